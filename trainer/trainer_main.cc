// bazel run //trainer:trainer -- [FLAGS]   (see options.h, or --help)
//
// Three ways to run (all train through FSDP, train.h):
//   * no RANK in the environment, --nproc 1: trains in this process, as the
//     only rank of a 1-rank group (a FileStore rendezvous, no port);
//   * no RANK, --nproc N > 1: starts N ranks of this same binary through
//     the launcher (launcher/launch.h; each with RANK/WORLD_SIZE/MASTER_* set)
//     and waits;
//   * RANK set (started by the above, //tools:launch or torchrun): joins the
//     process group from the environment and trains as that rank.
// Exit status: 0 on success, 2 on bad flags, 3 (trainer::kExitOutOfMemory)
// when a rank ran out of memory (the message names the step, the device and
// its memory figures; the checkpoints written before are intact), 1 on any
// other error (which is printed naming what went wrong); with --nproc, the
// first failing rank's.
//
// Faults: --timeout bounds every collective (a rank waiting for a hung peer
// fails; the launcher names the hung rank when it was stopped by a signal);
// --max-restarts N makes the launcher restart every rank after a failure,
// and a restarted rank (TORCHELASTIC_RESTART_COUNT > 0, set by our
// launcher or torchrun) resumes from --checkpoint-dir's newest complete
// checkpoint by itself. --max-restarts goes through the launcher even with
// --nproc 1, so the one rank can be restarted.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "c10/util/Exception.h"
#include "host/compute_layout.h"
#include "comm/process_group.h"
#include "comm/slurm.h"
#include "launcher/launch.h"
#include "trainer/checkpointing.h"
#include "trainer/cuda_graphs.h"
#include "trainer/options.h"
#include "trainer/train.h"

namespace {

std::atomic<int> g_stop_signal{0};

void OnSignal(int signal) { g_stop_signal.store(signal); }

int Fail(const absl::Status& status, int code = 1) {
  std::fprintf(stderr, "trainer: %s\n", std::string(status.message()).c_str());
  return code;
}

// The exit status of a failed training run.
int ExitCode(const absl::Status& status) {
  return trainer::IsOutOfMemory(status) ? trainer::kExitOutOfMemory : 1;
}

// Re-executes this binary as `nproc` ranks with the parsed flags.
int LaunchRanks(const trainer::Options& options) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return Fail(absl::InternalError("cannot resolve /proc/self/exe"));
  self[n] = '\0';
  launcher::LaunchOptions launch;
  launch.nproc_per_node = options.nproc;
  launch.threads_per_rank = options.threads_per_rank;
  launch.bind_cores = options.bind_cores;
  launch.max_restarts = options.max_restarts;
  launch.on_event = [](const std::string& message) {
    std::fprintf(stderr, "trainer: %s\n", message.c_str());
    std::fflush(stderr);
  };
  auto layout = launcher::thread_layout(launch);
  if (!layout.ok()) return Fail(layout.status(), 2);
  if (!layout->warning.empty()) {
    std::fprintf(stderr, "trainer: warning: %s\n", layout->warning.c_str());
  }
  launch.command = {self};
  for (const std::string& arg : trainer::ToArgs(options)) launch.command.push_back(arg);
  // Ctrl-C ends the ranks instead of leaving them running.
  struct sigaction action {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &action, nullptr);
  launch.stop_signal = &g_stop_signal;
  // Rank 0's progress lines read better without the "[rank 0] " prefix;
  // other ranks keep theirs (they only print errors).
  launch.on_line = [](int rank, bool is_stderr, const std::string& line) {
    std::FILE* out = is_stderr ? stderr : stdout;
    if (rank == 0 && !is_stderr) {
      std::fprintf(out, "%s\n", line.c_str());
    } else {
      std::fprintf(out, "[rank %d] %s\n", rank, line.c_str());
    }
    std::fflush(out);
  };
  auto result = launcher::launch(launch);
  if (!result.ok()) return Fail(result.status());
  if (result->exit_code != 0) {
    std::fprintf(stderr, "trainer: %s (exit status %d)\n", result->summary.c_str(),
                 result->exit_code);
  }
  return result->exit_code;
}

