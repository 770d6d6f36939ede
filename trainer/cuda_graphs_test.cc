// --cuda-graphs without a GPU: the decision (CudaGraphBlockers,
// PlanCudaGraphs) for representative
// configurations, each reason's words; the host side of the captured
// optimizer update (SetStepLearningRate, WriteFoundInf against
// CheckStepFinite, RecordGraphedOptimizerStep's step counts through warm-up,
// capture and replays with non-finite steps) on a capturable optimizer on
// the CPU; and the trainer binary under auto (eager, "not CUDA" printed
// once, the losses of --cuda-graphs=off bit for bit) and on (refused before
// training, exit 2, naming the flag and the reason). The capture itself
// needs a GPU: trainer/trainer_gpu_check.cc.
#include "trainer/cuda_graphs.h"

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <torch/optim/adamw.h>
#include <torch/types.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "optim/optimizers.h"
#include "state_dict/optim_state.h"
#include "trainer/finite_state.h"
#include "trainer/options.h"
#include "trainer/testing/run_trainer.h"

namespace trainer {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

TEST(CudaGraphsOptionTest, ParsesAutoOnOffAndRoundTrips) {
  auto defaults = ParseOptions({});
  ASSERT_TRUE(defaults.ok());
  EXPECT_EQ(defaults->cuda_graphs, CudaGraphs::kAuto);
  for (const auto& [value, mode] : std::vector<std::pair<std::string, CudaGraphs>>{
           {"auto", CudaGraphs::kAuto}, {"on", CudaGraphs::kOn}, {"off", CudaGraphs::kOff}}) {
    auto o = ParseOptions({"--cuda-graphs=" + value});
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->cuda_graphs, mode);
    EXPECT_EQ(Name(o->cuda_graphs), value);
    // The ranks re-parse ToArgs: they get the same mode.
    auto again = ParseOptions(ToArgs(*o));
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->cuda_graphs, mode);
  }
  EXPECT_EQ(ParseOptions({"--cuda-graphs", "yes"}).status().message(),
            "--cuda-graphs='yes': expected one of auto|on|off");
}

// A CUDA build on a GPU with the trainer's NCCL backend, 100 steps: the
// environment in which only the flags can prevent the capture.
CaptureEnvironment Gpu() {
  CaptureEnvironment env;
  env.built_with_cuda = true;
  env.on_cuda = true;
  env.backend = "cpu:gloo,cuda:nccl";
  env.steps_to_train = 100;
  return env;
}

Options CudaOptions() {
  Options o;
  o.device = Device::kCuda;
  return o;
}

TEST(CudaGraphBlockersTest, TheDefaultsOnAGpuCanBeCaptured) {
  EXPECT_THAT(CudaGraphBlockers(CudaOptions(), Gpu()), IsEmpty());
  // What the decision allows by design: the FSDP variants, bf16, float8,
  // activation checkpointing, several micro-batches (a fixed sequence of
  // no_sync forwards and backwards), the other optimizers, the LR schedule
  // (written to the device before each replay), checkpoints written
  // synchronously, the JSON log.
  Options o = CudaOptions();
  o.fsdp = FsdpApi::kFullyShard;
  o.mixed_precision = MixedPrecision::kBf16;
  o.float8 = true;
  o.activation_checkpointing = ActivationCheckpointing::kBlock;
  o.grad_accum = 4;
  o.optimizer = OptimizerKind::kSgd;
  o.checkpoint_dir = "/tmp/x";
  o.checkpoint_every = 10;
  o.log_json = "/tmp/x.jsonl";
  EXPECT_THAT(CudaGraphBlockers(o, Gpu()), IsEmpty());
  // A world of 1 on NCCL alone, too.
  CaptureEnvironment nccl = Gpu();
  nccl.backend = "nccl";
  EXPECT_THAT(CudaGraphBlockers(CudaOptions(), nccl), IsEmpty());
}

TEST(CudaGraphBlockersTest, NotCudaIsTheOneReasonOfTheCpuDefaults) {
  CaptureEnvironment cpu;
  cpu.built_with_cuda = false;
  cpu.on_cuda = false;
  cpu.backend = "gloo";
  cpu.steps_to_train = 450;
  EXPECT_THAT(CudaGraphBlockers(Options(), cpu),
              ElementsAre("not CUDA (--device=cpu): a CUDA graph holds CUDA work only"));
}

