// One safetensors file read a range at a time, without loading it: for
// loaders that must never hold a whole model (a rank reads its shard of each
// tensor, plus at most one tensor at a time).
//
//   auto file = formats::SafetensorsFile::Open("model-00001-of-00002.safetensors");
//   auto info = file->info("model.embed_tokens.weight");      // dtype, shape, offset
//   at::Tensor rows = *file->Read("model.embed_tokens.weight",  // elements [4096, 8192)
//                                 4096, 4096);                  // of the flattened tensor
//
// Open reads and validates the header only, with exactly LoadSafetensors'
// checks (one implementation, safetensors/internal/safetensors_header.h),
// which include that the file's size is 8 + the header's length + the data
// its tensors' offsets imply: a truncated file, or one whose header claims
// more or less than the file holds, is DataLoss at Open, naming the file
// (and the tensor that runs past its end). The tensors' bytes are read by
// Read, with pread on the file descriptor the object keeps open (no mmap:
// mapped pages count in the process's RSS), and only the bytes asked for.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace formats {

struct SafetensorsTensorInfo {
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t offset = 0;  // of its first byte in the file (8 + header + data_offsets[0])
  int64_t bytes = 0;   // numel * element size
};

class SafetensorsFile {
 public:
  // Opens `path` and reads its header. Errors: NotFound (or the errno's
  // code) when it cannot be opened; InvalidArgument when it is not a regular
  // file; DataLoss for every malformed or lying header LoadSafetensors
  // refuses, naming the file (and the tensor).
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();  // closes the file

  const std::string& path() const { return path_; }
  // "__metadata__"; empty when the file has none.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The tensors' names in the header's order.
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  // NotFound naming the file and the tensor when the header has no `name`.
  absl::StatusOr<SafetensorsTensorInfo> info(const std::string& name) const;

  // Elements [element_offset, element_offset + numel) of the flattened
  // (row-major) tensor `name`, as a fresh contiguous 1-D CPU tensor of the
  // file's dtype; reads those numel * element size bytes and no others.
  // Errors name the file and the tensor: NotFound for an unknown name,
  // InvalidArgument for a negative offset or count or a range past the
  // tensor's numel, DataLoss for a BOOL byte other than 0 or 1 in the range
  // (as LoadSafetensors) or a file that shrank since Open. Read and ReadAll
  // may run on several threads at once (pread keeps no file position).
  absl::StatusOr<at::Tensor> Read(const std::string& name, int64_t element_offset,
                                  int64_t numel) const;
  // The same elements into `out`, the caller's buffer (so that a loader can
  // reuse one): a contiguous CPU tensor of the file's dtype whose numel is
  // the count read. InvalidArgument naming the file, the tensor and `out`'s
  // dtype, device or layout when it is not one; Read's errors otherwise.
  absl::Status ReadInto(const std::string& name, int64_t element_offset,
                        const at::Tensor& out) const;
  // The whole tensor, in its shape (what LoadSafetensors gives for it).
  absl::StatusOr<at::Tensor> ReadAll(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  // `name`'s entry, or NotFound "<who_prefix><path>: no tensor ...".
  absl::StatusOr<const SafetensorsTensorInfo*> Find(const std::string& name,
                                                    const char* who_prefix) const;

  std::string path_;
  int fd_ = -1;
  std::map<std::string, std::string> metadata_;
  std::vector<std::string> names_;
  std::vector<SafetensorsTensorInfo> infos_;       // names_[i]'s
  std::unordered_map<std::string, size_t> index_;  // name -> i
};

}  // namespace formats
