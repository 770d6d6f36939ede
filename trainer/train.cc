#include "trainer/train.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/cuda.h>
#include <torch/types.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "activation_checkpointing/apply_activation_checkpointing.h"
#include "comm/collectives.h"
#include "comm/compute_layout.h"
#include "comm/device_mesh.h"
#include "comm/slurm.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "module_call/call.h"
#include "module_call/wrap_policy.h"
#include "state_dict/async_checkpoint.h"
#include "state_dict/checkpoint.h"
#include "state_dict/fsdp_optim_state_dict.h"
#include "state_dict/fsdp_state_dict.h"
#include "state_dict/optim_state.h"
#include "trainer/data.h"
#include "trainer/json_log.h"
#include "trainer/lr_schedule.h"
#include "trainer/models.h"
#include "trainer/progress.h"

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kModelPrefix[] = "model.";
constexpr char kOptimPrefix[] = "optim.";
constexpr char kStepKey[] = "trainer.step";
constexpr char kSeedKey[] = "trainer.seed";

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(
    const Options& o, std::vector<torch::Tensor> params) {
  switch (o.optimizer) {
    case OptimizerKind::kAdam:
      return std::make_unique<torch::optim::Adam>(
          std::move(params), torch::optim::AdamOptions(o.lr));
    case OptimizerKind::kAdamW:
      return std::make_unique<torch::optim::AdamW>(
          std::move(params), torch::optim::AdamWOptions(o.lr).weight_decay(0.01));
    case OptimizerKind::kSgd:
      return std::make_unique<torch::optim::SGD>(
          std::move(params), torch::optim::SGDOptions(o.lr).momentum(0.9));
  }
  return nullptr;
}

int64_t TensorBytes(const torch::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.numel() * t.element_size()) : 0;
}

// The model and its FSDP wrapper.
struct Wrapped {
  std::shared_ptr<LanguageModel> model;
  std::unique_ptr<fsdp::FullyShardedDataParallel> fsdp;
};

fsdp::ShardingStrategy ToStrategy(Sharding s) {
  switch (s) {
    case Sharding::kFull: return fsdp::ShardingStrategy::kFullShard;
    case Sharding::kGradOp: return fsdp::ShardingStrategy::kShardGradOp;
    case Sharding::kNone: return fsdp::ShardingStrategy::kNoShard;
    case Sharding::kHybrid: return fsdp::ShardingStrategy::kHybridShard;
  }
  return fsdp::ShardingStrategy::kFullShard;
}

fsdp::BackwardPrefetch ToPrefetch(BackwardPrefetch b) {
  switch (b) {
    case BackwardPrefetch::kPre: return fsdp::BackwardPrefetch::kBackwardPre;
    case BackwardPrefetch::kPost: return fsdp::BackwardPrefetch::kBackwardPost;
    case BackwardPrefetch::kNone: return fsdp::BackwardPrefetch::kNone;
  }
  return fsdp::BackwardPrefetch::kNone;
}

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
absl::Status SaveShardedCheckpoint(const Options& o, fsdp::FullyShardedDataParallel& model,
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
absl::Status SaveFullCheckpoint(const Options& o, fsdp::FullyShardedDataParallel& model,
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
    return absl::AbortedError(
        absl::StrCat(what, " failed on rank ", failed, " (see its message)"));
  }
  return absl::OkStatus();
}

// --async-checkpoint: the save in flight; `step` is 0 when there is none.
// Every rank records the step (a FULL save runs on rank 0 only), so all take
// part in finishing it.
struct AsyncSave {
  state_dict::AsyncCheckpointer saver;
  int64_t step = 0;
};

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

