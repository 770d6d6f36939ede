#pragma once

// The typed convenience layer: lets ordinary C++ callables go through the
// pytree transforms so that simple calls read like Python:
//
//   auto batched_dot = functorch::vmap(torch::dot);
//   torch::Tensor y = batched_dot(a, b);
//   torch::Tensor g = functorch::grad([](torch::Tensor x) { return x.sin().sum(); })(x);
//
// Arguments and results cross the transform as IValues. Supported C++ types:
// at::Tensor, c10::IValue, Tree, double/float, integers, bool, std::string,
// std::vector<T>, std::tuple<T...>, std::pair<A, B>, NamedTensors (and any
// torch::OrderedDict<std::string, T>), std::map<std::string, T>,
// std::optional<T>.
//
// One dict type: NamedTensors -- what named_parameters() returns and
// functional_call takes -- crosses a transform as a dict in its own insertion
// order, and a dict result converts back to NamedTensors, so parameters and
// gradients flow between functional_call and the transforms unconverted:
//
//   auto loss = [&](functorch::NamedTensors p, torch::Tensor x) {
//     return functorch::functional_call(model, p, x).sum();
//   };
//   functorch::NamedTensors g = functorch::grad(loss)(params, x);
//   torch::Tensor y = functorch::functional_call(model, g, x);
//
// A std::map<std::string, T> argument is accepted and converted: the callable
// receives it as torch::OrderedDict<std::string, T> (NamedTensors for
// tensors), in the map's (sorted) order. Callables therefore take dicts as
// NamedTensors, never as std::map.
//
// The wrapped callable is invoked with the caller's argument types (dicts
// as above), so generic lambdas work and a transform's output type can
// differ from its input types. Results of vmap keep the callable's return
// type; results of grad and the Jacobians (whose structure depends on runtime
// argnums) are a Tree, which converts implicitly to at::Tensor,
// std::vector<at::Tensor>, NamedTensors and std::tuple<...>.

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/ordered_dict.h>

#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "functorch/transforms/tree_fn.h"

namespace functorch {

// A dict of named tensors in insertion order: named_parameters()'s type, and
// the one functional_call takes (functorch/module/functional_call.h declares
// the same alias).
using NamedTensors = torch::OrderedDict<std::string, at::Tensor>;

template <class T, class Enable = void>
struct IValueConvert;

// A pytree result whose C++ type is only known at run time.
class Tree {
 public:
  Tree() = default;
  Tree(c10::IValue value) : value_(std::move(value)) {}  // NOLINT: implicit
  Tree(const at::Tensor& tensor) : value_(tensor) {}     // NOLINT: implicit

  const c10::IValue& ivalue() const { return value_; }
  at::Tensor tensor() const;
  // Element of a tuple or list result (e.g. grad with argnums={0, 1}); on a
  // tensor leaf, the tensor's row `index` (tree["w"][2] is row 2 of w).
  Tree operator[](size_t index) const;
  // Value of a dict result.
  Tree operator[](const std::string& key) const;
  size_t size() const;

  template <class T>
  T to() const {
    return IValueConvert<T>::from(value_);
  }

  operator at::Tensor() const { return tensor(); }  // NOLINT: implicit
  operator std::vector<at::Tensor>() const {        // NOLINT
    return to<std::vector<at::Tensor>>();
  }
  // A dict result (grad w.r.t. a NamedTensors argument), keys in order.
  operator NamedTensors() const { return to<NamedTensors>(); }  // NOLINT
  template <class... Ts>
  operator std::tuple<Ts...>() const {  // NOLINT
    return to<std::tuple<Ts...>>();
  }

