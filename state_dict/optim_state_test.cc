#include "state_dict/optim_state.h"

#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "formats/testing/python_interop.h"
#include "state_dict/module_state.h"
#include "state_dict/tensor_dict.h"

namespace state_dict {
namespace {

using formats::testing::PythonTorchAvailable;
using formats::testing::RunPython;
using formats::testing::TempDir;

torch::nn::Sequential MakeModel(int seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::ReLU(), torch::nn::Linear(3, 2));
}

void CopyParams(torch::nn::Module& from, torch::nn::Module& to) {
  ASSERT_TRUE(LoadModuleStateDict(to, ModuleStateDict(from)).ok());
}

void TrainStep(torch::nn::Sequential& model, torch::optim::Optimizer& opt, int seed) {
  torch::manual_seed(1000 + seed);
  torch::Tensor x = torch::randn({8, 4});
  opt.zero_grad();
  model->forward(x).pow(2).sum().backward();
  opt.step();
}

void ExpectSameParams(torch::nn::Module& a, torch::nn::Module& b) {
  TensorDict pa = ModuleStateDict(a), pb = ModuleStateDict(b);
  for (const auto& item : pa) {
    EXPECT_TRUE(torch::allclose(item.value(), pb[item.key()], 1e-6, 1e-7)) << item.key();
  }
}

// Export, write in PyTorch's format, read back, import into a fresh
// optimizer over a copy of the model; both then train identically.
template <typename Optim, typename Options>
void ExpectRoundTripContinuesTraining(const Options& options) {
  auto model = MakeModel(1);
  Optim opt(model->parameters(), options);
  for (int s = 0; s < 3; ++s) TrainStep(model, opt, s);

  auto exported = ExportOptimizerState(opt);
  ASSERT_TRUE(exported.ok()) << exported.status();
  const std::string path = TempDir("optim_roundtrip") + "/optim.pt";
  ASSERT_TRUE(SaveIValue(OptimStateDictToIValue(*exported), path).ok());
  auto ivalue = LoadIValue(path);
  ASSERT_TRUE(ivalue.ok()) << ivalue.status();
  auto loaded = OptimStateDictFromIValue(*ivalue);
  ASSERT_TRUE(loaded.ok()) << loaded.status();

  auto resumed_model = MakeModel(2);
  CopyParams(*model, *resumed_model);
  Optim resumed(resumed_model->parameters(), Options(0.5));
  ASSERT_TRUE(ImportOptimizerState(resumed, *loaded).ok());
  for (int s = 3; s < 6; ++s) {
    TrainStep(model, opt, s);
    TrainStep(resumed_model, resumed, s);
  }
  ExpectSameParams(*model, *resumed_model);
}

TEST(OptimStateTest, AdamRoundTrip) {
  ExpectRoundTripContinuesTraining<torch::optim::Adam>(
      torch::optim::AdamOptions(0.01).betas({0.8, 0.95}).weight_decay(0.1));
}

TEST(OptimStateTest, AdamAmsgradRoundTrip) {
  ExpectRoundTripContinuesTraining<torch::optim::Adam>(
      torch::optim::AdamOptions(0.01).amsgrad(true));
}

TEST(OptimStateTest, AdamWRoundTrip) {
  ExpectRoundTripContinuesTraining<torch::optim::AdamW>(torch::optim::AdamWOptions(0.02));
}

TEST(OptimStateTest, SgdMomentumRoundTrip) {
  ExpectRoundTripContinuesTraining<torch::optim::SGD>(
      torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true));
}

