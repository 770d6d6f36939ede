#include "fsdp/fsdp_gpu_check.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "comm/collectives.h"
#include "comm/process_group.h"
#include "comm/testing/world_of_1.h"
#include "fsdp/flat_param.h"
#include "fsdp/fully_shard.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "functorch/module/named_member_accessor.h"
#include "kernels/float8_linear.h"
#include "launcher/launch.h"
#include "module_call/call.h"
#include "module_call/wrap_policy.h"
#include "optim/optimizers.h"
#include "testing/sync_debug_mode.h"
#include "trainer/data.h"
#include "trainer/models.h"

namespace fsdp {
namespace {

using comm::testing::MakeWorldOf1;
using comm::testing::WorldOf1;
using gpu_check::Fail;
using gpu_check::Pass;
using gpu_check::Problems;
using gpu_check::Result;
using gpu_check::SyncDebugScope;

constexpr std::chrono::milliseconds kCollectiveTimeout = std::chrono::minutes(2);
// The argument after kGpuCheckRankArg: which FSDP a re-executed rank runs.
constexpr char kFsdp1Api[] = "fsdp1";
constexpr char kFullyShardApi[] = "fully_shard";

// ---------------------------------------------------------------------------
// The model, its batch, and training it unwrapped or under either FSDP.

// A small decoder-only transformer (trainer/models.h), a few SGD steps with
// momentum. Not Adam: Adam normalises each gradient element by its own
// running RMS, so an element whose true gradient is zero (the attention's
// key bias: softmax ignores a constant shift) moves by +-lr on rounding
// noise alone, and two correct runs that round differently (2 ranks sum
// in another order) end up lr apart there.
const trainer::ModelConfig kModel{/*layers=*/2, /*dim=*/64, /*heads=*/4, /*vocab=*/256,
                                  /*seq=*/32};
constexpr uint64_t kModelSeed = 1234;
constexpr uint64_t kDataSeed = 99;
constexpr int kSteps = 5;
constexpr int64_t kGlobalBatch = 8;
constexpr double kLr = 0.1;
constexpr double kMomentum = 0.9;

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(std::vector<torch::Tensor> params) {
  return std::make_unique<torch::optim::SGD>(std::move(params),
                                             torch::optim::SGDOptions(kLr).momentum(kMomentum));
}

// This rank's rows of the global batch (trainer/data.h: rank r of W takes
// rows [r*B/W, (r+1)*B/W), so the union over ranks is the global batch), as
// int64 tokens [rows, seq + 1]. The same batch every step: the tokens are
// uniformly random, so only a batch seen again can be learned, and a loss
// that falls shows the steps did something.
torch::Tensor Batch(int rank, int world) {
  trainer::BatchSpec spec{kDataSeed, /*step=*/0, kGlobalBatch, kModel.seq + 1, rank, world};
  auto batch = trainer::SampleSyntheticBatch(kModel.vocab, spec);
  TORCH_CHECK(batch.ok(), "gpu_check: SampleSyntheticBatch: ", batch.status().message());
  return *batch;
}

std::shared_ptr<trainer::TransformerLM> BuildTransformer() {
  // Same seed, same parameters: the reference and the wrapped model start equal.
  auto model = std::dynamic_pointer_cast<trainer::TransformerLM>(
      trainer::BuildModel(trainer::ModelType::kTransformer, kModel, kModelSeed));
  TORCH_CHECK(model != nullptr, "gpu_check: BuildModel did not return a TransformerLM");
  return model;
}

using Params = std::map<std::string, torch::Tensor>;

Params Snapshot(const torch::nn::Module& module) {
  Params out;
  for (const auto& item : module.named_parameters()) {
    out[item.key()] = item.value().detach().to(torch::kCPU, torch::kFloat, /*non_blocking=*/false,
                                               /*copy=*/true);
  }
  return out;
}

struct Run {
  std::vector<double> losses;  // global mean loss of each step
  Params params;               // after the last step
};

// The unwrapped model on `device`, the whole global batch every step.
Run TrainUnwrapped(torch::Device device) {
  auto model = BuildTransformer();
  model->to(device);
  auto optim = MakeOptimizer(model->parameters());
  Run run;
  for (int step = 0; step < kSteps; ++step) {
    optim->zero_grad();
    torch::Tensor loss = model->Loss(Batch(0, 1).to(device));
    loss.backward();
    optim->step();
    run.losses.push_back(loss.item<double>());
  }
  run.params = Snapshot(*model);
  return run;
}

struct FsdpVariant {
  bool bf16 = false;         // param_dtype bf16, reduce_dtype (and FSDP1's buffer_dtype) fp32
  bool cpu_offload = false;  // FSDP1's cpu_offload.offload_params; fully_shard's CPUOffloadPolicy
  bool fully_shard = false;  // fsdp::fully_shard (FSDP2) instead of FullyShardedDataParallel
};

// Inspects the optimizer-facing parameters between backward and the step.
using AfterBackward =
    std::function<void(int step, const std::vector<torch::Tensor>& parameters, Problems& problems)>;

// The FSDP checks' blocks run through module_call::call, where their units
// are gathered and resharded.
void RunBlocksThroughCallPoint(trainer::TransformerLM& model) {
  model.set_block_runner(
      [](int64_t, trainer::TransformerBlock& block, const torch::Tensor& x,
         const torch::Tensor& mask) { return module_call::call(block, x, mask); });
}

// The wrapping every FSDP check trains under: FULL_SHARD over `group`, one
// unit per block, device_id cuda:0 (not in a dry run), use_orig_params;
// with `bf16`, bf16 parameters with fp32 reduction and buffers.
fsdp::FullyShardedDataParallel::Options FullShardOptions(const comm::ProcessGroup& group,
                                                         torch::Device device, bool bf16) {
  fsdp::FullyShardedDataParallel::Options options;
  options.process_group = group;
  options.sharding_strategy = fsdp::ShardingStrategy::kFullShard;
  options.auto_wrap_policy =
      module_call::module_type_auto_wrap_policy<trainer::TransformerBlockImpl>();
  if (!device.is_cpu()) options.device_id = device;
  options.use_orig_params = true;
  if (bf16) {
    options.mixed_precision.param_dtype = torch::kBFloat16;
    options.mixed_precision.reduce_dtype = torch::kFloat32;
    options.mixed_precision.buffer_dtype = torch::kFloat32;
  }
  return options;
}

// The transformer on `device` under one of the two FSDPs, as the checks
// train it: FullyShardedDataParallel with FullShardOptions, or fsdp::fully_shard
// (FSDP2) on each block and then the root, over `group`, resharding after
// forward, with `variant`'s mixed precision and offload.
class ShardedTransformer {
 public:
  ShardedTransformer(const comm::ProcessGroup& group, torch::Device device,
                     const FsdpVariant& variant)
      : model_(BuildTransformer()) {
    RunBlocksThroughCallPoint(*model_);
    if (!variant.fully_shard) {
      // Built on the CPU; FSDP moves it to device_id.
      fsdp::FullyShardedDataParallel::Options options =
          FullShardOptions(group, device, variant.bf16);
      options.cpu_offload.offload_params = variant.cpu_offload;
      fsdp1_ = std::make_unique<fsdp::FullyShardedDataParallel>(model_, options);
      return;
    }
    // fully_shard computes where the parameters are when it is applied.
    model_->to(device);
    fsdp::FullyShardOptions options;
    options.process_group = group;
    options.reshard_after_forward = true;
    if (variant.bf16) {
      options.mp_policy.param_dtype = torch::kBFloat16;
      options.mp_policy.reduce_dtype = torch::kFloat32;
    }
    if (variant.cpu_offload) options.offload_policy = fsdp::CPUOffloadPolicy{};
    for (size_t i = 0; i < model_->blocks()->size(); ++i) {
      units_.push_back(fsdp::fully_shard(model_->blocks()->ptr(i), options));
    }
    units_.push_back(
        fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(model_), options));
  }

