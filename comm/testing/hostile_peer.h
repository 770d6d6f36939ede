// A rendezvous peer that misbehaves on purpose, for tests of what a rank
// does when MASTER_ADDR:MASTER_PORT is not a healthy c10d TCPStore: a TCP
// listener on 127.0.0.1 (a free port) served by one background thread.
//
//   HostilePeer peer(HostilePeer::Garbage("\xff\xff not a store"));
//   comm::InitOptions options;  // rank 1 of 2 against peer.port()
//   ... init_process_group(options) fails naming "127.0.0.1:<port>"
//
// Behaviours:
//   ListenOnly()  the port listens but nothing accepts: the kernel completes
//                 the TCP handshake, then nothing is ever read or written.
//   Silent()      accepts, reads everything, never writes.
//   Garbage(b)    writes `b` as soon as a connection is accepted, then only
//                 reads.
//   Scripted(f)   speaks the protocol correctly through the handshake
//                 (validate, ping echo, the "init/" add), then answers every
//                 other request with what `f` returns: bytes to write, then
//                 optionally silence, a close, or a drip (one byte per
//                 interval) of more bytes that never ends.
// Every connection is served the same way, one at a time.
//
// Lifetime: the destructor stops the thread and closes every socket. Nothing
// thrown inside the thread escapes it (it would be std::terminate).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace comm {
namespace testing {

// A request of c10d's TCPStore protocol as the peer read it.
struct StoreRequest {
  uint8_t query = 0;
  std::vector<std::string> keys;    // as on the wire ("/" prefixed)
  std::vector<std::string> values;  // SET, COMPARE_SET
  int64_t number = 0;               // ADD's delta
};

struct PeerAction {
  std::string reply;       // written at once
  bool close = false;      // then close the connection
  bool go_silent = false;  // then never write again (keep reading)
  // then write `drip` one byte at a time, every drip_interval, repeating it
  // forever (a peer that keeps a reply coming but never completes it)
  std::string drip;
  std::chrono::milliseconds drip_interval{50};
};

// An action that writes `bytes` and goes on reading requests.
inline PeerAction Answer(std::string bytes) {
  PeerAction action;
  action.reply = std::move(bytes);
  return action;
}

class HostilePeer {
 public:
  using Script = std::function<PeerAction(const StoreRequest&)>;

  struct Behaviour {
    enum Kind { kListenOnly, kSilent, kGarbage, kScripted } kind = kSilent;
    std::string garbage;
    Script script;
  };
  static Behaviour ListenOnly() { return {Behaviour::kListenOnly, "", nullptr}; }
  static Behaviour Silent() { return {Behaviour::kSilent, "", nullptr}; }
  static Behaviour Garbage(std::string bytes) {
    return {Behaviour::kGarbage, std::move(bytes), nullptr};
  }
  static Behaviour Scripted(Script script) { return {Behaviour::kScripted, "", std::move(script)}; }

  explicit HostilePeer(Behaviour behaviour);
  ~HostilePeer();
  HostilePeer(const HostilePeer&) = delete;
  HostilePeer& operator=(const HostilePeer&) = delete;

  int port() const { return port_; }
  // Requests the script saw (after the handshake), in order.
  std::vector<StoreRequest> requests() const;

  // Little-endian encodings of the protocol's reply fields, for scripts.
  static std::string U64(uint64_t value);
  static std::string I64(int64_t value);

 private:
  void Run();
  void Serve(int fd);

  Behaviour behaviour_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  mutable std::mutex mutex_;
  std::vector<StoreRequest> seen_;
  std::thread thread_;
};

}  // namespace testing
}  // namespace comm
