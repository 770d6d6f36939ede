#include "comm/collectives.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/amin.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sum.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/internal/group_state.h"
#include "comm/internal/work_state.h"

namespace comm {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "unknown";
}

namespace {

// The dtypes c10d's Gloo and NCCL backends both move and reduce (2.x: Gloo
// reduces bfloat16 and half too; 1.13's could not, which comm once worked
// around). Bool only travels (gather, broadcast).
bool is_supported(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
    case at::kBool: return true;
    default: return false;
  }
}

const internal::GroupState& member_state(const ProcessGroup& group, const char* op) {
  const auto& state = group.state();
  TORCH_CHECK(state && state->pg, "comm::", op, ": this process (world rank ",
              state ? state->global_rank : -1, ") is not a member of group '",
              state ? state->name : "",
              "': expected a group returned to a member (is_member() true)");
  return *state;
}

// c10d's flat collectives by whichever name this LibTorch has: 2.15 calls
// them all_gather_single / reduce_scatter_single / all_to_all_single (the
// old names still exist there but are deprecated, an error under -Werror);
// 2.11 has only _allgather_base / _reduce_scatter_base / alltoall_base. A
// requires-expression picks at compile time; the branch not taken is never
// instantiated, so neither name is a hard dependency.
template <typename Group>
c10::intrusive_ptr<c10d::Work> all_gather_base(Group& pg, at::Tensor& out, at::Tensor& in) {
  if constexpr (requires { pg.all_gather_single(out, in); }) {
    return pg.all_gather_single(out, in);
  } else {
    return pg._allgather_base(out, in);
  }
}

template <typename Group>
c10::intrusive_ptr<c10d::Work> reduce_scatter_base(Group& pg, at::Tensor& out, at::Tensor& in,
                                                   const c10d::ReduceScatterOptions& options) {
  if constexpr (requires { pg.reduce_scatter_single(out, in, options); }) {
    return pg.reduce_scatter_single(out, in, options);
  } else {
    return pg._reduce_scatter_base(out, in, options);
  }
}

template <typename Group>
c10::intrusive_ptr<c10d::Work> all_to_all_base(Group& pg, at::Tensor& out, at::Tensor& in,
                                               std::vector<int64_t>& splits) {
  if constexpr (requires { pg.all_to_all_single(out, in, splits, splits); }) {
    return pg.all_to_all_single(out, in, splits, splits);
  } else {
    return pg.alltoall_base(out, in, splits, splits);
  }
}

// True when `t`'s collective runs on NCCL: backend "nccl", or a CUDA tensor
// under "cpu:gloo,cuda:nccl".
bool on_nccl(const internal::GroupState& state, const at::Tensor& t) {
  return state.backend == "nccl" || (state.backend == kGlooCpuNcclCuda && t.is_cuda());
}

void check_flat(const internal::GroupState& state, const char* op, const char* arg,
                const at::Tensor& t) {
  TORCH_CHECK(t.defined(), "comm::", op, ": ", arg,
              " is undefined: expected a contiguous 1-D tensor");
  TORCH_CHECK(t.dim() == 1, "comm::", op, ": ", arg, " has shape ", t.sizes(),
              ": expected a 1-D (flat) tensor");
  TORCH_CHECK(t.is_contiguous(), "comm::", op, ": ", arg, " is not contiguous (stride ",
              t.strides(), "): expected a contiguous tensor");
  if (state.backend == "nccl") {
    TORCH_CHECK(t.device().is_cuda(), "comm::", op, ": ", arg, " is on ", t.device(),
                ": expected a CUDA tensor (backend nccl)");
  } else {
    TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), "comm::", op, ": ", arg, " is on ",
                t.device(), ": expected a CPU or CUDA tensor (backend ", state.backend, ")");
  }
  TORCH_CHECK(is_supported(t.scalar_type()), "comm::", op, ": ", arg, " has dtype ",
              t.scalar_type(),
              ": expected float32, float64, float16, bfloat16, bool or an "
              "integer type (int8, uint8, int32, int64)");
}

