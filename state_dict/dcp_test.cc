// torch.distributed.checkpoint (dcp.h) against Python's own: checkpoints
// that Python FSDP (SHARDED_STATE_DICT) and FSDP2 (fully_shard) saved on 2
// ranks read back bitwise on 1 and 3 ranks' ranges; our 3-rank saves (flat
// ranges cutting rows, 0-dim, bf16, pickled options) read by Python's
// dcp.load and dcp_to_torch_save; hostile metadata refused with errors
// naming what was wrong.
#include "state_dict/dcp.h"

#include <sys/stat.h>

#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "formats/testing/python_interop.h"
#include "state_dict/sharded_tensor.h"
#include "state_dict/tensor_dict.h"

namespace state_dict {
namespace {

using formats::testing::PythonTorchAvailable;
using formats::testing::RunPython;
using formats::testing::TempDir;

void RequirePython() {
  ASSERT_TRUE(PythonTorchAvailable()) << "the Python of the build's torch wheel cannot import "
                                         "torch (run tools/setup.sh --with-python)";
}

// Python FSDP (kind "fsdp1": FullyShardedDataParallel with
// SHARDED_STATE_DICT; "fsdp2": fully_shard with get_state_dict) trains a
// small model 2 steps with Adam on 2 ranks and saves
// dcp.save({"model": ..., "optim": ...}) to argv[2]; then Python's own DCP
// reader (dcp_to_torch_save) writes every tensor, flattened to DCP's keys,
// to argv[3]: the reference. (Not FSDP1's full optimizer state dict: in
// torch 2.15, taken after a sharded one, it gives exp_avg_sq's values for
// exp_avg, through get_state_dict and FSDP.optim_state_dict alike.)
constexpr char kPythonSave[] = R"PY(
import os, sys, torch, torch.nn as nn, torch.distributed as dist
import torch.multiprocessing as mp
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

def run(rank, kind, out, store):
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
        m = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    else:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model[0]); fully_shard(model)
        m = model
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    torch.manual_seed(1 + rank)
    for _ in range(2):
        m(torch.randn(4, 5)).pow(2).sum().backward(); opt.step(); opt.zero_grad()
    if kind == "fsdp1":
        FSDP.set_state_dict_type(m, StateDictType.SHARDED_STATE_DICT)
        sd = {"model": m.state_dict(), "optim": FSDP.optim_state_dict(m, opt)}
    else:
        msd, osd = get_state_dict(m, opt)
        sd = {"model": msd, "optim": osd}
    dcp.save(sd, checkpoint_id=out)
    dist.destroy_process_group()
    # torch 2.15 + Gloo: a worker thread can drop its last reference to a
    # finished collective during interpreter finalization and abort the
    # process ("terminate called without an active exception"; PyTorch
    # issue 190489, see benchmarks/python/ddp_step.py). Everything is
    # written: end without finalizing.
    sys.stdout.flush(); sys.stderr.flush(); os._exit(0)

if __name__ == "__main__":
    kind, out, ref = sys.argv[1], sys.argv[2], sys.argv[3]
    mp.spawn(run, args=(kind, out, out + ".store"), nprocs=2)
    dcp_to_torch_save(out, ref + ".nested")
    nested = torch.load(ref + ".nested")
    flat = {"model." + k: v for k, v in nested["model"].items()}
    for fqn, entries in nested["optim"]["state"].items():
        for name, v in entries.items():
            flat["optim.state.%s.%s" % (fqn, name)] = v
    torch.save(flat, ref)
)PY";

class PythonSavedDcp : public ::testing::TestWithParam<const char*> {};

