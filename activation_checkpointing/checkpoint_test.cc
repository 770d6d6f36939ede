// checkpoint() and apply_activation_checkpointing against the same
// computation without checkpointing: the recomputation is deterministic on
// the CPU (with the generator state replayed for dropout), so gradients must
// be bitwise equal (torch::equal), not merely close.
#include "activation_checkpointing/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "activation_checkpointing/apply_activation_checkpointing.h"
#include "module_call/call.h"
#include "module_call/wrap_policy.h"

namespace activation_checkpointing {
namespace {

using ::testing::HasSubstr;

struct Weights {
  at::Tensor w1, w2, x;
};

Weights MakeWeights() {
  torch::manual_seed(7);
  Weights w;
  w.w1 = torch::randn({16, 32}, torch::requires_grad());
  w.w2 = torch::randn({32, 8}, torch::requires_grad());
  w.x = torch::randn({5, 16}, torch::requires_grad());
  return w;
}

at::Tensor Mlp(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2, double p) {
  at::Tensor h = torch::tanh(x.matmul(w1));
  if (p > 0) h = torch::dropout(h, p, /*train=*/true);
  return torch::sigmoid(h.matmul(w2));
}

void ExpectBitwiseEqual(const at::Tensor& actual, const at::Tensor& expected,
                        const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what;
  ASSERT_TRUE(expected.defined()) << what;
  EXPECT_TRUE(torch::equal(actual, expected))
      << what << ": max abs difference " << (actual - expected).abs().max().item<double>();
}

// Gradients of x, w1, w2 for loss = sum(Mlp(...)^2), with or without
// checkpointing, starting from the same generator state.
std::vector<at::Tensor> Grads(bool use_checkpoint, double p, CheckpointOptions options = {},
                              int* calls = nullptr) {
  Weights w = MakeWeights();
  torch::manual_seed(123);
  auto fn = [&](const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2, double prob) {
    if (calls != nullptr) ++*calls;
    return Mlp(x, w1, w2, prob);
  };
  at::Tensor y =
      use_checkpoint ? checkpoint(options, fn, w.x, w.w1, w.w2, p) : fn(w.x, w.w1, w.w2, p);
  // Random numbers drawn after the region: the recomputation must not
  // disturb the generator the rest of the step sees.
  at::Tensor noise = torch::rand({5, 8});
  (y * y * noise).sum().backward();
  return {w.x.grad(), w.w1.grad(), w.w2.grad()};
}

TEST(Checkpoint, GradientsBitwiseEqualToUncheckpointed) {
  int calls = 0;
  auto expected = Grads(false, 0.0);
  auto actual = Grads(true, 0.0, {}, &calls);
  EXPECT_EQ(calls, 2) << "forward once, recomputation once";
  for (size_t i = 0; i < expected.size(); ++i) {
    ExpectBitwiseEqual(actual[i], expected[i], "grad " + std::to_string(i));
  }
}

TEST(Checkpoint, DropoutMasksReplayedBitwise) {
  auto expected = Grads(false, 0.5);
  auto actual = Grads(true, 0.5);
  for (size_t i = 0; i < expected.size(); ++i) {
    ExpectBitwiseEqual(actual[i], expected[i], "grad " + std::to_string(i));
  }
}

TEST(Checkpoint, WithoutPreserveRngStateTheRecomputationDrawsNewMasks) {
  CheckpointOptions options;
  options.preserve_rng_state = false;
  auto expected = Grads(false, 0.5);
  auto actual = Grads(true, 0.5, options);
  // The recomputation's dropout mask differs from the forward's, so the
  // gradients do (what preserve_rng_state=true exists to prevent).
  EXPECT_FALSE(torch::equal(actual[1], expected[1]));
}

TEST(Checkpoint, OutputsHoldOneNodeNotTheActivations) {
  Weights w = MakeWeights();
  at::Tensor y = checkpoint([](const at::Tensor& x, const at::Tensor& w1,
                               const at::Tensor& w2) { return Mlp(x, w1, w2, 0.0); },
                            w.x, w.w1, w.w2);
  ASSERT_TRUE(y.grad_fn() != nullptr);
  // The region's graph was not recorded: the node's inputs lead straight to
  // the arguments' accumulators.
  for (const auto& edge : y.grad_fn()->next_edges()) {
    ASSERT_TRUE(edge.function != nullptr);
    EXPECT_EQ(edge.function->name(), "torch::autograd::AccumulateGrad");
  }
}

TEST(Checkpoint, NestedRegions) {
  Weights w = MakeWeights();
  auto inner = [](const at::Tensor& h, const at::Tensor& w2) {
    return torch::sigmoid(torch::dropout(h, 0.3, true).matmul(w2));
  };
  auto plain = [&](const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2) {
    return inner(torch::tanh(x.matmul(w1)), w2) * 2;
  };
  auto nested = [&](const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2) {
    return checkpoint(inner, torch::tanh(x.matmul(w1)), w2) * 2;
  };
  torch::manual_seed(5);
  plain(w.x, w.w1, w.w2).pow(2).sum().backward();
  std::vector<at::Tensor> expected = {w.x.grad().clone(), w.w1.grad().clone(), w.w2.grad().clone()};
  for (auto* t : {&w.x, &w.w1, &w.w2}) t->mutable_grad().reset();
  torch::manual_seed(5);
  checkpoint(nested, w.x, w.w1, w.w2).pow(2).sum().backward();
  ExpectBitwiseEqual(w.x.grad(), expected[0], "x");
  ExpectBitwiseEqual(w.w1.grad(), expected[1], "w1");
  ExpectBitwiseEqual(w.w2.grad(), expected[2], "w2");
}

TEST(Checkpoint, TupleAndNonTensorArguments) {
  Weights w = MakeWeights();
  auto fn = [](const at::Tensor& x, const at::Tensor& w1, int64_t k, std::string tag) {
    at::Tensor h = x.matmul(w1);
    EXPECT_EQ(tag, "kept");
    return std::make_tuple(h.narrow(1, 0, k).exp(), h.sum(1));
  };
  auto [a, b] = fn(w.x, w.w1, 3, "kept");
  (a.sum() + b.pow(2).sum()).backward();
  at::Tensor expected = w.w1.grad().clone();
  w.w1.mutable_grad().reset();
  auto [c, d] = checkpoint(fn, w.x, w.w1, int64_t{3}, std::string("kept"));
  (c.sum() + d.pow(2).sum()).backward();
  ExpectBitwiseEqual(w.w1.grad(), expected, "w1");
}

TEST(Checkpoint, RetainGraphAllowsASecondBackward) {
  Weights w = MakeWeights();
  at::Tensor y = checkpoint([](const at::Tensor& x, const at::Tensor& w1,
                               const at::Tensor& w2) { return Mlp(x, w1, w2, 0.0); },
                            w.x, w.w1, w.w2)
                     .sum();
  y.backward({}, /*retain_graph=*/true);
  at::Tensor once = w.w1.grad().clone();
  y.backward();
  ExpectBitwiseEqual(w.w1.grad(), once * 2, "w1 after two backwards");
}

TEST(Checkpoint, GradOfInputsOnly) {
  Weights w = MakeWeights();
  at::Tensor y = checkpoint([](const at::Tensor& x, const at::Tensor& w1,
                               const at::Tensor& w2) { return Mlp(x, w1, w2, 0.0); },
                            w.x, w.w1, w.w2);
  at::Tensor gx = torch::autograd::grad({y.sum()}, {w.x})[0];
  at::Tensor expected = torch::autograd::grad({Mlp(w.x, w.w1, w.w2, 0.0).sum()}, {w.x})[0];
  ExpectBitwiseEqual(gx, expected, "dx");
  EXPECT_FALSE(w.w1.grad().defined()) << "torch::autograd::grad must not accumulate";
}

TEST(Checkpoint, NoGradRunsPlainly) {
  Weights w = MakeWeights();
  torch::NoGradGuard no_grad;
  at::Tensor y = checkpoint([](const at::Tensor& x, const at::Tensor& w1,
                               const at::Tensor& w2) { return Mlp(x, w1, w2, 0.0); },
                            w.x, w.w1, w.w2);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(torch::equal(y, Mlp(w.x, w.w1, w.w2, 0.0)));
}

// ---- errors -----------------------------------------------------------------

std::string ErrorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(CheckpointErrors, NoArgumentRequiresGrad) {
  Weights w = MakeWeights();
  at::Tensor x = w.x.detach();
  std::string error =
      ErrorOf([&] { checkpoint([&](const at::Tensor& in) { return in.matmul(w.w1); }, x); });
  EXPECT_THAT(error, HasSubstr("None of the inputs have requires_grad=True"));
}

TEST(CheckpointErrors, ClosedOverParameterIsNotSilentlyDropped) {
  Weights w = MakeWeights();
  at::Tensor y = checkpoint([&](const at::Tensor& in) { return in.matmul(w.w1).tanh(); }, w.x);
  std::string error = ErrorOf([&] { y.sum().backward(); });
  EXPECT_THAT(error, HasSubstr("reads a tensor that requires grad but is not one of its "
                               "tensor arguments"));
}

TEST(CheckpointErrors, SecondBackwardAfterTheInputsWereFreed) {
  Weights w = MakeWeights();
  at::Tensor y = checkpoint([](const at::Tensor& x, const at::Tensor& w1,
                               const at::Tensor& w2) { return Mlp(x, w1, w2, 0.0); },
                            w.x, w.w1, w.w2)
                     .sum();
  y.backward();
  std::string error = ErrorOf([&] { y.backward(); });
  EXPECT_THAT(error, HasSubstr("backward through the graph a second time"));
}

TEST(CheckpointErrors, DoubleBackward) {
  Weights w = MakeWeights();
  at::Tensor y = checkpoint([](const at::Tensor& x, const at::Tensor& w1,
                               const at::Tensor& w2) { return Mlp(x, w1, w2, 0.0); },
                            w.x, w.w1, w.w2);
  std::string error = ErrorOf([&] {
    torch::autograd::grad({y.sum()}, {w.x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
  });
  EXPECT_THAT(error, HasSubstr("create_graph=true"));
}

// ---- apply_activation_checkpointing -------------------------------------------

struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(12, 24));
    fc2 = register_module("fc2", torch::nn::Linear(24, 12));
    drop = register_module("drop", torch::nn::Dropout(0.2));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({12})));
  }
  at::Tensor forward(const at::Tensor& x) { return norm(x + fc2(drop(torch::gelu(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    torch::manual_seed(3);
    in = register_module("in", torch::nn::Linear(6, 12));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) blocks->push_back(Block());
    out = register_module("out", torch::nn::Linear(12, 2));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = in(x);
    for (const auto& block : *blocks) h = module_call::call(block->as<BlockImpl>(), h);
    return out(h);
  }
  torch::nn::Linear in{nullptr}, out{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Net);

std::map<std::string, at::Tensor> TrainStepGrads(const std::shared_ptr<torch::nn::Module>& model,
                                                 const std::function<at::Tensor(at::Tensor)>& run) {
  torch::manual_seed(11);
  at::Tensor x = torch::randn({4, 6});
  run(x).pow(2).mean().backward();
  std::map<std::string, at::Tensor> out;
  for (const auto& p : model->named_parameters()) out[p.key()] = p.value().grad();
  return out;
}

std::vector<std::string> Names(const torch::nn::Module& m) {
  std::vector<std::string> names;
  for (const auto& p : m.named_parameters()) names.push_back(p.key());
  for (const auto& b : m.named_buffers()) names.push_back(b.key());
  return names;
}

TEST(ApplyActivationCheckpointing, ModuleListBlocksThroughFsdpCall) {
  Net reference;
  Net model;
  const auto names_before = Names(*model);
  auto chosen =
      apply_activation_checkpointing(model, module_call::module_type_auto_wrap_policy<BlockImpl>());
  EXPECT_EQ(chosen, (std::vector<std::string>{"blocks.0", "blocks.1", "blocks.2"}));
  EXPECT_TRUE(is_checkpointed(*model->blocks[0]));
  EXPECT_FALSE(is_checkpointed(*model->in));
  EXPECT_FALSE(is_checkpointed(*reference->blocks[0]));
  EXPECT_EQ(Names(*model), names_before) << "no wrapper prefix in any name";
  auto expected = TrainStepGrads(reference.ptr(), [&](at::Tensor x) { return reference(x); });
  auto actual = TrainStepGrads(model.ptr(), [&](at::Tensor x) { return model(x); });
  ASSERT_EQ(actual.size(), expected.size());
  for (const auto& [name, grad] : expected) ExpectBitwiseEqual(actual[name], grad, name);
}

TEST(ApplyActivationCheckpointing, ActivationsAreNotKept) {
  // With every block checkpointed, the graph from the output back to the
  // input holds one recomputing node per block instead of each block's ops.
  Net model;
  apply_activation_checkpointing(model, module_call::module_type_auto_wrap_policy<BlockImpl>());
  at::Tensor y = model(torch::randn({4, 6}));
  int checkpoint_nodes = 0, op_nodes = 0;
  std::vector<torch::autograd::Node*> todo = {y.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  while (!todo.empty()) {
    auto* node = todo.back();
    todo.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    if (node->name().find("CheckpointFunction") != std::string::npos) ++checkpoint_nodes;
    if (node->name() != "torch::autograd::AccumulateGrad") ++op_nodes;
    for (const auto& e : node->next_edges()) todo.push_back(e.function.get());
  }
  EXPECT_EQ(checkpoint_nodes, 3);
  // in and out (AddmmBackward, TBackward each) and the three regions; an
  // uncheckpointed block alone records more than ten.
  EXPECT_LE(op_nodes, 8) << "the blocks' own ops were recorded";
}

TEST(ApplyActivationCheckpointing, SequentialChildrenBySizeThroughFsdpCall) {
  auto make = [] {
    torch::manual_seed(4);
    return torch::nn::Sequential(torch::nn::Linear(6, 32), torch::nn::Tanh(),
                                 torch::nn::Dropout(0.25), torch::nn::Linear(32, 32),
                                 torch::nn::GELU(), torch::nn::Linear(32, 2));
  };
  auto reference = make();
  auto model = make();
  auto chosen =
      apply_activation_checkpointing(model, module_call::size_based_auto_wrap_policy(200));
  EXPECT_EQ(chosen, (std::vector<std::string>{"0", "3"}));
  auto expected =
      TrainStepGrads(reference.ptr(), [&](at::Tensor x) { return reference->forward(x); });
  auto actual =
      TrainStepGrads(model.ptr(), [&](at::Tensor x) { return module_call::call(model, x); });
  for (const auto& [name, grad] : expected) ExpectBitwiseEqual(actual[name], grad, name);
}

TEST(ApplyActivationCheckpointing, CustomPolicyAndNestedModules) {
  // Checkpoint the blocks and, inside them, fc1 (called through module_call::call
  // from a block whose forward does so): regions nest.
  struct OuterImpl : torch::nn::Module {
    OuterImpl() {
      torch::manual_seed(9);
      inner = register_module("inner", torch::nn::Linear(8, 8));
      fc = register_module("fc", torch::nn::Linear(8, 8));
    }
    at::Tensor forward(const at::Tensor& x) {
      return fc(torch::relu(module_call::call(inner, x))) + x;
    }
    torch::nn::Linear inner{nullptr}, fc{nullptr};
  };
  auto reference = std::make_shared<OuterImpl>();
  auto model = torch::nn::Sequential(std::make_shared<OuterImpl>(), torch::nn::Linear(8, 1));
  auto ref_model = torch::nn::Sequential(reference, torch::nn::Linear(8, 1));
  ref_model[1]->as<torch::nn::LinearImpl>()->weight.data().copy_(
      model[1]->as<torch::nn::LinearImpl>()->weight);
  ref_model[1]->as<torch::nn::LinearImpl>()->bias.data().copy_(
      model[1]->as<torch::nn::LinearImpl>()->bias);
  auto chosen = apply_activation_checkpointing(
      model,
      module_call::custom_auto_wrap_policy([](const torch::nn::Module&, const std::string& fqn,
                                              int64_t) { return fqn == "0" || fqn == "0.inner"; }));
  EXPECT_EQ(chosen, (std::vector<std::string>{"0.inner", "0"}));
  torch::manual_seed(2);
  at::Tensor x = torch::randn({3, 8}, torch::requires_grad());
  module_call::call(ref_model, x).sum().backward();
  at::Tensor expected_x = x.grad().clone();
  x.mutable_grad().reset();
  module_call::call(model, x).sum().backward();
  ExpectBitwiseEqual(x.grad(), expected_x, "dx");
  for (const auto& p : ref_model->named_parameters()) {
    ExpectBitwiseEqual(model->named_parameters()[p.key()].grad(), p.value().grad(), p.key());
  }
}

TEST(ApplyActivationCheckpointing, Errors) {
  Net model;
  EXPECT_THAT(
      ErrorOf([&] { apply_activation_checkpointing(model, module_call::AutoWrapPolicy()); }),
      HasSubstr("policy is empty"));
  EXPECT_THAT(ErrorOf([&] {
                apply_activation_checkpointing(std::shared_ptr<torch::nn::Module>(),
                                               module_call::size_based_auto_wrap_policy(1));
              }),
              HasSubstr("model is null"));
}

}  // namespace
}  // namespace activation_checkpointing
