#include "trainer/wrap.h"

#include <string>
#include <utility>

#include <torch/types.h>

#include "absl/strings/str_cat.h"
#include "activation_checkpointing/apply_activation_checkpointing.h"
#include "comm/device_mesh.h"
#include "module_call/call.h"
#include "module_call/wrap_policy.h"

namespace trainer {
namespace {

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

}  // namespace

absl::StatusOr<std::unique_ptr<fsdp::FullyShardedDataParallel>> WrapModel(
    const Options& o, std::shared_ptr<LanguageModel> model, c10::Device device,
    const comm::ProcessGroup& world) {
  fsdp::FullyShardedDataParallel::Options options;
  options.sharding_strategy = ToStrategy(o.sharding);
  if (o.sharding == Sharding::kHybrid) {
    auto shape = HybridMeshShape(world.size());
    if (!shape.ok()) return shape.status();
    // FSDP keeps the mesh, and with it the groups of its two dimensions.
    auto mesh = comm::init_hybrid_shard_mesh(world, shape->first, shape->second);
    if (!mesh.ok()) return mesh.status();
    options.device_mesh = std::move(*mesh);
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
      const module_call::AutoWrapPolicy size =
          module_call::size_based_auto_wrap_policy(o.auto_wrap_min_params);
      options.auto_wrap_policy = module_call::custom_auto_wrap_policy(
          [size](const torch::nn::Module& module, const std::string& fqn, int64_t numel) {
            return dynamic_cast<const TransformerBlockImpl*>(&module) != nullptr &&
                   size.should_wrap(module, fqn, numel);
          });
      break;
    }
    case AutoWrap::kNone: break;
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
    lm->set_block_runner(
        [](int64_t, TransformerBlock& block, const torch::Tensor& x, const torch::Tensor& mask) {
          return module_call::call(block, x, mask);
        });
  }
  // Typed as LanguageModel (no single forward): the root is entered
  // through run() around Loss().
  return std::make_unique<fsdp::FullyShardedDataParallel>(model, std::move(options));
}

}  // namespace trainer
