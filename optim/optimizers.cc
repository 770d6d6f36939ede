#include "optim/optimizers.h"

#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_addcdiv.h>
#include <ATen/ops/_foreach_addcmul.h>
#include <ATen/ops/_foreach_div.h>
#include <ATen/ops/_foreach_lerp.h>
#include <ATen/ops/_foreach_maximum.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_neg.h>
#include <ATen/ops/_foreach_pow.h>
#include <ATen/ops/_foreach_reciprocal.h>
#include <ATen/ops/_foreach_sqrt.h>
#include <ATen/ops/_foreach_sub.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/types.h>

namespace optim {
namespace {

using torch::Tensor;
using torch::optim::OptimizerParamGroup;
using torch::optim::OptimizerParamState;
using StateMap = ska::flat_hash_map<void*, std::unique_ptr<OptimizerParamState>>;

// "Float on cpu".
std::string describe(const Tensor& t) {
  return std::string(c10::toString(t.scalar_type())) + " on " + t.device().str();
}

// What every fused / foreach kernel needs of a parameter and its gradient.
void check_param(const char* who, Implementation impl, int64_t index, const Tensor& p,
                 const Tensor& grad) {
  TORCH_CHECK(p.is_floating_point() && (p.device().is_cpu() || p.device().is_cuda()), who, " (",
              implementation_name(impl), "): parameter ", index, " is ", describe(p),
              ": expected a floating-point tensor on cpu or cuda (fused=True requires all "
              "the params to be floating point Tensors of supported devices)");
  TORCH_CHECK(!grad.is_sparse(), who, " (", implementation_name(impl), "): parameter ", index,
              " has a sparse gradient: expected a dense one (", who,
              " does not support sparse gradients)");
  TORCH_CHECK(grad.device() == p.device() && grad.scalar_type() == p.scalar_type(), who, " (",
              implementation_name(impl), "): parameter ", index, " is ", describe(p),
              " but its gradient is ", describe(grad),
              ": expected the gradient on the parameter's device, with its dtype");
}

void check_state(const char* who, Implementation impl, int64_t index, const Tensor& p,
                 const char* name, const Tensor& t) {
  TORCH_CHECK(t.device() == p.device() && t.scalar_type() == p.scalar_type(), who, " (",
              implementation_name(impl), "): parameter ", index, " is ", describe(p),
              " but its optimizer state '", name, "' is ", describe(t),
              ": expected the parameter's device and dtype (load state onto the parameters' "
              "devices)");
}

// What a step() in capturable mode adds to the ordinary one (a null
// `record`: the ordinary mode).
struct DeviceStep {
  CapturableStepRecord* record = nullptr;
  DeviceLrs* lrs = nullptr;
  Tensor found_inf;  // undefined: none
};

// The one device of param group `group_index`'s parameters (capturable
// mode keeps one lr tensor per group). `first_index`: the index of its
// first parameter in param_groups order.
c10::Device group_device(const char* who, Implementation impl, const OptimizerParamGroup& group,
                         int64_t first_index) {
  const auto& params = group.params();
  for (size_t k = 1; k < params.size(); ++k) {
    TORCH_CHECK(params[k].device() == params[0].device(), who, " (", implementation_name(impl),
                ", capturable): parameter ", first_index + static_cast<int64_t>(k), " is ",
                describe(params[k]), " but parameter ", first_index, " of its param group is ",
                describe(params[0]),
                ": expected one device per param group (capturable mode keeps one device "
                "learning rate tensor per group)");
  }
  return params[0].device();
}

void check_found_inf(const char* who, Implementation impl, int64_t index, const Tensor& p,
                     const Tensor& found_inf) {
  TORCH_CHECK(found_inf.device() == p.device(), who, " (", implementation_name(impl),
              ", capturable): found_inf is ", describe(found_inf), " but parameter ", index, " is ",
              describe(p), ": expected found_inf on the parameters' device");
}

// The learning rate tensor of group `g` in capturable mode, after the
// group's device check (nullptr record: the ordinary mode, no tensor).
Tensor device_lr(const char* who, Implementation impl, DeviceStep& d, size_t g,
                 const OptimizerParamGroup& group, double lr, int64_t first_index) {
  if (d.record == nullptr || group.params().empty()) return Tensor();
  const c10::Device device = group_device(who, impl, group, first_index);
  return d.lrs->get(g, lr, device, &d.record->wrote);
}

// Python's Optimizer._group_tensors_by_device_and_dtype: the kernels take
// lists of one device and one dtype.
template <typename State>
struct Bucket {
  c10::Device device;
  c10::ScalarType dtype;
  std::vector<Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
  std::vector<State*> states;
};

template <typename B>
B& bucket_for(std::vector<B>& buckets, const Tensor& p) {
  for (auto& b : buckets) {
    if (b.device == p.device() && b.dtype == p.scalar_type()) return b;
  }
  buckets.push_back(B{p.device(), p.scalar_type(), {}, {}, {}, {}, {}, {}});
  return buckets.back();
}

struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad;
};

template <typename Options>
AdamHyper hyper_of(const OptimizerParamGroup& group) {
  const auto& o = static_cast<const Options&>(group.options());
  return {o.lr(),  std::get<0>(o.betas()), std::get<1>(o.betas()),
          o.eps(), o.weight_decay(),       o.amsgrad()};
}

// The state of `p`, created as torch::optim creates it on a first step
// (`created` set to true then).
template <typename State>
State& adam_state(StateMap& state, const Tensor& p, bool amsgrad, bool* created) {
  auto& slot = state[p.unsafeGetTensorImpl()];
  if (!slot) {
    *created = true;
    auto s = std::make_unique<State>();
    s->step(0);
    s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (amsgrad) s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    slot = std::move(s);
  }
  auto& s = static_cast<State&>(*slot);
  if (amsgrad && !s.max_exp_avg_sq().defined()) {
    // amsgrad switched on after steps without it: the maximum starts at 0.
    s.max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    *created = true;  // a value made on the host, as a new state is
  }
  return s;
}

// The step tensors of `b`, from the cache (`wrote`: as StepTensors::get).
template <typename State>
std::vector<Tensor> step_tensors_of(Bucket<State>& b, StepTensors& steps, bool* wrote) {
  std::vector<Tensor> step_tensors;
  step_tensors.reserve(b.params.size());
  for (size_t k = 0; k < b.params.size(); ++k) {
    step_tensors.push_back(steps.get(b.params[k], b.states[k]->step(), wrote));
  }
  return step_tensors;
}

void add_one_to_steps(const std::vector<Tensor>& step_tensors, const c10::Device& device) {
  if (device.is_cpu()) {
    // As Python's fused step on the CPU: the Tensor overload. ATen's CPU
    // foreach has no multi-tensor kernel, and its Scalar overload wraps the
    // scalar into a new tensor for every parameter (4 more operators each).
    at::_foreach_add_(step_tensors, at::scalar_tensor(1.0, at::kFloat), /*alpha=*/1);
  } else {
    at::_foreach_add_(step_tensors, 1);
  }
}

// The host side of an Adam step: the int64 counts advance (as if found_inf
// were 0 in capturable mode), the cache follows.
template <typename State>
void count_adam_step(Bucket<State>& b, StepTensors& steps) {
  for (size_t k = 0; k < b.params.size(); ++k) {
    b.states[k]->step(b.states[k]->step() + 1);
    steps.set_value(b.params[k], b.states[k]->step());
  }
}

// `lr`: the device lr tensor in capturable mode (undefined: h.lr, a host
// number); `found_inf` likewise optional (capturable mode only).
template <typename State>
void fused_adam(Bucket<State>& b, const AdamHyper& h, bool decoupled, bool maximize,
                StepTensors& steps, const Tensor& lr, const Tensor& found_inf, bool* wrote) {
  const std::vector<Tensor> step_tensors = step_tensors_of(b, steps, wrote);
  add_one_to_steps(step_tensors, b.device);
  const at::TensorList max_exp_avg_sqs =
      h.amsgrad ? at::TensorList(b.max_exp_avg_sqs) : at::TensorList();
  const std::optional<Tensor> inf =
      found_inf.defined() ? std::optional<Tensor>(found_inf) : std::nullopt;
  if (!lr.defined()) {
    if (decoupled) {
      at::_fused_adamw_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, max_exp_avg_sqs, step_tensors,
                        h.lr, h.beta1, h.beta2, h.weight_decay, h.eps, h.amsgrad, maximize);
    } else {
      at::_fused_adam_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, max_exp_avg_sqs, step_tensors,
                       h.lr, h.beta1, h.beta2, h.weight_decay, h.eps, h.amsgrad, maximize);
    }
  } else if (decoupled) {
    at::_fused_adamw_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, max_exp_avg_sqs, step_tensors,
                      lr, h.beta1, h.beta2, h.weight_decay, h.eps, h.amsgrad, maximize,
                      /*grad_scale=*/std::nullopt, inf);
  } else {
    at::_fused_adam_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, max_exp_avg_sqs, step_tensors,
                     lr, h.beta1, h.beta2, h.weight_decay, h.eps, h.amsgrad, maximize,
                     /*grad_scale=*/std::nullopt, inf);
  }
  if (found_inf.defined()) {
    // Python's _fused_adam: a skipped step does not count on the device.
    at::_foreach_sub_(step_tensors, std::vector<Tensor>(step_tensors.size(), found_inf));
  }
  count_adam_step(b, steps);
}

