#include "fsdp/flat_param.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/StreamGuard.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <deque>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "comm/collectives.h"
#include "fsdp/internal/comm_streams.h"
#include "fsdp/internal/storage_view.h"
#include "functorch/module/named_member_accessor.h"

namespace fsdp {
namespace {

int64_t storage_nbytes(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return 0;
  return static_cast<int64_t>(t.storage().unsafeGetStorageImpl()->nbytes());
}

// Freed unsharded storage, kept for the next unshard of the same byte size
// on the same device (FSDP units are mostly alike: transformer blocks), as
// CUDA's caching allocator does for PyTorch. Without it every unshard of a
// large unit maps fresh pages from the OS and pays a page fault per page on
// first touch -- on the CPU allocator that cost rivals the all-gather itself.
// Bounded to kMaxCachedBlocks blocks, oldest evicted, so what is kept is at
// most about one more unit's worth while the next unit is being gathered.
class FreedStorageCache {
 public:
  static constexpr size_t kMaxCachedBlocks = 2;

  static FreedStorageCache& get() {
    // Leaked on purpose: DataPtr deleters must not run during static
    // destruction, after the allocator may be gone.
    static auto* cache = new FreedStorageCache();
    return *cache;
  }

  at::DataPtr take(size_t nbytes, c10::Device device) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = blocks_.begin(); it != blocks_.end(); ++it) {
      if (it->nbytes == nbytes && it->data.device() == device) {
        at::DataPtr data = std::move(it->data);
        cached_bytes_ -= nbytes;
        blocks_.erase(it);
        return data;
      }
    }
    return at::DataPtr(nullptr, device);
  }

  void give(at::DataPtr data, size_t nbytes) {
    std::deque<Block> evicted;  // freed outside the lock
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks_.push_back(Block{std::move(data), nbytes});
      cached_bytes_ += nbytes;
      while (blocks_.size() > kMaxCachedBlocks) {
        cached_bytes_ -= blocks_.front().nbytes;
        evicted.push_back(std::move(blocks_.front()));
        blocks_.pop_front();
      }
    }
  }

  int64_t cached_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(cached_bytes_);
  }

  void release() {
    std::deque<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      evicted.swap(blocks_);
      cached_bytes_ = 0;
    }
  }

 private:
  struct Block {
    at::DataPtr data;
    size_t nbytes;
  };
  std::mutex mu_;
  std::deque<Block> blocks_;
  size_t cached_bytes_ = 0;
};

// Releases the memory behind `t` while keeping its StorageImpl: every tensor
// sharing the StorageImpl (autograd views, saved tensors, the data alias)
// stays a valid object and sees the memory again after allocate_storage().
void free_storage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = storage->nbytes();
  if (nbytes == 0) return;
  if (!t.device().is_cpu()) {
    // The device's caching allocator keeps freed blocks itself, per stream.
    // The memory was allocated on a side stream but last read on the
    // current (compute) stream: record that, so the allocator does not hand
    // the block out again before the compute stream is done with it.
    t.record_stream(internal::current_stream(t.device()));
    storage->set_data_ptr(at::DataPtr(nullptr, t.device()));  // freed here
    storage->set_nbytes(0);
    return;
  }
  at::DataPtr data = storage->set_data_ptr(at::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
  FreedStorageCache::get().give(std::move(data), nbytes);
}

// Re-materialises the storage of `t` for its full size (contents
// uninitialised): a cached block of the same size, else the allocator the
// storage was created with.
void allocate_storage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(t.numel()) * static_cast<size_t>(t.element_size());
  if (storage->nbytes() == nbytes) return;
  TORCH_INTERNAL_ASSERT(storage->nbytes() == 0, "FlatParamHandle: storage holds ",
                        storage->nbytes(), " bytes, expected 0 or ", nbytes);
  at::DataPtr data = FreedStorageCache::get().take(nbytes, t.device());
  if (data.get() == nullptr) data = storage->allocator()->allocate(nbytes);
  storage->set_data_ptr_noswap(std::move(data));
  storage->set_nbytes(nbytes);
}

// A 1-D tensor over elements [offset, offset + numel) of `t`'s storage that
// is NOT an autograd view of `t`. Used for what optimizers hold (original
// params' data and grads): an autograd view there would make
// Optimizer::zero_grad()'s in-place detach_ fail.
at::Tensor storage_slice(const at::Tensor& t, int64_t offset, int64_t numel) {
  return internal::storage_view(t, offset, {numel});
}

