#include "trainer/train.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <torch/types.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/collectives.h"
#include "comm/device_mesh.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/wrap_policy.h"
#include "state_dict/checkpoint.h"
#include "state_dict/module_state.h"
#include "state_dict/optim_state.h"
#include "trainer/data.h"
#include "trainer/json_log.h"
#include "trainer/lr_schedule.h"
#include "trainer/models.h"
#include "trainer/progress.h"

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kModelPrefix[] = "model.";
constexpr char kOptimPrefix[] = "optim.";
constexpr char kStepKey[] = "trainer.step";
constexpr char kSeedKey[] = "trainer.seed";

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(
    const Options& o, std::vector<torch::Tensor> params) {
  switch (o.optimizer) {
    case OptimizerKind::kAdam:
      return std::make_unique<torch::optim::Adam>(
          std::move(params), torch::optim::AdamOptions(o.lr));
    case OptimizerKind::kAdamW:
      return std::make_unique<torch::optim::AdamW>(
          std::move(params), torch::optim::AdamWOptions(o.lr).weight_decay(0.01));
    case OptimizerKind::kSgd:
      return std::make_unique<torch::optim::SGD>(
          std::move(params), torch::optim::SGDOptions(o.lr).momentum(0.9));
  }
  return nullptr;
}

int64_t TensorBytes(const torch::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.numel() * t.element_size()) : 0;
}

// Where one original parameter lives in FSDP's flat parameters: its unit's
// handle and its FlatParamInfo (offsets in the flat parameter and in this
// rank's shard).
struct ParamPlace {
  const fsdp::FlatParamHandle* handle = nullptr;
  const fsdp::FlatParamInfo* info = nullptr;
};

// What Train builds around the model: the wrapper, the optimizer's
// parameter names (use_orig_params: the original FQNs, in optimizer order),
// each name's place in the flat parameters, and the group the flat
// parameters are sharded over.
struct Wrapped {
  std::shared_ptr<LanguageModel> model;
  std::unique_ptr<fsdp::FullyShardedDataParallel> fsdp;
  std::vector<std::string> param_names;
  std::map<std::string, ParamPlace> places;
  const comm::ProcessGroup* shard_group = nullptr;  // points into Train's locals
};

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

// Parameters + gradients + optimizer state this rank holds. With
// use_orig_params the optimizer's parameters are views of this rank's
// shard, so this counts the shard (padding excluded), its gradient and the
// optimizer state of those elements only.
absl::StatusOr<int64_t> StateBytes(const std::vector<torch::Tensor>& params,
                                   const torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  for (const auto& p : params) {
    bytes += TensorBytes(p) + TensorBytes(p.grad());
  }
  auto state = state_dict::ExportOptimizerState(optimizer);
  if (!state.ok()) return state.status();
  for (const auto& [key, entries] : state->state) {
    for (const auto& entry : entries) bytes += TensorBytes(entry.value());
  }
  return bytes;
}

// The optimizer's per-element state entries (shaped like the parameter, so
// sharded like it); everything else in a parameter's state (Adam's "step")
// is a scalar every rank holding state agrees on.
std::vector<std::string> ShardedStateKeys(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      return {"exp_avg", "exp_avg_sq"};
    case OptimizerKind::kSgd:
      return {"momentum_buffer"};
  }
  return {};
}

