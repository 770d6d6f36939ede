#include "trainer/wrap.h"

#include <functional>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>

#include <torch/types.h>

#include "absl/strings/str_cat.h"
#include "activation_checkpointing/apply_activation_checkpointing.h"
#include "comm/device_mesh.h"
#include "functorch/module/named_member_accessor.h"
#include "module_call/call.h"
#include "module_call/wrap_policy.h"
#include "state_dict/fully_shard/fully_shard_state_dict.h"
#include "trainer/float8_linears.h"

namespace trainer {
namespace {

// --sharding=hybrid's 2-D mesh (replicas x shards) over `world`; both FSDPs
// keep it, and with it the groups of its two dimensions.
absl::StatusOr<comm::DeviceMesh> HybridMesh(const comm::ProcessGroup& world) {
  auto shape = HybridMeshShape(world.size());
  if (!shape.ok()) return shape.status();
  return comm::init_hybrid_shard_mesh(world, shape->first, shape->second);
}

// The model's decoder layers (CausalLM::DecoderLayers), whatever its type:
// what --auto-wrap and --activation-checkpointing take. A layer is called
// only through module_call::call, the one place a unit or region can act.
// `min_params` > 0 (--auto-wrap size:N): only layers of at least that many
// parameters not taken by a deeper unit.
module_call::AutoWrapPolicy LayerPolicy(LanguageModel& model, int64_t min_params = 0) {
  std::set<const torch::nn::Module*> layers;
  for (const auto& layer : model.DecoderLayers()) layers.insert(layer.get());
  return module_call::custom_auto_wrap_policy(
      [layers, min_params](const torch::nn::Module& module, const std::string&, int64_t numel) {
        return layers.count(&module) != 0 && numel >= min_params;
      });
}

// --activation-checkpointing=block, for both FSDPs: marks the blocks;
// module_call::call (the block runner) then runs each one as a checkpointed
// region, its unit gathered again for the recomputation in backward. The
// last block too, although its backward runs right after the loss: leaving
// it unmarked (1/8 less recompute on trainer_bench) kept the same allocated
// peak but raised the 2-rank peak RSS (seq 512: FULL_SHARD 538 -> 557-568
// MiB, SHARD_GRAD_OP 604-607 -> 612 MiB), the allocator's layout being what
// changed.
absl::Status CheckpointBlocks(const Options& o, const std::shared_ptr<LanguageModel>& model) {
  if (o.activation_checkpointing != ActivationCheckpointing::kBlock) return absl::OkStatus();
  const auto blocks =
      activation_checkpointing::apply_activation_checkpointing(model, LayerPolicy(*model));
  if (blocks.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--activation-checkpointing=block: the ", Name(o.model),
                     " model has no decoder layers to checkpoint: use --model=transformer or "
                     "llama, or --activation-checkpointing=none"));
  }
  return absl::OkStatus();
}

fsdp::ShardingStrategy ToStrategy(Sharding s) {
  switch (s) {
    case Sharding::kFull: return fsdp::ShardingStrategy::kFullShard;
    case Sharding::kGradOp: return fsdp::ShardingStrategy::kShardGradOp;
    case Sharding::kNone: return fsdp::ShardingStrategy::kNoShard;
    case Sharding::kHybrid: return fsdp::ShardingStrategy::kHybridShard;
  }
  return fsdp::ShardingStrategy::kFullShard;
}

// FSDP1's Options::param_init_fn for a model built on the meta device
// (--model llama): each unit's parameters are allocated, uninitialised, on
// the CPU just before FSDP flattens and shards the unit, so a rank holds at
// most one unit whole; the caller then fills the shards (LoadHfIntoShards,
// or the config's initial values). A tensor tied under two names (a tied
// lm_head) becomes one tensor again.
std::function<void(torch::nn::Module&)> AllocateMetaParameters() {
  // Old meta tensor (kept alive, so its address stays its own) -> new one.
  auto allocated = std::make_shared<
      std::unordered_map<const c10::TensorImpl*, std::pair<at::Tensor, at::Tensor>>>();
  return [allocated](torch::nn::Module& module) {
    functorch::NamedMemberAccessor accessor(module.shared_from_this());
    for (const auto& item : module.named_parameters(/*recurse=*/false)) {
      const at::Tensor& meta = item.value();
      if (!meta.defined() || !meta.is_meta()) continue;
      auto [it, fresh] = allocated->try_emplace(meta.unsafeGetTensorImpl());
      if (fresh) {
        it->second = {meta, torch::empty(meta.sizes(), meta.options().device(torch::kCPU))
                                .set_requires_grad(meta.requires_grad())};
      }
      accessor.set_tensor(item.key(), it->second.second);
    }
  };
}

