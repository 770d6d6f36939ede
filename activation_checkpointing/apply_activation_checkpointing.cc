#include "activation_checkpointing/apply_activation_checkpointing.h"

#include <torch/nn/module.h>

#include <functional>
#include <unordered_set>
#include <utility>

#include "activation_checkpointing/internal/checkpoint_function.h"
#include "module_call/forward_hooks.h"

namespace activation_checkpointing {
namespace {

// A chosen module's forward at the module call point: a checkpointed region
// whose declared tensors are the module's parameters, with the module's
// before-rerun hooks (FSDP gathers the unit again) around the recomputation.
std::vector<at::Tensor> run_checkpointed_module(const std::shared_ptr<torch::nn::Module>& module,
                                                module_call::TensorFunction forward,
                                                std::vector<at::Tensor> inputs) {
  internal::Declared declared;
  declared.params = [module] { return module->parameters(); };
  declared.before_recompute = [module] { module_call::run_before_rerun_hooks(*module); };
  declared.before_backward = [module] { module_call::run_before_rerun_backward_hooks(*module); };
  declared.what = "activation checkpointing of module " + module->name();
  return internal::run_checkpointed(std::move(forward), std::move(inputs), std::move(declared),
                                    /*preserve_rng_state=*/true);
}

}  // namespace

std::vector<std::string> apply_activation_checkpointing(
    const std::shared_ptr<torch::nn::Module>& model, const module_call::AutoWrapPolicy& policy) {
  TORCH_CHECK(model != nullptr, "apply_activation_checkpointing: model is null");
  TORCH_CHECK(static_cast<bool>(policy),
              "apply_activation_checkpointing: policy is empty: "
              "expected a policy that chooses modules, e.g. "
              "module_call::module_type_auto_wrap_policy<BlockImpl>()");
  // The same walk as FSDP's auto-wrap (fsdp/internal/init.cc): post-order,
  // each parameter counted once, a chosen module's parameters taken.
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> chosen;
  std::unordered_set<const c10::TensorImpl*> counted;
  std::function<int64_t(const std::shared_ptr<torch::nn::Module>&, const std::string&)> visit =
      [&](const std::shared_ptr<torch::nn::Module>& module, const std::string& fqn) -> int64_t {
    int64_t numel = 0;
    for (const auto& child : module->named_children()) {
      numel += visit(child.value(), fqn.empty() ? child.key() : fqn + "." + child.key());
    }
    for (const auto& p : module->parameters(/*recurse=*/false)) {
      if (p.defined() && counted.insert(p.unsafeGetTensorImpl()).second) numel += p.numel();
    }
    if (module.get() == model.get()) return numel;
    if (policy.should_wrap(*module, fqn, numel)) {
      chosen.emplace_back(fqn, module);
      return 0;
    }
    return numel;
  };
  visit(model, "");
  std::vector<std::string> names;
  for (const auto& [fqn, module] : chosen) {
    module_call::set_region_runner(module, run_checkpointed_module);
    names.push_back(fqn);
  }
  return names;
}

bool is_checkpointed(const torch::nn::Module& module) {
  return module_call::has_region_runner(module);
}

}  // namespace activation_checkpointing
