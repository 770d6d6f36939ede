#include "fsdp/fully_sharded_data_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <exception>
#include <limits>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "comm/collectives.h"

namespace fsdp {
namespace internal {
namespace {

using ModulePtr = std::shared_ptr<torch::nn::Module>;
using Options = FullyShardedDataParallel::Options;

std::string describe(const std::string& fqn) { return fqn.empty() ? "<root>" : fqn; }

std::string unit_name(const std::string& fqn) { return "'" + describe(fqn) + "'"; }

// Gradient reductions allowed in flight at once during backward (see
// Runtime::post_backward). One already overlaps a unit's reduction with the
// next unit's backward; on trainer_bench (2 and 4 ranks, 2 cores) two were
// no faster and held ~40 MiB more peak RSS with FULL_SHARD.
constexpr size_t kMaxReductionsInFlight = 1;

}  // namespace

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
// unit owns), so fsdp::call can find its unit from a bare module reference.
class Registry {
 public:
  static Registry& get() {
    static auto* registry = new Registry();  // leaked: used from destructors
    return *registry;
  }
  std::shared_ptr<Runtime> find(const torch::nn::Module* module) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(module);
    return it == map_.end() ? nullptr : it->second.lock();
  }
  void add(const torch::nn::Module* module, const std::shared_ptr<Runtime>& rt) {
    std::lock_guard<std::mutex> lock(mu_);
    map_[module] = rt;
  }
  void remove(const torch::nn::Module* module, const Runtime* rt) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(module);
    if (it == map_.end()) return;
    auto held = it->second.lock();
    if (held == nullptr || held.get() == rt) map_.erase(it);
  }

 private:
  std::mutex mu_;
  std::unordered_map<const torch::nn::Module*, std::weak_ptr<Runtime>> map_;
};

class Runtime : public std::enable_shared_from_this<Runtime> {
 public:
  Runtime(ModulePtr root, Options options)
      : root_(std::move(root)), options_(std::move(options)) {}
  ~Runtime();

  void init();

  Frame unit_pre_forward(int unit);
  void unit_post_forward(int unit, const std::vector<at::Tensor>& outputs, bool known);
  void check_owner_gathered(const torch::nn::Module& module);
  void pre_backward(int unit);
  void post_backward(int unit);
  void final_callback();
  // Gradient reductions started in post_backward and not yet finished, in
  // start order. Every rank starts (and, for the hybrid strategies, chains
  // the replicate all-reduce of) them in this order, so collectives match.
  void poll_reductions();
  void finish_reductions();
  void abandon_reductions() noexcept;

  void summon(const FullyShardedDataParallel::SummonOptions& options);
  void unsummon(const FullyShardedDataParallel::SummonOptions& options) noexcept;
  at::Tensor clip_grad_norm(double max_norm, double norm_type);

  std::vector<int> preorder() const;
  torch::OrderedDict<std::string, at::Tensor> named_parameters() const;

  ModulePtr root_;
  Options options_;
  comm::ProcessGroup shard_group_;
  comm::ProcessGroup replicate_group_;  // hybrid strategies only
  std::vector<std::unique_ptr<Unit>> units_;  // creation (post-)order; root last
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
  int64_t peak_unsharded_bytes_ = 0;

 private:
  void resolve_groups();
  void broadcast_from_rank0(const at::Tensor& tensor);
  void note_unsharded();
  void prefetch(int unit);
  int next_in(const std::vector<int>& order, int unit) const;
  int gathered_units() const;
};

Runtime::~Runtime() {
  for (const auto& item : owner_of_) Registry::get().remove(item.first, this);
}

