// --log-json: one JSON object per line per optimizer step, written by rank
// 0, flushed after every line so a crashed run keeps what it logged. Read by
// tools/plot and by scripts:
//
//   {"step":12,"loss":3.1416,"lr":0.003,"step_time_s":0.41,
//    "tokens_per_s":2497.5,"peak_rss_bytes":[412000256,409923584],
//    "sharded_state_bytes":[1606656,1606656],"world_size":2}
//   (with --eval-every, on its steps also "val_loss":3.2)
//   (with --device cuda also "cuda_peak_allocated_bytes":[...] and
//   "cuda_peak_reserved_bytes":[...]; both keys are ABSENT on the CPU)
//
// loss is the global mean over the step's whole batch (before the step's
// update); lr the rate the step used; tokens_per_s counts the input tokens
// of all ranks (global_batch * seq / step_time_s); step_time_s runs from
// sampling the batch to the end of the optimizer step. The lists have one
// entry per rank, in rank order. A resumed run appends to its log, so after
// a crash a step can appear twice; the later line is the surviving run's.
// cuda_peak_allocated_bytes / cuda_peak_reserved_bytes are the CUDA caching
// allocator's peaks on the rank's device during the step (its peak
// statistics are reset when the step starts; the step's batch, forward,
// backward, optimizer update and any --eval-every evaluation, not its
// checkpoint): Python's torch.cuda.max_memory_allocated() /
// max_memory_reserved() after torch.cuda.reset_peak_memory_stats(); -1 for
// a rank whose allocator gave no figures (not a caching allocator).
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace trainer {

struct StepRecord {
  int64_t step = 0;
  double loss = 0;
  double lr = 0;
  double step_time_s = 0;
  double tokens_per_s = 0;
  std::vector<int64_t> peak_rss_bytes;       // per rank
  std::vector<int64_t> sharded_state_bytes;  // per rank: params+grads+optim
  // --eval-every's steps: the held-out split's mean loss after the step's
  // update ("val_loss"; absent on other steps).
  std::optional<double> val_loss;
  // --device cuda: per rank, the caching allocator's peak allocated and
  // reserved bytes in the step. Empty on the CPU: the keys are left out.
  std::vector<int64_t> cuda_peak_allocated_bytes;
  std::vector<int64_t> cuda_peak_reserved_bytes;
};

// The record as one JSON object (no newline), written by nlohmann::json:
// doubles in the shortest form that reads back bit for bit, a non-finite
// value as null (JSON has no NaN).
std::string FormatJsonLine(const StepRecord& record);

class JsonLogWriter {
 public:
  JsonLogWriter() = default;
  ~JsonLogWriter();
  JsonLogWriter(const JsonLogWriter&) = delete;
  JsonLogWriter& operator=(const JsonLogWriter&) = delete;

  // Opens `path` for writing; `append` keeps earlier lines (a resumed run
  // continues its log). Errors name the path.
  absl::Status Open(const std::string& path, bool append);
  absl::Status Write(const StepRecord& record);

 private:
  std::FILE* file_ = nullptr;
  std::string path_;
};

// This process's peak resident set size in bytes (VmHWM from
// /proc/self/status; getrusage's ru_maxrss where /proc is unavailable).
int64_t PeakRssBytes();

}  // namespace trainer
