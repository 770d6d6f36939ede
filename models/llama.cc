#include "models/llama.h"

#include "kernels/linear.h"
#include "kernels/linear_cross_entropy.h"
#include "kernels/rms_norm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/InferenceMode.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/linear.h>
#include <ATen/ops/embedding.h>
#include <torch/nn/functional/loss.h>
#include <torch/utils.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "functorch/module/named_member_accessor.h"
#include "module_call/call.h"
#include "models/rope.h"

namespace models {
namespace {

namespace F = torch::nn::functional;

// Rows of the loss's logits made at a time: 4096 x 128,256 float32 logits
// are 2.1 GB; kernels/linear_cross_entropy.h on why larger chunks pay.
constexpr int64_t kLossChunkRows = 4096;

// FNV-1a: a hash of a parameter's name that every machine computes alike
// (std::hash need not).
uint64_t StableHash(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return h;
}

void ThrowIfInvalid(const LlamaConfig& config) {
  const absl::Status status = ValidateLlamaConfig(config, "models::LlamaConfig");
  TORCH_CHECK(status.ok(), std::string(status.message()));
}

}  // namespace

// LlamaRMSNorm's forward reads its `weight` member: FSDP (and
// functional_call) reach it there when they swap the parameter for a view
// of a shard or a gathered tensor. Linear and Embedding, LibTorch's own, are
// bound by functorch/module.
static const bool kRmsNormBound =
    functorch::RegisterModuleMembers<LlamaRMSNormImpl>({{"weight", &LlamaRMSNormImpl::weight}});
static const bool kLinearBound = functorch::RegisterModuleMembers<LlamaLinearImpl>(
    {{"weight", &LlamaLinearImpl::weight}, {"bias", &LlamaLinearImpl::bias}});
static const bool kEmbeddingBound =
    functorch::RegisterModuleMembers<LlamaEmbeddingImpl>({{"weight", &LlamaEmbeddingImpl::weight}});

LlamaLinearImpl::LlamaLinearImpl(int64_t in, int64_t out, bool with_bias, c10::Device device) {
  const auto options = torch::TensorOptions().device(device);
  weight = register_parameter("weight", torch::empty({out, in}, options));
  if (with_bias) bias = register_parameter("bias", torch::empty({out}, options));
}

torch::Tensor LlamaLinearImpl::forward(const torch::Tensor& x) {
  // kernels::Linear: at::linear, with the CPU's float32 products through
  // oneDNN and a decode step's rows at memory speed (kernels/linear.h).
  return matmul ? matmul(x, weight, bias) : kernels::Linear(x, weight, bias);
}

LlamaEmbeddingImpl::LlamaEmbeddingImpl(int64_t vocab, int64_t hidden,
                                       std::optional<int64_t> padding_idx, c10::Device device)
    : padding_idx_(padding_idx) {
  weight = register_parameter("weight",
                              torch::empty({vocab, hidden}, torch::TensorOptions().device(device)));
}

torch::Tensor LlamaEmbeddingImpl::forward(const torch::Tensor& ids) {
  return at::embedding(weight, ids, padding_idx_.value_or(-1));
}

LlamaRMSNormImpl::LlamaRMSNormImpl(int64_t size, double eps, c10::Device device) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({size}, torch::TensorOptions().device(device)));
}