bool HasMetaParameters(const torch::nn::Module& model) {
  for (const auto& p : model.parameters()) {
    if (p.is_meta()) return true;
  }
  return false;
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
  if (o.fsdp == FsdpApi::kFullyShard) {
    // A caller that knows only FSDP1 (Wrap dispatches --fsdp): refused, never
    // trained under FSDP1 in silence.
    return absl::UnimplementedError(
        "--fsdp=fully_shard: this caller wraps with FullyShardedDataParallel only (WrapModel); "
        "it must build the model with trainer::Wrap to train under fully_shard: use "
        "--fsdp=fsdp1");
  }
  fsdp::FullyShardedDataParallel::Options options;
  options.sharding_strategy = ToStrategy(o.sharding);
  if (o.sharding == Sharding::kHybrid) {
    auto mesh = HybridMesh(world);
    if (!mesh.ok()) return mesh.status();
    options.device_mesh = std::move(*mesh);
  } else {
    options.process_group = world;
  }
  // A unit must be called through module_call::call, and the decoder layers
  // are the submodules called that way: wrapping, say, a layer's q_proj would
  // make the layer's own forward() read q_proj's 1-D shard. --auto-wrap
  // size:N is PyTorch's size_based_auto_wrap_policy limited to them; a model
  // without layers (the MLP) is the root unit alone.
  switch (o.auto_wrap) {
    case AutoWrap::kBlock: options.auto_wrap_policy = LayerPolicy(*model); break;
    case AutoWrap::kSize:
      options.auto_wrap_policy = LayerPolicy(*model, o.auto_wrap_min_params);
      break;
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
  if (HasMetaParameters(*model)) options.param_init_fn = AllocateMetaParameters();
  // Built on the CPU (or meta); FSDP moves each unit there before sharding it.
  if (!device.is_cpu()) options.device_id = device;
  // The optimizer sees the original parameters (views of this rank's
  // shard), so Adam/AdamW/SGD run unmodified per parameter and their state
  // is keyed by the model's own FQNs (checkpoints, OptimizerParamNames).
  options.use_orig_params = true;

  if (auto status = CheckpointBlocks(o, model); !status.ok()) return status;
  // Typed as LanguageModel (no single forward): the root is entered
  // through run() around Loss().
  return std::make_unique<fsdp::FullyShardedDataParallel>(model, std::move(options));
}

FullyShardModel::FullyShardModel(std::shared_ptr<LanguageModel> model, fsdp::FSDPModule root,
                                 std::vector<std::string> unit_names)
    : model_(std::move(model)), root_(std::move(root)), unit_names_(std::move(unit_names)) {}

torch::Tensor FullyShardModel::run(const std::function<torch::Tensor()>& fn) {
  module_call::ForwardCall call(*model_);
  return call.finish(fn());
}

FullyShardModel::NoSyncGuard::NoSyncGuard(fsdp::FSDPModule root) : root_(std::move(root)) {
  root_.set_requires_gradient_sync(false);
}

FullyShardModel::NoSyncGuard::~NoSyncGuard() { root_.set_requires_gradient_sync(true); }

FullyShardModel::NoSyncGuard FullyShardModel::no_sync() { return NoSyncGuard(root_); }

torch::Tensor FullyShardModel::clip_grad_norm_(double max_norm) {
  std::vector<torch::Tensor> trainable;
  for (const auto& p : model_->parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  return fsdp::clip_grad_norm_(trainable, max_norm);
}

std::vector<torch::Tensor> FullyShardModel::parameters() const { return model_->parameters(); }

absl::StatusOr<std::unique_ptr<FullyShardModel>> WrapModelFullyShard(
    const Options& o, std::shared_ptr<LanguageModel> model, c10::Device device,
    const comm::ProcessGroup& world) {
  // CheckFeatureAvailability refused what fully_shard does not do here
  // (--sharding none, --backward-prefetch=post).
  fsdp::FullyShardOptions options;
  if (o.sharding == Sharding::kHybrid) {
    // HSDP: fully_shard on the same 2-D mesh (replicas x shards) as FSDP1's.
    auto mesh = HybridMesh(world);
    if (!mesh.ok()) return mesh.status();
    options.mesh = std::move(*mesh);
  } else {
    options.process_group = world;
  }
  // full and hybrid: the blocks reshard after forward (FULL_SHARD,
  // HYBRID_SHARD); grad_op: every unit keeps its gathered parameters from
  // forward to backward (SHARD_GRAD_OP). The root's options are set below.
  options.reshard_after_forward = o.sharding != Sharding::kGradOp;
  if (o.mixed_precision == MixedPrecision::kBf16) {
    options.mp_policy.param_dtype = torch::kBFloat16;
    options.mp_policy.reduce_dtype = torch::kFloat32;
  }
  // PyTorch's CPUOffloadPolicy: the shards, their gradients and the
  // optimizer state on the CPU, computing on `device`.
  if (o.cpu_offload) options.offload_policy = fsdp::CPUOffloadPolicy{};
  // --float8-all-gather: the converted projections' weights (train.cc
  // converted them before wrapping), gathered as float8.
  if (o.float8_all_gather) options.float8_all_gather_fn = Float8ConvertedWeights(*model);
  // A model built on the meta device (too large for one rank: train.cc) is
  // sharded first and then allocated, shards only (to_empty, below).
  bool on_meta = false;
  for (const auto& p : model->parameters()) on_meta |= p.is_meta();
  if (!device.is_cpu() && !on_meta) model->to(device);
  if (auto status = CheckpointBlocks(o, model); !status.ok()) return status;
  std::vector<std::string> unit_names;
  std::vector<fsdp::FSDPModule> blocks;
  // Each decoder layer --auto-wrap picks becomes a unit, named by its FQN.
  std::map<const torch::nn::Module*, std::string> names;
  for (const auto& item : model->named_modules()) names[item.value().get()] = item.key();
  for (const std::shared_ptr<torch::nn::Module>& layer : model->DecoderLayers()) {
    int64_t numel = 0;
    for (const auto& p : layer->parameters()) numel += p.numel();
    const bool wrap = o.auto_wrap == AutoWrap::kBlock ||
                      (o.auto_wrap == AutoWrap::kSize && numel >= o.auto_wrap_min_params);
    if (!wrap) continue;
    blocks.push_back(fsdp::fully_shard(layer, options));
    unit_names.push_back(names[layer.get()]);
  }
  // The root under full and hybrid: reshard_after_forward unset, PyTorch's
  // default (None): the root keeps its parameters after forward, since
  // backward needs them at once (as FSDP1's FULL_SHARD root unit, which is
  // not resharded after forward), saving one all-gather per step. grad_op
  // keeps them anyway (false).
  fsdp::FullyShardOptions root_options = options;
  if (o.sharding != Sharding::kGradOp) root_options.reshard_after_forward.reset();
  fsdp::FSDPModule root =
      fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(model), root_options);
  // Each rank's shards, uninitialised: the caller fills them (a checkpoint's
  // or the model's initial values, LoadFullyShardFrom).
  if (on_meta) fsdp::to_empty(*model, device);
  unit_names.insert(unit_names.begin(), "");
  if (o.backward_prefetch == BackwardPrefetch::kPre) {
    // Backward runs the blocks last to first: each prefetches the one
    // before it (PyTorch's BACKWARD_PRE).
    for (size_t i = 1; i < blocks.size(); ++i)
      blocks[i].set_modules_to_backward_prefetch({blocks[i - 1]});
  }
  return std::make_unique<FullyShardModel>(std::move(model), std::move(root),
                                           std::move(unit_names));
}

absl::StatusOr<WrappedModel> Wrap(const Options& o, std::shared_ptr<LanguageModel> model,
                                  c10::Device device, const comm::ProcessGroup& world) {
  WrappedModel out;
  if (o.fsdp == FsdpApi::kFullyShard) {
    auto wrapped = WrapModelFullyShard(o, std::move(model), device, world);
    if (!wrapped.ok()) return wrapped.status();
    out.fully_shard = std::move(*wrapped);
  } else {
    auto wrapped = WrapModel(o, std::move(model), device, world);
    if (!wrapped.ok()) return wrapped.status();
    out.fsdp1 = std::move(*wrapped);
  }
  return out;
}

torch::Tensor TrainedModel::run(const std::function<torch::Tensor()>& fn) const {
  if (fsdp1_ != nullptr) return fsdp1_->run([&] { return fn(); });
  return fully_shard_->run(fn);
}

TrainedModel::NoSyncGuard::NoSyncGuard(const TrainedModel& model) {
  if (model.fsdp1() != nullptr) {
    fsdp1_.emplace(model.fsdp1()->no_sync());
  } else {
    fully_shard_.emplace(model.fully_shard()->root());
  }
}

torch::Tensor TrainedModel::clip_grad_norm_(double max_norm) const {
  return fsdp1_ != nullptr ? fsdp1_->clip_grad_norm_(max_norm)
                           : fully_shard_->clip_grad_norm_(max_norm);
}

std::vector<torch::Tensor> TrainedModel::parameters() const {
  return fsdp1_ != nullptr ? fsdp1_->parameters() : fully_shard_->parameters();
}

std::vector<std::string> TrainedModel::fsdp_unit_names() const {
  return fsdp1_ != nullptr ? fsdp1_->fsdp_unit_names() : fully_shard_->fsdp_unit_names();
}

std::unique_ptr<state_dict::ShardedModel> TrainedModel::shards() const {
  if (fsdp1_ != nullptr) return state_dict::ShardedModelOf(*fsdp1_);
  return state_dict::ShardedModelOf(fully_shard_->module());
}

}  // namespace trainer
