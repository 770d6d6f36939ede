// The CUDA kernels behind kernels/'s fused ops (see cuda_kernels.h for what
// each computes). Compiled by nvcc only under --config=cuda (kernels/BUILD's
// cuda_objects); no LibTorch here, so nvcc never parses its headers.
//
// Layout of the work, llm.c style: one block per row for the row
// reductions (RMSNorm), a grid-stride loop of one element (SwiGLU) or one
// rotation pair (RoPE) per thread for the element-wise ops, a grid-stride
// max then one block per 32 x 32 tile for the float8 cast. Loads and
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

// ---- float8 cast ---------------------------------------------------------------
//
// torchao's tensorwise cast as two kernels per tensor (amax, then the fused
// scale-and-cast). The ATen recipe (kernels::CastToFloat8) is abs, max, a
// float64 scale, an upcast to float32, a multiply, a clamp and a cast: up
// to six passes over the tensor and four temporaries of its size, plus the
// transposed copy that _scaled_mm's column-major operands need. Here x is
// read twice (once for amax, once for the cast), each float8 byte is
// written once per layout, and nothing else of x's size is allocated. The
// scale never visits the host: kernel 2 reads the amax that kernel 1 left
// on the device.

constexpr double kFloat8AmaxEps = 1e-12;  // torchao's EPS in amax_to_scale
constexpr int kAmaxThreads = 256;
constexpr int64_t kAmaxMaxBlocks = 2048;  // few atomics, enough warps to fill an H100

template <typename T>
__global__ void AbsMaxKernel(const T* __restrict__ x, int64_t n, uint32_t* __restrict__ amax_bits) {
  // |v| as float32 bits: for non-negative floats the bits order as the
  // values, and a NaN's (sign cleared) are above +inf's, so an unsigned max
  // keeps a NaN as at::max does.
  uint32_t m = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    m = max(m, __float_as_uint(fabsf(ToFloat(x[i]))));
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    m = max(m, __shfl_xor_sync(0xffffffffu, m, offset));
  }
  __shared__ uint32_t warp_max[32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = lane < static_cast<int>(blockDim.x / 32) ? warp_max[lane] : 0u;
    for (int offset = 16; offset > 0; offset >>= 1) {
      m = max(m, __shfl_xor_sync(0xffffffffu, m, offset));
    }
    if (lane == 0) atomicMax(amax_bits, m);
  }
}

// torchao's amax_to_scale, as ATen evaluates it: float64, clamp_min (a NaN
// stays NaN), a correctly rounded reciprocal, times float8_max, to float32.
__device__ __forceinline__ float TensorwiseScale(uint32_t amax_bits, double float8_max) {
  const double amax = static_cast<double>(__uint_as_float(amax_bits));
  const double clamped = amax < kFloat8AmaxEps ? kFloat8AmaxEps : amax;
  return __double2float_rn(__dmul_rn(__drcp_rn(clamped), float8_max));
}

// c10's float32 -> float8 conversions (c10/util/Float8_e4m3fn.h,
// Float8_e5m2.h: fp8e4m3fn_from_fp32_value, fp8e5m2_from_fp32_value),
// ported line for line so that the bytes are ATen's by construction on
// every architecture (round to nearest even, NaN kept with its sign).
__device__ __forceinline__ uint8_t FloatToE4m3fn(float f) {
  constexpr uint32_t kFp8Max = UINT32_C(1087) << 20;     // 480.0f: first value out of range
  constexpr uint32_t kDenormMask = UINT32_C(141) << 23;  // ((127 - 7) + (23 - 3) + 1)
  uint32_t f_bits = __float_as_uint(f);
  const uint32_t sign = f_bits & UINT32_C(0x80000000);
  f_bits ^= sign;
  uint8_t result;
  if (f_bits >= kFp8Max) {
    result = f_bits > UINT32_C(0x7F800000) ? 0x7f : 0x7e;  // NaN : saturate
  } else if (f_bits < (UINT32_C(121) << 23)) {             // below 2^-6: denormal
    f_bits = __float_as_uint(__fadd_rn(__uint_as_float(f_bits), __uint_as_float(kDenormMask)));
    result = static_cast<uint8_t>(f_bits - kDenormMask);
  } else {
    const uint32_t mant_odd = (f_bits >> 20) & 1;
    f_bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFF;
    f_bits += mant_odd;
    result = static_cast<uint8_t>(f_bits >> 20);
    if (result == 0x7f) result = 0x7e;
  }
  return result | static_cast<uint8_t>(sign >> 24);
}

