// NamedMemberAccessor: every stock module is bound, forward() sees swapped
// tensors, wrapped/non-leaf tensors pass through untouched, errors name the
// module type and the fix.
#include "functorch/module/named_member_accessor.h"

#include <ATen/functorch/DynamicLayer.h>
#include <ATen/functorch/TensorWrapper.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/adaptive.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/parameterdict.h>
#include <torch/nn/modules/container/parameterlist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/instancenorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/loss.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/pooling.h>
#include <torch/nn/modules/rnn.h>
#include <torch/nn/modules/transformer.h>
#include <torch/nn/modules/transformerlayer.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace nn = torch::nn;
using functorch::NamedMemberAccessor;
using functorch::ScopedTensorSwap;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

// Every stock module type that holds tensors, with every optional tensor
// switched on. Each registry entry of each module must be reachable, and the
// accessor must put a new tensor into every member handle bound to it.
using ModuleFactory = std::function<std::shared_ptr<nn::Module>()>;
std::vector<std::pair<std::string, ModuleFactory>> stock_modules() {
  std::vector<std::pair<std::string, ModuleFactory>> m;
  auto add = [&](const std::string& label, ModuleFactory factory) {
    m.emplace_back(label, std::move(factory));
  };
  add("Linear", [] { return std::shared_ptr<nn::Module>(nn::Linear(3, 4).ptr()); });
  add("Bilinear", [] { return std::shared_ptr<nn::Module>(nn::Bilinear(3, 2, 4).ptr()); });
  add("Conv1d", [] { return std::shared_ptr<nn::Module>(nn::Conv1d(2, 3, 3).ptr()); });
  add("Conv2d", [] { return std::shared_ptr<nn::Module>(nn::Conv2d(2, 3, 3).ptr()); });
  add("Conv3d", [] { return std::shared_ptr<nn::Module>(nn::Conv3d(2, 3, 3).ptr()); });
  add("ConvTranspose1d",
      [] { return std::shared_ptr<nn::Module>(nn::ConvTranspose1d(2, 3, 3).ptr()); });
  add("ConvTranspose2d",
      [] { return std::shared_ptr<nn::Module>(nn::ConvTranspose2d(2, 3, 3).ptr()); });
  add("ConvTranspose3d",
      [] { return std::shared_ptr<nn::Module>(nn::ConvTranspose3d(2, 3, 3).ptr()); });
  add("BatchNorm1d", [] { return std::shared_ptr<nn::Module>(nn::BatchNorm1d(3).ptr()); });
  add("BatchNorm2d", [] { return std::shared_ptr<nn::Module>(nn::BatchNorm2d(3).ptr()); });
  add("BatchNorm3d", [] { return std::shared_ptr<nn::Module>(nn::BatchNorm3d(3).ptr()); });
  add("InstanceNorm1d", [] {
    return std::shared_ptr<nn::Module>(
        nn::InstanceNorm1d(nn::InstanceNorm1dOptions(3).affine(true).track_running_stats(true))
            .ptr());
  });
  add("InstanceNorm2d", [] {
    return std::shared_ptr<nn::Module>(
        nn::InstanceNorm2d(nn::InstanceNorm2dOptions(3).affine(true).track_running_stats(true))
            .ptr());
  });
  add("InstanceNorm3d", [] {
    return std::shared_ptr<nn::Module>(
        nn::InstanceNorm3d(nn::InstanceNorm3dOptions(3).affine(true).track_running_stats(true))
            .ptr());
  });
  add("LayerNorm",
      [] { return std::shared_ptr<nn::Module>(nn::LayerNorm(nn::LayerNormOptions({4})).ptr()); });
  add("GroupNorm", [] { return std::shared_ptr<nn::Module>(nn::GroupNorm(2, 4).ptr()); });
  add("Embedding", [] { return std::shared_ptr<nn::Module>(nn::Embedding(5, 3).ptr()); });
  add("EmbeddingBag", [] { return std::shared_ptr<nn::Module>(nn::EmbeddingBag(5, 3).ptr()); });
  add("PReLU", [] {
    return std::shared_ptr<nn::Module>(nn::PReLU(nn::PReLUOptions().num_parameters(3)).ptr());
  });
  add("RNN", [] {
    return std::shared_ptr<nn::Module>(
        nn::RNN(nn::RNNOptions(3, 4).num_layers(2).bidirectional(true)).ptr());
  });
  add("LSTM", [] {
    return std::shared_ptr<nn::Module>(
        nn::LSTM(nn::LSTMOptions(3, 4).num_layers(2).proj_size(2)).ptr());
  });
  add("GRU", [] {
    return std::shared_ptr<nn::Module>(
        nn::GRU(nn::GRUOptions(3, 4).num_layers(2).bidirectional(true)).ptr());
  });
  add("RNNCell", [] { return std::shared_ptr<nn::Module>(nn::RNNCell(3, 4).ptr()); });
  add("LSTMCell", [] { return std::shared_ptr<nn::Module>(nn::LSTMCell(3, 4).ptr()); });
  add("GRUCell", [] { return std::shared_ptr<nn::Module>(nn::GRUCell(3, 4).ptr()); });
  add("MultiheadAttention", [] {
    return std::shared_ptr<nn::Module>(
        nn::MultiheadAttention(nn::MultiheadAttentionOptions(4, 2).add_bias_kv(true)).ptr());
  });
  add("MultiheadAttention(kdim)", [] {
    return std::shared_ptr<nn::Module>(
        nn::MultiheadAttention(nn::MultiheadAttentionOptions(4, 2).kdim(3).vdim(5)).ptr());
  });
  add("TransformerEncoderLayer",
      [] { return std::shared_ptr<nn::Module>(nn::TransformerEncoderLayer(4, 2).ptr()); });
  add("TransformerDecoderLayer",
      [] { return std::shared_ptr<nn::Module>(nn::TransformerDecoderLayer(4, 2).ptr()); });
  add("Transformer", [] {
    return std::shared_ptr<nn::Module>(nn::Transformer(nn::TransformerOptions(4, 2, 1, 1)).ptr());
  });
  add("AdaptiveLogSoftmaxWithLoss", [] {
    return std::shared_ptr<nn::Module>(
        nn::AdaptiveLogSoftmaxWithLoss(nn::AdaptiveLogSoftmaxWithLossOptions(16, 10, {3, 6}))
            .ptr());
  });
  add("NLLLoss", [] {
    return std::shared_ptr<nn::Module>(
        nn::NLLLoss(nn::NLLLossOptions().weight(torch::ones(3))).ptr());
  });
  add("CrossEntropyLoss", [] {
    return std::shared_ptr<nn::Module>(
        nn::CrossEntropyLoss(nn::CrossEntropyLossOptions().weight(torch::ones(3))).ptr());
  });
  add("BCELoss", [] {
    return std::shared_ptr<nn::Module>(
        nn::BCELoss(nn::BCELossOptions().weight(torch::ones(3))).ptr());
  });
  add("BCEWithLogitsLoss", [] {
    return std::shared_ptr<nn::Module>(
        nn::BCEWithLogitsLoss(
            nn::BCEWithLogitsLossOptions().weight(torch::ones(3)).pos_weight(torch::ones(3)))
            .ptr());
  });
  add("MultiMarginLoss", [] {
    return std::shared_ptr<nn::Module>(
        nn::MultiMarginLoss(nn::MultiMarginLossOptions().weight(torch::ones(3))).ptr());
  });
  add("MultiLabelSoftMarginLoss", [] {
    return std::shared_ptr<nn::Module>(
        nn::MultiLabelSoftMarginLoss(nn::MultiLabelSoftMarginLossOptions().weight(torch::ones(3)))
            .ptr());
  });
  add("FractionalMaxPool2d", [] {
    return std::shared_ptr<nn::Module>(
        nn::FractionalMaxPool2d(nn::FractionalMaxPool2dOptions(2).output_size(2)._random_samples(
                                    torch::rand({1, 2, 2})))
            .ptr());
  });
  add("FractionalMaxPool3d", [] {
    return std::shared_ptr<nn::Module>(
        nn::FractionalMaxPool3d(nn::FractionalMaxPool3dOptions(2).output_size(2)._random_samples(
                                    torch::rand({1, 2, 3})))
            .ptr());
  });
  add("ParameterList", [] {
    return std::shared_ptr<nn::Module>(nn::ParameterList(torch::randn(2), torch::randn(3)).ptr());
  });
  add("ParameterDict", [] {
    nn::ParameterDict dict;
    dict->insert("a", torch::randn(2));
    return std::shared_ptr<nn::Module>(dict.ptr());
  });
  add("Sequential", [] {
    return std::shared_ptr<nn::Module>(
        nn::Sequential(nn::Linear(3, 4), nn::ReLU(), nn::BatchNorm1d(4)).ptr());
  });
  return m;
}

