#include "trainer/float8_linears.h"

#include <optional>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "fsdp/fully_shard.h"
#include "kernels/float8_linear.h"
#include "models/llama.h"

namespace trainer {

absl::Status CheckFloat8Device(const c10::Device& device) {
  std::string why;
  if (kernels::Float8MatmulSupported(device, &why)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--float8 on ", device.str(), ": ", why,
                   "; expected a CUDA device of compute capability 8.9 or later (--device cuda)"));
}

absl::StatusOr<int> ConvertLinearsToFloat8(torch::nn::Module& model,
                                           bool fully_shard_gathers_weights) {
  int converted = 0;
  for (const auto& item : model.named_modules()) {
    auto* linear = dynamic_cast<models::LlamaLinearImpl*>(item.value().get());
    if (linear == nullptr || absl::EndsWith(item.key(), "lm_head")) continue;
    linear->matmul = [fully_shard_gathers_weights](const torch::Tensor& x,
                                                   const torch::Tensor& weight,
                                                   const torch::Tensor& bias) {
      const std::optional<at::Tensor> b =
          bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
      if (fully_shard_gathers_weights) {
        if (auto cast = fsdp::float8_unsharded_param(weight)) {
          return kernels::Float8Linear(x, weight, *cast, b);
        }
      }
      return kernels::Float8Linear(x, weight, b);
    };
    ++converted;
  }
  if (converted == 0) {
    return absl::InvalidArgumentError(
        "--float8: the model has no Llama linear projections to convert (expected --model llama)");
  }
  return converted;
}

std::function<bool(const at::Tensor& param)> Float8ConvertedWeights(torch::nn::Module& model) {
  std::set<const c10::TensorImpl*> weights;
  for (const auto& item : model.modules()) {
    auto* linear = dynamic_cast<models::LlamaLinearImpl*>(item.get());
    if (linear != nullptr && linear->matmul) weights.insert(linear->weight.unsafeGetTensorImpl());
  }
  return [weights = std::move(weights)](const at::Tensor& param) {
    return weights.count(param.unsafeGetTensorImpl()) > 0;
  };
}

}  // namespace trainer
