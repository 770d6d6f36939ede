// SHARDED state-dict entries, independent of how they were sharded.
//
// FSDP flattens many original parameters into one flat parameter and gives
// each rank one contiguous range of it, so a rank holds, per ORIGINAL
// parameter, a contiguous 1-D piece of that parameter's flattened data — the
// whole parameter, a middle slice of it, or nothing. A ShardedTensor records
// the original's global shape and dtype plus this rank's pieces with their
// offsets into the flattened original. That is enough to rebuild the full
// tensor from all ranks' pieces, and to reshard: fill the ranges a rank needs
// under a new world size / layout from the pieces N ranks saved.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <c10/util/Exception.h>  // torch/ordered_dict.h uses TORCH_CHECK unincluded
#include <torch/ordered_dict.h>
#include <torch/types.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace state_dict {

// The half-open range [offset, offset + numel) of a flattened tensor.
struct FlatRange {
  int64_t offset = 0;
  int64_t numel = 0;
  int64_t end() const { return offset + numel; }
  bool operator==(const FlatRange& o) const { return offset == o.offset && numel == o.numel; }
};

// One piece: `data` is 1-D with data.numel() == range.numel elements,
// elements [range.offset, range.end()) of the flattened original.
struct ShardPiece {
  FlatRange range;
  torch::Tensor data;
};

struct ShardedTensor {
  std::vector<int64_t> global_shape;
  torch::Dtype dtype = torch::kFloat;
  std::vector<ShardPiece> pieces;  // this rank's; may be empty

  int64_t global_numel() const;
};

// Name (FQN of the original parameter) -> this rank's sharded entry.
using ShardedStateDict = torch::OrderedDict<std::string, ShardedTensor>;

// FSDP's even split of `numel` elements over `world_size` ranks: every rank
// gets ceil(numel / world_size) elements (the last ones fewer, possibly none;
// FSDP's padding is not data and is not represented).
FlatRange EvenShardRange(int64_t numel, int world_size, int rank);

// For a flat parameter made by concatenating originals of `numels` (in order)
// and the `shard` range of it a rank owns, the piece of each original that
// shard covers, as a range of that original (numel 0 when none). This is how
// FSDP tells which parts of which originals a rank holds.
std::vector<FlatRange> OriginalRangesInShard(const std::vector<int64_t>& numels, FlatRange shard);

// Checks that `tensor`'s pieces are well formed: 1-D, of its dtype, numel
// matching their range, inside the global numel. Errors name `name`.
absl::Status ValidateShardedTensor(const std::string& name, const ShardedTensor& tensor);

// Pieces may overlap (a LOCAL save holds a replicated tensor once per rank)
// only as identical copies: checks that overlapping pieces of all `shards` are
// bitwise equal where they overlap (NaNs included), else a DataLoss error
// naming `name`, both pieces and the first element that differs.
absl::Status CheckOverlapsAgree(const std::string& name, const std::vector<ShardedTensor>& shards);

// Rebuilds the full tensor (global shape) from the pieces of all ranks
// (`shards`, one ShardedTensor per rank, same shape and dtype). The pieces
// must cover every element, overlapping only as identical copies
// (CheckOverlapsAgree); a gap or a disagreement is an error naming `name`
// and the elements involved.
absl::StatusOr<torch::Tensor> AssembleFullTensor(const std::string& name,
                                                 const std::vector<ShardedTensor>& shards);

// Reshard on load: returns a ShardedTensor with one piece per `needed` range,
// filled from the `saved` pieces (of any number of ranks, any layout; overlaps
// only as identical copies, checked as by CheckOverlapsAgree). Every needed
// element must be covered by some saved piece; otherwise the error names
// `name` and the first uncovered element.
absl::StatusOr<ShardedTensor> Reshard(const std::string& name,
                                      const std::vector<ShardedTensor>& saved,
                                      const std::vector<FlatRange>& needed);

// What a rank needs of one tensor when loading a sharded checkpoint: its
// expected global shape and dtype (checked against the checkpoint) and the
// ranges of the flattened tensor it holds under the current world size.
struct ShardRequest {
  std::vector<int64_t> global_shape;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<FlatRange> ranges;
};

// How FSDP lays out a flat parameter: its originals flattened and
// concatenated in order. Optimizer state of a flat parameter (Adam's exp_avg,
// exp_avg_sq; SGD's momentum_buffer) has the same layout.
struct FlatParamLayout {
  std::vector<std::string> names;  // FQNs of the originals
  std::vector<std::vector<int64_t>> shapes;
  c10::ScalarType dtype = c10::ScalarType::Float;

  std::vector<int64_t> numels() const;
  int64_t numel() const;
};

// A rank's shard of a flat tensor as SHARDED entries, one per original,
// named `names[i] + suffix` (e.g. suffix "/exp_avg" for optimizer state).
// `local` is 1-D and holds flat elements [shard.offset, shard.end()); any
// elements after those (FSDP's padding) are ignored. Pieces are copies.
ShardedStateDict SplitFlatShard(const FlatParamLayout& layout, FlatRange shard,
                                const torch::Tensor& local, const std::string& suffix = "");

// What to request (checkpoint.h: LoadResharded) to rebuild the shard
// `shard` of a flat tensor laid out as `layout`.
std::vector<std::pair<std::string, ShardRequest>> FlatShardRequests(const FlatParamLayout& layout,
                                                                    FlatRange shard,
                                                                    const std::string& suffix = "");

// Copies `entries` (as LoadResharded returns them for FlatShardRequests)
// into `local`, the rank's 1-D flat shard. Every entry is checked first —
// present, of the layout's dtype, with exactly the requested ranges — so an
// error leaves `local` untouched.
absl::Status FillFlatShard(const FlatParamLayout& layout, FlatRange shard,
                           const ShardedStateDict& entries, const std::string& suffix,
                           torch::Tensor& local);

// Splits a full tensor into the pieces `ranges` select (for tests and for
// producing a SHARDED dict from a FULL one).
ShardedTensor ShardFullTensor(const torch::Tensor& full, const std::vector<FlatRange>& ranges);

}  // namespace state_dict
