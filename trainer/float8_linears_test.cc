// --float8's conversion of a Llama: which projections change, that the
// model's parameters do not, that the forward and backward stay close to
// the high-precision model's (float8 e4m3/e5m2 round to 3/2 mantissa bits),
// --float8-all-gather's training equal to --float8's bit for bit on 2
// ranks, and the refusals (a model without Llama projections, the CPU).
#include "trainer/float8_linears.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

// Needs all of LibTorch: a test of a model with autograd (precompiled: LIBTORCH_PCH).
#include <torch/torch.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "comm/process_group.h"
#include "fsdp/fully_shard.h"
#include "models/llama.h"
#include "models/llama_config.h"
#include "testing/multiprocess.h"
#include "trainer/options.h"
#include "trainer/wrap.h"

namespace trainer {
namespace {

using ::testing::HasSubstr;

// Every projection's dimensions are multiples of 16, as float8 matrix
// products need: hidden 64, 4 heads of 16, 2 kv heads (32), FFN 128.
models::LlamaConfig SmallConfig() {
  // One file per process: the ranks of a RunOnRanks test write theirs at once.
  const std::string path =
      ::testing::TempDir() + "/float8_config_" + std::to_string(::getpid()) + ".json";
  std::ofstream(path) << R"({"model_type": "llama", "vocab_size": 128, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": false, "initializer_range": 0.1})";
  auto config = models::ReadLlamaConfig(path);
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

double RelativeError(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a - b).norm() / b.norm()).item<double>();
}

TEST(Float8LinearsTest, ConvertsTheDecoderProjectionsOnly) {
  const models::LlamaConfig config = SmallConfig();
  models::LlamaForCausalLM reference(config, c10::kCPU, 3);
  models::LlamaForCausalLM converted(config, c10::kCPU, 3);
  std::vector<std::string> names_before;
  for (const auto& p : converted->named_parameters()) names_before.push_back(p.key());

  auto count = ConvertLinearsToFloat8(*converted);
  ASSERT_TRUE(count.ok()) << count.status();
  EXPECT_EQ(*count, 7 * config.num_hidden_layers);  // q, k, v, o, gate, up, down
  EXPECT_FALSE(converted->lm_head->matmul) << "lm_head stays high precision";
  EXPECT_TRUE(
      converted->model->layers[0]->as<models::LlamaDecoderLayerImpl>()->mlp->down_proj->matmul);
  std::vector<std::string> names_after;
  for (const auto& p : converted->named_parameters()) names_after.push_back(p.key());
  EXPECT_EQ(names_after, names_before);

  // 2 x 9 tokens: 16 rows of 8 positions each after the shift; a fixed
  // batch (the test's verdict must not depend on the global generator).
  torch::manual_seed(11);
  const torch::Tensor batch = torch::randint(0, config.vocab_size, {2, 9});
  const torch::Tensor ref_loss = reference->Loss(batch);
  const torch::Tensor loss = converted->Loss(batch);
  ref_loss.backward();
  loss.backward();
  // Close, not equal: float8 is in use.
  EXPECT_NE(loss.item<double>(), ref_loss.item<double>());
  EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 0.05 * ref_loss.item<double>());
  for (const auto& p : converted->named_parameters()) {
    const torch::Tensor ref_grad = reference->named_parameters()[p.key()].grad();
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_TRUE(torch::isfinite(p.value().grad()).all().item<bool>()) << p.key();
    EXPECT_LT(RelativeError(p.value().grad(), ref_grad), 0.25) << p.key();
  }
}

// --float8-all-gather gathers the projections' weights as float8 and they
// multiply those casts: the casts of the whole weights, so training is
// --float8's bit for bit (2 ranks average two equal gradients exactly).
// The gathered path is the one taken: unsharded, the projections' weights
// are NaN stand-ins, which a linear casting its own weight would turn into
// a NaN loss.
TEST(Float8LinearsTest, AllGatherInFloat8TrainsAsFloat8OnTwoRanks) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    const models::LlamaConfig config = SmallConfig();
    torch::manual_seed(11);
    const torch::Tensor batch = torch::randint(0, config.vocab_size, {2, 17});  // 32 rows
    std::vector<std::vector<torch::Tensor>> runs;  // per run: losses and gradients
    // --float8, then --float8-all-gather without and with activation
    // checkpointing (whose recomputed forward multiplies the casts backward
    // gathers again).
    for (const auto& [gather, recompute] :
         std::vector<std::pair<bool, bool>>{{false, false}, {true, false}, {true, true}}) {
      SCOPED_TRACE(std::string(gather ? "--float8-all-gather" : "--float8") +
                   (recompute ? " --activation-checkpointing" : ""));
      models::LlamaForCausalLM llama(config, c10::kCPU, 3);
      Options o;
      o.model = ModelKind::kLlama;
      o.fsdp = FsdpApi::kFullyShard;
      o.float8 = true;
      o.float8_all_gather = gather;
      if (recompute) o.activation_checkpointing = ActivationCheckpointing::kBlock;
      ASSERT_TRUE(ConvertLinearsToFloat8(*llama, gather).ok());
      auto wrapped = Wrap(o, llama.ptr(), c10::kCPU, pg);
      ASSERT_TRUE(wrapped.ok()) << wrapped.status();
      const TrainedModel model = wrapped->model();
      torch::optim::SGD sgd(model.parameters(), 0.5);
      std::vector<torch::Tensor> run;
      for (int step = 0; step < 3; ++step) {
        sgd.zero_grad();
        const torch::Tensor loss = model.run([&] { return llama->Loss(batch); });
        loss.backward();
        run.push_back(loss.detach().clone());
        for (const auto& p : model.parameters()) run.push_back(p.grad().clone());
        sgd.step();
      }
      auto* layer = llama->model->layers[0]->as<models::LlamaDecoderLayerImpl>();
      std::optional<fsdp::FSDPModule> unit = fsdp::as_fsdp_module(*layer);
      ASSERT_TRUE(unit.has_value());
      unit->unshard();
      const torch::Tensor& q = layer->self_attn->q_proj->weight;
      EXPECT_EQ(fsdp::float8_unsharded_param(q).has_value(), gather);
      EXPECT_EQ(q.isnan().all().item<bool>(), gather);
      EXPECT_FALSE(fsdp::float8_unsharded_param(layer->input_layernorm->weight).has_value());
      unit->reshard();
      runs.push_back(std::move(run));
    }
    EXPECT_TRUE(torch::isfinite(runs[1][0]).item<bool>());
    for (size_t run = 1; run < runs.size(); ++run) {
      ASSERT_EQ(runs[run].size(), runs[0].size());
      for (size_t i = 0; i < runs[0].size(); ++i) {
        EXPECT_TRUE(torch::equal(runs[run][i], runs[0][i])) << "run " << run << ", tensor " << i;
      }
    }
  });
}

TEST(Float8LinearsTest, RefusesAModelWithoutLlamaProjections) {
  torch::nn::Linear linear(16, 16);
  auto count = ConvertLinearsToFloat8(*linear);
  ASSERT_FALSE(count.ok());
  EXPECT_THAT(std::string(count.status().message()),
              AllOf(HasSubstr("--float8"), HasSubstr("--model llama")));
}

TEST(Float8LinearsTest, RefusesTheCpu) {
  const absl::Status s = CheckFloat8Device(c10::Device(c10::kCPU));
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("--float8 on cpu"), HasSubstr("compute capability 8.9")));
}

}  // namespace
}  // namespace trainer