 private:
  c10::IValue value_;
};

template <>
struct IValueConvert<c10::IValue> {
  static c10::IValue to(const c10::IValue& v) { return v; }
  static c10::IValue from(const c10::IValue& v) { return v; }
};

template <>
struct IValueConvert<Tree> {
  static c10::IValue to(const Tree& v) { return v.ivalue(); }
  static Tree from(const c10::IValue& v) { return Tree(v); }
};

template <>
struct IValueConvert<at::Tensor> {
  static c10::IValue to(const at::Tensor& v) { return v; }
  static at::Tensor from(const c10::IValue& v) {
    TORCH_CHECK(v.isTensor(), "functorch: expected a Tensor, got ", v.tagKind());
    return v.toTensor();
  }
};

template <class T>
struct IValueConvert<T, std::enable_if_t<std::is_floating_point<T>::value>> {
  static c10::IValue to(T v) { return static_cast<double>(v); }
  static T from(const c10::IValue& v) { return static_cast<T>(v.toDouble()); }
};

template <>
struct IValueConvert<bool> {
  static c10::IValue to(bool v) { return v; }
  static bool from(const c10::IValue& v) { return v.toBool(); }
};

template <class T>
struct IValueConvert<
    T, std::enable_if_t<std::is_integral<T>::value && !std::is_same<T, bool>::value>> {
  static c10::IValue to(T v) { return static_cast<int64_t>(v); }
  static T from(const c10::IValue& v) { return static_cast<T>(v.toInt()); }
};

template <>
struct IValueConvert<std::string> {
  static c10::IValue to(const std::string& v) { return v; }
  static std::string from(const c10::IValue& v) { return v.toStringRef(); }
};

template <class T>
struct IValueConvert<std::optional<T>> {
  static c10::IValue to(const std::optional<T>& v) {
    return v.has_value() ? IValueConvert<T>::to(*v) : c10::IValue();
  }
  static std::optional<T> from(const c10::IValue& v) {
    if (v.isNone()) return std::nullopt;
    return IValueConvert<T>::from(v);
  }
};

template <class T>
struct IValueConvert<std::vector<T>> {
  static c10::IValue to(const std::vector<T>& v) {
    if constexpr (std::is_same<T, at::Tensor>::value) {
      return c10::IValue(v);  // a List[Tensor], as torch.jit would build
    } else {
      c10::impl::GenericList list(c10::AnyType::get());
      for (const auto& e : v) list.push_back(IValueConvert<T>::to(e));
      return list;
    }
  }
  static std::vector<T> from(const c10::IValue& v) {
    std::vector<T> out;
    if (v.isTuple()) {
      for (const auto& e : v.toTupleRef().elements()) {
        out.push_back(IValueConvert<T>::from(e));
      }
      return out;
    }
    TORCH_CHECK(v.isList(), "functorch: expected a list or tuple, got ", v.tagKind());
    auto list = v.toList();
    for (size_t i = 0; i < list.size(); ++i) {
      out.push_back(IValueConvert<T>::from(list.get(i)));
    }
    return out;
  }
};

template <class T>
struct IValueConvert<torch::OrderedDict<std::string, T>> {
  static c10::IValue to(const torch::OrderedDict<std::string, T>& v) {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    for (const auto& item : v) {
      dict.insert(item.key(), IValueConvert<T>::to(item.value()));
    }
    return dict;
  }
  static torch::OrderedDict<std::string, T> from(const c10::IValue& v) {
    TORCH_CHECK(v.isGenericDict(), "functorch: expected a dict, got ", v.tagKind());
    torch::OrderedDict<std::string, T> out;
    const auto dict = v.toGenericDict();
    out.reserve(dict.size());
    for (const auto& kv : dict) {  // c10::Dict keeps insertion order
      out.insert(kv.key().toStringRef(), IValueConvert<T>::from(kv.value()));
    }
    return out;
  }
};

template <class T>
struct IValueConvert<std::map<std::string, T>> {
  static c10::IValue to(const std::map<std::string, T>& v) {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    for (const auto& kv : v) {
      dict.insert(kv.first, IValueConvert<T>::to(kv.second));
    }
    return dict;
  }
  static std::map<std::string, T> from(const c10::IValue& v) {
    TORCH_CHECK(v.isGenericDict(), "functorch: expected a dict, got ", v.tagKind());
    std::map<std::string, T> out;
    for (const auto& kv : v.toGenericDict()) {
      out.emplace(kv.key().toStringRef(), IValueConvert<T>::from(kv.value()));
    }
    return out;
  }
};

template <class... Ts>
struct IValueConvert<std::tuple<Ts...>> {
  static c10::IValue to(const std::tuple<Ts...>& v) {
    return to_impl(v, std::index_sequence_for<Ts...>{});
  }
  static std::tuple<Ts...> from(const c10::IValue& v) {
    TORCH_CHECK(v.isTuple() || v.isList(), "functorch: expected a tuple of ", sizeof...(Ts),
                " elements, got ", v.tagKind());
    std::vector<c10::IValue> elements =
        v.isTuple() ? v.toTupleRef().elements().vec() : v.toList().vec();
    TORCH_CHECK(elements.size() == sizeof...(Ts), "functorch: expected a tuple of ", sizeof...(Ts),
                " elements, got ", elements.size());
    return from_impl(elements, std::index_sequence_for<Ts...>{});
  }

