#include "kernels/kernels_gpu_check.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/randn_like.h>
#include <ATen/ops/zeros.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>
#include <torch/utils.h>

#include "kernels/float8_linear.h"
#include "kernels/internal/aten_fused_ops.h"
#include "kernels/internal/fused_ops.h"
#include "kernels/linear_cross_entropy.h"
#include "kernels/reference.h"
#include "kernels/rms_norm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"

namespace kernels {
namespace {

constexpr double kEps = 1e-5;

// Collects the warnings raised while it is installed.
class CollectWarnings final : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  std::vector<std::string> messages;
};

// What a check needs around it: on the CPU (a dry run) the ATen FusedOps in
// front of the dispatch, so the Function path runs; warnings collected.
class CheckScope {
 public:
  explicit CheckScope(c10::Device device) : device_(device), guard_(&warnings_) {
    if (device.is_cpu()) dry_run_.emplace(internal::AtenFusedOps());
    torch::manual_seed(0);
  }
  bool dry_run() const { return dry_run_.has_value(); }
  const std::vector<std::string>& warnings() const { return warnings_.messages; }
  void Synchronize() const {
    if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
  }

 private:
  c10::Device device_;
  CollectWarnings warnings_;
  c10::WarningUtils::WarningHandlerGuard guard_;
  std::optional<internal::ScopedFusedOpsForTesting> dry_run_;
};

double RelativeError(const at::Tensor& actual, const at::Tensor& expected) {
  const at::Tensor a = actual.detach().to(at::kCPU).to(at::kDouble);
  const at::Tensor e = expected.detach().to(at::kCPU).to(at::kDouble);
  if (a.sizes() != e.sizes()) return 1e9;
  const double scale = e.abs().max().item<double>();
  const double diff = (a - e).abs().max().item<double>();
  return scale == 0 ? diff : diff / scale;
}

const char* DtypeName(at::ScalarType t) {
  return t == at::kFloat ? "f32" : t == at::kBFloat16 ? "bf16" : t == at::kHalf ? "f16" : "?";
}

// Tolerances (max-norm relative): float32 to the order of a sum; bf16 /
// fp16 a few units of the last place (the kernels keep some products in
// float32 that the composite rounds).
double ForwardTolerance(at::ScalarType t) { return t == at::kFloat ? 1e-5 : 2e-2; }
double GradTolerance(at::ScalarType t) { return t == at::kFloat ? 1e-4 : 5e-2; }

// Accumulates case results into one line.
class Report {
 public:
  void Compare(const std::string& what, const at::Tensor& actual, const at::Tensor& expected,
               double tolerance) {
    const double error = RelativeError(actual, expected);
    worst_ = std::max(worst_, error / tolerance);
    if (!(error <= tolerance)) {
      ok_ = false;
      problems_ << what << ": relative error " << error << " > " << tolerance << "; ";
    }
  }
  void ExpectKernel(const std::string& what, const at::Tensor& out, const char* function) {
    const auto fn = out.grad_fn();
    if (fn == nullptr || fn->name().find(function) == std::string::npos) {
      ok_ = false;
      problems_ << what << ": grad_fn " << (fn ? fn->name() : std::string("none")) << ", not "
                << function << " (the kernel path was not taken); ";
    }
  }
  void Fail(const std::string& problem) {
    ok_ = false;
    problems_ << problem << "; ";
  }
  void Note(const std::string& note) { notes_ << note << "; "; }
  void Case() { ++cases_; }
  gpu_check::Result Result(const CheckScope& scope) {
    for (const std::string& w : scope.warnings()) Fail("warning: " + w);
    std::ostringstream detail;
    if (ok_) {
      detail << cases_ << " cases against the ATen reference, worst error " << worst_
             << " of its tolerance; " << notes_.str();
    } else {
      detail << problems_.str();
    }
    return {ok_, detail.str()};
  }

