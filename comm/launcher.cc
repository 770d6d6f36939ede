#include "comm/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <algorithm>
#include <thread>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

extern char** environ;

namespace comm {
namespace {

using Clock = std::chrono::steady_clock;

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
std::vector<std::string> child_environment(
    const std::map<std::string, std::string>& overrides,
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
      return absl::NotFoundError(absl::StrCat(
          "program '", program, "' is not executable: ", errno_text(errno)));
    }
    return program;
  }
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    std::string dir = dirs.substr(start, end - start);
    if (dir.empty()) dir = ".";
    std::string candidate = dir + "/" + program;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  return absl::NotFoundError(
      absl::StrCat("program '", program, "' was not found in PATH=", dirs));
}

void emit(const LaunchOptions& options, int rank, bool is_stderr,
          const std::string& line) {
  if (options.on_line) {
    options.on_line(rank, is_stderr, line);
    return;
  }
  std::string text = absl::StrCat("[rank ", rank, "] ", line, "\n");
  FILE* stream = is_stderr ? stderr : stdout;
  std::fwrite(text.data(), 1, text.size(), stream);
  std::fflush(stream);
}

// Reads what is available on `fd`, emits complete lines (the last non-empty
// one also to `last_line`, when given); returns false at EOF.
bool drain(const LaunchOptions& options, int rank, bool is_stderr, int fd,
           std::string& partial, std::string* last_line) {
  char buffer[4096];
  ssize_t got = read(fd, buffer, sizeof buffer);
  if (got < 0 && (errno == EINTR || errno == EAGAIN)) return true;
  auto emit_line = [&](const std::string& line) {
    emit(options, rank, is_stderr, line);
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

void event(const LaunchOptions& options, const std::string& message) {
  if (options.on_event) {
    options.on_event(message);
    return;
  }
  std::fprintf(stderr, "launch: %s\n", message.c_str());
  std::fflush(stderr);
}

int shell_status(int status) {
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

}  // namespace

absl::StatusOr<int> pick_free_port() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("pick_free_port: socket(): ", errno_text(errno)));
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
    return absl::UnavailableError(absl::StrCat(
        "pick_free_port: cannot bind 127.0.0.1:0: ", errno_text(err)));
  }
  close(fd);
  return static_cast<int>(ntohs(addr.sin_port));
}

namespace {

// Hooks an attempt runs with on a multi-node elastic job: `poll` is asked
// every loop whether another node failed (exit code and cause), and
// `on_failure` is told of this node's first failure at once.
struct AttemptHooks {
  std::function<std::optional<std::pair<int, std::string>>()> poll;
  std::function<void(int exit_code, const std::string& summary)> on_failure;
};

// Multi-node restarts: the launchers agree on every attempt through node
// 0's launcher, which listens on master_addr:master_port (the ranks then get
// a fresh port node 0 picks for each attempt). One TCP connection per node,
// one message per line:
//   node k -> 0  "NODE k"               once, after connecting
//   node k -> 0  "JOIN r"               ready for attempt r
//   0 -> all     "GO r PORT"            every node joined: start, ranks use PORT
//   node k -> 0  "FAIL r CODE SUMMARY"  a local rank failed (the first failure)
//   0 -> all     "END r CODE CAUSE"     some node failed: end your ranks
//   node k -> 0  "OVER r"               every local rank of attempt r is gone
//   0 -> all     "NEXT r CAUSE" | "FINISH" | "ABORT CODE CAUSE"
//                                        the verdict once every node is over
// A launcher that disappears closes its connection: node 0 counts it as a
// failed node (and cannot restart without it), the others as the end of
// the job.
// Limits: a line is at most kMaxLauncherLine bytes (ours are cut to fit); a
// longer one, or a line that is not one of the messages above, is an error
// naming the peer and what it sent, treated as the loss of that peer. Every
// wait has a deadline: connecting and each attempt's start (the job's
// --timeout, at most 2 minutes), a new connection's introduction (10 s), a
// peer reading what we send (10 s), the end of an attempt (--timeout).
constexpr size_t kMaxLauncherLine = 64 * 1024;
constexpr auto kLauncherSendTimeout = std::chrono::seconds(10);
constexpr auto kLauncherHelloTimeout = std::chrono::seconds(10);

// A peer's line for messages: escaped, cut to 200 bytes.
std::string quote_line(const std::string& line) {
  constexpr size_t kShown = 200;
  std::string shown = absl::CHexEscape(line.substr(0, kShown));
  if (line.size() > kShown) absl::StrAppend(&shown, "... (", line.size(), " bytes)");
  return absl::StrCat("'", shown, "'");
}

std::string peer_address(int fd) {
  sockaddr_in addr{};
  socklen_t len = sizeof addr;
  char text[INET_ADDRSTRLEN] = "?";
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0 ||
      inet_ntop(AF_INET, &addr.sin_addr, text, sizeof text) == nullptr) {
    return "an unknown address";
  }
  return absl::StrCat(text, ":", ntohs(addr.sin_port));
}

// A TCP connection to `addr` within `deadline` (connect(2) alone may wait
// for minutes on an address that drops packets): the fd, or -1 and *err.
int connect_within(const sockaddr_in& addr, Clock::time_point deadline, int* err) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0) return fd;
  if (errno != EINPROGRESS) {
    *err = errno;
    close(fd);
    return -1;
  }
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - Clock::now());
    pollfd p{fd, POLLOUT, 0};
    const int ready = poll(&p, 1, static_cast<int>(std::max<int64_t>(0, left.count())));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) {
      *err = ETIMEDOUT;
      close(fd);
      return -1;
    }
    break;
  }
  int so_error = 0;
  socklen_t len = sizeof so_error;
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len) != 0) so_error = errno;
  if (so_error != 0) {
    *err = so_error;
    close(fd);
    return -1;
  }
  return fd;
}

