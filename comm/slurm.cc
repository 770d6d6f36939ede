#include "comm/slurm.h"

#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace comm {
namespace {

const char* env_or_null(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

absl::StatusOr<int> slurm_int(const char* name, const char* fallback_name, int min,
                              const std::string& expected) {
  const char* used = name;
  const char* value = env_or_null(name);
  if (value == nullptr && fallback_name != nullptr) {
    used = fallback_name;
    value = env_or_null(fallback_name);
  }
  if (value == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "environment variable ", name,
        fallback_name != nullptr ? absl::StrCat(" (or ", fallback_name, ")") : std::string(),
        " is not set in this srun task: expected ", expected));
  }
  int parsed = 0;
  if (!absl::SimpleAtoi(value, &parsed) || parsed < min) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", used, "='", value, "': expected ", expected));
  }
  return parsed;
}

}  // namespace

bool is_slurm_task() {
  return env_or_null("RANK") == nullptr && env_or_null("SLURM_STEP_ID") != nullptr &&
         env_or_null("SLURM_PROCID") != nullptr;
}

absl::StatusOr<std::string> first_slurm_host(absl::string_view hostlist) {
  const auto invalid = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("Slurm hostlist '", hostlist, "': ", why,
                                                   " (expected e.g. node[01-04,07],gpu1)"));
  };
  std::string host;
  size_t i = 0;
  while (i < hostlist.size() && hostlist[i] != ',') {
    if (hostlist[i] == ']') return invalid("']' without '['");
    if (hostlist[i] != '[') {
      host += hostlist[i++];
      continue;
    }
    const size_t close = hostlist.find(']', i);
    if (close == absl::string_view::npos) return invalid("'[' without ']'");
    // The group's first element: up to its first ',' or '-'.
    const absl::string_view group = hostlist.substr(i + 1, close - i - 1);
    const absl::string_view first = group.substr(0, group.find_first_of(",-"));
    if (first.empty()) return invalid("an empty range");
    host.append(first.data(), first.size());
    i = close + 1;
  }
  if (host.empty()) return invalid("no host");
  return host;
}

absl::StatusOr<std::optional<RankEnvironment>> slurm_rank_environment() {
  if (!is_slurm_task()) return std::optional<RankEnvironment>();
  RankEnvironment env;
  auto world = slurm_int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", 1, "a positive task count");
  if (!world.ok()) return world.status();
  env.world_size = *world;
  const std::string rank_range = absl::StrCat("a task id in [0, ", env.world_size, ")");
  auto rank = slurm_int("SLURM_PROCID", nullptr, 0, rank_range);
  if (!rank.ok()) return rank.status();
  if (*rank >= env.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable SLURM_PROCID='", *rank, "': expected ", rank_range));
  }
  env.rank = *rank;
  env.local_world_size = env.world_size;
  if (const char* nodes = env_or_null("SLURM_STEP_NUM_NODES")) {
    int count = 0;
    if (absl::SimpleAtoi(nodes, &count) && count > 0 && env.world_size % count == 0) {
      env.local_world_size = env.world_size / count;
    }
  }
  auto local_rank = slurm_int("SLURM_LOCALID", nullptr, 0, "a node-local task id >= 0");
  if (!local_rank.ok()) return local_rank.status();
  env.local_rank = *local_rank;
  if (const char* addr = env_or_null("MASTER_ADDR")) {
    env.master_addr = addr;
  } else {
    const char* list_name = "SLURM_STEP_NODELIST";
    const char* list = env_or_null(list_name);
    if (list == nullptr) {
      list_name = "SLURM_JOB_NODELIST";
      list = env_or_null(list_name);
    }
    if (list == nullptr) {
      return absl::InvalidArgumentError(
          "neither MASTER_ADDR nor SLURM_STEP_NODELIST / SLURM_JOB_NODELIST is set in this "
          "srun task: expected the host of task 0");
    }
    auto host = first_slurm_host(list);
    if (!host.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("environment variable ", list_name, ": ", host.status().message()));
    }
    env.master_addr = *host;
  }
  env.master_port = kSlurmDefaultMasterPort;
  if (const char* port = env_or_null("MASTER_PORT")) {
    if (!absl::SimpleAtoi(port, &env.master_port) || env.master_port <= 0 ||
        env.master_port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("environment variable MASTER_PORT='", port,
                                                     "': expected a TCP port in [1, 65535]"));
    }
  }
  return std::optional<RankEnvironment>(env);
}

}  // namespace comm
