// ForwardCall's steps and the Sequential driver (children are type-erased
// AnyModules, so their arguments and outputs travel as AnyValues).
#include "module_call/call.h"

#include <string>

namespace module_call {

ForwardCall::ForwardCall(torch::nn::Module& module)
    : module_(module), hooks_(internal::hooks_of(module)) {
  if (!hooks_) return;
  try {
    for (const auto& item : hooks_->forward) {
      if (item.second.pre_forward) item.second.pre_forward();
      ++pre_forward_done_;
    }
  } catch (...) {
    fail();
    throw;
  }
}

ForwardCall::~ForwardCall() {
  if (!finished_) fail();
}

void ForwardCall::fail() noexcept {
  if (!hooks_) return;
  for (size_t i = pre_forward_done_; i-- > 0;) {
    const auto& failed = hooks_->forward[i].second.forward_failed;
    if (!failed) continue;
    try {
      failed();
    } catch (const std::exception&) {
      // Best effort while unwinding: the original error is what matters.
    }
  }
  pre_forward_done_ = 0;
}

at::Tensor ForwardCall::map_tensor(const at::Tensor& t) const {
  at::Tensor out = t;
  if (!hooks_) return out;
  for (const auto& item : hooks_->forward) {
    if (item.second.map_tensor_argument) out = item.second.map_tensor_argument(out);
  }
  return out;
}

torch::nn::AnyValue ForwardCall::argument(torch::nn::AnyValue value) {
  if (const at::Tensor* t = value.try_get<at::Tensor>()) return torch::nn::AnyValue(map_tensor(*t));
  return value;
}

std::vector<at::Tensor> ForwardCall::run_region(TensorFunction forward,
                                                std::vector<at::Tensor> inputs) {
  return hooks_->region_runner(module_.shared_from_this(), std::move(forward), std::move(inputs));
}

void ForwardCall::finish(const std::vector<at::Tensor>& outputs, bool known) {
  finished_ = true;
  if (!hooks_) return;
  for (const auto& item : hooks_->forward) {
    if (item.second.post_forward) item.second.post_forward(outputs, known);
  }
}

bool ForwardCall::maps_outputs() const {
  if (!hooks_) return false;
  for (const auto& item : hooks_->forward) {
    if (item.second.map_tensor_output) return true;
  }
  return false;
}

at::Tensor ForwardCall::map_output(const at::Tensor& t) const {
  at::Tensor out = t;
  if (!hooks_) return out;
  for (const auto& item : hooks_->forward) {
    if (item.second.map_tensor_output) out = item.second.map_tensor_output(out);
  }
  return out;
}

namespace {

torch::nn::AnyValue any_forward(torch::nn::AnyModule& module,
                                std::vector<torch::nn::AnyValue> args) {
  switch (args.size()) {
    case 0: return module.any_forward();
    case 1: return module.any_forward(std::move(args[0]));
    case 2: return module.any_forward(std::move(args[0]), std::move(args[1]));
    case 3: return module.any_forward(std::move(args[0]), std::move(args[1]), std::move(args[2]));
    default:
      TORCH_CHECK(false,
                  "module_call: a torch::nn::Sequential driven through the call point was "
                  "called with ",
                  args.size(), " arguments: expected at most 3");
  }
}

// A Sequential child with a region runner: tensors in, one tensor out.
torch::nn::AnyValue region_any_forward(ForwardCall& point, torch::nn::AnyModule& module,
                                       std::vector<torch::nn::AnyValue> args) {
  const std::string what = "module_call: Sequential child " + module.ptr()->name() +
                           " runs as a region that reruns (activation checkpointing)";
  std::vector<at::Tensor> inputs;
  for (size_t i = 0; i < args.size(); ++i) {
    const at::Tensor* t = args[i].try_get<at::Tensor>();
    TORCH_CHECK(t != nullptr, what, ": argument ", i,
                " is not an at::Tensor: such a child "
                "takes tensors");
    inputs.push_back(*t);
  }
  TensorFunction forward = [module, what](const std::vector<at::Tensor>& ins) mutable {
    std::vector<torch::nn::AnyValue> values;
    for (const auto& t : ins) values.emplace_back(t);
    torch::nn::AnyValue out = any_forward(module, std::move(values));
    const at::Tensor* t = out.try_get<at::Tensor>();
    TORCH_CHECK(t != nullptr, what, ": its forward returned ", out.type_info().name(),
                ": expected an at::Tensor");
    return std::vector<at::Tensor>{*t};
  };
  return torch::nn::AnyValue(point.run_region(std::move(forward), std::move(inputs)).at(0));
}

torch::nn::AnyValue call_any(torch::nn::AnyModule& module, std::vector<torch::nn::AnyValue> args) {
  ForwardCall point(*module.ptr());
  for (auto& arg : args) arg = point.argument(std::move(arg));
  torch::nn::AnyValue out = point.runs_as_region()
                                ? region_any_forward(point, module, std::move(args))
                                : any_forward(module, std::move(args));
  std::vector<at::Tensor> tensors;
  bool known = true;
  if (const auto* t = out.try_get<at::Tensor>()) {
    internal::collect_tensors(*t, &tensors);
  } else if (const auto* v = out.try_get<std::vector<at::Tensor>>()) {
    internal::collect_tensors(*v, &tensors);
  } else if (const auto* t2 = out.try_get<std::tuple<at::Tensor, at::Tensor>>()) {
    internal::collect_tensors(*t2, &tensors);
  } else if (const auto* t3 = out.try_get<std::tuple<at::Tensor, at::Tensor, at::Tensor>>()) {
    internal::collect_tensors(*t3, &tensors);
  } else {
    known = false;
  }
  point.finish(tensors, known);
  if (!point.maps_outputs()) return out;
  const auto map = [&point](const at::Tensor& t) { return point.map_output(t); };
  if (auto* t = out.try_get<at::Tensor>()) {
    return torch::nn::AnyValue(map(*t));
  } else if (auto* v = out.try_get<std::vector<at::Tensor>>()) {
    std::vector<at::Tensor> mapped = *v;
    internal::map_tensors(mapped, map);
    return torch::nn::AnyValue(std::move(mapped));
  } else if (auto* t2 = out.try_get<std::tuple<at::Tensor, at::Tensor>>()) {
    std::tuple<at::Tensor, at::Tensor> mapped = *t2;
    internal::map_tensors(mapped, map);
    return torch::nn::AnyValue(std::move(mapped));
  } else if (auto* t3 = out.try_get<std::tuple<at::Tensor, at::Tensor, at::Tensor>>()) {
    std::tuple<at::Tensor, at::Tensor, at::Tensor> mapped = *t3;
    internal::map_tensors(mapped, map);
    return torch::nn::AnyValue(std::move(mapped));
  }
  return out;
}

}  // namespace

torch::nn::AnyValue sequential_forward(torch::nn::SequentialImpl& sequential,
                                       std::vector<torch::nn::AnyValue> args) {
  TORCH_CHECK(!sequential.is_empty(), "module_call: cannot call forward() on an empty Sequential");
  auto it = sequential.begin();
  torch::nn::AnyValue value = call_any(*it, std::move(args));
  for (++it; it != sequential.end(); ++it) {
    std::vector<torch::nn::AnyValue> next;
    next.push_back(std::move(value));
    value = call_any(*it, std::move(next));
  }
  return value;
}

}  // namespace module_call
