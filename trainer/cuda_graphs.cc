#include "trainer/cuda_graphs.h"

#include <utility>

#include <ATen/ops/isfinite.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/logical_or.h>
#include <ATen/ops/ne.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"
#include "comm/process_group.h"

#ifdef TORCHFSDP_CUDA
// Device-generic c10::Event and c10::StreamGuard rather than
// at::cuda::CUDAEvent and CUDAStreamGuard: those inline the CUDA runtime's
// calls into this file, which would then need libcudart at link time besides
// libtorch_cuda (a dynamically linked test has no other way to it).
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace trainer {

bool CudaGraphsBuilt() {
#ifdef TORCHFSDP_CUDA
  return true;
#else
  return false;
#endif
}

CaptureEnvironment CaptureEnvironmentFor(const Options& o, const c10::Device& device,
                                         int64_t steps_to_train) {
  CaptureEnvironment env;
  env.built_with_cuda = CudaGraphsBuilt();
  env.on_cuda = device.is_cuda();
  env.backend = o.device == Device::kCuda ? comm::kGlooCpuNcclCuda : "gloo";
  env.steps_to_train = steps_to_train;
  return env;
}

std::vector<std::string> CudaGraphBlockers(const Options& o, const CaptureEnvironment& env) {
  std::vector<std::string> why;
  if (!env.on_cuda) {
    why.push_back(absl::StrCat("not CUDA (--device=", Name(o.device),
                               "): a CUDA graph holds CUDA work only"));
  } else if (!env.built_with_cuda) {
    why.push_back(
        "this trainer was built without the capture (TORCHFSDP_CUDA undefined): build it with "
        "--config=cuda or the CMake GPU build");
  }
  // Only NCCL collectives can be captured; Gloo runs on host threads. A world
  // of 1 still runs FSDP's collectives through the group.
  if (env.on_cuda && !absl::StrContains(env.backend, "cuda:nccl") && env.backend != "nccl") {
    why.push_back(absl::StrCat("the process group's backend '", env.backend,
                               "' does not run CUDA collectives on NCCL (Gloo's run on host "
                               "threads, which a capture cannot record)"));
  }
  if (o.cpu_offload) {
    why.push_back(
        "--cpu-offload: the shards live on the CPU, so every step copies them between host and "
        "GPU and updates them on the CPU, outside anything a CUDA graph records");
  }
  if (o.async_checkpoint) {
    why.push_back(
        "--async-checkpoint: its writer thread copies the live state to the host with "
        "synchronising copies while the next step runs, which fail while a capture is in "
        "progress");
  }
  if (o.eval_every > 0) {
    why.push_back(
        "--eval-every: the evaluation's eager forward between replays gathers FSDP's unsharded "
        "parameters outside the graph's memory pool, which the captured step has not been "
        "checked to tolerate");
  }
  if (o.profile_step > 0) {
    why.push_back(
        "--profile-step: a replayed step shows in the trace as one graph launch, not the kernels "
        "the profile is taken for");
  }
  if (env.steps_to_train <= kCudaGraphWarmupSteps) {
    why.push_back(absl::StrCat("this run trains ", env.steps_to_train, " step",
                               env.steps_to_train == 1 ? "" : "s", " (--steps=", o.steps,
                               "): the capture follows ", kCudaGraphWarmupSteps,
                               " eager warm-up steps, leaving nothing to replay"));
  }
  return why;
}

absl::StatusOr<CudaGraphPlan> PlanCudaGraphs(const Options& o, const CaptureEnvironment& env) {
  CudaGraphPlan plan;
  if (o.cuda_graphs == CudaGraphs::kOff) return plan;
  plan.reasons = CudaGraphBlockers(o, env);
  if (plan.reasons.empty()) {
    plan.capture = true;
    return plan;
  }
  if (o.cuda_graphs == CudaGraphs::kOn) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--cuda-graphs=on: the step cannot be captured: ", absl::StrJoin(plan.reasons, "; "),
        " (--cuda-graphs=auto runs eagerly instead)"));
  }
  return plan;
}

std::string DescribeCudaGraphPlan(const Options& o, const CudaGraphPlan& plan) {
  if (o.cuda_graphs == CudaGraphs::kOff) return "";
  if (plan.capture) {
    return absl::StrCat(
        "cuda graphs: the step (forward, backward, its loss reduction, ",
        o.clip > 0 ? "the clipping, " : "", "the optimizer update) is captured after ",
        kCudaGraphWarmupSteps,
        " eager steps and replayed; the learning rate is written to the device before each "
        "replay");
  }
  return absl::StrCat("cuda graphs: eager step (--cuda-graphs=", Name(o.cuda_graphs),
                      "): ", absl::StrJoin(plan.reasons, "; "));
}