 private:
  bool ok_ = true;
  int cases_ = 0;
  double worst_ = 0;
  std::ostringstream problems_, notes_;
};

at::Tensor Leaf(const at::Tensor& t) { return t.detach().clone().requires_grad_(true); }

// Median wall time of fn in ms (synchronised), on the GPU only.
double MedianMs(const CheckScope& scope, const std::function<void()>& fn, int reps = 10) {
  fn();
  scope.Synchronize();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    scope.Synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

std::string Timing(const char* what, double fused_ms, double reference_ms) {
  char line[160];
  std::snprintf(line, sizeof(line), "%s fwd+bwd %.3f ms fused vs %.3f ms reference (%.2fx)", what,
                fused_ms, reference_ms, reference_ms / fused_ms);
  return line;
}

// Registration is a static initialiser of //kernels:cuda: no GPU needed to
// see whether it ran.
gpu_check::Result CheckRegistered(c10::Device device, bool expect_cuda_kernels) {
  const internal::FusedOps* ops = internal::CudaFusedOps();
  const char* dry_run = device.is_cpu() ? "dry run, the kernels not run: " : "";
  if (ops == nullptr) {
    if (device.is_cpu() && !expect_cuda_kernels) {
      return {true, "dry run: //kernels:cuda not linked (not expected in this build)"};
    }
    return {false, std::string(dry_run) +
                       "this binary does not link //kernels:cuda: CUDA tensors would take the "
                       "ATen reference (add it to the binary's deps under //third_party:cuda; "
                       "in the CMake build, to the alwayslink objects)"};
  }
  return {true, std::string(dry_run) + "//kernels:cuda linked (FusedOps '" + ops->name() + "')"};
}

gpu_check::Result CheckRmsNorm(c10::Device device) {
  CheckScope scope(device);
  Report report;
  struct Case {
    std::vector<int64_t> shape;
    at::ScalarType x, w;
    bool residual;
  };
  const std::vector<Case> cases = {
      {{4, 64, 512}, at::kFloat, at::kFloat, false},
      {{4, 64, 512}, at::kBFloat16, at::kBFloat16, false},
      {{4, 64, 512}, at::kBFloat16, at::kFloat, false},
      {{3, 17, 1000}, at::kFloat, at::kFloat, true},  // cols not a multiple of 32
      {{2, 33, 4096}, at::kBFloat16, at::kBFloat16, true},
      {{2, 5, 8, 128}, at::kHalf, at::kHalf, false},  // Qwen3's per-head q/k norm
      {{7, 40}, at::kFloat, at::kFloat, true},        // fewer columns than a warp's multiple
  };
  for (const Case& c : cases) {
    report.Case();
    const auto options = at::TensorOptions().device(device);
    const at::Tensor x = at::randn(c.shape, options.dtype(c.x));
    const at::Tensor residual = at::randn(c.shape, options.dtype(c.x));
    const at::Tensor weight = (1 + 0.1 * at::randn({c.shape.back()}, options)).to(c.w);
    std::ostringstream name;
    name << (c.residual ? "AddRmsNorm " : "RmsNorm ") << at::IntArrayRef(c.shape) << " "
         << DtypeName(c.x) << "/" << DtypeName(c.w);
    at::Tensor fx = Leaf(x), fr = Leaf(residual), fw = Leaf(weight);
    at::Tensor rx = Leaf(x), rr = Leaf(residual), rw = Leaf(weight);
    at::Tensor fused_out, fused_sum, ref_out, ref_sum;
    if (c.residual) {
      std::tie(fused_out, fused_sum) = AddRmsNorm(fx, fr, fw, kEps);
      std::tie(ref_out, ref_sum) = reference::AddRmsNorm(rx, rr, rw, kEps);
    } else {
      fused_out = RmsNorm(fx, fw, kEps);
      ref_out = reference::RmsNorm(rx, rw, kEps);
    }
    report.ExpectKernel(name.str(), fused_out, "RmsNormFunction");
    report.Compare(name.str() + " out", fused_out, ref_out, ForwardTolerance(c.x));
    const at::Tensor grad = at::randn_like(ref_out);
    std::vector<at::Tensor> fused_outputs = {fused_out}, ref_outputs = {ref_out};
    std::vector<at::Tensor> grads = {grad};
    if (c.residual) {
      report.Compare(name.str() + " sum", fused_sum, ref_sum, 0);
      const at::Tensor grad_sum = at::randn_like(ref_sum);
      fused_outputs.push_back(fused_sum);
      ref_outputs.push_back(ref_sum);
      grads.push_back(grad_sum);
    }
    torch::autograd::backward(fused_outputs, grads);
    torch::autograd::backward(ref_outputs, grads);
    report.Compare(name.str() + " grad x", fx.grad(), rx.grad(), GradTolerance(c.x));
    report.Compare(name.str() + " grad weight", fw.grad(), rw.grad(), GradTolerance(c.x));
    if (c.residual) {
      report.Compare(name.str() + " grad residual", fr.grad(), rr.grad(), GradTolerance(c.x));
    }
  }
  if (!scope.dry_run()) {
    // A Llama 3 8B layer's norm at 8 x 2048 tokens, bf16.
    const auto options = at::TensorOptions().device(device).dtype(at::kBFloat16);
    const at::Tensor x = at::randn({8, 2048, 4096}, options).requires_grad_(true);
    const at::Tensor w = at::ones({4096}, options).requires_grad_(true);
    const at::Tensor g = at::randn({8, 2048, 4096}, options);
    const double fused = MedianMs(scope, [&] { RmsNorm(x, w, kEps).backward(g); });
    const double ref = MedianMs(scope, [&] { reference::RmsNorm(x, w, kEps).backward(g); });
    report.Note(Timing("RmsNorm [8, 2048, 4096] bf16", fused, ref));
  }
  return report.Result(scope);
}

gpu_check::Result CheckSwiGlu(c10::Device device) {
  CheckScope scope(device);
  Report report;
  const std::vector<std::pair<std::vector<int64_t>, at::ScalarType>> cases = {
      {{4, 64, 1376}, at::kFloat},
      {{4, 64, 1376}, at::kBFloat16},
      {{3, 7, 999}, at::kHalf},
      {{1}, at::kFloat},
  };
  for (const auto& [shape, dtype] : cases) {
    report.Case();
    const auto options = at::TensorOptions().device(device).dtype(dtype);
    const at::Tensor gate = 3 * at::randn(shape, options);
    const at::Tensor up = at::randn(shape, options);
    std::ostringstream name;
    name << "SwiGlu " << at::IntArrayRef(shape) << " " << DtypeName(dtype);
    at::Tensor fg = Leaf(gate), fu = Leaf(up), rg = Leaf(gate), ru = Leaf(up);
    const at::Tensor fused = SwiGlu(fg, fu);
    const at::Tensor ref = reference::SwiGlu(rg, ru);
    report.ExpectKernel(name.str(), fused, "SwiGluFunction");
    report.Compare(name.str() + " out", fused, ref, ForwardTolerance(dtype));
    const at::Tensor grad = at::randn_like(ref);
    fused.backward(grad);
    ref.backward(grad);
    report.Compare(name.str() + " grad gate", fg.grad(), rg.grad(), GradTolerance(dtype));
    report.Compare(name.str() + " grad up", fu.grad(), ru.grad(), GradTolerance(dtype));
  }
  if (!scope.dry_run()) {
    const auto options = at::TensorOptions().device(device).dtype(at::kBFloat16);
    const at::Tensor gate = at::randn({8, 2048, 14336}, options).requires_grad_(true);
    const at::Tensor up = at::randn({8, 2048, 14336}, options).requires_grad_(true);
    const at::Tensor g = at::randn({8, 2048, 14336}, options);
    const double fused = MedianMs(scope, [&] { SwiGlu(gate, up).backward(g); });
    const double ref = MedianMs(scope, [&] { reference::SwiGlu(gate, up).backward(g); });
    report.Note(Timing("SwiGlu [8, 2048, 14336] bf16", fused, ref));
  }
  return report.Result(scope);
}

gpu_check::Result CheckRope(c10::Device device) {
  CheckScope scope(device);
  Report report;
  struct Case {
    int64_t batch, heads, kv_heads, length, head_dim;
    at::ScalarType dtype;
    bool per_row_tables;
  };
  const std::vector<Case> cases = {
      {2, 8, 2, 32, 64, at::kFloat, false},      {2, 8, 2, 32, 64, at::kBFloat16, false},
      {3, 4, 4, 17, 128, at::kFloat, true},      {2, 6, 3, 9, 96, at::kHalf, true},
      {1, 32, 8, 64, 128, at::kBFloat16, false},
  };
  for (const Case& c : cases) {
    report.Case();
    const auto options = at::TensorOptions().device(device).dtype(c.dtype);
    // As models/ makes them: projections [B, T, H, D] transposed to [B, H, T, D].
    const at::Tensor q = at::randn({c.batch, c.length, c.heads, c.head_dim}, options);
    const at::Tensor k = at::randn({c.batch, c.length, c.kv_heads, c.head_dim}, options);
    const auto table_shape = c.per_row_tables
                                 ? std::vector<int64_t>{c.batch, c.length, c.head_dim / 2}
                                 : std::vector<int64_t>{c.length, c.head_dim / 2};
    const at::Tensor angles = at::randn(table_shape, options.dtype(at::kFloat));
    const at::Tensor emb = at::cat({angles, angles}, -1);
    const at::Tensor cos = emb.cos().to(c.dtype), sin = emb.sin().to(c.dtype);
    std::ostringstream name;
    name << "ApplyRopeQK B=" << c.batch << " H=" << c.heads << " Hkv=" << c.kv_heads
         << " T=" << c.length << " D=" << c.head_dim << " " << DtypeName(c.dtype)
         << (c.per_row_tables ? " [B, T, D] tables" : "");
    at::Tensor fq = Leaf(q), fk = Leaf(k), rq = Leaf(q), rk = Leaf(k);
    auto [fused_q, fused_k] = ApplyRopeQK(fq.transpose(1, 2), fk.transpose(1, 2), cos, sin);
    auto [ref_q, ref_k] = reference::ApplyRopeQK(rq.transpose(1, 2), rk.transpose(1, 2), cos, sin);
    report.ExpectKernel(name.str(), fused_q, "RopeQKFunction");
    report.Compare(name.str() + " q", fused_q, ref_q, ForwardTolerance(c.dtype));
    report.Compare(name.str() + " k", fused_k, ref_k, ForwardTolerance(c.dtype));
    const at::Tensor gq = at::randn_like(ref_q), gk = at::randn_like(ref_k);
    torch::autograd::backward({fused_q, fused_k}, {gq, gk});
    torch::autograd::backward({ref_q, ref_k}, {gq, gk});
    report.Compare(name.str() + " grad q", fq.grad(), rq.grad(), GradTolerance(c.dtype));
    report.Compare(name.str() + " grad k", fk.grad(), rk.grad(), GradTolerance(c.dtype));
  }
  if (!scope.dry_run()) {
    const auto options = at::TensorOptions().device(device).dtype(at::kBFloat16);
    const at::Tensor q = at::randn({8, 2048, 32, 128}, options).requires_grad_(true);
    const at::Tensor k = at::randn({8, 2048, 8, 128}, options).requires_grad_(true);
    const at::Tensor cos = at::randn({2048, 128}, options), sin = at::randn({2048, 128}, options);
    auto run = [&](auto&& rope) {
      return [&, rope] {
        auto [a, b] = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin);
        torch::autograd::backward({a, b}, {at::ones_like(a), at::ones_like(b)});
      };
    };
    const double fused = MedianMs(scope, run([](auto&&... a) { return ApplyRopeQK(a...); }));
    const double ref =
        MedianMs(scope, run([](auto&&... a) { return reference::ApplyRopeQK(a...); }));
    report.Note(Timing("ApplyRopeQK 8x2048, 32+8 heads of 128, bf16", fused, ref));
  }
  return report.Result(scope);
}

gpu_check::Result CheckLinearCrossEntropy(c10::Device device) {
  CheckScope scope(device);
  Report report;
  const int64_t rows = scope.dry_run() ? 300 : 8192;
  const int64_t vocab = scope.dry_run() ? 1000 : 32768;
  const int64_t width = scope.dry_run() ? 64 : 1024;
  const int64_t chunk = scope.dry_run() ? 64 : 1024;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    report.Case();
    const auto options = at::TensorOptions().device(device).dtype(dtype);
    const at::Tensor hidden = at::randn({rows, width}, options);
    const at::Tensor weight = (at::randn({vocab, width}, options) * 0.05).to(dtype);
    at::Tensor targets = at::randint(vocab, {rows}, options.dtype(at::kLong));
    targets.index_fill_(0, at::arange(0, rows, 7, targets.options()), -100);
    at::Tensor fh = Leaf(hidden), fw = Leaf(weight), rh = Leaf(hidden), rw = Leaf(weight);
    auto* allocator = device.is_cuda() ? c10::getDeviceAllocator(c10::kCUDA)
                                       : static_cast<c10::DeviceAllocator*>(nullptr);
    auto peak_of = [&](const std::function<void()>& fn) -> int64_t {
      if (allocator == nullptr) {
        fn();
        return 0;
      }
      scope.Synchronize();
      allocator->resetPeakStats(device.index());
      const int64_t base = allocator->getDeviceStats(device.index()).allocated_bytes[0].current;
      fn();
      scope.Synchronize();
      return allocator->getDeviceStats(device.index()).allocated_bytes[0].peak - base;
    };
    at::Tensor fused, ref;
    const int64_t fused_peak = peak_of([&] {
      fused = LinearCrossEntropy(fh, fw, targets, chunk);
      fused.backward();
    });
    const int64_t ref_peak = peak_of([&] {
      ref = reference::LinearCrossEntropy(rh, rw, targets);
      ref.backward();
    });
    const std::string name = std::string("LinearCrossEntropy ") + DtypeName(dtype);
    report.Compare(name + " loss", fused, ref, dtype == at::kFloat ? 1e-5 : 1e-3);
    report.Compare(name + " grad hidden", fh.grad(), rh.grad(), GradTolerance(dtype));
    report.Compare(name + " grad weight", fw.grad(), rw.grad(), GradTolerance(dtype));
    if (allocator != nullptr) {
      std::ostringstream note;
      note << name << " N=" << rows << " V=" << vocab << " H=" << width << " chunk=" << chunk
           << ": peak " << fused_peak / (1 << 20) << " MiB vs the reference's "
           << ref_peak / (1 << 20) << " MiB";
      report.Note(note.str());
      if (!(fused_peak * 2 < ref_peak)) report.Fail(note.str() + ": expected under half");
    }
  }
  return report.Result(scope);
}

