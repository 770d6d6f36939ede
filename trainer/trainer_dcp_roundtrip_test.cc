// The round trip that proves --import-dcp / --export-dcp (issue 25, item 4):
// a small transformer trains N = 3 steps in Python FSDP2 (fully_shard, Gloo,
// CPU, 2 ranks; tools/trainer_mirror.py, the trainer's model, data, schedule
// and AdamW in Python), which saves a torch.distributed.checkpoint (DCP);
// the C++ trainer continues it on 3 ranks to step 2N and exports a DCP
// checkpoint; Python continues that on 2 ranks to step 3N. Its final state
// (every parameter, and AdamW's exp_avg, exp_avg_sq and step) matches an
// uninterrupted Python run of 3N steps on 2 ranks.
//
// That comparison only proves something if the Python run itself is right
// (PyTorch issue 162338: FSDP2 on Gloo once summed gradients instead of
// averaging them). So the uninterrupted Python run is also checked against
// an uninterrupted C++ trainer run of 3N steps (2 ranks; the mirror
// initialises the model exactly as the trainer does): the same per-step
// losses, and the same final state, optimizer moments included. Losses
// alone would not catch a gradient scaled by the world size (AdamW's update
// m/sqrt(v) does not change when every gradient is doubled), but exp_avg
// would be 2x and exp_avg_sq 4x. Every part's per-step losses are checked
// against the uninterrupted Python run's for the same steps. torch 2.15's
// FSDP2 averages correctly on Gloo, so the Python side uses FSDP2.
//
// Tolerances. The C++ and Python forward and backward kernels differ in
// summation order (LibTorch's MultiheadAttention does bmm + softmax, Python's
// scaled_dot_product_attention; FSDP reduces in different orders on 2 and 3
// ranks), so the runs agree to float32 rounding, not bitwise:
// - losses: 1e-5 relative (measured: ~1e-7);
// - each tensor of the final state: max |a - b| <= 2e-5 x max |b| over the
//   tensor (measured: <= 2.4e-6). Per tensor, not per element: elements
//   near zero (a small moment, a weight crossing zero) carry the rounding
//   of their larger neighbours;
// - except the key part of each block's attention in_proj_bias (elements
//   [dim, 2 dim)): its gradient is zero analytically (adding a constant to
//   every key's score of a query leaves the softmax unchanged), so what the
//   runs compute is rounding noise (|g| ~ 1e-10), which AdamW turns into
//   steps of lr x g / eps: those elements are values of ~1e-4 that differ
//   by as much between any two runs. They are checked to stay below 1e-3.
//
// Runtime: ~26 s on 2 cores (four Python runs of a few seconds each, mostly
// torch's import and torchrun; the C++ runs take ~1-3 s each).
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "state_dict/dcp.h"
#include "torch_python.h"
#include "trainer/testing/processes.h"
#include "trainer/testing/run_trainer.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;
using testing::ExpectSameLosses;
using ::testing::HasSubstr;
using testing::ReadLog;
using testing::RunResult;
using testing::RunTrainer;
using testing::TempDir;

constexpr int64_t kN = 3;  // steps per part
constexpr int64_t kDim = 32;
// The flags both sides have, with the same meaning. --warmup-steps 4: the
// learning rate rises over steps 1-4 and is constant after, so each part
// must continue at the right step to get the right rate.
const std::string kShared = "--layers 2 --dim " + std::to_string(kDim) +
                            " --heads 4 --seq 16 --global-batch 6 --lr 0.003 --warmup-steps 4 "
                            "--lr-schedule constant --seed 0 ";
// The trainer's own: what the mirror implements.
const std::string kTrainerOnly = "--model transformer --data synthetic --optimizer adamw ";

constexpr double kLossRelTol = 1e-5;
constexpr double kStateRelTol = 2e-5;
constexpr double kNoiseAbsTol = 1e-3;

RunResult RunShell(const std::string& command, const std::string& output_file) {
  const int status = std::system((command + " > '" + output_file + "' 2>&1").c_str());
  RunResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream in(output_file);
  std::stringstream text;
  text << in.rdbuf();
  result.output = text.str();
  return result;
}

