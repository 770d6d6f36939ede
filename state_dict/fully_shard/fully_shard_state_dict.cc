#include "state_dict/fully_shard/fully_shard_state_dict.h"

#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/collectives.h"
#include "fsdp/fully_shard.h"
#include "state_dict/checkpoint.h"
#include "state_dict/fsdp/checkpoint_keys.h"
#include "state_dict/fsdp/fsdp_full_checkpoint.h"
#include "state_dict/manifest.h"
#include "state_dict/optim_state.h"

namespace state_dict {
namespace {

std::string ShapeString(c10::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// One parameter or buffer of the model as the state dict sees it.
struct Entry {
  std::string fqn;
  torch::Tensor tensor;                        // the live shard, or the whole tensor
  std::optional<fsdp::ShardedParamSpec> spec;  // set for a fully_shard shard
  bool is_param = true;

  std::vector<int64_t> global_shape() const {
    return spec ? spec->global_shape : tensor.sizes().vec();
  }
  int64_t shard_dim() const { return spec ? spec->shard_dim : 0; }
  // This rank's part of the flattened global tensor, in the order of the
  // shard's own (contiguous) elements. A dim-0 shard is one run of whole
  // rows; a Shard(d) shard with d > 0 is one run per index of the dims
  // before d: its [shard_offset, + local size) slice of dim d, times the
  // dims after d.
  std::vector<FlatRange> ranges() const {
    const int64_t numel = tensor.numel();
    if (numel == 0) return {};
    if (!spec) return {FlatRange{0, numel}};
    const int64_t d = spec->shard_dim;
    if (d == 0) {
      const int64_t row = numel / tensor.size(0);
      return {FlatRange{spec->dim0_offset * row, numel}};
    }
    const std::vector<int64_t>& global = spec->global_shape;
    int64_t outer = 1, inner = 1;
    for (int64_t i = 0; i < d; ++i) outer *= global[static_cast<size_t>(i)];
    for (size_t i = static_cast<size_t>(d) + 1; i < global.size(); ++i) inner *= global[i];
    const int64_t run = tensor.size(d) * inner;
    const int64_t stride = global[static_cast<size_t>(d)] * inner;
    std::vector<FlatRange> out;
    out.reserve(static_cast<size_t>(outer));
    for (int64_t o = 0; o < outer; ++o) {
      out.push_back(FlatRange{o * stride + spec->shard_offset * inner, run});
    }
    return out;
  }
};

struct View {
  std::vector<Entry> entries;
  std::map<std::string, size_t> index;    // fqn -> entries
  std::map<const void*, size_t> by_impl;  // parameter TensorImpl -> entries
  // Checkpoint numbering: (replicate index r, shard rank s) is rank
  // r * shard size + s of replicate size * shard size (FSDP1's hybrid
  // numbering, fsdp_state_dict.h); replica 0 writes the shard pieces.
  int world_size = 1;
  int rank = 0;
  std::optional<comm::ProcessGroup> group;      // the shard group
  std::optional<comm::ProcessGroup> replicate;  // HSDP's replicate group
  bool is_replica() const { return replicate.has_value() && replicate->rank() != 0; }
};

// Every fully_shard module of the tree back to its shards (named_parameters
// then returns them).
void ReshardAll(const torch::nn::Module& model) {
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (auto unit = fsdp::as_fsdp_module(*m)) unit->reshard();
  }
}

absl::StatusOr<View> Describe(const torch::nn::Module& model) {
  try {
    ReshardAll(model);
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("fully_shard state dict: resharding the model: ", e.what_without_backtrace()));
  }
  View view;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (!item.value().defined()) continue;
    Entry e{item.key(), item.value(), fsdp::sharded_param_spec(item.value()), true};
    if (e.spec && !view.group) {
      view.group = e.spec->group;
      view.replicate = e.spec->replicate_group;
      const int replicas = view.replicate ? view.replicate->size() : 1;
      const int replica = view.replicate ? view.replicate->rank() : 0;
      view.world_size = replicas * e.spec->group.size();
      view.rank = replica * e.spec->group.size() + e.spec->rank;
    } else if (e.spec && (e.spec->group.name() != view.group->name() ||
                          e.spec->replicate_group.has_value() != view.replicate.has_value())) {
      return absl::UnimplementedError(
          absl::StrCat("fully_shard state dict: parameter '", e.fqn, "' is sharded over group '",
                       e.spec->group.name(), "', the first sharded parameter over '",
                       view.group->name(), "': expected one mesh for the whole tree"));
    }
    view.by_impl.emplace(item.value().unsafeGetTensorImpl(), view.entries.size());
    view.index.emplace(e.fqn, view.entries.size());
    view.entries.push_back(std::move(e));
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    if (!item.value().defined()) continue;
    view.index.emplace(item.key(), view.entries.size());
    view.entries.push_back(Entry{item.key(), item.value(), std::nullopt, false});
  }
  if (!view.group) {
    return absl::FailedPreconditionError(
        "fully_shard state dict: the module has no parameter fully_shard sharded: expected a "
        "module tree fsdp::fully_shard was applied to");
  }
  return view;
}

