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
// kilobyte file), and any record whose compressed bytes would run past the
// end of the file (a ZIP64 entry declaring a 16 GiB stored record in a
// 2 KB file made the reader allocate 16 GiB before reading a byte).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "formats/zip/zip_format.h"

namespace formats {

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
  // The archive's bytes are [base, base + file_bytes) of the file: the whole
  // file (base 0), or an archive embedded in a larger one (DCP's .distcp
  // files hold one torch.save archive per item; zip offsets are relative to
  // the archive's first byte).
  uint64_t base = 0;
  bool whole_file = true;
  uint64_t file_bytes = 0;
  std::string folder;
  std::vector<ZipEntry> entries;
};

// PrecheckTorchArchive that also returns the directory it read, so that a
// caller can read records itself (same errors). Every record's compressed
// bytes (after a local header's fixed part) lie inside the file, and a
// deflated record declares at most deflate's maximum expansion of them, so
// no declared size exceeds 1032 times the file's size.
absl::StatusOr<ZipDirectory> ReadTorchArchiveDirectory(const std::string& path);

// Bytes [offset, offset + length) of a file, and the name errors give them.
struct FileRegion {
  std::string path;
  uint64_t offset = 0;
  uint64_t length = 0;
  std::string Name() const;  // "<path> (bytes <offset>..<offset + length>)"
};

// ReadTorchArchiveDirectory for an archive embedded in `region`: the region
// must lie inside the file, and everything the archive declares inside the
// region. Errors name the region.
absl::StatusOr<ZipDirectory> ReadTorchArchiveDirectory(const FileRegion& region);

// The sum of the uncompressed sizes `directory`'s records declare (saturated
// at UINT64_MAX), and the part of it in records under "<folder>data/" (the
// tensors' storages), for a caller's byte budget.
struct DeclaredBytes {
  uint64_t total = 0;
  uint64_t storages = 0;
};
DeclaredBytes DeclaredRecordBytes(const ZipDirectory& directory);

// Reads records of an archive ReadTorchArchiveDirectory accepted, by their
// directory entries, without LibTorch's reader: whose getRecord allocates
// the size an entry declares before reading anything, and inflates a
// deflated record through a second buffer. Here a stored record is read
// straight into the caller's memory, and a deflated one is inflated
// straight into it, its compressed bytes read through one fixed buffer:
// memory is the record's declared size plus that buffer. A record that
// inflates to more (or fewer) bytes than its entry declares is an error
// naming it. No zip CRC-32 is checked (LibTorch's miniz checks none
// either). Errors are DataLoss "<path>: cannot read PyTorch archive: ...".
class ZipRecordReader {
 public:
  // Opens `path`, which must still be `directory.file_bytes` long (else the
  // file changed since it was checked: an error), or for an embedded archive
  // still hold its region. `directory` must outlive the reader; errors name
  // `path` (a region's Name() for an embedded archive).
  static absl::StatusOr<std::unique_ptr<ZipRecordReader>> Open(const std::string& path,
                                                               const ZipDirectory& directory,
                                                               const std::string& name = "");
  ~ZipRecordReader();
  ZipRecordReader(const ZipRecordReader&) = delete;
  ZipRecordReader& operator=(const ZipRecordReader&) = delete;

  int fd() const { return fd_; }
  uint64_t file_bytes() const { return directory_.file_bytes; }

  // `size` bytes at `offset` of the archive, which the caller has checked
  // lie in it.
  absl::Status ReadAt(uint64_t offset, char* out, size_t size);
  // Where `e`'s data begins (after its local header's name and extra field,
  // which may differ from the central directory's), checked, with its
  // compressed size, to lie inside the file.
  absl::StatusOr<uint64_t> DataOffset(const ZipEntry& e);
  // `e`'s e.uncompressed bytes into `out` (stored: read; deflated:
  // inflated). Stored or deflated records only.
  absl::Status ReadInto(const ZipEntry& e, char* out);
  // `e`'s uncompressed bytes, in order, handed to `piece` in pieces of at
  // most kPieceBytes, through fixed buffers (for a checksum of a record
  // whose data is not kept).
  static constexpr size_t kPieceBytes = size_t{1} << 20;
  absl::Status ReadInPieces(const ZipEntry& e,
                            const std::function<void(const char*, size_t)>& piece);

 private:
  ZipRecordReader(std::string name, const ZipDirectory& directory, int fd)
      : path_(std::move(name)), directory_(directory), fd_(fd) {}
  absl::Status Error(absl::string_view what) const;
  // Inflates `e` (deflated, its data at `offset`) into `out` when not null
  // (e.uncompressed bytes), else through a window handed to `piece`.
  absl::Status Inflate(const ZipEntry& e, uint64_t offset, char* out,
                       const std::function<void(const char*, size_t)>* piece);

  std::string path_;
  const ZipDirectory& directory_;
  int fd_;
  std::unique_ptr<char[]> input_;  // compressed bytes, kPieceBytes
};

}  // namespace formats
