// The keys under which an FSDP model's and optimizer's state are saved
// together, one definition for every writer and reader of them:
//
//   FULL file (SaveFsdpFullCheckpoint's model.pt, as the trainer writes it):
//     "model.<fqn>"             a parameter or buffer
//     "optim.<fqn>.<entry>"     an optimizer state entry ("exp_avg", "step")
//   DCP directory (SaveFsdpDcpShard, as Python's FSDP / fully_shard save
//   {"model": ..., "optim": ...}):
//     "model.<fqn>"             a parameter or buffer
//     "optim.state.<fqn>.<entry>"
//     "optim.param_groups.<i>.<option>"
//
// Sharded state dicts name an optimizer entry "<fqn>/<entry>"
// (fsdp_optim_state_dict.h). Entry names have no dots or slashes, FQNs have
// dots but no slashes, so every key above splits back at its last dot.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace state_dict {

// The two top-level names: the first element of a DCP key path, and the
// prefix (with a dot) of every FULL and DCP flat key.
inline constexpr char kModelKey[] = "model";
inline constexpr char kOptimKey[] = "optim";
// DCP's names of the optimizer's per-parameter state ("optim.state.") and
// of its parameter groups ("optim.param_groups.").
inline constexpr char kOptimStateKey[] = "state";
inline constexpr char kOptimParamGroupsKey[] = "param_groups";

// "<fqn>" -> "model.<fqn>" (FULL and DCP alike).
std::string ModelStateKey(const std::string& fqn);

// The FULL file key of a sharded state dict's name: "<fqn>" ->
// "model.<fqn>", "<fqn>/<entry>" -> "optim.<fqn>.<entry>".
std::string FullCheckpointKey(const std::string& sharded_name);

// A FULL file key taken apart.
struct FullCheckpointKeyParts {
  enum class Kind {
    kModel,  // "model.<fqn>": fqn
    kOptim,  // "optim.<fqn>.<entry>": fqn, entry
    kOther,  // anything else (the trainer's "trainer.step"): neither
  };
  Kind kind = Kind::kOther;
  std::string fqn;
  std::string entry;
};
// InvalidArgument "malformed key '<key>'" for an "optim." key without an
// entry.
absl::StatusOr<FullCheckpointKeyParts> ParseFullCheckpointKey(const std::string& key);

// "optim.state.", the prefix of DCP's flat keys of optimizer entries, and
// "optim.param_groups.<i>.<option>", DCP's flat key of a group's option.
std::string DcpOptimStatePrefix();
std::string DcpParamGroupOptionKey(int64_t group, const std::string& option);

// DCP's flat key of an optimizer entry: "optim.state.<fqn>.<entry>".
std::string DcpOptimStateKey(const std::string& fqn, const std::string& entry);

// The inverse: false for a key that is not "optim.state.<fqn>.<entry>".
bool ParseDcpOptimStateKey(const std::string& key, std::string* fqn, std::string* entry);

// Splits "<fqn><separator><entry>" at the last separator; false when there
// is none, or the fqn or the entry would be empty.
bool SplitEntryName(const std::string& name, char separator, std::string* fqn, std::string* entry);

}  // namespace state_dict
