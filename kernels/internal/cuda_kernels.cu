// The CUDA kernels behind kernels/'s fused ops (see cuda_kernels.h for what
// each computes). Compiled by nvcc only under --config=cuda (kernels/BUILD's
// cuda_objects); no LibTorch here, so nvcc never parses its headers.
//
// Layout of the work, llm.c style: one block per row for the row
// reductions (RMSNorm), a grid-stride loop of one element (SwiGLU) or one
// rotation pair (RoPE) per thread for the element-wise ops. Loads and
// stores of a row are coalesced (thread j takes columns j, j + blockDim,
// ...). Everything is computed in float32; a value the ATen reference
// rounds to T is rounded here at the same point (Round<T>), and products
// and sums that the reference keeps separate use __fmul_rn / __fadd_rn so
// that nvcc does not fuse them into one FMA with a different rounding.
#include "kernels/internal/cuda_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace kernels::cuda {
namespace {

// ---- element types -----------------------------------------------------------

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}

// v rounded to T and back: what ATen's op in T keeps of a float result.
template <typename T>
__device__ __forceinline__ float Round(float v) {
  return ToFloat(FromFloat<T>(v));
}

// ---- block reductions ----------------------------------------------------------

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The sum of v over the block (blockDim.x a multiple of 32), returned to
// every thread. Every thread of the block must call it.
__device__ float BlockSum(float v) {
  __shared__ float warp_sums[32];
  __shared__ float total;
  v = WarpSum(v);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x / 32;
    float s = lane < warps ? warp_sums[lane] : 0.0f;
    s = WarpSum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  const float result = total;
  __syncthreads();  // warp_sums and total are free for the next call
  return result;
}

// ---- RMSNorm -------------------------------------------------------------------

// O: the output type, float32 when the weight is float32, else T.
template <typename T, typename W, typename O>
__global__ void RmsNormForwardKernel(const T* __restrict__ x, const T* __restrict__ residual,
                                     const W* __restrict__ weight, O* __restrict__ out,
                                     T* __restrict__ sum_out, float* __restrict__ rstd,
                                     int64_t cols, float eps) {
  const int64_t row = blockIdx.x;
  const T* x_row = x + row * cols;
  const T* residual_row = residual != nullptr ? residual + row * cols : nullptr;
  T* sum_row = sum_out != nullptr ? sum_out + row * cols : nullptr;
  O* out_row = out + row * cols;

  float squares = 0.0f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    float h = ToFloat(x_row[j]);
    if (residual_row != nullptr) {
      const T sum = FromFloat<T>(__fadd_rn(h, ToFloat(residual_row[j])));
      sum_row[j] = sum;
      h = ToFloat(sum);
    }
    squares += h * h;
  }
  // mean then + eps then 1/sqrt, as ATen's x.pow(2).mean(-1) + eps, rsqrt.
  const float mean = BlockSum(squares) / static_cast<float>(cols);
  const float r = 1.0f / sqrtf(__fadd_rn(mean, eps));
  if (threadIdx.x == 0) rstd[row] = r;
  // Each thread reads back only the columns it wrote to sum_row.
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float h = ToFloat(sum_row != nullptr ? sum_row[j] : x_row[j]);
    const float normed = Round<T>(__fmul_rn(h, r));
    out_row[j] = FromFloat<O>(__fmul_rn(ToFloat(weight[j]), normed));
  }
}

template <typename T, typename W, typename O>
__global__ void RmsNormBackwardKernel(const O* __restrict__ grad_out,
                                      const T* __restrict__ grad_sum, const T* __restrict__ h,
                                      const W* __restrict__ weight, const float* __restrict__ rstd,
                                      T* __restrict__ grad_h, float* __restrict__ partial_dw,
                                      int64_t rows, int64_t cols) {
  float* dw = partial_dw != nullptr ? partial_dw + blockIdx.x * cols : nullptr;
  // Thread j owns columns j, j + blockDim, ... of dw for every row.
  if (dw != nullptr) {
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) dw[j] = 0.0f;
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const O* g_row = grad_out + row * cols;
    const T* h_row = h + row * cols;
    const float r = rstd[row];
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
      const float go = ToFloat(g_row[j]);
      const float xhat = ToFloat(h_row[j]) * r;
      dot += go * ToFloat(weight[j]) * xhat;
      if (dw != nullptr) dw[j] += go * Round<T>(xhat);
    }
    if (grad_h == nullptr) continue;  // uniform over the block
    const float mean_dot = BlockSum(dot) / static_cast<float>(cols);
    T* dh_row = grad_h + row * cols;
    const T* gs_row = grad_sum != nullptr ? grad_sum + row * cols : nullptr;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
      const float g = ToFloat(g_row[j]) * ToFloat(weight[j]);
      const float xhat = ToFloat(h_row[j]) * r;
      float d = r * (g - xhat * mean_dot);
      if (gs_row != nullptr) d += ToFloat(gs_row[j]);
      dh_row[j] = FromFloat<T>(d);
    }
  }
}

