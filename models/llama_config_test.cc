#include "models/llama_config.h"

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_replace.h"
#include "nlohmann/json.hpp"

namespace models {
namespace {

using ::testing::HasSubstr;

// Llama 3.2 1B's config.json as the Hub has it (transformers 4.x spelling).
constexpr char kLlama32_1B[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

// The same model as transformers 5.x writes it.
constexpr char kLlama32_1B_5x[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "bos_token_id": 128000,
  "dtype": "bfloat16",
  "eos_token_id": [128001, 128008, 128009],
  "head_dim": 64,
  "hidden_size": 2048,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rope_type": "llama3"
  },
  "tie_word_embeddings": true,
  "vocab_size": 128256
})";

void ExpectLlama32_1B(const LlamaConfig& c) {
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.intermediate_size, 8192);
  EXPECT_EQ(c.num_hidden_layers, 16);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.num_key_value_groups(), 4);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.rope.type, RopeType::kLlama3);
  EXPECT_DOUBLE_EQ(c.rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(c.rope.factor, 32.0);
  EXPECT_DOUBLE_EQ(c.rope.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 8192);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.o_proj_bias);
  EXPECT_FALSE(c.mlp_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_FALSE(c.sliding_window.has_value());
  EXPECT_EQ(c.bos_token_id, 128000);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{128001, 128008, 128009}));
  EXPECT_EQ(c.dtype, c10::kBFloat16);
}

TEST(LlamaConfig, ReadsTransformers4Spelling) {
  auto c = ParseLlamaConfig(kLlama32_1B);
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectLlama32_1B(*c);
}

TEST(LlamaConfig, ReadsTransformers5Spelling) {
  auto c = ParseLlamaConfig(kLlama32_1B_5x);
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectLlama32_1B(*c);
}

TEST(LlamaConfig, RopeScalingWithTypeInsteadOfRopeType) {
  std::string text =
      absl::StrReplaceAll(kLlama32_1B, {{"\"rope_type\": \"llama3\"", "\"type\": \"llama3\""}});
  auto c = ParseLlamaConfig(text);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope.type, RopeType::kLlama3);
}

TEST(LlamaConfig, DefaultsFollowTheModelType) {
  // Minimal configs: the five shape fields and the type.
  auto minimal = [](const std::string& type) {
    return ParseLlamaConfig(R"({"model_type": ")" + type +
                            R"(", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4})");
  };
  auto llama = minimal("llama");
  ASSERT_TRUE(llama.ok()) << llama.status();
  EXPECT_EQ(llama->num_key_value_heads, 4);  // LlamaConfig: None -> the heads
  EXPECT_EQ(llama->head_dim, 16);
  EXPECT_EQ(llama->max_position_embeddings, 2048);
  EXPECT_DOUBLE_EQ(llama->rope.theta, 10000.0);
  EXPECT_EQ(llama->rope.type, RopeType::kDefault);
  EXPECT_EQ(llama->bos_token_id, 1);
  EXPECT_EQ(llama->eos_token_ids, std::vector<int64_t>{2});

  auto mistral = minimal("mistral");
  ASSERT_TRUE(mistral.status().code() == absl::StatusCode::kInvalidArgument)
      << "Mistral's default 8 kv heads do not divide 4 heads: " << mistral.status();

  auto qwen3 = minimal("qwen3");
  // Qwen3Config: head_dim 128 and 32 kv heads by default; 32 does not divide 4.
  ASSERT_FALSE(qwen3.ok());
  EXPECT_THAT(std::string(qwen3.status().message()), HasSubstr("num_key_value_heads=32"));
}

