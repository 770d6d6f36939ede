#include "launcher/launch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "launcher/internal/rendezvous.h"

extern char** environ;

namespace launcher {
namespace {

using internal::AttemptHooks;
using internal::Clock;

struct Child {
  int rank = -1;
  pid_t pid = -1;
  int out_fd = -1;  // read ends of the rank's stdout / stderr pipes
  int err_fd = -1;
  std::string out_partial, err_partial;
  std::string last_err_line;  // for the failure summary
  bool reaped = false;
  int status = 0;
  int stop_signal = 0;  // the signal that stopped it, while stopped
  Clock::time_point stopped_at;
};

std::string errno_text(int err) { return std::strerror(err); }

// Builds "KEY=VALUE" strings for the child: inherited environment, minus
// `unset`, with `overrides` applied.
std::vector<std::string> child_environment(const std::map<std::string, std::string>& overrides,
                                           const std::vector<std::string>& unset) {
  std::vector<std::string> result;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry = *e;
    const std::string key = entry.substr(0, entry.find('='));
    bool drop = overrides.count(key) > 0;
    for (const auto& u : unset) drop = drop || u == key;
    if (!drop) result.push_back(std::move(entry));
  }
  for (const auto& [key, value] : overrides) {
    result.push_back(key + "=" + value);
  }
  return result;
}

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> result;
  for (auto& s : strings) result.push_back(s.data());
  result.push_back(nullptr);
  return result;
}

// Finds `program` as execvp would, before forking, so a typo is an error of
// launch() rather than N failing ranks.
absl::StatusOr<std::string> resolve_program(const std::string& program) {
  if (program.find('/') != std::string::npos) {
    if (access(program.c_str(), X_OK) != 0) {
      return absl::NotFoundError(
          absl::StrCat("program '", program, "' is not executable: ", errno_text(errno)));
    }
    return program;
  }
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  for (absl::string_view dir : absl::StrSplit(dirs, ':')) {
    std::string candidate = absl::StrCat(dir.empty() ? "." : dir, "/", program);
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return absl::NotFoundError(absl::StrCat("program '", program, "' was not found in PATH=", dirs));
}

// Reads what is available on `fd`, emits complete lines (the last non-empty
// one also to `last_line`, when given); returns false at EOF.
bool drain(const LaunchOptions& options, int rank, bool is_stderr, int fd, std::string& partial,
           std::string* last_line) {
  char buffer[4096];
  ssize_t got = read(fd, buffer, sizeof buffer);
  if (got < 0 && (errno == EINTR || errno == EAGAIN)) return true;
  auto emit_line = [&](const std::string& line) {
    options.on_line(rank, is_stderr, line);
    if (last_line != nullptr && !line.empty()) *last_line = line;
  };
  if (got <= 0) {
    if (!partial.empty()) emit_line(partial);
    partial.clear();
    return false;
  }
  partial.append(buffer, static_cast<size_t>(got));
  size_t newline;
  while ((newline = partial.find('\n')) != std::string::npos) {
    emit_line(partial.substr(0, newline));
    partial.erase(0, newline + 1);
  }
  return true;
}

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    return absl::StrCat("was killed by signal ", WTERMSIG(status), " (",
                        strsignal(WTERMSIG(status)), ")");
  }
  return absl::StrCat("exited with status ", WEXITSTATUS(status));
}

int shell_status(int status) {
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

}  // namespace

absl::StatusOr<int> pick_free_port() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("pick_free_port: socket(): ", errno_text(errno)));
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("pick_free_port: cannot bind 127.0.0.1:0: ", errno_text(err)));
  }
  close(fd);
  return static_cast<int>(ntohs(addr.sin_port));
}

