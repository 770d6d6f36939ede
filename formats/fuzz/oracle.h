// What every fuzz harness of the project's file loaders shares: aborting
// on an oracle violation (libFuzzer records it as a crash), a scratch
// directory for the input files, byte I/O that dies on failure, and the
// bitwise comparison of round-tripped tensors. Used by the format harnesses
// (harness.h) and by state_dict's checkpoint and DCP harnesses
// (state_dict/fuzz/harness.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "formats/torch_save/torch_save.h"

namespace formats {
namespace fuzz {

// Prints "*** state_dict fuzz oracle violated: <what>" and aborts.
[[noreturn]] void Violation(const std::string& what);

// "OK" or the status's text.
std::string StatusText(const absl::Status& status);

// Writes / reads a whole file; a failure is a Violation naming the path.
void WriteBytesOrDie(const std::string& path, const void* data, size_t size);
std::string ReadBytesOrDie(const std::string& path);

// A directory of this process's own, removed at exit. Under $TEST_TMPDIR
// (Bazel), else $TMPDIR, else /tmp; tools/fuzz.sh points TMPDIR at a tmpfs.
const std::string& ScratchDirectory();

// Same dtype, same shape and the same bytes (not torch::equal: fuzzed
// floats are often NaN).
bool BitwiseEqual(const at::Tensor& a, const at::Tensor& b);

// "Float [3, 4]".
std::string Describe(const at::Tensor& t);

// The bytes of all of `tensors`' elements; nullopt when the count overflows.
std::optional<int64_t> TotalBytes(const TensorDict& tensors);

// The round-trip oracles' check: `again` (what was saved and loaded back)
// has `loaded`'s names in the same order and bitwise equal tensors.
// `context` is appended to a violation's message.
void ExpectSameTensors(const TensorDict& loaded, const TensorDict& again,
                       const std::string& context = "");

}  // namespace fuzz
}  // namespace formats
