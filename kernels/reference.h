// The semantics of kernels/'s fused ops: each one the plain ATen composite
// the model code computes (models/llama.cc, models/rope.cc, transformers'
// modeling_llama.py), differentiated by autograd. Every op of kernels/ runs
// these on the CPU (and on CUDA inputs its kernel does not take), and the
// tests hold the fused paths to them.
//
// Roundings: in bfloat16/float16 every ATen op rounds its result to the
// dtype; the kernels round at the same points (kernels/internal/
// cuda_kernels.h), so they differ from these only in the order of a sum and
// the last bit of exp / sqrt.
#pragma once

#include <cstdint>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace kernels::reference {

// transformers' LlamaRMSNorm (models::LlamaRMSNorm):
//   weight * (x32 * rsqrt(mean(x32^2, -1) + eps)).to(x.dtype),  x32 = x.float()
// x: [..., hidden]; weight: [hidden]. The result has result_type(x, weight).
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

// The pre-norm decoder's residual step, h = x + residual; (RmsNorm(h), h).
std::tuple<at::Tensor, at::Tensor> AddRmsNorm(const at::Tensor& x, const at::Tensor& residual,
                                              const at::Tensor& weight, double eps);

// LlamaMLP's activation: silu(gate) * up.
at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up);

// models::ApplyRope on q and on k: x * cos + rotate_half(x) * sin,
// rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]). q [B, H, T, D], k [B,
// Hkv, T, D]; cos, sin [T, D] or [B, T, D] (one table per row).
std::tuple<at::Tensor, at::Tensor> ApplyRopeQK(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin);

// transformers' ForCausalLMLoss on already shifted rows: the mean
// cross-entropy of the float32 logits (hidden @ weight.T).float() against
// targets, rows whose target is ignore_index left out (NaN when all are).
// hidden [N, H], weight [V, H], targets int64 [N]. Materialises the [N, V]
// logits: the spec LinearCrossEntropy is held to, not a way to train.
at::Tensor LinearCrossEntropy(const at::Tensor& hidden, const at::Tensor& weight,
                              const at::Tensor& targets, int64_t ignore_index = -100);

// torchao's tensorwise dynamic float8 cast (hp_tensor_to_float8_dynamic;
// kernels::CastToFloat8 in float8_linear.h computes it with ATen operators)
// as the fused CUDA cast computes it (internal/cuda_kernels.cu), element by
// element in plain C++ on the CPU, step for step:
//   amax      = max |x|                 (exact; a NaN anywhere makes it NaN,
//               and then the scale and every byte: a NaN's sign is not
//               specified, and ATen's CPU recipe gives -NaN where this +NaN)
//   scale     = float32(float8_max * (1 / max(float64(amax), 1e-12)))
//               (float64: a correctly rounded reciprocal, then the product)
//   data      = float8(clamp(float32(x) * scale, -float8_max, float8_max))
//               (c10's round-to-nearest-even conversion; a NaN stays NaN)
//   inv_scale = float32(1 / scale)
//   data_t    = data transposed, row-major [cols, rows] (when `transposed`)
// x: [rows, cols], float32, bfloat16, float16 or float64, on any device
// (computed on the CPU, returned on x's device); float8_dtype:
// Float8_e4m3fn or Float8_e5m2. With `amax` (one element, any floating
// dtype and device) that is the amax instead of max |x| (torchao's
// reduce_amax). float8_linear_test holds it to kernels::CastToFloat8 and to
// torchao bit for bit.
struct Float8Cast {
  at::Tensor data;       // float8_dtype [rows, cols]
  at::Tensor data_t;     // float8_dtype [cols, rows]; undefined unless `transposed`
  at::Tensor scale;      // float32 scalar
  at::Tensor inv_scale;  // float32 scalar
};
Float8Cast CastToFloat8Tensorwise(const at::Tensor& x, at::ScalarType float8_dtype, bool transposed,
                                  const at::Tensor& amax = at::Tensor());

}  // namespace kernels::reference
