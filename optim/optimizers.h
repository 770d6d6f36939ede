// Fused and foreach Adam, AdamW and SGD for LibTorch: PyTorch's
// torch.optim.Adam/AdamW/SGD(..., fused=True) and (..., foreach=True).
//
// Each class IS the torch::optim optimizer of the same name (a subclass that
// overrides step() only): the same options, param groups and per-parameter
// state (torch::optim::AdamParamState, AdamWParamState, SGDParamState), so
// state dicts, checkpoints, resharding and state_dict/'s optimizer-state code
// see a torch::optim::AdamW, byte for byte. Only the update runs differently:
//
//   Implementation::kFused    one ATen kernel per (device, dtype) bucket of a
//                             param group: at::_fused_adam_ / _fused_adamw_ /
//                             _fused_sgd_ (CPU and CUDA), as Python's
//                             fused=True;
//   Implementation::kForeach  Python's foreach=True algorithm, on
//                             at::_foreach_* ops (a few multi-tensor kernels
//                             per bucket instead of ~10 ops per parameter).
//
// Example (the trainer's default):
//
//   optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-4));
//   loss.backward();
//   opt.step();
//
// Semantics are Python's (torch/optim/adam.py, adamw.py, sgd.py): weight
// decay, amsgrad, maximize, momentum / dampening / nesterov, a learning rate
// per group, parameters without a gradient skipped. `maximize` is Python's
// option, which torch::optim lacks: it is a constructor argument here and
// applies to every group (it is not saved with the state, as torch::optim
// saves no such option).
//
// Steps: the int64 AdamParamState::step stays authoritative (what state
// dicts save). The fused kernels read a float32 step tensor per parameter on
// its device; those are cached (keyed by the parameter) and refreshed only
// when the int64 step differs from what the cache last wrote (a state dict
// was loaded), so a step never reads a value back from the device.
//
// Errors (c10::Error, naming the optimizer, the parameter's index in
// param_groups order, what it is and what was expected): a parameter that is
// not floating point or not on CPU or CUDA, a sparse gradient, a gradient or
// state tensor whose device or dtype differs from its parameter's.
// Capturable mode (PyTorch's capturable=True; the Capturable base below):
// every value the update reads that changes from step to step lives on the
// parameters' device, so one step() can be captured into a CUDA graph and
// replayed while the learning rate schedule and the step counts go on:
//
//   * the learning rate of each param group is a float32 device tensor
//     (ATen's fused CUDA kernels read `const float*`; float32 on the CPU too,
//     so both compute with the same value), written from the group's
//     options().lr() by write_device_values() — one fill_ per group whose lr
//     changed, enqueued, no host synchronisation — which a replayed graph
//     then reads. step() itself writes a stale one (and marks that step not
//     replayable: see last_step_replayable);
//   * Adam's step counts are the float32 step tensors, advanced on the
//     device by the update (kFused and kForeach alike; Python's capturable
//     foreach computes its bias corrections on the device, as here);
//   * found_inf (optional, set_found_inf; kFused only): a 1-element float32
//     tensor on the parameters' device. When it holds 1.0 the fused kernels
//     skip the update (parameters and moments untouched) and the step tensors
//     are moved back (Python's fused path with GradScaler's found_inf: add 1,
//     kernel, subtract found_inf). It must hold 0.0 or 1.0.
//
// The other hyperparameters (betas, eps, weight decay, momentum, dampening,
// amsgrad, nesterov, maximize) are host numbers baked into a captured graph:
// change one and capture again.
//
// The host int64 AdamParamState::step stays what state dicts and
// checkpoints save, and never reads the device. Its rule:
//   * step() advances it by 1 for every parameter it updates, as if
//     found_inf were 0 (the host cannot know otherwise without a read);
//   * record_replayed_step(): a graph holding the last step() was replayed
//     once more: the same parameters' counts advance by 1 (the captured
//     step() counted itself, so the replay that first runs it is not
//     recorded);
//   * record_skipped_step(): the caller read found_inf as 1 after the last
//     step() or replay: their counts go back by 1, and states that step()
//     created are removed (a skipped step leaves no trace). A caller that
//     does not read found_inf and does not say so leaves the host count one
//     ahead of the device's for each skipped step (the trainer reads it every
//     step and stops the run on a non-finite one: trainer/finite_state.h).
// Between these, the device step tensors and the host counts agree; a state
// dict loaded into the optimizer (host counts changed) is written to the
// device by the next write_device_values() or step().
//
// Replaying: a graph may hold a step() only when that step() created
// nothing and wrote no device value from the host (lr, step count): the
// fill_ or the zeros would be replayed too, resetting the schedule, the
// counts or the moments on every replay. So: a few eager step()s first (the
// state exists), write_device_values() before the capture and before every
// replay, and after the capture check last_step_replayable().
//
// kForeach in capturable mode: Python's capturable _multi_tensor_adam (bias
// corrections as device tensors, the lr a device tensor) and, for SGD, the
// update as params += grads * (-lr) (the Tensor-lr form Python uses where
// alpha cannot be a tensor): no host synchronisation, the same update within
// float32 rounding of the bias corrections (optimizers_test states the
// tolerances). found_inf is refused with kForeach: neither ATen's foreach
// ops nor Python's foreach path take one, and skipping on the device would
// need extra copies of the state.
//
// Not supported: complex parameters (Python's foreach views them as real;
// here they are an error), GradScaler's grad_scale (found_inf is supported
// in capturable mode), differentiable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

