#include "kernels/internal/autograd_util.h"

#include <cstdint>

#include <ATen/core/grad_mode.h>

#include "kernels/internal/aten_fused_ops.h"

namespace kernels::internal {

void SaveFusedOps(torch::autograd::AutogradContext* ctx, const FusedOps* ops) {
  ctx->saved_data["fused_ops"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(ops));
}

const FusedOps* SavedFusedOps(torch::autograd::AutogradContext* ctx) {
  return reinterpret_cast<const FusedOps*>(
      static_cast<intptr_t>(ctx->saved_data["fused_ops"].toInt()));
}

const FusedOps* BackwardFusedOps(torch::autograd::AutogradContext* ctx) {
  return at::GradMode::is_enabled() ? AtenFusedOps() : SavedFusedOps(ctx);
}

}  // namespace kernels::internal
