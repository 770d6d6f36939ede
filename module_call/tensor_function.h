// A call of mixed arguments as a function of its tensor arguments: what a
// region that reruns (activation checkpointing) needs of a module's forward
// or of checkpoint(fn, args...), so it can keep only the tensors and call
// the function again in backward.
//
//   using Out = module_call::tensor_function_output_t<decltype(fn), decltype(x), int>;
//   module_call::TensorFunction f = module_call::as_tensor_function(fn, x, 3);
//   Out y = module_call::from_tensors<Out>(f(module_call::tensor_arguments(x, 3)));
//
// at::Tensor arguments become the inputs, in order; any other argument is
// copied into the function and passed again unchanged. The function returns
// at::Tensor, std::vector<at::Tensor> or std::tuple<at::Tensor...>
// (is_tensor_output), flattened to a vector.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace module_call {

using TensorFunction =
    std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

template <typename T>
struct is_tensor : std::is_same<std::decay_t<T>, at::Tensor> {};

template <typename T>
struct is_tensor_output : std::false_type {};
template <>
struct is_tensor_output<at::Tensor> : std::true_type {};
template <>
struct is_tensor_output<std::vector<at::Tensor>> : std::true_type {};
template <typename... Ts>
struct is_tensor_output<std::tuple<Ts...>>
    : std::bool_constant<(std::is_same<Ts, at::Tensor>::value && ...)> {};

template <typename... Args>
std::vector<at::Tensor> tensor_arguments(const Args&... args) {
  std::vector<at::Tensor> inputs;
  auto collect = [&inputs](const auto& arg) {
    if constexpr (is_tensor<decltype(arg)>::value) inputs.push_back(arg);
  };
  (collect(args), ...);
  return inputs;
}

inline std::vector<at::Tensor> to_tensors(at::Tensor out) { return {std::move(out)}; }
inline std::vector<at::Tensor> to_tensors(std::vector<at::Tensor> out) { return out; }
template <typename... Ts>
std::vector<at::Tensor> to_tensors(std::tuple<Ts...> out) {
  return std::apply([](auto&... t) { return std::vector<at::Tensor>{t...}; }, out);
}

namespace internal {

// What the function keeps of an argument: a copy of a non-tensor argument;
// nothing for a tensor (it comes back as an input).
struct TensorSlot {};
template <typename A>
using stored_t = std::conditional_t<is_tensor<A>::value, TensorSlot, std::decay_t<A>>;
template <typename A>
stored_t<A> store(A&& arg) {
  if constexpr (is_tensor<A>::value) {
    return TensorSlot();
  } else {
    return std::forward<A>(arg);
  }
}

// Position of argument I among the tensor arguments.
template <size_t I, typename... Args>
constexpr size_t tensor_position() {
  constexpr bool flags[] = {is_tensor<Args>::value..., false};
  size_t n = 0;
  for (size_t i = 0; i < I; ++i) n += flags[i] ? 1 : 0;
  return n;
}

template <size_t I, typename... Args, typename Stored>
decltype(auto) argument(Stored& stored, const std::vector<at::Tensor>& inputs) {
  if constexpr (is_tensor<std::tuple_element_t<I, std::tuple<Args...>>>::value) {
    return static_cast<const at::Tensor&>(inputs[tensor_position<I, Args...>()]);
  } else {
    return static_cast<std::tuple_element_t<I, Stored>&>(std::get<I>(stored));
  }
}

template <typename... Args, typename Fn, typename Stored, size_t... I>
auto invoke(Fn& fn, Stored& stored, const std::vector<at::Tensor>& inputs,
            std::index_sequence<I...>) {
  return fn(argument<I, Args...>(stored, inputs)...);
}

template <typename Out, size_t... I>
Out tuple_from(const std::vector<at::Tensor>& flat, std::index_sequence<I...>) {
  return Out(flat.at(I)...);
}

}  // namespace internal

// The inverse of to_tensors.
template <typename Out>
Out from_tensors(std::vector<at::Tensor> flat) {
  if constexpr (std::is_same<Out, at::Tensor>::value) {
    return flat.at(0);
  } else if constexpr (std::is_same<Out, std::vector<at::Tensor>>::value) {
    return flat;
  } else {
    return internal::tuple_from<Out>(flat, std::make_index_sequence<std::tuple_size<Out>::value>());
  }
}

// What fn returns when called as as_tensor_function calls it.
template <typename Fn, typename... Args>
using tensor_function_output_t = std::decay_t<decltype(internal::invoke<Args...>(
    std::declval<std::decay_t<Fn>&>(), std::declval<std::tuple<internal::stored_t<Args>...>&>(),
    std::declval<const std::vector<at::Tensor>&>(), std::index_sequence_for<Args...>()))>;

// fn(args...) with the tensor arguments replaced by the inputs it is called
// with. `fn` and the non-tensor arguments are copied (the function outlives
// this call).
template <typename Fn, typename... Args>
TensorFunction as_tensor_function(Fn&& fn, Args&&... args) {
  static_assert(is_tensor_output<tensor_function_output_t<Fn, Args...>>::value,
                "module_call::as_tensor_function: fn must return at::Tensor, "
                "std::vector<at::Tensor> or std::tuple<at::Tensor, ...>");
  using Stored = std::tuple<internal::stored_t<Args>...>;
  auto stored = std::make_shared<Stored>(internal::store(std::forward<Args>(args))...);
  return [fn = std::decay_t<Fn>(std::forward<Fn>(fn)),
          stored](const std::vector<at::Tensor>& ins) mutable {
    return to_tensors(
        internal::invoke<Args...>(fn, *stored, ins, std::index_sequence_for<Args...>()));
  };
}

}  // namespace module_call
