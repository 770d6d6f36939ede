// The trainer on --model llama, end to end (//trainer:trainer as a child
// process), from the golden Hugging Face checkpoint of
// tools/golden/llama_golden.py (models/testdata/llama3_gqa: GQA, llama3
// RoPE scaling, three safetensors shards with an index):
//   * the same losses (1e-4 relative) unwrapped on 1 rank, under FSDP1 and
//     fully_shard on 2-4 ranks, with every sharding strategy, activation
//     checkpointing, grad-accum, CPU offload and clipping; bf16 within 3%;
//   * resume across world sizes and both FSDPs, DCP export/import;
//   * --model-config (random initialisation from --seed) learns;
//   * --export-hf writes a checkpoint --hf-checkpoint reads back;
//   * a token file of the model's vocabulary with --eval-every;
//   * bad flags and bad checkpoints refused, naming what is wrong, before
//     any step runs.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/data.h"
#include "trainer/testing/run_trainer.h"

namespace trainer {
namespace {

using testing::ExpectSameLosses;
using ::testing::HasSubstr;
using testing::ReadLog;
using testing::RunResult;
using testing::RunTrainer;
using testing::StepLog;
using testing::TempDir;

const char kCheckpoint[] = "models/testdata/llama3_gqa";

// 8 steps of 12 rows of 16 tokens; a constant rate after warm-up, so a run of
// 4 steps is the first half of the 8-step run.
std::string Tiny() {
  return std::string("--model=llama --hf-checkpoint=") + kCheckpoint +
         " --data=synthetic --seq=16 --global-batch=12 --steps=8 --warmup-steps=2 --seed=5 "
         "--lr=1e-2 --lr-schedule=constant";
}

StepLog Train(const std::string& name, int nproc, const std::string& flags, size_t steps = 8) {
  const std::string log = TempDir("llama_" + name) + "/log.jsonl";
  RunResult r =
      RunTrainer(Tiny() + " --nproc=" + std::to_string(nproc) + " " + flags + " --log-json=" + log);
  EXPECT_EQ(r.exit_code, 0) << name << ": " << r.output;
  StepLog out = ReadLog(log, nproc);
  EXPECT_EQ(out.losses.size(), steps) << name;
  return out;
}

TEST(TrainerLlamaE2eTest, SameLossesUnderEveryWrapping) {
  const StepLog one = Train("one", 1, "--fsdp=fsdp1 --sharding=none");
  ASSERT_EQ(one.losses.size(), 8u);
  EXPECT_LT(one.losses.back(), one.losses.front());
  const std::vector<std::pair<std::string, std::pair<int, std::string>>> runs = {
      {"fsdp1 2", {2, "--fsdp=fsdp1"}},
      {"fsdp1 grad_op 3", {3, "--fsdp=fsdp1 --sharding=grad_op"}},
      {"fsdp1 hybrid 4", {4, "--fsdp=fsdp1 --sharding=hybrid"}},
      {"fully_shard 2", {2, "--fsdp=fully_shard"}},
      {"fully_shard 3", {3, "--fsdp=fully_shard"}},
      {"fully_shard grad_op", {2, "--fsdp=fully_shard --sharding=grad_op"}},
      {"fully_shard ac", {2, "--fsdp=fully_shard --activation-checkpointing=block"}},
      {"fsdp1 ac", {2, "--fsdp=fsdp1 --activation-checkpointing=block"}},
      {"fully_shard accum", {2, "--fsdp=fully_shard --grad-accum=2"}},
      {"fully_shard offload", {2, "--fsdp=fully_shard --cpu-offload"}},
      {"fsdp1 offload", {2, "--fsdp=fsdp1 --cpu-offload"}},
      {"fully_shard size wrap", {2, "--fsdp=fully_shard --auto-wrap=size:1000"}},
  };
  for (const auto& [name, run] : runs) {
    std::string file = name;
    for (char& c : file) c = c == ' ' ? '_' : c;
    ExpectSameLosses(one.losses, Train(file, run.first, run.second).losses, 1e-4, name);
  }
  const std::string clip = " --clip=0.05 --optimizer=sgd --lr=0.05";
  ExpectSameLosses(Train("clip1", 1, "--sharding=none" + clip).losses,
                   Train("clip_fs", 2, "--fsdp=fully_shard" + clip).losses, 1e-4, "clip");
  ExpectSameLosses(one.losses, Train("bf16", 2, "--fsdp=fully_shard --mixed-precision=bf16").losses,
                   0.03, "bf16 vs float32");
}

// Steps 1-4 with a checkpoint (or export) at 4, then 5-8 from it: the
// losses of 5-8 must be the uninterrupted run's.
void ExpectResumes(const std::vector<double>& whole, const std::string& name, int save_nproc,
                   const std::string& save, int load_nproc, const std::string& load) {
  const std::string dir = TempDir("llama_resume_" + name);
  RunResult first =
      RunTrainer(Tiny() + " --steps=4 --nproc=" + std::to_string(save_nproc) + " " + save + dir);
  ASSERT_EQ(first.exit_code, 0) << name << ": " << first.output;
  const std::string log = dir + "/resumed.jsonl";
  RunResult resumed = RunTrainer(Tiny() + " --nproc=" + std::to_string(load_nproc) + " " + load +
                                 dir + " --log-json=" + log);
  ASSERT_EQ(resumed.exit_code, 0) << name << ": " << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("steps 5-8")) << name;
  const StepLog b = ReadLog(log, load_nproc);
  ASSERT_EQ(b.steps, (std::vector<int64_t>{5, 6, 7, 8})) << name;
  ExpectSameLosses(std::vector<double>(whole.begin() + 4, whole.end()), b.losses, 1e-4, name);
}

TEST(TrainerLlamaE2eTest, ResumesAcrossWorldSizesAndFsdps) {
  const StepLog whole = Train("whole", 2, "--fsdp=fully_shard");
  ASSERT_EQ(whole.losses.size(), 8u);
  const std::string ckpt = " --checkpoint-every=4 --checkpoint-dir=";
  const std::string resume = " --resume --checkpoint-dir=";
  ExpectResumes(whole.losses, "fs2_to_fs3", 2, "--fsdp=fully_shard" + ckpt, 3,
                "--fsdp=fully_shard" + resume);
  ExpectResumes(whole.losses, "full_fs2_to_f1_3", 2,
                "--fsdp=fully_shard --checkpoint-format=full" + ckpt, 3,
                "--fsdp=fsdp1 --checkpoint-format=full" + resume);
  ExpectResumes(whole.losses, "dcp_f1_to_fs", 2, "--fsdp=fsdp1 --export-dcp=", 3,
                "--fsdp=fully_shard --import-dcp=");
}

TEST(TrainerLlamaE2eTest, ModelConfigInitialisesFromTheSeedAndLearns) {
  const std::string config = std::string("--model-config=") + kCheckpoint + "/config.json";
  auto run = [&](const std::string& name, const std::string& seed,
                 const std::string& fsdp = "fully_shard") {
    const std::string log = TempDir("llama_config_" + name) + "/log.jsonl";
    RunResult r = RunTrainer(
        "--model=llama " + config +
        " --data=synthetic --seq=16 --global-batch=8 --steps=30 --warmup-steps=2 --lr=1e-2 "
        "--nproc=2 --fsdp=" +
        fsdp + " --seed=" + seed + " --log-json=" + log);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return ReadLog(log, 2);
  };
  const StepLog a = run("a", "3"), b = run("b", "3"), c = run("c", "4");
  ASSERT_EQ(a.losses.size(), 30u);
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_NE(a.losses, c.losses);
  // fully_shard builds the model on the meta device and fills each rank's
  // shards tensor by tensor; FSDP1 initialises the whole model on the CPU:
  // the same initial values, so the same run.
  ExpectSameLosses(a.losses, run("fsdp1", "3", "fsdp1").losses, 1e-4, "fsdp1 vs fully_shard init");
  // transformers' init (N(0, 0.02)) starts at the uniform loss, ln(128).
  EXPECT_NEAR(a.losses.front(), std::log(128.0), 0.05);
}

TEST(TrainerLlamaE2eTest, ExportHfIsReadBackByHfCheckpoint) {
  const std::string dir = TempDir("llama_export");
  const std::string exported = dir + "/exported";
  // The constant-rate run of 4 steps, exported in bf16 and in float32.
  RunResult first =
      RunTrainer(Tiny() + " --steps=4 --nproc=2 --fsdp=fully_shard --export-hf=" + exported +
                 " --export-hf-max-shard-bytes=60000");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_THAT(first.output, HasSubstr("wrote Hugging Face checkpoint " + exported + " (float32)"));
  EXPECT_TRUE(std::filesystem::exists(exported + "/model.safetensors.index.json"));
  // Trained on from the export: the first loss is what the exported model
  // gives on step 1's batch, below the golden checkpoint's.
  const std::string log = dir + "/from_export.jsonl";
  RunResult second = RunTrainer(std::string("--model=llama --hf-checkpoint=") + exported +
                                " --data=synthetic --seq=16 --global-batch=12 --steps=1 "
                                "--warmup-steps=0 --seed=5 --nproc=3 --fsdp=fsdp1 --log-json=" +
                                log);
  ASSERT_EQ(second.exit_code, 0) << second.output;
  const StepLog from_export = ReadLog(log, 3);
  const StepLog from_golden = Train("golden_step1", 1, "--sharding=none --steps=1", 1);
  ASSERT_EQ(from_export.losses.size(), 1u);
  EXPECT_LT(from_export.losses[0], from_golden.losses[0] - 1e-3);
  // A second export replaces the first (a previous export may be replaced).
  RunResult again = RunTrainer(Tiny() + " --steps=1 --nproc=2 --export-hf=" + exported +
                               " --export-hf-dtype=bfloat16");
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_TRUE(std::filesystem::exists(exported + "/model.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(exported + "/model.safetensors.index.json"));
}

TEST(TrainerLlamaE2eTest, TokenFileWithEvaluation) {
  const std::string dir = TempDir("llama_tokens");
  std::vector<uint32_t> ids;
  for (uint32_t i = 0; i < 20000; ++i) ids.push_back((i * 7 + i / 13) % 128);
  ASSERT_TRUE(WriteTokenFile(dir + "/train.bin", ids, 128).ok());
  const std::string log = dir + "/log.jsonl";
  RunResult r =
      RunTrainer(std::string("--model=llama --hf-checkpoint=") + kCheckpoint + " --data=" + dir +
                 "/train.bin --eval-every=2 --seq=16 --global-batch=4 --steps=4 "
                 "--nproc=2 --fsdp=fully_shard --log-json=" +
                 log);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("val loss"));
  // A vocabulary the model does not have is refused by the data check.
  ids.push_back(200);
  ASSERT_TRUE(WriteTokenFile(dir + "/big.bin", ids, 256).ok());
  RunResult big = RunTrainer(std::string("--model=llama --hf-checkpoint=") + kCheckpoint +
                             " --data=" + dir + "/big.bin --seq=16 --global-batch=4 --steps=1");
  EXPECT_NE(big.exit_code, 0);
  EXPECT_THAT(big.output, HasSubstr("200"));
}

// Each bad run: its flags and what its error must say.
TEST(TrainerLlamaE2eTest, BadInputIsRefusedBeforeAnyStep) {
  const std::string dir = TempDir("llama_bad");
  // A checkpoint whose index names a file that is not there.
  const std::string broken = dir + "/broken";
  std::filesystem::create_directories(broken);
  for (const char* f : {"config.json", "model.safetensors.index.json",
                        "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"}) {
    std::filesystem::copy_file(std::string(kCheckpoint) + "/" + f, broken + "/" + f);
  }
  // A directory that is not an export.
  const std::string precious = dir + "/precious";
  std::filesystem::create_directories(precious);
  std::ofstream(precious + "/notes.txt") << "mine";
  const std::string base = " --data=synthetic --seq=16 --global-batch=4 --steps=2";
  const std::string ckpt = std::string(" --hf-checkpoint=") + kCheckpoint;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--model=llama" + base, "expected --hf-checkpoint DIR"},
      {"--model=llama" + ckpt + " --model-config=x.json" + base, "not both"},
      {"--model=llama --dim=64" + ckpt + base, "--dim: --model=llama takes its shape"},
      {"--model=transformer" + ckpt + base,
       "--hf-checkpoint='models/testdata/llama3_gqa': expected --model=llama"},
      {"--model=llama --hf-checkpoint=" + broken + base, "model-00003-of-00003.safetensors"},
      {"--model=llama --hf-checkpoint=" + dir + "/nothing" + base, "config.json"},
      {"--model=llama" + ckpt + " --data=synthetic --seq=300 --global-batch=4",
       "--seq=300: expected at most the model's max_position_embeddings=256"},
      {"--model=llama" + ckpt + base + " --export-hf=" + precious, "notes.txt"},
      {"--model=llama" + ckpt + base + " --export-hf=" + kCheckpoint,
       "expected a directory other than --hf-checkpoint's"},
      {"--model=llama" + ckpt + " --data=text --seq=16 --global-batch=4", "vocab_size=128"},
      {"--model=llama" + ckpt + base + " --float8", "--float8 on cpu: the CPU has no float8"},
      {"--model=transformer" + base + " --float8", "--float8: expected --model=llama"},
      {"--model=llama" + ckpt + base + " --float8-all-gather",
       "--float8-all-gather: expected --float8 and --fsdp=fully_shard (fully_shard gathers the "
       "float8 projections' weights), got --float8=off --fsdp=fsdp1"},
      {"--model=llama" + ckpt + base + " --float8 --float8-all-gather",
       "got --float8=on --fsdp=fsdp1"},
      {"--model=llama" + ckpt + base + " --fsdp=fully_shard --float8 --float8-all-gather",
       "--float8 on cpu: the CPU has no float8"},
  };
  for (const auto& [flags, expected] : cases) {
    RunResult r = RunTrainer(flags + " --nproc=2");
    EXPECT_NE(r.exit_code, 0) << flags;
    EXPECT_THAT(r.output, HasSubstr(expected)) << flags;
    EXPECT_THAT(r.output, ::testing::Not(HasSubstr("step 1/"))) << flags;
  }
  EXPECT_TRUE(std::filesystem::exists(precious + "/notes.txt"));
  EXPECT_FALSE(std::filesystem::exists(precious + "/config.json"));
}

}  // namespace
}  // namespace trainer