class Rendezvous {
 public:
  static absl::StatusOr<std::unique_ptr<Rendezvous>> Open(const LaunchOptions& options,
                                                          Clock::time_point deadline) {
    auto r = std::unique_ptr<Rendezvous>(new Rendezvous(options));
    const std::string where =
        absl::StrCat(options.master_addr, ":", options.master_port);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(options.master_port));
    if (inet_pton(AF_INET, options.master_addr.c_str(), &addr.sin_addr) != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--master-addr=", options.master_addr,
          ": expected an IPv4 address for the launchers' rendezvous (--max-restarts)"));
    }
    if (options.node_rank == 0) {
      const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      const int one = 1;
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
          listen(fd, options.nnodes) != 0) {
        const int err = errno;
        if (fd >= 0) close(fd);
        return absl::UnavailableError(absl::StrCat(
            "--master-port: node 0's launcher cannot listen on ", where,
            " for the other nodes: ", errno_text(err)));
      }
      r->listen_fd_ = fd;
      r->peers_.resize(static_cast<size_t>(options.nnodes));
      int joined = 1;
      std::string rejected;  // the last connection turned away, and why
      while (joined < options.nnodes) {
        if (Clock::now() > deadline) {
          return absl::DeadlineExceededError(absl::StrCat(
              "only ", joined, " of --nnodes=", options.nnodes, " launchers reached ", where,
              rejected.empty() ? "" : absl::StrCat("; turned away: ", rejected)));
        }
        pollfd p{fd, POLLIN, 0};
        if (poll(&p, 1, 100) <= 0) continue;
        const int peer = accept4(fd, nullptr, nullptr, SOCK_CLOEXEC);
        if (peer < 0) continue;
        Peer incoming;
        incoming.fd = peer;
        incoming.address = peer_address(peer);
        std::string line;
        bool complete = false;
        const auto hello_deadline = std::min(deadline, Clock::now() + kLauncherHelloTimeout);
        while (!incoming.closed && !(complete = r->NextLine(incoming, &line)) &&
               Clock::now() < hello_deadline) {
          r->Read(incoming, 100);
        }
        std::vector<std::string> words = absl::StrSplit(line, ' ');
        int node = -1;
        const bool hello = complete && words.size() == 2 && words[0] == "NODE" &&
                           absl::SimpleAtoi(words[1], &node) && node > 0 &&
                           node < options.nnodes;
        if (hello && r->peers_[node].fd < 0) {
          incoming.node = node;
          r->peers_[node] = incoming;
          ++joined;
          continue;
        }
        // Not one of ours (a port scanner, a stray client), or a node twice:
        // said and turned away, so it cannot stop the real nodes joining.
        if (!incoming.error.empty()) {
          rejected = absl::StrCat("a connection from ", incoming.address, " ", incoming.error);
        } else if (!complete) {
          rejected = absl::StrCat(
              "a connection from ", incoming.address,
              incoming.closed ? " closed" : " was silent",
              " before introducing itself (expected 'NODE k', k in [1, --nnodes=",
              options.nnodes, "))");
        } else if (hello) {
          rejected = absl::StrCat("a connection from ", incoming.address,
                                  " said it is node ", node, ", which has already joined");
        } else {
          rejected = absl::StrCat("a connection from ", incoming.address, " sent ",
                                  quote_line(line), ": expected 'NODE k', k in [1, --nnodes=",
                                  options.nnodes, ")");
        }
        event(options, absl::StrCat("launcher rendezvous at ", where, ": turned away ",
                                    rejected));
        close(peer);
      }
    } else {
      while (true) {
        int err = 0;
        const int fd = connect_within(addr, deadline, &err);
        if (fd >= 0) {
          Peer master;
          master.fd = fd;
          master.node = 0;
          master.address = where;
          r->peers_.push_back(master);
          break;
        }
        if (Clock::now() > deadline) {
          return absl::DeadlineExceededError(absl::StrCat(
              "node ", options.node_rank, " could not reach node 0's launcher at ", where,
              ": ", errno_text(err)));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      if (!r->Send(r->peers_[0], absl::StrCat("NODE ", options.node_rank))) {
        return absl::UnavailableError(absl::StrCat("lost node 0's launcher at ", where));
      }
    }
    return r;
  }

  ~Rendezvous() {
    for (auto& p : peers_) {
      if (p.fd >= 0) close(p.fd);
    }
    if (listen_fd_ >= 0) close(listen_fd_);
  }

  // Agrees on attempt `round` with every node; returns the ranks' port.
  absl::StatusOr<int> Join(int round, Clock::time_point deadline) {
    if (!is_master()) {
      if (!Send(peers_[0], absl::StrCat("JOIN ", round))) return Lost();
      while (true) {
        if (Clock::now() > deadline) return Late("starting an attempt");
        const absl::Status status = Pump(50);
        for (auto it = inbox_.begin(); it != inbox_.end(); ++it) {
          int r = -1, port = 0;
          if (Parse2(*it, "GO", &r, &port) && r == round) {
            inbox_.erase(inbox_.begin(), it + 1);
            return port;
          }
        }
        if (!status.ok()) return status;
      }
    }
    while (true) {
      int ready = 1;
      for (size_t k = 1; k < peers_.size(); ++k) {
        if (peers_[k].joined == round) ++ready;
      }
      if (ready == options_.nnodes) break;
      for (size_t k = 1; k < peers_.size(); ++k) {
        if (peers_[k].closed && !peers_[k].error.empty()) {
          return absl::DataLossError(absl::StrCat(Describe(peers_[k]), " ",
                                                  peers_[k].error, " before attempt ", round));
        }
        if (peers_[k].closed) {
          return absl::UnavailableError(absl::StrCat(
              "node ", k, "'s launcher disconnected before attempt ", round));
        }
      }
      if (Clock::now() > deadline) return Late("starting an attempt");
      (void)Pump(50);
    }
    auto port = pick_free_port();
    if (!port.ok()) return port.status();
    Broadcast(absl::StrCat("GO ", round, " ", *port));
    return *port;
  }

  // Non-blocking: whether some node failed during attempt `round`.
  std::optional<std::pair<int, std::string>> Poll(int round) {
    (void)Pump(0);
    if (failure_round_ == round) return failure_;
    return std::nullopt;
  }

  // This node's first failure of attempt `round`.
  void ReportFailure(int round, int code, const std::string& summary) {
    if (is_master()) {
      Fail(round, code, absl::StrCat("node 0: ", summary));
    } else {
      Send(peers_[0], absl::StrCat("FAIL ", round, " ", code, " ", summary));
    }
  }

  struct Verdict {
    bool restart = false;
    bool finish = false;
    int exit_code = 0;
    std::string cause;
  };

  // Once this node's ranks of attempt `round` are gone: waits for every
  // node, then the verdict (node 0 decides: restart while restarts remain).
  absl::StatusOr<Verdict> Finish(int round, Clock::time_point deadline) {
    if (!is_master()) {
      if (!Send(peers_[0], absl::StrCat("OVER ", round))) return Lost();
      while (true) {
        if (Clock::now() > deadline) return Late("the end of an attempt");
        const absl::Status status = Pump(50);
        for (auto it = inbox_.begin(); it != inbox_.end(); ++it) {
          const std::string line = *it;
          Verdict v;
          int r = -1;
          if (absl::StartsWith(line, "FINISH")) {
            v.finish = true;
          } else if (Parse1(line, "NEXT", &r, &v.cause) && r == round) {
            v.restart = true;
          } else if (!Parse1(line, "ABORT", &v.exit_code, &v.cause)) {
            continue;
          }
          inbox_.erase(inbox_.begin(), it + 1);
          return v;
        }
        inbox_.clear();
        if (!status.ok()) return status;
      }
    }
    while (true) {
      int over = 1;
      for (size_t k = 1; k < peers_.size(); ++k) {
        if (peers_[k].over == round || peers_[k].closed) ++over;
      }
      if (over == options_.nnodes) break;
      if (Clock::now() > deadline) return Late("the end of an attempt");
      (void)Pump(50);
    }
    Verdict v;
    if (failure_round_ != round) {
      v.finish = true;
      Broadcast("FINISH");
      return v;
    }
    v.exit_code = failure_.first;
    v.cause = failure_.second;
    bool lost_node = false;
    for (size_t k = 1; k < peers_.size(); ++k) lost_node = lost_node || peers_[k].closed;
    if (round < options_.max_restarts && !lost_node) {
      v.restart = true;
      Broadcast(absl::StrCat("NEXT ", round, " ", v.cause));
    } else {
      if (lost_node) absl::StrAppend(&v.cause, "; cannot restart without that node");
      Broadcast(absl::StrCat("ABORT ", v.exit_code, " ", v.cause));
    }
    return v;
  }

 private:
  struct Peer {
    int fd = -1;
    int node = -1;
    std::string partial;
    bool closed = false;
    std::string address;  // ip:port, for messages
    std::string error;    // why we gave up on it, when it broke the protocol
    int joined = -1;  // node 0: the last attempt the node joined
    int over = -1;    // node 0: the last attempt whose ranks are gone there
  };

  explicit Rendezvous(const LaunchOptions& options) : options_(options) {}

  bool is_master() const { return options_.node_rank == 0; }

  absl::Status Lost() const {
    return absl::UnavailableError(absl::StrCat(
        "lost the connection to node 0's launcher at ", options_.master_addr, ":",
        options_.master_port, " (it ended or died)"));
  }

  std::string Describe(const Peer& peer) const {
    return absl::StrCat("node ", peer.node, "'s launcher at ", peer.address);
  }

  // Gives up on `peer` for breaking the protocol; `what` completes
  // "<peer> ...".
  void ProtocolError(Peer& peer, const std::string& what) {
    if (peer.error.empty()) peer.error = what;
    peer.closed = true;
  }

  bool Send(Peer& peer, const std::string& line) {
    if (peer.closed) return false;
    std::string text = line.substr(0, kMaxLauncherLine);
    for (char& c : text) {
      if (c == '\n') c = ' ';
    }
    text.push_back('\n');
    size_t sent = 0;
    const auto deadline = Clock::now() + kLauncherSendTimeout;
    while (sent < text.size()) {
      const ssize_t n = send(peer.fd, text.data() + sent, text.size() - sent,
                             MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        pollfd p{peer.fd, POLLOUT, 0};
        if (left.count() <= 0 || poll(&p, 1, static_cast<int>(left.count())) == 0) {
          ProtocolError(peer, absl::StrCat("did not read what was sent to it for ",
                                           std::chrono::duration_cast<std::chrono::seconds>(
                                               kLauncherSendTimeout).count(),
                                           " s"));
          return false;
        }
        continue;
      }
      if (n <= 0) {
        peer.closed = true;
        return false;
      }
      sent += static_cast<size_t>(n);
    }
    return true;
  }

  void Broadcast(const std::string& line) {
    for (size_t k = 1; k < peers_.size(); ++k) Send(peers_[k], line);
  }

  // Reads what `peer` has within `timeout_ms`.
  void Read(Peer& peer, int timeout_ms) {
    if (peer.closed) return;
    pollfd p{peer.fd, POLLIN, 0};
    if (poll(&p, 1, timeout_ms) <= 0) return;
    char buffer[4096];
    const ssize_t n = recv(peer.fd, buffer, sizeof buffer, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) {
      peer.closed = true;
      return;
    }
    peer.partial.append(buffer, static_cast<size_t>(n));
    const size_t newline = peer.partial.find('\n');
    const size_t line = newline == std::string::npos ? peer.partial.size() : newline;
    if (line > kMaxLauncherLine) {
      ProtocolError(peer, absl::StrCat("sent a line of more than ", kMaxLauncherLine,
                                       " bytes (", quote_line(peer.partial.substr(0, 64)),
                                       "...): expected the launchers' short text messages"));
      peer.partial.clear();
    }
  }

  bool NextLine(Peer& peer, std::string* line) {
    const size_t newline = peer.partial.find('\n');
    if (newline == std::string::npos) return false;
    *line = peer.partial.substr(0, newline);
    peer.partial.erase(0, newline + 1);
    return true;
  }

  static bool Parse2(const std::string& line, const char* verb, int* a, int* b) {
    std::vector<std::string> words = absl::StrSplit(line, ' ');
    return words.size() == 3 && words[0] == verb && absl::SimpleAtoi(words[1], a) &&
           absl::SimpleAtoi(words[2], b);
  }
  // "VERB N REST..." -> N, REST.
  static bool Parse1(const std::string& line, const char* verb, int* n, std::string* rest) {
    std::vector<std::string> words = absl::StrSplit(line, absl::MaxSplits(' ', 2));
    if (words.size() < 2 || words[0] != verb || !absl::SimpleAtoi(words[1], n)) return false;
    *rest = words.size() == 3 ? words[2] : "";
    return true;
  }

  // A line node 0 may send besides END (checked where it is read).
  static bool FromMaster(const std::string& line) {
    int r = -1, port = 0, code = 0;
    std::string rest;
    return (Parse2(line, "GO", &r, &port) && port > 0 && port <= 65535) ||
           Parse1(line, "NEXT", &r, &rest) || line == "FINISH" ||
           Parse1(line, "ABORT", &code, &rest);
  }

  void Fail(int round, int code, const std::string& cause) {
    if (failure_round_ == round) return;  // the first failure is the cause
    failure_round_ = round;
    failure_ = {code, cause};
    Broadcast(absl::StrCat("END ", round, " ", code, " ", cause));
  }

  // Reads every connection once (waiting up to `wait_ms` in all), does node
  // 0's bookkeeping and queues the other lines. On nodes > 0, Lost() once
  // node 0 is gone (also recorded as the attempt's failure).
  absl::Status Pump(int wait_ms) {
    const int per_peer = std::max(0, wait_ms / std::max<int>(1, static_cast<int>(peers_.size())));
    for (size_t k = 0; k < peers_.size(); ++k) {
      Peer& peer = peers_[k];
      if (is_master() && k == 0) continue;
      const bool was_closed = peer.closed;
      Read(peer, per_peer);
      std::string line;
      // Lines that arrived before a close still count (a FAIL, then the
      // peer's exit); nothing after a protocol error does.
      while (peer.error.empty() && NextLine(peer, &line)) {
        int r = -1, code = 0;
        std::string rest;
        if (!is_master()) {
          if (Parse1(line, "END", &r, &rest)) {
            std::vector<std::string> parts = absl::StrSplit(rest, absl::MaxSplits(' ', 1));
            if (parts.size() == 2 && absl::SimpleAtoi(parts[0], &code)) {
              failure_round_ = r;
              failure_ = {code, parts[1]};
              continue;
            }
          } else if (FromMaster(line)) {
            inbox_.push_back(line);
            continue;
          }
          ProtocolError(peer, absl::StrCat("sent ", quote_line(line),
                                           ": expected GO r PORT, END r CODE CAUSE, NEXT r "
                                           "CAUSE, FINISH or ABORT CODE CAUSE"));
          break;
        }
        std::vector<std::string> words = absl::StrSplit(line, ' ');
        if (words.size() == 2 && Parse1(line, "JOIN", &r, &rest)) {
          peer.joined = r;
        } else if (words.size() == 2 && Parse1(line, "OVER", &r, &rest)) {
          peer.over = r;
        } else if (Parse1(line, "FAIL", &r, &rest)) {
          std::vector<std::string> parts = absl::StrSplit(rest, absl::MaxSplits(' ', 1));
          if (parts.size() == 2 && absl::SimpleAtoi(parts[0], &code)) {
            Fail(r, code, absl::StrCat("node ", peer.node, ": ", parts[1]));
          } else {
            ProtocolError(peer, absl::StrCat("sent ", quote_line(line),
                                             ": expected FAIL r CODE SUMMARY"));
          }
        } else {
          ProtocolError(peer, absl::StrCat("sent ", quote_line(line),
                                           ": expected JOIN r, OVER r or FAIL r CODE SUMMARY"));
        }
      }
      if (peer.closed && !was_closed && is_master() && current_round_ >= 0) {
        Fail(current_round_, 1,
             peer.error.empty()
                 ? absl::StrCat("node ", peer.node, "'s launcher disconnected")
                 : absl::StrCat(Describe(peer), " ", peer.error));
      }
      if (peer.closed && !is_master()) {
        const std::string why = peer.error.empty()
                                    ? std::string("node 0's launcher disconnected")
                                    : absl::StrCat(Describe(peer), " ", peer.error);
        if (failure_round_ != current_round_) {
          failure_round_ = current_round_;
          failure_ = {1, why};
        }
        if (!peer.error.empty()) return absl::DataLossError(why);
        return Lost();
      }
    }
    return absl::OkStatus();
  }

  absl::Status Late(const char* what) const {
    return absl::DeadlineExceededError(absl::StrCat(
        "node ", options_.node_rank, ": the launchers did not agree on ", what,
        " in time (--timeout, or 2 minutes to gather)"));
  }

 public:
  void set_round(int round) { current_round_ = round; }

 private:
  const LaunchOptions& options_;
  int listen_fd_ = -1;
  std::vector<Peer> peers_;  // node 0: indexed by node (0 unused); others: [node 0]
  std::vector<std::string> inbox_;
  int current_round_ = -1;
  int failure_round_ = -1;
  std::pair<int, std::string> failure_;
};

}  // namespace

