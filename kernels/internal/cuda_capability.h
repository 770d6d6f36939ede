// The CUDA compute-capability query behind kernels::Float8MatmulSupported.
// //kernels builds without CUDA, so it cannot call
// at::cuda::getDeviceProperties itself: //kernels:cuda (the CUDA plug-in,
// --config=cuda) registers the query from a static initialiser
// (internal/cuda_capability_query.cc), as it registers its kernels.
#pragma once

#include <c10/core/Device.h>

namespace kernels::internal {

struct ComputeCapability {
  int major = 0;
  int minor = 0;
};

// The capability of CUDA device `index` (-1: the current device). Throws
// c10::Error for a device that does not exist.
using CudaCapabilityQuery = ComputeCapability (*)(c10::DeviceIndex index);

// Sets the query (nullptr: none) and returns the one it replaces: called by
// //kernels:cuda's static initialiser, and by tests that stand in for a GPU.
CudaCapabilityQuery SetCudaCapabilityQuery(CudaCapabilityQuery query);
// The registered query, or nullptr when the binary does not link //kernels:cuda.
CudaCapabilityQuery GetCudaCapabilityQuery();

}  // namespace kernels::internal
