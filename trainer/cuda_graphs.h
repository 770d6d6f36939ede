// --cuda-graphs auto|on|off (issue 47 item 5): the whole training step —
// forward, backward, the reduction of its loss and non-finite flag, and the
// optimizer update — captured once into a CUDA graph with a private memory
// pool and replayed every step after, so a step costs the GPU one graph
// launch instead of one launch per kernel.
//
// What is captured and what is not, and why:
//   * captured: the forward and backward of every micro-batch (--grad-accum's
//     no_sync micro-batches too: a fixed sequence), FSDP's all-gathers and
//     reduce-scatters (NCCL), the gradients' non-finite flag, the all-reduce
//     of [loss, flag] (NCCL), with --clip fsdp's clip_grad_norm_ (its
//     all-reduce ordered on the stream, the scale computed on the device),
//     found_inf (1.0 when the global loss, the norm or some rank's gradients
//     are not finite: WriteFoundInf) and the optimizer update: optim/'s
//     fused Adam / AdamW / SGD in capturable mode (optim/optimizers.h),
//     which read the learning rate from a device tensor, advance Adam's step
//     counts on the device and skip the whole update on the device when
//     found_inf is 1. The batch is copied into a static device
//     buffer before each replay; the gradients live in the graph's pool and
//     are overwritten by each replay (no zero_grad between replays).
//   * eager, before each replay (the current stream, no host
//     synchronisation): the batch copy and the learning rate of the step
//     (LearningRate, lr_schedule.h) written into the optimizer's device lr
//     tensors (SetStepLearningRate: a fill_ per param group).
//   * eager, after the replay: the host's one read of [loss, flag(, norm)] and the
//     check that stops a non-finite run (finite_state.h). The update was
//     already withheld on the device by found_inf, so a non-finite step still
//     changes no parameter, moment or step count; the host's int64 step
//     counts (what checkpoints save) are kept by RecordGraphedOptimizerStep
//     without reading the device (one more per replay, one less for a
//     skipped step).
//   * the first kCudaGraphWarmupSteps steps of a run run eagerly on the side
//     stream the capture uses (lazy initialisation: cuBLAS workspaces, NCCL
//     communicators, the optimizer's state and device step tensors: the
//     same code as captured, so nothing is created inside the capture), the
//     next is captured and then replayed, and every later step is a replay.
//
// The decision (CudaGraphBlockers) names every reason a configuration
// cannot be captured; PlanCudaGraphs turns it into what the run does:
// --cuda-graphs=off is eager and says nothing; auto (the default) captures
// when there is no reason and otherwise prints one line naming every reason
// and runs eagerly; on with any reason is refused before training,
// naming the flag and every reason.
//
// The capture itself has NEVER RUN ON A GPU: it compiles in the CUDA build
// (--config=cuda, the CMake GPU build), and trainer_cuda_graphs
// (trainer/trainer_gpu_check.h) is ready for the GPU machine. Without CUDA
// (the default build) StepGraph throws if used, which PlanCudaGraphs never
// allows (the reason "not CUDA" is always there). The host side of the
// captured update (SetStepLearningRate, WriteFoundInf,
// RecordGraphedOptimizerStep) runs and is tested on the CPU.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/optim/optimizer.h>

#include "absl/status/statusor.h"
#include "optim/optimizers.h"
#include "trainer/options.h"

