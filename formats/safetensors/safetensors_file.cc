#include "formats/safetensors/safetensors_file.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <utility>

#include <ATen/ops/empty.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "formats/safetensors/internal/safetensors_header.h"

namespace formats {
namespace {

using internal::Quote;

absl::Status ErrnoError(absl::string_view what, const std::string& path) {
  const int error = errno;
  return absl::Status(absl::ErrnoToStatusCode(error),
                      absl::StrCat(what, " ", path, ": ", std::strerror(error)));
}

}  // namespace

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  SafetensorsFile file;
  file.path_ = path;
  file.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (file.fd_ < 0) return ErrnoError("cannot open", path);
  auto header = internal::ReadSafetensorsHeader(file.fd_, path, /*max_bytes=*/0);
  if (!header.ok()) return header.status();
  file.metadata_ = std::move(header->metadata);
  file.names_.reserve(header->tensors.size());
  file.infos_.reserve(header->tensors.size());
  file.index_.reserve(header->tensors.size());
  for (internal::SafetensorsHeaderTensor& t : header->tensors) {
    SafetensorsTensorInfo& info = file.infos_.emplace_back();
    info.dtype = t.dtype->type;
    info.shape = std::move(t.shape);
    info.numel = t.numel;
    // Both below the file's size (the header's check), which fits off_t.
    info.offset = static_cast<int64_t>(header->data_start + t.begin);
    info.bytes = static_cast<int64_t>(t.end - t.begin);
    file.index_.emplace(t.name, file.names_.size());
    file.names_.push_back(std::move(t.name));
  }
  return file;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      metadata_(std::move(other.metadata_)),
      names_(std::move(other.names_)),
      infos_(std::move(other.infos_)),
      index_(std::move(other.index_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    metadata_ = std::move(other.metadata_);
    names_ = std::move(other.names_);
    infos_ = std::move(other.infos_);
    index_ = std::move(other.index_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<const SafetensorsTensorInfo*> SafetensorsFile::Find(const std::string& name,
                                                                   const char* who_prefix) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::NotFoundError(absl::StrCat(who_prefix, path_, ": no tensor ", Quote(name),
                                            " in its header (", names_.size(), " tensors)"));
  }
  return &infos_[it->second];
}

absl::StatusOr<SafetensorsTensorInfo> SafetensorsFile::info(const std::string& name) const {
  auto found = Find(name, "");
  if (!found.ok()) return found.status();
  return **found;
}

namespace {

absl::Status CheckRange(const std::string& path, const std::string& name,
                        const SafetensorsTensorInfo& info, int64_t element_offset, int64_t numel) {
  // Written so that nothing overflows: numel <= info.numel - element_offset.
  if (element_offset < 0 || numel < 0 || element_offset > info.numel ||
      numel > info.numel - element_offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "formats::SafetensorsFile::Read: ", path, ": tensor ", Quote(name), ": elements [",
        element_offset, ", ", element_offset, " + ", numel, "): expected a range within [0, ",
        info.numel, ") (its numel) with a non-negative offset and count"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<at::Tensor> SafetensorsFile::Read(const std::string& name, int64_t element_offset,
                                                 int64_t numel) const {
  auto found = Find(name, "formats::SafetensorsFile::Read: ");
  if (!found.ok()) return found.status();
  const SafetensorsTensorInfo& info = **found;
  if (auto s = CheckRange(path_, name, info, element_offset, numel); !s.ok()) return s;
  at::Tensor out;
  try {
    out = at::empty({numel}, at::TensorOptions().dtype(info.dtype));
  } catch (const c10::Error& error) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "formats::SafetensorsFile::Read: ", path_, ": cannot allocate ", numel, " elements of ",
        "tensor ", Quote(name), ": ", error.what_without_backtrace()));
  }
  if (auto status = ReadInto(name, element_offset, out); !status.ok()) return status;
  return out;
}

absl::Status SafetensorsFile::ReadInto(const std::string& name, int64_t element_offset,
                                       const at::Tensor& out) const {
  auto found = Find(name, "formats::SafetensorsFile::Read: ");
  if (!found.ok()) return found.status();
  const SafetensorsTensorInfo& info = **found;
  if (!out.defined() || out.scalar_type() != info.dtype || !out.device().is_cpu() ||
      !out.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "formats::SafetensorsFile::ReadInto: ", path_, ": tensor ", Quote(name), ": out is ",
        out.defined() ? absl::StrCat(c10::toString(out.scalar_type()), " on ", out.device().str(),
                                     out.is_contiguous() ? "" : ", strided")
                      : "undefined",
        ": expected a contiguous CPU tensor of the file's dtype ", c10::toString(info.dtype)));
  }
  const int64_t numel = out.numel();
  if (auto s = CheckRange(path_, name, info, element_offset, numel); !s.ok()) return s;
  const int64_t element = static_cast<int64_t>(c10::elementSize(info.dtype));
  const uint64_t bytes = static_cast<uint64_t>(numel) * static_cast<uint64_t>(element);
  if (bytes == 0) return absl::OkStatus();
  absl::Status status =
      internal::ReadAt(fd_, path_, static_cast<uint64_t>(info.offset + element_offset * element),
                       out.data_ptr(), bytes,
                       absl::StrCat("tensor ", Quote(name), " elements [", element_offset, ", ",
                                    element_offset + numel, ")"));
  if (!status.ok()) return status;
  if (info.dtype == c10::ScalarType::Bool) {
    return internal::CheckBoolBytes(path_, name, out.data_ptr(), bytes,
                                    static_cast<uint64_t>(element_offset));
  }
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> SafetensorsFile::ReadAll(const std::string& name) const {
  auto info = this->info(name);
  if (!info.ok()) return info.status();
  auto flat = Read(name, 0, info->numel);
  if (!flat.ok()) return flat.status();
  return flat->view(info->shape);
}

}  // namespace formats
