#include "state_dict/fully_shard/fully_shard_dcp.h"

#include <variant>
#include <vector>

#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "absl/strings/str_cat.h"
#include "state_dict/dcp.h"
#include "state_dict/fsdp/checkpoint_keys.h"
#include "state_dict/fully_shard/fully_shard_state_dict.h"
#include "state_dict/optim_state.h"

namespace state_dict {
namespace {

// The options Python's optimizer of this kind has that LibTorch's lacks, at
// the values LibTorch's behaviour matches (as fsdp_dcp.cc adds them):
// Python's load_state_dict and dcp.load need them all.
void AddPythonOnlyOptions(const torch::optim::Optimizer& optimizer, OptimParamGroup& group) {
  auto add = [&](const char* key, c10::IValue value) {
    if (!group.options.contains(key)) group.options.insert(key, std::move(value));
  };
  add("foreach", c10::IValue());
  add("differentiable", false);
  add("fused", c10::IValue());
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer) == nullptr) {
    add("capturable", false);
    add("decoupled_weight_decay", dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr);
  }
}

}  // namespace

absl::Status SaveFullyShardDcpShard(const std::string& dir, torch::nn::Module& model,
                                    const torch::optim::Optimizer* optimizer,
                                    const std::vector<DcpShard::Object>& extra_objects) {
  for (const DcpShard::Object& o : extra_objects) {
    const std::string* first = o.path.empty() ? nullptr : std::get_if<std::string>(&o.path[0]);
    if (o.path.empty() || (first != nullptr && (*first == kModelKey || *first == kOptimKey))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SaveFullyShardDcpShard: extra object '", FlatKey(o.path),
          "': expected a non-empty key path outside 'model' and 'optim' (the model's and the "
          "optimizer's state)"));
    }
  }
  auto state = FullyShardModelStateDict(model);
  if (!state.ok()) return state.status();
  DcpShard shard;
  for (const auto& item : ShardToSave(*state)) {
    shard.tensors.push_back(DcpShard::Tensor{{kModelKey, item.key()}, item.value()});
  }
  if (optimizer != nullptr) {
    auto optim = FullyShardOptimStateDict(model, *optimizer);
    if (!optim.ok()) return optim.status();
    for (const auto& item : ShardToSave(*optim)) {
      std::string fqn, entry;
      if (!SplitEntryName(item.key(), '/', &fqn, &entry)) {
        return absl::InternalError(
            absl::StrCat("optimizer entry '", item.key(), "' is not '<parameter>/<entry>'"));
      }
      shard.tensors.push_back(
          DcpShard::Tensor{{kOptimKey, kOptimStateKey, fqn, entry}, item.value()});
    }
    if (state->rank == 0) {
      auto groups = FullyShardParamGroups(model, *optimizer);
      if (!groups.ok()) return groups.status();
      for (size_t i = 0; i < groups->size(); ++i) {
        OptimParamGroup& group = (*groups)[i];
        AddPythonOnlyOptions(*optimizer, group);
        const int64_t index = static_cast<int64_t>(i);
        for (const auto& option : group.options) {
          shard.objects.push_back(DcpShard::Object{
              {kOptimKey, kOptimParamGroupsKey, index, option.key()}, option.value()});
        }
        c10::impl::GenericList params(c10::StringType::get());
        for (const ParamKey& key : group.params) params.push_back(std::get<std::string>(key));
        shard.objects.push_back(DcpShard::Object{{kOptimKey, kOptimParamGroupsKey, index, "params"},
                                                 c10::IValue(params)});
      }
    }
  }
  if (state->rank == 0) {
    shard.objects.insert(shard.objects.end(), extra_objects.begin(), extra_objects.end());
  }
  return SaveDcpShard(dir, state->rank, shard);
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
