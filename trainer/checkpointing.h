// The trainer's checkpoints: their layout, save, resume and --async-checkpoint,
// through state_dict/'s FSDP state-dict API. Every function here is called by
// every rank; a failure on one rank stops all of them with a message naming it.
//
// Layout of D/step_<N> (--checkpoint-dir D):
//   --checkpoint-format=sharded (the default): every rank writes its pieces of
//   each original parameter and of its optimizer state (SHARDED model +
//   optimizer state dicts, no gathering) plus "trainer.step" / "trainer.seed"
//   with rank 0's; rank 0 commits once all are durable.
//   --checkpoint-format=full: rank 0 writes one model.pt that Python's
//   torch.load opens ("model.<fqn>", "optim.<fqn>.<entry>", "trainer.step",
//   "trainer.seed"), each tensor gathered onto it just before its record
//   is written (state_dict/fsdp/fsdp_full_checkpoint.h; the model's and the
//   optimizer's keys: state_dict/fsdp/checkpoint_keys.h).
// Either resumes on any world size and strategy (reshard on load), and under
// either --fsdp: the keys are the model's FQNs under FullyShardedDataParallel
// and fully_shard alike (state_dict/fully_shard/), so a run saved under one
// resumes under the other.
//
// PyTorch's distributed checkpoints (DCP, torch.distributed.checkpoint) move
// a run between Python and the trainer: --import-dcp D continues from D,
// --export-dcp D writes D after the last step (state_dict/fsdp/fsdp_dcp.h),
// keyed as Python FSDP / fully_shard save
//   dcp.save({"model": msd, "optim": osd,
//             "trainer": {"step": step, "seed": seed}}, checkpoint_id=D)
// ("model.<fqn>", "optim.state.<fqn>.<entry>", "optim.param_groups.<i>.<opt>",
// "trainer.step" and "trainer.seed" python ints); tools/trainer_mirror.py is
// the trainer's model, data and schedule in Python that reads and writes them.
// DCP is an import/export format, not a checkpoint format (no checksums,
// state_dict/dcp.h): --checkpoint-dir's checkpoints stay the trainer's own.
//
// The batch
// of a step is a function of (seed, step) and the model has no randomness in
// training (no dropout), so model + optimizer + step is everything a resumed
// run needs to continue the exact loss sequence.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include <torch/optim/optimizer.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/process_group.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "state_dict/async_checkpoint.h"
#include "trainer/options.h"
#include "trainer/run_lock.h"
#include "trainer/wrap.h"

