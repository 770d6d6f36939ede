#include "fsdp/internal/fully_shard/fsdp_param_group.h"

#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <c10/core/StreamGuard.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <utility>

#include "comm/collectives.h"
#include "functorch/module/named_member_accessor.h"

namespace fsdp {
namespace internal {

FSDPParamGroup::FSDPParamGroup(const std::shared_ptr<torch::nn::Module>& module,
                               std::vector<std::unique_ptr<FSDPParam>> params,
                               comm::ProcessGroup group, comm::ProcessGroup replicate_group,
                               comm::ProcessGroup post_forward_group, bool reshard_after_forward)
    : module_(module),
      params_(std::move(params)),
      group_(std::move(group)),
      replicate_group_(std::move(replicate_group)),
      post_forward_group_(std::move(post_forward_group)),
      reshard_after_forward_(reshard_after_forward) {
  place_shards_back_to_back();
  update_module_tensors();
}

void FSDPParamGroup::place_shards_back_to_back() {
  // Only when every padded shard is already what the all-gather sends: one
  // dtype, gathered in it, on the compute device (not offloaded).
  const at::Tensor& first = params_.front()->padded_shard();
  if (first.is_meta()) return;  // materialize() places them
  int64_t total = 0;
  for (const auto& p : params_) {
    const at::Tensor& shard = p->padded_shard();
    if (shard.scalar_type() != first.scalar_type() || p->gather_dtype() != shard.scalar_type() ||
        shard.device() != p->device() || shard.device() != first.device()) {
      return;
    }
    total += p->padded_shard_numel();
  }
  at::Tensor buffer = at::empty({total}, first.options());
  int64_t offset = 0;
  for (const auto& p : params_) {
    p->place_padded_shard(buffer, offset);
    offset += p->padded_shard_numel();
  }
  shard_buffer_ = std::move(buffer);
}

void FSDPParamGroup::materialize(const c10::Device& device) {
  TORCH_INTERNAL_ASSERT(is_meta() && state() == ShardedState::kSharded && !pending_);
  // The shards share one buffer under place_shards_back_to_back's rule,
  // with the devices they are about to have: one dtype, gathered in it, the
  // shard on the compute device (not offloaded elsewhere). Allocated once
  // here instead of shard by shard and then copied.
  const FSDPParam& first = *params_.front();
  const auto shard_device = [&](const FSDPParam& p) {
    return p.offload_to_cpu() ? c10::Device(c10::kCPU) : device;
  };
  bool share = true;
  int64_t total = 0;
  for (const auto& p : params_) {
    share = share && p->orig_dtype() == first.orig_dtype() &&
            p->gather_dtype() == p->orig_dtype() && shard_device(*p) == device;
    total += p->padded_shard_numel();
  }
  at::Tensor buffer;
  if (share) {
    at::TensorOptions options = at::TensorOptions().dtype(first.orig_dtype()).device(device);
    if (first.offload_to_cpu() && first.pin_memory() && at::globalContext().hasCUDA()) {
      options = options.pinned_memory(true);
    }
    buffer = at::empty({total}, options);
  }
  int64_t offset = 0;
  for (const auto& p : params_) {
    p->materialize(device, buffer, offset);
    offset += p->padded_shard_numel();
  }
  shard_buffer_ = std::move(buffer);
  update_module_tensors();
}

void FSDPParamGroup::check_materialized(const std::string& unit) const {
  if (!is_meta()) return;
  std::string names;
  for (const auto& p : params_) names += (names.empty() ? "" : ", ") + p->fqns().front();
  TORCH_CHECK(false, "fully_shard(", unit,
              "): FSDP parameters should be materialized from meta device before training, but "
              "the following were still on meta device: [",
              names,
              "]: call fsdp::to_empty(root, device) to allocate the shards, then fill them "
              "(state_dict::LoadFullyShardStateDict / LoadFullyShardFrom, or "
              "fsdp::init_sharded_states)");
}

std::vector<FSDPParam*> FSDPParamGroup::raw_params() const {
  std::vector<FSDPParam*> out;
  out.reserve(params_.size());
  for (const auto& p : params_) out.push_back(p.get());
  return out;
}

void FSDPParamGroup::update_module_tensors() {
  std::shared_ptr<torch::nn::Module> module = module_.lock();
  TORCH_CHECK(module != nullptr, "fully_shard: the module was destroyed");
  std::vector<std::string> names;
  std::vector<at::Tensor> values;
  for (const auto& p : params_) {
    for (const auto& name : p->fqns()) {
      names.push_back(name);
      values.push_back(p->module_tensor());
    }
  }
  functorch::NamedMemberAccessor accessor(module);
  accessor.set_tensors(names, std::move(values));
}

void FSDPParamGroup::unshard(bool async) {
  if (is_meta()) {
    std::shared_ptr<torch::nn::Module> module = module_.lock();
    check_materialized(module ? module->name() : std::string("destroyed module"));
  }
  if (pending_ || state() == ShardedState::kUnsharded) {
    if (!async) wait_for_unshard();
    return;
  }
  pending_group_ = state() == ShardedState::kShardedPostForward ? post_forward_group_ : group_;
  if (gathers_on_stream(pending_group_)) {
    FSDPCommContext& ctx = *comm_ctx_;
    const c10::Stream unshard_stream = ctx.streams->unshard;
    if (ctx.last_all_gather) {
      // Its buffers go back to the unshard stream's pool now: what that
      // stream allocates next is queued after their copy-out.
      ctx.last_all_gather->copied_out.block(unshard_stream);
      ctx.last_all_gather.reset();
    }
    // The shards as the compute stream left them (the optimizer's step).
    wait_stream(unshard_stream, current_stream(device()));
    c10::StreamGuard on_unshard_stream(unshard_stream);
    cast_float8_inputs(/*on_stream=*/true);
    pending_ = foreach_all_gather(raw_params(), pending_group_, shard_buffer_);
  } else {
    cast_float8_inputs(/*on_stream=*/false);
    pending_ = foreach_all_gather(raw_params(), pending_group_, shard_buffer_);
  }
  if (!async) wait_for_unshard();
}

void FSDPParamGroup::cast_float8_inputs(bool on_stream) {
  // Post-forward shards are float8 bytes already, with their scale.
  if (state() != ShardedState::kSharded) return;
  std::vector<FSDPParam*> float8;
  std::vector<at::Tensor> amaxes;
  for (const auto& p : params_) {
    if (!p->float8_all_gather()) continue;
    float8.push_back(p.get());
    amaxes.push_back(p->local_amax());
  }
  if (float8.empty()) return;
  at::NoGradGuard no_grad;
  // One all-reduce for all of them (torchao's precompute_float8_dynamic_
  // scale_for_fsdp does the same for the whole model after the step).
  at::Tensor amax = at::stack(amaxes);
  if (group_.size() > 1) {
    comm::Work work = comm::all_reduce(group_, amax, comm::ReduceOp::kMax);
    if (on_stream) {
      work.wait_on_stream();
    } else {
      work.wait();
    }
  }
  for (size_t i = 0; i < float8.size(); ++i) float8[i]->cast_to_float8(amax[i]);
}

bool FSDPParamGroup::gathers_on_stream(const comm::ProcessGroup& group) const {
  return comm_ctx_->streams.has_value() && group.size() > 1;
}

bool FSDPParamGroup::reduces_on_stream() const {
  return comm_ctx_->streams.has_value() &&
         (group_.size() > 1 || (replicate_group_.is_member() && replicate_group_.size() > 1));
}

void FSDPParamGroup::wait_for_unshard() {
  if (!pending_) return;
  AllGatherResult result = std::move(*pending_);
  pending_.reset();
  if (gathers_on_stream(pending_group_)) {
    // The compute stream waits for the collective (the host does not) and
    // copies out; the buffers stay allocated until the next all-gather's
    // stream has waited for that copy-out (PyTorch's AllGatherState).
    result.work.wait_on_stream();
    foreach_all_gather_copy_out(result, raw_params(), pending_group_);
    FSDPCommContext::CopiedOut copied{std::move(result), c10::Event(device().type())};
    copied.copied_out.record(current_stream(device()));
    comm_ctx_->last_all_gather = std::move(copied);
  } else {
    result.work.wait();
    foreach_all_gather_copy_out(result, raw_params(), pending_group_);
  }
  for (const auto& p : params_) p->to_unsharded();
  update_module_tensors();
}

void FSDPParamGroup::reshard() {
  wait_for_unshard();  // an all-gather in flight must land before freeing
  if (state() == ShardedState::kSharded) return;
  for (const auto& p : params_) p->to_sharded();
  update_module_tensors();
}

void FSDPParamGroup::post_forward() {
  if (state() != ShardedState::kUnsharded) return;
  if (!reshard_after_forward_ && at::GradMode::is_enabled()) return;
  if (post_forward_group_.is_member() && at::GradMode::is_enabled()) {
    for (const auto& p : params_) p->to_sharded_post_forward();
    update_module_tensors();
    return;
  }
  reshard();
}

FSDPParamGroup::~FSDPParamGroup() {
  if (!pending_reduce_) return;
  try {
    pending_reduce_->work.wait();
  } catch (const std::exception&) {
    // A destructor waits the operation out and drops its error.
  }
}

void FSDPParamGroup::post_backward() {
  if (requires_gradient_sync_) {
    std::vector<FSDPParam*> with_grad;
    std::vector<at::Tensor> grads;
    for (const auto& p : params_) {
      at::Tensor grad = p->unsharded_grad();
      if (!p->requires_grad() || !grad.defined()) continue;
      with_grad.push_back(p.get());
      grads.push_back(grad);
    }
    if (!with_grad.empty()) {
      // The previous reduction (a backward that was not the last) lands in
      // .grad first.
      finish_gradient_reduction();
      pending_reduce_ = foreach_reduce_start(
          with_grad, grads, group_, replicate_group_,
          ReplicaReduction{requires_all_reduce_, &partial_reduce_output_},
          reduces_on_stream() ? std::optional<c10::Stream>(comm_ctx_->streams->reduce)
                              : std::nullopt);
      for (FSDPParam* p : with_grad) p->clear_unsharded_grad();
    }
  }
  if (reshard_after_backward_) reshard();
}

void FSDPParamGroup::wait_for_reduce_scatter() {
  if (pending_reduce_) foreach_reduce_wait(*pending_reduce_);
}

void FSDPParamGroup::finish_gradient_reduction() {
  if (!pending_reduce_) return;
  PendingReduce pending = std::move(*pending_reduce_);
  pending_reduce_.reset();
  foreach_reduce_finish(pending);
}

}  // namespace internal
}  // namespace fsdp
