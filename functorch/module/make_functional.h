// make_functional, make_functional_with_buffers, combine_state_for_ensemble,
// functional_init(_with_buffers): functorch's (pre-torch.func) API that turns
// a module into a function of its parameters (and buffers).
//
//   torch::nn::Linear model(3, 3);
//   auto [fmodel, params] = functorch::make_functional(model);
//   torch::Tensor y = fmodel(params, x);              // params: vector<Tensor>
//
//   auto [fn, params, buffers] = functorch::make_functional_with_buffers(cnn);
//   y = fn(params, buffers, x);
//
// The functional module owns a deep copy of `model` (module->clone(), so the
// Impl must derive torch::nn::Cloneable) whose own parameters are replaced by
// tensors on the meta device: it computes only with the tensors passed in.
// The returned params are that copy's parameters (new leaves with the
// original's requires_grad, unless disable_autograd_tracking).
//
// Tied weights (one tensor registered under several names) appear once in
// params, under the first name; names_map() lists every name it feeds.
#pragma once

#include "functorch/module/functional_call.h"
#include "functorch/module/internal/module_traits.h"
#include "functorch/module/named_member_accessor.h"

#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace functorch {

// For each unique tensor: (its first name, every name it is registered
// under), in module order.
using NamesMap = std::vector<std::pair<std::string, std::vector<std::string>>>;

namespace internal {

// What make_functional takes out of a module: one tensor per tie, its first
// name, and the names map.
struct ExtractedState {
  std::vector<torch::Tensor> tensors;
  std::vector<std::string> names;
  NamesMap names_map;
};

// Parameters (buffers) of `module`, deduplicated by tensor identity.
ExtractedState named_unique_parameters(const torch::nn::Module& module);
ExtractedState named_unique_buffers(const torch::nn::Module& module);

// Makes `copy` (a fresh clone() of `original`) tie the names `original`
// ties, and gives its parameters the original's requires_grad: clone()
// re-creates every parameter separately.
void match_ties_and_requires_grad(const torch::nn::Module& original, NamedMemberAccessor& copy);

// Moves the state out of the module behind `accessor`: every name is pointed
// at a meta-device placeholder (one per tie). Returns the original tensors.
ExtractedState extract_weights(NamedMemberAccessor& accessor, bool disable_autograd_tracking);
ExtractedState extract_buffers(NamedMemberAccessor& accessor);

// Loads `first` then `second` into the names of `names_map` (every tied name
// gets its tensor) for the guard's lifetime. `api` names the caller in the
// count mismatch error.
std::unique_ptr<ScopedTensorSwap> swap_state(NamedMemberAccessor& accessor,
                                             const NamesMap& names_map,
                                             const std::vector<torch::Tensor>& first,
                                             const std::vector<torch::Tensor>& second,
                                             const char* what);

// Throws "`api`(model): `model` has buffers. ..." when `module` has buffers.
void check_no_buffers(const torch::nn::Module& module, const char* api, const char* alternative);

// PyTorch's checks on an ensemble: at least one model, one training mode,
// one class. `api` prefixes the messages.
void check_ensemble(const std::vector<std::shared_ptr<torch::nn::Module>>& models, const char* api);

// Stacks the i-th tensor of every inner vector, detached.
std::vector<torch::Tensor> transpose_stack(const std::vector<std::vector<torch::Tensor>>& tensors);

// functional_init's checks on ensemble_shape; returns the model count (0 for
// "no ensemble").
int64_t check_ensemble_shape(const std::vector<int64_t>& ensemble_shape);

}  // namespace internal

// The callable make_functional returns: fn(params, forward args...).
template <typename ModuleType>
class FunctionalModule {
 public:
  FunctionalModule(ModuleType stateless_model, std::shared_ptr<NamedMemberAccessor> accessor,
                   std::vector<std::string> param_names, NamesMap names_map)
      : stateless_model_(std::move(stateless_model)),
        accessor_(std::move(accessor)),
        param_names_(std::move(param_names)),
        names_map_(std::move(names_map)) {}

  // Runs the module's forward with `params` (one per param_names() entry)
  // loaded; the placeholders are back when it returns or throws.
  template <typename... Args>
  decltype(auto) operator()(const std::vector<torch::Tensor>& params, Args&&... args) const {
    auto guard = internal::swap_state(*accessor_, names_map_, params, {}, "FunctionalModule");
    return internal::call_forward(stateless_model_, std::forward<Args>(args)...);
  }

