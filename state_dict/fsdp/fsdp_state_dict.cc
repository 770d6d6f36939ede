#include "state_dict/fsdp/fsdp_state_dict.h"

#include <map>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include <torch/types.h>
#include <torch/utils.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/collectives.h"
#include "fsdp/flat_param.h"
#include "state_dict/checkpoint.h"
#include "state_dict/fsdp/internal/fsdp_view.h"
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

using internal::Describe;
using internal::Extra;
using internal::Flat;
using internal::FullPiece;
using internal::Managed;
using internal::ModelView;
using internal::NewStateDict;
using internal::ShapeString;
using internal::ShardRange;

absl::StatusOr<FsdpModelStateDict> GetFull(FullyShardedDataParallel& model,
                                           const StateDictConfig& config, const ModelView& view) {
  FsdpModelStateDict out = NewStateDict(view, StateDictType::kFull);
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
  FsdpModelStateDict out = NewStateDict(view, StateDictType::kSharded);
  for (const Managed& m : view.managed) {
    ShardedTensor st;
    st.global_shape = m.info->shape;
    st.dtype = m.handle->flat_param().scalar_type();
    if (m.info->numel_in_shard > 0) {
      st.pieces.push_back({{m.info->offset_in_param, m.info->numel_in_shard},
                           m.handle->flat_param().detach().narrow(0, m.info->offset_in_shard,
                                                                  m.info->numel_in_shard)});
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
  FsdpModelStateDict out = NewStateDict(view, StateDictType::kLocal);
  for (const Flat& f : view.flats) {
    ShardedTensor st;
    st.global_shape = {f.handle->padded_numel()};
    st.dtype = f.handle->flat_param().scalar_type();
    st.pieces.push_back({ShardRange(*f.handle), f.handle->flat_param().detach()});
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
                        const ShardedTensor* entry, c10::IntArrayRef shape, c10::ScalarType dtype) {
  if (entry == nullptr) {
    return absl::NotFoundError(absl::StrCat(what, " state dict has no entry '", name,
                                            "' (the model has it, shape ", ShapeString(shape),
                                            ")"));
  }
  if (c10::IntArrayRef(entry->global_shape) != shape) {
    return absl::InvalidArgumentError(absl::StrCat(what, " state dict entry '", name,
                                                   "' has shape ", ShapeString(entry->global_shape),
                                                   "; the model expects ", ShapeString(shape)));
  }
  if (entry->dtype != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(what, " state dict entry '", name,
                                                   "' has dtype ", c10::toString(entry->dtype),
                                                   "; the model expects ", c10::toString(dtype)));
  }
  return ValidateShardedTensor(name, *entry);
}

absl::Status CheckNoUnexpected(const std::string& what, const ShardedStateDict& dict,
                               const std::set<std::string>& known) {
  for (const auto& item : dict) {
    if (known.count(item.key()) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, " state dict has entry '", item.key(),
                                                     "', which the model does not have"));
    }
  }
  return absl::OkStatus();
}

absl::Status PlanExtras(const std::string& what, const ModelView& view,
                        const ShardedStateDict& dict, Plan& plan) {
  for (const Extra& e : view.extras) {
    const ShardedTensor* entry = dict.find(e.name);
    if (absl::Status s = CheckEntry(what, e.name, entry, e.tensor.sizes(), e.tensor.scalar_type());
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
    plan.copies.emplace_back(
        m.handle->flat_param().detach().narrow(0, m.info->offset_in_shard, m.info->numel_in_shard),
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
    if (absl::Status s =
            CheckEntry("LOCAL", f.name, entry, {f.handle->padded_numel()}, flat.scalar_type());
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
                                : absl::StrCat(", the first [", entry->pieces[0].range.offset, ", ",
                                               entry->pieces[0].range.end(), ")")));
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

StateDictTypeGuard::StateDictTypeGuard(const FullyShardedDataParallel& model, StateDictType type,
                                       StateDictConfig config)
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
                                                     StateDictType type, StateDictConfig config) {
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

absl::Status LoadModelStateDict(FullyShardedDataParallel& model, const FsdpModelStateDict& state) {
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
  return SaveShard(root, step, state.rank, state.world_size, ShardToSave(state));
}

ShardedStateDict ShardToSave(const FsdpModelStateDict& state) {
  if (state.type == StateDictType::kLocal || state.rank == 0) return state.sharded;
  // SHARDED on ranks != 0: entries every rank holds in full are written by
  // rank 0 only, and a hybrid replica's pieces by replicate index 0 (listed
  // here without pieces, so shapes are still recorded).
  const std::set<std::string> replicated(state.replicated.begin(), state.replicated.end());
  ShardedStateDict shard;
  for (const auto& item : state.sharded) {
    ShardedTensor st = item.value();
    if (state.shard_is_replica || replicated.count(item.key()) != 0) st.pieces.clear();
    shard.insert(item.key(), std::move(st));
  }
  return shard;
}

absl::Status LoadModelShardedFrom(FullyShardedDataParallel& model, const ShardedReader& read) {
  auto view = Describe(model);
  if (!view.ok()) return view.status();
  FsdpModelStateDict state = NewStateDict(*view, StateDictType::kSharded);
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
  auto loaded = read(requests);
  if (!loaded.ok()) return loaded.status();
  state.sharded = std::move(*loaded);
  return LoadSharded(*view, state);
}

absl::Status LoadModelCheckpoint(FullyShardedDataParallel& model, const std::string& step_dir,
                                 StateDictType type) {
  auto view = Describe(model);
  if (!view.ok()) return view.status();
  FsdpModelStateDict state = NewStateDict(*view, type);
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
    case StateDictType::kSharded:
      return LoadModelShardedFrom(
          model, [&](const ShardRequests& requests) { return LoadResharded(step_dir, requests); });
    case StateDictType::kLocal: {
      auto local = LoadLocalShard(step_dir, view->rank, view->world_size);
      if (!local.ok()) return local.status();
      for (const Flat& f : view->flats) {
        const torch::Tensor* t = local->find(f.name);
        if (t == nullptr) {
          return absl::NotFoundError(absl::StrCat("LOCAL checkpoint ", step_dir, " has no entry '",
                                                  f.name, "' for rank ", view->rank));
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
          return absl::NotFoundError(absl::StrCat("LOCAL checkpoint ", step_dir, " has no entry '",
                                                  e.name, "' for rank ", view->rank));
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

}  // namespace state_dict
