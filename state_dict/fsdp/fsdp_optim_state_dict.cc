#include "state_dict/fsdp/fsdp_optim_state_dict.h"

#include <map>
#include <set>
#include <utility>
#include <vector>

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include "absl/strings/str_cat.h"
#include "comm/collectives.h"
#include "state_dict/checkpoint.h"
#include "state_dict/fsdp/internal/fsdp_view.h"
#include "state_dict/internal/status_macros.h"
#include "state_dict/manifest.h"

namespace state_dict {
namespace {

using fsdp::FullyShardedDataParallel;
using internal::Managed;
using internal::ModelView;
using internal::ShapeString;

// One original parameter (or a parameter FSDP does not manage) and where
// this rank's part of it sits in the tensor the optimizer steps.
struct Slot {
  std::string name;
  std::vector<int64_t> shape;  // original shape
  int64_t numel = 0;
  int64_t id = 0;                    // optimizer parameter ID holding it
  const Managed* managed = nullptr;  // null: unmanaged, full on every rank
  bool replicated = false;           // every rank holds all of it
  FlatRange part;                    // this rank's elements of the original
  int64_t offset_in_local = 0;       // where they start in the optimizer's tensor
};

struct OptimParam {
  std::vector<int64_t> local_shape;  // the optimizer's tensor
  std::vector<size_t> slots;
};

struct OptimView {
  ModelView model;
  std::vector<Slot> slots;         // by original parameter ID
  std::vector<OptimParam> params;  // by optimizer ID
  std::map<std::string, size_t> slot_of;
};

absl::StatusOr<OptimView> DescribeOptim(const FullyShardedDataParallel& model,
                                        const torch::optim::Optimizer& optimizer) {
  OptimView out;
  STATE_DICT_ASSIGN_OR_RETURN(out.model, internal::Describe(model));
  const bool flat = !model.options().use_orig_params;
  // What each optimizer-facing tensor is.
  std::map<const c10::TensorImpl*, const internal::Flat*> flats;
  for (const internal::Flat& f : out.model.flats) {
    flats[f.handle->flat_param().unsafeGetTensorImpl()] = &f;
  }
  std::map<std::string, const Managed*> managed_by_name;
  for (const Managed& m : out.model.managed) managed_by_name[m.name] = &m;
  std::map<const c10::TensorImpl*, std::string> module_names;
  for (const auto& item : model.module()->named_parameters()) {
    module_names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  auto add_managed = [&](const Managed& m, int64_t id, int64_t offset_in_local) {
    Slot s;
    s.name = m.name;
    s.shape = m.info->shape;
    s.numel = m.info->numel;
    s.id = id;
    s.managed = &m;
    s.replicated = out.model.replicated_shards;
    s.part = {m.info->offset_in_param, m.info->numel_in_shard};
    s.offset_in_local = offset_in_local;
    return s;
  };
  int64_t id = 0;
  for (const auto& group : optimizer.param_groups()) {
    for (const torch::Tensor& param : group.params()) {
      OptimParam p;
      p.local_shape = param.sizes().vec();
      const c10::TensorImpl* impl = param.unsafeGetTensorImpl();
      std::vector<Slot> slots;
      if (auto f = flats.find(impl); f != flats.end()) {
        for (const Managed& m : out.model.managed) {
          if (m.handle == f->second->handle) {
            slots.push_back(add_managed(m, id, m.info->offset_in_shard));
          }
        }
      } else if (auto n = module_names.find(impl); n != module_names.end()) {
        if (auto m = managed_by_name.find(n->second); m != managed_by_name.end()) {
          if (flat) {
            return absl::InvalidArgumentError(absl::StrCat(
                "optimizer parameter ", id, " is the original parameter '", n->second,
                "', but the model (use_orig_params=false) steps flat parameters: build the "
                "optimizer over the FSDP model's parameters()"));
          }
          slots.push_back(add_managed(*m->second, id, 0));
        } else {
          Slot s;
          s.name = n->second;
          s.shape = param.sizes().vec();
          s.numel = param.numel();
          s.id = id;
          s.replicated = true;
          s.part = {0, s.numel};
          slots.push_back(std::move(s));
        }
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "optimizer parameter ", id, " (shape ", ShapeString(param.sizes()),
            ") is not a parameter of the FSDP model: build the optimizer over the FSDP "
            "model's parameters()"));
      }
      for (Slot& s : slots) {
        p.slots.push_back(out.slots.size());
        out.slot_of[s.name] = out.slots.size();
        out.slots.push_back(std::move(s));
      }
      out.params.push_back(std::move(p));
      ++id;
    }
  }
  return out;
}

std::vector<std::string> SlotNames(const OptimView& view) {
  std::vector<std::string> names;
  for (const Slot& s : view.slots) names.push_back(s.name);
  return names;
}

// This rank's part of `slot` in the optimizer's tensor `value` (1-D).
torch::Tensor LocalPart(const Slot& slot, const torch::Tensor& value) {
  return value.detach().reshape({-1}).narrow(0, slot.offset_in_local, slot.part.numel);
}

// The optimizer's param_groups with each group's parameters listed as the
// names of its originals.
std::vector<OptimParamGroup> NamedGroups(const OptimView& view, const OptimStateDict& exported) {
  std::vector<OptimParamGroup> groups;
  for (const OptimParamGroup& g : exported.param_groups) {
    OptimParamGroup named;
    named.options = g.options;
    for (const ParamKey& key : g.params) {
      for (size_t s : view.params[static_cast<size_t>(std::get<int64_t>(key))].slots) {
        named.params.emplace_back(view.slots[s].name);
      }
    }
    groups.push_back(std::move(named));
  }
  return groups;
}

// Entries split like their parameter, in a fixed order (the presence flags
// exchanged below).
constexpr const char* kShardedKeys[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                        "momentum_buffer"};
constexpr int kNumShardedKeys = 4;
constexpr const char* kKnownKeys = "step, exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer";

int ShardedKeyIndex(const std::string& key) {
  for (int k = 0; k < kNumShardedKeys; ++k) {
    if (key == kShardedKeys[k]) return k;
  }
  return -1;
}

// Per slot: kNumShardedKeys presence flags, the step, whether it has one.
constexpr int64_t kMetaWidth = kNumShardedKeys + 2;

// Turns a name- or original-ID-keyed full dict into per-slot entries.
absl::StatusOr<std::vector<const TensorDict*>> EntriesBySlot(const OptimView& view,
                                                             const OptimStateDict& full) {
  std::vector<const TensorDict*> by_slot(view.slots.size(), nullptr);
  for (const auto& [key, entries] : full.state) {
    size_t slot = 0;
    if (const int64_t* id = std::get_if<int64_t>(&key)) {
      if (*id < 0 || *id >= static_cast<int64_t>(view.slots.size())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "full optimizer state has parameter ID ", *id, "; the model's optimizer has ",
            view.slots.size(), " original parameters (IDs 0..", view.slots.size() - 1, ")"));
      }
      slot = static_cast<size_t>(*id);
    } else {
      const std::string& name = std::get<std::string>(key);
      auto it = view.slot_of.find(name);
      if (it == view.slot_of.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("full optimizer state has parameter '", name,
                         "', which is not a parameter of the optimizer's model"));
      }
      slot = it->second;
    }
    by_slot[slot] = &entries;
  }
  return by_slot;
}

