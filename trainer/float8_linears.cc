#include "trainer/float8_linears.h"

#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
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

absl::StatusOr<int> ConvertLinearsToFloat8(torch::nn::Module& model) {
  int converted = 0;
  for (const auto& item : model.named_modules()) {
    auto* linear = dynamic_cast<models::LlamaLinearImpl*>(item.value().get());
    if (linear == nullptr || absl::EndsWith(item.key(), "lm_head")) continue;
    linear->matmul = [](const torch::Tensor& x, const torch::Tensor& weight,
                        const torch::Tensor& bias) {
      return kernels::Float8Linear(x, weight,
                                   bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
    };
    ++converted;
  }
  if (converted == 0) {
    return absl::InvalidArgumentError(
        "--float8: the model has no Llama linear projections to convert (expected --model llama)");
  }
  return converted;
}

}  // namespace trainer
