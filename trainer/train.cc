#include "trainer/train.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>

#include <torch/types.h>  // first: clip_grad.h uses torch::Tensor unincluded
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/collectives.h"
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

// Parameters + gradients + optimizer state this rank holds. Without FSDP
// every rank holds all of it.
absl::StatusOr<int64_t> StateBytes(const torch::nn::Module& model,
                                   const torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  for (const auto& p : model.parameters()) {
    bytes += TensorBytes(p) + TensorBytes(p.grad());
  }
  auto state = state_dict::ExportOptimizerState(optimizer);
  if (!state.ok()) return state.status();
  for (const auto& [key, entries] : state->state) {
    for (const auto& entry : entries) bytes += TensorBytes(entry.value());
  }
  return bytes;
}

absl::StatusOr<state_dict::TensorDict> CheckpointState(
    const torch::nn::Module& model, const torch::optim::Optimizer& optimizer,
    int64_t step, uint64_t seed) {
  state_dict::TensorDict out;
  for (const auto& item : state_dict::ModuleStateDict(model)) {
    out.insert(kModelPrefix + item.key(), item.value());
  }
  auto names = state_dict::OptimizerParamNames(model, optimizer);
  if (!names.ok()) return names.status();
  auto exported = state_dict::ExportOptimizerState(optimizer);
  if (!exported.ok()) return exported.status();
  auto by_name = state_dict::RekeyOptimStateDict(
      *exported, state_dict::OptimStateKeyType::kParamName, *names);
  if (!by_name.ok()) return by_name.status();
  for (const auto& [key, entries] : by_name->state) {
    for (const auto& entry : entries) {
      out.insert(absl::StrCat(kOptimPrefix, std::get<std::string>(key), ".",
                              entry.key()),
                 entry.value());
    }
  }
  out.insert(kStepKey, torch::tensor({step}, torch::kInt64));
  out.insert(kSeedKey, torch::tensor({static_cast<int64_t>(seed)}, torch::kInt64));
  return out;
}

// Loads the newest checkpoint under `dir` into model and optimizer; returns
// its step.
absl::StatusOr<int64_t> Resume(const std::string& dir, const Options& o,
                               torch::nn::Module& model,
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
    auto names = state_dict::OptimizerParamNames(model, optimizer);
    if (!names.ok()) return names.status();
    // The current (fresh) optimizer supplies the groups and hyperparameters;
    // the checkpoint supplies the per-parameter state.
    auto current = state_dict::ExportOptimizerState(optimizer);
    if (!current.ok()) return current.status();
    auto named = state_dict::RekeyOptimStateDict(
        *current, state_dict::OptimStateKeyType::kParamName, *names);
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
    // In the optimizer's parameter order, as Python's state dicts are.
    for (const std::string& name : *names) {
      auto it = per_param.find(name);
      if (it == per_param.end()) continue;
      optim_state.state.emplace_back(name, std::move(it->second));
      per_param.erase(it);
    }
    if (!per_param.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint '", *step_dir, "' has optimizer state for '",
          per_param.begin()->first, "', which the model has no parameter of"));
    }
    auto by_id = state_dict::RekeyOptimStateDict(
        optim_state, state_dict::OptimStateKeyType::kParamId, *names);
    if (!by_id.ok()) return by_id.status();
    optim_state = std::move(*by_id);
  }
  if (auto s = state_dict::LoadModuleStateDict(model, model_state); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("checkpoint '", *step_dir,
                                               "' (model): ", s.message()));
  }
  if (auto s = state_dict::ImportOptimizerState(optimizer, optim_state); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("checkpoint '", *step_dir,
                                               "' (optimizer): ", s.message()));
  }
  return step->item<int64_t>();
}

// Averages the gradients over the group with one all-reduce of their
// concatenation (one collective per step instead of one per parameter).
void AllReduceGradients(const comm::ProcessGroup& group,
                        const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : params) grads.push_back(p.grad().reshape({-1}));
  torch::Tensor flat = torch::cat(grads);
  comm::all_reduce(group, flat, comm::ReduceOp::kAvg).wait();
  int64_t offset = 0;
  for (const auto& p : params) {
    const int64_t n = p.numel();
    p.grad().copy_(flat.narrow(0, offset, n).view_as(p));
    offset += n;
  }
}

