// The trainer binary end to end (//trainer:trainer, a data dependency):
// with no flags (2 ranks, FULL_SHARD) the loss falls on the text corpus, a
// resumed run continues the exact loss sequence (on the same and on other
// world sizes), a world started by //tools:launch gives the same losses, and
// bad flags are errors naming them. Small models, so each run takes a few
// seconds on 2 cores. FSDP strategies and features: trainer_fsdp_e2e_test.
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "torch_python.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/testing/run_trainer.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;
using testing::ExpectSameLosses;
using ::testing::HasSubstr;
using testing::ReadLog;
using testing::RunResult;
using testing::RunTrainer;
using testing::StepLog;
using testing::TempDir;

// A small transformer: one run of 12 steps takes ~2 s.
const char kSmall[] =
    "--layers=1 --dim=32 --heads=2 --seq=32 --global-batch=8 --steps=12 "
    "--warmup-steps=2 --seed=11";

TEST(TrainerE2eTest, LossFallsOnTextWithinThirtySteps) {
  const std::string log = TempDir("falls") + "/log.jsonl";
  RunResult r = RunTrainer("--steps=30 --warmup-steps=5 --log-json=" + log);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("done: steps 1-30"));
  EXPECT_THAT(r.output, HasSubstr("2 ranks, FSDP full"));  // the defaults
  StepLog steps = ReadLog(log, 2);
  ASSERT_EQ(steps.losses.size(), 30u);
  EXPECT_EQ(steps.steps.front(), 1);
  EXPECT_EQ(steps.steps.back(), 30);
  double last5 = 0;
  for (size_t i = 25; i < 30; ++i) last5 += steps.losses[i] / 5;
  // From ~ln(256) = 5.5 (uniform) to clearly below: the model has learnt
  // the byte statistics of English text.
  EXPECT_NEAR(steps.losses.front(), std::log(256.0), 0.3);
  EXPECT_LT(last5, steps.losses.front() - 1.0);
}

