// The handle of an asynchronous collective, so callers (fsdp) can overlap
// communication with compute and wait later.
#pragma once

#include <chrono>
#include <memory>

namespace comm {

namespace internal {
struct WorkState;
}  // namespace internal

// Copyable; copies share one operation. Waiting is idempotent: after the
// first wait() returns, later ones return at once (or rethrow its error).
class Work {
 public:
  // An already-completed no-op (e.g. a collective on a one-rank group).
  Work();

  // Blocks until the collective (and any local post-processing, e.g. the
  // reduction step of a reduce-scatter built from all-to-all) has finished and
  // the output tensors may be read. Bounded by the group's timeout: never
  // waits forever. Throws c10::Error when the collective failed (e.g. a peer
  // died: "Connection closed by peer") or the timeout passed. After a
  // timeout the group is unusable (as in torch.distributed).
  void wait();
  void wait(std::chrono::milliseconds timeout);

  // What PyTorch's work.wait() does on NCCL: the calling thread's current
  // stream (of the tensors' device) waits for the collective, the host does
  // not, so communication and compute stay queued on the GPU together. The
  // group's timeout is still enforced, by ProcessGroupNCCL's watchdog, which
  // aborts the group when a collective overruns it. For every other
  // collective (CPU tensors, Gloo) there is no stream to order: wait().
  // A failed collective throws as wait() does.
  void wait_on_stream();
  // True when wait_on_stream() never blocks the host (an NCCL collective).
  bool is_stream_ordered() const;
  // Non-blocking: true when wait() would return without blocking. Gloo's
  // sends and receives (send, recv, the rank-to-rank all-gathers) cannot
  // be asked: the first call starts a thread that waits for them, and
  // later calls report what it saw (a wait() then waits for that thread).
  bool is_completed() const;

  // Internal: built by collectives.cc.
  explicit Work(std::shared_ptr<internal::WorkState> state);

 private:
  std::shared_ptr<internal::WorkState> state_;
};

}  // namespace comm
