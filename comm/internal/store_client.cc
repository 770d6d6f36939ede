#include "comm/internal/store_client.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <thread>
#include <utility>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

namespace comm {
namespace internal {
namespace {

using Clock = std::chrono::steady_clock;
using store_wire::Deadline;

std::string ErrnoText(int err) { return absl::StrCat(std::strerror(err), " (errno ", err, ")"); }

// Milliseconds left until `deadline`, rounded up so a wait does not end a
// hair early and spin; 0 once it has passed.
int RemainingMs(const Deadline& deadline) {
  const auto left = deadline.at - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return static_cast<int>(std::min<int64_t>(ms, 1 << 30));
}

// Waits for `events` on `fd` until the deadline: true when ready, false when
// the deadline passed first. Errors of poll itself (not EINTR) count as
// ready, so the following call reports them.
bool PollUntil(int fd, short events, const Deadline& deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    const int rc = poll(&p, 1, RemainingMs(deadline));
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR) return true;
    if (rc == 0 && Clock::now() >= deadline.at) return false;
  }
}

std::string FormatPeer(const std::string& host, int port) {
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

struct Address {
  sockaddr_storage storage{};
  socklen_t length = 0;
  int family = AF_UNSPEC;
};

struct Resolution {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;
  int rc = 0;
  std::vector<Address> addresses;
};

void RunGetaddrinfo(const std::string& host, const std::string& port, int flags, Resolution* out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = flags | AI_NUMERICSERV;
  addrinfo* list = nullptr;
  out->rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &list);
  if (out->rc != 0) return;
  for (addrinfo* a = list; a != nullptr; a = a->ai_next) {
    if (a->ai_addrlen > sizeof(sockaddr_storage)) continue;
    Address address;
    std::memcpy(&address.storage, a->ai_addr, a->ai_addrlen);
    address.length = a->ai_addrlen;
    address.family = a->ai_family;
    out->addresses.push_back(address);
  }
  freeaddrinfo(list);
}

// getaddrinfo has no timeout of its own and a name may take the resolver's
// many seconds; a numeric address is parsed at once, a name is resolved on a
// detached thread we stop waiting for at the deadline.
absl::StatusOr<std::vector<Address>> Resolve(const std::string& host, int port,
                                             const std::string& peer, const Deadline& deadline) {
  const std::string service = std::to_string(port);
  Resolution numeric;
  RunGetaddrinfo(host, service, AI_NUMERICHOST, &numeric);
  if (numeric.rc == 0 && !numeric.addresses.empty()) return numeric.addresses;

  auto state = std::make_shared<Resolution>();
  try {
    std::thread([state, host, service] {
      // Nothing may escape a thread: a throw here would be std::terminate.
      try {
        Resolution result;
        RunGetaddrinfo(host, service, 0, &result);
        std::lock_guard<std::mutex> lock(state->mutex);
        state->rc = result.rc;
        state->addresses = std::move(result.addresses);
        state->done = true;
      } catch (...) {
        std::lock_guard<std::mutex> lock(state->mutex);
        state->rc = EAI_MEMORY;
        state->done = true;
      }
      state->done_cv.notify_all();
    }).detach();
  } catch (const std::exception& e) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot resolve rendezvous peer ", peer,
                                                     ": no thread for the lookup: ", e.what()));
  }
  std::unique_lock<std::mutex> lock(state->mutex);
  if (!state->done_cv.wait_until(lock, deadline.at, [&] { return state->done; })) {
    return absl::DeadlineExceededError(
        absl::StrCat("cannot resolve rendezvous peer ", peer, ": the name lookup of '", host,
                     "' did not finish within ", deadline.budget.count(), " ms"));
  }
  if (state->rc != 0 || state->addresses.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve rendezvous peer ", peer, ": '", host,
                     "' is not an address "
                     "and the name lookup failed: ",
                     state->rc != 0 ? gai_strerror(state->rc) : "no TCP address"));
  }
  return state->addresses;
}

class SocketTransport final : public store_wire::Transport {
 public:
  SocketTransport(int fd, std::string peer) : fd_(fd), peer_(std::move(peer)) {}
  ~SocketTransport() override { close(fd_); }
  SocketTransport(const SocketTransport&) = delete;
  SocketTransport& operator=(const SocketTransport&) = delete;

