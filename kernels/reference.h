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

}  // namespace kernels::reference
