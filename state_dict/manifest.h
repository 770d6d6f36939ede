// The manifest of a checkpoint step directory: what a complete checkpoint
// contains, written last so that its presence means "complete".
//
// On disk it is a small line-oriented text file, `MANIFEST`, e.g.
//
//   torchfsdp-checkpoint 2
//   kind sharded
//   step 1200
//   world_size 2
//   file rank_00000.pt rank 0 bytes 2311 crc32c 8a1f03c2 tensors 2
//   tensor 0.weight name 0.weight dtype Float shape 3,4 offset 0 numel 6 crc32c 1b2c...
//   tensor 0.bias name 0.bias dtype Float shape 3 offset 0 numel 3 crc32c ...
//   file rank_00001.pt rank 1 bytes ... tensors 1
//   tensor 0.weight name 0.weight dtype Float shape 3,4 offset 6 numel 6 crc32c ...
//   end crc32c 5e0c21a7
//
// Names and keys are FQNs and may not contain whitespace. Checksums are
// CRC-32C: per file over all its bytes, per tensor over its contiguous data,
// and the manifest's own over every byte before its "end" line, so that an
// edit anywhere in it (a shape changed to another of the same size, which
// no data file can contradict for a sharded checkpoint) is caught. A reader
// refuses a format version newer than kCheckpointFormatVersion. Version 1
// (written before 2026-11-25) ends in a bare "end" line and has no checksum
// of its own; it still reads, with its fields checked as before.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"
#include "state_dict/sharded_tensor.h"

namespace state_dict {

inline constexpr int kCheckpointFormatVersion = 2;
inline constexpr char kManifestFileName[] = "MANIFEST";

enum class CheckpointKind {
  kFull,     // one PyTorch-format file with full (unsharded) tensors
  kSharded,  // one PyTorch-format file per rank with 1-D pieces
};

struct ManifestTensor {
  std::string key;   // key in the data file's dict
  std::string name;  // FQN of the original tensor
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> global_shape;
  FlatRange range;  // the piece of the flattened original; full: all of it
  uint32_t crc32c = 0;
};

struct ManifestFile {
  std::string name;  // relative to the step directory
  int rank = 0;      // 0 for a full checkpoint's file
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
  std::vector<ManifestTensor> tensors;
};

struct Manifest {
  int format_version = kCheckpointFormatVersion;
  CheckpointKind kind = CheckpointKind::kFull;
  int64_t step = 0;
  int world_size = 1;
  std::vector<ManifestFile> files;
};

std::string FormatManifest(const Manifest& manifest);

// Parses FormatManifest's output; `source` (a path) only names errors. A
// manifest without its final "end" line is incomplete, and one whose
// checksum does not match its bytes is damaged (both DataLoss); a newer
// format version is FailedPrecondition. Memory spent is bounded by the
// text's size: no number written in it is used to size anything.
absl::StatusOr<Manifest> ParseManifest(const std::string& text, const std::string& source);

const char* CheckpointKindName(CheckpointKind kind);

}  // namespace state_dict
