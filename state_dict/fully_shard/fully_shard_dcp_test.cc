// fully_shard state through torch.distributed.checkpoint, both ways,
// against Python's fully_shard itself:
//
// - testdata/python_fsdp2_w2 (tools/golden/fully_shard_dcp_golden.py):
//   Python's fully_shard trained 2 Adam steps on 2 ranks and dcp.saved
//   get_state_dict(model, opt). Our fully_shard loads it on 3 ranks and
//   takes the third step on the same batch: the parameters equal Python's
//   after its third step (testdata/py_after.pt), so the model and Adam's
//   moments and step count arrived.
// - our fully_shard on 3 ranks trains the same 2 steps and saves DCP and a
//   FULL checkpoint; Python's fully_shard on 2 ranks dcp.loads the
//   directory (set_state_dict), checks the FULL model.pt with torch.load
//   (weights_only, its default) against what it loaded, and takes the third
//   step: again the same parameters as ours.
// - the same both ways with shard_placement_fn's Shard(1) on the 2-D
//   weights (Sequential(Linear(6, 4), ReLU, Linear(4, 2)), the weights
//   split by columns): testdata/python_fsdp2_shard1_w2 (Python's chunks
//   [rows, cols / 2]) loads into our Shard(1) tree on 2 ranks and our dim-0
//   tree on 3 and continues to testdata/py_after_shard1.pt; our Shard(1)
//   DCP directory (a [1, cols / 2] chunk per row) loads into Python's
//   Shard(1) fully_shard on 2 ranks, which continues as ours does.
#include "state_dict/fully_shard/fully_shard_dcp.h"

#include <cstdlib>
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
#include "formats/testing/python_interop.h"
#include "fsdp/fully_shard.h"
#include "module_call/call.h"
#include "state_dict/dcp.h"
#include "state_dict/fully_shard/fully_shard_state_dict.h"
#include "state_dict/tensor_dict.h"
#include "testing/multiprocess.h"

namespace state_dict {
namespace {

using formats::testing::PythonTorchAvailable;
using formats::testing::RunPython;

// Python's side of the tests of our directories. argv: our directory d
// (d/ckpt: DCP, d/full/step_2/model.pt: FULL), the fixture's batches.pt,
// the model's in / hidden / out features, and the dim shard_placement_fn
// gives the 2-D weights (-1: none, dim 0).
constexpr char kPythonLoad[] = R"PY(
import os, sys, torch, torch.distributed as dist
import torch.multiprocessing as mp
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict, StateDictOptions
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

def run(rank, d, batches, n_in, n_hidden, n_out, dim):
    dist.init_process_group("gloo", init_method="file://%s/store" % d, rank=rank, world_size=2)
    torch.manual_seed(123)  # overwritten by the load
    model = torch.nn.Sequential(torch.nn.Linear(n_in, n_hidden), torch.nn.ReLU(),
                                torch.nn.Linear(n_hidden, n_out))
    kw = {} if dim < 0 else {"shard_placement_fn": lambda p: Shard(dim) if p.dim() == 2 else None}
    fully_shard(model[0], **kw); fully_shard(model[2], **kw); fully_shard(model, **kw)
    if dim >= 0:
        assert model[0].weight.placements == (Shard(dim),), model[0].weight.placements
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=d + "/ckpt")
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    full, full_optim = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    ours = torch.load(d + "/full/step_2/model.pt")  # weights_only=True, the default
    assert rank != 0 or len(full) == 4, full.keys()
    for k, v in full.items():
        assert torch.equal(ours["model." + k], v), k
    for fqn, entries in full_optim.get("state", {}).items():  # rank 0's
        for entry, v in entries.items():
            assert torch.equal(ours["optim.%s.%s" % (fqn, entry)].reshape(v.shape), v), (fqn, entry)
    assert rank != 0 or len(full_optim["state"]) == 4, full_optim
    assert opt.param_groups[0]["lr"] == 0.01
    x3 = torch.load(batches)["x3"]
    model(x3).pow(2).sum().backward(); opt.step(); opt.zero_grad()
    full, _ = get_state_dict(model, opt,
                             options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in full.items()}, d + "/py_after_ours.pt")
    dist.barrier()
    dist.destroy_process_group()
    # Without finalizing: PyTorch issue 190489 (see state_dict/dcp_test.cc).
    sys.stdout.flush(); sys.stderr.flush(); os._exit(0)

if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1], sys.argv[2]) + tuple(int(a) for a in sys.argv[3:7]),
             nprocs=2)
)PY";

std::string Fixture(const std::string& name) {
  return std::string(std::getenv("TEST_SRCDIR")) + "/" + std::getenv("TEST_WORKSPACE") +
         "/state_dict/fully_shard/testdata/" + name;
}

