#include "state_dict/checkpoint.h"

#include "state_dict/internal/live_checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "formats/io/file_io.h"
#include "state_dict/tensor_dict.h"

namespace state_dict {
namespace internal {
namespace {
std::function<void(const std::string&)>& AfterFileWrittenHook() {
  static auto* hook = new std::function<void(const std::string&)>();
  return *hook;
}
}  // namespace

void SetAfterFileWrittenHookForTesting(std::function<void(const std::string&)> hook) {
  AfterFileWrittenHook() = std::move(hook);
}

}  // namespace internal

namespace {

constexpr char kFullFileName[] = "model.pt";
constexpr char kNoData[] = "-";  // key of a tensor a rank holds no piece of
// Deflate's largest ratio of inflated to compressed bytes (zlib's technical
// details: 1032:1); the zip precheck bounds records by the same number.
constexpr uint64_t kMaxDeflateExpansion = 1032;

std::string Shape(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::string RankFileName(int rank) { return absl::StrFormat("rank_%05d.pt", rank); }
std::string RankMetaName(int rank) { return absl::StrFormat("rank_%05d.meta", rank); }

// Writes one file of a checkpoint durably, then runs the test hook.
absl::Status WriteCheckpointFile(const std::string& path, absl::string_view bytes) {
  absl::Status status = formats::WriteFileAtomically(path, bytes);
  if (status.ok() && internal::AfterFileWrittenHook()) {
    internal::AfterFileWrittenHook()(path);
  }
  return status;
}

// Records in `file` the size and checksums of the data file `path` just
// written (`written`, its tensors keyed `keys` in order); `file`'s entries
// with data are in that order (data-less "-" entries are skipped). Then
// runs the test hook.
absl::Status RecordDataFile(const std::string& path,
                            const absl::StatusOr<WrittenTensorDict>& written,
                            const std::vector<std::string>& keys, ManifestFile& file) {
  if (!written.ok()) return written.status();
  file.bytes = written->bytes;
  file.crc32c = written->crc32c;
  size_t i = 0;
  for (ManifestTensor& t : file.tensors) {
    if (t.key == kNoData) continue;
    if (i >= written->tensor_crc32c.size() || i >= keys.size() || keys[i] != t.key) {
      return absl::InternalError(absl::StrCat("writing ", path, ": manifest entry '", t.key,
                                              "' does not match the written tensors"));
    }
    t.crc32c = written->tensor_crc32c[i++];
  }
  if (internal::AfterFileWrittenHook()) internal::AfterFileWrittenHook()(path);
  return absl::OkStatus();
}

// Streams `tensors` into the data file `path` (RecordDataFile).
absl::Status WriteDataFile(const std::string& path, const TensorDict& tensors, ManifestFile& file,
                           const formats::LiveTensors* live) {
  return RecordDataFile(path, formats::WriteTensorDict(tensors, path, live), tensors.keys(), file);
}

absl::Status CheckName(const std::string& name) {
  if (name.empty() || name == kNoData || std::any_of(name.begin(), name.end(), [](char c) {
        return c == ' ' || c == '\n' || c == '\t' || c == '\r' || c == '#';
      })) {
    return absl::InvalidArgumentError(absl::StrCat("tensor name '", name,
                                                   "' cannot be checkpointed (empty, or contains "
                                                   "whitespace or '#')"));
  }
  return absl::OkStatus();
}

absl::Status PrepareStepDirectory(const std::string& step_dir) {
  if (formats::PathExists(step_dir + "/" + kManifestFileName)) {
    return absl::AlreadyExistsError(
        absl::StrCat("checkpoint ", step_dir, " is already complete; refusing to overwrite it"));
  }
  return formats::CreateDirectories(step_dir);
}

// The product of `shape`, or -1 when it overflows int64 (a damaged manifest).
int64_t CheckedNumel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) return -1;
  }
  return n;
}

// A FULL checkpoint of `specs`' tensors: checks their names, writes
// model.pt through `write_data(path, file)` (which fills in the file's size
// and checksums), then the MANIFEST.
absl::Status SaveFullCheckpointFile(
    const std::string& root, int64_t step, const std::vector<TensorSpec>& specs,
    const std::function<absl::Status(const std::string&, ManifestFile&)>& write_data) {
  const std::string dir = StepDirectory(root, step);
  ManifestFile file;
  file.name = kFullFileName;
  for (const TensorSpec& spec : specs) {
    absl::Status status = CheckName(spec.key);
    if (!status.ok()) return status;
    const int64_t numel = CheckedNumel(spec.shape);
    if (numel < 0 ||
        std::any_of(spec.shape.begin(), spec.shape.end(), [](int64_t d) { return d < 0; })) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", spec.key, "' has shape ", Shape(spec.shape), ", which is not a valid shape"));
    }
    ManifestTensor t;
    t.key = t.name = spec.key;
    t.dtype = spec.dtype;
    t.global_shape = spec.shape;
    t.range = FlatRange{0, numel};
    file.tensors.push_back(std::move(t));
  }
  absl::Status status = PrepareStepDirectory(dir);
  if (!status.ok()) return status;
  status = write_data(dir + "/" + kFullFileName, file);
  if (!status.ok()) return status;
  Manifest m;
  m.kind = CheckpointKind::kFull;
  m.step = step;
  m.world_size = 1;
  m.files.push_back(std::move(file));
  return WriteCheckpointFile(dir + "/" + kManifestFileName, FormatManifest(m));
}

