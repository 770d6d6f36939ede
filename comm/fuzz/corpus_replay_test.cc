// Replays the committed rendezvous fuzz corpus and regressions through the
// fuzz harness, so its oracles run in every test run, not only when fuzzing.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "comm/fuzz/harness.h"

namespace comm {
namespace fuzz {
namespace {

namespace fs = std::filesystem;

fs::path FuzzDirectory() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr || workspace == nullptr) return "comm/fuzz";
  return fs::path(srcdir) / workspace / "comm" / "fuzz";
}

std::vector<fs::path> Inputs() {
  std::vector<fs::path> out;
  for (const char* kind : {"corpus", "regressions"}) {
    const fs::path dir = FuzzDirectory() / kind / "rendezvous";
    if (!fs::is_directory(dir)) continue;
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.is_regular_file()) out.push_back(entry.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(RendezvousCorpusReplay, EveryInputKeepsTheOracles) {
  const std::vector<fs::path> inputs = Inputs();
  ASSERT_GE(inputs.size(), 10u) << "the rendezvous corpus is missing";
  for (const fs::path& input : inputs) {
    SCOPED_TRACE(input.string());
    std::ifstream in(input, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), {});
    RunRendezvousInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
}

}  // namespace
}  // namespace fuzz
}  // namespace comm
