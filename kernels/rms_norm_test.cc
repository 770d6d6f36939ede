// kernels::RmsNorm and kernels::AddRmsNorm: the reference is models/'
// LlamaRMSNorm; the fused path (the autograd::Function with the CUDA
// kernels' arithmetic, run on the CPU through AtenFusedOps) matches it
// forward and backward in float32 and bfloat16, and finite differences in
// float64 to first and second order; CPU tensors take the reference without
// a word; an input the kernel does not take falls back with one warning.
#include "kernels/rms_norm.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/TensorOperators.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/randn_like.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/utils.h>

#include "kernels/internal/aten_fused_ops.h"
#include "kernels/internal/fused_ops.h"
#include "kernels/reference.h"
#include "kernels/testing/collect_warnings.h"
#include "kernels/testing/gradcheck.h"
#include "models/llama.h"

namespace kernels {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using testing::FiniteDifferenceProblems;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using testing::RelativeError;
using testing::SecondOrderFiniteDifferenceProblems;

constexpr double kEps = 1e-6;

at::Tensor Leaf(const at::Tensor& t) { return t.detach().clone().requires_grad_(true); }

std::string GradFnName(const at::Tensor& t) { return t.grad_fn() ? t.grad_fn()->name() : ""; }

TEST(RmsNormReference, IsLlamaRMSNorm) {
  torch::manual_seed(0);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    models::LlamaRMSNorm norm(48, kEps);
    {
      torch::NoGradGuard no_grad;
      norm->weight.copy_(1 + 0.1 * at::randn({48}));
    }
    norm->to(dtype);
    const at::Tensor x = at::randn({2, 5, 48}).to(dtype);
    EXPECT_TRUE(at::equal(reference::RmsNorm(x, norm->weight, kEps), norm->forward(x)));
    const at::Tensor residual = at::randn({2, 5, 48}).to(dtype);
    auto [normed, sum] = reference::AddRmsNorm(x, residual, norm->weight, kEps);
    EXPECT_TRUE(at::equal(sum, x + residual));
    EXPECT_TRUE(at::equal(normed, norm->forward(x + residual)));
  }
}

TEST(RmsNorm, CpuTensorsTakeTheReferenceSilently) {
  testing::CollectWarnings warnings;
  const at::Tensor x = Leaf(at::randn({3, 40}));
  const at::Tensor w = Leaf(at::randn({40}));
  const at::Tensor out = RmsNorm(x, w, kEps);
  EXPECT_TRUE(at::equal(out, reference::RmsNorm(x, w, kEps)));
  EXPECT_THAT(GradFnName(out), ::testing::Not(HasSubstr("RmsNormFunction")));
  auto [normed, sum] = AddRmsNorm(x, x, w, kEps);
  EXPECT_THAT(GradFnName(normed), ::testing::Not(HasSubstr("RmsNormFunction")));
  EXPECT_THAT(warnings.messages(), IsEmpty());
}

// The fused path on the CPU.
class RmsNormFused : public ::testing::Test {
 protected:
  internal::ScopedFusedOpsForTesting fused_{internal::AtenFusedOps()};
};

struct Case {
  std::vector<int64_t> shape;
  at::ScalarType x, w;
};

class RmsNormFusedCases : public RmsNormFused, public ::testing::WithParamInterface<Case> {};

