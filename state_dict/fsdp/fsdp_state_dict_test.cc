// FSDP model state dicts (fsdp_state_dict.h) on real ranks: FULL, SHARDED
// and LOCAL round trips on 1, 2 and 4 ranks (uneven shards, padding), a
// SHARDED checkpoint written by 4 ranks loaded on 2 and on 1 with training
// continued to the same parameters as an uninterrupted run, and loads that
// must fail leaving the model untouched.
#include <cstdlib>
#include <map>
#include <set>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "comm/collectives.h"
#include "comm/device_mesh.h"
#include "comm/subgroups.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "functorch/module/named_member_accessor.h"
#include "module_call/call.h"
#include "module_call/wrap_policy.h"
#include "state_dict/checkpoint.h"
#include "state_dict/fsdp/fsdp_optim_state_dict.h"
#include "state_dict/fsdp/fsdp_state_dict.h"
#include "testing/multiprocess.h"

namespace state_dict {
namespace {

using fsdp::FullyShardedDataParallel;

// Two wrapped Linear units of 20 and 18 elements, a root parameter of 7
// (all uneven over 2 and 4 ranks) and a buffer.
struct NetImpl : torch::nn::Module {
  explicit NetImpl(double seed) {
    torch::manual_seed(static_cast<uint64_t>(seed));
    a = register_module("a", torch::nn::Linear(3, 5));
    b = register_module("b", torch::nn::Linear(5, 3));
    c = register_parameter("c", torch::randn({7}));
    scale = register_buffer("scale", torch::full({5}, 1.0 + seed / 10.0));
  }
  torch::Tensor forward(torch::Tensor x) {
    return module_call::call(b, torch::tanh(module_call::call(a, x) * scale)) + 0.1 * c.sum();
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::Tensor c, scale;
};
TORCH_MODULE(Net);
const bool kNetBound =
    functorch::RegisterModuleMembers<NetImpl>({{"c", &NetImpl::c}, {"scale", &NetImpl::scale}});

FullyShardedDataParallel::Options Opts(const comm::ProcessGroup& pg) {
  FullyShardedDataParallel::Options o;
  o.process_group = pg;
  o.auto_wrap_policy = module_call::module_type_auto_wrap_policy<torch::nn::LinearImpl>();
  o.use_orig_params = true;
  return o;
}

TensorDict Full(FullyShardedDataParallel& model) {
  auto sd = GetModelStateDict(model, StateDictType::kFull);
  EXPECT_TRUE(sd.ok()) << sd.status();
  return sd.ok() ? sd->full : TensorDict();
}

void ExpectSame(const TensorDict& got, const TensorDict& want, const std::string& what,
                double rtol = 0, double atol = 0) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& item : want) {
    const torch::Tensor* g = got.find(item.key());
    ASSERT_NE(g, nullptr) << what << ": missing " << item.key();
    ASSERT_EQ(g->sizes(), item.value().sizes()) << what << ": " << item.key();
    EXPECT_TRUE(torch::allclose(*g, item.value(), rtol, atol)) << what << ": " << item.key() << "\n"
                                                               << *g << "\nvs\n"
                                                               << item.value();
  }
}

// Everything a rank holds: its flat shards and buffers (LOCAL), flattened.
std::map<std::string, torch::Tensor> Snapshot(FullyShardedDataParallel& model) {
  std::map<std::string, torch::Tensor> out;
  auto sd = GetModelStateDict(model, StateDictType::kLocal);
  EXPECT_TRUE(sd.ok()) << sd.status();
  if (!sd.ok()) return out;
  for (const auto& item : sd->sharded) {
    for (const auto& p : item.value().pieces) out[item.key()] = p.data.clone();
  }
  return out;
}

void ExpectUntouched(const std::map<std::string, torch::Tensor>& before,
                     FullyShardedDataParallel& model, const std::string& what) {
  auto after = Snapshot(model);
  ASSERT_EQ(after.size(), before.size()) << what;
  for (const auto& [name, t] : before) {
    EXPECT_TRUE(after.at(name).equal(t)) << what << ": " << name << " changed";
  }
}

std::string TmpDir(const std::string& name) {
  const char* root = std::getenv("TEST_TMPDIR");
  return std::string(root != nullptr ? root : "/tmp") + "/" + name;
}

// Each rank saves `state`, then rank 0 commits.
void SaveAndCommit(const comm::ProcessGroup& pg, const std::string& root, int64_t step,
                   const FsdpModelStateDict& state) {
  ASSERT_TRUE(SaveModelCheckpoint(root, step, state).ok());
  comm::barrier(pg).wait();
  if (pg.rank() == 0 && state.type != StateDictType::kFull) {
    absl::Status s = CommitShardedCheckpoint(root, step, pg.size());
    EXPECT_TRUE(s.ok()) << s;
  }
  comm::barrier(pg).wait();
}

void RoundTrips(comm::ProcessGroup& pg) {
  FullyShardedDataParallel src(Net(1.0), Opts(pg));
  const TensorDict want = Full(src);
  ASSERT_EQ(want.size(), 6u);
  ASSERT_NE(want.find("a.weight"), nullptr);
  EXPECT_EQ(want.find("a.weight")->sizes(), (std::vector<int64_t>{5, 3}));
  ASSERT_NE(want.find("scale"), nullptr);

  {  // rank0_only + offload_to_cpu
    auto r0 = GetModelStateDict(src, StateDictType::kFull, {true, true});
    ASSERT_TRUE(r0.ok()) << r0.status();
    if (pg.rank() == 0) {
      ExpectSame(r0->full, want, "rank0_only");
    } else {
      EXPECT_TRUE(r0->full.is_empty());
    }
  }
  {  // the per-model default
    EXPECT_EQ(CurrentStateDictType(src), StateDictType::kFull);
    StateDictTypeGuard guard(src, StateDictType::kSharded);
    auto sd = GetModelStateDict(src);
    ASSERT_TRUE(sd.ok());
    EXPECT_EQ(sd->type, StateDictType::kSharded);
    {
      StateDictTypeGuard inner(src, StateDictType::kLocal);
      EXPECT_EQ(CurrentStateDictType(src), StateDictType::kLocal);
    }
    EXPECT_EQ(CurrentStateDictType(src), StateDictType::kSharded);
  }
  EXPECT_EQ(CurrentStateDictType(src), StateDictType::kFull);

  {  // SHARDED pieces: every element of each original held exactly once
    auto sd = GetModelStateDict(src, StateDictType::kSharded);
    ASSERT_TRUE(sd.ok());
    torch::Tensor held = torch::zeros({3}, torch::kInt64);
    int i = 0;
    for (const char* name : {"a.weight", "b.weight", "c"}) {
      const ShardedTensor* st = sd->sharded.find(name);
      ASSERT_NE(st, nullptr) << name;
      for (const auto& p : st->pieces) held[i] += p.range.numel;
      ++i;
    }
    comm::all_reduce(pg, held).wait();
    EXPECT_EQ(held[0].item<int64_t>(), 15);
    EXPECT_EQ(held[1].item<int64_t>(), 15);
    EXPECT_EQ(held[2].item<int64_t>(), 7);
  }

  int64_t step = 0;
  for (StateDictType type :
       {StateDictType::kFull, StateDictType::kSharded, StateDictType::kLocal}) {
    const std::string what = StateDictTypeName(type);
    auto sd = GetModelStateDict(src, type);
    ASSERT_TRUE(sd.ok()) << sd.status();
    {
      FullyShardedDataParallel dst(Net(2.0), Opts(pg));
      absl::Status s = LoadModelStateDict(dst, *sd);
      ASSERT_TRUE(s.ok()) << what << ": " << s;
      ExpectSame(Full(dst), want, what + " in memory");
    }
    const std::string root = TmpDir("round_trip_" + std::to_string(pg.size()));
    SaveAndCommit(pg, root, ++step, *sd);
    {
      FullyShardedDataParallel dst(Net(3.0), Opts(pg));
      absl::Status s = LoadModelCheckpoint(dst, StepDirectory(root, step), type);
      ASSERT_TRUE(s.ok()) << what << ": " << s;
      ExpectSame(Full(dst), want, what + " checkpoint");
    }
    if (type != StateDictType::kLocal) {  // any form loads as FULL too
      FullyShardedDataParallel dst(Net(4.0), Opts(pg));
      absl::Status s = LoadModelCheckpoint(dst, StepDirectory(root, step), StateDictType::kFull);
      ASSERT_TRUE(s.ok()) << what << ": " << s;
      ExpectSame(Full(dst), want, what + " checkpoint loaded as FULL");
    }
  }
}

TEST(FsdpStateDict, RoundTripsOn1Rank) { comm::testing::RunOnRanks(1, RoundTrips); }
TEST(FsdpStateDict, RoundTripsOn2Ranks) { comm::testing::RunOnRanks(2, RoundTrips); }
TEST(FsdpStateDict, RoundTripsOn4Ranks) { comm::testing::RunOnRanks(4, RoundTrips); }

constexpr int kRows = 8;
constexpr double kLr = 0.1;

torch::Tensor Inputs(int step) {
  torch::manual_seed(100 + step);
  return torch::randn({kRows, 3});
}
torch::Tensor Targets(int step) {
  torch::manual_seed(200 + step);
  return torch::randn({kRows, 3});
}

// One SGD step on rows [rank*n, (rank+1)*n) of the global batch (the mean
// loss over equal parts averages to the full batch's gradient).
void Step(FullyShardedDataParallel& model, torch::optim::Optimizer& optim, int step, int rank,
          int world) {
  const int n = kRows / world;
  optim.zero_grad();
  auto out = model(Inputs(step).narrow(0, rank * n, n));
  torch::mse_loss(out, Targets(step).narrow(0, rank * n, n)).backward();
  optim.step();
}

TEST(FsdpStateDict, ShardedCheckpointOf4RanksContinuesOn2And1) {
  comm::testing::RunOnRanks(4, [](comm::ProcessGroup& world) {
    // Reference: 6 uninterrupted full-batch steps, one process.
    Net ref(1.0);
    torch::optim::SGD ref_optim(ref->parameters(), torch::optim::SGDOptions(kLr));
    TensorDict after3, after6;
    for (int step = 0; step < 6; ++step) {
      ref_optim.zero_grad();
      torch::mse_loss(ref(Inputs(step)), Targets(step)).backward();
      ref_optim.step();
      if (step == 2 || step == 5) {
        TensorDict& d = step == 2 ? after3 : after6;
        for (const auto& item : ref->named_parameters()) {
          d.insert(item.key(), item.value().detach().clone());
        }
        for (const auto& item : ref->named_buffers()) {
          d.insert(item.key(), item.value().detach().clone());
        }
      }
    }

    const std::string root = TmpDir("reshard");
    {
      FullyShardedDataParallel model(Net(1.0), Opts(world));
      torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(kLr));
      for (int step = 0; step < 3; ++step) Step(model, optim, step, world.rank(), world.size());
      ExpectSame(Full(model), after3, "4 ranks after 3 steps", 1e-5, 1e-6);
      auto sd = GetModelStateDict(model, StateDictType::kSharded);
      ASSERT_TRUE(sd.ok()) << sd.status();
      SaveAndCommit(world, root, 3, *sd);
    }
    const std::string dir = StepDirectory(root, 3);
    auto two = comm::new_group(world, {0, 1});
    auto one = comm::new_group(world, {0});
    ASSERT_TRUE(two.ok() && one.ok());
    for (const comm::ProcessGroup* pg : {&*two, &*one}) {
      if (!pg->is_member()) continue;
      FullyShardedDataParallel model(Net(9.0), Opts(*pg));
      absl::Status s = LoadModelCheckpoint(model, dir, StateDictType::kSharded);
      ASSERT_TRUE(s.ok()) << s;
      ExpectSame(Full(model), after3, "loaded on " + std::to_string(pg->size()), 1e-5, 1e-6);
      torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(kLr));
      for (int step = 3; step < 6; ++step) Step(model, optim, step, pg->rank(), pg->size());
      ExpectSame(Full(model), after6, "continued on " + std::to_string(pg->size()), 1e-5, 1e-6);
    }
    comm::barrier(world).wait();
  });
}

