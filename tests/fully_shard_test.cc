// fully_shard (issue 37) against the unwrapped model: the same model, seed
// and data trained with SGD in one process (the reference, global batch)
// and under fully_shard on 1, 2, 3 and 4 Gloo ranks (the global batch split
// over the ranks). Every step: the loss (averaged over ranks), each rank's
// shard of every gradient, and each rank's shard of every parameter after
// the step must match the reference rows to 1e-6 relative. Cases:
// reshard_after_forward unset/true/false/2, a frozen parameter and a frozen
// float64 parameter (mixed dtypes: gathered as bytes) in the root's group,
// shapes that need padding (8 rows on 3 ranks, 3 rows on 2 and 4 ranks:
// empty shards). Also against FullyShardedDataParallel on the same ranks,
// the bad-input errors, and that a module's shards of one dtype lie back to
// back in one buffer (the all-gather's input, no copy-in).
#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "comm/collectives.h"
#include "comm/device_mesh.h"
#include "comm/subgroups.h"
#include "fsdp/fully_shard.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "functorch/module/named_member_accessor.h"
#include "module_call/call.h"
#include "module_call/wrap_policy.h"
#include "testing/multiprocess.h"
#include "tests/fsdp_test_models.h"

namespace fsdp_test {
namespace {

constexpr int kSteps = 4;
constexpr int64_t kBatch = 12;  // divisible by 1, 2, 3 and 4 ranks
constexpr double kLr = 0.1;

struct Case {
  std::string name;
  std::optional<std::variant<bool, int>> reshard_after_forward;
  bool frozen = false;
  // shard_placement_fn: Shard(1) for 2-D parameters whose dim 1 divides
  // the group.
  bool shard1 = false;
  // HSDP: a (replicas x W/replicas) mesh instead of the process group.
  int hsdp_replicas = 0;
};

Batch MakeBatch(int step, int rank, int world) {
  torch::manual_seed(3000 + step);
  at::Tensor x = torch::randn({kBatch, kIn});
  at::Tensor y = torch::randn({kBatch, kOut});
  const int64_t n = kBatch / world;
  return Batch{x.narrow(0, rank * n, n), y.narrow(0, rank * n, n)};
}

// NetImpl's own parameters (only the frozen "scale64" added below) are
// read, if at all, from its registry.
const bool kNetBound = functorch::RegisterRegistryReadingModule<NetImpl>();

Net MakeNet(bool frozen) {
  Net model(3);
  if (frozen) {
    model->in->weight.set_requires_grad(false);
    model->register_parameter("scale64", torch::arange(5, torch::kDouble) + 0.5,
                              /*requires_grad=*/false);
  }
  return model;
}

std::vector<at::Tensor> Trainable(const torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (const auto& p : module.parameters()) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

struct Step {
  double loss = 0;
  std::map<std::string, at::Tensor> grads, params;
};

std::vector<Step> Reference(bool frozen) {
  Net model = MakeNet(frozen);
  torch::optim::SGD optim(Trainable(*model), torch::optim::SGDOptions(kLr));
  std::vector<Step> steps;
  for (int step = 0; step < kSteps; ++step) {
    Batch b = MakeBatch(step, 0, 1);
    optim.zero_grad();
    at::Tensor loss = Loss(model->forward(b.x), b.y);
    loss.backward();
    Step s;
    s.loss = loss.item<double>();
    for (const auto& p : model->named_parameters()) {
      if (p.value().grad().defined()) s.grads[p.key()] = p.value().grad().clone();
    }
    optim.step();
    s.params = Snapshot(*model);
    steps.push_back(std::move(s));
  }
  return steps;
}

void ExpectRel(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(torch::allclose(actual.to(torch::kDouble), expected.to(torch::kDouble), 1e-6, 1e-7))
      << what << ": max abs diff "
      << (actual.to(torch::kDouble) - expected.to(torch::kDouble)).abs().max().item<double>();
}

// This rank's part of `full` for the shard `param` (on its shard dim).
at::Tensor Rows(const at::Tensor& param, const at::Tensor& full) {
  std::optional<fsdp::ShardedParamSpec> spec = fsdp::sharded_param_spec(param);
  TORCH_CHECK(spec.has_value(), "not a sharded parameter");
  return full.narrow(spec->shard_dim, spec->shard_offset, param.size(spec->shard_dim));
}

void CheckShards(const torch::nn::Module& model, const std::map<std::string, at::Tensor>& full,
                 const std::string& what) {
  for (const auto& p : model.named_parameters()) {
    auto it = full.find(p.key());
    ASSERT_NE(it, full.end()) << what << ": " << p.key();
    std::optional<fsdp::ShardedParamSpec> spec = fsdp::sharded_param_spec(p.value());
    ASSERT_TRUE(spec.has_value()) << what << ": " << p.key() << " is not sharded";
    EXPECT_EQ(spec->global_shape, it->second.sizes().vec()) << what << ": " << p.key();
    ExpectRel(p.value(), Rows(p.value(), it->second), what + " param " + p.key());
  }
}

void TrainCase(comm::ProcessGroup& pg, const Case& c, const std::vector<Step>& reference) {
  SCOPED_TRACE(c.name + " on " + std::to_string(pg.size()) + " ranks");
  Net model = MakeNet(c.frozen);
  fsdp::FullyShardOptions options;
  options.process_group = pg;
  options.reshard_after_forward = c.reshard_after_forward;
  const int world = pg.size();
  if (c.hsdp_replicas > 0) {
    absl::StatusOr<comm::DeviceMesh> mesh =
        comm::init_hybrid_shard_mesh(pg, c.hsdp_replicas, world / c.hsdp_replicas);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    options.mesh = *mesh;  // with process_group: the same ranks
  }
  if (c.shard1) {
    options.shard_placement_fn = [world](const at::Tensor& p) -> std::optional<int64_t> {
      if (p.dim() == 2 && p.size(1) % world == 0) return 1;
      return std::nullopt;
    };
  }
  for (const auto& block : *model->blocks) fsdp::fully_shard(block, options);
  fsdp::FSDPModule root = fsdp::fully_shard(model, options);
  CheckShards(*model, Snapshot(*MakeNet(c.frozen)), c.name + " after fully_shard");
  if (c.shard1) {
    std::optional<fsdp::ShardedParamSpec> spec =
        fsdp::sharded_param_spec(model->blocks[0]->named_parameters()["fc1.weight"]);
    ASSERT_TRUE(spec.has_value());
    EXPECT_EQ(spec->shard_dim, 1);
    EXPECT_EQ(spec->shard_offset, pg.rank() * (kHidden / world));
    EXPECT_EQ(model->blocks[0]->named_parameters()["fc1.weight"].sizes(),
              at::IntArrayRef({kHidden, kHidden / world}));
  }
  torch::optim::SGD optim(Trainable(*model), torch::optim::SGDOptions(kLr));
  for (int step = 0; step < kSteps; ++step) {
    const std::string what = c.name + " step " + std::to_string(step);
    Batch b = MakeBatch(step, pg.rank(), pg.size());
    optim.zero_grad();
    at::Tensor loss = Loss(module_call::call(model, b.x), b.y);
    loss.backward();
    at::Tensor global = loss.detach().clone().reshape({1});
    comm::all_reduce(pg, global, comm::ReduceOp::kAvg).wait();
    EXPECT_NEAR(global.item<double>(), reference[step].loss, 1e-6 * reference[step].loss) << what;
    for (const auto& p : model->named_parameters()) {
      auto it = reference[step].grads.find(p.key());
      if (it == reference[step].grads.end()) {
        EXPECT_FALSE(p.value().grad().defined()) << what << ": frozen " << p.key();
        continue;
      }
      ASSERT_TRUE(p.value().grad().defined()) << what << ": no grad for " << p.key();
      ExpectRel(p.value().grad(), Rows(p.value(), it->second), what + " grad " + p.key());
    }
    optim.step();
    CheckShards(*model, reference[step].params, what);
  }
  if (c.frozen) {
    // The float64 parameter went through the byte all-gather: gather it.
    root.unshard();
    at::Tensor full = model->named_parameters()["scale64"];
    EXPECT_TRUE(full.equal(torch::arange(5, torch::kDouble) + 0.5)) << full;
    root.reshard();
    EXPECT_TRUE(fsdp::sharded_param_spec(model->named_parameters()["scale64"]).has_value());
  }
}

std::vector<Case> Cases(int world) {
  std::vector<Case> cases = {
      {"reshard_after_forward=default", std::nullopt},
      {"reshard_after_forward=true", true},
      {"reshard_after_forward=false", false},
      {"frozen+float64", std::nullopt, /*frozen=*/true},
  };
  if (world % 2 == 0) {
    cases.push_back({"reshard_after_forward=2", 2});
    // Shard(1) gathered over the post-forward group of 2 in backward.
    cases.push_back({"shard_placement_fn=Shard(1)+reshard_after_forward=2", 2, false, true});
    cases.push_back({"HSDP 2 x W/2", std::nullopt, false, false, 2});
  }
  if (world == 4) {
    // The post-forward groups split the mesh's shard group.
    cases.push_back({"HSDP 1 x 4+reshard_after_forward=2", 2, false, false, 1});
  }
  return cases;
}

void RunCases(int world) {
  const std::vector<Step> plain = Reference(false);
  const std::vector<Step> frozen = Reference(true);
  comm::testing::RunOptions options;
  options.timeout = std::chrono::seconds(240);
  comm::testing::RunOnRanks(
      world,
      [&](comm::ProcessGroup& pg) {
        for (const Case& c : Cases(pg.size())) TrainCase(pg, c, c.frozen ? frozen : plain);
      },
      options);
}

// The full parameters of a fully_shard model: every fully_shard module
// gathered (every rank must call it).
std::map<std::string, at::Tensor> FullParams(const Net& model) {
  std::vector<fsdp::FSDPModule> units;
  for (const auto& m : model->modules()) {
    if (auto unit = fsdp::as_fsdp_module(*m)) units.push_back(*unit);
  }
  for (auto& unit : units) unit.unshard();
  std::map<std::string, at::Tensor> out = Snapshot(*model);
  for (auto& unit : units) unit.reshard();
  return out;
}

// fully_shard against FullyShardedDataParallel (FULL_SHARD, the blocks as
// nested units) on 3 ranks (uneven shards): the same losses and full
// parameters after every SGD step.
TEST(FullyShard, MatchesFullyShardedDataParallelOn3Ranks) {
  comm::testing::RunOnRanks(3, [](comm::ProcessGroup& pg) {
    Net fsdp1_model(3);
    fsdp::FullyShardedDataParallel::Options fsdp1_options;
    fsdp1_options.process_group = pg;
    fsdp1_options.auto_wrap_policy = module_call::module_type_auto_wrap_policy<BlockImpl>();
    fsdp::FullyShardedDataParallel fsdp1(fsdp1_model, fsdp1_options);
    torch::optim::SGD fsdp1_optim(fsdp1.parameters(), torch::optim::SGDOptions(kLr));

    Net model(3);
    fsdp::FullyShardOptions options;
    options.process_group = pg;
    for (const auto& block : *model->blocks) fsdp::fully_shard(block, options);
    fsdp::fully_shard(model, options);
    torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(kLr));

    for (int step = 0; step < kSteps; ++step) {
      const std::string what = "step " + std::to_string(step);
      Batch b = MakeBatch(step, pg.rank(), pg.size());
      fsdp1_optim.zero_grad();
      at::Tensor fsdp1_loss = Loss(fsdp1(b.x), b.y);
      fsdp1_loss.backward();
      fsdp1_optim.step();
      optim.zero_grad();
      at::Tensor loss = Loss(module_call::call(model, b.x), b.y);
      loss.backward();
      optim.step();
      EXPECT_NEAR(loss.item<double>(), fsdp1_loss.item<double>(), 1e-6 * fsdp1_loss.item<double>())
          << what;
      std::map<std::string, at::Tensor> want = FullSnapshot(fsdp1);
      std::map<std::string, at::Tensor> got = FullParams(model);
      ASSERT_EQ(got.size(), want.size()) << what;
      for (const auto& [name, tensor] : want) ExpectRel(got.at(name), tensor, what + " " + name);
    }
  });
}

// The gradients of the sum of the losses of two microbatches of
// MakeBatch(step) (halves of the global batch), unwrapped.
std::map<std::string, at::Tensor> AccumulatedReference() {
  Net model = MakeNet(false);
  Batch b = MakeBatch(0, 0, 1);
  at::Tensor loss =
      Loss(model->forward(b.x.narrow(0, 0, kBatch / 2)), b.y.narrow(0, 0, kBatch / 2)) +
      Loss(model->forward(b.x.narrow(0, kBatch / 2, kBatch / 2)),
           b.y.narrow(0, kBatch / 2, kBatch / 2));
  loss.backward();
  std::map<std::string, at::Tensor> grads;
  for (const auto& p : model->named_parameters()) grads[p.key()] = p.value().grad().clone();
  return grads;
}

// FSDPModule controls on 2 ranks: gradient accumulation without sync
// (set_requires_gradient_sync), unshard(async_op) + wait, reshard,
// set_reshard_after_backward(false); and MixedPrecisionPolicy computing in
// float64 (param_dtype, reduce_dtype, cast_forward_inputs): the casts are
// exercised while the result must still match the float32 reference.
TEST(FullyShard, ControlsAndMixedPrecisionOn2Ranks) {
  const std::map<std::string, at::Tensor> accumulated = AccumulatedReference();
  const std::vector<Step> reference = Reference(false);
  comm::testing::RunOnRanks(2, [&](comm::ProcessGroup& pg) {
    const int64_t half = kBatch / 2, local = half / pg.size();
    {
      Net model = MakeNet(false);
      fsdp::FullyShardOptions options;
      options.process_group = pg;
      for (const auto& block : *model->blocks) fsdp::fully_shard(block, options);
      fsdp::FSDPModule root = fsdp::fully_shard(model, options);
      Batch b = MakeBatch(0, 0, 1);
      for (int micro = 0; micro < 2; ++micro) {
        root.set_requires_gradient_sync(micro == 1);
        const int64_t row = micro * half + pg.rank() * local;
        Loss(module_call::call(model, b.x.narrow(0, row, local)), b.y.narrow(0, row, local))
            .backward();
        if (micro == 0) {
          // Nothing reduced yet: the shards have no .grad.
          for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
        }
      }
      for (const auto& p : model->named_parameters()) {
        ASSERT_TRUE(p.value().grad().defined()) << p.key();
        ExpectRel(p.value().grad(), Rows(p.value(), accumulated.at(p.key())),
                  "accumulated grad " + p.key());
      }
      // unshard(async_op) then wait: the module's names hold the full
      // parameters; reshard: the shards again.
      fsdp::UnshardHandle handle = root.unshard(/*async_op=*/true);
      handle.wait();
      EXPECT_EQ(model->named_parameters()["in.bias"].sizes(), at::IntArrayRef({kHidden}));
      root.reshard();
      EXPECT_EQ(model->named_parameters()["in.bias"].sizes(),
                at::IntArrayRef({kHidden / pg.size()}));
      // Kept gathered after backward when asked to.
      auto block = fsdp::as_fsdp_module(*model->blocks[0]);
      ASSERT_TRUE(block.has_value());
      block->set_reshard_after_backward(false);
      Loss(module_call::call(model, b.x.narrow(0, 0, local)), b.y.narrow(0, 0, local)).backward();
      EXPECT_EQ(model->blocks[0]->named_parameters()["fc1.bias"].sizes(),
                at::IntArrayRef({kHidden}));
      EXPECT_EQ(model->named_parameters()["in.bias"].sizes(),
                at::IntArrayRef({kHidden / pg.size()}));
      block->reshard();
    }
    {
      Net model = MakeNet(false);
      fsdp::FullyShardOptions options;
      options.process_group = pg;
      options.mp_policy.param_dtype = torch::kDouble;
      options.mp_policy.reduce_dtype = torch::kDouble;
      for (const auto& block : *model->blocks) fsdp::fully_shard(block, options);
      fsdp::fully_shard(model, options);
      torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(kLr));
      for (int step = 0; step < kSteps; ++step) {
        Batch b = MakeBatch(step, pg.rank(), pg.size());
        optim.zero_grad();
        at::Tensor out = module_call::call(model, b.x);
        EXPECT_EQ(out.scalar_type(), torch::kDouble);
        Loss(out, b.y).backward();
        for (const auto& p : model->named_parameters()) {
          EXPECT_EQ(p.value().scalar_type(), torch::kFloat) << p.key();
          EXPECT_EQ(p.value().grad().scalar_type(), torch::kFloat) << p.key();
          ExpectRel(p.value().grad(), Rows(p.value(), reference[step].grads.at(p.key())),
                    "float64 compute grad " + p.key());
        }
        optim.step();
        CheckShards(*model, reference[step].params, "float64 compute");
      }
    }
  });
}

// Two microbatches (the halves of batch 0, this rank's rows of each)
// through the net under fully_shard with `options` (each block, then the
// root), `before` setting the root up for each: after the first backward
// (`first_backward` says what kind) no parameter has a .grad; after the
// second each holds its part of `accumulated`, the gradient of the two
// microbatches' summed losses.
void ExpectGradientOfTwoMicrobatches(
    const comm::ProcessGroup& pg, const fsdp::FullyShardOptions& options,
    const std::function<void(fsdp::FSDPModule& root, int micro)>& before,
    const std::string& first_backward, const std::map<std::string, at::Tensor>& accumulated) {
  const int64_t half = kBatch / 2, local = half / pg.size();
  Net model = MakeNet(false);
  for (const auto& block : *model->blocks) fsdp::fully_shard(block, options);
  fsdp::FSDPModule root = fsdp::fully_shard(model, options);
  Batch b = MakeBatch(0, 0, 1);
  for (int micro = 0; micro < 2; ++micro) {
    before(root, micro);
    const int64_t row = micro * half + pg.rank() * local;
    Loss(module_call::call(model, b.x.narrow(0, row, local)), b.y.narrow(0, row, local)).backward();
    if (micro == 0) {
      for (const auto& p : model->named_parameters()) {
        EXPECT_FALSE(p.value().grad().defined()) << p.key() << " after " << first_backward;
      }
    }
  }
  for (const auto& p : model->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    ExpectRel(p.value().grad(), Rows(p.value(), accumulated.at(p.key())),
              "accumulated grad " + p.key());
  }
}

// set_is_last_backward(false) on the root: the first microbatch's
// reductions stay in flight (the shards have no .grad after its backward);
// the second microbatch's, run with true, lands both: the gradient of the
// two microbatches' summed losses. On a process group and on an HSDP mesh
// (2 replicas x 1 shard: the replicate all-reduce deferred too).
TEST(FullyShard, SetIsLastBackwardOn2Ranks) {
  const std::map<std::string, at::Tensor> accumulated = AccumulatedReference();
  comm::testing::RunOnRanks(2, [&](comm::ProcessGroup& pg) {
    for (bool hsdp : {false, true}) {
      SCOPED_TRACE(hsdp ? "HSDP 2x1" : "process group");
      fsdp::FullyShardOptions options;
      if (hsdp) {
        absl::StatusOr<comm::DeviceMesh> mesh = comm::init_hybrid_shard_mesh(pg, 2, 1);
        ASSERT_TRUE(mesh.ok()) << mesh.status();
        options.mesh = *mesh;
      } else {
        options.process_group = pg;
      }
      ExpectGradientOfTwoMicrobatches(
          pg, options,
          [](fsdp::FSDPModule& root, int micro) { root.set_is_last_backward(micro == 1); },
          "a non-last backward", accumulated);
    }
  });
}

// HSDP (2 replicas x 1 shard) with set_requires_all_reduce(false) for the
// first of two microbatches: its reduction is kept, neither all-reduced
// over the replicas nor in .grad after its backward; the second
// microbatch's backward (true) adds it in before its all-reduce: the
// gradient of the two microbatches' summed losses, as without the flag.
TEST(FullyShard, SetRequiresAllReduceOn2Ranks) {
  const std::map<std::string, at::Tensor> accumulated = AccumulatedReference();
  comm::testing::RunOnRanks(2, [&](comm::ProcessGroup& pg) {
    fsdp::FullyShardOptions options;
    absl::StatusOr<comm::DeviceMesh> mesh = comm::init_hybrid_shard_mesh(pg, 2, 1);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    options.mesh = *mesh;
    ExpectGradientOfTwoMicrobatches(
        pg, options,
        [](fsdp::FSDPModule& root, int micro) { root.set_requires_all_reduce(micro == 1); },
        "a backward without all-reduce", accumulated);
  });
}

// Two children sharing one weight (tied), each called through the call
// point.
struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    a = register_module("a", torch::nn::Linear(4, 4));
    b = register_module("b", torch::nn::Linear(4, 4));
    functorch::NamedMemberAccessor(std::static_pointer_cast<torch::nn::Module>(
                                       std::shared_ptr<TiedImpl>(this, [](TiedImpl*) {})))
        .set_tensor("b.weight", a->weight);
  }
  at::Tensor forward(const at::Tensor& x) {
    return module_call::call(a, x) + module_call::call(b, x);
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Tied);

