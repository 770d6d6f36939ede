#include "trainer/train.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/aminmax.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <torch/types.h>
#include <torch/utils.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/collectives.h"
#include "host/compute_layout.h"
#include "models/llama.h"
#include "models/llama_config.h"
#include "optim/optimizers.h"
#include "state_dict/fully_shard/fully_shard_state_dict.h"
#include "state_dict/sharded_tensor.h"
#include "comm/process_group.h"
#include "comm/slurm.h"
#include "state_dict/optim_state.h"
#include "trainer/checkpointing.h"
#include "trainer/cuda_graphs.h"
#include "trainer/data.h"
#include "trainer/float8_linears.h"
#include "trainer/finite_state.h"
#include "trainer/json_log.h"
#include "trainer/lr_schedule.h"
#include "trainer/models.h"
#include "trainer/progress.h"
#include "trainer/step_profile.h"
#include "trainer/text_data.h"
#include "trainer/wrap.h"

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;

// PyTorch's fused=True optimizers (optim/optimizers.h), on CPU and CUDA:
// subclasses of torch::optim's with their options and state, so checkpoints
// and state dicts are those of torch::optim::Adam / AdamW / SGD, and one ATen
// kernel per (device, dtype) updates all parameters.
std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(const Options& o,
                                                       std::vector<torch::Tensor> params) {
  switch (o.optimizer) {
    case OptimizerKind::kAdam:
      return std::make_unique<optim::Adam>(std::move(params), torch::optim::AdamOptions(o.lr),
                                           optim::Implementation::kFused);
    case OptimizerKind::kAdamW:
      return std::make_unique<optim::AdamW>(std::move(params),
                                            torch::optim::AdamWOptions(o.lr).weight_decay(0.01),
                                            optim::Implementation::kFused);
    case OptimizerKind::kSgd:
      return std::make_unique<optim::SGD>(std::move(params),
                                          torch::optim::SGDOptions(o.lr).momentum(0.9),
                                          optim::Implementation::kFused);
  }
  return nullptr;
}

int64_t TensorBytes(const torch::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.numel() * t.element_size()) : 0;
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

// What the CUDA caching allocator holds on `device` (PyTorch's
// torch.cuda.memory_allocated / memory_reserved and their max_ forms, since
// the last reset). `known` is false on the CPU, and where the allocator
// cannot say (not a caching allocator).
struct DeviceMemory {
  bool known = false;
  int64_t peak_allocated = 0;
  int64_t peak_reserved = 0;
  int64_t allocated = 0;
  int64_t reserved = 0;
};

DeviceMemory CudaMemory(const c10::Device& device) {
  DeviceMemory m;
  if (!device.is_cuda()) return m;
  try {
    // c10's device-generic allocator interface: no CUDA header needed, so
    // this compiles in the CPU build too (it is only called on CUDA).
    const auto stats = c10::getDeviceAllocator(c10::kCUDA)->getDeviceStats(device.index());
    constexpr auto kAll = static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE);
    m.peak_allocated = stats.allocated_bytes[kAll].peak;
    m.peak_reserved = stats.reserved_bytes[kAll].peak;
    m.allocated = stats.allocated_bytes[kAll].current;
    m.reserved = stats.reserved_bytes[kAll].current;
    m.known = true;
  } catch (const c10::Error&) {
    // Not a caching allocator: the figures stay unknown.
  }
  return m;
}

// torch.cuda.reset_peak_memory_stats(device); nothing on the CPU.
void ResetCudaPeaks(const c10::Device& device) {
  if (!device.is_cuda()) return;
  try {
    c10::getDeviceAllocator(c10::kCUDA)->resetPeakStats(device.index());
  } catch (const c10::Error&) {
    // As in CudaMemory.
  }
}

std::string Bytes(int64_t bytes) {
  return absl::StrFormat("%d bytes (%.2f GiB)", bytes, static_cast<double>(bytes) / (1 << 30));
}

// The type URL of the payload that marks an out-of-memory status.
constexpr char kOutOfMemoryPayload[] = "type.googleapis.com/trainer.OutOfMemory";

// An allocation failed: CUDA's caching allocator (and any allocator that
// says so) throws c10::OutOfMemoryError; LibTorch's default CPU allocator
// throws a plain c10::Error ("DefaultCPUAllocator: can't allocate memory",
// older versions "not enough memory").
bool IsAllocationFailure(const c10::Error& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return true;
  const std::string what = e.what_without_backtrace();
  return absl::StrContains(what, "DefaultCPUAllocator: can't allocate memory") ||
         absl::StrContains(what, "DefaultCPUAllocator: not enough memory");
}