// The optimizer state of every original parameter, FULL (its original
// shape), name-keyed: each rank holds only the elements of its shard, so each
// sharded entry is put at the parameter's place in a shard-sized buffer and
// all-gathered over the shard group (one collective per handle and entry).
// Every rank must call it. A rank holding none of a parameter (or no state
// for it) contributes zeros; "step" is the maximum over ranks.
absl::StatusOr<std::map<std::string, state_dict::TensorDict>> FullOptimizerState(
    const Options& o, const Wrapped& w, const torch::optim::Optimizer& optimizer,
    const comm::ProcessGroup& world) {
  auto exported = state_dict::ExportOptimizerState(optimizer);
  if (!exported.ok()) return exported.status();
  std::map<std::string, const state_dict::TensorDict*> local;
  for (const auto& [key, entries] : exported->state) {
    const int64_t id = std::get<int64_t>(key);
    local[w.param_names.at(static_cast<size_t>(id))] = &entries;
  }
  const std::vector<std::string> keys = ShardedStateKeys(o.optimizer);
  const bool has_step = o.optimizer != OptimizerKind::kSgd;
  // An entry this code does not know how to consolidate (e.g. AMSGrad's
  // max_exp_avg_sq, if the optimizer options ever enable it) must not be
  // dropped from the checkpoint. The optimizer is the same on every rank,
  // so every rank returns here alike, before any collective.
  for (const auto& [name, entries] : local) {
    for (const auto& entry : *entries) {
      if (entry.key() == "step" && has_step) continue;
      if (std::find(keys.begin(), keys.end(), entry.key()) != keys.end()) continue;
      return absl::UnimplementedError(absl::StrCat(
          "checkpoint: optimizer state entry '", name, ".", entry.key(), "' of --optimizer=",
          Name(o.optimizer), " cannot be consolidated from FSDP shards"));
    }
  }
  // Which parameters have state anywhere, and the step: one all-reduce.
  const int64_t n = static_cast<int64_t>(w.param_names.size());
  torch::Tensor meta = torch::zeros({2 * n}, torch::kInt64);
  for (int64_t i = 0; i < n; ++i) {
    auto it = local.find(w.param_names[static_cast<size_t>(i)]);
    if (it == local.end()) continue;
    meta[i] = 1;
    if (has_step) {
      const torch::Tensor* step = it->second->find("step");
      if (step != nullptr) meta[n + i] = static_cast<int64_t>(step->item<double>());
    }
  }
  comm::all_reduce(world, meta, comm::ReduceOp::kMax).wait();

  std::map<std::string, state_dict::TensorDict> full;
  // Per handle and entry: the gathered flat state (padded_numel elements).
  std::map<std::pair<const fsdp::FlatParamHandle*, std::string>, torch::Tensor> gathered;
  for (int64_t i = 0; i < n; ++i) {
    const std::string& name = w.param_names[static_cast<size_t>(i)];
    if (meta[i].item<int64_t>() == 0) continue;
    auto place_it = w.places.find(name);
    if (place_it == w.places.end()) {
      return absl::InternalError(absl::StrCat("optimizer parameter '", name,
                                              "' is in no FSDP handle"));
    }
    const ParamPlace& place = place_it->second;
    const fsdp::FlatParamInfo& info = *place.info;
    state_dict::TensorDict entries;
    for (const std::string& key : keys) {
      auto slot = std::make_pair(place.handle, key);
      auto g = gathered.find(slot);
      if (g == gathered.end()) {
        // Build this handle's shard-sized buffer from all its parameters'
        // local state, then gather it: every rank visits handles and keys in
        // the same order (parameter order), so the collectives match.
        const int64_t shard_numel = place.handle->shard_numel();
        torch::Tensor buffer = torch::zeros({shard_numel}, torch::kFloat32);
        for (const fsdp::FlatParamInfo& other : place.handle->param_infos()) {
          if (other.numel_in_shard == 0) continue;
          for (const auto& [other_name, other_place] : w.places) {
            if (other_place.info != &other) continue;
            auto st = local.find(other_name);
            if (st == local.end()) break;
            const torch::Tensor* value = st->second->find(key);
            if (value == nullptr) break;
            buffer.narrow(0, other.offset_in_shard, other.numel_in_shard)
                .copy_(value->reshape({-1}));
            break;
          }
        }
        const int64_t parts = place.handle->shard_world_size();
        torch::Tensor flat = buffer;
        if (parts > 1) {
          flat = torch::empty({parts * shard_numel}, torch::kFloat32);
          comm::all_gather_into_tensor(*w.shard_group, flat, buffer).wait();
        }
        g = gathered.emplace(slot, flat).first;
      }
      entries.insert(key, g->second.narrow(0, info.offset, info.numel)
                              .reshape(info.shape)
                              .clone());
    }
    if (has_step) {
      entries.insert("step", torch::tensor(static_cast<double>(meta[n + i].item<int64_t>()),
                                           torch::kFloat32));
    }
    full.emplace(name, std::move(entries));
  }
  return full;
}