// Both foreach Adams (Python's _multi_tensor_adam) up to the step size:
// the gradients (negated for maximize, weight-decayed) into the first and
// second moments. `lr` is the host number or, capturable, the device tensor:
// decoupled weight decay scales the parameters by 1 - lr * weight_decay.
template <typename State, typename Lr>
void foreach_adam_moments(Bucket<State>& b, const AdamHyper& h, bool decoupled, bool maximize,
                          const Lr& lr) {
  std::vector<Tensor> grads = b.grads;
  if (maximize) grads = at::_foreach_neg(grads);
  if (h.weight_decay != 0) {
    if (decoupled) {
      at::_foreach_mul_(b.params, 1 - lr * h.weight_decay);
    } else if (maximize) {
      at::_foreach_add_(grads, b.params, h.weight_decay);
    } else {
      grads = at::_foreach_add(grads, b.params, h.weight_decay);
    }
  }
  at::_foreach_lerp_(b.exp_avgs, grads, 1 - h.beta1);
  at::_foreach_mul_(b.exp_avg_sqs, h.beta2);
  at::_foreach_addcmul_(b.exp_avg_sqs, grads, grads, 1 - h.beta2);
}

// sqrt(v) (amsgrad: of the running max of v) / sqrt(1 - beta2^t) + eps, per
// parameter; the corrections host numbers or device tensors.
template <typename State, typename Corrections>
std::vector<Tensor> foreach_adam_denominators(Bucket<State>& b, const AdamHyper& h,
                                              const Corrections& bias_correction2_sqrt) {
  std::vector<Tensor> denom;
  if (h.amsgrad) {
    at::_foreach_maximum_(b.max_exp_avg_sqs, b.exp_avg_sqs);
    denom = at::_foreach_sqrt(b.max_exp_avg_sqs);
  } else {
    denom = at::_foreach_sqrt(b.exp_avg_sqs);
  }
  at::_foreach_div_(denom, bias_correction2_sqrt);
  at::_foreach_add_(denom, h.eps);
  return denom;
}