TEST(FsdpStateDict, FailedLoadsLeaveTheModelUntouched) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    FullyShardedDataParallel model(Net(1.0), Opts(pg));
    FullyShardedDataParallel other(Net(5.0), Opts(pg));
    const auto before = Snapshot(model);

    // LOCAL at another world size.
    auto local = GetModelStateDict(other, StateDictType::kLocal);
    ASSERT_TRUE(local.ok());
    FsdpModelStateDict wrong_size = *local;
    wrong_size.world_size = 4;
    absl::Status s = LoadModelStateDict(model, wrong_size);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("world size 4"), std::string::npos) << s;
    EXPECT_NE(s.message().find("world size 2"), std::string::npos) << s;
    ExpectUntouched(before, model, "LOCAL wrong world size");

    // A LOCAL checkpoint of 2 ranks loaded on 1.
    const std::string root = TmpDir("errors");
    SaveAndCommit(pg, root, 1, *local);
    auto solo = comm::new_group(pg, {0});
    ASSERT_TRUE(solo.ok());
    if (solo->is_member()) {
      FullyShardedDataParallel one(Net(1.0), Opts(*solo));
      const auto one_before = Snapshot(one);
      s = LoadModelCheckpoint(one, StepDirectory(root, 1), StateDictType::kLocal);
      EXPECT_FALSE(s.ok());
      EXPECT_NE(s.message().find("2"), std::string::npos) << s;
      ExpectUntouched(one_before, one, "LOCAL checkpoint on 1 rank");
    }
    comm::barrier(pg).wait();

    // An unknown name; a wrong shape after entries that would load.
    auto sharded = GetModelStateDict(other, StateDictType::kSharded);
    ASSERT_TRUE(sharded.ok());
    FsdpModelStateDict unknown = *sharded;
    unknown.sharded.insert("nope.weight", ShardedTensor{{2}, torch::kFloat, {}});
    s = LoadModelStateDict(model, unknown);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("nope.weight"), std::string::npos) << s;
    ExpectUntouched(before, model, "SHARDED unknown name");

    FsdpModelStateDict bad_shape = *sharded;
    bad_shape.sharded["b.weight"].global_shape = {5, 3};
    s = LoadModelStateDict(model, bad_shape);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("b.weight"), std::string::npos) << s;
    ExpectUntouched(before, model, "SHARDED wrong shape");

    FsdpModelStateDict missing = *sharded;
    missing.sharded.erase("scale");
    s = LoadModelStateDict(model, missing);
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    ExpectUntouched(before, model, "SHARDED missing buffer");

    auto full = GetModelStateDict(other, StateDictType::kFull);
    ASSERT_TRUE(full.ok());
    FsdpModelStateDict full_bad = *full;
    full_bad.full["b.weight"] = torch::zeros({5, 3});
    s = LoadModelStateDict(model, full_bad);
    EXPECT_FALSE(s.ok());
    ExpectUntouched(before, model, "FULL wrong shape");
    FsdpModelStateDict full_unknown = *full;
    full_unknown.full.insert("nope", torch::zeros({1}));
    s = LoadModelStateDict(model, full_unknown);
    EXPECT_FALSE(s.ok());
    ExpectUntouched(before, model, "FULL unknown name");
  });
}

