#include "state_dict/fsdp_state_dict.h"

#include <map>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/collectives.h"
#include "fsdp/flat_param.h"
#include "state_dict/checkpoint.h"
#include "state_dict/module_state.h"

namespace state_dict {
namespace {

using fsdp::FullyShardedDataParallel;

struct Setting {
  StateDictType type;
  StateDictConfig config;
};

std::mutex& SettingsMutex() {
  static std::mutex mu;
  return mu;
}
std::map<const FullyShardedDataParallel*, Setting>& Settings() {
  static auto* settings = new std::map<const FullyShardedDataParallel*, Setting>();
  return *settings;
}

std::string Join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : absl::StrCat(prefix, ".", name);
}

std::string ShapeString(c10::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// One original parameter managed by a handle.
struct Managed {
  std::string name;
  const fsdp::FlatParamHandle* handle;
  const fsdp::FlatParamInfo* info;
};

// One flat parameter (kLocal).
struct Flat {
  std::string name;
  const fsdp::FlatParamHandle* handle;
};

// A buffer or a parameter FSDP does not manage: full on every rank.
struct Extra {
  std::string name;
  torch::Tensor tensor;
};

struct ModelView {
  std::vector<Managed> managed;
  std::vector<Flat> flats;
  std::vector<Extra> extras;
  int world_size = 1;
  int rank = 0;
  bool replicated_shards = false;  // kNoShard: every rank holds everything
};

absl::StatusOr<ModelView> Describe(const FullyShardedDataParallel& model) {
  ModelView view;
  const auto& options = model.options();
  if (fsdp::ShardingStrategy s = options.sharding_strategy;
      s != fsdp::ShardingStrategy::kFullShard && s != fsdp::ShardingStrategy::kShardGradOp &&
      s != fsdp::ShardingStrategy::kNoShard) {
    return absl::UnimplementedError(
        "FSDP state dicts: the hybrid sharding strategies are not supported (a shard "
        "is replicated over the replicate group); use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD");
  }
  if (!options.process_group.has_value()) {
    return absl::UnimplementedError(
        "FSDP state dicts: the model must be built with Options::process_group (a "
        "device_mesh is not supported here)");
  }
  view.world_size = options.process_group->size();
  view.rank = options.process_group->rank();
  view.replicated_shards = options.sharding_strategy == fsdp::ShardingStrategy::kNoShard;
  const std::vector<std::string> units = model.fsdp_unit_names();
  const std::vector<const fsdp::FlatParamHandle*> handles = model.handles();
  std::set<std::string> managed_names;
  for (size_t u = 0; u < handles.size(); ++u) {
    const fsdp::FlatParamHandle* h = handles[u];
    if (h == nullptr) continue;
    view.flats.push_back({Join(units[u], "flat_param"), h});
    for (const fsdp::FlatParamInfo& info : h->param_infos()) {
      view.managed.push_back({Join(units[u], info.fqn), h, &info});
      managed_names.insert(Join(units[u], info.fqn));
      for (const std::string& alias : info.alias_fqns) managed_names.insert(Join(units[u], alias));
    }
  }
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : model.module()->named_parameters()) {
    if (managed_names.count(item.key()) != 0) continue;
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    view.extras.push_back({item.key(), item.value()});
  }
  for (const auto& item : model.module()->named_buffers()) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    view.extras.push_back({item.key(), item.value()});
  }
  return view;
}

FlatRange ShardRange(const fsdp::FlatParamHandle& h) {
  return {h.shard_rank() * h.shard_numel(), h.shard_numel()};
}

ShardedTensor FullPiece(const torch::Tensor& t) {
  ShardedTensor st;
  st.global_shape = t.sizes().vec();
  st.dtype = t.scalar_type();
  if (t.numel() > 0) {
    st.pieces.push_back({{0, t.numel()}, t.detach().reshape({-1}).clone()});
  }
  return st;
}

absl::StatusOr<FsdpModelStateDict> GetFull(FullyShardedDataParallel& model,
                                           const StateDictConfig& config, const ModelView& view) {
  FsdpModelStateDict out;
  out.type = StateDictType::kFull;
  out.world_size = view.world_size;
  out.rank = view.rank;
  fsdp::SummonOptions summon;
  summon.writeback = false;
  summon.rank0_only = config.rank0_only;
  summon.offload_to_cpu = config.offload_to_cpu;
  auto guard = model.summon_full_params(summon);
  if (config.rank0_only && view.rank != 0) return out;
  for (const auto& item : ModuleStateDict(*model.module())) {
    torch::Tensor t = item.value().detach();
    if (config.offload_to_cpu) t = t.to(torch::kCPU);
    out.full.insert(item.key(), t.clone());
  }
  return out;
}

