// The typed API as C++ users write it (issue #17):
//   - has_aux on the typed vjp and jvp, against functorch 1.13 golden values
//     (tools/golden/functorch_transforms_golden.py), with Python's errors;
//   - structured bindings on vjp / jvp results and on vjp_fn's products;
//   - Tree indexing from a dict result into the tensor (tree["w"][2]);
//   - one dict type: NamedTensors flows through functional_call and the
//     transforms in both directions, in insertion order. These tests are
//     also compile-time tests: if a grad result stopped converting to
//     NamedTensors, or a NamedTensors stopped being accepted by a transform,
//     this file would stop building and the suite would fail.

#include <gtest/gtest.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "functorch/module/functional_call.h"
#include "functorch/transforms/testing/golden.h"
#include "functorch/transforms/transforms.h"

namespace functorch {
namespace {

namespace F = torch::nn::functional;
using testing::AllClose;
using testing::golden;
using torch::Tensor;

// f(x, y) = (x.sin() * y, {"cos": x.cos() * y, "sq": out * out}), as in the
// generator's sin_mul_aux.
auto sin_mul_aux = [](Tensor x, Tensor y) {
  Tensor out = x.sin() * y;
  return std::make_pair(out, NamedTensors{{"cos", x.cos() * y}, {"sq", out * out}});
};

// ------------------------------------------------------------ has_aux ---

TEST(TypedHasAux, VjpMatchesPython) {
  const auto& g = golden();
  auto [out, vjp_fn, aux] = vjp(sin_mul_aux, g["ab.a"], g["ab.b"], has_aux);
  static_assert(std::is_same<decltype(out), Tensor>::value, "pair's first");
  static_assert(std::is_same<decltype(aux), NamedTensors>::value, "pair's second");
  EXPECT_TRUE(AllClose(out, g["vjp_aux_out"]));
  EXPECT_EQ(aux.keys(), (std::vector<std::string>{"cos", "sq"}));
  EXPECT_TRUE(AllClose(aux["cos"], g["vjp_aux_aux_cos"]));
  EXPECT_TRUE(AllClose(aux["sq"], g["vjp_aux_aux_sq"]));
  EXPECT_FALSE(aux["sq"].requires_grad());  // returned as computed
  auto [da, db] = vjp_fn(g["vjp_aux.ct"]);
  EXPECT_TRUE(AllClose(da, g["vjp_aux_0"]));
  EXPECT_TRUE(AllClose(db, g["vjp_aux_1"]));
}

TEST(TypedHasAux, JvpMatchesPython) {
  const auto& g = golden();
  auto [out, jvp_out, aux] = jvp(sin_mul_aux, std::make_tuple(g["ab.a"], g["ab.b"]),
                                 std::make_tuple(g["jvp.ta"], g["jvp.tb"]), has_aux);
  static_assert(std::is_same<decltype(jvp_out), Tensor>::value, "output's type");
  EXPECT_TRUE(AllClose(out, g["jvp_aux_out"]));
  EXPECT_TRUE(AllClose(jvp_out, g["jvp_aux_tangent"]));
  EXPECT_TRUE(AllClose(aux["cos"], g["jvp_aux_aux_cos"]));
  EXPECT_TRUE(AllClose(aux["sq"], g["jvp_aux_aux_sq"]));
  // strict still applies after the tag.
  Tensor c = torch::randn({4}, torch::kFloat64);
  auto unrelated = [c](Tensor x) { return std::make_tuple(c, x); };
  EXPECT_THROW_WITH(jvp(unrelated, std::make_tuple(g["ab.a"]), std::make_tuple(g["jvp.ta"]),
                        has_aux, /*strict=*/true),
                    "The output of f is independent of the inputs");
}

TEST(TypedHasAux, ErrorsAsPython) {
  Tensor x = torch::randn({3});
  const char* vjp_msg =
      "vjp(f, *primals): output of function f should be a tuple: (output, "
      "aux) if has_aux is True";
  const char* jvp_msg =
      "jvp(f, primals, tangents): output of function f should be a tuple: "
      "(output, aux) if has_aux is True";
  auto single = [](Tensor x) { return x.sin(); };
  EXPECT_THROW_WITH(vjp(single, x, has_aux), vjp_msg);
  EXPECT_THROW_WITH(jvp(single, std::make_tuple(x), std::make_tuple(x), has_aux), jvp_msg);
  // A 3-tuple, a 2-element list: not (output, aux) either (checked at run
  // time, since the C++ type does not say).
  auto triple = [](Tensor x) { return c10::IValue(c10::ivalue::Tuple::create({x.sin(), x, x})); };
  EXPECT_THROW_WITH(vjp(triple, x, has_aux), vjp_msg);
  auto list = [](Tensor x) { return std::vector<Tensor>{x.sin(), x}; };
  EXPECT_THROW_WITH(vjp(list, x, has_aux), vjp_msg);
  // aux must be tensors.
  auto float_aux = [](Tensor x) { return std::make_pair(x.sin(), 1.0); };
  EXPECT_THROW_WITH(vjp(float_aux, x, has_aux),
                    "Expected tensors, got unsupported type <class 'float'>");
  EXPECT_THROW_WITH(jvp(float_aux, std::make_tuple(x), std::make_tuple(x), has_aux),
                    "Expected tensors, got unsupported type <class 'float'>");
  // A dynamically typed (output, aux) works: both come back as Trees.
  auto dynamic = [](Tensor x) {
    return c10::IValue(c10::ivalue::Tuple::create({x.sin(), x.cos()}));
  };
  auto [out, vjp_fn, aux] = vjp(dynamic, x, has_aux);
  static_assert(std::is_same<decltype(aux), Tree>::value, "not static");
  EXPECT_TRUE(AllClose(out, x.sin()));
  EXPECT_TRUE(AllClose(aux, x.cos()));
  EXPECT_TRUE(AllClose(std::get<0>(vjp_fn(torch::ones({3}))), x.cos()));
}

// ------------------------------------------------- structured bindings ---

TEST(TypedBindings, VjpOfTwoOutputsMatchesPython) {
  const auto& g = golden();
  auto two_outputs = [](Tensor x, Tensor y) { return std::make_tuple(x * y, (x + y).exp()); };
  auto [out, vjp_fn] = vjp(two_outputs, g["ab.a"], g["ab.b"]);
  auto [out0, out1] = out;
  EXPECT_TRUE(AllClose(out0, g["vjp2_out0"]));
  EXPECT_TRUE(AllClose(out1, g["vjp2_out1"]));
  // vjp_fn(ct0, ct1) is Python's vjp_fn((ct0, ct1)).
  auto [dx, dy] = vjp_fn(g["vjp2.ct0"], g["vjp2.ct1"]);
  EXPECT_TRUE(AllClose(dx, g["vjp2_0"]));
  EXPECT_TRUE(AllClose(dy, g["vjp2_1"]));
  auto [dx2, dy2] = vjp_fn(std::make_tuple(g["vjp2.ct0"], g["vjp2.ct1"]));
  EXPECT_TRUE(dx2.equal(dx) && dy2.equal(dy));
  // A cotangent tree of the wrong structure is Python's error.
  EXPECT_THROW_WITH(vjp_fn(g["vjp2.ct0"]),
                    "Expected pytree structure of cotangents to be the same "
                    "as pytree structure of outputs to the function. "
                    "cotangents: *, primal output: (*, *)");
}

TEST(TypedBindings, VjpFnUnderVmapGivesJacobianRows) {
  Tensor x = torch::randn({3});
  auto [out, vjp_fn] = vjp([](Tensor v) { return v.sin(); }, x);
  // vmap over the standard basis: the rows of the Jacobian diag(cos x).
  auto rows = vmap(vjp_fn)(torch::eye(3));
  EXPECT_TRUE(AllClose(std::get<0>(rows), torch::diag(x.cos())));
}

// ---------------------------------------------------- Tree indexing ---

TEST(TreeIndexing, DictThenTensorRow) {
  Tensor w = torch::randn({3, 4}), b = torch::randn({3});
  auto f = [](NamedTensors p) { return (p["w"] * 2).sum() + p["b"].pow(2).sum(); };
  Tree g = grad(f)(NamedTensors{{"w", w}, {"b", b}});
  // tree["w"][2] is row 2 of the gradient of w (not element 2 of a tree).
  EXPECT_TRUE(AllClose(g["w"][2], torch::full({4}, 2.0)));
  EXPECT_TRUE(AllClose(g["b"][1], 2 * b[1]));
  EXPECT_TRUE(AllClose(g["w"][2][3], torch::tensor(2.0)));
  EXPECT_THROW_WITH(g["w"][3], "Tree: index 3 out of range for a Tensor of size [3, 4]");
  EXPECT_THROW_WITH(g["w"][0][0][0], "Tree: cannot index a 0-dim Tensor (index 0)");
  EXPECT_THROW_WITH(g["v"], "Tree: no key 'v'; the dict has keys ['w', 'b']");
  EXPECT_THROW_WITH(g[0], "Tree: cannot index a GenericDict (index 0)");
}

// --------------------------------------------------- one dict type ---

// A model whose parameter names do not sort in insertion order
// ("0.weight" > "0.bias"), so any std::map round trip would show.
torch::nn::Sequential small_mlp() {
  torch::nn::Sequential model(torch::nn::Linear(4, 8), torch::nn::Tanh(), torch::nn::Linear(8, 3));
  model->to(torch::kFloat64);
  return model;
}

NamedTensors detached(const NamedTensors& params) {
  NamedTensors out;
  for (const auto& p : params) out.insert(p.key(), p.value().detach().clone());
  return out;
}

TEST(OneDictType, GradResultFlowsBackIntoFunctionalCallAndAnUpdate) {
  torch::manual_seed(0);
  torch::nn::Sequential model = small_mlp();
  Tensor xs = torch::randn({6, 4}, torch::kFloat64);
  Tensor ts = torch::randint(0, 3, {6});
  NamedTensors params = detached(model->named_parameters());

  auto loss = [&model](NamedTensors p, Tensor x, Tensor t) {
    return F::cross_entropy(functional_call(model, p, x), t);
  };
  // functional_call inside grad, the result straight into NamedTensors.
  NamedTensors g = grad(loss)(params, xs, ts);
  EXPECT_EQ(g.keys(), params.keys());  // insertion order, never sorted

  // Per-sample gradients: same dict type; their mean is the batch gradient.
  auto one_example = [&model](NamedTensors p, Tensor x, Tensor t) {
    return F::cross_entropy(functional_call(model, p, x.unsqueeze(0)), t.unsqueeze(0));
  };
  NamedTensors per_sample = vmap(grad(one_example), {std::nullopt, 0, 0})(params, xs, ts);
  EXPECT_EQ(per_sample.keys(), params.keys());
  for (const auto& p : g) {
    EXPECT_TRUE(AllClose(per_sample[p.key()].mean(0), p.value())) << p.key();
  }

  // An optimizer-style update on the dicts, against torch::optim::SGD on the
  // module (plain autograd).
  for (auto& p : params) p.value() = p.value() - 0.1 * g[p.key()];
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  F::cross_entropy(model->forward(xs), ts).backward();
  sgd.step();
  for (const auto& p : model->named_parameters()) {
    EXPECT_TRUE(AllClose(params[p.key()], p.value())) << p.key();
  }
  // The updated dict (and the gradient dict itself) go back into
  // functional_call unconverted.
  EXPECT_TRUE(AllClose(functional_call(model, params, xs), model->forward(xs)));
  Tensor through_grads = functional_call(model, g, xs);
  Tensor expected =
      F::linear(torch::tanh(F::linear(xs, g["0.weight"], g["0.bias"])), g["2.weight"], g["2.bias"]);
  EXPECT_TRUE(AllClose(through_grads, expected));
}

TEST(OneDictType, ModuleParametersNeedNoDetach) {
  // named_parameters() itself (leaves that require grad) goes into the
  // transforms, as in the README.
  torch::manual_seed(1);
  torch::nn::Linear model(3, 2);
  Tensor x = torch::randn({5, 3}), t = torch::randn({5, 2});
  auto loss = [&](NamedTensors p) { return torch::mse_loss(functional_call(model, p, x), t); };
  NamedTensors g = grad(loss)(model->named_parameters());
  torch::mse_loss(model->forward(x), t).backward();
  EXPECT_TRUE(AllClose(g["weight"], model->weight.grad(), 1e-5, 1e-6));
  EXPECT_TRUE(AllClose(g["bias"], model->bias.grad(), 1e-5, 1e-6));
}

TEST(OneDictType, VjpAndJvpOverADictMatchPython) {
  const auto& g = golden();
  NamedTensors params{{"w", g["tree.w"]}, {"b", g["tree.b"]}};
  auto dict_loss = [](NamedTensors p, Tensor x) {
    Tensor y = (p["w"].matmul(x) + p["b"]).tanh();
    return std::make_tuple(y.sum(), y);
  };
  auto [loss, vjp_fn, aux] = vjp(dict_loss, params, g["ab.a"], has_aux);
  EXPECT_TRUE(AllClose(loss, g["vjp_dict_loss"]));
  EXPECT_TRUE(AllClose(aux, g["vjp_dict_aux"]));
  auto [dparams, dx] = vjp_fn(torch::ones({}, torch::kFloat64));
  static_assert(std::is_same<decltype(dparams), NamedTensors>::value,
                "a dict primal's products are the same dict type");
  EXPECT_EQ(dparams.keys(), (std::vector<std::string>{"w", "b"}));
  EXPECT_TRUE(AllClose(dparams["w"], g["vjp_dict_w"]));
  EXPECT_TRUE(AllClose(dparams["b"], g["vjp_dict_b"]));
  EXPECT_TRUE(AllClose(dx, g["vjp_dict_x"]));

  NamedTensors tangent{{"w", torch::ones_like(params["w"])}, {"b", torch::zeros_like(params["b"])}};
  auto [out, jvp_out, jaux] = jvp(dict_loss, std::make_tuple(params, g["ab.a"]),
                                  std::make_tuple(tangent, torch::zeros_like(g["ab.a"])), has_aux);
  EXPECT_TRUE(AllClose(out, g["jvp_dict_out"]));
  EXPECT_TRUE(AllClose(jvp_out, g["jvp_dict_tangent"]));
  EXPECT_TRUE(AllClose(jaux, g["jvp_dict_aux"]));
}

TEST(OneDictType, StdMapArgumentsConvert) {
  static_assert(
      std::is_same<internal::canonical_t<std::map<std::string, Tensor>>, NamedTensors>::value,
      "a std::map argument reaches the callable as NamedTensors");
  static_assert(std::is_convertible<Tree, NamedTensors>::value,
                "a dict result converts to NamedTensors");
  Tensor w = torch::randn({2, 3}), b = torch::randn({2});
  auto f = [](NamedTensors p) { return (p["w"].sum(1) * p["b"]).sum(); };
  std::map<std::string, Tensor> as_map{{"w", w}, {"b", b}};
  NamedTensors from_map = grad(f)(as_map);
  // The map's (sorted) order, the same values as from NamedTensors.
  EXPECT_EQ(from_map.keys(), (std::vector<std::string>{"b", "w"}));
  NamedTensors from_named = grad(f)(NamedTensors{{"w", w}, {"b", b}});
  EXPECT_EQ(from_named.keys(), (std::vector<std::string>{"w", "b"}));
  EXPECT_TRUE(from_map["w"].equal(from_named["w"]));
  EXPECT_TRUE(from_map["b"].equal(from_named["b"]));
  // Nested: a vector of maps arrives as a vector of NamedTensors.
  auto h = [](std::vector<NamedTensors> ps) { return ps[0]["w"].sum() + ps[1]["w"].sum(); };
  std::vector<std::map<std::string, Tensor>> maps{{{"w", w}}, {{"w", b}}};
  Tree gh = grad(h)(maps);
  EXPECT_TRUE(AllClose(gh[1]["w"], torch::ones({2})));
}

}  // namespace
}  // namespace functorch