void Runtime::resolve_groups() {
  const auto strategy = options_.sharding_strategy;
  const bool hybrid = is_hybrid(strategy);
  TORCH_CHECK(!(options_.process_group && options_.device_mesh),
              "FullyShardedDataParallel: Cannot pass both process_group and "
              "device_mesh at the same time. Please just pass only one of them.");
  TORCH_CHECK(!(options_.hybrid_groups && (options_.process_group || options_.device_mesh)),
              "FullyShardedDataParallel: Options::hybrid_groups given together with ",
              "process_group or device_mesh: expected exactly one of them");
  if (hybrid) {
    if (options_.hybrid_groups) {
      shard_group_ = options_.hybrid_groups->shard;
      replicate_group_ = options_.hybrid_groups->replicate;
    } else if (options_.device_mesh) {
      auto groups = comm::hybrid_shard_groups(*options_.device_mesh);
      TORCH_CHECK(groups.ok(), "FullyShardedDataParallel: device_mesh for ",
                  sharding_strategy_name(strategy), ": ", groups.status().ToString());
      shard_group_ = groups->shard;
      replicate_group_ = groups->replicate;
    } else if (options_.process_group) {
      TORCH_CHECK(false, "FullyShardedDataParallel: ", sharding_strategy_name(strategy),
                  " with a single process_group: Expected process_group to be passed "
                  "in as either None or Tuple[dist.ProcessGroup, dist.ProcessGroup]: "
                  "set Options::hybrid_groups (shard, replicate; see "
                  "comm::hybrid_shard_groups) or a 2-D Options::device_mesh");
    } else {
      TORCH_CHECK(false, "FullyShardedDataParallel: Manual wrapping with ",
                  sharding_strategy_name(strategy), " requires explicit specification "
                  "of process group or device_mesh (Options::hybrid_groups or a 2-D "
                  "Options::device_mesh).");
    }
    TORCH_CHECK(shard_group_.is_member() && replicate_group_.is_member(),
                "FullyShardedDataParallel: ", sharding_strategy_name(strategy),
                ": the calling rank must be a member of both the shard group (size ",
                shard_group_.size(), ") and the replicate group (size ",
                replicate_group_.size(), ")");
    return;
  }
  TORCH_CHECK(!options_.hybrid_groups, "FullyShardedDataParallel: Options::hybrid_groups ",
              "given with ", sharding_strategy_name(strategy), ": only HYBRID_SHARD and "
              "_HYBRID_SHARD_ZERO2 use a (shard, replicate) pair; pass process_group");
  if (options_.device_mesh) {
    TORCH_CHECK(options_.device_mesh->ndim() == 1, "FullyShardedDataParallel: ",
                sharding_strategy_name(strategy), " expects a 1-D device_mesh but got ndim=",
                options_.device_mesh->ndim());
    auto group = options_.device_mesh->get_group(0);
    TORCH_CHECK(group.ok(), "FullyShardedDataParallel: device_mesh: ",
                group.status().ToString());
    shard_group_ = *group;
  } else {
    TORCH_CHECK(options_.process_group.has_value(), "FullyShardedDataParallel: ",
                "Options::process_group is empty: expected the data-parallel group "
                "(LibTorch has no default group; see comm::init_process_group)");
    shard_group_ = *options_.process_group;
  }
  TORCH_CHECK(shard_group_.is_member(), "FullyShardedDataParallel: process_group '",
              shard_group_.name(), "' (size ", shard_group_.size(),
              "): expected the calling rank to be a member");
}

void Runtime::broadcast_from_rank0(const at::Tensor& tensor) {
  if (!tensor.defined() || tensor.numel() == 0) return;
  at::NoGradGuard no_grad;
  at::Tensor flat = tensor.detach().reshape({-1}).contiguous().clone();
  comm::broadcast(shard_group_, flat, 0).wait();
  if (is_hybrid(options_.sharding_strategy)) comm::broadcast(replicate_group_, flat, 0).wait();
  tensor.detach().copy_(flat.view(tensor.sizes()));
}

