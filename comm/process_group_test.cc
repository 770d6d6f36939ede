// Initialisation from the environment and its errors, and faults: a rank
// that dies or hangs mid-collective makes the others fail within the
// timeout instead of hanging.
#include "comm/process_group.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/collectives.h"
#include "comm/testing/hostile_peer.h"
#include "launcher/launch.h"
#include "testing/multiprocess.h"

namespace comm {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

std::string message(const absl::Status& status) { return std::string(status.message()); }

// Sets the launcher's variables for one test and restores them after.
class EnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : kNames) unsetenv(name);
  }
  void TearDown() override {
    for (const char* name : kNames) unsetenv(name);
  }
  static constexpr const char* kNames[] = {
      "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"};
  void set_env(int rank, int world, int port) {
    setenv("RANK", std::to_string(rank).c_str(), 1);
    setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  }
};

TEST_F(EnvTest, MissingOrMalformedVariablesAreNamed) {
  auto status = init_process_group().status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(message(status), HasSubstr("WORLD_SIZE is not set"));

  set_env(0, 2, 29500);
  setenv("RANK", "abc", 1);
  EXPECT_THAT(message(init_process_group().status()),
              HasSubstr("RANK='abc': expected an integer in [0, WORLD_SIZE=2)"));
  setenv("RANK", "2", 1);
  EXPECT_THAT(message(init_process_group().status()),
              HasSubstr("RANK='2': expected an integer in [0, WORLD_SIZE=2)"));
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "-1", 1);
  EXPECT_THAT(message(init_process_group().status()),
              HasSubstr("WORLD_SIZE='-1': expected a positive integer"));
  setenv("WORLD_SIZE", "4", 1);
  setenv("LOCAL_WORLD_SIZE", "3", 1);
  EXPECT_THAT(message(init_process_group().status()),
              HasSubstr("LOCAL_WORLD_SIZE='3': expected a positive integer dividing "
                        "WORLD_SIZE=4"));
  setenv("LOCAL_WORLD_SIZE", "2", 1);
  setenv("LOCAL_RANK", "2", 1);
  EXPECT_THAT(message(read_rank_environment().status()),
              HasSubstr("LOCAL_RANK='2': expected an integer in [0, LOCAL_WORLD_SIZE=2)"));
  unsetenv("LOCAL_RANK");
  setenv("MASTER_PORT", "70000", 1);
  EXPECT_THAT(message(init_process_group().status()),
              HasSubstr("MASTER_PORT='70000': expected a TCP port in [1, 65535]"));
  unsetenv("MASTER_ADDR");
  EXPECT_THAT(message(init_process_group().status()), HasSubstr("MASTER_ADDR is not set"));

  set_env(3, 4, 29500);
  setenv("LOCAL_WORLD_SIZE", "2", 1);
  auto env = read_rank_environment();
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->local_rank, 1);  // defaults to RANK % LOCAL_WORLD_SIZE
  EXPECT_EQ(env->local_world_size, 2);
}

TEST_F(EnvTest, ExplicitArgumentsAreChecked) {
  InitOptions options;
  options.init_method = "tcp://127.0.0.1:1";
  options.rank = 2;
  options.world_size = 2;
  EXPECT_THAT(message(init_process_group(options).status()),
              HasSubstr("rank=2: expected an integer in [0, world_size=2)"));
  options.rank = 0;
  options.init_method = "tcp://nowhere";
  EXPECT_THAT(message(init_process_group(options).status()),
              HasSubstr("init_method='tcp://nowhere': expected tcp://HOST:PORT"));
  options.init_method = "udp://x";
  EXPECT_THAT(message(init_process_group(options).status()),
              HasSubstr("expected 'env://', 'tcp://HOST:PORT' or 'file:///PATH'"));
  options.init_method = "file://relative";
  EXPECT_THAT(message(init_process_group(options).status()),
              HasSubstr("expected file:///ABSOLUTE/PATH"));
  options.backend = "mpi";
  EXPECT_THAT(message(init_process_group(options).status()),
              HasSubstr("backend 'mpi': expected 'gloo'"));
  options.backend = "nccl";
  auto nccl = init_process_group(options).status();
  // A binary without //comm:nccl has no ProcessGroupNCCL; with it
  // on a machine without a GPU refuses before any rendezvous.
  if (nccl.code() == absl::StatusCode::kUnimplemented) {
    EXPECT_THAT(message(nccl), HasSubstr("does not link //comm:nccl"));
  } else {
    EXPECT_EQ(nccl.code(), absl::StatusCode::kFailedPrecondition) << nccl;
    EXPECT_THAT(message(nccl), HasSubstr("needs a CUDA GPU"));
  }
  EXPECT_THAT(message(nccl), HasSubstr("use backend 'gloo'"));
  // PyTorch's default on CUDA machines: refused the same way, and named.
  options.backend = kGlooCpuNcclCuda;
  auto mixed = init_process_group(options).status();
  EXPECT_EQ(mixed.code(), nccl.code()) << mixed;
  EXPECT_THAT(message(mixed), HasSubstr("use backend 'gloo'"));
  options.backend = "gloo";
  options.timeout = std::chrono::milliseconds(0);
  EXPECT_THAT(message(init_process_group(options).status()), HasSubstr("timeout=0 ms"));
}

