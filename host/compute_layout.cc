#include "host/compute_layout.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include <dlfcn.h>
#include <sys/sysinfo.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace host {

namespace {

// The path of the first mapped file whose name contains `needle`.
std::string MappedLibrary(const char* needle) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const auto slash = line.find('/');
    if (slash != std::string::npos && absl::StrContains(line.substr(slash), needle)) {
      return line.substr(slash);
    }
  }
  return "";
}

// OpenBLAS's thread entry points, when the process's BLAS is OpenBLAS.
using SetThreads = void (*)(int);
using GetThreads = int (*)();
SetThreads OpenBlasSetThreads() {
  return reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
}
GetThreads OpenBlasGetThreads() {
  return reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
}

std::string DescribeBlas() {
  const std::string path = MappedLibrary("libblas.so");
  std::string name = "unknown";
  if (absl::StrContains(path, "openblas")) {
    // /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
    const auto end = path.rfind('/');
    const auto begin = path.rfind('/', end - 1);
    name = absl::StrCat("OpenBLAS (", path.substr(begin + 1, end - begin - 1));
    if (GetThreads get = OpenBlasGetThreads()) {
      absl::StrAppend(&name, ", ", get(), get() == 1 ? " thread" : " threads");
    }
    absl::StrAppend(&name, ")");
  } else if (absl::StrContains(path, "/blas/")) {
    name = "reference BLAS (libblas3: unoptimised; tools/setup.sh installs OpenBLAS)";
  } else if (!path.empty()) {
    name = path;
  } else if (at::hasMKL()) {
    // The torch wheel links MKL into libtorch_cpu: no libblas is mapped.
    name = "MKL (in libtorch_cpu)";
  }
  return name;
}

}  // namespace

void SetComputeThreads(int threads) {
  at::set_num_threads(threads);
  if (SetThreads set = OpenBlasSetThreads()) set(threads);
}

absl::StatusOr<ThreadLayout> ApplyThreadLayout(int local_ranks, int requested_threads) {
  auto layout = PlanThreadLayout(local_ranks, requested_threads, std::getenv("OMP_NUM_THREADS"));
  if (layout.ok()) SetComputeThreads(layout->threads_per_rank);
  return layout;
}

std::string DescribeComputeLayout(int local_ranks) {
  const int threads = at::get_num_threads();
  const std::vector<int> cpus = AvailableCpus();
  const int cores = static_cast<int>(cpus.size());
  const int online = get_nprocs();
  // A rank the launcher bound to its own cores (LaunchOptions::bind_cores).
  const std::string where = cores < online && local_ranks > 1
                                ? absl::StrCat(", this rank bound to CPU", cores == 1 ? " " : "s ",
                                               absl::StrJoin(cpus, ","), " of ", online)
                                : absl::StrCat(" on ", cores, cores == 1 ? " core" : " cores");
  return absl::StrCat(
      local_ranks, local_ranks == 1 ? " rank x " : " ranks x ", threads,
      threads == 1 ? " thread" : " threads", where, "; BLAS: ", DescribeBlas(),
      "; allocator: ", MappedLibrary("libtcmalloc").empty() ? "glibc malloc" : "tcmalloc");
}

}  // namespace host
