// FlatParamHandle on real ranks (comm::testing::RunOnRanks): sharding,
// unshard/reshard and storage, views, gradient reduction against per-rank
// reference gradients computed locally, tied weights, mixed precision,
// use_orig_params, no_sync, hybrid sharding, writeback.
#include "fsdp/flat_param.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <chrono>
#include <string>
#include <thread>
#include <unistd.h>
#include <unordered_set>
#include <vector>

#include "comm/collectives.h"
#include "comm/device_mesh.h"
#include "testing/multiprocess.h"
#include "functorch/module/named_member_accessor.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;

// 3 -> 4 -> 3: 12 + 4 + 12 + 3 = 31 parameters, odd, so 2 and 4 ranks pad.
torch::nn::Sequential MakeMlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::Tanh(), torch::nn::Linear(4, 3));
}

// 4 -> 4 -> 4 with the second layer's weight tied to the first's.
torch::nn::Sequential MakeTied() {
  torch::manual_seed(1);
  torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::Tanh(), torch::nn::Linear(4, 4));
  functorch::NamedMemberAccessor accessor(seq);
  accessor.set_tensor("2.weight", accessor.get_tensor("0.weight"));
  return seq;
}

std::vector<std::string> ParamNames(const torch::nn::Module& module) {
  std::vector<std::string> names;
  for (const auto& item : module.named_parameters()) names.push_back(item.key());
  return names;
}

// Parameters in registration order, each tensor once (tied weights).
std::vector<at::Tensor> UniqueParams(const torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : module.parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

at::Tensor RankInput(int rank, int64_t features, int iteration = 0) {
  torch::manual_seed(100 + 10 * iteration + rank);
  return torch::randn({2, features});
}

at::Tensor Loss(const at::Tensor& out) { return out.to(at::kFloat).pow(2).sum(); }

// The flat (padded) gradient of a fresh reference module summed over
// `inputs`, divided by `divisor`: the average over ranks of what each rank's
// module would compute on its own input.
template <typename Make>
at::Tensor ReferenceFlatGrad(Make make, const std::vector<at::Tensor>& inputs, double divisor,
                             int64_t pad_to) {
  auto model = make();
  for (const auto& x : inputs) Loss(model->forward(x)).backward();
  std::vector<at::Tensor> grads;
  for (const auto& p : UniqueParams(*model)) grads.push_back(p.grad());
  return flatten_tensors(grads, pad_to) / divisor;
}

at::Tensor ShardOf(const at::Tensor& flat, int64_t rank, int64_t world) {
  const int64_t n = flat.numel() / world;
  return flat.narrow(0, rank * n, n);
}

// ---------------------------------------------------------------------------

TEST(FlattenTensors, RoundTripIsBitExactAndPadded) {
  torch::manual_seed(3);
  std::vector<at::Tensor> tensors = {
      torch::randn({3, 5}), torch::randn({7}), torch::randn({}),
      torch::randn({4, 2}).t(),  // non-contiguous: read in logical order
      torch::randn({2, 1, 3})};
  std::vector<FlatParamInfo> infos;
  at::Tensor flat = flatten_tensors(tensors, /*pad_to_multiple=*/4, &infos);
  const int64_t total = 15 + 7 + 1 + 8 + 6;
  EXPECT_EQ(flat.numel(), 40);  // 37 rounded up to a multiple of 4
  EXPECT_TRUE(flat.narrow(0, total, 3).eq(0).all().item<bool>());
  ASSERT_EQ(infos.size(), tensors.size());
  EXPECT_EQ(infos[3].stride, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(infos[4].offset, 15 + 7 + 1 + 8);
  auto views = unflatten_views(flat, infos);
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_TRUE(torch::equal(views[i], tensors[i])) << "tensor " << i;
    EXPECT_EQ(views[i].data_ptr(), static_cast<char*>(flat.data_ptr()) + infos[i].offset * 4)
        << "views must alias the flat tensor, not copy";
  }
}

TEST(FlattenTensors, Errors) {
  try {
    flatten_tensors({torch::ones({2}), torch::ones({2}, at::kDouble)});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("tensor 1 is Double"));
    EXPECT_THAT(e.what(), HasSubstr("uniform dtype"));
  }
  EXPECT_THROW(flatten_tensors({torch::ones({2})}, 0), c10::Error);
  EXPECT_THROW(flatten_tensors({}), c10::Error);
}

TEST(GradientPredivideFactor, MatchesPyTorch) {
  EXPECT_EQ(gradient_predivide_factor(1), 1);
  EXPECT_EQ(gradient_predivide_factor(2), 2);
  EXPECT_EQ(gradient_predivide_factor(4), 2);
  EXPECT_EQ(gradient_predivide_factor(6), 4);
  EXPECT_EQ(gradient_predivide_factor(8), 4);
  EXPECT_EQ(gradient_predivide_factor(16), 4);
  EXPECT_EQ(gradient_predivide_factor(32), 8);
}

