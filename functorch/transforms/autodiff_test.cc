// Tests for grad, grad_and_value, vjp, jvp, jacrev, jacfwd, hessian and their
// compositions with vmap and with functorch::functional_call.
//
// Golden values: tools/golden/functorch_transforms_golden.py (functorch 1.13).
//
// Ported from PyTorch's test/functorch/test_eager_transforms.py, rewritten
// in C++:
//   TestGradTransform: test_primitive, test_composite_simple,
//     test_composite_two_ops, test_nesting_simple (grad(grad)),
//     test_grad_of_vjp_composition, test_vjp_of_grad_composition,
//     test_no_grad_outside, test_no_grad_inside, test_unrelated_grad,
//     test_argnums, test_out_of_order_argnums, test_invalid_argnums,
//     test_grad_aux_tensor,
//     test_grad_aux_pytree, test_grad_pytree_inputs.
//   TestVmapOfGrad: test_per_sample_grads_simple, test_log_softmax,
//     per-sample grads through functional_call (test_per_sample_grads_*).
//   TestVjp: test_vjp (basic), test_vjp_pytree_output, test_vjp_pytree_error,
//     test_vjp_aux_tensor, test_unrelated_vjp.
//   TestJac (jacrev and jacfwd): test_simple, test_diff_numel,
//     test_vmap_on_jac_simple, test_nested_jac_simple, test_multiple_args,
//     test_multiple_outputs_multiple_argnums, test_aux_tensor,
//     test_unrelated_input, test_argnums_tuple, test_negative_argnums,
//     test_repeated_argnums, test_out_of_bounds_argnums, test_empty_argnums,
//     test_hessian_simple.
//   TestJvp: test_simple, test_multiple_inputs, test_pytree_inputs,
//     test_aux_tensor,
//     test_jvp_structure_mismatch (primals/tangents), test_strict_mode,
//     test_nested_compositions (jvp of jvp, vmap of jvp, jvp of grad).
// Also: every PyTorch error of grad/grad_and_value, exceptions inside grad /
// vjp / jvp leave the DynamicLayer stack and grad modes clean.

#include <ATen/functorch/DynamicLayer.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <map>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "functorch/module/functional_call.h"
#include "functorch/transforms/testing/golden.h"
#include "functorch/transforms/transforms.h"

namespace functorch {
namespace {

using testing::AllClose;
using testing::golden;
using torch::Tensor;

size_t stack_depth() { return at::functorch::getDynamicLayerStack().size(); }

class AutodiffTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(stack_depth(), 0u);
    torch::manual_seed(0);
  }
  void TearDown() override {
    EXPECT_EQ(stack_depth(), 0u);
    EXPECT_TRUE(c10::GradMode::is_enabled());
  }
};

Tensor sin_fn(const Tensor& x) { return x.sin(); }
Tensor fab(const Tensor& a, const Tensor& b) { return (a * b.sin()).sum(); }
Tensor fsin_mul(const Tensor& x, const Tensor& y) { return x.sin() * y; }
Tensor fvec(const Tensor& x) { return x.sin() * x.sum(); }

// ---------------------------------------------------------------- golden ---