FsdpModelStateDict GetSharded(const ModelView& view) {
  FsdpModelStateDict out;
  out.type = StateDictType::kSharded;
  out.world_size = view.world_size;
  out.rank = view.rank;
  for (const Managed& m : view.managed) {
    ShardedTensor st;
    st.global_shape = m.info->shape;
    st.dtype = m.handle->flat_param().scalar_type();
    if (m.info->numel_in_shard > 0) {
      st.pieces.push_back(
          {{m.info->offset_in_param, m.info->numel_in_shard},
           m.handle->flat_param().detach().narrow(0, m.info->offset_in_shard,
                                                  m.info->numel_in_shard).clone()});
    }
    out.sharded.insert(m.name, std::move(st));
    if (view.replicated_shards) out.replicated.push_back(m.name);
  }
  for (const Extra& e : view.extras) {
    out.sharded.insert(e.name, FullPiece(e.tensor));
    out.replicated.push_back(e.name);
  }
  return out;
}

FsdpModelStateDict GetLocal(const ModelView& view) {
  FsdpModelStateDict out;
  out.type = StateDictType::kLocal;
  out.world_size = view.world_size;
  out.rank = view.rank;
  for (const Flat& f : view.flats) {
    ShardedTensor st;
    st.global_shape = {f.handle->padded_numel()};
    st.dtype = f.handle->flat_param().scalar_type();
    st.pieces.push_back({ShardRange(*f.handle), f.handle->flat_param().detach().clone()});
    out.sharded.insert(f.name, std::move(st));
  }
  for (const Extra& e : view.extras) out.sharded.insert(e.name, FullPiece(e.tensor));
  return out;
}

// Copies planned by a load, executed only once everything checked out.
struct Plan {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;  // dst <- src
  void Apply() {
    torch::NoGradGuard no_grad;
    for (auto& [dst, src] : copies) dst.copy_(src.reshape(dst.sizes()));
  }
};

absl::Status CheckEntry(const std::string& what, const std::string& name,
                        const ShardedTensor* entry, c10::IntArrayRef shape,
                        c10::ScalarType dtype) {
  if (entry == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(what, " state dict has no entry '", name, "' (the model has it, shape ",
                     ShapeString(shape), ")"));
  }
  if (c10::IntArrayRef(entry->global_shape) != shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " state dict entry '", name, "' has shape ", ShapeString(entry->global_shape),
        "; the model expects ", ShapeString(shape)));
  }
  if (entry->dtype != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " state dict entry '", name, "' has dtype ", c10::toString(entry->dtype),
        "; the model expects ", c10::toString(dtype)));
  }
  return ValidateShardedTensor(name, *entry);
}

absl::Status CheckNoUnexpected(const std::string& what, const ShardedStateDict& dict,
                               const std::set<std::string>& known) {
  for (const auto& item : dict) {
    if (known.count(item.key()) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " state dict has entry '", item.key(), "', which the model does not have"));
    }
  }
  return absl::OkStatus();
}

absl::Status PlanExtras(const std::string& what, const ModelView& view,
                        const ShardedStateDict& dict, Plan& plan) {
  for (const Extra& e : view.extras) {
    const ShardedTensor* entry = dict.find(e.name);
    if (absl::Status s = CheckEntry(what, e.name, entry, e.tensor.sizes(),
                                    e.tensor.scalar_type());
        !s.ok()) {
      return s;
    }
    if (e.tensor.numel() == 0) continue;
    auto full = Reshard(e.name, {*entry}, {{0, e.tensor.numel()}});
    if (!full.ok()) return full.status();
    plan.copies.emplace_back(e.tensor.detach(), full->pieces[0].data);
  }
  return absl::OkStatus();
}

absl::Status LoadSharded(const ModelView& view, const FsdpModelStateDict& state) {
  Plan plan;
  std::set<std::string> known;
  for (const Managed& m : view.managed) {
    known.insert(m.name);
    const ShardedTensor* entry = state.sharded.find(m.name);
    if (absl::Status s = CheckEntry("SHARDED", m.name, entry, m.info->shape,
                                    m.handle->flat_param().scalar_type());
        !s.ok()) {
      return s;
    }
    if (m.info->numel_in_shard == 0) continue;
    auto piece = Reshard(m.name, {*entry}, {{m.info->offset_in_param, m.info->numel_in_shard}});
    if (!piece.ok()) return piece.status();
    plan.copies.emplace_back(m.handle->flat_param().detach().narrow(
                                 0, m.info->offset_in_shard, m.info->numel_in_shard),
                             piece->pieces[0].data);
  }
  for (const Extra& e : view.extras) known.insert(e.name);
  if (absl::Status s = CheckNoUnexpected("SHARDED", state.sharded, known); !s.ok()) return s;
  if (absl::Status s = PlanExtras("SHARDED", view, state.sharded, plan); !s.ok()) return s;
  plan.Apply();
  return absl::OkStatus();
}

