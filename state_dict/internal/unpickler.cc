#include "state_dict/internal/unpickler.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <caffe2/serialize/inline_container.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "state_dict/internal/crc32c.h"
#include "state_dict/internal/zip_precheck.h"

namespace state_dict {
namespace internal {
namespace {

// Python objects as the VM sees them. Containers are shared (memo + later
// SETITEMS mutate the same object), hence shared_ptr.
struct PyObject;
using PyRef = std::shared_ptr<PyObject>;

struct PyObject {
  enum class Kind { kNone, kBool, kInt, kFloat, kStr, kTuple, kList, kDict,
                    kGlobal, kStorage, kTensor };
  Kind kind = Kind::kNone;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // kStr; kGlobal: "module.name"
  std::vector<PyRef> items;  // kTuple, kList
  std::vector<std::pair<PyRef, PyRef>> entries;  // kDict
  PyRef attributes;  // kDict: state applied by BUILD (OrderedDict attrs)
  at::Storage storage;
  at::ScalarType storage_dtype = at::kFloat;
  at::Tensor tensor;
};

// Containers nested deeper than this are refused. Converting to IValues and
// destroying them recurses once per level, and a crafted pickle can nest a
// million levels (Python's unpickler is iterative and reads them); state
// dicts nest a handful.
constexpr int64_t kMaxNesting = 1000;

PyRef Make(PyObject::Kind kind) {
  auto o = std::make_shared<PyObject>();
  o->kind = kind;
  return o;
}

struct StorageType {
  const char* name;
  at::ScalarType dtype;
};
constexpr StorageType kStorageTypes[] = {
    {"torch.FloatStorage", at::kFloat},       {"torch.DoubleStorage", at::kDouble},
    {"torch.HalfStorage", at::kHalf},         {"torch.BFloat16Storage", at::kBFloat16},
    {"torch.LongStorage", at::kLong},         {"torch.IntStorage", at::kInt},
    {"torch.ShortStorage", at::kShort},       {"torch.CharStorage", at::kChar},
    {"torch.ByteStorage", at::kByte},         {"torch.BoolStorage", at::kBool},
    {"torch.ComplexFloatStorage", at::kComplexFloat},
    {"torch.ComplexDoubleStorage", at::kComplexDouble},
};

// Returns the storage of record "data/<key>" (its bytes as an untyped
// storage of the record's size), or an error naming the record.
using StorageLoader = std::function<absl::StatusOr<at::Storage>(const std::string& record)>;

class Vm {
 public:
  Vm(std::string path, const std::string& pickle, StorageLoader load_storage)
      : path_(std::move(path)), data_(pickle), load_storage_(std::move(load_storage)) {}

  // Every object the VM still references (the stack, the memo, storages),
  // for Dismantle.
  std::vector<PyRef> Roots() const {
    std::vector<PyRef> roots = stack_;
    for (const auto& entry : memo_) roots.push_back(entry.second);
    return roots;
  }

  absl::StatusOr<PyRef> Run() {
    while (true) {
      if (pos_ >= data_.size()) return Error("pickle ends without STOP");
      const size_t at = pos_;
      const uint8_t op = Byte();
      if (op == '.') break;
      absl::Status status = Step(op);
      if (!status.ok()) {
        return absl::Status(status.code(),
                            absl::StrCat(status.message(), " (opcode 0x",
                                         absl::Hex(op), " at byte ", at, ")"));
      }
    }
    if (stack_.size() != 1) return Error("pickle leaves a malformed stack");
    return stack_.back();
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::DataLossError(
        absl::StrCat(path_, ": cannot read PyTorch archive: ", what));
  }

  uint8_t Byte() { return static_cast<uint8_t>(data_[pos_++]); }

  absl::StatusOr<std::string> Bytes(size_t n) {
    if (n > data_.size() - pos_) return Error("pickle is truncated");
    std::string out = data_.substr(pos_, n);
    pos_ += n;
    return out;
  }

  template <typename T>
  absl::StatusOr<T> LittleEndian() {
    auto bytes = Bytes(sizeof(T));
    if (!bytes.ok()) return bytes.status();
    T value;
    std::memcpy(&value, bytes->data(), sizeof(T));  // x86-64: little endian
    return value;
  }

  absl::StatusOr<std::string> Line() {
    size_t end = data_.find('\n', pos_);
    if (end == std::string::npos) return Error("pickle is truncated in GLOBAL");
    std::string out = data_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return out;
  }

  absl::StatusOr<PyRef> Pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back())) {
      return Error("pickle pops an empty stack");
    }
    PyRef top = stack_.back();
    stack_.pop_back();
    return top;
  }

  absl::StatusOr<std::vector<PyRef>> PopToMark() {
    if (marks_.empty()) return Error("pickle has no MARK");
    size_t mark = marks_.back();
    marks_.pop_back();
    std::vector<PyRef> items(stack_.begin() + static_cast<std::ptrdiff_t>(mark), stack_.end());
    stack_.resize(mark);
    return items;
  }

  void Push(PyRef o) { stack_.push_back(std::move(o)); }

  absl::Status PushString(size_t n) {
    auto s = Bytes(n);
    if (!s.ok()) return s.status();
    PyRef o = Make(PyObject::Kind::kStr);
    o->s = *std::move(s);
    Push(o);
    return absl::OkStatus();
  }

  absl::Status PushInt(int64_t v) {
    PyRef o = Make(PyObject::Kind::kInt);
    o->i = v;
    Push(o);
    return absl::OkStatus();
  }

  absl::Status PushTuple(std::vector<PyRef> items) {
    PyRef o = Make(PyObject::Kind::kTuple);
    o->items = std::move(items);
    Push(o);
    return absl::OkStatus();
  }

  absl::Status PopTupleOf(size_t n) {
    std::vector<PyRef> items(n);
    for (size_t k = n; k-- > 0;) {
      auto o = Pop();
      if (!o.ok()) return o.status();
      items[k] = *o;
    }
    return PushTuple(std::move(items));
  }

  absl::Status Memoize(int64_t index) {
    if (stack_.empty()) return Error("memoize on an empty stack");
    memo_[index] = stack_.back();
    return absl::OkStatus();
  }

