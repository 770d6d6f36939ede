// What a GPU check is, for the checks each component keeps beside its code
// (comm/comm_gpu_check.h, optim/optim_gpu_check.h, fsdp/fsdp_gpu_check.h,
// functorch/transforms/transforms_gpu_check.h, kernels/kernels_gpu_check.h)
// and the program that runs them on the GPU machine, benchmarks/gpu_check,
// which prints one line per check:
//
//   PASS name  what was compared, and how closely it matched (3.2 s)
//   FAIL name  what was wrong (0.4 s)
//
// A component hands the runner its checks as a list, made for a device:
//
//   std::vector<gpu_check::Check> CommGpuChecks(c10::Device device);
//
// The device is cuda:0, or the CPU under gpu_check --dry-run-on-cpu, which
// runs the checks' own logic on a machine without a GPU: it checks the
// checks, not the CUDA build.
#pragma once

#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace gpu_check {

// gpu_check's flag that gives every check the CPU as its device. A check
// that re-executes gpu_check (fsdp/'s 2-rank checks start their ranks so)
// passes it on.
inline constexpr char kDryRunOnCpuArg[] = "--dry-run-on-cpu";

struct Result {
  bool ok = false;
  std::string detail;  // PASS: what matched and how closely; FAIL: what was wrong
};

struct Check {
  std::string name;  // "nccl_world_of_1", "kernels_rms_norm", ...: the line's second word
  std::function<Result()> run;  // may throw: the runner reports that as a FAIL
};

Result Pass(std::string detail);
Result Fail(std::string detail);

// The problems one check found, so that it reports all of them, not the first.
class Problems {
 public:
  void Add(std::string what);
  bool empty() const { return list_.empty(); }
  std::string Joined() const;  // "a; b; c"

 private:
  std::vector<std::string> list_;
};

// An exception's message, without the C++ backtrace a c10::Error carries.
std::string Describe(const std::exception& e);

}  // namespace gpu_check
