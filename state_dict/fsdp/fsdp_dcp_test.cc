// FSDP state through torch.distributed.checkpoint (fsdp_dcp.h), both ways,
// against Python itself:
//
// - Python FSDP (SHARDED_STATE_DICT) and FSDP2 (fully_shard) train 2 Adam
//   steps on 2 ranks and dcp.save; our FSDP loads that on 1 and 3 ranks
//   (FULL_SHARD, SHARD_GRAD_OP; flat parameters and original ones) and
//   takes a third step on the same batch as Python's third step: the
//   parameters agree (the update depends on Adam's moments and step count,
//   so the optimizer state arrived too).
// - our FSDP on 3 ranks trains 2 steps and saves (with values beside the
//   state: an int, a float, a str); Python FSDP and FSDP2 on 2 ranks
//   dcp.load model, optimizer and those values and take the third step:
//   again the same parameters as ours.
#include "state_dict/fsdp/fsdp_dcp.h"

#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "comm/collectives.h"
#include "formats/testing/python_interop.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "module_call/wrap_policy.h"
#include "state_dict/dcp.h"
#include "state_dict/fsdp/fsdp_state_dict.h"
#include "state_dict/tensor_dict.h"
#include "testing/multiprocess.h"

namespace state_dict {
namespace {

using formats::testing::PythonTorchAvailable;
using formats::testing::RunPython;
using fsdp::FullyShardedDataParallel;

// Python's side. argv: kind (fsdp1|fsdp2), mode (save|load), dir.
// save: 2 steps, dcp.save to dir/ckpt, then the third step; full params
//       after it to dir/py_after.pt, the batches to dir/batches.pt.
// load: dcp.load dir/ckpt (ours) into a fresh model + optimizer, the third
//       step on batches.pt's x3, full params to dir/py_after_ours.pt.
constexpr char kPython[] = R"PY(
import os, sys, torch, torch.nn as nn, torch.distributed as dist
import torch.multiprocessing as mp
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict, StateDictOptions

def step(m, opt, x):
    m(x).pow(2).sum().backward(); opt.step(); opt.zero_grad()

def run(rank, kind, mode, d):
    dist.init_process_group("gloo", init_method="file://%s/store_%s_%s" % (d, kind, mode),
                            rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
        m = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
        FSDP.set_state_dict_type(m, StateDictType.SHARDED_STATE_DICT)
    else:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model[0]); fully_shard(model)
        m = model
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    if mode == "save":
        torch.manual_seed(7)
        batches = [torch.randn(4, 5) for _ in range(3)]
        if rank == 0:
            torch.save({"x1": batches[0], "x2": batches[1], "x3": batches[2]}, d + "/batches.pt")
        step(m, opt, batches[0]); step(m, opt, batches[1])
        if kind == "fsdp1":
            sd = {"model": m.state_dict(), "optim": FSDP.optim_state_dict(m, opt)}
        else:
            msd, osd = get_state_dict(m, opt)
            sd = {"model": msd, "optim": osd}
        dcp.save(sd, checkpoint_id=d + "/ckpt")
        x3 = batches[2]
        out = d + "/py_after.pt"
    else:
        if kind == "fsdp1":
            # FSDP1 creates its optimizer state lazily: one zero-lr step
            # first, as Python's own FSDP resume recipes do.
            for g in opt.param_groups: g["lr"] = 0.0
            step(m, opt, torch.zeros(1, 5))
            sd = {"model": m.state_dict(), "optim": FSDP.optim_state_dict(m, opt)}
            dcp.load(sd, checkpoint_id=d + "/ckpt")
            m.load_state_dict(sd["model"])
            opt.load_state_dict(FSDP.optim_state_dict_to_load(m, opt, sd["optim"]))
        else:
            msd, osd = get_state_dict(m, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=d + "/ckpt")
            set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        # The values saved beside the state (SaveFsdpDcpShard's extra objects).
        extra = {"trainer": {"step": 0, "loss": 0.0, "tag": ""}}
        dcp.load(extra, checkpoint_id=d + "/ckpt")
        assert extra == {"trainer": {"step": 2, "loss": 0.25, "tag": "ours"}}, extra
        assert opt.param_groups[0]["lr"] == 0.01, opt.param_groups[0]["lr"]
        x3 = torch.load(d + "/batches.pt")["x3"]
        out = d + "/py_after_ours.pt"
    step(m, opt, x3)
    msd, _ = get_state_dict(m, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in msd.items()}, out)
    # Every rank's collectives done before any tears its group down.
    dist.barrier()
    dist.destroy_process_group()
    # Without finalizing: PyTorch issue 190489 (see state_dict/dcp_test.cc).
    sys.stdout.flush(); sys.stderr.flush(); os._exit(0)

if __name__ == "__main__":
    kind, mode, d = sys.argv[1], sys.argv[2], sys.argv[3]
    mp.spawn(run, args=(kind, mode, d), nprocs=2)
)PY";