TEST_F(EnvTest, UnreachableMasterFailsWithinTimeout) {
  auto port = launcher::pick_free_port();  // nobody listens there
  ASSERT_TRUE(port.ok());
  set_env(1, 2, *port);
  InitOptions options;
  // c10d retries the connection about once a second until the deadline.
  options.timeout = std::chrono::milliseconds(2500);
  const auto start = Clock::now();
  auto status = init_process_group(options).status();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(message(status), HasSubstr("127.0.0.1:" + std::to_string(*port)));
  EXPECT_LT(seconds, 10.0);
}

// Whatever listens on MASTER_PORT, a rank other than 0 ends with an error
// naming it within the rendezvous timeout: garbage (c10d's own client died
// of std::length_error here), silence (c10d's waited forever), and a peer
// that passes the handshake, then answers Gloo's rendezvous with a value
// length of 2^64-1 (the error crosses Gloo's code as an exception).
TEST_F(EnvTest, HostileMasterPortIsAClearErrorWithinTheTimeout) {
  using testing::Answer;
  using testing::HostilePeer;
  using testing::PeerAction;
  using testing::StoreRequest;
  struct Case {
    HostilePeer::Behaviour behaviour;
    absl::StatusCode code;
    std::string says;
  };
  std::vector<Case> cases;
  cases.push_back({HostilePeer::Garbage(std::string(64, '\xff')), absl::StatusCode::kDataLoss,
                   "answered the ping with 0xffffffff"});
  cases.push_back({HostilePeer::Silent(), absl::StatusCode::kDeadlineExceeded,
                   "did not answer the handshake (validate and ping) within 2000 ms"});
  cases.push_back({HostilePeer::Scripted([](const StoreRequest& request) {
                     if (request.query == 4) return Answer(HostilePeer::I64(2));   // add
                     if (request.query == 6) return Answer(std::string(1, '\0'));  // wait
                     if (request.query == 3) return Answer(HostilePeer::U64(~uint64_t{0}));
                     return PeerAction();  // set: no reply
                   }),
                   absl::StatusCode::kDeadlineExceeded,
                   "sent a value length of 18446744073709551615 bytes for key"});
  for (const Case& c : cases) {
    HostilePeer peer(c.behaviour);
    set_env(1, 2, peer.port());
    InitOptions options;
    options.timeout = std::chrono::milliseconds(2000);
    const auto start = Clock::now();
    auto status = init_process_group(options).status();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    EXPECT_EQ(status.code(), c.code) << status;
    EXPECT_THAT(message(status),
                HasSubstr("rendezvous peer 127.0.0.1:" + std::to_string(peer.port())));
    EXPECT_THAT(message(status), HasSubstr(c.says));
    EXPECT_LT(seconds, 2.0 + 1.5) << status;
  }
}

TEST_F(EnvTest, MasterPortInUseIsNamed) {
  // Hold a listening socket on a port, then try to serve the store there.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof addr;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);
  set_env(0, 2, port);
  InitOptions options;
  options.timeout = std::chrono::milliseconds(1500);
  const auto start = Clock::now();
  auto status = init_process_group(options).status();
  close(fd);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(message(status), HasSubstr("port " + std::to_string(port)));
  EXPECT_THAT(message(status), HasSubstr("already in use"));
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 10.0);
}

TEST_F(EnvTest, FileAndTcpInitMethods) {
  const std::string path =
      std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp") +
      "/filestore_" + std::to_string(getpid());
  InitOptions options;
  options.init_method = "file://" + path;
  options.rank = 0;
  options.world_size = 1;
  options.timeout = std::chrono::seconds(10);
  auto pg = init_process_group(options);
  ASSERT_TRUE(pg.ok()) << pg.status();
  EXPECT_EQ(pg->rank(), 0);
  EXPECT_EQ(pg->size(), 1);
  EXPECT_EQ(pg->backend(), "gloo");
  EXPECT_EQ(pg->global_ranks(), std::vector<int>{0});
  at::Tensor t = at::ones({3});
  all_reduce(*pg, t).wait();
  EXPECT_TRUE(t.equal(at::ones({3})));
}

