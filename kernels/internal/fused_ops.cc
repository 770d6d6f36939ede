#include "kernels/internal/fused_ops.h"

#include <array>
#include <atomic>
#include <cstdint>
#include <limits>
#include <sstream>

#include <ATen/core/grad_mode.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/util/Exception.h>

namespace kernels::internal {
namespace {

std::atomic<const FusedOps*> g_cuda_ops{nullptr};
std::atomic<const FusedOps*> g_testing_ops{nullptr};
std::array<std::atomic<bool>, 5> g_warned{};

std::string Shape(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

std::string DtypeProblem(const FusedOps& ops, const char* what, const at::Tensor& t) {
  if (ops.TakesDtype(t.scalar_type())) return "";
  std::ostringstream out;
  out << what << " has dtype " << t.scalar_type()
      << ": the kernel takes float32, bfloat16 or float16";
  return out.str();
}

// What every op asks of each input: one device, no forward-mode AD tangent
// (an autograd::Function has no forward derivative), no functorch wrapper
// (a C++ autograd::Function does not run under vmap/grad transforms).
std::string CommonProblems(std::initializer_list<std::pair<const char*, const at::Tensor*>> named) {
  const at::Tensor* first = nullptr;
  const char* first_what = "";
  for (const auto& [what, t] : named) {
    if (!t->defined()) continue;
    if (first == nullptr) {
      first = t;
      first_what = what;
    }
    if (t->device() != first->device()) {
      std::ostringstream out;
      out << what << " is on " << t->device() << " and " << first_what << " on " << first->device()
          << ": the kernel takes tensors on one device";
      return out.str();
    }
    if (t->key_set().has_any(c10::functorch_transforms_ks)) {
      return std::string(what) +
             " is a functorch-transformed tensor (vmap/grad): the kernel's autograd::Function "
             "does not run under functorch transforms";
    }
    if (t->_fw_grad(/*level=*/0).defined()) {
      return std::string(what) +
             " carries a forward-mode AD tangent: the kernel has no forward derivative";
    }
  }
  return "";
}

}  // namespace

const char* OpName(Op op) {
  switch (op) {
    case Op::kRmsNorm: return "kernels::RmsNorm";
    case Op::kAddRmsNorm: return "kernels::AddRmsNorm";
    case Op::kSwiGlu: return "kernels::SwiGlu";
    case Op::kApplyRopeQK: return "kernels::ApplyRopeQK";
    case Op::kFloat8Linear: return "kernels::Float8Linear";
    case Op::kCastToFloat8Fused: return "kernels::CastToFloat8Fused";
  }
  return "kernels::?";
}

bool FusedOps::TakesDtype(at::ScalarType dtype) const {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

std::string UnsupportedRmsNorm(const FusedOps& ops, const at::Tensor& x, const at::Tensor& residual,
                               const at::Tensor& weight) {
  std::string problem = CommonProblems({{"x", &x}, {"residual", &residual}, {"weight", &weight}});
  if (!problem.empty()) return problem;
  if (!(problem = DtypeProblem(ops, "x", x)).empty()) return problem;
  if (x.dim() < 1 || x.size(-1) == 0) {
    return "x has shape " + Shape(x) + ": the kernel takes [..., hidden] with hidden >= 1";
  }
  if (weight.dim() != 1 || weight.size(0) != x.size(-1)) {
    return "weight has shape " + Shape(weight) + " for x of shape " + Shape(x) +
           ": the kernel takes a 1-D weight of x's last size";
  }
  if (weight.scalar_type() != x.scalar_type() &&
      !(weight.scalar_type() == at::kFloat && x.scalar_type() != at::kDouble)) {
    std::ostringstream out;
    out << "weight has dtype " << weight.scalar_type() << " and x " << x.scalar_type()
        << ": the kernel takes a weight in x's dtype or float32";
    return out.str();
  }
  if (residual.defined() &&
      (residual.sizes() != x.sizes() || residual.scalar_type() != x.scalar_type())) {
    std::ostringstream out;
    out << "residual has shape " << residual.sizes() << " and dtype " << residual.scalar_type()
        << ", x " << x.sizes() << " and " << x.scalar_type()
        << ": the kernel takes the same shape and dtype (no broadcasting)";
    return out.str();
  }
  if (x.numel() / x.size(-1) > std::numeric_limits<int32_t>::max()) {
    return "x has " + std::to_string(x.numel() / x.size(-1)) +
           " rows: the kernel takes at most 2^31 - 1 (one block per row)";
  }
  return "";
}

std::string UnsupportedSwiGlu(const FusedOps& ops, const at::Tensor& gate, const at::Tensor& up) {
  std::string problem = CommonProblems({{"gate", &gate}, {"up", &up}});
  if (!problem.empty()) return problem;
  if (!(problem = DtypeProblem(ops, "gate", gate)).empty()) return problem;
  if (gate.sizes() != up.sizes() || gate.scalar_type() != up.scalar_type()) {
    std::ostringstream out;
    out << "gate has shape " << gate.sizes() << " and dtype " << gate.scalar_type() << ", up "
        << up.sizes() << " and " << up.scalar_type()
        << ": the kernel takes the same shape and dtype (no broadcasting)";
    return out.str();
  }
  return "";
}

std::string UnsupportedRopeQK(const FusedOps& ops, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& cos, const at::Tensor& sin) {
  std::string problem = CommonProblems({{"q", &q}, {"k", &k}, {"cos", &cos}, {"sin", &sin}});
  if (!problem.empty()) return problem;
  if (!(problem = DtypeProblem(ops, "q", q)).empty()) return problem;
  if (k.scalar_type() != q.scalar_type() || cos.scalar_type() != q.scalar_type() ||
      sin.scalar_type() != q.scalar_type()) {
    std::ostringstream out;
    out << "q, k, cos, sin have dtypes " << q.scalar_type() << ", " << k.scalar_type() << ", "
        << cos.scalar_type() << ", " << sin.scalar_type()
        << ": the kernel takes one dtype (the tables cast to q's)";
    return out.str();
  }
  if (q.dim() != 4 || k.dim() != 4 || q.size(0) != k.size(0) || q.size(2) != k.size(2) ||
      q.size(3) != k.size(3) || q.size(3) % 2 != 0) {
    return "q has shape " + Shape(q) + " and k " + Shape(k) +
           ": the kernel takes q [B, H, T, D] and k [B, Hkv, T, D] with an even D";
  }
  const int64_t batch = q.size(0), length = q.size(2), head_dim = q.size(3);
  const bool per_time = cos.dim() == 2 && cos.size(0) == length && cos.size(1) == head_dim;
  const bool per_row =
      cos.dim() == 3 && cos.size(0) == batch && cos.size(1) == length && cos.size(2) == head_dim;
  if (!(per_time || per_row) || sin.sizes() != cos.sizes()) {
    return "cos has shape " + Shape(cos) + " and sin " + Shape(sin) + " for q of shape " +
           Shape(q) + ": the kernel takes both [T, D] or both [B, T, D]";
  }
  if (at::GradMode::is_enabled() && (cos.requires_grad() || sin.requires_grad())) {
    return "cos or sin requires grad: the kernel differentiates q and k only";
  }
  return "";
}

std::string UnsupportedFloat8Cast(const FusedOps& ops, const at::Tensor& x) {
  std::string problem = DtypeProblem(ops, "x", x);
  if (!problem.empty()) return problem;
  if (x.dim() != 2 || x.size(0) == 0 || x.size(1) == 0) {
    return "x has shape " + Shape(x) + ": the kernel takes a non-empty [rows, cols]";
  }
  // One block per 32 x 32 tile: gridDim.x is at most 2^31 - 1.
  if ((x.size(0) + 31) / 32 > std::numeric_limits<int32_t>::max() / ((x.size(1) + 31) / 32)) {
    return "x has shape " + Shape(x) + ": the kernel takes at most 2^31 - 1 tiles of 32 x 32";
  }
  return "";
}

bool RegisterCudaFusedOps(const FusedOps* ops) {
  g_cuda_ops.store(ops);
  return true;
}

const FusedOps* CudaFusedOps() { return g_cuda_ops.load(); }

ScopedFusedOpsForTesting::ScopedFusedOpsForTesting(const FusedOps* ops)
    : previous_(g_testing_ops.exchange(ops)) {}

ScopedFusedOpsForTesting::~ScopedFusedOpsForTesting() { g_testing_ops.store(previous_); }

void ResetFallbackWarningsForTesting() {
  for (auto& warned : g_warned) warned.store(false);
}

const FusedOps* FusedOpsForTesting() { return g_testing_ops.load(); }

const FusedOps* AvailableFusedOps(const at::Tensor& device_of, std::string* why_not) {
  if (const FusedOps* ops = g_testing_ops.load()) return ops;
  if (!device_of.is_cuda()) return nullptr;
  if (const FusedOps* ops = g_cuda_ops.load()) return ops;
  *why_not =
      "this binary does not link //kernels:cuda, the CUDA kernels (a target selects it under "
      "//third_party:cuda, --config=cuda)";
  return nullptr;
}

void WarnFallbackOnce(Op op, const std::string& why) {
  if (g_warned[static_cast<size_t>(op)].exchange(true)) return;
  TORCH_WARN(OpName(op), ": running the ATen reference instead of the fused kernel: ", why,
             " (said once)");
}

}  // namespace kernels::internal
