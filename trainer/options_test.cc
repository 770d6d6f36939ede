// Flag parsing and validation, and the JSON log line format (no LibTorch:
// these build and run in seconds).
#include "trainer/options.h"

#include "absl/strings/match.h"

#include <limits>
#include <utility>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/json_log.h"
#include "trainer/lr_schedule.h"
#include "trainer/testing/json_lines.h"

namespace trainer {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

absl::StatusOr<Options> Parse(std::vector<std::string> args) { return ParseOptions(args); }

TEST(OptionsTest, DefaultsAreTwoRanksFullShard) {
  auto o = Parse({});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->model, ModelKind::kTransformer);
  EXPECT_EQ(o->data, DataKind::kText);
  EXPECT_EQ(o->nproc, 2);
  EXPECT_FALSE(o->nproc_given);  // a rank then takes the launcher's WORLD_SIZE
  EXPECT_EQ(o->sharding, Sharding::kFull);
  EXPECT_EQ(o->auto_wrap, AutoWrap::kBlock);
  EXPECT_TRUE(CheckFeatureAvailability(*o, 1).ok());
  EXPECT_TRUE(CheckFeatureAvailability(*o, 2).ok());
}

TEST(OptionsTest, ParsesBothSpellingsAndEveryFlag) {
  auto o = Parse({"--model",
                  "mlp",
                  "--data=synthetic",
                  "--steps",
                  "7",
                  "--seed=3",
                  "--global-batch",
                  "12",
                  "--lr=0.5",
                  "--nproc",
                  "3",
                  "--sharding=grad_op",
                  "--mixed-precision",
                  "bf16",
                  "--cpu-offload",
                  "--auto-wrap",
                  "size:1000",
                  "--backward-prefetch=post",
                  "--grad-accum",
                  "2",
                  "--clip",
                  "1.0",
                  "--optimizer",
                  "sgd",
                  "--lr-schedule",
                  "constant",
                  "--warmup-steps",
                  "2",
                  "--layers",
                  "3",
                  "--dim",
                  "48",
                  "--heads",
                  "6",
                  "--vocab",
                  "300",
                  "--seq",
                  "16",
                  "--checkpoint-dir",
                  "/tmp/x",
                  "--checkpoint-every",
                  "5",
                  "--checkpoint-format",
                  "full",
                  "--resume",
                  "--log-json",
                  "log.jsonl"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->model, ModelKind::kMlp);
  EXPECT_EQ(o->data, DataKind::kSynthetic);
  EXPECT_EQ(o->steps, 7);
  EXPECT_EQ(o->seed, 3);
  EXPECT_EQ(o->global_batch, 12);
  EXPECT_DOUBLE_EQ(o->lr, 0.5);
  EXPECT_EQ(o->nproc, 3);
  EXPECT_TRUE(o->nproc_given);
  EXPECT_EQ(o->sharding, Sharding::kGradOp);
  EXPECT_EQ(o->mixed_precision, MixedPrecision::kBf16);
  EXPECT_TRUE(o->cpu_offload);
  EXPECT_EQ(o->auto_wrap, AutoWrap::kSize);
  EXPECT_EQ(o->auto_wrap_min_params, 1000);
  EXPECT_EQ(o->backward_prefetch, BackwardPrefetch::kPost);
  EXPECT_EQ(o->grad_accum, 2);
  EXPECT_DOUBLE_EQ(o->clip, 1.0);
  EXPECT_EQ(o->optimizer, OptimizerKind::kSgd);
  EXPECT_EQ(o->lr_schedule, LrSchedule::kConstant);
  EXPECT_EQ(o->warmup_steps, 2);
  EXPECT_EQ(o->layers, 3);
  EXPECT_EQ(o->dim, 48);
  EXPECT_EQ(o->heads, 6);
  EXPECT_EQ(o->vocab, 300);
  EXPECT_EQ(o->seq, 16);
  EXPECT_EQ(o->checkpoint_dir, "/tmp/x");
  EXPECT_EQ(o->checkpoint_every, 5);
  EXPECT_EQ(o->checkpoint_format, CheckpointFormat::kFull);
  EXPECT_TRUE(o->resume);
  EXPECT_EQ(o->log_json, "log.jsonl");

  // ToArgs round-trips: what the ranks re-parse is what the parent parsed.
  auto again = ParseOptions(ToArgs(*o));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(ToArgs(*again), ToArgs(*o));
}

struct BadFlag {
  std::vector<std::string> args;
  std::vector<std::string> message_parts;
};

class BadFlagTest : public ::testing::TestWithParam<BadFlag> {};

TEST_P(BadFlagTest, NamesFlagValueAndExpectation) {
  auto o = ParseOptions(GetParam().args);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  for (const std::string& part : GetParam().message_parts) {
    EXPECT_THAT(std::string(o.status().message()), HasSubstr(part));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Flags, BadFlagTest,
    ::testing::Values(
        BadFlag{{"--model", "cnn"}, {"--model='cnn'", "mlp|transformer"}},
        BadFlag{{"--steps=0"}, {"--steps='0'", "integer >= 1"}},
        BadFlag{{"--steps=ten"}, {"--steps='ten'", "an integer"}},
        BadFlag{{"--lr=-1"}, {"--lr='-1'", "> 0"}}, BadFlag{{"--lr=nan"}, {"--lr='nan'", "finite"}},
        BadFlag{{"--sharding=zero3"}, {"--sharding='zero3'", "full|grad_op|none|hybrid"}},
        BadFlag{{"--auto-wrap=size:x"}, {"--auto-wrap='size:x'", "size:N"}},
        BadFlag{{"--cpu-offload=maybe"}, {"--cpu-offload='maybe'", "true|false"}},
        BadFlag{{"--optimizer", "lamb"}, {"--optimizer='lamb'", "adam|adamw|sgd"}},
        BadFlag{{"--checkpoint-format=zip"}, {"--checkpoint-format='zip'", "sharded|full"}},
        BadFlag{{"--global_batch=4"}, {"unknown flag --global_batch"}},
        BadFlag{{"steps"}, {"unexpected argument 'steps'"}},
        BadFlag{{"--steps"}, {"--steps: missing value"}},
        BadFlag{{"--dim=30", "--heads=4"}, {"--heads=4", "divisor of --dim=30"}},
        BadFlag{{"--vocab=100"}, {"--vocab=100", ">= 256", "--data=text"}},
        BadFlag{{"--resume"}, {"--resume", "--checkpoint-dir"}},
        BadFlag{{"--checkpoint-every=5"}, {"--checkpoint-every=5", "--checkpoint-dir"}}));

TEST(OptionsTest, FaultFlags) {
  auto o = ParseOptions(
      {"--timeout", "2.5", "--max-restarts=3", "--keep-last", "2", "--checkpoint-dir", "/tmp/x"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->timeout_s, 2.5);
  EXPECT_EQ(o->max_restarts, 3);
  EXPECT_EQ(o->keep_last, 2);
  // The ranks get --timeout and --keep-last; restarting is the launcher's.
  const std::vector<std::string> args = ToArgs(*o);
  EXPECT_THAT(args, ::testing::Contains("--timeout=2.5"));
  EXPECT_THAT(args, ::testing::Contains("--keep-last=2"));
  auto again = ParseOptions(args);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->timeout_s, 2.5);
  EXPECT_EQ(again->keep_last, 2);
  EXPECT_EQ(again->max_restarts, 0);
  auto defaults = ParseOptions({});
  ASSERT_TRUE(defaults.ok());
  EXPECT_EQ(defaults->timeout_s, 0);  // the launcher's, else 10 minutes
  EXPECT_EQ(defaults->keep_last, 0);

  auto message = [](std::vector<std::string> args) {
    return std::string(ParseOptions(args).status().message());
  };
  EXPECT_THAT(message({"--timeout", "0"}), HasSubstr("--timeout='0': expected a number > 0"));
  EXPECT_THAT(message({"--timeout", "nan"}), HasSubstr("--timeout='nan'"));
  EXPECT_THAT(message({"--timeout", "1e9"}), HasSubstr("(0, 1e7]"));
  EXPECT_THAT(message({"--max-restarts", "-1"}), HasSubstr("--max-restarts='-1'"));
  EXPECT_THAT(message({"--keep-last", "-2"}), HasSubstr("--keep-last='-2'"));
  EXPECT_THAT(message({"--keep-last", "2"}), HasSubstr("expected --checkpoint-dir"));
}

TEST(OptionsTest, AsyncCheckpointFlag) {
  auto o = ParseOptions({"--async-checkpoint", "--checkpoint-dir", "/tmp/x"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->async_checkpoint);
  auto again = ParseOptions(ToArgs(*o));  // the ranks get it
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->async_checkpoint);
  auto defaults = ParseOptions({});
  ASSERT_TRUE(defaults.ok());
  EXPECT_FALSE(defaults->async_checkpoint);
  EXPECT_THAT(std::string(ParseOptions({"--async-checkpoint"}).status().message()),
              HasSubstr("--async-checkpoint: expected --checkpoint-dir"));
  EXPECT_THAT(
      std::string(
          ParseOptions({"--async-checkpoint=maybe", "--checkpoint-dir=/tmp/x"}).status().message()),
      HasSubstr("--async-checkpoint='maybe'"));
}

TEST(OptionsTest, ProfileFlags) {
  auto o = ParseOptions({"--steps=5", "--profile-step", "3", "--profile-trace=/tmp/step3.json"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->profile_step, 3);
  EXPECT_EQ(o->profile_trace, "/tmp/step3.json");
  auto again = ParseOptions(ToArgs(*o));  // the ranks get both (rank 0 profiles)
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->profile_step, 3);
  EXPECT_EQ(again->profile_trace, "/tmp/step3.json");
  auto defaults = ParseOptions({});
  ASSERT_TRUE(defaults.ok());
  EXPECT_EQ(defaults->profile_step, 0);  // off
  EXPECT_THAT(ToArgs(*defaults), ::testing::Not(::testing::Contains(HasSubstr("--profile"))));
  // The last step may be profiled.
  EXPECT_TRUE(ParseOptions({"--steps=5", "--profile-step=5", "--profile-trace=t.json"}).ok());
  EXPECT_TRUE(ParseOptions({"--profile-step=0"}).ok());

  auto message = [](std::vector<std::string> args) {
    const absl::Status s = ParseOptions(args).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    return std::string(s.message());
  };
  EXPECT_EQ(message({"--profile-step=2"}),
            "--profile-step=2: expected --profile-trace PATH to say where the trace goes");
  EXPECT_EQ(message({"--profile-trace=/tmp/t.json"}),
            "--profile-trace='/tmp/t.json': expected --profile-step N (N >= 1) to say which step "
            "to profile");
  EXPECT_EQ(message({"--profile-trace=/tmp/t.json", "--profile-step=0"}),
            "--profile-trace='/tmp/t.json': expected --profile-step N (N >= 1) to say which step "
            "to profile");
  EXPECT_EQ(message({"--steps=3", "--profile-step=4", "--profile-trace=t.json"}),
            "--profile-step=4: expected a step <= --steps=3 (that step would never run)");
  EXPECT_THAT(message({"--profile-step=-1", "--profile-trace=t.json"}),
              HasSubstr("--profile-step='-1'"));
  EXPECT_THAT(message({"--profile-step=two", "--profile-trace=t.json"}),
              HasSubstr("--profile-step='two'"));
  EXPECT_EQ(message({"--profile-step=2", "--profile-trace="}),
            "--profile-trace='': expected a value");
  EXPECT_EQ(message({"--profile-step=2", "--profile-trace", ""}),
            "--profile-trace='': expected a file path");
}

TEST(OptionsTest, DcpFlags) {
  auto o = ParseOptions({"--import-dcp", "/tmp/py_step3", "--export-dcp=/tmp/cpp_step6"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->import_dcp, "/tmp/py_step3");
  EXPECT_EQ(o->export_dcp, "/tmp/cpp_step6");
  auto again = ParseOptions(ToArgs(*o));  // the ranks get both
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->import_dcp, "/tmp/py_step3");
  EXPECT_EQ(again->export_dcp, "/tmp/cpp_step6");
  auto defaults = ParseOptions({});
  ASSERT_TRUE(defaults.ok());
  EXPECT_EQ(defaults->import_dcp, "");
  EXPECT_EQ(defaults->export_dcp, "");
  EXPECT_THAT(ToArgs(*defaults), ::testing::Not(::testing::Contains(HasSubstr("-dcp"))));
  // Either flag alone, and with checkpoints of the trainer's own format.
  EXPECT_TRUE(ParseOptions({"--export-dcp", "/tmp/a", "--checkpoint-dir", "/tmp/c"}).ok());
  EXPECT_TRUE(ParseOptions({"--import-dcp", "/tmp/a", "--checkpoint-dir", "/tmp/c"}).ok());

  auto message = [](std::vector<std::string> args) {
    const absl::Status s = ParseOptions(args).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    return std::string(s.message());
  };
  EXPECT_EQ(message({"--import-dcp", "/tmp/a", "--resume", "--checkpoint-dir", "/tmp/c"}),
            "--import-dcp='/tmp/a': expected no --resume (a run starts from one of the two: the "
            "DCP directory, or --checkpoint-dir's newest checkpoint)");
  EXPECT_THAT(message({"--import-dcp", "/tmp/a", "--export-dcp", "/tmp/a"}),
              AllOf(HasSubstr("--export-dcp='/tmp/a'"), HasSubstr("other than --import-dcp's")));
  EXPECT_EQ(message({"--import-dcp="}), "--import-dcp='': expected a value");
  EXPECT_EQ(message({"--export-dcp", ""}), "--export-dcp='': expected a directory path");
  EXPECT_EQ(message({"--import-dcp"}), "--import-dcp: missing value (expected DIR)");
}

TEST(OptionsTest, LlamaFlagsAndTheirRefusals) {
  auto message = [](std::vector<std::string> args) {
    return std::string(ParseOptions(args).status().message());
  };
  EXPECT_THAT(message({"--model=llama"}), HasSubstr("expected --hf-checkpoint DIR"));
  EXPECT_THAT(message({"--model=llama", "--hf-checkpoint=a", "--model-config=b.json"}),
              HasSubstr("not both"));
  EXPECT_EQ(message({"--model=llama", "--hf-checkpoint=a", "--vocab=300"}),
            "--vocab: --model=llama takes its shape from its config.json (--hf-checkpoint or "
            "--model-config); expected no --vocab");
  EXPECT_EQ(message({"--hf-checkpoint=a"}),
            "--hf-checkpoint='a': expected --model=llama, got --model=transformer");
  EXPECT_EQ(message({"--export-hf=a"}),
            "--export-hf='a': expected --model=llama, got --model=transformer");
  EXPECT_THAT(message({"--model=llama", "--hf-checkpoint=a", "--export-hf=a"}),
              HasSubstr("other than --hf-checkpoint's"));
  EXPECT_THAT(message({"--model=llama", "--hf-checkpoint=a", "--export-hf-dtype=fp8"}),
              HasSubstr("expected one of float32|bfloat16"));
  // The flags round-trip to the ranks' command line, without the shape
  // flags the config gives.
  auto parsed = ParseOptions({"--model=llama", "--hf-checkpoint=ckpt", "--export-hf=out",
                              "--export-hf-dtype=bfloat16", "--export-hf-max-shard-bytes=1000"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const std::vector<std::string> args = ToArgs(*parsed);
  for (const std::string& arg : args) EXPECT_FALSE(absl::StartsWith(arg, "--dim=")) << arg;
  auto again = ParseOptions(args);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->hf_checkpoint, "ckpt");
  EXPECT_EQ(again->export_hf, "out");
  EXPECT_EQ(again->export_hf_dtype, ExportDtype::kBf16);
  EXPECT_EQ(again->export_hf_max_shard_bytes, 1000);
}

TEST(OptionsTest, CommandLineDetails) {
  auto message = [](std::vector<std::string> args) {
    return std::string(ParseOptions(args).status().message());
  };
  EXPECT_EQ(message({"--model", "cnn"}), "--model='cnn': expected one of mlp|transformer|llama");
  EXPECT_EQ(message({"--seed=-1"}), "--seed='-1': expected an integer >= 0");
  EXPECT_EQ(message({"--nproc=2000"}), "--nproc='2000': expected an integer in [1, 1024]");
  EXPECT_EQ(message({"--steps"}), "--steps: missing value (expected N)");
  EXPECT_EQ(message({"--activation-checkpointing=all"}),
            "--activation-checkpointing='all': expected one of none|block");
  EXPECT_EQ(message({"--auto-wrap=size:0"}),
            "--auto-wrap='size:0': expected block|none|size:N with N a positive parameter count");
  EXPECT_EQ(message({"--log-json", ""}), "--log-json='': expected a file path");
  // "--flag=" is not the bare flag: it would take the next argument.
  EXPECT_EQ(message({"--checkpoint-dir=", "--resume"}), "--checkpoint-dir='': expected a value");
  EXPECT_EQ(message({"--resume=", "--checkpoint-dir=/tmp/x"}), "--resume='': expected a value");
  EXPECT_THAT(message({"--bogus="}), HasSubstr("unknown flag --bogus"));
  EXPECT_THAT(message({"--steps=1", "--", "x"}), HasSubstr("unexpected argument '--'"));
  EXPECT_THAT(message({"-x"}), HasSubstr("unexpected argument '-x'"));

  auto o = Parse({"--steps=3", "--steps", "010", "--lr=0.1", "--auto-wrap=size:+7"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->steps, 10);  // the last one, and decimal
  EXPECT_EQ(o->lr, 0.1);    // exactly
  EXPECT_EQ(o->auto_wrap_min_params, 7);
  auto defaults = ParseOptions(ToArgs(Options{}));
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->lr, Options{}.lr);  // what ranks re-parse is bit-identical

  // --help skips the checks between flags (the flags themselves are checked).
  for (const char* help : {"-h", "--help"}) {
    auto h = Parse({help, "--resume"});
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_TRUE(h->help);
  }
}

TEST(OptionsTest, UsageListsEveryFlagWithItsDefault) {
  const std::string usage = Usage();
  std::vector<std::string> args = ToArgs(Options{});
  for (const char* more :
       {"--timeout", "--max-restarts", "--checkpoint-dir", "--log-json", "--help"}) {
    args.push_back(more);
  }
  for (const std::string& arg : args) {
    EXPECT_THAT(usage, HasSubstr(arg.substr(0, arg.find('=')) + " ")) << usage;
  }
  EXPECT_THAT(usage, HasSubstr("--sharding full|grad_op|none|hybrid=full"));
  EXPECT_THAT(usage, HasSubstr("--steps N=450"));
  EXPECT_THAT(usage, HasSubstr("--auto-wrap block|size:N|none=block"));
}

TEST(OptionsTest, GlobalBatchMustSplitOverRanksAndMicroBatches) {
  auto o = Parse({"--global-batch=6"});
  ASSERT_TRUE(o.ok());
  EXPECT_TRUE(CheckFeatureAvailability(*o, 3).ok());
  absl::Status s = CheckFeatureAvailability(*o, 4);
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("--global-batch=6"), HasSubstr("world size 4")));
  o->grad_accum = 4;
  s = CheckFeatureAvailability(*o, 1);
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("--global-batch=6"), HasSubstr("--grad-accum=4")));
}