  const ModuleType& stateless_model() const { return stateless_model_; }
  const std::vector<std::string>& param_names() const { return param_names_; }
  const NamesMap& names_map() const { return names_map_; }

 private:
  ModuleType stateless_model_;
  std::shared_ptr<NamedMemberAccessor> accessor_;
  std::vector<std::string> param_names_;
  NamesMap names_map_;
};

// The callable make_functional_with_buffers returns:
// fn(params, buffers, forward args...).
template <typename ModuleType>
class FunctionalModuleWithBuffers {
 public:
  FunctionalModuleWithBuffers(ModuleType stateless_model,
                              std::shared_ptr<NamedMemberAccessor> accessor,
                              std::vector<std::string> param_names,
                              std::vector<std::string> buffer_names, NamesMap all_names_map)
      : stateless_model_(std::move(stateless_model)),
        accessor_(std::move(accessor)),
        param_names_(std::move(param_names)),
        buffer_names_(std::move(buffer_names)),
        all_names_map_(std::move(all_names_map)) {}

  template <typename... Args>
  decltype(auto) operator()(const std::vector<torch::Tensor>& params,
                            const std::vector<torch::Tensor>& buffers, Args&&... args) const {
    auto guard = internal::swap_state(*accessor_, all_names_map_, params, buffers,
                                      "FunctionalModuleWithBuffers");
    return internal::call_forward(stateless_model_, std::forward<Args>(args)...);
  }

  const ModuleType& stateless_model() const { return stateless_model_; }
  const std::vector<std::string>& param_names() const { return param_names_; }
  const std::vector<std::string>& buffer_names() const { return buffer_names_; }
  // Parameter entries first, then buffer entries.
  const NamesMap& all_names_map() const { return all_names_map_; }

 private:
  ModuleType stateless_model_;
  std::shared_ptr<NamedMemberAccessor> accessor_;
  std::vector<std::string> param_names_;
  std::vector<std::string> buffer_names_;
  NamesMap all_names_map_;
};

namespace internal {
template <typename ModuleType>
std::pair<ModuleType, std::shared_ptr<NamedMemberAccessor>> stateless_copy(
    const ModuleType& model) {
  ModuleType copy = clone_module(model);
  auto accessor = std::make_shared<NamedMemberAccessor>(module_ptr(copy));
  match_ties_and_requires_grad(*module_ptr(model), *accessor);
  return {std::move(copy), std::move(accessor)};
}
}  // namespace internal

// make_functional(model, disable_autograd_tracking) -> (fn, params).
// Throws if `model` has buffers (use make_functional_with_buffers).
template <typename ModuleType>
std::pair<FunctionalModule<ModuleType>, std::vector<torch::Tensor>> make_functional(
    const ModuleType& model, bool disable_autograd_tracking = false) {
  internal::check_no_buffers(*internal::module_ptr(model), "make_functional",
                             "make_functional_with_buffers");
  auto [copy, accessor] = internal::stateless_copy(model);
  auto weights = internal::extract_weights(*accessor, disable_autograd_tracking);
  return {FunctionalModule<ModuleType>(std::move(copy), std::move(accessor),
                                       std::move(weights.names), std::move(weights.names_map)),
          std::move(weights.tensors)};
}

// make_functional_with_buffers(model, disable_autograd_tracking)
//   -> (fn, params, buffers).
template <typename ModuleType>
std::tuple<FunctionalModuleWithBuffers<ModuleType>, std::vector<torch::Tensor>,
           std::vector<torch::Tensor>>
make_functional_with_buffers(const ModuleType& model, bool disable_autograd_tracking = false) {
  auto [copy, accessor] = internal::stateless_copy(model);
  auto weights = internal::extract_weights(*accessor, disable_autograd_tracking);
  auto buffers = internal::extract_buffers(*accessor);
  NamesMap all_names_map = std::move(weights.names_map);
  all_names_map.insert(all_names_map.end(), buffers.names_map.begin(), buffers.names_map.end());
  return {FunctionalModuleWithBuffers<ModuleType>(
              std::move(copy), std::move(accessor), std::move(weights.names),
              std::move(buffers.names), std::move(all_names_map)),
          std::move(weights.tensors), std::move(buffers.tensors)};
}

// combine_state_for_ensemble(models) -> (fn, params, buffers): every
// parameter and buffer stacked over the M models (leading dim M, detached),
// and a functional version of models[0]; use it under vmap. All models must
// have the same class and training mode.
template <typename ModuleType>
std::tuple<FunctionalModuleWithBuffers<ModuleType>, std::vector<torch::Tensor>,
           std::vector<torch::Tensor>>
