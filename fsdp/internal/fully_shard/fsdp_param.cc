#include "fsdp/internal/fully_shard/fsdp_param.h"

#include <ATen/Context.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/zeros.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <limits>
#include <utility>

namespace fsdp {
namespace internal {

void free_storage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == 0) return;
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
}

void alloc_storage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(t.numel()) * static_cast<size_t>(t.element_size());
  if (storage->nbytes() == nbytes) return;
  TORCH_INTERNAL_ASSERT(storage->nbytes() == 0, "fully_shard: storage holds ", storage->nbytes(),
                        " bytes, expected 0 or ", nbytes);
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

at::Tensor unallocated(c10::IntArrayRef sizes, const at::TensorOptions& options) {
  // An empty tensor's storage has the device's allocator and no memory; a
  // tensor of the full sizes over it is what free_storage leaves.
  return storage_view(at::empty({0}, options), 0, sizes);
}

FSDPParam::FSDPParam(std::vector<std::string> fqns, const at::Tensor& param,
                     const comm::ProcessGroup& group, const comm::ProcessGroup& post_forward_group,
                     std::optional<c10::ScalarType> param_dtype,
                     std::optional<c10::ScalarType> reduce_dtype, int64_t shard_dim,
                     bool offload_to_cpu, bool pin_memory, bool float8_all_gather)
    : fqns_(std::move(fqns)),
      orig_param_(c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr())),
      post_forward_group_(post_forward_group),
      device_(param.device()),
      shard_dim_(shard_dim),
      world_size_(group.size()),
      requires_grad_(param.requires_grad()),
      offload_to_cpu_(offload_to_cpu),
      pin_memory_(pin_memory),
      float8_all_gather_(float8_all_gather),
      orig_dtype_(param.scalar_type()) {
  const std::string& name = fqns_.front();
  TORCH_CHECK(param.dim() > 0, "fully_shard doesn't support scalar parameters. Change ", name,
              " to a 1D tensor with numel equal to 1.");
  TORCH_CHECK(param.is_contiguous(), "fully_shard: FSDP does not support non-contiguous ",
              "parameters yet: parameter '", name, "' has shape ", param.sizes(), " and stride ",
              param.strides());
  TORCH_INTERNAL_ASSERT(shard_dim_ >= 0 && shard_dim_ < param.dim());
  TORCH_INTERNAL_ASSERT(!float8_all_gather_ || (shard_dim_ == 0 && param.is_floating_point() &&
                                                !at::isFloat8Type(orig_dtype_)));
  const bool floating = at::isFloatingType(orig_dtype_);
  param_dtype_ = floating && param_dtype ? *param_dtype : orig_dtype_;
  reduce_dtype_ = floating && reduce_dtype ? *reduce_dtype : param_dtype_;
  global_shape_ = param.sizes().vec();
  const int64_t size = global_shape_[shard_dim_];
  chunk_ = (size + world_size_ - 1) / world_size_;
  TORCH_INTERNAL_ASSERT(shard_dim_ == 0 || chunk_ * world_size_ == size);
  shard_offset_ = std::min<int64_t>(size, group.rank() * chunk_);
  const int64_t local = std::min<int64_t>(chunk_, size - shard_offset_);
  local_shape_ = global_shape_;
  local_shape_[shard_dim_] = local;
  std::vector<int64_t> padded_shape = global_shape_;
  padded_shape[shard_dim_] = chunk_;
  padded_shard_numel_ = 1;
  for (int64_t s : padded_shape) padded_shard_numel_ *= s;

  at::NoGradGuard no_grad;
  if (param.is_meta()) {
    // Deferred initialisation: a meta shard of the padded shape (no memory;
    // nothing to copy), allocated by materialize().
    padded_shard_ = at::empty({padded_shard_numel_}, param.options().requires_grad(false));
  } else {
    padded_shard_ = at::zeros({padded_shard_numel_}, param.options().requires_grad(false));
    if (local > 0) {
      padded_shard_.view(padded_shape)
          .narrow(shard_dim_, 0, local)
          .copy_(param.detach().narrow(shard_dim_, shard_offset_, local));
    }
    // On dim 0 the real rows are the padded shard's front; on another dim
    // there is no padding. Either way the shard is a contiguous prefix.
    if (offload_to_cpu_) {
      padded_shard_ = padded_shard_.to(at::kCPU);
      // Pinned memory needs a CUDA runtime with a device (a CPU-only process
      // keeps ordinary memory).
      if (pin_memory_ && at::globalContext().hasCUDA()) padded_shard_ = padded_shard_.pin_memory();
    }
  }
  sharded_param_ = storage_view(padded_shard_, 0, local_shape_);
  sharded_param_.set_requires_grad(requires_grad_);
  init_unsharded(param.options());
}

