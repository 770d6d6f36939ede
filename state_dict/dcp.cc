#include "state_dict/dcp.h"

#include <unistd.h>

#include <algorithm>
#include <functional>
#include <map>

#include <ATen/ATen.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "formats/dcp/dcp_metadata.h"
#include "formats/io/file_io.h"
#include "formats/torch_save/tensor_dict_io.h"
#include "formats/torch_save/torch_archive_reader.h"

namespace state_dict {
namespace {

using formats::DcpChunk;
using formats::DcpEntry;
using formats::DcpIndex;
using formats::DcpMetadata;
using formats::DcpStorage;

constexpr char kMetadataFile[] = ".metadata";
// Python's DCP reads `.metadata` and the files it names; these records of a
// rank's items until the commit are neither.
std::string PartFile(const std::string& dir, int rank) {
  return absl::StrCat(dir, "/.rank_", rank, ".dcp_part");
}
std::string DataFileName(int rank) { return absl::StrCat("__", rank, "_0.distcp"); }

std::string Dims(const std::vector<int64_t>& dims) {
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

std::vector<int64_t> RowMajorStrides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  return strides;
}

int64_t Volume(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

// The flat ranges of a row-major tensor of `shape` that `chunk` covers, in
// the chunk's own row-major order: each run is elements [start, start +
// length) of the flattened tensor and [local, local + length) of the
// flattened chunk. A box spans every index of its trailing full dimensions,
// so each run covers the dimension before them and all after.
struct Run {
  int64_t start;
  int64_t local;
  int64_t length;
};
void ForEachRun(const std::vector<int64_t>& shape, const DcpChunk& chunk,
                const std::function<void(const Run&)>& fn) {
  const size_t n = shape.size();
  if (n == 0) {
    fn(Run{0, 0, 1});
    return;
  }
  for (int64_t s : chunk.sizes) {
    if (s == 0) return;
  }
  const std::vector<int64_t> strides = RowMajorStrides(shape);
  size_t inner = n - 1;
  while (inner > 0 && chunk.sizes[inner] == shape[inner]) --inner;
  const int64_t length = chunk.sizes[inner] * strides[inner];
  std::vector<int64_t> index(inner, 0);
  int64_t local = 0;
  while (true) {
    int64_t start = chunk.offsets[inner] * strides[inner];
    for (size_t d = 0; d < inner; ++d) start += (chunk.offsets[d] + index[d]) * strides[d];
    fn(Run{start, local, length});
    local += length;
    size_t d = inner;
    while (d > 0 && ++index[d - 1] == chunk.sizes[d - 1]) index[--d] = 0;
    if (d == 0) return;
  }
}

// The first and last flat element `chunk` covers (first > last when empty).
std::pair<int64_t, int64_t> FlatSpan(const std::vector<int64_t>& shape, const DcpChunk& chunk) {
  const std::vector<int64_t> strides = RowMajorStrides(shape);
  int64_t first = 0, last = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (chunk.sizes[d] == 0) return {1, 0};
    first += chunk.offsets[d] * strides[d];
    last += (chunk.offsets[d] + chunk.sizes[d] - 1) * strides[d];
  }
  return {first, last};
}

bool BoxesOverlap(const DcpChunk& a, const DcpChunk& b) {
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    if (a.sizes[d] == 0 || b.sizes[d] == 0) return false;
    if (a.offsets[d] >= b.offsets[d] + b.sizes[d] || b.offsets[d] >= a.offsets[d] + a.sizes[d]) {
      return false;
    }
  }
  return true;
}

// A flat range of a tensor of `shape` as boxes, each a contiguous part of
// the range, in order: a partial first row, whole rows, a partial last row
// (recursively, for the rows' own dimensions).
void RangeToBoxes(const std::vector<int64_t>& shape, size_t dim, std::vector<int64_t> prefix,
                  int64_t begin, int64_t end, std::vector<DcpChunk>& out) {
  if (begin >= end) return;
  if (dim == shape.size()) {  // a 0-dim tensor's one element
    out.push_back(DcpChunk{prefix, std::vector<int64_t>(prefix.size(), 1)});
    return;
  }
  int64_t inner = 1;
  for (size_t d = dim + 1; d < shape.size(); ++d) inner *= shape[d];
  auto row = [&](int64_t r, int64_t b, int64_t e) {
    std::vector<int64_t> p = prefix;
    p.push_back(r);
    RangeToBoxes(shape, dim + 1, p, b, e, out);
  };
  if (begin % inner != 0) {
    const int64_t r = begin / inner;
    const int64_t stop = std::min(end, (r + 1) * inner);
    row(r, begin - r * inner, stop - r * inner);
    begin = stop;
  }
  const int64_t rows = end / inner - begin / inner;
  if (begin < end && rows > 0) {
    DcpChunk box;
    box.offsets = prefix;
    box.offsets.push_back(begin / inner);
    box.sizes.assign(prefix.size(), 1);
    box.sizes.push_back(rows);
    for (size_t d = dim + 1; d < shape.size(); ++d) {
      box.offsets.push_back(0);
      box.sizes.push_back(shape[d]);
    }
    out.push_back(std::move(box));
    begin += rows * inner;
  }
  if (begin < end) {
    const int64_t r = begin / inner;
    row(r, 0, end - r * inner);
  }
}

// A box of a tensor of `shape` within dimensions `dim..` under `prefix`:
// RangeToBoxes' boxes carry the full prefix of size-1 dimensions.
std::vector<DcpChunk> FlatRangeToBoxes(const std::vector<int64_t>& shape, FlatRange range) {
  std::vector<DcpChunk> out;
  if (shape.empty()) {
    if (range.numel > 0) out.push_back(DcpChunk{{}, {}});
    return out;
  }
  RangeToBoxes(shape, 0, {}, range.offset, range.end(), out);
  return out;
}

}  // namespace

