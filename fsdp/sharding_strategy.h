// How an FSDP unit spreads its flat parameter over ranks (PyTorch's
// ShardingStrategy), and the two facts a handle needs from it: whether it
// shards at all, and when the gathered parameter is freed again.
#pragma once

namespace fsdp {

enum class ShardingStrategy {
  // Shard parameters, gradients and optimizer state; free the gathered
  // parameter after forward and gather it again for backward (ZeRO-3).
  kFullShard,
  // Keep the gathered parameter from forward until after backward (ZeRO-2):
  // one all-gather per iteration instead of two, at the cost of memory.
  kShardGradOp,
  // No sharding (DDP-like): every rank keeps the whole flat parameter and
  // gradients are all-reduced.
  kNoShard,
  // kFullShard within the shard group (a node), replicated across the
  // replicate group: reduce-scatter within, then all-reduce across.
  kHybridShard,
  // kShardGradOp within the shard group, replicated across the replicate
  // group (PyTorch's _HYBRID_SHARD_ZERO2).
  kHybridShardZero2,
};

// "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
// "_HYBRID_SHARD_ZERO2" (PyTorch's spelling, for messages).
const char* sharding_strategy_name(ShardingStrategy strategy);

// False only for kNoShard.
bool uses_sharding(ShardingStrategy strategy);

// kHybridShard and kHybridShardZero2: gradients also cross a replicate group.
bool is_hybrid(ShardingStrategy strategy);

// True when the runtime should free the gathered parameter right after the
// unit's forward (kFullShard, kHybridShard); otherwise it stays gathered
// until after backward (kShardGradOp, kHybridShardZero2) or, for kNoShard,
// there is nothing to free.
bool reshard_after_forward(ShardingStrategy strategy);

}  // namespace fsdp
