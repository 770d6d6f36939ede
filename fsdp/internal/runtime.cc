// The forward/backward runtime (PyTorch's _runtime_utils.py): pre-forward
// (gather, forward prefetch) and post-forward (reshard, arm the pre-backward
// hooks on the outputs); pre-backward (gather again, kBackwardPre prefetch)
// and post-backward (start the gradient reduction, reshard, kBackwardPost
// prefetch); the reductions in flight; and the end-of-backward callback
// (final_callback) queued on the autograd engine. They run from the hooks
// register_forward_hooks puts on every managed module at the module call
// point (module_call/forward_hooks.h) and on the units' outputs.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <exception>
#include <unordered_set>

#include "fsdp/internal/comm_streams.h"
#include "fsdp/internal/runtime_state.h"
#include "module_call/forward_hooks.h"

namespace fsdp {
namespace internal {
namespace {

// Gradient reductions allowed in flight at once during backward (see
// Runtime::post_backward). One already overlaps a unit's reduction with the
// next unit's backward; on trainer_bench (2 and 4 ranks, 2 cores) two were
// no faster and held ~40 MiB more peak RSS with FULL_SHARD.
constexpr size_t kMaxReductionsInFlight = 1;

}  // namespace

void Runtime::note_unsharded() {
  int64_t total = 0;
  for (const auto& unit : units_) {
    if (unit->handle) total += unit->handle->unsharded_storage_nbytes();
  }
  peak_unsharded_bytes_ = std::max(peak_unsharded_bytes_, total);
}

int Runtime::gathered_units() const {
  int n = 0;
  for (const auto& unit : units_) {
    if (unit->is_root || !unit->handle || !uses_sharding(options_.sharding_strategy)) continue;
    if (unit->handle->is_unsharded() || unit->handle->is_unsharding()) ++n;
  }
  return n;
}

int Runtime::next_in(const std::vector<int>& order, int unit) const {
  auto it = std::find(order.begin(), order.end(), unit);
  if (it == order.end() || ++it == order.end()) return -1;
  return *it;
}

void Runtime::prefetch(int unit) {
  if (unit < 0) return;
  auto& handle = units_[unit]->handle;
  if (!handle || handle->is_unsharded() || handle->is_unsharding()) return;
  // The rate limiter: instead of blocking the host until a gathered unit is
  // freed (PyTorch waits on a CUDA event; on the CPU there is nothing to
  // wait on), the prefetch is skipped (the unit is then gathered on demand),
  // which keeps at most two units' parameters gathered on every device.
  if (options_.limit_all_gathers && gathered_units() >= 2) return;
  handle->unshard(/*async=*/true);
  note_unsharded();
}

void Runtime::unit_pre_forward(int index) {
  Unit& unit = *units_[index];
  TORCH_CHECK(!module_call::in_rerunning_region(), "module_call::call(", describe(unit.fqn),
              "): this FSDP unit runs inside an "
              "activation-checkpointed region, whose recomputation in backward would have "
              "to run the unit's forward again: checkpoint the FSDP units themselves (or "
              "modules inside them), not a module that contains units");
  if (unit.is_root) {
    if (state_ == TrainingState::kBackward) {
      // The last backward failed before its final callback ran (an error
      // inside it): start over from a clean state. Its partial, unreduced
      // gradients are dropped so they cannot leak into this iteration.
      for (auto& u : units_) {
        if (u->handle) u->handle->clear_unsharded_grad();
      }
      final_callback();
    }
    TORCH_CHECK(state_ == TrainingState::kIdle, "FullyShardedDataParallel::forward: ",
                "called while a forward is running: the root's forward must not be "
                "re-entered");
    TORCH_CHECK(summon_depth_ == 0, "FullyShardedDataParallel::forward: called inside ",
                "summon_full_params: leave its scope first");
    // Normally final_callback finished them; not if backward never reached it.
    finish_reductions();
    reset_flat_param_grads_if_needed();
    state_ = TrainingState::kForward;
    forward_since_backward_ = true;
    current_order_.clear();
  } else {
    TORCH_CHECK(state_ == TrainingState::kForward, "module_call::call(", describe(unit.fqn),
                "): this FSDP unit was called outside its root's forward: call the "
                "FullyShardedDataParallel object (forward or operator()) and let the "
                "root module call its units");
  }
  if (!forward_order_recorded_) current_order_.push_back(index);
  if (unit.handle) {
    try {
      unit.handle->unshard();
      unit.handle->use_unsharded_views();
    } catch (...) {
      if (unit.is_root) state_ = TrainingState::kIdle;
      throw;
    }
    note_unsharded();
  }
  if (options_.forward_prefetch && forward_order_recorded_) {
    prefetch(next_in(forward_order_, index));
  }
}

void Runtime::unit_post_forward(int index, const std::vector<at::Tensor>& outputs, bool known) {
  Unit& unit = *units_[index];
  const bool grad = at::GradMode::is_enabled();
  bool resharded = false;
  if (unit.handle && ((!unit.is_root && unit.handle->reshard_after_forward()) || !grad)) {
    unit.handle->reshard();
    resharded = true;
  }
  if (grad) {
    bool hooked = false;
    std::weak_ptr<Runtime> weak = weak_from_this();
    for (const auto& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      t.register_hook([weak, index](const at::Tensor&) {
        if (auto rt = weak.lock()) rt->pre_backward(index);
      });
      hooked = true;
    }
    TORCH_CHECK(known || hooked || !resharded, "module_call::call(", describe(unit.fqn),
                "): the unit's forward returned a type FSDP cannot look into, so its "
                "backward could not gather its parameters again: return at::Tensor, "
                "std::vector<at::Tensor>, or a std::tuple/std::pair of those");
  }
  if (unit.is_root) {
    if (!forward_order_recorded_) {
      forward_order_ = current_order_;
      forward_order_recorded_ = true;
    }
    state_ = TrainingState::kIdle;
  }
}

void Runtime::check_owner_gathered(const torch::nn::Module& module) {
  auto owner = owner_of_.find(&module);
  if (owner == owner_of_.end()) return;
  const Unit& unit = *units_[owner->second];
  if (!unit.handle || unit.handle->is_unsharded()) return;
  auto name = fqn_of_.find(&module);
  TORCH_CHECK(false, "module_call::call(",
              name == fqn_of_.end() ? module.name() : describe(name->second), "): module ",
              module.name(), " belongs to FSDP unit ", unit_name(unit.fqn),
              " whose parameters are sharded; call ", unit_name(unit.fqn),
              " through module_call::call (the root through FullyShardedDataParallel::forward)");
}

void Runtime::prepare_recompute(int unit) {
  auto& handle = units_[unit]->handle;
  if (!handle) return;
  // Normally a no-op: the unit's pre-backward (hooked on its outputs) ran
  // before backward reached anything inside it.
  handle->unshard();
  handle->use_unsharded_views();
  note_unsharded();
}

void Runtime::finish_reductions_in_backward() {
  // A checkpointed module's recomputation is about to be differentiated:
  // its unit's backward peaks from here on (the recomputed activations,
  // their gradients and the unit's gradient alive together). The reduction
  // the previous unit's post-backward started has overlapped the
  // recomputation's forward; finishing it now frees its unsharded gradient
  // and reduce-scatter buffers (2.5x the unit's sharded size on 2 ranks)
  // before that peak instead of after it. Measured on trainer_bench
  // (FULL_SHARD, every block checkpointed, 2 ranks, seq 512): the step's
  // allocated peak 15 MiB lower and its peak RSS ~25 MiB lower, for a wait
  // of 0-13 ms per unit here. Finishing before the recomputation instead
  // would save 15 MiB more but waited 15-44 ms per unit (the collective had
  // only just started: no overlap left). Every rank finishes the same
  // reductions in the same order, so results are unchanged.
  if (state_ != TrainingState::kBackward) return;
  finish_reductions();
}

void Runtime::pre_backward(int index) {
  if (!backward_started_) {
    TORCH_CHECK(forward_since_backward_,
                "FullyShardedDataParallel: backward through a "
                "graph whose backward already ran (retain_graph=true reuse or double "
                "backward) is not supported: FSDP reduced and freed the gradients and "
                "parameters of that pass; run forward again");
    backward_started_ = true;
    state_ = TrainingState::kBackward;
    current_order_.clear();
    // zero_grad may also run between forward and backward.
    reset_flat_param_grads_if_needed();
    std::weak_ptr<Runtime> weak = weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto rt = weak.lock()) rt->final_callback();
    });
  }
  Unit& unit = *units_[index];
  if (unit.pre_backward_done) return;
  unit.pre_backward_done = true;
  if (!backward_order_recorded_) current_order_.push_back(index);
  if (unit.handle) {
    unit.handle->unshard();  // no-op when still gathered (or prefetched)
    note_unsharded();
  }
  if (options_.backward_prefetch == BackwardPrefetch::kBackwardPre && backward_order_recorded_) {
    prefetch(next_in(backward_order_, index));
  }
  // Free the buffers of reductions that completed meanwhile.
  poll_reductions();
}

