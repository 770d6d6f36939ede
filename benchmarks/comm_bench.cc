// Bus bandwidth of comm's collectives over Gloo on 2 ranks, 1 KiB .. 64 MiB,
// beside the raw c10d call of the same size, so the interface's overhead
// shows as a ratio (goal <= 1.05x).
//
//   bazel run //benchmarks:comm_bench [-- --benchmark_filter=all_reduce]
//
// Started without RANK in the environment, the binary re-runs itself as 2
// ranks through comm::launch; rank 0 prints the results, rank 1 only its
// errors. Both ranks register the same benchmarks with fixed iteration
// counts, so they run every collective in lock-step.
//
// Size = bytes of the full flat float32 tensor: the all-gather output, the
// reduce-scatter input, the all-reduce tensor. Bus bandwidth (as
// nccl-tests): size/time x (W-1)/W for all-gather and reduce-scatter,
// x 2(W-1)/W for all-reduce.
#include <unistd.h>

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "comm/collectives.h"
#include "comm/launcher.h"
#include "comm/process_group.h"

namespace {

constexpr int kWorld = 2;
constexpr int kRepetitions = 5;
comm::ProcessGroup* g_group = nullptr;

enum class Op { kAllGather, kReduceScatter, kAllReduce };

double bus_factor(Op op) {
  const double w = kWorld;
  return op == Op::kAllReduce ? 2.0 * (w - 1) / w : (w - 1) / w;
}

// One collective of `bytes` (full flat size), run by `impl` per iteration.
using Step = std::function<void()>;
using Factory = std::function<Step(int64_t bytes)>;

Step comm_step(Op op, int64_t bytes) {
  const int64_t total = bytes / 4, shard = total / kWorld;
  comm::ProcessGroup& pg = *g_group;
  switch (op) {
    case Op::kAllGather: {
      at::Tensor in = at::ones({shard}), out = at::empty({total});
      return [&pg, in, out] { comm::all_gather_into_tensor(pg, out, in).wait(); };
    }
    case Op::kReduceScatter: {
      at::Tensor in = at::ones({total}), out = at::empty({shard});
      return [&pg, in, out] { comm::reduce_scatter_tensor(pg, out, in).wait(); };
    }
    case Op::kAllReduce: {
      at::Tensor t = at::ones({total});
      return [&pg, t] { comm::all_reduce(pg, t).wait(); };
    }
  }
  return {};
}

// What a caller writes against c10d directly (Gloo has no reduce-scatter, so
// its raw counterpart is the same all-to-all + local sum comm builds on).
Step raw_step(Op op, int64_t bytes) {
  const int64_t total = bytes / 4, shard = total / kWorld;
  auto pg = g_group->c10d_group();
  switch (op) {
    case Op::kAllGather: {
      at::Tensor in = at::ones({shard}), out = at::empty({total});
      return [pg, in, out, shard] {
        std::vector<std::vector<at::Tensor>> outs(1);
        for (int r = 0; r < kWorld; ++r) outs[0].push_back(out.narrow(0, r * shard, shard));
        std::vector<at::Tensor> ins{in};
        pg->allgather(outs, ins)->wait();
      };
    }
    case Op::kReduceScatter: {
      at::Tensor in = at::ones({total}), out = at::empty({shard});
      return [pg, in, out, shard] {
        at::Tensor received = at::empty({shard * kWorld});
        std::vector<int64_t> splits;
        pg->alltoall_base(received, const_cast<at::Tensor&>(in), splits, splits)->wait();
        at::sum_out(const_cast<at::Tensor&>(out), received.view({kWorld, shard}), 0);
      };
    }
    case Op::kAllReduce: {
      at::Tensor t = at::ones({total});
      return [pg, t] {
        std::vector<at::Tensor> ts{t};
        pg->allreduce(ts)->wait();
      };
    }
  }
  return {};
}

// The alternative reduce-scatter: all-reduce the whole input, keep a slice.
Step raw_allreduce_slice_step(int64_t bytes) {
  const int64_t total = bytes / 4, shard = total / kWorld;
  auto pg = g_group->c10d_group();
  const int rank = g_group->rank();
  at::Tensor in = at::ones({total}), out = at::empty({shard});
  return [pg, in, out, shard, rank, total] {
    std::vector<at::Tensor> ts{in.clone()};
    pg->allreduce(ts)->wait();
    out.copy_(ts[0].narrow(0, rank * shard, shard));
    (void)total;
  };
}

void run(benchmark::State& state, Op op, const Factory& factory) {
  const int64_t bytes = state.range(0);
  Step step = factory(bytes);
  comm::barrier(*g_group).wait();
  step();  // warm-up, and lines the ranks up
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) step();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  state.counters["busbw_GB/s"] =
      static_cast<double>(bytes) * bus_factor(op) * state.iterations() / seconds / 1e9;
  state.SetLabel(std::to_string(bytes >> 10) + " KiB");
}

