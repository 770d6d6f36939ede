// op_count_bench: how many ATen operators one training step dispatches, on
// the trainer's FSDP state, counted with RecordFunction (issue 36's CPU goal:
// no more than Python FSDP2 on the same model, which
// benchmarks/python/op_count.py counts with torch.profiler).
//
//   bazel run -c opt //benchmarks:op_count_bench -- [--fsdp=fsdp1|fully_shard] [--list[=PHASE]]
//
// The model is trainer_bench's (TransformerLM: 8 blocks x 512, 8 heads,
// vocab 256, seq 32, 2 rows), wrapped by the trainer's own trainer::Wrap
// (wrap.h) at its defaults on a Gloo world of 1: --fsdp=fsdp1 (the
// default: fsdp::FullyShardedDataParallel FULL_SHARD, one unit per block
// plus the root, backward prefetch pre, use_orig_params) or
// --fsdp=fully_shard (fsdp::fully_shard on each block, then the root: the
// port of Python's FSDP2), with the trainer's optimizer (optim::AdamW,
// fused). One step is what Python's
// peer does per step (benchmarks/python/fsdp_step.py): zero_grad (the
// trainer's: optim::zero_grad, Python's set_to_none), forward
// and loss, backward (FSDP's gradient reduction inside), loss.item(), the
// optimizer step. 3 warm-up steps, then 3 counted ones (the counts of
// each are printed; they are equal when nothing is lazily set up).
//
// A global RecordFunction callback (at::addGlobalCallback, scope FUNCTION:
// the dispatcher's operator calls, what the profiler records as "aten::...")
// counts, per step:
//   aten_ops      every aten:: operator call, nested ones included (an
//                 aten::linear and the aten::t / aten::addmm it calls are 3)
//   top_level     aten:: calls not inside another aten:: call on the same
//                 thread (what the framework itself dispatches)
//   other_ops     non-aten operators (c10d::, profiler::, ...)
// and, with --list, the 40 most frequent aten:: names (--list=PHASE: those
// of one phase: zero_grad, forward, backward, item, optimizer).
//
// The counts do not depend on the sizes (no data-dependent loops), only on
// the model's structure, FSDP's units and the optimizer.
#include <ATen/record_function.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>
#include <torch/utils.h>
#include <torch/version.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/process_group.h"
#include "optim/optimizers.h"
#include "trainer/models.h"
#include "trainer/options.h"
#include "trainer/wrap.h"

