// FullyShardedDataParallel for LibTorch modules (PyTorch's
// torch.distributed.fsdp.FullyShardedDataParallel).
//
//   fsdp::FullyShardedDataParallel::Options options;
//   options.process_group = world;
//   options.auto_wrap_policy = module_call::module_type_auto_wrap_policy<BlockImpl>();
//   fsdp::FullyShardedDataParallel model(MyModel(), options);
//   torch::optim::Adam optim(model.parameters(), 1e-3);
//   auto loss = loss_fn(model.forward(x), y);     // or model(x)
//   loss.backward();                              // gradients reduce-scattered
//   optim.step();
//
// Units. The wrapped module is the root unit; the auto-wrap policy makes
// chosen submodules nested units. Each unit owns one FlatParamHandle over its
// parameters that no deeper unit owns. Nothing is inserted into the module
// tree: parameter and buffer names stay the user's (clean FQNs).
//
// Calling nested units. LibTorch has no forward hooks, so FSDP registers its
// pre-/post-forward on every module it manages at the module call point
// (module_call/call.h), and a nested unit must be called through it:
//
//   x = layer->forward(x);            becomes   x = module_call::call(layer, x);
//
// which gathers the unit's parameters, runs layer->forward(x), frees them
// again (FULL_SHARD) and arms the backward hooks. torch::nn::Sequential (as
// root or unit) needs nothing: the call point drives its children. Calling a
// module inside a unit whose parameters are sharded is an error naming the
// unit.
//
// Runtime per iteration (as PyTorch's _runtime_utils): pre-forward gathers
// a unit (and, with forward_prefetch, starts the next unit's all-gather in
// the order recorded at the first forward); post-forward frees it again for
// FULL_SHARD / HYBRID_SHARD except on the root, whose parameters backward
// needs first; hooks on the unit's output tensors gather it again when
// backward reaches it (prefetching the next unit for kBackwardPre); once
// autograd has accumulated the unit's gradient its gradient is reduced
// (not under no_sync) and the unit resharded (prefetch for kBackwardPost);
// a callback queued on the autograd engine at the end of backward frees
// whatever is still gathered and resets the per-iteration state.
//
// Bad input caught: a submodule of a sharded unit called through
// module_call::call; a unit called outside its root's forward or inside an
// activation-checkpointed region; a second backward through a graph whose
// backward already ran; a parameter shared by two
// units; PyTorch's invalid option combinations. Not caught: calling a
// submodule's forward() directly (LibTorch gives FSDP no hook; it then sees
// 1-D shards and usually fails on shapes), and in-place writes to parameters
// outside summon_full_params (they land in this rank's shard).
//
// Threading: one FullyShardedDataParallel is driven from one thread (plus
// the autograd engine's, which runs its hooks); every rank must run the same
// forward/backward sequence, as in PyTorch.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/device_mesh.h"
#include "comm/process_group.h"
#include "fsdp/flat_param.h"
#include "fsdp/mixed_precision.h"
#include "fsdp/sharding_strategy.h"
#include "module_call/call.h"
#include "module_call/wrap_policy.h"

