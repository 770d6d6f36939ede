#include "trainer/models.h"

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/init.h>
#include <torch/utils.h>

#include "module_call/call.h"

namespace trainer {
namespace {

namespace F = torch::nn::functional;

// GPT-2's embedding init. LibTorch's default N(0, 1) would make the tied
// output projection produce logits of std ~sqrt(dim) at step 0.
constexpr double kEmbeddingStd = 0.02;

}  // namespace

torch::Tensor CausalMask(int64_t length, const torch::TensorOptions& options) {
  return torch::full({length, length}, -std::numeric_limits<float>::infinity(), options).triu(1);
}

TransformerBlockImpl::TransformerBlockImpl(int64_t dim, int64_t heads, AttentionKernel attention)
    : heads_(heads), attention_(attention) {
  ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
  attn_ = register_module(
      "attn", torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(dim, heads)));
  ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
  fc1_ = register_module("fc1", torch::nn::Linear(dim, 4 * dim));
  gelu_ = register_module("gelu", torch::nn::GELU());
  fc2_ = register_module("fc2", torch::nn::Linear(4 * dim, dim));
}

torch::Tensor TransformerBlockImpl::attend(const torch::Tensor& h,
                                           const torch::Tensor& causal_mask) {
  const int64_t batch = h.size(0), length = h.size(1), dim = h.size(2);
  TORCH_CHECK(causal_mask.defined() && causal_mask.dim() == 2 && causal_mask.size(0) == length &&
                  causal_mask.size(1) == length,
              "TransformerBlock: causal_mask ",
              causal_mask.defined() ? c10::str("of shape ", causal_mask.sizes()) : "undefined",
              ": expected CausalMask(", length, "), [", length, ", ", length, "]");
  if (attention_ == AttentionKernel::kMultiheadAttention) {
    // LibTorch's MultiheadAttention is sequence-first: [T, B, dim].
    torch::Tensor t = h.transpose(0, 1);
    return std::get<0>(attn_->forward(t, t, t, /*key_padding_mask=*/{}, /*need_weights=*/false,
                                      causal_mask))
        .transpose(0, 1);
  }
  // The same projections as MultiheadAttention (rows [0, dim) of
  // in_proj_weight give q, [dim, 2 dim) k, [2 dim, 3 dim) v), heads split
  // from dim; SDPA's default scale is MultiheadAttention's 1/sqrt(head_dim).
  const std::vector<torch::Tensor> qkv =
      F::linear(h, attn_->in_proj_weight, attn_->in_proj_bias).chunk(3, -1);
  auto heads_first = [&](const torch::Tensor& t) {
    return t.view({batch, length, heads_, dim / heads_}).transpose(1, 2);  // [B, H, T, hd]
  };
  torch::Tensor out = at::scaled_dot_product_attention(heads_first(qkv[0]), heads_first(qkv[1]),
                                                       heads_first(qkv[2]), /*attn_mask=*/{},
                                                       /*dropout_p=*/0.0, /*is_causal=*/true);
  return attn_->out_proj(out.transpose(1, 2).reshape({batch, length, dim}));
}

torch::Tensor TransformerBlockImpl::forward(const torch::Tensor& x,
                                            const torch::Tensor& causal_mask) {
  torch::Tensor y = x + attend(ln1_(x), causal_mask);
  return y + fc2_(gelu_(fc1_(ln2_(y))));
}

TransformerLM::TransformerLM(const ModelConfig& config) : config_(config) {
  tok_emb_ = register_module("tok_emb", torch::nn::Embedding(config.vocab, config.dim));
  pos_emb_ = register_module("pos_emb", torch::nn::Embedding(config.seq, config.dim));
  blocks_ = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.layers; ++i) {
    blocks_->push_back(TransformerBlock(config.dim, config.heads, config.attention));
  }
  ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.dim})));
  torch::NoGradGuard no_grad;
  torch::nn::init::normal_(tok_emb_->weight, 0.0, kEmbeddingStd);
  torch::nn::init::normal_(pos_emb_->weight, 0.0, kEmbeddingStd);
}

void TransformerLM::set_block_runner(BlockRunner runner) { block_runner_ = std::move(runner); }

torch::Tensor TransformerLM::forward(const torch::Tensor& tokens) {
  const int64_t length = tokens.size(1);
  TORCH_CHECK(length <= config_.seq, "TransformerLM: sequence of ", length,
              " tokens, expected at most seq=", config_.seq);
  torch::Tensor positions = torch::arange(length, tokens.options());
  torch::Tensor x = tok_emb_(tokens) + pos_emb_(positions);
  const torch::Tensor mask = CausalMask(length, x.options());
  // The single call site of the blocks (see set_block_runner).
  for (size_t i = 0; i < blocks_->size(); ++i) {
    TransformerBlock block = blocks_->ptr<TransformerBlockImpl>(i);
    x = block_runner_ ? block_runner_(static_cast<int64_t>(i), block, x, mask)
                      : module_call::call(block, x, mask);
  }
  // Tied output projection: the logits reuse the token embedding's tensor
  // (no second parameter exists, so the state dict has it once).
  return F::linear(ln_f_(x), tok_emb_->weight);
}

std::vector<std::shared_ptr<torch::nn::Module>> TransformerLM::DecoderLayers() {
  std::vector<std::shared_ptr<torch::nn::Module>> layers;
  for (size_t i = 0; i < blocks_->size(); ++i) layers.push_back(blocks_->ptr(i));
  return layers;
}

torch::Tensor TransformerLM::Loss(const torch::Tensor& batch) {
  const int64_t length = batch.size(1) - 1;
  torch::Tensor logits = forward(batch.narrow(1, 0, length));
  torch::Tensor targets = batch.narrow(1, 1, length);
  return F::cross_entropy(logits.reshape({-1, config_.vocab}), targets.reshape({-1}));
}

MlpLM::MlpLM(const ModelConfig& config) : config_(config) {
  // A narrow per-byte embedding keeps the first layer (seq * width inputs)
  // small; dim is the hidden width.
  const int64_t width = std::max<int64_t>(1, config.dim / 4);
  emb_ = register_module("emb", torch::nn::Embedding(config.vocab, width));
  fc1_ = register_module("fc1", torch::nn::Linear(config.seq * width, config.dim));
  gelu_ = register_module("gelu", torch::nn::GELU());
  fc2_ = register_module("fc2", torch::nn::Linear(config.dim, config.vocab));
}

torch::Tensor MlpLM::forward(const torch::Tensor& window) {
  TORCH_CHECK(window.size(1) == config_.seq, "MlpLM: window of ", window.size(1),
              " tokens, expected seq=", config_.seq);
  return fc2_(gelu_(fc1_(emb_(window).flatten(1))));
}

torch::Tensor MlpLM::Loss(const torch::Tensor& batch) {
  torch::Tensor logits = forward(batch.narrow(1, 0, config_.seq));
  return F::cross_entropy(logits, batch.select(1, config_.seq));
}

std::shared_ptr<LanguageModel> BuildModel(ModelType type, const ModelConfig& config,
                                          uint64_t seed) {
  torch::manual_seed(seed);
  if (type == ModelType::kMlp) return std::make_shared<MlpLM>(config);
  return std::make_shared<TransformerLM>(config);
}

}  // namespace trainer