c10::ScalarType FSDPParam::gather_dtype() const {
  return float8_all_gather_ ? at::kFloat8_e4m3fn : param_dtype_;
}

void FSDPParam::init_unsharded(const at::TensorOptions& options) {
  const at::TensorOptions gathered = options.dtype(gather_dtype()).requires_grad(false);
  all_gather_output_ = unallocated({padded_shard_numel_ * world_size_}, gathered);
  if (float8_all_gather_) {
    unsharded_float8_ = storage_view(all_gather_output_, 0, global_shape_);
    // The stand-in: one NaN of the parameter dtype seen through zero
    // strides, a plain tensor (not an autograd view), so it can be a leaf.
    const at::TensorOptions dtype = options.dtype(param_dtype_).requires_grad(false);
    const at::Tensor nan = at::full({1}, std::numeric_limits<double>::quiet_NaN(), dtype);
    unsharded_param_ = at::empty({0}, nan.options());
    unsharded_param_.set_(nan.storage(), 0, global_shape_,
                          std::vector<int64_t>(global_shape_.size(), 0));
  } else if (shard_dim_ == 0) {
    unsharded_param_ = storage_view(all_gather_output_, 0, global_shape_);
  } else {
    unsharded_buffer_ = unallocated({c10::multiply_integers(global_shape_)}, gathered);
    unsharded_param_ = storage_view(unsharded_buffer_, 0, global_shape_);
  }
  unsharded_param_.set_requires_grad(requires_grad_);
}

void FSDPParam::materialize(const c10::Device& device, const at::Tensor& buffer, int64_t offset) {
  TORCH_INTERNAL_ASSERT(is_meta() && state_ == ShardedState::kSharded &&
                        device.type() != c10::DeviceType::Meta);
  at::NoGradGuard no_grad;
  const c10::Device shard_device = offload_to_cpu_ ? c10::Device(c10::kCPU) : device;
  if (buffer.defined()) {
    TORCH_INTERNAL_ASSERT(buffer.scalar_type() == orig_dtype_ && buffer.device() == shard_device &&
                          buffer.dim() == 1 && offset + padded_shard_numel_ <= buffer.numel());
    padded_shard_ = storage_view(buffer, offset, {padded_shard_numel_});
  } else {
    at::TensorOptions options = at::TensorOptions().dtype(orig_dtype_).device(shard_device);
    // Pinned as the constructor pins an offloaded shard.
    if (offload_to_cpu_ && pin_memory_ && at::globalContext().hasCUDA()) {
      options = options.pinned_memory(true);
    }
    padded_shard_ = at::empty({padded_shard_numel_}, options);
  }
  // The padding (dim 0 only: the real rows are the front) is zero, as the
  // constructor's; the rows are left for the caller to fill.
  const int64_t local_numel = c10::multiply_integers(local_shape_);
  if (local_numel < padded_shard_numel_) {
    padded_shard_.narrow(0, local_numel, padded_shard_numel_ - local_numel).zero_();
  }
  device_ = device;
  sharded_param_ = storage_view(padded_shard_, 0, local_shape_);
  sharded_param_.set_requires_grad(requires_grad_);
  init_unsharded(at::TensorOptions().dtype(orig_dtype_).device(device));
}

void FSDPParam::place_padded_shard(const at::Tensor& buffer, int64_t offset) {
  TORCH_INTERNAL_ASSERT(buffer.scalar_type() == padded_shard_.scalar_type() &&
                        buffer.device() == padded_shard_.device() && buffer.dim() == 1 &&
                        offset + padded_shard_numel_ <= buffer.numel());
  at::NoGradGuard no_grad;
  at::Tensor placed = storage_view(buffer, offset, {padded_shard_numel_});
  placed.copy_(padded_shard_);
  padded_shard_ = std::move(placed);
  sharded_param_ = storage_view(padded_shard_, 0, local_shape_);
  sharded_param_.set_requires_grad(requires_grad_);
}

at::Tensor FSDPParam::local_amax() const {
  TORCH_INTERNAL_ASSERT(float8_all_gather_);
  at::NoGradGuard no_grad;
  // max(|x|), one reduction without a temporary (exact: float32 holds
  // every float32, bf16 and float16 value); the padding's zeros change
  // nothing.
  return at::linalg_vector_norm(padded_shard_, std::numeric_limits<double>::infinity(),
                                std::nullopt, false, at::kFloat)
      .to(device_);
}