namespace optim {

enum class Implementation {
  kFused,    // Python's fused=True
  kForeach,  // Python's foreach=True
};

// "fused" or "foreach".
const char* implementation_name(Implementation implementation);

// Python's Optimizer.zero_grad() (set_to_none=True): every parameter's
// gradient dropped, no operator dispatched. LibTorch's
// torch::optim::Optimizer::zero_grad (not virtual) first detaches each
// gradient in place: one aten::detach_ per parameter per step.
void zero_grad(torch::optim::Optimizer& optimizer);

// The float32 step tensors the fused Adam kernels read, one per parameter,
// each on its parameter's device. Internal to Adam / AdamW.
class StepTensors {
 public:
  // The step tensor of `param`, holding `step` (filled only when the cached
  // tensor holds another value, or is on another device). `wrote`, when
  // given, is set to true when it made or filled the tensor.
  torch::Tensor& get(const torch::Tensor& param, int64_t step, bool* wrote = nullptr);
  // Records that the tensor of `param` now holds `step` (after the kernels'
  // at::_foreach_add_(steps, 1)).
  void set_value(const torch::Tensor& param, int64_t step);

 private:
  struct Entry {
    torch::Tensor tensor;
    int64_t value = 0;
  };
  std::unordered_map<const void*, Entry> entries_;
};

// Internal to Capturable: the float32 device learning rate of each param
// group, and what the last write put there.
class DeviceLrs {
 public:
  // The lr tensor of group `group` on `device`, holding (float) `lr` (made or
  // filled only when it holds another value or is on another device; `wrote`
  // set to true then).
  const torch::Tensor& get(size_t group, double lr, const c10::Device& device, bool* wrote);
  // The tensor of `group` as last written (undefined if never).
  torch::Tensor tensor(size_t group) const;

 private:
  struct Entry {
    torch::Tensor tensor;
    double value = 0;
  };
  std::vector<Entry> entries_;
};

// Internal to Capturable: what the last step() in capturable mode did.
struct CapturableStepRecord {
  std::vector<torch::Tensor> params;  // the parameters it updated, in order
  std::vector<bool> created;          // whose state it created
  bool wrote = false;                 // it made or filled a device value from the host
  bool counted = false;               // a step or replay whose skip may still be recorded
  bool any = false;                   // a step() was recorded at all
};

// The capturable mode of Adam, AdamW and SGD (see the top of this file): a
// base of each, so code that holds a torch::optim::Optimizer finds it with
// dynamic_cast<optim::Capturable*>. Errors are c10::Error naming the
// optimizer (e.g. "optim::AdamW (fused): write_device_values: ...").
class Capturable {
 public:
  Capturable(const Capturable&) = delete;
  Capturable& operator=(const Capturable&) = delete;
  virtual ~Capturable();

