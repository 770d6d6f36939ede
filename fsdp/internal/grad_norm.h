// The local part of clip_grad_norm_ for both FSDPs: each rank's
// contribution to the global gradient norm, and the in-place scaling.
//
// As torch.nn.utils.clip_grad_norm_ computes it: one norm per gradient by
// _foreach_norm, in the gradient's own dtype, one launch per (device, dtype)
// group, combined in float64 on the device the collective runs on. Never a
// float64 copy of a gradient, and never a CPU accumulator beside CUDA
// gradients (which ATen refuses: "found at least two devices").
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace fsdp {
namespace internal {

// sum over `grads` of ||g||_p^p, or (p = inf) max over them of max |g|: a
// float64 tensor of shape [1] on `device` (zero when `grads` is empty or
// all empty), ready for an all-reduce (kSum, or kMax for inf).
at::Tensor LocalGradNormPow(const std::vector<at::Tensor>& grads, double norm_type,
                            c10::Device device);

// g *= coef for every gradient, one _foreach_mul_ per (device, dtype) group.
void ScaleGrads(const std::vector<at::Tensor>& grads, double coef);

}  // namespace internal
}  // namespace fsdp
