#include "kernels/float8_linear.h"

#include <atomic>
#include <cstdint>
#include <limits>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_scaled_mm.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/linear.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e4m3fnuz.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Float8_e5m2fnuz.h>
#include <torch/csrc/autograd/custom_function.h>

#include "kernels/internal/cuda_capability.h"
#include "kernels/internal/fused_ops.h"

namespace kernels {
namespace internal {
namespace {
// Constant-initialised, so //kernels:cuda's static initialiser may set it
// before or after this file's.
std::atomic<CudaCapabilityQuery> g_capability_query{nullptr};
}  // namespace

CudaCapabilityQuery SetCudaCapabilityQuery(CudaCapabilityQuery query) {
  return g_capability_query.exchange(query);
}

CudaCapabilityQuery GetCudaCapabilityQuery() { return g_capability_query.load(); }

}  // namespace internal

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// torch.finfo(dtype).max, which torchao scales to and saturates at.
double Float8Max(at::ScalarType float8_dtype) {
  switch (float8_dtype) {
    case at::kFloat8_e4m3fn: return std::numeric_limits<c10::Float8_e4m3fn>::max();
    case at::kFloat8_e5m2: return std::numeric_limits<c10::Float8_e5m2>::max();
    case at::kFloat8_e4m3fnuz: return std::numeric_limits<c10::Float8_e4m3fnuz>::max();
    case at::kFloat8_e5m2fnuz: return std::numeric_limits<c10::Float8_e5m2fnuz>::max();
    default: break;
  }
  TORCH_CHECK(false, "kernels::CastToFloat8: float8_dtype is ", float8_dtype,
              ": expected Float8_e4m3fn, Float8_e5m2, Float8_e4m3fnuz or Float8_e5m2fnuz");
}

// torchao's amax_to_scale: EPS keeps an all-zero tensor from dividing by zero.
constexpr double kAmaxEps = 1e-12;

// _scaled_mm's first operand is row-major, its second column-major (cuBLASLt's
// float8 GEMM takes only "TN"); torchao's preprocess_addmm arranges the same.
bool IsRowMajor(const at::Tensor& t) { return t.stride(0) > t.stride(1) && t.stride(1) == 1; }
at::Tensor RowMajor(const at::Tensor& t) { return IsRowMajor(t) ? t : t.contiguous(); }
at::Tensor ColumnMajor(const at::Tensor& t) { return IsRowMajor(t) ? t.t().contiguous().t() : t; }

at::Tensor ScaledMm(const at::Tensor& a, const at::Tensor& a_inv_scale, const at::Tensor& b,
                    const at::Tensor& b_inv_scale, at::ScalarType out_dtype, bool use_fast_accum) {
  return at::_scaled_mm(RowMajor(a), ColumnMajor(b), a_inv_scale, b_inv_scale,
                        /*bias=*/std::nullopt, /*scale_result=*/std::nullopt, out_dtype,
                        use_fast_accum);
}

// The recipe's settings ("tensorwise": Float8LinearConfig's defaults).
constexpr at::ScalarType kForwardDtype = at::kFloat8_e4m3fn;  // input and weight
constexpr at::ScalarType kGradientDtype = at::kFloat8_e5m2;   // grad_output
constexpr bool kOutputFastAccum = true;                       // gemm_config_output
constexpr bool kGradFastAccum = false;                        // grad_input, grad_weight

// A cast for a matrix product: the float8 bits, row-major, and (when a
// product needs the operand the other way round) the same bits transposed,
// row-major: data_t.t() is data in the column-major layout _scaled_mm's
// second operand takes.
struct Float8Operand {
  at::Tensor data;    // [rows, cols] row-major
  at::Tensor data_t;  // [cols, rows] row-major; undefined unless asked for
  at::Tensor inv_scale;
};

// x [rows, cols] cast by the fused kernel `ops` chose (internal/fused_ops.h:
// the CUDA kernel, or AtenFusedOps in tests), or, with none (the CPU, or a
// CUDA binary without //kernels:cuda, which warned), by the ATen recipe
// CastToFloat8 and a transposed copy.
Float8Operand CastOperand(const internal::FusedOps* ops, const at::Tensor& x,
                          at::ScalarType float8_dtype, bool transposed) {
  if (ops != nullptr) {
    internal::FusedOps::Float8CastOut c =
        ops->CastToFloat8(x.contiguous(), float8_dtype, transposed, at::Tensor());
    return {c.data, c.data_t, c.inv_scale};
  }
  const Float8Tensor c = CastToFloat8(x, float8_dtype);
  return {c.data, transposed ? c.data.t().contiguous() : at::Tensor(), c.inv_scale};
}

struct Float8LinearFunction : torch::autograd::Function<Float8LinearFunction> {
  // input [..., K], weight [N, K] -> [..., N] in input's dtype. `ops`: the
  // cast's implementation (nullptr: the ATen recipe). `weight_cast`: the
  // weight's cast made elsewhere (then weight's values are not read), or
  // nullptr. grad_input, grad_weight: whether a backward may ask for them
  // (grad mode on and the tensor requires grad; forward runs with grad mode
  // off).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const internal::FusedOps* ops, const Float8Tensor* weight_cast,
                            bool grad_input, bool grad_weight) {
    const int64_t k = weight.size(1);
    // Each cast also writes, in the same pass, the transposed bits the
    // backward's product needs (x's for grad_weight, w's for grad_input),
    // and only those are saved: the forward's layout is freed after the
    // product, so the backward makes no copies and holds 1 byte an element.
    const Float8Operand x = CastOperand(ops, input.reshape({-1, k}), kForwardDtype, grad_weight);
    // A given cast is saved as it is, row-major (its owner, e.g. fully_shard,
    // frees and refills that memory between forward and backward as it does
    // for any parameter autograd saved); the backward transposes it.
    const Float8Operand w =
        weight_cast != nullptr
            ? Float8Operand{weight_cast->data, at::Tensor(), weight_cast->inv_scale}
            : CastOperand(ops, weight, kForwardDtype, grad_input);
    // [M, K] x weight.t(): the column-major [K, N] view of w's row-major [N, K] bits.
    const at::Tensor out = ScaledMm(x.data, x.inv_scale, w.data.t(), w.inv_scale,
                                    input.scalar_type(), kOutputFastAccum);
    // The float8 casts, not the inputs: torchao casts input and weight again
    // in backward, to the same bits.
    ctx->save_for_backward(
        {x.data_t, x.inv_scale, weight_cast != nullptr ? w.data : w.data_t, w.inv_scale});
    ctx->saved_data["weight_row_major"] = weight_cast != nullptr;
    ctx->saved_data["input_sizes"] = input.sizes().vec();
    ctx->saved_data["fused_ops"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(ops));
    std::vector<int64_t> out_sizes = input.sizes().vec();
    out_sizes.back() = weight.size(0);
    return out.view(out_sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "kernels::Float8Linear: backward with create_graph=true is not supported (the "
                "float8 matrix products have no derivative)");
    const variable_list saved = ctx->get_saved_variables();
    const std::vector<int64_t> input_sizes = ctx->saved_data["input_sizes"].toIntVector();
    const auto* ops = reinterpret_cast<const internal::FusedOps*>(
        static_cast<intptr_t>(ctx->saved_data["fused_ops"].toInt()));
    const at::Tensor& grad_out = grad_outputs[0];
    if (!grad_out.defined())
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor& x_t = saved[0];  // [K, M]
    const at::Tensor& x_inv_scale = saved[1];
    // [K, N] row-major; a given weight cast was saved as it is, [N, K].
    const at::Tensor w_t =
        ctx->saved_data["weight_row_major"].toBool() ? saved[2].t().contiguous() : saved[2];
    const at::Tensor& w_inv_scale = saved[3];
    const bool need_input = ctx->needs_input_grad(0);
    const bool need_weight = ctx->needs_input_grad(1);
    const int64_t n = grad_out.size(-1);  // weight.size(0)
    // torchao casts grad_output twice (for grad_input and grad_weight), to
    // the same bits with the tensorwise recipe: once here, with its
    // transpose for grad_weight in the same pass.
    const at::ScalarType dtype = grad_out.scalar_type();
    const at::Tensor grad_2d = grad_out.reshape({-1, n});
    const Float8Operand g = CastOperand(ops, grad_2d, kGradientDtype, need_weight);
    at::Tensor grad_input;
    at::Tensor grad_weight;
    if (need_input) {
      // [M, N] x [N, K]: w_t.t() is w's bits column-major.
      grad_input = ScaledMm(g.data, g.inv_scale, w_t.t(), w_inv_scale, dtype, kGradFastAccum)
                       .view(input_sizes);
    }
    if (need_weight) {
      // [N, M] x [M, K]: g's bits transposed, row-major; x_t.t() is x's bits column-major.
      grad_weight = ScaledMm(g.data_t, g.inv_scale, x_t.t(), x_inv_scale, dtype, kGradFastAccum);
    }
    return {grad_input, grad_weight, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

bool IsLinearDtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// "input [2, 15, 64] x weight [48, 64]", the key of the warning once per shape.
std::string ShapeName(const at::Tensor& input, const at::Tensor& weight) {
  std::ostringstream s;
  s << "input " << input.sizes() << " x weight " << weight.sizes();
  return s.str();
}

void WarnFallbackOnce(const at::Tensor& input, const at::Tensor& weight, int64_t rows) {
  static std::mutex mutex;
  static std::set<std::string> warned;
  const std::string shape = ShapeName(input, weight);
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (!warned.insert(shape).second) return;
  }
  TORCH_WARN("kernels::Float8Linear: ", shape, " (M = ", rows, " rows, K = ", weight.size(1),
             ", N = ", weight.size(0),
             "): float8 matrix products (at::_scaled_mm) need M, K and N non-zero multiples of "
             "16; running the high-precision at::linear instead (said once per shape)");
}

void CheckCastInput(const at::Tensor& x) {
  TORCH_CHECK(x.defined(), "kernels::CastToFloat8: x is undefined: expected a tensor");
  TORCH_CHECK(x.is_floating_point() && !at::isFloat8Type(x.scalar_type()),
              "kernels::CastToFloat8: x has dtype ", x.scalar_type(),
              ": expected a high-precision floating dtype (float32, bfloat16, float16, float64)");
  TORCH_CHECK(x.numel() > 0, "kernels::CastToFloat8: x has shape ", x.sizes(),
              ": expected at least one element (amax of an empty tensor is undefined)");
}

void CheckGivenAmax(const at::Tensor& x, const at::Tensor& amax) {
  TORCH_CHECK(amax.defined() && amax.numel() == 1 && amax.is_floating_point() &&
                  !at::isFloat8Type(amax.scalar_type()),
              "kernels::CastToFloat8: amax ",
              amax.defined()
                  ? "has shape " + c10::str(amax.sizes(), " and dtype ", amax.scalar_type())
                  : std::string("is undefined"),
              ": expected one high-precision floating element, max(|x|) over the tensor x is "
              "part of");
  TORCH_CHECK(amax.device() == x.device(), "kernels::CastToFloat8: amax is on ", amax.device(),
              " and x on ", x.device(), ": expected one device");
}

Float8Tensor CastWithAmax(const at::Tensor& x, at::ScalarType float8_dtype,
                          const at::Tensor& amax) {
  const double float8_max = Float8Max(float8_dtype);
  const at::NoGradGuard no_grad;
  // amax_to_scale: float64, `float8_max / clamp(amax, EPS)`, which Python
  // evaluates as Tensor.__rtruediv__: reciprocal, then multiply (a division
  // rounds differently); then float32.
  const at::Tensor scale =
      amax.to(at::kDouble).clamp_min(kAmaxEps).reciprocal().mul(float8_max).to(at::kFloat);
  // _ToFloat8ConstrFunc: x upcast to float32 before the multiply (as
  // torch.compile would), then to_fp8_saturated: clamp, cast.
  const at::Tensor data =
      (x.to(at::kFloat) * scale).clamp(-float8_max, float8_max).to(float8_dtype);
  // addmm_float8_unwrapped: _scaled_mm takes scale.reciprocal().
  return Float8Tensor{data, scale, scale.reciprocal(), x.scalar_type()};
}

}  // namespace

Float8Tensor CastToFloat8(const at::Tensor& x, at::ScalarType float8_dtype) {
  Float8Max(float8_dtype);  // the dtype's error before x's
  CheckCastInput(x);
  const at::NoGradGuard no_grad;
  // tensor_to_amax: max(|x|) in x's dtype (exact in any dtype).
  return CastWithAmax(x, float8_dtype, at::abs(x).max());
}

Float8Tensor CastToFloat8(const at::Tensor& x, at::ScalarType float8_dtype,
                          const at::Tensor& amax) {
  Float8Max(float8_dtype);
  CheckCastInput(x);
  CheckGivenAmax(x, amax);
  return CastWithAmax(x, float8_dtype, amax.reshape({}));
}

Float8Tensor CastToFloat8Fused(const at::Tensor& x, at::ScalarType float8_dtype,
                               const at::Tensor& amax) {
  Float8Max(float8_dtype);
  CheckCastInput(x);
  CheckGivenAmax(x, amax);
  // The kernel casts a [rows, cols] matrix: the leading dim by the rest.
  const at::Tensor matrix = x.dim() == 2 ? x : x.reshape({x.dim() == 0 ? 1 : x.size(0), -1});
  const internal::FusedOps* ops = internal::ChooseFusedOps(
      internal::Op::kCastToFloat8Fused, {x, amax}, [&](const internal::FusedOps& o) {
        if (float8_dtype != at::kFloat8_e4m3fn && float8_dtype != at::kFloat8_e5m2) {
          return c10::str("float8_dtype is ", float8_dtype,
                          ": the kernel writes Float8_e4m3fn or Float8_e5m2");
        }
        return internal::UnsupportedFloat8Cast(o, matrix);
      });
  if (ops == nullptr) return CastWithAmax(x, float8_dtype, amax.reshape({}));
  const at::NoGradGuard no_grad;
  const internal::FusedOps::Float8CastOut c = ops->CastToFloat8(
      matrix.contiguous(), float8_dtype, /*transposed=*/false, amax.reshape({}).to(at::kFloat));
  return Float8Tensor{c.data.view(x.sizes()), c.scale, c.inv_scale, x.scalar_type()};
}

namespace {

// The weight a given cast stands for, in weight's dtype, as autograd's
// value of `weight` (whose own values are not read): its gradient passes
// to weight unchanged. torchao's Float8TrainingTensor dequantizes the same
// way for an operator that is not a float8 matrix product.
struct DequantizedWeight : torch::autograd::Function<DequantizedWeight> {
  static at::Tensor forward(AutogradContext* /*ctx*/, const at::Tensor& weight,
                            const Float8Tensor* weight_cast) {
    return weight_cast->data.to(at::kFloat).mul(weight_cast->inv_scale).to(weight.scalar_type());
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grad_outputs) {
    return {grad_outputs[0], at::Tensor()};
  }
};

at::Tensor LinearImpl(const at::Tensor& input, const at::Tensor& weight,
                      const Float8Tensor* weight_cast, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.defined() && weight.defined(),
              "kernels::Float8Linear: input and weight must be defined tensors");
  TORCH_CHECK(weight.dim() == 2, "kernels::Float8Linear: weight has shape ", weight.sizes(),
              ": expected [N, K]");
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == weight.size(1),
              "kernels::Float8Linear: input has shape ", input.sizes(), " and weight ",
              weight.sizes(),
              ": expected input [..., K] with K = weight.size(1) = ", weight.size(1));
  TORCH_CHECK(IsLinearDtype(input.scalar_type()) && IsLinearDtype(weight.scalar_type()),
              "kernels::Float8Linear: input has dtype ", input.scalar_type(), " and weight ",
              weight.scalar_type(), ": expected float32, bfloat16 or float16");
  TORCH_CHECK(input.device() == weight.device(), "kernels::Float8Linear: input is on ",
              input.device(), " and weight on ", weight.device(), ": expected one device");
  if (weight_cast != nullptr) {
    const at::Tensor& data = weight_cast->data;
    const at::Tensor& inv = weight_cast->inv_scale;
    TORCH_CHECK(data.defined() && data.scalar_type() == kForwardDtype &&
                    data.sizes() == weight.sizes() && data.device() == weight.device(),
                "kernels::Float8Linear: weight_cast.data is ",
                data.defined()
                    ? c10::str(data.scalar_type(), " ", data.sizes(), " on ", data.device())
                    : std::string("undefined"),
                ": expected ", kForwardDtype, " ", weight.sizes(), " on ", weight.device(),
                " (weight's shape and device)");
    TORCH_CHECK(inv.defined() && inv.numel() == 1 && inv.scalar_type() == at::kFloat &&
                    inv.device() == weight.device(),
                "kernels::Float8Linear: weight_cast.inv_scale is ",
                inv.defined() ? c10::str(inv.scalar_type(), " ", inv.sizes(), " on ", inv.device())
                              : std::string("undefined"),
                ": expected one float32 element on ", weight.device());
  }
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0),
                "kernels::Float8Linear: bias has shape ", bias->sizes(), ": expected [N] = [",
                weight.size(0), "]");
    TORCH_CHECK(bias->device() == input.device(), "kernels::Float8Linear: bias is on ",
                bias->device(), " and input on ", input.device(), ": expected one device");
  }
  const int64_t k = weight.size(1);
  const int64_t n = weight.size(0);
  const int64_t rows = k == 0 ? 0 : input.numel() / k;
  if (rows == 0 || k == 0 || n == 0 || rows % 16 != 0 || k % 16 != 0 || n % 16 != 0) {
    WarnFallbackOnce(input, weight, rows);
    const at::Tensor w =
        weight_cast != nullptr ? DequantizedWeight::apply(weight, weight_cast) : weight;
    return at::linear(input, w, has_bias ? *bias : std::optional<at::Tensor>());
  }
  // The casts: the fused kernel on CUDA (internal/fused_ops.h; without
  // //kernels:cuda in the binary, the ATen recipe with a warning, once);
  // the ATen recipe on the CPU, silently (it is the reference).
  const internal::FusedOps* ops = internal::ChooseFusedOps(
      internal::Op::kFloat8Linear, {input, weight}, [&](const internal::FusedOps& o) {
        std::string why = internal::UnsupportedFloat8Cast(o, input.reshape({-1, k}));
        return why.empty() && weight_cast == nullptr ? internal::UnsupportedFloat8Cast(o, weight)
                                                     : why;
      });
  const bool grad_mode = at::GradMode::is_enabled();
  at::Tensor out = Float8LinearFunction::apply(input, weight, ops, weight_cast,
                                               grad_mode && input.requires_grad(),
                                               grad_mode && weight.requires_grad());
  // Float8Linear.forward: `output + self.bias.to(output.dtype)`.
  if (has_bias) out = out + bias->to(out.scalar_type());
  return out;
}

}  // namespace

