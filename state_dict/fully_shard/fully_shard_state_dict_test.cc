// fully_shard state dicts (fully_shard_state_dict.h, fully_shard_dcp.h)
// across world sizes, formats and FSDP generations, on 3 Gloo ranks:
//
// - fully_shard on 3 ranks trains 2 Adam steps and saves a SHARDED
//   checkpoint, a FULL one and a DCP directory; fully_shard on 2 ranks (a
//   subgroup) and on 1 loads each, takes a third step, and must equal the
//   unwrapped model trained 3 steps in one process (so model and Adam's
//   state both arrived).
// - FSDP1 (FullyShardedDataParallel, use_orig_params) on 3 ranks saves
//   SHARDED (model + optimizer), FULL (model) and DCP; fully_shard on 2
//   ranks loads each. And FSDP1 on 2 ranks loads fully_shard's SHARDED
//   checkpoint and DCP: the same parameters after the third step.
// - the FULL file's keys and values as a plain reader (LoadTensorDict,
//   what torch.load gives) sees them.
// - fully_shard on an HSDP mesh (3 replicas x 1 shard) saves SHARDED, FULL
//   and DCP, loaded the same way.
// - bad input: a missing key, a wrong global shape, FSDP1's flat-parameter
//   keys, optimizer state of another shape: errors naming key and
//   expectation, the model untouched.
// - on 2 ranks, shard_placement_fn's Shard(1) weights: SHARDED, FULL and
//   DCP saved and loaded into Shard(1) and dim-0 trees on 2 ranks and 1,
//   and a dim-0 tree's checkpoints into Shard(1) trees.
#include "state_dict/fully_shard/fully_shard_state_dict.h"

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "comm/collectives.h"
#include "comm/device_mesh.h"
#include "comm/subgroups.h"
#include "fsdp/fully_shard.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "module_call/call.h"
#include "module_call/wrap_policy.h"
#include "state_dict/checkpoint.h"
#include "state_dict/dcp.h"
#include "state_dict/fsdp/fsdp_dcp.h"
#include "state_dict/fsdp/fsdp_optim_state_dict.h"
#include "state_dict/fsdp/fsdp_state_dict.h"
#include "state_dict/fully_shard/fully_shard_dcp.h"
#include "state_dict/tensor_dict.h"
#include "testing/multiprocess.h"

namespace state_dict {
namespace {

using fsdp::FullyShardedDataParallel;
using Params = std::map<std::string, torch::Tensor>;

torch::nn::Sequential MakeModel() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(5, 7), torch::nn::ReLU(), torch::nn::Linear(7, 3));
}

// Three batches of 4 rows of `inputs` values, from `seed`.
std::vector<torch::Tensor> RandomBatches(uint64_t seed, int64_t inputs) {
  torch::manual_seed(seed);
  std::vector<torch::Tensor> out;
  for (int i = 0; i < 3; ++i) out.push_back(torch::randn({4, inputs}));
  return out;
}

std::vector<torch::Tensor> Batches() { return RandomBatches(7, 5); }

Params Snapshot(const torch::nn::Module& m) {
  Params out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

// The unwrapped `model` after `steps` Adam steps on `batches`.
Params Trained(torch::nn::Sequential model, const std::vector<torch::Tensor>& batches, int steps) {
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
  for (int i = 0; i < steps; ++i) {
    model->forward(batches[static_cast<size_t>(i)]).pow(2).sum().backward();
    opt.step();
    opt.zero_grad();
  }
  return Snapshot(*model);
}

Params Reference(int steps) { return Trained(MakeModel(), Batches(), steps); }

void ExpectClose(const Params& got, const Params& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, t] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << what << ": " << name;
    EXPECT_TRUE(torch::allclose(it->second, t, 1e-5, 1e-6)) << what << ": " << name << "\ngot\n"
                                                            << it->second << "\nwant\n"
                                                            << t;
  }
}