// Every tensor read as world sizes 1 and 3 would (FSDP's even flat split)
// equals what Python's DCP reader gives, bitwise; the param groups' options
// read back.
TEST_P(PythonSavedDcp, LoadsOnOtherWorldSizesBitwise) {
  RequirePython();
  const std::string dir = TempDir(std::string("py_") + GetParam());
  std::string output;
  ASSERT_EQ(RunPython(kPythonSave, std::string(GetParam()) + " " + dir + "/ckpt " + dir + "/ref.pt",
                      &output),
            0)
      << output;
  auto ref = LoadTensorDict(dir + "/ref.pt");
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto ckpt = DcpCheckpoint::Open(dir + "/ckpt");
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ASSERT_EQ(ckpt->tensors().size(), ref->tensors.size());
  for (const auto& info : ckpt->tensors()) {
    const torch::Tensor* want = ref->tensors.find(info.key);
    ASSERT_NE(want, nullptr) << info.key;
    for (int world : {1, 3}) {
      std::vector<ShardedTensor> shards;
      for (int rank = 0; rank < world; ++rank) {
        ShardRequest request;
        request.global_shape = info.shape;
        request.dtype = info.dtype;
        const FlatRange range = EvenShardRange(want->numel(), world, rank);
        if (range.numel > 0) request.ranges.push_back(range);
        auto loaded = ckpt->LoadResharded({{info.key, request}});
        ASSERT_TRUE(loaded.ok()) << loaded.status();
        shards.push_back(loaded->begin()->value());
      }
      auto full = AssembleFullTensor(info.key, shards);
      ASSERT_TRUE(full.ok()) << full.status();
      EXPECT_TRUE(torch::equal(*full, *want)) << info.key << " on " << world << " ranks";
    }
  }
  auto lr = ckpt->LoadObject("optim.param_groups.0.lr");
  ASSERT_TRUE(lr.ok()) << lr.status();
  EXPECT_DOUBLE_EQ(lr->toDouble(), 0.01);
  auto betas = ckpt->LoadObject("optim.param_groups.0.betas");
  ASSERT_TRUE(betas.ok()) << betas.status();
  ASSERT_TRUE(betas->isTuple());
  EXPECT_DOUBLE_EQ(betas->toTupleRef().elements()[1].toDouble(), 0.999);
  auto params = ckpt->LoadObject("optim.param_groups.0.params");
  ASSERT_TRUE(params.ok()) << params.status();
  ASSERT_TRUE(params->isList());
  EXPECT_EQ(params->toListRef()[0].toStringRef(), "0.weight");
}

INSTANTIATE_TEST_SUITE_P(Fsdp, PythonSavedDcp, ::testing::Values("fsdp1", "fsdp2"));

// Three ranks' flat pieces, cut mid-row as FSDP cuts flat parameters.
std::vector<DcpShard> ThreeRankShards(TensorDict& full) {
  torch::manual_seed(5);
  full.insert("model.w", torch::randn({5, 7}));
  full.insert("model.v", torch::randn({2, 3, 4}).to(torch::kBFloat16));
  full.insert("model.b", torch::arange(10, torch::kLong));
  full.insert("optim.state.w.step", torch::tensor(3.0f));
  std::vector<DcpShard> shards(3);
  for (const auto& item : full) {
    const torch::Tensor& t = item.value();
    DcpKeyPath path;
    const std::string& key = item.key();
    if (key.rfind("model.", 0) == 0)
      path = {"model", key.substr(6)};
    else
      path = {"optim", "state", "w", "step"};
    for (int rank = 0; rank < 3; ++rank) {
      ShardedTensor s;
      s.global_shape = t.sizes().vec();
      s.dtype = t.scalar_type();
      // The 0-dim step is replicated: every rank holds it, as FSDP's ranks do.
      const FlatRange range = t.dim() == 0 ? FlatRange{0, 1} : EvenShardRange(t.numel(), 3, rank);
      if (range.numel > 0) {
        s.pieces.push_back(
            ShardPiece{range, t.reshape({-1}).narrow(0, range.offset, range.numel).clone()});
      }
      shards[static_cast<size_t>(rank)].tensors.push_back(DcpShard::Tensor{path, s});
    }
  }
  shards[0].objects.push_back(DcpShard::Object{{"optim", "param_groups", int64_t{0}, "lr"}, 0.5});
  shards[0].objects.push_back(
      DcpShard::Object{{"optim", "param_groups", int64_t{0}, "betas"},
                       c10::ivalue::Tuple::create({c10::IValue(0.8), c10::IValue(0.9)})});
  return shards;
}

