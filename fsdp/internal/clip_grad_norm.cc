// FullyShardedDataParallel::clip_grad_norm_: the norm of the gradients of
// all ranks' shards and the unmanaged parameters, one all-reduce over the
// shard group, then the gradients scaled in place.
#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <vector>

#include "comm/collectives.h"
#include "fsdp/internal/grad_norm.h"
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
  std::vector<at::Tensor> sharded_grads, local_grads;
  std::optional<c10::Device> device;
  for (auto& unit : units_) {
    if (!unit->handle) continue;
    const at::Tensor& flat = unit->handle->flat_param();
    if (!device) device = flat.device();
    const at::Tensor& grad = flat.grad();
    if (!grad.defined()) continue;
    (uses_sharding(options_.sharding_strategy) ? sharded_grads : local_grads).push_back(grad);
  }
  for (const auto& item : unmanaged_params_) {
    if (!device) device = item.second.device();
    const at::Tensor& grad = item.second.grad();
    if (grad.defined()) local_grads.push_back(grad);
  }
  // The accumulators live where the shards are, so the all-reduce runs on
  // the backend of the compute device (NCCL for CUDA shards).
  const c10::Device where = device.value_or(c10::Device(c10::kCPU));
  at::Tensor sharded = LocalGradNormPow(sharded_grads, norm_type, where);
  const at::Tensor local = LocalGradNormPow(local_grads, norm_type, where);
  // Shards are disjoint within the shard group and identical across
  // replicas, so only the shard group is reduced over.
  // Ordered on the stream, not the host (NCCL; Gloo waits): nothing here
  // reads the device, so --cuda-graphs can capture the clipping.
  comm::all_reduce(shard_group_, sharded, inf ? comm::ReduceOp::kMax : comm::ReduceOp::kSum)
      .wait_on_stream();
  at::Tensor total = inf ? at::maximum(sharded, local) : (sharded + local).pow(1.0 / norm_type);
  ClipGradsWithNorm(sharded_grads, max_norm, total);
  ClipGradsWithNorm(local_grads, max_norm, total);
  return total.to(at::kFloat).reshape({});
}

}  // namespace internal
}  // namespace fsdp