// `model` as a fully_shard tree over `pg`: each Linear, then the root;
// with `dim1`, the 2-D weights on Shard(1) (shard_placement_fn), else on
// dim 0.
torch::nn::Sequential ShardTree(torch::nn::Sequential model, const comm::ProcessGroup& pg,
                                bool dim1 = false) {
  fsdp::FullyShardOptions options;
  options.process_group = pg;
  if (dim1) {
    options.shard_placement_fn = [](const at::Tensor& p) -> std::optional<int64_t> {
      if (p.dim() == 2) return 1;
      return std::nullopt;
    };
  }
  fsdp::fully_shard((*model)[0], options);
  fsdp::fully_shard((*model)[2], options);
  fsdp::fully_shard(model, options);
  return model;
}

torch::nn::Sequential Sharded(const comm::ProcessGroup& pg) { return ShardTree(MakeModel(), pg); }

void Step(torch::nn::Sequential& model, torch::optim::Optimizer& opt, const torch::Tensor& x) {
  module_call::call(model, x).pow(2).sum().backward();
  opt.step();
  opt.zero_grad();
}

// The full parameters of a fully_shard tree (collective).
Params Gathered(torch::nn::Sequential& model) {
  std::vector<fsdp::FSDPModule> units;
  for (const auto& m : model->modules()) {
    if (auto unit = fsdp::as_fsdp_module(*m)) units.push_back(*unit);
  }
  for (auto& unit : units) unit.unshard();
  Params out = Snapshot(*model);
  for (auto& unit : units) unit.reshard();
  return out;
}

FullyShardedDataParallel::Options Fsdp1Options(const comm::ProcessGroup& pg) {
  FullyShardedDataParallel::Options o;
  o.process_group = pg;
  o.auto_wrap_policy = module_call::module_type_auto_wrap_policy<torch::nn::LinearImpl>();
  o.use_orig_params = true;
  return o;
}

Params Fsdp1Full(FullyShardedDataParallel& model) {
  auto sd = GetModelStateDict(model, StateDictType::kFull);
  EXPECT_TRUE(sd.ok()) << sd.status();
  Params out;
  if (sd.ok()) {
    for (const auto& item : sd->full) out[item.key()] = item.value();
  }
  return out;
}

std::string Dir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return std::string(tmp == nullptr ? "/tmp" : tmp) + "/fully_shard_state_dict";
}

void CommitDcp(const comm::ProcessGroup& pg, const std::string& dir) {
  comm::barrier(pg).wait();
  if (pg.rank() == 0) {
    auto s = CommitDcpCheckpoint(dir, pg.size());
    ASSERT_TRUE(s.ok()) << s;
  }
  comm::barrier(pg).wait();
}

