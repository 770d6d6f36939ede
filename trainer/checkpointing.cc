#include "trainer/checkpointing.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <utility>

#include <torch/types.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/collectives.h"
#include "state_dict/checkpoint.h"
#include "state_dict/fsdp/fsdp_optim_state_dict.h"
#include "state_dict/fsdp/fsdp_state_dict.h"
#include "state_dict/optim_state.h"

namespace trainer {
namespace {

constexpr char kModelPrefix[] = "model.";
constexpr char kOptimPrefix[] = "optim.";
constexpr char kStepKey[] = "trainer.step";
constexpr char kSeedKey[] = "trainer.seed";

// The trainer's own entries of a checkpoint: one int64 each.
state_dict::ShardedTensor Scalar(int64_t value) {
  state_dict::ShardedTensor st;
  st.global_shape = {1};
  st.dtype = torch::kInt64;
  st.pieces.push_back({{0, 1}, torch::tensor({value}, torch::kInt64)});
  return st;
}

// SHARDED: every rank writes its pieces of the model and the optimizer
// state (no gathering), the trainer's step and seed go with rank 0's.
absl::Status SaveShardedTrainerState(const Options& o, fsdp::FullyShardedDataParallel& model,
                                     const torch::optim::Optimizer& optimizer, int64_t step,
                                     state_dict::AsyncCheckpointer* async) {
  auto state = state_dict::GetModelStateDict(model, state_dict::StateDictType::kSharded);
  if (!state.ok()) return state.status();
  auto optim = state_dict::ShardedOptimStateDict(model, optimizer);
  if (!optim.ok()) return optim.status();
  auto both = state_dict::MergeShardedStateDicts(std::move(*state), *optim);
  if (!both.ok()) return both.status();
  both->sharded.insert(kStepKey, Scalar(step));
  both->sharded.insert(kSeedKey, Scalar(o.seed));
  both->replicated.push_back(kStepKey);
  both->replicated.push_back(kSeedKey);
  if (async != nullptr) {  // --async-checkpoint: written from the live state meanwhile
    return async->SaveShardInPlace(o.checkpoint_dir, step, both->rank, both->world_size,
                                   state_dict::ShardToSave(*both));
  }
  return state_dict::SaveModelCheckpoint(o.checkpoint_dir, step, *both);
}

// FULL: the model's and the optimizer's FULL state dicts gathered onto
// rank 0 (collective), which writes one model.pt: "model.<fqn>",
// "optim.<fqn>.<entry>" (e.g. "optim.blocks.0.fc1.weight.exp_avg"),
// "trainer.step", "trainer.seed".
absl::Status SaveFullTrainerState(const Options& o, fsdp::FullyShardedDataParallel& model,
                                  const torch::optim::Optimizer& optimizer, int64_t step,
                                  bool is_main, state_dict::AsyncCheckpointer* async) {
  state_dict::StateDictConfig rank0_only;
  rank0_only.rank0_only = true;
  auto state = state_dict::GetModelStateDict(model, state_dict::StateDictType::kFull, rank0_only);
  if (!state.ok()) return state.status();
  auto optim = state_dict::FullOptimStateDict(model, optimizer, /*rank0_only=*/true);
  if (!optim.ok()) return optim.status();
  if (!is_main) return absl::OkStatus();
  state_dict::TensorDict out;
  for (const auto& item : state->full) out.insert(kModelPrefix + item.key(), item.value());
  for (const auto& [key, entries] : optim->state) {
    for (const auto& entry : entries) {
      out.insert(absl::StrCat(kOptimPrefix, std::get<std::string>(key), ".", entry.key()),
                 entry.value());
    }
  }
  out.insert(kStepKey, torch::tensor({step}, torch::kInt64));
  out.insert(kSeedKey, torch::tensor({o.seed}, torch::kInt64));
  if (async != nullptr) return async->SaveFullInPlace(o.checkpoint_dir, step, out);
  return state_dict::SaveFullCheckpoint(o.checkpoint_dir, step, out);
}

// Every rank learns whether `local` failed anywhere: a rank that failed
// returns its own error, the others an Aborted naming the lowest failed
// rank. So all ranks stop with a message instead of dying in the next
// collective.
absl::Status AgreeOnStatus(const comm::ProcessGroup& group, absl::Status local,
                           const std::string& what) {
  torch::Tensor first_failed =
      torch::tensor({local.ok() ? int64_t{group.size()} : int64_t{group.rank()}});
  comm::all_reduce(group, first_failed, comm::ReduceOp::kMin).wait();
  if (!local.ok()) return local;
  const int64_t failed = first_failed.item<int64_t>();
  if (failed < group.size()) {
    return absl::AbortedError(absl::StrCat(what, " failed on rank ", failed, " (see its message)"));
  }
  return absl::OkStatus();
}

std::string CheckpointContext(const Options& o, int64_t step) {
  return absl::StrCat("--checkpoint-dir='", o.checkpoint_dir, "' step ", step);
}

absl::Status InContext(const std::string& what, absl::Status s) {
  return s.ok() ? s : absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

// Once every rank's files of `step` are durable: rank 0 commits a sharded
// checkpoint (makes it visible) and applies --keep-last.
absl::Status CommitCheckpoint(const Options& o, const comm::ProcessGroup& group, int64_t step) {
  const bool is_main = group.rank() == 0;
  const bool sharded = o.checkpoint_format == CheckpointFormat::kSharded;
  if (!sharded && o.keep_last == 0) return absl::OkStatus();
  absl::Status committed = absl::OkStatus();
  if (is_main && sharded) {
    committed = state_dict::CommitShardedCheckpoint(o.checkpoint_dir, step, group.size());
  }
  // --keep-last: only once this step is committed, so the newest complete
  // checkpoint is always the one just written.
  if (is_main && committed.ok() && o.keep_last > 0) {
    committed = state_dict::PruneCheckpoints(
                    o.checkpoint_dir, static_cast<int>(std::min<int64_t>(o.keep_last, 1 << 30)))
                    .status();
  }
  const std::string what = CheckpointContext(o, step);
  return AgreeOnStatus(group, InContext(what, committed), what);
}

absl::Status CheckSeed(const Options& o, const std::string& step_dir, int64_t seed) {
  if (seed == o.seed) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--seed=", o.seed, ": the checkpoint '", step_dir, "' was trained with --seed=", seed,
      "; resume with the same seed to continue its run"));
}

absl::Status InCheckpoint(const std::string& step_dir, const char* part, absl::Status s) {
  if (s.ok()) return s;
  return absl::Status(s.code(),
                      absl::StrCat("checkpoint '", step_dir, "' (", part, "): ", s.message()));
}

// A sharded checkpoint of any world size and strategy: each rank reads only
// its ranges (state_dict's reshard on load).
absl::StatusOr<int64_t> ResumeSharded(const std::string& step_dir, const Options& o,
                                      fsdp::FullyShardedDataParallel& model,
                                      torch::optim::Optimizer& optimizer) {
  state_dict::ShardRequest scalar;
  scalar.global_shape = {1};
  scalar.dtype = torch::kInt64;
  scalar.ranges = {{0, 1}};
  auto trainer = state_dict::LoadResharded(step_dir, {{kStepKey, scalar}, {kSeedKey, scalar}});
  if (!trainer.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint '", step_dir, "': ", trainer.status().message(),
                     " (expected a checkpoint written by the trainer)"));
  }
  const int64_t step = trainer->find(kStepKey)->pieces[0].data.item<int64_t>();
  const int64_t seed = trainer->find(kSeedKey)->pieces[0].data.item<int64_t>();
  if (auto s = CheckSeed(o, step_dir, seed); !s.ok()) return s;
  if (auto s =
          state_dict::LoadModelCheckpoint(model, step_dir, state_dict::StateDictType::kSharded);
      !s.ok()) {
    return InCheckpoint(step_dir, "model", s);
  }
  if (auto s = state_dict::LoadShardedOptimCheckpoint(model, optimizer, step_dir); !s.ok()) {
    return InCheckpoint(step_dir, "optimizer", s);
  }
  return step;
}