  absl::Status Send(absl::string_view bytes, const Deadline& deadline) override {
    std::size_t sent = 0;
    while (sent < bytes.size()) {
      const ssize_t n =
          send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        sent += static_cast<std::size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (!PollUntil(fd_, POLLOUT, deadline)) {
          return absl::DeadlineExceededError("send timed out");
        }
        continue;
      }
      return absl::UnavailableError(
          absl::StrCat("send failed: ", ErrnoText(n < 0 ? errno : EPIPE)));
    }
    return absl::OkStatus();
  }

  absl::Status Receive(std::size_t max, const Deadline& deadline, std::string* out) override {
    char buffer[64 * 1024];
    max = std::min(max, sizeof buffer);
    while (true) {
      if (!PollUntil(fd_, POLLIN, deadline)) {
        return absl::DeadlineExceededError("no data");
      }
      const ssize_t n = recv(fd_, buffer, max, MSG_DONTWAIT);
      if (n > 0) {
        out->append(buffer, static_cast<std::size_t>(n));
        return absl::OkStatus();
      }
      if (n == 0) return absl::UnavailableError("closed the connection");
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return absl::UnavailableError(absl::StrCat("broke the connection: ", ErrnoText(errno)));
    }
  }

  const std::string& peer() const override { return peer_; }

 private:
  const int fd_;
  const std::string peer_;
};

// One non-blocking connect to `address`, bounded by the deadline: the fd,
// or -1 with `*error` saying why.
int ConnectOnce(const Address& address, const Deadline& deadline, std::string* error) {
  const int fd = socket(address.family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *error = absl::StrCat("socket(): ", ErrnoText(errno));
    return -1;
  }
  int rc = connect(fd, reinterpret_cast<const sockaddr*>(&address.storage), address.length);
  if (rc != 0 && errno == EINPROGRESS) {
    if (!PollUntil(fd, POLLOUT, deadline)) {
      *error = "the TCP connection was not established in time";
      close(fd);
      return -1;
    }
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    rc = err == 0 ? 0 : -1;
    errno = err;
  }
  if (rc != 0) {
    *error = ErrnoText(errno);
    close(fd);
    return -1;
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

[[noreturn]] void Throw(const absl::Status& status) {
  if (absl::IsUnavailable(status)) {
    C10_THROW_ERROR(DistNetworkError, std::string(status.message()));
  }
  C10_THROW_ERROR(DistStoreError, std::string(status.message()));
}

template <typename T>
T ValueOrThrow(absl::StatusOr<T> value) {
  if (!value.ok()) Throw(value.status());
  return *std::move(value);
}

std::string ToString(const std::vector<uint8_t>& bytes) {
  return std::string(bytes.begin(), bytes.end());
}

std::vector<uint8_t> ToBytes(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

}  // namespace

absl::StatusOr<std::unique_ptr<store_wire::Transport>> ConnectSocket(const std::string& host,
                                                                     int port,
                                                                     const Deadline& deadline) {
  const std::string peer = FormatPeer(host, port);
  absl::StatusOr<std::vector<Address>> addresses = Resolve(host, port, peer, deadline);
  if (!addresses.ok()) return addresses.status();
  // Rank 0 may not be listening yet: retry, backing off to 1 s, as c10d does.
  auto backoff = std::chrono::milliseconds(50);
  std::string last_error;
  int attempts = 0;
  while (true) {
    for (const Address& address : *addresses) {
      ++attempts;
      const int fd = ConnectOnce(address, deadline, &last_error);
      if (fd >= 0) {
        return std::unique_ptr<store_wire::Transport>(std::make_unique<SocketTransport>(fd, peer));
      }
    }
    const auto left = deadline.at - Clock::now();
    if (left <= Clock::duration::zero()) break;
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, left));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("could not connect to rendezvous peer ", peer, " within ",
                   deadline.budget.count(), " ms (", attempts, " attempts; last: ", last_error,
                   "): is rank 0 running, and MASTER_ADDR/MASTER_PORT right?"));
}

