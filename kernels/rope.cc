#include "kernels/rope.h"

#include <torch/csrc/autograd/custom_function.h>

#include "kernels/internal/autograd_util.h"
#include "kernels/internal/fused_ops.h"
#include "kernels/reference.h"

namespace kernels {
namespace {

using internal::FusedOps;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The kernel takes any strides but a contiguous last dimension.
at::Tensor LastDimContiguous(const at::Tensor& x) {
  return x.size(-1) <= 1 || x.stride(-1) == 1 ? x : x.contiguous();
}

struct RopeQKFunction : torch::autograd::Function<RopeQKFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& cos, const at::Tensor& sin, const FusedOps* ops) {
    const at::Tensor c = cos.contiguous();
    const at::Tensor s = sin.contiguous();
    ctx->save_for_backward({c, s});
    internal::SaveFusedOps(ctx, ops);
    auto [q_out, k_out] = ops->RopeQK(LastDimContiguous(q), LastDimContiguous(k), c, s,
                                      /*transpose=*/false);
    return {q_out, k_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_q, grad_k] = internal::BackwardFusedOps(ctx)->RopeQK(
        LastDimContiguous(grads[0]), LastDimContiguous(grads[1]), saved[0], saved[1],
        /*transpose=*/true);
    return {ctx->needs_input_grad(0) ? grad_q : at::Tensor(),
            ctx->needs_input_grad(1) ? grad_k : at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> ApplyRopeQK(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin) {
  const FusedOps* ops = internal::ChooseFusedOps(
      internal::Op::kApplyRopeQK, {q, k, cos, sin},
      [&](const FusedOps& o) { return internal::UnsupportedRopeQK(o, q, k, cos, sin); });
  if (ops == nullptr) return reference::ApplyRopeQK(q, k, cos, sin);
  variable_list out = RopeQKFunction::apply(q, k, cos, sin, ops);
  return {out[0], out[1]};
}

}  // namespace kernels