  absl::Status Recall(int64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) return Error(absl::StrCat("memo ", index, " unset"));
    Push(it->second);
    return absl::OkStatus();
  }

  absl::Status SetItems(const PyRef& dict, const std::vector<PyRef>& kv) {
    if (dict->kind != PyObject::Kind::kDict) return Error("SETITEMS on a non-dict");
    if (kv.size() % 2 != 0) return Error("SETITEMS with an odd item count");
    for (size_t k = 0; k < kv.size(); k += 2) {
      bool replaced = false;
      for (auto& entry : dict->entries) {
        if (SameKey(*entry.first, *kv[k])) {
          entry.second = kv[k + 1];
          replaced = true;
        }
      }
      if (!replaced) dict->entries.emplace_back(kv[k], kv[k + 1]);
    }
    return absl::OkStatus();
  }

  static bool SameKey(const PyObject& a, const PyObject& b) {
    if (a.kind != b.kind) return false;
    if (a.kind == PyObject::Kind::kStr) return a.s == b.s;
    if (a.kind == PyObject::Kind::kInt) return a.i == b.i;
    return false;
  }

  absl::StatusOr<PyRef> LoadStorage(const PyRef& pid) {
    // ('storage', torch.<Type>Storage, key, location, numel)
    if (pid->kind != PyObject::Kind::kTuple || pid->items.size() != 5 ||
        pid->items[0]->s != "storage" ||
        pid->items[1]->kind != PyObject::Kind::kGlobal ||
        pid->items[2]->kind != PyObject::Kind::kStr) {
      return Error("unsupported persistent id (expected a storage)");
    }
    const std::string& type = pid->items[1]->s;
    const std::string& key = pid->items[2]->s;
    const StorageType* found = nullptr;
    for (const StorageType& t : kStorageTypes) {
      if (type == t.name) found = &t;
    }
    if (found == nullptr) return Error(absl::StrCat("unsupported storage type ", type));
    auto cached = storages_.find(key);
    if (cached != storages_.end()) return cached->second;
    PyRef o = Make(PyObject::Kind::kStorage);
    o->storage_dtype = found->dtype;
    auto storage = load_storage_("data/" + key);
    if (!storage.ok()) return storage.status();
    o->storage = *std::move(storage);
    storages_[key] = o;
    return o;
  }

  static absl::StatusOr<std::vector<int64_t>> IntTuple(const PyRef& o) {
    std::vector<int64_t> out;
    if (o->kind != PyObject::Kind::kTuple && o->kind != PyObject::Kind::kList) {
      return absl::InvalidArgumentError("expected a tuple of ints");
    }
    for (const PyRef& item : o->items) {
      if (item->kind != PyObject::Kind::kInt) {
        return absl::InvalidArgumentError("expected a tuple of ints");
      }
      out.push_back(item->i);
    }
    return out;
  }

  absl::StatusOr<PyRef> Call(const PyRef& func, const PyRef& args) {
    if (func->kind != PyObject::Kind::kGlobal) return Error("REDUCE of a non-global");
    if (args->kind != PyObject::Kind::kTuple) return Error("REDUCE without an argument tuple");
    const std::string& name = func->s;
    const std::vector<PyRef>& a = args->items;
    if (name == "collections.OrderedDict") {
      if (!a.empty()) return Error("OrderedDict(...) with arguments is unsupported");
      return Make(PyObject::Kind::kDict);
    }
    if (name == "torch._utils._rebuild_tensor_v2") {
      // (storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata])
      if (a.size() < 4 || a[0]->kind != PyObject::Kind::kStorage ||
          a[1]->kind != PyObject::Kind::kInt) {
        return Error("malformed _rebuild_tensor_v2 arguments");
      }
      auto sizes = IntTuple(a[2]);
      auto strides = IntTuple(a[3]);
      if (!sizes.ok() || !strides.ok() || sizes->size() != strides->size()) {
        return Error("malformed tensor size/stride");
      }
      const at::Storage& storage = a[0]->storage;
      const int64_t element = static_cast<int64_t>(c10::elementSize(a[0]->storage_dtype));
      // Index of the last element addressed; sizes and strides come from the
      // file, so every step is checked for overflow before it is trusted.
      int64_t extent = a[1]->i;
      bool empty = false;
      bool overflow = false;
      for (size_t d = 0; d < sizes->size(); ++d) {
        if ((*sizes)[d] < 0 || (*strides)[d] < 0) return Error("negative tensor size/stride");
        if ((*sizes)[d] == 0) empty = true;
        int64_t step = 0;
        overflow |= __builtin_mul_overflow((*sizes)[d] - 1, (*strides)[d], &step) ||
                    __builtin_add_overflow(extent, step, &extent);
      }
      int64_t end_byte = 0;
      overflow |= __builtin_add_overflow(extent, int64_t{1}, &end_byte) ||
                  __builtin_mul_overflow(end_byte, element, &end_byte);
      if (!empty && (a[1]->i < 0 || overflow ||
                     end_byte > static_cast<int64_t>(storage.nbytes()))) {
        return Error(absl::StrCat("tensor of size [", absl::StrJoin(*sizes, ","),
                                  "] runs past its storage of ", storage.nbytes(),
                                  " bytes (truncated or corrupted archive)"));
      }
      PyRef o = Make(PyObject::Kind::kTensor);
      o->tensor = at::empty({0}, at::TensorOptions().dtype(a[0]->storage_dtype))
                      .set_(storage, a[1]->i, *sizes, *strides);
      if (a.size() > 4 && a[4]->kind == PyObject::Kind::kBool && a[4]->b) {
        o->tensor.set_requires_grad(true);
      }
      return o;
    }
    if (name == "torch._utils._rebuild_parameter") {
      // (data, requires_grad, backward_hooks)
      if (a.empty() || a[0]->kind != PyObject::Kind::kTensor) {
        return Error("malformed _rebuild_parameter arguments");
      }
      return a[0];
    }
    if (name == "torch.jit._pickle.restore_type_tag") {
      if (a.empty()) return Error("malformed restore_type_tag arguments");
      return a[0];
    }
    if (name == "torch.jit._pickle.build_intlist" ||
        name == "torch.jit._pickle.build_doublelist" ||
        name == "torch.jit._pickle.build_boollist" ||
        name == "torch.jit._pickle.build_tensorlist") {
      if (a.size() != 1) return Error(absl::StrCat("malformed ", name, " arguments"));
      return a[0];
    }
    return Error(absl::StrCat("unsupported global ", name,
                              " (only tensors, containers and scalars are read)"));
  }

  absl::Status Step(uint8_t op) {
    using K = PyObject::Kind;
    switch (op) {
      case 0x80:  // PROTO
        if (pos_ >= data_.size()) return Error("pickle is truncated");
        if (Byte() > 4) return Error("pickle protocol newer than 4");
        return absl::OkStatus();
      case 0x95: {  // FRAME
        auto n = LittleEndian<uint64_t>();
        return n.ok() ? absl::OkStatus() : n.status();
      }
      case '(':
        marks_.push_back(stack_.size());
        return absl::OkStatus();
      case '0': {
        auto o = Pop();
        return o.ok() ? absl::OkStatus() : o.status();
      }
      case '1': {
        auto items = PopToMark();
        return items.ok() ? absl::OkStatus() : items.status();
      }
      case '2':
        if (stack_.empty()) return Error("DUP on an empty stack");
        Push(stack_.back());
        return absl::OkStatus();
      case 'N':
        Push(Make(K::kNone));
        return absl::OkStatus();
      case 0x88:
      case 0x89: {
        PyRef o = Make(K::kBool);
        o->b = op == 0x88;
        Push(o);
        return absl::OkStatus();
      }
      case 'J': {
        auto v = LittleEndian<int32_t>();
        return v.ok() ? PushInt(*v) : v.status();
      }
      case 'K': {
        auto v = LittleEndian<uint8_t>();
        return v.ok() ? PushInt(*v) : v.status();
      }
      case 'M': {
        auto v = LittleEndian<uint16_t>();
        return v.ok() ? PushInt(*v) : v.status();
      }
      case 0x8a: {  // LONG1: little-endian two's complement of n bytes
        auto n = LittleEndian<uint8_t>();
        if (!n.ok()) return n.status();
        if (*n > 8) return Error("integer wider than 64 bits");
        auto bytes = Bytes(*n);
        if (!bytes.ok()) return bytes.status();
        uint64_t u = 0;
        for (size_t k = 0; k < *n; ++k) {
          u |= static_cast<uint64_t>(static_cast<uint8_t>((*bytes)[k])) << (8 * k);
        }
        if (*n > 0 && *n < 8 && (static_cast<uint8_t>((*bytes)[*n - 1]) & 0x80)) {
          u |= ~uint64_t{0} << (8 * *n);  // sign extend
        }
        return PushInt(static_cast<int64_t>(u));
      }
      case 'G': {  // BINFLOAT, big endian
        auto bytes = Bytes(8);
        if (!bytes.ok()) return bytes.status();
        uint64_t u = 0;
        for (char c : *bytes) u = (u << 8) | static_cast<uint8_t>(c);
        PyRef o = Make(K::kFloat);
        std::memcpy(&o->f, &u, sizeof(double));
        Push(o);
        return absl::OkStatus();
      }
      case 'X':
      case 'B':
      case 'T': {
        auto n = LittleEndian<uint32_t>();
        return n.ok() ? PushString(*n) : n.status();
      }
      case 0x8c:
      case 'C':
      case 'U': {
        auto n = LittleEndian<uint8_t>();
        return n.ok() ? PushString(*n) : n.status();
      }
      case 0x8d:
      case 0x8e: {
        auto n = LittleEndian<uint64_t>();
        return n.ok() ? PushString(*n) : n.status();
      }
      case ')':
        return PushTuple({});
      case 't': {
        auto items = PopToMark();
        return items.ok() ? PushTuple(*std::move(items)) : items.status();
      }
      case 0x85:
        return PopTupleOf(1);
      case 0x86:
        return PopTupleOf(2);
      case 0x87:
        return PopTupleOf(3);
      case ']':
        Push(Make(K::kList));
        return absl::OkStatus();
      case 'l': {
        auto items = PopToMark();
        if (!items.ok()) return items.status();
        PyRef o = Make(K::kList);
        o->items = *std::move(items);
        Push(o);
        return absl::OkStatus();
      }
      case 'a': {
        auto item = Pop();
        if (!item.ok()) return item.status();
        if (stack_.empty() || stack_.back()->kind != K::kList) return Error("APPEND to a non-list");
        stack_.back()->items.push_back(*item);
        return absl::OkStatus();
      }
      case 'e': {
        auto items = PopToMark();
        if (!items.ok()) return items.status();
        if (stack_.empty() || stack_.back()->kind != K::kList) return Error("APPENDS to a non-list");
        for (PyRef& item : *items) stack_.back()->items.push_back(item);
        return absl::OkStatus();
      }
      case '}':
        Push(Make(K::kDict));
        return absl::OkStatus();
      case 'd': {
        auto items = PopToMark();
        if (!items.ok()) return items.status();
        PyRef o = Make(K::kDict);
        absl::Status status = SetItems(o, *items);
        if (!status.ok()) return status;
        Push(o);
        return absl::OkStatus();
      }
      case 's': {
        auto value = Pop();
        if (!value.ok()) return value.status();
        auto key = Pop();
        if (!key.ok()) return key.status();
        if (stack_.empty()) return Error("SETITEM without a dict");
        return SetItems(stack_.back(), {*key, *value});
      }
      case 'u': {
        auto items = PopToMark();
        if (!items.ok()) return items.status();
        if (stack_.empty()) return Error("SETITEMS without a dict");
        return SetItems(stack_.back(), *items);
      }
      case 'c': {
        auto module = Line();
        if (!module.ok()) return module.status();
        auto name = Line();
        if (!name.ok()) return name.status();
        PyRef o = Make(K::kGlobal);
        o->s = absl::StrCat(*module, ".", *name);
        Push(o);
        return absl::OkStatus();
      }
      case 0x93: {  // STACK_GLOBAL
        auto name = Pop();
        if (!name.ok()) return name.status();
        auto module = Pop();
        if (!module.ok()) return module.status();
        PyRef o = Make(K::kGlobal);
        o->s = absl::StrCat((*module)->s, ".", (*name)->s);
        Push(o);
        return absl::OkStatus();
      }
      case 'q': {
        auto n = LittleEndian<uint8_t>();
        return n.ok() ? Memoize(*n) : n.status();
      }
      case 'r': {
        auto n = LittleEndian<uint32_t>();
        return n.ok() ? Memoize(*n) : n.status();
      }
      case 0x94:
        return Memoize(static_cast<int64_t>(memo_.size()));
      case 'h': {
        auto n = LittleEndian<uint8_t>();
        return n.ok() ? Recall(*n) : n.status();
      }
      case 'j': {
        auto n = LittleEndian<uint32_t>();
        return n.ok() ? Recall(*n) : n.status();
      }
      case 'R': {
        auto args = Pop();
        if (!args.ok()) return args.status();
        auto func = Pop();
        if (!func.ok()) return func.status();
        auto result = Call(*func, *args);
        if (!result.ok()) return result.status();
        Push(*result);
        return absl::OkStatus();
      }
      case 'b': {  // BUILD: obj.__dict__.update(state)
        auto state = Pop();
        if (!state.ok()) return state.status();
        if (stack_.empty()) return Error("BUILD without an object");
        PyRef& obj = stack_.back();
        if (obj->kind == K::kDict && (*state)->kind == K::kDict) {
          obj->attributes = *state;
          return absl::OkStatus();
        }
        if (obj->kind == K::kTensor) return absl::OkStatus();  // Parameter state
        return Error("BUILD on an unsupported object");
      }
      case 'Q': {
        auto pid = Pop();
        if (!pid.ok()) return pid.status();
        auto storage = LoadStorage(*pid);
        if (!storage.ok()) return storage.status();
        Push(*storage);
        return absl::OkStatus();
      }
      default:
        return Error("unsupported pickle opcode");
    }
  }

  std::string path_;
  const std::string& data_;
  StorageLoader load_storage_;
  size_t pos_ = 0;
  std::vector<PyRef> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<int64_t, PyRef> memo_;
  std::map<std::string, PyRef> storages_;
};

