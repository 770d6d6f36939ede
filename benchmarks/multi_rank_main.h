// main() for a Google Benchmark binary whose cases run on several local
// ranks in lock-step (collectives, FSDP):
//
//   int main(int argc, char** argv) {
//     return benchmarks::RunOnLocalRanks(argc, argv, {"comm_bench", 2,
//         [](const comm::ProcessGroup& group) { register_all(group); },
//         [] { return std::make_unique<RatioReporter>(); }});
//   }
//
// Started without RANK in the environment, the binary re-runs itself as
// `world_size` ranks through launcher::launch, so `bazel run` alone is enough.
// In a rank it joins the world group, registers the benchmarks (every rank
// must register the same collective cases with fixed iteration counts, so
// they stay in lock-step), and runs them: rank 0 reports through its
// reporter (and alone writes --benchmark_out), the others report nothing but
// their errors, which arrive prefixed "[rank K]".
#pragma once

#include <benchmark/benchmark.h>

#include <functional>
#include <memory>
#include <string>

#include "comm/process_group.h"

namespace benchmarks {

struct MultiRankBenchmark {
  // For messages ("comm_bench: ...").
  std::string name;
  int world_size = 2;
  // Called in every rank after the group exists; the group outlives the run.
  std::function<void(const comm::ProcessGroup& group)> register_benchmarks;
  // Rank 0's reporter; null: Google Benchmark's console reporter.
  std::function<std::unique_ptr<benchmark::BenchmarkReporter>()> make_reporter;
};

int RunOnLocalRanks(int argc, char** argv, const MultiRankBenchmark& spec);

}  // namespace benchmarks