// `st`'s pieces back to back, in order: this rank's shard, flattened,
// when they are its ranges (Entry::ranges).
torch::Tensor JoinedPieces(const ShardedTensor& st) {
  if (st.pieces.size() == 1) return st.pieces[0].data;
  if (st.pieces.empty()) return torch::empty({0}, torch::TensorOptions().dtype(st.dtype));
  std::vector<torch::Tensor> runs;
  runs.reserve(st.pieces.size());
  for (const ShardPiece& piece : st.pieces) runs.push_back(piece.data);
  return torch::cat(runs);
}

// A Shard(d) entry (d > 0) whole on every rank of `group`: every rank
// holds an equal chunk of dim d (fully_shard requires it), its runs in
// order; gathered end to end they are the chunks, concatenated again on
// dim d. Collective.
absl::StatusOr<torch::Tensor> GatherOffDim0(const std::string& key, const ShardedTensor& st,
                                            int64_t dim, const comm::ProcessGroup& group) {
  const int world = group.size();
  const int64_t numel = st.global_numel();
  const torch::Tensor local = JoinedPieces(st);
  if (local.numel() * world != numel) {
    return absl::InternalError(absl::StrCat("fully_shard state dict: '", key, "' (Shard(", dim,
                                            ")) holds ", local.numel(), " elements on rank ",
                                            group.rank(), ": expected ", numel, " / ", world));
  }
  torch::Tensor gathered = torch::empty({numel}, torch::TensorOptions().dtype(st.dtype));
  try {
    comm::all_gather_into_tensor(group, gathered, local).wait();
  } catch (const c10::Error& e) {
    return absl::UnavailableError(absl::StrCat("fully_shard state dict: gathering '", key,
                                               "': ", e.what_without_backtrace()));
  }
  std::vector<int64_t> stacked = {world};
  stacked.insert(stacked.end(), st.global_shape.begin(), st.global_shape.end());
  stacked[static_cast<size_t>(dim) + 1] /= world;
  return torch::cat(gathered.view(stacked).unbind(0), dim);
}

// The shard dim of state dict entry `key`, `st` ("<fqn>" or
// "<fqn>/<entry>": a parameter's optimizer state of its shape is sharded
// as the parameter; Adam's 0-dim "step" is not); 0 for everything not
// sharded off dim 0.
int64_t ShardDimOf(const View& view, const std::string& key, const ShardedTensor& st) {
  const auto entry = view.index.find(key.substr(0, key.find('/')));
  if (entry == view.index.end()) return 0;
  const Entry& e = view.entries[entry->second];
  return e.global_shape() == st.global_shape ? e.shard_dim() : 0;
}

FsdpModelStateDict NewStateDict(const View& view) {
  FsdpModelStateDict out;
  out.type = StateDictType::kSharded;
  out.world_size = view.world_size;
  out.rank = view.rank;
  out.shard_is_replica = view.is_replica();
  return out;
}