TEST_F(AutodiffTest, GoldenGrad) {
  const auto& g = golden();
  Tensor s = g["scalar"], a = g["ab.a"], b = g["ab.b"];
  Tensor cos_s = grad(sin_fn)(s);
  EXPECT_TRUE(AllClose(cos_s, g["grad_sin"]));
  EXPECT_TRUE(AllClose(grad(grad(sin_fn))(s), g["grad_grad_sin"]));
  EXPECT_TRUE(AllClose(grad(grad(grad(sin_fn)))(s), g["grad_grad_grad_sin"]));
  Tree both = grad(fab, {0, 1})(a, b);
  EXPECT_TRUE(AllClose(both[0], g["grad_ab_0"]));
  EXPECT_TRUE(AllClose(both[1], g["grad_ab_1"]));
  EXPECT_TRUE(AllClose(grad(fab, 1)(a, b), g["grad_ab_argnum1"]));
  Tree gv = grad_and_value(fab)(a, b);
  EXPECT_TRUE(AllClose(gv[0], g["grad_and_value_grad"]));
  EXPECT_TRUE(AllClose(gv[1], g["grad_and_value_value"]));
  auto with_aux = [](Tensor x) {
    Tensor y = x.exp();
    return std::make_tuple(y.sum(), y.cos());
  };
  Tree ga = grad(with_aux, 0, /*has_aux=*/true)(a);
  EXPECT_TRUE(AllClose(ga[0], g["grad_aux_grad"]));
  EXPECT_TRUE(AllClose(ga[1], g["grad_aux_aux"]));
  auto ftree = [](NamedTensors p, Tensor x) { return (p["w"].matmul(x) + p["b"]).tanh().sum(); };
  NamedTensors gt = grad(ftree)(NamedTensors{{"w", g["tree.w"]}, {"b", g["tree.b"]}}, a);
  EXPECT_EQ(gt.keys(), (std::vector<std::string>{"w", "b"}));
  EXPECT_TRUE(AllClose(gt["w"], g["grad_tree_w"]));
  EXPECT_TRUE(AllClose(gt["b"], g["grad_tree_b"]));
  // A std::map argument converts: the callable still receives NamedTensors
  // (in the map's order), and the result is the same dict.
  NamedTensors from_map =
      grad(ftree)(std::map<std::string, Tensor>{{"w", g["tree.w"]}, {"b", g["tree.b"]}}, a);
  EXPECT_EQ(from_map.keys(), (std::vector<std::string>{"b", "w"}));
  EXPECT_TRUE(AllClose(from_map["w"], g["grad_tree_w"]));
  EXPECT_TRUE(AllClose(from_map["b"], g["grad_tree_b"]));
}

TEST_F(AutodiffTest, GoldenVjpJvp) {
  const auto& g = golden();
  Tensor a = g["ab.a"], b = g["ab.b"];
  auto [out, vjp_fn] = vjp(fsin_mul, a, b);
  static_assert(std::is_same<decltype(out), Tensor>::value, "f's own type");
  EXPECT_TRUE(AllClose(out, g["vjp_out"]));
  auto [da, db] = vjp_fn(g["vjp.ct"]);
  EXPECT_TRUE(AllClose(da, g["vjp_0"]));
  EXPECT_TRUE(AllClose(db, g["vjp_1"]));
  auto [jvp_primal_out, jvp_out] =
      jvp(fsin_mul, std::make_tuple(a, b), std::make_tuple(g["jvp.ta"], g["jvp.tb"]));
  EXPECT_TRUE(AllClose(jvp_primal_out, g["jvp_out"]));
  EXPECT_TRUE(AllClose(jvp_out, g["jvp_tangent"]));
}

TEST_F(AutodiffTest, GoldenJacobians) {
  const auto& g = golden();
  Tensor a = g["ab.a"], b = g["ab.b"];
  EXPECT_TRUE(AllClose(jacrev(fvec)(a), g["jacrev_fvec"]));
  EXPECT_TRUE(AllClose(jacfwd(fvec)(a), g["jacfwd_fvec"]));
  Tree j = jacrev(fsin_mul, {0, 1})(a, b);
  EXPECT_TRUE(AllClose(j[0], g["jacrev_ab_0"]));
  EXPECT_TRUE(AllClose(j[1], g["jacrev_ab_1"]));
  EXPECT_TRUE(AllClose(jacfwd(fsin_mul, 1)(a, b), g["jacfwd_ab_1"]));
  Tensor W1 = g["tanh.W1"], W2 = g["tanh.W2"];
  auto tanh_mlp = [W1, W2](Tensor x) { return W2.matmul(W1.matmul(x).tanh()).tanh(); };
  auto summed = [tanh_mlp](Tensor x) { return tanh_mlp(x).sum(); };
  EXPECT_TRUE(AllClose(jacrev(jacrev(summed))(a), g["jacrev_jacrev_sum"]));
  EXPECT_TRUE(AllClose(hessian(summed)(a), g["hessian_sum"]));
  EXPECT_TRUE(AllClose(vmap(jacrev(tanh_mlp))(g["batch.x"]), g["vmap_jacrev_tanh"]));
  EXPECT_TRUE(AllClose(vmap(jacfwd(tanh_mlp))(g["batch.x"]), g["vmap_jacfwd_tanh"]));
}

// ------------------------------------------------ per-sample gradients ---

torch::nn::Sequential make_mlp(const testing::Golden& g) {
  torch::nn::Sequential model(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 3));
  model->to(torch::kFloat64);
  torch::NoGradGuard no_grad;
  auto params = model->named_parameters();
  params["0.weight"].copy_(g["mlp.w1"]);
  params["0.bias"].copy_(g["mlp.b1"]);
  params["2.weight"].copy_(g["mlp.w2"]);
  params["2.bias"].copy_(g["mlp.b2"]);
  return model;
}