std::string ErrorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// Explicit forward/backward prefetching changes when parameters are
// gathered, not the result; clip_grad_norm_ over the shards equals
// torch::nn::utils::clip_grad_norm_ on the unwrapped model (2-norm and inf).
TEST(FullyShard, PrefetchAndClipGradNormOn3Ranks) {
  const std::vector<Step> reference = Reference(false);
  std::map<std::string, std::pair<double, std::map<std::string, at::Tensor>>> clipped;
  for (double norm_type : {2.0, static_cast<double>(INFINITY)}) {
    Net model = MakeNet(false);
    Batch b = MakeBatch(0, 0, 1);
    Loss(model->forward(b.x), b.y).backward();
    const double total = torch::nn::utils::clip_grad_norm_(model->parameters(), 0.05, norm_type);
    std::map<std::string, at::Tensor> grads;
    for (const auto& p : model->named_parameters()) grads[p.key()] = p.value().grad().clone();
    clipped[std::to_string(norm_type)] = {total, grads};
  }
  comm::testing::RunOnRanks(3, [&](comm::ProcessGroup& pg) {
    {
      Net model = MakeNet(false);
      fsdp::FullyShardOptions options;
      options.process_group = pg;
      std::vector<fsdp::FSDPModule> blocks;
      for (const auto& block : *model->blocks) blocks.push_back(fsdp::fully_shard(block, options));
      fsdp::FSDPModule root = fsdp::fully_shard(model, options);
      root.set_modules_to_forward_prefetch({blocks[0]});
      for (size_t i = 0; i + 1 < blocks.size(); ++i) {
        blocks[i].set_modules_to_forward_prefetch({blocks[i + 1]});
        blocks[i + 1].set_modules_to_backward_prefetch({blocks[i]});
      }
      torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(kLr));
      for (int step = 0; step < kSteps; ++step) {
        Batch b = MakeBatch(step, pg.rank(), pg.size());
        optim.zero_grad();
        Loss(module_call::call(model, b.x), b.y).backward();
        optim.step();
        CheckShards(*model, reference[step].params, "prefetch step " + std::to_string(step));
      }
    }
    for (double norm_type : {2.0, static_cast<double>(INFINITY)}) {
      Net model = MakeNet(false);
      fsdp::FullyShardOptions options;
      options.process_group = pg;
      for (const auto& block : *model->blocks) fsdp::fully_shard(block, options);
      fsdp::fully_shard(model, options);
      Batch b = MakeBatch(0, pg.rank(), pg.size());
      Loss(module_call::call(model, b.x), b.y).backward();
      const auto& [want, grads] = clipped.at(std::to_string(norm_type));
      at::Tensor total = fsdp::clip_grad_norm_(model->parameters(), 0.05, norm_type);
      EXPECT_NEAR(total.item<double>(), want, 1e-6 * want) << "norm_type " << norm_type;
      for (const auto& p : model->named_parameters()) {
        ExpectRel(p.value().grad(), Rows(p.value(), grads.at(p.key())),
                  "clipped grad " + p.key() + " norm_type " + std::to_string(norm_type));
      }
    }
    const std::string error =
        ErrorOf([] { fsdp::clip_grad_norm_({torch::ones({2}, torch::requires_grad())}, 1.0); });
    EXPECT_NE(error.find("parameters[0] (shape [2]) is not a parameter fully_shard sharded"),
              std::string::npos)
        << error;
  });
}

