// What autograd keeps for backward, and what a training step costs, with the
// trainer's two attention kernels (trainer/models.h AttentionKernel), issue
// 36's GPU proxy: the memory saved per step must fall by at least the
// B*H*T^2 attention scores.
//
//   bazel run -c opt //benchmarks:attention_memory_bench
//
//   BM_Forward/kernel:0   AttentionKernel::kSdpa (at::scaled_dot_product_attention,
//                         is_causal), the trainer's attention since issue 36
//   BM_Forward/kernel:1   AttentionKernel::kMultiheadAttention (LibTorch's
//                         nn::MultiheadAttention + CausalMask), the one before
//   BM_Step/kernel:N      forward + backward of the same, timed
//
// Model: the trainer's TransformerLM at issue 36's 152M configuration
// (12 layers x dim 1024, 16 heads, seq 1024, vocab 256) by default; the
// environment scales it: ATTN_BENCH_LAYERS, _DIM, _HEADS, _SEQ, _ROWS (rows
// of seq + 1 tokens per step; default 2: the global batch of 16 does
// not fit 24 GiB with the old kernel, and the scores scale linearly in rows).
// BM_Step runs at ATTN_BENCH_STEP_SEQ (default 256) so that it takes seconds.
//
// Counters: fwd_retained_MiB, the bytes the allocator (tcmalloc's
// generic.current_allocated_bytes) holds more after the forward (loss
// computed, graph alive) than before it: what the graph keeps for backward;
// scores_MiB = layers x B x H x T^2 x 4 bytes, one float32 [B, H, T, T] per
// layer, the attention scores the goal says must go. The summary prints
// the drop from kMultiheadAttention to kSdpa against scores_MiB.
#include <benchmark/benchmark.h>
#include <dlfcn.h>
#include <torch/types.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "benchmarks/machine_report.h"
#include "trainer/models.h"

namespace {

int64_t FromEnv(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr) return fallback;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (*text == '\0' || *end != '\0' || value < 1) {
    std::fprintf(stderr, "attention_memory_bench: %s='%s': expected an integer >= 1\n", name, text);
    std::exit(2);
  }
  return value;
}

trainer::ModelConfig Config(int64_t kernel, int64_t seq) {
  trainer::ModelConfig c{FromEnv("ATTN_BENCH_LAYERS", 12), FromEnv("ATTN_BENCH_DIM", 1024),
                         FromEnv("ATTN_BENCH_HEADS", 16), /*vocab=*/256, seq};
  c.attention =
      kernel == 0 ? trainer::AttentionKernel::kSdpa : trainer::AttentionKernel::kMultiheadAttention;
  return c;
}

const int64_t kRows = FromEnv("ATTN_BENCH_ROWS", 2);

// tcmalloc's generic.current_allocated_bytes (-1 without tcmalloc).
int64_t AllocatedBytes() {
  using Getter = int (*)(const char*, size_t*);
  static const auto getter =
      reinterpret_cast<Getter>(dlsym(RTLD_DEFAULT, "MallocExtension_GetNumericProperty"));
  size_t value = 0;
  if (getter == nullptr || !getter("generic.current_allocated_bytes", &value)) return -1;
  return static_cast<int64_t>(value);
}

torch::Tensor Batch(int64_t seq) {
  torch::manual_seed(3);
  return torch::randint(256, {kRows, seq + 1}, torch::kInt64);
}

void BM_Forward(benchmark::State& state) {
  const trainer::ModelConfig config = Config(state.range(0), FromEnv("ATTN_BENCH_SEQ", 1024));
  auto model = trainer::BuildModel(trainer::ModelType::kTransformer, config, /*seed=*/0);
  const torch::Tensor batch = Batch(config.seq);
  int64_t retained = 0;
  for (auto _ : state) {
    const int64_t before = AllocatedBytes();
    torch::Tensor loss = model->Loss(batch);
    const int64_t after = AllocatedBytes();
    retained = after - before;
    benchmark::DoNotOptimize(loss.data_ptr());
  }
  const double mib = 1024.0 * 1024.0;
  state.counters["fwd_retained_MiB"] = static_cast<double>(retained) / mib;
  state.counters["scores_MiB"] = static_cast<double>(config.layers * kRows * config.heads) *
                                 static_cast<double>(config.seq * config.seq) * 4.0 / mib;
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  state.counters["params"] = static_cast<double>(params);
  state.SetLabel("layers " + std::to_string(config.layers) + ", dim " + std::to_string(config.dim) +
                 ", heads " + std::to_string(config.heads) + ", seq " + std::to_string(config.seq) +
                 ", rows " + std::to_string(kRows));
}

void BM_Step(benchmark::State& state) {
  const trainer::ModelConfig config = Config(state.range(0), FromEnv("ATTN_BENCH_STEP_SEQ", 256));
  auto model = trainer::BuildModel(trainer::ModelType::kTransformer, config, /*seed=*/0);
  const torch::Tensor batch = Batch(config.seq);
  for (auto _ : state) {
    model->zero_grad();
    model->Loss(batch).backward();
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(kRows * config.seq),
                                                  benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel("seq " + std::to_string(config.seq) + ", rows " + std::to_string(kRows) + "; " +
                 benchmarks::ThreadsLabel());
}

BENCHMARK(BM_Forward)
    ->ArgName("kernel")
    ->Arg(0)
    ->Arg(1)
    ->Iterations(1)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Step)->ArgName("kernel")->Arg(0)->Arg(1)->Iterations(2)->UseRealTime()->Unit(
    benchmark::kMillisecond);

void Summary(const benchmarks::Results& results) {
  auto sdpa = results.find("BM_Forward/kernel:0/iterations:1");
  auto mha = results.find("BM_Forward/kernel:1/iterations:1");
  if (sdpa != results.end() && mha != results.end()) {
    const double drop =
        mha->second.counters.at("fwd_retained_MiB") - sdpa->second.counters.at("fwd_retained_MiB");
    const double scores = sdpa->second.counters.at("scores_MiB");
    std::printf(
        "saved for backward: MultiheadAttention %.1f MiB, SDPA %.1f MiB: %.1f MiB less = "
        "%.2f x the B*H*T^2 float32 scores (%.1f MiB); goal >= 1\n",
        mha->second.counters.at("fwd_retained_MiB"), sdpa->second.counters.at("fwd_retained_MiB"),
        drop, drop / scores, scores);
  }
  auto step_sdpa = results.find("BM_Step/kernel:0/iterations:2");
  auto step_mha = results.find("BM_Step/kernel:1/iterations:2");
  if (step_sdpa != results.end() && step_mha != results.end()) {
    std::printf("forward+backward: SDPA %.3f s, MultiheadAttention %.3f s: SDPA %.2fx faster\n",
                step_sdpa->second.real_s, step_mha->second.real_s,
                step_mha->second.real_s / step_sdpa->second.real_s);
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmarks::UseAllCores("attention_memory_bench");
  benchmarks::SummaryReporter reporter(Summary);
  return benchmarks::RunWithSummary(argc, argv, reporter);
}