// One attempt: starts the local ranks, forwards their output and waits for
// them (see launch()). `deadline` bounds the whole job (Clock::time_point::max()
// without --timeout); `hooks` (multi-node restarts only, else null) learn of
// this node's first failure and say when another node failed.
static absl::StatusOr<LaunchResult> run_attempt(const LaunchOptions& options,
                                                const std::string& program,
                                                const ThreadLayout& layout, int port,
                                                int attempt, Clock::time_point deadline,
                                                const AttemptHooks* hooks) {
  const int nproc = options.nproc_per_node;
  const int world = nproc * options.nnodes;
  std::vector<std::string> argv_strings = options.command;
  std::vector<char*> argv = c_strings(argv_strings);
  // Every string the children need is built here: between fork and exec
  // only async-signal-safe calls are allowed (the parent may have threads).
  std::vector<std::vector<std::string>> env_strings(nproc);
  std::vector<std::vector<char*>> envs(nproc);
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
    env_strings[local] = child_environment(vars, options.unset_env);
    envs[local] = c_strings(env_strings[local]);
  }

  // Grandchildren whose rank dies are re-parented to us, so they can be
  // reaped rather than left to init.
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  const pid_t launcher_pid = getpid();
  std::vector<Child> children(nproc);
  absl::Status spawn_error;
  for (int local = 0; local < nproc; ++local) {
    Child& child = children[local];
    child.rank = options.node_rank * nproc + local;
    int out_pipe[2], err_pipe[2];
    if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) {
      spawn_error = absl::ResourceExhaustedError(
          absl::StrCat("pipe(): ", errno_text(errno)));
      break;
    }
    const pid_t pid = fork();
    if (pid < 0) {
      spawn_error = absl::ResourceExhaustedError(
          absl::StrCat("fork(): ", errno_text(errno)));
      close(out_pipe[0]); close(out_pipe[1]);
      close(err_pipe[0]); close(err_pipe[1]);
      break;
    }
    if (pid == 0) {
      // Child: async-signal-safe calls only.
      setpgid(0, 0);  // its own process group, killed as a whole
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
      execve(program.c_str(), argv.data(), envs[local].data());
      const char message[] = "comm::launch: execve failed\n";
      ssize_t ignored = write(STDERR_FILENO, message, sizeof message - 1);
      (void)ignored;
      _exit(127);
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

  LaunchResult result;
  bool ending = false;  // SIGTERM sent to the survivors
  Clock::time_point term_sent;
  bool killed = false;
  auto end_all = [&](int signal) {
    for (auto& c : children) {
      // A stopped process acts on SIGTERM only once continued: kill it.
      if (c.pid > 0 && !c.reaped) kill(-c.pid, c.stop_signal != 0 ? SIGKILL : signal);
    }
  };
  // "rank 1 (pid 123) hung (stopped by signal 19 (Stopped (signal)) 5.1 s
  // before and never continued); " for each rank stopped now, or "".
  auto describe_hung = [&]() {
    std::string text;
    for (const auto& c : children) {
      if (c.reaped || c.stop_signal == 0) continue;
      result.hung_ranks.push_back(c.rank);
      const auto tenths = std::chrono::duration_cast<std::chrono::milliseconds>(
                              Clock::now() - c.stopped_at).count() / 100;
      absl::StrAppend(&text, "rank ", c.rank, " (pid ", c.pid, ") hung (stopped by signal ",
                      c.stop_signal, " (", strsignal(c.stop_signal), ") ", tenths / 10, ".",
                      tenths % 10, " s before and never continued); ");
    }
    return text;
  };
  if (!spawn_error.ok()) {
    ending = true;
    term_sent = Clock::now();
    end_all(SIGTERM);
  }
  std::vector<bool> ended_by_us(nproc, false);

  while (true) {
    // Forward output.
    std::vector<pollfd> fds;
    std::vector<std::pair<int, bool>> owners;  // (child index, is_stderr)
    for (int i = 0; i < nproc; ++i) {
      if (children[i].out_fd >= 0) {
        fds.push_back({children[i].out_fd, POLLIN, 0});
        owners.push_back({i, false});
      }
      if (children[i].err_fd >= 0) {
        fds.push_back({children[i].err_fd, POLLIN, 0});
        owners.push_back({i, true});
      }
    }
    if (!fds.empty()) {
      poll(fds.data(), fds.size(), 50);
      for (size_t k = 0; k < fds.size(); ++k) {
        if (fds[k].revents == 0) continue;
        Child& c = children[owners[k].first];
        const bool is_err = owners[k].second;
        int& fd = is_err ? c.err_fd : c.out_fd;
        if (!drain(options, c.rank, is_err, fd,
                   is_err ? c.err_partial : c.out_partial,
                   is_err ? &c.last_err_line : nullptr)) {
          close(fd);
          fd = -1;
        }
      }
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }

    // Reap.
    int status = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG | WUNTRACED | WCONTINUED)) > 0) {
      for (int i = 0; i < nproc; ++i) {
        Child& c = children[i];
        if (c.pid != pid) continue;
        if (WIFSTOPPED(status)) {
          c.stop_signal = WSTOPSIG(status);
          c.stopped_at = Clock::now();
          event(options, absl::StrCat("rank ", c.rank, " (pid ", c.pid,
                                      ") was stopped by signal ", c.stop_signal, " (",
                                      strsignal(c.stop_signal), ")"));
          if (ending) kill(-c.pid, SIGKILL);
          continue;
        }
        if (WIFCONTINUED(status)) {
          c.stop_signal = 0;
          continue;
        }
        c.reaped = true;
        c.status = status;
        const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        if (failed && !ending) {
          // What the rank said last is usually why it failed: read what is
          // still in its stderr pipe before quoting it.
          pollfd pending{c.err_fd, POLLIN, 0};
          while (c.err_fd >= 0 && poll(&pending, 1, 0) > 0) {
            if (!drain(options, c.rank, true, c.err_fd, c.err_partial,
                       &c.last_err_line)) {
              close(c.err_fd);
              c.err_fd = -1;
            }
          }
          result.first_failed_rank = c.rank;
          result.exit_code = shell_status(status);
          const std::string hung = describe_hung();
          result.summary = absl::StrCat(hung, "rank ", c.rank, " (pid ", c.pid, ") ",
                                        describe_status(status), " first");
          if (!hung.empty()) absl::StrAppend(&result.summary, ", waiting for it");
          if (!c.last_err_line.empty()) {
            absl::StrAppend(&result.summary, " (its last error line: \"",
                            c.last_err_line, "\")");
          }
          absl::StrAppend(&result.summary, "; ended the other ranks");
          if (hooks != nullptr) hooks->on_failure(result.exit_code, result.summary);
          ending = true;
          term_sent = Clock::now();
          for (int j = 0; j < nproc; ++j) {
            if (!children[j].reaped) ended_by_us[j] = true;
          }
          end_all(SIGTERM);
        }
        // The rank's own process group may hold grandchildren: end them.
        kill(-c.pid, SIGKILL);
      }
    }

    bool all_reaped = true;
    for (auto& c : children) all_reaped = all_reaped && (c.pid < 0 || c.reaped);
    bool all_closed = true;
    for (auto& c : children) all_closed = all_closed && c.out_fd < 0 && c.err_fd < 0;
    if (all_reaped && (all_closed || (ending && Clock::now() - term_sent >
                                                    options.kill_grace))) {
      break;
    }
    if (all_reaped && !ending) {
      // Grandchildren may keep the pipes open; give them a moment, then stop.
      ending = true;
      term_sent = Clock::now();
    }

    // Another node failed (multi-node restarts).
    if (!ending && hooks != nullptr) {
      if (auto remote = hooks->poll()) {
        result.exit_code = remote->first;
        result.summary = absl::StrCat(remote->second, "; ended this node's ranks");
        ending = true;
        term_sent = Clock::now();
        for (int j = 0; j < nproc; ++j) {
          if (!children[j].reaped) ended_by_us[j] = true;
        }
        end_all(SIGTERM);
      }
    }

    // Timeout and external stop.
    if (!ending && Clock::now() > deadline) {
      result.timed_out = true;
      result.exit_code = 124;
      result.summary = absl::StrCat(describe_hung(), "timeout: ranks still running after ",
                                    options.timeout.count(),
                                    " ms were ended");
      ending = true;
      term_sent = Clock::now();
      for (int j = 0; j < nproc; ++j) {
        if (!children[j].reaped) ended_by_us[j] = true;
      }
      end_all(SIGTERM);
    }
    if (!ending && options.stop_signal != nullptr &&
        options.stop_signal->load() != 0) {
      const int sig = options.stop_signal->load();
      result.exit_code = 128 + sig;
      result.summary = absl::StrCat("launcher received signal ", sig, " (",
                                    strsignal(sig), "); ended the ranks");
      ending = true;
      term_sent = Clock::now();
      for (int j = 0; j < nproc; ++j) {
        if (!children[j].reaped) ended_by_us[j] = true;
      }
      end_all(SIGTERM);
    }
    if (ending && !killed && Clock::now() - term_sent > options.kill_grace) {
      end_all(SIGKILL);
      killed = true;
    }
  }
  for (auto& c : children) {
    if (c.out_fd >= 0) close(c.out_fd);
    if (c.err_fd >= 0) close(c.err_fd);
  }
  // Reap re-parented grandchildren (killed above with their rank's process
  // group), so none lingers even as a zombie; bounded, since the caller may
  // have unrelated children of its own.
  const auto reap_deadline = Clock::now() + std::chrono::milliseconds(500);
  while (Clock::now() < reap_deadline) {
    const pid_t reaped = waitpid(-1, nullptr, WNOHANG);
    if (reaped < 0) break;  // ECHILD: none left
    if (reaped == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!spawn_error.ok()) return spawn_error;

  for (int i = 0; i < nproc; ++i) {
    RankExit exit;
    exit.rank = children[i].rank;
    exit.pid = children[i].pid;
    if (WIFEXITED(children[i].status)) exit.exit_code = WEXITSTATUS(children[i].status);
    if (WIFSIGNALED(children[i].status)) exit.term_signal = WTERMSIG(children[i].status);
    exit.ended_by_launcher = ended_by_us[i];
    result.ranks.push_back(exit);
  }
  return result;
}

