// The models the trainer trains, built from stock LibTorch modules only.
//
// Both are byte-level language models over a batch of token rows
// [B, seq + 1] (data.h):
//
//   TransformerLM  decoder-only: token + learned position embeddings, N
//                  pre-LayerNorm blocks (causal self-attention, then
//                  Linear-GELU-Linear), a final LayerNorm and an output
//                  projection TIED to the token embedding (one tensor; its
//                  gradient is the sum of both uses). Predicts token t+1 from
//                  tokens <= t at every position: seq predictions per row.
//   MlpLM          predicts the last token of a row from the `seq` bytes
//                  before it: the window's embeddings, concatenated,
//                  through Linear-GELU-Linear to vocab logits. One
//                  prediction per row.
//
// Initialisation is a function of the seed alone (BuildModel seeds LibTorch's
// generator), so every rank builds identical replicas.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "models/causal_lm.h"

namespace trainer {

// How a TransformerBlock computes its causal self-attention. Both use the
// same parameters (nn::MultiheadAttention's in_proj_weight, in_proj_bias,
// out_proj.weight, out_proj.bias) and compute the same function.
enum class AttentionKernel {
  // at::scaled_dot_product_attention(q, k, v, {}, 0, is_causal=true): flash
  // or memory-efficient kernels on CUDA, the fused CPU kernel on CPU; no
  // B*H*T*T scores are kept for backward. What Python's
  // nn.MultiheadAttention(need_weights=False) dispatches to.
  kSdpa,
  // LibTorch's nn::MultiheadAttention::forward with CausalMask: bmm +
  // softmax + bmm, the attention weights (B*H*T*T) kept for backward. The
  // trainer's attention before issue 36; kept to measure against.
  kMultiheadAttention,
};

struct ModelConfig {
  int64_t layers = 2;
  int64_t dim = 64;
  int64_t heads = 4;
  int64_t vocab = 256;
  int64_t seq = 64;
  AttentionKernel attention = AttentionKernel::kSdpa;
};

// A model the training loop can drive without knowing which one it is: the
// interface every model of models/ implements (Loss, DecoderLayers).
using LanguageModel = models::CausalLM;

// One pre-LayerNorm decoder block: x + attn(ln1(x)), then + mlp(ln2(x)).
// Its own module type so FSDP's auto-wrap policy can wrap each block.
class TransformerBlockImpl : public torch::nn::Module {
 public:
  TransformerBlockImpl(int64_t dim, int64_t heads,
                       AttentionKernel attention = AttentionKernel::kSdpa);
  // x: [B, T, dim]; causal_mask: CausalMask(T) ([T, T] float, -inf above
  // the diagonal). kMultiheadAttention adds it to the scores; kSdpa takes it
  // as PyTorch's is_causal hint (nn.MultiheadAttention's is_causal=True):
  // it checks the shape and attends causally with SDPA's is_causal=true,
  // which needs no mask, so the flash / memory-efficient kernels apply.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& causal_mask);

 private:
  // Self-attention of h: [B, T, dim] -> [B, T, dim].
  torch::Tensor attend(const torch::Tensor& h, const torch::Tensor& causal_mask);

  int64_t heads_;
  AttentionKernel attention_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::MultiheadAttention attn_{nullptr};
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr};
  torch::nn::GELU gelu_{nullptr};
};
TORCH_MODULE(TransformerBlock);

class TransformerLM : public LanguageModel {
 public:
  explicit TransformerLM(const ModelConfig& config);

  // tokens: int64 [B, T] with T <= seq. Returns logits [B, T, vocab].
  torch::Tensor forward(const torch::Tensor& tokens);
  torch::Tensor Loss(const torch::Tensor& batch) override;
  // The blocks, in order.
  std::vector<std::shared_ptr<torch::nn::Module>> DecoderLayers() override;

  // How forward() runs block `index` on its input. The default calls the
  // block through module_call::call (the call point FSDP and activation
  // checkpointing hook). This is the ONE place blocks are called from, so a
  // wrapper that must act around each nested unit (FSDP's all-gather before
  // and reshard after a block) installs its runner here instead of patching
  // forward().
  using BlockRunner =
      std::function<torch::Tensor(int64_t index, TransformerBlock& block, const torch::Tensor& x,
                                  const torch::Tensor& causal_mask)>;
  void set_block_runner(BlockRunner runner);

  torch::nn::ModuleList& blocks() { return blocks_; }
  // The token embedding, which is also the output projection.
  torch::nn::Embedding token_embedding() const { return tok_emb_; }

 private:
  ModelConfig config_;
  torch::nn::Embedding tok_emb_{nullptr}, pos_emb_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::LayerNorm ln_f_{nullptr};
  BlockRunner block_runner_;
};

class MlpLM : public LanguageModel {
 public:
  explicit MlpLM(const ModelConfig& config);

  // window: int64 [B, seq]. Returns logits [B, vocab] for the next token.
  torch::Tensor forward(const torch::Tensor& window);
  torch::Tensor Loss(const torch::Tensor& batch) override;
  // None: the MLP has no decoder layers (FSDP's root unit holds it all).
  std::vector<std::shared_ptr<torch::nn::Module>> DecoderLayers() override { return {}; }

 private:
  ModelConfig config_;
  torch::nn::Embedding emb_{nullptr};
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr};
  torch::nn::GELU gelu_{nullptr};
};

enum class ModelType { kMlp, kTransformer };

// Seeds LibTorch's default generator with `seed`, then builds the model, so
// the initial parameters depend on (type, config, seed) only.
std::shared_ptr<LanguageModel> BuildModel(ModelType type, const ModelConfig& config, uint64_t seed);

// [T, T] float mask for nn::MultiheadAttention: 0 where key <= query, -inf
// where key > query, so position t never sees later positions (the
// semantics of SDPA's is_causal=true), made where `options` say (float
// unless they name another floating dtype). Made on the device rather than
// copied there: a copy from pageable CPU memory would make every forward
// wait for the GPU.
torch::Tensor CausalMask(int64_t length, const torch::TensorOptions& options = {});

}  // namespace trainer