TEST_F(AutodiffTest, PerSampleGradsViaFunctionalCall) {
  const auto& g = golden();
  torch::nn::Sequential model = make_mlp(g);
  NamedTensors params = model->named_parameters();
  auto loss = [&model](NamedTensors p, Tensor x, Tensor t) {
    Tensor logits = functional_call(model, p, x.unsqueeze(0));
    return torch::nn::functional::cross_entropy(logits, t.unsqueeze(0));
  };
  Tensor xs = g["mlp.x"], ts = g["mlp.t"];
  Tree per_sample = vmap(grad(loss), {std::nullopt, 0, 0})(params, xs, ts);

  // Against functorch.
  EXPECT_TRUE(AllClose(per_sample["0.weight"], g["psg_w1"]));
  EXPECT_TRUE(AllClose(per_sample["0.bias"], g["psg_b1"]));
  EXPECT_TRUE(AllClose(per_sample["2.weight"], g["psg_w2"]));
  EXPECT_TRUE(AllClose(per_sample["2.bias"], g["psg_b2"]));

  // Against the per-example autograd loop.
  for (int64_t i = 0; i < xs.size(0); ++i) {
    model->zero_grad();
    Tensor l = torch::nn::functional::cross_entropy(model->forward(xs[i].unsqueeze(0)),
                                                    ts[i].unsqueeze(0));
    std::vector<Tensor> leaves;
    std::vector<std::string> names;
    for (const auto& p : model->named_parameters()) {
      leaves.push_back(p.value());
      names.push_back(p.key());
    }
    auto grads = torch::autograd::grad({l}, leaves);
    for (size_t k = 0; k < names.size(); ++k) {
      EXPECT_TRUE(AllClose(per_sample[names[k]].tensor()[i], grads[k]))
          << names[k] << " example " << i;
    }
  }
}

TEST_F(AutodiffTest, GradOverFunctionalCall) {
  torch::nn::Linear model(3, 2);
  Tensor x = torch::randn({5, 3});
  NamedTensors params{{"weight", model->weight.detach()}, {"bias", model->bias.detach()}};
  auto f = [&model, x](NamedTensors p) { return functional_call(model, p, x).pow(2).sum(); };
  Tree g = grad(f)(params);
  Tensor out = model->forward(x);
  auto expected = torch::autograd::grad({out.pow(2).sum()}, {model->weight, model->bias});
  EXPECT_TRUE(AllClose(g["weight"], expected[0], 1e-5, 1e-6));
  EXPECT_TRUE(AllClose(g["bias"], expected[1], 1e-5, 1e-6));
}

TEST_F(AutodiffTest, PerSampleGradsSimpleAndLogSoftmax) {
  // TestVmapOfGrad.test_per_sample_grads_simple
  Tensor w = torch::randn({3});
  Tensor xs = torch::randn({4, 3});
  auto compute = [](Tensor w, Tensor x) { return (w * x).sum(); };
  Tensor psg = vmap(grad(compute), {std::nullopt, 0})(w, xs);
  EXPECT_TRUE(AllClose(psg, xs));
  // TestVmapOfGrad.test_log_softmax
  Tensor x = torch::randn({3, 5});
  auto f = [](Tensor v) { return torch::log_softmax(v, 0)[0]; };
  Tensor result = vmap(grad(f))(x);
  Tensor expected = -torch::softmax(x, 1);
  expected.select(1, 0).add_(1);
  EXPECT_TRUE(AllClose(result, expected, 1e-5, 1e-6));
}

TEST_F(AutodiffTest, PerSampleGradsMseLoss) {
  // mse_loss_backward has no batching rule in ATen 1.13 (Python functorch
  // registers a Python decomposition for it); in C++ it goes through the
  // engine's generic batched fallback, which must still be correct.
  Tensor w = torch::randn({3, 4});
  Tensor xs = torch::randn({5, 4}), ys = torch::randn({5, 3});
  auto loss = [](Tensor w, Tensor x, Tensor y) { return torch::mse_loss(w.matmul(x), y); };
  Tensor psg = vmap(grad(loss), {std::nullopt, 0, 0})(w, xs, ys);
  for (int64_t i = 0; i < 5; ++i) {
    Tensor wi = w.clone().requires_grad_();
    Tensor expected = torch::autograd::grad({loss(wi, xs[i], ys[i])}, {wi})[0];
    EXPECT_TRUE(AllClose(psg[i], expected, 1e-5, 1e-6)) << "example " << i;
  }
}

