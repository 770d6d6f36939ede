#include "state_dict/fully_shard/fully_shard_dcp.h"

#include <vector>

#include "state_dict/dcp.h"
#include "state_dict/fsdp/fsdp_dcp.h"
#include "state_dict/fully_shard/fully_shard_state_dict.h"

namespace state_dict {

absl::Status SaveFullyShardDcpShard(const std::string& dir, torch::nn::Module& model,
                                    const torch::optim::Optimizer* optimizer,
                                    const std::vector<DcpShard::Object>& extra_objects) {
  return SaveShardedModelDcp(dir, *ShardedModelOf(model), optimizer, extra_objects);
}

absl::Status LoadFullyShardDcp(const std::string& dir, torch::nn::Module& model,
                               torch::optim::Optimizer* optimizer) {
  auto ckpt = DcpCheckpoint::Open(dir);
  if (!ckpt.ok()) return ckpt.status();
  return LoadFullyShardDcp(*ckpt, model, optimizer);
}

absl::Status LoadFullyShardDcp(const DcpCheckpoint& ckpt, torch::nn::Module& model,
                               torch::optim::Optimizer* optimizer) {
  return LoadShardedModelDcp(ckpt, *ShardedModelOf(model), optimizer);
}

}  // namespace state_dict
