#include "formats/fuzz/corpus.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>

#include <gtest/gtest.h>

namespace formats {
namespace fuzz {

namespace fs = std::filesystem;

fs::path FuzzDirectory(const std::string& package_fuzz_dir) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr || workspace == nullptr) return package_fuzz_dir;
  return fs::path(srcdir) / workspace / package_fuzz_dir;
}

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

std::vector<fs::path> CorpusInputs(const fs::path& fuzz_dir, const std::string& target) {
  std::vector<fs::path> out;
  for (const char* kind : {"corpus", "regressions"}) {
    const fs::path dir = fuzz_dir / kind / target;
    if (!fs::is_directory(dir)) continue;
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.is_regular_file()) out.push_back(entry.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

void ReplayCorpus(const fs::path& fuzz_dir, const std::string& target, size_t min_inputs,
                  void (*run)(const uint8_t* data, size_t size)) {
  const std::vector<fs::path> inputs = CorpusInputs(fuzz_dir, target);
  ASSERT_GE(inputs.size(), min_inputs) << "the " << target << " corpus is missing";
  for (const fs::path& input : inputs) {
    SCOPED_TRACE(input.string());
    const std::string bytes = ReadAll(input);
    run(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
}

}  // namespace fuzz
}  // namespace formats
