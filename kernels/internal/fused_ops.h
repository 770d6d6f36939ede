// The seam between kernels/'s public ops and their fused implementations.
//
// Each public op (rms_norm.h, swiglu.h, rope.h) asks ChooseFusedOps which
// implementation takes its inputs:
//   - CPU tensors (and every device but CUDA): none; the op runs its ATen
//     reference (reference.h), silently: that is the reference's job.
//   - CUDA tensors: the FusedOps that //kernels:cuda registered when it was
//     linked into the binary, if the inputs are ones the kernels take
//     (Unsupported* below say which); otherwise the reference, with a
//     warning, once per op, naming the op and the reason.
// A test can put its own FusedOps in front of that choice for every device
// (ScopedFusedOpsForTesting): AtenFusedOps() (aten_fused_ops.h) computes
// what the CUDA kernels compute, with ATen on any device, so the
// autograd::Function path, its saved tensors and the explicit backward
// formulas run on the CPU.
//
// A FusedOps method gets its tensors in the layout its kernel takes (the
// op's Function makes them contiguous) and returns new tensors, none a view
// (an output of an autograd::Function that is a view could not be modified
// in place). Called from a Function's forward it records no graph (the
// Function is the graph's node); AtenFusedOps called from a backward with
// grad mode on does, which makes that backward differentiable again.
#pragma once

#include <initializer_list>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>

namespace kernels::internal {

class FusedOps {
 public:
  virtual ~FusedOps() = default;
  // "cuda", "aten": for messages.
  virtual const char* name() const = 0;
  // The activation dtypes it takes: float32, bfloat16, float16 (AtenFusedOps
  // float64 too, so that tests check its formulas by finite differences).
  virtual bool TakesDtype(at::ScalarType dtype) const;

  struct RmsNormOut {
    at::Tensor out;   // x's shape, result_type(x, weight)
    at::Tensor sum;   // x + residual in x's shape and dtype; undefined without residual
    at::Tensor rstd;  // float32 (float64 x: float64) x.shape[:-1]: 1 / sqrt(mean(h^2, -1) + eps)
  };
  // x, residual (undefined for RmsNorm): contiguous [..., cols], one shape
  // and dtype; weight: contiguous [cols].
  virtual RmsNormOut RmsNormForward(const at::Tensor& x, const at::Tensor& residual,
                                    const at::Tensor& weight, double eps) const = 0;
  // grad_out: contiguous, h's shape, out's dtype; grad_sum: the new
  // residual's gradient (contiguous; undefined: none), added to grad_h; h:
  // the normalised input (x, or x + residual), contiguous. Returns (grad_h
  // in h's shape and dtype, grad_weight in weight's); each undefined when
  // not asked for.
  virtual std::pair<at::Tensor, at::Tensor> RmsNormBackward(
      const at::Tensor& grad_out, const at::Tensor& grad_sum, const at::Tensor& h,
      const at::Tensor& weight, const at::Tensor& rstd, bool need_grad_h,
      bool need_grad_weight) const = 0;

  // gate, up: contiguous, one shape and dtype.
  virtual at::Tensor SwiGluForward(const at::Tensor& gate, const at::Tensor& up) const = 0;
  // (grad_gate, grad_up).
  virtual std::pair<at::Tensor, at::Tensor> SwiGluBackward(const at::Tensor& grad,
                                                           const at::Tensor& gate,
                                                           const at::Tensor& up) const = 0;

  // q [B, H, T, D], k [B, Hkv, T, D], each with a contiguous last dimension
  // (other strides free); cos, sin contiguous [T, D] or [B, T, D]; one
  // dtype. The rotated q and k (laid out as empty_like(q), empty_like(k));
  // `transpose`: the backward (the gradients of q and k from theirs).
  virtual std::pair<at::Tensor, at::Tensor> RopeQK(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& cos, const at::Tensor& sin,
                                                   bool transpose) const = 0;

