#include "launcher/internal/rendezvous.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace launcher {
namespace internal {
namespace {

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
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
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
    const std::string where = absl::StrCat(options.master_addr, ":", options.master_port);
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
        return absl::UnavailableError(
            absl::StrCat("--master-port: node 0's launcher cannot listen on ", where,
                         " for the other nodes: ", std::strerror(err)));
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
                           absl::SimpleAtoi(words[1], &node) && node > 0 && node < options.nnodes;
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
              "a connection from ", incoming.address, incoming.closed ? " closed" : " was silent",
              " before introducing itself (expected 'NODE k', k in [1, --nnodes=", options.nnodes,
              "))");
        } else if (hello) {
          rejected = absl::StrCat("a connection from ", incoming.address, " said it is node ", node,
                                  ", which has already joined");
        } else {
          rejected =
              absl::StrCat("a connection from ", incoming.address, " sent ", quote_line(line),
                           ": expected 'NODE k', k in [1, --nnodes=", options.nnodes, ")");
        }
        options.on_event(
            absl::StrCat("launcher rendezvous at ", where, ": turned away ", rejected));
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
          return absl::DeadlineExceededError(absl::StrCat("node ", options.node_rank,
                                                          " could not reach node 0's launcher at ",
                                                          where, ": ", std::strerror(err)));
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
          return absl::DataLossError(
              absl::StrCat(Describe(peers_[k]), " ", peers_[k].error, " before attempt ", round));
        }
        if (peers_[k].closed) {
          return absl::UnavailableError(
              absl::StrCat("node ", k, "'s launcher disconnected before attempt ", round));
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
    int joined = -1;      // node 0: the last attempt the node joined
    int over = -1;        // node 0: the last attempt whose ranks are gone there
  };

  explicit Rendezvous(const LaunchOptions& options) : options_(options) {}

  bool is_master() const { return options_.node_rank == 0; }

  absl::Status Lost() const {
    return absl::UnavailableError(absl::StrCat("lost the connection to node 0's launcher at ",
                                               options_.master_addr, ":", options_.master_port,
                                               " (it ended or died)"));
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
      const ssize_t n =
          send(peer.fd, text.data() + sent, text.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        pollfd p{peer.fd, POLLOUT, 0};
        if (left.count() <= 0 || poll(&p, 1, static_cast<int>(left.count())) == 0) {
          ProtocolError(
              peer,
              absl::StrCat(
                  "did not read what was sent to it for ",
                  std::chrono::duration_cast<std::chrono::seconds>(kLauncherSendTimeout).count(),
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
      ProtocolError(peer, absl::StrCat("sent a line of more than ", kMaxLauncherLine, " bytes (",
                                       quote_line(peer.partial.substr(0, 64)),
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
            ProtocolError(
                peer, absl::StrCat("sent ", quote_line(line), ": expected FAIL r CODE SUMMARY"));
          }
        } else {
          ProtocolError(peer, absl::StrCat("sent ", quote_line(line),
                                           ": expected JOIN r, OVER r or FAIL r CODE SUMMARY"));
        }
      }
      if (peer.closed && !was_closed && is_master() && current_round_ >= 0) {
        Fail(current_round_, 1,
             peer.error.empty() ? absl::StrCat("node ", peer.node, "'s launcher disconnected")
                                : absl::StrCat(Describe(peer), " ", peer.error));
      }
      if (peer.closed && !is_master()) {
        const std::string why = peer.error.empty() ? std::string("node 0's launcher disconnected")
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
    return absl::DeadlineExceededError(
        absl::StrCat("node ", options_.node_rank, ": the launchers did not agree on ", what,
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

absl::StatusOr<LaunchResult> launch_elastic_nodes(const LaunchOptions& options,
                                                  const RunAttempt& run_attempt,
                                                  Clock::time_point deadline) {
  auto gather_deadline = [&] { return std::min(deadline, Clock::now() + std::chrono::minutes(2)); };
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
    auto result = run_attempt(*port, attempt, hooks);
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
      result->summary = absl::StrCat(
          verdict->cause, "; no restart left (--max-restarts=", options.max_restarts, " used)");
      return result;
    }
    causes.push_back(verdict->cause);
    options.on_event(absl::StrCat("restart ", attempt + 1, " of ", options.max_restarts, " (all ",
                                  options.nnodes, " nodes): ", verdict->cause));
  }
}

}  // namespace internal
}  // namespace launcher