void check_reducible(const char* op, const at::Tensor& t, ReduceOp reduce) {
  TORCH_CHECK(t.scalar_type() != at::kBool, "comm::", op,
              ": dtype Bool cannot be reduced: expected a numeric dtype");
  TORCH_CHECK(reduce != ReduceOp::kAvg || at::isFloatingType(t.scalar_type()), "comm::", op,
              ": ReduceOp avg on dtype ", t.scalar_type(),
              ": expected a floating-point dtype (an integer average would "
              "truncate)");
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
    case ReduceOp::kAvg: return c10d::ReduceOp::AVG;
    case ReduceOp::kSum: return c10d::ReduceOp::SUM;
  }
  return c10d::ReduceOp::SUM;
}

Work make_work(const internal::GroupState& state, const char* op,
               std::vector<c10::intrusive_ptr<c10d::Work>> works, std::function<void()> finish,
               std::vector<at::Tensor> keep, const char* detail_key = nullptr,
               const char* detail_text = nullptr, int detail_int = 0, bool rank_to_rank = false) {
  auto ws = std::make_shared<internal::WorkState>();
  ws->op = op;
  ws->group_name = state.name;
  ws->rank = state.rank;
  ws->size = state.size;
  ws->detail_key = detail_key;
  ws->detail_text = detail_text;
  ws->detail_int = detail_int;
  ws->stream_ordered = !keep.empty() && on_nccl(state, keep.front());
  ws->works = std::move(works);
  ws->finish = std::move(finish);
  ws->keep_alive = std::move(keep);
  ws->default_timeout = state.timeout;
  ws->completes_only_by_waiting = rank_to_rank;
  return Work(std::move(ws));
}

// Gloo's all-gather (c10d's allgather) stages every call through a flat
// buffer it allocates, and copies out of it. For large tensors on the CPU,
// sends and receives do less: each rank sends its input to every other rank
// and receives theirs straight into place, the same bytes on the wire
// ((W-1)/W of the output per rank) without the staging copy or its page
// faults (comm_bench's all_gather rows: 0.6-0.8x c10d's time from 1 MiB).
// Below that the messages' own costs win, so small gathers keep the
// collective.
constexpr int64_t kDirectAllGatherMinBytes = int64_t{1} << 20;

// The tag of comm's own sends and receives; comm::send/recv take tags below it.
constexpr int kInternalTag = kMaxTag + 1;

bool gathers_directly(const internal::GroupState& state, c10::Device device, int64_t bytes) {
  return state.backend != "nccl" && device.is_cpu() && bytes >= kDirectAllGatherMinBytes;
}

// Tensors under this size travel together: each message costs a c10d Work,
// a wake-up and a turn of Gloo's loop, which for a bias or a norm's weight
// is more than its bytes (comm_bench: block_all_gather).
constexpr int64_t kPackBelowBytes = int64_t{64} << 10;

struct DirectAllGather {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::function<void()> finish;  // unpacks the small tensors; may be empty
};

