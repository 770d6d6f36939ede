// A model that does not fit one rank's memory still loads and trains
// (issue 45, item 6): a Llama whose float32 parameters alone exceed the
// memory limit imposed on every process (RLIMIT_DATA, `ulimit -d`: private
// writable memory, what the allocator takes) trains on 4 ranks with
// fully_shard and with FSDP1, built on the meta device and each rank's
// shards allocated (fully_shard: all at once; FSDP1: a unit at a time, whole,
// just before it is sharded) and filled tensor by tensor. The same limit on one rank fails, cleanly
// (exit status 3, an out-of-memory line), which shows the limit binds.
//
// Sizes (2026-11-28, 2 cores): the model below has 590 M parameters,
// 2.36 GB in float32, and the limit is 95% of that. Each of 4 ranks holds a
// quarter of the parameters, of their gradients and of SGD's momentum
// (together 0.75x the parameters' bytes) plus ~300-360 MiB of process and
// FSDP working set (a few gathered layers, their gradients, the
// reduce-scatter buffers): hence many small layers. At 136 layers a rank
// peaked at 96% of the parameters' bytes, too close to any limit below
// them; here ~90%.
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/testing/run_trainer.h"

namespace trainer {
namespace {

using ::testing::HasSubstr;
using testing::ReadLog;
using testing::RunResult;
using testing::RunTrainer;
using testing::TempDir;

// Many small layers: the per-rank working set (a few gathered layers) stays
// small beside the sharded parameters.
constexpr int64_t kHidden = 512, kFfn = 1408, kLayers = 200, kVocab = 512, kKvHeads = 4;

int64_t ParameterCount() {
  const int64_t head_dim = kHidden / 8;
  const int64_t attention = 2 * kHidden * kHidden + 2 * kHidden * kKvHeads * head_dim;
  const int64_t layer = attention + 3 * kHidden * kFfn + 2 * kHidden;
  return kLayers * layer + 2 * kVocab * kHidden + kHidden;
}

std::string WriteConfig() {
  const std::string path = TempDir("memory_limit_config") + "/config.json";
  std::ofstream(path) << R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",)"
                      << R"("vocab_size": )" << kVocab << R"(, "hidden_size": )" << kHidden
                      << R"(, "intermediate_size": )" << kFfn << R"(, "num_hidden_layers": )"
                      << kLayers << R"(, "num_attention_heads": 8, "num_key_value_heads": )"
                      << kKvHeads
                      << R"(, "max_position_embeddings": 256, "rms_norm_eps": 1e-05,)"
                         R"("rope_theta": 10000.0, "tie_word_embeddings": false,)"
                         R"("torch_dtype": "float32"})";
  return path;
}

// 95% of the float32 parameters: no process may hold them all.
int64_t LimitKb() { return ParameterCount() * 4 * 95 / 100 / 1024; }

std::string Flags(const std::string& config, int nproc, const std::string& fsdp = "fully_shard",
                  int steps = 2) {
  return "--model=llama --model-config=" + config + " --fsdp=" + fsdp +
         " --optimizer=sgd --lr=0.05 --data=synthetic --seq=32"
         " --global-batch=4 --threads-per-rank=1 --steps=" +
         std::to_string(steps) + " --nproc=" + std::to_string(nproc);
}

TEST(TrainerMemoryLimitTest, FourRanksTrainWhatOneRankCannotHold) {
  const std::string config = WriteConfig();
  const std::string limit = "ulimit -d " + std::to_string(LimitKb()) + " &&";
  ASSERT_GT(ParameterCount() * 4, LimitKb() * 1024)
      << "the premise: the parameters exceed the limit";

  const std::string log = TempDir("memory_limit_4") + "/log.jsonl";
  RunResult four = RunTrainer(Flags(config, 4) + " --log-json=" + log, limit);
  ASSERT_EQ(four.exit_code, 0) << four.output;
  EXPECT_THAT(four.output, HasSubstr(std::to_string(ParameterCount()) + " parameters"));
  const auto steps = ReadLog(log, 4);
  ASSERT_EQ(steps.losses.size(), 2u);
  for (double loss : steps.losses) EXPECT_TRUE(std::isfinite(loss));
  // Each rank held a quarter of the parameters, their gradients and
  // momentum: 0.75x the float32 parameters' bytes.
  for (double bytes : steps.sharded_state_bytes.back()) {
    EXPECT_NEAR(bytes, ParameterCount() * 4 * 0.75, ParameterCount() * 4 * 0.02)
        << "a rank's parameters, gradients and momentum";
  }

  // FSDP1 too: built on the meta device, each unit allocated just before
  // it is flattened and sharded (its param_init_fn), then filled. Under this
  // limit it loads and trains one step: the second, with SGD's momentum
  // allocated, goes over. Not for its tensors any more: since the stale
  // gradient shard is freed before forward (issue 47 item 7), a rank's
  // peak of live CPU-allocator bytes is fully_shard's (1760 vs 1747-1752
  // MiB; 2014 before), but tcmalloc's heap grows higher around them (high
  // water 2191-2230 MiB against fully_shard's 1985-2005; 2119-2122 before),
  // over the limit's 2140 MiB (counted per rank, unlimited, 2026-11-28;
  // benchmarks/RESULTS.md).
  const std::string fsdp1_log = TempDir("memory_limit_fsdp1") + "/log.jsonl";
  RunResult fsdp1 = RunTrainer(Flags(config, 4, "fsdp1", 1) + " --log-json=" + fsdp1_log, limit);
  ASSERT_EQ(fsdp1.exit_code, 0) << fsdp1.output;
  const auto fsdp1_steps = ReadLog(fsdp1_log, 4);
  ASSERT_EQ(fsdp1_steps.losses.size(), 1u);
  // The same initial values (from the seed) and batch: the same loss.
  EXPECT_NEAR(fsdp1_steps.losses[0], steps.losses[0], 1e-4);

  // The control: one rank under the same limit cannot even allocate them.
  RunResult one = RunTrainer(Flags(config, 1), limit);
  EXPECT_EQ(one.exit_code, 3) << one.output;
  EXPECT_THAT(one.output, HasSubstr("out of memory"));
}

}  // namespace
}  // namespace trainer
