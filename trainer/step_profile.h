// --profile-step N: one training step under LibTorch's Kineto profiler,
// written as a Chrome trace (chrome://tracing, Perfetto, and
// benchmarks/python/profile_table.py, which compares it with TorchTitan's
// torch.profiler trace kernel class by kernel class).
//
// Rank 0 only profiles (one trace per run; the ranks run the same kernels).
// The trace holds the CPU ops (aten::*) and, on CUDA, the GPU kernels,
// memcpys and memsets of the step.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include <c10/core/Device.h>

#include "absl/status/status.h"

namespace at {
struct RecordFunction;
}  // namespace at

namespace trainer {

// Kineto's profiler, on from construction until Finish() (or destruction,
// which discards what it recorded: a step that failed leaves no trace).
// One at a time per process: LibTorch's profiler state is global.
class StepProfiler {
 public:
  // prepareProfiler + enableProfiler with ProfilerState::KINETO, activities
  // {CPU}, plus {CUDA} when `device` is a CUDA device; then opens a
  // "ProfilerStep#<step>" user annotation, as torch.profiler's prof.step()
  // does, so that a trace reader finds the step's span the same way in our
  // traces and in Python's.
  StepProfiler(const c10::Device& device, int64_t step);
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Waits for the device (so the step's kernels are in the trace), stops the
  // profiler and writes the trace to `path` crash-safely: to `path`.tmp,
  // fsynced, then renamed over `path` (a reader never sees half a trace).
  // An error names the path.
  absl::Status Finish(const std::string& path);

 private:
  c10::Device device_;
  bool active_ = false;
  std::unique_ptr<at::RecordFunction> annotation_;  // ProfilerStep#<step>
};

// Whether --profile-trace PATH can be written before step 1 runs (its
// directory exists), so a mistyped path fails in seconds, not at step N.
absl::Status CheckProfileTrace(const std::string& path);

// Runs `fn` (returning absl::StatusOr<T> or absl::Status) under a
// StepProfiler and writes the trace to `path` when it succeeded. A failed
// `fn` (status or exception) writes nothing and returns as it did.
template <typename F>
auto ProfileStep(const c10::Device& device, int64_t step, const std::string& path, F&& fn)
    -> decltype(fn()) {
  StepProfiler profiler(device, step);
  auto result = std::forward<F>(fn)();
  if (!result.ok()) return result;
  if (absl::Status s = profiler.Finish(path); !s.ok()) return s;
  return result;
}

}  // namespace trainer
