// fully_shard's two collectives over a group of FSDPParams (PyTorch's
// _fsdp_collectives.py): one all-gather per group with copy-in and
// copy-out, and one reduce-scatter of the gradients straight into the
// shards. Private to //fsdp:fully_shard.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "comm/process_group.h"
#include "comm/work.h"
#include "fsdp/internal/fully_shard/fsdp_param.h"

namespace fsdp {
namespace internal {

// An all-gather in flight: the Work and the buffers it writes.
struct AllGatherResult {
  comm::Work work;
  at::Tensor output;                  // [W * total input numel], the common dtype (uint8 if mixed)
  std::vector<int64_t> input_numels;  // per parameter, in output's dtype
};

// Copy-in of every parameter's all_gather_input() into one flat buffer and
// the all-gather of it over `group` (PyTorch's foreach_all_gather). Mixed
// parameter dtypes are gathered as bytes.
AllGatherResult foreach_all_gather(const std::vector<FSDPParam*>& params,
                                   const comm::ProcessGroup& group);

// Waits and copies each parameter's W pieces out of the flat buffer into
// its all_gather_output() (allocated here), with split_with_sizes_copy
// (PyTorch's foreach_all_gather_copy_out).
void foreach_all_gather_copy_out(AllGatherResult& result, const std::vector<FSDPParam*>& params,
                                 const comm::ProcessGroup& group);

// Reduce-scatters the unsharded gradients `grads` (one per entry of
// `params`, all in the reduce dtype) averaged over `group`, and adds each
// rank's rows to the shards' .grad (PyTorch's foreach_reduce: chunk-cat
// copy-in, reduce_scatter_tensor with AVG, views of the output). Blocks
// until done. HSDP: `replicate_group` (empty otherwise) then averages the
// reduce-scattered shards with an all-reduce before they are added. A
// parameter sharded on another dim has its gradient chunked on that dim.
void foreach_reduce(const std::vector<FSDPParam*>& params, const std::vector<at::Tensor>& grads,
                    const comm::ProcessGroup& group, const comm::ProcessGroup& replicate_group);

}  // namespace internal
}  // namespace fsdp
