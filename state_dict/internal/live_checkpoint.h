// Checkpoint saves of live tensors (for AsyncCheckpointer's saves without a
// snapshot) and the checkpoint code's test hooks.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "formats/torch_save/tensor_dict_io.h"
#include "state_dict/checkpoint.h"

namespace state_dict {
namespace internal {
// SaveFullCheckpoint and SaveShard of live tensors (LiveTensors:
// formats/torch_save/tensor_dict_io.h). For AsyncCheckpointer.
absl::Status SaveFullCheckpoint(const std::string& root, int64_t step, const TensorDict& state,
                                const formats::LiveTensors* live);
absl::Status SaveShard(const std::string& root, int64_t step, int rank, int world_size,
                       const ShardedStateDict& shard, const formats::LiveTensors* live);

// Test hook: called after each file of a save is durably in place, with its
// path. Lets a test kill a process between two files of one checkpoint.
void SetAfterFileWrittenHookForTesting(std::function<void(const std::string&)> hook);
// Test hook: called by PruneCheckpoints before each rename, unlink and rmdir,
// with the path it is about to change. Lets a test kill a removal midway.
void SetBeforeRemoveHookForTesting(std::function<void(const std::string&)> hook);
}  // namespace internal
}  // namespace state_dict
