// A first look at the stack: LibTorch, and c10d's Gloo backend on one rank.
// Replaced by //:trainer once the trainer exists.
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>

int main() {
  const auto store_path =
      std::filesystem::temp_directory_path() / "torchfsdp_demo_store";
  std::filesystem::remove(store_path);
  auto store = c10::make_intrusive<c10d::FileStore>(store_path.string(), 1);
  auto options = c10d::ProcessGroupGloo::Options::create();
  options->devices.push_back(
      c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  c10d::ProcessGroupGloo group(store, /*rank=*/0, /*size=*/1, options);

  torch::manual_seed(0);
  torch::nn::Linear model(4, 2);
  auto loss = model(torch::randn({8, 4})).pow(2).mean();
  loss.backward();
  std::vector<at::Tensor> flat_grad = {
      torch::cat({model->weight.grad().flatten(), model->bias.grad()})};
  group.allreduce(flat_grad)->wait();

  std::printf("LibTorch %s, c10d Gloo process group of %d rank(s)\n",
              TORCH_VERSION, group.getSize());
  std::printf("linear 4->2: loss %.4f, all-reduced grad norm %.4f\n",
              loss.item<float>(), flat_grad[0].norm().item<float>());
  std::filesystem::remove(store_path);
  return 0;
}