// ---- optimizer state ----------------------------------------------------

void AdamStep(FullyShardedDataParallel& model, torch::optim::Optimizer& optim, int step, int rank,
              int world) {
  Step(model, optim, step, rank, world);
}

TensorDict Params(torch::nn::Module& m) {
  TensorDict d;
  for (const auto& item : m.named_parameters()) d.insert(item.key(), item.value().detach().clone());
  for (const auto& item : m.named_buffers()) d.insert(item.key(), item.value().detach().clone());
  return d;
}

void ExpectSameOptim(const OptimStateDict& got, const OptimStateDict& want,
                     const std::string& what) {
  ASSERT_EQ(got.state.size(), want.state.size()) << what;
  for (size_t i = 0; i < want.state.size(); ++i) {
    EXPECT_EQ(ParamKeyString(got.state[i].first), ParamKeyString(want.state[i].first)) << what;
    ExpectSame(got.state[i].second, want.state[i].second,
               what + " " + ParamKeyString(want.state[i].first), 1e-5, 1e-7);
  }
}

// One checkpoint holds the model and the optimizer state.
FsdpModelStateDict WithOptim(FsdpModelStateDict model_sd, const FsdpModelStateDict& optim_sd) {
  auto merged = MergeShardedStateDicts(std::move(model_sd), optim_sd);
  EXPECT_TRUE(merged.ok()) << merged.status();
  return merged.ok() ? *merged : FsdpModelStateDict();
}

