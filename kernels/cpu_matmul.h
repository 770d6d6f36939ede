// Float32 matrix products on the CPU through oneDNN, the library LibTorch
// carries beside its BLAS.
//
//   at::Tensor c = kernels::Mm(a, b);        // at::mm(a, b)
//   kernels::MmOut(c, a, b);                 // at::mm_out(c, a, b)
//   kernels::AddMmInPlace(acc, a, b);        // acc.addmm_(a, b)
//
// Why: at::mm hands float32 to the BLAS LibTorch was built with (MKL in the
// torch wheel) and uses oneDNN only for bfloat16, float16 or reduced-
// precision float32. On the AMD EPYC (Zen 5) machines we build on, MKL's
// sgemm ran at 103-112 GFLOP/s on one core where oneDNN's float32 matmul,
// in the same libtorch_cpu, ran at 227-257 (1024 x 256 x 4096 and the
// shapes of the Llama step; benchmarks/RESULTS.md, 2026-11-28): MKL does not
// pick its AVX-512 kernels on AMD processors. The arithmetic is float32
// either way (no bf16 or tf32 math mode is set); only the order of the sums
// differs.
//
// oneDNN serves when CpuMatmulUsesOneDnn says so: both operands dense
// float32 CPU tensors (internal/plain_cpu.h), each row- or column-major (a
// transpose is free), LibTorch built with oneDNN (at::hasMKLDNN()) and
// exporting its entry point (below), no
// autograd to record (these are for the inside of autograd Functions), and
// a product of at least kOneDnnMinMacs multiply-adds (below it oneDNN's
// per-call set-up costs more than the BLAS's slower loop: 64^3 ran in 19 us
// against MKL's 11). Anything else is the ATen op named above, so callers
// use these unconditionally.
//
// The oneDNN entry point is at::native::mkldnn_matmul, which libtorch_cpu
// exports (TORCH_API) but the wheel ships no header for: looked up once by
// its mangled name (the signature LibTorch 2.1 and later define), so a
// LibTorch without it, or with another signature, runs ATen's products
// instead of failing to link. linear_test asserts that the wheel we build
// with has it.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace kernels {

inline constexpr int64_t kOneDnnMinMacs = int64_t{1} << 20;

// Whether this LibTorch exports the oneDNN entry point.
bool OneDnnMatmulFound();

// Whether a @ b (2-D) goes to oneDNN.
bool CpuMatmulUsesOneDnn(const at::Tensor& a, const at::Tensor& b);

at::Tensor Mm(const at::Tensor& a, const at::Tensor& b);

// out: [a.size(0), b.size(1)], a's dtype; contiguous for oneDNN (otherwise
// at::mm_out).
void MmOut(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b);

// acc += a @ b.
void AddMmInPlace(const at::Tensor& acc, const at::Tensor& a, const at::Tensor& b);

}  // namespace kernels
