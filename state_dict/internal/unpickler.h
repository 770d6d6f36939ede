// A reader for the pickle programs inside PyTorch's zip checkpoints.
//
// Why not torch::jit::Unpickler / torch::pickle_load: LibTorch 1.13's
// unpickler special-cases `collections.OrderedDict` as "a tensor's backward
// hooks, value never used" and replaces it by None, so the OrderedDict that
// nn.Module.state_dict() returns (and that torch.save writes first) makes the
// following SETITEMS fail; its type-resolver hook is never consulted for that
// global, and the `_metadata` attribute (applied with BUILD) has no place in
// an IValue either. Rewriting the opcode stream would still need a full
// opcode walker, so this is a small, strict pickle VM for the subset that
// torch.save (protocol 2) and torch::pickle_save produce: containers,
// scalars, strings, OrderedDict (+ BUILD of its attributes), tensors rebuilt
// from storages (torch._utils._rebuild_tensor_v2 / _rebuild_parameter) and
// the torch.jit._pickle type-tag helpers. Anything else is an error naming
// the global or opcode, never arbitrary code execution.
//
// Rechecked on LibTorch 2.15 (the wheel this project builds on), because
// 2.x was to replace hand-written loaders where it could: unchanged.
// torch::pickle_load on a file Python 2.15 wrote with
// torch.save(OrderedDict(w=..., b=...)) still yields None for the
// OrderedDict ("Expected GenericDict but got None"), while the same dict
// saved as a plain dict loads. Every nn.Module.state_dict() is an
// OrderedDict, so LibTorch's loader cannot read Python's checkpoints.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"
#include "state_dict/internal/zip_precheck.h"