bool IsContainer(const PyObject& o) {
  return o.kind == PyObject::Kind::kTuple || o.kind == PyObject::Kind::kList ||
         o.kind == PyObject::Kind::kDict;
}

size_t ChildCount(const PyObject& o) {
  return o.kind == PyObject::Kind::kDict ? 2 * o.entries.size() : o.items.size();
}

const PyRef& ChildAt(const PyObject& o, size_t i) {
  if (o.kind == PyObject::Kind::kDict) {
    return i % 2 == 0 ? o.entries[i / 2].first : o.entries[i / 2].second;
  }
  return o.items[i];
}

// How deeply containers nest under `root` (a scalar 0, [] 1, [[]] 2), or -1
// when a container contains itself (the memo lets a pickle build cycles).
// Iterative, with each object visited once: a hostile pickle can nest
// millions of levels or share one object 2^60 ways.
int64_t NestingDepth(const PyObject* root) {
  struct Frame {
    const PyObject* object;
    size_t next_child;
    int64_t deepest_child;
  };
  std::unordered_map<const PyObject*, int64_t> done;
  std::unordered_set<const PyObject*> on_path;
  std::vector<Frame> path{{root, 0, 0}};
  on_path.insert(root);
  int64_t depth = 0;
  while (!path.empty()) {
    Frame& frame = path.back();
    if (frame.next_child < ChildCount(*frame.object)) {
      const PyObject* child = ChildAt(*frame.object, frame.next_child++).get();
      auto finished = done.find(child);
      if (finished != done.end()) {
        frame.deepest_child = std::max(frame.deepest_child, finished->second);
      } else if (!on_path.insert(child).second) {
        return -1;
      } else {
        path.push_back(Frame{child, 0, 0});  // invalidates `frame`
      }
      continue;
    }
    depth = (IsContainer(*frame.object) ? 1 : 0) + frame.deepest_child;
    done[frame.object] = depth;
    on_path.erase(frame.object);
    path.pop_back();
    if (!path.empty()) path.back().deepest_child = std::max(path.back().deepest_child, depth);
  }
  return depth;
}

