// Starts the local ranks of a distributed job, as torchrun does: the library
// behind //tools:launch and comm/testing/multiprocess.h.
//
// Each rank is a child process with RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, GROUP_RANK (node rank), MASTER_ADDR and MASTER_PORT set,
// and OMP_NUM_THREADS from thread_layout(): the ranks on this node share its
// cores (see comm/thread_layout.h). Its stdout/stderr
// lines are prefixed "[rank K] ". When a rank fails (non-zero exit or killed
// by a signal) the others get SIGTERM, then SIGKILL after `kill_grace`.
// Children die with the launcher (PR_SET_PDEATHSIG) and each runs in its own
// process group, which is killed as a whole, so nothing is left behind.
// launch() blocks and must be called from a thread that outlives it (the
// death signal follows the forking thread). It marks the calling process a
// child subreaper (PR_SET_CHILD_SUBREAPER) so orphaned grandchildren come
// back to it and are reaped, and it reaps with waitpid(-1): do not run it
// beside other code in the same process that waits for its own children.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/thread_layout.h"

namespace comm {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  // 0: pick a free local port (single node only).
  int master_port = 0;
  // Ends every rank after this long (0: no limit); the result then has
  // timed_out set and exit_code 124.
  std::chrono::milliseconds timeout{0};
  // How long ranks get between SIGTERM and SIGKILL.
  std::chrono::milliseconds kill_grace{3000};
  // Intra-op threads per rank; 0: OMP_NUM_THREADS if the environment (or
  // `env`) sets it, else cores / nproc_per_node, at least 1.
  int threads_per_rank = 0;
  // The program (looked up in PATH when it has no '/') and its arguments.
  std::vector<std::string> command;
  // Added to (or replacing) the inherited environment of every rank.
  std::map<std::string, std::string> env;
  // Removed from the inherited environment.
  std::vector<std::string> unset_env;
  // Receives every output line of every rank (without the newline). Unset:
  // "[rank K] line" goes to this process's stdout or stderr, matching the
  // stream the rank wrote to.
  std::function<void(int rank, bool is_stderr, const std::string& line)>
      on_line;
  // Polled while waiting: when it becomes non-zero (e.g. set by a SIGINT
  // handler to the signal number), the ranks are ended and launch() returns
  // with exit_code 128 + that value.
  const std::atomic<int>* stop_signal = nullptr;
};

struct RankExit {
  int rank = -1;        // global rank
  int pid = -1;
  int exit_code = -1;   // when exited normally
  int term_signal = 0;  // when killed by a signal
  // True when comm ended this rank (another failed, timeout or stop).
  bool ended_by_launcher = false;
};

struct LaunchResult {
  // 0 when every rank exited 0. Otherwise the first failing rank's exit code,
  // or 128 + signal if it was killed; 124 on timeout.
  int exit_code = 0;
  // Global rank that failed first, if any.
  std::optional<int> first_failed_rank;
  bool timed_out = false;
  // One line saying what happened ("rank 1 (pid 123) was killed by signal 9
  // (Killed) first; ended the others"), empty on success.
  std::string summary;
  std::vector<RankExit> ranks;  // indexed by local rank
};

// Bad options (nproc <= 0, node_rank >= nnodes, nnodes > 1 without a master
// port, empty command, program not executable) are an InvalidArgument /
// NotFound error; a rank failing is not an error of launch() but a result.
absl::StatusOr<LaunchResult> launch(const LaunchOptions& options);

// The thread layout launch() gives the ranks of `options`; callers print it
// (and its warning) before launching.
absl::StatusOr<ThreadLayout> thread_layout(const LaunchOptions& options);

// Parses the command line of //tools:launch:
//   --nproc N [--nnodes M] [--node-rank K] [--master-addr A] [--master-port P]
//   [--timeout SECONDS] [--threads-per-rank T] -- PROGRAM [ARGS...]
// (also --flag=value). `args` excludes argv[0].
absl::StatusOr<LaunchOptions> parse_launch_args(const std::vector<std::string>& args);

// A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0).
absl::StatusOr<int> pick_free_port();

}  // namespace comm