namespace state_dict {
namespace internal {

struct UnpickledArchive {
  // The top-level object. Dicts become c10 GenericDicts (insertion order
  // kept; key type from the keys: str or int), lists GenericLists, tuples
  // Tuples, tensors Tensors sharing the archive's storages.
  c10::IValue value;
  // When the top-level object is an OrderedDict carrying Python attributes
  // (state_dict()'s `_metadata`: {module prefix: {"version": N}}), that
  // attribute dict; None otherwise.
  c10::IValue metadata;
};

// What a load may spend on one archive.
struct ArchiveLimits {
  // When not 0: refuse (ResourceExhausted, naming the file, the total its
  // records declare and this budget) an archive whose records' declared
  // uncompressed sizes sum to more than this, before any record is read.
  uint64_t max_bytes = 0;
};

// Reads a PyTorch zip archive (torch.save / torch::pickle_save). Errors name
// `path` and what was wrong (truncated zip, unsupported global, bad tensor).
// Each storage record the pickle names is read once (however many keys name
// it), into fresh memory of the size its directory entry declares, which the
// zip precheck has checked against the file (see zip_precheck.h): a stored
// record is read straight into it, a deflated one inflated straight into it
// through a fixed buffer, and one that inflates to another size than it
// declares is an error naming it. So the memory a load holds is at most the
// records' declared sizes (the tensors' storages and data.pkl) plus the
// pickle's objects and fixed buffers; `limits.max_bytes` bounds those sizes
// up front. Nothing checks the records' bytes: LibTorch's miniz is built
// without its zip CRC-32 checks (a flipped byte in a stored tensor record
// loads silently, here as in Python's torch.load); checkpoints have their
// own CRC-32C for that.
// Time is linear in the file: a dict's keys are hashed as they are set (one
// SETITEMS of N keys used to take N^2/2 comparisons).
absl::StatusOr<UnpickledArchive> ReadTorchArchive(const std::string& path,
                                                  const ArchiveLimits& limits = {});
// The same for an archive embedded in a region of a file (DCP's .distcp
// files: one torch.save archive per item); errors name the region.
absl::StatusOr<UnpickledArchive> ReadTorchArchive(const FileRegion& region,
                                                  const ArchiveLimits& limits = {});

// A Python value from a pickle of plain data and of objects of classes a
// caller allows (UnpickleObjects): the metadata of formats such as
// torch.distributed.checkpoint's `.metadata`, which pickles dataclasses.
struct PickledValue {
  // Declared so that clang (tools/fuzz.sh) accepts `entries`: with
  // libstdc++ 12 in C++20, the implicit constructor makes std::pair check a
  // PickledValue that is not complete yet (gcc accepts either).
  PickledValue() = default;
  enum class Kind { kNone, kBool, kInt, kFloat, kStr, kTuple, kList, kDict, kGlobal, kObject };
  Kind kind = Kind::kNone;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // kStr (text or bytes); kGlobal, kObject: "module.Class"
  std::vector<PickledValue> items;  // kTuple, kList; kObject: constructor arguments
  std::vector<std::pair<PickledValue, PickledValue>> entries;  // kDict, in order
  std::vector<PickledValue> state;  // kObject: what BUILD set (none or one value)
};

// Runs `pickle` (protocols 0-4) with the same strict VM as the archive
// reader, except that calling a global (REDUCE, NEWOBJ) of `classes` makes a
// kObject of it instead of running anything, and BUILD sets its state. Any
// other global, a persistent id, a cycle, nesting past 1000 levels or a
// result of more than a few values per byte of the pickle (shared objects
// expanded) is a DataLoss error naming `name` and what was wrong.
absl::StatusOr<PickledValue> UnpickleObjects(const std::string& name, const std::string& pickle,
                                             const std::set<std::string>& classes);

// What ReadTorchArchiveInOnePass does with tensor data.
enum class TensorData {
  kRead,          // read into the tensors' storages (a load)
  kChecksumOnly,  // only checksummed, through a fixed buffer (a verify): the
                  // tensors have their dtype, sizes and strides but no data,
                  // except those named in `keep` and those that are not
                  // exactly their storage's bytes (see below)
};

// CRC-32C of each storage record's bytes, by the storage the tensors share.
// Look up only storages of the archive's tensors (held by them, so their
// addresses cannot have been reused).
using RecordCrcs = std::unordered_map<const c10::StorageImpl*, uint32_t>;

struct ChecksummedArchive {
  UnpickledArchive archive;
  uint64_t bytes = 0;   // the file's size
  uint32_t crc32c = 0;  // CRC-32C of the whole file
  RecordCrcs record_crc32c;
};

// ReadTorchArchive for a file whose every byte a checkpoint manifest's
// CRC-32C covers, in one sequential pass: each storage record is read once
// and checksummed as it is read; with kRead its storage is the record's
// bytes in a private, copy-on-write mapping of the file that the storages
// keep alive (read into fresh memory where the file cannot be mapped), with
// kChecksumOnly it goes through a fixed buffer (or into fresh memory when
// kept); the bytes between records
// are read and checksummed too, and the whole file's CRC-32C is assembled
// from the pieces' (Crc32cCombine); the caller compares it with the
// manifest's. Deflated records are inflated after the pass, straight into
// their storage (or through fixed buffers when only checksummed).
// With kChecksumOnly, memory is one fixed buffer plus the pickle's objects,
// whatever the file's size, except for the data of the top-level dict's
// tensors named in `keep` and of tensors that are not exactly their storage
// (views sharing one, as torch.save writes them; never written by
// SaveTensorDict), which is kept: their checksum needs their data.
// Accepts and rejects the same archives as ReadTorchArchive (some errors are
// worded differently), and gives the same values.
absl::StatusOr<ChecksummedArchive> ReadTorchArchiveInOnePass(
    const std::string& path, TensorData data, const std::set<std::string>& keep = {});

// CRC-32C of `t`'s elements in order (of t.contiguous()'s bytes), for a
// tensor of an archive read by ReadTorchArchiveInOnePass: its record's
// checksum when `t` is exactly its storage's bytes, else computed from its
// data; nullopt when that data was not kept.
std::optional<uint32_t> TensorCrc32c(const RecordCrcs& records, const at::Tensor& t);

}  // namespace internal
}  // namespace state_dict