TEST(CudaGraphBlockersTest, EachFeatureThatCannotBeCapturedIsNamed) {
  struct Case {
    const char* flag;
    void (*set)(Options&);
  };
  const std::vector<Case> cases = {
      {"--cpu-offload", [](Options& o) { o.cpu_offload = true; }},
      {"--async-checkpoint",
       [](Options& o) {
         o.checkpoint_dir = "/tmp/x";
         o.async_checkpoint = true;
       }},
      {"--eval-every", [](Options& o) { o.eval_every = 10; }},
      {"--profile-step",
       [](Options& o) {
         o.profile_step = 5;
         o.profile_trace = "/tmp/t.json";
       }},
  };
  for (const Case& c : cases) {
    Options o = CudaOptions();
    c.set(o);
    const std::vector<std::string> why = CudaGraphBlockers(o, Gpu());
    ASSERT_EQ(why.size(), 1u) << c.flag;
    EXPECT_THAT(why[0], HasSubstr(std::string(c.flag) + ":")) << c.flag;
  }
}

TEST(CudaGraphBlockersTest, TheEnvironmentsReasons) {
  CaptureEnvironment gloo = Gpu();
  gloo.backend = "gloo";  // CUDA tensors over Gloo (fsdp's 2-ranks-on-one-GPU checks)
  EXPECT_THAT(CudaGraphBlockers(CudaOptions(), gloo),
              ElementsAre(HasSubstr("backend 'gloo' does not run CUDA collectives on NCCL")));
  CaptureEnvironment unbuilt = Gpu();
  unbuilt.built_with_cuda = false;
  EXPECT_THAT(CudaGraphBlockers(CudaOptions(), unbuilt),
              ElementsAre(HasSubstr("built without the capture (TORCHFSDP_CUDA undefined)")));
  CaptureEnvironment short_run = Gpu();
  short_run.steps_to_train = kCudaGraphWarmupSteps;
  Options o = CudaOptions();
  o.steps = 3;
  EXPECT_THAT(CudaGraphBlockers(o, short_run),
              ElementsAre("this run trains 3 steps (--steps=3): the capture follows 3 eager "
                          "warm-up steps, leaving nothing to replay"));
}

TEST(CudaGraphBlockersTest, EveryReasonIsListedNotJustTheFirst) {
  Options o = CudaOptions();
  o.cpu_offload = true;
  o.clip = 1.0;  // captured too: not a reason
  o.eval_every = 5;
  CaptureEnvironment gloo = Gpu();
  gloo.backend = "gloo";
  EXPECT_THAT(CudaGraphBlockers(o, gloo),
              ElementsAre(HasSubstr("backend 'gloo'"), HasSubstr("--cpu-offload:"),
                          HasSubstr("--eval-every:")));
}

TEST(PlanCudaGraphsTest, OffAutoAndOn) {
  Options o = CudaOptions();
  o.cuda_graphs = CudaGraphs::kOff;
  auto off = PlanCudaGraphs(o, Gpu());
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE(off->capture);
  EXPECT_THAT(off->reasons, IsEmpty());
  EXPECT_EQ(DescribeCudaGraphPlan(o, *off), "");

  for (CudaGraphs mode : {CudaGraphs::kAuto, CudaGraphs::kOn}) {
    o.cuda_graphs = mode;
    auto plan = PlanCudaGraphs(o, Gpu());
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(plan->capture);
    EXPECT_EQ(DescribeCudaGraphPlan(o, *plan),
              "cuda graphs: the step (forward, backward, its loss reduction, the optimizer "
              "update) is captured after 3 eager steps and replayed; the learning rate is "
              "written to the device before each replay");
    // --clip: the clipping is captured with the rest (its all-reduce is
    // ordered on the stream), and the line says so.
    Options clipped = o;
    clipped.clip = 1.0;
    auto with_clip = PlanCudaGraphs(clipped, Gpu());
    ASSERT_TRUE(with_clip.ok()) << with_clip.status();
    EXPECT_TRUE(with_clip->capture);
    EXPECT_THAT(with_clip->reasons, IsEmpty());
    EXPECT_EQ(DescribeCudaGraphPlan(clipped, *with_clip),
              "cuda graphs: the step (forward, backward, its loss reduction, the clipping, the "
              "optimizer update) is captured after 3 eager steps and replayed; the learning rate "
              "is written to the device before each replay");
  }

  o.eval_every = 10;
  o.cpu_offload = true;
  o.cuda_graphs = CudaGraphs::kAuto;
  auto fallback = PlanCudaGraphs(o, Gpu());
  ASSERT_TRUE(fallback.ok());
  EXPECT_FALSE(fallback->capture);
  EXPECT_EQ(fallback->reasons.size(), 2u);
  EXPECT_THAT(DescribeCudaGraphPlan(o, *fallback),
              AllOf(HasSubstr("cuda graphs: eager step (--cuda-graphs=auto): --cpu-offload:"),
                    HasSubstr("; --eval-every:")));

  o.cuda_graphs = CudaGraphs::kOn;
  auto refused = PlanCudaGraphs(o, Gpu());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              AllOf(HasSubstr("--cuda-graphs=on: the step cannot be captured: --cpu-offload:"),
                    HasSubstr("; --eval-every: the evaluation's eager forward"),
                    HasSubstr("(--cuda-graphs=auto runs eagerly instead)")));
}

