// Rotary position embeddings on q and k together: one kernel forward and
// one backward on CUDA, for both tensors.
//
//   auto [q_rot, k_rot] = kernels::ApplyRopeQK(q, k, cos, sin);
//   // q [B, H, T, D], k [B, Hkv, T, D]; cos, sin [T, D] or [B, T, D]
//
// Semantics: models::ApplyRope on each (reference.h): the rotate-half
// layout, x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin, in the inputs'
// dtype (the tables cast to it, as models/ does). Backward: the transpose
// of that rotation, which for RoPE's tables (whose halves repeat) is RoPE
// with -sin. No gradient for cos and sin (tables, not parameters).
//
// Why fused: the composite per tensor is five kernels (two narrows and a
// negation into a cat, two products, a sum) writing three temporaries of
// q's size; for q and k that is ten launches and six temporaries per layer,
// and autograd repeats them backward. The kernel reads each (x_i, x_{i+D/2})
// pair once, with its cos and sin, and writes both outputs, q's and k's
// heads in the same launch; backward is the same kernel transposed. q and k
// may be strided views (the [B, T, H, D] -> [B, H, T, D] transpose of the
// projections), as long as D is contiguous; the outputs keep their layout.
//
// Dispatch (internal/fused_ops.h): CUDA tensors of one dtype (float32,
// bfloat16, float16) with q [B, H, T, D], k [B, Hkv, T, D], even D, and
// tables [T, D] or [B, T, D] that need no gradient run the kernel; anything
// else runs the reference, and a CUDA input that falls back says why once.
// The backward is the kernel transposed; with create_graph=true, the same
// rotation in ATen (differentiable again).
#pragma once

#include <tuple>

#include <ATen/core/Tensor.h>

namespace kernels {

// Returns (RoPE(q), RoPE(k)).
std::tuple<at::Tensor, at::Tensor> ApplyRopeQK(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin);

}  // namespace kernels
