// The parameters of one fully_shard call, gathered and reduced together
// (PyTorch's FSDPParamGroup, _fsdp_param_group.py). Private to
// //fsdp:fully_shard.
//
//   unshard(async)        start the all-gather (over the post-forward group
//                         when resharded to it after forward)
//   wait_for_unshard()    copy-out; the module's names point at the
//                         unsharded parameters
//   post_forward()        reshard (to the post-forward group for an int
//                         reshard_after_forward) unless told to keep them
//   post_backward()       start reduce-scattering the unsharded gradients
//                         (or keep accumulating them without gradient
//                         sync), then reshard
//   finish_gradient_reduction()
//                         wait for that reduction (HSDP: then all-reduce)
//                         and add it to the shards' .grad; the root's
//                         end-of-backward callback calls it when
//                         is_last_backward, the group's next post_backward
//                         always (before starting its own)
//   reshard()             back to the shards
//   materialize(device)   meta shards to real ones (fsdp::to_empty)
#pragma once

#include <c10/core/Event.h>
#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/process_group.h"
#include "fsdp/internal/comm_streams.h"
#include "fsdp/internal/fully_shard/fsdp_collectives.h"
#include "fsdp/internal/fully_shard/fsdp_param.h"

namespace fsdp {
namespace internal {

// What the groups of one root's tree share (PyTorch's FSDPCommContext):
// on an accelerator, FSDP1's process-wide all-gather ("unshard") and
// reduce-scatter ("reduce") streams, and the last all-gather copied out,
// whose buffers are dropped only once the next all-gather's stream has
// waited for `copied_out` (instead of record_stream: memory stays
// deterministic). On the CPU, and for one-rank groups (which send
// nothing), no streams: everything runs as the caller's code does.
struct FSDPCommContext {
  std::optional<CommStreams> streams;
  struct CopiedOut {
    AllGatherResult result;
    c10::Event copied_out;
  };
  std::optional<CopiedOut> last_all_gather;
};

class FSDPParamGroup {
 public:
  // `module` is held weakly. `replicate_group`: HSDP's replicate group
  // (empty otherwise). `post_forward_group`: the smaller group of an int
  // reshard_after_forward (empty otherwise).
  FSDPParamGroup(const std::shared_ptr<torch::nn::Module>& module,
                 std::vector<std::unique_ptr<FSDPParam>> params, comm::ProcessGroup group,
                 comm::ProcessGroup replicate_group, comm::ProcessGroup post_forward_group,
                 bool reshard_after_forward);

  const std::vector<std::unique_ptr<FSDPParam>>& params() const { return params_; }
  const comm::ProcessGroup& group() const { return group_; }
  const comm::ProcessGroup& replicate_group() const { return replicate_group_; }
  // The compute device (where the unsharded parameters live).
  const c10::Device& device() const { return params_.front()->device(); }
  // The root's lazy initialisation shares one context with its tree.
  void set_comm_context(std::shared_ptr<FSDPCommContext> ctx) { comm_ctx_ = std::move(ctx); }
  ShardedState state() const { return params_.front()->state(); }
  // Whether the shards are meta tensors (a module sharded on the meta
  // device, all of its parameters or none: fully_shard checks).
  bool is_meta() const { return params_.front()->is_meta(); }
  // Allocates every shard on `device` (the CPU when offloaded), in one
  // buffer when they can share one (as place_shards_back_to_back), padding
  // zeroed, rows uninitialised, and points the module at the new shards.
  // Only while is_meta().
  void materialize(const c10::Device& device);
  // Throws, naming `unit` and the parameters, while is_meta(): a meta
  // module must be materialised (fsdp::to_empty) before it is gathered.
  void check_materialized(const std::string& unit) const;
  bool unshard_pending() const { return pending_.has_value(); }

  void unshard(bool async);
  void wait_for_unshard();
  void reshard();
  void post_forward();
  // Starts reducing (or, without gradient sync, keeps) the gradients;
  // reshards when reshard_after_backward.
  void post_backward();
  void finish_gradient_reduction();
  bool reduction_pending() const { return pending_reduce_.has_value(); }
  // Waits for the reduce-scatter in flight and frees its copy-in; the
  // result still lands in .grad at finish_gradient_reduction.
  void wait_for_reduce_scatter();
  // Waits out a reduction still in flight (its error dropped).
  ~FSDPParamGroup();

  bool reshard_after_forward() const { return reshard_after_forward_; }
  void set_reshard_after_forward(bool value) { reshard_after_forward_ = value; }
  void set_reshard_after_backward(bool value) { reshard_after_backward_ = value; }
  void set_requires_gradient_sync(bool value) { requires_gradient_sync_ = value; }
  void set_requires_all_reduce(bool value) { requires_all_reduce_ = value; }

 private:
  std::vector<FSDPParam*> raw_params() const;
  // Points the module's names at each parameter's module_tensor().
  void update_module_tensors();
  // Moves the padded shards, in order, into shard_buffer_ when they can
  // share one (see shard_buffer_).
  void place_shards_back_to_back();
  // Whether an all-gather over `group` / this group's gradient reduction
  // runs on the context's streams (an accelerator, something to send).
  // Float8 all-gather: the shards' amaxes all-reduced (MAX) over the shard
  // group in one collective, and each float8 parameter's shard cast with
  // its whole's (waited for on the current stream when `on_stream`).
  void cast_float8_inputs(bool on_stream);
  bool gathers_on_stream(const comm::ProcessGroup& group) const;
  bool reduces_on_stream() const;

  std::weak_ptr<torch::nn::Module> module_;
  std::vector<std::unique_ptr<FSDPParam>> params_;
  comm::ProcessGroup group_;
  comm::ProcessGroup replicate_group_;
  comm::ProcessGroup post_forward_group_;
  bool reshard_after_forward_;
  bool reshard_after_backward_ = true;
  bool requires_gradient_sync_ = true;
  bool requires_all_reduce_ = true;
  // HSDP without all-reduce: the sum of the shard-group averages not yet
  // all-reduced (PyTorch's _partial_reduce_output), added in before the
  // next all-reduce.
  at::Tensor partial_reduce_output_;
  std::optional<AllGatherResult> pending_;
  // This rank's padded shards back to back (each FSDPParam's padded shard
  // and sharded parameter are views of it), when they share a dtype that
  // is also the gather dtype and live on the compute device; undefined
  // otherwise (mixed dtypes, param_dtype casts, CPU offload). Sharded, it
  // is the all-gather's input as it is: no copy-in.
  at::Tensor shard_buffer_;
  // The group the pending all-gather runs over.
  comm::ProcessGroup pending_group_;
  std::optional<PendingReduce> pending_reduce_;
  std::shared_ptr<FSDPCommContext> comm_ctx_ = std::make_shared<FSDPCommContext>();
};

}  // namespace internal
}  // namespace fsdp