void Runtime::post_backward(int index) {
  Unit& unit = *units_[index];
  if (!unit.handle) return;
  if (!no_sync_) {
    // Start the reduction and let backward go on; final_callback (queued by
    // the first pre_backward) waits for it before the optimizer can see the
    // gradients. Reductions that completed meanwhile are finished here, so
    // only the unsharded gradients of those in flight stay alive.
    try {
      if (unit.handle->reduce_grad_pending()) finish_reductions();
      if (unit.handle->start_reduce_grad()) pending_reductions_.push_back(index);
      if (backward_started_) {
        poll_reductions();
        // Bound the memory: at most kMaxReductionsInFlight units' unsharded
        // gradients (and reduction buffers) wait for their collectives; the
        // oldest is waited for beyond that (PyTorch's CUDA streams hold
        // more; the CPU gains nothing from a longer queue).
        while (pending_reductions_.size() > kMaxReductionsInFlight) {
          units_[pending_reductions_.front()]->handle->finish_reduce_grad();
          pending_reductions_.pop_front();
        }
      } else {
        // No end-of-backward callback was queued (backward did not enter
        // through a unit's output): finish now, as a blocking reduction.
        finish_reductions();
      }
    } catch (...) {
      abandon_reductions();
      throw;
    }
  }
  unit.handle->reshard();
  if (options_.backward_prefetch == BackwardPrefetch::kBackwardPost && backward_order_recorded_) {
    prefetch(next_in(backward_order_, index));
  }
}