// Whether `key` is one SaveShard gives a piece of `name`: the name itself
// (first piece) or "<name>#<k>".
bool IsPieceKey(const std::string& key, const std::string& name) {
  if (key == name) return true;
  int64_t k;
  return absl::StartsWith(key, name + "#") &&
         absl::SimpleAtoi(absl::string_view(key).substr(name.size() + 1), &k) && k > 0;
}

// Per name in a manifest: its global shape and dtype as first listed, and
// its data pieces over all files.
struct ManifestGlobal {
  const ManifestTensor* first;
  std::vector<FlatRange> pieces;
};
using ManifestGlobals = std::map<std::string, ManifestGlobal>;

// ValidateManifest's first step: the manifest's step is its directory's,
// and its files are the ones the savers write for its kind and world size.
absl::Status CheckManifestFiles(const std::string& step_dir, const std::string& manifest_path,
                                const Manifest& m) {
  auto bad = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat("manifest ", manifest_path, ": ", what));
  };
  // A manifest copied into another step's directory would resume the wrong
  // step.
  const std::string base = step_dir.substr(step_dir.find_last_of('/') + 1);
  int64_t dir_step;
  if (absl::StartsWith(base, "step_") && absl::SimpleAtoi(base.substr(5), &dir_step) &&
      dir_step != m.step) {
    return bad(absl::StrCat("records step ", m.step, " but lies in directory ", base));
  }
  if (m.kind == CheckpointKind::kFull) {
    if (m.world_size != 1 || m.files.size() != 1 || m.files[0].name != kFullFileName ||
        m.files[0].rank != 0) {
      return bad(absl::StrCat("a full checkpoint has one file, ", kFullFileName,
                              " of rank 0 in a world of 1; found ", m.files.size(),
                              " files in a world of ", m.world_size));
    }
  } else {
    // Before anything is sized by it: a world size is only as believable as
    // the files listed for it.
    if (m.files.size() != static_cast<size_t>(m.world_size)) {
      return bad(absl::StrCat("lists ", m.files.size(), " files for a world of size ", m.world_size,
                              ": expected one file per rank"));
    }
    std::vector<int> seen(static_cast<size_t>(m.world_size), 0);
    for (const ManifestFile& f : m.files) {
      if (f.rank >= m.world_size) {
        return bad(absl::StrCat("file ", f.name, " is for rank ", f.rank, " but the world size is ",
                                m.world_size));
      }
      if (f.name != RankFileName(f.rank)) {
        return bad(absl::StrCat("rank ", f.rank, "'s file is named ", f.name, ", expected ",
                                RankFileName(f.rank)));
      }
      ++seen[static_cast<size_t>(f.rank)];
    }
    for (int r = 0; r < m.world_size; ++r) {
      if (seen[static_cast<size_t>(r)] != 1) {
        return bad(absl::StrCat("has ", seen[static_cast<size_t>(r)], " files for rank ", r,
                                " of world size ", m.world_size, ", expected 1"));
      }
    }
  }
  return absl::OkStatus();
}

