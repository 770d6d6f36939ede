#include "kernels/cpu_matmul.h"

#include <dlfcn.h>

#include <ATen/Context.h>
#include <ATen/record_function.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/core/GradMode.h>

#include "kernels/internal/plain_cpu.h"

namespace kernels {
namespace {

// at::native::mkldnn_matmul(mat1, mat2, result, beta, alpha): result = beta *
// result + alpha * (mat1 @ mat2) (with beta 0 the result is only written);
// libtorch_cpu's ATen/native/mkldnn/Matmul.h, not shipped with the wheel.
using OneDnnMatmul = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, float,
                              float);

// Looked up by its mangled name rather than linked: a LibTorch whose
// signature differs (another mangled name) or that lacks it then runs
// at::mm instead of failing to link or load.
OneDnnMatmul FindOneDnnMatmul() {
  constexpr char kSymbol[] = "_ZN2at6native13mkldnn_matmulERKNS_6TensorES3_S3_ff";
  if (!at::hasMKLDNN()) return nullptr;
  void* found = dlsym(RTLD_DEFAULT, kSymbol);
  if (found == nullptr) {
    // libtorch_cpu loaded privately (RTLD_LOCAL) by whoever loaded us.
    if (void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD); lib != nullptr) {
      found = dlsym(lib, kSymbol);
    }
  }
  return reinterpret_cast<OneDnnMatmul>(found);
}

OneDnnMatmul OneDnn() {
  static const OneDnnMatmul found = FindOneDnnMatmul();
  return found;
}

// Row-major or column-major: a layout oneDNN reads in place.
bool Dense2d(const at::Tensor& t) {
  if (t.dim() != 2) return false;
  const auto s = t.strides();
  return (s[1] == 1 && s[0] >= t.size(1)) || (s[0] == 1 && s[1] >= t.size(0));
}

bool RecordsAutograd(const at::Tensor& t) {
  return c10::GradMode::is_enabled() && t.requires_grad();
}

// `out` can take oneDNN's result of a @ b in place.
bool WritableResult(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  return internal::PlainCpuFloat(out) && out.is_contiguous() && out.dim() == 2 &&
         out.size(0) == a.size(0) && out.size(1) == b.size(1) && !RecordsAutograd(out);
}

}  // namespace

bool OneDnnMatmulFound() { return OneDnn() != nullptr; }

bool CpuMatmulUsesOneDnn(const at::Tensor& a, const at::Tensor& b) {
  if (OneDnn() == nullptr || !internal::PlainCpuFloat(a) || !internal::PlainCpuFloat(b))
    return false;
  if (!Dense2d(a) || !Dense2d(b) || a.size(1) != b.size(0)) return false;
  if (a.size(0) * a.size(1) * b.size(1) < kOneDnnMinMacs) return false;
  return !RecordsAutograd(a) && !RecordsAutograd(b);
}

// Each oneDNN product is a profiler range named kProfilerName: ATen's
// profiler records ops, and oneDNN's call is none (benchmarks/python/
// profile_table.py counts the name as GEMM).
constexpr char kProfilerName[] = "kernels::onednn_matmul";

at::Tensor Mm(const at::Tensor& a, const at::Tensor& b) {
  if (!CpuMatmulUsesOneDnn(a, b)) return at::mm(a, b);
  RECORD_FUNCTION(kProfilerName, std::vector<c10::IValue>());
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
  OneDnn()(a, b, out, /*beta=*/0.0f, /*alpha=*/1.0f);
  return out;
}

void MmOut(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  if (!CpuMatmulUsesOneDnn(a, b) || !WritableResult(out, a, b)) {
    at::mm_out(const_cast<at::Tensor&>(out), a, b);
    return;
  }
  RECORD_FUNCTION(kProfilerName, std::vector<c10::IValue>());
  OneDnn()(a, b, out, /*beta=*/0.0f, /*alpha=*/1.0f);
}

void AddMmInPlace(const at::Tensor& acc, const at::Tensor& a, const at::Tensor& b) {
  if (!CpuMatmulUsesOneDnn(a, b) || !WritableResult(acc, a, b)) {
    const_cast<at::Tensor&>(acc).addmm_(a, b);
    return;
  }
  RECORD_FUNCTION(kProfilerName, std::vector<c10::IValue>());
  OneDnn()(a, b, acc, /*beta=*/1.0f, /*alpha=*/1.0f);
}

}  // namespace kernels
