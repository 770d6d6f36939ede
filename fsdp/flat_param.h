// The flat parameter of one FSDP unit and the handle that manages it
// (PyTorch's FlatParameter / FlatParamHandle).
//
// The parameters a unit owns are flattened, in registration order, into one
// 1-D tensor padded to a multiple of the shard group's size; rank r keeps the
// contiguous chunk r (the "shard"). Around compute the runtime drives the
// handle through
//
//   unshard()                 all-gather the shard into the padded buffer
//   use_unsharded_views()     point the module's parameters at views of it
//   ... forward / backward ...
//   reduce_grad()             reduce-scatter the flat gradient into the shard
//                             (or start_reduce_grad() ... finish_reduce_grad())
//   reshard()                 free the gathered storage
//
// Lifetimes. The unsharded flat parameter is one autograd leaf for the whole
// life of the handle; reshard() releases its storage (nbytes() becomes 0) and
// the next unshard() re-allocates the same StorageImpl, so views made before
// (including the ones autograd saved during forward) see the new data. Views
// are cheap to rebuild (no copy) and are rebuilt by use_unsharded_views().
// Reading the views (or running a backward that needs them) while sharded
// reads freed memory: unshard first, as PyTorch's runtime does.
//
// Gradients. Backward accumulates into the unsharded flat parameter's .grad
// (unsharded_grad()); reduce_grad() reduces it over the ranks and adds the
// result to the shard's .grad (flat_param().grad(), or the original
// parameters' .grad views with use_orig_params). Skipping reduce_grad()
// (no_sync) keeps accumulating the unsharded gradient; the next
// reduce_grad() reduces the sum.
//
// On an accelerator (a CUDA compute device) the handle works as PyTorch's
// FSDP does on GPUs: gathers (with the shard's cast, or its copy from pinned
// host memory under CPU offload) are queued on an unshard stream and
// reductions (casts, reduce-scatter, accumulation into the shard's .grad) on
// a reduce stream, each ordered after the compute stream's work with events,
// so communication overlaps compute and the host never waits for a
// collective. wait_for_unshard() makes the caller's current stream wait for
// the gather; a finished reduction is one queued on the reduce stream, and
// finish_reduce_grad() (or advance_reduce_grad(true)) makes the caller's
// stream wait for it before the caller reads .grad. The runtime does that
// once, at the end of backward. Memory allocated on one stream and used on
// another is recorded on the second (Tensor::record_stream), so the caching
// allocator does not reuse it too early.
//
// Not thread-safe; every rank of the shard (and replicate) group must make
// the same collective calls in the same order.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/autograd/variable.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <optional>

#include "comm/process_group.h"
#include "comm/work.h"
#include "fsdp/mixed_precision.h"
#include "fsdp/sharding_strategy.h"

namespace torch {
namespace nn {
class Module;
}  // namespace nn
namespace autograd {
struct Node;
}  // namespace autograd
}  // namespace torch

namespace functorch {
class NamedMemberAccessor;
}  // namespace functorch

namespace fsdp {

// Where one original parameter lives in the flat parameter.
struct FlatParamInfo {
  // The name it was flattened under (the first of its names in registration
  // order), relative to the handle's module.
  std::string fqn;
  // Its other names (tied/shared parameters): every alias is pointed at the
  // same view.
  std::vector<std::string> alias_fqns;
  std::vector<int64_t> shape;
  // The original's strides. Views are rebuilt contiguous (flattening reads
  // the parameter in logical order); recorded for checkpoint code.
  std::vector<int64_t> stride;
  int64_t numel = 0;
  // First element in the unsharded flat parameter.
  int64_t offset = 0;
  bool requires_grad = true;

