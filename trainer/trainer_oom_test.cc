// Out of memory in a training step (issue 36, item 4): an allocation that
// fails in a step ends Train with a ResourceExhausted status that names the
// step, the device and its memory figures (IsOutOfMemory), the checkpoints
// written before stay complete (the newest resumes and the run continues as
// the uninterrupted one), and the trainer binary exits with
// kExitOutOfMemory, never by an abort. Also --log-json's CUDA memory keys:
// absent on the CPU, lists per rank when set.
//
// The failure is made deterministic two ways:
//   * in process, a CPU allocator that refuses any single allocation above a
//     limit with c10::OutOfMemoryError (what CUDA's caching allocator
//     throws), installed between a first run and its resume: the checkpoint
//     load allocates less than the limit, the resumed step's activations
//     more;
//   * in the trainer binary, LibTorch's own CPU allocator asked for an
//     impossible batch (2^40 rows: about 10^14 bytes), which it refuses with
//     a plain c10::Error ("DefaultCPUAllocator: can't allocate memory").
#include <cstdint>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include "testing/multiprocess.h"
#include "trainer/json_log.h"
#include "trainer/options.h"
#include "trainer/testing/json_lines.h"
#include "trainer/testing/run_trainer.h"
#include "trainer/train.h"

namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Refuses any single allocation above `limit` bytes, as CUDA's caching
// allocator refuses one that does not fit: c10::OutOfMemoryError.
class LimitingAllocator final : public c10::Allocator {
 public:
  LimitingAllocator(c10::Allocator* inner, size_t limit) : inner_(inner), limit_(limit) {}