// `value` (this rank's part of entry `e`'s shape) as a ShardedTensor; a
// view of it.
ShardedTensor Pieces(const Entry& e, const torch::Tensor& value) {
  ShardedTensor st;
  st.global_shape = e.global_shape();
  st.dtype = value.scalar_type();
  const torch::Tensor flat = value.detach().reshape({-1});
  int64_t at = 0;
  for (const FlatRange& range : e.ranges()) {
    st.pieces.push_back({range, flat.narrow(0, at, range.numel)});
    at += range.numel;
  }
  return st;
}

// Optimizer parameter IDs (LibTorch's: in group order) -> model entries.
absl::StatusOr<std::vector<size_t>> OptimParams(const View& view,
                                                const torch::optim::Optimizer& optimizer) {
  std::vector<size_t> out;
  for (const auto& group : optimizer.param_groups()) {
    for (const torch::Tensor& p : group.params()) {
      auto it = view.by_impl.find(p.unsafeGetTensorImpl());
      if (it == view.by_impl.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "fully_shard optimizer state dict: optimizer parameter ", out.size(), " (shape ",
            ShapeString(p.sizes()),
            ") is not a parameter of the module: expected an optimizer built on the module's "
            "parameters() after fully_shard (its shards)"));
      }
      out.push_back(it->second);
    }
  }
  return out;
}

// `loaded`'s entry `name` as this rank's tensor of `shape` (its pieces
// exactly `ranges`).
absl::StatusOr<torch::Tensor> Local(const ShardedStateDict& loaded, const std::string& name,
                                    const std::vector<FlatRange>& ranges,
                                    c10::IntArrayRef local_shape, c10::ScalarType dtype) {
  const ShardedTensor* st = loaded.find(name);
  if (st == nullptr) {
    return absl::NotFoundError(absl::StrCat("entry '", name, "' was not loaded"));
  }
  if (ranges.empty()) return torch::zeros(local_shape, torch::TensorOptions().dtype(dtype));
  bool exact = st->pieces.size() == ranges.size();
  for (size_t i = 0; exact && i < ranges.size(); ++i) exact = st->pieces[i].range == ranges[i];
  if (!exact) {
    return absl::InvalidArgumentError(
        absl::StrCat("entry '", name, "': the source returned ", st->pieces.size(),
                     " pieces, expected exactly this rank's ", ranges.size(),
                     " range(s) starting [", ranges[0].offset, ", ", ranges[0].end(), ")"));
  }
  return JoinedPieces(*st).reshape(local_shape);
}

