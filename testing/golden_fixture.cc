#include "testing/golden_fixture.h"

#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <vector>

namespace test_data {

std::string RunfilePath(const std::string& workspace_path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr || workspace == nullptr) return workspace_path;
  return std::string(srcdir) + "/" + workspace + "/" + workspace_path;
}

GoldenFixture::GoldenFixture(const std::string& path) : path_(path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "golden fixture ", path,
              ": cannot open it (is it in the test's data, and did its tools/golden/ script run?)");
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  const c10::IValue value = torch::jit::pickle_load(bytes);
  TORCH_CHECK(value.isGenericDict(), "golden fixture ", path,
              ": expected a {str: Tensor} dict, got ", value.tagKind());
  for (const auto& item : value.toGenericDict()) {
    TORCH_CHECK(item.key().isString() && item.value().isTensor(), "golden fixture ", path,
                ": expected a {str: Tensor} dict, found an entry ", item.key().tagKind(), ": ",
                item.value().tagKind());
    tensors_.emplace(item.key().toStringRef(), item.value().toTensor());
  }
}

const at::Tensor& GoldenFixture::operator[](const std::string& key) const {
  auto it = tensors_.find(key);
  TORCH_CHECK(it != tensors_.end(), "golden fixture ", path_, ": no value '", key,
              "' (rerun its tools/golden/ script if the test is newer than the fixture)");
  return it->second;
}

std::map<std::string, at::Tensor> GoldenFixture::with_prefix(const std::string& prefix) const {
  std::map<std::string, at::Tensor> out;
  const std::string start = prefix + ".";
  for (auto it = tensors_.lower_bound(start); it != tensors_.end(); ++it) {
    if (it->first.compare(0, start.size(), start) != 0) break;
    out.emplace(it->first.substr(start.size()), it->second);
  }
  return out;
}

}  // namespace test_data