  // This rank's part of it (what a use_orig_params view covers): elements
  // [offset_in_param, offset_in_param + numel_in_shard) of the flattened
  // parameter sit at [offset_in_shard, offset_in_shard + numel_in_shard) of
  // the local shard. numel_in_shard == 0 when this rank holds none of it.
  int64_t offset_in_shard = 0;
  int64_t numel_in_shard = 0;
  int64_t offset_in_param = 0;
};

// Concatenates the tensors' elements (logical order, any strides) into one
// new 1-D tensor, zero-padded at the end to a multiple of `pad_to_multiple`
// (>= 1). All tensors must share dtype and device; the result does not
// require grad. `infos` (optional) receives shape/stride/numel/offset per
// tensor (names left empty).
at::Tensor flatten_tensors(const std::vector<at::Tensor>& tensors, int64_t pad_to_multiple = 1,
                           std::vector<FlatParamInfo>* infos = nullptr);

// Views of `flat` (1-D) shaped as `infos` describe: no copy. If `flat`
// requires grad the views are autograd views, so gradients flow to `flat`.
std::vector<at::Tensor> unflatten_views(const at::Tensor& flat,
                                        const std::vector<FlatParamInfo>& infos);

// PyTorch's _get_gradient_predivide_factor: the power of two, about
// sqrt(world_size), that gradients are divided by before the reduction (the
// rest, world_size / factor, after it) so float16/bfloat16 sums stay in
// range.
double gradient_predivide_factor(int64_t world_size);

// Memory that reshard() freed is kept (at most two blocks, process-wide) and
// handed to the next unshard() that needs exactly that many bytes on that
// device, as CUDA's caching allocator does for PyTorch's FSDP: a freshly
// allocated CPU buffer costs a page fault per page on first touch, which
// for a large unit rivals the all-gather. Tensors still own nothing while
// sharded (storage nbytes 0); the bytes below are what the process keeps.
int64_t cached_unsharded_bytes();
// Returns the kept blocks to the allocator (torch.cuda.empty_cache's role).
void release_cached_unsharded_memory();

struct FlatParamOptions {
  ShardingStrategy sharding_strategy = ShardingStrategy::kFullShard;
  MixedPrecision mixed_precision;
  // CPU offload: the shard and its gradient live on the CPU; the shard is
  // copied to the compute device for the all-gather. (Pinned memory only
  // for a CUDA compute device.)
  bool offload_params = false;
  // Keep the original parameter tensors as the optimizer-facing parameters
  // (views of this rank's part of the shard) and allow mixing frozen and
  // trainable parameters.
  bool use_orig_params = false;
  // Where gathering and compute happen. Unset: the parameters' device.
  std::optional<c10::Device> compute_device;
};

// What unshard() gathers.
struct UnshardOptions {
  // Gather the full-precision shard even under mixed precision (what
  // summon_full_params does, so writes can be written back losslessly).
  // The gathered parameter then does not take part in autograd.
  bool full_precision = false;
};

class FlatParamHandle {
 public:
  // Flattens and shards the parameters `param_fqns` (names relative to
  // `module`, as module->named_parameters() spells them) of one unit, in the
  // order given -- pass them in registration order, leaving out ignored
  // parameters and those owned by nested units. Other names of the same
  // tensors in `module` (tied weights) become aliases: stored once, viewed
  // under every name. A tensor already managed by another handle must not be
  // listed again (the runtime tracks managed tensors by identity, as
  // PyTorch does: a shared parameter belongs to the first unit that takes
  // it). Afterwards each original parameter tensor keeps its
  // identity but its data is a 1-D view of this rank's part of the shard
  // (possibly empty), and the module's names point at it.
  //
  // `shard_group` is the group the flat parameter is sharded over (all of
  // data parallelism, or one node for the hybrid strategies); for kNoShard it
  // is the group gradients are all-reduced over. `replicate_group` is
  // required for the hybrid strategies and must be empty otherwise.
  //
  // Errors (c10::Error): unknown or empty names, non-floating or mixed
  // dtypes/devices, mixed requires_grad without use_orig_params, a missing
  // or superfluous replicate group, a caller not in the groups.
  FlatParamHandle(std::shared_ptr<torch::nn::Module> module,
                  const std::vector<std::string>& param_fqns, comm::ProcessGroup shard_group,
                  FlatParamOptions options = {},
                  comm::ProcessGroup replicate_group = comm::ProcessGroup());
  ~FlatParamHandle();
  FlatParamHandle(const FlatParamHandle&) = delete;
  FlatParamHandle& operator=(const FlatParamHandle&) = delete;

  // ---- unshard / reshard -------------------------------------------------