combine_state_for_ensemble(const std::vector<ModuleType>& models) {
  std::vector<std::shared_ptr<torch::nn::Module>> ptrs;
  for (const auto& model : models) ptrs.push_back(internal::module_ptr(model));
  internal::check_ensemble(ptrs, "combine_state_for_ensemble");
  std::vector<std::vector<torch::Tensor>> params, buffers;
  for (const auto& ptr : ptrs) {
    params.push_back(internal::named_unique_parameters(*ptr).tensors);
    buffers.push_back(internal::named_unique_buffers(*ptr).tensors);
  }
  auto fn = std::get<0>(make_functional_with_buffers(models.front()));
  return {std::move(fn), internal::transpose_stack(params), internal::transpose_stack(buffers)};
}

// What functional_init(...)(ctor args...) returns.
template <typename ModuleType>
struct FunctionalInitResult {
  std::vector<torch::Tensor> weights;  // stacked over the ensemble if any
  FunctionalModule<ModuleType> fn;
  std::vector<std::string> weight_names;
};

template <typename ModuleType>
struct FunctionalInitWithBuffersResult {
  std::vector<torch::Tensor> weights;
  std::vector<torch::Tensor> buffers;
  FunctionalModuleWithBuffers<ModuleType> fn;
  std::vector<std::string> weight_names;
  std::vector<std::string> buffer_names;
};

// functional_init<ModuleType>(ensemble_shape, device)(ctor args...):
// constructs ModuleType(ctor args...) -- ensemble_shape[0] of them if
// ensemble_shape = {M} -- on `device` and returns their weights (stacked,
// detached, for an ensemble), a functional module and the weight names.
// ensemble_shape must have at most one element, M > 0. Models with buffers
// need functional_init_with_buffers.
template <typename ModuleType>
auto functional_init(std::vector<int64_t> ensemble_shape = {}, torch::Device device = torch::kCPU) {
  return [ensemble_shape, device](auto&&... args) {
    const int64_t num_models = internal::check_ensemble_shape(ensemble_shape);
    auto make = [&] {
      ModuleType model(args...);
      internal::module_ptr(model)->to(device);
      internal::check_no_buffers(*internal::module_ptr(model), "make_functional_deprecated_v1",
                                 "make_functional_with_buffers_deprecated_v1");
      return model;
    };
    ModuleType model = make();
    auto [fn, weights] = make_functional(model);
    if (num_models > 0) {
      std::vector<std::vector<torch::Tensor>> all;
      all.push_back(internal::named_unique_parameters(*internal::module_ptr(model)).tensors);
      for (int64_t i = 1; i < num_models; ++i) {
        all.push_back(internal::named_unique_parameters(*internal::module_ptr(make())).tensors);
      }
      weights = internal::transpose_stack(all);
    }
    std::vector<std::string> names = fn.param_names();
    return FunctionalInitResult<ModuleType>{std::move(weights), std::move(fn), std::move(names)};
  };
}

// As functional_init, for models with buffers.
template <typename ModuleType>
auto functional_init_with_buffers(std::vector<int64_t> ensemble_shape = {},
                                  torch::Device device = torch::kCPU) {
  return [ensemble_shape, device](auto&&... args) {
    const int64_t num_models = internal::check_ensemble_shape(ensemble_shape);
    auto make = [&] {
      ModuleType model(args...);
      internal::module_ptr(model)->to(device);
      return model;
    };
    ModuleType model = make();
    auto [fn, weights, buffers] = make_functional_with_buffers(model);
    if (num_models > 0) {
      std::vector<std::vector<torch::Tensor>> all_weights, all_buffers;
      for (int64_t i = 0; i < num_models; ++i) {
        ModuleType member = i == 0 ? model : make();
        all_weights.push_back(
            internal::named_unique_parameters(*internal::module_ptr(member)).tensors);
        all_buffers.push_back(
            internal::named_unique_buffers(*internal::module_ptr(member)).tensors);
      }
      weights = internal::transpose_stack(all_weights);
      buffers = internal::transpose_stack(all_buffers);
    }
    std::vector<std::string> weight_names = fn.param_names();
    std::vector<std::string> buffer_names = fn.buffer_names();
    return FunctionalInitWithBuffersResult<ModuleType>{std::move(weights), std::move(buffers),
                                                       std::move(fn), std::move(weight_names),
                                                       std::move(buffer_names)};
  };
}

}  // namespace functorch
