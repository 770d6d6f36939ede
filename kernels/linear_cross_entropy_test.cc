// kernels::LinearCrossEntropy against cross_entropy of the materialised
// logits (transformers' ForCausalLMLoss): loss and both gradients for chunk
// sizes that divide N, do not, are 1 and exceed N, with ignore_index rows,
// in float32, bfloat16 and (finite differences) float64; what it keeps
// between forward and backward and its peak allocation (~chunk x V, not
// N x V), measured with a counting CPU allocator; its argument checks.
#include "kernels/linear_cross_entropy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/full.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/utils.h>

#include "kernels/reference.h"
#include "kernels/testing/counting_allocator.h"
#include "kernels/testing/gradcheck.h"

namespace kernels {
namespace {

using ::testing::HasSubstr;
using testing::RelativeError;

constexpr int64_t kIgnore = -100;

at::Tensor Leaf(const at::Tensor& t) { return t.detach().clone().requires_grad_(true); }

struct Problem {
  at::Tensor hidden, weight, targets;
};

// N rows of width H over a vocabulary of V; every `ignore_every`-th target
// is ignore_index (0: none).
Problem MakeProblem(int64_t n, int64_t h, int64_t v, at::ScalarType dtype, int64_t ignore_every,
                    uint64_t seed) {
  torch::manual_seed(seed);
  Problem p;
  p.hidden = at::randn({n, h}).to(dtype);
  p.weight = (at::randn({v, h}) * (2.0 / std::sqrt(static_cast<double>(h)))).to(dtype);
  p.targets = at::randint(v, {n}, at::kLong);
  if (ignore_every > 0) p.targets.index_fill_(0, at::arange(0, n, ignore_every), kIgnore);
  return p;
}

struct Case {
  int64_t chunk;
  at::ScalarType dtype;
  int64_t ignore_every;
};

class LinearCrossEntropyCases : public ::testing::TestWithParam<Case> {};

TEST_P(LinearCrossEntropyCases, MatchesCrossEntropyOfTheLogits) {
  const Case& c = GetParam();
  const Problem p = MakeProblem(/*n=*/37, /*h=*/24, /*v=*/101, c.dtype, c.ignore_every, 7);
  at::Tensor fh = Leaf(p.hidden), fw = Leaf(p.weight), rh = Leaf(p.hidden), rw = Leaf(p.weight);
  const at::Tensor loss = LinearCrossEntropy(fh, fw, p.targets, c.chunk);
  // transformers: the logits in the inputs' dtype, upcast, then the loss.
  const at::Tensor expected = at::cross_entropy_loss(at::mm(rh, rw.t()).to(at::kFloat), p.targets,
                                                     {}, at::Reduction::Mean, kIgnore);
  ASSERT_EQ(loss.dim(), 0);
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  const bool f32 = c.dtype == at::kFloat;
  EXPECT_NEAR(loss.item<double>(), expected.item<double>(), f32 ? 1e-6 : 1e-4);
  loss.backward();
  expected.backward();
  EXPECT_LE(RelativeError(fh.grad(), rh.grad()), f32 ? 1e-5 : 1e-2);
  EXPECT_LE(RelativeError(fw.grad(), rw.grad()), f32 ? 1e-5 : 1e-2);
  EXPECT_EQ(fh.grad().scalar_type(), c.dtype);
  EXPECT_EQ(fw.grad().scalar_type(), c.dtype);
  // And the reference spells the same thing.
  EXPECT_TRUE(at::equal(expected, reference::LinearCrossEntropy(rh, rw, p.targets)));
  if (c.dtype == at::kBFloat16) {
    // Against the loss of bf16 logits taken as they are (no upcast), loosely.
    const at::Tensor bf16_loss = at::cross_entropy_loss(at::mm(p.hidden, p.weight.t()), p.targets,
                                                        {}, at::Reduction::Mean, kIgnore);
    EXPECT_NEAR(loss.item<double>(), bf16_loss.item<double>(), 3e-2);
  }
}

INSTANTIATE_TEST_SUITE_P(
    ChunksAndDtypes, LinearCrossEntropyCases,
    ::testing::Values(Case{1, at::kFloat, 0}, Case{5, at::kFloat, 0},    // 37 = 7 x 5 + 2
                      Case{37, at::kFloat, 0}, Case{64, at::kFloat, 0},  // all rows, more
                      Case{8, at::kFloat, 3}, Case{37, at::kFloat, 4},   // ignore_index
                      Case{5, at::kBFloat16, 0}, Case{16, at::kBFloat16, 3},
                      Case{3, at::kHalf, 5}));

TEST(LinearCrossEntropy, FiniteDifferencesInFloat64) {
  const Problem p = MakeProblem(7, 5, 11, at::kDouble, 3, 1);
  for (int64_t chunk : {1, 3, 7}) {
    auto f = [&](const std::vector<at::Tensor>& in) {
      return std::vector<at::Tensor>{LinearCrossEntropy(in[0], in[1], p.targets, chunk)};
    };
    EXPECT_EQ(testing::FiniteDifferenceProblems(f, {p.hidden, p.weight}), "") << "chunk " << chunk;
  }
  // float64 stays float64.
  EXPECT_EQ(LinearCrossEntropy(p.hidden, p.weight, p.targets, 2).scalar_type(), at::kDouble);
}

TEST(LinearCrossEntropy, AllRowsIgnoredIsNaNWithZeroGradients) {
  const Problem p = MakeProblem(6, 4, 9, at::kFloat, 1, 2);  // every target ignored
  at::Tensor h = Leaf(p.hidden), w = Leaf(p.weight);
  const at::Tensor loss = LinearCrossEntropy(h, w, p.targets, 4);
  const at::Tensor expected = reference::LinearCrossEntropy(p.hidden, p.weight, p.targets);
  EXPECT_TRUE(std::isnan(loss.item<double>()));
  EXPECT_TRUE(std::isnan(expected.item<double>()));
  loss.backward();
  EXPECT_EQ(h.grad().abs().max().item<double>(), 0);
  EXPECT_EQ(w.grad().abs().max().item<double>(), 0);
}

TEST(LinearCrossEntropy, OnlyTheGradientAskedFor) {
  const Problem p = MakeProblem(9, 4, 13, at::kFloat, 0, 3);
  at::Tensor w = Leaf(p.weight);
  LinearCrossEntropy(p.hidden, w, p.targets, 4).backward();  // hidden needs none
  at::Tensor rw = Leaf(p.weight);
  reference::LinearCrossEntropy(p.hidden, rw, p.targets).backward();
  EXPECT_LE(RelativeError(w.grad(), rw.grad()), 1e-5);
}

TEST(LinearCrossEntropy, RefusesBadArguments) {
  const Problem p = MakeProblem(4, 3, 5, at::kFloat, 0, 4);
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  EXPECT_THAT(message([&] { LinearCrossEntropy(p.hidden, p.weight, p.targets, 0); }),
              HasSubstr("kernels::LinearCrossEntropy: chunk=0: expected >= 1"));
  EXPECT_THAT(message([&] { LinearCrossEntropy(p.hidden, p.weight.t(), p.targets, 2); }),
              HasSubstr("hidden of shape [4, 3] and weight of shape [3, 5]: expected [N, H] and "
                        "[V, H]"));
  EXPECT_THAT(
      message([&] { LinearCrossEntropy(p.hidden, p.weight, p.targets.narrow(0, 0, 3), 2); }),
      HasSubstr("targets of shape [3] and dtype Long: expected int64 [4]"));
  EXPECT_THAT(
      message([&] { LinearCrossEntropy(p.hidden, p.weight.to(at::kDouble), p.targets, 2); }),
      HasSubstr("expected one floating dtype"));
  const at::Tensor out_of_range = at::full({4}, 5, at::kLong);
  EXPECT_THAT(message([&] { LinearCrossEntropy(p.hidden, p.weight, out_of_range, 2); }),
              HasSubstr("a target is outside [0, V) and is not ignore_index"));
  EXPECT_THAT(message([&] {
                at::Tensor h = Leaf(p.hidden);
                const at::Tensor loss = LinearCrossEntropy(h, p.weight, p.targets, 2);
                auto g = torch::autograd::grad({loss}, {h}, {}, /*retain_graph=*/true,
                                               /*create_graph=*/true);
                g[0].sum().backward();
              }),
              HasSubstr("create_graph=true (double backward) is not supported"));
}

// What the op allocates, through LibTorch's CPU allocator.
TEST(LinearCrossEntropy, PeakMemoryIsAChunkOfLogitsNotAllOfThem) {
  constexpr int64_t kRows = 2048, kWidth = 32, kVocab = 4096, kChunk = 128;
  const Problem p = MakeProblem(kRows, kWidth, kVocab, at::kFloat, 5, 5);
  const uint64_t all_logits = kRows * kVocab * sizeof(float);     // 32 MiB
  const uint64_t chunk_logits = kChunk * kVocab * sizeof(float);  // 2 MiB
  const uint64_t weight_bytes = kVocab * kWidth * sizeof(float);  // 0.5 MiB
  const uint64_t hidden_bytes = kRows * kWidth * sizeof(float);   // 0.25 MiB

  testing::ScopedCountingAllocator counting;
  at::Tensor h = Leaf(p.hidden), w = Leaf(p.weight);
  const uint64_t before = counting.live();
  counting.ResetPeak();
  at::Tensor loss = LinearCrossEntropy(h, w, p.targets, kChunk);
  const uint64_t forward_peak = counting.peak() - before;
  // Kept for backward: the per-row logsumexp (N floats) and a few scalars.
  const uint64_t kept = counting.live() - before;
  counting.ResetPeak();
  const uint64_t before_backward = counting.live();
  loss.backward();
  const uint64_t backward_peak = counting.peak() - before_backward;
  std::printf(
      "LinearCrossEntropy N=%ld V=%ld chunk=%ld: forward peak %.2f MiB, kept %.1f KiB, "
      "backward peak %.2f MiB (all logits: %.0f MiB)\n",
      static_cast<long>(kRows), static_cast<long>(kVocab), static_cast<long>(kChunk),
      forward_peak / 1048576.0, kept / 1024.0, backward_peak / 1048576.0, all_logits / 1048576.0);
  EXPECT_LE(kept, kRows * sizeof(float) + 4096);
  EXPECT_LE(forward_peak, 2 * chunk_logits + kRows * 16 + 65536);
  // Backward: the chunk's logits (and their exp in place), the gradients.
  EXPECT_LE(backward_peak, 2 * chunk_logits + weight_bytes + hidden_bytes + kRows * 16 + 65536);

  // The reference materialises all the logits (and their gradient).
  at::Tensor rh = Leaf(p.hidden), rw = Leaf(p.weight);
  counting.ResetPeak();
  const uint64_t before_reference = counting.live();
  reference::LinearCrossEntropy(rh, rw, p.targets).backward();
  const uint64_t reference_peak = counting.peak() - before_reference;
  std::printf("reference: peak %.2f MiB\n", reference_peak / 1048576.0);
  EXPECT_GE(reference_peak, 2 * all_logits);
  EXPECT_LE(RelativeError(h.grad(), rh.grad()), 1e-5);
}

TEST(LinearCrossEntropy, Bf16PeakMemoryAddsTheFloat32Accumulator) {
  constexpr int64_t kRows = 1024, kWidth = 64, kVocab = 4096, kChunk = 64;
  const Problem p = MakeProblem(kRows, kWidth, kVocab, at::kBFloat16, 0, 6);
  const uint64_t chunk_logits = kChunk * kVocab * 4;
  const uint64_t accumulator = kVocab * kWidth * 4;
  testing::ScopedCountingAllocator counting;
  at::Tensor h = Leaf(p.hidden), w = Leaf(p.weight);
  counting.ResetPeak();
  const uint64_t before = counting.live();
  LinearCrossEntropy(h, w, p.targets, kChunk).backward();
  const uint64_t peak = counting.peak() - before;
  // chunk logits in bf16 and float32, the float32 accumulator, its bf16
  // copy and the bf16 gradients; far below the N x V float32 logits.
  EXPECT_LE(peak, 2 * chunk_logits + 2 * accumulator + kRows * kWidth * 2 + 65536);
  EXPECT_LT(peak, kRows * kVocab * 4 / 2);
}

}  // namespace
}  // namespace kernels