  // Starts the all-gather into the unsharded buffer (re-allocating its
  // storage). With async=false it also waits. Calling it while already
  // unsharded (or unsharding) with the same options is a no-op, so a
  // pre-backward unshard after SHARD_GRAD_OP's forward costs nothing.
  void unshard(bool async = false, UnshardOptions options = {});
  // Completes a pending async unshard (no-op otherwise). Must be called
  // before the unsharded parameter is read.
  void wait_for_unshard();
  // Rebuilds one view per original parameter from the unsharded flat
  // parameter (no copy) and points the module's names (and aliases) at them,
  // so forward() computes on the gathered parameters. Waits for a pending
  // unshard. Requires the handle to be unsharded.
  void use_unsharded_views();
  // Frees the unsharded storage (its StorageImpl drops to 0 bytes; the
  // memory goes to the freed-storage cache above) unless it is the shard
  // itself (kNoShard without mixed precision, where writes always persist),
  // and points the module's names back at the original parameters (views of
  // the shard). With writeback, first copies this rank's chunk of the
  // unsharded parameter into the shard, so writes made to the full
  // parameters while unsharded (summon_full_params with writeback) persist.
  // A pending unshard is waited for. Local: no collective.
  void reshard(bool writeback = false);

  bool is_unsharded() const { return state_ == State::kUnsharded; }
  bool is_unsharding() const { return state_ == State::kUnsharding; }

  // ---- gradients ---------------------------------------------------------

  // Reduces the accumulated unsharded gradient over the ranks and adds it to
  // the sharded gradient: cast to reduce dtype, divide by the pre-divide
  // factor, reduce-scatter (all-reduce for kNoShard), for the hybrid
  // strategies all-reduce across the replicate group, divide by the
  // post-divide factor, cast back (unless keep_low_precision_grads), move to
  // the shard's device, accumulate. The result is the average over all data
  // parallel ranks. Clears the unsharded gradient. Does nothing (returns
  // false) when backward produced no gradient for this unit. Blocking:
  // start_reduce_grad() then finish_reduce_grad() (the runtime uses those
  // separately, so the reduction overlaps the rest of backward).
  bool reduce_grad();

  // The same reduction split so backward can overlap it (what PyTorch's
  // post-backward hook on its own stream does). start_reduce_grad() takes
  // the unsharded gradient (it is cleared at once, so later backward passes
  // accumulate afresh), casts and pre-divides it and starts the first
  // collective (reduce-scatter, or all-reduce for kNoShard) without waiting;
  // it returns false (and starts nothing) when there is no gradient. A
  // reduction still pending from an earlier start is finished first. Until
  // the reduction is finished the shard's .grad (and the original
  // parameters' .grad with use_orig_params) do not include it.
  //
  // For the hybrid strategies the replicate-group all-reduce can only start
  // once the reduce-scatter is done; it is started by advance_reduce_grad()
  // or issue_reduce_grad(). Every rank must start the collectives of its
  // handles in the same order: callers with several handles advance them in
  // the order they were started (see Runtime::poll_reductions and
  // Runtime::finish_reductions in fsdp/internal/runtime.cc).
  //
  // If a collective failed (peer died, timeout) the calls below throw that
  // error and the pending reduction is dropped (never waited on again).
  bool start_reduce_grad();
  // True between start_reduce_grad() and the end of the reduction.
  bool reduce_grad_pending() const { return pending_reduce_.stage != 0; }
  // True when no collective of the pending reduction is left to start (always
  // for non-hybrid strategies, or when nothing is pending).
  bool reduce_grad_issued() const {
    return pending_reduce_.stage != 1 || !needs_replicate_reduce();
  }
  // Waits for the first collective if needed so that every collective of the
  // pending reduction has been started. No-op when nothing is pending.
  void issue_reduce_grad();
  // Makes what progress is possible: with block=false it never waits (it
  // starts the replicate all-reduce once the reduce-scatter is done, and
  // finishes the reduction once the last collective is done); with block=true
  // it waits until the reduction is finished. Finishing = divide by the
  // post-divide factor, cast, move to the shard's device, accumulate into
  // the shard's .grad (and re-point the originals' .grad), free the buffers.
  // Returns true when nothing is pending any more.
  bool advance_reduce_grad(bool block);
  // advance_reduce_grad(true).
  void finish_reduce_grad() { advance_reduce_grad(/*block=*/true); }
  // Drops a pending reduction without finishing it (waits for its
  // collectives, ignoring their errors, so no buffer is freed under them).
  // For error recovery only: the gradient it carried is lost.
  void abandon_reduce_grad() noexcept;
  // Calls `hook` each time backward has accumulated into the unsharded
  // gradient (an AccumulateGrad post hook): where the runtime runs
  // reduce_grad() unless in no_sync. Error if no parameter requires grad.
  void register_post_backward_hook(std::function<void()> hook);
  // Drops the accumulated unsharded gradient (e.g. after an aborted step).
  void clear_unsharded_grad();
  // use_orig_params: drops the shard's flat gradient once the optimizer has
  // reset every trainable original parameter's .grad (zero_grad with
  // set_to_none; the originals' .grad are views of it), as PyTorch's
  // _reset_flat_param_grad_info_if_needed does. Otherwise the flat gradient
  // stays allocated, unseen, until this unit's next reduction replaces it:
  // one gradient-sized buffer per unit through the next forward and most of
  // backward, where the activations peak (measured: FSDP1's extra memory
  // over fully_shard in issue 47). No-op without use_orig_params (the
  // optimizer then resets the flat parameter's .grad itself) or while any
  // original still has a gradient. Local: no collective.
  void reset_flat_param_grad_if_needed();