TEST(NamedMemberAccessor, EveryStockModuleTensorIsReachable) {
  for (const auto& [label, factory] : stock_modules()) {
    SCOPED_TRACE(label);
    std::shared_ptr<nn::Module> module;
    try {
      module = factory();
    } catch (const c10::Error& e) {
      ADD_FAILURE() << label << ": " << e.what_without_backtrace();
      continue;
    }
    NamedMemberAccessor accessor(module);
    std::vector<std::string> names;
    for (const auto& item : module->named_parameters()) names.push_back(item.key());
    for (const auto& item : module->named_buffers()) names.push_back(item.key());
    ASSERT_FALSE(names.empty()) << label;
    for (const auto& name : names) {
      SCOPED_TRACE(label + " / " + name);
      torch::Tensor original = accessor.get_tensor(name);
      torch::Tensor marker = torch::zeros_like(original);
      torch::Tensor old = accessor.swap_tensor(name, marker);
      EXPECT_TRUE(old.is_same(original));
      EXPECT_TRUE(accessor.get_tensor(name).is_same(marker));
      EXPECT_TRUE(module->named_parameters().contains(name)
                      ? module->named_parameters()[name].is_same(marker)
                      : module->named_buffers()[name].is_same(marker));
      accessor.set_tensor(name, original);
      EXPECT_TRUE(accessor.get_tensor(name).is_same(original));
    }
  }
}