// Empties every container reachable from `roots` without recursion, so that
// dropping the last reference frees each object on its own: a deeply nested
// pickle would otherwise overflow the stack in shared_ptr's destructor chain,
// and a self-containing one would never be freed.
void Dismantle(std::vector<PyRef> roots) {
  std::unordered_set<const PyObject*> seen;
  std::vector<PyRef> all;
  while (!roots.empty()) {
    PyRef o = std::move(roots.back());
    roots.pop_back();
    if (o == nullptr || !seen.insert(o.get()).second) continue;
    for (size_t i = 0; i < ChildCount(*o); ++i) roots.push_back(ChildAt(*o, i));
    if (o->attributes != nullptr) roots.push_back(o->attributes);
    all.push_back(std::move(o));
  }
  for (const PyRef& o : all) {
    o->items.clear();
    o->entries.clear();
    o->attributes.reset();
  }
}

// Converts the VM's objects to IValues. `converted` keeps an object shared
// between several places shared in the result (as Python's torch.load does),
// which also keeps conversion linear in the pickle's size. The caller bounds
// the nesting (NestingDepth) first, so this recursion, and the IValue's
// destructor later, stay shallow.
absl::StatusOr<c10::IValue> ToIValue(
    const std::string& path, const PyRef& o,
    std::unordered_map<const PyObject*, c10::IValue>& converted) {
  using K = PyObject::Kind;
  if (IsContainer(*o)) {
    auto found = converted.find(o.get());
    if (found != converted.end()) return found->second;
  }
  c10::IValue out;
  switch (o->kind) {
    case K::kNone:
      return c10::IValue();
    case K::kBool:
      return c10::IValue(o->b);
    case K::kInt:
      return c10::IValue(o->i);
    case K::kFloat:
      return c10::IValue(o->f);
    case K::kStr:
      return c10::IValue(o->s);
    case K::kTensor:
      return c10::IValue(o->tensor);
    case K::kTuple: {
      std::vector<c10::IValue> items;
      for (const PyRef& item : o->items) {
        auto v = ToIValue(path, item, converted);
        if (!v.ok()) return v.status();
        items.push_back(*std::move(v));
      }
      out = c10::IValue(c10::ivalue::Tuple::create(std::move(items)));
      break;
    }
    case K::kList: {
      c10::impl::GenericList list(c10::AnyType::get());
      for (const PyRef& item : o->items) {
        auto v = ToIValue(path, item, converted);
        if (!v.ok()) return v.status();
        list.push_back(*std::move(v));
      }
      out = c10::IValue(list);
      break;
    }
    case K::kDict: {
      c10::TypePtr key_type = c10::StringType::get();
      if (!o->entries.empty() && o->entries.front().first->kind == K::kInt) {
        key_type = c10::IntType::get();
      }
      c10::impl::GenericDict dict(key_type, c10::AnyType::get());
      for (const auto& entry : o->entries) {
        const K want = key_type == c10::IntType::get() ? K::kInt : K::kStr;
        if (entry.first->kind != want) {
          return absl::DataLossError(absl::StrCat(
              path, ": dict keys must be all str or all int"));
        }
        auto v = ToIValue(path, entry.second, converted);
        if (!v.ok()) return v.status();
        c10::IValue key = want == K::kInt ? c10::IValue(entry.first->i)
                                          : c10::IValue(entry.first->s);
        dict.insert_or_assign(std::move(key), *std::move(v));
      }
      out = c10::IValue(dict);
      break;
    }
    case K::kGlobal:
    case K::kStorage:
      return absl::DataLossError(
          absl::StrCat(path, ": archive holds a bare class or storage, not data"));
  }
  converted.emplace(o.get(), out);
  return out;
}

