// fully_shard(): resolves the group, collects the parameters no nested
// fully_shard module manages, shards them (PyTorch's _fully_shard.py and
// _fsdp_init.py); FSDPModule forwards to the state.
#include "fsdp/fully_shard.h"

#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "comm/collectives.h"
#include "comm/subgroups.h"
#include "fsdp/internal/fully_shard/fsdp_state.h"
#include "fsdp/internal/grad_norm.h"
#include "functorch/module/named_member_accessor.h"

namespace fsdp {
namespace {

using internal::FSDPParam;
using internal::FSDPParamGroup;
using internal::FSDPState;
using ModulePtr = std::shared_ptr<torch::nn::Module>;

std::string describe(const torch::nn::Module& module) { return module.name(); }

std::string ranks_string(std::vector<int> ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

// The groups parameters are sharded and replicated over (replicate empty
// unless HSDP).
struct Groups {
  comm::ProcessGroup shard;
  comm::ProcessGroup replicate;
};

Groups resolve_groups(const FullyShardOptions& options, const std::string& name) {
  if (!options.mesh) {
    TORCH_CHECK(options.process_group.has_value(), "fully_shard(", name,
                "): expected options.process_group or options.mesh (LibTorch has no default "
                "process group)");
    return {*options.process_group, comm::ProcessGroup()};
  }
  const comm::DeviceMesh& mesh = *options.mesh;
  TORCH_CHECK(mesh.ndim() == 1 || mesh.ndim() == 2, "fully_shard(", name,
              "): fully_shard expects a 1D or 2D DeviceMesh but got a ", mesh.ndim(),
              "-D mesh of shape [", ranks_string({mesh.shape().begin(), mesh.shape().end()}), "]");
  const bool hsdp = mesh.ndim() == 2;
  absl::StatusOr<comm::ProcessGroup> group = mesh.get_group(hsdp ? 1 : 0);
  TORCH_CHECK(group.ok(), "fully_shard(", name, "): ", group.status().ToString());
  comm::ProcessGroup replicate;
  if (hsdp) {
    absl::StatusOr<comm::ProcessGroup> r = mesh.get_group(0);
    TORCH_CHECK(r.ok(), "fully_shard(", name, "): ", r.status().ToString());
    replicate = *r;
  }
  if (options.process_group) {
    std::vector<int> want = options.process_group->global_ranks();
    std::vector<int> got = hsdp ? mesh.ranks() : group->global_ranks();
    if (hsdp) {
      // HSDP: the mesh's ranks as a set (its layout is the mesh's business).
      std::sort(want.begin(), want.end());
      std::sort(got.begin(), got.end());
    }
    TORCH_CHECK(want == got, "fully_shard(", name, "): options.mesh spans world ranks [",
                ranks_string(got), "] but options.process_group spans [", ranks_string(want),
                "]: expected the mesh to be over the process group's ranks");
  }
  return {*group, replicate};
}

// Whether parameters stay sharded over a smaller group after forward:
// (reshard_after_forward as a bool, the post-forward group).
std::pair<bool, comm::ProcessGroup> resolve_reshard(const FullyShardOptions& options,
                                                    const comm::ProcessGroup& group,
                                                    const std::string& name) {
  if (!options.reshard_after_forward) return {true, comm::ProcessGroup()};
  if (const bool* b = std::get_if<bool>(&*options.reshard_after_forward)) {
    return {*b, comm::ProcessGroup()};
  }
  const int n = std::get<int>(*options.reshard_after_forward);
  const int world = group.size();
  TORCH_CHECK(n >= 1 && n <= world && world % n == 0, "fully_shard(", name,
              "): If passing reshard_after_forward as an int, it should be a factor of ", world,
              ", not ", n);
  if (n == 1) return {false, comm::ProcessGroup()};
  if (n == world) return {true, comm::ProcessGroup()};
  absl::StatusOr<comm::ProcessGroup> sub = comm::new_subgroups(group, n);
  TORCH_CHECK(sub.ok(), "fully_shard(", name, "): reshard_after_forward=", n, ": ",
              sub.status().ToString());
  return {true, *sub};
}

struct Managed {
  std::vector<ModulePtr> modules;
  // Parameters in registration order, each with all its names.
  std::vector<std::pair<std::vector<std::string>, at::Tensor>> params;
};

// The modules and parameters this call manages: `module`'s subtree without
// the subtrees of nested fully_shard modules and without `ignored`
// parameters (PyTorch's _get_managed_modules / _get_managed_states). A
// module whose own parameters are all ignored is not managed (PyTorch's
// _adjust_managed_modules), so fully_shard may still be applied to it.
Managed collect_managed(const ModulePtr& module,
                        const std::unordered_set<const c10::TensorImpl*>& ignored) {
  Managed out;
  std::unordered_set<const torch::nn::Module*> excluded;
  std::unordered_map<const c10::TensorImpl*, size_t> index_of;
  for (const auto& item : module->named_modules()) {
    const ModulePtr& m = item.value();
    if (excluded.count(m.get()) != 0) continue;
    if (m != module && internal::state_of(*m) != nullptr) {
      for (const auto& sub : m->modules()) excluded.insert(sub.get());
      continue;
    }
    bool any_param = false, all_ignored = true;
    for (const auto& p : m->named_parameters(/*recurse=*/false)) {
      if (!p.value().defined()) continue;
      any_param = true;
      if (ignored.count(p.value().unsafeGetTensorImpl()) != 0) continue;
      all_ignored = false;
      const std::string name = item.key().empty() ? p.key() : item.key() + "." + p.key();
      auto [it, added] = index_of.emplace(p.value().unsafeGetTensorImpl(), out.params.size());
      if (added) {
        out.params.push_back({{name}, p.value()});
      } else {
        out.params[it->second].first.push_back(name);
      }
    }
    if (m == module || !any_param || !all_ignored) out.modules.push_back(m);
  }
  return out;
}

// options.ignored_params as TensorImpls, each checked to be a parameter of
// `module`'s subtree.
std::unordered_set<const c10::TensorImpl*> resolve_ignored(const ModulePtr& module,
                                                           const FullyShardOptions& options,
                                                           const std::string& name) {
  std::unordered_set<const c10::TensorImpl*> params;
  for (const auto& p : module->parameters()) {
    if (p.defined()) params.insert(p.unsafeGetTensorImpl());
  }
  std::unordered_set<const c10::TensorImpl*> out;
  for (size_t i = 0; i < options.ignored_params.size(); ++i) {
    const at::Tensor& t = options.ignored_params[i];
    TORCH_CHECK(t.defined() && params.count(t.unsafeGetTensorImpl()) != 0, "fully_shard(", name,
                "): options.ignored_params[", i, "] (",
                t.defined() ? "shape " + c10::str(t.sizes()) : std::string("undefined"),
                ") is not a parameter of the module: expected a tensor its named_parameters() "
                "returns (a parameter a nested fully_shard sharded is its shard, not the "
                "original)");
    out.insert(t.unsafeGetTensorImpl());
  }
  return out;
}

// The dim options.shard_placement_fn chose for `param` (0 without one),
// normalised and checked (PyTorch's _init_sharded_param).
int64_t resolve_shard_dim(const FullyShardOptions& options, const at::Tensor& param,
                          const std::string& param_name, int world, const std::string& name) {
  if (!options.shard_placement_fn) return 0;
  std::optional<int64_t> dim = options.shard_placement_fn(param);
  if (!dim) return 0;
  const int64_t ndim = param.dim();
  TORCH_CHECK(*dim >= -ndim && *dim < ndim && ndim > 0, "fully_shard(", name,
              "): shard_placement_fn returned Shard(", *dim, ") for parameter '", param_name,
              "' of shape ", param.sizes(), ": expected a dim in [", -ndim, ", ", ndim, ")");
  const int64_t d = *dim < 0 ? *dim + ndim : *dim;
  TORCH_CHECK(d == 0 || param.size(d) % world == 0, "fully_shard(", name,
              "): FSDP does not support uneven sharding on dim ", d, ": parameter '", param_name,
              "' has shape ", param.sizes(), " (world size: ", world, ")");
  return d;
}

// Whether options.float8_all_gather_fn picks `param`, checked.
bool resolve_float8_all_gather(const FullyShardOptions& options, const at::Tensor& param,
                               const std::string& param_name, int64_t shard_dim,
                               const std::string& name) {
  if (!options.float8_all_gather_fn || !options.float8_all_gather_fn(param)) return false;
  TORCH_CHECK(param.is_floating_point() && !at::isFloat8Type(param.scalar_type()), "fully_shard(",
              name, "): float8_all_gather_fn chose parameter '", param_name, "' of dtype ",
              param.scalar_type(),
              ": expected a high-precision floating parameter (float32, bfloat16, float16) to "
              "cast to float8");
  TORCH_CHECK(param.numel() > 0, "fully_shard(", name, "): float8_all_gather_fn chose parameter '",
              param_name, "' of shape ", param.sizes(),
              ": expected at least one element (an empty tensor has no amax to scale by)");
  TORCH_CHECK(shard_dim == 0, "fully_shard(", name, "): float8_all_gather_fn chose parameter '",
              param_name, "', which shard_placement_fn shards on dim ", shard_dim,
              ": float8 all-gather gathers dim-0 shards only");
  return true;
}

void check_dtypes(const Managed& managed, const std::string& name) {
  std::optional<c10::ScalarType> dtype;
  for (const auto& [names, p] : managed.params) {
    if (!p.requires_grad()) continue;
    if (!dtype) dtype = p.scalar_type();
    TORCH_CHECK(*dtype == p.scalar_type(), "fully_shard(", name,
                "): FSDP expects uniform original parameter dtype but got ", *dtype, " and ",
                p.scalar_type(), " (parameter '", names.front(),
                "'); frozen parameters may differ");
  }
}

// All of the managed parameters on the meta device or none (PyTorch's
// FSDP2 keeps meta parameters on meta for deferred initialisation; one
// unit's shards are allocated together by to_empty).
void check_meta(const Managed& managed, const std::string& name) {
  const std::pair<std::vector<std::string>, at::Tensor>* meta = nullptr;
  const std::pair<std::vector<std::string>, at::Tensor>* real = nullptr;
  for (const auto& entry : managed.params) {
    auto& slot = entry.second.is_meta() ? meta : real;
    if (slot == nullptr) slot = &entry;
  }
  TORCH_CHECK(meta == nullptr || real == nullptr, "fully_shard(", name, "): parameter '",
              meta->first.front(), "' is on the meta device but parameter '", real->first.front(),
              "' is on ", real->second.device(),
              ": expected all of the module's managed parameters on the meta device or none "
              "(build the whole module on meta and materialise it with fsdp::to_empty after "
              "fully_shard, or move it off meta before fully_shard)");
}

}  // namespace

FSDPModule fully_shard(const ModulePtr& module, const FullyShardOptions& options) {
  TORCH_CHECK(module != nullptr, "fully_shard: module is null");
  const std::string name = describe(*module);
  TORCH_CHECK(internal::state_of(*module) == nullptr,
              "fully_shard: Each distinct composable distributed API can only be applied to a "
              "module once. fully_shard has already been applied to the following module: ",
              name);
  if (auto manager = internal::manager_of(*module)) {
    TORCH_CHECK(false, "fully_shard(", name,
                "): the module's parameters are already managed by fully_shard applied to ",
                "an ancestor (", manager->name(),
                "): apply fully_shard bottom-up, to submodules before their parents");
  }
  const Groups groups = resolve_groups(options, name);
  const comm::ProcessGroup& group = groups.shard;
  TORCH_CHECK(group.is_member(), "fully_shard(", name,
              "): this process is not a member of the process group");
  auto [reshard_after_forward, post_forward_group] = resolve_reshard(options, group, name);
  Managed managed = collect_managed(module, resolve_ignored(module, options, name));
  check_dtypes(managed, name);
  check_meta(managed, name);

  std::unique_ptr<FSDPParamGroup> param_group;
  if (!managed.params.empty()) {
    std::vector<std::unique_ptr<FSDPParam>> params;
    for (auto& [names, p] : managed.params) {
      const int64_t shard_dim = resolve_shard_dim(options, p, names.front(), group.size(), name);
      params.push_back(std::make_unique<FSDPParam>(
          names, p, group, post_forward_group, options.mp_policy.param_dtype,
          options.mp_policy.reduce_dtype, shard_dim, options.offload_policy.has_value(),
          options.offload_policy.has_value() && options.offload_policy->pin_memory,
          resolve_float8_all_gather(options, p, names.front(), shard_dim, name)));
    }
    param_group =
        std::make_unique<FSDPParamGroup>(module, std::move(params), group, groups.replicate,
                                         post_forward_group, reshard_after_forward);
  }
  auto state = std::make_shared<FSDPState>(module, name, std::move(param_group), options.mp_policy,
                                           !options.reshard_after_forward.has_value());
  internal::register_state(module, state, managed.modules);
  state->register_hooks();
  return FSDPModule(state);
}

std::optional<FSDPModule> as_fsdp_module(const torch::nn::Module& module) {
  auto state = internal::state_of(module);
  if (!state) return std::nullopt;
  return FSDPModule(state);
}

std::optional<ShardedParamSpec> sharded_param_spec(const at::Tensor& param) {
  return internal::find_sharded_param(param);
}

std::optional<kernels::Float8Tensor> float8_unsharded_param(const at::Tensor& unsharded_param) {
  return internal::find_unsharded_float8(unsharded_param);
}

std::shared_ptr<torch::nn::Module> FSDPModule::module() const { return state_->module(); }

UnshardHandle FSDPModule::unshard(bool async_op) {
  if (auto* group = state_->param_group()) group->unshard(async_op);
  return UnshardHandle(async_op ? state_ : nullptr);
}

void UnshardHandle::wait() {
  if (!state_) return;
  if (auto* group = state_->param_group()) group->wait_for_unshard();
}

void FSDPModule::reshard() {
  if (auto* group = state_->param_group()) group->reshard();
}

namespace {
// `fn` on the group of `state` and, with `recurse`, of every fully_shard
// module below it.
template <typename Fn>
void for_each_group(const std::shared_ptr<FSDPState>& state, bool recurse, Fn fn) {
  if (!recurse) {
    if (auto* group = state->param_group()) fn(*group);
    return;
  }
  ModulePtr module = state->module();
  TORCH_CHECK(module != nullptr, "fully_shard: the module was destroyed");
  for (const auto& m : module->modules()) {
    auto s = internal::state_of(*m);
    if (s && s->param_group()) fn(*s->param_group());
  }
}
}  // namespace

void FSDPModule::set_requires_gradient_sync(bool requires_gradient_sync, bool recurse) {
  for_each_group(state_, recurse,
                 [&](FSDPParamGroup& g) { g.set_requires_gradient_sync(requires_gradient_sync); });
}

void FSDPModule::set_requires_all_reduce(bool requires_all_reduce, bool recurse) {
  for_each_group(state_, recurse,
                 [&](FSDPParamGroup& g) { g.set_requires_all_reduce(requires_all_reduce); });
}

void FSDPModule::set_reshard_after_backward(bool reshard_after_backward, bool recurse) {
  for_each_group(state_, recurse,
                 [&](FSDPParamGroup& g) { g.set_reshard_after_backward(reshard_after_backward); });
}

void FSDPModule::set_is_last_backward(bool is_last_backward) {
  state_->set_is_last_backward(is_last_backward);
}

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) {
  state_->forward_prefetch.clear();
  for (const auto& m : modules) state_->forward_prefetch.push_back(m.state_);
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) {
  state_->backward_prefetch.clear();
  for (const auto& m : modules) state_->backward_prefetch.push_back(m.state_);
}

at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                           double norm_type) {
  TORCH_CHECK(norm_type > 0 || std::isinf(norm_type),
              "fsdp::clip_grad_norm_: norm_type=", norm_type, ": expected p > 0 or inf");
  TORCH_CHECK(max_norm >= 0, "fsdp::clip_grad_norm_: max_norm=", max_norm, ": expected >= 0");
  const bool inf = std::isinf(norm_type);
  at::NoGradGuard no_grad;
  std::optional<comm::ProcessGroup> group;
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < parameters.size(); ++i) {
    std::optional<ShardedParamSpec> spec = sharded_param_spec(parameters[i]);
    TORCH_CHECK(spec.has_value(), "fsdp::clip_grad_norm_: parameters[", i, "] (shape ",
                parameters[i].sizes(), ") is not a parameter fully_shard sharded");
    if (!group) group = spec->group;
    TORCH_CHECK(spec->group.name() == group->name(), "fsdp::clip_grad_norm_: parameters[", i,
                "] is sharded over group '", spec->group.name(), "', parameters[0] over '",
                group->name(), "': expected one group");
    const at::Tensor& grad = parameters[i].grad();
    if (grad.defined()) grads.push_back(grad);
  }
  // On the shards' device: the all-reduce then runs on its backend (NCCL
  // for CUDA shards), and no CPU accumulator meets a CUDA norm.
  const c10::Device device =
      parameters.empty() ? c10::Device(c10::kCPU) : parameters.front().device();
  at::Tensor acc = internal::LocalGradNormPow(grads, norm_type, device);
  if (group) {
    // Ordered on the stream, not the host (NCCL; Gloo waits): nothing here
    // reads the device, so --cuda-graphs can capture the clipping.
    comm::all_reduce(*group, acc, inf ? comm::ReduceOp::kMax : comm::ReduceOp::kSum)
        .wait_on_stream();
  }
  at::Tensor total = inf ? acc : acc.pow(1.0 / norm_type);
  internal::ClipGradsWithNorm(grads, max_norm, total);
  return total.to(at::kFloat).reshape({});
}

