// Finite-difference checks of gradients for kernels/'s tests (PyTorch's
// torch.autograd.gradcheck, for C++): the gradient autograd computes
// against central differences, in float64.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace kernels::testing {

using TensorFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// For a fixed random cotangent u of each output, compares autograd's
// gradient of sum(<u, f(inputs)>) with respect to every element of every
// floating input (float64; others are passed through) with
// (s(x + eps e_i) - s(x - eps e_i)) / (2 eps). Returns "" when every element
// is within atol + rtol * |numeric|, else the first few that are not.
std::string FiniteDifferenceProblems(const TensorFunction& f, const std::vector<at::Tensor>& inputs,
                                     double eps = 1e-6, double atol = 1e-7, double rtol = 1e-5);

// The same for the second derivative: autograd's gradient (create_graph)
// of <v, d s / d inputs> against finite differences of the first
// gradient, for a random v. Checks that a backward is differentiable again.
std::string SecondOrderFiniteDifferenceProblems(const TensorFunction& f,
                                                const std::vector<at::Tensor>& inputs,
                                                double eps = 1e-6, double atol = 1e-6,
                                                double rtol = 1e-4);

// max |actual - expected| / max |expected| (0 for two zero tensors), in
// float64: the tests' closeness measure.
double RelativeError(const at::Tensor& actual, const at::Tensor& expected);

}  // namespace kernels::testing