// Train, with the exceptions LibTorch and comm throw (a failed collective
// when a peer died, a shape error) turned into one line without the
// backtrace c10::Error carries.
absl::Status RunTraining(const trainer::Options& options, const comm::ProcessGroup& group) {
  try {
    return trainer::Train(options, group).status();
  } catch (const c10::Error& e) {
    // An allocation failure outside a step's guard is still out of memory.
    return trainer::OutOfMemoryOutsideStep(e);
  } catch (const std::exception& e) {
    return absl::InternalError(e.what());
  }
}

// The collective timeout: --timeout, else the launcher's
// COMM_COLLECTIVE_TIMEOUT_MS, else 10 minutes.
absl::StatusOr<std::chrono::milliseconds> CollectiveTimeout(const trainer::Options& options) {
  if (options.timeout_s > 0) {
    return std::chrono::milliseconds(
        std::max<int64_t>(1, static_cast<int64_t>(options.timeout_s * 1000)));
  }
  if (const char* ms = std::getenv(launcher::kCollectiveTimeoutVariable)) {
    int64_t value = 0;
    if (!absl::SimpleAtoi(ms, &value) || value <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(launcher::kCollectiveTimeoutVariable, "='", ms,
                       "': expected a positive number of milliseconds (set by the launcher)"));
    }
    return std::chrono::milliseconds(value);
  }
  return std::chrono::milliseconds(std::chrono::minutes(10));
}

// A restarted rank (the launcher's restart count > 0) continues from the
// newest checkpoint that verifies (damaged newer ones set aside), if the run
// got to write one; before that, it starts over.
absl::Status ResumeIfRestarted(trainer::Options& options, const comm::ProcessGroup& group) {
  const char* count = std::getenv(launcher::kRestartCountVariable);
  int64_t restart = 0;
  if (count == nullptr || !absl::SimpleAtoi(count, &restart) || restart <= 0 ||
      options.checkpoint_dir.empty() || options.resume) {
    return absl::OkStatus();
  }
  auto chosen = trainer::ChooseResumeCheckpoint(options.checkpoint_dir, group);
  if (!chosen.ok()) return chosen.status();
  if (!chosen->has_value()) {
    if (group.rank() == 0) {
      std::printf("trainer: restart %lld: no complete checkpoint in '%s' yet, starting over\n",
                  static_cast<long long>(restart), options.checkpoint_dir.c_str());
    }
    return absl::OkStatus();
  }
  if (group.rank() == 0) {
    std::printf("trainer: restart %lld: resuming from %s\n", static_cast<long long>(restart),
                (*chosen)->c_str());
    std::fflush(stdout);
  }
  options.resume = true;
  options.resume_from = **chosen;
  return absl::OkStatus();
}

int RunRank(trainer::Options options) {
  // Started by our own launcher, OMP_NUM_THREADS already says this; an
  // outside launcher's ranks take the flag here.
  if (options.threads_per_rank > 0) host::SetComputeThreads(options.threads_per_rank);
  if (options.max_restarts > 0) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
                    "--max-restarts=", options.max_restarts,
                    ": a rank started by an outside launcher (RANK is set) cannot restart "
                    "its peers; give --max-restarts to the launcher")),
                2);
  }
  auto timeout = CollectiveTimeout(options);
  if (!timeout.ok()) return Fail(timeout.status(), 2);
  comm::InitOptions init;
  init.backend = trainer::ProcessGroupBackend(options);
  init.timeout = *timeout;
  // Ranks start seconds apart on a loaded machine: a short collective
  // timeout from the launcher's environment must not fail the rendezvous.
  // A --timeout given to this rank bounds every wait, the rendezvous's too.
  init.rendezvous_timeout = options.timeout_s > 0 ? *timeout
                                                  : std::max<std::chrono::milliseconds>(
                                                        *timeout, std::chrono::minutes(2));
  auto group = comm::init_process_group(init);
  if (!group.ok()) return Fail(group.status());
  if (options.nproc_given && options.nproc != 1 && options.nproc != group->size()) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
                    "--nproc=", options.nproc, ": expected 1 or the launcher's WORLD_SIZE=",
                    group->size(), " when started as a rank (RANK is set)")),
                2);
  }
  if (auto s = ResumeIfRestarted(options, *group); !s.ok()) return Fail(s);
  auto result = RunTraining(options, *group);
  if (!result.ok()) return Fail(result, ExitCode(result));
  return 0;
}

