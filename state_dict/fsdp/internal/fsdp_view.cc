#include "state_dict/fsdp/internal/fsdp_view.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/collectives.h"
#include "comm/device_mesh.h"
#include "fsdp/sharding_strategy.h"

namespace state_dict::internal {
namespace {

// The groups FSDP resolved from the options (the same rules as its
// constructor, which already rejected inconsistent combinations).
absl::Status ResolveGroups(const fsdp::FullyShardedDataParallel::Options& options,
                           ModelView& view) {
  view.hybrid = fsdp::is_hybrid(options.sharding_strategy);
  if (view.hybrid) {
    if (options.hybrid_groups.has_value()) {
      view.shard_group = options.hybrid_groups->shard;
      view.replicate_group = options.hybrid_groups->replicate;
      return absl::OkStatus();
    }
    if (!options.device_mesh.has_value()) {
      return absl::InvalidArgumentError(
          "FSDP state dicts: a hybrid-sharded model without hybrid_groups or device_mesh");
    }
    auto groups = comm::hybrid_shard_groups(*options.device_mesh);
    if (!groups.ok()) return groups.status();
    view.shard_group = groups->shard;
    view.replicate_group = groups->replicate;
    return absl::OkStatus();
  }
  if (options.device_mesh.has_value()) {
    auto group = options.device_mesh->get_group(0);
    if (!group.ok()) return group.status();
    view.shard_group = *group;
    return absl::OkStatus();
  }
  if (!options.process_group.has_value()) {
    return absl::InvalidArgumentError("FSDP state dicts: the model has no process group");
  }
  view.shard_group = *options.process_group;
  return absl::OkStatus();
}

}  // namespace

std::string JoinFqn(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : absl::StrCat(prefix, ".", name);
}

std::string ShapeString(c10::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<ModelView> Describe(const fsdp::FullyShardedDataParallel& model) {
  ModelView view;
  const auto& options = model.options();
  if (absl::Status s = ResolveGroups(options, view); !s.ok()) return s;
  const int shard_size = view.shard_group.size();
  const int shard_rank = view.shard_group.rank();
  const int replicas = view.hybrid ? view.replicate_group.size() : 1;
  const int replica = view.hybrid ? view.replicate_group.rank() : 0;
  view.world_size = replicas * shard_size;
  view.rank = replica * shard_size + shard_rank;
  view.replicated_shards = options.sharding_strategy == fsdp::ShardingStrategy::kNoShard;
  view.shard_is_replica = replica > 0;

  const std::vector<std::string> units = model.fsdp_unit_names();
  const std::vector<const fsdp::FlatParamHandle*> handles = model.handles();
  std::set<std::string> managed_names;
  for (size_t u = 0; u < handles.size(); ++u) {
    const fsdp::FlatParamHandle* h = handles[u];
    if (h == nullptr) continue;
    view.flats.push_back({JoinFqn(units[u], "flat_param"), h});
    for (const fsdp::FlatParamInfo& info : h->param_infos()) {
      view.managed.push_back({JoinFqn(units[u], info.fqn), h, &info});
      managed_names.insert(JoinFqn(units[u], info.fqn));
      for (const std::string& alias : info.alias_fqns) {
        managed_names.insert(JoinFqn(units[u], alias));
      }
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

FsdpModelStateDict NewStateDict(const ModelView& view, StateDictType type) {
  FsdpModelStateDict out;
  out.type = type;
  out.world_size = view.world_size;
  out.rank = view.rank;
  out.shard_is_replica = type == StateDictType::kSharded && view.shard_is_replica;
  return out;
}

void BroadcastFromRankZero(const ModelView& view, const torch::Tensor& tensor) {
  if (view.hybrid && view.shard_group.rank() == 0) {
    comm::broadcast(view.replicate_group, tensor, 0).wait();
  }
  comm::broadcast(view.shard_group, tensor, 0).wait();
}

FlatRange ShardRange(const fsdp::FlatParamHandle& handle) {
  return {handle.shard_rank() * handle.shard_numel(), handle.shard_numel()};
}

ShardedTensor FullPiece(const torch::Tensor& t) {
  ShardedTensor st;
  st.global_shape = t.sizes().vec();
  st.dtype = t.scalar_type();
  if (t.numel() > 0) {
    st.pieces.push_back({{0, t.numel()}, t.detach().reshape({-1})});
  }
  return st;
}

}  // namespace state_dict::internal
