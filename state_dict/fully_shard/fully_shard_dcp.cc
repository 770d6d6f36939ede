#include "state_dict/fully_shard/fully_shard_dcp.h"

#include <optional>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "state_dict/dcp.h"
#include "state_dict/fsdp/checkpoint_keys.h"
#include "state_dict/fsdp/fsdp_dcp.h"
#include "state_dict/fully_shard/fully_shard_state_dict.h"
#include "state_dict/optim_state.h"

namespace state_dict {
absl::Status SaveFullyShardDcpShard(const std::string& dir, torch::nn::Module& model,
                                    const torch::optim::Optimizer* optimizer,
                                    const std::vector<DcpShard::Object>& extra_objects) {
  auto state = FullyShardModelStateDict(model);
  if (!state.ok()) return state.status();
  std::optional<FsdpModelStateDict> optim;
  if (optimizer != nullptr) {
    auto got = FullyShardOptimStateDict(model, *optimizer);
    if (!got.ok()) return got.status();
    optim = std::move(*got);
  }
  return SaveShardedStateAsDcp(
      dir, "SaveFullyShardDcpShard", *state, optimizer, optim ? &*optim : nullptr,
      [&] { return FullyShardParamGroups(model, *optimizer); }, extra_objects);
}

absl::Status LoadFullyShardDcp(const std::string& dir, torch::nn::Module& model,
                               torch::optim::Optimizer* optimizer) {
  auto ckpt = DcpCheckpoint::Open(dir);
  if (!ckpt.ok()) return ckpt.status();
  return LoadFullyShardDcp(*ckpt, model, optimizer);
}

absl::Status LoadFullyShardDcp(const DcpCheckpoint& ckpt, torch::nn::Module& model,
                               torch::optim::Optimizer* optimizer) {
  // Our names ("<fqn>", "<fqn>/<entry>") -> DCP's.
  auto read = [&](const ShardRequests& requests) -> absl::StatusOr<ShardedStateDict> {
    ShardRequests renamed;
    for (const auto& [name, request] : requests) {
      std::string fqn, entry;
      const std::string key = SplitEntryName(name, '/', &fqn, &entry) ? DcpOptimStateKey(fqn, entry)
                                                                      : ModelStateKey(name);
      renamed.emplace_back(key, request);
    }
    auto loaded = ckpt.LoadResharded(renamed);
    if (!loaded.ok()) return loaded.status();
    ShardedStateDict out;
    for (size_t i = 0; i < requests.size(); ++i) {
      const ShardedTensor* st = loaded->find(renamed[i].first);
      out.insert(requests[i].first, st != nullptr ? *st : ShardedTensor{});
    }
    return out;
  };
  std::vector<ShardedEntryInfo> entries;
  if (optimizer != nullptr) {
    for (const auto& t : ckpt.tensors()) {
      std::string fqn, entry;
      if (!ParseDcpOptimStateKey(t.key, &fqn, &entry)) continue;
      entries.push_back(ShardedEntryInfo{absl::StrCat(fqn, "/", entry), t.shape, t.dtype});
    }
  }
  return LoadFullyShardFrom(model, optimizer, absl::StrCat("DCP checkpoint ", ckpt.dir()), entries,
                            read);
}

}  // namespace state_dict
