#include "fsdp/internal/comm_streams.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <map>
#include <mutex>
#include <utility>

namespace fsdp {
namespace internal {

std::optional<CommStreams> comm_streams_for(c10::Device device) {
  if (device.is_cpu() || device.is_meta()) return std::nullopt;
  TORCH_CHECK(device.has_index(), "fsdp: compute device ", device,
              " has no index: expected a concrete device such as cuda:0 "
              "(FullyShardedDataParallel::Options::device_id)");
  static std::mutex mu;
  static auto* streams = new std::map<std::pair<int, int>, CommStreams>();  // never freed
  std::lock_guard<std::mutex> lock(mu);
  const auto key =
      std::make_pair(static_cast<int>(device.type()), static_cast<int>(device.index()));
  auto it = streams->find(key);
  if (it == streams->end()) {
    c10::impl::VirtualGuardImpl impl(device.type());
    CommStreams made{impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true),
                     impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true)};
    // The pool hands streams out round-robin; two calls in a row differ.
    it = streams->emplace(key, made).first;
  }
  return it->second;
}

c10::Stream current_stream(c10::Device device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

void wait_stream(const c10::Stream& waiter, const c10::Stream& producer) {
  if (waiter == producer) return;
  c10::Event event(producer.device_type());
  event.record(producer);
  event.block(waiter);
}

}  // namespace internal
}  // namespace fsdp