TEST(OptimStateTest, LayoutMatchesPython) {
  auto model = MakeModel(1);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
  TrainStep(model, opt, 0);
  auto sd = ExportOptimizerState(opt);
  ASSERT_TRUE(sd.ok());
  ASSERT_EQ(sd->state.size(), 4u);
  EXPECT_EQ(std::get<int64_t>(sd->state[3].first), 3);
  EXPECT_EQ(sd->state[0].second.keys(),
            (std::vector<std::string>{"step", "exp_avg", "exp_avg_sq"}));
  EXPECT_EQ(sd->state[0].second["step"].dim(), 0);
  EXPECT_EQ(sd->state[0].second["step"].item<float>(), 1.0f);
  ASSERT_EQ(sd->param_groups.size(), 1u);
  EXPECT_EQ(sd->param_groups[0].params.size(), 4u);
  EXPECT_TRUE(sd->param_groups[0].options["betas"].isTuple());
}

// The seed's use case: the same parameter names, a different order (here:
// reversed, in two groups). ID-keyed state only loads correctly through
// names.
TEST(OptimStateTest, RekeyMovesStateBetweenDifferentlyOrderedOptimizers) {
  auto a = MakeModel(1);
  torch::optim::Adam opt_a(a->parameters(), torch::optim::AdamOptions(0.01));
  for (int s = 0; s < 2; ++s) TrainStep(a, opt_a, s);

  auto b = MakeModel(2);
  CopyParams(*a, *b);
  std::vector<torch::Tensor> params = b->parameters();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{params[3], params[2]});
  groups.emplace_back(std::vector<torch::Tensor>{params[1], params[0]});
  torch::optim::Adam opt_b(groups, torch::optim::AdamOptions(0.01));

  auto exported = ExportOptimizerState(opt_a);
  ASSERT_TRUE(exported.ok());
  auto names_a = OptimizerParamNames(*a, opt_a);
  auto names_b = OptimizerParamNames(*b, opt_b);
  ASSERT_TRUE(names_a.ok() && names_b.ok());
  EXPECT_EQ(*names_b, (std::vector<std::string>{"2.bias", "2.weight", "0.bias", "0.weight"}));
  auto by_name = RekeyOptimStateDict(*exported, OptimStateKeyType::kParamName, *names_a);
  ASSERT_TRUE(by_name.ok()) << by_name.status();
  EXPECT_EQ(std::get<std::string>(by_name->state[0].first), "0.weight");
  EXPECT_EQ(std::get<std::string>(by_name->param_groups[0].params[3]), "2.bias");
  // Name-keyed dicts survive a file round trip too.
  const std::string path = TempDir("rekey") + "/optim.pt";
  ASSERT_TRUE(SaveIValue(OptimStateDictToIValue(*by_name), path).ok());
  auto reread = OptimStateDictFromIValue(*LoadIValue(path));
  ASSERT_TRUE(reread.ok()) << reread.status();
  EXPECT_EQ(reread->key_type, OptimStateKeyType::kParamName);

  // Into B's IDs: one saved group, B has two — regroup by B's layout.
  auto by_id = RekeyOptimStateDict(*reread, OptimStateKeyType::kParamId, *names_b);
  ASSERT_TRUE(by_id.ok()) << by_id.status();
  OptimStateDict for_b = *by_id;
  for_b.param_groups = {by_id->param_groups[0], by_id->param_groups[0]};
  for_b.param_groups[0].params = {int64_t{0}, int64_t{1}};
  for_b.param_groups[1].params = {int64_t{2}, int64_t{3}};
  EXPECT_FALSE(ImportOptimizerState(opt_b, *by_id).ok());  // group mismatch
  ASSERT_TRUE(ImportOptimizerState(opt_b, for_b).ok());

  TrainStep(a, opt_a, 2);
  TrainStep(b, opt_b, 2);
  ExpectSameParams(*a, *b);

  // And back: B's state keyed by name equals A's.
  auto back = ExportOptimizerState(opt_b);
  auto b_names = RekeyOptimStateDict(*back, OptimStateKeyType::kParamName, *names_b);
  auto a_names =
      RekeyOptimStateDict(*ExportOptimizerState(opt_a), OptimStateKeyType::kParamName, *names_a);
  ASSERT_TRUE(b_names.ok() && a_names.ok());
  for (const auto& entry : a_names->state) {
    bool found = false;
    for (const auto& other : b_names->state) {
      if (other.first != entry.first) continue;
      found = true;
      EXPECT_TRUE(torch::allclose(other.second["exp_avg"], entry.second["exp_avg"]));
    }
    EXPECT_TRUE(found) << ParamKeyString(entry.first);
  }
}

