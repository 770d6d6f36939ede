// Bus bandwidth of comm's collectives over Gloo on 2 ranks, 1 KiB .. 64 MiB,
// beside the raw c10d call of the same size, so the interface's overhead
// shows as a ratio (goal <= 1.05x; from 1 MiB comm's all-gather goes rank
// to rank and is faster than c10d's). block_all_gather: one transformer
// block's gather as each FSDP does it (its counters in the console table).
//
//   bazel run //benchmarks:comm_bench [-- --benchmark_filter=all_reduce]
//
// Started without RANK in the environment, the binary re-runs itself as 2
// ranks through launcher::launch; rank 0 prints the results, rank 1 only its
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
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/collectives.h"
#include "benchmarks/multi_rank_main.h"
#include "comm/process_group.h"

namespace {

constexpr int kWorld = 2;
constexpr int kRepetitions = 3;
const comm::ProcessGroup* g_group = nullptr;

enum class Op { kAllGather, kReduceScatter, kAllReduce };

double bus_factor(Op op) {
  const double w = kWorld;
  return op == Op::kAllReduce ? 2.0 * (w - 1) / w : (w - 1) / w;
}

// One collective of `bytes` (full flat size), run by `impl` per iteration.
using Step = std::function<void()>;

Step comm_step(Op op, int64_t bytes) {
  const int64_t total = bytes / 4, shard = total / kWorld;
  const comm::ProcessGroup& pg = *g_group;
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

// The formulations comm used on LibTorch 1.13's Gloo, which had neither
// reduce-scatter nor a flat all-gather: an all-to-all + local sum, and a list
// all-gather into views. comm now calls c10d's all_gather_single, and on Gloo
// still reduce-scatters as an all-to-all + local sum (c10d's
// reduce_scatter_single Work cannot be polled there: comm/collectives.cc);
// these cases are the raw c10d counterparts.
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
        // c10d's name for it: all_to_all_single on 2.15, alltoall_base on
        // 2.11 (see comm/collectives.cc); the branch not taken is not
        // instantiated.
        auto all_to_all = [&](auto& group, at::Tensor& input) {
          if constexpr (requires { group.all_to_all_single(received, input, splits, splits); }) {
            return group.all_to_all_single(received, input, splits, splits);
          } else {
            return group.alltoall_base(received, input, splits, splits);
          }
        };
        all_to_all(*pg, const_cast<at::Tensor&>(in))->wait();
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

// Runs the variants alternately, one call each per iteration, rotating which
// goes first, so background load on the shared 2-core machine hits them
// alike and their ratios come from the same period. Sets a "<name>_us"
// counter per variant; returns each one's mean seconds per call.
std::vector<double> time_interleaved(benchmark::State& state,
                                     const std::vector<std::pair<std::string, Step>>& variants) {
  std::vector<double> seconds(variants.size(), 0.0);
  comm::barrier(*g_group).wait();
  for (const auto& v : variants) v.second();  // warm-up, and lines the ranks up
  int64_t i = 0;
  for (auto _ : state) {
    for (size_t k = 0; k < variants.size(); ++k) {
      const size_t v = (k + static_cast<size_t>(i)) % variants.size();
      const auto start = std::chrono::steady_clock::now();
      variants[v].second();
      seconds[v] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    ++i;
  }
  const double n = static_cast<double>(state.iterations());
  for (size_t v = 0; v < variants.size(); ++v) {
    seconds[v] /= n;
    state.counters[variants[v].first + "_us"] = seconds[v] * 1e6;
  }
  return seconds;
}

// comm's call against the raw c10d call (and, for reduce-scatter, the
// all-reduce alternative), interleaved.
void run(benchmark::State& state, Op op) {
  const int64_t bytes = state.range(0);
  std::vector<std::pair<std::string, Step>> variants = {{"comm", comm_step(op, bytes)},
                                                        {"raw", raw_step(op, bytes)}};
  if (op == Op::kReduceScatter) {
    variants.push_back({"via_allreduce", raw_allreduce_slice_step(bytes)});
  }
  const std::vector<double> seconds = time_interleaved(state, variants);
  state.counters["comm_busbw_GB/s"] = bytes * bus_factor(op) / seconds[0] / 1e9;
  state.counters["raw_busbw_GB/s"] = bytes * bus_factor(op) / seconds[1] / 1e9;
  state.counters["ratio"] = seconds[0] / seconds[1];
  state.SetLabel(std::to_string(bytes >> 10) + " KiB");
}

// One transformer block's all-gather (the trainer's dim-512 block: 12
// tensors, 12 MiB gathered), as each FSDP does it: fully_shard's per-tensor
// gather straight into each parameter (all_gather_into_tensors), FSDP1's
// one flat all_gather_into_tensor (no copy-out: the parameters are views of
// it), and fully_shard's flat path (c10d's collective, then the copy-out of
// each parameter's W pieces) that the first replaces on Gloo.
void run_block(benchmark::State& state) {
  const int64_t dim = 512;
  const std::vector<int64_t> numels = {3 * dim * dim, 3 * dim, dim * dim,     dim,
                                       dim,           dim,     dim,           dim,
                                       4 * dim * dim, 4 * dim, 4 * dim * dim, dim};
  const comm::ProcessGroup& pg = *g_group;
  int64_t shard_total = 0;
  std::vector<int64_t> shard_numels;
  for (int64_t n : numels) {
    shard_numels.push_back((n + kWorld - 1) / kWorld);
    shard_total += shard_numels.back();
  }
  at::Tensor shards = at::ones({shard_total});
  std::vector<at::Tensor> inputs, outputs;
  int64_t offset = 0;
  for (int64_t n : shard_numels) {
    inputs.push_back(shards.narrow(0, offset, n));
    outputs.push_back(at::empty({n * kWorld}));
    offset += n;
  }
  at::Tensor flat = at::empty({shard_total * kWorld});
  auto pgc = g_group->c10d_group();
  std::vector<std::pair<std::string, Step>> variants = {
      {"tensors", [&] { comm::all_gather_into_tensors(pg, outputs, inputs).wait(); }},
      {"flat", [&] { comm::all_gather_into_tensor(pg, flat, shards).wait(); }},
      {"flat_copy_out", [&] {
         std::vector<std::vector<at::Tensor>> outs(1);
         for (int r = 0; r < kWorld; ++r) {
           outs[0].push_back(flat.narrow(0, r * shard_total, shard_total));
         }
         std::vector<at::Tensor> ins{shards};
         pgc->allgather(outs, ins)->wait();
         at::Tensor rows = flat.view({kWorld, shard_total});
         int64_t column = 0;
         for (size_t k = 0; k < outputs.size(); ++k) {
           outputs[k].view({kWorld, -1}).copy_(rows.narrow(1, column, shard_numels[k]));
           column += shard_numels[k];
         }
       }}};
  const std::vector<double> seconds = time_interleaved(state, variants);
  state.counters["tensors/flat"] = seconds[0] / seconds[1];
  state.counters["tensors/flat_copy_out"] = seconds[0] / seconds[2];
  state.SetLabel(std::to_string((shard_total * kWorld * 4) >> 10) + " KiB");
}

// Prints a summary table (medians over the repetitions) after the runs.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  RatioReporter() : ConsoleReporter(OO_Tabular) {}
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const auto& r : runs) {
      if (r.run_type != Run::RT_Aggregate || r.aggregate_name != "median") continue;
      if (r.counters.find("comm_us") == r.counters.end())
        continue;  // block_all_gather: its own counters
      Row row;
      row.name = r.run_name.function_name;
      row.bytes = std::atoll(r.run_name.args.c_str());
      for (const auto& [key, counter] : r.counters) row.values[key] = counter.value;
      rows_.push_back(row);
    }
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf("\nmedians of %d repetitions\n%-15s %9s %10s %10s %7s %10s %10s %10s\n",
                kRepetitions, "op", "size", "comm us", "raw us", "ratio", "comm GB/s", "raw GB/s",
                "alt us");
    for (const auto& row : rows_) {
      auto get = [&](const char* key) {
        auto it = row.values.find(key);
        return it == row.values.end() ? 0.0 : it->second;
      };
      std::printf("%-15s %5lld KiB %10.1f %10.1f %7.3f %10.3f %10.3f %10s\n", row.name.c_str(),
                  static_cast<long long>(row.bytes >> 10), get("comm_us"), get("raw_us"),
                  get("ratio"), get("comm_busbw_GB/s"), get("raw_busbw_GB/s"),
                  row.values.count("via_allreduce_us")
                      ? std::to_string(static_cast<int>(get("via_allreduce_us"))).c_str()
                      : "-");
    }
    // One number for the interface's overhead across every op and size.
    double log_sum = 0;
    int count = 0;
    for (const auto& row : rows_) {
      auto it = row.values.find("ratio");
      if (it != row.values.end() && it->second > 0) {
        log_sum += std::log(it->second);
        ++count;
      }
    }
    if (count > 0) {
      std::printf("geometric mean of comm/raw ratios over %d rows: %.3f\n", count,
                  std::exp(log_sum / count));
    }
  }

