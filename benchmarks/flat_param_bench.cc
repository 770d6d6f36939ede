// fsdp/flat_param: the cost of the flat-parameter layer itself, on 100
// parameters totalling 16M floats (64 MiB):
//   * flatten_tensors / unflatten_views (one process);
//   * FlatParamHandle::use_unsharded_views (rebuilding the 100 views and
//     pointing the module at them);
//   * unshard + reshard on 2 ranks against the bare comm all-gather of the
//     same size, printed as a ratio (goal <= 1.10x). The bare gather is
//     timed twice: into a buffer allocated once (the collective alone) and
//     into a buffer allocated per call (what any scheme that really frees
//     the gathered memory between uses must pay on the CPU allocator).
//
//   bazel run //benchmarks:flat_param_bench
//
// Started without RANK in the environment, the binary re-runs itself as 2
// ranks through launcher::launch; rank 0 runs the one-process benchmarks and
// prints everything, rank 1 joins the collective ones. Collective benchmarks
// use fixed iteration counts so both ranks stay in lock-step.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/nn/modules/container/parameterlist.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/collectives.h"
#include "benchmarks/multi_rank_main.h"
#include "comm/process_group.h"
#include "fsdp/flat_param.h"

namespace {

constexpr int kWorld = 2;
constexpr int kParams = 100;
constexpr int64_t kTotal = int64_t{16} << 20;  // 16M floats
constexpr int kCollectiveIters = 10;
constexpr int kRounds = 5;
const comm::ProcessGroup* g_group = nullptr;

// 99 tensors of [4, 41943] and one of [4, 41947]: 16,777,216 floats.
std::vector<at::Tensor> make_params() {
  std::vector<at::Tensor> params;
  int64_t remaining = kTotal;
  for (int i = 0; i < kParams; ++i) {
    const int64_t cols = i + 1 < kParams ? kTotal / kParams / 4 : remaining / 4;
    params.push_back(at::randn({4, cols}));
    remaining -= 4 * cols;
  }
  return params;
}

torch::nn::ParameterList make_module() {
  torch::nn::ParameterList list;
  for (auto& p : make_params()) list->append(p.requires_grad_());
  return list;
}

std::vector<std::string> names_of(const torch::nn::Module& module) {
  std::vector<std::string> names;
  for (const auto& item : module.named_parameters()) names.push_back(item.key());
  return names;
}

void BM_Flatten(benchmark::State& state) {
  const auto params = make_params();
  for (auto _ : state) {
    benchmark::DoNotOptimize(fsdp::flatten_tensors(params, kWorld));
  }
  state.SetBytesProcessed(state.iterations() * kTotal * 4);
}

void BM_UnflattenViews(benchmark::State& state) {
  std::vector<fsdp::FlatParamInfo> infos;
  const at::Tensor flat = fsdp::flatten_tensors(make_params(), kWorld, &infos);
  for (auto _ : state) benchmark::DoNotOptimize(fsdp::unflatten_views(flat, infos));
}

// The same, with autograd views of a leaf that requires grad (what the
// handle builds).
void BM_UnflattenAutogradViews(benchmark::State& state) {
  std::vector<fsdp::FlatParamInfo> infos;
  const at::Tensor flat = fsdp::flatten_tensors(make_params(), kWorld, &infos).requires_grad_();
  for (auto _ : state) benchmark::DoNotOptimize(fsdp::unflatten_views(flat, infos));
}

// ---- collective benchmarks (both ranks) ----------------------------------

struct Collective {
  torch::nn::ParameterList module = make_module();
  std::unique_ptr<fsdp::FlatParamHandle> handle =
      std::make_unique<fsdp::FlatParamHandle>(module.ptr(), names_of(*module), *g_group);
};

void lock_step(benchmark::State& state, const std::function<void()>& step) {
  comm::barrier(*g_group).wait();
  step();  // warm-up
  for (auto _ : state) step();
}

void BM_HandleUnshardReshard(benchmark::State& state) {
  Collective c;
  lock_step(state, [&] {
    c.handle->unshard();
    c.handle->reshard();
  });
}

// The same without the freed-storage cache: every unshard maps fresh
// memory (the cost the cache exists to avoid).
void BM_HandleUnshardReshardNoCache(benchmark::State& state) {
  Collective c;
  lock_step(state, [&] {
    c.handle->unshard();
    c.handle->reshard();
    fsdp::release_cached_unsharded_memory();
  });
}

void BM_HandleUnshardViewsReshard(benchmark::State& state) {
  Collective c;
  lock_step(state, [&] {
    c.handle->unshard();
    c.handle->use_unsharded_views();
    c.handle->reshard();
  });
}

void BM_BareAllGather(benchmark::State& state) {
  const int64_t shard = kTotal / kWorld;
  at::Tensor in = at::ones({shard}), out = at::empty({kTotal});
  lock_step(state, [&] { comm::all_gather_into_tensor(*g_group, out, in).wait(); });
}

void BM_BareAllGatherFreshOutput(benchmark::State& state) {
  const int64_t shard = kTotal / kWorld;
  at::Tensor in = at::ones({shard});
  lock_step(state, [&] {
    at::Tensor out = at::empty({kTotal});
    comm::all_gather_into_tensor(*g_group, out, in).wait();
  });
}

// Local (no collective), but needs an unsharded handle, hence here.
void BM_HandleViewRebuild(benchmark::State& state) {
  Collective c;
  c.handle->unshard();
  lock_step(state, [&] { c.handle->use_unsharded_views(); });
  c.handle->reshard();
}

class RatioReporter : public benchmark::ConsoleReporter {
 public:
  // Ranks write to pipes: no colour codes.
  RatioReporter() : ConsoleReporter(OO_None) {}
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const auto& r : runs) {
      const std::string name = r.benchmark_name();
      times_[name.substr(0, name.find('/'))].push_back(r.GetAdjustedRealTime());
      cpu_[name.substr(0, name.find('/'))].push_back(r.GetAdjustedCPUTime());
    }
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    auto median = [](std::vector<double> v) {
      if (v.empty()) return 0.0;
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    auto find = [&](const std::string& name) { return median(times_[name]); };
    const double bare = find("BM_BareAllGatherPrealloc"),
                 fresh = find("BM_BareAllGatherFreshOutput");
    const double handle = find("BM_HandleUnshardReshard"),
                 full = find("BM_HandleUnshardViewsReshard"),
                 no_cache = find("BM_HandleUnshardReshardNoCache");
    if (bare <= 0 || fresh <= 0) return;
    std::printf(
        "\nmedians over %d interleaved rounds of %d iterations (ms): bare %.1f, "
        "bare+fresh output %.1f, handle %.1f, handle+views %.1f, handle no cache %.1f\n",
        kRounds, kCollectiveIters, bare, fresh, handle, full, no_cache);
    std::printf("calling-thread CPU per iteration (ms, median): bare %.3f, handle %.3f\n",
                median(cpu_["BM_BareAllGatherPrealloc"]), median(cpu_["BM_HandleUnshardReshard"]));
    std::printf("unshard+reshard / bare all-gather (preallocated output): %.3fx\n", handle / bare);
    std::printf("unshard+reshard / bare all-gather (output allocated per call): %.3fx\n",
                handle / fresh);
    std::printf("unshard+views+reshard / bare all-gather (preallocated output): %.3fx\n",
                full / bare);
    std::printf(
        "unshard+reshard, freed-storage cache off / bare all-gather "
        "(preallocated output): %.3fx; / (output allocated per call): %.3fx\n",
        no_cache / bare, no_cache / fresh);
  }

