#include "comm/comm_gpu_check.h"

#include <chrono>
#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/types.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/collectives.h"
#include "comm/process_group.h"
#include "comm/testing/world_of_1.h"
#include "comm/work.h"

namespace comm {
namespace {

using gpu_check::Fail;
using gpu_check::Pass;
using gpu_check::Problems;
using gpu_check::Result;
using testing::MakeWorldOf1;

constexpr std::chrono::milliseconds kCollectiveTimeout = std::chrono::minutes(2);

// n values in [-125, 125]: integers, exact in every dtype the collectives
// take (bfloat16 holds integers up to 256 exactly).
torch::Tensor KnownValues(int64_t n, torch::ScalarType dtype, torch::Device device) {
  return (torch::arange(n, torch::kInt64).remainder(251) - 125).to(device, dtype);
}

// Exact comparison; `what` names the collective, dtype and field.
void ExpectEqual(Problems& problems, const std::string& what, const torch::Tensor& actual,
                 const torch::Tensor& expected) {
  torch::Tensor a = actual.to(torch::kCPU);
  torch::Tensor e = expected.to(torch::kCPU);
  if (a.sizes() != e.sizes()) {
    problems.Add(
        absl::StrCat(what, ": shape ", c10::str(a.sizes()), ", expected ", c10::str(e.sizes())));
    return;
  }
  if (a.scalar_type() != e.scalar_type()) {
    problems.Add(absl::StrCat(what, ": dtype ", c10::toString(a.scalar_type()), ", expected ",
                              c10::toString(e.scalar_type())));
    return;
  }
  if (!torch::equal(a, e)) {
    torch::Tensor wrong = a.ne(e).nonzero();
    const int64_t first = wrong.size(0) > 0 ? wrong[0][0].item<int64_t>() : -1;
    problems.Add(absl::StrCat(what, ": ", wrong.size(0), " of ", a.numel(),
                              " elements differ (first at ", first, ": ",
                              first >= 0 ? a[first].item<double>() : 0.0, ", expected ",
                              first >= 0 ? e[first].item<double>() : 0.0, ")"));
  }
}

// Every collective comm wraps, on CUDA tensors of three dtypes. On one rank
// each result is the input itself; the out-of-place ones (all-gather,
// reduce-scatter) write into outputs pre-filled with a sentinel, so a
// collective that wrote nothing is caught. Half the waits are wait(), half
// wait_on_stream() (then the comparison, on the same stream, must see the
// result).
Result CheckNcclWorldOf1(c10::Device device) {
  auto world = MakeWorldOf1("nccl", kCollectiveTimeout);
  if (!world.ok()) return Fail(std::string(world.status().message()));
  const comm::ProcessGroup& group = world->group;
  Problems problems;
  if (group.backend() != "nccl" || group.size() != 1 || group.rank() != 0) {
    problems.Add(absl::StrCat("group: backend '", group.backend(), "', size ", group.size(),
                              ", rank ", group.rank(), ": expected 'nccl', 1, 0"));
  }
  constexpr int64_t kN = 4099;  // not a multiple of anything NCCL likes
  int compared = 0;
  for (torch::ScalarType dtype : {torch::kFloat, torch::kBFloat16, torch::kLong}) {
    const std::string type = c10::toString(dtype);
    const torch::Tensor expected = KnownValues(kN, dtype, device);

    torch::Tensor t = expected.clone();
    comm::all_reduce(group, t, comm::ReduceOp::kSum).wait();
    ExpectEqual(problems, "all_reduce(sum) " + type, t, expected);

    if (torch::isFloatingType(dtype)) {  // avg is for floating types only
      t = expected.clone();
      comm::all_reduce(group, t, comm::ReduceOp::kAvg).wait_on_stream();
      ExpectEqual(problems, "all_reduce(avg) " + type, t, expected);
    }

    torch::Tensor gathered = torch::full({kN}, -7777, expected.options());
    comm::all_gather_into_tensor(group, gathered, expected).wait_on_stream();
    ExpectEqual(problems, "all_gather_into_tensor " + type, gathered, expected);

    torch::Tensor scattered = torch::full({kN}, -7777, expected.options());
    comm::reduce_scatter_tensor(group, scattered, expected, comm::ReduceOp::kSum).wait();
    ExpectEqual(problems, "reduce_scatter_tensor(sum) " + type, scattered, expected);

    t = expected.clone();
    comm::broadcast(group, t, /*root=*/0).wait_on_stream();
    ExpectEqual(problems, "broadcast " + type, t, expected);
    compared += torch::isFloatingType(dtype) ? 5 : 4;
  }
  comm::barrier(group).wait();
  // A CPU tensor on a pure NCCL group is refused before anything is sent.
  try {
    torch::Tensor cpu = torch::ones({4});
    comm::all_reduce(group, cpu).wait();
    problems.Add("all_reduce of a CPU tensor on backend nccl did not throw");
  } catch (const c10::Error& e) {
    if (!absl::StrContains(e.what_without_backtrace(), "expected a CUDA tensor")) {
      problems.Add(absl::StrCat("all_reduce of a CPU tensor on backend nccl threw '",
                                e.what_without_backtrace(),
                                "': expected it to ask for a CUDA tensor"));
    }
  }
  if (!problems.empty()) return Fail(problems.Joined());
  return Pass(absl::StrCat(compared,
                           " collectives (all_reduce sum/avg, all_gather_into_tensor, "
                           "reduce_scatter_tensor, broadcast; float32, bfloat16, int64; ",
                           kN,
                           " elements) equal to the expected values exactly; a CPU "
                           "tensor refused"));
}

// comm::kGlooCpuNcclCuda: one group, CPU tensors through Gloo, CUDA tensors
// through NCCL (what the trainer's --device cuda uses).
Result CheckGlooCpuNcclCudaWorldOf1(c10::Device device) {
  auto world = MakeWorldOf1(comm::kGlooCpuNcclCuda, kCollectiveTimeout);
  if (!world.ok()) return Fail(std::string(world.status().message()));
  const comm::ProcessGroup& group = world->group;
  Problems problems;
  constexpr int64_t kN = 1000;
  const torch::Tensor cpu_expected = KnownValues(kN, torch::kFloat, torch::kCPU);
  const torch::Tensor cuda_expected = KnownValues(kN, torch::kFloat, device) * 2;

  torch::Tensor cpu = cpu_expected.clone();
  torch::Tensor cuda = cuda_expected.clone();
  // Both in flight at once, then both waited for.
  comm::Work cpu_work = comm::all_reduce(group, cpu, comm::ReduceOp::kSum);
  comm::Work cuda_work = comm::all_reduce(group, cuda, comm::ReduceOp::kSum);
  cpu_work.wait();
  cuda_work.wait_on_stream();
  ExpectEqual(problems, "all_reduce(sum) CPU float32", cpu, cpu_expected);
  ExpectEqual(problems, "all_reduce(sum) CUDA float32", cuda, cuda_expected);

  cpu = cpu_expected.clone();
  comm::all_reduce(group, cpu, comm::ReduceOp::kAvg).wait();
  ExpectEqual(problems, "all_reduce(avg) CPU float32", cpu, cpu_expected);

  torch::Tensor cpu_gathered = torch::full({kN}, -7777.0f);
  comm::all_gather_into_tensor(group, cpu_gathered, cpu_expected).wait();
  ExpectEqual(problems, "all_gather_into_tensor CPU float32", cpu_gathered, cpu_expected);
  torch::Tensor cuda_gathered = torch::full({kN}, -7777.0f, cuda_expected.options());
  comm::all_gather_into_tensor(group, cuda_gathered, cuda_expected).wait_on_stream();
  ExpectEqual(problems, "all_gather_into_tensor CUDA float32", cuda_gathered, cuda_expected);
  comm::barrier(group).wait();
  if (!problems.empty()) return Fail(problems.Joined());
  return Pass(
      "CPU (Gloo) and CUDA (NCCL) all_reduce sum in flight together, all_reduce avg, "
      "all_gather_into_tensor on both: equal to the expected values exactly");
}

// comm/work.h: on NCCL, wait_on_stream() makes the calling thread's current
// stream wait for the collective without blocking the host, and
// is_stream_ordered() is true; for a CPU (Gloo) collective it is false.
// The ordering is tested with a collective large enough to take a while:
// the output is pre-filled with -1 on the current stream, gathered into on
// NCCL's stream, and compared on the current stream right after
// wait_on_stream(); without the ordering the comparison would race the copy.
Result CheckNcclWorkStreamOrdered(c10::Device device) {
  Problems problems;
  {
    auto world = MakeWorldOf1("nccl", kCollectiveTimeout);
    if (!world.ok()) return Fail(std::string(world.status().message()));
    constexpr int64_t kBig = int64_t{64} << 20;  // 64M floats, 256 MiB
    torch::Tensor input =
        torch::arange(kBig, torch::TensorOptions().dtype(torch::kFloat).device(device));
    for (int round = 0; round < 3; ++round) {
      torch::Tensor output = torch::full({kBig}, -1.0f, input.options());
      comm::Work work = comm::all_gather_into_tensor(world->group, output, input);
      if (!work.is_stream_ordered()) {
        problems.Add(
            "all_gather_into_tensor on backend nccl: Work::is_stream_ordered() is "
            "false: expected true for an NCCL collective (comm/work.h), so "
            "wait_on_stream() blocks the host and FSDP's NCCL communication does "
            "not overlap");
      }
      work.wait_on_stream();
      // Queued on the current stream right after the wait: must see the gather.
      const bool equal = torch::equal(output, input);
      if (!equal) {
        problems.Add(absl::StrCat("round ", round,
                                  ": the current stream read the all-gather's output before "
                                  "the collective finished (wait_on_stream() did not order it)"));
      }
      if (!problems.empty()) break;
    }
  }
  {
    auto world = MakeWorldOf1(comm::kGlooCpuNcclCuda, kCollectiveTimeout);
    if (!world.ok()) return Fail(std::string(world.status().message()));
    torch::Tensor cpu = torch::ones({16});
    torch::Tensor cuda = torch::ones({16}, torch::TensorOptions().device(device));
    comm::Work cpu_work = comm::all_reduce(world->group, cpu);
    comm::Work cuda_work = comm::all_reduce(world->group, cuda);
    if (cpu_work.is_stream_ordered()) {
      problems.Add(absl::StrCat("all_reduce of a CPU tensor on '", comm::kGlooCpuNcclCuda,
                                "': is_stream_ordered() true, expected false (Gloo)"));
    }
    if (!cuda_work.is_stream_ordered()) {
      problems.Add(absl::StrCat("all_reduce of a CUDA tensor on '", comm::kGlooCpuNcclCuda,
                                "': is_stream_ordered() false, expected true (NCCL)"));
    }
    cpu_work.wait_on_stream();  // a CPU collective: a plain wait()
    cuda_work.wait_on_stream();
    ExpectEqual(problems, "all_reduce CPU on the mixed backend", cpu, torch::ones({16}));
    ExpectEqual(problems, "all_reduce CUDA on the mixed backend", cuda, torch::ones({16}));
  }
  if (!problems.empty()) return Fail(problems.Joined());
  return Pass(
      "3 rounds of a 256 MiB all-gather read on the current stream right after "
      "wait_on_stream(): all saw the result; is_stream_ordered() true for NCCL, "
      "false for Gloo");
}

}  // namespace

std::vector<gpu_check::Check> CommGpuChecks(c10::Device device) {
  if (!device.is_cuda()) return {};
  return {
      {"nccl_world_of_1", [device] { return CheckNcclWorldOf1(device); }},
      {"gloo_cpu_nccl_cuda_world_of_1", [device] { return CheckGlooCpuNcclCudaWorldOf1(device); }},
      {"nccl_work_stream_ordered", [device] { return CheckNcclWorkStreamOrdered(device); }},
  };
}

}  // namespace comm
