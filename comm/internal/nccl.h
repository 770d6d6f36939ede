// The NCCL side of comm, compiled only in the CUDA build (--config=cuda,
// which defines TORCHFSDP_CUDA). Internal to comm/.
#pragma once

#include <chrono>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/statusor.h"

namespace comm {
namespace internal {

// The number of CUDA devices this process sees; an error naming what is
// missing (no driver, no device) when it is none, since NCCL needs one.
absl::StatusOr<int> cuda_device_count();

// c10d::ProcessGroupNCCL for `rank` of `size` on `store`, bound to the CUDA
// device LOCAL_RANK % device count (torchrun's convention; the caller may
// have set the current device already, which then wins), with `timeout` on
// every collective.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout);

}  // namespace internal
}  // namespace comm
