#include "state_dict/optim_state.h"

#include <map>
#include <memory>
#include <set>
#include <tuple>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "state_dict/internal/status_macros.h"

namespace state_dict {
namespace {

using torch::optim::Adam;
using torch::optim::AdamOptions;
using torch::optim::AdamParamState;
using torch::optim::AdamW;
using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;
using torch::optim::SGD;
using torch::optim::SGDOptions;
using torch::optim::SGDParamState;

enum class Kind { kAdam, kAdamW, kSGD };

absl::StatusOr<Kind> KindOf(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const Adam*>(&optimizer) != nullptr) return Kind::kAdam;
  if (dynamic_cast<const AdamW*>(&optimizer) != nullptr) return Kind::kAdamW;
  if (dynamic_cast<const SGD*>(&optimizer) != nullptr) return Kind::kSGD;
  return absl::UnimplementedError(
      "optimizer state dicts support torch::optim::Adam, AdamW and SGD");
}

// The key LibTorch's optimizers use for a parameter in state() (2.x: the
// parameter's TensorImpl, no longer its address printed as a string).
void* StateKey(const torch::Tensor& param) { return param.unsafeGetTensorImpl(); }

std::string Shape(const torch::Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.sizes(), ", "), "]");
}

torch::Tensor StepTensor(int64_t step) {
  return torch::tensor(static_cast<float>(step), torch::kFloat);
}

template <typename Options>
void ExportAdamOptions(const Options& o, torch::OrderedDict<std::string, c10::IValue>* out) {
  out->insert("lr", o.lr());
  out->insert("betas",
              c10::ivalue::Tuple::create({std::get<0>(o.betas()), std::get<1>(o.betas())}));
  out->insert("eps", o.eps());
  out->insert("weight_decay", o.weight_decay());
  out->insert("amsgrad", o.amsgrad());
  out->insert("maximize", false);
}

template <typename ParamState>
TensorDict ExportAdamState(const ParamState& s) {
  TensorDict out;
  out.insert("step", StepTensor(s.step()));
  out.insert("exp_avg", s.exp_avg().detach());
  out.insert("exp_avg_sq", s.exp_avg_sq().detach());
  if (s.max_exp_avg_sq().defined()) out.insert("max_exp_avg_sq", s.max_exp_avg_sq().detach());
  return out;
}

// ---- reading hyperparameters ------------------------------------------------

absl::Status OptionError(size_t group, const std::string& key, const c10::IValue& v,
                         absl::string_view expected) {
  return absl::InvalidArgumentError(absl::StrCat("param_groups[", group, "]['", key, "'] is ",
                                                 v.tagKind(), ", expected ", expected));
}

absl::StatusOr<double> GetDouble(const OptimParamGroup& g, size_t index, const std::string& key) {
  const c10::IValue* v = g.options.find(key);
  if (v == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("param_groups[", index, "] lacks '", key, "'"));
  }
  if (v->isDouble()) return v->toDouble();
  if (v->isInt()) return static_cast<double>(v->toInt());
  return OptionError(index, key, *v, "a number");
}

absl::StatusOr<bool> GetBool(const OptimParamGroup& g, size_t index, const std::string& key) {
  const c10::IValue* v = g.options.find(key);
  if (v == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("param_groups[", index, "] lacks '", key, "'"));
  }
  if (v->isBool()) return v->toBool();
  return OptionError(index, key, *v, "a bool");
}

absl::StatusOr<std::tuple<double, double>> GetBetas(const OptimParamGroup& g, size_t index) {
  const c10::IValue* v = g.options.find("betas");
  if (v == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("param_groups[", index, "] lacks 'betas'"));
  }
  std::vector<c10::IValue> items;
  if (v->isTuple()) {
    items = v->toTupleRef().elements().vec();
  } else if (v->isList()) {
    items = v->toList().vec();
  }
  if (items.size() != 2 || !items[0].isDouble() || !items[1].isDouble()) {
    return OptionError(index, "betas", *v, "a pair of floats");
  }
  return std::make_tuple(items[0].toDouble(), items[1].toDouble());
}