void Runtime::reset_flat_param_grads_if_needed() {
  for (const auto& unit : units_) {
    if (unit->handle) unit->handle->reset_flat_param_grad_if_needed();
  }
}

void Runtime::poll_reductions() {
  try {
    for (auto it = pending_reductions_.begin(); it != pending_reductions_.end();) {
      FlatParamHandle& handle = *units_[*it]->handle;
      if (handle.advance_reduce_grad(/*block=*/false)) {
        it = pending_reductions_.erase(it);
        continue;
      }
      // A later unit must not start its replicate all-reduce before this one.
      if (!handle.reduce_grad_issued()) break;
      ++it;
    }
  } catch (...) {
    abandon_reductions();
    throw;
  }
}

void Runtime::finish_reductions() {
  if (pending_reductions_.empty()) return;
  try {
    // Hybrid: start every replicate all-reduce (in order) before waiting for
    // any of them, so they overlap one another.
    for (int i : pending_reductions_) units_[i]->handle->issue_reduce_grad();
    while (!pending_reductions_.empty()) {
      units_[pending_reductions_.front()]->handle->finish_reduce_grad();
      pending_reductions_.pop_front();
    }
  } catch (...) {
    abandon_reductions();
    throw;
  }
}

void Runtime::abandon_reductions() noexcept {
  for (int i : pending_reductions_) units_[i]->handle->abandon_reduce_grad();
  pending_reductions_.clear();
}