absl::Status LoadLocal(const ModelView& view, const FsdpModelStateDict& state) {
  if (state.world_size != view.world_size || state.rank != view.rank) {
    return absl::FailedPreconditionError(absl::StrCat(
        "LOCAL state dict was taken at world size ", state.world_size, " (rank ", state.rank,
        "); this model runs at world size ", view.world_size, " (rank ", view.rank,
        "): load a LOCAL state dict only at the same world size, or use SHARDED/FULL"));
  }
  Plan plan;
  std::set<std::string> known;
  for (const Flat& f : view.flats) {
    known.insert(f.name);
    const ShardedTensor* entry = state.sharded.find(f.name);
    const torch::Tensor& flat = f.handle->flat_param();
    if (absl::Status s = CheckEntry("LOCAL", f.name, entry, {f.handle->padded_numel()},
                                    flat.scalar_type());
        !s.ok()) {
      return s;
    }
    const FlatRange expected = ShardRange(*f.handle);
    if (entry->pieces.size() != 1 || !(entry->pieces[0].range == expected)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "LOCAL state dict entry '", f.name, "' must hold exactly this rank's shard, elements [",
          expected.offset, ", ", expected.end(), ") of the flat parameter; it holds ",
          entry->pieces.size(), " piece(s)",
          entry->pieces.empty() ? std::string()
                                : absl::StrCat(", the first [", entry->pieces[0].range.offset,
                                               ", ", entry->pieces[0].range.end(), ")")));
    }
    plan.copies.emplace_back(flat.detach(), entry->pieces[0].data);
  }
  for (const Extra& e : view.extras) known.insert(e.name);
  if (absl::Status s = CheckNoUnexpected("LOCAL", state.sharded, known); !s.ok()) return s;
  if (absl::Status s = PlanExtras("LOCAL", view, state.sharded, plan); !s.ok()) return s;
  plan.Apply();
  return absl::OkStatus();
}

absl::Status LoadFull(FullyShardedDataParallel& model, const TensorDict& full) {
  // LoadModuleStateDict checks every name and shape before it copies, and
  // the guard writes the (possibly unchanged) full parameters back.
  fsdp::SummonOptions summon;
  summon.writeback = true;
  auto guard = model.summon_full_params(summon);
  return LoadModuleStateDict(*model.module(), full, /*strict=*/true);
}

}  // namespace

const char* StateDictTypeName(StateDictType type) {
  switch (type) {
    case StateDictType::kFull: return "FULL_STATE_DICT";
    case StateDictType::kSharded: return "SHARDED_STATE_DICT";
    case StateDictType::kLocal: return "LOCAL_STATE_DICT";
  }
  return "?";
}

StateDictTypeGuard::StateDictTypeGuard(const FullyShardedDataParallel& model,
                                       StateDictType type, StateDictConfig config)
    : model_(&model), had_previous_(false), previous_type_(StateDictType::kFull) {
  std::lock_guard<std::mutex> lock(SettingsMutex());
  auto& settings = Settings();
  auto it = settings.find(model_);
  if (it != settings.end()) {
    had_previous_ = true;
    previous_type_ = it->second.type;
    previous_config_ = it->second.config;
  }
  settings[model_] = Setting{type, config};
}

StateDictTypeGuard::~StateDictTypeGuard() {
  std::lock_guard<std::mutex> lock(SettingsMutex());
  auto& settings = Settings();
  if (had_previous_) {
    settings[model_] = Setting{previous_type_, previous_config_};
  } else {
    settings.erase(model_);
  }
}

StateDictType CurrentStateDictType(const FullyShardedDataParallel& model) {
  std::lock_guard<std::mutex> lock(SettingsMutex());
  auto it = Settings().find(&model);
  return it == Settings().end() ? StateDictType::kFull : it->second.type;
}

StateDictConfig CurrentStateDictConfig(const FullyShardedDataParallel& model) {
  std::lock_guard<std::mutex> lock(SettingsMutex());
  auto it = Settings().find(&model);
  return it == Settings().end() ? StateDictConfig{} : it->second.config;
}

absl::StatusOr<FsdpModelStateDict> GetModelStateDict(FullyShardedDataParallel& model,
                                                     StateDictType type,
                                                     StateDictConfig config) {
  auto view = Describe(model);
  if (!view.ok()) return view.status();
  switch (type) {
    case StateDictType::kFull: return GetFull(model, config, *view);
    case StateDictType::kSharded: return GetSharded(*view);
    case StateDictType::kLocal: return GetLocal(*view);
  }
  return absl::InvalidArgumentError("unknown StateDictType");
}

absl::StatusOr<FsdpModelStateDict> GetModelStateDict(FullyShardedDataParallel& model) {
  return GetModelStateDict(model, CurrentStateDictType(model), CurrentStateDictConfig(model));
}

