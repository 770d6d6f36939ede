// The client side of c10d's TCPStore wire protocol, with limits: message
// encoding, a reply parser that is a pure function over bytes (fuzzed by
// //comm/fuzz), and a session that runs one operation at a time over a
// Transport. Internal to comm/; no LibTorch (the c10d::Store on top of it is
// comm/internal/store_client.h).
//
// PyTorch: the client half of torch/csrc/distributed/c10d/TCPStore.cpp, as
// its two servers (TCPStoreBackend.cpp, the legacy one, and
// TCPStoreLibUvBackend.cpp, the default) speak it in LibTorch 2.15. Facts
// of the protocol, checked against both servers by store_client_test:
//   * every connection opens with VALIDATE (query byte 0, then the magic
//     number 0x3C85F7CE); the servers answer nothing and drop a connection
//     whose first query is anything else (libuv silently, legacy by closing);
//   * a query is one type byte, then its arguments: keys and values as a
//     uint64 length and the bytes, counts as uint64, numbers as int64, all in
//     the host's byte order (little-endian on every machine c10d runs on);
//   * replies: a value (uint64 length, bytes) to GET and COMPARE_SET; an
//     int64 to ADD, DELETE_KEY and GETNUMKEYS; one byte to CHECK (0 ready,
//     1 not ready); WAIT answers one byte 0 (STOP_WAITING) only once every
//     key exists, and CANCEL_WAIT one byte 1 (WAIT_CANCELED), possibly after
//     a 0 that crossed it; PING echoes its uint32 nonce; SET answers nothing;
//   * user keys carry a "/" prefix on the wire (the client's keyPrefix_);
//     the "init/" counter that TCPStoreOptions::waitWorkers counts has none;
//   * the legacy server closes the connection on a GET of a missing key (the
//     libuv one answers an empty value), so a get waits for its key first.
//
// Limits (Limits below): nothing read from the peer is trusted. A length
// prefix is checked against the limit before anything is read or kept for
// it, and the bytes of a value are read as they arrive (never allocated from
// the prefix), so a hostile peer can make a rank hold at most
// max_value_bytes for a reply, and only by sending them. Every operation has
// a deadline; a reply that does not arrive by then is an error, never a
// wait without end.
//
// Errors (absl::Status): DeadlineExceeded (no reply in time, a key not set in
// time), Unavailable (the peer closed the connection or the network failed),
// DataLoss (the peer sent something the protocol does not allow: a length
// over the limit, an unknown response byte, a wrong ping echo),
// InvalidArgument (a key or value of ours over the limits the servers
// enforce), FailedPrecondition (the session is unusable after an earlier
// error: a broken stream cannot be resynchronised). Messages name the peer
// ("rendezvous peer 127.0.0.1:29500"), the operation and key, the value
// received and what was expected, e.g.
//   rendezvous peer 127.0.0.1:29533 sent a value length of
//   18446744073709551615 bytes for key 'x' (get): expected at most 1048576
//   bytes (comm's limit for a rendezvous value)
//
// Thread safety: a StoreSession is not thread-safe; its owner serialises
// calls (StoreClient holds a mutex). ParseReply and the encoders are pure.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace comm {
namespace internal {
namespace store_wire {

// torch/csrc/distributed/c10d/store/TCPStoreBackend.hpp (2.15).
inline constexpr uint32_t kValidationMagic = 0x3C85F7CE;
enum class Query : uint8_t {
  kValidate = 0,
  kSet = 1,
  kCompareSet = 2,
  kGet = 3,
  kAdd = 4,
  kCheck = 5,
  kWait = 6,
  kGetNumKeys = 7,
  kDeleteKey = 8,
  kCancelWait = 12,
  kPing = 13,
};
inline constexpr uint8_t kCheckReady = 0;
inline constexpr uint8_t kCheckNotReady = 1;
inline constexpr uint8_t kStopWaiting = 0;
inline constexpr uint8_t kWaitCanceled = 1;
// Every user key goes on the wire with this prefix (as c10d's client does);
// the worker counter key does not.
inline constexpr char kKeyPrefix[] = "/";
inline constexpr char kWorkerCounterKey[] = "init/";

struct Limits {
  // The longest key we send: the libuv server's MAX_STRING_LEN (8 KiB); it
  // drops the connection on a longer one, so refusing here gives the error
  // a name. Our keys are short ("0/1/rank_3").
  std::size_t max_key_bytes = 8 * 1024;
  // Keys in one check/wait: the libuv server's MAX_KEY_COUNT.
  std::size_t max_keys = 128 * 1024;
  // The largest value a reply may carry, and that we send. What rendezvous
  // stores: in Gloo's full mesh (2.15) each rank publishes one value of
  // about 154 + 8 * world bytes (measured: 170 bytes at world 2, 282 at 16;
  // 64 KiB at 8192 ranks); NCCL's unique id is 128 bytes; comm's own values
  // are a few bytes. 1 MiB covers Gloo beyond 100000 ranks and is an eighth
  // of what c10d's libuv server will store at all (MAX_PAYLOAD_LEN, 8 MiB).
  std::size_t max_value_bytes = 1024 * 1024;
};

// What a reply answers; decides its grammar.
enum class ReplyKind : uint8_t {
  kValue,       // GET, COMPARE_SET: uint64 length + bytes
  kInt64,       // ADD: any int64
  kCount,       // DELETE_KEY, GETNUMKEYS: an int64 >= 0
  kCheck,       // CHECK: 0 or 1
  kWaitResult,  // WAIT: 0
  kCancelAck,   // CANCEL_WAIT: 1, or a late 0 (the wait ended first)
  kPingEcho,    // PING: a uint32
};

struct Reply {
  std::string value;   // kValue
  int64_t number = 0;  // kInt64, kCount, kPingEcho
  bool flag = false;   // kCheck: ready; kCancelAck: canceled (false: a late
                       // STOP_WAITING, the ack still follows)
};

// For messages: who sent the reply and what it answers ("key 'x' (get)").
struct ReplyContext {
  absl::string_view peer;  // "127.0.0.1:29500"
  absl::string_view what;
};

// Either a complete reply (`complete`, `consumed` bytes of the input), or
// how many more bytes at least are needed (`more` > 0) before it can be.
struct ParseOutcome {
  bool complete = false;
  std::size_t consumed = 0;
  std::size_t more = 0;
  Reply reply;
};

// Parses the reply of kind `kind` at the start of `bytes`. Pure: the same
// bytes give the same outcome, an incomplete outcome never asks for more
// than the limits allow (a header, then at most max_value_bytes), and an
// error (DataLoss) is final. Bytes after a complete reply are not looked at.
absl::StatusOr<ParseOutcome> ParseReply(ReplyKind kind, absl::string_view bytes,
                                        const Limits& limits, const ReplyContext& context);

// A key for messages: quoted, non-printable bytes escaped, long ones cut.
std::string DescribeKey(absl::string_view key);

// A deadline and the budget it came from (messages say "within N ms").
struct Deadline {
  std::chrono::steady_clock::time_point at;
  std::chrono::milliseconds budget{0};
  static Deadline After(std::chrono::milliseconds budget);
};

// The byte stream to one peer. Implementations: the socket in
// store_client.cc, an in-memory script in the fuzz harness.
class Transport {
 public:
  virtual ~Transport() = default;
  // Sends every byte of `bytes` by `deadline`: DeadlineExceeded, or
  // Unavailable when the connection fails.
  virtual absl::Status Send(absl::string_view bytes, const Deadline& deadline) = 0;
  // Appends between 1 and `max` (> 0) bytes to `*out` once some arrive, by
  // `deadline`: DeadlineExceeded when none did, Unavailable when the peer
  // closed the connection (the message says how) or the network failed.
  virtual absl::Status Receive(std::size_t max, const Deadline& deadline, std::string* out) = 0;
  // "HOST:PORT" of the peer, for messages.
  virtual const std::string& peer() const = 0;
};

// One client connection's operations, each a request and its reply under a
// deadline. Keys are the caller's (the "/" prefix is added here). After any
// error but an op's own timeout that left the stream in step, the session is
// broken: every later call fails with FailedPrecondition naming the first
// error, without touching the transport.
class StoreSession {
 public:
  StoreSession(std::unique_ptr<Transport> transport, const Limits& limits);

