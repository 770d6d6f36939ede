#include "kernels/internal/aten_fused_ops.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>

#include "kernels/reference.h"

namespace kernels::internal {
namespace {

// The kernels' arithmetic type: float32 (float64 for float64 inputs, which
// only tests send here).
at::ScalarType Acc(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

at::Tensor Up(const at::Tensor& t, at::ScalarType acc) { return t.to(acc); }

// v rounded to `dtype` and back: what an op in that dtype keeps.
at::Tensor Round(const at::Tensor& v, at::ScalarType dtype) {
  return v.to(dtype).to(v.scalar_type());
}

// [B, T, D] tables broadcast over the heads as [B, 1, T, D].
at::Tensor PerHead(const at::Tensor& table) {
  return table.dim() == 3 ? table.unsqueeze(1) : table;
}

class Aten final : public FusedOps {
 public:
  const char* name() const override { return "aten"; }

  bool TakesDtype(at::ScalarType dtype) const override {
    return dtype == at::kDouble || FusedOps::TakesDtype(dtype);
  }

  RmsNormOut RmsNormForward(const at::Tensor& x, const at::Tensor& residual,
                            const at::Tensor& weight, double eps) const override {
    const at::ScalarType t = x.scalar_type();
    const at::ScalarType acc = Acc(x);
    RmsNormOut out;
    at::Tensor h = x;
    if (residual.defined()) h = out.sum = (Up(x, acc) + Up(residual, acc)).to(t);
    out.rstd = RmsNormRstd(h, eps);
    const at::Tensor normed = Round(Up(h, acc) * out.rstd.unsqueeze(-1), t);
    // The result type of weight * x: float32 for a float32 weight on
    // bf16/fp16 activations, else x's.
    const at::ScalarType out_type =
        weight.scalar_type() == at::kFloat && t != at::kDouble ? at::kFloat : t;
    out.out = (Up(weight, acc) * normed).to(out_type);
    return out;
  }

  std::pair<at::Tensor, at::Tensor> RmsNormBackward(const at::Tensor& grad_out,
                                                    const at::Tensor& grad_sum, const at::Tensor& h,
                                                    const at::Tensor& weight,
                                                    const at::Tensor& rstd, bool need_grad_h,
                                                    bool need_grad_weight) const override {
    const at::ScalarType t = h.scalar_type();
    const at::ScalarType acc = Acc(h);
    const at::Tensor go = Up(grad_out, acc);
    const at::Tensor r = Up(rstd, acc).unsqueeze(-1);
    const at::Tensor xhat = Up(h, acc) * r;
    at::Tensor grad_h, grad_weight;
    if (need_grad_h) {
      const at::Tensor g = go * Up(weight, acc);
      const at::Tensor mean_dot = (g * xhat).mean(-1, /*keepdim=*/true);
      at::Tensor d = r * (g - xhat * mean_dot);
      if (grad_sum.defined()) d = d + Up(grad_sum, acc);
      grad_h = d.to(t);
    }
    if (need_grad_weight) {
      grad_weight = (go * Round(xhat, t)).reshape({-1, h.size(-1)}).sum(0).to(weight.scalar_type());
    }
    return {grad_h, grad_weight};
  }

  at::Tensor SwiGluForward(const at::Tensor& gate, const at::Tensor& up) const override {
    const at::ScalarType t = gate.scalar_type();
    const at::ScalarType acc = Acc(gate);
    const at::Tensor silu = Round(at::silu(Up(gate, acc)), t);
    return (silu * Up(up, acc)).to(t);
  }

  std::pair<at::Tensor, at::Tensor> SwiGluBackward(const at::Tensor& grad, const at::Tensor& gate,
                                                   const at::Tensor& up) const override {
    const at::ScalarType t = gate.scalar_type();
    const at::ScalarType acc = Acc(gate);
    const at::Tensor g = Up(gate, acc);
    const at::Tensor go = Up(grad, acc);
    const at::Tensor s = at::sigmoid(g);
    const at::Tensor grad_gate = go * Up(up, acc) * s * (1 + g * (1 - s));
    const at::Tensor grad_up = go * (g * s);
    return {grad_gate.to(t), grad_up.to(t)};
  }

  std::pair<at::Tensor, at::Tensor> RopeQK(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& cos, const at::Tensor& sin,
                                           bool transpose) const override {
    return {Rope(q, cos, sin, transpose), Rope(k, cos, sin, transpose)};
  }

 private:
  // Forward: out_1 = x_1 c_1 - x_2 s_1, out_2 = x_2 c_2 + x_1 s_2 (halves 1
  // and 2 of the head); transpose: g_1 c_1 + g_2 s_2, g_2 c_2 - g_1 s_1.
  // Each product rounded to the dtype, then the sum.
  static at::Tensor Rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                         bool transpose) {
    const at::ScalarType t = x.scalar_type();
    const at::ScalarType acc = Acc(x);
    const int64_t half = x.size(-1) / 2;
    const at::Tensor c = Up(PerHead(cos), acc);
    const at::Tensor s = Up(PerHead(sin), acc);
    const at::Tensor x_acc = Up(x, acc);
    auto first = [half](const at::Tensor& v) { return v.narrow(-1, 0, half); };
    auto second = [half](const at::Tensor& v) { return v.narrow(-1, half, half); };
    const at::Tensor xc = Round(x_acc * c, t);
    at::Tensor out1, out2;
    if (!transpose) {
      out1 = first(xc) - Round(second(x_acc) * first(s), t);
      out2 = second(xc) + Round(first(x_acc) * second(s), t);
    } else {
      out1 = first(xc) + Round(second(x_acc) * second(s), t);
      out2 = second(xc) - Round(first(x_acc) * first(s), t);
    }
    at::Tensor out = at::empty_like(x);
    out.narrow(-1, 0, half).copy_(out1);
    out.narrow(-1, half, half).copy_(out2);
    return out;
  }

  // The kernel's arithmetic is the reference's, element by element (not
  // tensor expressions: ATen's recipe, kernels::CastToFloat8, is what the
  // reference is held to).
  Float8CastOut CastToFloat8(const at::Tensor& x, at::ScalarType float8_dtype, bool transposed,
                             const at::Tensor& amax) const override {
    reference::Float8Cast c = reference::CastToFloat8Tensorwise(x, float8_dtype, transposed, amax);
    return {c.data, c.data_t, c.scale, c.inv_scale};
  }
};

}  // namespace

at::Tensor RmsNormRstd(const at::Tensor& h, double eps) {
  return at::rsqrt(Up(h, Acc(h)).pow(2).mean(-1) + eps);
}

const FusedOps* AtenFusedOps() {
  static const Aten ops;
  return &ops;
}

}  // namespace kernels::internal