// Shard slices, padding, unshard on every rank, forward equality, storage
// bytes across reshard, and gradients equal to the average of per-rank
// gradients -- for each strategy that takes a single group.
void CheckShardUnshardAndGrads(comm::ProcessGroup& pg) {
  const int world = pg.size();
  for (auto strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard}) {
    SCOPED_TRACE(sharding_strategy_name(strategy));
    const bool sharded = uses_sharding(strategy);
    const int64_t shards = sharded ? world : 1;
    auto model = MakeMlp();
    auto reference = MakeMlp();
    const at::Tensor ref_flat = flatten_tensors(UniqueParams(*reference), shards);
    FlatParamOptions options;
    options.sharding_strategy = strategy;
    FlatParamHandle handle(model.ptr(), ParamNames(*model), pg, options);

    // The shard: rank r's contiguous chunk of the padded flat parameter.
    const int64_t padded = (31 + shards - 1) / shards * shards;
    EXPECT_EQ(handle.unpadded_numel(), 31);
    EXPECT_EQ(handle.padded_numel(), padded);
    EXPECT_EQ(handle.shard_numel(), padded / shards);
    const int64_t rank = sharded ? pg.rank() : 0;
    EXPECT_TRUE(torch::equal(handle.flat_param(), ShardOf(ref_flat, rank, shards)));
    EXPECT_TRUE(handle.flat_param().requires_grad());
    EXPECT_TRUE(handle.flat_param().is_leaf());
    EXPECT_EQ(handle.sharded_storage_nbytes(), padded / shards * 4);
    // The originals keep their identity and view this rank's part.
    const auto& infos = handle.param_infos();
    for (size_t i = 0; i < infos.size(); ++i) {
      EXPECT_TRUE(handle.orig_params()[i].is_same(model->named_parameters()[infos[i].fqn]));
      EXPECT_EQ(handle.orig_params()[i].numel(), infos[i].numel_in_shard);
    }
    if (sharded) {
      EXPECT_EQ(handle.unsharded_storage_nbytes(), 0);
    }

    // Unshard: the original parameters on every rank; forward equals the
    // unwrapped module's.
    handle.unshard();
    EXPECT_TRUE(handle.is_unsharded());
    EXPECT_EQ(handle.unsharded_storage_nbytes(), padded * 4);
    EXPECT_TRUE(torch::equal(handle.unsharded_flat_param().detach(), ref_flat));
    handle.use_unsharded_views();
    for (const auto& item : reference->named_parameters()) {
      EXPECT_TRUE(torch::equal(model->named_parameters()[item.key()], item.value())) << item.key();
    }
    // Views, not copies: each parameter points into the gathered buffer.
    for (const auto& info : infos) {
      EXPECT_EQ(model->named_parameters()[info.fqn].data_ptr(),
                static_cast<char*>(handle.unsharded_flat_param().data_ptr()) + info.offset * 4)
          << info.fqn;
    }
    const at::Tensor x = RankInput(pg.rank(), 3);
    const at::Tensor out = model->forward(x);
    EXPECT_TRUE(torch::equal(out, reference->forward(x)));

    // FULL_SHARD frees the gathered memory after forward and gathers again
    // before backward: autograd's saved views must see the re-gathered data.
    if (handle.reshard_after_forward()) {
      handle.reshard();
      EXPECT_EQ(handle.unsharded_storage_nbytes(), 0);
      handle.unshard();
    }
    int hook_calls = 0;
    handle.register_post_backward_hook([&] { ++hook_calls; });
    Loss(out).backward();
    EXPECT_EQ(hook_calls, 1);
    ASSERT_TRUE(handle.unsharded_grad().defined());
    EXPECT_TRUE(handle.reduce_grad());
    EXPECT_FALSE(handle.unsharded_grad().defined());
    handle.reshard();
    if (sharded) {
      EXPECT_EQ(handle.unsharded_storage_nbytes(), 0);
      // The freed block is kept for the next unshard, within the cache's
      // bound, until released.
      EXPECT_LE(cached_unsharded_bytes(), 2 * padded * 4);
      release_cached_unsharded_memory();
      EXPECT_EQ(cached_unsharded_bytes(), 0);
    }
    EXPECT_EQ(handle.sharded_storage_nbytes(), padded / shards * 4);

    std::vector<at::Tensor> inputs;
    for (int r = 0; r < world; ++r) inputs.push_back(RankInput(r, 3));
    const at::Tensor expected =
        ShardOf(ReferenceFlatGrad(MakeMlp, inputs, world, shards), rank, shards);
    ASSERT_TRUE(handle.flat_param().grad().defined());
    EXPECT_TRUE(torch::allclose(handle.flat_param().grad(), expected, 1e-5, 1e-6))
        << handle.flat_param().grad() << "\nexpected\n"
        << expected;

    // A second iteration accumulates into the sharded gradient.
    handle.unshard();
    handle.use_unsharded_views();
    Loss(model->forward(x)).backward();
    EXPECT_EQ(hook_calls, 2);
    handle.reduce_grad();
    handle.reshard();
    EXPECT_TRUE(torch::allclose(handle.flat_param().grad(), 2 * expected, 1e-5, 1e-6));
  }
}