std::string Dir(const std::string& name = "fully_shard_dcp") {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return std::string(tmp == nullptr ? "/tmp" : tmp) + "/" + name;
}

// Sequential(Linear(in, hidden), ReLU, Linear(hidden, out)) and the dim
// shard_placement_fn gives its 2-D weights (-1: none, dim 0): the first
// fixture's model, and the Shard(1) fixture's.
struct Shape {
  int64_t in, hidden, out, dim;
};
constexpr Shape kDim0Model{5, 7, 3, -1};
constexpr Shape kShard1Model{6, 4, 2, 1};

std::string PythonArgs(const std::string& dir, const std::string& batches, const Shape& shape) {
  return dir + " " + batches + " " + std::to_string(shape.in) + " " + std::to_string(shape.hidden) +
         " " + std::to_string(shape.out) + " " + std::to_string(shape.dim);
}

torch::nn::Sequential Sharded(const comm::ProcessGroup& pg, const Shape& shape = kDim0Model) {
  torch::manual_seed(123);  // overwritten by the load, or below
  torch::nn::Sequential model(torch::nn::Linear(shape.in, shape.hidden), torch::nn::ReLU(),
                              torch::nn::Linear(shape.hidden, shape.out));
  fsdp::FullyShardOptions options;
  options.process_group = pg;
  if (shape.dim >= 0) {
    const int64_t dim = shape.dim;
    options.shard_placement_fn = [dim](const at::Tensor& p) -> std::optional<int64_t> {
      if (p.dim() == 2) return dim;
      return std::nullopt;
    };
  }
  fsdp::fully_shard((*model)[0], options);
  fsdp::fully_shard((*model)[2], options);
  fsdp::fully_shard(model, options);
  return model;
}

void Step(torch::nn::Sequential& model, torch::optim::Optimizer& opt, const torch::Tensor& x) {
  module_call::call(model, x).pow(2).sum().backward();
  opt.step();
  opt.zero_grad();
}

TensorDict Gathered(torch::nn::Sequential& model) {
  std::vector<fsdp::FSDPModule> units;
  for (const auto& m : model->modules()) {
    if (auto unit = fsdp::as_fsdp_module(*m)) units.push_back(*unit);
  }
  for (auto& unit : units) unit.unshard();
  TensorDict out;
  for (const auto& p : model->named_parameters()) out.insert(p.key(), p.value().detach().clone());
  for (auto& unit : units) unit.reshard();
  return out;
}

void ExpectClose(const TensorDict& ours, const TensorDict& python, const std::string& what) {
  ASSERT_EQ(ours.size(), python.size()) << what;
  for (const auto& item : python) {
    const torch::Tensor* mine = ours.find(item.key());
    ASSERT_NE(mine, nullptr) << what << ": " << item.key();
    EXPECT_TRUE(torch::allclose(*mine, item.value(), 1e-5, 1e-6))
        << what << ": " << item.key() << "\nours\n"
        << *mine << "\npython\n"
        << item.value();
  }
}

// One of Python's fully_shard fixtures (`fixture`, saved on 2 ranks after
// 2 steps; `batches`, `after`: its batches and its parameters after the
// third step) loads into ours (`shape`, on pg's ranks), which takes the
// third step to Python's parameters.
void PythonDirectoryContinuesHere(comm::ProcessGroup& pg, const Shape& shape,
                                  const std::string& fixture, const std::string& batches_file,
                                  const std::string& after_file, const std::string& what) {
  auto batches = LoadTensorDict(Fixture(batches_file));
  ASSERT_TRUE(batches.ok()) << batches.status();
  torch::nn::Sequential model = Sharded(pg, shape);
  auto spec = fsdp::sharded_param_spec((*model)[0]->named_parameters()["weight"]);
  ASSERT_TRUE(spec.has_value());
  ASSERT_EQ(spec->shard_dim, shape.dim < 0 ? 0 : shape.dim);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
  auto loaded = LoadFullyShardDcp(Fixture(fixture), *model, &opt);
  ASSERT_TRUE(loaded.ok()) << loaded;
  Step(model, opt, batches->tensors["x3"]);
  auto python = LoadTensorDict(Fixture(after_file));
  ASSERT_TRUE(python.ok()) << python.status();
  ExpectClose(
      Gathered(model), python->tensors,
      what + " on " + std::to_string(pg.size()) + " ranks, dim " + std::to_string(spec->shard_dim));
}

// Python's fully_shard saved on 2 ranks; ours loads on 3 and continues.
TEST(FullyShardDcp, PythonDirectoryContinuesHereOnAnotherWorldSize) {
  comm::testing::RunOnRanks(3, [&](comm::ProcessGroup& pg) {
    PythonDirectoryContinuesHere(pg, kDim0Model, "python_fsdp2_w2", "batches.pt", "py_after.pt",
                                 "Python's fully_shard DCP");
  });
}

