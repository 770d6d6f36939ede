// storage_view: a tensor over part of another tensor's storage that is not
// an autograd view of it, made without the dispatcher. Both FSDPs hand
// such tensors to optimizers and modules (FSDP1's original parameters and
// gradients over the flat parameter, fully_shard's shards, unsharded
// parameters and gradients over their buffers): an autograd view there
// would make an optimizer's in-place detach_ (zero_grad without
// set_to_none) fail, and empty() + set_() would cost two dispatched
// operators per parameter at every state change, host overhead per unit
// that PyTorch's FSDP2 does not pay. Private to //fsdp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>

namespace fsdp {
namespace internal {

// Contiguous `sizes` over `base`'s storage from element `offset` (relative
// to `base`'s own storage offset), with `base`'s dtype, device and
// dispatch keys. It shares the StorageImpl: freeing or re-allocating the
// storage's memory shows through it.
at::Tensor storage_view(const at::Tensor& base, int64_t offset, c10::IntArrayRef sizes);

}  // namespace internal
}  // namespace fsdp
