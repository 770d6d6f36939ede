// kernels::CastToFloat8 and kernels::Float8Linear against torchao 0.17.0's
// float8 recipe "tensorwise" run on the CPU (tools/golden/float8_golden.py
// wrote testdata/float8/golden.pt): the casts bit for bit, a two-layer
// model's output and gradients bit for bit (float32 and bfloat16, with and
// without bias); mutated recipes that the comparison must catch; the
// high-precision fallback for shapes _scaled_mm cannot take; which devices
// have float8 matrix products; a cast given instead of made (shards cast
// with the whole's amax, a weight cast fully_shard gathered).
#include "kernels/float8_linear.h"

#include <limits>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "kernels/internal/aten_fused_ops.h"
#include "kernels/internal/cuda_capability.h"
#include "kernels/internal/fused_ops.h"
#include "kernels/reference.h"
#include "kernels/testing/collect_warnings.h"
#include "testing/golden_fixture.h"

namespace kernels {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

const test_data::GoldenFixture& Golden() {
  static const test_data::GoldenFixture golden(
      test_data::RunfilePath("kernels/testdata/float8/golden.pt"));
  return golden;
}

at::ScalarType CastDtype(const std::string& c) {
  return Golden()["cast." + c + ".dtype"].item<int64_t>() == 0 ? at::kFloat8_e4m3fn
                                                               : at::kFloat8_e5m2;
}

at::Tensor Bits(const at::Tensor& float8) { return float8.contiguous().view(at::kByte); }

// Elements whose bits differ.
int64_t BitsDiffer(const at::Tensor& a, const at::Tensor& b) {
  return Bits(a).ne(Bits(b)).sum().item<int64_t>();
}

double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

class CastTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CastTest, BitForBitTorchao) {
  const std::string c = GetParam();
  const at::Tensor input = Golden()["cast." + c + ".input"];
  const Float8Tensor t = CastToFloat8(input, CastDtype(c));
  EXPECT_EQ(t.data.scalar_type(), CastDtype(c));
  EXPECT_EQ(t.data.sizes(), input.sizes());
  EXPECT_EQ(t.orig_dtype, input.scalar_type());
  EXPECT_TRUE(at::equal(Bits(t.data), Golden()["cast." + c + ".data"]))
      << BitsDiffer(t.data, Golden()["cast." + c + ".data"].view(CastDtype(c)))
      << " elements differ";
  EXPECT_TRUE(at::equal(t.scale, Golden()["cast." + c + ".scale"]))
      << t.scale.item<float>() << " vs " << Golden()["cast." + c + ".scale"].item<float>();
  EXPECT_EQ(t.scale.scalar_type(), at::kFloat);
  EXPECT_EQ(t.scale.dim(), 0);
  EXPECT_TRUE(at::equal(t.inv_scale, t.scale.reciprocal()));
}

INSTANTIATE_TEST_SUITE_P(Golden, CastTest,
                         ::testing::Values("x_f32_e4m3", "x_bf16_e4m3", "g_f32_e5m2", "g_bf16_e5m2",
                                           "zeros_e4m3", "tiny_f32_e4m3", "huge_f32_e5m2"));

// reference::CastToFloat8Tensorwise, the fused CUDA cast's arithmetic element
// by element, is torchao's cast bit for bit, and its transposed layout is
// the same bytes transposed.
TEST_P(CastTest, FusedCastReferenceBitForBitTorchao) {
  const std::string c = GetParam();
  const at::Tensor input = Golden()["cast." + c + ".input"];
  const at::Tensor rows = input.reshape({-1, input.size(-1)});
  const reference::Float8Cast t = reference::CastToFloat8Tensorwise(rows, CastDtype(c), true);
  EXPECT_EQ(t.data.scalar_type(), CastDtype(c));
  EXPECT_TRUE(at::equal(Bits(t.data), Golden()["cast." + c + ".data"].reshape(rows.sizes())))
      << BitsDiffer(t.data,
                    Golden()["cast." + c + ".data"].view(CastDtype(c)).reshape(rows.sizes()))
      << " elements differ";
  EXPECT_TRUE(at::equal(Bits(t.data_t), Bits(t.data.t())));
  EXPECT_TRUE(at::equal(t.scale.view(at::kInt), Golden()["cast." + c + ".scale"].view(at::kInt)))
      << t.scale.item<float>() << " vs " << Golden()["cast." + c + ".scale"].item<float>();
  EXPECT_TRUE(at::equal(t.inv_scale, t.scale.reciprocal()));
  EXPECT_FALSE(reference::CastToFloat8Tensorwise(rows, CastDtype(c), false).data_t.defined());
}