 private:
  std::map<std::string, std::vector<double>> times_, cpu_;
};

void register_all(bool local) {
  if (local) {
    benchmark::RegisterBenchmark("BM_Flatten", BM_Flatten)->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_UnflattenViews", BM_UnflattenViews)
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark("BM_UnflattenAutogradViews", BM_UnflattenAutogradViews)
        ->Unit(benchmark::kMicrosecond);
  }
  // Rounds of bare/handle/... in turn, so load that drifts over the run (a
  // shared 2-core VM) hits each alike; the summary takes medians over rounds.
  // (Google Benchmark's own random interleaving seeds from random_device,
  // which would order the two ranks differently.)
  for (int round = 0; round < kRounds; ++round) {
    for (auto [name, fn] : std::vector<std::pair<const char*, void (*)(benchmark::State&)>>{
             {"BM_BareAllGatherPrealloc", BM_BareAllGather},
             {"BM_HandleUnshardReshard", BM_HandleUnshardReshard},
             {"BM_BareAllGatherFreshOutput", BM_BareAllGatherFreshOutput},
             {"BM_HandleUnshardViewsReshard", BM_HandleUnshardViewsReshard},
             {"BM_HandleUnshardReshardNoCache", BM_HandleUnshardReshardNoCache}}) {
      benchmark::RegisterBenchmark((std::string(name) + "/round:" + std::to_string(round)).c_str(),
                                   fn)
          ->Iterations(kCollectiveIters)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  benchmark::RegisterBenchmark("BM_HandleViewRebuild", BM_HandleViewRebuild)
      ->Iterations(2000)
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
}

}  // namespace

int main(int argc, char** argv) {
  benchmarks::MultiRankBenchmark spec;
  spec.name = "flat_param_bench";
  spec.world_size = kWorld;
  spec.register_benchmarks = [](const comm::ProcessGroup& group) {
    g_group = &group;
    register_all(/*local=*/group.rank() == 0);
  };
  spec.make_reporter = [] { return std::make_unique<RatioReporter>(); };
  return benchmarks::RunOnLocalRanks(argc, argv, spec);
}
