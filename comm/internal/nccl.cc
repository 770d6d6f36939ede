#include "comm/internal/nccl.h"

#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace comm {
namespace internal {
namespace {

absl::StatusOr<int> cuda_device_count() {
  // c10::cuda::device_count() is 0, with a warning, when there is no driver
  // or no device; never an exception.
  const int count = static_cast<int>(c10::cuda::device_count());
  if (count <= 0) {
    return absl::FailedPreconditionError(
        "backend 'nccl' needs a CUDA GPU, and this process sees none "
        "(c10::cuda::device_count() is 0: no NVIDIA driver, no device, or "
        "CUDA_VISIBLE_DEVICES hides them); use backend 'gloo'");
  }
  return count;
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  const int count = static_cast<int>(c10::cuda::device_count());
  int local_rank = rank;
  if (const char* env = std::getenv("LOCAL_RANK"); env != nullptr) {
    (void)absl::SimpleAtoi(env, &local_rank);
  }
  const int device = local_rank % count;
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

// //comm:nccl is alwayslink: linking it is what makes "nccl" available.
[[maybe_unused]] const bool registered = [] {
  register_nccl_hooks({&cuda_device_count, &make_nccl_backend});
  return true;
}();

}  // namespace
}  // namespace internal
}  // namespace comm
