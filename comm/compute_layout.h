// Applies a ThreadLayout (comm/thread_layout.h) inside a process, and says
// what the process actually computes with: its intra-op threads, the BLAS
// library LibTorch's matmuls land in and its threads, and the allocator.
//
// Ranks started by comm::launch get OMP_NUM_THREADS and need nothing here; a
// process computing on its own (one trainer rank, a benchmark) must apply
// the layout, because LibTorch 1.13 otherwise sizes its pool from cpuinfo's
// physical-core count (1 on some VMs), and OpenBLAS's OpenMP build then
// follows LibTorch's pool down to 1 thread.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "comm/thread_layout.h"

namespace comm {

// Sets LibTorch's intra-op threads and, when the BLAS is OpenBLAS, its
// threads too (OpenBLAS sizes its pool from OMP_NUM_THREADS at load time,
// so a process that was not started with it set needs telling).
void SetComputeThreads(int threads);

// PlanThreadLayout(local_ranks, requested_threads, $OMP_NUM_THREADS), then
// SetComputeThreads with its threads_per_rank. The caller prints the
// layout's warning, if any.
absl::StatusOr<ThreadLayout> ApplyThreadLayout(int local_ranks, int requested_threads);

// "2 ranks x 1 thread on 2 cores; BLAS: OpenBLAS (openblas-pthread,
// 1 thread); allocator: tcmalloc".
std::string DescribeComputeLayout(int local_ranks);

}  // namespace comm