// ToIValue after checking how deeply `o` nests.
absl::StatusOr<c10::IValue> ToBoundedIValue(
    const std::string& path, const PyRef& o,
    std::unordered_map<const PyObject*, c10::IValue>& converted) {
  const int64_t depth = NestingDepth(o.get());
  if (depth < 0) {
    return absl::DataLossError(absl::StrCat(
        path, ": pickle holds a container that contains itself; only acyclic "
        "data is read"));
  }
  if (depth > kMaxNesting) {
    return absl::DataLossError(absl::StrCat(
        path, ": pickle nests containers ", depth, " levels deep; at most ",
        kMaxNesting, " levels are read"));
  }
  return ToIValue(path, o, converted);
}

// Runs the archive's pickle program, with its storages from
// `load_storage`, and converts the result to IValues.
absl::StatusOr<UnpickledArchive> Unpickle(const std::string& path, const std::string& pickle,
                                          StorageLoader load_storage) {
  Vm vm(path, pickle, std::move(load_storage));
  // Destroyed before `vm` (and on every return and throw): frees the VM's
  // objects however deep or cyclic they are.
  struct DismantleOnExit {
    Vm& vm;
    ~DismantleOnExit() { Dismantle(vm.Roots()); }
  } dismantle{vm};
  auto top = vm.Run();
  if (!top.ok()) return top.status();
  UnpickledArchive out;
  std::unordered_map<const PyObject*, c10::IValue> converted;
  auto value = ToBoundedIValue(path, *top, converted);
  if (!value.ok()) return value.status();
  out.value = *std::move(value);
  if ((*top)->attributes != nullptr) {
    for (const auto& entry : (*top)->attributes->entries) {
      if (entry.first->kind == PyObject::Kind::kStr && entry.first->s == "_metadata") {
        auto metadata = ToBoundedIValue(path, entry.second, converted);
        if (!metadata.ok()) return metadata.status();
        out.metadata = *std::move(metadata);
      }
    }
  }
  return out;
}

absl::Status ArchiveError(const std::string& path, absl::string_view what) {
  return absl::DataLossError(absl::StrCat(path, ": cannot read PyTorch archive: ", what));
}

absl::Status CaughtArchiveError(const std::string& path, const c10::Error& e) {
  // PyTorchStreamReader reports a damaged zip (bad header, short file,
  // a deflated record that does not inflate) by throwing.
  return absl::DataLossError(absl::StrCat(
      path, ": not a readable PyTorch archive (truncated or corrupted?): ",
      e.what_without_backtrace()));
}

at::Storage UntypedStorage(size_t nbytes, at::DataPtr data) {
  return at::Storage(at::Storage::use_byte_size_t(), nbytes, std::move(data),
                     /*allocator=*/nullptr, /*resizable=*/false);
}

// miniz, and so LibTorch's reader, finds record names ignoring ASCII case.
std::string AsciiLower(std::string s) {
  for (char& c : s) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return s;
}

// Whether `t`'s elements in order are exactly its storage's bytes (what
// every tensor a PyTorch writer saves is): its checksum is then its
// record's.
bool IsWholeStorage(const at::Tensor& t) {
  return t.storage_offset() == 0 && t.is_contiguous() && t.nbytes() == t.storage().nbytes();
}