  // VALIDATE, then PING with `nonce`: a peer that does not echo it is not a
  // c10d TCPStore (DataLoss) or not answering (DeadlineExceeded).
  absl::Status Handshake(uint32_t nonce, const Deadline& deadline);
  // Counts this client on the server's "init/" counter, as a c10d client
  // created with waitWorkers does (a server created so waits for it).
  absl::Status AnnounceWorker(const Deadline& deadline);

  absl::Status Set(absl::string_view key, absl::string_view value, const Deadline& deadline);
  // Waits (by `deadline`) for the key to exist, then reads it.
  absl::StatusOr<std::string> Get(absl::string_view key, const Deadline& deadline);
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta, const Deadline& deadline);
  absl::StatusOr<bool> Check(const std::vector<std::string>& keys, const Deadline& deadline);
  // Returns once every key exists; DeadlineExceeded when they do not by
  // `deadline`. The wait is then cancelled on the server, which has
  // `cancel_grace` more to acknowledge it (else the session is broken), so
  // a timed-out wait returns by deadline + cancel_grace.
  absl::Status Wait(const std::vector<std::string>& keys, const Deadline& deadline,
                    std::chrono::milliseconds cancel_grace = kCancelGrace);
  absl::StatusOr<bool> DeleteKey(absl::string_view key, const Deadline& deadline);
  absl::StatusOr<int64_t> NumKeys(const Deadline& deadline);
  // c10d's compareSet: sets `desired` when the value is `expected` (or the
  // key is missing and `expected` is empty); returns the value after.
  absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                         absl::string_view desired, const Deadline& deadline);

  // OK, or the error that broke the session.
  const absl::Status& broken() const { return broken_; }
  const std::string& peer() const { return transport_->peer(); }
  const Limits& limits() const { return limits_; }

  static constexpr std::chrono::milliseconds kCancelGrace{2000};

 private:
  absl::Status Usable() const;
  absl::Status CheckKey(absl::string_view key, absl::string_view op) const;
  absl::Status CheckValue(absl::string_view key, absl::string_view value,
                          absl::string_view op) const;
  absl::Status SendRequest(const std::string& bytes, absl::string_view what,
                           const Deadline& deadline);
  absl::StatusOr<Reply> ReadReply(ReplyKind kind, absl::string_view what, const Deadline& deadline);
  // Records `status` as the reason the session is unusable; returns it.
  absl::Status Break(absl::Status status);

  std::unique_ptr<Transport> transport_;
  Limits limits_;
  absl::Status broken_;
};

// Describes keys for messages: "key 'a'" or "keys 'a', 'b' (and 3 more)".
std::string DescribeKeys(const std::vector<std::string>& keys);

}  // namespace store_wire
}  // namespace internal
}  // namespace comm