absl::StatusOr<state_dict::TensorDict> CheckpointState(
    const Options& o, const Wrapped& w, const torch::optim::Optimizer& optimizer,
    const comm::ProcessGroup& world, int64_t step, uint64_t seed) {
  state_dict::TensorDict out;
  {
    // The FULL model: every rank gathers (summon is collective), rank 0
    // writes. Cloned so the file is written after the guard frees them.
    auto guard = w.fsdp->summon_full_params({/*writeback=*/false});
    for (const auto& item : state_dict::ModuleStateDict(*w.model)) {
      out.insert(kModelPrefix + item.key(), item.value().detach().clone());
    }
  }
  auto full = FullOptimizerState(o, w, optimizer, world);
  if (!full.ok()) return full.status();
  for (const auto& [name, entries] : *full) {
    for (const auto& entry : entries) {
      out.insert(absl::StrCat(kOptimPrefix, name, ".", entry.key()), entry.value());
    }
  }
  out.insert(kStepKey, torch::tensor({step}, torch::kInt64));
  out.insert(kSeedKey, torch::tensor({static_cast<int64_t>(seed)}, torch::kInt64));
  return out;
}

// Loads the newest checkpoint under `dir` into model and optimizer; returns
// its step. Every rank reads the FULL file: the model through
// summon_full_params(writeback) (each rank keeps its shard of it), the
// optimizer state by cutting each rank's elements out of the full entries
// (offset_in_param / numel_in_shard), so the world size need not match the
// one that saved.
absl::StatusOr<int64_t> Resume(const std::string& dir, const Options& o, const Wrapped& w,
                               torch::optim::Optimizer& optimizer) {
  auto step_dir = state_dict::LatestCheckpoint(dir);
  if (!step_dir.ok()) {
    return absl::NotFoundError(absl::StrCat("--resume: no complete checkpoint in --checkpoint-dir='",
                                            dir, "': ", step_dir.status().message()));
  }
  auto saved = state_dict::LoadFullStateDict(*step_dir);
  if (!saved.ok()) return saved.status();
  const torch::Tensor* step = saved->find(kStepKey);
  const torch::Tensor* seed = saved->find(kSeedKey);
  if (step == nullptr || seed == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint '", *step_dir, "' lacks ", kStepKey, "/", kSeedKey,
        ": expected a checkpoint written by the trainer"));
  }
  if (seed->item<int64_t>() != o.seed) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--seed=", o.seed, ": the checkpoint '", *step_dir, "' was trained with --seed=",
        seed->item<int64_t>(), "; resume with the same seed to continue its run"));
  }

  state_dict::TensorDict model_state;
  state_dict::OptimStateDict optim_state;
  {
    // The current (fresh) optimizer supplies the groups and hyperparameters;
    // the checkpoint supplies the per-parameter state.
    auto current = state_dict::ExportOptimizerState(optimizer);
    if (!current.ok()) return current.status();
    auto named = state_dict::RekeyOptimStateDict(
        *current, state_dict::OptimStateKeyType::kParamName, w.param_names);
    if (!named.ok()) return named.status();
    optim_state = std::move(*named);
    optim_state.state.clear();
    std::map<std::string, state_dict::TensorDict> per_param;
    for (const auto& item : *saved) {
      std::string key = item.key();
      if (absl::StartsWith(key, kModelPrefix)) {
        model_state.insert(key.substr(sizeof(kModelPrefix) - 1), item.value());
      } else if (absl::StartsWith(key, kOptimPrefix)) {
        // "optim.<fqn>.<entry>": entry names have no dots, FQNs do.
        const std::string rest = key.substr(sizeof(kOptimPrefix) - 1);
        const size_t dot = rest.rfind('.');
        if (dot == std::string::npos) {
          return absl::InvalidArgumentError(
              absl::StrCat("checkpoint '", *step_dir, "': malformed key '", key, "'"));
        }
        per_param[rest.substr(0, dot)].insert(rest.substr(dot + 1), item.value());
      }
    }
    const std::vector<std::string> sharded = ShardedStateKeys(o.optimizer);
    // In the optimizer's parameter order, as Python's state dicts are; each
    // per-element entry cut down to this rank's elements of the parameter.
    for (const std::string& name : w.param_names) {
      auto it = per_param.find(name);
      if (it == per_param.end()) continue;
      const fsdp::FlatParamInfo& info = *w.places.at(name).info;
      state_dict::TensorDict mine;
      for (const auto& entry : it->second) {
        torch::Tensor value = entry.value();
        if (std::find(sharded.begin(), sharded.end(), entry.key()) != sharded.end()) {
          if (value.numel() != info.numel) {
            return absl::InvalidArgumentError(absl::StrCat(
                "checkpoint '", *step_dir, "': optimizer state '", name, ".", entry.key(),
                "' has ", value.numel(), " elements; the model's parameter has ", info.numel));
          }
          value = value.reshape({-1}).narrow(0, info.offset_in_param, info.numel_in_shard).clone();
        }
        mine.insert(entry.key(), value);
      }
      optim_state.state.emplace_back(name, std::move(mine));
      per_param.erase(it);
    }
    if (!per_param.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint '", *step_dir, "' has optimizer state for '",
          per_param.begin()->first, "', which the model has no parameter of"));
    }
    auto by_id = state_dict::RekeyOptimStateDict(
        optim_state, state_dict::OptimStateKeyType::kParamId, w.param_names);
    if (!by_id.ok()) return by_id.status();
    optim_state = std::move(*by_id);
  }
  {
    auto guard = w.fsdp->summon_full_params({/*writeback=*/true});
    if (auto s = state_dict::LoadModuleStateDict(*w.model, model_state); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("checkpoint '", *step_dir,
                                                 "' (model): ", s.message()));
    }
  }
  if (auto s = state_dict::ImportOptimizerState(optimizer, optim_state); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("checkpoint '", *step_dir,
                                               "' (optimizer): ", s.message()));
  }
  return step->item<int64_t>();
}

