// y = x W^T + b, at::linear's contract, with the CPU's float32 products at
// the machine's speed: the Llama model's linear layers.
//
//   at::Tensor y = kernels::Linear(x, weight, bias);  // bias may be undefined
//
// What runs:
//   * a decode step's few rows without autograd: DecodeLinear
//     (decode_linear.h), which reads W once at memory speed;
//   * other dense float32 CPU tensors: an autograd Function whose forward
//     and backward products (y = x W^T; dx = dy W; dW = dy^T x; the bias
//     added by autograd's add) go through cpu_matmul.h (oneDNN, 2.2x MKL's
//     sgemm on the AMD machines we measured); its backward with
//     create_graph runs the same formulas in ATen ops, so higher-order
//     gradients work;
//   * anything else (CUDA, other dtypes, tensors of a functorch transform,
//     autocast): at::linear itself.
// Results equal at::linear's up to the order of float32 sums.
#pragma once

#include <ATen/core/Tensor.h>

namespace kernels {

// x: [..., in]; weight: [out, in]; bias: [out] or undefined.
at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

}  // namespace kernels
