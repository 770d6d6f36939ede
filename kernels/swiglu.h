// SwiGLU, the Llama MLP's activation, silu(gate) * up, as one kernel
// forward and one backward on CUDA.
//
//   at::Tensor a = kernels::SwiGlu(gate_proj(x), up_proj(x));
//   at::Tensor y = down_proj(a);
//
// Semantics: at::silu(gate) * up (reference.h), in the inputs' dtype.
//
// Why fused: the composite is two kernels forward (silu, then the
// product) that write and read back silu(gate), a tensor of the MLP's
// intermediate size ([tokens, intermediate], the widest activation of the
// layer after the logits), and autograd keeps it for backward beside gate
// and up; backward is four more element-wise kernels (silu's backward, two
// products, ...). The kernel reads gate and up and writes the output once;
// backward reads the gradient, gate and up once and writes both gradients,
// recomputing the sigmoid instead of keeping anything but the inputs.
//
// Dispatch (internal/fused_ops.h): CUDA tensors of one shape and dtype
// (float32, bfloat16, float16) run the kernel (a non-contiguous input is
// made contiguous first); anything else runs the reference, and a CUDA input
// that falls back says why once. The backward is a kernel; with
// create_graph=true, the same formula in ATen (differentiable again).
#pragma once

#include <ATen/core/Tensor.h>

namespace kernels {

// gate, up: one shape. Returns silu(gate) * up in that shape.
at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up);

}  // namespace kernels