// Bad input: each a clear error naming what is wrong.
TEST(FullyShard, BadInput) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    fsdp::FullyShardOptions options;
    options.process_group = pg;
    {
      Net model(1);
      fsdp::fully_shard(model->blocks[0], options);
      EXPECT_NE(ErrorOf([&] {
                  fsdp::fully_shard(model->blocks[0], options);
                }).find("fully_shard has already been applied to the following module"),
                std::string::npos);
      fsdp::fully_shard(model, options);
      EXPECT_NE(ErrorOf([&] {
                  fsdp::fully_shard(model->in, options);
                }).find("already managed by fully_shard applied to an ancestor"),
                std::string::npos);
    }
    {
      Net model(1);
      fsdp::FullyShardOptions bad = options;
      bad.reshard_after_forward = 3;
      const std::string error = ErrorOf([&] { fsdp::fully_shard(model, bad); });
      EXPECT_NE(error.find("it should be a factor of 2, not 3"), std::string::npos) << error;
    }
    {
      // A mesh over the same ranks in another order: not the group's.
      absl::StatusOr<comm::DeviceMesh> mesh = comm::DeviceMesh::create(pg, {2}, {1, 0});
      ASSERT_TRUE(mesh.ok()) << mesh.status();
      Net model(1);
      fsdp::FullyShardOptions bad = options;
      bad.mesh = *mesh;
      const std::string error = ErrorOf([&] { fsdp::fully_shard(model, bad); });
      EXPECT_NE(error.find("options.mesh spans world ranks [1, 0] but options.process_group "
                           "spans [0, 1]"),
                std::string::npos)
          << error;
    }
    {
      // PyTorch's behaviour: a parameter shared by two fully_shard groups
      // is an error at the first forward (lazy init), naming it.
      Tied model;
      fsdp::fully_shard(model->a, options);
      fsdp::fully_shard(model->b, options);
      fsdp::fully_shard(model, options);
      const std::string error = ErrorOf([&] { module_call::call(model, torch::ones({2, 4})); });
      EXPECT_NE(error.find("Parameter 'b.weight' is shared with a parameter already managed by "
                           "another FSDP group"),
                std::string::npos)
          << error;
    }
    {
      absl::StatusOr<comm::DeviceMesh> mesh = comm::DeviceMesh::create(pg, {1, 1, 2});
      ASSERT_TRUE(mesh.ok()) << mesh.status();
      Net model(1);
      fsdp::FullyShardOptions bad = options;
      bad.mesh = *mesh;
      const std::string error = ErrorOf([&] { fsdp::fully_shard(model, bad); });
      EXPECT_NE(error.find("fully_shard expects a 1D or 2D DeviceMesh but got a 3-D mesh of "
                           "shape [1, 1, 2]"),
                std::string::npos)
          << error;
    }
    {
      // HSDP: a 1 x 2 mesh over both ranks, and a process group of this rank
      // alone.
      absl::StatusOr<comm::DeviceMesh> mesh = comm::init_hybrid_shard_mesh(pg, 1, 2);
      ASSERT_TRUE(mesh.ok()) << mesh.status();
      absl::StatusOr<comm::ProcessGroup> alone = comm::new_subgroups(pg, 1);
      ASSERT_TRUE(alone.ok()) << alone.status();
      Net model(1);
      fsdp::FullyShardOptions bad;
      bad.process_group = *alone;
      bad.mesh = *mesh;
      const std::string error = ErrorOf([&] { fsdp::fully_shard(model, bad); });
      EXPECT_NE(error.find("options.mesh spans world ranks [0, 1] but options.process_group "
                           "spans [" +
                           std::to_string(pg.rank()) + "]"),
                std::string::npos)
          << error;
    }
    {
      Net model(1);
      fsdp::FullyShardOptions bad = options;
      bad.shard_placement_fn = [](const at::Tensor&) -> std::optional<int64_t> { return 2; };
      const std::string error = ErrorOf([&] { fsdp::fully_shard(model, bad); });
      EXPECT_NE(error.find("shard_placement_fn returned Shard(2) for parameter 'in.weight' of "
                           "shape [8, 6]: expected a dim in [-2, 2)"),
                std::string::npos)
          << error;
    }
    {
      torch::nn::Linear linear(3, 3);
      fsdp::FullyShardOptions bad = options;
      bad.shard_placement_fn = [](const at::Tensor&) -> std::optional<int64_t> { return -1; };
      const std::string error = ErrorOf([&] { fsdp::fully_shard(linear, bad); });
      EXPECT_NE(error.find("FSDP does not support uneven sharding on dim 1: parameter 'weight' "
                           "has shape [3, 3] (world size: 2)"),
                std::string::npos)
          << error;
    }
    {
      Net model(1);
      fsdp::FullyShardOptions bad = options;
      bad.ignored_params = {model->in->weight, torch::ones({2})};
      const std::string error = ErrorOf([&] { fsdp::fully_shard(model, bad); });
      EXPECT_NE(error.find("options.ignored_params[1] (shape [2]) is not a parameter of the "
                           "module"),
                std::string::npos)
          << error;
    }
    {
      struct ScalarImpl : torch::nn::Module {
        ScalarImpl() { register_parameter("s", torch::ones({})); }
      };
      auto module = std::make_shared<ScalarImpl>();
      const std::string error = ErrorOf([&] { fsdp::fully_shard(module, options); });
      EXPECT_NE(error.find("fully_shard doesn't support scalar parameters. Change s to a 1D "
                           "tensor with numel equal to 1."),
                std::string::npos)
          << error;
    }
  });
}

