// Direct references to torch::nn::Module's registries. LibTorch exposes them
// only as copies (named_parameters(), named_buffers(), named_children()),
// but swapping a tensor has to write the entry in place, without
// register_parameter's set_requires_grad (wrong for non-leaf and
// functorch-wrapped tensors) and without copying the dicts on every call.
#pragma once

#include <torch/nn/module.h>
#include <torch/ordered_dict.h>

#include <memory>
#include <string>

namespace functorch {
namespace internal {

using TensorRegistry = torch::OrderedDict<std::string, torch::Tensor>;
using ChildRegistry = torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>;

TensorRegistry& parameter_registry(torch::nn::Module& module);
TensorRegistry& buffer_registry(torch::nn::Module& module);
const ChildRegistry& child_registry(const torch::nn::Module& module);

}  // namespace internal
}  // namespace functorch
