// y = x W^T + b for the few rows of a decode step on the CPU, at the speed
// of reading W from memory.
//
//   at::Tensor y = kernels::DecodeLinear(x, weight, bias);  // at::linear's contract
//
// Why: each generated token multiplies a [batch, 1, in] activation by every
// weight matrix of the model, a matrix-vector product per row whose cost is
// reading W once (4 bytes per parameter in float32). at::linear hands it to
// the BLAS's sgemm, which streams W at about half of what a vectorised read
// of memory reaches on the machines we measured (benchmarks/RESULTS.md,
// generation on the CPU): past the last-level cache, a decode step ran at
// that speed. This kernel reads each row of W once and dots it with every
// row of x while the row is in L1, four rows of W at a time (four
// independent accumulators and prefetch streams), with AVX-512 or AVX2 FMAs
// chosen at run time, the output features split over at::parallel_for's
// threads.
//
// It takes over only where that is the whole story (DecodeLinearApplies):
// dense float32 CPU tensors, a contiguous [out, in] weight, x with at most
// kDecodeLinearMaxRows rows (the product of its leading dimensions), no
// autograd to record (inference mode, no grad mode, or nothing that requires
// grad), no functorch transform and no autocast around it. Everything else
// is at::linear, so a caller uses DecodeLinear unconditionally.
//
// Numerics: float32 accumulation in another order than the BLAS's, so the
// results differ from at::linear's in the last bits (tested to 1e-5
// relative).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace kernels {

// Rows of x up to which a row of W, once read, is reused from L1; past it a
// GEMM's blocking pays.
inline constexpr int64_t kDecodeLinearMaxRows = 8;

// Whether DecodeLinear computes (x, weight, bias) itself; otherwise it is
// at::linear. bias may be undefined.
bool DecodeLinearApplies(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

// at::linear(x, weight, bias): x [..., in], weight [out, in], bias [out] or
// undefined; returns [..., out].
at::Tensor DecodeLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

}  // namespace kernels
