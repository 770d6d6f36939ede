// How the public templates reach the torch::nn::Module behind the three ways
// LibTorch hands a module around -- a ModuleHolder (torch::nn::Linear, a user
// TORCH_MODULE), a std::shared_ptr<Impl>, an AnyModule -- and call its typed
// forward(). Internal: include the public headers instead.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace functorch {
namespace internal {

template <typename T>
struct ModuleTraits;

template <typename Contained>
struct ModuleTraits<torch::nn::ModuleHolder<Contained>> {
  using Holder = torch::nn::ModuleHolder<Contained>;
  static std::shared_ptr<torch::nn::Module> ptr(const Holder& m) { return m.ptr(); }
  template <typename... Args>
  static decltype(auto) forward(const Holder& m, Args&&... args) {
    return m.ptr()->forward(std::forward<Args>(args)...);
  }
  // A deep copy of `m`, as Python's copy.deepcopy (needs Cloneable).
  template <typename Derived>
  static Derived clone(const Derived& m) {
    return Derived(std::dynamic_pointer_cast<Contained>(m.ptr()->clone()));
  }
};

template <typename Impl>
struct ModuleTraits<std::shared_ptr<Impl>> {
  static_assert(std::is_base_of<torch::nn::Module, Impl>::value,
                "expected a std::shared_ptr to a torch::nn::Module subclass");
  static std::shared_ptr<torch::nn::Module> ptr(const std::shared_ptr<Impl>& m) { return m; }
  template <typename... Args>
  static decltype(auto) forward(const std::shared_ptr<Impl>& m, Args&&... args) {
    return m->forward(std::forward<Args>(args)...);
  }
  template <typename Derived>
  static Derived clone(const Derived& m) {
    return std::dynamic_pointer_cast<Impl>(m->clone());
  }
};

template <>
struct ModuleTraits<torch::nn::AnyModule> {
  static std::shared_ptr<torch::nn::Module> ptr(const torch::nn::AnyModule& m) { return m.ptr(); }
  // The AnyValue route: whatever the contained forward returns, boxed.
  template <typename... Args>
  static torch::nn::AnyValue forward(const torch::nn::AnyModule& m, Args&&... args) {
    return const_cast<torch::nn::AnyModule&>(m).any_forward(std::forward<Args>(args)...);
  }
  template <typename Derived>
  static Derived clone(const Derived& m) {
    return m.clone();
  }
};

// Maps a user-facing module type (torch::nn::Linear derives from
// ModuleHolder<LinearImpl>) onto the ModuleTraits specialisation.
template <typename Contained>
ModuleTraits<torch::nn::ModuleHolder<Contained>> traits_of(
    const torch::nn::ModuleHolder<Contained>*);
template <typename Impl>
ModuleTraits<std::shared_ptr<Impl>> traits_of(const std::shared_ptr<Impl>*);
ModuleTraits<torch::nn::AnyModule> traits_of(const torch::nn::AnyModule*);

template <typename ModuleType>
using TraitsFor = decltype(traits_of(std::declval<const std::decay_t<ModuleType>*>()));

template <typename ModuleType>
std::shared_ptr<torch::nn::Module> module_ptr(const ModuleType& module) {
  return TraitsFor<ModuleType>::ptr(module);
}

template <typename ModuleType, typename... Args>
decltype(auto) call_forward(const ModuleType& module, Args&&... args) {
  return TraitsFor<ModuleType>::forward(module, std::forward<Args>(args)...);
}

template <typename ModuleType>
ModuleType clone_module(const ModuleType& module) {
  return TraitsFor<ModuleType>::template clone<ModuleType>(module);
}

}  // namespace internal
}  // namespace functorch
