// The trainer binary end to end (//trainer:trainer, a data dependency):
// loss falls on the text corpus, a resumed run continues the exact loss
// sequence, and 1 and 2 ranks (started through comm's launcher) give the
// same losses. Small models, so each run takes a few seconds on 2 cores.
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/testing/json_lines.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

struct RunResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  fs::path dir = fs::path(base != nullptr ? base : "/tmp") / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

RunResult RunTrainer(const std::string& args) {
  const std::string out_file = TempDir("out") + "/output.txt";
  const std::string command = "trainer/trainer " + args + " > " + out_file + " 2>&1";
  const int status = std::system(command.c_str());
  RunResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream in(out_file);
  std::stringstream text;
  text << in.rdbuf();
  result.output = text.str();
  return result;
}

// A small transformer: one run of 12 steps takes ~2 s.
const char kSmall[] =
    "--layers=1 --dim=32 --heads=2 --seq=32 --global-batch=8 --steps=12 "
    "--warmup-steps=2 --seed=11";

struct StepLog {
  std::vector<int64_t> steps;
  std::vector<double> losses;
};

StepLog ReadLog(const std::string& path, int expected_world_size) {
  StepLog log;
  for (const std::string& line : testing::ReadLines(path)) {
    auto object = testing::ParseJsonLine(line);
    EXPECT_TRUE(object.has_value()) << "not JSON: " << line;
    if (!object) continue;
    for (const char* key : {"step", "loss", "lr", "step_time_s", "tokens_per_s",
                            "peak_rss_bytes", "sharded_state_bytes"}) {
      EXPECT_EQ(object->count(key), 1u) << key << " missing in " << line;
    }
    EXPECT_EQ(object->at("peak_rss_bytes").list.size(),
              static_cast<size_t>(expected_world_size));
    EXPECT_EQ(object->at("sharded_state_bytes").list.size(),
              static_cast<size_t>(expected_world_size));
    for (double bytes : object->at("peak_rss_bytes").list) EXPECT_GT(bytes, 1 << 20);
    for (double bytes : object->at("sharded_state_bytes").list) EXPECT_GT(bytes, 0);
    EXPECT_GT(object->at("tokens_per_s").number, 0);
    log.steps.push_back(static_cast<int64_t>(object->at("step").number));
    log.losses.push_back(object->at("loss").number);
  }
  return log;
}

void ExpectSameLosses(const std::vector<double>& a, const std::vector<double>& b,
                      double rel_tol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_LE(std::abs(a[i] - b[i]), rel_tol * std::abs(a[i]))
        << "step index " << i << ": " << a[i] << " vs " << b[i];
  }
}

TEST(TrainerE2eTest, LossFallsOnTextWithinThirtySteps) {
  const std::string log = TempDir("falls") + "/log.jsonl";
  RunResult r = RunTrainer("--steps=30 --warmup-steps=5 --log-json=" + log);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("done: steps 1-30"));
  StepLog steps = ReadLog(log, 1);
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
  RunResult first = RunTrainer(std::string(kSmall) + " --checkpoint-every=6 --checkpoint-dir=" +
                               ckpt + " --log-json=" + dir + "/first.jsonl");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_TRUE(fs::exists(ckpt + "/step_6/MANIFEST"));
  fs::remove_all(ckpt + "/step_12");

  RunResult resumed = RunTrainer(std::string(kSmall) + " --resume --checkpoint-dir=" + ckpt +
                                 " --log-json=" + dir + "/resumed.jsonl");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("steps 7-12"));

  const StepLog a = ReadLog(dir + "/whole.jsonl", 1);
  const StepLog b = ReadLog(dir + "/resumed.jsonl", 1);
  ASSERT_EQ(a.losses.size(), 12u);
  ASSERT_EQ(b.steps, (std::vector<int64_t>{7, 8, 9, 10, 11, 12}));
  // Same process count, same ops, same state: bit-identical.
  EXPECT_EQ(std::vector<double>(a.losses.begin() + 6, a.losses.end()), b.losses);
  // Checkpointing itself does not perturb the run.
  EXPECT_EQ(ReadLog(dir + "/first.jsonl", 1).losses, a.losses);

  // The same checkpoint resumed on 2 ranks continues the same sequence.
  fs::remove_all(ckpt + "/step_12");
  RunResult two = RunTrainer(std::string(kSmall) + " --nproc=2 --resume --checkpoint-dir=" +
                             ckpt + " --log-json=" + dir + "/two.jsonl");
  ASSERT_EQ(two.exit_code, 0) << two.output;
  ExpectSameLosses(std::vector<double>(a.losses.begin() + 6, a.losses.end()),
                   ReadLog(dir + "/two.jsonl", 2).losses, 1e-4);

  // Training into a directory that holds checkpoints, without --resume, is
  // refused before the first step (checkpoints are never overwritten).
  RunResult again = RunTrainer(std::string(kSmall) + " --checkpoint-dir=" + ckpt);
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_THAT(again.output, HasSubstr("already holds a checkpoint"));
  EXPECT_THAT(again.output, ::testing::Not(HasSubstr("tok/s")));  // no step ran

  // Resuming with another seed would silently train a different run.
  fs::remove_all(ckpt + "/step_12");
  RunResult other_seed = RunTrainer(std::string(kSmall) + " --seed=12 --resume --checkpoint-dir=" + ckpt);
  EXPECT_EQ(other_seed.exit_code, 1);
  EXPECT_THAT(other_seed.output, HasSubstr("--seed=12"));
}

