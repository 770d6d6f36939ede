// gpu_check: what the CUDA build does on a real GPU, in one run, for the
// rarely lent GPU machine (benchmarks/run_gpu.sh builds and runs it there).
// Not a Google Benchmark: one line per check,
//
//   PASS name  what was compared, and how closely it matched (3.2 s)
//   FAIL name  what was wrong (0.4 s)
//
// then "gpu_check: N passed, M failed", and exit status 1 when any check
// failed, 0 when all passed. Built without CUDA (the default, CPU-only
// build), or run where LibTorch sees no CUDA device, it prints
// "NOT RUN: <why>" and exits 77 (the automake "skipped" code), so a script
// can tell "no GPU here" from "broken".
//
// The checks live beside what they check, one file per component
// (testing/gpu_check.h says what a check is); this file only runs them, a
// component after those it builds on:
//   comm/comm_gpu_check.h                        nccl_world_of_1,
//                                                gloo_cpu_nccl_cuda_world_of_1,
//                                                nccl_work_stream_ordered
//   optim/optim_gpu_check.h                      fused_optimizers
//   fsdp/fsdp_gpu_check.h                        fsdp_* and fully_shard_*: parity
//                                                fp32, bf16, CPU offload; 2 ranks
//                                                over Gloo; a step with no host
//                                                synchronisation
//   functorch/transforms/transforms_gpu_check.h  functorch_per_sample_grads,
//                                                functorch_batched_hessians
//   kernels/kernels_gpu_check.h                  kernels_*: each CUDA kernel
//                                                against its ATen reference
//   trainer/trainer_gpu_check.h                  trainer_cuda_graphs: the
//                                                trainer's captured step
//                                                against its eager step
//
// Usage: gpu_check [--only SUBSTRING] [--dry-run-on-cpu]
//   --only            runs the checks whose name contains SUBSTRING
//   --dry-run-on-cpu  every check with the CPU as its device: the FSDP checks
//                     on the CPU over Gloo (no NCCL checks), the functorch
//                     checks CPU against CPU (trivially exact; 3 timed Hessian
//                     calls), the kernels' checks through their ATen stand-in:
//                     tests the checks' own logic without a GPU
// Exit status: 0 all passed, 1 a check failed, 2 bad arguments, 77 not run.
#include <dlfcn.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/comm_gpu_check.h"
#include "fsdp/fsdp_gpu_check.h"
#include "functorch/transforms/transforms_gpu_check.h"
#include "kernels/kernels_gpu_check.h"
#include "models/models_gpu_check.h"
#include "optim/optim_gpu_check.h"
#include "testing/gpu_check.h"
#include "trainer/trainer_gpu_check.h"

namespace {

#ifdef TORCHFSDP_CUDA
constexpr bool kBuiltWithCuda = true;
#else
constexpr bool kBuiltWithCuda = false;
#endif

// The exit status that means "skipped" (automake's convention).
constexpr int kNotRun = 77;

// The reason the checks cannot run here, or nothing.
std::optional<std::string> WhyNotRun() {
  if (!kBuiltWithCuda) {
    return std::string(
        "gpu_check was built without CUDA (TORCHFSDP_CUDA undefined): build it with "
        "`bazel build --config=cuda //benchmarks:gpu_check` or benchmarks/gpu/CMakeLists.txt");
  }
  const int devices = static_cast<int>(torch::cuda::device_count());
  if (devices > 0) return std::nullopt;
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  // Without libtorch_cuda in the process LibTorch sees no device even on a
  // GPU machine (a link that dropped it): say which case this is.
  void* torch_cuda = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD);
  if (torch_cuda != nullptr) dlclose(torch_cuda);
  return absl::StrCat("no CUDA device (torch::cuda::device_count() is 0; LibTorch ", TORCH_VERSION,
                      ", libtorch_cuda.so ", torch_cuda != nullptr ? "loaded" : "NOT loaded",
                      "; CUDA_VISIBLE_DEVICES=",
                      visible != nullptr ? absl::StrCat("'", visible, "'") : "unset", ")");
}

