// Crash-safe checkpoint directories.
//
//   <root>/step_<N>/MANIFEST          written last (see manifest.h)
//   <root>/step_<N>/model.pt          FULL: one PyTorch-format file
//   <root>/step_<N>/rank_<RRRRR>.pt   SHARDED: one per rank, 1-D pieces
//   <root>/step_<N>/rank_<RRRRR>.meta SHARDED, until the commit only: a
//                                     rank's part of the manifest
//
// Every file is written under a temporary name, fsynced, renamed and its
// directory fsynced; the MANIFEST comes last. A step directory without a
// complete MANIFEST is an interrupted save: LatestCheckpoint skips it, so a
// crash at any moment leaves the previous checkpoint the one that loads.
//
// Loading checks everything before returning anything — the MANIFEST's own
// checksum and format version,
// world size and that every rank's file is present, that the manifest's
// entries are consistent (file names, keys, shapes, dtypes, and every
// tensor's pieces covering it), file sizes and CRC-32C
// checksums, each tensor's dtype, shape and checksum — and errors name the
// file and the tensor. VerifyCheckpoint runs the same checks on every file. Nothing is loaded into
// a model here; the returned dicts go to LoadModuleStateDict (module_state.h) or FSDP, which check
// them against the model before copying.
//
// Loaded tensors share the checkpoint file's pages, copy-on-write (a private
// mapping, as torch.load(mmap=True)): a load reads each byte once, to
// checksum it, and copying the tensors into a model reads the page cache
// directly. Writing a loaded tensor copies only the pages written and never
// reaches the file; removing the checkpoint (PruneCheckpoints) leaves loaded
// tensors valid. Checkpoint files are never written in place (every save
// writes a new file and renames it), which is what makes this sharing safe:
// whoever truncates or rewrites a committed file in place while tensors
// loaded from it live changes them, or crashes their reader with SIGBUS.
// Where a file system cannot map files, loads read into fresh memory.
//
// Sharded saves need no communication: each rank calls SaveShard, then — once
// all ranks returned (the caller's barrier) — one rank calls
// CommitShardedCheckpoint, which gathers the ranks' .meta files into the
// MANIFEST and then removes them (nothing reads them after the commit; the
// MANIFEST records and checksums everything). A sharded checkpoint written by N ranks loads on any
// M ranks through LoadResharded.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "state_dict/manifest.h"
#include "state_dict/sharded_tensor.h"
#include "state_dict/tensor_dict.h"

