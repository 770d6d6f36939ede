#include "models/kv_cache.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

namespace models {

KvCache::KvCache(const LlamaConfig& config, int64_t batch, int64_t capacity, c10::Device device,
                 c10::ScalarType dtype) {
  TORCH_CHECK(batch > 0 && capacity > 0, "models::KvCache: batch ", batch, " and capacity ",
              capacity, ": expected both positive");
  const auto options = at::TensorOptions().device(device).dtype(dtype);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    // Empty, not zeros: only written slots are ever read.
    keys_.push_back(
        at::empty({batch, config.num_key_value_heads, capacity, config.head_dim}, options));
    values_.push_back(at::empty_like(keys_.back()));
  }
  valid_ = at::zeros({batch, capacity}, options.dtype(at::kBool));
  seen_ = at::zeros({batch}, options.dtype(at::kLong));
}

void KvCache::Write(int64_t layer, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(keys_.size()), "models::KvCache: layer ",
              layer, " of ", keys_.size());
  const int64_t steps = k.size(2);
  TORCH_CHECK(length_ + steps <= capacity(), "models::KvCache: ", steps, " more tokens after ",
              length_, " exceed the capacity of ", capacity(), " (made for a shorter generation)");
  keys_[layer].narrow(2, length_, steps).copy_(k);
  values_[layer].narrow(2, length_, steps).copy_(v);
}

void KvCache::Advance(const at::Tensor& mask, bool padded) {
  const int64_t steps = mask.size(1);
  TORCH_CHECK(mask.size(0) == batch() && length_ + steps <= capacity(), "models::KvCache: mask ",
              mask.sizes(), " after ", length_, " slots of ", capacity(), " for batch ", batch());
  valid_.narrow(1, length_, steps).copy_(mask);
  seen_.add_(mask.sum(1));
  length_ += steps;
  padded_ = padded_ || padded;
}

}  // namespace models
