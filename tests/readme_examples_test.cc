// The README's examples, compiled and checked, so the README cannot drift
// from the APIs it shows. Each TEST mirrors one README snippet.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "comm/collectives.h"
#include "comm/process_group.h"
#include "comm/testing/multiprocess.h"
#include "functorch/module/functional_call.h"
#include "functorch/transforms/transforms.h"
#include "state_dict/checkpoint.h"
#include "state_dict/module_state.h"

namespace {

// README: "functional_call and per-sample gradients".
TEST(ReadmeExamples, PerSampleGradients) {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(128, 256), torch::nn::ReLU(),
                              torch::nn::Linear(256, 10));
  std::map<std::string, torch::Tensor> params;
  for (const auto& p : model->named_parameters()) params[p.key()] = p.value().detach();

  // The loss of one example as a function of the parameters.
  auto loss = [&](std::map<std::string, torch::Tensor> p, torch::Tensor x,
                  torch::Tensor y) {
    functorch::NamedTensors named;
    for (const auto& [name, tensor] : p) named.insert(name, tensor);
    auto logits = functorch::functional_call(model, named, x.unsqueeze(0));
    return torch::nn::functional::cross_entropy(logits, y.unsqueeze(0));
  };
  // vmap over the batch (dim 0 of x and y), not over the parameters.
  auto per_sample_grads =
      functorch::vmap(functorch::grad(loss), {std::nullopt, 0, 0});

  torch::Tensor x = torch::randn({8, 128});
  torch::Tensor y = torch::randint(0, 10, {8});
  functorch::Tree grads = per_sample_grads(params, x, y);
  torch::Tensor w = grads["0.weight"];
  ASSERT_EQ(w.sizes(), (std::vector<int64_t>{8, 256, 128}));

  // Example 3 against plain autograd on the module.
  model->zero_grad();
  torch::nn::functional::cross_entropy(model->forward(x[3].unsqueeze(0)),
                                       y[3].unsqueeze(0))
      .backward();
  EXPECT_TRUE(torch::allclose(w[3], model->named_parameters()["0.weight"].grad(),
                              1e-5, 1e-6));
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

// README: "Checkpoints".
TEST(ReadmeExamples, Checkpoint) {
  const auto root = std::filesystem::path(::testing::TempDir()) / "readme_ckpt";
  std::filesystem::remove_all(root);
  torch::nn::Linear model(4, 2);
  const int64_t step = 7;
  ASSERT_TRUE(state_dict::SaveFullCheckpoint(root.string(), step,
                                             state_dict::ModuleStateDict(*model))
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

}  // namespace