torch::nn::Sequential MakeModel() {
  torch::manual_seed(123);  // overwritten by the load
  return torch::nn::Sequential(torch::nn::Linear(5, 7), torch::nn::ReLU(), torch::nn::Linear(7, 3));
}

FullyShardedDataParallel::Options Opts(const comm::ProcessGroup& pg, bool flat, bool grad_op) {
  FullyShardedDataParallel::Options o;
  o.process_group = pg;
  o.auto_wrap_policy = module_call::module_type_auto_wrap_policy<torch::nn::LinearImpl>();
  o.use_orig_params = !flat;
  if (grad_op) o.sharding_strategy = fsdp::ShardingStrategy::kShardGradOp;
  return o;
}

// Every rank runs the same batch: FSDP's averaged gradient is that batch's.
void Step(FullyShardedDataParallel& m, torch::optim::Optimizer& opt, const torch::Tensor& x) {
  m.forward(x).pow(2).sum().backward();
  opt.step();
  opt.zero_grad();
}

TensorDict Full(FullyShardedDataParallel& model) {
  auto sd = GetModelStateDict(model, StateDictType::kFull);
  EXPECT_TRUE(sd.ok()) << sd.status();
  return sd.ok() ? sd->full : TensorDict();
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

std::string Dir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return std::string(tmp == nullptr ? "/tmp" : tmp) + "/fsdp_dcp";
}

// Python's checkpoint of `kind`, made once per test binary run (the test
// process only: ranks re-run the TEST body and find it).
void EnsurePythonCheckpoint(const std::string& kind, const std::string& dir) {
  if (comm::testing::IsRankProcess() || std::filesystem::exists(dir + "/py_after.pt")) return;
  ASSERT_TRUE(PythonTorchAvailable()) << "run tools/setup.sh --with-python";
  std::filesystem::create_directories(dir);
  std::string output;
  ASSERT_EQ(RunPython(kPython, kind + " save " + dir, &output), 0) << output;
}

struct Case {
  const char* kind;
  int world;
  bool flat;
};

class PythonCheckpoint : public ::testing::TestWithParam<Case> {};

// Python saves on 2 ranks; we load on 1 or 3 (FULL_SHARD with original
// parameters, SHARD_GRAD_OP with flat ones) and continue.
TEST_P(PythonCheckpoint, ContinuesHere) {
  const Case c = GetParam();
  const std::string dir = Dir() + "/from_" + c.kind;
  EnsurePythonCheckpoint(c.kind, dir);
  if (HasFatalFailure()) return;
  comm::testing::RunOnRanks(c.world, [&](comm::ProcessGroup& pg) {
    auto batches = LoadTensorDict(dir + "/batches.pt");
    ASSERT_TRUE(batches.ok()) << batches.status();
    FullyShardedDataParallel model(MakeModel(), Opts(pg, c.flat, /*grad_op=*/c.flat));
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(0.01));
    auto loaded = LoadFsdpDcp(dir + "/ckpt", model, &opt);
    ASSERT_TRUE(loaded.ok()) << loaded;
    Step(model, opt, batches->tensors["x3"]);
    auto python = LoadTensorDict(dir + "/py_after.pt");
    ASSERT_TRUE(python.ok()) << python.status();
    ExpectClose(Full(model), python->tensors,
                std::string(c.kind) + " on " + std::to_string(c.world) + " ranks");
  });
}

