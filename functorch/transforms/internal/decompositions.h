#pragma once

// Decompositions the transforms install for ops whose own kernels do not
// compose: what Python functorch 1.13 installs on import, plus the forward-AD
// decompositions PyTorch registers from Python (torch/_decomp/
// decompositions_for_jvp.py, skipped on Python 3.11), done from C++.
//
//   FuncTorchBatched  aten::mse_loss_backward, aten::addr, and (Python
//                     2.x's additions) smooth_l1_loss_backward,
//                     huber_loss_backward, nll_loss_forward,
//                     nll_loss_backward -- as Python's
//                     _register_python_decomposition_vmap: under vmap they
//                     run as a few batched primitive ops instead of the
//                     per-example fallback loop, and the primitives carry
//                     forward-mode AD (what hessian = jacfwd(jacrev) needs:
//                     mse_loss_backward's own forward formula writes into a
//                     ZeroTensor and throws).
//   FuncTorchVmapMode aten::mm (ours, not Python's): an mm with contraction 1
//                     under vmap is an outer product and runs as a broadcast
//                     multiply, with the same bits, instead of ATen's rule's
//                     k = 1 bmm (MKL's slow path; the per-sample weight
//                     gradient of a linear layer). Other mm go on to ATen's
//                     FuncTorchBatched rule. Only a fallthrough lives at this
//                     key for mm, so no ATen kernel is overridden.
//   AutogradCPU       aten::mse_loss_backward, when a forward or reverse
//                     derivative of it is wanted (jvp(grad(f)) without vmap);
//                     otherwise the fused kernel runs as before.
//   JIT (forward AD)  _log_softmax_backward_data, _softmax_backward_data,
//                     log_sigmoid_backward, huber_loss_backward,
//                     soft_margin_loss_backward, nll_loss_backward (LibTorch
//                     2.x routes it here too): autograd has no forward
//                     formula for these and asks the TorchScript
//                     decomposition registry, which LibTorch leaves empty
//                     (cross_entropy, nll_loss, kl_div, huber, soft_margin
//                     and multilabel_soft_margin Hessians need them).
//
// Every transform calls this once before it runs; it is idempotent and
// thread-safe. Nothing changes for programs that never use a transform.

namespace functorch {
namespace internal {

void register_decompositions();

}  // namespace internal
}  // namespace functorch
