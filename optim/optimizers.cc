#include "optim/optimizers.h"

#include <cmath>
#include <memory>
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
#include <ATen/ops/_foreach_sqrt.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>
#include <ATen/ops/empty_like.h>
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

// The state of `p`, created as torch::optim creates it on a first step.
template <typename State>
State& adam_state(StateMap& state, const Tensor& p, bool amsgrad) {
  auto& slot = state[p.unsafeGetTensorImpl()];
  if (!slot) {
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
  }
  return s;
}

template <typename State>
void fused_adam(Bucket<State>& b, const AdamHyper& h, bool decoupled, bool maximize,
                StepTensors& steps) {
  std::vector<Tensor> step_tensors;
  step_tensors.reserve(b.params.size());
  for (size_t k = 0; k < b.params.size(); ++k) {
    step_tensors.push_back(steps.get(b.params[k], b.states[k]->step()));
  }
  if (b.device.is_cpu()) {
    // As Python's fused step on the CPU: the Tensor overload. ATen's CPU
    // foreach has no multi-tensor kernel, and its Scalar overload wraps the
    // scalar into a new tensor for every parameter (4 more operators each).
    at::_foreach_add_(step_tensors, at::scalar_tensor(1.0, at::kFloat), /*alpha=*/1);
  } else {
    at::_foreach_add_(step_tensors, 1);
  }
  const at::TensorList max_exp_avg_sqs =
      h.amsgrad ? at::TensorList(b.max_exp_avg_sqs) : at::TensorList();
  if (decoupled) {
    at::_fused_adamw_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, max_exp_avg_sqs, step_tensors,
                      h.lr, h.beta1, h.beta2, h.weight_decay, h.eps, h.amsgrad, maximize);
  } else {
    at::_fused_adam_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, max_exp_avg_sqs, step_tensors,
                     h.lr, h.beta1, h.beta2, h.weight_decay, h.eps, h.amsgrad, maximize);
  }
  for (size_t k = 0; k < b.params.size(); ++k) {
    b.states[k]->step(b.states[k]->step() + 1);
    steps.set_value(b.params[k], b.states[k]->step());
  }
}

// Python's _multi_tensor_adam without capturable: bias corrections on the
// host from the int64 steps.
template <typename State>
void foreach_adam(Bucket<State>& b, const AdamHyper& h, bool decoupled, bool maximize) {
  std::vector<Tensor> grads = b.grads;
  if (maximize) grads = at::_foreach_neg(grads);
  if (h.weight_decay != 0) {
    if (decoupled) {
      at::_foreach_mul_(b.params, 1 - h.lr * h.weight_decay);
    } else if (maximize) {
      at::_foreach_add_(grads, b.params, h.weight_decay);
    } else {
      grads = at::_foreach_add(grads, b.params, h.weight_decay);
    }
  }
  at::_foreach_lerp_(b.exp_avgs, grads, 1 - h.beta1);
  at::_foreach_mul_(b.exp_avg_sqs, h.beta2);
  at::_foreach_addcmul_(b.exp_avg_sqs, grads, grads, 1 - h.beta2);
  grads.clear();
  std::vector<at::Scalar> step_size, bias_correction2_sqrt;
  for (State* s : b.states) {
    s->step(s->step() + 1);
    const double step = static_cast<double>(s->step());
    step_size.emplace_back(-(h.lr / (1 - std::pow(h.beta1, step))));
    bias_correction2_sqrt.emplace_back(std::sqrt(1 - std::pow(h.beta2, step)));
  }
  std::vector<Tensor> denom;
  if (h.amsgrad) {
    at::_foreach_maximum_(b.max_exp_avg_sqs, b.exp_avg_sqs);
    denom = at::_foreach_sqrt(b.max_exp_avg_sqs);
  } else {
    denom = at::_foreach_sqrt(b.exp_avg_sqs);
  }
  at::_foreach_div_(denom, bias_correction2_sqrt);
  at::_foreach_add_(denom, h.eps);
  at::_foreach_addcdiv_(b.params, b.exp_avgs, denom, step_size);
}

// One Adam or AdamW step over every group (Python's Adam.step with
// fused=True or foreach=True).
template <typename State, typename Options>
void adam_step(const char* who, bool decoupled, Implementation impl, bool maximize,
               std::vector<OptimizerParamGroup>& groups, StateMap& state, StepTensors& steps) {
  int64_t index = 0;
  for (auto& group : groups) {
    const AdamHyper h = hyper_of<Options>(group);
    std::vector<Bucket<State>> buckets;
    for (const Tensor& p : group.params()) {
      const int64_t i = index++;
      const Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      check_param(who, impl, i, p, grad);
      State& s = adam_state<State>(state, p, h.amsgrad);
      check_state(who, impl, i, p, "exp_avg", s.exp_avg());
      check_state(who, impl, i, p, "exp_avg_sq", s.exp_avg_sq());
      if (h.amsgrad) check_state(who, impl, i, p, "max_exp_avg_sq", s.max_exp_avg_sq());
      auto& b = bucket_for(buckets, p);
      b.params.push_back(p);
      b.grads.push_back(grad);
      b.exp_avgs.push_back(s.exp_avg());
      b.exp_avg_sqs.push_back(s.exp_avg_sq());
      if (h.amsgrad) b.max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
      b.states.push_back(&s);
    }
    for (auto& b : buckets) {
      if (impl == Implementation::kFused) {
        fused_adam(b, h, decoupled, maximize, steps);
      } else {
        foreach_adam(b, h, decoupled, maximize);
      }
    }
  }
}

