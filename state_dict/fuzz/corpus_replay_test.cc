// Replays the committed corpus and regressions of state_dict's fuzzers
// (checkpoint, dcp) through the fuzz harness, so its oracles run in every
// test run, not only when fuzzing. The formats' corpora:
// //formats/fuzz:corpus_replay_test.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "state_dict/fuzz/harness.h"

namespace state_dict {
namespace fuzz {
namespace {

namespace fs = std::filesystem;

fs::path FuzzDirectory() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr || workspace == nullptr) return "state_dict/fuzz";
  return fs::path(srcdir) / workspace / "state_dict" / "fuzz";
}

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// Every file under corpus/<target> and regressions/<target>, sorted.
std::vector<fs::path> Inputs(const std::string& target) {
  std::vector<fs::path> out;
  for (const char* kind : {"corpus", "regressions"}) {
    const fs::path dir = FuzzDirectory() / kind / target;
    if (!fs::is_directory(dir)) continue;
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.is_regular_file()) out.push_back(entry.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(CorpusReplayTest, CheckpointCorpusAndRegressionsKeepTheOracles) {
  const std::vector<fs::path> inputs = Inputs("checkpoint");
  ASSERT_GE(inputs.size(), 5u) << "the checkpoint corpus is missing";
  for (const fs::path& input : inputs) {
    SCOPED_TRACE(input.string());
    const std::string bytes = ReadAll(input);
    RunCheckpointInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
}

TEST(CorpusReplayTest, DcpCorpusAndRegressionsKeepTheOracles) {
  const std::vector<fs::path> inputs = Inputs("dcp");
  ASSERT_GE(inputs.size(), 4u) << "the dcp corpus is missing";
  for (const fs::path& input : inputs) {
    SCOPED_TRACE(input.string());
    const std::string bytes = ReadAll(input);
    RunDcpInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
}

// The project-made seeds as this build writes them (the committed ones go
// stale when a writer changes): the template's own files, each of which
// must load everything as saved, whatever the committed corpus holds.
TEST(CorpusReplayTest, TemplateFilesLoadAsSaved) {
  const fs::path dir = fs::path(std::getenv("TEST_TMPDIR")) / "fresh_seeds";
  for (const char* target : {"checkpoint", "dcp"}) {
    fs::create_directories(dir / target);
  }
  const absl::Status written =
      WriteProjectSeeds((dir / "checkpoint").string(), (dir / "dcp").string());
  ASSERT_TRUE(written.ok()) << written;
  int replayed = 0;
  for (const char* target : {"checkpoint", "dcp"}) {
    for (const auto& entry : fs::directory_iterator(dir / target)) {
      SCOPED_TRACE(entry.path().string());
      const std::string bytes = ReadAll(entry.path());
      const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
      if (std::string(target) == "dcp")
        RunDcpInput(data, bytes.size());
      else
        RunCheckpointInput(data, bytes.size());
      ++replayed;
    }
  }
  EXPECT_EQ(replayed, 6 + kDcpFiles);
}

}  // namespace
}  // namespace fuzz
}  // namespace state_dict