  c10::DataPtr allocate(size_t n) override {
    TORCH_CHECK_WITH(OutOfMemoryError, n <= limit_, "test allocator: refused ", n, " bytes (limit ",
                     limit_, " bytes)");
    return inner_->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override { return inner_->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    inner_->copy_data(dest, src, count);
  }

 private:
  c10::Allocator* inner_;
  size_t limit_;
};

// The priority both installs and restores with (SetCPUAllocator keeps the
// allocator of the highest priority set so far).
constexpr uint8_t kPriority = 100;

// The MLP at a batch whose tensors (2048 rows x 17 int64 tokens: 272 KiB;
// the embedded window, 2048 x 16 x 8 floats: 1 MiB) are above kLimit, while
// every parameter, gradient, optimizer state and checkpoint tensor is far
// below it.
trainer::Options Small(const std::string& dir) {
  trainer::Options o;
  o.model = trainer::ModelKind::kMlp;
  o.data = trainer::DataKind::kSynthetic;
  o.vocab = 64;
  o.dim = 32;
  o.seq = 16;
  o.global_batch = 2048;
  o.warmup_steps = 2;
  o.steps = 2;
  o.checkpoint_dir = dir + "/ckpt";
  o.checkpoint_every = 1;
  o.log_json = dir + "/log.jsonl";
  return o;
}
constexpr size_t kLimit = 256 * 1024;

TEST(TrainerOutOfMemory, StepFailsClearlyAndTheCheckpointsResume) {
  comm::testing::RunOptions run;
  run.timeout = std::chrono::seconds(240);
  run.collective_timeout = std::chrono::seconds(60);
  comm::testing::RunOnRanks(
      1,
      [](comm::ProcessGroup& pg) {
        const std::string dir = trainer::testing::TempDir("oom");
        const std::string ref_dir = trainer::testing::TempDir("oom_reference");

        // The uninterrupted run, steps 1-4.
        trainer::Options ref = Small(ref_dir);
        ref.steps = 4;
        auto reference = trainer::Train(ref, pg);
        ASSERT_TRUE(reference.ok()) << reference.status();
        ASSERT_EQ(reference->losses.size(), 4u);

        // Steps 1-2, checkpointed after each.
        trainer::Options o = Small(dir);
        auto first = trainer::Train(o, pg);
        ASSERT_TRUE(first.ok()) << first.status();

        // --log-json on the CPU: no CUDA keys (documented in json_log.h).
        for (const std::string& line : trainer::testing::ReadLines(o.log_json)) {
          EXPECT_THAT(line, Not(HasSubstr("cuda_peak")));
        }

        // Resume to step 4 with every allocation above kLimit refused.
        o.steps = 4;
        o.resume = true;
        c10::Allocator* original = c10::GetCPUAllocator();
        LimitingAllocator limited(original, kLimit);
        c10::SetCPUAllocator(&limited, kPriority);
        absl::StatusOr<trainer::TrainResult> failed = absl::UnknownError("not run");
        try {
          failed = trainer::Train(o, pg);
        } catch (const std::exception& e) {
          c10::SetCPUAllocator(original, kPriority);
          FAIL() << "Train threw instead of returning a status: " << e.what();
        }
        c10::SetCPUAllocator(original, kPriority);
        ASSERT_FALSE(failed.ok());
        const absl::Status& s = failed.status();
        EXPECT_TRUE(trainer::IsOutOfMemory(s)) << s;
        EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
        EXPECT_THAT(s.message(), HasSubstr("step 3: out of memory on cpu"));
        EXPECT_THAT(s.message(), HasSubstr("test allocator: refused"));
        EXPECT_THAT(s.message(), HasSubstr("peak RSS of this process"));
        EXPECT_THAT(s.message(), HasSubstr("checkpoints already written are intact"));

        // The newest checkpoint (step 2) resumes, and steps 3-4 are the
        // uninterrupted run's.
        auto resumed = trainer::Train(o, pg);
        ASSERT_TRUE(resumed.ok()) << resumed.status();
        EXPECT_EQ(resumed->first_step, 3);
        ASSERT_EQ(resumed->losses.size(), 2u);
        EXPECT_EQ(resumed->losses[0], reference->losses[2]);
        EXPECT_EQ(resumed->losses[1], reference->losses[3]);
      },
      run);
}

// LibTorch's own CPU allocator, in the trainer binary: an impossible batch
// is refused with a plain c10::Error, which the trainer also reports as out
// of memory (exit status 3, kExitOutOfMemory), naming the step and device.
TEST(TrainerOutOfMemory, BinaryExitsWithTheOutOfMemoryCode) {
  const auto result = trainer::testing::RunTrainer(
      "--model mlp --data synthetic --vocab 64 --dim 32 --seq 16 --steps 2 "
      "--global-batch 1099511627776");
  EXPECT_EQ(result.exit_code, trainer::kExitOutOfMemory) << result.output;
  EXPECT_THAT(result.output, HasSubstr("step 1: out of memory on cpu"));
  EXPECT_THAT(result.output, HasSubstr("can't allocate memory"));
  EXPECT_THAT(result.output, Not(HasSubstr("terminate called")));
}

TEST(TrainerJsonLog, CudaPeaksArePerRankListsWhenSet) {
  trainer::StepRecord r;
  r.step = 7;
  r.peak_rss_bytes = {100, 200};
  r.sharded_state_bytes = {3, 4};
  EXPECT_THAT(trainer::FormatJsonLine(r), Not(HasSubstr("cuda_peak")));
  r.cuda_peak_allocated_bytes = {5000000000, 6};
  r.cuda_peak_reserved_bytes = {7000000000, 8};
  auto parsed = trainer::testing::ParseJsonLine(trainer::FormatJsonLine(r));
  ASSERT_TRUE(parsed.has_value());
  EXPECT_EQ(parsed->at("cuda_peak_allocated_bytes").get<std::vector<int64_t>>(),
            (std::vector<int64_t>{5000000000, 6}));
  EXPECT_EQ(parsed->at("cuda_peak_reserved_bytes").get<std::vector<int64_t>>(),
            (std::vector<int64_t>{7000000000, 8}));
  EXPECT_EQ(parsed->at("world_size").get<int>(), 2);
}

}  // namespace
