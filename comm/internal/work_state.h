// What a comm::Work shares between its copies. Internal to comm/.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Work.hpp>

namespace comm {
namespace internal {

struct WorkState {
  // The c10d operation; null for work that completed when it was made.
  c10::intrusive_ptr<c10d::Work> work;
  // Local post-processing run once, in wait(), after `work` succeeds (e.g.
  // summing the chunks an all-to-all delivered, copying an upcast result
  // back). Empty when there is none.
  std::function<void()> finish;
  // The tensors the operation reads or writes, kept alive until it ends.
  std::vector<at::Tensor> keep_alive;
  // For messages: "all_reduce(sum) on group 0 (rank 1 of 2)".
  std::string what;
  std::chrono::milliseconds default_timeout{0};

  std::mutex mutex;
  bool done = false;
  std::exception_ptr error;
};

}  // namespace internal
}  // namespace comm