absl::Status LoadOptim(const View& view, torch::optim::Optimizer& optimizer,
                       const std::string& source, const std::vector<ShardedEntryInfo>& entries,
                       const ShardedReader& read) {
  auto ids = OptimParams(view, optimizer);
  if (!ids.ok()) return ids.status();
  std::map<size_t, int64_t> id_of;
  for (size_t i = 0; i < ids->size(); ++i) id_of[(*ids)[i]] = static_cast<int64_t>(i);
  ShardRequests requests;
  std::vector<std::pair<int64_t, std::string>> slots;  // (param ID, entry) per request
  std::set<std::string> seen;
  for (const ShardedEntryInfo& info : entries) {
    std::string fqn, entry;
    if (!SplitEntryName(info.name, '/', &fqn, &entry) || !seen.insert(info.name).second) continue;
    auto it = view.index.find(fqn);
    if (it == view.index.end() || !view.entries[it->second].is_param) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, " has optimizer state '", info.name, "', but '", fqn,
                       "' is not a parameter of the module: expected '<parameter fqn>/<entry>'"));
    }
    auto id = id_of.find(it->second);
    if (id == id_of.end()) {
      return absl::InvalidArgumentError(absl::StrCat(source, " has optimizer state '", info.name,
                                                     "', but the optimizer does not step '", fqn,
                                                     "'"));
    }
    const Entry& e = view.entries[it->second];
    ShardRequest r;
    r.dtype = info.dtype;
    if (info.global_shape.empty()) {  // "step": one element, whole on every rank
      r.ranges = {FlatRange{0, 1}};
    } else {
      if (c10::IntArrayRef(info.global_shape) != c10::IntArrayRef(e.global_shape())) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": optimizer state '", info.name, "' has global shape ",
                         ShapeString(info.global_shape), ": expected its parameter's ",
                         ShapeString(e.global_shape())));
      }
      r.global_shape = info.global_shape;
      r.ranges = e.ranges();
    }
    requests.emplace_back(info.name, r);
    slots.emplace_back(id->second, entry);
  }
  auto loaded = read(requests);
  if (!loaded.ok()) return loaded.status();
  std::map<int64_t, TensorDict> per_param;
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& [name, r] = requests[i];
    const Entry& e = view.entries[(*ids)[static_cast<size_t>(slots[i].first)]];
    auto local = r.global_shape.empty() ? Local(*loaded, name, r.ranges, {}, r.dtype)
                                        : Local(*loaded, name, r.ranges, e.tensor.sizes(), r.dtype);
    if (!local.ok()) return local.status();
    per_param[slots[i].first].insert(slots[i].second, local->clone());
  }
  auto current = ExportOptimizerState(optimizer);
  if (!current.ok()) return current.status();
  OptimStateDict to_load;
  to_load.key_type = OptimStateKeyType::kParamId;
  to_load.param_groups = current->param_groups;
  for (auto& [id, dict] : per_param) to_load.state.emplace_back(id, std::move(dict));
  if (auto s = ImportOptimizerState(optimizer, to_load); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(source, ": optimizer state: ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status LoadModel(const View& view, const std::string& source, const ShardedReader& read) {
  ShardRequests requests;
  for (const Entry& e : view.entries) {
    requests.emplace_back(e.fqn,
                          ShardRequest{e.global_shape(), e.tensor.scalar_type(), e.ranges()});
  }
  auto loaded = read(requests);
  if (!loaded.ok()) return loaded.status();
  std::vector<torch::Tensor> values;
  for (const Entry& e : view.entries) {
    auto local = Local(*loaded, e.fqn, e.ranges(), e.tensor.sizes(), e.tensor.scalar_type());
    if (!local.ok()) {
      return absl::Status(local.status().code(),
                          absl::StrCat(source, ": ", local.status().message()));
    }
    values.push_back(*local);
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i].numel() > 0) view.entries[i].tensor.detach().copy_(values[i]);
  }
  return absl::OkStatus();
}

// Status of every rank: the first failure (by rank) on all of them.
absl::Status AgreeOnStatus(const comm::ProcessGroup& group, const absl::Status& local,
                           const std::string& what) {
  torch::Tensor failed = torch::full({1}, local.ok() ? group.size() : group.rank(), torch::kInt64);
  comm::all_reduce(group, failed, comm::ReduceOp::kMin).wait();
  const int64_t first = failed.item<int64_t>();
  if (first == group.size()) return absl::OkStatus();
  if (!local.ok()) return local;
  return absl::FailedPreconditionError(absl::StrCat(what, " failed on rank ", first));
}

// AgreeOnStatus over every rank of the tree's mesh: the shard group, then
// (HSDP) the replicate group, so every rank learns of any rank's failure.
absl::Status AgreeEverywhere(const View& view, const absl::Status& local, const std::string& what) {
  absl::Status s = AgreeOnStatus(*view.group, local, what);
  if (!view.replicate) return s;
  return AgreeOnStatus(*view.replicate, s, what);
}

}  // namespace

absl::StatusOr<comm::ProcessGroup> FullyShardGroup(const torch::nn::Module& model) {
  auto view = Describe(model);
  if (!view.ok()) return view.status();
  return *view->group;
}

absl::StatusOr<FsdpModelStateDict> FullyShardModelStateDict(torch::nn::Module& model) {
  auto view = Describe(model);
  if (!view.ok()) return view.status();
  FsdpModelStateDict out = NewStateDict(*view);
  for (const Entry& e : view->entries) {
    out.sharded.insert(e.fqn, Pieces(e, e.tensor));
    if (!e.spec) out.replicated.push_back(e.fqn);
  }
  return out;
}

