// gpu_check: what the CUDA build does on a real GPU, in one run, for the
// rarely lent GPU machine (benchmarks/run_gpu.sh builds and runs it there).
// Not a Google Benchmark: one line per check,
//
//   PASS name  what was compared, and how closely it matched
//   FAIL name  what was wrong
//
// and exit status 1 when any check failed, 0 when all passed. Built without
// CUDA (the default, CPU-only build), or run where LibTorch sees no CUDA
// device, it prints "NOT RUN: <why>" and exits 77 (the automake "skipped"
// code), so a script can tell "no GPU here" from "broken".
//
// Checks (one function each, below):
//   nccl_world_of_1                comm's collectives on backend "nccl", one
//                                  rank: known values, compared exactly
//   gloo_cpu_nccl_cuda_world_of_1  comm::kGlooCpuNcclCuda: a CPU and a CUDA
//                                  tensor reduced in the same group
//   nccl_work_stream_ordered       comm::Work on NCCL: wait_on_stream()
//                                  orders the caller's stream after the
//                                  collective, is_stream_ordered() says so
//   fsdp_parity_full_shard_fp32    FSDP (FULL_SHARD, device_id cuda:0,
//                                  use_orig_params) on the NCCL world of 1
//                                  against the unwrapped model on cuda:0
//   fsdp_parity_bf16               the same with bf16 parameters, fp32
//                                  reduction: losses near the fp32 run's,
//                                  gradients finite and fp32
//   fsdp_parity_cpu_offload        offload_params: the shard pinned on the
//                                  CPU, same numbers as the fp32 reference
//   fsdp_gloo_2_ranks_cuda         2 ranks (this binary re-executed through
//                                  launcher::launch) on the one GPU over Gloo
//                                  with CUDA tensors: FULL_SHARD with real
//                                  collectives against the unwrapped model
//   fused_optimizers               optim/'s fused and foreach Adam, AdamW,
//                                  SGD on the GPU (float32 and bfloat16
//                                  buckets) against torch::optim on the CPU;
//                                  steps under sync-debug mode error
//   fsdp_step_no_sync              one full FSDP training step (forward,
//                                  backward with the gradient reduction,
//                                  fused AdamW; bf16 parameters, fp32
//                                  reduction) on the NCCL world of 1 under
//                                  sync-debug mode error, 3 times after a
//                                  warm-up step and a step that counts the
//                                  synchronisations under mode warn: only
//                                  the loss is read
//   fully_shard_parity_fp32,       the five FSDP checks above repeated for
//   fully_shard_parity_bf16,       fsdp::fully_shard (FSDP2, issue 37):
//   fully_shard_parity_cpu_offload each block and then the root, on cuda:0,
//   fully_shard_gloo_2_ranks_cuda  resharding after forward; bf16 as
//   fully_shard_step_no_sync       MixedPrecisionPolicy(bf16, fp32), offload
//                                  as CPUOffloadPolicy (shards pinned)
//   functorch_per_sample_grads     vmap(grad(loss)) of an MLP 128-256-10,
//                                  cross-entropy, batch 256, float32
//                                  (transforms_bench's
//                                  BM_PerSampleGrad_VmapGrad) on cuda:0
//                                  against the CPU (max-norm relative
//                                  1e-5), timed: median of 20 calls
//   functorch_batched_hessians     vmap(jacfwd(jacrev(u))) of a
//                                  2-512-512-512-3 tanh MLP at 1024 points
//                                  (hessian_bench's PINN case) on cuda:0
//                                  against the CPU (max-norm relative
//                                  1e-4), timed: median of 20 calls
//   kernels_cuda_linked,           kernels/'s fused ops (kernels::
//   kernels_rms_norm,              KernelsGpuChecks, kernels_gpu_check.h):
//   kernels_swiglu,                each CUDA kernel against its ATen
//   kernels_rope_qk,               reference on cuda:0, forward and
//   kernels_linear_cross_entropy,  gradients, float32 / bf16 / fp16, that
//   kernels_fallback_warns         the kernel path was taken, the loss's
//                                  peak memory, fused vs composite timings;
//                                  in a dry run the same comparisons on the
//                                  CPU through the kernels' ATen stand-in
//
// The FSDP checks train trainer/models.h's transformer (2 layers, width 64,
// seq 32) for 5 SGD steps (lr 0.1, momentum 0.9) on one fixed batch of 8
// rows, and the unwrapped model (built with the same seed) likewise.
// Tolerances: fp32 losses and final parameters rtol 1e-5, atol 1e-6 (those
// of tests/fsdp_parity_test.cc); bf16 losses within 2e-2 relative of the
// fp32 reference's.
//
// Note: on a one-rank group FSDP sends nothing (a one-rank shard group's
// gather and reduce-scatter are local copies), so the world-of-1 FSDP
// checks test FSDP's device placement, streams and offload, and the 2-rank
// Gloo check tests its collectives on CUDA tensors. NCCL cannot put two
// ranks on one GPU.
//
// Usage: gpu_check [--only SUBSTRING] [--dry-run-on-cpu]
//   --only            runs the checks whose name contains SUBSTRING
//   --dry-run-on-cpu  the FSDP checks on the CPU over Gloo (no NCCL checks),
//                     the functorch checks with the CPU as the device (then
//                     CPU against CPU, trivially exact; 3 timed Hessian
//                     calls), the kernels' checks on the CPU: tests the
//                     checks' own logic without a GPU
// Exit status: 0 all passed, 1 a check failed, 2 bad arguments, 77 not run.
#include <dlfcn.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <ATen/Context.h>
#include <c10/util/Backtrace.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/version.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "comm/collectives.h"
#include "comm/process_group.h"
#include "comm/work.h"
#include "fsdp/flat_param.h"
#include "fsdp/fully_shard.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "functorch/transforms/transforms.h"
#include "kernels/kernels_gpu_check.h"
#include "launcher/launch.h"
#include "module_call/call.h"
#include "module_call/wrap_policy.h"
#include "optim/optimizers.h"
#include "trainer/data.h"
#include "trainer/models.h"

#ifdef TORCHFSDP_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace {

#ifdef TORCHFSDP_CUDA
constexpr bool kBuiltWithCuda = true;
#else
constexpr bool kBuiltWithCuda = false;
#endif

// The exit status that means "skipped" (automake's convention).
constexpr int kNotRun = 77;
// The arguments a re-executed rank of fsdp_gloo_2_ranks_cuda and
// fully_shard_gloo_2_ranks_cuda gets: kGlooRankArg, then which FSDP.
constexpr char kGlooRankArg[] = "--gloo-rank-child";
constexpr char kFsdp1Api[] = "fsdp1";
constexpr char kFullyShardApi[] = "fully_shard";
// Runs the FSDP checks on the CPU (see g_device).
constexpr char kDryRunArg[] = "--dry-run-on-cpu";

constexpr std::chrono::milliseconds kCollectiveTimeout = std::chrono::minutes(2);

// ---------------------------------------------------------------------------
// Reporting.

struct CheckResult {
  bool ok = true;
  std::string detail;  // PASS: what matched and how closely; FAIL: what was wrong
};

CheckResult Pass(std::string detail) { return {true, std::move(detail)}; }
CheckResult Fail(std::string detail) { return {false, std::move(detail)}; }

// Collects problems found by one check, so a check reports all of them.
struct Problems {
  std::vector<std::string> list;
  void Add(std::string what) { list.push_back(std::move(what)); }
  bool empty() const { return list.empty(); }
  std::string Joined() const { return absl::StrJoin(list, "; "); }
};

std::string Describe(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return c10_error->what_without_backtrace();
  }
  return e.what();
}

// ---------------------------------------------------------------------------
// Helpers.

