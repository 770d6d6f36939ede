// The trainer's --activation-checkpointing=block (issue #15): the blocks'
// activations are recomputed in backward, which changes when they exist but
// not what is computed, so the loss sequence must equal the run without it
// bitwise (1 rank: FULL_SHARD's one-rank shard group; 2 ranks: FULL_SHARD
// and SHARD_GRAD_OP, bf16 too). And the flag on a model without blocks is an
// error that says so.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "testing/multiprocess.h"
#include "trainer/options.h"
#include "trainer/train.h"

namespace {

using ::testing::HasSubstr;

trainer::Options SmallTransformer() {
  trainer::Options o;
  o.model = trainer::ModelKind::kTransformer;
  o.data = trainer::DataKind::kSynthetic;
  o.steps = 6;
  o.global_batch = 4;
  o.layers = 3;
  o.dim = 32;
  o.heads = 4;
  o.vocab = 64;
  o.seq = 32;
  o.warmup_steps = 2;
  return o;
}

std::vector<double> Losses(trainer::Options o, const comm::ProcessGroup& pg) {
  auto result = trainer::Train(o, pg);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? result->losses : std::vector<double>();
}

void ExpectSameLosses(trainer::Options o, const comm::ProcessGroup& pg, const std::string& what) {
  o.activation_checkpointing = trainer::ActivationCheckpointing::kNone;
  const auto plain = Losses(o, pg);
  o.activation_checkpointing = trainer::ActivationCheckpointing::kBlock;
  const auto checkpointed = Losses(o, pg);
  ASSERT_EQ(plain.size(), static_cast<size_t>(o.steps)) << what;
  ASSERT_EQ(checkpointed.size(), plain.size()) << what;
  for (size_t i = 0; i < plain.size(); ++i) {
    // Exact: same operations in the same order.
    EXPECT_EQ(checkpointed[i], plain[i]) << what << " step " << i + 1;
  }
}

comm::testing::RunOptions LongRun() {
  comm::testing::RunOptions options;
  options.timeout = std::chrono::seconds(240);
  options.collective_timeout = std::chrono::seconds(60);
  return options;
}

TEST(TrainerActivationCheckpointing, OneRankSameLossesBitwise) {
  comm::testing::RunOnRanks(
      1, [](comm::ProcessGroup& pg) { ExpectSameLosses(SmallTransformer(), pg, "1 rank"); },
      LongRun());
}

TEST(TrainerActivationCheckpointing, TwoRanksSameLossesBitwise) {
  comm::testing::RunOnRanks(
      2,
      [](comm::ProcessGroup& pg) {
        auto o = SmallTransformer();
        o.nproc = 2;
        o.sharding = trainer::Sharding::kFull;
        ExpectSameLosses(o, pg, "2 ranks FULL_SHARD");
        o.sharding = trainer::Sharding::kGradOp;
        o.mixed_precision = trainer::MixedPrecision::kBf16;
        ExpectSameLosses(o, pg, "2 ranks SHARD_GRAD_OP bf16");
      },
      LongRun());
}

TEST(TrainerActivationCheckpointing, ModelWithoutBlocksIsAnError) {
  comm::testing::RunOnRanks(
      1,
      [](comm::ProcessGroup& pg) {
        auto o = SmallTransformer();
        o.model = trainer::ModelKind::kMlp;
        o.activation_checkpointing = trainer::ActivationCheckpointing::kBlock;
        auto result = trainer::Train(o, pg);
        ASSERT_FALSE(result.ok());
        EXPECT_THAT(std::string(result.status().message()),
                    HasSubstr("--activation-checkpointing=block: the mlp model has no "
                              "decoder layers to checkpoint"));
      },
      LongRun());
}

}  // namespace
