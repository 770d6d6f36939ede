// The runtime's asynchronous gradient reduction (post_backward starts it,
// the end-of-backward callback finishes it): gradients are final when
// backward returns, and a reduction that fails in flight (a peer died)
// surfaces as an exception from backward instead of a hang or a silent drop.
// With activation checkpointing, no reduction is in flight while a unit's
// recomputation is differentiated (where its backward peaks).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>
#include <torch/utils.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include "activation_checkpointing/apply_activation_checkpointing.h"
#include "testing/multiprocess.h"
#include "fsdp/fully_sharded_data_parallel.h"

namespace fsdp {
namespace {

torch::nn::Sequential MakeNet() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 4));
}

at::Tensor Input(int rank) {
  torch::manual_seed(10 + rank);
  return torch::randn({3, 8});
}

FullyShardedDataParallel::Options Wrapped(comm::ProcessGroup& pg, ShardingStrategy s) {
  FullyShardedDataParallel::Options options;
  options.process_group = pg;
  options.sharding_strategy = s;
  options.use_orig_params = true;
  options.auto_wrap_policy = module_call::module_type_auto_wrap_policy<torch::nn::LinearImpl>();
  return options;
}

// After backward returns every unit's gradient is the average over ranks.
TEST(AsyncReduce, GradsAreFinalWhenBackwardReturns) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
      SCOPED_TRACE(sharding_strategy_name(strategy));
      auto ref = MakeNet();
      for (int r = 0; r < 2; ++r) ref->forward(Input(r)).pow(2).sum().backward();
      FullyShardedDataParallel model(MakeNet(), Wrapped(pg, strategy));
      model.forward(Input(pg.rank())).pow(2).sum().backward();
      for (const auto* handle : model.handles()) {
        if (handle == nullptr) continue;  // the root owns no parameters
        EXPECT_FALSE(handle->reduce_grad_pending());
        EXPECT_FALSE(handle->unsharded_grad().defined());
        ASSERT_TRUE(handle->flat_param().grad().defined());
      }
      FullyShardedDataParallel::SummonOptions summon;
      summon.writeback = false;
      summon.with_grads = true;
      auto guard = model.summon_full_params(summon);
      auto params = model.module()->named_parameters();
      for (const auto& item : ref->named_parameters()) {
        ASSERT_TRUE(params[item.key()].grad().defined()) << item.key();
        EXPECT_TRUE(torch::allclose(params[item.key()].grad(), item.value().grad() / 2, 1e-5, 1e-6))
            << item.key();
      }
    }
  });
}

// Rank 1 dies after forward; rank 0's backward starts reductions that can
// never complete: backward throws (within the group's timeout) and the next
// backward does not hang on the dropped reductions either.
TEST(AsyncReduce, PeerDeathSurfacesFromBackward) {
  comm::testing::RunOptions options;
  options.collective_timeout = std::chrono::seconds(10);
  options.closing_barrier = false;
  comm::testing::RunOnRanks(
      2,
      [](comm::ProcessGroup& pg) {
        FullyShardedDataParallel model(MakeNet(), Wrapped(pg, ShardingStrategy::kNoShard));
        model.forward(Input(pg.rank())).pow(2).sum().backward();  // both alive
        at::Tensor loss = model.forward(Input(pg.rank())).pow(2).sum();
        if (pg.rank() == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          _exit(0);
        }
        const auto start = std::chrono::steady_clock::now();
        EXPECT_THROW(loss.backward(), c10::Error);
        EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                  10.0);
        for (const auto* handle : model.handles()) {
          if (handle != nullptr) {
            EXPECT_FALSE(handle->reduce_grad_pending());
          }
        }
        // The next iteration fails again (the peer is gone), quickly.
        const auto again = std::chrono::steady_clock::now();
        try {
          model.forward(Input(pg.rank())).pow(2).sum().backward();
          ADD_FAILURE() << "backward with a dead peer succeeded";
        } catch (const c10::Error&) {
        }
        EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - again).count(),
                  10.0);
      },
      options);
}

// A Linear + tanh unit whose recomputation (the only forward of a
// checkpointed module that runs with grad enabled) calls `probe` from
// inside its own backward.
struct ProbedImpl : torch::nn::Module {
  ProbedImpl() { fc = register_module("fc", torch::nn::Linear(64, 64)); }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = fc(x);
    if (h.requires_grad() && probe) {
      h.register_hook([p = probe](const at::Tensor&) { p(); });
    }
    return torch::tanh(h);
  }
  torch::nn::Linear fc{nullptr};
  std::function<void()> probe;
};
TORCH_MODULE(Probed);

// Each unit's reduction is started by its post-backward and may overlap the
// next unit's backward; for a checkpointed unit it is finished before that
// unit's recomputation is differentiated (its buffers would otherwise be
// alive at the unit's memory peak). Checked from inside every
// recomputation's backward: no unit has a reduction pending. The gradients
// still average the ranks' (GradsAreFinalWhenBackwardReturns covers the
// values; fsdp_features_test checks checkpointing changes no bit).
TEST(AsyncReduce, NoReductionInFlightWhenARecomputationIsDifferentiated) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                          ShardingStrategy::kNoShard}) {
      SCOPED_TRACE(sharding_strategy_name(strategy));
      torch::manual_seed(0);
      torch::nn::Sequential net(Probed(), Probed(), Probed(), torch::nn::Linear(64, 4));
      ASSERT_EQ(activation_checkpointing::apply_activation_checkpointing(
                    net, module_call::module_type_auto_wrap_policy<ProbedImpl>())
                    .size(),
                3u);
      FullyShardedDataParallel::Options options = Wrapped(pg, strategy);
      options.auto_wrap_policy = module_call::module_type_auto_wrap_policy<ProbedImpl>();
      FullyShardedDataParallel model(net, options);
      int probes = 0, pending = 0;
      for (int i = 0; i < 3; ++i) {
        net[i]->as<ProbedImpl>()->probe = [&model, &probes, &pending] {
          ++probes;
          for (const auto* handle : model.handles()) {
            if (handle != nullptr && handle->reduce_grad_pending()) ++pending;
          }
        };
      }
      for (int step = 0; step < 3; ++step) {
        torch::manual_seed(10 + pg.rank());
        model.forward(torch::randn({8, 64})).pow(2).sum().backward();
      }
      EXPECT_EQ(probes, 9);  // 3 units x 3 steps: every recomputation probed
      EXPECT_EQ(pending, 0);
    }
  });
}

}  // namespace
}  // namespace fsdp
