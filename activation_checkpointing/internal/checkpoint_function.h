// The machinery behind checkpoint() and checkpointed modules: the autograd
// node that recomputes a region in backward, the template glue that turns
// a function of mixed arguments into a region of tensors, and the registry
// of modules apply_activation_checkpointing marked. Shared with
// //fsdp:fully_sharded_data_parallel, whose fsdp::call runs marked modules
// through it; not a public API.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace torch {
namespace nn {
class Module;
}  // namespace nn
}  // namespace torch

namespace activation_checkpointing {
namespace internal {

// What a region reads besides its tensor arguments, and what must happen
// before it is recomputed.
struct Declared {
  // Tensors the region reads that may need gradients (a module's
  // parameters). Called before the forward and after each recomputation,
  // which may see other tensor objects in the same order and shapes (FSDP
  // points the module at fresh views of the re-gathered flat parameter);
  // the gradients with respect to the recomputation's tensors are returned
  // for the forward's.
  std::function<std::vector<at::Tensor>()> params;
  // Runs before each recomputation (FSDP: gather the owning unit again and
  // point the module at its unsharded views).
  std::function<void()> before_recompute;
  // Runs after each recomputation, before it is differentiated: where the
  // region's memory peaks (its activations and their gradients alive
  // together). FSDP finishes the gradient reductions still in flight there,
  // so their buffers are not alive at that peak.
  std::function<void()> before_backward;
  // Names the region in messages ("module blocks.0 (BlockImpl)").
  std::string what = "checkpoint";
};

// A region as a function of its tensor inputs, returning its outputs.
using Region = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

// Runs `region(inputs)` checkpointed (see checkpoint.h); returns its outputs,
// connected to the graph through one recomputing node.
std::vector<at::Tensor> run_checkpointed(Region region, std::vector<at::Tensor> inputs,
                                         Declared declared, bool preserve_rng_state);

// This thread is inside a checkpointed region's no-grad forward / inside a
// recomputation in backward (FSDP refuses to run a unit there).
bool in_checkpointed_forward();
bool in_recomputation();

// The modules apply_activation_checkpointing marked (held weakly: a module
// destroyed and another allocated at its address is not marked).
void mark_checkpointed(const std::shared_ptr<torch::nn::Module>& module);
bool is_checkpointed(const torch::nn::Module& module);

// ---- template glue ---------------------------------------------------------

template <typename T>
struct is_tensor : std::is_same<std::decay_t<T>, at::Tensor> {};

// Outputs a region may return: at::Tensor, std::vector<at::Tensor>,
// std::tuple<at::Tensor...>.
template <typename T>
struct is_region_output : std::false_type {};
template <>
struct is_region_output<at::Tensor> : std::true_type {};
template <>
struct is_region_output<std::vector<at::Tensor>> : std::true_type {};
template <typename... Ts>
struct is_region_output<std::tuple<Ts...>>
    : std::bool_constant<(std::is_same<Ts, at::Tensor>::value && ...)> {};

inline std::vector<at::Tensor> flatten_output(at::Tensor out) { return {std::move(out)}; }
inline std::vector<at::Tensor> flatten_output(std::vector<at::Tensor> out) { return out; }
template <typename... Ts>
std::vector<at::Tensor> flatten_output(std::tuple<Ts...> out) {
  return std::apply([](auto&... t) { return std::vector<at::Tensor>{t...}; }, out);
}

template <typename Out>
struct Restore;
template <>
struct Restore<at::Tensor> {
  static at::Tensor from(std::vector<at::Tensor> flat) { return flat.at(0); }
};
template <>
struct Restore<std::vector<at::Tensor>> {
  static std::vector<at::Tensor> from(std::vector<at::Tensor> flat) { return flat; }
};
template <typename... Ts>
struct Restore<std::tuple<Ts...>> {
  template <size_t... I>
  static std::tuple<Ts...> build(const std::vector<at::Tensor>& flat, std::index_sequence<I...>) {
    return std::tuple<Ts...>(flat.at(I)...);
  }
  static std::tuple<Ts...> from(std::vector<at::Tensor> flat) {
    return build(flat, std::index_sequence_for<Ts...>());
  }
};

// What the region keeps of an argument for the recomputation: a copy of a
// non-tensor argument; nothing for a tensor (the node saves those).
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
decltype(auto) region_argument(Stored& stored, const std::vector<at::Tensor>& inputs) {
  if constexpr (is_tensor<std::tuple_element_t<I, std::tuple<Args...>>>::value) {
    return static_cast<const at::Tensor&>(inputs[tensor_position<I, Args...>()]);
  } else {
    return static_cast<std::tuple_element_t<I, Stored>&>(std::get<I>(stored));
  }
}

template <typename... Args, typename Fn, typename Stored, size_t... I>
auto invoke_region(Fn& fn, Stored& stored, const std::vector<at::Tensor>& inputs,
                   std::index_sequence<I...>) {
  return fn(region_argument<I, Args...>(stored, inputs)...);
}

template <typename Fn, typename... Args>
auto checkpoint_call(bool preserve_rng_state, Declared declared, Fn&& fn, Args&&... args) {
  using Stored = std::tuple<stored_t<Args>...>;
  using Out = std::decay_t<decltype(invoke_region<Args...>(
      std::declval<std::decay_t<Fn>&>(), std::declval<Stored&>(),
      std::declval<const std::vector<at::Tensor>&>(), std::index_sequence_for<Args...>()))>;
  static_assert(is_region_output<Out>::value,
                "activation_checkpointing::checkpoint: fn must return at::Tensor, "
                "std::vector<at::Tensor> or std::tuple<at::Tensor, ...>");
  std::vector<at::Tensor> inputs;
  auto collect = [&inputs](const auto& arg) {
    if constexpr (is_tensor<decltype(arg)>::value) inputs.push_back(arg);
  };
  (collect(args), ...);
  // The recomputation needs fn and the non-tensor arguments after this call
  // returns: both are copied.
  auto stored = std::make_shared<Stored>(store(std::forward<Args>(args))...);
  Region region = [fn = std::decay_t<Fn>(std::forward<Fn>(fn)), stored](
                      const std::vector<at::Tensor>& ins) mutable {
    return flatten_output(invoke_region<Args...>(fn, *stored, ins, std::index_sequence_for<Args...>()));
  };
  return Restore<Out>::from(
      run_checkpointed(std::move(region), std::move(inputs), std::move(declared), preserve_rng_state));
}

}  // namespace internal
}  // namespace activation_checkpointing
