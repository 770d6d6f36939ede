// Registers the compute-capability query (cuda_capability.h) when a binary
// links //kernels:cuda. Only under --config=cuda (it needs libtorch_cuda).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>

#include "kernels/internal/cuda_capability.h"

namespace kernels::internal {
namespace {

ComputeCapability Query(c10::DeviceIndex index) {
  const cudaDeviceProp* props =
      at::cuda::getDeviceProperties(index < 0 ? c10::cuda::current_device() : index);
  return ComputeCapability{props->major, props->minor};
}

[[maybe_unused]] const bool kRegistered = (SetCudaCapabilityQuery(&Query), true);

}  // namespace
}  // namespace kernels::internal
