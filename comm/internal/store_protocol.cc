#include "comm/internal/store_protocol.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace comm {
namespace internal {
namespace store_wire {
namespace {

// c10d writes integers with memcpy, i.e. in the host's byte order; so do we.
template <typename T>
void AppendRaw(std::string* out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out->append(bytes, sizeof(T));
}

template <typename T>
T ReadRaw(absl::string_view bytes) {
  T value;
  std::memcpy(&value, bytes.data(), sizeof(T));
  return value;
}

void AppendQuery(std::string* out, Query query) { out->push_back(static_cast<char>(query)); }

void AppendBytes(std::string* out, absl::string_view bytes) {
  AppendRaw<uint64_t>(out, bytes.size());
  out->append(bytes.data(), bytes.size());
}

void AppendKey(std::string* out, absl::string_view key) {
  AppendRaw<uint64_t>(out, std::string(kKeyPrefix).size() + key.size());
  out->append(kKeyPrefix);
  out->append(key.data(), key.size());
}

std::string Peer(const ReplyContext& context) {
  return absl::StrCat("rendezvous peer ", context.peer);
}

// A fixed-size reply: `size` bytes, or how many are missing.
bool HaveFixed(absl::string_view bytes, std::size_t size, ParseOutcome* outcome) {
  if (bytes.size() >= size) {
    outcome->complete = true;
    outcome->consumed = size;
    return true;
  }
  outcome->more = size - bytes.size();
  return false;
}

}  // namespace

Deadline Deadline::After(std::chrono::milliseconds budget) {
  // now() + a caller's milliseconds::max() would overflow; a year is "never"
  // for a rendezvous and still a deadline.
  constexpr std::chrono::milliseconds kLongest = std::chrono::hours(24 * 365);
  budget = std::clamp(budget, std::chrono::milliseconds(0), kLongest);
  return Deadline{std::chrono::steady_clock::now() + budget, budget};
}

std::string DescribeKey(absl::string_view key) {
  constexpr std::size_t kShown = 120;
  std::string shown = absl::CHexEscape(key.substr(0, kShown));
  if (key.size() > kShown) {
    absl::StrAppend(&shown, "... (", key.size(), " bytes)");
  }
  return absl::StrCat("'", shown, "'");
}

std::string DescribeKeys(const std::vector<std::string>& keys) {
  if (keys.size() == 1) return absl::StrCat("key ", DescribeKey(keys[0]));
  std::string out = "keys ";
  constexpr std::size_t kShown = 3;
  for (std::size_t i = 0; i < keys.size() && i < kShown; ++i) {
    absl::StrAppend(&out, i == 0 ? "" : ", ", DescribeKey(keys[i]));
  }
  if (keys.size() > kShown) {
    absl::StrAppend(&out, " (and ", keys.size() - kShown, " more)");
  }
  if (keys.empty()) out = "no keys";
  return out;
}

absl::StatusOr<ParseOutcome> ParseReply(ReplyKind kind, absl::string_view bytes,
                                        const Limits& limits, const ReplyContext& context) {
  ParseOutcome outcome;
  switch (kind) {
    case ReplyKind::kValue: {
      if (!HaveFixed(bytes, sizeof(uint64_t), &outcome)) return outcome;
      const uint64_t length = ReadRaw<uint64_t>(bytes);
      if (length > limits.max_value_bytes) {
        return absl::DataLossError(absl::StrCat(Peer(context), " sent a value length of ", length,
                                                " bytes for ", context.what, ": expected at most ",
                                                limits.max_value_bytes,
                                                " bytes (comm's limit for a rendezvous value)"));
      }
      // No overflow: length <= max_value_bytes, a size_t.
      const std::size_t total = sizeof(uint64_t) + static_cast<std::size_t>(length);
      outcome.complete = false;
      outcome.consumed = 0;
      if (bytes.size() < total) {
        outcome.more = total - bytes.size();
        return outcome;
      }
      outcome.complete = true;
      outcome.consumed = total;
      outcome.reply.value.assign(bytes.data() + sizeof(uint64_t), static_cast<std::size_t>(length));
      return outcome;
    }
    case ReplyKind::kInt64:
    case ReplyKind::kCount: {
      if (!HaveFixed(bytes, sizeof(int64_t), &outcome)) return outcome;
      outcome.reply.number = ReadRaw<int64_t>(bytes);
      if (kind == ReplyKind::kCount && outcome.reply.number < 0) {
        return absl::DataLossError(absl::StrCat(Peer(context), " sent a count of ",
                                                outcome.reply.number, " for ", context.what,
                                                ": expected a number >= 0"));
      }
      return outcome;
    }
    case ReplyKind::kPingEcho: {
      if (!HaveFixed(bytes, sizeof(uint32_t), &outcome)) return outcome;
      outcome.reply.number = ReadRaw<uint32_t>(bytes);
      return outcome;
    }
    case ReplyKind::kCheck:
    case ReplyKind::kWaitResult:
    case ReplyKind::kCancelAck: {
      if (!HaveFixed(bytes, 1, &outcome)) return outcome;
      const uint8_t byte = static_cast<uint8_t>(bytes[0]);
      const char* expected = "";
      if (kind == ReplyKind::kCheck) {
        if (byte == kCheckReady || byte == kCheckNotReady) {
          outcome.reply.flag = byte == kCheckReady;
          return outcome;
        }
        expected = "0 (ready) or 1 (not ready)";
      } else if (kind == ReplyKind::kWaitResult) {
        if (byte == kStopWaiting) return outcome;
        expected = "0 (STOP_WAITING)";
      } else {
        if (byte == kWaitCanceled || byte == kStopWaiting) {
          outcome.reply.flag = byte == kWaitCanceled;
          return outcome;
        }
        expected = "1 (WAIT_CANCELED) or 0 (STOP_WAITING)";
      }
      return absl::DataLossError(
          absl::StrFormat("%s sent the byte 0x%02x in reply to %s: expected %s", Peer(context),
                          byte, context.what, expected));
    }
  }
  return absl::InternalError(
      absl::StrCat("ParseReply: unknown reply kind ", static_cast<int>(kind)));
}

StoreSession::StoreSession(std::unique_ptr<Transport> transport, const Limits& limits)
    : transport_(std::move(transport)), limits_(limits) {}

absl::Status StoreSession::Break(absl::Status status) {
  if (broken_.ok() && !status.ok()) broken_ = status;
  return status;
}

absl::Status StoreSession::Usable() const {
  if (broken_.ok()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("the connection to rendezvous peer ", peer(),
                   " is unusable after an earlier error: ", broken_.message()));
}

absl::Status StoreSession::CheckKey(absl::string_view key, absl::string_view op) const {
  const std::size_t wire = std::string(kKeyPrefix).size() + key.size();
  if (wire > limits_.max_key_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, " of key ", DescribeKey(key), " on rendezvous peer ", peer(),
                     ": the key is ", wire, " bytes on the wire, expected at most ",
                     limits_.max_key_bytes, " (c10d's libuv TCPStore server drops longer ones)"));
  }
  return absl::OkStatus();
}