namespace {

// The environment of every local rank of one attempt, as execve takes it.
// Every string the children need is built before forking: between fork and
// exec only async-signal-safe calls are allowed (the parent may have threads).
struct RankEnvironments {
  std::vector<std::vector<std::string>> strings;
  std::vector<std::vector<char*>> pointers;  // into `strings`
  // The CPUs each local rank is bound to; none: not bound.
  std::vector<std::optional<cpu_set_t>> cpus;
};

RankEnvironments rank_environments(const LaunchOptions& options, const host::ThreadLayout& layout,
                                   int port, int attempt) {
  const int nproc = options.nproc_per_node;
  const int world = nproc * options.nnodes;
  RankEnvironments envs;
  envs.strings.resize(nproc);
  envs.pointers.resize(nproc);
  envs.cpus.resize(nproc);
  for (int local = 0; local < nproc; ++local) {
    std::map<std::string, std::string> vars = options.env;
    const int rank = options.node_rank * nproc + local;
    vars["RANK"] = std::to_string(rank);
    vars["WORLD_SIZE"] = std::to_string(world);
    vars["LOCAL_RANK"] = std::to_string(local);
    vars["LOCAL_WORLD_SIZE"] = std::to_string(nproc);
    vars["GROUP_RANK"] = std::to_string(options.node_rank);
    vars["MASTER_ADDR"] = options.master_addr;
    vars["MASTER_PORT"] = std::to_string(port);
    vars["OMP_NUM_THREADS"] = std::to_string(layout.threads_per_rank);
    vars[kRestartCountVariable] = std::to_string(attempt);
    vars[kMaxRestartsVariable] = std::to_string(options.max_restarts);
    if (options.collective_timeout.count() > 0) {
      vars[kCollectiveTimeoutVariable] = std::to_string(options.collective_timeout.count());
    }
    const std::vector<int> cpus =
        options.bind_cores ? host::CpusOfRank(layout, local) : std::vector<int>();
    if (!cpus.empty()) {
      cpu_set_t& set = envs.cpus[local].emplace();
      CPU_ZERO(&set);
      for (int cpu : cpus) CPU_SET(cpu, &set);
    }
    envs.strings[local] = child_environment(vars, options.unset_env);
    envs.pointers[local] = c_strings(envs.strings[local]);
  }
  return envs;
}

// In the forked child: becomes the rank (execve) or exits 127.
// Async-signal-safe calls only.
[[noreturn]] void exec_rank(pid_t launcher_pid, const int out_pipe[2], const int err_pipe[2],
                            const std::string& program, char* const* argv, char* const* envp,
                            const cpu_set_t* cpus) {
  setpgid(0, 0);  // its own process group, killed as a whole
  // Unbound if it fails (a cpuset changed since the plan): slower, not wrong.
  if (cpus != nullptr) sched_setaffinity(0, sizeof(cpu_set_t), cpus);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != launcher_pid) _exit(127);  // launcher already gone
  dup2(out_pipe[1], STDOUT_FILENO);
  dup2(err_pipe[1], STDERR_FILENO);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  // A rank writing to a dead peer's socket gets EPIPE, an error its
  // collective reports, instead of dying of SIGPIPE and being blamed
  // for the peer's failure (as Python ranks: the interpreter ignores
  // SIGPIPE too). An ignored disposition survives execve.
  struct sigaction ignore_pipe {};
  ignore_pipe.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &ignore_pipe, nullptr);
  execve(program.c_str(), argv, envp);
  const char message[] = "launcher::launch: execve failed\n";
  ssize_t ignored = write(STDERR_FILENO, message, sizeof message - 1);
  (void)ignored;
  _exit(127);
}

// The local ranks of one attempt: spawned, their output forwarded, reaped,
// and ended together when one fails, another node fails, the deadline
// passes or the launcher is told to stop (see launch()).
class Attempt {
 public:
  Attempt(const LaunchOptions& options, Clock::time_point deadline, const AttemptHooks* hooks)
      : options_(options),
        deadline_(deadline),
        hooks_(hooks),
        children_(options.nproc_per_node),
        ended_by_us_(options.nproc_per_node, false) {}

