// A reader for the pickle programs inside PyTorch's zip checkpoints.
//
// Why not torch::jit::Unpickler / torch::pickle_load: LibTorch 1.13's
// unpickler special-cases `collections.OrderedDict` as "a tensor's backward
// hooks, value never used" and replaces it by None, so the OrderedDict that
// nn.Module.state_dict() returns (and that torch.save writes first) makes the
// following SETITEMS fail; its type-resolver hook is never consulted for that
// global, and the `_metadata` attribute (applied with BUILD) has no place in
// an IValue either. Rewriting the opcode stream would still need a full
// opcode walker, so this is a small, strict pickle VM for the subset that
// torch.save (protocol 2) and torch::pickle_save produce: containers,
// scalars, strings, OrderedDict (+ BUILD of its attributes), tensors rebuilt
// from storages (torch._utils._rebuild_tensor_v2 / _rebuild_parameter) and
// the torch.jit._pickle type-tag helpers. Anything else is an error naming
// the global or opcode, never arbitrary code execution.
#pragma once

#include <string>

#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"

namespace state_dict {
namespace internal {

struct UnpickledArchive {
  // The top-level object. Dicts become c10 GenericDicts (insertion order
  // kept; key type from the keys: str or int), lists GenericLists, tuples
  // Tuples, tensors Tensors sharing the archive's storages.
  c10::IValue value;
  // When the top-level object is an OrderedDict carrying Python attributes
  // (state_dict()'s `_metadata`: {module prefix: {"version": N}}), that
  // attribute dict; None otherwise.
  c10::IValue metadata;
};

// Reads a PyTorch zip archive (torch.save / torch::pickle_save). Errors name
// `path` and what was wrong (truncated zip, unsupported global, bad tensor).
absl::StatusOr<UnpickledArchive> ReadTorchArchive(const std::string& path);

}  // namespace internal
}  // namespace state_dict
