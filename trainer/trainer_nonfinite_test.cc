// A diverged run loses nothing (issue 38, item 1), on the built trainer:
// the first non-finite step ends the run before its optimizer update, no
// checkpoint is written from non-finite state (so --keep-last keeps the
// last finite ones), and a checkpoint, FULL or sharded, or a DCP import
// holding NaN is refused by name unless --allow-nonfinite-import.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <ATen/ops/full.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "state_dict/checkpoint.h"
#include "state_dict/dcp.h"
#include "trainer/testing/run_trainer.h"

namespace trainer::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// A small transformer on the license texts.
constexpr char kSmall[] = "--layers 1 --dim 32 --seq 16 --global-batch 4 --warmup-steps 2 ";

std::vector<std::string> StepNames(const std::string& root) {
  auto listed = state_dict::ListCheckpoints(root);
  EXPECT_TRUE(listed.ok()) << listed.status();
  std::vector<std::string> names;
  if (listed.ok()) {
    for (const std::string& dir : *listed) names.push_back(fs::path(dir).filename().string());
  }
  return names;
}

// The scenario: 10 healthy steps, then a resume with --lr 1e30 (a
// stand-in for a loss spike).
TEST(TrainerNonFinite, DivergedRunStopsAtTheFirstNonFiniteStepAndKeepsTheGoodCheckpoints) {
  const std::string dir = TempDir("diverge");
  const std::string args = std::string(kSmall) + "--nproc 2 --checkpoint-dir " + dir +
                           "/ck --checkpoint-every 2 --keep-last 2 ";
  const RunResult healthy = RunTrainer(args + "--steps 10");
  ASSERT_EQ(healthy.exit_code, 0) << healthy.output;
  ASSERT_THAT(StepNames(dir + "/ck"), ElementsAre("step_8", "step_10"));

  const RunResult spiked = RunTrainer(args + "--steps 30 --resume --lr 1e30");
  EXPECT_EQ(spiked.exit_code, 1) << spiked.output;
  // Step 11 is finite (with the old weights); its update makes step 12's nan.
  EXPECT_THAT(spiked.output,
              HasSubstr("step 12: the global loss is nan: expected a finite number"));
  EXPECT_THAT(spiked.output, Not(HasSubstr("step 13")));
  EXPECT_THAT(StepNames(dir + "/ck"), ElementsAre("step_8", "step_10"));
  // And they still load: a resume at a sane lr goes on from step 10.
  const RunResult again = RunTrainer(args + "--steps 12 --resume");
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_THAT(StepNames(dir + "/ck"), ElementsAre("step_10", "step_12"));
}

// `key`'s first element set to NaN in a FULL state dict of `step_dir`.
state_dict::TensorDict WithNaN(const std::string& step_dir, const std::string& key) {
  auto full = state_dict::LoadFullStateDict(step_dir);
  EXPECT_TRUE(full.ok()) << full.status();
  state_dict::TensorDict out;
  for (const auto& item : *full) {
    at::Tensor t = item.value().clone();
    if (item.key() == key) t.reshape({-1})[0].fill_(std::nan(""));
    out.insert(item.key(), t);
  }
  EXPECT_TRUE(out.contains(key)) << key;
  return out;
}

// The same entries as a 1-rank SHARDED checkpoint (each tensor one piece).
absl::Status SaveAsSharded(const std::string& root, int64_t step,
                           const state_dict::TensorDict& dict) {
  state_dict::ShardedStateDict shard;
  for (const auto& item : dict) {
    state_dict::ShardedTensor st;
    st.global_shape = item.value().sizes().vec();
    st.dtype = item.value().scalar_type();
    st.pieces.push_back({{0, item.value().numel()}, item.value().reshape({-1})});
    shard.insert(item.key(), st);
  }
  return state_dict::SaveShardedCheckpoint(root, step, {shard});
}

