// The recomputing autograd node (a custom torch::autograd::Function). Its
// forward runs the region under no-grad and saves only the region's tensor
// inputs; its backward reruns the region with grad enabled on detached
// copies of them (the CPU generator state of the forward restored around it)
// and differentiates the recomputation with torch::autograd::grad. The
// gradients of the declared parameters are returned as the node's input
// gradients, so the outer backward accumulates them where the forward's
// parameters lead (a leaf's .grad, or FSDP's flat parameter), in the outer
// engine's order, exactly as without checkpointing.
#include "activation_checkpointing/internal/checkpoint_function.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <mutex>
#include <unordered_set>

#include "module_call/forward_hooks.h"

namespace activation_checkpointing {
namespace internal {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Node;
using torch::autograd::variable_list;

// What the node keeps between forward and backward besides the saved inputs.
struct RegionState : torch::CustomClassHolder {
  Region region;
  Declared declared;
  bool preserve_rng_state = true;
  at::Tensor rng_state;  // the CPU generator's state before the forward
  size_t num_inputs = 0;
  size_t num_params = 0;
  std::vector<bool> param_requires_grad;  // at the forward
};

at::Tensor cpu_rng_state() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_rng_state(const at::Tensor& state) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// Restores the generator state it found, also when the recomputation throws.
class RngStateGuard {
 public:
  explicit RngStateGuard(const at::Tensor& replay) : saved_(cpu_rng_state()) {
    set_cpu_rng_state(replay);
  }
  ~RngStateGuard() { set_cpu_rng_state(saved_); }
  RngStateGuard(const RngStateGuard&) = delete;
  RngStateGuard& operator=(const RngStateGuard&) = delete;

 private:
  at::Tensor saved_;
};

// Every path from `roots` back through the recomputed graph must end at a
// declared tensor (a detached input or a declared parameter): a node that
// is neither created by the recomputation (its sequence number lies in
// [first, last)) nor declared belongs to a tensor the region closed over,
// whose gradient the node could not return.
void check_no_undeclared_tensors(const variable_list& roots, const variable_list& declared,
                                 uint64_t first, uint64_t last, const std::string& what) {
  std::unordered_set<const Node*> stop;
  for (const auto& t : declared) {
    if (auto fn = torch::autograd::impl::gradient_edge(t).function) stop.insert(fn.get());
  }
  std::unordered_set<const Node*> seen;
  std::vector<Node*> todo;
  for (const auto& t : roots) {
    if (auto fn = torch::autograd::impl::gradient_edge(t).function) todo.push_back(fn.get());
  }
  while (!todo.empty()) {
    Node* node = todo.back();
    todo.pop_back();
    if (!seen.insert(node).second || stop.count(node) != 0) continue;
    const uint64_t seq = node->sequence_nr();
    TORCH_CHECK(seq >= first && seq < last, what,
                ": the recomputed function reads a tensor that requires grad but is not "
                "one of its tensor arguments (reached through autograd node ",
                node->name(),
                "), so its gradient would be lost: pass that tensor as an "
                "argument (checkpoint([&](const at::Tensor& x, const at::Tensor& w) {...}, "
                "x, w)), or checkpoint the module with apply_activation_checkpointing, "
                "which declares the module's parameters");
    for (const auto& edge : node->next_edges()) {
      if (edge.function) todo.push_back(edge.function.get());
    }
  }
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<RegionState> state,
                               at::TensorList inputs_then_params) {
    variable_list inputs(inputs_then_params.begin(),
                         inputs_then_params.begin() + static_cast<int64_t>(state->num_inputs));
    ctx->save_for_backward(inputs);
    ctx->set_materialize_grads(false);
    variable_list outputs;
    {
      module_call::RerunningRegion rerunning;
      outputs = state->region(inputs);
    }
    variable_list non_differentiable;
    for (size_t i = 0; i < outputs.size(); ++i) {
      TORCH_CHECK(outputs[i].defined(), state->declared.what, ": output ", i,
                  " of the checkpointed function is an undefined tensor: expected defined "
                  "tensors");
      if (!outputs[i].is_floating_point() && !outputs[i].is_complex()) {
        non_differentiable.push_back(outputs[i]);
      }
    }
    if (!non_differentiable.empty()) ctx->mark_non_differentiable(non_differentiable);
    ctx->saved_data["state"] = at::IValue::make_capsule(state);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto state =
        c10::static_intrusive_pointer_cast<RegionState>(ctx->saved_data["state"].toCapsule());
    const std::string& what = state->declared.what;
    TORCH_CHECK(!at::GradMode::is_enabled(), what,
                ": backward with create_graph=true "
                "(double backward) through a checkpointed region is not supported: the "
                "recomputation is differentiated once; compute higher-order gradients "
                "without checkpointing");
    // Throws LibTorch's "Trying to backward through the graph a second time"
    // once a backward without retain_graph freed the inputs.
    const variable_list saved = ctx->get_saved_variables();
    variable_list detached;
    detached.reserve(saved.size());
    for (const auto& t : saved) {
      at::Tensor d = t.detach();
      d.set_requires_grad(t.requires_grad());
      detached.push_back(d);
    }

    variable_list outputs, params;
    uint64_t first = 0, last = 0;
    {
      std::unique_ptr<RngStateGuard> rng;
      if (state->preserve_rng_state) rng = std::make_unique<RngStateGuard>(state->rng_state);
      // Grad mode first: what before_recompute makes (FSDP's unsharded
      // views of the flat parameter) must require grad like the forward's.
      at::AutoGradMode grad(true);
      if (state->declared.before_recompute) state->declared.before_recompute();
      first = at::sequence_number::peek();
      module_call::RerunningRegion rerunning;
      outputs = state->region(detached);
      if (state->declared.params) params = state->declared.params();
      last = at::sequence_number::peek();
    }
    TORCH_CHECK(params.size() == state->num_params, what, ": the recomputation declared ",
                params.size(), " parameters where the forward declared ", state->num_params,
                ": the module's parameters must not change between forward and backward");
    for (size_t i = 0; i < params.size(); ++i) {
      // A parameter that needed a gradient in the forward must in the
      // recomputation too, or its gradient would silently be lost.
      TORCH_CHECK(!state->param_requires_grad[i] || params[i].requires_grad(), what,
                  ": declared parameter ", i,
                  " required grad in the forward but not in "
                  "the recomputation (made under no-grad?): its gradient would be lost");
    }
    TORCH_CHECK(outputs.size() == grad_outputs.size(), what, ": the recomputation returned ",
                outputs.size(), " outputs where the forward returned ", grad_outputs.size(),
                ": the checkpointed function must be deterministic in its structure");

    variable_list roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!grad_outputs[i].defined() || !outputs[i].requires_grad()) continue;
      roots.push_back(outputs[i]);
      root_grads.push_back(grad_outputs[i]);
    }
    // Gradients wanted: the node's inputs (region inputs, then parameters)
    // that require grad and that this backward needs.
    variable_list wrt;
    std::vector<size_t> wrt_index;
    auto want = [&](const at::Tensor& t, size_t index) {
      if (t.requires_grad() && ctx->needs_input_grad(index)) {
        wrt.push_back(t);
        wrt_index.push_back(index);
      }
    };
    for (size_t i = 0; i < detached.size(); ++i) want(detached[i], i);
    for (size_t i = 0; i < params.size(); ++i) want(params[i], detached.size() + i);

