#include "fsdp/internal/fully_shard/fsdp_collectives.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/split_with_sizes_copy.h>
#include <c10/core/StreamGuard.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cstring>

#include "comm/collectives.h"
#include "fsdp/internal/comm_streams.h"

namespace fsdp {
namespace internal {
namespace {

// The dtype the group is gathered in: the parameters' when they share one,
// bytes otherwise (PyTorch gathers mixed dtypes as uint8 too), and bytes
// for float8, which the backends need not know.
c10::ScalarType gather_dtype(const std::vector<FSDPParam*>& params) {
  const c10::ScalarType first = params.front()->gather_dtype();
  for (const FSDPParam* p : params) {
    if (p->gather_dtype() != first || at::isFloat8Type(p->gather_dtype())) return at::kByte;
  }
  return first;
}

at::Tensor as_dtype(const at::Tensor& t, c10::ScalarType dtype) {
  if (t.scalar_type() == dtype) return t;
  return t.view(dtype);  // to bytes (only used for kByte)
}

// What a collective is handed: float8 as its bytes.
at::Tensor on_the_wire(const at::Tensor& t) {
  return at::isFloat8Type(t.scalar_type()) ? t.view(at::kByte) : t;
}

// The copies of the collectives' copy-in and copy-out move contiguous
// bytes between contiguous buffers. On the CPU they are memcpy's here:
// through ATen each would be a narrow, a view and a copy_ per parameter
// and rank (5 to 8 dispatched operators), which is the host overhead per
// unit that a C++ FSDP should not pay. Other devices go through ATen.
bool host_memcpy_ok(const at::Tensor& t) { return t.device().is_cpu() && t.is_contiguous(); }

char* bytes_of(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

// memcpy, except for nothing: an empty shard's data pointer may be null.
void copy_bytes(char* dst, const char* src, int64_t n) {
  if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n));
}

// Whether `inputs` are `buffer`'s elements back to back, in order, in its
// dtype: then it is the copy-in already.
bool inputs_are_buffer(const std::vector<at::Tensor>& inputs, const at::Tensor& buffer) {
  if (!buffer.defined()) return false;
  const char* next = bytes_of(buffer);
  int64_t numel = 0;
  for (const at::Tensor& in : inputs) {
    if (in.scalar_type() != buffer.scalar_type() || in.device() != buffer.device() ||
        !in.is_contiguous() || (in.numel() > 0 && bytes_of(in) != next)) {
      return false;
    }
    next += in.nbytes();
    numel += in.numel();
  }
  return numel == buffer.numel();
}

// HSDP: the shards, averaged over the shard group, averaged again over the
// replicas (PyTorch's all_reduce with AVG on the replicate group; without
// all-reduce, kept in *replica.partial instead, and no further); then
// each parameter's part of `output` into its shard's .grad. `on_stream`:
// queued on the current (reduce) stream, the all-reduce waited for there.
void add_to_sharded_grads(const at::Tensor& output, const std::vector<FSDPParam*>& params,
                          const comm::ProcessGroup& replicate_group,
                          const ReplicaReduction& replica, bool on_stream) {
  at::NoGradGuard no_grad;
  if (replicate_group.is_member() && replicate_group.size() > 1) {
    at::Tensor& partial = *replica.partial;
    if (!replica.all_reduce) {
      // Kept (summed) until an all-reduce; .grad does not see it yet.
      if (partial.defined()) {
        partial.add_(output);
      } else {
        partial = output;
      }
      return;
    }
    if (partial.defined()) {
      output.add_(partial);
      partial = at::Tensor();
    }
    comm::Work work = comm::all_reduce(replicate_group, output, comm::ReduceOp::kAvg);
    if (on_stream) {
      work.wait_on_stream();
    } else {
      work.wait();
    }
  }
  int64_t offset = 0;
  for (FSDPParam* p : params) {
    p->accumulate_sharded_grad(output, offset);
    offset += p->padded_shard_numel();
  }
}

}  // namespace

AllGatherResult foreach_all_gather(const std::vector<FSDPParam*>& params,
                                   const comm::ProcessGroup& group,
                                   const at::Tensor& shard_buffer) {
  at::NoGradGuard no_grad;
  AllGatherResult result;
  if (group.size() > 1) {
    int64_t bytes = 0;
    for (const FSDPParam* p : params) {
      bytes += static_cast<int64_t>(p->all_gather_output().nbytes());
    }
    if (comm::all_gathers_rank_to_rank(group, params.front()->device(), bytes)) {
      // Each parameter's pieces go straight into its all_gather_output: no
      // copy-in and no copy-out (result.output stays undefined).
      std::vector<at::Tensor> inputs, outputs;
      for (FSDPParam* p : params) {
        p->alloc_all_gather_output();
        inputs.push_back(on_the_wire(p->all_gather_input()));
        outputs.push_back(on_the_wire(p->all_gather_output()));
      }
      result.work = comm::all_gather_into_tensors(group, outputs, inputs);
      return result;
    }
  }
  const c10::ScalarType dtype = gather_dtype(params);
  std::vector<at::Tensor> inputs;
  int64_t total = 0;
  for (FSDPParam* p : params) {
    inputs.push_back(as_dtype(p->all_gather_input(), dtype));
    result.input_numels.push_back(inputs.back().numel());
    total += inputs.back().numel();
  }
  const at::TensorOptions options =
      at::TensorOptions().device(params.front()->device()).dtype(dtype);
  // Copy-in: one contiguous buffer of this rank's inputs (unless they are
  // one already).
  at::Tensor input;
  if (inputs_are_buffer(inputs, shard_buffer)) {
    input = shard_buffer;
  } else {
    input = at::empty({total}, options);
    if (std::all_of(inputs.begin(), inputs.end(), host_memcpy_ok)) {
      char* dst = bytes_of(input);
      for (const at::Tensor& in : inputs) {
        copy_bytes(dst, bytes_of(in), static_cast<int64_t>(in.nbytes()));
        dst += in.nbytes();
      }
    } else {
      at::cat_out(input, inputs, 0);
    }
  }
  if (group.size() == 1) {
    // Gathering over one rank is the copy-in itself.
    result.output = input;
    return result;
  }
  result.output = at::empty({total * group.size()}, options);
  result.work = comm::all_gather_into_tensor(group, result.output, input);
  return result;
}

void foreach_all_gather_copy_out(const AllGatherResult& result,
                                 const std::vector<FSDPParam*>& params,
                                 const comm::ProcessGroup& group) {
  if (!result.output.defined()) return;  // gathered in place
  at::NoGradGuard no_grad;
  const int64_t world = group.size();
  const c10::ScalarType dtype = result.output.scalar_type();
  for (FSDPParam* p : params) p->alloc_all_gather_output();
  const bool on_host = host_memcpy_ok(result.output) &&
                       std::all_of(params.begin(), params.end(), [](const FSDPParam* p) {
                         return host_memcpy_ok(p->all_gather_output());
                       });
  if (on_host) {
    // [W, total]: row r is rank r's inputs; each parameter's W pieces are
    // the same columns of every row.
    const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
    const int64_t total = result.output.numel() / world;
    const char* rows = bytes_of(result.output);
    int64_t column = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t piece = result.input_numels[i] * item;
      TORCH_INTERNAL_ASSERT(params[i]->all_gather_output().nbytes() ==
                            static_cast<size_t>(piece * world));
      char* out = bytes_of(params[i]->all_gather_output());
      for (int64_t r = 0; r < world; ++r) {
        copy_bytes(out + r * piece, rows + (r * total + column) * item, piece);
      }
      column += result.input_numels[i];
    }
  } else {
    std::vector<at::Tensor> outs;
    for (size_t i = 0; i < params.size(); ++i) {
      outs.push_back(as_dtype(params[i]->all_gather_output(), dtype).view({world, -1}));
      TORCH_INTERNAL_ASSERT(outs.back().size(1) == result.input_numels[i]);
    }
    // [W, total]: row r is rank r's inputs; split its columns per parameter.
    at::split_with_sizes_copy_out(outs, result.output.view({world, -1}), result.input_numels,
                                  /*dim=*/1);
  }
}