// ValidateManifest's second step, for each file: its entries are ones the
// savers write, within their tensors' shapes, listing no more data than the
// file can hold, and agreeing with earlier entries of the same tensor;
// records each tensor's pieces in `globals`.
absl::Status CheckManifestFileEntries(const std::string& manifest_path, const Manifest& m,
                                      const ManifestFile& f, ManifestGlobals& globals) {
  auto bad = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat("manifest ", manifest_path, ": ", what));
  };
  std::set<std::string> keys;
  // The data the file's entries claim cannot exceed what the file can
  // hold: its size, or deflate's maximum expansion of it (1032:1) for
  // archives with compressed records. What a load allocates from these
  // entries is then bounded by the files' sizes.
  uint64_t claimed_bytes = 0;
  const uint64_t capacity =
      f.bytes > UINT64_MAX / kMaxDeflateExpansion ? UINT64_MAX : f.bytes * kMaxDeflateExpansion;
  for (const ManifestTensor& t : f.tensors) {
    const std::string where = absl::StrCat("tensor '", t.name, "' in file ", f.name);
    absl::Status status = CheckName(t.name);
    if (!status.ok()) return bad(absl::StrCat(where, ": ", status.message()));
    const int64_t numel = CheckedNumel(t.global_shape);
    if (numel < 0)
      return bad(absl::StrCat(where, ": shape ", Shape(t.global_shape),
                              " has more elements than int64 holds"));
    const FlatRange& r = t.range;
    if (r.offset < 0 || r.numel < 0 || r.offset > numel - r.numel) {
      return bad(absl::StrCat(where, ": its piece of ", r.numel, " elements at offset ", r.offset,
                              " lies outside its ", numel, " elements (shape ",
                              Shape(t.global_shape), ")"));
    }
    // The entries the savers write: a full file holds each tensor whole
    // under its name; a rank file holds pieces under "<name>" and
    // "<name>#<k>", or a data-less "-" entry recording shape and dtype.
    const bool no_data = m.kind == CheckpointKind::kSharded && t.key == kNoData;
    bool well_formed;
    if (m.kind == CheckpointKind::kFull) {
      well_formed = t.key == t.name && r.offset == 0 && r.numel == numel;
    } else if (no_data) {
      well_formed = r.offset == 0 && r.numel == 0;
    } else {
      well_formed = IsPieceKey(t.key, t.name);
    }
    if (!well_formed) {
      return bad(absl::StrCat(where, ": key '", t.key, "' with piece [", r.offset, ", ", r.end(),
                              ") is not an entry the checkpoint writer makes"));
    }
    if (!no_data && !keys.insert(t.key).second) {
      return bad(absl::StrCat("file ", f.name, " lists key '", t.key, "' twice"));
    }
    uint64_t piece_bytes = 0;
    if (!no_data &&
        (__builtin_mul_overflow(static_cast<uint64_t>(r.numel),
                                static_cast<uint64_t>(c10::elementSize(t.dtype)), &piece_bytes) ||
         __builtin_add_overflow(claimed_bytes, piece_bytes, &claimed_bytes) ||
         claimed_bytes > capacity)) {
      return bad(absl::StrCat(
          "file ", f.name, " of ", f.bytes, " bytes cannot hold its tensors: ", where,
          " brings the data listed for it past ", capacity, " bytes (", kMaxDeflateExpansion,
          " times its size, deflate's "
          "maximum expansion) with ",
          r.numel, " elements of ", c10::toString(t.dtype)));
    }
    auto inserted = globals.emplace(t.name, ManifestGlobal{&t, {}});
    const ManifestTensor& first = *inserted.first->second.first;
    if (first.global_shape != t.global_shape || first.dtype != t.dtype) {
      return bad(absl::StrCat(where, " is ", Shape(t.global_shape), " ", c10::toString(t.dtype),
                              ", an earlier entry says ", Shape(first.global_shape), " ",
                              c10::toString(first.dtype)));
    }
    if (!no_data && r.numel > 0) inserted.first->second.pieces.push_back(r);
  }
  return absl::OkStatus();
}

// ValidateManifest's third step: every tensor's pieces, over all files,
// cover its global shape.
absl::Status CheckManifestCoverage(const std::string& manifest_path, ManifestGlobals& globals) {
  auto bad = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat("manifest ", manifest_path, ": ", what));
  };
  for (auto& entry : globals) {
    std::vector<FlatRange>& pieces = entry.second.pieces;
    std::sort(pieces.begin(), pieces.end(),
              [](const FlatRange& a, const FlatRange& b) { return a.offset < b.offset; });
    const int64_t numel = CheckedNumel(entry.second.first->global_shape);
    // Overlaps are allowed: a LOCAL save (every rank's raw state) holds
    // replicated tensors from every rank. The copies must be identical, which
    // the loads and VerifyCheckpoint check once the data is read.
    int64_t covered = 0;  // elements [0, covered) are held by some piece
    for (const FlatRange& r : pieces) {
      if (r.offset > covered) {
        return bad(absl::StrCat("tensor '", entry.first, "': no file holds elements [", covered,
                                ", ", r.offset, ")"));
      }
      covered = std::max(covered, r.end());
    }
    if (covered != numel) {
      return bad(absl::StrCat("tensor '", entry.first, "': no file holds elements [", covered, ", ",
                              numel, ") of its ", numel));
    }
  }
  return absl::OkStatus();
}

// ValidateManifest's last step: every file is present with the recorded
// size.
absl::Status CheckManifestFilesOnDisk(const std::string& step_dir, const Manifest& m) {
  for (const ManifestFile& f : m.files) {
    struct stat st;
    const std::string path = step_dir + "/" + f.name;
    if (::stat(path.c_str(), &st) != 0) {
      return absl::NotFoundError(absl::StrCat("missing file ", path, " (rank ", f.rank, " of ",
                                              m.world_size,
                                              "): the checkpoint cannot be loaded without it"));
    }
    if (static_cast<uint64_t>(st.st_size) != f.bytes) {
      return absl::DataLossError(
          absl::StrCat("file ", path, " is ",
                       static_cast<uint64_t>(st.st_size) < f.bytes ? "truncated" : "too long", ": ",
                       st.st_size, " bytes, the manifest records ", f.bytes));
    }
  }
  return absl::OkStatus();
}

