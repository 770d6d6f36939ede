// Batched Hessians for scientific computing (issue 13, part 5): a small
// physics-informed MLP u: R^2 -> R^3 (2 -> 512 -> 512 -> 512 -> 3, tanh after
// each hidden layer, float32), its Hessian [3, 2, 2] at 1024 points.
//
//   bazel run //benchmarks:hessian_bench
//
//   BM_Hessian_VmapJacfwdJacrev   vmap(jacfwd(jacrev(u)))(xs) -> [1024,3,2,2]
//   BM_Hessian_VmapHessian        vmap(hessian(u))(xs), the same composition
//                                 through the hessian() entry point
//   BM_Hessian_PerPointLoop       hessian(u)(xs[i]) for each point, stacked:
//                                 the baseline a user writes without vmap
//   BM_MatmulReplay/<case>        only the matmul-family kernels that case
//                                 ran (recorded once, see below), replayed as
//                                 plain ATen calls on tensors of the same
//                                 sizes and strides: the time the case would
//                                 take if everything but its matmuls were
//                                 free, measured in this run
//   BM_Sgemm/MxKxN                torch::mm_out at 1024x512x512 (one hidden
//                                 layer over the batch) and at the shape the
//                                 batched case spends most of its FLOPs in
//
// FLOPs. Only matmul-family FLOPs are counted (2 per multiply-add);
// elementwise work (tanh, its derivatives, bias adds) is O(points x 512 x k)
// against O(points x 512^2 x k) and ignored. Derivation, per point, with
// n = 2 inputs, m = 3 outputs, H = 512: one pass of one vector through the
// network's matmuls (forward, or backward to the input, which runs the same
// shapes transposed) costs C = 2 (n H + 2 H^2 + H m) FLOP. jacfwd(jacrev(u))
// runs: the primal forward (1 vector), its forward-mode tangents along the n
// input directions (n vectors), the reverse pass for the m output
// cotangents (m vectors), and the forward-mode derivative of that reverse
// pass (m x n vectors; the weights are constants, so each tangent of a
// matmul is one matmul of the same shape). In all (1 + n + m + m n) C =
// 12 C = 12,644,352 FLOP per point, 12.95 GFLOP for 1024 points.
//
// The GFLOP/s counters of the three Hessian cases use that analytic count
// (the same work for all three, so their GFLOP/s compare like their times).
// As a cross-check, each case first runs once under an ATen RecordFunction
// observer that adds up 2 x (multiply-adds) of every matmul-family call
// (mm, addmm, bmm, baddbmm, addbmm, mv, addmv, dot, matmul, linear) whose
// inputs are plain tensors (functorch's BatchedTensor / TensorWrapper peeled
// off), counted once when one such call runs another (linear -> addmm).
// Startup prints that count against the analytic one with the shapes it
// saw. It is NOT exact: calls an autograd kernel makes by redispatch (the
// primal of a forward-AD op) are not observed, and some calls are observed
// twice, so first measurements gave 1.33x analytic (batched) and 0.67x
// (loop); the BM_MatmulReplay cases replay exactly the observed calls and
// their FLOP/s use the observed count.
#include <ATen/record_function.h>
#include <benchmark/benchmark.h>
#include <torch/nn/functional/linear.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "benchmarks/machine_report.h"
#include "functorch/transforms/transforms.h"

namespace {

using torch::Tensor;
namespace F = torch::nn::functional;

constexpr int64_t kPoints = 1024;
constexpr int64_t kIn = 2;
constexpr int64_t kHidden = 512;
constexpr int64_t kOut = 3;

struct PinnMlp {
  // Scaled so tanh stays out of saturation (values do not change the cost).
  Tensor w1 = torch::randn({kHidden, kIn}) / std::sqrt(double{kIn});
  Tensor b1 = torch::randn({kHidden}) * 0.1;
  Tensor w2 = torch::randn({kHidden, kHidden}) / std::sqrt(double{kHidden});
  Tensor b2 = torch::randn({kHidden}) * 0.1;
  Tensor w3 = torch::randn({kHidden, kHidden}) / std::sqrt(double{kHidden});
  Tensor b3 = torch::randn({kHidden}) * 0.1;
  Tensor w4 = torch::randn({kOut, kHidden}) / std::sqrt(double{kHidden});
  Tensor b4 = torch::randn({kOut}) * 0.1;

