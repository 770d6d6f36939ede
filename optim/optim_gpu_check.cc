#include "optim/optim_gpu_check.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "absl/strings/str_cat.h"
#include "optim/optimizers.h"
#include "testing/sync_debug_mode.h"

namespace optim {
namespace {

using gpu_check::Fail;
using gpu_check::Pass;
using gpu_check::Problems;
using gpu_check::Result;
using gpu_check::SyncDebugScope;

// optim::Adam / AdamW / SGD, fused and foreach, on `device`: parameters in
// two dtypes (float32 and, on CUDA, bfloat16: two buckets of the fused
// kernels), 4 steps of fixed gradients, against torch::optim's on the CPU
// in float32 (rtol 1e-5, atol 1e-6; bfloat16 parameters within 2e-2 of the
// reference). On CUDA the steps after the first (the state exists) run
// under CUDA's sync-debug mode set to error: a step that synchronises the
// host (reads a value back) throws.
template <typename Ours, typename Reference, typename Options>
void CheckOneOptimizer(c10::Device device, Problems& problems, const std::string& what,
                       const Options& options, optim::Implementation impl) {
  torch::manual_seed(36);
  const std::vector<std::vector<int64_t>> shapes = {{33, 7}, {129}, {4, 5, 6}};
  std::vector<torch::Tensor> init, ours, ref;
  for (const auto& s : shapes) init.push_back(torch::randn(s));
  for (size_t i = 0; i < init.size(); ++i) {
    const auto dtype = (device.is_cuda() && i == 1) ? torch::kBFloat16 : torch::kFloat32;
    ours.push_back(
        init[i].to(device, dtype, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true));
    ref.push_back(init[i].to(ours[i].dtype()).to(torch::kFloat32).clone().requires_grad_(true));
  }
  Ours opt(ours, options, impl);
  Reference ref_opt(ref, options);
  for (int step = 0; step < 4; ++step) {
    for (size_t i = 0; i < init.size(); ++i) {
      torch::Tensor g = torch::randn(init[i].sizes());
      ours[i].mutable_grad() = g.to(device, ours[i].dtype());
      ref[i].mutable_grad() = g.to(ours[i].dtype()).to(torch::kFloat32);
    }
    {
      const bool no_sync = device.is_cuda() && step > 0;
      SyncDebugScope mode(no_sync ? SyncDebugScope::Mode::kError : SyncDebugScope::Mode::kOff);
      opt.step();
    }
    ref_opt.step();
  }
  for (size_t i = 0; i < init.size(); ++i) {
    const torch::Tensor a = ours[i].detach().to(torch::kCPU, torch::kFloat32);
    const bool low = ours[i].scalar_type() == torch::kBFloat16;
    const torch::Tensor e =
        low ? ref[i].detach().to(torch::kBFloat16).to(torch::kFloat32) : ref[i].detach();
    if (!torch::allclose(a, e, low ? 2e-2 : 1e-5, low ? 2e-2 : 1e-6)) {
      problems.Add(absl::StrCat(what, " ", optim::implementation_name(impl), ": parameter ", i,
                                " (", c10::toString(ours[i].scalar_type()),
                                ") differs from torch::optim's on the CPU by up to ",
                                (a - e).abs().max().item<double>()));
    }
  }
}

Result CheckFusedOptimizers(c10::Device device) {
  Problems problems;
  for (const auto impl : {optim::Implementation::kFused, optim::Implementation::kForeach}) {
    CheckOneOptimizer<optim::AdamW, torch::optim::AdamW>(
        device, problems, "AdamW", torch::optim::AdamWOptions(1e-2).weight_decay(0.1), impl);
    CheckOneOptimizer<optim::Adam, torch::optim::Adam>(
        device, problems, "Adam amsgrad",
        torch::optim::AdamOptions(1e-2).weight_decay(0.05).amsgrad(true), impl);
    CheckOneOptimizer<optim::SGD, torch::optim::SGD>(
        device, problems, "SGD nesterov",
        torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(0.01), impl);
  }
  if (!problems.empty()) return Fail(problems.Joined());
  return Pass(absl::StrCat("fused and foreach Adam (amsgrad), AdamW, SGD (nesterov) on ",
                           device.str(),
                           device.is_cpu() ? ""
                                           : " (float32 and bfloat16 buckets; steps 2-4 under "
                                             "sync-debug mode error)",
                           " equal torch::optim's on the CPU over 4 steps"));
}

}  // namespace

std::vector<gpu_check::Check> OptimGpuChecks(c10::Device device) {
  return {{"fused_optimizers", [device] { return CheckFusedOptimizers(device); }}};
}

}  // namespace optim
