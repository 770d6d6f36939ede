#include "state_dict/fsdp/fsdp_full_checkpoint.h"

#include <algorithm>
#include <set>
#include <utility>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/collectives.h"
#include "state_dict/checkpoint.h"
#include "formats/hf/hf_checkpoint_files.h"
#include "state_dict/hf_checkpoint.h"

namespace state_dict {
namespace {

// One row per tensor of the table every rank contributes: the numel of the
// piece it sends (0 for none), a fingerprint of the tensor's name, dtype and
// shape (so that rank 0 never writes pieces of different tensors as one),
// and the piece's offset, or kBadRow when the rank cannot send its piece
// (more than one).
constexpr int64_t kRowWidth = 3;
constexpr int64_t kBadRow = -1;

// FNV-1a over the name, dtype and shape: the same on every rank, unlike
// std::hash and absl::Hash, which may differ between processes.
int64_t Fingerprint(const std::string& name, const ShardedTensor& t) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const void* data, size_t size) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < size; ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  };
  mix(name.data(), name.size());
  const int dtype = static_cast<int>(t.dtype);
  mix(&dtype, sizeof(dtype));
  for (int64_t d : t.global_shape) mix(&d, sizeof(d));
  return static_cast<int64_t>(h >> 2);
}

// Who sends what, the same on every rank (computed from the gathered
// table): per tensor, the ranks whose pieces rank 0 receives, in rank order.
// A piece that ranks before it already cover (replicas) is not sent.
struct Plan {
  std::vector<std::vector<int>> senders;  // per tensor
  std::vector<FlatRange> ranges;          // per tensor and rank: [i * world + r]
  int world = 1;

  FlatRange range(size_t tensor, int rank) const {
    return ranges[tensor * static_cast<size_t>(world) + static_cast<size_t>(rank)];
  }
};

// The contiguous piece `rank` sends of `t`, or none. Replicated entries come
// from rank 0 alone, nothing from a replica of another shard group.
absl::StatusOr<std::optional<ShardPiece>> PieceToSend(const FsdpModelStateDict& state,
                                                      const std::set<std::string>& replicated,
                                                      const std::string& name,
                                                      const ShardedTensor& t) {
  if (state.shard_is_replica) return std::nullopt;
  if (replicated.count(name) > 0 && state.rank != 0) return std::nullopt;
  std::vector<const ShardPiece*> pieces;
  for (const ShardPiece& p : t.pieces) {
    if (p.range.numel > 0) pieces.push_back(&p);
  }
  if (pieces.empty()) return std::nullopt;
  if (pieces.size() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "' has ", pieces.size(), " pieces on rank ", state.rank,
                     ": expected at most one (FSDP's SHARDED state dict has one per rank)"));
  }
  return *pieces.front();
}

absl::StatusOr<Plan> MakePlan(const ShardedStateDict& sharded, const at::Tensor& table, int world) {
  const int64_t count = static_cast<int64_t>(sharded.size());
  auto row = table.accessor<int64_t, 3>();  // [rank][tensor][field]
  Plan plan;
  plan.world = world;
  plan.senders.resize(sharded.size());
  plan.ranges.resize(sharded.size() * static_cast<size_t>(world));
  for (int64_t i = 0; i < count; ++i) {
    const std::string& name = sharded[static_cast<size_t>(i)].key();
    const int64_t numel = sharded[static_cast<size_t>(i)].value().global_numel();
    std::vector<FlatRange> covered;  // sorted, disjoint
    for (int r = 0; r < world; ++r) {
      if (row[r][i][2] == kBadRow) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", name, "': rank ", r,
                         " holds more than one piece of it; expected at most one per rank"));
      }
      if (row[r][i][1] != row[0][i][1]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", name, "' (entry ", i, ") differs between rank 0 and rank ", r,
            " in name, dtype or shape: every rank must pass the state dict taken on it"));
      }
      const FlatRange range{row[r][i][2], row[r][i][0]};
      plan.ranges[static_cast<size_t>(i * world + r)] = range;
      if (range.numel == 0) continue;
      if (range.offset < 0 || range.numel < 0 || range.end() > numel) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", name, "': rank ", r, "'s piece [", range.offset, ", ",
                         range.end(), ") lies outside its ", numel, " elements"));
      }
      // Sent unless the ranks before it cover it already.
      int64_t uncovered = range.numel;
      for (const FlatRange& c : covered) {
        uncovered -=
            std::max<int64_t>(0, std::min(c.end(), range.end()) - std::max(c.offset, range.offset));
      }
      if (uncovered == 0) continue;
      plan.senders[static_cast<size_t>(i)].push_back(r);
      covered.push_back(range);
      std::sort(covered.begin(), covered.end(),
                [](const FlatRange& a, const FlatRange& b) { return a.offset < b.offset; });
      std::vector<FlatRange> merged;
      for (const FlatRange& c : covered) {
        if (!merged.empty() && c.offset <= merged.back().end()) {
          merged.back().numel = std::max(merged.back().end(), c.end()) - merged.back().offset;
        } else {
          merged.push_back(c);
        }
      }
      covered = std::move(merged);
    }
    const bool whole = (numel == 0 && covered.empty()) ||
                       (covered.size() == 1 && covered[0].offset == 0 && covered[0].numel == numel);
    if (!whole) {
      std::vector<std::string> held;
      for (const FlatRange& c : covered)
        held.push_back(absl::StrCat("[", c.offset, ", ", c.end(), ")"));
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "': the ranks' pieces cover ",
                       held.empty() ? std::string("nothing") : absl::StrJoin(held, " "), " of its ",
                       numel, " elements; expected all of them"));
    }
  }
  return plan;
}

