// Checks a PyTorch zip archive before LibTorch's reader is constructed on it.
//
// Why: LibTorch 1.13's caffe2::serialize::PyTorchStreamReader constructor
// opens the zip with miniz (mz_zip_reader_init, which allocates the reader's
// state) and only then checks the archive's layout: at least one record, the
// first record's name inside a folder ("archive/..."), a version record
// ("<folder>/.data/version", else "<folder>/version") that extracts (CRC
// intact) and holds an integer in the supported range. Each failed check
// throws from the constructor, so the destructor that would free miniz's
// state never runs: every such archive leaked ~300 bytes (found by
// LeakSanitizer under libFuzzer, tools/fuzz.sh). miniz is linked into
// libtorch_cpu without a header, so the state cannot be freed from outside.
// Rechecked on LibTorch 2.15: unchanged (a zip without its version record,
// opened three times under LeakSanitizer: 3 direct leaks from
// mz_zip_reader_init, 456 bytes, plus the central directory they hold).
//
// PrecheckTorchArchive parses the zip's end records, central directory and
// version record itself and refuses, with an error naming the file and what
// is wrong, every archive on which those post-init checks would throw. It
// accepts everything PyTorch writes (stored records, ZIP64 end records) and
// standard zip tools' variations (archive comments, deflated records, data
// descriptors). It is stricter than miniz only for archives no PyTorch
// writer produces (e.g. a version record over 64 KiB). It also refuses a
// record with bytes that is marked as a directory: miniz would "extract" it
// as nothing and the reader would hand out uninitialised memory as its data,
// and a deflated record claiming more than deflate's 1032:1 maximum expansion
// (the reader allocates the claimed size before inflating: gigabytes for a
// kilobyte file).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "state_dict/internal/zip_format.h"

namespace state_dict {
namespace internal {

// OK when PyTorchStreamReader can be constructed on `path` without throwing
// after it has opened the zip (the reader may still reject the file before
// that point, which leaks nothing). Otherwise DataLoss (NotFound for a missing
// file) with "<path>: not a readable PyTorch archive: <what is wrong>".
absl::Status PrecheckTorchArchive(const std::string& path);

// One record of the zip's central directory (ZIP64 sizes applied).
struct ZipEntry {
  std::string name;
  uint16_t flags = 0;
  uint16_t method = 0;  // 0 stored, 8 deflated
  uint32_t crc32 = 0;
  uint64_t compressed = 0;
  uint64_t uncompressed = 0;
  uint64_t local_header = 0;  // offset of the record's local header
  uint32_t external_attributes = 0;
};

// Where `e`'s data begins, from the kZipLocalHeaderSize bytes at
// e.local_header (its name and extra field may differ from the central
// directory's); nullopt when they are not a local header.
std::optional<uint64_t> ZipDataOffset(const ZipEntry& e, const char* local_header);
// Flags of records miniz refuses to extract (encrypted, compressed patch
// data, strong encryption).
constexpr uint16_t kZipUnsupportedFlags = 0x0001 | 0x0020 | 0x0040;

// What PrecheckTorchArchive read: the file's size when it was checked, the
// folder LibTorch's reader prefixes every record name with ("archive/"), and
// the central directory's records in its order. Sizes and offsets are as
// the file claims them: only the central directory itself and the version
// record were checked against the file's size.
struct ZipDirectory {
  uint64_t file_bytes = 0;
  std::string folder;
  std::vector<ZipEntry> entries;
};

// PrecheckTorchArchive that also returns the directory it read, so that a
// caller can read records itself (same errors).
absl::StatusOr<ZipDirectory> ReadTorchArchiveDirectory(const std::string& path);

}  // namespace internal
}  // namespace state_dict