  trainer::TransformerLM& model() { return *model_; }
  fsdp::FullyShardedDataParallel* fsdp1() { return fsdp1_.get(); }

  // What the optimizer steps on: FSDP1's flat shards (or use_orig_params
  // views), or fully_shard's per-parameter shards.
  std::vector<torch::Tensor> parameters() const {
    return fsdp1_ != nullptr ? fsdp1_->parameters() : model_->parameters();
  }

  // The loss of `batch` through the root's call point.
  torch::Tensor Loss(const torch::Tensor& batch) {
    if (fsdp1_ != nullptr) return fsdp1_->run([&] { return model_->Loss(batch); });
    module_call::ForwardCall call(*model_);
    return call.finish(model_->Loss(batch));
  }

  // The unsharded parameters, by name, as float32 on the CPU.
  Params FullParams() {
    if (fsdp1_ != nullptr) {
      fsdp::SummonOptions summon;
      summon.writeback = false;
      auto full = fsdp1_->summon_full_params(summon);
      return Snapshot(*fsdp1_->module());
    }
    for (fsdp::FSDPModule& unit : units_) unit.unshard();
    Params params = Snapshot(*model_);
    for (fsdp::FSDPModule& unit : units_) unit.reshard();
    return params;
  }

  // How many FSDP units the model has (the root and one per block expected).
  std::vector<std::string> UnitNames() const {
    if (fsdp1_ != nullptr) return fsdp1_->fsdp_unit_names();
    std::vector<std::string> names;
    for (size_t i = 0; i + 1 < units_.size(); ++i) names.push_back(absl::StrCat("blocks.", i));
    names.insert(names.begin(), "");
    return names;
  }

  // The tensors that hold this rank's shards (FSDP1: each unit's flat
  // shard; fully_shard: each parameter's).
  std::vector<torch::Tensor> Shards() const {
    if (fsdp1_ == nullptr) return model_->parameters();
    std::vector<torch::Tensor> shards;
    for (const fsdp::FlatParamHandle* handle : fsdp1_->handles()) {
      if (handle != nullptr) shards.push_back(handle->flat_param());
    }
    return shards;
  }

