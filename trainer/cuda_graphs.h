// --cuda-graphs auto|on|off (issue 47 item 5): the training step's forward
// and backward, with the reduction of its loss and non-finite flag, captured
// once into a CUDA graph with a private memory pool and replayed every step
// after, so a step costs the GPU one graph launch instead of one launch per
// kernel.
//
// What is captured and what is not, and why:
//   * captured: the forward and backward of every micro-batch (--grad-accum's
//     no_sync micro-batches too: a fixed sequence), FSDP's all-gathers and
//     reduce-scatters (NCCL), the gradients' non-finite flag and the
//     all-reduce of [loss, flag] (NCCL). The batch is copied into a static
//     device buffer before each replay; the gradients live in the graph's
//     pool and are overwritten by each replay (no zero_grad between replays).
//   * eager, after the replay: the host's one read of [loss, flag] (the check
//     that stops a non-finite step before its update, finite_state.h) and the
//     optimizer step. optim/'s fused AdamW takes the learning rate as a host
//     number and advances its host-side int64 step count; captured, both would
//     freeze at their capture-time values (the LR schedule would stop and
//     checkpoints would save a wrong step). Keeping the update eager keeps the
//     schedule exact at the cost of its few launches (one fused kernel per
//     device and dtype, and the step-count add). Capturing it too needs optim/
//     to take the learning rate as a device tensor and a found_inf tensor (ATen's
//     _fused_adamw_ has both), and the step check to move after the update.
//   * the first kCudaGraphWarmupSteps steps of a run run eagerly on the side
//     stream the capture uses (lazy initialisation: cuBLAS workspaces, NCCL
//     communicators, the optimizer's state), the next is captured and then
//     replayed, and every later step is a replay.
//
// The decision (CudaGraphBlockers) names every reason a configuration
// cannot be captured; PlanCudaGraphs turns it into what the run does:
// --cuda-graphs=off is eager and says nothing; auto (the default) captures
// when there is no reason and otherwise prints one line naming every reason
// and runs eagerly; on with any reason is refused before training,
// naming the flag and every reason.
//
// The capture itself has NEVER RUN ON A GPU: it compiles in the CUDA build
// (--config=cuda, the CMake GPU build), and trainer_cuda_graphs_gpu_check
// (trainer/trainer_gpu_check.h) is ready for the GPU machine. Without CUDA
// (the default build) StepGraph throws if used, which PlanCudaGraphs never
// allows (the reason "not CUDA" is always there).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "absl/status/statusor.h"
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
  bool capture = false;
  // auto falling back to eager: the reasons (printed once by rank 0).
  std::vector<std::string> reasons;
};

// --cuda-graphs=off: eager, no reasons. auto: capture when CudaGraphBlockers
// is empty, else eager with its reasons. on: capture, or InvalidArgument
// "--cuda-graphs=on: the step cannot be captured: <reason>; <reason>
// (--cuda-graphs=auto runs eagerly instead)".
absl::StatusOr<CudaGraphPlan> PlanCudaGraphs(const Options& options, const CaptureEnvironment& env);

// The line rank 0 prints for a plan: "cuda graphs: the step is captured
// after 3 eager steps and replayed", or "cuda graphs: eager step
// (--cuda-graphs=auto): <reason>; <reason>"; empty for off.
std::string DescribeCudaGraphPlan(const Options& options, const CudaGraphPlan& plan);

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
