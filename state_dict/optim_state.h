// Optimizer state dicts for torch::optim (Adam, AdamW, SGD), in the layout of
// Python's Optimizer.state_dict():
//
//   {"state": {0: {"step": tensor(3.), "exp_avg": ..., "exp_avg_sq": ...}, ...},
//    "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), ..., "params": [0, 1]}]}
//
// Parameter IDs follow LibTorch's native ordering: param groups in order,
// parameters in order within each group, numbered from 0 — the same numbering
// Python uses. RekeyOptimStateDict switches the keys between those IDs and
// parameter names (FQNs), as FSDP's OptimStateKeyType does, so that state
// saved from one optimizer loads into another whose parameters have the same
// names in a different order (or, with FSDP, a different wrapping).
//
// A FULL optimizer state dict is a name-keyed OptimStateDict with full
// tensors. FSDP produces one from its flat-parameter state by splitting each
// flat state tensor (exp_avg, ...) into the originals exactly as it splits
// the flat parameter (sharded_tensor.h: OriginalRangesInShard), which also
// gives the SHARDED form (a ShardedTensor per "<fqn>/<state name>").
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "state_dict/tensor_dict.h"

namespace state_dict {

enum class OptimStateKeyType {
  kParamName,  // keys are FQNs ("encoder.weight")
  kParamId,    // keys are LibTorch/Python parameter IDs (0, 1, ...)
};

// An int64_t ID or a std::string name, per OptimStateDict::key_type.
using ParamKey = std::variant<int64_t, std::string>;

std::string ParamKeyString(const ParamKey& key);

struct OptimParamGroup {
  // Hyperparameters under Python's names: Adam/AdamW "lr", "betas" (a
  // 2-tuple of doubles), "eps", "weight_decay", "amsgrad", "maximize"; SGD
  // "lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize".
  torch::OrderedDict<std::string, c10::IValue> options;
  std::vector<ParamKey> params;
};

struct OptimStateDict {
  OptimStateKeyType key_type = OptimStateKeyType::kParamId;
  // Per-parameter state for the parameters that have any, in ID order:
  // "step" (a 0-dim float32 tensor, as Python 1.13 keeps it), "exp_avg",
  // "exp_avg_sq", "max_exp_avg_sq" (amsgrad) for Adam/AdamW;
  // "momentum_buffer" for SGD.
  std::vector<std::pair<ParamKey, TensorDict>> state;
  std::vector<OptimParamGroup> param_groups;
};

// The state of an Adam, AdamW or SGD optimizer, ID-keyed. Tensors share
// storage with the optimizer's (like Python's state_dict()); save or clone
// them before the optimizer steps again. Unimplemented for other optimizers.
absl::StatusOr<OptimStateDict> ExportOptimizerState(const torch::optim::Optimizer& optimizer);

// Python's optimizer.load_state_dict for a plain optimizer (what
// optim_state_dict_to_load returns when no FSDP is involved). `state` must be
// ID-keyed (rekey name-keyed dicts first). Saved groups are matched to the
// optimizer's groups by their parameter IDs; each state tensor is checked
// against its parameter's shape; hyperparameters are checked for type. Any
// problem is returned — naming the group, parameter ID and state entry —
// before the optimizer is changed; on success tensors are copied (cast to the
// parameter's dtype/device, "step" to an integer) and group hyperparameters
// replaced. Python-only options that LibTorch lacks are accepted when they
// are off ("maximize", "capturable", "differentiable" false) and rejected
// otherwise. "fused" and "foreach" (Python's fused=True / foreach=True) are
// accepted either way (a bool or None): they pick how the update is
// computed, not the update or the state, so Python's fused AdamW state
// loads into torch::optim's AdamW and optim/'s fused or foreach one alike,
// and the optimizer keeps its own implementation. Other unknown keys
// (Python 2.x's "decoupled_weight_decay", ...) are ignored.
absl::Status ImportOptimizerState(torch::optim::Optimizer& optimizer, const OptimStateDict& state);

// The FQN of each optimizer parameter in ID order, looked up in `model`'s
// named_parameters(). Error if a parameter is not the model's.
absl::StatusOr<std::vector<std::string>> OptimizerParamNames(
    const torch::nn::Module& model, const torch::optim::Optimizer& optimizer);

// Rekeys `state` (state keys and each group's "params") to `key_type`, using
// `param_names[id]` = FQN of parameter `id` of the optimizer the result is
// for (see OptimizerParamNames; FSDP supplies its own list). Unknown names or
// IDs are errors naming them. Rekeying to the current type is a copy.
absl::StatusOr<OptimStateDict> RekeyOptimStateDict(const OptimStateDict& state,
                                                   OptimStateKeyType key_type,
                                                   const std::vector<std::string>& param_names);

// Python's layout as an IValue (str keys for names, int keys for IDs), ready
// for SaveIValue (tensor_dict.h) and torch.load; and back, accepting what
// Python 1.13 saves ("step" as a tensor or a number, None momentum buffers).
c10::IValue OptimStateDictToIValue(const OptimStateDict& state);
absl::StatusOr<OptimStateDict> OptimStateDictFromIValue(const c10::IValue& value);

}  // namespace state_dict