void FSDPParam::cast_to_float8(const at::Tensor& global_amax) {
  TORCH_INTERNAL_ASSERT(float8_all_gather_ && state_ == ShardedState::kSharded);
  // Offloaded: to the device first, in the shard's own dtype (torchao casts
  // the shard as it is, not a param_dtype copy of it).
  const at::Tensor source =
      padded_shard_.device() == device_
          ? padded_shard_
          : padded_shard_.to(device_, /*non_blocking=*/padded_shard_.is_pinned());
  // As [padded dim 0, the rest]: the fused cast's [rows, cols] on CUDA.
  kernels::Float8Tensor cast =
      kernels::CastToFloat8Fused(source.view({padded_dim0(), padded_shard_numel_ / padded_dim0()}),
                                 at::kFloat8_e4m3fn, global_amax);
  float8_input_ = cast.data.view({padded_shard_numel_});
  float8_scale_ = std::move(cast.scale);
  float8_inv_scale_ = std::move(cast.inv_scale);
}

at::Tensor FSDPParam::all_gather_input() const {
  if (float8_all_gather_ && state_ == ShardedState::kSharded) {
    TORCH_INTERNAL_ASSERT(float8_input_.defined(), "fully_shard: ", fqns_.front(),
                          " was not cast to float8 before its all-gather");
    return float8_input_;
  }
  const at::Tensor& source =
      state_ == ShardedState::kShardedPostForward ? post_forward_shard_ : padded_shard_;
  if (source.device() != device_) {
    // Offloaded: host to device (asynchronous from pinned memory).
    return source.to(device_, gather_dtype(), /*non_blocking=*/source.is_pinned());
  }
  return source.scalar_type() == gather_dtype() ? source : source.to(gather_dtype());
}

void FSDPParam::alloc_all_gather_output() { alloc_storage(all_gather_output_); }

void FSDPParam::to_unsharded() {
  post_forward_shard_ = at::Tensor();
  float8_input_ = at::Tensor();  // gathered (the all-gather was waited for)
  if (shard_dim_ != 0) {
    // all_gather_output_ is [W * global dim 0, ...] (the shards stacked on
    // dim 0): cat its W chunks on shard_dim_ into the unsharded buffer,
    // through a tensor of its own so the leaf's version is not bumped.
    at::NoGradGuard no_grad;
    alloc_storage(unsharded_buffer_);
    std::vector<int64_t> stacked = local_shape_;
    stacked[0] *= world_size_;
    at::Tensor out = storage_view(unsharded_buffer_, 0, global_shape_);
    at::cat_out(out, all_gather_output_.view(stacked).chunk(world_size_, 0), shard_dim_);
  }
  state_ = ShardedState::kUnsharded;
}

void FSDPParam::to_sharded() {
  if (shard_dim_ != 0) free_storage(unsharded_buffer_);
  free_storage(all_gather_output_);
  post_forward_shard_ = at::Tensor();
  state_ = ShardedState::kSharded;
}

void FSDPParam::to_sharded_post_forward() {
  TORCH_INTERNAL_ASSERT(state_ == ShardedState::kUnsharded && post_forward_group_.is_member());
  const int64_t numel = all_gather_output_.numel();
  const int64_t n = post_forward_group_.size();
  // The gathered buffer is W padded shards; n divides W, so each of the n
  // post-forward shards is W/n of them.
  const int64_t part = numel / n;
  at::NoGradGuard no_grad;
  post_forward_shard_ =
      all_gather_output_.narrow(0, part * post_forward_group_.rank(), part).clone();
  if (shard_dim_ != 0) free_storage(unsharded_buffer_);
  free_storage(all_gather_output_);
  state_ = ShardedState::kShardedPostForward;
}

std::optional<kernels::Float8Tensor> FSDPParam::unsharded_float8() const {
  if (!float8_all_gather_ || state_ != ShardedState::kUnsharded) return std::nullopt;
  return kernels::Float8Tensor{unsharded_float8_, float8_scale_, float8_inv_scale_, param_dtype_};
}

const at::Tensor& FSDPParam::module_tensor() const {
  return state_ == ShardedState::kUnsharded ? unsharded_param_ : sharded_param_;
}

at::Tensor FSDPParam::unsharded_grad() const { return unsharded_param_.grad(); }

void FSDPParam::clear_unsharded_grad() { unsharded_param_.mutable_grad().reset(); }

void FSDPParam::accumulate_sharded_grad(const at::Tensor& reduce_output, int64_t offset) {
  at::NoGradGuard no_grad;
  // A tensor of its own over the reduce output's memory (not a dispatched
  // narrow + view per parameter; and not an autograd view, so
  // zero_grad(set_to_none=false) can detach_ it).
  at::Tensor local = storage_view(reduce_output, offset, local_shape_);
  // To the shard's dtype and device (the CPU when offloaded: blocking).
  if (local.device() != sharded_param_.device() || local.scalar_type() != orig_dtype_) {
    local = local.to(sharded_param_.device(), orig_dtype_);
  }
  at::Tensor& current = sharded_param_.mutable_grad();
  if (current.defined()) {
    current.add_(local);
  } else {
    current = std::move(local);
  }
}

}  // namespace internal
}  // namespace fsdp
