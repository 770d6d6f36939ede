// One parameter under fully_shard (PyTorch's FSDPParam, _fsdp_param.py):
// its dim-0 shard, the buffer it is all-gathered into and the unsharded
// parameter over that buffer. Private to //fsdp:fully_shard.
//
// Layout, for a parameter of global shape [d0, rest...] on a group of W
// ranks: chunk = ceil(d0 / W) rows (torch.chunk's); rank r holds rows
// [r*chunk, min((r+1)*chunk, d0)) (possibly none). Its padded shard is a
// 1-D tensor of chunk*prod(rest) elements, the real rows first and zeros
// after; the sharded parameter (the optimizer's) is a view of its front.
// The all-gather output is W padded shards back to back, i.e. the padded
// global parameter [W*chunk, rest...]; the unsharded parameter is its first
// d0 rows.
//
// Sharded on another dim d (shard_placement_fn; size(d) divisible by W, so
// no padding): the padded shard is torch.chunk(param, W, d)[rank], made
// contiguous; the all-gather output is still the W shards back to back,
// and the unsharded parameter lives in a buffer of its own, filled from it
// by torch.cat(chunks, d) (PyTorch's _reassemble_all_gather_outputs). Both
// buffers are allocated while unsharded.
//
// CPUOffloadPolicy: the padded shard (and the sharded parameter over it,
// and its .grad) is on the CPU, pinned when asked and CUDA is present;
// all_gather_input() copies it to the device; the gathered buffers are on
// the device; accumulate_sharded_grad() copies the reduced gradient back.
//
// Meta device (a module built on meta, PyTorch's deferred initialisation):
// a parameter on the meta device gives a meta padded shard, sharded
// parameter and gathered buffers of their shapes (no memory) and device()
// meta, until materialize() allocates the shard on a real device.
//
// Float8 all-gather (fully_shard's float8_all_gather_fn; torchao's
// WeightWithDynamicFloat8CastTensor): before each all-gather from the
// shards, the group all-reduces (MAX) every such parameter's amax over the
// shard group and each shard is cast to Float8_e4m3fn with the whole's
// scale (kernels::CastToFloat8Fused with that amax), so 1 byte an element is
// gathered and the gathered bytes are the whole parameter's cast, bit for
// bit. The gathered buffer is float8; unsharded, the parameter's values
// are that cast (unsharded_float8(): what kernels::Float8Linear
// multiplies), and the unsharded parameter the module sees is a stand-in of
// the parameter dtype whose every element reads NaN (one element of
// memory, zero strides): it is only autograd's leaf, where the gradient
// arrives in the parameter dtype and is reduce-scattered as any other.
// Post-forward shards keep the float8 bytes and the scale.
//
// Tensors that share memory are made with set_ (fresh TensorImpls, own
// version counters), so writing a gathered buffer never bumps the version
// of a tensor autograd saved (PyTorch uses _unsafe_preserve_version_counter
// for the same), and an optimizer's zero_grad can detach_ the .grad.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "comm/process_group.h"
#include "kernels/float8_linear.h"
#include "fsdp/internal/storage_view.h"

namespace fsdp {
namespace internal {

// Releases `t`'s memory, keeping its StorageImpl (tensors sharing it stay
// valid objects and see memory again after alloc_storage).
void free_storage(const at::Tensor& t);
// Re-allocates `t`'s storage for its numel (contents uninitialised).
void alloc_storage(const at::Tensor& t);
// A contiguous tensor of `sizes` whose storage holds no memory yet (as
// after free_storage; alloc_storage allocates it), on `options`' device.
at::Tensor unallocated(c10::IntArrayRef sizes, const at::TensorOptions& options);

enum class ShardedState { kSharded, kShardedPostForward, kUnsharded };

class FSDPParam {
 public:
  // `fqns`: the parameter's names relative to the fully_shard module (the
  // first is its name; the others tied aliases). `param` must be contiguous
  // and at least 1-D; on the meta device, nothing is allocated (see above). `post_forward_group`:
  // the smaller group of an int reshard_after_forward (empty otherwise).
  FSDPParam(std::vector<std::string> fqns, const at::Tensor& param, const comm::ProcessGroup& group,
            const comm::ProcessGroup& post_forward_group,
            std::optional<c10::ScalarType> param_dtype, std::optional<c10::ScalarType> reduce_dtype,
            int64_t shard_dim = 0, bool offload_to_cpu = false, bool pin_memory = false,
            bool float8_all_gather = false);

