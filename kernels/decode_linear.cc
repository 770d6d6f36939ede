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

// y[r, o + j] for every row r of x and j < kW: kW rows of W at a time, so
// kW independent FMA chains (a chain of one waits out the FMA latency every
// vector) and kW read streams. kW = 1 serves the rows left over; each
// output is the same sum either way, so how a block is split does not
// change a bit.
template <int kW>
__attribute__((target("avx512f"))) void RowsAvx512(const Block& b, int64_t o) {
  const int64_t in = b.in, full = in & ~int64_t{15};
  const __mmask16 tail = static_cast<__mmask16>((1u << (in - full)) - 1);
  const float* w = b.w + o * in;
  for (int64_t r = 0; r < b.rows; ++r) {
    const float* x = b.x + r * in;
    __m512 a[kW];
    for (int j = 0; j < kW; ++j) a[j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < full; k += 16) {
      const __m512 xv = _mm512_loadu_ps(x + k);
      for (int j = 0; j < kW; ++j)
        a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(w + j * in + k), xv, a[j]);
    }
    if (tail != 0) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, x + full);
      for (int j = 0; j < kW; ++j) {
        a[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w + j * in + full), xv, a[j]);
      }
    }
    for (int j = 0; j < kW; ++j) b.y[r * b.out + o + j] = _mm512_reduce_add_ps(a[j]);
  }
}

__attribute__((target("avx2,fma"))) float Sum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// RowsAvx512 with 8-float vectors and the tail added one float at a time.
template <int kW>
__attribute__((target("avx2,fma"))) void RowsAvx2(const Block& b, int64_t o) {
  const int64_t in = b.in, full = in & ~int64_t{7};
  const float* w = b.w + o * in;
  for (int64_t r = 0; r < b.rows; ++r) {
    const float* x = b.x + r * in;
    __m256 a[kW];
    for (int j = 0; j < kW; ++j) a[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < full; k += 8) {
      const __m256 xv = _mm256_loadu_ps(x + k);
      for (int j = 0; j < kW; ++j)
        a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(w + j * in + k), xv, a[j]);
    }
    for (int j = 0; j < kW; ++j) {
      float sum = Sum8(a[j]);
      for (int64_t k = full; k < in; ++k) sum += w[j * in + k] * x[k];
      b.y[r * b.out + o + j] = sum;
    }
  }
}

#endif  // __x86_64__

// Output features [begin, end): blocks of four rows of W, then one at a time.
template <void (*Four)(const Block&, int64_t), void (*One)(const Block&, int64_t)>
void Dot(const Block& b, int64_t begin, int64_t end) {
  int64_t o = begin;
  for (; o + 4 <= end; o += 4) Four(b, o);
  for (; o < end; ++o) One(b, o);
}

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
  if (__builtin_cpu_supports("avx512f")) return Dot<RowsAvx512<4>, RowsAvx512<1>>;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return Dot<RowsAvx2<4>, RowsAvx2<1>>;
  }
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
