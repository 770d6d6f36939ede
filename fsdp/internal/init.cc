// FSDP initialisation (PyTorch's _init_utils.py): the process groups of the
// sharding strategy, ignored modules and parameters, moving to device_id,
// auto-wrap into units, deferred (meta-device) initialisation unit by unit,
// sync_module_states, one FlatParamHandle per unit, and the post-backward
// hooks, registry entries and module call point hooks the runtime needs.
#include <ATen/ATen.h>

#include <functional>
#include <unordered_map>
#include <unordered_set>

#include "comm/collectives.h"
#include "comm/device_mesh.h"
#include "fsdp/internal/runtime_state.h"
#include "fsdp/mixed_precision.h"
#include "fsdp/sharding_strategy.h"

namespace fsdp {
namespace internal {

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
                  sharding_strategy_name(strategy),
                  " requires explicit specification "
                  "of process group or device_mesh (Options::hybrid_groups or a 2-D "
                  "Options::device_mesh).");
    }
    TORCH_CHECK(shard_group_.is_member() && replicate_group_.is_member(),
                "FullyShardedDataParallel: ", sharding_strategy_name(strategy),
                ": the calling rank must be a member of both the shard group (size ",
                shard_group_.size(), ") and the replicate group (size ", replicate_group_.size(),
                ")");
    return;
  }
  TORCH_CHECK(!options_.hybrid_groups, "FullyShardedDataParallel: Options::hybrid_groups ",
              "given with ", sharding_strategy_name(strategy),
              ": only HYBRID_SHARD and "
              "_HYBRID_SHARD_ZERO2 use a (shard, replicate) pair; pass process_group");
  if (options_.device_mesh) {
    TORCH_CHECK(options_.device_mesh->ndim() == 1,
                "FullyShardedDataParallel: ", sharding_strategy_name(strategy),
                " expects a 1-D device_mesh but got ndim=", options_.device_mesh->ndim());
    auto group = options_.device_mesh->get_group(0);
    TORCH_CHECK(group.ok(), "FullyShardedDataParallel: device_mesh: ", group.status().ToString());
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
  TORCH_CHECK(Registry::get().find(root_.get()) == nullptr,
              "FullyShardedDataParallel: ", "the module (", root_->name(),
              ") is already managed by another "
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
  const Ignored ignored = collect_ignored(named_modules);

  std::unordered_map<const c10::TensorImpl*, int> param_owner;
  for (auto& [fqn, module] : auto_wrap(ignored)) add_unit(fqn, module, ignored, param_owner);
  check_shared_parameters(named_modules, param_owner);

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

  register_post_backward_hooks();
  for (const auto& item : owner_of_) Registry::get().add(item.first, shared_from_this());
  register_forward_hooks();
}

Runtime::Ignored Runtime::collect_ignored(
    const torch::OrderedDict<std::string, ModulePtr>& named_modules) const {
  Ignored ignored;
  for (size_t i = 0; i < options_.ignored_modules.size(); ++i) {
    const auto& m = options_.ignored_modules[i];
    TORCH_CHECK(m != nullptr, "FullyShardedDataParallel: ignored_modules[", i, "] is null");
    TORCH_CHECK(Registry::get().find(m.get()) == nullptr, "FullyShardedDataParallel: ",
                "`ignored_modules` should not include FSDP modules (ignored_modules[", i, "], ",
                m->name(), ", is managed by another FullyShardedDataParallel)");
    TORCH_CHECK(fqn_of_.count(m.get()) != 0, "FullyShardedDataParallel: ignored_modules[", i, "] (",
                m->name(), ") is not a submodule of the wrapped module");
    TORCH_CHECK(m.get() != root_.get(), "FullyShardedDataParallel: ignored_modules[", i,
                "] is the wrapped module itself: expected a submodule");
    for (const auto& sub : m->modules(/*include_self=*/true)) ignored.modules.insert(sub.get());
  }
  for (const auto& item : named_modules) {
    if (ignored.modules.count(item.value().get()) != 0) continue;
    TORCH_CHECK(Registry::get().find(item.value().get()) == nullptr,
                "FullyShardedDataParallel: submodule '", item.key(), "' (", item.value()->name(),
                ") is already managed by another "
                "FullyShardedDataParallel: wrap the model once and let "
                "auto_wrap_policy make the nested units (or list it in "
                "ignored_modules)");
  }
  for (const auto* m : ignored.modules) {
    for (const auto& p : m->parameters(/*recurse=*/false)) {
      ignored.params.insert(p.unsafeGetTensorImpl());
    }
  }
  std::unordered_set<const c10::TensorImpl*> all_params;
  for (const auto& p : root_->parameters()) all_params.insert(p.unsafeGetTensorImpl());
  for (size_t i = 0; i < options_.ignored_states.size(); ++i) {
    const auto& t = options_.ignored_states[i];
    TORCH_CHECK(t.defined() && all_params.count(t.unsafeGetTensorImpl()) != 0,
                "FullyShardedDataParallel: ignored_states[", i, "] is not a parameter ",
                "of the wrapped module: ignored_states expects the module's own "
                "parameter tensors");
    ignored.params.insert(t.unsafeGetTensorImpl());
  }
  return ignored;
}

std::vector<std::pair<std::string, ModulePtr>> Runtime::auto_wrap(const Ignored& ignored) const {
  // Post-order over the tree, counting each parameter once.
  std::vector<std::pair<std::string, ModulePtr>> unit_modules;
  std::unordered_set<const c10::TensorImpl*> counted;
  std::function<int64_t(const ModulePtr&, const std::string&)> visit =
      [&](const ModulePtr& module, const std::string& fqn) -> int64_t {
    if (ignored.modules.count(module.get()) != 0) return 0;
    int64_t numel = 0;
    for (const auto& child : module->named_children()) {
      numel += visit(child.value(), fqn.empty() ? child.key() : fqn + "." + child.key());
    }
    for (const auto& p : module->parameters(/*recurse=*/false)) {
      if (!p.defined() || ignored.params.count(p.unsafeGetTensorImpl()) != 0) continue;
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
  return unit_modules;
}

void Runtime::add_unit(const std::string& fqn, const ModulePtr& module, const Ignored& ignored,
                       std::unordered_map<const c10::TensorImpl*, int>& param_owner) {
  const int index = static_cast<int>(units_.size());
  auto unit = std::make_unique<Unit>();
  unit->fqn = fqn;
  unit->module = module;
  unit->is_root = module.get() == root_.get();
  std::vector<ModulePtr> owned;
  for (const auto& sub : module->modules(/*include_self=*/true)) {
    if (ignored.modules.count(sub.get()) != 0 || owner_of_.count(sub.get()) != 0) continue;
    owner_of_[sub.get()] = index;
    owned.push_back(sub);
  }
  unit_of_[module.get()] = index;
  materialize(fqn, owned);
  std::vector<std::string> names;
  for (const auto& p : module->named_parameters(/*recurse=*/true)) {
    const auto* impl = p.value().unsafeGetTensorImpl();
    if (!p.value().defined() || ignored.params.count(impl) != 0) continue;
    if (param_owner.count(impl) != 0) continue;
    param_owner[impl] = index;
    if (options_.sync_module_states) broadcast_from_rank0(p.value());
    names.push_back(p.key());
  }
  if (!names.empty()) {
    FlatParamOptions handle_options;
    handle_options.sharding_strategy = options_.sharding_strategy;
    handle_options.mixed_precision = options_.mixed_precision;
    handle_options.offload_params = options_.cpu_offload.offload_params;
    handle_options.use_orig_params = options_.use_orig_params;
    handle_options.compute_device = options_.device_id;
    unit->handle = std::make_unique<FlatParamHandle>(
        module, names, shard_group_, handle_options,
        is_hybrid(options_.sharding_strategy) ? replicate_group_ : comm::ProcessGroup());
  }
  units_.push_back(std::move(unit));
}

void Runtime::materialize(const std::string& fqn, const std::vector<ModulePtr>& owned) {
  bool any_meta = false;
  for (const auto& sub : owned) {
    for (const auto& p : sub->parameters(false)) any_meta |= p.defined() && p.is_meta();
    for (const auto& b : sub->buffers(false)) any_meta |= b.defined() && b.is_meta();
  }
  if (!any_meta) return;
  TORCH_CHECK(options_.param_init_fn != nullptr, "FullyShardedDataParallel: unit ", unit_name(fqn),
              " has parameters or buffers on the meta device: "
              "expected Options::param_init_fn to materialise them (LibTorch "
              "modules have no reset_parameters() FSDP could call)");
  for (const auto& sub : owned) options_.param_init_fn(*sub);
  for (const auto& sub : owned) {
    for (const auto& p : sub->named_parameters(false)) {
      TORCH_CHECK(!p.value().defined() || !p.value().is_meta(),
                  "FullyShardedDataParallel: param_init_fn left parameter '", p.key(), "' of ",
                  unit_name(fqn), " on the meta device");
    }
  }
}

void Runtime::check_shared_parameters(
    const torch::OrderedDict<std::string, ModulePtr>& named_modules,
    const std::unordered_map<const c10::TensorImpl*, int>& param_owner) const {
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
                  unit_name(units_[owner->second]->fqn),
                  ": a shared parameter must "
                  "live inside one unit; change auto_wrap_policy so their common "
                  "ancestor wraps both");
    }
  }
}

void Runtime::register_post_backward_hooks() {
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
}

}  // namespace internal
}  // namespace fsdp