std::string FlatKey(const DcpKeyPath& path) {
  std::vector<std::string> parts;
  for (const auto& part : path) {
    parts.push_back(std::holds_alternative<std::string>(part)
                        ? std::get<std::string>(part)
                        : absl::StrCat(std::get<int64_t>(part)));
  }
  return absl::StrJoin(parts, ".");
}

absl::StatusOr<DcpCheckpoint> DcpCheckpoint::Open(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/", kMetadataFile);
  if (!formats::PathExists(path)) {
    return absl::NotFoundError(
        absl::StrCat(dir, " is not a torch.distributed.checkpoint directory: it has no ",
                     kMetadataFile, " (an interrupted save, or not a DCP checkpoint)"));
  }
  auto bytes = formats::ReadFile(path);
  if (!bytes.ok()) return bytes.status();
  auto metadata = formats::ParseDcpMetadata(path, *bytes);
  if (!metadata.ok()) return metadata.status();
  // Chunks of one tensor must not overlap: a load copies each element from
  // the one chunk that has it. A sweep along the first dimension compares
  // each chunk only with those whose rows it shares (row chunks, as FSDP and
  // FSDP2 write them: none), not every pair.
  for (const DcpEntry& e : metadata->entries) {
    std::vector<const DcpChunk*> boxes;
    for (const DcpChunk& c : e.chunks) {
      if (!e.size.empty() && Volume(c.sizes) > 0) boxes.push_back(&c);
    }
    if (e.size.empty() && e.chunks.size() > 1) {
      return absl::DataLossError(absl::StrCat(path, ": the 0-dim '", absl::CEscape(e.key), "' has ",
                                              e.chunks.size(), " chunks"));
    }
    std::sort(boxes.begin(), boxes.end(),
              [](const DcpChunk* a, const DcpChunk* b) { return a->offsets[0] < b->offsets[0]; });
    std::vector<const DcpChunk*> open;  // chunks whose rows reach the current one
    for (const DcpChunk* box : boxes) {
      open.erase(std::remove_if(open.begin(), open.end(),
                                [&](const DcpChunk* o) {
                                  return o->offsets[0] + o->sizes[0] <= box->offsets[0];
                                }),
                 open.end());
      for (const DcpChunk* o : open) {
        if (BoxesOverlap(*o, *box)) {
          return absl::DataLossError(absl::StrCat(path, ": chunks at ", Dims(o->offsets), " and ",
                                                  Dims(box->offsets), " of '", absl::CEscape(e.key),
                                                  "' overlap"));
        }
      }
      open.push_back(box);
    }
  }
  // Items must not share bytes: Python's writer never does, and a region
  // named by many items would let a small file claim its expansion many
  // times over.
  std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> regions;
  for (const auto& [index, where] : metadata->storage) {
    regions[where.relative_path].emplace_back(where.offset, where.length);
  }
  for (auto& [file, list] : regions) {
    std::sort(list.begin(), list.end());
    for (size_t i = 1; i < list.size(); ++i) {
      if (list[i].first < list[i - 1].first + list[i - 1].second) {
        return absl::DataLossError(absl::StrCat(path, ": items in ", absl::CEscape(file),
                                                " share bytes (at ", list[i - 1].first, " and ",
                                                list[i].first, ")"));
      }
    }
  }
  return DcpCheckpoint(dir, std::make_shared<const DcpMetadata>(*std::move(metadata)));
}

