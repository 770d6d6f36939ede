#include "state_dict/fsdp/sharded_model.h"

#include <set>
#include <utility>

#include <c10/util/Exception.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "absl/strings/str_cat.h"
#include "state_dict/checkpoint.h"
#include "state_dict/fsdp/checkpoint_keys.h"
#include "state_dict/fsdp/internal/fsdp_view.h"
#include "state_dict/manifest.h"

namespace state_dict {
namespace {

class FsdpShardedModel final : public ShardedModel {
 public:
  explicit FsdpShardedModel(fsdp::FullyShardedDataParallel& model) : model_(model) {}

  absl::StatusOr<FsdpModelStateDict> ModelState() override {
    return GetModelStateDict(model_, StateDictType::kSharded);
  }
  absl::StatusOr<FsdpModelStateDict> OptimizerState(
      const torch::optim::Optimizer& optimizer) override {
    return ShardedOptimStateDict(model_, optimizer);
  }
  absl::StatusOr<std::vector<OptimParamGroup>> ParamGroups(
      const torch::optim::Optimizer& optimizer) override {
    return NamedParamGroups(model_, optimizer);
  }
  absl::Status LoadModel(const std::string& /*source*/, const ShardedReader& read) override {
    // The readers' errors name their source (a directory, a file).
    return LoadModelShardedFrom(model_, read);
  }
  absl::Status LoadOptimizer(torch::optim::Optimizer& optimizer, const std::string& source,
                             const std::vector<ShardedEntryInfo>& entries,
                             const ShardedReader& read) override {
    return LoadShardedOptimFrom(model_, optimizer, source, entries, read);
  }