absl::StatusOr<FsdpModelStateDict> FullyShardOptimStateDict(
    torch::nn::Module& model, const torch::optim::Optimizer& optimizer) {
  auto view = Describe(model);
  if (!view.ok()) return view.status();
  auto ids = OptimParams(*view, optimizer);
  if (!ids.ok()) return ids.status();
  auto exported = ExportOptimizerState(optimizer);
  if (!exported.ok()) return exported.status();
  FsdpModelStateDict out = NewStateDict(*view);
  for (const auto& [key, entries] : exported->state) {
    const Entry& e = view->entries[(*ids)[static_cast<size_t>(std::get<int64_t>(key))]];
    for (const auto& entry : entries) {
      const std::string name = absl::StrCat(e.fqn, "/", entry.key());
      const torch::Tensor value = entry.value().detach();
      if (value.dim() == 0) {
        ShardedTensor st;
        st.dtype = value.scalar_type();
        st.pieces.push_back({{0, 1}, value.reshape({1})});
        out.sharded.insert(name, std::move(st));
        out.replicated.push_back(name);
        continue;
      }
      if (value.sizes() != e.tensor.sizes()) {
        return absl::InternalError(
            absl::StrCat("optimizer state '", name, "' has shape ", ShapeString(value.sizes()),
                         ": expected its parameter's shard shape ", ShapeString(e.tensor.sizes())));
      }
      out.sharded.insert(name, Pieces(e, value));
      if (!e.spec) out.replicated.push_back(name);
    }
  }
  return out;
}

absl::StatusOr<FsdpModelStateDict> FullyShardStateDict(torch::nn::Module& model,
                                                       const torch::optim::Optimizer* optimizer) {
  return ModelAndOptimizerState(*ShardedModelOf(model), optimizer);
}

absl::StatusOr<TensorDict> FullyShardFullStateDict(torch::nn::Module& model,
                                                   const torch::optim::Optimizer* optimizer,
                                                   bool rank0_only) {
  auto view = Describe(model);
  if (!view.ok()) return view.status();
  const comm::ProcessGroup* group = &*view->group;
  auto state = FullyShardStateDict(model, optimizer);
  if (auto s = AgreeEverywhere(*view, state.status(), "fully_shard state dict"); !s.ok()) {
    return s;
  }
  const std::set<std::string> replicated(state->replicated.begin(), state->replicated.end());
  const int world = group->size();
  // HSDP: each replica gathers over its own shard group.
  const bool keep = !rank0_only || view->rank == 0;
  TensorDict out;
  for (const auto& item : state->sharded) {
    const ShardedTensor& st = item.value();
    const std::vector<int64_t>& shape = st.global_shape;
    if (replicated.count(item.key()) > 0) {
      if (keep) out.insert(item.key(), st.pieces.at(0).data.reshape(shape).clone());
      continue;
    }
    const int64_t dim = ShardDimOf(*view, item.key(), st);
    const int64_t numel = st.global_numel();
    if (dim != 0) {
      auto whole = GatherOffDim0(item.key(), st, dim, *group);
      if (!whole.ok()) return whole.status();
      if (keep) out.insert(item.key(), std::move(*whole));
      continue;
    }
    // Dim-0 chunks as torch.chunk cuts them: rank r holds rows
    // [r * chunk, ...), so each rank pads its piece to `chunk` rows and one
    // all-gather lays them end to end.
    const int64_t rows = shape.empty() ? 1 : shape[0];
    const int64_t row = rows > 0 ? numel / rows : 0;
    const int64_t chunk = (rows + world - 1) / world;
    torch::Tensor local = torch::zeros({chunk * row}, torch::TensorOptions().dtype(st.dtype));
    if (!st.pieces.empty()) {
      const ShardPiece& piece = st.pieces[0];
      if (piece.range.offset != group->rank() * chunk * row) {
        return absl::InternalError(absl::StrCat(
            "fully_shard state dict: '", item.key(), "' piece at flat offset ", piece.range.offset,
            ": expected rank ", group->rank(), "'s chunk at ", group->rank() * chunk * row));
      }
      local.narrow(0, 0, piece.range.numel).copy_(piece.data);
    }
    torch::Tensor gathered =
        torch::empty({world * chunk * row}, torch::TensorOptions().dtype(st.dtype));
    try {
      comm::all_gather_into_tensor(*group, gathered, local).wait();
    } catch (const c10::Error& e) {
      return absl::UnavailableError(absl::StrCat("fully_shard state dict: gathering '", item.key(),
                                                 "': ", e.what_without_backtrace()));
    }
    if (keep) out.insert(item.key(), gathered.narrow(0, 0, numel).reshape(shape));
  }
  return out;
}