 private:
  std::shared_ptr<trainer::TransformerLM> model_;
  std::unique_ptr<fsdp::FullyShardedDataParallel> fsdp1_;
  std::vector<fsdp::FSDPModule> units_;  // fully_shard's: the blocks, then the root
};

// The same model wrapped per `variant` on `group`, this rank's rows of
// each step's batch. `after_backward` inspects the state between backward
// and the optimizer step. Losses are averaged over the group (a CPU
// all-reduce: the group must carry CPU tensors when it has more than one
// rank).
Run TrainFsdp(const comm::ProcessGroup& group, torch::Device device, const FsdpVariant& variant,
              const AfterBackward& after_backward, Problems& problems) {
  ShardedTransformer sharded(group, device, variant);
  const std::string api = variant.fully_shard ? "fully_shard" : "FSDP";
  const std::vector<std::string> unit_names = sharded.UnitNames();
  const int units = static_cast<int>(unit_names.size());
  if (units != 1 + static_cast<int>(kModel.layers)) {
    problems.Add(absl::StrCat(api, " made ", units, " units (", absl::StrJoin(unit_names, ", "),
                              "): expected the root and one per block, ", 1 + kModel.layers));
  }
  // Where the shards live: cuda:0, or pinned CPU memory under offload.
  for (const torch::Tensor& shard : sharded.Shards()) {
    if (variant.cpu_offload) {
      if (!shard.device().is_cpu()) {
        problems.Add(absl::StrCat("cpu_offload: a shard is on ", shard.device().str(),
                                  ": expected the CPU"));
      } else if (!device.is_cpu() && !shard.is_pinned()) {
        problems.Add(
            "cpu_offload: a shard is in pageable CPU memory: expected pinned "
            "(so its copies to the GPU are asynchronous)");
      }
    } else if (shard.device() != device) {
      problems.Add(absl::StrCat("a shard is on ", shard.device().str(), ": expected ", device.str(),
                                variant.fully_shard ? "" : " (device_id)"));
    }
    if (shard.scalar_type() != torch::kFloat) {
      problems.Add(absl::StrCat("a shard has dtype ", c10::toString(shard.scalar_type()),
                                ": expected float32 (the optimizer's full precision)"));
    }
    if (!problems.empty()) break;
  }

  auto optim = MakeOptimizer(sharded.parameters());
  Run run;
  for (int step = 0; step < kSteps; ++step) {
    optim->zero_grad();
    const torch::Tensor batch = Batch(group.rank(), group.size()).to(device);
    torch::Tensor loss = sharded.Loss(batch);
    loss.backward();
    if (after_backward) after_backward(step, sharded.parameters(), problems);
    optim->step();
    torch::Tensor global = torch::tensor({loss.item<double>()}, torch::kDouble);
    if (group.size() > 1) comm::all_reduce(group, global, comm::ReduceOp::kAvg).wait();
    run.losses.push_back(global.item<double>());
  }
  run.params = sharded.FullParams();
  return run;
}

struct Closeness {
  double max_abs = 0;  // largest |actual - expected|
  double max_rel = 0;  // largest |actual - expected| / |expected| (where |expected| > atol)
};

// Losses within rtol of the reference's, step by step.
Closeness CompareLosses(Problems& problems, const std::vector<double>& actual,
                        const std::vector<double>& expected, double rtol, const std::string& what) {
  Closeness c;
  if (actual.size() != expected.size()) {
    problems.Add(absl::StrCat(what, ": ", actual.size(), " losses, expected ", expected.size()));
    return c;
  }
  for (size_t i = 0; i < actual.size(); ++i) {
    const double diff = std::abs(actual[i] - expected[i]);
    const double rel = diff / std::max(std::abs(expected[i]), 1e-12);
    c.max_abs = std::max(c.max_abs, diff);
    c.max_rel = std::max(c.max_rel, rel);
    if (!std::isfinite(actual[i]) || rel > rtol) {
      problems.Add(
          absl::StrFormat("%s: step %d loss %.9g, reference %.9g (relative difference "
                          "%.3g > %.3g)",
                          what, static_cast<int>(i), actual[i], expected[i], rel, rtol));
    }
  }
  return c;
}

// Parameters close elementwise: |a - e| <= atol + rtol * |e| (torch.allclose).
Closeness CompareParams(Problems& problems, const Params& actual, const Params& expected,
                        double rtol, double atol) {
  Closeness c;
  for (const auto& [name, want] : expected) {
    auto it = actual.find(name);
    if (it == actual.end()) {
      problems.Add("final parameters: " + name + " missing from the FSDP model");
      continue;
    }
    const torch::Tensor& got = it->second;
    if (got.sizes() != want.sizes()) {
      problems.Add(absl::StrCat("final parameters: ", name, " has shape ", c10::str(got.sizes()),
                                ", expected ", c10::str(want.sizes())));
      continue;
    }
    const torch::Tensor diff = (got.to(torch::kDouble) - want.to(torch::kDouble)).abs();
    const double max_abs = diff.max().item<double>();
    const torch::Tensor scale = want.to(torch::kDouble).abs();
    const double max_rel = (diff / scale.clamp_min(atol)).max().item<double>();
    c.max_abs = std::max(c.max_abs, max_abs);
    c.max_rel = std::max(c.max_rel, max_rel);
    if (!torch::allclose(got, want, rtol, atol)) {
      problems.Add(
          absl::StrFormat("final parameters: %s differs from the reference by up to "
                          "%.3g (relative %.3g; tolerance rtol %.0e, atol %.0e)",
                          name, max_abs, max_rel, rtol, atol));
    }
  }
  if (actual.size() != expected.size()) {
    problems.Add(absl::StrCat("final parameters: ", actual.size(), " in the FSDP model, ",
                              expected.size(), " in the reference"));
  }
  return c;
}

// ---------------------------------------------------------------------------
// Parity with the unwrapped model on the device.

// fp32 on one GPU: the same kernels on the same shapes, FSDP adding only
// copies (a one-rank "reduction" is the gradient itself), so the numbers
// are expected equal up to rounding. Tolerance: the parity test's
// (tests/fsdp_parity_test.cc): rtol 1e-5, atol 1e-6.
constexpr double kFp32Rtol = 1e-5;
constexpr double kFp32Atol = 1e-6;

// What the world-of-1 checks of one run share: the device, the world they
// train on and the unwrapped model's fp32 run.
class Shared {
 public:
  explicit Shared(torch::Device device) : device_(device) {}
  torch::Device device() const { return device_; }