TEST(LlamaConfig, ModelTypesSetTheirBiasesAndNorms) {
  const std::string shape = R"("vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2)";
  auto qwen2 = ParseLlamaConfig(R"({"model_type": "qwen2", )" + shape + "}");
  ASSERT_TRUE(qwen2.ok()) << qwen2.status();
  EXPECT_TRUE(qwen2->qkv_bias);
  EXPECT_FALSE(qwen2->o_proj_bias);
  EXPECT_FALSE(qwen2->qk_norm);

  auto qwen3 = ParseLlamaConfig(R"({"model_type": "qwen3", "head_dim": 8, )" + shape + "}");
  ASSERT_TRUE(qwen3.ok()) << qwen3.status();
  EXPECT_TRUE(qwen3->qk_norm);
  EXPECT_FALSE(qwen3->qkv_bias);
  EXPECT_EQ(qwen3->head_dim, 8);

  auto mistral =
      ParseLlamaConfig(R"({"model_type": "mistral", "sliding_window": null, )" + shape + "}");
  ASSERT_TRUE(mistral.ok()) << mistral.status();
  EXPECT_FALSE(mistral->sliding_window.has_value());
  auto mistral_default = ParseLlamaConfig(R"({"model_type": "mistral", )" + shape + "}");
  ASSERT_TRUE(mistral_default.ok()) << mistral_default.status();
  EXPECT_EQ(mistral_default->sliding_window, 4096);

  auto llama_bias = ParseLlamaConfig(
      R"({"model_type": "llama", "attention_bias": true, "mlp_bias": true, )" + shape + "}");
  ASSERT_TRUE(llama_bias.ok()) << llama_bias.status();
  EXPECT_TRUE(llama_bias->qkv_bias);
  EXPECT_TRUE(llama_bias->o_proj_bias);
  EXPECT_TRUE(llama_bias->mlp_bias);
}

// Each bad config: the error code and what the message must name.
struct BadConfig {
  std::string name;
  std::string json;
  absl::StatusCode code;
  std::string names;
};

class LlamaConfigRefuses : public ::testing::TestWithParam<BadConfig> {};

TEST_P(LlamaConfigRefuses, NamingTheFieldAndValue) {
  const BadConfig& bad = GetParam();
  auto c = ParseLlamaConfig(bad.json, "dir/config.json");
  ASSERT_FALSE(c.ok()) << bad.name;
  EXPECT_EQ(c.status().code(), bad.code) << c.status();
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("dir/config.json")) << bad.name;
  EXPECT_THAT(std::string(c.status().message()), HasSubstr(bad.names)) << bad.name;
}

std::string With(const std::string& replace, const std::string& by) {
  std::string text = absl::StrReplaceAll(kLlama32_1B, {{replace, by}});
  EXPECT_NE(text, kLlama32_1B) << replace;
  return text;
}

using Code = absl::StatusCode;

INSTANTIATE_TEST_SUITE_P(
    Bad, LlamaConfigRefuses,
    ::testing::Values(
        BadConfig{"not json", "{", Code::kInvalidArgument, "not valid JSON"},
        BadConfig{"not an object", "[1]", Code::kInvalidArgument, "expected a JSON object"},
        BadConfig{"missing field", With("\"vocab_size\": 128256", "\"x\": 1"),
                  Code::kInvalidArgument, "vocab_size is missing"},
        BadConfig{"wrong type", With("\"hidden_size\": 2048", "\"hidden_size\": \"2048\""),
                  Code::kInvalidArgument, "hidden_size=\"2048\""},
        BadConfig{
            "heads do not divide hidden",
            absl::StrReplaceAll(kLlama32_1B, {{"\"head_dim\": 64,", ""},
                                              {"\"hidden_size\": 2048", "\"hidden_size\": 2050"}}),
            Code::kInvalidArgument, "hidden_size=2050 is not divisible by num_attention_heads=32"},
        BadConfig{"kv heads do not divide heads",
                  With("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5"),
                  Code::kInvalidArgument, "num_key_value_heads=5"},
        BadConfig{"odd head_dim", With("\"head_dim\": 64", "\"head_dim\": 63"),
                  Code::kInvalidArgument, "head_dim=63"},
        BadConfig{"unknown rope type", With("\"rope_type\": \"llama3\"", "\"rope_type\": \"yarn\""),
                  Code::kUnimplemented, "rope_scaling.rope_type='yarn'"},
        BadConfig{"dynamic rope", With("\"rope_type\": \"llama3\"", "\"rope_type\": \"dynamic\""),
                  Code::kUnimplemented, "'dynamic'"},
        BadConfig{"unknown rope key",
                  With("\"low_freq_factor\": 1.0", "\"low_freq_factor\": 1.0, \"beta_fast\": 32"),
                  Code::kUnimplemented, "rope_scaling.beta_fast=32"},
        BadConfig{"llama3 without its factors", With("\"low_freq_factor\": 1.0,", ""),
                  Code::kInvalidArgument, "rope_scaling.low_freq_factor is missing"},
        BadConfig{"model type", With("\"model_type\": \"llama\"", "\"model_type\": \"gemma2\""),
                  Code::kUnimplemented, "model_type=\"gemma2\""},
        BadConfig{"activation", With("\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\""),
                  Code::kUnimplemented, "hidden_act=\"gelu\""},
        BadConfig{"moe",
                  With("\"mlp_bias\": false", "\"mlp_bias\": false, \"num_local_experts\": 8"),
                  Code::kUnimplemented, "num_local_experts=8"},
        BadConfig{
            "soft-capping",
            With("\"mlp_bias\": false", "\"mlp_bias\": false, \"final_logit_softcapping\": 30.0"),
            Code::kUnimplemented, "final_logit_softcapping=30.0"},
        BadConfig{"attention dropout",
                  With("\"attention_dropout\": 0.0", "\"attention_dropout\": 0.1"),
                  Code::kUnimplemented, "attention_dropout=0.1"},
        BadConfig{
            "partial rotary",
            With("\"mlp_bias\": false", "\"mlp_bias\": false, \"partial_rotary_factor\": 0.5"),
            Code::kUnimplemented, "partial_rotary_factor=0.5"},
        BadConfig{
            "layer types",
            With("\"mlp_bias\": false",
                 R"("mlp_bias": false, "layer_types": ["full_attention", "sliding_attention"])"),
            Code::kUnimplemented, "\"sliding_attention\""},
        BadConfig{"contradicting dtypes",
                  With("\"torch_dtype\": \"bfloat16\"",
                       "\"torch_dtype\": \"bfloat16\", \"dtype\": \"float32\""),
                  Code::kInvalidArgument, "contradict"},
        BadConfig{"unknown dtype",
                  With("\"torch_dtype\": \"bfloat16\"", "\"torch_dtype\": \"int8\""),
                  Code::kInvalidArgument, "torch_dtype=\"int8\""},
        BadConfig{"qwen sliding window",
                  R"({"model_type": "qwen2", "use_sliding_window": true, "vocab_size": 10,
                      "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
                      "num_attention_heads": 2, "num_key_value_heads": 2})",
                  Code::kUnimplemented, "use_sliding_window=true"}),
    [](const ::testing::TestParamInfo<BadConfig>& info) {
      std::string name = info.param.name;
      for (char& ch : name) {
        if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
      }
      return name;
    });

