// functorch/transforms' checks for the GPU machine (benchmarks/gpu_check
// runs them, one PASS/FAIL line each; testing/gpu_check.h): the transforms
// on the device give the CPU's results, and how long a call takes beside
// torch.func's (benchmarks/run_gpu.sh reads the "median X ms of N calls"
// of these lines and runs torch.func's peers on the same device).
//
//   functorch_per_sample_grads  vmap(grad(loss)) of an MLP 128-256-10,
//                               cross-entropy, batch 256, float32
//                               (transforms_bench's BM_PerSampleGrad_VmapGrad)
//                               against the CPU (max-norm relative 1e-5),
//                               timed: median of 20 calls
//   functorch_batched_hessians  vmap(jacfwd(jacrev(u))) of a 2-512-512-512-3
//                               tanh MLP at 1024 points (hessian_bench's PINN
//                               case) against the CPU (max-norm relative
//                               1e-4), timed: median of 20 calls
//
// With the CPU as `device` (gpu_check --dry-run-on-cpu) they compare the
// CPU with itself (trivially exact), with 3 timed Hessian calls.
#pragma once

#include <vector>

#include <c10/core/Device.h>

#include "testing/gpu_check.h"

namespace functorch {

// The checks on `device` (cuda:0, or the CPU for a dry run).
std::vector<gpu_check::Check> TransformsGpuChecks(c10::Device device);

}  // namespace functorch