TEST(TrainerE2eTest, ResumeContinuesTheExactLossSequence) {
  const std::string dir = TempDir("resume");
  RunResult whole = RunTrainer(std::string(kSmall) + " --log-json=" + dir + "/whole.jsonl");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;

  // A run that checkpoints at 6 and 12; dropping step 12 leaves it as if it
  // had been killed after step 6's checkpoint.
  const std::string ckpt = dir + "/ckpt";
  RunResult first =
      RunTrainer(std::string(kSmall) + " --checkpoint-every=6 --checkpoint-dir=" + ckpt +
                 " --log-json=" + dir + "/first.jsonl");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_TRUE(fs::exists(ckpt + "/step_6/MANIFEST"));
  // Sharded by default: one file per rank, nothing gathered.
  EXPECT_TRUE(fs::exists(ckpt + "/step_6/rank_00000.pt"));
  EXPECT_TRUE(fs::exists(ckpt + "/step_6/rank_00001.pt"));
  EXPECT_FALSE(fs::exists(ckpt + "/step_6/model.pt"));
  fs::remove_all(ckpt + "/step_12");

  RunResult resumed = RunTrainer(std::string(kSmall) + " --resume --checkpoint-dir=" + ckpt +
                                 " --log-json=" + dir + "/resumed.jsonl");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("steps 7-12"));

  const StepLog a = ReadLog(dir + "/whole.jsonl", 2);
  const StepLog b = ReadLog(dir + "/resumed.jsonl", 2);
  ASSERT_EQ(a.losses.size(), 12u);
  ASSERT_EQ(b.steps, (std::vector<int64_t>{7, 8, 9, 10, 11, 12}));
  // Same world size, same ops, same state: bit-identical.
  EXPECT_EQ(std::vector<double>(a.losses.begin() + 6, a.losses.end()), b.losses);
  // Checkpointing itself does not perturb the run.
  EXPECT_EQ(ReadLog(dir + "/first.jsonl", 2).losses, a.losses);

  // The sharded checkpoint of 2 ranks resumed on 1 rank (NO_SHARD) and on 4
  // ranks (HYBRID_SHARD, 2x2) continues the same sequence: each rank reads
  // its own ranges, whatever the world size and strategy that saved it.
  struct Target {
    int world;
    const char* sharding;
  };
  for (const Target& t : {Target{1, "none"}, Target{4, "hybrid"}}) {
    fs::remove_all(ckpt + "/step_12");
    const std::string log = dir + "/world" + std::to_string(t.world) + ".jsonl";
    RunResult other = RunTrainer(std::string(kSmall) + " --nproc=" + std::to_string(t.world) +
                                 " --sharding=" + t.sharding +
                                 " --resume --checkpoint-dir=" + ckpt + " --log-json=" + log);
    ASSERT_EQ(other.exit_code, 0) << other.output;
    EXPECT_THAT(other.output, HasSubstr("steps 7-12"));
    ExpectSameLosses(std::vector<double>(a.losses.begin() + 6, a.losses.end()),
                     ReadLog(log, t.world).losses, 1e-4,
                     std::string("resumed on ") + std::to_string(t.world) + " " + t.sharding);
  }

  // --checkpoint-format=full: rank 0 writes one model.pt (Python's
  // torch.load opens it); it resumes on another world size too.
  const std::string full_ckpt = dir + "/full";
  RunResult full =
      RunTrainer(std::string(kSmall) +
                 " --checkpoint-every=6 --checkpoint-format=full --checkpoint-dir=" + full_ckpt);
  ASSERT_EQ(full.exit_code, 0) << full.output;
  EXPECT_TRUE(fs::exists(full_ckpt + "/step_6/model.pt"));
  EXPECT_FALSE(fs::exists(full_ckpt + "/step_6/rank_00000.pt"));
  fs::remove_all(full_ckpt + "/step_12");
  RunResult from_full = RunTrainer(
      std::string(kSmall) + " --nproc=4 --sharding=grad_op --resume --checkpoint-dir=" + full_ckpt +
      " --log-json=" + dir + "/from_full.jsonl");
  ASSERT_EQ(from_full.exit_code, 0) << from_full.output;
  ExpectSameLosses(std::vector<double>(a.losses.begin() + 6, a.losses.end()),
                   ReadLog(dir + "/from_full.jsonl", 4).losses, 1e-4,
                   "FULL checkpoint resumed on 4 ranks grad_op");

  // Python reads both formats with the same numbers: the FULL file as is,
  // the sharded checkpoint of the same (bit-identical) run after
  // `tools/ckpt convert`; model entries by FQN, optimizer entries as
  // "optim.<fqn>.<entry>" (full) and "<fqn>/<entry>" (sharded).
  const std::string converted = dir + "/sharded_as_full.pt";
  const std::string convert = "tools/ckpt convert " + ckpt + "/step_6 --to-full " + converted +
                              " > " + dir + "/convert.txt 2>&1";
  ASSERT_EQ(std::system(convert.c_str()), 0) << convert;
  // torch.load with Python 2.x's default, weights_only=True.
  const std::string torch_python = std::string("'") + kTorchPython + "'";
  ASSERT_EQ(std::system((torch_python + " -c 'import torch' > /dev/null 2>&1").c_str()), 0)
      << kTorchPython << " cannot import torch (run tools/setup.sh --with-python)";
  {
    const std::string script = dir + "/compare.py";
    {
      std::ofstream py(script);
      py << "import sys, torch\n"
            "s = torch.load(sys.argv[1]); f = torch.load(sys.argv[2])\n"
            "assert int(s['trainer.step'][0]) == 6 and int(f['trainer.step'][0]) == 6\n"
            "n = 0\n"
            "for k, v in f.items():\n"
            "    if k.startswith('model.'):\n"
            "        assert torch.equal(s[k[6:]], v), k; n += 1\n"
            "    elif k.startswith('optim.'):\n"
            "        p, e = k[6:].rsplit('.', 1)\n"
            "        assert torch.allclose(s[p + '/' + e].float(), v.float(), rtol=0, atol=0), k\n"
            "        n += 1\n"
            "assert n > 20, n\n";
    }
    const std::string python =
        torch_python + " " + script + " " + converted + " " + full_ckpt + "/step_6/model.pt";
    EXPECT_EQ(std::system(python.c_str()), 0) << python;
  }

  // Training into a directory that holds checkpoints, without --resume, is
  // refused before the first step (checkpoints are never overwritten).
  RunResult again = RunTrainer(std::string(kSmall) + " --checkpoint-dir=" + ckpt);
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_THAT(again.output, HasSubstr("already holds a checkpoint"));
  EXPECT_THAT(again.output, ::testing::Not(HasSubstr("tok/s")));  // no step ran

  // Resuming with another seed would silently train a different run.
  fs::remove_all(ckpt + "/step_12");
  RunResult other_seed =
      RunTrainer(std::string(kSmall) + " --seed=12 --resume --checkpoint-dir=" + ckpt);
  EXPECT_EQ(other_seed.exit_code, 1);
  EXPECT_THAT(other_seed.output, HasSubstr("--seed=12"));
}