// Finishes the async save in flight, if any: every rank's result agreed on
// (a background failure surfaces here, on every rank), then the commit.
// With `block` false it only polls: one all-reduce, and nothing more unless
// every rank's write has finished.
absl::Status FinishAsyncSave(const Options& o, const comm::ProcessGroup& group,
                             AsyncSave& async, bool block) {
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

// Writes the checkpoint of `step` in --checkpoint-format; a sharded one is
// committed (made visible) by rank 0 once every rank's pieces are durable.
// With `async` (--async-checkpoint), the previous async save is finished
// first, and this one is started on the live state and finished later
// (FinishAsyncSave); the next optimizer step waits until it is written.
absl::Status SaveCheckpoint(const Options& o, fsdp::FullyShardedDataParallel& model,
                            const torch::optim::Optimizer& optimizer,
                            const comm::ProcessGroup& group, int64_t step, AsyncSave* async) {
  if (async != nullptr) {
    if (auto s = FinishAsyncSave(o, group, *async, /*block=*/true); !s.ok()) return s;
  }
  state_dict::AsyncCheckpointer* saver = async != nullptr ? &async->saver : nullptr;
  const bool is_main = group.rank() == 0;
  const std::string what = CheckpointContext(o, step);
  absl::Status saved = o.checkpoint_format == CheckpointFormat::kSharded
                           ? SaveShardedCheckpoint(o, model, optimizer, step, saver)
                           : SaveFullCheckpoint(o, model, optimizer, step, is_main, saver);
  if (auto s = AgreeOnStatus(group, InContext(what, saved), what); !s.ok()) return s;
  if (async != nullptr) {
    async->step = step;
    return absl::OkStatus();
  }
  return CommitCheckpoint(o, group, step);
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
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint '", step_dir, "': ", trainer.status().message(),
        " (expected a checkpoint written by the trainer)"));
  }
  const int64_t step = trainer->find(kStepKey)->pieces[0].data.item<int64_t>();
  const int64_t seed = trainer->find(kSeedKey)->pieces[0].data.item<int64_t>();
  if (auto s = CheckSeed(o, step_dir, seed); !s.ok()) return s;
  if (auto s = state_dict::LoadModelCheckpoint(model, step_dir,
                                               state_dict::StateDictType::kSharded);
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
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint '", step_dir, "' lacks ", kStepKey, "/", kSeedKey,
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
absl::StatusOr<int64_t> Resume(const Options& o, const comm::ProcessGroup& group,
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
    return absl::NotFoundError(absl::StrCat("--resume: no complete checkpoint in --checkpoint-dir='",
                                            o.checkpoint_dir, "'"));
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

// Wraps the model per the FSDP flags. `mesh` / `hybrid` receive the 2-D
// mesh and its groups for --sharding=hybrid (they must outlive the result).
absl::StatusOr<Wrapped> WrapModel(const Options& o, std::shared_ptr<LanguageModel> model,
                                  c10::Device device, const comm::ProcessGroup& world,
                                  std::optional<comm::DeviceMesh>* mesh,
                                  std::optional<comm::HybridShardGroups>* hybrid) {
  Wrapped w;
  w.model = model;
  fsdp::FullyShardedDataParallel::Options options;
  options.sharding_strategy = ToStrategy(o.sharding);
  if (o.sharding == Sharding::kHybrid) {
    auto shape = HybridMeshShape(world.size());
    if (!shape.ok()) return shape.status();
    auto m = comm::init_hybrid_shard_mesh(world, shape->first, shape->second);
    if (!m.ok()) return m.status();
    *mesh = std::move(*m);
    auto groups = comm::hybrid_shard_groups(**mesh);
    if (!groups.ok()) return groups.status();
    *hybrid = std::move(*groups);
    options.device_mesh = **mesh;
  } else {
    options.process_group = world;
  }
  switch (o.auto_wrap) {
    case AutoWrap::kBlock:
      // The MLP has no blocks: the policy finds nothing and the root is the
      // only unit.
      options.auto_wrap_policy = module_call::module_type_auto_wrap_policy<TransformerBlockImpl>();
      break;
    case AutoWrap::kSize: {
      // size_based_auto_wrap_policy, limited to the blocks: a unit must be
      // called through module_call::call, and the blocks (TransformerLM's block
      // runner) are the only submodules called that way. Wrapping, say, a
      // block's fc1 would make the block's own forward() read fc1's 1-D
      // shard. Below the threshold a block stays in the root unit; the MLP
      // has no blocks, so it is always the root unit alone.
      const module_call::AutoWrapPolicy size = module_call::size_based_auto_wrap_policy(o.auto_wrap_min_params);
      options.auto_wrap_policy = module_call::custom_auto_wrap_policy(
          [size](const torch::nn::Module& module, const std::string& fqn, int64_t numel) {
            return dynamic_cast<const TransformerBlockImpl*>(&module) != nullptr &&
                   size.should_wrap(module, fqn, numel);
          });
      break;
    }
    case AutoWrap::kNone:
      break;
  }
  options.backward_prefetch = ToPrefetch(o.backward_prefetch);
  if (o.mixed_precision == MixedPrecision::kBf16) {
    // Gather and compute in bfloat16; reduce gradients and keep buffers in
    // float32 (the shard the optimizer updates stays float32).
    options.mixed_precision.param_dtype = torch::kBFloat16;
    options.mixed_precision.reduce_dtype = torch::kFloat32;
    options.mixed_precision.buffer_dtype = torch::kFloat32;
  }
  options.cpu_offload.offload_params = o.cpu_offload;
  // Built on the CPU; FSDP moves each unit there before sharding it.
  if (!device.is_cpu()) options.device_id = device;
  // The optimizer sees the original parameters (views of this rank's
  // shard), so Adam/AdamW/SGD run unmodified per parameter and their state
  // is keyed by the model's own FQNs (checkpoints, OptimizerParamNames).
  options.use_orig_params = true;

  if (o.activation_checkpointing == ActivationCheckpointing::kBlock) {
    // Marks the blocks; module_call::call (the block runner below) then runs each
    // one as a checkpointed region, its unit gathered again for the
    // recomputation in backward. The last block too, although its backward
    // runs right after the loss: leaving it unmarked (1/8 less recompute
    // on trainer_bench) kept the same allocated peak but raised the 2-rank
    // peak RSS (seq 512: FULL_SHARD 538 -> 557-568 MiB, SHARD_GRAD_OP
    // 604-607 -> 612 MiB), the allocator's layout being what changed.
    const auto blocks = activation_checkpointing::apply_activation_checkpointing(
        model, module_call::module_type_auto_wrap_policy<TransformerBlockImpl>());
    if (blocks.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--activation-checkpointing=block: the ", Name(o.model),
          " model has no transformer blocks to checkpoint: use --model=transformer, or "
          "--activation-checkpointing=none"));
    }
  }
  if (auto* lm = dynamic_cast<TransformerLM*>(model.get())) {
    // Every block call goes through the runner: module_call::call gathers a
    // wrapped block before and reshards it after (a plain forward when the
    // block is not a unit, e.g. --auto-wrap=none).
    lm->set_block_runner([](int64_t, TransformerBlock& block, const torch::Tensor& x,
                            const torch::Tensor& mask) { return module_call::call(block, x, mask); });
  }
  // Typed as LanguageModel (no single forward): the root is entered
  // through run() around Loss().
  w.fsdp = std::make_unique<fsdp::FullyShardedDataParallel>(model, std::move(options));

  return w;
}

