// Whole files as bytes, for tests that damage checkpoints on purpose.
#pragma once

#include <fstream>
#include <iterator>
#include <string>

namespace formats {
namespace testing {

// The file's bytes ("" when it cannot be read).
inline std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// Replaces the file's contents with `bytes`.
inline void Spit(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

}  // namespace testing
}  // namespace formats