__device__ __forceinline__ uint8_t FloatToE5m2(float f) {
  constexpr uint32_t kFp32Inf = UINT32_C(255) << 23;
  constexpr uint32_t kFp8Max = UINT32_C(143) << 23;      // 65536.0f
  constexpr uint32_t kDenormMask = UINT32_C(134) << 23;  // ((127 - 15) + (23 - 2) + 1)
  uint32_t f_bits = __float_as_uint(f);
  const uint32_t sign = f_bits & UINT32_C(0x80000000);
  f_bits ^= sign;
  uint8_t result;
  if (f_bits >= kFp8Max) {
    result = f_bits > kFp32Inf ? UINT8_C(0x7F) : UINT8_C(0x7C);
  } else if (f_bits < (UINT32_C(113) << 23)) {  // below 2^-14: denormal
    f_bits = __float_as_uint(__fadd_rn(__uint_as_float(f_bits), __uint_as_float(kDenormMask)));
    result = static_cast<uint8_t>(f_bits - kDenormMask);
  } else {
    const uint32_t mant_odd = (f_bits >> 21) & 1;
    f_bits += (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFFF;
    f_bits += mant_odd;
    result = static_cast<uint8_t>(f_bits >> 21);
  }
  return result | static_cast<uint8_t>(sign >> 24);
}

template <Float8Type F>
struct Float8Traits;
template <>
struct Float8Traits<Float8Type::kE4m3fn> {
  static constexpr float kMax = 448.0f;
  __device__ static uint8_t Convert(float v) { return FloatToE4m3fn(v); }
};
template <>
struct Float8Traits<Float8Type::kE5m2> {
  static constexpr float kMax = 57344.0f;
  __device__ static uint8_t Convert(float v) { return FloatToE5m2(v); }
};

// float8(clamp(float32(v) * scale, -max, max)): the comparisons keep a NaN
// (fminf/fmaxf would drop it; ATen's clamp keeps it).
template <typename T, Float8Type F>
__device__ __forceinline__ uint8_t CastElement(T v, float scale) {
  constexpr float kMax = Float8Traits<F>::kMax;
  float y = __fmul_rn(ToFloat(v), scale);
  y = y < -kMax ? -kMax : (y > kMax ? kMax : y);
  return Float8Traits<F>::Convert(y);
}

// One block per 32 x 32 tile of x (blockIdx.x = tile_row * col_tiles +
// tile_col), 32 x 8 threads, each thread 4 elements of the tile. Reads of x
// and writes of data are along rows (coalesced); the tile's bytes go
// through shared memory so that the writes of data_t are along its rows
// too.
constexpr int kCastTile = 32;
constexpr int kCastTileRows = 8;

template <typename T, Float8Type F>
__global__ void ScaleCastKernel(const T* __restrict__ x, uint8_t* __restrict__ data,
                                uint8_t* __restrict__ data_t,
                                const uint32_t* __restrict__ amax_bits,
                                float* __restrict__ scale_out, float* __restrict__ inv_scale_out,
                                int64_t rows, int64_t cols, int64_t col_tiles) {
  __shared__ float block_scale;
  __shared__ uint8_t tile[kCastTile][kCastTile + 1];
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    const float scale = TensorwiseScale(*amax_bits, Float8Traits<F>::kMax);
    block_scale = scale;
    if (blockIdx.x == 0) {
      *scale_out = scale;
      *inv_scale_out = __frcp_rn(scale);  // ATen's scale.reciprocal()
    }
  }
  __syncthreads();
  const float scale = block_scale;
  const int64_t r0 = (blockIdx.x / col_tiles) * kCastTile;
  const int64_t c0 = (blockIdx.x % col_tiles) * kCastTile;
  const int64_t c = c0 + threadIdx.x;
  for (int i = threadIdx.y; i < kCastTile; i += kCastTileRows) {
    const int64_t r = r0 + i;
    if (r < rows && c < cols) {
      const uint8_t byte = CastElement<T, F>(x[r * cols + c], scale);
      data[r * cols + c] = byte;
      tile[i][threadIdx.x] = byte;
    }
  }
  if (data_t == nullptr) return;  // uniform over the grid
  __syncthreads();
  // data_t[cc, r] = data[r, cc]: thread x takes row r0 + x of x, which is
  // consecutive in data_t's row cc.
  const int64_t r = r0 + threadIdx.x;
  for (int i = threadIdx.y; i < kCastTile; i += kCastTileRows) {
    const int64_t cc = c0 + i;
    if (r < rows && cc < cols) data_t[cc * rows + r] = tile[threadIdx.x][i];
  }
}

