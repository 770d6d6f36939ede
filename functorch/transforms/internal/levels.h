#pragma once

// RAII guards over ATen's DynamicLayer stack: one per transform level.
// Python functorch pairs _X_increment_nesting with _X_decrement_nesting in a
// try/finally; here the destructor is the finally, so every exit path --
// including an exception thrown by the user's function -- pops the layer and
// restores the grad modes, and later transforms see a clean stack.

#include <ATen/functorch/DynamicLayer.h>
#include <ATen/functorch/TensorWrapper.h>
#include <c10/core/AutogradState.h>
#include <c10/core/GradMode.h>

#include <cstdint>

namespace functorch {
namespace internal {

class VmapLevel {
 public:
  VmapLevel(int64_t batch_size, at::functorch::RandomnessType randomness)
      : level_(at::functorch::initAndPushDynamicLayer(at::functorch::TransformType::Vmap,
                                                      batch_size, randomness)) {}
  ~VmapLevel() { at::functorch::popDynamicLayerAndDeleteMetadata(); }
  VmapLevel(const VmapLevel&) = delete;
  VmapLevel& operator=(const VmapLevel&) = delete;
  int64_t level() const { return level_; }

 private:
  int64_t level_;
};

// A reverse-mode (grad/vjp) level. Records the caller's grad mode in the
// layer (the engine restores it for the levels below) and enables grad while
// the function runs, as `with torch.enable_grad()` does in Python: a
// transform's result must not depend on an outer no_grad.
class GradLevel {
 public:
  GradLevel()
      : level_(at::functorch::initAndPushDynamicLayer(
            at::functorch::TransformType::Grad, std::nullopt, std::nullopt,
            /*prev_grad_mode=*/c10::GradMode::is_enabled())),
        prev_grad_mode_(c10::GradMode::is_enabled()) {
    c10::GradMode::set_enabled(true);
  }
  ~GradLevel() {
    c10::GradMode::set_enabled(prev_grad_mode_);
    at::functorch::popDynamicLayerAndDeleteMetadata();
  }
  GradLevel(const GradLevel&) = delete;
  GradLevel& operator=(const GradLevel&) = delete;
  int64_t level() const { return level_; }

 private:
  int64_t level_;
  bool prev_grad_mode_;
};

// A forward-mode (jvp) level; enables forward grad while the function runs.
class JvpLevel {
 public:
  JvpLevel()
      : level_(at::functorch::initAndPushDynamicLayer(at::functorch::TransformType::Jvp,
                                                      std::nullopt, std::nullopt, std::nullopt,
                                                      /*prev_fwd_grad_mode=*/fw_grad_mode())),
        prev_fwd_grad_mode_(fw_grad_mode()) {
    c10::AutogradState::get_tls_state().set_fw_grad_mode(true);
  }
  ~JvpLevel() {
    c10::AutogradState::get_tls_state().set_fw_grad_mode(prev_fwd_grad_mode_);
    at::functorch::popDynamicLayerAndDeleteMetadata();
  }
  JvpLevel(const JvpLevel&) = delete;
  JvpLevel& operator=(const JvpLevel&) = delete;
  int64_t level() const { return level_; }

 private:
  static bool fw_grad_mode() { return c10::AutogradState::get_tls_state().get_fw_grad_mode(); }
  int64_t level_;
  bool prev_fwd_grad_mode_;
};

// requires_grad_() on a TensorWrapper is an in-place change of an input,
// which the engine refuses unless this flag is set (Python's
// enable_inplace_requires_grad).
class InplaceRequiresGradAllowed {
 public:
  InplaceRequiresGradAllowed() : prev_(at::functorch::getInplaceRequiresGradAllowed()) {
    at::functorch::setInplaceRequiresGradAllowed(true);
  }
  ~InplaceRequiresGradAllowed() { at::functorch::setInplaceRequiresGradAllowed(prev_); }
  InplaceRequiresGradAllowed(const InplaceRequiresGradAllowed&) = delete;
  InplaceRequiresGradAllowed& operator=(const InplaceRequiresGradAllowed&) = delete;

 private:
  bool prev_;
};

}  // namespace internal
}  // namespace functorch