// --nproc 1 without a launcher: a 1-rank group over a FileStore in a fresh
// temporary directory (no TCP port to pick or collide on), so a single
// process runs the same FSDP code path as every rank of a larger run.
int RunSingleProcess(const trainer::Options& options) {
  auto timeout = CollectiveTimeout(options);
  if (!timeout.ok()) return Fail(timeout.status(), 2);
  auto layout = host::ApplyThreadLayout(1, options.threads_per_rank);
  if (!layout.ok()) return Fail(layout.status(), 2);
  if (!layout->warning.empty()) {
    std::fprintf(stderr, "trainer: warning: %s\n", layout->warning.c_str());
  }
  const char* tmp = std::getenv("TMPDIR");
  std::string dir_template =
      absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/trainer_store_XXXXXX");
  std::vector<char> buf(dir_template.begin(), dir_template.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) {
    return Fail(absl::InternalError(absl::StrCat(
        "mkdtemp('", dir_template, "') for the 1-rank process group: ", std::strerror(errno))));
  }
  const std::string dir(buf.data());
  const std::string store = dir + "/store";
  int code = 0;
  {
    comm::InitOptions init;
    init.backend = trainer::ProcessGroupBackend(options);
    init.init_method = "file://" + store;
    init.rank = 0;
    init.world_size = 1;
    init.timeout = *timeout;
    auto group = comm::init_process_group(init);
    if (!group.ok()) {
      code = Fail(group.status());
    } else if (auto s = RunTraining(options, *group); !s.ok()) {
      code = Fail(s, ExitCode(s));
    }
  }
  std::error_code ignored;  // a leftover temp directory is not worth failing a finished run
  std::filesystem::remove_all(dir, ignored);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  // `bazel run` starts us in the runfiles tree; relative paths (--log-json,
  // --checkpoint-dir) should mean what they mean where the user typed them.
  if (const char* dir = std::getenv("BUILD_WORKING_DIRECTORY")) {
    if (chdir(dir) != 0) std::perror("trainer: chdir(BUILD_WORKING_DIRECTORY)");
  }
  auto options = trainer::ParseOptions(std::vector<std::string>(argv + 1, argv + argc));
  if (!options.ok()) {
    return Fail(absl::InvalidArgumentError(
                    absl::StrCat(options.status().message(), " (trainer --help lists the flags)")),
                2);
  }
  if (options->help) {
    std::fputs(trainer::Usage().c_str(), stdout);
    return 0;
  }
  if (std::getenv("RANK") != nullptr || comm::is_slurm_task()) return RunRank(*options);
  // Refuse bad combinations before starting any rank.
  if (auto s = trainer::CheckFeatureAvailability(*options, options->nproc); !s.ok()) {
    return Fail(s, 2);
  }
  auto device = trainer::ComputeDevice(*options);
  if (!device.ok()) return Fail(device.status(), 2);
  // --cuda-graphs=on that cannot be honoured, before any rank starts.
  if (auto plan = trainer::PlanCudaGraphs(
          *options, trainer::CaptureEnvironmentFor(*options, *device, options->steps));
      !plan.ok()) {
    return Fail(plan.status(), 2);
  }
  if (options->nproc > 1 || options->max_restarts > 0) return LaunchRanks(*options);
  return RunSingleProcess(*options);
}