TEST(OptimStateTest, BadStateIsRejectedBeforeAnythingChanges) {
  auto model = MakeModel(1);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
  TrainStep(model, opt, 0);
  auto good = ExportOptimizerState(opt);
  ASSERT_TRUE(good.ok());
  OptimStateDict snapshot = *good;
  for (auto& entry : snapshot.state) {
    for (auto& item : entry.second) item.value() = item.value().clone();
  }

  OptimStateDict bad = snapshot;
  bad.state[2].second["exp_avg"] = torch::zeros({7});
  bad.param_groups[0].options["lr"] = c10::IValue(0.5);
  absl::Status status = ImportOptimizerState(opt, bad);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("state[2]['exp_avg'] has shape [7]"), std::string::npos)
      << status;
  EXPECT_EQ(static_cast<const torch::optim::AdamOptions&>(opt.param_groups()[0].options()).lr(),
            0.01);
  auto after = ExportOptimizerState(opt);
  EXPECT_TRUE(torch::equal(after->state[2].second["exp_avg"], snapshot.state[2].second["exp_avg"]));

  bad = snapshot;
  bad.param_groups[0].options["maximize"] = c10::IValue(true);
  EXPECT_NE(ImportOptimizerState(opt, bad).message().find("'maximize'"), std::string::npos);

  bad = snapshot;
  bad.param_groups[0].options["betas"] = c10::IValue(0.9);
  EXPECT_NE(ImportOptimizerState(opt, bad).message().find("'betas'"), std::string::npos);

  auto names = OptimizerParamNames(*model, opt);
  auto by_name = RekeyOptimStateDict(snapshot, OptimStateKeyType::kParamName, *names);
  EXPECT_NE(ImportOptimizerState(opt, *by_name).message().find("rekey"), std::string::npos);
  std::vector<std::string> renamed = *names;
  renamed[1] = "0.other";
  auto unknown = RekeyOptimStateDict(*by_name, OptimStateKeyType::kParamId, renamed);
  EXPECT_TRUE(absl::IsNotFound(unknown.status()));
  EXPECT_NE(unknown.status().message().find("'0.bias'"), std::string::npos);

  torch::optim::RMSprop rms(model->parameters());
  EXPECT_TRUE(absl::IsUnimplemented(ExportOptimizerState(rms).status()));
}

// C++ Adam state -> file -> Python's torch.optim.Adam.load_state_dict; one
// more step with the same gradients in both gives the same parameters.
TEST(OptimStateTest, PythonAdamLoadsCppState) {
  if (!PythonTorchAvailable()) {
    GTEST_FAIL() << "the Python of the build's torch wheel cannot import torch (run tools/setup.sh "
                    "--with-python)";
  }
  const std::string dir = TempDir("optim_cpp_to_py");
  auto model = MakeModel(1);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01).weight_decay(0.01));
  for (int s = 0; s < 3; ++s) TrainStep(model, opt, s);
  ASSERT_TRUE(SaveTensorDict(ModuleStateDict(*model), dir + "/model.pt").ok());
  ASSERT_TRUE(
      SaveIValue(OptimStateDictToIValue(*ExportOptimizerState(opt)), dir + "/optim.pt").ok());
  opt.zero_grad();
  torch::manual_seed(77);
  model->forward(torch::randn({8, 4})).pow(2).sum().backward();
  TensorDict grads;
  for (const auto& item : model->named_parameters()) grads.insert(item.key(), item.value().grad());
  ASSERT_TRUE(SaveTensorDict(grads, dir + "/grads.pt").ok());
  opt.step();

  std::string output;
  int rc = RunPython(R"(
import sys, torch
d = sys.argv[1]
m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
m.load_state_dict(torch.load(d + "/model.pt"))
opt = torch.optim.Adam(m.parameters(), lr=1.0)
sd = torch.load(d + "/optim.pt")
assert torch.is_tensor(sd["state"][0]["step"]), sd["state"][0]
assert sd["param_groups"][0]["params"] == [0, 1, 2, 3], sd["param_groups"]
opt.load_state_dict(sd)
assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.9, 0.999)
grads = torch.load(d + "/grads.pt")
for name, p in m.named_parameters():
    p.grad = grads[name]
