// The README's examples, compiled and checked, so the README cannot drift
// from the APIs it shows. Each TEST mirrors one README snippet.
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "comm/collectives.h"
#include "comm/process_group.h"
#include "comm/subgroups.h"
#include "testing/multiprocess.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "functorch/module/functional_call.h"
#include "functorch/transforms/transforms.h"
#include "module_call/call.h"
#include "module_call/wrap_policy.h"
#include "state_dict/checkpoint.h"
#include "state_dict/fsdp/fsdp_optim_state_dict.h"
#include "state_dict/fsdp/fsdp_state_dict.h"
#include "state_dict/module_state.h"

namespace {

// README: "functional_call and per-sample gradients".
TEST(ReadmeExamples, PerSampleGradients) {
  torch::manual_seed(0);
  torch::Tensor x = torch::randn({8, 128});
  torch::Tensor y = torch::randint(0, 10, {8});

  torch::nn::Sequential model(torch::nn::Linear(128, 256), torch::nn::ReLU(),
                              torch::nn::Linear(256, 10));
  // The loss of one example as a function of the parameters.
  auto loss = [&](functorch::NamedTensors params, torch::Tensor x, torch::Tensor y) {
    auto logits = functorch::functional_call(model, params, x.unsqueeze(0));
    return torch::nn::functional::cross_entropy(logits, y.unsqueeze(0));
  };
  // vmap over the batch (dim 0 of x and y), not over the parameters.
  functorch::NamedTensors grads =
      functorch::vmap(functorch::grad(loss), {std::nullopt, 0, 0})(model->named_parameters(), x, y);
  torch::Tensor w = grads["0.weight"];  // [batch, 256, 128]

  ASSERT_EQ(w.sizes(), (std::vector<int64_t>{8, 256, 128}));
  EXPECT_EQ(grads.keys(), model->named_parameters().keys());
  // Example 3 against plain autograd on the module.
  model->zero_grad();
  torch::nn::functional::cross_entropy(model->forward(x[3].unsqueeze(0)), y[3].unsqueeze(0))
      .backward();
  EXPECT_TRUE(torch::allclose(w[3], model->named_parameters()["0.weight"].grad(), 1e-5, 1e-6));
  // The gradient dict back into an update and functional_call, unconverted.
  functorch::NamedTensors params;
  for (const auto& p : model->named_parameters()) params.insert(p.key(), p.value().detach());
  const double lr = 0.1;
  for (auto& p : params) p.value() -= lr * grads[p.key()][3];
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(lr));
  sgd.step();  // with example 3's gradients from above
  EXPECT_TRUE(
      torch::allclose(functorch::functional_call(model, params, x), model->forward(x), 1e-5, 1e-6));
}

// README: "functional_call and per-sample gradients", the Hessian.
TEST(ReadmeExamples, ParameterDictHessian) {
  torch::manual_seed(0);
  torch::Tensor x = torch::randn({5, 3}), t = torch::randn({5, 2});

  torch::nn::Linear net(3, 2);
  auto mse = [&](functorch::NamedTensors p) {
    return torch::mse_loss(functorch::functional_call(net, p, x), t);
  };
  functorch::Tree H = functorch::hessian(mse)(net->named_parameters());
  torch::Tensor H_ww = H["weight"]["weight"];  // [2, 3, 2, 3]

  // Analytically, for L = mean over N*O of (x W^T + b - t)^2:
  // d2L/dW_ij dW_kl = 2/(N O) delta_ik (x^T x)_jl, d2L/db_i db_k = 2/O delta_ik.
  const double n = 5, o = 2;
  torch::Tensor expected_ww =
      torch::einsum("ik,jl->ijkl", {torch::eye(2), x.t().mm(x)}) * (2 / (n * o));
  EXPECT_TRUE(torch::allclose(H_ww, expected_ww, 1e-4, 1e-5));
  EXPECT_TRUE(torch::allclose(H["bias"]["bias"].tensor(), torch::eye(2) * (2 / o), 1e-4, 1e-5));
  torch::Tensor expected_wb = torch::einsum("ik,j->ijk", {torch::eye(2), x.sum(0)}) * (2 / (n * o));
  EXPECT_TRUE(torch::allclose(H["weight"]["bias"].tensor(), expected_wb, 1e-4, 1e-5));
}