// A plain (unwrapped) model trained 6 full-batch steps in one process: its
// parameters after 3 and 6 steps, and its optimizer state after 3, keyed by
// name (the independent reference for every FSDP optimizer state below).
struct Reference {
  std::vector<std::string> names;  // optimizer parameter names by ID
  TensorDict after3, after6;
  OptimStateDict state3;
};

enum class OptimKind { kAdam, kSgdMomentum };

std::unique_ptr<torch::optim::Optimizer> MakeOptim(OptimKind kind,
                                                   std::vector<torch::Tensor> params) {
  if (kind == OptimKind::kAdam) {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(kLr));
  }
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(kLr).momentum(0.9));
}

Reference MakeReference(OptimKind kind) {
  Reference r;
  Net ref(1.0);
  auto optim = MakeOptim(kind, ref->parameters());
  auto names = OptimizerParamNames(*ref, *optim);
  EXPECT_TRUE(names.ok());
  if (names.ok()) r.names = *names;
  for (int step = 0; step < 6; ++step) {
    optim->zero_grad();
    torch::mse_loss(ref(Inputs(step)), Targets(step)).backward();
    optim->step();
    if (step == 2) {
      r.after3 = Params(*ref);
      auto exported = ExportOptimizerState(*optim);
      EXPECT_TRUE(exported.ok());
      auto named = RekeyOptimStateDict(*exported, OptimStateKeyType::kParamName, r.names);
      EXPECT_TRUE(named.ok()) << named.status();
      r.state3 = *named;  // the live tensors: copy them
      for (auto& [key, entries] : r.state3.state) {
        TensorDict copy;
        for (const auto& e : entries) copy.insert(e.key(), e.value().detach().clone());
        entries = std::move(copy);
      }
    }
  }
  r.after6 = Params(*ref);
  return r;
}

// Resumes `dir` (model + optimizer, SHARDED) into a fresh model built by
// `opts` on `pg`, checks the consolidated optimizer state against the
// reference, trains steps 3..5 and checks the parameters.
void ResumeAndContinue(const comm::ProcessGroup& pg, const FullyShardedDataParallel::Options& opts,
                       OptimKind kind, const std::string& dir, const Reference& ref,
                       const std::string& what) {
  FullyShardedDataParallel model(Net(9.0), opts);
  auto optim = MakeOptim(kind, model.parameters());
  absl::Status s = LoadModelCheckpoint(model, dir, StateDictType::kSharded);
  ASSERT_TRUE(s.ok()) << what << ": " << s;
  s = LoadShardedOptimCheckpoint(model, *optim, dir);
  ASSERT_TRUE(s.ok()) << what << ": " << s;
  auto full = FullOptimStateDict(model, *optim);
  ASSERT_TRUE(full.ok()) << what << ": " << full.status();
  ExpectSameOptim(*full, ref.state3, what + " optimizer state");
  for (int step = 3; step < 6; ++step) Step(model, *optim, step, pg.rank(), pg.size());
  ExpectSame(Full(model), ref.after6, what, 1e-5, 1e-6);
}