std::string join_names(const FlatParamInfo& info) {
  std::string out = "'" + info.fqn + "'";
  for (const auto& alias : info.alias_fqns) out += ", '" + alias + "'";
  return out;
}

class LambdaPostHook : public torch::autograd::FunctionPostHook {
 public:
  explicit LambdaPostHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace

at::Tensor flatten_tensors(const std::vector<at::Tensor>& tensors, int64_t pad_to_multiple,
                           std::vector<FlatParamInfo>* infos) {
  TORCH_CHECK(!tensors.empty(), "flatten_tensors: `tensors` is empty: expected ",
              "at least one tensor");
  TORCH_CHECK(pad_to_multiple >= 1, "flatten_tensors: pad_to_multiple=", pad_to_multiple,
              ": expected >= 1");
  const auto dtype = tensors[0].scalar_type();
  const auto device = tensors[0].device();
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    TORCH_CHECK(t.defined(), "flatten_tensors: tensor ", i, " is undefined");
    TORCH_CHECK(t.scalar_type() == dtype && t.device() == device, "flatten_tensors: tensor ", i,
                " is ", t.scalar_type(), " on ", t.device(), ": expected ", dtype, " on ", device,
                " like tensor 0 (must flatten tensors with uniform dtype)");
    total += t.numel();
  }
  const int64_t padded = (total + pad_to_multiple - 1) / pad_to_multiple * pad_to_multiple;
  at::NoGradGuard no_grad;
  at::Tensor flat = at::empty({padded}, tensors[0].options());
  if (infos != nullptr) infos->clear();
  int64_t offset = 0;
  for (const auto& t : tensors) {
    // view() + copy_ reads `t` in logical order whatever its strides, with no
    // intermediate contiguous copy.
    flat.narrow(0, offset, t.numel()).view(t.sizes()).copy_(t);
    if (infos != nullptr) {
      FlatParamInfo info;
      info.shape = t.sizes().vec();
      info.stride = t.strides().vec();
      info.numel = t.numel();
      info.offset = offset;
      info.requires_grad = t.requires_grad();
      infos->push_back(std::move(info));
    }
    offset += t.numel();
  }
  if (padded > total) flat.narrow(0, total, padded - total).zero_();
  return flat;
}

std::vector<at::Tensor> unflatten_views(const at::Tensor& flat,
                                        const std::vector<FlatParamInfo>& infos) {
  TORCH_CHECK(flat.dim() == 1, "unflatten_views: flat has shape ", flat.sizes(),
              ": expected a 1-D tensor");
  std::vector<at::Tensor> views;
  views.reserve(infos.size());
  for (const auto& info : infos) {
    TORCH_CHECK(info.offset >= 0 && info.offset + info.numel <= flat.numel(),
                "unflatten_views: parameter '", info.fqn, "' spans [", info.offset, ", ",
                info.offset + info.numel, "): expected it inside the flat tensor's ", flat.numel(),
                " elements");
    views.push_back(flat.narrow(0, info.offset, info.numel).view(info.shape));
  }
  return views;
}

int64_t cached_unsharded_bytes() { return FreedStorageCache::get().cached_bytes(); }

void release_cached_unsharded_memory() { FreedStorageCache::get().release(); }

double gradient_predivide_factor(int64_t world_size) {
  TORCH_CHECK(world_size >= 1, "gradient_predivide_factor: world_size=", world_size,
              ": expected >= 1");
  int64_t factor = 1;
  while (world_size % factor == 0 && static_cast<double>(world_size) / static_cast<double>(factor) >
                                         static_cast<double>(factor)) {
    factor *= 2;
  }
  return static_cast<double>(factor);
}

// ---------------------------------------------------------------------------