// Python-only switches LibTorch does not implement: accepted only when off.
// "fused" and "foreach" (Python's fused=True / foreach=True) choose how the
// update is computed, not what it computes: Python's fused, foreach and
// for-loop steps are the same update to float rounding, with the same state
// ("step", "exp_avg", ...). So a state saved by Python's AdamW(fused=True)
// or (foreach=True) loads into any of ours (torch::optim's for-loop, or
// optim/'s fused and foreach, whose state is torch::optim's), and the
// optimizer keeps computing its own way; they need only be a bool or None.
absl::Status CheckPythonOnlyOptions(const OptimParamGroup& g, size_t index) {
  for (const char* key : {"fused", "foreach"}) {
    const c10::IValue* v = g.options.find(key);
    if (v != nullptr && !v->isNone() && !v->isBool()) {
      return OptionError(index, key, *v, "a bool or None");
    }
  }
  for (const char* key : {"maximize", "capturable", "differentiable"}) {
    const c10::IValue* v = g.options.find(key);
    if (v == nullptr || v->isNone()) continue;
    if (!v->isBool()) return OptionError(index, key, *v, "a bool");
    if (v->toBool()) {
      return absl::UnimplementedError(
          absl::StrCat("param_groups[", index, "]['", key,
                       "'] is True; LibTorch's optimizers "
                       "have no such option, so this state cannot be loaded faithfully"));
    }
  }
  return absl::OkStatus();
}

template <typename Options>
absl::StatusOr<std::unique_ptr<torch::optim::OptimizerOptions>> ReadAdamOptions(
    const torch::optim::OptimizerOptions& current, const OptimParamGroup& g, size_t index) {
  auto o = std::make_unique<Options>(static_cast<const Options&>(current));
  double d;
  STATE_DICT_ASSIGN_OR_RETURN(d, GetDouble(g, index, "lr"));
  o->lr(d);
  std::tuple<double, double> betas;
  STATE_DICT_ASSIGN_OR_RETURN(betas, GetBetas(g, index));
  o->betas(betas);
  STATE_DICT_ASSIGN_OR_RETURN(d, GetDouble(g, index, "eps"));
  o->eps(d);
  STATE_DICT_ASSIGN_OR_RETURN(d, GetDouble(g, index, "weight_decay"));
  o->weight_decay(d);
  bool b;
  STATE_DICT_ASSIGN_OR_RETURN(b, GetBool(g, index, "amsgrad"));
  o->amsgrad(b);
  return std::unique_ptr<torch::optim::OptimizerOptions>(std::move(o));
}

absl::StatusOr<std::unique_ptr<torch::optim::OptimizerOptions>> ReadSgdOptions(
    const torch::optim::OptimizerOptions& current, const OptimParamGroup& g, size_t index) {
  auto o = std::make_unique<SGDOptions>(static_cast<const SGDOptions&>(current));
  double d;
  STATE_DICT_ASSIGN_OR_RETURN(d, GetDouble(g, index, "lr"));
  o->lr(d);
  STATE_DICT_ASSIGN_OR_RETURN(d, GetDouble(g, index, "momentum"));
  o->momentum(d);
  STATE_DICT_ASSIGN_OR_RETURN(d, GetDouble(g, index, "dampening"));
  o->dampening(d);
  STATE_DICT_ASSIGN_OR_RETURN(d, GetDouble(g, index, "weight_decay"));
  o->weight_decay(d);
  bool b;
  STATE_DICT_ASSIGN_OR_RETURN(b, GetBool(g, index, "nesterov"));
  o->nesterov(b);
  return std::unique_ptr<torch::optim::OptimizerOptions>(std::move(o));
}

// ---- reading per-parameter state ----------------------------------------------

// Checks `entry` of parameter `id` against `param` and returns it converted
// to the parameter's dtype and device (a fresh copy).
absl::StatusOr<torch::Tensor> ReadStateTensor(const TensorDict& s, int64_t id,
                                              const std::string& entry,
                                              const torch::Tensor& param) {
  const torch::Tensor* t = s.find(entry);
  if (t == nullptr || !t->defined()) {
    return absl::InvalidArgumentError(absl::StrCat("state[", id, "] lacks '", entry, "'"));
  }
  if (t->sizes() != param.sizes()) {
    return absl::InvalidArgumentError(absl::StrCat("state[", id, "]['", entry, "'] has shape ",
                                                   Shape(*t), ", parameter ", id, " has shape ",
                                                   Shape(param)));
  }
  return t->detach().to(param.options(), /*non_blocking=*/false, /*copy=*/true);
}

