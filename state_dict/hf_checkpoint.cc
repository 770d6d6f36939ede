#include "state_dict/hf_checkpoint.h"

#include <algorithm>
#include <future>
#include <map>

#include <torch/types.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "state_dict/module_state.h"

namespace state_dict {
namespace {

bool IsFloating16or32(c10::ScalarType t) {
  return t == c10::kFloat || t == c10::kBFloat16 || t == c10::kHalf;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// InvalidArgument unless the file's dtype converts to `dtype`: equal, or
// both among float32, bfloat16 and float16.
absl::Status CheckConvertible(const formats::HfCheckpointFiles& files, const std::string& name,
                              const formats::HfTensorInfo& info, c10::ScalarType dtype) {
  if (info.dtype == dtype || (IsFloating16or32(info.dtype) && IsFloating16or32(dtype))) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("Hugging Face checkpoint ", files.dir(), ": tensor '", name, "' in ", info.file,
                   " is ", c10::toString(info.dtype), ": the model expects ", c10::toString(dtype),
                   " (float32, bfloat16 and float16 convert to each other; nothing else does)"));
}

// The checks a request's tensor must pass before anything is read.
absl::StatusOr<formats::HfTensorInfo> CheckedInfo(const formats::HfCheckpointFiles& files,
                                                  const std::string& name,
                                                  const std::vector<int64_t>& shape,
                                                  c10::ScalarType dtype) {
  if (!files.contains(name)) {
    return absl::NotFoundError(
        absl::StrCat("Hugging Face checkpoint ", files.dir(), ": no tensor '", name,
                     "', which the model has (a checkpoint of another model or configuration?)"));
  }
  auto info = files.info(name);
  if (!info.ok()) return info.status();
  if (info->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Hugging Face checkpoint ", files.dir(), ": tensor '", name, "' in ", info->file,
        " has shape ", ShapeString(info->shape), ": the model expects ", ShapeString(shape)));
  }
  if (auto s = CheckConvertible(files, name, *info, dtype); !s.ok()) return s;
  return info;
}

}  // namespace

absl::StatusOr<ShardedStateDict> ReadHfShards(
    const formats::HfCheckpointFiles& files,
    const std::vector<std::pair<std::string, ShardRequest>>& requests) {
  for (const auto& [name, request] : requests) {
    auto info = CheckedInfo(files, name, request.global_shape, request.dtype);
    if (!info.ok()) return info.status();
  }
  ShardedStateDict out;
  for (const auto& [name, request] : requests) {
    ShardedTensor tensor;
    tensor.global_shape = request.global_shape;
    tensor.dtype = request.dtype;
    for (const FlatRange& range : request.ranges) {
      auto piece = files.Read(name, range.offset, range.numel);
      if (!piece.ok()) return piece.status();
      tensor.pieces.push_back({range, piece->to(request.dtype)});
    }
    out.insert(name, std::move(tensor));
  }
  return out;
}

HfRangeReader::HfRangeReader(const formats::HfCheckpointFiles& files, int64_t chunk_bytes)
    : files_(files), chunk_bytes_(std::max<int64_t>(chunk_bytes, 64)) {}

