// The state fully_shard attaches to a module (PyTorch's FSDPState,
// _fsdp_state.py): the hooks at the module call point, lazy initialisation
// by the root, the pre-/post-backward hooks and the root's end-of-backward
// callback; and the process-wide registry from modules to states. Private
// to //fsdp:fully_shard.
#pragma once

#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/fully_shard.h"
#include "fsdp/internal/fully_shard/fsdp_param_group.h"
#include "module_call/forward_hooks.h"

namespace fsdp {
namespace internal {

class FSDPState;

// What the root shares with every state of its tree (PyTorch's
// FSDPStateContext).
struct FSDPStateContext {
  std::vector<std::shared_ptr<FSDPState>> all_states;  // root first, pre-order
  bool final_callback_queued = false;
  // PyTorch's is_last_backward: whether the end of backward waits for the
  // gradient reductions still in flight (FSDPModule::set_is_last_backward).
  bool is_last_backward = true;
  // The group whose reduce-scatter was started last and not yet waited for.
  // The next group's post-backward waits for it first (PyTorch waits for
  // the previous reduce-scatter before the next: reduce_scatter_state), so
  // one copy-in buffer at a time is alive, not one per group.
  FSDPParamGroup* reduce_scatter_in_flight = nullptr;
};

class FSDPState : public std::enable_shared_from_this<FSDPState> {
 public:
  // `group` null: the module has no parameters of its own to manage.
  FSDPState(const std::shared_ptr<torch::nn::Module>& module, std::string name,
            std::unique_ptr<FSDPParamGroup> group, MixedPrecisionPolicy mp_policy,
            bool auto_reshard_after_forward);
  ~FSDPState();

  void register_hooks();
  std::shared_ptr<torch::nn::Module> module() const { return module_.lock(); }
  const std::string& name() const { return name_; }
  FSDPParamGroup* param_group() const { return group_.get(); }
  // Sets it on this state's context: its own until the root's lazy
  // initialisation, which shares the root's with the whole tree (so set it
  // on the root, as in PyTorch).
  void set_is_last_backward(bool value) { context_->is_last_backward = value; }

  // The hooks.
  void pre_forward();
  at::Tensor map_input(const at::Tensor& t);
  void post_forward(const std::vector<at::Tensor>& outputs);
  void forward_failed() noexcept;
  void pre_backward();
  // The backward of the inputs' post-backward node: the module's backward
  // is done once every input that took part has its gradient.
  void input_grad_ready();
  void post_backward();
  void root_final_callback();

  std::vector<std::weak_ptr<FSDPState>> forward_prefetch;
  std::vector<std::weak_ptr<FSDPState>> backward_prefetch;

 private:
  void lazy_init();
  // Before the root's lazy init: every fully_shard module of the tree is
  // materialised (no meta shards), else an error naming the modules and
  // parameters still on meta (PyTorch's _validate_no_meta_params).
  void validate_no_meta_params() const;
  void validate_no_duplicate_params() const;
  // Starts the all-gathers of `states` (async).
  static void prefetch(const std::vector<std::weak_ptr<FSDPState>>& states);
  FSDPStateContext& context() const { return *context_; }

  std::weak_ptr<torch::nn::Module> module_;
  std::string name_;
  std::string fqn_;  // relative to the root, set by its lazy init
  std::unique_ptr<FSDPParamGroup> group_;
  MixedPrecisionPolicy mp_policy_;
  bool auto_reshard_after_forward_;
  std::optional<bool> is_root_;
  std::shared_ptr<FSDPStateContext> context_;
  module_call::HookHandle hooks_;
  // Per iteration.
  int pending_input_grads_ = 0;
  bool pre_backward_done_ = false;
  bool post_backward_done_ = false;
};

// The registry holds each state strongly and its module weakly; the
// entries (and states, with their shards) of destroyed modules are dropped
// at the next fully_shard call.
// The state fully_shard put on `module`, or null.
std::shared_ptr<FSDPState> state_of(const torch::nn::Module& module);
// The state whose group manages `module`'s parameters (its own state, or
// an ancestor's), or null.
std::shared_ptr<FSDPState> manager_of(const torch::nn::Module& module);
void register_state(const std::shared_ptr<torch::nn::Module>& module,
                    const std::shared_ptr<FSDPState>& state,
                    const std::vector<std::shared_ptr<torch::nn::Module>>& managed);
// The spec of `p`, one of `group`'s parameters.
ShardedParamSpec spec_of(const FSDPParamGroup& group, const FSDPParam& p);
// The spec of a sharded parameter (by TensorImpl), or nothing.
std::optional<ShardedParamSpec> find_sharded_param(const at::Tensor& t);
// The float8 cast of an unsharded parameter gathered in float8 (by the
// TensorImpl of the stand-in the module holds), or nothing.
std::optional<kernels::Float8Tensor> find_unsharded_float8(const at::Tensor& t);

}  // namespace internal
}  // namespace fsdp
