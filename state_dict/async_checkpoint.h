// Checkpoints written in the background while training goes on, after
// PyTorch's torch.distributed.checkpoint.async_save: one background thread
// writes the state with the synchronous functions of checkpoint.h — the same
// files, checksums and commit protocol. Either from a snapshot (SaveFull,
// SaveShard: the state is copied at the step boundary, so the next steps may
// change the live tensors at once) or in place (SaveFullInPlace,
// SaveShardInPlace: no copy; the loop waits with WaitUntilWritten() before
// it changes the state, which the next step's forward and backward usually
// cover).
//
//   state_dict::AsyncCheckpointer saver;
//   for (int64_t step = 1; step <= steps; ++step) {
//     Train(step);
//     if (step % every == 0) {
//       // Returns once the snapshot is taken; the write goes on meanwhile.
//       absl::Status s = saver.SaveFull(root, step, State());
//       if (!s.ok()) return s;  // the PREVIOUS save's error, or this copy's
//     }
//   }
//   absl::Status last = saver.Wait();  // the last save's result
//
// At most one save is in flight: each Save* first waits for the previous one
// and returns its error, so a failed background save is reported at the
// next save or at Wait(), never lost. (The destructor waits too, and prints
// an error nobody collected to stderr.) A process killed during a background
// save leaves a step directory without a MANIFEST, which LatestCheckpoint
// skips: the previous checkpoint is the one that loads.
//
// Memory: one copy of the state, kept between saves and refilled in place
// when the next state has the same entries (no new allocation, no page
// faults), the price async checkpointing pays for overlapping the write.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "state_dict/checkpoint.h"
#include "state_dict/sharded_tensor.h"
#include "state_dict/tensor_dict.h"

namespace formats {
struct LiveTensors;  // formats/torch_save/tensor_dict_io.h
}  // namespace formats

namespace state_dict {

class AsyncCheckpointer {
 public:
  AsyncCheckpointer() = default;
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  // SaveFullCheckpoint(root, step, snapshot of `state`) in the background,
  // then `then` (when given and the save succeeded; e.g. pruning old
  // checkpoints, which must follow the commit).
  absl::Status SaveFull(const std::string& root, int64_t step, const TensorDict& state,
                        std::function<absl::Status()> then = nullptr);

  // SaveShard of one rank in the background. As for the synchronous
  // SaveShard, CommitShardedCheckpoint may run only after every rank's save
  // succeeded: each rank's Wait() returned OK, then the caller's barrier.
  absl::Status SaveShard(const std::string& root, int64_t step, int rank, int world_size,
                         const ShardedStateDict& shard);

  // Without a snapshot: the background thread writes `state`'s own tensors,
  // so the save costs the loop no copy and no memory. The caller must leave
  // them unchanged until WaitUntilWritten() returns, e.g. by calling it
  // before the next optimizer step; the fsync and the commit go on after
  // that. A tensor changed in place before its bytes were written fails the
  // save with DataLoss naming it (reported by Wait() or the next save) and
  // commits nothing, so the previous checkpoint stays the latest; an
  // in-place change still running while the save checks cannot be seen,
  // which is why the rule above is the contract, not the check.
  absl::Status SaveFullInPlace(const std::string& root, int64_t step, const TensorDict& state,
                               std::function<absl::Status()> then = nullptr);
  absl::Status SaveShardInPlace(const std::string& root, int64_t step, int rank, int world_size,
                                const ShardedStateDict& shard);
  // The in-place building block for saves of other shapes (e.g. a FULL
  // checkpoint whose tensors travel to rank 0 over a group of their own,
  // state_dict/fsdp/fsdp_full_checkpoint.h): runs `write` in the background;
  // WaitUntilWritten() returns once `write` has returned. The caller leaves
  // the tensors `write` reads unchanged until then (no version check here).
  absl::Status StartInPlace(std::function<absl::Status()> write);
  // Blocks until the in-place save in flight has handed every byte of the
  // state to the kernel (or ended); at once when there is none.
  void WaitUntilWritten();

  // The building blocks, for state of other shapes (e.g. an FSDP state dict
  // holding both kinds): Snapshot waits for the save in flight (returning
  // its error, if any) and copies the tensors into the kept buffers; Start
  // runs `write` in the background. `write` must own what it reads.
  absl::StatusOr<TensorDict> Snapshot(const TensorDict& state);
  absl::StatusOr<ShardedStateDict> Snapshot(const ShardedStateDict& shard);
  absl::Status Start(std::function<absl::Status()> write);

  // Blocks until the save in flight, if any, finished; returns its status
  // (OK when there was none). Each result is returned once.
  absl::Status Wait();

  bool in_flight() const { return worker_.joinable(); }
  // No save in flight, or it has finished: Wait() returns at once. For
  // polling at step boundaries.
  bool finished() const { return !worker_.joinable() || finished_.load(std::memory_order_acquire); }

 private:
  // A copy of `source` in the buffer kept under `slot` (refilled in place
  // when dtype and shape match).
  at::Tensor Copy(const std::string& slot, const at::Tensor& source);

  // Runs `save` in the background with the versions of `tensors` now and a
  // callback that releases WaitUntilWritten().
  absl::Status StartInPlace(const std::vector<at::Tensor>& tensors,
                            std::function<absl::Status(const formats::LiveTensors&)> save);
  void MarkWritten();

  std::thread worker_;
  absl::Status result_;  // written by the worker, read after join
  std::mutex written_mutex_;
  std::condition_variable written_cv_;
  bool written_ = true;
  std::atomic<bool> finished_{true};
  std::map<std::string, at::Tensor> buffers_;
};

}  // namespace state_dict