TEST_P(RmsNormFusedCases, MatchesTheReferenceForwardAndBackward) {
  const Case& c = GetParam();
  torch::manual_seed(1);
  const at::Tensor x = at::randn(c.shape).to(c.x);
  const at::Tensor residual = at::randn(c.shape).to(c.x);
  const at::Tensor w = (1 + 0.1 * at::randn({c.shape.back()})).to(c.w);
  const double fwd_tol = c.x == at::kFloat ? 1e-6 : 1e-2;
  const double grad_tol = c.x == at::kFloat ? 1e-5 : 3e-2;

  at::Tensor fx = Leaf(x), fw = Leaf(w), rx = Leaf(x), rw = Leaf(w);
  const at::Tensor fused = RmsNorm(fx, fw, kEps);
  const at::Tensor ref = reference::RmsNorm(rx, rw, kEps);
  EXPECT_THAT(GradFnName(fused), HasSubstr("RmsNormFunction"));
  ASSERT_EQ(fused.sizes(), ref.sizes());
  ASSERT_EQ(fused.scalar_type(), ref.scalar_type());
  EXPECT_LE(RelativeError(fused, ref), fwd_tol);
  const at::Tensor grad = at::randn_like(ref);
  fused.backward(grad);
  ref.backward(grad);
  EXPECT_LE(RelativeError(fx.grad(), rx.grad()), grad_tol);
  EXPECT_LE(RelativeError(fw.grad(), rw.grad()), grad_tol);
  EXPECT_EQ(fx.grad().scalar_type(), c.x);
  EXPECT_EQ(fw.grad().scalar_type(), c.w);

  // AddRmsNorm: both outputs, gradients through both.
  at::Tensor ax = Leaf(x), ar = Leaf(residual), aw = Leaf(w);
  at::Tensor bx = Leaf(x), br = Leaf(residual), bw = Leaf(w);
  auto [fused_n, fused_h] = AddRmsNorm(ax, ar, aw, kEps);
  auto [ref_n, ref_h] = reference::AddRmsNorm(bx, br, bw, kEps);
  EXPECT_THAT(GradFnName(fused_n), HasSubstr("AddRmsNormFunction"));
  EXPECT_TRUE(at::equal(fused_h, ref_h));
  EXPECT_LE(RelativeError(fused_n, ref_n), fwd_tol);
  const at::Tensor grad_h = at::randn_like(ref_h);
  torch::autograd::backward({fused_n, fused_h}, {grad, grad_h});
  torch::autograd::backward({ref_n, ref_h}, {grad, grad_h});
  EXPECT_LE(RelativeError(ax.grad(), bx.grad()), grad_tol);
  EXPECT_LE(RelativeError(ar.grad(), br.grad()), grad_tol);
  EXPECT_LE(RelativeError(aw.grad(), bw.grad()), grad_tol);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RmsNormFusedCases,
    ::testing::Values(Case{{4, 8, 64}, at::kFloat, at::kFloat},
                      Case{{4, 8, 64}, at::kBFloat16, at::kBFloat16},
                      Case{{4, 8, 64}, at::kBFloat16, at::kFloat},  // float32 weight
                      Case{{3, 33}, at::kHalf, at::kHalf},
                      Case{{2, 3, 5, 1000}, at::kFloat, at::kFloat},
                      Case{{7}, at::kFloat, at::kFloat}));  // one row

TEST_F(RmsNormFused, FiniteDifferencesInFloat64) {
  torch::manual_seed(2);
  const at::Tensor x = at::randn({3, 2, 6}, at::kDouble);
  const at::Tensor residual = at::randn({3, 2, 6}, at::kDouble);
  const at::Tensor w = 1 + 0.1 * at::randn({6}, at::kDouble);
  EXPECT_THAT(GradFnName(RmsNorm(Leaf(x), w, kEps)), HasSubstr("RmsNormFunction"));
  auto norm = [](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{RmsNorm(in[0], in[1], kEps)};
  };
  auto add_norm = [](const std::vector<at::Tensor>& in) {
    auto [n, h] = AddRmsNorm(in[0], in[1], in[2], kEps);
    return std::vector<at::Tensor>{n, h};
  };
  EXPECT_EQ(FiniteDifferenceProblems(norm, {x, w}), "");
  EXPECT_EQ(FiniteDifferenceProblems(add_norm, {x, residual, w}), "");
  // Double backward: through the reference the Function recomputes.
  EXPECT_EQ(SecondOrderFiniteDifferenceProblems(norm, {x, w}), "");
  EXPECT_EQ(SecondOrderFiniteDifferenceProblems(add_norm, {x, residual, w}), "");
}

TEST_F(RmsNormFused, NonContiguousInputAndOnlyTheWeightsGradient) {
  torch::manual_seed(3);
  const at::Tensor x = at::randn({16, 4}).t();  // [4, 16], strides (1, 4)
  at::Tensor fw = Leaf(at::randn({16})), rw = Leaf(fw);
  const at::Tensor fused = RmsNorm(x, fw, kEps);
  const at::Tensor ref = reference::RmsNorm(x, rw, kEps);
  EXPECT_LE(RelativeError(fused, ref), 1e-6);
  fused.sum().backward();
  ref.sum().backward();
  EXPECT_LE(RelativeError(fw.grad(), rw.grad()), 1e-5);
}

TEST_F(RmsNormFused, AnInputTheKernelDoesNotTakeFallsBackWithOneWarning) {
  internal::ResetFallbackWarningsForTesting();
  testing::CollectWarnings warnings;
  const at::Tensor x = at::randn({2, 8});
  const at::Tensor w = at::randn({8}).to(at::kHalf);  // neither x's dtype nor float32
  const at::Tensor out = RmsNorm(x, w, kEps);
  RmsNorm(x, w, kEps);
  EXPECT_TRUE(at::equal(out, reference::RmsNorm(x, w, kEps)));
  EXPECT_THAT(warnings.messages(),
              ElementsAre(AllOf(HasSubstr("kernels::RmsNorm:"), HasSubstr("ATen reference"),
                                HasSubstr("weight has dtype Half and x Float"))));
  // Another op warns for itself.
  AddRmsNorm(x, at::randn({1, 8}), at::randn({8}), kEps);  // broadcast residual
  ASSERT_EQ(warnings.messages().size(), 2u);
  EXPECT_THAT(warnings.messages()[1],
              AllOf(HasSubstr("kernels::AddRmsNorm:"), HasSubstr("residual has shape [1, 8]")));
  internal::ResetFallbackWarningsForTesting();
}

}  // namespace
}  // namespace kernels