absl::StatusOr<std::vector<OptimParamGroup>> FullyShardParamGroups(
    const torch::nn::Module& model, const torch::optim::Optimizer& optimizer) {
  auto view = Describe(model);
  if (!view.ok()) return view.status();
  auto ids = OptimParams(*view, optimizer);
  if (!ids.ok()) return ids.status();
  auto exported = ExportOptimizerState(optimizer);
  if (!exported.ok()) return exported.status();
  std::vector<OptimParamGroup> groups = exported->param_groups;
  for (OptimParamGroup& g : groups) {
    for (ParamKey& key : g.params) {
      key = view->entries[(*ids)[static_cast<size_t>(std::get<int64_t>(key))]].fqn;
    }
  }
  return groups;
}

namespace {

// A shard still on the meta device would take the load's data and drop it.
absl::Status RefuseMetaShards(const torch::nn::Module& model, const std::string& source) {
  for (const auto& p : model.named_parameters()) {
    if (p.value().defined() && p.value().is_meta()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "loading ", source, " into a fully_shard model: parameter '", p.key(),
          "' is on the meta device: call fsdp::to_empty(model, device) first to allocate the "
          "shards"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LoadFullyShardFrom(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                                const std::string& source,
                                const std::vector<ShardedEntryInfo>& optim_entries,
                                const ShardedReader& read) {
  return LoadShardedModelFrom(*ShardedModelOf(model), optimizer, source, optim_entries, read);
}

absl::Status LoadFullyShardStateDict(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                                     const ShardedStateDict& state) {
  if (auto s = RefuseMetaShards(model, "a SHARDED state dict"); !s.ok()) return s;
  auto view = Describe(model);
  if (!view.ok()) return view.status();
  std::vector<ShardedEntryInfo> optim_entries;
  for (const auto& item : state) {
    std::string fqn, entry;
    if (SplitEntryName(item.key(), '/', &fqn, &entry)) {
      if (optimizer != nullptr) {
        optim_entries.push_back({item.key(), item.value().global_shape, item.value().dtype});
      }
      continue;
    }
    if (view->index.count(item.key()) == 0) {
      const bool flat = item.key() == "flat_param" ||
                        item.key().find("flat_param") != std::string::npos ||
                        item.key().find("_fsdp_wrapped_module") != std::string::npos;
      return absl::InvalidArgumentError(absl::StrCat(
          "fully_shard state dict: unexpected key '", item.key(), "' (global shape ",
          ShapeString(item.value().global_shape), ")",
          flat ? ", a FullyShardedDataParallel flat parameter (a LOCAL state dict?)" : "",
          ": expected the module's parameter and buffer FQNs (e.g. '", view->entries[0].fqn,
          "') and '<fqn>/<entry>' optimizer entries, as a SHARDED or FULL state dict names "
          "them"));
    }
  }
  return LoadFullyShardFrom(model, optimizer, "fully_shard state dict", optim_entries,
                            DictReader(state));
}

absl::Status SaveFullyShardCheckpoint(const std::string& root, int64_t step,
                                      torch::nn::Module& model,
                                      const torch::optim::Optimizer* optimizer,
                                      FullyShardCheckpointKind kind) {
  auto view = Describe(model);
  if (!view.ok()) return view.status();
  auto state = FullyShardStateDict(model, optimizer);
  // Every rank took its state (or failed) before any writes.
  if (auto s = AgreeEverywhere(*view, state.status(), "fully_shard state dict"); !s.ok()) {
    return s;
  }
  if (kind == FullyShardCheckpointKind::kFull) {
    absl::Status saved = absl::OkStatus();
    if (!view->is_replica()) {
      // Replica 0's shard group alone gathers and writes (HSDP: the other
      // replicas hold the same shards).
      ShardedStateDict renamed;
      for (const auto& item : state->sharded) {
        ShardedTensor st = item.value();
        if (const int64_t dim = ShardDimOf(*view, item.key(), st); dim != 0) {
          // SaveFsdpFullCheckpoint takes one contiguous piece per rank: a
          // Shard(d) entry is gathered whole here (so each is held whole
          // on every rank of the group until the file is written) and
          // handed over as group rank 0's single piece.
          auto whole = GatherOffDim0(item.key(), st, dim, *view->group);
          if (!whole.ok()) {
            saved = whole.status();
            break;
          }
          st.pieces.clear();
          if (view->group->rank() == 0) {
            st.pieces.push_back({FlatRange{0, whole->numel()}, whole->reshape({-1})});
          }
        }
        renamed.insert(FullCheckpointKey(item.key()), std::move(st));
      }
      state->sharded = std::move(renamed);
      for (std::string& name : state->replicated) name = FullCheckpointKey(name);
      state->world_size = view->group->size();
      state->rank = view->group->rank();
      if (saved.ok()) saved = SaveFsdpFullCheckpoint(root, step, *state, *view->group);
    }
    return AgreeEverywhere(*view, saved, "SaveFsdpFullCheckpoint");
  }
  absl::Status saved = SaveModelCheckpoint(root, step, *state);
  if (auto s = AgreeEverywhere(*view, saved, "SaveShard"); !s.ok()) return s;
  absl::Status committed = absl::OkStatus();
  if (view->rank == 0) committed = CommitShardedCheckpoint(root, step, view->world_size);
  return AgreeEverywhere(*view, committed, "CommitShardedCheckpoint");
}

absl::Status LoadFullyShardCheckpoint(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                                      const std::string& step_dir) {
  return LoadShardedModelCheckpoint(*ShardedModelOf(model), optimizer, step_dir);
}

namespace {

class FullyShardShardedModel final : public ShardedModel {
 public:
  explicit FullyShardShardedModel(torch::nn::Module& model) : model_(model) {}

  absl::StatusOr<FsdpModelStateDict> ModelState() override {
    return FullyShardModelStateDict(model_);
  }
  absl::StatusOr<FsdpModelStateDict> OptimizerState(
      const torch::optim::Optimizer& optimizer) override {
    return FullyShardOptimStateDict(model_, optimizer);
  }
  absl::StatusOr<std::vector<OptimParamGroup>> ParamGroups(
      const torch::optim::Optimizer& optimizer) override {
    return FullyShardParamGroups(model_, optimizer);
  }
  absl::Status LoadModel(const std::string& source, const ShardedReader& read) override {
    if (auto s = RefuseMetaShards(model_, source); !s.ok()) return s;
    auto view = Describe(model_);
    if (!view.ok()) return view.status();
    return state_dict::LoadModel(*view, source, read);
  }
  absl::Status LoadOptimizer(torch::optim::Optimizer& optimizer, const std::string& source,
                             const std::vector<ShardedEntryInfo>& entries,
                             const ShardedReader& read) override {
    if (auto s = RefuseMetaShards(model_, source); !s.ok()) return s;
    auto view = Describe(model_);
    if (!view.ok()) return view.status();
    return LoadOptim(*view, optimizer, source, entries, read);
  }

 private:
  torch::nn::Module& model_;
};

}  // namespace

std::unique_ptr<ShardedModel> ShardedModelOf(torch::nn::Module& model) {
  return std::make_unique<FullyShardShardedModel>(model);
}

}  // namespace state_dict
