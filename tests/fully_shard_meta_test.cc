// fully_shard of a model built on the meta device (PyTorch's FSDP2 deferred
// initialisation): the model is built module by module, each module's
// tensors moved to meta as soon as it is made, fully_shard'ed (blocks, then
// the root) with nothing allocated, materialised with fsdp::to_empty (each
// rank's shards only) and filled from the reference's full state dict with
// state_dict::LoadFullyShardStateDict, or by fsdp::init_sharded_states.
// Then AdamW over the shards must give the reference's losses and
// parameters (the same model trained unwrapped in one process on the
// global batch) to 1e-5, on 1, 2, 3 (uneven shards) and 4 ranks (an empty
// shard), Shard(1) placement and CPUOffloadPolicy on 2, HSDP 2 x 2 on 4.
// Memory: before to_empty every parameter and buffer is a meta tensor;
// after it a rank's parameter storage is its padded shards, about 1/world
// of the model. Errors: forward (and unshard, init) before to_empty, meta
// and real parameters in one module, to_empty onto meta.
#include <ATen/core/grad_mode.h>
#include <c10/core/StorageImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "comm/collectives.h"
#include "comm/device_mesh.h"
#include "fsdp/fully_shard.h"
#include "functorch/module/named_member_accessor.h"
#include "module_call/call.h"
#include "state_dict/fully_shard/fully_shard_state_dict.h"
#include "state_dict/sharded_tensor.h"
#include "testing/multiprocess.h"

namespace {

constexpr int64_t kIn = 6;
constexpr int64_t kHidden = 8;  // 3 ranks: rows 3, 3, 2
constexpr int64_t kOut = 3;     // 2 ranks: 2, 1; 4 ranks: 1, 1, 1, 0
constexpr int64_t kBatch = 12;  // divisible by 1, 2, 3 and 4 ranks
constexpr int kSteps = 3;

// `module` with every parameter and buffer replaced by a meta tensor of its
// shape, dtype and requires_grad (the CPU tensors it was built with are
// dropped here, before the next module is built).
template <typename Holder>
Holder OnMeta(Holder module, bool on_meta) {
  if (!on_meta) return module;
  std::vector<std::string> names;
  std::vector<at::Tensor> values;
  for (const auto& p : module->named_parameters()) {
    at::Tensor t = at::empty(p.value().sizes(), p.value().options().device(torch::kMeta));
    t.set_requires_grad(p.value().requires_grad());
    names.push_back(p.key());
    values.push_back(t);
  }
  for (const auto& b : module->named_buffers()) {
    names.push_back(b.key());
    values.push_back(at::empty(b.value().sizes(), b.value().options().device(torch::kMeta)));
  }
  functorch::NamedMemberAccessor(module).set_tensors(names, std::move(values));
  return module;
}

// A residual block with a buffer its forward reads.
struct MetaBlockImpl : torch::nn::Module {
  MetaBlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kHidden, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kHidden));
    scale = register_buffer("scale", torch::linspace(0.5, 1.5, kHidden));
  }
  at::Tensor forward(const at::Tensor& x) { return x + fc2(torch::tanh(fc1(x))) * scale; }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  at::Tensor scale;
};
TORCH_MODULE(MetaBlock);
const bool kMetaBlockBound =
    functorch::RegisterModuleMembers<MetaBlockImpl>({{"scale", &MetaBlockImpl::scale}});

// Built module by module, each moved to meta at once when `on_meta`: the
// whole model is never allocated. The same seed gives the reference.
struct MetaNetImpl : torch::nn::Module {
  explicit MetaNetImpl(bool on_meta) {
    torch::manual_seed(0);
    in = register_module("in", OnMeta(torch::nn::Linear(kIn, kHidden), on_meta));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) blocks->push_back(OnMeta(MetaBlock(), on_meta));
    out = register_module("out", OnMeta(torch::nn::Linear(kHidden, kOut), on_meta));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = in(x);
    for (const auto& block : *blocks) h = module_call::call(block->as<MetaBlockImpl>(), h);
    return out(h);
  }
  torch::nn::Linear in{nullptr}, out{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(MetaNet);

struct Batch {
  at::Tensor x, y;
};
Batch MakeBatch(int step, int rank, int world) {
  torch::manual_seed(5000 + step);
  at::Tensor x = torch::randn({kBatch, kIn});
  at::Tensor y = torch::randn({kBatch, kOut});
  const int64_t n = kBatch / world;
  return Batch{x.narrow(0, rank * n, n), y.narrow(0, rank * n, n)};
}

torch::optim::AdamWOptions Adam() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.1); }

