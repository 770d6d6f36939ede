#pragma once

// Test helpers: the golden fixture (tools/golden/functorch_transforms_golden.py)
// and tensor comparison.

#include <gtest/gtest.h>
#include <torch/types.h>

#include <string>

#include "testing/golden_fixture.h"

namespace functorch {
namespace testing {

// A fixture of tools/golden/functorch_transforms_golden.py (or
// functorch_losses_golden.py) in functorch/transforms/testdata/.
class Golden {
 public:
  explicit Golden(const std::string& file = "transforms_golden.pt")
      : fixture_(test_data::RunfilePath("functorch/transforms/testdata/" + file)) {}
  bool has(const std::string& key) const { return fixture_.has(key); }
  const torch::Tensor& operator[](const std::string& key) const { return fixture_[key]; }

 private:
  test_data::GoldenFixture fixture_;
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
