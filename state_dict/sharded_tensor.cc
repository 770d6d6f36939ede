#include "state_dict/sharded_tensor.h"

#include <algorithm>
#include <cstring>

#include <torch/types.h>
#include <torch/utils.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace state_dict {
namespace {

std::string Shape(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// All pieces of all ranks, sorted by offset.
std::vector<const ShardPiece*> SortedPieces(const std::vector<ShardedTensor>& shards) {
  std::vector<const ShardPiece*> pieces;
  for (const ShardedTensor& shard : shards) {
    for (const ShardPiece& piece : shard.pieces) {
      if (piece.range.numel > 0) pieces.push_back(&piece);
    }
  }
  std::sort(pieces.begin(), pieces.end(), [](const ShardPiece* a, const ShardPiece* b) {
    return a->range.offset < b->range.offset;
  });
  return pieces;
}

absl::Status CheckSameGlobal(const std::string& name, const std::vector<ShardedTensor>& shards) {
  if (shards.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': no shards"));
  }
  for (size_t r = 0; r < shards.size(); ++r) {
    if (shards[r].global_shape != shards[0].global_shape || shards[r].dtype != shards[0].dtype) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "': shard ", r, " says ", Shape(shards[r].global_shape),
                       " ", c10::toString(shards[r].dtype), ", shard 0 says ",
                       Shape(shards[0].global_shape), " ", c10::toString(shards[0].dtype)));
    }
    absl::Status status = ValidateShardedTensor(name, shards[r]);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

// Index of the first element where a and b (same dtype and numel, 1-D)
// differ bitwise, or -1. Bitwise, not ==: a NaN equals the same NaN, and -0
// differs from +0, as in the bytes a checkpoint stores.
int64_t FirstBitwiseDifference(const torch::Tensor& a, const torch::Tensor& b) {
  const torch::Tensor ca = a.contiguous();
  const torch::Tensor cb = b.contiguous();
  const size_t element = ca.element_size();
  const auto* pa = static_cast<const unsigned char*>(ca.data_ptr());
  const auto* pb = static_cast<const unsigned char*>(cb.data_ptr());
  const size_t bytes = static_cast<size_t>(ca.numel()) * element;
  if (std::memcmp(pa, pb, bytes) == 0) return -1;
  size_t i = 0;
  while (pa[i] == pb[i]) ++i;
  return static_cast<int64_t>(i / element);
}

// The pieces sorted by offset must agree wherever they overlap. One sweep
// suffices: the piece reaching furthest so far (`reach`) holds every earlier
// element a later piece can overlap, and agrees with all earlier pieces there.
absl::Status CheckSortedPiecesAgree(const std::string& name,
                                    const std::vector<const ShardPiece*>& pieces) {
  const ShardPiece* reach = nullptr;
  for (const ShardPiece* piece : pieces) {
    if (reach != nullptr && piece->range.offset < reach->range.end()) {
      const int64_t begin = piece->range.offset;
      const int64_t end = std::min(reach->range.end(), piece->range.end());
      const int64_t differ =
          FirstBitwiseDifference(reach->data.narrow(0, begin - reach->range.offset, end - begin),
                                 piece->data.narrow(0, 0, end - begin));
      if (differ >= 0) {
        return absl::DataLossError(
            absl::StrCat("tensor '", name, "': pieces [", reach->range.offset, ", ",
                         reach->range.end(), ") and [", piece->range.offset, ", ",
                         piece->range.end(), ") overlap but differ at element ", begin + differ,
                         " (overlapping pieces must be identical copies)"));
      }
    }
    if (reach == nullptr || piece->range.end() > reach->range.end()) reach = piece;
  }
  return absl::OkStatus();
}

}  // namespace

int64_t ShardedTensor::global_numel() const {
  int64_t n = 1;
  for (int64_t d : global_shape) n *= d;
  return n;
}

FlatRange EvenShardRange(int64_t numel, int world_size, int rank) {
  const int64_t chunk = (numel + world_size - 1) / world_size;
  const int64_t begin = std::min(numel, chunk * rank);
  const int64_t end = std::min(numel, chunk * (rank + 1));
  return FlatRange{begin, end - begin};
}

std::vector<FlatRange> OriginalRangesInShard(const std::vector<int64_t>& numels, FlatRange shard) {
  std::vector<FlatRange> out;
  int64_t start = 0;  // offset of the current original in the flat parameter
  for (int64_t numel : numels) {
    const int64_t begin = std::max(start, shard.offset);
    const int64_t end = std::min(start + numel, shard.end());
    if (begin < end) {
      out.push_back(FlatRange{begin - start, end - begin});
    } else {
      out.push_back(FlatRange{0, 0});
    }
    start += numel;
  }
  return out;
}