// Per-rank values of `local`, in rank order (just `local` on one process).
std::vector<std::vector<int64_t>> GatherPerRank(const comm::ProcessGroup* group,
                                                const std::vector<int64_t>& local) {
  const int world = group != nullptr ? group->size() : 1;
  std::vector<std::vector<int64_t>> out(local.size(), std::vector<int64_t>(world));
  if (group == nullptr) {
    for (size_t k = 0; k < local.size(); ++k) out[k][0] = local[k];
    return out;
  }
  const int64_t n = static_cast<int64_t>(local.size());
  torch::Tensor mine = torch::tensor(local, torch::kInt64);
  torch::Tensor all = torch::empty({world * n}, torch::kInt64);
  comm::all_gather_into_tensor(*group, all, mine).wait();
  const int64_t* data = all.data_ptr<int64_t>();
  for (int r = 0; r < world; ++r) {
    for (int64_t k = 0; k < n; ++k) out[k][r] = data[r * n + k];
  }
  return out;
}

}  // namespace

absl::StatusOr<TrainResult> Train(const Options& o, const comm::ProcessGroup* group) {
  const int world = group != nullptr ? group->size() : 1;
  const int rank = group != nullptr ? group->rank() : 0;
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
  const std::vector<torch::Tensor> params = model->parameters();
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
    auto step = Resume(o.checkpoint_dir, o, *model, *optimizer);
    if (!step.ok()) return step.status();
    result.first_step = *step + 1;
  }

  int64_t num_params = 0;
  for (const auto& p : params) num_params += p.numel();
  JsonLogWriter log;
  if (is_main) {
    std::printf("trainer: %s, %lld parameters, %s data%s, %d rank%s, global batch %lld%s, "
                "steps %lld-%lld\n",
                Name(o.model), static_cast<long long>(num_params), Name(o.data),
                o.data == DataKind::kText
                    ? absl::StrCat(" (", corpus.size(), " bytes of ", kLicenseDir, ")").c_str()
                    : "",
                world, world == 1 ? "" : "s (data parallel)",
                static_cast<long long>(o.global_batch),
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
    double local_loss = 0;
    for (const torch::Tensor& micro : batch->chunk(o.grad_accum, 0)) {
      torch::Tensor loss = model->Loss(micro) / static_cast<double>(o.grad_accum);
      loss.backward();
      local_loss += loss.item<double>();
    }
    double global_loss = local_loss;
    if (group != nullptr) {
      AllReduceGradients(*group, params);
      torch::Tensor l = torch::tensor({local_loss}, torch::kFloat64);
      comm::all_reduce(*group, l, comm::ReduceOp::kAvg).wait();
      global_loss = l.item<double>();
    }
    if (o.clip > 0) torch::nn::utils::clip_grad_norm_(params, o.clip);
    optimizer->step();
    const double step_time =
        std::chrono::duration<double>(Clock::now() - step_start).count();
    result.losses.push_back(global_loss);
    total_tokens += static_cast<double>(tokens_per_step);

    auto state_bytes = StateBytes(*model, *optimizer);
    if (!state_bytes.ok()) return state_bytes.status();
    const auto per_rank = GatherPerRank(group, {PeakRssBytes(), *state_bytes});
    if (is_main) {
      const double tokens_per_s = static_cast<double>(tokens_per_step) / step_time;
      StepRecord record{step, global_loss, lr, step_time, tokens_per_s, per_rank[0],
                        per_rank[1]};
      if (!o.log_json.empty()) {
        if (auto s = log.Write(record); !s.ok()) return s;
      }
      progress.Update(step, global_loss, tokens_per_s,
                      std::chrono::duration<double>(Clock::now() - run_start).count());
    }

    const bool checkpoint_now =
        !o.checkpoint_dir.empty() &&
        ((o.checkpoint_every > 0 && step % o.checkpoint_every == 0) || step == o.steps);
    if (checkpoint_now) {
      absl::Status saved;
      if (is_main) {
        auto state = CheckpointState(*model, *optimizer, step,
                                     static_cast<uint64_t>(o.seed));
        saved = state.ok() ? state_dict::SaveFullCheckpoint(o.checkpoint_dir, step, *state)
                           : state.status();
        if (!saved.ok()) {
          saved = absl::Status(saved.code(), absl::StrCat("--checkpoint-dir='", o.checkpoint_dir,
                                                          "' step ", step, ": ", saved.message()));
        }
      }
      // Instead of a bare barrier, every rank learns whether the save worked,
      // so all stop with a message rather than the others dying in their next
      // collective when rank 0 exits.
      if (group != nullptr) {
        torch::Tensor failed = torch::tensor({saved.ok() ? int64_t{0} : int64_t{1}});
        comm::all_reduce(*group, failed, comm::ReduceOp::kMax).wait();
        if (saved.ok() && failed.item<int64_t>() != 0) {
          return absl::AbortedError(absl::StrCat(
              "the checkpoint of step ", step, " failed on rank 0 (see its message)"));
        }
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
