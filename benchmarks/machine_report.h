#pragma once

// Shared by the single-process benchmarks:
//
//   UseAllCores()      applies comm's thread layout (cores, or
//                      OMP_NUM_THREADS when set) before anything runs:
//                      LibTorch 1.13 would size its pool from cpuinfo's
//                      physical cores (1 on these VMs), and the OpenMP
//                      OpenBLAS follows that pool.
//   ThreadsLabel()     the threads a run actually used, as a benchmark label:
//                      LibTorch's intra-op threads (at::get_num_threads(), as
//                      the environment set them) and, separately, OpenBLAS's
//                      own pthread pool, which sgemm uses whatever LibTorch's
//                      setting is (Debian's LibTorch calls the generic
//                      libblas.so.3 interface and never sets OpenBLAS's
//                      threads). The OPENBLAS_* variables are reported as
//                      found, never set.
//   SummaryReporter    the console reporter plus a hook run after the last
//                      benchmark, so a binary can print ratios between its
//                      own cases (a workload against the limit that bounds
//                      it, measured in the same run).

#include <benchmark/benchmark.h>
#include <dlfcn.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "host/compute_layout.h"

namespace benchmarks {

// Exits with status 2 and the reason when OMP_NUM_THREADS is malformed.
inline void UseAllCores(const char* binary) {
  auto layout = host::ApplyThreadLayout(1, 0);
  if (!layout.ok()) {
    std::fprintf(stderr, "%s: %s\n", binary, std::string(layout.status().message()).c_str());
    std::exit(2);
  }
  if (!layout->warning.empty())
    std::fprintf(stderr, "%s: warning: %s\n", binary, layout->warning.c_str());
  std::fprintf(stderr, "%s: compute: %s\n", binary, host::DescribeComputeLayout(1).c_str());
}

// OpenBLAS's pool size and the kernel it picked, looked up at run time
// (libblas.so.3 may be OpenBLAS, the reference BLAS or something else: the
// Debian alternative decides, so nothing is linked against OpenBLAS itself).
inline std::string BlasDescription() {
  using IntFn = int (*)();
  using StrFn = char* (*)();
  auto threads = reinterpret_cast<IntFn>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  auto corename = reinterpret_cast<StrFn>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  if (threads == nullptr || corename == nullptr) return "BLAS: not OpenBLAS";
  std::string out =
      "OpenBLAS " + std::string(corename()) + " kernel, " + std::to_string(threads()) + " threads";
  for (const char* name :
       {"OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"}) {
    const char* value = std::getenv(name);
    out += std::string(", ") + name + "=" + (value != nullptr ? value : "(unset)");
  }
  return out;
}

inline std::string ThreadsLabel() {
  return "intra-op threads " + std::to_string(at::get_num_threads()) + "; " + BlasDescription();
}

// What the summary hook sees of one benchmark: the median over repetitions
// (or the single run) of its real time in seconds and of each counter.
struct Measured {
  double real_s = 0;
  std::map<std::string, double> counters;
};
using Results = std::map<std::string, Measured>;

class SummaryReporter : public benchmark::ConsoleReporter {
 public:
  explicit SummaryReporter(std::function<void(const Results&)> summary)
      : benchmark::ConsoleReporter(OO_None), summary_(std::move(summary)) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.error_occurred || run.run_type != Run::RT_Iteration) continue;
      // Keyed by the registered name ("/real_time" and the like dropped).
      std::string name = run.run_name.str();
      const auto cut = name.find("/real_time");
      if (cut != std::string::npos) name.erase(cut);
      auto& samples = samples_[name];
      samples.real_s.push_back(run.GetAdjustedRealTime() /
                               benchmark::GetTimeUnitMultiplier(run.time_unit));
      for (const auto& [name, counter] : run.counters) {
        samples.counters[name].push_back(counter.value);
      }
    }
  }

  void Finalize() override {
    ConsoleReporter::Finalize();
    Results results;
    for (auto& [name, samples] : samples_) {
      Measured& m = results[name];
      m.real_s = Median(samples.real_s);
      for (auto& [counter, values] : samples.counters) m.counters[counter] = Median(values);
    }
    GetOutputStream() << "\n";
    summary_(results);
    GetOutputStream().flush();
  }

 private:
  struct Samples {
    std::vector<double> real_s;
    std::map<std::string, std::vector<double>> counters;
  };
  static double Median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  }

  std::function<void(const Results&)> summary_;
  std::map<std::string, Samples> samples_;
};

// Runs the registered benchmarks with `reporter` on the console (a
// --benchmark_out file, if asked for, is written as usual).
inline int RunWithSummary(int argc, char** argv, SummaryReporter& reporter) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}

}  // namespace benchmarks