// outputs[k][r*n_k : (r+1)*n_k] (a contiguous CPU view, a piece) receives
// inputs[k] of group rank r. Large inputs are sent as they are and received
// straight into place; the small ones are packed into one message per peer
// and unpacked in finish. The ranks take turns around the ring (at step s,
// send to rank + s and receive from rank - s), so no peer is sent
// everything at once; a rank's own pieces are copies.
DirectAllGather start_direct_all_gather(const internal::GroupState& state,
                                        const std::vector<at::Tensor>& outputs,
                                        const std::vector<at::Tensor>& inputs) {
  const int world = state.size, rank = state.rank;
  std::vector<std::vector<at::Tensor>> pieces(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    for (size_t k = 0; k < inputs.size(); ++k) {
      const int64_t n = inputs[k].numel();
      pieces[static_cast<size_t>(r)].push_back(outputs[k].narrow(0, r * n, n));
    }
  }
  std::vector<size_t> large, small;
  int64_t small_bytes = 0;
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (static_cast<int64_t>(inputs[k].nbytes()) < kPackBelowBytes) {
      small.push_back(k);
      small_bytes += static_cast<int64_t>(inputs[k].nbytes());
    } else {
      large.push_back(k);
    }
  }
  if (small.size() < 2) {
    large.insert(large.end(), small.begin(), small.end());
    small.clear();
  }
  at::Tensor packed;
  std::vector<at::Tensor> received(static_cast<size_t>(world));
  if (!small.empty()) {
    packed = at::empty({small_bytes}, inputs.front().options().dtype(at::kByte));
    char* at = static_cast<char*>(packed.data_ptr());
    for (size_t k : small) {
      if (inputs[k].nbytes() > 0) std::memcpy(at, inputs[k].data_ptr(), inputs[k].nbytes());
      at += inputs[k].nbytes();
    }
  }
  DirectAllGather result;
  for (int step = 1; step < world; ++step) {
    const int from = (rank - step + world) % world;
    const int to = (rank + step) % world;
    for (size_t k : large) {
      std::vector<at::Tensor> into{pieces[static_cast<size_t>(from)][k]};
      result.works.push_back(state.pg->recv(into, from, kInternalTag));
    }
    if (!small.empty()) {
      received[static_cast<size_t>(from)] = at::empty_like(packed);
      std::vector<at::Tensor> into{received[static_cast<size_t>(from)]};
      result.works.push_back(state.pg->recv(into, from, kInternalTag));
    }
    for (size_t k : large) {
      std::vector<at::Tensor> sent{inputs[k]};
      result.works.push_back(state.pg->send(sent, to, kInternalTag));
    }
    if (!small.empty()) {
      std::vector<at::Tensor> sent{packed};
      result.works.push_back(state.pg->send(sent, to, kInternalTag));
    }
  }
  for (size_t k = 0; k < inputs.size(); ++k) {
    pieces[static_cast<size_t>(rank)][k].copy_(inputs[k]);
  }
  if (!small.empty()) {
    result.finish = [pieces, small, received = std::move(received), rank]() {
      for (size_t r = 0; r < received.size(); ++r) {
        if (static_cast<int>(r) == rank) continue;
        const char* at = static_cast<const char*>(received[r].data_ptr());
        for (size_t k : small) {
          const at::Tensor& piece = pieces[r][k];
          if (piece.nbytes() > 0) std::memcpy(piece.data_ptr(), at, piece.nbytes());
          at += piece.nbytes();
        }
      }
    };
  }
  return result;
}

// `output` and `input` of an all-gather; `which` names the pair in a list.
void check_all_gather(const internal::GroupState& state, const char* op, const at::Tensor& output,
                      const at::Tensor& input, const std::string& which = "") {
  check_flat(state, op, ("input" + which).c_str(), input);
  check_flat(state, op, ("output" + which).c_str(), output);
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "comm::", op, ": output", which,
              " has dtype ", output.scalar_type(), ": expected the input's dtype ",
              input.scalar_type());
  const int64_t n = input.numel();
  TORCH_CHECK(output.numel() == n * state.size, "comm::", op, ": output", which, " has ",
              output.numel(), " elements: expected group size ", state.size, " x input's ", n,
              " = ", n * state.size);
}

}  // namespace

Work all_gather_into_tensor(const ProcessGroup& group, const at::Tensor& output,
                            const at::Tensor& input) {
  constexpr const char* kOp = "all_gather_into_tensor";
  const auto& state = member_state(group, kOp);
  check_all_gather(state, kOp, output, input);
  if (gathers_directly(state, output.device(), static_cast<int64_t>(output.nbytes()))) {
    DirectAllGather direct = start_direct_all_gather(state, {output}, {input});
    return make_work(state, kOp, std::move(direct.works), std::move(direct.finish), {output, input},
                     nullptr, nullptr, 0, /*rank_to_rank=*/true);
  }
  at::Tensor out = output;
  at::Tensor in = input;
  auto work = all_gather_base(*state.pg, out, in);
  return make_work(state, kOp, {std::move(work)}, nullptr, {output, input});
}