namespace trainer {

// --checkpoint-dir before anything is built: every rank checks that it can
// create and write the directory, then rank 0 takes its lock (run_lock.h),
// printing a line when it takes a stale one over. Returns rank 0's lock
// (null on the other ranks and without --checkpoint-dir), held until
// destroyed. Every rank stops when one fails.
absl::StatusOr<std::unique_ptr<DirectoryLock>> PrepareCheckpointDir(
    const Options& options, const comm::ProcessGroup& group);

// The step training continues after. With --resume: the step of the
// checkpoint (options.resume_from, else ChooseResumeCheckpoint's), whose
// model and optimizer state are loaded into `model` and `optimizer`.
// Without: once --checkpoint-dir is known to hold no checkpoint
// (checkpoints are never overwritten; caught now rather than at the first
// save, after minutes of training), --import-dcp's step (ImportDcp), else 0.
// A restarted rank that finds a checkpoint resumes from it (options.resume
// set by trainer_main), not from --import-dcp, which is older.
absl::StatusOr<int64_t> ResumeTrainer(const Options& options, const comm::ProcessGroup& group,
                                      TrainedModel model, torch::optim::Optimizer& optimizer);

// --import-dcp: loads the DCP directory's model and optimizer state into
// `model` and `optimizer` (each rank reads only the chunks it needs; any
// world size and layout it was saved with) and returns its "trainer.step",
// the step training continues after. Errors name --import-dcp and the
// directory: no such directory or no `.metadata` (NotFound), no
// "trainer.step" / "trainer.seed" int, a seed other than --seed, a step not
// below --steps, optimizer state of another --optimizer (InvalidArgument),
// a damaged directory or entries that do not fit the model (what
// state_dict says). DCP has no checksums: flipped bytes inside a tensor
// load as they are.
// Every rank stops when one fails.
absl::StatusOr<int64_t> ImportDcp(const Options& options, const comm::ProcessGroup& group,
                                  TrainedModel model, torch::optim::Optimizer& optimizer);

// --export-dcp, before training: AlreadyExists when the directory already
// holds a DCP checkpoint (a `.metadata`), so that a run is not lost at its
// end; DCP has no commit protocol to overwrite one safely.
// --hf-checkpoint: the checkpoint's weights straight into this rank's shards
// (each rank reads only its ranges of each tensor from the files, one
// tensor at a time), strict: every parameter and buffer of the model must be
// in the checkpoint with its shape, and the checkpoint may hold nothing
// else. Collective only in that every rank loads; errors agreed on by all
// ranks.
absl::Status LoadHfIntoShards(const Options& options, const comm::ProcessGroup& group,
                              TrainedModel model);

// --export-hf: refused at start when the directory exists and is not a
// previous export (which the export replaces), so a run is not trained to be
// lost at its end. Every rank returns the same status.
absl::Status CheckHfExportTarget(const Options& options, const comm::ProcessGroup& group);

// --export-hf after the last step: the model as a Hugging Face checkpoint
// (--export-hf-dtype, files of at most --export-hf-max-shard-bytes,
// `config_json` as its config.json), rank 0 writing each tensor as the
// others send it their pieces; never a model with NaN or Inf parameters.
absl::Status ExportHf(const Options& options, const comm::ProcessGroup& group, TrainedModel model,
                      const torch::optim::Optimizer& optimizer, const std::string& config_json);

absl::Status CheckDcpExportTarget(const Options& options, const comm::ProcessGroup& group);

// --export-dcp, after the last step `step`: every rank writes its shard
// (state_dict::SaveFsdpDcpShard, with "trainer.step" and "trainer.seed" as
// python ints), then, once all have, rank 0 writes `.metadata`
// (state_dict::CommitDcpCheckpoint), which makes the directory a checkpoint.
absl::Status ExportDcp(const Options& options, const comm::ProcessGroup& group, TrainedModel model,
                       const torch::optim::Optimizer& optimizer, int64_t step);

// The checkpoint to resume from, chosen once for the job: rank 0 takes the
// newest under `dir` that verifies, setting damaged newer ones aside with a
// message on stderr naming each, where it went and why
// (state_dict::RecoverLatestCheckpoint); the other ranks wait for it and
// then find the same one. Empty when there is none.
absl::StatusOr<std::optional<std::string>> ChooseResumeCheckpoint(const std::string& dir,
                                                                  const comm::ProcessGroup& group);

// --async-checkpoint: the save in flight; `step` is 0 when there is none.
// Every rank records the step and takes part in finishing it (a FULL save:
// rank 0 writes, the others send it their pieces). The optimizer may change
// the state only after saver.WaitUntilWritten().
struct AsyncSave {
  state_dict::AsyncCheckpointer saver;
  int64_t step = 0;
  // FULL: the group the background save sends its tensors to rank 0 over
  // (made at the first save), so that they never interleave with the
  // training's collectives on the main group.
  std::optional<comm::ProcessGroup> transfer_group;
};

// Writes the checkpoint of `step` in --checkpoint-format; a sharded one is
// committed (made visible) by rank 0 once every rank's pieces are durable,
// then --keep-last applies. With `async` (--async-checkpoint), the previous
// async save is finished first, and this one is started on the live state and
// finished later (FinishAsyncSave).
absl::Status SaveTrainerCheckpoint(const Options& options, TrainedModel model,
                                   const torch::optim::Optimizer& optimizer,
                                   const comm::ProcessGroup& group, int64_t step, AsyncSave* async);

// Finishes the async save in flight, if any: every rank's result agreed on
// (a background failure surfaces here, on every rank), then the commit.
// With `block` false it only polls: one all-reduce, and nothing more unless
// every rank's write has finished.
absl::Status FinishAsyncSave(const Options& options, const comm::ProcessGroup& group,
                             AsyncSave& async, bool block);

}  // namespace trainer
