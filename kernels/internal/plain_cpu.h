// What the CPU kernels that read a tensor's memory themselves (cpu_matmul.h,
// decode_linear.h) take: package-internal.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>

namespace kernels::internal {

// A dense float32 CPU tensor whose storage holds its values: not the
// wrapper of a functorch transform (batched, grad-tracking), not
// functionalised, not a Python subclass, no lazy conjugate or negation bit.
inline bool PlainCpuFloat(const at::Tensor& t) {
  constexpr c10::DispatchKeySet kWrapped({c10::DispatchKey::FuncTorchBatched,
                                          c10::DispatchKey::FuncTorchGradWrapper,
                                          c10::DispatchKey::Functionalize, c10::DispatchKey::Python,
                                          c10::DispatchKey::Conjugate, c10::DispatchKey::Negative});
  return t.defined() && t.device().is_cpu() && t.layout() == c10::kStrided &&
         t.scalar_type() == at::kFloat && t.has_storage() && !t.key_set().has_any(kWrapped);
}

}  // namespace kernels::internal
