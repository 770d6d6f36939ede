#include "kernels/reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <ATen/Dispatch.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/silu.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

namespace kernels::reference {
namespace {

at::Tensor Rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  // One table per row ([B, T, D]) broadcasts over the heads as [B, 1, T, D].
  const at::Tensor c = cos.dim() == 3 ? cos.unsqueeze(1) : cos;
  const at::Tensor s = sin.dim() == 3 ? sin.unsqueeze(1) : sin;
  const at::Tensor rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * c + rotated * s;
}

// The float8 byte of v, by c10's conversion (the one ATen's cast uses).
uint8_t Float8Bits(float v, at::ScalarType float8_dtype) {
  return float8_dtype == at::kFloat8_e4m3fn ? c10::Float8_e4m3fn(v).x : c10::Float8_e5m2(v).x;
}

}  // namespace

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor variance = x32.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (x32 * at::rsqrt(variance + eps)).to(x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> AddRmsNorm(const at::Tensor& x, const at::Tensor& residual,
                                              const at::Tensor& weight, double eps) {
  at::Tensor h = x + residual;
  return {RmsNorm(h, weight, eps), h};
}

at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up) { return at::silu(gate) * up; }

std::tuple<at::Tensor, at::Tensor> ApplyRopeQK(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "kernels::ApplyRopeQK: q of shape ", q.sizes(),
              " and k of shape ", k.sizes(),
              ": expected [batch, heads, length, head_dim] and [batch, kv_heads, length, "
              "head_dim]");
  TORCH_CHECK(q.size(-1) % 2 == 0 && k.size(-1) == q.size(-1),
              "kernels::ApplyRopeQK: head_dim of q ", q.size(-1), " and of k ", k.size(-1),
              ": expected one even head_dim");
  return {Rope(q, cos, sin), Rope(k, cos, sin)};
}

at::Tensor LinearCrossEntropy(const at::Tensor& hidden, const at::Tensor& weight,
                              const at::Tensor& targets, int64_t ignore_index) {
  const at::Tensor logits = at::mm(hidden, weight.t()).to(at::kFloat);
  return at::cross_entropy_loss(logits, targets, /*weight=*/{}, at::Reduction::Mean, ignore_index);
}

Float8Cast CastToFloat8Tensorwise(const at::Tensor& x, at::ScalarType float8_dtype, bool transposed,
                                  const at::Tensor& given_amax) {
  TORCH_CHECK(float8_dtype == at::kFloat8_e4m3fn || float8_dtype == at::kFloat8_e5m2,
              "kernels::reference::CastToFloat8Tensorwise: float8_dtype is ", float8_dtype,
              ": expected Float8_e4m3fn or Float8_e5m2");
  TORCH_CHECK(x.dim() == 2 && x.numel() > 0,
              "kernels::reference::CastToFloat8Tensorwise: x has shape ", x.sizes(),
              ": expected a non-empty [rows, cols]");
  const double float8_max = float8_dtype == at::kFloat8_e4m3fn ? 448.0 : 57344.0;
  const at::Tensor in = x.detach().to(at::kCPU).contiguous();
  const int64_t rows = in.size(0), cols = in.size(1), n = in.numel();
  at::Tensor data = at::empty({rows, cols}, in.options().dtype(at::kByte));
  at::Tensor data_t = transposed ? at::empty({cols, rows}, data.options()) : at::Tensor();
  float scale = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, in.scalar_type(), "CastToFloat8Tensorwise", [&] {
        const scalar_t* v = in.const_data_ptr<scalar_t>();
        // amax: max |x| in x's precision (exact); a NaN is kept.
        double amax = 0;
        if (given_amax.defined()) {
          amax = given_amax.item<double>();
        } else {
          for (int64_t i = 0; i < n; ++i) {
            const double a = std::abs(static_cast<double>(v[i]));
            if (std::isnan(a) || a > amax) amax = std::isnan(amax) ? amax : a;
          }
        }
        // amax_to_scale: clamp_min (NaN stays), reciprocal, times max, float32.
        const double clamped = amax < 1e-12 ? 1e-12 : amax;
        scale = static_cast<float>((1.0 / clamped) * float8_max);
        const float max = static_cast<float>(float8_max);
        uint8_t* out = data.mutable_data_ptr<uint8_t>();
        for (int64_t i = 0; i < n; ++i) {
          float y = static_cast<float>(v[i]) * scale;
          y = y < -max ? -max : (y > max ? max : y);  // clamp; a NaN stays
          out[i] = Float8Bits(y, float8_dtype);
        }
        if (transposed) {
          uint8_t* out_t = data_t.mutable_data_ptr<uint8_t>();
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t c = 0; c < cols; ++c) out_t[c * rows + r] = out[r * cols + c];
          }
        }
      });
  const auto on_x = [&](const at::Tensor& t) { return t.to(x.device()); };
  Float8Cast result;
  result.data = on_x(data.view(float8_dtype));
  if (transposed) result.data_t = on_x(data_t.view(float8_dtype));
  result.scale = on_x(at::full({}, scale, in.options().dtype(at::kFloat)));
  result.inv_scale = on_x(at::full({}, 1.0f / scale, in.options().dtype(at::kFloat)));
  return result;
}

}  // namespace kernels::reference
