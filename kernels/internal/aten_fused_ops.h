// A FusedOps (fused_ops.h) computed with ATen operators on any device: the
// CUDA kernels' arithmetic (float32, the same roundings to the activations'
// dtype, the same explicit backward formulas) written as tensor expressions.
// Tests put it in front of the dispatch (ScopedFusedOpsForTesting) to run
// the fused ops' autograd::Functions, saved tensors and backward formulas on
// the CPU; it is what internal/cuda_kernels.cu is checked against on a GPU.
#pragma once

#include <ATen/core/Tensor.h>

#include "kernels/internal/fused_ops.h"

namespace kernels::internal {

const FusedOps* AtenFusedOps();

// 1 / sqrt(mean(h^2, -1) + eps) in float32 (float64 for float64 h), as
// RmsNormForward computes it: with grad mode on, differentiable in h (the
// backward for create_graph=true recomputes it so).
at::Tensor RmsNormRstd(const at::Tensor& h, double eps);

}  // namespace kernels::internal
