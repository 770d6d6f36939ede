#include "comm/process_group.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <functional>
#include <thread>
#include <utility>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "comm/internal/gloo_threads.h"
#include "comm/internal/group_state.h"
#include "comm/internal/nccl.h"
#include "comm/internal/store_client.h"
#include "comm/slurm.h"

namespace comm {

ProcessGroup::ProcessGroup() : state_(std::make_shared<internal::GroupState>()) {}

ProcessGroup::ProcessGroup(std::shared_ptr<internal::GroupState> state)
    : state_(std::move(state)) {}

int ProcessGroup::rank() const { return state_->rank; }
int ProcessGroup::size() const { return state_->size; }
bool ProcessGroup::is_member() const { return state_->pg.defined(); }
const std::vector<int>& ProcessGroup::global_ranks() const { return state_->global_ranks; }
int ProcessGroup::global_rank() const { return state_->global_rank; }
const std::string& ProcessGroup::backend() const { return state_->backend; }
std::chrono::milliseconds ProcessGroup::timeout() const { return state_->timeout; }
const std::string& ProcessGroup::name() const { return state_->name; }
c10::intrusive_ptr<c10d::ProcessGroup> ProcessGroup::c10d_group() const { return state_->pg; }

namespace {

// The message of an exception from c10d without the C++ backtrace c10::Error
// appends, so our errors stay one readable paragraph.
std::string describe(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return c10_error->what_without_backtrace();
  }
  return e.what();
}

absl::StatusOr<int> int_from_env(const char* name, bool required, int fallback,
                                 const std::string& expected) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') {
    if (required) {
      return absl::InvalidArgumentError(
          absl::StrCat("environment variable ", name, " is not set: expected ", expected,
                       " (set by //tools:launch or torchrun, or pass it explicitly)"));
    }
    return fallback;
  }
  int parsed = 0;
  if (!absl::SimpleAtoi(value, &parsed)) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", name, "='", value, "': expected ", expected));
  }
  return parsed;
}

bool is_loopback(const std::string& host) {
  if (host == "localhost") return true;
  in_addr addr{};
  if (inet_pton(AF_INET, host.c_str(), &addr) == 1) {
    return (ntohl(addr.s_addr) >> 24) == 127;
  }
  return host == "::1";
}

struct Rendezvous {
  c10::intrusive_ptr<c10d::Store> store;
  std::string description;
  std::string master_addr;
  // The store's add, absl-style, bounded by `timeout`: comm's own client
  // reports its errors with their codes; c10d's stores throw, caught here.
  std::function<absl::StatusOr<int64_t>(const std::string& key, int64_t delta,
                                        std::chrono::milliseconds timeout)>
      add;
};

std::function<absl::StatusOr<int64_t>(const std::string&, int64_t, std::chrono::milliseconds)>
c10d_add(const c10::intrusive_ptr<c10d::Store>& store) {
  return [store](const std::string& key, int64_t delta,
                 std::chrono::milliseconds) -> absl::StatusOr<int64_t> {
    try {
      return store->add(key, delta);
    } catch (const std::exception& e) {
      return absl::UnavailableError(describe(e));
    }
  };
}

// Where the store at MASTER_ADDR:MASTER_PORT comes from.
struct StoreServer {
  // torchrun's agent serves it (TORCHELASTIC_USE_AGENT_STORE=True): every
  // rank, rank 0 included, is a client, and keys go under
  // "/worker/attempt_<TORCHELASTIC_RESTART_COUNT>" as torch.distributed's
  // env:// rendezvous puts them, so a restarted group starts clean in the
  // agent's long-lived store.
  bool agent = false;
  std::string key_prefix;  // agent only
};

// torchrun's variables, read as torch.distributed reads them.
absl::StatusOr<StoreServer> store_server_from_env() {
  StoreServer server;
  const char* use_agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  if (use_agent == nullptr || std::string(use_agent) != "True") return server;
  auto attempt = int_from_env("TORCHELASTIC_RESTART_COUNT", true, 0,
                              "a restart count >= 0 (torchrun sets it)");
  if (!attempt.ok()) return attempt.status();
  if (*attempt < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable TORCHELASTIC_RESTART_COUNT=", *attempt,
                     ": expected a restart count >= 0 (torchrun sets it)"));
  }
  server.agent = true;
  server.key_prefix = absl::StrCat("/worker/attempt_", *attempt);
  return server;
}