TEST(FlatParamHandle, ShardUnshardGrads1Rank) {
  comm::testing::RunOnRanks(1, CheckShardUnshardAndGrads);
}
TEST(FlatParamHandle, ShardUnshardGrads2Ranks) {
  comm::testing::RunOnRanks(2, CheckShardUnshardAndGrads);
}
TEST(FlatParamHandle, ShardUnshardGrads4Ranks) {
  comm::testing::RunOnRanks(4, CheckShardUnshardAndGrads);
}

TEST(FlatParamHandle, AsyncUnshardAndTinyParams) {
  // 2 parameter elements on 4 ranks: ranks 2 and 3 hold only padding.
  comm::testing::RunOnRanks(4, [](comm::ProcessGroup& pg) {
    torch::manual_seed(0);
    torch::nn::Linear model(torch::nn::LinearOptions(1, 1));
    FlatParamHandle handle(model.ptr(), {"weight", "bias"}, pg);
    EXPECT_EQ(handle.padded_numel(), 4);
    EXPECT_EQ(handle.shard_numel(), 1);
    if (pg.rank() >= 2) {
      EXPECT_EQ(handle.flat_param().item<float>(), 0.0f);
    }
    for (const auto& info : handle.param_infos()) {
      const bool owns = info.offset <= pg.rank() && pg.rank() < info.offset + info.numel;
      EXPECT_EQ(info.numel_in_shard, owns ? 1 : 0) << info.fqn;
    }
    handle.unshard(/*async=*/true);
    EXPECT_TRUE(handle.is_unsharding() || handle.is_unsharded());
    handle.use_unsharded_views();  // waits
    EXPECT_TRUE(handle.is_unsharded());
    torch::manual_seed(0);
    torch::nn::Linear reference(torch::nn::LinearOptions(1, 1));
    EXPECT_TRUE(torch::equal(model->weight, reference->weight));
    EXPECT_TRUE(torch::equal(model->bias, reference->bias));
    handle.reshard();
    EXPECT_EQ(handle.unsharded_storage_nbytes(), 0);
    EXPECT_EQ(model->weight.numel(), pg.rank() == 0 ? 1 : 0);
    EXPECT_EQ(model->bias.numel(), pg.rank() == 1 ? 1 : 0);
  });
}

// Two units over one module (as an outer unit whose inner submodule is its
// own unit): each flattens only the names it is given; both gathers are in
// flight at once (prefetch) before either is waited for.
TEST(FlatParamHandle, TwoUnitsPrefetchAndReduce) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    auto model = MakeMlp();
    FlatParamHandle inner(model.ptr(), {"2.weight", "2.bias"}, pg);
    FlatParamHandle outer(model.ptr(), {"0.weight", "0.bias"}, pg);
    EXPECT_EQ(inner.unpadded_numel(), 15);
    EXPECT_EQ(outer.unpadded_numel(), 16);
    outer.unshard(/*async=*/true);
    inner.unshard(/*async=*/true);
    outer.use_unsharded_views();
    inner.use_unsharded_views();
    auto reference = MakeMlp();
    const at::Tensor x = RankInput(pg.rank(), 3);
    const at::Tensor out = model->forward(x);
    EXPECT_TRUE(torch::equal(out, reference->forward(x)));
    outer.reshard();
    inner.reshard();
    EXPECT_EQ(outer.unsharded_storage_nbytes() + inner.unsharded_storage_nbytes(), 0);
    inner.unshard(/*async=*/true);
    outer.unshard(/*async=*/true);
    inner.wait_for_unshard();
    outer.wait_for_unshard();
    Loss(out).backward();
    EXPECT_TRUE(inner.reduce_grad());
    EXPECT_TRUE(outer.reduce_grad());
    inner.reshard();
    outer.reshard();
    std::vector<at::Tensor> inputs{RankInput(0, 3), RankInput(1, 3)};
    auto ref = MakeMlp();
    for (const auto& in : inputs) Loss(ref->forward(in)).backward();
    auto params = ref->named_parameters();
    const at::Tensor outer_flat =
        flatten_tensors({params["0.weight"].grad(), params["0.bias"].grad()}, 2) / 2;
    const at::Tensor inner_flat =
        flatten_tensors({params["2.weight"].grad(), params["2.bias"].grad()}, 2) / 2;
    EXPECT_TRUE(
        torch::allclose(outer.flat_param().grad(), ShardOf(outer_flat, pg.rank(), 2), 1e-5, 1e-6));
    EXPECT_TRUE(
        torch::allclose(inner.flat_param().grad(), ShardOf(inner_flat, pg.rank(), 2), 1e-5, 1e-6));
  });
}

