// A process group: the set of processes a collective runs over, and how the
// first one (the "world") is created from the environment, as
// torch.distributed.init_process_group does.
//
// Error convention for all of comm/:
//   * Set-up (anything that reads configuration or the environment, or
//     rendezvous through a store: init_process_group, new_group, device
//     meshes, the launcher) returns absl::Status / absl::StatusOr. Messages
//     name the argument or variable, its value and what was expected.
//   * Collectives and Work::wait() throw c10::Error (a std::exception), as
//     ATen ops and c10d do: they run inside tensor code that already throws,
//     and a failed peer surfaces as an exception from c10d anyway.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "c10/util/intrusive_ptr.h"

namespace c10d {
class ProcessGroup;
class Store;
}  // namespace c10d

namespace comm {

namespace internal {
struct GroupState;
}  // namespace internal

// torch.distributed's default (30 minutes). Tests and the launcher pass
// shorter ones.
inline constexpr std::chrono::milliseconds kDefaultTimeout = std::chrono::minutes(30);

// The backend torch.distributed picks by default on a CUDA machine: CPU
// tensors through Gloo, CUDA tensors through NCCL, in one group (what a
// trainer on GPUs wants: NCCL for the model, Gloo for small CPU
// bookkeeping such as agreeing on a checkpoint's status).
inline constexpr char kGlooCpuNcclCuda[] = "cpu:gloo,cuda:nccl";

// PyTorch's torch.distributed.is_nccl_available(): whether this binary can
// make "nccl" groups, i.e. links //comm:nccl (what --config=cuda adds to the
// project's binaries; a binary of your own adds it to its deps). Whether a
// GPU is present is checked when a group is made.
bool is_nccl_available();

// A value type (cheap to copy; copies share the underlying c10d group).
// A process that is not a member of a group still holds a ProcessGroup for
// it (as torch.distributed's new_group returns NON_GROUP_MEMBER): is_member()
// is false, rank() is -1 and collectives on it throw.
class ProcessGroup {
 public:
  // An empty group: no members, is_member() false. Useful as a placeholder.
  ProcessGroup();

  // This process's rank within the group, or -1 when not a member.
  int rank() const;
  // Number of processes in the group.
  int size() const;
  bool is_member() const;
  // global_ranks()[r] is the world rank of the group's rank r.
  const std::vector<int>& global_ranks() const;
  // This process's rank in the world group.
  int global_rank() const;
  // "gloo" (or "nccl" where available).
  const std::string& backend() const;
  // The timeout every collective and wait() on this group is bounded by.
  std::chrono::milliseconds timeout() const;
  // A name unique among the groups of one world ("0" for the world itself,
  // "0/1", "0/2", ... for groups made from it). Also the store prefix.
  const std::string& name() const;

  // The c10d group, for callers that need a raw c10d call (benchmarks, the
  // few ops comm does not wrap). Null when not a member. Include
  // <torch/csrc/distributed/c10d/ProcessGroup.hpp> to use it.
  c10::intrusive_ptr<c10d::ProcessGroup> c10d_group() const;

  // Internal: comm's own .cc files build groups through this.
  explicit ProcessGroup(std::shared_ptr<internal::GroupState> state);
  const std::shared_ptr<internal::GroupState>& state() const { return state_; }

 private:
  std::shared_ptr<internal::GroupState> state_;
};

struct InitOptions {
  // "gloo" (CPU, always available; CUDA tensors too in the CUDA build),
  // "nccl" (CUDA tensors only) or kGlooCpuNcclCuda; the last two only with a
  // CUDA/NCCL LibTorch and a GPU (otherwise an Unimplemented or
  // FailedPrecondition error saying which is missing).
  std::string backend = "gloo";
  // "env://"            MASTER_ADDR/MASTER_PORT (+ RANK/WORLD_SIZE unless
  //                     given below) through a c10d::TCPStore served by rank 0;
  //                     the other ranks connect with comm's own client of its
  //                     protocol, which bounds every reply in size and time
  //                     (comm/internal/store_client.h).
  // "tcp://HOST:PORT"   the same with an explicit master address.
  // "file:///PATH"      a c10d::FileStore on a file every rank can see.
  std::string init_method = "env://";
  // -1: read RANK / WORLD_SIZE from the environment.
  int rank = -1;
  int world_size = -1;
  // Bounds every collective (and wait()), and the rendezvous unless
  // rendezvous_timeout is set.
  std::chrono::milliseconds timeout = kDefaultTimeout;
  // Bounds connecting to the master and waiting for every rank to join
  // (0: `timeout`). Ranks start at different times (loading LibTorch takes
  // a while on a busy machine), so a short collective timeout often wants a
  // longer rendezvous.
  std::chrono::milliseconds rendezvous_timeout{0};
};

// Creates the world group; every rank calls it. Errors (InvalidArgument
// unless noted) name what was wrong: a missing or malformed variable
// ("environment variable RANK='x': expected an integer in [0, WORLD_SIZE=2)"),
// rank >= world size, an unreachable master or missing ranks
// (DeadlineExceeded within the rendezvous timeout, naming host:port), a
// master port already in use (Unavailable, naming the port), a backend this
// LibTorch lacks (Unimplemented, suggesting gloo). Whatever answers on the
// master's port, a rank other than 0 returns within the rendezvous timeout:
// a peer that is not a c10d TCPStore (garbage instead of the handshake's
// ping echo) is DataLoss, one that accepts and stays silent
// DeadlineExceeded, both naming "rendezvous peer HOST:PORT" and what it sent
// or failed to send, e.g. "rendezvous peer 127.0.0.1:29500 answered the
// ping with 0xffffffff: expected its nonce 0x1a2b3c4d echoed (is it a c10d
// TCPStore server?)". A reply that breaks the protocol later, during the
// backend's own rendezvous (Gloo reading its peers' addresses through the
// store: a value length over 1 MiB, an unknown response byte), comes back
// as DeadlineExceeded "could not connect the gloo group" with the same text.
absl::StatusOr<ProcessGroup> init_process_group(const InitOptions& options = {});

// The variables a launcher (//tools:launch, torchrun, srun through
// comm/slurm.h) sets for each rank.
struct RankEnvironment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;
  int master_port = 0;
};

// Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT; in a task srun started without RANK, Slurm's variables
// instead (comm/slurm.h). LOCAL_WORLD_SIZE defaults to WORLD_SIZE (one node) and
// LOCAL_RANK to RANK % LOCAL_WORLD_SIZE when unset; the others are required. Checks ranges and
// consistency (RANK < WORLD_SIZE, LOCAL_RANK < LOCAL_WORLD_SIZE,
// WORLD_SIZE % LOCAL_WORLD_SIZE == 0, 0 < MASTER_PORT < 65536).
absl::StatusOr<RankEnvironment> read_rank_environment();

}  // namespace comm