TEST(TrainerE2eTest, OneAndTwoRanksGiveTheSameLosses) {
  const std::string dir = TempDir("ranks");
  for (const std::string& extra : {std::string(""),
                                  std::string(" --grad-accum=2 --clip=0.5 --optimizer=sgd "
                                              "--lr=0.05 --lr-schedule=constant")}) {
    RunResult one = RunTrainer(std::string(kSmall) + extra + " --log-json=" + dir + "/one.jsonl");
    ASSERT_EQ(one.exit_code, 0) << one.output;
    RunResult two = RunTrainer(std::string(kSmall) + extra + " --nproc=2 --log-json=" + dir +
                               "/two.jsonl");
    ASSERT_EQ(two.exit_code, 0) << two.output;
    const StepLog a = ReadLog(dir + "/one.jsonl", 1);
    const StepLog b = ReadLog(dir + "/two.jsonl", 2);
    ASSERT_EQ(a.losses.size(), 12u);
    ExpectSameLosses(a.losses, b.losses, 1e-4);
    EXPECT_LT(a.losses.back(), a.losses.front()) << extra;
  }
  // Gradient accumulation splits the same batch: same losses as K = 1.
  RunResult k1 = RunTrainer(std::string(kSmall) + " --log-json=" + dir + "/k1.jsonl");
  RunResult k4 = RunTrainer(std::string(kSmall) + " --grad-accum=4 --log-json=" + dir + "/k4.jsonl");
  ASSERT_EQ(k1.exit_code, 0) << k1.output;
  ASSERT_EQ(k4.exit_code, 0) << k4.output;
  const std::vector<double> reference = ReadLog(dir + "/k1.jsonl", 1).losses;
  ExpectSameLosses(reference, ReadLog(dir + "/k4.jsonl", 1).losses, 1e-4);

  // Started by //tools:launch (RANK set), the trainer runs as one rank of
  // that world: the same losses again.
  const std::string command = "tools/launch --nproc 2 -- trainer/trainer " +
                              std::string(kSmall) + " --log-json=" + dir +
                              "/launched.jsonl > " + dir + "/launched.txt 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  ExpectSameLosses(reference, ReadLog(dir + "/launched.jsonl", 2).losses, 1e-4);
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

  RunResult fsdp = RunTrainer("--nproc=2 --sharding=full");
  EXPECT_EQ(fsdp.exit_code, 2);
  EXPECT_THAT(fsdp.output,
              HasSubstr("--sharding=full: not available yet: requires "
                        "fsdp::FullyShardedDataParallel (issue #7)"));

  // A rank's failure ends the run with its message, not a backtrace from
  // the other ranks' next collective.
  RunResult save = RunTrainer(std::string(kSmall) +
                              " --nproc=2 --steps=1 --checkpoint-dir=/proc/no-such-dir");
  EXPECT_EQ(save.exit_code, 1);
  EXPECT_THAT(save.output, HasSubstr("--checkpoint-dir='/proc/no-such-dir' step 1"));
  EXPECT_THAT(save.output, HasSubstr("failed on rank 0"));
  EXPECT_THAT(save.output, ::testing::Not(HasSubstr("frame #")));

  RunResult batch = RunTrainer("--nproc=3 --global-batch=16");
  EXPECT_EQ(batch.exit_code, 2);
  EXPECT_THAT(batch.output, HasSubstr("--global-batch=16: expected a multiple of the world size 3"));
}

}  // namespace
}  // namespace trainer