// Everything about a checkpoint that can be checked without reading its data
// files: the manifest's entries agree with one another and with the file
// names the savers use; every tensor's pieces, over all files, cover its
// global shape; every file is present with the recorded size.
// VerifyCheckpoint and every load run this, then ReadVerifiedFile on each
// file they read, so `verify` accepts exactly what a load accepts. Errors
// name the manifest (or the missing/short file) and the entry.
absl::Status ValidateManifest(const std::string& step_dir, const Manifest& m) {
  const std::string manifest_path = step_dir + "/" + kManifestFileName;
  if (auto s = CheckManifestFiles(step_dir, manifest_path, m); !s.ok()) return s;
  ManifestGlobals globals;
  for (const ManifestFile& f : m.files) {
    if (auto s = CheckManifestFileEntries(manifest_path, m, f, globals); !s.ok()) return s;
  }
  if (auto s = CheckManifestCoverage(manifest_path, globals); !s.ok()) return s;
  return CheckManifestFilesOnDisk(step_dir, m);
}

// Reads one data file and checks it against its manifest entry completely
// (size, checksum, keys, dtypes, sizes, per-tensor checksums). Returns the
// file's tensors by key; with TensorData::kChecksumOnly (VerifyCheckpoint)
// they carry no data, except those whose keys are in `keep`.
//
// One sequential pass over the file: each tensor's record is read once
// (becoming its storage: the file's pages, copy-on-write; or through a fixed
// buffer when only checksummed), its CRC-32C computed as it is read, and the whole file's
// CRC-32C assembled from the records' and the bytes between them
// (formats::ReadChecksummedTensorDict). Verify and every load run this same
// function, so they accept and reject the same files.
absl::StatusOr<TensorDict> ReadVerifiedFile(const std::string& step_dir, CheckpointKind kind,
                                            const ManifestFile& f,
                                            formats::TensorData data = formats::TensorData::kRead,
                                            const std::set<std::string>& keep = {}) {
  const std::string path = step_dir + "/" + f.name;
  auto size_mismatch = [&](uint64_t bytes) {
    return absl::DataLossError(absl::StrCat("file ", path, " is ",
                                            bytes < f.bytes ? "truncated" : "too long", ": ", bytes,
                                            " bytes, the manifest records ", f.bytes));
  };
  auto checksum_mismatch = [&](uint32_t crc, absl::string_view culprit) {
    return absl::DataLossError(
        absl::StrFormat("checksum mismatch in file %s: crc32c %08x, the manifest records %08x; %s",
                        path, crc, f.crc32c, culprit));
  };
  auto file = formats::ReadChecksummedTensorDict(path, data, keep);
  if (!file.ok()) {
    // Not readable as a dict of tensors. Whether its bytes are the ones the
    // manifest records decides what is reported: damage (with the reader's
    // error as its culprit), or the reader's error itself. This second pass
    // runs on this error path only.
    auto sum = formats::ChecksumFile(path);
    if (!sum.ok()) {
      if (absl::IsNotFound(sum.status())) {
        return absl::NotFoundError(absl::StrCat("missing file ", path, " (rank ", f.rank, ")"));
      }
      return sum.status();
    }
    if (sum->bytes != f.bytes) return size_mismatch(sum->bytes);
    if (sum->crc32c != f.crc32c) return checksum_mismatch(sum->crc32c, file.status().message());
    return file.status();
  }
  if (file->bytes != f.bytes) return size_mismatch(file->bytes);
  const TensorDict& tensors = file->loaded.tensors;
  // The file's tensor for manifest entry `t` (one with data) is what the
  // entry records: present, its dtype, its shape, its checksum.
  auto check_tensor = [&](const ManifestTensor& t) -> absl::Status {
    const torch::Tensor* found = tensors.find(t.key);
    if (found == nullptr) {
      return absl::DataLossError(
          absl::StrCat("file ", path, " lacks tensor '", t.name, "' (key '", t.key, "')"));
    }
    if (found->scalar_type() != t.dtype) {
      return absl::DataLossError(absl::StrCat("file ", path, ": tensor '", t.name, "' is ",
                                              c10::toString(found->scalar_type()),
                                              ", the manifest records ", c10::toString(t.dtype)));
    }
    const std::vector<int64_t> want =
        kind == CheckpointKind::kFull ? t.global_shape : std::vector<int64_t>{t.range.numel};
    if (found->sizes().vec() != want) {
      return absl::DataLossError(absl::StrCat("file ", path, ": tensor '", t.name, "' has shape ",
                                              Shape(found->sizes().vec()),
                                              ", the manifest records ", Shape(want)));
    }
    const std::optional<uint32_t> tensor_crc = formats::TensorCrc32c(file->record_crc32c, *found);
    if (!tensor_crc.has_value()) {  // ReadChecksummedTensorDict keeps what this needs
      return absl::InternalError(absl::StrCat("file ", path, ": tensor '", t.name,
                                              "' was read without the data its checksum needs"));
    }
    if (*tensor_crc != t.crc32c) {
      return absl::DataLossError(
          absl::StrFormat("checksum mismatch in file %s: tensor '%s' has crc32c %08x, the manifest "
                          "records %08x",
                          path, t.name, *tensor_crc, t.crc32c));
    }
    return absl::OkStatus();
  };
  if (file->crc32c != f.crc32c) {
    std::string culprit = "the damage is outside tensor data";
    for (const ManifestTensor& t : f.tensors) {
      if (t.key != kNoData && tensors.find(t.key) != nullptr && !check_tensor(t).ok()) {
        culprit = absl::StrCat("tensor '", t.name, "' (key '", t.key, "') is corrupted");
        break;
      }
    }
    return checksum_mismatch(file->crc32c, culprit);
  }
  size_t stored = 0;
  for (const ManifestTensor& t : f.tensors) {
    if (t.key == kNoData) continue;
    ++stored;
    absl::Status status = check_tensor(t);
    if (!status.ok()) return status;
  }
  if (stored != tensors.size()) {
    return absl::DataLossError(absl::StrCat("file ", path, " holds ", tensors.size(),
                                            " tensors, the manifest lists ", stored));
  }
  return std::move(file->loaded.tensors);
}

