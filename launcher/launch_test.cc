// The launcher, through the library (launcher::launch) and the command line
// (//tools:launch): environment, output prefixes, exit codes, ending the
// other ranks, timeouts, and that no process outlives a launch.
#include "launcher/launch.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <future>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/testing/hostile_peer.h"
#include "launcher/flags.h"

namespace launcher {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using Clock = std::chrono::steady_clock;
using comm::testing::HostilePeer;

std::string runfile(const std::string& path) {
  const char* dir = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  return std::string(dir ? dir : ".") + "/" + (ws ? ws : "torchfsdp_cpp") + "/" + path;
}

std::string child_program() { return runfile("launcher/launch_test_child"); }

std::string temp_dir() {
  std::string pattern =
      std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp") +
      "/launchXXXXXX";
  return mkdtemp(pattern.data());
}

bool process_alive(int pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0) return false;
  // A zombie has exited; only its parent has not collected it yet.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const auto close_paren = line.rfind(')');
  return close_paren == std::string::npos || line.size() < close_paren + 3 ||
         line[close_paren + 2] != 'Z';
}

// PIDs each rank wrote ("PID GRANDCHILD") to dir/rank_K.
std::vector<int> read_pids(const std::string& dir, int nproc) {
  std::vector<int> pids;
  for (int r = 0; r < nproc; ++r) {
    std::ifstream f(dir + "/rank_" + std::to_string(r));
    int pid = 0, grandchild = 0;
    if (f >> pid >> grandchild) {
      pids.push_back(pid);
      if (grandchild > 0) pids.push_back(grandchild);
    }
  }
  return pids;
}

struct Captured {
  std::mutex mutex;
  std::vector<std::string> out, err;
};

LaunchOptions options_for(int nproc, std::vector<std::string> args, Captured* captured) {
  LaunchOptions options;
  options.nproc_per_node = nproc;
  options.command = {child_program()};
  options.command.insert(options.command.end(), args.begin(), args.end());
  options.kill_grace = std::chrono::milliseconds(1000);
  options.timeout = std::chrono::seconds(20);
  options.on_line = [captured](int rank, bool is_stderr, const std::string& line) {
    std::lock_guard<std::mutex> lock(captured->mutex);
    (is_stderr ? captured->err : captured->out)
        .push_back("[rank " + std::to_string(rank) + "] " + line);
  };
  return options;
}

TEST(Launcher, SetsRankEnvironmentAndPrefixesOutput) {
  Captured captured;
  auto result = launch(options_for(3, {"--print-env"}, &captured));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 0) << result->summary;
  EXPECT_FALSE(result->first_failed_rank.has_value());
  ASSERT_EQ(result->ranks.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    const std::string p = "[rank " + std::to_string(r) + "] ";
    EXPECT_THAT(captured.out, ::testing::Contains(p + "RANK=" + std::to_string(r)));
    EXPECT_THAT(captured.out, ::testing::Contains(p + "LOCAL_RANK=" + std::to_string(r)));
    EXPECT_THAT(captured.out, ::testing::Contains(p + "WORLD_SIZE=3"));
    EXPECT_THAT(captured.out, ::testing::Contains(p + "LOCAL_WORLD_SIZE=3"));
    EXPECT_THAT(captured.out, ::testing::Contains(p + "MASTER_ADDR=127.0.0.1"));
    EXPECT_THAT(captured.err, ::testing::Contains(p + "hello from stderr"));
  }
  // A free port was picked and every rank got the same one.
  std::string port_line;
  for (const auto& line : captured.out) {
    if (line.find("MASTER_PORT=") != std::string::npos) {
      const std::string port = line.substr(line.find('=') + 1);
      EXPECT_GT(std::atoi(port.c_str()), 0);
      if (port_line.empty()) port_line = port;
      EXPECT_EQ(port, port_line);
    }
  }
}