TEST(FlatParamHandle, TiedParametersAreStoredOnce) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    auto model = MakeTied();
    // The caller lists only one name; the tie is found by identity.
    FlatParamHandle handle(model.ptr(), {"0.weight", "0.bias", "2.bias"}, pg);
    EXPECT_EQ(handle.unpadded_numel(), 16 + 4 + 4);
    ASSERT_EQ(handle.param_infos().size(), 3u);
    EXPECT_EQ(handle.param_infos()[0].alias_fqns, std::vector<std::string>{"2.weight"});
    EXPECT_THAT(handle.managed_fqns(), ::testing::Contains("2.weight"));

    handle.unshard();
    handle.use_unsharded_views();
    auto params = model->named_parameters();
    EXPECT_TRUE(params["0.weight"].is_same(params["2.weight"]));
    auto* lin2 = model[2]->as<torch::nn::Linear>();
    EXPECT_TRUE(lin2->weight.is_same(params["0.weight"]));

    auto reference = MakeTied();
    const at::Tensor x = RankInput(pg.rank(), 4);
    const at::Tensor out = model->forward(x);
    EXPECT_TRUE(torch::equal(out, reference->forward(x)));
    Loss(out).backward();
    handle.reduce_grad();
    handle.reshard();
    // Both uses of the tied weight contribute to its one gradient.
    std::vector<at::Tensor> inputs{RankInput(0, 4), RankInput(1, 4)};
    const at::Tensor expected = ShardOf(ReferenceFlatGrad(MakeTied, inputs, 2, 2), pg.rank(), 2);
    EXPECT_TRUE(torch::allclose(handle.flat_param().grad(), expected, 1e-5, 1e-6));
    // After reshard both names are the (same) original tensor again.
    params = model->named_parameters();
    EXPECT_TRUE(params["0.weight"].is_same(params["2.weight"]));
  });
}

TEST(FlatParamHandle, MixedPrecisionDtypes) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    for (bool keep_low : {false, true}) {
      SCOPED_TRACE(keep_low ? "keep_low_precision_grads" : "full-precision grads");
      auto model = MakeMlp();
      FlatParamOptions options;
      options.mixed_precision.param_dtype = at::kBFloat16;
      options.mixed_precision.reduce_dtype = at::kFloat;
      options.mixed_precision.keep_low_precision_grads = keep_low;
      FlatParamHandle handle(model.ptr(), ParamNames(*model), pg, options);
      EXPECT_EQ(handle.flat_param().scalar_type(), at::kFloat);
      EXPECT_EQ(handle.compute_dtype(), at::kBFloat16);
      EXPECT_EQ(handle.reduce_dtype(), at::kFloat);
      EXPECT_EQ(handle.unsharded_flat_param().scalar_type(), at::kBFloat16);

      handle.unshard(/*async=*/true);
      if (handle.is_unsharding()) {
        // The bf16 copy of the shard lives only while the gather runs.
        EXPECT_EQ(handle.low_precision_shard_nbytes(), handle.shard_numel() * 2);
      }
      handle.wait_for_unshard();
      EXPECT_EQ(handle.low_precision_shard_nbytes(), 0);
      EXPECT_EQ(handle.unsharded_storage_nbytes(), handle.padded_numel() * 2);
      handle.use_unsharded_views();
      EXPECT_EQ(model[0]->as<torch::nn::Linear>()->weight.scalar_type(), at::kBFloat16);
      auto reference = MakeMlp();
      const at::Tensor x = RankInput(pg.rank(), 3);
      const at::Tensor out = model->forward(x.to(at::kBFloat16));
      EXPECT_EQ(out.scalar_type(), at::kBFloat16);
      EXPECT_TRUE(torch::allclose(out.to(at::kFloat), reference->forward(x), 5e-2, 5e-2));
      Loss(out).backward();
      EXPECT_EQ(handle.unsharded_grad().scalar_type(), at::kBFloat16);
      handle.reduce_grad();
      handle.reshard();
      EXPECT_EQ(handle.unsharded_storage_nbytes(), 0);
      const at::Tensor grad = handle.flat_param().grad();
      EXPECT_EQ(grad.scalar_type(), keep_low ? at::kBFloat16 : at::kFloat);
      std::vector<at::Tensor> inputs{RankInput(0, 3), RankInput(1, 3)};
      const at::Tensor expected = ShardOf(ReferenceFlatGrad(MakeMlp, inputs, 2, 2), pg.rank(), 2);
      EXPECT_TRUE(torch::allclose(grad.to(at::kFloat), expected, 5e-2, 5e-2))
          << grad << "\nexpected\n"
          << expected;
    }

    // Reduction in float16 with predivide: only the division is observable.
    auto model = MakeMlp();
    FlatParamOptions options;
    options.mixed_precision.reduce_dtype = at::kHalf;
    FlatParamHandle handle(model.ptr(), ParamNames(*model), pg, options);
    EXPECT_EQ(handle.compute_dtype(), at::kFloat);
    EXPECT_EQ(handle.predivide_factor(), 2);
    EXPECT_EQ(handle.postdivide_factor(), 1);
    handle.unshard();
    handle.use_unsharded_views();
    Loss(model->forward(RankInput(pg.rank(), 3))).backward();
    handle.reduce_grad();
    handle.reshard();
    EXPECT_EQ(handle.flat_param().grad().scalar_type(), at::kFloat);
    std::vector<at::Tensor> inputs{RankInput(0, 3), RankInput(1, 3)};
    EXPECT_TRUE(torch::allclose(handle.flat_param().grad(),
                                ShardOf(ReferenceFlatGrad(MakeMlp, inputs, 2, 2), pg.rank(), 2),
                                1e-2, 1e-2));
  });
}

