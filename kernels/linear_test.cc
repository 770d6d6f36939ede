// kernels::Linear and cpu_matmul.h's products against at::linear / at::mm
// in float64 (the exact values, rounded once).
#include "kernels/linear.h"

#include <limits>

#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "kernels/cpu_matmul.h"

namespace kernels {
namespace {

at::Tensor F64(const at::Tensor& t) { return t.detach().to(torch::kDouble); }

void ExpectClose(const at::Tensor& got, const at::Tensor& exact, const std::string& what) {
  ASSERT_EQ(got.sizes(), exact.sizes()) << what;
  const double scale = exact.abs().max().item<double>() + 1;
  const double error = (F64(got) - exact).abs().max().item<double>();
  EXPECT_LE(error, 2e-6 * scale) << what << ": error " << error << " of max " << scale;
}

// The wheel's LibTorch has oneDNN: if this fails, Mm silently became at::mm
// and the speed in benchmarks/RESULTS.md with it.
TEST(CpuMatmulTest, OneDnnServesLargeFloat32ProductsInEitherLayout) {
  ASSERT_TRUE(at::hasMKLDNN());
  ASSERT_TRUE(OneDnnMatmulFound());
  torch::NoGradGuard no_grad;
  const at::Tensor a = torch::randn({96, 128}), b = torch::randn({128, 160});
  EXPECT_TRUE(CpuMatmulUsesOneDnn(a, b));
  for (const auto& [x, y] :
       {std::pair{a, b}, std::pair{a.t().contiguous().t(), b}, std::pair{a, b.t().contiguous().t()},
        std::pair{a.t().contiguous().t(), b.t().contiguous().t()}}) {
    ASSERT_TRUE(CpuMatmulUsesOneDnn(x, y));
    ExpectClose(Mm(x, y), at::mm(F64(x), F64(y)), "Mm");
  }
}

TEST(CpuMatmulTest, OutIsOnlyWrittenAndAddAccumulates) {
  torch::NoGradGuard no_grad;
  const at::Tensor a = torch::randn({128, 96}), b = torch::randn({96, 128});
  // beta 0: a result full of NaN must not leak into the product.
  at::Tensor out = torch::full({128, 128}, std::numeric_limits<float>::quiet_NaN());
  MmOut(out, a, b);
  ExpectClose(out, at::mm(F64(a), F64(b)), "MmOut");
  at::Tensor acc = torch::randn({128, 128});
  const at::Tensor before = F64(acc);
  AddMmInPlace(acc, a, b);
  ExpectClose(acc, before + at::mm(F64(a), F64(b)), "AddMmInPlace");
}

TEST(CpuMatmulTest, EverythingElseIsAten) {
  torch::NoGradGuard no_grad;
  const at::Tensor small = torch::randn({8, 8});
  EXPECT_FALSE(CpuMatmulUsesOneDnn(small, small));  // below kOneDnnMinMacs
  const at::Tensor big = torch::randn({256, 256});
  EXPECT_FALSE(CpuMatmulUsesOneDnn(big.to(torch::kDouble), big.to(torch::kDouble)));
  // Every other column: neither layout oneDNN reads in place.
  const at::Tensor strided = torch::randn({256, 512}).slice(1, 0, 512, 2);
  EXPECT_FALSE(CpuMatmulUsesOneDnn(strided, big));
  ExpectClose(Mm(strided, big), at::mm(F64(strided), F64(big)), "strided");
  EXPECT_TRUE(torch::equal(Mm(small, small), at::mm(small, small)));
}

TEST(CpuMatmulTest, AutogradToRecordIsAtMm) {
  const at::Tensor a = torch::randn({128, 128}, torch::requires_grad());
  EXPECT_FALSE(CpuMatmulUsesOneDnn(a, a));
  EXPECT_TRUE(Mm(a, a).requires_grad());
}

// Forward and every gradient against float64 at::linear, on the Llama
// step's shapes ([batch, seq, in]) and a decode row.
TEST(LinearTest, ForwardAndGradientsMatchLinear) {
  torch::manual_seed(3);
  for (const std::vector<int64_t>& shape :
       std::vector<std::vector<int64_t>>{{4, 64, 96}, {2, 3, 96}, {1, 1, 96}, {300, 96}}) {
    for (bool with_bias : {false, true}) {
      const at::Tensor x = torch::randn(shape, torch::requires_grad());
      const at::Tensor w = torch::randn({80, 96}, torch::requires_grad());
      const at::Tensor b = with_bias ? torch::randn({80}, torch::requires_grad()) : at::Tensor();
      const at::Tensor y = Linear(x, w, b);
      const at::Tensor x64 = F64(x).requires_grad_(), w64 = F64(w).requires_grad_();
      const at::Tensor b64 = with_bias ? F64(b).requires_grad_() : at::Tensor();
      const at::Tensor y64 =
          at::linear(x64, w64, with_bias ? std::optional<at::Tensor>(b64) : std::nullopt);
      const std::string what = "shape " + c10::str(x.sizes()) + (with_bias ? " with bias" : "");
      ExpectClose(y, y64.detach(), what + ": output");
      const at::Tensor dy = torch::randn(y.sizes());
      y.backward(dy);
      y64.backward(F64(dy));
      ExpectClose(x.grad(), x64.grad(), what + ": dx");
      ExpectClose(w.grad(), w64.grad(), what + ": dW");
      if (with_bias) ExpectClose(b.grad(), b64.grad(), what + ": db");
    }
  }
}

TEST(LinearTest, SecondOrderGradientsMatchLinear) {
  torch::manual_seed(4);
  const at::Tensor x = torch::randn({64, 48}, torch::requires_grad());
  const at::Tensor w = torch::randn({40, 48}, torch::requires_grad());
  auto second = [](const at::Tensor& x, const at::Tensor& w, bool ours) {
    const at::Tensor y = ours ? Linear(x, w, {}) : at::linear(x, w);
    const at::Tensor dw = torch::autograd::grad({y.pow(2).sum()}, {w}, {}, /*retain_graph=*/true,
                                                /*create_graph=*/true)[0];
    return torch::autograd::grad({dw.pow(2).sum()}, {x})[0];
  };
  const at::Tensor x64 = F64(x).requires_grad_(), w64 = F64(w).requires_grad_();
  ExpectClose(second(x, w, true), second(x64, w64, false), "d/dx |dW|^2");
}

TEST(LinearTest, OtherTensorsAreAtLinear) {
  torch::NoGradGuard no_grad;
  const at::Tensor x = torch::randn({16, 32}, torch::kDouble);
  const at::Tensor w = torch::randn({8, 32}, torch::kDouble);
  EXPECT_TRUE(torch::equal(Linear(x, w, {}), at::linear(x, w)));
}

}  // namespace
}  // namespace kernels