// output_dtype, ignored_params and CPUOffloadPolicy on 2 ranks, against
// the unwrapped model.
TEST(FullyShard, OutputDtypeAndIgnoredParamsOn2Ranks) {
  const std::vector<Step> reference = Reference(false);
  comm::testing::RunOnRanks(2, [&](comm::ProcessGroup& pg) {
    {
      // CPUOffloadPolicy on a CPU-only run: the shards are CPU tensors,
      // pinned only where CUDA is present; training is unchanged.
      Net model = MakeNet(false);
      fsdp::FullyShardOptions options;
      options.process_group = pg;
      options.offload_policy = fsdp::CPUOffloadPolicy{};
      for (const auto& block : *model->blocks) fsdp::fully_shard(block, options);
      fsdp::fully_shard(model, options);
      for (const auto& p : model->named_parameters()) {
        EXPECT_TRUE(p.value().device().is_cpu()) << p.key();
        EXPECT_EQ(p.value().is_pinned(), at::globalContext().hasCUDA()) << p.key();
      }
      torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(kLr));
      for (int step = 0; step < 2; ++step) {
        Batch b = MakeBatch(step, pg.rank(), pg.size());
        optim.zero_grad();
        Loss(module_call::call(model, b.x), b.y).backward();
        optim.step();
        CheckShards(*model, reference[step].params, "offload step " + std::to_string(step));
      }
    }
    {
      // output_dtype float64 on the root: the output is cast (a
      // differentiable cast: the float32 gradients are unchanged).
      Net model = MakeNet(false);
      fsdp::FullyShardOptions options;
      options.process_group = pg;
      for (const auto& block : *model->blocks) fsdp::fully_shard(block, options);
      options.mp_policy.output_dtype = torch::kDouble;
      fsdp::fully_shard(model, options);
      Batch b = MakeBatch(0, pg.rank(), pg.size());
      at::Tensor out = module_call::call(model, b.x);
      EXPECT_EQ(out.scalar_type(), torch::kDouble);
      Loss(out, b.y.to(torch::kDouble)).backward();
      for (const auto& p : model->named_parameters()) {
        ASSERT_TRUE(p.value().grad().defined()) << p.key();
        EXPECT_EQ(p.value().grad().scalar_type(), torch::kFloat) << p.key();
        ExpectRel(p.value().grad(), Rows(p.value(), reference[0].grads.at(p.key())),
                  "output_dtype grad " + p.key());
      }
    }
    {
      // in.bias ignored by the root: left in place, unsharded, and its
      // gradient is this rank's own (not reduced); the rest as usual.
      Net model = MakeNet(false);
      const at::Tensor bias = model->in->bias;
      fsdp::FullyShardOptions options;
      options.process_group = pg;
      for (const auto& block : *model->blocks) fsdp::fully_shard(block, options);
      options.ignored_params = {bias};
      fsdp::FSDPModule root = fsdp::fully_shard(model, options);
      EXPECT_TRUE(model->in->named_parameters()["bias"].is_same(bias));
      EXPECT_FALSE(fsdp::sharded_param_spec(bias).has_value());
      for (const auto& p : root.sharded_parameters()) EXPECT_FALSE(p.is_same(bias));
      Batch b = MakeBatch(0, pg.rank(), pg.size());
      Loss(module_call::call(model, b.x), b.y).backward();
      Net local = MakeNet(false);
      Loss(local->forward(b.x), b.y).backward();
      ASSERT_TRUE(bias.grad().defined());
      ExpectRel(bias.grad(), local->in->bias.grad(), "ignored in.bias grad (local)");
      for (const auto& p : model->named_parameters()) {
        if (p.key() == "in.bias") continue;
        ExpectRel(p.value().grad(), Rows(p.value(), reference[0].grads.at(p.key())),
                  "grad " + p.key() + " beside an ignored parameter");
      }
    }
  });
}

