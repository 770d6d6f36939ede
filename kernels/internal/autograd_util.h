// What the fused ops' autograd::Functions share: carrying the FusedOps
// through the autograd context, and choosing the backward's.
#pragma once

#include <torch/csrc/autograd/custom_function.h>

#include "kernels/internal/fused_ops.h"

namespace kernels::internal {

void SaveFusedOps(torch::autograd::AutogradContext* ctx, const FusedOps* ops);
const FusedOps* SavedFusedOps(torch::autograd::AutogradContext* ctx);

// The FusedOps a backward runs: the forward's, or, when autograd asks for a
// backward it can differentiate again (create_graph=true, so grad mode is
// on), AtenFusedOps(): the same formulas as ATen operators, differentiable,
// on any device (a kernel's backward is not differentiable).
const FusedOps* BackwardFusedOps(torch::autograd::AutogradContext* ctx);

}  // namespace kernels::internal