// ------------------------------------------------ batched Jacobians ---

TEST_F(AutodiffTest, BatchedJacobianMatchesAutogradLoop) {
  Tensor W1 = torch::randn({6, 4}), W2 = torch::randn({4, 6});
  auto f = [W1, W2](Tensor x) { return W2.matmul(W1.matmul(x).tanh()).tanh(); };
  Tensor xs = torch::randn({5, 4});
  Tensor jr = vmap(jacrev(f))(xs);
  Tensor jf = vmap(jacfwd(f))(xs);
  ASSERT_EQ(jr.sizes(), torch::IntArrayRef({5, 4, 4}));
  for (int64_t i = 0; i < xs.size(0); ++i) {
    Tensor x = xs[i].clone().requires_grad_(true);
    Tensor y = f(x);
    std::vector<Tensor> rows;
    for (int64_t r = 0; r < y.size(0); ++r) {
      rows.push_back(torch::autograd::grad({y[r]}, {x}, {}, true)[0]);
    }
    Tensor expected = torch::stack(rows);
    EXPECT_TRUE(AllClose(jr[i], expected, 1e-5, 1e-6)) << "example " << i;
    EXPECT_TRUE(AllClose(jf[i], expected, 1e-5, 1e-6)) << "example " << i;
  }
}

// --------------------------------------------------- TestGradTransform ---

TEST_F(AutodiffTest, GradPrimitiveAndComposite) {
  Tensor x = torch::randn({});
  Tensor g = grad(sin_fn)(x);
  EXPECT_TRUE(AllClose(g, x.cos()));
  Tensor v = torch::randn({3});
  EXPECT_TRUE(AllClose(grad([](Tensor x) { return x.sin().sum(); })(v), v.cos()));
  Tensor y = torch::randn({3});
  Tensor gy = grad([y](Tensor x) { return (x * y).sum(); })(v);
  EXPECT_TRUE(AllClose(gy, y));
  EXPECT_TRUE(AllClose(grad(grad(sin_fn))(x), -x.sin()));
}

TEST_F(AutodiffTest, GradNoGradOutsideAndInside) {
  Tensor x = torch::randn({});
  {
    torch::NoGradGuard no_grad;
    Tensor g = grad(sin_fn)(x);
    EXPECT_TRUE(AllClose(g, x.cos()));
    EXPECT_FALSE(g.requires_grad());
  }
  auto f = [](Tensor x) {
    Tensor c;
    {
      torch::NoGradGuard no_grad;
      c = x.pow(2);
    }
    return x - c;
  };
  EXPECT_TRUE(AllClose(grad(f)(x), torch::ones({}, x.options())));
}

TEST_F(AutodiffTest, GradUnrelatedIsZero) {
  Tensor x = torch::randn({3});
  Tensor y = torch::randn({3});
  Tensor g = grad([y](Tensor) { return y.sum(); })(x);
  EXPECT_TRUE(AllClose(g, torch::zeros({3})));
}

TEST_F(AutodiffTest, GradArgnums) {
  Tensor x = torch::randn({}), y = torch::randn({}), z = torch::randn({});
  auto f = [](Tensor x, Tensor y, Tensor z) { return x * y * z; };
  EXPECT_TRUE(AllClose(grad(f, 1)(x, y, z), x * z));
  EXPECT_TRUE(AllClose(grad(f, -1)(x, y, z), x * y));
  Tree gs = grad(f, {1, 0})(x, y, z);  // out of order
  EXPECT_TRUE(AllClose(gs[0], x * z));
  EXPECT_TRUE(AllClose(gs[1], y * z));
  Tree single = grad(f, {2})(x, y, z);
  ASSERT_EQ(single.size(), 1u);
  EXPECT_TRUE(AllClose(single[0], x * y));
}