// A module's shards of one dtype lie back to back in one buffer, each
// padded to its chunk (the all-gather sends that buffer without a
// copy-in), and stay there through training; the mixed-dtype root group
// (a frozen float64 parameter) still trains (RunCases' frozen case).
TEST(FullyShard, ShardsOfOneDtypeShareOneBufferOn3Ranks) {
  comm::testing::RunOnRanks(3, [](comm::ProcessGroup& pg) {
    Net model = MakeNet(false);
    fsdp::FullyShardOptions options;
    options.process_group = pg;
    std::vector<fsdp::FSDPModule> blocks;
    for (const auto& block : *model->blocks) blocks.push_back(fsdp::fully_shard(block, options));
    fsdp::fully_shard(model, options);
    auto expect_back_to_back = [&](const std::string& when) {
      for (size_t b = 0; b < blocks.size(); ++b) {
        const std::vector<at::Tensor> shards = blocks[b].sharded_parameters();
        ASSERT_GE(shards.size(), 2u);
        const char* next = static_cast<const char*>(shards.front().data_ptr());
        for (const at::Tensor& shard : shards) {
          std::optional<fsdp::ShardedParamSpec> spec = fsdp::sharded_param_spec(shard);
          ASSERT_TRUE(spec.has_value());
          int64_t padded = spec->padded_dim0;
          for (size_t d = 1; d < spec->global_shape.size(); ++d) padded *= spec->global_shape[d];
          if (shard.numel() > 0) {
            EXPECT_EQ(static_cast<const char*>(shard.data_ptr()), next)
                << when << ": block " << b << " shard of " << spec->global_shape;
          }
          next += padded * static_cast<int64_t>(shard.element_size());
        }
      }
    };
    expect_back_to_back("after fully_shard");
    torch::optim::SGD optim(model->parameters(), kLr);
    for (int step = 0; step < 2; ++step) {
      Batch b = MakeBatch(step, pg.rank(), pg.size());
      optim.zero_grad();
      Loss(module_call::call(model, b.x), b.y).backward();
      optim.step();
    }
    expect_back_to_back("after 2 steps");
  });
}