 private:
  template <size_t... I>
  static c10::IValue to_impl(const std::tuple<Ts...>& v, std::index_sequence<I...>) {
    return c10::ivalue::Tuple::create(
        std::vector<c10::IValue>{IValueConvert<Ts>::to(std::get<I>(v))...});
  }
  template <size_t... I>
  static std::tuple<Ts...> from_impl(const std::vector<c10::IValue>& e, std::index_sequence<I...>) {
    return std::tuple<Ts...>(IValueConvert<Ts>::from(e[I])...);
  }
};

template <class A, class B>
struct IValueConvert<std::pair<A, B>> {
  static c10::IValue to(const std::pair<A, B>& v) {
    return IValueConvert<std::tuple<A, B>>::to(std::tuple<A, B>(v.first, v.second));
  }
  static std::pair<A, B> from(const c10::IValue& v) {
    auto t = IValueConvert<std::tuple<A, B>>::from(v);
    return {std::get<0>(t), std::get<1>(t)};
  }
};

template <class T>
c10::IValue to_ivalue(const T& value) {
  return IValueConvert<std::decay_t<T>>::to(value);
}

inline at::Tensor Tree::tensor() const { return IValueConvert<at::Tensor>::from(value_); }

inline Tree Tree::operator[](size_t index) const {
  if (value_.isTensor()) {
    const at::Tensor& t = value_.toTensor();
    TORCH_CHECK(t.dim() > 0, "Tree: cannot index a 0-dim Tensor (index ", index, ")");
    TORCH_CHECK(static_cast<int64_t>(index) < t.size(0), "Tree: index ", index,
                " out of range for a Tensor of size ", t.sizes());
    return Tree(t.select(0, static_cast<int64_t>(index)));
  }
  if (value_.isTuple()) {
    const auto& elements = value_.toTupleRef().elements();
    TORCH_CHECK(index < elements.size(), "Tree: index ", index, " out of range for a tuple of ",
                elements.size());
    return Tree(elements[index]);
  }
  TORCH_CHECK(value_.isList(), "Tree: cannot index a ", value_.tagKind(), " (index ", index,
              "); expected a tuple, list or Tensor");
  auto list = value_.toList();
  TORCH_CHECK(index < list.size(), "Tree: index ", index, " out of range for a list of ",
              list.size());
  return Tree(list.get(index));
}

inline Tree Tree::operator[](const std::string& key) const {
  TORCH_CHECK(value_.isGenericDict(), "Tree: cannot look up key '", key, "' in a ",
              value_.tagKind(), "; expected a dict");
  auto dict = value_.toGenericDict();
  auto it = dict.find(key);
  if (it == dict.end()) {
    std::string keys;
    for (const auto& kv : dict) {
      keys += (keys.empty() ? "'" : ", '") + kv.key().toStringRef() + "'";
    }
    TORCH_CHECK(false, "Tree: no key '", key, "'; the dict has keys [", keys, "]");
  }
  return Tree(it->value());
}

inline size_t Tree::size() const {
  if (value_.isTuple()) return value_.toTupleRef().elements().size();
  if (value_.isList()) return value_.toList().size();
  if (value_.isGenericDict()) return value_.toGenericDict().size();
  return 1;
}

namespace internal {

// The type a transformed callable receives for an argument passed as T:
// T itself, except that dicts arrive as torch::OrderedDict (std::map
// arguments are converted), at any depth.
template <class T>
struct Canonical {
  using type = T;
};
template <class T>
using canonical_t = typename Canonical<std::decay_t<T>>::type;
template <class T>
struct Canonical<std::map<std::string, T>> {
  using type = torch::OrderedDict<std::string, canonical_t<T>>;
};
template <class T>
struct Canonical<torch::OrderedDict<std::string, T>> {
  using type = torch::OrderedDict<std::string, canonical_t<T>>;
};
template <class T>
struct Canonical<std::vector<T>> {
  using type = std::vector<canonical_t<T>>;
};
template <class... Ts>
struct Canonical<std::tuple<Ts...>> {
  using type = std::tuple<canonical_t<Ts>...>;
};
template <class A, class B>
struct Canonical<std::pair<A, B>> {
  using type = std::pair<canonical_t<A>, canonical_t<B>>;
};
template <class T>
struct Canonical<std::optional<T>> {
  using type = std::optional<canonical_t<T>>;
};

// What `f` returns when called with the canonical forms of Args.
template <class F, class... Args>
struct TypedCall {
  static_assert(std::is_invocable<const F&, canonical_t<Args>...>::value,
                "functorch: the transformed function cannot be called with "
                "these arguments. Dict arguments reach it as "
                "functorch::NamedTensors (torch::OrderedDict<std::string, T>), "
                "also when passed as std::map: declare dict parameters as "
                "NamedTensors.");
  using type = std::decay_t<std::invoke_result_t<const F&, canonical_t<Args>...>>;
  static_assert(!std::is_void<type>::value,
                "functorch: a transformed function must return a value");
};
template <class F, class... Args>
using typed_result_t = typename TypedCall<F, Args...>::type;

template <class F, class... Args, size_t... I>
c10::IValue invoke_typed(const F& f, const std::vector<c10::IValue>& args,
                         std::index_sequence<I...>) {
  return to_ivalue(f(IValueConvert<Args>::from(args[I])...));
}

// A TreeFn that calls `f` with the IValues converted back to Args. The
// callable is held by pointer: the TreeFn lives only for one typed call.
template <class F, class... Args>
TreeFn as_tree_fn(const F* f) {
  return TreeFn([f](const std::vector<c10::IValue>& args) -> c10::IValue {
    TORCH_CHECK(args.size() == sizeof...(Args), "functorch: the function takes ", sizeof...(Args),
                " arguments, got ", args.size());
    return invoke_typed<F, Args...>(*f, args, std::index_sequence_for<Args...>{});
  });
}

// The typed face of a transform: `transform` maps a TreeFn to a TreeFn;
// calling this object wraps `f` for the given argument types, applies the
// transform, and converts the result to `Result<R>` (R: f's return type).
template <class F, class Transform, template <class> class Result>
class Typed {
 public:
  Typed(F f, Transform transform) : f_(std::move(f)), transform_(std::move(transform)) {}

  template <class... Args>
  auto operator()(Args&&... args) const {
    using R = typed_result_t<F, Args...>;
    TreeFn inner = as_tree_fn<F, canonical_t<Args>...>(&f_);
    c10::IValue out = transform_(inner)({to_ivalue(args)...});
    return IValueConvert<Result<R>>::from(out);
  }

 private:
  F f_;
  Transform transform_;
};

template <class R>
using SameType = R;
template <class R>
using AsTree = Tree;

}  // namespace internal
}  // namespace functorch