  // The world of 1 (NCCL; Gloo in a dry run), made at the first check that
  // needs it, so that a failure to make it fails those checks, each naming it.
  const absl::StatusOr<WorldOf1>& World() {
    if (!world_) {
      world_.emplace(MakeWorldOf1(device_.is_cpu() ? "gloo" : "nccl", kCollectiveTimeout));
    }
    return *world_;
  }

  // The fp32 reference, computed once.
  const Run& Reference() {
    if (!reference_) reference_ = TrainUnwrapped(device_);
    return *reference_;
  }

 private:
  torch::Device device_;
  std::optional<absl::StatusOr<WorldOf1>> world_;
  std::optional<Run> reference_;
};

Result CheckParityFp32(Shared& shared, const comm::ProcessGroup& group, bool fully_shard) {
  const torch::Device device = shared.device();
  Problems problems;
  auto check_devices = [device](int step, const std::vector<torch::Tensor>& parameters,
                                Problems& p) {
    if (step != 0) return;
    for (const torch::Tensor& param : parameters) {
      if (param.device() != device || !param.grad().defined() || param.grad().device() != device) {
        p.Add(absl::StrCat("after backward: a parameter on ", param.device().str(), " with ",
                           param.grad().defined() ? "a gradient on " + param.grad().device().str()
                                                  : std::string("no gradient"),
                           ": expected both on ", device.str()));
        return;
      }
    }
  };
  FsdpVariant variant;
  variant.fully_shard = fully_shard;
  const Run fsdp = TrainFsdp(group, device, variant, check_devices, problems);
  const Run& ref = shared.Reference();
  if (!(ref.losses.back() < ref.losses.front())) {
    problems.Add(
        absl::StrFormat("the unwrapped reference did not train (loss %.6f -> %.6f): "
                        "the parity would be vacuous",
                        ref.losses.front(), ref.losses.back()));
  }
  const Closeness loss = CompareLosses(problems, fsdp.losses, ref.losses, kFp32Rtol, "fp32");
  const Closeness params = CompareParams(problems, fsdp.params, ref.params, kFp32Rtol, kFp32Atol);
  if (!problems.empty()) return Fail(problems.Joined());
  return Pass(absl::StrFormat(
      "%d SGD steps, losses %.6f..%.6f: max loss difference %.3g (relative %.3g), final "
      "parameters max abs difference %.3g (tolerance rtol %.0e, atol %.0e)",
      kSteps, fsdp.losses.front(), fsdp.losses.back(), loss.max_abs, loss.max_rel, params.max_abs,
      kFp32Rtol, kFp32Atol));
}

// bf16 parameters and compute, fp32 gradient reduction. There is no exact
// bf16 reference (autocast-free bf16 in the unwrapped model would round
// differently), so: every step's loss within 2e-2 relative of the fp32
// reference's (the loss itself is a bf16 number, ~0.4% resolution at 5.5;
// the trainer's README states 3% and measures < 1%), gradients finite and
// fp32 (reduced in fp32, cast back to the parameters' dtype), parameters
// still fp32 and finite.
Result CheckParityBf16(Shared& shared, const comm::ProcessGroup& group, bool fully_shard) {
  constexpr double kBf16LossRtol = 2e-2;
  Problems problems;
  auto check_grads = [](int step, const std::vector<torch::Tensor>& parameters, Problems& p) {
    int with_grad = 0;
    for (const torch::Tensor& param : parameters) {
      if (param.scalar_type() != torch::kFloat) {
        p.Add(absl::StrCat("step ", step, ": a parameter has dtype ",
                           c10::toString(param.scalar_type()), ": expected float32"));
        return;
      }
      const torch::Tensor& grad = param.grad();
      if (!grad.defined()) continue;
      ++with_grad;
      if (grad.scalar_type() != torch::kFloat) {
        p.Add(absl::StrCat("step ", step, ": a gradient has dtype ",
                           c10::toString(grad.scalar_type()), ": expected float32"));
        return;
      }
      if (!torch::isfinite(grad).all().item<bool>()) {
        p.Add(absl::StrCat("step ", step, ": a gradient (shape ", c10::str(grad.sizes()),
                           ") has non-finite values"));
        return;
      }
    }
    if (with_grad == 0) p.Add(absl::StrCat("step ", step, ": no parameter has a gradient"));
  };
  FsdpVariant variant;
  variant.bf16 = true;
  variant.fully_shard = fully_shard;
  const Run fsdp = TrainFsdp(group, shared.device(), variant, check_grads, problems);
  const Run& ref = shared.Reference();
  const Closeness loss =
      CompareLosses(problems, fsdp.losses, ref.losses, kBf16LossRtol, "bf16 vs fp32");
  for (const auto& [name, value] : fsdp.params) {
    if (!torch::isfinite(value).all().item<bool>()) {
      problems.Add("final parameters: " + name + " has non-finite values");
    }
  }
  if (!problems.empty()) return Fail(problems.Joined());
  return Pass(absl::StrFormat(
      "%d SGD steps: losses within %.3g relative of the fp32 reference (tolerance %.0e), "
      "gradients float32 and finite every step, parameters float32 and finite",
      kSteps, loss.max_rel, kBf16LossRtol));
}

// CPU offload: shards (and the optimizer's parameters and gradients) pinned
// on the CPU, gathered onto cuda:0 to compute. The optimizer then runs on
// the CPU and the reference's on the GPU; both compute the same fp32 SGD,
// so the fp32 tolerance applies.
Result CheckParityCpuOffload(Shared& shared, const comm::ProcessGroup& group, bool fully_shard) {
  Problems problems;
  auto check_offloaded = [](int step, const std::vector<torch::Tensor>& parameters, Problems& p) {
    for (const torch::Tensor& param : parameters) {
      if (!param.device().is_cpu()) {
        p.Add(absl::StrCat("step ", step, ": an optimizer-facing parameter is on ",
                           param.device().str(), ": expected the CPU (offload_params)"));
        return;
      }
      if (param.grad().defined() && !param.grad().device().is_cpu()) {
        p.Add(absl::StrCat("step ", step, ": a gradient is on ", param.grad().device().str(),
                           ": expected the CPU (offload_params)"));
        return;
      }
    }
  };
  FsdpVariant variant;
  variant.cpu_offload = true;
  variant.fully_shard = fully_shard;
  const Run fsdp = TrainFsdp(group, shared.device(), variant, check_offloaded, problems);
  const Run& ref = shared.Reference();
  const Closeness loss = CompareLosses(problems, fsdp.losses, ref.losses, kFp32Rtol, "offload");
  const Closeness params = CompareParams(problems, fsdp.params, ref.params, kFp32Rtol, kFp32Atol);
  if (!problems.empty()) return Fail(problems.Joined());
  return Pass(absl::StrFormat(
      "shards %son the CPU, gradients on the CPU; %d SGD steps: max loss difference %.3g, "
      "final parameters max abs difference %.3g (tolerance rtol %.0e, atol %.0e)",
      shared.device().is_cpu() ? "(dry run: not pinned) " : "pinned ", kSteps, loss.max_abs,
      params.max_abs, kFp32Rtol, kFp32Atol));
}

// ---------------------------------------------------------------------------
// Two ranks on one GPU over Gloo with CUDA tensors.

// Batch split over 2 ranks: each rank's mean loss is over half the rows,
// the gradient is the average of two half-batch means, and Gloo sums in its
// own order, so the numbers differ from the one-process reference by
// rounding only (measured on the CPU, --dry-run-on-cpu: 6e-8 in the
// parameters). Tolerance: the fp32 one, as tests/fsdp_parity_test.cc uses
// for 2 and 4 ranks.
constexpr double kTwoRankLossRtol = kFp32Rtol;
constexpr double kTwoRankRtol = kFp32Rtol;
constexpr double kTwoRankAtol = kFp32Atol;

// In each re-executed rank: FSDP on the world group (Gloo, from the
// launcher's environment) against the unwrapped model, which every rank
// trains itself on the whole batch. Prints one "RESULT ..." line (rank 0)
// or the problems, and exits 0 when it matched.
int RunGlooRank(torch::Device device, bool fully_shard) {
  comm::InitOptions init;  // gloo, env://: RANK, WORLD_SIZE, MASTER_* from launcher::launch
  init.timeout = kCollectiveTimeout;
  auto group = comm::init_process_group(init);
  if (!group.ok()) {
    std::fprintf(stderr, "gpu_check rank: comm::init_process_group(gloo, env://): %s\n",
                 std::string(group.status().message()).c_str());
    return 1;
  }
  try {
    Problems problems;
    FsdpVariant variant;
    variant.fully_shard = fully_shard;
    const Run fsdp = TrainFsdp(*group, device, variant, nullptr, problems);
    const Run ref = TrainUnwrapped(device);
    const Closeness loss =
        CompareLosses(problems, fsdp.losses, ref.losses, kTwoRankLossRtol, "2 ranks");
    const Closeness params =
        CompareParams(problems, fsdp.params, ref.params, kTwoRankRtol, kTwoRankAtol);
    if (!problems.empty()) {
      std::fprintf(stderr, "PROBLEMS %s\n", problems.Joined().c_str());
      return 1;
    }
    if (group->rank() == 0) {
      std::printf(
          "RESULT %s: %d SGD steps on %d ranks (Gloo, %s tensors, half the batch each): "
          "max loss difference %.3g (relative %.3g, tolerance %.0e), final parameters "
          "max abs difference %.3g (tolerance rtol %.0e, atol %.0e)\n",
          fully_shard ? "fully_shard" : "FSDP FULL_SHARD", kSteps, group->size(),
          device.is_cpu() ? "CPU" : "CUDA", loss.max_abs, loss.max_rel, kTwoRankLossRtol,
          params.max_abs, kTwoRankRtol, kTwoRankAtol);
      std::fflush(stdout);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "PROBLEMS %s\n", gpu_check::Describe(e).c_str());
    return 1;
  }
}

// Re-executes this binary as 2 ranks through launcher::launch (as the trainer's
// --nproc does) and collects their verdict.
Result CheckGlooTwoRanksCuda(torch::Device device, bool fully_shard) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return Fail("cannot resolve /proc/self/exe to re-execute this binary");
  self[n] = '\0';
  launcher::LaunchOptions launch;
  launch.nproc_per_node = 2;
  launch.command = {self, kGpuCheckRankArg, fully_shard ? kFullyShardApi : kFsdp1Api};
  if (device.is_cpu()) launch.command.push_back(gpu_check::kDryRunOnCpuArg);
  launch.timeout = std::chrono::minutes(5);
  launch.collective_timeout = kCollectiveTimeout;
  std::mutex mu;
  std::vector<std::string> lines;
  std::string result_line;
  launch.on_line = [&](int rank, bool is_stderr, const std::string& line) {
    std::lock_guard<std::mutex> lock(mu);
    if (rank == 0 && !is_stderr && absl::StartsWith(line, "RESULT ")) {
      result_line = line.substr(7);
    } else {
      lines.push_back(absl::StrCat("[rank ", rank, "] ", line));
    }
  };
  launch.on_event = [&](const std::string& message) {
    std::lock_guard<std::mutex> lock(mu);
    lines.push_back("launch: " + message);
  };
  auto result = launcher::launch(launch);
  if (!result.ok()) return Fail(absl::StrCat("launcher::launch: ", result.status().message()));
  if (result->exit_code != 0 || result_line.empty()) {
    // The ranks' own words (their last lines), then the launcher's summary.
    std::vector<std::string> last;
    for (const std::string& line : lines) {
      if (absl::StrContains(line, "PROBLEMS") || absl::StrContains(line, "rror") ||
          absl::StrContains(line, "gpu_check")) {
        last.push_back(line);
      }
    }
    if (last.size() > 6) last.erase(last.begin(), last.end() - 6);
    return Fail(absl::StrCat("exit status ", result->exit_code, ": ", result->summary, " | ",
                             absl::StrJoin(last, " | ")));
  }
  return Pass(result_line);
}

