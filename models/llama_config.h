// LlamaConfig: the shape and options of a Llama-family decoder, read from a
// Hugging Face `config.json` (transformers' LlamaConfig, MistralConfig,
// Qwen2Config, Qwen3Config).
//
//   absl::StatusOr<models::LlamaConfig> config =
//       models::ReadLlamaConfig("Llama-3.2-1B/config.json");
//   auto model = models::LlamaForCausalLM(*config);
//
// Both spellings found in the wild are read: transformers 4.x's
// (`rope_theta`, `rope_scaling` with `type` or `rope_type`, `torch_dtype`)
// and 5.x's (`rope_parameters` with `rope_theta` inside, `dtype`). A field
// missing from the file takes the default transformers' config class of that
// `model_type` gives it (Qwen3's head_dim 128, Mistral's sliding_window 4096,
// ...), except the five that fix the shape (vocab_size, hidden_size,
// intermediate_size, num_hidden_layers, num_attention_heads), which are
// required.
//
// What transformers would compute and this model does not implement is
// refused, naming the field and its value, never computed as something else:
// a model_type other than llama, mistral, qwen2, qwen3; hidden_act other than
// silu; RoPE types other than default, linear and llama3 (yarn, dynamic,
// longrope, ...); partial_rotary_factor other than 1; per-layer RoPE;
// sliding-window attention (qwen's use_sliding_window, a layer_types entry
// other than full_attention; Mistral's sliding_window is accepted and the
// forward refuses sequences longer than it, for which it is the same as full
// causal attention); MoE (num_local_experts, num_experts); attention or
// final logit soft-capping; attention_dropout other than 0.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"

namespace models {

// How RoPE's inverse frequencies are made from theta (transformers'
// ROPE_INIT_FUNCTIONS).
enum class RopeType {
  kDefault,  // 1 / theta^(2i / head_dim)
  kLinear,   // the default's, divided by `factor`
  kLlama3,   // Llama 3.1/3.2: low frequencies / factor, high kept, a smooth band between
};

struct RopeConfig {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;
  // kLinear and kLlama3.
  double factor = 1.0;
  // kLlama3.
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct LlamaConfig {
  // "llama", "mistral", "qwen2" or "qwen3": which transformers class the
  // checkpoint is (its biases and norms follow from it and the flags below).
  std::string model_type = "llama";

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;

  double rms_norm_eps = 1e-6;
  double initializer_range = 0.02;
  RopeConfig rope;

  // Biases of q_proj, k_proj, v_proj (Llama's and Qwen3's attention_bias;
  // always for Qwen2) and of o_proj (attention_bias; never for Qwen2).
  bool qkv_bias = false;
  bool o_proj_bias = false;
  // Llama's mlp_bias: gate_proj, up_proj and down_proj.
  bool mlp_bias = false;
  // Qwen3: RMSNorm over each head's q and k (q_norm, k_norm) before RoPE.
  bool qk_norm = false;
  // lm_head is the token embedding: one tensor, saved as
  // model.embed_tokens.weight only.
  bool tie_word_embeddings = false;
  // Mistral: keys further back than this are not attended to. Sequences up
  // to this length are causal attention as usual; longer ones are refused.
  std::optional<int64_t> sliding_window;

  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;  // config.json's eos_token_id: one id or a list
  std::optional<int64_t> pad_token_id;

  // The file's dtype / torch_dtype; none when it names none (or "auto").
  std::optional<c10::ScalarType> dtype;

  // The config.json this was read from, kept so that an export writes back
  // every field this struct does not model (architectures, token ids,
  // transformers_version, ...). Empty for a config made in code.
  std::string source_json;

  int64_t num_key_value_groups() const { return num_attention_heads / num_key_value_heads; }
};

// Parses `json_text` (a config.json's contents). Every error is
// InvalidArgument or Unimplemented and names `source` (the file, in
// messages), the field and its value.
absl::StatusOr<LlamaConfig> ParseLlamaConfig(const std::string& json_text,
                                             const std::string& source = "config.json");

// Reads and parses the file at `path` (NotFound naming it when it cannot be
// read).
absl::StatusOr<LlamaConfig> ReadLlamaConfig(const std::string& path);

// Checks a config made or changed in code: shapes positive, heads dividing
// as the model needs, head_dim even. What ParseLlamaConfig also checks.
absl::Status ValidateLlamaConfig(const LlamaConfig& config, const std::string& source);

// The config.json an export writes: `source_json` with every field this
// struct models set from it (so a config changed in code is written as it
// now is) and the dtype set to `dtype`, in the spelling the source used
// (`dtype` for 5.x files and configs made in code, `torch_dtype` for 4.x
// files). transformers' from_pretrained reads it.
std::string LlamaConfigJson(const LlamaConfig& config, c10::ScalarType dtype);

}  // namespace models
