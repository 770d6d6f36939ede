// Small models and a training loop shared by the FSDP integration tests:
// the same model, data and seed trained without FSDP in one process (the
// reference) and with FSDP on several ranks.
#pragma once

#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <map>
#include <string>
#include <vector>

#include "fsdp/fully_sharded_data_parallel.h"
#include "module_call/call.h"

namespace fsdp_test {

constexpr int64_t kIn = 6;
constexpr int64_t kHidden = 8;
constexpr int64_t kOut = 3;
constexpr int64_t kGlobalBatch = 8;

// A residual block; its parent calls it through module_call::call.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t width = kHidden) {
    fc1 = register_module("fc1", torch::nn::Linear(width, width));
    fc2 = register_module("fc2", torch::nn::Linear(width, width));
  }
  at::Tensor forward(const at::Tensor& x) { return x + fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

// ModuleList-of-blocks model: the one line per call site is module_call::call.
struct NetImpl : torch::nn::Module {
  explicit NetImpl(int num_blocks = 3) {
    torch::manual_seed(0);
    in = register_module("in", torch::nn::Linear(kIn, kHidden));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < num_blocks; ++i) blocks->push_back(Block());
    out = register_module("out", torch::nn::Linear(kHidden, kOut));
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

inline torch::nn::Sequential MakeSequential() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(kIn, kHidden), torch::nn::Tanh(),
                               torch::nn::Linear(kHidden, kHidden), torch::nn::Tanh(),
                               torch::nn::Linear(kHidden, kOut));
}

// The global batch of step `step` (same on every rank) and this rank's part.
struct Batch {
  at::Tensor x, y;
};
inline Batch GlobalBatch(int step) {
  torch::manual_seed(1000 + step);
  Batch b;
  b.x = torch::randn({kGlobalBatch, kIn});
  b.y = torch::randn({kGlobalBatch, kOut});
  return b;
}
inline Batch LocalBatch(int step, int rank, int world) {
  Batch g = GlobalBatch(step);
  const int64_t n = kGlobalBatch / world;
  return Batch{g.x.narrow(0, rank * n, n), g.y.narrow(0, rank * n, n)};
}

inline at::Tensor Loss(const at::Tensor& out, const at::Tensor& y) {
  return torch::mse_loss(out.to(at::kFloat), y);
}

// name -> detached clone of every parameter.
inline std::map<std::string, at::Tensor> Snapshot(const torch::nn::Module& module) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : module.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

// The full parameters of an FSDP model (every rank must call it).
inline std::map<std::string, at::Tensor> FullSnapshot(fsdp::FullyShardedDataParallel& model) {
  fsdp::SummonOptions options;
  options.writeback = false;
  auto guard = model.summon_full_params(options);
  return Snapshot(*model.module());
}

inline void ExpectClose(const std::map<std::string, at::Tensor>& actual,
                        const std::map<std::string, at::Tensor>& expected, const std::string& what,
                        double rtol = 1e-5, double atol = 1e-6) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (const auto& [name, want] : expected) {
    auto it = actual.find(name);
    ASSERT_NE(it, actual.end()) << what << ": missing " << name;
    ASSERT_EQ(it->second.sizes(), want.sizes()) << what << ": " << name;
    const double err =
        (it->second.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
    const double scale = want.abs().max().item<double>();
    EXPECT_TRUE(torch::allclose(it->second.to(at::kFloat), want, rtol, atol))
        << what << ": " << name << " max abs error " << err << " (max |value| " << scale << ")";
  }
}

}  // namespace fsdp_test