// Checks one full entry of `slot`: a scalar or a tensor of the original's
// shape.
absl::Status CheckFullEntry(const Slot& slot, const std::string& key, const torch::Tensor& value) {
  if (value.dim() == 0) return absl::OkStatus();
  if (ShardedKeyIndex(key) < 0) {
    return absl::InvalidArgumentError(absl::StrCat("full optimizer state '", slot.name, "/", key,
                                                   "' is not a known entry (known: ", kKnownKeys,
                                                   ")"));
  }
  if (value.sizes() != c10::IntArrayRef(slot.shape)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "full optimizer state '", slot.name, "/", key, "' has shape ", ShapeString(value.sizes()),
        "; the parameter's original shape is ", ShapeString(slot.shape)));
  }
  return absl::OkStatus();
}

// Assembles the optimizer-ID-keyed state of this rank from per-slot parts:
// parts[slot][key] is the slot's part (1-D, slot.part.numel elements) or a
// 0-dim scalar. Originals sharing one flat parameter must have the same
// entries and equal scalars.
absl::StatusOr<std::vector<std::pair<ParamKey, TensorDict>>> AssembleLocal(
    const OptimView& view, const std::vector<std::map<std::string, torch::Tensor>>& parts,
    const std::string& what) {
  std::vector<std::pair<ParamKey, TensorDict>> state;
  for (size_t id = 0; id < view.params.size(); ++id) {
    const OptimParam& p = view.params[id];
    std::set<std::string> keys;
    for (size_t s : p.slots) {
      for (const auto& [key, value] : parts[s]) keys.insert(key);
    }
    if (keys.empty()) continue;
    TensorDict entries;
    for (const std::string& key : keys) {
      torch::Tensor local;
      const Slot* first = nullptr;
      for (size_t s : p.slots) {
        const Slot& slot = view.slots[s];
        auto it = parts[s].find(key);
        if (it == parts[s].end()) {
          return absl::InvalidArgumentError(absl::StrCat(
              what, " has '", key, "' for '", view.slots[p.slots[0]].name, "' but not for '",
              slot.name, "', which shares its flat parameter (optimizer parameter ", id,
              "): a flat parameter's originals must all have the entry"));
        }
        const torch::Tensor& value = it->second;
        if (value.dim() == 0) {
          if (first == nullptr) {
            local = value.clone();
            first = &slot;
          } else if (!value.equal(local)) {
            return absl::InvalidArgumentError(
                absl::StrCat(what, " has '", key, "' = ", value.item<double>(), " for '", slot.name,
                             "' but ", local.item<double>(), " for '", first->name,
                             "', which share a flat parameter: they must be equal"));
          }
          continue;
        }
        if (!local.defined()) {
          local = torch::zeros(p.local_shape, value.options());
          first = &slot;
        }
        if (slot.part.numel > 0) {
          local.view({-1})
              .narrow(0, slot.offset_in_local, slot.part.numel)
              .copy_(value.reshape({-1}));
        }
      }
      entries.insert(key, local);
    }
    state.emplace_back(ParamKey(static_cast<int64_t>(id)), std::move(entries));
  }
  return state;
}

