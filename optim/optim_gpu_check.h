// optim/'s check for the GPU machine (benchmarks/gpu_check runs it, one
// PASS/FAIL line; testing/gpu_check.h):
//
//   fused_optimizers  optim/'s fused and foreach Adam (amsgrad), AdamW, SGD
//                     (nesterov) on the device (float32 and bfloat16
//                     parameters: two buckets of the fused kernels), 4
//                     steps, against torch::optim's on the CPU in float32;
//                     the steps after the first under CUDA's sync-debug
//                     mode error (testing/sync_debug_mode.h), so a step
//                     that makes the host wait for the GPU fails
//   capturable_optimizers  the same optimizers in capturable mode against
//                     the ordinary mode of the same implementation over 6
//                     steps of a learning rate that changes every step
//                     (fused: bit for bit, with a found_inf that skips one
//                     step; foreach: within 1e-5, 2e-2 for bfloat16);
//                     write_device_values() and the steps after the first
//                     two under sync-debug mode error. NEVER YET RUN ON A GPU
//                     (written without one).
//
// With the CPU as `device` (gpu_check --dry-run-on-cpu) the same
// comparison in float32 only, without the sync-debug mode.
#pragma once

#include <vector>

#include <c10/core/Device.h>

#include "testing/gpu_check.h"

namespace optim {

// The check on `device` (cuda:0, or the CPU for a dry run).
std::vector<gpu_check::Check> OptimGpuChecks(c10::Device device);

}  // namespace optim
