// The side streams FSDP communicates on when it computes on an accelerator
// (PyTorch's _unshard_stream and _post_backward_stream; FSDP2's all-gather
// and reduce-scatter streams): parameters are gathered and gradients
// reduced there, ordered against the compute stream with events, so
// communication overlaps compute instead of queuing behind it.
//
// Device-generic (c10::Stream, c10::Event through the device's guard
// implementation): the same code runs on whatever accelerator LibTorch was
// built with, and a CPU-only LibTorch compiles it unchanged. A CPU compute
// device has no streams: for_device() returns nothing and FSDP waits on the
// host as before.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <optional>

namespace fsdp {
namespace internal {

struct CommStreams {
  c10::Stream unshard;  // all-gathers, and the shard's copy/cast before them
  c10::Stream reduce;   // gradient casts, reduce-scatters, accumulation
};

// The process-wide pair for `device` (created on first use, high priority
// as PyTorch's are, so communication kernels are not starved by compute).
// Nothing for a CPU device.
std::optional<CommStreams> comm_streams_for(c10::Device device);

// The calling thread's current stream on `device`.
c10::Stream current_stream(c10::Device device);

// `waiter` waits (on the device, not the host) for the work queued on
// `producer` so far.
void wait_stream(const c10::Stream& waiter, const c10::Stream& producer);

}  // namespace internal
}  // namespace fsdp
