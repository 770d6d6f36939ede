// The bounded TCPStore client: round trips against c10d's own server (both
// flavours of 2.15: libuv, the default, and the legacy one), Gloo
// rendezvousing through it, and hostile peers on loopback (garbage, huge
// length prefixes, silence, a close mid-reply, a reply that never ends),
// each of which must end in a clear error within the timeout, never an
// abort or a hang.
#include "comm/internal/store_client.h"

#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/testing/hostile_peer.h"

namespace comm {
namespace internal {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;
using testing::Answer;
using testing::HostilePeer;
using testing::PeerAction;
using testing::StoreRequest;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::vector<uint8_t> Bytes(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

std::string Text(const std::vector<uint8_t>& bytes) {
  return std::string(bytes.begin(), bytes.end());
}

StoreClientOptions ClientOptions(int port, std::chrono::milliseconds timeout) {
  StoreClientOptions options;
  options.host = "127.0.0.1";
  options.port = port;
  options.timeout = timeout;
  return options;
}

c10::intrusive_ptr<c10d::TCPStore> Server(bool libuv, std::optional<std::size_t> workers = {}) {
  c10d::TCPStoreOptions options;
  options.port = 0;
  options.isServer = true;
  options.numWorkers = workers;
  options.waitWorkers = false;
  options.useLibUV = libuv;
  options.timeout = std::chrono::seconds(20);
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", options);
}

class RealServer : public ::testing::TestWithParam<bool> {
 protected:
  bool libuv() const { return GetParam(); }
};

INSTANTIATE_TEST_SUITE_P(Flavours, RealServer, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "LibUv" : "Legacy";
                         });

TEST_P(RealServer, RoundTripsWithC10dsOwnClient) {
  auto server = Server(libuv());
  ASSERT_EQ(server->isLibUvBackend(), libuv());
  auto client = StoreClient::Connect(ClientOptions(server->getPort(), std::chrono::seconds(10)));
  ASSERT_TRUE(client.ok()) << client.status();
  c10d::Store& ours = **client;

  // Keys written by one client are read by the other: the same "/" prefix.
  server->set("from_server", Bytes("hello"));
  EXPECT_EQ(Text(ours.get("from_server")), "hello");
  ours.set("from_us", Bytes(std::string("\0bin\xff", 5)));
  EXPECT_EQ(Text(server->get("from_us")), std::string("\0bin\xff", 5));

  EXPECT_EQ(ours.add("counter", 2), 2);
  EXPECT_EQ(server->add("counter", 3), 5);
  EXPECT_EQ(ours.add("counter", -1), 4);

  EXPECT_TRUE(ours.check({"from_server", "from_us"}));
  EXPECT_FALSE(ours.check({"from_server", "missing"}));

  // compareSet: missing key with an empty expectation sets it.
  EXPECT_EQ(Text(ours.compareSet("cas", {}, Bytes("v1"))), "v1");
  EXPECT_EQ(Text(ours.compareSet("cas", Bytes("nope"), Bytes("v2"))), "v1");
  EXPECT_EQ(Text(ours.compareSet("cas", Bytes("v1"), Bytes("v2"))), "v2");

  const int64_t keys = ours.getNumKeys();
  EXPECT_GE(keys, 4);
  EXPECT_TRUE(ours.deleteKey("cas"));
  EXPECT_FALSE(ours.deleteKey("cas"));
  EXPECT_EQ(ours.getNumKeys(), keys - 1);

  // A value of 1 MiB (the limit), both ways.
  const std::string big(1 << 20, 'z');
  ours.set("big", Bytes(big));
  EXPECT_EQ(Text(server->get("big")), big);
  EXPECT_EQ(Text(ours.get("big")), big);

  // c10d's defaults over our operations.
  EXPECT_FALSE(ours.hasExtendedApi());
  ours.append("list", Bytes("a"));
  ours.append("list", Bytes("b"));
  EXPECT_EQ(Text(ours.get("list")), "ab");
  auto clone = ours.clone();
  EXPECT_EQ(Text(clone->get("from_server")), "hello");
}

TEST_P(RealServer, WaitReturnsWhenTheKeyIsSetAndTimesOutOtherwise) {
  auto server = Server(libuv());
  auto client = StoreClient::Connect(ClientOptions(server->getPort(), std::chrono::seconds(10)));
  ASSERT_TRUE(client.ok()) << client.status();
  c10d::Store& ours = **client;

  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    server->set("later", Bytes("x"));
  });
  auto start = Clock::now();
  ours.wait({"later"}, std::chrono::seconds(5));
  EXPECT_GE(SecondsSince(start), 0.15);
  setter.join();
  // get waits for its key too (the legacy server would drop the connection
  // on a get of a missing one).
  std::thread setter2([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    server->set("later2", Bytes("y"));
  });
  EXPECT_EQ(Text(ours.get("later2")), "y");
  setter2.join();