template <typename T, typename W, typename O>
int LaunchRmsNormForward(const void* x, const void* residual, const void* weight, void* out,
                         void* sum_out, float* rstd, int64_t rows, int64_t cols, float eps,
                         int threads, cudaStream_t stream) {
  RmsNormForwardKernel<T, W, O><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(residual), static_cast<const W*>(weight),
      static_cast<O*>(out), static_cast<T*>(sum_out), rstd, cols, eps);
  return static_cast<int>(cudaGetLastError());
}

template <typename T, typename W, typename O>
int LaunchRmsNormBackward(const void* grad_out, const void* grad_sum, const void* h,
                          const void* weight, const float* rstd, void* grad_h, float* partial_dw,
                          int64_t rows, int64_t cols, int blocks, int threads,
                          cudaStream_t stream) {
  RmsNormBackwardKernel<T, W, O><<<blocks, threads, 0, stream>>>(
      static_cast<const O*>(grad_out), static_cast<const T*>(grad_sum), static_cast<const T*>(h),
      static_cast<const W*>(weight), rstd, static_cast<T*>(grad_h), partial_dw, rows, cols);
  return static_cast<int>(cudaGetLastError());
}

// ---- SwiGLU --------------------------------------------------------------------

__device__ __forceinline__ float Sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

// Grid-stride: enough blocks to fill the GPU, each thread several elements.
constexpr int kElementThreads = 256;
unsigned ElementBlocks(int64_t n) {
  return static_cast<unsigned>(
      std::min<int64_t>((n + kElementThreads - 1) / kElementThreads, int64_t{1} << 20));
}

template <typename T>
__global__ void SwiGluForwardKernel(const T* __restrict__ gate, const T* __restrict__ up,
                                    T* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = ToFloat(gate[i]);
    // ATen's silu in T, then the product in T.
    const float silu = Round<T>(g / (1.0f + expf(-g)));
    out[i] = FromFloat<T>(__fmul_rn(silu, ToFloat(up[i])));
  }
}

template <typename T>
__global__ void SwiGluBackwardKernel(const T* __restrict__ grad, const T* __restrict__ gate,
                                     const T* __restrict__ up, T* __restrict__ grad_gate,
                                     T* __restrict__ grad_up, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = ToFloat(gate[i]);
    const float go = ToFloat(grad[i]);
    const float s = Sigmoid(g);
    const float silu = g * s;
    grad_gate[i] = FromFloat<T>(go * ToFloat(up[i]) * s * (1.0f + g * (1.0f - s)));
    grad_up[i] = FromFloat<T>(go * silu);
  }
}

// ---- RoPE ----------------------------------------------------------------------

template <typename T>
__global__ void RopeQKKernel(RopeTensor q, RopeTensor k, const T* __restrict__ cos,
                             const T* __restrict__ sin, int64_t table_stride_b, int64_t batch,
                             int64_t length, int64_t head_dim, bool transpose) {
  const int64_t half = head_dim / 2;
  const int64_t heads = q.heads + k.heads;
  const int64_t pairs = batch * heads * length * half;
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < pairs;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = p % half;
    int64_t rest = p / half;
    const int64_t t = rest % length;
    rest /= length;
    const int64_t head_of_both = rest % heads;
    const int64_t b = rest / heads;
    const bool is_q = head_of_both < q.heads;
    const RopeTensor& x = is_q ? q : k;
    const int64_t head = is_q ? head_of_both : head_of_both - q.heads;
    const T* in =
        static_cast<const T*>(x.in) + b * x.in_stride_b + head * x.in_stride_h + t * x.in_stride_t;
    T* out =
        static_cast<T*>(x.out) + b * x.out_stride_b + head * x.out_stride_h + t * x.out_stride_t;
    const int64_t table = b * table_stride_b + t * head_dim;
    const float x1 = ToFloat(in[i]);
    const float x2 = ToFloat(in[i + half]);
    const float c1 = ToFloat(cos[table + i]);
    const float c2 = ToFloat(cos[table + i + half]);
    const float s1 = ToFloat(sin[table + i]);
    const float s2 = ToFloat(sin[table + i + half]);
    // ATen's x * cos + cat(-x2, x1) * sin: each product rounded to T, then
    // the sum. The backward (transpose) as autograd of that expression
    // gives it: g * cos, plus g * sin moved back through the rotation.
    float out1, out2;
    if (!transpose) {
      out1 = __fadd_rn(Round<T>(__fmul_rn(x1, c1)), -Round<T>(__fmul_rn(x2, s1)));
      out2 = __fadd_rn(Round<T>(__fmul_rn(x2, c2)), Round<T>(__fmul_rn(x1, s2)));
    } else {
      out1 = __fadd_rn(Round<T>(__fmul_rn(x1, c1)), Round<T>(__fmul_rn(x2, s2)));
      out2 = __fadd_rn(Round<T>(__fmul_rn(x2, c2)), -Round<T>(__fmul_rn(x1, s1)));
    }
    out[i] = FromFloat<T>(out1);
    out[i + half] = FromFloat<T>(out2);
  }
}

