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
// Not supported: complex parameters (Python's foreach views them as real;
// here they are an error), GradScaler's grad_scale / found_inf, capturable,
// differentiable.
#pragma once

#include <cstdint>
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
  // tensor holds another value, or is on another device).
  torch::Tensor& get(const torch::Tensor& param, int64_t step);
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

class Adam : public torch::optim::Adam {
 public:
  Adam(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
       torch::optim::AdamOptions defaults = {},
       Implementation implementation = Implementation::kFused, bool maximize = false);
  Adam(std::vector<torch::Tensor> params, torch::optim::AdamOptions defaults = {},
       Implementation implementation = Implementation::kFused, bool maximize = false);

  torch::Tensor step(LossClosure closure = nullptr) override;

  Implementation implementation() const { return implementation_; }
  bool maximize() const { return maximize_; }

 private:
  Implementation implementation_;
  bool maximize_;
  StepTensors steps_;
};

class AdamW : public torch::optim::AdamW {
 public:
  AdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
        torch::optim::AdamWOptions defaults = {},
        Implementation implementation = Implementation::kFused, bool maximize = false);
  AdamW(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults = {},
        Implementation implementation = Implementation::kFused, bool maximize = false);

  torch::Tensor step(LossClosure closure = nullptr) override;

  Implementation implementation() const { return implementation_; }
  bool maximize() const { return maximize_; }

 private:
  Implementation implementation_;
  bool maximize_;
  StepTensors steps_;
};

class SGD : public torch::optim::SGD {
 public:
  SGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
      torch::optim::SGDOptions defaults, Implementation implementation = Implementation::kFused,
      bool maximize = false);
  SGD(std::vector<torch::Tensor> params, torch::optim::SGDOptions defaults,
      Implementation implementation = Implementation::kFused, bool maximize = false);

  torch::Tensor step(LossClosure closure = nullptr) override;

  Implementation implementation() const { return implementation_; }
  bool maximize() const { return maximize_; }

 private:
  Implementation implementation_;
  bool maximize_;
};

}  // namespace optim
