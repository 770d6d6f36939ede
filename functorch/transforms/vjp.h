#pragma once

// vjp: vector-Jacobian products, as torch.func.vjp.
//
//   functorch::VjpResult r = functorch::vjp(f, x, y);  // typed, no aux
//   functorch::Tree grads = r.vjp_fn(cotangents);       // tuple: one per primal
//   torch::Tensor dx = grads[0];
//
// has_aux: the pytree form, vjp(tree_fn, {x, y}, /*has_aux=*/true).
//
// vjp(f, primals...) runs f once, recording the graph under a Grad level,
// and returns the output together with vjp_fn, which maps cotangents (same
// tree structure as the output) to the tuple of products with respect to
// every primal. vjp_fn may be called many times, and under vmap (that is how
// jacrev computes whole Jacobians).
//
// With has_aux, f returns (output, aux); aux is returned undifferentiated.

#include <c10/util/Optional.h>

#include <functional>
#include <utility>
#include <vector>

#include "functorch/transforms/argnums.h"
#include "functorch/transforms/tree_fn.h"
#include "functorch/transforms/typed.h"

namespace functorch {

struct VjpResult {
  Tree output;
  // cotangents -> tuple of products (one per primal, or per argnums entry).
  // Accepts a Tree (any typed.h value converts via to_ivalue).
  std::function<Tree(const Tree& cotangents)> vjp_fn;
  Tree aux;  // None unless has_aux
};

VjpResult vjp(const TreeFn& f, const std::vector<c10::IValue>& primals,
              bool has_aux = false);

namespace internal {
// vjp restricted to the primals in `argnums` (jacrev's building block);
// nullopt means all of them.
VjpResult vjp_with_argnums(const TreeFn& f,
                           const std::vector<c10::IValue>& primals,
                           const c10::optional<Argnums>& argnums,
                           bool has_aux);
}  // namespace internal

template <class F, class... Args>
VjpResult vjp(const F& f, const Args&... primals) {
  static_assert(sizeof...(Args) > 0, "vjp(f, *primals): no primals given");
  TreeFn tree_f = internal::as_tree_fn<F, Args...>(&f);
  return vjp(tree_f, std::vector<c10::IValue>{to_ivalue(primals)...});
}

}  // namespace functorch