// Python's _multi_tensor_adam without capturable: bias corrections on the
// host from the int64 steps.
template <typename State>
void foreach_adam(Bucket<State>& b, const AdamHyper& h, bool decoupled, bool maximize) {
  foreach_adam_moments(b, h, decoupled, maximize, h.lr);
  std::vector<at::Scalar> step_size, bias_correction2_sqrt;
  for (State* s : b.states) {
    s->step(s->step() + 1);
    const double step = static_cast<double>(s->step());
    step_size.emplace_back(-(h.lr / (1 - std::pow(h.beta1, step))));
    bias_correction2_sqrt.emplace_back(std::sqrt(1 - std::pow(h.beta2, step)));
  }
  const std::vector<Tensor> denom = foreach_adam_denominators(b, h, bias_correction2_sqrt);
  at::_foreach_addcdiv_(b.params, b.exp_avgs, denom, step_size);
}

// Python's _multi_tensor_adam with capturable=True: the step counts are
// the device step tensors and the bias corrections are computed from them on
// the device, the learning rate is the device tensor `lr`; nothing is read
// back.
template <typename State>
void foreach_adam_capturable(Bucket<State>& b, const AdamHyper& h, bool decoupled, bool maximize,
                             StepTensors& steps, const Tensor& lr, bool* wrote) {
  const std::vector<Tensor> step_tensors = step_tensors_of(b, steps, wrote);
  add_one_to_steps(step_tensors, b.device);
  foreach_adam_moments(b, h, decoupled, maximize, lr);
  // step_size = lr / (beta1^t - 1) = -lr / (1 - beta1^t) and
  // bias_correction2_sqrt = sqrt(1 - beta2^t), per parameter, on the device.
  std::vector<Tensor> step_size = at::_foreach_pow(h.beta1, step_tensors);
  std::vector<Tensor> bias_correction2_sqrt = at::_foreach_pow(h.beta2, step_tensors);
  at::_foreach_sub_(step_size, 1);
  at::_foreach_sub_(bias_correction2_sqrt, 1);
  at::_foreach_neg_(bias_correction2_sqrt);
  at::_foreach_div_(step_size, lr);
  at::_foreach_reciprocal_(step_size);
  at::_foreach_sqrt_(bias_correction2_sqrt);
  std::vector<Tensor> denom = foreach_adam_denominators(b, h, bias_correction2_sqrt);
  // denom = -(1 - beta1^t) (sqrt(v / (1 - beta2^t)) + eps) / lr
  at::_foreach_div_(denom, step_size);
  at::_foreach_addcdiv_(b.params, b.exp_avgs, denom);
  count_adam_step(b, steps);
}

