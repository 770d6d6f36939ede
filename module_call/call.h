// The module call point (PyTorch's Module.__call__, _call_impl): calls a
// module's forward with the hooks registered on it (forward_hooks.h) around
// it. LibTorch has no forward hooks and a parent calls its children through
// typed members, so a feature that must act around a submodule's forward
// (FSDP, activation checkpointing) sees only the calls made through here:
//
//   x = block->forward(x);            becomes   x = module_call::call(block, x);
//
// `module` is a ModuleHolder (Linear, MyBlock), a std::shared_ptr<Impl> or
// an Impl* (what ModuleList's ptr->as<Impl>() gives); call returns what
// forward returns. On a module with no hooks it just calls forward.
//
// torch::nn::Sequential is driven child by child (Sequential::forward's
// semantics: the first child takes the arguments, each next one the previous
// output; at most 3 arguments), each child through the call point, and
// returns an at::Tensor.
//
// A module with a region runner (activation checkpointing) runs its forward
// inside it; that forward must return at::Tensor, std::vector<at::Tensor> or
// a std::tuple of tensors, and a Sequential child there takes tensors only
// (each an error naming the module otherwise). Post-forward hooks see the
// tensors of at::Tensor, std::vector<at::Tensor> and tuples or pairs of
// those; for any other return type they are told the outputs are unknown.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "module_call/forward_hooks.h"
#include "module_call/tensor_function.h"

namespace module_call {

template <typename ModuleRef, typename... Args>
auto call(ModuleRef&& module, Args&&... args);

// Sequential::forward with every child called through the call point (the
// Sequential's own hooks are the caller's business, as in call()).
torch::nn::AnyValue sequential_forward(torch::nn::SequentialImpl& sequential,
                                       std::vector<torch::nn::AnyValue> args);

// One call through the call point, for a caller that runs the forward itself
// (FullyShardedDataParallel's root forward and run()): construction runs the
// pre_forward hooks, argument() maps the arguments, finish() runs the
// post_forward hooks; destroyed unfinished (forward threw), it runs the
// forward_failed hooks. Lives on the caller's stack for that one call.
class ForwardCall {
 public:
  explicit ForwardCall(torch::nn::Module& module);
  ~ForwardCall();
  ForwardCall(const ForwardCall&) = delete;
  ForwardCall& operator=(const ForwardCall&) = delete;

  // The argument as the hooks map it (map_tensor_argument on an
  // at::Tensor; any other argument unchanged).
  template <typename T>
  decltype(auto) argument(T&& value) {
    if constexpr (is_tensor<T>::value) {
      return map_tensor(value);
    } else {
      return std::forward<T>(value);
    }
  }
  torch::nn::AnyValue argument(torch::nn::AnyValue value);

  bool runs_as_region() const { return hooks_ && hooks_->region_runner; }
  std::vector<at::Tensor> run_region(TensorFunction forward, std::vector<at::Tensor> inputs);

  // Runs the post_forward hooks on `out`'s tensors and returns it, its
  // tensors replaced by the map_tensor_output hooks.
  template <typename Out>
  Out finish(Out out);
  void finish(const std::vector<at::Tensor>& outputs, bool outputs_known);
  // What the map_tensor_output hooks make of one output tensor, and
  // whether there are any.
  bool maps_outputs() const;
  at::Tensor map_output(const at::Tensor& t) const;

 private:
  at::Tensor map_tensor(const at::Tensor& t) const;
  void fail() noexcept;

