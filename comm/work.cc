#include "comm/work.h"

#include <algorithm>
#include <chrono>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#include "comm/internal/work_state.h"

namespace comm {

Work::Work() : state_(std::make_shared<internal::WorkState>()) { state_->done = true; }

Work::Work(std::shared_ptr<internal::WorkState> state) : state_(std::move(state)) {}

void Work::wait() {
  {
    // A completed Work (a default-constructed one too: it has no timeout of
    // its own) has nothing to wait for.
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->done) {
      if (state_->error) std::rethrow_exception(state_->error);
      return;
    }
  }
  wait(state_->default_timeout);
}

namespace {

// Records `e` as the operation's error, in comm's words: which collective, on
// which group and rank, and why.
void record_failure(internal::WorkState& state, const std::exception& e,
                    const std::string& waited) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  const std::string why = c10_error ? c10_error->what_without_backtrace() : e.what();
  try {
    std::ostringstream what;
    what << state.op << " on group '" << state.group_name << "' (rank " << state.rank << " of "
         << state.size << ")";
    if (state.detail_key != nullptr) {
      what << " " << state.detail_key << "=";
      if (state.detail_text != nullptr) {
        what << state.detail_text;
      } else {
        what << state.detail_int;
      }
    }
    TORCH_CHECK(false, "comm: ", what.str(), " failed (", waited, "): ", why);
  } catch (...) {
    state.error = std::current_exception();
  }
}

// c10d's Work::wait(timeout) throws "Operation timed out!" when the deadline
// passes, so this never blocks forever; the operations share the deadline.
// Last posted first: the messages between two ranks arrive in order, so once
// the last is in, the earlier ones return without putting the thread to
// sleep again.
void wait_for_all(const std::vector<c10::intrusive_ptr<c10d::Work>>& works,
                  std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (auto it = works.rbegin(); it != works.rend(); ++it) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    (*it)->wait(std::max(left, std::chrono::milliseconds(1)));
  }
}

void finish_waiting(internal::WorkState& state) {
  state.done = true;
  // Drop buffers now rather than when the last copy of the Work goes.
  state.finish = nullptr;
  state.keep_alive.clear();
}

}  // namespace

void Work::wait(std::chrono::milliseconds timeout) {
  TORCH_CHECK(timeout.count() > 0, "comm::Work::wait: timeout=", timeout.count(),
              " ms: expected a positive duration");
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (!state_->done) {
    try {
      if (state_->waited.valid()) {
        // is_completed() started a thread that waits; wait for it instead.
        TORCH_CHECK(state_->waited.wait_for(timeout) == std::future_status::ready,
                    "Operation timed out!");
        state_->waited.get();  // rethrows what the thread caught
      } else {
        wait_for_all(state_->works, timeout);
      }
      if (state_->finish) state_->finish();
    } catch (const std::exception& e) {
      record_failure(*state_, e, "waited up to " + std::to_string(timeout.count()) + " ms");
    }
    finish_waiting(*state_);
  }
  if (state_->error) std::rethrow_exception(state_->error);
}

void Work::wait_on_stream() {
  if (!state_->stream_ordered) {
    wait();
    return;
  }
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (!state_->done) {
    try {
      // No timeout argument: with one, ProcessGroupNCCL blocks the host
      // until completion. Without, it only makes the current stream wait.
      for (const auto& work : state_->works) work->wait();
      if (state_->finish) state_->finish();
    } catch (const std::exception& e) {
      record_failure(*state_, e,
                     "ordered on the current stream; the group's watchdog enforces " +
                         std::to_string(state_->default_timeout.count()) + " ms");
    }
    // The tensors stay referenced by ProcessGroupNCCL's own bookkeeping until
    // the GPU is done with them, so ours may go.
    finish_waiting(*state_);
  }
  if (state_->error) std::rethrow_exception(state_->error);
}

bool Work::is_stream_ordered() const { return state_->stream_ordered; }

bool Work::is_completed() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->done) return true;
  if (!state_->completes_only_by_waiting) {
    for (const auto& work : state_->works) {
      if (!work->isCompleted()) return false;
    }
    return true;
  }
  if (!state_->waited.valid()) {
    // The thread holds the c10d operations (and through them the tensors),
    // not this state, so a Work dropped while it waits is simply released.
    std::promise<void> promise;
    state_->waited = promise.get_future().share();
    std::thread([works = state_->works, timeout = state_->default_timeout,
                 promise = std::move(promise)]() mutable {
      try {
        wait_for_all(works, timeout);
        promise.set_value();
      } catch (...) {
        promise.set_exception(std::current_exception());
      }
    }).detach();
    return false;
  }
  return state_->waited.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

}  // namespace comm
