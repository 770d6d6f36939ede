#include "formats/safetensors/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "formats/io/file_io.h"
#include "formats/safetensors/internal/safetensors_header.h"

namespace formats {
namespace {

using internal::IsValidUtf8;
using internal::kSafetensorsMaxHeaderBytes;
using internal::Quote;
using internal::SafetensorsDtype;
using internal::SafetensorsDtypeNames;
using internal::SafetensorsDtypeOf;
using internal::SafetensorsEntry;

absl::Status ErrnoError(absl::string_view what, const std::string& path) {
  const int error = errno;
  return absl::Status(absl::ErrnoToStatusCode(error),
                      absl::StrCat(what, " ", path, ": ", std::strerror(error)));
}

// An open file descriptor, closed when it goes.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

absl::Status SaveSafetensors(const TensorDict& tensors, const std::string& path,
                             const std::map<std::string, std::string>& metadata) {
  auto invalid = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot save ", path, " as safetensors: ", what));
  };
  std::vector<SafetensorsEntry> entries;
  std::vector<const at::Tensor*> sources;  // entries[i]'s tensor
  entries.reserve(tensors.size());
  sources.reserve(tensors.size());
  for (const auto& item : tensors) {
    const std::string& name = item.key();
    const at::Tensor& t = item.value();
    const std::string what = absl::StrCat("tensor ", Quote(name));
    if (name == "__metadata__") return invalid("a tensor may not be named \"__metadata__\"");
    if (!IsValidUtf8(name)) return invalid(absl::StrCat(what, ": the name is not valid UTF-8"));
    if (!t.defined()) return invalid(absl::StrCat(what, " is undefined"));
    if (t.layout() != c10::kStrided) {
      return invalid(absl::StrCat(what, " has layout ", c10::str(t.layout()),
                                  "; safetensors holds dense (strided) tensors only"));
    }
    const SafetensorsDtype* dtype = SafetensorsDtypeOf(t.scalar_type());
    if (dtype == nullptr) {
      return invalid(absl::StrCat(what, " has dtype ", c10::toString(t.scalar_type()),
                                  ", which safetensors has no name for; it holds ",
                                  SafetensorsDtypeNames()));
    }
    SafetensorsEntry& e = entries.emplace_back();
    e.name = name;
    e.dtype = dtype;
    e.shape = t.sizes().vec();
    e.bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    sources.push_back(&t);
  }
  std::map<std::string, std::string> meta = metadata;
  meta.emplace("format", "pt");  // unless the caller gave one
  for (const auto& [key, value] : meta) {
    if (!IsValidUtf8(key) || !IsValidUtf8(value)) {
      return invalid(absl::StrCat("metadata entry ", Quote(key), ": not valid UTF-8"));
    }
  }

  // The data: largest elements first (stable: the dict's order within a
  // size), so that each tensor starts at a multiple of its element size.
  internal::LayOutBySize(entries);
  std::vector<size_t> layout(entries.size());
  std::iota(layout.begin(), layout.end(), size_t{0});
  std::sort(layout.begin(), layout.end(),
            [&](size_t a, size_t b) { return entries[a].begin < entries[b].begin; });

  std::string header = internal::SafetensorsHeaderText(meta, entries);
  if (header.size() > kSafetensorsMaxHeaderBytes) {
    return invalid(absl::StrCat("its header would take ", header.size(), " bytes, more than the ",
                                kSafetensorsMaxHeaderBytes, " that safetensors readers accept (",
                                entries.size(), " tensors)"));
  }

  auto file = AtomicFileWriter::Open(path);
  if (!file.ok()) return file.status();
  const uint64_t header_bytes = header.size();
  char length[8];
  std::memcpy(length, &header_bytes, sizeof(length));  // little-endian (static_assert in internal/)
  absl::Status status = (*file)->Append(length, sizeof(length));
  if (status.ok()) status = (*file)->Append(header.data(), header.size());
  if (!status.ok()) return status;
  header = std::string();
  for (const size_t i : layout) {
    const SafetensorsEntry& e = entries[i];
    if (e.bytes == 0) continue;
    at::Tensor data;
    try {
      // Conjugate and negative views are lazy bits over unchanged data:
      // resolve them, then bring the bytes to the CPU in row-major order.
      data = sources[i]->detach().resolve_conj().resolve_neg();
      if (!data.device().is_cpu()) data = data.to(c10::kCPU);
      data = data.contiguous();
    } catch (const c10::Error& error) {
      return invalid(absl::StrCat("tensor ", Quote(e.name), " cannot be copied to the CPU: ",
                                  error.what_without_backtrace()));
    }
    if (static_cast<uint64_t>(data.numel()) * data.element_size() != e.bytes) {
      return invalid(absl::StrCat("tensor ", Quote(e.name), " changed size while being saved"));
    }
    status = (*file)->Append(data.data_ptr(), e.bytes);
    if (!status.ok()) return status;
  }
  return (*file)->Commit();
}

absl::StatusOr<LoadedSafetensors> LoadSafetensors(const std::string& path,
                                                  const LoadOptions& options) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoError("cannot open", path);
  auto header = internal::ReadSafetensorsHeader(fd.get(), path, options.max_bytes);
  if (!header.ok()) return header.status();

  LoadedSafetensors out;
  out.metadata = std::move(header->metadata);
  for (internal::SafetensorsHeaderTensor& t : header->tensors) {
    const uint64_t bytes = t.end - t.begin;
    at::Tensor tensor;
    try {
      tensor = at::empty(t.shape, at::TensorOptions().dtype(t.dtype->type));
    } catch (const c10::Error& error) {
      return absl::ResourceExhaustedError(
          absl::StrCat(path, ": cannot allocate tensor ", Quote(t.name), " (", bytes,
                       " bytes): ", error.what_without_backtrace()));
    }
    if (bytes > 0) {
      absl::Status status =
          internal::ReadAt(fd.get(), path, header->data_start + t.begin, tensor.data_ptr(), bytes,
                           absl::StrCat("tensor ", Quote(t.name)));
      if (!status.ok()) return status;
    }
    if (t.dtype->type == c10::ScalarType::Bool) {
      absl::Status status = internal::CheckBoolBytes(path, t.name, tensor.data_ptr(), bytes, 0);
      if (!status.ok()) return status;
    }
    out.tensors.insert(std::move(t.name), std::move(tensor));
  }
  return out;
}

}  // namespace formats