// What each rank sends rank 0, agreed by all ranks (collectives: every rank
// calls it): this rank's piece of each tensor, and the plan made from every
// rank's rows of the table. Errors are the same on every rank, except that a
// rank whose own pieces are bad returns its own error.
struct Exchange {
  std::vector<std::optional<ShardPiece>> to_send;  // per tensor
  Plan plan;
};

absl::StatusOr<Exchange> AgreeOnPieces(const FsdpModelStateDict& state,
                                       const std::set<std::string>& replicated,
                                       const comm::ProcessGroup& group) {
  const int world = group.size();
  const ShardedStateDict& sharded = state.sharded;
  // Every rank's count of tensors first: the table below is sized by it.
  at::Tensor counts = at::empty({world}, at::kLong);
  comm::all_gather_into_tensor(group, counts,
                               at::full({1}, static_cast<int64_t>(sharded.size()), at::kLong))
      .wait();
  std::vector<int64_t> per_rank(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + world);
  if (std::any_of(per_rank.begin(), per_rank.end(),
                  [&](int64_t n) { return n != per_rank.front(); })) {
    return absl::InvalidArgumentError(
        absl::StrCat("SaveFsdpFullCheckpoint: the ranks pass different numbers of tensors (",
                     absl::StrJoin(per_rank, ", "), " on ranks 0 to ", world - 1,
                     "); every rank must pass the state dict taken on it"));
  }
  const int64_t count = static_cast<int64_t>(sharded.size());
  at::Tensor mine = at::zeros({count, kRowWidth}, at::kLong);
  std::vector<std::optional<ShardPiece>> to_send(sharded.size());
  std::optional<absl::Status> local_error;
  for (int64_t i = 0; i < count; ++i) {
    const auto& item = sharded[static_cast<size_t>(i)];
    auto piece = PieceToSend(state, replicated, item.key(), item.value());
    mine[i][1] = Fingerprint(item.key(), item.value());
    if (!piece.ok()) {
      mine[i][2] = kBadRow;
      if (!local_error) local_error = piece.status();
      continue;
    }
    to_send[static_cast<size_t>(i)] = *piece;
    if (*piece) {
      mine[i][0] = (*piece)->range.numel;
      mine[i][2] = (*piece)->range.offset;
    }
  }
  at::Tensor table = at::empty({world * count * kRowWidth}, at::kLong);
  comm::all_gather_into_tensor(group, table, mine.reshape({-1})).wait();
  auto plan = MakePlan(sharded, table.view({world, count, kRowWidth}), world);
  if (!plan.ok()) return local_error ? *local_error : plan.status();
  return Exchange{std::move(to_send), *std::move(plan)};
}

}  // namespace