absl::Status HfRangeReader::ReadInto(const std::string& name, FlatRange range,
                                     const torch::Tensor& destination) {
  auto info = files_.info(name);
  if (!info.ok()) return info.status();
  if (!destination.defined() || !destination.device().is_cpu() || !destination.is_contiguous() ||
      destination.numel() != range.numel) {
    return absl::InvalidArgumentError(
        absl::StrCat("HfRangeReader::ReadInto: Hugging Face checkpoint ", files_.dir(),
                     ": tensor '", name, "' elements [", range.offset, ", ", range.end(),
                     "): expected a contiguous CPU destination of ", range.numel, " elements"));
  }
  if (auto s = CheckConvertible(files_, name, *info, destination.scalar_type()); !s.ok()) {
    return s;
  }
  if (range.numel == 0) return absl::OkStatus();
  const int64_t chunk =
      std::max<int64_t>(1, chunk_bytes_ / static_cast<int64_t>(c10::elementSize(info->dtype)));
  for (torch::Tensor& buffer : staging_) {
    if (!buffer.defined() || buffer.scalar_type() != info->dtype || buffer.numel() < chunk) {
      buffer = torch::empty({chunk}, torch::TensorOptions().dtype(info->dtype));
    }
  }
  auto read = [this, &name, &range](int buffer, int64_t start, int64_t n) {
    return files_.ReadInto(name, range.offset + start, staging_[buffer].narrow(0, 0, n));
  };
  // Chunk k is read into staging_[k % 2] on another thread while chunk k-1
  // is converted into the destination here.
  std::future<absl::Status> pending =
      std::async(std::launch::async, read, 0, int64_t{0}, std::min(chunk, range.numel));
  for (int64_t start = 0, k = 0; start < range.numel; start += chunk, ++k) {
    const int64_t n = std::min(chunk, range.numel - start);
    if (absl::Status s = pending.get(); !s.ok()) return s;
    const int64_t next = start + n;
    if (next < range.numel) {
      pending = std::async(std::launch::async, read, static_cast<int>((k + 1) % 2), next,
                           std::min(chunk, range.numel - next));
    }
    try {
      destination.narrow(0, start, n).copy_(staging_[k % 2].narrow(0, 0, n));
    } catch (const c10::Error& e) {
      if (pending.valid()) pending.wait();
      return absl::InternalError(absl::StrCat("Hugging Face checkpoint ", files_.dir(),
                                              ": tensor '", name,
                                              "': ", e.what_without_backtrace()));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckNoUnexpectedHfTensors(const formats::HfCheckpointFiles& files,
                                        const std::set<std::string>& expected) {
  for (const std::string& name : files.names()) {
    if (expected.count(name) != 0) continue;
    auto info = files.info(name);
    return absl::InvalidArgumentError(
        absl::StrCat("Hugging Face checkpoint ", files.dir(), ": tensor '", name, "'",
                     info.ok() ? absl::StrCat(" in ", info->file) : "",
                     " is not one of the model's parameters (a checkpoint of another model or "
                     "configuration?)"));
  }
  return absl::OkStatus();
}

absl::Status LoadHfCheckpoint(torch::nn::Module& module, const std::string& dir) {
  auto files = formats::HfCheckpointFiles::Open(dir);
  if (!files.ok()) return files.status();
  const TensorDict state = ModuleStateDict(module);
  std::set<std::string> names;
  for (const auto& item : state) {
    names.insert(item.key());
    auto info =
        CheckedInfo(*files, item.key(), item.value().sizes().vec(), item.value().scalar_type());
    if (!info.ok()) return info.status();
  }
  if (auto s = CheckNoUnexpectedHfTensors(*files, names); !s.ok()) return s;
  torch::NoGradGuard no_grad;
  for (const auto& item : state) {
    auto tensor = files->ReadAll(item.key());
    if (!tensor.ok()) return tensor.status();
    item.value().copy_(*tensor);
  }
  return absl::OkStatus();
}

absl::Status WriteHfCheckpoint(const std::string& dir, const std::vector<TensorSpec>& specs,
                               const TensorSource& source, c10::ScalarType dtype,
                               int64_t max_shard_bytes, const std::string& config_json) {
  if (!IsFloating16or32(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("WriteHfCheckpoint(", dir, "): dtype ",
                                                   c10::toString(dtype),
                                                   ": expected float32, bfloat16 or float16"));
  }
  std::vector<TensorSpec> written = specs;
  for (TensorSpec& spec : written) {
    if (IsFloating16or32(spec.dtype)) spec.dtype = dtype;
  }
  auto writer = formats::HfCheckpointWriter::Create(dir, written, max_shard_bytes,
                                                    {{"config.json", config_json}});
  if (!writer.ok()) return writer.status();
  for (size_t i = 0; i < written.size(); ++i) {
    auto tensor = source(i);
    if (!tensor.ok()) return tensor.status();
    // The writer converts a chunk at a time: no whole copy in `dtype`.
    if (auto s = writer->Write(written[i].key, *tensor); !s.ok()) return s;
  }
  return writer->Commit();
}

absl::Status SaveHfCheckpoint(const torch::nn::Module& module, const std::string& dir,
                              c10::ScalarType dtype, int64_t max_shard_bytes,
                              const std::string& config_json) {
  const TensorDict state = ModuleStateDict(module);
  std::vector<TensorSpec> specs;
  for (const auto& item : state) {
    specs.push_back({item.key(), item.value().scalar_type(), item.value().sizes().vec()});
  }
  return WriteHfCheckpoint(
      dir, specs, [&](size_t i) -> absl::StatusOr<at::Tensor> { return state[i].value(); }, dtype,
      max_shard_bytes, config_json);
}

}  // namespace state_dict