std::string FileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// --async-checkpoint writes, from the live state while the next step's
// forward and backward run (its optimizer step waits until written), the
// very files a synchronous save writes (byte for byte, both formats), while
// the run's losses stay those of a run without checkpoints; every
// checkpoint is committed, and resuming from one continues the sequence.
TEST(TrainerE2eTest, AsyncCheckpointsAreTheSynchronousOnes) {
  const std::string dir = TempDir("async");
  RunResult whole = RunTrainer(std::string(kSmall) + " --log-json=" + dir + "/whole.jsonl");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const StepLog a = ReadLog(dir + "/whole.jsonl", 2);
  ASSERT_EQ(a.losses.size(), 12u);
  for (const std::string format : {"sharded", "full"}) {
    const std::string sync_ckpt = dir + "/sync_" + format;
    const std::string async_ckpt = dir + "/async_" + format;
    const std::string common = std::string(kSmall) +
                               " --checkpoint-every=3 --checkpoint-format=" + format +
                               " --checkpoint-dir=";
    RunResult sync = RunTrainer(common + sync_ckpt);
    ASSERT_EQ(sync.exit_code, 0) << sync.output;
    RunResult async = RunTrainer(common + async_ckpt + " --async-checkpoint --log-json=" + dir +
                                 "/async_" + format + ".jsonl");
    ASSERT_EQ(async.exit_code, 0) << async.output;
    EXPECT_EQ(ReadLog(dir + "/async_" + format + ".jsonl", 2).losses, a.losses) << format;
    const std::vector<std::string> files =
        format == std::string("full")
            ? std::vector<std::string>{"model.pt", "MANIFEST"}
            : std::vector<std::string>{"rank_00000.pt", "rank_00001.pt", "MANIFEST"};
    for (int step : {3, 6, 9, 12}) {
      for (const std::string& file : files) {
        const std::string rel = "/step_" + std::to_string(step) + "/" + file;
        ASSERT_TRUE(fs::exists(async_ckpt + rel)) << format << rel;
        EXPECT_TRUE(FileBytes(async_ckpt + rel) == FileBytes(sync_ckpt + rel)) << format << rel;
      }
    }
    fs::remove_all(async_ckpt + "/step_9");
    fs::remove_all(async_ckpt + "/step_12");
    const std::string log = dir + "/resumed_" + format + ".jsonl";
    RunResult resumed = RunTrainer(std::string(kSmall) + " --resume --async-checkpoint " +
                                   "--checkpoint-dir=" + async_ckpt + " --log-json=" + log);
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    EXPECT_THAT(resumed.output, HasSubstr("steps 7-12"));
    EXPECT_EQ(ReadLog(log, 2).losses, std::vector<double>(a.losses.begin() + 6, a.losses.end()))
        << format;
    EXPECT_TRUE(fs::exists(async_ckpt + "/step_12/MANIFEST")) << format;
  }
}

