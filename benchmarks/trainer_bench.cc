// The trainer's TransformerLM at ~25M parameters (8 blocks, dim 512, 8
// heads, vocab 256): one training step (zero_grad, forward, backward,
// gradient reduction, Adam step) per iteration, on the world size given by
// TRAINER_BENCH_NPROC (default 1; the binary starts its own ranks through
// RunOnLocalRanks):
//
//   BM_Step/NoFSDP         1 rank only: the plain model, the baseline.
//   BM_Step/DDP            > 1 rank: plain all-reduce data parallelism
//                          written on comm/ (flatten grads -> one
//                          all_reduce avg -> unflatten), the NO_SHARD
//                          baseline; what PyTorch's DDP does, less bucketing.
//   BM_Step/FULL_SHARD, BM_Step/SHARD_GRAD_OP, BM_Step/NO_SHARD
//                          fsdp::FullyShardedDataParallel wrapped as the
//                          trainer wraps it (one unit per block, backward
//                          prefetch pre, use_orig_params).
//   BM_Step/FULLY_SHARD    fsdp::fully_shard (FSDP2's per-parameter
//                          shards) as the trainer applies it under
//                          --fsdp=fully_shard (trainer::WrapModelFullyShard
//                          with the trainer's defaults: each block, then the
//                          root; resharded after forward; backward prefetch).
//   BM_Step/<case>_ckpt    the same with every block activation-checkpointed
//                          (activation_checkpointing/, as the trainer's
//                          --activation-checkpointing=block), for NoFSDP,
//                          FULL_SHARD, SHARD_GRAD_OP and FULLY_SHARD.
//
// Memory counters besides peak RSS: fwd_retained_MiB, the bytes the
// allocator holds more after the forward (loss computed) than before it,
// max over steps and ranks: the activations the graph keeps for backward
// (plus, under FULL_SHARD, the root unit's gathered parameters, which stay
// gathered until backward: 0.6 MiB here); base_rss_MiB, the process's RSS
// when the case starts (LibTorch, Gloo, the benchmark itself), so that
// peak_rss_MiB - base_rss_MiB is what the case costs; setup_peak_rss_MiB,
// the peak while the model is built and wrapped, and step_peak_rss_MiB, the
// peak over the steps alone (the allocator's free pages released and the
// high-water mark reset in between; step_base_rss_MiB is the RSS then).
// Allocator bytes come
// from tcmalloc (MallocExtension_GetNumericProperty, looked up at run time so
// the binary still links with another allocator; -1 then).
//
// Peak RSS is a process-wide high-water mark, so each case must run in its
// own process for its counter to mean anything: run_trainer_bench.sh
// starts one process per (case, world size) with --benchmark_filter.
// Each case also reports the parameter + gradient + optimizer bytes a rank
// holds after its steps (max over ranks), measured by the trainer's own
// trainer::ShardedStateBytes (its --log-json's sharded_state_bytes).
#include <benchmark/benchmark.h>
#include <torch/optim/adam.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "activation_checkpointing/apply_activation_checkpointing.h"
#include "benchmarks/multi_rank_main.h"
#include "comm/collectives.h"
#include "comm/process_group.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/sharding_strategy.h"
#include "module_call/call.h"
#include "module_call/wrap_policy.h"
#include "trainer/json_log.h"
#include "trainer/models.h"
#include "trainer/options.h"
#include "trainer/train.h"
#include "trainer/wrap.h"