// The fused ops of kernels/ (one CUDA kernel each on CUDA tensors; on the
// CPU their ATen references, transformers' formulas) in place of the
// composites: the step's elementwise work, casts and float32 logits are
// what the profile of a 1B step put beside its GEMMs (benchmarks/
// RESULTS.md, 2026-11-28).
torch::Tensor LlamaRMSNormImpl::forward(const torch::Tensor& x) {
  return kernels::RmsNorm(x, weight, eps_);
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& c, c10::Device device)
    : heads_(c.num_attention_heads), kv_heads_(c.num_key_value_heads), head_dim_(c.head_dim) {
  auto linear = [&](int64_t in, int64_t out, bool bias) {
    return LlamaLinear(in, out, bias, device);
  };
  q_proj = register_module("q_proj", linear(c.hidden_size, heads_ * head_dim_, c.qkv_bias));
  k_proj = register_module("k_proj", linear(c.hidden_size, kv_heads_ * head_dim_, c.qkv_bias));
  v_proj = register_module("v_proj", linear(c.hidden_size, kv_heads_ * head_dim_, c.qkv_bias));
  o_proj = register_module("o_proj", linear(heads_ * head_dim_, c.hidden_size, c.o_proj_bias));
  if (c.qk_norm) {
    q_norm = register_module("q_norm", LlamaRMSNorm(head_dim_, c.rms_norm_eps, device));
    k_norm = register_module("k_norm", LlamaRMSNorm(head_dim_, c.rms_norm_eps, device));
  }
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> LlamaAttentionImpl::Project(
    const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t batch = x.size(0), length = x.size(1);
  // [B, T, heads * d] -> [B, T, heads, d]; Qwen3 normalises each head here,
  // before RoPE; then heads first, [B, heads, T, d].
  auto heads = [&](const torch::Tensor& t, int64_t n, LlamaRMSNorm& norm) {
    torch::Tensor h = t.view({batch, length, n, head_dim_});
    if (!norm.is_empty()) h = norm(h);
    return h.transpose(1, 2);
  };
  LlamaRMSNorm none{nullptr};
  auto [q, k] = kernels::ApplyRopeQK(heads(q_proj(x), heads_, q_norm),
                                     heads(k_proj(x), kv_heads_, k_norm), cos, sin);
  return {std::move(q), std::move(k), heads(v_proj(x), kv_heads_, none)};
}

torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                          const torch::Tensor& sin) {
  const int64_t batch = x.size(0), length = x.size(1);
  const auto [q, k, v] = Project(x, cos, sin);
  // enable_gqa: query head h attends with key/value head h / (heads /
  // kv_heads), transformers' repeat_kv (repeat_interleave), without copies
  // of k and v where the kernel supports it.
  const torch::Tensor out = at::scaled_dot_product_attention(
      q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true, /*scale=*/std::nullopt,
      /*enable_gqa=*/kv_heads_ != heads_);
  return o_proj(out.transpose(1, 2).reshape({batch, length, heads_ * head_dim_}));
}

torch::Tensor LlamaAttentionImpl::ForwardCached(const torch::Tensor& x, const torch::Tensor& cos,
                                                const torch::Tensor& sin, const torch::Tensor& mask,
                                                KvCache* cache, int64_t layer) {
  const int64_t batch = x.size(0), length = x.size(1);
  auto [q, k, v] = Project(x, cos, sin);
  if (cache != nullptr) {
    cache->Write(layer, k, v);
    const int64_t slots = cache->length() + length;
    k = cache->keys(layer).narrow(2, 0, slots);
    v = cache->values(layer).narrow(2, 0, slots);
  }
  bool gqa = kv_heads_ != heads_;
  if (gqa && mask.defined() && !x.device().is_cpu()) {
    // With a mask, CUDA's flash kernel is out and the memory-efficient one
    // takes no enable_gqa, so SDPA would fall back to the math kernel:
    // repeated heads (transformers' repeat_kv) keep the fused kernel. The
    // CPU kernel takes a mask with enable_gqa (no copies).
    k = k.repeat_interleave(heads_ / kv_heads_, 1);
    v = v.repeat_interleave(heads_ / kv_heads_, 1);
    gqa = false;
  }
  const torch::Tensor out = at::scaled_dot_product_attention(
      q, k, v, mask.defined() ? std::optional<torch::Tensor>(mask) : std::nullopt,
      /*dropout_p=*/0.0, /*is_causal=*/!mask.defined() && length > 1,
      /*scale=*/std::nullopt, gqa);
  return o_proj(out.transpose(1, 2).reshape({batch, length, heads_ * head_dim_}));
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& c, c10::Device device) {
  auto linear = [&](int64_t in, int64_t out) { return LlamaLinear(in, out, c.mlp_bias, device); };
  gate_proj = register_module("gate_proj", linear(c.hidden_size, c.intermediate_size));
  up_proj = register_module("up_proj", linear(c.hidden_size, c.intermediate_size));
  down_proj = register_module("down_proj", linear(c.intermediate_size, c.hidden_size));
}