TEST(Launcher, MultiNodeRanksAndGlobalWorldSize) {
  Captured captured;
  auto options = options_for(2, {"--print-env"}, &captured);
  options.nnodes = 3;
  options.node_rank = 1;
  options.master_port = 29999;
  auto result = launch(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_THAT(captured.out, ::testing::Contains("[rank 2] RANK=2"));
  EXPECT_THAT(captured.out, ::testing::Contains("[rank 3] LOCAL_RANK=1"));
  EXPECT_THAT(captured.out, ::testing::Contains("[rank 3] WORLD_SIZE=6"));
  EXPECT_THAT(captured.out, ::testing::Contains("[rank 2] MASTER_PORT=29999"));
}

TEST(Launcher, FailingRankEndsOthersAndItsStatusPropagates) {
  Captured captured;
  const std::string dir = temp_dir();
  const auto start = Clock::now();
  auto result = launch(options_for(
      3, {"--fail-rank", "1", "--fail-code", "7", "--pid-dir", dir, "--spawn-grandchild"},
      &captured));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 7);
  ASSERT_TRUE(result->first_failed_rank.has_value());
  EXPECT_EQ(*result->first_failed_rank, 1);
  EXPECT_THAT(result->summary, HasSubstr("rank 1"));
  EXPECT_THAT(result->summary, HasSubstr("exited with status 7"));
  EXPECT_THAT(result->summary, HasSubstr("rank 1: simulated checksum mismatch"));
  EXPECT_LT(seconds, 5.0);
  EXPECT_TRUE(result->ranks[0].ended_by_launcher);
  EXPECT_FALSE(result->ranks[1].ended_by_launcher);
  const auto pids = read_pids(dir, 3);
  EXPECT_EQ(pids.size(), 6u);  // 3 ranks + 3 grandchildren
  for (int pid : pids) EXPECT_FALSE(process_alive(pid)) << "pid " << pid << " survived";
}

TEST(Launcher, RanksGetTheThreadLayoutAsOmpNumThreads) {
  Captured captured;
  auto options = options_for(2, {"--print-env"}, &captured);
  options.unset_env = {"OMP_NUM_THREADS"};
  auto layout = thread_layout(options);
  ASSERT_TRUE(layout.ok());
  auto result = launch(options);
  ASSERT_TRUE(result.ok()) << result.status();
  const std::string expected =
      "OMP_NUM_THREADS=" + std::to_string(std::max(1, host::AvailableCores() / 2));
  EXPECT_THAT(captured.out, ::testing::Contains("[rank 1] " + expected));

  Captured requested;
  options = options_for(2, {"--print-env"}, &requested);
  options.threads_per_rank = 3;
  ASSERT_TRUE(launch(options).ok());
  EXPECT_THAT(requested.out, ::testing::Contains("[rank 0] OMP_NUM_THREADS=3"));
}

// Each rank runs on its own threads_per_rank CPUs when the ranks' threads
// fit this process's CPUs, and on all of them when they do not, or when
// binding is off (`nproc` without OMP_NUM_THREADS prints a process's
// affinity count).
TEST(Launcher, RanksAreBoundToTheirOwnCoresWhenTheyFit) {
  const int cores = host::AvailableCores();
  const int threads = std::max(1, cores / 2);
  const bool fits = 2 * threads <= cores;
  for (bool bind : {true, false}) {
    Captured captured;
    auto options = options_for(2, {}, &captured);
    options.command = {"/bin/sh", "-c", "unset OMP_NUM_THREADS OMP_THREAD_LIMIT; nproc"};
    options.unset_env = {"OMP_NUM_THREADS"};
    options.bind_cores = bind;
    auto result = launch(options);
    ASSERT_TRUE(result.ok()) << result.status();
    const int expected = bind && fits ? threads : cores;
    for (int rank : {0, 1}) {
      EXPECT_THAT(captured.out, ::testing::Contains("[rank " + std::to_string(rank) + "] " +
                                                    std::to_string(expected)))
          << "bind_cores=" << bind << ", " << cores << " cores";
    }
  }
  Captured oversubscribed;
  auto options = options_for(2, {}, &oversubscribed);
  options.command = {"/bin/sh", "-c", "unset OMP_NUM_THREADS OMP_THREAD_LIMIT; nproc"};
  options.threads_per_rank = cores;  // 2 x cores threads: not bound
  ASSERT_TRUE(launch(options).ok());
  EXPECT_THAT(oversubscribed.out, ::testing::Contains("[rank 0] " + std::to_string(cores)));
}

// A rank writing to a dead peer's socket must fail with EPIPE (and say so),
// not die of SIGPIPE and be reported as the first failure.
TEST(Launcher, RanksDoNotDieOfSigpipe) {
  Captured captured;
  auto result = launch(options_for(1, {"--write-closed-pipe"}, &captured));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 3) << result->summary;
  EXPECT_THAT(result->summary, HasSubstr("write: EPIPE"));
}

TEST(Launcher, KilledRankReportsSignalStatus) {
  Captured captured;
  auto result = launch(options_for(2, {"--kill-self-rank", "0"}, &captured));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 128 + SIGKILL);
  EXPECT_EQ(result->first_failed_rank.value_or(-1), 0);
  EXPECT_THAT(result->summary, HasSubstr("killed by signal 9"));
}

TEST(Launcher, RankIgnoringSigtermIsKilledAfterGrace) {
  Captured captured;
  const auto start = Clock::now();
  auto result = launch(
      options_for(2, {"--fail-rank", "1", "--fail-code", "3", "--ignore-sigterm"}, &captured));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 3);
  EXPECT_EQ(result->ranks[0].term_signal, SIGKILL);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0);
}

