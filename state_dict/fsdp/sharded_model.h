// A sharded model as every checkpoint format sees it, whichever FSDP
// sharded it: the one description of its shards that our checkpoints, DCP
// directories and Hugging Face directories read and write through.
//
// FullyShardedDataParallel (FSDP1) cuts flat parameters into contiguous
// ranges; fully_shard (FSDP2) gives each rank dim-0 rows of every
// parameter. Both can say, per original parameter, buffer and optimizer
// entry, its global shape and dtype and this rank's pieces of the flattened
// tensor (a DTensor's placement, spelled as ranges: sharded_tensor.h). That
// description, plus the two loads only the FSDP itself can do (writing its
// shards; creating optimizer state), is ShardedModel. Each FSDP implements it
// once (ShardedModelOf below, and fully_shard_state_dict.h's overload); each
// format is written once over it:
//
//   our checkpoints   ModelAndOptimizerState + SaveModelCheckpoint / the
//                     FULL save (fsdp_full_checkpoint.h);
//                     LoadShardedModelCheckpoint
//   DCP               SaveShardedModelDcp / LoadShardedModelDcp (fsdp_dcp.h)
//   Hugging Face      SaveFsdpHfCheckpoint(ModelState()) /
//                     LoadHfIntoShards (fsdp_full_checkpoint.h)
//   any reader        LoadShardedModelFrom, LoadModelTensorByTensor
//
//   std::unique_ptr<ShardedModel> shards = ShardedModelOf(fsdp_model);  // FSDP1
//   std::unique_ptr<ShardedModel> shards = ShardedModelOf(*module);     // fully_shard
//   LoadShardedModelCheckpoint(*shards, &optimizer, StepDirectory(root, step));
//
// Names are the model's own FQNs ("layers.0.self_attn.q_proj.weight") and
// "<fqn>/<entry>" for optimizer state, whichever FSDP: a checkpoint either
// wrote loads into the other at any world size. Every function is
// called by every rank of the model (the FSDPs' getters may communicate);
// loads check what they read before they write (per function, as stated).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/optim/optimizer.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "state_dict/fsdp/fsdp_optim_state_dict.h"
#include "state_dict/fsdp/fsdp_state_dict.h"
#include "state_dict/optim_state.h"

namespace state_dict {

class ShardedModel {
 public:
  virtual ~ShardedModel() = default;

  // This rank's SHARDED state of the model (kSharded): every parameter and
  // buffer under its FQN with its global shape, dtype and this rank's
  // pieces, which are views of the live shards — writing into them (under
  // torch::NoGradGuard) writes the model; entries every rank holds whole
  // are listed in `replicated`; numbered for a checkpoint.
  virtual absl::StatusOr<FsdpModelStateDict> ModelState() = 0;

  // The optimizer's state: "<fqn>/<entry>" entries (exp_avg, exp_avg_sq,
  // momentum_buffer: sharded like their parameter; step: replicated).
  // InvalidArgument for an optimizer whose parameters are not the model's.
  virtual absl::StatusOr<FsdpModelStateDict> OptimizerState(
      const torch::optim::Optimizer& optimizer) = 0;

  // The optimizer's param_groups with their parameters' FQNs and Python's
  // option names (for DCP).
  virtual absl::StatusOr<std::vector<OptimParamGroup>> ParamGroups(
      const torch::optim::Optimizer& optimizer) = 0;

  // Requests every parameter's and buffer's entry for this rank's ranges
  // from `read` (one call) and writes them; everything is checked before
  // anything is written. `source` names the source in errors.
  virtual absl::Status LoadModel(const std::string& source, const ShardedReader& read) = 0;

  // The optimizer entries ("<fqn>/<entry>") among `entries` (what the
  // source holds) requested for this rank's ranges and loaded, all checked
  // first; the optimizer keeps its hyperparameters.
  virtual absl::Status LoadOptimizer(torch::optim::Optimizer& optimizer, const std::string& source,
                                     const std::vector<ShardedEntryInfo>& entries,
                                     const ShardedReader& read) = 0;
};

// FSDP1's: its SHARDED state dict (fsdp_state_dict.h) and sharded optimizer
// state (fsdp_optim_state_dict.h). `model` must outlive the result.
std::unique_ptr<ShardedModel> ShardedModelOf(fsdp::FullyShardedDataParallel& model);

// ModelState() followed by OptimizerState(*optimizer) in one dict (when
// `optimizer` is not null): what a checkpoint of both holds.
absl::StatusOr<FsdpModelStateDict> ModelAndOptimizerState(ShardedModel& model,
                                                          const torch::optim::Optimizer* optimizer);

// LoadOptimizer (when `optimizer` is not null) and then LoadModel: a bad
// optimizer entry leaves both untouched; a bad model entry after a good
// optimizer load leaves the optimizer loaded.
absl::Status LoadShardedModelFrom(ShardedModel& model, torch::optim::Optimizer* optimizer,
                                  const std::string& source,
                                  const std::vector<ShardedEntryInfo>& optim_entries,
                                  const ShardedReader& read);

// The model's entries as LoadModel loads them, but one tensor at a time,
// so that a load adds one tensor's pieces to the rank's memory rather than
// a second copy of its whole shard (a Hugging Face checkpoint into a model
// that barely fits): `read` is first asked for every entry with no ranges
// — a reader then checks names, shapes and dtypes without reading data
// (ReadHfShards does) — and then for each piece's range alone, each copied
// into the shard before the next is read. So a bad name, shape or dtype
// leaves the model untouched, but an error while reading (a damaged file)
// leaves the entries before it loaded. FailedPrecondition for shards still
// on the meta device.
absl::Status LoadModelTensorByTensor(ShardedModel& model, const std::string& source,
                                     const ShardedReader& read);

// LoadModelTensorByTensor with the copying left to `fill`, for a source
// that can write straight into the shard (HfRangeReader: no temporary the
// size of a piece): after the same check, `fill(name, request, range,
// destination)` for each piece of each entry, `destination` being the
// piece's live view (range.numel elements, 1-D; written under NoGradGuard).
using ShardFiller = std::function<absl::Status(const std::string& name, const ShardRequest& entry,
                                               FlatRange range, const torch::Tensor& destination)>;
absl::Status FillModelShards(ShardedModel& model, const std::string& source,
                             const ShardedReader& check, const ShardFiller& fill);

// Loads a checkpoint step directory (checkpoint.h) of either kind, written
// at any world size by either FSDP: a sharded one reads only this rank's
// ranges; a FULL one is found under "<fqn>" (SaveModelCheckpoint of a kFull
// dict) or "model.<fqn>" / "optim.<fqn>.<entry>" (the FULL save of
// fsdp_full_checkpoint.h, the trainer's FULL). With `optimizer`, the
// checkpoint must hold optimizer state for every parameter that has some in
// it; parameters it has none for keep none.
absl::Status LoadShardedModelCheckpoint(ShardedModel& model, torch::optim::Optimizer* optimizer,
                                        const std::string& step_dir);

// A reader over an in-memory SHARDED dict (any world size's pieces; one
// rank's FULL tensors as single pieces): answers requests by resharding
// (sharded_tensor.h: Reshard), naming a missing entry, a wrong global shape
// or a dtype.
ShardedReader DictReader(const ShardedStateDict& state);

}  // namespace state_dict
