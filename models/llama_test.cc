// LlamaForCausalLM against transformers: the checkpoints and golden values of
// tools/golden/llama_golden.py (models/testdata/<case>/), loaded with the
// plain safetensors reader (testing/golden_cases.h) so that this test
// depends on the model alone.
#include "models/llama.h"

#include <map>
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "models/rope.h"
#include "models/testing/golden_cases.h"
#include "testing/golden_fixture.h"

namespace models {
namespace {

// float32 against transformers' float32 on the same CPU: the same ATen
// kernels in the same order, so the differences are reduction orders inside
// the BLAS and SDPA kernels (thread counts, blocking). The golden script
// measured float32-vs-float64 differences of the same size (its docstring);
// a layout mistake moves the logits by more than 1e-1 (the mutations below).
constexpr double kLogitTol = 1e-4;
constexpr double kGradTol = 1e-4;

using testing::CaseDir;
using testing::CheckpointTensors;
using testing::ConfigOf;
using testing::LoadModel;

double MaxAbsDiff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

const std::vector<std::string>& FloatCases() {
  static const std::vector<std::string> cases = {"llama3_gqa", "llama_tied", "qwen3", "qwen2",
                                                 "mistral"};
  return cases;
}

class LlamaGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(LlamaGolden, RopeTablesEqualTransformers) {
  const test_data::GoldenFixture golden(CaseDir(GetParam()) + "/golden.pt");
  const LlamaConfig config = ConfigOf(GetParam());
  const torch::Tensor inv_freq = RopeInverseFrequencies(config.rope, config.head_dim);
  EXPECT_TRUE(torch::equal(inv_freq, golden["inv_freq"])) << inv_freq << "\n" << golden["inv_freq"];
  const int64_t length = golden["cos"].size(1);
  auto [cos, sin] = RopeCosSin(inv_freq, torch::arange(length));
  EXPECT_LE(MaxAbsDiff(cos, golden["cos"][0]), 1e-6);
  EXPECT_LE(MaxAbsDiff(sin, golden["sin"][0]), 1e-6);
}

TEST_P(LlamaGolden, LogitsLossHiddenStatesEqualTransformers) {
  const test_data::GoldenFixture golden(CaseDir(GetParam()) + "/golden.pt");
  LlamaForCausalLM model = LoadModel(GetParam());
  const torch::Tensor batch = golden["batch"];
  const torch::Tensor input = batch.narrow(1, 0, batch.size(1) - 1);
  const torch::Tensor logits = model->forward(input);
  EXPECT_LE(MaxAbsDiff(logits, golden["logits"]), kLogitTol);
  EXPECT_NEAR(model->Loss(batch).item<double>(), golden["loss"].item<double>(), 1e-5);
  // The final hidden state (transformers' last hidden_states entry is after
  // the final norm).
  const int64_t layers = model->config().num_hidden_layers;
  EXPECT_LE(MaxAbsDiff(model->model->forward(input), golden[absl::StrCat("hidden.", layers)]),
            kLogitTol);
}

TEST_P(LlamaGolden, GradientsAndOneAdamWStepEqualTransformers) {
  const test_data::GoldenFixture golden(CaseDir(GetParam()) + "/golden.pt");
  LlamaForCausalLM model = LoadModel(GetParam());
  model->Loss(golden["batch"]).backward();
  std::vector<torch::Tensor> params;
  for (auto& p : model->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    const torch::Tensor& expected = golden["grad." + p.key()];
    const double scale = std::max(1.0, expected.abs().max().item<double>());
    EXPECT_LE(MaxAbsDiff(p.value().grad(), expected), kGradTol * scale) << p.key();
    params.push_back(p.value());
  }
  // The step from transformers' own gradients: AdamW's first step moves
  // each element by about lr * sign(grad), so gradients that agree to 1e-6
  // but straddle zero (a few dozen entries below 1e-5 per case) would move
  // their parameters 2 lr apart (tools/golden/llama_golden.py's docstring).
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->named_parameters())
      p.value().mutable_grad() = golden["grad." + p.key()].clone();
  }
  torch::optim::AdamW adamw(
      params, torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1));
  adamw.step();
  for (auto& p : model->named_parameters()) {
    EXPECT_LE(MaxAbsDiff(p.value(), golden["after_adamw." + p.key()]), 1e-6) << p.key();
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, LlamaGolden, ::testing::ValuesIn(FloatCases()));

