#include "comm/work.h"

#include <utility>

#include <c10/util/Exception.h>

#include "comm/internal/work_state.h"

namespace comm {

Work::Work() : state_(std::make_shared<internal::WorkState>()) {
  state_->done = true;
}

Work::Work(std::shared_ptr<internal::WorkState> state)
    : state_(std::move(state)) {}

void Work::wait() { wait(state_->default_timeout); }

void Work::wait(std::chrono::milliseconds timeout) {
  TORCH_CHECK(timeout.count() > 0, "comm::Work::wait: timeout=",
              timeout.count(), " ms: expected a positive duration");
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (!state_->done) {
    try {
      if (state_->work) {
        // c10d's Work::wait(timeout) throws "Operation timed out!" when the
        // deadline passes, so this never blocks forever.
        state_->work->wait(timeout);
      }
      if (state_->finish) state_->finish();
    } catch (const std::exception& e) {
      const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
      const std::string why =
          c10_error ? c10_error->what_without_backtrace() : e.what();
      try {
        std::ostringstream what;
        what << state_->op << " on group '" << state_->group_name << "' (rank "
             << state_->rank << " of " << state_->size << ")";
        if (state_->detail_key != nullptr) {
          what << " " << state_->detail_key << "=";
          if (state_->detail_text != nullptr) {
            what << state_->detail_text;
          } else {
            what << state_->detail_int;
          }
        }
        TORCH_CHECK(false, "comm: ", what.str(), " failed (waited up to ",
                    timeout.count(), " ms): ", why);
      } catch (...) {
        state_->error = std::current_exception();
      }
    }
    state_->done = true;
    // Drop buffers now rather than when the last copy of the Work goes.
    state_->finish = nullptr;
    state_->keep_alive.clear();
  }
  if (state_->error) std::rethrow_exception(state_->error);
}

bool Work::is_completed() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done || !state_->work || state_->work->isCompleted();
}

}  // namespace comm