TEST(FsdpOptimStateDict, FullShardedAndPlainRoundTripsWithAdam) {
  comm::testing::RunOnRanks(4, [](comm::ProcessGroup& world) {
    const Reference ref = MakeReference(OptimKind::kAdam);
    const TensorDict& after3 = ref.after3;
    const TensorDict& after6 = ref.after6;
    const OptimStateDict& ref_state3 = ref.state3;
    const std::vector<std::string>* ref_names = &ref.names;

    const std::string root = TmpDir("optim");
    {
      FullyShardedDataParallel model(Net(1.0), Opts(world));
      torch::optim::Adam optim(model.parameters(), torch::optim::AdamOptions(kLr));
      for (int step = 0; step < 3; ++step) AdamStep(model, optim, step, world.rank(), world.size());
      ExpectSame(Full(model), after3, "4 ranks after 3 steps", 1e-5, 1e-6);

      auto full = FullOptimStateDict(model, optim);
      ASSERT_TRUE(full.ok()) << full.status();
      EXPECT_EQ(full->key_type, OptimStateKeyType::kParamName);
      ExpectSameOptim(*full, ref_state3, "FULL optimizer state");
      auto r0 = FullOptimStateDict(model, optim, /*rank0_only=*/true);
      ASSERT_TRUE(r0.ok()) << r0.status();
      EXPECT_EQ(r0->state.empty(), world.rank() != 0);

      // FULL -> this rank's shard -> import: unchanged.
      auto before = ExportOptimizerState(optim);
      auto mine = ShardFullOptimStateDict(model, optim, *full);
      ASSERT_TRUE(mine.ok()) << mine.status();
      ASSERT_TRUE(ImportOptimizerState(optim, *mine).ok());
      auto after = ExportOptimizerState(optim);
      ExpectSameOptim(*after, *before, "FULL -> shard round trip");

      // Errors leave the optimizer untouched.
      OptimStateDict bad = *full;
      bad.state[1].second["exp_avg"] = torch::zeros({2, 2});
      auto err = ShardFullOptimStateDict(model, optim, bad);
      EXPECT_EQ(err.status().code(), absl::StatusCode::kInvalidArgument) << err.status();
      EXPECT_NE(err.status().message().find("exp_avg"), std::string::npos) << err.status();
      OptimStateDict unknown = *full;
      unknown.state[0].first = std::string("nope.weight");
      EXPECT_FALSE(ShardFullOptimStateDict(model, optim, unknown).ok());
      auto sharded = ShardedOptimStateDict(model, optim);
      ASSERT_TRUE(sharded.ok()) << sharded.status();
      FsdpModelStateDict bad_sharded = *sharded;
      bad_sharded.sharded.insert("nope.weight/exp_avg", ShardedTensor{{2}, torch::kFloat, {}});
      absl::Status s = LoadShardedOptimStateDict(model, optim, bad_sharded);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      ExpectSameOptim(*ExportOptimizerState(optim), *before, "after failed loads");

      // SHARDED model + optimizer in one checkpoint.
      auto model_sd = GetModelStateDict(model, StateDictType::kSharded);
      ASSERT_TRUE(model_sd.ok());
      auto clash = MergeShardedStateDicts(*model_sd, *model_sd);
      EXPECT_EQ(clash.status().code(), absl::StatusCode::kInvalidArgument) << clash.status();
      EXPECT_FALSE(MergeShardedStateDicts(*model_sd, FsdpModelStateDict()).ok());
      SaveAndCommit(world, root, 3, WithOptim(*model_sd, *sharded));
    }
    const std::string dir = StepDirectory(root, 3);
    auto two = comm::new_group(world, {0, 1});
    auto one = comm::new_group(world, {0});
    ASSERT_TRUE(two.ok() && one.ok());
    for (const comm::ProcessGroup* pg : {&*two, &*one}) {
      if (!pg->is_member()) continue;
      ResumeAndContinue(*pg, Opts(*pg), OptimKind::kAdam, dir, ref,
                        "resumed on " + std::to_string(pg->size()));
    }
    comm::barrier(world).wait();

    {  // A plain model's checkpoint, rekeyed by name, into FSDP and back.
      FullyShardedDataParallel model(Net(9.0), Opts(world));
      torch::optim::Adam optim(model.parameters(), torch::optim::AdamOptions(kLr));
      FsdpModelStateDict plain;
      plain.full = after3;
      ASSERT_TRUE(LoadModelStateDict(model, plain).ok());
      auto mine = ShardFullOptimStateDict(model, optim, ref_state3);
      ASSERT_TRUE(mine.ok()) << mine.status();
      absl::Status s = ImportOptimizerState(optim, *mine);
      ASSERT_TRUE(s.ok()) << s;
      auto back = FullOptimStateDict(model, optim);
      ASSERT_TRUE(back.ok());
      Net plain_model(9.0);
      torch::optim::Adam plain_optim(plain_model->parameters(), torch::optim::AdamOptions(kLr));
      auto by_id = RekeyOptimStateDict(*back, OptimStateKeyType::kParamId, *ref_names);
      ASSERT_TRUE(by_id.ok()) << by_id.status();
      s = ImportOptimizerState(plain_optim, *by_id);
      ASSERT_TRUE(s.ok()) << s;
      auto plain_back = ExportOptimizerState(plain_optim);
      ASSERT_TRUE(plain_back.ok());
      auto plain_named =
          RekeyOptimStateDict(*plain_back, OptimStateKeyType::kParamName, *ref_names);
      ASSERT_TRUE(plain_named.ok());
      ExpectSameOptim(*plain_named, ref_state3, "plain -> FSDP -> plain");

      // scatter: only rank 0 passes the dict.
      torch::optim::Adam scattered(model.parameters(), torch::optim::AdamOptions(kLr));
      auto sc = ScatterFullOptimStateDict(model, scattered,
                                          world.rank() == 0 ? ref_state3 : OptimStateDict{});
      ASSERT_TRUE(sc.ok()) << sc.status();
      ASSERT_TRUE(ImportOptimizerState(scattered, *sc).ok());
      ExpectSameOptim(*ExportOptimizerState(scattered), *ExportOptimizerState(optim), "scattered");
      OptimStateDict bad = ref_state3;
      bad.state[0].second["exp_avg"] = torch::zeros({1});
      auto bad_sc =
          ScatterFullOptimStateDict(model, scattered, world.rank() == 0 ? bad : OptimStateDict{});
      EXPECT_EQ(bad_sc.status().code(), absl::StatusCode::kInvalidArgument) << bad_sc.status();
      for (int step = 3; step < 6; ++step) AdamStep(model, optim, step, world.rank(), world.size());
      ExpectSame(Full(model), after6, "plain optimizer state continued under FSDP", 1e-5, 1e-6);
    }
  });
}

