#include "comm/fuzz/harness.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "comm/internal/store_protocol.h"

namespace comm {
namespace fuzz {
namespace {

namespace wire = ::comm::internal::store_wire;

constexpr char kPeer[] = "fuzz:1";
constexpr uint32_t kNonce = 0x01020304;

[[noreturn]] void Violation(const std::string& what) {
  std::fprintf(stderr, "rendezvous fuzz oracle violated: %s\n", what.c_str());
  std::abort();
}

wire::Limits FuzzLimits() {
  wire::Limits limits;
  limits.max_value_bytes = 64;  // small, so inputs reach the bound easily
  return limits;
}

void ExpectNamesPeer(const absl::Status& status, const std::string& where) {
  if (status.ok()) return;
  if (status.message().empty() ||
      !absl::StrContains(status.message(), absl::StrCat("rendezvous peer ", kPeer))) {
    Violation(absl::StrCat(where, ": an error that does not name the peer: ", status.ToString()));
  }
}

// ParseReply's oracles for one kind over `bytes`.
void CheckParser(wire::ReplyKind kind, absl::string_view bytes) {
  const wire::Limits limits = FuzzLimits();
  const wire::ReplyContext context{kPeer, "key 'k' (fuzz)"};
  const std::string where =
      absl::StrCat("ParseReply(kind ", static_cast<int>(kind), ", ", bytes.size(), " bytes)");
  absl::StatusOr<wire::ParseOutcome> full = wire::ParseReply(kind, bytes, limits, context);
  if (!full.ok()) {
    if (!absl::IsDataLoss(full.status())) {
      Violation(absl::StrCat(where, ": not DataLoss: ", full.status().ToString()));
    }
    ExpectNamesPeer(full.status(), where);
    return;
  }
  const std::size_t max_reply = sizeof(uint64_t) + limits.max_value_bytes;
  if (!full->complete) {
    if (full->more == 0 || full->more > max_reply || bytes.size() + full->more > max_reply) {
      Violation(absl::StrCat(where, ": incomplete, asking for ", full->more,
                             " more bytes (a reply is at most ", max_reply, ")"));
    }
    return;
  }
  const std::size_t consumed = full->consumed;
  if (consumed == 0 || consumed > bytes.size() || consumed > max_reply) {
    Violation(absl::StrCat(where, ": complete after ", consumed, " bytes"));
  }
  if (kind == wire::ReplyKind::kValue) {
    const std::string& value = full->reply.value;
    if (value.size() > limits.max_value_bytes || consumed != sizeof(uint64_t) + value.size() ||
        bytes.substr(sizeof(uint64_t), value.size()) != value) {
      Violation(absl::StrCat(where, ": a value of ", value.size(),
                             " bytes that is not the bytes after its length"));
    }
  }
  // Every prefix of a complete reply is incomplete, and asks for no more
  // than the reply's remaining bytes.
  for (std::size_t n = 0; n < consumed; ++n) {
    absl::StatusOr<wire::ParseOutcome> part =
        wire::ParseReply(kind, bytes.substr(0, n), limits, context);
    if (!part.ok() || part->complete || part->more == 0 || part->more > consumed - n) {
      Violation(absl::StrCat(
          where, ": the ", n, "-byte prefix of a ", consumed, "-byte reply parsed as ",
          part.ok() ? (part->complete ? "complete" : absl::StrCat("needing ", part->more))
                    : part.status().ToString()));
    }
  }
  // Bytes after the reply are not looked at.
  absl::StatusOr<wire::ParseOutcome> again =
      wire::ParseReply(kind, bytes.substr(0, consumed), limits, context);
  if (!again.ok() || !again->complete || again->consumed != consumed ||
      again->reply.value != full->reply.value || again->reply.number != full->reply.number ||
      again->reply.flag != full->reply.flag) {
    Violation(absl::StrCat(where, ": the reply alone parses differently"));
  }
}

// The peer, played from the input (see harness.h for the frame layout).
class ScriptedTransport final : public wire::Transport {
 public:
  ScriptedTransport(absl::string_view frames, bool close_at_end, std::string* sent)
      : frames_(frames), close_at_end_(close_at_end), sent_(sent) {}

