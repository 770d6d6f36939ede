// FullyShardedDataParallel for LibTorch modules (PyTorch's
// torch.distributed.fsdp.FullyShardedDataParallel).
//
//   fsdp::FullyShardedDataParallel::Options options;
//   options.process_group = world;
//   options.auto_wrap_policy = fsdp::module_type_auto_wrap_policy<BlockImpl>();
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
// Calling nested units. LibTorch has no forward hooks and a parent calls its
// children through typed members, so FSDP cannot intercept those calls. A
// nested unit must therefore be called through fsdp::call(child, args...),
// which gathers its parameters, runs child->forward(args...), frees them
// again (FULL_SHARD) and arms the backward hooks. For torch::nn::Sequential
// (as root or unit) FSDP drives the children itself; for any other module the
// parent's forward changes one line per call site:
//
//   x = layer->forward(x);            becomes   x = fsdp::call(layer, x);
//
// fsdp::call on a module that is not a unit just calls forward; on a module
// inside a unit whose parameters are sharded it is an error naming the unit.
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
// fsdp::call; a unit called outside its root's forward; a second backward
// through a graph whose backward already ran; a parameter shared by two
// units; the seed's invalid option combinations. Not caught: calling a
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

#include "activation_checkpointing/internal/checkpoint_function.h"
#include "comm/device_mesh.h"
#include "comm/process_group.h"
#include "fsdp/flat_param.h"
#include "fsdp/mixed_precision.h"
#include "fsdp/sharding_strategy.h"
#include "fsdp/wrap_policy.h"

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
  // The seed's __init__ arguments.
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
    AutoWrapPolicy auto_wrap_policy;
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
  // included), `norm_type` any p > 0 or inf. Scales gradients in place when
  // the norm exceeds max_norm; returns the total norm (float32 scalar).
  // Every rank must call it.
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

// ---------------------------------------------------------------------------
// The explicit call point for nested units (see the top of this file).
// `module` is a ModuleHolder (Linear, MyBlock), a std::shared_ptr<Impl> or
// an Impl* (what ModuleList's ptr->as<Impl>() gives).
template <typename ModuleRef, typename... Args>
auto call(ModuleRef&& module, Args&&... args);

// ---------------------------------------------------------------------------
// Implementation details of the templates above.
namespace internal {

// What the post-forward needs from the pre-forward.
struct Frame {
  std::shared_ptr<Runtime> rt;
  int unit = -1;
  bool root = false;
};

// Pre-forward for `module`: a unit (gather, prefetch), a module inside a
// unit (checked to be gathered), or nothing.
Frame pre_forward(torch::nn::Module& module);
// Post-forward: reshard when the strategy says so and arm the pre-backward
// hooks on `outputs`. `outputs_known` is false when the forward returned a
// type FSDP cannot look into.
void post_forward(const Frame& frame, const std::vector<at::Tensor>& outputs,
                  bool outputs_known);
// The forward threw: return the root to idle (and free what it gathered) so
// the next iteration can start.
void abort_forward(const Frame& frame) noexcept;
// Calls abort_forward unless released (post-forward reached).
class FrameGuard {
 public:
  explicit FrameGuard(const Frame& frame) : frame_(frame) {}
  ~FrameGuard() {
    if (!released_) abort_forward(frame_);
  }
  FrameGuard(const FrameGuard&) = delete;
  FrameGuard& operator=(const FrameGuard&) = delete;
  void release() { released_ = true; }