TEST(TrainerNonFinite, CheckpointsHoldingNaNAreRefusedByName) {
  const std::string dir = TempDir("planted");
  // A FULL checkpoint with a NaN parameter.
  RunResult r =
      RunTrainer(std::string(kSmall) +
                 "--nproc 1 --steps 2 --checkpoint-format full --checkpoint-dir " + dir + "/full");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_TRUE(state_dict::SaveFullCheckpoint(
                  dir + "/full_nan", 2, WithNaN(dir + "/full/step_2", "model.blocks.0.fc1.weight"))
                  .ok());
  r = RunTrainer(std::string(kSmall) + "--nproc 2 --steps 4 --resume --checkpoint-dir " + dir +
                 "/full_nan");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("checkpoint '" + dir + "/full_nan/step_2': parameter " +
                                  "blocks.0.fc1.weight holds 1 NaN/Inf value of"));
  EXPECT_THAT(r.output, HasSubstr("--allow-nonfinite-import loads it anyway"));
  EXPECT_THAT(r.output, Not(HasSubstr("step 3/4")));

  // A sharded one (a 1-rank checkpoint resumed on 2 ranks) with a NaN in
  // the optimizer state: refused the same way...
  r = RunTrainer(std::string(kSmall) + "--nproc 1 --steps 2 --checkpoint-dir " + dir + "/sharded");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_TRUE(SaveAsSharded(dir + "/sharded_nan", 2,
                            WithNaN(dir + "/sharded/step_2", "blocks.0.fc1.weight/exp_avg"))
                  .ok());
  const std::string resume = std::string(kSmall) +
                             "--nproc 2 --steps 4 --checkpoint-every 1 --resume --checkpoint-dir " +
                             dir + "/sharded_nan";
  r = RunTrainer(resume);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("optimizer state blocks.0.fc1.weight/exp_avg holds 1 NaN/Inf"));
  EXPECT_THAT(StepNames(dir + "/sharded_nan"), ElementsAre("step_2"));
  // ... and, allowed in, the NaN reaches the parameter in step 3's update
  // (its loss still finite): that step's checkpoint is not written.
  r = RunTrainer(resume + " --allow-nonfinite-import");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("step 3: not saved: parameter blocks.0.fc1.weight holds"));
  EXPECT_THAT(StepNames(dir + "/sharded_nan"), ElementsAre("step_2"));
}

// DCP has no checksums: a NaN written over the first element of `key` in
// its .distcp file (found by the bytes of its first 8 elements) loads
// silently, unless the trainer looks.
void PlantNaNInDcp(const std::string& dcp, const std::string& key) {
  auto ckpt = state_dict::DcpCheckpoint::Open(dcp);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  state_dict::ShardRequest request;
  for (const auto& t : ckpt->tensors()) {
    if (t.key == key) request = {t.shape, t.dtype, {{0, 8}}};
  }
  ASSERT_FALSE(request.global_shape.empty()) << key;
  auto head = ckpt->LoadResharded({{key, request}});
  ASSERT_TRUE(head.ok()) << head.status();
  const at::Tensor first8 = head->begin()->value().pieces.at(0).data.contiguous();
  const std::string needle(static_cast<const char*>(first8.data_ptr()), 8 * sizeof(float));
  int planted = 0;
  for (const auto& entry : fs::directory_iterator(dcp)) {
    if (entry.path().extension() != ".distcp") continue;
    std::ifstream in(entry.path(), std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t at = bytes.find(needle);
    if (at == std::string::npos) continue;
    const float nan = std::nanf("");
    std::memcpy(&bytes[at], &nan, sizeof(nan));
    std::ofstream(entry.path(), std::ios::binary | std::ios::trunc) << bytes;
    ++planted;
  }
  ASSERT_EQ(planted, 1) << key;
}

TEST(TrainerNonFinite, DcpImportHoldingNaNIsRefused) {
  const std::string dir = TempDir("dcp_nan");
  for (const char* name : {"/dcp", "/dcp_optim"}) {
    RunResult r =
        RunTrainer(std::string(kSmall) + "--nproc 2 --steps 2 --export-dcp " + dir + name);
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  PlantNaNInDcp(dir + "/dcp", "model.blocks.0.fc1.weight");
  RunResult r =
      RunTrainer(std::string(kSmall) + "--nproc 2 --steps 4 --import-dcp " + dir + "/dcp");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--import-dcp='" + dir + "/dcp': parameter " +
                                  "blocks.0.fc1.weight holds 1 NaN/Inf value"));
  r = RunTrainer(std::string(kSmall) +
                 "--nproc 2 --steps 4 --allow-nonfinite-import --import-dcp " + dir + "/dcp");
  EXPECT_EQ(r.exit_code, 1) << r.output;  // loaded, and then the first step's loss is nan
  EXPECT_THAT(r.output, HasSubstr("step 3: the global loss is nan"));

  // NaN in the optimizer state, allowed in: step 3's loss is finite, its
  // update makes the parameter NaN, and the run's --export-dcp is refused.
  PlantNaNInDcp(dir + "/dcp_optim", "optim.state.blocks.0.fc1.weight.exp_avg");
  r = RunTrainer(std::string(kSmall) + "--nproc 2 --steps 3 --import-dcp " + dir + "/dcp_optim");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("optimizer state blocks.0.fc1.weight/exp_avg holds 1 NaN/Inf"));
  r = RunTrainer(std::string(kSmall) +
                 "--nproc 2 --steps 3 --allow-nonfinite-import --import-dcp " + dir +
                 "/dcp_optim --export-dcp " + dir + "/out");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--export-dcp='" + dir +
                                  "/out' step 3: not written: parameter "
                                  "blocks.0.fc1.weight holds"));
  EXPECT_FALSE(fs::exists(dir + "/out/.metadata"));
}

}  // namespace
}  // namespace trainer::testing
