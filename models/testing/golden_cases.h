// Test-only: the golden checkpoints of models/testdata/<case>/ (made by
// tools/golden/llama_golden.py) as the tests of models/ read them.
#pragma once

#include <map>
#include <string>

#include <torch/types.h>

#include "models/llama.h"
#include "models/llama_config.h"

namespace models::testing {

// models/testdata/<name> in the test's runfiles.
std::string CaseDir(const std::string& name);

// Its config.json (a failed read fails the test).
LlamaConfig ConfigOf(const std::string& name);

// Every tensor of every safetensors file of the case, as stored (a name in
// two files fails the test).
std::map<std::string, torch::Tensor> CheckpointTensors(const std::string& name);

// The case's model with the checkpoint's weights, converted to float32;
// a parameter the checkpoint lacks, a tensor the model lacks or a shape
// that differs fails the test.
LlamaForCausalLM LoadModel(const std::string& name);

}  // namespace models::testing