opt.step()
torch.save(dict(m.named_parameters()), d + "/after.pt")
print("ok")
)",
                     "'" + dir + "'", &output);
  ASSERT_EQ(rc, 0) << output;
  auto after = LoadTensorDict(dir + "/after.pt");
  ASSERT_TRUE(after.ok()) << after.status();
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(torch::allclose(after->tensors[item.key()], item.value(), 1e-5, 1e-6))
        << item.key();
  }
}

// Python trains with Adam (amsgrad) and saves optimizer.state_dict(); C++
// imports it and takes the next step exactly as Python did.
TEST(OptimStateTest, CppAdamLoadsPythonState) {
  if (!PythonTorchAvailable()) {
    GTEST_FAIL() << "the Python of the build's torch wheel cannot import torch (run tools/setup.sh "
                    "--with-python)";
  }
  const std::string dir = TempDir("optim_py_to_cpp");
  std::string output;
  int rc = RunPython(R"(
import sys, torch
d = sys.argv[1]
torch.manual_seed(5)
m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
opt = torch.optim.Adam(m.parameters(), lr=0.02, betas=(0.85, 0.99), amsgrad=True)
def step():
    opt.zero_grad()
    m(torch.randn(8, 4)).pow(2).sum().backward()
for _ in range(3):
    step(); opt.step()
torch.save(m.state_dict(), d + "/model.pt")
torch.save(opt.state_dict(), d + "/optim.pt")
step()
torch.save({n: p.grad for n, p in m.named_parameters()}, d + "/grads.pt")
opt.step()
torch.save(m.state_dict(), d + "/after.pt")
print("ok")
)",
                     "'" + dir + "'", &output);
  ASSERT_EQ(rc, 0) << output;
  auto model = MakeModel(9);
  auto sd = LoadTensorDict(dir + "/model.pt");
  ASSERT_TRUE(sd.ok()) << sd.status();
  ASSERT_TRUE(LoadModuleStateDict(*model, sd->tensors).ok());
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1.0));
  auto ivalue = LoadIValue(dir + "/optim.pt");
  ASSERT_TRUE(ivalue.ok()) << ivalue.status();
  auto osd = OptimStateDictFromIValue(*ivalue);
  ASSERT_TRUE(osd.ok()) << osd.status();
  absl::Status status = ImportOptimizerState(opt, *osd);
  ASSERT_TRUE(status.ok()) << status;
  const auto& options =
      static_cast<const torch::optim::AdamOptions&>(opt.param_groups()[0].options());
  EXPECT_EQ(options.lr(), 0.02);
  EXPECT_TRUE(options.amsgrad());
  auto grads = LoadTensorDict(dir + "/grads.pt");
  ASSERT_TRUE(grads.ok());
  for (auto& item : model->named_parameters()) {
    item.value().mutable_grad() = grads->tensors[item.key()].clone();
  }
  opt.step();
  auto after = LoadTensorDict(dir + "/after.pt");
  ASSERT_TRUE(after.ok());
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(torch::allclose(after->tensors[item.key()], item.value(), 1e-5, 1e-6))
        << item.key();
  }
}

}  // namespace
}  // namespace state_dict