absl::Status ValidateShardedTensor(const std::string& name, const ShardedTensor& tensor) {
  const int64_t numel = tensor.global_numel();
  for (const ShardPiece& piece : tensor.pieces) {
    const FlatRange& r = piece.range;
    if (r.offset < 0 || r.numel < 0 || r.end() > numel) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", name, "': piece [", r.offset, ", ", r.end(), ") lies outside its ", numel,
          " elements (shape ", Shape(tensor.global_shape), ")"));
    }
    if (!piece.data.defined() || piece.data.dim() != 1 || piece.data.numel() != r.numel) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "': piece at offset ", r.offset, " must be 1-D with ",
                       r.numel, " elements, has shape ",
                       piece.data.defined() ? Shape(piece.data.sizes().vec()) : "undefined"));
    }
    if (piece.data.scalar_type() != tensor.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", name, "': piece at offset ", r.offset, " is ",
          c10::toString(piece.data.scalar_type()), ", expected ", c10::toString(tensor.dtype)));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckOverlapsAgree(const std::string& name, const std::vector<ShardedTensor>& shards) {
  absl::Status status = CheckSameGlobal(name, shards);
  if (!status.ok()) return status;
  return CheckSortedPiecesAgree(name, SortedPieces(shards));
}

absl::StatusOr<torch::Tensor> AssembleFullTensor(const std::string& name,
                                                 const std::vector<ShardedTensor>& shards) {
  absl::Status status = CheckSameGlobal(name, shards);
  if (!status.ok()) return status;
  const ShardedTensor& first = shards.front();
  const int64_t numel = first.global_numel();
  torch::Tensor flat = torch::empty({numel}, torch::TensorOptions().dtype(first.dtype));
  const std::vector<const ShardPiece*> pieces = SortedPieces(shards);
  status = CheckSortedPiecesAgree(name, pieces);
  if (!status.ok()) return status;
  int64_t covered = 0;  // elements [0, covered) are filled
  for (const ShardPiece* piece : pieces) {
    if (piece->range.offset > covered) break;  // gap, reported below
    if (piece->range.end() <= covered) continue;
    const int64_t skip = covered - piece->range.offset;  // an identical overlap
    flat.narrow(0, covered, piece->range.numel - skip)
        .copy_(piece->data.narrow(0, skip, piece->range.numel - skip));
    covered = piece->range.end();
  }
  if (covered != numel) {
    return absl::NotFoundError(absl::StrCat("tensor '", name, "': no shard holds elements from ",
                                            covered, " on (of ", numel,
                                            "); a rank's shard is missing"));
  }
  return flat.view(first.global_shape);
}

absl::StatusOr<ShardedTensor> Reshard(const std::string& name,
                                      const std::vector<ShardedTensor>& saved,
                                      const std::vector<FlatRange>& needed) {
  absl::Status status = CheckSameGlobal(name, saved);
  if (!status.ok()) return status;
  ShardedTensor out;
  out.global_shape = saved.front().global_shape;
  out.dtype = saved.front().dtype;
  const int64_t numel = out.global_numel();
  const std::vector<const ShardPiece*> pieces = SortedPieces(saved);
  status = CheckSortedPiecesAgree(name, pieces);
  if (!status.ok()) return status;
  for (const FlatRange& want : needed) {
    if (want.offset < 0 || want.numel < 0 || want.end() > numel) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': requested range [",
                                                     want.offset, ", ", want.end(),
                                                     ") lies outside its ", numel, " elements"));
    }
    torch::Tensor data = torch::empty({want.numel}, torch::TensorOptions().dtype(out.dtype));
    int64_t filled = want.offset;  // [want.offset, filled) done
    for (const ShardPiece* piece : pieces) {
      if (filled >= want.end()) break;
      if (piece->range.end() <= filled || piece->range.offset > filled) continue;
      const int64_t end = std::min(piece->range.end(), want.end());
      data.narrow(0, filled - want.offset, end - filled)
          .copy_(piece->data.narrow(0, filled - piece->range.offset, end - filled));
      filled = end;
    }
    if (filled < want.end()) {
      return absl::NotFoundError(absl::StrCat("tensor '", name, "': no saved shard holds element ",
                                              filled, " (needed for range [", want.offset, ", ",
                                              want.end(), ")); a rank's shard is missing"));
    }
    out.pieces.push_back(ShardPiece{want, data});
  }
  return out;
}

