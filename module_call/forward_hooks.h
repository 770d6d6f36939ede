// Hooks around a module's forward at the module call point (PyTorch's
// Module.register_forward_pre_hook / register_forward_hook, where
// torch.distributed's composable fully_shard and checkpoint put their
// work). LibTorch modules have no forward hooks, so these run only where
// module_call::call (call.h) calls a module.
//
// This is the seam between features that act around a module's forward:
//   * FSDP registers pre-/post-forward hooks on every module it manages
//     (gather, reshard, arm the backward hooks) and before-rerun hooks
//     (gather again for a recomputation in backward);
//   * activation checkpointing registers a region runner on the modules it
//     checkpoints (their forward runs again in backward) and sets the
//     "inside a region that reruns" flag while such a forward runs.
// Neither feature includes the other.
//
//   module_call::HookHandle handle = module_call::register_forward_hooks(
//       block, {.pre_forward = [] { ... }, .post_forward = [](const auto&, bool) { ... }});
//   ...
//   handle.remove();
//
// Order: pre_forward hooks run in registration order, then forward (inside
// the region runner, if one is registered), then post_forward hooks in
// registration order, then map_tensor_output hooks in registration order. When a pre_forward hook
// or forward throws, the forward_failed hooks of the hooks whose pre_forward completed run (in
// reverse order) and the error propagates; post_forward does not run.
//
// Lifetimes: entries are keyed by the module and hold it weakly (a module
// destroyed and another allocated at its address has none). A hook runs on
// the thread that calls the module (before_rerun hooks: autograd's); it must
// not register or remove hooks of the module it runs for.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "module_call/tensor_function.h"

namespace torch {
namespace nn {
class Module;
}  // namespace nn
}  // namespace torch

namespace module_call {

// What one feature does around one module's forward. Every field may be
// empty.
struct ForwardHooks {
  // Before forward.
  std::function<void()> pre_forward;
  // Replaces each at::Tensor argument of forward (PyTorch's pre-hook
  // returning new args; FSDP's mixed precision casts floating-point inputs).
  std::function<at::Tensor(const at::Tensor&)> map_tensor_argument;
  // After forward, with the tensors it returned (`outputs_known` false when
  // it returned a type the call point cannot look into; see call.h).
  std::function<void(const std::vector<at::Tensor>& outputs, bool outputs_known)> post_forward;
  // Replaces each at::Tensor forward returned (PyTorch's forward hook
  // returning a new output; FSDP's output_dtype casts floating-point
  // outputs). Runs after every post_forward hook, in registration order,
  // each on the previous one's result; the caller gets the result. Only
  // reaches the tensors post_forward sees (at::Tensor, std::vector<at::Tensor>,
  // tuples and pairs of those; a Sequential child's at::Tensor, vector or
  // 2-/3-tuple); any other return type is returned unchanged.
  std::function<at::Tensor(const at::Tensor&)> map_tensor_output;
  // Forward threw after this pre_forward completed.
  std::function<void()> forward_failed;
  // The module's forward is about to run again inside a region that reruns
  // (recomputation in backward) ...
  std::function<void()> before_rerun;
  // ... and that rerun is about to be differentiated.
  std::function<void()> before_rerun_backward;
};

// PyTorch's RemovableHandle. Copyable; remove() is idempotent.
class HookHandle {
 public:
  HookHandle() = default;
  void remove();

 private:
  friend HookHandle register_forward_hooks(const std::shared_ptr<torch::nn::Module>&, ForwardHooks);
  HookHandle(const torch::nn::Module* module, uint64_t id) : module_(module), id_(id) {}
  const torch::nn::Module* module_ = nullptr;
  uint64_t id_ = 0;
};

// Adds `hooks` after the ones already registered on `module`.
HookHandle register_forward_hooks(const std::shared_ptr<torch::nn::Module>& module,
                                  ForwardHooks hooks);

// Runs the module's forward, given as a function of its tensor arguments,
// so that it can run again in backward (activation checkpointing). It must
// call the module's before_rerun hooks (run_before_rerun_hooks) before each
// rerun and its before_rerun_backward hooks before differentiating it.
using RegionRunner =
    std::function<std::vector<at::Tensor>(const std::shared_ptr<torch::nn::Module>& module,
                                          TensorFunction forward, std::vector<at::Tensor> inputs)>;

// At most one per module: setting it again replaces it. Error when `module`
// is null.
void set_region_runner(const std::shared_ptr<torch::nn::Module>& module, RegionRunner runner);
bool has_region_runner(const torch::nn::Module& module);

void run_before_rerun_hooks(const torch::nn::Module& module);
void run_before_rerun_backward_hooks(const torch::nn::Module& module);

// Whether this thread is inside a region that reruns: its first forward or
// its rerun in backward (FSDP refuses to run a unit there, whose forward
// would then run twice). Set by the region with RerunningRegion.
bool in_rerunning_region();

// RAII: in_rerunning_region() is true while one is alive on this thread.
class RerunningRegion {
 public:
  RerunningRegion();
  ~RerunningRegion();
  RerunningRegion(const RerunningRegion&) = delete;
  RerunningRegion& operator=(const RerunningRegion&) = delete;
};

namespace internal {

// What the call point reads for one call: a snapshot, unchanged by later
// registrations.
struct ModuleHooks {
  std::vector<std::pair<uint64_t, ForwardHooks>> forward;  // registration order
  RegionRunner region_runner;
};
// Null when `module` has neither hooks nor a region runner.
std::shared_ptr<const ModuleHooks> hooks_of(const torch::nn::Module& module);

}  // namespace internal
}  // namespace module_call
