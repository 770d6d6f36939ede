#pragma once

// Test helpers: the golden fixture (tools/golden/functorch_transforms_golden.py)
// and tensor comparison.

#include <gtest/gtest.h>
#include <torch/serialize.h>
#include <torch/types.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace functorch {
namespace testing {

inline std::string runfile(const std::string& path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir != nullptr && workspace != nullptr) {
    return std::string(srcdir) + "/" + workspace + "/" + path;
  }
  return path;
}

// torch.save of a plain {str: Tensor} dict, read with torch::pickle_load.
class Golden {
 public:
  explicit Golden(const std::string& file = "transforms_golden.pt") {
    const std::string path = runfile("functorch/transforms/testdata/" + file);
    std::ifstream in(path, std::ios::binary);
    EXPECT_TRUE(in.good()) << "cannot open " << path;
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    dict_ = torch::pickle_load(bytes).toGenericDict();
  }
  bool has(const std::string& key) const { return dict_.contains(key); }
  torch::Tensor operator[](const std::string& key) const {
    auto it = dict_.find(key);
    if (it == dict_.end()) {
      ADD_FAILURE() << "golden value '" << key << "' missing";
      return torch::Tensor();
    }
    return it->value().toTensor();
  }

 private:
  c10::impl::GenericDict dict_{c10::StringType::get(), c10::AnyType::get()};
};

inline const Golden& golden() {
  static const Golden* g = new Golden();
  return *g;
}

inline ::testing::AssertionResult AllClose(const torch::Tensor& actual,
                                           const torch::Tensor& expected, double rtol = 1e-6,
                                           double atol = 1e-7) {
  if (!actual.defined() || !expected.defined()) {
    return ::testing::AssertionFailure() << "undefined tensor";
  }
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure()
           << "shape " << actual.sizes() << " != expected " << expected.sizes();
  }
  if (!torch::allclose(actual.to(expected.dtype()), expected, rtol, atol)) {
    return ::testing::AssertionFailure()
           << "values differ, max abs diff "
           << (actual.to(expected.dtype()) - expected).abs().max().item<double>() << "\nactual:\n"
           << actual << "\nexpected:\n"
           << expected;
  }
  return ::testing::AssertionSuccess();
}

// Expects `statement` to throw a c10::Error whose message contains `text`.
#define EXPECT_THROW_WITH(statement, text)                                                     \
  do {                                                                                         \
    try {                                                                                      \
      statement;                                                                               \
      ADD_FAILURE() << "expected an error containing: " << (text);                             \
    } catch (const c10::Error& e) {                                                            \
      EXPECT_NE(std::string(e.what_without_backtrace()).find(text), std::string::npos)         \
          << "message: " << e.what_without_backtrace() << "\nexpected to contain: " << (text); \
    }                                                                                          \
  } while (0)

}  // namespace testing
}  // namespace functorch
