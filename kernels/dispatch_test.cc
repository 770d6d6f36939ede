// The choice between a fused kernel and the ATen reference
// (internal/fused_ops.h): which binaries have the CUDA kernels, what each op
// refuses and why, that a fallback warns once per op, and kernels/'s GPU
// checks run on the CPU (what gpu_check --dry-run-on-cpu does: the checks
// checked, through AtenFusedOps).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/TensorOperators.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>

#include "kernels/internal/aten_fused_ops.h"
#include "kernels/internal/fused_ops.h"
#include "kernels/kernels_gpu_check.h"
#include "kernels/rms_norm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"
#include "kernels/testing/collect_warnings.h"

namespace kernels::internal {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::StartsWith;

TEST(CudaFusedOps, RegisteredExactlyWhenTheBinaryLinksKernelsCuda) {
#ifdef TORCHFSDP_KERNELS_CUDA_LINKED
  ASSERT_NE(CudaFusedOps(), nullptr);
  EXPECT_STREQ(CudaFusedOps()->name(), "cuda");
#else
  EXPECT_EQ(CudaFusedOps(), nullptr);
#endif
}

TEST(ChooseFusedOps, CpuTensorsNeverTakeAFusedOp) {
  testing::CollectWarnings warnings;
  const at::Tensor x = at::randn({2, 4});
  int asked = 0;
  EXPECT_EQ(ChooseFusedOps(Op::kRmsNorm, {x, x},
                           [&](const FusedOps&) {
                             ++asked;
                             return std::string();
                           }),
            nullptr);
  EXPECT_EQ(asked, 0);
  EXPECT_THAT(warnings.messages(), IsEmpty());
}

TEST(ChooseFusedOps, TheTestingOverrideTakesEveryDevice) {
  ScopedFusedOpsForTesting fused(AtenFusedOps());
  const at::Tensor x = at::randn({2, 4});
  EXPECT_EQ(ChooseFusedOps(Op::kSwiGlu, {x}, [](const FusedOps&) { return std::string(); }),
            AtenFusedOps());
}

// The reason each op gives for inputs its kernel does not take.
TEST(Unsupported, SaysWhatIsNotTaken) {
  // AtenFusedOps takes what the kernels take, and float64.
  const FusedOps& cuda_like = *AtenFusedOps();
  const at::Tensor f32 = at::randn({2, 3, 8});
  const at::Tensor w = at::randn({8});
  EXPECT_EQ(UnsupportedRmsNorm(cuda_like, f32, {}, w), "");
  EXPECT_EQ(UnsupportedRmsNorm(cuda_like, f32, f32, w), "");
  EXPECT_EQ(UnsupportedRmsNorm(cuda_like, f32.to(at::kBFloat16), {}, w), "");  // f32 weight
  EXPECT_THAT(UnsupportedRmsNorm(cuda_like, f32.to(at::kInt), {}, w),
              StartsWith("x has dtype Int: the kernel takes float32, bfloat16 or float16"));
  EXPECT_THAT(UnsupportedRmsNorm(cuda_like, f32, {}, at::randn({7})),
              HasSubstr("weight has shape [7] for x of shape [2, 3, 8]"));
  EXPECT_THAT(UnsupportedRmsNorm(cuda_like, f32, f32.to(at::kHalf), w),
              HasSubstr("residual has shape [2, 3, 8] and dtype Half, x [2, 3, 8] and Float"));
  EXPECT_THAT(UnsupportedRmsNorm(cuda_like, at::zeros({3, 0}), {}, at::zeros({0})),
              HasSubstr("hidden >= 1"));

  EXPECT_EQ(UnsupportedSwiGlu(cuda_like, f32, f32), "");
  EXPECT_THAT(UnsupportedSwiGlu(cuda_like, f32, f32.to(at::kBFloat16)),
              HasSubstr("the same shape and dtype"));

  const at::Tensor q = at::randn({2, 4, 5, 8}), k = at::randn({2, 2, 5, 8});
  const at::Tensor table = at::randn({5, 8}), per_row = at::randn({2, 5, 8});
  EXPECT_EQ(UnsupportedRopeQK(cuda_like, q, k, table, table), "");
  EXPECT_EQ(UnsupportedRopeQK(cuda_like, q, k, per_row, per_row), "");
  EXPECT_THAT(UnsupportedRopeQK(cuda_like, q, at::randn({2, 2, 5, 6}), table, table),
              HasSubstr("with an even D"));
  EXPECT_THAT(UnsupportedRopeQK(cuda_like, at::randn({2, 4, 5, 7}), at::randn({2, 2, 5, 7}),
                                at::randn({5, 7}), at::randn({5, 7})),
              HasSubstr("with an even D"));
  EXPECT_THAT(UnsupportedRopeQK(cuda_like, q, k, at::randn({1, 5, 8}), at::randn({1, 5, 8})),
              HasSubstr("both [T, D] or both [B, T, D]"));
  EXPECT_THAT(UnsupportedRopeQK(cuda_like, q, k, table.requires_grad_(true), table),
              HasSubstr("cos or sin requires grad"));

  EXPECT_EQ(UnsupportedFloat8Cast(cuda_like, at::randn({16, 32})), "");
  EXPECT_EQ(UnsupportedFloat8Cast(cuda_like, at::randn({3, 5}, at::kBFloat16)), "");
  EXPECT_THAT(UnsupportedFloat8Cast(cuda_like, at::zeros({16, 32}, at::kInt)),
              StartsWith("x has dtype Int: the kernel takes float32, bfloat16 or float16"));
  EXPECT_THAT(UnsupportedFloat8Cast(cuda_like, at::randn({2, 16, 32})),
              HasSubstr("x has shape [2, 16, 32]: the kernel takes a non-empty [rows, cols]"));
  EXPECT_THAT(UnsupportedFloat8Cast(cuda_like, at::zeros({0, 32})),
              HasSubstr("a non-empty [rows, cols]"));
}

TEST(Unsupported, Float64IsTakenOnlyByTheAtenStandIn) {
  const at::Tensor x = at::randn({2, 8}, at::kDouble);
  const at::Tensor w = at::randn({8}, at::kDouble);
  EXPECT_EQ(UnsupportedRmsNorm(*AtenFusedOps(), x, {}, w), "");
  struct KernelDtypes final : FusedOps {
    const char* name() const override { return "kernel dtypes"; }
    RmsNormOut RmsNormForward(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              double) const override {
      return {};
    }
    std::pair<at::Tensor, at::Tensor> RmsNormBackward(const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, bool,
                                                      bool) const override {
      return {};
    }
    at::Tensor SwiGluForward(const at::Tensor&, const at::Tensor&) const override { return {}; }
    std::pair<at::Tensor, at::Tensor> SwiGluBackward(const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&) const override {
      return {};
    }
    std::pair<at::Tensor, at::Tensor> RopeQK(const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&, const at::Tensor&,
                                             bool) const override {
      return {};
    }
    Float8CastOut CastToFloat8(const at::Tensor&, at::ScalarType, bool,
                               const at::Tensor&) const override {
      return {};
    }
  } kernel_dtypes;
  EXPECT_THAT(UnsupportedRmsNorm(kernel_dtypes, x, {}, w),
              StartsWith("x has dtype Double: the kernel takes float32, bfloat16 or float16"));
}

TEST(WarnFallbackOnce, OncePerOpNamingTheOpAndTheReason) {
  ResetFallbackWarningsForTesting();
  testing::CollectWarnings warnings;
  WarnFallbackOnce(Op::kSwiGlu, "reason one");
  WarnFallbackOnce(Op::kSwiGlu, "reason two");
  WarnFallbackOnce(Op::kApplyRopeQK, "reason three");
  WarnFallbackOnce(Op::kFloat8Linear, "reason four");
  WarnFallbackOnce(Op::kFloat8Linear, "reason five");
  ASSERT_EQ(warnings.messages().size(), 3u);
  EXPECT_EQ(warnings.messages()[0],
            "kernels::SwiGlu: running the ATen reference instead of the fused kernel: reason one "
            "(said once)");
  EXPECT_THAT(warnings.messages()[1], StartsWith("kernels::ApplyRopeQK: "));
  EXPECT_EQ(warnings.messages()[2],
            "kernels::Float8Linear: running the ATen reference instead of the fused kernel: "
            "reason four (said once)");
  ResetFallbackWarningsForTesting();
}

TEST(KernelsGpuChecks, PassOnTheCpuThroughTheAtenStandIn) {
  const std::vector<gpu_check::Check> checks = kernels::KernelsGpuChecks(c10::Device(c10::kCPU));
  ASSERT_EQ(checks.size(), 8u);
  for (const gpu_check::Check& check : checks) {
    const gpu_check::Result result = check.run();
    std::printf("%s %s %s\n", result.ok ? "PASS" : "FAIL", check.name.c_str(),
                result.detail.c_str());
    EXPECT_TRUE(result.ok) << check.name << ": " << result.detail;
  }
}

}  // namespace
}  // namespace kernels::internal
