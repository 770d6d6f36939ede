#include "host/thread_layout.h"

#include <sched.h>

#include <algorithm>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace host {

namespace {

const char* SourceText(ThreadLayout::Source source) {
  switch (source) {
    case ThreadLayout::Source::kAutomatic: return "automatic: cores / ranks";
    case ThreadLayout::Source::kRequested: return "--threads-per-rank";
    case ThreadLayout::Source::kEnvironment: return "OMP_NUM_THREADS";
  }
  return "?";
}

const char* Plural(int n, const char* one, const char* many) { return n == 1 ? one : many; }

}  // namespace

std::string ThreadLayout::ToString() const {
  return absl::StrCat(local_ranks, Plural(local_ranks, " rank x ", " ranks x "), threads_per_rank,
                      Plural(threads_per_rank, " thread", " threads"), " on ", cores,
                      Plural(cores, " core", " cores"), " (", SourceText(source), ")");
}

std::vector<int> AvailableCpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
    }
  }
  if (cpus.empty()) {
    const int n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    for (int cpu = 0; cpu < n; ++cpu) cpus.push_back(cpu);
  }
  return cpus;
}

int AvailableCores() { return static_cast<int>(AvailableCpus().size()); }

std::vector<int> CpusOfRank(const ThreadLayout& layout, int local_rank) {
  const int64_t needed = int64_t{layout.local_ranks} * layout.threads_per_rank;
  if (local_rank < 0 || local_rank >= layout.local_ranks || layout.threads_per_rank < 1 ||
      needed > static_cast<int64_t>(layout.cpus.size())) {
    return {};
  }
  const auto first = layout.cpus.begin() + int64_t{local_rank} * layout.threads_per_rank;
  return std::vector<int>(first, first + layout.threads_per_rank);
}

absl::StatusOr<ThreadLayout> PlanThreadLayout(int local_ranks, int requested_threads,
                                              const char* omp_num_threads) {
  if (local_ranks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("local ranks = ", local_ranks, ": expected a positive integer"));
  }
  if (requested_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--threads-per-rank=", requested_threads,
                     ": expected a positive integer (or 0 for automatic)"));
  }
  ThreadLayout layout;
  layout.cpus = AvailableCpus();
  layout.cores = static_cast<int>(layout.cpus.size());
  layout.local_ranks = local_ranks;
  if (requested_threads > 0) {
    layout.threads_per_rank = requested_threads;
    layout.source = ThreadLayout::Source::kRequested;
  } else if (omp_num_threads != nullptr) {
    int threads = 0;
    if (!absl::SimpleAtoi(omp_num_threads, &threads) || threads < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("OMP_NUM_THREADS='", omp_num_threads, "': expected a positive integer"));
    }
    layout.threads_per_rank = threads;
    layout.source = ThreadLayout::Source::kEnvironment;
  } else {
    layout.threads_per_rank = std::max(1, layout.cores / local_ranks);
  }
  // More ranks than cores is the caller's choice of ranks; only threads
  // beyond each rank's share of the cores are this plan's to warn about.
  const int share = std::max(1, layout.cores / layout.local_ranks);
  if (layout.threads_per_rank > share) {
    layout.warning =
        absl::StrCat("oversubscribed: ", layout.local_ranks, " local ranks x ",
                     layout.threads_per_rank, " threads (", SourceText(layout.source),
                     ") = ", layout.local_ranks * layout.threads_per_rank, " threads on ",
                     layout.cores, " cores; at most ", share, " threads per rank would fit");
  }
  return layout;
}

}  // namespace host
