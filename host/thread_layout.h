// How many intra-op threads each local rank runs with, so that ranks x
// threads fill the machine's cores without oversubscribing them.
//
// LibTorch's OpenMP pool and its BLAS (the torch wheel's MKL, or an
// OpenBLAS) size themselves from OMP_NUM_THREADS, so one number per rank
// governs both; Gloo's I/O threads mostly sleep in epoll and are not counted.
// The launcher sets OMP_NUM_THREADS for every rank from this plan; a process
// that trains in place (one rank, no launcher) applies it with
// ApplyThreadLayout (host/compute_layout.h). No LibTorch here.
//
// Precedence: an explicit request (a --threads-per-rank flag) over an
// OMP_NUM_THREADS already in the environment over the automatic
// cores / local ranks (at least 1).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace host {

struct ThreadLayout {
  enum class Source { kAutomatic, kRequested, kEnvironment };

  int cores = 1;             // CPUs this process may run on
  std::vector<int> cpus;     // their ids, ascending (cores of them)
  int local_ranks = 1;       // ranks sharing those cores
  int threads_per_rank = 1;  // intra-op threads of each rank
  Source source = Source::kAutomatic;

  // Non-empty when threads_per_rank exceeds the rank's share of the cores
  // (cores / local_ranks, at least 1): a chosen oversubscription is allowed
  // but never silent.
  std::string warning;

  // "2 ranks x 1 thread on 2 cores (automatic: cores / ranks)".
  std::string ToString() const;
};

// CPUs in this process's affinity mask (a cpuset or taskset narrows it),
// which can be fewer than the machine has.
int AvailableCores();
// Their ids, ascending.
std::vector<int> AvailableCpus();

// The CPUs local rank `local_rank` is bound to: the rank's own
// threads_per_rank of layout.cpus (rank 0 the first ones), so its compute
// threads and its Gloo threads stay on its cores and off its neighbours'.
// Empty (no binding: the rank runs on all of them) when local_ranks x
// threads_per_rank do not fit the CPUs, or local_rank is out of range.
std::vector<int> CpusOfRank(const ThreadLayout& layout, int local_rank);

// `requested_threads` 0 means not requested. `omp_num_threads` is the
// environment's OMP_NUM_THREADS, or nullptr when unset. A request or an
// OMP_NUM_THREADS that is not a positive integer is InvalidArgument naming
// it; `local_ranks` < 1 likewise.
absl::StatusOr<ThreadLayout> PlanThreadLayout(int local_ranks, int requested_threads,
                                              const char* omp_num_threads);

}  // namespace host