Work all_gather_into_tensors(const ProcessGroup& group, const std::vector<at::Tensor>& outputs,
                             const std::vector<at::Tensor>& inputs) {
  constexpr const char* kOp = "all_gather_into_tensors";
  const auto& state = member_state(group, kOp);
  TORCH_CHECK(outputs.size() == inputs.size(), "comm::", kOp, ": ", outputs.size(), " outputs for ",
              inputs.size(), " inputs: expected one output per input");
  int64_t bytes = 0;
  bool all_cpu = true;
  for (size_t k = 0; k < inputs.size(); ++k) {
    check_all_gather(state, kOp, outputs[k], inputs[k], "s[" + std::to_string(k) + "]");
    bytes += static_cast<int64_t>(outputs[k].nbytes());
    all_cpu = all_cpu && outputs[k].device().is_cpu();
  }
  if (inputs.empty()) return Work();
  std::vector<at::Tensor> keep = outputs;
  keep.insert(keep.end(), inputs.begin(), inputs.end());
  if (all_cpu && gathers_directly(state, outputs.front().device(), bytes)) {
    DirectAllGather direct = start_direct_all_gather(state, outputs, inputs);
    return make_work(state, kOp, std::move(direct.works), std::move(direct.finish), std::move(keep),
                     nullptr, nullptr, 0, /*rank_to_rank=*/true);
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (size_t k = 0; k < inputs.size(); ++k) {
    at::Tensor out = outputs[k];
    at::Tensor in = inputs[k];
    works.push_back(all_gather_base(*state.pg, out, in));
  }
  return make_work(state, kOp, std::move(works), nullptr, std::move(keep));
}

bool all_gathers_rank_to_rank(const ProcessGroup& group, c10::Device device, int64_t bytes) {
  const auto& state = group.state();
  return state && state->pg && gathers_directly(*state, device, bytes);
}

Work reduce_scatter_tensor(const ProcessGroup& group, const at::Tensor& output,
                           const at::Tensor& input, ReduceOp op) {
  constexpr const char* kOp = "reduce_scatter_tensor";
  const auto& state = member_state(group, kOp);
  check_flat(state, kOp, "input", input);
  check_flat(state, kOp, "output", output);
  check_reducible(kOp, input, op);
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "comm::", kOp, ": output has dtype ",
              output.scalar_type(), ": expected the input's dtype ", input.scalar_type());
  const int64_t n = output.numel();
  const int world = state.size;
  TORCH_CHECK(input.numel() == n * world, "comm::", kOp, ": input has ", input.numel(),
              " elements: expected group size ", world, " x output's ", n, " = ", n * world,
              " (pad the flat tensor to a multiple of the group size)");
  if (on_nccl(state, input)) {
    at::Tensor out = output;
    at::Tensor in = input;
    c10d::ReduceScatterOptions options;
    options.reduceOp = to_c10d(op);
    auto work = reduce_scatter_base(*state.pg, out, in, options);
    return make_work(state, kOp, {std::move(work)}, nullptr, {output, input}, "op",
                     reduce_op_name(op));
  }
  // Gloo: not c10d's reduce_scatter_single. On 2.15 its Work never reports
  // isCompleted() before wait() is called (a 4-rank poll in
  // flat_param_test's AsyncReduceIsBitIdenticalToBlocking spun for 60 s),
  // and the FSDP runtime advances reductions without blocking. Built as an
  // all-to-all (rank r receives everyone's chunk r: (world-1)/world of the
  // input per rank, what a ring reduce-scatter moves) followed by a local
  // reduction over the `world` received chunks; comm_bench compares it
  // with c10d's.
  at::Tensor received = at::empty({n * world}, input.options());
  at::Tensor in = input;
  std::vector<int64_t> even_splits;  // empty = equal splits
  auto work = all_to_all_base(*state.pg, received, in, even_splits);
  auto finish = [received, output, op, world, n]() {
    at::Tensor chunks = received.view({world, n});
    // Reduce bfloat16/half in float32: one rounding at the end instead of
    // one per rank.
    if (output.scalar_type() == at::kBFloat16 || output.scalar_type() == at::kHalf) {
      chunks = chunks.to(at::kFloat);
      at::Tensor result;
      switch (op) {
        case ReduceOp::kSum: result = chunks.sum(0); break;
        case ReduceOp::kAvg: result = chunks.sum(0).div_(world); break;
        case ReduceOp::kMax: result = chunks.amax(0); break;
        case ReduceOp::kMin: result = chunks.amin(0); break;
      }
      output.copy_(result);
      return;
    }
    // Straight into the caller's tensor: no temporary on the hot path.
    at::Tensor out = output;
    switch (op) {
      case ReduceOp::kSum: at::sum_out(out, chunks, 0); break;
      case ReduceOp::kAvg: at::sum_out(out, chunks, 0).div_(world); break;
      case ReduceOp::kMax: at::amax_out(out, chunks, 0); break;
      case ReduceOp::kMin: at::amin_out(out, chunks, 0); break;
    }
  };
  return make_work(state, kOp, {std::move(work)}, std::move(finish), {output, input}, "op",
                   reduce_op_name(op));
}