TEST_F(AutodiffTest, GradAuxPytree) {
  Tensor x = torch::randn({3});
  auto f = [](Tensor x) {
    return std::make_tuple(x.sum(), std::map<std::string, Tensor>{{"a", x.sin()}, {"b", x * 2}});
  };
  Tree r = grad(f, 0, true)(x);
  EXPECT_TRUE(AllClose(r[0], torch::ones({3})));
  EXPECT_TRUE(AllClose(r[1]["a"], x.sin()));
  EXPECT_TRUE(AllClose(r[1]["b"], x * 2));
  // grad_and_value with aux: (grads, (value, aux)).
  Tree gv = grad_and_value(f, 0, true)(x);
  EXPECT_TRUE(AllClose(gv[1][0], x.sum()));
  EXPECT_TRUE(AllClose(gv[1][1]["a"], x.sin()));
}

TEST_F(AutodiffTest, GradOfVjpAndVjpOfGrad) {
  Tensor x = torch::randn({}), y = torch::randn({});
  // grad of vjp
  auto h = [](Tensor x, Tensor y) {
    auto [out, vjp_fn] = vjp(sin_fn, x);
    auto [dx] = vjp_fn(y);
    return dx;
  };
  EXPECT_TRUE(AllClose(grad(h)(x, y), -x.sin() * y));
  // vjp of grad
  auto r = vjp(grad(sin_fn), x);
  EXPECT_TRUE(AllClose(std::get<0>(r.vjp_fn(y)), -x.sin() * y));
}

TEST_F(AutodiffTest, GradPyTorchErrors) {
  Tensor x = torch::randn({3});
  EXPECT_THROW_WITH(grad([](Tensor x) { return x.sin(); })(x),
                    "grad_and_value(f)(*args): Expected f(*args) to return a scalar "
                    "Tensor, got tensor with 1 dims. Maybe you wanted to use the vjp or "
                    "jacrev APIs instead?");
  EXPECT_THROW_WITH(grad([](Tensor) { return 1.0; })(x),
                    "grad_and_value(f)(*args): Expected f(*args) to return a "
                    "Tensor, got <class 'float'>");
  EXPECT_THROW_WITH(grad(fab, 2)(x, x), "Got argnum=2, but only 2 positional inputs");
  EXPECT_THROW_WITH(grad(fab, -3)(x, x), "Got argnum=-3, but only 2 positional inputs");
  EXPECT_THROW_WITH(grad(fab, Argnums::tuple({}))(x, x), "argnums must be non-empty");
  EXPECT_THROW_WITH(grad(fab, {0, 0})(x, x), "argnums elements must be unique, got (0, 0)");
  EXPECT_THROW_WITH(grad([](Tensor x) { return x.sum(); }, 0, true)(x),
                    "output of function f should be a tuple: (output, aux) if "
                    "has_aux is True");
  EXPECT_THROW_WITH(grad([](Tensor, double s) { return torch::tensor(s); }, 1)(x, 2.0),
                    "Thing passed to transform API must be Tensor, got <class "
                    "'float'>");
}

TEST_F(AutodiffTest, ThrowingFunctionLeavesStackClean) {
  Tensor x = torch::randn({3});
  const bool fw_grad_mode = c10::AutogradState::get_tls_state().get_fw_grad_mode();
  auto bad = [](Tensor x) -> Tensor {
    throw std::runtime_error("boom");
    return x.sum();
  };
  EXPECT_THROW(grad(bad)(x), std::runtime_error);
  EXPECT_EQ(stack_depth(), 0u);
  EXPECT_THROW(vmap(grad(bad))(torch::randn({2, 3})), std::runtime_error);
  EXPECT_EQ(stack_depth(), 0u);
  EXPECT_THROW(jacrev(bad)(x), std::runtime_error);
  EXPECT_THROW(jacfwd(bad)(x), std::runtime_error);
  EXPECT_THROW(hessian(bad)(x), std::runtime_error);
  EXPECT_THROW(jvp(bad, std::make_tuple(x), std::make_tuple(x)), std::runtime_error);
  EXPECT_EQ(stack_depth(), 0u);
  EXPECT_TRUE(c10::GradMode::is_enabled());
  EXPECT_EQ(c10::AutogradState::get_tls_state().get_fw_grad_mode(), fw_grad_mode);
  // A PyTorch error (non-scalar output) thrown by grad itself also unwinds.
  EXPECT_THROW(grad(sin_fn)(x), c10::Error);
  {
    torch::NoGradGuard no_grad;
    EXPECT_THROW(grad(bad)(x), std::runtime_error);
    EXPECT_FALSE(c10::GradMode::is_enabled());
  }
  // Transforms still work, and nested jvp still opens a dual level.
  EXPECT_TRUE(AllClose(grad([](Tensor x) { return x.sin().sum(); })(x), x.cos()));
  EXPECT_TRUE(AllClose(jacfwd(sin_fn)(x), torch::diag(x.cos())));
}