// tools/trainer_mirror.py under torchrun on 2 ranks (--standalone: the
// rendezvous on a free port of the kernel's choosing, so concurrent tests
// cannot collide), with `args`.
RunResult RunMirror(const std::string& args, const std::string& output_file) {
  return RunShell(std::string("'") + kTorchPython +
                      "' -m torch.distributed.run --standalone --nproc-per-node 2 "
                      "tools/trainer_mirror.py --fsdp fsdp2 " +
                      kShared + args,
                  output_file);
}

// The mirror's "step N loss X" lines.
std::map<int64_t, double> MirrorLosses(const std::string& output) {
  std::map<int64_t, double> out;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    long long step = 0;
    double loss = 0;
    if (std::sscanf(line.c_str(), "step %lld loss %lf", &step, &loss) == 2) out[step] = loss;
  }
  return out;
}

std::vector<double> LossesOf(const std::map<int64_t, double>& losses, int64_t first, int64_t last) {
  std::vector<double> out;
  for (int64_t step = first; step <= last; ++step) {
    auto it = losses.find(step);
    out.push_back(it == losses.end() ? std::nan("") : it->second);
  }
  return out;
}

// A DCP directory read whole: every tensor (full), and trainer.step/seed.
struct DcpState {
  std::map<std::string, torch::Tensor> tensors;
  int64_t step = -1;
  int64_t seed = -1;
};

DcpState ReadDcp(const std::string& dir) {
  DcpState state;
  auto ckpt = state_dict::DcpCheckpoint::Open(dir);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  if (!ckpt.ok()) return state;
  std::vector<std::pair<std::string, state_dict::ShardRequest>> requests;
  for (const auto& t : ckpt->tensors()) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    requests.push_back({t.key, state_dict::ShardRequest{t.shape, t.dtype, {{0, numel}}}});
  }
  auto loaded = ckpt->LoadResharded(requests);
  EXPECT_TRUE(loaded.ok()) << loaded.status();
  if (!loaded.ok()) return state;
  for (const auto& [key, request] : requests) {
    const state_dict::ShardedTensor* t = loaded->find(key);
    EXPECT_TRUE(t != nullptr && t->pieces.size() == 1) << dir << ": " << key;
    if (t == nullptr || t->pieces.size() != 1) continue;
    state.tensors[key] = t->pieces[0].data.reshape(request.global_shape).to(torch::kFloat64);
  }
  const std::vector<std::pair<std::string, int64_t*>> objects = {{"trainer.step", &state.step},
                                                                 {"trainer.seed", &state.seed}};
  for (const auto& [key, out] : objects) {
    auto value = ckpt->LoadObject(key);
    EXPECT_TRUE(value.ok() && value->isInt()) << dir << ": " << key << ": " << value.status();
    if (value.ok() && value->isInt()) *out = value->toInt();
  }
  return state;
}

// "model.blocks.<i>.attn.in_proj_bias": its key part is noise (see above).
bool IsInProjBias(const std::string& key) {
  return key.rfind("model.", 0) == 0 && key.size() > 13 &&
         key.compare(key.size() - 13, 13, ".in_proj_bias") == 0;
}

