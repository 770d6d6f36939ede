// functional_call, make_functional(_with_buffers), stack_module_state,
// combine_state_for_ensemble, functional_init: values against real PyTorch
// (fixtures from tools/golden/functorch_module_golden.py), agreement with the
// module's own forward/autograd, and every error message.
#include "functorch/module/functional_call.h"
#include "functorch/module/make_functional.h"
#include "functorch/module/stack_module_state.h"
#include "testing/golden_fixture.h"

#include <ATen/functorch/DynamicLayer.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>
#include <torch/nn/modules/rnn.h>
#include <torch/nn/modules/transformerlayer.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace {

namespace nn = torch::nn;
using functorch::FunctionalCallOptions;
using functorch::NamedTensors;
using Fixture = test_data::GoldenFixture;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

Fixture load_fixture(const std::string& name) {
  return Fixture(test_data::RunfilePath("functorch/module/testdata/" + name + ".pt"));
}

std::map<std::string, torch::Tensor> with_prefix(const Fixture& f, const std::string& prefix) {
  return f.with_prefix(prefix);
}

void load_state(const std::shared_ptr<nn::Module>& module,
                const std::map<std::string, torch::Tensor>& state) {
  torch::NoGradGuard no_grad;
  auto params = module->named_parameters();
  auto buffers = module->named_buffers();
  size_t loaded = 0;
  for (const auto& [name, value] : state) {
    torch::Tensor* target = params.find(name);
    if (target == nullptr) target = buffers.find(name);
    ASSERT_NE(target, nullptr) << "C++ model has no " << name;
    ASSERT_EQ(target->sizes(), value.sizes()) << name;
    target->copy_(value);
    ++loaded;
  }
  ASSERT_EQ(loaded, state.size());
}

// The fixture's substitutes: parameters as fresh leaves requiring grad,
// buffers as copies (BatchNorm updates them in place).
NamedTensors substitutes(const std::shared_ptr<nn::Module>& module, const Fixture& f) {
  NamedTensors sub;
  const auto params = module->named_parameters();
  for (const auto& [name, value] : with_prefix(f, "sub")) {
    torch::Tensor copy = value.clone();
    if (params.contains(name)) copy.requires_grad_();
    sub.insert(name, copy);
  }
  return sub;
}

void expect_close(const torch::Tensor& actual, const torch::Tensor& expected,
                  const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(torch::allclose(actual.to(expected.dtype()), expected, 1e-4, 1e-5))
      << what << ": max abs diff "
      << (actual.to(expected.dtype()) - expected).abs().max().item<double>();
}

torch::Tensor sum_sq(const std::vector<torch::Tensor>& outs) {
  torch::Tensor loss = torch::zeros({});
  for (const auto& o : outs) loss = loss + o.pow(2).sum();
  return loss;
}

// Runs `run` (the module's forward through functional_call with the
// fixture's substitutes) and checks outputs, gradients and buffers after the
// call against PyTorch; also that the module keeps its own tensors.
void check_golden(const std::shared_ptr<nn::Module>& module, const Fixture& f,
                  const std::function<std::vector<torch::Tensor>(const NamedTensors&)>& run) {
  load_state(module, with_prefix(f, "param"));
  const auto own_before = module->named_parameters();
  NamedTensors sub = substitutes(module, f);
  std::vector<torch::Tensor> outs = run(sub);
  for (size_t i = 0; i < outs.size(); ++i) {
    expect_close(outs[i], f["out." + std::to_string(i)], "out." + std::to_string(i));
  }
  std::vector<std::string> names;
  std::vector<torch::Tensor> leaves;
  for (const auto& item : module->named_parameters()) {
    names.push_back(item.key());
    leaves.push_back(sub[item.key()]);
  }
  auto grads = torch::autograd::grad({sum_sq(outs)}, leaves);
  for (size_t i = 0; i < names.size(); ++i) {
    expect_close(grads[i], f["grad." + names[i]], "grad." + names[i]);
  }
  for (const auto& [name, after] : with_prefix(f, "after")) {
    expect_close(sub[name], after, "after." + name);
  }
  const auto own_after = module->named_parameters();
  ASSERT_EQ(own_before.size(), own_after.size());
  for (size_t i = 0; i < own_before.size(); ++i) {
    EXPECT_TRUE(own_before[i].value().is_same(own_after[i].value())) << own_before[i].key();
  }
}