// Bit for bit, every NaN one NaN (a NaN's sign and payload are not
// specified, and ATen's CPU and GPU arithmetic make different ones): float8
// as bytes, other dtypes as their bits.
at::Tensor NanCanonicalBits(const at::Tensor& t) {
  const at::Tensor nan = t.to(at::kFloat).isnan().contiguous();
  switch (t.element_size()) {
    case 1: return t.contiguous().view(at::kByte).masked_fill(nan, 0x7F);
    case 2: return t.contiguous().view(at::kShort).masked_fill(nan, 0x7FFF);
    case 4: return t.contiguous().view(at::kInt).masked_fill(nan, 0x7FC00000);
    default: return t;
  }
}
bool SameBits(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  return at::equal(NanCanonicalBits(a), NanCanonicalBits(b));
}

// Float8Linear's fused cast (two kernels: amax, then scale + cast +
// transpose in one pass) against torchao's recipe as ATen operators on the
// same device (kernels::CastToFloat8, which float8_linear_test holds to
// torchao bit for bit): the bytes of both layouts and the scales identical.
gpu_check::Result CheckFloat8Cast(c10::Device device) {
  CheckScope scope(device);
  Report report;
  const auto options = at::TensorOptions().device(device);
  std::string why;
  const internal::FusedOps* ops = internal::AvailableFusedOps(at::zeros({1}, options), &why);
  if (ops == nullptr) return {false, "no fused cast: " + why};
  struct Case {
    std::vector<int64_t> shape;
    at::ScalarType dtype, float8;
    const char* values;  // "randn", "wide" (subnormal float8 too), "zeros", "inf", "nan"
    double magnitude;
  };
  const std::vector<Case> cases = {
      {{256, 512}, at::kFloat, at::kFloat8_e4m3fn, "randn", 3},
      {{256, 512}, at::kBFloat16, at::kFloat8_e4m3fn, "randn", 3},
      {{64, 4096}, at::kHalf, at::kFloat8_e4m3fn, "randn", 1e-3},
      {{2048, 96}, at::kBFloat16, at::kFloat8_e5m2, "randn", 1e-4},
      {{37, 53}, at::kFloat, at::kFloat8_e5m2, "randn", 1e3},  // partial tiles
      {{1, 1}, at::kBFloat16, at::kFloat8_e4m3fn, "randn", 1},
      {{100, 300}, at::kFloat, at::kFloat8_e4m3fn, "wide", 1},
      {{100, 300}, at::kBFloat16, at::kFloat8_e5m2, "wide", 1},
      {{16, 16}, at::kFloat, at::kFloat8_e4m3fn, "zeros", 0},
      {{48, 80}, at::kFloat, at::kFloat8_e4m3fn, "inf", 1},
      {{48, 80}, at::kBFloat16, at::kFloat8_e5m2, "nan", 1},
  };
  for (const Case& c : cases) {
    report.Case();
    const std::string values = c.values;
    at::Tensor x = at::randn(c.shape, options) * c.magnitude;
    if (values == "wide") x = x * at::exp(4 * at::randn(c.shape, options));
    if (values == "zeros") x = at::zeros(c.shape, options);
    x = x.to(c.dtype);
    if (values == "inf") x.view(-1)[x.numel() / 2].fill_(-std::numeric_limits<double>::infinity());
    if (values == "nan") x.view(-1)[x.numel() / 3].fill_(std::numeric_limits<double>::quiet_NaN());
    std::ostringstream name;
    name << "cast " << at::IntArrayRef(c.shape) << " " << DtypeName(c.dtype) << " -> " << c.float8
         << " " << values;
    const internal::FusedOps::Float8CastOut fused =
        ops->CastToFloat8(x, c.float8, true, at::Tensor());
    const Float8Tensor aten = CastToFloat8(x, c.float8);
    if (!SameBits(fused.data, aten.data)) report.Fail(name.str() + ": data bytes differ");
    if (!SameBits(fused.data_t, aten.data.t().contiguous())) {
      report.Fail(name.str() + ": transposed bytes differ");
    }
    if (!SameBits(fused.scale, aten.scale)) {
      report.Fail(name.str() + ": scale " + std::to_string(fused.scale.item<float>()) + " vs " +
                  std::to_string(aten.scale.item<float>()));
    }
    if (!SameBits(fused.inv_scale, aten.inv_scale)) report.Fail(name.str() + ": inv_scale differs");
    // With an amax given (twice x's: a larger whole's, as fully_shard's
    // float8 all-gather reduces it over the shards), no amax pass.
    const at::Tensor amax = x.abs().max().to(at::kFloat) * 2;
    const internal::FusedOps::Float8CastOut given = ops->CastToFloat8(x, c.float8, false, amax);
    const Float8Tensor aten_given = CastToFloat8(x, c.float8, amax);
    if (!SameBits(given.data, aten_given.data) || !SameBits(given.scale, aten_given.scale)) {
      report.Fail(name.str() + ": with a given amax, the bytes or the scale differ");
    }
  }
  report.Note(
      "float8 bytes (both layouts) and scales bit for bit (a NaN's sign apart), with the amax "
      "computed and given");
  if (!scope.dry_run()) {
    // A Llama 3 8B layer's activations at 8 x 2048 tokens, bf16, both layouts.
    const at::Tensor x = at::randn({16384, 4096}, options.dtype(at::kBFloat16));
    const double fused =
        MedianMs(scope, [&] { ops->CastToFloat8(x, at::kFloat8_e4m3fn, true, at::Tensor()); });
    const double aten = MedianMs(scope, [&] {
      const Float8Tensor t = CastToFloat8(x, at::kFloat8_e4m3fn);
      t.data.t().contiguous();
    });
    char line[200];
    std::snprintf(line, sizeof(line),
                  "cast [16384, 4096] bf16 -> e4m3 + transposed copy %.3f ms fused vs %.3f ms "
                  "ATen recipe (%.2fx)",
                  fused, aten, aten / fused);
    report.Note(line);
  }
  return report.Result(scope);
}