// Wraps the model per the FSDP flags. `mesh` / `hybrid` receive the 2-D
// mesh and its groups for --sharding=hybrid (they must outlive the result).
absl::StatusOr<Wrapped> WrapModel(const Options& o, std::shared_ptr<LanguageModel> model,
                                  const comm::ProcessGroup& world,
                                  c10::optional<comm::DeviceMesh>* mesh,
                                  c10::optional<comm::HybridShardGroups>* hybrid) {
  Wrapped w;
  w.model = model;
  fsdp::FullyShardedDataParallel::Options options;
  options.sharding_strategy = ToStrategy(o.sharding);
  w.shard_group = &world;
  if (o.sharding == Sharding::kHybrid) {
    auto shape = HybridMeshShape(world.size());
    if (!shape.ok()) return shape.status();
    auto m = comm::init_hybrid_shard_mesh(world, shape->first, shape->second);
    if (!m.ok()) return m.status();
    *mesh = std::move(*m);
    auto groups = comm::hybrid_shard_groups(**mesh);
    if (!groups.ok()) return groups.status();
    *hybrid = std::move(*groups);
    options.device_mesh = **mesh;
    w.shard_group = &(*hybrid)->shard;
  } else {
    options.process_group = world;
  }
  switch (o.auto_wrap) {
    case AutoWrap::kBlock:
      // The MLP has no blocks: the policy finds nothing and the root is the
      // only unit.
      options.auto_wrap_policy = fsdp::module_type_auto_wrap_policy<TransformerBlockImpl>();
      break;
    case AutoWrap::kSize: {
      // size_based_auto_wrap_policy, limited to the blocks: a unit must be
      // called through fsdp::call, and the blocks (TransformerLM's block
      // runner) are the only submodules called that way. Wrapping, say, a
      // block's fc1 would make the block's own forward() read fc1's 1-D
      // shard. Below the threshold a block stays in the root unit; the MLP
      // has no blocks, so it is always the root unit alone.
      const fsdp::AutoWrapPolicy size = fsdp::size_based_auto_wrap_policy(o.auto_wrap_min_params);
      options.auto_wrap_policy = fsdp::custom_auto_wrap_policy(
          [size](const torch::nn::Module& module, const std::string& fqn, int64_t numel) {
            return dynamic_cast<const TransformerBlockImpl*>(&module) != nullptr &&
                   size.should_wrap(module, fqn, numel);
          });
      break;
    }
    case AutoWrap::kNone:
      break;
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
  // The optimizer sees the original parameters (views of this rank's
  // shard), so Adam/AdamW/SGD run unmodified per parameter and their state
  // is keyed by the model's own FQNs (checkpoints, OptimizerParamNames).
  options.use_orig_params = true;

  if (auto* lm = dynamic_cast<TransformerLM*>(model.get())) {
    // Every block call goes through the runner: fsdp::call gathers a
    // wrapped block before and reshards it after (a plain forward when the
    // block is not a unit, e.g. --auto-wrap=none).
    lm->set_block_runner([](int64_t, TransformerBlock& block, const torch::Tensor& x,
                            const torch::Tensor& mask) { return fsdp::call(block, x, mask); });
  }
  // Typed as LanguageModel (no single forward): the root is entered
  // through run() around Loss().
  w.fsdp = std::make_unique<fsdp::FullyShardedDataParallel>(model, std::move(options));

  std::unordered_map<const void*, std::string> name_of;
  for (const auto& item : w.fsdp->named_parameters()) {
    name_of[item.value().unsafeGetTensorImpl()] = item.key();
  }
  for (const torch::Tensor& p : w.fsdp->parameters()) {
    auto it = name_of.find(p.unsafeGetTensorImpl());
    if (it == name_of.end()) {
      return absl::InternalError("an FSDP parameter is missing from named_parameters()");
    }
    w.param_names.push_back(it->second);
  }
  const auto units = w.fsdp->fsdp_unit_names();
  const auto handles = w.fsdp->handles();
  for (size_t u = 0; u < handles.size(); ++u) {
    if (handles[u] == nullptr) continue;
    for (const fsdp::FlatParamInfo& info : handles[u]->param_infos()) {
      const std::string name = units[u].empty() ? info.fqn : absl::StrCat(units[u], ".", info.fqn);
      w.places[name] = ParamPlace{handles[u], &info};
    }
  }
  for (const std::string& name : w.param_names) {
    if (w.places.count(name) == 0) {
      return absl::InternalError(absl::StrCat(
          "parameter '", name, "' is in no FSDP handle (ignored parameters are not used)"));
    }
  }
  return w;
}

// Per-rank values of `local`, in rank order.
std::vector<std::vector<int64_t>> GatherPerRank(const comm::ProcessGroup& group,
                                                const std::vector<int64_t>& local) {
  const int world = group.size();
  std::vector<std::vector<int64_t>> out(local.size(), std::vector<int64_t>(world));
  const int64_t n = static_cast<int64_t>(local.size());
  torch::Tensor mine = torch::tensor(local, torch::kInt64);
  torch::Tensor all = torch::empty({world * n}, torch::kInt64);
  comm::all_gather_into_tensor(group, all, mine).wait();
  const int64_t* data = all.data_ptr<int64_t>();
  for (int r = 0; r < world; ++r) {
    for (int64_t k = 0; k < n; ++k) out[k][r] = data[r * n + k];
  }
  return out;
}

}  // namespace