// A FULL checkpoint: every rank reads model.pt; the model goes in through
// the FULL state dict, the optimizer state through shard_full (each rank
// cuts its elements out), with the current optimizer's hyperparameters.
absl::StatusOr<int64_t> ResumeFull(const std::string& step_dir, const Options& o,
                                   fsdp::FullyShardedDataParallel& model,
                                   torch::optim::Optimizer& optimizer) {
  auto saved = state_dict::LoadFullStateDict(step_dir);
  if (!saved.ok()) return saved.status();
  const torch::Tensor* step = saved->find(kStepKey);
  const torch::Tensor* seed = saved->find(kSeedKey);
  if (step == nullptr || seed == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint '", step_dir, "' lacks ", kStepKey, "/", kSeedKey,
                     ": expected a checkpoint written by the trainer"));
  }
  if (auto s = CheckSeed(o, step_dir, seed->item<int64_t>()); !s.ok()) return s;
  state_dict::FsdpModelStateDict model_state;
  model_state.type = state_dict::StateDictType::kFull;
  state_dict::OptimStateDict optim_state;
  optim_state.key_type = state_dict::OptimStateKeyType::kParamName;
  std::map<std::string, state_dict::TensorDict> per_param;
  for (const auto& item : *saved) {
    const std::string& key = item.key();
    if (absl::StartsWith(key, kModelPrefix)) {
      model_state.full.insert(key.substr(sizeof(kModelPrefix) - 1), item.value());
    } else if (absl::StartsWith(key, kOptimPrefix)) {
      // "optim.<fqn>.<entry>": entry names have no dots, FQNs do.
      const std::string rest = key.substr(sizeof(kOptimPrefix) - 1);
      const size_t dot = rest.rfind('.');
      if (dot == std::string::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat("checkpoint '", step_dir, "': malformed key '", key, "'"));
      }
      per_param[rest.substr(0, dot)].insert(rest.substr(dot + 1), item.value());
    }
  }
  for (auto& [name, entries] : per_param) optim_state.state.emplace_back(name, std::move(entries));
  auto current = state_dict::ExportOptimizerState(optimizer);
  if (!current.ok()) return current.status();
  auto mine = state_dict::ShardFullOptimStateDict(model, optimizer, optim_state);
  if (!mine.ok()) return InCheckpoint(step_dir, "optimizer", mine.status());
  mine->param_groups = current->param_groups;
  if (auto s = state_dict::LoadModelStateDict(model, model_state); !s.ok()) {
    return InCheckpoint(step_dir, "model", s);
  }
  if (auto s = state_dict::ImportOptimizerState(optimizer, *mine); !s.ok()) {
    return InCheckpoint(step_dir, "optimizer", s);
  }
  return step->item<int64_t>();
}

