#include "optim/optim_gpu_check.h"

#include <cmath>
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

// Capturable mode on `device` against the ordinary mode of the same
// implementation (optimizers.h): a learning rate that changes every step
// (given exactly to ours, rounded to float32 for the ordinary one, which is
// the device lr's value), 6 steps; kFused with a found_inf that skips step
// 3 (NaN gradients; record_skipped_step after it, the ordinary optimizer
// does not see that step). kFused must match bit for bit (the same kernels,
// the lr read from the device), kForeach within rtol/atol 1e-5 (float32;
// 2e-2 for bfloat16: the bias corrections come from float32 device
// tensors). On CUDA, write_device_values() and the steps after the first
// two run under sync-debug mode error: nothing in them may make the host
// wait.
template <typename Ours, typename Options>
void CheckOneCapturable(c10::Device device, Problems& problems, const std::string& what,
                        const Options& options, optim::Implementation impl) {
  torch::manual_seed(37);
  const std::vector<std::vector<int64_t>> shapes = {{33, 7}, {129}, {4, 5, 6}};
  std::vector<torch::Tensor> ours, ref;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto dtype = (device.is_cuda() && i == 1) ? torch::kBFloat16 : torch::kFloat32;
    ours.push_back(torch::randn(shapes[i]).to(device, dtype).requires_grad_(true));
    ref.push_back(ours.back().detach().clone().requires_grad_(true));
  }
  Ours opt(ours, options, impl, /*maximize=*/false, /*capturable=*/true);
  Ours ref_opt(ref, options, impl);
  const bool fused = impl == optim::Implementation::kFused;
  torch::Tensor found_inf =
      torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat32).device(device));
  if (fused) opt.set_found_inf(found_inf);
  const double base = options.lr();
  for (int step = 0; step < 6; ++step) {
    const double lr = base * (0.4 + 0.6 * std::cos(0.5 * step)) / 3.0;
    const bool skipped = fused && step == 3;
    for (size_t i = 0; i < ours.size(); ++i) {
      torch::Tensor g = torch::randn(shapes[i]).to(device, ours[i].scalar_type());
      if (skipped) g.view(-1)[0] = std::nan("");
      ours[i].mutable_grad() = g;
      ref[i].mutable_grad() = g.clone();
    }
    opt.param_groups()[0].options().set_lr(lr);
    ref_opt.param_groups()[0].options().set_lr(static_cast<double>(static_cast<float>(lr)));
    if (fused) found_inf.fill_(skipped ? 1.0 : 0.0);
    {
      const bool no_sync = device.is_cuda() && step > 1;
      SyncDebugScope mode(no_sync ? SyncDebugScope::Mode::kError : SyncDebugScope::Mode::kOff);
      opt.write_device_values();
      opt.step();
      if (step > 1 && !opt.last_step_replayable()) {
        problems.Add(absl::StrCat(what, " ", optim::implementation_name(impl), ": step ", step,
                                  " after write_device_values() was not replayable"));
      }
      if (skipped) opt.record_skipped_step();
    }
    if (!skipped) ref_opt.step();
  }
  for (size_t i = 0; i < ours.size(); ++i) {
    const torch::Tensor a = ours[i].detach().to(torch::kCPU, torch::kFloat32);
    const torch::Tensor e = ref[i].detach().to(torch::kCPU, torch::kFloat32);
    const bool low = ours[i].scalar_type() == torch::kBFloat16;
    const double tol = fused ? 0 : (low ? 2e-2 : 1e-5);
    const bool same = fused ? torch::equal(a, e) : torch::allclose(a, e, tol, tol);
    if (!same) {
      problems.Add(absl::StrCat(
          what, " ", optim::implementation_name(impl), " capturable: parameter ", i, " (",
          c10::toString(ours[i].scalar_type()), ") differs from the ordinary mode's by up to ",
          (a - e).abs().max().item<double>(), fused ? " (expected bit for bit)" : ""));
    }
  }
}

Result CheckCapturableOptimizers(c10::Device device) {
  Problems problems;
  for (const auto impl : {optim::Implementation::kFused, optim::Implementation::kForeach}) {
    CheckOneCapturable<optim::AdamW>(device, problems, "AdamW",
                                     torch::optim::AdamWOptions(1e-2).weight_decay(0.1), impl);
    CheckOneCapturable<optim::Adam>(
        device, problems, "Adam amsgrad",
        torch::optim::AdamOptions(1e-2).weight_decay(0.05).amsgrad(true), impl);
    CheckOneCapturable<optim::SGD>(
        device, problems, "SGD nesterov",
        torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(0.01), impl);
  }
  if (!problems.empty()) return Fail(problems.Joined());
  return Pass(absl::StrCat(
      "capturable fused (bit for bit, a found_inf-skipped step included) and foreach Adam "
      "(amsgrad), AdamW, SGD (nesterov) on ",
      device.str(), " equal the ordinary mode over 6 steps of a changing learning rate",
      device.is_cpu() ? "" : " (write_device_values and steps 3-6 under sync-debug mode error)"));
}

}  // namespace

std::vector<gpu_check::Check> OptimGpuChecks(c10::Device device) {
  return {{"fused_optimizers", [device] { return CheckFusedOptimizers(device); }},
          {"capturable_optimizers", [device] { return CheckCapturableOptimizers(device); }}};
}

}  // namespace optim