// ---------------------------------------------------------------------------
// A full FSDP training step with no host synchronisation (issue 36, item 5).

// The trainer's step on the NCCL world of 1: trainer/models.h's transformer
// (SDPA attention) in FSDP FULL_SHARD, one unit per block, bf16 parameters
// with fp32 reduction, optim/'s fused AdamW; the batch copied from pinned
// memory without blocking. Step 1 warms up (NCCL's communicator, the
// optimizer's state, the allocator's pools); step 2 runs under sync-debug
// mode warn and counts every synchronising call by phase (their stacks go
// to stderr); steps 3-5 each run forward, backward (gradient reduction
// inside) and the optimizer step under sync-debug mode error, phase by
// phase, so a synchronisation is reported naming the phase. Only each step's loss is then read
// (.item(), the logged loss: outside the mode). The losses must be finite and fall (the same batch
// every step).
Result CheckStepNoSync(Shared& shared, const comm::ProcessGroup& group, bool fully_shard) {
  const torch::Device device = shared.device();
  const bool dry_run = device.is_cpu();
  Problems problems;
  FsdpVariant variant;
  variant.bf16 = true;
  variant.fully_shard = fully_shard;
  ShardedTransformer sharded(group, device, variant);
  optim::AdamW optimizer(sharded.parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.01),
                         optim::Implementation::kFused);
  // This rank's rows, pinned once, so each step's copy to the GPU is
  // asynchronous (a pageable copy waits for the GPU).
  torch::Tensor host_batch = Batch(group.rank(), group.size());
  if (!dry_run) host_batch = host_batch.pin_memory();

  // Step 1 warms up; step 2 surveys under kWarn (every synchronising call
  // of the step counted, by phase, with where it was raised: written to
  // stderr); steps 3-5 are the test, under kError.
  constexpr int kNoSyncSteps = 3;
  std::vector<double> losses;
  std::vector<SyncDebugScope::Sync> surveyed;
  for (int step = 1; step <= 2 + kNoSyncSteps; ++step) {
    const bool survey = step == 2 && !dry_run;
    const bool checked = step > 2 && !dry_run;
    std::string phase = "zero_grad and the batch's copy";
    try {
      torch::Tensor loss;
      {
        SyncDebugScope mode(checked  ? SyncDebugScope::Mode::kError
                            : survey ? SyncDebugScope::Mode::kWarn
                                     : SyncDebugScope::Mode::kOff);
        auto enter = [&](const char* what) {
          phase = what;
          mode.set_phase(phase);
        };
        enter("zero_grad and the batch's copy");
        optim::zero_grad(optimizer);  // as the trainer
        const torch::Tensor batch = host_batch.to(device, /*non_blocking=*/true);
        enter("forward");
        loss = sharded.Loss(batch);
        enter("backward (FSDP's gradient reduction inside)");
        loss.backward();
        enter("the fused AdamW step");
        optimizer.step();
        surveyed = mode.syncs();
      }
      phase = "reading the loss";
      losses.push_back(loss.item<double>());
    } catch (const c10::Error& e) {
      std::string what = e.what_without_backtrace();
      if (const auto nl = what.find('\n'); nl != std::string::npos) what.resize(nl);
      problems.Add(absl::StrCat("step ", step, ", ", phase,
                                checked ? " (under sync-debug mode error)" : "", ": ", what));
      // Where: the whole error, its stack included, for gpu_check.log.
      std::fprintf(stderr, "%s step %d, %s: %s\n", fully_shard ? "fully_shard" : "FSDP", step,
                   phase.c_str(), e.what());
      break;
    }
  }
  if (!surveyed.empty()) {
    std::map<std::string, int> by_phase;
    for (const SyncDebugScope::Sync& sync : surveyed) {
      ++by_phase[sync.phase];
      std::fprintf(stderr, "%s step 2 synchronised the host in %s, at:\n%s\n",
                   fully_shard ? "fully_shard" : "FSDP", sync.phase.c_str(), sync.stack.c_str());
    }
    std::vector<std::string> counts;
    for (const auto& [where, n] : by_phase) counts.push_back(absl::StrCat(where, " x", n));
    problems.Add(absl::StrCat("step 2 under sync-debug mode warn: ", surveyed.size(),
                              " synchronising calls (", absl::StrJoin(counts, ", "),
                              "; their stacks are in gpu_check's stderr)"));
  }
  if (problems.empty()) {
    for (size_t i = 0; i < losses.size(); ++i) {
      if (!std::isfinite(losses[i])) {
        problems.Add(absl::StrCat("step ", i + 1, ": loss ", losses[i], " is not finite"));
      }
    }
    if (!losses.empty() && !(losses.back() < losses.front())) {
      problems.Add(absl::StrFormat("the loss did not fall over %d steps (%.6f -> %.6f)",
                                   static_cast<int>(losses.size()), losses.front(), losses.back()));
    }
  }
  if (!problems.empty()) return Fail(problems.Joined());
  return Pass(absl::StrFormat(
      "%s, bf16 parameters and fp32 reduction, fused AdamW: %d steps, loss "
      "%.6f -> %.6f%s",
      fully_shard ? "fully_shard" : "FSDP FULL_SHARD", static_cast<int>(losses.size()),
      losses.front(), losses.back(),
      dry_run ? " (dry run: no sync-debug mode on the CPU)"
              : "; step 2 under sync-debug mode warn found no synchronising call, steps 3-5 "
                "(forward, backward with the reduction, optimizer step) ran under sync-debug "
                "mode error: no host synchronisation but the loss's"));
}