PendingReduce foreach_reduce_start(const std::vector<FSDPParam*>& params,
                                   const std::vector<at::Tensor>& grads,
                                   const comm::ProcessGroup& group,
                                   const comm::ProcessGroup& replicate_group,
                                   const ReplicaReduction& replica,
                                   const std::optional<c10::Stream>& reduce_stream) {
  at::NoGradGuard no_grad;
  const int64_t world = group.size();
  const c10::ScalarType dtype = params.front()->reduce_dtype();
  int64_t total = 0;
  for (FSDPParam* p : params) total += p->padded_shard_numel();
  const at::TensorOptions options = grads.front().options().dtype(dtype);
  // Copy-in (PyTorch's chunk_cat): row r of [W, total] holds, per parameter,
  // the rows of its gradient that rank r owns, zero-padded to the chunk.
  at::Tensor input = at::empty({world, total}, options);
  int64_t column = 0;
  const bool on_host = host_memcpy_ok(input) &&
                       std::all_of(grads.begin(), grads.end(),
                                   [&](const at::Tensor& g) {
                                     return host_memcpy_ok(g) && g.scalar_type() == dtype;
                                   }) &&
                       std::all_of(params.begin(), params.end(),
                                   [](const FSDPParam* p) { return p->shard_dim() == 0; });
  if (on_host) {
    // Rank r's part of a gradient is its dim-0 rows [r * chunk, (r + 1) *
    // chunk), contiguous; what the last ranks lack of a full chunk is
    // zero padding.
    const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
    char* rows = bytes_of(input);
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t n = params[i]->padded_shard_numel();
      const int64_t numel = grads[i].numel();
      const char* grad = bytes_of(grads[i]);
      for (int64_t r = 0; r < world; ++r) {
        const int64_t begin = std::min(r * n, numel);
        const int64_t have = std::min(n, numel - begin);
        char* dst = rows + (r * total + column) * item;
        copy_bytes(dst, grad + begin * item, have * item);
        if (n > have) std::memset(dst + have * item, 0, static_cast<size_t>((n - have) * item));
      }
      column += n;
    }
  }
  for (size_t i = 0; i < params.size() && !on_host; ++i) {
    const FSDPParam& p = *params[i];
    const int64_t n = p.padded_shard_numel();
    at::Tensor dst = input.narrow(1, column, n);
    at::Tensor flat = grads[i];
    if (p.shard_dim() != 0) {
      // Rank r's part is chunk r on the shard dim: stack the chunks on dim
      // 0 (PyTorch's _default_reduce_scatter_input_fn).
      flat = at::cat(flat.chunk(world, p.shard_dim()), 0);
    }
    flat = flat.reshape({-1});
    if (flat.scalar_type() != dtype) flat = flat.to(dtype);
    const int64_t pad = world * n - flat.numel();
    if (pad > 0) flat = at::constant_pad_nd(flat, {0, pad});
    dst.copy_(flat.view({world, n}));
    column += n;
  }
  PendingReduce pending;
  pending.input = input.view({-1});
  pending.params = params;
  pending.replicate_group = replicate_group;
  pending.replica = replica;
  std::optional<c10::StreamGuard> on_reduce_stream;
  if (reduce_stream) {
    // Everything from here on is queued on the reduce stream, after the
    // copy-in (the output is allocated there, and so are the .grad views
    // of it).
    wait_stream(*reduce_stream, current_stream(input.device()));
    on_reduce_stream.emplace(*reduce_stream);
  }
  if (world == 1) {
    // The average over one rank is the copy-in itself.
    pending.output = pending.input;
  } else {
    pending.output = at::empty({total}, options);
    pending.work =
        comm::reduce_scatter_tensor(group, pending.output, pending.input, comm::ReduceOp::kAvg);
  }
  if (reduce_stream) {
    pending.work.wait_on_stream();
    add_to_sharded_grads(pending.output, params, replicate_group, replica, /*on_stream=*/true);
    // Queued: nothing is left for foreach_reduce_finish but the wait.
    pending.output = at::Tensor();
    pending.params.clear();
    pending.reduced.emplace(reduce_stream->device_type());
    pending.reduced->record(*reduce_stream);
  }
  return pending;
}

void foreach_reduce_wait(PendingReduce& pending) {
  if (!pending.input.defined()) return;  // waited for already
  if (pending.reduced) {
    // The current stream waits for the reduce stream's work; the host goes on.
    pending.reduced->block(current_stream(pending.input.device()));
  } else {
    pending.work.wait();
  }
  // The Work holds the collective's tensors (Gloo's keeps its inputs and
  // outputs): dropping it is what frees the copy-in.
  pending.work = comm::Work();
  pending.input = at::Tensor();
}

void foreach_reduce_finish(PendingReduce& pending) {
  foreach_reduce_wait(pending);
  if (pending.output.defined()) {
    add_to_sharded_grads(pending.output, pending.params, pending.replicate_group, pending.replica,
                         /*on_stream=*/false);
  }
  pending.output = at::Tensor();
  pending.params.clear();
}

}  // namespace internal
}  // namespace fsdp
