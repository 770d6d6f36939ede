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

#include "formats/fuzz/corpus.h"
#include "state_dict/fuzz/harness.h"

namespace state_dict {
namespace fuzz {
namespace {

namespace fs = std::filesystem;
using formats::fuzz::FuzzDirectory;
using formats::fuzz::ReadAll;
using formats::fuzz::ReplayCorpus;

TEST(CorpusReplayTest, CheckpointCorpusAndRegressionsKeepTheOracles) {
  ReplayCorpus(FuzzDirectory("state_dict/fuzz"), "checkpoint", 5, RunCheckpointInput);
}

TEST(CorpusReplayTest, DcpCorpusAndRegressionsKeepTheOracles) {
  ReplayCorpus(FuzzDirectory("state_dict/fuzz"), "dcp", 4, RunDcpInput);
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