// The status of an allocation that failed in `step` (`what` it was doing)
// on `device`: the allocator's words (first line), the device's figures in
// the step (the CUDA caching allocator's peaks since the step began, or the
// process's peak RSS on the CPU), and that no checkpoint was being written.
absl::Status OutOfMemoryStatus(int64_t step, const std::string& what, const c10::Device& device,
                               const c10::Error& e) {
  std::string message = e.what_without_backtrace();
  if (const auto nl = message.find('\n'); nl != std::string::npos) message.resize(nl);
  std::string figures;
  const DeviceMemory m = CudaMemory(device);
  if (m.known) {
    figures =
        absl::StrCat("CUDA caching allocator on ", device.str(), " in this step: peak allocated ",
                     Bytes(m.peak_allocated), ", peak reserved ", Bytes(m.peak_reserved),
                     "; now allocated ", Bytes(m.allocated), ", reserved ", Bytes(m.reserved));
  } else {
    figures = absl::StrCat("peak RSS of this process ", Bytes(PeakRssBytes()));
  }
  absl::Status status = absl::ResourceExhaustedError(
      absl::StrCat("step ", step, ": out of memory on ", device.str(), " in ", what, ": ", message,
                   "; ", figures,
                   ". The step's update was not applied and no checkpoint was being written: the "
                   "checkpoints already written are intact (resume from the newest; a smaller "
                   "--global-batch with --grad-accum, or more ranks, need less memory per step)"));
  status.SetPayload(kOutOfMemoryPayload, absl::Cord(device.str()));
  return status;
}

// Runs `f` (returning an absl::StatusOr or absl::Status), turning an
// allocation failure into OutOfMemoryStatus; other exceptions pass.
template <typename F>
auto GuardOutOfMemory(int64_t step, const std::string& what, const c10::Device& device, F f)
    -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error& e) {
    if (!IsAllocationFailure(e)) throw;
    return OutOfMemoryStatus(step, what, device, e);
  }
}

}  // namespace

bool IsOutOfMemory(const absl::Status& status) {
  return status.GetPayload(kOutOfMemoryPayload).has_value();
}

absl::Status OutOfMemoryOutsideStep(const c10::Error& e) {
  if (!IsAllocationFailure(e)) return absl::InternalError(e.what_without_backtrace());
  std::string message = e.what_without_backtrace();
  if (const auto nl = message.find('\n'); nl != std::string::npos) message.resize(nl);
  absl::Status status = absl::ResourceExhaustedError(
      absl::StrCat("out of memory outside a training step (building, wrapping, loading or "
                   "saving): ",
                   message, "; peak RSS of this process ", Bytes(PeakRssBytes())));
  status.SetPayload(kOutOfMemoryPayload, absl::Cord("outside a step"));
  return status;
}

absl::StatusOr<int64_t> ShardedStateBytes(const std::vector<torch::Tensor>& params,
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

absl::StatusOr<c10::Device> ComputeDevice(const Options& o) {
  if (o.device == Device::kCpu) return c10::Device(c10::kCPU);
  if (!comm::is_nccl_available()) {
    return absl::UnimplementedError(
        "--device=cuda: this trainer was built without CUDA (build it with "
        "--config=cuda against a CUDA LibTorch, such as the torch wheel); use --device=cpu");
  }
  const int64_t count = static_cast<int64_t>(torch::cuda::device_count());
  if (count <= 0) {
    return absl::FailedPreconditionError(
        "--device=cuda: this process sees no CUDA GPU (torch::cuda::device_count() is 0: no "
        "NVIDIA driver, no device, or CUDA_VISIBLE_DEVICES hides them); use --device=cpu");
  }
  int64_t local_rank = 0;
  if (comm::is_slurm_task()) {
    auto env = comm::slurm_rank_environment();
    if (!env.ok()) return env.status();
    local_rank = (*env)->local_rank;
  } else if (const char* v = std::getenv("LOCAL_RANK");
             v != nullptr && !absl::SimpleAtoi(v, &local_rank)) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable LOCAL_RANK='", v, "': expected a non-negative integer"));
  }
  // torchrun's convention, and the GPU comm's NCCL backend binds.
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank % count));
}

std::string ProcessGroupBackend(const Options& o) {
  return o.device == Device::kCuda ? comm::kGlooCpuNcclCuda : "gloo";
}

