#include "kernels/linear.h"

#include <optional>
#include <vector>

#include <ATen/autocast_mode.h>
#include <ATen/ops/linear.h>
#include <torch/csrc/autograd/custom_function.h>

#include "kernels/cpu_matmul.h"
#include "kernels/decode_linear.h"
#include "kernels/internal/plain_cpu.h"

namespace kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  // x W^T; the bias, if any, is added outside (autograd's own add): a
  // custom Function cannot take an undefined tensor.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    const at::Tensor y = Mm(x.reshape({-1, weight.size(1)}), weight.t());
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = weight.size(0);
    ctx->save_for_backward({x, weight});
    return y.view(shape);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor dy = grads[0].reshape({-1, weight.size(0)});
    const at::Tensor rows = x.reshape({-1, weight.size(1)});
    // Under create_graph these record autograd, and Mm is then at::mm.
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = Mm(dy, weight).view(x.sizes());
    if (ctx->needs_input_grad(1)) dw = Mm(dy.t(), rows);
    return {dx, dw};
  }
};

}  // namespace

at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (DecodeLinearApplies(x, weight, bias)) return DecodeLinear(x, weight, bias);
  const bool plain = internal::PlainCpuFloat(x) && internal::PlainCpuFloat(weight) &&
                     (!bias.defined() || internal::PlainCpuFloat(bias)) && x.dim() >= 1 &&
                     weight.dim() == 2 && x.size(-1) == weight.size(1) &&
                     (!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0))) &&
                     !at::autocast::is_autocast_enabled(at::kCPU);
  if (!plain) {
    return at::linear(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
  }
  const at::Tensor y = LinearFunction::apply(x, weight);
  return bias.defined() ? y + bias : y;
}

}  // namespace kernels
