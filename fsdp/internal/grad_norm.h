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

// As torch.nn.utils.clip_grads_with_norm_: coef = min(max_norm / (total +
// 1e-6), 1) computed on `total`'s device (float64, as the host computed it
// before) and every gradient multiplied by it, one _foreach_mul_ per
// (device, dtype) group — by exactly 1 when the norm is within max_norm,
// which leaves the values as they were. No host synchronisation: the step
// need not wait for the norm (nor a CUDA graph's capture for the host).
void ClipGradsWithNorm(const std::vector<at::Tensor>& grads, double max_norm,
                       const at::Tensor& total);

}  // namespace internal
}  // namespace fsdp
