#include "state_dict/fsdp/checkpoint_keys.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace state_dict {
namespace {

// "model." / "optim.".
std::string Prefix(const char* name) { return absl::StrCat(name, "."); }

}  // namespace

std::string ModelStateKey(const std::string& fqn) { return absl::StrCat(kModelKey, ".", fqn); }

std::string FullCheckpointKey(const std::string& sharded_name) {
  const size_t slash = sharded_name.find('/');
  if (slash == std::string::npos) return ModelStateKey(sharded_name);
  return absl::StrCat(kOptimKey, ".", sharded_name.substr(0, slash), ".",
                      sharded_name.substr(slash + 1));
}

absl::StatusOr<FullCheckpointKeyParts> ParseFullCheckpointKey(const std::string& key) {
  FullCheckpointKeyParts parts;
  const std::string model = Prefix(kModelKey);
  const std::string optim = Prefix(kOptimKey);
  if (absl::StartsWith(key, model)) {
    parts.kind = FullCheckpointKeyParts::Kind::kModel;
    parts.fqn = key.substr(model.size());
  } else if (absl::StartsWith(key, optim)) {
    // "optim.<fqn>.<entry>": entry names have no dots, FQNs do.
    const std::string rest = key.substr(optim.size());
    const size_t dot = rest.rfind('.');
    if (dot == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("malformed key '", key, "'"));
    }
    parts.kind = FullCheckpointKeyParts::Kind::kOptim;
    parts.fqn = rest.substr(0, dot);
    parts.entry = rest.substr(dot + 1);
  }
  return parts;
}

std::string DcpOptimStatePrefix() { return absl::StrCat(kOptimKey, ".", kOptimStateKey, "."); }

std::string DcpParamGroupOptionKey(int64_t group, const std::string& option) {
  return absl::StrCat(kOptimKey, ".", kOptimParamGroupsKey, ".", group, ".", option);
}

std::string DcpOptimStateKey(const std::string& fqn, const std::string& entry) {
  return absl::StrCat(DcpOptimStatePrefix(), fqn, ".", entry);
}

bool ParseDcpOptimStateKey(const std::string& key, std::string* fqn, std::string* entry) {
  const std::string prefix = DcpOptimStatePrefix();
  if (!absl::StartsWith(key, prefix)) return false;
  return SplitEntryName(key.substr(prefix.size()), '.', fqn, entry);
}

bool SplitEntryName(const std::string& name, char separator, std::string* fqn, std::string* entry) {
  const size_t at = name.rfind(separator);
  if (at == std::string::npos || at == 0 || at + 1 == name.size()) return false;
  *fqn = name.substr(0, at);
  *entry = name.substr(at + 1);
  return true;
}

}  // namespace state_dict
