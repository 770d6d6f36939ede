// The hook registry at the module call point: order, argument mapping,
// failure, removal, region runners and the rerunning-region flag.
#include "module_call/forward_hooks.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>

#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "module_call/call.h"

namespace {

using ::testing::ElementsAre;

struct FailingImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor&) { throw std::runtime_error("forward failed"); }
};
TORCH_MODULE(Failing);

// Hooks that log "<name>.<event>".
module_call::ForwardHooks Logging(std::vector<std::string>* log, const std::string& name) {
  module_call::ForwardHooks hooks;
  hooks.pre_forward = [log, name] { log->push_back(name + ".pre"); };
  hooks.post_forward = [log, name](const std::vector<at::Tensor>& outputs, bool known) {
    log->push_back(name + ".post/" + std::to_string(outputs.size()) + (known ? "" : "?"));
  };
  hooks.forward_failed = [log, name] { log->push_back(name + ".failed"); };
  return hooks;
}

TEST(ForwardHooks, RunInRegistrationOrderAroundForward) {
  torch::nn::Linear linear(2, 3);
  std::vector<std::string> log;
  module_call::register_forward_hooks(linear.ptr(), Logging(&log, "a"));
  module_call::register_forward_hooks(linear.ptr(), Logging(&log, "b"));
  at::Tensor y = module_call::call(linear, torch::ones({1, 2}));
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{1, 3}));
  EXPECT_THAT(log, ElementsAre("a.pre", "b.pre", "a.post/1", "b.post/1"));
}

TEST(ForwardHooks, MapTensorArgumentsInOrder) {
  torch::nn::Identity identity;
  module_call::ForwardHooks twice, plus_one;
  twice.map_tensor_argument = [](const at::Tensor& t) { return t * 2; };
  plus_one.map_tensor_argument = [](const at::Tensor& t) { return t + 1; };
  module_call::register_forward_hooks(identity.ptr(), twice);
  module_call::register_forward_hooks(identity.ptr(), plus_one);
  EXPECT_EQ(module_call::call(identity, torch::full({1}, 3.0)).item<double>(), 7.0);
}

// A module returning a pair of tensors and an int.
struct PairImpl : torch::nn::Module {
  std::tuple<at::Tensor, at::Tensor, int> forward(const at::Tensor& x) { return {x, x + 1, 7}; }
};
TORCH_MODULE(Pair);

TEST(ForwardHooks, MapTensorOutputsAfterPostForwardInOrder) {
  torch::nn::Identity identity;
  std::vector<std::string> log;
  module_call::ForwardHooks twice = Logging(&log, "a");
  module_call::ForwardHooks plus_one;
  twice.map_tensor_output = [&log](const at::Tensor& t) {
    log.push_back("a.map");
    return t * 2;
  };
  plus_one.map_tensor_output = [&log](const at::Tensor& t) {
    log.push_back("b.map");
    return t + 1;
  };
  plus_one.post_forward = [&log](const std::vector<at::Tensor>& outputs, bool) {
    // post_forward sees forward's own output, before any mapping.
    log.push_back("b.post=" + std::to_string(outputs.at(0).item<double>()));
  };
  module_call::register_forward_hooks(identity.ptr(), twice);
  module_call::register_forward_hooks(identity.ptr(), plus_one);
  EXPECT_EQ(module_call::call(identity, torch::full({1}, 3.0)).item<double>(), 7.0);
  EXPECT_THAT(log, ElementsAre("a.pre", "a.post/1", "b.post=3.000000", "a.map", "b.map"));

  // Tuples: every tensor mapped, other elements unchanged; through a
  // Sequential child too.
  Pair pair;
  module_call::ForwardHooks to_double;
  to_double.map_tensor_output = [](const at::Tensor& t) { return t.to(torch::kDouble); };
  module_call::register_forward_hooks(pair.ptr(), to_double);
  auto [a, b, n] = module_call::call(pair, torch::ones({1}));
  EXPECT_EQ(a.scalar_type(), torch::kDouble);
  EXPECT_EQ(b.scalar_type(), torch::kDouble);
  EXPECT_EQ(b.item<double>(), 2.0);
  EXPECT_EQ(n, 7);
  torch::nn::Sequential seq{torch::nn::Identity(), torch::nn::Identity()};
  module_call::register_forward_hooks(seq[0], to_double);
  at::Tensor out = module_call::call(seq, torch::ones({1}));
  EXPECT_EQ(out.scalar_type(), torch::kDouble);
}

