// fully_shard: per-parameter sharding (PyTorch's FSDP2,
// torch.distributed.fsdp.fully_shard), beside FullyShardedDataParallel.
//
//   fsdp::FullyShardOptions options;
//   options.process_group = world;
//   for (auto& block : *model->blocks) fsdp::fully_shard(block.ptr(), options);
//   fsdp::FSDPModule root = fsdp::fully_shard(model.ptr(), options);
//   torch::optim::Adam optim(model->parameters(), 1e-3);   // steps on the shards
//   auto loss = loss_fn(module_call::call(model, x), y);
//   loss.backward();                                        // reduce-scattered
//   optim.step();
//
// HSDP (2 replicas of 4-way sharding on 8 ranks), bf16 compute with float32
// reduction and float32 outputs from the root:
//
//   options.mesh = comm::init_hybrid_shard_mesh(world, 2, 4).value();
//   options.mp_policy.param_dtype = torch::kBFloat16;
//   options.mp_policy.reduce_dtype = torch::kFloat;
//   for (auto& block : *model->blocks) fsdp::fully_shard(block.ptr(), options);
//   options.mp_policy.output_dtype = torch::kFloat;
//   fsdp::fully_shard(model.ptr(), options);
//
// Sharding. Each parameter of the module (those no nested fully_shard
// module manages, less options.ignored_params) is replaced, in the module,
// by this rank's dim-0 shard: torch.chunk(param, world_size, dim=0)[rank],
// padded on dim 0 to the size of chunk 0 in the storage FSDP gathers from
// (so the last ranks may hold a smaller or an empty shard, as in PyTorch);
// options.shard_placement_fn may pick another dim per parameter.
// named_parameters() returns the shards, so a stock torch::optim optimizer
// steps on them; sharded_param_spec() tells a shard's global shape, group,
// shard dim and offset (the C++ counterpart of a DTensor with Shard(d)).
// Frozen and trainable parameters, and parameters of different dtypes, mix
// in one module.
//
// Meta device (PyTorch's deferred initialisation: a model too large for
// one rank is never materialised whole). Build the model with its
// parameters and buffers on the meta device, fully_shard its modules and
// root as usual, then allocate and fill only this rank's shards:
//
//   Net model = MakeNetOnMeta();                 // every tensor on meta
//   for (auto& block : *model->blocks) fsdp::fully_shard(block.ptr(), options);
//   fsdp::fully_shard(model.ptr(), options);     // meta shards, nothing allocated
//   fsdp::to_empty(*model, torch::kCUDA);        // this rank's shards, uninitialised
//   state_dict::LoadFullyShardFrom(*model, nullptr, source, {}, reader);  // or
//   fsdp::init_sharded_states(*model, init_fn);  // fill them
//   torch::optim::AdamW optim(model->parameters(), 1e-3);  // after to_empty
//
// A module's managed parameters are all on meta or none (mixing them in one
// module is an error naming one of each). On meta, fully_shard computes the
// sharding as for real tensors, and the shards (sharded_parameters(),
// named_parameters(), what sharded_param_spec() takes) are meta tensors of
// the shard's shape; nothing is allocated, for the shards or the gathered
// buffers. Buffers stay where they are (on meta, if they were). to_empty
// allocates them; until then the first forward (or unshard()) is an error
// naming the modules and parameters still on meta.
//
// Runtime, at the module call point (module_call/call.h; LibTorch has no
// forward hooks): call the root, and each fully_shard submodule from its
// parent, through module_call::call. Around a module's forward its
// parameters are all-gathered in one collective (copy-in to one flat
// buffer, all_gather_into_tensor, copy-out with split_with_sizes_copy;
// the copy-in is skipped when the shards share one dtype, gathered in it,
// on the compute device: they then lie back to back in one buffer per
// module, which is the all-gather's input; on Gloo with CPU tensors of
// 1 MiB or more per module, each parameter is instead gathered straight
// into its unsharded buffer, with no flat buffer and no copy-out) and
// the module's names point at the unsharded parameters; after forward they
// are resharded (reshard_after_forward), gathered again when backward
// reaches the module's outputs, and once the module's backward is done the
// gradients are reduce-scattered (averaged over the group; HSDP: then
// all-reduced, averaged, over the replicas), asynchronously, into each
// shard's .grad. The first module called (the root) initialises the tree
// lazily and, at the end of backward, finishes whatever is left and waits
// for the reductions (unless set_is_last_backward(false)).
//
// On an accelerator (CUDA) the all-gathers run on FSDP1's unshard stream
// and the reductions (reduce-scatter, HSDP's all-reduce, the accumulation
// into .grad) on its reduce stream, ordered against the caller's stream
// with events, so the host never waits for communication; the copy-out
// and the reduce-scatter's copy-in run on the caller's stream. Buffers
// used across streams are held until the consuming stream has waited for
// them (PyTorch's AllGatherState / ReduceScatterState), never
// record_stream'ed, so memory use is deterministic. A one-rank group sends
// nothing and uses no side stream. (Run on one GPU only: 2 Gloo ranks with
// CUDA tensors, benchmarks/gpu_check; never on several GPUs over NCCL.)
//
// Errors (c10::Error naming the module, with PyTorch's wording where it has
// one): fully_shard twice on one module, or on a module after an ancestor;
// a scalar or non-contiguous parameter; an int reshard_after_forward that
// does not divide the shard group's size; a mesh of other than 1 or 2 dims;
// a mesh that does not match the process group; shard_placement_fn giving
// a dim out of range, or one the parameter does not divide evenly over
// the group; an ignored parameter that is not one of the module's; a
// parameter shared between two fully_shard modules (PyTorch's behaviour:
// error at the first forward, naming the parameter).
//
// Lifetimes: fully_shard's state lives as long as the module (a
// process-wide registry keyed by the module, holding it weakly; a destroyed
// module's state, with its shards, is dropped at the next fully_shard call;
// a gradient reduction still in flight then is waited out). The options are
// copied: shard_placement_fn is called during fully_shard only. Threading:
// driven from one thread (plus autograd's); every rank must run the same
// forward/backward sequence.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "comm/device_mesh.h"
#include "comm/process_group.h"
#include "comm/work.h"
#include "kernels/float8_linear.h"