// ----------------------------------------------------------- TestVjp ---

TEST_F(AutodiffTest, VjpPytreeOutputAndErrors) {
  Tensor x = torch::randn({3});
  auto f = [](Tensor x) { return std::make_tuple(x.sin(), x.cos()); };
  auto r = vjp(f, x);
  auto [sin_x, cos_x] = r.output;  // f's std::tuple<Tensor, Tensor>
  EXPECT_TRUE(AllClose(sin_x, x.sin()));
  EXPECT_TRUE(AllClose(cos_x, x.cos()));
  auto [v] = r.vjp_fn(std::make_tuple(torch::ones({3}), torch::ones({3})));
  EXPECT_TRUE(AllClose(v, x.cos() - x.sin()));
  // Called twice: the graph is retained. Two cotangents stand for a tuple.
  auto [v2] = r.vjp_fn(torch::ones({3}), torch::zeros({3}));
  EXPECT_TRUE(AllClose(v2, x.cos()));
  EXPECT_THROW_WITH(r.vjp_fn(torch::ones({3})),
                    "Expected pytree structure of cotangents to be the same as "
                    "pytree structure of outputs to the function. "
                    "cotangents: *, primal output: (*, *)");
  // Unrelated output: zeros.
  Tensor y = torch::randn({3});
  auto u = vjp([y](Tensor) { return y; }, x);
  EXPECT_TRUE(AllClose(std::get<0>(u.vjp_fn(torch::ones({3}))), torch::zeros({3})));
  // has_aux through the pytree form.
  TreeFn with_aux([](const std::vector<c10::IValue>& a) -> c10::IValue {
    Tensor t = a[0].toTensor();
    return c10::ivalue::Tuple::create({t.sin(), t.cos()});
  });
  VjpResult ra = vjp(with_aux, {x}, /*has_aux=*/true);
  EXPECT_TRUE(AllClose(ra.aux, x.cos()));
  EXPECT_TRUE(AllClose(ra.vjp_fn(torch::ones({3}))[0], x.cos()));
  TreeFn no_aux(
      [](const std::vector<c10::IValue>& a) -> c10::IValue { return a[0].toTensor().sin(); });
  EXPECT_THROW_WITH(vjp(no_aux, {x}, true),
                    "vjp(f, *primals): output of function f should be a "
                    "tuple: (output, aux) if has_aux is True");
  TreeFn returns_none([](const std::vector<c10::IValue>&) { return c10::IValue(); });
  EXPECT_THROW_WITH(vjp(returns_none, {x}),
                    "vjp(f, *primals): Expected f to be a function that has "
                    "non-empty output (got output = None)");
  EXPECT_THROW_WITH(vjp([](Tensor x) { return x.to(torch::kLong); }, x),
                    "vjp(f, ...): All outputs of f must be floating-point or complex "
                    "Tensors");
}

// ----------------------------------------------------------- TestJac ---