// Rank 0 serves the store with c10d's TCPStore (and talks to it through
// c10d's client: itself), unless torchrun's agent serves it. Every other
// rank connects with comm's own client (internal/store_client.h): c10d's
// trusts the lengths a peer sends and has no deadline in its handshake, so
// whatever listens on MASTER_PORT could abort or hang the rank.
absl::StatusOr<Rendezvous> connect_tcp(const std::string& host, int port, int rank, int world_size,
                                       std::chrono::milliseconds timeout,
                                       const std::string& port_source,
                                       const StoreServer& server = {}) {
  if (port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(port_source, "=", port, ": expected a TCP port in [1, 65535]"));
  }
  const std::string address = absl::StrCat(host, ":", port);
  if (server.agent || rank != 0) {
    internal::StoreClientOptions client_options;
    client_options.host = host;
    client_options.port = port;
    client_options.timeout = timeout;
    auto client = internal::StoreClient::Connect(client_options);
    if (!client.ok()) {
      const std::string whom =
          server.agent
              ? absl::StrCat("could not reach torchrun's store at ", address,
                             " (TORCHELASTIC_USE_AGENT_STORE=True, ", port_source, ")")
              : absl::StrCat("could not join the rendezvous at ", address, " (", port_source,
                             ": is it right, and is rank 0 of ", world_size, " running?)");
      return absl::Status(client.status().code(),
                          absl::StrCat("rank ", rank, " ", whom, ": ", client.status().message()));
    }
    c10::intrusive_ptr<internal::StoreClient> ours = *client;
    if (!server.agent) {
      return Rendezvous{
          ours, absl::StrCat("tcp://", address), host,
          [ours](const std::string& key, int64_t delta, std::chrono::milliseconds budget) {
            return ours->TryAdd(key, delta, budget);
          }};
    }
    const std::string prefix = server.key_prefix;
    return Rendezvous{
        c10::make_intrusive<c10d::PrefixStore>(prefix, ours),
        absl::StrCat("tcp://", address, " (torchrun's agent store, ", prefix, ")"), host,
        [ours, prefix](const std::string& key, int64_t delta, std::chrono::milliseconds budget) {
          // As c10d::PrefixStore joins them.
          return ours->TryAdd(prefix + "/" + key, delta, budget);
        }};
  }
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(port);
  store_options.isServer = true;
  store_options.numWorkers = static_cast<std::size_t>(world_size);
  store_options.waitWorkers = true;
  store_options.timeout = timeout;
  try {
    auto store = c10::make_intrusive<c10d::TCPStore>(host, store_options);
    return Rendezvous{store, absl::StrCat("tcp://", address), host, c10d_add(store)};
  } catch (const std::exception& e) {
    const std::string why = describe(e);
    if (absl::StrContains(why, "listen") || absl::StrContains(why, "in use") ||
        absl::StrContains(why, "bind")) {
      return absl::UnavailableError(
          absl::StrCat("rank 0 could not serve the rendezvous store on port ", port,
                       " (MASTER_ADDR:MASTER_PORT=", address,
                       "): is the port already in use? c10d said: ", why));
    }
    return absl::DeadlineExceededError(
        absl::StrCat("rank 0 could not complete the rendezvous at ", address, " within ",
                     timeout.count(), " ms (are all ", world_size,
                     " ranks started, with this MASTER_ADDR/MASTER_PORT?). c10d said: ", why));
  }
}