TEST(ProcessGroupOnRanks, EnvInitGivesRanksAndTimeout) {
  testing::RunOptions options;
  options.collective_timeout = std::chrono::seconds(7);
  testing::RunOnRanks(
      2,
      [](ProcessGroup& pg) {
        EXPECT_EQ(pg.size(), 2);
        EXPECT_EQ(pg.rank(), std::atoi(std::getenv("RANK")));
        EXPECT_EQ(pg.global_rank(), pg.rank());
        EXPECT_TRUE(pg.is_member());
        EXPECT_EQ(pg.name(), "0");
        EXPECT_EQ(pg.timeout(), std::chrono::seconds(7));
        EXPECT_TRUE(pg.c10d_group().defined());
      },
      options);
}

// The kernel's struct sched_attr.
struct SchedAttr {
  uint32_t size, policy;
  uint64_t flags;
  int32_t nice;
  uint32_t priority;
  uint64_t runtime, deadline, period;
  uint32_t util_min, util_max;
};

// The slice of thread `tid` in ns (sched_getattr's sched_runtime), or -1.
int64_t slice_of(pid_t tid) {
  SchedAttr attr{};
  if (syscall(SYS_sched_getattr, tid, &attr, sizeof(attr), 0u) != 0) return -1;
  return static_cast<int64_t>(attr.runtime);
}

// Whether a thread can set itself a 0.1 ms slice (Linux 6.12 and later).
bool kernel_has_custom_slices() {
  bool has = false;
  std::thread([&has] {
    SchedAttr attr{};
    attr.size = sizeof(attr);
    attr.runtime = 100'000;
    const pid_t self = static_cast<pid_t>(syscall(SYS_gettid));
    has = syscall(SYS_sched_setattr, self, &attr, 0u) == 0 && slice_of(self) == 100'000;
  }).join();
  return has;
}

std::string name_of(const std::string& tid) {
  std::ifstream comm_file("/proc/self/task/" + tid + "/comm");
  std::string name;
  std::getline(comm_file, name);
  return name;
}

// comm/internal/gloo_threads.h: the threads a Gloo group starts (its TCP
// loop, c10d's workers) get the shortest slice; the rank's own threads keep
// the default.
TEST(ProcessGroupOnRanks, GlooThreadsGetTheShortestSliceAndNoOtherThreadDoes) {
  if (!kernel_has_custom_slices()) {
    GTEST_SKIP() << "no custom scheduler slices on this kernel (Linux 6.12 and later)";
  }
  testing::RunOnRanks(2, [](ProcessGroup& pg) {
    barrier(pg).wait();  // c10d's workers have named themselves
    const int64_t default_slice = slice_of(static_cast<pid_t>(syscall(SYS_gettid)));
    EXPECT_NE(default_slice, 100'000);
    int gloo_threads = 0;
    for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
      const std::string tid = entry.path().filename();
      const std::string name = name_of(tid);
      const int64_t slice = slice_of(static_cast<pid_t>(std::stoi(tid)));
      if (name == "gloo_tcp_loop" || name == "pt_gloo_runloop") {
        ++gloo_threads;
        EXPECT_EQ(slice, 100'000) << name << " (thread " << tid << ")";
      } else {
        EXPECT_EQ(slice, default_slice) << name << " (thread " << tid << ")";
      }
    }
    EXPECT_GE(gloo_threads, 2);  // the loop and at least one worker
  });
}

TEST(ProcessGroupOnRanks, FileAndTcpInitMethodsOnTwoRanks) {
  testing::RunOnRanks(2, [](ProcessGroup& env_world) {
    // file://: a path both ranks derive alike (their parent is the test).
    const char* tmp = std::getenv("TEST_TMPDIR");
    InitOptions file_init;
    file_init.init_method = std::string("file://") + (tmp ? tmp : "/tmp") +
                            "/filestore_two_ranks_" + std::to_string(getppid());
    file_init.rank = env_world.rank();
    file_init.world_size = 2;
    file_init.timeout = std::chrono::seconds(20);
    auto file_world = init_process_group(file_init);
    ASSERT_TRUE(file_world.ok()) << file_world.status();
    at::Tensor t = at::full({5}, env_world.rank() + 1.0);
    all_reduce(*file_world, t).wait();
    EXPECT_TRUE(t.equal(at::full({5}, 3.0)));

    // tcp://HOST:PORT: rank 0 picks the port, the env world tells rank 1.
    at::Tensor port = at::zeros({1}, at::kLong);
    if (env_world.rank() == 0) port[0] = *launcher::pick_free_port();
    broadcast(env_world, port, 0).wait();
    InitOptions tcp_init;
    tcp_init.init_method = "tcp://127.0.0.1:" + std::to_string(port.item<int64_t>());
    tcp_init.rank = env_world.rank();
    tcp_init.world_size = 2;
    tcp_init.timeout = std::chrono::seconds(20);
    auto tcp_world = init_process_group(tcp_init);
    ASSERT_TRUE(tcp_world.ok()) << tcp_world.status();
    at::Tensor g = at::empty({4});
    all_gather_into_tensor(*tcp_world, g, at::full({2}, env_world.rank() * 1.0)).wait();
    EXPECT_TRUE(g.equal(at::tensor({0.0f, 0.0f, 1.0f, 1.0f})));
    barrier(*tcp_world).wait();
    barrier(*file_world).wait();
  });
}

TEST(Faults, RankDyingMidCollectiveFailsTheOthersQuickly) {
  testing::RunOptions options;
  options.collective_timeout = std::chrono::seconds(10);
  options.closing_barrier = false;
  testing::RunOnRanks(
      2,
      [](ProcessGroup& pg) {
        at::Tensor t = at::ones({1 << 16});
        all_reduce(pg, t).wait();  // both alive: fine
        if (pg.rank() == 1) {
          // Dies while rank 0 waits in the next collective.
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          _exit(0);
        }
        const auto start = Clock::now();
        try {
          all_reduce(pg, t).wait();
          ADD_FAILURE() << "all_reduce with a dead peer succeeded";
        } catch (const c10::Error& e) {
          EXPECT_THAT(e.what_without_backtrace(), HasSubstr("all_reduce"));
          EXPECT_THAT(e.what_without_backtrace(), HasSubstr("failed"));
        }
        EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 10.0);
      },
      options);
}