  // One point: x [2] -> u [3].
  Tensor operator()(const Tensor& x) const {
    Tensor h = F::linear(x, w1, b1).tanh();
    h = F::linear(h, w2, b2).tanh();
    h = F::linear(h, w3, b3).tanh();
    return F::linear(h, w4, b4);
  }
};

double AnalyticFlops(int64_t points) {
  const double pass = 2.0 * (kIn * kHidden + 2 * kHidden * kHidden + kHidden * kOut);
  return static_cast<double>(points) * (1 + kIn + kOut + kOut * kIn) * pass;
}

// The three ways of computing the [points, 3, 2, 2] Hessians.
struct Cases {
  PinnMlp f;
  Tensor xs;
  std::function<Tensor(const Tensor&)> vmap_jacfwd_jacrev;
  std::function<Tensor(const Tensor&)> vmap_hessian;
  std::function<Tensor(const Tensor&)> per_point_loop;

  Cases() {
    torch::manual_seed(0);
    xs = torch::rand({kPoints, kIn}) * 2 - 1;
    const PinnMlp& u = f;
    auto ff = [u](const Tensor& x) { return u(x); };
    auto a = functorch::vmap(functorch::jacfwd(functorch::jacrev(ff)));
    vmap_jacfwd_jacrev = [a](const Tensor& x) -> Tensor { return a(x); };
    auto b = functorch::vmap(functorch::hessian(ff));
    vmap_hessian = [b](const Tensor& x) -> Tensor { return b(x); };
    auto h = functorch::hessian(ff);
    per_point_loop = [h](const Tensor& x) {
      std::vector<Tensor> per_point;
      per_point.reserve(static_cast<size_t>(x.size(0)));
      for (int64_t i = 0; i < x.size(0); ++i) per_point.push_back(h(x[i]));
      return torch::stack(per_point);
    };
  }
};

Cases& GetCases() {
  static Cases* cases = new Cases();
  return *cases;
}

// --- the matmul recorder ------------------------------------------------------

struct TensorMeta {
  std::vector<int64_t> sizes, strides;
  bool operator<(const TensorMeta& o) const {
    return std::tie(sizes, strides) < std::tie(o.sizes, o.strides);
  }
};

struct MatmulCall {
  std::string op;                                 // "aten::mm", ...
  std::vector<std::optional<TensorMeta>> inputs;  // nullopt: not a tensor / None
  double flops = 0;
};

bool IsMatmulOp(const std::string& op) {
  static const char* const kOps[] = {"aten::mm",     "aten::addmm",  "aten::bmm",   "aten::baddbmm",
                                     "aten::addbmm", "aten::mv",     "aten::addmv", "aten::dot",
                                     "aten::vdot",   "aten::matmul", "aten::linear"};
  return std::find(std::begin(kOps), std::end(kOps), op) != std::end(kOps);
}

// A tensor functorch has not wrapped (no BatchedTensor, no grad/jvp
// TensorWrapper): an op on such inputs is the physical kernel call.
bool IsPlain(const Tensor& t) {
  return !t.key_set().has_any(c10::DispatchKeySet(
      {c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper}));
}

double Prod(c10::IntArrayRef v) {
  double p = 1;
  for (int64_t x : v) p *= static_cast<double>(x);
  return p;
}

// 2 x multiply-adds of one call, from its input sizes.
double MatmulFlops(const std::string& op, const std::vector<std::optional<TensorMeta>>& in) {
  auto s = [&](size_t i) -> const std::vector<int64_t>& { return in.at(i).value().sizes; };
  if (op == "aten::mm") return 2 * Prod(s(0)) * s(1)[1];
  if (op == "aten::addmm") return 2 * Prod(s(1)) * s(2)[1];
  if (op == "aten::bmm") return 2 * Prod(s(0)) * s(1)[2];
  if (op == "aten::baddbmm" || op == "aten::addbmm") return 2 * Prod(s(1)) * s(2)[2];
  if (op == "aten::mv" || op == "aten::dot" || op == "aten::vdot") return 2 * Prod(s(0));
  if (op == "aten::addmv") return 2 * Prod(s(1));
  if (op == "aten::linear") {
    const auto& w = s(1);
    return 2 * Prod(s(0)) * (w.size() == 2 ? static_cast<double>(w[0]) : 1.0);
  }
  // matmul: broadcast batch dims x M x N x K.
  std::vector<int64_t> a = s(0), b = s(1);
  if (a.size() == 1 && b.size() == 1) return 2.0 * static_cast<double>(a[0]);
  const double k = static_cast<double>(a.back());
  const double m = a.size() >= 2 ? static_cast<double>(a[a.size() - 2]) : 1.0;
  const double n = b.size() >= 2 ? static_cast<double>(b.back()) : 1.0;
  std::vector<int64_t> batch_a(a.begin(), a.end() - std::min<size_t>(a.size(), 2));
  std::vector<int64_t> batch_b(b.begin(), b.end() - std::min<size_t>(b.size(), 2));
  return 2 * Prod(at::infer_size(batch_a, batch_b)) * m * n * k;
}

struct Recorder {
  std::mutex mu;
  std::vector<MatmulCall> calls;
};
Recorder* g_recorder = nullptr;
// Depth of plain matmul-family calls on this thread: a call made inside one
// (mv -> addmv, linear -> addmm) is the same work and is not counted again.
thread_local int t_plain_matmul_depth = 0;

struct DepthMark : at::ObserverContext {};

std::unique_ptr<at::ObserverContext> OnOpStart(const at::RecordFunction& fn) {
  const std::string op = fn.name();
  if (!IsMatmulOp(op)) return nullptr;
  MatmulCall call;
  call.op = op;
  for (const c10::IValue& v : fn.inputs()) {
    if (v.isTensor() && v.toTensor().defined()) {
      const Tensor& t = v.toTensor();
      if (!IsPlain(t)) return nullptr;
      call.inputs.push_back(TensorMeta{t.sizes().vec(), t.strides().vec()});
    } else {
      call.inputs.push_back(std::nullopt);
    }
  }
  if (t_plain_matmul_depth++ == 0) {
    call.flops = MatmulFlops(op, call.inputs);
    std::lock_guard<std::mutex> lock(g_recorder->mu);
    g_recorder->calls.push_back(std::move(call));
  }
  return std::make_unique<DepthMark>();
}

void OnOpEnd(const at::RecordFunction&, at::ObserverContext* mark) {
  if (mark != nullptr) --t_plain_matmul_depth;
}

// Runs `fn` once and returns the matmul-family calls it made.
std::vector<MatmulCall> RecordMatmuls(const std::function<void()>& fn) {
  Recorder recorder;
  g_recorder = &recorder;
  at::CallbackHandle handle = at::addGlobalCallback(at::RecordFunctionCallback(OnOpStart, OnOpEnd)
                                                        .needsInputs(true)
                                                        .scopes({at::RecordScope::FUNCTION}));
  fn();
  at::removeCallback(handle);
  g_recorder = nullptr;
  return std::move(recorder.calls);
}

double TotalFlops(const std::vector<MatmulCall>& calls) {
  double total = 0;
  for (const auto& c : calls) total += c.flops;
  return total;
}

std::string ShapeString(const MatmulCall& c) {
  std::string out = c.op.substr(6) + "(";
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    if (!c.inputs[i]) continue;
    out += "[";
    for (size_t d = 0; d < c.inputs[i]->sizes.size(); ++d) {
      out += (d ? "," : "") + std::to_string(c.inputs[i]->sizes[d]);
    }
    out += "]";
  }
  return out + ")";
}

