// What a comm::Work shares between its copies. Internal to comm/.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <sstream>
#include <vector>

#include <torch/csrc/distributed/c10d/Work.hpp>

namespace comm {
namespace internal {

struct WorkState {
  // The c10d operations (several for a collective built from sends and
  // receives); none for work that completed when it was made.
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  // Local post-processing run once, in wait(), after `works` succeed (e.g.
  // summing the chunks an all-to-all delivered, copying an upcast result
  // back). Empty when there is none.
  std::function<void()> finish;
  // The tensors the operation reads or writes, kept alive until it ends.
  std::vector<at::Tensor> keep_alive;
  // For the error message, formatted only when there is an error (building
  // strings on every call would show in small collectives' latency):
  // "all_reduce on group '0' (rank 1 of 2) op=sum".
  const char* op = "";
  std::string group_name;  // short: fits the small-string buffer
  int rank = -1;
  int size = 0;
  const char* detail_key = nullptr;  // "op" or "root"
  const char* detail_text = nullptr;
  int detail_int = 0;
  std::chrono::milliseconds default_timeout{0};
  // An NCCL collective: c10d's wait() without a timeout only orders the
  // current stream after it.
  bool stream_ordered = false;
  // Gloo's sends and receives (c10d's SendWork/RecvWork) report
  // isCompleted() only once wait() has returned, so is_completed() cannot
  // ask them: its first call starts a thread that waits for `works`, and
  // `waited` becomes ready when that thread is done (or failed).
  bool completes_only_by_waiting = false;
  std::shared_future<void> waited;

  std::mutex mutex;
  bool done = false;
  std::exception_ptr error;
};

}  // namespace internal
}  // namespace comm
