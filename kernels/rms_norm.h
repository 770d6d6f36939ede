// RMSNorm, and RMSNorm fused with the residual add before it: one kernel
// forward and one backward each, on CUDA.
//
//   at::Tensor n = kernels::RmsNorm(x, weight, eps);                 // LlamaRMSNorm
//   auto [n, h] = kernels::AddRmsNorm(x, attn_out, weight, eps);     // h = x + attn_out
//
// Semantics: exactly transformers' LlamaRMSNorm (reference.h): statistics in
// float32, the normalised x cast back to x's dtype, then multiplied by the
// weight (whose dtype, with x's, gives the result's: bf16 x with a bf16
// weight is bf16, with a float32 weight float32).
//
// Why fused: the composite is seven ATen kernels (x.float(), pow, mean, +
// eps, rsqrt, *, .to(dtype), * weight), most of which read and write the
// whole [tokens, hidden] activation in float32, and autograd saves the
// float32 copy of x and the normalised x for backward. The kernel reads a
// row, reduces it in one block, writes the output once, and keeps for
// backward x (which the layer before keeps anyway) and one float per row
// (1/rms); the backward reads x, the output's gradient and the weight once
// more and writes x's gradient, the weight's gradient as per-block float32
// partial sums reduced by one ATen sum. AddRmsNorm adds the pre-norm
// decoder's residual step (h = x + attn_out; n = norm(h)): the sum is
// written once, while the norm reads it, instead of being written by one
// kernel and read back by the next; its backward adds the new residual's
// gradient into the same pass.
//
// Dispatch (internal/fused_ops.h): CUDA tensors of float32, bfloat16 or
// float16 (the weight in x's dtype or float32) run the kernel; anything
// else runs the reference, and a CUDA input that falls back says why once.
// The kernel path is an autograd::Function whose backward is a kernel too;
// asked for a backward it can differentiate again (create_graph=true), it
// computes the same formulas with ATen operators instead.
#pragma once

#include <tuple>

#include <ATen/core/Tensor.h>

namespace kernels {

// x: [..., hidden]; weight: [hidden]. Returns [..., hidden].
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

// h = x + residual (same shape and dtype); returns (RmsNorm(h, weight, eps),
// h): the normalised input of the next sublayer, and the new residual.
std::tuple<at::Tensor, at::Tensor> AddRmsNorm(const at::Tensor& x, const at::Tensor& residual,
                                              const at::Tensor& weight, double eps);

}  // namespace kernels