absl::Status LoadModelStateDict(FullyShardedDataParallel& model,
                                const FsdpModelStateDict& state) {
  auto view = Describe(model);
  if (!view.ok()) return view.status();
  switch (state.type) {
    case StateDictType::kFull: return LoadFull(model, state.full);
    case StateDictType::kSharded: return LoadSharded(*view, state);
    case StateDictType::kLocal: return LoadLocal(*view, state);
  }
  return absl::InvalidArgumentError("unknown StateDictType");
}

absl::Status SaveModelCheckpoint(const std::string& root, int64_t step,
                                 const FsdpModelStateDict& state) {
  if (state.type == StateDictType::kFull) {
    if (state.rank != 0) return absl::OkStatus();
    return SaveFullCheckpoint(root, step, state.full);
  }
  if (state.type == StateDictType::kLocal || state.rank == 0) {
    return SaveShard(root, step, state.rank, state.world_size, state.sharded);
  }
  // SHARDED on ranks != 0: entries every rank holds in full are written by
  // rank 0 only (listed here without pieces, so shapes are still recorded).
  const std::set<std::string> replicated(state.replicated.begin(), state.replicated.end());
  ShardedStateDict shard;
  for (const auto& item : state.sharded) {
    ShardedTensor st = item.value();
    if (replicated.count(item.key()) != 0) st.pieces.clear();
    shard.insert(item.key(), std::move(st));
  }
  return SaveShard(root, step, state.rank, state.world_size, shard);
}

absl::Status LoadModelCheckpoint(FullyShardedDataParallel& model, const std::string& step_dir,
                                 StateDictType type) {
  auto view = Describe(model);
  if (!view.ok()) return view.status();
  FsdpModelStateDict state;
  state.type = type;
  state.world_size = view->world_size;
  state.rank = view->rank;
  switch (type) {
    case StateDictType::kFull: {
      auto full = LoadFullStateDict(step_dir);
      if (!full.ok()) return full.status();
      for (const auto& item : *full) {
        // Optimizer entries ("<param>/<entry>") saved in the same checkpoint.
        if (item.key().find('/') != std::string::npos) continue;
        state.full.insert(item.key(), item.value());
      }
      return LoadFull(model, state.full);
    }
    case StateDictType::kSharded: {
      std::vector<std::pair<std::string, ShardRequest>> requests;
      for (const Managed& m : view->managed) {
        ShardRequest r;
        r.global_shape = m.info->shape;
        r.dtype = m.handle->flat_param().scalar_type();
        if (m.info->numel_in_shard > 0) {
          r.ranges.push_back({m.info->offset_in_param, m.info->numel_in_shard});
        }
        requests.emplace_back(m.name, std::move(r));
      }
      for (const Extra& e : view->extras) {
        ShardRequest r;
        r.global_shape = e.tensor.sizes().vec();
        r.dtype = e.tensor.scalar_type();
        if (e.tensor.numel() > 0) r.ranges.push_back({0, e.tensor.numel()});
        requests.emplace_back(e.name, std::move(r));
      }
      auto loaded = LoadResharded(step_dir, requests);
      if (!loaded.ok()) return loaded.status();
      state.sharded = std::move(*loaded);
      return LoadSharded(*view, state);
    }
    case StateDictType::kLocal: {
      auto local = LoadLocalShard(step_dir, view->rank, view->world_size);
      if (!local.ok()) return local.status();
      for (const Flat& f : view->flats) {
        const torch::Tensor* t = local->find(f.name);
        if (t == nullptr) {
          return absl::NotFoundError(absl::StrCat("LOCAL checkpoint ", step_dir,
                                                  " has no entry '", f.name, "' for rank ",
                                                  view->rank));
        }
        ShardedTensor st;
        st.global_shape = {f.handle->padded_numel()};
        st.dtype = t->scalar_type();
        const FlatRange range{ShardRange(*f.handle).offset, t->numel()};
        st.pieces.push_back({range, t->reshape({-1})});
        state.sharded.insert(f.name, std::move(st));
      }
      for (const Extra& e : view->extras) {
        const torch::Tensor* t = local->find(e.name);
        if (t == nullptr) {
          return absl::NotFoundError(absl::StrCat("LOCAL checkpoint ", step_dir,
                                                  " has no entry '", e.name, "' for rank ",
                                                  view->rank));
        }
        ShardedTensor st;
        st.global_shape = e.tensor.sizes().vec();
        st.dtype = t->scalar_type();
        st.pieces.push_back({{0, t->numel()}, t->reshape({-1})});
        state.sharded.insert(e.name, std::move(st));
      }
      return LoadLocal(*view, state);
    }
  }
  return absl::InvalidArgumentError("unknown StateDictType");
}


// ---- optimizer state -------------------------------------------------------

