// models/'s checks for the GPU machine (benchmarks/gpu_check runs them, one
// PASS/FAIL line each; testing/gpu_check.h):
//
//   models_generate_greedy  a random float32 Llama (GQA 4/2 heads, 2
//                           layers), greedy with the key/value cache on the
//                           device: each prompt alone gives the CPU's tokens
//                           (a differing token passes only where the CPU's
//                           two best logits are within 1e-4 of each other, a
//                           tie either side may break), the two prompts of
//                           different lengths batched give each one's
//                           unbatched tokens (the padded path: its mask, its
//                           per-row RoPE positions and, on CUDA, the
//                           repeated key/value heads that keep SDPA's fused
//                           kernel), and without the cache the same tokens.
//   models_generate_speed   a bfloat16 Llama of 3 x 2048 (GQA 16/4, FFN
//                           8192, vocabulary 32,000; 0.3 G parameters) on
//                           the device: 128 new tokens after 16, batch 1;
//                           prints tokens/s and the weights' bytes read per
//                           second that implies (not a pass condition: the
//                           figure for benchmarks/RESULTS.md).
//
// Under gpu_check --dry-run-on-cpu both run on the CPU (the speed check on a
// model of 2 x 256): the checks' own logic only.
#pragma once

#include <vector>

#include <c10/core/Device.h>

#include "testing/gpu_check.h"

namespace models {

std::vector<gpu_check::Check> ModelsGpuChecks(c10::Device device);

}  // namespace models