// Where the FLOPs go: calls grouped by op and input sizes, largest first.
void PrintBreakdown(const char* name, const std::vector<MatmulCall>& calls, size_t top) {
  std::map<std::string, std::pair<int64_t, double>> groups;
  for (const auto& c : calls) {
    auto& g = groups[ShapeString(c)];
    g.first += 1;
    g.second += c.flops;
  }
  std::vector<std::pair<std::string, std::pair<int64_t, double>>> sorted(groups.begin(),
                                                                         groups.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
  const double total = TotalFlops(calls);
  std::printf("  %s: %zu matmul-family calls, %zu distinct shapes; largest shares:\n", name,
              calls.size(), groups.size());
  for (size_t i = 0; i < std::min(top, sorted.size()); ++i) {
    std::printf("    %6.2f %%  %6lld x %s\n", 100 * sorted[i].second.second / total,
                static_cast<long long>(sorted[i].second.first), sorted[i].first.c_str());
  }
}

// The recorded calls as plain ATen calls on tensors of the same sizes and
// strides (one tensor per distinct size/stride, as the workload reuses its
// weights; values are random, which does not change the cost).
class Replay {
 public:
  explicit Replay(const std::vector<MatmulCall>& calls) {
    for (const auto& c : calls) {
      std::vector<Tensor> args;
      for (const auto& meta : c.inputs) args.push_back(meta ? TensorFor(*meta) : Tensor());
      steps_.emplace_back(c.op, std::move(args));
    }
  }

  void Run() const {
    for (const auto& [op, t] : steps_) {
      Tensor out;
      if (op == "aten::mm")
        out = at::mm(t[0], t[1]);
      else if (op == "aten::addmm")
        out = at::addmm(t[0], t[1], t[2]);
      else if (op == "aten::bmm")
        out = at::bmm(t[0], t[1]);
      else if (op == "aten::baddbmm")
        out = at::baddbmm(t[0], t[1], t[2]);
      else if (op == "aten::addbmm")
        out = at::addbmm(t[0], t[1], t[2]);
      else if (op == "aten::mv")
        out = at::mv(t[0], t[1]);
      else if (op == "aten::addmv")
        out = at::addmv(t[0], t[1], t[2]);
      else if (op == "aten::dot")
        out = at::dot(t[0], t[1]);
      else if (op == "aten::vdot")
        out = at::vdot(t[0], t[1]);
      else if (op == "aten::matmul")
        out = at::matmul(t[0], t[1]);
      else
        out = at::linear(t[0], t[1], t.size() > 2 ? t[2] : Tensor());
      benchmark::DoNotOptimize(out);
    }
  }

 private:
  Tensor TensorFor(const TensorMeta& meta) {
    auto it = cache_.find(meta);
    if (it != cache_.end()) return it->second;
    int64_t storage = 1;
    for (size_t d = 0; d < meta.sizes.size(); ++d) {
      if (meta.sizes[d] == 0) storage = 0;
      if (storage > 0) storage += (meta.sizes[d] - 1) * meta.strides[d];
    }
    // as_strided on a random base reproduces any layout, including the
    // stride-0 (expanded) inputs vmap produces.
    Tensor t = torch::randn({storage}).as_strided(meta.sizes, meta.strides);
    cache_.emplace(meta, t);
    return t;
  }

  std::map<TensorMeta, Tensor> cache_;
  std::vector<std::pair<std::string, std::vector<Tensor>>> steps_;
};

// --- benchmarks -----------------------------------------------------------------

void SetFlops(benchmark::State& state, double flops) {
  state.counters["FLOP/s"] =
      benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(benchmarks::ThreadsLabel());
}

void BM_Case(benchmark::State& state, std::function<Tensor(const Tensor&)> fn, double flops) {
  const Tensor& xs = GetCases().xs;
  for (auto _ : state) {
    Tensor h = fn(xs);
    benchmark::DoNotOptimize(h.data_ptr());
  }
  SetFlops(state, flops);
}

void BM_Replay(benchmark::State& state, std::shared_ptr<Replay> replay, double flops) {
  for (auto _ : state) replay->Run();
  SetFlops(state, flops);
}

void BM_Sgemm(benchmark::State& state, int64_t m, int64_t k, int64_t n) {
  const Tensor a = torch::randn({m, k});
  const Tensor b = torch::randn({k, n});
  Tensor c = torch::empty({m, n});
  for (auto _ : state) {
    torch::mm_out(c, a, b);
    benchmark::DoNotOptimize(c.data_ptr());
  }
  SetFlops(state, 2.0 * static_cast<double>(m * k * n));
}

std::string SgemmName(int64_t m, int64_t k, int64_t n) {
  return "BM_Sgemm/" + std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n);
}