// Multi-node with restarts: every attempt starts once all launchers joined
// it (Rendezvous), a failure anywhere ends the ranks on every node, and node
// 0's verdict (restart, finish, give up) holds for all.
static absl::StatusOr<LaunchResult> launch_elastic_nodes(const LaunchOptions& options,
                                                         const std::string& program,
                                                         const ThreadLayout& layout,
                                                         Clock::time_point deadline) {
  auto gather_deadline = [&] {
    return std::min(deadline, Clock::now() + std::chrono::minutes(2));
  };
  auto rendezvous = Rendezvous::Open(options, gather_deadline());
  if (!rendezvous.ok()) return rendezvous.status();
  Rendezvous& rdzv = **rendezvous;
  std::vector<std::string> causes;
  for (int attempt = 0;; ++attempt) {
    rdzv.set_round(attempt);
    auto port = rdzv.Join(attempt, gather_deadline());
    if (!port.ok()) {
      return absl::Status(port.status().code(),
                          absl::StrCat("attempt ", attempt, ": ", port.status().message(),
                                       causes.empty() ? "" : "; after restarts for: ",
                                       absl::StrJoin(causes, " | ")));
    }
    AttemptHooks hooks;
    hooks.poll = [&rdzv, attempt] { return rdzv.Poll(attempt); };
    hooks.on_failure = [&rdzv, attempt](int code, const std::string& summary) {
      rdzv.ReportFailure(attempt, code, summary);
    };
    auto result = run_attempt(options, program, layout, *port, attempt, deadline, &hooks);
    if (!result.ok()) return result.status();
    result->restart_causes = causes;
    auto verdict = rdzv.Finish(attempt, deadline);
    if (!verdict.ok()) {
      if (result->exit_code == 0) result->exit_code = 1;
      absl::StrAppend(&result->summary, result->summary.empty() ? "" : "; ",
                      verdict.status().message());
      return result;
    }
    if (verdict->finish) return result;
    if (!verdict->restart) {
      if (result->exit_code == 0) result->exit_code = verdict->exit_code;
      result->summary = absl::StrCat(verdict->cause, "; no restart left (--max-restarts=",
                                     options.max_restarts, " used)");
      return result;
    }
    causes.push_back(verdict->cause);
    event(options, absl::StrCat("restart ", attempt + 1, " of ", options.max_restarts,
                                " (all ", options.nnodes, " nodes): ", verdict->cause));
  }
}

