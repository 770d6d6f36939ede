#include "trainer/trainer_gpu_check.h"

#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
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

// What a run varies.
struct RunFlags {
  CudaGraphs mode = CudaGraphs::kOff;
  int64_t steps = 0;
  LrSchedule schedule = LrSchedule::kCosine;
  double clip = 0;
};

// trainer::Train on a fresh 1-rank group (a FileStore in a temporary
// directory, as trainer_main's single process), the whole call under
// sync-debug mode warn.
absl::StatusOr<Run> TrainOnce(const c10::Device& device, const RunFlags& flags) {
  Options o;
  o.device = device.is_cuda() ? Device::kCuda : Device::kCpu;
  o.data = DataKind::kSynthetic;
  o.layers = 2;
  o.dim = 64;
  o.heads = 4;
  o.vocab = 256;
  o.seq = 32;
  o.global_batch = 8;
  o.steps = flags.steps;
  o.warmup_steps = 2;
  o.lr_schedule = flags.schedule;
  o.clip = flags.clip;
  o.seed = 5;
  o.nproc = 1;
  o.cuda_graphs = flags.mode;
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

constexpr double kRtol = 1e-5;

// The largest relative difference of `b`'s losses from `a`'s over steps
// [from, end) (1-based `from`); a problem for each step past `rtol` when
// `problems` is given, and for a count other than `expected`.
double CompareLosses(const std::string& what, const Run& a, const Run& b, size_t expected,
                     size_t from, double rtol, Problems* problems) {
  if (a.losses.size() != expected || b.losses.size() != expected) {
    if (problems != nullptr) {
      problems->Add(absl::StrCat(what, ": ", a.losses.size(), " and ", b.losses.size(),
                                 " losses: expected ", expected, " each"));
    }
    return std::numeric_limits<double>::infinity();
  }
  double worst = 0;
  for (size_t i = from - 1; i < expected; ++i) {
    const double x = a.losses[i], y = b.losses[i];
    const double rel = std::abs(x - y) / std::max(std::abs(x), 1e-12);
    worst = std::max(worst, std::isfinite(y) ? rel : std::numeric_limits<double>::infinity());
    if (problems != nullptr && (!std::isfinite(y) || rel > rtol)) {
      problems->Add(absl::StrFormat("%s: step %d: eager loss %.8g, graphed %.8g (rel %.2g > %.0e)",
                                    what, static_cast<int>(i) + 1, x, y, rel, rtol));
    }
  }
  return worst;
}

Result CheckCudaGraphs(const c10::Device& device) {
  const bool dry_run = device.is_cpu();
  // On the CPU on is refused: the dry run compares auto (eager there) with off.
  const CudaGraphs graphed_mode = dry_run ? CudaGraphs::kAuto : CudaGraphs::kOn;
  // 16 steps: 3 eager warm-up steps, the capture (step 4), 12 replays, over
  // which the cosine schedule falls from 0.93 to 0 of --lr and Adam's bias
  // corrections keep changing; a learning rate or step count frozen at the
  // capture's would show in every later loss.
  constexpr int64_t kLong = 16, kShort = 8;
  Problems problems;
  auto eager = TrainOnce(device, {CudaGraphs::kOff, kLong});
  auto graphed = TrainOnce(device, {graphed_mode, kLong});
  auto eager_short = TrainOnce(device, {CudaGraphs::kOff, kShort});
  auto graphed_short = TrainOnce(device, {graphed_mode, kShort});
  // A stand-in for a frozen learning rate: the constant schedule keeps
  // --lr after the warm-up, about what the cosine gives at the capture.
  auto frozen_lr = TrainOnce(device, {CudaGraphs::kOff, kLong, LrSchedule::kConstant});
  // --clip: the clipping (its all-reduce ordered on the stream) captured too.
  auto eager_clip = TrainOnce(device, {CudaGraphs::kOff, kLong, LrSchedule::kCosine, 0.5});
  auto graphed_clip = TrainOnce(device, {graphed_mode, kLong, LrSchedule::kCosine, 0.5});
  for (const auto* r :
       {&eager, &graphed, &eager_short, &graphed_short, &frozen_lr, &eager_clip, &graphed_clip}) {
    if (!r->ok()) return Fail(absl::StrCat("Train failed: ", r->status().ToString()));
  }
  const double worst =
      CompareLosses("fully captured", *eager, *graphed, kLong, 1, kRtol, &problems);
  const double worst_clip =
      CompareLosses("--clip (captured)", *eager_clip, *graphed_clip, kLong, 1, kRtol, &problems);
  // The comparison must be able to see a frozen learning rate at all.
  const double frozen = CompareLosses("frozen lr", *eager, *frozen_lr, kLong,
                                      kCudaGraphWarmupSteps + 2, kRtol, nullptr);
  if (!(frozen > 100 * kRtol)) {
    problems.Add(absl::StrFormat(
        "the constant-lr run's losses after the capture differ from the cosine run's by only rel "
        "%.2g: the loss comparison (rtol %.0e) could not see a frozen learning rate",
        frozen, kRtol));
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
      "%d steps (capture at step %d), the optimizer update captured: losses within rel %.2g of "
      "eager (a frozen lr would differ by %.2g); with --clip (captured): within %.2g; host "
      "synchronisations per step: eager %.2f, graphed %.2f%s; Train wall time %.2f s eager, "
      "%.2f s graphed (set-up included)",
      static_cast<int>(kLong), static_cast<int>(kCudaGraphWarmupSteps) + 1, worst, frozen,
      worst_clip, eager_per_step, graphed_per_step,
      dry_run ? " (dry run: auto is eager on the CPU, no sync-debug mode)" : "", eager->seconds,
      graphed->seconds));
}

}  // namespace

std::vector<gpu_check::Check> TrainerGpuChecks(c10::Device device) {
  return {{"trainer_cuda_graphs", [device] { return CheckCudaGraphs(device); }}};
}

}  // namespace trainer