std::vector<DcpCheckpoint::TensorInfo> DcpCheckpoint::tensors() const {
  std::vector<TensorInfo> out;
  for (const DcpEntry& e : metadata_->entries) {
    if (!e.is_bytes) out.push_back(TensorInfo{e.key, e.size, e.dtype});
  }
  return out;
}

std::vector<std::string> DcpCheckpoint::objects() const {
  std::vector<std::string> out;
  for (const DcpEntry& e : metadata_->entries) {
    if (e.is_bytes) out.push_back(e.key);
  }
  return out;
}

absl::StatusOr<ShardedStateDict> DcpCheckpoint::LoadResharded(
    const std::vector<std::pair<std::string, ShardRequest>>& requests) const {
  std::map<std::string, const DcpEntry*> by_key;
  for (const DcpEntry& e : metadata_->entries) by_key[e.key] = &e;
  ShardedStateDict out;
  for (const auto& requested : requests) {
    // Not a structured binding: clang before 16 (tools/fuzz.sh's clang-14)
    // cannot capture one in the lambda below.
    const std::string& key = requested.first;
    const ShardRequest& request = requested.second;
    auto found = by_key.find(key);
    if (found == by_key.end()) {
      return absl::NotFoundError(
          absl::StrCat("DCP checkpoint ", dir_, " has no entry '", absl::CEscape(key), "'"));
    }
    const DcpEntry& e = *found->second;
    if (e.is_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("DCP checkpoint ", dir_, ": '", absl::CEscape(key), "' is not a tensor"));
    }
    if (e.size != request.global_shape || e.dtype != request.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "DCP checkpoint ", dir_, ": '", absl::CEscape(key), "' is ", c10::toString(e.dtype),
          Dims(e.size), ", expected ", c10::toString(request.dtype), Dims(request.global_shape)));
    }
    const int64_t numel = Volume(e.size);
    for (const FlatRange& r : request.ranges) {
      if (r.offset < 0 || r.numel < 0 || r.end() > numel) {
        return absl::InvalidArgumentError(absl::StrCat("request for '", absl::CEscape(key),
                                                       "': range [", r.offset, ", ", r.end(),
                                                       ") outside its ", numel, " elements"));
      }
    }
    // The chunks the ranges need, and that they cover every requested
    // element, from the metadata and each chunk's zip directory, before
    // anything of the request's size is allocated: sizes in `.metadata` are
    // claims, and a chunk claiming more elements than its archive's storage
    // records hold (themselves checked against the file) is refused here.
    // So a load's memory is bounded by the files' sizes.
    const uint64_t element_size = c10::elementSize(e.dtype);
    std::vector<std::pair<const DcpChunk*, formats::FileRegion>> needed;
    std::vector<std::vector<FlatRange>> filled(request.ranges.size());
    for (const DcpChunk& chunk : e.chunks) {
      const auto [first, last] = FlatSpan(e.size, chunk);
      bool wanted = false;
      for (const FlatRange& r : request.ranges) wanted |= r.offset <= last && first < r.end();
      if (!wanted) continue;
      const DcpStorage& where = metadata_->storage.at(DcpIndex{e.key, chunk.offsets});
      formats::FileRegion region{absl::StrCat(dir_, "/", where.relative_path), where.offset,
                                 where.length};
      auto directory = formats::ReadTorchArchiveDirectory(region);
      if (!directory.ok()) return directory.status();
      const uint64_t holds = formats::DeclaredRecordBytes(*directory).storages;
      if (static_cast<uint64_t>(Volume(chunk.sizes)) > holds / element_size) {
        return absl::DataLossError(absl::StrCat(
            region.Name(), ": the chunk of '", absl::CEscape(key), "' at ", Dims(chunk.offsets),
            " claims ", Dims(chunk.sizes), " of ", c10::toString(e.dtype),
            ", more than its archive's ", holds, " bytes of storage hold"));
      }
      ForEachRun(e.size, chunk, [&](const Run& run) {
        for (size_t i = 0; i < request.ranges.size(); ++i) {
          const FlatRange& r = request.ranges[i];
          const int64_t lo = std::max(r.offset, run.start);
          const int64_t hi = std::min(r.end(), run.start + run.length);
          if (lo < hi) filled[i].push_back(FlatRange{lo, hi - lo});
        }
      });
      needed.emplace_back(&chunk, std::move(region));
    }
    for (size_t i = 0; i < request.ranges.size(); ++i) {
      std::sort(filled[i].begin(), filled[i].end(),
                [](const FlatRange& a, const FlatRange& b) { return a.offset < b.offset; });
      int64_t next = request.ranges[i].offset;
      for (const FlatRange& f : filled[i]) {
        if (f.offset > next) break;
        next = std::max(next, f.end());
      }
      if (next < request.ranges[i].end()) {
        return absl::DataLossError(absl::StrCat("DCP checkpoint ", dir_, ": no chunk of '",
                                                absl::CEscape(key), "' holds flat element ", next,
                                                " (of ", numel, ")"));
      }
    }

    ShardedTensor result;
    result.global_shape = e.size;
    result.dtype = e.dtype;
    for (const FlatRange& r : request.ranges) {
      result.pieces.push_back(
          ShardPiece{r, at::empty({r.numel}, at::TensorOptions().dtype(e.dtype))});
    }
    for (const auto& [chunk, region] : needed) {
      auto archive = formats::ReadTorchArchive(region);
      if (!archive.ok()) return archive.status();
      if (!archive->value.isTensor()) {
        return absl::DataLossError(absl::StrCat(region.Name(), ": the chunk of '",
                                                absl::CEscape(key), "' is not a tensor"));
      }
      const at::Tensor data = archive->value.toTensor();
      if (data.scalar_type() != e.dtype || data.sizes().vec() != chunk->sizes) {
        return absl::DataLossError(absl::StrCat(
            region.Name(), ": the chunk of '", absl::CEscape(key), "' at ", Dims(chunk->offsets),
            " holds ", c10::toString(data.scalar_type()), Dims(data.sizes().vec()),
            ", its metadata says ", c10::toString(e.dtype), Dims(chunk->sizes)));
      }
      const at::Tensor flat = data.contiguous().reshape({-1});
      ForEachRun(e.size, *chunk, [&](const Run& run) {
        for (size_t i = 0; i < request.ranges.size(); ++i) {
          const FlatRange& r = request.ranges[i];
          const int64_t lo = std::max(r.offset, run.start);
          const int64_t hi = std::min(r.end(), run.start + run.length);
          if (lo >= hi) continue;
          result.pieces[i]
              .data.narrow(0, lo - r.offset, hi - lo)
              .copy_(flat.narrow(0, run.local + lo - run.start, hi - lo));
        }
      });
    }
    out.insert(key, std::move(result));
  }
  return out;
}