TEST(MixedPrecision, CastBuffersKeepsIdentityAndIntegers) {
  torch::nn::BatchNorm1d bn(3);
  const at::Tensor mean = bn->running_mean;
  cast_buffers(*bn, at::kBFloat16);
  EXPECT_TRUE(bn->running_mean.is_same(mean));
  EXPECT_EQ(bn->running_mean.scalar_type(), at::kBFloat16);
  EXPECT_EQ(bn->named_buffers()["running_var"].scalar_type(), at::kBFloat16);
  EXPECT_EQ(bn->num_batches_tracked.scalar_type(), at::kLong);
}

TEST(FlatParamHandle, UseOrigParamsViewsAndOptimizer) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    auto model = MakeMlp();
    model[0]->as<torch::nn::Linear>()->bias.set_requires_grad(false);  // frozen
    FlatParamOptions options;
    options.use_orig_params = true;
    FlatParamHandle handle(model.ptr(), ParamNames(*model), pg, options);
    // Outside forward the module's parameters are 1-D views of this rank's
    // part of the shard, sharing its memory.
    const auto& infos = handle.param_infos();
    std::vector<at::Tensor> trainable;
    for (size_t i = 0; i < infos.size(); ++i) {
      const at::Tensor p = model->named_parameters()[infos[i].fqn];
      EXPECT_EQ(p.dim(), 1);
      EXPECT_EQ(p.numel(), infos[i].numel_in_shard);
      if (p.numel() > 0) {
        EXPECT_EQ(p.data_ptr(), static_cast<char*>(handle.flat_param().data_ptr()) +
                                    infos[i].offset_in_shard * 4);
      }
      if (infos[i].requires_grad) trainable.push_back(p);
    }
    EXPECT_EQ(trainable.size(), 3u);
    torch::optim::SGD sgd(trainable, torch::optim::SGDOptions(0.5));

    auto reference = MakeMlp();
    reference[0]->as<torch::nn::Linear>()->bias.set_requires_grad(false);
    for (int step = 0; step < 2; ++step) {
      sgd.zero_grad();
      handle.unshard();
      handle.use_unsharded_views();
      EXPECT_EQ(model[0]->as<torch::nn::Linear>()->weight.sizes(), (std::vector<int64_t>{4, 3}));
      EXPECT_TRUE(torch::allclose(model->forward(RankInput(0, 3)),
                                  reference->forward(RankInput(0, 3)), 1e-5, 1e-6));
      Loss(model->forward(RankInput(pg.rank(), 3, step))).backward();
      handle.reduce_grad();
      handle.reshard();
      for (size_t i = 0; i < infos.size(); ++i) {
        const at::Tensor& orig = handle.orig_params()[i];
        if (!infos[i].requires_grad) {
          EXPECT_FALSE(orig.grad().defined()) << infos[i].fqn;
          continue;
        }
        ASSERT_TRUE(orig.grad().defined()) << infos[i].fqn;
        EXPECT_TRUE(
            torch::equal(orig.grad(), handle.flat_param().grad().narrow(0, infos[i].offset_in_shard,
                                                                        infos[i].numel_in_shard)));
      }
      sgd.step();
      // The same step on the unwrapped reference (frozen bias untouched).
      reference->zero_grad();
      Loss(reference->forward(RankInput(0, 3, step))).backward();
      Loss(reference->forward(RankInput(1, 3, step))).backward();
      torch::NoGradGuard no_grad;
      for (auto& p : reference->parameters()) {
        if (p.grad().defined()) p.sub_(0.5 * p.grad() / 2);
      }
    }
    // The optimizer's in-place updates reached the flat shard.
    const at::Tensor ref_flat = flatten_tensors(UniqueParams(*reference), 2);
    EXPECT_TRUE(
        torch::allclose(handle.flat_param().detach(), ShardOf(ref_flat, pg.rank(), 2), 1e-5, 1e-6));
  });
}