void Runtime::init() {
  resolve_groups();
  TORCH_CHECK(!(!options_.ignored_modules.empty() && !options_.ignored_states.empty()),
              "FullyShardedDataParallel: Cannot pass both ignored_modules and "
              "ignored_states at the same time. Please just pass ignored_states.");
  TORCH_CHECK(Registry::get().find(root_.get()) == nullptr, "FullyShardedDataParallel: ",
              "the module (", root_->name(), ") is already managed by another "
              "FullyShardedDataParallel: wrap it once (nested units come from "
              "auto_wrap_policy)");
  if (options_.device_id) {
    for (const auto& p : root_->parameters()) {
      if (p.device() != *options_.device_id && !p.is_meta()) {
        root_->to(*options_.device_id);
        break;
      }
    }
  }

  // Names of every module; the ignored subtrees.
  const auto named_modules = root_->named_modules("", /*include_self=*/true);
  for (const auto& item : named_modules) fqn_of_[item.value().get()] = item.key();
  std::unordered_set<const torch::nn::Module*> ignored_modules;
  for (size_t i = 0; i < options_.ignored_modules.size(); ++i) {
    const auto& m = options_.ignored_modules[i];
    TORCH_CHECK(m != nullptr, "FullyShardedDataParallel: ignored_modules[", i, "] is null");
    TORCH_CHECK(Registry::get().find(m.get()) == nullptr, "FullyShardedDataParallel: ",
                "`ignored_modules` should not include FSDP modules (ignored_modules[",
                i, "], ", m->name(), ", is managed by another FullyShardedDataParallel)");
    TORCH_CHECK(fqn_of_.count(m.get()) != 0, "FullyShardedDataParallel: ignored_modules[",
                i, "] (", m->name(), ") is not a submodule of the wrapped module");
    TORCH_CHECK(m.get() != root_.get(), "FullyShardedDataParallel: ignored_modules[", i,
                "] is the wrapped module itself: expected a submodule");
    for (const auto& sub : m->modules(/*include_self=*/true)) ignored_modules.insert(sub.get());
  }
  for (const auto& item : named_modules) {
    if (ignored_modules.count(item.value().get()) != 0) continue;
    TORCH_CHECK(Registry::get().find(item.value().get()) == nullptr,
                "FullyShardedDataParallel: submodule '", item.key(), "' (",
                item.value()->name(), ") is already managed by another "
                "FullyShardedDataParallel: wrap the model once and let "
                "auto_wrap_policy make the nested units (or list it in "
                "ignored_modules)");
  }
  std::unordered_set<const c10::TensorImpl*> ignored_params;
  for (const auto* m : ignored_modules) {
    for (const auto& p : m->parameters(/*recurse=*/false)) {
      ignored_params.insert(p.unsafeGetTensorImpl());
    }
  }
  {
    std::unordered_set<const c10::TensorImpl*> all_params;
    for (const auto& p : root_->parameters()) all_params.insert(p.unsafeGetTensorImpl());
    for (size_t i = 0; i < options_.ignored_states.size(); ++i) {
      const auto& t = options_.ignored_states[i];
      TORCH_CHECK(t.defined() && all_params.count(t.unsafeGetTensorImpl()) != 0,
                  "FullyShardedDataParallel: ignored_states[", i, "] is not a parameter ",
                  "of the wrapped module: ignored_states expects the module's own "
                  "parameter tensors");
      ignored_params.insert(t.unsafeGetTensorImpl());
    }
  }

  // Auto-wrap: post-order over the tree, counting each parameter once.
  std::vector<std::pair<std::string, ModulePtr>> unit_modules;
  std::unordered_set<const c10::TensorImpl*> counted;
  std::function<int64_t(const ModulePtr&, const std::string&)> visit =
      [&](const ModulePtr& module, const std::string& fqn) -> int64_t {
    if (ignored_modules.count(module.get()) != 0) return 0;
    int64_t numel = 0;
    for (const auto& child : module->named_children()) {
      numel += visit(child.value(), fqn.empty() ? child.key() : fqn + "." + child.key());
    }
    for (const auto& p : module->parameters(/*recurse=*/false)) {
      if (!p.defined() || ignored_params.count(p.unsafeGetTensorImpl()) != 0) continue;
      if (counted.insert(p.unsafeGetTensorImpl()).second) numel += p.numel();
    }
    if (module.get() == root_.get()) return numel;
    if (options_.auto_wrap_policy && options_.auto_wrap_policy.should_wrap(*module, fqn, numel)) {
      unit_modules.emplace_back(fqn, module);
      return 0;
    }
    return numel;
  };
  visit(root_, "");
  unit_modules.emplace_back("", root_);

  // One handle per unit, deepest first, each over what no earlier unit took.
  FlatParamOptions handle_options;
  handle_options.sharding_strategy = options_.sharding_strategy;
  handle_options.mixed_precision = options_.mixed_precision;
  handle_options.offload_params = options_.cpu_offload.offload_params;
  handle_options.use_orig_params = options_.use_orig_params;
  handle_options.compute_device = options_.device_id;
  std::unordered_map<const c10::TensorImpl*, int> param_owner;
  for (auto& [fqn, module] : unit_modules) {
    const int index = static_cast<int>(units_.size());
    auto unit = std::make_unique<Unit>();
    unit->fqn = fqn;
    unit->module = module;
    unit->is_root = module.get() == root_.get();
    std::vector<ModulePtr> owned;
    for (const auto& sub : module->modules(/*include_self=*/true)) {
      if (ignored_modules.count(sub.get()) != 0 || owner_of_.count(sub.get()) != 0) continue;
      owner_of_[sub.get()] = index;
      owned.push_back(sub);
    }
    unit_of_[module.get()] = index;
    // Deferred initialisation: materialise this unit's modules only now, so
    // at most one unit is ever unsharded in memory.
    bool any_meta = false;
    for (const auto& sub : owned) {
      for (const auto& p : sub->parameters(false)) any_meta |= p.defined() && p.is_meta();
      for (const auto& b : sub->buffers(false)) any_meta |= b.defined() && b.is_meta();
    }
    if (any_meta) {
      TORCH_CHECK(options_.param_init_fn != nullptr, "FullyShardedDataParallel: unit ",
                  unit_name(fqn), " has parameters or buffers on the meta device: "
                  "expected Options::param_init_fn to materialise them (LibTorch "
                  "modules have no reset_parameters() FSDP could call)");
      for (const auto& sub : owned) options_.param_init_fn(*sub);
      for (const auto& sub : owned) {
        for (const auto& p : sub->named_parameters(false)) {
          TORCH_CHECK(!p.value().defined() || !p.value().is_meta(),
                      "FullyShardedDataParallel: param_init_fn left parameter '",
                      p.key(), "' of ", unit_name(fqn), " on the meta device");
        }
      }
    }
    std::vector<std::string> names;
    for (const auto& p : module->named_parameters(/*recurse=*/true)) {
      const auto* impl = p.value().unsafeGetTensorImpl();
      if (!p.value().defined() || ignored_params.count(impl) != 0) continue;
      if (param_owner.count(impl) != 0) continue;
      param_owner[impl] = index;
      if (options_.sync_module_states) broadcast_from_rank0(p.value());
      names.push_back(p.key());
    }
    if (!names.empty()) {
      unit->handle = std::make_unique<FlatParamHandle>(
          module, names, shard_group_, handle_options,
          is_hybrid(options_.sharding_strategy) ? replicate_group_ : comm::ProcessGroup());
    }
    units_.push_back(std::move(unit));
  }

  // A parameter used by modules of two different units would be read
  // sharded by one of them: PyTorch requires it inside one unit, too.
  for (const auto& item : named_modules) {
    auto owner = owner_of_.find(item.value().get());
    if (owner == owner_of_.end()) continue;
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      auto taken = param_owner.find(p.value().unsafeGetTensorImpl());
      if (taken == param_owner.end() || taken->second == owner->second) continue;
      const std::string name = item.key().empty() ? p.key() : item.key() + "." + p.key();
      TORCH_CHECK(false, "FullyShardedDataParallel: parameter '", name, "' is shared ",
                  "by FSDP units ", unit_name(units_[taken->second]->fqn), " and ",
                  unit_name(units_[owner->second]->fqn), ": a shared parameter must "
                  "live inside one unit; change auto_wrap_policy so their common "
                  "ancestor wraps both");
    }
  }

  at::NoGradGuard no_grad;
  for (const auto& item : root_->named_parameters()) {
    if (param_owner.count(item.value().unsafeGetTensorImpl()) == 0) {
      unmanaged_params_.emplace_back(item.key(), item.value());
    }
  }
  if (options_.sync_module_states) {
    for (const auto& b : root_->buffers()) broadcast_from_rank0(b);
    for (const auto& p : unmanaged_params_) broadcast_from_rank0(p.second);
  }
  if (options_.mixed_precision.buffer_dtype) {
    cast_buffers(*root_, *options_.mixed_precision.buffer_dtype);
  }

  std::weak_ptr<Runtime> weak = weak_from_this();
  for (int i = 0; i < static_cast<int>(units_.size()); ++i) {
    auto& handle = units_[i]->handle;
    if (!handle) continue;
    bool trainable = false;
    for (const auto& info : handle->param_infos()) trainable |= info.requires_grad;
    if (!trainable) continue;
    handle->register_post_backward_hook([weak, i] {
      if (auto rt = weak.lock()) rt->post_backward(i);
    });
  }
  for (const auto& item : owner_of_) Registry::get().add(item.first, shared_from_this());
}

