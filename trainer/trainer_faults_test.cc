// Runtime faults on the built trainer, injected from outside as a user
// would: a rank stopped with SIGSTOP (hung peer, --timeout), --keep-last
// pruning with debris of earlier crashes, a damaged newest checkpoint under
// --resume, hostile peers on MASTER_PORT, and the flags' errors.
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/testing/hostile_peer.h"
#include "trainer/testing/processes.h"
#include "trainer/testing/run_trainer.h"

namespace trainer::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

// A small fast run: the MLP on synthetic tokens.
constexpr char kSmall[] =
    "--model mlp --data synthetic --vocab 64 --dim 32 --seq 16 --global-batch 8 "
    "--warmup-steps 2 ";

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// Rank 1 is stopped mid-run: rank 0's next collective times out after
// --timeout, the job ends soon after, the report names rank 1 as the rank
// that hung, and the stopped process does not outlive the job.
TEST(TrainerFaults, StoppedRankIsNamedAndTheJobEndsWithinTheTimeout) {
  const std::string dir = TempDir("hung");
  const std::string log = dir + "/log.jsonl";
  // An explicit --timeout bounds the rendezvous too: long enough for both
  // ranks to start on a loaded machine.
  const double timeout_s = 8;
  const pid_t trainer =
      StartTrainer(std::string(kSmall) + "--nproc 2 --steps 100000 --timeout 8 --log-json " + log,
                   dir + "/out.txt");
  pid_t stopped = -1;
  Clock::time_point stopped_at;
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (Clock::now() < deadline && stopped < 0) {
    if (LoggedSteps(log).size() >= 3) {
      for (pid_t pid : ChildrenOf(trainer)) {
        if (RankOf(pid) == 1) stopped = pid;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_GT(stopped, 0) << "rank 1 never trained: " << ReadAll(dir + "/out.txt");
  ASSERT_EQ(kill(stopped, SIGSTOP), 0);
  stopped_at = Clock::now();
  const int status = WaitExit(trainer);
  const double seconds = std::chrono::duration<double>(Clock::now() - stopped_at).count();
  const std::string output = ReadAll(dir + "/out.txt");
  EXPECT_NE(status, 0) << output;
  EXPECT_GE(seconds, timeout_s - 1) << output;  // ended by the timeout, not sooner
  EXPECT_LT(seconds, timeout_s + 6) << output;  // and not much later
  EXPECT_THAT(output, HasSubstr("rank 1 (pid " + std::to_string(stopped) +
                                ") hung (stopped by signal " + std::to_string(SIGSTOP)))
      << output;
  EXPECT_THAT(output, HasSubstr("rank 0 (pid ")) << output;
  EXPECT_FALSE(Alive(stopped)) << "the stopped rank outlived the job";
}

// --keep-last 2: after the run only the newest two checkpoints remain, and
// an interrupted save of an earlier crash (older, no MANIFEST) is gone; a
// resumed run with --keep-last 1 leaves only its last.
TEST(TrainerFaults, KeepLastLeavesTheNewestCheckpointsAndRemovesDebris) {
  const std::string root = TempDir("keep_last");
  const std::string ckpt = root + "/ckpt";
  fs::create_directories(ckpt + "/step_1");
  { std::ofstream(ckpt + "/step_1/rank_00000.pt") << "torn save of a crashed run"; }
  auto run = RunTrainer(std::string(kSmall) +
                        "--nproc 2 --steps 12 --checkpoint-every 2 "
                        "--keep-last 2 --checkpoint-dir " +
                        ckpt);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_EQ(Entries(ckpt), (std::vector<std::string>{"step_10", "step_12"}));

  auto resumed = RunTrainer(std::string(kSmall) +
                            "--nproc 2 --steps 15 --checkpoint-every 2 "
                            "--keep-last 1 --resume --checkpoint-dir " +
                            ckpt);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(Entries(ckpt), (std::vector<std::string>{"step_15"}));
}

// Issue 27: the newest checkpoint's MANIFEST damaged and the one before it
// missing a byte of a rank file. --resume names each checkpoint it skips and
// why, moves it aside where nothing picks it up again, continues from the
// newest good one, and saves the damaged steps anew (before: it resumed
// from the previous step without a word, then died at the damaged step with
// "already complete; refusing to overwrite it").
TEST(TrainerFaults, DamagedNewestCheckpointIsSetAsideAndTrainingContinues) {
  const std::string ckpt = TempDir("damaged_newest") + "/ckpt";
  auto run = RunTrainer(std::string(kSmall) +
                        "--nproc 2 --steps 12 --checkpoint-every 4 "
                        "--checkpoint-dir " +
                        ckpt);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ASSERT_EQ(Entries(ckpt), (std::vector<std::string>{"step_12", "step_4", "step_8"}));
  {
    std::fstream manifest(ckpt + "/step_12/MANIFEST", std::ios::in | std::ios::out);
    manifest.seekp(40);
    manifest.put('#');
  }
  fs::resize_file(ckpt + "/step_8/rank_00001.pt",
                  fs::file_size(ckpt + "/step_8/rank_00001.pt") - 1);

  auto resumed = RunTrainer(std::string(kSmall) +
                            "--nproc 2 --steps 16 --checkpoint-every 4 "
                            "--resume --checkpoint-dir " +
                            ckpt);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("trainer: skipping damaged checkpoint " + ckpt +
                                        "/step_12 (moved to " + ckpt +
                                        "/.damaged.step_12): "
                                        "manifest " +
                                        ckpt + "/step_12/MANIFEST is damaged"));
  EXPECT_THAT(resumed.output, HasSubstr("trainer: skipping damaged checkpoint " + ckpt +
                                        "/step_8 (moved to " + ckpt + "/.damaged.step_8): file " +
                                        ckpt + "/step_8/rank_00001.pt is truncated"));
  EXPECT_THAT(resumed.output, HasSubstr("trainer: resuming from " + ckpt + "/step_4\n"));
  EXPECT_EQ(Entries(ckpt), (std::vector<std::string>{".damaged.step_12", ".damaged.step_8",
                                                     "step_12", "step_16", "step_4", "step_8"}));
}

TEST(TrainerFaults, FlagErrorsNameTheFlag) {
  auto keep = RunTrainer(std::string(kSmall) + "--nproc 1 --steps 2 --keep-last 2");
  EXPECT_EQ(keep.exit_code, 2);
  EXPECT_THAT(keep.output, HasSubstr("--keep-last=2: expected --checkpoint-dir"));
  auto timeout = RunTrainer(std::string(kSmall) + "--nproc 1 --steps 2 --timeout 0");
  EXPECT_EQ(timeout.exit_code, 2);
  EXPECT_THAT(timeout.output, HasSubstr("--timeout='0'"));
  auto restarts = RunTrainer(std::string(kSmall) + "--nproc 1 --steps 2 --max-restarts -1");
  EXPECT_EQ(restarts.exit_code, 2);
  EXPECT_THAT(restarts.output, HasSubstr("--max-restarts='-1'"));
}

// --device=cuda where it cannot run (this suite runs the CPU build, on
// machines without a GPU): refused before any rank starts, naming what is
// missing, both for a single process and for launched ranks.
TEST(TrainerFaults, CudaWithoutCudaIsRefusedNamingWhatIsMissing) {
  for (const char* nproc : {"1", "2"}) {
    auto run = RunTrainer(std::string(kSmall) + "--steps 2 --device cuda --nproc " + nproc);
    EXPECT_EQ(run.exit_code, 2) << run.output;
    EXPECT_THAT(run.output, HasSubstr("--device=cuda: this trainer was built without CUDA"));
    EXPECT_THAT(run.output, HasSubstr("use --device=cpu"));
    EXPECT_THAT(run.output, ::testing::Not(HasSubstr("[rank")));
  }
  auto bad = RunTrainer(std::string(kSmall) + "--steps 2 --device tpu --nproc 1");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.output, HasSubstr("--device"));
}

// Issue 27: a rank (RANK set, as torchrun or //tools:launch start it) whose
// MASTER_PORT is held by something that answers with garbage, or that
// accepts and never answers, ends with an error naming that peer (comm's
// rendezvous client) within --timeout, instead of aborting in
// std::length_error (exit 134) or waiting forever. The peers are comm's
// test fixture. This runs the trainer as rank 1 of 2 with `peer` on
// MASTER_PORT.
RunResult RunRank1Against(const comm::testing::HostilePeer& peer, const std::string& args) {
  const std::string port = std::to_string(peer.port());
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", port.c_str(), 1);
  RunResult run = RunTrainer(args);
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) unsetenv(name);
  return run;
}

