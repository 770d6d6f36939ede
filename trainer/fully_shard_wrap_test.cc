// --fsdp=fully_shard's pieces of the trainer (wrap.h's Wrap and
// TrainedModel, checkpointing.h under fully_shard), on 2 Gloo ranks, with
// the trainer's model, synthetic batches and AdamW:
//   * the losses of 6 steps under fully_shard equal FSDP1's and the
//     unwrapped model's (1e-5 relative), also with --sharding=grad_op,
//     --auto-wrap=none, --activation-checkpointing=block, --grad-accum=2
//     (no_sync) and --clip (fsdp::clip_grad_norm_);
//   * a checkpoint saved after step 3 (sharded and FULL) resumes to the
//     same losses for steps 4-6, under fully_shard and across --fsdp: saved
//     by FSDP1 resumed by fully_shard and back; --export-dcp /
//     --import-dcp likewise;
//   * between forward and backward the root keeps its parameters
//     gathered (PyTorch's default for the root), the blocks are sharded
//     under --sharding=full, all gathered under grad_op;
//   * options: --fsdp=fully_shard with what it does not do (--sharding none
//     or hybrid, --backward-prefetch=post) is refused naming
//     both flags.
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>

#include "comm/collectives.h"
#include "fsdp/fully_shard.h"
#include "testing/multiprocess.h"
#include "trainer/checkpointing.h"
#include "trainer/data.h"
#include "trainer/models.h"
#include "trainer/options.h"
#include "trainer/wrap.h"