namespace fsdp {

namespace internal {
class FSDPState;
}  // namespace internal

// PyTorch's MixedPrecisionPolicy (the part implemented here).
struct MixedPrecisionPolicy {
  // Gather and compute the parameters in this dtype (unset: their own).
  std::optional<c10::ScalarType> param_dtype;
  // Reduce-scatter gradients in this dtype (unset: param_dtype, else the
  // parameter's own); the shard's .grad keeps the parameter's dtype.
  std::optional<c10::ScalarType> reduce_dtype;
  // Cast the floating-point tensors the module's forward returns to this
  // dtype (PyTorch's output_dtype; unset: leave them). Applied at the call
  // point (module_call's map_tensor_output), so only to at::Tensor,
  // std::vector<at::Tensor> and tuples/pairs of those; other return types
  // are returned unchanged. The cast is differentiable: gradients flow back
  // in the forward's own dtype.
  std::optional<c10::ScalarType> output_dtype;
  // Cast floating-point tensor arguments of the module's forward to
  // param_dtype (when set).
  bool cast_forward_inputs = true;
};

// PyTorch's CPUOffloadPolicy: the sharded parameters (and so their
// gradients and the optimizer's state and step) live on the CPU; the
// module computes on the device its parameters were on when fully_shard
// was called.
//   * Each shard is copied to the CPU at fully_shard (pinned when
//     pin_memory and a CUDA device is present: at::globalContext().hasCUDA();
//     a CPU-only process has no pinned memory and keeps ordinary memory).
//   * Before each all-gather the shard is copied to the compute device
//     (non_blocking when pinned); the gathered parameters live there.
//   * Each reduced gradient is copied back to the CPU (blocking) and added
//     to the shard's .grad there.
// With parameters already on the CPU (a CPU-only run) the shards stay
// where they are, in ordinary memory: the policy then changes nothing but
// what sharded_parameters() promise (CPU tensors).
struct CPUOffloadPolicy {
  bool pin_memory = true;
};

struct FullyShardOptions {
  // The group parameters are sharded over. Give it, or a mesh, or both.
  //   1-D mesh: parameters are sharded over its group (the mesh's ranks,
  //     in order, must then be process_group's).
  //   2-D mesh (HSDP, PyTorch's fully_shard on a 2-D mesh): dim 0
  //     replicates, dim 1 shards. Each parameter is sharded over the
  //     calling rank's dim-1 group and replicated over its dim-0 group;
  //     backward reduce-scatters gradients over the shard group (average)
  //     and then all-reduces the shards over the replicate group (average),
  //     so .grad is the mean over all replicate x shard ranks. With
  //     process_group also given, the mesh must span the same set of ranks.
  //     comm::init_hybrid_shard_mesh(world, replicate, shard) makes one.
  // Any other mesh dimensionality is an error.
  std::optional<comm::ProcessGroup> process_group;
  std::optional<comm::DeviceMesh> mesh;
  // PyTorch's reshard_after_forward: unset is PyTorch's None (true, except
  // for the root, which keeps its parameters for backward); true frees the
  // gathered parameters after forward and gathers them again in backward;
  // false keeps them; an int N (a divisor of the group size) keeps them
  // sharded over groups of N consecutive ranks after forward, so backward
  // gathers only within those. (With a 2-D mesh, N divides the shard
  // dim's size.)
  std::optional<std::variant<bool, int>> reshard_after_forward;
  MixedPrecisionPolicy mp_policy;
  // PyTorch's ignored_params: parameters of the module's subtree that this
  // call leaves alone: not sharded, not gathered, their gradients not
  // reduced (each rank keeps its own, as PyTorch does), not returned by
  // sharded_parameters(). Each must be a parameter of the module's subtree
  // (the tensor named_parameters() returns), else an error naming it.
  std::vector<at::Tensor> ignored_params;
  // PyTorch's shard_placement_fn: called once per managed parameter, it
  // returns the dim to shard that parameter on (PyTorch's Shard(dim);
  // negative counts from the end) or nothing for dim 0. A dim other than 0
  // must divide evenly over the shard group (FSDP2 supports only even
  // sharding off dim 0). Such a parameter's shard is the contiguous
  // torch.chunk(param, W, dim)[rank]; it is gathered as the other
  // parameters are (its shards back to back) and then reassembled with
  // torch.cat(chunks, dim) into a separate unsharded buffer (as PyTorch
  // does), and its gradient is chunked on that dim before the
  // reduce-scatter. sharded_param_spec() reports the dim in shard_dim.
  std::function<std::optional<int64_t>(const at::Tensor& param)> shard_placement_fn;
  // PyTorch's offload_policy: unset is its OffloadPolicy() (no offload).
  std::optional<CPUOffloadPolicy> offload_policy;
  // Float8 all-gather (torchao's enable_fsdp_float8_all_gather, its
  // WeightWithDynamicFloat8CastTensor: fsdp_pre_all_gather's
  // hp_tensor_to_float8_dynamic with reduce_amax, the amaxes of a module
  // reduced in one collective, as precompute_float8_dynamic_scale_for_fsdp
  // batches them; its scale is the dynamic path's, reciprocal then
  // multiply, where precompute's float64 division may differ in the last
  // bit), for the weights of float8 linear layers (kernels::Float8Linear).
  // Called once per managed parameter; where it returns true, every all-gather
  // from the shards first all-reduces (MAX, one collective for the
  // module) the parameter's amax over the shard group, casts this rank's
  // shard to Float8_e4m3fn with the whole parameter's scale
  // (kernels::CastToFloat8Fused with that amax: one fused pass on CUDA)
  // and gathers those bytes: 1 byte
  // an element on the wire and in the gathered buffer instead of
  // param_dtype's 2 or 4. The gathered bytes are, bit for bit, the whole
  // parameter's tensorwise cast, what Float8Linear would make of it.
  //   Unsharded, such a parameter's values are that cast, which
  // float8_unsharded_param() returns for Float8Linear to multiply; the
  // tensor the module's name holds is a stand-in of param_dtype and the
  // parameter's shape whose elements all read NaN (no memory of its
  // size): autograd's leaf, receiving the gradient, which is
  // reduce-scattered in reduce_dtype as any other. Anything else reading
  // the weight while unsharded (an ordinary linear, explicit unshard()
  // followed by reading it) reads NaN. Shards, state dicts and optimizers
  // are unchanged (high precision).
  //   Pays where the all-gather moves bytes between GPUs (several ranks);
  // on one rank it only moves the weight's cast from the forward to the
  // gather. Errors: a parameter that is not of a floating dtype, or that
  // shard_placement_fn shards on a dim other than 0.
  std::function<bool(const at::Tensor& param)> float8_all_gather_fn;
};

// What a sharded parameter is (a DTensor's spec with placement
// Shard(shard_dim), and Replicate() on the replicate dim of a 2-D mesh).
struct ShardedParamSpec {
  std::vector<int64_t> global_shape;
  comm::ProcessGroup group;  // the group it is sharded over
  int64_t shard_dim = 0;     // 0 unless shard_placement_fn chose another
  int rank = 0;              // the group rank holding this shard
  // With shard_dim 0: this shard is rows [dim0_offset, dim0_offset + local
  // dim 0) of the global parameter, and padded_dim0 is dim 0 of the padded
  // shard every rank gathers: ceil(global dim 0 / group size) (torch.chunk's
  // chunk size). With another shard_dim every shard holds all of dim 0:
  // dim0_offset is 0 and padded_dim0 the global dim 0.
  int64_t dim0_offset = 0;
  int64_t padded_dim0 = 0;
  // The same along shard_dim: this shard is [shard_offset, shard_offset +
  // local size) of the global parameter on shard_dim, padded to
  // padded_shard_size there.
  int64_t shard_offset = 0;
  int64_t padded_shard_size = 0;
  // HSDP (2-D mesh): the group the shard is replicated over; unset on a
  // 1-D mesh or process group.
  std::optional<comm::ProcessGroup> replicate_group;
};

// An all-gather FSDPModule::unshard(async_op=true) started (PyTorch's
// UnshardHandle).
class UnshardHandle {
 public:
  UnshardHandle() = default;
  // Waits for the all-gather and points the module at the unsharded
  // parameters. Idempotent.
  void wait();

