#include "state_dict/module_state.h"

#include <string>

#include <torch/utils.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace state_dict {
namespace {

std::string ShapeString(const torch::Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.sizes(), ", "), "]");
}

}  // namespace

TensorDict ModuleStateDict(const torch::nn::Module& module) {
  TensorDict out;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    out.insert(item.key(), item.value().detach());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    out.insert(item.key(), item.value().detach());
  }
  return out;
}

absl::Status LoadModuleStateDict(torch::nn::Module& module, const TensorDict& state, bool strict) {
  TensorDict targets = ModuleStateDict(module);
  for (const auto& item : state) {
    const torch::Tensor* target = targets.find(item.key());
    if (target == nullptr) {
      if (!strict) continue;
      return absl::NotFoundError(absl::StrCat(
          "unknown tensor '", item.key(), "': the module has no parameter or buffer of that name"));
    }
    const torch::Tensor& value = item.value();
    if (!value.defined()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", item.key(), "' is undefined"));
    }
    if (value.sizes() != target->sizes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape mismatch for '", item.key(), "': checkpoint has ", ShapeString(value),
                       ", the module expects ", ShapeString(*target)));
    }
    if (value.scalar_type() != target->scalar_type()) {
      return absl::InvalidArgumentError(
          absl::StrCat("dtype mismatch for '", item.key(), "': checkpoint has ",
                       c10::toString(value.scalar_type()), ", the module expects ",
                       c10::toString(target->scalar_type())));
    }
  }
  if (strict) {
    for (const auto& item : targets) {
      if (!state.contains(item.key())) {
        return absl::NotFoundError(absl::StrCat("missing tensor '", item.key(),
                                                "': the module has it, the state dict does not"));
      }
    }
  }
  torch::NoGradGuard no_grad;
  for (const auto& item : state) {
    torch::Tensor* target = targets.find(item.key());
    if (target != nullptr) target->copy_(item.value());
  }
  return absl::OkStatus();
}

}  // namespace state_dict
