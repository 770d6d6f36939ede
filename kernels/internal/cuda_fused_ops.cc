// The CUDA FusedOps: allocates the outputs with ATen, launches
// internal/cuda_kernels.cu's kernels on the current stream, and registers
// itself (fused_ops.h) when a binary links //kernels:cuda. Only under
// --config=cuda (it needs the CUDA toolkit's headers and libtorch_cuda).
#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include "kernels/internal/cuda_kernels.h"
#include "kernels/internal/fused_ops.h"

namespace kernels::internal {
namespace {

cuda::DType KernelType(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return cuda::DType::kFloat32;
    case at::kBFloat16: return cuda::DType::kBFloat16;
    case at::kHalf: return cuda::DType::kFloat16;
    default: break;
  }
  TORCH_CHECK(false, "kernels: dtype ", t.scalar_type(),
              " reached a CUDA kernel: expected float32, bfloat16 or float16 (the dispatch's "
              "checks should have sent it to the reference)");
}

void* Stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

void Check(int error) { C10_CUDA_CHECK(static_cast<cudaError_t>(error)); }

// Threads per row block: one thread per column up to 1024, a multiple of 32.
int RowThreads(int64_t cols) {
  return static_cast<int>(std::clamp<int64_t>((cols + 31) / 32 * 32, 32, 1024));
}

int MultiprocessorCount(const at::Tensor& t) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, t.get_device()));
  return std::max(count, 1);
}

class Cuda final : public FusedOps {
 public:
  const char* name() const override { return "cuda"; }

  RmsNormOut RmsNormForward(const at::Tensor& x, const at::Tensor& residual,
                            const at::Tensor& weight, double eps) const override {
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t cols = x.size(-1);
    const int64_t rows = x.numel() / std::max<int64_t>(cols, 1);
    RmsNormOut out;
    const at::ScalarType out_type =
        weight.scalar_type() == at::kFloat ? at::kFloat : x.scalar_type();
    out.out = at::empty(x.sizes(), x.options().dtype(out_type));
    if (residual.defined()) out.sum = at::empty_like(x);
    std::vector<int64_t> row_shape(x.sizes().begin(), x.sizes().end() - 1);
    out.rstd = at::empty(row_shape, x.options().dtype(at::kFloat));
    Check(cuda::RmsNormForward(
        KernelType(x), KernelType(weight), x.data_ptr(),
        residual.defined() ? residual.data_ptr() : nullptr, weight.data_ptr(), out.out.data_ptr(),
        out.sum.defined() ? out.sum.data_ptr() : nullptr, out.rstd.data_ptr<float>(), rows, cols,
        static_cast<float>(eps), RowThreads(cols), Stream()));
    return out;
  }

  std::pair<at::Tensor, at::Tensor> RmsNormBackward(const at::Tensor& grad_out,
                                                    const at::Tensor& grad_sum, const at::Tensor& h,
                                                    const at::Tensor& weight,
                                                    const at::Tensor& rstd, bool need_grad_h,
                                                    bool need_grad_weight) const override {
    const c10::cuda::CUDAGuard guard(h.device());
    const int64_t cols = h.size(-1);
    const int64_t rows = h.numel() / std::max<int64_t>(cols, 1);
    at::Tensor grad_h = need_grad_h ? at::empty_like(h) : at::Tensor();
    // Blocks: enough to fill the GPU; each sums its rows' share of dW.
    const int blocks =
        static_cast<int>(std::clamp<int64_t>(rows, 1, 4 * int64_t{MultiprocessorCount(h)}));
    at::Tensor partial_dw =
        need_grad_weight ? at::empty({blocks, cols}, h.options().dtype(at::kFloat)) : at::Tensor();
    Check(cuda::RmsNormBackward(KernelType(h), KernelType(weight), grad_out.data_ptr(),
                                grad_sum.defined() ? grad_sum.data_ptr() : nullptr, h.data_ptr(),
                                weight.data_ptr(), rstd.data_ptr<float>(),
                                need_grad_h ? grad_h.data_ptr() : nullptr,
                                need_grad_weight ? partial_dw.data_ptr<float>() : nullptr, rows,
                                cols, blocks, RowThreads(cols), Stream()));
    at::Tensor grad_weight;
    if (need_grad_weight) {
      grad_weight = rows == 0 ? at::zeros_like(weight) : partial_dw.sum(0).to(weight.scalar_type());
    }
    return {grad_h, grad_weight};
  }

  at::Tensor SwiGluForward(const at::Tensor& gate, const at::Tensor& up) const override {
    const c10::cuda::CUDAGuard guard(gate.device());
    at::Tensor out = at::empty_like(gate);
    Check(cuda::SwiGluForward(KernelType(gate), gate.data_ptr(), up.data_ptr(), out.data_ptr(),
                              gate.numel(), Stream()));
    return out;
  }