namespace state_dict {

// "<root>/step_<step>".
std::string StepDirectory(const std::string& root, int64_t step);

// FULL checkpoint: `state` goes to model.pt in PyTorch's format (Python's
// torch.load opens it as a dict with the same names). AlreadyExists when the
// step already has a complete checkpoint (never overwritten in place).
absl::Status SaveFullCheckpoint(const std::string& root, int64_t step, const TensorDict& state);

// The same FULL checkpoint of the tensors `tensors` describes, their data
// produced one at a time by `source` (TensorSpec and TensorSource:
// tensor_dict.h): a save that never holds more than one tensor's data,
// such as state gathered onto one rank tensor by tensor
// (state_dict/fsdp/fsdp_full_checkpoint.h). An error from `source` stops
// the save with nothing committed and is returned as it is.
absl::Status SaveFullCheckpoint(const std::string& root, int64_t step,
                                const std::vector<TensorSpec>& tensors, const TensorSource& source);

// SHARDED checkpoint, one rank's part: writes rank_<rank>.pt (a dict of the
// rank's pieces; a tensor's first piece is keyed by its name, later ones
// "<name>#<k>") and then rank_<rank>.meta. Every rank should list every
// tensor (with no pieces where it holds none) so that shapes and dtypes are
// recorded for all. Only commit when every rank's SaveShard succeeded.
absl::Status SaveShard(const std::string& root, int64_t step, int rank, int world_size,
                       const ShardedStateDict& shard);

// After every rank's SaveShard returned: checks all `world_size` ranks'
// files are there and agree on step, world size and global shapes/dtypes,
// and that the pieces cover every tensor (what a load will check), then writes the MANIFEST, which
// makes the checkpoint visible, and removes the .meta files.
absl::Status CommitShardedCheckpoint(const std::string& root, int64_t step, int world_size);

// SaveShard for every rank in turn, then CommitShardedCheckpoint (one process
// holding all ranks' shards: tests, tools).
absl::Status SaveShardedCheckpoint(const std::string& root, int64_t step,
                                   const std::vector<ShardedStateDict>& shards);

// The complete checkpoint step directories under `root`, by ascending step.
// Directories without a valid MANIFEST are skipped.
absl::StatusOr<std::vector<std::string>> ListCheckpoints(const std::string& root);

// What PruneCheckpoints removed (step directories, by ascending step).
struct PruneReport {
  std::vector<std::string> removed;  // complete checkpoints beyond the newest K
  std::vector<std::string> torn;     // saves and removals a crash interrupted
};

// Keeps the newest `keep_last` complete checkpoints under `root` and removes
// the older ones, together with debris of earlier crashes: step directories
// without a MANIFEST older than the newest complete checkpoint (interrupted
// saves) and "<root>/.removing.*" (interrupted removals). Torn directories
// newer than the newest complete checkpoint are left alone (a save may be
// writing one), as are directories whose MANIFEST is damaged or of a newer
// format (those are errors to look at, not debris).
//
// Crash-safe: a doomed directory is first renamed to
// "<root>/.removing.step_<N>" and the rename made durable, then its files are
// deleted. A kill at any moment leaves the newest complete checkpoint (and
// every other kept one) untouched and loadable, and each doomed one either
// whole or out of ListCheckpoints' sight; the next call finishes the job.
// keep_last < 1 is InvalidArgument (the newest is never removed).
absl::StatusOr<PruneReport> PruneCheckpoints(const std::string& root, int keep_last);

// The step directory of the newest complete checkpoint; NotFound if none.
absl::StatusOr<std::string> LatestCheckpoint(const std::string& root);

// A checkpoint that RecoverLatestCheckpoint moved out of the way.
struct SetAsideCheckpoint {
  std::string step_dir;  // where it was: "<root>/step_<N>"
  std::string moved_to;  // "<root>/.damaged.step_<N>", or ".damaged.step_<N>.<k>"
  absl::Status why;      // what its MANIFEST or VerifyCheckpoint said
};

struct RecoveredCheckpoint {
  std::optional<std::string> step_dir;        // the newest that verifies; none left: empty
  std::vector<SetAsideCheckpoint> set_aside;  // newest first
};

// What a resume starts from: the newest step directory under `root` that
// VerifyCheckpoint accepts (every file read and checksummed). Each newer one
// whose MANIFEST is present but damaged, or whose files fail verification
// (DataLoss, or a missing file), is renamed to "<root>/.damaged.step_<N>"
// (".<k>" appended if that exists) and the rename made durable: nothing
// lists, loads, prunes or overwrites it again, so training continues from
// the good one and can save step N anew, while the damaged files stay for a
// person to look at. Directories without a MANIFEST (interrupted saves) are
// skipped and left for PruneCheckpoints. A root that does not exist (a job
// killed before its first save) has no checkpoint: step_dir is empty.
//
// Stops with an error, moving nothing further, on a MANIFEST of a newer
// format (FailedPrecondition: a newer build's checkpoint is not damage) and
// on I/O errors other than damage (permissions, a vanished root). Reads every
// byte of each checkpoint it tries; call it from one process of a job (the
// others wait, then LatestCheckpoint gives them the same directory).
//
//   auto recovered = RecoverLatestCheckpoint("/ckpt");
//   for (const auto& s : recovered->set_aside) LOG << s.step_dir << ": " << s.why;
absl::StatusOr<RecoveredCheckpoint> RecoverLatestCheckpoint(const std::string& root);

// The parsed MANIFEST of a step directory (NotFound when there is none).
absl::StatusOr<Manifest> ReadManifest(const std::string& step_dir);

// Checks everything any load checks, without a model: the manifest's
// consistency (step matches the directory, ranks 0..world_size-1 each have
// exactly one file named for its rank, keys, shapes and dtypes agree, every
// tensor's pieces cover it) and every file it lists: present,
// size, checksum, each tensor's key, dtype, size and checksum; pieces that
// overlap (replicated tensors) must be identical copies. The loads run
// the same function on the manifest and the same per-file check on each file
// they read, so a checkpoint that verifies loads, and one that a load
// rejects fails verify with the same error.
absl::Status VerifyCheckpoint(const std::string& step_dir);

// The FULL state dict of a checkpoint of either kind (sharded ones are
// assembled from all ranks' pieces), verified.
absl::StatusOr<TensorDict> LoadFullStateDict(const std::string& step_dir);

// Reshard on load: for each requested name (ShardRequest: sharded_tensor.h;
// FlatShardRequests builds them for a flat-parameter shard), the requested
// pieces filled from whichever saved ranks hold them (only those files are
// read, and each is verified first). Errors: an unknown name, a shape or dtype differing
// from the request, a missing rank file, a checksum failure.
absl::StatusOr<ShardedStateDict> LoadResharded(
    const std::string& step_dir, const std::vector<std::pair<std::string, ShardRequest>>& requests);

// LOCAL: the raw contents of rank `rank`'s file (as SaveShard wrote it),
// only if the checkpoint was written by `world_size` ranks.
absl::StatusOr<TensorDict> LoadLocalShard(const std::string& step_dir, int rank, int world_size);

}  // namespace state_dict
