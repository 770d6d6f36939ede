#include "fsdp/internal/fully_shard/fsdp_state.h"

#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/custom_class.h>

#include <exception>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "fsdp/internal/comm_streams.h"

namespace fsdp {
namespace internal {
namespace {

// The registry: module -> its state (strong: the state lives as long as the
// module) and module -> the state managing its parameters; sharded
// parameter -> its FSDPParam's state.
struct Entry {
  std::weak_ptr<torch::nn::Module> module;
  std::shared_ptr<FSDPState> state;  // fully_shard applied to this module
  std::weak_ptr<FSDPState> manager;  // whose group holds its parameters
};

class Registry {
 public:
  static Registry& get() {
    static Registry* registry = new Registry();
    return *registry;
  }
  std::mutex mu;
  std::unordered_map<const torch::nn::Module*, Entry> modules;

  // Drops the entries of destroyed modules (and so their states).
  void purge() {
    for (auto it = modules.begin(); it != modules.end();) {
      if (it->second.module.expired()) {
        it = modules.erase(it);
      } else {
        ++it;
      }
    }
  }
};

// Carries the state into the post-backward node's backward.
struct StateRef : torch::CustomClassHolder {
  explicit StateRef(std::weak_ptr<FSDPState> s) : state(std::move(s)) {}
  std::weak_ptr<FSDPState> state;
};

// Identity in forward; its backward runs once the gradient w.r.t. the
// module's input is complete, i.e. after the module's backward (PyTorch's
// RegisterPostBackwardFunction).
struct PostBackwardFunction : torch::autograd::Function<PostBackwardFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            c10::IValue state) {
    ctx->saved_data["state"] = std::move(state);
    return input;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto ref = c10::static_intrusive_pointer_cast<StateRef>(ctx->saved_data["state"].toCapsule());
    if (auto state = ref->state.lock()) state->input_grad_ready();
    return {grads.at(0), at::Tensor()};
  }
};

}  // namespace

std::shared_ptr<FSDPState> state_of(const torch::nn::Module& module) {
  Registry& r = Registry::get();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.modules.find(&module);
  if (it == r.modules.end() || it->second.module.expired()) return nullptr;
  return it->second.state;
}

std::shared_ptr<FSDPState> manager_of(const torch::nn::Module& module) {
  Registry& r = Registry::get();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.modules.find(&module);
  if (it == r.modules.end() || it->second.module.expired()) return nullptr;
  return it->second.manager.lock();
}

void register_state(const std::shared_ptr<torch::nn::Module>& module,
                    const std::shared_ptr<FSDPState>& state,
                    const std::vector<std::shared_ptr<torch::nn::Module>>& managed) {
  Registry& r = Registry::get();
  std::lock_guard<std::mutex> lock(r.mu);
  r.purge();
  for (const auto& m : managed) {
    Entry& e = r.modules[m.get()];
    if (e.module.expired()) e = Entry{m, nullptr, {}};
    e.manager = state;
  }
  Entry& e = r.modules[module.get()];
  e.module = module;
  e.state = state;
  e.manager = state;
}

ShardedParamSpec spec_of(const FSDPParamGroup& group, const FSDPParam& p) {
  ShardedParamSpec spec;
  spec.global_shape = p.global_shape();
  spec.group = group.group();
  spec.rank = group.group().rank();
  spec.shard_dim = p.shard_dim();
  spec.dim0_offset = p.dim0_offset();
  spec.padded_dim0 = p.padded_dim0();
  spec.shard_offset = p.shard_offset();
  spec.padded_shard_size = p.padded_shard_size();
  if (group.replicate_group().is_member()) spec.replicate_group = group.replicate_group();
  return spec;
}

namespace {
// The states of the live modules.
std::vector<std::shared_ptr<FSDPState>> live_states() {
  std::vector<std::shared_ptr<FSDPState>> states;
  Registry& r = Registry::get();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const auto& item : r.modules) {
    if (item.second.state && !item.second.module.expired()) states.push_back(item.second.state);
  }
  return states;
}
}  // namespace

std::optional<ShardedParamSpec> find_sharded_param(const at::Tensor& t) {
  if (!t.defined()) return std::nullopt;
  for (const auto& state : live_states()) {
    FSDPParamGroup* group = state->param_group();
    if (group == nullptr) continue;
    for (const auto& p : group->params()) {
      if (p->sharded_param().is_same(t)) return spec_of(*group, *p);
    }
  }
  return std::nullopt;
}

std::optional<kernels::Float8Tensor> find_unsharded_float8(const at::Tensor& t) {
  if (!t.defined()) return std::nullopt;
  for (const auto& state : live_states()) {
    FSDPParamGroup* group = state->param_group();
    if (group == nullptr) continue;
    for (const auto& p : group->params()) {
      if (p->float8_all_gather() && p->unsharded_param().is_same(t)) return p->unsharded_float8();
    }
  }
  return std::nullopt;
}

