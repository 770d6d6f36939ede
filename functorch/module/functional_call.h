// functional_call: run a module's own forward() with some or all of its
// parameters and buffers replaced by given tensors, as torch.func's
// functional_call. The module is unchanged afterwards (also when forward()
// throws); the substitutes may be functorch-wrapped or non-leaf tensors and
// gradients flow to them.
//
//   torch::nn::Linear model(3, 4);
//   functorch::NamedTensors params{{"weight", w}, {"bias", b}};
//   torch::Tensor y = functorch::functional_call(model, params, x);
//
//   auto [p, buf] = functorch::stack_module_state(models);   // list of dicts:
//   y = functorch::functional_call(model, {p, buf}, x);
//
//   functorch::FunctionalCallOptions strict;  strict.strict = true;
//   y = functorch::functional_call(model, params, strict, x);
//
// `module` is a ModuleHolder (torch::nn::Linear, a TORCH_MODULE), a
// std::shared_ptr<Impl>, or a torch::nn::AnyModule (then the result is the
// torch::nn::AnyValue its any_forward() returns). The remaining arguments go
// to forward() unchanged, so any typed forward works: Tensor -> Tensor,
// several tensors, tuples (LSTM), Sequential, ...
//
// As in PyTorch, the swap is visible to anything that uses the module while
// the call runs: do not run functional_call on one module from two threads.
// Buffers updated in place (BatchNorm running stats in training) are updated
// in the tensors passed in.
#pragma once

#include "functorch/module/internal/module_traits.h"
#include "functorch/module/named_member_accessor.h"

#include <torch/nn/module.h>
#include <torch/ordered_dict.h>
#include <torch/types.h>

#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace functorch {

// A dict of named tensors, in insertion order (what named_parameters()
// returns).
using NamedTensors = torch::OrderedDict<std::string, torch::Tensor>;

struct FunctionalCallOptions {
  // Every parameter and buffer of the module must be given, and nothing
  // else; otherwise "Error(s) in reparametrizing for ...".
  bool strict = false;
  // Tied parameters (one tensor under several names) follow a value given
  // for any of their names, unless every tied name is given. Off: only the
  // given names change.
  bool tie_weights = true;
};

// One dict or a list of dicts (keys must not repeat across dicts). A
// non-owning view of its arguments: build it in the call expression.
class ParameterAndBufferDicts {
 public:
  ParameterAndBufferDicts(const NamedTensors& dict) : dicts_{&dict} {}
  ParameterAndBufferDicts(const std::vector<NamedTensors>& dicts);
  ParameterAndBufferDicts(std::initializer_list<NamedTensors> dicts);
  ParameterAndBufferDicts(const std::pair<NamedTensors, NamedTensors>& dicts)
      : dicts_{&dicts.first, &dicts.second} {}

  const std::vector<const NamedTensors*>& dicts() const { return dicts_; }

 private:
  std::vector<const NamedTensors*> dicts_;
};

// RAII form of functional_call (PyTorch's _reparametrize_module): swaps the
// given tensors into `module` for the lifetime of this object. Checks
// (duplicate keys across dicts, strict keys, tied values) happen before
// anything is swapped.
class ReparametrizeGuard {
 public:
  ReparametrizeGuard(std::shared_ptr<torch::nn::Module> module,
                     const ParameterAndBufferDicts& parameters_and_buffers,
                     const FunctionalCallOptions& options = {});
  ~ReparametrizeGuard();
  ReparametrizeGuard(const ReparametrizeGuard&) = delete;
  ReparametrizeGuard& operator=(const ReparametrizeGuard&) = delete;

 private:
  NamedMemberAccessor accessor_;
  std::unique_ptr<ScopedTensorSwap> swap_;
};

namespace internal {
template <typename T>
using IsOptions = std::is_same<std::decay_t<T>, FunctionalCallOptions>;
template <typename... Args>
struct FirstIsOptions : std::false_type {};
template <typename First, typename... Rest>
struct FirstIsOptions<First, Rest...> : IsOptions<First> {};
}  // namespace internal

// functional_call(module, dicts, options, args...)
template <typename ModuleType, typename... Args>
decltype(auto) functional_call(const ModuleType& module,
                               const ParameterAndBufferDicts& parameters_and_buffers,
                               const FunctionalCallOptions& options, Args&&... args) {
  ReparametrizeGuard guard(internal::module_ptr(module), parameters_and_buffers, options);
  return internal::call_forward(module, std::forward<Args>(args)...);
}

// functional_call(module, dicts, args...) with default options.
template <typename ModuleType, typename... Args,
          typename = std::enable_if_t<!internal::FirstIsOptions<Args...>::value>>
decltype(auto) functional_call(const ModuleType& module,
                               const ParameterAndBufferDicts& parameters_and_buffers,
                               Args&&... args) {
  ReparametrizeGuard guard(internal::module_ptr(module), parameters_and_buffers,
                           FunctionalCallOptions{});
  return internal::call_forward(module, std::forward<Args>(args)...);
}

}  // namespace functorch