 private:
  fsdp::FullyShardedDataParallel& model_;
};

// A step directory's entries by our names ("<fqn>", "<fqn>/<entry>"): a
// FULL checkpoint of the trainer's layout keys them "model.<fqn>" /
// "optim.<fqn>.<entry>" (checkpoint_keys.h), found by that name when the
// plain one is absent; a FULL file is read whole and cut per request.
ShardedReader CheckpointReader(const std::string& step_dir, const std::set<std::string>& names,
                               bool full) {
  auto rename = [names](const ShardRequests& requests) {
    ShardRequests renamed;
    for (const auto& [name, request] : requests) {
      const std::string key = FullCheckpointKey(name);
      renamed.emplace_back(names.count(name) == 0 && names.count(key) > 0 ? key : name, request);
    }
    return renamed;
  };
  return
      [step_dir, rename, full](const ShardRequests& requests) -> absl::StatusOr<ShardedStateDict> {
        const ShardRequests renamed = rename(requests);
        absl::StatusOr<ShardedStateDict> loaded;
        if (full) {
          auto file = LoadFullStateDict(step_dir);
          if (!file.ok()) return file.status();
          ShardedStateDict whole;
          for (const auto& [name, request] : renamed) {
            const torch::Tensor* t = file->find(name);
            if (t == nullptr) continue;  // DictReader names it
            ShardedTensor st;
            st.global_shape = t->sizes().vec();
            st.dtype = t->scalar_type();
            st.pieces.push_back({FlatRange{0, t->numel()}, t->reshape({-1})});
            whole.insert(name, std::move(st));
          }
          loaded = DictReader(whole)(renamed);
          if (!loaded.ok()) {
            return absl::Status(loaded.status().code(),
                                absl::StrCat(step_dir, ": ", loaded.status().message()));
          }
        } else {
          loaded = LoadResharded(step_dir, renamed);
        }
        if (!loaded.ok()) return loaded.status();
        ShardedStateDict out;
        for (size_t i = 0; i < requests.size(); ++i) {
          const ShardedTensor* st = loaded->find(renamed[i].first);
          out.insert(requests[i].first, st != nullptr ? *st : ShardedTensor{});
        }
        return out;
      };
}

}  // namespace

std::unique_ptr<ShardedModel> ShardedModelOf(fsdp::FullyShardedDataParallel& model) {
  return std::make_unique<FsdpShardedModel>(model);
}

absl::StatusOr<FsdpModelStateDict> ModelAndOptimizerState(
    ShardedModel& model, const torch::optim::Optimizer* optimizer) {
  auto state = model.ModelState();
  if (!state.ok() || optimizer == nullptr) return state;
  auto optim = model.OptimizerState(*optimizer);
  if (!optim.ok()) return optim.status();
  return MergeShardedStateDicts(std::move(*state), *optim);
}

absl::Status LoadShardedModelFrom(ShardedModel& model, torch::optim::Optimizer* optimizer,
                                  const std::string& source,
                                  const std::vector<ShardedEntryInfo>& optim_entries,
                                  const ShardedReader& read) {
  if (optimizer != nullptr) {
    if (auto s = model.LoadOptimizer(*optimizer, source, optim_entries, read); !s.ok()) return s;
  }
  return model.LoadModel(source, read);
}

absl::Status FillModelShards(ShardedModel& model, const std::string& source,
                             const ShardedReader& check, const ShardFiller& fill) {
  auto state = model.ModelState();
  if (!state.ok()) return state.status();
  ShardRequests requests;
  for (const auto& item : state->sharded) {
    for (const ShardPiece& piece : item.value().pieces) {
      if (piece.data.is_meta()) {
        return absl::FailedPreconditionError(
            absl::StrCat("loading ", source, ": '", item.key(),
                         "' is on the meta device: allocate the shards first (fsdp::to_empty for "
                         "fully_shard, Options::param_init_fn for FullyShardedDataParallel)"));
      }
    }
    requests.emplace_back(item.key(),
                          ShardRequest{item.value().global_shape, item.value().dtype, {}});
  }
  if (auto checked = check(requests); !checked.ok()) return checked.status();
  torch::NoGradGuard no_grad;
  size_t i = 0;
  for (const auto& item : state->sharded) {
    const ShardRequest& entry = requests[i++].second;
    for (const ShardPiece& piece : item.value().pieces) {
      if (auto s = fill(item.key(), entry, piece.range, piece.data); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

absl::Status LoadModelTensorByTensor(ShardedModel& model, const std::string& source,
                                     const ShardedReader& read) {
  return FillModelShards(
      model, source, read,
      [&](const std::string& name, const ShardRequest& entry, FlatRange range,
          const torch::Tensor& destination) -> absl::Status {
        auto loaded = read({{name, ShardRequest{entry.global_shape, entry.dtype, {range}}}});
        if (!loaded.ok()) return loaded.status();
        const ShardedTensor* got = loaded->find(name);
        if (got == nullptr || got->pieces.size() != 1 || !(got->pieces[0].range == range) ||
            got->pieces[0].data.numel() != range.numel ||
            got->pieces[0].data.scalar_type() != entry.dtype) {
          return absl::InternalError(absl::StrCat(
              source, ": the reader did not return '", name, "' as requested (elements [",
              range.offset, ", ", range.end(), ") of global shape ",
              internal::ShapeString(entry.global_shape), ", ", c10::toString(entry.dtype), ")"));
        }
        destination.copy_(got->pieces[0].data.reshape({-1}));
        return absl::OkStatus();
      });
}

absl::Status LoadShardedModelCheckpoint(ShardedModel& model, torch::optim::Optimizer* optimizer,
                                        const std::string& step_dir) {
  auto manifest = ReadManifest(step_dir);
  if (!manifest.ok()) return manifest.status();
  std::set<std::string> names;
  std::vector<ShardedEntryInfo> optim_entries;
  std::set<std::string> seen;
  for (const ManifestFile& file : manifest->files) {
    for (const ManifestTensor& t : file.tensors) {
      names.insert(t.name);
      if (!seen.insert(t.name).second) continue;
      auto parts = ParseFullCheckpointKey(t.name);
      if (parts.ok() && parts->kind == FullCheckpointKeyParts::Kind::kOptim) {
        optim_entries.push_back(
            {absl::StrCat(parts->fqn, "/", parts->entry), t.global_shape, t.dtype});
        continue;
      }
      std::string fqn, entry;
      if (SplitEntryName(t.name, '/', &fqn, &entry)) {
        optim_entries.push_back({t.name, t.global_shape, t.dtype});
      }
    }
  }
  return LoadShardedModelFrom(
      model, optimizer, absl::StrCat("checkpoint ", step_dir), optim_entries,
      CheckpointReader(step_dir, names, manifest->kind == CheckpointKind::kFull));
}

ShardedReader DictReader(const ShardedStateDict& state) {
  return [&state](const ShardRequests& requests) -> absl::StatusOr<ShardedStateDict> {
    ShardedStateDict out;
    for (const auto& [name, request] : requests) {
      const ShardedTensor* st = state.find(name);
      if (st == nullptr) {
        return absl::NotFoundError(absl::StrCat("state dict has no entry '", name,
                                                "': expected one of global shape ",
                                                internal::ShapeString(request.global_shape)));
      }
      if (c10::IntArrayRef(st->global_shape) != c10::IntArrayRef(request.global_shape) ||
          st->dtype != request.dtype) {
        return absl::InvalidArgumentError(absl::StrCat(
            "state dict entry '", name, "' has global shape ",
            internal::ShapeString(st->global_shape), " ", c10::toString(st->dtype), ": expected ",
            internal::ShapeString(request.global_shape), " ", c10::toString(request.dtype)));
      }
      if (auto s = ValidateShardedTensor(name, *st); !s.ok()) return s;
      auto resharded = Reshard(name, {*st}, request.ranges);
      if (!resharded.ok()) return resharded.status();
      out.insert(name, std::move(*resharded));
    }
    return out;
  };
}

}  // namespace state_dict