// A private (copy-on-write) mapping of a whole file, shared by the storages
// that point into it and unmapped with the last of them. Loaded tensors use
// the file's page-cache pages until they are written: a load reads the file
// as a verify does (through a fixed buffer, into the page cache) and maps
// it, instead of also copying every byte into fresh memory, which cost as
// much again as the disk read (issue #16); a later copy into a model's
// parameters reads the page cache directly. The checksum is taken from the
// reads, not by touching the mapping: faulting a file mapping in sequentially
// fills the page cache one 4 KiB page at a time, where read() fills it with
// large folios, and measured 2x slower here.
class FileMapping {
 public:
  // nullptr when the file system cannot map the file (the caller reads it).
  static std::shared_ptr<FileMapping> Map(int fd, uint64_t bytes) {
    if (bytes == 0) return nullptr;
    void* data = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                        MAP_PRIVATE, fd, 0);
    if (data == MAP_FAILED) return nullptr;
    return std::shared_ptr<FileMapping>(new FileMapping(static_cast<char*>(data), bytes));
  }
  ~FileMapping() { ::munmap(data_, static_cast<size_t>(bytes_)); }
  FileMapping(const FileMapping&) = delete;
  FileMapping& operator=(const FileMapping&) = delete;

  // The data pointer of a storage of the bytes at `offset`; it keeps the
  // mapping alive.
  static at::DataPtr Share(const std::shared_ptr<FileMapping>& mapping, uint64_t offset) {
    return at::DataPtr(mapping->data_ + offset, new std::shared_ptr<FileMapping>(mapping),
                       [](void* owner) { delete static_cast<std::shared_ptr<FileMapping>*>(owner); },
                       at::Device(at::kCPU));
  }

 private:
  FileMapping(char* data, uint64_t bytes) : data_(data), bytes_(bytes) {}
  char* data_;
  uint64_t bytes_;
};

// Reads and checksums the storage records in pieces of this size: each piece
// is checksummed right after it is read, while it is in the CPU's cache.
constexpr size_t kChunkBytes = size_t{1} << 20;

// Reads a PyTorch archive in one sequential pass for ReadTorchArchiveInOnePass:
// the pickle first (small, near the end), whose storages are placeholders of
// their records' sizes; then the file from its first byte to its last, each
// stored storage record read once, becoming its storage (through the file's
// mapping, see FileMapping) or through a fixed buffer when only checksummed,
// checksummed on the fly, the bytes
// between records (zip headers, data.pkl, the central directory) read and
// checksummed too, and the whole file's CRC-32C assembled from the pieces'
// with Crc32cCombine. Records this pass cannot read directly (deflated ones,
// as Python's zipfile rewrites an archive; ones sharing bytes with another;
// names that differ only in case) are read afterwards by LibTorch's reader,
// which inflates them; their compressed bytes are covered by the pass like
// any other. No zip CRC-32 is checked, as LibTorch's reader checks none
// either (its miniz is built without those checks: a flipped byte in a
// stored record loads silently, here and in Python's torch.load).
//
// Every offset and size comes from the file: each is checked against the
// file's size before anything is allocated or read.
class OnePassReader {
 public:
  OnePassReader(const std::string& path, const ZipDirectory& directory,
                caffe2::serialize::PyTorchStreamReader& reader, TensorData data)
      : path_(path), directory_(directory), reader_(reader), data_(data) {
    for (size_t i = 0; i < directory_.entries.size(); ++i) {
      auto inserted = entry_by_name_.emplace(AsciiLower(directory_.entries[i].name),
                                             static_cast<int64_t>(i));
      if (!inserted.second) inserted.first->second = kAmbiguous;
    }
  }
  ~OnePassReader() {
    if (fd_ >= 0) ::close(fd_);
  }
  OnePassReader(const OnePassReader&) = delete;
  OnePassReader& operator=(const OnePassReader&) = delete;

  absl::Status Open() {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) return Errno("cannot open");
    struct stat st;
    if (::fstat(fd_, &st) != 0) return Errno("cannot stat");
    size_ = static_cast<uint64_t>(st.st_size);
    if (size_ != directory_.file_bytes) {
      return ArchiveError(path_, absl::StrCat("it changed while being read (", directory_.file_bytes,
                                              " bytes, then ", size_, ")"));
    }
    ::posix_fadvise(fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
    return absl::OkStatus();
  }

  // data.pkl: read directly when stored, else by LibTorch's reader.
  absl::StatusOr<std::string> ReadPickle() {
    const std::string name = "data.pkl";
    const int64_t i = FindEntry(name);
    if (i >= 0 && Direct(Entry(i))) {
      auto offset = DataOffset(Entry(i), name);
      if (!offset.ok()) return offset.status();
      std::string pickle(static_cast<size_t>(Entry(i).compressed), '\0');
      absl::Status status = ReadAt(*offset, &pickle[0], pickle.size());
      if (!status.ok()) return status;
      return pickle;
    }
    at::DataPtr ptr;
    size_t size = 0;
    std::tie(ptr, size) = reader_.getRecord(name);
    return std::string(static_cast<const char*>(ptr.get()), size);
  }

  // The VM's storage loader: a storage of the record's size whose data the
  // pass fills in later (the same storage for every key naming the record).
  absl::StatusOr<at::Storage> Storage(const std::string& record) {
    const std::string key = AsciiLower(record);
    auto found = slots_.find(key);
    if (found != slots_.end()) return found->second.storage;
    if (!reader_.hasRecord(record)) {
      return ArchiveError(path_, absl::StrCat("record ", record, " is missing"));
    }
    Slot slot;
    slot.record = record;
    const int64_t i = FindEntry(record);
    if (i < 0) {
      // No single directory entry of this name (several, ignoring case):
      // the one LibTorch's reader picks, read now (and kept in either mode).
      at::DataPtr ptr;
      size_t size = 0;
      std::tie(ptr, size) = reader_.getRecord(record);
      slot.crc = Crc32c(ptr.get(), size);
      slot.storage = UntypedStorage(size, std::move(ptr));
      slot.done = true;
    } else {
      slot.entry = Direct(Entry(i)) ? i : -1;
      slot.storage = UntypedStorage(static_cast<size_t>(Entry(i).uncompressed),
                                    at::DataPtr(nullptr, at::Device(at::kCPU)));
    }
    Slot& kept = slots_.emplace(key, std::move(slot)).first->second;
    by_storage_[kept.storage.unsafeGetStorageImpl()] = &kept;
    return kept.storage;
  }

  // When only checksumming: keep the data of this storage too.
  void Keep(const c10::StorageImpl* storage) {
    auto found = by_storage_.find(storage);
    if (found != by_storage_.end()) found->second->keep = true;
  }

