#include "models/rope.h"

#include <cmath>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace models {

at::Tensor RopeInverseFrequencies(const RopeConfig& rope, int64_t head_dim) {
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0,
              "models::RopeInverseFrequencies: head_dim=", head_dim,
              ": expected an even number > 0");
  // transformers: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), in
  // float32 throughout. The same ATen operations in the same order, so the
  // same roundings: Python's `scalar / tensor` is tensor.reciprocal() * scalar.
  const at::Tensor exponents =
      at::arange(0, head_dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) /
      static_cast<double>(head_dim);
  const at::Tensor inv_freq = at::pow(rope.theta, exponents).reciprocal() * 1.0;
  switch (rope.type) {
    case RopeType::kDefault: return inv_freq;
    case RopeType::kLinear: return inv_freq / rope.factor;
    case RopeType::kLlama3: break;
  }
  const double old_context = static_cast<double>(rope.original_max_position_embeddings);
  const double low_freq_wavelen = old_context / rope.low_freq_factor;
  const double high_freq_wavelen = old_context / rope.high_freq_factor;
  const at::Tensor wavelen = inv_freq.reciprocal() * (2 * M_PI);
  at::Tensor scaled = at::where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq);
  const at::Tensor smooth = (wavelen.reciprocal() * old_context - rope.low_freq_factor) /
                            (rope.high_freq_factor - rope.low_freq_factor);
  const at::Tensor smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled;
  const at::Tensor in_band =
      (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
  return at::where(in_band, smoothed, scaled);
}

std::pair<at::Tensor, at::Tensor> RopeCosSin(const at::Tensor& inv_freq,
                                             const at::Tensor& positions) {
  TORCH_CHECK(inv_freq.dim() == 1 && inv_freq.scalar_type() == at::kFloat,
              "models::RopeCosSin: inv_freq of shape ", inv_freq.sizes(), " and dtype ",
              inv_freq.scalar_type(), ": expected float32 [head_dim / 2]");
  const at::Tensor angles =
      positions.unsqueeze(-1).to(at::kFloat) * inv_freq.to(positions.device());
  const at::Tensor emb = at::cat({angles, angles}, -1);
  return {emb.cos(), emb.sin()};
}

at::Tensor ApplyRope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4, "models::ApplyRope: x of shape ", x.sizes(),
              ": expected [batch, heads, length, head_dim]");
  const int64_t half = x.size(-1) / 2;
  // One table per row ([B, T, d]) broadcasts over the heads as [B, 1, T, d].
  const at::Tensor c = cos.dim() == 3 ? cos.unsqueeze(1) : cos;
  const at::Tensor s = sin.dim() == 3 ? sin.unsqueeze(1) : sin;
  const at::Tensor rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * c + rotated * s;
}

}  // namespace models
