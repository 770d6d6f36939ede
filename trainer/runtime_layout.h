// What a rank actually computes with: its intra-op threads, the BLAS
// library LibTorch's matmuls land in and its threads, and the allocator.
// Read from the running process, not from flags, so the line the trainer
// prints is true even when an outside launcher or LD_PRELOAD chose.
#pragma once

#include <string>

namespace trainer {

// Sets LibTorch's intra-op threads and, when the BLAS is OpenBLAS, its
// threads too (OpenBLAS sizes its pool from OMP_NUM_THREADS at load time,
// so a process that was not started with it set needs telling).
void SetComputeThreads(int threads);

// "2 ranks x 1 thread on 2 cores; BLAS: OpenBLAS (openblas-pthread,
// 1 thread); allocator: tcmalloc".
std::string DescribeRuntimeLayout(int local_ranks);

}  // namespace trainer