TEST(TrainerE2eTest, LaunchedRanksGiveTheSameLosses) {
  const std::string dir = TempDir("launched");
  RunResult one = RunTrainer(std::string(kSmall) + " --nproc=1 --log-json=" + dir + "/one.jsonl");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const std::vector<double> reference = ReadLog(dir + "/one.jsonl", 1).losses;
  ASSERT_EQ(reference.size(), 12u);
  // Started by //tools:launch (RANK set), the trainer runs as one rank of
  // that world: WORLD_SIZE=4 wins over the default --nproc of 2 (only an
  // explicit, different --nproc is an error). The same losses.
  const std::string command = "tools/launch --nproc 4 -- trainer/trainer " + std::string(kSmall) +
                              " --log-json=" + dir + "/launched.jsonl > " + dir +
                              "/launched.txt 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  ExpectSameLosses(reference, ReadLog(dir + "/launched.jsonl", 4).losses, 1e-4);
}

TEST(TrainerE2eTest, MlpAndSyntheticDataRun) {
  RunResult mlp = RunTrainer("--model=mlp --steps=5 --seq=16");
  EXPECT_EQ(mlp.exit_code, 0) << mlp.output;
  EXPECT_THAT(mlp.output, HasSubstr("trainer: mlp"));
  RunResult synthetic = RunTrainer(std::string(kSmall) + " --data=synthetic --vocab=64 --steps=3");
  EXPECT_EQ(synthetic.exit_code, 0) << synthetic.output;
}

TEST(TrainerE2eTest, BadFlagsExitTwoNamingTheFlag) {
  RunResult bad = RunTrainer("--steps=-3");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.output, HasSubstr("--steps='-3': expected an integer >= 1"));

  // HYBRID_SHARD needs a 2-D mesh; 2 ranks cannot form one (refused before
  // any rank starts).
  RunResult hybrid = RunTrainer("--nproc=2 --sharding=hybrid");
  EXPECT_EQ(hybrid.exit_code, 2);
  EXPECT_THAT(hybrid.output, HasSubstr("--sharding=hybrid with 2 ranks: expected a world size "
                                       "that forms a 2-D mesh"));

  // A rank's failure ends the run with its message, not a backtrace from
  // the other ranks' next collective. The directory passes the start-up
  // check (trainer_checkpoint_dir_test), but a file sits where step_1's
  // directory goes. Sharded: every rank's write fails; full: rank 0's, and
  // rank 1 says so.
  for (const char* format : {"sharded", "full"}) {
    const std::string ckpt = TempDir(std::string("blocked_") + format);
    std::ofstream(ckpt + "/step_1") << "not a directory";
    RunResult save = RunTrainer(std::string(kSmall) + " --checkpoint-format=" + format +
                                " --nproc=2 --steps=1 --checkpoint-dir=" + ckpt);
    EXPECT_EQ(save.exit_code, 1) << format;
    EXPECT_THAT(save.output, HasSubstr("--checkpoint-dir='" + ckpt + "' step 1")) << save.output;
    if (std::string(format) == "full") {
      EXPECT_THAT(save.output, HasSubstr("failed on rank 0"));
    }
    EXPECT_THAT(save.output, ::testing::Not(HasSubstr("frame #")));
  }

  RunResult batch = RunTrainer("--nproc=3 --global-batch=16");
  EXPECT_EQ(batch.exit_code, 2);
  EXPECT_THAT(batch.output,
              HasSubstr("--global-batch=16: expected a multiple of the world size 3"));
}

}  // namespace
}  // namespace trainer