// Per-rank values of `local`, in rank order.
std::vector<std::vector<int64_t>> GatherPerRank(const comm::ProcessGroup& group,
                                                const std::vector<int64_t>& local) {
  const int world = group.size();
  std::vector<std::vector<int64_t>> out(local.size(), std::vector<int64_t>(world));
  const int64_t n = static_cast<int64_t>(local.size());
  torch::Tensor mine = torch::tensor(local, torch::kInt64);
  torch::Tensor all = torch::empty({world * n}, torch::kInt64);
  comm::all_gather_into_tensor(group, all, mine).wait();
  const int64_t* data = all.data_ptr<int64_t>();
  for (int r = 0; r < world; ++r) {
    for (int64_t k = 0; k < n; ++k) out[k][r] = data[r * n + k];
  }
  return out;
}

}  // namespace

absl::StatusOr<int64_t> ShardedStateBytes(const std::vector<torch::Tensor>& params,
                                          const torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  for (const auto& p : params) {
    bytes += TensorBytes(p) + TensorBytes(p.grad());
  }
  auto state = state_dict::ExportOptimizerState(optimizer);
  if (!state.ok()) return state.status();
  for (const auto& [key, entries] : state->state) {
    for (const auto& entry : entries) bytes += TensorBytes(entry.value());
  }
  return bytes;
}