  bool capturable() const { return capturable_; }
  // Turns the mode on or off (Python's param_groups[i]['capturable'], here
  // for the whole optimizer). Off clears found_inf; the host counts stay
  // authoritative either way.
  void set_capturable(bool capturable);

  // found_inf for the following step()s (see above); an undefined tensor
  // removes it. Needs capturable mode and kFused; a float32 tensor of one
  // element (its device is checked against each parameter's by step()).
  void set_found_inf(torch::Tensor found_inf);
  const torch::Tensor& found_inf() const { return found_inf_; }

  // The device lr tensor of param group `group` (undefined before the first
  // write_device_values() or step()).
  torch::Tensor lr_tensor(size_t group) const;

  // Writes every param group's options().lr() into its device lr tensor and
  // every parameter's int64 step (Adam) into its step tensor, where they
  // differ from what was last written (fill_: enqueued on the current
  // stream, no host synchronisation). Call it before each replay and
  // before a capture, outside the capture.
  void write_device_values();

  // A graph holding the last step() was replayed once (see above). Refused
  // when that step() was not replayable.
  void record_replayed_step();
  // The last step() or replay was skipped on the device (found_inf was 1).
  // Refused when nothing was stepped since the last such call.
  void record_skipped_step();
  // Whether the last step() only enqueued device work with values already
  // on the device: no state, step tensor or lr tensor made, nothing filled
  // from the host. Only such a step() may be captured and replayed.
  bool last_step_replayable() const;

 protected:
  Capturable(torch::optim::Optimizer& optimizer, const char* who, Implementation implementation,
             bool capturable, StepTensors* steps);
  // For step(): the record to fill (nullptr when not capturable), after
  // checks; and the end of the step.
  CapturableStepRecord* begin_step();
  DeviceLrs& device_lrs() { return lrs_; }

 private:
  std::string who() const;
  void require_capturable(const char* method) const;

  torch::optim::Optimizer& optimizer_;
  const char* name_;
  Implementation capturable_implementation_;
  bool capturable_;
  StepTensors* steps_;  // Adam / AdamW's, nullptr for SGD
  torch::Tensor found_inf_;
  DeviceLrs lrs_;
  CapturableStepRecord record_;
};

class Adam : public torch::optim::Adam, public Capturable {
 public:
  Adam(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
       torch::optim::AdamOptions defaults = {},
       Implementation implementation = Implementation::kFused, bool maximize = false,
       bool capturable = false);
  Adam(std::vector<torch::Tensor> params, torch::optim::AdamOptions defaults = {},
       Implementation implementation = Implementation::kFused, bool maximize = false,
       bool capturable = false);

  torch::Tensor step(LossClosure closure = nullptr) override;

  Implementation implementation() const { return implementation_; }
  bool maximize() const { return maximize_; }

 private:
  Implementation implementation_;
  bool maximize_;
  StepTensors steps_;
};

class AdamW : public torch::optim::AdamW, public Capturable {
 public:
  AdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
        torch::optim::AdamWOptions defaults = {},
        Implementation implementation = Implementation::kFused, bool maximize = false,
        bool capturable = false);
  AdamW(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults = {},
        Implementation implementation = Implementation::kFused, bool maximize = false,
        bool capturable = false);

  torch::Tensor step(LossClosure closure = nullptr) override;

  Implementation implementation() const { return implementation_; }
  bool maximize() const { return maximize_; }

 private:
  Implementation implementation_;
  bool maximize_;
  StepTensors steps_;
};

class SGD : public torch::optim::SGD, public Capturable {
 public:
  SGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
      torch::optim::SGDOptions defaults, Implementation implementation = Implementation::kFused,
      bool maximize = false, bool capturable = false);
  SGD(std::vector<torch::Tensor> params, torch::optim::SGDOptions defaults,
      Implementation implementation = Implementation::kFused, bool maximize = false,
      bool capturable = false);

  torch::Tensor step(LossClosure closure = nullptr) override;

  Implementation implementation() const { return implementation_; }
  bool maximize() const { return maximize_; }

 private:
  Implementation implementation_;
  bool maximize_;
};

}  // namespace optim
