#include "functorch/module/make_functional.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>
#include <torch/types.h>

#include <typeindex>
#include <unordered_map>

namespace functorch {
namespace internal {
namespace {

// Groups `named` (which may list one tensor under several names, as
// LibTorch's named_parameters() does for tied weights) by tensor identity,
// keeping first-appearance order.
ExtractedState unique_by_tensor(const torch::OrderedDict<std::string, torch::Tensor>& named) {
  ExtractedState state;
  std::unordered_map<const c10::TensorImpl*, size_t> index;
  for (const auto& item : named) {
    auto [it, inserted] = index.emplace(item.value().unsafeGetTensorImpl(), state.tensors.size());
    if (inserted) {
      state.tensors.push_back(item.value());
      state.names.push_back(item.key());
      state.names_map.emplace_back(item.key(), std::vector<std::string>{});
    }
    state.names_map[it->second].second.push_back(item.key());
  }
  return state;
}

// Points every name of `state` at a meta-device placeholder of the same
// shape and dtype (one per tie), so the stateless copy holds no data and a
// forward without loaded state fails loudly.
void replace_with_placeholders(NamedMemberAccessor& accessor, const ExtractedState& state) {
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    torch::Tensor placeholder =
        torch::empty_like(state.tensors[i], state.tensors[i].options().device(torch::kMeta));
    for (const auto& name : state.names_map[i].second) accessor.set_tensor(name, placeholder);
  }
}

}  // namespace

ExtractedState named_unique_parameters(const torch::nn::Module& module) {
  return unique_by_tensor(module.named_parameters());
}

ExtractedState named_unique_buffers(const torch::nn::Module& module) {
  return unique_by_tensor(module.named_buffers());
}

void match_ties_and_requires_grad(const torch::nn::Module& original, NamedMemberAccessor& copy) {
  for (const auto& state : {named_unique_parameters(original), named_unique_buffers(original)}) {
    for (size_t i = 0; i < state.tensors.size(); ++i) {
      const auto& names = state.names_map[i].second;
      torch::Tensor first = copy.get_tensor(names.front());
      if (first.is_leaf() && first.requires_grad() != state.tensors[i].requires_grad()) {
        first.requires_grad_(state.tensors[i].requires_grad());
      }
      for (size_t j = 1; j < names.size(); ++j) copy.set_tensor(names[j], first);
    }
  }
}

ExtractedState extract_weights(NamedMemberAccessor& accessor, bool disable_autograd_tracking) {
  ExtractedState state = named_unique_parameters(*accessor.module());
  replace_with_placeholders(accessor, state);
  if (disable_autograd_tracking) {
    for (auto& param : state.tensors) param.requires_grad_(false);
  }
  return state;
}

ExtractedState extract_buffers(NamedMemberAccessor& accessor) {
  ExtractedState state = named_unique_buffers(*accessor.module());
  replace_with_placeholders(accessor, state);
  return state;
}

std::unique_ptr<ScopedTensorSwap> swap_state(NamedMemberAccessor& accessor,
                                             const NamesMap& names_map,
                                             const std::vector<torch::Tensor>& first,
                                             const std::vector<torch::Tensor>& second,
                                             const char* what) {
  TORCH_CHECK(first.size() + second.size() == names_map.size(), what, ": expected ",
              names_map.size(), " tensors (one per name in param_names()",
              (second.empty() ? "" : ", then buffer_names()"), "), got ",
              first.size() + second.size());
  std::vector<std::string> names;
  std::vector<torch::Tensor> values;
  for (size_t i = 0; i < names_map.size(); ++i) {
    const torch::Tensor& value = i < first.size() ? first[i] : second[i - first.size()];
    for (const auto& name : names_map[i].second) {
      names.push_back(name);
      values.push_back(value);
    }
  }
  return std::make_unique<ScopedTensorSwap>(accessor, std::move(names), std::move(values));
}

void check_no_buffers(const torch::nn::Module& module, const char* api, const char* alternative) {
  TORCH_CHECK(module.buffers().empty(), api, "(model): `model` has buffers. Please use ",
              alternative, "(model) instead.");
}

void check_ensemble(const std::vector<std::shared_ptr<torch::nn::Module>>& models,
                    const char* api) {
  TORCH_CHECK(!models.empty(), api, ": Expected at least one model, got 0.");
  bool all_training = true, all_eval = true;
  for (const auto& model : models) {
    TORCH_CHECK(model != nullptr, api, ": model is null");
    all_training = all_training && model->is_training();
    all_eval = all_eval && !model->is_training();
  }
  TORCH_CHECK(all_training || all_eval, api,
              ": Expected all models to have the same training/eval mode.");
  const torch::nn::Module& first = *models.front();
  const std::type_index type0 = typeid(first);
  for (const auto& model : models) {
    const torch::nn::Module& each = *model;
    TORCH_CHECK(std::type_index(typeid(each)) == type0, api,
                ": Expected all models to be of the same class.");
  }
}

std::vector<torch::Tensor> transpose_stack(const std::vector<std::vector<torch::Tensor>>& tensors) {
  std::vector<torch::Tensor> result;
  if (tensors.empty()) return result;
  for (const auto& row : tensors) {
    TORCH_CHECK(row.size() == tensors.front().size(),
                "transpose_stack: every model must have the same number of "
                "tensors; got ",
                tensors.front().size(), " and ", row.size());
  }
  for (size_t i = 0; i < tensors.front().size(); ++i) {
    std::vector<torch::Tensor> shards;
    shards.reserve(tensors.size());
    for (const auto& row : tensors) shards.push_back(row[i]);
    result.push_back(torch::stack(shards).detach());
  }
  return result;
}

int64_t check_ensemble_shape(const std::vector<int64_t>& ensemble_shape) {
  TORCH_CHECK_VALUE(ensemble_shape.size() < 2, "NYI: ensemble_shape with more than 1 element");
  if (ensemble_shape.empty()) return 0;
  TORCH_CHECK_VALUE(ensemble_shape[0] > 0, "num_models ", ensemble_shape[0], " should be > 0");
  return ensemble_shape[0];
}

}  // namespace internal
}  // namespace functorch