 private:
  const Frame& frame_;
  bool released_ = false;
};
// Under mixed precision, the dtype floating-point inputs of `frame`'s unit
// are cast to (nullopt: none).
std::optional<c10::ScalarType> input_dtype(const Frame& frame);
// Sequential semantics with unit logic per child.
torch::nn::AnyValue sequential_forward(torch::nn::SequentialImpl& sequential,
                                       std::vector<torch::nn::AnyValue> args);
std::vector<at::Tensor> any_value_tensors(torch::nn::AnyValue& value, bool* known);

template <typename T>
bool collect_tensors(const T&, std::vector<at::Tensor>*) {
  return false;
}
inline bool collect_tensors(const at::Tensor& t, std::vector<at::Tensor>* out) {
  out->push_back(t);
  return true;
}
inline bool collect_tensors(const std::vector<at::Tensor>& ts, std::vector<at::Tensor>* out) {
  out->insert(out->end(), ts.begin(), ts.end());
  return true;
}
template <typename... Ts>
bool collect_tensors(const std::tuple<Ts...>& tuple, std::vector<at::Tensor>* out) {
  bool known = true;
  std::apply([&](const auto&... elems) { ((known &= collect_tensors(elems, out)), ...); },
             tuple);
  return known;
}
template <typename A, typename B>
bool collect_tensors(const std::pair<A, B>& pair, std::vector<at::Tensor>* out) {
  const bool a = collect_tensors(pair.first, out);
  const bool b = collect_tensors(pair.second, out);
  return a && b;
}

template <typename T>
T&& cast_input(T&& value, std::optional<c10::ScalarType>) {
  return std::forward<T>(value);
}
inline at::Tensor cast_input(const at::Tensor& t, std::optional<c10::ScalarType> dtype) {
  if (!dtype || !t.defined() || !t.is_floating_point()) return t;
  return t.to(*dtype);
}
inline at::Tensor cast_input(at::Tensor& t, std::optional<c10::ScalarType> dtype) {
  return cast_input(static_cast<const at::Tensor&>(t), dtype);
}
inline at::Tensor cast_input(at::Tensor&& t, std::optional<c10::ScalarType> dtype) {
  return cast_input(static_cast<const at::Tensor&>(t), dtype);
}

template <typename T>
torch::nn::Module& module_of(const std::shared_ptr<T>& m) {
  return *m;
}
template <typename T>
torch::nn::Module& module_of(const torch::nn::ModuleHolder<T>& m) {
  return *m.ptr();
}
template <typename T>
torch::nn::Module& module_of(T* m) {
  return *m;
}
template <typename T>
T& impl_of(const std::shared_ptr<T>& m) {
  return *m;
}
template <typename T>
T& impl_of(const torch::nn::ModuleHolder<T>& m) {
  return *m.ptr();
}
template <typename T>
T& impl_of(T* m) {
  return *m;
}

// Before a checkpointed module inside `module`'s unit is recomputed in
// backward: gather that unit (normally already done by its pre-backward)
// and point the module tree at its unsharded views again (resharding
// pointed it back at the shards).
void before_recompute(torch::nn::Module& module);
// After that recomputation, before its backward: finish the gradient
// reductions still in flight (Runtime::finish_reductions_in_backward).
void before_recompute_backward(torch::nn::Module& module);

// impl.forward(args...) as a checkpointed region
// (activation_checkpointing/apply_activation_checkpointing.h): the module's
// parameters are declared, and FSDP prepares each recomputation.
template <typename Impl, typename... Args>
auto checkpointed_forward(Impl& impl, Args&&... args) {
  using Out = std::decay_t<decltype(impl.forward(std::forward<Args>(args)...))>;
  if constexpr (activation_checkpointing::internal::is_region_output<Out>::value) {
    Impl* self = &impl;
    activation_checkpointing::internal::Declared declared;
    declared.params = [self] { return self->parameters(); };
    declared.before_recompute = [self] { before_recompute(*self); };
    declared.before_backward = [self] { before_recompute_backward(*self); };
    declared.what = "activation checkpointing of module " + impl.name();
    return activation_checkpointing::internal::checkpoint_call(
        /*preserve_rng_state=*/true, std::move(declared),
        [self](auto&&... a) { return self->forward(a...); }, std::forward<Args>(args)...);
  } else {
    TORCH_CHECK(false, "activation checkpointing of module ", impl.name(),
                ": its forward returns a type a checkpointed region cannot return: expected "
                "at::Tensor, std::vector<at::Tensor> or std::tuple of tensors");
    return impl.forward(std::forward<Args>(args)...);
  }
}

}  // namespace internal

template <typename ModuleRef, typename... Args>
auto call(ModuleRef&& module, Args&&... args) {
  auto& impl = internal::impl_of(module);
  using Impl = std::decay_t<decltype(impl)>;
  internal::Frame frame = internal::pre_forward(internal::module_of(module));
  internal::FrameGuard guard(frame);
  const auto dtype = internal::input_dtype(frame);
  if constexpr (std::is_same<Impl, torch::nn::SequentialImpl>::value) {
    std::vector<torch::nn::AnyValue> values;
    (values.emplace_back(internal::cast_input(std::forward<Args>(args), dtype)), ...);
    torch::nn::AnyValue out = internal::sequential_forward(impl, std::move(values));
    bool known = false;
    std::vector<at::Tensor> tensors = internal::any_value_tensors(out, &known);
    guard.release();
    internal::post_forward(frame, tensors, known);
    return out.get<at::Tensor>();
  } else {
    auto out = activation_checkpointing::internal::is_checkpointed(impl)
                   ? internal::checkpointed_forward(impl, internal::cast_input(
                                                              std::forward<Args>(args), dtype)...)
                   : impl.forward(internal::cast_input(std::forward<Args>(args), dtype)...);
    std::vector<at::Tensor> tensors;
    const bool known = internal::collect_tensors(out, &tensors);
    guard.release();
    internal::post_forward(frame, tensors, known);
    return out;
  }
}

template <typename Fn>
auto FullyShardedDataParallel::run(Fn&& fn) {
  internal::Frame frame = internal::pre_forward(*module());
  internal::FrameGuard guard(frame);
  auto out = std::forward<Fn>(fn)();
  std::vector<at::Tensor> tensors;
  const bool known = internal::collect_tensors(out, &tensors);
  guard.release();
  internal::post_forward(frame, tensors, known);
  return out;
}

template <typename ReturnType, typename... Args>
ReturnType FullyShardedDataParallel::forward(Args&&... args) {
  internal::Frame frame = internal::pre_forward(*module());
  internal::FrameGuard guard(frame);
  const auto dtype = internal::input_dtype(frame);
  check_root_callable();
  torch::nn::AnyValue out = torch::nn::AnyValue(0);
  if (root_sequential_ != nullptr) {
    std::vector<torch::nn::AnyValue> values;
    (values.emplace_back(internal::cast_input(std::forward<Args>(args), dtype)), ...);
    out = internal::sequential_forward(*root_sequential_, std::move(values));
  } else {
    out = root_any_.any_forward(internal::cast_input(std::forward<Args>(args), dtype)...);
  }
  bool known = false;
  std::vector<at::Tensor> tensors = internal::any_value_tensors(out, &known);
  if (!known) {
    if (auto* typed = out.try_get<ReturnType>()) known = internal::collect_tensors(*typed, &tensors);
  }
  guard.release();
  internal::post_forward(frame, tensors, known);
  return out.get<ReturnType>();
}

}  // namespace fsdp
