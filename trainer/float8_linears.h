// --float8: the Llama decoder layers' projections (q/k/v/o, gate/up/down)
// compute through kernels::Float8Linear (torchao's tensorwise recipe,
// float8 tensor cores), as TorchTitan's `--model.converters
// quantize.linear.float8` swaps nn.Linear. lm_head and the embedding stay
// in high precision (TorchTitan's Llama recipes filter `output` out too).
// The parameters, their names and dtypes do not change: FSDP, checkpoints
// and exports see the same model.
//
// --float8-all-gather (with --fsdp fully_shard): fully_shard gathers those
// projections' weights as float8 (FullyShardOptions::float8_all_gather_fn,
// torchao's enable_fsdp_float8_all_gather), and the projections multiply
// the gathered casts (fsdp::float8_unsharded_param) instead of casting
// their weights: half the bytes of a bf16 all-gather, the same bits.
#pragma once

#include <functional>
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
// through kernels::Float8Linear; returns how many. With
// `fully_shard_gathers_weights` (--float8-all-gather) each multiplies the
// float8 cast fully_shard gathered for its weight where there is one
// (fsdp::float8_unsharded_param). InvalidArgument when there is none (a
// model that is not a Llama).
absl::StatusOr<int> ConvertLinearsToFloat8(torch::nn::Module& model,
                                           bool fully_shard_gathers_weights = false);

// FullyShardOptions::float8_all_gather_fn for --float8-all-gather: true for
// the weights of the projections ConvertLinearsToFloat8 converted under
// `model` (as they are now: call it before fully_shard replaces them).
std::function<bool(const at::Tensor& param)> Float8ConvertedWeights(torch::nn::Module& model);

}  // namespace trainer