void ExpectSameState(const DcpState& got, const DcpState& want, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(got.step, want.step);
  EXPECT_EQ(got.seed, want.seed);
  ASSERT_EQ(got.tensors.size(), want.tensors.size());
  int model_entries = 0, moments = 0;
  for (const auto& [key, b] : want.tensors) {
    auto it = got.tensors.find(key);
    ASSERT_NE(it, got.tensors.end()) << key;
    torch::Tensor a = it->second;
    ASSERT_EQ(a.sizes(), b.sizes()) << key;
    model_entries += key.rfind("model.", 0) == 0;
    moments += key.find(".exp_avg") != std::string::npos;
    torch::Tensor a_checked = a, b_checked = b;
    if (IsInProjBias(key)) {
      ASSERT_EQ(b.numel(), 3 * kDim) << key;
      const torch::Tensor noise = (a.narrow(0, kDim, kDim) - b.narrow(0, kDim, kDim)).abs();
      EXPECT_LE(noise.max().item<double>(), kNoiseAbsTol) << key << " (key part)";
      a_checked = torch::cat({a.narrow(0, 0, kDim), a.narrow(0, 2 * kDim, kDim)});
      b_checked = torch::cat({b.narrow(0, 0, kDim), b.narrow(0, 2 * kDim, kDim)});
    }
    const double diff = (a_checked - b_checked).abs().max().item<double>();
    const double scale = b_checked.abs().max().item<double>();
    EXPECT_LE(diff, kStateRelTol * scale + 1e-30)
        << key << ": max |difference| " << diff << ", max |value| " << scale;
  }
  // Both parts of the state were there to compare: the 2-layer model's 28
  // parameters (2 embeddings, 12 per block, the final LayerNorm's 2), and
  // exp_avg and exp_avg_sq of each.
  EXPECT_EQ(model_entries, 28);
  EXPECT_EQ(moments, 2 * 28);
}

bool PythonHasTorch() {
  return std::system(
             (std::string("'") + kTorchPython + "' -c 'import torch' > /dev/null 2>&1").c_str()) ==
         0;
}

TEST(TrainerDcpRoundTrip, PythonToCppToPythonMatchesAnUninterruptedPythonRun) {
  ASSERT_TRUE(PythonHasTorch()) << kTorchPython
                                << " cannot import torch (run tools/setup.sh --with-python)";
  const std::string dir = TempDir("dcp_roundtrip");
  const std::string n = std::to_string(kN), n2 = std::to_string(2 * kN),
                    n3 = std::to_string(3 * kN);

  // Part 1: Python FSDP2, 2 ranks, steps 1..N.
  RunResult part1 =
      RunMirror("--steps " + n + " --export-dcp " + dir + "/python_step" + n, dir + "/part1.txt");
  ASSERT_EQ(part1.exit_code, 0) << part1.output;
  // Part 2: the trainer, 3 ranks, steps N+1..2N.
  RunResult part2 = RunTrainer(kTrainerOnly + kShared + "--nproc 3 --steps " + n2 +
                               " --import-dcp " + dir + "/python_step" + n + " --export-dcp " +
                               dir + "/cpp_step" + n2 + " --log-json " + dir + "/part2.jsonl");
  ASSERT_EQ(part2.exit_code, 0) << part2.output;
  EXPECT_THAT(part2.output, HasSubstr("trainer: continuing from DCP checkpoint " + dir +
                                      "/python_step" + n + " (step " + n + ")"));
  EXPECT_THAT(part2.output, HasSubstr("trainer: wrote DCP checkpoint " + dir + "/cpp_step" + n2 +
                                      " (step " + n2 + ")"));
  // Part 3: Python FSDP2, 2 ranks, steps 2N+1..3N.
  RunResult part3 = RunMirror("--steps " + n3 + " --import-dcp " + dir + "/cpp_step" + n2 +
                                  " --export-dcp " + dir + "/roundtrip_step" + n3,
                              dir + "/part3.txt");
  ASSERT_EQ(part3.exit_code, 0) << part3.output;

  // The uninterrupted runs: Python, and the trainer.
  RunResult python = RunMirror("--steps " + n3 + " --export-dcp " + dir + "/python_step" + n3,
                               dir + "/python.txt");
  ASSERT_EQ(python.exit_code, 0) << python.output;
  RunResult cpp = RunTrainer(kTrainerOnly + kShared + "--nproc 2 --steps " + n3 + " --export-dcp " +
                             dir + "/cpp_step" + n3 + " --log-json " + dir + "/cpp.jsonl");
  ASSERT_EQ(cpp.exit_code, 0) << cpp.output;

  // The Python run is right: the trainer's losses, step for step, and
  // (below) its final state, optimizer moments included.
  const std::map<int64_t, double> python_losses = MirrorLosses(python.output);
  const std::vector<double> want = LossesOf(python_losses, 1, 3 * kN);
  const testing::StepLog cpp_log = ReadLog(dir + "/cpp.jsonl", 2);
  ASSERT_EQ(cpp_log.steps.size(), static_cast<size_t>(3 * kN));
  ExpectSameLosses(cpp_log.losses, want, kLossRelTol, "trainer vs Python, steps 1-" + n3);
  // Each part trained the steps it should, with the losses of those steps.
  ExpectSameLosses(LossesOf(MirrorLosses(part1.output), 1, kN), LossesOf(python_losses, 1, kN),
                   kLossRelTol, "part 1 (Python)");
  const testing::StepLog part2_log = ReadLog(dir + "/part2.jsonl", 3);
  EXPECT_EQ(part2_log.steps, (std::vector<int64_t>{kN + 1, kN + 2, 2 * kN}));
  ExpectSameLosses(part2_log.losses, LossesOf(python_losses, kN + 1, 2 * kN), kLossRelTol,
                   "part 2 (C++, 3 ranks)");
  const std::map<int64_t, double> part3_losses = MirrorLosses(part3.output);
  EXPECT_EQ(part3_losses.size(), static_cast<size_t>(kN)) << part3.output;
  ExpectSameLosses(LossesOf(part3_losses, 2 * kN + 1, 3 * kN),
                   LossesOf(python_losses, 2 * kN + 1, 3 * kN), kLossRelTol, "part 3 (Python)");

  const DcpState python_state = ReadDcp(dir + "/python_step" + n3);
  const DcpState cpp_state = ReadDcp(dir + "/cpp_step" + n3);
  const DcpState roundtrip_state = ReadDcp(dir + "/roundtrip_step" + n3);
  EXPECT_EQ(python_state.step, 3 * kN);
  EXPECT_EQ(python_state.seed, 0);
  ExpectSameState(cpp_state, python_state, "uninterrupted: trainer vs Python");
  ExpectSameState(roundtrip_state, python_state, "Python -> C++ -> Python vs Python");
  // The C++ part exported the step it reached.
  const DcpState part2_state = ReadDcp(dir + "/cpp_step" + n2);
  EXPECT_EQ(part2_state.step, 2 * kN);
  EXPECT_EQ(part2_state.seed, 0);
}