namespace {

// Rank 0's first lines: the model, the data, the FSDP layout and the steps
// this run trains, then the compute layout (threads, BLAS, allocator).
void PrintRunHeader(const Options& o, int world, TrainedModel fsdp_model, const c10::Device& device,
                    int64_t num_params, const std::string& data_description, int64_t first_step) {
  std::string layout =
      absl::StrCat(world, world == 1 ? " rank" : " ranks", ", ",
                   o.fsdp == FsdpApi::kFullyShard ? "fully_shard " : "FSDP ", Name(o.sharding));
  if (o.sharding == Sharding::kHybrid) {
    auto shape = HybridMeshShape(world);
    if (shape.ok())
      absl::StrAppend(&layout, " (", shape->first, " replicas x ", shape->second, " shards)");
  }
  absl::StrAppend(&layout, ", ", fsdp_model.fsdp_unit_names().size(), " unit",
                  fsdp_model.fsdp_unit_names().size() == 1 ? "" : "s", " (auto-wrap ",
                  AutoWrapName(o), ")");
  if (o.mixed_precision == MixedPrecision::kBf16) absl::StrAppend(&layout, ", bf16");
  if (o.cpu_offload) absl::StrAppend(&layout, ", cpu offload");
  if (!device.is_cpu()) absl::StrAppend(&layout, ", on ", device.str(), " (NCCL)");
  std::printf(
      "trainer: %s, %lld parameters, %s data%s, %s, global batch %lld%s, "
      "steps %lld-%lld\n",
      Name(o.model), static_cast<long long>(num_params), Name(o.data),
      data_description.empty() ? "" : absl::StrCat(" (", data_description, ")").c_str(),
      layout.c_str(), static_cast<long long>(o.global_batch),
      o.grad_accum > 1 ? absl::StrCat(" in ", o.grad_accum, " micro-batches").c_str() : "",
      static_cast<long long>(first_step), static_cast<long long>(o.steps));
  const char* local_world = std::getenv("LOCAL_WORLD_SIZE");
  std::printf(
      "trainer: compute: %s\n",
      host::DescribeComputeLayout(local_world != nullptr ? std::atoi(local_world) : world).c_str());
  std::fflush(stdout);
}

// One step's forward and backward on this rank's rows `batch`, in
// o.grad_accum micro-batches of equal size: scaling each mean loss by 1/K
// makes the accumulated gradient the gradient of the mean over the rank's
// rows. The first K-1 backwards run under no_sync (gradients accumulate
// unreduced); the last one reduces the sum, averaged over ranks by FSDP.
// Returns the rank's loss (the sum of the scaled micro-batch losses), a
// 0-dim float64 tensor on `device`, not read. `batch` is on the host (each
// micro-batch is copied to the device here) or already on `device` (the
// static buffer of a CUDA graph: cuda_graphs.h).
torch::Tensor ForwardBackward(const Options& o, TrainedModel fsdp_model, LanguageModel& model,
                              const torch::Tensor& batch, const c10::Device& device) {
  torch::Tensor local_loss;
  const std::vector<torch::Tensor> micros = batch.chunk(o.grad_accum, 0);
  for (size_t m = 0; m < micros.size(); ++m) {
    // To a GPU from pinned memory without blocking: a pageable copy would
    // wait for the GPU (a host synchronisation besides the step's one read).
    const torch::Tensor micro = micros[m].device() == device ? micros[m]
                                : device.is_cuda()
                                    ? micros[m].pin_memory().to(device, /*non_blocking=*/true)
                                    : micros[m].to(device);
    auto forward_backward = [&] {
      torch::Tensor loss =
          fsdp_model.run([&] { return model.Loss(micro); }) / static_cast<double>(o.grad_accum);
      loss.backward();
      // In float64, in micro-batch order: the sum the host computed before.
      const torch::Tensor value = loss.detach().to(torch::kFloat64);
      local_loss = local_loss.defined() ? local_loss + value : value;
    };
    if (m + 1 < micros.size()) {
      auto no_sync = fsdp_model.no_sync();
      forward_backward();
    } else {
      forward_backward();
    }
  }
  return local_loss;
}

// Whether some gradient of `params` holds NaN or Inf, as a 0-dim float64
// tensor (1 or 0) on the gradients' device, not read: finite_state.h's
// LocalGradsFinite without its host synchronisation. On CUDA one
// multi-tensor pass: the infinity norm (max |g|, NaN propagating) is NaN or
// Inf exactly when g holds one. On the CPU, where _foreach_norm is a
// per-tensor abs into a temporary then a max (6.3 ms of a 137 ms Llama step
// on 2.5 M gradients, 2026-11-28), each gradient's min and max in one
// vectorised pass (NaN propagating too: a NaN, +Inf or -Inf shows in one).
torch::Tensor LocalGradsNonFinite(const std::vector<torch::Tensor>& params,
                                  const c10::Device& device) {
  std::vector<torch::Tensor> grads;
  for (const torch::Tensor& p : params) {
    const torch::Tensor& g = p.grad();
    if (g.defined() && g.numel() > 0) grads.push_back(g);
  }
  if (grads.empty()) return torch::zeros({}, torch::dtype(torch::kFloat64).device(device));
  std::vector<torch::Tensor> extremes;
  if (device.is_cpu()) {
    for (const torch::Tensor& g : grads) {
      auto [low, high] = at::aminmax(g);
      extremes.push_back(low.to(torch::kFloat64));
      extremes.push_back(high.to(torch::kFloat64));
    }
  } else {
    extremes = at::_foreach_norm(grads, std::numeric_limits<double>::infinity());
  }
  return at::logical_not(at::isfinite(at::stack(extremes))).any().to(torch::kFloat64);
}

// The --log-json record of a step: `record` with its per-rank figures (peak
// RSS, sharded state bytes) gathered from every rank; rank 0 writes it.
// Every rank calls it (a collective inside).
absl::Status LogStep(const comm::ProcessGroup& group, const std::vector<torch::Tensor>& params,
                     const torch::optim::Optimizer& optimizer, const c10::Device& device,
                     JsonLogWriter& log, StepRecord record) {
  auto state_bytes = ShardedStateBytes(params, optimizer);
  if (!state_bytes.ok()) return state_bytes.status();
  std::vector<int64_t> local = {PeakRssBytes(), *state_bytes};
  // Every rank computes on the same kind of device, so all gather alike.
  const bool on_cuda = device.is_cuda();
  if (on_cuda) {
    const DeviceMemory m = CudaMemory(device);
    local.push_back(m.known ? m.peak_allocated : -1);
    local.push_back(m.known ? m.peak_reserved : -1);
  }
  const auto per_rank = GatherPerRank(group, local);
  if (group.rank() != 0) return absl::OkStatus();
  record.peak_rss_bytes = per_rank[0];
  record.sharded_state_bytes = per_rank[1];
  if (on_cuda) {
    record.cuda_peak_allocated_bytes = per_rank[2];
    record.cuda_peak_reserved_bytes = per_rank[3];
  }
  return log.Write(record);
}

// After `step`: its checkpoint when --checkpoint-every (or the last step)
// asks for one, else a step of the --async-checkpoint save in flight.
absl::Status CheckpointAfterStep(const Options& o, const comm::ProcessGroup& group,
                                 TrainedModel fsdp_model, torch::optim::Optimizer& optimizer,
                                 int64_t step, AsyncSave* async) {
  const bool checkpoint_now =
      !o.checkpoint_dir.empty() &&
      ((o.checkpoint_every > 0 && step % o.checkpoint_every == 0) || step == o.steps);
  if (checkpoint_now) return SaveTrainerCheckpoint(o, fsdp_model, optimizer, group, step, async);
  if (async != nullptr) return FinishAsyncSave(o, group, *async, /*block=*/false);
  return absl::OkStatus();
}

// What one step works on.
struct StepContext {
  const Options& o;
  const comm::ProcessGroup& group;
  TrainedModel fsdp_model;
  LanguageModel& model;
  torch::optim::Optimizer& optimizer;
  const std::vector<torch::Tensor>& params;
  const c10::Device& device;
};

// The CUDA graph of a run whose --cuda-graphs plan captures (cuda_graphs.h):
// the first kCudaGraphWarmupSteps steps run eagerly on the graph's side
// stream, the next is captured and replayed, every later one replayed.
struct GraphedStep {
  explicit GraphedStep(const c10::Device& device) : graph(device) {}
  StepGraph graph;
  int64_t eager_steps = 0;
  torch::Tensor static_batch;    // this rank's rows, on the device, refilled before each replay
  torch::Tensor static_figures;  // what the captured body returned
  // The update is in the graph, the optimizer capturable, reading
  // `found_inf` (float32, on the device, made before the capture and written
  // by WriteFoundInf in it).
  torch::Tensor found_inf;
};

// This rank's forward and backward on `batch`, then the step's figures as a
// float64 [2] tensor averaged over ranks: [global mean loss, > 0 when some
// rank's gradients hold NaN or Inf]. Only enqueued on a GPU: the loss and
// the flag stay on the device and the all-reduce is NCCL's, ordered on the
// stream (wait_on_stream), so nothing here makes the host wait; on the CPU
// it is Gloo's, as before.
torch::Tensor StepFigures(StepContext& c, const torch::Tensor& batch) {
  const torch::Tensor local_loss = ForwardBackward(c.o, c.fsdp_model, c.model, batch, c.device);
  const torch::Tensor grads_bad = LocalGradsNonFinite(c.params, c.device);
  torch::Tensor figures = torch::stack({local_loss, grads_bad.to(local_loss.device())});
  comm::all_reduce(c.group, figures, comm::ReduceOp::kAvg).wait_on_stream();
  return figures;
}

// With --clip: clips the gradients to it (fsdp's clip_grad_norm_: an
// all-reduce over all ranks' shards, the scale on the device) and appends
// the global norm to the step's [loss, flag]; else the figures as they are.
torch::Tensor ClippedFigures(StepContext& c, const torch::Tensor& figures) {
  if (c.o.clip <= 0) return figures;
  const torch::Tensor norm = c.fsdp_model.clip_grad_norm_(c.o.clip);
  return torch::cat({figures, norm.to(figures.device(), torch::kFloat64).reshape({1})});
}

// The step's one read of the device: [loss, flag(, norm)] to the host,
// checked by CheckStepFinite; the global mean loss.
absl::StatusOr<double> ReadStepFigures(const StepContext& c, int64_t step,
                                       const torch::Tensor& figures) {
  const torch::Tensor read = figures.to(torch::kCPU);
  const double* values = read.data_ptr<double>();
  const double grad_norm = c.o.clip > 0 ? values[2] : -1;
  if (auto s = CheckStepFinite(step, values[0], grad_norm, /*grads_finite=*/values[1] == 0.0);
      !s.ok()) {
    return s;
  }
  return values[0];
}

// One optimizer step on this rank's rows `batch` at learning rate `lr`;
// returns the global mean loss. A non-finite loss, gradient or (--clip)
// gradient norm on any rank ends the run here, before the optimizer update
// (finite_state.h), on every rank alike: the loss and a "some gradient is
// not finite" flag travel in one all-reduce. `graphed`: the step runs
// through the run's CUDA graph (GraphedTrainStep; nullptr: eagerly).
//
// Host synchronisations on CUDA: one per step, the read of [loss, flag]
// (and --clip's norm with them) just before the optimizer update, the
// latest point at which the update can still be withheld on the host
// (fsdp's clip_grad_norm_ scales on the device and reads nothing). Before:
// the [loss, flag] read, then the all-reduce on the host's Gloo, and with
// --clip a second read of the norm besides clip_grad_norm_'s own (1, or 3
// with --clip; now 1).
//
// Why the read comes before the update here rather than after it (with the
// update made a no-op on the device when the flag is set, as PyTorch's
// GradScaler does through found_inf): the ordinary optimizers take no
// found_inf (only optim/'s capturable mode does), so reading first is what
// keeps "a non-finite step stops before its optimizer update" exact, at the
// cost of the GPU idling while the host launches the (fused: a few kernels)
// update. GraphedTrainStep, whose optimizer is capturable, reads after the
// update instead, which found_inf withholds on the device.
absl::StatusOr<double> GraphedTrainStep(StepContext& c, int64_t step, double lr,
                                        const torch::Tensor& batch, GraphedStep& g);

absl::StatusOr<double> TrainStep(StepContext& c, int64_t step, double lr,
                                 const torch::Tensor& batch, AsyncSave* async,
                                 GraphedStep* graphed) {
  if (graphed != nullptr) return GraphedTrainStep(c, step, lr, batch, *graphed);
  SetStepLearningRate(c.optimizer, lr);  // the optimizer is not capturable here
  // Python's zero_grad(): no detach_ per gradient (optim::zero_grad).
  optim::zero_grad(c.optimizer);
  const auto global_loss = ReadStepFigures(c, step, ClippedFigures(c, StepFigures(c, batch)));
  if (!global_loss.ok()) return global_loss.status();
  // An async save in flight writes the live parameters and optimizer
  // state: they may change only once it has written them (in the time of
  // this step's forward and backward, usually).
  if (async != nullptr) async->saver.WaitUntilWritten();
  c.optimizer.step();
  return *global_loss;
}

// A step of a run with --cuda-graphs (cuda_graphs.h): the learning rate is
// written to the device first (no host synchronisation), then the step —
// forward and backward, [loss, flag] all-reduced, --clip's clipping (its
// norm appended to them), found_inf from them, the capturable update, which
// found_inf withholds on the device — runs eagerly on the side stream
// (warm-up), is captured and replayed, or is replayed; then the step's one
// read of [loss, flag(, norm)]. A non-finite step ends the run as in TrainStep, its update
// already withheld; the optimizer's host step counts follow
// (RecordGraphedOptimizerStep). No async save is in flight here
// (--async-checkpoint cannot be captured).
absl::StatusOr<double> GraphedTrainStep(StepContext& c, int64_t step, double lr,
                                        const torch::Tensor& batch, GraphedStep& g) {
  auto& capturable = dynamic_cast<optim::Capturable&>(c.optimizer);
  SetStepLearningRate(c.optimizer, lr);
  // The same code eagerly, captured and so replayed: the warm-up creates
  // the optimizer's state and device step counts the capture then finds.
  auto body = [&](const torch::Tensor& rows) {
    const torch::Tensor figures = ClippedFigures(c, StepFigures(c, rows));
    WriteFoundInf(figures, g.found_inf);
    c.optimizer.step();
    return figures;
  };
  GraphedPhase phase = GraphedPhase::kReplay;
  torch::Tensor figures;
  if (g.eager_steps < kCudaGraphWarmupSteps) {
    phase = GraphedPhase::kWarmup;
    optim::zero_grad(c.optimizer);
    g.graph.RunOnSideStream([&] { figures = body(batch); });
    ++g.eager_steps;
  } else if (!g.graph.captured()) {
    phase = GraphedPhase::kCapture;
    g.static_batch = batch.to(c.device);
    // As in TrainStep: the captured backward allocates the gradients in the
    // graph's pool and every replay overwrites them.
    optim::zero_grad(c.optimizer);
    g.graph.Capture([&] { g.static_figures = body(g.static_batch); });
    if (!capturable.last_step_replayable()) {
      return absl::InternalError(absl::StrCat(
          "step ", step,
          ": the captured optimizer step made or filled device values from the host (state, "
          "a step count or the learning rate not written before the capture): expected the "
          "warm-up steps to have created them; every replay would have repeated the writes"));
    }
    g.graph.Replay();  // runs the captured step (which counted itself)
    figures = g.static_figures;
  } else {
    g.static_batch.copy_(batch.pin_memory(), /*non_blocking=*/true);
    g.graph.Replay();
    figures = g.static_figures;
  }
  auto global_loss = ReadStepFigures(c, step, figures);
  RecordGraphedOptimizerStep(capturable, phase, global_loss.ok());
  return global_loss;
}

// The run's tokens and their split: the license bytes (--data text),
// --data PATH as `format` says, or its text encoded (`text`, --tokenizer);
// none for synthetic data. With --eval-every the last tenth is held out.
struct RunData {
  TokenData tokens;
  TokenSplit split;
};

absl::StatusOr<RunData> LoadRunData(const Options& o, DataFormat format, TextData* text,
                                    const comm::ProcessGroup& group) {
  RunData run;
  std::string what;
  if (o.data == DataKind::kSynthetic) return run;
  if (o.data == DataKind::kText) {
    auto corpus = LoadTextCorpus();
    if (!corpus.ok()) return corpus.status();
    run.tokens.tokens.assign(corpus->begin(), corpus->end());
    run.tokens.description = absl::StrCat(corpus->size(), " bytes of ", kLicenseDir);
    what = absl::StrCat("--data=text (", kLicenseDir, ")");
  } else if (text != nullptr) {
    auto encoded = text->Encode(group);
    if (!encoded.ok()) return encoded.status();
    run.tokens = std::move(*encoded);
    what = absl::StrCat("--data='", o.data_path, "'");
  } else {
    auto file = LoadDataFile(o.data_path, format, o.vocab);
    if (!file.ok()) return file.status();
    run.tokens = std::move(*file);
    what = absl::StrCat("--data='", o.data_path, "'");
  }
  auto split = SplitTokens(static_cast<int64_t>(run.tokens.tokens.size()), o.seq + 1,
                           o.eval_every > 0, what);
  if (!split.ok()) return split.status();
  run.split = *split;
  if (o.eval_every > 0) {
    absl::StrAppend(&run.tokens.description, ", the last ", split->val_end - split->val_begin,
                    " tokens held out");
  }
  return run;
}

// Global batches of the held-out tokens a validation loss averages over.
constexpr int64_t kEvalBatches = 4;

// The global mean loss over kEvalBatches fixed batches of the held-out
// split (batch k sampled as step -1-k: the same batches at every
// evaluation, for a seed), without gradients; every rank takes its rows.
absl::StatusOr<double> ValidationLoss(StepContext& c, const RunData& data) {
  torch::NoGradGuard no_grad;
  // The batches' losses summed on the device in float64, in batch order (the
  // sum the host computed before, bit for bit), and read once.
  torch::Tensor local;
  for (int64_t k = 0; k < kEvalBatches; ++k) {
    BatchSpec spec{static_cast<uint64_t>(c.o.seed),
                   -1 - k,
                   c.o.global_batch,
                   c.o.seq + 1,
                   c.group.rank(),
                   c.group.size()};
    auto batch =
        SampleTokenBatch(data.tokens.tokens, data.split.val_begin, data.split.val_end, spec);
    if (!batch.ok()) return batch.status();
    const torch::Tensor rows = c.device.is_cuda()
                                   ? batch->pin_memory().to(c.device, /*non_blocking=*/true)
                                   : batch->to(c.device);
    const torch::Tensor loss =
        c.fsdp_model.run([&] { return c.model.Loss(rows); }).to(torch::kFloat64);
    local = local.defined() ? local + loss : loss;
  }
  torch::Tensor l = (local / static_cast<double>(kEvalBatches)).reshape({1}).to(torch::kCPU);
  comm::all_reduce(c.group, l, comm::ReduceOp::kAvg).wait();
  return l.item<double>();
}

// The model --model names, built on the CPU: the transformer and the MLP
// from --layers/--dim/--heads/--vocab/--seq, a Llama-family model from its
// config.json (--hf-checkpoint's or --model-config), its weights
// initialised from --seed as transformers does (--hf-checkpoint's are
// loaded into the shards after wrapping: LoadHfIntoShards).
struct RunModel {
  std::shared_ptr<LanguageModel> model;
  std::optional<models::LlamaConfig> llama;  // --model llama
};

absl::StatusOr<RunModel> BuildRunModel(const Options& o) {
  RunModel run;
  if (o.model != ModelKind::kLlama) {
    const ModelConfig config{o.layers, o.dim, o.heads, o.vocab, o.seq};
    run.model = BuildModel(o.model == ModelKind::kMlp ? ModelType::kMlp : ModelType::kTransformer,
                           config, static_cast<uint64_t>(o.seed));
    return run;
  }
  const bool from_checkpoint = !o.hf_checkpoint.empty();
  const std::string config_path =
      from_checkpoint ? o.hf_checkpoint + "/config.json" : o.model_config;
  auto config = models::ReadLlamaConfig(config_path);
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat(from_checkpoint ? "--hf-checkpoint" : "--model-config", ": ",
                                     config.status().message()));
  }
  if (o.seq > config->max_position_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat("--seq=", o.seq, ": expected at most the model's max_position_embeddings=",
                     config->max_position_embeddings, " (", config_path, ")"));
  }
  if (config->sliding_window && o.seq > *config->sliding_window) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--seq=", o.seq, ": expected at most the model's sliding_window=", *config->sliding_window,
        " (", config_path, "; sliding-window attention is not implemented)"));
  }
  try {
    // Nothing is allocated until each rank's shards are (fully_shard:
    // wrap.cc's to_empty; FSDP1: a unit at a time, its param_init_fn), then
    // filled from the checkpoint or from InitialLlamaParameter
    // (FillLlamaShards): no rank ever holds the whole model.
    run.model = models::LlamaForCausalLM(*config, c10::kMeta).ptr();
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(absl::StrCat(config_path, ": ", e.what_without_backtrace()));
  }
  run.llama = std::move(*config);
  return run;
}

