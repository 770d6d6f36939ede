#include "functorch/transforms/transforms_gpu_check.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <torch/cuda.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/functional/loss.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "functorch/transforms/transforms.h"

namespace functorch {
namespace {

using gpu_check::Fail;
using gpu_check::Pass;
using gpu_check::Problems;
using gpu_check::Result;

// Calls `fn` `warm_up` times, then times `reps` calls (`device`
// synchronised before and after each) and returns the median in ms.
double MedianMs(torch::Device device, const std::function<void()>& fn, int warm_up, int reps) {
  auto sync = [device] {
    if (!device.is_cpu()) torch::cuda::synchronize();
  };
  for (int i = 0; i < warm_up; ++i) fn();
  std::vector<double> ms;
  ms.reserve(static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    sync();
    const auto start = std::chrono::steady_clock::now();
    fn();
    sync();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count());
  }
  std::nth_element(ms.begin(), ms.begin() + static_cast<std::ptrdiff_t>(ms.size() / 2), ms.end());
  return ms[ms.size() / 2];
}

// max|actual - expected| over max|expected|, both compared on the CPU; the
// shapes must agree. Adds a problem when the ratio exceeds `rtol`.
double CompareToCpu(torch::Device device, Problems& problems, const std::string& what,
                    const torch::Tensor& actual, const torch::Tensor& expected, double rtol) {
  const torch::Tensor a = actual.to(torch::kCPU);
  if (a.sizes() != expected.sizes()) {
    problems.Add(absl::StrCat(what, ": shape ", c10::str(a.sizes()), ", expected ",
                              c10::str(expected.sizes()), " (the CPU's)"));
    return 0;
  }
  const double diff = (a - expected).abs().max().item<double>();
  const double scale = expected.abs().max().item<double>();
  const double rel = scale > 0 ? diff / scale : diff;
  if (!(rel <= rtol)) {
    problems.Add(
        absl::StrFormat("%s: max |%s - CPU| = %.3g, %.3g of max |CPU| = %.3g: expected <= %g", what,
                        device.str(), diff, rel, scale, rtol));
  }
  return rel;
}

// How the device result was compared with the CPU's, for a PASS line.
std::string ComparedWithCpu(torch::Device device, double rel, double rtol) {
  if (device.is_cpu()) {
    return absl::StrFormat(
        "max difference %.3g of max |CPU| (dry run: the device is the CPU, so this compares "
        "the CPU with itself and is trivially exact)",
        rel);
  }
  return absl::StrFormat("max |%s - CPU| = %.3g of max |CPU| (<= %g; TF32 matmuls %s)",
                         device.str(), rel, rtol,
                         at::globalContext().allowTF32CuBLAS() ? "ON" : "off");
}

// //benchmarks:transforms_bench's BM_PerSampleGrad_VmapGrad case: an MLP
// 128 -> 256 -> ReLU -> 10, cross-entropy, batch 256, float32; the
// per-example loss, as written for vmap.
torch::Tensor PerSampleLoss(const torch::Tensor& w1, const torch::Tensor& b1,
                            const torch::Tensor& w2, const torch::Tensor& b2,
                            const torch::Tensor& x, const torch::Tensor& t) {
  namespace F = torch::nn::functional;
  torch::Tensor logits = F::linear(F::linear(x, w1, b1).relu(), w2, b2);
  return F::cross_entropy(logits.unsqueeze(0), t.unsqueeze(0));
}

Result CheckFunctorchPerSampleGrads(torch::Device device) {
  constexpr double kRtol = 1e-5;
  torch::manual_seed(0);
  const std::vector<torch::Tensor> cpu_inputs = {
      torch::randn({256, 128}) * 0.05, torch::zeros({256}),
      torch::randn({10, 256}) * 0.05,  torch::zeros({10}),
      torch::randn({256, 128}),        torch::randint(0, 10, {256})};
  std::vector<torch::Tensor> inputs;
  for (const auto& t : cpu_inputs) inputs.push_back(t.to(device));
  auto per_sample = functorch::vmap(functorch::grad(PerSampleLoss, {0, 1, 2, 3}),
                                    {std::nullopt, std::nullopt, std::nullopt, std::nullopt, 0, 0});
  auto run = [&per_sample](const std::vector<torch::Tensor>& in) -> std::vector<torch::Tensor> {
    return per_sample(in[0], in[1], in[2], in[3], in[4], in[5]);
  };
  const std::vector<torch::Tensor> expected = run(cpu_inputs);
  const std::vector<torch::Tensor> actual = run(inputs);
  Problems problems;
  const char* const names[] = {"dw1", "db1", "dw2", "db2"};
  double worst = 0;
  if (actual.size() != 4 || expected.size() != 4) {
    problems.Add(absl::StrCat("vmap(grad) returned ", actual.size(), " (device) and ",
                              expected.size(), " (CPU) gradients: expected 4"));
  } else {
    for (size_t i = 0; i < 4; ++i) {
      if (actual[i].device() != device) {
        problems.Add(absl::StrCat(names[i], " is on ", actual[i].device().str(), ", expected ",
                                  device.str()));
      }
      worst =
          std::max(worst, CompareToCpu(device, problems, names[i], actual[i], expected[i], kRtol));
    }
  }
  if (!problems.empty()) return Fail(problems.Joined());
  constexpr int kReps = 20;
  const double ms = MedianMs(
      device, [&] { run(inputs); }, /*warm_up=*/3, kReps);
  return Pass(absl::StrFormat(
      "vmap(grad(loss)) over MLP 128-256-10, cross-entropy, batch 256, float32 on %s: "
      "4 per-sample gradients ([256, 256, 128] ...) equal the CPU's: %s; median %.3f ms of %d "
      "calls",
      device.str(), ComparedWithCpu(device, worst, kRtol), ms, kReps));
}

// //benchmarks:hessian_bench's PINN case: u: R^2 -> R^3, 2 -> 512 -> 512 ->
// 512 -> 3, tanh after each hidden layer, float32; its Hessians
// vmap(jacfwd(jacrev(u))) at 1024 points -> [1024, 3, 2, 2].
struct PinnMlp {
  std::vector<torch::Tensor> p;  // w1 b1 w2 b2 w3 b3 w4 b4
  torch::Tensor operator()(const torch::Tensor& x) const {
    namespace F = torch::nn::functional;
    torch::Tensor h = F::linear(x, p[0], p[1]).tanh();
    h = F::linear(h, p[2], p[3]).tanh();
    h = F::linear(h, p[4], p[5]).tanh();
    return F::linear(h, p[6], p[7]);
  }
  PinnMlp To(torch::Device device) const {
    PinnMlp moved;
    for (const auto& t : p) moved.p.push_back(t.to(device));
    return moved;
  }
};

Result CheckFunctorchBatchedHessians(torch::Device device) {
  // Second derivatives through three 512-wide layers in float32: the
  // device's summation order differs from the CPU's.
  constexpr double kRtol = 1e-4;
  constexpr int64_t kIn = 2, kHidden = 512, kOut = 3, kPoints = 1024;
  torch::manual_seed(0);
  PinnMlp cpu_u;
  cpu_u.p = {
      torch::randn({kHidden, kIn}) / std::sqrt(double{kIn}),         torch::randn({kHidden}) * 0.1,
      torch::randn({kHidden, kHidden}) / std::sqrt(double{kHidden}), torch::randn({kHidden}) * 0.1,
      torch::randn({kHidden, kHidden}) / std::sqrt(double{kHidden}), torch::randn({kHidden}) * 0.1,
      torch::randn({kOut, kHidden}) / std::sqrt(double{kHidden}),    torch::randn({kOut}) * 0.1};
  const torch::Tensor cpu_xs = torch::rand({kPoints, kIn}) * 2 - 1;
  const PinnMlp u = cpu_u.To(device);
  const torch::Tensor xs = cpu_xs.to(device);
  auto hessians_of = [](const PinnMlp& f) {
    auto ff = [f](const torch::Tensor& x) { return f(x); };
    return functorch::vmap(functorch::jacfwd(functorch::jacrev(ff)));
  };
  auto cpu_hessians = hessians_of(cpu_u);
  auto hessians = hessians_of(u);
  const torch::Tensor expected = cpu_hessians(cpu_xs);
  const torch::Tensor actual = hessians(xs);
  Problems problems;
  if (actual.device() != device) {
    problems.Add(
        absl::StrCat("the Hessians are on ", actual.device().str(), ", expected ", device.str()));
  }
  const double rel = CompareToCpu(device, problems, "Hessians", actual, expected, kRtol);
  if (!problems.empty()) return Fail(problems.Joined());
  // A call takes about a second on a small CPU: fewer calls in a dry run.
  const bool dry_run = device.is_cpu();
  const int reps = dry_run ? 3 : 20;
  const double ms = MedianMs(
      device, [&] { hessians(xs); }, dry_run ? 1 : 3, reps);
  return Pass(absl::StrFormat(
      "vmap(jacfwd(jacrev(u))), u a 2-512-512-512-3 tanh MLP, float32, %d points on %s: "
      "Hessians [%d, 3, 2, 2] equal the CPU's: %s; median %.3f ms of %d calls",
      static_cast<int>(kPoints), device.str(), static_cast<int>(kPoints),
      ComparedWithCpu(device, rel, kRtol), ms, reps));
}

}  // namespace

std::vector<gpu_check::Check> TransformsGpuChecks(c10::Device device) {
  return {
      {"functorch_per_sample_grads", [device] { return CheckFunctorchPerSampleGrads(device); }},
      {"functorch_batched_hessians", [device] { return CheckFunctorchBatchedHessians(device); }},
  };
}

}  // namespace functorch