std::map<std::string, at::Tensor> Snapshot(const torch::nn::Module& module) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : module.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

struct Reference {
  std::map<std::string, at::Tensor> initial;  // parameters and buffers
  std::vector<double> losses;
  std::vector<std::map<std::string, at::Tensor>> params;  // after each step
};

Reference Train() {
  MetaNet model(/*on_meta=*/false);
  Reference ref;
  for (const auto& p : model->named_parameters()) ref.initial[p.key()] = p.value().detach().clone();
  for (const auto& b : model->named_buffers()) ref.initial[b.key()] = b.value().clone();
  torch::optim::AdamW optim(model->parameters(), Adam());
  for (int step = 0; step < kSteps; ++step) {
    Batch b = MakeBatch(step, 0, 1);
    optim.zero_grad();
    at::Tensor loss = torch::mse_loss(model->forward(b.x), b.y);
    loss.backward();
    optim.step();
    ref.losses.push_back(loss.item<double>());
    ref.params.push_back(Snapshot(*model));
  }
  return ref;
}

// The reference's full tensors as a SHARDED state dict of one piece each
// (what a FULL checkpoint loads as).
state_dict::ShardedStateDict FullDict(const std::map<std::string, at::Tensor>& full) {
  state_dict::ShardedStateDict out;
  for (const auto& [name, t] : full) {
    out.insert(name, state_dict::ShardFullTensor(t, {state_dict::FlatRange{0, t.numel()}}));
  }
  return out;
}

// This rank's part of `full` for the shard `param`.
at::Tensor Rows(const at::Tensor& param, const at::Tensor& full) {
  std::optional<fsdp::ShardedParamSpec> spec = fsdp::sharded_param_spec(param);
  TORCH_CHECK(spec.has_value(), "not a sharded parameter");
  return full.narrow(spec->shard_dim, spec->shard_offset, param.size(spec->shard_dim));
}

void ExpectShardsClose(const torch::nn::Module& model,
                       const std::map<std::string, at::Tensor>& full, const std::string& what) {
  for (const auto& p : model.named_parameters()) {
    auto it = full.find(p.key());
    ASSERT_NE(it, full.end()) << what << ": " << p.key();
    ASSERT_TRUE(fsdp::sharded_param_spec(p.value()).has_value()) << what << ": " << p.key();
    at::Tensor want = Rows(p.value(), it->second);
    ASSERT_EQ(p.value().sizes(), want.sizes()) << what << ": " << p.key();
    EXPECT_TRUE(torch::allclose(p.value(), want, 1e-5, 1e-6))
        << what << ": " << p.key() << " max abs diff "
        << (p.value() - want).abs().max().item<double>();
  }
}

std::string ErrorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

struct Case {
  std::string name;
  bool shard1 = false;   // shard_placement_fn: Shard(1) where dim 1 divides the group
  bool offload = false;  // CPUOffloadPolicy (CPU-only: shards stay in ordinary memory)
  int hsdp_replicas = 0;
};

fsdp::FullyShardOptions OptionsFor(comm::ProcessGroup& pg, const Case& c) {
  fsdp::FullyShardOptions options;
  options.process_group = pg;
  int shard_world = pg.size();
  if (c.hsdp_replicas > 0) {
    shard_world = pg.size() / c.hsdp_replicas;
    absl::StatusOr<comm::DeviceMesh> mesh =
        comm::init_hybrid_shard_mesh(pg, c.hsdp_replicas, shard_world);
    TORCH_CHECK(mesh.ok(), mesh.status().ToString());
    options.mesh = *mesh;
  }
  if (c.shard1) {
    options.shard_placement_fn = [shard_world](const at::Tensor& p) -> std::optional<int64_t> {
      if (p.dim() == 2 && p.size(1) % shard_world == 0) return 1;
      return std::nullopt;
    };
  }
  if (c.offload) options.offload_policy = fsdp::CPUOffloadPolicy{};
  return options;
}

// Bytes of the distinct storages holding `model`'s parameters.
int64_t ParameterStorageBytes(const torch::nn::Module& model) {
  std::unordered_set<const c10::StorageImpl*> seen;
  int64_t bytes = 0;
  for (const auto& p : model.parameters()) {
    if (seen.insert(p.storage().unsafeGetStorageImpl()).second) {
      bytes += static_cast<int64_t>(p.storage().nbytes());
    }
  }
  return bytes;
}

