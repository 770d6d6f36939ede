// Runs the body of a GoogleTest TEST on several real ranks.
//
//   TEST(AllReduce, Sums) {
//     comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
//       auto t = at::full({3}, pg.rank() + 1.0);
//       comm::all_reduce(pg, t).wait();
//       EXPECT_TRUE(t.equal(at::full({3}, 3.0)));
//     });
//   }
//
// In the test process, RunOnRanks re-executes this binary (/proc/self/exe)
// once per rank through launcher::launch with --gtest_filter=<this test>, waits,
// and fails the test with every rank's output when any rank fails, crashes or
// times out. In a rank (recognised by the variable COMM_TESTING_RANK_OF), it
// initialises the world group from the environment, runs `body` (so EXPECT_*
// and ASSERT_* work there as usual), and ends with a barrier, so no rank
// tears down its connections while others still use them.
//
// One RunOnRanks per TEST: each rank re-runs the whole TEST body, so code
// around the call runs in the test process and in every rank, and a second
// call would rendezvous again on the port the first one used and fail. Each
// call costs a process start per rank (~0.3-1 s on 2 cores), so group several
// checks into one body.
//
// It lives in //testing, above the launcher it starts ranks with (comm's own
// tests use it too); its namespace stays comm::testing, as its body is a
// comm::ProcessGroup's.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <string>

#include "comm/process_group.h"

namespace comm {
namespace testing {

struct RunOptions {
  // Limit for the whole run (all ranks); they are killed after it.
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
  // Process-group timeout inside the ranks (bounds every collective).
  std::chrono::milliseconds collective_timeout = std::chrono::seconds(20);
  // Extra environment for the ranks.
  std::map<std::string, std::string> env;
  // When true, the test process does not fail if ranks fail; fault tests
  // inspect `last_exit_code` instead.
  bool expect_failure = false;
  // The barrier each rank runs after the body. Turn off in fault tests where
  // a rank exits or hangs on purpose.
  bool closing_barrier = true;
};

// True inside a rank started by RunOnRanks.
bool IsRankProcess();

// See above. Every rank calls it with the same arguments (the child re-runs
// the TEST body), so `options` apply in the ranks too. Returns the launcher's exit code in the test
// process (0 when all ranks passed) and 0 in a rank.
int RunOnRanks(int world_size, const std::function<void(ProcessGroup&)>& body,
               const RunOptions& options = {});

}  // namespace testing
}  // namespace comm
