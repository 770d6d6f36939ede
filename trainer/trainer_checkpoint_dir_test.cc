// Fail fast on --checkpoint-dir (issue 38, item 2), on the built trainer:
// a directory that cannot be created fails before step 1; a second job on a
// directory in use refuses at start naming the holder; after kill -9 of the
// holder a new job takes its stale lock over; a lock file that is not the
// trainer's is refused; a job's own restarts (--max-restarts) keep their
// lock and finish.
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "trainer/testing/processes.h"
#include "trainer/testing/run_trainer.h"

namespace trainer::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;
using Clock = std::chrono::steady_clock;

constexpr char kSmall[] =
    "--model mlp --data synthetic --vocab 64 --dim 32 --seq 16 --global-batch 8 "
    "--warmup-steps 2 ";

// Waits until `log` has at least `steps` steps (or 60 s).
void WaitForSteps(const std::string& log, size_t steps) {
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (Clock::now() < deadline && LoggedSteps(log).size() < steps) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GE(LoggedSteps(log).size(), steps) << log;
}

TEST(TrainerCheckpointDir, UncreatableOrUnwritableDirectoryFailsBeforeStepOne) {
  const std::string dir = TempDir("unwritable");
  RunResult r = RunTrainer(std::string(kSmall) +
                           "--nproc 2 --steps 3 --checkpoint-dir /proc/nonexistent/ck "
                           "--log-json " +
                           dir + "/log.jsonl");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--checkpoint-dir='/proc/nonexistent/ck': cannot create it: "));
  EXPECT_THAT(r.output, Not(HasSubstr("step 1")));
  EXPECT_TRUE(LoggedSteps(dir + "/log.jsonl").empty());
  // A file where the directory should be.
  std::ofstream(dir + "/file") << "x";
  r = RunTrainer(std::string(kSmall) + "--nproc 1 --steps 3 --checkpoint-dir " + dir + "/file");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--checkpoint-dir='" + dir + "/file': "));
  EXPECT_THAT(r.output, Not(HasSubstr("step 1")));
}

TEST(TrainerCheckpointDir, SecondJobRefusesAtStartAndTakesOverOnceTheFirstIsKilled) {
  const std::string dir = TempDir("two_jobs");
  const std::string ckpt = dir + "/ck";
  const std::string log = dir + "/log.jsonl";
  const pid_t first =
      StartTrainer(std::string(kSmall) + "--nproc 2 --steps 1000000 " +
                       "--checkpoint-every 1000 --checkpoint-dir " + ckpt + " --log-json " + log,
                   dir + "/first.txt");
  WaitForSteps(log, 2);
  // The holder is the first job's launcher (the ranks' parent).
  RunResult second = RunTrainer(std::string(kSmall) + "--nproc 1 --steps 3 --checkpoint-dir " +
                                ckpt + " --log-json " + dir + "/second.jsonl");
  EXPECT_EQ(second.exit_code, 1) << second.output;
  EXPECT_THAT(second.output, HasSubstr("--checkpoint-dir='" + ckpt + "' is in use by job "));
  EXPECT_THAT(second.output, HasSubstr(", pid " + std::to_string(first) + ", since "));
  EXPECT_TRUE(LoggedSteps(dir + "/second.jsonl").empty());

  // kill -9 of the whole first job: its lock stays, stale.
  for (pid_t rank : ChildrenOf(first)) kill(rank, SIGKILL);
  kill(first, SIGKILL);
  WaitExit(first);
  ASSERT_TRUE(fs::exists(ckpt + "/.lock"));
  RunResult third =
      RunTrainer(std::string(kSmall) + "--nproc 2 --steps 3 --checkpoint-dir " + ckpt);
  EXPECT_EQ(third.exit_code, 0) << third.output;
  EXPECT_THAT(third.output, HasSubstr("trainer: taking over the stale lock of --checkpoint-dir='" +
                                      ckpt + "': its holder, job launcher:"));
  EXPECT_THAT(third.output, HasSubstr("pid " + std::to_string(first) + ", since "));
  EXPECT_FALSE(fs::exists(ckpt + "/.lock"));  // released at the end
  EXPECT_TRUE(fs::exists(ckpt + "/step_3/MANIFEST"));
}

TEST(TrainerCheckpointDir, ALockFileThatIsNotOursIsRefused) {
  const std::string ckpt = TempDir("foreign_lock");
  std::ofstream(ckpt + "/.lock") << "held by a cron job\n";
  const RunResult r =
      RunTrainer(std::string(kSmall) + "--nproc 1 --steps 3 --checkpoint-dir " + ckpt);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--checkpoint-dir='" + ckpt + "': the lock file '" + ckpt +
                                  "/.lock' is not a trainer's lock (its first line is not 'trainer "
                                  "checkpoint-dir lock'): expected a file this trainer wrote"));
  EXPECT_TRUE(fs::exists(ckpt + "/.lock"));  // left alone
}

// Every rank killed mid-run: the restarted ranks (new pids, the same
// launcher) recognise the lock as their job's and finish the run.
TEST(TrainerCheckpointDir, RestartsOfTheSameJobKeepTheLock) {
  const std::string dir = TempDir("restarts");
  const std::string ckpt = dir + "/ck";
  const std::string log = dir + "/log.jsonl";
  const pid_t job =
      StartTrainer(std::string(kSmall) + "--nproc 2 --steps 40 --max-restarts 1 " +
                       "--checkpoint-every 5 --checkpoint-dir " + ckpt + " --log-json " + log,
                   dir + "/out.txt");
  WaitForSteps(log, 12);
  for (pid_t rank : ChildrenOf(job)) kill(rank, SIGKILL);
  EXPECT_EQ(WaitExit(job), 0) << ReadAll(dir + "/out.txt");
  const std::string out = ReadAll(dir + "/out.txt");
  EXPECT_THAT(out, HasSubstr("restart 1 of 1"));
  EXPECT_THAT(out, Not(HasSubstr("is in use by")));
  EXPECT_THAT(out, Not(HasSubstr("taking over")));
  EXPECT_TRUE(fs::exists(ckpt + "/step_40/MANIFEST"));
  EXPECT_FALSE(fs::exists(ckpt + "/.lock"));
}

}  // namespace
}  // namespace trainer::testing