TEST(Dcp, OurSavesReloadOnOtherRanges) {
  const std::string dir = TempDir("roundtrip") + "/ckpt";
  TensorDict full;
  std::vector<DcpShard> shards = ThreeRankShards(full);
  for (int rank = 0; rank < 3; ++rank) {
    ASSERT_TRUE(SaveDcpShard(dir, rank, shards[static_cast<size_t>(rank)]).ok());
  }
  ASSERT_TRUE(CommitDcpCheckpoint(dir, 3).ok());
  auto ckpt = DcpCheckpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  for (const auto& item : full) {
    for (int world : {1, 2, 4}) {
      std::vector<ShardedTensor> pieces;
      for (int rank = 0; rank < world; ++rank) {
        ShardRequest r{item.value().sizes().vec(), item.value().scalar_type(), {}};
        const FlatRange range = EvenShardRange(item.value().numel(), world, rank);
        if (range.numel > 0) r.ranges.push_back(range);
        auto loaded = ckpt->LoadResharded({{item.key(), r}});
        ASSERT_TRUE(loaded.ok()) << loaded.status();
        pieces.push_back(loaded->begin()->value());
      }
      auto assembled = AssembleFullTensor(item.key(), pieces);
      ASSERT_TRUE(assembled.ok()) << assembled.status();
      EXPECT_TRUE(torch::equal(*assembled, item.value())) << item.key() << " world " << world;
    }
  }
  auto lr = ckpt->LoadObject("optim.param_groups.0.lr");
  ASSERT_TRUE(lr.ok()) << lr.status();
  EXPECT_DOUBLE_EQ(lr->toDouble(), 0.5);
  // A request of another shape or dtype names both.
  ShardRequest wrong{{7, 5}, torch::kFloat, {{0, 35}}};
  auto refused = ckpt->LoadResharded({{"model.w", wrong}});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("expected Float[7, 5]"), std::string::npos)
      << refused.status();
}