// Collects mean real time per benchmark and prints comm/raw ratios at the end.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const auto& r : runs) {
      // Ratios from the median of the repetitions: a 2-core VM running two
      // ranks plus Gloo's threads is noisy.
      if (r.run_type != Run::RT_Aggregate || r.aggregate_name != "median") continue;
      // "all_gather/comm" + "/" + "1024", without the iteration suffixes.
      times_[r.run_name.function_name + "/" + r.run_name.args] =
          r.GetAdjustedRealTime();
    }
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf("\n%-16s %10s %12s %12s %8s\n", "op", "size", "comm (us)",
                "raw (us)", "ratio");
    for (const auto& [name, time] : times_) {
      const auto pos = name.find("/comm/");
      if (pos == std::string::npos) continue;
      const std::string raw_name = name.substr(0, pos) + "/raw/" + name.substr(pos + 6);
      const auto raw = times_.find(raw_name);
      if (raw == times_.end()) continue;
      const int64_t bytes = std::atoll(name.substr(pos + 6).c_str());
      std::printf("%-16s %7lld KiB %12.1f %12.1f %8.3f\n", name.substr(0, pos).c_str(),
                  static_cast<long long>(bytes >> 10), time, raw->second,
                  time / raw->second);
    }
  }

 private:
  std::map<std::string, double> times_;
};

class SilentReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

void register_all() {
  const std::vector<std::pair<const char*, Op>> ops = {
      {"all_gather", Op::kAllGather},
      {"reduce_scatter", Op::kReduceScatter},
      {"all_reduce", Op::kAllReduce}};
  for (int64_t bytes = 1 << 10; bytes <= (int64_t{64} << 20); bytes *= 4) {
    // ~64 MiB moved per repetition, at least 4 iterations.
    const int64_t iters = std::clamp<int64_t>((int64_t{64} << 20) / bytes, 4, 500);
    for (const auto& [name, op] : ops) {
      const Op o = op;
      for (bool raw : {false, true}) {
        // Google Benchmark appends the size (the Arg) to the name.
        const std::string full = std::string(name) + (raw ? "/raw" : "/comm");
        benchmark::RegisterBenchmark(full.c_str(),
                                     [o, raw](benchmark::State& s) {
                                       run(s, o, [o, raw](int64_t b) {
                                         return raw ? raw_step(o, b) : comm_step(o, b);
                                       });
                                     })
            ->Arg(bytes)
            ->Iterations(iters)
            ->Repetitions(kRepetitions)
            ->ReportAggregatesOnly(true)
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
      }
    }
    const std::string alt = "reduce_scatter_via_allreduce/raw";
    benchmark::RegisterBenchmark(alt.c_str(),
                                 [](benchmark::State& s) {
                                   run(s, Op::kReduceScatter, raw_allreduce_slice_step);
                                 })
        ->Arg(bytes)
        ->Iterations(iters)
        ->Repetitions(kRepetitions)
        ->ReportAggregatesOnly(true)
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
}

int launch_ranks(int argc, char** argv) {
  comm::LaunchOptions options;
  options.nproc_per_node = kWorld;
  options.command = {"/proc/self/exe"};
  // The ranks write to pipes; keep escape codes out of the report.
  options.command.push_back("--benchmark_color=false");
  for (int i = 1; i < argc; ++i) options.command.push_back(argv[i]);
  options.timeout = std::chrono::minutes(20);
  options.on_line = [](int rank, bool is_stderr, const std::string& line) {
    if (rank == 0 && !is_stderr) {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    } else if (is_stderr) {
      std::fprintf(stderr, "[rank %d] %s\n", rank, line.c_str());
    }
  };
  auto result = comm::launch(options);
  if (!result.ok()) {
    std::fprintf(stderr, "comm_bench: %s\n", std::string(result.status().message()).c_str());
    return 2;
  }
  if (result->exit_code != 0) {
    std::fprintf(stderr, "comm_bench: %s\n", result->summary.c_str());
  }
  return result->exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  if (std::getenv("RANK") == nullptr) return launch_ranks(argc, argv);

  comm::InitOptions init;
  init.timeout = std::chrono::minutes(5);
  auto group = comm::init_process_group(init);
  if (!group.ok()) {
    std::fprintf(stderr, "comm_bench: %s\n", group.status().ToString().c_str());
    return 1;
  }
  g_group = &*group;
  if (group->rank() != 0) {
    // Only rank 0 writes --benchmark_out files.
    int kept = 1;
    for (int i = 1; i < argc; ++i) {
      if (std::string(argv[i]).rfind("--benchmark_out", 0) != 0) argv[kept++] = argv[i];
    }
    argc = kept;
  }
  benchmark::Initialize(&argc, argv);
  register_all();
  if (group->rank() == 0) {
    RatioReporter reporter;
    benchmark::RunSpecifiedBenchmarks(&reporter);
  } else {
    SilentReporter display;
    benchmark::RunSpecifiedBenchmarks(&display);
  }
  comm::barrier(*group).wait();
  benchmark::Shutdown();
  return 0;
}