// One Adam or AdamW step over every group (Python's Adam.step with
// fused=True or foreach=True; capturable when `d.record` is set).
template <typename State, typename Options>
void adam_step(const char* who, bool decoupled, Implementation impl, bool maximize,
               std::vector<OptimizerParamGroup>& groups, StateMap& state, StepTensors& steps,
               DeviceStep& d) {
  int64_t index = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    auto& group = groups[g];
    const AdamHyper h = hyper_of<Options>(group);
    const Tensor lr = device_lr(who, impl, d, g, group, h.lr, index);
    std::vector<Bucket<State>> buckets;
    for (const Tensor& p : group.params()) {
      const int64_t i = index++;
      const Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      check_param(who, impl, i, p, grad);
      if (d.found_inf.defined()) check_found_inf(who, impl, i, p, d.found_inf);
      bool created = false;
      State& s = adam_state<State>(state, p, h.amsgrad, &created);
      check_state(who, impl, i, p, "exp_avg", s.exp_avg());
      check_state(who, impl, i, p, "exp_avg_sq", s.exp_avg_sq());
      if (h.amsgrad) check_state(who, impl, i, p, "max_exp_avg_sq", s.max_exp_avg_sq());
      if (d.record != nullptr) {
        d.record->params.push_back(p);
        d.record->created.push_back(created);
      }
      auto& b = bucket_for(buckets, p);
      b.params.push_back(p);
      b.grads.push_back(grad);
      b.exp_avgs.push_back(s.exp_avg());
      b.exp_avg_sqs.push_back(s.exp_avg_sq());
      if (h.amsgrad) b.max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
      b.states.push_back(&s);
    }
    bool* wrote = d.record != nullptr ? &d.record->wrote : nullptr;
    for (auto& b : buckets) {
      if (impl == Implementation::kFused) {
        fused_adam(b, h, decoupled, maximize, steps, lr, d.found_inf, wrote);
      } else if (lr.defined()) {
        foreach_adam_capturable(b, h, decoupled, maximize, steps, lr, wrote);
      } else {
        foreach_adam(b, h, decoupled, maximize);
      }
    }
  }
}