namespace trainer {

// Eager steps before the capture (PyTorch's whole-network capture example
// warms up 3 iterations on the side stream).
inline constexpr int64_t kCudaGraphWarmupSteps = 3;

// Whether this binary was compiled with the capture (TORCHFSDP_CUDA).
bool CudaGraphsBuilt();

// What the decision needs beyond the flags.
struct CaptureEnvironment {
  bool built_with_cuda = false;  // CudaGraphsBuilt()
  bool on_cuda = false;          // the step computes on a CUDA device
  // The process group's backend string (ProcessGroupBackend): CUDA tensors
  // must go to NCCL, the only backend whose collectives can be captured.
  std::string backend;
  // Steps this run trains (after a resume, those left).
  int64_t steps_to_train = 0;
};

// The environment of a run with `options` on `device` (this binary, its
// backend) training `steps_to_train` steps.
CaptureEnvironment CaptureEnvironmentFor(const Options& options, const c10::Device& device,
                                         int64_t steps_to_train);

// Every reason the step of a run with `options` in `env` cannot be captured,
// each naming the flag (or what is missing) and why; empty when it can.
// --cuda-graphs itself does not matter here.
std::vector<std::string> CudaGraphBlockers(const Options& options, const CaptureEnvironment& env);

struct CudaGraphPlan {
  bool capture = false;  // the whole step, the optimizer made capturable
  // auto falling back to eager: the reasons (printed once by rank 0).
  std::vector<std::string> reasons;
};

// --cuda-graphs=off: eager, no reasons. auto: capture when CudaGraphBlockers
// is empty, else eager with its reasons. on: capture, or InvalidArgument
// "--cuda-graphs=on: the step cannot be captured: <reason>; <reason>
// (--cuda-graphs=auto runs eagerly instead)".
absl::StatusOr<CudaGraphPlan> PlanCudaGraphs(const Options& options, const CaptureEnvironment& env);

// The line rank 0 prints for a plan: "cuda graphs: the step (forward,
// backward, ..., the optimizer update) is captured after 3 eager steps and
// replayed; ...", or "cuda graphs: eager step
// (--cuda-graphs=auto): <reason>; <reason>"; empty for off.
std::string DescribeCudaGraphPlan(const Options& options, const CudaGraphPlan& plan);

// ---- the host side of a captured optimizer update (CPU-testable) ----------

// The learning rate of the step about to run, eagerly, captured or
// replayed: every param group's lr option (what checkpoints save and the
// ordinary update reads) and, for an optimizer in capturable mode
// (optim::Capturable), its device lr tensors (write_device_values: one
// fill_ per group whose rate changed, enqueued on the current stream, no
// host synchronisation). Call it outside any capture, before the step.
void SetStepLearningRate(torch::optim::Optimizer& optimizer, double lr);

// found_inf for the captured update, computed on the device with no host
// read: `found_inf` (float32, one element) := 1.0 when the step's `figures`
// ([global mean loss, mean over ranks of "this rank's gradients hold NaN or
// Inf"], float64 [2], and with --clip the global gradient norm, [3]) say the
// step is not finite — the global loss or the norm is NaN or Inf, or the
// flag is not 0: exactly what CheckStepFinite refuses on the host after the
// read — else 0.0.
void WriteFoundInf(const at::Tensor& figures, at::Tensor& found_inf);

// Which step of a graphed run: an eager warm-up step, the step captured
// (then replayed once to run it), or a replay of the captured step.
enum class GraphedPhase { kWarmup, kCapture, kReplay };

// The optimizer's host step counts after a graphed step whose update ran in
// capturable mode, once the host has read whether the step was `finite`:
// a replay is counted (record_replayed_step: the warm-up and capturing
// step()s counted themselves), and a step that was not finite was skipped on
// the device by found_inf, so its count is taken back (record_skipped_step).
void RecordGraphedOptimizerStep(optim::Capturable& optimizer, GraphedPhase phase, bool finite);

// One captured CUDA graph of the step with its private memory pool and the
// side stream it is captured on (CUDA build only: elsewhere every method
// throws, naming the missing TORCHFSDP_CUDA).
class StepGraph {
 public:
  explicit StepGraph(const c10::Device& device);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // Runs `body` eagerly on the side stream, ordered after the work already
  // queued on the current stream and before what is queued on it next (the
  // warm-up steps).
  void RunOnSideStream(const std::function<void()>& body);
  // Captures `body` (which must not synchronise with the host) on the side
  // stream into the graph's private pool. The captured work has not run.
  void Capture(const std::function<void()>& body);
  // Launches the captured graph on the current stream.
  void Replay();
  bool captured() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainer
