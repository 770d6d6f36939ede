#include "kernels/decode_linear.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <torch/types.h>
#include <torch/utils.h>

namespace kernels {
namespace {

// DecodeLinear against at::linear in float64 (the exact product, rounded
// once): every shape a decode step has, the tails of both vector widths
// (in % 16, in % 8), rows 1..8, with and without bias.
TEST(DecodeLinearTest, MatchesLinearOnEveryRowCountAndTail) {
  torch::manual_seed(0);
  torch::NoGradGuard no_grad;
  for (int64_t in : {1, 7, 8, 15, 16, 17, 33, 64, 250, 512}) {
    for (int64_t out : {1, 3, 4, 5, 13, 64, 130}) {
      for (int64_t rows : {1, 2, 3, 8}) {
        for (bool with_bias : {false, true}) {
          const at::Tensor x = torch::randn({rows, 1, in});
          const at::Tensor w = torch::randn({out, in});
          const at::Tensor b = with_bias ? torch::randn({out}) : at::Tensor();
          ASSERT_TRUE(DecodeLinearApplies(x, w, b));
          const at::Tensor y = DecodeLinear(x, w, b);
          const at::Tensor expected = at::linear(
              x.to(torch::kDouble), w.to(torch::kDouble),
              with_bias ? std::optional<at::Tensor>(b.to(torch::kDouble)) : std::nullopt);
          ASSERT_EQ(y.sizes(), expected.sizes());
          ASSERT_EQ(y.scalar_type(), torch::kFloat);
          EXPECT_TRUE(torch::allclose(y.to(torch::kDouble), expected, 1e-5, 1e-5 * std::sqrt(in)))
              << "in " << in << " out " << out << " rows " << rows << " bias " << with_bias
              << ": max error " << (y.to(torch::kDouble) - expected).abs().max().item<double>();
        }
      }
    }
  }
}

TEST(DecodeLinearTest, SplitsOverThreadsWithTheSameResult) {
  torch::manual_seed(1);
  c10::InferenceMode inference;
  const at::Tensor x = torch::randn({2, 1, 256});
  const at::Tensor w = torch::randn({1001, 256});
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const at::Tensor one = DecodeLinear(x, w, {});
  at::set_num_threads(2);
  const at::Tensor two = DecodeLinear(x, w, {});
  at::set_num_threads(threads);
  // Each output element is one row's dot product wherever the split falls.
  EXPECT_TRUE(torch::equal(one, two));
}

TEST(DecodeLinearTest, NonContiguousInputIsRead) {
  torch::NoGradGuard no_grad;
  const at::Tensor x = torch::randn({64, 3}).t();  // [3, 64], strided
  const at::Tensor w = torch::randn({10, 64});
  ASSERT_TRUE(DecodeLinearApplies(x, w, {}));
  EXPECT_TRUE(torch::allclose(DecodeLinear(x, w, {}), at::linear(x, w), 1e-5, 1e-5));
}

// Where it does not apply it IS at::linear: the same values, the same
// autograd graph.
TEST(DecodeLinearTest, EverythingElseIsAtLinear) {
  const at::Tensor w = torch::randn({6, 32});
  const at::Tensor many = torch::randn({kDecodeLinearMaxRows + 1, 32});
  {
    torch::NoGradGuard no_grad;
    EXPECT_FALSE(DecodeLinearApplies(many, w, {}));  // a GEMM's rows
    EXPECT_FALSE(
        DecodeLinearApplies(torch::randn({1, 32}, torch::kDouble), w.to(torch::kDouble), {}));
    EXPECT_FALSE(DecodeLinearApplies(torch::randn({1, 32}), w.t().contiguous().t(), {}));
    EXPECT_TRUE(torch::equal(DecodeLinear(many, w, {}), at::linear(many, w)));
  }
  // Autograd to record: at::linear, and the gradient flows.
  const at::Tensor x = torch::randn({1, 32}, torch::requires_grad());
  EXPECT_FALSE(DecodeLinearApplies(x, w, {}));
  DecodeLinear(x, w, {}).sum().backward();
  EXPECT_TRUE(torch::allclose(x.grad(), w.sum(0).unsqueeze(0)));
  // No tensor requiring grad: nothing to record, the kernel serves.
  EXPECT_TRUE(DecodeLinearApplies(torch::randn({1, 32}), w, {}));
}

}  // namespace
}  // namespace kernels