// Meta model -> fully_shard -> to_empty -> LoadFullyShardStateDict ->
// kSteps of AdamW, against the reference.
void RunCase(comm::ProcessGroup& pg, const Case& c, const Reference& ref) {
  SCOPED_TRACE(c.name + " on " + std::to_string(pg.size()) + " ranks");
  const fsdp::FullyShardOptions options = OptionsFor(pg, c);
  MetaNet model(/*on_meta=*/true);
  std::vector<fsdp::FSDPModule> units;
  for (const auto& block : *model->blocks) units.push_back(fsdp::fully_shard(block, options));
  units.push_back(fsdp::fully_shard(model, options));

  // Sharded on meta: every shard a meta tensor of its shard's shape, no
  // memory; the buffers still meta.
  const int shard_world = c.hsdp_replicas > 0 ? pg.size() / c.hsdp_replicas : pg.size();
  int64_t model_numel = 0, padded_numel = 0, row_numel = 0;
  for (const auto& p : model->named_parameters()) {
    ASSERT_TRUE(p.value().is_meta()) << p.key();
    EXPECT_EQ(p.value().storage().data(), nullptr) << p.key();
    std::optional<fsdp::ShardedParamSpec> spec = fsdp::sharded_param_spec(p.value());
    ASSERT_TRUE(spec.has_value()) << p.key();
    const at::Tensor& full = ref.initial.at(p.key());
    EXPECT_EQ(spec->global_shape, full.sizes().vec()) << p.key();
    EXPECT_EQ(spec->group.size(), shard_world) << p.key();
    const int64_t dim_size = full.size(spec->shard_dim);
    const int64_t rows = std::max<int64_t>(
        0, std::min<int64_t>(spec->padded_shard_size, dim_size - spec->shard_offset));
    EXPECT_EQ(p.value().size(spec->shard_dim), rows) << p.key();
    const int64_t row = full.numel() / dim_size;
    model_numel += full.numel();
    padded_numel += spec->padded_shard_size * row;
    row_numel += row;
  }
  for (const auto& b : model->named_buffers()) EXPECT_TRUE(b.value().is_meta()) << b.key();
  for (const auto& unit : units) {
    for (const auto& t : unit.sharded_parameters()) EXPECT_TRUE(t.is_meta());
  }

  fsdp::to_empty(*model, torch::kCPU);

  // This rank's shards only: the padded shards, 1/world of the padded model.
  for (const auto& p : model->named_parameters()) {
    EXPECT_FALSE(p.value().is_meta()) << p.key();
    EXPECT_TRUE(p.value().device().is_cpu()) << p.key();
    EXPECT_TRUE(fsdp::sharded_param_spec(p.value()).has_value()) << p.key();
  }
  for (const auto& b : model->named_buffers()) {
    EXPECT_FALSE(b.value().is_meta()) << b.key();
    EXPECT_EQ(b.value().sizes(), ref.initial.at(b.key()).sizes()) << b.key();
  }
  const int64_t bytes = ParameterStorageBytes(*model);
  EXPECT_EQ(bytes, padded_numel * 4);
  EXPECT_LE(bytes, (model_numel / shard_world + row_numel) * 4);
  if (shard_world > 1) EXPECT_LT(bytes, model_numel * 4);
  // The units hand out the tensors the module holds.
  std::unordered_set<const c10::TensorImpl*> module_params;
  for (const auto& p : model->parameters()) module_params.insert(p.unsafeGetTensorImpl());
  for (const auto& unit : units) {
    for (const auto& t : unit.sharded_parameters()) {
      EXPECT_FALSE(t.is_meta());
      EXPECT_EQ(module_params.count(t.unsafeGetTensorImpl()), 1u);
    }
  }

  absl::Status loaded = state_dict::LoadFullyShardStateDict(*model, nullptr, FullDict(ref.initial));
  ASSERT_TRUE(loaded.ok()) << loaded;
  ExpectShardsClose(*model, ref.initial, "loaded");
  for (const auto& b : model->named_buffers()) {
    EXPECT_TRUE(b.value().equal(ref.initial.at(b.key()))) << b.key();
  }

  torch::optim::AdamW optim(model->parameters(), Adam());
  for (int step = 0; step < kSteps; ++step) {
    const std::string what = "step " + std::to_string(step);
    Batch b = MakeBatch(step, pg.rank(), pg.size());
    optim.zero_grad();
    at::Tensor loss = torch::mse_loss(module_call::call(model, b.x), b.y);
    loss.backward();
    optim.step();
    at::Tensor global = loss.detach().clone().reshape({1});
    comm::all_reduce(pg, global, comm::ReduceOp::kAvg).wait();
    EXPECT_NEAR(global.item<double>(), ref.losses[step], 1e-5 * ref.losses[step]) << what;
    ExpectShardsClose(*model, ref.params[step], what);
  }
}