  // ---- introspection -----------------------------------------------------

  // The local shard: 1-D, full precision, an autograd leaf that requires
  // grad when any parameter does. With use_orig_params=false this is what
  // the optimizer steps.
  const at::Tensor& flat_param() const { return flat_param_; }
  // The unsharded, padded flat parameter (compute dtype). Its storage is
  // empty while sharded.
  const at::Tensor& unsharded_flat_param() const { return unsharded_; }
  // Its accumulated gradient (undefined when none).
  at::Tensor unsharded_grad() const;
  // The original parameter tensors (one per FlatParamInfo), which outside
  // forward/backward view this rank's part of the shard.
  const std::vector<at::Tensor>& orig_params() const { return orig_params_; }
  const std::vector<FlatParamInfo>& param_infos() const { return infos_; }
  // Every name the handle manages (primary names and aliases).
  std::vector<std::string> managed_fqns() const;

  int64_t unpadded_numel() const { return unpadded_numel_; }
  int64_t padded_numel() const { return padded_numel_; }
  int64_t shard_numel() const { return shard_numel_; }
  // This rank's index within the shard group (0 for kNoShard).
  int64_t shard_rank() const { return shard_rank_; }
  int64_t shard_world_size() const { return shard_world_size_; }

  ShardingStrategy sharding_strategy() const { return options_.sharding_strategy; }
  bool reshard_after_forward() const {
    return fsdp::reshard_after_forward(options_.sharding_strategy);
  }
  const FlatParamOptions& options() const { return options_; }
  c10::ScalarType compute_dtype() const { return compute_dtype_; }
  c10::ScalarType reduce_dtype() const { return reduce_dtype_; }
  double predivide_factor() const { return predivide_factor_; }
  double postdivide_factor() const { return postdivide_factor_; }

  // Bytes held right now by the unsharded buffer(s) (for kNoShard without
  // mixed precision that is the shard itself), by the cast/moved copy of the
  // shard an in-flight gather reads (0 once it is done), and by the shard:
  // what tests check to see memory really freed.
  int64_t unsharded_storage_nbytes() const;
  int64_t low_precision_shard_nbytes() const;
  int64_t sharded_storage_nbytes() const;

  const std::shared_ptr<torch::nn::Module>& module() const;

 private:
  enum class State { kSharded, kUnsharding, kUnsharded };

