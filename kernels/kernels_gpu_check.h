// kernels/'s checks for the GPU machine: each fused op on a CUDA device
// against its ATen reference on the same device (forward and gradients,
// float32 and bfloat16, the shapes models/ uses and awkward ones), that the
// kernel path was the one taken (no fallback warning), and
// LinearCrossEntropy's peak device memory against the reference's.
//
// benchmarks/gpu_check runs them beside its own (one PASS/FAIL line each):
//
//   for (kernels::GpuCheck& check : kernels::KernelsGpuChecks(device)) ...
//
// With the CPU as `device` (gpu_check --dry-run-on-cpu, and
// //kernels:dispatch_test) the same comparisons run on the CPU through
// internal/aten_fused_ops.h, which computes what the kernels compute: that
// checks the checks, not the kernels.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <c10/core/Device.h>

namespace kernels {

struct GpuCheckResult {
  bool ok;
  std::string detail;  // what was compared and how closely it matched, or what was wrong
};

struct GpuCheck {
  std::string name;  // "kernels_rms_norm", ...
  std::function<GpuCheckResult()> run;
};

// The checks, to run on `device` (cuda:N, or the CPU for a dry run).
std::vector<GpuCheck> KernelsGpuChecks(c10::Device device);

}  // namespace kernels