// Calls f with a null pointer of the C++ type of `t`.
template <typename F>
int WithType(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32: return f(static_cast<float*>(nullptr));
    case DType::kBFloat16: return f(static_cast<__nv_bfloat16*>(nullptr));
    case DType::kFloat16: return f(static_cast<__half*>(nullptr));
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace

int RmsNormForward(DType t, DType w, const void* x, const void* residual, const void* weight,
                   void* out, void* sum_out, float* rstd, int64_t rows, int64_t cols, float eps,
                   int threads, void* stream) {
  if (rows == 0 || cols == 0) return 0;
  // One block per row: gridDim.x is at most 2^31 - 1.
  if (threads % 32 != 0 || threads < 32 || threads > 1024 || rows > INT32_MAX) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const auto s = static_cast<cudaStream_t>(stream);
  return WithType(t, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    if (w == DType::kFloat32) {
      return LaunchRmsNormForward<T, float, float>(x, residual, weight, out, sum_out, rstd, rows,
                                                   cols, eps, threads, s);
    }
    if (w != t) return static_cast<int>(cudaErrorInvalidValue);
    return LaunchRmsNormForward<T, T, T>(x, residual, weight, out, sum_out, rstd, rows, cols, eps,
                                         threads, s);
  });
}

int RmsNormBackward(DType t, DType w, const void* grad_out, const void* grad_sum, const void* h,
                    const void* weight, const float* rstd, void* grad_h, float* partial_dw,
                    int64_t rows, int64_t cols, int blocks, int threads, void* stream) {
  if (rows == 0 || cols == 0) return 0;
  if (threads % 32 != 0 || threads < 32 || threads > 1024 || blocks < 1) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const auto s = static_cast<cudaStream_t>(stream);
  return WithType(t, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    if (w == DType::kFloat32) {
      return LaunchRmsNormBackward<T, float, float>(grad_out, grad_sum, h, weight, rstd, grad_h,
                                                    partial_dw, rows, cols, blocks, threads, s);
    }
    if (w != t) return static_cast<int>(cudaErrorInvalidValue);
    return LaunchRmsNormBackward<T, T, T>(grad_out, grad_sum, h, weight, rstd, grad_h, partial_dw,
                                          rows, cols, blocks, threads, s);
  });
}

int SwiGluForward(DType t, const void* gate, const void* up, void* out, int64_t n, void* stream) {
  if (n == 0) return 0;
  return WithType(t, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    SwiGluForwardKernel<T>
        <<<ElementBlocks(n), kElementThreads, 0, static_cast<cudaStream_t>(stream)>>>(
            static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(out), n);
    return static_cast<int>(cudaGetLastError());
  });
}

int SwiGluBackward(DType t, const void* grad, const void* gate, const void* up, void* grad_gate,
                   void* grad_up, int64_t n, void* stream) {
  if (n == 0) return 0;
  return WithType(t, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    SwiGluBackwardKernel<T>
        <<<ElementBlocks(n), kElementThreads, 0, static_cast<cudaStream_t>(stream)>>>(
            static_cast<const T*>(grad), static_cast<const T*>(gate), static_cast<const T*>(up),
            static_cast<T*>(grad_gate), static_cast<T*>(grad_up), n);
    return static_cast<int>(cudaGetLastError());
  });
}

int RopeQK(DType t, const RopeTensor& q, const RopeTensor& k, const void* cos, const void* sin,
           int64_t table_stride_b, int64_t batch, int64_t length, int64_t head_dim, bool transpose,
           void* stream) {
  const int64_t pairs = batch * (q.heads + k.heads) * length * (head_dim / 2);
  if (pairs == 0) return 0;
  if (head_dim % 2 != 0) return static_cast<int>(cudaErrorInvalidValue);
  return WithType(t, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    RopeQKKernel<T>
        <<<ElementBlocks(pairs), kElementThreads, 0, static_cast<cudaStream_t>(stream)>>>(
            q, k, static_cast<const T*>(cos), static_cast<const T*>(sin), table_stride_b, batch,
            length, head_dim, transpose);
    return static_cast<int>(cudaGetLastError());
  });
}

}  // namespace kernels::cuda
