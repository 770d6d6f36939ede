#pragma once

// vjp: vector-Jacobian products, as torch.func.vjp.
//
//   auto [out, vjp_fn] = functorch::vjp(f, x, y);       // out = f(x, y)
//   auto [dx, dy] = vjp_fn(ct);                         // one per primal
//   auto [out, vjp_fn, aux] = functorch::vjp(g, x, functorch::has_aux);
//
// vjp(f, primals...) runs f once, recording the graph under a Grad level,
// and returns the output together with vjp_fn, which maps cotangents (same
// tree structure as the output) to the products with respect to every
// primal. vjp_fn may be called many times, and under vmap (that is how
// jacrev computes whole Jacobians). With has_aux, f returns (output, aux);
// aux is returned undifferentiated.
//
// Typed results (the callable's own types, as vmap keeps them):
//   output   f's return type; with has_aux, the first element of f's
//            std::pair / 2-tuple (Tree when f returns a Tree or IValue).
//   vjp_fn   VjpFn: vjp_fn(ct) takes one cotangent tree shaped like the
//            output; vjp_fn(ct0, ct1, ...) stands for vjp_fn((ct0, ct1, ...))
//            when f returns a tuple. It returns a std::tuple with one product
//            per primal, typed as the primal (a NamedTensors primal gets a
//            NamedTensors of products, in its key order).
//   aux      the second element's type.
//
// The pytree form takes and returns IValue trees: vjp(tree_fn, {x, y},
// /*has_aux=*/true) -> VjpResult.

#include <optional>

#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "functorch/transforms/argnums.h"
#include "functorch/transforms/has_aux.h"
#include "functorch/transforms/tree_fn.h"
#include "functorch/transforms/typed.h"

namespace functorch {

struct VjpResult {
  Tree output;
  // cotangents -> tuple of products (one per primal, or per argnums entry).
  std::function<Tree(const Tree& cotangents)> vjp_fn;
  Tree aux;  // None unless has_aux
};

VjpResult vjp(const TreeFn& f, const std::vector<c10::IValue>& primals, bool has_aux = false);

namespace internal {
// vjp restricted to the primals in `argnums` (jacrev's building block);
// nullopt means all of them.
VjpResult vjp_with_argnums(const TreeFn& f, const std::vector<c10::IValue>& primals,
                           const std::optional<Argnums>& argnums, bool has_aux);
}  // namespace internal

// The typed vjp_fn: cotangents -> std::tuple<Primals...> of products.
template <class... Primals>
class VjpFn {
 public:
  explicit VjpFn(std::function<Tree(const Tree&)> fn) : fn_(std::move(fn)) {}

  template <class... Cotangents>
  std::tuple<Primals...> operator()(const Cotangents&... cotangents) const {
    static_assert(sizeof...(Cotangents) > 0, "vjp_fn(cotangents): no cotangents given");
    c10::IValue tree;
    if constexpr (sizeof...(Cotangents) == 1) {
      tree = to_ivalue(cotangents...);
    } else {
      tree = c10::ivalue::Tuple::create(std::vector<c10::IValue>{to_ivalue(cotangents)...});
    }
    return IValueConvert<std::tuple<Primals...>>::from(fn_(tree).ivalue());
  }

 private:
  std::function<Tree(const Tree&)> fn_;
};

template <class Output, class... Primals>
struct TypedVjpResult {
  Output output;
  VjpFn<Primals...> vjp_fn;
};

template <class Output, class Aux, class... Primals>
struct TypedVjpResultWithAux {
  Output output;
  VjpFn<Primals...> vjp_fn;
  Aux aux;
};

namespace internal {

template <class... Args>
constexpr bool ends_with_has_aux() {
  if constexpr (sizeof...(Args) == 0) {
    return false;
  } else {
    return std::is_same<
        std::tuple_element_t<sizeof...(Args) - 1, std::tuple<std::decay_t<Args>...>>,
        HasAux>::value;
  }
}

template <bool kHasAux, class F, class... Args>
auto typed_vjp(const F& f, const Args&... primals) {
  static_assert(sizeof...(Args) > 0, "vjp(f, *primals): no primals given");
  using R = typed_result_t<F, Args...>;
  TreeFn tree_f = as_tree_fn<F, canonical_t<Args>...>(&f);
  VjpResult r = vjp_with_argnums(tree_f, std::vector<c10::IValue>{to_ivalue(primals)...},
                                 std::nullopt, kHasAux);
  VjpFn<canonical_t<Args>...> vjp_fn(std::move(r.vjp_fn));
  if constexpr (kHasAux) {
    using Output = typename AuxSplit<R>::output;
    using Aux = typename AuxSplit<R>::aux;
    return TypedVjpResultWithAux<Output, Aux, canonical_t<Args>...>{
        IValueConvert<Output>::from(r.output.ivalue()), std::move(vjp_fn),
        IValueConvert<Aux>::from(r.aux.ivalue())};
  } else {
    return TypedVjpResult<R, canonical_t<Args>...>{IValueConvert<R>::from(r.output.ivalue()),
                                                   std::move(vjp_fn)};
  }
}

template <class F, class ArgsTuple, size_t... I>
auto typed_vjp_with_aux(const F& f, const ArgsTuple& args, std::index_sequence<I...>) {
  return typed_vjp<true>(f, std::get<I>(args)...);
}

}  // namespace internal

// vjp(f, primals...) or vjp(f, primals..., functorch::has_aux).
template <class F, class... Args>
auto vjp(const F& f, const Args&... args) {
  if constexpr (internal::ends_with_has_aux<Args...>()) {
    return internal::typed_vjp_with_aux(f, std::forward_as_tuple(args...),
                                        std::make_index_sequence<sizeof...(Args) - 1>{});
  } else {
    return internal::typed_vjp<false>(f, args...);
  }
}

}  // namespace functorch
