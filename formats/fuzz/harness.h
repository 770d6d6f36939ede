// Fuzz harnesses for the file formats' loaders of untrusted files, shared by
// the libFuzzer targets (tools/fuzz.sh builds them with clang) and by
// //formats/fuzz:corpus_replay_test, which replays the committed corpus and
// regressions through the same functions under Bazel. state_dict's
// checkpoint and DCP harnesses are in state_dict/fuzz/harness.h.
//
// Each Run* function feeds one input to the loaders and checks an oracle
// beyond "no crash". A loader may reject an input (that is the point), but
// the loaders must agree with each other; on a disagreement the function
// prints both results and calls abort(), which libFuzzer records as a crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace formats {
namespace fuzz {

// The input is a whole file, loaded with LoadTensorDict and LoadIValue.
// Oracle: when LoadTensorDict accepts it, LoadIValue does too, and the dict
// saved with SaveTensorDict loads back with the same keys in the same order,
// each tensor of the same dtype and shape with bitwise equal elements
// (bitwise, not torch::equal, because fuzzed floats are often NaN).
void RunTorchFileInput(const uint8_t* data, size_t size);

// The input is a whole safetensors file, loaded with LoadSafetensors.
// Oracle: when it loads, SaveSafetensors of the tensors and metadata writes
// a file that loads back with the same names in the same order, each tensor
// of the same dtype and shape with bitwise equal elements, and the same
// metadata (plus the {"format": "pt"} SaveSafetensors adds when the file had
// no "format"). Memory stays bounded by the file's size: the loader allocates
// nothing a header declares beyond the bytes the file holds. And
// SafetensorsFile agrees with it: Open refuses what LoadSafetensors refuses
// with the same status (but for BOOL bytes, which only reads check: then
// ReadAll of a BOOL tensor fails as the load did); when the file loads, the
// same names in order, the same metadata, ReadAll of each tensor bitwise
// equal and a range read equal to the same elements.
void RunSafetensorsInput(const uint8_t* data, size_t size);

// The input is the model.safetensors.index.json of a fixed directory of two
// shards (a.safetensors: "x" F32 [2, 3] and "y" I64 [4]; b.safetensors: "z"
// BF16 [5]), opened with HfCheckpointFiles. Oracle: when it opens, it is
// sharded, reads only files the directory holds, its names are exactly the
// tensors of the headers of those files, each in its own file, and every
// tensor reads back (whole and by range) as it was written. Returns Open's
// status (for the replay test's look at the seeds).
absl::Status RunHfIndexInput(const uint8_t* data, size_t size);

// Writes the project-made seeds of the torch_file target (SaveTensorDict /
// SaveIValue outputs) into `torch_file_dir`, which must exist.
absl::Status WriteTorchFileSeeds(const std::string& torch_file_dir);

}  // namespace fuzz
}  // namespace formats