absl::Status StoreSession::CheckValue(absl::string_view key, absl::string_view value,
                                      absl::string_view op) const {
  if (value.size() > limits_.max_value_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, " of key ", DescribeKey(key), " on rendezvous peer ", peer(),
                     ": the value is ", value.size(), " bytes, expected at most ",
                     limits_.max_value_bytes, " (comm's limit for a rendezvous value)"));
  }
  return absl::OkStatus();
}

absl::Status StoreSession::SendRequest(const std::string& bytes, absl::string_view what,
                                       const Deadline& deadline) {
  absl::Status sent = transport_->Send(bytes, deadline);
  if (sent.ok()) return sent;
  if (absl::IsDeadlineExceeded(sent)) {
    return Break(absl::DeadlineExceededError(
        absl::StrCat("rendezvous peer ", peer(), " did not take the request for ", what, " within ",
                     deadline.budget.count(), " ms (it is not reading)")));
  }
  return Break(absl::Status(
      sent.code(), absl::StrCat("rendezvous peer ", peer(), ": sending the request for ", what,
                                " failed: ", sent.message())));
}

absl::StatusOr<Reply> StoreSession::ReadReply(ReplyKind kind, absl::string_view what,
                                              const Deadline& deadline) {
  // Bytes are read only as far as the parser asks, so nothing of a later
  // reply is ever consumed here, and a value grows only as its bytes arrive.
  constexpr std::size_t kChunk = 64 * 1024;
  std::string buffer;
  const ReplyContext context{peer(), what};
  while (true) {
    absl::StatusOr<ParseOutcome> parsed = ParseReply(kind, buffer, limits_, context);
    if (!parsed.ok()) return Break(parsed.status());
    if (parsed->complete) return std::move(parsed->reply);
    absl::Status got = transport_->Receive(std::min(parsed->more, kChunk), deadline, &buffer);
    if (got.ok()) continue;
    const std::string received = absl::StrCat(
        buffer.size(), " bytes of the reply received, at least ", parsed->more, " more expected");
    if (absl::IsDeadlineExceeded(got)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "rendezvous peer ", peer(), " did not answer ", what, " within ", deadline.budget.count(),
          " ms (", received, "; is it a c10d TCPStore server, and alive?)"));
    }
    return Break(
        absl::Status(got.code(), absl::StrCat("rendezvous peer ", peer(), " ", got.message(),
                                              " while ", what, " was awaited (", received, ")")));
  }
}

