// Test-only: run //trainer:trainer (a data dependency of the test) as a
// child process and read its JSON log. Shared by the end-to-end tests.
#pragma once

#include <sys/wait.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "trainer/testing/json_lines.h"

namespace trainer::testing {

struct RunResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

// A fresh (emptied) directory under the test's TEST_TMPDIR.
inline std::string TempDir(const std::string& name) {
  namespace fs = std::filesystem;
  const char* base = std::getenv("TEST_TMPDIR");
  fs::path dir = fs::path(base != nullptr ? base : "/tmp") / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

// `shell_prefix` runs first in the same shell, e.g. "ulimit -d 500000;" to
// impose a limit the trainer and its ranks inherit.
inline RunResult RunTrainer(const std::string& args, const std::string& shell_prefix = "") {
  const std::string out_file = TempDir("out") + "/output.txt";
  const std::string command =
      shell_prefix + " trainer/trainer " + args + " > " + out_file + " 2>&1";
  const int status = std::system(command.c_str());
  RunResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream in(out_file);
  std::stringstream text;
  text << in.rdbuf();
  result.output = text.str();
  return result;
}

struct StepLog {
  std::vector<int64_t> steps;
  std::vector<double> losses;
  // Per step, per rank.
  std::vector<std::vector<double>> sharded_state_bytes;
};

// Reads a --log-json file, checking every line's shape and that it comes
// from `expected_world_size` ranks.
inline StepLog ReadLog(const std::string& path, int expected_world_size) {
  StepLog log;
  for (const std::string& line : ReadLines(path)) {
    auto object = ParseJsonLine(line);
    EXPECT_TRUE(object.has_value()) << "not JSON: " << line;
    if (!object) continue;
    for (const char* key : {"step", "loss", "lr", "step_time_s", "tokens_per_s", "peak_rss_bytes",
                            "sharded_state_bytes", "world_size"}) {
      EXPECT_EQ(object->count(key), 1u) << key << " missing in " << line;
    }
    const auto peak_rss = object->at("peak_rss_bytes").get<std::vector<double>>();
    const auto state = object->at("sharded_state_bytes").get<std::vector<double>>();
    EXPECT_EQ(peak_rss.size(), static_cast<size_t>(expected_world_size));
    EXPECT_EQ(state.size(), static_cast<size_t>(expected_world_size));
    EXPECT_EQ(object->at("world_size").get<int>(), expected_world_size) << line;
    for (double bytes : peak_rss) EXPECT_GT(bytes, 1 << 20);
    for (double bytes : state) EXPECT_GT(bytes, 0);
    EXPECT_GT(object->at("tokens_per_s").get<double>(), 0);
    EXPECT_TRUE(object->at("step").is_number_integer()) << line;
    EXPECT_TRUE(object->at("loss").is_number()) << line;  // null: a non-finite loss
    log.steps.push_back(object->at("step").get<int64_t>());
    log.losses.push_back(object->at("loss").is_number() ? object->at("loss").get<double>()
                                                        : std::nan(""));
    log.sharded_state_bytes.push_back(state);
  }
  return log;
}

inline void ExpectSameLosses(const std::vector<double>& a, const std::vector<double>& b,
                             double rel_tol, const std::string& what = "") {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_LE(std::abs(a[i] - b[i]), rel_tol * std::abs(a[i]))
        << what << ": step index " << i << ": " << a[i] << " vs " << b[i];
  }
}

}  // namespace trainer::testing
