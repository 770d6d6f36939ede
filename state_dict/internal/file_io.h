// Durable file primitives for checkpoints: every file is written under a
// temporary name, fsynced, renamed into place and its directory fsynced, so a
// reader (or a crash) sees either the old state or the complete new file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace state_dict {
namespace internal {

// CRC-32C (Castagnoli polynomial 0x1EDC6F41, reflected 0x82F63B78), the
// checksum of iSCSI/ext4/LevelDB. Table driven; `crc` continues a previous
// call (start with 0).
uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);

// Writes `contents` to `path` atomically and durably: a temporary file in the
// same directory is written, fsynced and renamed over `path`, then the
// directory is fsynced so the rename itself survives a power loss.
absl::Status WriteFileAtomically(const std::string& path,
                                 absl::string_view contents);

// Reads a whole file. NotFound when it does not exist.
absl::StatusOr<std::string> ReadFile(const std::string& path);

// mkdir -p, then fsync of the parent so the new entry is durable.
absl::Status CreateDirectories(const std::string& path);

absl::Status FsyncDirectory(const std::string& path);

bool PathExists(const std::string& path);

// Names of the entries of a directory (not "." or "..").
absl::StatusOr<std::vector<std::string>> ListDirectory(const std::string& path);

}  // namespace internal
}  // namespace state_dict