namespace fsdp {

// When the next unit's parameters are gathered during backward (PyTorch's
// BackwardPrefetch): before the current unit's gradient computation
// (kBackwardPre, more overlap, more memory), after its gradient reduction
// (kBackwardPost), or only when needed (kNone).
enum class BackwardPrefetch { kNone, kBackwardPre, kBackwardPost };

struct CPUOffload {
  // Keep the shard and its gradient on the CPU; gather onto the compute
  // device. (With a CPU compute device this changes nothing.)
  bool offload_params = false;
};

namespace internal {
class Runtime;

// True when ModuleImpl has one non-template forward() (what AnyModule needs).
template <typename T, typename = void>
struct has_single_forward : std::false_type {};
template <typename T>
struct has_single_forward<T, std::void_t<decltype(&T::forward)>> : std::true_type {};
}  // namespace internal

// What summon_full_params gathers (PyTorch's arguments of the same names).
struct SummonOptions {
  // Copy changes made to the full parameters back into the shards.
  bool writeback = true;
  // Only rank 0 keeps the full parameters (others reshard at once).
  bool rank0_only = false;
  // Full parameters on the CPU (they already are with a CPU compute device).
  bool offload_to_cpu = false;
  // Also gather gradients into the full parameters' .grad
  // (requires use_orig_params, as in PyTorch).
  bool with_grads = false;
};

class FullyShardedDataParallel {
 public:
  // PyTorch's __init__ arguments.
  struct Options {
    // The data-parallel group (required: LibTorch has no default group).
    // For HYBRID_SHARD pass hybrid_groups or device_mesh instead.
    std::optional<comm::ProcessGroup> process_group;
    // HYBRID_SHARD / _HYBRID_SHARD_ZERO2: (shard, replicate) pair.
    std::optional<comm::HybridShardGroups> hybrid_groups;
    // 1-D (its group is the data-parallel group) or, for the hybrid
    // strategies, 2-D (replicate x shard). Exclusive with process_group.
    std::optional<comm::DeviceMesh> device_mesh;
    ShardingStrategy sharding_strategy = ShardingStrategy::kFullShard;
    CPUOffload cpu_offload;
    module_call::AutoWrapPolicy auto_wrap_policy;
    BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
    // param_dtype: gathered and computed in it (floating-point inputs of the
    // root and of units are cast to it); reduce_dtype: gradients reduced in
    // it; buffer_dtype: buffers are cast to it once, at construction.
    MixedPrecision mixed_precision;
    // Modules (with their subtrees) and parameters FSDP leaves alone: not
    // flattened, not sharded, gradients not reduced (as in PyTorch, keeping
    // them in sync is the caller's job). They still appear in parameters().
    std::vector<std::shared_ptr<torch::nn::Module>> ignored_modules;
    std::vector<at::Tensor> ignored_states;
    // Materialises parameters created on the meta device, called once per
    // module just before the unit owning it is flattened (so only one unit is
    // ever materialised unsharded). Required when any parameter or buffer is
    // on meta; must leave none there. A meta tensor cannot take CPU data
    // through set_data, so replace the tensors (e.g. with
    // functorch::NamedMemberAccessor::set_tensor, which updates the member
    // handles too).
    std::function<void(torch::nn::Module&)> param_init_fn;
    // Compute device; the module is moved there first when it is elsewhere.
    std::optional<c10::Device> device_id;
    // Broadcast rank 0's parameters and buffers before sharding.
    bool sync_module_states = false;
    // Gather the next unit (recorded order) while the current one computes.
    bool forward_prefetch = false;
    // The rate limiter: at most two non-root units' parameters gathered at
    // once. On the CPU there is no stream to block, so a prefetch that would
    // exceed it is skipped (the unit is gathered when it runs) instead of
    // waiting for a free.
    bool limit_all_gathers = true;
    // Optimizer-facing parameters are the original ones (views of this
    // rank's shard) rather than one flat parameter per unit.
    bool use_orig_params = false;
  };

  using SummonOptions = fsdp::SummonOptions;

  // RAII: the module's parameters are the full, unsharded ones while alive.
  class FullParamsGuard {
   public:
    ~FullParamsGuard();
    FullParamsGuard(FullParamsGuard&&) noexcept;
    FullParamsGuard(const FullParamsGuard&) = delete;
    FullParamsGuard& operator=(const FullParamsGuard&) = delete;
    FullParamsGuard& operator=(FullParamsGuard&&) = delete;

   private:
    friend class FullyShardedDataParallel;
    FullParamsGuard(std::shared_ptr<internal::Runtime> rt, SummonOptions options);
    std::shared_ptr<internal::Runtime> rt_;
    SummonOptions options_;
  };

  // RAII: backward accumulates unreduced gradients instead of reducing them;
  // the first backward after the guard reduces the sum.
  class NoSyncGuard {
   public:
    ~NoSyncGuard();
    NoSyncGuard(NoSyncGuard&&) noexcept;
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(NoSyncGuard&&) = delete;

   private:
    friend class FullyShardedDataParallel;
    explicit NoSyncGuard(std::shared_ptr<internal::Runtime> rt);
    std::shared_ptr<internal::Runtime> rt_;
  };