TEST(Launcher, TimeoutEndsHungRanks) {
  Captured captured;
  auto options = options_for(2, {"--sleep"}, &captured);
  options.timeout = std::chrono::milliseconds(800);
  const auto start = Clock::now();
  auto result = launch(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->timed_out);
  EXPECT_EQ(result->exit_code, 124);
  EXPECT_THAT(result->summary, HasSubstr("timeout"));
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0);
}

// A rank stopped by a signal hangs its peers until their collectives time
// out; the summary names it (not only the ranks that timed out), and it is
// killed although stopped (SIGTERM would wait for a SIGCONT).
TEST(Launcher, StoppedRankIsNamedAsTheOneThatHung) {
  Captured captured;
  std::vector<std::string> events;
  auto options = options_for(3, {"--hang-rank", "1"}, &captured);
  options.on_event = [&](const std::string& message) { events.push_back(message); };
  const auto start = Clock::now();
  auto result = launch(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0);
  EXPECT_EQ(result->exit_code, 1) << result->summary;
  EXPECT_EQ(result->hung_ranks, std::vector<int>{1});
  EXPECT_THAT(result->summary, HasSubstr("rank 1 (pid "));
  EXPECT_THAT(result->summary, HasSubstr(") hung (stopped by signal " + std::to_string(SIGSTOP)));
  EXPECT_THAT(result->summary, HasSubstr("timed out"));
  // The rank that failed first is one of the waiting ones.
  ASSERT_TRUE(result->first_failed_rank.has_value());
  EXPECT_NE(*result->first_failed_rank, 1);
  EXPECT_THAT(events, ::testing::Contains(HasSubstr("rank 1 (pid")));
  EXPECT_EQ(result->ranks[1].term_signal, SIGKILL);
  EXPECT_FALSE(process_alive(result->ranks[1].pid));
}

TEST(Launcher, CollectiveTimeoutAndRestartCountReachTheRanks) {
  Captured captured;
  auto options = options_for(2, {"--print-env"}, &captured);
  options.collective_timeout = std::chrono::milliseconds(1500);
  options.max_restarts = 4;
  auto result = launch(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 0) << result->summary;
  EXPECT_THAT(captured.out, ::testing::Contains("[rank 1] COMM_COLLECTIVE_TIMEOUT_MS=1500"));
  EXPECT_THAT(captured.out, ::testing::Contains("[rank 1] TORCHELASTIC_RESTART_COUNT=0"));
  EXPECT_THAT(captured.out, ::testing::Contains("[rank 0] TORCHELASTIC_MAX_RESTARTS=4"));
  EXPECT_TRUE(result->restart_causes.empty());
}

// Every failure restarts the whole group, with a fresh rendezvous port,
// until the ranks succeed (here: on the second restart).
TEST(Launcher, FailedGroupIsRestartedWithAFreshRendezvous) {
  Captured captured;
  std::vector<std::string> events;
  const std::string dir = temp_dir();
  auto options = options_for(3,
                             {"--print-env", "--fail-rank", "1", "--fail-code", "7",
                              "--fail-until-restart", "2", "--pid-dir", dir},
                             &captured);
  options.max_restarts = 3;
  options.on_event = [&](const std::string& message) { events.push_back(message); };
  auto result = launch(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 0) << result->summary;
  ASSERT_EQ(result->restart_causes.size(), 2u);
  for (const auto& cause : result->restart_causes) {
    EXPECT_THAT(cause, HasSubstr("rank 1 (pid "));
    EXPECT_THAT(cause, HasSubstr("exited with status 7"));
  }
  ASSERT_EQ(events.size(), 2u);
  EXPECT_THAT(events[0], HasSubstr("restart 1 of 3: rank 1 (pid "));
  EXPECT_THAT(events[1], HasSubstr("restart 2 of 3: rank 1 (pid "));
  std::set<std::string> ports;
  for (const auto& line : captured.out) {
    if (line.find("[rank 0] MASTER_PORT=") == 0) ports.insert(line);
  }
  EXPECT_EQ(ports.size(), 3u) << "expected a fresh port for each of 3 attempts";
  for (int attempt = 0; attempt < 3; ++attempt) {
    EXPECT_THAT(captured.out, ::testing::Contains("[rank 2] TORCHELASTIC_RESTART_COUNT=" +
                                                  std::to_string(attempt)));
  }
  EXPECT_THAT(captured.out, ::testing::Contains("[rank 1] rank 1: restart 2, not failing"));
  // The ranks of the failed attempts were ended, not left running.
  for (int pid : read_pids(dir, 3)) EXPECT_FALSE(process_alive(pid)) << pid;
}