torch::Tensor LlamaMLPImpl::forward(const torch::Tensor& x) {
  return down_proj(kernels::SwiGlu(gate_proj(x), up_proj(x)));  // silu(gate) * up
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& c, c10::Device device) {
  self_attn = register_module("self_attn", LlamaAttention(c, device));
  mlp = register_module("mlp", LlamaMLP(c, device));
  input_layernorm =
      register_module("input_layernorm", LlamaRMSNorm(c.hidden_size, c.rms_norm_eps, device));
  post_attention_layernorm = register_module("post_attention_layernorm",
                                             LlamaRMSNorm(c.hidden_size, c.rms_norm_eps, device));
}

torch::Tensor LlamaDecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                             const torch::Tensor& sin) {
  // h = x + attention, and the MLP's input norm(h), from one pass.
  const auto [normed, h] =
      kernels::AddRmsNorm(x, self_attn(input_layernorm(x), cos, sin),
                          post_attention_layernorm->weight, post_attention_layernorm->eps());
  return h + mlp(normed);
}

torch::Tensor LlamaDecoderLayerImpl::ForwardCached(const torch::Tensor& x, const torch::Tensor& cos,
                                                   const torch::Tensor& sin,
                                                   const torch::Tensor& mask, KvCache* cache,
                                                   int64_t layer) {
  const torch::Tensor h =
      x + self_attn->ForwardCached(input_layernorm(x), cos, sin, mask, cache, layer);
  return h + mlp(post_attention_layernorm(h));
}

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& c, c10::Device device) : config_(c) {
  ThrowIfInvalid(c);
  std::optional<int64_t> padding_idx;
  if (c.pad_token_id && *c.pad_token_id >= 0 && *c.pad_token_id < c.vocab_size) {
    padding_idx = *c.pad_token_id;
  }
  embed_tokens = register_module("embed_tokens",
                                 LlamaEmbedding(c.vocab_size, c.hidden_size, padding_idx, device));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(LlamaDecoderLayer(c, device));
  norm = register_module("norm", LlamaRMSNorm(c.hidden_size, c.rms_norm_eps, device));
  inv_freq = RopeInverseFrequencies(c.rope, c.head_dim);
}

std::pair<torch::Tensor, torch::Tensor> LlamaModelImpl::RopeTables(int64_t length,
                                                                   c10::Device device,
                                                                   c10::ScalarType dtype) {
  if (!inv_freq.is_same(cached_inv_freq_)) {
    rope_tables_.clear();
    cached_inv_freq_ = inv_freq;
  }
  const auto key = std::make_tuple(device.str(), static_cast<int>(dtype), length);
  auto it = rope_tables_.find(key);
  if (it == rope_tables_.end()) {
    torch::NoGradGuard no_grad;
    // Kept for every later call: made as ordinary tensors even when the
    // first caller runs under InferenceMode (Generate), or a training
    // forward that later reads them could not save them for backward.
    c10::InferenceMode not_inference(false);
    // Made on the device: a copy from pageable host memory would make the
    // forward wait for the GPU.
    auto [cos, sin] = RopeCosSin(inv_freq.to(device),
                                 torch::arange(length, torch::TensorOptions().device(device)));
    it = rope_tables_.emplace(key, std::make_pair(cos.to(dtype), sin.to(dtype))).first;
  }
  return it->second;
}

torch::Tensor LlamaModelImpl::forward(const torch::Tensor& input_ids) {
  TORCH_CHECK(input_ids.dim() == 2 && input_ids.scalar_type() == torch::kLong,
              "models::LlamaModel: input_ids of shape ", input_ids.sizes(), " and dtype ",
              input_ids.scalar_type(), ": expected int64 [batch, length]");
  const int64_t length = input_ids.size(1);
  TORCH_CHECK(!config_.sliding_window || length <= *config_.sliding_window,
              "models::LlamaModel: a sequence of ", length, " tokens is longer than the config's ",
              "sliding_window=", *config_.sliding_window,
              ": sliding-window attention is not implemented (up to that length it is causal "
              "attention, which is)");
  torch::Tensor h = embed_tokens(input_ids);
  auto [cos, sin] = RopeTables(length, h.device(), h.scalar_type());
  for (const auto& layer : *layers) {
    h = module_call::call(layer->as<LlamaDecoderLayerImpl>(), h, cos, sin);
  }
  return norm(h);
}