TEST(NamedMemberAccessor, LinearForwardSeesSwappedWeight) {
  nn::Linear linear(3, 2);
  NamedMemberAccessor accessor(linear);
  const torch::Tensor x = torch::randn({4, 3});
  const torch::Tensor w = torch::randn({2, 3});
  const torch::Tensor b = torch::randn({2});
  {
    ScopedTensorSwap swap(accessor, {"weight", "bias"}, {w, b});
    EXPECT_TRUE(torch::allclose(linear(x), torch::addmm(b, x, w.t())));
    EXPECT_TRUE(linear->weight.is_same(w));
  }
  EXPECT_FALSE(linear->weight.is_same(w));
  EXPECT_TRUE(linear->weight.is_same(linear->named_parameters()["weight"]));
}

// The forwards that do not read a plain `weight` field: RNN flat weights,
// MultiheadAttention's in_proj, a loss reading options.weight().
TEST(NamedMemberAccessor, ForwardSeesSwappedTensorsInRnnAttentionAndLoss) {
  torch::manual_seed(0);
  nn::LSTM lstm(nn::LSTMOptions(3, 4).num_layers(2));
  nn::LSTM reference(nn::LSTMOptions(3, 4).num_layers(2));
  NamedMemberAccessor accessor(lstm);
  const torch::Tensor x = torch::randn({5, 2, 3});
  std::vector<std::string> names;
  std::vector<torch::Tensor> values;
  for (const auto& item : reference->named_parameters()) {
    names.push_back(item.key());
    values.push_back(item.value());
  }
  {
    ScopedTensorSwap swap(accessor, names, values);
    EXPECT_TRUE(torch::allclose(std::get<0>(lstm(x)), std::get<0>(reference(x))));
  }
  EXPECT_FALSE(torch::allclose(std::get<0>(lstm(x)), std::get<0>(reference(x))));

  nn::MultiheadAttention mha(4, 2);
  NamedMemberAccessor mha_accessor(mha);
  const torch::Tensor q = torch::randn({3, 1, 4});
  const torch::Tensor before = std::get<0>(mha(q, q, q));
  {
    ScopedTensorSwap swap(mha_accessor, {"in_proj_weight"},
                          {torch::randn_like(mha->in_proj_weight)});
    EXPECT_FALSE(torch::allclose(std::get<0>(mha(q, q, q)), before));
  }
  EXPECT_TRUE(torch::allclose(std::get<0>(mha(q, q, q)), before));

  nn::BCELoss loss(nn::BCELossOptions().weight(torch::ones(3)));
  NamedMemberAccessor loss_accessor(loss);
  const torch::Tensor p = torch::rand({2, 3}), t = torch::rand({2, 3});
  const torch::Tensor unweighted = loss(p, t);
  ScopedTensorSwap swap(loss_accessor, {"weight"}, {torch::full({3}, 2.0)});
  EXPECT_TRUE(torch::allclose(loss(p, t), 2 * unweighted));
}