// Names of the tensors some of whose pieces overlap (in any files).
std::vector<std::string> OverlappingTensors(const Manifest& m) {
  std::map<std::string, std::vector<FlatRange>> pieces;
  for (const ManifestFile& f : m.files) {
    for (const ManifestTensor& t : f.tensors) {
      if (t.key != kNoData && t.range.numel > 0) pieces[t.name].push_back(t.range);
    }
  }
  std::vector<std::string> out;
  for (auto& entry : pieces) {
    std::vector<FlatRange>& ranges = entry.second;
    std::sort(ranges.begin(), ranges.end(),
              [](const FlatRange& a, const FlatRange& b) { return a.offset < b.offset; });
    int64_t reach = 0;
    for (const FlatRange& r : ranges) {
      if (r.offset < reach) {
        out.push_back(entry.first);
        break;
      }
      reach = std::max(reach, r.end());
    }
  }
  return out;
}

// Reshard for pieces just loaded: a requested range that is exactly one
// saved piece (resuming on the layout that saved) is taken as loaded, which
// nothing else holds, instead of being copied again. Reshard (which always
// copies: its other callers keep using what they pass) makes the other
// ranges and, called even when there are none, checks the pieces once.
absl::StatusOr<ShardedTensor> ReshardLoaded(const std::string& name,
                                            const std::vector<ShardedTensor>& saved,
                                            const std::vector<FlatRange>& needed) {
  std::vector<const ShardPiece*> exact(needed.size(), nullptr);
  std::vector<FlatRange> to_copy;
  for (size_t i = 0; i < needed.size(); ++i) {
    for (const ShardedTensor& st : saved) {
      for (const ShardPiece& piece : st.pieces) {
        if (needed[i].numel > 0 && piece.range == needed[i]) exact[i] = &piece;
      }
    }
    if (exact[i] == nullptr) to_copy.push_back(needed[i]);
  }
  auto out = Reshard(name, saved, to_copy);
  if (!out.ok()) return out;
  std::vector<ShardPiece> copied = std::move(out->pieces);
  out->pieces.clear();
  auto next_copied = copied.begin();
  for (size_t i = 0; i < needed.size(); ++i) {
    out->pieces.push_back(exact[i] != nullptr ? ShardPiece{needed[i], exact[i]->data}
                                              : std::move(*next_copied++));
  }
  return out;
}

absl::StatusOr<Manifest> ReadCheckedManifest(const std::string& step_dir) {
  auto m = ReadManifest(step_dir);
  if (!m.ok()) return m.status();
  absl::Status status = ValidateManifest(step_dir, *m);
  if (!status.ok()) return status;
  return m;
}

}  // namespace

std::string StepDirectory(const std::string& root, int64_t step) {
  return absl::StrCat(root, "/step_", step);
}

absl::Status SaveFullCheckpoint(const std::string& root, int64_t step, const TensorDict& state) {
  return internal::SaveFullCheckpoint(root, step, state, nullptr);
}