// Fused SGD on parameters whose momentum buffers all exist (is_first_step
// false) or all do not (true: the kernel writes them). `lr` and
// `found_inf`: as fused_adam's.
void fused_sgd(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
               const std::vector<Tensor>& bufs, const torch::optim::SGDOptions& o, bool maximize,
               bool is_first_step, const Tensor& lr, const Tensor& found_inf) {
  if (params.empty()) return;
  if (!lr.defined()) {
    at::_fused_sgd_(params, grads, bufs, o.weight_decay(), o.momentum(), o.lr(), o.dampening(),
                    o.nesterov(), maximize, is_first_step);
    return;
  }
  at::_fused_sgd_(params, grads, bufs, o.weight_decay(), o.momentum(), lr, o.dampening(),
                  o.nesterov(), maximize, is_first_step, /*grad_scale=*/std::nullopt,
                  found_inf.defined() ? std::optional<Tensor>(found_inf) : std::nullopt);
}

using SgdBucket = Bucket<torch::optim::SGDParamState>;

void fused_sgd_bucket(SgdBucket& b, const torch::optim::SGDOptions& o, bool maximize,
                      StateMap& state, const Tensor& lr, const Tensor& found_inf) {
  if (o.momentum() == 0) {
    fused_sgd(b.params, b.grads, {}, o, maximize, /*is_first_step=*/false, lr, found_inf);
    return;
  }
  std::vector<Tensor> params, grads, bufs, new_params, new_grads, new_bufs;
  for (size_t k = 0; k < b.params.size(); ++k) {
    if (b.states[k] != nullptr) {
      params.push_back(b.params[k]);
      grads.push_back(b.grads[k]);
      bufs.push_back(b.states[k]->momentum_buffer());
    } else {
      new_params.push_back(b.params[k]);
      new_grads.push_back(b.grads[k]);
      // With found_inf the kernel may skip writing them: zeros, never
      // uninitialised memory (record_skipped_step removes them).
      new_bufs.push_back(found_inf.defined() ? at::zeros_like(b.grads[k])
                                             : at::empty_like(b.grads[k]));
    }
  }
  fused_sgd(params, grads, bufs, o, maximize, /*is_first_step=*/false, lr, found_inf);
  fused_sgd(new_params, new_grads, new_bufs, o, maximize, /*is_first_step=*/true, lr, found_inf);
  for (size_t k = 0; k < new_params.size(); ++k) {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(new_bufs[k]);
    state[new_params[k].unsafeGetTensorImpl()] = std::move(s);
  }
}

// Python's _multi_tensor_sgd. Unlike Python, nesterov does not add the
// momentum into the gradient tensors in place (torch::optim leaves .grad
// untouched too); the parameters' update is the same.
// `lr`: the device lr tensor in capturable mode (undefined: o.lr()), which
// makes the update params += grads * (-lr) (alpha cannot be a tensor).
void foreach_sgd_bucket(SgdBucket& b, const torch::optim::SGDOptions& o, bool maximize,
                        StateMap& state, const Tensor& lr) {
  std::vector<Tensor> grads = b.grads;
  if (maximize) grads = at::_foreach_neg(grads);
  if (o.weight_decay() != 0) {
    if (maximize) {
      at::_foreach_add_(grads, b.params, o.weight_decay());
    } else {
      grads = at::_foreach_add(grads, b.params, o.weight_decay());
    }
  }
  if (o.momentum() != 0) {
    std::vector<Tensor> bufs;
    bool all_have = true;
    for (auto* s : b.states) all_have = all_have && s != nullptr;
    if (all_have) {
      for (auto* s : b.states) bufs.push_back(s->momentum_buffer());
      at::_foreach_mul_(bufs, o.momentum());
      at::_foreach_add_(bufs, grads, 1 - o.dampening());
    } else {
      for (size_t k = 0; k < b.params.size(); ++k) {
        if (b.states[k] == nullptr) {
          auto s = std::make_unique<torch::optim::SGDParamState>();
          s->momentum_buffer(grads[k].detach().clone());
          bufs.push_back(s->momentum_buffer());
          state[b.params[k].unsafeGetTensorImpl()] = std::move(s);
        } else {
          Tensor buf = b.states[k]->momentum_buffer();
          buf.mul_(o.momentum()).add_(grads[k], 1 - o.dampening());
          bufs.push_back(buf);
        }
      }
    }
    grads = o.nesterov() ? at::_foreach_add(grads, bufs, o.momentum()) : bufs;
  }
  if (lr.defined()) {
    at::_foreach_add_(b.params, at::_foreach_mul(grads, -lr));
  } else {
    at::_foreach_add_(b.params, grads, -o.lr());
  }
}