FSDPState::FSDPState(const std::shared_ptr<torch::nn::Module>& module, std::string name,
                     std::unique_ptr<FSDPParamGroup> group, MixedPrecisionPolicy mp_policy,
                     bool auto_reshard_after_forward)
    : module_(module),
      name_(std::move(name)),
      group_(std::move(group)),
      mp_policy_(mp_policy),
      auto_reshard_after_forward_(auto_reshard_after_forward),
      context_(std::make_shared<FSDPStateContext>()) {}

FSDPState::~FSDPState() { hooks_.remove(); }

void FSDPState::register_hooks() {
  std::weak_ptr<FSDPState> weak = weak_from_this();
  module_call::ForwardHooks hooks;
  hooks.pre_forward = [weak] {
    if (auto s = weak.lock()) s->pre_forward();
  };
  hooks.map_tensor_argument = [weak](const at::Tensor& t) {
    auto s = weak.lock();
    return s ? s->map_input(t) : t;
  };
  hooks.post_forward = [weak](const std::vector<at::Tensor>& outputs, bool /*known*/) {
    if (auto s = weak.lock()) s->post_forward(outputs);
  };
  if (const std::optional<c10::ScalarType> dtype = mp_policy_.output_dtype) {
    // PyTorch's _cast_output_dtype: floating-point outputs to output_dtype.
    hooks.map_tensor_output = [dtype](const at::Tensor& t) {
      if (!t.defined() || !t.is_floating_point() || t.scalar_type() == *dtype) return t;
      return t.to(*dtype);
    };
  }
  hooks.forward_failed = [weak] {
    if (auto s = weak.lock()) s->forward_failed();
  };
  hooks_ = module_call::register_forward_hooks(module(), std::move(hooks));
}

void FSDPState::lazy_init() {
  if (is_root_.has_value()) return;
  std::shared_ptr<torch::nn::Module> root = module();
  TORCH_CHECK(root != nullptr, "fully_shard: the module was destroyed");
  is_root_ = true;
  // The root's own context (set_is_last_backward may have been called on
  // it already) becomes the tree's.
  context_->all_states.push_back(shared_from_this());
  std::unordered_set<const FSDPState*> seen{this};
  for (const auto& item : root->named_modules()) {
    std::shared_ptr<FSDPState> state = state_of(*item.value());
    if (!state || !seen.insert(state.get()).second) continue;
    TORCH_CHECK(!state->is_root_.has_value(), "FSDP state has already been lazily initialized for ",
                item.key(), "\nFSDP requires running forward through the root module first");
    state->is_root_ = false;
    state->fqn_ = item.key();
    state->context_ = context_;
    context_->all_states.push_back(state);
  }
  // One communication context for the tree: the compute device's streams
  // (none on the CPU), shared by every group.
  auto comm_ctx = std::make_shared<FSDPCommContext>();
  for (const auto& state : context_->all_states) {
    if (!state->group_) continue;
    if (!comm_ctx->streams) comm_ctx->streams = comm_streams_for(state->group_->device());
    state->group_->set_comm_context(comm_ctx);
  }
  // The root keeps its parameters after forward (backward needs them at
  // once), unless reshard_after_forward was given explicitly.
  if (auto_reshard_after_forward_ && group_) group_->set_reshard_after_forward(false);
  validate_no_duplicate_params();
}

void FSDPState::validate_no_meta_params() const {
  std::shared_ptr<torch::nn::Module> root = module();
  TORCH_CHECK(root != nullptr, "fully_shard: the module was destroyed");
  std::string units, names;
  std::unordered_set<const FSDPState*> seen;
  for (const auto& item : root->named_modules()) {
    std::shared_ptr<FSDPState> state = state_of(*item.value());
    if (!state || !seen.insert(state.get()).second) continue;
    if (!state->group_ || !state->group_->is_meta()) continue;
    units += (units.empty() ? "" : ", ") +
             (item.key().empty() ? "the root (" + state->name_ + ")" : "'" + item.key() + "'");
    for (const auto& p : state->group_->params()) {
      const std::string& name = p->fqns().front();
      names += (names.empty() ? "" : ", ") + (item.key().empty() ? name : item.key() + "." + name);
    }
  }
  TORCH_CHECK(units.empty(), "fully_shard(", name_,
              "): FSDP parameters should be materialized from meta device before training, but "
              "the following were still on meta device: [",
              names, "] (fully_shard modules ", units,
              "): call fsdp::to_empty(root, device) before the first forward to allocate the "
              "shards, then fill them (state_dict::LoadFullyShardStateDict / "
              "LoadFullyShardFrom, or fsdp::init_sharded_states)");
}

void FSDPState::validate_no_duplicate_params() const {
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& state : context().all_states) {
    if (!state->group_) continue;
    for (const auto& p : state->group_->params()) {
      // The weak reference keeps the original's TensorImpl allocated, so its
      // address identifies it even after the last strong reference went
      // (fully_shard replaced it everywhere).
      const c10::TensorImpl* orig = p->orig_param()._unsafe_get_target();
      const std::string& name = p->fqns().front();
      TORCH_CHECK(seen.insert(orig).second, "fully_shard: Parameter '",
                  state->fqn_.empty() ? name : state->fqn_ + "." + name,
                  "' is shared with a parameter already managed by another FSDP group. For "
                  "shared/tied parameters, apply fully_shard to a common ancestor of the "
                  "modules sharing it (and not to those modules), so one group holds it.");
    }
  }
}

