#include "comm/internal/gloo_threads.h"

#include <dirent.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>

namespace comm {
namespace internal {
namespace {

// The kernel's struct sched_attr (include/uapi/linux/sched/types.h), which
// glibc does not declare.
struct SchedAttr {
  uint32_t size;
  uint32_t sched_policy;
  uint64_t sched_flags;
  int32_t sched_nice;
  uint32_t sched_priority;
  uint64_t sched_runtime;  // SCHED_OTHER: the slice, in ns (Linux >= 6.12)
  uint64_t sched_deadline;
  uint64_t sched_period;
  uint32_t sched_util_min;
  uint32_t sched_util_max;
};

// The smallest slice the kernel accepts (it clamps to [0.1 ms, 100 ms]).
constexpr uint64_t kSliceNs = 100'000;

}  // namespace

std::vector<pid_t> ThreadIds() {
  std::vector<pid_t> ids;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return ids;
  while (const dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long id = std::strtol(entry->d_name, &end, 10);
    if (end != entry->d_name && *end == '\0' && id > 0) ids.push_back(static_cast<pid_t>(id));
  }
  closedir(dir);
  std::sort(ids.begin(), ids.end());
  return ids;
}

void ShortenSlicesOfNewThreads(const std::vector<pid_t>& before, const std::vector<pid_t>& after) {
  for (pid_t tid : after) {
    if (std::binary_search(before.begin(), before.end(), tid)) continue;
    if (sched_getscheduler(tid) != SCHED_OTHER) continue;
    errno = 0;
    const int nice = getpriority(PRIO_PROCESS, static_cast<id_t>(tid));
    if (errno != 0) continue;  // ended meanwhile
    SchedAttr attr{};
    attr.size = sizeof(attr);
    attr.sched_policy = SCHED_OTHER;
    attr.sched_nice = nice;
    attr.sched_runtime = kSliceNs;
    // Best effort (see the header): a refusal only leaves the default slice.
    (void)syscall(SYS_sched_setattr, tid, &attr, 0u);
  }
}

}  // namespace internal
}  // namespace comm
