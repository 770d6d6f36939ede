#include "trainer/trainer_gpu_check.h"

#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/process_group.h"
#include "testing/sync_debug_mode.h"
#include "trainer/cuda_graphs.h"
#include "trainer/options.h"
#include "trainer/train.h"

namespace trainer {
namespace {

using gpu_check::Fail;
using gpu_check::Pass;
using gpu_check::Problems;
using gpu_check::Result;
using gpu_check::SyncDebugScope;

struct Run {
  std::vector<double> losses;
  int syncs = 0;  // synchronising calls in the whole of Train
  double seconds = 0;
};

// trainer::Train on a fresh 1-rank group (a FileStore in a temporary
// directory, as trainer_main's single process), `steps` steps, the whole
// call under sync-debug mode warn.
absl::StatusOr<Run> TrainOnce(const c10::Device& device, CudaGraphs mode, int64_t steps) {
  Options o;
  o.device = device.is_cuda() ? Device::kCuda : Device::kCpu;
  o.data = DataKind::kSynthetic;
  o.layers = 2;
  o.dim = 64;
  o.heads = 4;
  o.vocab = 256;
  o.seq = 32;
  o.global_batch = 8;
  o.steps = steps;
  o.warmup_steps = 2;
  o.seed = 5;
  o.nproc = 1;
  o.cuda_graphs = mode;
  char dir_template[] = "/tmp/trainer_gpu_check_XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return absl::InternalError("mkdtemp failed");
  const std::string dir = dir_template;
  Run run;
  absl::Status status;
  {
    comm::InitOptions init;
    init.backend = ProcessGroupBackend(o);
    init.init_method = "file://" + dir + "/store";
    init.rank = 0;
    init.world_size = 1;
    auto group = comm::init_process_group(init);
    if (!group.ok()) return group.status();
    const auto start = std::chrono::steady_clock::now();
    SyncDebugScope scope(SyncDebugScope::Mode::kWarn);
    auto result = Train(o, *group);
    run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    run.syncs = static_cast<int>(scope.syncs().size());
    if (result.ok()) run.losses = result->losses;
    status = result.status();
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  if (!status.ok()) return status;
  return run;
}

Result CheckCudaGraphs(const c10::Device& device) {
  const bool dry_run = device.is_cpu();
  // On the CPU on is refused: the dry run compares auto (eager there) with off.
  const CudaGraphs graphed_mode = dry_run ? CudaGraphs::kAuto : CudaGraphs::kOn;
  constexpr int64_t kLong = 10, kShort = 6;
  Problems problems;
  auto eager = TrainOnce(device, CudaGraphs::kOff, kLong);
  auto graphed = TrainOnce(device, graphed_mode, kLong);
  auto eager_short = TrainOnce(device, CudaGraphs::kOff, kShort);
  auto graphed_short = TrainOnce(device, graphed_mode, kShort);
  for (const auto* r : {&eager, &graphed, &eager_short, &graphed_short}) {
    if (!r->ok()) return Fail(absl::StrCat("Train failed: ", r->status().ToString()));
  }
  double worst = 0;
  if (eager->losses.size() != static_cast<size_t>(kLong) ||
      graphed->losses.size() != eager->losses.size()) {
    problems.Add(absl::StrCat(eager->losses.size(), " eager and ", graphed->losses.size(),
                              " graphed losses: expected ", kLong, " each"));
  } else {
    for (size_t i = 0; i < eager->losses.size(); ++i) {
      const double a = eager->losses[i], b = graphed->losses[i];
      const double rel = std::abs(a - b) / std::max(std::abs(a), 1e-12);
      worst = std::max(worst, rel);
      if (!std::isfinite(b) || rel > 1e-5) {
        problems.Add(absl::StrFormat("step %d: eager loss %.8g, graphed %.8g (rel %.2g > 1e-5)",
                                     static_cast<int>(i) + 1, a, b, rel));
      }
    }
  }
  const double steps = static_cast<double>(kLong - kShort);
  const double eager_per_step = (eager->syncs - eager_short->syncs) / steps;
  const double graphed_per_step = (graphed->syncs - graphed_short->syncs) / steps;
  if (graphed_per_step > eager_per_step) {
    problems.Add(
        absl::StrFormat("%.2f host synchronisations per replayed step: expected at most "
                        "the eager step's %.2f",
                        graphed_per_step, eager_per_step));
  }
  if (!problems.empty()) return Fail(problems.Joined());
  return Pass(absl::StrFormat(
      "%d steps, losses within rel %.2g of eager; host synchronisations per step: eager %.2f, "
      "graphed %.2f%s; Train wall time %.2f s eager, %.2f s graphed (set-up included)",
      static_cast<int>(kLong), worst, eager_per_step, graphed_per_step,
      dry_run ? " (dry run: auto is eager on the CPU, no sync-debug mode)" : "", eager->seconds,
      graphed->seconds));
}

}  // namespace

std::vector<gpu_check::Check> TrainerGpuChecks(c10::Device device) {
  return {{"trainer_cuda_graphs", [device] { return CheckCudaGraphs(device); }}};
}

}  // namespace trainer