absl::StatusOr<int64_t> ReadStep(const TensorDict& s, int64_t id) {
  const torch::Tensor* t = s.find("step");
  if (t == nullptr || !t->defined() || t->numel() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("state[", id, "]['step'] is missing or not a scalar"));
  }
  const double step = t->item<double>();
  if (step < 0 || step != static_cast<double>(static_cast<int64_t>(step))) {
    return absl::InvalidArgumentError(
        absl::StrCat("state[", id, "]['step'] is ", step, ", expected a non-negative integer"));
  }
  return static_cast<int64_t>(step);
}

template <typename ParamState, typename Options>
absl::StatusOr<std::unique_ptr<torch::optim::OptimizerParamState>> ReadAdamState(
    const TensorDict& s, int64_t id, const torch::Tensor& param, const Options& options) {
  auto out = std::make_unique<ParamState>();
  int64_t step;
  STATE_DICT_ASSIGN_OR_RETURN(step, ReadStep(s, id));
  out->step(step);
  torch::Tensor t;
  STATE_DICT_ASSIGN_OR_RETURN(t, ReadStateTensor(s, id, "exp_avg", param));
  out->exp_avg(t);
  STATE_DICT_ASSIGN_OR_RETURN(t, ReadStateTensor(s, id, "exp_avg_sq", param));
  out->exp_avg_sq(t);
  if (options.amsgrad()) {
    STATE_DICT_ASSIGN_OR_RETURN(t, ReadStateTensor(s, id, "max_exp_avg_sq", param));
    out->max_exp_avg_sq(t);
  }
  return std::unique_ptr<torch::optim::OptimizerParamState>(std::move(out));
}

// ---- IValue conversion -----------------------------------------------------

c10::IValue KeyToIValue(const ParamKey& key) {
  if (const int64_t* id = std::get_if<int64_t>(&key)) return c10::IValue(*id);
  return c10::IValue(std::get<std::string>(key));
}

absl::StatusOr<ParamKey> KeyFromIValue(const c10::IValue& v, const std::string& where) {
  if (v.isInt()) return ParamKey(v.toInt());
  if (v.isString()) return ParamKey(v.toStringRef());
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": parameter key is ", v.tagKind(), ", expected int or str"));
}

}  // namespace

std::string ParamKeyString(const ParamKey& key) {
  if (const int64_t* id = std::get_if<int64_t>(&key)) return std::to_string(*id);
  return absl::StrCat("'", std::get<std::string>(key), "'");
}

absl::StatusOr<OptimStateDict> ExportOptimizerState(const torch::optim::Optimizer& optimizer) {
  Kind kind;
  STATE_DICT_ASSIGN_OR_RETURN(kind, KindOf(optimizer));
  OptimStateDict out;
  int64_t id = 0;
  for (const auto& group : optimizer.param_groups()) {
    OptimParamGroup g;
    if (kind == Kind::kAdam) {
      ExportAdamOptions(static_cast<const AdamOptions&>(group.options()), &g.options);
    } else if (kind == Kind::kAdamW) {
      ExportAdamOptions(static_cast<const AdamWOptions&>(group.options()), &g.options);
    } else {
      const auto& o = static_cast<const SGDOptions&>(group.options());
      g.options.insert("lr", o.lr());
      g.options.insert("momentum", o.momentum());
      g.options.insert("dampening", o.dampening());
      g.options.insert("weight_decay", o.weight_decay());
      g.options.insert("nesterov", o.nesterov());
      g.options.insert("maximize", false);
    }
    for (const torch::Tensor& param : group.params()) {
      g.params.emplace_back(id);
      auto it = optimizer.state().find(StateKey(param));
      if (it != optimizer.state().end()) {
        TensorDict s;
        if (kind == Kind::kAdam) {
          s = ExportAdamState(static_cast<const AdamParamState&>(*it->second));
        } else if (kind == Kind::kAdamW) {
          s = ExportAdamState(static_cast<const AdamWParamState&>(*it->second));
        } else {
          const auto& sgd = static_cast<const SGDParamState&>(*it->second);
          if (sgd.momentum_buffer().defined()) {
            s.insert("momentum_buffer", sgd.momentum_buffer().detach());
          }
        }
        if (!s.is_empty()) out.state.emplace_back(id, std::move(s));
      }
      ++id;
    }
    out.param_groups.push_back(std::move(g));
  }
  return out;
}