// Float8Linear with the fused casts against the same op with the reference
// casts (AtenFusedOps: reference::CastToFloat8Tensorwise on the CPU, the
// products on the device): the same bits in, so the output and every
// gradient bit for bit. On the GPU only where float8 matrix products run
// (compute capability 8.9 or later).
gpu_check::Result CheckFloat8Linear(c10::Device device) {
  CheckScope scope(device);
  std::string why;
  if (!scope.dry_run() && !Float8MatmulSupported(device, &why)) return {true, "not run: " + why};
  Report report;
  for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    report.Case();
    const auto options = at::TensorOptions().device(device).dtype(dtype);
    const at::Tensor x = at::randn({4, 64, 512}, options);
    const at::Tensor w = (at::randn({768, 512}, options) * 0.05).to(dtype);
    const at::Tensor b = at::randn({768}, options);
    const at::Tensor grad = at::randn({4, 64, 768}, options);
    at::Tensor fx = Leaf(x), fw = Leaf(w), fb = Leaf(b), rx = Leaf(x), rw = Leaf(w), rb = Leaf(b);
    const at::Tensor fused = Float8Linear(fx, fw, fb);
    fused.backward(grad);
    at::Tensor ref;
    {
      const internal::ScopedFusedOpsForTesting reference_casts(internal::AtenFusedOps());
      ref = Float8Linear(rx, rw, rb);
      ref.backward(grad);
    }
    const std::string name =
        std::string("Float8Linear [256, 512] x [768, 512] ") + DtypeName(dtype);
    for (const auto& [what, a, e] :
         {std::tuple<const char*, at::Tensor, at::Tensor>{"out", fused, ref},
          {"grad x", fx.grad(), rx.grad()},
          {"grad weight", fw.grad(), rw.grad()},
          {"grad bias", fb.grad(), rb.grad()}}) {
      if (!a.defined() || !SameBits(a.detach(), e.detach())) {
        report.Fail(name + " " + what + ": not bit for bit the reference casts' (max |diff| " +
                    std::to_string(RelativeError(a, e)) + " relative)");
      }
    }
  }
  report.Note("output and gradients bit for bit");
  if (!scope.dry_run()) {
    // A Llama 3 8B MLP projection at 8 x 2048 tokens: float8 against bf16.
    const auto options = at::TensorOptions().device(device).dtype(at::kBFloat16);
    const at::Tensor x = at::randn({16384, 4096}, options).requires_grad_(true);
    const at::Tensor w = (at::randn({14336, 4096}, options) * 0.02).requires_grad_(true);
    const at::Tensor g = at::randn({16384, 14336}, options);
    const double f8 = MedianMs(scope, [&] { Float8Linear(x, w, std::nullopt).backward(g); });
    const double bf16 = MedianMs(scope, [&] { at::linear(x, w).backward(g); });
    char line[200];
    std::snprintf(line, sizeof(line),
                  "Float8Linear [16384, 4096] x [14336, 4096] fwd+bwd %.3f ms vs bf16 at::linear "
                  "%.3f ms (%.2fx)",
                  f8, bf16, bf16 / f8);
    report.Note(line);
  }
  return report.Result(scope);
}