TEST(FlatParamHandle, MixedRequiresGradNeedsUseOrigParams) {
  comm::testing::RunOnRanks(1, [](comm::ProcessGroup& pg) {
    auto model = MakeMlp();
    model[2]->as<torch::nn::Linear>()->bias.set_requires_grad(false);
    try {
      FlatParamHandle handle(model.ptr(), ParamNames(*model), pg);
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("uniform `requires_grad` when `use_orig_params=False`"));
      EXPECT_THAT(e.what(), HasSubstr("'2.bias' has requires_grad=0"));
    }
    try {
      FlatParamHandle handle(model.ptr(), {"0.weight", "nope"}, pg);
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("'nope', which is not a parameter"));
    }
    EXPECT_THROW(FlatParamHandle(model.ptr(), {}, pg), c10::Error);
    EXPECT_THROW(FlatParamHandle(model.ptr(), {"0.weight", "0.weight"}, pg), c10::Error);
    FlatParamOptions hybrid;
    hybrid.sharding_strategy = ShardingStrategy::kHybridShard;
    try {
      FlatParamHandle handle(model.ptr(), {"0.weight"}, pg, hybrid);
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("HYBRID_SHARD needs a replicate_group"));
    }
    FlatParamOptions plain;
    EXPECT_THROW(FlatParamHandle(model.ptr(), {"0.weight"}, pg, plain, pg), c10::Error);
  });
}

TEST(FlatParamHandle, NoSyncAccumulatesUnshardedGrad) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    auto model = MakeMlp();
    FlatParamHandle handle(model.ptr(), ParamNames(*model), pg);
    // Two iterations inside no_sync (no reduction), one synced.
    for (int step = 0; step < 3; ++step) {
      handle.unshard();
      handle.use_unsharded_views();
      Loss(model->forward(RankInput(pg.rank(), 3, step))).backward();
      if (step < 2) {
        EXPECT_FALSE(handle.flat_param().grad().defined());
      } else {
        EXPECT_TRUE(handle.reduce_grad());
      }
      handle.reshard();
      // The unsharded gradient survives reshard (it is not the parameter's
      // storage).
      if (step < 2) {
        EXPECT_TRUE(handle.unsharded_grad().defined());
      }
    }
    std::vector<at::Tensor> inputs;
    for (int step = 0; step < 3; ++step) {
      for (int r = 0; r < 2; ++r) inputs.push_back(RankInput(r, 3, step));
    }
    EXPECT_TRUE(torch::allclose(handle.flat_param().grad(),
                                ShardOf(ReferenceFlatGrad(MakeMlp, inputs, 2, 2), pg.rank(), 2),
                                1e-5, 1e-6));
    EXPECT_FALSE(handle.reduce_grad());  // nothing accumulated since
  });
}

TEST(FlatParamHandle, Hybrid2x2) {
  comm::testing::RunOnRanks(4, [](comm::ProcessGroup& pg) {
    auto mesh = comm::init_hybrid_shard_mesh(pg, /*replicate_size=*/2, /*shard_size=*/2);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    auto groups = comm::hybrid_shard_groups(*mesh);
    ASSERT_TRUE(groups.ok()) << groups.status();
    for (auto strategy : {ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2}) {
      SCOPED_TRACE(sharding_strategy_name(strategy));
      auto model = MakeMlp();
      FlatParamOptions options;
      options.sharding_strategy = strategy;
      FlatParamHandle handle(model.ptr(), ParamNames(*model), groups->shard, options,
                             groups->replicate);
      EXPECT_EQ(handle.shard_world_size(), 2);
      EXPECT_EQ(handle.shard_rank(), pg.rank() % 2);
      EXPECT_EQ(handle.padded_numel(), 32);
      EXPECT_EQ(handle.predivide_factor(), 2);
      EXPECT_EQ(handle.postdivide_factor(), 2);
      EXPECT_EQ(handle.reshard_after_forward(), strategy == ShardingStrategy::kHybridShard);
      const at::Tensor ref_flat = flatten_tensors(UniqueParams(*MakeMlp()), 2);
      EXPECT_TRUE(torch::equal(handle.flat_param(), ShardOf(ref_flat, pg.rank() % 2, 2)));
      handle.unshard();
      EXPECT_TRUE(torch::equal(handle.unsharded_flat_param().detach(), ref_flat));
      handle.use_unsharded_views();
      Loss(model->forward(RankInput(pg.rank(), 3))).backward();
      handle.reduce_grad();
      handle.reshard();
      std::vector<at::Tensor> inputs;
      for (int r = 0; r < 4; ++r) inputs.push_back(RankInput(r, 3));
      EXPECT_TRUE(torch::allclose(
          handle.flat_param().grad(),
          ShardOf(ReferenceFlatGrad(MakeMlp, inputs, 4, 2), pg.rank() % 2, 2), 1e-5, 1e-6));
    }
  });
}

