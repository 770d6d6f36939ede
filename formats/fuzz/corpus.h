// The committed inputs of a fuzz target, for the replay tests that run every
// harness's oracles in each test run: <fuzz dir>/corpus/<target>/* and
// <fuzz dir>/regressions/<target>/*. Shared by //formats/fuzz and
// //state_dict/fuzz's corpus_replay_test (testonly).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace formats {
namespace fuzz {

// `package_fuzz_dir` ("formats/fuzz") in the test's runfiles; the relative
// path itself outside Bazel.
std::filesystem::path FuzzDirectory(const std::string& package_fuzz_dir);

// The whole file; empty when it cannot be read.
std::string ReadAll(const std::filesystem::path& path);

// Every regular file under corpus/<target> and regressions/<target> of
// `fuzz_dir`, sorted.
std::vector<std::filesystem::path> CorpusInputs(const std::filesystem::path& fuzz_dir,
                                                const std::string& target);

// Runs every input of `target` through `run` (a harness's Run*Input), each
// under a SCOPED_TRACE naming it. A gtest failure when there are fewer than
// `min_inputs`: the corpus went missing from the test's data.
void ReplayCorpus(const std::filesystem::path& fuzz_dir, const std::string& target,
                  size_t min_inputs, void (*run)(const uint8_t* data, size_t size));

}  // namespace fuzz
}  // namespace formats