nn::Sequential make_mlp() {
  return nn::Sequential(nn::Linear(4, 8), nn::ReLU(), nn::Linear(8, 8), nn::Tanh(),
                        nn::Linear(8, 3));
}

nn::Sequential make_cnn() {
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(2, 4, 3).padding(1)), nn::BatchNorm2d(4),
                        nn::ReLU(), nn::AdaptiveAvgPool2d(1), nn::Flatten(), nn::Linear(4, 3));
}

TEST(Golden, Mlp) {
  const Fixture f = load_fixture("mlp");
  nn::Sequential model = make_mlp();
  check_golden(model.ptr(), f, [&](const NamedTensors& sub) {
    return std::vector<torch::Tensor>{functorch::functional_call(model, sub, f["in.x"])};
  });
}

TEST(Golden, CnnBatchNormTrain) {
  const Fixture f = load_fixture("cnn_train");
  nn::Sequential model = make_cnn();
  model->train();
  check_golden(model.ptr(), f, [&](const NamedTensors& sub) {
    return std::vector<torch::Tensor>{functorch::functional_call(model, sub, f["in.x"])};
  });
  // The module's own running statistics were not touched.
  expect_close(model->named_buffers()["1.running_mean"], f["param.1.running_mean"],
               "own running_mean");
  EXPECT_EQ(model->named_buffers()["1.num_batches_tracked"].item<int64_t>(),
            f["param.1.num_batches_tracked"].item<int64_t>());
}

TEST(Golden, CnnBatchNormEval) {
  const Fixture f = load_fixture("cnn_eval");
  nn::Sequential model = make_cnn();
  model->eval();
  check_golden(model.ptr(), f, [&](const NamedTensors& sub) {
    return std::vector<torch::Tensor>{functorch::functional_call(model, sub, f["in.x"])};
  });
}

TEST(Golden, CnnBatchNormTrainThroughMakeFunctionalWithBuffers) {
  const Fixture f = load_fixture("cnn_train");
  nn::Sequential model = make_cnn();
  model->train();
  check_golden(model.ptr(), f, [&](const NamedTensors& sub) {
    auto [fn, params, buffers] = functorch::make_functional_with_buffers(model);
    std::vector<torch::Tensor> p, b;
    for (const auto& name : fn.param_names()) p.push_back(sub[name]);
    for (const auto& name : fn.buffer_names()) b.push_back(sub[name]);
    return std::vector<torch::Tensor>{fn(p, b, f["in.x"])};
  });
}

TEST(Golden, Lstm) {
  const Fixture f = load_fixture("lstm");
  nn::LSTM model(nn::LSTMOptions(3, 5).num_layers(2));
  check_golden(model.ptr(), f, [&](const NamedTensors& sub) {
    auto [y, state] = functorch::functional_call(model, sub, f["in.x"]);
    return std::vector<torch::Tensor>{y, std::get<0>(state), std::get<1>(state)};
  });
}

TEST(Golden, TransformerEncoderLayer) {
  const Fixture f = load_fixture("transformer");
  nn::TransformerEncoderLayer model(
      nn::TransformerEncoderLayerOptions(8, 2).dim_feedforward(16).dropout(0.0));
  model->train();
  check_golden(model.ptr(), f, [&](const NamedTensors& sub) {
    return std::vector<torch::Tensor>{functorch::functional_call(model, sub, f["in.x"])};
  });
}

