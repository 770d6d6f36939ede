#include "kernels/testing/gradcheck.h"

#include <cmath>
#include <sstream>

#include <ATen/ops/randn_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/utils.h>

namespace kernels::testing {
namespace {

struct Prepared {
  std::vector<at::Tensor> inputs;      // floating ones: fresh leaves requiring grad
  std::vector<size_t> differentiable;  // their positions
};

Prepared Prepare(const std::vector<at::Tensor>& inputs) {
  Prepared p;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].defined() && inputs[i].is_floating_point()) {
      p.inputs.push_back(inputs[i].detach().clone().requires_grad_(true));
      p.differentiable.push_back(i);
    } else {
      p.inputs.push_back(inputs[i]);
    }
  }
  return p;
}

std::vector<at::Tensor> Cotangents(const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> u;
  for (const at::Tensor& out : outputs) u.push_back(at::randn_like(out));
  return u;
}

// sum_k <u_k, out_k> as a float64 0-dim tensor (a graph when grad is on).
at::Tensor Pairing(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& u) {
  at::Tensor s;
  for (size_t k = 0; k < outputs.size(); ++k) {
    at::Tensor term = (outputs[k].to(at::kDouble) * u[k].to(at::kDouble)).sum();
    s = s.defined() ? s + term : term;
  }
  return s;
}

// Central differences of scalar(inputs) with respect to each element of
// inputs[i] for i in `which`; compared with `analytic`.
std::string Compare(const std::function<double()>& scalar, std::vector<at::Tensor>& inputs,
                    const std::vector<size_t>& which, const std::vector<at::Tensor>& analytic,
                    double eps, double atol, double rtol, const char* what) {
  std::ostringstream problems;
  int reported = 0;
  for (size_t j = 0; j < which.size(); ++j) {
    at::Tensor x = inputs[which[j]];
    at::Tensor flat = x.detach().view(-1);  // shares x's storage
    const at::Tensor expected =
        analytic[j].defined() ? analytic[j].detach().reshape(-1) : at::zeros_like(flat);
    for (int64_t e = 0; e < flat.numel(); ++e) {
      const double original = flat[e].item<double>();
      flat[e].fill_(original + eps);
      const double plus = scalar();
      flat[e].fill_(original - eps);
      const double minus = scalar();
      flat[e].fill_(original);
      const double numeric = (plus - minus) / (2 * eps);
      const double got = expected[e].item<double>();
      if (!(std::abs(got - numeric) <= atol + rtol * std::abs(numeric))) {
        if (reported++ < 5) {
          problems << what << " of input " << which[j] << " element " << e << ": autograd " << got
                   << ", finite differences " << numeric << "; ";
        }
      }
    }
  }
  if (reported > 5) problems << "(" << reported << " elements in all)";
  return problems.str();
}

}  // namespace

std::string FiniteDifferenceProblems(const TensorFunction& f, const std::vector<at::Tensor>& inputs,
                                     double eps, double atol, double rtol) {
  Prepared p = Prepare(inputs);
  std::vector<at::Tensor> wrt;
  for (size_t i : p.differentiable) wrt.push_back(p.inputs[i]);
  const std::vector<at::Tensor> outputs = f(p.inputs);
  const std::vector<at::Tensor> u = Cotangents(outputs);
  const std::vector<at::Tensor> analytic =
      torch::autograd::grad({Pairing(outputs, u)}, wrt, {}, /*retain_graph=*/false,
                            /*create_graph=*/false, /*allow_unused=*/true);
  auto scalar = [&] {
    torch::NoGradGuard no_grad;
    return Pairing(f(p.inputs), u).item<double>();
  };
  return Compare(scalar, p.inputs, p.differentiable, analytic, eps, atol, rtol, "gradient");
}

std::string SecondOrderFiniteDifferenceProblems(const TensorFunction& f,
                                                const std::vector<at::Tensor>& inputs, double eps,
                                                double atol, double rtol) {
  Prepared p = Prepare(inputs);
  std::vector<at::Tensor> wrt;
  for (size_t i : p.differentiable) wrt.push_back(p.inputs[i]);
  std::vector<at::Tensor> u, v;
  // <v, d<u, f>/dx> as a function of the inputs, differentiable.
  auto first_order = [&](bool create_graph) {
    const std::vector<at::Tensor> outputs = f(p.inputs);
    if (u.empty()) u = Cotangents(outputs);
    std::vector<at::Tensor> grads =
        torch::autograd::grad({Pairing(outputs, u)}, wrt, {}, /*retain_graph=*/true,
                              /*create_graph=*/create_graph, /*allow_unused=*/true);
    if (v.empty()) {
      for (size_t j = 0; j < wrt.size(); ++j) v.push_back(at::randn_like(wrt[j]));
    }
    at::Tensor s = at::zeros({}, wrt[0].options().requires_grad(false));
    for (size_t j = 0; j < grads.size(); ++j) {
      if (grads[j].defined()) s = s + (grads[j] * v[j]).sum();
    }
    return s;
  };
  const at::Tensor s = first_order(/*create_graph=*/true);
  // A first derivative that does not depend on the inputs (a linear f) has
  // no graph: its second derivative is zero.
  const std::vector<at::Tensor> analytic =
      s.requires_grad() ? torch::autograd::grad({s}, wrt, {}, /*retain_graph=*/false,
                                                /*create_graph=*/false, /*allow_unused=*/true)
                        : std::vector<at::Tensor>(wrt.size());
  auto scalar = [&] { return first_order(/*create_graph=*/false).item<double>(); };
  return Compare(scalar, p.inputs, p.differentiable, analytic, eps, atol, rtol,
                 "second derivative");
}

double RelativeError(const at::Tensor& actual, const at::Tensor& expected) {
  const at::Tensor a = actual.detach().to(at::kCPU).to(at::kDouble);
  const at::Tensor e = expected.detach().to(at::kCPU).to(at::kDouble);
  const double scale = e.abs().max().item<double>();
  const double diff = (a - e).abs().max().item<double>();
  if (scale == 0) return diff;
  return diff / scale;
}

}  // namespace kernels::testing