TEST(Launcher, GivesUpWhenRestartsAreUsedUp) {
  Captured captured;
  auto options = options_for(2, {"--kill-self-rank", "0", "--fail-until-restart", "5"}, &captured);
  options.max_restarts = 1;
  options.on_event = [](const std::string&) {};
  auto result = launch(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 128 + SIGKILL);
  EXPECT_EQ(result->restart_causes.size(), 1u);
  EXPECT_THAT(result->summary, HasSubstr("killed by signal 9"));
  EXPECT_THAT(result->summary, HasSubstr("no restart left (--max-restarts=1 used)"));
}

TEST(Launcher, TimeoutIsNotRestarted) {
  Captured captured;
  auto options = options_for(2, {"--sleep"}, &captured);
  options.timeout = std::chrono::milliseconds(800);
  options.max_restarts = 3;
  auto result = launch(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->timed_out);
  EXPECT_TRUE(result->restart_causes.empty());
}

TEST(Launcher, BadOptionsAreErrors) {
  LaunchOptions options;
  options.command = {child_program()};
  options.nproc_per_node = 0;
  EXPECT_THAT(std::string(launch(options).status().message()), HasSubstr("--nproc=0"));
  options.nproc_per_node = 2;
  options.nnodes = 2;
  EXPECT_THAT(std::string(launch(options).status().message()), HasSubstr("--master-port is unset"));
  options.nnodes = 1;
  options.node_rank = 1;
  EXPECT_THAT(std::string(launch(options).status().message()), HasSubstr("--node-rank=1"));
  options.node_rank = 0;
  options.command = {"/no/such/program"};
  EXPECT_EQ(launch(options).status().code(), absl::StatusCode::kNotFound);
  options.command = {};
  EXPECT_FALSE(launch(options).ok());
  options.command = {child_program()};
  options.max_restarts = -1;
  EXPECT_THAT(std::string(launch(options).status().message()), HasSubstr("--max-restarts=-1"));
}

TEST(Launcher, ParsesCommandLine) {
  auto options = parse_launch_args({"--nproc", "4", "--nnodes=2", "--node-rank", "1",
                                    "--master-addr", "10.0.0.1", "--master-port", "1234",
                                    "--timeout", "2.5", "--", "prog", "--x"});
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->nproc_per_node, 4);
  EXPECT_EQ(options->nnodes, 2);
  EXPECT_EQ(options->node_rank, 1);
  EXPECT_EQ(options->master_addr, "10.0.0.1");
  EXPECT_EQ(options->master_port, 1234);
  EXPECT_EQ(options->timeout.count(), 2500);
  EXPECT_EQ(options->command, (std::vector<std::string>{"prog", "--x"}));
  EXPECT_THAT(std::string(parse_launch_args({"--nproc", "x", "--", "p"}).status().message()),
              HasSubstr("--nproc='x'"));
  EXPECT_THAT(std::string(parse_launch_args({"--", "p"}).status().message()),
              HasSubstr("--nproc is missing"));
  EXPECT_THAT(
      std::string(
          parse_launch_args({"--nproc", "2", "--bogus", "1", "--", "p"}).status().message()),
      HasSubstr("unknown flag --bogus"));
  EXPECT_THAT(std::string(parse_launch_args({"--nproc", "2"}).status().message()),
              HasSubstr("no program"));
  auto elastic = parse_launch_args(
      {"--nproc", "2", "--collective-timeout", "1.5", "--max-restarts=3", "--", "prog"});
  ASSERT_TRUE(elastic.ok()) << elastic.status();
  EXPECT_EQ(elastic->collective_timeout.count(), 1500);
  EXPECT_EQ(elastic->max_restarts, 3);
  EXPECT_EQ(elastic->timeout.count(), 0);
  EXPECT_THAT(
      std::string(parse_launch_args({"--nproc", "2", "--collective-timeout", "0", "--", "p"})
                      .status()
                      .message()),
      HasSubstr("--collective-timeout='0'"));
  EXPECT_THAT(std::string(parse_launch_args({"--nproc", "2", "--max-restarts", "-1", "--", "p"})
                              .status()
                              .message()),
              HasSubstr("--max-restarts='-1'"));
}