TEST(OptionsTest, FsdpFlagsAreAcceptedOnAnyWorldSize) {
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"--sharding=full"},
                                             {"--sharding=grad_op"},
                                             {"--sharding=none"},
                                             {"--mixed-precision=bf16"},
                                             {"--cpu-offload"},
                                             {"--auto-wrap=size:100"},
                                             {"--auto-wrap=none"},
                                             {"--backward-prefetch=none"},
                                             {"--backward-prefetch=post"}}) {
    auto o = Parse(args);
    ASSERT_TRUE(o.ok()) << o.status();
    for (int world : {1, 2, 4}) {
      EXPECT_TRUE(CheckFeatureAvailability(*o, world).ok()) << args[0] << " on " << world;
    }
  }
}

TEST(OptionsTest, HybridNeedsATwoDimensionalMesh) {
  EXPECT_EQ(*HybridMeshShape(4), std::make_pair(int64_t{2}, int64_t{2}));
  EXPECT_EQ(*HybridMeshShape(6), std::make_pair(int64_t{2}, int64_t{3}));
  EXPECT_EQ(*HybridMeshShape(8), std::make_pair(int64_t{2}, int64_t{4}));
  EXPECT_EQ(*HybridMeshShape(9), std::make_pair(int64_t{3}, int64_t{3}));
  // 420 splits over 1..7 ranks, so only the mesh can be the problem.
  auto o = Parse({"--sharding=hybrid", "--global-batch=420"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(CheckFeatureAvailability(*o, 4).ok());
  for (int world : {1, 2, 3, 5, 7}) {
    absl::Status s = CheckFeatureAvailability(*o, world);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << world;
    EXPECT_THAT(std::string(s.message()),
                AllOf(HasSubstr("--sharding=hybrid with " + std::to_string(world) + " rank"),
                      HasSubstr("2-D mesh"), HasSubstr("--nproc=4 gives 2x2")));
  }
}

TEST(LrScheduleTest, WarmupThenConstantOrCosineToZero) {
  Options o;
  o.lr = 0.01;
  o.steps = 110;
  o.warmup_steps = 10;
  o.lr_schedule = LrSchedule::kCosine;
  EXPECT_DOUBLE_EQ(LearningRate(o, 1), 0.001);
  EXPECT_DOUBLE_EQ(LearningRate(o, 10), 0.01);
  EXPECT_DOUBLE_EQ(LearningRate(o, 60), 0.005);  // halfway through the decay
  EXPECT_NEAR(LearningRate(o, 110), 0.0, 1e-15);
  for (int64_t s = 11; s <= 110; ++s) EXPECT_LT(LearningRate(o, s), LearningRate(o, s - 1) + 1e-15);
  o.lr_schedule = LrSchedule::kConstant;
  EXPECT_DOUBLE_EQ(LearningRate(o, 5), 0.005);
  EXPECT_DOUBLE_EQ(LearningRate(o, 11), 0.01);
  EXPECT_DOUBLE_EQ(LearningRate(o, 110), 0.01);
  o.warmup_steps = 0;
  EXPECT_DOUBLE_EQ(LearningRate(o, 1), 0.01);
  // Warmup longer than the run: still warming up at the end, no error.
  o.warmup_steps = 500;
  o.lr_schedule = LrSchedule::kCosine;
  EXPECT_DOUBLE_EQ(LearningRate(o, 110), 0.01 * 110 / 500);
}

TEST(JsonLogTest, LineIsJsonWithTheDocumentedKeys) {
  StepRecord r{12, 3.25, 0.003, 0.5, 2048.0, {1000, 2000}, {30, 40}, {}, {}, {}};
  const std::string line = FormatJsonLine(r);
  // The documented key order; doubles in their shortest exact form.
  EXPECT_EQ(line,
            "{\"step\":12,\"loss\":3.25,\"lr\":0.003,\"step_time_s\":0.5,"
            "\"tokens_per_s\":2048.0,\"peak_rss_bytes\":[1000,2000],"
            "\"sharded_state_bytes\":[30,40],\"world_size\":2}");
  auto parsed = testing::ParseJsonLine(line);
  ASSERT_TRUE(parsed.has_value()) << line;
  EXPECT_EQ(parsed->at("step").get<int64_t>(), 12);
  EXPECT_EQ(parsed->at("loss").get<double>(), 3.25);
  EXPECT_EQ(parsed->at("lr").get<double>(), 0.003);
  EXPECT_EQ(parsed->at("step_time_s").get<double>(), 0.5);
  EXPECT_EQ(parsed->at("tokens_per_s").get<double>(), 2048.0);
  EXPECT_EQ(parsed->at("peak_rss_bytes").get<std::vector<double>>(),
            (std::vector<double>{1000, 2000}));
  EXPECT_EQ(parsed->at("sharded_state_bytes").get<std::vector<double>>(),
            (std::vector<double>{30, 40}));
  EXPECT_EQ(parsed->at("world_size").get<int64_t>(), 2);

  // A loss reads back bit for bit.
  r.loss = 0.1 + 0.2;
  parsed = testing::ParseJsonLine(FormatJsonLine(r));
  ASSERT_TRUE(parsed.has_value());
  EXPECT_EQ(parsed->at("loss").get<double>(), 0.1 + 0.2);

  r.loss = std::numeric_limits<double>::quiet_NaN();
  parsed = testing::ParseJsonLine(FormatJsonLine(r));
  ASSERT_TRUE(parsed.has_value());
  EXPECT_TRUE(parsed->at("loss").is_null());

  EXPECT_FALSE(testing::ParseJsonLine("{\"a\": 1} x").has_value());
  EXPECT_FALSE(testing::ParseJsonLine("{\"a\": nan}").has_value());
  EXPECT_FALSE(testing::ParseJsonLine("{\"a\": 1, \"a\": 2}").has_value());
  EXPECT_FALSE(testing::ParseJsonLine("{\"a\": {\"b\": 1}}").has_value());
  EXPECT_FALSE(testing::ParseJsonLine("{\"a\": \"text\"}").has_value());
  EXPECT_FALSE(testing::ParseJsonLine("[1, 2]").has_value());
}

TEST(JsonLogTest, PeakRssIsPlausible) {
  const int64_t rss = PeakRssBytes();
  EXPECT_GT(rss, 1 << 20);           // a running gtest binary: > 1 MiB
  EXPECT_LT(rss, int64_t{1} << 36);  // and < 64 GiB
}

}  // namespace
TEST(OptionsTest, DataEvalAndNonFiniteFlags) {
  auto o = ParseOptions({"--data", "/tmp/corpus.bin", "--data-format=tokens", "--eval-every", "5",
                         "--allow-nonfinite-import"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->data, DataKind::kFile);
  EXPECT_EQ(o->data_path, "/tmp/corpus.bin");
  EXPECT_EQ(o->data_format, DataFormat::kTokens);
  EXPECT_EQ(o->eval_every, 5);
  EXPECT_TRUE(o->allow_nonfinite_import);
  auto again = ParseOptions(ToArgs(*o));  // the ranks get every one
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(ToArgs(*again), ToArgs(*o));
  EXPECT_EQ(again->data_path, "/tmp/corpus.bin");
  EXPECT_TRUE(again->allow_nonfinite_import);
  auto text = ParseOptions({"--data", "text"});
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(text->data, DataKind::kText);
  EXPECT_EQ(text->data_path, "");
  auto file_named_text = ParseOptions({"--data", "./text"});
  ASSERT_TRUE(file_named_text.ok());
  EXPECT_EQ(file_named_text->data, DataKind::kFile);

  auto message = [](std::vector<std::string> args) {
    const absl::Status s = ParseOptions(args).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    return std::string(s.message());
  };
  EXPECT_EQ(message({"--data="}), "--data='': expected a value");
  EXPECT_THAT(message({"--data-format=bytes"}),
              AllOf(HasSubstr("--data-format=bytes"), HasSubstr("expected --data PATH")));
  EXPECT_THAT(message({"--data-format=words", "--data=/x"}),
              HasSubstr("--data-format='words': expected one of auto|bytes|tokens"));
  EXPECT_THAT(message({"--eval-every=3", "--data=synthetic"}),
              AllOf(HasSubstr("--eval-every=3"), HasSubstr("--data text or PATH")));
  EXPECT_THAT(message({"--eval-every=-1"}), HasSubstr("--eval-every='-1'"));
}

TEST(OptionsTest, TokenizerFlagAndTheLayoutsItTakes) {
  for (const char* format : {"auto", "text"}) {
    auto o = ParseOptions({"--data=corpus.txt", "--tokenizer", "tok.json", "--vocab=4096",
                           std::string("--data-format=") + format});
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->tokenizer, "tok.json");
    auto again = ParseOptions(ToArgs(*o));  // what the ranks are given
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->tokenizer, "tok.json");
    EXPECT_EQ(ToArgs(*again), ToArgs(*o));
  }
  EXPECT_EQ(ParseOptions({}).value().tokenizer, "");

  auto message = [](std::vector<std::string> args) {
    const absl::Status s = ParseOptions(args).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    return std::string(s.message());
  };
  EXPECT_EQ(message({"--tokenizer=t.json"}),
            "--tokenizer='t.json': expected --data PATH, a text file to encode (got --data=text)");
  EXPECT_EQ(message({"--tokenizer=t.json", "--data=synthetic"}),
            "--tokenizer='t.json': expected --data PATH, a text file to encode (got "
            "--data=synthetic)");
  EXPECT_EQ(message({"--tokenizer=t.json", "--data=x.bin", "--data-format=tokens"}),
            "--tokenizer='t.json': expected --data-format=auto or text (it encodes text), got "
            "--data-format=tokens (a token file is already encoded: drop --tokenizer)");
  EXPECT_EQ(message({"--tokenizer=t.json", "--data=x.txt", "--data-format=bytes"}),
            "--tokenizer='t.json': expected --data-format=auto or text (it encodes text), got "
            "--data-format=bytes (the bytes are the ids: drop --tokenizer)");
  EXPECT_EQ(message({"--data=x.txt", "--data-format=text"}),
            "--data-format=text: expected --tokenizer FILE, the tokenizer.json to encode it with "
            "(or --data-format=bytes to train on its bytes)");
  EXPECT_EQ(message({"--tokenizer="}), "--tokenizer='': expected a value");
  EXPECT_THAT(Usage(), HasSubstr("--tokenizer FILE"));
  EXPECT_THAT(Usage(), HasSubstr("auto|bytes|tokens|text"));
}

TEST(JsonLogTest, ValLossOnlyWhenEvaluated) {
  StepRecord r{5, 3.0, 0.001, 0.5, 100.0, {1}, {2}, {}, {}, {}};
  EXPECT_THAT(FormatJsonLine(r), ::testing::Not(HasSubstr("val_loss")));
  r.val_loss = 2.5;
  EXPECT_THAT(FormatJsonLine(r),
              HasSubstr(",\"world_size\":1,\"val_loss\":2.5,\"val_perplexity\":12.18249"));
}

}  // namespace trainer