TEST(FsdpOptimStateDict, SgdMomentumAndAdamWRoundTrips) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    for (int kind = 0; kind < 2; ++kind) {
      const std::string what = kind == 0 ? "SGD momentum" : "AdamW";
      auto make = [&](FullyShardedDataParallel& m) -> std::unique_ptr<torch::optim::Optimizer> {
        if (kind == 0) {
          return std::make_unique<torch::optim::SGD>(m.parameters(),
                                                     torch::optim::SGDOptions(kLr).momentum(0.9));
        }
        return std::make_unique<torch::optim::AdamW>(
            m.parameters(), torch::optim::AdamWOptions(kLr).weight_decay(0.01));
      };
      FullyShardedDataParallel model(Net(1.0), Opts(pg));
      auto optim = make(model);
      for (int step = 0; step < 2; ++step) Step(model, *optim, step, pg.rank(), pg.size());
      auto want = ExportOptimizerState(*optim);
      ASSERT_TRUE(want.ok());

      auto full = FullOptimStateDict(model, *optim);
      ASSERT_TRUE(full.ok()) << what << ": " << full.status();
      ASSERT_EQ(full->state.size(), 5u) << what;
      ASSERT_NE(full->state[0].second.find(kind == 0 ? "momentum_buffer" : "exp_avg"), nullptr);
      auto sharded = ShardedOptimStateDict(model, *optim);
      ASSERT_TRUE(sharded.ok()) << what << ": " << sharded.status();

      FullyShardedDataParallel other(Net(2.0), Opts(pg));
      auto fresh = make(other);
      auto mine = ShardFullOptimStateDict(other, *fresh, *full);
      ASSERT_TRUE(mine.ok()) << what << ": " << mine.status();
      ASSERT_TRUE(ImportOptimizerState(*fresh, *mine).ok()) << what;
      ExpectSameOptim(*ExportOptimizerState(*fresh), *want, what + " FULL");

      auto fresh2 = make(other);
      absl::Status s = LoadShardedOptimStateDict(other, *fresh2, *sharded);
      ASSERT_TRUE(s.ok()) << what << ": " << s;
      ExpectSameOptim(*ExportOptimizerState(*fresh2), *want, what + " SHARDED");
    }
  });
}

