// The collectives fsdp needs, over a comm::ProcessGroup. Each starts the
// operation and returns a Work; call .wait() before reading the output.
//
// Arguments: every tensor must be a contiguous 1-D CPU tensor (flat
// parameter shards); inputs and outputs of one call share a dtype. float32,
// float64, float16 and bfloat16 are supported, plus integer types for
// broadcast/all-gather/all-reduce. Violations throw c10::Error naming the
// argument, its value and the expectation, before anything is sent.
//
// The tensors must stay alive and untouched until wait() returns (the Work
// also keeps them referenced).
#pragma once

#include <vector>

#include "ATen/core/Tensor.h"
#include "c10/core/Device.h"
#include "comm/process_group.h"
#include "comm/work.h"

namespace comm {

enum class ReduceOp {
  kSum,
  kAvg,  // sum / group size (c10d's ReduceOp::AVG)
  kMax,
  kMin,
};

const char* reduce_op_name(ReduceOp op);

// output[r*n : (r+1)*n] = input of rank r.   output: [size*n], input: [n].
Work all_gather_into_tensor(const ProcessGroup& group, const at::Tensor& output,
                            const at::Tensor& input);

// Several all_gather_into_tensor at once (torch.distributed's
// all_gather_into_tensor_coalesced): outputs[k][r*n_k : (r+1)*n_k] = inputs[k]
// of rank r, n_k = inputs[k].numel(). Each pair (outputs[k], inputs[k]) is
// checked as all_gather_into_tensor checks its arguments; pairs may differ in
// dtype and size. On Gloo, CPU tensors of 1 MiB or more in all go rank to
// rank straight into the outputs (no staging buffer, no copy-out); other
// calls are one collective per pair, in order.
Work all_gather_into_tensors(const ProcessGroup& group, const std::vector<at::Tensor>& outputs,
                             const std::vector<at::Tensor>& inputs);
// Whether all_gather_into_tensors over `group` of tensors on `device`,
// `bytes` of output in all, goes rank to rank. When it does not, it is one
// collective per tensor: a caller with many small tensors should flatten
// them into one all_gather_into_tensor instead.
bool all_gathers_rank_to_rank(const ProcessGroup& group, c10::Device device, int64_t bytes);

// output = op over ranks r of input_r[rank*n : (rank+1)*n].
// output: [n], input: [size*n]. Callers pad the flat tensor to a multiple of
// the group size (as FlatParameter does).
Work reduce_scatter_tensor(const ProcessGroup& group, const at::Tensor& output,
                           const at::Tensor& input, ReduceOp op = ReduceOp::kSum);

// In place: tensor = op over all ranks of tensor.
Work all_reduce(const ProcessGroup& group, const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);

// In place: every rank's tensor becomes root's. `root` is a rank *within
// `group`* (0 <= root < group.size()), not a world rank.
Work broadcast(const ProcessGroup& group, const at::Tensor& tensor, int root = 0);

Work barrier(const ProcessGroup& group);

// Point to point (torch.distributed.isend / irecv): `tensor` goes to rank
// `dst`, which receives it into a tensor of the same dtype and numel with
// recv(group, t, src=this rank). Ranks are group ranks, and neither may be
// the caller's own. Pairs match in the order they were posted (`tag` keeps
// interleaved streams between the same two ranks apart). Like every
// collective here, wait() is bounded by the group's timeout.
// Tags run from 0 to kMaxTag; higher ones are comm's own.
inline constexpr int kMaxTag = (1 << 30) - 1;
Work send(const ProcessGroup& group, const at::Tensor& tensor, int dst, int tag = 0);
Work recv(const ProcessGroup& group, const at::Tensor& tensor, int src, int tag = 0);

}  // namespace comm
