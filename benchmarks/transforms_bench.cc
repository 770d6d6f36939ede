// Benchmarks for //functorch/transforms (issue #5).
//
//   bazel run //benchmarks:transforms_bench
//
// Per-sample gradients: MLP 128 -> 256 -> ReLU -> 10, cross-entropy, batch
// 256, float32; vmap(grad(loss)) against a loop of per-example
// torch::autograd::grad. Batched Jacobians: f: R^16 -> R^16 tanh MLP (hidden
// 64), batch 1024; vmap(jacrev(f)) against per-example autograd Jacobians
// (one backward per output row). BM_VmapDot_Tiny: the whole-call overhead of
// a vmapped dot on [8, 5] inputs.

#include <benchmark/benchmark.h>

#include "benchmarks/machine_report.h"
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/functional/loss.h>
#include <torch/types.h>

#include <vector>

#include "functorch/transforms/transforms.h"

namespace {

using torch::Tensor;
namespace F = torch::nn::functional;

struct Mlp {
  Tensor w1 = torch::randn({256, 128}) * 0.05;
  Tensor b1 = torch::zeros({256});
  Tensor w2 = torch::randn({10, 256}) * 0.05;
  Tensor b2 = torch::zeros({10});
  Tensor x = torch::randn({256, 128});
  Tensor t = torch::randint(0, 10, {256});
};

// Loss of one example (x: [128], t: []), written for a single example as
// per-sample code is written for vmap.
Tensor example_loss(const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
                    const Tensor& x, const Tensor& t) {
  Tensor h = F::linear(x, w1, b1).relu();
  Tensor logits = F::linear(h, w2, b2);
  return F::cross_entropy(logits.unsqueeze(0), t.unsqueeze(0));
}

void BM_PerSampleGrad_VmapGrad(benchmark::State& state) {
  Mlp m;
  auto per_sample = functorch::vmap(functorch::grad(example_loss, {0, 1, 2, 3}),
                                    {std::nullopt, std::nullopt, std::nullopt, std::nullopt, 0, 0});
  for (auto _ : state) {
    functorch::Tree grads = per_sample(m.w1, m.b1, m.w2, m.b2, m.x, m.t);
    benchmark::DoNotOptimize(grads);
  }
}
BENCHMARK(BM_PerSampleGrad_VmapGrad)->Unit(benchmark::kMillisecond);

void BM_PerSampleGrad_Loop(benchmark::State& state) {
  Mlp m;
  std::vector<Tensor> params{m.w1.requires_grad_(), m.b1.requires_grad_(), m.w2.requires_grad_(),
                             m.b2.requires_grad_()};
  for (auto _ : state) {
    std::vector<std::vector<Tensor>> per_param(params.size());
    for (int64_t i = 0; i < m.x.size(0); ++i) {
      Tensor loss = example_loss(params[0], params[1], params[2], params[3], m.x[i], m.t[i]);
      auto grads = torch::autograd::grad({loss}, params);
      for (size_t k = 0; k < grads.size(); ++k) per_param[k].push_back(grads[k]);
    }
    std::vector<Tensor> stacked;
    for (auto& g : per_param) stacked.push_back(torch::stack(g));
    benchmark::DoNotOptimize(stacked);
  }
}
BENCHMARK(BM_PerSampleGrad_Loop)->Unit(benchmark::kMillisecond);

// The memory floor under both: the per-sample gradients are 256 copies of
// every parameter (36.4 MB), written into fresh memory as vmap(grad) and
// torch.stack write them. Nothing that returns them can be faster than this.
void BM_PerSampleGrad_OutputWriteFloor(benchmark::State& state) {
  Mlp m;
  const int64_t batch = m.x.size(0);
  const std::vector<Tensor> params{m.w1, m.b1, m.w2, m.b2};
  int64_t bytes = 0;
  for (auto _ : state) {
    std::vector<Tensor> out;
    bytes = 0;
    for (const Tensor& p : params) {
      std::vector<int64_t> shape{batch};
      shape.insert(shape.end(), p.sizes().begin(), p.sizes().end());
      out.push_back(torch::empty(shape).fill_(1.0));
      bytes += out.back().nbytes();
    }
    benchmark::DoNotOptimize(out);
  }
  state.counters["GB/s"] =
      benchmark::Counter(static_cast<double>(bytes) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_PerSampleGrad_OutputWriteFloor)->Unit(benchmark::kMillisecond);

// The first layer's per-sample weight gradients are 256 rank-1 outer
// products. ATen's mm batching rule hands them to bmm with a contraction of
// 1, which on the wheel's MKL costs about 3.6x the same products as a
// broadcast multiply (MKL's beta-scaling pass, sgemm_mscale, dominates);
// Python torch.func runs that bmm. functorch/transforms runs the multiply
// (its mm rule under FuncTorchVmapMode). These two keep the gap measured.
void BM_PerSampleGrad_Rank1AsBmm(benchmark::State& state) {
  Tensor grad_out = torch::randn({256, 256, 1});
  Tensor input = torch::randn({256, 1, 128});
  for (auto _ : state) {
    Tensor outer = torch::bmm(grad_out, input);
    benchmark::DoNotOptimize(outer);
  }
}
BENCHMARK(BM_PerSampleGrad_Rank1AsBmm)->Unit(benchmark::kMillisecond);

void BM_PerSampleGrad_Rank1AsMul(benchmark::State& state) {
  Tensor grad_out = torch::randn({256, 256, 1});
  Tensor input = torch::randn({256, 1, 128});
  for (auto _ : state) {
    Tensor outer = grad_out * input;
    benchmark::DoNotOptimize(outer);
  }
}
BENCHMARK(BM_PerSampleGrad_Rank1AsMul)->Unit(benchmark::kMillisecond);

struct TanhMlp {
  Tensor w1 = torch::randn({64, 16}) * 0.25;
  Tensor b1 = torch::randn({64}) * 0.1;
  Tensor w2 = torch::randn({16, 64}) * 0.125;
  Tensor b2 = torch::randn({16}) * 0.1;
  Tensor operator()(const Tensor& x) const {
    return F::linear(F::linear(x, w1, b1).tanh(), w2, b2).tanh();
  }
};

void BM_BatchedJacobian_VmapJacrev(benchmark::State& state) {
  TanhMlp f;
  Tensor xs = torch::randn({1024, 16});
  auto batched_jacobian = functorch::vmap(functorch::jacrev(f));
  for (auto _ : state) {
    Tensor j = batched_jacobian(xs);
    benchmark::DoNotOptimize(j);
  }
}
BENCHMARK(BM_BatchedJacobian_VmapJacrev)->Unit(benchmark::kMillisecond);

void BM_BatchedJacobian_Loop(benchmark::State& state) {
  TanhMlp f;
  Tensor xs = torch::randn({1024, 16});
  for (auto _ : state) {
    std::vector<Tensor> jacobians;
    for (int64_t i = 0; i < xs.size(0); ++i) {
      Tensor x = xs[i].detach().requires_grad_();
      Tensor y = f(x);
      std::vector<Tensor> rows;
      for (int64_t r = 0; r < y.size(0); ++r) {
        rows.push_back(torch::autograd::grad({y[r]}, {x}, {}, /*retain_graph=*/true)[0]);
      }
      jacobians.push_back(torch::stack(rows));
    }
    Tensor j = torch::stack(jacobians);
    benchmark::DoNotOptimize(j);
  }
}
BENCHMARK(BM_BatchedJacobian_Loop)->Unit(benchmark::kMillisecond);

void BM_VmapDot_Tiny(benchmark::State& state) {
  Tensor x = torch::randn({8, 5}), y = torch::randn({8, 5});
  auto batched_dot = functorch::vmap(torch::dot);
  for (auto _ : state) {
    Tensor out = batched_dot(x, y);
    benchmark::DoNotOptimize(out);
  }
}
BENCHMARK(BM_VmapDot_Tiny)->Unit(benchmark::kMicrosecond);

// For scale: the same [8] result without vmap (one fused op).
void BM_Dot_Tiny_Direct(benchmark::State& state) {
  Tensor x = torch::randn({8, 5}), y = torch::randn({8, 5});
  for (auto _ : state) {
    Tensor out = (x * y).sum(1);
    benchmark::DoNotOptimize(out);
  }
}
BENCHMARK(BM_Dot_Tiny_Direct)->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) {
  benchmarks::UseAllCores("transforms_bench");
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