absl::Status wait_for_all_ranks(const Rendezvous& rendezvous, int world_size,
                                std::chrono::milliseconds timeout) {
  const std::string key = "comm/ranks_arrived";
  const std::string& where = rendezvous.description;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // Each add gets what is left of the rendezvous timeout, so the whole wait
  // ends by the deadline however the store behaves.
  auto left = [&] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline - std::chrono::steady_clock::now()));
  };
  auto failed = [&](const absl::Status& status) {
    return absl::Status(status.code(), absl::StrCat("the rendezvous store at ", where,
                                                    " failed: ", status.message()));
  };
  absl::StatusOr<int64_t> arrived = rendezvous.add(key, 1, left());
  if (!arrived.ok()) return failed(arrived.status());
  while (*arrived < world_size) {
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "only ", *arrived, " of WORLD_SIZE=", world_size, " ranks reached the rendezvous at ",
          where, " within ", timeout.count(), " ms: expected all of them (did every rank start?)"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    arrived = rendezvous.add(key, 0, left());
    if (!arrived.ok()) return failed(arrived.status());
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RankEnvironment> read_rank_environment() {
  auto slurm = slurm_rank_environment();
  if (!slurm.ok()) return slurm.status();
  if (slurm->has_value()) return **slurm;
  RankEnvironment env;
  auto world = int_from_env("WORLD_SIZE", true, 0, "a positive integer");
  if (!world.ok()) return world.status();
  if (*world <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("environment variable WORLD_SIZE='", *world,
                                                   "': expected a positive integer"));
  }
  env.world_size = *world;
  const std::string rank_range = absl::StrCat("an integer in [0, WORLD_SIZE=", env.world_size, ")");
  auto rank = int_from_env("RANK", true, 0, rank_range);
  if (!rank.ok()) return rank.status();
  if (*rank < 0 || *rank >= env.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable RANK='", *rank, "': expected ", rank_range));
  }
  env.rank = *rank;
  auto local_world = int_from_env("LOCAL_WORLD_SIZE", false, env.world_size,
                                  "a positive integer dividing WORLD_SIZE");
  if (!local_world.ok()) return local_world.status();
  if (*local_world <= 0 || env.world_size % *local_world != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable LOCAL_WORLD_SIZE='", *local_world,
                     "': expected a positive integer dividing WORLD_SIZE=", env.world_size));
  }
  env.local_world_size = *local_world;
  const std::string local_range =
      absl::StrCat("an integer in [0, LOCAL_WORLD_SIZE=", env.local_world_size, ")");
  auto local_rank = int_from_env("LOCAL_RANK", false, env.rank % env.local_world_size, local_range);
  if (!local_rank.ok()) return local_rank.status();
  if (*local_rank < 0 || *local_rank >= env.local_world_size) {
    return absl::InvalidArgumentError(absl::StrCat("environment variable LOCAL_RANK='", *local_rank,
                                                   "': expected ", local_range));
  }
  env.local_rank = *local_rank;
  const char* addr = std::getenv("MASTER_ADDR");
  if (addr == nullptr || *addr == '\0') {
    return absl::InvalidArgumentError(
        "environment variable MASTER_ADDR is not set: expected the host name "
        "or address of rank 0 (e.g. 127.0.0.1)");
  }
  env.master_addr = addr;
  auto port = int_from_env("MASTER_PORT", true, 0, "a TCP port in [1, 65535]");
  if (!port.ok()) return port.status();
  if (*port <= 0 || *port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("environment variable MASTER_PORT='", *port,
                                                   "': expected a TCP port in [1, 65535]"));
  }
  env.master_port = *port;
  return env;
}

