// FullyShardedDataParallel::clip_grad_norm_: the norm of the gradients of
// all ranks' shards and the unmanaged parameters, one all-reduce over the
// shard group, then the gradients scaled in place.
#include <ATen/ATen.h>

#include <cmath>

#include "comm/collectives.h"
#include "fsdp/internal/runtime_state.h"

namespace fsdp {
namespace internal {

at::Tensor Runtime::clip_grad_norm(double max_norm, double norm_type) {
  TORCH_CHECK(state_ == TrainingState::kIdle, "clip_grad_norm_: called during forward or ",
              "backward: expected it after backward, before optimizer.step()");
  TORCH_CHECK(norm_type > 0 || std::isinf(norm_type), "clip_grad_norm_: norm_type=", norm_type,
              ": expected p > 0 or inf");
  TORCH_CHECK(max_norm >= 0, "clip_grad_norm_: max_norm=", max_norm, ": expected >= 0");
  finish_reductions();
  const bool inf = std::isinf(norm_type);
  at::NoGradGuard no_grad;
  auto combine = [&](at::Tensor& acc, const at::Tensor& grad) {
    at::Tensor g = grad.detach().to(at::kDouble);
    if (inf) {
      acc = at::maximum(acc, g.abs().max());
    } else {
      acc = acc + at::linalg_vector_norm(g, norm_type).pow(norm_type);
    }
  };
  at::Tensor sharded = at::zeros({1}, at::kDouble);
  at::Tensor local = at::zeros({1}, at::kDouble);
  std::vector<at::Tensor> grads;
  for (auto& unit : units_) {
    if (!unit->handle) continue;
    const at::Tensor& grad = unit->handle->flat_param().grad();
    if (!grad.defined()) continue;
    grads.push_back(grad);
    if (grad.numel() == 0) continue;
    combine(uses_sharding(options_.sharding_strategy) ? sharded : local, grad);
  }
  for (const auto& item : unmanaged_params_) {
    const at::Tensor& grad = item.second.grad();
    if (!grad.defined()) continue;
    grads.push_back(grad);
    if (grad.numel() > 0) combine(local, grad);
  }
  // Shards are disjoint within the shard group and identical across
  // replicas, so only the shard group is reduced over.
  comm::all_reduce(shard_group_, sharded, inf ? comm::ReduceOp::kMax : comm::ReduceOp::kSum).wait();
  at::Tensor total = inf ? at::maximum(sharded, local) : (sharded + local).pow(1.0 / norm_type);
  const double norm = total.item<double>();
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (auto& g : grads) g.mul_(coef);
  }
  return total.to(at::kFloat).reshape({});
}

}  // namespace internal
}  // namespace fsdp
