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

#include "ATen/core/Tensor.h"
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
Work send(const ProcessGroup& group, const at::Tensor& tensor, int dst, int tag = 0);
Work recv(const ProcessGroup& group, const at::Tensor& tensor, int src, int tag = 0);

}  // namespace comm