TEST(Llama, ParameterNamesAreTheCheckpointsAndNothingIsABuffer) {
  for (const std::string& name : FloatCases()) {
    LlamaForCausalLM model(ConfigOf(name));
    std::set<std::string> ours, theirs;
    for (const auto& p : model->named_parameters()) ours.insert(p.key());
    for (const auto& [key, tensor] : CheckpointTensors(name)) theirs.insert(key);
    EXPECT_EQ(ours, theirs) << name;
    EXPECT_TRUE(model->named_buffers().is_empty()) << name;
  }
}

TEST(Llama, Bf16CheckpointLoadsAsItsFloat32Values) {
  const test_data::GoldenFixture golden(CaseDir("llama3_gqa_bf16") + "/golden.pt");
  std::map<std::string, torch::Tensor> tensors = CheckpointTensors("llama3_gqa_bf16");
  for (const auto& [key, tensor] : tensors) {
    EXPECT_EQ(tensor.scalar_type(), torch::kBFloat16) << key;
    EXPECT_TRUE(torch::equal(tensor.to(torch::kFloat), golden["params." + key])) << key;
  }
  LlamaForCausalLM model = LoadModel("llama3_gqa_bf16");
  const torch::Tensor batch =
      test_data::GoldenFixture(CaseDir("llama3_gqa") + "/golden.pt")["batch"];
  EXPECT_LE(MaxAbsDiff(model->forward(batch.narrow(1, 0, batch.size(1) - 1)), golden["logits"]),
            kLogitTol);
}

// Runs in bfloat16 and stays near the float32 result: bf16 keeps 8 bits, so
// the logits agree to a few percent of their range, not to float32's 1e-4.
TEST(Llama, Bfloat16ForwardIsNearFloat32) {
  const test_data::GoldenFixture golden(CaseDir("llama3_gqa") + "/golden.pt");
  LlamaForCausalLM model = LoadModel("llama3_gqa");
  model->to(torch::kBFloat16);
  const torch::Tensor batch = golden["batch"];
  const torch::Tensor logits = model->forward(batch.narrow(1, 0, batch.size(1) - 1));
  EXPECT_EQ(logits.scalar_type(), torch::kBFloat16);
  const double range = golden["logits"].abs().max().item<double>();
  EXPECT_LE(MaxAbsDiff(logits, golden["logits"]), 0.1 * range);
  EXPECT_EQ(model->Loss(batch).scalar_type(), torch::kFloat);
}

// ---- Mutations: each layout mistake a port could make breaks the golden
// comparison. Each is applied to the weights or tables of the correct model
// (model_mistaken(W) == model(P W) for a permutation P), so no code path of
// the model exists only for a test.

double LogitErrorAfter(const std::string& name,
                       const std::function<void(LlamaForCausalLMImpl&)>& mutate) {
  const test_data::GoldenFixture golden(CaseDir(name) + "/golden.pt");
  LlamaForCausalLM model = LoadModel(name);
  {
    torch::NoGradGuard no_grad;
    mutate(*model);
  }
  const torch::Tensor batch = golden["batch"];
  return MaxAbsDiff(model->forward(batch.narrow(1, 0, batch.size(1) - 1)), golden["logits"]);
}

// Rows of a [heads * d, in] projection, per head, reordered by `order` (a
// permutation of [0, d)).
void PermuteHeadRows(torch::Tensor& weight, int64_t head_dim, const torch::Tensor& order) {
  const int64_t heads = weight.size(0) / head_dim;
  torch::Tensor w = weight.view({heads, head_dim, -1}).index_select(1, order);
  weight.copy_(w.reshape(weight.sizes()));
}

TEST(LlamaMutations, InterleavedRopeBreaksTheGoldenLogits) {
  // Interleaved RoPE rotates pairs (2i, 2i+1); rotate-half pairs (i, i + d/2).
  // Applying interleaved RoPE to weights W equals applying rotate-half to
  // rows reordered [0, 2, 4, ..., 1, 3, 5, ...].
  const double error = LogitErrorAfter("llama3_gqa", [](LlamaForCausalLMImpl& m) {
    const int64_t d = m.config().head_dim;
    const torch::Tensor order =
        torch::cat({torch::arange(0, d, 2), torch::arange(1, d, 2)}).argsort();
    for (auto& layer : *m.model->layers) {
      auto& attn = layer->as<LlamaDecoderLayerImpl>()->self_attn;
      PermuteHeadRows(attn->q_proj->weight, d, order);
      PermuteHeadRows(attn->k_proj->weight, d, order);
    }
  });
  EXPECT_GT(error, 100 * kLogitTol);
}