  start = Clock::now();
  try {
    ours.wait({"never", "later"}, std::chrono::milliseconds(400));
    ADD_FAILURE() << "wait for a missing key returned";
  } catch (const c10::DistStoreError& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("keys 'never', 'later' not set"));
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("within 400 ms"));
  }
  EXPECT_GE(SecondsSince(start), 0.35);
  EXPECT_LT(SecondsSince(start), 0.4 + 1.0);
  // The wait was cancelled on the server: the connection is still in step.
  EXPECT_EQ(ours.add("after_wait", 7), 7);
  server->set("never", Bytes("now"));
  EXPECT_EQ(Text(ours.get("never")), "now");

  // c10d's "no timeout" (0) is the client's own timeout here, and an absurd
  // one is still a deadline, not an overflow.
  ours.setTimeout(std::chrono::milliseconds::max());
  EXPECT_EQ(ours.add("after_huge_timeout", 1), 1);
  ours.setTimeout(c10d::Store::kNoTimeout);
  EXPECT_EQ(ours.add("after_no_timeout", 1), 1);

  // The store's timeout bounds get.
  ours.setTimeout(std::chrono::milliseconds(300));
  start = Clock::now();
  EXPECT_THROW(ours.get("absent"), c10::DistStoreError);
  EXPECT_LT(SecondsSince(start), 0.3 + 1.0);
  EXPECT_EQ(ours.add("after_get", 1), 1);
}

// A server made with numWorkers and waitWorkers waits in its constructor for
// every worker to count itself on "init/": ours does, as c10d's client.
TEST_P(RealServer, CountsItselfForAServerWaitingForWorkers) {
  const int port = [&] {
    auto probe = Server(libuv());
    return static_cast<int>(probe->getPort());
  }();
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(port);
  options.isServer = true;
  options.numWorkers = 2;
  options.waitWorkers = true;
  options.useLibUV = libuv();
  options.timeout = std::chrono::seconds(20);
  auto server = std::async(std::launch::async, [&] {
    return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", options);
  });
  auto client = StoreClient::Connect(ClientOptions(port, std::chrono::seconds(20)));
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_EQ(server.wait_for(std::chrono::seconds(15)), std::future_status::ready);
  auto store = server.get();
  store->set("k", Bytes("v"));
  EXPECT_EQ(Text((*client)->get("k")), "v");
}

// Gloo's rendezvous (set, wait, get of each rank's addresses) through our
// client on rank 1 and c10d's on rank 0, then an all-reduce.
TEST_P(RealServer, GlooRendezvousesThroughIt) {
  auto server = Server(libuv());
  auto client = StoreClient::Connect(ClientOptions(server->getPort(), std::chrono::seconds(20)));
  ASSERT_TRUE(client.ok()) << client.status();
  c10::intrusive_ptr<c10d::Store> stores[2] = {server, *client};
  std::vector<std::future<at::Tensor>> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.push_back(std::async(std::launch::async, [&, rank] {
      auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(20));
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      auto store = c10::make_intrusive<c10d::PrefixStore>("gloo_test/", stores[rank]);
      auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, 2, options);
      std::vector<at::Tensor> tensors = {at::full({4}, rank + 1.0)};
      gloo->allreduce(tensors)->wait();
      return tensors[0];
    }));
  }
  for (auto& rank : ranks) {
    ASSERT_EQ(rank.wait_for(std::chrono::seconds(30)), std::future_status::ready);
    EXPECT_TRUE(rank.get().equal(at::full({4}, 3.0)));
  }
}

