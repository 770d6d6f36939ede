// Hugging Face checkpoint directories (config.json + safetensors files, one
// or sharded with model.safetensors.index.json) as a source and a sink of
// state: what transformers' from_pretrained reads and save_pretrained writes.
//
// In: ReadHfShards answers the same requests a sharded checkpoint or a DCP
// directory answers (a ShardedReader, fsdp_state_dict.h), reading only the
// requested ranges of each tensor from the files, so that an FSDP model
// loads straight into its shards: a rank never holds more than its shard
// plus the piece being converted.
//
//   auto files = formats::HfCheckpointFiles::Open(dir);
//   LoadModelTensorByTensor(sharded_model, dir, [&](const ShardRequests& r) {
//     return ReadHfShards(*files, r);
//   });
//
// (state_dict/fsdp/fsdp_full_checkpoint.h's LoadHfCheckpointIntoShards does
// this for either FSDP.)
//
// Out: WriteHfCheckpoint takes the tensors one at a time (TensorSource), so
// that rank 0 of an FSDP model writes what the others send it tensor by
// tensor (SaveFsdpHfCheckpoint, state_dict/fsdp/fsdp_full_checkpoint.h).
//
// An unwrapped module: LoadHfCheckpoint / SaveHfCheckpoint.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "formats/hf/hf_checkpoint_files.h"
#include "state_dict/sharded_tensor.h"
#include "state_dict/tensor_dict.h"

namespace state_dict {

// For each request, the tensor of the same name: its shape must equal the
// request's global shape, and each requested range of its flattened data is
// read (only those bytes) and converted to the request's dtype. float32,
// bfloat16 and float16 files convert to each other (a checkpoint's dtype need
// not be the model's); any other pair is refused. Errors, before anything is
// returned: NotFound for a tensor the directory lacks, InvalidArgument for a
// wrong shape or an unconvertible dtype, naming the directory, the tensor
// and both values; the files' own errors as they are.
absl::StatusOr<ShardedStateDict> ReadHfShards(
    const formats::HfCheckpointFiles& files,
    const std::vector<std::pair<std::string, ShardRequest>>& requests);

// Ranges of a checkpoint's tensors straight into the caller's tensors (a
// shard's live view), converted between float32, bfloat16 and float16,
// through two staging buffers of `chunk_bytes` reused from call to call:
// while one chunk is converted into the destination, another thread reads
// the next from the file. So a load allocates no temporary the size of a
// piece (whose fresh pages the kernel would clear first) and converts while
// the disk reads. One reader per thread.
class HfRangeReader {
 public:
  explicit HfRangeReader(const formats::HfCheckpointFiles& files,
                         int64_t chunk_bytes = int64_t{16} << 20);

  // Elements [range.offset, range.end()) of `name`'s flattened data into
  // `destination` (CPU, contiguous, range.numel elements). Errors as
  // ReadHfShards' (no tensor, an unconvertible dtype: InvalidArgument naming
  // the directory, the tensor and both dtypes), InvalidArgument for a
  // destination that is not as stated, and the files' own; on a read error
  // the destination holds the chunks before it.
  absl::Status ReadInto(const std::string& name, FlatRange range, const torch::Tensor& destination);

 private:
  const formats::HfCheckpointFiles& files_;
  int64_t chunk_bytes_;
  torch::Tensor staging_[2];
};

// InvalidArgument naming the tensor and its file when `files` holds a tensor
// that is not in `expected` (a checkpoint of another model, or one with
// weights this model would drop): the loaders request only what the model
// has, so this is how a strict load sees the rest.
absl::Status CheckNoUnexpectedHfTensors(const formats::HfCheckpointFiles& files,
                                        const std::set<std::string>& expected);

// Every parameter and buffer of `module` from the checkpoint in `dir`,
// converted to its dtype; strict both ways (CheckNoUnexpectedHfTensors).
// Every tensor's presence, shape and dtype is checked before the first is
// copied; then each is read whole and copied, one at a time.
absl::Status LoadHfCheckpoint(torch::nn::Module& module, const std::string& dir);

// Writes `specs` (names, the source's dtypes and shapes) as a checkpoint
// directory `dir` with `config_json` as its config.json, each tensor taken
// from `source` in spec order and converted to `dtype` (float32, bfloat16
// or float16), in files of at most `max_shard_bytes` (HfCheckpointWriter:
// atomic; a previous export there is replaced, any other directory refused).
absl::Status WriteHfCheckpoint(const std::string& dir, const std::vector<TensorSpec>& specs,
                               const TensorSource& source, c10::ScalarType dtype,
                               int64_t max_shard_bytes, const std::string& config_json);

// WriteHfCheckpoint of `module`'s parameters and buffers (ModuleStateDict).
absl::Status SaveHfCheckpoint(const torch::nn::Module& module, const std::string& dir,
                              c10::ScalarType dtype, int64_t max_shard_bytes,
                              const std::string& config_json);

}  // namespace state_dict