// ---- the host side of a captured optimizer update, on the CPU ------------

std::vector<torch::Tensor> TwoParams() {
  torch::manual_seed(7);
  return {torch::randn({4, 3}).requires_grad_(true), torch::randn({5}).requires_grad_(true)};
}

std::vector<torch::optim::OptimizerParamGroup> TwoGroups(const std::vector<torch::Tensor>& p) {
  return {
      torch::optim::OptimizerParamGroup(
          {p[0]}, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(1.0))),
      torch::optim::OptimizerParamGroup(
          {p[1]}, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(2.0)))};
}

TEST(SetStepLearningRateTest, EveryGroupAndTheDeviceLrOfACapturableOptimizer) {
  auto p = TwoParams();
  optim::AdamW ordinary(TwoGroups(p), {}, optim::Implementation::kFused);
  SetStepLearningRate(ordinary, 0.1);
  for (const auto& group : ordinary.param_groups()) EXPECT_EQ(group.options().get_lr(), 0.1);
  EXPECT_FALSE(ordinary.lr_tensor(0).defined());

  optim::AdamW capturable(TwoGroups(p), {}, optim::Implementation::kFused, false, true);
  for (double lr : {0.1, 3e-4, 0.0}) {
    SetStepLearningRate(capturable, lr);
    for (size_t g = 0; g < 2; ++g) {
      EXPECT_EQ(capturable.param_groups()[g].options().get_lr(), lr);
      EXPECT_EQ(capturable.lr_tensor(g).item<float>(), static_cast<float>(lr)) << g;
    }
  }
}

TEST(WriteFoundInfTest, OneExactlyWhenTheHostCheckRefusesTheStep) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    double loss, flag;
  };
  torch::Tensor found_inf = torch::full({}, 7.0);  // overwritten every time
  for (const Case& c : std::vector<Case>{{2.5, 0},
                                         {nan, 0},
                                         {inf, 0},
                                         {-inf, 0},
                                         {2.5, 1},
                                         {2.5, 0.5},  // one rank of two
                                         {nan, 1},
                                         {1e300, 0}}) {
    const torch::Tensor figures = torch::tensor({c.loss, c.flag}, torch::kFloat64);
    WriteFoundInf(figures, found_inf);
    const bool refused = !CheckStepFinite(1, c.loss, -1, c.flag == 0.0).ok();
    EXPECT_EQ(found_inf.item<float>(), refused ? 1.0f : 0.0f) << c.loss << " " << c.flag;
  }
  // With --clip the global gradient norm is the third figure.
  for (double norm : {0.5, 1e30, nan, inf}) {
    WriteFoundInf(torch::tensor({2.5, 0.0, norm}, torch::kFloat64), found_inf);
    const bool refused = !CheckStepFinite(1, 2.5, norm, true).ok();
    EXPECT_EQ(found_inf.item<float>(), refused ? 1.0f : 0.0f) << "norm " << norm;
  }
  torch::Tensor shaped = torch::zeros({1});  // GradScaler's shape
  WriteFoundInf(torch::tensor({nan, 0.0}, torch::kFloat64), shaped);
  EXPECT_EQ(shaped.item<float>(), 1.0f);
}

int64_t HostStep(const torch::optim::Optimizer& opt, const torch::Tensor& p) {
  return static_cast<const torch::optim::AdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()))
      .step();
}

