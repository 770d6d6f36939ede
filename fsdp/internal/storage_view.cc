#include "fsdp/internal/storage_view.h"

#include <c10/core/TensorImpl.h>

#include <utility>

namespace fsdp {
namespace internal {

at::Tensor storage_view(const at::Tensor& base, int64_t offset, c10::IntArrayRef sizes) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(),
                                                   base.dtype());
  impl->set_sizes_contiguous(sizes);
  impl->set_storage_offset(base.storage_offset() + offset);
  return at::Tensor(std::move(impl));
}

}  // namespace internal
}  // namespace fsdp
