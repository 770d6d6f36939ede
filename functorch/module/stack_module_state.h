// stack_module_state(models) -> (params, buffers), as torch.func's: for M
// models of one class and training mode, every parameter and buffer stacked
// along a new leading dimension of size M, keyed by name (state-dict names;
// a tied tensor once, under its first name). Stacked parameters are new
// leaves (requires_grad when the models' are), unrelated to the models'
// parameters, ready for an optimizer; buffers are stacked as they are.
//
//   std::vector<torch::nn::Linear> models = ...;
//   auto [params, buffers] = functorch::stack_module_state(models);
//   // per model: functional_call(models[0], {params_i, buffers_i}, x), or
//   // vmap over dim 0 with functorch/transforms.
#pragma once

#include "functorch/module/functional_call.h"
#include "functorch/module/internal/module_traits.h"

#include <torch/nn/module.h>

#include <memory>
#include <utility>
#include <vector>

namespace functorch {

std::pair<NamedTensors, NamedTensors> stack_module_state(
    const std::vector<std::shared_ptr<torch::nn::Module>>& models);

// Any module handle type (ModuleHolder, shared_ptr<Impl>, AnyModule).
template <typename ModuleType>
std::pair<NamedTensors, NamedTensors> stack_module_state(const std::vector<ModuleType>& models) {
  std::vector<std::shared_ptr<torch::nn::Module>> ptrs;
  ptrs.reserve(models.size());
  for (const auto& model : models) ptrs.push_back(internal::module_ptr(model));
  return stack_module_state(ptrs);
}

}  // namespace functorch