INSTANTIATE_TEST_SUITE_P(Fsdp, PythonCheckpoint,
                         ::testing::Values(Case{"fsdp1", 1, false}, Case{"fsdp1", 3, true},
                                           Case{"fsdp2", 3, false}, Case{"fsdp2", 1, true}));

class OurCheckpoint : public ::testing::TestWithParam<const char*> {};

// We save on 3 ranks (flat parameters cut mid-row); Python FSDP or FSDP2 on
// 2 ranks loads model and optimizer and continues.
TEST_P(OurCheckpoint, ContinuesInPython) {
  const std::string dir = Dir() + "/to_" + GetParam();
  if (!comm::testing::IsRankProcess()) {
    ASSERT_TRUE(PythonTorchAvailable()) << "run tools/setup.sh --with-python";
    std::filesystem::create_directories(dir);
    torch::manual_seed(9);
    TensorDict batches;
    for (const char* name : {"x1", "x2", "x3"}) batches.insert(name, torch::randn({4, 5}));
    ASSERT_TRUE(SaveTensorDict(batches, dir + "/batches.pt").ok());
  }
  const int failed = comm::testing::RunOnRanks(3, [&](comm::ProcessGroup& pg) {
    auto batches = LoadTensorDict(dir + "/batches.pt");
    ASSERT_TRUE(batches.ok()) << batches.status();
    torch::manual_seed(0);
    FullyShardedDataParallel model(MakeModel(), Opts(pg, /*flat=*/true, false));
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(0.01));
    Step(model, opt, batches->tensors["x1"]);
    Step(model, opt, batches->tensors["x2"]);
    // Values beside the state, as dcp.save saves a dict's non-tensor leaves;
    // paths inside the state's own are refused.
    for (const DcpKeyPath& taken : {DcpKeyPath{"model", "x"}, DcpKeyPath{"optim"}, DcpKeyPath{}}) {
      absl::Status refused = SaveFsdpDcpShard(dir + "/refused", model, &opt, {{taken, 1}});
      EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    }
    auto saved = SaveFsdpDcpShard(dir + "/ckpt", model, &opt,
                                  {{{"trainer", "step"}, int64_t{2}},
                                   {{"trainer", "loss"}, 0.25},
                                   {{"trainer", "tag"}, std::string("ours")}});
    ASSERT_TRUE(saved.ok()) << saved;
    comm::barrier(pg).wait();
    if (pg.rank() == 0) {
      auto committed = CommitDcpCheckpoint(dir + "/ckpt", pg.size());
      ASSERT_TRUE(committed.ok()) << committed;
      auto checkpoint = DcpCheckpoint::Open(dir + "/ckpt");
      ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
      auto step = checkpoint->LoadObject("trainer.step");
      auto loss = checkpoint->LoadObject("trainer.loss");
      auto tag = checkpoint->LoadObject("trainer.tag");
      ASSERT_TRUE(step.ok() && loss.ok() && tag.ok());
      EXPECT_EQ(step->toInt(), 2);
      EXPECT_EQ(loss->toDouble(), 0.25);
      EXPECT_EQ(tag->toStringRef(), "ours");
    }
    Step(model, opt, batches->tensors["x3"]);
    TensorDict after = Full(model);
    if (pg.rank() == 0) {
      ASSERT_TRUE(SaveTensorDict(after, dir + "/ours_after.pt").ok());
    }
  });
  if (comm::testing::IsRankProcess()) return;
  ASSERT_EQ(failed, 0);
  std::string output;
  ASSERT_EQ(RunPython(kPython, std::string(GetParam()) + " load " + dir, &output), 0) << output;
  auto ours = LoadTensorDict(dir + "/ours_after.pt");
  auto python = LoadTensorDict(dir + "/py_after_ours.pt");
  ASSERT_TRUE(ours.ok() && python.ok());
  ExpectClose(ours->tensors, python->tensors, std::string("Python ") + GetParam());
}

INSTANTIATE_TEST_SUITE_P(Fsdp, OurCheckpoint, ::testing::Values("fsdp1", "fsdp2"));

}  // namespace
}  // namespace state_dict
