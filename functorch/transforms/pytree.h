#pragma once

// Pytrees over c10::IValue: the C++ counterpart of torch.utils._pytree, the
// nested argument structures every transform accepts and returns.
//
// Nodes are tuples, lists (any element type) and dicts (insertion order, as
// Python dicts); everything else -- tensors, None, numbers, strings -- is a
// leaf. As in PyTorch 1.13's pytree, None is a leaf, not an empty node.

#include <ATen/core/ivalue.h>
#include <optional>

#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace functorch {

// The shape of a pytree with its leaves removed.
class TreeSpec {
 public:
  enum class Kind { kLeaf, kTuple, kList, kDict };

  // A single leaf.
  TreeSpec() = default;

  Kind kind() const { return kind_; }
  bool is_leaf() const { return kind_ == Kind::kLeaf; }
  int64_t num_leaves() const { return num_leaves_; }
  const std::vector<TreeSpec>& children() const { return children_; }
  // Dict keys in insertion order (empty unless kind() == kDict).
  const std::vector<c10::IValue>& keys() const { return keys_; }

  // Same structure: kinds, arities and dict keys (container element types are
  // not compared, as Python compares node types, not contents).
  bool operator==(const TreeSpec& other) const;
  bool operator!=(const TreeSpec& other) const { return !(*this == other); }

  // Python-like rendering with `*` for leaves, e.g. `(*, [*, *], {'w': *})`.
  std::string to_string() const;

 private:
  friend std::pair<std::vector<c10::IValue>, TreeSpec> tree_flatten(const c10::IValue& tree);
  friend c10::IValue tree_unflatten(c10::ArrayRef<c10::IValue> leaves, const TreeSpec& spec);

  Kind kind_ = Kind::kLeaf;
  int64_t num_leaves_ = 1;
  std::vector<TreeSpec> children_;
  std::vector<c10::IValue> keys_;
  // Container types of the original node, reused on unflatten so a
  // List[Tensor] comes back as a List[Tensor].
  c10::TypePtr element_type_;
  c10::TypePtr key_type_;
};

// Leaves in depth-first, left-to-right order, and the structure around them.
std::pair<std::vector<c10::IValue>, TreeSpec> tree_flatten(const c10::IValue& tree);

// Inverse of tree_flatten. Throws when leaves.size() != spec.num_leaves().
c10::IValue tree_unflatten(c10::ArrayRef<c10::IValue> leaves, const TreeSpec& spec);

// Applies `fn` to every leaf, keeping the structure.
c10::IValue tree_map(const std::function<c10::IValue(const c10::IValue&)>& fn,
                     const c10::IValue& tree);

// A tree of optional<int64_t>: the in_dims / out_dims of vmap. A single dim
// (or None) broadcasts over a whole subtree, as in Python:
//
//   0                      every tensor mapped over dim 0
//   {0, std::nullopt}      (0, None): first argument mapped, second not
//                          (std::nullopt, the same type, works too)
//   {0, {1, std::nullopt}} nested; a brace list is a tuple
//   DimTree::dict({{"w", 0}, {"b", std::nullopt}})
//                          matched to a dict by key, in any order
//   DimTree::tuple({tree}) the one-element tuple of a DimTree: `{tree}` alone
//                          is the tuple under GCC but a copy of `tree` under
//                          clang (C++ list-initialization from one element
//                          of the same class)
class DimTree {
 public:
  DimTree(int64_t dim) : dim_(dim) {}                 // NOLINT: implicit like Python
  DimTree(int dim) : dim_(dim) {}                     // NOLINT
  DimTree(std::nullopt_t) {}                          // NOLINT
  DimTree(std::optional<int64_t> dim) : dim_(dim) {}  // NOLINT
  // A tuple of sub-trees; `{0}` is the one-element tuple (0,).
  DimTree(std::initializer_list<DimTree> elements);  // NOLINT

  static DimTree tuple(std::vector<DimTree> elements);
  static DimTree list(std::vector<DimTree> elements);
  static DimTree dict(std::vector<std::pair<std::string, DimTree>> items);

  bool is_leaf() const { return kind_ == TreeSpec::Kind::kLeaf; }
  // The dim of a leaf (nullopt for None); only meaningful when is_leaf().
  std::optional<int64_t> dim() const { return dim_; }
  TreeSpec::Kind kind() const { return kind_; }
  const std::vector<DimTree>& children() const { return children_; }

  // One dim per leaf of `spec`, or nullopt when the structures are
  // incompatible (Python's _broadcast_to_and_flatten). A tuple or list here
  // matches a tuple or list there, since a C++ brace list cannot say which.
  std::optional<std::vector<std::optional<int64_t>>> broadcast_to(const TreeSpec& spec) const;

  // The structure of this tree itself (for error messages).
  std::string structure() const;
  // Python-like rendering: `0`, `None`, `(0, None)`, `{'w': 0}`.
  std::string to_string() const;

 private:
  DimTree() = default;
  bool broadcast_into(const TreeSpec& spec, std::vector<std::optional<int64_t>>& out) const;
  // Renders the tree, leaves as their dims or (show_dims=false) as "*".
  std::string render(bool show_dims) const;

  TreeSpec::Kind kind_ = TreeSpec::Kind::kLeaf;
  std::optional<int64_t> dim_;
  std::vector<DimTree> children_;
  std::vector<std::string> keys_;
};

// Python's type(x).__name__ for an IValue leaf or node ("float", "Tensor").
std::string python_type_name(const c10::IValue& value);
// Python's str(type(x)), as error messages print it ("<class 'float'>").
std::string python_type_repr(const c10::IValue& value);

}  // namespace functorch