  // The pass over the whole file, then the records it could not read.
  absl::Status ReadRecords() {
    std::vector<Slot*> direct;
    for (auto& entry : slots_) {
      if (!entry.second.done && entry.second.entry >= 0) direct.push_back(&entry.second);
    }
    std::sort(direct.begin(), direct.end(), [&](const Slot* a, const Slot* b) {
      return Entry(a->entry).local_header < Entry(b->entry).local_header;
    });
    uint64_t at = 0;   // everything before `at` is checksummed into `crc`
    uint32_t crc = 0;
    for (Slot* slot : direct) {
      const ZipEntry& e = Entry(slot->entry);
      if (e.local_header < at) continue;  // shares bytes with an earlier record: read below
      auto data = DataOffset(e, slot->record);  // checks the record lies inside the file
      if (!data.ok()) return data.status();
      // The bytes since the last record, then its local header, name and
      // extra field.
      absl::Status status = Skim(at, *data, crc);
      if (!status.ok()) return status;
      status = ReadData(*slot, *data, e.compressed);
      if (!status.ok()) return status;
      crc = Crc32cCombine(crc, slot->crc, e.compressed);
      at = *data + e.compressed;
    }
    absl::Status status = Skim(at, size_, crc);
    if (!status.ok()) return status;
    crc32c_ = crc;
    for (auto& entry : slots_) {
      Slot& slot = entry.second;
      if (slot.done) continue;
      at::DataPtr ptr;
      size_t size = 0;
      std::tie(ptr, size) = reader_.getRecord(slot.record);
      if (size != slot.storage.nbytes()) {
        return ArchiveError(path_, absl::StrCat("record ", slot.record, " holds ", size,
                                                " bytes, its directory entry says ",
                                                slot.storage.nbytes()));
      }
      slot.crc = Crc32c(ptr.get(), size);
      if (KeepsData(slot)) slot.storage.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(ptr));
      slot.done = true;
    }
    return absl::OkStatus();
  }

  uint64_t bytes() const { return size_; }
  uint32_t crc32c() const { return crc32c_; }
  RecordCrcs record_crc32c() const {
    RecordCrcs out;
    for (const auto& entry : slots_) {
      out[entry.second.storage.unsafeGetStorageImpl()] = entry.second.crc;
    }
    return out;
  }

 private:
  static constexpr int64_t kAmbiguous = -2;

  struct Slot {
    std::string record;  // "data/<key>"
    int64_t entry = -1;  // its directory entry when the pass reads it directly
    at::Storage storage;
    bool keep = false;   // keep the data when only checksumming
    bool done = false;   // read, and `crc` known
    uint32_t crc = 0;    // CRC-32C of the record's (uncompressed) bytes
  };

  const ZipEntry& Entry(int64_t i) const { return directory_.entries[static_cast<size_t>(i)]; }

  // The entry LibTorch's reader finds for `record`; -1 when none, kAmbiguous
  // when several names match.
  int64_t FindEntry(const std::string& record) const {
    auto found = entry_by_name_.find(AsciiLower(directory_.folder + record));
    return found == entry_by_name_.end() ? -1 : found->second;
  }

  // Records read directly: stored (no compression), of consistent sizes, of
  // no flags miniz refuses.
  static bool Direct(const ZipEntry& e) {
    return e.method == kZipStored && e.compressed == e.uncompressed &&
           (e.flags & kZipUnsupportedFlags) == 0;
  }

  bool KeepsData(const Slot& slot) const { return data_ == TensorData::kRead || slot.keep; }

  absl::Status Errno(absl::string_view what) const {
    const int error = errno;
    return absl::Status(absl::ErrnoToStatusCode(error),
                        absl::StrCat(what, " ", path_, ": ", std::strerror(error)));
  }

  // `size` bytes at `offset` (inside the file: the callers check).
  absl::Status ReadAt(uint64_t offset, char* out, size_t size) {
    size_t done = 0;
    while (done < size) {
      const ssize_t n = ::pread(fd_, out + done, size - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Errno("cannot read");
      if (n == 0) {
        return ArchiveError(path_, absl::StrCat("it ends at byte ", offset + done, ", before the ",
                                                size - done, " bytes expected there"));
      }
      done += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  // The whole file mapped, once, for a load; nullptr when it cannot be, and
  // when only checksumming (the few records kept then are read into fresh
  // memory, so a verify touches one fixed buffer and maps nothing).
  FileMapping* Mapping() {
    if (!mapping_tried_ && data_ == TensorData::kRead) {
      mapping_tried_ = true;
      mapping_ = FileMapping::Map(fd_, size_);
    }
    return mapping_.get();
  }

  char* Buffer() {
    if (buffer_ == nullptr) buffer_.reset(new char[kChunkBytes]);
    return buffer_.get();
  }

  // Checksums bytes [from, to) into `crc` through the fixed buffer.
  absl::Status Skim(uint64_t from, uint64_t to, uint32_t& crc) {
    while (from < to) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunkBytes, to - from));
      absl::Status status = ReadAt(from, Buffer(), n);
      if (!status.ok()) return status;
      crc = Crc32c(Buffer(), n, crc);
      from += n;
    }
    return absl::OkStatus();
  }

  // Where `e`'s data begins: after its local header's name and extra field
  // (which may differ from the central directory's).
  absl::StatusOr<uint64_t> DataOffset(const ZipEntry& e, const std::string& record) {
    if (e.local_header > size_ || kZipLocalHeaderSize > size_ - e.local_header) {
      return ArchiveError(path_, absl::StrCat("the local header of record ", record,
                                              " lies beyond the end of the ", size_,
                                              "-byte file"));
    }
    char header[kZipLocalHeaderSize];
    absl::Status status = ReadAt(e.local_header, header, sizeof(header));
    if (!status.ok()) return status;
    const std::optional<uint64_t> offset = ZipDataOffset(e, header);
    if (!offset.has_value()) {
      return ArchiveError(path_, absl::StrCat("the local header of record ", record,
                                              " is damaged"));
    }
    const uint64_t data = *offset;
    if (data > size_ || e.compressed > size_ - data) {
      return ArchiveError(path_, absl::StrCat("record ", record, " (", e.compressed,
                                              " bytes at offset ", data,
                                              ") runs past the end of the ", size_,
                                              "-byte file"));
    }
    return data;
  }

  // The record's `size` bytes at `offset` (inside the file), checksummed:
  // through the fixed buffer, its storage then the mapping's view of them
  // (or nothing, when only checksummed); into a new buffer that becomes its
  // storage's data where the file could not be mapped.
  absl::Status ReadData(Slot& slot, uint64_t offset, uint64_t size) {
    uint32_t crc = 0;
    at::DataPtr ptr;
    char* out = nullptr;
    // Mapped: the bytes are read (into the page cache, and through the fixed
    // buffer to checksum them) and the storage is the mapping's view of them.
    const bool mapped = KeepsData(slot) && size > 0 && Mapping() != nullptr;
    if (KeepsData(slot) && !mapped) {
      ptr = c10::GetCPUAllocator()->allocate(static_cast<size_t>(size));
      out = static_cast<char*>(ptr.get());
    }
    for (uint64_t done = 0; done < size;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunkBytes, size - done));
      char* piece = out != nullptr ? out + done : Buffer();
      absl::Status status = ReadAt(offset + done, piece, n);
      if (!status.ok()) return status;
      crc = Crc32c(piece, n, crc);
      done += n;
    }
    if (mapped) ptr = FileMapping::Share(mapping_, offset);
    if (KeepsData(slot)) slot.storage.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(ptr));
    slot.crc = crc;
    slot.done = true;
    return absl::OkStatus();
  }

  const std::string& path_;
  const ZipDirectory& directory_;
  caffe2::serialize::PyTorchStreamReader& reader_;
  const TensorData data_;
  std::unordered_map<std::string, int64_t> entry_by_name_;  // lower-case name -> entry
  std::map<std::string, Slot> slots_;                        // by lower-case record name
  std::unordered_map<const c10::StorageImpl*, Slot*> by_storage_;
  int fd_ = -1;
  uint64_t size_ = 0;
  uint32_t crc32c_ = 0;
  std::unique_ptr<char[]> buffer_;
  std::shared_ptr<FileMapping> mapping_;
  bool mapping_tried_ = false;
};

}  // namespace