absl::Status WriteGatheredOnRank0(const FsdpModelStateDict& state, const comm::ProcessGroup& group,
                                  const std::string& what, const GatheredWrite& write) {
  if (state.type != StateDictType::kSharded) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": expected a SHARDED_STATE_DICT, got ", StateDictTypeName(state.type)));
  }
  if (group.size() != state.world_size || group.rank() != state.rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the state dict was taken on rank ", state.rank, " of ",
                     state.world_size, ", but the group has this process as rank ", group.rank(),
                     " of ", group.size(), "; pass the group the model is sharded over"));
  }
  const ShardedStateDict& sharded = state.sharded;
  const std::set<std::string> replicated(state.replicated.begin(), state.replicated.end());
  try {
    auto exchange = AgreeOnPieces(state, replicated, group);
    if (!exchange.ok()) return exchange.status();
    const std::vector<std::optional<ShardPiece>>& to_send = exchange->to_send;
    const Plan* plan = &exchange->plan;

    const bool is_writer = group.rank() == 0;
    // Tensor i on rank 0: its own piece when that is all of it (no copy),
    // else the part of a buffer its pieces are received into.
    auto whole_on_rank0 = [&](size_t i) {
      const std::optional<ShardPiece>& own = to_send[i];
      const std::vector<int>& senders = plan->senders[i];
      return senders.size() == 1 && senders[0] == 0 && own &&
             own->range.numel == sharded[i].value().global_numel();
    };
    int64_t largest_received = 0;
    for (size_t i = 0; i < sharded.size(); ++i) {
      if (whole_on_rank0(i)) continue;
      const ShardedTensor& t = sharded[i].value();
      largest_received = std::max<int64_t>(
          largest_received, t.global_numel() * static_cast<int64_t>(c10::elementSize(t.dtype)));
    }
    size_t produced = 0;
    at::Tensor receive_buffer;
    auto gather = [&](size_t i) -> absl::StatusOr<at::Tensor> {
      produced = i + 1;
      const ShardedTensor& t = sharded[i].value();
      const std::optional<ShardPiece>& own = to_send[i];
      const std::vector<int>& senders = plan->senders[i];
      if (whole_on_rank0(i)) return own->data.view(t.global_shape);
      // Every tensor is received into one buffer, kept for the whole save
      // (the writer is done with a tensor before it asks for the next): one
      // allocation of the largest tensor's bytes, not one per tensor.
      const at::Device device = own ? own->data.device() : at::Device(at::kCPU);
      const int64_t bytes = t.global_numel() * static_cast<int64_t>(c10::elementSize(t.dtype));
      if (!receive_buffer.defined() || receive_buffer.device() != device ||
          receive_buffer.numel() < bytes) {
        receive_buffer = at::Tensor();
        receive_buffer = at::empty({std::max(bytes, largest_received)},
                                   at::TensorOptions().dtype(at::kByte).device(device));
      }
      at::Tensor full = receive_buffer.narrow(0, 0, bytes).view(t.dtype);
      std::vector<comm::Work> receiving;
      for (int r : senders) {
        const FlatRange range = plan->range(i, r);
        at::Tensor into = full.narrow(0, range.offset, range.numel);
        if (r == 0) {
          into.copy_(own->data);
        } else {
          receiving.push_back(comm::recv(group, into, r));
        }
      }
      for (comm::Work& w : receiving) w.wait();
      return full.view(t.global_shape);
    };

    absl::Status written = absl::OkStatus();
    if (is_writer) {
      std::vector<TensorSpec> specs;
      for (const auto& item : sharded) {
        specs.push_back({item.key(), item.value().dtype, item.value().global_shape});
      }
      written = write(specs, gather);
      // A failed write stops asking for tensors: receive (and drop) the rest,
      // so that no rank is left blocked in a send.
      for (size_t i = produced; i < sharded.size(); ++i) (void)gather(i);
    } else {
      for (size_t i = 0; i < sharded.size(); ++i) {
        const std::vector<int>& senders = plan->senders[i];
        if (std::find(senders.begin(), senders.end(), group.rank()) == senders.end()) continue;
        comm::send(group, to_send[i]->data, 0).wait();
      }
    }
    at::Tensor failed = at::full({1}, written.ok() ? int64_t{0} : int64_t{1}, at::kLong);
    comm::broadcast(group, failed, 0).wait();
    if (!written.ok()) return written;
    if (failed.item<int64_t>() != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, " failed on rank 0, which writes it (see its message); nothing was committed"));
    }
    return absl::OkStatus();
  } catch (const c10::Error& e) {
    return absl::UnavailableError(
        absl::StrCat(what, " on rank ", group.rank(), ": ", e.what_without_backtrace()));
  }
}

absl::Status SaveFsdpFullCheckpoint(const std::string& root, int64_t step,
                                    const FsdpModelStateDict& state,
                                    const comm::ProcessGroup& group) {
  return WriteGatheredOnRank0(
      state, group, absl::StrCat("FULL checkpoint of step ", step, " under ", root),
      [&](const std::vector<TensorSpec>& specs, const TensorSource& source) {
        return SaveFullCheckpoint(root, step, specs, source);
      });
}

absl::Status SaveFsdpHfCheckpoint(const std::string& dir, const FsdpModelStateDict& state,
                                  const comm::ProcessGroup& group, c10::ScalarType dtype,
                                  int64_t max_shard_bytes, const std::string& config_json) {
  return WriteGatheredOnRank0(
      state, group, absl::StrCat("Hugging Face export to ", dir),
      [&](const std::vector<TensorSpec>& specs, const TensorSource& source) {
        return WriteHfCheckpoint(dir, specs, source, dtype, max_shard_bytes, config_json);
      });
}

absl::Status LoadHfCheckpointIntoShards(const std::string& dir, ShardedModel& model) {
  auto files = formats::HfCheckpointFiles::Open(dir);
  if (!files.ok()) return files.status();
  auto state = model.ModelState();
  if (!state.ok()) return state.status();
  std::set<std::string> names;
  for (const auto& item : state->sharded) names.insert(item.key());
  if (auto s = CheckNoUnexpectedHfTensors(*files, names); !s.ok()) return s;
  // Names, shapes and dtypes first (ReadHfShards with no ranges reads no
  // data), then each piece streamed from the file into the shard.
  HfRangeReader reader(*files);
  return FillModelShards(
      model, absl::StrCat("Hugging Face checkpoint ", dir),
      [&](const ShardRequests& requests) { return ReadHfShards(*files, requests); },
      [&](const std::string& name, const ShardRequest&, FlatRange range,
          const torch::Tensor& destination) {
        if (destination.is_contiguous()) return reader.ReadInto(name, range, destination);
        torch::Tensor staged = torch::empty({range.numel}, destination.options());
        if (auto s = reader.ReadInto(name, range, staged); !s.ok()) return s;
        destination.copy_(staged);
        return absl::OkStatus();
      });
}

}  // namespace state_dict