// Every component's checks on `device`, lower layers first: a component's
// checks run after those of the components it builds on (FSDP's step
// checks use optim/'s fused AdamW), so the first FAIL names the cause.
std::vector<gpu_check::Check> AllChecks(c10::Device device) {
  std::vector<gpu_check::Check> checks;
  auto append = [&checks](std::vector<gpu_check::Check> more) {
    checks.insert(checks.end(), std::make_move_iterator(more.begin()),
                  std::make_move_iterator(more.end()));
  };
  append(comm::CommGpuChecks(device));  // none on the CPU: they need NCCL
  append(optim::OptimGpuChecks(device));
  append(fsdp::FsdpGpuChecks(device));
  append(functorch::TransformsGpuChecks(device));
  // In a dry run kernels_cuda_linked still checks that a CUDA build linked
  // //kernels:cuda (its registration needs no GPU).
  append(kernels::KernelsGpuChecks(device, kBuiltWithCuda));
  // Generation runs the Llama model, which uses kernels/.
  append(models::ModelsGpuChecks(device));
  // The whole trainer last: it uses every component above.
  append(trainer::TrainerGpuChecks(device));
  return checks;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  std::string only;
  bool dry_run = false;
  std::optional<fsdp::GpuCheckApi> rank_of;  // a rank of fsdp/'s 2-rank checks
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--only" && i + 1 < args.size()) {
      only = args[++i];
    } else if (absl::StartsWith(args[i], "--only=")) {
      only = args[i].substr(7);
    } else if (args[i] == gpu_check::kDryRunOnCpuArg) {
      dry_run = true;
    } else if (args[i] == fsdp::kGpuCheckRankArg && i + 1 < args.size() &&
               fsdp::ParseGpuCheckApi(args[i + 1])) {
      rank_of = fsdp::ParseGpuCheckApi(args[++i]);
    } else {
      std::fprintf(stderr,
                   "gpu_check: unknown argument '%s' (usage: gpu_check [--only SUBSTRING] "
                   "[%s])\n",
                   args[i].c_str(), gpu_check::kDryRunOnCpuArg);
      return 2;
    }
  }
  const c10::Device device = dry_run ? c10::Device(c10::kCPU) : c10::Device(c10::kCUDA, 0);
  if (rank_of) return fsdp::RunGpuCheckRank(*rank_of, device);

  if (!dry_run) {
    if (auto why = WhyNotRun()) {
      std::printf("NOT RUN: %s\n", why->c_str());
      return kNotRun;
    }
    std::printf("gpu_check: LibTorch %s, %d CUDA device(s)\n", TORCH_VERSION,
                static_cast<int>(torch::cuda::device_count()));
  } else {
    std::printf(
        "gpu_check: LibTorch %s, %s: the FSDP checks on the CPU over Gloo (no NCCL, "
        "no GPU: this checks the checks only)\n",
        TORCH_VERSION, gpu_check::kDryRunOnCpuArg);
  }
  std::fflush(stdout);

  // Kept to the end: fsdp/'s checks share a process group that goes with them.
  const std::vector<gpu_check::Check> checks = AllChecks(device);
  int failed = 0;
  int ran = 0;
  for (const gpu_check::Check& check : checks) {
    if (!only.empty() && !absl::StrContains(check.name, only)) continue;
    ++ran;
    const auto start = std::chrono::steady_clock::now();
    gpu_check::Result result;
    try {
      result = check.run();
      // An asynchronous CUDA error belongs to this check.
      if (!dry_run) torch::cuda::synchronize();
    } catch (const std::exception& e) {
      result = gpu_check::Fail(absl::StrCat("threw: ", gpu_check::Describe(e)));
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("%s %s %s (%.1f s)\n", result.ok ? "PASS" : "FAIL", check.name.c_str(),
                result.detail.c_str(), seconds);
    std::fflush(stdout);
    if (!result.ok) ++failed;
  }
  if (ran == 0) {
    std::fprintf(stderr, "gpu_check: no check name contains '%s'\n", only.c_str());
    return 2;
  }
  std::printf("gpu_check: %d passed, %d failed\n", ran - failed, failed);
  return failed == 0 ? 0 : 1;
}