void FSDPState::pre_forward() {
  if (!is_root_.has_value()) {
    // Checked before anything is initialised, so the same call succeeds
    // once the tree is materialised.
    validate_no_meta_params();
    lazy_init();
  }
  TORCH_CHECK(context_ != nullptr, "fully_shard: internal error: no context for ", name_);
  if (*is_root_) {
    for (const auto& s : context().all_states) {
      s->pre_backward_done_ = false;
      s->post_backward_done_ = false;
      s->pending_input_grads_ = 0;
    }
  }
  if (group_) {
    group_->unshard(/*async=*/false);
  }
  prefetch(forward_prefetch);
}

void FSDPState::prefetch(const std::vector<std::weak_ptr<FSDPState>>& states) {
  for (const auto& weak : states) {
    auto state = weak.lock();
    if (state && state->group_) state->group_->unshard(/*async=*/true);
  }
}

at::Tensor FSDPState::map_input(const at::Tensor& t) {
  at::Tensor out = t;
  if (mp_policy_.cast_forward_inputs && mp_policy_.param_dtype && out.defined() &&
      out.is_floating_point() && out.scalar_type() != *mp_policy_.param_dtype) {
    out = out.to(*mp_policy_.param_dtype);
  }
  if (group_ && out.defined() && out.requires_grad() && at::GradMode::is_enabled()) {
    ++pending_input_grads_;
    out = PostBackwardFunction::apply(
        out, c10::IValue::make_capsule(c10::make_intrusive<StateRef>(weak_from_this())));
  }
  return out;
}

void FSDPState::post_forward(const std::vector<at::Tensor>& outputs) {
  if (group_) group_->post_forward();
  if (!at::GradMode::is_enabled()) return;
  std::weak_ptr<FSDPState> weak = weak_from_this();
  for (const auto& t : outputs) {
    if (!t.defined() || !t.requires_grad()) continue;
    t.register_hook([weak](const at::Tensor&) {
      if (auto s = weak.lock()) s->pre_backward();
    });
  }
}

void FSDPState::forward_failed() noexcept {
  if (!is_root_.value_or(false) || !context_) return;
  for (const auto& s : context().all_states) {
    if (!s->group_) continue;
    try {
      s->group_->reshard();
    } catch (const std::exception&) {
      // Best effort while unwinding: the original error is what matters.
    }
  }
}

void FSDPState::pre_backward() {
  if (pre_backward_done_) return;
  pre_backward_done_ = true;
  if (!context().final_callback_queued) {
    context().final_callback_queued = true;
    std::weak_ptr<FSDPState> root = context().all_states.front();
    torch::autograd::Engine::get_default_engine().queue_callback([root] {
      if (auto r = root.lock()) r->root_final_callback();
    });
  }
  if (group_) group_->unshard(/*async=*/false);
  prefetch(backward_prefetch);
}

void FSDPState::input_grad_ready() {
  if (--pending_input_grads_ > 0) return;
  post_backward();
}

void FSDPState::post_backward() {
  if (post_backward_done_ || !group_) return;
  post_backward_done_ = true;
  FSDPParamGroup*& in_flight = context().reduce_scatter_in_flight;
  if (in_flight != nullptr && in_flight != group_.get()) in_flight->wait_for_reduce_scatter();
  in_flight = nullptr;
  group_->post_backward();
  if (group_->reduction_pending()) in_flight = group_.get();
}

void FSDPState::root_final_callback() {
  std::exception_ptr error;
  for (const auto& s : context().all_states) {
    try {
      // Modules whose inputs needed no gradient (their backward never
      // reached a post-backward node), and modules prefetched or kept
      // gathered but unused in backward: reduce what they have, reshard.
      s->post_backward();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    s->pre_backward_done_ = false;
    s->post_backward_done_ = false;
    s->pending_input_grads_ = 0;
  }
  for (const auto& s : context().all_states) {
    // A prefetched all-gather still in flight (a group kept unsharded after
    // backward): it may read the shards themselves (the shard buffer), so it
    // lands before backward returns and an optimizer steps on them.
    if (!s->group_ || !s->group_->unshard_pending()) continue;
    try {
      s->group_->wait_for_unshard();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (context().is_last_backward) {
    // PyTorch's wait_for_gradient_reduction: every reduction lands in .grad
    // before backward() returns. Otherwise they stay in flight, finished by
    // the next backward.
    for (const auto& s : context().all_states) {
      if (!s->group_) continue;
      try {
        s->group_->finish_gradient_reduction();
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
  }
  context().final_callback_queued = false;
  if (error) std::rethrow_exception(error);
}

}  // namespace internal
}  // namespace fsdp
