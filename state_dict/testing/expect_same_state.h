// The assertion checkpoint round trips make: same keys in the same order,
// same dtypes, equal values.
#pragma once

#include <gtest/gtest.h>
#include <torch/types.h>

#include "state_dict/tensor_dict.h"

namespace state_dict {
namespace testing {

inline void ExpectSameState(const TensorDict& got, const TensorDict& want) {
  ASSERT_EQ(got.keys(), want.keys());
  for (const auto& item : want) {
    EXPECT_EQ(got[item.key()].scalar_type(), item.value().scalar_type()) << item.key();
    EXPECT_TRUE(torch::equal(got[item.key()], item.value())) << item.key();
  }
}

}  // namespace testing
}  // namespace state_dict