absl::Status StoreSession::Handshake(uint32_t nonce, const Deadline& deadline) {
  if (absl::Status usable = Usable(); !usable.ok()) return usable;
  std::string request;
  AppendQuery(&request, Query::kValidate);
  AppendRaw<uint32_t>(&request, kValidationMagic);
  AppendQuery(&request, Query::kPing);
  AppendRaw<uint32_t>(&request, nonce);
  const char* what = "the handshake (validate and ping)";
  if (absl::Status sent = SendRequest(request, what, deadline); !sent.ok()) {
    return sent;
  }
  absl::StatusOr<Reply> reply = ReadReply(ReplyKind::kPingEcho, what, deadline);
  if (!reply.ok()) return Break(reply.status());
  if (static_cast<uint32_t>(reply->number) != nonce) {
    return Break(absl::DataLossError(
        absl::StrFormat("rendezvous peer %s answered the ping with 0x%08x: expected its nonce "
                        "0x%08x echoed (is it a c10d TCPStore server?)",
                        peer(), static_cast<uint32_t>(reply->number), nonce)));
  }
  return absl::OkStatus();
}

absl::Status StoreSession::AnnounceWorker(const Deadline& deadline) {
  if (absl::Status usable = Usable(); !usable.ok()) return usable;
  std::string request;
  AppendQuery(&request, Query::kAdd);
  AppendBytes(&request, kWorkerCounterKey);
  AppendRaw<int64_t>(&request, 1);
  const std::string what =
      absl::StrCat("key ", DescribeKey(kWorkerCounterKey), " (add, joining the store)");
  if (absl::Status sent = SendRequest(request, what, deadline); !sent.ok()) return sent;
  absl::StatusOr<Reply> reply = ReadReply(ReplyKind::kInt64, what, deadline);
  if (!reply.ok()) return Break(reply.status());
  return absl::OkStatus();
}

absl::Status StoreSession::Set(absl::string_view key, absl::string_view value,
                               const Deadline& deadline) {
  if (absl::Status usable = Usable(); !usable.ok()) return usable;
  if (absl::Status ok = CheckKey(key, "set"); !ok.ok()) return ok;
  if (absl::Status ok = CheckValue(key, value, "set"); !ok.ok()) return ok;
  std::string request;
  AppendQuery(&request, Query::kSet);
  AppendKey(&request, key);
  AppendBytes(&request, value);
  return SendRequest(request, absl::StrCat("key ", DescribeKey(key), " (set)"), deadline);
}