 private:
  struct Row {
    std::string name;
    int64_t bytes = 0;
    std::map<std::string, double> values;
  };
  std::vector<Row> rows_;
};

void register_all() {
  benchmark::RegisterBenchmark("block_all_gather", run_block)
      ->Iterations(30)
      ->Repetitions(kRepetitions)
      ->ReportAggregatesOnly(true)
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
  const std::vector<std::pair<const char*, Op>> ops = {{"all_gather", Op::kAllGather},
                                                       {"reduce_scatter", Op::kReduceScatter},
                                                       {"all_reduce", Op::kAllReduce}};
  for (int64_t bytes = 1 << 10; bytes <= (int64_t{64} << 20); bytes *= 4) {
    // ~64 MiB per variant and repetition, at least 3 iterations.
    const int64_t iters = std::clamp<int64_t>((int64_t{64} << 20) / bytes, 3, 300);
    for (const auto& [name, op] : ops) {
      const Op o = op;
      benchmark::RegisterBenchmark(name, [o](benchmark::State& s) { run(s, o); })
          ->Arg(bytes)
          ->Iterations(iters)
          ->Repetitions(kRepetitions)
          ->ReportAggregatesOnly(true)
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmarks::MultiRankBenchmark spec;
  spec.name = "comm_bench";
  spec.world_size = kWorld;
  spec.register_benchmarks = [](const comm::ProcessGroup& group) {
    g_group = &group;
    register_all();
  };
  spec.make_reporter = [] { return std::make_unique<RatioReporter>(); };
  return benchmarks::RunOnLocalRanks(argc, argv, spec);
}