std::vector<int> Runtime::preorder() const {
  std::vector<int> order;
  for (const auto& m : root_->modules(/*include_self=*/true)) {
    auto it = unit_of_.find(m.get());
    if (it != unit_of_.end()) order.push_back(it->second);
  }
  return order;
}

void Runtime::note_unsharded() {
  int64_t total = 0;
  for (const auto& unit : units_) {
    if (unit->handle) total += unit->handle->unsharded_storage_nbytes();
  }
  peak_unsharded_bytes_ = std::max(peak_unsharded_bytes_, total);
}

int Runtime::gathered_units() const {
  int n = 0;
  for (const auto& unit : units_) {
    if (unit->is_root || !unit->handle || !uses_sharding(options_.sharding_strategy)) continue;
    if (unit->handle->is_unsharded() || unit->handle->is_unsharding()) ++n;
  }
  return n;
}

int Runtime::next_in(const std::vector<int>& order, int unit) const {
  auto it = std::find(order.begin(), order.end(), unit);
  if (it == order.end() || ++it == order.end()) return -1;
  return *it;
}

void Runtime::prefetch(int unit) {
  if (unit < 0) return;
  auto& handle = units_[unit]->handle;
  if (!handle || handle->is_unsharded() || handle->is_unsharding()) return;
  // The rate limiter: on the CPU there is no stream to block, so instead of
  // waiting for a free the prefetch is skipped (the unit is then gathered on
  // demand), which keeps at most two units' parameters gathered.
  if (options_.limit_all_gathers && gathered_units() >= 2) return;
  handle->unshard(/*async=*/true);
  note_unsharded();
}

Frame Runtime::unit_pre_forward(int index) {
  Unit& unit = *units_[index];
  if (unit.is_root) {
    if (state_ == TrainingState::kBackward) {
      // The last backward failed before its final callback ran (an error
      // inside it): start over from a clean state. Its partial, unreduced
      // gradients are dropped so they cannot leak into this iteration.
      for (auto& u : units_) {
        if (u->handle) u->handle->clear_unsharded_grad();
      }
      final_callback();
    }
    TORCH_CHECK(state_ == TrainingState::kIdle, "FullyShardedDataParallel::forward: ",
                "called while a forward is running: the root's forward must not be "
                "re-entered");
    TORCH_CHECK(summon_depth_ == 0, "FullyShardedDataParallel::forward: called inside ",
                "summon_full_params: leave its scope first");
    // Normally final_callback finished them; not if backward never reached it.
    finish_reductions();
    state_ = TrainingState::kForward;
    forward_since_backward_ = true;
    current_order_.clear();
  } else {
    TORCH_CHECK(state_ == TrainingState::kForward, "fsdp::call(", describe(unit.fqn),
                "): this FSDP unit was called outside its root's forward: call the "
                "FullyShardedDataParallel object (forward or operator()) and let the "
                "root module call its units");
  }
  if (!forward_order_recorded_) current_order_.push_back(index);
  if (unit.handle) {
    try {
      unit.handle->unshard();
      unit.handle->use_unsharded_views();
    } catch (...) {
      if (unit.is_root) state_ = TrainingState::kIdle;
      throw;
    }
    note_unsharded();
  }
  if (options_.forward_prefetch && forward_order_recorded_) {
    prefetch(next_in(forward_order_, index));
  }
  Frame frame;
  frame.rt = shared_from_this();
  frame.unit = index;
  frame.root = unit.is_root;
  return frame;
}