  // The constructor's work: collect_orig_params, then flatten, shard and
  // point the originals at the shard.
  void init_flat_param(const std::vector<std::string>& param_fqns);
  // Checks `param_fqns` (listed once, parameters of the module, floating
  // point, one dtype and device, uniform requires_grad unless
  // use_orig_params) and fills infos_ (names, aliases) and orig_params_.
  void collect_orig_params(const std::vector<std::string>& param_fqns);
  void point_originals_at_shard();
  void sync_orig_grads_from_flat();
  bool orig_grads_were_cleared() const;
  void set_module_tensors(const std::vector<at::Tensor>& values);
  bool needs_replicate_reduce() const;
  void finalize_reduce_grad();
  void accumulate_shard_grad(at::Tensor shard_grad);
  void wait_for_collective(comm::Work& work);
  void mark_unshard_queued();

  std::shared_ptr<torch::nn::Module> module_;
  std::unique_ptr<functorch::NamedMemberAccessor> accessor_;
  comm::ProcessGroup shard_group_;
  comm::ProcessGroup replicate_group_;
  FlatParamOptions options_;

  std::vector<FlatParamInfo> infos_;
  std::vector<at::Tensor> orig_params_;
  bool any_requires_grad_ = false;

  int64_t unpadded_numel_ = 0;
  int64_t padded_numel_ = 0;
  int64_t shard_numel_ = 0;
  int64_t shard_rank_ = 0;
  int64_t shard_world_size_ = 1;
  c10::Device compute_device_{c10::kCPU};
  c10::ScalarType param_dtype_ = c10::kFloat;  // the full-precision dtype
  c10::ScalarType compute_dtype_ = c10::kFloat;
  c10::ScalarType reduce_dtype_ = c10::kFloat;
  double predivide_factor_ = 1.0;
  double postdivide_factor_ = 1.0;

  // The shard (full precision; the optimizer's tensor).
  at::Tensor flat_param_;
  // The all-gather's input when the shard has to be cast (mixed precision)
  // or moved (CPU offload) first; dropped once the gather is done.
  at::Tensor gather_input_;
  // The unsharded padded flat parameter in compute dtype: an autograd leaf
  // (when anything requires grad) whose storage comes and goes.
  at::Tensor unsharded_;
  // Same storage, separate version counter: collectives and copies write
  // through it so autograd's saved-tensor version checks are not tripped.
  at::Tensor unsharded_data_;
  // Full-precision gather target for UnshardOptions::full_precision under
  // mixed precision.
  at::Tensor full_precision_unsharded_;
  // True when unsharded_ aliases the shard's storage (kNoShard without mixed
  // precision): nothing to gather or free.
  bool unsharded_is_shard_ = false;

  // Set when the compute device is an accelerator (a CUDA GPU): the streams
  // parameters are gathered and gradients reduced on (see
  // fsdp/internal/comm_streams.h), and the event marking the end of the
  // last gather (or copy) queued there, which the compute stream waits on
  // before it reads the gathered parameters.
  std::optional<c10::Stream> unshard_stream_;
  std::optional<c10::Stream> reduce_stream_;
  std::optional<c10::Event> unshard_queued_;

  State state_ = State::kSharded;
  bool active_full_precision_ = false;
  comm::Work pending_gather_;
  std::vector<at::Tensor> unsharded_views_;
  // std::shared_ptr<Node> up to about 2.12, c10::intrusive_ptr<Node> since.
  decltype(torch::autograd::impl::grad_accumulator(
      std::declval<const at::Tensor&>())) grad_accumulator_;

  // A gradient reduction started by start_reduce_grad() and not finished.
  // stage: 0 none, 1 first collective (reduce-scatter / all-reduce) in
  // flight, 2 replicate all-reduce in flight (hybrid), 3 collectives done
  // (or none needed: a one-rank shard group), result not yet accumulated,
  // 4 (CPU offload from an accelerator) the result's copy into pinned host
  // memory queued, to be added once `copied_to_host` has completed.
  // `grad` is the reduce-dtype input of the first collective (the taken
  // unsharded gradient, or its cast copy); `shard_grad` the result (== grad
  // for kNoShard and one-rank shard groups). `compute_stream`: the stream
  // backward produced the gradient on (accelerators only).
  struct PendingReduce {
    int stage = 0;
    at::Tensor grad;
    at::Tensor shard_grad;
    comm::Work work;
    std::optional<c10::Stream> compute_stream;
    std::optional<c10::Event> copied_to_host;
  };
  PendingReduce pending_reduce_;
};

}  // namespace fsdp
