#include "state_dict/fsdp/fsdp_dcp.h"

#include <functional>
#include <optional>

#include <variant>
#include <vector>

#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "absl/strings/str_cat.h"
#include "state_dict/dcp.h"
#include "state_dict/fsdp/checkpoint_keys.h"
#include "state_dict/fsdp/fsdp_optim_state_dict.h"
#include "state_dict/fsdp/fsdp_state_dict.h"
#include "state_dict/optim_state.h"

namespace state_dict {
namespace {

// The options Python's optimizer of this kind has that LibTorch's lacks, at
// the values LibTorch's behaviour matches: Python's load_state_dict and
// dcp.load (strict about missing keys) need them all.
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

absl::Status SaveShardedStateAsDcp(
    const std::string& dir, const char* caller, const FsdpModelStateDict& state,
    const torch::optim::Optimizer* optimizer, const FsdpModelStateDict* optim_state,
    const std::function<absl::StatusOr<std::vector<OptimParamGroup>>()>& param_groups,
    const std::vector<DcpShard::Object>& extra_objects) {
  for (const DcpShard::Object& o : extra_objects) {
    const std::string* first = o.path.empty() ? nullptr : std::get_if<std::string>(&o.path[0]);
    if (o.path.empty() || (first != nullptr && (*first == kModelKey || *first == kOptimKey))) {
      return absl::InvalidArgumentError(absl::StrCat(
          caller, ": extra object '", FlatKey(o.path),
          "': expected a non-empty key path outside 'model' and 'optim' (the model's and the "
          "optimizer's state)"));
    }
  }
  DcpShard shard;
  for (const auto& item : ShardToSave(state)) {
    shard.tensors.push_back(DcpShard::Tensor{{kModelKey, item.key()}, item.value()});
  }
  if (optimizer != nullptr) {
    if (optim_state == nullptr) {
      return absl::InternalError(absl::StrCat(caller, ": an optimizer without its state"));
    }
    for (const auto& item : ShardToSave(*optim_state)) {
      std::string fqn, entry;
      if (!SplitEntryName(item.key(), '/', &fqn, &entry)) {
        return absl::InternalError(
            absl::StrCat("optimizer entry '", item.key(), "' is not '<parameter>/<entry>'"));
      }
      shard.tensors.push_back(
          DcpShard::Tensor{{kOptimKey, kOptimStateKey, fqn, entry}, item.value()});
    }
    if (state.rank == 0) {
      auto groups = param_groups();
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
  if (state.rank == 0) {
    shard.objects.insert(shard.objects.end(), extra_objects.begin(), extra_objects.end());
  }
  return SaveDcpShard(dir, state.rank, shard);
}

}  // namespace

absl::Status SaveShardedModelDcp(const std::string& dir, ShardedModel& model,
                                 const torch::optim::Optimizer* optimizer,
                                 const std::vector<DcpShard::Object>& extra_objects) {
  auto state = model.ModelState();
  if (!state.ok()) return state.status();
  std::optional<FsdpModelStateDict> optim;
  if (optimizer != nullptr) {
    auto got = model.OptimizerState(*optimizer);
    if (!got.ok()) return got.status();
    optim = std::move(*got);
  }
  return SaveShardedStateAsDcp(
      dir, "SaveShardedModelDcp", *state, optimizer, optim ? &*optim : nullptr,
      [&] { return model.ParamGroups(*optimizer); }, extra_objects);
}

absl::Status LoadShardedModelDcp(const DcpCheckpoint& ckpt, ShardedModel& model,
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
  return LoadShardedModelFrom(model, optimizer, absl::StrCat("DCP checkpoint ", ckpt.dir()),
                              entries, read);
}

absl::Status SaveFsdpDcpShard(const std::string& dir, fsdp::FullyShardedDataParallel& model,
                              const torch::optim::Optimizer* optimizer,
                              const std::vector<DcpShard::Object>& extra_objects) {
  return SaveShardedModelDcp(dir, *ShardedModelOf(model), optimizer, extra_objects);
}

absl::Status LoadFsdpDcp(const std::string& dir, fsdp::FullyShardedDataParallel& model,
                         torch::optim::Optimizer* optimizer) {
  auto ckpt = DcpCheckpoint::Open(dir);
  if (!ckpt.ok()) return ckpt.status();
  return LoadFsdpDcp(*ckpt, model, optimizer);
}

absl::Status LoadFsdpDcp(const DcpCheckpoint& ckpt, fsdp::FullyShardedDataParallel& model,
                         torch::optim::Optimizer* optimizer) {
  return LoadShardedModelDcp(ckpt, *ShardedModelOf(model), optimizer);
}

}  // namespace state_dict