FlatParamHandle::FlatParamHandle(std::shared_ptr<torch::nn::Module> module,
                                 const std::vector<std::string>& param_fqns,
                                 comm::ProcessGroup shard_group, FlatParamOptions options,
                                 comm::ProcessGroup replicate_group)
    : module_(std::move(module)),
      shard_group_(std::move(shard_group)),
      replicate_group_(std::move(replicate_group)),
      options_(std::move(options)) {
  TORCH_CHECK(module_ != nullptr, "FlatParamHandle: module is null");
  const auto strategy = options_.sharding_strategy;
  TORCH_CHECK(shard_group_.is_member(), "FlatParamHandle: shard_group '", shard_group_.name(),
              "' (size ", shard_group_.size(), "): expected the calling rank to be a member");
  int64_t data_parallel_world = shard_group_.size();
  if (is_hybrid(strategy)) {
    TORCH_CHECK(replicate_group_.is_member(), "FlatParamHandle: ", sharding_strategy_name(strategy),
                " needs a replicate_group the calling rank is a member of; got ", "one of size ",
                replicate_group_.size(), " (see comm::hybrid_shard_groups)");
    data_parallel_world *= replicate_group_.size();
  } else {
    TORCH_CHECK(replicate_group_.size() == 0, "FlatParamHandle: replicate_group", " of size ",
                replicate_group_.size(), " given with ", sharding_strategy_name(strategy),
                ": expected none (only HYBRID_SHARD and _HYBRID_SHARD_ZERO2 "
                "replicate)");
  }
  if (uses_sharding(strategy)) {
    shard_world_size_ = shard_group_.size();
    shard_rank_ = shard_group_.rank();
  }
  predivide_factor_ = gradient_predivide_factor(data_parallel_world);
  postdivide_factor_ = static_cast<double>(data_parallel_world) / predivide_factor_;
  accessor_ = std::make_unique<functorch::NamedMemberAccessor>(module_);
  init_flat_param(param_fqns);
}

FlatParamHandle::~FlatParamHandle() {
  // A reduction in flight reads and writes our gradient buffers.
  abandon_reduce_grad();
  // A gather still in flight writes into our buffers: finish it first. Never
  // throw from a destructor; the group's own timeout bounds the wait.
  if (state_ == State::kUnsharding) {
    try {
      pending_gather_.wait();
    } catch (const std::exception&) {
    }
  }
}

void FlatParamHandle::collect_orig_params(const std::vector<std::string>& param_fqns) {
  TORCH_CHECK(!param_fqns.empty(), "FlatParamHandle: param_fqns is empty: ",
              "expected the names of the parameters this unit owns (a unit ",
              "with no parameters needs no handle)");
  const auto named = module_->named_parameters(/*recurse=*/true);
  std::unordered_map<const c10::TensorImpl*, size_t> index_of;
  std::unordered_set<std::string> listed;
  for (const auto& fqn : param_fqns) {
    TORCH_CHECK(listed.insert(fqn).second, "FlatParamHandle: param_fqns lists '", fqn,
                "' twice: expected each name once");
    const at::Tensor* param = named.find(fqn);
    TORCH_CHECK(param != nullptr && param->defined(), "FlatParamHandle: param_fqns contains '", fqn,
                "', which is not a parameter of the module: expected a name "
                "from module->named_parameters()");
    const c10::TensorImpl* impl = param->unsafeGetTensorImpl();
    auto found = index_of.find(impl);
    if (found != index_of.end()) {
      infos_[found->second].alias_fqns.push_back(fqn);
      continue;
    }
    TORCH_CHECK(at::isFloatingType(param->scalar_type()), "FlatParamHandle: parameter '", fqn,
                "' has dtype ", param->scalar_type(), ": expected a floating-point dtype");
    if (!orig_params_.empty()) {
      const at::Tensor& first = orig_params_.front();
      TORCH_CHECK(param->scalar_type() == first.scalar_type(),
                  "FlatParamHandle: must flatten tensors with uniform dtype but "
                  "got ",
                  first.scalar_type(), " ('", infos_.front().fqn, "') and ", param->scalar_type(),
                  " ('", fqn, "')");
      TORCH_CHECK(param->device() == first.device(),
                  "FlatParamHandle: must flatten tensors on the same device but "
                  "got ",
                  first.device(), " ('", infos_.front().fqn, "') and ", param->device(), " ('", fqn,
                  "')");
      TORCH_CHECK(options_.use_orig_params || param->requires_grad() == first.requires_grad(),
                  "FlatParamHandle: must flatten tensors with uniform "
                  "`requires_grad` when `use_orig_params=False`, but '",
                  infos_.front().fqn, "' has requires_grad=", first.requires_grad(), " and '", fqn,
                  "' has requires_grad=", param->requires_grad(),
                  ": for use_orig_params=False each FSDP unit must manage "
                  "parameters that are all frozen or all non-frozen (freeze whole "
                  "units, or set use_orig_params=true)");
    }
    index_of.emplace(impl, infos_.size());
    FlatParamInfo info;
    info.fqn = fqn;
    infos_.push_back(std::move(info));
    orig_params_.push_back(*param);
  }
  // Names the caller did not list but that hold one of the same tensors
  // (a weight tied across submodules): after sharding they must see the same
  // views, or they would keep computing with the stale original.
  for (const auto& item : named) {
    if (listed.count(item.key()) != 0) continue;
    auto found = index_of.find(item.value().unsafeGetTensorImpl());
    if (found != index_of.end()) infos_[found->second].alias_fqns.push_back(item.key());
  }
}

