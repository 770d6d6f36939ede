#include "comm/testing/hostile_peer.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <exception>
#include <utility>

namespace comm {
namespace testing {
namespace {

// Query bytes of c10d's TCPStore protocol, written out again from c10d's
// TCPStoreBackend.hpp rather than taken from comm/internal/store_protocol.h:
// this peer is the client's independent reference, so a wrong number there
// must not be mirrored here.
enum : uint8_t {
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

// Reads exactly n bytes, waking every 50 ms to see whether to stop. False
// when the connection closed or the peer is stopping.
bool ReadExact(int fd, size_t n, std::string* out, const std::atomic<bool>& stop) {
  out->clear();
  while (out->size() < n) {
    if (stop.load()) return false;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    char buffer[4096];
    const ssize_t got = recv(fd, buffer, std::min(sizeof buffer, n - out->size()), 0);
    if (got <= 0) return false;
    out->append(buffer, static_cast<size_t>(got));
  }
  return true;
}

bool ReadU64(int fd, uint64_t* value, const std::atomic<bool>& stop) {
  std::string bytes;
  if (!ReadExact(fd, 8, &bytes, stop)) return false;
  std::memcpy(value, bytes.data(), 8);
  return true;
}

bool ReadString(int fd, std::string* value, const std::atomic<bool>& stop) {
  uint64_t length = 0;
  // A test peer trusts our client, but not without limit.
  return ReadU64(fd, &length, stop) && length <= (64u << 20) &&
         ReadExact(fd, static_cast<size_t>(length), value, stop);
}

bool WriteAll(int fd, const std::string& bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

// Reads one request; false when the connection ended or was not the protocol.
bool ReadRequest(int fd, StoreRequest* request, const std::atomic<bool>& stop) {
  std::string byte;
  if (!ReadExact(fd, 1, &byte, stop)) return false;
  *request = StoreRequest{};
  request->query = static_cast<uint8_t>(byte[0]);
  std::string text;
  uint64_t count = 0;
  switch (request->query) {
    case kValidate:
    case kPing: {
      if (!ReadExact(fd, 4, &text, stop)) return false;
      uint32_t number = 0;
      std::memcpy(&number, text.data(), 4);
      request->number = number;
      return true;
    }
    case kSet:
      request->keys.resize(1);
      request->values.resize(1);
      return ReadString(fd, &request->keys[0], stop) && ReadString(fd, &request->values[0], stop);
    case kCompareSet:
      request->keys.resize(1);
      request->values.resize(2);
      return ReadString(fd, &request->keys[0], stop) && ReadString(fd, &request->values[0], stop) &&
             ReadString(fd, &request->values[1], stop);
    case kGet:
    case kDeleteKey: request->keys.resize(1); return ReadString(fd, &request->keys[0], stop);
    case kAdd: {
      request->keys.resize(1);
      uint64_t delta = 0;
      if (!ReadString(fd, &request->keys[0], stop) || !ReadU64(fd, &delta, stop)) {
        return false;
      }
      request->number = static_cast<int64_t>(delta);
      return true;
    }
    case kCheck:
    case kWait:
      if (!ReadU64(fd, &count, stop) || count > 1024) return false;
      request->keys.resize(static_cast<size_t>(count));
      for (std::string& key : request->keys) {
        if (!ReadString(fd, &key, stop)) return false;
      }
      return true;
    case kCancelWait:
    case kGetNumKeys: return true;
    default: return false;
  }
}

}  // namespace

std::string HostilePeer::U64(uint64_t value) {
  std::string bytes(8, '\0');
  std::memcpy(bytes.data(), &value, 8);
  return bytes;
}

std::string HostilePeer::I64(int64_t value) { return U64(static_cast<uint64_t>(value)); }

HostilePeer::HostilePeer(Behaviour behaviour) : behaviour_(std::move(behaviour)) {
  listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (listen_fd_ < 0 || bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      listen(listen_fd_, 16) != 0 ||
      getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    port_ = -1;  // tests see an impossible port and fail naming it
    return;
  }
  port_ = ntohs(addr.sin_port);
  thread_ = std::thread([this] {
    try {
      Run();
    } catch (...) {
      // A test helper: a failure here shows up as the client's error.
    }
  });
}

HostilePeer::~HostilePeer() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) close(listen_fd_);
}

std::vector<StoreRequest> HostilePeer::requests() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return seen_;
}

void HostilePeer::Run() {
  while (!stop_.load()) {
    if (behaviour_.kind == Behaviour::kListenOnly) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    pollfd p{listen_fd_, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Serve(fd);
    close(fd);
  }
}

void HostilePeer::Serve(int fd) {
  std::string sink;
  if (behaviour_.kind == Behaviour::kGarbage && !WriteAll(fd, behaviour_.garbage)) return;
  if (behaviour_.kind != Behaviour::kScripted) {
    while (ReadExact(fd, 1, &sink, stop_)) {
    }
    return;
  }
  StoreRequest request;
  while (ReadRequest(fd, &request, stop_)) {
    if (request.query == kValidate) continue;
    if (request.query == kPing) {
      std::string echo(4, '\0');
      const uint32_t nonce = static_cast<uint32_t>(request.number);
      std::memcpy(echo.data(), &nonce, 4);
      if (!WriteAll(fd, echo)) return;
      continue;
    }
    if (request.query == kAdd && request.keys[0] == "init/") {
      if (!WriteAll(fd, I64(1))) return;
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      seen_.push_back(request);
    }
    const PeerAction action = behaviour_.script(request);
    if (!WriteAll(fd, action.reply) || action.close) return;
    if (!action.drip.empty()) {
      for (size_t i = 0; !stop_.load(); i = (i + 1) % action.drip.size()) {
        if (!WriteAll(fd, action.drip.substr(i, 1))) return;
        std::this_thread::sleep_for(action.drip_interval);
      }
      return;
    }
    if (action.go_silent) {
      while (ReadExact(fd, 1, &sink, stop_)) {
      }
      return;
    }
  }
}

}  // namespace testing
}  // namespace comm
