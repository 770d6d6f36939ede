#include "trainer/checkpointing.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/collectives.h"
#include "comm/subgroups.h"
#include "state_dict/checkpoint.h"
#include "state_dict/dcp.h"
#include "formats/hf/hf_checkpoint_files.h"
#include "state_dict/fsdp/checkpoint_keys.h"
#include "state_dict/fsdp/fsdp_dcp.h"
#include "state_dict/fsdp/fsdp_full_checkpoint.h"
#include "state_dict/fsdp/fsdp_optim_state_dict.h"
#include "state_dict/fsdp/fsdp_state_dict.h"
#include "state_dict/fully_shard/fully_shard_dcp.h"
#include "state_dict/fully_shard/fully_shard_state_dict.h"
#include "state_dict/hf_checkpoint.h"
#include "state_dict/optim_state.h"
#include "trainer/finite_state.h"

namespace trainer {
namespace {

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

// What a checkpoint holds, as this rank's SHARDED pieces (views of the live
// state): the model's and the optimizer's entries ("<fqn>", "<fqn>/<entry>";
// with `rename`, under the names it gives), then "trainer.step" and
// "trainer.seed", which rank 0 writes.
absl::StatusOr<state_dict::FsdpModelStateDict> TrainerShardedState(
    const Options& o, TrainedModel model, const torch::optim::Optimizer& optimizer, int64_t step,
    std::string (*rename)(const std::string&) = nullptr) {
  // The same names and layout under either FSDP.
  absl::StatusOr<state_dict::FsdpModelStateDict> both =
      state_dict::ModelAndOptimizerState(*model.shards(), &optimizer);
  if (!both.ok()) return both.status();
  if (rename != nullptr) {
    state_dict::ShardedStateDict renamed;
    for (const auto& item : both->sharded) renamed.insert(rename(item.key()), item.value());
    both->sharded = std::move(renamed);
    for (std::string& name : both->replicated) name = rename(name);
  }
  both->sharded.insert(kStepKey, Scalar(step));
  both->sharded.insert(kSeedKey, Scalar(o.seed));
  both->replicated.push_back(kStepKey);
  both->replicated.push_back(kSeedKey);
  return both;
}

// SHARDED: every rank writes its pieces of the model and the optimizer
// state (no gathering), the trainer's step and seed go with rank 0's.
absl::Status SaveShardedTrainerState(const Options& o, TrainedModel model,
                                     const torch::optim::Optimizer& optimizer, int64_t step,
                                     state_dict::AsyncCheckpointer* async) {
  auto both = TrainerShardedState(o, model, optimizer, step);
  if (!both.ok()) return both.status();
  if (async != nullptr) {  // --async-checkpoint: written from the live state meanwhile
    return async->SaveShardInPlace(o.checkpoint_dir, step, both->rank, both->world_size,
                                   state_dict::ShardToSave(*both));
  }
  return state_dict::SaveModelCheckpoint(o.checkpoint_dir, step, *both);
}

// FULL: one model.pt ("model.<fqn>", "optim.<fqn>.<entry>", e.g.
// "optim.blocks.0.fc1.weight.exp_avg", "trainer.step", "trainer.seed") written by rank 0, each
// tensor gathered onto it just before its record is written
// (SaveFsdpFullCheckpoint): the save adds one tensor to rank 0's memory.
// --async-checkpoint runs the same save in the background, over a group of
// its own (the training's collectives go on meanwhile on the main group);
// the optimizer waits for it (WaitUntilWritten) as for every in-place save.
absl::Status SaveFullTrainerState(const Options& o, TrainedModel model,
                                  const torch::optim::Optimizer& optimizer,
                                  const comm::ProcessGroup& group, int64_t step, AsyncSave* async) {
  auto file_state = TrainerShardedState(o, model, optimizer, step, state_dict::FullCheckpointKey);
  if (!file_state.ok()) return file_state.status();
  if (async == nullptr) {
    return state_dict::SaveFsdpFullCheckpoint(o.checkpoint_dir, step, *file_state, group);
  }
  if (!async->transfer_group) {
    std::vector<int> everyone(static_cast<size_t>(group.size()));
    for (int r = 0; r < group.size(); ++r) everyone[static_cast<size_t>(r)] = r;
    auto made = comm::new_group(group, everyone);
    if (!made.ok()) return made.status();
    async->transfer_group = *made;
  }
  return async->saver.StartInPlace([root = o.checkpoint_dir, step, state = *std::move(file_state),
                                    transfer = *async->transfer_group] {
    return state_dict::SaveFsdpFullCheckpoint(root, step, state, transfer);
  });
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
                                      TrainedModel model, torch::optim::Optimizer& optimizer) {
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
  if (auto s = state_dict::LoadShardedModelCheckpoint(*model.shards(), &optimizer, step_dir);
      !s.ok()) {
    return InCheckpoint(step_dir, "model and optimizer", s);
  }
  return step;
}

// A FULL checkpoint: every rank reads model.pt; the model goes in through
// the FULL state dict, the optimizer state through shard_full (each rank
// cuts its elements out), with the current optimizer's hyperparameters.
absl::StatusOr<int64_t> ResumeFull(const std::string& step_dir, const Options& o,
                                   TrainedModel model, torch::optim::Optimizer& optimizer) {
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
  // "model.<fqn>" / "optim.<fqn>.<entry>", each rank cutting its ranges out.
  if (auto s = state_dict::LoadShardedModelCheckpoint(*model.shards(), &optimizer, step_dir);
      !s.ok()) {
    return InCheckpoint(step_dir, "model and optimizer", s);
  }
  return step->item<int64_t>();
}

absl::Status StateFinite(TrainedModel model, const torch::optim::Optimizer& optimizer,
                         const std::string& what) {
  return CheckStateFinite(*model.shards(), optimizer, what);
}

// A loaded checkpoint's state is finite, unless --allow-nonfinite-import.
absl::Status CheckLoadedFinite(const Options& o, TrainedModel model,
                               const torch::optim::Optimizer& optimizer, const std::string& what) {
  if (o.allow_nonfinite_import) return absl::OkStatus();
  absl::Status s = StateFinite(model, optimizer, what);
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(s.message(),
                                             " (refused: a diverged run's state; "
                                             "--allow-nonfinite-import loads it anyway)"));
}

// Loads the checkpoint to resume from (o.resume_from, or the newest that
// verifies), of either format; returns its step.
absl::StatusOr<int64_t> LoadResumeCheckpoint(const Options& o, const comm::ProcessGroup& group,
                                             TrainedModel model,
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
  auto step = manifest->kind == state_dict::CheckpointKind::kFull
                  ? ResumeFull(*step_dir, o, model, optimizer)
                  : ResumeSharded(*step_dir, o, model, optimizer);
  if (!step.ok()) return step;
  const std::string what = absl::StrCat("checkpoint '", *step_dir, "'");
  if (auto s = AgreeOnStatus(group, CheckLoadedFinite(o, model, optimizer, what), what); !s.ok()) {
    return s;
  }
  return step;
}

// --import-dcp / --export-dcp: "trainer.step" and "trainer.seed" are the
// nested {"trainer": {"step": ..., "seed": ...}} of Python's dcp.save.
const state_dict::DcpKeyPath kDcpStepPath = {"trainer", "step"};
const state_dict::DcpKeyPath kDcpSeedPath = {"trainer", "seed"};

std::string ImportContext(const Options& o) {
  return absl::StrCat("--import-dcp='", o.import_dcp, "'");
}

// "trainer.step" / "trainer.seed" of the checkpoint: a python int.
absl::StatusOr<int64_t> DcpInt(const Options& o, const state_dict::DcpCheckpoint& ckpt,
                               const char* key) {
  auto value = ckpt.LoadObject(key);
  if (absl::IsNotFound(value.status())) {
    return absl::InvalidArgumentError(
        absl::StrCat(ImportContext(o), ": the DCP checkpoint has no '", key,
                     "' entry: expected one saved as dcp.save({\"model\": ..., \"optim\": ..., "
                     "\"trainer\": {\"step\": N, \"seed\": S}}) (the trainer's --export-dcp, "
                     "tools/trainer_mirror.py)"));
  }
  if (!value.ok()) return InContext(ImportContext(o), value.status());
  if (!value->isInt()) {
    return absl::InvalidArgumentError(absl::StrCat(ImportContext(o), ": '", key, "' is a ",
                                                   value->tagKind(), ": expected a python int"));
  }
  return value->toInt();
}

// The per-parameter state entries --optimizer keeps (LibTorch's and
// Python's alike: MakeOptimizer's AdamW and Adam without amsgrad, SGD with
// momentum).
std::set<std::string> OptimizerEntries(OptimizerKind kind) {
  if (kind == OptimizerKind::kSgd) return {"momentum_buffer"};
  return {"exp_avg", "exp_avg_sq", "step"};
}

// The checkpoint's optimizer state is --optimizer's: the same entries, and
// for Adam / AdamW the same kind of weight decay (Python's param groups say
// which: decoupled_weight_decay). Loading another optimizer's state would
// fail later, inside the first step, with a message naming neither.
absl::Status CheckDcpOptimizer(const Options& o, const state_dict::DcpCheckpoint& ckpt) {
  const std::string optim_state = state_dict::DcpOptimStatePrefix();
  std::set<std::string> entries;
  for (const auto& t : ckpt.tensors()) {
    if (!absl::StartsWith(t.key, optim_state)) continue;
    entries.insert(t.key.substr(t.key.rfind('.') + 1));
  }
  const std::set<std::string> expected = OptimizerEntries(o.optimizer);
  if (entries != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        ImportContext(o), ": its optimizer state has the entries {", absl::StrJoin(entries, ", "),
        "} (", optim_state, "<parameter>.<entry>): expected {", absl::StrJoin(expected, ", "),
        "}, --optimizer=", Name(o.optimizer),
        "'s (a checkpoint of another optimizer, or of the model alone)"));
  }
  if (o.optimizer == OptimizerKind::kSgd) return absl::OkStatus();
  const std::string decoupled_key = state_dict::DcpParamGroupOptionKey(0, "decoupled_weight_decay");
  auto decoupled = ckpt.LoadObject(decoupled_key);
  if (absl::IsNotFound(decoupled.status())) return absl::OkStatus();  // older PyTorch
  if (!decoupled.ok()) return InContext(ImportContext(o), decoupled.status());
  if (decoupled->isBool() && decoupled->toBool() != (o.optimizer == OptimizerKind::kAdamW)) {
    return absl::InvalidArgumentError(absl::StrCat(
        ImportContext(o), ": '", decoupled_key, "' is ", decoupled->toBool() ? "True" : "False",
        ": the checkpoint was trained with ", decoupled->toBool() ? "adamw" : "adam",
        ", expected --optimizer=", Name(o.optimizer), "'s state"));
  }
  return absl::OkStatus();
}