TEST(FlatParamHandle, WritebackReachesShards) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    for (bool mixed : {false, true}) {
      SCOPED_TRACE(mixed ? "mixed precision" : "full precision");
      auto model = MakeMlp();
      FlatParamOptions options;
      if (mixed) options.mixed_precision.param_dtype = at::kBFloat16;
      FlatParamHandle handle(model.ptr(), ParamNames(*model), pg, options);
      const at::Tensor before = handle.flat_param().detach().clone();
      UnshardOptions full;
      full.full_precision = true;
      handle.unshard(false, full);
      handle.use_unsharded_views();
      {
        torch::NoGradGuard no_grad;
        auto weight = model[0]->as<torch::nn::Linear>()->weight;
        EXPECT_EQ(weight.scalar_type(), at::kFloat);  // lossless under MP
        weight.mul_(3);
        model[2]->as<torch::nn::Linear>()->bias.fill_(0.25);
      }
      handle.reshard(/*writeback=*/true);
      EXPECT_EQ(handle.unsharded_storage_nbytes(), 0);
      auto expected_model = MakeMlp();
      {
        torch::NoGradGuard no_grad;
        expected_model[0]->as<torch::nn::Linear>()->weight.mul_(3);
        expected_model[2]->as<torch::nn::Linear>()->bias.fill_(0.25);
      }
      const at::Tensor expected = flatten_tensors(UniqueParams(*expected_model), 2);
      EXPECT_TRUE(torch::equal(handle.flat_param(), ShardOf(expected, pg.rank(), 2)));
      EXPECT_FALSE(torch::equal(handle.flat_param(), before));
      // Without writeback, writes are dropped.
      handle.unshard(false, full);
      handle.use_unsharded_views();
      {
        torch::NoGradGuard no_grad;
        model[0]->as<torch::nn::Linear>()->weight.zero_();
      }
      handle.reshard(/*writeback=*/false);
      EXPECT_TRUE(torch::equal(handle.flat_param(), ShardOf(expected, pg.rank(), 2)));
    }
  });
}

TEST(FlatParamHandle, CpuOffloadKeepsShardAndGradOnCpu) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    auto model = MakeMlp();
    FlatParamOptions options;
    options.offload_params = true;
    FlatParamHandle handle(model.ptr(), ParamNames(*model), pg, options);
    EXPECT_TRUE(handle.flat_param().device().is_cpu());
    EXPECT_FALSE(handle.flat_param().is_pinned());
    handle.unshard();
    handle.use_unsharded_views();
    Loss(model->forward(RankInput(pg.rank(), 3))).backward();
    handle.reduce_grad();
    handle.reshard();
    EXPECT_TRUE(handle.flat_param().grad().device().is_cpu());
    std::vector<at::Tensor> inputs{RankInput(0, 3), RankInput(1, 3)};
    EXPECT_TRUE(torch::allclose(handle.flat_param().grad(),
                                ShardOf(ReferenceFlatGrad(MakeMlp, inputs, 2, 2), pg.rank(), 2),
                                1e-5, 1e-6));
  });
}