// Fused SGD on parameters whose momentum buffers all exist (is_first_step
// false) or all do not (true: the kernel writes them).
void fused_sgd(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
               const std::vector<Tensor>& bufs, const torch::optim::SGDOptions& o, bool maximize,
               bool is_first_step) {
  if (params.empty()) return;
  at::_fused_sgd_(params, grads, bufs, o.weight_decay(), o.momentum(), o.lr(), o.dampening(),
                  o.nesterov(), maximize, is_first_step);
}

using SgdBucket = Bucket<torch::optim::SGDParamState>;

void fused_sgd_bucket(SgdBucket& b, const torch::optim::SGDOptions& o, bool maximize,
                      StateMap& state) {
  if (o.momentum() == 0) {
    fused_sgd(b.params, b.grads, {}, o, maximize, /*is_first_step=*/false);
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
      new_bufs.push_back(at::empty_like(b.grads[k]));
    }
  }
  fused_sgd(params, grads, bufs, o, maximize, /*is_first_step=*/false);
  fused_sgd(new_params, new_grads, new_bufs, o, maximize, /*is_first_step=*/true);
  for (size_t k = 0; k < new_params.size(); ++k) {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(new_bufs[k]);
    state[new_params[k].unsafeGetTensorImpl()] = std::move(s);
  }
}

// Python's _multi_tensor_sgd. Unlike Python, nesterov does not add the
// momentum into the gradient tensors in place (torch::optim leaves .grad
// untouched too); the parameters' update is the same.
void foreach_sgd_bucket(SgdBucket& b, const torch::optim::SGDOptions& o, bool maximize,
                        StateMap& state) {
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
  at::_foreach_add_(b.params, grads, -o.lr());
}

void sgd_step(Implementation impl, bool maximize, std::vector<OptimizerParamGroup>& groups,
              StateMap& state) {
  const char* who = "optim::SGD";
  int64_t index = 0;
  for (auto& group : groups) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
    std::vector<SgdBucket> buckets;
    for (const Tensor& p : group.params()) {
      const int64_t i = index++;
      const Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      check_param(who, impl, i, p, grad);
      torch::optim::SGDParamState* s = nullptr;
      auto it = state.find(p.unsafeGetTensorImpl());
      if (o.momentum() != 0 && it != state.end()) {
        s = static_cast<torch::optim::SGDParamState*>(it->second.get());
        check_state(who, impl, i, p, "momentum_buffer", s->momentum_buffer());
      }
      auto& b = bucket_for(buckets, p);
      b.params.push_back(p);
      b.grads.push_back(grad);
      b.states.push_back(s);
    }
    for (auto& b : buckets) {
      if (impl == Implementation::kFused) {
        fused_sgd_bucket(b, o, maximize, state);
      } else {
        foreach_sgd_bucket(b, o, maximize, state);
      }
    }
  }
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

Tensor& StepTensors::get(const Tensor& param, int64_t step) {
  Entry& e = entries_[param.unsafeGetTensorImpl()];
  if (!e.tensor.defined() || e.tensor.device() != param.device()) {
    e.tensor = torch::full({}, static_cast<double>(step),
                           torch::TensorOptions().dtype(torch::kFloat32).device(param.device()));
    e.value = step;
  } else if (e.value != step) {
    e.tensor.fill_(static_cast<double>(step));  // the state was loaded or replaced
    e.value = step;
  }
  return e.tensor;
}

void StepTensors::set_value(const Tensor& param, int64_t step) {
  entries_[param.unsafeGetTensorImpl()].value = step;
}

Adam::Adam(const std::vector<OptimizerParamGroup>& param_groups, torch::optim::AdamOptions defaults,
           Implementation implementation, bool maximize)
    : torch::optim::Adam(param_groups, std::move(defaults)),
      implementation_(implementation),
      maximize_(maximize) {}

Adam::Adam(std::vector<Tensor> params, torch::optim::AdamOptions defaults,
           Implementation implementation, bool maximize)
    : Adam({OptimizerParamGroup(std::move(params))}, std::move(defaults), implementation,
           maximize) {}

Tensor Adam::step(LossClosure closure) {
  return step_with_closure(closure, [&] {
    adam_step<torch::optim::AdamParamState, torch::optim::AdamOptions>(
        "optim::Adam", /*decoupled=*/false, implementation_, maximize_, param_groups_, state_,
        steps_);
  });
}

AdamW::AdamW(const std::vector<OptimizerParamGroup>& param_groups,
             torch::optim::AdamWOptions defaults, Implementation implementation, bool maximize)
    : torch::optim::AdamW(param_groups, std::move(defaults)),
      implementation_(implementation),
      maximize_(maximize) {}

AdamW::AdamW(std::vector<Tensor> params, torch::optim::AdamWOptions defaults,
             Implementation implementation, bool maximize)
    : AdamW({OptimizerParamGroup(std::move(params))}, std::move(defaults), implementation,
            maximize) {}

Tensor AdamW::step(LossClosure closure) {
  return step_with_closure(closure, [&] {
    adam_step<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(
        "optim::AdamW", /*decoupled=*/true, implementation_, maximize_, param_groups_, state_,
        steps_);
  });
}

SGD::SGD(const std::vector<OptimizerParamGroup>& param_groups, torch::optim::SGDOptions defaults,
         Implementation implementation, bool maximize)
    : torch::optim::SGD(param_groups, std::move(defaults)),
      implementation_(implementation),
      maximize_(maximize) {}

SGD::SGD(std::vector<Tensor> params, torch::optim::SGDOptions defaults,
         Implementation implementation, bool maximize)
    : SGD({OptimizerParamGroup(std::move(params))}, std::move(defaults), implementation, maximize) {
}

Tensor SGD::step(LossClosure closure) {
  return step_with_closure(closure,
                           [&] { sgd_step(implementation_, maximize_, param_groups_, state_); });
}

}  // namespace optim