// Loads the checkpoint to resume from (o.resume_from, or the newest that
// verifies), of either format; returns its step.
absl::StatusOr<int64_t> LoadResumeCheckpoint(const Options& o, const comm::ProcessGroup& group,
                                             fsdp::FullyShardedDataParallel& model,
                                             torch::optim::Optimizer& optimizer) {
  std::optional<std::string> step_dir;
  if (!o.resume_from.empty()) {
    step_dir = o.resume_from;
  } else {
    auto chosen = ChooseResumeCheckpoint(o.checkpoint_dir, group);
    if (!chosen.ok()) return chosen.status();
    step_dir = *chosen;
  }
  if (!step_dir.has_value()) {
    return absl::NotFoundError(absl::StrCat(
        "--resume: no complete checkpoint in --checkpoint-dir='", o.checkpoint_dir, "'"));
  }
  if (group.rank() == 0 && o.resume_from.empty()) {  // a restart says it itself
    std::printf("trainer: resuming from %s\n", step_dir->c_str());
    std::fflush(stdout);
  }
  auto manifest = state_dict::ReadManifest(*step_dir);
  if (!manifest.ok()) return manifest.status();
  return manifest->kind == state_dict::CheckpointKind::kFull
             ? ResumeFull(*step_dir, o, model, optimizer)
             : ResumeSharded(*step_dir, o, model, optimizer);
}

}  // namespace

