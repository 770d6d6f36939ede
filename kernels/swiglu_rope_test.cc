// kernels::SwiGlu and kernels::ApplyRopeQK: the references are LlamaMLP's
// silu(gate) * up and models::ApplyRope; the fused paths (their
// autograd::Functions with the CUDA kernels' arithmetic, run on the CPU
// through AtenFusedOps) match them forward and backward in float32 and
// bfloat16 (RoPE on the strided q/k views models/ makes, GQA, per-row
// tables), and finite differences in float64 to first and second order.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/randn_like.h>
#include <ATen/ops/silu.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/utils.h>

#include "kernels/internal/aten_fused_ops.h"
#include "kernels/internal/fused_ops.h"
#include "kernels/reference.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"
#include "kernels/testing/collect_warnings.h"
#include "kernels/testing/gradcheck.h"
#include "models/llama_config.h"
#include "models/rope.h"

namespace kernels {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using testing::FiniteDifferenceProblems;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using testing::RelativeError;
using testing::SecondOrderFiniteDifferenceProblems;

at::Tensor Leaf(const at::Tensor& t) { return t.detach().clone().requires_grad_(true); }

std::string GradFnName(const at::Tensor& t) { return t.grad_fn() ? t.grad_fn()->name() : ""; }

class Fused : public ::testing::Test {
 protected:
  internal::ScopedFusedOpsForTesting fused_{internal::AtenFusedOps()};
};

// ---- SwiGLU -------------------------------------------------------------------

TEST(SwiGlu, CpuTensorsTakeTheReferenceSilently) {
  testing::CollectWarnings warnings;
  const at::Tensor gate = Leaf(at::randn({3, 10})), up = Leaf(at::randn({3, 10}));
  const at::Tensor out = SwiGlu(gate, up);
  // The reference is LlamaMLP's activation, bitwise.
  EXPECT_TRUE(at::equal(out, at::silu(gate) * up));
  EXPECT_THAT(GradFnName(out), Not(HasSubstr("SwiGluFunction")));
  EXPECT_THAT(warnings.messages(), IsEmpty());
}

TEST_F(Fused, SwiGluMatchesTheReferenceForwardAndBackward) {
  torch::manual_seed(0);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    const at::Tensor gate = (3 * at::randn({4, 6, 37})).to(dtype);
    const at::Tensor up = at::randn({4, 6, 37}).to(dtype);
    at::Tensor fg = Leaf(gate), fu = Leaf(up), rg = Leaf(gate), ru = Leaf(up);
    const at::Tensor fused = SwiGlu(fg, fu);
    const at::Tensor ref = reference::SwiGlu(rg, ru);
    EXPECT_THAT(GradFnName(fused), HasSubstr("SwiGluFunction"));
    // The kernel rounds silu to the dtype as at::silu does: bitwise.
    EXPECT_TRUE(at::equal(fused, ref));
    const at::Tensor grad = at::randn_like(ref);
    fused.backward(grad);
    ref.backward(grad);
    const double tol = dtype == at::kFloat ? 1e-6 : 2e-2;
    EXPECT_LE(RelativeError(fg.grad(), rg.grad()), tol);
    EXPECT_LE(RelativeError(fu.grad(), ru.grad()), tol);
  }
}

TEST_F(Fused, SwiGluFiniteDifferencesInFloat64) {
  torch::manual_seed(1);
  auto f = [](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{SwiGlu(in[0], in[1])};
  };
  const std::vector<at::Tensor> inputs = {2 * at::randn({3, 7}, at::kDouble),
                                          at::randn({3, 7}, at::kDouble)};
  EXPECT_THAT(GradFnName(SwiGlu(Leaf(inputs[0]), inputs[1])), HasSubstr("SwiGluFunction"));
  EXPECT_EQ(FiniteDifferenceProblems(f, inputs), "");
  EXPECT_EQ(SecondOrderFiniteDifferenceProblems(f, inputs), "");
}