    variable_list result(1 + detached.size() + params.size());  // [0]: the state
    if (roots.empty() || wrt.empty()) return result;
    {
      variable_list all_declared = detached;
      all_declared.insert(all_declared.end(), params.begin(), params.end());
      check_no_undeclared_tensors(roots, all_declared, first, last, what);
    }
    if (state->declared.before_backward) state->declared.before_backward();
    variable_list grads = torch::autograd::grad(roots, wrt, root_grads, /*retain_graph=*/false,
                                                /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t k = 0; k < grads.size(); ++k) result[1 + wrt_index[k]] = grads[k];
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> run_checkpointed(Region region, std::vector<at::Tensor> inputs,
                                         Declared declared, bool preserve_rng_state) {
  if (!at::GradMode::is_enabled()) return region(inputs);
  std::vector<at::Tensor> params;
  if (declared.params) params = declared.params();
  bool any_requires_grad = false;
  for (const auto& t : inputs) any_requires_grad |= t.defined() && t.requires_grad();
  for (const auto& t : params) any_requires_grad |= t.defined() && t.requires_grad();
  if (!any_requires_grad) {
    // A module with frozen parameters on an input that needs no gradient:
    // there is nothing to differentiate, run it as it is.
    TORCH_CHECK(declared.params, declared.what,
                ": none of the tensor arguments requires "
                "grad (PyTorch: \"None of the inputs have requires_grad=True. Gradients "
                "will be None\"), so the outputs could only depend on tensors the "
                "function closed over, which checkpointing cannot differentiate: pass "
                "the tensors that need gradients (e.g. the parameters) as arguments, or "
                "run without checkpointing");
    return region(inputs);
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(inputs[i].defined(), declared.what, ": tensor argument ", i,
                " is undefined: expected defined tensors");
  }
  auto state = c10::make_intrusive<RegionState>();
  state->region = std::move(region);
  state->declared = std::move(declared);
  state->preserve_rng_state = preserve_rng_state;
  if (preserve_rng_state) state->rng_state = cpu_rng_state();
  state->num_inputs = inputs.size();
  state->num_params = params.size();
  for (const auto& p : params) state->param_requires_grad.push_back(p.requires_grad());
  std::vector<at::Tensor> all = std::move(inputs);
  all.insert(all.end(), params.begin(), params.end());
  return CheckpointFunction::apply(state, at::TensorList(all));
}

}  // namespace internal
}  // namespace activation_checkpointing
