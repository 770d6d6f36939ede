// comm/'s checks for the GPU machine (benchmarks/gpu_check runs them, one
// PASS/FAIL line each; testing/gpu_check.h): the NCCL backend on one GPU, a
// world of 1.
//
//   nccl_world_of_1                every collective comm wraps on backend
//                                  "nccl": known values, compared exactly;
//                                  a CPU tensor refused
//   gloo_cpu_nccl_cuda_world_of_1  comm::kGlooCpuNcclCuda: a CPU and a CUDA
//                                  tensor reduced in the same group
//   nccl_work_stream_ordered       comm::Work on NCCL: wait_on_stream()
//                                  orders the caller's stream after the
//                                  collective, is_stream_ordered() says so
//
// They need NCCL, so with the CPU as `device` (gpu_check --dry-run-on-cpu)
// there are none. The binary must link //comm:nccl (--config=cuda).
#pragma once

#include <vector>

#include <c10/core/Device.h>

#include "testing/gpu_check.h"

namespace comm {

// The checks on `device` (cuda:0); none on the CPU.
std::vector<gpu_check::Check> CommGpuChecks(c10::Device device);

}  // namespace comm
