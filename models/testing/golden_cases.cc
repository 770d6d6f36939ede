#include "models/testing/golden_cases.h"

#include <filesystem>
#include <set>

#include <gtest/gtest.h>
#include <torch/utils.h>

#include "formats/safetensors/safetensors.h"
#include "testing/golden_fixture.h"

namespace models::testing {

std::string CaseDir(const std::string& name) {
  return test_data::RunfilePath("models/testdata/" + name);
}

LlamaConfig ConfigOf(const std::string& name) {
  auto config = ReadLlamaConfig(CaseDir(name) + "/config.json");
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

std::map<std::string, torch::Tensor> CheckpointTensors(const std::string& name) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& entry : std::filesystem::directory_iterator(CaseDir(name))) {
    if (entry.path().extension() != ".safetensors") continue;
    auto loaded = formats::LoadSafetensors(entry.path().string());
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    for (const auto& item : loaded->tensors) {
      EXPECT_TRUE(out.emplace(item.key(), item.value()).second) << item.key();
    }
  }
  return out;
}

LlamaForCausalLM LoadModel(const std::string& name) {
  LlamaForCausalLM model(ConfigOf(name));
  std::map<std::string, torch::Tensor> tensors = CheckpointTensors(name);
  torch::NoGradGuard no_grad;
  std::set<std::string> names;
  for (auto& p : model->named_parameters()) {
    names.insert(p.key());
    auto it = tensors.find(p.key());
    if (it == tensors.end()) {
      ADD_FAILURE() << name << ": the checkpoint has no " << p.key();
      continue;
    }
    EXPECT_EQ(p.value().sizes(), it->second.sizes()) << p.key();
    p.value().copy_(it->second);
  }
  for (const auto& [key, tensor] : tensors) {
    EXPECT_TRUE(names.count(key)) << name << ": the model has no parameter " << key;
  }
  return model;
}

}  // namespace models::testing