// ---------------------------------------------------------------- hostile

constexpr auto kTimeout = std::chrono::milliseconds(1500);
constexpr double kSlack = 1.0;  // seconds beyond the timeout allowed

std::string Message(const absl::Status& status) { return std::string(status.message()); }

// Connects to a scripted peer (whose handshake is correct).
c10::intrusive_ptr<StoreClient> ConnectTo(const HostilePeer& peer) {
  auto client = StoreClient::Connect(ClientOptions(peer.port(), kTimeout));
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *client : nullptr;
}

TEST(HostilePeer, GarbageInsteadOfTheHandshakeIsAClearError) {
  std::string random(256, '\0');
  uint32_t x = 12345;
  for (char& c : random) {
    x = x * 1103515245u + 12345u;
    c = static_cast<char>(x >> 24);
  }
  for (const std::string& garbage :
       {random, std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", 12),
        std::string("HTTP/1.1 400 Bad Request\r\n\r\n")}) {
    HostilePeer peer(HostilePeer::Garbage(garbage));
    const auto start = Clock::now();
    auto client = StoreClient::Connect(ClientOptions(peer.port(), kTimeout));
    EXPECT_LT(SecondsSince(start), 1.0);
    ASSERT_FALSE(client.ok());
    EXPECT_EQ(client.status().code(), absl::StatusCode::kDataLoss) << client.status();
    EXPECT_THAT(Message(client.status()),
                HasSubstr("rendezvous peer 127.0.0.1:" + std::to_string(peer.port()) +
                          " answered the ping with 0x"));
    EXPECT_THAT(Message(client.status()), HasSubstr("is it a c10d TCPStore server?"));
  }
}

TEST(HostilePeer, SilenceEndsWithinTheTimeout) {
  for (auto behaviour : {HostilePeer::ListenOnly(), HostilePeer::Silent()}) {
    HostilePeer peer(behaviour);
    const auto start = Clock::now();
    auto client = StoreClient::Connect(ClientOptions(peer.port(), kTimeout));
    const double seconds = SecondsSince(start);
    ASSERT_FALSE(client.ok());
    EXPECT_EQ(client.status().code(), absl::StatusCode::kDeadlineExceeded) << client.status();
    EXPECT_THAT(Message(client.status()),
                HasSubstr("rendezvous peer 127.0.0.1:" + std::to_string(peer.port()) +
                          " did not answer the handshake (validate and ping) within 1500 ms"));
    EXPECT_GE(seconds, 1.4);
    EXPECT_LT(seconds, 1.5 + kSlack);
  }
}

TEST(HostilePeer, NobodyListeningIsRetriedUntilTheTimeout) {
  int port = 0;
  {
    HostilePeer closed(HostilePeer::Silent());
    port = closed.port();
  }
  const auto start = Clock::now();
  auto client = StoreClient::Connect(ClientOptions(port, kTimeout));
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(Message(client.status()),
              HasSubstr("could not connect to rendezvous peer 127.0.0.1:" + std::to_string(port) +
                        " within 1500 ms"));
  EXPECT_THAT(Message(client.status()), HasSubstr("Connection refused"));
  EXPECT_LT(SecondsSince(start), 1.5 + kSlack);
}