torch::Tensor LlamaModelImpl::ForwardCached(const torch::Tensor& input_ids,
                                            const torch::Tensor& mask, KvCache* cache) {
  TORCH_CHECK(input_ids.dim() == 2 && input_ids.scalar_type() == torch::kLong,
              "models::LlamaModel::ForwardCached: input_ids of shape ", input_ids.sizes(),
              " and dtype ", input_ids.scalar_type(), ": expected int64 [batch, length]");
  const int64_t batch = input_ids.size(0), length = input_ids.size(1);
  const c10::Device device = input_ids.device();
  const torch::Tensor real =
      mask.defined()
          ? mask.to(device, torch::kBool)
          : torch::ones({batch, length}, torch::TensorOptions().device(device).dtype(torch::kBool));
  TORCH_CHECK(real.sizes() == input_ids.sizes(), "models::LlamaModel::ForwardCached: mask of ",
              "shape ", real.sizes(), " for input_ids of shape ", input_ids.sizes());
  const int64_t past = cache != nullptr ? cache->length() : 0;
  TORCH_CHECK(cache == nullptr || cache->batch() == batch,
              "models::LlamaModel::ForwardCached: a cache for batch ",
              cache == nullptr ? 0 : cache->batch(), " and input_ids of batch ", batch);
  const int64_t slots = past + length;
  TORCH_CHECK(!config_.sliding_window || slots <= *config_.sliding_window,
              "models::LlamaModel: a sequence of ", slots, " tokens is longer than the config's ",
              "sliding_window=", *config_.sliding_window,
              ": sliding-window attention is not implemented");
  // Padding anywhere (this step's mask or an earlier one) needs the mask and
  // per-row positions; without it (one prompt, or prompts of one length)
  // every row is at positions [past, slots), so the shared RoPE table and
  // SDPA's own causal masking serve, with fewer ops per decoded token.
  const bool padded =
      (mask.defined() && !real.all().item<bool>()) || (cache != nullptr && cache->padded());
  torch::Tensor h = embed_tokens(input_ids);
  // The tables of forward (RopeTables: float32, then cast), long enough for
  // every position so far.
  auto [table_cos, table_sin] =
      RopeTables(std::max(config_.max_position_embeddings, slots), h.device(), h.scalar_type());
  torch::Tensor cos, sin, attn_mask;
  if (!padded) {
    cos = table_cos.narrow(0, past, length);
    sin = table_sin.narrow(0, past, length);
    // One query attends to every slot so far; a first step is causal as
    // SDPA's is_causal (no mask) makes it. Several queries after a prefix
    // need the mask below (is_causal aligns them top-left).
    if (length > 1 && past > 0) {
      attn_mask = torch::ones({length, slots}, h.options().dtype(torch::kBool)).tril(past);
    }
  } else {
    const torch::Tensor seen =
        cache != nullptr
            ? cache->seen()
            : torch::zeros({batch}, torch::TensorOptions().device(device).dtype(torch::kLong));
    // transformers' position_ids from the attention mask: cumsum - 1 (a
    // pad's position is never looked at; clamped to stay a table index).
    const torch::Tensor positions =
        (seen.unsqueeze(1) + real.to(torch::kLong).cumsum(1) - 1).clamp_min(0);
    cos = table_cos.index_select(0, positions.reshape({-1})).view({batch, length, -1});
    sin = table_sin.index_select(0, positions.reshape({-1})).view({batch, length, -1});
    // [B, 1, T, slots]: query i (slot past + i) sees key slot j <= past + i
    // holding a real token, and always itself (a padding query would
    // otherwise see nothing, and its softmax over nothing is NaN).
    const torch::Tensor key_real =
        cache != nullptr ? torch::cat({cache->valid().narrow(1, 0, past), real}, 1) : real;
    const auto index_options = torch::TensorOptions().device(device).dtype(torch::kLong);
    const torch::Tensor query_slot = torch::arange(past, slots, index_options).view({length, 1});
    const torch::Tensor key_slot = torch::arange(slots, index_options).view({1, slots});
    attn_mask = (((key_slot <= query_slot).unsqueeze(0) & key_real.unsqueeze(1)) |
                 (key_slot == query_slot).unsqueeze(0))
                    .unsqueeze(1);
  }
  int64_t index = 0;
  // Directly, not through module_call::call: generation runs on an unwrapped
  // model (no FSDP unit or checkpointed region hooks these layers then).
  for (const auto& layer : *layers) {
    h = layer->as<LlamaDecoderLayerImpl>()->ForwardCached(h, cos, sin, attn_mask, cache, index++);
  }
  if (cache != nullptr) cache->Advance(real, padded);
  return norm(h);
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaConfig& config, c10::Device device,
                                           std::optional<uint64_t> init_seed)
    : config_(config) {
  model = register_module("model", LlamaModel(config, device));
  if (!config.tie_word_embeddings) {
    lm_head = register_module("lm_head",
                              LlamaLinear(config.hidden_size, config.vocab_size, false, device));
  }
  if (init_seed && !device.is_meta()) InitializeWeights(*init_seed);
}