// The full dict's groups, their parameters as this optimizer's IDs (each
// once, in first-seen order).
absl::StatusOr<std::vector<OptimParamGroup>> GroupsById(const OptimView& view,
                                                        const OptimStateDict& full) {
  std::vector<OptimParamGroup> groups;
  for (const OptimParamGroup& g : full.param_groups) {
    OptimParamGroup by_id;
    by_id.options = g.options;
    std::set<int64_t> seen;
    for (const ParamKey& key : g.params) {
      size_t slot = 0;
      if (const int64_t* id = std::get_if<int64_t>(&key)) {
        if (*id < 0 || *id >= static_cast<int64_t>(view.slots.size())) {
          return absl::InvalidArgumentError(absl::StrCat(
              "full optimizer state's param_groups list parameter ID ", *id,
              "; the model's optimizer has ", view.slots.size(), " original parameters"));
        }
        slot = static_cast<size_t>(*id);
      } else {
        auto it = view.slot_of.find(std::get<std::string>(key));
        if (it == view.slot_of.end()) {
          return absl::InvalidArgumentError(
              absl::StrCat("full optimizer state's param_groups list '", std::get<std::string>(key),
                           "', which is not a parameter of the optimizer's model"));
        }
        slot = it->second;
      }
      const int64_t id = view.slots[slot].id;
      if (seen.insert(id).second) by_id.params.emplace_back(id);
    }
    groups.push_back(std::move(by_id));
  }
  return groups;
}

// ShardFullOptimStateDict for a validated view; `groups` from the full dict.
absl::StatusOr<OptimStateDict> ShardFull(const OptimView& view, const OptimStateDict& full,
                                         std::vector<OptimParamGroup> groups) {
  std::vector<const TensorDict*> by_slot;
  STATE_DICT_ASSIGN_OR_RETURN(by_slot, EntriesBySlot(view, full));
  std::vector<std::map<std::string, torch::Tensor>> parts(view.slots.size());
  for (size_t s = 0; s < view.slots.size(); ++s) {
    if (by_slot[s] == nullptr) continue;
    const Slot& slot = view.slots[s];
    for (const auto& entry : *by_slot[s]) {
      const torch::Tensor& value = entry.value();
      if (absl::Status st = CheckFullEntry(slot, entry.key(), value); !st.ok()) return st;
      parts[s][entry.key()] = value.dim() == 0 ? value.detach()
                                               : value.detach().reshape({-1}).narrow(
                                                     0, slot.part.offset, slot.part.numel);
    }
  }
  OptimStateDict out;
  out.key_type = OptimStateKeyType::kParamId;
  STATE_DICT_ASSIGN_OR_RETURN(out.state, AssembleLocal(view, parts, "full optimizer state"));
  out.param_groups = std::move(groups);
  return out;
}

