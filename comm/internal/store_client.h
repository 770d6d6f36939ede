// A c10d::Store that is a client of a c10d TCPStore server, with limits: what
// every rank but rank 0 rendezvous through (rank 0 serves the store with
// c10d's own TCPStore). Internal to comm/.
//
// PyTorch: the client side of c10d::TCPStore (torch.distributed.TCPStore with
// is_master=False). c10d's own client reads length prefixes from the wire
// into std::vector sizes unchecked (a garbage answer ends the process in
// std::length_error) and waits without end in its connect/validate
// handshake; it lives inside LibTorch, so comm speaks the protocol itself
// (comm/internal/store_protocol.h) and bounds every read in size and time.
//
//   StoreClientOptions options;
//   options.host = "127.0.0.1";
//   options.port = 29500;
//   options.timeout = std::chrono::seconds(30);
//   absl::StatusOr<c10::intrusive_ptr<StoreClient>> store = StoreClient::Connect(options);
//   if (!store.ok()) return store.status();  // e.g. DeadlineExceeded naming the peer
//   (*store)->set("key", value);             // c10d::Store API: throws on errors
//   absl::StatusOr<int64_t> n = (*store)->TryAdd("ranks", 1);  // or absl-style
//
// Operations: the c10d::Store ones ProcessGroupGloo, ProcessGroupNCCL and comm
// use: set, get, add, check, wait (both overloads), deleteKey, getNumKeys,
// compareSet, clone; append/multiGet/multiSet come from c10d::Store's
// defaults over those (hasExtendedApi() is false, so Gloo does not ask for
// them). Queue, barrier and listKeys operations are c10d's NotImplemented.
//
// Time: Connect (name resolution, TCP connect with retries while nothing
// listens yet, the handshake) finishes within options.timeout. Each
// operation is bounded by the store's timeout (getTimeout(), set to
// options.timeout; c10d's kNoTimeout of 0 means options.timeout here, since
// nothing may wait without end), wait(keys, timeout) by its argument; a
// timed-out wait is cancelled on the server within 2 s more.
//
// Errors: Connect and the Try* functions return absl::Status (see
// store_protocol.h for the codes and messages). The c10d::Store overrides
// throw, as the interface requires: c10::DistNetworkError when the
// connection failed or closed, c10::DistStoreError for everything else
// (timeouts, malformed replies), with the same messages. After a malformed
// or partial reply the connection is unusable and every later operation
// says so.
//
// Lifetime and threads: operations are serialised by a mutex (one request
// on the connection at a time, like c10d's client); clone() opens a new
// connection. No threads of its own outlive a call (name resolution runs on
// a short-lived detached thread that only touches its own state).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/internal/store_protocol.h"

namespace comm {
namespace internal {

struct StoreClientOptions {
  std::string host;  // a name, an IPv4 or an IPv6 address
  int port = 0;
  // Bounds Connect and, as the store's timeout, every operation.
  std::chrono::milliseconds timeout{30000};
  store_wire::Limits limits;
  // Count this client on the server's "init/" counter, as c10d's client
  // with waitWorkers does: a TCPStore server made with numWorkers and
  // waitWorkers waits for it in its constructor.
  bool announce_worker = true;
};

class StoreClient final : public c10d::Store {
 public:
  // Connects, handshakes and (announce_worker) joins, all within
  // options.timeout. InvalidArgument for a bad port or timeout;
  // DeadlineExceeded when nothing answered in time (naming the peer and the
  // last connection error); DataLoss when the peer is not a TCPStore.
  static absl::StatusOr<c10::intrusive_ptr<StoreClient>> Connect(const StoreClientOptions& options);

  // absl-style operations for comm's own set-up code, bounded by the store's
  // timeout (TryAdd: by `timeout` when positive).
  absl::StatusOr<int64_t> TryAdd(const std::string& key, int64_t delta,
                                 std::chrono::milliseconds timeout = {});
  absl::StatusOr<std::string> TryGet(const std::string& key);
  absl::Status TrySet(const std::string& key, const std::string& value);

  // "HOST:PORT", as messages name the peer.
  const std::string& peer() const { return peer_; }

  // c10d::Store.
  c10::intrusive_ptr<c10d::Store> clone() override;
  using c10d::Store::set;
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  // Public for c10::make_intrusive; use Connect.
  struct Token {};
  StoreClient(Token, const StoreClientOptions& options,
              std::unique_ptr<store_wire::StoreSession> session);

 private:
  store_wire::Deadline OpDeadline(std::chrono::milliseconds timeout) const;
  store_wire::Deadline OpDeadline() const { return OpDeadline(timeout_); }

  const StoreClientOptions options_;
  const std::string peer_;
  std::mutex mutex_;
  std::unique_ptr<store_wire::StoreSession> session_;
};

// The socket Transport StoreClient uses, for tests that speak the protocol
// to a hand-made peer: connects to host:port within `deadline` (retrying
// while nothing listens, as a rank started before rank 0 must).
absl::StatusOr<std::unique_ptr<store_wire::Transport>> ConnectSocket(
    const std::string& host, int port, const store_wire::Deadline& deadline);

}  // namespace internal
}  // namespace comm