namespace internal {
namespace {

NcclHooks*& registered_nccl_hooks() {
  static NcclHooks* hooks = nullptr;
  return hooks;
}

}  // namespace

void register_nccl_hooks(const NcclHooks& hooks) {
  registered_nccl_hooks() = new NcclHooks(hooks);  // lives as long as the process
}

const NcclHooks* nccl_hooks() { return registered_nccl_hooks(); }

absl::StatusOr<c10::intrusive_ptr<c10d::ProcessGroup>> make_backend_group(
    const std::string& backend, const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& master_addr) {
  const bool mixed = backend == kGlooCpuNcclCuda;
  const bool with_gloo = backend == "gloo" || mixed;
  const bool with_nccl = backend == "nccl" || mixed;
  const NcclHooks* nccl = nccl_hooks();
  if (with_nccl) {
    if (nccl == nullptr) {
      return absl::UnimplementedError(absl::StrCat(
          "backend '", backend,
          "' is not available in this build: the binary does not link //comm:nccl "
          "(build with --config=cuda against a CUDA LibTorch, such as the torch wheel, "
          "to get ProcessGroupNCCL); use backend 'gloo' (CPU tensors)"));
    }
    if (auto devices = nccl->cuda_device_count(); !devices.ok()) {
      return devices.status();
    }
  } else if (!with_gloo) {
    return absl::InvalidArgumentError(
        absl::StrCat("backend '", backend, "': expected 'gloo', or in CUDA builds 'nccl' or '",
                     kGlooCpuNcclCuda, "'"));
  }
  if (!store) return c10::intrusive_ptr<c10d::ProcessGroup>();  // probe only
  try {
    // Since 2.0 a c10d::ProcessGroup dispatches each collective to the
    // Backend registered for the tensors' device type.
    auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
    if (with_gloo) {
      // Gloo's threads (its device's TCP loop, c10d's workers) are the ones
      // started from here to the group's construction.
      const std::vector<pid_t> threads_before = ThreadIds();
      auto options = c10d::ProcessGroupGloo::Options::create(timeout);
      // Loopback rendezvous: pin Gloo to 127.0.0.1 instead of resolving the
      // host name (which sandboxes often cannot). GLOO_SOCKET_IFNAME wins,
      // as in torch.distributed.
      const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
      if (ifname != nullptr && *ifname != '\0') {
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      } else if (!master_addr.empty() && is_loopback(master_addr)) {
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      } else {
        options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
      auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
      ShortenSlicesOfNewThreads(threads_before, ThreadIds());
      group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
      // As torch.distributed's "gloo": CUDA tensors go through Gloo too
      // (where the binary can have CUDA tensors at all).
      if (!with_nccl && nccl != nullptr) {
        group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO, gloo);
      }
      group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
    }
    if (with_nccl) {
      group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL,
                        nccl->make_nccl_backend(store, rank, size, timeout));
      group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
    }
    return group;
  } catch (const std::exception& e) {
    return absl::DeadlineExceededError(
        absl::StrCat("rank ", rank, " of ", size, " could not connect the ", backend,
                     " group within ", timeout.count(), " ms: ", describe(e)));
  }
}

}  // namespace internal

bool is_nccl_available() { return internal::nccl_hooks() != nullptr; }

namespace {

struct RankAndSize {
  int rank = -1;
  int world_size = -1;
};

// The rank and world size `options` give, else the environment's: env://
// reads them as read_rank_environment() does (RANK and WORLD_SIZE, or srun's
// variables), the other methods from RANK and WORLD_SIZE.
absl::StatusOr<RankAndSize> rank_and_world_size(const InitOptions& options) {
  int rank = options.rank;
  int world_size = options.world_size;
  if (options.init_method == "env://" && (rank < 0 || world_size < 0)) {
    auto env = read_rank_environment();
    if (!env.ok()) return env.status();
    if (rank < 0) rank = env->rank;
    if (world_size < 0) world_size = env->world_size;
  } else {
    if (world_size < 0) {
      auto w = int_from_env("WORLD_SIZE", true, 0, "a positive integer");
      if (!w.ok()) return w.status();
      world_size = *w;
    }
    if (rank < 0) {
      auto r = int_from_env("RANK", true, 0, "an integer in [0, WORLD_SIZE)");
      if (!r.ok()) return r.status();
      rank = *r;
    }
  }
  if (world_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size=", world_size, ": expected a positive integer"));
  }
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank=", rank, ": expected an integer in [0, world_size=", world_size, ")"));
  }
  return RankAndSize{rank, world_size};
}