TEST(Launcher, CommandLineDetails) {
  auto message = [](std::vector<std::string> args) {
    return std::string(parse_launch_args(args).status().message());
  };
  // The program may come without "--"; its arguments are its own, untouched.
  auto bare = parse_launch_args({"--nproc=2", "prog", "--nproc", "9", "--x=", "[a,b]"});
  ASSERT_TRUE(bare.ok()) << bare.status();
  EXPECT_EQ(bare->nproc_per_node, 2);
  EXPECT_EQ(bare->command, (std::vector<std::string>{"prog", "--nproc", "9", "--x=", "[a,b]"}));
  auto dashes = parse_launch_args({"--nproc_per_node", "3", "--nproc-per-node=4", "--", "--"});
  ASSERT_TRUE(dashes.ok()) << dashes.status();
  EXPECT_EQ(dashes->nproc_per_node, 4);  // the last one
  EXPECT_EQ(dashes->command, (std::vector<std::string>{"--"}));
  EXPECT_THAT(message({"--nproc"}), HasSubstr("--nproc: 1 required N missing"));
  EXPECT_EQ(message({"--nproc", "2", "--master-port", "70000", "--", "p"}),
            "--master-port='70000': expected an integer in [1, 65535]");
  EXPECT_EQ(message({"--nproc", "2", "--timeout", "nan", "--", "p"}),
            "--timeout='nan': expected a positive number of seconds (at most 1e7)");
  EXPECT_EQ(message({"--nproc", "2", "--node-rank=-1", "--", "p"}),
            "--node-rank='-1': expected an integer >= 0");
  EXPECT_EQ(message({"--nproc", "2", "--master-addr=", "--", "p"}),
            "--master-addr='': expected a value");
  EXPECT_THAT(message({"--nproc", "2", "--help", "--", "p"}), HasSubstr("unknown flag --help"));
  const std::string usage = launch_usage();
  for (const char* flag :
       {"--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--timeout",
        "--collective-timeout", "--max-restarts", "--threads-per-rank", "--help"}) {
    EXPECT_THAT(usage, HasSubstr(flag));
  }
  EXPECT_THAT(usage, HasSubstr("PROGRAM [ARGS...] follow the flags"));
}

// The command-line tool, as a user runs it.
struct ToolRun {
  int status = -1;
  std::string output;
};