TEST(ForwardHooks, ForwardFailedForThoseWhosePreForwardRan) {
  Failing failing;
  std::vector<std::string> log;
  module_call::register_forward_hooks(failing.ptr(), Logging(&log, "a"));
  module_call::register_forward_hooks(failing.ptr(), Logging(&log, "b"));
  EXPECT_THROW(module_call::call(failing, torch::ones({1})), std::runtime_error);
  EXPECT_THAT(log, ElementsAre("a.pre", "b.pre", "b.failed", "a.failed"));

  // A throwing pre_forward: only the hooks before it are told.
  torch::nn::Identity identity;
  log.clear();
  module_call::register_forward_hooks(identity.ptr(), Logging(&log, "a"));
  module_call::ForwardHooks refuse;
  refuse.pre_forward = [] { throw std::runtime_error("refused"); };
  refuse.forward_failed = [&log] { log.push_back("refuse.failed"); };
  module_call::register_forward_hooks(identity.ptr(), refuse);
  module_call::register_forward_hooks(identity.ptr(), Logging(&log, "c"));
  EXPECT_THROW(module_call::call(identity, torch::ones({1})), std::runtime_error);
  EXPECT_THAT(log, ElementsAre("a.pre", "a.failed"));
}

TEST(ForwardHooks, RemovedHooksNoLongerRun) {
  torch::nn::Identity identity;
  std::vector<std::string> log;
  module_call::HookHandle a =
      module_call::register_forward_hooks(identity.ptr(), Logging(&log, "a"));
  module_call::register_forward_hooks(identity.ptr(), Logging(&log, "b"));
  a.remove();
  a.remove();  // idempotent
  module_call::call(identity, torch::ones({1}));
  EXPECT_THAT(log, ElementsAre("b.pre", "b.post/1"));
}

TEST(ForwardHooks, HeldWeakly) {
  std::vector<std::string> log;
  {
    torch::nn::Identity gone;
    module_call::register_forward_hooks(gone.ptr(), Logging(&log, "gone"));
  }
  torch::nn::Identity fresh;  // possibly at the same address
  module_call::call(fresh, torch::ones({1}));
  EXPECT_TRUE(log.empty());
}

TEST(ForwardHooks, SequentialChildrenThroughTheCallPoint) {
  torch::nn::Sequential seq{torch::nn::Identity(), torch::nn::Identity()};
  std::vector<std::string> log;
  module_call::register_forward_hooks(seq.ptr(), Logging(&log, "seq"));
  module_call::register_forward_hooks(seq[0], Logging(&log, "0"));
  module_call::register_forward_hooks(seq[1], Logging(&log, "1"));
  module_call::call(seq, torch::ones({1}));
  EXPECT_THAT(log, ElementsAre("seq.pre", "0.pre", "0.post/1", "1.pre", "1.post/1", "seq.post/1"));
}

TEST(RegionRunner, RunsForwardAndTheRerunningFlag) {
  torch::nn::Linear linear(2, 2);
  std::vector<std::string> log;
  module_call::ForwardHooks hooks = Logging(&log, "a");
  hooks.before_rerun = [&log] { log.push_back("a.before_rerun"); };
  hooks.before_rerun_backward = [&log] { log.push_back("a.before_rerun_backward"); };
  module_call::register_forward_hooks(linear.ptr(), hooks);
  EXPECT_FALSE(module_call::has_region_runner(*linear));
  // A region that runs forward twice, as a recomputation would.
  module_call::set_region_runner(
      linear.ptr(), [&log](const std::shared_ptr<torch::nn::Module>& module,
                           module_call::TensorFunction forward, std::vector<at::Tensor> inputs) {
        module_call::RerunningRegion rerunning;
        log.push_back(std::string("region/") + (module_call::in_rerunning_region() ? "in" : "out"));
        forward(inputs);
        module_call::run_before_rerun_hooks(*module);
        module_call::run_before_rerun_backward_hooks(*module);
        return forward(inputs);
      });
  EXPECT_TRUE(module_call::has_region_runner(*linear));
  EXPECT_FALSE(module_call::in_rerunning_region());
  at::Tensor x = torch::ones({1, 2});
  EXPECT_TRUE(torch::equal(module_call::call(linear, x), linear->forward(x)));
  EXPECT_FALSE(module_call::in_rerunning_region());
  EXPECT_THAT(log, ElementsAre("a.pre", "region/in", "a.before_rerun", "a.before_rerun_backward",
                               "a.post/1"));
}

TEST(RegionRunner, ForwardOfMixedArguments) {
  struct ScaleImpl : torch::nn::Module {
    std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, double s, const at::Tensor& y) {
      return {x * s, y + s};
    }
  };
  auto scale = std::make_shared<ScaleImpl>();
  std::vector<int64_t> seen_inputs;
  module_call::set_region_runner(
      scale, [&](const std::shared_ptr<torch::nn::Module>&, module_call::TensorFunction forward,
                 std::vector<at::Tensor> inputs) {
        seen_inputs.push_back(static_cast<int64_t>(inputs.size()));
        return forward(inputs);
      });
  auto [a, b] = module_call::call(scale, torch::ones({1}), 3.0, torch::zeros({1}));
  EXPECT_EQ(a.item<double>(), 3.0);
  EXPECT_EQ(b.item<double>(), 3.0);
  EXPECT_THAT(seen_inputs, ElementsAre(2));
}

}  // namespace