// Splits "<param>/<entry>"; false for model entries (no '/').
bool SplitOptimName(const std::string& name, std::string* param, std::string* entry) {
  const size_t slash = name.rfind('/');
  if (slash == std::string::npos) return false;
  *param = name.substr(0, slash);
  *entry = name.substr(slash + 1);
  return true;
}

// What this rank needs of a saved entry of `slot` (scalars: their element).
ShardRequest SlotRequest(const Slot& slot, const std::vector<int64_t>& global_shape,
                         c10::ScalarType dtype) {
  ShardRequest r;
  r.global_shape = global_shape;
  r.dtype = dtype;
  if (global_shape.empty()) {
    r.ranges.push_back({0, 1});
  } else if (slot.part.numel > 0) {
    r.ranges.push_back(slot.part);
  }
  return r;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> FsdpOptimizerParamNames(
    const FullyShardedDataParallel& model, const torch::optim::Optimizer& optimizer) {
  OptimView view;
  STATE_DICT_ASSIGN_OR_RETURN(view, DescribeOptim(model, optimizer));
  return SlotNames(view);
}

absl::StatusOr<OptimStateDict> FullOptimStateDict(FullyShardedDataParallel& model,
                                                  const torch::optim::Optimizer& optimizer,
                                                  bool rank0_only) {
  OptimView view;
  STATE_DICT_ASSIGN_OR_RETURN(view, DescribeOptim(model, optimizer));
  OptimStateDict exported;
  STATE_DICT_ASSIGN_OR_RETURN(exported, ExportOptimizerState(optimizer));
  std::vector<const TensorDict*> local(view.params.size(), nullptr);
  for (const auto& [key, entries] : exported.state) {
    local[static_cast<size_t>(std::get<int64_t>(key))] = &entries;
  }
  // Which entries exist anywhere (a rank holding none of a parameter may
  // have no state for it) and each scalar's value: one all-reduce (max).
  const int64_t n = static_cast<int64_t>(view.slots.size());
  torch::Tensor meta = torch::full({n * kMetaWidth}, -1.0, torch::kFloat64);
  for (int64_t i = 0; i < n; ++i) {
    const Slot& slot = view.slots[static_cast<size_t>(i)];
    const TensorDict* entries = local[static_cast<size_t>(slot.id)];
    if (entries == nullptr) continue;
    for (const auto& entry : *entries) {
      if (entry.value().dim() == 0) {
        if (entry.key() != "step") {
          return absl::UnimplementedError(
              absl::StrCat("FSDP optimizer state entry '", slot.name, "/", entry.key(),
                           "' cannot be consolidated (known: ", kKnownKeys, ")"));
        }
        meta[i * kMetaWidth + kNumShardedKeys] = entry.value().item<double>();
        meta[i * kMetaWidth + kNumShardedKeys + 1] = 1.0;
        continue;
      }
      const int k = ShardedKeyIndex(entry.key());
      if (k < 0) {
        return absl::UnimplementedError(
            absl::StrCat("FSDP optimizer state entry '", slot.name, "/", entry.key(),
                         "' cannot be consolidated (known: ", kKnownKeys, ")"));
      }
      meta[i * kMetaWidth + k] = 1.0;
    }
  }
  // Replicas of the shard group hold the same values: the shard group sees
  // every element once.
  comm::all_reduce(view.model.shard_group, meta, comm::ReduceOp::kMax).wait();

  OptimStateDict full;
  full.key_type = OptimStateKeyType::kParamName;
  for (int64_t i = 0; i < n; ++i) {
    const Slot& slot = view.slots[static_cast<size_t>(i)];
    const TensorDict* entries = local[static_cast<size_t>(slot.id)];
    TensorDict out;
    for (int k = 0; k < kNumShardedKeys; ++k) {
      if (meta[i * kMetaWidth + k].item<double>() < 0) continue;
      const torch::Tensor* value = entries == nullptr ? nullptr : entries->find(kShardedKeys[k]);
      torch::Tensor gathered;
      if (slot.replicated) {
        if (value == nullptr) {
          return absl::InternalError(absl::StrCat("optimizer state '", slot.name, "/",
                                                  kShardedKeys[k], "' is missing on rank ",
                                                  view.model.rank));
        }
        gathered = LocalPart(slot, *value).to(torch::kFloat32).reshape(slot.shape).clone();
      } else {
        torch::Tensor buffer = torch::zeros({slot.numel}, torch::kFloat32);
        if (value != nullptr && slot.part.numel > 0) {
          buffer.narrow(0, slot.part.offset, slot.part.numel).copy_(LocalPart(slot, *value));
        }
        comm::all_reduce(view.model.shard_group, buffer, comm::ReduceOp::kSum).wait();
        gathered = buffer.reshape(slot.shape);
      }
      out.insert(kShardedKeys[k], gathered);
    }
    if (meta[i * kMetaWidth + kNumShardedKeys + 1].item<double>() > 0) {
      out.insert("step", torch::tensor(meta[i * kMetaWidth + kNumShardedKeys].item<double>(),
                                       torch::kFloat32));
    }
    if (!out.is_empty()) full.state.emplace_back(ParamKey(slot.name), std::move(out));
  }
  if (rank0_only && view.model.rank != 0) return OptimStateDict{};
  full.param_groups = NamedGroups(view, exported);
  return full;
}

absl::StatusOr<OptimStateDict> ShardFullOptimStateDict(const FullyShardedDataParallel& model,
                                                       const torch::optim::Optimizer& optimizer,
                                                       const OptimStateDict& full) {
  OptimView view;
  STATE_DICT_ASSIGN_OR_RETURN(view, DescribeOptim(model, optimizer));
  std::vector<OptimParamGroup> groups;
  STATE_DICT_ASSIGN_OR_RETURN(groups, GroupsById(view, full));
  return ShardFull(view, full, std::move(groups));
}

absl::StatusOr<OptimStateDict> ScatterFullOptimStateDict(FullyShardedDataParallel& model,
                                                         const torch::optim::Optimizer& optimizer,
                                                         const OptimStateDict& full) {
  OptimView view;
  STATE_DICT_ASSIGN_OR_RETURN(view, DescribeOptim(model, optimizer));
  OptimStateDict current;
  STATE_DICT_ASSIGN_OR_RETURN(current, ExportOptimizerState(optimizer));
  const int64_t n = static_cast<int64_t>(view.slots.size());
  // meta[0]: 1 when rank 0's dict is usable; then kMetaWidth per slot.
  torch::Tensor meta = torch::zeros({1 + n * kMetaWidth}, torch::kFloat64);
  std::vector<const TensorDict*> by_slot(view.slots.size(), nullptr);
  absl::Status problem = absl::OkStatus();
  if (view.model.rank == 0) {
    auto entries = EntriesBySlot(view, full);
    if (entries.ok()) {
      by_slot = std::move(*entries);
    } else {
      problem = entries.status();
    }
    for (int64_t i = 0; i < n && problem.ok(); ++i) {
      const TensorDict* dict = by_slot[static_cast<size_t>(i)];
      if (dict == nullptr) continue;
      const Slot& slot = view.slots[static_cast<size_t>(i)];
      for (const auto& e : *dict) {
        problem = CheckFullEntry(slot, e.key(), e.value());
        if (!problem.ok()) break;
        if (e.value().dim() == 0) {
          if (e.key() != "step") {
            problem = absl::InvalidArgumentError(
                absl::StrCat("full optimizer state '", slot.name, "/", e.key(),
                             "' cannot be scattered (known: ", kKnownKeys, ")"));
            break;
          }
          meta[1 + i * kMetaWidth + kNumShardedKeys] = e.value().item<double>();
          meta[1 + i * kMetaWidth + kNumShardedKeys + 1] = 1.0;
          continue;
        }
        meta[1 + i * kMetaWidth + ShardedKeyIndex(e.key())] = 1.0;
      }
    }
    meta[0] = problem.ok() ? 1.0 : 0.0;
  }
  internal::BroadcastFromRankZero(view.model, meta);
  if (meta[0].item<double>() == 0) {
    if (!problem.ok()) return problem;
    return absl::InvalidArgumentError(
        "scatter_full_optim_state_dict: rank 0's full optimizer state dict was rejected (see "
        "rank 0's error)");
  }
  OptimStateDict mine;
  mine.key_type = OptimStateKeyType::kParamName;
  for (int64_t i = 0; i < n; ++i) {
    const Slot& slot = view.slots[static_cast<size_t>(i)];
    TensorDict dict;
    for (int k = 0; k < kNumShardedKeys; ++k) {
      if (meta[1 + i * kMetaWidth + k].item<double>() == 0) continue;
      torch::Tensor value;  // 1-D: collectives take flat tensors
      if (view.model.rank == 0) {
        value = by_slot[static_cast<size_t>(i)]
                    ->find(kShardedKeys[k])
                    ->to(torch::kFloat32)
                    .reshape({-1})
                    .clone();
      } else {
        value = torch::empty({slot.numel}, torch::kFloat32);
      }
      internal::BroadcastFromRankZero(view.model, value);
      dict.insert(kShardedKeys[k], value.reshape(slot.shape));
    }
    if (meta[1 + i * kMetaWidth + kNumShardedKeys + 1].item<double>() > 0) {
      dict.insert("step", torch::tensor(meta[1 + i * kMetaWidth + kNumShardedKeys].item<double>(),
                                        torch::kFloat32));
    }
    if (!dict.is_empty()) mine.state.emplace_back(ParamKey(slot.name), std::move(dict));
  }
  return ShardFull(view, mine, current.param_groups);
}

absl::StatusOr<std::vector<OptimParamGroup>> NamedParamGroups(
    const FullyShardedDataParallel& model, const torch::optim::Optimizer& optimizer) {
  OptimView view;
  STATE_DICT_ASSIGN_OR_RETURN(view, DescribeOptim(model, optimizer));
  OptimStateDict exported;
  STATE_DICT_ASSIGN_OR_RETURN(exported, ExportOptimizerState(optimizer));
  return NamedGroups(view, exported);
}

absl::StatusOr<FsdpModelStateDict> ShardedOptimStateDict(const FullyShardedDataParallel& model,
                                                         const torch::optim::Optimizer& optimizer) {
  OptimView view;
  STATE_DICT_ASSIGN_OR_RETURN(view, DescribeOptim(model, optimizer));
  OptimStateDict exported;
  STATE_DICT_ASSIGN_OR_RETURN(exported, ExportOptimizerState(optimizer));
  FsdpModelStateDict out = internal::NewStateDict(view.model, StateDictType::kSharded);
  for (const auto& [key, entries] : exported.state) {
    const OptimParam& p = view.params[static_cast<size_t>(std::get<int64_t>(key))];
    for (const auto& entry : entries) {
      const torch::Tensor value = entry.value().detach();
      if (value.dim() > 0 && value.sizes() != c10::IntArrayRef(p.local_shape)) {
        return absl::InternalError(absl::StrCat(
            "optimizer state '", view.slots[p.slots[0]].name, "/", entry.key(), "' has shape ",
            ShapeString(value.sizes()), "; its parameter has ", ShapeString(p.local_shape)));
      }
      for (size_t s : p.slots) {
        const Slot& slot = view.slots[s];
        const std::string name = absl::StrCat(slot.name, "/", entry.key());
        if (value.dim() == 0) {
          ShardedTensor st;
          st.dtype = value.scalar_type();
          st.pieces.push_back({{0, 1}, value.reshape({1}).clone()});
          out.sharded.insert(name, std::move(st));
          out.replicated.push_back(name);
        } else if (slot.replicated) {
          out.sharded.insert(name, internal::FullPiece(LocalPart(slot, value).reshape(slot.shape)));
          out.replicated.push_back(name);
        } else {
          ShardedTensor st;
          st.global_shape = slot.shape;
          st.dtype = value.scalar_type();
          if (slot.part.numel > 0) {
            st.pieces.push_back({slot.part, LocalPart(slot, value)});
          }
          out.sharded.insert(name, std::move(st));
        }
      }
    }
  }
  return out;
}

absl::StatusOr<FsdpModelStateDict> MergeShardedStateDicts(FsdpModelStateDict model,
                                                          const FsdpModelStateDict& optimizer) {
  if (model.type != StateDictType::kSharded || optimizer.type != StateDictType::kSharded) {
    return absl::InvalidArgumentError(
        absl::StrCat("MergeShardedStateDicts: expected two SHARDED_STATE_DICTs, got ",
                     StateDictTypeName(model.type), " and ", StateDictTypeName(optimizer.type)));
  }
  if (model.rank != optimizer.rank || model.world_size != optimizer.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("MergeShardedStateDicts: the model's state dict is of rank ", model.rank,
                     " of ", model.world_size, ", the optimizer's of rank ", optimizer.rank, " of ",
                     optimizer.world_size));
  }
  for (const auto& item : optimizer.sharded) {
    if (model.sharded.contains(item.key())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "MergeShardedStateDicts: both state dicts have an entry '", item.key(), "'"));
    }
    model.sharded.insert(item.key(), item.value());
  }
  model.replicated.insert(model.replicated.end(), optimizer.replicated.begin(),
                          optimizer.replicated.end());
  return model;
}

