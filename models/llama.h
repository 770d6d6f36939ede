// The Llama-family decoder as transformers computes it (LlamaForCausalLM,
// MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM), with
// transformers' parameter names, so that its state dict is the checkpoint's:
//
//   model.embed_tokens.weight
//   model.layers.<i>.input_layernorm.weight
//   model.layers.<i>.self_attn.{q,k,v,o}_proj.{weight,bias}   (biases per config)
//   model.layers.<i>.self_attn.{q,k}_norm.weight                (Qwen3)
//   model.layers.<i>.post_attention_layernorm.weight
//   model.layers.<i>.mlp.{gate,up,down}_proj.{weight,bias}
//   model.norm.weight
//   lm_head.weight                                   (absent when tied)
//
//   auto config = models::ReadLlamaConfig("checkpoint/config.json");
//   models::LlamaForCausalLM model(*config);
//   model->InitializeWeights(/*seed=*/0);        // or load a checkpoint
//   torch::Tensor logits = model->forward(input_ids);  // [B, T, vocab]
//
// Incremental decoding (generation.h): ForwardCached runs a step's tokens
// against a KvCache (kv_cache.h) of the keys and values before them, with
// left padding masked; forward, the training path, is unchanged.
//
// Per layer: x + o_proj(attention(RoPE(q), RoPE(k), v)) over
// input_layernorm(x), then + down_proj(silu(gate_proj(h)) * up_proj(h)) over
// post_attention_layernorm. RMSNorm in float32 with eps inside the square
// root, cast back, then scaled by its weight; RoPE tables in float32, cast to
// the activations' dtype; grouped-query attention through
// scaled_dot_product_attention (causal, scale 1/sqrt(head_dim)), query head
// h reading key/value head h / (heads / kv_heads) as transformers' repeat_kv;
// the embedding's pad_token_id row gets no gradient (nn.Embedding's
// padding_idx). The RoPE tables are not parameters or buffers: nothing of
// them is saved.
//
// Each decoder layer is called through module_call::call, so FSDP units and
// activation checkpointing apply to it (CausalLM::DecoderLayers). CPU and
// CUDA, float32, bfloat16 and float16 (model->to(device, dtype)).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <memory>
#include <tuple>
#include <vector>

#include <c10/core/Device.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include "models/causal_lm.h"
#include "models/kv_cache.h"
#include "models/llama_config.h"

namespace models {

// nn.Linear with transformers' parameter names (weight [out, in], bias
// [out]), made on `device` uninitialised: LibTorch's Linear draws kaiming
// values on the CPU first (for a 1B model, 1.2 billion random numbers that
// the checkpoint then overwrites, and nothing at all can be made on the meta
// device that way). LlamaForCausalLM initialises its parameters itself.
//
// `matmul` is how forward computes x W^T + b: at::linear unless something
// outside the model replaced it (the trainer's --float8 sets
// kernels::Float8Linear on the decoder layers' projections, as TorchTitan's
// converters swap nn.Linear); the parameters and their names stay, so
// checkpoints and FSDP see the same module.
class LlamaLinearImpl : public torch::nn::Module {
 public:
  using Matmul = std::function<torch::Tensor(const torch::Tensor& x, const torch::Tensor& weight,
                                             const torch::Tensor& bias)>;
  LlamaLinearImpl(int64_t in, int64_t out, bool bias, c10::Device device);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias;  // bias undefined without one
  Matmul matmul;               // empty: at::linear
};
TORCH_MODULE(LlamaLinear);

// nn.Embedding(vocab, hidden, padding_idx): the padding row gets no
// gradient. Made uninitialised, as LlamaLinear.
class LlamaEmbeddingImpl : public torch::nn::Module {
 public:
  LlamaEmbeddingImpl(int64_t vocab, int64_t hidden, std::optional<int64_t> padding_idx,
                     c10::Device device);
  torch::Tensor forward(const torch::Tensor& ids);
  torch::Tensor weight;
  const std::optional<int64_t>& padding_idx() const { return padding_idx_; }

 private:
  std::optional<int64_t> padding_idx_;
};
TORCH_MODULE(LlamaEmbedding);

// transformers' LlamaRMSNorm: weight * (x / sqrt(mean(x^2) + eps)), the
// normalisation in float32 and its result cast back to x's dtype before the
// weight multiplies it. The weight starts at one.
class LlamaRMSNormImpl : public torch::nn::Module {
 public:
  LlamaRMSNormImpl(int64_t size, double eps, c10::Device device = c10::kCPU);
  torch::Tensor forward(const torch::Tensor& x);
  double eps() const { return eps_; }
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(LlamaRMSNorm);

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  LlamaAttentionImpl(const LlamaConfig& config, c10::Device device);
  // x: [B, T, hidden]; cos, sin: [T, head_dim] or [B, T, head_dim] in x's
  // dtype. Causal over the T positions.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  // Incremental decoding (LlamaModel::ForwardCached): x's keys and values
  // are written to `cache` (layer `layer`) and the queries attend over every
  // slot so far, as `mask` (bool [B, 1, T, slots] or [T, slots], true:
  // attend) allows; an undefined mask: causal from slot 0 (T == 1, or the
  // first T slots); without a cache, over x's own positions. cos, sin:
  // [T, head_dim] or [B, T, head_dim].
  torch::Tensor ForwardCached(const torch::Tensor& x, const torch::Tensor& cos,
                              const torch::Tensor& sin, const torch::Tensor& mask, KvCache* cache,
                              int64_t layer);

  LlamaLinear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  LlamaRMSNorm q_norm{nullptr}, k_norm{nullptr};  // Qwen3 only

 private:
  // q [B, heads, T, d], k and v [B, kv_heads, T, d], RoPE applied to q and k.
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> Project(const torch::Tensor& x,
                                                                  const torch::Tensor& cos,
                                                                  const torch::Tensor& sin);

