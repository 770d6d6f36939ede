// functorch/module: functional_call's overhead over the module's own forward
// (the parameter swap must cost nothing next to the matmuls), and
// stack_module_state for an ensemble of 32 models.
//
//   bazel run //benchmarks:functional_bench
//
// Model: 10 Linear(256, 256) layers with ReLU between, batch 64, float32,
// under NoGradGuard (autograd bookkeeping would only hide the overhead).
#include "functorch/module/functional_call.h"
#include "functorch/module/stack_module_state.h"

#include <benchmark/benchmark.h>

#include "benchmarks/machine_report.h"
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <vector>

namespace {

constexpr int64_t kWidth = 256;
constexpr int64_t kBatch = 64;
constexpr int kLayers = 10;

torch::nn::Sequential make_mlp10() {
  torch::nn::Sequential mlp;
  for (int i = 0; i < kLayers; ++i) {
    mlp->push_back(torch::nn::Linear(kWidth, kWidth));
    if (i + 1 < kLayers) mlp->push_back(torch::nn::ReLU());
  }
  return mlp;
}

void BM_ModuleForward_MLP10(benchmark::State& state) {
  torch::manual_seed(0);
  torch::NoGradGuard no_grad;
  auto model = make_mlp10();
  const torch::Tensor x = torch::randn({kBatch, kWidth});
  for (auto _ : state) {
    benchmark::DoNotOptimize(model->forward(x));
  }
}
BENCHMARK(BM_ModuleForward_MLP10)->Unit(benchmark::kMicrosecond);

void BM_FunctionalCall_MLP10(benchmark::State& state) {
  torch::manual_seed(0);
  torch::NoGradGuard no_grad;
  auto model = make_mlp10();
  // Substitutes from a second model: all 20 parameters are swapped per call.
  const functorch::NamedTensors params = make_mlp10()->named_parameters();
  const torch::Tensor x = torch::randn({kBatch, kWidth});
  for (auto _ : state) {
    benchmark::DoNotOptimize(functorch::functional_call(model, params, x));
  }
}
BENCHMARK(BM_FunctionalCall_MLP10)->Unit(benchmark::kMicrosecond);

// The swap alone (checks, 20 swaps in, 20 back), no forward: what
// functional_call adds to any forward.
void BM_ReparametrizeOnly_MLP10(benchmark::State& state) {
  torch::manual_seed(0);
  auto model = make_mlp10();
  const functorch::NamedTensors params = make_mlp10()->named_parameters();
  for (auto _ : state) {
    functorch::ReparametrizeGuard guard(model.ptr(), params);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_ReparametrizeOnly_MLP10)->Unit(benchmark::kMicrosecond);

void BM_StackModuleState_32(benchmark::State& state) {
  torch::manual_seed(0);
  std::vector<torch::nn::Sequential> models;
  for (int i = 0; i < 32; ++i) models.push_back(make_mlp10());
  for (auto _ : state) {
    benchmark::DoNotOptimize(functorch::stack_module_state(models));
  }
}
BENCHMARK(BM_StackModuleState_32)->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  benchmarks::UseAllCores("functional_bench");
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