absl::StatusOr<OptimStateDict> FlattenShardedOptimStateDict(
    const FullyShardedDataParallel& model, const torch::optim::Optimizer& optimizer,
    const FsdpModelStateDict& sharded) {
  OptimView view;
  STATE_DICT_ASSIGN_OR_RETURN(view, DescribeOptim(model, optimizer));
  OptimStateDict current;
  STATE_DICT_ASSIGN_OR_RETURN(current, ExportOptimizerState(optimizer));
  std::vector<std::map<std::string, torch::Tensor>> parts(view.slots.size());
  for (const auto& item : sharded.sharded) {
    std::string param, entry;
    if (!SplitOptimName(item.key(), &param, &entry)) continue;
    auto it = view.slot_of.find(param);
    if (it == view.slot_of.end()) {
      return absl::InvalidArgumentError(absl::StrCat("sharded optimizer state has entry '",
                                                     item.key(), "', but '", param,
                                                     "' is not a parameter of the optimizer"));
    }
    const Slot& slot = view.slots[it->second];
    const ShardedTensor& st = item.value();
    if (!st.global_shape.empty() &&
        c10::IntArrayRef(st.global_shape) != c10::IntArrayRef(slot.shape)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sharded optimizer state '", item.key(), "' has shape ", ShapeString(st.global_shape),
          "; the parameter's original shape is ", ShapeString(slot.shape)));
    }
    if (!st.global_shape.empty() && ShardedKeyIndex(entry) < 0) {
      return absl::InvalidArgumentError(absl::StrCat("sharded optimizer state '", item.key(),
                                                     "' is not a known entry (known: ", kKnownKeys,
                                                     ")"));
    }
    const ShardRequest r = SlotRequest(slot, st.global_shape, st.dtype);
    ShardedTensor resharded;
    STATE_DICT_ASSIGN_OR_RETURN(resharded, Reshard(item.key(), {st}, r.ranges));
    if (st.global_shape.empty()) {
      parts[it->second][entry] = resharded.pieces[0].data.reshape({});
    } else {
      parts[it->second][entry] =
          r.ranges.empty() ? torch::zeros({0}, st.dtype) : resharded.pieces[0].data;
    }
  }
  OptimStateDict out;
  out.key_type = OptimStateKeyType::kParamId;
  STATE_DICT_ASSIGN_OR_RETURN(out.state, AssembleLocal(view, parts, "sharded optimizer state"));
  out.param_groups = current.param_groups;
  return out;
}