ShardedTensor ShardFullTensor(const torch::Tensor& full, const std::vector<FlatRange>& ranges) {
  ShardedTensor out;
  out.global_shape = full.sizes().vec();
  out.dtype = full.scalar_type();
  torch::Tensor flat = full.detach().contiguous().view({-1});
  for (const FlatRange& r : ranges) {
    if (r.numel == 0) continue;
    out.pieces.push_back(ShardPiece{r, flat.narrow(0, r.offset, r.numel).clone()});
  }
  return out;
}

std::vector<int64_t> FlatParamLayout::numels() const {
  std::vector<int64_t> out;
  for (const auto& shape : shapes) out.push_back(c10::multiply_integers(shape));
  return out;
}

int64_t FlatParamLayout::numel() const {
  int64_t n = 0;
  for (int64_t k : numels()) n += k;
  return n;
}

ShardedStateDict SplitFlatShard(const FlatParamLayout& layout, FlatRange shard,
                                const torch::Tensor& local, const std::string& suffix) {
  const std::vector<int64_t> numels = layout.numels();
  const std::vector<FlatRange> ranges = OriginalRangesInShard(numels, shard);
  torch::Tensor flat = local.detach().reshape({-1});
  ShardedStateDict out;
  int64_t start = 0;  // offset of original i in the flat tensor
  for (size_t i = 0; i < layout.names.size(); ++i) {
    ShardedTensor t;
    t.global_shape = layout.shapes[i];
    t.dtype = layout.dtype;
    if (ranges[i].numel > 0) {
      const int64_t local_offset = start + ranges[i].offset - shard.offset;
      t.pieces.push_back(
          ShardPiece{ranges[i], flat.narrow(0, local_offset, ranges[i].numel).clone()});
    }
    out.insert(layout.names[i] + suffix, std::move(t));
    start += numels[i];
  }
  return out;
}

std::vector<std::pair<std::string, ShardRequest>> FlatShardRequests(const FlatParamLayout& layout,
                                                                    FlatRange shard,
                                                                    const std::string& suffix) {
  const std::vector<FlatRange> ranges = OriginalRangesInShard(layout.numels(), shard);
  std::vector<std::pair<std::string, ShardRequest>> out;
  for (size_t i = 0; i < layout.names.size(); ++i) {
    ShardRequest request;
    request.global_shape = layout.shapes[i];
    request.dtype = layout.dtype;
    if (ranges[i].numel > 0) request.ranges.push_back(ranges[i]);
    out.emplace_back(layout.names[i] + suffix, std::move(request));
  }
  return out;
}

absl::Status FillFlatShard(const FlatParamLayout& layout, FlatRange shard,
                           const ShardedStateDict& entries, const std::string& suffix,
                           torch::Tensor& local) {
  const std::vector<int64_t> numels = layout.numels();
  const std::vector<FlatRange> ranges = OriginalRangesInShard(numels, shard);
  if (!local.defined() || local.dim() != 1 || local.numel() < shard.numel ||
      local.scalar_type() != layout.dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("flat shard must be a 1-D ", c10::toString(layout.dtype),
                     " tensor of at least ", shard.numel, " elements"));
  }
  std::vector<const torch::Tensor*> sources(layout.names.size(), nullptr);
  for (size_t i = 0; i < layout.names.size(); ++i) {
    const std::string name = layout.names[i] + suffix;
    const ShardedTensor* t = entries.find(name);
    if (t == nullptr) {
      return absl::NotFoundError(absl::StrCat("no entry for tensor '", name, "'"));
    }
    if (ranges[i].numel == 0) continue;
    if (t->pieces.size() != 1 || !(t->pieces[0].range == ranges[i]) ||
        t->pieces[0].data.scalar_type() != layout.dtype ||
        t->pieces[0].data.numel() != ranges[i].numel) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "': expected one ", c10::toString(layout.dtype),
                       " piece [", ranges[i].offset, ", ", ranges[i].end(), ") for this shard"));
    }
    sources[i] = &t->pieces[0].data;
  }
  torch::NoGradGuard no_grad;
  int64_t start = 0;
  for (size_t i = 0; i < layout.names.size(); ++i) {
    if (sources[i] != nullptr) {
      local.narrow(0, start + ranges[i].offset - shard.offset, ranges[i].numel).copy_(*sources[i]);
    }
    start += numels[i];
  }
  return absl::OkStatus();
}

}  // namespace state_dict