// A fresh directory for a FileStore, removed when done.
class TempDir {
 public:
  TempDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ =
        absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/gpu_check_XXXXXX");
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    TORCH_CHECK(mkdtemp(buf.data()) != nullptr, "gpu_check: mkdtemp('", templ,
                "') failed: ", std::strerror(errno));
    path_ = buf.data();
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A one-rank world on a FileStore (no port), as the trainer's --nproc 1.
// The store directory lives as long as the group: NCCL creates its
// communicator at the first collective, through the store.
struct WorldOf1 {
  std::unique_ptr<TempDir> dir;
  comm::ProcessGroup group;
};

absl::StatusOr<WorldOf1> MakeWorldOf1(const std::string& backend) {
  WorldOf1 world;
  world.dir = std::make_unique<TempDir>();
  comm::InitOptions init;
  init.backend = backend;
  init.init_method = "file://" + world.dir->path() + "/store";
  init.rank = 0;
  init.world_size = 1;
  init.timeout = kCollectiveTimeout;
  auto group = comm::init_process_group(init);
  if (!group.ok()) {
    return absl::Status(group.status().code(),
                        absl::StrCat("comm::init_process_group(backend '", backend,
                                     "', world of 1): ", group.status().message()));
  }
  world.group = *group;
  return world;
}

const torch::Device kCuda0(torch::kCUDA, 0);

// Where the FSDP checks compute: cuda:0, or the CPU under --dry-run-on-cpu
// (which runs the FSDP checks' own logic on a machine without a GPU, Gloo
// standing in for NCCL; it checks the checks, not the CUDA build).
torch::Device g_device = kCuda0;
bool DryRun() { return g_device.is_cpu(); }

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

// ---------------------------------------------------------------------------
// a. Collectives on NCCL (one rank).

// Every collective comm wraps, on CUDA tensors of three dtypes. On one rank
// each result is the input itself; the out-of-place ones (all-gather,
// reduce-scatter) write into outputs pre-filled with a sentinel, so a
// collective that wrote nothing is caught. Half the waits are wait(), half
// wait_on_stream() (then the comparison, on the same stream, must see the
// result).
CheckResult CheckNcclWorldOf1() {
  auto world = MakeWorldOf1("nccl");
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
    const torch::Tensor expected = KnownValues(kN, dtype, kCuda0);

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
CheckResult CheckGlooCpuNcclCudaWorldOf1() {
  auto world = MakeWorldOf1(comm::kGlooCpuNcclCuda);
  if (!world.ok()) return Fail(std::string(world.status().message()));
  const comm::ProcessGroup& group = world->group;
  Problems problems;
  constexpr int64_t kN = 1000;
  const torch::Tensor cpu_expected = KnownValues(kN, torch::kFloat, torch::kCPU);
  const torch::Tensor cuda_expected = KnownValues(kN, torch::kFloat, kCuda0) * 2;

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
CheckResult CheckNcclWorkStreamOrdered() {
  Problems problems;
  {
    auto world = MakeWorldOf1("nccl");
    if (!world.ok()) return Fail(std::string(world.status().message()));
    constexpr int64_t kBig = int64_t{64} << 20;  // 64M floats, 256 MiB
    torch::Tensor input =
        torch::arange(kBig, torch::TensorOptions().dtype(torch::kFloat).device(kCuda0));
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
    auto world = MakeWorldOf1(comm::kGlooCpuNcclCuda);
    if (!world.ok()) return Fail(std::string(world.status().message()));
    torch::Tensor cpu = torch::ones({16});
    torch::Tensor cuda = torch::ones({16}, torch::TensorOptions().device(kCuda0));
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

// ---------------------------------------------------------------------------
// b. FSDP parity on cuda:0.

// A small decoder-only transformer (trainer/models.h), a few SGD steps with
// momentum. Not Adam: Adam normalises each gradient element by its own
// running RMS, so an element whose true gradient is zero (the attention's
// key bias: softmax ignores a constant shift) moves by +-lr on rounding
// noise alone, and two correct runs that round differently (2 ranks sum
// in another order) end up lr apart there.
const trainer::ModelConfig kModel{/*layers=*/2, /*dim=*/64, /*heads=*/4, /*vocab=*/256,
                                  /*seq=*/32};
constexpr uint64_t kModelSeed = 1234;
constexpr uint64_t kDataSeed = 99;
constexpr int kSteps = 5;
constexpr int64_t kGlobalBatch = 8;
constexpr double kLr = 0.1;
constexpr double kMomentum = 0.9;

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(std::vector<torch::Tensor> params) {
  return std::make_unique<torch::optim::SGD>(std::move(params),
                                             torch::optim::SGDOptions(kLr).momentum(kMomentum));
}

// This rank's rows of the global batch (trainer/data.h: rank r of W takes
// rows [r*B/W, (r+1)*B/W), so the union over ranks is the global batch), as
// int64 tokens [rows, seq + 1]. The same batch every step: the tokens are
// uniformly random, so only a batch seen again can be learned, and a loss
// that falls shows the steps did something.
torch::Tensor Batch(int rank, int world) {
  trainer::BatchSpec spec{kDataSeed, /*step=*/0, kGlobalBatch, kModel.seq + 1, rank, world};
  auto batch = trainer::SampleSyntheticBatch(kModel.vocab, spec);
  TORCH_CHECK(batch.ok(), "gpu_check: SampleSyntheticBatch: ", batch.status().message());
  return *batch;
}

std::shared_ptr<trainer::TransformerLM> BuildTransformer() {
  // Same seed, same parameters: the reference and the wrapped model start equal.
  auto model = std::dynamic_pointer_cast<trainer::TransformerLM>(
      trainer::BuildModel(trainer::ModelType::kTransformer, kModel, kModelSeed));
  TORCH_CHECK(model != nullptr, "gpu_check: BuildModel did not return a TransformerLM");
  return model;
}

using Params = std::map<std::string, torch::Tensor>;

Params Snapshot(const torch::nn::Module& module) {
  Params out;
  for (const auto& item : module.named_parameters()) {
    out[item.key()] = item.value().detach().to(torch::kCPU, torch::kFloat, /*non_blocking=*/false,
                                               /*copy=*/true);
  }
  return out;
}

struct Run {
  std::vector<double> losses;  // global mean loss of each step
  Params params;               // after the last step
};

// The unwrapped model on `device`, the whole global batch every step.
Run TrainUnwrapped(torch::Device device) {
  auto model = BuildTransformer();
  model->to(device);
  auto optim = MakeOptimizer(model->parameters());
  Run run;
  for (int step = 0; step < kSteps; ++step) {
    optim->zero_grad();
    torch::Tensor loss = model->Loss(Batch(0, 1).to(device));
    loss.backward();
    optim->step();
    run.losses.push_back(loss.item<double>());
  }
  run.params = Snapshot(*model);
  return run;
}

struct FsdpVariant {
  bool bf16 = false;         // param_dtype bf16, reduce_dtype (and FSDP1's buffer_dtype) fp32
  bool cpu_offload = false;  // FSDP1's cpu_offload.offload_params; fully_shard's CPUOffloadPolicy
  bool fully_shard = false;  // fsdp::fully_shard (FSDP2) instead of FullyShardedDataParallel
};

// Inspects the optimizer-facing parameters between backward and the step.
using AfterBackward =
    std::function<void(int step, const std::vector<torch::Tensor>& parameters, Problems& problems)>;

// The FSDP checks' blocks run through module_call::call, where their units
// are gathered and resharded.
void RunBlocksThroughCallPoint(trainer::TransformerLM& model) {
  model.set_block_runner(
      [](int64_t, trainer::TransformerBlock& block, const torch::Tensor& x,
         const torch::Tensor& mask) { return module_call::call(block, x, mask); });
}

// The wrapping every FSDP check trains under: FULL_SHARD over `group`, one
// unit per block, device_id cuda:0 (not in a dry run), use_orig_params;
// with `bf16`, bf16 parameters with fp32 reduction and buffers.
fsdp::FullyShardedDataParallel::Options FullShardOptions(const comm::ProcessGroup& group,
                                                         bool bf16) {
  fsdp::FullyShardedDataParallel::Options options;
  options.process_group = group;
  options.sharding_strategy = fsdp::ShardingStrategy::kFullShard;
  options.auto_wrap_policy =
      module_call::module_type_auto_wrap_policy<trainer::TransformerBlockImpl>();
  if (!DryRun()) options.device_id = g_device;
  options.use_orig_params = true;
  if (bf16) {
    options.mixed_precision.param_dtype = torch::kBFloat16;
    options.mixed_precision.reduce_dtype = torch::kFloat32;
    options.mixed_precision.buffer_dtype = torch::kFloat32;
  }
  return options;
}

// The transformer on g_device under one of the two FSDPs, as the checks
// train it: FullyShardedDataParallel with FullShardOptions, or fsdp::fully_shard
// (FSDP2) on each block and then the root, over `group`, resharding after
// forward, with `variant`'s mixed precision and offload.
class ShardedTransformer {
 public:
  ShardedTransformer(const comm::ProcessGroup& group, const FsdpVariant& variant)
      : model_(BuildTransformer()) {
    RunBlocksThroughCallPoint(*model_);
    if (!variant.fully_shard) {
      // Built on the CPU; FSDP moves it to device_id.
      fsdp::FullyShardedDataParallel::Options options = FullShardOptions(group, variant.bf16);
      options.cpu_offload.offload_params = variant.cpu_offload;
      fsdp1_ = std::make_unique<fsdp::FullyShardedDataParallel>(model_, options);
      return;
    }
    // fully_shard computes where the parameters are when it is applied.
    model_->to(g_device);
    fsdp::FullyShardOptions options;
    options.process_group = group;
    options.reshard_after_forward = true;
    if (variant.bf16) {
      options.mp_policy.param_dtype = torch::kBFloat16;
      options.mp_policy.reduce_dtype = torch::kFloat32;
    }
    if (variant.cpu_offload) options.offload_policy = fsdp::CPUOffloadPolicy{};
    for (size_t i = 0; i < model_->blocks()->size(); ++i) {
      units_.push_back(fsdp::fully_shard(model_->blocks()->ptr(i), options));
    }
    units_.push_back(
        fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(model_), options));
  }

  trainer::TransformerLM& model() { return *model_; }
  fsdp::FullyShardedDataParallel* fsdp1() { return fsdp1_.get(); }

  // What the optimizer steps on: FSDP1's flat shards (or use_orig_params
  // views), or fully_shard's per-parameter shards.
  std::vector<torch::Tensor> parameters() const {
    return fsdp1_ != nullptr ? fsdp1_->parameters() : model_->parameters();
  }

  // The loss of `batch` through the root's call point.
  torch::Tensor Loss(const torch::Tensor& batch) {
    if (fsdp1_ != nullptr) return fsdp1_->run([&] { return model_->Loss(batch); });
    module_call::ForwardCall call(*model_);
    return call.finish(model_->Loss(batch));
  }

  // The unsharded parameters, by name, as float32 on the CPU.
  Params FullParams() {
    if (fsdp1_ != nullptr) {
      fsdp::SummonOptions summon;
      summon.writeback = false;
      auto full = fsdp1_->summon_full_params(summon);
      return Snapshot(*fsdp1_->module());
    }
    for (fsdp::FSDPModule& unit : units_) unit.unshard();
    Params params = Snapshot(*model_);
    for (fsdp::FSDPModule& unit : units_) unit.reshard();
    return params;
  }

  // How many FSDP units the model has (the root and one per block expected).
  std::vector<std::string> UnitNames() const {
    if (fsdp1_ != nullptr) return fsdp1_->fsdp_unit_names();
    std::vector<std::string> names;
    for (size_t i = 0; i + 1 < units_.size(); ++i) names.push_back(absl::StrCat("blocks.", i));
    names.insert(names.begin(), "");
    return names;
  }

  // The tensors that hold this rank's shards (FSDP1: each unit's flat
  // shard; fully_shard: each parameter's).
  std::vector<torch::Tensor> Shards() const {
    if (fsdp1_ == nullptr) return model_->parameters();
    std::vector<torch::Tensor> shards;
    for (const fsdp::FlatParamHandle* handle : fsdp1_->handles()) {
      if (handle != nullptr) shards.push_back(handle->flat_param());
    }
    return shards;
  }

 private:
  std::shared_ptr<trainer::TransformerLM> model_;
  std::unique_ptr<fsdp::FullyShardedDataParallel> fsdp1_;
  std::vector<fsdp::FSDPModule> units_;  // fully_shard's: the blocks, then the root
};

// The same model wrapped per `variant` on `group`, this rank's rows of
// each step's batch. `after_backward` inspects the state between backward
// and the optimizer step. Losses are averaged over the group (a CPU
// all-reduce: the group must carry CPU tensors when it has more than one
// rank).
Run TrainFsdp(const comm::ProcessGroup& group, const FsdpVariant& variant,
              const AfterBackward& after_backward, Problems& problems) {
  ShardedTransformer sharded(group, variant);
  const std::string api = variant.fully_shard ? "fully_shard" : "FSDP";
  const std::vector<std::string> unit_names = sharded.UnitNames();
  const int units = static_cast<int>(unit_names.size());
  if (units != 1 + static_cast<int>(kModel.layers)) {
    problems.Add(absl::StrCat(api, " made ", units, " units (", absl::StrJoin(unit_names, ", "),
                              "): expected the root and one per block, ", 1 + kModel.layers));
  }
  // Where the shards live: cuda:0, or pinned CPU memory under offload.
  for (const torch::Tensor& shard : sharded.Shards()) {
    if (variant.cpu_offload) {
      if (!shard.device().is_cpu()) {
        problems.Add(absl::StrCat("cpu_offload: a shard is on ", shard.device().str(),
                                  ": expected the CPU"));
      } else if (!DryRun() && !shard.is_pinned()) {
        problems.Add(
            "cpu_offload: a shard is in pageable CPU memory: expected pinned "
            "(so its copies to the GPU are asynchronous)");
      }
    } else if (shard.device() != g_device) {
      problems.Add(absl::StrCat("a shard is on ", shard.device().str(), ": expected ",
                                g_device.str(), variant.fully_shard ? "" : " (device_id)"));
    }
    if (shard.scalar_type() != torch::kFloat) {
      problems.Add(absl::StrCat("a shard has dtype ", c10::toString(shard.scalar_type()),
                                ": expected float32 (the optimizer's full precision)"));
    }
    if (!problems.empty()) break;
  }

  auto optim = MakeOptimizer(sharded.parameters());
  Run run;
  for (int step = 0; step < kSteps; ++step) {
    optim->zero_grad();
    const torch::Tensor batch = Batch(group.rank(), group.size()).to(g_device);
    torch::Tensor loss = sharded.Loss(batch);
    loss.backward();
    if (after_backward) after_backward(step, sharded.parameters(), problems);
    optim->step();
    torch::Tensor global = torch::tensor({loss.item<double>()}, torch::kDouble);
    if (group.size() > 1) comm::all_reduce(group, global, comm::ReduceOp::kAvg).wait();
    run.losses.push_back(global.item<double>());
  }
  run.params = sharded.FullParams();
  return run;
}

struct Closeness {
  double max_abs = 0;  // largest |actual - expected|
  double max_rel = 0;  // largest |actual - expected| / |expected| (where |expected| > atol)
};

// Losses within rtol of the reference's, step by step.
Closeness CompareLosses(Problems& problems, const std::vector<double>& actual,
                        const std::vector<double>& expected, double rtol, const std::string& what) {
  Closeness c;
  if (actual.size() != expected.size()) {
    problems.Add(absl::StrCat(what, ": ", actual.size(), " losses, expected ", expected.size()));
    return c;
  }
  for (size_t i = 0; i < actual.size(); ++i) {
    const double diff = std::abs(actual[i] - expected[i]);
    const double rel = diff / std::max(std::abs(expected[i]), 1e-12);
    c.max_abs = std::max(c.max_abs, diff);
    c.max_rel = std::max(c.max_rel, rel);
    if (!std::isfinite(actual[i]) || rel > rtol) {
      problems.Add(
          absl::StrFormat("%s: step %d loss %.9g, reference %.9g (relative difference "
                          "%.3g > %.3g)",
                          what, static_cast<int>(i), actual[i], expected[i], rel, rtol));
    }
  }
  return c;
}

// Parameters close elementwise: |a - e| <= atol + rtol * |e| (torch.allclose).
Closeness CompareParams(Problems& problems, const Params& actual, const Params& expected,
                        double rtol, double atol) {
  Closeness c;
  for (const auto& [name, want] : expected) {
    auto it = actual.find(name);
    if (it == actual.end()) {
      problems.Add("final parameters: " + name + " missing from the FSDP model");
      continue;
    }
    const torch::Tensor& got = it->second;
    if (got.sizes() != want.sizes()) {
      problems.Add(absl::StrCat("final parameters: ", name, " has shape ", c10::str(got.sizes()),
                                ", expected ", c10::str(want.sizes())));
      continue;
    }
    const torch::Tensor diff = (got.to(torch::kDouble) - want.to(torch::kDouble)).abs();
    const double max_abs = diff.max().item<double>();
    const torch::Tensor scale = want.to(torch::kDouble).abs();
    const double max_rel = (diff / scale.clamp_min(atol)).max().item<double>();
    c.max_abs = std::max(c.max_abs, max_abs);
    c.max_rel = std::max(c.max_rel, max_rel);
    if (!torch::allclose(got, want, rtol, atol)) {
      problems.Add(
          absl::StrFormat("final parameters: %s differs from the reference by up to "
                          "%.3g (relative %.3g; tolerance rtol %.0e, atol %.0e)",
                          name, max_abs, max_rel, rtol, atol));
    }
  }
  if (actual.size() != expected.size()) {
    problems.Add(absl::StrCat("final parameters: ", actual.size(), " in the FSDP model, ",
                              expected.size(), " in the reference"));
  }
  return c;
}

// fp32 on one GPU: the same kernels on the same shapes, FSDP adding only
// copies (a one-rank "reduction" is the gradient itself), so the numbers
// are expected equal up to rounding. Tolerance: the parity test's
// (tests/fsdp_parity_test.cc): rtol 1e-5, atol 1e-6.
constexpr double kFp32Rtol = 1e-5;
constexpr double kFp32Atol = 1e-6;

// The fp32 reference, computed once.
const Run& Reference() {
  static const Run* reference = new Run(TrainUnwrapped(g_device));
  return *reference;
}

CheckResult CheckParityFp32(const comm::ProcessGroup& group, bool fully_shard) {
  Problems problems;
  auto check_devices = [](int step, const std::vector<torch::Tensor>& parameters, Problems& p) {
    if (step != 0) return;
    for (const torch::Tensor& param : parameters) {
      if (param.device() != g_device || !param.grad().defined() ||
          param.grad().device() != g_device) {
        p.Add(absl::StrCat("after backward: a parameter on ", param.device().str(), " with ",
                           param.grad().defined() ? "a gradient on " + param.grad().device().str()
                                                  : std::string("no gradient"),
                           ": expected both on ", g_device.str()));
        return;
      }
    }
  };
  FsdpVariant variant;
  variant.fully_shard = fully_shard;
  const Run fsdp = TrainFsdp(group, variant, check_devices, problems);
  const Run& ref = Reference();
  if (!(ref.losses.back() < ref.losses.front())) {
    problems.Add(
        absl::StrFormat("the unwrapped reference did not train (loss %.6f -> %.6f): "
                        "the parity would be vacuous",
                        ref.losses.front(), ref.losses.back()));
  }
  const Closeness loss = CompareLosses(problems, fsdp.losses, ref.losses, kFp32Rtol, "fp32");
  const Closeness params = CompareParams(problems, fsdp.params, ref.params, kFp32Rtol, kFp32Atol);
  if (!problems.empty()) return Fail(problems.Joined());
  return Pass(absl::StrFormat(
      "%d SGD steps, losses %.6f..%.6f: max loss difference %.3g (relative %.3g), final "
      "parameters max abs difference %.3g (tolerance rtol %.0e, atol %.0e)",
      kSteps, fsdp.losses.front(), fsdp.losses.back(), loss.max_abs, loss.max_rel, params.max_abs,
      kFp32Rtol, kFp32Atol));
}

// bf16 parameters and compute, fp32 gradient reduction. There is no exact
// bf16 reference (autocast-free bf16 in the unwrapped model would round
// differently), so: every step's loss within 2e-2 relative of the fp32
// reference's (the loss itself is a bf16 number, ~0.4% resolution at 5.5;
// the trainer's README states 3% and measures < 1%), gradients finite and
// fp32 (reduced in fp32, cast back to the parameters' dtype), parameters
// still fp32 and finite.
CheckResult CheckParityBf16(const comm::ProcessGroup& group, bool fully_shard) {
  constexpr double kBf16LossRtol = 2e-2;
  Problems problems;
  auto check_grads = [](int step, const std::vector<torch::Tensor>& parameters, Problems& p) {
    int with_grad = 0;
    for (const torch::Tensor& param : parameters) {
      if (param.scalar_type() != torch::kFloat) {
        p.Add(absl::StrCat("step ", step, ": a parameter has dtype ",
                           c10::toString(param.scalar_type()), ": expected float32"));
        return;
      }
      const torch::Tensor& grad = param.grad();
      if (!grad.defined()) continue;
      ++with_grad;
      if (grad.scalar_type() != torch::kFloat) {
        p.Add(absl::StrCat("step ", step, ": a gradient has dtype ",
                           c10::toString(grad.scalar_type()), ": expected float32"));
        return;
      }
      if (!torch::isfinite(grad).all().item<bool>()) {
        p.Add(absl::StrCat("step ", step, ": a gradient (shape ", c10::str(grad.sizes()),
                           ") has non-finite values"));
        return;
      }
    }
    if (with_grad == 0) p.Add(absl::StrCat("step ", step, ": no parameter has a gradient"));
  };
  FsdpVariant variant;
  variant.bf16 = true;
  variant.fully_shard = fully_shard;
  const Run fsdp = TrainFsdp(group, variant, check_grads, problems);
  const Run& ref = Reference();
  const Closeness loss =
      CompareLosses(problems, fsdp.losses, ref.losses, kBf16LossRtol, "bf16 vs fp32");
  for (const auto& [name, value] : fsdp.params) {
    if (!torch::isfinite(value).all().item<bool>()) {
      problems.Add("final parameters: " + name + " has non-finite values");
    }
  }
  if (!problems.empty()) return Fail(problems.Joined());
  return Pass(absl::StrFormat(
      "%d SGD steps: losses within %.3g relative of the fp32 reference (tolerance %.0e), "
      "gradients float32 and finite every step, parameters float32 and finite",
      kSteps, loss.max_rel, kBf16LossRtol));
}

// CPU offload: shards (and the optimizer's parameters and gradients) pinned
// on the CPU, gathered onto cuda:0 to compute. The optimizer then runs on
// the CPU and the reference's on the GPU; both compute the same fp32 SGD,
// so the fp32 tolerance applies.
CheckResult CheckParityCpuOffload(const comm::ProcessGroup& group, bool fully_shard) {
  Problems problems;
  auto check_offloaded = [](int step, const std::vector<torch::Tensor>& parameters, Problems& p) {
    for (const torch::Tensor& param : parameters) {
      if (!param.device().is_cpu()) {
        p.Add(absl::StrCat("step ", step, ": an optimizer-facing parameter is on ",
                           param.device().str(), ": expected the CPU (offload_params)"));
        return;
      }
      if (param.grad().defined() && !param.grad().device().is_cpu()) {
        p.Add(absl::StrCat("step ", step, ": a gradient is on ", param.grad().device().str(),
                           ": expected the CPU (offload_params)"));
        return;
      }
    }
  };
  FsdpVariant variant;
  variant.cpu_offload = true;
  variant.fully_shard = fully_shard;
  const Run fsdp = TrainFsdp(group, variant, check_offloaded, problems);
  const Run& ref = Reference();
  const Closeness loss = CompareLosses(problems, fsdp.losses, ref.losses, kFp32Rtol, "offload");
  const Closeness params = CompareParams(problems, fsdp.params, ref.params, kFp32Rtol, kFp32Atol);
  if (!problems.empty()) return Fail(problems.Joined());
  return Pass(absl::StrFormat(
      "shards %son the CPU, gradients on the CPU; %d SGD steps: max loss difference %.3g, "
      "final parameters max abs difference %.3g (tolerance rtol %.0e, atol %.0e)",
      DryRun() ? "(dry run: not pinned) " : "pinned ", kSteps, loss.max_abs, params.max_abs,
      kFp32Rtol, kFp32Atol));
}

// ---------------------------------------------------------------------------
// c. Two ranks on one GPU over Gloo with CUDA tensors.

// Batch split over 2 ranks: each rank's mean loss is over half the rows,
// the gradient is the average of two half-batch means, and Gloo sums in its
// own order, so the numbers differ from the one-process reference by
// rounding only (measured on the CPU, --dry-run-on-cpu: 6e-8 in the
// parameters). Tolerance: the fp32 one, as tests/fsdp_parity_test.cc uses
// for 2 and 4 ranks.
constexpr double kTwoRankLossRtol = kFp32Rtol;
constexpr double kTwoRankRtol = kFp32Rtol;
constexpr double kTwoRankAtol = kFp32Atol;

// In each re-executed rank: FSDP on the world group (Gloo, from the
// launcher's environment) against the unwrapped model, which every rank
// trains itself on the whole batch. Prints one "RESULT ..." line (rank 0)
// or the problems, and exits 0 when it matched.
int RunGlooRank(bool fully_shard) {
  comm::InitOptions init;  // gloo, env://: RANK, WORLD_SIZE, MASTER_* from launcher::launch
  init.timeout = kCollectiveTimeout;
  auto group = comm::init_process_group(init);
  if (!group.ok()) {
    std::fprintf(stderr, "gpu_check rank: comm::init_process_group(gloo, env://): %s\n",
                 std::string(group.status().message()).c_str());
    return 1;
  }
  try {
    Problems problems;
    FsdpVariant variant;
    variant.fully_shard = fully_shard;
    const Run fsdp = TrainFsdp(*group, variant, nullptr, problems);
    const Run ref = TrainUnwrapped(g_device);
    const Closeness loss =
        CompareLosses(problems, fsdp.losses, ref.losses, kTwoRankLossRtol, "2 ranks");
    const Closeness params =
        CompareParams(problems, fsdp.params, ref.params, kTwoRankRtol, kTwoRankAtol);
    if (!problems.empty()) {
      std::fprintf(stderr, "PROBLEMS %s\n", problems.Joined().c_str());
      return 1;
    }
    if (group->rank() == 0) {
      std::printf(
          "RESULT %s: %d SGD steps on %d ranks (Gloo, %s tensors, half the batch each): "
          "max loss difference %.3g (relative %.3g, tolerance %.0e), final parameters "
          "max abs difference %.3g (tolerance rtol %.0e, atol %.0e)\n",
          fully_shard ? "fully_shard" : "FSDP FULL_SHARD", kSteps, group->size(),
          DryRun() ? "CPU" : "CUDA", loss.max_abs, loss.max_rel, kTwoRankLossRtol, params.max_abs,
          kTwoRankRtol, kTwoRankAtol);
      std::fflush(stdout);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "PROBLEMS %s\n", Describe(e).c_str());
    return 1;
  }
}

// Re-executes this binary as 2 ranks through launcher::launch (as the trainer's
// --nproc does) and collects their verdict.
CheckResult CheckGlooTwoRanksCuda(bool fully_shard) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return Fail("cannot resolve /proc/self/exe to re-execute this binary");
  self[n] = '\0';
  launcher::LaunchOptions launch;
  launch.nproc_per_node = 2;
  launch.command = {self, kGlooRankArg, fully_shard ? kFullyShardApi : kFsdp1Api};
  if (DryRun()) launch.command.push_back(kDryRunArg);
  launch.timeout = std::chrono::minutes(5);
  launch.collective_timeout = kCollectiveTimeout;
  std::mutex mu;
  std::vector<std::string> lines;
  std::string result_line;
  launch.on_line = [&](int rank, bool is_stderr, const std::string& line) {
    std::lock_guard<std::mutex> lock(mu);
    if (rank == 0 && !is_stderr && absl::StartsWith(line, "RESULT ")) {
      result_line = line.substr(7);
    } else {
      lines.push_back(absl::StrCat("[rank ", rank, "] ", line));
    }
  };
  launch.on_event = [&](const std::string& message) {
    std::lock_guard<std::mutex> lock(mu);
    lines.push_back("launch: " + message);
  };
  auto result = launcher::launch(launch);
  if (!result.ok()) return Fail(absl::StrCat("launcher::launch: ", result.status().message()));
  if (result->exit_code != 0 || result_line.empty()) {
    // The ranks' own words (their last lines), then the launcher's summary.
    std::vector<std::string> last;
    for (const std::string& line : lines) {
      if (absl::StrContains(line, "PROBLEMS") || absl::StrContains(line, "rror") ||
          absl::StrContains(line, "gpu_check")) {
        last.push_back(line);
      }
    }
    if (last.size() > 6) last.erase(last.begin(), last.end() - 6);
    return Fail(absl::StrCat("exit status ", result->exit_code, ": ", result->summary, " | ",
                             absl::StrJoin(last, " | ")));
  }
  return Pass(result_line);
}

// ---------------------------------------------------------------------------
// e. Fused and foreach optimizers (optim/) on the device.

// optim::Adam / AdamW / SGD, fused and foreach, on g_device: parameters in
// two dtypes (float32 and, on CUDA, bfloat16: two buckets of the fused
// kernels), 4 steps of fixed gradients, against torch::optim's on the CPU
// in float32 (rtol 1e-5, atol 1e-6; bfloat16 parameters within 2e-2 of the
// reference). On CUDA the steps after the first (the state exists) run
// under CUDA's sync-debug mode set to error: a step that synchronises the
// host (reads a value back) throws.
template <typename Ours, typename Reference, typename Options>
void CheckOneOptimizer(Problems& problems, const std::string& what, const Options& options,
                       optim::Implementation impl) {
  torch::manual_seed(36);
  const std::vector<std::vector<int64_t>> shapes = {{33, 7}, {129}, {4, 5, 6}};
  std::vector<torch::Tensor> init, ours, ref;
  for (const auto& s : shapes) init.push_back(torch::randn(s));
  for (size_t i = 0; i < init.size(); ++i) {
    const auto dtype = (!DryRun() && i == 1) ? torch::kBFloat16 : torch::kFloat32;
    ours.push_back(
        init[i].to(g_device, dtype, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true));
    ref.push_back(init[i].to(ours[i].dtype()).to(torch::kFloat32).clone().requires_grad_(true));
  }
  Ours opt(ours, options, impl);
  Reference ref_opt(ref, options);
  for (int step = 0; step < 4; ++step) {
    for (size_t i = 0; i < init.size(); ++i) {
      torch::Tensor g = torch::randn(init[i].sizes());
      ours[i].mutable_grad() = g.to(g_device, ours[i].dtype());
      ref[i].mutable_grad() = g.to(ours[i].dtype()).to(torch::kFloat32);
    }
#ifdef TORCHFSDP_CUDA
    const bool no_sync = !DryRun() && step > 0;
    if (no_sync) c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
    try {
      opt.step();
    } catch (...) {
      c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
      throw;
    }
    if (no_sync) {
      c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    }
#else
    opt.step();
#endif
    ref_opt.step();
  }
  for (size_t i = 0; i < init.size(); ++i) {
    const torch::Tensor a = ours[i].detach().to(torch::kCPU, torch::kFloat32);
    const bool low = ours[i].scalar_type() == torch::kBFloat16;
    const torch::Tensor e =
        low ? ref[i].detach().to(torch::kBFloat16).to(torch::kFloat32) : ref[i].detach();
    if (!torch::allclose(a, e, low ? 2e-2 : 1e-5, low ? 2e-2 : 1e-6)) {
      problems.Add(absl::StrCat(what, " ", optim::implementation_name(impl), ": parameter ", i,
                                " (", c10::toString(ours[i].scalar_type()),
                                ") differs from torch::optim's on the CPU by up to ",
                                (a - e).abs().max().item<double>()));
    }
  }
}

CheckResult CheckFusedOptimizers() {
  Problems problems;
  for (const auto impl : {optim::Implementation::kFused, optim::Implementation::kForeach}) {
    CheckOneOptimizer<optim::AdamW, torch::optim::AdamW>(
        problems, "AdamW", torch::optim::AdamWOptions(1e-2).weight_decay(0.1), impl);
    CheckOneOptimizer<optim::Adam, torch::optim::Adam>(
        problems, "Adam amsgrad", torch::optim::AdamOptions(1e-2).weight_decay(0.05).amsgrad(true),
        impl);
    CheckOneOptimizer<optim::SGD, torch::optim::SGD>(
        problems, "SGD nesterov",
        torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(0.01), impl);
  }
  if (!problems.empty()) return Fail(problems.Joined());
  return Pass(absl::StrCat("fused and foreach Adam (amsgrad), AdamW, SGD (nesterov) on ",
                           g_device.str(),
                           DryRun() ? ""
                                    : " (float32 and bfloat16 buckets; steps 2-4 under "
                                      "sync-debug mode error)",
                           " equal torch::optim's on the CPU over 4 steps"));
}

// ---------------------------------------------------------------------------
// A full FSDP training step with no host synchronisation (issue 36, item 5).

// CUDA's sync-debug mode (PyTorch's torch.cuda.set_sync_debug_mode) while
// alive: kError makes any call that makes the host wait for the GPU (a
// .item(), a blocking copy, cudaStreamSynchronize, a nonzero) throw; kWarn
// makes it warn, and this scope records each such warning instead of
// printing it (with the phase set at the time and the stack where it was
// raised; autograd replays its worker threads' warnings on this thread at
// the end of backward, so those stacks show the replay). Off again when
// the scope ends, thrown through or not. Nothing on the CPU.
class SyncDebugScope : public c10::WarningHandler {
 public:
  enum class Mode { kOff, kWarn, kError };
  struct Sync {
    std::string phase;
    std::string stack;
  };

  explicit SyncDebugScope(Mode mode) : mode_(mode) {
#ifdef TORCHFSDP_CUDA
    if (mode_ == Mode::kWarn) {
      previous_handler_ = c10::WarningUtils::get_warning_handler();
      c10::WarningUtils::set_warning_handler(this);
    }
    if (mode_ != Mode::kOff) {
      c10::cuda::warning_state().set_sync_debug_mode(mode_ == Mode::kWarn
                                                         ? c10::cuda::SyncDebugMode::L_WARN
                                                         : c10::cuda::SyncDebugMode::L_ERROR);
    }
#endif
  }
  ~SyncDebugScope() override {
#ifdef TORCHFSDP_CUDA
    if (mode_ != Mode::kOff) {
      c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    }
    if (mode_ == Mode::kWarn) c10::WarningUtils::set_warning_handler(previous_handler_);
#endif
  }
  SyncDebugScope(const SyncDebugScope&) = delete;
  SyncDebugScope& operator=(const SyncDebugScope&) = delete;

  void set_phase(std::string phase) { phase_ = std::move(phase); }
  const std::vector<Sync>& syncs() const { return syncs_; }

  void process(const c10::Warning& warning) override {
    if (!absl::StrContains(warning.msg(), "synchroniz")) {
      if (previous_handler_ != nullptr) previous_handler_->process(warning);
      return;
    }
    syncs_.push_back({phase_, c10::get_backtrace(/*frames_to_skip=*/1,
                                                 /*maximum_number_of_frames=*/24)});
  }

 private:
  Mode mode_;
  c10::WarningHandler* previous_handler_ = nullptr;
  std::string phase_;
  std::vector<Sync> syncs_;
};

// The trainer's step on the NCCL world of 1: trainer/models.h's transformer
// (SDPA attention) in FSDP FULL_SHARD, one unit per block, bf16 parameters
// with fp32 reduction, optim/'s fused AdamW; the batch copied from pinned
// memory without blocking. Step 1 warms up (NCCL's communicator, the
// optimizer's state, the allocator's pools); step 2 runs under sync-debug
// mode warn and counts every synchronising call by phase (their stacks go
// to stderr); steps 3-5 each run forward, backward (gradient reduction
// inside) and the optimizer step under sync-debug mode error, phase by
// phase, so a synchronisation is reported naming the phase. Only each step's loss is then read
// (.item(), the logged loss: outside the mode). The losses must be finite and fall (the same batch
// every step).
CheckResult CheckStepNoSync(const comm::ProcessGroup& group, bool fully_shard) {
  Problems problems;
  FsdpVariant variant;
  variant.bf16 = true;
  variant.fully_shard = fully_shard;
  ShardedTransformer sharded(group, variant);
  optim::AdamW optimizer(sharded.parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.01),
                         optim::Implementation::kFused);
  // This rank's rows, pinned once, so each step's copy to the GPU is
  // asynchronous (a pageable copy waits for the GPU).
  torch::Tensor host_batch = Batch(group.rank(), group.size());
  if (!DryRun()) host_batch = host_batch.pin_memory();

  // Step 1 warms up; step 2 surveys under kWarn (every synchronising call
  // of the step counted, by phase, with where it was raised: written to
  // stderr); steps 3-5 are the test, under kError.
  constexpr int kNoSyncSteps = 3;
  std::vector<double> losses;
  std::vector<SyncDebugScope::Sync> surveyed;
  for (int step = 1; step <= 2 + kNoSyncSteps; ++step) {
    const bool survey = step == 2 && !DryRun();
    const bool checked = step > 2 && !DryRun();
    std::string phase = "zero_grad and the batch's copy";
    try {
      torch::Tensor loss;
      {
        SyncDebugScope mode(checked  ? SyncDebugScope::Mode::kError
                            : survey ? SyncDebugScope::Mode::kWarn
                                     : SyncDebugScope::Mode::kOff);
        auto enter = [&](const char* what) {
          phase = what;
          mode.set_phase(phase);
        };
        enter("zero_grad and the batch's copy");
        optim::zero_grad(optimizer);  // as the trainer
        const torch::Tensor batch = host_batch.to(g_device, /*non_blocking=*/true);
        enter("forward");
        loss = sharded.Loss(batch);
        enter("backward (FSDP's gradient reduction inside)");
        loss.backward();
        enter("the fused AdamW step");
        optimizer.step();
        surveyed = mode.syncs();
      }
      phase = "reading the loss";
      losses.push_back(loss.item<double>());
    } catch (const c10::Error& e) {
      std::string what = e.what_without_backtrace();
      if (const auto nl = what.find('\n'); nl != std::string::npos) what.resize(nl);
      problems.Add(absl::StrCat("step ", step, ", ", phase,
                                checked ? " (under sync-debug mode error)" : "", ": ", what));
      // Where: the whole error, its stack included, for gpu_check.log.
      std::fprintf(stderr, "%s step %d, %s: %s\n", fully_shard ? "fully_shard" : "FSDP", step,
                   phase.c_str(), e.what());
      break;
    }
  }
  if (!surveyed.empty()) {
    std::map<std::string, int> by_phase;
    for (const SyncDebugScope::Sync& sync : surveyed) {
      ++by_phase[sync.phase];
      std::fprintf(stderr, "%s step 2 synchronised the host in %s, at:\n%s\n",
                   fully_shard ? "fully_shard" : "FSDP", sync.phase.c_str(), sync.stack.c_str());
    }
    std::vector<std::string> counts;
    for (const auto& [where, n] : by_phase) counts.push_back(absl::StrCat(where, " x", n));
    problems.Add(absl::StrCat("step 2 under sync-debug mode warn: ", surveyed.size(),
                              " synchronising calls (", absl::StrJoin(counts, ", "),
                              "; their stacks are in gpu_check's stderr)"));
  }
  if (problems.empty()) {
    for (size_t i = 0; i < losses.size(); ++i) {
      if (!std::isfinite(losses[i])) {
        problems.Add(absl::StrCat("step ", i + 1, ": loss ", losses[i], " is not finite"));
      }
    }
    if (!losses.empty() && !(losses.back() < losses.front())) {
      problems.Add(absl::StrFormat("the loss did not fall over %d steps (%.6f -> %.6f)",
                                   static_cast<int>(losses.size()), losses.front(), losses.back()));
    }
  }
  if (!problems.empty()) return Fail(problems.Joined());
  return Pass(absl::StrFormat(
      "%s, bf16 parameters and fp32 reduction, fused AdamW: %d steps, loss "
      "%.6f -> %.6f%s",
      fully_shard ? "fully_shard" : "FSDP FULL_SHARD", static_cast<int>(losses.size()),
      losses.front(), losses.back(),
      DryRun() ? " (dry run: no sync-debug mode on the CPU)"
               : "; step 2 under sync-debug mode warn found no synchronising call, steps 3-5 "
                 "(forward, backward with the reduction, optimizer step) ran under sync-debug "
                 "mode error: no host synchronisation but the loss's"));
}

// ---------------------------------------------------------------------------
// functorch on the device (issue 36, item 6): the results equal the CPU's,
// and the time per call beside torch.func's (benchmarks/run_gpu.sh reads the
// "median X ms" of these lines).

// Calls `fn` `warm_up` times, then times `reps` calls (the device
// synchronised before and after each) and returns the median in ms.
double MedianMs(const std::function<void()>& fn, int warm_up, int reps) {
  auto sync = [] {
    if (!DryRun()) torch::cuda::synchronize();
  };
  for (int i = 0; i < warm_up; ++i) fn();
  std::vector<double> ms;
  ms.reserve(static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    sync();
    const auto start = std::chrono::steady_clock::now();
    fn();
    sync();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count());
  }
  std::nth_element(ms.begin(), ms.begin() + static_cast<std::ptrdiff_t>(ms.size() / 2), ms.end());
  return ms[ms.size() / 2];
}

// max|actual - expected| over max|expected|, both compared on the CPU; the
// shapes must agree. Adds a problem when the ratio exceeds `rtol`.
double CompareToCpu(Problems& problems, const std::string& what, const torch::Tensor& actual,
                    const torch::Tensor& expected, double rtol) {
  const torch::Tensor a = actual.to(torch::kCPU);
  if (a.sizes() != expected.sizes()) {
    problems.Add(absl::StrCat(what, ": shape ", c10::str(a.sizes()), ", expected ",
                              c10::str(expected.sizes()), " (the CPU's)"));
    return 0;
  }
  const double diff = (a - expected).abs().max().item<double>();
  const double scale = expected.abs().max().item<double>();
  const double rel = scale > 0 ? diff / scale : diff;
  if (!(rel <= rtol)) {
    problems.Add(
        absl::StrFormat("%s: max |%s - CPU| = %.3g, %.3g of max |CPU| = %.3g: expected <= %g", what,
                        g_device.str(), diff, rel, scale, rtol));
  }
  return rel;
}

// How the device result was compared with the CPU's, for a PASS line.
std::string ComparedWithCpu(double rel, double rtol) {
  if (DryRun()) {
    return absl::StrFormat(
        "max difference %.3g of max |CPU| (dry run: the device is the CPU, so this compares "
        "the CPU with itself and is trivially exact)",
        rel);
  }
  return absl::StrFormat("max |%s - CPU| = %.3g of max |CPU| (<= %g; TF32 matmuls %s)",
                         g_device.str(), rel, rtol,
                         at::globalContext().allowTF32CuBLAS() ? "ON" : "off");
}

// //benchmarks:transforms_bench's BM_PerSampleGrad_VmapGrad case: an MLP
// 128 -> 256 -> ReLU -> 10, cross-entropy, batch 256, float32; the
// per-example loss, as written for vmap.
torch::Tensor PerSampleLoss(const torch::Tensor& w1, const torch::Tensor& b1,
                            const torch::Tensor& w2, const torch::Tensor& b2,
                            const torch::Tensor& x, const torch::Tensor& t) {
  namespace F = torch::nn::functional;
  torch::Tensor logits = F::linear(F::linear(x, w1, b1).relu(), w2, b2);
  return F::cross_entropy(logits.unsqueeze(0), t.unsqueeze(0));
}

CheckResult CheckFunctorchPerSampleGrads() {
  constexpr double kRtol = 1e-5;
  torch::manual_seed(0);
  const std::vector<torch::Tensor> cpu_inputs = {
      torch::randn({256, 128}) * 0.05, torch::zeros({256}),
      torch::randn({10, 256}) * 0.05,  torch::zeros({10}),
      torch::randn({256, 128}),        torch::randint(0, 10, {256})};
  std::vector<torch::Tensor> inputs;
  for (const auto& t : cpu_inputs) inputs.push_back(t.to(g_device));
  auto per_sample = functorch::vmap(functorch::grad(PerSampleLoss, {0, 1, 2, 3}),
                                    {std::nullopt, std::nullopt, std::nullopt, std::nullopt, 0, 0});
  auto run = [&per_sample](const std::vector<torch::Tensor>& in) -> std::vector<torch::Tensor> {
    return per_sample(in[0], in[1], in[2], in[3], in[4], in[5]);
  };
  const std::vector<torch::Tensor> expected = run(cpu_inputs);
  const std::vector<torch::Tensor> actual = run(inputs);
  Problems problems;
  const char* const names[] = {"dw1", "db1", "dw2", "db2"};
  double worst = 0;
  if (actual.size() != 4 || expected.size() != 4) {
    problems.Add(absl::StrCat("vmap(grad) returned ", actual.size(), " (device) and ",
                              expected.size(), " (CPU) gradients: expected 4"));
  } else {
    for (size_t i = 0; i < 4; ++i) {
      if (actual[i].device() != g_device) {
        problems.Add(absl::StrCat(names[i], " is on ", actual[i].device().str(), ", expected ",
                                  g_device.str()));
      }
      worst = std::max(worst, CompareToCpu(problems, names[i], actual[i], expected[i], kRtol));
    }
  }
  if (!problems.empty()) return Fail(problems.Joined());
  constexpr int kReps = 20;
  const double ms = MedianMs([&] { run(inputs); }, /*warm_up=*/3, kReps);
  return Pass(absl::StrFormat(
      "vmap(grad(loss)) over MLP 128-256-10, cross-entropy, batch 256, float32 on %s: "
      "4 per-sample gradients ([256, 256, 128] ...) equal the CPU's: %s; median %.3f ms of %d "
      "calls",
      g_device.str(), ComparedWithCpu(worst, kRtol), ms, kReps));
}

// //benchmarks:hessian_bench's PINN case: u: R^2 -> R^3, 2 -> 512 -> 512 ->
// 512 -> 3, tanh after each hidden layer, float32; its Hessians
// vmap(jacfwd(jacrev(u))) at 1024 points -> [1024, 3, 2, 2].
struct PinnMlp {
  std::vector<torch::Tensor> p;  // w1 b1 w2 b2 w3 b3 w4 b4
  torch::Tensor operator()(const torch::Tensor& x) const {
    namespace F = torch::nn::functional;
    torch::Tensor h = F::linear(x, p[0], p[1]).tanh();
    h = F::linear(h, p[2], p[3]).tanh();
    h = F::linear(h, p[4], p[5]).tanh();
    return F::linear(h, p[6], p[7]);
  }
  PinnMlp To(torch::Device device) const {
    PinnMlp moved;
    for (const auto& t : p) moved.p.push_back(t.to(device));
    return moved;
  }
};

CheckResult CheckFunctorchBatchedHessians() {
  // Second derivatives through three 512-wide layers in float32: the
  // device's summation order differs from the CPU's.
  constexpr double kRtol = 1e-4;
  constexpr int64_t kIn = 2, kHidden = 512, kOut = 3, kPoints = 1024;
  torch::manual_seed(0);
  PinnMlp cpu_u;
  cpu_u.p = {
      torch::randn({kHidden, kIn}) / std::sqrt(double{kIn}),         torch::randn({kHidden}) * 0.1,
      torch::randn({kHidden, kHidden}) / std::sqrt(double{kHidden}), torch::randn({kHidden}) * 0.1,
      torch::randn({kHidden, kHidden}) / std::sqrt(double{kHidden}), torch::randn({kHidden}) * 0.1,
      torch::randn({kOut, kHidden}) / std::sqrt(double{kHidden}),    torch::randn({kOut}) * 0.1};
  const torch::Tensor cpu_xs = torch::rand({kPoints, kIn}) * 2 - 1;
  const PinnMlp u = cpu_u.To(g_device);
  const torch::Tensor xs = cpu_xs.to(g_device);
  auto hessians_of = [](const PinnMlp& f) {
    auto ff = [f](const torch::Tensor& x) { return f(x); };
    return functorch::vmap(functorch::jacfwd(functorch::jacrev(ff)));
  };
  auto cpu_hessians = hessians_of(cpu_u);
  auto hessians = hessians_of(u);
  const torch::Tensor expected = cpu_hessians(cpu_xs);
  const torch::Tensor actual = hessians(xs);
  Problems problems;
  if (actual.device() != g_device) {
    problems.Add(
        absl::StrCat("the Hessians are on ", actual.device().str(), ", expected ", g_device.str()));
  }
  const double rel = CompareToCpu(problems, "Hessians", actual, expected, kRtol);
  if (!problems.empty()) return Fail(problems.Joined());
  // A call takes about a second on a small CPU: fewer calls in a dry run.
  const int reps = DryRun() ? 3 : 20;
  const double ms = MedianMs([&] { hessians(xs); }, DryRun() ? 1 : 3, reps);
  return Pass(absl::StrFormat(
      "vmap(jacfwd(jacrev(u))), u a 2-512-512-512-3 tanh MLP, float32, %d points on %s: "
      "Hessians [%d, 3, 2, 2] equal the CPU's: %s; median %.3f ms of %d calls",
      static_cast<int>(kPoints), g_device.str(), static_cast<int>(kPoints),
      ComparedWithCpu(rel, kRtol), ms, reps));
}

// ---------------------------------------------------------------------------

struct Check {
  std::string name;
  std::function<CheckResult()> run;
};

// The reason the checks cannot run here, or nothing.
std::optional<std::string> WhyNotRun() {
  if (!kBuiltWithCuda) {
    return std::string(
        "gpu_check was built without CUDA (TORCHFSDP_CUDA undefined): build it with "
        "`bazel build --config=cuda //benchmarks:gpu_check` or benchmarks/gpu/CMakeLists.txt");
  }
  const int devices = static_cast<int>(torch::cuda::device_count());
  if (devices > 0) return std::nullopt;
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  // Without libtorch_cuda in the process LibTorch sees no device even on a
  // GPU machine (a link that dropped it): say which case this is.
  void* torch_cuda = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD);
  if (torch_cuda != nullptr) dlclose(torch_cuda);
  return absl::StrCat("no CUDA device (torch::cuda::device_count() is 0; LibTorch ", TORCH_VERSION,
                      ", libtorch_cuda.so ", torch_cuda != nullptr ? "loaded" : "NOT loaded",
                      "; CUDA_VISIBLE_DEVICES=",
                      visible != nullptr ? absl::StrCat("'", visible, "'") : "unset", ")");
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  std::string only;
  bool dry_run = false;
  bool rank_child = false;
  bool rank_child_fully_shard = false;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--only" && i + 1 < args.size()) {
      only = args[++i];
    } else if (absl::StartsWith(args[i], "--only=")) {
      only = args[i].substr(7);
    } else if (args[i] == kDryRunArg) {
      dry_run = true;
    } else if (args[i] == kGlooRankArg && i + 1 < args.size() &&
               (args[i + 1] == kFsdp1Api || args[i + 1] == kFullyShardApi)) {
      rank_child = true;
      rank_child_fully_shard = args[++i] == kFullyShardApi;
    } else {
      std::fprintf(stderr,
                   "gpu_check: unknown argument '%s' (usage: gpu_check [--only SUBSTRING] "
                   "[%s])\n",
                   args[i].c_str(), kDryRunArg);
      return 2;
    }
  }
  if (dry_run) g_device = torch::Device(torch::kCPU);
  if (rank_child) return RunGlooRank(rank_child_fully_shard);

  if (!dry_run) {
    if (auto why = WhyNotRun()) {
      std::printf("NOT RUN: %s\n", why->c_str());
      return kNotRun;
    }
    std::printf("gpu_check: LibTorch %s, %d CUDA device(s)\n", TORCH_VERSION,
                static_cast<int>(torch::cuda::device_count()));
  } else {
    std::printf(
        "gpu_check: LibTorch %s, %s: the FSDP checks on the CPU over Gloo (no NCCL, "
        "no GPU: this checks the checks only)\n",
        TORCH_VERSION, kDryRunArg);
  }
  std::fflush(stdout);

  // The FSDP checks share one world of 1 (NCCL; Gloo in a dry run), made
  // lazily, so a failure to make it fails those checks, each naming it.
  std::optional<absl::StatusOr<WorldOf1>> fsdp_world;
  // Each FSDP check runs for FullyShardedDataParallel (fully_shard false)
  // and for fully_shard.
  auto on_fsdp_world = [&](CheckResult (*check)(const comm::ProcessGroup&, bool),
                           bool fully_shard) {
    return [&fsdp_world, check, fully_shard]() -> CheckResult {
      if (!fsdp_world) fsdp_world.emplace(MakeWorldOf1(DryRun() ? "gloo" : "nccl"));
      if (!fsdp_world->ok()) return Fail(std::string(fsdp_world->status().message()));
      return check((*fsdp_world)->group, fully_shard);
    };
  };
  struct Entry {
    Check check;
    bool needs_gpu;  // skipped in a dry run
  };
  std::vector<Entry> checks = {
      {{"nccl_world_of_1", CheckNcclWorldOf1}, true},
      {{"gloo_cpu_nccl_cuda_world_of_1", CheckGlooCpuNcclCudaWorldOf1}, true},
      {{"nccl_work_stream_ordered", CheckNcclWorkStreamOrdered}, true},
      {{"fsdp_parity_full_shard_fp32", on_fsdp_world(CheckParityFp32, false)}, false},
      {{"fsdp_parity_bf16", on_fsdp_world(CheckParityBf16, false)}, false},
      {{"fsdp_parity_cpu_offload", on_fsdp_world(CheckParityCpuOffload, false)}, false},
      {{"fsdp_gloo_2_ranks_cuda", [] { return CheckGlooTwoRanksCuda(false); }}, false},
      {{"fused_optimizers", CheckFusedOptimizers}, false},
      {{"fsdp_step_no_sync", on_fsdp_world(CheckStepNoSync, false)}, false},
      {{"fully_shard_parity_fp32", on_fsdp_world(CheckParityFp32, true)}, false},
      {{"fully_shard_parity_bf16", on_fsdp_world(CheckParityBf16, true)}, false},
      {{"fully_shard_parity_cpu_offload", on_fsdp_world(CheckParityCpuOffload, true)}, false},
      {{"fully_shard_gloo_2_ranks_cuda", [] { return CheckGlooTwoRanksCuda(true); }}, false},
      {{"fully_shard_step_no_sync", on_fsdp_world(CheckStepNoSync, true)}, false},
      {{"functorch_per_sample_grads", CheckFunctorchPerSampleGrads}, false},
      {{"functorch_batched_hessians", CheckFunctorchBatchedHessians}, false},
  };
  // kernels/'s checks run on g_device too: in a dry run on the CPU through
  // the kernels' ATen stand-in, kernels_cuda_linked still checking that a
  // CUDA build linked //kernels:cuda (its registration needs no GPU).
  for (kernels::GpuCheck& check : kernels::KernelsGpuChecks(g_device, kBuiltWithCuda)) {
    checks.push_back({{std::move(check.name),
                       [run = std::move(check.run)]() -> CheckResult {
                         const kernels::GpuCheckResult result = run();
                         return {result.ok, result.detail};
                       }},
                      false});
  }

  int failed = 0;
  int ran = 0;
  for (const Entry& entry : checks) {
    const Check& check = entry.check;
    if (!only.empty() && !absl::StrContains(check.name, only)) continue;
    if (dry_run && entry.needs_gpu) continue;
    ++ran;
    const auto start = std::chrono::steady_clock::now();
    CheckResult result;
    try {
      result = check.run();
      // An asynchronous CUDA error belongs to this check.
      if (!dry_run) torch::cuda::synchronize();
    } catch (const std::exception& e) {
      result = Fail(absl::StrCat("threw: ", Describe(e)));
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("%s %s %s (%.1f s)\n", result.ok ? "PASS" : "FAIL", check.name.c_str(),
                result.detail.c_str(), seconds);
    std::fflush(stdout);
    if (!result.ok) ++failed;
  }
  if (ran == 0) {
    std::fprintf(stderr, "gpu_check: no check name contains '%s'\n", only.c_str());
    return 2;
  }
  std::printf("gpu_check: %d passed, %d failed\n", ran - failed, failed);
  return failed == 0 ? 0 : 1;
}