namespace {

// Where an optimizer parameter lives: a managed original or an extra.
struct OptimParam {
  std::string name;
  const Managed* managed = nullptr;  // null: unmanaged, full on every rank
  std::vector<int64_t> shape;
};

struct OptimView {
  ModelView model;
  std::vector<OptimParam> params;  // by optimizer ID
};

absl::StatusOr<OptimView> DescribeOptim(const FullyShardedDataParallel& model,
                                        const torch::optim::Optimizer& optimizer) {
  if (!model.options().use_orig_params) {
    return absl::UnimplementedError(
        "FSDP optimizer state dicts: not implemented: requires use_orig_params=true (the "
        "model steps flat parameters)");
  }
  auto view = Describe(model);
  if (!view.ok()) return view.status();
  auto names = OptimizerParamNames(*model.module(), optimizer);
  if (!names.ok()) return names.status();
  OptimView out;
  out.model = std::move(*view);
  std::map<std::string, const Managed*> managed;
  for (const Managed& m : out.model.managed) managed[m.name] = &m;
  std::map<std::string, const Extra*> extras;
  for (const Extra& e : out.model.extras) extras[e.name] = &e;
  for (const std::string& name : *names) {
    OptimParam p;
    p.name = name;
    if (auto it = managed.find(name); it != managed.end()) {
      p.managed = it->second;
      p.shape = it->second->info->shape;
    } else if (auto e = extras.find(name); e != extras.end()) {
      p.shape = e->second->tensor.sizes().vec();
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer parameter '", name, "' is neither managed by FSDP nor a model parameter"));
    }
    out.params.push_back(std::move(p));
  }
  return out;
}

// Entries sharded like their parameter, in the order gathered.
constexpr const char* kShardedKeys[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                        "momentum_buffer"};
constexpr int kNumShardedKeys = 4;

int ShardedKeyIndex(const std::string& key) {
  for (int k = 0; k < kNumShardedKeys; ++k) {
    if (key == kShardedKeys[k]) return k;
  }
  return -1;
}

}  // namespace

absl::StatusOr<OptimStateDict> FullOptimStateDict(FullyShardedDataParallel& model,
                                                  const torch::optim::Optimizer& optimizer,
                                                  bool rank0_only) {
  auto view = DescribeOptim(model, optimizer);
  if (!view.ok()) return view.status();
  auto exported = ExportOptimizerState(optimizer);
  if (!exported.ok()) return exported.status();
  const int64_t n = static_cast<int64_t>(view->params.size());
  std::vector<const TensorDict*> local(static_cast<size_t>(n), nullptr);
  for (const auto& [key, entries] : exported->state) {
    local[static_cast<size_t>(std::get<int64_t>(key))] = &entries;
  }
  // Which entries exist anywhere (a rank holding none of a parameter may
  // have no state for it) and each scalar's value: one all-reduce (max).
  // Per parameter: kNumShardedKeys presence flags, then "step".
  const int64_t width = kNumShardedKeys + 2;
  torch::Tensor meta = torch::full({n * width}, -1.0, torch::kFloat64);
  for (int64_t i = 0; i < n; ++i) {
    const TensorDict* entries = local[static_cast<size_t>(i)];
    if (entries == nullptr) continue;
    for (const auto& entry : *entries) {
      if (entry.key() == "step" && entry.value().numel() == 1) {
        meta[i * width + kNumShardedKeys] = entry.value().item<double>();
        meta[i * width + kNumShardedKeys + 1] = 1.0;
        continue;
      }
      const int k = ShardedKeyIndex(entry.key());
      if (k < 0) {
        return absl::UnimplementedError(absl::StrCat(
            "FSDP optimizer state entry '", view->params[static_cast<size_t>(i)].name, "/",
            entry.key(), "' cannot be consolidated (known: step, exp_avg, exp_avg_sq, "
            "max_exp_avg_sq, momentum_buffer)"));
      }
      meta[i * width + k] = 1.0;
    }
  }
  const comm::ProcessGroup& pg = *model.options().process_group;
  comm::all_reduce(pg, meta, comm::ReduceOp::kMax).wait();

  OptimStateDict full;
  full.key_type = OptimStateKeyType::kParamId;
  full.param_groups = exported->param_groups;
  for (int64_t i = 0; i < n; ++i) {
    const OptimParam& p = view->params[static_cast<size_t>(i)];
    const TensorDict* entries = local[static_cast<size_t>(i)];
    TensorDict out;
    for (int k = 0; k < kNumShardedKeys; ++k) {
      if (meta[i * width + k].item<double>() < 0) continue;
      const torch::Tensor* value = entries == nullptr ? nullptr : entries->find(kShardedKeys[k]);
      torch::Tensor gathered;
      if (p.managed == nullptr || view->model.replicated_shards) {
        // Every rank holds all of it.
        if (value == nullptr) {
          return absl::InternalError(absl::StrCat("optimizer state '", p.name, "/",
                                                  kShardedKeys[k], "' is missing on rank ",
                                                  view->model.rank));
        }
        gathered = value->detach().to(torch::kFloat32).reshape(p.shape).clone();
      } else {
        const fsdp::FlatParamInfo& info = *p.managed->info;
        torch::Tensor buffer = torch::zeros({info.numel}, torch::kFloat32);
        if (value != nullptr && info.numel_in_shard > 0) {
          buffer.narrow(0, info.offset_in_param, info.numel_in_shard)
              .copy_(value->detach().reshape({-1}));
        }
        comm::all_reduce(pg, buffer, comm::ReduceOp::kSum).wait();
        gathered = buffer.reshape(p.shape);
      }
      out.insert(kShardedKeys[k], gathered);
    }
    if (meta[i * width + kNumShardedKeys + 1].item<double>() > 0) {
      out.insert("step", torch::tensor(meta[i * width + kNumShardedKeys].item<double>(),
                                       torch::kFloat32));
    }
    if (!out.is_empty()) full.state.emplace_back(ParamKey(i), std::move(out));
  }
  if (rank0_only && view->model.rank != 0) return OptimStateDict{};
  std::vector<std::string> names;
  for (const OptimParam& p : view->params) names.push_back(p.name);
  return RekeyOptimStateDict(full, OptimStateKeyType::kParamName, names);
}