template <class Jac>
void check_jacobian_api(Jac jac) {
  Tensor x = torch::randn({3});
  EXPECT_TRUE(AllClose(jac(sin_fn, Argnums(0))(x), torch::diag(x.cos())));
  // Different numels in and out.
  auto diff_numel = [](Tensor x) { return x.unsqueeze(0).expand({2, 3}).sin(); };
  Tensor j = jac(diff_numel, Argnums(0))(x);
  EXPECT_EQ(j.sizes(), torch::IntArrayRef({2, 3, 3}));
  // Multiple args, argnums tuple and negative.
  Tensor y = torch::randn({3});
  auto f = [](Tensor x, Tensor y) { return x + y.pow(2); };
  Tree both = jac(f, Argnums{0, 1})(x, y);
  EXPECT_TRUE(AllClose(both[0], torch::eye(3)));
  EXPECT_TRUE(AllClose(both[1], torch::diag(2 * y)));
  EXPECT_TRUE(AllClose(jac(f, Argnums(-1))(x, y), torch::diag(2 * y)));
  // Unrelated input: zeros.
  Tensor z = jac([y](Tensor) { return y.sin(); }, Argnums(0))(x);
  EXPECT_TRUE(AllClose(z, torch::zeros({3, 3})));
  // Multiple outputs, multiple argnums.
  auto g = [](Tensor x, Tensor y) { return std::make_tuple(x * y, x + y); };
  Tree m = jac(g, Argnums{0, 1})(x, y);
  EXPECT_TRUE(AllClose(m[0][0], torch::diag(y)));
  EXPECT_TRUE(AllClose(m[0][1], torch::diag(x)));
  EXPECT_TRUE(AllClose(m[1][0], torch::eye(3)));
  // vmap of jac, jac of jac.
  Tensor xs = torch::randn({4, 3});
  Tensor batched = vmap(jac(sin_fn, Argnums(0)))(xs);
  EXPECT_TRUE(AllClose(batched[2], torch::diag(xs[2].cos())));
  auto sum_sin = [](Tensor x) { return x.sin().sum(); };
  EXPECT_TRUE(AllClose(jac(jac(sum_sin, Argnums(0)), Argnums(0))(x), torch::diag(-x.sin())));
  // argnums errors.
  EXPECT_THROW_WITH(jac(f, Argnums(2))(x, y), "Got argnum=2, but only 2 positional inputs");
  EXPECT_THROW_WITH(jac(f, Argnums{0, 0})(x, y), "argnums elements must be unique");
  EXPECT_THROW_WITH(jac(f, Argnums::tuple({}))(x, y), "argnums must be non-empty");
}

TEST_F(AutodiffTest, JacrevApi) {
  check_jacobian_api([](auto f, Argnums a) { return jacrev(f, a); });
  // has_aux
  Tensor x = torch::randn({3});
  auto g = [](Tensor x) { return std::make_tuple(x.sin(), x.cos()); };
  Tree r = jacrev(g, 0, true)(x);
  EXPECT_TRUE(AllClose(r[0], torch::diag(x.cos())));
  EXPECT_TRUE(AllClose(r[1], x.cos()));
}

TEST_F(AutodiffTest, JacfwdApi) {
  check_jacobian_api([](auto f, Argnums a) { return jacfwd(f, a); });
  Tensor x = torch::randn({3});
  auto g = [](Tensor x) { return std::make_tuple(x.sin(), x.cos()); };
  Tree r = jacfwd(g, 0, true)(x);
  EXPECT_TRUE(AllClose(r[0], torch::diag(x.cos())));
  EXPECT_TRUE(AllClose(r[1], x.cos()));
  // randomness is forwarded to the inner vmap.
  auto noisy = [](Tensor x) { return x * torch::rand({3}); };
  EXPECT_THROW_WITH(jacfwd(noisy)(x), "randomness");
  Tensor j = jacfwd(noisy, 0, false, Randomness::kSame)(x);
  EXPECT_TRUE(AllClose(j, torch::diag(torch::diagonal(j))));
}

TEST_F(AutodiffTest, HessianSimple) {
  Tensor x = torch::randn({3});
  auto f = [](Tensor x) { return x.sin().sum(); };
  EXPECT_TRUE(AllClose(hessian(f)(x), torch::diag(-x.sin())));
  // Two arguments, argnums=1.
  Tensor y = torch::randn({3});
  auto g = [](Tensor x, Tensor y) { return (x * y.pow(3)).sum(); };
  EXPECT_TRUE(AllClose(hessian(g, 1)(x, y), torch::diag(6 * x * y), 1e-5, 1e-6));
  // Tuple argnums: the full block Hessian ((d2/dx2, d2/dxdy), (.., d2/dy2)).
  Tree H = hessian(g, {0, 1})(x, y);
  EXPECT_TRUE(AllClose(H[0][0], torch::zeros({3, 3})));
  EXPECT_TRUE(AllClose(H[0][1], torch::diag(3 * y.pow(2)), 1e-5, 1e-6));
  EXPECT_TRUE(AllClose(H[1][0], torch::diag(3 * y.pow(2)), 1e-5, 1e-6));
  EXPECT_TRUE(AllClose(H[1][1], torch::diag(6 * x * y), 1e-5, 1e-6));
}

// ----------------------------------------------------------- TestJvp ---