// Two float8 linears (bf16) whose weights fully_shard may gather as float8.
struct Float8PairImpl : torch::nn::Module {
  explicit Float8PairImpl(torch::Device device) {
    torch::manual_seed(21);
    const auto options = torch::TensorOptions().dtype(torch::kBFloat16).device(device);
    w1 = register_parameter("w1", (torch::randn({256, 128}) * 0.1).to(options));
    w2 = register_parameter("w2", (torch::randn({128, 256}) * 0.1).to(options));
  }
  static torch::Tensor Linear(const torch::Tensor& x, const torch::Tensor& w) {
    if (auto cast = fsdp::float8_unsharded_param(w)) {
      return kernels::Float8Linear(x, w, *cast, std::nullopt);
    }
    return kernels::Float8Linear(x, w, std::nullopt);
  }
  torch::Tensor forward(const torch::Tensor& x) { return Linear(torch::relu(Linear(x, w1)), w2); }
  torch::Tensor w1, w2;
};
TORCH_MODULE(Float8Pair);
const bool kFloat8PairBound = functorch::RegisterModuleMembers<Float8PairImpl>(
    {{"w1", &Float8PairImpl::w1}, {"w2", &Float8PairImpl::w2}});

// fully_shard's float8 all-gather on the device (the world of 1: the amax
// and the cast on the unshard stream, the gathered bytes on the device)
// against the same model unsharded, whose float8 linears cast their own
// weights (with //kernels:cuda's fused cast, which gpu_check holds to the
// ATen recipe the gather's cast uses): 3 SGD steps' outputs and
// gradients bit for bit, and the gathered bytes the whole weights' casts.
Result CheckFloat8AllGather(Shared& shared, const comm::ProcessGroup& group, bool /*fully_shard*/) {
  const torch::Device device = shared.device();
  if (std::string why; device.is_cuda() && !kernels::Float8MatmulSupported(device, &why)) {
    return Fail("float8 matrix products unavailable: " + why);
  }
  Problems problems;
  Float8Pair reference(device);
  Float8Pair sharded(device);
  fsdp::FullyShardOptions options;
  options.process_group = group;
  options.float8_all_gather_fn = [](const torch::Tensor&) { return true; };
  fsdp::FSDPModule root = fsdp::fully_shard(sharded.ptr(), options);
  torch::optim::SGD ref_optim(reference->parameters(), 1e-3);
  torch::optim::SGD optim(sharded->parameters(), 1e-3);
  double max_output = 0;
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(300 + step);
    const torch::Tensor x = torch::randn({64, 128}).to(device, torch::kBFloat16);
    const torch::Tensor g = torch::randn({64, 128}).to(device, torch::kBFloat16);
    ref_optim.zero_grad();
    optim.zero_grad();
    const torch::Tensor y_ref = reference->forward(x);
    y_ref.backward(g);
    const torch::Tensor y = module_call::call(sharded, x);
    y.backward(g);
    max_output = std::max(max_output, y_ref.abs().max().item<double>());
    if (!torch::equal(y, y_ref)) {
      problems.Add(absl::StrFormat(
          "step %d: output differs by up to %.3g", step,
          (y.to(torch::kFloat) - y_ref.to(torch::kFloat)).abs().max().item<double>()));
    }
    for (const char* name : {"w1", "w2"}) {
      const torch::Tensor grad = sharded->named_parameters()[name].grad();
      const torch::Tensor ref_grad = reference->named_parameters()[name].grad();
      if (!grad.defined() || !torch::equal(grad, ref_grad)) {
        problems.Add(absl::StrCat("step ", step, ": ", name, "'s gradient ",
                                  grad.defined() ? "differs" : "is missing"));
      }
    }
    ref_optim.step();
    optim.step();
  }
  root.unshard();
  for (const auto& [weight, full] : std::vector<std::pair<torch::Tensor, torch::Tensor>>{
           {sharded->w1, reference->w1}, {sharded->w2, reference->w2}}) {
    const std::optional<kernels::Float8Tensor> cast = fsdp::float8_unsharded_param(weight);
    const kernels::Float8Tensor whole = kernels::CastToFloat8(full, torch::kFloat8_e4m3fn);
    if (!cast || cast->data.device() != device ||
        !torch::equal(cast->data.view(torch::kByte), whole.data.view(torch::kByte))) {
      problems.Add("the gathered float8 bytes are not the whole weight's cast on the device");
    }
  }
  root.reshard();
  if (!problems.empty()) return Fail(problems.Joined());
  return Pass(absl::StrFormat(
      "3 SGD steps of two bf16 float8 linears [256x128, 128x256], weights gathered as e4m3: "
      "outputs (up to %.3g) and gradients bit for bit the unsharded float8 model's",
      max_output));
}

}  // namespace