void Runtime::unit_post_forward(int index, const std::vector<at::Tensor>& outputs,
                                bool known) {
  Unit& unit = *units_[index];
  const bool grad = at::GradMode::is_enabled();
  bool resharded = false;
  if (unit.handle && ((!unit.is_root && unit.handle->reshard_after_forward()) || !grad)) {
    unit.handle->reshard();
    resharded = true;
  }
  if (grad) {
    bool hooked = false;
    std::weak_ptr<Runtime> weak = weak_from_this();
    for (const auto& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      t.register_hook([weak, index](const at::Tensor&) {
        if (auto rt = weak.lock()) rt->pre_backward(index);
      });
      hooked = true;
    }
    TORCH_CHECK(known || hooked || !resharded, "fsdp::call(", describe(unit.fqn),
                "): the unit's forward returned a type FSDP cannot look into, so its "
                "backward could not gather its parameters again: return at::Tensor, "
                "std::vector<at::Tensor>, or a std::tuple/std::pair of those");
  }
  if (unit.is_root) {
    if (!forward_order_recorded_) {
      forward_order_ = current_order_;
      forward_order_recorded_ = true;
    }
    state_ = TrainingState::kIdle;
  }
}

void Runtime::check_owner_gathered(const torch::nn::Module& module) {
  auto owner = owner_of_.find(&module);
  if (owner == owner_of_.end()) return;
  const Unit& unit = *units_[owner->second];
  if (!unit.handle || unit.handle->is_unsharded()) return;
  auto name = fqn_of_.find(&module);
  TORCH_CHECK(false, "fsdp::call(", name == fqn_of_.end() ? module.name() : describe(name->second),
              "): module ", module.name(), " belongs to FSDP unit ", unit_name(unit.fqn),
              " whose parameters are sharded; call ", unit_name(unit.fqn),
              " through fsdp::call (the root through FullyShardedDataParallel::forward)");
}

void Runtime::pre_backward(int index) {
  if (!backward_started_) {
    TORCH_CHECK(forward_since_backward_, "FullyShardedDataParallel: backward through a "
                "graph whose backward already ran (retain_graph=true reuse or double "
                "backward) is not supported: FSDP reduced and freed the gradients and "
                "parameters of that pass; run forward again");
    backward_started_ = true;
    state_ = TrainingState::kBackward;
    current_order_.clear();
    std::weak_ptr<Runtime> weak = weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto rt = weak.lock()) rt->final_callback();
    });
  }
  Unit& unit = *units_[index];
  if (unit.pre_backward_done) return;
  unit.pre_backward_done = true;
  if (!backward_order_recorded_) current_order_.push_back(index);
  if (unit.handle) {
    unit.handle->unshard();  // no-op when still gathered (or prefetched)
    note_unsharded();
  }
  if (options_.backward_prefetch == BackwardPrefetch::kBackwardPre && backward_order_recorded_) {
    prefetch(next_in(backward_order_, index));
  }
  // Free the buffers of reductions that completed meanwhile.
  poll_reductions();
}

void Runtime::post_backward(int index) {
  Unit& unit = *units_[index];
  if (!unit.handle) return;
  if (!no_sync_) {
    // Start the reduction and let backward go on; final_callback (queued by
    // the first pre_backward) waits for it before the optimizer can see the
    // gradients. Reductions that completed meanwhile are finished here, so
    // only the unsharded gradients of those in flight stay alive.
    try {
      if (unit.handle->reduce_grad_pending()) finish_reductions();
      if (unit.handle->start_reduce_grad()) pending_reductions_.push_back(index);
      if (backward_started_) {
        poll_reductions();
        // Bound the memory: at most kMaxReductionsInFlight units' unsharded
        // gradients (and reduction buffers) wait for their collectives; the
        // oldest is waited for beyond that (PyTorch's CUDA streams hold
        // more; the CPU gains nothing from a longer queue).
        while (pending_reductions_.size() > kMaxReductionsInFlight) {
          units_[pending_reductions_.front()]->handle->finish_reduce_grad();
          pending_reductions_.pop_front();
        }
      } else {
        // No end-of-backward callback was queued (backward did not enter
        // through a unit's output): finish now, as a blocking reduction.
        finish_reductions();
      }
    } catch (...) {
      abandon_reductions();
      throw;
    }
  }
  unit.handle->reshard();
  if (options_.backward_prefetch == BackwardPrefetch::kBackwardPost && backward_order_recorded_) {
    prefetch(next_in(backward_order_, index));
  }
}

void Runtime::poll_reductions() {
  try {
    for (auto it = pending_reductions_.begin(); it != pending_reductions_.end();) {
      FlatParamHandle& handle = *units_[*it]->handle;
      if (handle.advance_reduce_grad(/*block=*/false)) {
        it = pending_reductions_.erase(it);
        continue;
      }
      // A later unit must not start its replicate all-reduce before this one.
      if (!handle.reduce_grad_issued()) break;
      ++it;
    }
  } catch (...) {
    abandon_reductions();
    throw;
  }
}

void Runtime::finish_reductions() {
  if (pending_reductions_.empty()) return;
  try {
    // Hybrid: start every replicate all-reduce (in order) before waiting for
    // any of them, so they overlap one another.
    for (int i : pending_reductions_) units_[i]->handle->issue_reduce_grad();
    while (!pending_reductions_.empty()) {
      units_[pending_reductions_.front()]->handle->finish_reduce_grad();
      pending_reductions_.pop_front();
    }
  } catch (...) {
    abandon_reductions();
    throw;
  }
}