namespace trainer {
namespace {

Options Tiny() {
  Options o;
  o.layers = 2;
  o.dim = 32;
  o.heads = 2;
  o.seq = 16;
  o.vocab = 64;
  o.global_batch = 8;
  o.seed = 5;
  o.lr = 3e-3;
  o.steps = 6;
  return o;
}

std::shared_ptr<LanguageModel> Build(const Options& o) {
  return BuildModel(ModelType::kTransformer, ModelConfig{o.layers, o.dim, o.heads, o.vocab, o.seq},
                    static_cast<uint64_t>(o.seed));
}

torch::Tensor Batch(const Options& o, int64_t step, int rank, int world) {
  auto b = SampleSyntheticBatch(o.vocab, BatchSpec{static_cast<uint64_t>(o.seed), step,
                                                   o.global_batch, o.seq + 1, rank, world});
  EXPECT_TRUE(b.ok()) << b.status();
  return *b;
}

// Losses of steps [first, last] (global means), as the trainer's loop
// computes them (ForwardBackward + TrainStep, without logging).
std::vector<double> TrainSteps(const Options& o, const comm::ProcessGroup& pg, TrainedModel model,
                               LanguageModel& lm, torch::optim::Optimizer& opt, int64_t first,
                               int64_t last) {
  std::vector<double> losses;
  for (int64_t step = first; step <= last; ++step) {
    opt.zero_grad();
    double local = 0;
    const std::vector<torch::Tensor> micros =
        Batch(o, step, pg.rank(), pg.size()).chunk(o.grad_accum, 0);
    for (size_t m = 0; m < micros.size(); ++m) {
      auto fb = [&] {
        torch::Tensor loss =
            model.run([&] { return lm.Loss(micros[m]); }) / static_cast<double>(o.grad_accum);
        loss.backward();
        local += loss.item<double>();
      };
      if (m + 1 < micros.size()) {
        auto no_sync = model.no_sync();
        fb();
      } else {
        fb();
      }
    }
    torch::Tensor l = torch::tensor({local}, torch::kFloat64);
    comm::all_reduce(pg, l, comm::ReduceOp::kAvg).wait();
    if (o.clip > 0) model.clip_grad_norm_(o.clip);
    opt.step();
    losses.push_back(l.item<double>());
  }
  return losses;
}

std::unique_ptr<torch::optim::Optimizer> AdamW(const Options& o, TrainedModel model) {
  return std::make_unique<torch::optim::AdamW>(model.parameters(),
                                               torch::optim::AdamWOptions(o.lr).weight_decay(0.01));
}

// One run: wrapped per `o.fsdp`, steps 1..6.
std::vector<double> RunSteps(const Options& o, const comm::ProcessGroup& pg) {
  auto lm = Build(o);
  auto wrapped = Wrap(o, lm, c10::Device(c10::kCPU), pg);
  EXPECT_TRUE(wrapped.ok()) << wrapped.status();
  if (!wrapped.ok()) return {};
  auto opt = AdamW(o, wrapped->model());
  return TrainSteps(o, pg, wrapped->model(), *lm, *opt, 1, o.steps);
}

// The unwrapped model on the global batch (one process).
std::vector<double> Unwrapped(const Options& o) {
  auto lm = Build(o);
  torch::optim::AdamW opt(lm->parameters(), torch::optim::AdamWOptions(o.lr).weight_decay(0.01));
  std::vector<double> losses;
  for (int64_t step = 1; step <= o.steps; ++step) {
    opt.zero_grad();
    torch::Tensor loss = lm->Loss(Batch(o, step, 0, 1));
    loss.backward();
    if (o.clip > 0) torch::nn::utils::clip_grad_norm_(lm->parameters(), o.clip);
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

void ExpectSame(const std::vector<double>& want, const std::vector<double>& got,
                const std::string& what, double rel = 1e-5) {
  ASSERT_EQ(want.size(), got.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], rel * std::abs(want[i])) << what << " step " << i + 1;
  }
}

TEST(FullyShardTrainer, SameLossesAsFsdp1AndUnwrapped) {
  const Options base = Tiny();
  const std::vector<double> plain = Unwrapped(base);
  Options clipped = base;
  clipped.clip = 0.05;
  const std::vector<double> plain_clipped = Unwrapped(clipped);
  comm::testing::RunOptions run;
  run.timeout = std::chrono::seconds(300);
  comm::testing::RunOnRanks(
      2,
      [&](comm::ProcessGroup& pg) {
        Options fsdp1 = base;
        ExpectSame(plain, RunSteps(fsdp1, pg), "fsdp1");
        Options fs = base;
        fs.fsdp = FsdpApi::kFullyShard;
        ExpectSame(plain, RunSteps(fs, pg), "fully_shard");
        Options grad_op = fs;
        grad_op.sharding = Sharding::kGradOp;
        ExpectSame(plain, RunSteps(grad_op, pg), "fully_shard, grad_op");
        Options root_only = fs;
        root_only.auto_wrap = AutoWrap::kNone;
        root_only.backward_prefetch = BackwardPrefetch::kNone;
        ExpectSame(plain, RunSteps(root_only, pg), "fully_shard, root only");
        Options ac = fs;
        ac.activation_checkpointing = ActivationCheckpointing::kBlock;
        ExpectSame(plain, RunSteps(ac, pg), "fully_shard, activation checkpointing");
        Options accum = fs;
        accum.grad_accum = 2;
        ExpectSame(plain, RunSteps(accum, pg), "fully_shard, grad-accum 2");
        Options clip = clipped;
        clip.fsdp = FsdpApi::kFullyShard;
        ExpectSame(plain_clipped, RunSteps(clip, pg), "fully_shard, clip");
      },
      run);
}

std::string Dir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return std::string(tmp == nullptr ? "/tmp" : tmp) + "/fully_shard_wrap/" + name;
}

// Steps 1-3 under `save`'s --fsdp, a checkpoint (or --export-dcp) of step 3,
// then a new model under `load`'s --fsdp resumes (or --import-dcp) and
// trains steps 4-6: their losses must be the uninterrupted run's.
void SaveThenResume(const comm::ProcessGroup& pg, Options save, Options load,
                    const std::vector<double>& want, const std::string& what) {
  SCOPED_TRACE(what);
  const bool dcp = !save.export_dcp.empty();
  std::error_code ec;
  std::filesystem::create_directories(dcp ? save.export_dcp : save.checkpoint_dir, ec);
  {
    auto lm = Build(save);
    auto wrapped = Wrap(save, lm, c10::Device(c10::kCPU), pg);
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    auto opt = AdamW(save, wrapped->model());
    TrainSteps(save, pg, wrapped->model(), *lm, *opt, 1, 3);
    if (dcp) {
      auto s = ExportDcp(save, pg, wrapped->model(), *opt, 3);
      ASSERT_TRUE(s.ok()) << s;
    } else {
      auto s = SaveTrainerCheckpoint(save, wrapped->model(), *opt, pg, 3, nullptr);
      ASSERT_TRUE(s.ok()) << s;
    }
  }
  auto lm = Build(load);
  auto wrapped = Wrap(load, lm, c10::Device(c10::kCPU), pg);
  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
  auto opt = AdamW(load, wrapped->model());
  auto step = ResumeTrainer(load, pg, wrapped->model(), *opt);
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_EQ(*step, 3);
  ExpectSame(std::vector<double>(want.begin() + 3, want.end()),
             TrainSteps(load, pg, wrapped->model(), *lm, *opt, 4, 6), what);
}

TEST(FullyShardTrainer, CheckpointsResumeUnderEitherFsdp) {
  const Options base = Tiny();
  const std::vector<double> plain = Unwrapped(base);
  comm::testing::RunOptions run;
  run.timeout = std::chrono::seconds(300);
  comm::testing::RunOnRanks(
      2,
      [&](comm::ProcessGroup& pg) {
        int n = 0;
        for (auto format : {CheckpointFormat::kSharded, CheckpointFormat::kFull}) {
          for (auto [from, to] : {std::pair{FsdpApi::kFullyShard, FsdpApi::kFullyShard},
                                  std::pair{FsdpApi::kFsdp1, FsdpApi::kFullyShard},
                                  std::pair{FsdpApi::kFullyShard, FsdpApi::kFsdp1}}) {
            Options save = base, load = base;
            save.checkpoint_dir = load.checkpoint_dir = Dir("ckpt" + std::to_string(n++));
            save.checkpoint_format = load.checkpoint_format = format;
            save.fsdp = from;
            load.fsdp = to;
            load.resume = true;
            SaveThenResume(pg, save, load, plain,
                           std::string(Name(format)) + " " + Name(from) + " -> " + Name(to));
          }
        }
        for (auto [from, to] : {std::pair{FsdpApi::kFullyShard, FsdpApi::kFullyShard},
                                std::pair{FsdpApi::kFsdp1, FsdpApi::kFullyShard},
                                std::pair{FsdpApi::kFullyShard, FsdpApi::kFsdp1}}) {
          Options save = base, load = base;
          save.export_dcp = load.import_dcp = Dir("dcp" + std::to_string(n++));
          save.fsdp = from;
          load.fsdp = to;
          SaveThenResume(pg, save, load, plain,
                         std::string("dcp ") + Name(from) + " -> " + Name(to));
        }
      },
      run);
}

// Between forward and backward: under --sharding=full the blocks are
// resharded and the root keeps its own parameters gathered (PyTorch's
// default reshard_after_forward=None for the root, as FSDP1's FULL_SHARD
// root unit), so backward gathers no root parameters again; under
// --sharding=grad_op every unit keeps its parameters. After backward all
// are sharded.
TEST(FullyShardTrainer, RootKeepsItsParametersAfterForward) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    for (Sharding sharding : {Sharding::kFull, Sharding::kGradOp}) {
      const std::string what = sharding == Sharding::kFull ? "full" : "grad_op";
      Options o = Tiny();
      o.fsdp = FsdpApi::kFullyShard;
      o.sharding = sharding;
      auto lm = Build(o);
      auto wrapped = Wrap(o, lm, c10::Device(c10::kCPU), pg);
      ASSERT_TRUE(wrapped.ok()) << wrapped.status();
      TrainedModel model = wrapped->model();
      torch::Tensor loss = model.run([&] { return lm->Loss(Batch(o, 1, pg.rank(), pg.size())); });
      int64_t root_params = 0;
      for (const auto& p : lm->named_parameters()) {
        const bool in_block = p.key().rfind("blocks.", 0) == 0;
        root_params += in_block ? 0 : 1;
        const bool want_sharded = in_block && sharding == Sharding::kFull;
        EXPECT_EQ(fsdp::sharded_param_spec(p.value()).has_value(), want_sharded)
            << what << ", after forward: " << p.key();
      }
      EXPECT_GT(root_params, 0);
      loss.backward();
      for (const auto& p : lm->named_parameters()) {
        EXPECT_TRUE(fsdp::sharded_param_spec(p.value()).has_value())
            << what << ", after backward: " << p.key();
      }
    }
  });
}

TEST(FullyShardTrainer, RefusesWhatFullyShardDoesNotDoNamingBothFlags) {
  Options o = Tiny();
  o.fsdp = FsdpApi::kFullyShard;
  EXPECT_TRUE(CheckFeatureAvailability(o, 2).ok());
  struct Case {
    void (*set)(Options&);
    const char* flag;
  };
  for (const Case& c : {Case{[](Options& x) { x.sharding = Sharding::kNone; }, "--sharding=none"},
                        Case{[](Options& x) { x.backward_prefetch = BackwardPrefetch::kPost; },
                             "--backward-prefetch=post"}}) {
    Options bad = o;
    c.set(bad);
    absl::Status s = CheckFeatureAvailability(bad, 4);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.flag << ": " << s;
    EXPECT_NE(std::string(s.message()).find(c.flag), std::string::npos) << s;
    EXPECT_NE(std::string(s.message()).find("--fsdp=fully_shard"), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace trainer