 private:
  friend class FSDPModule;
  explicit UnshardHandle(std::shared_ptr<internal::FSDPState> state) : state_(std::move(state)) {}
  std::shared_ptr<internal::FSDPState> state_;
};

// A module fully_shard was applied to (PyTorch's FSDPModule): a handle on
// its state, cheap to copy.
class FSDPModule {
 public:
  std::shared_ptr<torch::nn::Module> module() const;

  // All-gathers the module's parameters now (PyTorch's unshard); with
  // async_op the returned handle's wait() finishes it, otherwise it is done.
  // The all-gather may read the shards themselves while in flight (no
  // copy-in when they share one dtype on the compute device): do not
  // change them (e.g. an optimizer step) before wait().
  UnshardHandle unshard(bool async_op = false);
  // Frees the gathered parameters (PyTorch's reshard).
  void reshard();
  // false: backward accumulates unsharded gradients instead of
  // reduce-scattering them; the next synchronised backward reduces the sum.
  // With `recurse`, for every fully_shard module in this one's subtree too
  // (PyTorch's default).
  void set_requires_gradient_sync(bool requires_gradient_sync, bool recurse = true);
  // HSDP (a 2-D mesh): false makes backward reduce-scatter the gradients
  // over the shard group but not all-reduce them over the replicas; the
  // results are kept and added in before the next all-reduce (PyTorch's
  // set_requires_all_reduce: gradient accumulation that sends less), and
  // reach .grad only then. No effect without a replicate group.
  void set_requires_all_reduce(bool requires_all_reduce, bool recurse = true);
  // Whether backward reshards the parameters once their gradients are
  // reduced (default true).
  void set_reshard_after_backward(bool reshard_after_backward, bool recurse = true);