TEST(Faults, HungPeerTimesOutInsteadOfHanging) {
  testing::RunOptions options;
  options.collective_timeout = std::chrono::milliseconds(1500);
  options.closing_barrier = false;
  testing::RunOnRanks(
      2,
      [](ProcessGroup& pg) {
        if (pg.rank() == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(3500));  // never joins
          return;
        }
        at::Tensor t = at::ones({8});
        const auto start = Clock::now();
        EXPECT_THROW(all_reduce(pg, t).wait(), c10::Error);
        const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
        EXPECT_GE(seconds, 1.0);
        EXPECT_LT(seconds, 3.5);
      },
      options);
}

// A large all-gather on Gloo is sends and receives (comm/collectives.cc),
// several c10d operations under one Work: a dead or hung peer must still
// fail it within the group's timeout, once, with comm's message.
TEST(Faults, RankToRankAllGatherFailsOnADeadPeerAndTimesOutOnAHungOne) {
  constexpr int64_t kShard = int64_t{1} << 18;  // 2 x 1 MiB gathered: rank to rank
  testing::RunOptions options;
  options.collective_timeout = std::chrono::milliseconds(1500);
  options.closing_barrier = false;
  testing::RunOnRanks(
      3,
      [](ProcessGroup& pg) {
        ASSERT_TRUE(all_gathers_rank_to_rank(pg, at::kCPU, 3 * kShard * 4));
        at::Tensor in = at::full({kShard}, pg.rank() * 1.0f);
        at::Tensor out = at::empty({3 * kShard});
        all_gather_into_tensor(pg, out, in).wait();  // all alive: fine
        EXPECT_EQ(out[2 * kShard].item<float>(), 2.0f);
        if (pg.rank() == 2) _exit(0);  // dies before the next gather
        if (pg.rank() == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(4000));  // hangs
          _exit(0);
        }
        const auto start = Clock::now();
        Work work = all_gather_into_tensor(pg, out, in);
        try {
          work.wait();
          ADD_FAILURE() << "all_gather_into_tensor with a dead and a hung peer succeeded";
        } catch (const c10::Error& e) {
          EXPECT_THAT(e.what_without_backtrace(), HasSubstr("all_gather_into_tensor"));
          EXPECT_THAT(e.what_without_backtrace(), HasSubstr("failed"));
        }
        EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 3.5);
        EXPECT_THROW(work.wait(), c10::Error);  // the same error again, at once
      },
      options);
}

TEST(Faults, FailingRankFailsTheRunWithItsOutput) {
  testing::RunOptions options;
  options.expect_failure = true;
  options.closing_barrier = false;
  const int status = testing::RunOnRanks(
      2,
      [](ProcessGroup& pg) {
        if (pg.rank() == 1) ADD_FAILURE() << "deliberate failure on rank 1";
      },
      options);
  if (!testing::IsRankProcess()) {
    EXPECT_NE(status, 0);
  }
}

}  // namespace
}  // namespace comm