TEST(LlamaConfig, JsonRoundTripsInBothSpellings) {
  for (const char* text : {kLlama32_1B, kLlama32_1B_5x}) {
    auto c = ParseLlamaConfig(text);
    ASSERT_TRUE(c.ok()) << c.status();
    const std::string written = LlamaConfigJson(*c, c10::kFloat);
    auto back = ParseLlamaConfig(written);
    ASSERT_TRUE(back.ok()) << back.status() << "\n" << written;
    ExpectLlama32_1B([&] {
      LlamaConfig expected = *back;
      expected.dtype = c10::kBFloat16;  // written as float32 on purpose
      return expected;
    }());
    EXPECT_EQ(back->dtype, c10::kFloat);
    const auto json = nlohmann::json::parse(written);
    // The source's spelling and its other fields are kept.
    EXPECT_EQ(json.contains("torch_dtype"), text == std::string(kLlama32_1B)) << written;
    EXPECT_EQ(json.contains("rope_parameters"), text != std::string(kLlama32_1B)) << written;
    EXPECT_EQ(json["architectures"][0], "LlamaForCausalLM");
  }
}

TEST(LlamaConfig, ConfigMadeInCodeIsWrittenIn5xSpelling) {
  LlamaConfig c;
  c.model_type = "qwen3";
  c.vocab_size = 10;
  c.hidden_size = 8;
  c.intermediate_size = 16;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 4;
  c.max_position_embeddings = 64;
  c.qk_norm = true;
  ASSERT_TRUE(ValidateLlamaConfig(c, "test").ok());
  const std::string written = LlamaConfigJson(c, c10::kBFloat16);
  auto back = ParseLlamaConfig(written);
  ASSERT_TRUE(back.ok()) << back.status() << written;
  EXPECT_EQ(back->model_type, "qwen3");
  EXPECT_EQ(back->head_dim, 4);
  EXPECT_EQ(back->num_key_value_heads, 1);
  EXPECT_EQ(back->dtype, c10::kBFloat16);
  EXPECT_EQ(nlohmann::json::parse(written)["architectures"][0], "Qwen3ForCausalLM");
}

}  // namespace
}  // namespace models
