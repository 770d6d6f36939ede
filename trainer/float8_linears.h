// --float8: the Llama decoder layers' projections (q/k/v/o, gate/up/down)
// compute through kernels::Float8Linear (torchao's tensorwise recipe,
// float8 tensor cores), as TorchTitan's `--model.converters
// quantize.linear.float8` swaps nn.Linear. lm_head and the embedding stay
// in high precision (TorchTitan's Llama recipes filter `output` out too).
// The parameters, their names and dtypes do not change: FSDP, checkpoints
// and exports see the same model.
#pragma once

#include <string>

#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace trainer {

// OK where `device` has float8 matrix products (CUDA, compute capability
// >= 8.9, with //kernels:cuda linked); else InvalidArgument naming --float8
// and why not.
absl::Status CheckFloat8Device(const c10::Device& device);

// Sets every models::LlamaLinear under `model` except lm_head to compute
// through kernels::Float8Linear; returns how many. InvalidArgument when
// there is none (a model that is not a Llama).
absl::StatusOr<int> ConvertLinearsToFloat8(torch::nn::Module& model);

}  // namespace trainer