// A user module with a tie: decoder.weight is embedding.weight (registry
// and member), made with the accessor. It holds no tensors of its own, so it
// needs no member binding.
struct TiedLMImpl : nn::Cloneable<TiedLMImpl> {
  TiedLMImpl() { reset(); }
  void reset() override {
    embedding = register_module("embedding", nn::Embedding(10, 6));
    decoder = register_module("decoder", nn::Linear(nn::LinearOptions(6, 10).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& tokens) { return decoder(embedding(tokens)); }
  nn::Embedding embedding{nullptr};
  nn::Linear decoder{nullptr};
};
TORCH_MODULE(TiedLM);

TiedLM make_tied() {
  TiedLM model;
  functorch::NamedMemberAccessor accessor(model);
  accessor.set_tensor("decoder.weight", accessor.get_tensor("embedding.weight"));
  return model;
}

TEST(Golden, TiedEmbeddings) {
  const Fixture f = load_fixture("tied");
  TiedLM model = make_tied();
  load_state(model.ptr(), {{"embedding.weight", f["param.embedding.weight"]}});
  ASSERT_TRUE(model->decoder->weight.is_same(model->embedding->weight));
  const torch::Tensor tokens = f["in.tokens"];
  const torch::Tensor w = f["sub.embedding.weight"].clone().requires_grad_();

  // functional_call, tie_weights (default): the decoder follows.
  torch::Tensor y =
      functorch::functional_call(model, NamedTensors{{"embedding.weight", w}}, tokens);
  expect_close(y, f["out.0"], "functional_call out");
  expect_close(torch::autograd::grad({y.pow(2).sum()}, {w})[0], f["grad.embedding.weight"],
               "functional_call grad");

  // make_functional: one tensor for the tie, a names map listing both names.
  auto [fmodel, params] = functorch::make_functional(model);
  ASSERT_EQ(params.size(), 1u);
  EXPECT_EQ(fmodel.param_names(), std::vector<std::string>{"embedding.weight"});
  ASSERT_EQ(fmodel.names_map().size(), 1u);
  EXPECT_EQ(fmodel.names_map()[0].second,
            (std::vector<std::string>{"embedding.weight", "decoder.weight"}));
  y = fmodel({w}, tokens);
  expect_close(y, f["out.0"], "make_functional out");
  expect_close(torch::autograd::grad({y.pow(2).sum()}, {w})[0], f["grad.embedding.weight"],
               "make_functional grad");

  // tie_weights=false: only the given name changes.
  FunctionalCallOptions untied;
  untied.tie_weights = false;
  y = functorch::functional_call(model, NamedTensors{{"embedding.weight", w}}, untied, tokens);
  expect_close(y,
               torch::matmul(w.index_select(0, tokens.flatten()).view({2, 3, 6}),
                             model->decoder->weight.t()),
               "untied out");
  // Both names given, same tensor: fine; different tensors: PyTorch's error.
  y = functorch::functional_call(
      model, NamedTensors{{"embedding.weight", w}, {"decoder.weight", w}}, tokens);
  expect_close(y, f["out.0"], "both names, one tensor");
  EXPECT_EQ(error_of([&] {
              functorch::functional_call(
                  model, NamedTensors{{"embedding.weight", w}, {"decoder.weight", w * 1}}, tokens);
            }),
            "functional_call got multiple values for keys ['decoder.weight', "
            "'embedding.weight'], which are tied. Consider using tie_weights=False");
  // strict wants every name, tied ones included.
  FunctionalCallOptions strict;
  strict.strict = true;
  EXPECT_EQ(
      error_of([&] {
        functorch::functional_call(model, NamedTensors{{"embedding.weight", w}}, strict, tokens);
      }),
      "Error(s) in reparametrizing for (anonymous namespace)::TiedLMImpl:\n\tMissing key(s): "
      "'decoder.weight'.");
}

// AnyModule cannot hold a Sequential (templated forward); a one-line
// wrapper with a typed forward can.
struct MlpWrapperImpl : nn::Cloneable<MlpWrapperImpl> {
  explicit MlpWrapperImpl(nn::Sequential body) : body(std::move(body)) { reset(); }
  void reset() override { register_module("body", body); }
  torch::Tensor forward(const torch::Tensor& x) { return body->forward(x); }
  nn::Sequential body;
};

TEST(Golden, EnsembleStackModuleStateAndVmap) {
  const Fixture f = load_fixture("ensemble");
  std::vector<nn::Sequential> models;
  for (int m = 0; m < 3; ++m) {
    models.push_back(nn::Sequential(nn::Linear(4, 6), nn::ReLU(), nn::Linear(6, 2)));
    load_state(models.back().ptr(), with_prefix(f, "model" + std::to_string(m)));
  }
  const torch::Tensor x = f["in.x"];
  const torch::Tensor expected = f["out.0"];

  auto [params, buffers] = functorch::stack_module_state(models);
  EXPECT_EQ(params.keys(), (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"}));
  EXPECT_TRUE(buffers.is_empty());
  for (const auto& item : params) {
    EXPECT_TRUE(item.value().is_leaf() && item.value().requires_grad()) << item.key();
    EXPECT_EQ(item.value().size(0), 3);
  }
  // Model by model: slices of the stacked leaves.
  for (int64_t m = 0; m < 3; ++m) {
    NamedTensors slice;
    for (const auto& item : params) slice.insert(item.key(), item.value()[m]);
    expect_close(functorch::functional_call(models[0], {slice, buffers}, x), expected[m],
                 "model slice");
  }
  // Stacked leaves are optimizable: gradients reach them.
  NamedTensors first;
  for (const auto& item : params) first.insert(item.key(), item.value()[1]);
  functorch::functional_call(models[0], first, x).sum().backward();
  EXPECT_TRUE(params["2.bias"].grad().defined());
  EXPECT_TRUE(params["2.bias"].grad()[0].eq(0).all().item<bool>());

  // vmap over the stacked parameters on ATen's functorch engine: the
  // substitutes are BatchedTensors, the module a Sequential.
  using namespace at::functorch;
  const int64_t level = initAndPushDynamicLayer(TransformType::Vmap, 3, RandomnessType::Error);
  torch::Tensor y;
  try {
    NamedTensors batched;
    for (const auto& item : params)
      batched.insert(item.key(), at::_add_batch_dim(item.value(), 0, level));
    y = at::_remove_batch_dim(functorch::functional_call(models[0], {batched, buffers}, x), level,
                              3, 0);
  } catch (...) {
    popDynamicLayerAndDeleteMetadata();
    throw;
  }
  popDynamicLayerAndDeleteMetadata();
  expect_close(y, expected, "vmap(functional_call)");

  // combine_state_for_ensemble, and the AnyModule/AnyValue route.
  auto [fn, cparams, cbuffers] = functorch::combine_state_for_ensemble(models);
  ASSERT_EQ(cparams.size(), 4u);
  EXPECT_FALSE(cparams[0].requires_grad());
  nn::AnyModule any(std::make_shared<MlpWrapperImpl>(models[0]));
  for (int64_t m = 0; m < 3; ++m) {
    std::vector<torch::Tensor> p;
    for (const auto& t : cparams) p.push_back(t[m]);
    expect_close(fn(p, {}, x), expected[m], "combine_state_for_ensemble");
    NamedTensors slice;
    for (size_t i = 0; i < p.size(); ++i) slice.insert("body." + fn.param_names()[i], p[i]);
    nn::AnyValue out = functorch::functional_call(any, slice, x);
    expect_close(out.get<torch::Tensor>(), expected[m], "AnyModule");
  }
}

// functional_call with the module's own tensors == its forward; gradients
// through substituted parameters == autograd on a module holding them.
TEST(FunctionalCall, MatchesModuleForwardAndAutograd) {
  torch::manual_seed(0);
  nn::TransformerEncoderLayer model(
      nn::TransformerEncoderLayerOptions(8, 2).dim_feedforward(16).dropout(0.0));
  nn::TransformerEncoderLayer twin(
      nn::TransformerEncoderLayerOptions(8, 2).dim_feedforward(16).dropout(0.0));
  const torch::Tensor x = torch::randn({5, 2, 8});
  NamedTensors own = model->named_parameters();
  EXPECT_TRUE(torch::equal(functorch::functional_call(model, own, x), model(x)));

  NamedTensors sub;
  for (const auto& item : twin->named_parameters())
    sub.insert(item.key(), item.value().detach().clone().requires_grad_());
  torch::Tensor y = functorch::functional_call(model, sub, x);
  twin(x).pow(2).sum().backward();
  auto grads = torch::autograd::grad({y.pow(2).sum()}, sub.values());
  for (size_t i = 0; i < sub.size(); ++i) {
    expect_close(grads[i], twin->named_parameters()[sub.keys()[i]].grad(), sub.keys()[i]);
  }
}

// Several tensor arguments, and a typed forward of a user module.
struct TwoInputImpl : nn::Cloneable<TwoInputImpl> {
  TwoInputImpl() { reset(); }
  void reset() override { fc = register_module("fc", nn::Linear(3, 2)); }
  torch::Tensor forward(const torch::Tensor& a, const torch::Tensor& b, double scale) {
    return fc(a + b) * scale;
  }
  nn::Linear fc{nullptr};
};
TORCH_MODULE(TwoInput);

TEST(FunctionalCall, SeveralArgumentsAndSharedPtr) {
  TwoInput model;
  const torch::Tensor a = torch::randn({4, 3}), b = torch::randn({4, 3});
  const torch::Tensor w = torch::randn({2, 3}), bias = torch::randn({2});
  const torch::Tensor expected = torch::addmm(bias, a + b, w.t()) * 2.0;
  expect_close(functorch::functional_call(model, NamedTensors{{"fc.weight", w}, {"fc.bias", bias}},
                                          a, b, 2.0),
               expected, "holder");
  std::shared_ptr<TwoInputImpl> ptr = model.ptr();
  expect_close(
      functorch::functional_call(ptr, NamedTensors{{"fc.weight", w}, {"fc.bias", bias}}, a, b, 2.0),
      expected, "shared_ptr");
}

TEST(FunctionalCall, RestoresOnExceptionAndNests) {
  nn::Linear linear(3, 2);
  const torch::Tensor original = linear->weight;
  const torch::Tensor x = torch::randn({4, 3});
  EXPECT_THROW(
      functorch::functional_call(linear, NamedTensors{{"weight", torch::randn({5, 7})}}, x),
      c10::Error);
  EXPECT_TRUE(linear->weight.is_same(original));
  EXPECT_TRUE(linear->named_parameters()["weight"].is_same(original));

  const torch::Tensor w1 = torch::randn({2, 3}), w2 = torch::randn({2, 3});
  {
    functorch::ReparametrizeGuard outer(linear.ptr(), NamedTensors{{"weight", w1}});
    expect_close(functorch::functional_call(linear, NamedTensors{{"weight", w2}}, x),
                 torch::addmm(linear->bias, x, w2.t()), "inner");
    expect_close(linear(x), torch::addmm(linear->bias, x, w1.t()), "outer after inner");
  }
  EXPECT_TRUE(linear->weight.is_same(original));
}

TEST(FunctionalCall, Errors) {
  nn::Linear linear(3, 2);
  const torch::Tensor x = torch::randn({4, 3});
  NamedTensors a{{"weight", torch::randn({2, 3})}, {"bias", torch::randn({2})}};
  NamedTensors b{{"bias", torch::randn({2})}};
  EXPECT_EQ(error_of([&] {
              functorch::functional_call(linear, {a, b}, x);
            }),
            "['bias'] appeared in multiple dictionaries; behavior of functional call is ambiguous");
  FunctionalCallOptions strict;
  strict.strict = true;
  EXPECT_EQ(
      error_of([&] {
        functorch::functional_call(
            linear, NamedTensors{{"weight", torch::randn({2, 3})}, {"foo", x}}, strict, x);
      }),
      "Error(s) in reparametrizing for torch::nn::LinearImpl:\n\tUnexpected key(s): 'foo'.\n\t"
      "Missing key(s): 'bias'.");
  // Not strict: an unknown name of an existing module is ignored, as in
  // PyTorch; an unknown submodule is an error.
  expect_close(functorch::functional_call(linear, NamedTensors{{"foo", x}}, x), linear(x),
               "ignored key");
  EXPECT_EQ(error_of([&] {
              functorch::functional_call(linear, NamedTensors{{"sub.weight", x}}, x);
            }),
            "NamedMemberAccessor: no tensor named 'sub.weight': torch::nn::LinearImpl has no "
            "submodule 'sub'");
}

struct UnboundImpl : nn::Cloneable<UnboundImpl> {
  UnboundImpl() { reset(); }
  void reset() override { scale = register_parameter("scale", torch::ones(3)); }
  torch::Tensor forward(const torch::Tensor& x) { return x * scale; }
  torch::Tensor scale;
};
TORCH_MODULE(Unbound);

TEST(FunctionalCall, UnboundModuleTypeIsAnErrorNotASilentCall) {
  Unbound model;
  const std::string error = error_of([&] {
    functorch::functional_call(model, NamedTensors{{"scale", torch::zeros(3)}}, torch::ones(3));
  });
  EXPECT_NE(error.find("(anonymous namespace)::UnboundImpl"), std::string::npos) << error;
  EXPECT_NE(error.find("RegisterModuleMembers"), std::string::npos) << error;
}

TEST(MakeFunctional, MlpParamsAreCopiesAndModelIsUntouched) {
  torch::manual_seed(0);
  nn::Sequential model = make_mlp();
  const torch::Tensor x = torch::randn({5, 4});
  auto [fmodel, params] = functorch::make_functional(model);
  ASSERT_EQ(params.size(), 6u);
  EXPECT_EQ(fmodel.param_names(), (std::vector<std::string>{"0.weight", "0.bias", "2.weight",
                                                            "2.bias", "4.weight", "4.bias"}));
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(params[i].requires_grad() && params[i].is_leaf());
    EXPECT_FALSE(params[i].is_same(model->parameters()[i]));
    EXPECT_TRUE(torch::equal(params[i], model->parameters()[i]));
  }
  EXPECT_TRUE(torch::equal(fmodel(params, x), model->forward(x)));
  // The functional module's own copy holds meta placeholders only.
  for (const auto& p : fmodel.stateless_model()->parameters()) EXPECT_TRUE(p.is_meta());

  auto [fmodel2, frozen] = functorch::make_functional(model, /*disable_autograd_tracking=*/true);
  EXPECT_FALSE(frozen[0].requires_grad());
  EXPECT_TRUE(model->parameters()[0].requires_grad());

  EXPECT_EQ(error_of([&, &f = fmodel, &p = params] {
              f(std::vector<torch::Tensor>(p.begin(), p.begin() + 2), x);
            }),
            "FunctionalModule: expected 6 tensors (one per name in param_names()), got 2");
}

// The other two module handle types: AnyModule (AnyValue out) and
// shared_ptr<Impl>.
TEST(MakeFunctional, AnyModuleAndSharedPtr) {
  torch::manual_seed(0);
  nn::Linear linear(3, 2);
  const torch::Tensor x = torch::randn({4, 3});
  nn::AnyModule any(linear);
  auto [any_fn, any_params] = functorch::make_functional(any);
  EXPECT_TRUE(torch::equal(any_fn(any_params, x).get<torch::Tensor>(), linear(x)));
  std::shared_ptr<nn::LinearImpl> ptr = linear.ptr();
  auto [ptr_fn, ptr_params, ptr_buffers] = functorch::make_functional_with_buffers(ptr);
  EXPECT_TRUE(ptr_buffers.empty());
  EXPECT_TRUE(torch::equal(ptr_fn(ptr_params, {}, x), linear(x)));
  auto [params, buffers] = functorch::stack_module_state(std::vector<nn::AnyModule>{any, any});
  EXPECT_EQ(params["weight"].sizes(), (std::vector<int64_t>{2, 2, 3}));
}

TEST(MakeFunctional, LstmGolden) {
  const Fixture f = load_fixture("lstm");
  nn::LSTM model(nn::LSTMOptions(3, 5).num_layers(2));
  check_golden(model.ptr(), f, [&](const NamedTensors& sub) {
    auto [fmodel, params] = functorch::make_functional(model);
    std::vector<torch::Tensor> p;
    for (const auto& name : fmodel.param_names()) p.push_back(sub[name]);
    auto [y, state] = fmodel(p, f["in.x"]);
    return std::vector<torch::Tensor>{y, std::get<0>(state), std::get<1>(state)};
  });
}

TEST(MakeFunctional, Errors) {
  nn::Sequential cnn = make_cnn();
  EXPECT_EQ(error_of([&] { functorch::make_functional(cnn); }),
            "make_functional(model): `model` has buffers. Please use "
            "make_functional_with_buffers(model) instead.");
}

TEST(FunctionalInit, EnsembleAndErrors) {
  auto init = functorch::functional_init<nn::Linear>({3});
  auto result = init(4, 2);
  ASSERT_EQ(result.weights.size(), 2u);
  EXPECT_EQ(result.weights[0].sizes(), (std::vector<int64_t>{3, 2, 4}));
  EXPECT_EQ(result.weight_names, (std::vector<std::string>{"weight", "bias"}));
  const torch::Tensor x = torch::randn({5, 4});
  expect_close(result.fn({result.weights[0][2], result.weights[1][2]}, x),
               torch::addmm(result.weights[1][2], x, result.weights[0][2].t()), "member 2");

  auto single = functorch::functional_init<nn::Linear>()(4, 2);
  EXPECT_EQ(single.weights[0].sizes(), (std::vector<int64_t>{2, 4}));
  EXPECT_TRUE(single.weights[0].requires_grad());

  auto with_buffers = functorch::functional_init_with_buffers<nn::BatchNorm1d>({2})(3);
  EXPECT_EQ(with_buffers.buffer_names,
            (std::vector<std::string>{"running_mean", "running_var", "num_batches_tracked"}));
  EXPECT_EQ(with_buffers.buffers[0].sizes(), (std::vector<int64_t>{2, 3}));

  EXPECT_EQ(error_of([] {
              functorch::functional_init<nn::Linear>({2, 3})(4, 2);
            }),
            "NYI: ensemble_shape with more than 1 element");
  EXPECT_EQ(error_of([] { functorch::functional_init<nn::Linear>({0})(4, 2); }),
            "num_models 0 should be > 0");
  EXPECT_EQ(error_of([] { functorch::functional_init<nn::BatchNorm1d>()(3); }),
            "make_functional_deprecated_v1(model): `model` has buffers. Please use "
            "make_functional_with_buffers_deprecated_v1(model) instead.");
}

TEST(StackModuleState, BuffersAndErrors) {
  std::vector<nn::BatchNorm1d> bns{nn::BatchNorm1d(3), nn::BatchNorm1d(3)};
  auto [params, buffers] = functorch::stack_module_state(bns);
  EXPECT_EQ(buffers.keys(),
            (std::vector<std::string>{"running_mean", "running_var", "num_batches_tracked"}));
  EXPECT_FALSE(buffers["running_mean"].requires_grad());
  EXPECT_EQ(buffers["num_batches_tracked"].sizes(), (std::vector<int64_t>{2}));

  for (const char* api : {"stack_module_state", "combine_state_for_ensemble"}) {
    SCOPED_TRACE(api);
    auto call = [&](const std::vector<std::shared_ptr<nn::Module>>& models) {
      if (std::string(api) == "stack_module_state") {
        functorch::stack_module_state(models);
      } else {
        functorch::combine_state_for_ensemble(models);
      }
    };
    EXPECT_EQ(error_of([&] { call({}); }),
              std::string(api) + ": Expected at least one model, got 0.");
    nn::Linear train(2, 2), eval(2, 2);
    eval->eval();
    EXPECT_EQ(error_of([&] {
                call({train.ptr(), eval.ptr()});
              }),
              std::string(api) + ": Expected all models to have the same training/eval mode.");
    EXPECT_EQ(error_of([&] {
                call({train.ptr(), nn::Bilinear(2, 2, 2).ptr()});
              }),
              std::string(api) + ": Expected all models to be of the same class.");
  }
  nn::Linear a(2, 2), b(2, 2);
  b->weight.requires_grad_(false);
  EXPECT_EQ(error_of([&] {
              functorch::stack_module_state(std::vector<nn::Linear>{a, b});
            }),
            "Expected weight from each model to have the same .requires_grad");
}

}  // namespace
