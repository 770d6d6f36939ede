#include "fsdp/mixed_precision.h"

#include <torch/nn/module.h>

namespace fsdp {

void cast_buffers(torch::nn::Module& module, c10::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  for (auto& buffer : module.buffers(/*recurse=*/true)) {
    if (!buffer.defined() || !at::isFloatingType(buffer.scalar_type()) ||
        buffer.scalar_type() == dtype) {
      continue;
    }
    // set_data keeps the tensor's identity: the registry entry and the
    // member handle (BatchNormImpl::running_mean) are the same tensor.
    buffer.set_data(buffer.to(dtype));
  }
}

}  // namespace fsdp