// Non-leaf substitutes: stored as given (no copy, no set_requires_grad), and
// autograd reaches the leaf behind them.
TEST(NamedMemberAccessor, NonLeafTensorGetsGradient) {
  nn::Linear linear(3, 2);
  NamedMemberAccessor accessor(linear);
  torch::Tensor base = torch::randn({2, 3}, torch::requires_grad());
  torch::Tensor weight = base * 2;  // non-leaf
  const torch::Tensor x = torch::randn({4, 3});
  {
    ScopedTensorSwap swap(accessor, {"weight"}, {weight});
    EXPECT_TRUE(accessor.get_tensor("weight").is_same(weight));
    linear(x).sum().backward();
  }
  ASSERT_TRUE(base.grad().defined());
  EXPECT_TRUE(torch::allclose(base.grad(), 2 * x.sum(0).expand({2, 3})));
  EXPECT_FALSE(weight.is_leaf());
  EXPECT_FALSE(linear->weight.grad().defined());
}

// A vmap-level BatchedTensor (ATen's functorch engine, driven directly) as a
// substitute weight: the Linear's forward computes one output per batch
// entry of the weight.
TEST(NamedMemberAccessor, BatchedTensorSubstitute) {
  using namespace at::functorch;
  nn::Linear linear(3, 2);
  NamedMemberAccessor accessor(linear);
  const torch::Tensor weights = torch::randn({5, 2, 3});
  const torch::Tensor x = torch::randn({4, 3});
  const int64_t level = initAndPushDynamicLayer(TransformType::Vmap, 5, RandomnessType::Error);
  torch::Tensor out;
  try {
    torch::Tensor batched = at::_add_batch_dim(weights, 0, level);
    ScopedTensorSwap swap(accessor, {"weight"}, {batched});
    out = at::_remove_batch_dim(linear(x), level, 5, 0);
  } catch (...) {
    popDynamicLayerAndDeleteMetadata();
    throw;
  }
  popDynamicLayerAndDeleteMetadata();
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{5, 4, 2}));
  for (int64_t i = 0; i < 5; ++i) {
    EXPECT_TRUE(torch::allclose(out[i], torch::addmm(linear->bias, x, weights[i].t()), 1e-5, 1e-6));
  }
}

// A grad-level TensorWrapper (what functorch's grad transform passes) as a
// substitute weight: the gradient computed at that level reaches it.
TEST(NamedMemberAccessor, GradTensorWrapperSubstitute) {
  using namespace at::functorch;
  nn::Linear linear(3, 2);
  NamedMemberAccessor accessor(linear);
  const torch::Tensor weight = torch::randn({2, 3});
  const torch::Tensor x = torch::randn({4, 3});
  const int64_t level = initAndPushDynamicLayer(TransformType::Grad, std::nullopt, std::nullopt,
                                                /*prev_grad_mode=*/true);
  torch::Tensor grad;
  try {
    torch::AutoGradMode enable(true);
    torch::Tensor wrapped = makeTensorWrapper(weight, level).requires_grad_();
    ScopedTensorSwap swap(accessor, {"weight"}, {wrapped});
    EXPECT_TRUE(linear->weight.is_same(wrapped));
    torch::Tensor g = torch::autograd::grad({linear(x).sum()}, {wrapped})[0];
    ASSERT_NE(maybeGetTensorWrapper(g), nullptr);
    grad = maybeGetTensorWrapper(g)->value();
  } catch (...) {
    popDynamicLayerAndDeleteMetadata();
    throw;
  }
  popDynamicLayerAndDeleteMetadata();
  EXPECT_TRUE(torch::allclose(grad, x.sum(0).expand({2, 3})));
  EXPECT_FALSE(linear->weight.grad().defined());
}

