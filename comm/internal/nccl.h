// The NCCL side of comm, linked in as a plug-in: //comm:nccl (internal/nccl.cc)
// registers these hooks when the binary links it, and process_group.cc looks
// them up when a group asks for NCCL. So every other comm file, and every
// package above comm, compiles the same with or without CUDA; only the
// binaries that link //comm:nccl differ. Internal to comm/.
#pragma once

#include <chrono>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/statusor.h"

namespace comm {
namespace internal {

struct NcclHooks {
  // The number of CUDA devices this process sees; an error naming what is
  // missing (no driver, no device) when it is none, since NCCL needs one.
  absl::StatusOr<int> (*cuda_device_count)();
  // c10d::ProcessGroupNCCL for `rank` of `size` on `store`, bound to the CUDA
  // device LOCAL_RANK % device count (torchrun's convention; the caller may
  // have set the current device already, which then wins), with `timeout` on
  // every collective.
  c10::intrusive_ptr<c10d::Backend> (*make_nccl_backend)(
      const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
      std::chrono::milliseconds timeout);
};

// Called once, from //comm:nccl's static initializer.
void register_nccl_hooks(const NcclHooks& hooks);

// The hooks //comm:nccl registered, or nullptr when the binary does not link
// it (a CPU build).
const NcclHooks* nccl_hooks();

}  // namespace internal
}  // namespace comm
