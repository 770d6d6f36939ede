// One AdamW step on the parameter state of trainer_bench's model (the
// trainer's TransformerLM, 8 blocks x dim 512, 8 heads, vocab 256, seq 32:
// ~25.4M float32 parameters in 100 tensors), issue 36's CPU goal: the fused
// step at least 3x faster than torch::optim::AdamW.
//
//   bazel run -c opt //benchmarks:optim_bench
//
//   BM_AdamWStep/torch_optim   torch::optim::AdamW (per parameter: ~10 ATen
//                              ops, each a pass over the tensor)
//   BM_AdamWStep/foreach       optim::AdamW, Implementation::kForeach
//                              (at::_foreach_* over all 100 tensors)
//   BM_AdamWStep/fused         optim::AdamW, Implementation::kFused (one
//                              at::_fused_adamw_ kernel: one pass)
//   BM_TensorCopy              the bandwidth probe of hardware_limits_bench,
//                              in the same run: a 256 MiB float32
//                              Tensor::copy_; "rd+wr/s" = 2 x bytes copied.
//
// Every step case has lr 3e-4, weight decay 0.01 (the trainer's), the same
// fixed gradients, and its state created by one untimed step first.
// Counter "bytes/s" of a step case: the bytes an AdamW step must move at the
// least, 28 per parameter (read param, grad, exp_avg, exp_avg_sq; write
// param, exp_avg, exp_avg_sq; float32), per second. The summary prints each
// step against torch::optim's and that traffic as a fraction of the copy's
// rd+wr/s: how close a step comes to the memory bandwidth that bounds it.
// Counter cpu_ms: the process's CPU time per step (all threads), a measure
// of the work that a busy machine does not inflate as it does wall time;
// the summary prints its ratio too. Run with --benchmark_repetitions and
// --benchmark_enable_random_interleaving on a shared machine.
#include <benchmark/benchmark.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>

#include <time.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "benchmarks/machine_report.h"
#include "optim/optimizers.h"
#include "trainer/models.h"

namespace {

const trainer::ModelConfig kConfig{/*layers=*/8, /*dim=*/512, /*heads=*/8, /*vocab=*/256,
                                   /*seq=*/32};
constexpr double kBytesPerParam = 7 * sizeof(float);
constexpr size_t kCopyBytes = size_t{256} << 20;

// The model's parameters with fixed gradients (what a backward leaves).
std::vector<torch::Tensor> ParamsWithGrads() {
  auto model = trainer::BuildModel(trainer::ModelType::kTransformer, kConfig, /*seed=*/0);
  std::vector<torch::Tensor> params = model->parameters();
  torch::manual_seed(1);
  for (auto& p : params) p.mutable_grad() = torch::randn_like(p) * 1e-3;
  return params;
}

int64_t NumParams(const std::vector<torch::Tensor>& params) {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel();
  return n;
}

// CPU time of the whole process (every thread): unlike wall time, it does
// not grow when other processes take the cores.
double ProcessCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

enum Case { kTorchOptim, kForeach, kFused };

std::unique_ptr<torch::optim::Optimizer> MakeAdamW(Case c, std::vector<torch::Tensor> params) {
  const auto options = torch::optim::AdamWOptions(3e-4).weight_decay(0.01);
  if (c == kTorchOptim) return std::make_unique<torch::optim::AdamW>(std::move(params), options);
  return std::make_unique<optim::AdamW>(
      std::move(params), options,
      c == kFused ? optim::Implementation::kFused : optim::Implementation::kForeach);
}

void BM_AdamWStep(benchmark::State& state) {
  const auto c = static_cast<Case>(state.range(0));
  const std::vector<torch::Tensor> params = ParamsWithGrads();
  auto opt = MakeAdamW(c, params);
  opt->step();  // creates the state
  const double cpu_start = ProcessCpuSeconds();
  for (auto _ : state) opt->step();
  state.counters["cpu_ms"] =
      (ProcessCpuSeconds() - cpu_start) * 1e3 / static_cast<double>(state.iterations());
  const double n = static_cast<double>(NumParams(params));
  state.counters["params"] = n;
  state.counters["tensors"] = static_cast<double>(params.size());
  state.counters["bytes/s"] =
      benchmark::Counter(n * kBytesPerParam, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(benchmarks::ThreadsLabel());
}

void BM_TensorCopy(benchmark::State& state) {
  const int64_t floats = static_cast<int64_t>(kCopyBytes / sizeof(float));
  const torch::Tensor src = torch::ones({floats});
  torch::Tensor dst = torch::zeros({floats});
  const double cpu_start = ProcessCpuSeconds();
  for (auto _ : state) {
    dst.copy_(src);
    benchmark::DoNotOptimize(dst.data_ptr());
  }
  state.counters["cpu_ms"] =
      (ProcessCpuSeconds() - cpu_start) * 1e3 / static_cast<double>(state.iterations());
  state.counters["rd+wr/s"] = benchmark::Counter(2.0 * static_cast<double>(kCopyBytes),
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel("Tensor::copy_ float32, 256 MiB; " + benchmarks::ThreadsLabel());
}

BENCHMARK(BM_AdamWStep)
    ->ArgName("case")
    ->Arg(kTorchOptim)
    ->Arg(kForeach)
    ->Arg(kFused)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TensorCopy)->UseRealTime()->Unit(benchmark::kMillisecond);

void Summary(const benchmarks::Results& results) {
  const auto get = [&](const std::string& name) -> const benchmarks::Measured* {
    auto it = results.find(name);
    return it == results.end() ? nullptr : &it->second;
  };
  const auto* base = get("BM_AdamWStep/case:0");
  const auto* copy = get("BM_TensorCopy");
  const char* names[] = {"torch::optim::AdamW", "optim::AdamW foreach", "optim::AdamW fused"};
  for (int c = 0; c < 3; ++c) {
    const auto* m = get("BM_AdamWStep/case:" + std::to_string(c));
    if (m == nullptr) continue;
    std::printf("%-22s %8.2f ms/step", names[c], m->real_s * 1e3);
    if (base != nullptr) std::printf("  %5.2fx torch::optim", base->real_s / m->real_s);
    std::printf("  (CPU %.2f ms/step", m->counters.at("cpu_ms"));
    if (base != nullptr) {
      std::printf(": %.2fx torch::optim", base->counters.at("cpu_ms") / m->counters.at("cpu_ms"));
    }
    std::printf(")");
    if (copy != nullptr) {
      // The same fraction on CPU time: bytes per CPU-second of the step
      // against the copy's (each over its own CPU time).
      const double step_bytes = m->counters.at("bytes/s") * m->real_s;
      const double copy_bytes = 2.0 * static_cast<double>(kCopyBytes);
      const double step_cpu_bw = step_bytes / (m->counters.at("cpu_ms") * 1e-3);
      const double copy_cpu_bw = copy_bytes / (copy->counters.at("cpu_ms") * 1e-3);
      std::printf(
          "  %.2f GB/s = %.2f of Tensor::copy_'s rd+wr %.2f GB/s (per CPU-second: %.2f of %.2f "
          "GB/s)",
          m->counters.at("bytes/s") / 1e9, m->counters.at("bytes/s") / copy->counters.at("rd+wr/s"),
          copy->counters.at("rd+wr/s") / 1e9, step_cpu_bw / copy_cpu_bw, copy_cpu_bw / 1e9);
    }
    std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmarks::UseAllCores("optim_bench");
  benchmarks::SummaryReporter reporter(Summary);
  return benchmarks::RunWithSummary(argc, argv, reporter);
}