// The trainer's order for a graphed run whose update is captured (train.cc's
// GraphedTrainStep), on a capturable AdamW on the CPU: every step
// SetStepLearningRate, then the update (step() for the warm-up and the
// capture; a replay runs no host code, so none here), then, once the host
// knows whether the step was finite, RecordGraphedOptimizerStep. The host
// counts must be the number of finite steps, whatever the phase of the
// non-finite ones (the first warm-up step among them: its state is
// removed), and the captured step must be replayable.
TEST(RecordGraphedOptimizerStepTest, TheHostCountsAreTheFiniteSteps) {
  auto p = TwoParams();
  optim::AdamW opt(TwoGroups(p), {}, optim::Implementation::kFused, false, true);
  torch::Tensor found_inf = torch::zeros({});
  opt.set_found_inf(found_inf);
  struct Step {
    GraphedPhase phase;
    bool finite;
  };
  const std::vector<Step> steps = {{GraphedPhase::kWarmup, false}, {GraphedPhase::kWarmup, true},
                                   {GraphedPhase::kWarmup, true},  {GraphedPhase::kCapture, true},
                                   {GraphedPhase::kReplay, true},  {GraphedPhase::kReplay, false},
                                   {GraphedPhase::kReplay, true},  {GraphedPhase::kReplay, true}};
  int64_t finite_steps = 0;
  for (size_t s = 0; s < steps.size(); ++s) {
    SetStepLearningRate(opt, 1e-3 * static_cast<double>(s + 1));
    found_inf.fill_(steps[s].finite ? 0.0 : 1.0);
    if (steps[s].phase != GraphedPhase::kReplay) {
      for (auto& t : p) {
        t.mutable_grad() = steps[s].finite ? torch::ones_like(t) : torch::full_like(t, NAN);
      }
      opt.step();
    }
    if (steps[s].phase == GraphedPhase::kCapture) EXPECT_TRUE(opt.last_step_replayable());
    RecordGraphedOptimizerStep(opt, steps[s].phase, steps[s].finite);
    if (steps[s].finite) ++finite_steps;
    if (s == 0) {
      EXPECT_TRUE(opt.state().empty()) << "the skipped first step left no state";
      continue;
    }
    for (const auto& t : p) EXPECT_EQ(HostStep(opt, t), finite_steps) << "step " << s;
  }
  EXPECT_EQ(finite_steps, 6);
  // What a checkpoint saves.
  auto exported = state_dict::ExportOptimizerState(opt);
  ASSERT_TRUE(exported.ok()) << exported.status();
  for (auto& [key, entries] : exported->state) {
    EXPECT_EQ(entries["step"].item<int64_t>(), 6);
  }
}

TEST(StepGraphTest, WithoutCudaItRefusesToBeMade) {
  if (CudaGraphsBuilt()) GTEST_SKIP() << "a CUDA build: StepGraph needs a GPU, not here";
  EXPECT_THROW(StepGraph(c10::Device(c10::kCPU)), c10::Error);
}

// The binary: auto on the CPU trains eagerly, says why once, and gives
// the losses of off bit for bit; on is refused before any rank starts.
const char kSmall[] =
    "--layers=1 --dim=32 --heads=2 --seq=32 --global-batch=8 --steps=5 --warmup-steps=2 "
    "--seed=3";

int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(CudaGraphsTrainerTest, AutoOnTheCpuIsEagerSaysWhyOnceAndMatchesOff) {
  const std::string dir = testing::TempDir("auto");
  const testing::RunResult automatic =
      testing::RunTrainer(std::string(kSmall) + " --log-json=" + dir + "/auto.jsonl");
  ASSERT_EQ(automatic.exit_code, 0) << automatic.output;
  EXPECT_EQ(Count(automatic.output,
                  "cuda graphs: eager step (--cuda-graphs=auto): not CUDA "
                  "(--device=cpu)"),
            1)
      << automatic.output;
  const testing::RunResult off = testing::RunTrainer(std::string(kSmall) + " --cuda-graphs=off" +
                                                     " --log-json=" + dir + "/off.jsonl");
  ASSERT_EQ(off.exit_code, 0) << off.output;
  EXPECT_THAT(off.output, Not(HasSubstr("cuda graphs")));
  const testing::StepLog a = testing::ReadLog(dir + "/auto.jsonl", 2);
  const testing::StepLog b = testing::ReadLog(dir + "/off.jsonl", 2);
  ASSERT_EQ(a.losses.size(), 5u);
  EXPECT_EQ(a.losses, b.losses);
}

TEST(CudaGraphsTrainerTest, OnIsRefusedBeforeTrainingNamingEveryReason) {
  const testing::RunResult r =
      testing::RunTrainer(std::string(kSmall) + " --cuda-graphs=on --cpu-offload --nproc=1");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output,
              AllOf(HasSubstr("--cuda-graphs=on: the step cannot be captured: not CUDA "
                              "(--device=cpu): a CUDA graph holds CUDA work only; --cpu-offload: "),
                    Not(HasSubstr("step 1"))));
}

TEST(CudaGraphsTrainerTest, ABadValueNamesTheFlagAndTheChoices) {
  const testing::RunResult r = testing::RunTrainer("--cuda-graphs=maybe");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output,
              AllOf(HasSubstr("--cuda-graphs"), HasSubstr("maybe"), HasSubstr("auto|on|off")));
}

}  // namespace
}  // namespace trainer