// Runs //tools:launch with `args` in the background, its stdout and stderr
// into `out_path`.
pid_t start_tool(const std::vector<std::string>& args, const std::string& out_path) {
  const pid_t pid = fork();
  if (pid == 0) {
    FILE* out = std::freopen(out_path.c_str(), "w", stdout);
    (void)out;
    dup2(fileno(stdout), STDERR_FILENO);
    std::vector<std::string> argv_strings{runfile("tools/launch")};
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& s : argv_strings) argv.push_back(s.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

// With `pid_dir`: once every rank (of `nproc`) has written its pid file,
// SIGKILL rank `kill_rank`, or send `tool_signal` to the launcher itself.
ToolRun run_tool(const std::vector<std::string>& args, const std::string& pid_dir = "",
                 int kill_rank = -1, int tool_signal = 0, int nproc = 0) {
  const std::string out_path = temp_dir() + "/out";
  const pid_t pid = start_tool(args, out_path);
  if (kill_rank >= 0) {
    // Kill one rank from outside once it is up.
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    std::vector<int> pids;
    while (Clock::now() < deadline) {
      std::ifstream f(pid_dir + "/rank_" + std::to_string(kill_rank));
      int rank_pid = 0, grandchild = 0;
      if (f >> rank_pid >> grandchild) {
        kill(rank_pid, SIGKILL);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  if (tool_signal != 0) {
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (Clock::now() < deadline &&
           read_pids(pid_dir, nproc).size() < static_cast<size_t>(nproc)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    kill(pid, tool_signal);
  }
  ToolRun run;
  int status = 0;
  waitpid(pid, &status, 0);
  run.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream f(out_path);
  run.output.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  return run;
}

TEST(LaunchTool, ExitCodePropagatesAndFirstFailureIsReported) {
  auto run =
      run_tool({"--nproc", "2", "--", child_program(), "--fail-rank", "1", "--fail-code", "5"});
  EXPECT_EQ(run.status, 5) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[rank 1] rank 1 failing with 5"));
  EXPECT_THAT(run.output, HasSubstr("launch: rank 1 (pid"));
  auto ok = run_tool({"--nproc=2", "--", child_program(), "--print-env"});
  EXPECT_EQ(ok.status, 0) << ok.output;
  EXPECT_THAT(ok.output, HasSubstr("[rank 1] RANK=1"));
  auto usage = run_tool({"--nproc", "2"});
  EXPECT_EQ(usage.status, 2);
  EXPECT_THAT(usage.output, HasSubstr("no program"));
}

TEST(LaunchTool, HelpAndUsageErrors) {
  auto help = run_tool({"--help"});
  EXPECT_EQ(help.status, 0) << help.output;
  EXPECT_THAT(help.output, HasSubstr("--collective-timeout SECONDS"));
  auto bad = run_tool({"--nproc", "0", "--", child_program()});
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_THAT(bad.output, HasSubstr("launch: --nproc='0': expected an integer >= 1"));
}

TEST(LaunchTool, KillingOneRankEndsAllWithinSecondsAndLeavesNoProcess) {
  const std::string dir = temp_dir();
  const auto start = Clock::now();
  auto run = run_tool(
      {"--nproc", "3", "--", child_program(), "--sleep", "--pid-dir", dir, "--spawn-grandchild"},
      dir, /*kill_rank=*/2);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_EQ(run.status, 128 + SIGKILL) << run.output;
  EXPECT_THAT(run.output, HasSubstr("rank 2"));
  EXPECT_THAT(run.output, HasSubstr("killed by signal 9"));
  EXPECT_LT(seconds, 8.0);
  // Ranks and their grandchildren: all gone once the launcher has exited
  // (grandchildren were re-parented to it, killed and reaped).
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto pids = read_pids(dir, 3);
  EXPECT_EQ(pids.size(), 6u);
  for (int pid : pids) EXPECT_FALSE(process_alive(pid)) << "pid " << pid << " survived";
}

TEST(LaunchTool, SigtermToLauncherEndsRanks) {
  const std::string dir = temp_dir();
  auto run = run_tool({"--nproc", "2", "--", child_program(), "--sleep", "--pid-dir", dir}, dir, -1,
                      SIGTERM, 2);
  EXPECT_EQ(run.status, 128 + SIGTERM) << run.output;
  EXPECT_THAT(run.output, HasSubstr("launcher received signal 15"));
  const auto pids = read_pids(dir, 2);
  EXPECT_EQ(pids.size(), 2u);
  for (int pid : pids) EXPECT_FALSE(process_alive(pid)) << "pid " << pid << " survived";
}

TEST(LaunchTool, RanksDieWithAKilledLauncher) {
  const std::string dir = temp_dir();
  auto run = run_tool({"--nproc", "2", "--", child_program(), "--sleep", "--pid-dir", dir}, dir, -1,
                      SIGKILL, 2);
  EXPECT_EQ(run.status, 128 + SIGKILL);
  // PR_SET_PDEATHSIG: the kernel kills the ranks when the launcher dies.
  // Their parent is gone, so they are reaped by a subreaper/init, not us.
  const auto pids = read_pids(dir, 2);
  EXPECT_EQ(pids.size(), 2u);
  const auto deadline = Clock::now() + std::chrono::seconds(3);
  for (int pid : pids) {
    while (process_alive(pid) && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_FALSE(process_alive(pid)) << "pid " << pid << " survived its launcher";
  }
}

TEST(LaunchTool, MaxRestartsRestartsAndLogsTheCause) {
  auto run = run_tool({"--nproc", "2", "--max-restarts", "2", "--", child_program(), "--fail-rank",
                       "0", "--fail-code", "6", "--fail-until-restart", "1"});
  EXPECT_EQ(run.status, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("launch: restart 1 of 2: rank 0 (pid "));
  EXPECT_THAT(run.output, HasSubstr("exited with status 6"));
  EXPECT_THAT(run.output, HasSubstr("[rank 0] rank 0: restart 1, not failing"));
}

// Two launchers on loopback (nodes 0 and 1, one rank each), as two
// processes, each started with start_tool.

ToolRun wait_tool(pid_t pid, const std::string& out_path) {
  ToolRun run;
  int status = 0;
  waitpid(pid, &status, 0);
  run.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream f(out_path);
  run.output.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  return run;
}

std::vector<std::string> node_args(int node, int port, int max_restarts,
                                   std::vector<std::string> child_args) {
  std::vector<std::string> args = {"--nproc",
                                   "1",
                                   "--nnodes",
                                   "2",
                                   "--node-rank",
                                   std::to_string(node),
                                   "--master-port",
                                   std::to_string(port),
                                   "--max-restarts",
                                   std::to_string(max_restarts),
                                   "--",
                                   child_program()};
  args.insert(args.end(), child_args.begin(), child_args.end());
  return args;
}

std::vector<std::string> lines_with(const std::string& text, const std::string& prefix) {
  std::vector<std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) == 0) out.push_back(line.substr(prefix.size()));
  }
  return out;
}

// Rank 1 (node 1) fails in the first attempt: node 0's rank is ended too,
// both launchers log the same restart and cause, and the second attempt
// runs on both nodes with one fresh port.
TEST(LaunchTool, MultiNodeRestartsEveryNode) {
  const int port = pick_free_port().value();
  const std::string dir = temp_dir();
  const std::vector<std::string> child = {"--print-env", "--fail-rank",          "1", "--fail-code",
                                          "5",           "--fail-until-restart", "1"};
  const pid_t node1 = start_tool(node_args(1, port, 2, child), dir + "/node1");
  const pid_t node0 = start_tool(node_args(0, port, 2, child), dir + "/node0");
  const ToolRun run0 = wait_tool(node0, dir + "/node0");
  const ToolRun run1 = wait_tool(node1, dir + "/node1");
  EXPECT_EQ(run0.status, 0) << run0.output;
  EXPECT_EQ(run1.status, 0) << run1.output;
  for (const ToolRun* run : {&run0, &run1}) {
    EXPECT_THAT(run->output, HasSubstr("launch: restart 1 of 2 (all 2 nodes): node 1: rank 1 "
                                       "(pid "))
        << run->output;
    EXPECT_THAT(run->output, HasSubstr("exited with status 5")) << run->output;
    EXPECT_THAT(run->output, Not(HasSubstr("restart 2 of 2"))) << run->output;
  }
  EXPECT_THAT(run0.output, HasSubstr("[rank 0] rank 0: restart 1, not failing"));
  EXPECT_THAT(run1.output, HasSubstr("[rank 1] rank 1: restart 1, not failing"));
  // Both nodes' ranks got the same port in each attempt, a new one per attempt.
  const auto ports0 = lines_with(run0.output, "[rank 0] MASTER_PORT=");
  const auto ports1 = lines_with(run1.output, "[rank 1] MASTER_PORT=");
  ASSERT_EQ(ports0.size(), 2u) << run0.output;
  EXPECT_EQ(ports0, ports1);
  EXPECT_NE(ports0[0], ports0[1]);
  EXPECT_NE(ports0[0], std::to_string(port));  // the launchers' own port
}

TEST(LaunchTool, MultiNodeGivesUpTogetherWithTheReason) {
  const int port = pick_free_port().value();
  const std::string dir = temp_dir();
  const std::vector<std::string> child = {"--fail-rank",          "0", "--fail-code", "6",
                                          "--fail-until-restart", "9"};
  const pid_t node1 = start_tool(node_args(1, port, 1, child), dir + "/node1");
  const pid_t node0 = start_tool(node_args(0, port, 1, child), dir + "/node0");
  const ToolRun run0 = wait_tool(node0, dir + "/node0");
  const ToolRun run1 = wait_tool(node1, dir + "/node1");
  for (const ToolRun* run : {&run0, &run1}) {
    EXPECT_EQ(run->status, 6) << run->output;
    EXPECT_THAT(run->output, HasSubstr("restart 1 of 1 (all 2 nodes): node 0: rank 0"))
        << run->output;
    EXPECT_THAT(run->output, HasSubstr("no restart left (--max-restarts=1 used)")) << run->output;
  }
}

// A launcher that dies takes its node out: node 0 ends its ranks and says
// why instead of waiting or restarting without it.
TEST(LaunchTool, MultiNodeLauncherLossEndsTheJob) {
  const int port = pick_free_port().value();
  const std::string dir = temp_dir();
  const pid_t node1 =
      start_tool(node_args(1, port, 3, {"--sleep", "--pid-dir", dir}), dir + "/node1");
  const pid_t node0 =
      start_tool(node_args(0, port, 3, {"--sleep", "--pid-dir", dir}), dir + "/node0");
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (Clock::now() < deadline && read_pids(dir, 2).size() < 2) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(read_pids(dir, 2).size(), 2u);
  kill(node1, SIGKILL);
  const auto start = Clock::now();
  const ToolRun run0 = wait_tool(node0, dir + "/node0");
  wait_tool(node1, dir + "/node1");
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 10.0);
  EXPECT_NE(run0.status, 0) << run0.output;
  EXPECT_THAT(run0.output, HasSubstr("node 1's launcher disconnected")) << run0.output;
  EXPECT_THAT(run0.output, HasSubstr("cannot restart without that node")) << run0.output;
  for (int pid : read_pids(dir, 2)) EXPECT_FALSE(process_alive(pid)) << pid;
}

// The launchers' own rendezvous (multi-node restarts) against peers that are
// not launchers: every wait ends by its deadline and every malformed message
// is an error naming the peer and what it sent.
LaunchOptions NodeOptions(int node, int port, std::chrono::milliseconds timeout) {
  LaunchOptions options;
  options.nnodes = 2;
  options.node_rank = node;
  options.master_port = port;
  options.max_restarts = 1;
  options.timeout = timeout;
  options.command = {child_program()};
  return options;
}

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

TEST(LauncherRendezvous, Node0ThatIsNotALauncherIsNamed) {
  struct Case {
    HostilePeer::Behaviour behaviour;
    std::string says;
  };
  const std::vector<Case> cases = {
      {HostilePeer::Garbage("GARBAGE 1 2 3\n"),
       "sent 'GARBAGE 1 2 3': expected GO r PORT, END r CODE CAUSE, NEXT r CAUSE, FINISH or "
       "ABORT CODE CAUSE"},
      {HostilePeer::Garbage("GO 0 99999\n"), "sent 'GO 0 99999': expected GO r PORT"},
      {HostilePeer::Garbage(std::string(200000, 'x')),
       "sent a line of more than 65536 bytes ('xxxx"},
  };
  for (const Case& c : cases) {
    HostilePeer peer(c.behaviour);
    const auto start = Clock::now();
    auto result = launch(NodeOptions(1, peer.port(), std::chrono::seconds(20)));
    ASSERT_FALSE(result.ok());
    EXPECT_EQ(result.status().code(), absl::StatusCode::kDataLoss) << result.status();
    EXPECT_THAT(
        std::string(result.status().message()),
        HasSubstr("node 0's launcher at 127.0.0.1:" + std::to_string(peer.port()) + " " + c.says));
    EXPECT_LT(SecondsSince(start), 5.0);
  }
}

TEST(LauncherRendezvous, SilentNode0EndsWithinTheTimeout) {
  for (auto behaviour : {HostilePeer::Silent(), HostilePeer::ListenOnly()}) {
    HostilePeer peer(behaviour);
    const auto start = Clock::now();
    auto result = launch(NodeOptions(1, peer.port(), std::chrono::milliseconds(1500)));
    ASSERT_FALSE(result.ok());
    EXPECT_EQ(result.status().code(), absl::StatusCode::kDeadlineExceeded) << result.status();
    EXPECT_THAT(std::string(result.status().message()),
                HasSubstr("did not agree on starting an attempt in time"));
    EXPECT_LT(SecondsSince(start), 1.5 + 1.5);
  }
}

// Connects to 127.0.0.1:port (retrying while node 0 starts listening) and
// sends `text`; returns the fd (kept open by the caller).
int ConnectAndSend(int port, const std::string& text) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < deadline) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
      EXPECT_EQ(send(fd, text.data(), text.size(), MSG_NOSIGNAL),
                static_cast<ssize_t>(text.size()));
      return fd;
    }
    close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ADD_FAILURE() << "node 0 never listened on port " << port;
  return -1;
}