  std::pair<at::Tensor, at::Tensor> SwiGluBackward(const at::Tensor& grad, const at::Tensor& gate,
                                                   const at::Tensor& up) const override {
    const c10::cuda::CUDAGuard guard(gate.device());
    at::Tensor grad_gate = at::empty_like(gate);
    at::Tensor grad_up = at::empty_like(up);
    Check(cuda::SwiGluBackward(KernelType(gate), grad.data_ptr(), gate.data_ptr(), up.data_ptr(),
                               grad_gate.data_ptr(), grad_up.data_ptr(), gate.numel(), Stream()));
    return {grad_gate, grad_up};
  }

  std::pair<at::Tensor, at::Tensor> RopeQK(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& cos, const at::Tensor& sin,
                                           bool transpose) const override {
    const c10::cuda::CUDAGuard guard(q.device());
    at::Tensor q_out = at::empty_like(q);
    at::Tensor k_out = at::empty_like(k);
    auto describe = [](const at::Tensor& in, const at::Tensor& out) {
      return cuda::RopeTensor{in.data_ptr(), out.data_ptr(), in.size(1),
                              in.stride(0),  in.stride(1),   in.stride(2),
                              out.stride(0), out.stride(1),  out.stride(2)};
    };
    const int64_t batch = q.size(0), length = q.size(2), head_dim = q.size(3);
    const int64_t table_stride_b = cos.dim() == 3 ? length * head_dim : 0;
    Check(cuda::RopeQK(KernelType(q), describe(q, q_out), describe(k, k_out), cos.data_ptr(),
                       sin.data_ptr(), table_stride_b, batch, length, head_dim, transpose,
                       Stream()));
    return {q_out, k_out};
  }

  Float8CastOut CastToFloat8(const at::Tensor& x, at::ScalarType float8_dtype, bool transposed,
                             const at::Tensor& amax) const override {
    const c10::cuda::CUDAGuard guard(x.device());
    TORCH_CHECK(float8_dtype == at::kFloat8_e4m3fn || float8_dtype == at::kFloat8_e5m2,
                "kernels: float8 dtype ", float8_dtype,
                " reached the CUDA cast: expected Float8_e4m3fn or Float8_e5m2");
    const int64_t rows = x.size(0), cols = x.size(1);
    Float8CastOut out;
    out.data = at::empty({rows, cols}, x.options().dtype(float8_dtype));
    if (transposed) out.data_t = at::empty({cols, rows}, x.options().dtype(float8_dtype));
    // scale, inv_scale and the amax scratch (its float32 bits) in one
    // allocation, each 16 bytes from the next: the scales go to
    // _scaled_mm as cuBLASLt's scale pointers, which are then as aligned as
    // a tensor of their own would be. Tensors over that storage, not views
    // (FusedOps' outputs are never views).
    constexpr int64_t kApart = 4;  // floats: 16 bytes
    const at::Tensor scalars = at::empty({3 * kApart}, x.options().dtype(at::kFloat));
    auto scalar_at = [&](int64_t i) {
      at::Tensor t = at::empty({0}, scalars.options());
      t.set_(scalars.storage(), i * kApart, {}, {});
      return t;
    };
    out.scale = scalar_at(0);
    out.inv_scale = scalar_at(1);
    float* base = scalars.data_ptr<float>();
    // A given amax (float32, on x's device) is read where it is: the kernel
    // takes its bits.
    const bool amax_given = amax.defined();
    if (amax_given) {
      TORCH_CHECK(
          amax.scalar_type() == at::kFloat && amax.numel() == 1 && amax.device() == x.device(),
          "kernels: the float8 cast's amax is ", amax.scalar_type(), " ", amax.sizes(), " on ",
          amax.device(), ": expected one float32 element on ", x.device());
    }
    auto* amax_bits = amax_given ? reinterpret_cast<uint32_t*>(amax.data_ptr<float>())
                                 : reinterpret_cast<uint32_t*>(base + 2 * kApart);
    auto bytes = [](const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); };
    Check(cuda::CastToFloat8(
        KernelType(x),
        float8_dtype == at::kFloat8_e4m3fn ? cuda::Float8Type::kE4m3fn : cuda::Float8Type::kE5m2,
        x.data_ptr(), bytes(out.data), transposed ? bytes(out.data_t) : nullptr, base,
        base + kApart, amax_bits, amax_given, rows, cols, Stream()));
    return out;
  }
};

const Cuda kCuda;
// Linked in (alwayslink): the dispatch finds the kernels from here on.
[[maybe_unused]] const bool kRegistered = RegisterCudaFusedOps(&kCuda);

}  // namespace
}  // namespace kernels::internal