void FlatParamHandle::init_flat_param(const std::vector<std::string>& param_fqns) {
  collect_orig_params(param_fqns);
  const at::Tensor& first = orig_params_.front();
  param_dtype_ = first.scalar_type();
  compute_device_ = options_.compute_device.value_or(first.device());
  if (auto streams = internal::comm_streams_for(compute_device_)) {
    unshard_stream_ = streams->unshard;
    reduce_stream_ = streams->reduce;
  }
  const auto& mp = options_.mixed_precision;
  compute_dtype_ = mp.param_dtype.value_or(param_dtype_);
  reduce_dtype_ = mp.reduce_dtype.value_or(compute_dtype_);
  for (const auto& p : orig_params_) any_requires_grad_ |= p.requires_grad();

  // Flatten (padded for the shard group), then keep only this rank's chunk.
  std::vector<at::Tensor> detached;
  detached.reserve(orig_params_.size());
  for (const auto& p : orig_params_) detached.push_back(p.detach());
  std::vector<FlatParamInfo> layout;
  at::Tensor full = flatten_tensors(detached, shard_world_size_, &layout);
  for (size_t i = 0; i < infos_.size(); ++i) {
    infos_[i].shape = layout[i].shape;
    infos_[i].stride = layout[i].stride;
    infos_[i].numel = layout[i].numel;
    infos_[i].offset = layout[i].offset;
    infos_[i].requires_grad = orig_params_[i].requires_grad();
    unpadded_numel_ += layout[i].numel;
  }
  padded_numel_ = full.numel();
  shard_numel_ = padded_numel_ / shard_world_size_;
  const int64_t shard_start = shard_rank_ * shard_numel_;
  for (auto& info : infos_) {
    const int64_t lo = std::max(info.offset, shard_start);
    const int64_t hi = std::min(info.offset + info.numel, shard_start + shard_numel_);
    if (hi > lo) {
      info.offset_in_shard = lo - shard_start;
      info.numel_in_shard = hi - lo;
      info.offset_in_param = lo - info.offset;
    }
  }

  {
    at::NoGradGuard no_grad;
    // clone(): the shard must own its memory so `full` is freed here.
    at::Tensor shard = full.narrow(0, shard_start, shard_numel_).clone();
    full = at::Tensor();
    if (options_.offload_params && !shard.device().is_cpu()) shard = shard.to(at::kCPU);
    // Pinned host memory only pays off (and only exists) with a CUDA compute
    // device; a CPU-only LibTorch has no pinned allocator.
    if (options_.offload_params && compute_device_.is_cuda()) shard = shard.pin_memory();
    flat_param_ = shard;
  }
  flat_param_.set_requires_grad(any_requires_grad_);

  // kNoShard in full precision on the shard's device computes on the shard
  // itself: the unsharded parameter is an alias of its storage.
  unsharded_is_shard_ = !uses_sharding(options_.sharding_strategy) &&
                        compute_dtype_ == param_dtype_ && flat_param_.device() == compute_device_;
  if (unsharded_is_shard_) {
    unsharded_ = flat_param_.variable_data();
  } else {
    unsharded_ = at::empty({padded_numel_},
                           at::TensorOptions().dtype(compute_dtype_).device(compute_device_));
    free_storage(unsharded_);
  }
  unsharded_.set_requires_grad(any_requires_grad_);
  unsharded_data_ = unsharded_.variable_data();
  point_originals_at_shard();
}

void FlatParamHandle::point_originals_at_shard() {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < infos_.size(); ++i) {
    orig_params_[i].set_data(
        storage_slice(flat_param_, infos_[i].offset_in_shard, infos_[i].numel_in_shard));
  }
}

void FlatParamHandle::set_module_tensors(const std::vector<at::Tensor>& values) {
  std::vector<std::string> names;
  std::vector<at::Tensor> expanded;
  for (size_t i = 0; i < infos_.size(); ++i) {
    names.push_back(infos_[i].fqn);
    expanded.push_back(values[i]);
    for (const auto& alias : infos_[i].alias_fqns) {
      names.push_back(alias);
      expanded.push_back(values[i]);
    }
  }
  accessor_->set_tensors(names, std::move(expanded));
}

