// The state one FullyShardedDataParallel shares between its parts (PyTorch
// keeps the same on the _FSDPState, see _common_utils.py). Private to
// //fsdp:fully_sharded_data_parallel.
//
// Runtime's methods are defined in the file named after the PyTorch module
// they mirror:
//   internal/init.cc             __init__: process groups, ignored modules,
//                                auto-wrap, meta-device materialisation,
//                                sync_module_states, one handle per unit
//                                (_init_utils.py)
//   internal/runtime.cc          pre/post-forward, pre/post-backward,
//                                prefetch, gradient reductions, the
//                                end-of-backward callback (_runtime_utils.py)
//   internal/unshard_params.cc   summon_full_params (_unshard_param_utils.py)
//   internal/clip_grad_norm.cc   clip_grad_norm_
//   internal/runtime_state.cc    the registry, traversal order, parameters
#pragma once

#include <torch/nn/module.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "comm/process_group.h"
#include "fsdp/flat_param.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "module_call/forward_hooks.h"

namespace fsdp {
namespace internal {

using ModulePtr = std::shared_ptr<torch::nn::Module>;

// A unit's name in messages: "<root>" for the root.
std::string describe(const std::string& fqn);
// The same, quoted.
std::string unit_name(const std::string& fqn);

struct Unit {
  std::string fqn;  // relative to the root; "" for the root
  ModulePtr module;
  std::unique_ptr<FlatParamHandle> handle;  // null: no parameters to own
  bool is_root = false;
  // Per backward pass.
  bool pre_backward_done = false;
};

enum class TrainingState { kIdle, kForward, kBackward };

// Module -> the runtime that manages it (unit modules and every module a
// unit owns), so a module is never wrapped twice.
class Registry {
 public:
  static Registry& get();
  std::shared_ptr<Runtime> find(const torch::nn::Module* module);
  void add(const torch::nn::Module* module, const std::shared_ptr<Runtime>& rt);
  // Only if `module` is still registered to `rt` (or to a runtime already
  // gone): a later wrapper of the same module keeps its entry.
  void remove(const torch::nn::Module* module, const Runtime* rt);

 private:
  std::mutex mu_;
  std::unordered_map<const torch::nn::Module*, std::weak_ptr<Runtime>> map_;
};

class Runtime : public std::enable_shared_from_this<Runtime> {
 public:
  using Options = FullyShardedDataParallel::Options;

  Runtime(ModulePtr root, Options options) : root_(std::move(root)), options_(std::move(options)) {}
  ~Runtime();

  // internal/init.cc
  void init();

  // internal/runtime.cc
  // The hooks below, on every managed module at the module call point;
  // removed again by the destructor.
  void register_forward_hooks();
  void unit_pre_forward(int unit);
  void unit_post_forward(int unit, const std::vector<at::Tensor>& outputs, bool known);
  void check_owner_gathered(const torch::nn::Module& module);
  // The root's forward threw: free what it gathered, back to idle.
  void abort_forward() noexcept;
  // A checkpointed module of `unit` is about to be recomputed in backward:
  // gather the unit and use its unsharded views.
  void prepare_recompute(int unit);
  // ... and that recomputation is about to be differentiated: finish the
  // gradient reductions in flight, so their buffers are freed before the
  // unit's backward peaks.
  void finish_reductions_in_backward();
  void pre_backward(int unit);
  void post_backward(int unit);
  void join_reduce_streams();
  void final_callback();
  // Gradient reductions started in post_backward and not yet finished, in
  // start order. Every rank starts (and, for the hybrid strategies, chains
  // the replicate all-reduce of) them in this order, so collectives match.
  void poll_reductions();
  void finish_reductions();
  void abandon_reductions() noexcept;
  // Every handle's reset_flat_param_grad_if_needed(), where PyTorch calls
  // _reset_flat_param_grad_info_if_needed: the root's pre-forward and the
  // start of backward, so gradients zero_grad set to none are freed before
  // the step's activations are.
  void reset_flat_param_grads_if_needed();

  // internal/unshard_params.cc
  void summon(const SummonOptions& options);
  void unsummon(const SummonOptions& options) noexcept;

  // internal/clip_grad_norm.cc
  at::Tensor clip_grad_norm(double max_norm, double norm_type);

  // internal/runtime_state.cc
  std::vector<int> preorder() const;
  torch::OrderedDict<std::string, at::Tensor> named_parameters() const;

  ModulePtr root_;
  Options options_;
  comm::ProcessGroup shard_group_;
  comm::ProcessGroup replicate_group_;                          // hybrid strategies only
  std::vector<std::unique_ptr<Unit>> units_;                    // creation (post-)order; root last
  std::unordered_map<const torch::nn::Module*, int> unit_of_;   // unit modules
  std::unordered_map<const torch::nn::Module*, int> owner_of_;  // all managed modules
  std::unordered_map<const torch::nn::Module*, std::string> fqn_of_;
  std::vector<std::pair<std::string, at::Tensor>> unmanaged_params_;

  TrainingState state_ = TrainingState::kIdle;
  bool no_sync_ = false;
  bool backward_started_ = false;
  bool forward_since_backward_ = false;
  int summon_depth_ = 0;
  bool forward_order_recorded_ = false;
  bool backward_order_recorded_ = false;
  std::vector<int> forward_order_, backward_order_, current_order_;
  std::vector<int> summon_grad_units_;
  std::deque<int> pending_reductions_;
  std::vector<module_call::HookHandle> hook_handles_;
  int64_t peak_unsharded_bytes_ = 0;

 private:
  // internal/init.cc: the steps of init().
  // The modules and parameters FSDP leaves alone (ignored_modules with
  // their subtrees, ignored_states).
  struct Ignored {
    std::unordered_set<const torch::nn::Module*> modules;
    std::unordered_set<const c10::TensorImpl*> params;
  };
  void resolve_groups();
  void broadcast_from_rank0(const at::Tensor& tensor);
  // Checks ignored_modules / ignored_states and that no module is managed
  // by another FSDP already.
  Ignored collect_ignored(const torch::OrderedDict<std::string, ModulePtr>& named_modules) const;
  // The unit modules auto_wrap_policy picks, post-order, the root last.
  std::vector<std::pair<std::string, ModulePtr>> auto_wrap(const Ignored& ignored) const;
  // One unit: the modules it owns, deferred initialisation, its handle over
  // the parameters no earlier unit took (recorded in `param_owner`).
  void add_unit(const std::string& fqn, const ModulePtr& module, const Ignored& ignored,
                std::unordered_map<const c10::TensorImpl*, int>& param_owner);
  // Deferred initialisation: materialises the unit's meta-device modules
  // only now, so at most one unit is ever unsharded in memory.
  void materialize(const std::string& fqn, const std::vector<ModulePtr>& owned);
  // A parameter used by modules of two units is an error.
  void check_shared_parameters(
      const torch::OrderedDict<std::string, ModulePtr>& named_modules,
      const std::unordered_map<const c10::TensorImpl*, int>& param_owner) const;
  void register_post_backward_hooks();
  // internal/runtime.cc
  void note_unsharded();
  void prefetch(int unit);
  int next_in(const std::vector<int>& order, int unit) const;
  int gathered_units() const;
};

}  // namespace internal
}  // namespace fsdp
