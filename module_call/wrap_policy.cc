#include "module_call/wrap_policy.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>

#include <typeinfo>
#include <utility>

namespace module_call {

AutoWrapPolicy size_based_auto_wrap_policy(int64_t min_num_params) {
  TORCH_CHECK(min_num_params >= 1, "size_based_auto_wrap_policy: min_num_params=", min_num_params,
              ": expected >= 1");
  AutoWrapPolicy policy;
  policy.should_wrap = [min_num_params](const torch::nn::Module& module, const std::string& /*fqn*/,
                                        int64_t nonwrapped_numel) {
    // A container is never called as a whole, so a unit there would never
    // run its pre-forward.
    if (dynamic_cast<const torch::nn::ModuleListImpl*>(&module) != nullptr ||
        dynamic_cast<const torch::nn::ModuleDictImpl*>(&module) != nullptr) {
      return false;
    }
    return nonwrapped_numel >= min_num_params;
  };
  return policy;
}

AutoWrapPolicy module_type_auto_wrap_policy(std::set<std::type_index> module_types) {
  TORCH_CHECK(!module_types.empty(), "module_type_auto_wrap_policy: module_types ",
              "is empty: expected at least one module type (e.g. typeid(BlockImpl))");
  AutoWrapPolicy policy;
  policy.should_wrap = [types = std::move(module_types)](const torch::nn::Module& module,
                                                         const std::string& /*fqn*/,
                                                         int64_t /*nonwrapped_numel*/) {
    return types.count(std::type_index(typeid(module))) != 0;
  };
  return policy;
}

AutoWrapPolicy custom_auto_wrap_policy(AutoWrapPolicy::Predicate predicate) {
  TORCH_CHECK(predicate != nullptr,
              "custom_auto_wrap_policy: predicate is empty: ", "expected a callable");
  AutoWrapPolicy policy;
  policy.should_wrap = std::move(predicate);
  return policy;
}

}  // namespace module_call