  const std::vector<std::string>& fqns() const { return fqns_; }
  const at::Tensor& sharded_param() const { return sharded_param_; }
  const at::Tensor& unsharded_param() const { return unsharded_param_; }
  bool requires_grad() const { return requires_grad_; }
  c10::ScalarType orig_dtype() const { return orig_dtype_; }
  // What the parameter is gathered and computed in.
  c10::ScalarType param_dtype() const { return param_dtype_; }
  c10::ScalarType reduce_dtype() const { return reduce_dtype_; }
  // Whether it is gathered in float8 (see above), and the dtype it is
  // gathered in: Float8_e4m3fn then, else param_dtype().
  bool float8_all_gather() const { return float8_all_gather_; }
  c10::ScalarType gather_dtype() const;
  const std::vector<int64_t>& global_shape() const { return global_shape_; }
  // Where the module computes: the parameter's device at fully_shard (or
  // materialize()'s). The shard lives there too, or on the CPU when
  // offloaded.
  const c10::Device& device() const { return device_; }
  // Whether the shard is a meta tensor (not materialised yet).
  bool is_meta() const { return padded_shard_.is_meta(); }
  // CPUOffloadPolicy: the shard on the CPU (pinned when pin_memory() and a
  // CUDA device is present).
  bool offload_to_cpu() const { return offload_to_cpu_; }
  bool pin_memory() const { return pin_memory_; }
  int64_t shard_dim() const { return shard_dim_; }
  // Along shard_dim: the padded chunk size, and where this shard starts.
  int64_t padded_shard_size() const { return chunk_; }
  int64_t shard_offset() const { return shard_offset_; }
  int64_t padded_dim0() const { return shard_dim_ == 0 ? chunk_ : global_shape_[0]; }
  int64_t dim0_offset() const { return shard_dim_ == 0 ? shard_offset_ : 0; }
  // The original parameter's TensorImpl (weakly): the identity PyTorch's
  // duplicate-parameter check compares.
  const c10::weak_intrusive_ptr<c10::TensorImpl>& orig_param() const { return orig_param_; }
  ShardedState state() const { return state_; }

  // Elements of one rank's padded shard, and of the whole gathered buffer.
  int64_t padded_shard_numel() const { return padded_shard_numel_; }
  // The padded shard (1-D, orig dtype; on the CPU when offloaded).
  const at::Tensor& padded_shard() const { return padded_shard_; }
  // Moves the padded shard into `buffer` (1-D, the padded shard's dtype
  // and device), elements [offset, offset + padded_shard_numel()), and
  // makes the sharded parameter a fresh leaf over it. Only before anything
  // has seen sharded_param() (the group's constructor does it, so that its
  // shards lie back to back and are the all-gather's input as they are).
  void place_padded_shard(const at::Tensor& buffer, int64_t offset);
  // Meta to `device` (PyTorch's to_empty followed by reset_sharded_param):
  // the padded shard is allocated uninitialised, its padding zeroed, on
  // `device` (the CPU when offloaded, pinned as at construction), or is
  // `buffer`'s elements [offset, offset + padded_shard_numel()) when
  // `buffer` is defined (1-D, orig dtype, on the shard's device); the
  // sharded parameter becomes a fresh leaf over it, and the gathered
  // buffers are (unallocated) tensors on `device`. Only while is_meta().
  void materialize(const c10::Device& device, const at::Tensor& buffer = at::Tensor(),
                   int64_t offset = 0);
  // Float8 all-gather, before an all-gather from the shards: max(|shard|)
  // (float32 scalar on device()), and the cast of the padded shard with
  // the group's amax (all of the parameter's shards'), which the next
  // all_gather_input() returns.
  at::Tensor local_amax() const;
  void cast_to_float8(const at::Tensor& global_amax);
  // What this rank contributes to the next all-gather (1-D, gather_dtype):
  // the padded shard (float8: its cast), or the post-forward shard in
  // kShardedPostForward.
  at::Tensor all_gather_input() const;
  // The gathered buffer (1-D, gather_dtype, W*padded_shard_numel elements);
  // storage allocated by alloc_all_gather_output().
  const at::Tensor& all_gather_output() const { return all_gather_output_; }
  void alloc_all_gather_output();