absl::Status SaveFullCheckpoint(const std::string& root, int64_t step,
                                const std::vector<TensorSpec>& tensors,
                                const TensorSource& source) {
  std::vector<std::string> keys;
  for (const TensorSpec& spec : tensors) keys.push_back(spec.key);
  return SaveFullCheckpointFile(
      root, step, tensors, [&](const std::string& path, ManifestFile& file) {
        return RecordDataFile(path, formats::WriteTensorRecords(tensors, source, path, nullptr),
                              keys, file);
      });
}

absl::Status SaveShard(const std::string& root, int64_t step, int rank, int world_size,
                       const ShardedStateDict& shard) {
  return internal::SaveShard(root, step, rank, world_size, shard, nullptr);
}

namespace internal {

absl::Status SaveFullCheckpoint(const std::string& root, int64_t step, const TensorDict& state,
                                const formats::LiveTensors* live) {
  auto specs = formats::TensorSpecsOf(state, StepDirectory(root, step));
  if (!specs.ok()) return specs.status();
  return SaveFullCheckpointFile(root, step, *specs,
                                [&](const std::string& path, ManifestFile& file) {
                                  return WriteDataFile(path, state, file, live);
                                });
}

absl::Status SaveShard(const std::string& root, int64_t step, int rank, int world_size,
                       const ShardedStateDict& shard, const formats::LiveTensors* live) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is not in a world of size ", world_size));
  }
  const std::string dir = StepDirectory(root, step);
  ManifestFile file;
  file.name = RankFileName(rank);
  file.rank = rank;
  TensorDict pieces;
  for (const auto& item : shard) {
    absl::Status status = CheckName(item.key());
    if (status.ok()) status = ValidateShardedTensor(item.key(), item.value());
    if (!status.ok()) return status;
    const ShardedTensor& st = item.value();
    ManifestTensor t;
    t.name = item.key();
    t.dtype = st.dtype;
    t.global_shape = st.global_shape;
    if (st.pieces.empty()) {
      t.key = kNoData;  // records the shape/dtype; the rank holds no data
      file.tensors.push_back(t);
    }
    for (size_t k = 0; k < st.pieces.size(); ++k) {
      t.key = k == 0 ? item.key() : absl::StrCat(item.key(), "#", k);
      t.range = st.pieces[k].range;
      pieces.insert(t.key, st.pieces[k].data);
      file.tensors.push_back(t);
    }
  }
  absl::Status status = PrepareStepDirectory(dir);
  if (!status.ok()) return status;
  // A .meta left by an interrupted earlier attempt at this step must not
  // vouch for this attempt: it goes before the data file is rewritten, so if
  // this save fails, CommitShardedCheckpoint sees the rank as unfinished.
  const std::string meta_path = dir + "/" + RankMetaName(rank);
  if (::unlink(meta_path.c_str()) == 0) {
    status = formats::FsyncDirectory(dir);
    if (!status.ok()) return status;
  }
  status = WriteDataFile(dir + "/" + file.name, pieces, file, live);
  if (!status.ok()) return status;
  Manifest meta;
  meta.kind = CheckpointKind::kSharded;
  meta.step = step;
  meta.world_size = world_size;
  meta.files.push_back(std::move(file));
  return WriteCheckpointFile(meta_path, FormatManifest(meta));
}

}  // namespace internal

