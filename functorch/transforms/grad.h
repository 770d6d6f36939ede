#pragma once

// grad and grad_and_value: reverse-mode gradients of a scalar function, as
// torch.func.grad / grad_and_value. They nest (grad(grad(sin))) and compose
// with vmap (vmap(grad(loss)) gives per-sample gradients).
//
//   auto cos_x = functorch::grad([](torch::Tensor x) { return x.sin(); })(x);
//   auto neg_sin_x = functorch::grad(functorch::grad(
//       [](torch::Tensor x) { return x.sin(); }))(x);
//
// `f` must return a 0-dim Tensor, or with has_aux=true a 2-tuple
// (0-dim Tensor, aux tree of tensors). Arguments selected by argnums may be
// pytrees of tensors; the gradient has the same structure.
//
// Results:
//   grad            grads                       (has_aux: (grads, aux))
//   grad_and_value  (grads, value)              (has_aux: (grads, (value, aux)))
// where grads is the gradient w.r.t. argument argnums (int) or a tuple of
// them (tuple argnums).
//
// Errors keep Python's wording: non-Tensor output, output with dims,
// argnums out of range / empty / repeated, has_aux output not a 2-tuple,
// a differentiated argument that is not a tensor.

#include <utility>

#include "functorch/transforms/argnums.h"
#include "functorch/transforms/tree_fn.h"
#include "functorch/transforms/typed.h"

namespace functorch {

TreeFn grad(TreeFn f, Argnums argnums = 0, bool has_aux = false);
TreeFn grad_and_value(TreeFn f, Argnums argnums = 0, bool has_aux = false);

template <class F>
auto grad(F f, Argnums argnums = 0, bool has_aux = false) {
  auto transform = [argnums = std::move(argnums), has_aux](const TreeFn& g) {
    return grad(g, argnums, has_aux);
  };
  return internal::Typed<F, decltype(transform), internal::AsTree>(std::move(f),
                                                                   std::move(transform));
}

template <class F>
auto grad_and_value(F f, Argnums argnums = 0, bool has_aux = false) {
  auto transform = [argnums = std::move(argnums), has_aux](const TreeFn& g) {
    return grad_and_value(g, argnums, has_aux);
  };
  return internal::Typed<F, decltype(transform), internal::AsTree>(std::move(f),
                                                                   std::move(transform));
}

}  // namespace functorch