absl::StatusOr<OptimStateDict> ShardFullOptimStateDict(const FullyShardedDataParallel& model,
                                                       const torch::optim::Optimizer& optimizer,
                                                       const OptimStateDict& full) {
  auto view = DescribeOptim(model, optimizer);
  if (!view.ok()) return view.status();
  std::vector<std::string> names;
  for (const OptimParam& p : view->params) names.push_back(p.name);
  OptimStateDict by_id = full;
  if (full.key_type == OptimStateKeyType::kParamName) {
    auto rekeyed = RekeyOptimStateDict(full, OptimStateKeyType::kParamId, names);
    if (!rekeyed.ok()) return rekeyed.status();
    by_id = std::move(*rekeyed);
  }
  for (auto& [key, entries] : by_id.state) {
    const int64_t id = std::get<int64_t>(key);
    if (id < 0 || id >= static_cast<int64_t>(view->params.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "full optimizer state has parameter ID ", id, "; the optimizer has ",
          view->params.size(), " parameters"));
    }
    const OptimParam& p = view->params[static_cast<size_t>(id)];
    TensorDict sliced;
    for (const auto& entry : entries) {
      const torch::Tensor& value = entry.value();
      if (value.dim() == 0 || p.managed == nullptr) {
        sliced.insert(entry.key(), value);
        continue;
      }
      if (value.sizes() != c10::IntArrayRef(p.shape)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "full optimizer state '", p.name, "/", entry.key(), "' has shape ",
            ShapeString(value.sizes()), "; the parameter's original shape is ",
            ShapeString(p.shape)));
      }
      const fsdp::FlatParamInfo& info = *p.managed->info;
      sliced.insert(entry.key(), value.reshape({-1})
                                     .narrow(0, info.offset_in_param, info.numel_in_shard)
                                     .clone());
    }
    entries = std::move(sliced);
  }
  return by_id;
}

