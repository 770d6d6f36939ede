#include "functorch/transforms/pytree.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace functorch {
std::pair<std::vector<c10::IValue>, TreeSpec> tree_flatten(const c10::IValue& tree) {
  std::vector<c10::IValue> leaves;
  TreeSpec spec;
  if (tree.isTuple()) {
    spec.kind_ = TreeSpec::Kind::kTuple;
    spec.num_leaves_ = 0;
    for (const auto& element : tree.toTupleRef().elements()) {
      auto sub = tree_flatten(element);
      spec.num_leaves_ += sub.second.num_leaves_;
      spec.children_.push_back(std::move(sub.second));
      for (auto& leaf : sub.first) leaves.push_back(std::move(leaf));
    }
  } else if (tree.isList()) {
    spec.kind_ = TreeSpec::Kind::kList;
    spec.num_leaves_ = 0;
    auto list = tree.toList();
    spec.element_type_ = list.elementType();
    for (size_t i = 0; i < list.size(); ++i) {
      auto sub = tree_flatten(list.get(i));
      spec.num_leaves_ += sub.second.num_leaves_;
      spec.children_.push_back(std::move(sub.second));
      for (auto& leaf : sub.first) leaves.push_back(std::move(leaf));
    }
  } else if (tree.isGenericDict()) {
    spec.kind_ = TreeSpec::Kind::kDict;
    spec.num_leaves_ = 0;
    auto dict = tree.toGenericDict();
    spec.key_type_ = dict.keyType();
    spec.element_type_ = dict.valueType();
    for (const auto& item : dict) {
      spec.keys_.push_back(item.key());
      auto sub = tree_flatten(item.value());
      spec.num_leaves_ += sub.second.num_leaves_;
      spec.children_.push_back(std::move(sub.second));
      for (auto& leaf : sub.first) leaves.push_back(std::move(leaf));
    }
  } else {
    leaves.push_back(tree);
  }
  return {std::move(leaves), std::move(spec)};
}