void FlatParamHandle::unshard(bool async, UnshardOptions options) {
  const bool full_precision = options.full_precision && compute_dtype_ != param_dtype_;
  if (state_ != State::kSharded) {
    TORCH_CHECK(full_precision == active_full_precision_,
                "FlatParamHandle::unshard: already unsharded with "
                "full_precision=",
                active_full_precision_, "; got full_precision=", full_precision,
                ": reshard() first");
    if (!async) wait_for_unshard();
    return;
  }
  active_full_precision_ = full_precision;
  at::Tensor target = unsharded_data_;
  if (full_precision) {
    if (!full_precision_unsharded_.defined()) {
      full_precision_unsharded_ = at::empty(
          {padded_numel_}, at::TensorOptions().dtype(param_dtype_).device(compute_device_));
      free_storage(full_precision_unsharded_);
    }
    target = full_precision_unsharded_;
  } else if (unsharded_is_shard_) {
    state_ = State::kUnsharded;
    return;
  }
  {
    // On an accelerator everything below is queued on the unshard stream,
    // after what the compute stream has queued so far (the optimizer's last
    // update of the shard), so the gather overlaps the compute queued next.
    std::optional<c10::StreamGuard> on_unshard_stream;
    if (unshard_stream_) {
      internal::wait_stream(*unshard_stream_, internal::current_stream(compute_device_));
      on_unshard_stream.emplace(*unshard_stream_);
    }
    allocate_storage(target);
    at::NoGradGuard no_grad;
    // variable_data(): read the shard without touching its autograd state.
    at::Tensor shard = flat_param_.variable_data();
    if (!uses_sharding(options_.sharding_strategy) || shard_world_size_ == 1) {
      // Nothing to gather (no sharding, or a one-rank shard group: the shard
      // is the whole flat parameter): cast (and/or move) it.
      target.copy_(shard, /*non_blocking=*/unshard_stream_.has_value());
      state_ = State::kUnsharded;
      mark_unshard_queued();
      return;
    }
    // The all-gather's input: the shard cast to the gathered dtype and moved
    // to the compute device (a temporary freed once the gather is done), or
    // the shard itself. From pinned host memory (CPU offload) the copy is
    // asynchronous on the unshard stream.
    gather_input_ = shard;
    if (shard.scalar_type() != target.scalar_type() || shard.device() != target.device()) {
      gather_input_ = shard.to(target.device(), target.scalar_type(),
                               /*non_blocking=*/unshard_stream_.has_value(), /*copy=*/false);
    }
    pending_gather_ = comm::all_gather_into_tensor(shard_group_, target, gather_input_);
    state_ = State::kUnsharding;
  }
  if (!async) wait_for_unshard();
}

void FlatParamHandle::mark_unshard_queued() {
  if (!unshard_stream_) return;
  unshard_queued_.emplace(compute_device_.type());
  unshard_queued_->record(*unshard_stream_);
}

void FlatParamHandle::wait_for_unshard() {
  if (state_ == State::kUnsharding) {
    if (unshard_stream_) {
      // The unshard stream waits for the collective (the host does not);
      // the temporaries below were allocated on it, so freeing them after
      // this is ordered after the gather.
      c10::StreamGuard on_unshard_stream(*unshard_stream_);
      pending_gather_.wait_on_stream();
    } else {
      pending_gather_.wait();
    }
    pending_gather_ = comm::Work();
    gather_input_ = at::Tensor();
    state_ = State::kUnsharded;
    mark_unshard_queued();
  }
  if (unshard_queued_) {
    // The caller's stream computes on the gathered parameters next.
    unshard_queued_->block(internal::current_stream(compute_device_));
    unshard_queued_.reset();
  }
}

