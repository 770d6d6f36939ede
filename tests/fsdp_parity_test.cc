// FSDP training parity (issue #7): the same models, data and seed trained
// for 20 Adam steps without FSDP in one process and with FSDP on 2 and 4
// ranks (the global batch split over the data-parallel ranks) for every
// sharding strategy, nested auto-wrap on, with and without use_orig_params,
// and each backward-prefetch mode; the full parameters must match the
// reference after every step (float32, rtol 1e-5). Issue #15: the same
// cases again with activation checkpointing on (the blocks, or the
// Sequential's Linears: FSDP units and a module of the root unit), against
// the same uncheckpointed single-process reference.
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/types.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "activation_checkpointing/apply_activation_checkpointing.h"
#include "comm/device_mesh.h"
#include "testing/multiprocess.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "module_call/wrap_policy.h"
#include "tests/fsdp_test_models.h"

namespace fsdp_test {
namespace {

using fsdp::BackwardPrefetch;
using fsdp::FullyShardedDataParallel;
using fsdp::ShardingStrategy;

constexpr int kSteps = 20;
constexpr double kLr = 1e-2;

enum class ModelKind { kModuleList, kSequential };

struct Case {
  ModelKind model;
  ShardingStrategy strategy;
  bool use_orig_params;
  BackwardPrefetch prefetch;
  bool forward_prefetch;
  bool checkpointing = false;
};

std::string Describe(const Case& c) {
  static const char* prefetch[] = {"none", "BACKWARD_PRE", "BACKWARD_POST"};
  return std::string(c.model == ModelKind::kModuleList ? "ModuleList" : "Sequential") + "/" +
         fsdp::sharding_strategy_name(c.strategy) +
         "/use_orig_params=" + (c.use_orig_params ? "1" : "0") +
         "/prefetch=" + prefetch[static_cast<int>(c.prefetch)] +
         "/forward_prefetch=" + (c.forward_prefetch ? "1" : "0") +
         (c.checkpointing ? "/activation_checkpointing" : "");
}

// Reference parameters after each step: one process, full batch.
template <typename Model>
std::vector<std::map<std::string, at::Tensor>> Reference(Model model) {
  torch::optim::Adam optim(model->parameters(), torch::optim::AdamOptions(kLr));
  std::vector<std::map<std::string, at::Tensor>> out;
  for (int step = 0; step < kSteps; ++step) {
    Batch b = GlobalBatch(step);
    optim.zero_grad();
    Loss(model->forward(b.x), b.y).backward();
    optim.step();
    out.push_back(Snapshot(*model));
  }
  return out;
}

template <typename Model>
void TrainAndCompare(Model model, FullyShardedDataParallel::Options options, const Case& c,
                     int dp_rank, int dp_world,
                     const std::vector<std::map<std::string, at::Tensor>>& reference) {
  options.sharding_strategy = c.strategy;
  options.use_orig_params = c.use_orig_params;
  options.backward_prefetch = c.prefetch;
  options.forward_prefetch = c.forward_prefetch;
  if (c.checkpointing) {
    // Blocks (units), or the Sequential's Linears 0 and 2 (units) and 4
    // (a module of the root unit).
    const auto chosen = activation_checkpointing::apply_activation_checkpointing(
        model, c.model == ModelKind::kModuleList
                   ? module_call::module_type_auto_wrap_policy<BlockImpl>()
                   : module_call::custom_auto_wrap_policy(
                         [](const torch::nn::Module&, const std::string& fqn, int64_t) {
                           return fqn == "0" || fqn == "2" || fqn == "4";
                         }));
    ASSERT_EQ(chosen.size(), 3u);
  }
  FullyShardedDataParallel fsdp_model(model, options);
  ASSERT_GT(fsdp_model.fsdp_modules().size(), 1u) << "nested auto-wrap made no unit";
  torch::optim::Adam optim(fsdp_model.parameters(), torch::optim::AdamOptions(kLr));
  for (int step = 0; step < kSteps; ++step) {
    Batch b = LocalBatch(step, dp_rank, dp_world);
    optim.zero_grad();
    Loss(fsdp_model(b.x), b.y).backward();
    optim.step();
    ExpectClose(FullSnapshot(fsdp_model), reference[step],
                Describe(c) + " step " + std::to_string(step));
    if (::testing::Test::HasFailure()) return;
  }
}

std::vector<Case> Cases(const std::vector<ShardingStrategy>& strategies,
                        bool checkpointing = false) {
  std::vector<Case> cases;
  int k = 0;
  for (auto model : {ModelKind::kModuleList, ModelKind::kSequential}) {
    for (auto strategy : strategies) {
      for (bool orig : {false, true}) {
        // Rotate the prefetch modes so each strategy meets all of them.
        const auto prefetch = static_cast<BackwardPrefetch>(k % 3);
        cases.push_back(Case{model, strategy, orig, prefetch, k % 2 == 1, checkpointing});
        ++k;
      }
    }
  }
  return cases;
}

void RunCases(const std::vector<Case>& cases, FullyShardedDataParallel::Options base, int dp_rank,
              int dp_world) {
  const auto list_reference = Reference(Net());
  const auto seq_reference = Reference(MakeSequential());
  for (const auto& c : cases) {
    SCOPED_TRACE(Describe(c));
    if (c.model == ModelKind::kModuleList) {
      auto options = base;
      options.auto_wrap_policy = module_call::module_type_auto_wrap_policy<BlockImpl>();
      TrainAndCompare(Net(), options, c, dp_rank, dp_world, list_reference);
    } else {
      auto options = base;
      // Wraps the 6x8 and 8x8 Linears (56 and 72 parameters); the root keeps
      // the last one (27).
      options.auto_wrap_policy = module_call::size_based_auto_wrap_policy(50);
      TrainAndCompare(MakeSequential(), options, c, dp_rank, dp_world, seq_reference);
    }
    if (::testing::Test::HasFailure()) return;
  }
}

comm::testing::RunOptions LongRun() {
  comm::testing::RunOptions options;
  options.timeout = std::chrono::seconds(240);
  options.collective_timeout = std::chrono::seconds(60);
  return options;
}

const std::vector<ShardingStrategy> kFlatStrategies = {
    ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard};

// FULL_SHARD, SHARD_GRAD_OP and NO_SHARD over one world of `world_size` ranks.
void RunFlatStrategies(int world_size, bool checkpointing = false) {
  comm::testing::RunOnRanks(
      world_size,
      [checkpointing](comm::ProcessGroup& pg) {
        FullyShardedDataParallel::Options options;
        options.process_group = pg;
        RunCases(Cases(kFlatStrategies, checkpointing), options, pg.rank(), pg.size());
      },
      LongRun());
}

TEST(FsdpParity, TwoRanksAllStrategies) { RunFlatStrategies(2); }

TEST(FsdpParity, TwoRanksAllStrategiesWithActivationCheckpointing) {
  RunFlatStrategies(2, /*checkpointing=*/true);
}

TEST(FsdpParity, FourRanksAllStrategies) { RunFlatStrategies(4); }

TEST(FsdpParity, HybridShardTwoByTwo) {
  comm::testing::RunOnRanks(
      4,
      [](comm::ProcessGroup& pg) {
        auto mesh = comm::init_hybrid_shard_mesh(pg, /*replicate_size=*/2, /*shard_size=*/2);
        ASSERT_TRUE(mesh.ok()) << mesh.status();
        FullyShardedDataParallel::Options options;
        options.device_mesh = *mesh;
        RunCases(Cases({ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2}),
                 options, pg.rank(), pg.size());
      },
      LongRun());
}

TEST(FsdpParity, HybridShardTwoByTwoWithActivationCheckpointing) {
  comm::testing::RunOnRanks(
      4,
      [](comm::ProcessGroup& pg) {
        auto mesh = comm::init_hybrid_shard_mesh(pg, /*replicate_size=*/2, /*shard_size=*/2);
        ASSERT_TRUE(mesh.ok()) << mesh.status();
        FullyShardedDataParallel::Options options;
        options.device_mesh = *mesh;
        RunCases(Cases({ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2},
                       /*checkpointing=*/true),
                 options, pg.rank(), pg.size());
      },
      LongRun());
}

}  // namespace
}  // namespace fsdp_test