  // PyTorch's set_is_last_backward: whether the next backward is the last
  // one before the gradients are read (default true, and it stays as set).
  // Each module's gradient reduce-scatter starts, asynchronously, when its
  // backward is done; with true, the end of backward waits for all of
  // them (HSDP: and their all-reduces) and adds them to the shards' .grad.
  // With false (microbatches whose backward more backward follows) it does
  // not wait: the reductions stay in flight, overlapping what comes next,
  // and each lands in .grad when the same module's next reduction starts
  // or at the end of the next backward run with true. Until then the
  // shards' .grad lack them (PyTorch on CUDA leaves them unsynchronised
  // instead). Set it on the root (before or after the first forward);
  // it applies to the root's whole tree.
  void set_is_last_backward(bool is_last_backward);

  // Explicit prefetching (PyTorch's set_modules_to_forward_prefetch /
  // set_modules_to_backward_prefetch): when this module's forward (its
  // pre-backward) starts, the all-gathers of `modules` (fully_shard modules)
  // start too, and overlap this module's compute; each waits for its own
  // when it runs.
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules);
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules);

  // The module's sharded parameters, in registration order.
  std::vector<at::Tensor> sharded_parameters() const;

 private:
  friend FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>&,
                                const FullyShardOptions&);
  friend std::optional<FSDPModule> as_fsdp_module(const torch::nn::Module&);
  explicit FSDPModule(std::shared_ptr<internal::FSDPState> state) : state_(std::move(state)) {}
  std::shared_ptr<internal::FSDPState> state_;
};

// Shards `module`'s parameters (those no nested fully_shard module manages)
// and registers the runtime on it. Apply it bottom-up: submodules first,
// the root last. Every rank of the group calls it, in the same order.
FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module,
                       const FullyShardOptions& options);
