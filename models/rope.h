// Rotary position embeddings (RoPE) as transformers computes them for the
// Llama family: the rotate-half layout (a head's dimension i pairs with
// i + head_dim / 2, not with its neighbour), the tables in float32.
//
//   torch::Tensor inv_freq = models::RopeInverseFrequencies(config.rope, config.head_dim);
//   auto [cos, sin] = models::RopeCosSin(inv_freq, torch::arange(T));  // [T, head_dim]
//   q = models::ApplyRope(q, cos.to(q.dtype()), sin.to(q.dtype()));   // q: [B, H, T, head_dim]
#pragma once

#include <cstdint>
#include <utility>

#include <ATen/core/Tensor.h>

#include "models/llama_config.h"

namespace models {

// float32 [head_dim / 2]: 1 / theta^(2i / head_dim), computed in float32 as
// transformers does, then scaled per `rope.type`: kLinear divides all by
// factor; kLlama3 divides those whose wavelength 2π/f exceeds
// original_max_position_embeddings / low_freq_factor by factor, keeps those
// under original_max_position_embeddings / high_freq_factor, and
// interpolates between the two in the band between (the smoothing of
// Llama 3.1).
at::Tensor RopeInverseFrequencies(const RopeConfig& rope, int64_t head_dim);

// cos and sin, float32 [..., head_dim] for int64 `positions` of any shape
// ([T], or [B, T] for rows with their own positions): the angles
// position * inv_freq, each repeated for the two halves of the head.
std::pair<at::Tensor, at::Tensor> RopeCosSin(const at::Tensor& inv_freq,
                                             const at::Tensor& positions);

// x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[..., d/2:],
// x[..., :d/2]). x: [B, H, T, head_dim]; cos, sin: [T, head_dim] or
// [B, T, head_dim] (one table per row), in x's dtype.
at::Tensor ApplyRope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace models