// Ours on `ranks` ranks (`shape`) starts from the parameters of Python's
// fixture `fixture`, takes 2 steps with a fresh Adam (what it saves is
// ours) and saves DCP (and a FULL file) under `dir`, then the third step;
// Python's fully_shard on 2 ranks (kPythonLoad, the same shape) loads the
// DCP directory, takes the same third step and must equal ours.
void OurDirectoryContinuesInPython(const std::string& dir, int ranks, const Shape& shape,
                                   const std::string& fixture, const std::string& batches_file,
                                   const std::string& what) {
  if (!comm::testing::IsRankProcess()) {
    ASSERT_TRUE(PythonTorchAvailable()) << "run tools/setup.sh --with-python";
    std::filesystem::create_directories(dir);
  }
  const int failed = comm::testing::RunOnRanks(ranks, [&](comm::ProcessGroup& pg) {
    auto batches = LoadTensorDict(Fixture(batches_file));
    ASSERT_TRUE(batches.ok()) << batches.status();
    torch::nn::Sequential model = Sharded(pg, shape);
    auto loaded = LoadFullyShardDcp(Fixture(fixture), *model, nullptr);
    ASSERT_TRUE(loaded.ok()) << loaded;
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
    Step(model, opt, batches->tensors["x1"]);
    Step(model, opt, batches->tensors["x2"]);
    auto saved = SaveFullyShardDcpShard(dir + "/ckpt", *model, &opt);
    ASSERT_TRUE(saved.ok()) << saved;
    comm::barrier(pg).wait();
    if (pg.rank() == 0) {
      auto committed = CommitDcpCheckpoint(dir + "/ckpt", pg.size());
      ASSERT_TRUE(committed.ok()) << committed;
    }
    auto full =
        SaveFullyShardCheckpoint(dir + "/full", 2, *model, &opt, FullyShardCheckpointKind::kFull);
    ASSERT_TRUE(full.ok()) << full;
    Step(model, opt, batches->tensors["x3"]);
    TensorDict after = Gathered(model);
    if (pg.rank() == 0) ASSERT_TRUE(SaveTensorDict(after, dir + "/ours_after.pt").ok());
  });
  if (comm::testing::IsRankProcess()) return;
  ASSERT_EQ(failed, 0);
  std::string output;
  ASSERT_EQ(RunPython(kPythonLoad, PythonArgs(dir, Fixture(batches_file), shape), &output), 0)
      << output;
  auto ours = LoadTensorDict(dir + "/ours_after.pt");
  auto python = LoadTensorDict(dir + "/py_after_ours.pt");
  ASSERT_TRUE(ours.ok() && python.ok());
  ExpectClose(ours->tensors, python->tensors, what);
}

// Ours saves on 3 ranks; Python's fully_shard on 2 loads and continues.
TEST(FullyShardDcp, OurDirectoryContinuesInPython) {
  OurDirectoryContinuesInPython(Dir(), 3, kDim0Model, "python_fsdp2_w2", "batches.pt",
                                "Python's fully_shard on 2 ranks from ours");
}

// Shard(1) on 2 ranks, or dim 0 on 3, loads Python's Shard(1) directory
// (its weights' chunks [rows, cols / 2] at column offsets 0 and cols / 2)
// and takes the third step to Python's parameters after its third.
TEST(FullyShardDcp, PythonShard1DirectoryContinuesHereOnShard1) {
  comm::testing::RunOnRanks(2, [&](comm::ProcessGroup& pg) {
    PythonDirectoryContinuesHere(pg, kShard1Model, "python_fsdp2_shard1_w2", "batches_shard1.pt",
                                 "py_after_shard1.pt", "Python's Shard(1) fully_shard DCP");
  });
}

TEST(FullyShardDcp, PythonShard1DirectoryContinuesHereOnDim0OnAnotherWorldSize) {
  comm::testing::RunOnRanks(3, [&](comm::ProcessGroup& pg) {
    PythonDirectoryContinuesHere(pg, {6, 4, 2, -1}, "python_fsdp2_shard1_w2", "batches_shard1.pt",
                                 "py_after_shard1.pt", "Python's Shard(1) fully_shard DCP");
  });
}

// Ours with Shard(1) on 2 ranks saves (a [1, cols / 2] DCP chunk per row
// of a weight); Python's fully_shard with Shard(1) on 2 loads and continues.
TEST(FullyShardDcp, OurShard1DirectoryContinuesInPython) {
  OurDirectoryContinuesInPython(Dir("fully_shard_dcp_shard1"), 2, kShard1Model,
                                "python_fsdp2_shard1_w2", "batches_shard1.pt",
                                "Python's Shard(1) fully_shard on 2 ranks from ours");
}

}  // namespace
}  // namespace state_dict