c10::IValue tree_unflatten(c10::ArrayRef<c10::IValue> leaves, const TreeSpec& spec) {
  TORCH_CHECK(static_cast<int64_t>(leaves.size()) == spec.num_leaves(),
              "tree_unflatten(leaves, spec): expected ", spec.num_leaves(),
              " leaves for structure ", spec.to_string(), ", got ", leaves.size());
  switch (spec.kind_) {
    case TreeSpec::Kind::kLeaf: return leaves[0];
    case TreeSpec::Kind::kTuple: {
      std::vector<c10::IValue> elements;
      size_t pos = 0;
      for (const auto& child : spec.children_) {
        elements.push_back(tree_unflatten(leaves.slice(pos, child.num_leaves()), child));
        pos += child.num_leaves();
      }
      return c10::ivalue::Tuple::create(std::move(elements));
    }
    case TreeSpec::Kind::kList: {
      std::vector<c10::IValue> elements;
      size_t pos = 0;
      bool keeps_type = spec.element_type_ != nullptr;
      for (const auto& child : spec.children_) {
        elements.push_back(tree_unflatten(leaves.slice(pos, child.num_leaves()), child));
        pos += child.num_leaves();
        // A leaf may have been replaced by a value of another type (a tensor
        // by None, say); the list then becomes a List[Any].
        keeps_type = keeps_type && elements.back().type()->isSubtypeOf(*spec.element_type_);
      }
      c10::impl::GenericList list(keeps_type ? spec.element_type_ : c10::AnyType::get());
      for (auto& element : elements) list.push_back(std::move(element));
      return list;
    }
    case TreeSpec::Kind::kDict: {
      std::vector<c10::IValue> values;
      size_t pos = 0;
      bool keeps_type = spec.element_type_ != nullptr;
      for (const auto& child : spec.children_) {
        values.push_back(tree_unflatten(leaves.slice(pos, child.num_leaves()), child));
        pos += child.num_leaves();
        keeps_type = keeps_type && values.back().type()->isSubtypeOf(*spec.element_type_);
      }
      c10::impl::GenericDict dict(spec.key_type_,
                                  keeps_type ? spec.element_type_ : c10::AnyType::get());
      for (size_t i = 0; i < values.size(); ++i) {
        dict.insert(spec.keys_[i], std::move(values[i]));
      }
      return dict;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unknown TreeSpec kind");
}

c10::IValue tree_map(const std::function<c10::IValue(const c10::IValue&)>& fn,
                     const c10::IValue& tree) {
  auto flat = tree_flatten(tree);
  for (auto& leaf : flat.first) leaf = fn(leaf);
  return tree_unflatten(flat.first, flat.second);
}

bool TreeSpec::operator==(const TreeSpec& other) const {
  if (kind_ != other.kind_ || children_.size() != other.children_.size()) {
    return false;
  }
  if (kind_ == Kind::kDict) {
    for (size_t i = 0; i < keys_.size(); ++i) {
      if (keys_[i] != other.keys_[i]) return false;
    }
  }
  for (size_t i = 0; i < children_.size(); ++i) {
    if (children_[i] != other.children_[i]) return false;
  }
  return true;
}

namespace {

std::string key_repr(const c10::IValue& key) {
  std::ostringstream os;
  if (key.isString()) {
    os << "'" << key.toStringRef() << "'";
  } else {
    os << key;
  }
  return os.str();
}

}  // namespace

std::string TreeSpec::to_string() const {
  std::ostringstream os;
  switch (kind_) {
    case Kind::kLeaf: return "*";
    case Kind::kTuple:
      os << "(";
      for (size_t i = 0; i < children_.size(); ++i) {
        os << (i ? ", " : "") << children_[i].to_string();
      }
      os << (children_.size() == 1 ? ",)" : ")");
      break;
    case Kind::kList:
      os << "[";
      for (size_t i = 0; i < children_.size(); ++i) {
        os << (i ? ", " : "") << children_[i].to_string();
      }
      os << "]";
      break;
    case Kind::kDict:
      os << "{";
      for (size_t i = 0; i < children_.size(); ++i) {
        os << (i ? ", " : "") << key_repr(keys_[i]) << ": " << children_[i].to_string();
      }
      os << "}";
      break;
  }
  return os.str();
}

DimTree::DimTree(std::initializer_list<DimTree> elements)
    : kind_(TreeSpec::Kind::kTuple), children_(elements) {}

DimTree DimTree::tuple(std::vector<DimTree> elements) {
  DimTree tree;
  tree.kind_ = TreeSpec::Kind::kTuple;
  tree.children_ = std::move(elements);
  return tree;
}

DimTree DimTree::list(std::vector<DimTree> elements) {
  DimTree tree;
  tree.kind_ = TreeSpec::Kind::kList;
  tree.children_ = std::move(elements);
  return tree;
}

DimTree DimTree::dict(std::vector<std::pair<std::string, DimTree>> items) {
  DimTree tree;
  tree.kind_ = TreeSpec::Kind::kDict;
  for (auto& item : items) {
    tree.keys_.push_back(std::move(item.first));
    tree.children_.push_back(std::move(item.second));
  }
  return tree;
}

std::optional<std::vector<std::optional<int64_t>>> DimTree::broadcast_to(
    const TreeSpec& spec) const {
  std::vector<std::optional<int64_t>> out;
  out.reserve(spec.num_leaves());
  if (!broadcast_into(spec, out)) return std::nullopt;
  return out;
}

bool DimTree::broadcast_into(const TreeSpec& spec, std::vector<std::optional<int64_t>>& out) const {
  if (is_leaf()) {
    out.insert(out.end(), spec.num_leaves(), dim_);
    return true;
  }
  if (spec.is_leaf()) return false;
  const bool sequence_here = kind_ != TreeSpec::Kind::kDict;
  const bool sequence_there = spec.kind() != TreeSpec::Kind::kDict;
  if (sequence_here != sequence_there) return false;
  if (children_.size() != spec.children().size()) return false;
  if (kind_ != TreeSpec::Kind::kDict) {
    for (size_t i = 0; i < children_.size(); ++i) {
      if (!children_[i].broadcast_into(spec.children()[i], out)) return false;
    }
    return true;
  }
  // A dict matches by key, in the order of the tree's own keys: a C++ dict
  // (std::map sorts, OrderedDict does not) need not list them in the same
  // order as the DimTree.
  for (size_t i = 0; i < spec.children().size(); ++i) {
    const auto& key = spec.keys()[i];
    if (!key.isString()) return false;
    auto it = std::find(keys_.begin(), keys_.end(), key.toStringRef());
    if (it == keys_.end()) return false;
    const DimTree& child = children_[it - keys_.begin()];
    if (!child.broadcast_into(spec.children()[i], out)) return false;
  }
  return true;
}

std::string DimTree::structure() const { return render(/*show_dims=*/false); }

std::string DimTree::to_string() const { return render(/*show_dims=*/true); }

std::string DimTree::render(bool show_dims) const {
  std::ostringstream os;
  switch (kind_) {
    case TreeSpec::Kind::kLeaf:
      if (!show_dims) return "*";
      if (dim_.has_value()) {
        os << *dim_;
      } else {
        os << "None";
      }
      break;
    case TreeSpec::Kind::kTuple:
    case TreeSpec::Kind::kList:
      os << (kind_ == TreeSpec::Kind::kTuple ? "(" : "[");
      for (size_t i = 0; i < children_.size(); ++i) {
        os << (i ? ", " : "") << children_[i].render(show_dims);
      }
      if (kind_ == TreeSpec::Kind::kTuple && children_.size() == 1) os << ",";
      os << (kind_ == TreeSpec::Kind::kTuple ? ")" : "]");
      break;
    case TreeSpec::Kind::kDict:
      os << "{";
      for (size_t i = 0; i < children_.size(); ++i) {
        os << (i ? ", " : "") << "'" << keys_[i] << "': " << children_[i].render(show_dims);
      }
      os << "}";
      break;
  }
  return os.str();
}

std::string python_type_name(const c10::IValue& value) {
  if (value.isTensor()) return "Tensor";
  if (value.isNone()) return "NoneType";
  if (value.isDouble()) return "float";
  if (value.isInt()) return "int";
  if (value.isBool()) return "bool";
  if (value.isString()) return "str";
  if (value.isTuple()) return "tuple";
  if (value.isList()) return "list";
  if (value.isGenericDict()) return "dict";
  return value.tagKind();
}

std::string python_type_repr(const c10::IValue& value) {
  if (value.isTensor()) return "<class 'torch.Tensor'>";
  return "<class '" + python_type_name(value) + "'>";
}

}  // namespace functorch
