// The trainer under --fsdp=fully_shard, end to end (//trainer:trainer as a
// child process), against --fsdp=fsdp1 and the unwrapped model (1 rank):
//   * the same loss sequence (1e-4 relative, as trainer_fsdp_e2e_test) on 2
//     and 3 ranks, with --sharding=grad_op, hybrid (2x2 on 4 ranks), --auto-wrap=none,
//     --activation-checkpointing=block, --grad-accum=2, --cpu-offload
//     (CPUOffloadPolicy) and --clip;
//     --mixed-precision=bf16 within 3% of float32;
//   * resume: a run checkpointed at step 4 (sharded and full, sync and
//     --async-checkpoint) continues steps 5-8 with the uninterrupted run's
//     losses, under fully_shard, and across --fsdp both ways and world sizes;
//     --export-dcp / --import-dcp likewise;
//   * refused combinations name both flags.
#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/testing/run_trainer.h"

namespace trainer {
namespace {

using testing::ExpectSameLosses;
using ::testing::HasSubstr;
using testing::ReadLog;
using testing::RunResult;
using testing::RunTrainer;
using testing::StepLog;
using testing::TempDir;

// Two blocks, 8 steps (as trainer_fsdp_e2e_test).
const char kTiny[] =
    "--layers=2 --dim=32 --heads=2 --seq=16 --global-batch=12 --steps=8 "
    "--warmup-steps=2 --seed=5";

StepLog Train(const std::string& name, int nproc, const std::string& flags, size_t steps = 8) {
  const std::string log = TempDir("fully_shard_" + name) + "/log.jsonl";
  RunResult r = RunTrainer(std::string(kTiny) + " --nproc=" + std::to_string(nproc) + " " + flags +
                           " --log-json=" + log);
  EXPECT_EQ(r.exit_code, 0) << name << ": " << r.output;
  StepLog out = ReadLog(log, nproc);
  EXPECT_EQ(out.losses.size(), steps) << name;
  return out;
}

TEST(TrainerFullyShardE2eTest, SameLossesAsFsdp1AndTheUnwrappedModel) {
  const StepLog one = Train("one", 1, "--fsdp=fsdp1 --sharding=none");
  ASSERT_EQ(one.losses.size(), 8u);
  EXPECT_LT(one.losses.back(), one.losses.front());
  ExpectSameLosses(one.losses, Train("fsdp1_2", 2, "--fsdp=fsdp1").losses, 1e-4, "fsdp1 on 2");
  ExpectSameLosses(one.losses, Train("fs2", 2, "--fsdp=fully_shard").losses, 1e-4,
                   "fully_shard on 2");
  ExpectSameLosses(one.losses, Train("fs3", 3, "--fsdp=fully_shard").losses, 1e-4,
                   "fully_shard on 3");
  ExpectSameLosses(one.losses, Train("fs1", 1, "--fsdp=fully_shard").losses, 1e-4,
                   "fully_shard on 1");
  ExpectSameLosses(one.losses,
                   Train("fs_grad_op", 2, "--fsdp=fully_shard --sharding=grad_op").losses, 1e-4,
                   "fully_shard grad_op");
  ExpectSameLosses(one.losses, Train("fs_hybrid", 4, "--fsdp=fully_shard --sharding=hybrid").losses,
                   1e-4, "fully_shard hybrid 2x2");
  ExpectSameLosses(
      one.losses,
      Train("fs_root", 2, "--fsdp=fully_shard --auto-wrap=none --backward-prefetch=none").losses,
      1e-4, "fully_shard root only");
  ExpectSameLosses(one.losses,
                   Train("fs_ac", 2, "--fsdp=fully_shard --activation-checkpointing=block").losses,
                   1e-4, "fully_shard + activation checkpointing");
  ExpectSameLosses(one.losses, Train("fs_accum", 2, "--fsdp=fully_shard --grad-accum=2").losses,
                   1e-4, "fully_shard grad-accum 2");
  ExpectSameLosses(one.losses, Train("fs_offload", 2, "--fsdp=fully_shard --cpu-offload").losses,
                   1e-4, "fully_shard cpu offload");
  const std::string clip = "--clip=0.05 --optimizer=sgd --lr=0.05 --lr-schedule=constant";
  ExpectSameLosses(Train("clip1", 1, clip + " --sharding=none").losses,
                   Train("fs_clip", 2, clip + " --fsdp=fully_shard").losses, 1e-4,
                   "fully_shard clip");
  const StepLog bf16 = Train("fs_bf16", 2, "--fsdp=fully_shard --mixed-precision=bf16");
  ExpectSameLosses(one.losses, bf16.losses, 0.03, "fully_shard bf16 vs float32");
}

// Steps 1-4 with a checkpoint (or export) at 4 under `save`, then 5-8 from
// it under `load`: the losses of 5-8 must be the uninterrupted run's.
void ExpectResumes(const std::vector<double>& whole, const std::string& name, int save_nproc,
                   const std::string& save, int load_nproc, const std::string& load,
                   const std::string& save_to, const std::string& load_from) {
  const std::string dir = TempDir("fully_shard_resume_" + name);
  RunResult first =
      RunTrainer(std::string(kTiny) + " --steps=4 --nproc=" + std::to_string(save_nproc) + " " +
                 save + " " + save_to + dir);
  ASSERT_EQ(first.exit_code, 0) << name << ": " << first.output;
  const std::string log = dir + "/resumed.jsonl";
  RunResult resumed = RunTrainer(std::string(kTiny) + " --nproc=" + std::to_string(load_nproc) +
                                 " " + load + " " + load_from + dir + " --log-json=" + log);
  ASSERT_EQ(resumed.exit_code, 0) << name << ": " << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("steps 5-8")) << name;
  const StepLog b = ReadLog(log, load_nproc);
  ASSERT_EQ(b.steps, (std::vector<int64_t>{5, 6, 7, 8})) << name;
  ExpectSameLosses(std::vector<double>(whole.begin() + 4, whole.end()), b.losses, 1e-4, name);
}

TEST(TrainerFullyShardE2eTest, CheckpointsResumeUnderEitherFsdp) {
  // A constant rate (after warm-up), so that the first half's run of 4
  // steps is the first half of the 8-step run.
  const std::string constant = " --lr-schedule=constant";
  const StepLog whole = Train("whole", 2, "--fsdp=fully_shard" + constant);
  ASSERT_EQ(whole.losses.size(), 8u);
  const std::string fs = "--fsdp=fully_shard" + constant, f1 = "--fsdp=fsdp1" + constant;
  const std::string ckpt = "--checkpoint-every=4 --checkpoint-dir=";
  const std::string resume = "--resume --checkpoint-dir=";
  for (const char* format : {"sharded", "full"}) {
    const std::string fmt = std::string(" --checkpoint-format=") + format;
    ExpectResumes(whole.losses, std::string(format) + "_fs", 2, fs + fmt, 2, fs + fmt, ckpt,
                  resume);
    ExpectResumes(whole.losses, std::string(format) + "_fs_async", 2,
                  fs + fmt + " --async-checkpoint", 3, fs + fmt, ckpt, resume);
    ExpectResumes(whole.losses, std::string(format) + "_f1_to_fs", 2, f1 + fmt, 3, fs + fmt, ckpt,
                  resume);
    ExpectResumes(whole.losses, std::string(format) + "_fs_to_f1", 3, fs + fmt, 2, f1 + fmt, ckpt,
                  resume);
  }
  ExpectResumes(whole.losses, "sharded_hybrid_to_fs", 4, fs + " --sharding=hybrid", 3, fs, ckpt,
                resume);
  ExpectResumes(whole.losses, "dcp_fs", 2, fs, 3, fs, "--export-dcp=", "--import-dcp=");
  ExpectResumes(whole.losses, "dcp_fs_to_f1", 3, fs, 2, f1, "--export-dcp=", "--import-dcp=");
  ExpectResumes(whole.losses, "dcp_f1_to_fs", 2, f1, 2, fs, "--export-dcp=", "--import-dcp=");
}

TEST(TrainerFullyShardE2eTest, RefusesWhatFullyShardDoesNotDoNamingBothFlags) {
  // The flag is honoured: the run says what it trains under.
  RunResult ok = RunTrainer(std::string(kTiny) + " --steps=1 --nproc=2 --fsdp=fully_shard");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_THAT(ok.output, HasSubstr("2 ranks, fully_shard full, 3 units"));
  for (const char* flag : {"--sharding=none", "--backward-prefetch=post"}) {
    RunResult r = RunTrainer(std::string(kTiny) + " --nproc=2 --fsdp=fully_shard " + flag);
    EXPECT_NE(r.exit_code, 0) << flag;
    EXPECT_THAT(r.output, HasSubstr("--fsdp=fully_shard")) << flag;
    EXPECT_THAT(r.output, HasSubstr(flag)) << r.output;
  }
}

}  // namespace
}  // namespace trainer