absl::Status ImportOptimizerState(torch::optim::Optimizer& optimizer, const OptimStateDict& state) {
  Kind kind;
  STATE_DICT_ASSIGN_OR_RETURN(kind, KindOf(optimizer));
  if (state.key_type != OptimStateKeyType::kParamId) {
    return absl::InvalidArgumentError(
        "the optimizer state dict is keyed by parameter name; rekey it with "
        "RekeyOptimStateDict(..., OptimStateKeyType::kParamId, names) first");
  }
  auto& groups = optimizer.param_groups();
  if (state.param_groups.size() != groups.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("loaded state dict has ", state.param_groups.size(),
                     " parameter groups, the optimizer has ", groups.size()));
  }
  // Parameters by native ID, and the set of IDs of each optimizer group.
  std::vector<torch::Tensor> params;
  std::vector<std::set<int64_t>> group_ids(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const torch::Tensor& p : groups[g].params()) {
      group_ids[g].insert(static_cast<int64_t>(params.size()));
      params.push_back(p);
    }
  }
  // Match saved groups to optimizer groups by their parameter IDs, and read
  // every group's hyperparameters — all before changing anything.
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> new_options(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    size_t match = state.param_groups.size();
    for (size_t s = 0; s < state.param_groups.size(); ++s) {
      std::set<int64_t> ids;
      for (const ParamKey& key : state.param_groups[s].params) {
        const int64_t* id = std::get_if<int64_t>(&key);
        if (id == nullptr) {
          return absl::InvalidArgumentError(absl::StrCat("param_groups[", s, "] lists parameter ",
                                                         ParamKeyString(key),
                                                         " by name in an ID-keyed state dict"));
        }
        ids.insert(*id);
      }
      if (ids == group_ids[g] && ids.size() == state.param_groups[s].params.size()) match = s;
    }
    if (match == state.param_groups.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the optimizer's parameter group ", g, " (parameter IDs ",
                       absl::StrJoin(group_ids[g], ", "),
                       ") matches no saved parameter group; loaded state dict contains a "
                       "parameter group that doesn't match the size of optimizer's group"));
    }
    const OptimParamGroup& saved = state.param_groups[match];
    absl::Status status = CheckPythonOnlyOptions(saved, match);
    if (!status.ok()) return status;
    if (kind == Kind::kAdam) {
      STATE_DICT_ASSIGN_OR_RETURN(new_options[g],
                                  ReadAdamOptions<AdamOptions>(groups[g].options(), saved, match));
    } else if (kind == Kind::kAdamW) {
      STATE_DICT_ASSIGN_OR_RETURN(new_options[g],
                                  ReadAdamOptions<AdamWOptions>(groups[g].options(), saved, match));
    } else {
      STATE_DICT_ASSIGN_OR_RETURN(new_options[g],
                                  ReadSgdOptions(groups[g].options(), saved, match));
    }
  }
  std::vector<const torch::optim::OptimizerOptions*> options_of(params.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    for (int64_t id : group_ids[g]) options_of[static_cast<size_t>(id)] = new_options[g].get();
  }
  std::vector<std::pair<void*, std::unique_ptr<torch::optim::OptimizerParamState>>> new_state;
  std::set<int64_t> seen;
  for (const auto& entry : state.state) {
    const int64_t* id_ptr = std::get_if<int64_t>(&entry.first);
    if (id_ptr == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("state key ", ParamKeyString(entry.first),
                                                     " is a name in an ID-keyed state dict"));
    }
    const int64_t id = *id_ptr;
    if (id < 0 || id >= static_cast<int64_t>(params.size())) {
      return absl::InvalidArgumentError(absl::StrCat("state has parameter ID ", id,
                                                     "; the optimizer has IDs 0..",
                                                     static_cast<int64_t>(params.size()) - 1));
    }
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat("state lists parameter ID ", id, " twice"));
    }
    const torch::Tensor& param = params[static_cast<size_t>(id)];
    const auto& options = *options_of[static_cast<size_t>(id)];
    std::unique_ptr<torch::optim::OptimizerParamState> s;
    if (kind == Kind::kAdam) {
      STATE_DICT_ASSIGN_OR_RETURN(
          s, (ReadAdamState<AdamParamState>(entry.second, id, param,
                                            static_cast<const AdamOptions&>(options))));
    } else if (kind == Kind::kAdamW) {
      STATE_DICT_ASSIGN_OR_RETURN(
          s, (ReadAdamState<AdamWParamState>(entry.second, id, param,
                                             static_cast<const AdamWOptions&>(options))));
    } else {
      auto sgd = std::make_unique<SGDParamState>();
      if (entry.second.contains("momentum_buffer")) {
        torch::Tensor t;
        STATE_DICT_ASSIGN_OR_RETURN(t, ReadStateTensor(entry.second, id, "momentum_buffer", param));
        sgd->momentum_buffer(t);
      }
      s = std::move(sgd);
    }
    new_state.emplace_back(StateKey(param), std::move(s));
  }
  // Everything checked: apply.
  for (size_t g = 0; g < groups.size(); ++g) groups[g].set_options(std::move(new_options[g]));
  optimizer.state().clear();
  for (auto& entry : new_state) optimizer.state()[entry.first] = std::move(entry.second);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> OptimizerParamNames(
    const torch::nn::Module& model, const torch::optim::Optimizer& optimizer) {
  std::map<const c10::TensorImpl*, std::string> names;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  std::vector<std::string> out;
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    for (const torch::Tensor& p : optimizer.param_groups()[g].params()) {
      auto it = names.find(p.unsafeGetTensorImpl());
      if (it == names.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter ID ", out.size(), " (group ", g, ", shape ", Shape(p),
                         ") of the optimizer is not a parameter of the model"));
      }
      out.push_back(it->second);
    }
  }
  return out;
}