  int64_t heads_, kv_heads_, head_dim_;
};
TORCH_MODULE(LlamaAttention);

class LlamaMLPImpl : public torch::nn::Module {
 public:
  LlamaMLPImpl(const LlamaConfig& config, c10::Device device);
  torch::Tensor forward(const torch::Tensor& x);

  LlamaLinear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMLP);

class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  LlamaDecoderLayerImpl(const LlamaConfig& config, c10::Device device);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  // forward with LlamaAttention::ForwardCached.
  torch::Tensor ForwardCached(const torch::Tensor& x, const torch::Tensor& cos,
                              const torch::Tensor& sin, const torch::Tensor& mask, KvCache* cache,
                              int64_t layer);

  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
  LlamaRMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

// transformers' LlamaModel: the embedding, the layers and the final norm
// (registered as "model" in LlamaForCausalLM).
class LlamaModelImpl : public torch::nn::Module {
 public:
  // `device`: LlamaForCausalLM's.
  explicit LlamaModelImpl(const LlamaConfig& config, c10::Device device = c10::kCPU);
  // input_ids: int64 [B, T]. The last hidden state after the final norm,
  // [B, T, hidden].
  torch::Tensor forward(const torch::Tensor& input_ids);
  // Incremental decoding. input_ids: int64 [B, T], the tokens after those
  // already in `cache` (all of a prompt, then one per step); `mask`: bool or
  // integer [B, T], nonzero for real tokens and zero for (left) padding,
  // undefined for all real. Each real token is at RoPE position "real tokens
  // before it in its row" and attends causally to its row's real tokens (a
  // padding token attends to itself only, so that nothing is a softmax over
  // nothing). The step's keys and values are appended to `cache`; with a
  // null cache the T positions attend among themselves (a whole sequence
  // recomputed: --no-cache). Returns the final hidden states [B, T, hidden].
  // Sequences in one row longer than a config's sliding_window are refused,
  // as in forward.
  torch::Tensor ForwardCached(const torch::Tensor& input_ids, const torch::Tensor& mask,
                              KvCache* cache);

  LlamaEmbedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  LlamaRMSNorm norm{nullptr};

  // float32 [head_dim / 2] (RopeInverseFrequencies of the config), on the
  // CPU; not a buffer. Replaceable (e.g. to test a different scaling).
  torch::Tensor inv_freq;

 private:
  // cos and sin for positions [0, length) on `device` in `dtype`, made once
  // per (device, dtype, length) and kept.
  std::pair<torch::Tensor, torch::Tensor> RopeTables(int64_t length, c10::Device device,
                                                     c10::ScalarType dtype);

  LlamaConfig config_;
  torch::Tensor cached_inv_freq_;
  std::map<std::tuple<std::string, int, int64_t>, std::pair<torch::Tensor, torch::Tensor>>
      rope_tables_;
};
TORCH_MODULE(LlamaModel);

class LlamaForCausalLMImpl : public CausalLM {
 public:
  // The parameters made on `device` and initialised as InitializeWeights(
  // init_seed) does (none: left uninitialised, for a caller that loads a
  // checkpoint next). On the meta device (c10::kMeta) nothing is allocated
  // or initialised: a model too large for one rank's memory is sharded first
  // (fsdp), then each rank fills only its shards (a checkpoint's, or
  // InitialLlamaParameter's).
  explicit LlamaForCausalLMImpl(const LlamaConfig& config, c10::Device device = c10::kCPU,
                                std::optional<uint64_t> init_seed = 0);

  // input_ids: int64 [B, T]. Logits [B, T, vocab] in the parameters' dtype.
  torch::Tensor forward(const torch::Tensor& input_ids);
  // LlamaModel::ForwardCached's hidden states through the output
  // projection: logits [B, T, vocab], or [B, 1, vocab] of the last position
  // only with `last_only` (a prompt's step needs no more).
  torch::Tensor ForwardCached(const torch::Tensor& input_ids, const torch::Tensor& mask,
                              KvCache* cache, bool last_only = false);
  // CausalLM: cross-entropy of forward(batch[:, :-1]) against batch[:, 1:],
  // the logits upcast to float32 (transformers' ForCausalLMLoss).
  torch::Tensor Loss(const torch::Tensor& batch) override;
  std::vector<std::shared_ptr<torch::nn::Module>> DecoderLayers() override;

  // transformers' _init_weights from `seed`: every Linear and the embedding
  // N(0, initializer_range) (biases and the pad_token_id row zero), every
  // RMSNorm weight one. Each parameter is InitialLlamaParameter(config(),
  // name, shape, seed): the same on every rank and machine whatever the
  // order, the world size or the device.
  void InitializeWeights(uint64_t seed);
  const LlamaConfig& config() const { return config_; }
  // The output projection's weight: lm_head's, or the embedding's when tied.
  torch::Tensor output_weight() const;

  LlamaModel model{nullptr};
  LlamaLinear lm_head{nullptr};  // null when tie_word_embeddings

 private:
  LlamaConfig config_;
};
TORCH_MODULE(LlamaForCausalLM);

// The initial value InitializeWeights gives parameter `name` (a
// LlamaForCausalLM parameter name) of `shape` (its whole shape), float32 on
// the CPU: N(0, initializer_range) from a CPU generator seeded with `seed`
// and the name alone (the pad_token_id row of the embedding zero), zeros for
// a bias, ones for a norm's weight. One tensor can be made without the
// others: a rank filling only its shards of a model built on the meta device
// makes them one at a time.
torch::Tensor InitialLlamaParameter(const LlamaConfig& config, const std::string& name,
                                    at::IntArrayRef shape, uint64_t seed);

}  // namespace models