void FlatParamHandle::use_unsharded_views() {
  wait_for_unshard();
  TORCH_CHECK(state_ == State::kUnsharded,
              "FlatParamHandle::use_unsharded_views: the flat parameter is "
              "sharded: expected unshard() first");
  const at::Tensor& base = active_full_precision_ ? full_precision_unsharded_ : unsharded_;
  // Frozen parameters (use_orig_params) view a detached alias, so backward
  // neither computes nor accumulates gradients for their region.
  at::Tensor frozen_base = base.detach();
  // One split_with_sizes (the parameters lie back to back from offset 0,
  // padding last), as PyTorch's _use_unsharded_views does: its backward is
  // one concatenation into the flat gradient. A narrow() per parameter
  // would make backward build a zero-filled flat-sized gradient per
  // parameter and sum them all.
  std::vector<int64_t> sizes;
  sizes.reserve(infos_.size() + 1);
  int64_t covered = 0;
  bool consecutive = true;
  for (const auto& info : infos_) {
    consecutive &= info.offset == covered;
    sizes.push_back(info.numel);
    covered += info.numel;
  }
  if (covered < base.numel()) sizes.push_back(base.numel() - covered);
  consecutive &= covered <= base.numel();
  std::vector<at::Tensor> parts;
  if (consecutive && base.requires_grad()) parts = base.split_with_sizes(sizes);
  unsharded_views_.clear();
  unsharded_views_.reserve(infos_.size());
  for (size_t i = 0; i < infos_.size(); ++i) {
    const auto& info = infos_[i];
    if (info.requires_grad && !parts.empty()) {
      unsharded_views_.push_back(parts[i].view(info.shape));
      continue;
    }
    const at::Tensor& from = info.requires_grad ? base : frozen_base;
    unsharded_views_.push_back(from.narrow(0, info.offset, info.numel).view(info.shape));
  }
  set_module_tensors(unsharded_views_);
}

void FlatParamHandle::reshard(bool writeback) {
  wait_for_unshard();
  if (state_ == State::kSharded) return;
  const at::Tensor& data = active_full_precision_ ? full_precision_unsharded_ : unsharded_data_;
  const bool aliases_shard = unsharded_is_shard_ && !active_full_precision_;
  if (writeback && !aliases_shard) {
    at::NoGradGuard no_grad;
    // Through variable_data(): a plain write to the leaf's memory (the
    // optimizer-facing views of the originals share it and see it).
    flat_param_.variable_data().copy_(data.narrow(0, shard_rank_ * shard_numel_, shard_numel_));
  }
  if (!aliases_shard) free_storage(data);
  unsharded_views_.clear();
  active_full_precision_ = false;
  state_ = State::kSharded;
  set_module_tensors(orig_params_);
}

at::Tensor FlatParamHandle::unsharded_grad() const { return unsharded_.grad(); }

void FlatParamHandle::clear_unsharded_grad() { unsharded_.mutable_grad().reset(); }

void FlatParamHandle::reset_flat_param_grad_if_needed() {
  if (!options_.use_orig_params || !flat_param_.grad().defined()) return;
  if (orig_grads_were_cleared()) flat_param_.mutable_grad().reset();
}

bool FlatParamHandle::orig_grads_were_cleared() const {
  // A per-parameter optimizer's zero_grad(set_to_none) resets the originals'
  // .grad (views of the flat gradient); the flat gradient must follow, or
  // the next reduction would add to stale values.
  bool any_trainable = false;
  for (size_t i = 0; i < infos_.size(); ++i) {
    if (!infos_[i].requires_grad) continue;
    any_trainable = true;
    if (orig_params_[i].grad().defined()) return false;
  }
  return any_trainable;
}

void FlatParamHandle::sync_orig_grads_from_flat() {
  const at::Tensor& flat_grad = flat_param_.grad();
  for (size_t i = 0; i < infos_.size(); ++i) {
    at::Tensor& grad = orig_params_[i].mutable_grad();
    if (!infos_[i].requires_grad || !flat_grad.defined()) {
      grad = at::Tensor();
      continue;
    }
    grad = storage_slice(flat_grad, infos_[i].offset_in_shard, infos_[i].numel_in_shard);
  }
}

bool FlatParamHandle::needs_replicate_reduce() const {
  return is_hybrid(options_.sharding_strategy) && replicate_group_.size() > 1;
}

bool FlatParamHandle::reduce_grad() {
  if (!start_reduce_grad()) return false;
  finish_reduce_grad();
  return true;
}