void RunCases(int world, const std::vector<Case>& cases) {
  const Reference ref = Train();
  comm::testing::RunOnRanks(world, [&](comm::ProcessGroup& pg) {
    for (const Case& c : cases) RunCase(pg, c, ref);
  });
}

TEST(FullyShardMeta, MatchesUnwrappedOn1Rank) { RunCases(1, {{"plain"}}); }
TEST(FullyShardMeta, MatchesUnwrappedOn2Ranks) {
  RunCases(2, {{"plain"}, {"shard1", /*shard1=*/true}, {"offload", false, /*offload=*/true}});
}
TEST(FullyShardMeta, MatchesUnwrappedOn3Ranks) { RunCases(3, {{"plain"}}); }
TEST(FullyShardMeta, MatchesUnwrappedOn4Ranks) {
  RunCases(4, {{"plain"}, {"hsdp 2x2", false, false, /*hsdp_replicas=*/2}});
}

// init_sharded_states fills each rank's rows from its spec (here: the
// reference's rows, so training matches too); with CPUOffloadPolicy. An
// ignored parameter on meta is materialised whole and given no spec.
TEST(FullyShardMeta, InitShardedStatesOn3Ranks) {
  const Reference ref = Train();
  comm::testing::RunOnRanks(3, [&](comm::ProcessGroup& pg) {
    Case c{"init", false, /*offload=*/true};
    const fsdp::FullyShardOptions options = OptionsFor(pg, c);
    MetaNet model(/*on_meta=*/true);
    for (const auto& block : *model->blocks) fsdp::fully_shard(block, options);
    fsdp::fully_shard(model, options);
    fsdp::to_empty(*model, torch::kCPU);
    std::vector<std::string> visited;
    fsdp::init_sharded_states(*model, [&](const std::string& fqn, const at::Tensor& local,
                                          const std::optional<fsdp::ShardedParamSpec>& spec) {
      visited.push_back(fqn);
      const at::Tensor& full = ref.initial.at(fqn);
      if (!spec) {
        EXPECT_NE(fqn.find("scale"), std::string::npos) << fqn << ": only buffers are whole";
        local.copy_(full);
        return;
      }
      EXPECT_EQ(spec->global_shape, full.sizes().vec()) << fqn;
      EXPECT_FALSE(at::GradMode::is_enabled());
      local.copy_(full.narrow(spec->shard_dim, spec->shard_offset, local.size(spec->shard_dim)));
    });
    EXPECT_EQ(visited.size(), ref.initial.size());
    ExpectShardsClose(*model, ref.initial, "initialised");
    torch::optim::AdamW optim(model->parameters(), Adam());
    for (int step = 0; step < kSteps; ++step) {
      Batch b = MakeBatch(step, pg.rank(), pg.size());
      optim.zero_grad();
      at::Tensor loss = torch::mse_loss(module_call::call(model, b.x), b.y);
      loss.backward();
      optim.step();
      at::Tensor global = loss.detach().clone().reshape({1});
      comm::all_reduce(pg, global, comm::ReduceOp::kAvg).wait();
      EXPECT_NEAR(global.item<double>(), ref.losses[step], 1e-5 * ref.losses[step]);
      ExpectShardsClose(*model, ref.params[step], "init step " + std::to_string(step));
    }

    // An ignored meta parameter: whole after to_empty, no spec.
    torch::nn::Linear linear = OnMeta(torch::nn::Linear(kHidden, kOut), true);
    fsdp::FullyShardOptions ignoring = options;
    ignoring.ignored_params = {linear->bias};
    fsdp::fully_shard(linear, ignoring);
    EXPECT_TRUE(linear->bias.is_meta());
    fsdp::to_empty(*linear, torch::kCPU);
    EXPECT_FALSE(linear->bias.is_meta());
    EXPECT_EQ(linear->bias.sizes(), at::IntArrayRef({kOut}));
    EXPECT_TRUE(linear->bias.requires_grad());
    EXPECT_FALSE(fsdp::sharded_param_spec(linear->bias).has_value());
    EXPECT_TRUE(fsdp::sharded_param_spec(linear->weight).has_value());
    std::map<std::string, bool> has_spec;
    fsdp::init_sharded_states(*linear, [&](const std::string& fqn, const at::Tensor& local,
                                           const std::optional<fsdp::ShardedParamSpec>& spec) {
      has_spec[fqn] = spec.has_value();
      local.fill_(1.0);
    });
    EXPECT_EQ(has_spec, (std::map<std::string, bool>{{"bias", false}, {"weight", true}}));
    EXPECT_TRUE(linear->bias.equal(torch::ones({kOut})));
  });
}