// A run started from --import-dcp that loses a rank restarts (--max-restarts)
// from its own newest checkpoint, not from the imported one, which is older:
// the steps after the restart have the losses of an uninterrupted run from
// the same import.
TEST(TrainerDcpRoundTrip, RestartedRanksResumeTheirCheckpointNotTheImport) {
  constexpr int64_t kImportStep = 4, kSteps = 300;
  const std::string dir = TempDir("dcp_import_restart");
  const std::string imported = dir + "/imported";
  RunResult exported = RunTrainer(kTrainerOnly + kShared + "--nproc 2 --steps " +
                                  std::to_string(kImportStep) + " --export-dcp " + imported);
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  const std::string run = kTrainerOnly + kShared + "--nproc 2 --steps " + std::to_string(kSteps) +
                          " --import-dcp " + imported;
  RunResult uninterrupted = RunTrainer(run + " --log-json " + dir + "/want.jsonl");
  ASSERT_EQ(uninterrupted.exit_code, 0) << uninterrupted.output;
  const testing::StepLog want = ReadLog(dir + "/want.jsonl", 2);
  ASSERT_EQ(want.losses.size(), static_cast<size_t>(kSteps - kImportStep));

  const std::string log = dir + "/log.jsonl";
  const pid_t trainer = testing::StartTrainer(run + " --checkpoint-every 10 --checkpoint-dir " +
                                                  dir + "/ckpt --max-restarts 1 --log-json " + log,
                                              dir + "/out.txt");
  std::vector<pid_t> ranks;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(90);
  while (std::chrono::steady_clock::now() < deadline) {
    ranks = testing::ChildrenOf(trainer);
    const auto steps = testing::LoggedSteps(log);
    if (ranks.size() == 2 && !steps.empty() && steps.back() >= kImportStep + 25) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_LT(std::chrono::steady_clock::now(), deadline) << testing::ReadAll(dir + "/out.txt");
  ASSERT_EQ(kill(ranks[1], SIGKILL), 0);
  ASSERT_EQ(testing::WaitExit(trainer), 0) << testing::ReadAll(dir + "/out.txt");
  const std::string output = testing::ReadAll(dir + "/out.txt");
  EXPECT_THAT(output, HasSubstr("trainer: restart 1: resuming from " + dir + "/ckpt/step_"))
      << output;
  // Imported once, by the first attempt only.
  const std::string continuing = "trainer: continuing from DCP checkpoint " + imported;
  EXPECT_EQ(output.find(continuing), output.rfind(continuing)) << output;
  // The log holds the first attempt's steps, then the resumed ones: the last
  // half match the uninterrupted run.
  const testing::StepLog got = ReadLog(log, 2);
  ASSERT_GE(got.losses.size(), want.losses.size());
  EXPECT_EQ(got.steps.back(), kSteps);
  const size_t tail = want.losses.size() / 2;
  ExpectSameLosses(std::vector<double>(got.losses.end() - tail, got.losses.end()),
                   std::vector<double>(want.losses.end() - tail, want.losses.end()), 1e-6,
                   "after the restart");
}

// The flags' errors name the flag, the directory and what is wrong (a
// checkpoint the trainer exported, so no Python is needed).
TEST(TrainerDcpRoundTrip, ImportAndExportErrors) {
  const std::string dir = TempDir("dcp_errors");
  const std::string small = kTrainerOnly + kShared + "--nproc 1 ";
  const std::string ckpt = dir + "/step2";
  RunResult saved = RunTrainer(small + "--steps 2 --export-dcp " + ckpt);
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  ASSERT_TRUE(fs::exists(ckpt + "/.metadata"));

  auto expect_error = [&](const std::string& args, const std::string& message) {
    RunResult r = RunTrainer(small + args);
    EXPECT_NE(r.exit_code, 0) << args << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(message)) << args;
  };
  expect_error("--steps 4 --seed 1 --import-dcp " + ckpt,
               "--seed=1: --import-dcp='" + ckpt + "' was trained with seed 0");
  expect_error("--steps 2 --import-dcp " + ckpt,
               "--steps=2: --import-dcp='" + ckpt + "' is at step 2");
  expect_error("--steps 4 --import-dcp " + dir + "/none",
               "--import-dcp='" + dir + "/none': no such directory");
  expect_error("--steps 4 --export-dcp " + ckpt,
               "--export-dcp='" + ckpt + "' already holds a DCP checkpoint");
  // The optimizer must be the one the checkpoint was trained with (its
  // small arguments are kTrainerOnly's: the last --optimizer counts).
  expect_error("--steps 4 --optimizer sgd --import-dcp " + ckpt,
               "--import-dcp='" + ckpt +
                   "': its optimizer state has the entries {exp_avg, exp_avg_sq, step}");
  expect_error("--steps 4 --optimizer adam --import-dcp " + ckpt,
               "--import-dcp='" + ckpt +
                   "': 'optim.param_groups.0.decoupled_weight_decay' is True: the checkpoint "
                   "was trained with adamw");
  expect_error("--steps 4 --resume --checkpoint-dir " + dir + "/c --import-dcp " + ckpt,
               "--import-dcp='" + ckpt + "': expected no --resume");

  // Damaged: no .metadata (an interrupted save), a truncated data file.
  const std::string torn = dir + "/torn";
  fs::copy(ckpt, torn);
  fs::remove(torn + "/.metadata");
  expect_error(
      "--steps 4 --import-dcp " + torn,
      "--import-dcp='" + torn + "': " + torn + " is not a torch.distributed.checkpoint directory");
  const std::string truncated = dir + "/truncated";
  fs::copy(ckpt, truncated);
  fs::resize_file(truncated + "/__0_0.distcp", 1000);
  expect_error("--steps 4 --import-dcp " + truncated, "--import-dcp='" + truncated + "': ");

  // And the checkpoint itself continues, on 2 ranks.
  RunResult continued = RunTrainer(kTrainerOnly + kShared + "--nproc 2 --steps 4 --import-dcp " +
                                   ckpt + " --log-json " + dir + "/log.jsonl");
  ASSERT_EQ(continued.exit_code, 0) << continued.output;
  EXPECT_EQ(ReadLog(dir + "/log.jsonl", 2).steps, (std::vector<int64_t>{3, 4}));
}