bool FlatParamHandle::start_reduce_grad() {
  if (reduce_grad_pending()) finish_reduce_grad();
  at::Tensor unsharded_grad = unsharded_.grad();
  if (!unsharded_grad.defined()) return false;
  at::NoGradGuard no_grad;
  PendingReduce pending;
  // On an accelerator the reduction is queued on the reduce stream after
  // the backward computation that produced the gradient.
  std::optional<c10::StreamGuard> on_reduce_stream;
  if (reduce_stream_) {
    pending.compute_stream = internal::current_stream(compute_device_);
    internal::wait_stream(*reduce_stream_, *pending.compute_stream);
    // Allocated on the compute stream, read on the reduce stream, released
    // below before that read is done.
    unsharded_grad.record_stream(*reduce_stream_);
    on_reduce_stream.emplace(*reduce_stream_);
  }
  // The unsharded gradient is taken (cleared below), so it may be reused as
  // the reduction buffer when no cast is needed.
  at::Tensor grad = unsharded_grad.to(reduce_dtype_).contiguous();
  unsharded_grad = at::Tensor();
  if (predivide_factor_ > 1) grad.div_(predivide_factor_);
  pending.grad = grad;
  pending.stage = 1;
  if (uses_sharding(options_.sharding_strategy) && shard_world_size_ == 1) {
    // A one-rank shard group: the reduce-scatter would copy `grad` out and
    // back (the sum over one rank is the value itself). Nothing to send;
    // the replicate all-reduce (hybrid) can start at once.
    pending.shard_grad = grad;
    if (needs_replicate_reduce()) {
      pending.work = comm::all_reduce(replicate_group_, grad, comm::ReduceOp::kSum);
      pending.stage = 2;
    } else {
      pending.stage = 3;
    }
  } else if (uses_sharding(options_.sharding_strategy)) {
    pending.shard_grad = at::empty({shard_numel_}, grad.options());
    pending.work =
        comm::reduce_scatter_tensor(shard_group_, pending.shard_grad, grad, comm::ReduceOp::kSum);
  } else {
    pending.work = comm::all_reduce(shard_group_, grad, comm::ReduceOp::kSum);
    pending.shard_grad = grad;
  }
  // Backward accumulates afresh from here on; the taken gradient lives in
  // `pending` (and in the Work) until the reduction is finished.
  unsharded_.mutable_grad().reset();
  pending_reduce_ = std::move(pending);
  return true;
}

void FlatParamHandle::issue_reduce_grad() {
  PendingReduce& p = pending_reduce_;
  if (p.stage != 1 || !needs_replicate_reduce()) return;
  try {
    std::optional<c10::StreamGuard> on_reduce_stream;
    if (reduce_stream_) on_reduce_stream.emplace(*reduce_stream_);
    wait_for_collective(p.work);
    p.work = comm::all_reduce(replicate_group_, p.shard_grad, comm::ReduceOp::kSum);
    p.stage = 2;
  } catch (...) {
    abandon_reduce_grad();
    throw;
  }
}

bool FlatParamHandle::advance_reduce_grad(bool block) {
  PendingReduce& p = pending_reduce_;
  if (p.stage == 0) return true;
  try {
    // A stream-ordered collective (NCCL) can always be waited for: the wait
    // is queued on the reduce stream, the host goes on.
    auto ready = [&](const comm::Work& work) {
      return block || work.is_stream_ordered() || work.is_completed();
    };
    std::optional<c10::StreamGuard> on_reduce_stream;
    if (reduce_stream_) on_reduce_stream.emplace(*reduce_stream_);
    if (p.stage == 1) {
      if (!ready(p.work)) return false;
      wait_for_collective(p.work);
      if (needs_replicate_reduce()) {
        p.work = comm::all_reduce(replicate_group_, p.shard_grad, comm::ReduceOp::kSum);
        p.stage = 2;
      } else {
        p.work = comm::Work();
        p.stage = 3;
      }
    }
    if (p.stage == 2) {
      if (!ready(p.work)) return false;
      wait_for_collective(p.work);
      p.work = comm::Work();
      p.stage = 3;
    }
    if (p.stage == 3) finalize_reduce_grad();
    if (p.stage == 4) {
      // CPU offload from an accelerator: the gradient's copy into pinned
      // host memory must land before the host adds it to the shard's .grad.
      if (!block && !p.copied_to_host->query()) return false;
      p.copied_to_host->synchronize();
      accumulate_shard_grad(std::move(p.shard_grad));
      pending_reduce_ = PendingReduce();
    }
  } catch (...) {
    abandon_reduce_grad();
    throw;
  }
  if (block && reduce_stream_) {
    // The caller reads the gradient on its stream next.
    internal::wait_stream(internal::current_stream(compute_device_), *reduce_stream_);
  }
  return true;
}

void FlatParamHandle::wait_for_collective(comm::Work& work) {
  // Called with the reduce stream current when there is one.
  if (reduce_stream_) {
    work.wait_on_stream();
  } else {
    work.wait();
  }
}