absl::Status LoadShardedOptimStateDict(const FullyShardedDataParallel& model,
                                       torch::optim::Optimizer& optimizer,
                                       const FsdpModelStateDict& sharded) {
  OptimStateDict to_load;
  STATE_DICT_ASSIGN_OR_RETURN(to_load, FlattenShardedOptimStateDict(model, optimizer, sharded));
  return ImportOptimizerState(optimizer, to_load);
}

absl::Status LoadShardedOptimFrom(const FullyShardedDataParallel& model,
                                  torch::optim::Optimizer& optimizer, const std::string& source,
                                  const std::vector<ShardedEntryInfo>& entries,
                                  const ShardedReader& read) {
  OptimView view;
  STATE_DICT_ASSIGN_OR_RETURN(view, DescribeOptim(model, optimizer));
  ShardRequests requests;
  std::set<std::string> requested;
  for (const ShardedEntryInfo& t : entries) {
    std::string param, entry;
    if (!SplitOptimName(t.name, &param, &entry)) continue;
    if (!requested.insert(t.name).second) continue;
    auto it = view.slot_of.find(param);
    if (it == view.slot_of.end()) {
      return absl::InvalidArgumentError(absl::StrCat(source, " has optimizer state '", t.name,
                                                     "', but '", param,
                                                     "' is not a parameter of the optimizer"));
    }
    requests.emplace_back(t.name, SlotRequest(view.slots[it->second], t.global_shape, t.dtype));
  }
  FsdpModelStateDict saved;
  saved.type = StateDictType::kSharded;
  STATE_DICT_ASSIGN_OR_RETURN(saved.sharded, read(requests));
  return LoadShardedOptimStateDict(model, optimizer, saved);
}

