// summon_full_params (PyTorch's _unshard_param_utils.py): every unit
// gathered in full precision, optionally with its gradients, and resharded
// (with writeback) when the outermost guard ends.
#include <ATen/ATen.h>

#include <exception>

#include "comm/collectives.h"
#include "fsdp/internal/runtime_state.h"

namespace fsdp {
namespace internal {

void Runtime::summon(const SummonOptions& options) {
  TORCH_CHECK(state_ == TrainingState::kIdle, "summon_full_params: called during ",
              state_ == TrainingState::kForward ? "forward" : "backward",
              ": expected it outside forward and backward");
  TORCH_CHECK(!(options.writeback && options.rank0_only),
              "summon_full_params: "
              "writeback=True and rank0_only=True is not supported, as model parameter "
              "shapes will be different across ranks, and writing to them can lead to "
              "inconsistencies across ranks when the context is exited.");
  TORCH_CHECK(!options.with_grads || options_.use_orig_params,
              "summon_full_params: "
              "with_grads=True requires use_orig_params=True");
  if (summon_depth_ == 0) finish_reductions();
  if (summon_depth_++ > 0) return;  // nested: already gathered
  const bool keep = !options.rank0_only || shard_group_.global_rank() == 0;
  try {
    summon_grad_units_.clear();
    for (int i : preorder()) {
      auto& handle = units_[i]->handle;
      if (!handle) continue;
      UnshardOptions unshard_options;
      unshard_options.full_precision = true;
      handle->unshard(/*async=*/false, unshard_options);
      TORCH_CHECK(!options.offload_to_cpu || handle->unsharded_flat_param().device().is_cpu(),
                  "summon_full_params: offload_to_cpu with a non-CPU compute device is "
                  "not implemented yet");
      handle->use_unsharded_views();
      if (options.with_grads) {
        at::Tensor grad = handle->flat_param().grad();
        if (grad.defined()) {
          at::NoGradGuard no_grad;
          at::Tensor full = grad;
          if (uses_sharding(options_.sharding_strategy)) {
            full = at::empty({handle->padded_numel()}, grad.options());
            comm::all_gather_into_tensor(shard_group_, full, grad.contiguous()).wait();
          }
          if (keep) {
            const auto params = handle->module()->named_parameters();
            for (const auto& info : handle->param_infos()) {
              if (!info.requires_grad) continue;
              at::Tensor g = full.narrow(0, info.offset, info.numel).view(info.shape);
              params[info.fqn].mutable_grad() = g;
            }
            summon_grad_units_.push_back(i);
          }
        }
      }
      if (!keep) handle->reshard(/*writeback=*/false);
    }
  } catch (...) {
    summon_depth_ = 0;
    for (auto& unit : units_) {
      if (unit->handle) unit->handle->reshard(false);
    }
    throw;
  }
}

void Runtime::unsummon(const SummonOptions& options) noexcept {
  if (--summon_depth_ > 0) return;
  for (int i : summon_grad_units_) {
    auto& handle = units_[i]->handle;
    const auto params = handle->module()->named_parameters();
    for (const auto& info : handle->param_infos()) {
      if (const at::Tensor* p = params.find(info.fqn)) p->mutable_grad().reset();
    }
  }
  summon_grad_units_.clear();
  for (auto& unit : units_) {
    if (!unit->handle) continue;
    try {
      unit->handle->reshard(options.writeback && !options.rank0_only);
    } catch (const std::exception&) {
      // A destructor must not throw; reshard only fails on a broken gather,
      // which the next collective reports.
    }
  }
}

}  // namespace internal
}  // namespace fsdp