absl::StatusOr<OptimStateDict> ScatterFullOptimStateDict(
    FullyShardedDataParallel& model, const torch::optim::Optimizer& optimizer,
    const OptimStateDict& full) {
  auto view = DescribeOptim(model, optimizer);
  if (!view.ok()) return view.status();
  auto current = ExportOptimizerState(optimizer);
  if (!current.ok()) return current.status();
  const comm::ProcessGroup& pg = *model.options().process_group;
  const int64_t n = static_cast<int64_t>(view->params.size());
  std::vector<std::string> names;
  for (const OptimParam& p : view->params) names.push_back(p.name);
  // meta[0]: 1 when rank 0's dict is usable. Then per parameter:
  // kNumShardedKeys presence flags, the step, whether there is a step.
  const int64_t width = kNumShardedKeys + 2;
  torch::Tensor meta = torch::zeros({1 + n * width}, torch::kFloat64);
  std::vector<const TensorDict*> entries(static_cast<size_t>(n), nullptr);
  OptimStateDict by_id;
  absl::Status problem = absl::OkStatus();
  if (view->model.rank == 0) {
    by_id = full;
    if (full.key_type == OptimStateKeyType::kParamName) {
      auto rekeyed = RekeyOptimStateDict(full, OptimStateKeyType::kParamId, names);
      if (rekeyed.ok()) {
        by_id = std::move(*rekeyed);
      } else {
        problem = rekeyed.status();
      }
    }
    for (const auto& [key, dict] : by_id.state) {
      if (!problem.ok()) break;
      const int64_t id = std::get<int64_t>(key);
      if (id < 0 || id >= n) {
        problem = absl::InvalidArgumentError(absl::StrCat(
            "full optimizer state has parameter ID ", id, "; the optimizer has ", n,
            " parameters"));
        break;
      }
      const OptimParam& p = view->params[static_cast<size_t>(id)];
      entries[static_cast<size_t>(id)] = &dict;
      for (const auto& e : dict) {
        if (e.key() == "step" && e.value().numel() == 1) {
          meta[1 + id * width + kNumShardedKeys] = e.value().item<double>();
          meta[1 + id * width + kNumShardedKeys + 1] = 1.0;
          continue;
        }
        const int k = ShardedKeyIndex(e.key());
        if (k < 0 || e.value().sizes() != c10::IntArrayRef(p.shape)) {
          problem = absl::InvalidArgumentError(absl::StrCat(
              "full optimizer state '", p.name, "/", e.key(), "' (shape ",
              ShapeString(e.value().sizes()), ") cannot be scattered: expected one of step, "
              "exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer shaped like the "
              "parameter, ", ShapeString(p.shape)));
          break;
        }
        meta[1 + id * width + k] = 1.0;
      }
    }
    meta[0] = problem.ok() ? 1.0 : 0.0;
  }
  comm::broadcast(pg, meta, 0).wait();
  if (meta[0].item<double>() == 0) {
    if (!problem.ok()) return problem;
    return absl::InvalidArgumentError(
        "scatter_full_optim_state_dict: rank 0's full optimizer state dict was rejected (see "
        "rank 0's error)");
  }
  OptimStateDict mine;
  mine.key_type = OptimStateKeyType::kParamId;
  mine.param_groups = current->param_groups;
  for (int64_t i = 0; i < n; ++i) {
    const OptimParam& p = view->params[static_cast<size_t>(i)];
    TensorDict dict;
    for (int k = 0; k < kNumShardedKeys; ++k) {
      if (meta[1 + i * width + k].item<double>() == 0) continue;
      torch::Tensor value;  // flat: collectives take 1-D tensors
      if (view->model.rank == 0) {
        value = entries[static_cast<size_t>(i)]->find(kShardedKeys[k])->to(torch::kFloat32)
                    .reshape({-1}).clone();
      } else {
        int64_t numel = 1;
        for (int64_t d : p.shape) numel *= d;
        value = torch::empty({numel}, torch::kFloat32);
      }
      comm::broadcast(pg, value, 0).wait();
      dict.insert(kShardedKeys[k], value.reshape(p.shape));
    }
    if (meta[1 + i * width + kNumShardedKeys + 1].item<double>() > 0) {
      dict.insert("step", torch::tensor(meta[1 + i * width + kNumShardedKeys].item<double>(),
                                        torch::kFloat32));
    }
    if (!dict.is_empty()) mine.state.emplace_back(ParamKey(i), std::move(dict));
  }
  return ShardFullOptimStateDict(model, optimizer, mine);
}

absl::StatusOr<FsdpModelStateDict> ShardedOptimStateDict(
    const FullyShardedDataParallel& model, const torch::optim::Optimizer& optimizer) {
  auto view = DescribeOptim(model, optimizer);
  if (!view.ok()) return view.status();
  auto exported = ExportOptimizerState(optimizer);
  if (!exported.ok()) return exported.status();
  FsdpModelStateDict out;
  out.type = StateDictType::kSharded;
  out.world_size = view->model.world_size;
  out.rank = view->model.rank;
  for (const auto& [key, entries] : exported->state) {
    const OptimParam& p = view->params[static_cast<size_t>(std::get<int64_t>(key))];
    for (const auto& entry : entries) {
      const std::string name = absl::StrCat(p.name, "/", entry.key());
      const torch::Tensor value = entry.value().detach();
      if (value.dim() == 0) {
        ShardedTensor st;
        st.dtype = value.scalar_type();
        st.pieces.push_back({{0, 1}, value.reshape({1}).clone()});
        out.sharded.insert(name, std::move(st));
        out.replicated.push_back(name);
      } else if (p.managed == nullptr || view->model.replicated_shards) {
        out.sharded.insert(name, FullPiece(value.reshape(p.shape)));
        out.replicated.push_back(name);
      } else {
        const fsdp::FlatParamInfo& info = *p.managed->info;
        if (value.numel() != info.numel_in_shard) {
          return absl::InternalError(absl::StrCat("optimizer state '", name, "' has ",
                                                  value.numel(), " elements; the shard holds ",
                                                  info.numel_in_shard));
        }
        ShardedTensor st;
        st.global_shape = p.shape;
        st.dtype = value.scalar_type();
        if (info.numel_in_shard > 0) {
          st.pieces.push_back(
              {{info.offset_in_param, info.numel_in_shard}, value.reshape({-1}).clone()});
        }
        out.sharded.insert(name, std::move(st));
      }
    }
  }
  return out;
}

