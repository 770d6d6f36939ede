#include "kernels/reference.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/silu.h>
#include <c10/util/Exception.h>

namespace kernels::reference {
namespace {

at::Tensor Rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  // One table per row ([B, T, D]) broadcasts over the heads as [B, 1, T, D].
  const at::Tensor c = cos.dim() == 3 ? cos.unsqueeze(1) : cos;
  const at::Tensor s = sin.dim() == 3 ? sin.unsqueeze(1) : sin;
  const at::Tensor rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * c + rotated * s;
}

}  // namespace

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor variance = x32.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (x32 * at::rsqrt(variance + eps)).to(x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> AddRmsNorm(const at::Tensor& x, const at::Tensor& residual,
                                              const at::Tensor& weight, double eps) {
  at::Tensor h = x + residual;
  return {RmsNorm(h, weight, eps), h};
}

at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up) { return at::silu(gate) * up; }

std::tuple<at::Tensor, at::Tensor> ApplyRopeQK(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "kernels::ApplyRopeQK: q of shape ", q.sizes(),
              " and k of shape ", k.sizes(),
              ": expected [batch, heads, length, head_dim] and [batch, kv_heads, length, "
              "head_dim]");
  TORCH_CHECK(q.size(-1) % 2 == 0 && k.size(-1) == q.size(-1),
              "kernels::ApplyRopeQK: head_dim of q ", q.size(-1), " and of k ", k.size(-1),
              ": expected one even head_dim");
  return {Rope(q, cos, sin), Rope(k, cos, sin)};
}

at::Tensor LinearCrossEntropy(const at::Tensor& hidden, const at::Tensor& weight,
                              const at::Tensor& targets, int64_t ignore_index) {
  const at::Tensor logits = at::mm(hidden, weight.t()).to(at::kFloat);
  return at::cross_entropy_loss(logits, targets, /*weight=*/{}, at::Reduction::Mean, ignore_index);
}

}  // namespace kernels::reference