  torch::nn::Module& module_;
  std::shared_ptr<const internal::ModuleHooks> hooks_;  // null: none
  size_t pre_forward_done_ = 0;
  bool finished_ = false;
};

// ---------------------------------------------------------------------------
// Implementation details of the templates above.
namespace internal {

template <typename T>
bool collect_tensors(const T&, std::vector<at::Tensor>*) {
  return false;
}
inline bool collect_tensors(const at::Tensor& t, std::vector<at::Tensor>* out) {
  out->push_back(t);
  return true;
}
inline bool collect_tensors(const std::vector<at::Tensor>& ts, std::vector<at::Tensor>* out) {
  out->insert(out->end(), ts.begin(), ts.end());
  return true;
}
template <typename... Ts>
bool collect_tensors(const std::tuple<Ts...>& tuple, std::vector<at::Tensor>* out) {
  bool known = true;
  std::apply([&](const auto&... elems) { ((known &= collect_tensors(elems, out)), ...); }, tuple);
  return known;
}
template <typename A, typename B>
bool collect_tensors(const std::pair<A, B>& pair, std::vector<at::Tensor>* out) {
  const bool a = collect_tensors(pair.first, out);
  const bool b = collect_tensors(pair.second, out);
  return a && b;
}

// Replaces, in place, the tensors collect_tensors finds in `value` by
// fn(tensor).
template <typename... Ts, typename Fn>
void map_tensors(std::tuple<Ts...>& tuple, const Fn& fn);
template <typename A, typename B, typename Fn>
void map_tensors(std::pair<A, B>& pair, const Fn& fn);
template <typename T, typename Fn>
void map_tensors(T&, const Fn&) {}
template <typename Fn>
void map_tensors(at::Tensor& t, const Fn& fn) {
  t = fn(t);
}
template <typename Fn>
void map_tensors(std::vector<at::Tensor>& ts, const Fn& fn) {
  for (auto& t : ts) t = fn(t);
}
template <typename... Ts, typename Fn>
void map_tensors(std::tuple<Ts...>& tuple, const Fn& fn) {
  std::apply([&](auto&... elems) { (map_tensors(elems, fn), ...); }, tuple);
}
template <typename A, typename B, typename Fn>
void map_tensors(std::pair<A, B>& pair, const Fn& fn) {
  map_tensors(pair.first, fn);
  map_tensors(pair.second, fn);
}

template <typename T>
T& impl_of(const std::shared_ptr<T>& m) {
  return *m;
}
template <typename T>
T& impl_of(const torch::nn::ModuleHolder<T>& m) {
  return *m.ptr();
}
template <typename T>
T& impl_of(T* m) {
  return *m;
}

// impl.forward(args...) inside the module's region runner.
template <typename Impl, typename... Args>
auto region_forward(ForwardCall& point, Impl& impl, Args&&... args) {
  using Out = std::decay_t<decltype(impl.forward(std::forward<Args>(args)...))>;
  if constexpr (is_tensor_output<Out>::value) {
    std::vector<at::Tensor> inputs = tensor_arguments(args...);
    Impl* self = &impl;
    TensorFunction forward = as_tensor_function([self](auto&&... a) { return self->forward(a...); },
                                                std::forward<Args>(args)...);
    return from_tensors<Out>(point.run_region(std::move(forward), std::move(inputs)));
  } else {
    TORCH_CHECK(false, "module_call::call(", impl.name(),
                "): the module runs as a region that "
                "reruns (activation checkpointing), and its forward returns a type such a "
                "region cannot return: expected at::Tensor, std::vector<at::Tensor> or "
                "std::tuple of tensors");
    return impl.forward(std::forward<Args>(args)...);
  }
}

}  // namespace internal

template <typename Out>
Out ForwardCall::finish(Out out) {
  std::vector<at::Tensor> tensors;
  const bool known = internal::collect_tensors(out, &tensors);
  finish(tensors, known);
  if (maps_outputs()) {
    internal::map_tensors(out, [this](const at::Tensor& t) { return map_output(t); });
  }
  return out;
}

template <typename ModuleRef, typename... Args>
auto call(ModuleRef&& module, Args&&... args) {
  auto& impl = internal::impl_of(module);
  using Impl = std::decay_t<decltype(impl)>;
  ForwardCall point(impl);
  if constexpr (std::is_same<Impl, torch::nn::SequentialImpl>::value) {
    std::vector<torch::nn::AnyValue> values;
    (values.emplace_back(point.argument(std::forward<Args>(args))), ...);
    return point.finish(sequential_forward(impl, std::move(values)).template get<at::Tensor>());
  } else {
    auto out =
        point.runs_as_region()
            ? internal::region_forward(point, impl, point.argument(std::forward<Args>(args))...)
            : impl.forward(point.argument(std::forward<Args>(args))...);
    return point.finish(std::move(out));
  }
}

}  // namespace module_call
