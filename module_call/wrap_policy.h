// Auto-wrap policies: which submodules of a model a feature takes (PyTorch's
// torch.distributed.fsdp.wrap, which both FSDP and apply_activation_checkpointing
// take as `auto_wrap_policy`). FSDP makes them units; activation
// checkpointing checkpoints them.
//
//   options.auto_wrap_policy = module_call::module_type_auto_wrap_policy<BlockImpl>();
//
// The feature walks the module tree bottom-up (post-order, in registration
// order). For every submodule other than the root it asks the policy whether
// to take it, passing the number of parameters in its subtree that no deeper
// chosen module (and, in FSDP, no ignored module) has taken yet. A chosen
// module takes those parameters; the root keeps whatever is left. A parameter
// reachable from several modules counts once, for the first module
// (registration order) that reaches it.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <set>
#include <string>
#include <typeindex>

namespace torch {
namespace nn {
class Module;
}  // namespace nn
}  // namespace torch

namespace module_call {

struct AutoWrapPolicy {
  // `module`: the candidate; `fqn`: its name relative to the wrapped root;
  // `nonwrapped_numel`: parameters in its subtree no deeper chosen module took.
  using Predicate = std::function<bool(const torch::nn::Module& module, const std::string& fqn,
                                       int64_t nonwrapped_numel)>;
  // Empty: chooses nothing (FSDP: only the root is a unit).
  Predicate should_wrap;

  explicit operator bool() const { return static_cast<bool>(should_wrap); }
};

// PyTorch's size_based_auto_wrap_policy: wrap a module once its not yet
// wrapped subtree holds at least `min_num_params` parameters. Containers
// (ModuleList, ModuleDict) are never wrapped themselves, as in PyTorch: their
// owner calls the elements, never the container. Error unless
// min_num_params >= 1.
AutoWrapPolicy size_based_auto_wrap_policy(int64_t min_num_params);

// PyTorch's ModuleWrapPolicy / transformer_auto_wrap_policy: wrap every module
// whose dynamic type is one of `module_types` (the Impl classes:
// typeid(BlockImpl), not the holder). Error when the set is empty.
AutoWrapPolicy module_type_auto_wrap_policy(std::set<std::type_index> module_types);

// Convenience: module_type_auto_wrap_policy({typeid(Impls)...}).
template <typename... Impls>
AutoWrapPolicy module_type_auto_wrap_policy() {
  return module_type_auto_wrap_policy(std::set<std::type_index>{typeid(Impls)...});
}

// A user predicate (PyTorch's CustomPolicy / lambda_auto_wrap_policy).
AutoWrapPolicy custom_auto_wrap_policy(AutoWrapPolicy::Predicate predicate);

}  // namespace module_call
