#include "functorch/transforms/internal/decompositions.h"

#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/mm_ops.h>
#include <ATen/ops/mse_loss_backward_ops.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/jit.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/runtime/decomposition_registry.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <tuple>
#include <vector>
#include <string>
#include <utility>

namespace functorch {
namespace internal {
namespace {

// torch/_decomp's mse_loss_backward, in primitive ops.
at::Tensor mse_loss_backward_decomposed(const at::Tensor& grad_output, const at::Tensor& self,
                                        const at::Tensor& target, int64_t reduction) {
  const double norm =
      reduction == at::Reduction::Mean ? 2.0 / static_cast<double>(self.numel()) : 2.0;
  return (self - target).mul(norm).mul(grad_output);
}

// torch/_refs' addr, in primitive ops (outer product, scaled and added).
at::Tensor addr_decomposed(const at::Tensor& self, const at::Tensor& vec1, const at::Tensor& vec2,
                           const at::Scalar& beta, const at::Scalar& alpha) {
  TORCH_CHECK(vec1.dim() == 1, "addr: Expected 1-D argument vec1, but got ", vec1.dim(), "-D");
  TORCH_CHECK(vec2.dim() == 1, "addr: Expected 1-D argument vec2, but got ", vec2.dim(), "-D");
  at::Tensor expanded = self.expand({vec1.size(0), vec2.size(0)});
  at::Tensor outer = at::outer(vec1, vec2);
  if (expanded.scalar_type() == at::kBool) {
    at::Tensor scaled = alpha.toBool() ? outer : at::full_like(expanded, false);
    return beta.toBool() ? at::logical_or(expanded, scaled) : scaled;
  }
  // beta == 0 drops self entirely, NaNs included (as the fused kernel does).
  if (beta.isIntegral(true) ? beta.toLong() == 0 : beta.toDouble() == 0.0) {
    return outer.mul(alpha);
  }
  return expanded.mul(beta).add(outer.mul(alpha));
}

// torch/_decomp's smooth_l1_loss_backward and huber_loss_backward (Python
// 2.x functorch registers both for vmap), elementwise.
at::Tensor smooth_l1_loss_backward_decomposed(const at::Tensor& grad_output, const at::Tensor& self,
                                              const at::Tensor& target, int64_t reduction,
                                              double beta) {
  const double norm =
      reduction == at::Reduction::Mean ? 1.0 / static_cast<double>(self.numel()) : 1.0;
  const at::Tensor x = self - target;
  const at::Tensor norm_grad = grad_output * norm;
  return at::where(x.abs() < beta, norm_grad * x / beta, norm_grad * x.sign());
}

at::Tensor huber_loss_backward_decomposed(const at::Tensor& grad_output, const at::Tensor& self,
                                          const at::Tensor& target, int64_t reduction,
                                          double delta) {
  const double norm =
      reduction == at::Reduction::Mean ? 1.0 / static_cast<double>(self.numel()) : 1.0;
  const at::Tensor x = self - target;
  return at::where(x < -delta, grad_output * (-norm * delta),
                   at::where(x > delta, grad_output * (norm * delta), x * grad_output * norm));
}

// nll_loss's class weights shaped to broadcast along `channel_dim` of a
// `ndim`-D input.
at::Tensor class_weights_along(const at::Tensor& weight, int64_t ndim, int64_t channel_dim) {
  std::vector<int64_t> shape(static_cast<size_t>(ndim), 1);
  shape[static_cast<size_t>(channel_dim)] = weight.size(0);
  return weight.reshape(shape);
}

// torch/_decomp's nll_loss_forward, registered for vmap by Python 2.x
// functorch: one gather over the batch instead of the per-example fallback
// loop (which made per-sample gradients of a cross-entropy loss 1.5x slower
// than torch.func's). self is [N, C] or [C], target [N] or [].
std::tuple<at::Tensor, at::Tensor> nll_loss_forward_decomposed(
    const at::Tensor& self, const at::Tensor& target, const std::optional<at::Tensor>& weight,
    int64_t reduction, int64_t ignore_index) {
  TORCH_CHECK(self.dim() > 0 && self.dim() <= 2, "nll_loss: input tensor should be 1D or 2D, got ",
              self.dim(), "D");
  TORCH_CHECK(target.dim() <= 1,
              "nll_loss: 0D or 1D target tensor expected, multi-target not "
              "supported, got ",
              target.dim(), "D");
  const bool no_batch_dim = self.dim() == 1 && target.dim() == 0;
  TORCH_CHECK(no_batch_dim || self.size(0) == target.size(0),
              "nll_loss: size mismatch (got input: ", self.sizes(), ", target: ", target.sizes(),
              ")");
  const int64_t n_classes = self.size(-1);
  const int64_t channel_dim = self.dim() < 2 ? 0 : 1;
  at::Tensor input = self;
  at::Tensor w;
  if (weight.has_value() && weight->defined()) {
    TORCH_CHECK(weight->dim() == 1 && weight->numel() == n_classes,
                "nll_loss: weight tensor should be defined either for all ", n_classes,
                " classes or no classes but got weight tensor of shape: ", weight->sizes());
    w = class_weights_along(*weight, self.dim(), channel_dim);
    input = self * w;
  }
  const at::Tensor valid = target != ignore_index;
  const at::Tensor safe_target = at::where(valid, target, 0).unsqueeze(channel_dim);
  at::Tensor result =
      at::where(valid, -at::gather(input, channel_dim, safe_target).squeeze(channel_dim), 0);
  if (reduction == at::Reduction::None && self.dim() > 1) {
    return {result, at::zeros({}, self.options())};
  }
  at::Tensor total_weight;
  if (w.defined()) {
    const at::Tensor picked =
        at::gather(w.expand(self.sizes()), channel_dim, safe_target).squeeze(channel_dim);
    total_weight = at::where(valid, picked, 0).sum();
  } else {
    total_weight = valid.sum().to(self.scalar_type());
  }
  if (reduction == at::Reduction::Sum) {
    result = result.sum();
  } else if (reduction == at::Reduction::Mean) {
    result = result.sum() / total_weight;
  }
  return {result, total_weight};
}

// torch/_decomp's _nll_loss_backward: a scatter of -1 at the targets, scaled.
at::Tensor nll_loss_backward_decomposed(const at::Tensor& grad_output, const at::Tensor& self,
                                        const at::Tensor& target,
                                        const std::optional<at::Tensor>& weight, int64_t reduction,
                                        int64_t ignore_index, const at::Tensor& total_weight) {
  const int64_t channel_dim = self.dim() < 2 ? 0 : 1;
  at::Tensor go = reduction == at::Reduction::Mean ? grad_output / total_weight : grad_output;
  // For a 1-D self the kernel reads only target[0].
  at::Tensor t = self.dim() == 1 && target.dim() > 0 ? target.select(0, 0) : target;
  t = t.unsqueeze(channel_dim);
  const at::Tensor valid = t != ignore_index;
  const at::Tensor grad_input =
      at::scatter(at::zeros_like(self), channel_dim, at::where(valid, t, 0), -1.0);
  if (grad_input.dim() > go.dim() && go.dim() > 0) go = go.unsqueeze(channel_dim);
  if (weight.has_value() && weight->defined()) {
    go = go * class_weights_along(*weight, self.dim(), channel_dim);
  }
  return grad_input * at::where(valid, go, 0);
}

// vmap's rule for mm, ahead of ATen's (FuncTorchVmapMode is dispatched before
// FuncTorchBatched). When the contraction is 1, mm is an outer product: ATen's
// rule makes it a bmm with k = 1, in which MKL's beta-scaling and packing
// passes cost 3-4x the products themselves (74 % of per-sample gradients
// through a linear layer, whose weight gradient is x^T . grad_out for one
// example). A broadcast multiply computes the same single rounded product per
// element. Every other mm, and every mm this cannot express exactly (mixed
// dtypes, which mm refuses; integer or non-strided tensors), goes on to ATen's
// rule unchanged.
at::Tensor mm_outer_product_under_vmap(c10::DispatchKeySet ks, const at::Tensor& self,
                                       const at::Tensor& mat2) {
  const bool outer_product =
      self.dim() == 2 && mat2.dim() == 2 && self.sym_size(1) == 1 && mat2.sym_size(0) == 1 &&
      self.scalar_type() == mat2.scalar_type() &&
      (at::isFloatingType(self.scalar_type()) || at::isComplexType(self.scalar_type())) &&
      self.layout() == at::kStrided && mat2.layout() == at::kStrided &&
      self.device() == mat2.device();
  if (outer_product) return at::mul(self, mat2);
  return at::_ops::mm::redispatch(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER,
                                                           c10::DispatchKey::FuncTorchVmapMode),
                                  self, mat2);
}

bool needs_derivative(const at::Tensor& t) {
  if (!t.defined()) return false;
  return (c10::GradMode::is_enabled() && t.requires_grad()) || t._fw_grad(/*level=*/0).defined();
}

// AutogradCPU kernel of mse_loss_backward. Its generated kernel's forward
// formula scales a ZeroTensor in place (the tangent of a target that has
// none) and throws; the primitive ops have correct forward and backward
// formulas. When no derivative is wanted (the ordinary backward pass) the
// fused kernel below autograd runs, as before.
at::Tensor mse_loss_backward_autograd(c10::DispatchKeySet ks, const at::Tensor& grad_output,
                                      const at::Tensor& self, const at::Tensor& target,
                                      int64_t reduction) {
  if (needs_derivative(grad_output) || needs_derivative(self) || needs_derivative(target)) {
    return mse_loss_backward_decomposed(grad_output, self, target, reduction);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return at::_ops::mse_loss_backward::redispatch(ks & c10::after_autograd_keyset, grad_output, self,
                                                 target, reduction);
}

// Forward-AD decompositions, in TorchScript as PyTorch registers them
// (torch/_decomp/decompositions.py; one function per op, same signature as
// the op's schema). Reduction.MEAN is 1.
constexpr const char* kJvpDecompositions = R"JIT(
def _log_softmax_backward_data(grad_output: Tensor, output: Tensor, dim: int, input_dtype: int):
    grad_input = grad_output - torch.exp(output) * torch.sum(grad_output, dim=dim, keepdim=True)
    return grad_input.to(input_dtype)

def _softmax_backward_data(grad_output: Tensor, output: Tensor, dim: int, input_dtype: int):
    new_grad = grad_output * output
    grad_input = new_grad - output * torch.sum(new_grad, dim=dim, keepdim=True)
    return grad_input.to(input_dtype)

def log_sigmoid_backward(grad_output: Tensor, self: Tensor, buffer: Tensor):
    max_deriv = (self < 0).to(self.dtype)
    sign = max_deriv * 2 - 1
    z = torch.exp(-torch.abs(self))
    return grad_output * (max_deriv - sign * (z / (1 + z)))

def huber_loss_backward(grad_output: Tensor, self: Tensor, target: Tensor, reduction: int, delta: float):
    norm = 1.0 / self.numel() if reduction == 1 else 1.0
    x = self - target
    return torch.where(x < -delta, -norm * grad_output * delta,
                       torch.where(x > delta, norm * grad_output * delta, norm * x * grad_output))

def nll_loss_backward(grad_output: Tensor, self: Tensor, target: Tensor, weight: Optional[Tensor], reduction: int, ignore_index: int, total_weight: Tensor):
    channel_dim = 0 if self.dim() < 2 else 1
    if reduction == 1:
        grad_output = grad_output / total_weight
    target = target.unsqueeze(channel_dim)
    safe_target = torch.where(target != ignore_index, target, 0)
    grad_input = torch.scatter(torch.zeros_like(self), channel_dim, safe_target, -1.0)
    if grad_input.dim() > grad_output.dim() and grad_output.dim() > 0:
        grad_output = grad_output.unsqueeze(channel_dim)
    if weight is not None:
        new_shape = [1 for _ in range(self.dim())]
        new_shape[channel_dim] = weight.shape[0]
        grad_output = grad_output * weight.reshape(new_shape)
    grad_output = torch.where(target != ignore_index, grad_output, 0.0)
    return grad_input * grad_output

def soft_margin_loss_backward(grad_output: Tensor, self: Tensor, target: Tensor, reduction: int):
    grad_input = target * grad_output / (torch.exp(target * self) + 1)
    if reduction == 1:
        grad_input = grad_input / self.numel()
    return -grad_input
)JIT";

void register_jvp_decompositions() {
  auto unit = torch::jit::compile(kJvpDecompositions);
  for (const char* name :
       {"_log_softmax_backward_data", "_softmax_backward_data", "log_sigmoid_backward",
        "huber_loss_backward", "soft_margin_loss_backward", "nll_loss_backward"}) {
    // The registry is keyed by the address of the dispatcher's own schema.
    const c10::FunctionSchema& schema =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow((std::string("aten::") + name).c_str(), "")
            .schema();
    if (torch::jit::has_jit_decomposition(schema)) continue;
    torch::jit::RegisterDecomposition(
        schema, torch::jit::toGraphFunction(unit->get_function(name)).graph()->copy());
  }
}

}  // namespace

void register_decompositions() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Libraries live for the whole process: the kernels stay registered.
    auto* batched = new torch::Library(torch::Library::IMPL, "aten",
                                       c10::DispatchKey::FuncTorchBatched, __FILE__, __LINE__);
    batched->impl("mse_loss_backward", TORCH_FN(mse_loss_backward_decomposed));
    batched->impl("addr", TORCH_FN(addr_decomposed));
    // Added to Python functorch's list after 1.13; registered here since
    // LibTorch 2.x (without them these ran as per-example loops).
    batched->impl("smooth_l1_loss_backward", TORCH_FN(smooth_l1_loss_backward_decomposed));
    batched->impl("huber_loss_backward", TORCH_FN(huber_loss_backward_decomposed));
    batched->impl("nll_loss_forward", TORCH_FN(nll_loss_forward_decomposed));
    batched->impl("nll_loss_backward", TORCH_FN(nll_loss_backward_decomposed));
    // Not an override: FuncTorchVmapMode has only a fallthrough for mm.
    auto* vmap_mode = new torch::Library(torch::Library::IMPL, "aten",
                                         c10::DispatchKey::FuncTorchVmapMode, __FILE__, __LINE__);
    vmap_mode->impl("mm", TORCH_FN(mm_outer_product_under_vmap));
    auto* autograd = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::AutogradCPU,
                                        __FILE__, __LINE__);
    autograd->impl("mse_loss_backward", TORCH_FN(mse_loss_backward_autograd));
    register_jvp_decompositions();
  });
}

}  // namespace internal
}  // namespace functorch
