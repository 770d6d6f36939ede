#include "functorch/module/stack_module_state.h"

#include "functorch/module/make_functional.h"

#include <algorithm>
#include <string>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/types.h>

namespace functorch {
namespace {

// PyTorch's construct_stacked_leaf: requires_grad must agree across models;
// if it is set, the result is a new leaf (detached) that requires grad.
torch::Tensor construct_stacked_leaf(const std::vector<torch::Tensor>& tensors,
                                     const std::string& name) {
  bool all_requires_grad = true, none_requires_grad = true;
  for (const auto& t : tensors) {
    all_requires_grad = all_requires_grad && t.requires_grad();
    none_requires_grad = none_requires_grad && !t.requires_grad();
  }
  TORCH_CHECK(all_requires_grad || none_requires_grad, "Expected ", name,
              " from each model to have the same .requires_grad");
  torch::Tensor result = torch::stack(tensors);
  if (all_requires_grad) result = result.detach().requires_grad_();
  return result;
}

NamedTensors stack_named(const std::vector<internal::ExtractedState>& states, const char* kind) {
  NamedTensors stacked;
  const auto& first = states.front();
  for (size_t i = 0; i < first.names.size(); ++i) {
    const std::string& name = first.names[i];
    std::vector<torch::Tensor> tensors;
    tensors.reserve(states.size());
    for (size_t m = 0; m < states.size(); ++m) {
      const auto& names = states[m].names;
      auto it = std::find(names.begin(), names.end(), name);
      TORCH_CHECK(it != names.end(), "stack_module_state: model ", m, " has no ", kind, " '", name,
                  "' (model 0 has)");
      tensors.push_back(states[m].tensors[it - names.begin()]);
    }
    stacked.insert(name, construct_stacked_leaf(tensors, name));
  }
  return stacked;
}

}  // namespace

std::pair<NamedTensors, NamedTensors> stack_module_state(
    const std::vector<std::shared_ptr<torch::nn::Module>>& models) {
  internal::check_ensemble(models, "stack_module_state");
  std::vector<internal::ExtractedState> params, buffers;
  for (const auto& model : models) {
    params.push_back(internal::named_unique_parameters(*model));
    buffers.push_back(internal::named_unique_buffers(*model));
  }
  return {stack_named(params, "parameter"), stack_named(buffers, "buffer")};
}

}  // namespace functorch