torch::Tensor LlamaForCausalLMImpl::output_weight() const {
  return lm_head.is_empty() ? model->embed_tokens->weight : lm_head->weight;
}

torch::Tensor LlamaForCausalLMImpl::forward(const torch::Tensor& input_ids) {
  return kernels::Linear(model(input_ids), output_weight(), {});
}

torch::Tensor LlamaForCausalLMImpl::ForwardCached(const torch::Tensor& input_ids,
                                                  const torch::Tensor& mask, KvCache* cache,
                                                  bool last_only) {
  torch::Tensor h = model->ForwardCached(input_ids, mask, cache);
  if (last_only) h = h.narrow(1, h.size(1) - 1, 1);
  return kernels::Linear(h, output_weight(), {});
}

torch::Tensor LlamaForCausalLMImpl::Loss(const torch::Tensor& batch) {
  TORCH_CHECK(batch.dim() == 2 && batch.size(1) >= 2 && batch.scalar_type() == torch::kLong,
              "models::LlamaForCausalLM::Loss: batch of shape ", batch.sizes(), " and dtype ",
              batch.scalar_type(), ": expected int64 [B, T + 1] token rows with T >= 1");
  const int64_t length = batch.size(1) - 1;
  const torch::Tensor hidden = model(batch.narrow(1, 0, length));
  // cross_entropy(lm_head(hidden).float(), targets) without the [tokens,
  // vocab] float32 logits: kLossChunkRows rows at a time.
  return kernels::LinearCrossEntropy(hidden.reshape({-1, hidden.size(-1)}), output_weight(),
                                     batch.narrow(1, 1, length).reshape({-1}), kLossChunkRows);
}

std::vector<std::shared_ptr<torch::nn::Module>> LlamaForCausalLMImpl::DecoderLayers() {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (const auto& layer : *model->layers) out.push_back(layer);
  return out;
}

torch::Tensor InitialLlamaParameter(const LlamaConfig& config, const std::string& name,
                                    at::IntArrayRef shape, uint64_t seed) {
  const auto options = torch::TensorOptions().dtype(torch::kFloat);
  // By the name's last parts: which module holds it and which of its tensors.
  if (absl::EndsWith(name, ".bias")) return torch::zeros(shape, options);
  if (absl::EndsWith(name, "norm.weight")) return torch::ones(shape, options);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed ^ StableHash(name));
  torch::Tensor value = torch::empty(shape, options);
  value.normal_(0.0, config.initializer_range, generator);
  if (name == "model.embed_tokens.weight" && config.pad_token_id && *config.pad_token_id >= 0 &&
      *config.pad_token_id < value.size(0)) {
    value[*config.pad_token_id].zero_();
  }
  return value;
}

void LlamaForCausalLMImpl::InitializeWeights(uint64_t seed) {
  torch::NoGradGuard no_grad;
  for (auto& p : named_parameters()) {
    TORCH_CHECK(!p.value().is_meta(), "models::LlamaForCausalLM::InitializeWeights: '", p.key(),
                "' is on the meta device: materialise the parameters first, or fill each shard "
                "from InitialLlamaParameter");
    p.value().copy_(InitialLlamaParameter(config_, p.key(), p.value().sizes(), seed));
  }
}

}  // namespace models
