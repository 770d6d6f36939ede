// The zip container of torch.save files, written record by record in one
// pass over each record's bytes.
//
// The layout is the one LibTorch's caffe2::serialize::PyTorchStreamWriter
// (miniz) produces, byte for byte (tested): stored records named
// <archive>/<name>, each record's data 64-byte aligned by an "FB" padding
// field, a data descriptor after every record, ZIP64 end records, and
// `version` as the last record. It is our own because the zip CRC-32 is what
// PyTorchStreamWriter spends most of a save's CPU on (miniz's table loop,
// not exported, not replaceable) and it reads every record's bytes once for
// that, once more for our CRC-32C and once to write them. Here each record
// is read once: 256 KiB pieces go through libdeflate's carry-less-multiply
// CRC-32, the CRC-32C and the file while they are in cache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "formats/io/file_io.h"

namespace formats {
namespace internal {

class TorchZipWriter {
 public:
  // Writes through `file` (not owned; it must outlive this writer), from
  // its current end: zip offsets are relative to that byte, so an archive
  // may follow others in one file (DCP's .distcp files). The archive name
  // prefixes every record; PyTorchStreamWriter writing to a function uses
  // "archive".
  explicit TorchZipWriter(AtomicFileWriter& file, std::string archive_name = "archive");

  // Appends the stored record <archive>/<name> with `size` bytes at `data`
  // (null allowed when size is 0) and returns their CRC-32C.
  absl::StatusOr<uint32_t> WriteRecord(absl::string_view name, const void* data, size_t size);

  // Writes the `version` record and the central directory. Nothing may be
  // written after it; the file still has to be committed.
  absl::Status Finish();

 private:
  struct Entry {
    std::string name;
    uint64_t offset;  // of the local header
    uint64_t size;
    uint32_t crc32;
  };

  AtomicFileWriter& file_;
  uint64_t base_;  // the file's size when the archive began
  std::string archive_name_;
  std::vector<Entry> entries_;
  uint64_t uncompressed_crc_hash_ = 0;
  bool finished_ = false;
};

}  // namespace internal
}  // namespace formats