// --model llama without --hf-checkpoint: each rank's
// shards from the model's initial values, one whole tensor made at a time
// (the same values InitializeWeights gives the unsharded model).
absl::Status FillLlamaShards(const Options& o, const models::LlamaConfig& config,
                             TrainedModel model) {
  const state_dict::ShardedReader initial = [&](const state_dict::ShardRequests& requests)
      -> absl::StatusOr<state_dict::ShardedStateDict> {
    state_dict::ShardedStateDict out;
    for (const auto& [name, request] : requests) {
      // The loader first asks for every tensor with no ranges (a check of
      // names and shapes): nothing to draw for those.
      if (request.ranges.empty()) {
        out.insert(name, state_dict::ShardedTensor{request.global_shape, request.dtype, {}});
        continue;
      }
      const torch::Tensor full = models::InitialLlamaParameter(config, name, request.global_shape,
                                                               static_cast<uint64_t>(o.seed));
      out.insert(name, state_dict::ShardFullTensor(full.to(request.dtype), request.ranges));
    }
    return out;
  };
  return state_dict::LoadModelTensorByTensor(*model.shards(), "--model-config's initial values",
                                             initial);
}

}  // namespace

absl::StatusOr<TrainResult> Train(const Options& options, const comm::ProcessGroup& group) {
  auto built = BuildRunModel(options);
  if (!built.ok()) return built.status();
  // --model llama: its vocabulary is its config's (the data and the
  // synthetic batches are checked against and drawn from it).
  Options o = options;
  if (built->llama) {
    o.vocab = built->llama->vocab_size;
    if (o.data == DataKind::kText && o.vocab < 256) {
      return absl::InvalidArgumentError(
          absl::StrCat("--data=text: the model's vocab_size=", o.vocab,
                       " is below 256 (the corpus is byte-level): use --data with a token file"));
    }
  }
  const int world = group.size();
  const int rank = group.rank();
  const bool is_main = rank == 0;
  if (auto s = CheckFeatureAvailability(o, world); !s.ok()) return s;
  auto device = ComputeDevice(o);
  if (!device.ok()) return device.status();
  if (o.float8) {
    if (auto s = CheckFloat8Device(*device); !s.ok()) return s;
  }
  // --data PATH's layout (data.h) and --tokenizer, its vocabulary against the
  // model's (text_data.h), before anything is written; LoadRunData reads the
  // file or encodes the text.
  auto data_format = ResolveDataFormat(o);
  if (!data_format.ok()) return data_format.status();
  auto text = OpenTextData(o, group);
  if (!text.ok()) return text.status();
  // Before anything is built: a mistyped or shared --checkpoint-dir fails now.
  auto dir_lock = PrepareCheckpointDir(o, group);
  if (!dir_lock.ok()) return dir_lock.status();

  auto data = LoadRunData(o, *data_format, text->get(), group);
  if (!data.ok()) return data.status();

  std::shared_ptr<LanguageModel> model = built->model;
  int64_t num_params = 0;
  for (const auto& p : model->named_parameters()) num_params += p.value().numel();
  if (auto s = CheckHfExportTarget(o, group); !s.ok()) return s;
  if (o.float8) {
    auto converted = ConvertLinearsToFloat8(*model, o.float8_all_gather);
    if (!converted.ok()) return converted.status();
  }

  auto wrapped = Wrap(o, model, *device, group);  // per --fsdp
  if (!wrapped.ok()) return wrapped.status();
  const TrainedModel fsdp_model = wrapped->model();
  if (!o.hf_checkpoint.empty()) {
    if (auto s = LoadHfIntoShards(o, group, fsdp_model); !s.ok()) return s;
  } else if (built->llama) {
    if (auto s = FillLlamaShards(o, *built->llama, fsdp_model); !s.ok()) return s;
  }
  const std::vector<torch::Tensor> params = fsdp_model.parameters();
  std::unique_ptr<torch::optim::Optimizer> optimizer = MakeOptimizer(o, params);

  if (auto s = CheckDcpExportTarget(o, group); !s.ok()) return s;
  auto resumed_after = ResumeTrainer(o, group, fsdp_model, *optimizer);
  if (!resumed_after.ok()) return resumed_after.status();
  TrainResult result;
  result.first_step = *resumed_after + 1;
  // --cuda-graphs: refused here, before the first step, when on cannot be
  // honoured (trainer_main refuses it before starting ranks already, from
  // the flags; here the steps left after a resume are known too).
  auto graph_plan = PlanCudaGraphs(
      o, CaptureEnvironmentFor(o, *device, std::max<int64_t>(0, o.steps - result.first_step + 1)));
  if (!graph_plan.ok()) return graph_plan.status();

  JsonLogWriter log;
  if (is_main) {
    PrintRunHeader(o, world, fsdp_model, *device, num_params, data->tokens.description,
                   result.first_step);
    if (const std::string line = DescribeCudaGraphPlan(o, *graph_plan); !line.empty()) {
      std::printf("trainer: %s\n", line.c_str());
      std::fflush(stdout);
    }
    if (!o.log_json.empty()) {
      if (auto s = log.Open(o.log_json, /*append=*/o.resume); !s.ok()) return s;
    }
  }
  ProgressBar progress(result.first_step, o.steps, stdout, is_main && isatty(fileno(stdout)) != 0);
  if (is_main && o.profile_step > 0) {
    // Before step 1: a trace path that cannot be written fails now, not at
    // step N; a resumed run past step N says why no trace comes.
    if (auto s = CheckProfileTrace(o.profile_trace); !s.ok()) return s;
    if (o.profile_step < result.first_step) {
      std::printf(
          "profile: --profile-step=%lld is before this run's first step %lld "
          "(resumed): nothing is profiled\n",
          static_cast<long long>(o.profile_step), static_cast<long long>(result.first_step));
      std::fflush(stdout);
    }
  }

  const int64_t tokens_per_step = o.global_batch * o.seq;
  const Clock::time_point run_start = Clock::now();
  double total_tokens = 0;
  // Declared before the loop so that leaving it on an error still waits for
  // the background write (the destructor joins it) before the state goes.
  AsyncSave async_save;
  AsyncSave* async = o.async_checkpoint ? &async_save : nullptr;
  StepContext ctx{o, group, fsdp_model, *model, *optimizer, params, *device};
  std::unique_ptr<GraphedStep> graphed;
  if (graph_plan->capture) {
    graphed = std::make_unique<GraphedStep>(*device);
    // The update reads its learning rate and found_inf from the device
    // (optim/'s capturable mode); found_inf is made here, outside the pool.
    auto& capturable = dynamic_cast<optim::Capturable&>(*optimizer);
    capturable.set_capturable(true);
    graphed->found_inf = torch::zeros({}, torch::dtype(torch::kFloat32).device(*device));
    capturable.set_found_inf(graphed->found_inf);
  }
  for (int64_t step = result.first_step; step <= o.steps; ++step) {
    // The step's peaks (--log-json, an out-of-memory error) start here.
    ResetCudaPeaks(*device);
    const Clock::time_point step_start = Clock::now();
    const double lr = LearningRate(o, step);
    BatchSpec spec{static_cast<uint64_t>(o.seed), step, o.global_batch, o.seq + 1, rank, world};
    // An allocation that fails in the step (the batch, forward, backward,
    // the optimizer update) ends the run with an error naming the step and
    // the device's memory figures (IsOutOfMemory; the trainer exits
    // kExitOutOfMemory), before anything of this step is checkpointed.
    auto run_step = [&] {
      return GuardOutOfMemory(step, "the training step", *device, [&]() -> absl::StatusOr<double> {
        auto batch = o.data == DataKind::kSynthetic
                         ? SampleSyntheticBatch(o.vocab, spec)
                         : SampleTokenBatch(data->tokens.tokens, data->split.train_begin,
                                            data->split.train_end, spec);
        if (!batch.ok()) return batch.status();
        return TrainStep(ctx, step, lr, *batch, async, graphed.get());
      });
    };
    // --profile-step: exactly this step (batch, forward, backward, update)
    // under the profiler, on rank 0 only (one trace; the ranks run the same
    // kernels, and the others' timing is left undisturbed).
    const bool profiled = is_main && step == o.profile_step;
    auto step_loss = profiled ? ProfileStep(*device, step, o.profile_trace, run_step) : run_step();
    if (!step_loss.ok()) return step_loss.status();
    if (profiled) {
      progress.Message(absl::StrCat("profile: step ", step, " written to ", o.profile_trace));
    }
    const double global_loss = *step_loss;
    const double step_time = std::chrono::duration<double>(Clock::now() - step_start).count();
    result.losses.push_back(global_loss);
    total_tokens += static_cast<double>(tokens_per_step);

    const double tokens_per_s = static_cast<double>(tokens_per_step) / step_time;
    // Only the JSON log needs the per-rank figures: without it, no extra
    // collective per step. Every rank has the same options, so all agree.
    std::optional<double> val_loss;
    if (o.eval_every > 0 && (step % o.eval_every == 0 || step == o.steps)) {
      auto evaluated = GuardOutOfMemory(step, "the --eval-every evaluation", *device,
                                        [&] { return ValidationLoss(ctx, *data); });
      if (!evaluated.ok()) return evaluated.status();
      val_loss = *evaluated;
      if (is_main) {
        progress.Message(absl::StrFormat("step %d  val loss %.4f  perplexity %.4g", step, *val_loss,
                                         std::exp(*val_loss)));
      }
    }
    if (!o.log_json.empty()) {
      StepRecord record;
      record.step = step;
      record.loss = global_loss;
      record.lr = lr;
      record.step_time_s = step_time;
      record.tokens_per_s = tokens_per_s;
      record.val_loss = val_loss;
      if (auto s = LogStep(group, params, *optimizer, *device, log, std::move(record)); !s.ok()) {
        return s;
      }
    }
    if (is_main) {
      progress.Update(step, global_loss, tokens_per_s,
                      std::chrono::duration<double>(Clock::now() - run_start).count());
    }
    if (auto s = CheckpointAfterStep(o, group, fsdp_model, *optimizer, step, async); !s.ok()) {
      return s;
    }
  }
  if (async != nullptr) {
    if (auto s = FinishAsyncSave(o, group, *async, /*block=*/true); !s.ok()) return s;
  }
  if (!o.export_dcp.empty()) {
    const int64_t last_step = result.first_step - 1 + static_cast<int64_t>(result.losses.size());
    if (auto s = ExportDcp(o, group, fsdp_model, *optimizer, last_step); !s.ok()) return s;
  }
  if (!o.export_hf.empty()) {
    const c10::ScalarType dtype =
        o.export_hf_dtype == ExportDtype::kBf16 ? c10::kBFloat16 : c10::kFloat;
    if (auto s = ExportHf(o, group, fsdp_model, *optimizer,
                          models::LlamaConfigJson(*built->llama, dtype));
        !s.ok()) {
      return s;
    }
  }
  if (is_main) {
    const double elapsed = std::chrono::duration<double>(Clock::now() - run_start).count();
    progress.Finish(elapsed, elapsed > 0 ? total_tokens / elapsed : 0, PeakRssBytes());
  }
  return result;
}

}  // namespace trainer