  // State changes (PyTorch's to_unsharded / to_sharded /
  // to_sharded_post_forward). The caller points the module at
  // module_tensor() afterwards.
  void to_unsharded();
  void to_sharded();
  void to_sharded_post_forward();
  // What the module's names hold in the current state.
  const at::Tensor& module_tensor() const;
  // Float8 all-gather, unsharded: the parameter's cast (data: the gathered
  // bytes as global_shape(); scale and inv_scale of the whole). Nothing
  // otherwise.
  std::optional<kernels::Float8Tensor> unsharded_float8() const;

  // The unsharded gradient autograd accumulated (undefined when none),
  // and its release.
  at::Tensor unsharded_grad() const;
  void clear_unsharded_grad();
  // Adds this rank's reduced gradient, the shard's elements of the reduce
  // output from `offset` on (reduce dtype), to the shard's .grad (set when
  // it has none), cast to the parameter's dtype.
  void accumulate_sharded_grad(const at::Tensor& reduce_output, int64_t offset);

 private:
  // The gathered buffer and unsharded parameter (unallocated) with
  // `options`' device.
  void init_unsharded(const at::TensorOptions& options);

  std::vector<std::string> fqns_;
  c10::weak_intrusive_ptr<c10::TensorImpl> orig_param_;
  comm::ProcessGroup post_forward_group_;
  std::vector<int64_t> global_shape_;
  std::vector<int64_t> local_shape_;
  c10::Device device_;
  int64_t shard_dim_ = 0;
  int64_t chunk_ = 0;         // padded shard size along shard_dim_
  int64_t shard_offset_ = 0;  // along shard_dim_
  int64_t padded_shard_numel_ = 0;
  int world_size_ = 1;
  bool requires_grad_ = false;
  bool offload_to_cpu_ = false;
  bool pin_memory_ = false;
  bool float8_all_gather_ = false;
  c10::ScalarType orig_dtype_;
  c10::ScalarType param_dtype_;
  c10::ScalarType reduce_dtype_;

  at::Tensor padded_shard_;        // 1-D, orig dtype, padded_shard_numel
  at::Tensor sharded_param_;       // leaf over padded_shard_'s front
  at::Tensor all_gather_output_;   // 1-D, param dtype; freed while sharded
  at::Tensor unsharded_buffer_;    // shard_dim_ != 0 only: 1-D, param dtype
  at::Tensor unsharded_param_;     // leaf over all_gather_output_ (or unsharded_buffer_)
  at::Tensor post_forward_shard_;  // 1-D, kShardedPostForward only
  // Float8 all-gather only:
  at::Tensor float8_input_;  // the padded shard's cast, until gathered
  at::Tensor float8_scale_;  // the whole's, from the last cast
  at::Tensor float8_inv_scale_;
  at::Tensor unsharded_float8_;  // global_shape over all_gather_output_
  ShardedState state_ = ShardedState::kSharded;
};

}  // namespace internal
}  // namespace fsdp