absl::StatusOr<std::optional<std::string>> ChooseResumeCheckpoint(const std::string& dir,
                                                                  const comm::ProcessGroup& group) {
  absl::Status chosen = absl::OkStatus();
  std::optional<std::string> step_dir;
  if (group.rank() == 0) {
    auto recovered = state_dict::RecoverLatestCheckpoint(dir);
    if (recovered.ok()) {
      for (const state_dict::SetAsideCheckpoint& damaged : recovered->set_aside) {
        std::fprintf(stderr, "trainer: skipping damaged checkpoint %s (moved to %s): %s\n",
                     damaged.step_dir.c_str(), damaged.moved_to.c_str(),
                     std::string(damaged.why.message()).c_str());
      }
      step_dir = recovered->step_dir;
    } else {
      chosen = absl::Status(recovered.status().code(), absl::StrCat("--checkpoint-dir='", dir,
                                                                    "': choosing the checkpoint to "
                                                                    "resume from: ",
                                                                    recovered.status().message()));
    }
  }
  const std::string what = absl::StrCat("choosing the checkpoint to resume from in '", dir, "'");
  if (auto s = AgreeOnStatus(group, chosen, what); !s.ok()) return s;
  if (group.rank() == 0) return step_dir;
  // Rank 0 has set every damaged newer one aside: the newest listed is its.
  auto latest = state_dict::LatestCheckpoint(dir);
  if (absl::IsNotFound(latest.status())) return std::optional<std::string>();
  if (!latest.ok()) return latest.status();
  return std::optional<std::string>(*latest);
}

absl::StatusOr<int64_t> ResumeTrainer(const Options& o, const comm::ProcessGroup& group,
                                      fsdp::FullyShardedDataParallel& model,
                                      torch::optim::Optimizer& optimizer) {
  if (o.resume) return LoadResumeCheckpoint(o, group, model, optimizer);
  if (o.checkpoint_dir.empty()) return 0;
  auto existing = state_dict::LatestCheckpoint(o.checkpoint_dir);
  if (existing.ok()) {
    return absl::AlreadyExistsError(absl::StrCat(
        "--checkpoint-dir='", o.checkpoint_dir, "' already holds a checkpoint (", *existing,
        "): pass --resume to continue that run, or use an empty directory"));
  }
  return 0;
}

absl::Status SaveTrainerCheckpoint(const Options& o, fsdp::FullyShardedDataParallel& model,
                                   const torch::optim::Optimizer& optimizer,
                                   const comm::ProcessGroup& group, int64_t step,
                                   AsyncSave* async) {
  if (async != nullptr) {
    if (auto s = FinishAsyncSave(o, group, *async, /*block=*/true); !s.ok()) return s;
  }
  state_dict::AsyncCheckpointer* saver = async != nullptr ? &async->saver : nullptr;
  const bool is_main = group.rank() == 0;
  const std::string what = CheckpointContext(o, step);
  absl::Status saved = o.checkpoint_format == CheckpointFormat::kSharded
                           ? SaveShardedTrainerState(o, model, optimizer, step, saver)
                           : SaveFullTrainerState(o, model, optimizer, step, is_main, saver);
  if (auto s = AgreeOnStatus(group, InContext(what, saved), what); !s.ok()) return s;
  if (async != nullptr) {
    async->step = step;
    return absl::OkStatus();
  }
  return CommitCheckpoint(o, group, step);
}

absl::Status FinishAsyncSave(const Options& o, const comm::ProcessGroup& group, AsyncSave& async,
                             bool block) {
  if (async.step == 0) return absl::OkStatus();
  if (!block) {
    torch::Tensor finished = torch::tensor({int64_t{async.saver.finished() ? 1 : 0}});
    comm::all_reduce(group, finished, comm::ReduceOp::kMin).wait();
    if (finished.item<int64_t>() == 0) return absl::OkStatus();
  }
  const int64_t step = std::exchange(async.step, 0);
  const std::string what = CheckpointContext(o, step);
  if (auto s = AgreeOnStatus(group, InContext(what, async.saver.Wait()), what); !s.ok()) {
    return s;
  }
  return CommitCheckpoint(o, group, step);
}

}  // namespace trainer