absl::StatusOr<c10::Device> ComputeDevice(const Options& o) {
  if (o.device == Device::kCpu) return c10::Device(c10::kCPU);
#ifndef TORCHFSDP_CUDA
  return absl::UnimplementedError(
      "--device=cuda: this trainer was built without CUDA (build it with "
      "--config=cuda against a CUDA LibTorch, such as the torch wheel); use --device=cpu");
#else
  const int64_t count = static_cast<int64_t>(torch::cuda::device_count());
  if (count <= 0) {
    return absl::FailedPreconditionError(
        "--device=cuda: this process sees no CUDA GPU (torch::cuda::device_count() is 0: no "
        "NVIDIA driver, no device, or CUDA_VISIBLE_DEVICES hides them); use --device=cpu");
  }
  int64_t local_rank = 0;
  if (comm::is_slurm_task()) {
    auto env = comm::slurm_rank_environment();
    if (!env.ok()) return env.status();
    local_rank = (*env)->local_rank;
  } else if (const char* v = std::getenv("LOCAL_RANK");
             v != nullptr && !absl::SimpleAtoi(v, &local_rank)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "environment variable LOCAL_RANK='", v, "': expected a non-negative integer"));
  }
  // torchrun's convention, and the GPU comm's NCCL backend binds.
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank % count));
#endif
}

std::string ProcessGroupBackend(const Options& o) {
  return o.device == Device::kCuda ? comm::kGlooCpuNcclCuda : "gloo";
}