absl::Status LoadShardedOptimCheckpoint(const FullyShardedDataParallel& model,
                                        torch::optim::Optimizer& optimizer,
                                        const std::string& step_dir) {
  Manifest manifest;
  STATE_DICT_ASSIGN_OR_RETURN(manifest, ReadManifest(step_dir));
  std::vector<ShardedEntryInfo> entries;
  for (const ManifestFile& file : manifest.files) {
    for (const ManifestTensor& t : file.tensors) {
      entries.push_back(ShardedEntryInfo{t.name, t.global_shape, t.dtype});
    }
  }
  return LoadShardedOptimFrom(
      model, optimizer, absl::StrCat("checkpoint ", step_dir), entries,
      [&](const ShardRequests& requests) { return LoadResharded(step_dir, requests); });
}

absl::StatusOr<FsdpOptimStateDict> GetOptimStateDict(FullyShardedDataParallel& model,
                                                     const torch::optim::Optimizer& optimizer,
                                                     StateDictType type, StateDictConfig config) {
  FsdpOptimStateDict out;
  out.type = type;
  switch (type) {
    case StateDictType::kFull:
      STATE_DICT_ASSIGN_OR_RETURN(out.full,
                                  FullOptimStateDict(model, optimizer, config.rank0_only));
      return out;
    case StateDictType::kSharded:
      STATE_DICT_ASSIGN_OR_RETURN(out.sharded, ShardedOptimStateDict(model, optimizer));
      return out;
    case StateDictType::kLocal: break;
  }
  return absl::InvalidArgumentError(
      "optim_state_dict: LOCAL_STATE_DICT is not supported for optimizer state (it is "
      "defined per original parameter); use SHARDED_STATE_DICT, which loads at any world "
      "size, or FULL_STATE_DICT");
}

