// The FULL state dict of a plain (unsharded) module, and loading one back
// without ever leaving the module half-loaded.
#pragma once

#include <torch/nn/module.h>

#include "absl/status/status.h"
#include "state_dict/tensor_dict.h"

namespace state_dict {

// Parameters then buffers of `module`, recursively, under the FQNs Python's
// nn.Module.state_dict() uses ("0.weight", "encoder.layer.bias"); tensors are
// detached views of the module's own (no copy).
TensorDict ModuleStateDict(const torch::nn::Module& module);

// Copies `state` into `module`'s parameters and buffers. Everything is
// checked first — every name known, every module entry present (unless
// `strict` is false), shapes and dtypes equal — and the first problem is
// returned naming the tensor, the value found and the value expected; only
// when all checks pass are tensors copied, so an error leaves `module`
// untouched.
absl::Status LoadModuleStateDict(torch::nn::Module& module, const TensorDict& state,
                                 bool strict = true);

}  // namespace state_dict