absl::StatusOr<UnpickledArchive> ReadTorchArchive(const std::string& path) {
  // The reader's constructor leaks miniz's state when it throws after opening
  // the zip; the precheck refuses every archive it would throw on there.
  absl::Status archive_ok = PrecheckTorchArchive(path);
  if (!archive_ok.ok()) return archive_ok;
  try {
    caffe2::serialize::PyTorchStreamReader reader(path);
    if (!reader.hasRecord("data.pkl")) {
      return absl::DataLossError(absl::StrCat(path, ": no data.pkl record"));
    }
    at::DataPtr ptr;
    size_t size = 0;
    std::tie(ptr, size) = reader.getRecord("data.pkl");
    const std::string pickle(static_cast<const char*>(ptr.get()), size);
    return Unpickle(path, pickle, [&](const std::string& record) -> absl::StatusOr<at::Storage> {
      if (!reader.hasRecord(record)) {
        return ArchiveError(path, absl::StrCat("record ", record, " is missing"));
      }
      at::DataPtr data;
      size_t nbytes = 0;
      std::tie(data, nbytes) = reader.getRecord(record);
      return UntypedStorage(nbytes, std::move(data));
    });
  } catch (const c10::Error& e) {
    return CaughtArchiveError(path, e);
  }
}

absl::StatusOr<ChecksummedArchive> ReadTorchArchiveInOnePass(const std::string& path,
                                                             TensorData data,
                                                             const std::set<std::string>& keep) {
  // The precheck (as ReadTorchArchive), which also gives the directory.
  auto directory = ReadTorchArchiveDirectory(path);
  if (!directory.ok()) return directory.status();
  try {
    // LibTorch's reader still opens the archive: it validates the zip as for
    // any load (cheaply: the end records, the central directory and the
    // version record), and reads the records this pass does not read itself.
    caffe2::serialize::PyTorchStreamReader reader(path);
    if (!reader.hasRecord("data.pkl")) {
      return absl::DataLossError(absl::StrCat(path, ": no data.pkl record"));
    }
    OnePassReader records(path, *directory, reader, data);
    absl::Status status = records.Open();
    if (!status.ok()) return status;
    auto pickle = records.ReadPickle();
    if (!pickle.ok()) return pickle.status();
    auto archive = Unpickle(path, *pickle, [&](const std::string& record) {
      return records.Storage(record);
    });
    if (!archive.ok()) return archive.status();
    // Only checksumming, data is still kept for the tensors `keep` names and
    // for tensors that are not exactly their storage's bytes (never written
    // by PyTorch's savers; their checksum needs their data), of the
    // top-level dict.
    if (data == TensorData::kChecksumOnly && archive->value.isGenericDict()) {
      for (const auto& entry : archive->value.toGenericDict()) {
        if (!entry.value().isTensor()) continue;
        const at::Tensor& t = entry.value().toTensor();
        const bool named = entry.key().isString() && keep.count(entry.key().toStringRef()) > 0;
        if (named || !IsWholeStorage(t)) records.Keep(t.storage().unsafeGetStorageImpl());
      }
    }
    status = records.ReadRecords();
    if (!status.ok()) return status;
    ChecksummedArchive out;
    out.archive = *std::move(archive);
    out.bytes = records.bytes();
    out.crc32c = records.crc32c();
    out.record_crc32c = records.record_crc32c();
    return out;
  } catch (const c10::Error& e) {
    return CaughtArchiveError(path, e);
  }
}

std::optional<uint32_t> TensorCrc32c(const RecordCrcs& records, const at::Tensor& t) {
  if (IsWholeStorage(t)) {
    auto found = records.find(t.storage().unsafeGetStorageImpl());
    if (found != records.end()) return found->second;
  }
  if (t.numel() == 0) return 0u;
  if (t.storage().data() == nullptr) return std::nullopt;  // only checksummed
  const at::Tensor c = t.contiguous();
  return Crc32c(c.data_ptr(), c.nbytes());
}

}  // namespace internal
}  // namespace state_dict