std::vector<gpu_check::Check> FsdpGpuChecks(c10::Device device) {
  auto shared = std::make_shared<Shared>(device);
  // The checks on the world of 1, for FullyShardedDataParallel (fully_shard
  // false) or fully_shard.
  using WorldCheck = Result (*)(Shared&, const comm::ProcessGroup&, bool);
  auto on_world = [shared](WorldCheck check, bool fully_shard) {
    return [shared, check, fully_shard]() -> Result {
      const absl::StatusOr<WorldOf1>& world = shared->World();
      if (!world.ok()) return Fail(std::string(world.status().message()));
      return check(*shared, world->group, fully_shard);
    };
  };
  auto two_ranks = [device](bool fully_shard) {
    return [device, fully_shard] { return CheckGlooTwoRanksCuda(device, fully_shard); };
  };
  return {
      {"fsdp_parity_full_shard_fp32", on_world(CheckParityFp32, false)},
      {"fsdp_parity_bf16", on_world(CheckParityBf16, false)},
      {"fsdp_parity_cpu_offload", on_world(CheckParityCpuOffload, false)},
      {"fsdp_gloo_2_ranks_cuda", two_ranks(false)},
      {"fsdp_step_no_sync", on_world(CheckStepNoSync, false)},
      {"fully_shard_parity_fp32", on_world(CheckParityFp32, true)},
      {"fully_shard_parity_bf16", on_world(CheckParityBf16, true)},
      {"fully_shard_parity_cpu_offload", on_world(CheckParityCpuOffload, true)},
      {"fully_shard_gloo_2_ranks_cuda", two_ranks(true)},
      {"fully_shard_step_no_sync", on_world(CheckStepNoSync, true)},
      {"fully_shard_float8_all_gather", on_world(CheckFloat8AllGather, true)},
  };
}

std::optional<GpuCheckApi> ParseGpuCheckApi(std::string_view name) {
  if (name == kFsdp1Api) return GpuCheckApi::kFullyShardedDataParallel;
  if (name == kFullyShardApi) return GpuCheckApi::kFullyShard;
  return std::nullopt;
}

int RunGpuCheckRank(GpuCheckApi api, c10::Device device) {
  return RunGlooRank(device, api == GpuCheckApi::kFullyShard);
}

}  // namespace fsdp
