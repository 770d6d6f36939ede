// What state_dict's checkpoint and DCP code need of the torch.save format
// beyond its public API (torch_save.h), a seam no other package should use:
// the one-pass checksummed read under every checkpoint load and verify, and
// the write of tensors that their owner changes again once they are written
// (AsyncCheckpointer's saves without a snapshot).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "formats/io/file_io.h"
#include "formats/torch_save/torch_archive_reader.h"
#include "formats/torch_save/torch_save.h"

namespace formats {

// LoadTensorDict of a file a checkpoint manifest checksums (checkpoint.cc's
// loads and verify): one sequential pass, the file's size and CRC-32C and
// each record's CRC-32C computed on the way (
// ReadTorchArchiveInOnePass; per-tensor checksums with TensorCrc32c). With
// TensorData::kChecksumOnly the tensors carry no data except those whose keys
// are in `keep`.
struct ChecksummedTensorDict {
  LoadedTensorDict loaded;
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
  RecordCrcs record_crc32c;
};
absl::StatusOr<ChecksummedTensorDict> ReadChecksummedTensorDict(
    const std::string& path, TensorData data, const std::set<std::string>& keep = {});

// WriteTensorDict of live tensors, which their owner will change again once
// `written` has run (AsyncCheckpointer's saves without a snapshot). Each
// tensor's version counter must still be the one in `versions` (recorded
// when the save was asked for) once all bytes are written: else DataLoss
// naming it, and nothing is committed. `written` runs once every byte is in
// the kernel's hands, before the fsync.
struct LiveTensors {
  std::map<const c10::TensorImpl*, int64_t> versions;
  std::function<void()> written;
};
absl::StatusOr<WrittenTensorDict> WriteTensorDict(const TensorDict& tensors,
                                                  const std::string& path, const LiveTensors* live);

// The spec of each tensor of `tensors`, in order; InvalidArgument naming the
// tensor and `path` for an undefined one.
absl::StatusOr<std::vector<TensorSpec>> TensorSpecsOf(const TensorDict& tensors,
                                                      const std::string& path);

// The streamed WriteTensorDict under both: `before_commit` (may be empty)
// runs once every record is written and the file is complete, before its
// fsync and rename; its error leaves nothing behind.
absl::StatusOr<WrittenTensorDict> WriteTensorRecords(
    const std::vector<TensorSpec>& specs, const TensorSource& source, const std::string& path,
    const std::function<absl::Status()>& before_commit);

// SaveIValue's torch.save archive, appended to `file` at its current end
// (zip offsets relative to the archive's first byte): DCP's .distcp files
// hold one per item.
absl::Status AppendTorchSave(const c10::IValue& value, AtomicFileWriter& file);

}  // namespace formats