void to_empty(torch::nn::Module& root, c10::Device device) {
  TORCH_CHECK(device.type() != c10::DeviceType::Meta, "fsdp::to_empty(", root.name(),
              "): device=", device, ": expected a device to allocate on, not meta");
  ModulePtr root_ptr;
  try {
    root_ptr = root.shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    TORCH_CHECK(false, "fsdp::to_empty(", root.name(),
                "): the module is not owned by a std::shared_ptr (a ModuleHolder or "
                "std::make_shared): expected one, to point its members at the new tensors");
  }
  const std::vector<ModulePtr> modules = root.modules(/*include_self=*/true);
  // A module whose meta shards an ancestor's group holds: that group's
  // shards are allocated together or not at all (checked before anything
  // changes).
  std::unordered_set<const torch::nn::Module*> subtree;
  for (const auto& m : modules) subtree.insert(m.get());
  for (const auto& m : modules) {
    auto manager = internal::manager_of(*m);
    if (!manager || !manager->param_group() || !manager->param_group()->is_meta()) continue;
    ModulePtr owner = manager->module();
    TORCH_CHECK(owner != nullptr && subtree.count(owner.get()) != 0, "fsdp::to_empty(", root.name(),
                "): the meta parameters of '", m->name(),
                "' are sharded by fully_shard applied to an ancestor (", manager->name(),
                "): expected to_empty on that module or the root, which allocates its shards "
                "together");
  }
  // fully_shard's meta shards, unit by unit: each unit's shards (and its
  // module's names) at once, the only memory allocated for its parameters.
  for (const auto& m : modules) {
    auto state = internal::state_of(*m);
    FSDPParamGroup* group = state ? state->param_group() : nullptr;
    if (group != nullptr && group->is_meta()) group->materialize(device);
  }
  // The rest on meta (buffers; parameters no fully_shard manages: ignored
  // ones, modules outside every fully_shard module), whole, as
  // nn.Module.to_empty does; a tensor under several names (tied) stays one.
  std::vector<std::string> names;
  std::vector<at::Tensor> values;
  std::unordered_map<const c10::TensorImpl*, at::Tensor> replaced;
  const auto add = [&](const std::string& name, const at::Tensor& t, bool is_parameter) {
    if (!t.defined() || !t.is_meta()) return;
    auto [it, added] = replaced.emplace(t.unsafeGetTensorImpl(), at::Tensor());
    if (added) {
      it->second = at::empty(t.sizes(), t.options().device(device).requires_grad(false));
      if (is_parameter) it->second.set_requires_grad(t.requires_grad());
    }
    names.push_back(name);
    values.push_back(it->second);
  };
  for (const auto& p : root.named_parameters(/*recurse=*/true)) add(p.key(), p.value(), true);
  for (const auto& b : root.named_buffers(/*recurse=*/true)) add(b.key(), b.value(), false);
  if (!names.empty()) {
    functorch::NamedMemberAccessor accessor(root_ptr);
    accessor.set_tensors(names, std::move(values));
  }
}