absl::StatusOr<LaunchResult> launch(const LaunchOptions& options) {
  if (options.nproc_per_node <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--nproc=", options.nproc_per_node, ": expected a positive integer"));
  }
  if (options.nnodes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--nnodes=", options.nnodes, ": expected a positive integer"));
  }
  if (options.node_rank < 0 || options.node_rank >= options.nnodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--node-rank=", options.node_rank,
                     ": expected an integer in [0, --nnodes=", options.nnodes,
                     ")"));
  }
  if (options.master_port < 0 || options.master_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--master-port=", options.master_port,
        ": expected a TCP port in [1, 65535] (or 0 to pick a free one)"));
  }
  if (options.master_port == 0 && options.nnodes > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--master-port is unset with --nnodes=", options.nnodes,
        ": expected an explicit port every node agrees on"));
  }
  if (options.command.empty()) {
    return absl::InvalidArgumentError(
        "no program to launch: expected `-- PROGRAM [ARGS...]`");
  }
  if (options.max_restarts < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-restarts=", options.max_restarts, ": expected an integer >= 0"));
  }
  auto program = resolve_program(options.command[0]);
  if (!program.ok()) return program.status();
  auto layout = thread_layout(options);
  if (!layout.ok()) return layout.status();
  const Clock::time_point deadline = options.timeout.count() > 0
                                         ? Clock::now() + options.timeout
                                         : Clock::time_point::max();
  std::vector<std::string> causes;
  if (options.nnodes > 1 && options.max_restarts > 0) {
    return launch_elastic_nodes(options, *program, *layout, deadline);
  }
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
        absl::StrAppend(&result->summary, "; no restart left (--max-restarts=",
                        options.max_restarts, " used)");
      }
      return result;
    }
    causes.push_back(result->summary);
    event(options, absl::StrCat("restart ", attempt + 1, " of ", options.max_restarts,
                                ": ", result->summary));
  }
}