namespace {

trainer::ModelConfig g_config{/*layers=*/8, /*dim=*/512, /*heads=*/8, /*vocab=*/256,
                              /*seq=*/32};
// --tiny: the same structure (blocks, units, parameters per unit) with
// negligible compute, so that a step's time is host time: what
// run_host_overhead.sh measures per FSDP unit.
const trainer::ModelConfig kTinyConfig{/*layers=*/8, /*dim=*/16, /*heads=*/2, /*vocab=*/32,
                                       /*seq=*/8};
constexpr int64_t kRows = 2;
constexpr int kWarmupSteps = 3;
constexpr int kCountedSteps = 3;
// Timed after the counted steps, with the RecordFunction callback removed.
constexpr int kTimedSteps = 50;
// --fsdp=none: the model unwrapped (the baseline FSDP's overhead is
// measured against).
bool g_unwrapped = false;

struct Counts {
  std::atomic<int64_t> aten{0};
  std::atomic<int64_t> top_level{0};
  std::atomic<int64_t> other{0};
  std::mutex mu;
  std::map<std::string, int64_t> by_name;
};

Counts* g_counts = nullptr;
std::atomic<bool> g_counting{false};
bool g_list = false;
trainer::FsdpApi g_fsdp = trainer::FsdpApi::kFsdp1;
// --list=PHASE: list only that phase's operators (zero_grad, forward,
// backward, item, optimizer).
std::string g_list_phase;
std::string g_phase;
thread_local int t_aten_depth = 0;

std::unique_ptr<at::ObserverContext> OnEnter(const at::RecordFunction& fn) {
  if (!g_counting.load(std::memory_order_relaxed)) return nullptr;
  const char* name = fn.name();
  const bool aten = std::strncmp(name, "aten::", 6) == 0;
  if (aten) {
    g_counts->aten.fetch_add(1, std::memory_order_relaxed);
    if (t_aten_depth == 0) g_counts->top_level.fetch_add(1, std::memory_order_relaxed);
    ++t_aten_depth;
    if (g_list && (g_list_phase.empty() || g_list_phase == g_phase)) {
      std::lock_guard<std::mutex> lock(g_counts->mu);
      ++g_counts->by_name[name];
    }
  } else {
    g_counts->other.fetch_add(1, std::memory_order_relaxed);
  }
  return nullptr;
}

void OnExit(const at::RecordFunction& fn, at::ObserverContext* /*ctx*/) {
  if (!g_counting.load(std::memory_order_relaxed)) return;
  if (std::strncmp(fn.name(), "aten::", 6) == 0 && t_aten_depth > 0) --t_aten_depth;
}

std::string MakeStoreDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ =
      absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/op_count_XXXXXX");
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  TORCH_CHECK(mkdtemp(buf.data()) != nullptr, "op_count_bench: mkdtemp('", templ,
              "') failed: ", std::strerror(errno));
  return buf.data();
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--list") {
      g_list = true;
    } else if (std::string(argv[i]) == "--fsdp=fully_shard") {
      g_fsdp = trainer::FsdpApi::kFullyShard;
    } else if (std::string(argv[i]) == "--fsdp=fsdp1") {
      g_fsdp = trainer::FsdpApi::kFsdp1;
    } else if (std::string(argv[i]) == "--fsdp=none") {
      g_unwrapped = true;
    } else if (std::string(argv[i]) == "--tiny") {
      g_config = kTinyConfig;
    } else if (absl::StartsWith(argv[i], "--list=")) {
      g_list = true;
      g_list_phase = std::string(argv[i]).substr(7);
    } else {
      std::fprintf(stderr,
                   "op_count_bench: unknown argument '%s' (usage: op_count_bench "
                   "[--fsdp=fsdp1|fully_shard|none] [--tiny] [--list[=PHASE]])\n",
                   argv[i]);
      return 2;
    }
  }
  const std::string dir = MakeStoreDir();
  int status = 0;
  {
    comm::InitOptions init;
    init.backend = "gloo";
    init.init_method = "file://" + dir + "/store";
    init.rank = 0;
    init.world_size = 1;
    auto group = comm::init_process_group(init);
    if (!group.ok()) {
      std::fprintf(stderr, "op_count_bench: %s\n", std::string(group.status().message()).c_str());
      return 1;
    }
    trainer::Options o;
    o.model = trainer::ModelKind::kTransformer;
    o.layers = g_config.layers;
    o.dim = g_config.dim;
    o.heads = g_config.heads;
    o.vocab = g_config.vocab;
    o.seq = g_config.seq;
    o.global_batch = kRows;
    o.fsdp = g_fsdp;
    std::shared_ptr<trainer::LanguageModel> model =
        trainer::BuildModel(trainer::ModelType::kTransformer, g_config, /*seed=*/0);
    int64_t num_params = 0;
    for (const auto& p : model->parameters()) num_params += p.numel();
    // The trainer's own wrapping (wrap.h) for its defaults: FULL_SHARD, one
    // unit per block plus the root, backward prefetch pre, use_orig_params.
    trainer::WrappedModel wrapped;
    if (!g_unwrapped) {
      auto made = trainer::Wrap(o, model, c10::Device(c10::kCPU), *group);
      if (!made.ok()) {
        std::fprintf(stderr, "op_count_bench: %s\n", std::string(made.status().message()).c_str());
        return 1;
      }
      wrapped = std::move(*made);
    }
    const std::vector<torch::Tensor> params =
        g_unwrapped ? model->parameters() : wrapped.model().parameters();
    const size_t units = g_unwrapped ? 0 : wrapped.model().fsdp_unit_names().size();
    optim::AdamW optimizer(params, torch::optim::AdamWOptions(3e-3).weight_decay(0.01),
                           optim::Implementation::kFused);
    torch::manual_seed(1000);
    const torch::Tensor batch =
        torch::randint(g_config.vocab, {kRows, g_config.seq + 1}, torch::kInt64);
    auto forward = [&] {
      return g_unwrapped ? model->Loss(batch)
                         : wrapped.model().run([&] { return model->Loss(batch); });
    };

    Counts counts;
    g_counts = &counts;
    at::addGlobalCallback(
        at::RecordFunctionCallback(OnEnter, OnExit).scopes({at::RecordScope::FUNCTION}));
    std::printf(
        "op_count_bench: LibTorch %s, TransformerLM %lld parameters (%lld blocks x %lld, %lld "
        "heads, vocab %lld, seq %lld, %lld rows), --fsdp %s FULL_SHARD %zu units on a Gloo world "
        "of 1, optim::AdamW (fused)\n",
        TORCH_VERSION, static_cast<long long>(num_params), static_cast<long long>(g_config.layers),
        static_cast<long long>(g_config.dim), static_cast<long long>(g_config.heads),
        static_cast<long long>(g_config.vocab), static_cast<long long>(g_config.seq),
        static_cast<long long>(kRows), g_unwrapped ? "none" : trainer::Name(g_fsdp), units);
    std::vector<int64_t> aten_per_step, top_per_step;
    for (int step = 1; step <= kWarmupSteps + kCountedSteps; ++step) {
      const bool counted = step > kWarmupSteps;
      counts.aten = 0;
      counts.top_level = 0;
      counts.other = 0;
      g_counting.store(counted);
      // Each phase's aten:: count, as differences of the running total.
      std::vector<int64_t> marks = {counts.aten.load()};
      g_phase = "zero_grad";
      optim::zero_grad(optimizer);  // as the trainer
      marks.push_back(counts.aten.load());
      g_phase = "forward";
      torch::Tensor loss = forward();
      marks.push_back(counts.aten.load());
      g_phase = "backward";
      loss.backward();
      marks.push_back(counts.aten.load());
      g_phase = "item";
      const double value = loss.item<double>();
      marks.push_back(counts.aten.load());
      g_phase = "optimizer";
      optimizer.step();
      marks.push_back(counts.aten.load());
      g_counting.store(false);
      if (!counted) continue;
      std::printf(
          "step %d phases (aten_ops): zero_grad %lld, forward %lld, backward %lld, item %lld, "
          "optimizer %lld\n",
          step, static_cast<long long>(marks[1] - marks[0]),
          static_cast<long long>(marks[2] - marks[1]), static_cast<long long>(marks[3] - marks[2]),
          static_cast<long long>(marks[4] - marks[3]), static_cast<long long>(marks[5] - marks[4]));
      aten_per_step.push_back(counts.aten.load());
      top_per_step.push_back(counts.top_level.load());
      std::printf("step %d: aten_ops %lld, top_level %lld, other_ops %lld (loss %.4f)\n", step,
                  static_cast<long long>(counts.aten.load()),
                  static_cast<long long>(counts.top_level.load()),
                  static_cast<long long>(counts.other.load()), value);
    }
    // Host time: the callback is gone (an active RecordFunction callback
    // slows every operator down), then kTimedSteps steps one by one; the
    // median step, in microseconds.
    at::clearCallbacks();
    std::vector<double> step_us;
    for (int step = 0; step < kTimedSteps; ++step) {
      const auto start = std::chrono::steady_clock::now();
      optim::zero_grad(optimizer);
      torch::Tensor loss = forward();
      loss.backward();
      loss.item<double>();
      optimizer.step();
      step_us.push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
              .count());
    }
    std::sort(step_us.begin(), step_us.end());
    std::printf(
        "RESULT aten_ops_per_step %lld top_level_per_step %lld host_us_per_step %.1f units %zu\n",
        static_cast<long long>(aten_per_step.back()), static_cast<long long>(top_per_step.back()),
        step_us[step_us.size() / 2], units);
    if (g_list) {
      std::vector<std::pair<int64_t, std::string>> sorted;
      for (const auto& [name, n] : counts.by_name) sorted.emplace_back(n, name);
      std::sort(sorted.rbegin(), sorted.rend());
      for (size_t i = 0; i < sorted.size() && i < 40; ++i) {
        std::printf("  %6lld  %s\n", static_cast<long long>(sorted[i].first / kCountedSteps),
                    sorted[i].second.c_str());
      }
    }
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  return status;
}