absl::StatusOr<std::string> StoreSession::Get(absl::string_view key, const Deadline& deadline) {
  if (absl::Status usable = Usable(); !usable.ok()) return usable;
  if (absl::Status ok = CheckKey(key, "get"); !ok.ok()) return ok;
  if (absl::Status waited = Wait({std::string(key)}, deadline); !waited.ok()) {
    return waited;
  }
  std::string request;
  AppendQuery(&request, Query::kGet);
  AppendKey(&request, key);
  const std::string what = absl::StrCat("key ", DescribeKey(key), " (get)");
  if (absl::Status sent = SendRequest(request, what, deadline); !sent.ok()) return sent;
  absl::StatusOr<Reply> reply = ReadReply(ReplyKind::kValue, what, deadline);
  if (!reply.ok()) return Break(reply.status());
  return std::move(reply->value);
}

absl::StatusOr<int64_t> StoreSession::Add(absl::string_view key, int64_t delta,
                                          const Deadline& deadline) {
  if (absl::Status usable = Usable(); !usable.ok()) return usable;
  if (absl::Status ok = CheckKey(key, "add"); !ok.ok()) return ok;
  std::string request;
  AppendQuery(&request, Query::kAdd);
  AppendKey(&request, key);
  AppendRaw<int64_t>(&request, delta);
  const std::string what = absl::StrCat("key ", DescribeKey(key), " (add)");
  if (absl::Status sent = SendRequest(request, what, deadline); !sent.ok()) return sent;
  absl::StatusOr<Reply> reply = ReadReply(ReplyKind::kInt64, what, deadline);
  if (!reply.ok()) return Break(reply.status());
  return reply->number;
}

absl::StatusOr<bool> StoreSession::Check(const std::vector<std::string>& keys,
                                         const Deadline& deadline) {
  if (absl::Status usable = Usable(); !usable.ok()) return usable;
  if (keys.size() > limits_.max_keys) {
    return absl::InvalidArgumentError(absl::StrCat("check of ", keys.size(),
                                                   " keys on rendezvous peer ", peer(),
                                                   ": expected at most ", limits_.max_keys));
  }
  std::string request;
  AppendQuery(&request, Query::kCheck);
  AppendRaw<uint64_t>(&request, keys.size());
  for (const std::string& key : keys) {
    if (absl::Status ok = CheckKey(key, "check"); !ok.ok()) return ok;
    AppendKey(&request, key);
  }
  const std::string what = absl::StrCat(DescribeKeys(keys), " (check)");
  if (absl::Status sent = SendRequest(request, what, deadline); !sent.ok()) return sent;
  absl::StatusOr<Reply> reply = ReadReply(ReplyKind::kCheck, what, deadline);
  if (!reply.ok()) return Break(reply.status());
  return reply->flag;
}

absl::Status StoreSession::Wait(const std::vector<std::string>& keys, const Deadline& deadline,
                                std::chrono::milliseconds cancel_grace) {
  if (absl::Status usable = Usable(); !usable.ok()) return usable;
  if (keys.size() > limits_.max_keys) {
    return absl::InvalidArgumentError(absl::StrCat("wait for ", keys.size(),
                                                   " keys on rendezvous peer ", peer(),
                                                   ": expected at most ", limits_.max_keys));
  }
  std::string request;
  AppendQuery(&request, Query::kWait);
  AppendRaw<uint64_t>(&request, keys.size());
  for (const std::string& key : keys) {
    if (absl::Status ok = CheckKey(key, "wait"); !ok.ok()) return ok;
    AppendKey(&request, key);
  }
  const std::string what = absl::StrCat(DescribeKeys(keys), " (wait)");
  if (absl::Status sent = SendRequest(request, what, deadline); !sent.ok()) return sent;
  absl::StatusOr<Reply> reply = ReadReply(ReplyKind::kWaitResult, what, deadline);
  if (reply.ok()) return absl::OkStatus();
  if (!absl::IsDeadlineExceeded(reply.status())) return Break(reply.status());
  // The keys are not there (or the peer is silent). The server still holds
  // our wait: cancel it so the stream stays in step for the next operation.
  const absl::Status timed_out = absl::DeadlineExceededError(
      absl::StrCat(DescribeKeys(keys), " not set on rendezvous peer ", peer(), " within ",
                   deadline.budget.count(), " ms (wait)"));
  const Deadline grace = Deadline::After(cancel_grace);
  std::string cancel;
  AppendQuery(&cancel, Query::kCancelWait);
  const std::string cancel_what =
      absl::StrCat("the cancellation of the wait for ", DescribeKeys(keys));
  if (absl::Status sent = SendRequest(cancel, cancel_what, grace); !sent.ok()) {
    return Break(timed_out);
  }
  for (int replies = 0; replies < 2; ++replies) {
    absl::StatusOr<Reply> ack = ReadReply(ReplyKind::kCancelAck, cancel_what, grace);
    if (!ack.ok()) {
      (void)Break(ack.status());
      return absl::DeadlineExceededError(
          absl::StrCat(timed_out.message(),
                       "; then the cancellation failed, so the connection "
                       "is given up: ",
                       ack.status().message()));
    }
    // A STOP_WAITING that crossed our cancel comes first; the ack follows.
    if (ack->flag) return timed_out;
  }
  return Break(absl::DataLossError(
      absl::StrCat("rendezvous peer ", peer(), " answered ", cancel_what,
                   " with STOP_WAITING twice: expected WAIT_CANCELED after at most one")));
}

