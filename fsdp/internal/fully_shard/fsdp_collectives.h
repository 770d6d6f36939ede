// fully_shard's two collectives over a group of FSDPParams (PyTorch's
// _fsdp_collectives.py): one all-gather per group with copy-in and
// copy-out, and one reduce-scatter of the gradients straight into the
// shards. Private to //fsdp:fully_shard.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <optional>
#include <vector>

#include "comm/process_group.h"
#include "comm/work.h"
#include "fsdp/internal/fully_shard/fsdp_param.h"

namespace fsdp {
namespace internal {

// An all-gather in flight: the Work and the buffers it writes.
struct AllGatherResult {
  comm::Work work;
  // [W * total input numel], the common dtype (uint8 if mixed); undefined
  // when the pieces go straight into each all_gather_output().
  at::Tensor output;
  std::vector<int64_t> input_numels;  // per parameter, in output's dtype
};

// Copy-in of every parameter's all_gather_input() into one flat buffer and
// the all-gather of it over `group` (PyTorch's foreach_all_gather). Mixed
// parameter dtypes are gathered as bytes. Where comm gathers rank to rank
// (Gloo, CPU, 1 MiB or more: comm::all_gathers_rank_to_rank), each
// parameter is gathered straight into its all_gather_output() instead, in
// one Work, and there is no copy-in or copy-out: the one layout change
// FSDP2's flat buffer forces on the CPU, a copy of every gathered byte
// (RESULTS.md), is gone. When `shard_buffer` is defined
// and the inputs are its elements back to back, in order (the group's
// shards while sharded), it is the all-gather's input itself, without a
// copy-in: the shards must then not change until the all-gather is waited
// for (the Work holds the buffer).
AllGatherResult foreach_all_gather(const std::vector<FSDPParam*>& params,
                                   const comm::ProcessGroup& group,
                                   const at::Tensor& shard_buffer = at::Tensor());

// Copies each parameter's W pieces out of the flat buffer into its
// all_gather_output() (allocated here), with split_with_sizes_copy
// (PyTorch's foreach_all_gather_copy_out), on the current stream; nothing
// when they were gathered in place. The
// caller has waited for result.work (wait(), or on an accelerator
// wait_on_stream()) and keeps result.output until the copies are done.
void foreach_all_gather_copy_out(const AllGatherResult& result,
                                 const std::vector<FSDPParam*>& params,
                                 const comm::ProcessGroup& group);

// HSDP's step after the reduce-scatter: the all-reduce over the replicas,
// or (all_reduce false) keeping the result in *partial for the next one.
struct ReplicaReduction {
  bool all_reduce = true;
  at::Tensor* partial = nullptr;  // the group's; outlives the reduction
};

// A gradient reduction in flight: the reduce-scatter's Work and the
// buffers it reads and writes.
struct PendingReduce {
  comm::Work work;
  at::Tensor input;   // [W, total], the copy-in
  at::Tensor output;  // [total], this rank's padded shards, reduce dtype
  std::vector<FSDPParam*> params;
  comm::ProcessGroup replicate_group;
  ReplicaReduction replica;
  // On an accelerator: recorded on the reduce stream once the reduction
  // (and its accumulation into .grad) is queued there; waiting for it is a
  // stream wait, not a host one.
  std::optional<c10::Event> reduced;
};

// Starts reduce-scattering the unsharded gradients `grads` (one per entry
// of `params`, any dtype: cast to the reduce dtype in the copy-in) averaged
// over `group` (PyTorch's foreach_reduce: chunk-cat copy-in,
// reduce_scatter_tensor with AVG). A parameter sharded on another dim has
// its gradient chunked on that dim. The gradients may be freed once this
// returns.
//
// With `reduce_stream` (an accelerator; PyTorch's reduce_scatter_stream)
// the copy-in runs on the current stream; the reduce-scatter, HSDP's
// all-reduce and the accumulation into the shards' .grad are queued at
// once on `reduce_stream` after it, and `reduced` recorded: the host never
// waits. The copy-in stays allocated (in the result) until the current
// stream has waited for `reduced` (foreach_reduce_wait), so no
// record_stream is needed and memory use is deterministic.
PendingReduce foreach_reduce_start(const std::vector<FSDPParam*>& params,
                                   const std::vector<at::Tensor>& grads,
                                   const comm::ProcessGroup& group,
                                   const comm::ProcessGroup& replicate_group,
                                   const ReplicaReduction& replica,
                                   const std::optional<c10::Stream>& reduce_stream);
// Waits for the reduce-scatter (on an accelerator: the current stream
// waits for `reduced`) and frees the copy-in (output stays); once only:
// later calls return at once.
void foreach_reduce_wait(PendingReduce& pending);
// Waits for it; then (unless queued on the reduce stream already) HSDP
// (`replicate_group` not empty) all-reduces the shards averaged over the
// replicas (with `replica.all_reduce` false: adds them to *replica.partial
// instead, and nothing reaches .grad) and each rank's part is added to the
// shards' .grad (views of the output).
void foreach_reduce_finish(PendingReduce& pending);

}  // namespace internal
}  // namespace fsdp