// Units of more than 1 MiB, which comm gathers rank to rank on Gloo: each
// parameter's pieces land straight in its unsharded buffer, with no flat
// buffer and no copy-out. Two wide residual blocks (one holding a frozen
// float64 parameter, so its group mixes dtypes) against the unwrapped model,
// with reshard_after_forward default and 2 (the post-forward group's gather
// is rank to rank too) and with Shard(1).
constexpr int64_t kWide = 384;  // a Block(kWide): 2 x (384 x 384 + 384) float32, 1.1 MiB

// Its forward() reads fc1 and fc2 through their holders; the scale64 that
// WideNet adds to its first block is not read.
const bool kBlockBound = functorch::RegisterRegistryReadingModule<BlockImpl>();

struct WideNetImpl : torch::nn::Module {
  WideNetImpl() {
    torch::manual_seed(7);
    first = register_module("first", Block(kWide));
    second = register_module("second", Block(kWide));
    first->register_parameter("scale64", torch::arange(9, torch::kDouble) + 0.25,
                              /*requires_grad=*/false);
  }
  at::Tensor forward(const at::Tensor& x) {
    return module_call::call(second, module_call::call(first, x));
  }
  Block first{nullptr}, second{nullptr};
};
TORCH_MODULE(WideNet);

void TrainWideCase(comm::ProcessGroup& pg, const Case& c) {
  SCOPED_TRACE(c.name + " on " + std::to_string(pg.size()) + " ranks");
  const int world = pg.size();
  constexpr int64_t kRows = 8;
  auto batch = [&](int step, int rank, int ranks) {
    torch::manual_seed(500 + step);
    at::Tensor x = torch::randn({kRows, kWide});
    at::Tensor y = torch::randn({kRows, kWide});
    const int64_t n = kRows / ranks;
    return Batch{x.narrow(0, rank * n, n), y.narrow(0, rank * n, n)};
  };
  WideNet reference;
  WideNet model;
  fsdp::FullyShardOptions options;
  options.process_group = pg;
  options.reshard_after_forward = c.reshard_after_forward;
  if (c.shard1) {
    options.shard_placement_fn = [](const at::Tensor& p) -> std::optional<int64_t> {
      if (p.dim() == 2) return 1;
      return std::nullopt;
    };
  }
  int64_t block_bytes = 0;
  for (const auto& p : model->first->parameters()) {
    block_bytes += static_cast<int64_t>(p.numel() * p.element_size());
  }
  ASSERT_TRUE(comm::all_gathers_rank_to_rank(pg, at::kCPU, block_bytes))
      << block_bytes << " bytes: this test means to gather rank to rank";
  fsdp::FSDPModule first = fsdp::fully_shard(model->first, options);
  fsdp::fully_shard(model->second, options);
  fsdp::fully_shard(model, options);
  torch::optim::SGD reference_optim(Trainable(*reference), torch::optim::SGDOptions(kLr));
  torch::optim::SGD optim(Trainable(*model), torch::optim::SGDOptions(kLr));
  for (int step = 0; step < 3; ++step) {
    const std::string what = c.name + " step " + std::to_string(step);
    Batch whole = batch(step, 0, 1);
    reference_optim.zero_grad();
    at::Tensor reference_loss = Loss(reference->forward(whole.x), whole.y);
    reference_loss.backward();
    Batch mine = batch(step, pg.rank(), world);
    optim.zero_grad();
    at::Tensor loss = Loss(module_call::call(model, mine.x), mine.y);
    loss.backward();
    at::Tensor global = loss.detach().clone().reshape({1});
    comm::all_reduce(pg, global, comm::ReduceOp::kAvg).wait();
    EXPECT_NEAR(global.item<double>(), reference_loss.item<double>(),
                1e-6 * reference_loss.item<double>())
        << what;
    std::map<std::string, at::Tensor> reference_grads;
    for (const auto& p : reference->named_parameters()) {
      if (p.value().grad().defined()) reference_grads[p.key()] = p.value().grad();
    }
    for (const auto& p : model->named_parameters()) {
      auto it = reference_grads.find(p.key());
      if (it == reference_grads.end()) continue;
      ASSERT_TRUE(p.value().grad().defined()) << what << ": no grad for " << p.key();
      ExpectRel(p.value().grad(), Rows(p.value(), it->second), what + " grad " + p.key());
    }
    reference_optim.step();
    optim.step();
    CheckShards(*model, Snapshot(*reference), what);
  }
  first.unshard();
  EXPECT_TRUE(
      model->first->named_parameters()["scale64"].equal(torch::arange(9, torch::kDouble) + 0.25));
  first.reshard();
}