  // Forks and execs every local rank. A pipe or fork failure ends the ranks
  // already started; finish() returns it.
  void spawn(const std::string& program, const std::vector<char*>& argv,
             const RankEnvironments& envs) {
    // Grandchildren whose rank dies are re-parented to us, so they can be
    // reaped rather than left to init.
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    const pid_t launcher_pid = getpid();
    const int nproc = options_.nproc_per_node;
    for (int local = 0; local < nproc; ++local) {
      Child& child = children_[local];
      child.rank = options_.node_rank * nproc + local;
      int out_pipe[2], err_pipe[2];
      if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) {
        spawn_error_ = absl::ResourceExhaustedError(absl::StrCat("pipe(): ", errno_text(errno)));
        break;
      }
      const pid_t pid = fork();
      if (pid < 0) {
        spawn_error_ = absl::ResourceExhaustedError(absl::StrCat("fork(): ", errno_text(errno)));
        close(out_pipe[0]);
        close(out_pipe[1]);
        close(err_pipe[0]);
        close(err_pipe[1]);
        break;
      }
      if (pid == 0) {
        exec_rank(launcher_pid, out_pipe, err_pipe, program, argv.data(),
                  envs.pointers[local].data(), envs.cpus[local] ? &*envs.cpus[local] : nullptr);
      }
      setpgid(pid, pid);  // also from the parent, to win the race with kill()
      close(out_pipe[1]);
      close(err_pipe[1]);
      child.pid = pid;
      child.out_fd = out_pipe[0];
      child.err_fd = err_pipe[0];
      fcntl(child.out_fd, F_SETFL, O_NONBLOCK);
      fcntl(child.err_fd, F_SETFL, O_NONBLOCK);
    }
    if (!spawn_error_.ok()) {
      ending_ = true;
      term_sent_ = Clock::now();
      signal_all(SIGTERM);
    }
  }

  // Forwards output and reaps until every rank is reaped and its pipes are
  // closed (or, once ending, the kill grace has passed); ends the ranks
  // when one fails, another node fails, the deadline passes or a stop
  // signal arrives.
  void supervise() {
    while (true) {
      forward_output();
      reap();
      if (finished()) break;
      // Another node failed (multi-node restarts).
      if (!ending_ && hooks_ != nullptr) {
        if (auto remote = hooks_->poll()) {
          result_.exit_code = remote->first;
          result_.summary = absl::StrCat(remote->second, "; ended this node's ranks");
          end_ranks();
        }
      }
      // Timeout and external stop.
      if (!ending_ && Clock::now() > deadline_) {
        result_.timed_out = true;
        result_.exit_code = 124;
        result_.summary = absl::StrCat(describe_hung(), "timeout: ranks still running after ",
                                       options_.timeout.count(), " ms were ended");
        end_ranks();
      }
      if (!ending_ && options_.stop_signal != nullptr && options_.stop_signal->load() != 0) {
        const int sig = options_.stop_signal->load();
        result_.exit_code = 128 + sig;
        result_.summary = absl::StrCat("launcher received signal ", sig, " (", strsignal(sig),
                                       "); ended the ranks");
        end_ranks();
      }
      if (ending_ && !killed_ && Clock::now() - term_sent_ > options_.kill_grace) {
        signal_all(SIGKILL);
        killed_ = true;
      }
    }
  }

  // Closes the pipes, reaps what is left, and returns the attempt's result
  // (or the error that stopped spawning).
  absl::StatusOr<LaunchResult> finish() {
    for (auto& c : children_) {
      if (c.out_fd >= 0) close(c.out_fd);
      if (c.err_fd >= 0) close(c.err_fd);
    }
    // Reap re-parented grandchildren (killed with their rank's process
    // group), so none lingers even as a zombie; bounded, since the caller may
    // have unrelated children of its own.
    const auto reap_deadline = Clock::now() + std::chrono::milliseconds(500);
    while (Clock::now() < reap_deadline) {
      const pid_t reaped = waitpid(-1, nullptr, WNOHANG);
      if (reaped < 0) break;  // ECHILD: none left
      if (reaped == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!spawn_error_.ok()) return spawn_error_;

    for (size_t i = 0; i < children_.size(); ++i) {
      const Child& child = children_[i];
      RankExit exit;
      exit.rank = child.rank;
      exit.pid = child.pid;
      if (WIFEXITED(child.status)) exit.exit_code = WEXITSTATUS(child.status);
      if (WIFSIGNALED(child.status)) exit.term_signal = WTERMSIG(child.status);
      exit.ended_by_launcher = ended_by_us_[i];
      result_.ranks.push_back(exit);
    }
    return result_;
  }

 private:
  // Forwards what the ranks wrote, waiting up to 50 ms for it.
  void forward_output() {
    std::vector<pollfd> fds;
    std::vector<std::pair<int, bool>> owners;  // (child index, is_stderr)
    for (size_t i = 0; i < children_.size(); ++i) {
      if (children_[i].out_fd >= 0) {
        fds.push_back({children_[i].out_fd, POLLIN, 0});
        owners.push_back({static_cast<int>(i), false});
      }
      if (children_[i].err_fd >= 0) {
        fds.push_back({children_[i].err_fd, POLLIN, 0});
        owners.push_back({static_cast<int>(i), true});
      }
    }
    if (fds.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      return;
    }
    poll(fds.data(), fds.size(), 50);
    for (size_t k = 0; k < fds.size(); ++k) {
      if (fds[k].revents == 0) continue;
      Child& c = children_[owners[k].first];
      const bool is_err = owners[k].second;
      int& fd = is_err ? c.err_fd : c.out_fd;
      if (!drain(options_, c.rank, is_err, fd, is_err ? c.err_partial : c.out_partial,
                 is_err ? &c.last_err_line : nullptr)) {
        close(fd);
        fd = -1;
      }
    }
  }

  // Collects every rank that stopped, continued or ended since last asked.
  void reap() {
    int status = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG | WUNTRACED | WCONTINUED)) > 0) {
      for (Child& c : children_) {
        if (c.pid != pid) continue;
        if (WIFSTOPPED(status)) {
          c.stop_signal = WSTOPSIG(status);
          c.stopped_at = Clock::now();
          options_.on_event(absl::StrCat("rank ", c.rank, " (pid ", c.pid,
                                         ") was stopped by signal ", c.stop_signal, " (",
                                         strsignal(c.stop_signal), ")"));
          if (ending_) kill(-c.pid, SIGKILL);
          continue;
        }
        if (WIFCONTINUED(status)) {
          c.stop_signal = 0;
          continue;
        }
        c.reaped = true;
        c.status = status;
        const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        if (failed && !ending_) on_first_failure(c);
        // The rank's own process group may hold grandchildren: end them.
        kill(-c.pid, SIGKILL);
      }
    }
  }

  // The first rank of this attempt to fail: the result says why, and the
  // other ranks are ended.
  void on_first_failure(Child& c) {
    // What the rank said last is usually why it failed: read what is
    // still in its stderr pipe before quoting it.
    pollfd pending{c.err_fd, POLLIN, 0};
    while (c.err_fd >= 0 && poll(&pending, 1, 0) > 0) {
      if (!drain(options_, c.rank, true, c.err_fd, c.err_partial, &c.last_err_line)) {
        close(c.err_fd);
        c.err_fd = -1;
      }
    }
    result_.first_failed_rank = c.rank;
    result_.exit_code = shell_status(c.status);
    const std::string hung = describe_hung();
    result_.summary = absl::StrCat(hung, "rank ", c.rank, " (pid ", c.pid, ") ",
                                   describe_status(c.status), " first");
    if (!hung.empty()) absl::StrAppend(&result_.summary, ", waiting for it");
    if (!c.last_err_line.empty()) {
      absl::StrAppend(&result_.summary, " (its last error line: \"", c.last_err_line, "\")");
    }
    absl::StrAppend(&result_.summary, "; ended the other ranks");
    if (hooks_ != nullptr) hooks_->on_failure(result_.exit_code, result_.summary);
    end_ranks();
  }

  // True once every rank is reaped and its pipes are closed, or every rank
  // is reaped and the kill grace after ending has passed. Starts that grace
  // when the last rank is reaped: grandchildren may keep the pipes open.
  bool finished() {
    bool all_reaped = true;
    for (auto& c : children_) all_reaped = all_reaped && (c.pid < 0 || c.reaped);
    bool all_closed = true;
    for (auto& c : children_) all_closed = all_closed && c.out_fd < 0 && c.err_fd < 0;
    if (all_reaped &&
        (all_closed || (ending_ && Clock::now() - term_sent_ > options_.kill_grace))) {
      return true;
    }
    if (all_reaped && !ending_) {
      // Grandchildren may keep the pipes open; give them a moment, then stop.
      ending_ = true;
      term_sent_ = Clock::now();
    }
    return false;
  }

  // Sends SIGTERM to every rank still running (SIGKILL after the grace, in
  // supervise()), marking them as ended by the launcher.
  void end_ranks() {
    ending_ = true;
    term_sent_ = Clock::now();
    for (size_t j = 0; j < children_.size(); ++j) {
      if (!children_[j].reaped) ended_by_us_[j] = true;
    }
    signal_all(SIGTERM);
  }

  void signal_all(int signal) {
    for (auto& c : children_) {
      // A stopped process acts on SIGTERM only once continued: kill it.
      if (c.pid > 0 && !c.reaped) kill(-c.pid, c.stop_signal != 0 ? SIGKILL : signal);
    }
  }

  // "rank 1 (pid 123) hung (stopped by signal 19 (Stopped (signal)) 5.1 s
  // before and never continued); " for each rank stopped now, or "".
  std::string describe_hung() {
    std::string text;
    for (const auto& c : children_) {
      if (c.reaped || c.stop_signal == 0) continue;
      result_.hung_ranks.push_back(c.rank);
      const auto tenths =
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - c.stopped_at)
              .count() /
          100;
      absl::StrAppend(&text, "rank ", c.rank, " (pid ", c.pid, ") hung (stopped by signal ",
                      c.stop_signal, " (", strsignal(c.stop_signal), ") ", tenths / 10, ".",
                      tenths % 10, " s before and never continued); ");
    }
    return text;
  }

  const LaunchOptions& options_;
  const Clock::time_point deadline_;
  const AttemptHooks* const hooks_;
  std::vector<Child> children_;
  std::vector<bool> ended_by_us_;
  absl::Status spawn_error_;
  LaunchResult result_;
  bool ending_ = false;  // SIGTERM sent to the survivors
  Clock::time_point term_sent_;
  bool killed_ = false;
};