TEST(FullyShardMeta, ErrorsOn2Ranks) {
  const Reference ref = Train();
  comm::testing::RunOnRanks(2, [&](comm::ProcessGroup& pg) {
    fsdp::FullyShardOptions options;
    options.process_group = pg;
    {
      // Meta and real parameters in one module.
      torch::nn::Linear linear = OnMeta(torch::nn::Linear(kIn, kHidden), true);
      functorch::NamedMemberAccessor(linear).set_tensor(
          "weight", torch::zeros({kHidden, kIn}, torch::requires_grad()));
      const std::string error = ErrorOf([&] { fsdp::fully_shard(linear, options); });
      EXPECT_NE(error.find("parameter 'bias' is on the meta device but parameter 'weight' is "
                           "on cpu: expected all of the module's managed parameters on the "
                           "meta device or none"),
                std::string::npos)
          << error;
    }
    {
      MetaNet model(/*on_meta=*/true);
      std::vector<fsdp::FSDPModule> blocks;
      for (const auto& block : *model->blocks) blocks.push_back(fsdp::fully_shard(block, options));
      fsdp::FSDPModule root = fsdp::fully_shard(model, options);
      const Batch b = MakeBatch(0, pg.rank(), pg.size());
      // Forward before to_empty: the modules and parameters on meta.
      std::string error = ErrorOf([&] { module_call::call(model, b.x); });
      EXPECT_NE(error.find("FSDP parameters should be materialized from meta device before "
                           "training, but the following were still on meta device: [in.weight, "
                           "in.bias, out.weight, out.bias, blocks.0.fc1.weight"),
                std::string::npos)
          << error;
      EXPECT_NE(error.find("(fully_shard modules the root ("), std::string::npos) << error;
      EXPECT_NE(error.find("'blocks.0', 'blocks.1', 'blocks.2'): call fsdp::to_empty(root, "
                           "device)"),
                std::string::npos)
          << error;
      // unshard() of one module names it.
      error = ErrorOf([&] { blocks[1].unshard(); });
      EXPECT_NE(error.find("MetaBlockImpl): FSDP parameters should be materialized from meta "
                           "device before training, but the following were still on meta "
                           "device: [fc1.weight, fc1.bias, fc2.weight, fc2.bias]: call "
                           "fsdp::to_empty"),
                std::string::npos)
          << error;
      error = ErrorOf([&] {
        fsdp::init_sharded_states(*model, [](const std::string&, const at::Tensor&,
                                             const std::optional<fsdp::ShardedParamSpec>&) {});
      });
      EXPECT_NE(error.find("parameter 'in.weight' is on the meta device: call "
                           "fsdp::to_empty(root, device) first"),
                std::string::npos)
          << error;
      // A module whose shards the root's group holds: the group is
      // materialised whole or not at all.
      error = ErrorOf([&] { fsdp::to_empty(*model->in, torch::kCPU); });
      EXPECT_NE(error.find("are sharded by fully_shard applied to an ancestor"), std::string::npos)
          << error;
      EXPECT_TRUE(model->in->weight.is_meta());
      error = ErrorOf([&] { fsdp::to_empty(*model, torch::kMeta); });
      EXPECT_NE(error.find("device=meta: expected a device to allocate on, not meta"),
                std::string::npos)
          << error;

      // The same model works once materialised and loaded.
      fsdp::to_empty(*model, torch::kCPU);
      absl::Status loaded =
          state_dict::LoadFullyShardStateDict(*model, nullptr, FullDict(ref.initial));
      ASSERT_TRUE(loaded.ok()) << loaded;
      torch::optim::AdamW optim(model->parameters(), Adam());
      at::Tensor loss = torch::mse_loss(module_call::call(model, b.x), b.y);
      loss.backward();
      optim.step();
      at::Tensor global = loss.detach().clone().reshape({1});
      comm::all_reduce(pg, global, comm::ReduceOp::kAvg).wait();
      EXPECT_NEAR(global.item<double>(), ref.losses[0], 1e-5 * ref.losses[0]);
      ExpectShardsClose(*model, ref.params[0], "after the failed forward");
    }
  });
}

}  // namespace