void RunWideCases(int world) {
  comm::testing::RunOnRanks(world, [](comm::ProcessGroup& pg) {
    std::vector<Case> cases = {{"reshard_after_forward=default", std::nullopt},
                               {"shard_placement_fn=Shard(1)", std::nullopt, false, true}};
    if (pg.size() % 2 == 0 && pg.size() > 2) {
      cases.push_back({"reshard_after_forward=2", 2});
    }
    for (const Case& c : cases) TrainWideCase(pg, c);
  });
}

TEST(FullyShard, LargeUnitsGatherRankToRankOn2Ranks) { RunWideCases(2); }
TEST(FullyShard, LargeUnitsGatherRankToRankOn4Ranks) { RunWideCases(4); }

TEST(FullyShard, MatchesUnwrappedOn1Rank) { RunCases(1); }
TEST(FullyShard, MatchesUnwrappedOn2Ranks) { RunCases(2); }
TEST(FullyShard, MatchesUnwrappedOn3Ranks) { RunCases(3); }
TEST(FullyShard, MatchesUnwrappedOn4Ranks) { RunCases(4); }

// HSDP beyond 4 ranks: 3 replicas x 2 shards and 2 replicas x 3 shards on
// 6 ranks, against the unwrapped model.
TEST(FullyShard, HsdpMatchesUnwrappedOn6Ranks) {
  const std::vector<Step> plain = Reference(false);
  comm::testing::RunOptions options;
  options.timeout = std::chrono::seconds(240);
  comm::testing::RunOnRanks(
      6,
      [&](comm::ProcessGroup& pg) {
        for (const Case& c : {Case{"HSDP 3 x 2", std::nullopt, false, false, 3},
                              Case{"HSDP 2 x 3", std::nullopt, false, false, 2}}) {
          TrainCase(pg, c, plain);
        }
      },
      options);
}

}  // namespace
}  // namespace fsdp_test
