// Fuzz harnesses for state_dict's loaders of untrusted checkpoints (its own
// step directories and torch.distributed.checkpoint directories), shared by
// the libFuzzer targets (tools/fuzz.sh builds them with clang) and by
// //state_dict/fuzz:corpus_replay_test, which replays the committed corpus
// and regressions through the same functions under Bazel. The file formats'
// harnesses (torch_file, safetensors) are in formats/fuzz/harness.h.
//
// Each Run* function feeds one input to the loaders and checks an oracle
// beyond "no crash". A loader may reject an input (that is the point), but
// the loaders must agree with each other; on a disagreement the function
// prints both results and calls abort(), which libFuzzer records as a crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace state_dict {
namespace fuzz {

// Which file of the template checkpoint an input replaces, and whether
// checksums are fixed up so that the input reaches the checks behind them:
// for a rank file, the MANIFEST's size and checksum of it; for the MANIFEST,
// its own checksum.
struct CheckpointInputLayout {
  static constexpr int kFiles = 3;  // MANIFEST, rank_00000.pt, rank_00001.pt
  int file = 0;                     // first byte % 3
  bool fix_file_checksum = false;   // (first byte / 3) % 2
};
CheckpointInputLayout DecodeCheckpointSelector(uint8_t first_byte);

// The input's first byte selects a file of a template sharded checkpoint
// (2 ranks, small tensors of several dtypes; made once per process with
// SaveShardedCheckpoint), the rest of the input replaces that file; then
// VerifyCheckpoint, LoadFullStateDict, LoadResharded (every tensor whole) and
// LoadLocalShard (rank 0 of 2) run on the directory.
// Oracle: verify OK <=> convert OK (the full state dict saved as one file
// and loaded back bitwise equal, as `ckpt convert` does); verify OK => every
// load OK, and the full and resharded loads give
// bitwise equal tensors; verify fails => the full load fails, and so does the
// resharded load unless the file verify rejects is one that no whole-tensor
// request needs to read (a file holding no data pieces).
void RunCheckpointInput(const uint8_t* data, size_t size);

// The files of the template DCP directory an input of RunDcpInput can
// replace, by selector (first byte % kDcpFiles).
constexpr int kDcpFiles = 3;  // .metadata, __0_0.distcp, __1_0.distcp

// The input's first byte selects a file of a template torch.distributed.
// checkpoint directory (2 ranks written with SaveDcpShard and
// CommitDcpCheckpoint: flat pieces cutting rows, a 0-dim tensor, a bf16
// tensor, an empty tensor, a pickled float and tuple; made once per process),
// the rest of the input replaces that file; then DcpCheckpoint::Open, and
// when it opens, for every tensor LoadResharded of the whole tensor (one
// request of [0, numel)) and of each half as a request of its own, and
// LoadObject of every object.
// Oracle: the whole load succeeds exactly when both halves do (they read the
// same chunks), and then the halves concatenated equal the whole bitwise;
// when the input leaves the template's bytes unchanged, everything opens and
// loads and equals the template's tensors (bitwise) and objects. Memory stays
// bounded by the files' sizes (libFuzzer's -rss_limit_mb catches the rest).
void RunDcpInput(const uint8_t* data, size_t size);

// Writes the project-made seeds: the template checkpoint's files into
// `checkpoint_dir` and the template DCP directory's files into `dcp_dir`
// (each prefixed by its selector byte). The directories must exist. The
// torch_file target's seeds: formats/fuzz/harness.h.
absl::Status WriteProjectSeeds(const std::string& checkpoint_dir, const std::string& dcp_dir);

}  // namespace fuzz
}  // namespace state_dict
