// CUDA's sync-debug mode (PyTorch's torch.cuda.set_sync_debug_mode) for the
// life of a scope, so a GPU check can show that code never makes the host
// wait for the GPU (fsdp/'s step checks, optim/'s fused optimizers):
//
//   {
//     gpu_check::SyncDebugScope mode(gpu_check::SyncDebugScope::Mode::kError);
//     optimizer.step();  // a .item(), a blocking copy, a nonzero... throws
//   }
//
// kError makes any call that makes the host wait for the GPU (a .item(), a
// blocking copy, cudaStreamSynchronize, a nonzero) throw; kWarn makes it
// warn, and the scope records each such warning instead of printing it
// (with the phase set at the time and the stack where it was raised;
// autograd replays its worker threads' warnings on this thread at the end
// of backward, so those stacks show the replay). The mode is off again when
// the scope ends, thrown through or not.
//
// Only in a binary built with CUDA (this target's TORCHFSDP_CUDA, under
// --config=cuda or the CMake GPU build): elsewhere, and with kOff, the
// scope does nothing.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

namespace gpu_check {

class SyncDebugScope : public c10::WarningHandler {
 public:
  enum class Mode { kOff, kWarn, kError };
  struct Sync {
    std::string phase;  // what set_phase said when it was raised
    std::string stack;
  };

  explicit SyncDebugScope(Mode mode);
  ~SyncDebugScope() override;
  SyncDebugScope(const SyncDebugScope&) = delete;
  SyncDebugScope& operator=(const SyncDebugScope&) = delete;

  // Names what runs from now on, for the synchronisations kWarn records.
  void set_phase(std::string phase) { phase_ = std::move(phase); }
  // Under kWarn, every synchronising call so far.
  const std::vector<Sync>& syncs() const { return syncs_; }

  // c10::WarningHandler: records a synchronisation warning, hands any other
  // to the handler that was installed before.
  void process(const c10::Warning& warning) override;

 private:
  [[maybe_unused]] Mode mode_;  // read in a CUDA build only
  c10::WarningHandler* previous_handler_ = nullptr;
  std::string phase_;
  std::vector<Sync> syncs_;
};

}  // namespace gpu_check