// start_reduce_grad() ... finish_reduce_grad() (what the runtime does, so the
// reduction overlaps backward) gives exactly what the blocking reduce_grad()
// gives, also with a second backward accumulating while the first reduction
// is in flight, for every strategy (hybrid included) and with mixed
// precision.
TEST(FlatParamHandle, AsyncReduceIsBitIdenticalToBlocking) {
  comm::testing::RunOnRanks(4, [](comm::ProcessGroup& pg) {
    auto mesh = comm::init_hybrid_shard_mesh(pg, /*replicate_size=*/2, /*shard_size=*/2);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    auto groups = comm::hybrid_shard_groups(*mesh);
    ASSERT_TRUE(groups.ok()) << groups.status();
    // Hybrid over one-rank shard groups too (no reduce-scatter is sent).
    auto mesh_4x1 = comm::init_hybrid_shard_mesh(pg, /*replicate_size=*/4, /*shard_size=*/1);
    ASSERT_TRUE(mesh_4x1.ok()) << mesh_4x1.status();
    auto groups_4x1 = comm::hybrid_shard_groups(*mesh_4x1);
    ASSERT_TRUE(groups_4x1.ok()) << groups_4x1.status();
    for (int variant = 0; variant < 5; ++variant) {
      const ShardingStrategy strategy = variant == 0   ? ShardingStrategy::kFullShard
                                        : variant == 1 ? ShardingStrategy::kShardGradOp
                                        : variant == 2 ? ShardingStrategy::kNoShard
                                                       : ShardingStrategy::kHybridShard;
      const bool one_rank_shards = variant == 4;
      for (bool mixed : {false, true}) {
        SCOPED_TRACE(std::string(sharding_strategy_name(strategy)) +
                     (one_rank_shards ? " 4x1" : "") + (mixed ? " mixed" : " full"));
        const bool hybrid = is_hybrid(strategy);
        const auto& hybrid_groups = one_rank_shards ? *groups_4x1 : *groups;
        FlatParamOptions options;
        options.sharding_strategy = strategy;
        options.use_orig_params = mixed;
        if (mixed) options.mixed_precision.reduce_dtype = at::kHalf;
        const comm::ProcessGroup& shard = hybrid ? hybrid_groups.shard : pg;
        const comm::ProcessGroup replicate =
            hybrid ? hybrid_groups.replicate : comm::ProcessGroup();
        auto blocking_model = MakeMlp();
        auto async_model = MakeMlp();
        FlatParamHandle b_inner(blocking_model.ptr(), {"2.weight", "2.bias"}, shard, options,
                                replicate);
        FlatParamHandle b_outer(blocking_model.ptr(), {"0.weight", "0.bias"}, shard, options,
                                replicate);
        FlatParamHandle a_inner(async_model.ptr(), {"2.weight", "2.bias"}, shard, options,
                                replicate);
        FlatParamHandle a_outer(async_model.ptr(), {"0.weight", "0.bias"}, shard, options,
                                replicate);
        auto backward = [&](torch::nn::Sequential& model, FlatParamHandle& inner,
                            FlatParamHandle& outer, int step) {
          inner.unshard();
          outer.unshard();
          inner.use_unsharded_views();
          outer.use_unsharded_views();
          Loss(model->forward(RankInput(pg.rank(), 3, step))).backward();
        };
        for (int step = 0; step < 2; ++step) {
          backward(blocking_model, b_inner, b_outer, step);
          EXPECT_TRUE(b_inner.reduce_grad());
          EXPECT_TRUE(b_outer.reduce_grad());
        }
        backward(async_model, a_inner, a_outer, 0);
        EXPECT_TRUE(a_inner.start_reduce_grad());
        EXPECT_TRUE(a_outer.start_reduce_grad());
        EXPECT_TRUE(a_inner.reduce_grad_pending());
        EXPECT_FALSE(a_inner.unsharded_grad().defined());
        EXPECT_FALSE(a_inner.flat_param().grad().defined());
        // A second backward accumulates afresh while both are in flight.
        backward(async_model, a_inner, a_outer, 1);
        EXPECT_TRUE(a_inner.unsharded_grad().defined());
        // In start order, as the runtime does (hybrid: replicate all-reduces
        // must start in the same order on every rank).
        a_inner.issue_reduce_grad();
        a_outer.issue_reduce_grad();
        EXPECT_TRUE(a_inner.reduce_grad_issued());
        a_inner.finish_reduce_grad();
        a_outer.finish_reduce_grad();
        EXPECT_FALSE(a_inner.reduce_grad_pending());
        EXPECT_TRUE(a_outer.advance_reduce_grad(/*block=*/false));  // nothing pending
        EXPECT_TRUE(a_inner.start_reduce_grad());
        EXPECT_TRUE(a_outer.start_reduce_grad());
        while (!a_inner.advance_reduce_grad(/*block=*/false)) std::this_thread::yield();
        a_outer.finish_reduce_grad();
        EXPECT_FALSE(a_inner.start_reduce_grad());  // nothing accumulated since
        for (auto* pair : {&b_inner, &b_outer}) {
          FlatParamHandle& b = *pair;
          FlatParamHandle& a = pair == &b_inner ? a_inner : a_outer;
          ASSERT_TRUE(a.flat_param().grad().defined());
          EXPECT_TRUE(torch::equal(a.flat_param().grad(), b.flat_param().grad()))
              << a.flat_param().grad() << "\nvs blocking\n"
              << b.flat_param().grad();
          if (mixed) {
            for (size_t i = 0; i < a.orig_params().size(); ++i) {
              EXPECT_TRUE(torch::equal(a.orig_params()[i].grad(), b.orig_params()[i].grad()));
            }
          }
        }
        for (auto* h : {&b_inner, &b_outer, &a_inner, &a_outer}) h->reshard();
      }
    }
  });
}

// A peer that dies while a reduction is in flight: finishing it throws
// (bounded by the group's timeout, never hangs) and drops it.
TEST(FlatParamHandle, AsyncReduceSurfacesPeerFailure) {
  comm::testing::RunOptions options;
  options.collective_timeout = std::chrono::seconds(10);
  options.closing_barrier = false;
  comm::testing::RunOnRanks(
      2,
      [](comm::ProcessGroup& pg) {
        auto model = MakeMlp();
        FlatParamOptions flat_options;
        flat_options.sharding_strategy = ShardingStrategy::kNoShard;
        FlatParamHandle handle(model.ptr(), ParamNames(*model), pg, flat_options);
        handle.unshard();
        handle.use_unsharded_views();
        Loss(model->forward(RankInput(pg.rank(), 3))).backward();
        EXPECT_TRUE(handle.reduce_grad());  // both alive
        const at::Tensor before = handle.flat_param().grad().clone();
        Loss(model->forward(RankInput(pg.rank(), 3))).backward();
        if (pg.rank() == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          _exit(0);
        }
        const auto start = std::chrono::steady_clock::now();
        try {
          EXPECT_TRUE(handle.start_reduce_grad());
          handle.finish_reduce_grad();
          ADD_FAILURE() << "a reduction with a dead peer succeeded";
        } catch (const c10::Error& e) {
          EXPECT_THAT(e.what_without_backtrace(), HasSubstr("failed"));
        }
        EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                  10.0);
        EXPECT_FALSE(handle.reduce_grad_pending());
        EXPECT_TRUE(torch::equal(handle.flat_param().grad(), before));
      },
      options);
}

}  // namespace
}  // namespace fsdp
