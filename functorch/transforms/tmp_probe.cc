#include <ATen/functorch/BatchedFallback.h>
#include <torch/torch.h>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <chrono>
#include <iostream>
#include "functorch/transforms/transforms.h"
using torch::Tensor;
namespace F = torch::nn::functional;
Tensor example_loss(const Tensor& w1, const Tensor& b1, const Tensor& w2,
                    const Tensor& b2, const Tensor& x, const Tensor& t) {
  Tensor h = F::linear(x, w1, b1).relu();
  Tensor logits = F::linear(h, w2, b2);
  return F::cross_entropy(logits.unsqueeze(0), t.unsqueeze(0));
}
int main() {
  at::functorch::setVmapFallbackWarningEnabled(true);
  Tensor w1 = torch::randn({256, 128}) * 0.05, b1 = torch::zeros({256});
  Tensor w2 = torch::randn({10, 256}) * 0.05, b2 = torch::zeros({10});
  Tensor x = torch::randn({256, 128});
  Tensor t = torch::randint(0, 10, {256});
  auto per_sample = functorch::vmap(functorch::grad(example_loss, {0, 1, 2, 3}),
      {c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt, 0, 0});
  functorch::Tree g = per_sample(w1, b1, w2, b2, x, t);
  {
    torch::autograd::profiler::RecordProfile guard("/tmp/probe/trace.json");
    for (int i = 0; i < 3; ++i) g = per_sample(w1, b1, w2, b2, x, t);
  }
}