absl::StatusOr<bool> StoreSession::DeleteKey(absl::string_view key, const Deadline& deadline) {
  if (absl::Status usable = Usable(); !usable.ok()) return usable;
  if (absl::Status ok = CheckKey(key, "delete"); !ok.ok()) return ok;
  std::string request;
  AppendQuery(&request, Query::kDeleteKey);
  AppendKey(&request, key);
  const std::string what = absl::StrCat("key ", DescribeKey(key), " (delete)");
  if (absl::Status sent = SendRequest(request, what, deadline); !sent.ok()) return sent;
  absl::StatusOr<Reply> reply = ReadReply(ReplyKind::kCount, what, deadline);
  if (!reply.ok()) return Break(reply.status());
  if (reply->number > 1) {
    return Break(absl::DataLossError(absl::StrCat("rendezvous peer ", peer(), " said it deleted ",
                                                  reply->number, " entries for ", what,
                                                  ": expected 0 or 1")));
  }
  return reply->number == 1;
}

absl::StatusOr<int64_t> StoreSession::NumKeys(const Deadline& deadline) {
  if (absl::Status usable = Usable(); !usable.ok()) return usable;
  std::string request;
  AppendQuery(&request, Query::kGetNumKeys);
  const char* what = "the number of keys";
  if (absl::Status sent = SendRequest(request, what, deadline); !sent.ok()) return sent;
  absl::StatusOr<Reply> reply = ReadReply(ReplyKind::kCount, what, deadline);
  if (!reply.ok()) return Break(reply.status());
  return reply->number;
}

absl::StatusOr<std::string> StoreSession::CompareSet(absl::string_view key,
                                                     absl::string_view expected,
                                                     absl::string_view desired,
                                                     const Deadline& deadline) {
  if (absl::Status usable = Usable(); !usable.ok()) return usable;
  if (absl::Status ok = CheckKey(key, "compare_set"); !ok.ok()) return ok;
  if (absl::Status ok = CheckValue(key, expected, "compare_set"); !ok.ok()) return ok;
  if (absl::Status ok = CheckValue(key, desired, "compare_set"); !ok.ok()) return ok;
  std::string request;
  AppendQuery(&request, Query::kCompareSet);
  AppendKey(&request, key);
  AppendBytes(&request, expected);
  AppendBytes(&request, desired);
  const std::string what = absl::StrCat("key ", DescribeKey(key), " (compare_set)");
  if (absl::Status sent = SendRequest(request, what, deadline); !sent.ok()) return sent;
  absl::StatusOr<Reply> reply = ReadReply(ReplyKind::kValue, what, deadline);
  if (!reply.ok()) return Break(reply.status());
  return std::move(reply->value);
}

}  // namespace store_wire
}  // namespace internal
}  // namespace comm