absl::StatusOr<TrainResult> Train(const Options& o, const comm::ProcessGroup& group) {
  const int world = group.size();
  const int rank = group.rank();
  const bool is_main = rank == 0;
  if (auto s = CheckFeatureAvailability(o, world); !s.ok()) return s;

  std::vector<uint8_t> corpus;
  if (o.data == DataKind::kText) {
    auto loaded = LoadTextCorpus();
    if (!loaded.ok()) return loaded.status();
    corpus = std::move(*loaded);
  }

  const ModelConfig config{o.layers, o.dim, o.heads, o.vocab, o.seq};
  std::shared_ptr<LanguageModel> model = BuildModel(
      o.model == ModelKind::kMlp ? ModelType::kMlp : ModelType::kTransformer,
      config, static_cast<uint64_t>(o.seed));
  int64_t num_params = 0;
  for (const auto& p : model->parameters()) num_params += p.numel();

  c10::optional<comm::DeviceMesh> mesh;
  c10::optional<comm::HybridShardGroups> hybrid;
  auto wrapped = WrapModel(o, model, group, &mesh, &hybrid);
  if (!wrapped.ok()) return wrapped.status();
  Wrapped& w = *wrapped;
  fsdp::FullyShardedDataParallel& fsdp_model = *w.fsdp;
  const std::vector<torch::Tensor> params = fsdp_model.parameters();
  std::unique_ptr<torch::optim::Optimizer> optimizer = MakeOptimizer(o, params);

  TrainResult result;
  if (!o.resume && !o.checkpoint_dir.empty()) {
    // Caught now rather than at the first save, after minutes of training:
    // checkpoints are never overwritten.
    auto existing = state_dict::LatestCheckpoint(o.checkpoint_dir);
    if (existing.ok()) {
      return absl::AlreadyExistsError(absl::StrCat(
          "--checkpoint-dir='", o.checkpoint_dir, "' already holds a checkpoint (",
          *existing, "): pass --resume to continue that run, or use an empty directory"));
    }
  }
  if (o.resume) {
    auto step = Resume(o.checkpoint_dir, o, w, *optimizer);
    if (!step.ok()) return step.status();
    result.first_step = *step + 1;
  }

  JsonLogWriter log;
  if (is_main) {
    std::string layout = absl::StrCat(world, world == 1 ? " rank" : " ranks", ", FSDP ",
                                      Name(o.sharding));
    if (o.sharding == Sharding::kHybrid) {
      auto shape = HybridMeshShape(world);
      if (shape.ok()) absl::StrAppend(&layout, " (", shape->first, " replicas x ", shape->second, " shards)");
    }
    absl::StrAppend(&layout, ", ", fsdp_model.fsdp_unit_names().size(), " unit",
                    fsdp_model.fsdp_unit_names().size() == 1 ? "" : "s", " (auto-wrap ",
                    AutoWrapName(o), ")");
    if (o.mixed_precision == MixedPrecision::kBf16) absl::StrAppend(&layout, ", bf16");
    if (o.cpu_offload) absl::StrAppend(&layout, ", cpu offload");
    std::printf("trainer: %s, %lld parameters, %s data%s, %s, global batch %lld%s, "
                "steps %lld-%lld\n",
                Name(o.model), static_cast<long long>(num_params), Name(o.data),
                o.data == DataKind::kText
                    ? absl::StrCat(" (", corpus.size(), " bytes of ", kLicenseDir, ")").c_str()
                    : "",
                layout.c_str(), static_cast<long long>(o.global_batch),
                o.grad_accum > 1 ? absl::StrCat(" in ", o.grad_accum, " micro-batches").c_str() : "",
                static_cast<long long>(result.first_step), static_cast<long long>(o.steps));
    std::fflush(stdout);
    if (!o.log_json.empty()) {
      if (auto s = log.Open(o.log_json, /*append=*/o.resume); !s.ok()) return s;
    }
  }
  ProgressBar progress(result.first_step, o.steps, stdout,
                       is_main && isatty(fileno(stdout)) != 0);

  const int64_t tokens_per_step = o.global_batch * o.seq;
  const Clock::time_point run_start = Clock::now();
  double total_tokens = 0;
  for (int64_t step = result.first_step; step <= o.steps; ++step) {
    const Clock::time_point step_start = Clock::now();
    const double lr = LearningRate(o, step);
    for (auto& param_group : optimizer->param_groups()) {
      param_group.options().set_lr(lr);
    }
    optimizer->zero_grad();

    BatchSpec spec{static_cast<uint64_t>(o.seed), step, o.global_batch, o.seq + 1,
                   rank, world};
    auto batch = o.data == DataKind::kText ? SampleTextBatch(corpus, spec)
                                           : SampleSyntheticBatch(o.vocab, spec);
    if (!batch.ok()) return batch.status();

    // Micro-batches of equal size: scaling each mean loss by 1/K makes the
    // accumulated gradient the gradient of the mean over the rank's rows.
    // The first K-1 backwards run under no_sync (gradients accumulate
    // unreduced); the last one reduces the sum, averaged over ranks by FSDP.
    double local_loss = 0;
    const std::vector<torch::Tensor> micros = batch->chunk(o.grad_accum, 0);
    for (size_t m = 0; m < micros.size(); ++m) {
      const torch::Tensor& micro = micros[m];
      auto forward_backward = [&] {
        torch::Tensor loss =
            fsdp_model.run([&] { return model->Loss(micro); }) / static_cast<double>(o.grad_accum);
        loss.backward();
        local_loss += loss.item<double>();
      };
      if (m + 1 < micros.size()) {
        auto no_sync = fsdp_model.no_sync();
        forward_backward();
      } else {
        forward_backward();
      }
    }
    torch::Tensor l = torch::tensor({local_loss}, torch::kFloat64);
    comm::all_reduce(group, l, comm::ReduceOp::kAvg).wait();
    const double global_loss = l.item<double>();
    // The norm over all ranks' shards (an all-reduce inside).
    if (o.clip > 0) fsdp_model.clip_grad_norm_(o.clip);
    optimizer->step();
    const double step_time =
        std::chrono::duration<double>(Clock::now() - step_start).count();
    result.losses.push_back(global_loss);
    total_tokens += static_cast<double>(tokens_per_step);

    const double tokens_per_s = static_cast<double>(tokens_per_step) / step_time;
    // Only the JSON log needs the per-rank figures: without it, no extra
    // collective per step. Every rank has the same options, so all agree.
    if (!o.log_json.empty()) {
      auto state_bytes = StateBytes(params, *optimizer);
      if (!state_bytes.ok()) return state_bytes.status();
      const auto per_rank = GatherPerRank(group, {PeakRssBytes(), *state_bytes});
      if (is_main) {
        StepRecord record{step, global_loss, lr, step_time, tokens_per_s, per_rank[0],
                          per_rank[1]};
        if (auto s = log.Write(record); !s.ok()) return s;
      }
    }
    if (is_main) {
      progress.Update(step, global_loss, tokens_per_s,
                      std::chrono::duration<double>(Clock::now() - run_start).count());
    }

    const bool checkpoint_now =
        !o.checkpoint_dir.empty() &&
        ((o.checkpoint_every > 0 && step % o.checkpoint_every == 0) || step == o.steps);
    if (checkpoint_now) {
      // Gathering is collective: every rank builds the FULL state, rank 0
      // writes it.
      auto state = CheckpointState(o, w, *optimizer, group, step,
                                   static_cast<uint64_t>(o.seed));
      absl::Status saved = state.status();
      if (is_main && state.ok()) {
        saved = state_dict::SaveFullCheckpoint(o.checkpoint_dir, step, *state);
      }
      if (!saved.ok()) {
        saved = absl::Status(saved.code(), absl::StrCat("--checkpoint-dir='", o.checkpoint_dir,
                                                        "' step ", step, ": ", saved.message()));
      }
      // Instead of a bare barrier, every rank learns whether the save worked,
      // so all stop with a message rather than the others dying in their next
      // collective when rank 0 exits.
      torch::Tensor failed = torch::tensor({saved.ok() ? int64_t{0} : int64_t{1}});
      comm::all_reduce(group, failed, comm::ReduceOp::kMax).wait();
      if (saved.ok() && failed.item<int64_t>() != 0) {
        return absl::AbortedError(absl::StrCat(
            "the checkpoint of step ", step, " failed on rank 0 (see its message)"));
      }
      if (!saved.ok()) return saved;
    }
  }
  if (is_main) {
    const double elapsed =
        std::chrono::duration<double>(Clock::now() - run_start).count();
    progress.Finish(elapsed, elapsed > 0 ? total_tokens / elapsed : 0, PeakRssBytes());
  }
  return result;
}

}  // namespace trainer