namespace {

// Splits "<param>/<entry>"; false for model entries (no '/').
bool SplitOptimName(const std::string& name, std::string* param, std::string* entry) {
  const size_t slash = name.rfind('/');
  if (slash == std::string::npos) return false;
  *param = name.substr(0, slash);
  *entry = name.substr(slash + 1);
  return true;
}

// What this rank needs of optimizer entry `name` of parameter `p`.
ShardRequest OptimRequest(const OptimParam& p, const ShardedTensor& saved) {
  ShardRequest r;
  r.global_shape = saved.global_shape;
  r.dtype = saved.dtype;
  if (saved.global_shape.empty()) {
    r.ranges.push_back({0, 1});
  } else if (p.managed == nullptr) {
    int64_t numel = 1;
    for (int64_t d : p.shape) numel *= d;
    if (numel > 0) r.ranges.push_back({0, numel});
  } else if (p.managed->info->numel_in_shard > 0) {
    r.ranges.push_back({p.managed->info->offset_in_param, p.managed->info->numel_in_shard});
  }
  return r;
}

}  // namespace

absl::Status LoadShardedOptimStateDict(const FullyShardedDataParallel& model,
                                       torch::optim::Optimizer& optimizer,
                                       const FsdpModelStateDict& saved) {
  auto view = DescribeOptim(model, optimizer);
  if (!view.ok()) return view.status();
  auto current = ExportOptimizerState(optimizer);
  if (!current.ok()) return current.status();
  std::map<std::string, int64_t> ids;
  for (size_t i = 0; i < view->params.size(); ++i) {
    ids[view->params[i].name] = static_cast<int64_t>(i);
  }
  std::map<int64_t, TensorDict> state;
  for (const auto& item : saved.sharded) {
    std::string param, entry;
    if (!SplitOptimName(item.key(), &param, &entry)) continue;
    auto id = ids.find(param);
    if (id == ids.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sharded optimizer state has entry '", item.key(), "', but '", param,
          "' is not a parameter of the optimizer"));
    }
    const OptimParam& p = view->params[static_cast<size_t>(id->second)];
    const ShardedTensor& st = item.value();
    if (!st.global_shape.empty() && c10::IntArrayRef(st.global_shape) != c10::IntArrayRef(p.shape)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sharded optimizer state '", item.key(), "' has shape ", ShapeString(st.global_shape),
          "; the parameter's original shape is ", ShapeString(p.shape)));
    }
    const ShardRequest r = OptimRequest(p, st);
    auto pieces = Reshard(item.key(), {st}, r.ranges);
    if (!pieces.ok()) return pieces.status();
    torch::Tensor value;
    if (st.global_shape.empty()) {
      value = pieces->pieces[0].data.reshape({});
    } else if (p.managed == nullptr) {
      value = r.ranges.empty() ? torch::zeros(p.shape, st.dtype)
                               : pieces->pieces[0].data.reshape(p.shape);
    } else {
      value = r.ranges.empty() ? torch::zeros({0}, st.dtype) : pieces->pieces[0].data;
    }
    state[id->second].insert(entry, value);
  }
  OptimStateDict to_load;
  to_load.key_type = OptimStateKeyType::kParamId;
  to_load.param_groups = current->param_groups;
  for (auto& [id, entries] : state) to_load.state.emplace_back(ParamKey(id), std::move(entries));
  return ImportOptimizerState(optimizer, to_load);
}

absl::Status LoadShardedOptimCheckpoint(const FullyShardedDataParallel& model,
                                        torch::optim::Optimizer& optimizer,
                                        const std::string& step_dir) {
  auto view = DescribeOptim(model, optimizer);
  if (!view.ok()) return view.status();
  auto manifest = ReadManifest(step_dir);
  if (!manifest.ok()) return manifest.status();
  std::map<std::string, const OptimParam*> params;
  for (const OptimParam& p : view->params) params[p.name] = &p;
  std::vector<std::pair<std::string, ShardRequest>> requests;
  std::set<std::string> requested;
  for (const ManifestFile& file : manifest->files) {
    for (const ManifestTensor& t : file.tensors) {
      std::string param, entry;
      if (!SplitOptimName(t.name, &param, &entry)) continue;
      if (!requested.insert(t.name).second) continue;
      auto p = params.find(param);
      if (p == params.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "checkpoint ", step_dir, " has optimizer state '", t.name, "', but '", param,
            "' is not a parameter of the optimizer"));
      }
      ShardedTensor shape_only;
      shape_only.global_shape = t.global_shape;
      shape_only.dtype = t.dtype;
      requests.emplace_back(t.name, OptimRequest(*p->second, shape_only));
    }
  }
  auto loaded = LoadResharded(step_dir, requests);
  if (!loaded.ok()) return loaded.status();
  FsdpModelStateDict saved;
  saved.type = StateDictType::kSharded;
  saved.sharded = std::move(*loaded);
  return LoadShardedOptimStateDict(model, optimizer, saved);
}

}  // namespace state_dict
