// Gloo's threads wake on every message of a collective; this gives them the
// scheduler's shortest slice, so they run at once instead of waiting for a
// rank's compute thread to use up its own. Internal to comm/.
//
// Why: a Gloo collective hands each message through threads that sleep
// between messages (Gloo's TCP loop, c10d's worker threads). On Linux's
// EEVDF scheduler (6.6 and later) a thread that wakes preempts the running
// one only if its virtual deadline comes first; with the default slice
// (0.75 ms or more) a rank's compute thread keeps the core while the message
// waits, and a training step pays that wait on every collective. A custom
// slice (sched_setattr's sched_runtime for SCHED_OTHER, Linux 6.12 and
// later, no privilege needed) of 0.1 ms gives the woken thread the earlier
// deadline. The trainer's small fully_shard step on 2 cores: 0.89x the time
// (benchmarks/RESULTS.md). Older kernels ignore it or refuse it; either way
// nothing changes but the speed.
#pragma once

#include <sys/types.h>

#include <vector>

namespace comm {
namespace internal {

// The threads of this process, by thread id.
std::vector<pid_t> ThreadIds();

// Gives the SCHED_OTHER threads among those in `after` but not in `before`
// (the ones a Gloo process group created) the shortest slice, keeping each
// one's nice value. Best effort: a thread that ended or a kernel that
// refuses is skipped.
void ShortenSlicesOfNewThreads(const std::vector<pid_t>& before, const std::vector<pid_t>& after);

}  // namespace internal
}  // namespace comm
