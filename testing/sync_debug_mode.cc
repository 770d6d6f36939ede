#include "testing/sync_debug_mode.h"

#include <c10/util/Backtrace.h>

#include "absl/strings/match.h"

#ifdef TORCHFSDP_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace gpu_check {

SyncDebugScope::SyncDebugScope(Mode mode) : mode_(mode) {
#ifdef TORCHFSDP_CUDA
  if (mode_ == Mode::kWarn) {
    previous_handler_ = c10::WarningUtils::get_warning_handler();
    c10::WarningUtils::set_warning_handler(this);
  }
  if (mode_ != Mode::kOff) {
    c10::cuda::warning_state().set_sync_debug_mode(mode_ == Mode::kWarn
                                                       ? c10::cuda::SyncDebugMode::L_WARN
                                                       : c10::cuda::SyncDebugMode::L_ERROR);
  }
#endif
}

SyncDebugScope::~SyncDebugScope() {
#ifdef TORCHFSDP_CUDA
  if (mode_ != Mode::kOff) {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  }
  if (mode_ == Mode::kWarn) c10::WarningUtils::set_warning_handler(previous_handler_);
#endif
}

void SyncDebugScope::process(const c10::Warning& warning) {
  if (!absl::StrContains(warning.msg(), "synchroniz")) {
    if (previous_handler_ != nullptr) previous_handler_->process(warning);
    return;
  }
  syncs_.push_back({phase_, c10::get_backtrace(/*frames_to_skip=*/1,
                                               /*maximum_number_of_frames=*/24)});
}

}  // namespace gpu_check
