#pragma once

// has_aux for the typed vjp and jvp, Python's `has_aux=True`:
//
//   auto [out, vjp_fn, aux] = functorch::vjp(f, x, y, functorch::has_aux);
//   auto [out, jvp_out, aux] = functorch::jvp(f, std::make_tuple(x),
//                                             std::make_tuple(t),
//                                             functorch::has_aux);
//
// f then returns (output, aux): aux is returned as computed, not
// differentiated. A tag rather than a bool because the result has a
// different arity (and type) with it, as in Python. grad, grad_and_value,
// jacrev and jacfwd take `bool has_aux` (their results are a Tree either way).

#include <tuple>
#include <utility>

#include "functorch/transforms/typed.h"

namespace functorch {

struct HasAux {
  explicit constexpr HasAux() = default;
};
inline constexpr HasAux has_aux{};

namespace internal {

// Splits the return type of a has_aux function into (output, aux) types.
template <class R>
struct AuxSplit {  // not statically a pair: checked at run time
  using output = Tree;
  using aux = Tree;
};
template <class A, class B>
struct AuxSplit<std::pair<A, B>> {
  using output = A;
  using aux = B;
};
template <class A, class B>
struct AuxSplit<std::tuple<A, B>> {
  using output = A;
  using aux = B;
};

}  // namespace internal

}  // namespace functorch
