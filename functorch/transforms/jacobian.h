#pragma once

// jacrev, jacfwd, hessian: whole Jacobians, as torch.func.
//
//   jacrev(f)   reverse mode: one vjp, vmapped over the standard basis of the
//               output space (one batched backward pass, not a loop).
//   jacfwd(f)   forward mode: jvp vmapped over the standard basis of the
//               input space.
//   hessian(f)  jacfwd(jacrev(f)).
//
//   auto J = functorch::jacrev([](torch::Tensor x) { return x.sin(); })(x);  // diag(cos x)
//   auto batched = functorch::vmap(functorch::jacrev(f))(xs);             // [B, n, n]
//   auto H = functorch::jacrev(functorch::jacrev(f))(x);
//
// The Jacobian of output leaf o w.r.t. input leaf i has shape
// o.shape + i.shape. Its tree: the output's structure, each leaf replaced by
// the derivative w.r.t. argument argnums (int argnums) or by a tuple of them
// (tuple argnums). With has_aux, f returns (output, aux) and the result is
// (jacobian, aux).

#include <utility>

#include "functorch/transforms/argnums.h"
#include "functorch/transforms/tree_fn.h"
#include "functorch/transforms/typed.h"
#include "functorch/transforms/vmap.h"

namespace functorch {

TreeFn jacrev(TreeFn f, Argnums argnums = 0, bool has_aux = false);
TreeFn jacfwd(TreeFn f, Argnums argnums = 0, bool has_aux = false,
              Randomness randomness = Randomness::kError);
TreeFn hessian(TreeFn f, Argnums argnums = 0);

template <class F>
auto jacrev(F f, Argnums argnums = 0, bool has_aux = false) {
  auto transform = [argnums = std::move(argnums), has_aux](const TreeFn& g) {
    return jacrev(g, argnums, has_aux);
  };
  return internal::Typed<F, decltype(transform), internal::AsTree>(std::move(f),
                                                                   std::move(transform));
}

template <class F>
auto jacfwd(F f, Argnums argnums = 0, bool has_aux = false,
            Randomness randomness = Randomness::kError) {
  auto transform = [argnums = std::move(argnums), has_aux, randomness](const TreeFn& g) {
    return jacfwd(g, argnums, has_aux, randomness);
  };
  return internal::Typed<F, decltype(transform), internal::AsTree>(std::move(f),
                                                                   std::move(transform));
}

template <class F>
auto hessian(F f, Argnums argnums = 0) {
  auto transform = [argnums = std::move(argnums)](const TreeFn& g) { return hessian(g, argnums); };
  return internal::Typed<F, decltype(transform), internal::AsTree>(std::move(f),
                                                                   std::move(transform));
}

}  // namespace functorch
