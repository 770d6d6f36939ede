#include "kernels/linear_cross_entropy.h"

#include "kernels/cpu_matmul.h"

#include <algorithm>

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_assert_async.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

namespace kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// float32 for bfloat16, float16 and float32 inputs; float64 stays float64.
at::ScalarType AccumulationType(const at::Tensor& hidden) {
  return hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// The chunk's logits hidden[rows] @ weight.T, in the accumulation dtype: the
// GEMM in the inputs' dtype, then the upcast (transformers' order).
at::Tensor ChunkLogits(const at::Tensor& hidden_rows, const at::Tensor& weight,
                       at::ScalarType acc) {
  return Mm(hidden_rows, weight.t()).to(acc);
}

struct LinearCrossEntropyFunction : torch::autograd::Function<LinearCrossEntropyFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& targets, int64_t chunk,
                            int64_t ignore_index) {
    const int64_t rows = hidden.size(0);
    const int64_t vocab = weight.size(0);
    const at::ScalarType acc = AccumulationType(hidden);
    const at::TensorOptions acc_options = hidden.options().dtype(acc);
    const at::Tensor valid = targets != ignore_index;
    // Checked on the device: no host synchronisation on CUDA.
    at::_assert_async(
        ((targets >= 0).logical_and(targets < vocab)).logical_or(valid.logical_not()).all(),
        "kernels::LinearCrossEntropy: a target is outside [0, V) and is not "
        "ignore_index");
    const at::Tensor safe_targets = at::where(valid, targets, 0);
    at::Tensor logsumexp = at::empty({rows}, acc_options);
    at::Tensor loss_sum = at::zeros({}, acc_options);
    for (int64_t start = 0; start < rows; start += chunk) {
      const int64_t n = std::min(chunk, rows - start);
      at::Tensor logits = ChunkLogits(hidden.narrow(0, start, n), weight, acc);
      const at::Tensor target_logit =
          logits.gather(1, safe_targets.narrow(0, start, n).unsqueeze(1)).squeeze(1);
      // logsumexp in place: max, then log(sum(exp(logits - max))) + max.
      const at::Tensor max = std::get<0>(logits.max(1, /*keepdim=*/true));
      logits.sub_(max).exp_();
      const at::Tensor lse = logits.sum(1).log_().add_(max.squeeze(1));
      logits.reset();
      logsumexp.narrow(0, start, n).copy_(lse);
      loss_sum.add_(((lse - target_logit) * valid.narrow(0, start, n)).sum());
    }
    const at::Tensor count = valid.sum();
    ctx->save_for_backward({hidden, weight, targets, logsumexp, count});
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["ignore_index"] = ignore_index;
    // 0 / 0 = NaN when every target is ignored, as PyTorch's mean.
    return loss_sum / count;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "kernels::LinearCrossEntropy: backward with create_graph=true (double "
                "backward) is not supported: its backward is computed once, chunk by chunk; "
                "use kernels::reference::LinearCrossEntropy for higher-order gradients");
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& hidden = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& targets = saved[2];
    const at::Tensor& logsumexp = saved[3];
    const at::Tensor& count = saved[4];
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    const bool need_hidden = ctx->needs_input_grad(0);
    const bool need_weight = ctx->needs_input_grad(1);
    if (!need_hidden && !need_weight) return {at::Tensor(), at::Tensor(), {}, {}, {}};

    const int64_t rows = hidden.size(0);
    const int64_t vocab = weight.size(0);
    const int64_t width = hidden.size(1);
    const at::ScalarType acc = AccumulationType(hidden);
    const bool acc_is_input_dtype = hidden.scalar_type() == acc;
    const at::Tensor valid = targets != ignore_index;
    const at::Tensor safe_targets = at::where(valid, targets, 0);
    // d loss / d logit = (softmax - onehot(target)) * grad / count on the
    // valid rows; count >= 1 there (all rows ignored: every factor is 0).
    const at::Tensor scale = grads[0].to(acc) / count.clamp_min(1).to(acc);
    const at::Tensor row_factor = valid.to(acc) * scale;

    at::Tensor grad_hidden = need_hidden ? at::empty_like(hidden) : at::Tensor();
    // grad_weight, summed over chunks in the accumulation dtype.
    at::Tensor grad_weight_acc =
        need_weight ? at::zeros({vocab, width}, weight.options().dtype(acc)) : at::Tensor();
    for (int64_t start = 0; start < rows; start += chunk) {
      const int64_t n = std::min(chunk, rows - start);
      const at::Tensor hidden_rows = hidden.narrow(0, start, n);
      at::Tensor g = ChunkLogits(hidden_rows, weight, acc);
      g.sub_(logsumexp.narrow(0, start, n).unsqueeze(1)).exp_();
      const at::Tensor factor = row_factor.narrow(0, start, n).unsqueeze(1);
      g.scatter_add_(1, safe_targets.narrow(0, start, n).unsqueeze(1),
                     -valid.narrow(0, start, n).to(acc).unsqueeze(1));
      g.mul_(factor);
      at::Tensor grad_hidden_rows = need_hidden ? grad_hidden.narrow(0, start, n) : at::Tensor();
      if (acc_is_input_dtype) {
        if (need_hidden) MmOut(grad_hidden_rows, g, weight);
        if (need_weight) AddMmInPlace(grad_weight_acc, g.t(), hidden_rows);
        continue;
      }
      const at::Tensor g_in = g.to(hidden.scalar_type());
      g.reset();
      if (need_hidden) at::mm_out(grad_hidden_rows, g_in, weight);
      if (!need_weight) continue;
      // The GEMM in the input dtype (tensor cores on a GPU; ATen's addmm
      // cannot add a bf16 product into a float32 sum), a block of
      // vocabulary rows at a time so that the temporary is no larger than
      // the chunk's logits, then added into the float32 sum.
      const int64_t block = std::clamp<int64_t>(n * vocab / std::max<int64_t>(width, 1), 1, vocab);
      for (int64_t v = 0; v < vocab; v += block) {
        const int64_t b = std::min(block, vocab - v);
        grad_weight_acc.narrow(0, v, b).add_(at::mm(g_in.narrow(1, v, b).t(), hidden_rows));
      }
    }
    at::Tensor grad_weight;
    if (need_weight) {
      grad_weight = acc_is_input_dtype ? grad_weight_acc : grad_weight_acc.to(weight.scalar_type());
    }
    return {grad_hidden, grad_weight, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor LinearCrossEntropy(const at::Tensor& hidden, const at::Tensor& weight,
                              const at::Tensor& targets, int64_t chunk, int64_t ignore_index) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
              "kernels::LinearCrossEntropy: hidden of shape ", hidden.sizes(),
              " and weight of shape ", weight.sizes(), ": expected [N, H] and [V, H]");
  TORCH_CHECK(hidden.is_floating_point() && weight.scalar_type() == hidden.scalar_type(),
              "kernels::LinearCrossEntropy: hidden of dtype ", hidden.scalar_type(),
              " and weight of dtype ", weight.scalar_type(), ": expected one floating dtype");
  TORCH_CHECK(
      targets.dim() == 1 && targets.size(0) == hidden.size(0) && targets.scalar_type() == at::kLong,
      "kernels::LinearCrossEntropy: targets of shape ", targets.sizes(), " and dtype ",
      targets.scalar_type(), ": expected int64 [", hidden.size(0), "] (one per row)");
  TORCH_CHECK(weight.device() == hidden.device() && targets.device() == hidden.device(),
              "kernels::LinearCrossEntropy: hidden on ", hidden.device(), ", weight on ",
              weight.device(), ", targets on ", targets.device(), ": expected one device");
  TORCH_CHECK(chunk >= 1, "kernels::LinearCrossEntropy: chunk=", chunk,
              ": expected >= 1 rows per chunk");
  return LinearCrossEntropyFunction::apply(hidden, weight, targets, chunk, ignore_index);
}

}  // namespace kernels