absl::Status CommitShardedCheckpoint(const std::string& root, int64_t step, int world_size) {
  const std::string dir = StepDirectory(root, step);
  Manifest m;
  m.kind = CheckpointKind::kSharded;
  m.step = step;
  m.world_size = world_size;
  // name -> (global shape, dtype) as rank 0.. recorded it
  std::map<std::string, std::pair<std::vector<int64_t>, c10::ScalarType>> globals;
  for (int r = 0; r < world_size; ++r) {
    const std::string meta_path = dir + "/" + RankMetaName(r);
    auto text = formats::ReadFile(meta_path);
    if (!text.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("cannot commit ", dir, ": rank ", r,
                                                        " has not finished its shard (",
                                                        text.status().message(), ")"));
    }
    auto meta = ParseManifest(*text, meta_path);
    if (!meta.ok()) return meta.status();
    if (meta->step != step || meta->world_size != world_size || meta->files.size() != 1 ||
        meta->files[0].rank != r) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot commit ", dir, ": ", meta_path, " is for step ", meta->step, ", world size ",
          meta->world_size, "; expected step ", step, ", world size ", world_size, ", rank ", r));
    }
    struct stat st;
    const std::string data_path = dir + "/" + meta->files[0].name;
    if (::stat(data_path.c_str(), &st) != 0 ||
        static_cast<uint64_t>(st.st_size) != meta->files[0].bytes) {
      return absl::FailedPreconditionError(absl::StrCat("cannot commit ", dir, ": ", data_path,
                                                        " is missing or not the size ", meta_path,
                                                        " records"));
    }
    for (const ManifestTensor& t : meta->files[0].tensors) {
      auto inserted = globals.emplace(t.name, std::make_pair(t.global_shape, t.dtype));
      if (!inserted.second && (inserted.first->second.first != t.global_shape ||
                               inserted.first->second.second != t.dtype)) {
        return absl::FailedPreconditionError(
            absl::StrCat("cannot commit ", dir, ": rank ", r, " records tensor '", t.name, "' as ",
                         Shape(t.global_shape), " ", c10::toString(t.dtype),
                         ", an earlier rank as ", Shape(inserted.first->second.first), " ",
                         c10::toString(inserted.first->second.second)));
      }
    }
    m.files.push_back(std::move(meta->files[0]));
  }
  // A checkpoint that would not load is never made visible.
  absl::Status status = ValidateManifest(dir, m);
  if (!status.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot commit ", dir, ": ", status.message()));
  }
  status = WriteCheckpointFile(dir + "/" + kManifestFileName, FormatManifest(m));
  if (!status.ok()) return status;
  // The .meta files only carry each rank's entry to this commit; nothing
  // reads them once the MANIFEST exists (which records all they held, and
  // checksums the data files). Removing them leaves no unchecked file in the
  // checkpoint. A crash before this point leaves harmless, unread leftovers.
  for (int r = 0; r < world_size; ++r) {
    const std::string meta_path = dir + "/" + RankMetaName(r);
    if (::unlink(meta_path.c_str()) != 0 && errno != ENOENT) {
      return absl::InternalError(absl::StrCat("checkpoint ", dir, " is committed, but removing ",
                                              meta_path, " failed: ", std::strerror(errno)));
    }
  }
  return formats::FsyncDirectory(dir);
}

absl::Status SaveShardedCheckpoint(const std::string& root, int64_t step,
                                   const std::vector<ShardedStateDict>& shards) {
  const int world_size = static_cast<int>(shards.size());
  for (int r = 0; r < world_size; ++r) {
    absl::Status status = SaveShard(root, step, r, world_size, shards[static_cast<size_t>(r)]);
    if (!status.ok()) return status;
  }
  return CommitShardedCheckpoint(root, step, world_size);
}

absl::StatusOr<Manifest> ReadManifest(const std::string& step_dir) {
  const std::string path = step_dir + "/" + kManifestFileName;
  auto text = formats::ReadFile(path);
  if (!text.ok()) {
    if (absl::IsNotFound(text.status())) {
      return absl::NotFoundError(
          absl::StrCat(step_dir, " is not a complete checkpoint: it has no ", kManifestFileName));
    }
    return text.status();
  }
  return ParseManifest(*text, path);
}