template <typename Impl>
FSDPModule fully_shard(const torch::nn::ModuleHolder<Impl>& module,
                       const FullyShardOptions& options) {
  return fully_shard(std::static_pointer_cast<torch::nn::Module>(module.ptr()), options);
}

// torch.nn.utils.clip_grad_norm_ over fully_shard's shards: the norm of
// the gradients of all ranks' shards (each element counted once; one
// all-reduce over their group), `norm_type` any p > 0 or inf; scales the
// gradients in place by min(max_norm / (norm + 1e-6), 1), computed on the
// device (no host synchronisation). Returns the total norm (float32
// scalar). Every rank of the group calls it
// after backward. Errors: a parameter that is not a fully_shard shard, or
// shards of different groups.
at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                           double norm_type = 2.0);

// The FSDPModule of `module`, if fully_shard was applied to it.
std::optional<FSDPModule> as_fsdp_module(const torch::nn::Module& module);

// The spec of a parameter fully_shard sharded (its current shard tensor, as
// named_parameters() returns it); nothing for any other tensor.
std::optional<ShardedParamSpec> sharded_param_spec(const at::Tensor& param);

// A float8-gathered parameter's cast (options.float8_all_gather_fn) while
// its module is unsharded: `unsharded_param` is the tensor the module's
// name holds then (the stand-in); data is the gathered Float8_e4m3fn bytes
// in the parameter's shape, scale and inv_scale the whole parameter's.
// Nothing for any other tensor, or while sharded. The tensors are
// fully_shard's buffers: valid until the module reshards; autograd may
// save them (they are refilled before backward reads them). A float8
// linear computes
//   if (auto cast = fsdp::float8_unsharded_param(weight))
//     y = kernels::Float8Linear(x, weight, *cast, bias);
std::optional<kernels::Float8Tensor> float8_unsharded_param(const at::Tensor& unsharded_param);

// PyTorch's module.to_empty(device=device) on a module tree fully_shard
// was applied to (FSDPModule._apply + FSDPParam.reset_sharded_param):
// allocates, uninitialised (torch::empty), every tensor of `root`'s tree
// that is on the meta device:
//   * each fully_shard module's meta shards, this rank's only, on `device`
//     (with a CPUOffloadPolicy on the CPU, pinned where fully_shard pins);
//     the module then computes on `device`. A module's shards of one dtype
//     lie back to back in one buffer, as fully_shard lays them out; the
//     padding rows are zero. The shards replace the meta ones everywhere:
//     in FSDP's state and in the modules (their registries and members,
//     through functorch::NamedMemberAccessor), so named_parameters(),
//     sharded_parameters(), sharded_param_spec() and forward see them.
//   * every other meta parameter (ignored_params, modules outside every
//     fully_shard module) and buffer, whole, on `device` (tied tensors stay
//     tied).
// Tensors not on meta are left as they are (PyTorch's to_empty would
// replace them too). The parameters are new tensors: build the optimizer
// after to_empty. Then fill them (state_dict::LoadFullyShardStateDict /
// LoadFullyShardFrom read each rank's rows only, or init_sharded_states);
// from there on the module behaves as one sharded from real tensors.
// Local (no collective); call it on every rank. Errors: `device` meta;
// `root` not owned by a std::shared_ptr; `root` inside a fully_shard
// module whose shards are still on meta (call it on that module or the
// root: a module's shards are allocated together).
void to_empty(torch::nn::Module& root, c10::Device device);

// A function filling one tensor of a module tree in place: `fqn` its name
// under the root, `local` the tensor (this rank's shard of a parameter
// fully_shard sharded, else a whole parameter or buffer) and, for a shard,
// its spec: it holds [spec->shard_offset, spec->shard_offset +
// local.size(spec->shard_dim)) of the global tensor (shape
// spec->global_shape) along spec->shard_dim; nullopt for a whole tensor.
using ShardInitFn = std::function<void(const std::string& fqn, const at::Tensor& local,
                                       const std::optional<ShardedParamSpec>& spec)>;

// Calls `init_fn` once per parameter and buffer of `root`'s tree (tied
// tensors once, under their first name; parameters first, in
// named_parameters() order), with every fully_shard module resharded and
// gradients off: initialisation over shards, e.g. after to_empty
// (each rank fills its own rows: a random init must draw per global
// position to agree with an unsharded one). Local. Errors: a tensor still
// on meta; whatever `init_fn` throws propagates.
void init_sharded_states(torch::nn::Module& root, const ShardInitFn& init_fn);

}  // namespace fsdp
