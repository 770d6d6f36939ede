// kernels::CastToFloat8 and kernels::Float8Linear against torchao 0.17.0's
// float8 recipe "tensorwise" run on the CPU (tools/golden/float8_golden.py
// wrote testdata/float8/golden.pt): the casts bit for bit, a two-layer
// model's output and gradients bit for bit (float32 and bfloat16, with and
// without bias); mutated recipes that the comparison must catch; the
// high-precision fallback for shapes _scaled_mm cannot take; which devices
// have float8 matrix products.
#include "kernels/float8_linear.h"

#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "kernels/internal/cuda_capability.h"
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