absl::Status VerifyCheckpoint(const std::string& step_dir) {
  auto m = ReadCheckedManifest(step_dir);
  if (!m.ok()) return m.status();
  // Each file is only checksummed, through a fixed buffer: verify holds no
  // file's tensors, whatever their size. Except: loads accept overlapping
  // pieces (replicated tensors of a LOCAL save) only as identical copies, so
  // verify compares them bitwise, keeping the data of just those pieces.
  std::map<std::string, std::vector<ShardedTensor>> overlapping;
  for (const std::string& name : OverlappingTensors(*m)) overlapping[name];
  for (const ManifestFile& f : m->files) {
    std::set<std::string> keep;
    for (const ManifestTensor& t : f.tensors) {
      if (t.key != kNoData && overlapping.count(t.name) > 0) keep.insert(t.key);
    }
    auto contents =
        ReadVerifiedFile(step_dir, m->kind, f, formats::TensorData::kChecksumOnly, keep);
    if (!contents.ok()) return contents.status();
    for (const ManifestTensor& t : f.tensors) {
      auto it = overlapping.find(t.name);
      if (it == overlapping.end() || t.key == kNoData) continue;
      ShardedTensor piece;
      piece.global_shape = t.global_shape;
      piece.dtype = t.dtype;
      piece.pieces.push_back(ShardPiece{t.range, (*contents)[t.key]});
      it->second.push_back(std::move(piece));
    }
  }
  for (const auto& entry : overlapping) {
    absl::Status status = CheckOverlapsAgree(entry.first, entry.second);
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat(step_dir, ": ", status.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TensorDict> LoadFullStateDict(const std::string& step_dir) {
  auto m = ReadCheckedManifest(step_dir);
  if (!m.ok()) return m.status();
  if (m->kind == CheckpointKind::kFull) {
    auto contents = ReadVerifiedFile(step_dir, m->kind, m->files[0]);
    if (!contents.ok()) return contents.status();
    TensorDict out;
    for (const ManifestTensor& t : m->files[0].tensors) out.insert(t.name, (*contents)[t.key]);
    return out;
  }
  // Sharded: gather every rank's pieces per name, in first-seen order.
  std::vector<std::string> order;
  std::map<std::string, std::vector<ShardedTensor>> by_name;
  for (const ManifestFile& f : m->files) {
    auto contents = ReadVerifiedFile(step_dir, m->kind, f);
    if (!contents.ok()) return contents.status();
    for (const ManifestTensor& t : f.tensors) {
      auto& shards = by_name[t.name];
      if (shards.empty()) order.push_back(t.name);
      ShardedTensor st;
      st.global_shape = t.global_shape;
      st.dtype = t.dtype;
      if (t.key != kNoData) st.pieces.push_back(ShardPiece{t.range, (*contents)[t.key]});
      shards.push_back(std::move(st));
    }
  }
  TensorDict out;
  for (const std::string& name : order) {
    auto full = AssembleFullTensor(name, by_name[name]);
    if (!full.ok()) {
      return absl::Status(full.status().code(),
                          absl::StrCat(step_dir, ": ", full.status().message()));
    }
    out.insert(name, *std::move(full));
  }
  return out;
}

absl::StatusOr<ShardedStateDict> LoadResharded(
    const std::string& step_dir,
    const std::vector<std::pair<std::string, ShardRequest>>& requests) {
  auto m = ReadCheckedManifest(step_dir);
  if (!m.ok()) return m.status();
  // Which manifest entries hold each requested name, and which files must be
  // read for the requested ranges.
  std::set<size_t> needed_files;
  for (const auto& request : requests) {
    const std::string& name = request.first;
    bool found = false;
    for (size_t fi = 0; fi < m->files.size(); ++fi) {
      for (const ManifestTensor& t : m->files[fi].tensors) {
        if (t.name != name) continue;
        found = true;
        if (t.global_shape != request.second.global_shape || t.dtype != request.second.dtype) {
          return absl::InvalidArgumentError(absl::StrCat(
              "tensor '", name, "' in ", step_dir, "/", m->files[fi].name, " is ",
              Shape(t.global_shape), " ", c10::toString(t.dtype), ", the model expects ",
              Shape(request.second.global_shape), " ", c10::toString(request.second.dtype)));
        }
        for (const FlatRange& want : request.second.ranges) {
          if (t.key != kNoData && want.numel > 0 && t.range.offset < want.end() &&
              want.offset < t.range.end()) {
            needed_files.insert(fi);
          }
        }
      }
    }
    if (!found) {
      return absl::NotFoundError(
          absl::StrCat("tensor '", name, "' is not in checkpoint ", step_dir));
    }
  }
  std::map<size_t, TensorDict> contents;
  for (size_t fi : needed_files) {
    auto loaded = ReadVerifiedFile(step_dir, m->kind, m->files[fi]);
    if (!loaded.ok()) return loaded.status();
    contents.emplace(fi, *std::move(loaded));
  }
  ShardedStateDict out;
  for (const auto& request : requests) {
    std::vector<ShardedTensor> saved;
    for (const auto& entry : contents) {
      for (const ManifestTensor& t : m->files[entry.first].tensors) {
        if (t.name != request.first || t.key == kNoData) continue;
        ShardedTensor st;
        st.global_shape = t.global_shape;
        st.dtype = t.dtype;
        st.pieces.push_back(ShardPiece{t.range, entry.second[t.key]});
        saved.push_back(std::move(st));
      }
    }
    if (saved.empty()) {  // nothing needed from disk (empty ranges)
      ShardedTensor st;
      st.global_shape = request.second.global_shape;
      st.dtype = request.second.dtype;
      saved.push_back(std::move(st));
    }
    auto resharded = ReshardLoaded(request.first, saved, request.second.ranges);
    if (!resharded.ok()) {
      return absl::Status(resharded.status().code(),
                          absl::StrCat(step_dir, ": ", resharded.status().message()));
    }
    out.insert(request.first, *std::move(resharded));
  }
  return out;
}

absl::StatusOr<TensorDict> LoadLocalShard(const std::string& step_dir, int rank, int world_size) {
  auto m = ReadCheckedManifest(step_dir);
  if (!m.ok()) return m.status();
  if (m->kind != CheckpointKind::kSharded || m->world_size != world_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", step_dir, " is ", CheckpointKindName(m->kind), " with world size ",
        m->world_size, "; a local shard needs a sharded checkpoint of world size ", world_size,
        " (use LoadResharded to change world size)"));
  }
  for (const ManifestFile& f : m->files) {
    if (f.rank == rank) return ReadVerifiedFile(step_dir, m->kind, f);
  }
  return absl::NotFoundError(absl::StrCat("checkpoint ", step_dir, " has no file for rank ", rank));
}

}  // namespace state_dict
