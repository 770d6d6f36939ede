// The launchers' rendezvous for multi-node restarts (`--nnodes N
// --max-restarts M`), internal to launcher/: what launch.h's "Multi-node"
// paragraph promises (its contract), as a line protocol over one TCP
// connection per node to node 0's launcher (spelled out in rendezvous.cc).
// PyTorch: torchrun's elastic agent with its c10d rendezvous handler
// (torch.distributed.elastic.rendezvous), for one fixed set of nodes.
//
//   return launch_elastic_nodes(options, run_attempt, deadline);
//
// Errors: a peer that breaks the protocol is DataLoss naming its address and
// quoting what it sent, a lost launcher Unavailable, a wait past its
// deadline DeadlineExceeded.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "launcher/launch.h"

namespace launcher {
namespace internal {

using Clock = std::chrono::steady_clock;

// Hooks an attempt runs with on a multi-node elastic job: `poll` is asked
// every loop whether another node failed (exit code and cause), and
// `on_failure` is told of this node's first failure at once.
struct AttemptHooks {
  std::function<std::optional<std::pair<int, std::string>>()> poll;
  std::function<void(int exit_code, const std::string& summary)> on_failure;
};

// Runs attempt `attempt` of this node's ranks with MASTER_PORT=`port`.
using RunAttempt =
    std::function<absl::StatusOr<LaunchResult>(int port, int attempt, const AttemptHooks& hooks)>;

// Multi-node with restarts: every attempt starts once all launchers joined
// it, a failure anywhere ends the ranks on every node, and node 0's verdict
// (restart, finish, give up) holds for all. `options.on_event` must be set.
absl::StatusOr<LaunchResult> launch_elastic_nodes(const LaunchOptions& options,
                                                  const RunAttempt& run_attempt,
                                                  Clock::time_point deadline);

}  // namespace internal
}  // namespace launcher