TEST_F(Fused, SwiGluNonContiguousInputs) {
  // gate and up as the two halves of one fused projection's output.
  const at::Tensor both = at::randn({5, 2 * 12});
  const at::Tensor gate = both.narrow(1, 0, 12), up = both.narrow(1, 12, 12);
  // (On strided inputs ATen's silu takes its scalar loop, whose exp may
  // differ from the vectorised one in the last bit.)
  EXPECT_LE(RelativeError(SwiGlu(gate, up), reference::SwiGlu(gate, up)), 1e-6);
}

TEST_F(Fused, SwiGluBroadcastFallsBackWithOneWarning) {
  internal::ResetFallbackWarningsForTesting();
  testing::CollectWarnings warnings;
  const at::Tensor gate = at::randn({3, 8}), up = at::randn({1, 8});
  EXPECT_TRUE(at::equal(SwiGlu(gate, up), reference::SwiGlu(gate, up)));
  SwiGlu(gate, up);
  EXPECT_THAT(warnings.messages(),
              ElementsAre(AllOf(HasSubstr("kernels::SwiGlu:"),
                                HasSubstr("gate has shape [3, 8] and dtype Float, up [1, 8]"))));
  internal::ResetFallbackWarningsForTesting();
}

// ---- RoPE -----------------------------------------------------------------------

// cos, sin as models/ makes them: [T, D] (or [B, T, D] for per-row
// positions), float32, then cast to the activations' dtype.
std::pair<at::Tensor, at::Tensor> Tables(int64_t batch, int64_t length, int64_t head_dim,
                                         bool per_row, at::ScalarType dtype) {
  models::RopeConfig rope;
  rope.theta = 10000;
  const at::Tensor inv_freq = models::RopeInverseFrequencies(rope, head_dim);
  at::Tensor positions = at::arange(length);
  if (per_row) positions = positions.unsqueeze(0) + 3 * at::arange(batch).unsqueeze(1);
  auto [cos, sin] = models::RopeCosSin(inv_freq, positions);
  return {cos.to(dtype), sin.to(dtype)};
}

TEST(ApplyRopeQK, ReferenceIsModelsApplyRopeOnBoth) {
  testing::CollectWarnings warnings;
  for (bool per_row : {false, true}) {
    auto [cos, sin] = Tables(2, 5, 8, per_row, at::kFloat);
    const at::Tensor q = at::randn({2, 4, 5, 8}), k = at::randn({2, 2, 5, 8});
    auto [q_rot, k_rot] = ApplyRopeQK(q, k, cos, sin);  // CPU: the reference
    EXPECT_TRUE(at::equal(q_rot, models::ApplyRope(q, cos, sin)));
    EXPECT_TRUE(at::equal(k_rot, models::ApplyRope(k, cos, sin)));
  }
  EXPECT_THAT(warnings.messages(), IsEmpty());
}

struct RopeCase {
  int64_t batch, heads, kv_heads, length, head_dim;
  at::ScalarType dtype;
  bool per_row;
};

class RopeFused : public Fused, public ::testing::WithParamInterface<RopeCase> {};

TEST_P(RopeFused, MatchesTheReferenceForwardAndBackward) {
  const RopeCase& c = GetParam();
  torch::manual_seed(2);
  auto [cos, sin] = Tables(c.batch, c.length, c.head_dim, c.per_row, c.dtype);
  // The layout models/ hands over: [B, T, H, D] projections transposed.
  const at::Tensor q = at::randn({c.batch, c.length, c.heads, c.head_dim}).to(c.dtype);
  const at::Tensor k = at::randn({c.batch, c.length, c.kv_heads, c.head_dim}).to(c.dtype);
  at::Tensor fq = Leaf(q), fk = Leaf(k), rq = Leaf(q), rk = Leaf(k);
  auto [fused_q, fused_k] = ApplyRopeQK(fq.transpose(1, 2), fk.transpose(1, 2), cos, sin);
  auto [ref_q, ref_k] = reference::ApplyRopeQK(rq.transpose(1, 2), rk.transpose(1, 2), cos, sin);
  EXPECT_THAT(GradFnName(fused_q), HasSubstr("RopeQKFunction"));
  // Each product rounded as ATen rounds it: bitwise.
  EXPECT_TRUE(at::equal(fused_q, ref_q));
  EXPECT_TRUE(at::equal(fused_k, ref_k));
  // The output keeps the input's layout (empty_like).
  EXPECT_EQ(fused_q.strides(), fq.transpose(1, 2).strides());
  const at::Tensor gq = at::randn_like(ref_q), gk = at::randn_like(ref_k);
  torch::autograd::backward({fused_q, fused_k}, {gq, gk});
  torch::autograd::backward({ref_q, ref_k}, {gq, gk});
  // Backward: the transpose rounds like autograd's graph too.
  EXPECT_TRUE(at::equal(fq.grad(), rq.grad()));
  EXPECT_TRUE(at::equal(fk.grad(), rk.grad()));
}

