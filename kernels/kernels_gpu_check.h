// kernels/'s checks for the GPU machine: each fused op on a CUDA device
// against its ATen reference on the same device (forward and gradients,
// float32 and bfloat16, the shapes models/ uses and awkward ones), that the
// kernel path was the one taken (no fallback warning), and
// LinearCrossEntropy's peak device memory against the reference's.
//
// benchmarks/gpu_check runs them beside the other components' checks (one
// PASS/FAIL line each; testing/gpu_check.h):
//
//   kernels_cuda_linked, kernels_rms_norm, kernels_swiglu, kernels_rope_qk,
//   kernels_linear_cross_entropy, kernels_float8_cast, kernels_float8_linear,
//   kernels_fallback_warns
//
// kernels_float8_cast holds Float8Linear's fused cast to the ATen recipe
// (kernels::CastToFloat8) on the device bit for bit (bytes of both layouts,
// scales) and times it against the recipe; kernels_float8_linear holds
// Float8Linear with the fused casts to the same op with the reference casts
// bit for bit and times it against bf16 at::linear (devices with float8
// matrix products only).
//
// With the CPU as `device` (gpu_check --dry-run-on-cpu, and
// //kernels:dispatch_test) the same comparisons run on the CPU through
// internal/aten_fused_ops.h, which computes what the kernels compute: that
// checks the checks, not the kernels.
#pragma once

#include <vector>

#include <c10/core/Device.h>

#include "testing/gpu_check.h"

namespace kernels {

// The checks, to run on `device` (cuda:N, or the CPU for a dry run).
// kernels_cuda_linked fails on a CUDA device when the binary does not link
// //kernels:cuda; on the CPU it fails so only when `expect_cuda_kernels`
// (gpu_check built with CUDA: a dry run then catches a link that dropped the
// alwayslink kernels before a GPU run would), else it says whether they are.
std::vector<gpu_check::Check> KernelsGpuChecks(c10::Device device,
                                               bool expect_cuda_kernels = false);

}  // namespace kernels
