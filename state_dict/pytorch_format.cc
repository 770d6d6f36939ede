#include "state_dict/pytorch_format.h"

#include <vector>

#include <torch/csrc/jit/serialization/pickle.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "state_dict/internal/file_io.h"
#include "state_dict/internal/unpickler.h"

namespace state_dict {

absl::Status SaveIValue(const c10::IValue& value, const std::string& path) {
  std::vector<char> bytes;
  try {
    bytes = torch::jit::pickle_save(value);
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot serialise state for ", path, ": ", e.what_without_backtrace()));
  }
  return internal::WriteFileAtomically(
      path, absl::string_view(bytes.data(), bytes.size()));
}

absl::StatusOr<c10::IValue> LoadIValue(const std::string& path) {
  auto archive = internal::ReadTorchArchive(path);
  if (!archive.ok()) return archive.status();
  return std::move(archive->value);
}

absl::StatusOr<std::string> SerializeTensorDict(const TensorDict& tensors) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& item : tensors) {
    if (!item.value().defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot save tensor '", item.key(), "': it is undefined"));
    }
    dict.insert(item.key(), item.value().detach().to(at::kCPU).contiguous());
  }
  try {
    std::vector<char> bytes = torch::jit::pickle_save(c10::IValue(dict));
    return std::string(bytes.data(), bytes.size());
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot serialise tensors: ", e.what_without_backtrace()));
  }
}

absl::Status SaveTensorDict(const TensorDict& tensors, const std::string& path) {
  auto bytes = SerializeTensorDict(tensors);
  if (!bytes.ok()) {
    return absl::Status(bytes.status().code(),
                        absl::StrCat(path, ": ", bytes.status().message()));
  }
  return internal::WriteFileAtomically(path, *bytes);
}

absl::StatusOr<LoadedTensorDict> LoadTensorDict(const std::string& path) {
  auto archive = internal::ReadTorchArchive(path);
  if (!archive.ok()) return archive.status();
  if (!archive->value.isGenericDict()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": expected a dict of tensors, found ",
        archive->value.tagKind()));
  }
  LoadedTensorDict out;
  for (const auto& entry : archive->value.toGenericDict()) {
    if (!entry.key().isString()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": expected string keys, found ", entry.key().tagKind()));
    }
    const std::string& name = entry.key().toStringRef();
    if (!entry.value().isTensor()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": entry '", name, "' is a ", entry.value().tagKind(),
          ", expected a tensor"));
    }
    out.tensors.insert(name, entry.value().toTensor());
  }
  out.metadata = std::move(archive->metadata);
  return out;
}

}  // namespace state_dict