Work all_reduce(const ProcessGroup& group, const at::Tensor& tensor, ReduceOp op) {
  constexpr const char* kOp = "all_reduce";
  const auto& state = member_state(group, kOp);
  check_flat(state, kOp, "tensor", tensor);
  check_reducible(kOp, tensor, op);
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = to_c10d(op);
  auto work = state.pg->allreduce(tensors, options);
  return make_work(state, kOp, {std::move(work)}, nullptr, {tensor}, "op", reduce_op_name(op));
}

Work broadcast(const ProcessGroup& group, const at::Tensor& tensor, int root) {
  constexpr const char* kOp = "broadcast";
  const auto& state = member_state(group, kOp);
  check_flat(state, kOp, "tensor", tensor);
  TORCH_CHECK(root >= 0 && root < state.size, "comm::", kOp, ": root=", root,
              ": expected a rank of the group in [0, ", state.size,
              ") (a group rank, not a world rank)");
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  auto work = state.pg->broadcast(tensors, options);
  return make_work(state, kOp, {std::move(work)}, nullptr, {tensor}, "root", nullptr, root);
}

namespace {

// send (to `peer`) or recv (from `peer`): the checks and the Work are the
// same; the argument is named as each function names it.
Work point_to_point(const ProcessGroup& group, const at::Tensor& tensor, int peer, int tag,
                    bool sending) {
  const char* op = sending ? "send" : "recv";
  const char* arg = sending ? "dst" : "src";
  const auto& state = member_state(group, op);
  check_flat(state, op, "tensor", tensor);
  TORCH_CHECK(tag >= 0 && tag <= kMaxTag, "comm::", op, ": tag=", tag,
              ": expected 0 <= tag <= ", kMaxTag, " (higher tags are comm's own)");
  TORCH_CHECK(peer >= 0 && peer < state.size, "comm::", op, ": ", arg, "=", peer,
              ": expected a rank of the group in [0, ", state.size,
              ") (a group rank, not a world rank)");
  TORCH_CHECK(peer != state.rank, "comm::", op, ": ", arg, "=", peer,
              " is this rank: expected another rank of the group");
  std::vector<at::Tensor> tensors{tensor};
  auto work = sending ? state.pg->send(tensors, peer, tag) : state.pg->recv(tensors, peer, tag);
  return make_work(state, op, {std::move(work)}, nullptr, {tensor}, arg, nullptr, peer,
                   /*rank_to_rank=*/true);
}

}  // namespace

Work send(const ProcessGroup& group, const at::Tensor& tensor, int dst, int tag) {
  return point_to_point(group, tensor, dst, tag, /*sending=*/true);
}

Work recv(const ProcessGroup& group, const at::Tensor& tensor, int src, int tag) {
  return point_to_point(group, tensor, src, tag, /*sending=*/false);
}

Work barrier(const ProcessGroup& group) {
  constexpr const char* kOp = "barrier";
  const auto& state = member_state(group, kOp);
  auto work = state.pg->barrier();
  return make_work(state, kOp, {std::move(work)}, nullptr, {});
}

}  // namespace comm