absl::StatusOr<OptimStateDict> RekeyOptimStateDict(const OptimStateDict& state,
                                                   OptimStateKeyType key_type,
                                                   const std::vector<std::string>& param_names) {
  std::map<std::string, int64_t> ids;
  for (size_t i = 0; i < param_names.size(); ++i) {
    if (!ids.emplace(param_names[i], static_cast<int64_t>(i)).second) {
      return absl::InvalidArgumentError(absl::StrCat("parameter name '", param_names[i],
                                                     "' appears twice in the ID -> name list"));
    }
  }
  auto rekey = [&](const ParamKey& key) -> absl::StatusOr<ParamKey> {
    if (key_type == OptimStateKeyType::kParamName) {
      if (const std::string* name = std::get_if<std::string>(&key)) return ParamKey(*name);
      const int64_t id = std::get<int64_t>(key);
      if (id < 0 || id >= static_cast<int64_t>(param_names.size())) {
        return absl::InvalidArgumentError(absl::StrCat("parameter ID ", id, " has no name (",
                                                       param_names.size(), " parameters)"));
      }
      return ParamKey(param_names[static_cast<size_t>(id)]);
    }
    if (const int64_t* id = std::get_if<int64_t>(&key)) return ParamKey(*id);
    auto it = ids.find(std::get<std::string>(key));
    if (it == ids.end()) {
      return absl::NotFoundError(absl::StrCat("unknown parameter name '",
                                              std::get<std::string>(key),
                                              "': the optimizer has no parameter of that name"));
    }
    return ParamKey(it->second);
  };
  OptimStateDict out;
  out.key_type = key_type;
  for (const auto& entry : state.state) {
    ParamKey key;
    STATE_DICT_ASSIGN_OR_RETURN(key, rekey(entry.first));
    out.state.emplace_back(std::move(key), entry.second);
  }
  if (key_type == OptimStateKeyType::kParamId) {
    std::sort(out.state.begin(), out.state.end(), [](const auto& a, const auto& b) {
      return std::get<int64_t>(a.first) < std::get<int64_t>(b.first);
    });
  }
  for (const OptimParamGroup& group : state.param_groups) {
    OptimParamGroup g;
    g.options = group.options;
    for (const ParamKey& key : group.params) {
      ParamKey k;
      STATE_DICT_ASSIGN_OR_RETURN(k, rekey(key));
      g.params.push_back(std::move(k));
    }
    out.param_groups.push_back(std::move(g));
  }
  return out;
}