TEST(LlamaMutations, TiledKvHeadsBreakTheGoldenLogits) {
  // Tiled: query head h reads kv head h % kv; repeated (transformers): h /
  // groups. The tiled model equals the repeated one with its query heads
  // (and o_proj's matching columns) permuted.
  const double error = LogitErrorAfter("llama3_gqa", [](LlamaForCausalLMImpl& m) {
    const LlamaConfig& c = m.config();
    ASSERT_GT(c.num_key_value_groups(), 1);
    std::vector<int64_t> perm;
    for (int64_t h = 0; h < c.num_attention_heads; ++h) {
      const int64_t kv = h % c.num_key_value_heads, slot = h / c.num_key_value_heads;
      perm.push_back(kv * c.num_key_value_groups() + slot);
    }
    const torch::Tensor heads = torch::tensor(perm);
    for (auto& layer : *m.model->layers) {
      auto& attn = layer->as<LlamaDecoderLayerImpl>()->self_attn;
      torch::Tensor q = attn->q_proj->weight.view({c.num_attention_heads, c.head_dim, -1});
      attn->q_proj->weight.copy_(q.index_select(0, heads).reshape(attn->q_proj->weight.sizes()));
      torch::Tensor o = attn->o_proj->weight.view({-1, c.num_attention_heads, c.head_dim});
      attn->o_proj->weight.copy_(o.index_select(1, heads).reshape(attn->o_proj->weight.sizes()));
    }
  });
  EXPECT_GT(error, 100 * kLogitTol);
}

TEST(LlamaMutations, SwappedGateAndUpBreakTheGoldenLogits) {
  const double error = LogitErrorAfter("llama3_gqa", [](LlamaForCausalLMImpl& m) {
    for (auto& layer : *m.model->layers) {
      auto& mlp = layer->as<LlamaDecoderLayerImpl>()->mlp;
      const torch::Tensor gate = mlp->gate_proj->weight.clone();
      mlp->gate_proj->weight.copy_(mlp->up_proj->weight);
      mlp->up_proj->weight.copy_(gate);
    }
  });
  EXPECT_GT(error, 100 * kLogitTol);
}

TEST(LlamaMutations, Llama3ScalingWithoutTheSmoothingBandBreaksTheGoldenLogits) {
  const double error = LogitErrorAfter("llama3_gqa", [](LlamaForCausalLMImpl& m) {
    RopeConfig unsmoothed = m.config().rope;
    // Without the band every frequency is either kept or divided by factor:
    // what llama3 scaling gives when low_freq_factor == high_freq_factor
    // (band of width zero, at the low-frequency edge).
    const torch::Tensor smoothed = RopeInverseFrequencies(unsmoothed, m.config().head_dim);
    const double low_wavelen =
        unsmoothed.original_max_position_embeddings / unsmoothed.low_freq_factor;
    RopeConfig plain = unsmoothed;
    plain.type = RopeType::kDefault;
    const torch::Tensor base = RopeInverseFrequencies(plain, m.config().head_dim);
    const torch::Tensor wavelen = 2 * M_PI / base;
    m.model->inv_freq = torch::where(wavelen > low_wavelen, base / unsmoothed.factor, base);
    ASSERT_FALSE(torch::equal(m.model->inv_freq, smoothed)) << "no frequency in the band";
  });
  EXPECT_GT(error, 100 * kLogitTol);
}

// ---- Behaviour beyond the golden values.

TEST(Llama, InitializeWeightsAsTransformersFromASeed) {
  LlamaConfig config = ConfigOf("llama_tied");
  config.pad_token_id = 3;
  LlamaForCausalLM a(config), b(config), c(config);
  a->InitializeWeights(7);
  b->InitializeWeights(7);
  c->InitializeWeights(8);
  for (const auto& p : a->named_parameters()) {
    const torch::Tensor& t = p.value();
    EXPECT_TRUE(torch::equal(t, b->named_parameters()[p.key()])) << p.key();
    if (absl::EndsWith(p.key(), "norm.weight")) {
      EXPECT_TRUE(torch::equal(t, torch::ones_like(t))) << p.key();
    } else if (absl::EndsWith(p.key(), ".bias")) {
      EXPECT_TRUE(torch::equal(t, torch::zeros_like(t))) << p.key();
    } else {
      EXPECT_FALSE(torch::equal(t, c->named_parameters()[p.key()])) << p.key();
      const double std = t.std().item<double>();
      EXPECT_NEAR(std, config.initializer_range, 0.25 * config.initializer_range) << p.key();
    }
  }
  EXPECT_TRUE(torch::equal(a->model->embed_tokens->weight[3], torch::zeros({config.hidden_size})));
}