void Runtime::join_reduce_streams() {
  // On an accelerator a finished reduction is one queued on the reduce
  // stream; the caller's current stream (the engine runs final callbacks
  // with the stream backward was called on) waits for all of them here,
  // once, so the optimizer reads final gradients -- and not after each unit,
  // which would stall backward's compute behind its own reductions.
  std::vector<c10::Device> joined;
  for (const auto& unit : units_) {
    if (!unit->handle) continue;
    const c10::Device device = unit->handle->unsharded_flat_param().device();
    if (device.is_cpu() || std::find(joined.begin(), joined.end(), device) != joined.end())
      continue;
    joined.push_back(device);
    if (auto streams = comm_streams_for(device))
      wait_stream(current_stream(device), streams->reduce);
  }
}

void Runtime::final_callback() {
  // The gradients must be final before backward returns. An error (a peer
  // died, a timeout) is rethrown from backward once the state is reset.
  std::exception_ptr error;
  try {
    finish_reductions();
    join_reduce_streams();
  } catch (...) {
    error = std::current_exception();
  }
  for (auto& unit : units_) {
    // Prefetched but unused, or a unit whose parameters got no gradient.
    if (unit->handle) unit->handle->reshard();
    unit->pre_backward_done = false;
  }
  if (!backward_order_recorded_) {
    backward_order_ = current_order_;
    backward_order_recorded_ = true;
  }
  backward_started_ = false;
  forward_since_backward_ = false;
  state_ = TrainingState::kIdle;
  if (error) std::rethrow_exception(error);
}

void Runtime::abort_forward() noexcept {
  // The root's forward threw: free what it gathered and return to idle, so
  // the next iteration can start.
  for (auto& unit : units_) {
    if (!unit->handle) continue;
    try {
      unit->handle->reshard();
    } catch (const std::exception&) {
      // Best effort while unwinding: the original error is what matters.
    }
  }
  current_order_.clear();
  state_ = TrainingState::kIdle;
}

void Runtime::register_forward_hooks() {
  std::weak_ptr<Runtime> weak = weak_from_this();
  std::unordered_set<const torch::nn::Module*> hooked;
  for (const ModulePtr& module : root_->modules(/*include_self=*/true)) {
    auto owner = owner_of_.find(module.get());
    if (owner == owner_of_.end() || !hooked.insert(module.get()).second) continue;
    const int index = owner->second;
    const Unit& unit = *units_[index];
    const torch::nn::Module* m = module.get();
    module_call::ForwardHooks hooks;
    hooks.before_rerun = [weak, index] {
      if (auto rt = weak.lock()) rt->prepare_recompute(index);
    };
    hooks.before_rerun_backward = [weak] {
      if (auto rt = weak.lock()) rt->finish_reductions_in_backward();
    };
    if (unit.module != module) {
      // A module inside a unit: only checked to be gathered.
      hooks.pre_forward = [weak, m] {
        if (auto rt = weak.lock()) rt->check_owner_gathered(*m);
      };
    } else {
      hooks.pre_forward = [weak, index] {
        if (auto rt = weak.lock()) rt->unit_pre_forward(index);
      };
      hooks.post_forward = [weak, index](const std::vector<at::Tensor>& outputs, bool known) {
        if (auto rt = weak.lock()) rt->unit_post_forward(index, outputs, known);
      };
      if (unit.is_root) {
        hooks.forward_failed = [weak] {
          if (auto rt = weak.lock()) rt->abort_forward();
        };
      }
      if (const auto dtype = options_.mixed_precision.param_dtype) {
        hooks.map_tensor_argument = [dtype = *dtype](const at::Tensor& t) {
          return t.defined() && t.is_floating_point() ? t.to(dtype) : t;
        };
      }
    }
    hook_handles_.push_back(module_call::register_forward_hooks(module, std::move(hooks)));
  }
}

}  // namespace internal
}  // namespace fsdp