at::Tensor Float8Linear(const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  return LinearImpl(input, weight, nullptr, bias);
}

at::Tensor Float8Linear(const at::Tensor& input, const at::Tensor& weight,
                        const Float8Tensor& weight_cast, const std::optional<at::Tensor>& bias) {
  return LinearImpl(input, weight, &weight_cast, bias);
}

bool Float8MatmulSupported(const c10::Device& device, std::string* why) {
  std::string reason;
  if (device.is_cpu()) {
    reason =
        "the CPU has no float8 matrix products (at::_scaled_mm runs there only as a slow "
        "emulation); float8 needs CUDA with compute capability 8.9 or later";
  } else if (!device.is_cuda()) {
    std::ostringstream s;
    s << "device " << device
      << " has no float8 matrix products here; float8 needs CUDA with compute capability 8.9 "
         "or later";
    reason = s.str();
  } else if (internal::GetCudaCapabilityQuery() == nullptr) {
    reason =
        "this binary does not link //kernels:cuda, which asks a CUDA device for its compute "
        "capability (build with --config=cuda and select //kernels:cuda under "
        "//third_party:cuda)";
  } else {
    internal::ComputeCapability cc;
    try {
      cc = internal::GetCudaCapabilityQuery()(device.index());
    } catch (const c10::Error& e) {
      reason = "cannot ask device " + device.str() +
               " for its compute capability: " + e.what_without_backtrace();
    }
    if (reason.empty() && cc.major * 10 + cc.minor < 89) {
      std::ostringstream s;
      s << "device " << device << " has compute capability " << cc.major << "." << cc.minor
        << "; float8 matrix products need 8.9 or later (Ada, Hopper, Blackwell)";
      reason = s.str();
    }
  }
  if (why != nullptr) *why = reason;
  return reason.empty();
}

}  // namespace kernels