TEST(TrainerFaults, GarbageOnMasterPortIsAClearErrorNotAnAbort) {
  comm::testing::HostilePeer garbage(comm::testing::HostilePeer::Garbage(std::string(64, '\xff')));
  const std::string port = std::to_string(garbage.port());
  const auto start = Clock::now();
  auto run = RunRank1Against(garbage, std::string(kSmall) + "--steps 2 --timeout 10");
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_EQ(run.exit_code, 1) << run.output;  // not 134 (std::terminate's abort)
  EXPECT_THAT(run.output, HasSubstr("rank 1 could not join the rendezvous at 127.0.0.1:" + port));
  EXPECT_THAT(run.output, HasSubstr("rendezvous peer 127.0.0.1:" + port +
                                    " answered the ping with 0xffffffff"));
  EXPECT_THAT(run.output, ::testing::Not(HasSubstr("terminate called")));
  EXPECT_LT(seconds, 10.0) << run.output;
}

TEST(TrainerFaults, SilentMasterPortEndsWithinTheTimeout) {
  comm::testing::HostilePeer silent(comm::testing::HostilePeer::Silent());
  const auto start = Clock::now();
  auto run = RunRank1Against(silent, std::string(kSmall) + "--steps 2 --timeout 5");
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("rank 1 could not join the rendezvous at 127.0.0.1:" +
                                    std::to_string(silent.port())));
  EXPECT_THAT(run.output, HasSubstr("within 5000 ms")) << run.output;
  EXPECT_LT(seconds, 5.0 + 10.0) << run.output;  // the timeout, plus starting the binary
}

}  // namespace
}  // namespace trainer::testing