TEST(FullyShardStateDict, MovesBetweenWorldSizesFormatsAndFsdp1) {
  const std::string dir = Dir();
  const Params after2 = Reference(2), after3 = Reference(3);
  const auto batches = Batches();
  comm::testing::RunOptions run;
  run.timeout = std::chrono::seconds(240);
  comm::testing::RunOnRanks(
      3,
      [&](comm::ProcessGroup& world) {
        if (world.rank() == 0) std::filesystem::create_directories(dir);
        comm::barrier(world).wait();
        // ---- saved by fully_shard on 3 ranks ----
        {
          torch::nn::Sequential model = Sharded(world);
          torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
          Step(model, opt, batches[0]);
          Step(model, opt, batches[1]);
          for (auto kind : {FullyShardCheckpointKind::kSharded, FullyShardCheckpointKind::kFull}) {
            const std::string root =
                dir + (kind == FullyShardCheckpointKind::kFull ? "/fs_full" : "/fs_sharded");
            auto s = SaveFullyShardCheckpoint(root, 2, *model, &opt, kind);
            ASSERT_TRUE(s.ok()) << s;
          }
          auto s = SaveFullyShardDcpShard(dir + "/fs_dcp", *model, &opt);
          ASSERT_TRUE(s.ok()) << s;
          CommitDcp(world, dir + "/fs_dcp");
          ExpectClose(Gathered(model), after2, "fully_shard after 2 steps");
          // get_model_state_dict(full_state_dict=True): whole on every rank,
          // the optimizer's too; rank0_only: rank 0's alone.
          auto full = FullyShardFullStateDict(*model, &opt);
          ASSERT_TRUE(full.ok()) << full.status();
          Params full_model;
          for (const auto& item : *full) {
            if (item.key().find('/') == std::string::npos) full_model[item.key()] = item.value();
          }
          ExpectClose(full_model, after2, "FullyShardFullStateDict");
          EXPECT_EQ((*full)["0.weight/exp_avg"].sizes(), torch::IntArrayRef({7, 5}));
          EXPECT_EQ((*full)["2.bias/step"].dim(), 0);
          auto rank0 = FullyShardFullStateDict(*model, nullptr, /*rank0_only=*/true);
          ASSERT_TRUE(rank0.ok()) << rank0.status();
          EXPECT_EQ(rank0->size(), world.rank() == 0 ? 4u : 0u);
          if (world.rank() == 0) {
            // What torch.load gives: "model.<fqn>" full tensors, Adam's
            // state under "optim.<fqn>.<entry>".
            auto file = LoadTensorDict(dir + "/fs_full/step_2/model.pt");
            ASSERT_TRUE(file.ok()) << file.status();
            Params model_part;
            for (const auto& item : file->tensors) {
              if (item.key().rfind("model.", 0) == 0)
                model_part[item.key().substr(6)] = item.value();
            }
            ExpectClose(model_part, after2, "FULL file");
            for (const char* key :
                 {"optim.0.weight.exp_avg", "optim.0.weight.exp_avg_sq", "optim.2.bias.step"}) {
              EXPECT_NE(file->tensors.find(key), nullptr) << key;
            }
            EXPECT_EQ(file->tensors["optim.0.weight.exp_avg"].sizes(), torch::IntArrayRef({7, 5}));
          }
        }
        // ---- saved by FSDP1 on 3 ranks ----
        {
          FullyShardedDataParallel model(MakeModel(), Fsdp1Options(world));
          torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(0.01));
          for (int i = 0; i < 2; ++i) {
            model.forward(batches[static_cast<size_t>(i)]).pow(2).sum().backward();
            opt.step();
            opt.zero_grad();
          }
          auto msd = GetModelStateDict(model, StateDictType::kSharded);
          ASSERT_TRUE(msd.ok()) << msd.status();
          auto osd = ShardedOptimStateDict(model, opt);
          ASSERT_TRUE(osd.ok()) << osd.status();
          auto both = MergeShardedStateDicts(*msd, *osd);
          ASSERT_TRUE(both.ok()) << both.status();
          ASSERT_TRUE(SaveModelCheckpoint(dir + "/f1_sharded", 2, *both).ok());
          auto full = GetModelStateDict(model, StateDictType::kFull, {/*rank0_only=*/true});
          ASSERT_TRUE(full.ok()) << full.status();
          ASSERT_TRUE(SaveModelCheckpoint(dir + "/f1_full", 2, *full).ok());
          comm::barrier(world).wait();
          if (world.rank() == 0) {
            ASSERT_TRUE(CommitShardedCheckpoint(dir + "/f1_sharded", 2, 3).ok());
          }
          ASSERT_TRUE(SaveFsdpDcpShard(dir + "/f1_dcp", model, &opt).ok());
          CommitDcp(world, dir + "/f1_dcp");
        }
        // ---- saved by fully_shard on an HSDP mesh (3 replicas x 1 shard):
        // checkpoint ranks 0-2, replica 0 writing the pieces ----
        {
          auto mesh = comm::init_hybrid_shard_mesh(world, 3, 1);
          ASSERT_TRUE(mesh.ok()) << mesh.status();
          torch::nn::Sequential model = MakeModel();
          fsdp::FullyShardOptions options;
          options.mesh = *mesh;
          fsdp::fully_shard((*model)[0], options);
          fsdp::fully_shard((*model)[2], options);
          fsdp::fully_shard(model, options);
          torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
          Step(model, opt, batches[0]);
          Step(model, opt, batches[1]);
          auto state = FullyShardModelStateDict(*model);
          ASSERT_TRUE(state.ok()) << state.status();
          EXPECT_EQ(state->world_size, 3);
          EXPECT_EQ(state->rank, world.rank());
          EXPECT_EQ(state->shard_is_replica, world.rank() != 0);
          for (auto kind : {FullyShardCheckpointKind::kSharded, FullyShardCheckpointKind::kFull}) {
            const std::string root =
                dir + (kind == FullyShardCheckpointKind::kFull ? "/hsdp_full" : "/hsdp_sharded");
            auto s = SaveFullyShardCheckpoint(root, 2, *model, &opt, kind);
            ASSERT_TRUE(s.ok()) << s;
          }
          auto s = SaveFullyShardDcpShard(dir + "/hsdp_dcp", *model, &opt);
          ASSERT_TRUE(s.ok()) << s;
          CommitDcp(world, dir + "/hsdp_dcp");
          auto full = FullyShardFullStateDict(*model, nullptr);
          ASSERT_TRUE(full.ok()) << full.status();
          Params full_model;
          for (const auto& item : *full) full_model[item.key()] = item.value();
          ExpectClose(full_model, after2, "HSDP FullyShardFullStateDict");
        }
        // ---- loaded on 2 ranks (0, 1) and on 1 (rank 2) ----
        auto pair = comm::new_group(world, {0, 1});
        auto single = comm::new_group(world, {2});
        ASSERT_TRUE(pair.ok() && single.ok());
        const comm::ProcessGroup& pg = world.rank() < 2 ? *pair : *single;
        struct Source {
          const char* name;
          bool dcp;
          bool with_optim;
        };
        for (const Source& src :
             {Source{"fs_sharded/step_2", false, true}, Source{"fs_full/step_2", false, true},
              Source{"fs_dcp", true, true}, Source{"f1_sharded/step_2", false, true},
              Source{"f1_full/step_2", false, false}, Source{"f1_dcp", true, true},
              Source{"hsdp_sharded/step_2", false, true}, Source{"hsdp_full/step_2", false, true},
              Source{"hsdp_dcp", true, true}}) {
          const std::string what = std::string(src.name) + " into fully_shard on " +
                                   std::to_string(pg.size()) + " ranks";
          torch::nn::Sequential model = Sharded(pg);
          torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
          const std::string path = dir + "/" + src.name;
          absl::Status s =
              src.dcp ? LoadFullyShardDcp(path, *model, &opt)
                      : LoadFullyShardCheckpoint(*model, src.with_optim ? &opt : nullptr, path);
          ASSERT_TRUE(s.ok()) << what << ": " << s;
          ExpectClose(Gathered(model), after2, what + " (loaded)");
          if (!src.with_optim) continue;
          Step(model, opt, batches[2]);
          ExpectClose(Gathered(model), after3, what + " (third step)");
        }
        // fully_shard's checkpoints into FSDP1 on 2 ranks / 1 rank.
        for (const char* name : {"fs_sharded/step_2", "fs_dcp"}) {
          const std::string what = std::string(name) + " into FSDP1";
          const std::string path = dir + "/" + name;
          FullyShardedDataParallel model(MakeModel(), Fsdp1Options(pg));
          torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(0.01));
          if (std::string(name) == "fs_dcp") {
            auto s = LoadFsdpDcp(path, model, &opt);
            ASSERT_TRUE(s.ok()) << what << ": " << s;
          } else {
            auto s = LoadModelCheckpoint(model, path, StateDictType::kSharded);
            ASSERT_TRUE(s.ok()) << what << ": " << s;
            s = LoadShardedOptimCheckpoint(model, opt, path);
            ASSERT_TRUE(s.ok()) << what << ": " << s;
          }
          model.forward(batches[2]).pow(2).sum().backward();
          opt.step();
          ExpectClose(Fsdp1Full(model), after3, what + " (third step)");
        }
        // FSDP1 loads fully_shard's FULL file through the trainer's layout
        // is the trainer's business; the FULL model entries load plainly:
        {
          auto file = LoadFullStateDict(dir + "/fs_full/step_2");
          ASSERT_TRUE(file.ok()) << file.status();
          FsdpModelStateDict full;
          full.type = StateDictType::kFull;
          for (const auto& item : *file) {
            if (item.key().rfind("model.", 0) == 0)
              full.full.insert(item.key().substr(6), item.value());
          }
          FullyShardedDataParallel model(MakeModel(), Fsdp1Options(pg));
          auto s = LoadModelStateDict(model, full);
          ASSERT_TRUE(s.ok()) << s;
          ExpectClose(Fsdp1Full(model), after2, "fs_full into FSDP1");
        }

        // ---- bad input ----
        torch::nn::Sequential model = Sharded(pg);
        torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
        const Params before = Gathered(model);
        auto good = FullyShardModelStateDict(*model);
        ASSERT_TRUE(good.ok()) << good.status();
        auto expect_error = [&](const ShardedStateDict& sd, const std::string& needle,
                                const std::string& what) {
          absl::Status s = LoadFullyShardStateDict(*model, &opt, sd);
          EXPECT_FALSE(s.ok()) << what;
          EXPECT_NE(std::string(s.message()).find(needle), std::string::npos) << what << ": " << s;
          ExpectClose(Gathered(model), before, what + ": model untouched");
        };
        {
          ShardedStateDict sd;
          for (const auto& item : good->sharded) {
            if (item.key() != "2.bias") sd.insert(item.key(), item.value());
          }
          expect_error(sd, "'2.bias'", "missing key");
        }
        {
          ShardedStateDict sd;
          for (const auto& item : good->sharded) {
            ShardedTensor t = item.value();
            if (item.key() == "0.weight") t.global_shape = {5, 7};
            sd.insert(item.key(), t);
          }
          expect_error(sd, "'0.weight' has global shape [5, 7] Float: expected [7, 5] Float",
                       "wrong global shape");
        }
        {
          ShardedStateDict sd;
          ShardedTensor flat;
          flat.global_shape = {59};
          flat.pieces.push_back({{0, 59}, torch::zeros({59})});
          sd.insert("_fsdp_wrapped_module.flat_param", flat);
          expect_error(sd, "unexpected key '_fsdp_wrapped_module.flat_param'", "FSDP1 flat keys");
        }
        {
          ShardedStateDict sd;
          for (const auto& item : good->sharded) sd.insert(item.key(), item.value());
          ShardedTensor bad;
          bad.global_shape = {3, 3};
          bad.pieces.push_back({{0, 9}, torch::zeros({9})});
          sd.insert("0.weight/exp_avg", bad);
          expect_error(sd, "'0.weight/exp_avg' has global shape [3, 3]", "optimizer state shape");
        }
        {
          auto s = LoadFullyShardCheckpoint(*model, &opt, dir + "/nowhere/step_2");
          EXPECT_FALSE(s.ok());
          EXPECT_NE(std::string(s.message()).find("nowhere"), std::string::npos) << s;
        }
      },
      run);
}

