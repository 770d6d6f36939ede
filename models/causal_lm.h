// CausalLM: what a trainer needs of a language model, whichever it is.
//
// The trainer composes models through this interface alone: it computes the
// loss of a batch of token rows, and names its repeated decoder layers, which
// FSDP makes units of and activation checkpointing recomputes. A model calls
// each of those layers through module_call::call (the module call point), so
// that whatever a wrapper hooks there (FSDP's all-gather and reshard, a
// checkpointed region) happens around every layer; the model itself knows
// nothing of parallelism.
#pragma once

#include <memory>
#include <vector>

#include <torch/nn/module.h>

namespace models {

class CausalLM : public torch::nn::Module {
 public:
  // Mean cross-entropy of the model's next-token predictions on `batch`:
  // int64 [B, T + 1] token rows, each row's first T tokens the input and its
  // last T the targets (B * T predictions). Computed in float32 whatever the
  // parameters' dtype.
  virtual torch::Tensor Loss(const torch::Tensor& batch) = 0;

  // The decoder layers in the order forward runs them (empty for a model
  // with none); each is called only through module_call::call.
  virtual std::vector<std::shared_ptr<torch::nn::Module>> DecoderLayers() = 0;
};

}  // namespace models
