#include "kernels/rms_norm.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include "kernels/internal/aten_fused_ops.h"
#include "kernels/internal/autograd_util.h"
#include "kernels/internal/fused_ops.h"
#include "kernels/reference.h"

namespace kernels {
namespace {

using internal::FusedOps;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// RMSNorm's backward from the saved h (x, or x + residual), weight and rstd;
// grad_sum undefined for RmsNorm. (grad_h, grad_weight) in h's and weight's
// shapes. For create_graph=true, with ATen's formulas and rstd recomputed
// from h, so that the gradients are differentiable in h too.
std::pair<at::Tensor, at::Tensor> NormBackward(AutogradContext* ctx, const at::Tensor& grad_out,
                                               const at::Tensor& grad_sum, bool need_grad_h,
                                               bool need_grad_weight) {
  const variable_list saved = ctx->get_saved_variables();
  const at::Tensor& h = saved[0];
  const at::Tensor& weight = saved[1];
  const at::Tensor rstd = at::GradMode::is_enabled()
                              ? internal::RmsNormRstd(h, ctx->saved_data["eps"].toDouble())
                              : saved[2];
  return internal::BackwardFusedOps(ctx)->RmsNormBackward(
      grad_out.contiguous(), grad_sum.defined() ? grad_sum.contiguous() : at::Tensor(),
      h.contiguous(), weight.contiguous(), rstd, need_grad_h, need_grad_weight);
}

struct RmsNormFunction : torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps, const FusedOps* ops) {
    FusedOps::RmsNormOut r = ops->RmsNormForward(x.contiguous(), {}, weight.contiguous(), eps);
    ctx->save_for_backward({x, weight, r.rstd});
    ctx->saved_data["eps"] = eps;
    internal::SaveFusedOps(ctx, ops);
    return r.out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto [grad_x, grad_weight] =
        NormBackward(ctx, grads[0], {}, ctx->needs_input_grad(0), ctx->needs_input_grad(1));
    return {grad_x, grad_weight, at::Tensor(), at::Tensor()};
  }
};

struct AddRmsNormFunction : torch::autograd::Function<AddRmsNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const at::Tensor& residual, const at::Tensor& weight, double eps,
                               const FusedOps* ops) {
    FusedOps::RmsNormOut r =
        ops->RmsNormForward(x.contiguous(), residual.contiguous(), weight.contiguous(), eps);
    // h is the second output: saving it costs nothing the caller does not
    // keep (the next residual add reads it).
    ctx->save_for_backward({r.sum, weight, r.rstd});
    ctx->saved_data["eps"] = eps;
    internal::SaveFusedOps(ctx, ops);
    return {r.out, r.sum};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool need_h = ctx->needs_input_grad(0) || ctx->needs_input_grad(1);
    auto [grad_h, grad_weight] =
        NormBackward(ctx, grads[0], grads[1], need_h, ctx->needs_input_grad(2));
    return {ctx->needs_input_grad(0) ? grad_h : at::Tensor(),
            ctx->needs_input_grad(1) ? grad_h : at::Tensor(), grad_weight, at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const FusedOps* ops = internal::ChooseFusedOps(
      internal::Op::kRmsNorm, {x, weight},
      [&](const FusedOps& o) { return internal::UnsupportedRmsNorm(o, x, at::Tensor(), weight); });
  if (ops == nullptr) return reference::RmsNorm(x, weight, eps);
  return RmsNormFunction::apply(x, weight, eps, ops);
}

std::tuple<at::Tensor, at::Tensor> AddRmsNorm(const at::Tensor& x, const at::Tensor& residual,
                                              const at::Tensor& weight, double eps) {
  const FusedOps* ops = internal::ChooseFusedOps(
      internal::Op::kAddRmsNorm, {x, residual, weight},
      [&](const FusedOps& o) { return internal::UnsupportedRmsNorm(o, x, residual, weight); });
  if (ops == nullptr) return reference::AddRmsNorm(x, residual, weight, eps);
  variable_list out = AddRmsNormFunction::apply(x, residual, weight, eps, ops);
  return {out[0], out[1]};
}

}  // namespace kernels