TEST(HostilePeer, HugeValueLengthIsRefusedBeforeAnyAllocation) {
  HostilePeer peer(HostilePeer::Scripted([](const StoreRequest& request) {
    if (request.query == 6) return Answer(std::string(1, '\0'));  // wait: ready
    return Answer(HostilePeer::U64(~uint64_t{0}));                // get
  }));
  auto client = ConnectTo(peer);
  ASSERT_TRUE(client);
  const auto start = Clock::now();
  auto value = client->TryGet("x");
  ASSERT_FALSE(value.ok());
  EXPECT_EQ(value.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Message(value.status()),
              HasSubstr("rendezvous peer 127.0.0.1:" + std::to_string(peer.port()) +
                        " sent a value length of 18446744073709551615 bytes for key 'x' "
                        "(get): expected at most 1048576 bytes"));
  EXPECT_LT(SecondsSince(start), 1.0);
  // The stream is out of step now: every later operation says so.
  auto after = client->TryAdd("y", 1);
  EXPECT_EQ(after.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(after.status()), HasSubstr("unusable after an earlier error: "
                                                 "rendezvous peer 127.0.0.1:"));
  // Through c10d's interface it is an exception, never std::terminate.
  EXPECT_THROW(client->add("y", 1), c10::DistStoreError);
}

TEST(HostilePeer, MalformedResponseBytesAreNamed) {
  HostilePeer peer(HostilePeer::Scripted([](const StoreRequest& request) {
    if (request.query == 5) return Answer(std::string(1, '\x07'));  // check
    return Answer(std::string(1, '\x09'));                          // wait
  }));
  // The peer serves one connection at a time: each client in its own scope.
  {
    auto client = ConnectTo(peer);
    ASSERT_TRUE(client);
    try {
      client->check({"a"});
      ADD_FAILURE() << "check returned";
    } catch (const c10::DistStoreError& e) {
      EXPECT_THAT(e.what_without_backtrace(),
                  HasSubstr("sent the byte 0x07 in reply to key 'a' (check): expected 0 "
                            "(ready) or 1 (not ready)"));
    }
  }
  auto client = ConnectTo(peer);
  ASSERT_TRUE(client);
  try {
    client->wait({"a"});
    ADD_FAILURE() << "wait returned";
  } catch (const c10::DistStoreError& e) {
    EXPECT_THAT(e.what_without_backtrace(),
                HasSubstr("sent the byte 0x09 in reply to key 'a' (wait): expected 0 "
                          "(STOP_WAITING)"));
  }
}

TEST(HostilePeer, CloseMidReplyIsAClearError) {
  HostilePeer peer(HostilePeer::Scripted([](const StoreRequest& request) {
    if (request.query == 6) return Answer(std::string(1, '\0'));
    PeerAction action = Answer(HostilePeer::U64(10) + "abc");
    action.close = true;
    return action;
  }));
  auto client = ConnectTo(peer);
  ASSERT_TRUE(client);
  const auto start = Clock::now();
  try {
    client->get("k");
    ADD_FAILURE() << "get returned";
  } catch (const c10::DistNetworkError& e) {
    EXPECT_THAT(e.what_without_backtrace(),
                HasSubstr("rendezvous peer 127.0.0.1:" + std::to_string(peer.port()) +
                          " closed the connection while key 'k' (get) was awaited "
                          "(11 bytes of the reply received, at least 7 more expected)"));
  }
  EXPECT_LT(SecondsSince(start), 1.0);
}

// Silence after part of a reply, and a reply that keeps coming one byte at
// a time without end: both end at the operation's deadline.
TEST(HostilePeer, PartialOrEndlessRepliesEndAtTheDeadline) {
  HostilePeer partial(HostilePeer::Scripted([](const StoreRequest& request) {
    PeerAction action = Answer(std::string(3, '\x01'));  // 3 of add's 8 bytes
    action.go_silent = true;
    return action;
  }));
  {
    auto client = ConnectTo(partial);
    ASSERT_TRUE(client);
    const auto start = Clock::now();
    auto added = client->TryAdd("n", 1);
    ASSERT_FALSE(added.ok());
    EXPECT_EQ(added.status().code(), absl::StatusCode::kDeadlineExceeded) << added.status();
    EXPECT_THAT(Message(added.status()),
                HasSubstr("did not answer key 'n' (add) within 1500 ms (3 bytes of the "
                          "reply received, at least 5 more expected"));
    EXPECT_LT(SecondsSince(start), 1.5 + kSlack);
  }
  HostilePeer endless(HostilePeer::Scripted([](const StoreRequest& request) {
    if (request.query == 6) return Answer(std::string(1, '\0'));
    PeerAction action = Answer(HostilePeer::U64(1u << 20));  // a 1 MiB value, dripped
    action.drip = "z";
    action.drip_interval = std::chrono::milliseconds(5);
    return action;
  }));
  auto client = ConnectTo(endless);
  ASSERT_TRUE(client);
  const auto start = Clock::now();
  auto value = client->TryGet("slow");
  ASSERT_FALSE(value.ok());
  EXPECT_EQ(value.status().code(), absl::StatusCode::kDeadlineExceeded) << value.status();
  EXPECT_THAT(Message(value.status()), HasSubstr("did not answer key 'slow' (get) within"));
  EXPECT_LT(SecondsSince(start), 1.5 + kSlack);
}