c10::IValue OptimStateDictToIValue(const OptimStateDict& state) {
  const bool by_id = state.key_type == OptimStateKeyType::kParamId;
  const c10::TypePtr key_type =
      by_id ? c10::TypePtr(c10::IntType::get()) : c10::TypePtr(c10::StringType::get());
  c10::impl::GenericDict per_param(key_type, c10::AnyType::get());
  for (const auto& entry : state.state) {
    c10::impl::GenericDict tensors(c10::StringType::get(), c10::AnyType::get());
    for (const auto& item : entry.second) tensors.insert(item.key(), item.value());
    per_param.insert(KeyToIValue(entry.first), c10::IValue(tensors));
  }
  c10::impl::GenericList groups(c10::AnyType::get());
  for (const OptimParamGroup& group : state.param_groups) {
    c10::impl::GenericDict g(c10::StringType::get(), c10::AnyType::get());
    for (const auto& item : group.options) g.insert(item.key(), item.value());
    c10::impl::GenericList params(c10::AnyType::get());
    for (const ParamKey& key : group.params) params.push_back(KeyToIValue(key));
    g.insert("params", c10::IValue(params));
    groups.push_back(c10::IValue(g));
  }
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  out.insert("state", c10::IValue(per_param));
  out.insert("param_groups", c10::IValue(groups));
  return c10::IValue(out);
}

absl::StatusOr<OptimStateDict> OptimStateDictFromIValue(const c10::IValue& value) {
  auto bad = [](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("not an optimizer state dict: ", what));
  };
  if (!value.isGenericDict()) return bad("expected a dict");
  const auto dict = value.toGenericDict();
  if (!dict.contains("state") || !dict.contains("param_groups")) {
    return bad("expected keys 'state' and 'param_groups'");
  }
  const c10::IValue& state = dict.at("state");
  const c10::IValue& groups = dict.at("param_groups");
  if (!state.isGenericDict()) return bad("'state' is not a dict");
  if (!groups.isList()) return bad("'param_groups' is not a list");
  OptimStateDict out;
  bool key_type_known = false;
  auto note_key = [&](const ParamKey& key, const std::string& where) -> absl::Status {
    const OptimStateKeyType type = std::holds_alternative<int64_t>(key)
                                       ? OptimStateKeyType::kParamId
                                       : OptimStateKeyType::kParamName;
    if (key_type_known && type != out.key_type) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": mixes parameter IDs and names"));
    }
    out.key_type = type;
    key_type_known = true;
    return absl::OkStatus();
  };
  for (const auto& entry : state.toGenericDict()) {
    ParamKey key;
    STATE_DICT_ASSIGN_OR_RETURN(key, KeyFromIValue(entry.key(), "state"));
    absl::Status status = note_key(key, "state");
    if (!status.ok()) return status;
    if (!entry.value().isGenericDict()) {
      return bad(absl::StrCat("state[", ParamKeyString(key), "] is not a dict"));
    }
    TensorDict tensors;
    for (const auto& item : entry.value().toGenericDict()) {
      if (!item.key().isString()) return bad("state entry names must be strings");
      const std::string& name = item.key().toStringRef();
      const c10::IValue& v = item.value();
      if (v.isNone()) continue;  // e.g. SGD's momentum_buffer without momentum
      if (v.isTensor()) {
        tensors.insert(name, v.toTensor());
      } else if (name == "step" && (v.isInt() || v.isDouble())) {
        tensors.insert(name,
                       torch::tensor(v.isInt() ? static_cast<double>(v.toInt()) : v.toDouble(),
                                     torch::kFloat));
      } else {
        return bad(absl::StrCat("state[", ParamKeyString(key), "]['", name, "'] is ", v.tagKind(),
                                ", expected a tensor"));
      }
    }
    out.state.emplace_back(std::move(key), std::move(tensors));
  }
  for (const c10::IValue& group : groups.toList().vec()) {
    if (!group.isGenericDict()) return bad("a param group is not a dict");
    OptimParamGroup g;
    for (const auto& item : group.toGenericDict()) {
      if (!item.key().isString()) return bad("param group keys must be strings");
      const std::string& name = item.key().toStringRef();
      if (name != "params") {
        g.options.insert(name, item.value());
        continue;
      }
      if (!item.value().isList()) return bad("a group's 'params' is not a list");
      for (const c10::IValue& key_value : item.value().toList().vec()) {
        ParamKey key;
        STATE_DICT_ASSIGN_OR_RETURN(key, KeyFromIValue(key_value, "param_groups"));
        absl::Status status = note_key(key, "param_groups");
        if (!status.ok()) return status;
        g.params.push_back(std::move(key));
      }
    }
    out.param_groups.push_back(std::move(g));
  }
  return out;
}

}  // namespace state_dict
