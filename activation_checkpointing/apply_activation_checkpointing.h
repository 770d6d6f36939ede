// apply_activation_checkpointing (PyTorch's
// torch.distributed.algorithms._checkpoint.checkpoint_wrapper
// .apply_activation_checkpointing): checkpoint the submodules a policy
// chooses, typically each transformer block, so their activations are
// recomputed in backward instead of kept.
//
//   activation_checkpointing::apply_activation_checkpointing(
//       model, module_call::module_type_auto_wrap_policy<BlockImpl>());
//   // then, as before: module_call::call(block, x) in the parent's forward,
//   // FullyShardedDataParallel (any strategy) or no FSDP at all.
//
// The policy vocabulary is FSDP's auto-wrap one (module_call/wrap_policy.h:
// by type, by size, custom), asked the same way: post-order over the tree,
// never the root, each module with the parameters in its subtree that no
// deeper chosen module took.
//
// Nothing is inserted into the module tree (PyTorch inserts a
// CheckpointWrapper and strips its `_checkpoint_wrapped_module.` prefix from
// names again): a chosen module gets a region runner at the module call
// point (module_call/forward_hooks.h), so parameter and buffer names and
// every state dict stay exactly the unwrapped model's.
//
// Where it takes effect. LibTorch has no forward hooks, so a chosen module
// is checkpointed where module_call::call(module, args...) runs it, including
// the children of a torch::nn::Sequential called through it or wrapped by
// FSDP. A direct module->forward(x) or sequential->forward(x) cannot be seen
// and runs without checkpointing. The module's parameters are the region's
// declared tensors (see checkpoint.h); its forward must return at::Tensor,
// std::vector<at::Tensor> or a tuple of tensors, with tensor arguments
// (others are copied).
//
// With FSDP: a checkpointed unit is gathered again for its recomputation in
// backward (FSDP's pre-backward gathers it, as for any unit, before the
// recomputation needs it) and resharded after its gradient is reduced;
// prefetching follows the same recorded order. A module containing FSDP
// units cannot be checkpointed (its recomputation would have to run other
// units' forward inside backward): an error says to checkpoint the units.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <string>
#include <vector>

#include "module_call/wrap_policy.h"

namespace activation_checkpointing {

// Checkpoints the submodules of `model` that `policy` chooses and returns
// their names (relative to `model`, in the order chosen). Applying it again
// is harmless. Error when `model` is null or `policy` is empty.
std::vector<std::string> apply_activation_checkpointing(
    const std::shared_ptr<torch::nn::Module>& model, const module_call::AutoWrapPolicy& policy);

template <typename ModuleImpl>
std::vector<std::string> apply_activation_checkpointing(
    const torch::nn::ModuleHolder<ModuleImpl>& model, const module_call::AutoWrapPolicy& policy) {
  return apply_activation_checkpointing(std::static_pointer_cast<torch::nn::Module>(model.ptr()),
                                        policy);
}

// Whether apply_activation_checkpointing chose `module`.
bool is_checkpointed(const torch::nn::Module& module);

}  // namespace activation_checkpointing