TEST(NamedMemberAccessor, NestedSwapsRestoreInOrderAndOnException) {
  nn::Sequential seq(nn::Linear(2, 2));
  NamedMemberAccessor accessor(seq.ptr());
  const torch::Tensor original = accessor.get_tensor("0.weight");
  const torch::Tensor a = torch::ones({2, 2}), b = torch::zeros({2, 2});
  {
    ScopedTensorSwap outer(accessor, {"0.weight"}, {a});
    {
      ScopedTensorSwap inner(accessor, {"0.weight"}, {b});
      EXPECT_TRUE(accessor.get_tensor("0.weight").is_same(b));
    }
    EXPECT_TRUE(accessor.get_tensor("0.weight").is_same(a));
  }
  EXPECT_TRUE(accessor.get_tensor("0.weight").is_same(original));
  try {
    ScopedTensorSwap swap(accessor, {"0.weight"}, {a});
    throw std::runtime_error("forward failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_TRUE(accessor.get_tensor("0.weight").is_same(original));
  auto* linear = seq[0]->as<nn::Linear>();
  EXPECT_TRUE(linear->weight.is_same(original));
  // All-or-nothing: a bad name later in the list leaves nothing swapped.
  EXPECT_THROW(accessor.swap_tensors({"0.weight", "0.nope"}, {a, b}), c10::Error);
  EXPECT_TRUE(linear->weight.is_same(original));
}

struct UnboundBlockImpl : nn::Cloneable<UnboundBlockImpl> {
  UnboundBlockImpl() { reset(); }
  void reset() override { scale = register_parameter("scale", torch::ones(3)); }
  torch::Tensor forward(const torch::Tensor& x) { return x * scale; }
  torch::Tensor scale;
};

struct BoundBlockImpl : nn::Cloneable<BoundBlockImpl> {
  BoundBlockImpl() { reset(); }
  void reset() override {
    scale = register_parameter("scale", torch::ones(3));
    shift = register_buffer("shift", torch::zeros(3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x * scale + shift; }
  torch::Tensor scale, shift;
};
const bool kBoundBlockRegistered = functorch::RegisterModuleMembers<BoundBlockImpl>(
    {{"scale", &BoundBlockImpl::scale}, {"shift", &BoundBlockImpl::shift}});

struct RegistryBlockImpl : nn::Cloneable<RegistryBlockImpl> {
  RegistryBlockImpl() { reset(); }
  void reset() override { register_parameter("scale", torch::ones(3)); }
  torch::Tensor forward(const torch::Tensor& x) { return x * named_parameters()["scale"]; }
};
const bool kRegistryBlockRegistered = functorch::RegisterRegistryReadingModule<RegistryBlockImpl>();

TEST(NamedMemberAccessor, UserModules) {
  ASSERT_TRUE(kBoundBlockRegistered && kRegistryBlockRegistered);
  const torch::Tensor x = torch::randn({2, 3});
  auto bound = std::make_shared<BoundBlockImpl>();
  NamedMemberAccessor bound_accessor(bound);
  {
    ScopedTensorSwap swap(bound_accessor, {"scale", "shift"},
                          {torch::full({3}, 2.0), torch::ones(3)});
    EXPECT_TRUE(torch::allclose(bound->forward(x), 2 * x + 1));
  }
  EXPECT_TRUE(torch::allclose(bound->forward(x), x));

  auto registry = std::make_shared<RegistryBlockImpl>();
  NamedMemberAccessor registry_accessor(registry);
  ScopedTensorSwap swap(registry_accessor, {"scale"}, {torch::full({3}, 3.0)});
  EXPECT_TRUE(torch::allclose(registry->forward(x), 3 * x));
}

TEST(NamedMemberAccessor, Errors) {
  auto seq = nn::Sequential(nn::Linear(2, 2));
  seq->push_back("block", std::make_shared<UnboundBlockImpl>());
  NamedMemberAccessor accessor(seq.ptr());
  const std::string unbound = error_of([&] { accessor.get_tensor("block.scale"); });
  EXPECT_NE(unbound.find("cannot reach 'block.scale'"), std::string::npos) << unbound;
  EXPECT_NE(unbound.find("type (anonymous namespace)::UnboundBlockImpl, at 'block'"),
            std::string::npos)
      << unbound;
  EXPECT_NE(
      unbound.find("functorch::RegisterModuleMembers<(anonymous namespace)::UnboundBlockImpl>"),
      std::string::npos)
      << unbound;
  EXPECT_NE(unbound.find("RegisterRegistryReadingModule"), std::string::npos) << unbound;

  EXPECT_EQ(error_of([&] { accessor.get_tensor("1.weight"); }),
            "NamedMemberAccessor: no tensor named '1.weight': "
            "torch::nn::SequentialImpl has no submodule '1'");
  EXPECT_EQ(error_of([&] { accessor.set_tensor("0.wieght", torch::ones(1)); }),
            "NamedMemberAccessor: no tensor named '0.wieght': "
            "torch::nn::LinearImpl (at '0') has no parameter or buffer 'wieght'");
  EXPECT_EQ(error_of([&] { accessor.swap_tensors({"0.weight"}, {}); }),
            "NamedMemberAccessor::swap_tensors: expected one value per name, "
            "got 1 names and 0 values");
  EXPECT_TRUE(accessor.has_tensor("0.bias"));
  EXPECT_FALSE(accessor.has_tensor("0.nope"));
  EXPECT_TRUE(accessor.has_submodule("block"));
  EXPECT_FALSE(accessor.has_submodule("0.x"));
  auto [missing, unexpected] = accessor.check_keys({"0.weight", "zzz"});
  EXPECT_EQ(missing, (std::vector<std::string>{"0.bias", "block.scale"}));
  EXPECT_EQ(unexpected, (std::vector<std::string>{"zzz"}));
}

}  // namespace