void Runtime::abandon_reductions() noexcept {
  for (int i : pending_reductions_) units_[i]->handle->abandon_reduce_grad();
  pending_reductions_.clear();
}

void Runtime::final_callback() {
  // The gradients must be final before backward returns. An error (a peer
  // died, a timeout) is rethrown from backward once the state is reset.
  std::exception_ptr error;
  try {
    finish_reductions();
  } catch (...) {
    error = std::current_exception();
  }
  for (auto& unit : units_) {
    // Prefetched but unused, or a unit whose parameters got no gradient.
    if (unit->handle) unit->handle->reshard();
    unit->pre_backward_done = false;
  }
  if (!backward_order_recorded_) {
    backward_order_ = current_order_;
    backward_order_recorded_ = true;
  }
  backward_started_ = false;
  forward_since_backward_ = false;
  state_ = TrainingState::kIdle;
  if (error) std::rethrow_exception(error);
}

void Runtime::summon(const FullyShardedDataParallel::SummonOptions& options) {
  TORCH_CHECK(state_ == TrainingState::kIdle, "summon_full_params: called during ",
              state_ == TrainingState::kForward ? "forward" : "backward",
              ": expected it outside forward and backward");
  TORCH_CHECK(!(options.writeback && options.rank0_only), "summon_full_params: "
              "writeback=True and rank0_only=True is not supported, as model parameter "
              "shapes will be different across ranks, and writing to them can lead to "
              "inconsistencies across ranks when the context is exited.");
  TORCH_CHECK(!options.with_grads || options_.use_orig_params, "summon_full_params: "
              "with_grads=True requires use_orig_params=True");
  if (summon_depth_ == 0) finish_reductions();
  if (summon_depth_++ > 0) return;  // nested: already gathered
  const bool keep = !options.rank0_only || shard_group_.global_rank() == 0;
  try {
    summon_grad_units_.clear();
    for (int i : preorder()) {
      auto& handle = units_[i]->handle;
      if (!handle) continue;
      UnshardOptions unshard_options;
      unshard_options.full_precision = true;
      handle->unshard(/*async=*/false, unshard_options);
      TORCH_CHECK(!options.offload_to_cpu || handle->unsharded_flat_param().device().is_cpu(),
                  "summon_full_params: offload_to_cpu with a non-CPU compute device is "
                  "not implemented yet");
      handle->use_unsharded_views();
      if (options.with_grads) {
        at::Tensor grad = handle->flat_param().grad();
        if (grad.defined()) {
          at::NoGradGuard no_grad;
          at::Tensor full = grad;
          if (uses_sharding(options_.sharding_strategy)) {
            full = at::empty({handle->padded_numel()}, grad.options());
            comm::all_gather_into_tensor(shard_group_, full, grad.contiguous()).wait();
          }
          if (keep) {
            const auto params = handle->module()->named_parameters();
            for (const auto& info : handle->param_infos()) {
              if (!info.requires_grad) continue;
              at::Tensor g = full.narrow(0, info.offset, info.numel).view(info.shape);
              params[info.fqn].mutable_grad() = g;
            }
            summon_grad_units_.push_back(i);
          }
        }
      }
      if (!keep) handle->reshard(/*writeback=*/false);
    }
  } catch (...) {
    summon_depth_ = 0;
    for (auto& unit : units_) {
      if (unit->handle) unit->handle->reshard(false);
    }
    throw;
  }
}

void Runtime::unsummon(const FullyShardedDataParallel::SummonOptions& options) noexcept {
  if (--summon_depth_ > 0) return;
  for (int i : summon_grad_units_) {
    auto& handle = units_[i]->handle;
    const auto params = handle->module()->named_parameters();
    for (const auto& info : handle->param_infos()) {
      if (const at::Tensor* p = params.find(info.fqn)) p->mutable_grad().reset();
    }
  }
  summon_grad_units_.clear();
  for (auto& unit : units_) {
    if (!unit->handle) continue;
    try {
      unit->handle->reshard(options.writeback && !options.rank0_only);
    } catch (const std::exception&) {
      // A destructor must not throw; reshard only fails on a broken gather,
      // which the next collective reports.
    }
  }
}

