// SaveFsdpFullCheckpoint on real ranks: the file equals what the gathered
// FULL state dicts (GetModelStateDict(kFull) + FullOptimStateDict) hold,
// bit for bit, under every sharding strategy on 1, 2, 3 and 4 ranks
// (hybrid); and bad calls end on every rank with an error, the group still
// usable afterwards.
#include "state_dict/fsdp/fsdp_full_checkpoint.h"

#include <cstdlib>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "comm/collectives.h"
#include "comm/device_mesh.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "module_call/call.h"
#include "module_call/wrap_policy.h"
#include "state_dict/checkpoint.h"
#include "state_dict/fsdp/fsdp_optim_state_dict.h"
#include "state_dict/fsdp/fsdp_state_dict.h"
#include "testing/multiprocess.h"

namespace state_dict {
namespace {

using fsdp::FullyShardedDataParallel;
using ::testing::HasSubstr;

// Three wrapped units whose flat parameters (42, 28 and 10 elements) split
// unevenly, so that shards cut parameters in the middle; a root buffer.
struct ChainImpl : torch::nn::Module {
  ChainImpl() {
    torch::manual_seed(7);
    first = register_module("first", torch::nn::Linear(6, 6));
    second = register_module("second", torch::nn::Linear(6, 4));
    third = register_module("third", torch::nn::Linear(4, 2));
    shift = register_buffer("shift", torch::linspace(-1, 1, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::tanh(module_call::call(first, x));
    x = torch::tanh(module_call::call(second, x) + shift);
    return module_call::call(third, x);
  }
  torch::nn::Linear first{nullptr}, second{nullptr}, third{nullptr};
  torch::Tensor shift;
};
TORCH_MODULE(Chain);

std::string TmpDir(const std::string& name) {
  const char* root = std::getenv("TEST_TMPDIR");
  return std::string(root != nullptr ? root : "/tmp") + "/" + name;
}

// One AdamW step on a batch that depends on the rank, so that the state is
// not the same everywhere before the reduction.
void Train(FullyShardedDataParallel& model, torch::optim::Optimizer& optim, int rank) {
  torch::manual_seed(100 + rank);
  optim.zero_grad();
  model.forward(torch::randn({5, 6})).pow(2).mean().backward();
  optim.step();
}

// The SHARDED model and optimizer state, merged (what the trainer saves).
FsdpModelStateDict ShardedState(FullyShardedDataParallel& model,
                                const torch::optim::Optimizer& optim) {
  auto model_sd = GetModelStateDict(model, StateDictType::kSharded);
  EXPECT_TRUE(model_sd.ok()) << model_sd.status();
  auto optim_sd = ShardedOptimStateDict(model, optim);
  EXPECT_TRUE(optim_sd.ok()) << optim_sd.status();
  auto both = MergeShardedStateDicts(*model_sd, *optim_sd);
  EXPECT_TRUE(both.ok()) << both.status();
  return *both;
}

// What the gathering path holds on rank 0, under the sharded names
// ("<fqn>", "<fqn>/<entry>"); empty elsewhere.
TensorDict GatheredReference(FullyShardedDataParallel& model,
                             const torch::optim::Optimizer& optim) {
  StateDictConfig rank0_only;
  rank0_only.rank0_only = true;
  auto full = GetModelStateDict(model, StateDictType::kFull, rank0_only);
  EXPECT_TRUE(full.ok()) << full.status();
  auto optim_full = FullOptimStateDict(model, optim, /*rank0_only=*/true);
  EXPECT_TRUE(optim_full.ok()) << optim_full.status();
  TensorDict out = full->full;
  for (const auto& [key, entries] : optim_full->state) {
    for (const auto& entry : entries) {
      out.insert(std::get<std::string>(key) + "/" + entry.key(), entry.value());
    }
  }
  return out;
}

void ExpectSavedEqualsGathered(const comm::ProcessGroup& group,
                               const FullyShardedDataParallel::Options& options,
                               const std::string& what) {
  FullyShardedDataParallel model(Chain(), options);
  torch::optim::AdamW optim(model.parameters(), torch::optim::AdamWOptions(0.01));
  Train(model, optim, group.rank());
  Train(model, optim, group.rank());
  const FsdpModelStateDict state = ShardedState(model, optim);
  const TensorDict want = GatheredReference(model, optim);

  const std::string root = TmpDir("full_" + what + "_" + std::to_string(group.size()));
  absl::Status saved = SaveFsdpFullCheckpoint(root, 2, state, group);
  ASSERT_TRUE(saved.ok()) << what << ": " << saved;
  comm::barrier(group).wait();
  if (group.rank() != 0) return;
  auto loaded = LoadFullStateDict(StepDirectory(root, 2));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->size(), state.sharded.size()) << what;
  ASSERT_EQ(loaded->size(), want.size()) << what;
  for (size_t i = 0; i < loaded->size(); ++i) {
    // The dict's order, and the gathered values bit for bit.
    const std::string& key = (*loaded)[i].key();
    EXPECT_EQ(key, state.sharded[i].key()) << what;
    const torch::Tensor* expected = want.find(key);
    ASSERT_NE(expected, nullptr) << what << ": " << key;
    const torch::Tensor& got = (*loaded)[i].value();
    EXPECT_EQ(got.scalar_type(), expected->scalar_type()) << what << ": " << key;
    EXPECT_EQ(got.sizes(), expected->sizes()) << what << ": " << key;
    EXPECT_TRUE(got.equal(*expected)) << what << ": " << key << "\n"
                                      << got << "\nvs\n"
                                      << *expected;
  }
}

FullyShardedDataParallel::Options Options(const comm::ProcessGroup& group,
                                          fsdp::ShardingStrategy strategy, bool use_orig_params) {
  FullyShardedDataParallel::Options o;
  o.process_group = group;
  o.auto_wrap_policy = module_call::module_type_auto_wrap_policy<torch::nn::LinearImpl>();
  o.sharding_strategy = strategy;
  o.use_orig_params = use_orig_params;
  return o;
}

void EveryStrategy(comm::ProcessGroup& group) {
  ExpectSavedEqualsGathered(group, Options(group, fsdp::ShardingStrategy::kFullShard, true),
                            "FULL_SHARD");
  ExpectSavedEqualsGathered(group, Options(group, fsdp::ShardingStrategy::kShardGradOp, false),
                            "SHARD_GRAD_OP_flat");
  ExpectSavedEqualsGathered(group, Options(group, fsdp::ShardingStrategy::kNoShard, true),
                            "NO_SHARD");
}

TEST(SaveFsdpFullCheckpoint, EqualsTheGatheredStateOn1Rank) {
  comm::testing::RunOnRanks(1, EveryStrategy);
}
TEST(SaveFsdpFullCheckpoint, EqualsTheGatheredStateOn2Ranks) {
  comm::testing::RunOnRanks(2, EveryStrategy);
}
TEST(SaveFsdpFullCheckpoint, EqualsTheGatheredStateOn3Ranks) {
  comm::testing::RunOnRanks(3, EveryStrategy);
}

// HYBRID_SHARD, 2 replicas x 2 shards: the replicas send nothing.
TEST(SaveFsdpFullCheckpoint, EqualsTheGatheredStateUnderHybridShard) {
  comm::testing::RunOnRanks(4, [](comm::ProcessGroup& world) {
    auto mesh = comm::init_hybrid_shard_mesh(world, 2, 2);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    FullyShardedDataParallel::Options o;
    o.auto_wrap_policy = module_call::module_type_auto_wrap_policy<torch::nn::LinearImpl>();
    o.sharding_strategy = fsdp::ShardingStrategy::kHybridShard;
    o.use_orig_params = true;
    o.device_mesh = *mesh;
    ExpectSavedEqualsGathered(world, o, "HYBRID_SHARD");
  });
}

// Bad calls end on every rank with an error, and every message has been
// received: the group still works afterwards.
TEST(SaveFsdpFullCheckpoint, BadCallsFailOnEveryRank) {
  comm::testing::RunOnRanks(3, [](comm::ProcessGroup& group) {
    FullyShardedDataParallel model(Chain(),
                                   Options(group, fsdp::ShardingStrategy::kFullShard, true));
    torch::optim::AdamW optim(model.parameters(), torch::optim::AdamWOptions(0.01));
    Train(model, optim, group.rank());
    const FsdpModelStateDict state = ShardedState(model, optim);
    const std::string root = TmpDir("full_bad");
    auto still_works = [&] {
      torch::Tensor one = torch::ones({1});
      comm::all_reduce(group, one).wait();
      EXPECT_EQ(one.item<float>(), 3.0f);
    };

    {  // rank 1 passes another shape for one tensor
      FsdpModelStateDict changed = state;
      if (group.rank() == 1) changed.sharded["second.weight"].global_shape = {24};
      absl::Status s = SaveFsdpFullCheckpoint(root, 1, changed, group);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr("'second.weight' (entry "));
      EXPECT_THAT(std::string(s.message()), HasSubstr("differs between rank 0 and rank 1"));
    }
    {  // rank 2 leaves an entry out
      FsdpModelStateDict fewer = state;
      if (group.rank() == 2) fewer.sharded.erase("shift");
      absl::Status s = SaveFsdpFullCheckpoint(root, 1, fewer, group);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(std::string(s.message()),
                  HasSubstr("different numbers of tensors (25, 25, 24 on ranks 0 to 2)"));
    }
    {  // rank 1 drops its pieces of first.weight: part of it is nowhere
      FsdpModelStateDict holes = state;
      if (group.rank() == 1) holes.sharded["first.weight"].pieces.clear();
      absl::Status s = SaveFsdpFullCheckpoint(root, 1, holes, group);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr("'first.weight': the ranks' pieces cover"));
    }
    {  // two pieces on one rank
      FsdpModelStateDict doubled = state;
      if (group.rank() == 0) {
        ShardedTensor& t = doubled.sharded["first.weight"];  // rank 0 holds [0, 14)
        t.pieces.push_back(t.pieces.front());
      }
      absl::Status s = SaveFsdpFullCheckpoint(root, 1, doubled, group);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(std::string(s.message()),
                  HasSubstr(group.rank() == 0 ? "'first.weight' has 2 pieces on rank 0"
                                              : "'first.weight': rank 0 holds more than one"));
    }
    still_works();
    EXPECT_FALSE(LatestCheckpoint(root).ok()) << "nothing committed by a failed save";

    // Rank 0's write fails (the step is complete already) after the others
    // began sending: rank 0 drains them and returns its own error.
    ASSERT_TRUE(SaveFsdpFullCheckpoint(root, 1, state, group).ok());
    comm::barrier(group).wait();
    absl::Status again = SaveFsdpFullCheckpoint(root, 1, state, group);
    if (group.rank() == 0) {
      EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists) << again;
    } else {
      EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
      EXPECT_THAT(std::string(again.message()), HasSubstr("failed on rank 0, which writes it"));
    }
    still_works();
  });
}

}  // namespace
}  // namespace state_dict