// What most Python runs save: dcp.save({"model": ..., "optim": ...}) with
// no "trainer" entry, or the model alone. Python re-saves a trainer export
// without it (dcp_to_torch_save, then dcp.save in one process); the trainer
// imports either at step 0 with a line saying so.
TEST(TrainerDcpRoundTrip, ImportsAPythonCheckpointWithoutATrainerEntry) {
  ASSERT_TRUE(PythonHasTorch());
  const std::string dir = TempDir("dcp_no_trainer");
  const std::string small = kTrainerOnly + kShared;
  RunResult saved = RunTrainer(small + "--nproc 1 --steps 2 --export-dcp " + dir + "/exported");
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  const std::string script = dir + "/resave.py";
  std::ofstream(script) << "import sys, torch, torch.distributed.checkpoint as dcp\n"
                           "from torch.distributed.checkpoint.format_utils import "
                           "dcp_to_torch_save\n"
                           "src, out = sys.argv[1], sys.argv[2]\n"
                           "dcp_to_torch_save(src, out + '.pt')\n"
                           "sd = torch.load(out + '.pt', weights_only=False)\n"
                           "assert set(sd) == {'model', 'optim', 'trainer'}, set(sd)\n"
                           "dcp.save({'model': sd['model'], 'optim': sd['optim']}, "
                           "checkpoint_id=out + '_with_optim')\n"
                           "dcp.save({'model': sd['model']}, checkpoint_id=out + '_model_only')\n";
  RunResult resaved = RunShell(
      std::string("'") + kTorchPython + "' " + script + " " + dir + "/exported " + dir + "/python",
      dir + "/python.txt");
  ASSERT_EQ(resaved.exit_code, 0) << resaved.output;

  RunResult fresh = RunTrainer(small + "--nproc 2 --steps 3 --log-json " + dir + "/fresh.jsonl");
  ASSERT_EQ(fresh.exit_code, 0) << fresh.output;
  const testing::StepLog fresh_log = ReadLog(dir + "/fresh.jsonl", 2);
  std::vector<double> second_losses;
  for (const char* kind : {"with_optim", "model_only"}) {
    SCOPED_TRACE(kind);
    const std::string ckpt = dir + "/python_" + kind;
    const std::string log = dir + "/" + kind + ".jsonl";
    RunResult r =
        RunTrainer(small + "--nproc 2 --steps 3 --import-dcp " + ckpt + " --log-json " + log);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_THAT(r.output,
                HasSubstr("trainer: DCP checkpoint " + ckpt +
                          " has no 'trainer' entry (a Python run's): loaded its model" +
                          (std::string(kind) == "with_optim"
                               ? " and optimizer state; starting at step 0"
                               : " (it has no optimizer state: --optimizer=adamw starts fresh); "
                                 "starting at step 0")));
    const testing::StepLog got = ReadLog(log, 2);
    EXPECT_EQ(got.steps, (std::vector<int64_t>{1, 2, 3}));
    // Step 1 starts from the imported (2-step) weights, not from the seed's.
    ASSERT_EQ(got.losses.size(), 3u);
    EXPECT_GT(std::abs(got.losses[0] - fresh_log.losses[0]), 1e-6);
    second_losses.push_back(got.losses[1]);
  }
  // The same weights; only the optimizer state differs: so does step 2.
  EXPECT_GT(std::abs(second_losses[0] - second_losses[1]), 1e-7);
}

}  // namespace
}  // namespace trainer
