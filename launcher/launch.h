// Starts the local ranks of a distributed job, as torchrun does: the library
// behind //tools:launch (its flags: launcher/flags.h), the trainer's --nproc
// and testing/multiprocess.h.
//
// PyTorch: torchrun (torch.distributed.run) and its elastic agent.
//
//   launcher::LaunchOptions options;
//   options.nproc_per_node = 2;
//   options.command = {"bazel-bin/trainer/trainer", "--steps=10"};
//   absl::StatusOr<launcher::LaunchResult> result = launcher::launch(options);
//   if (!result.ok()) return result.status();  // bad options: nothing started
//   return result->exit_code;                  // 0, or the first failure's
//
// Each rank is a child process with RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, GROUP_RANK (node rank), MASTER_ADDR and MASTER_PORT set,
// and OMP_NUM_THREADS from thread_layout(): the ranks on this node share its
// cores (see host/thread_layout.h). Its stdout/stderr
// lines are prefixed "[rank K] ". When a rank fails (non-zero exit or killed
// by a signal) the others get SIGTERM, then SIGKILL after `kill_grace` (a
// stopped rank gets SIGKILL at once: SIGTERM would wait for a SIGCONT).
//
// Elastic restarts (torchrun's --max-restarts): with max_restarts N > 0, a
// failed group is ended as a whole and started again, with a fresh
// rendezvous port (when master_port is 0) and TORCHELASTIC_RESTART_COUNT set
// to the attempt number (0 first), up to N times; every restart is reported
// through `on_event` with its cause. A program that checkpoints resumes from
// its newest checkpoint when it sees a restart count above 0 (the trainer
// does). A timeout or a stop signal ends the job without restarting.
// Multi-node (nnodes > 1 with max_restarts > 0): node 0's launcher listens on
// master_addr:master_port and the other launchers connect to it; every
// attempt starts once all nodes joined it, its ranks get a fresh port node 0
// picks (not master_port), a failure on any node ends the ranks on every
// node, and node 0's verdict — restart everywhere, or give up with the
// reason — holds for all. A launcher that dies ends the job (no restart
// without its node). The launchers' messages are short text lines (at most
// 64 KiB); a peer that sends anything else is a DataLoss error naming its
// address and what it sent, a connection to node 0 that does not introduce
// itself as a node is turned away (reported through `on_event`), and every
// wait of that rendezvous is bounded (by `timeout`, and at most 2 minutes
// to gather the nodes for an attempt).
//
// Hung ranks: a rank stopped by a signal (SIGSTOP, SIGTSTP, a tracer) is
// seen by the launcher (waitpid WUNTRACED). When the job then fails — the
// other ranks' collectives time out waiting for it — the summary names the
// stopped rank as the one that hung, before the rank whose timeout came
// first. A rank that is alive but silent without being stopped (spinning,
// deadlocked) cannot be told from its waiting peers from outside; the
// summary then names only the ranks that failed.
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
#include "host/thread_layout.h"

namespace launcher {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  // 0: pick a free local port (single node only).
  int master_port = 0;
  // Ends every rank after this long (0: no limit), restarts included; the
  // result then has timed_out set and exit_code 124.
  std::chrono::milliseconds timeout{0};
  // The collective timeout the ranks should give their process groups,
  // passed as COMM_COLLECTIVE_TIMEOUT_MS (0: not set). The trainer honours
  // it when its own --timeout is not given.
  std::chrono::milliseconds collective_timeout{0};
  // Restarts of the whole group after a rank fails (0: none).
  int max_restarts = 0;
  // Receives the launcher's own messages (a restart and its cause, a rank
  // stopped by a signal). Unset: "launch: MESSAGE" on stderr.
  std::function<void(const std::string& message)> on_event;
  // How long ranks get between SIGTERM and SIGKILL.
  std::chrono::milliseconds kill_grace{3000};
  // Intra-op threads per rank; 0: OMP_NUM_THREADS if the environment (or
  // `env`) sets it, else cores / nproc_per_node, at least 1.
  int threads_per_rank = 0;
  // Binds each local rank to its own threads_per_rank CPUs (before exec,
  // so every thread of the rank inherits it: its compute threads and
  // Gloo's), when the ranks' threads fit the CPUs this process may use
  // (host::CpusOfRank); otherwise, or when false, ranks run on all of them.
  // Off the other ranks' cores, a rank's collective hand-offs and its
  // caches are its own: the trainer's small FSDP step on 2 cores is ~15%
  // faster bound (benchmarks/RESULTS.md). torchrun binds only when asked
  // (--numa-binding); turn this off when other jobs share the CPUs.
  bool bind_cores = true;
  // The program (looked up in PATH when it has no '/') and its arguments.
  std::vector<std::string> command;
  // Added to (or replacing) the inherited environment of every rank.
  std::map<std::string, std::string> env;
  // Removed from the inherited environment.
  std::vector<std::string> unset_env;
  // Receives every output line of every rank (without the newline). Unset:
  // "[rank K] line" goes to this process's stdout or stderr, matching the
  // stream the rank wrote to.
  std::function<void(int rank, bool is_stderr, const std::string& line)> on_line;
  // Polled while waiting: when it becomes non-zero (e.g. set by a SIGINT
  // handler to the signal number), the ranks are ended and launch() returns
  // with exit_code 128 + that value.
  const std::atomic<int>* stop_signal = nullptr;
};

struct RankExit {
  int rank = -1;  // global rank
  int pid = -1;
  int exit_code = -1;   // when exited normally
  int term_signal = 0;  // when killed by a signal
  // True when the launcher ended this rank (another failed, timeout or stop).
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
  // (Killed) first; ended the others"), empty on success. Of the last
  // attempt when the group was restarted.
  std::string summary;
  // Ranks that were stopped by a signal when the attempt failed (the ranks
  // that hung), in rank order.
  std::vector<int> hung_ranks;
  std::vector<RankExit> ranks;  // indexed by local rank; of the last attempt
  // Restarts done, with the summary of the failure that caused each.
  std::vector<std::string> restart_causes;
};

// The environment variables a rank reads: restart attempt (0 first) and the
// collective timeout in milliseconds (set only when `collective_timeout` is).
inline constexpr char kRestartCountVariable[] = "TORCHELASTIC_RESTART_COUNT";
inline constexpr char kMaxRestartsVariable[] = "TORCHELASTIC_MAX_RESTARTS";
inline constexpr char kCollectiveTimeoutVariable[] = "COMM_COLLECTIVE_TIMEOUT_MS";

// Bad options (nproc <= 0, node_rank >= nnodes, nnodes > 1 without a master
// port, empty command, program not executable) are an InvalidArgument /
// NotFound error; a rank failing is not an error of launch() but a result.
absl::StatusOr<LaunchResult> launch(const LaunchOptions& options);

// The thread layout launch() gives the ranks of `options`; callers print it
// (and its warning) before launching.
absl::StatusOr<host::ThreadLayout> thread_layout(const LaunchOptions& options);

// A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0).
absl::StatusOr<int> pick_free_port();

}  // namespace launcher