// A CUDA input the kernel does not take falls back to the reference with one
// warning naming the op and the reason.
gpu_check::Result CheckFallbackWarns(c10::Device device) {
  CheckScope scope(device);
  internal::ResetFallbackWarningsForTesting();
  const auto options = at::TensorOptions().device(device);
  const at::Tensor x = at::randn({4, 64}, options);
  const at::Tensor weight = at::randn({64}, options.dtype(at::kHalf));  // f16 weight, f32 x
  const at::Tensor out = RmsNorm(x, weight, kEps);
  RmsNorm(x, weight, kEps);  // no second warning
  const double error = RelativeError(out, reference::RmsNorm(x, weight, kEps));
  const auto& warnings = scope.warnings();
  if (warnings.size() != 1 || warnings[0].find("kernels::RmsNorm") == std::string::npos ||
      warnings[0].find("Half") == std::string::npos || error != 0) {
    std::ostringstream detail;
    detail << warnings.size() << " warnings (expected 1 naming kernels::RmsNorm and the Half "
           << "weight)" << (warnings.empty() ? "" : ": " + warnings[0]) << "; result vs reference "
           << error;
    internal::ResetFallbackWarningsForTesting();
    return {false, detail.str()};
  }
  internal::ResetFallbackWarningsForTesting();
  return {true, "warned once: " + warnings[0]};
}

}  // namespace

std::vector<gpu_check::Check> KernelsGpuChecks(c10::Device device, bool expect_cuda_kernels) {
  return {
      {"kernels_cuda_linked",
       [device, expect_cuda_kernels] { return CheckRegistered(device, expect_cuda_kernels); }},
      {"kernels_rms_norm", [device] { return CheckRmsNorm(device); }},
      {"kernels_swiglu", [device] { return CheckSwiGlu(device); }},
      {"kernels_rope_qk", [device] { return CheckRope(device); }},
      {"kernels_linear_cross_entropy", [device] { return CheckLinearCrossEntropy(device); }},
      {"kernels_float8_cast", [device] { return CheckFloat8Cast(device); }},
      {"kernels_float8_linear", [device] { return CheckFloat8Linear(device); }},
      {"kernels_fallback_warns", [device] { return CheckFallbackWarns(device); }},
  };
}

}  // namespace kernels