void sgd_step(Implementation impl, bool maximize, std::vector<OptimizerParamGroup>& groups,
              StateMap& state, DeviceStep& d) {
  const char* who = "optim::SGD";
  int64_t index = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    auto& group = groups[g];
    const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
    const Tensor lr = device_lr(who, impl, d, g, group, o.lr(), index);
    std::vector<SgdBucket> buckets;
    for (const Tensor& p : group.params()) {
      const int64_t i = index++;
      const Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      check_param(who, impl, i, p, grad);
      if (d.found_inf.defined()) check_found_inf(who, impl, i, p, d.found_inf);
      torch::optim::SGDParamState* s = nullptr;
      auto it = state.find(p.unsafeGetTensorImpl());
      if (o.momentum() != 0 && it != state.end()) {
        s = static_cast<torch::optim::SGDParamState*>(it->second.get());
        check_state(who, impl, i, p, "momentum_buffer", s->momentum_buffer());
      }
      if (d.record != nullptr) {
        d.record->params.push_back(p);
        d.record->created.push_back(o.momentum() != 0 && s == nullptr);
      }
      auto& b = bucket_for(buckets, p);
      b.params.push_back(p);
      b.grads.push_back(grad);
      b.states.push_back(s);
    }
    for (auto& b : buckets) {
      if (impl == Implementation::kFused) {
        fused_sgd_bucket(b, o, maximize, state, lr, d.found_inf);
      } else {
        foreach_sgd_bucket(b, o, maximize, state, lr);
      }
    }
  }
}

// The int64 step of an Adam or AdamW state, moved by `delta`; returns the
// new value.
int64_t add_to_adam_step(OptimizerParamState& s, int64_t delta) {
  if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(&s)) {
    a->step(a->step() + delta);
    return a->step();
  }
  auto& w = dynamic_cast<torch::optim::AdamWParamState&>(s);
  w.step(w.step() + delta);
  return w.step();
}

// torch::optim's step(): the closure under grad mode, the update without.
template <typename Update>
Tensor step_with_closure(const torch::optim::Optimizer::LossClosure& closure, Update update) {
  Tensor loss = {};
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  torch::NoGradGuard no_grad;
  update();
  return loss;
}

}  // namespace

const char* implementation_name(Implementation implementation) {
  return implementation == Implementation::kFused ? "fused" : "foreach";
}

void zero_grad(torch::optim::Optimizer& optimizer) {
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) p.mutable_grad().reset();
  }
}

Tensor& StepTensors::get(const Tensor& param, int64_t step, bool* wrote) {
  Entry& e = entries_[param.unsafeGetTensorImpl()];
  if (!e.tensor.defined() || e.tensor.device() != param.device()) {
    e.tensor = torch::full({}, static_cast<double>(step),
                           torch::TensorOptions().dtype(torch::kFloat32).device(param.device()));
    e.value = step;
    if (wrote != nullptr) *wrote = true;
  } else if (e.value != step) {
    e.tensor.fill_(static_cast<double>(step));  // the state was loaded or replaced
    e.value = step;
    if (wrote != nullptr) *wrote = true;
  }
  return e.tensor;
}

const Tensor& DeviceLrs::get(size_t group, double lr, const c10::Device& device, bool* wrote) {
  if (entries_.size() <= group) entries_.resize(group + 1);
  Entry& e = entries_[group];
  if (!e.tensor.defined() || e.tensor.device() != device) {
    e.tensor = at::full({}, lr, at::TensorOptions().dtype(at::kFloat).device(device));
    e.value = lr;
    *wrote = true;
  } else if (e.value != lr) {
    e.tensor.fill_(lr);
    e.value = lr;
    *wrote = true;
  }
  return e.tensor;
}

Tensor DeviceLrs::tensor(size_t group) const {
  return group < entries_.size() ? entries_[group].tensor : Tensor();
}