absl::StatusOr<std::vector<DcpCheckpoint::ChunkInfo>> DcpCheckpoint::Chunks(
    const std::string& key) const {
  for (const DcpEntry& e : metadata_->entries) {
    if (e.key != key) continue;
    if (e.is_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("DCP checkpoint ", dir_, ": '", absl::CEscape(key), "' is not a tensor"));
    }
    std::vector<ChunkInfo> out;
    for (const DcpChunk& chunk : e.chunks) {
      const DcpStorage& where = metadata_->storage.at(DcpIndex{key, chunk.offsets});
      out.push_back(
          ChunkInfo{chunk.offsets, chunk.sizes, where.relative_path, where.offset, where.length});
    }
    return out;
  }
  return absl::NotFoundError(
      absl::StrCat("DCP checkpoint ", dir_, " has no entry '", absl::CEscape(key), "'"));
}

absl::StatusOr<at::Tensor> DcpCheckpoint::LoadTensor(const std::string& key) const {
  for (const DcpEntry& e : metadata_->entries) {
    if (e.key != key || e.is_bytes) continue;
    const int64_t numel = Volume(e.size);
    auto loaded = LoadResharded({{key, ShardRequest{e.size, e.dtype, {FlatRange{0, numel}}}}});
    if (!loaded.ok()) return loaded.status();
    const ShardedTensor& st = loaded->begin()->value();
    if (numel == 0 || st.pieces.empty()) return at::empty(e.size, at::TensorOptions(e.dtype));
    return st.pieces.front().data.reshape(e.size);
  }
  return absl::NotFoundError(
      absl::StrCat("DCP checkpoint ", dir_, " has no tensor '", absl::CEscape(key), "'"));
}

