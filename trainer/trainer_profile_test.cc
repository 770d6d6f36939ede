// --profile-step end to end (//trainer:trainer, a data dependency): 3 tiny
// steps on 2 ranks with step 2 profiled on rank 0 leave one Chrome trace
// (JSON with a "traceEvents" list holding aten:: CPU ops and the step's
// ProfilerStep#2 annotation) and no temporary file; a --profile-trace in a
// directory that does not exist fails before step 1, naming the flag.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "trainer/testing/run_trainer.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::RunResult;
using testing::RunTrainer;
using testing::TempDir;

// A one-block transformer: attention and matmuls in the trace, ~2 s a run.
const char kTiny[] =
    "--layers=1 --dim=32 --heads=2 --seq=32 --global-batch=8 --steps=3 --warmup-steps=1 ";

TEST(TrainerProfileTest, WritesOneChromeTraceOfTheStep) {
  const std::string dir = TempDir("profile");
  const std::string trace = dir + "/step2.json";
  RunResult r = RunTrainer(std::string(kTiny) + "--profile-step=2 --profile-trace=" + trace +
                           " --log-json=" + dir + "/log.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("profile: step 2 written to " + trace));
  EXPECT_THAT(r.output, HasSubstr("done: steps 1-3"));
  ASSERT_TRUE(fs::exists(trace)) << r.output;
  EXPECT_FALSE(fs::exists(trace + ".tmp"));
  // Rank 0 only: the directory holds the trace and the log, nothing else.
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    ++files;
    EXPECT_THAT(entry.path().filename().string(), Not(HasSubstr(".tmp")));
  }
  EXPECT_EQ(files, 2);

  std::ifstream in(trace);
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json json =
      nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(json.is_discarded()) << "not JSON: " << trace;
  ASSERT_TRUE(json.contains("traceEvents")) << trace;
  ASSERT_TRUE(json["traceEvents"].is_array());
  int aten_ops = 0;
  bool step_annotation = false;
  for (const nlohmann::json& event : json["traceEvents"]) {
    if (!event.contains("name") || !event["name"].is_string()) continue;
    const std::string name = event["name"].get<std::string>();
    if (name.find("aten::") != std::string::npos) ++aten_ops;
    step_annotation |= name == "ProfilerStep#2";
  }
  EXPECT_GT(aten_ops, 0) << "no aten:: op in " << trace;
  EXPECT_TRUE(step_annotation) << "no ProfilerStep#2 annotation in " << trace;
}

TEST(TrainerProfileTest, ATraceInAMissingDirectoryFailsBeforeStepOne) {
  const std::string dir = TempDir("profile_missing");
  const std::string trace = dir + "/no/such/dir/trace.json";
  RunResult r = RunTrainer(std::string(kTiny) + "--profile-step=2 --profile-trace=" + trace);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--profile-trace='" + trace + "'"));
  EXPECT_THAT(r.output, HasSubstr("expected a file in an existing directory"));
  EXPECT_THAT(r.output, Not(HasSubstr("done:")));
}

TEST(TrainerProfileTest, FlagErrorsNameTheFlag) {
  RunResult r = RunTrainer(std::string(kTiny) + "--profile-step=4 --profile-trace=/tmp/t.json");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--profile-step=4: expected a step <= --steps=3"));
}

}  // namespace
}  // namespace trainer