StoreClient::StoreClient(Token, const StoreClientOptions& options,
                         std::unique_ptr<store_wire::StoreSession> session)
    : c10d::Store(options.timeout),
      options_(options),
      peer_(session->peer()),
      session_(std::move(session)) {}

absl::StatusOr<c10::intrusive_ptr<StoreClient>> StoreClient::Connect(
    const StoreClientOptions& options) {
  if (options.port <= 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous port ", options.port, ": expected a TCP port in [1, 65535]"));
  }
  if (options.timeout.count() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous timeout ", options.timeout.count(),
                                                   " ms: expected a positive duration"));
  }
  const Deadline deadline = Deadline::After(options.timeout);
  absl::StatusOr<std::unique_ptr<store_wire::Transport>> transport =
      ConnectSocket(options.host, options.port, deadline);
  if (!transport.ok()) return transport.status();
  auto session = std::make_unique<store_wire::StoreSession>(*std::move(transport), options.limits);
  // A nonce a stray service will not echo by chance.
  const uint32_t nonce = static_cast<uint32_t>(getpid()) * 2654435761u ^
                         static_cast<uint32_t>(Clock::now().time_since_epoch().count());
  if (absl::Status shook = session->Handshake(nonce, deadline); !shook.ok()) {
    return shook;
  }
  if (options.announce_worker) {
    if (absl::Status joined = session->AnnounceWorker(deadline); !joined.ok()) {
      return joined;
    }
  }
  return c10::make_intrusive<StoreClient>(Token{}, options, std::move(session));
}

Deadline StoreClient::OpDeadline(std::chrono::milliseconds timeout) const {
  return Deadline::After(timeout.count() > 0 ? timeout : options_.timeout);
}

absl::StatusOr<int64_t> StoreClient::TryAdd(const std::string& key, int64_t delta,
                                            std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  return session_->Add(key, delta, timeout.count() > 0 ? OpDeadline(timeout) : OpDeadline());
}

absl::StatusOr<std::string> StoreClient::TryGet(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return session_->Get(key, OpDeadline());
}

absl::Status StoreClient::TrySet(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(mutex_);
  return session_->Set(key, value, OpDeadline());
}

c10::intrusive_ptr<c10d::Store> StoreClient::clone() {
  StoreClientOptions options = options_;
  options.timeout = timeout_.count() > 0 ? timeout_ : options_.timeout;
  options.announce_worker = false;  // the same worker, another connection
  return ValueOrThrow(Connect(options));
}

void StoreClient::set(const std::string& key, const std::vector<uint8_t>& value) {
  std::lock_guard<std::mutex> lock(mutex_);
  const absl::Status status = session_->Set(key, ToString(value), OpDeadline());
  if (!status.ok()) Throw(status);
}

std::vector<uint8_t> StoreClient::compareSet(const std::string& key,
                                             const std::vector<uint8_t>& expected,
                                             const std::vector<uint8_t>& desired) {
  std::lock_guard<std::mutex> lock(mutex_);
  return ToBytes(
      ValueOrThrow(session_->CompareSet(key, ToString(expected), ToString(desired), OpDeadline())));
}

std::vector<uint8_t> StoreClient::get(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return ToBytes(ValueOrThrow(session_->Get(key, OpDeadline())));
}

int64_t StoreClient::add(const std::string& key, int64_t value) {
  std::lock_guard<std::mutex> lock(mutex_);
  return ValueOrThrow(session_->Add(key, value, OpDeadline()));
}

bool StoreClient::deleteKey(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return ValueOrThrow(session_->DeleteKey(key, OpDeadline()));
}

bool StoreClient::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mutex_);
  return ValueOrThrow(session_->Check(keys, OpDeadline()));
}

int64_t StoreClient::getNumKeys() {
  std::lock_guard<std::mutex> lock(mutex_);
  return ValueOrThrow(session_->NumKeys(OpDeadline()));
}

void StoreClient::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void StoreClient::wait(const std::vector<std::string>& keys,
                       const std::chrono::milliseconds& timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  const absl::Status status = session_->Wait(keys, OpDeadline(timeout));
  if (!status.ok()) Throw(status);
}

}  // namespace internal
}  // namespace comm