absl::StatusOr<c10::IValue> DcpCheckpoint::LoadObject(const std::string& key) const {
  for (const DcpEntry& e : metadata_->entries) {
    if (e.key != key) continue;
    if (!e.is_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("DCP checkpoint ", dir_, ": '", absl::CEscape(key), "' is a tensor"));
    }
    const DcpStorage& where = metadata_->storage.at(DcpIndex{key, std::nullopt});
    auto archive = formats::ReadTorchArchive(formats::FileRegion{
        absl::StrCat(dir_, "/", where.relative_path), where.offset, where.length});
    if (!archive.ok()) return archive.status();
    return archive->value;
  }
  return absl::NotFoundError(
      absl::StrCat("DCP checkpoint ", dir_, " has no entry '", absl::CEscape(key), "'"));
}

absl::Status SaveDcpShard(const std::string& dir, int rank, const DcpShard& shard) {
  if (rank < 0) {
    return absl::InvalidArgumentError(absl::StrCat("SaveDcpShard: rank ", rank, " is negative"));
  }
  if (auto s = formats::CreateDirectories(dir); !s.ok()) return s;
  const std::string file_name = DataFileName(rank);
  auto file = formats::AtomicFileWriter::Open(absl::StrCat(dir, "/", file_name));
  if (!file.ok()) return file.status();
  DcpMetadata part;
  for (const DcpShard::Tensor& t : shard.tensors) {
    DcpEntry entry;
    entry.key = FlatKey(t.path);
    if (auto s = ValidateShardedTensor(entry.key, t.tensor); !s.ok()) return s;
    if (!formats::DcpDtypeName(t.tensor.dtype).has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", entry.key, "' is ", c10::toString(t.tensor.dtype), ", which DCP cannot name"));
    }
    entry.dtype = t.tensor.dtype;
    entry.size = t.tensor.global_shape;
    for (const ShardPiece& piece : t.tensor.pieces) {
      int64_t at = piece.range.offset;
      for (DcpChunk& box : FlatRangeToBoxes(entry.size, piece.range)) {
        const int64_t n = Volume(box.sizes);
        const at::Tensor data = piece.data.narrow(0, at - piece.range.offset, n)
                                    .to(at::kCPU)
                                    .contiguous()
                                    .reshape(box.sizes)
                                    .clone();
        at += n;
        const uint64_t offset = (*file)->bytes();
        if (auto s = formats::AppendTorchSave(data, **file); !s.ok()) return s;
        part.storage[DcpIndex{entry.key, box.offsets}] =
            DcpStorage{file_name, offset, (*file)->bytes() - offset};
        entry.chunks.push_back(std::move(box));
      }
    }
    part.paths[entry.key] = t.path;
    part.entries.push_back(std::move(entry));
  }
  for (const DcpShard::Object& o : shard.objects) {
    DcpEntry entry;
    entry.key = FlatKey(o.path);
    entry.is_bytes = true;
    const uint64_t offset = (*file)->bytes();
    if (auto s = formats::AppendTorchSave(o.value, **file); !s.ok()) return s;
    part.storage[DcpIndex{entry.key, std::nullopt}] =
        DcpStorage{file_name, offset, (*file)->bytes() - offset};
    part.paths[entry.key] = o.path;
    part.entries.push_back(std::move(entry));
  }
  if (auto s = (*file)->Commit(); !s.ok()) return s;
  return formats::WriteFileAtomically(PartFile(dir, rank), formats::SerializeDcpMetadata(part));
}

