// The pickle VM under the torch.save and DCP readers (private to formats):
// runs the pickle program of a torch.save archive (data.pkl, its storages
// handed in by the archive reader, formats/torch_save/torch_archive_reader.h) and pickles of plain
// objects (DCP's `.metadata`).
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
//
// Rechecked on LibTorch 2.15 (the wheel this project builds on), because
// 2.x was to replace hand-written loaders where it could: unchanged.
// torch::pickle_load on a file Python 2.15 wrote with
// torch.save(OrderedDict(w=..., b=...)) still yields None for the
// OrderedDict ("Expected GenericDict but got None"), while the same dict
// saved as a plain dict loads. Every nn.Module.state_dict() is an
// OrderedDict, so LibTorch's loader cannot read Python's checkpoints.
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"

namespace formats {

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

// Returns the storage of record "data/<key>" (its bytes as an untyped
// storage of the record's size), or an error naming the record.
using StorageLoader = std::function<absl::StatusOr<at::Storage>(const std::string& record)>;

// Runs an archive's pickle program (`pickle`, its data.pkl), with the
// storages its persistent ids name from `load_storage` (asked once per
// record key), and converts the result to IValues, shared objects kept
// shared. A global outside the subset above, a malformed program, a cycle
// or nesting past 1000 levels is a DataLoss error naming `path` and what
// was wrong.
// Time is linear in the pickle: a dict's keys are hashed as they are set
// (one SETITEMS of N keys used to take N^2/2 comparisons).
absl::StatusOr<UnpickledArchive> UnpickleArchive(const std::string& path, const std::string& pickle,
                                                 StorageLoader load_storage);

// A Python value from a pickle of plain data and of objects of classes a
// caller allows (UnpickleObjects): the metadata of formats such as
// torch.distributed.checkpoint's `.metadata`, which pickles dataclasses.
struct PickledValue {
  // Declared so that clang (tools/fuzz.sh) accepts `entries`: with
  // libstdc++ 12 in C++20, the implicit constructor makes std::pair check a
  // PickledValue that is not complete yet (gcc accepts either).
  PickledValue() = default;
  enum class Kind { kNone, kBool, kInt, kFloat, kStr, kTuple, kList, kDict, kGlobal, kObject };
  Kind kind = Kind::kNone;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                    // kStr (text or bytes); kGlobal, kObject: "module.Class"
  std::vector<PickledValue> items;  // kTuple, kList; kObject: constructor arguments
  std::vector<std::pair<PickledValue, PickledValue>> entries;  // kDict, in order
  std::vector<PickledValue> state;  // kObject: what BUILD set (none or one value)
};

// Runs `pickle` (protocols 0-4) with the same strict VM as the archive
// reader, except that calling a global (REDUCE, NEWOBJ) of `classes` makes a
// kObject of it instead of running anything, and BUILD sets its state. Any
// other global, a persistent id, a cycle, nesting past 1000 levels or a
// result of more than a few values per byte of the pickle (shared objects
// expanded) is a DataLoss error naming `name` and what was wrong.
absl::StatusOr<PickledValue> UnpickleObjects(const std::string& name, const std::string& pickle,
                                             const std::set<std::string>& classes);

}  // namespace formats