at::Tensor Runtime::clip_grad_norm(double max_norm, double norm_type) {
  TORCH_CHECK(state_ == TrainingState::kIdle, "clip_grad_norm_: called during forward or ",
              "backward: expected it after backward, before optimizer.step()");
  TORCH_CHECK(norm_type > 0 || std::isinf(norm_type), "clip_grad_norm_: norm_type=",
              norm_type, ": expected p > 0 or inf");
  TORCH_CHECK(max_norm >= 0, "clip_grad_norm_: max_norm=", max_norm, ": expected >= 0");
  finish_reductions();
  const bool inf = std::isinf(norm_type);
  at::NoGradGuard no_grad;
  auto combine = [&](at::Tensor& acc, const at::Tensor& grad) {
    at::Tensor g = grad.detach().to(at::kDouble);
    if (inf) {
      acc = at::maximum(acc, g.abs().max());
    } else {
      acc = acc + at::linalg_vector_norm(g, norm_type).pow(norm_type);
    }
  };
  at::Tensor sharded = at::zeros({1}, at::kDouble);
  at::Tensor local = at::zeros({1}, at::kDouble);
  std::vector<at::Tensor> grads;
  for (auto& unit : units_) {
    if (!unit->handle) continue;
    const at::Tensor& grad = unit->handle->flat_param().grad();
    if (!grad.defined()) continue;
    grads.push_back(grad);
    if (grad.numel() == 0) continue;
    combine(uses_sharding(options_.sharding_strategy) ? sharded : local, grad);
  }
  for (const auto& item : unmanaged_params_) {
    const at::Tensor& grad = item.second.grad();
    if (!grad.defined()) continue;
    grads.push_back(grad);
    if (grad.numel() > 0) combine(local, grad);
  }
  // Shards are disjoint within the shard group and identical across
  // replicas, so only the shard group is reduced over.
  comm::all_reduce(shard_group_, sharded, inf ? comm::ReduceOp::kMax : comm::ReduceOp::kSum)
      .wait();
  at::Tensor total = inf ? at::maximum(sharded, local)
                         : (sharded + local).pow(1.0 / norm_type);
  const double norm = total.item<double>();
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (auto& g : grads) g.mul_(coef);
  }
  return total.to(at::kFloat).reshape({});
}

torch::OrderedDict<std::string, at::Tensor> Runtime::named_parameters() const {
  torch::OrderedDict<std::string, at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  if (options_.use_orig_params) {
    for (const auto& item : root_->named_parameters()) {
      if (seen.insert(item.value().unsafeGetTensorImpl()).second) {
        out.insert(item.key(), item.value());
      }
    }
    return out;
  }
  for (int i : preorder()) {
    const auto& unit = *units_[i];
    if (!unit.handle) continue;
    out.insert(unit.fqn.empty() ? "flat_param" : unit.fqn + ".flat_param",
               unit.handle->flat_param());
  }
  for (const auto& item : unmanaged_params_) {
    if (seen.insert(item.second.unsafeGetTensorImpl()).second) {
      out.insert(item.first, item.second);
    }
  }
  return out;
}

// ---- call-point entry ------------------------------------------------------

Frame pre_forward(torch::nn::Module& module) {
  std::shared_ptr<Runtime> rt = Registry::get().find(&module);
  if (!rt) return Frame();
  auto unit = rt->unit_of_.find(&module);
  if (unit != rt->unit_of_.end()) return rt->unit_pre_forward(unit->second);
  rt->check_owner_gathered(module);
  return Frame();
}

void post_forward(const Frame& frame, const std::vector<at::Tensor>& outputs, bool known) {
  if (!frame.rt) return;
  frame.rt->unit_post_forward(frame.unit, outputs, known);
}

void abort_forward(const Frame& frame) noexcept {
  if (!frame.rt || !frame.root) return;
  for (auto& unit : frame.rt->units_) {
    if (!unit->handle) continue;
    try {
      unit->handle->reshard();
    } catch (const std::exception&) {
      // Best effort while unwinding: the original error is what matters.
    }
  }
  frame.rt->current_order_.clear();
  frame.rt->state_ = TrainingState::kIdle;
}

c10::optional<c10::ScalarType> input_dtype(const Frame& frame) {
  if (!frame.rt) return c10::nullopt;
  return frame.rt->options_.mixed_precision.param_dtype;
}

std::vector<at::Tensor> any_value_tensors(torch::nn::AnyValue& value, bool* known) {
  std::vector<at::Tensor> out;
  *known = true;
  if (auto* t = value.try_get<at::Tensor>()) {
    collect_tensors(*t, &out);
  } else if (auto* v = value.try_get<std::vector<at::Tensor>>()) {
    collect_tensors(*v, &out);
  } else if (auto* t2 = value.try_get<std::tuple<at::Tensor, at::Tensor>>()) {
    collect_tensors(*t2, &out);
  } else if (auto* t3 = value.try_get<std::tuple<at::Tensor, at::Tensor, at::Tensor>>()) {
    collect_tensors(*t3, &out);
  } else {
    *known = false;
  }
  return out;
}

namespace {
torch::nn::AnyValue call_any(torch::nn::AnyModule& module, std::vector<torch::nn::AnyValue> args) {
  Frame frame = pre_forward(*module.ptr());
  torch::nn::AnyValue out = torch::nn::AnyValue(0);
  switch (args.size()) {
    case 0:
      out = module.any_forward();
      break;
    case 1:
      out = module.any_forward(std::move(args[0]));
      break;
    case 2:
      out = module.any_forward(std::move(args[0]), std::move(args[1]));
      break;
    case 3:
      out = module.any_forward(std::move(args[0]), std::move(args[1]), std::move(args[2]));
      break;
    default:
      TORCH_CHECK(false, "fsdp: a torch::nn::Sequential driven by FSDP was called with ",
                  args.size(), " arguments: expected at most 3");
  }
  bool known = false;
  std::vector<at::Tensor> tensors = any_value_tensors(out, &known);
  post_forward(frame, tensors, known);
  return out;
}
}  // namespace