absl::StatusOr<ThreadLayout> thread_layout(const LaunchOptions& options) {
  const char* omp = std::getenv("OMP_NUM_THREADS");
  for (const std::string& name : options.unset_env) {
    if (name == "OMP_NUM_THREADS") omp = nullptr;
  }
  if (auto it = options.env.find("OMP_NUM_THREADS"); it != options.env.end()) {
    omp = it->second.c_str();
  }
  return PlanThreadLayout(options.nproc_per_node, options.threads_per_rank, omp);
}

namespace {

// A CLI11 transform: `expected` returns what a refused value should have been
// ("" when it takes the value, which it may rewrite). CLI11 then words the
// error "--flag: 'value': expected ...".
CLI::Validator checked(std::function<std::string(std::string&)> expected) {
  return CLI::Validator(
      [expected](std::string& value) {
        const std::string given = value, what = expected(value);
        return what.empty() ? what : absl::StrCat("'", given, "': expected ", what);
      },
      "");
}

// The flags, into `o`. PROGRAM [ARGS...] (after `--`, or from the first
// argument that is not a flag) is left untouched in app.remaining().
void define_launch_flags(CLI::App& app, LaunchOptions& o) {
  app.name("launch");
  app.footer("PROGRAM [ARGS...] follow the flags, after `--` or not.");
  app.prefix_command();
  app.set_help_flag();  // --help only as the first argument (tools/launch.cc)
  app.option_defaults()->always_capture_default()->multi_option_policy(
      CLI::MultiOptionPolicy::TakeLast);
  auto integer = [&app](const std::string& names, int& out, int min, int max,
                        const std::string& help) {
    return app.add_option(names, out, help)->type_name("N")->transform(
        checked([=](std::string& v) {
          int n = 0;
          if (!absl::SimpleAtoi(v, &n) || n < min || n > max) {
            return max == std::numeric_limits<int>::max()
                       ? absl::StrCat("an integer >= ", min)
                       : absl::StrCat("an integer in [", min, ", ", max, "]");
          }
          v = std::to_string(n);  // CLI11 would read "010" as octal
          return std::string();
        }));
  };
  auto seconds = [&app](const std::string& flag, std::chrono::milliseconds& out,
                        const std::string& help) {
    app.add_option_function<double>(
           flag,
           [&out](double s) {
             out = std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(s * 1000)));
           },
           help)
        ->type_name("SECONDS")
        ->transform(checked([](std::string& v) -> std::string {
          double s = 0;
          if (absl::SimpleAtod(v, &s) && s > 0 && s <= 1e7) return "";
          return "a positive number of seconds (at most 1e7)";
        }));
  };
  const int kAny = std::numeric_limits<int>::max();
  integer("--nproc,--nproc-per-node,--nproc_per_node", o.nproc_per_node, 1, kAny,
          "ranks on this node")
      ->required()
      ->default_str("");
  integer("--nnodes", o.nnodes, 1, kAny, "nodes");
  integer("--node-rank,--node_rank", o.node_rank, 0, kAny, "this node's rank");
  app.add_option("--master-addr,--master_addr", o.master_addr, "node 0's address")
      ->type_name("ADDR");
  integer("--master-port,--master_port", o.master_port, 1, 65535,
          "node 0's port (default: a free local port)")
      ->default_str("");
  seconds("--timeout", o.timeout, "end the whole job after this long (exit 124)");
  seconds("--collective-timeout", o.collective_timeout,
          "the ranks' process-group timeout, passed as COMM_COLLECTIVE_TIMEOUT_MS");
  integer("--max-restarts,--max_restarts", o.max_restarts, 0, kAny,
          "restart every rank after a failure, up to N times (TORCHELASTIC_RESTART_COUNT); "
          "with --nnodes, node 0 decides for all");
  integer("--threads-per-rank", o.threads_per_rank, 1, kAny,
          "OMP_NUM_THREADS of each rank (default: OMP_NUM_THREADS if set, else cores / nproc)")
      ->default_str("");
}

}  // namespace

