#pragma once

// jvp: Jacobian-vector products by forward-mode AD, as torch.func.jvp.
//
//   auto r = functorch::jvp(f, std::make_tuple(x), std::make_tuple(t));
//   // r.output = f(x), r.tangent = J_f(x) t
//
// The pytree form takes vectors of IValues: jvp(tree_fn, {x}, {t}).
//
// Primals and tangents are trees of the same structure (one entry per
// positional argument of f). f runs once on dual tensors
// (at::_make_dual / at::_unpack_dual) under a Jvp level of the DynamicLayer
// stack, so jvp nests and composes with vmap and grad. With strict=true an
// output independent of the inputs is an error; otherwise its tangent is
// zeros. With has_aux, f returns (output, aux).

#include <c10/util/Optional.h>

#include <tuple>
#include <vector>

#include "functorch/transforms/argnums.h"
#include "functorch/transforms/tree_fn.h"
#include "functorch/transforms/typed.h"

namespace functorch {

struct JvpResult {
  Tree output;
  Tree tangent;
  Tree aux;  // None unless has_aux
};

JvpResult jvp(const TreeFn& f, const std::vector<c10::IValue>& primals,
              const std::vector<c10::IValue>& tangents, bool strict = false,
              bool has_aux = false);

namespace internal {
// jvp where only the primals in `argnums` carry tangents (jacfwd's building
// block): `tangents` then has one entry per argnums entry (a single tree for
// an int argnums).
JvpResult jvp_with_argnums(const TreeFn& f,
                           const std::vector<c10::IValue>& primals,
                           const c10::IValue& tangents,
                           const c10::optional<Argnums>& argnums, bool strict,
                           bool has_aux);
}  // namespace internal

// Typed form: primals and tangents as std::tuples, e.g.
//   functorch::jvp(f, std::make_tuple(x, y), std::make_tuple(tx, ty));
template <class F, class... P, class... T>
JvpResult jvp(const F& f, const std::tuple<P...>& primals,
              const std::tuple<T...>& tangents, bool strict = false) {
  static_assert(sizeof...(P) == sizeof...(T),
                "jvp(f, primals, tangents): primals and tangents must have "
                "the same number of entries");
  TreeFn tree_f = internal::as_tree_fn<F, P...>(&f);
  auto to_vector = [](const c10::IValue& tuple) {
    return tuple.toTupleRef().elements().vec();
  };
  return jvp(tree_f, to_vector(to_ivalue(primals)),
             to_vector(to_ivalue(tangents)), strict);
}

}  // namespace functorch