  absl::Status Send(absl::string_view bytes, const wire::Deadline&) override {
    ++calls_;
    sent_->append(bytes.data(), bytes.size());
    return absl::OkStatus();
  }

  absl::Status Receive(std::size_t max, const wire::Deadline&, std::string* out) override {
    ++calls_;
    if (max == 0) Violation("Receive asked for 0 bytes");
    while (frame_left_ == 0) {
      if (frames_.empty()) {
        return close_at_end_ ? absl::UnavailableError("closed the connection")
                             : absl::DeadlineExceededError("no data");
      }
      frame_left_ = static_cast<uint8_t>(frames_[0]);
      frames_.remove_prefix(1);
      if (frame_left_ == 0) return absl::DeadlineExceededError("no data");
    }
    const std::size_t n = std::min({max, frame_left_, frames_.size()});
    if (n == 0) {  // a frame cut short by the end of the input
      frame_left_ = 0;
      return Receive(max, wire::Deadline{}, out);
    }
    out->append(frames_.data(), n);
    frames_.remove_prefix(n);
    frame_left_ -= n;
    return absl::OkStatus();
  }

  const std::string& peer() const override { return peer_; }
  int calls() const { return calls_; }

 private:
  absl::string_view frames_;
  std::size_t frame_left_ = 0;
  const bool close_at_end_;
  std::string* sent_;
  const std::string peer_ = kPeer;
  int calls_ = 0;
};

// The bytes a peer would see, concatenated; cut into the frames' payload.
std::string PeerBytes(absl::string_view frames) {
  std::string out;
  while (!frames.empty()) {
    const std::size_t n = std::min<std::size_t>(static_cast<uint8_t>(frames[0]), frames.size() - 1);
    out.append(frames.data() + 1, n);
    frames.remove_prefix(1 + n);
  }
  return out;
}

// A server's reading of our requests: every request well formed.
void CheckRequests(absl::string_view sent) {
  auto fail = [&](const std::string& why) {
    Violation(absl::StrCat("a malformed request from the client (", why, ") at byte ", sent.size(),
                           " from the end"));
  };
  auto take = [&](std::size_t n) {
    if (sent.size() < n) fail(absl::StrCat("needs ", n, " more bytes"));
    absl::string_view part = sent.substr(0, n);
    sent.remove_prefix(n);
    return part;
  };
  auto u64 = [&] {
    uint64_t v = 0;
    std::memcpy(&v, take(8).data(), 8);
    return v;
  };
  auto string = [&] {
    const uint64_t length = u64();
    if (length > sent.size()) fail(absl::StrCat("a length of ", length));
    return take(static_cast<std::size_t>(length));
  };
  auto key = [&] {
    absl::string_view k = string();
    if (k.empty() || k[0] != '/' || k.size() > wire::Limits().max_key_bytes) {
      fail(absl::StrCat("key '", k, "'"));
    }
  };
  bool first = true;
  while (!sent.empty()) {
    const uint8_t query = static_cast<uint8_t>(take(1)[0]);
    if (first && query != static_cast<uint8_t>(wire::Query::kValidate)) {
      fail("the first request is not VALIDATE");
    }
    first = false;
    switch (static_cast<wire::Query>(query)) {
      case wire::Query::kValidate: {
        uint32_t magic = 0;
        std::memcpy(&magic, take(4).data(), 4);
        if (magic != wire::kValidationMagic) fail("a wrong magic number");
        break;
      }
      case wire::Query::kPing: take(4); break;
      case wire::Query::kSet:
        key();
        string();
        break;
      case wire::Query::kCompareSet:
        key();
        string();
        string();
        break;
      case wire::Query::kGet:
      case wire::Query::kDeleteKey: key(); break;
      case wire::Query::kAdd: {
        absl::string_view k = string();
        if (k != wire::kWorkerCounterKey && (k.empty() || k[0] != '/')) fail("an add key");
        take(8);
        break;
      }
      case wire::Query::kCheck:
      case wire::Query::kWait: {
        const uint64_t count = u64();
        if (count == 0 || count > wire::Limits().max_keys) fail("a key count");
        for (uint64_t i = 0; i < count; ++i) key();
        break;
      }
      case wire::Query::kGetNumKeys:
      case wire::Query::kCancelWait: break;
      default: fail(absl::StrCat("query byte ", query));
    }
  }
}

}  // namespace

void RunRendezvousInput(const uint8_t* data, size_t size) {
  if (size < 2) return;
  const uint8_t ops = data[0];
  const bool close_at_end = (data[1] & 1) != 0;
  const absl::string_view frames(reinterpret_cast<const char*>(data) + 2, size - 2);

  const std::string peer_bytes = PeerBytes(frames);
  for (wire::ReplyKind kind :
       {wire::ReplyKind::kValue, wire::ReplyKind::kInt64, wire::ReplyKind::kCount,
        wire::ReplyKind::kCheck, wire::ReplyKind::kWaitResult, wire::ReplyKind::kCancelAck,
        wire::ReplyKind::kPingEcho}) {
    CheckParser(kind, peer_bytes);
  }

  std::string sent;
  auto owned = std::make_unique<ScriptedTransport>(frames, close_at_end, &sent);
  ScriptedTransport* transport = owned.get();
  wire::StoreSession session(std::move(owned), FuzzLimits());
  // The transport ignores time; deadlines only shape messages here.
  const auto deadline = [] { return wire::Deadline::After(std::chrono::milliseconds(1000)); };
  const std::size_t max_value = FuzzLimits().max_value_bytes;

  // Runs one operation; checks the session's oracles around it.
  auto step = [&](const char* name, auto&& op) {
    const bool was_broken = !session.broken().ok();
    const int calls_before = transport->calls();
    const std::size_t sent_before = sent.size();
    const absl::Status status = op();
    const std::string where = absl::StrCat("operation ", name);
    ExpectNamesPeer(status, where);
    if (was_broken) {
      if (!absl::IsFailedPrecondition(status)) {
        Violation(absl::StrCat(where, " on a broken session: ", status.ToString()));
      }
      if (transport->calls() != calls_before || sent.size() != sent_before) {
        Violation(absl::StrCat(where, " on a broken session touched the connection"));
      }
    }
    if (!session.broken().ok() && status.ok()) {
      Violation(
          absl::StrCat(where, " succeeded but broke the session: ", session.broken().ToString()));
    }
  };

  step("handshake", [&] { return session.Handshake(kNonce, deadline()); });
  step("announce", [&] { return session.AnnounceWorker(deadline()); });
  const int count = 1 + (ops >> 3) % 8;
  for (int i = 0; i < count; ++i) {
    switch ((ops + i) % 8) {
      case 0: step("set", [&] { return session.Set("k", "v", deadline()); }); break;
      case 1:
        step("get", [&] {
          absl::StatusOr<std::string> value = session.Get("k", deadline());
          if (value.ok() && value->size() > max_value) Violation("get: a value over the limit");
          return value.status();
        });
        break;
      case 2: step("add", [&] { return session.Add("k", 1, deadline()).status(); }); break;
      case 3: step("check", [&] { return session.Check({"k", "l"}, deadline()).status(); }); break;
      case 4:
        step("wait", [&] { return session.Wait({"k"}, deadline(), std::chrono::milliseconds(1)); });
        break;
      case 5: step("delete", [&] { return session.DeleteKey("k", deadline()).status(); }); break;
      case 6:
        step("num_keys", [&] {
          absl::StatusOr<int64_t> n = session.NumKeys(deadline());
          if (n.ok() && *n < 0) Violation("num_keys: a negative count");
          return n.status();
        });
        break;
      default:
        step("compare_set", [&] {
          absl::StatusOr<std::string> value = session.CompareSet("k", "", "v", deadline());
          if (value.ok() && value->size() > max_value) {
            Violation("compare_set: a value over the limit");
          }
          return value.status();
        });
    }
  }
  CheckRequests(sent);
}

}  // namespace fuzz
}  // namespace comm
