// fsdp/'s checks for the GPU machine (benchmarks/gpu_check runs them, one
// PASS/FAIL line each; testing/gpu_check.h): both FSDPs on one GPU, each
// check once for FullyShardedDataParallel (fsdp_*) and once for
// fsdp::fully_shard (fully_shard_*: each block, then the root, resharding
// after forward; bf16 as MixedPrecisionPolicy(bf16, fp32), offload as
// CPUOffloadPolicy).
//
//   fsdp_parity_full_shard_fp32,  FULL_SHARD (device_id cuda:0,
//   fully_shard_parity_fp32       use_orig_params) on an NCCL world of 1
//                                 against the unwrapped model on cuda:0
//   fsdp_parity_bf16,             bf16 parameters, fp32 reduction: losses
//   fully_shard_parity_bf16       near the fp32 run's, gradients finite and
//                                 fp32
//   fsdp_parity_cpu_offload,      the shard pinned on the CPU, same numbers
//   fully_shard_parity_cpu_offload as the fp32 reference
//   fsdp_gloo_2_ranks_cuda,       2 ranks (this program re-executed, below)
//   fully_shard_gloo_2_ranks_cuda on the one GPU over Gloo with CUDA
//                                 tensors: FULL_SHARD with real collectives
//                                 against the unwrapped model
//   fsdp_step_no_sync,            one full training step (forward, backward
//   fully_shard_step_no_sync      with the gradient reduction, optim/'s
//                                 fused AdamW; bf16 parameters, fp32
//                                 reduction) on the NCCL world of 1 under
//                                 CUDA's sync-debug mode error, 3 times after
//                                 a warm-up step and a step that counts the
//                                 synchronisations under mode warn: only the
//                                 loss is read
//   fully_shard_float8_all_gather two bf16 float8 linears whose weights
//                                 are gathered as e4m3 (float8_all_gather_fn)
//                                 against the same model unsharded casting
//                                 its own: 3 SGD steps' outputs and
//                                 gradients bit for bit, the gathered bytes
//                                 the whole weights' casts (needs sm_89+)
//
// The checks train trainer/models.h's transformer (2 layers, width 64, seq
// 32) for 5 SGD steps (lr 0.1, momentum 0.9) on one fixed batch of 8 rows,
// and the unwrapped model (built with the same seed) likewise. Tolerances:
// fp32 losses and final parameters rtol 1e-5, atol 1e-6 (those of
// tests/fsdp_parity_test.cc); bf16 losses within 2e-2 relative of the fp32
// reference's.
//
// On a one-rank group FSDP sends nothing (a one-rank shard group's gather
// and reduce-scatter are local copies), so the world-of-1 checks test
// FSDP's device placement, streams and offload, and the 2-rank Gloo checks
// its collectives on CUDA tensors. NCCL cannot put two ranks on one GPU.
//
// With the CPU as `device` (gpu_check --dry-run-on-cpu) the same checks run
// on the CPU over Gloo (no sync-debug mode, shards not pinned): that checks
// the checks, not the CUDA build.
#pragma once

#include <optional>
#include <string_view>
#include <vector>

#include <c10/core/Device.h>

#include "testing/gpu_check.h"

namespace fsdp {

// The checks on `device` (cuda:0, or the CPU for a dry run).
std::vector<gpu_check::Check> FsdpGpuChecks(c10::Device device);

// The 2-rank checks start their ranks as this program again
// (/proc/self/exe, through launcher::launch) with the arguments
//
//   kGpuCheckRankArg  fsdp1|fully_shard  [gpu_check::kDryRunOnCpuArg]
//
// and the program's main hands such a process to RunGpuCheckRank instead of
// running its checks.
inline constexpr char kGpuCheckRankArg[] = "--gloo-rank-child";

enum class GpuCheckApi { kFullyShardedDataParallel, kFullyShard };

// "fsdp1" or "fully_shard" (the argument after kGpuCheckRankArg); nothing
// for any other.
std::optional<GpuCheckApi> ParseGpuCheckApi(std::string_view name);

// One rank: `api` on the world group (Gloo, from the launcher's
// environment) against the unwrapped model, which every rank trains itself
// on the whole batch. Rank 0 prints one "RESULT ..." line, a rank that
// finds a problem "PROBLEMS ..." on stderr; returns the exit status (0: matched).
int RunGpuCheckRank(GpuCheckApi api, c10::Device device);

}  // namespace fsdp
