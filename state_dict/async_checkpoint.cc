#include "state_dict/async_checkpoint.h"

#include "state_dict/internal/live_checkpoint.h"

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"

namespace state_dict {

AsyncCheckpointer::~AsyncCheckpointer() {
  absl::Status status = Wait();
  if (!status.ok()) {
    std::fprintf(stderr,
                 "state_dict::AsyncCheckpointer: background save failed and "
                 "nobody called Wait(): %s\n",
                 status.ToString().c_str());
  }
}

absl::Status AsyncCheckpointer::Wait() {
  if (!worker_.joinable()) return absl::OkStatus();
  worker_.join();
  return std::exchange(result_, absl::OkStatus());
}

void AsyncCheckpointer::MarkWritten() {
  {
    std::lock_guard<std::mutex> lock(written_mutex_);
    written_ = true;
  }
  written_cv_.notify_all();
}

void AsyncCheckpointer::WaitUntilWritten() {
  std::unique_lock<std::mutex> lock(written_mutex_);
  written_cv_.wait(lock, [this] { return written_; });
}

absl::Status AsyncCheckpointer::StartInPlace(
    const std::vector<at::Tensor>& tensors,
    std::function<absl::Status(const formats::LiveTensors&)> save) {
  absl::Status previous = Wait();
  if (!previous.ok()) return previous;
  formats::LiveTensors live;
  for (const at::Tensor& t : tensors) {
    if (t.defined()) live.versions[t.unsafeGetTensorImpl()] = static_cast<int64_t>(t._version());
  }
  live.written = [this] { MarkWritten(); };
  {
    std::lock_guard<std::mutex> lock(written_mutex_);
    written_ = false;
  }
  absl::Status started = Start([this, live = std::move(live), save = std::move(save)] {
    absl::Status status = save(live);
    MarkWritten();  // also when the save failed before writing everything
    return status;
  });
  if (!started.ok()) MarkWritten();
  return started;
}

absl::Status AsyncCheckpointer::StartInPlace(std::function<absl::Status()> write) {
  return StartInPlace({},
                      [write = std::move(write)](const formats::LiveTensors&) { return write(); });
}

absl::Status AsyncCheckpointer::SaveFullInPlace(const std::string& root, int64_t step,
                                                const TensorDict& state,
                                                std::function<absl::Status()> then) {
  return StartInPlace(state.values(), [root, step, state,
                                       then = std::move(then)](const formats::LiveTensors& live) {
    absl::Status status = internal::SaveFullCheckpoint(root, step, state, &live);
    if (status.ok() && then) status = then();
    return status;
  });
}

absl::Status AsyncCheckpointer::SaveShardInPlace(const std::string& root, int64_t step, int rank,
                                                 int world_size, const ShardedStateDict& shard) {
  std::vector<at::Tensor> pieces;
  for (const auto& item : shard) {
    for (const ShardPiece& piece : item.value().pieces) pieces.push_back(piece.data);
  }
  return StartInPlace(pieces,
                      [root, step, rank, world_size, shard](const formats::LiveTensors& live) {
                        return internal::SaveShard(root, step, rank, world_size, shard, &live);
                      });
}

absl::Status AsyncCheckpointer::Start(std::function<absl::Status()> write) {
  absl::Status previous = Wait();
  if (!previous.ok()) return previous;
  finished_.store(false, std::memory_order_release);
  worker_ = std::thread([this, write = std::move(write)] {
    try {
      result_ = write();
    } catch (const std::exception& e) {  // never let a throw end the process
      result_ = absl::InternalError(absl::StrCat("background checkpoint save threw: ", e.what()));
    }
    finished_.store(true, std::memory_order_release);
  });
  return absl::OkStatus();
}

at::Tensor AsyncCheckpointer::Copy(const std::string& slot, const at::Tensor& source) {
  if (!source.defined()) return at::Tensor();  // the save reports it by name
  at::Tensor& b = buffers_[slot];
  if (!b.defined() || b.scalar_type() != source.scalar_type() || b.sizes() != source.sizes()) {
    b = at::empty(source.sizes(), at::TensorOptions().dtype(source.scalar_type()));
  }
  b.copy_(source.detach());
  return b;
}

absl::StatusOr<TensorDict> AsyncCheckpointer::Snapshot(const TensorDict& state) {
  // The buffers may still be in use by the save in flight.
  absl::Status previous = Wait();
  if (!previous.ok()) return previous;
  TensorDict snapshot;
  for (const auto& item : state) {
    snapshot.insert(item.key(), Copy("full:" + item.key(), item.value()));
  }
  return snapshot;
}

absl::StatusOr<ShardedStateDict> AsyncCheckpointer::Snapshot(const ShardedStateDict& shard) {
  absl::Status previous = Wait();
  if (!previous.ok()) return previous;
  ShardedStateDict snapshot;
  for (const auto& item : shard) {
    ShardedTensor st = item.value();
    for (size_t k = 0; k < st.pieces.size(); ++k) {
      st.pieces[k].data = Copy(absl::StrCat("shard:", item.key(), "#", k), st.pieces[k].data);
    }
    snapshot.insert(item.key(), std::move(st));
  }
  return snapshot;
}

absl::Status AsyncCheckpointer::SaveFull(const std::string& root, int64_t step,
                                         const TensorDict& state,
                                         std::function<absl::Status()> then) {
  auto snapshot = Snapshot(state);
  if (!snapshot.ok()) return snapshot.status();
  return Start([root, step, snapshot = *std::move(snapshot), then = std::move(then)] {
    absl::Status status = SaveFullCheckpoint(root, step, snapshot);
    if (status.ok() && then) status = then();
    return status;
  });
}

absl::Status AsyncCheckpointer::SaveShard(const std::string& root, int64_t step, int rank,
                                          int world_size, const ShardedStateDict& shard) {
  auto snapshot = Snapshot(shard);
  if (!snapshot.ok()) return snapshot.status();
  return Start([root, step, rank, world_size, snapshot = *std::move(snapshot)] {
    return state_dict::SaveShard(root, step, rank, world_size, snapshot);
  });
}

}  // namespace state_dict