// A server that never acknowledges the cancellation of a timed-out wait:
// the wait still returns by its timeout plus the cancel grace (2 s).
TEST(HostilePeer, UnacknowledgedWaitCancellationIsBounded) {
  HostilePeer peer(HostilePeer::Scripted([](const StoreRequest& request) {
    PeerAction action;
    action.go_silent = true;
    return action;
  }));
  auto client = ConnectTo(peer);
  ASSERT_TRUE(client);
  const auto start = Clock::now();
  try {
    client->wait({"k"}, std::chrono::milliseconds(500));
    ADD_FAILURE() << "wait returned";
  } catch (const c10::DistStoreError& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("key 'k' not set on rendezvous peer"));
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("the cancellation failed"));
  }
  EXPECT_LT(SecondsSince(start), 0.5 + 2.0 + kSlack);
  auto after = client->TryAdd("x", 1);
  EXPECT_EQ(after.status().code(), absl::StatusCode::kFailedPrecondition);
}

// A host name is resolved under the deadline too (getaddrinfo has none): a
// name that resolves connects, one that does not fails within the timeout
// whether the resolver answers at once or hangs.
TEST(StoreClientOptions, HostNamesResolveWithinTheTimeout) {
  auto server = Server(/*libuv=*/true);
  StoreClientOptions options = ClientOptions(server->getPort(), std::chrono::seconds(10));
  options.host = "localhost";
  auto client = StoreClient::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->add("by_name", 2), 2);
  EXPECT_THAT((*client)->peer(), HasSubstr("localhost:"));

  options.host = "no-such-host.invalid";
  options.timeout = kTimeout;
  const auto start = Clock::now();
  auto missing = StoreClient::Connect(options);
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(Message(missing.status()),
              HasSubstr("cannot resolve rendezvous peer no-such-host.invalid:"));
  EXPECT_LT(SecondsSince(start), 1.5 + kSlack);
}

TEST(StoreClientOptions, OwnLimitsAreCheckedBeforeSending) {
  HostilePeer peer(HostilePeer::Scripted([](const StoreRequest&) { return PeerAction(); }));
  auto client = ConnectTo(peer);
  ASSERT_TRUE(client);
  auto set = client->TrySet("big", std::string((1u << 20) + 1, 'x'));
  EXPECT_EQ(set.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(set), HasSubstr("set of key 'big' on rendezvous peer 127.0.0.1:"));
  EXPECT_THAT(Message(set), HasSubstr("the value is 1048577 bytes, expected at most 1048576"));
  auto key = client->TryAdd(std::string(9000, 'k'), 1);
  EXPECT_EQ(key.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(key.status()), HasSubstr("the key is 9001 bytes on the wire, expected at "
                                               "most 8192"));
  EXPECT_TRUE(peer.requests().empty());  // nothing reached the peer
  auto bad_port = StoreClient::Connect(ClientOptions(70000, kTimeout));
  EXPECT_THAT(Message(bad_port.status()),
              HasSubstr("rendezvous port 70000: expected a TCP port in [1, 65535]"));
}

}  // namespace
}  // namespace internal
}  // namespace comm