void init_sharded_states(torch::nn::Module& root, const ShardInitFn& init_fn) {
  TORCH_CHECK(init_fn != nullptr, "fsdp::init_sharded_states(", root.name(),
              "): init_fn is empty: expected a function");
  // The shards' specs, by tensor (sharded_param_spec scans every state).
  std::unordered_map<const c10::TensorImpl*, ShardedParamSpec> specs;
  for (const auto& m : root.modules(/*include_self=*/true)) {
    auto state = internal::state_of(*m);
    FSDPParamGroup* group = state ? state->param_group() : nullptr;
    if (group == nullptr) continue;
    group->reshard();
    for (const auto& p : group->params()) {
      specs.emplace(p->sharded_param().unsafeGetTensorImpl(), internal::spec_of(*group, *p));
    }
  }
  at::NoGradGuard no_grad;
  std::unordered_set<const c10::TensorImpl*> seen;
  const auto visit = [&](const std::string& name, const at::Tensor& t, bool is_parameter) {
    if (!t.defined() || !seen.insert(t.unsafeGetTensorImpl()).second) return;
    TORCH_CHECK(!t.is_meta(), "fsdp::init_sharded_states(", root.name(),
                "): ", is_parameter ? "parameter '" : "buffer '", name,
                "' is on the meta device: call fsdp::to_empty(root, device) first");
    auto spec = specs.find(t.unsafeGetTensorImpl());
    init_fn(name, t,
            spec == specs.end() ? std::nullopt : std::optional<ShardedParamSpec>(spec->second));
  };
  for (const auto& p : root.named_parameters(/*recurse=*/true)) visit(p.key(), p.value(), true);
  for (const auto& b : root.named_buffers(/*recurse=*/true)) visit(b.key(), b.value(), false);
}

std::vector<at::Tensor> FSDPModule::sharded_parameters() const {
  std::vector<at::Tensor> out;
  if (auto* group = state_->param_group()) {
    for (const auto& p : group->params()) out.push_back(p->sharded_param());
  }
  return out;
}

}  // namespace fsdp