Capturable::Capturable(torch::optim::Optimizer& optimizer, const char* who,
                       Implementation implementation, bool capturable, StepTensors* steps)
    : optimizer_(optimizer),
      name_(who),
      capturable_implementation_(implementation),
      capturable_(capturable),
      steps_(steps) {}

Capturable::~Capturable() = default;

std::string Capturable::who() const {
  return std::string(name_) + " (" + implementation_name(capturable_implementation_) + ")";
}

void Capturable::require_capturable(const char* method) const {
  TORCH_CHECK(capturable_, who(), ": ", method,
              ": the optimizer is not capturable: expected capturable mode (the constructor's "
              "capturable=true, or set_capturable(true))");
}

void Capturable::set_capturable(bool capturable) {
  capturable_ = capturable;
  record_ = CapturableStepRecord();
  if (!capturable) found_inf_ = Tensor();
}

void Capturable::set_found_inf(Tensor found_inf) {
  require_capturable("set_found_inf");
  if (found_inf.defined()) {
    TORCH_CHECK(capturable_implementation_ == Implementation::kFused, who(),
                ": set_found_inf: found_inf needs Implementation::kFused (ATen's fused kernels "
                "skip the update on the device when it holds 1; neither ATen's foreach ops nor "
                "Python's foreach path take a found_inf)");
    TORCH_CHECK(found_inf.scalar_type() == at::kFloat && found_inf.numel() == 1, who(),
                ": set_found_inf: found_inf is ", describe(found_inf), " with shape ",
                found_inf.sizes(),
                ": expected a float32 tensor of one element (what ATen's fused kernels read)");
  }
  // A 0-dim view (GradScaler's found_inf may be [1]): the step tensors
  // subtract it in place, which needs its shape.
  found_inf_ = found_inf.defined() ? found_inf.reshape({}) : Tensor();
}

Tensor Capturable::lr_tensor(size_t group) const { return lrs_.tensor(group); }

void Capturable::write_device_values() {
  require_capturable("write_device_values");
  torch::NoGradGuard no_grad;
  bool wrote = false;
  int64_t index = 0;
  auto& groups = optimizer_.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    if (!params.empty()) {
      const c10::Device device = group_device(name_, capturable_implementation_, groups[g], index);
      lrs_.get(g, groups[g].options().get_lr(), device, &wrote);
    }
    index += static_cast<int64_t>(params.size());
    if (steps_ == nullptr) continue;
    for (const Tensor& p : params) {
      auto it = optimizer_.state().find(p.unsafeGetTensorImpl());
      if (it == optimizer_.state().end()) continue;
      const int64_t step = add_to_adam_step(*it->second, 0);
      steps_->get(p, step, &wrote);
    }
  }
}

CapturableStepRecord* Capturable::begin_step() {
  if (!capturable_) return nullptr;
  record_ = CapturableStepRecord();
  record_.any = true;
  record_.counted = true;
  return &record_;
}

bool Capturable::last_step_replayable() const {
  if (!record_.any || record_.wrote) return false;
  for (bool c : record_.created) {
    if (c) return false;
  }
  return true;
}

void Capturable::record_replayed_step() {
  require_capturable("record_replayed_step");
  TORCH_CHECK(record_.any, who(),
              ": record_replayed_step: no step() was recorded in capturable mode: expected a "
              "replay of a graph that captured one");
  TORCH_CHECK(last_step_replayable(), who(),
              ": record_replayed_step: the last step() was not replayable (it made or filled "
              "device values from the host: a first step's state, a changed lr or step count "
              "not written by write_device_values() first): expected a graph to hold only a "
              "step() for which last_step_replayable() is true");
  for (const Tensor& p : record_.params) {
    if (steps_ == nullptr) break;
    auto it = optimizer_.state().find(p.unsafeGetTensorImpl());
    TORCH_CHECK(it != optimizer_.state().end(), who(),
                ": record_replayed_step: a parameter of the captured step has no state any "
                "more: expected the state the capture updated (was another state dict loaded?)");
    steps_->set_value(p, add_to_adam_step(*it->second, 1));
  }
  record_.counted = true;
}