// README: "functional_call and per-sample gradients", has_aux and bindings.
TEST(ReadmeExamples, VjpJvpHasAuxAndBindings) {
  torch::manual_seed(0);
  torch::Tensor x = torch::randn({4}), y = torch::randn({4}), ct = torch::randn({4});
  torch::Tensor tx = torch::randn({4});
  auto f = [](torch::Tensor x, torch::Tensor y) { return std::make_pair(x.sin() * y, x.cos()); };
  auto g = [](torch::Tensor x) { return x.exp(); };

  auto [out, vjp_fn, aux] = functorch::vjp(f, x, y, functorch::has_aux);  // f -> (out, aux)
  auto [dx, dy] = vjp_fn(ct);  // one product per primal, typed like it
  auto [f_x, jvp_out] = functorch::jvp(g, std::make_tuple(x), std::make_tuple(tx));

  EXPECT_TRUE(torch::allclose(out, x.sin() * y));
  EXPECT_TRUE(torch::allclose(aux, x.cos()));
  EXPECT_TRUE(torch::allclose(dx, x.cos() * y * ct));
  EXPECT_TRUE(torch::allclose(dy, x.sin() * ct));
  EXPECT_TRUE(torch::allclose(f_x, x.exp()));
  EXPECT_TRUE(torch::allclose(jvp_out, x.exp() * tx));
}

// README: "Process groups and collectives".
TEST(ReadmeExamples, AllGather) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& world) {
    const int64_t n = 3;
    at::Tensor shard = at::full({n}, static_cast<double>(world.rank()));
    at::Tensor full = at::empty({n * world.size()}, shard.options());
    comm::Work gather = comm::all_gather_into_tensor(world, full, shard);
    gather.wait();
    EXPECT_TRUE(full.equal(at::tensor({0., 0., 0., 1., 1., 1.}, full.options())));
  });
}

// README: "Wrapping your own model in FSDP".
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(64, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 64));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    in = register_module("in", torch::nn::Linear(16, 64));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 4; ++i) blocks->push_back(Block());
    out = register_module("out", torch::nn::Linear(64, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = in(x);  // the root's own modules: as usual
    for (const auto& block : *blocks) {
      x = module_call::call(block->as<BlockImpl>(), x);  // was: block->as<BlockImpl>()->forward(x)
    }
    return out(x);
  }
  torch::nn::Linear in{nullptr}, out{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Net);

TEST(ReadmeExamples, WrapOwnModelInFsdp) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& world) {
    torch::manual_seed(0);  // same initial weights on every rank
    fsdp::FullyShardedDataParallel::Options options;
    options.process_group = world;
    options.auto_wrap_policy = module_call::module_type_auto_wrap_policy<BlockImpl>();
    fsdp::FullyShardedDataParallel model(Net(), options);
    EXPECT_EQ(model.fsdp_unit_names(),
              (std::vector<std::string>{"", "blocks.0", "blocks.1", "blocks.2", "blocks.3"}));
    torch::optim::Adam optim(model.parameters(), torch::optim::AdamOptions(1e-2));

    torch::manual_seed(100 + world.rank());  // each rank its own data
    torch::Tensor x = torch::randn({8, 16}), y = torch::randn({8, 10});
    double first = 0, last = 0;
    for (int step = 0; step < 10; ++step) {
      optim.zero_grad();
      torch::Tensor loss = torch::mse_loss(model(x), y);
      loss.backward();
      optim.step();
      (step == 0 ? first : last) = loss.item<double>();
    }
    EXPECT_LT(last, first);
  });
}