absl::Status CommitDcpCheckpoint(const std::string& dir, int world_size) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("CommitDcpCheckpoint: world_size ", world_size, " is not positive"));
  }
  DcpMetadata merged;
  std::map<std::string, size_t> position;  // key -> index in merged.entries
  for (int rank = 0; rank < world_size; ++rank) {
    const std::string path = PartFile(dir, rank);
    auto bytes = formats::ReadFile(path);
    if (!bytes.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot commit DCP checkpoint ", dir, ": rank ", rank,
                       " has not saved its shard (", bytes.status().message(), ")"));
    }
    auto part = formats::ParseDcpMetadata(path, *bytes);
    if (!part.ok()) return part.status();
    for (DcpEntry& e : part->entries) {
      auto [it, inserted] = position.emplace(e.key, merged.entries.size());
      if (inserted) {
        DcpEntry copy = e;
        copy.chunks.clear();
        merged.entries.push_back(std::move(copy));
      }
      DcpEntry& m = merged.entries[it->second];
      if (m.is_bytes != e.is_bytes || (!m.is_bytes && (m.size != e.size || m.dtype != e.dtype))) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cannot commit DCP checkpoint ", dir, ": ranks disagree on '", absl::CEscape(e.key),
            "' (rank ", rank, ": ", e.is_bytes ? "an object" : c10::toString(e.dtype),
            e.is_bytes ? "" : Dims(e.size), ")"));
      }
      if (m.is_bytes) {
        merged.storage.emplace(DcpIndex{e.key, std::nullopt},
                               part->storage.at(DcpIndex{e.key, std::nullopt}));
        continue;
      }
      for (DcpChunk& c : e.chunks) {
        // A replicated tensor's identical boxes from several ranks: the
        // first is kept, as Python's DCP deduplicates them.
        bool duplicate = false;
        for (const DcpChunk& have : m.chunks) {
          if (have.offsets == c.offsets && have.sizes == c.sizes)
            duplicate = true;
          else if (BoxesOverlap(have, c)) {
            return absl::InvalidArgumentError(absl::StrCat(
                "cannot commit DCP checkpoint ", dir, ": pieces of '", absl::CEscape(e.key),
                "' at ", Dims(have.offsets), " and ", Dims(c.offsets), " overlap"));
          }
        }
        if (duplicate) continue;
        merged.storage[DcpIndex{e.key, c.offsets}] = part->storage.at(DcpIndex{e.key, c.offsets});
        m.chunks.push_back(std::move(c));
      }
    }
    for (auto& [key, path] : part->paths) merged.paths.emplace(key, path);
  }
  for (const DcpEntry& e : merged.entries) {
    if (e.is_bytes) continue;
    int64_t covered = 0;
    for (const DcpChunk& c : e.chunks) covered += Volume(c.sizes);
    if (covered != Volume(e.size)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot commit DCP checkpoint ", dir, ": the ranks' pieces of '", absl::CEscape(e.key),
          "' cover ", covered, " of its ", Volume(e.size), " elements"));
    }
  }
  merged.version = "1.0.0";
  if (auto s = formats::WriteFileAtomically(absl::StrCat(dir, "/", kMetadataFile),
                                            formats::SerializeDcpMetadata(merged));
      !s.ok()) {
    return s;
  }
  for (int rank = 0; rank < world_size; ++rank) ::unlink(PartFile(dir, rank).c_str());
  return absl::OkStatus();
}

}  // namespace state_dict
