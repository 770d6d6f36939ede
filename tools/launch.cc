// bazel run //tools:launch -- --nproc N [--nnodes M --node-rank K
//     --master-addr A --master-port P --timeout SECONDS
//     --collective-timeout SECONDS --max-restarts N
//     --threads-per-rank T] -- PROGRAM [ARGS...]     (--help: every flag)
//
// Starts N local ranks of PROGRAM with RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and OMP_NUM_THREADS set (see
// launcher/launch.h and host/thread_layout.h; the layout is printed first),
// prefixes their output with "[rank K] ", and exits with the status of the
// first rank that failed (128 + signal if it was killed, 124 on --timeout,
// 2 on bad usage). With --max-restarts N a failed group is restarted (all
// ranks, fresh rendezvous) up to N times, each restart logged with its cause.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "host/thread_layout.h"
#include "launcher/flags.h"
#include "launcher/launch.h"

namespace {

std::atomic<int> g_stop_signal{0};

void on_signal(int signal) { g_stop_signal.store(signal); }

}  // namespace

int main(int argc, char** argv) {
  // `bazel run` starts us in the runfiles tree; run the program from where
  // the user typed the command, so relative paths mean what they expect.
  if (const char* dir = std::getenv("BUILD_WORKING_DIRECTORY")) {
    if (chdir(dir) != 0) std::perror("launch: chdir(BUILD_WORKING_DIRECTORY)");
  }
  std::vector<std::string> args(argv + 1, argv + argc);
  // --help only first: anywhere later it may be the program's own.
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    std::fputs(launcher::launch_usage().c_str(), stdout);
    return 0;
  }
  auto options = launcher::parse_launch_args(args);
  if (!options.ok()) {
    std::fprintf(stderr, "launch: %s (launch --help lists the flags)\n",
                 std::string(options.status().message()).c_str());
    return 2;
  }
  auto layout = launcher::thread_layout(*options);
  if (!layout.ok()) {
    std::fprintf(stderr, "launch: %s\n", std::string(layout.status().message()).c_str());
    return 2;
  }
  const bool bound = options->bind_cores && !host::CpusOfRank(*layout, 0).empty();
  std::fprintf(stderr, "launch: %s%s\n", layout->ToString().c_str(),
               bound ? "; each rank bound to its own cores" : "");
  if (!layout->warning.empty()) {
    std::fprintf(stderr, "launch: warning: %s\n", layout->warning.c_str());
  }
  // SIGINT/SIGTERM/SIGHUP end the ranks (SIGTERM, then SIGKILL) instead of
  // leaving them to run on.
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &action, nullptr);
  options->stop_signal = &g_stop_signal;

  auto result = launcher::launch(*options);
  if (!result.ok()) {
    std::fprintf(stderr, "launch: %s\n", std::string(result.status().message()).c_str());
    return 2;
  }
  if (result->exit_code != 0) {
    std::fprintf(stderr, "launch: %s (exit status %d)\n", result->summary.c_str(),
                 result->exit_code);
  }
  return result->exit_code;
}