// README: "Checkpoints".
TEST(ReadmeExamples, Checkpoint) {
  const auto root = std::filesystem::path(::testing::TempDir()) / "readme_ckpt";
  std::filesystem::remove_all(root);
  torch::nn::Linear model(4, 2);
  const int64_t step = 7;
  ASSERT_TRUE(
      state_dict::SaveFullCheckpoint(root.string(), step, state_dict::ModuleStateDict(*model))
          .ok());

  torch::nn::Linear restored(4, 2);
  auto latest = state_dict::LatestCheckpoint(root.string());
  ASSERT_TRUE(latest.ok()) << latest.status();
  auto state = state_dict::LoadFullStateDict(*latest);
  ASSERT_TRUE(state.ok()) << state.status();
  absl::Status loaded = state_dict::LoadModuleStateDict(*restored, *state, /*strict=*/true);
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_TRUE(restored->weight.equal(model->weight));
  EXPECT_TRUE(restored->bias.equal(model->bias));
}

// README: "Checkpoints", the sharded FSDP model: saved on 2 ranks, loaded
// on 1.
TEST(ReadmeExamples, ShardedFsdpCheckpoint) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& world) {
    const std::string root =
        (std::filesystem::path(::testing::TempDir()) / "readme_sharded").string();
    auto options_for = [](const comm::ProcessGroup& pg) {
      fsdp::FullyShardedDataParallel::Options options;
      options.process_group = pg;
      options.auto_wrap_policy = module_call::module_type_auto_wrap_policy<BlockImpl>();
      options.use_orig_params = true;
      return options;
    };
    torch::manual_seed(0);
    fsdp::FullyShardedDataParallel model(Net(), options_for(world));
    torch::optim::Adam optim(model.parameters(), torch::optim::AdamOptions(1e-2));
    torch::manual_seed(100 + world.rank());
    torch::Tensor x = torch::randn({8, 16}), y = torch::randn({8, 10});
    optim.zero_grad();
    torch::mse_loss(model(x), y).backward();
    optim.step();
    const int64_t step = 1;

    using state_dict::StateDictType;
    auto both = state_dict::MergeShardedStateDicts(
        *state_dict::GetModelStateDict(model, StateDictType::kSharded),
        *state_dict::ShardedOptimStateDict(model, optim));
    ASSERT_TRUE(both.ok()) << both.status();
    absl::Status saved = state_dict::SaveModelCheckpoint(root, step, *both);
    ASSERT_TRUE(saved.ok()) << saved;
    comm::barrier(world).wait();
    if (world.rank() == 0)
      saved = state_dict::CommitShardedCheckpoint(root, step, both->world_size);
    ASSERT_TRUE(saved.ok()) << saved;
    comm::barrier(world).wait();
    auto want = state_dict::GetModelStateDict(model, StateDictType::kFull);
    auto want_optim = state_dict::FullOptimStateDict(model, optim);
    ASSERT_TRUE(want.ok() && want_optim.ok());

    auto one = comm::new_group(world, {0});
    ASSERT_TRUE(one.ok()) << one.status();
    if (one->is_member()) {
      torch::manual_seed(5);  // other initial weights, overwritten by the load
      fsdp::FullyShardedDataParallel restored(Net(), options_for(*one));
      torch::optim::Adam restored_optim(restored.parameters(), torch::optim::AdamOptions(1e-2));
      auto latest = state_dict::LatestCheckpoint(root);
      ASSERT_TRUE(latest.ok()) << latest.status();
      absl::Status loaded =
          state_dict::LoadModelCheckpoint(restored, *latest, StateDictType::kSharded);
      ASSERT_TRUE(loaded.ok()) << loaded;
      loaded = state_dict::LoadShardedOptimCheckpoint(restored, restored_optim, *latest);
      ASSERT_TRUE(loaded.ok()) << loaded;
      auto got = state_dict::GetModelStateDict(restored, StateDictType::kFull);
      ASSERT_TRUE(got.ok());
      for (const auto& item : want->full) {
        EXPECT_TRUE(got->full.find(item.key())->equal(item.value())) << item.key();
      }
      auto got_optim = state_dict::FullOptimStateDict(restored, restored_optim);
      ASSERT_TRUE(got_optim.ok());
      ASSERT_EQ(got_optim->state.size(), want_optim->state.size());
      for (size_t i = 0; i < want_optim->state.size(); ++i) {
        for (const auto& e : want_optim->state[i].second) {
          EXPECT_TRUE(got_optim->state[i].second.find(e.key())->equal(e.value())) << e.key();
        }
      }
    }
    comm::barrier(world).wait();
  });
}

}  // namespace
