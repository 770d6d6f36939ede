// The `.metadata` file of a torch.distributed.checkpoint (DCP) directory:
// Python's pickle of torch.distributed.checkpoint.metadata.Metadata, as
// FileSystemWriter.finish writes it, read with the strict pickle VM
// (formats/pickle/pickle_vm.h: UnpickleObjects) that allows only the classes DCP's metadata
// is made of, and written as a protocol-2 pickle of the same classes that
// Python's pickle.load (FileSystemReader.read_metadata) reads.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"

namespace formats {

// ChunkStorageMetadata: a box of the tensor (per-dimension offsets, sizes).
struct DcpChunk {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
};

// One entry of state_dict_metadata: TensorStorageMetadata (a tensor of
// `size` and `dtype` saved as `chunks`) or BytesStorageMetadata (any other
// value, saved with torch.save).
struct DcpEntry {
  std::string key;  // the flattened key ("model.0.weight")
  bool is_bytes = false;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> size;
  std::vector<DcpChunk> chunks;
};

// A storage_data key (MetadataIndex): a tensor chunk by its offsets, a bytes
// entry with none.
struct DcpIndex {
  std::string fqn;
  std::optional<std::vector<int64_t>> offset;
  bool operator<(const DcpIndex& o) const {
    return std::tie(fqn, offset) < std::tie(o.fqn, o.offset);
  }
};

// _StorageInfo: where an item's bytes are (a torch.save archive for a
// tensor chunk, torch.save's bytes for a bytes entry).
struct DcpStorage {
  std::string relative_path;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// A flattened key's place in the nested state dict (planner_data):
// ("optim", "param_groups", 0, "lr").
using DcpPath = std::vector<std::variant<std::string, int64_t>>;

struct DcpMetadata {
  std::vector<DcpEntry> entries;           // state_dict_metadata, in order
  std::map<DcpIndex, DcpStorage> storage;  // storage_data
  std::map<std::string, DcpPath> paths;    // planner_data (flatten mapping)
  std::string version;                     // "1.0.0" as torch 2.x writes
};

// Reads `pickle` (the bytes of `name`). Everything is checked that a load
// relies on: known classes and dtypes only, shapes and chunk boxes
// non-negative and inside their tensor, every chunk and bytes entry having
// a storage_data record. Chunk overlap and coverage are the caller's (they
// need the data). Errors: DataLoss naming `name` and the key.
absl::StatusOr<DcpMetadata> ParseDcpMetadata(const std::string& name, const std::string& pickle);

// The pickle Python's DCP reads back as an equal Metadata.
std::string SerializeDcpMetadata(const DcpMetadata& metadata);

// Python's name of a dtype ("float32", "bfloat16"); nullopt when DCP has none.
std::optional<std::string> DcpDtypeName(c10::ScalarType dtype);

}  // namespace formats