void FlatParamHandle::abandon_reduce_grad() noexcept {
  if (pending_reduce_.stage == 0) return;
  if (pending_reduce_.stage >= 3) {  // no collective in flight
    if (pending_reduce_.copied_to_host) {
      try {
        pending_reduce_.copied_to_host->synchronize();  // the copy writes into it
      } catch (...) {
      }
    }
    pending_reduce_ = PendingReduce();
    return;
  }
  try {
    // Bounded by the group's timeout; a failed Work rethrows at once.
    pending_reduce_.work.wait();
  } catch (...) {
  }
  pending_reduce_ = PendingReduce();
}

void FlatParamHandle::finalize_reduce_grad() {
  at::NoGradGuard no_grad;
  at::Tensor shard_grad = std::move(pending_reduce_.shard_grad);
  std::optional<c10::Stream> compute_stream = pending_reduce_.compute_stream;
  pending_reduce_ = PendingReduce();  // frees the unsharded gradient
  if (postdivide_factor_ > 1) shard_grad.div_(postdivide_factor_);
  const auto grad_dtype =
      options_.mixed_precision.keep_low_precision_grads ? compute_dtype_ : param_dtype_;
  if (reduce_stream_ && flat_param_.device().is_cpu()) {
    // CPU offload: an asynchronous copy into pinned host memory on the
    // reduce stream; advance_reduce_grad() adds it once it has landed.
    pending_reduce_.shard_grad =
        shard_grad.to(flat_param_.device(), grad_dtype, /*non_blocking=*/true);
    pending_reduce_.copied_to_host.emplace(compute_device_.type());
    pending_reduce_.copied_to_host->record(*reduce_stream_);
    pending_reduce_.stage = 4;
    return;
  }
  shard_grad = shard_grad.to(flat_param_.device(), grad_dtype);
  // Allocated on the reduce stream, used (and freed) on the compute stream
  // from the end of backward on.
  if (compute_stream && !shard_grad.is_cpu()) shard_grad.record_stream(*compute_stream);
  accumulate_shard_grad(std::move(shard_grad));
}

void FlatParamHandle::accumulate_shard_grad(at::Tensor shard_grad) {
  at::NoGradGuard no_grad;
  // zero_grad may have run since the runtime's last reset (no forward in
  // between: a backward alone, or reduce_grad called directly).
  reset_flat_param_grad_if_needed();
  at::Tensor& accumulated = flat_param_.mutable_grad();
  if (accumulated.defined()) {
    TORCH_CHECK(accumulated.sizes() == shard_grad.sizes(),
                "FlatParamHandle::reduce_grad: the shard's existing .grad has "
                "shape ",
                accumulated.sizes(), ": expected ", shard_grad.sizes());
    accumulated.add_(shard_grad);
  } else {
    // Own memory: shard_grad may still alias the taken unsharded gradient
    // (kNoShard), which is fine since nothing else references it now.
    accumulated = shard_grad;
  }
  if (options_.use_orig_params) sync_orig_grads_from_flat();
}

void FlatParamHandle::register_post_backward_hook(std::function<void()> hook) {
  TORCH_CHECK(any_requires_grad_, "FlatParamHandle::register_post_backward_hook: ",
              "no parameter of this unit requires grad (", join_names(infos_.front()),
              ", ...): there is no backward to hook");
  TORCH_CHECK(hook != nullptr, "FlatParamHandle::register_post_backward_hook: ", "hook is empty");
  // The tensor holds its AccumulateGrad node only weakly; keep it alive so
  // the hook survives between iterations.
  if (!grad_accumulator_) grad_accumulator_ = torch::autograd::impl::grad_accumulator(unsharded_);
  grad_accumulator_->add_post_hook(std::make_unique<LambdaPostHook>(std::move(hook)));
}

std::vector<std::string> FlatParamHandle::managed_fqns() const {
  std::vector<std::string> names;
  for (const auto& info : infos_) {
    names.push_back(info.fqn);
    names.insert(names.end(), info.alias_fqns.begin(), info.alias_fqns.end());
  }
  return names;
}

int64_t FlatParamHandle::unsharded_storage_nbytes() const {
  return storage_nbytes(unsharded_) + storage_nbytes(full_precision_unsharded_);
}

int64_t FlatParamHandle::low_precision_shard_nbytes() const {
  if (!gather_input_.defined() || gather_input_.is_same(flat_param_)) return 0;
  if (gather_input_.storage().is_alias_of(flat_param_.storage())) return 0;
  return storage_nbytes(gather_input_);
}

int64_t FlatParamHandle::sharded_storage_nbytes() const { return storage_nbytes(flat_param_); }

const std::shared_ptr<torch::nn::Module>& FlatParamHandle::module() const { return module_; }

}  // namespace fsdp