// Python reads our checkpoint: dcp_to_torch_save (no process group) gives
// the nested dict, and dcp.load fills preallocated tensors; both equal our
// full tensors bitwise.
TEST(Dcp, PythonReadsOurSaves) {
  RequirePython();
  const std::string dir = TempDir("to_python");
  TensorDict full;
  std::vector<DcpShard> shards = ThreeRankShards(full);
  for (int rank = 0; rank < 3; ++rank) {
    ASSERT_TRUE(SaveDcpShard(dir + "/ckpt", rank, shards[static_cast<size_t>(rank)]).ok());
  }
  ASSERT_TRUE(CommitDcpCheckpoint(dir + "/ckpt", 3).ok());
  ASSERT_TRUE(SaveTensorDict(full, dir + "/ref.pt").ok());
  const char* script = R"PY(
import sys, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
d = sys.argv[1]
ref = torch.load(d + "/ref.pt")
dcp_to_torch_save(d + "/ckpt", d + "/full.pt")
nested = torch.load(d + "/full.pt")
assert torch.equal(nested["model"]["w"], ref["model.w"])
assert torch.equal(nested["model"]["v"], ref["model.v"]) and nested["model"]["v"].dtype == torch.bfloat16
assert torch.equal(nested["model"]["b"], ref["model.b"])
assert torch.equal(nested["optim"]["state"]["w"]["step"], ref["optim.state.w.step"])
assert nested["optim"]["param_groups"][0]["lr"] == 0.5, nested["optim"]["param_groups"]
assert tuple(nested["optim"]["param_groups"][0]["betas"]) == (0.8, 0.9)
sd = {"model": {"w": torch.zeros(5, 7), "v": torch.zeros(2, 3, 4, dtype=torch.bfloat16),
                "b": torch.zeros(10, dtype=torch.long)}}
dcp.load(sd, checkpoint_id=d + "/ckpt", no_dist=True)
assert torch.equal(sd["model"]["w"], ref["model.w"])
assert torch.equal(sd["model"]["v"], ref["model.v"])
print("OK")
)PY";
  std::string output;
  ASSERT_EQ(RunPython(script, dir, &output), 0) << output;
  EXPECT_NE(output.find("OK"), std::string::npos) << output;
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// Metadata crafted as an attacker or a damaged disk would: each refused
// with an error saying what, and nothing run.
TEST(Dcp, HostileMetadataIsRefused) {
  RequirePython();
  const std::string dir = TempDir("hostile");
  TensorDict full;
  std::vector<DcpShard> shards = ThreeRankShards(full);
  for (int rank = 0; rank < 3; ++rank) {
    ASSERT_TRUE(SaveDcpShard(dir + "/good", rank, shards[static_cast<size_t>(rank)]).ok());
  }
  ASSERT_TRUE(CommitDcpCheckpoint(dir + "/good", 3).ok());
  // Python edits a copy of the good metadata in one way each.
  const char* script = R"PY(
import sys, os, pickle, shutil, torch
d = sys.argv[1]
def variant(name, edit):
    shutil.copytree(d + "/good", d + "/" + name)
    md = pickle.load(open(d + "/good/.metadata", "rb"))
    edit(md)
    pickle.dump(md, open(d + "/" + name + "/.metadata", "wb"))
def escape(md):
    for k, v in md.storage_data.items():
        v.relative_path = "../../etc/passwd"
def outside(md):
    md.state_dict_metadata["model.w"].chunks[0].sizes = torch.Size([9, 7])
def past_end(md):
    for k, v in md.storage_data.items():
        if k.fqn == "model.w":
            v.offset = 1 << 40
            break
def missing(md):
    del md.storage_data[next(iter(md.storage_data))]
def overlap(md):
    chunks = md.state_dict_metadata["model.w"].chunks
    chunks[0].sizes = torch.Size([2, 7])  # [0, 0] now reaches into row 1
def shared(md):
    first = next(iter(md.storage_data.values()))
    for v in md.storage_data.values():
        if v.relative_path == first.relative_path:
            v.offset, v.length = first.offset, first.length
variant("escape", escape)
variant("overlap", overlap)
variant("shared", shared)
variant("outside", outside)
variant("past_end", past_end)
variant("missing", missing)
print("OK")
)PY";
  std::string output;
  ASSERT_EQ(RunPython(script, dir, &output), 0) << output;
  struct Case {
    const char* name;
    const char* message;
  };
  for (const Case& c :
       {Case{"escape", "not a file of the checkpoint directory"},
        Case{"outside", "lies outside 'model.w'"}, Case{"missing", "has no storage record"},
        Case{"overlap", "of 'model.w' overlap"}, Case{"shared", "share bytes"}}) {
    auto opened = DcpCheckpoint::Open(dir + "/" + c.name);
    ASSERT_FALSE(opened.ok()) << c.name;
    EXPECT_NE(opened.status().message().find(c.message), std::string::npos)
        << c.name << ": " << opened.status();
  }
  // Offsets past the file's end: the metadata parses; the read says where.
  auto past_end = DcpCheckpoint::Open(dir + "/past_end");
  ASSERT_TRUE(past_end.ok()) << past_end.status();
  ShardRequest r{{5, 7}, torch::kFloat, {{0, 35}}};
  auto read = past_end->LoadResharded({{"model.w", r}});
  ASSERT_FALSE(read.ok());
  EXPECT_NE(read.status().message().find("beyond the end"), std::string::npos) << read.status();

  // A pickle that would run os.system in Python's unpickler.
  ::mkdir((dir + "/rce").c_str(), 0755);
  const std::string command = "touch " + dir + "/owned";
  std::string rce_pickle =
      "\x80\x02"
      "cos\nsystem\nX";
  for (int k = 0; k < 4; ++k) rce_pickle += static_cast<char>((command.size() >> (8 * k)) & 0xff);
  rce_pickle += command + "\x85R.";
  WriteBytes(dir + "/rce/.metadata", rce_pickle);
  auto rce = DcpCheckpoint::Open(dir + "/rce");
  ASSERT_FALSE(rce.ok());
  EXPECT_NE(rce.status().message().find("unsupported global os.system"), std::string::npos)
      << rce.status();
  EXPECT_FALSE(std::ifstream(dir + "/owned").good());
  // No .metadata: an interrupted save.
  auto none = DcpCheckpoint::Open(dir);
  EXPECT_TRUE(absl::IsNotFound(none.status())) << none.status();
}

TEST(Dcp, CommitChecksEveryRank) {
  const std::string dir = TempDir("commit") + "/ckpt";
  TensorDict full;
  std::vector<DcpShard> shards = ThreeRankShards(full);
  ASSERT_TRUE(SaveDcpShard(dir, 0, shards[0]).ok());
  ASSERT_TRUE(SaveDcpShard(dir, 1, shards[1]).ok());
  auto early = CommitDcpCheckpoint(dir, 3);
  ASSERT_FALSE(early.ok());
  EXPECT_NE(early.message().find("rank 2 has not saved its shard"), std::string::npos) << early;
  EXPECT_TRUE(absl::IsNotFound(DcpCheckpoint::Open(dir).status()));
  // Rank 2 with a piece missing: coverage is checked.
  shards[2].tensors[0].tensor.pieces.clear();
  ASSERT_TRUE(SaveDcpShard(dir, 2, shards[2]).ok());
  auto gap = CommitDcpCheckpoint(dir, 3);
  ASSERT_FALSE(gap.ok());
  EXPECT_NE(gap.message().find("cover 24 of its 35 elements"), std::string::npos) << gap;
}

}  // namespace
}  // namespace state_dict
