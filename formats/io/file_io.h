// Durable file primitives for checkpoints: every file is written under a
// temporary name, fsynced, renamed into place and its directory fsynced, so a
// reader (or a crash) sees either the old state or the complete new file.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "formats/io/crc32c.h"

namespace formats {

// A file written in pieces under a temporary name in its directory, with the
// CRC-32C and size of everything appended so far; Commit() fsyncs it,
// renames it over `path` and fsyncs the directory. Destroyed uncommitted (an
// error, an exception) it removes the temporary file: `path` is untouched.
// Memory is one fixed buffer that gathers small appends; appends of 64 KiB
// or more go straight to the file.
class AtomicFileWriter {
 public:
  static absl::StatusOr<std::unique_ptr<AtomicFileWriter>> Open(const std::string& path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  absl::Status Append(const void* data, size_t size);
  // Append for a caller that already has the bytes' CRC-32C (computed while
  // they were in cache): the file's checksum is extended from it instead of
  // reading them again.
  absl::Status AppendChecksummed(const void* data, size_t size, uint32_t crc32c);
  absl::Status Commit();

  uint64_t bytes() const { return bytes_; }
  uint32_t crc32c() const { return crc_; }
  const std::string& path() const { return path_; }

 private:
  AtomicFileWriter(std::string path, std::string tmp, int fd);
  absl::Status Store(const void* data, size_t size);  // buffered or direct
  absl::Status Flush();
  absl::Status WriteAll(const char* data, size_t size);

  std::string path_;
  std::string tmp_;
  int fd_;
  std::unique_ptr<char[]> buffer_;
  size_t buffered_ = 0;
  uint64_t bytes_ = 0;
  uint64_t written_ = 0;            // bytes handed to write()
  uint64_t writeback_started_ = 0;  // bytes handed to sync_file_range()
  uint32_t crc_ = 0;
  absl::Status error_;  // the first failure; later calls repeat it
};

struct FileChecksum {
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
};

// Size and CRC-32C of a file, read sequentially through one fixed buffer.
// NotFound when it does not exist.
absl::StatusOr<FileChecksum> ChecksumFile(const std::string& path);

// Writes `contents` to `path` atomically and durably: a temporary file in the
// same directory is written, fsynced and renamed over `path`, then the
// directory is fsynced so the rename itself survives a power loss.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents);

// Reads a whole file. NotFound when it does not exist.
absl::StatusOr<std::string> ReadFile(const std::string& path);

// mkdir -p, then fsync of the parent so the new entry is durable.
absl::Status CreateDirectories(const std::string& path);

absl::Status FsyncDirectory(const std::string& path);

bool PathExists(const std::string& path);

// Names of the entries of a directory (not "." or "..").
absl::StatusOr<std::vector<std::string>> ListDirectory(const std::string& path);

}  // namespace formats
