// State dicts in PyTorch's own file format (the zip archive of torch.save),
// readable from Python with `torch.load(path)`.
//
//   formats::TensorDict sd = ...;               // "0.weight" -> tensor, ...
//   SaveTensorDict(sd, "model.pt");             // Python: torch.load -> dict
//   auto loaded = LoadTensorDict("py_model.pt");  // from torch.save(
//                                                 //   model.state_dict(), ...)
//
// state_dict's API takes and returns these types under its own names
// (state_dict/tensor_dict.h: state_dict::TensorDict is this TensorDict).
//
// Saving writes a plain dict (Python >= 3.7 dicts keep insertion order, and
// nn.Module.load_state_dict accepts it). Loading accepts both a plain dict and
// the collections.OrderedDict (with its `_metadata`) that state_dict() returns,
// which LibTorch 1.13's torch::pickle_load rejects (see
// formats/pickle/pickle_vm.h for why and how).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>  // torch/ordered_dict.h uses TORCH_CHECK unincluded
#include <torch/ordered_dict.h>
#include <torch/types.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace formats {

// Name (fully qualified, "layer.0.weight") -> tensor, in module order.
using TensorDict = torch::OrderedDict<std::string, torch::Tensor>;

struct LoadedTensorDict {
  TensorDict tensors;
  // Python's state_dict()._metadata when present ({prefix: {"version": N}}),
  // a GenericDict; None for files without it.
  c10::IValue metadata;
};

// Writes `tensors` to `path` (atomically: temporary file, fsync, rename).
// Tensors are written contiguous and on the CPU, one after another straight
// into the file: the memory a save adds is one fixed write buffer, plus a
// copy of one tensor at a time when it is not already a contiguous CPU
// tensor. Each tensor gets its own storage record holding exactly its bytes
// (views of one storage are written separately, never the whole storage).
absl::Status SaveTensorDict(const TensorDict& tensors, const std::string& path);

// What WriteTensorDict wrote, checksummed on the fly while writing.
struct WrittenTensorDict {
  uint64_t bytes = 0;   // size of the file
  uint32_t crc32c = 0;  // CRC-32C of the whole file
  // CRC-32C of each tensor's contiguous data, in the dict's order.
  std::vector<uint32_t> tensor_crc32c;
};

// SaveTensorDict that also reports the file's size and checksums (for
// checkpoint manifests).
absl::StatusOr<WrittenTensorDict> WriteTensorDict(const TensorDict& tensors,
                                                  const std::string& path);

// A tensor of a file whose data is produced only when its record is
// written, so that a save never holds more than one tensor's data: state
// gathered from other ranks one tensor at a time (state_dict/fsdp's
// SaveFsdpFullCheckpoint), or computed on the fly.
struct TensorSpec {
  std::string key;
  torch::Dtype dtype = torch::kFloat;
  std::vector<int64_t> shape;
};
// Tensor i's data: of spec i's dtype and shape, any device and strides.
// Called once per tensor, for i = 0, 1, ... in order; the writer drops each
// tensor before asking for the next. An error stops the save (nothing is
// written) and is returned as it is.
using TensorSource = std::function<absl::StatusOr<torch::Tensor>(size_t i)>;

// WriteTensorDict of the tensors `specs` describe, their data taken from
// `source` one at a time: the same file WriteTensorDict writes for a dict of
// those tensors. Data of another dtype or shape than its spec is an
// InvalidArgument naming the key.
absl::StatusOr<WrittenTensorDict> WriteTensorDict(const std::vector<TensorSpec>& specs,
                                                  const TensorSource& source,
                                                  const std::string& path);

// How a load treats a file it may not trust.
struct LoadOptions {
  // A byte budget, 0 for none. A file whose records declare more bytes than
  // this in all (uncompressed: its tensors' storages, its pickle and the
  // few small metadata records) is refused up front, from its zip directory,
  // before any record is read or any memory is allocated for one:
  // ResourceExhausted "<path>: its records declare T bytes (S of them tensor
  // storages), more than the load's budget of B bytes (max_bytes) ...". As
  // `torch.load` callers of untrusted files ask for; a state dict of N
  // bytes of tensors needs a budget a little above N (its pickle: tens of
  // bytes per tensor).
  uint64_t max_bytes = 0;
};

// Reads a dict of tensors written by SaveTensorDict or Python's torch.save.
// Errors name the file and, for a non-tensor value, its key.
//
// Whatever the file, a load holds at most what its records declare (each
// checked against the file's size before anything is allocated for it: a
// stored record cannot declare more than the file holds, a deflated one
// more than deflate can expand its bytes to, ~1032x), plus the pickle's
// objects and fixed buffers: each storage record is read once into memory
// of its declared size, a deflated one inflated straight into it, and a
// record that inflates past its declared size is an error naming it. Time is
// linear in the file's size (keys, records and nesting; nesting is refused
// past 1000 levels).
absl::StatusOr<LoadedTensorDict> LoadTensorDict(const std::string& path);
absl::StatusOr<LoadedTensorDict> LoadTensorDict(const std::string& path,
                                                const LoadOptions& options);

// Any picklable IValue (dicts with str/int keys, lists, tuples, scalars,
// strings, tensors), e.g. an optimizer state dict in Python's layout.
// LoadIValue reads as LoadTensorDict does.
absl::Status SaveIValue(const c10::IValue& value, const std::string& path);
absl::StatusOr<c10::IValue> LoadIValue(const std::string& path);
absl::StatusOr<c10::IValue> LoadIValue(const std::string& path, const LoadOptions& options);

}  // namespace formats