// The mm/addmm shape (M, K, N) carrying the most FLOPs of `calls`.
std::tuple<int64_t, int64_t, int64_t> DominantGemm(const std::vector<MatmulCall>& calls) {
  std::map<std::tuple<int64_t, int64_t, int64_t>, double> by_shape;
  for (const auto& c : calls) {
    const size_t a = c.op == "aten::mm" ? 0 : c.op == "aten::addmm" ? 1 : 99;
    if (a == 99) continue;
    const auto& x = c.inputs.at(a)->sizes;
    const auto& y = c.inputs.at(a + 1)->sizes;
    by_shape[{x[0], x[1], y[1]}] += c.flops;
  }
  std::tuple<int64_t, int64_t, int64_t> best{kPoints, kHidden, kHidden};
  double most = 0;
  for (const auto& [shape, flops] : by_shape) {
    if (flops > most) std::tie(best, most) = std::tie(shape, flops);
  }
  return best;
}

const char* const kBatched = "BM_Hessian_VmapJacfwdJacrev";
const char* const kBatchedHessian = "BM_Hessian_VmapHessian";
const char* const kLoop = "BM_Hessian_PerPointLoop";
std::string g_dominant_sgemm;

void PrintSummary(const benchmarks::Results& r) {
  auto gflops = [&](const std::string& name) {
    auto it = r.find(name);
    return it == r.end() ? 0.0 : it->second.counters.at("FLOP/s") / 1e9;
  };
  auto ms = [&](const std::string& name) {
    auto it = r.find(name);
    return it == r.end() ? 0.0 : it->second.real_s * 1e3;
  };
  std::printf("== Hessians of the 2->512->512->512->3 tanh MLP at %lld points (medians; %s)\n",
              static_cast<long long>(kPoints), benchmarks::ThreadsLabel().c_str());
  const std::string sgemm = SgemmName(kPoints, kHidden, kHidden);
  for (const std::string name : {kBatched, kBatchedHessian, kLoop}) {
    if (ms(name) == 0) continue;
    std::printf("%-30s %9.2f ms  %6.1f GFLOP/s", name.c_str(), ms(name), gflops(name));
    if (gflops(sgemm) > 0)
      std::printf("  = %.3f of sgemm 1024x512x512", gflops(name) / gflops(sgemm));
    const std::string replay = "BM_MatmulReplay/" + name.substr(3);
    if (ms(replay) > 0) {
      std::printf("; its matmuls alone %.2f ms (%.0f %% of its time)", ms(replay),
                  100 * ms(replay) / ms(name));
    }
    std::printf("\n");
  }
  if (gflops(sgemm) > 0) std::printf("%-30s %6.1f GFLOP/s\n", sgemm.c_str(), gflops(sgemm));
  if (!g_dominant_sgemm.empty() && gflops(g_dominant_sgemm) > 0) {
    std::printf("%-30s %6.1f GFLOP/s (the batched case's largest FLOP share)\n",
                g_dominant_sgemm.c_str(), gflops(g_dominant_sgemm));
  }
  if (ms(kBatched) > 0 && ms(kLoop) > 0) {
    std::printf("vmap(jacfwd(jacrev)) vs per-point loop: %.1fx faster\n", ms(kLoop) / ms(kBatched));
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmarks::UseAllCores("hessian_bench");
  Cases& cases = GetCases();
  std::printf("hessian_bench: %s\n", benchmarks::ThreadsLabel().c_str());

  // One recorded run of each case: the FLOP counts, the replays, and the
  // check that all three compute the same Hessians.
  Tensor h_batched, h_hessian, h_loop;
  auto batched_calls = RecordMatmuls([&] { h_batched = cases.vmap_jacfwd_jacrev(cases.xs); });
  auto hessian_calls = RecordMatmuls([&] { h_hessian = cases.vmap_hessian(cases.xs); });
  auto loop_calls = RecordMatmuls([&] { h_loop = cases.per_point_loop(cases.xs); });
  const std::vector<int64_t> expected{kPoints, kOut, kIn, kIn};
  if (h_batched.sizes().vec() != expected || !torch::allclose(h_batched, h_hessian) ||
      !torch::allclose(h_batched, h_loop, /*rtol=*/1e-4, /*atol=*/1e-5)) {
    std::fprintf(stderr, "hessian_bench: the three cases disagree (max |batched - loop| %g)\n",
                 (h_batched - h_loop).abs().max().item<double>());
    return 1;
  }
  const double analytic = AnalyticFlops(kPoints);
  std::printf(
      "results agree (max |batched - loop| = %.3g); FLOPs per call, analytic 12 C x "
      "%lld points = %.4g\n",
      (h_batched - h_loop).abs().max().item<double>(), static_cast<long long>(kPoints), analytic);
  for (const auto& [name, calls] :
       {std::make_pair(kBatched, &batched_calls), std::make_pair(kBatchedHessian, &hessian_calls),
        std::make_pair(kLoop, &loop_calls)}) {
    std::printf("  %-28s observed matmul calls %.4g (%.3f x analytic; see the header comment)\n",
                name, TotalFlops(*calls), TotalFlops(*calls) / analytic);
  }
  PrintBreakdown(kBatched, batched_calls, 8);
  PrintBreakdown(kLoop, loop_calls, 5);
  std::fflush(stdout);

  auto reg = [](const std::string& name, auto fn, auto... args) {
    return benchmark::RegisterBenchmark(name.c_str(), fn, args...)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  };
  reg(kBatched, BM_Case, cases.vmap_jacfwd_jacrev, analytic);
  reg(kBatchedHessian, BM_Case, cases.vmap_hessian, analytic);
  reg(kLoop, BM_Case, cases.per_point_loop, analytic);
  reg(std::string("BM_MatmulReplay/") + (kBatched + 3), BM_Replay,
      std::make_shared<Replay>(batched_calls), TotalFlops(batched_calls));
  reg(std::string("BM_MatmulReplay/") + (kLoop + 3), BM_Replay,
      std::make_shared<Replay>(loop_calls), TotalFlops(loop_calls));
  reg(SgemmName(kPoints, kHidden, kHidden), BM_Sgemm, kPoints, kHidden, kHidden);
  const auto [m, k, n] = DominantGemm(batched_calls);
  if (SgemmName(m, k, n) != SgemmName(kPoints, kHidden, kHidden)) {
    g_dominant_sgemm = SgemmName(m, k, n);
    reg(g_dominant_sgemm, BM_Sgemm, m, k, n);
  }

  benchmarks::SummaryReporter reporter(PrintSummary);
  return benchmarks::RunWithSummary(argc, argv, reporter);
}
