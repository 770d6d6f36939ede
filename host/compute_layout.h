// Applies a ThreadLayout (host/thread_layout.h) inside a process, and says
// what the process actually computes with: its intra-op threads, the BLAS
// library LibTorch's matmuls land in and its threads, and the allocator.
//
// Ranks started by launcher::launch (//tools:launch, the trainer's --nproc)
// get OMP_NUM_THREADS and need nothing here; a process computing on its own
// (one trainer rank, a benchmark) must apply the layout, because without
// OMP_NUM_THREADS LibTorch sizes its intra-op pool itself, from the count of
// physical cores (MKL's or cpuinfo's), which on some VMs is below the CPUs
// the process may use (one core for two CPUs). The torch wheel's BLAS is MKL
// inside libtorch_cpu, which at::set_num_threads sizes too; a LibTorch built
// against a system OpenBLAS (TORCHFSDP_LIBTORCH) has a pool of its own, which
// SetComputeThreads also sizes.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "host/thread_layout.h"

namespace host {

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

}  // namespace host
