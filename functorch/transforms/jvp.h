#pragma once

// jvp: Jacobian-vector products by forward-mode AD, as torch.func.jvp.
//
//   auto [out, jvp_out] = functorch::jvp(f, std::make_tuple(x), std::make_tuple(t));
//   // out = f(x), jvp_out = J_f(x) t
//   auto [out, jvp_out, aux] = functorch::jvp(g, std::make_tuple(x),
//                                             std::make_tuple(t),
//                                             functorch::has_aux);
//
// The pytree form takes vectors of IValues: jvp(tree_fn, {x}, {t}) ->
// JvpResult.
//
// Primals and tangents are trees of the same structure (one entry per
// positional argument of f). f runs once on dual tensors
// (at::_make_dual / at::_unpack_dual) under a Jvp level of the DynamicLayer
// stack, so jvp nests and composes with vmap and grad. With strict=true an
// output independent of the inputs is an error; otherwise its tangent is
// zeros. With has_aux, f returns (output, aux) and aux is returned as
// computed. Typed results keep f's types: output and jvp_out have f's
// return type (with has_aux, the first element of its pair / 2-tuple; Tree
// when that is not static), aux the second element's.

#include <optional>

#include <tuple>
#include <vector>

#include "functorch/transforms/argnums.h"
#include "functorch/transforms/has_aux.h"
#include "functorch/transforms/tree_fn.h"
#include "functorch/transforms/typed.h"

namespace functorch {

struct JvpResult {
  Tree output;
  Tree tangent;
  Tree aux;  // None unless has_aux
};

JvpResult jvp(const TreeFn& f, const std::vector<c10::IValue>& primals,
              const std::vector<c10::IValue>& tangents, bool strict = false, bool has_aux = false);

namespace internal {
// jvp where only the primals in `argnums` carry tangents (jacfwd's building
// block): `tangents` then has one entry per argnums entry (a single tree for
// an int argnums).
JvpResult jvp_with_argnums(const TreeFn& f, const std::vector<c10::IValue>& primals,
                           const c10::IValue& tangents, const std::optional<Argnums>& argnums,
                           bool strict, bool has_aux);
}  // namespace internal

template <class Output>
struct TypedJvpResult {
  Output output;
  Output jvp_out;  // J_f(primals) tangents, shaped like the output
};

template <class Output, class Aux>
struct TypedJvpResultWithAux {
  Output output;
  Output jvp_out;
  Aux aux;
};

namespace internal {

template <bool kHasAux, class F, class... P, class... T>
auto typed_jvp(const F& f, const std::tuple<P...>& primals, const std::tuple<T...>& tangents,
               bool strict) {
  static_assert(sizeof...(P) == sizeof...(T),
                "jvp(f, primals, tangents): primals and tangents must have "
                "the same number of entries");
  using R = typed_result_t<F, P...>;
  TreeFn tree_f = as_tree_fn<F, canonical_t<P>...>(&f);
  auto to_vector = [](const c10::IValue& tuple) { return tuple.toTupleRef().elements().vec(); };
  JvpResult r = jvp_with_argnums(tree_f, to_vector(to_ivalue(primals)), to_ivalue(tangents),
                                 std::nullopt, strict, kHasAux);
  if constexpr (kHasAux) {
    using Output = typename AuxSplit<R>::output;
    using Aux = typename AuxSplit<R>::aux;
    return TypedJvpResultWithAux<Output, Aux>{IValueConvert<Output>::from(r.output.ivalue()),
                                              IValueConvert<Output>::from(r.tangent.ivalue()),
                                              IValueConvert<Aux>::from(r.aux.ivalue())};
  } else {
    return TypedJvpResult<R>{IValueConvert<R>::from(r.output.ivalue()),
                             IValueConvert<R>::from(r.tangent.ivalue())};
  }
}

}  // namespace internal

// Typed form: primals and tangents as std::tuples, e.g.
//   functorch::jvp(f, std::make_tuple(x, y), std::make_tuple(tx, ty));
template <class F, class... P, class... T>
auto jvp(const F& f, const std::tuple<P...>& primals, const std::tuple<T...>& tangents,
         bool strict = false) {
  return internal::typed_jvp<false>(f, primals, tangents, strict);
}

// jvp(f, primals, tangents, functorch::has_aux[, strict]).
template <class F, class... P, class... T>
auto jvp(const F& f, const std::tuple<P...>& primals, const std::tuple<T...>& tangents, HasAux,
         bool strict = false) {
  return internal::typed_jvp<true>(f, primals, tangents, strict);
}

}  // namespace functorch
