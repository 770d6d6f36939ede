// The language-model head and its loss in one op, without the logits:
// mean cross-entropy of hidden @ weight.T against the targets, computed a
// chunk of rows at a time.
//
//   at::Tensor h = model->model(input_ids).reshape({-1, hidden});   // [N, H]
//   at::Tensor loss = kernels::LinearCrossEntropy(h, lm_head_weight, targets.reshape({-1}),
//                                                 /*chunk=*/4096);
//
// Semantics: transformers' ForCausalLMLoss on shifted rows (reference.h):
// the logits upcast to float32 (float64 stays float64), log-softmax,
// the mean over the rows whose target is not ignore_index (NaN when none
// is, as PyTorch's). The loss is float32 (float64 for float64 inputs).
//
// Why: at Llama 3's vocabulary (V = 128,256) the logits are the largest
// activation of the model. For N = 8 x 4096 tokens they are 8.4 GB in bf16,
// 16.8 GB as the float32 copy the loss takes, and as much again for their
// gradient; autograd keeps the float32 copy alive until backward. Here no
// [N, V] tensor exists: forward computes each chunk's [chunk, V] logits,
// reduces them to the row's logsumexp and target logit, and drops them,
// keeping only the float32 logsumexp per row ([N]); backward recomputes
// each chunk's logits (one more GEMM of the forward's size, the price of
// the memory) and forms the chunk's softmax gradient in place, from which
// it takes the chunk's rows of grad_hidden and its contribution to
// grad_weight. Peak memory of the op is about chunk x V x (4 + the input's
// element size) bytes, plus, for bfloat16/float16 inputs, a float32 [V, H]
// accumulator for grad_weight (V x H x 4 bytes, 2.1 GB for Llama 3 8B's
// head; the chunks' contributions are summed in float32, each chunk's GEMM
// in the input dtype on tensor cores, then added a block of vocabulary rows
// at a time: V x H x 12 bytes of memory traffic per chunk, which chunks of
// 4096 rows or more amortise on a GPU).
//
// Pure ATen (mm, logsumexp by max/exp/log, gather, scatter_add): one code
// path for CPU and CUDA, and no host synchronisation on CUDA (the target
// range check is an asynchronous assert). An autograd::Function:
// differentiable once (backward with create_graph=true is an error).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace kernels {

// hidden [N, H] and weight [V, H] of one floating dtype and device; targets
// int64 [N], each in [0, V) or ignore_index; chunk >= 1 rows per step (the
// last chunk may be shorter). Returns the mean loss, a scalar.
at::Tensor LinearCrossEntropy(const at::Tensor& hidden, const at::Tensor& weight,
                              const at::Tensor& targets, int64_t chunk,
                              int64_t ignore_index = -100);

}  // namespace kernels
