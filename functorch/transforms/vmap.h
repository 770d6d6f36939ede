#pragma once

// vmap: the vectorizing map of torch.func, on ATen's functorch engine.
//
// vmap(f) returns a function that maps `f` over a dimension of its inputs.
// The map is pushed into the operators `f` calls (BatchedTensor + batching
// rules); it is not a loop over examples.
//
//   auto batched_dot = functorch::vmap(torch::dot);          // [N,D],[N,D] -> [N]
//   auto nested = functorch::vmap(functorch::vmap(torch::dot));  // [N1,N0,D] -> [N1,N0]
//   auto one_side = functorch::vmap(torch::dot, {0, std::nullopt});  // [N,D],[D] -> [N]
//
// Arguments:
//   in_dims    per input leaf, the dim to map over (None: not mapped). A
//              single dim broadcasts; otherwise a tree matching the
//              arguments (a tuple with one entry per argument). Negative
//              dims count from the end.
//   out_dims   per output leaf, where the mapped dim goes. None passes an
//              output through unmapped -- the way to return non-tensors, as
//              in torch.func.
//   randomness error: random ops inside f throw; different: each example
//              draws its own numbers; same: one draw shared by the batch.
//   chunk_size None: one vmap over the whole batch; k: vmap k examples at a
//              time and concatenate (same results, lower peak memory; with
//              randomness=same every chunk replays the same RNG state).
//
// Errors (ValueError in Python; c10::Error here) keep PyTorch's wording:
// no inputs, in_dims incompatible with the inputs, in_dim for a non-tensor,
// in_dim out of range, inconsistent batch sizes, no tensor to map over,
// out_dims incompatible with the outputs, a non-tensor output with an int
// out_dim, chunk_size <= 0, unknown randomness.

#include <optional>

#include <string>
#include <utility>

#include "functorch/transforms/pytree.h"
#include "functorch/transforms/tree_fn.h"
#include "functorch/transforms/typed.h"

namespace functorch {

enum class Randomness { kError, kDifferent, kSame };

// "error" | "different" | "same"; anything else throws with Python's message.
Randomness parse_randomness(const std::string& randomness);

// The pytree form: `f` takes and returns IValue trees.
TreeFn vmap(TreeFn f, DimTree in_dims = 0, DimTree out_dims = 0,
            Randomness randomness = Randomness::kError,
            std::optional<int64_t> chunk_size = std::nullopt);

namespace internal {
// Argument checks Python performs when vmap(...) is called, before any input.
void check_vmap_args(const std::optional<int64_t>& chunk_size);
}  // namespace internal

// The typed form: any callable over the types typed.h supports; the result
// keeps the callable's return type.
template <class F>
auto vmap(F f, DimTree in_dims = 0, DimTree out_dims = 0,
          Randomness randomness = Randomness::kError,
          std::optional<int64_t> chunk_size = std::nullopt) {
  internal::check_vmap_args(chunk_size);
  auto transform = [in_dims = std::move(in_dims), out_dims = std::move(out_dims), randomness,
                    chunk_size](const TreeFn& g) {
    return vmap(g, in_dims, out_dims, randomness, chunk_size);
  };
  return internal::Typed<F, decltype(transform), internal::SameType>(std::move(f),
                                                                     std::move(transform));
}

}  // namespace functorch