// What --import-dcp found: the step to continue after, and whether the
// checkpoint had the trainer's entries and optimizer state.
struct ImportedDcp {
  int64_t step = 0;
  bool has_trainer = true;
  bool has_optimizer = true;
};

// "trainer.step" and "trainer.seed" checked against --steps and --seed.
absl::StatusOr<int64_t> ImportedStep(const Options& o, const state_dict::DcpCheckpoint& ckpt) {
  const std::string what = ImportContext(o);
  auto step = DcpInt(o, ckpt, kStepKey);
  if (!step.ok()) return step.status();
  auto seed = DcpInt(o, ckpt, kSeedKey);
  if (!seed.ok()) return seed.status();
  if (*seed != o.seed) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--seed=", o.seed, ": ", what, " was trained with seed ", *seed, " ('", kSeedKey,
        "'); pass --seed=", *seed, " to continue its run (a step's batch depends on the seed)"));
  }
  if (*step < 0 || *step >= o.steps) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--steps=", o.steps, ": ", what, " is at step ", *step, " ('", kStepKey,
        "'): expected a step in [0, --steps) (--steps is the whole run's length, counting the "
        "steps before the checkpoint)"));
  }
  return *step;
}

// One rank's part of ImportDcp (no collectives). A checkpoint without any
// "trainer.*" entry (what a Python run saves: dcp.save({"model": ...,
// "optim": ...})) starts at step 0; one without optimizer state loads the
// model alone, the optimizer starting fresh.
absl::StatusOr<ImportedDcp> ImportDcpOnRank(const Options& o, TrainedModel model,
                                            torch::optim::Optimizer& optimizer) {
  const std::string what = ImportContext(o);
  std::error_code ec;
  if (!std::filesystem::is_directory(o.import_dcp, ec)) {
    return absl::NotFoundError(absl::StrCat(what, ": no such directory"));
  }
  auto ckpt = state_dict::DcpCheckpoint::Open(o.import_dcp);
  if (!ckpt.ok()) return InContext(what, ckpt.status());
  ImportedDcp imported;
  imported.has_trainer = false;
  for (const std::string& key : ckpt->objects()) {
    imported.has_trainer = imported.has_trainer || absl::StartsWith(key, "trainer.");
  }
  imported.has_optimizer = false;
  for (const auto& t : ckpt->tensors()) {
    imported.has_optimizer =
        imported.has_optimizer || absl::StartsWith(t.key, state_dict::DcpOptimStatePrefix());
  }
  if (imported.has_trainer) {
    auto step = ImportedStep(o, *ckpt);
    if (!step.ok()) return step.status();
    imported.step = *step;
  }
  if (imported.has_optimizer) {
    if (auto s = CheckDcpOptimizer(o, *ckpt); !s.ok()) return s;
  }
  torch::optim::Optimizer* load_optimizer = imported.has_optimizer ? &optimizer : nullptr;
  if (auto s = state_dict::LoadShardedModelDcp(*ckpt, *model.shards(), load_optimizer); !s.ok()) {
    return InContext(what, s);
  }
  if (auto s = CheckLoadedFinite(o, model, optimizer, what); !s.ok()) return s;
  return imported;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DirectoryLock>> PrepareCheckpointDir(
    const Options& o, const comm::ProcessGroup& group) {
  if (o.checkpoint_dir.empty()) return std::unique_ptr<DirectoryLock>();
  const std::string what = absl::StrCat("--checkpoint-dir='", o.checkpoint_dir, "'");
  if (auto s = AgreeOnStatus(group, CheckDirectoryWritable(o.checkpoint_dir, group.rank()), what);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<std::unique_ptr<DirectoryLock>> lock = std::unique_ptr<DirectoryLock>();
  if (group.rank() == 0) {
    std::string taken_over;
    lock = DirectoryLock::Acquire(o.checkpoint_dir, ThisJob(), &taken_over);
    if (lock.ok() && !taken_over.empty()) {
      std::printf("trainer: taking over the stale lock of %s: its holder, %s, is gone\n",
                  what.c_str(), taken_over.c_str());
      std::fflush(stdout);
    }
  }
  if (auto s = AgreeOnStatus(group, lock.status(), what); !s.ok()) return s;
  return lock;
}

absl::StatusOr<int64_t> ImportDcp(const Options& o, const comm::ProcessGroup& group,
                                  TrainedModel model, torch::optim::Optimizer& optimizer) {
  auto imported = ImportDcpOnRank(o, model, optimizer);
  const std::string what = ImportContext(o);
  if (auto s = AgreeOnStatus(group, imported.status(), what); !s.ok()) return s;
  if (group.rank() == 0) {
    if (imported->has_trainer) {
      std::printf("trainer: continuing from DCP checkpoint %s (step %lld)\n", o.import_dcp.c_str(),
                  static_cast<long long>(imported->step));
    } else {
      const std::string optim =
          imported->has_optimizer
              ? std::string(" and optimizer state")
              : absl::StrCat(" (it has no optimizer state: --optimizer=", Name(o.optimizer),
                             " starts fresh)");
      std::printf(
          "trainer: DCP checkpoint %s has no 'trainer' entry (a Python run's): loaded its "
          "model%s; starting at step 0\n",
          o.import_dcp.c_str(), optim.c_str());
    }
    std::fflush(stdout);
  }
  return imported->step;
}

absl::Status LoadHfIntoShards(const Options& o, const comm::ProcessGroup& group,
                              TrainedModel model) {
  const std::string what = absl::StrCat("--hf-checkpoint='", o.hf_checkpoint, "'");
  // Each rank reads its ranges of each tensor, one tensor at a time: it
  // holds its shard plus one tensor's pieces, never the whole model.
  const absl::Status loaded =
      state_dict::LoadHfCheckpointIntoShards(o.hf_checkpoint, *model.shards());
  return AgreeOnStatus(group, InContext(what, loaded), what);
}

absl::Status CheckHfExportTarget(const Options& o, const comm::ProcessGroup& group) {
  if (o.export_hf.empty()) return absl::OkStatus();
  const std::string what = absl::StrCat("--export-hf='", o.export_hf, "'");
  absl::Status usable = absl::OkStatus();
  if (group.rank() == 0) usable = formats::CheckHfExportTarget(o.export_hf);
  return AgreeOnStatus(group, InContext(what, usable), what);
}

absl::Status ExportHf(const Options& o, const comm::ProcessGroup& group, TrainedModel model,
                      const torch::optim::Optimizer& optimizer, const std::string& config_json) {
  const std::string what = absl::StrCat("--export-hf='", o.export_hf, "'");
  if (auto s = AgreeOnStatus(
          group, StateFinite(model, optimizer, absl::StrCat(what, ": not written")), what);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<state_dict::FsdpModelStateDict> state = model.shards()->ModelState();
  if (!state.ok()) return AgreeOnStatus(group, InContext(what, state.status()), what);
  const c10::ScalarType dtype =
      o.export_hf_dtype == ExportDtype::kBf16 ? c10::kBFloat16 : c10::kFloat;
  // Collective: every rank returns an error when one failed.
  const absl::Status written = state_dict::SaveFsdpHfCheckpoint(
      o.export_hf, *state, group, dtype, o.export_hf_max_shard_bytes, config_json);
  if (!written.ok()) return InContext(what, written);
  if (group.rank() == 0) {
    std::printf("trainer: wrote Hugging Face checkpoint %s (%s)\n", o.export_hf.c_str(),
                Name(o.export_hf_dtype));
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

absl::Status CheckDcpExportTarget(const Options& o, const comm::ProcessGroup& group) {
  if (o.export_dcp.empty()) return absl::OkStatus();
  absl::Status usable = absl::OkStatus();
  const std::string what = absl::StrCat("--export-dcp='", o.export_dcp, "'");
  if (group.rank() == 0) {
    std::error_code ec;
    if (std::filesystem::exists(o.export_dcp + "/.metadata", ec)) {
      usable = absl::AlreadyExistsError(absl::StrCat(
          what, " already holds a DCP checkpoint (", o.export_dcp,
          "/.metadata): expected a new or empty directory (DCP has no way to replace one "
          "safely)"));
    } else if (std::filesystem::exists(o.export_dcp, ec) &&
               !std::filesystem::is_directory(o.export_dcp, ec)) {
      usable = absl::FailedPreconditionError(absl::StrCat(what, ": exists and is not a directory"));
    }
  }
  return AgreeOnStatus(group, usable, what);
}

absl::Status ExportDcp(const Options& o, const comm::ProcessGroup& group, TrainedModel model,
                       const torch::optim::Optimizer& optimizer, int64_t step) {
  const std::string what = absl::StrCat("--export-dcp='", o.export_dcp, "' step ", step);
  // As for checkpoints: never an export of non-finite state.
  if (auto s = AgreeOnStatus(
          group, StateFinite(model, optimizer, absl::StrCat(what, ": not written")), what);
      !s.ok()) {
    return s;
  }
  // Python ints, as dcp.save saves them.
  const std::vector<state_dict::DcpShard::Object> trainer_state = {
      {kDcpStepPath, c10::IValue(step)}, {kDcpSeedPath, c10::IValue(o.seed)}};
  const absl::Status saved =
      state_dict::SaveShardedModelDcp(o.export_dcp, *model.shards(), &optimizer, trainer_state);
  // Also the barrier: every rank's shard is written before rank 0 commits.
  if (auto s = AgreeOnStatus(group, InContext(what, saved), what); !s.ok()) return s;
  absl::Status committed = absl::OkStatus();
  if (group.rank() == 0) {
    committed = state_dict::CommitDcpCheckpoint(o.export_dcp, group.size());
  }
  if (auto s = AgreeOnStatus(group, InContext(what, committed), what); !s.ok()) return s;
  if (group.rank() == 0) {
    std::printf("trainer: wrote DCP checkpoint %s (step %lld)\n", o.export_dcp.c_str(),
                static_cast<long long>(step));
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

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
                                      TrainedModel model, torch::optim::Optimizer& optimizer) {
  if (o.resume) return LoadResumeCheckpoint(o, group, model, optimizer);
  if (!o.checkpoint_dir.empty()) {
    auto existing = state_dict::LatestCheckpoint(o.checkpoint_dir);
    if (existing.ok()) {
      return absl::AlreadyExistsError(absl::StrCat(
          "--checkpoint-dir='", o.checkpoint_dir, "' already holds a checkpoint (", *existing,
          "): pass --resume to continue that run, or use an empty directory"));
    }
  }
  if (!o.import_dcp.empty()) return ImportDcp(o, group, model, optimizer);
  return 0;
}

absl::Status SaveTrainerCheckpoint(const Options& o, TrainedModel model,
                                   const torch::optim::Optimizer& optimizer,
                                   const comm::ProcessGroup& group, int64_t step,
                                   AsyncSave* async) {
  if (async != nullptr) {
    if (auto s = FinishAsyncSave(o, group, *async, /*block=*/true); !s.ok()) return s;
  }
  state_dict::AsyncCheckpointer* saver = async != nullptr ? &async->saver : nullptr;
  const std::string what = CheckpointContext(o, step);
  // Never a checkpoint of non-finite state (finite_state.h): nothing is
  // written and, since --keep-last runs only after a save, nothing pruned.
  if (auto s = AgreeOnStatus(
          group, StateFinite(model, optimizer, absl::StrCat(what, ": not saved")), what);
      !s.ok()) {
    return s;
  }
  absl::Status saved = o.checkpoint_format == CheckpointFormat::kSharded
                           ? SaveShardedTrainerState(o, model, optimizer, step, saver)
                           : SaveFullTrainerState(o, model, optimizer, group, step, async);
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