// ---- Shard(1): shard_placement_fn's shards off dim 0 ----

// Every weight's dims divide by 2, so shard_placement_fn may put the
// weights on Shard(1) over 2 ranks (fully_shard shards off dim 0 only
// evenly).
torch::nn::Sequential MakeEvenModel() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(6, 4), torch::nn::ReLU(), torch::nn::Linear(4, 2));
}

std::vector<torch::Tensor> EvenBatches() { return RandomBatches(11, 6); }

Params EvenReference(int steps) { return Trained(MakeEvenModel(), EvenBatches(), steps); }

torch::nn::Sequential EvenSharded(const comm::ProcessGroup& pg, bool dim1) {
  return ShardTree(MakeEvenModel(), pg, dim1);
}

// On 2 ranks: a Shard(1) tree saves SHARDED, FULL and DCP and gives its
// full state dict; each loads into a Shard(1) tree and a dim-0 tree on 2
// ranks and on 1, and a dim-0 tree's checkpoint into a Shard(1) tree; after
// a third step all equal the unwrapped model's 3 steps (Adam's state
// arrived too).
TEST(FullyShardStateDict, ShardOffDimZeroSavesAndLoads) {
  const std::string dir = Dir() + "_dim1";
  const Params after2 = EvenReference(2), after3 = EvenReference(3);
  const auto batches = EvenBatches();
  comm::testing::RunOptions run;
  run.timeout = std::chrono::seconds(240);
  comm::testing::RunOnRanks(
      2,
      [&](comm::ProcessGroup& world) {
        if (world.rank() == 0) std::filesystem::create_directories(dir);
        comm::barrier(world).wait();
        for (bool dim1 : {true, false}) {
          const std::string tag = dim1 ? "dim1" : "dim0";
          torch::nn::Sequential model = EvenSharded(world, dim1);
          if (dim1) {
            auto spec = fsdp::sharded_param_spec((*model)[0]->named_parameters()["weight"]);
            ASSERT_TRUE(spec.has_value());
            ASSERT_EQ(spec->shard_dim, 1);
          }
          torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
          Step(model, opt, batches[0]);
          Step(model, opt, batches[1]);
          ExpectClose(Gathered(model), after2, tag + " after 2 steps");
          for (auto kind : {FullyShardCheckpointKind::kSharded, FullyShardCheckpointKind::kFull}) {
            const std::string root =
                dir + "/" + tag + (kind == FullyShardCheckpointKind::kFull ? "_full" : "_sharded");
            auto s = SaveFullyShardCheckpoint(root, 2, *model, &opt, kind);
            ASSERT_TRUE(s.ok()) << tag << ": " << s;
          }
          auto s = SaveFullyShardDcpShard(dir + "/" + tag + "_dcp", *model, &opt);
          ASSERT_TRUE(s.ok()) << s;
          CommitDcp(world, dir + "/" + tag + "_dcp");
          auto full = FullyShardFullStateDict(*model, &opt);
          ASSERT_TRUE(full.ok()) << full.status();
          Params full_model;
          for (const auto& item : *full) {
            if (item.key().find('/') == std::string::npos) full_model[item.key()] = item.value();
          }
          ExpectClose(full_model, after2, tag + " FullyShardFullStateDict");
          EXPECT_EQ((*full)["0.weight/exp_avg"].sizes(), torch::IntArrayRef({4, 6}));
        }
        if (world.rank() == 0) {
          // The FULL file as torch.load sees it: whole tensors.
          auto file = LoadTensorDict(dir + "/dim1_full/step_2/model.pt");
          ASSERT_TRUE(file.ok()) << file.status();
          Params model_part;
          for (const auto& item : file->tensors) {
            if (item.key().rfind("model.", 0) == 0) model_part[item.key().substr(6)] = item.value();
          }
          ExpectClose(model_part, after2, "dim1 FULL file");
          EXPECT_EQ(file->tensors["optim.0.weight.exp_avg"].sizes(), torch::IntArrayRef({4, 6}));
        }
        auto single = comm::new_group(world, {world.rank()});
        ASSERT_TRUE(single.ok());
        struct Target {
          const comm::ProcessGroup* pg;
          bool dim1;
        };
        for (const std::string src : {"dim1_sharded/step_2", "dim1_full/step_2", "dim1_dcp",
                                      "dim0_sharded/step_2", "dim0_dcp"}) {
          for (const Target& target : {Target{&world, true}, Target{&world, false},
                                       Target{&*single, false}, Target{&*single, true}}) {
            const std::string what = src + " into " + (target.dim1 ? "Shard(1)" : "Shard(0)") +
                                     " on " + std::to_string(target.pg->size()) + " rank(s)";
            torch::nn::Sequential model = EvenSharded(*target.pg, target.dim1);
            torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
            const std::string path = dir + "/" + src;
            absl::Status s = src.find("_dcp") != std::string::npos
                                 ? LoadFullyShardDcp(path, *model, &opt)
                                 : LoadFullyShardCheckpoint(*model, &opt, path);
            ASSERT_TRUE(s.ok()) << what << ": " << s;
            ExpectClose(Gathered(model), after2, what + " (loaded)");
            Step(model, opt, batches[2]);
            ExpectClose(Gathered(model), after3, what + " (third step)");
          }
        }
      },
      run);
}

}  // namespace
}  // namespace state_dict