torch::nn::AnyValue sequential_forward(torch::nn::SequentialImpl& sequential,
                                       std::vector<torch::nn::AnyValue> args) {
  TORCH_CHECK(!sequential.is_empty(), "fsdp: cannot call forward() on an empty Sequential");
  auto it = sequential.begin();
  torch::nn::AnyValue value = call_any(*it, std::move(args));
  for (++it; it != sequential.end(); ++it) {
    std::vector<torch::nn::AnyValue> next;
    next.push_back(std::move(value));
    value = call_any(*it, std::move(next));
  }
  return value;
}

}  // namespace internal

// ---- FullyShardedDataParallel ---------------------------------------------

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                   Options options) {
  TORCH_CHECK(module != nullptr, "FullyShardedDataParallel: module is null");
  rt_ = std::make_shared<internal::Runtime>(std::move(module), std::move(options));
  rt_->init();
}

FullyShardedDataParallel::~FullyShardedDataParallel() = default;

void FullyShardedDataParallel::check_root_callable() const {
  TORCH_CHECK(root_sequential_ != nullptr || !root_any_.is_empty(),
              "FullyShardedDataParallel::forward: the root module (", rt_->root_->name(),
              ") has no single forward() FSDP could call (wrapped type-erased, or its "
              "forward is a template or overloaded): wrap the typed module "
              "(std::shared_ptr<Impl> or its ModuleHolder), or enter the root through "
              "FullyShardedDataParallel::run(fn)");
}

std::vector<at::Tensor> FullyShardedDataParallel::parameters() const {
  return rt_->named_parameters().values();
}

torch::OrderedDict<std::string, at::Tensor> FullyShardedDataParallel::named_parameters() const {
  return rt_->named_parameters();
}

torch::OrderedDict<std::string, at::Tensor> FullyShardedDataParallel::named_buffers() const {
  torch::OrderedDict<std::string, at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : rt_->root_->named_buffers()) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.insert(item.key(), item.value());
  }
  return out;
}

at::Tensor FullyShardedDataParallel::clip_grad_norm_(double max_norm, double norm_type) {
  return rt_->clip_grad_norm(max_norm, norm_type);
}

FullyShardedDataParallel::NoSyncGuard FullyShardedDataParallel::no_sync() {
  return NoSyncGuard(rt_);
}

FullyShardedDataParallel::NoSyncGuard::NoSyncGuard(std::shared_ptr<internal::Runtime> rt)
    : rt_(std::move(rt)) {
  TORCH_CHECK(rt_->state_ == internal::TrainingState::kIdle, "no_sync: called during ",
              "forward or backward: expected it around whole iterations");
  TORCH_CHECK(!rt_->no_sync_, "no_sync: already inside a no_sync() scope");
  rt_->finish_reductions();
  rt_->no_sync_ = true;
}

FullyShardedDataParallel::NoSyncGuard::NoSyncGuard(NoSyncGuard&& other) noexcept
    : rt_(std::move(other.rt_)) {}

FullyShardedDataParallel::NoSyncGuard::~NoSyncGuard() {
  if (rt_) rt_->no_sync_ = false;
}

FullyShardedDataParallel::FullParamsGuard FullyShardedDataParallel::summon_full_params(
    SummonOptions options) {
  return FullParamsGuard(rt_, options);
}

FullyShardedDataParallel::FullParamsGuard::FullParamsGuard(
    std::shared_ptr<internal::Runtime> rt, SummonOptions options)
    : rt_(std::move(rt)), options_(options) {
  rt_->summon(options_);
}

FullyShardedDataParallel::FullParamsGuard::FullParamsGuard(FullParamsGuard&& other) noexcept
    : rt_(std::move(other.rt_)), options_(other.options_) {}

FullyShardedDataParallel::FullParamsGuard::~FullParamsGuard() {
  if (rt_) rt_->unsummon(options_);
}

void FullyShardedDataParallel::apply(const std::function<void(torch::nn::Module&)>& fn) {
  TORCH_CHECK(fn != nullptr, "FullyShardedDataParallel::apply: fn is empty");
  SummonOptions options;
  options.writeback = true;
  auto guard = summon_full_params(options);
  at::NoGradGuard no_grad;
  rt_->root_->apply(fn);
}

std::vector<std::shared_ptr<torch::nn::Module>> FullyShardedDataParallel::fsdp_modules() const {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (int i : rt_->preorder()) out.push_back(rt_->units_[i]->module);
  return out;
}

std::vector<std::string> FullyShardedDataParallel::fsdp_unit_names() const {
  std::vector<std::string> out;
  for (int i : rt_->preorder()) out.push_back(rt_->units_[i]->fqn);
  return out;
}

std::vector<const FlatParamHandle*> FullyShardedDataParallel::handles() const {
  std::vector<const FlatParamHandle*> out;
  for (int i : rt_->preorder()) out.push_back(rt_->units_[i]->handle.get());
  return out;
}

int64_t FullyShardedDataParallel::peak_unsharded_bytes() const {
  return rt_->peak_unsharded_bytes_;
}

void FullyShardedDataParallel::reset_peak_unsharded_bytes() { rt_->peak_unsharded_bytes_ = 0; }

const std::shared_ptr<torch::nn::Module>& FullyShardedDataParallel::module() const {
  return rt_->root_;
}

const FullyShardedDataParallel::Options& FullyShardedDataParallel::options() const {
  return rt_->options_;
}

}  // namespace fsdp