namespace {

// ~25.3M parameters: 8 blocks of 12*dim^2 (+ biases, LayerNorms) plus the
// tied 256x512 embedding and 64x512 positions. Small batch and sequence keep
// one step around a second on 2 cores, so 4 ranks (oversubscribed 2x) stay
// within the runner's time budget.
//
// TRAINER_BENCH_ROWS (rows per rank, default 2) and TRAINER_BENCH_SEQ
// (default 32) give the compute-bound configurations MFU is measured at
// (benchmarks/RESULTS.md): at the defaults a step is dominated by
// per-parameter work (optimizer, gradient reduction), not matmuls.
int64_t PositiveFromEnv(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (*end != '\0' || value <= 0) {
    std::fprintf(stderr, "trainer_bench: %s='%s': expected a positive integer\n", name, text);
    std::exit(2);
  }
  return value;
}
const trainer::ModelConfig kConfig{/*layers=*/8, /*dim=*/512, /*heads=*/8,
                                   /*vocab=*/256,
                                   /*seq=*/PositiveFromEnv("TRAINER_BENCH_SEQ", 32)};
const int64_t kRowsPerRank = PositiveFromEnv("TRAINER_BENCH_ROWS", 2);
constexpr double kLr = 1e-4;

const comm::ProcessGroup* g_group = nullptr;

// Fixed iteration counts (every rank must run the same number of
// collective steps). Few: one 25M-parameter step takes seconds on 2 cores,
// and 4 ranks oversubscribe them 2x; the runner must stay within minutes.
int Iterations(int world) { return world >= 4 ? 2 : 3; }

torch::Tensor RankBatch(int rank) {
  // Different rows per rank, as in data-parallel training; the values do
  // not change the cost.
  torch::manual_seed(1000 + rank);
  return torch::randint(kConfig.vocab, {kRowsPerRank, kConfig.seq + 1}, torch::kInt64);
}

std::shared_ptr<trainer::TransformerLM> BuildLM() {
  auto model = trainer::BuildModel(trainer::ModelType::kTransformer, kConfig, /*seed=*/0);
  return std::dynamic_pointer_cast<trainer::TransformerLM>(model);
}

int64_t NumParams(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

// tcmalloc's generic.current_allocated_bytes (-1 without tcmalloc).
int64_t AllocatedBytes() {
  using Getter = int (*)(const char*, size_t*);
  static const auto getter =
      reinterpret_cast<Getter>(dlsym(RTLD_DEFAULT, "MallocExtension_GetNumericProperty"));
  size_t value = 0;
  if (getter == nullptr || !getter("generic.current_allocated_bytes", &value)) return -1;
  return static_cast<int64_t>(value);
}

// This process's resident set now, in bytes (/proc/self/statm).
int64_t CurrentRssBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * 4096;
}

double MaxOverRanksMiB(const comm::ProcessGroup& group, int64_t bytes) {
  torch::Tensor t = torch::tensor({bytes}, torch::kInt64);
  comm::all_reduce(group, t, comm::ReduceOp::kMax).wait();
  return static_cast<double>(t.item<int64_t>()) / (1024.0 * 1024.0);
}

// The largest forward-retained allocation over the steps (see the top).
struct ForwardRetained {
  int64_t max_bytes = 0;
  template <typename Forward>
  torch::Tensor operator()(Forward&& forward) {
    const int64_t before = AllocatedBytes();
    torch::Tensor loss = forward();
    const int64_t after = AllocatedBytes();
    if (before >= 0 && after >= 0) max_bytes = std::max(max_bytes, after - before);
    return loss;
  }
};

void CheckpointBlocks(const std::shared_ptr<trainer::TransformerLM>& lm) {
  // NoFSDP also calls its blocks through module_call::call (a plain forward on a
  // module that is not a unit), where checkpointed modules are run.
  lm->set_block_runner([](int64_t, trainer::TransformerBlock& block, const torch::Tensor& x,
                          const torch::Tensor& mask) { return module_call::call(block, x, mask); });
  const auto blocks = activation_checkpointing::apply_activation_checkpointing(
      std::static_pointer_cast<torch::nn::Module>(lm),
      module_call::module_type_auto_wrap_policy<trainer::TransformerBlockImpl>());
  TORCH_CHECK(blocks.size() == static_cast<size_t>(kConfig.layers), "trainer_bench: checkpointed ",
              blocks.size(), " blocks, expected ", kConfig.layers);
}

// Peak RSS of every rank, in MiB; the max is what a machine must provision.
double MaxPeakRssMiB(const comm::ProcessGroup& group) {
  torch::Tensor rss = torch::tensor({trainer::PeakRssBytes()}, torch::kInt64);
  comm::all_reduce(group, rss, comm::ReduceOp::kMax).wait();
  return static_cast<double>(rss.item<int64_t>()) / (1024.0 * 1024.0);
}

// What a rank holds of parameters, gradients and optimizer state, max over
// ranks.
double MaxStateBytes(const comm::ProcessGroup& group, const std::vector<torch::Tensor>& params,
                     const torch::optim::Optimizer& optim) {
  auto bytes = trainer::ShardedStateBytes(params, optim);
  TORCH_CHECK(bytes.ok(), "trainer_bench: ", bytes.status().ToString());
  torch::Tensor t = torch::tensor({*bytes}, torch::kInt64);
  comm::all_reduce(group, t, comm::ReduceOp::kMax).wait();
  return static_cast<double>(t.item<int64_t>());
}

void Report(benchmark::State& state, const comm::ProcessGroup& group, int64_t num_params,
            const std::vector<torch::Tensor>& params, const torch::optim::Optimizer& optim,
            int64_t base_rss, const ForwardRetained& retained) {
  state.counters["ranks"] = group.size();
  state.counters["base_rss_MiB"] = MaxOverRanksMiB(group, base_rss);
  state.counters["fwd_retained_MiB"] = MaxOverRanksMiB(group, retained.max_bytes);
  state.counters["params"] = static_cast<double>(num_params);
  state.counters["step_peak_rss_MiB"] = MaxPeakRssMiB(group);
  state.counters["peak_rss_MiB"] = std::max(state.counters["step_peak_rss_MiB"].value,
                                            state.counters["setup_peak_rss_MiB"].value);
  state.counters["state_bytes"] = MaxStateBytes(group, params, optim);
  // 6 * parameters * tokens: the usual count of a step's model FLOPs
  // (forward 2, backward 4 per parameter per token), per rank; divided by
  // the measured sgemm peak it is the MFU.
  const double tokens = static_cast<double>(kRowsPerRank * kConfig.seq);
  state.counters["tokens_per_rank"] = tokens;
  state.counters["model_FLOP/s_per_rank"] =
      benchmark::Counter(6.0 * static_cast<double>(num_params) * tokens,
                         benchmark::Counter::kIsIterationInvariantRate);
}

// Peak RSS counts the set-up too (building the model, FSDP flattening it),
// which a long run pays once. Before the steps, the allocator returns the
// pages set-up freed and the kernel's high-water mark is reset, so that
// step_peak_rss_MiB is what training itself needs.
void ResetPeakRss() {
  using Release = void (*)();
  static const auto release =
      reinterpret_cast<Release>(dlsym(RTLD_DEFAULT, "MallocExtension_ReleaseFreeMemory"));
  if (release != nullptr) release();
  std::ofstream("/proc/self/clear_refs") << "5";  // resets VmHWM to the current RSS
}

// One warm-up step before timing: Adam allocates its state and FSDP
// initialises lazily on the first forward, which the steady state does not
// pay (the warm-up's memory is counted: it is the steady state's).
template <typename Step>
void TimeSteps(benchmark::State& state, Step&& step) {
  const comm::ProcessGroup& group = *g_group;
  state.counters["setup_peak_rss_MiB"] = MaxPeakRssMiB(group);
  ResetPeakRss();
  state.counters["step_base_rss_MiB"] = MaxOverRanksMiB(group, CurrentRssBytes());
  // What of step_base_rss is live tensors and other heap objects, as the
  // allocator counts them (the rest is the binary, libraries and free pages
  // the allocator keeps).
  state.counters["step_base_allocated_MiB"] = MaxOverRanksMiB(group, AllocatedBytes());
  step();
  for (auto _ : state) step();
}

void BM_NoFSDP(benchmark::State& state, bool checkpointing) {
  const comm::ProcessGroup& group = *g_group;
  const int64_t base_rss = CurrentRssBytes();
  auto lm = BuildLM();
  if (checkpointing) CheckpointBlocks(lm);
  torch::optim::Adam optim(lm->parameters(), torch::optim::AdamOptions(kLr));
  const torch::Tensor batch = RankBatch(group.rank());
  ForwardRetained retained;
  TimeSteps(state, [&] {
    optim.zero_grad();
    retained([&] { return lm->Loss(batch); }).backward();
    optim.step();
  });
  Report(state, group, NumParams(*lm), lm->parameters(), optim, base_rss, retained);
}

void BM_DDP(benchmark::State& state) {
  const comm::ProcessGroup& group = *g_group;
  const int64_t base_rss = CurrentRssBytes();
  auto lm = BuildLM();
  const std::vector<torch::Tensor> params = lm->parameters();
  torch::optim::Adam optim(params, torch::optim::AdamOptions(kLr));
  const torch::Tensor batch = RankBatch(group.rank());
  ForwardRetained retained;
  TimeSteps(state, [&] {
    optim.zero_grad();
    retained([&] { return lm->Loss(batch); }).backward();
    std::vector<torch::Tensor> grads;
    grads.reserve(params.size());
    for (const auto& p : params) grads.push_back(p.grad().reshape({-1}));
    torch::Tensor flat = torch::cat(grads);
    comm::all_reduce(group, flat, comm::ReduceOp::kAvg).wait();
    int64_t offset = 0;
    for (const auto& p : params) {
      const int64_t n = p.numel();
      p.grad().copy_(flat.narrow(0, offset, n).view_as(p.grad()));
      offset += n;
    }
    optim.step();
  });
  Report(state, group, NumParams(*lm), params, optim, base_rss, retained);
}

// The steps of a wrapped model (either FSDP; the root entered through
// run() around the loss) with Adam, timed and reported.
void TimeWrappedSteps(benchmark::State& state, trainer::TransformerLM& lm,
                      trainer::TrainedModel model, int64_t num_params, int64_t base_rss) {
  const comm::ProcessGroup& group = *g_group;
  torch::optim::Adam optim(model.parameters(), torch::optim::AdamOptions(kLr));
  const torch::Tensor batch = RankBatch(group.rank());
  ForwardRetained retained;
  TimeSteps(state, [&] {
    optim.zero_grad();
    retained([&] { return model.run([&] { return lm.Loss(batch); }); }).backward();
    optim.step();
  });
  Report(state, group, num_params, model.parameters(), optim, base_rss, retained);
}

void BM_FSDP(benchmark::State& state, fsdp::ShardingStrategy strategy, bool checkpointing) {
  const comm::ProcessGroup& group = *g_group;
  const int64_t base_rss = CurrentRssBytes();
  auto lm = BuildLM();
  const int64_t num_params = NumParams(*lm);
  if (checkpointing) CheckpointBlocks(lm);
  // The trainer's wrapping (trainer/wrap.cc WrapModel with its defaults): blocks
  // are units called through module_call::call from the block runner, the root is
  // entered through run(), and the optimizer sees the original parameters.
  lm->set_block_runner([](int64_t, trainer::TransformerBlock& block, const torch::Tensor& x,
                          const torch::Tensor& mask) { return module_call::call(block, x, mask); });
  fsdp::FullyShardedDataParallel::Options options;
  options.process_group = group;
  options.sharding_strategy = strategy;
  options.auto_wrap_policy =
      module_call::module_type_auto_wrap_policy<trainer::TransformerBlockImpl>();
  options.backward_prefetch = fsdp::BackwardPrefetch::kBackwardPre;
  options.use_orig_params = true;
  // Typed as LanguageModel, as in the trainer: no single forward(), so the
  // root is entered through run().
  fsdp::FullyShardedDataParallel model(std::static_pointer_cast<trainer::LanguageModel>(lm),
                                       std::move(options));
  TimeWrappedSteps(state, *lm, model, num_params, base_rss);
  state.counters["peak_gathered_MiB"] =
      static_cast<double>(model.peak_unsharded_bytes()) / (1024.0 * 1024.0);
}

void BM_FullyShard(benchmark::State& state, bool checkpointing) {
  const comm::ProcessGroup& group = *g_group;
  const int64_t base_rss = CurrentRssBytes();
  auto lm = BuildLM();
  const int64_t num_params = NumParams(*lm);
  trainer::Options options;
  options.fsdp = trainer::FsdpApi::kFullyShard;
  if (checkpointing) {
    options.activation_checkpointing = trainer::ActivationCheckpointing::kBlock;
  }
  auto wrapped = trainer::WrapModelFullyShard(
      options, std::static_pointer_cast<trainer::LanguageModel>(lm), c10::Device(c10::kCPU), group);
  TORCH_CHECK(wrapped.ok(), "trainer_bench: ", wrapped.status().ToString());
  TimeWrappedSteps(state, *lm, **wrapped, num_params, base_rss);
}

void RegisterAll(const comm::ProcessGroup& group) {
  g_group = &group;
  const int iters = Iterations(group.size());
  auto add = [&](const std::string& name, auto fn) {
    benchmark::RegisterBenchmark(("BM_Step/" + name).c_str(), fn)
        ->Iterations(iters)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  };
  if (group.size() == 1) {
    add("NoFSDP", [](benchmark::State& s) { BM_NoFSDP(s, false); });
    add("NoFSDP_ckpt", [](benchmark::State& s) { BM_NoFSDP(s, true); });
  } else {
    add("DDP", BM_DDP);
  }
  using fsdp::ShardingStrategy;
  add("FULL_SHARD", [](benchmark::State& s) { BM_FSDP(s, ShardingStrategy::kFullShard, false); });
  add("SHARD_GRAD_OP",
      [](benchmark::State& s) { BM_FSDP(s, ShardingStrategy::kShardGradOp, false); });
  add("NO_SHARD", [](benchmark::State& s) { BM_FSDP(s, ShardingStrategy::kNoShard, false); });
  add("FULL_SHARD_ckpt",
      [](benchmark::State& s) { BM_FSDP(s, ShardingStrategy::kFullShard, true); });
  add("SHARD_GRAD_OP_ckpt",
      [](benchmark::State& s) { BM_FSDP(s, ShardingStrategy::kShardGradOp, true); });
  add("FULLY_SHARD", [](benchmark::State& s) { BM_FullyShard(s, false); });
  add("FULLY_SHARD_ckpt", [](benchmark::State& s) { BM_FullyShard(s, true); });
}

int WorldSize() {
  const char* n = std::getenv("TRAINER_BENCH_NPROC");
  if (n == nullptr || *n == '\0') return 1;
  const int w = std::atoi(n);
  return w >= 1 ? w : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return benchmarks::RunOnLocalRanks(argc, argv,
                                     {"trainer_bench", WorldSize(), RegisterAll, nullptr});
}
