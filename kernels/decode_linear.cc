#include "kernels/decode_linear.h"

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include "kernels/internal/plain_cpu.h"

namespace kernels {
namespace {

// One block of output features [begin, end) for every row of x: y[r, o] =
// sum_k w[o, k] x[r, k]. x rows are `in` floats apart, y rows `out` apart.
struct Block {
  const float* w;
  const float* x;
  float* y;
  int64_t in, out, rows;
};

#if defined(__x86_64__)

__attribute__((target("avx512f"))) void DotAvx512(const Block& b, int64_t begin, int64_t end) {
  const int64_t in = b.in, full = in & ~int64_t{15};
  const __mmask16 tail = static_cast<__mmask16>((1u << (in - full)) - 1);
  int64_t o = begin;
  // Four rows of W at a time: four independent FMA chains (a chain of one
  // waits out the FMA latency every 16 floats) and four read streams.
  for (; o + 4 <= end; o += 4) {
    const float* w0 = b.w + o * in;
    const float* w1 = w0 + in;
    const float* w2 = w1 + in;
    const float* w3 = w2 + in;
    for (int64_t r = 0; r < b.rows; ++r) {
      const float* x = b.x + r * in;
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
             a3 = _mm512_setzero_ps();
      for (int64_t k = 0; k < full; k += 16) {
        const __m512 xv = _mm512_loadu_ps(x + k);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + k), xv, a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w1 + k), xv, a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w2 + k), xv, a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w3 + k), xv, a3);
      }
      if (tail != 0) {
        const __m512 xv = _mm512_maskz_loadu_ps(tail, x + full);
        a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w0 + full), xv, a0);
        a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w1 + full), xv, a1);
        a2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w2 + full), xv, a2);
        a3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w3 + full), xv, a3);
      }
      float* y = b.y + r * b.out + o;
      y[0] = _mm512_reduce_add_ps(a0);
      y[1] = _mm512_reduce_add_ps(a1);
      y[2] = _mm512_reduce_add_ps(a2);
      y[3] = _mm512_reduce_add_ps(a3);
    }
  }
  for (; o < end; ++o) {
    const float* w = b.w + o * in;
    for (int64_t r = 0; r < b.rows; ++r) {
      const float* x = b.x + r * in;
      __m512 a = _mm512_setzero_ps();
      for (int64_t k = 0; k < full; k += 16) {
        a = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a);
      }
      if (tail != 0) {
        a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w + full),
                            _mm512_maskz_loadu_ps(tail, x + full), a);
      }
      b.y[r * b.out + o] = _mm512_reduce_add_ps(a);
    }
  }
}

__attribute__((target("avx2,fma"))) float Sum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

__attribute__((target("avx2,fma"))) void DotAvx2(const Block& b, int64_t begin, int64_t end) {
  const int64_t in = b.in, full = in & ~int64_t{7};
  int64_t o = begin;
  for (; o + 4 <= end; o += 4) {
    const float* w0 = b.w + o * in;
    const float* w1 = w0 + in;
    const float* w2 = w1 + in;
    const float* w3 = w2 + in;
    for (int64_t r = 0; r < b.rows; ++r) {
      const float* x = b.x + r * in;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
             a3 = _mm256_setzero_ps();
      for (int64_t k = 0; k < full; k += 8) {
        const __m256 xv = _mm256_loadu_ps(x + k);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), xv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), xv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), xv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), xv, a3);
      }
      float s0 = Sum8(a0), s1 = Sum8(a1), s2 = Sum8(a2), s3 = Sum8(a3);
      for (int64_t k = full; k < in; ++k) {
        s0 += w0[k] * x[k];
        s1 += w1[k] * x[k];
        s2 += w2[k] * x[k];
        s3 += w3[k] * x[k];
      }
      float* y = b.y + r * b.out + o;
      y[0] = s0;
      y[1] = s1;
      y[2] = s2;
      y[3] = s3;
    }
  }
  for (; o < end; ++o) {
    const float* w = b.w + o * in;
    for (int64_t r = 0; r < b.rows; ++r) {
      const float* x = b.x + r * in;
      __m256 a = _mm256_setzero_ps();
      for (int64_t k = 0; k < full; k += 8) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a);
      }
      float s = Sum8(a);
      for (int64_t k = full; k < in; ++k) s += w[k] * x[k];
      b.y[r * b.out + o] = s;
    }
  }
}

#endif  // __x86_64__

void DotScalar(const Block& b, int64_t begin, int64_t end) {
  for (int64_t o = begin; o < end; ++o) {
    const float* w = b.w + o * b.in;
    for (int64_t r = 0; r < b.rows; ++r) {
      const float* x = b.x + r * b.in;
      float s = 0;
      for (int64_t k = 0; k < b.in; ++k) s += w[k] * x[k];
      b.y[r * b.out + o] = s;
    }
  }
}

using DotFn = void (*)(const Block&, int64_t, int64_t);

DotFn ChooseDot() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) return DotAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return DotAvx2;
#endif
  return DotScalar;
}

bool NeedsAutograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (c10::InferenceMode::is_enabled() || !c10::GradMode::is_enabled()) return false;
  return x.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad());
}

}  // namespace

bool DecodeLinearApplies(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (!x.defined() || !weight.defined() || x.dim() < 1 || weight.dim() != 2) return false;
  if (!internal::PlainCpuFloat(x) || !internal::PlainCpuFloat(weight) || !weight.is_contiguous())
    return false;
  if (bias.defined() &&
      (!internal::PlainCpuFloat(bias) || bias.dim() != 1 || bias.size(0) != weight.size(0)))
    return false;
  if (x.size(-1) != weight.size(1) || weight.size(1) == 0) return false;
  const int64_t rows = x.numel() / x.size(-1);
  if (rows < 1 || rows > kDecodeLinearMaxRows) return false;
  if (at::autocast::is_autocast_enabled(at::kCPU)) return false;
  return !NeedsAutograd(x, weight, bias);
}

at::Tensor DecodeLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (!DecodeLinearApplies(x, weight, bias)) {
    return at::linear(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
  }
  static const DotFn dot = ChooseDot();
  const at::Tensor input = x.contiguous();
  const int64_t in = weight.size(1), out = weight.size(0), rows = input.numel() / in;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  at::Tensor y = at::empty(shape, x.options());
  const Block block{
      weight.data_ptr<float>(), input.data_ptr<float>(), y.data_ptr<float>(), in, out, rows};
  // At least 64 KiB of W per task, in whole blocks of four rows: smaller
  // pieces cost more to hand out than to read.
  const int64_t grain = std::max<int64_t>(4, ((16384 / in) + 3) / 4 * 4);
  at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) { dot(block, begin, end); });
  if (bias.defined()) y.add_(bias);
  return y;
}

}  // namespace kernels