// One attempt: starts the local ranks, forwards their output and waits for
// them (see launch()). `deadline` bounds the whole job (Clock::time_point::max()
// without --timeout); `hooks` (multi-node restarts only, else null) learn of
// this node's first failure and say when another node failed.
absl::StatusOr<LaunchResult> run_attempt(const LaunchOptions& options, const std::string& program,
                                         const host::ThreadLayout& layout, int port, int attempt,
                                         Clock::time_point deadline, const AttemptHooks* hooks) {
  std::vector<std::string> argv_strings = options.command;
  std::vector<char*> argv = c_strings(argv_strings);
  RankEnvironments envs = rank_environments(options, layout, port, attempt);
  Attempt ranks(options, deadline, hooks);
  ranks.spawn(program, argv, envs);
  ranks.supervise();
  return ranks.finish();
}

}  // namespace

absl::StatusOr<LaunchResult> launch(const LaunchOptions& given) {
  // Unset callbacks print; everything below calls them.
  LaunchOptions options = given;
  if (!options.on_line) {
    options.on_line = [](int rank, bool is_stderr, const std::string& line) {
      const std::string text = absl::StrCat("[rank ", rank, "] ", line, "\n");
      FILE* stream = is_stderr ? stderr : stdout;
      std::fwrite(text.data(), 1, text.size(), stream);
      std::fflush(stream);
    };
  }
  if (!options.on_event) {
    options.on_event = [](const std::string& message) {
      std::fprintf(stderr, "launch: %s\n", message.c_str());
      std::fflush(stderr);
    };
  }
  if (options.nproc_per_node <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nproc=", options.nproc_per_node, ": expected a positive integer"));
  }
  if (options.nnodes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nnodes=", options.nnodes, ": expected a positive integer"));
  }
  if (options.node_rank < 0 || options.node_rank >= options.nnodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--node-rank=", options.node_rank,
                     ": expected an integer in [0, --nnodes=", options.nnodes, ")"));
  }
  if (options.master_port < 0 || options.master_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--master-port=", options.master_port,
                     ": expected a TCP port in [1, 65535] (or 0 to pick a free one)"));
  }
  if (options.master_port == 0 && options.nnodes > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--master-port is unset with --nnodes=", options.nnodes,
                     ": expected an explicit port every node agrees on"));
  }
  if (options.command.empty()) {
    return absl::InvalidArgumentError("no program to launch: expected `-- PROGRAM [ARGS...]`");
  }
  if (options.max_restarts < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-restarts=", options.max_restarts, ": expected an integer >= 0"));
  }
  auto program = resolve_program(options.command[0]);
  if (!program.ok()) return program.status();
  auto layout = thread_layout(options);
  if (!layout.ok()) return layout.status();
  const Clock::time_point deadline =
      options.timeout.count() > 0 ? Clock::now() + options.timeout : Clock::time_point::max();
  if (options.nnodes > 1 && options.max_restarts > 0) {
    return internal::launch_elastic_nodes(
        options,
        [&](int port, int attempt, const AttemptHooks& hooks) {
          return run_attempt(options, *program, *layout, port, attempt, deadline, &hooks);
        },
        deadline);
  }
  std::vector<std::string> causes;
  for (int attempt = 0;; ++attempt) {
    int port = options.master_port;
    if (port == 0) {  // a fresh rendezvous for every attempt
      auto picked = pick_free_port();
      if (!picked.ok()) return picked.status();
      port = *picked;
    }
    auto result = run_attempt(options, *program, *layout, port, attempt, deadline, nullptr);
    if (!result.ok()) return result.status();
    result->restart_causes = causes;
    const bool stopped = options.stop_signal != nullptr && options.stop_signal->load() != 0;
    if (result->exit_code == 0 || result->timed_out || stopped) return result;
    if (attempt >= options.max_restarts) {
      if (options.max_restarts > 0) {
        absl::StrAppend(&result->summary,
                        "; no restart left (--max-restarts=", options.max_restarts, " used)");
      }
      return result;
    }
    causes.push_back(result->summary);
    options.on_event(
        absl::StrCat("restart ", attempt + 1, " of ", options.max_restarts, ": ", result->summary));
  }
}

absl::StatusOr<host::ThreadLayout> thread_layout(const LaunchOptions& options) {
  const char* omp = std::getenv("OMP_NUM_THREADS");
  for (const std::string& name : options.unset_env) {
    if (name == "OMP_NUM_THREADS") omp = nullptr;
  }
  if (auto it = options.env.find("OMP_NUM_THREADS"); it != options.env.end()) {
    omp = it->second.c_str();
  }
  return host::PlanThreadLayout(options.nproc_per_node, options.threads_per_rank, omp);
}

}  // namespace launcher