absl::StatusOr<LaunchOptions> parse_launch_args(const std::vector<std::string>& args) {
  LaunchOptions options;
  CLI::App app;
  define_launch_flags(app, options);
  try {
    app.parse(std::vector<std::string>(args.rbegin(), args.rend()));  // CLI11 reads last-first
  } catch (const CLI::ValidationError& e) {  // "--flag: 'value': expected ..."
    std::string what = e.what();
    if (size_t at = what.find(": '"); at != std::string::npos) what.replace(at, 2, "=");
    return absl::InvalidArgumentError(what);
  } catch (const CLI::RequiredError&) {
    return absl::InvalidArgumentError(
        "--nproc is missing: expected --nproc N (ranks on this node)");
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(e.what());
  }
  std::vector<std::string> rest = app.remaining();
  // CLI11 reads a flag's "--flag=" (nothing after '=') as "--flag", which
  // took the next argument as its value.
  for (size_t i = 0; i + rest.size() < args.size(); ++i) {
    if (absl::StartsWith(args[i], "--") && args[i].find('=') + 1 == args[i].size()) {
      return absl::InvalidArgumentError(absl::StrCat(args[i], "'': expected a value"));
    }
  }
  if (!rest.empty() && rest.front() == "--") {
    rest.erase(rest.begin());
  } else if (!rest.empty() && rest.front().size() > 1 && rest.front()[0] == '-') {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown flag ", rest.front().substr(0, rest.front().find('='))));
  }
  options.command = std::move(rest);
  if (options.command.empty()) {
    return absl::InvalidArgumentError(
        "no program given: expected `-- PROGRAM [ARGS...]` after the flags");
  }
  return options;
}

std::string launch_usage() {
  LaunchOptions defaults;
  CLI::App app;
  define_launch_flags(app, defaults);
  app.set_help_flag("-h,--help", "print this help and exit (only as the first argument)");
  app.get_formatter()->column_width(34);
  return app.help();
}

}  // namespace comm
