// Activation checkpointing (PyTorch's torch.utils.checkpoint.checkpoint with
// use_reentrant=False semantics): run a function without keeping the
// activations backward would need, and run it again in backward to get them.
//
//   auto y = activation_checkpointing::checkpoint(
//       [&](const at::Tensor& x) { return fc2(torch::relu(fc1(x))); }, x);
//
// Forward runs `fn` under no-grad, so only the tensor arguments are kept
// (saved for backward) and the outputs are tied to the graph by one node;
// backward re-runs `fn` on detached copies of them with grad enabled and
// differentiates the recomputation with respect to the arguments and the
// declared parameters. The default CPU generator's state is saved before the
// forward and restored around the recomputation (preserve_rng_state), so
// dropout draws the same masks and gradients equal the uncheckpointed ones
// bitwise on the CPU.
//
// What fn may read. Tensors that need gradients must reach fn as its
// arguments, or be declared: checkpoint() declares none, and
// apply_activation_checkpointing (apply_activation_checkpointing.h) declares
// the module's parameters. The recomputed graph is checked in backward: an
// undeclared tensor requiring grad that fn closed over (a module parameter
// read through a lambda capture) is an error naming the fix, never a
// silently missing gradient.
//
// Arguments: at::Tensor arguments become the region's inputs; any other
// argument is copied and passed again unchanged in the recomputation.
// fn returns at::Tensor, std::vector<at::Tensor> or std::tuple of tensors.
//
// Errors: grad enabled but no tensor argument requires grad (PyTorch warns
// "None of the inputs have requires_grad=True. Gradients will be None";
// here the outputs could only depend on closed-over tensors, which this
// implementation cannot see, so it refuses); a second backward through a
// region whose saved inputs were freed (LibTorch's "Trying to backward
// through the graph a second time"; retain_graph=true keeps them and each
// backward recomputes); create_graph=true (double backward) through a
// region. With grad disabled, fn simply runs.
//
// Nesting works: an inner checkpoint runs plainly inside the outer region's
// no-grad forward and checkpoints itself in the outer recomputation.
//
// Side effects in fn happen twice (once more in backward): buffers updated
// in forward (BatchNorm running statistics) are updated again, as in PyTorch.
#pragma once

#include <ATen/core/Tensor.h>

#include <type_traits>
#include <utility>
#include <vector>

#include "activation_checkpointing/internal/checkpoint_function.h"
#include "module_call/tensor_function.h"

namespace activation_checkpointing {

struct CheckpointOptions {
  // Restore the CPU generator's state from before the forward around the
  // recomputation (PyTorch's preserve_rng_state). false: the recomputation
  // draws fresh random numbers (dropout masks differ from the forward's).
  bool preserve_rng_state = true;
};

template <typename Fn, typename... Args>
auto checkpoint(const CheckpointOptions& options, Fn&& fn, Args&&... args) {
  using Out = module_call::tensor_function_output_t<Fn, Args...>;
  std::vector<at::Tensor> inputs = module_call::tensor_arguments(args...);
  module_call::TensorFunction region =
      module_call::as_tensor_function(std::forward<Fn>(fn), std::forward<Args>(args)...);
  return module_call::from_tensors<Out>(internal::run_checkpointed(
      std::move(region), std::move(inputs), internal::Declared(), options.preserve_rng_state));
}

template <typename Fn, typename... Args,
          typename = std::enable_if_t<!std::is_same<std::decay_t<Fn>, CheckpointOptions>::value>>
auto checkpoint(Fn&& fn, Args&&... args) {
  return checkpoint(CheckpointOptions(), std::forward<Fn>(fn), std::forward<Args>(args)...);
}

}  // namespace activation_checkpointing
