#include "fsdp/internal/grad_norm.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/clamp_max.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {
namespace internal {
namespace {

// Non-empty gradients grouped so that each _foreach call sees one device
// and one dtype (its fast path).
std::map<std::pair<std::string, int>, std::vector<at::Tensor>> ByDeviceAndDtype(
    const std::vector<at::Tensor>& grads) {
  std::map<std::pair<std::string, int>, std::vector<at::Tensor>> groups;
  for (const at::Tensor& g : grads) {
    if (!g.defined() || g.numel() == 0) continue;
    groups[{g.device().str(), static_cast<int>(g.scalar_type())}].push_back(g.detach());
  }
  return groups;
}

}  // namespace

at::Tensor LocalGradNormPow(const std::vector<at::Tensor>& grads, double norm_type,
                            c10::Device device) {
  at::NoGradGuard no_grad;
  const bool inf = std::isinf(norm_type);
  at::Tensor acc = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
  for (auto& [key, group] : ByDeviceAndDtype(grads)) {
    const at::Tensor norms = at::stack(at::_foreach_norm(group, norm_type)).to(device, at::kDouble);
    acc = inf ? at::maximum(acc, norms.max()) : acc + norms.pow(norm_type).sum();
  }
  return acc;
}

void ClipGradsWithNorm(const std::vector<at::Tensor>& grads, double max_norm,
                       const at::Tensor& total) {
  at::NoGradGuard no_grad;
  const at::Tensor denominator = total.to(at::kDouble).reshape({}) + 1e-6;
  const at::Tensor coef = at::clamp_max(at::full_like(denominator, max_norm) / denominator, 1.0);
  for (auto& [key, group] : ByDeviceAndDtype(grads)) {
    // The coefficient in the gradients' compute precision: float32 for
    // float32, bfloat16 and float16 gradients (what a double scalar became
    // in _foreach_mul_'s float arithmetic before), float64 for float64.
    const at::Tensor& first = group.front();
    const c10::ScalarType dtype = first.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    at::_foreach_mul_(group, coef.to(first.device(), dtype));
  }
}

}  // namespace internal
}  // namespace fsdp
