// The torch.save archive reader: a whole load, and the one-pass checksummed
// read under every checkpoint load and verify. A seam: torch_save.cc and
// state_dict's DCP reader (state_dict/dcp.cc, one archive per .distcp item)
// use it; nothing else should.
// The zip bytes come from the byte layer (formats/zip/zip_precheck.h: the
// checked central directory, regions, record reads; formats/io/crc32c.h),
// the pickle is run by the pickle VM (formats/pickle/pickle_vm.h) with the
// storages this reader reads. torch_save.cc turns what it returns into
// tensor dicts.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>

#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"
#include "formats/pickle/pickle_vm.h"
#include "formats/zip/zip_precheck.h"

namespace formats {

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
// Time is linear in the file (see UnpickleArchive).
absl::StatusOr<UnpickledArchive> ReadTorchArchive(const std::string& path,
                                                  const ArchiveLimits& limits = {});
// The same for an archive embedded in a region of a file (DCP's .distcp
// files: one torch.save archive per item); errors name the region.
absl::StatusOr<UnpickledArchive> ReadTorchArchive(const FileRegion& region,
                                                  const ArchiveLimits& limits = {});

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

}  // namespace formats
