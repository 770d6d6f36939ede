// trainer/'s checks for the GPU machine (benchmarks/gpu_check runs them, one
// PASS/FAIL line each; testing/gpu_check.h):
//
//   trainer_cuda_graphs  the trainer (trainer::Train, an NCCL world of 1 on
//                        cuda:0, the transformer in FSDP FULL_SHARD on
//                        synthetic batches, fused AdamW with the cosine
//                        schedule and its warm-up) for 16 steps with
//                        --cuda-graphs=off and with --cuda-graphs=on (3
//                        eager warm-up steps, the capture of the whole step
//                        with its optimizer update, 12 replays during which
//                        the learning rate falls from 0.93 to 0 of --lr):
//                        the losses must agree within rtol 1e-5 (the replays
//                        run the kernels the eager steps run, on other
//                        addresses, the learning rate read from a float32
//                        device tensor); a run with the constant schedule
//                        (a stand-in for a learning rate frozen at the
//                        capture) must differ from the cosine run by more
//                        than 100x that, or the comparison could not see a
//                        frozen rate; the same pair with --clip (the
//                        clipping captured with the rest) within rtol 1e-5;
//                        and a replayed step must
//                        make no more host synchronisations than an eager one
//                        (CUDA's sync-debug mode warn counts them; per step
//                        from the difference between a 16-step and an 8-step
//                        run, so the set-up's and the capture's own do not
//                        count). Prints the steps' wall time both ways (not
//                        a pass condition).
//
// Under gpu_check --dry-run-on-cpu the same runs on the CPU, where on is
// refused ("not CUDA") and auto runs eagerly: the check's own logic only.
// NEVER YET RUN ON A GPU (written without one; 2026-11-29; the captured
// optimizer update added since, likewise never run).
#pragma once

#include <vector>

#include <c10/core/Device.h>

#include "testing/gpu_check.h"

namespace trainer {

std::vector<gpu_check::Check> TrainerGpuChecks(c10::Device device);

}  // namespace trainer
