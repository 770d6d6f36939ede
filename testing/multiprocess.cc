#include "testing/multiprocess.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "comm/collectives.h"
#include "launcher/launch.h"

namespace comm {
namespace testing {
namespace {

// Set in each rank to the full name of the test it runs.
constexpr const char kRankOfVariable[] = "COMM_TESTING_RANK_OF";
constexpr const char kTimeoutVariable[] = "COMM_TESTING_COLLECTIVE_TIMEOUT_MS";

std::string CurrentTestName() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (info == nullptr) return "";
  return absl::StrCat(info->test_suite_name(), ".", info->name());
}

std::string MessageOf(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return c10_error->what_without_backtrace();
  }
  return e.what();
}

int RunInRank(const std::function<void(ProcessGroup&)>& body, const RunOptions& options) {
  InitOptions init;
  if (const char* ms = std::getenv(kTimeoutVariable)) {
    init.timeout = std::chrono::milliseconds(std::atoll(ms));
  }
  // Ranks start up to seconds apart on a loaded machine: a short collective
  // timeout must not fail the rendezvous.
  init.rendezvous_timeout = std::max(init.timeout, std::chrono::milliseconds(30000));
  auto group = init_process_group(init);
  if (!group.ok()) {
    ADD_FAILURE() << "comm::testing: init_process_group failed in this rank: " << group.status();
    return 0;
  }
  try {
    body(*group);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank " << group->rank() << ": the body threw: " << MessageOf(e);
    // Peers may be blocked in a collective with us: no closing barrier.
    return 0;
  }
  if (::testing::Test::HasFatalFailure() || !options.closing_barrier) return 0;
  // Nobody closes its connections while others still use them.
  try {
    barrier(*group).wait();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank " << group->rank() << ": the closing barrier failed: " << MessageOf(e);
  }
  return 0;
}

}  // namespace

bool IsRankProcess() { return std::getenv(kRankOfVariable) != nullptr; }

int RunOnRanks(int world_size, const std::function<void(ProcessGroup&)>& body,
               const RunOptions& options) {
  if (IsRankProcess()) return RunInRank(body, options);

  const std::string test = CurrentTestName();
  if (test.empty()) {
    ADD_FAILURE() << "comm::testing::RunOnRanks must be called from a TEST body";
    return -1;
  }
  launcher::LaunchOptions launch_options;
  launch_options.nproc_per_node = world_size;
  launch_options.timeout = options.timeout;
  launch_options.kill_grace = std::chrono::milliseconds(2000);
  launch_options.command = {"/proc/self/exe", absl::StrCat("--gtest_filter=", test),
                            "--gtest_also_run_disabled_tests", "--gtest_repeat=1",
                            "--gtest_brief=1"};
  launch_options.env = options.env;
  launch_options.env[kRankOfVariable] = test;
  launch_options.env[kTimeoutVariable] = std::to_string(options.collective_timeout.count());
  // Bazel's test protocol variables belong to this process: a rank writing
  // test.xml or honouring the shard index would clobber or skip the test.
  launch_options.unset_env = {
      "XML_OUTPUT_FILE",     "GTEST_OUTPUT",           "TEST_PREMATURE_EXIT_FILE",
      "GTEST_SHARD_INDEX",   "GTEST_TOTAL_SHARDS",     "TEST_SHARD_INDEX",
      "TEST_TOTAL_SHARDS",   "TEST_SHARD_STATUS_FILE", "GTEST_FILTER",
      "TESTBRIDGE_TEST_ONLY"};
  std::mutex mutex;
  std::string output;
  launch_options.on_line = [&](int rank, bool is_stderr, const std::string& line) {
    std::lock_guard<std::mutex> lock(mutex);
    absl::StrAppend(&output, "[rank ", rank, is_stderr ? " err" : "", "] ", line, "\n");
  };
  auto result = launcher::launch(launch_options);
  if (!result.ok()) {
    ADD_FAILURE() << "comm::testing: could not start the ranks: " << result.status();
    return -1;
  }
  if (result->exit_code != 0 && !options.expect_failure) {
    ADD_FAILURE() << "comm::testing: " << world_size << " ranks of " << test
                  << " failed: " << result->summary << " (exit status " << result->exit_code
                  << ")\n--- rank output ---\n"
                  << output;
  }
  return result->exit_code;
}

}  // namespace testing
}  // namespace comm