  // Wraps `module` (typed: its forward() becomes this object's forward()).
  template <typename ModuleImpl>
  FullyShardedDataParallel(std::shared_ptr<ModuleImpl> module, Options options)
      : FullyShardedDataParallel(std::static_pointer_cast<torch::nn::Module>(module),
                                 std::move(options)) {
    if constexpr (std::is_same<ModuleImpl, torch::nn::SequentialImpl>::value) {
      root_sequential_ = module.get();
    } else if constexpr (std::is_same<ModuleImpl, torch::nn::Module>::value) {
      root_sequential_ = dynamic_cast<torch::nn::SequentialImpl*>(module.get());
    } else if constexpr (internal::has_single_forward<ModuleImpl>::value) {
      // AnyModule type-erases the forward signature (and checks argument
      // types at run time with a clear message).
      root_any_ = torch::nn::AnyModule(module);
    }
  }
  template <typename ModuleImpl>
  FullyShardedDataParallel(const torch::nn::ModuleHolder<ModuleImpl>& module, Options options)
      : FullyShardedDataParallel(module.ptr(), std::move(options)) {}
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  // The root's forward, with the root unit's pre-/post-forward around it
  // (and, under mixed precision, floating-point tensor arguments cast to
  // param_dtype). ReturnType must be what the module's forward returns.
  template <typename ReturnType = at::Tensor, typename... Args>
  ReturnType forward(Args&&... args);
  template <typename... Args>
  at::Tensor operator()(Args&&... args) {
    return forward<at::Tensor>(std::forward<Args>(args)...);
  }

  // Runs `fn` as the root's forward: for a root entered through another
  // method than forward() (a Loss(batch) that calls forward itself), or a
  // root without a single forward(). `fn` returns at::Tensor,
  // std::vector<at::Tensor> or a tuple/pair of those (FSDP hooks them for
  // backward). Inputs are not cast for mixed precision here.
  //   auto loss = fsdp_model.run([&] { return lm->Loss(batch); });
  template <typename Fn>
  auto run(Fn&& fn);

  // The optimizer's parameters: with use_orig_params the original
  // parameters (this rank's 1-D part of each), otherwise one flat parameter
  // per unit ("<unit fqn>.flat_param", the root's is "flat_param"); then
  // the parameters FSDP does not manage (ignored). Each tensor once.
  std::vector<at::Tensor> parameters() const;
  torch::OrderedDict<std::string, at::Tensor> named_parameters() const;
  // Buffers (never sharded) under their own names.
  torch::OrderedDict<std::string, at::Tensor> named_buffers() const;

  // Gradient clipping over the whole model: the norm of all gradients of
  // all ranks' shards (each element counted once, ignored parameters
  // included), `norm_type` any p > 0 or inf. Scales gradients in place by
  // min(max_norm / (norm + 1e-6), 1), computed on the device (no host
  // synchronisation); returns the total norm (float32 scalar, on the
  // shards' device). Every rank must call it.
  at::Tensor clip_grad_norm_(double max_norm, double norm_type = 2.0);

  NoSyncGuard no_sync();
  // Every rank must call it (it all-gathers). Not inside forward/backward.
  FullParamsGuard summon_full_params(SummonOptions options = {});
  // fn on the root and every submodule (Module::apply's order) with full
  // parameters, written back afterwards (PyTorch's FSDP.apply).
  void apply(const std::function<void(torch::nn::Module&)>& fn);

  // The unit modules, root first, then the nested ones in pre-order.
  std::vector<std::shared_ptr<torch::nn::Module>> fsdp_modules() const;
  std::vector<std::string> fsdp_unit_names() const;
  // The handles, in the order of fsdp_modules() (null for a unit without
  // parameters).
  std::vector<const FlatParamHandle*> handles() const;

  // Largest sum over units of gathered-parameter bytes
  // (FlatParamHandle::unsharded_storage_nbytes) seen at any unshard since
  // construction or the last reset.
  int64_t peak_unsharded_bytes() const;
  void reset_peak_unsharded_bytes();

  const std::shared_ptr<torch::nn::Module>& module() const;
  const Options& options() const;

 private:
  FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> module, Options options);
  // Throws when the root's forward cannot be called (type-erased module).
  void check_root_callable() const;

  std::shared_ptr<internal::Runtime> rt_;
  torch::nn::AnyModule root_any_;
  torch::nn::SequentialImpl* root_sequential_ = nullptr;
};

template <typename Fn>
auto FullyShardedDataParallel::run(Fn&& fn) {
  module_call::ForwardCall call(*module());
  return call.finish(std::forward<Fn>(fn)());
}

template <typename ReturnType, typename... Args>
ReturnType FullyShardedDataParallel::forward(Args&&... args) {
  check_root_callable();
  module_call::ForwardCall call(*module());
  torch::nn::AnyValue out = torch::nn::AnyValue(0);
  if (root_sequential_ != nullptr) {
    std::vector<torch::nn::AnyValue> values;
    (values.emplace_back(call.argument(std::forward<Args>(args))), ...);
    out = module_call::sequential_forward(*root_sequential_, std::move(values));
  } else {
    out = root_any_.any_forward(call.argument(std::forward<Args>(args))...);
  }
  return call.finish(out.get<ReturnType>());
}

}  // namespace fsdp