// Bytes with every NaN as 0x7F and float32 scalars' bits with every NaN as
// 0x7FC00000: the sign and payload of a NaN are not specified (ATen's CPU
// recipe makes the scale -NaN from a +NaN input, the reference +NaN).
at::Tensor NanCanonicalBits(const at::Tensor& t) {
  if (at::isFloat8Type(t.scalar_type())) {
    return Bits(t).masked_fill(t.to(at::kFloat).isnan().contiguous(), 0x7F);
  }
  return t.contiguous().view(at::kInt).masked_fill(t.isnan(), 0x7FC00000);
}

// The reference against the ATen recipe (kernels::CastToFloat8) beyond the
// golden cases: every input dtype, both float8 dtypes, float8 subnormals,
// odd shapes, and non-finite inputs (an inf makes the scale 0 and itself a
// NaN, a NaN makes the scale and every byte NaN): bytes and scales
// identical, a NaN's sign apart.
TEST(FusedCastReferenceTest, BitForBitTheAtenRecipe) {
  at::manual_seed(47);
  int cases = 0;
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) {
    for (const at::ScalarType float8 : {at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
      for (const std::string values : {"randn", "wide", "negative zero", "inf", "nan", "tiny"}) {
        at::Tensor x = at::randn({37, 53}, at::kDouble);
        if (values == "wide") x = x * at::exp(5 * at::randn({37, 53}, at::kDouble));
        if (values == "tiny") x = x * 1e-7;  // within float16's subnormals
        if (values == "negative zero") x = x.clamp_max(0) * 0;
        x = x.to(dtype);
        if (values == "inf") x.view(-1)[100].fill_(std::numeric_limits<double>::infinity());
        if (values == "nan") x.view(-1)[7].fill_(std::numeric_limits<double>::quiet_NaN());
        const std::string name =
            std::string(c10::toString(dtype)) + " -> " + c10::toString(float8) + " " + values;
        const reference::Float8Cast ours = reference::CastToFloat8Tensorwise(x, float8, true);
        const Float8Tensor aten = CastToFloat8(x, float8);
        EXPECT_TRUE(at::equal(NanCanonicalBits(ours.data), NanCanonicalBits(aten.data)))
            << name << ": " << BitsDiffer(ours.data, aten.data) << " elements differ";
        EXPECT_TRUE(at::equal(NanCanonicalBits(ours.data_t), NanCanonicalBits(aten.data.t())));
        EXPECT_TRUE(at::equal(NanCanonicalBits(ours.scale), NanCanonicalBits(aten.scale)))
            << name << ": " << ours.scale.item<float>() << " vs " << aten.scale.item<float>();
        EXPECT_TRUE(at::equal(NanCanonicalBits(ours.inv_scale), NanCanonicalBits(aten.inv_scale)))
            << name;
        if (values == "nan") {
          EXPECT_TRUE(ours.scale.isnan().item<bool>()) << name;
          EXPECT_TRUE(ours.data.to(at::kFloat).isnan().all().item<bool>()) << name;
        } else {
          EXPECT_TRUE(at::equal(Bits(ours.data), Bits(aten.data))) << name;
          EXPECT_TRUE(at::equal(ours.scale.view(at::kInt), aten.scale.view(at::kInt))) << name;
        }
        if (values == "inf") EXPECT_EQ(ours.scale.item<float>(), 0.0f) << name;
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 48);
}

// The bit comparison catches plausible misreadings of torchao's order of
// operations. (Dropping the saturation cannot be caught: with a scale from
// the tensor's own amax, |x| * scale exceeds float8_max by at most a
// rounding, which the cast rounds to float8_max anyway.)
TEST(CastMutationTest, ScaleWithoutTheFloat64UpcastDiffers) {
  // amax_to_scale's arithmetic in float32 instead of float64.
  const at::Tensor input = Golden()["cast.g_f32_e5m2.input"];
  const at::Tensor scale = input.abs().max().clamp_min(1e-12).reciprocal().mul(57344.0);
  ASSERT_EQ(scale.scalar_type(), at::kFloat);
  EXPECT_FALSE(at::equal(scale, Golden()["cast.g_f32_e5m2.scale"]));
}

TEST(CastMutationTest, MultiplyingBeforeTheUpcastDiffers) {
  // bfloat16 x * scale rounds the product to bfloat16 before the float8 cast.
  const at::Tensor input = Golden()["cast.x_bf16_e4m3.input"];
  const at::Tensor scale = Golden()["cast.x_bf16_e4m3.scale"];
  const at::Tensor mutated = (input * scale).clamp(-448, 448).to(at::kFloat8_e4m3fn);
  ASSERT_EQ(mutated.scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_GT(BitsDiffer(mutated, Golden()["cast.x_bf16_e4m3.data"].view(at::kFloat8_e4m3fn)), 0);
}

struct Model {
  at::Tensor x, w0, b0, w1, b1, out;
};

// The golden case's parameters as leaves that require grad; forward through
// two Float8Linears; backward with the golden grad_out.
Model RunModel(const std::string& m) {
  const auto& g = Golden();
  const bool bias = g.has(m + ".b0");
  Model model;
  model.x = g[m + ".x"].clone().requires_grad_();
  model.w0 = g[m + ".w0"].clone().requires_grad_();
  model.w1 = g[m + ".w1"].clone().requires_grad_();
  if (bias) {
    model.b0 = g[m + ".b0"].clone().requires_grad_();
    model.b1 = g[m + ".b1"].clone().requires_grad_();
  }
  const auto opt = [](const at::Tensor& t) {
    return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
  };
  const at::Tensor h = Float8Linear(model.x, model.w0, opt(model.b0));
  model.out = Float8Linear(h, model.w1, opt(model.b1));
  model.out.backward(g[m + ".grad_out"]);
  return model;
}

class LinearTest : public ::testing::TestWithParam<std::string> {};

TEST_P(LinearTest, OutputAndGradientsBitForBitTorchao) {
  const std::string m = GetParam();
  const auto& g = Golden();
  const Model model = RunModel(m);
  std::vector<std::pair<std::string, at::Tensor>> checks = {
      {"out", model.out.detach()},
      {"grad.x", model.x.grad()},
      {"grad.w0", model.w0.grad()},
      {"grad.w1", model.w1.grad()},
  };
  if (model.b0.defined()) {
    checks.push_back({"grad.b0", model.b0.grad()});
    checks.push_back({"grad.b1", model.b1.grad()});
  }
  for (const auto& [name, ours] : checks) {
    const at::Tensor& theirs = g[m + "." + name];
    ASSERT_TRUE(ours.defined()) << name;
    EXPECT_EQ(ours.scalar_type(), theirs.scalar_type()) << name;
    EXPECT_EQ(ours.sizes(), theirs.sizes()) << name;
    EXPECT_TRUE(at::equal(ours, theirs))
        << m << " " << name << ": max |diff| " << MaxAbsDiff(ours, theirs);
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, LinearTest,
                         ::testing::Values("f32_bias", "f32_nobias", "bf16_bias", "bf16_nobias"));

// The second layer's weight gradient recomputed by hand: with grad_output in
// e5m2 it is torchao's bit for bit; in e4m3 (the forward's dtype) it is not,
// by far more than a rounding, so the golden comparison would catch that bug.
TEST(LinearMutationTest, GradOutputInE4m3Differs) {
  for (const std::string m : {"f32_bias", "bf16_nobias"}) {
    const auto& g = Golden();
    const std::optional<at::Tensor> b0 =
        g.has(m + ".b0") ? std::optional<at::Tensor>(g[m + ".b0"]) : std::nullopt;
    const at::Tensor h = Float8Linear(g[m + ".x"], g[m + ".w0"], b0).reshape({-1, 48});
    const at::Tensor grad_out = g[m + ".grad_out"].reshape({-1, 32});
    const auto grad_w1 = [&](at::ScalarType grad_dtype) {
      const Float8Tensor go = CastToFloat8(grad_out, grad_dtype);
      const Float8Tensor x1 = CastToFloat8(h, at::kFloat8_e4m3fn);
      return at::_scaled_mm(go.data.t().contiguous(), x1.data.t().contiguous().t(), go.inv_scale,
                            x1.inv_scale, std::nullopt, std::nullopt, grad_out.scalar_type(),
                            /*use_fast_accum=*/false);
    };
    const at::Tensor golden = g[m + ".grad.w1"];
    EXPECT_TRUE(at::equal(grad_w1(at::kFloat8_e5m2), golden)) << m;
    const at::Tensor mutated = grad_w1(at::kFloat8_e4m3fn);
    EXPECT_FALSE(at::equal(mutated, golden)) << m;
    EXPECT_GT(MaxAbsDiff(mutated, golden), 1e-3 * golden.abs().max().item<double>()) << m;
  }
}

// The fused path (what runs on CUDA): the autograd::Function with the
// casts of a FusedOps (here AtenFusedOps, the reference's arithmetic, in
// front of the dispatch on the CPU), saving only the transposed bits the
// backward needs. Still torchao's output and gradients bit for bit, and
// nothing warned.
TEST_P(LinearTest, FusedCastPathBitForBitTorchao) {
  const std::string m = GetParam();
  const auto& g = Golden();
  testing::CollectWarnings warnings;
  const internal::ScopedFusedOpsForTesting fused(internal::AtenFusedOps());
  const Model model = RunModel(m);
  std::vector<std::pair<std::string, at::Tensor>> checks = {
      {"out", model.out.detach()},
      {"grad.x", model.x.grad()},
      {"grad.w0", model.w0.grad()},
      {"grad.w1", model.w1.grad()},
  };
  if (model.b0.defined()) checks.push_back({"grad.b0", model.b0.grad()});
  for (const auto& [name, ours] : checks) {
    ASSERT_TRUE(ours.defined()) << name;
    EXPECT_TRUE(at::equal(ours, g[m + "." + name])) << m << " " << name;
  }
  EXPECT_THAT(warnings.messages(), ::testing::IsEmpty());
}

TEST(LinearTest, FusedCastPathOnlyTheGradientsAskedFor) {
  const internal::ScopedFusedOpsForTesting fused(internal::AtenFusedOps());
  const auto& g = Golden();
  for (const bool input_grad : {true, false}) {
    const at::Tensor x = g["f32_bias.x"].clone().requires_grad_(input_grad);
    const at::Tensor w = g["f32_bias.w0"].clone().requires_grad_(!input_grad);
    Float8Linear(x, w, std::nullopt).backward(at::ones({2, 16, 48}));
    EXPECT_EQ(x.grad().defined(), input_grad);
    EXPECT_EQ(w.grad().defined(), !input_grad);
    const internal::ScopedFusedOpsForTesting aten_recipe(nullptr);
    const at::Tensor xr = g["f32_bias.x"].clone().requires_grad_(input_grad);
    const at::Tensor wr = g["f32_bias.w0"].clone().requires_grad_(!input_grad);
    Float8Linear(xr, wr, std::nullopt).backward(at::ones({2, 16, 48}));
    EXPECT_TRUE(at::equal(input_grad ? x.grad() : w.grad(), input_grad ? xr.grad() : wr.grad()));
  }
}

TEST(LinearTest, WithoutGradModeTheSameOutput) {
  const internal::ScopedFusedOpsForTesting fused(internal::AtenFusedOps());
  const at::Tensor x = Golden()["f32_bias.x"].clone().requires_grad_();
  const at::Tensor w = Golden()["f32_bias.w0"].clone().requires_grad_();
  const at::Tensor with_grad = Float8Linear(x, w, std::nullopt);
  const at::NoGradGuard no_grad;
  EXPECT_TRUE(at::equal(Float8Linear(x, w, std::nullopt), with_grad.detach()));
}

TEST(LinearTest, BatchDimsAndContiguityDoNotMatter) {
  // The same rows as [32, 64] and as a transposed (non-contiguous) [16, 2, 64].
  const at::Tensor x = Golden()["f32_bias.x"];
  const at::Tensor w = Golden()["f32_bias.w0"];
  const at::Tensor flat = Float8Linear(x.reshape({32, 64}), w, std::nullopt);
  const at::Tensor strided = Float8Linear(x.transpose(0, 1), w, std::nullopt);
  EXPECT_TRUE(at::equal(flat.reshape({2, 16, 48}), strided.transpose(0, 1)));
}

TEST(LinearTest, FallsBackForDimsNotMultiplesOf16AndWarnsOncePerShape) {
  const at::Tensor x = Golden()["f32_bias.x"];
  const at::Tensor w15 = Golden()["f32_bias.w0"].narrow(0, 0, 15).contiguous();  // N = 15
  const at::Tensor b15 = Golden()["f32_bias.b0"].narrow(0, 0, 15).contiguous();
  const at::Tensor x30 = x.reshape({32, 64}).narrow(0, 0, 30);  // M = 30
  const at::Tensor w = Golden()["f32_bias.w0"];
  testing::CollectWarnings warnings;
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(at::equal(Float8Linear(x, w15, b15), at::linear(x, w15, b15)));
    EXPECT_TRUE(at::equal(Float8Linear(x30, w, std::nullopt), at::linear(x30, w)));
  }
  EXPECT_THAT(warnings.messages(),
              ElementsAre(HasSubstr("kernels::Float8Linear: input [2, 16, 64] x weight [15, 64] "
                                    "(M = 32 rows, K = 64, N = 15): float8 matrix products"),
                          HasSubstr("input [30, 64] x weight [48, 64] (M = 30 rows")));

  // Gradients flow through the fallback as through at::linear.
  const at::Tensor xg = x.clone().requires_grad_();
  Float8Linear(xg, w15, b15).sum().backward();
  const at::Tensor xr = x.clone().requires_grad_();
  at::linear(xr, w15, b15).sum().backward();
  EXPECT_TRUE(at::equal(xg.grad(), xr.grad()));
}

TEST(LinearTest, DoubleBackwardIsAnError) {
  const at::Tensor x = Golden()["f32_bias.x"].clone().requires_grad_();
  const at::Tensor w = Golden()["f32_bias.w0"];
  const at::Tensor y = Float8Linear(x, w, std::nullopt).sum();
  EXPECT_THAT([&] { torch::autograd::grad({y}, {x}, {}, /*retain_graph=*/true, true); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("create_graph=true")));
}

// ---- a cast made elsewhere (fully_shard's float8 all-gather) ----------------

// torchao's reduce_amax: shards cast with the whole's amax are the whole's
// cast, bit for bit, whatever the cut (uneven, one shard holding the amax).
TEST(ShardCastTest, ShardsCastWithTheWholesAmaxAreTheWholesCast) {
  at::manual_seed(3);
  at::Tensor x = at::randn({50, 32});
  x[40][7] = 37.5;  // the amax, in the last shard only
  const Float8Tensor whole = CastToFloat8(x, at::kFloat8_e4m3fn);
  const at::Tensor amax = x.abs().max();
  std::vector<at::Tensor> shards;
  bool own_amax_differs = false;
  for (const at::Tensor& shard : x.split(17, 0)) {
    const Float8Tensor cast = CastToFloat8(shard, at::kFloat8_e4m3fn, amax);
    EXPECT_TRUE(at::equal(cast.scale, whole.scale));
    EXPECT_TRUE(at::equal(cast.inv_scale, whole.inv_scale));
    shards.push_back(cast.data);
    // Each shard's own amax (no reduction) gives other bits where it is smaller.
    own_amax_differs |= BitsDiffer(CastToFloat8(shard, at::kFloat8_e4m3fn).data, cast.data) > 0;
  }
  EXPECT_EQ(BitsDiffer(at::cat(shards, 0), whole.data), 0);
  EXPECT_TRUE(own_amax_differs);
  // amax in any high-precision dtype and shape of one element.
  EXPECT_EQ(BitsDiffer(CastToFloat8(x, at::kFloat8_e4m3fn, amax.to(at::kDouble).view({1})).data,
                       whole.data),
            0);
}

// CastToFloat8Fused: the same bits as the ATen recipe with that amax, on
// the CPU (the recipe itself) and through the fused path (AtenFusedOps: the
// reference's arithmetic, which the CUDA kernel's is step for step), for a
// shard's 1-D, 2-D and 3-D shapes.
TEST(ShardCastTest, FusedCastWithAGivenAmaxIsTheRecipes) {
  at::manual_seed(6);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (at::ScalarType float8 : {at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
      for (const std::vector<int64_t>& shape :
           std::vector<std::vector<int64_t>>{{300}, {22, 32}, {3, 5, 16}}) {
        SCOPED_TRACE(c10::str(dtype, " ", float8, " ", at::IntArrayRef(shape)));
        const at::Tensor x = at::randn(shape).to(dtype);
        const at::Tensor amax = x.abs().max().to(at::kFloat) * 1.7;  // a larger whole's
        const Float8Tensor recipe = CastToFloat8(x, float8, amax);
        const Float8Tensor cpu = CastToFloat8Fused(x, float8, amax);
        EXPECT_EQ(BitsDiffer(cpu.data, recipe.data), 0);
        EXPECT_TRUE(at::equal(cpu.scale, recipe.scale));
        const internal::ScopedFusedOpsForTesting fused(internal::AtenFusedOps());
        const Float8Tensor path = CastToFloat8Fused(x, float8, amax);
        EXPECT_EQ(path.data.sizes(), x.sizes());
        EXPECT_EQ(BitsDiffer(path.data, recipe.data), 0);
        EXPECT_TRUE(at::equal(path.scale, recipe.scale));
        EXPECT_TRUE(at::equal(path.inv_scale, recipe.inv_scale));
      }
    }
  }
}

// Given the weight's cast, Float8Linear multiplies it and never reads the
// weight: a NaN weight standing for it gives the cast weight's output and
// gradients, bit for bit, and receives the weight's gradient.
TEST(GivenWeightCastTest, BitForBitTheWeightItCasts) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    at::manual_seed(4);
    const at::Tensor x0 = at::randn({2, 16, 64}).to(dtype);
    const at::Tensor w0 = (at::randn({48, 64}) * 0.1).to(dtype);
    const at::Tensor b = at::randn({48}).to(dtype);
    const at::Tensor g = at::randn({2, 16, 48}).to(dtype);
    const Float8Tensor cast = CastToFloat8(w0, at::kFloat8_e4m3fn);

    const at::Tensor x = x0.clone().requires_grad_();
    const at::Tensor w = w0.clone().requires_grad_();
    const at::Tensor y = Float8Linear(x, w, b);
    y.backward(g);
    const at::Tensor xc = x0.clone().requires_grad_();
    const at::Tensor nan_weight = at::full_like(w0, NAN).requires_grad_();
    const at::Tensor yc = Float8Linear(xc, nan_weight, cast, b);
    yc.backward(g);
    EXPECT_TRUE(at::equal(yc, y));
    EXPECT_TRUE(at::equal(xc.grad(), x.grad()));
    EXPECT_TRUE(at::equal(nan_weight.grad(), w.grad()));
    EXPECT_EQ(nan_weight.grad().scalar_type(), dtype);
  }
}

TEST(GivenWeightCastTest, FallbackUsesTheDequantizedCastAndGivesTheWeightItsGradient) {
  at::manual_seed(5);
  const at::Tensor x0 = at::randn({20, 64});  // M = 20: not a multiple of 16
  const at::Tensor w0 = at::randn({48, 64}) * 0.1;
  const Float8Tensor cast = CastToFloat8(w0, at::kFloat8_e4m3fn);
  const at::Tensor dequantized = cast.data.to(at::kFloat) * cast.inv_scale;
  testing::CollectWarnings warnings;
  const at::Tensor x = x0.clone().requires_grad_();
  const at::Tensor nan_weight = at::full_like(w0, NAN).requires_grad_();
  const at::Tensor y = Float8Linear(x, nan_weight, cast, std::nullopt);
  y.sum().backward();
  const at::Tensor xr = x0.clone().requires_grad_();
  const at::Tensor wr = dequantized.clone().requires_grad_();
  at::linear(xr, wr).sum().backward();
  EXPECT_TRUE(at::equal(y, at::linear(x0, dequantized)));
  EXPECT_TRUE(at::equal(x.grad(), xr.grad()));
  EXPECT_TRUE(at::equal(nan_weight.grad(), wr.grad()));
  EXPECT_THAT(warnings.messages(), ElementsAre(HasSubstr("input [20, 64] x weight [48, 64]")));
}

TEST(GivenWeightCastTest, ErrorsNameTheCastAndTheExpectation) {
  const at::Tensor x = at::zeros({16, 32});
  const at::Tensor w = at::ones({16, 32});
  const Float8Tensor cast = CastToFloat8(w, at::kFloat8_e4m3fn);
  const auto fails = [&](const Float8Tensor& bad, const std::string& expected) {
    EXPECT_THAT([&] { Float8Linear(x, w, bad, std::nullopt); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr(expected)));
  };
  Float8Tensor e5m2 = CastToFloat8(w, at::kFloat8_e5m2);
  fails(e5m2, "weight_cast.data is Float8_e5m2 [16, 32] on cpu: expected Float8_e4m3fn [16, 32]");
  Float8Tensor transposed = cast;
  transposed.data = cast.data.t();
  fails(transposed, "weight_cast.data is Float8_e4m3fn [32, 16] on cpu: expected");
  Float8Tensor no_scale = cast;
  no_scale.inv_scale = at::Tensor();
  fails(no_scale, "weight_cast.inv_scale is undefined: expected one float32 element on cpu");
  Float8Tensor double_scale = cast;
  double_scale.inv_scale = cast.inv_scale.to(at::kDouble);
  fails(double_scale, "weight_cast.inv_scale is Double");

  EXPECT_THAT([&] { CastToFloat8(w, at::kFloat8_e4m3fn, at::ones({2})); },
              ::testing::ThrowsMessage<c10::Error>(
                  HasSubstr("amax has shape [2] and dtype Float: expected one high-precision")));
  EXPECT_THAT([&] { CastToFloat8(w, at::kFloat8_e4m3fn, at::Tensor()); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("amax is undefined")));
}

TEST(ArgumentTest, ErrorsNameTheArgumentAndTheExpectation) {
  const at::Tensor x = at::zeros({16, 32});
  const at::Tensor w = at::zeros({16, 32});
  EXPECT_THAT([&] { Float8Linear(x, w.reshape({-1}), std::nullopt); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("weight has shape [512]")));
  EXPECT_THAT(
      [&] {
        Float8Linear(at::zeros({16, 48}), w, std::nullopt);
      },
      ::testing::ThrowsMessage<c10::Error>(HasSubstr("K = weight.size(1) = 32")));
  EXPECT_THAT([&] { Float8Linear(x.to(at::kDouble), w, std::nullopt); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("input has dtype Double")));
  EXPECT_THAT([&] { Float8Linear(x, w, at::zeros({32})); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("bias has shape [32]")));
  EXPECT_THAT([&] { CastToFloat8(x, at::kFloat); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("float8_dtype is Float")));
  EXPECT_THAT([&] { CastToFloat8(at::zeros({0}), at::kFloat8_e4m3fn); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("at least one element")));
  EXPECT_THAT([&] { CastToFloat8(at::zeros({4}, at::kInt), at::kFloat8_e4m3fn); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("x has dtype Int")));
}

TEST(SupportTest, CpuHasNoFloat8MatrixProducts) {
  std::string why;
  EXPECT_FALSE(Float8MatmulSupported(c10::Device(c10::kCPU), &why));
  EXPECT_THAT(why, HasSubstr("the CPU has no float8 matrix products"));
  EXPECT_FALSE(Float8MatmulSupported(c10::Device(c10::kCPU), nullptr));
}

#ifndef TORCHFSDP_KERNELS_CUDA_LINKED
TEST(SupportTest, CudaWithoutThePlugInIsRefusedWithTheReason) {
  std::string why;
  EXPECT_FALSE(Float8MatmulSupported(c10::Device("cuda:0"), &why));
  EXPECT_THAT(why, HasSubstr("does not link //kernels:cuda"));
}
#endif

// A stand-in for //kernels:cuda's query: the capability decides.
TEST(SupportTest, ComputeCapabilityDecides) {
  static int major = 0;
  static int minor = 0;
  const auto previous = internal::SetCudaCapabilityQuery([](c10::DeviceIndex) {
    return internal::ComputeCapability{major, minor};
  });
  std::string why;
  major = 8, minor = 0;  // A100
  EXPECT_FALSE(Float8MatmulSupported(c10::Device("cuda:0"), &why));
  EXPECT_THAT(why, HasSubstr("device cuda:0 has compute capability 8.0; float8 matrix products "
                             "need 8.9 or later"));
  for (const auto& [ma, mi] : {std::pair{8, 9}, std::pair{9, 0}, std::pair{10, 0}}) {
    major = ma, minor = mi;
    EXPECT_TRUE(Float8MatmulSupported(c10::Device("cuda:0"), &why)) << ma << "." << mi;
    EXPECT_EQ(why, "");
  }
  internal::SetCudaCapabilityQuery([](c10::DeviceIndex) -> internal::ComputeCapability {
    TORCH_CHECK(false, "no such device");
  });
  EXPECT_FALSE(Float8MatmulSupported(c10::Device("cuda:3"), &why));
  EXPECT_THAT(why, HasSubstr("cannot ask device cuda:3 for its compute capability: no such"));
  internal::SetCudaCapabilityQuery(previous);
}

}  // namespace
}  // namespace kernels