INSTANTIATE_TEST_SUITE_P(Shapes, RopeFused,
                         ::testing::Values(RopeCase{2, 4, 2, 6, 16, at::kFloat, false},
                                           RopeCase{2, 4, 2, 6, 16, at::kBFloat16, false},
                                           RopeCase{3, 6, 6, 5, 8, at::kHalf, true},
                                           RopeCase{2, 8, 1, 7, 64, at::kBFloat16, true}));

TEST_F(Fused, RopeFiniteDifferencesInFloat64) {
  torch::manual_seed(3);
  for (bool per_row : {false, true}) {
    auto [cos, sin] = Tables(2, 3, 6, per_row, at::kDouble);
    auto f = [&, cos = cos, sin = sin](const std::vector<at::Tensor>& in) {
      auto [a, b] = ApplyRopeQK(in[0], in[1], cos, sin);
      return std::vector<at::Tensor>{a, b};
    };
    const std::vector<at::Tensor> inputs = {at::randn({2, 3, 3, 6}, at::kDouble),
                                            at::randn({2, 1, 3, 6}, at::kDouble)};
    EXPECT_THAT(GradFnName(f({Leaf(inputs[0]), inputs[1]})[0]), HasSubstr("RopeQKFunction"));
    EXPECT_EQ(FiniteDifferenceProblems(f, inputs), "");
    EXPECT_EQ(SecondOrderFiniteDifferenceProblems(f, inputs), "");
  }
}

TEST_F(Fused, RopeBackwardIsRopeWithMinusSin) {
  auto [cos, sin] = Tables(1, 4, 8, false, at::kDouble);
  const at::Tensor q = Leaf(at::randn({1, 2, 4, 8}, at::kDouble));
  const at::Tensor k = Leaf(at::randn({1, 1, 4, 8}, at::kDouble));
  auto [a, b] = ApplyRopeQK(q, k, cos, sin);
  const at::Tensor gq = at::randn_like(a), gk = at::randn_like(b);
  torch::autograd::backward({a, b}, {gq, gk});
  auto [expect_q, expect_k] = reference::ApplyRopeQK(gq, gk, cos, -sin);
  EXPECT_LE(RelativeError(q.grad(), expect_q), 1e-15);
  EXPECT_LE(RelativeError(k.grad(), expect_k), 1e-15);
}

TEST_F(Fused, RopeTablesOfAnotherDtypeFallBackWithOneWarning) {
  internal::ResetFallbackWarningsForTesting();
  testing::CollectWarnings warnings;
  auto [cos, sin] = Tables(1, 4, 8, false, at::kFloat);
  const at::Tensor q = at::randn({1, 2, 4, 8}).to(at::kBFloat16);
  auto [a, b] = ApplyRopeQK(q, q, cos, sin);  // bf16 q, float32 tables: float32 out
  auto [ra, rb] = reference::ApplyRopeQK(q, q, cos, sin);
  EXPECT_TRUE(at::equal(a, ra));
  EXPECT_EQ(a.scalar_type(), at::kFloat);
  EXPECT_THAT(
      warnings.messages(),
      ElementsAre(AllOf(HasSubstr("kernels::ApplyRopeQK:"),
                        HasSubstr("q, k, cos, sin have dtypes BFloat16, BFloat16, Float"))));
  internal::ResetFallbackWarningsForTesting();
}

}  // namespace
}  // namespace kernels
