// The trainer started by the field's launchers. First PyTorch's own, torchrun (the installed
// `torch`'s torch.distributed.run, with --no-python), as clusters start jobs:
// its agent serves the rendezvous store and tells the workers so
// (TORCHELASTIC_USE_AGENT_STORE=True), which comm's env:// rendezvous
// follows. Covered: the static rendezvous on one node, --standalone (the
// c10d backend on a free port), two torchrun processes on loopback forming
// one job with the c10d backend, and torchrun's --max-restarts relaunching
// the workers after one is killed, which resume from the newest checkpoint.
// Then Slurm's srun, whose tasks are told who they are by SLURM_* variables
// (set here as srun sets them; there is no Slurm on these machines). Each
// run's losses are the trainer's own launcher's, step for step.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "torch_python.h"
#include "trainer/testing/processes.h"
#include "trainer/testing/run_trainer.h"

namespace trainer::testing {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

constexpr char kSmall[] =
    "--model mlp --data synthetic --vocab 64 --dim 32 --seq 16 --global-batch 8 "
    "--warmup-steps 2 --optimizer adamw ";

// A TCP port nothing listens on now (the kernel's pick; closed again).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  EXPECT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  close(fd);
  return ntohs(addr.sin_port);
}

// torchrun with `torchrun_args`, running the trainer with `trainer_args`;
// stdout and stderr to `output_file`. Returns torchrun's pid.
pid_t StartTorchrun(const std::string& torchrun_args, const std::string& trainer_args,
                    const std::string& output_file) {
  const std::string command = std::string("exec ") + kTorchPython + " -m torch.distributed.run " +
                              torchrun_args + " --no-python trainer/trainer " + trainer_args +
                              " > " + output_file + " 2>&1";
  const pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

// The losses of the same run under the trainer's own launcher, 2 ranks.
std::vector<double> ReferenceLosses(int steps) {
  const std::string log = TempDir("torchrun_reference") + "/log.jsonl";
  auto run = RunTrainer(std::string(kSmall) + "--nproc 2 --steps " + std::to_string(steps) +
                        " --log-json " + log);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  return ReadLog(log, 2).losses;
}

TEST(TrainerTorchrun, StaticAndStandaloneRendezvousTrainAsOurLauncherDoes) {
  const std::vector<double> want = ReferenceLosses(8);
  ASSERT_EQ(want.size(), 8u);
  const std::string static_args =
      "--nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port " +
      std::to_string(FreePort());
  for (const std::string& torchrun_args :
       {static_args, std::string("--standalone --nproc-per-node 2")}) {
    SCOPED_TRACE(torchrun_args);
    const std::string dir = TempDir("torchrun_one_node");
    const pid_t torchrun = StartTorchrun(
        torchrun_args, std::string(kSmall) + "--steps 8 --log-json " + dir + "/log.jsonl",
        dir + "/out.txt");
    const int status = WaitExit(torchrun);
    const std::string output = ReadAll(dir + "/out.txt");
    ASSERT_EQ(status, 0) << output;
    // Before: "rank 0 could not serve the rendezvous store on port …
    // Address already in use" (the agent already serves it).
    EXPECT_THAT(output, ::testing::Not(HasSubstr("could not serve")));
    ExpectSameLosses(ReadLog(dir + "/log.jsonl", 2).losses, want, 1e-6, torchrun_args);
  }
}

TEST(TrainerTorchrun, TwoTorchrunProcessesFormOneJobWithTheC10dBackend) {
  const std::vector<double> want = ReferenceLosses(8);
  const std::string endpoint = "127.0.0.1:" + std::to_string(FreePort());
  const std::string dir = TempDir("torchrun_c10d");
  std::vector<pid_t> launchers;
  for (int node = 0; node < 2; ++node) {
    launchers.push_back(
        StartTorchrun("--nnodes 1:2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-id trainer_test "
                      "--rdzv-endpoint " +
                          endpoint + " --rdzv-conf last_call_timeout=30",
                      std::string(kSmall) + "--steps 8 --log-json " + dir + "/log" +
                          std::to_string(node) + ".jsonl",
                      dir + "/out" + std::to_string(node) + ".txt"));
  }
  for (int node = 0; node < 2; ++node) {
    const int status = WaitExit(launchers[static_cast<size_t>(node)]);
    EXPECT_EQ(status, 0) << ReadAll(dir + "/out" + std::to_string(node) + ".txt");
  }
  // One of the two hosts rank 0, which writes the log.
  std::string log;
  for (int node = 0; node < 2; ++node) {
    const std::string path = dir + "/log" + std::to_string(node) + ".jsonl";
    if (!ReadAll(path).empty()) log = path;
  }
  ASSERT_FALSE(log.empty()) << ReadAll(dir + "/out0.txt") << ReadAll(dir + "/out1.txt");
  ExpectSameLosses(ReadLog(log, 2).losses, want, 1e-6, "c10d, 2 launchers");
}

// torchrun --max-restarts 1: a worker SIGKILLed after the first checkpoints
// makes torchrun relaunch both; they see TORCHELASTIC_RESTART_COUNT=1 and
// resume from the newest checkpoint, and the run's last steps have the
// uninterrupted run's losses.
TEST(TrainerTorchrun, MaxRestartsRelaunchesWorkersThatResume) {
  constexpr int kSteps = 400;
  const std::vector<double> want = ReferenceLosses(kSteps);
  ASSERT_EQ(want.size(), static_cast<size_t>(kSteps));
  const std::string dir = TempDir("torchrun_restart");
  const std::string log = dir + "/log.jsonl";
  const pid_t torchrun = StartTorchrun(
      "--nnodes 1 --nproc-per-node 2 --max-restarts 1 --master-addr 127.0.0.1 --master-port " +
          std::to_string(FreePort()),
      std::string(kSmall) + "--steps " + std::to_string(kSteps) +
          " --checkpoint-every 10 --checkpoint-dir " + dir + "/ckpt --log-json " + log,
      dir + "/out.txt");
  std::vector<pid_t> workers;
  const auto deadline = Clock::now() + std::chrono::seconds(90);
  while (Clock::now() < deadline) {
    workers = ChildrenOf(torchrun);
    const auto steps = LoggedSteps(log);
    if (workers.size() == 2 && !steps.empty() && steps.back() >= 25) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_LT(Clock::now(), deadline) << ReadAll(dir + "/out.txt");
  ASSERT_EQ(kill(workers[1], SIGKILL), 0);
  const int status = WaitExit(torchrun);
  const std::string output = ReadAll(dir + "/out.txt");
  ASSERT_EQ(status, 0) << output;
  EXPECT_THAT(output, HasSubstr("trainer: restart 1: resuming from " + dir + "/ckpt/step_"))
      << output;
  // The log holds the first attempt's steps, then the resumed ones from the
  // checkpoint on: the last kSteps/2 match the uninterrupted run.
  const StepLog got = ReadLog(log, 2);
  ASSERT_GE(got.losses.size(), static_cast<size_t>(kSteps));
  EXPECT_EQ(got.steps.back(), kSteps);
  const std::vector<double> got_tail(got.losses.end() - kSteps / 2, got.losses.end());
  const std::vector<double> want_tail(want.end() - kSteps / 2, want.end());
  ExpectSameLosses(got_tail, want_tail, 1e-6, "after the restart");
}

// Two tasks of an srun job step on one node: no RANK, WORLD_SIZE or
// MASTER_ADDR, only Slurm's variables (comm/slurm.h maps them).
TEST(TrainerSrun, TasksOfAJobStepFormTheGroupFromSlurmsVariables) {
  const std::vector<double> want = ReferenceLosses(8);
  const std::string dir = TempDir("srun_tasks");
  const std::string port = std::to_string(FreePort());
  std::vector<pid_t> tasks;
  for (int task = 0; task < 2; ++task) {
    const pid_t pid = fork();
    if (pid == 0) {
      for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                               "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT"}) {
        unsetenv(name);
      }
      setenv("SLURM_JOB_ID", "4242", 1);
      setenv("SLURM_STEP_ID", "0", 1);
      setenv("SLURM_PROCID", std::to_string(task).c_str(), 1);
      setenv("SLURM_LOCALID", std::to_string(task).c_str(), 1);
      setenv("SLURM_STEP_NUM_TASKS", "2", 1);
      setenv("SLURM_STEP_NUM_NODES", "1", 1);
      setenv("SLURM_STEP_NODELIST", "127.0.0.1", 1);
      setenv("MASTER_PORT", port.c_str(), 1);  // the documented way to pick one
      const std::string command = "exec trainer/trainer " + std::string(kSmall) +
                                  "--steps 8 --log-json " + dir + "/log.jsonl > " + dir + "/out" +
                                  std::to_string(task) + ".txt 2>&1";
      execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    tasks.push_back(pid);
  }
  for (int task = 0; task < 2; ++task) {
    EXPECT_EQ(WaitExit(tasks[static_cast<size_t>(task)]), 0)
        << ReadAll(dir + "/out" + std::to_string(task) + ".txt");
  }
  EXPECT_THAT(ReadAll(dir + "/out0.txt"), HasSubstr("2 ranks"));
  ExpectSameLosses(ReadLog(dir + "/log.jsonl", 2).losses, want, 1e-6, "srun tasks");
}

}  // namespace
}  // namespace trainer::testing