TEST(Llama, MetaModelAllocatesNothingAndInitialisesTensorByTensor) {
  const LlamaConfig config = ConfigOf("llama3_gqa");
  LlamaForCausalLM meta(config, c10::kMeta), cpu(config);
  cpu->InitializeWeights(11);
  for (const auto& p : meta->named_parameters()) {
    EXPECT_TRUE(p.value().is_meta()) << p.key();
    EXPECT_TRUE(p.value().requires_grad()) << p.key();
    // One tensor at a time, from the meta model: the CPU model's values.
    EXPECT_TRUE(torch::equal(InitialLlamaParameter(config, p.key(), p.value().sizes(), 11),
                             cpu->named_parameters()[p.key()]))
        << p.key();
  }
  // The module members forward() reads are the meta tensors too.
  EXPECT_TRUE(
      meta->model->layers[0]->as<LlamaDecoderLayerImpl>()->self_attn->q_proj->weight.is_meta());
  EXPECT_TRUE(meta->lm_head->weight.is_meta());
  EXPECT_THROW(meta->InitializeWeights(1), c10::Error);
}

TEST(Llama, PaddingTokenRowGetsNoGradient) {
  LlamaConfig config = ConfigOf("llama_tied");
  config.tie_word_embeddings = false;  // the output projection would feed that row
  config.pad_token_id = 5;
  LlamaForCausalLM model(config);
  model->InitializeWeights(1);
  const torch::Tensor batch = torch::tensor({{5, 1, 5, 2, 3}, {4, 5, 6, 5, 1}});
  model->Loss(batch).backward();
  const torch::Tensor grad = model->model->embed_tokens->weight.grad();
  EXPECT_TRUE(torch::equal(grad[5], torch::zeros_like(grad[5])));
  EXPECT_GT(grad[1].abs().sum().item<double>(), 0);
}

TEST(Llama, TiedOutputProjectionIsTheEmbedding) {
  LlamaForCausalLM model(ConfigOf("llama_tied"));
  EXPECT_TRUE(model->lm_head.is_empty());
  EXPECT_TRUE(model->output_weight().is_same(model->model->embed_tokens->weight));
}

TEST(Llama, SlidingWindowLongerSequencesAreRefused) {
  LlamaConfig config = ConfigOf("mistral");
  config.sliding_window = 8;
  LlamaForCausalLM model(config);
  EXPECT_NO_THROW(model->forward(torch::zeros({1, 8}, torch::kLong)));
  try {
    model->forward(torch::zeros({1, 9}, torch::kLong));
    FAIL() << "a 9-token sequence over a window of 8 was computed";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr("sliding_window=8"));
  }
}

TEST(Llama, BadInputIsRefused) {
  LlamaForCausalLM model(ConfigOf("llama_tied"));
  EXPECT_THROW(model->forward(torch::zeros({4}, torch::kLong)), c10::Error);
  EXPECT_THROW(model->forward(torch::zeros({1, 4}, torch::kFloat)), c10::Error);
  EXPECT_THROW(model->Loss(torch::zeros({2, 1}, torch::kLong)), c10::Error);
  LlamaConfig bad = ConfigOf("llama_tied");
  bad.num_key_value_heads = 3;
  EXPECT_THROW(LlamaForCausalLM{bad}, c10::Error);
}

TEST(Llama, DecoderLayersAreTheLayersInOrder) {
  LlamaForCausalLM model(ConfigOf("llama3_gqa"));
  const auto layers = model->DecoderLayers();
  ASSERT_EQ(static_cast<int64_t>(layers.size()), model->config().num_hidden_layers);
  for (size_t i = 0; i < layers.size(); ++i) {
    EXPECT_EQ(layers[i].get(), model->model->layers[i].get());
  }
}

}  // namespace
}  // namespace models
