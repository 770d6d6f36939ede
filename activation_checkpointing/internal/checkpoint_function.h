// The machinery behind checkpoint() and checkpointed modules: the autograd
// node that recomputes a region in backward. Private to this package; the
// function-of-tensors glue is module_call/tensor_function.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

#include "module_call/tensor_function.h"

namespace activation_checkpointing {
namespace internal {

// What a region reads besides its tensor arguments, and what must happen
// before it is recomputed.
struct Declared {
  // Tensors the region reads that may need gradients (a module's
  // parameters). Called before the forward and after each recomputation,
  // which may see other tensor objects in the same order and shapes (FSDP
  // points the module at fresh views of the re-gathered flat parameter);
  // the gradients with respect to the recomputation's tensors are returned
  // for the forward's.
  std::function<std::vector<at::Tensor>()> params;
  // Runs before each recomputation (FSDP: gather the owning unit again and
  // point the module at its unsharded views).
  std::function<void()> before_recompute;
  // Runs after each recomputation, before it is differentiated: where the
  // region's memory peaks (its activations and their gradients alive
  // together). FSDP finishes the gradient reductions still in flight there,
  // so their buffers are not alive at that peak.
  std::function<void()> before_backward;
  // Names the region in messages ("module blocks.0 (BlockImpl)").
  std::string what = "checkpoint";
};

// A region as a function of its tensor inputs, returning its outputs.
using Region = module_call::TensorFunction;

// Runs `region(inputs)` checkpointed (see checkpoint.h); returns its outputs,
// connected to the graph through one recomputing node.
std::vector<at::Tensor> run_checkpointed(Region region, std::vector<at::Tensor> inputs,
                                         Declared declared, bool preserve_rng_state);

}  // namespace internal
}  // namespace activation_checkpointing