// use_orig_params=false: the optimizer steps one flat parameter per unit;
// its state dicts are still per original parameter and equal the plain
// model's, and move between flat, original-parameter and plain optimizers.
void FlatParameterOptimizerState(comm::ProcessGroup& world, OptimKind kind) {
  const Reference ref = MakeReference(kind);
  const std::string kindname = kind == OptimKind::kAdam ? "Adam" : "SGD momentum";
  auto flat_opts = Opts(world);
  flat_opts.use_orig_params = false;
  const std::string root = TmpDir(kind == OptimKind::kAdam ? "flat_adam" : "flat_sgd");
  {
    FullyShardedDataParallel model(Net(1.0), flat_opts);
    auto optim = MakeOptim(kind, model.parameters());
    ASSERT_EQ(model.parameters().size(), 3u);  // a, b, root: flat parameters
    auto names = FsdpOptimizerParamNames(model, *optim);
    ASSERT_TRUE(names.ok()) << names.status();
    EXPECT_EQ(names->size(), 5u);
    for (int step = 0; step < 3; ++step) Step(model, *optim, step, world.rank(), world.size());
    ExpectSame(Full(model), ref.after3, kindname + " flat after 3 steps", 1e-5, 1e-6);

    auto full = FullOptimStateDict(model, *optim);
    ASSERT_TRUE(full.ok()) << full.status();
    ExpectSameOptim(*full, ref.state3, kindname + " flat FULL == plain");
    std::set<std::string> grouped;
    for (const auto& key : full->param_groups.at(0).params)
      grouped.insert(std::get<std::string>(key));
    EXPECT_EQ(grouped, std::set<std::string>(ref.names.begin(), ref.names.end()));

    // FULL -> shard -> import is the identity on the flat state.
    auto before = ExportOptimizerState(*optim);
    ASSERT_TRUE(before.ok());
    auto mine = ShardFullOptimStateDict(model, *optim, *full);
    ASSERT_TRUE(mine.ok()) << mine.status();
    ASSERT_TRUE(ImportOptimizerState(*optim, *mine).ok());
    ExpectSameOptim(*ExportOptimizerState(*optim), *before, kindname + " flat FULL round trip");

    // The plain model's state (by name) and the scattered one load too.
    auto fresh = MakeOptim(kind, model.parameters());
    auto from_plain = ShardFullOptimStateDict(model, *fresh, ref.state3);
    ASSERT_TRUE(from_plain.ok()) << from_plain.status();
    ASSERT_TRUE(ImportOptimizerState(*fresh, *from_plain).ok());
    ExpectSameOptim(*ExportOptimizerState(*fresh), *before, kindname + " plain -> flat");
    auto scattered = MakeOptim(kind, model.parameters());
    auto sc = ScatterFullOptimStateDict(model, *scattered,
                                        world.rank() == 0 ? ref.state3 : OptimStateDict{});
    ASSERT_TRUE(sc.ok()) << sc.status();
    ASSERT_TRUE(ImportOptimizerState(*scattered, *sc).ok());
    ExpectSameOptim(*ExportOptimizerState(*scattered), *before, kindname + " scattered flat");

    // Originals sharing a flat parameter must agree; nothing changes on error.
    OptimStateDict partial = ref.state3;
    const std::string entry = kind == OptimKind::kAdam ? "exp_avg" : "momentum_buffer";
    for (auto& [key, entries] : partial.state) {
      if (std::get<std::string>(key) != "a.bias") continue;
      TensorDict kept;
      for (const auto& e : entries) {
        if (e.key() != entry) kept.insert(e.key(), e.value());
      }
      entries = std::move(kept);
    }
    auto err = ShardFullOptimStateDict(model, *optim, partial);
    EXPECT_EQ(err.status().code(), absl::StatusCode::kInvalidArgument) << err.status();
    EXPECT_NE(err.status().message().find("shares its flat parameter"), std::string::npos)
        << err.status();

    // SHARDED through the state_dict_type-driven API, into a checkpoint.
    StateDictTypeGuard guard(model, StateDictType::kSharded);
    auto optim_sd = GetOptimStateDict(model, *optim);
    ASSERT_TRUE(optim_sd.ok()) << optim_sd.status();
    ASSERT_EQ(optim_sd->type, StateDictType::kSharded);
    auto to_load = OptimStateDictToLoad(model, *optim, *optim_sd);
    ASSERT_TRUE(to_load.ok()) << to_load.status();
    ASSERT_TRUE(ImportOptimizerState(*optim, *to_load).ok());
    ExpectSameOptim(*ExportOptimizerState(*optim), *before, kindname + " flat SHARDED");
    auto model_sd = GetModelStateDict(model);
    ASSERT_TRUE(model_sd.ok()) << model_sd.status();
    SaveAndCommit(world, root, 3, WithOptim(*model_sd, optim_sd->sharded));
  }
  // The flat checkpoint continues on fewer ranks, flat or not.
  const std::string dir = StepDirectory(root, 3);
  auto two = comm::new_group(world, {0, 1});
  auto one = comm::new_group(world, {0});
  ASSERT_TRUE(two.ok() && one.ok());
  if (two->is_member()) {
    ResumeAndContinue(*two, Opts(*two), kind, dir, ref,
                      kindname + " flat 4 ranks -> use_orig_params 2 ranks");
  }
  if (one->is_member()) {
    auto o = Opts(*one);
    o.use_orig_params = false;
    ResumeAndContinue(*one, o, kind, dir, ref, kindname + " flat 4 ranks -> flat 1 rank");
  }
  comm::barrier(world).wait();
}

TEST(FsdpOptimStateDict, FlatParametersWithAdam) {
  comm::testing::RunOnRanks(
      4, [](comm::ProcessGroup& world) { FlatParameterOptimizerState(world, OptimKind::kAdam); });
}

TEST(FsdpOptimStateDict, FlatParametersWithSgdMomentum) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& world) {
    FlatParameterOptimizerState(world, OptimKind::kSgdMomentum);
  });
}

