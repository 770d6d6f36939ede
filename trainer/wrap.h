// The model as the trainer trains it: wrapped in fsdp::FullyShardedDataParallel
// over the given group (one rank included: one code path), per --sharding,
// --auto-wrap, --backward-prefetch, --mixed-precision, --cpu-offload and
// --activation-checkpointing (the flag -> option table is in README.md);
// or, with --fsdp=fully_shard, under fsdp::fully_shard (FSDP2): each
// transformer block the wrap policy picks, then the root.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "comm/process_group.h"
#include "fsdp/fully_shard.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "state_dict/fsdp/sharded_model.h"
#include "trainer/models.h"
#include "trainer/options.h"

namespace trainer {

// Wraps `model` (built on the CPU; FSDP moves each unit to `device`) over
// `world`, or over a 2-D mesh of it for --sharding=hybrid. With
// use_orig_params, so the stock optimizers run per original parameter (on
// this rank's part of it), keyed by the model's own FQNs. The units are the
// model's CausalLM::DecoderLayers(), each called through module_call::call;
// the root,
// which has no single forward, is entered through run() around Loss().
absl::StatusOr<std::unique_ptr<fsdp::FullyShardedDataParallel>> WrapModel(
    const Options& options, std::shared_ptr<LanguageModel> model, c10::Device device,
    const comm::ProcessGroup& world);

// --fsdp=fully_shard: the model with fsdp::fully_shard applied to each
// transformer block --auto-wrap picks (block: every one; size:N: those of at
// least N parameters; none: no block) and to the root. The methods the
// trainer uses have FullyShardedDataParallel's names and meaning.
class FullyShardModel {
 public:
  FullyShardModel(std::shared_ptr<LanguageModel> model, fsdp::FSDPModule root,
                  std::vector<std::string> unit_names);

  // The root's call point around `fn` (FullyShardedDataParallel::run): its
  // parameters gathered before, its backward hooked on the result.
  torch::Tensor run(const std::function<torch::Tensor()>& fn);
  // Gradients accumulate unreduced while the guard lives (PyTorch's
  // set_requires_gradient_sync(False)); the next synchronised backward
  // reduces the sum.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(fsdp::FSDPModule root);
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    fsdp::FSDPModule root_;
  };
  NoSyncGuard no_sync();
  // fsdp::clip_grad_norm_ over the shards of the trainable parameters.
  torch::Tensor clip_grad_norm_(double max_norm);
  // The model's parameters: every one a fully_shard shard.
  std::vector<torch::Tensor> parameters() const;
  // "" for the root, "blocks.<i>" for each sharded block.
  const std::vector<std::string>& fsdp_unit_names() const { return unit_names_; }
  LanguageModel& module() const { return *model_; }
  const fsdp::FSDPModule& root() const { return root_; }

 private:
  std::shared_ptr<LanguageModel> model_;
  fsdp::FSDPModule root_;
  std::vector<std::string> unit_names_;
};

absl::StatusOr<std::unique_ptr<FullyShardModel>> WrapModelFullyShard(
    const Options& options, std::shared_ptr<LanguageModel> model, c10::Device device,
    const comm::ProcessGroup& world);

// Either wrapped model, as the training loop and checkpointing.h see it: a
// reference (the model lives where it was made), cheap to copy, made
// implicitly from either.
class TrainedModel {
 public:
  TrainedModel(fsdp::FullyShardedDataParallel& fsdp1)  // NOLINT: implicit on purpose
      : fsdp1_(&fsdp1) {}
  TrainedModel(FullyShardModel& fully_shard)  // NOLINT: implicit on purpose
      : fully_shard_(&fully_shard) {}

  // Exactly one is set.
  fsdp::FullyShardedDataParallel* fsdp1() const { return fsdp1_; }
  FullyShardModel* fully_shard() const { return fully_shard_; }

  torch::Tensor run(const std::function<torch::Tensor()>& fn) const;
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(const TrainedModel& model);

   private:
    std::optional<fsdp::FullyShardedDataParallel::NoSyncGuard> fsdp1_;
    std::optional<FullyShardModel::NoSyncGuard> fully_shard_;
  };
  NoSyncGuard no_sync() const { return NoSyncGuard(*this); }
  torch::Tensor clip_grad_norm_(double max_norm) const;
  std::vector<torch::Tensor> parameters() const;
  std::vector<std::string> fsdp_unit_names() const;
  // Its shards as every checkpoint format reads and writes them
  // (state_dict/fsdp/sharded_model.h), whichever FSDP made them.
  std::unique_ptr<state_dict::ShardedModel> shards() const;

 private:
  fsdp::FullyShardedDataParallel* fsdp1_ = nullptr;
  FullyShardModel* fully_shard_ = nullptr;
};

// The model wrapped per --fsdp: owns it; model() is what the loop uses.
struct WrappedModel {
  std::unique_ptr<fsdp::FullyShardedDataParallel> fsdp1;  // --fsdp=fsdp1
  std::unique_ptr<FullyShardModel> fully_shard;           // --fsdp=fully_shard
  TrainedModel model() const {
    return fsdp1 != nullptr ? TrainedModel(*fsdp1) : TrainedModel(*fully_shard);
  }
};

// WrapModel or WrapModelFullyShard, per --fsdp.
absl::StatusOr<WrappedModel> Wrap(const Options& options, std::shared_ptr<LanguageModel> model,
                                  c10::Device device, const comm::ProcessGroup& world);

}  // namespace trainer
