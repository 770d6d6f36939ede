// The Llama model of models/ under both FSDPs, as the trainer wraps and loads
// it (trainer::Wrap, trainer::LoadHfIntoShards, trainer::ExportHf), on 1-4
// ranks, against transformers' golden values (models/testdata/llama3_gqa,
// tools/golden/llama_golden.py): the Hugging Face checkpoint loaded straight
// into the shards gives transformers' loss, one SGD step (lr 1, so the
// update is the gradient) moves every parameter by transformers' gradient,
// and the export read back holds exactly the trained parameters.
//
// Every rank computes on the whole golden batch, so the gradient FSDP
// averages over the ranks is the batch's gradient whatever the world size
// (3 ranks shard every tensor unevenly).
#include <filesystem>
#include <set>
#include <string>

#include <gtest/gtest.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "comm/collectives.h"
#include "comm/process_group.h"
#include "formats/hf/hf_checkpoint_files.h"
#include "models/llama.h"
#include "state_dict/fsdp/fsdp_state_dict.h"
#include "state_dict/fully_shard/fully_shard_state_dict.h"
#include "state_dict/hf_checkpoint.h"
#include "testing/golden_fixture.h"
#include "testing/multiprocess.h"
#include "trainer/checkpointing.h"
#include "trainer/options.h"
#include "trainer/wrap.h"

namespace {

constexpr char kCase[] = "models/testdata/llama3_gqa";

// The trained parameters, whole, on every rank.
std::map<std::string, torch::Tensor> FullParameters(trainer::TrainedModel model) {
  absl::StatusOr<state_dict::TensorDict> full;
  if (model.fully_shard() != nullptr) {
    full = state_dict::FullyShardFullStateDict(model.fully_shard()->module(), nullptr);
  } else {
    auto state = state_dict::GetModelStateDict(*model.fsdp1(), state_dict::StateDictType::kFull);
    if (state.ok()) {
      full = state->full;
    } else {
      full = state.status();
    }
  }
  EXPECT_TRUE(full.ok()) << full.status();
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : *full) out[item.key()] = item.value().clone();
  return out;
}

void TrainOneStepAgainstTransformers(trainer::FsdpApi api, trainer::Sharding sharding,
                                     bool activation_checkpointing, int world) {
  comm::testing::RunOptions run;
  run.timeout = std::chrono::seconds(120);
  comm::testing::RunOnRanks(
      world,
      [&](comm::ProcessGroup& pg) {
        const std::string dir = test_data::RunfilePath(kCase);
        const test_data::GoldenFixture golden(dir + "/golden.pt");
        auto config = models::ReadLlamaConfig(dir + "/config.json");
        ASSERT_TRUE(config.ok()) << config.status();
        auto llama = models::LlamaForCausalLM(*config);
        llama->InitializeWeights(/*seed=*/1);  // replaced by the checkpoint's

        trainer::Options o;
        o.model = trainer::ModelKind::kLlama;
        o.hf_checkpoint = dir;
        o.fsdp = api;
        o.sharding = sharding;
        o.activation_checkpointing = activation_checkpointing
                                         ? trainer::ActivationCheckpointing::kBlock
                                         : trainer::ActivationCheckpointing::kNone;
        auto wrapped = trainer::Wrap(o, llama.ptr(), torch::kCPU, pg);
        ASSERT_TRUE(wrapped.ok()) << wrapped.status();
        const trainer::TrainedModel model = wrapped->model();
        ASSERT_TRUE(trainer::LoadHfIntoShards(o, pg, model).ok());
        const std::map<std::string, torch::Tensor> before = FullParameters(model);
        for (const auto& [name, t] : before) {
          auto files = formats::HfCheckpointFiles::Open(dir);
          ASSERT_TRUE(files.ok());
          EXPECT_TRUE(torch::equal(t, *files->ReadAll(name))) << name << " not loaded";
        }

        const torch::Tensor loss = model.run([&] { return llama->Loss(golden["batch"]); });
        EXPECT_NEAR(loss.item<double>(), golden["loss"].item<double>(), 1e-5);
        loss.backward();
        torch::optim::SGD sgd(model.parameters(), torch::optim::SGDOptions(1.0));
        sgd.step();
        const std::map<std::string, torch::Tensor> after = FullParameters(model);
        ASSERT_EQ(after.size(), llama->named_parameters().size());
        for (const auto& [name, t] : after) {
          const torch::Tensor grad = before.at(name) - t;
          const torch::Tensor& expected = golden["grad." + name];
          const double scale = std::max(1.0, expected.abs().max().item<double>());
          EXPECT_LE((grad - expected).abs().max().item<double>(), 1e-4 * scale) << name;
        }

        // The export, read back by every rank, is the trained model bitwise.
        o.export_hf = std::string(std::getenv("TEST_TMPDIR")) + "/export_" +
                      ::testing::UnitTest::GetInstance()->current_test_info()->name();
        ASSERT_TRUE(trainer::CheckHfExportTarget(o, pg).ok());
        ASSERT_TRUE(
            trainer::ExportHf(o, pg, model, sgd, models::LlamaConfigJson(*config, torch::kFloat))
                .ok());
        comm::barrier(pg).wait();
        auto back = models::LlamaForCausalLM(*config);
        ASSERT_TRUE(state_dict::LoadHfCheckpoint(*back, o.export_hf).ok());
        for (const auto& p : back->named_parameters()) {
          EXPECT_TRUE(torch::equal(p.value(), after.at(p.key()))) << p.key();
        }
      },
      run);
}

using trainer::FsdpApi;
using trainer::Sharding;

TEST(LlamaFsdp, FullyShardOneRank) {
  TrainOneStepAgainstTransformers(FsdpApi::kFullyShard, Sharding::kFull, false, 1);
}
TEST(LlamaFsdp, FullyShardTwoRanks) {
  TrainOneStepAgainstTransformers(FsdpApi::kFullyShard, Sharding::kFull, false, 2);
}
TEST(LlamaFsdp, FullyShardThreeRanksUnevenShardsWithActivationCheckpointing) {
  TrainOneStepAgainstTransformers(FsdpApi::kFullyShard, Sharding::kFull, true, 3);
}
TEST(LlamaFsdp, FullyShardFourRanksGradOp) {
  TrainOneStepAgainstTransformers(FsdpApi::kFullyShard, Sharding::kGradOp, false, 4);
}
TEST(LlamaFsdp, Fsdp1TwoRanks) {
  TrainOneStepAgainstTransformers(FsdpApi::kFsdp1, Sharding::kFull, false, 2);
}
TEST(LlamaFsdp, Fsdp1ThreeRanksWithActivationCheckpointing) {
  TrainOneStepAgainstTransformers(FsdpApi::kFsdp1, Sharding::kFull, true, 3);
}
TEST(LlamaFsdp, Fsdp1FourRanksHybrid) {
  TrainOneStepAgainstTransformers(FsdpApi::kFsdp1, Sharding::kHybrid, false, 4);
}

}  // namespace