// HYBRID_SHARD (2 replicas x 2 shards, device mesh) and _HYBRID_SHARD_ZERO2
// (the same groups as a pair): model and optimizer checkpoints are ordinary
// sharded ones that load into FULL_SHARD on 2 and 1 ranks and back into the
// hybrid model; FULL state dicts and scatter work across both groups.
TEST(FsdpStateDict, HybridShardCheckpointsLoadAnywhere) {
  comm::testing::RunOnRanks(4, [](comm::ProcessGroup& world) {
    const Reference ref = MakeReference(OptimKind::kAdam);
    auto mesh = comm::init_hybrid_shard_mesh(world, 2, 2);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    auto pair = comm::hybrid_shard_groups(*mesh);
    ASSERT_TRUE(pair.ok()) << pair.status();
    for (int variant = 0; variant < 2; ++variant) {
      FullyShardedDataParallel::Options o;
      o.auto_wrap_policy = module_call::module_type_auto_wrap_policy<torch::nn::LinearImpl>();
      o.use_orig_params = variant == 0;
      if (variant == 0) {
        o.sharding_strategy = fsdp::ShardingStrategy::kHybridShard;
        o.device_mesh = *mesh;
      } else {
        o.sharding_strategy = fsdp::ShardingStrategy::kHybridShardZero2;
        o.hybrid_groups = *pair;
      }
      const std::string what = variant == 0 ? "HYBRID_SHARD" : "_HYBRID_SHARD_ZERO2 (flat)";
      const std::string root = TmpDir("hybrid" + std::to_string(variant));
      {
        FullyShardedDataParallel model(Net(1.0), o);
        torch::optim::Adam optim(model.parameters(), torch::optim::AdamOptions(kLr));
        for (int step = 0; step < 3; ++step) Step(model, optim, step, world.rank(), world.size());
        ExpectSame(Full(model), ref.after3, what + " after 3 steps", 1e-5, 1e-6);
        auto full = FullOptimStateDict(model, optim);
        ASSERT_TRUE(full.ok()) << full.status();
        ExpectSameOptim(*full, ref.state3, what + " FULL optimizer state");
        auto before = ExportOptimizerState(optim);
        torch::optim::Adam scattered(model.parameters(), torch::optim::AdamOptions(kLr));
        auto sc = ScatterFullOptimStateDict(model, scattered,
                                            world.rank() == 0 ? ref.state3 : OptimStateDict{});
        ASSERT_TRUE(sc.ok()) << sc.status();
        ASSERT_TRUE(ImportOptimizerState(scattered, *sc).ok());
        ExpectSameOptim(*ExportOptimizerState(scattered), *before, what + " scattered");

        auto model_sd = GetModelStateDict(model, StateDictType::kSharded);
        ASSERT_TRUE(model_sd.ok()) << model_sd.status();
        EXPECT_EQ(model_sd->world_size, 4);
        EXPECT_EQ(model_sd->rank, world.rank());
        EXPECT_EQ(model_sd->shard_is_replica, world.rank() >= 2);
        auto optim_sd = ShardedOptimStateDict(model, optim);
        ASSERT_TRUE(optim_sd.ok()) << optim_sd.status();
        SaveAndCommit(world, root, 3, WithOptim(*model_sd, *optim_sd));
      }
      const std::string dir = StepDirectory(root, 3);
      // Replicas wrote shapes only: their shard files hold no tensor data.
      auto manifest = ReadManifest(dir);
      ASSERT_TRUE(manifest.ok()) << manifest.status();
      ASSERT_EQ(manifest->files.size(), 4u);
      for (const ManifestFile& file : manifest->files) {
        int64_t bytes = 0;
        for (const ManifestTensor& t : file.tensors) bytes += t.range.numel;
        if (file.rank >= 2) {
          EXPECT_EQ(bytes, 0) << what << ": " << file.name;
        } else {
          EXPECT_GT(bytes, 0) << what << ": " << file.name;
        }
      }
      auto two = comm::new_group(world, {0, 1});
      auto one = comm::new_group(world, {0});
      ASSERT_TRUE(two.ok() && one.ok());
      if (two->is_member()) {
        ResumeAndContinue(*two, Opts(*two), OptimKind::kAdam, dir, ref,
                          what + " -> FULL_SHARD 2 ranks");
      }
      if (one->is_member()) {
        ResumeAndContinue(*one, Opts(*one), OptimKind::kAdam, dir, ref,
                          what + " -> FULL_SHARD 1 rank");
      }
      ResumeAndContinue(world, o, OptimKind::kAdam, dir, ref, what + " -> itself");
      comm::barrier(world).wait();
    }
  });
}

TEST(FsdpOptimStateDict, LocalOptimizerStateIsAnError) {
  comm::testing::RunOnRanks(1, [](comm::ProcessGroup& pg) {
    FullyShardedDataParallel model(Net(1.0), Opts(pg));
    torch::optim::Adam optim(model.parameters(), torch::optim::AdamOptions(kLr));
    StateDictTypeGuard guard(model, StateDictType::kLocal);
    auto sd = GetOptimStateDict(model, optim);
    EXPECT_EQ(sd.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(sd.status().message().find("LOCAL_STATE_DICT"), std::string::npos) << sd.status();
    // An optimizer over the unwrapped module's parameters is not FSDP's.
    Net plain(1.0);
    torch::optim::Adam wrong(plain->parameters(), torch::optim::AdamOptions(kLr));
    auto names = FsdpOptimizerParamNames(model, wrong);
    EXPECT_EQ(names.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(names.status().message().find("not a parameter of the FSDP model"), std::string::npos)
        << names.status();
  });
}

}  // namespace
}  // namespace state_dict