absl::StatusOr<std::optional<std::string>> ChooseResumeCheckpoint(
    const std::string& dir, const comm::ProcessGroup& group) {
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
      chosen = absl::Status(recovered.status().code(),
                            absl::StrCat("--checkpoint-dir='", dir, "': choosing the checkpoint to "
                                         "resume from: ", recovered.status().message()));
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

absl::StatusOr<TrainResult> Train(const Options& o, const comm::ProcessGroup& group) {
  const int world = group.size();
  const int rank = group.rank();
  const bool is_main = rank == 0;
  if (auto s = CheckFeatureAvailability(o, world); !s.ok()) return s;
  auto device = ComputeDevice(o);
  if (!device.ok()) return device.status();

  std::vector<uint8_t> corpus;
  if (o.data == DataKind::kText) {
    auto loaded = LoadTextCorpus();
    if (!loaded.ok()) return loaded.status();
    corpus = std::move(*loaded);
  }

  const ModelConfig config{o.layers, o.dim, o.heads, o.vocab, o.seq};
  std::shared_ptr<LanguageModel> model = BuildModel(
      o.model == ModelKind::kMlp ? ModelType::kMlp : ModelType::kTransformer,
      config, static_cast<uint64_t>(o.seed));
  int64_t num_params = 0;
  for (const auto& p : model->parameters()) num_params += p.numel();

  std::optional<comm::DeviceMesh> mesh;
  std::optional<comm::HybridShardGroups> hybrid;
  auto wrapped = WrapModel(o, model, *device, group, &mesh, &hybrid);
  if (!wrapped.ok()) return wrapped.status();
  Wrapped& w = *wrapped;
  fsdp::FullyShardedDataParallel& fsdp_model = *w.fsdp;
  const std::vector<torch::Tensor> params = fsdp_model.parameters();
  std::unique_ptr<torch::optim::Optimizer> optimizer = MakeOptimizer(o, params);

  TrainResult result;
  if (!o.resume && !o.checkpoint_dir.empty()) {
    // Caught now rather than at the first save, after minutes of training:
    // checkpoints are never overwritten.
    auto existing = state_dict::LatestCheckpoint(o.checkpoint_dir);
    if (existing.ok()) {
      return absl::AlreadyExistsError(absl::StrCat(
          "--checkpoint-dir='", o.checkpoint_dir, "' already holds a checkpoint (",
          *existing, "): pass --resume to continue that run, or use an empty directory"));
    }
  }
  if (o.resume) {
    auto step = Resume(o, group, fsdp_model, *optimizer);
    if (!step.ok()) return step.status();
    result.first_step = *step + 1;
  }

  JsonLogWriter log;
  if (is_main) {
    std::string layout = absl::StrCat(world, world == 1 ? " rank" : " ranks", ", FSDP ",
                                      Name(o.sharding));
    if (o.sharding == Sharding::kHybrid) {
      auto shape = HybridMeshShape(world);
      if (shape.ok()) absl::StrAppend(&layout, " (", shape->first, " replicas x ", shape->second, " shards)");
    }
    absl::StrAppend(&layout, ", ", fsdp_model.fsdp_unit_names().size(), " unit",
                    fsdp_model.fsdp_unit_names().size() == 1 ? "" : "s", " (auto-wrap ",
                    AutoWrapName(o), ")");
    if (o.mixed_precision == MixedPrecision::kBf16) absl::StrAppend(&layout, ", bf16");
    if (o.cpu_offload) absl::StrAppend(&layout, ", cpu offload");
    if (!device->is_cpu()) absl::StrAppend(&layout, ", on ", device->str(), " (NCCL)");
    std::printf("trainer: %s, %lld parameters, %s data%s, %s, global batch %lld%s, "
                "steps %lld-%lld\n",
                Name(o.model), static_cast<long long>(num_params), Name(o.data),
                o.data == DataKind::kText
                    ? absl::StrCat(" (", corpus.size(), " bytes of ", kLicenseDir, ")").c_str()
                    : "",
                layout.c_str(), static_cast<long long>(o.global_batch),
                o.grad_accum > 1 ? absl::StrCat(" in ", o.grad_accum, " micro-batches").c_str() : "",
                static_cast<long long>(result.first_step), static_cast<long long>(o.steps));
    const char* local_world = std::getenv("LOCAL_WORLD_SIZE");
    std::printf("trainer: compute: %s\n",
                comm::DescribeComputeLayout(local_world != nullptr ? std::atoi(local_world) : world)
                    .c_str());
    std::fflush(stdout);
    if (!o.log_json.empty()) {
      if (auto s = log.Open(o.log_json, /*append=*/o.resume); !s.ok()) return s;
    }
  }
  ProgressBar progress(result.first_step, o.steps, stdout,
                       is_main && isatty(fileno(stdout)) != 0);

  const int64_t tokens_per_step = o.global_batch * o.seq;
  const Clock::time_point run_start = Clock::now();
  double total_tokens = 0;
  // Declared before the loop so that leaving it on an error still waits for
  // the background write (the destructor joins it) before the state goes.
  AsyncSave async_save;
  AsyncSave* async = o.async_checkpoint ? &async_save : nullptr;
  for (int64_t step = result.first_step; step <= o.steps; ++step) {
    const Clock::time_point step_start = Clock::now();
    const double lr = LearningRate(o, step);
    for (auto& param_group : optimizer->param_groups()) {
      param_group.options().set_lr(lr);
    }
    optimizer->zero_grad();

    BatchSpec spec{static_cast<uint64_t>(o.seed), step, o.global_batch, o.seq + 1,
                   rank, world};
    auto batch = o.data == DataKind::kText ? SampleTextBatch(corpus, spec)
                                           : SampleSyntheticBatch(o.vocab, spec);
    if (!batch.ok()) return batch.status();

    // Micro-batches of equal size: scaling each mean loss by 1/K makes the
    // accumulated gradient the gradient of the mean over the rank's rows.
    // The first K-1 backwards run under no_sync (gradients accumulate
    // unreduced); the last one reduces the sum, averaged over ranks by FSDP.
    double local_loss = 0;
    const std::vector<torch::Tensor> micros = batch->chunk(o.grad_accum, 0);
    for (size_t m = 0; m < micros.size(); ++m) {
      const torch::Tensor micro = micros[m].to(*device);
      auto forward_backward = [&] {
        torch::Tensor loss =
            fsdp_model.run([&] { return model->Loss(micro); }) / static_cast<double>(o.grad_accum);
        loss.backward();
        local_loss += loss.item<double>();
      };
      if (m + 1 < micros.size()) {
        auto no_sync = fsdp_model.no_sync();
        forward_backward();
      } else {
        forward_backward();
      }
    }
    torch::Tensor l = torch::tensor({local_loss}, torch::kFloat64);
    comm::all_reduce(group, l, comm::ReduceOp::kAvg).wait();
    const double global_loss = l.item<double>();
    // The norm over all ranks' shards (an all-reduce inside).
    if (o.clip > 0) fsdp_model.clip_grad_norm_(o.clip);
    // An async save in flight writes the live parameters and optimizer
    // state: they may change only once it has written them (in the time of
    // this step's forward and backward, usually).
    if (async != nullptr) async->saver.WaitUntilWritten();
    optimizer->step();
    const double step_time =
        std::chrono::duration<double>(Clock::now() - step_start).count();
    result.losses.push_back(global_loss);
    total_tokens += static_cast<double>(tokens_per_step);

    const double tokens_per_s = static_cast<double>(tokens_per_step) / step_time;
    // Only the JSON log needs the per-rank figures: without it, no extra
    // collective per step. Every rank has the same options, so all agree.
    if (!o.log_json.empty()) {
      auto state_bytes = ShardedStateBytes(params, *optimizer);
      if (!state_bytes.ok()) return state_bytes.status();
      const auto per_rank = GatherPerRank(group, {PeakRssBytes(), *state_bytes});
      if (is_main) {
        StepRecord record{step, global_loss, lr, step_time, tokens_per_s, per_rank[0],
                          per_rank[1]};
        if (auto s = log.Write(record); !s.ok()) return s;
      }
    }
    if (is_main) {
      progress.Update(step, global_loss, tokens_per_s,
                      std::chrono::duration<double>(Clock::now() - run_start).count());
    }

    const bool checkpoint_now =
        !o.checkpoint_dir.empty() &&
        ((o.checkpoint_every > 0 && step % o.checkpoint_every == 0) || step == o.steps);
    if (checkpoint_now) {
      if (auto s = SaveCheckpoint(o, fsdp_model, *optimizer, group, step, async); !s.ok()) {
        return s;
      }
    } else if (async != nullptr) {
      if (auto s = FinishAsyncSave(o, group, *async, /*block=*/false); !s.ok()) return s;
    }
  }
  if (async != nullptr) {
    if (auto s = FinishAsyncSave(o, group, *async, /*block=*/true); !s.ok()) return s;
  }
  if (is_main) {
    const double elapsed =
        std::chrono::duration<double>(Clock::now() - run_start).count();
    progress.Finish(elapsed, elapsed > 0 ? total_tokens / elapsed : 0, PeakRssBytes());
  }
  return result;
}

}  // namespace trainer
