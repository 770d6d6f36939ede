#include "kernels/swiglu.h"

#include <torch/csrc/autograd/custom_function.h>

#include "kernels/internal/autograd_util.h"
#include "kernels/internal/fused_ops.h"
#include "kernels/reference.h"

namespace kernels {
namespace {

using internal::FusedOps;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct SwiGluFunction : torch::autograd::Function<SwiGluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up,
                            const FusedOps* ops) {
    ctx->save_for_backward({gate, up});
    internal::SaveFusedOps(ctx, ops);
    return ops->SwiGluForward(gate.contiguous(), up.contiguous());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& gate = saved[0];
    const at::Tensor& up = saved[1];
    auto [grad_gate, grad_up] = internal::BackwardFusedOps(ctx)->SwiGluBackward(
        grads[0].contiguous(), gate.contiguous(), up.contiguous());
    return {ctx->needs_input_grad(0) ? grad_gate : at::Tensor(),
            ctx->needs_input_grad(1) ? grad_up : at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up) {
  const FusedOps* ops = internal::ChooseFusedOps(
      internal::Op::kSwiGlu, {gate, up},
      [&](const FusedOps& o) { return internal::UnsupportedSwiGlu(o, gate, up); });
  if (ops == nullptr) return reference::SwiGlu(gate, up);
  return SwiGluFunction::apply(gate, up, ops);
}

}  // namespace kernels