absl::StatusOr<FsdpOptimStateDict> GetOptimStateDict(FullyShardedDataParallel& model,
                                                     const torch::optim::Optimizer& optimizer) {
  return GetOptimStateDict(model, optimizer, CurrentStateDictType(model),
                           CurrentStateDictConfig(model));
}

absl::StatusOr<OptimStateDict> OptimStateDictToLoad(const FullyShardedDataParallel& model,
                                                    const torch::optim::Optimizer& optimizer,
                                                    const FsdpOptimStateDict& state) {
  switch (state.type) {
    case StateDictType::kFull: return ShardFullOptimStateDict(model, optimizer, state.full);
    case StateDictType::kSharded:
      return FlattenShardedOptimStateDict(model, optimizer, state.sharded);
    case StateDictType::kLocal: break;
  }
  return absl::InvalidArgumentError(
      "optim_state_dict_to_load: a LOCAL_STATE_DICT optimizer state does not exist (see "
      "GetOptimStateDict); pass a FULL or SHARDED one");
}

absl::Status LoadOptimStateDict(const FullyShardedDataParallel& model,
                                torch::optim::Optimizer& optimizer,
                                const FsdpOptimStateDict& state) {
  OptimStateDict to_load;
  STATE_DICT_ASSIGN_OR_RETURN(to_load, OptimStateDictToLoad(model, optimizer, state));
  return ImportOptimizerState(optimizer, to_load);
}

}  // namespace state_dict
