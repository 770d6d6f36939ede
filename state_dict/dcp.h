// PyTorch's distributed checkpoints (torch.distributed.checkpoint, "DCP"),
// read and written, so that a run moves between Python and C++.
//
// A DCP directory as Python's FileSystemWriter writes it:
//
//   <dir>/.metadata         a pickle of DCP's Metadata: every key's shape,
//                           dtype and chunks (boxes), and where each is
//   <dir>/__<rank>_0.distcp one per rank: each tensor chunk a torch.save
//                           archive, each other value torch.save's bytes
//
// Keys are the nested state dict's, flattened with dots: Python FSDP's
// SHARDED_STATE_DICT and FSDP2 (`fully_shard` with get_state_dict) saved as
// dcp.save({"model": ..., "optim": ...}) give "model.<fqn>",
// "optim.state.<fqn>.<entry>" and "optim.param_groups.<i>.<option>".
//
//   // Python: dcp.save({"model": msd, "optim": osd}, checkpoint_id="/ckpt/py")
//   auto ckpt = state_dict::DcpCheckpoint::Open("/ckpt/py");
//   auto mine = ckpt->LoadResharded({{"model.0.weight", request}});  // any world size
//
//   // The other way: every rank, then one rank after a barrier.
//   SaveDcpShard("/ckpt/cpp", rank, shard);
//   CommitDcpCheckpoint("/ckpt/cpp", world_size);
//   // Python: dcp.load(sd, checkpoint_id="/ckpt/cpp"), or
//   //         dcp_to_torch_save("/ckpt/cpp", "full.pt")
//
// DCP is an import/export format here, not a second checkpoint format: it
// has no checksums (a flipped byte loads silently, in Python too) and no
// commit protocol beyond writing `.metadata` last, so training checkpoints
// stay in checkpoint.h's format and fsdp_dcp.h moves FSDP state in and out.
//
// Reading trusts nothing in the directory: `.metadata` is read by the strict
// pickle VM allowing only DCP's metadata classes (no code runs, as Python's
// weights_only load), every chunk must lie inside its tensor and its bytes
// inside a file of the directory (no path leaves it), and each item is a
// torch.save archive read with the same checks as LoadTensorDict. Errors
// name the directory and the key.
//
// Writing: each rank's file and `.metadata` are written atomically
// (temporary name, fsync, rename); `.metadata` last, so a directory without
// it is an interrupted save that nothing loads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <ATen/core/ivalue.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "state_dict/sharded_tensor.h"

namespace formats {
struct DcpMetadata;  // formats/dcp/dcp_metadata.h
}  // namespace formats

namespace state_dict {

// A DCP directory, its `.metadata` read and checked.
class DcpCheckpoint {
 public:
  // NotFound when `dir` has no `.metadata`; DataLoss for one that is not
  // DCP metadata this build reads (the error says what).
  static absl::StatusOr<DcpCheckpoint> Open(const std::string& dir);

  struct TensorInfo {
    std::string key;
    std::vector<int64_t> shape;
    c10::ScalarType dtype;
  };
  // The tensor entries, in the checkpoint's order.
  std::vector<TensorInfo> tensors() const;
  // The keys of the other (pickled) values, in order.
  std::vector<std::string> objects() const;

  // LoadResharded (checkpoint.h) for DCP: each requested key's requested
  // flat ranges, filled from whichever chunks cover them (only those chunks
  // are read). Errors: an unknown key, a shape or dtype other than the
  // request's, a range no chunk covers, chunks that overlap with different
  // values, an unreadable item.
  absl::StatusOr<ShardedStateDict> LoadResharded(
      const std::vector<std::pair<std::string, ShardRequest>>& requests) const;

  // One saved chunk of a tensor (DCP's ChunkStorageMetadata and where its
  // bytes are): the box [offsets, offsets + sizes) of the tensor, stored as
  // a torch.save archive at bytes [offset, offset + length) of `file`
  // (relative to the directory).
  struct ChunkInfo {
    std::vector<int64_t> offsets;
    std::vector<int64_t> sizes;
    std::string file;
    uint64_t offset = 0;
    uint64_t length = 0;
  };
  // The chunks tensor `key` was saved as, in the metadata's order (what
  // `ckpt inspect` lists). NotFound for an unknown key, InvalidArgument for
  // an object's key.
  absl::StatusOr<std::vector<ChunkInfo>> Chunks(const std::string& key) const;

  // Tensor `key` whole, of its shape and dtype: LoadResharded of its full
  // range, so every chunk is read and the chunks must cover every element
  // (DataLoss naming the key and the first element none covers), each
  // chunk's bytes must be inside its file (a truncated or missing file:
  // DataLoss / NotFound naming it). dcp_to_torch_save's value of the key.
  absl::StatusOr<at::Tensor> LoadTensor(const std::string& key) const;

  // A pickled value (a param group option, a step counter): what Python's
  // torch.load of its bytes gives, read as LoadIValue reads.
  absl::StatusOr<c10::IValue> LoadObject(const std::string& key) const;

  const std::string& dir() const { return dir_; }

 private:
  DcpCheckpoint(std::string dir, std::shared_ptr<const formats::DcpMetadata> metadata)
      : dir_(std::move(dir)), metadata_(std::move(metadata)) {}
  std::string dir_;
  std::shared_ptr<const formats::DcpMetadata> metadata_;
};

// A key's place in the nested state dict Python's DCP rebuilds (its
// planner_data): {"optim", "param_groups", 0, "lr"}. The flattened key is
// the parts joined with dots.
using DcpKeyPath = std::vector<std::variant<std::string, int64_t>>;

// The flattened key of `path` ("optim.param_groups.0.lr"), as the metadata
// and DcpCheckpoint name it.
std::string FlatKey(const DcpKeyPath& path);

// What one rank saves.
struct DcpShard {
  struct Tensor {
    DcpKeyPath path;
    ShardedTensor tensor;  // this rank's pieces (may be none)
  };
  struct Object {
    DcpKeyPath path;
    c10::IValue value;  // str, int, float, bool, None, tuples and lists of them
  };
  std::vector<Tensor> tensors;
  std::vector<Object> objects;
};

// Writes rank `rank`'s file (`__<rank>_0.distcp`) and a record of its items
// for CommitDcpCheckpoint. Each piece goes in as the boxes (DCP chunks) its
// flat range covers — a range cutting rows becomes a partial row, whole
// rows and a partial row — each a torch.save archive of that box. Every
// rank should list every tensor, with no pieces where it holds none, so
// that shapes and dtypes agree.
absl::Status SaveDcpShard(const std::string& dir, int rank, const DcpShard& shard);

// After every rank's SaveDcpShard returned: checks every rank's record is
// there and they agree on each tensor's shape and dtype and cover it, then
// writes `.metadata` (which makes the directory a checkpoint) and removes
// the records.
absl::Status CommitDcpCheckpoint(const std::string& dir, int world_size);

}  // namespace state_dict