void SetStepLearningRate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
  auto* capturable = dynamic_cast<optim::Capturable*>(&optimizer);
  if (capturable != nullptr && capturable->capturable()) capturable->write_device_values();
}

void WriteFoundInf(const at::Tensor& figures, at::Tensor& found_inf) {
  TORCH_CHECK(figures.dim() == 1 && figures.size(0) >= 2 && figures.size(0) <= 3,
              "trainer::WriteFoundInf: figures has shape ", figures.sizes(),
              ": expected [loss, flag] or [loss, flag, gradient norm]");
  at::NoGradGuard no_grad;
  at::Tensor bad = at::logical_or(at::logical_not(at::isfinite(figures[0])), at::ne(figures[1], 0));
  if (figures.size(0) == 3) bad = at::logical_or(bad, at::logical_not(at::isfinite(figures[2])));
  found_inf.copy_(bad.reshape(found_inf.sizes()));
}

void RecordGraphedOptimizerStep(optim::Capturable& optimizer, GraphedPhase phase, bool finite) {
  if (phase == GraphedPhase::kReplay) optimizer.record_replayed_step();
  if (!finite) optimizer.record_skipped_step();
}

#ifdef TORCHFSDP_CUDA

struct StepGraph::Impl {
  explicit Impl(const c10::Device& device)
      : device(device),
        side(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {}
  c10::Device device;
  c10::Stream side;
  at::cuda::CUDAGraph graph;
  bool captured = false;

  // `waiter` waits for what is queued on `producer` so far (an event, not
  // the host).
  static void Wait(const c10::Stream& waiter, const c10::Stream& producer) {
    c10::Event event(producer.device_type());
    event.record(producer);
    event.block(waiter);
  }

  // `body` on the side stream, ordered between the current stream's work
  // before and after.
  void OnSide(const std::function<void()>& body) {
    const c10::Stream current = c10::cuda::getCurrentCUDAStream(device.index());
    Wait(side, current);
    {
      c10::StreamGuard guard(side);
      body();
    }
    Wait(current, side);
  }
};

StepGraph::StepGraph(const c10::Device& device) : impl_(std::make_unique<Impl>(device)) {
  TORCH_CHECK(device.is_cuda(), "trainer::StepGraph: device ", device, ": expected a CUDA device");
}

StepGraph::~StepGraph() = default;

void StepGraph::RunOnSideStream(const std::function<void()>& body) { impl_->OnSide(body); }

void StepGraph::Capture(const std::function<void()>& body) {
  TORCH_CHECK(!impl_->captured, "trainer::StepGraph::Capture: already captured");
  // A capture may not start while the side stream still has eager work
  // queued from a warm-up step: it reads that work's results.
  impl_->OnSide([&] {
    impl_->side.synchronize();
    // Its own private pool ({0, 0}: CUDAGraph makes one): what the step
    // allocates while captured is kept for the replays and never handed to
    // eager code in between.
    impl_->graph.capture_begin();
    try {
      body();
    } catch (...) {
      // End the capture so the stream is usable again, then rethrow the cause.
      try {
        impl_->graph.capture_end();
      } catch (const c10::Error&) {
      }
      throw;
    }
    impl_->graph.capture_end();
  });
  impl_->captured = true;
}

void StepGraph::Replay() {
  TORCH_CHECK(impl_->captured, "trainer::StepGraph::Replay: nothing captured yet");
  impl_->graph.replay();
}

bool StepGraph::captured() const { return impl_->captured; }

#else  // !TORCHFSDP_CUDA

struct StepGraph::Impl {};

namespace {
[[noreturn]] void NotBuilt(const char* what) {
  TORCH_CHECK(false, "trainer::StepGraph::", what,
              ": this binary was built without CUDA graphs (TORCHFSDP_CUDA undefined); "
              "PlanCudaGraphs never captures here");
}
}  // namespace

StepGraph::StepGraph(const c10::Device&) { NotBuilt("StepGraph"); }
StepGraph::~StepGraph() = default;
void StepGraph::RunOnSideStream(const std::function<void()>&) { NotBuilt("RunOnSideStream"); }
void StepGraph::Capture(const std::function<void()>&) { NotBuilt("Capture"); }
void StepGraph::Replay() { NotBuilt("Replay"); }
bool StepGraph::captured() const { return false; }

#endif  // TORCHFSDP_CUDA

}  // namespace trainer