  struct Float8CastOut {
    at::Tensor data;       // float8_dtype [rows, cols]
    at::Tensor data_t;     // float8_dtype [cols, rows]: data transposed, row-major; undefined
                           // unless asked for
    at::Tensor scale;      // float32 scalar
    at::Tensor inv_scale;  // float32 scalar: 1 / scale
  };
  // torchao's tensorwise dynamic cast of x (contiguous [rows, cols], rows
  // and cols >= 1) to float8_dtype (Float8_e4m3fn or Float8_e5m2), as
  // reference::CastToFloat8Tensorwise defines it, with the transposed copy
  // that _scaled_mm's column-major operands need when `transposed`. `amax`:
  // undefined (max|x| is computed), or the amax to scale by (one float32
  // element on x's device, >= 0: torchao's reduce_amax over the shards x is
  // one of).
  virtual Float8CastOut CastToFloat8(const at::Tensor& x, at::ScalarType float8_dtype,
                                     bool transposed, const at::Tensor& amax) const = 0;
};

// The ops whose choice is made here (and warned about once each).
// kFloat8Linear: its float8 casts; kCastToFloat8Fused: that function's
// (float8_linear.h).
enum class Op { kRmsNorm, kAddRmsNorm, kSwiGlu, kApplyRopeQK, kFloat8Linear, kCastToFloat8Fused };
const char* OpName(Op op);  // "kernels::RmsNorm", ...

// What `ops` does not take, as a reason ("x has dtype Double: the kernel
// takes float32, bfloat16 or float16"); empty when it takes the inputs.
// Device-independent apart from "all on one device"; ChooseFusedOps adds the
// device rule. residual may be undefined (RmsNorm).
std::string UnsupportedRmsNorm(const FusedOps& ops, const at::Tensor& x, const at::Tensor& residual,
                               const at::Tensor& weight);
std::string UnsupportedSwiGlu(const FusedOps& ops, const at::Tensor& gate, const at::Tensor& up);
std::string UnsupportedRopeQK(const FusedOps& ops, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& cos, const at::Tensor& sin);
// x: what Float8Linear casts (its input or weight; the output gradient has
// the input's dtype).
std::string UnsupportedFloat8Cast(const FusedOps& ops, const at::Tensor& x);

// The implementation that takes `inputs` (see the top of this file), or
// nullptr for the reference. `why_not(ops)` (one of the Unsupported*) is
// asked only when a FusedOps is otherwise available. Warns once per op when
// an input it would take falls back.
template <typename WhyNot>
const FusedOps* ChooseFusedOps(Op op, std::initializer_list<at::Tensor> inputs, WhyNot why_not);

// Registered by //kernels:cuda's static initialiser; true.
bool RegisterCudaFusedOps(const FusedOps* ops);
// The registered CUDA implementation, or nullptr when the binary does not
// link //kernels:cuda.
const FusedOps* CudaFusedOps();

// While alive, `ops` takes the inputs of every device (for tests: run the
// fused path on the CPU with AtenFusedOps()). Not thread-safe against ops
// running on other threads; not nestable.
class ScopedFusedOpsForTesting {
 public:
  explicit ScopedFusedOpsForTesting(const FusedOps* ops);
  ~ScopedFusedOpsForTesting();
  ScopedFusedOpsForTesting(const ScopedFusedOpsForTesting&) = delete;
  ScopedFusedOpsForTesting& operator=(const ScopedFusedOpsForTesting&) = delete;

 private:
  const FusedOps* previous_;
};

// Tests: makes every op warn again on its next fallback.
void ResetFallbackWarningsForTesting();

// ---- details of ChooseFusedOps -------------------------------------------------

const FusedOps* FusedOpsForTesting();
// The FusedOps that may take inputs on `device_of` (a CUDA tensor, or any
// tensor under ScopedFusedOpsForTesting), or nullptr with the reason in
// *why_not when a CUDA input has none (a binary without //kernels:cuda).
const FusedOps* AvailableFusedOps(const at::Tensor& device_of, std::string* why_not);
// Warns (TORCH_WARN) the first time `op` falls back, naming the op and why.
void WarnFallbackOnce(Op op, const std::string& why);

template <typename WhyNot>
const FusedOps* ChooseFusedOps(Op op, std::initializer_list<at::Tensor> inputs, WhyNot why_not) {
  const at::Tensor* device_of = nullptr;
  for (const at::Tensor& t : inputs) {
    if (t.defined() && (t.is_cuda() || FusedOpsForTesting() != nullptr)) {
      device_of = &t;
      break;
    }
  }
  if (device_of == nullptr) return nullptr;
  std::string why;
  const FusedOps* ops = AvailableFusedOps(*device_of, &why);
  if (ops != nullptr) why = why_not(*ops);
  if (!why.empty()) {
    WarnFallbackOnce(op, why);
    return nullptr;
  }
  return ops;
}

}  // namespace kernels::internal
