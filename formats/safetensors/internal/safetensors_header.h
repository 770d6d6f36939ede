// The safetensors header, read and written in one place: the one parser and
// validator behind LoadSafetensors (safetensors.cc), SafetensorsFile
// (safetensors_file.cc) and HfCheckpointFiles, and the one header writer
// behind SaveSafetensors and HfCheckpointWriter (hf/hf_checkpoint_files.cc).
// Private to //formats (target :safetensors_header); the file format itself
// is described in safetensors/safetensors.h.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace formats {
namespace internal {

// The reference implementation refuses headers longer than this.
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

struct SafetensorsDtype {
  absl::string_view name;  // as the header spells it ("BF16")
  c10::ScalarType type;
};

// The dtype's safetensors name; nullptr for a torch dtype safetensors has no
// name for (complex128, the quantized ones, ...).
const SafetensorsDtype* SafetensorsDtypeOf(c10::ScalarType type);

// Every safetensors name this reader and writer know, comma-separated, for
// messages.
std::string SafetensorsDtypeNames();

// A name or string from a file (or a caller) as an error message shows it:
// quoted, non-printable bytes escaped, long ones cut.
std::string Quote(absl::string_view s);

bool IsValidUtf8(absl::string_view s);

std::string ShapeString(const std::vector<int64_t>& shape);

// ---- reading ----------------------------------------------------------------

struct SafetensorsHeaderTensor {
  std::string name;
  const SafetensorsDtype* dtype = nullptr;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  uint64_t begin = 0;  // data_offsets: [begin, end) of the data buffer
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<SafetensorsHeaderTensor> tensors;  // in the header's order
  std::map<std::string, std::string> metadata;   // "__metadata__"
  uint64_t data_start = 0;                       // 8 + the header's length
  uint64_t data_bytes = 0;                       // file size - data_start
};

// Reads and validates the header of the safetensors file open on `fd`
// (`path` names it in messages), with every check LoadSafetensors documents
// but the BOOL bytes: a regular file of at least 8 bytes, the header length
// within the limit and the file, the JSON, every tensor's fields, no
// duplicate names, and the tensors tiling the data exactly, which makes the
// file's size 8 + header length + the data the header implies (a truncated
// file, or one whose header claims more, fails naming the tensor that runs
// past the end). DataLoss for a corrupt file, naming it. `max_bytes` (0:
// none) bounds the header and data together: ResourceExhausted before the
// header is read (LoadOptions::max_bytes). Reads only the 8 + N header
// bytes.
absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(int fd, const std::string& path,
                                                        uint64_t max_bytes);

// Reads exactly `size` bytes at `offset` with pread (EINTR and short reads
// retried); a file that ends first is DataLoss naming `what` and the file.
absl::Status ReadAt(int fd, const std::string& path, uint64_t offset, void* out, uint64_t size,
                    absl::string_view what);

// The BOOL check of LoadSafetensors: DataLoss naming the file, the tensor and
// the element (counted from `first_element`) when a byte is neither 0 nor 1.
absl::Status CheckBoolBytes(const std::string& path, const std::string& tensor, const void* bytes,
                            uint64_t count, uint64_t first_element);

// ---- writing ----------------------------------------------------------------

struct SafetensorsEntry {
  std::string name;
  const SafetensorsDtype* dtype = nullptr;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;  // numel * element size
  uint64_t begin = 0;  // set by LayOutBySize
};

// Places the entries' data back to back, largest elements first (stable:
// the entries' order within an element size), so that every tensor starts
// at a multiple of its element size, as Python's writer does; sets each
// `begin` and returns the data's total bytes.
uint64_t LayOutBySize(std::vector<SafetensorsEntry>& entries);

// The header's JSON: "__metadata__" (`metadata`, in key order) first, then
// the entries in their order, padded with spaces to a multiple of 8 bytes (so
// that the data starts 8-byte aligned after the 8-byte length). Names and
// strings must be valid UTF-8 (the caller checks; they are escaped as JSON).
std::string SafetensorsHeaderText(const std::map<std::string, std::string>& metadata,
                                  const std::vector<SafetensorsEntry>& entries);

}  // namespace internal
}  // namespace formats