// Connects to the store `method` names (env://, tcp://HOST:PORT or
// file:///PATH) as rank `rank` of `world_size`.
absl::StatusOr<Rendezvous> open_rendezvous(const std::string& method, int rank, int world_size,
                                           std::chrono::milliseconds rendezvous_timeout) {
  if (method == "env://") {
    auto slurm = slurm_rank_environment();
    if (!slurm.ok()) return slurm.status();
    const char* addr =
        slurm->has_value() ? (*slurm)->master_addr.c_str() : std::getenv("MASTER_ADDR");
    if (addr == nullptr || *addr == '\0') {
      return absl::InvalidArgumentError(
          "environment variable MASTER_ADDR is not set: expected the host "
          "name or address of rank 0 (e.g. 127.0.0.1)");
    }
    absl::StatusOr<int> port =
        slurm->has_value() ? absl::StatusOr<int>((*slurm)->master_port)
                           : int_from_env("MASTER_PORT", true, 0, "a TCP port in [1, 65535]");
    if (!port.ok()) return port.status();
    auto server = store_server_from_env();
    if (!server.ok()) return server.status();
    return connect_tcp(addr, *port, rank, world_size, rendezvous_timeout, "MASTER_PORT", *server);
  }
  if (absl::StartsWith(method, "tcp://")) {
    const std::string host_port = method.substr(6);
    const auto colon = host_port.rfind(':');
    int port = 0;
    if (colon == std::string::npos || colon == 0 ||
        !absl::SimpleAtoi(host_port.substr(colon + 1), &port)) {
      return absl::InvalidArgumentError(
          absl::StrCat("init_method='", method, "': expected tcp://HOST:PORT"));
    }
    return connect_tcp(host_port.substr(0, colon), port, rank, world_size, rendezvous_timeout,
                       "init_method port");
  }
  if (absl::StartsWith(method, "file://")) {
    const std::string path = method.substr(7);
    if (path.empty() || path[0] != '/') {
      return absl::InvalidArgumentError(
          absl::StrCat("init_method='", method, "': expected file:///ABSOLUTE/PATH"));
    }
    try {
      c10::intrusive_ptr<c10d::Store> store =
          c10::make_intrusive<c10d::FileStore>(path, world_size);
      store->setTimeout(rendezvous_timeout);
      return Rendezvous{store, method, "", c10d_add(store)};
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("cannot open the FileStore at '", path, "': ", describe(e)));
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "init_method='", method, "': expected 'env://', 'tcp://HOST:PORT' or 'file:///PATH'"));
}

}  // namespace

absl::StatusOr<ProcessGroup> init_process_group(const InitOptions& options) {
  if (options.timeout.count() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout=", options.timeout.count(), " ms: expected a positive duration"));
  }
  if (options.backend != "gloo") {
    // Fail before any rendezvous, so every rank reports it at once.
    auto probe = internal::make_backend_group(options.backend, {}, 0, 1, options.timeout, "");
    if (!probe.ok()) return probe.status();
  }
  const std::chrono::milliseconds rendezvous_timeout =
      options.rendezvous_timeout.count() > 0 ? options.rendezvous_timeout : options.timeout;
  auto ranks = rank_and_world_size(options);
  if (!ranks.ok()) return ranks.status();
  const int rank = ranks->rank;
  const int world_size = ranks->world_size;
  auto rendezvous = open_rendezvous(options.init_method, rank, world_size, rendezvous_timeout);
  if (!rendezvous.ok()) return rendezvous.status();
  // Wait (up to the rendezvous timeout) until every rank has reached the
  // store, so Gloo's own connection step, bounded by the collective timeout,
  // does not also absorb the ranks' start-up skew.
  if (absl::Status arrived = wait_for_all_ranks(*rendezvous, world_size, rendezvous_timeout);
      !arrived.ok()) {
    return arrived;
  }

  auto state = std::make_shared<internal::GroupState>();
  state->root_store = rendezvous->store;
  state->rank = rank;
  state->size = world_size;
  state->global_rank = rank;
  state->global_ranks.resize(world_size);
  for (int r = 0; r < world_size; ++r) state->global_ranks[r] = r;
  state->backend = options.backend;
  state->name = "0";
  state->timeout = options.timeout;
  state->rendezvous = rendezvous->description;
  state->master_addr = rendezvous->master_addr;
  auto group = internal::make_backend_group(
      options.backend, c10::make_intrusive<c10d::PrefixStore>(state->name + "/", rendezvous->store),
      rank, world_size, options.timeout, rendezvous->master_addr);
  if (!group.ok()) {
    return absl::Status(
        group.status().code(),
        absl::StrCat(group.status().message(), " (rendezvous ", rendezvous->description, ")"));
  }
  state->pg = *group;
  return ProcessGroup(std::move(state));
}

}  // namespace comm