void Capturable::record_skipped_step() {
  require_capturable("record_skipped_step");
  TORCH_CHECK(record_.counted, who(),
              ": record_skipped_step: no step() or replay was recorded since the last "
              "record_skipped_step(): expected one skip per skipped step");
  for (size_t k = 0; k < record_.params.size(); ++k) {
    const Tensor& p = record_.params[k];
    auto it = optimizer_.state().find(p.unsafeGetTensorImpl());
    if (it == optimizer_.state().end()) continue;
    if (record_.created[k]) {
      // Nothing of a skipped first step remains (Adam's device step tensor
      // is back at 0, the value a new state starts from).
      optimizer_.state().erase(it);
      if (steps_ != nullptr) steps_->set_value(p, 0);
      continue;
    }
    if (steps_ != nullptr) steps_->set_value(p, add_to_adam_step(*it->second, -1));
  }
  record_.counted = false;
}

void StepTensors::set_value(const Tensor& param, int64_t step) {
  entries_[param.unsafeGetTensorImpl()].value = step;
}

Adam::Adam(const std::vector<OptimizerParamGroup>& param_groups, torch::optim::AdamOptions defaults,
           Implementation implementation, bool maximize, bool capturable)
    : torch::optim::Adam(param_groups, std::move(defaults)),
      Capturable(*this, "optim::Adam", implementation, capturable, &steps_),
      implementation_(implementation),
      maximize_(maximize) {}

Adam::Adam(std::vector<Tensor> params, torch::optim::AdamOptions defaults,
           Implementation implementation, bool maximize, bool capturable)
    : Adam({OptimizerParamGroup(std::move(params))}, std::move(defaults), implementation, maximize,
           capturable) {}

Tensor Adam::step(LossClosure closure) {
  return step_with_closure(closure, [&] {
    DeviceStep d{begin_step(), &device_lrs(), capturable() ? found_inf() : Tensor()};
    adam_step<torch::optim::AdamParamState, torch::optim::AdamOptions>(
        "optim::Adam", /*decoupled=*/false, implementation_, maximize_, param_groups_, state_,
        steps_, d);
  });
}

AdamW::AdamW(const std::vector<OptimizerParamGroup>& param_groups,
             torch::optim::AdamWOptions defaults, Implementation implementation, bool maximize,
             bool capturable)
    : torch::optim::AdamW(param_groups, std::move(defaults)),
      Capturable(*this, "optim::AdamW", implementation, capturable, &steps_),
      implementation_(implementation),
      maximize_(maximize) {}

AdamW::AdamW(std::vector<Tensor> params, torch::optim::AdamWOptions defaults,
             Implementation implementation, bool maximize, bool capturable)
    : AdamW({OptimizerParamGroup(std::move(params))}, std::move(defaults), implementation, maximize,
            capturable) {}

Tensor AdamW::step(LossClosure closure) {
  return step_with_closure(closure, [&] {
    DeviceStep d{begin_step(), &device_lrs(), capturable() ? found_inf() : Tensor()};
    adam_step<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(
        "optim::AdamW", /*decoupled=*/true, implementation_, maximize_, param_groups_, state_,
        steps_, d);
  });
}

SGD::SGD(const std::vector<OptimizerParamGroup>& param_groups, torch::optim::SGDOptions defaults,
         Implementation implementation, bool maximize, bool capturable)
    : torch::optim::SGD(param_groups, std::move(defaults)),
      Capturable(*this, "optim::SGD", implementation, capturable, /*steps=*/nullptr),
      implementation_(implementation),
      maximize_(maximize) {}

SGD::SGD(std::vector<Tensor> params, torch::optim::SGDOptions defaults,
         Implementation implementation, bool maximize, bool capturable)
    : SGD({OptimizerParamGroup(std::move(params))}, std::move(defaults), implementation, maximize,
          capturable) {}

Tensor SGD::step(LossClosure closure) {
  return step_with_closure(closure, [&] {
    DeviceStep d{begin_step(), &device_lrs(), capturable() ? found_inf() : Tensor()};
    sgd_step(implementation_, maximize_, param_groups_, state_, d);
  });
}

}  // namespace optim