TEST_F(AutodiffTest, JvpBasics) {
  Tensor x = torch::randn({2, 3}), t = torch::randn({2, 3});
  auto r = jvp(sin_fn, std::make_tuple(x), std::make_tuple(t));
  EXPECT_TRUE(AllClose(r.output, x.sin()));
  EXPECT_TRUE(AllClose(r.jvp_out, x.cos() * t));
  // Multiple inputs.
  Tensor y = torch::randn({2, 3}), ty = torch::randn({2, 3});
  auto m =
      jvp([](Tensor a, Tensor b) { return a * b; }, std::make_tuple(x, y), std::make_tuple(t, ty));
  EXPECT_TRUE(AllClose(m.jvp_out, t * y + x * ty));
  // Pytree inputs (pytree form).
  TreeFn tree_f([](const std::vector<c10::IValue>& a) -> c10::IValue {
    auto pair = a[0].toTupleRef().elements();
    return pair[0].toTensor() * pair[1].toTensor();
  });
  JvpResult p =
      jvp(tree_f, {to_ivalue(std::make_tuple(x, y))}, {to_ivalue(std::make_tuple(t, ty))});
  EXPECT_TRUE(AllClose(p.tangent, t * y + x * ty));
  // has_aux: (output, aux); aux comes back without the jvp level's wrappers.
  TreeFn with_aux([](const std::vector<c10::IValue>& a) -> c10::IValue {
    Tensor v = a[0].toTensor();
    return c10::ivalue::Tuple::create({v.sin(), v.cos()});
  });
  JvpResult ra = jvp(with_aux, {x}, {t}, /*strict=*/false, /*has_aux=*/true);
  EXPECT_TRUE(AllClose(ra.tangent, x.cos() * t));
  EXPECT_TRUE(AllClose(ra.aux, x.cos()));
  EXPECT_THROW_WITH(jvp(tree_f, {to_ivalue(std::make_tuple(x, y))},
                        {to_ivalue(std::make_tuple(t, ty))}, false, true),
                    "jvp(f, primals, tangents): output of function f should "
                    "be a tuple: (output, aux) if has_aux is True");
  // Structure mismatch.
  EXPECT_THROW_WITH(jvp(tree_f, {to_ivalue(std::make_tuple(x, y))}, {t}),
                    "jvp(f, primals, tangents): Expected primals and tangents "
                    "to have the same python structure");
  // Non-tensor primal.
  EXPECT_THROW_WITH(jvp(tree_f, {c10::IValue(1.0)}, {c10::IValue(1.0)}),
                    "Expected primals to only contain Tensors, got <class "
                    "'float'>");
  // Unrelated output: zero tangent, or an error with strict.
  Tensor c = torch::randn({2, 3});
  auto unrelated = [c](Tensor) { return c; };
  auto u = jvp(unrelated, std::make_tuple(x), std::make_tuple(t));
  EXPECT_TRUE(AllClose(u.jvp_out, torch::zeros({2, 3})));
  EXPECT_THROW_WITH(jvp(unrelated, std::make_tuple(x), std::make_tuple(t), true),
                    "The output of f is independent of the inputs");
}

TEST_F(AutodiffTest, JvpCompositions) {
  Tensor x = torch::randn({3}), t = torch::randn({3});
  // jvp of jvp: second derivative of sin along t.
  auto inner = [t](Tensor x) {
    return jvp(sin_fn, std::make_tuple(x), std::make_tuple(t)).jvp_out;
  };
  auto outer = jvp(inner, std::make_tuple(x), std::make_tuple(t));
  EXPECT_TRUE(AllClose(outer.jvp_out, -x.sin() * t * t));
  // vmap of jvp.
  Tensor xs = torch::randn({4, 3}), ts = torch::randn({4, 3});
  Tensor vt = vmap([](Tensor x, Tensor t) {
    return jvp(sin_fn, std::make_tuple(x), std::make_tuple(t)).jvp_out;
  })(xs, ts);
  EXPECT_TRUE(AllClose(vt, xs.cos() * ts));
  // jvp of grad (forward-over-reverse).
  auto g = [](Tensor x) { return grad([](Tensor y) { return y.sin().sum(); })(x).tensor(); };
  auto fr = jvp(g, std::make_tuple(x), std::make_tuple(t));
  EXPECT_TRUE(AllClose(fr.jvp_out, -x.sin() * t));
  // grad of jvp (reverse-over-forward).
  auto h = [t](Tensor x) {
    return jvp(sin_fn, std::make_tuple(x), std::make_tuple(t)).jvp_out.sum();
  };
  EXPECT_TRUE(AllClose(grad(h)(x), -x.sin() * t));
}

}  // namespace
}  // namespace functorch
