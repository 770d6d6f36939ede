// What a comm::ProcessGroup shares between its copies. Internal to comm/.
#pragma once

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/statusor.h"

namespace comm {
namespace internal {

struct GroupState {
  // Null when the calling process is not a member.
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  // The world's store; groups made from this one rendezvous under
  // "<name>/" prefixes in it.
  c10::intrusive_ptr<c10d::Store> root_store;
  int rank = -1;
  int size = 0;
  std::vector<int> global_ranks;
  int global_rank = -1;
  std::string backend;
  std::string name;
  std::chrono::milliseconds timeout{0};
  // How many groups have been made from this one: every member counts the
  // same, so they agree on the child's name without talking.
  std::atomic<int> children_made{0};
  // How the world was reached, e.g. "tcp://127.0.0.1:29500", for messages.
  std::string rendezvous;
  // MASTER_ADDR (empty for file://): picks Gloo's network device, loopback
  // when it is a loopback address.
  std::string master_addr;
};

// Creates the backend's c10d group for `rank` of `size` on `store`
// (rendezvous happens here; bounded by `timeout`). Gloo binds to
// GLOO_SOCKET_IFNAME when set, else 127.0.0.1 when `master_addr` is a
// loopback address, else the address the host name resolves to.
absl::StatusOr<c10::intrusive_ptr<c10d::ProcessGroup>> make_backend_group(
    const std::string& backend, const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& master_addr);

}  // namespace internal
}  // namespace comm
