// Mixed precision for one FSDP unit (PyTorch's MixedPrecision).
//
// The full-precision shard is what the optimizer updates. param_dtype is
// the precision of the copy that is all-gathered and computed on;
// reduce_dtype the precision gradients are reduced in; buffer_dtype the
// precision buffers are cast to (buffers are never sharded). An unset
// field means "no cast": param_dtype falls back to the parameters' own
// dtype, reduce_dtype to the (resolved) param_dtype, as in PyTorch.
#pragma once

#include <c10/core/ScalarType.h>
#include <optional>

namespace torch {
namespace nn {
class Module;
}  // namespace nn
}  // namespace torch

namespace fsdp {

struct MixedPrecision {
  std::optional<c10::ScalarType> param_dtype;
  std::optional<c10::ScalarType> reduce_dtype;
  std::optional<c10::ScalarType> buffer_dtype;
  // Keep the reduced gradient in the low precision instead of casting it
  // back to the parameters' dtype (the optimizer then sees low-precision
  // gradients).
  bool keep_low_precision_grads = false;

  bool enabled() const {
    return param_dtype.has_value() || reduce_dtype.has_value() || buffer_dtype.has_value();
  }
};

// Casts every floating-point buffer of `module` and its submodules to
// `dtype` in place of identity (Tensor::set_data), so member handles that
// forward() reads see the cast buffer. Integer buffers (BatchNorm's
// num_batches_tracked) are left alone, as PyTorch does.
void cast_buffers(torch::nn::Module& module, c10::ScalarType dtype);

}  // namespace fsdp