template <typename T, Float8Type F>
int LaunchCastToFloat8(const void* x, uint8_t* data, uint8_t* data_t, float* scale_out,
                       float* inv_scale_out, uint32_t* amax_bits, bool amax_given, int64_t rows,
                       int64_t cols, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (!amax_given) {
    const cudaError_t zeroed = cudaMemsetAsync(amax_bits, 0, sizeof(uint32_t), stream);
    if (zeroed != cudaSuccess) return static_cast<int>(zeroed);
    const auto amax_blocks = static_cast<unsigned>(
        std::min<int64_t>((n + kAmaxThreads - 1) / kAmaxThreads, kAmaxMaxBlocks));
    AbsMaxKernel<T>
        <<<amax_blocks, kAmaxThreads, 0, stream>>>(static_cast<const T*>(x), n, amax_bits);
    const cudaError_t launched = cudaGetLastError();
    if (launched != cudaSuccess) return static_cast<int>(launched);
  }
  const int64_t col_tiles = (cols + kCastTile - 1) / kCastTile;
  const int64_t tiles = (rows + kCastTile - 1) / kCastTile * col_tiles;
  ScaleCastKernel<T, F>
      <<<static_cast<unsigned>(tiles), dim3(kCastTile, kCastTileRows), 0, stream>>>(
          static_cast<const T*>(x), data, data_t, amax_bits, scale_out, inv_scale_out, rows, cols,
          col_tiles);
  return static_cast<int>(cudaGetLastError());
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

int CastToFloat8(DType t, Float8Type f8, const void* x, uint8_t* data, uint8_t* data_t,
                 float* scale_out, float* inv_scale_out, uint32_t* amax_bits, bool amax_given,
                 int64_t rows, int64_t cols, void* stream) {
  // An empty tensor has no amax (CastToFloat8 refuses it); one block per
  // tile: gridDim.x is at most 2^31 - 1.
  if (rows <= 0 || cols <= 0) return static_cast<int>(cudaErrorInvalidValue);
  if ((rows + kCastTile - 1) / kCastTile > INT32_MAX / ((cols + kCastTile - 1) / kCastTile)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const auto s = static_cast<cudaStream_t>(stream);
  return WithType(t, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    if (f8 == Float8Type::kE4m3fn) {
      return LaunchCastToFloat8<T, Float8Type::kE4m3fn>(x, data, data_t, scale_out, inv_scale_out,
                                                        amax_bits, amax_given, rows, cols, s);
    }
    return LaunchCastToFloat8<T, Float8Type::kE5m2>(x, data, data_t, scale_out, inv_scale_out,
                                                    amax_bits, amax_given, rows, cols, s);
  });
}

}  // namespace kernels::cuda
