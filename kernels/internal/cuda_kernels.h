// The CUDA kernels' launchers, with no LibTorch and no CUDA header: plain
// pointers, sizes and strides, so that internal/cuda_kernels.cu compiles
// with nvcc alone and internal/cuda_fused_ops.cc (clang, LibTorch) calls it.
// Every launcher enqueues its kernels on `stream` (a cudaStream_t) and
// returns the launch's cudaError_t as an int (0: cudaSuccess); an empty
// problem (no rows, no elements) launches nothing and returns 0.
//
// Element types: T, the activations' type, is float32, bfloat16 or float16.
// Arithmetic is float32 throughout; every value ATen's composite rounds to T
// (a product, a sum, the normalised x) is rounded to T at the same point,
// so a kernel's output is the reference's up to the order of a sum and the
// last bit of exp / sqrt.
#pragma once

#include <cstdint>

namespace kernels::cuda {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// ---- RMSNorm (with the residual add) ---------------------------------------

// One block per row of x [rows, cols] (contiguous): h = x (+ residual,
// rounded to T, written to sum_out), rstd[row] = 1 / sqrt(mean(h^2) + eps)
// in float32, out = weight * T(h * rstd) in the output type (W = T: T;
// W = float32: float32, ATen's type promotion). residual and sum_out are
// both null (RmsNorm) or both set (AddRmsNorm). `threads`: a multiple of 32,
// at most 1024.
int RmsNormForward(DType t, DType w, const void* x, const void* residual, const void* weight,
                   void* out, void* sum_out, float* rstd, int64_t rows, int64_t cols, float eps,
                   int threads, void* stream);

// The gradient of RmsNormForward: `blocks` blocks, each taking rows
// blockIdx.x, blockIdx.x + blocks, ... For each row, with g = grad_out *
// weight and xhat = h * rstd (float32),
//   grad_h = rstd * (g - xhat * mean(g * xhat)) (+ grad_sum),
// rounded to T (skipped when grad_h is null); and
// partial_dw[block, col] = sum over the block's rows of grad_out * T(xhat)
// (float32 [blocks, cols]; skipped when null), which the caller sums over
// blocks. grad_out has the output type (W = float32: float32, else T);
// grad_sum (the gradient of AddRmsNorm's new residual) is T or null.
int RmsNormBackward(DType t, DType w, const void* grad_out, const void* grad_sum, const void* h,
                    const void* weight, const float* rstd, void* grad_h, float* partial_dw,
                    int64_t rows, int64_t cols, int blocks, int threads, void* stream);

// ---- SwiGLU ----------------------------------------------------------------

// out = T(T(silu(gate)) * up) over n contiguous elements.
int SwiGluForward(DType t, const void* gate, const void* up, void* out, int64_t n, void* stream);

// With s = sigmoid(gate): grad_gate = grad * up * s * (1 + gate * (1 - s)),
// grad_up = grad * gate * s, each rounded to T; gate and up are read again
// (nothing but the inputs is saved).
int SwiGluBackward(DType t, const void* grad, const void* gate, const void* up, void* grad_gate,
                   void* grad_up, int64_t n, void* stream);

// ---- RoPE on q and k ---------------------------------------------------------

// A [batch, heads, length, head_dim] tensor whose last dimension is
// contiguous; strides in elements.
struct RopeTensor {
  const void* in;
  void* out;
  int64_t heads;
  int64_t in_stride_b, in_stride_h, in_stride_t;
  int64_t out_stride_b, out_stride_h, out_stride_t;
};

// Rotate-half RoPE of q and k in one launch (one thread per pair (i, i +
// head_dim / 2) of a row of either): out = x * cos + rotate_half(x) * sin.
// cos, sin: contiguous [length, head_dim] (table_stride_b 0) or [batch,
// length, head_dim] (table_stride_b = length * head_dim). `transpose`: the
// backward, the exact transpose of the rotation, dx_i = g_i cos_i +
// g_{i+d/2} sin_{i+d/2}, dx_{i+d/2} = g_{i+d/2} cos_{i+d/2} - g_i sin_i
// (RoPE with -sin for tables whose halves repeat, as every RoPE table does).
int RopeQK(DType t, const RopeTensor& q, const RopeTensor& k, const void* cos, const void* sin,
           int64_t table_stride_b, int64_t batch, int64_t length, int64_t head_dim, bool transpose,
           void* stream);

// ---- float8 cast (torchao's tensorwise recipe) -------------------------------

enum class Float8Type : int { kE4m3fn = 0, kE5m2 = 1 };

// torchao's tensorwise dynamic cast of x [rows, cols] (contiguous), two
// kernels, no host synchronisation:
//   1. amax: max |x| over the tensor, into *amax_bits (the float32 bits of
//      the maximum; a NaN anywhere makes it a NaN), one atomicMax per block;
//   2. the fused scale-and-cast, which reads *amax_bits on the device:
//        scale     = float32(float8_max * (1 / max(float64(amax), 1e-12)))
//                    (float64: a correctly rounded reciprocal, then the product)
//        data      = float8(clamp(float32(x) * scale, -float8_max, float8_max))
//                    (c10's round-to-nearest-even conversion, NaN kept)
//        data_t    = data transposed, row-major [cols, rows] (null: not written)
//        *scale_out = scale, *inv_scale_out = 1 / scale (float32, correctly
//                    rounded)
//      in one pass over x: each element read once, its float8 byte written
//      to data and, through a shared-memory tile, to data_t.
// amax_bits is scratch the launcher zeroes first (cudaMemsetAsync); with
// amax_given it already holds the amax to scale by (a non-negative float32's
// bits, e.g. max|x| reduced over the ranks whose shards x is one of), and
// step 1 does not run. The arithmetic is
// kernels::reference::CastToFloat8Tensorwise's, step for step.
int CastToFloat8(DType t, Float8Type f8, const void* x, uint8_t* data, uint8_t* data_t,
                 float* scale_out, float* inv_scale_out, uint32_t* amax_bits, bool amax_given,
                 int64_t rows, int64_t cols, void* stream);

}  // namespace kernels::cuda
