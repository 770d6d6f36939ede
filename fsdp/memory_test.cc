// FSDP1's memory in a training step, counted by a CPU allocator that tracks
// live and peak bytes (issue 47 item 7).
//
// The bug this guards against: with use_orig_params the optimizer's
// zero_grad(set_to_none) resets the original parameters' .grad, which are
// views of each unit's flat shard gradient; that flat gradient stayed
// allocated, unseen, until the unit's next reduction replaced it, so one
// whole gradient shard lived through the next forward and most of
// backward, on top of the activations: the step's peak grew by the
// gradient's size (issue 47: ~3.9 bytes per parameter at 408M on an H100,
// world of 1; ~140 MiB per rank on trainer_memory_limit_test's model).
// PyTorch frees it in the root's pre-forward
// (_reset_flat_param_grad_info_if_needed); so does our runtime now.
//
// The model's activations (saved for backward) are 4x its shard, so each
// step peaks at the start of backward. Without optimizer state or a
// previous gradient, step 1 peaks at shard + activations + working set;
// step 2 adds SGD's momentum (one shard's bytes) and nothing else. A stale
// gradient would add a second shard's bytes: hence the bound of 1.5 shards
// on the difference, half a shard from either outcome, while the working
// set (a few gathered units, the allocator's cache, the reduction in
// flight) is the same in both steps and cancels. fully_shard on the same
// model is the reference for the whole peak.
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <ATen/Parallel.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fsdp/fully_shard.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "module_call/call.h"
#include "module_call/wrap_policy.h"
#include "testing/multiprocess.h"

namespace fsdp {
namespace {

// Wraps the default CPU allocator and counts the bytes it has handed out
// and not yet taken back, and their peak since the last ResetPeak().
class CountingAllocator final : public c10::Allocator {
 public:
  CountingAllocator() : base_(c10::GetDefaultCPUAllocator()) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    auto* block = new Block{std::move(inner), n, this};
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_ += static_cast<int64_t>(n);
      peak_ = std::max(peak_, live_);
    }
    return {data, block, &Delete, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t live() {
    std::lock_guard<std::mutex> lock(mu_);
    return live_;
  }
  int64_t peak() {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_;
  }
  void ResetPeak() {
    std::lock_guard<std::mutex> lock(mu_);
    peak_ = live_;
  }

 private:
  struct Block {
    c10::DataPtr inner;  // freed with the block
    size_t n;
    CountingAllocator* owner;
  };
  static void Delete(void* context) {
    auto* block = static_cast<Block*>(context);
    {
      std::lock_guard<std::mutex> lock(block->owner->mu_);
      block->owner->live_ -= static_cast<int64_t>(block->n);
    }
    delete block;
  }

  c10::Allocator* base_;
  std::mutex mu_;
  int64_t live_ = 0;
  int64_t peak_ = 0;
};

// Installed once per process, for good: tensors it allocated may outlive
// any scope (the FSDP1 runtime's freed-storage cache), so it must too.
CountingAllocator& Counter() {
  static auto* counter = [] {
    auto* c = new CountingAllocator();
    c10::SetCPUAllocator(c, /*priority=*/100);
    return c;
  }();
  return *counter;
}

constexpr int64_t kWidth = 256, kLayers = 16, kBatch = 256;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < kLayers; ++i) layers->push_back(torch::nn::Linear(kWidth, kWidth));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& layer : *layers) {
      x = torch::tanh(module_call::call(layer->as<torch::nn::LinearImpl>(), x));
    }
    return x;
  }
  torch::nn::ModuleList layers{nullptr};
};
TORCH_MODULE(Net);

Net MakeNet() {
  torch::manual_seed(0);
  return Net();
}

struct StepPeaks {
  int64_t shard_bytes = 0;     // this rank's parameters
  std::vector<int64_t> peaks;  // per step, above the live bytes before it
};

// Two SGD steps with momentum, zero_grad as the trainer's (every .grad set
// to none); the peak of each step (forward, backward, optimizer step).
StepPeaks Train(const std::vector<at::Tensor>& params, const std::function<at::Tensor()>& loss,
                int64_t live_before) {
  StepPeaks out;
  for (const auto& p : params) out.shard_bytes += p.numel() * p.element_size();
  torch::optim::SGD optimizer(params, torch::optim::SGDOptions(0.01).momentum(0.9));
  for (int step = 0; step < 2; ++step) {
    for (const auto& p : params) p.mutable_grad().reset();
    Counter().ResetPeak();
    loss().backward();
    optimizer.step();
    out.peaks.push_back(Counter().peak() - live_before);
  }
  return out;
}

at::Tensor Input(int rank) {
  torch::manual_seed(100 + rank);
  return torch::randn({kBatch, kWidth});
}

TEST(FsdpMemory, NoStaleGradientAtTheStepsPeak) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    at::set_num_threads(1);
    CountingAllocator& counter = Counter();
    const at::Tensor x = Input(pg.rank());

    // The reference: fully_shard, one unit per layer and the root.
    StepPeaks reference;
    {
      const int64_t live_before = counter.live();
      Net net = MakeNet();
      FullyShardOptions options;
      options.process_group = pg;
      for (const auto& layer : *net->layers) fully_shard(layer, options);
      fully_shard(net.ptr(), options);
      reference = Train(
          net->parameters(), [&] { return module_call::call(net, x).pow(2).mean(); }, live_before);
    }
    const double shard = static_cast<double>(reference.shard_bytes);
    SCOPED_TRACE("shard " + std::to_string(reference.shard_bytes) + " B; fully_shard's peaks " +
                 std::to_string(reference.peaks[0]) + ", " + std::to_string(reference.peaks[1]));

    for (bool use_orig_params : {true, false}) {
      SCOPED_TRACE(use_orig_params ? "use_orig_params" : "flat parameters");
      release_cached_unsharded_memory();
      const int64_t live_before = counter.live();
      FullyShardedDataParallel::Options options;
      options.process_group = pg;
      options.use_orig_params = use_orig_params;
      options.auto_wrap_policy = module_call::module_type_auto_wrap_policy<torch::nn::LinearImpl>();
      FullyShardedDataParallel model(MakeNet(), options);
      const StepPeaks fsdp1 = Train(
          model.parameters(), [&] { return model.forward(x).pow(2).mean(); }, live_before);
      SCOPED_TRACE("FSDP1's peaks " + std::to_string(fsdp1.peaks[0]) + ", " +
                   std::to_string(fsdp1.peaks[1]));
      EXPECT_EQ(fsdp1.shard_bytes, reference.shard_bytes);
      // Step 2 holds SGD's momentum (one shard) more than step 1, and no
      // gradient of step 1 (another shard, the bug).
      EXPECT_LT(fsdp1.peaks[1] - fsdp1.peaks[0], 1.5 * shard);
      EXPECT_GT(fsdp1.peaks[1] - fsdp1.peaks[0], 0.5 * shard);
      // And the whole peak is fully_shard's, within half a shard (FSDP1's
      // freed-storage cache and flat buffers against fully_shard's).
      EXPECT_LT(fsdp1.peaks[1], reference.peaks[1] + 0.5 * shard);
    }
  });
}

}  // namespace
}  // namespace fsdp