TEST(LauncherRendezvous, StrangersAtNode0AreTurnedAwayByName) {
  const int port = pick_free_port().value();
  std::mutex mutex;
  std::vector<std::string> events;
  LaunchOptions options = NodeOptions(0, port, std::chrono::milliseconds(2500));
  options.on_event = [&](const std::string& message) {
    std::lock_guard<std::mutex> lock(mutex);
    events.push_back(message);
  };
  const auto start = Clock::now();
  auto node0 = std::async(std::launch::async, [&] { return launch(options); });
  const int stranger = ConnectAndSend(port, "GET / HTTP/1.1\r\n\r\n");
  auto result = node0.get();
  if (stranger >= 0) close(stranger);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kDeadlineExceeded) << result.status();
  const std::string expected = "sent 'GET / HTTP/1.1\\r': expected 'NODE k', k in [1, --nnodes=2)";
  EXPECT_THAT(std::string(result.status().message()),
              HasSubstr("only 1 of --nnodes=2 launchers reached 127.0.0.1:" + std::to_string(port) +
                        "; turned away: a connection from 127.0.0.1:"));
  EXPECT_THAT(std::string(result.status().message()), HasSubstr(expected));
  EXPECT_LT(SecondsSince(start), 2.5 + 1.5);
  std::lock_guard<std::mutex> lock(mutex);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_THAT(events[0], HasSubstr(expected));
}

TEST(LauncherRendezvous, MalformedMessageFromANodeIsNamed) {
  const int port = pick_free_port().value();
  const auto start = Clock::now();
  auto node0 = std::async(std::launch::async,
                          [&] { return launch(NodeOptions(0, port, std::chrono::seconds(20))); });
  const int fake = ConnectAndSend(port, "NODE 1\nJOIN zero\n");
  auto result = node0.get();
  if (fake >= 0) close(fake);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kDataLoss) << result.status();
  EXPECT_THAT(std::string(result.status().message()), HasSubstr("node 1's launcher at 127.0.0.1:"));
  EXPECT_THAT(std::string(result.status().message()),
              HasSubstr(" sent 'JOIN zero': expected JOIN r, OVER r or FAIL r CODE SUMMARY "
                        "before attempt 0"));
  EXPECT_LT(SecondsSince(start), 5.0);
}

TEST(LaunchTool, TimeoutFlagEndsHungRanks) {
  auto run = run_tool({"--nproc", "2", "--timeout", "0.8", "--", child_program(), "--sleep"});
  EXPECT_EQ(run.status, 124) << run.output;
  EXPECT_THAT(run.output, HasSubstr("timeout"));
}

}  // namespace
}  // namespace launcher
