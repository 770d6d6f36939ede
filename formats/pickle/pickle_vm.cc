#include "formats/pickle/pickle_vm.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace formats {
namespace {

// Python objects as the VM sees them. Containers are shared (memo + later
// SETITEMS mutate the same object), hence shared_ptr.
struct PyObject;
using PyRef = std::shared_ptr<PyObject>;

struct PyObject {
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kFloat,
    kStr,
    kTuple,
    kList,
    kDict,
    kGlobal,
    kStorage,
    kTensor,
    kObject
  };
  Kind kind = Kind::kNone;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;             // kStr; kGlobal, kObject: "module.name" of the class
  std::vector<PyRef> items;  // kTuple, kList; kObject: constructor arguments
  std::vector<std::pair<PyRef, PyRef>> entries;  // kDict
  // kDict: where each str and int key is in `entries`, made on the first
  // SETITEM(S): without it every SETITEM scanned the dict, and one SETITEMS
  // of N keys took N^2/2 key comparisons (a 1e5-key pickle: over a minute).
  // The views point into the keys' own `s`, which `entries` keeps alive and
  // nothing changes.
  struct Index {
    std::unordered_map<std::string_view, size_t> str;
    std::unordered_map<int64_t, size_t> ints;
  };
  std::unique_ptr<Index> index;
  PyRef attributes;  // kDict, kObject: state applied by BUILD (OrderedDict attrs)
  at::Storage storage;
  at::ScalarType storage_dtype = at::kFloat;
  at::Tensor tensor;
};

// Containers nested deeper than this are refused. Converting to IValues and
// destroying them recurses once per level, and a crafted pickle can nest a
// million levels (Python's unpickler is iterative and reads them); state
// dicts nest a handful.
constexpr int64_t kMaxNesting = 1000;

PyRef NewObject(PyObject::Kind kind) {
  auto o = std::make_shared<PyObject>();
  o->kind = kind;
  return o;
}

struct StorageType {
  const char* name;
  at::ScalarType dtype;
};
constexpr StorageType kStorageTypes[] = {
    {"torch.FloatStorage", at::kFloat},
    {"torch.DoubleStorage", at::kDouble},
    {"torch.HalfStorage", at::kHalf},
    {"torch.BFloat16Storage", at::kBFloat16},
    {"torch.LongStorage", at::kLong},
    {"torch.IntStorage", at::kInt},
    {"torch.ShortStorage", at::kShort},
    {"torch.CharStorage", at::kChar},
    {"torch.ByteStorage", at::kByte},
    {"torch.BoolStorage", at::kBool},
    {"torch.ComplexFloatStorage", at::kComplexFloat},
    {"torch.ComplexDoubleStorage", at::kComplexDouble},
};

class Vm {
 public:
  Vm(std::string path, const std::string& pickle, StorageLoader load_storage)
      : path_(std::move(path)), data_(pickle), load_storage_(std::move(load_storage)) {}
  // A VM for pickles of Python objects: calling (REDUCE, NEWOBJ) a global
  // of `classes` makes an object of it; no persistent ids (storages).
  Vm(std::string name, const std::string& pickle, const std::set<std::string>& classes)
      : path_(std::move(name)), data_(pickle), classes_(&classes) {}

  // Every object the VM still references (the stack, the memo, storages),
  // and every container it made that is still alive, for Dismantle.
  std::vector<PyRef> Roots() const {
    std::vector<PyRef> roots = stack_;
    for (const PyRef& o : memo_) roots.push_back(o);
    for (const auto& entry : sparse_memo_) roots.push_back(entry.second);
    for (const std::weak_ptr<PyObject>& made : containers_) {
      if (PyRef o = made.lock()) roots.push_back(std::move(o));
    }
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
        return absl::Status(status.code(), absl::StrCat(status.message(), " (opcode 0x",
                                                        absl::Hex(op), " at byte ", at, ")"));
      }
    }
    if (stack_.size() != 1) return Error("pickle leaves a malformed stack");
    return stack_.back();
  }

 private:
  PyRef Make(PyObject::Kind kind) {
    PyRef o = NewObject(kind);
    using K = PyObject::Kind;
    if (kind == K::kTuple || kind == K::kList || kind == K::kDict || kind == K::kObject) {
      containers_.push_back(o);
    }
    return o;
  }

  absl::Status Error(absl::string_view what) const {
    return absl::DataLossError(absl::StrCat(
        path_,
        classes_ == nullptr ? ": cannot read PyTorch archive: " : ": cannot read pickle: ", what));
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
    const size_t i = static_cast<size_t>(index);
    if (index >= 0 && i < memo_.size()) {
      memo_count_ += memo_[i] == nullptr ? 1 : 0;
      memo_[i] = stack_.back();
    } else if (index >= 0 && i == memo_.size() && sparse_memo_.count(index) == 0) {
      ++memo_count_;
      memo_.push_back(stack_.back());
    } else {
      memo_count_ += sparse_memo_.count(index) == 0 ? 1 : 0;
      sparse_memo_[index] = stack_.back();
    }
    return absl::OkStatus();
  }

  absl::Status Recall(int64_t index) {
    const size_t i = static_cast<size_t>(index);
    if (index >= 0 && i < memo_.size() && memo_[i] != nullptr) {
      Push(memo_[i]);
      return absl::OkStatus();
    }
    auto it = sparse_memo_.find(index);
    if (it == sparse_memo_.end()) return Error(absl::StrCat("memo ", index, " unset"));
    Push(it->second);
    return absl::OkStatus();
  }

  // As Python's dict: a key already present keeps its place and takes the
  // new value. Keys other than str and int (which ToIValue refuses anyway)
  // are never equal to another.
  absl::Status SetItems(const PyRef& dict, const std::vector<PyRef>& kv) {
    if (dict->kind != PyObject::Kind::kDict) return Error("SETITEMS on a non-dict");
    if (kv.size() % 2 != 0) return Error("SETITEMS with an odd item count");
    if (dict->index == nullptr) {
      dict->index = std::make_unique<PyObject::Index>();
      for (size_t e = 0; e < dict->entries.size(); ++e) IndexKey(*dict, e);
    }
    // Room for a large batch at once (SETITEMS of the whole dict, as
    // picklers write it); only when the batch is at least the dict's size,
    // so that many small batches still grow it geometrically.
    const size_t batch = kv.size() / 2;
    if (batch > 0 && batch >= dict->entries.size()) {
      dict->entries.reserve(dict->entries.size() + batch);
      if (kv[0]->kind == PyObject::Kind::kStr)
        dict->index->str.reserve(dict->entries.size() + batch);
    }
    for (size_t k = 0; k < kv.size(); k += 2) {
      const size_t next = dict->entries.size();
      dict->entries.emplace_back(kv[k], kv[k + 1]);
      const size_t at = IndexKey(*dict, next);
      if (at != next) {
        dict->entries[at].second = kv[k + 1];
        dict->entries.pop_back();
      }
    }
    return absl::OkStatus();
  }

  // Records entry `e`'s key in the dict's index; returns the entry that
  // holds the key (`e` unless an earlier one has it).
  static size_t IndexKey(PyObject& dict, size_t e) {
    const PyObject& key = *dict.entries[e].first;
    if (key.kind == PyObject::Kind::kStr) return dict.index->str.emplace(key.s, e).first->second;
    if (key.kind == PyObject::Kind::kInt) return dict.index->ints.emplace(key.i, e).first->second;
    return e;
  }

  absl::StatusOr<PyRef> LoadStorage(const PyRef& pid) {
    if (load_storage_ == nullptr) return Error("persistent id in a pickle of plain objects");
    // ('storage', torch.<Type>Storage, key, location, numel)
    if (pid->kind != PyObject::Kind::kTuple || pid->items.size() != 5 ||
        pid->items[0]->s != "storage" || pid->items[1]->kind != PyObject::Kind::kGlobal ||
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
    if (classes_ != nullptr) return MakeObject(func, args);
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
      if (!empty &&
          (a[1]->i < 0 || overflow || end_byte > static_cast<int64_t>(storage.nbytes()))) {
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
    if (name == "torch.jit._pickle.build_intlist" || name == "torch.jit._pickle.build_doublelist" ||
        name == "torch.jit._pickle.build_boollist" ||
        name == "torch.jit._pickle.build_tensorlist") {
      if (a.size() != 1) return Error(absl::StrCat("malformed ", name, " arguments"));
      return a[0];
    }
    return Error(absl::StrCat("unsupported global ", name,
                              " (only tensors, containers and scalars are read)"));
  }

  // An object of an allowed class, with its constructor arguments.
  absl::StatusOr<PyRef> MakeObject(const PyRef& cls, const PyRef& args) {
    if (cls->kind != PyObject::Kind::kGlobal || classes_ == nullptr ||
        classes_->count(cls->s) == 0) {
      return Error(absl::StrCat("unsupported global ",
                                cls->kind == PyObject::Kind::kGlobal ? cls->s : "(not a class)",
                                " (only the classes this format's metadata uses are read)"));
    }
    if (args->kind != PyObject::Kind::kTuple) return Error("object made without an argument tuple");
    PyRef o = Make(PyObject::Kind::kObject);
    o->s = cls->s;
    o->items = args->items;
    return o;
  }

  // One opcode, by family (pickletools' names in the helpers' comments).
  absl::Status Step(uint8_t op) {
    switch (op) {
      case 0x80:
      case 0x95:
      case '(':
      case '0':
      case '1':
      case '2': return StackOp(op);
      case 'N':
      case 0x88:
      case 0x89:
      case 'J':
      case 'K':
      case 'M':
      case 0x8a:
      case 'G':
      case 'X':
      case 'B':
      case 'T':
      case 0x8c:
      case 'C':
      case 'U':
      case 0x8d:
      case 0x8e: return ScalarOp(op);
      case ')':
      case 't':
      case 0x85:
      case 0x86:
      case 0x87:
      case ']':
      case 'l':
      case 'a':
      case 'e':
      case '}':
      case 'd':
      case 's':
      case 'u': return ContainerOp(op);
      case 'q':
      case 'r':
      case 0x94:
      case 'h':
      case 'j': return MemoOp(op);
      case 0x81:
      case 'c':
      case 0x93:
      case 'R':
      case 'b':
      case 'Q': return ObjectOp(op);
      default: return Error("unsupported pickle opcode");
    }
  }

  // PROTO, FRAME and the stack's own opcodes: MARK, POP, POP_MARK, DUP.
  absl::Status StackOp(uint8_t op) {
    switch (op) {
      case 0x80:  // PROTO
        if (pos_ >= data_.size()) return Error("pickle is truncated");
        if (Byte() > 4) return Error("pickle protocol newer than 4");
        return absl::OkStatus();
      case 0x95: {  // FRAME
        auto n = LittleEndian<uint64_t>();
        return n.ok() ? absl::OkStatus() : n.status();
      }
      case '(': marks_.push_back(stack_.size()); return absl::OkStatus();
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
      default: return Error("unsupported pickle opcode");
    }
  }

  // None, bools, ints, floats and strings, pushed.
  absl::Status ScalarOp(uint8_t op) {
    using K = PyObject::Kind;
    switch (op) {
      case 'N': Push(Make(K::kNone)); return absl::OkStatus();
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
      default: return Error("unsupported pickle opcode");
    }
  }

  // Tuples, lists and dicts: made, appended to, set items of.
  absl::Status ContainerOp(uint8_t op) {
    using K = PyObject::Kind;
    switch (op) {
      case ')': return PushTuple({});
      case 't': {
        auto items = PopToMark();
        return items.ok() ? PushTuple(*std::move(items)) : items.status();
      }
      case 0x85: return PopTupleOf(1);
      case 0x86: return PopTupleOf(2);
      case 0x87: return PopTupleOf(3);
      case ']': Push(Make(K::kList)); return absl::OkStatus();
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
        if (stack_.empty() || stack_.back()->kind != K::kList)
          return Error("APPENDS to a non-list");
        for (PyRef& item : *items) stack_.back()->items.push_back(item);
        return absl::OkStatus();
      }
      case '}': Push(Make(K::kDict)); return absl::OkStatus();
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
      default: return Error("unsupported pickle opcode");
    }
  }

  // The memo: MEMOIZE, BINPUT / LONG_BINPUT, BINGET / LONG_BINGET.
  absl::Status MemoOp(uint8_t op) {
    switch (op) {
      case 'q': {
        auto n = LittleEndian<uint8_t>();
        return n.ok() ? Memoize(*n) : n.status();
      }
      case 'r': {
        auto n = LittleEndian<uint32_t>();
        return n.ok() ? Memoize(*n) : n.status();
      }
      case 0x94: return Memoize(static_cast<int64_t>(memo_count_));
      case 'h': {
        auto n = LittleEndian<uint8_t>();
        return n.ok() ? Recall(*n) : n.status();
      }
      case 'j': {
        auto n = LittleEndian<uint32_t>();
        return n.ok() ? Recall(*n) : n.status();
      }
      default: return Error("unsupported pickle opcode");
    }
  }

  // Globals and what is made of them: GLOBAL, STACK_GLOBAL, REDUCE, NEWOBJ,
  // BUILD, and persistent ids (storages).
  absl::Status ObjectOp(uint8_t op) {
    using K = PyObject::Kind;
    switch (op) {
      case 0x81: {  // NEWOBJ: cls.__new__(cls, *args)
        auto args = Pop();
        if (!args.ok()) return args.status();
        auto cls = Pop();
        if (!cls.ok()) return cls.status();
        auto o = MakeObject(*cls, *args);
        if (!o.ok()) return o.status();
        Push(*o);
        return absl::OkStatus();
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
        if (obj->kind == K::kObject && obj->attributes == nullptr) {
          obj->attributes = *state;
          return absl::OkStatus();
        }
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
      default: return Error("unsupported pickle opcode");
    }
  }

  std::string path_;
  const std::string& data_;
  StorageLoader load_storage_;
  const std::set<std::string>* classes_ = nullptr;
  size_t pos_ = 0;
  std::vector<PyRef> stack_;
  std::vector<size_t> marks_;
  // The memo, as picklers number it (0, 1, 2, ...), in a vector; indices
  // that would leave a gap (a 4-byte index comes from the file) in a map.
  std::vector<PyRef> memo_;
  std::unordered_map<int64_t, PyRef> sparse_memo_;
  size_t memo_count_ = 0;  // distinct indices set: MEMOIZE's next index
  std::map<std::string, PyRef> storages_;
  // Every container made. One that holds itself (a list appended to itself)
  // and then leaves the stack and the memo is a reference cycle no root
  // reaches, which Dismantle must break all the same (Python's collector
  // would; shared_ptr cannot).
  std::vector<std::weak_ptr<PyObject>> containers_;
};

bool IsContainer(const PyObject& o) {
  return o.kind == PyObject::Kind::kTuple || o.kind == PyObject::Kind::kList ||
         o.kind == PyObject::Kind::kDict || o.kind == PyObject::Kind::kObject;
}

// An object's children are its arguments, then its state.
size_t ChildCount(const PyObject& o) {
  if (o.kind == PyObject::Kind::kObject) return o.items.size() + (o.attributes ? 1 : 0);
  return o.kind == PyObject::Kind::kDict ? 2 * o.entries.size() : o.items.size();
}

const PyRef& ChildAt(const PyObject& o, size_t i) {
  if (o.kind == PyObject::Kind::kDict) {
    return i % 2 == 0 ? o.entries[i / 2].first : o.entries[i / 2].second;
  }
  if (o.kind == PyObject::Kind::kObject && i == o.items.size()) return o.attributes;
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
      // Scalars nest nothing: skipping them keeps the maps to the
      // containers (a dict of N str keys is 2N + 1 objects, 1 container).
      if (!IsContainer(*child)) continue;
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
// and a self-containing one would never be freed. Each container's children
// are moved out of it when it is first reached, so a container reached again
// (shared, or in a cycle) is already empty: linear in the references.
void Dismantle(std::vector<PyRef> roots) {
  while (!roots.empty()) {
    PyRef o = std::move(roots.back());
    roots.pop_back();
    if (o == nullptr || !IsContainer(*o)) continue;
    for (PyRef& item : o->items) roots.push_back(std::move(item));
    o->items.clear();
    o->index.reset();  // before `entries`: it points into their keys
    for (auto& entry : o->entries) {
      roots.push_back(std::move(entry.first));
      roots.push_back(std::move(entry.second));
    }
    o->entries.clear();
    if (o->attributes != nullptr) roots.push_back(std::move(o->attributes));
  }
}

// Converts the VM's objects to IValues. `converted` keeps an object shared
// between several places shared in the result (as Python's torch.load does),
// which also keeps conversion linear in the pickle's size. The caller bounds
// the nesting (NestingDepth) first, so this recursion, and the IValue's
// destructor later, stay shallow.
absl::StatusOr<c10::IValue> ToIValue(const std::string& path, const PyRef& o,
                                     std::unordered_map<const PyObject*, c10::IValue>& converted) {
  using K = PyObject::Kind;
  if (IsContainer(*o)) {
    auto found = converted.find(o.get());
    if (found != converted.end()) return found->second;
  }
  c10::IValue out;
  switch (o->kind) {
    case K::kNone: return c10::IValue();
    case K::kBool: return c10::IValue(o->b);
    case K::kInt: return c10::IValue(o->i);
    case K::kFloat: return c10::IValue(o->f);
    case K::kStr: return c10::IValue(o->s);
    case K::kTensor: return c10::IValue(o->tensor);
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
      dict.reserve(static_cast<int64_t>(o->entries.size()));
      for (const auto& entry : o->entries) {
        const K want = key_type == c10::IntType::get() ? K::kInt : K::kStr;
        if (entry.first->kind != want) {
          return absl::DataLossError(absl::StrCat(path, ": dict keys must be all str or all int"));
        }
        auto v = ToIValue(path, entry.second, converted);
        if (!v.ok()) return v.status();
        c10::IValue key =
            want == K::kInt ? c10::IValue(entry.first->i) : c10::IValue(entry.first->s);
        dict.insert_or_assign(std::move(key), *std::move(v));
      }
      out = c10::IValue(dict);
      break;
    }
    case K::kGlobal:
    case K::kStorage:
    case K::kObject:
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
    return absl::DataLossError(
        absl::StrCat(path,
                     ": pickle holds a container that contains itself; only acyclic "
                     "data is read"));
  }
  if (depth > kMaxNesting) {
    return absl::DataLossError(absl::StrCat(path, ": pickle nests containers ", depth,
                                            " levels deep; at most ", kMaxNesting,
                                            " levels are read"));
  }
  return ToIValue(path, o, converted);
}

// Copies the VM's objects into PickledValues. A value shared in the pickle
// is copied once per place that names it, so `budget` (nodes left) bounds
// the result: a pickle that shares one list 2^60 ways is refused, not
// expanded. The caller bounds the nesting first.
absl::StatusOr<PickledValue> ToPickledValue(const std::string& name, const PyRef& o,
                                            const std::set<std::string>& classes, int64_t& budget) {
  using K = PyObject::Kind;
  using V = PickledValue::Kind;
  if (--budget < 0) {
    return absl::DataLossError(
        absl::StrCat(name,
                     ": pickle expands to too many values (it shares objects more than "
                     "plain metadata does)"));
  }
  PickledValue out;
  auto children = [&](const std::vector<PyRef>& from,
                      std::vector<PickledValue>& to) -> absl::Status {
    to.reserve(from.size());
    for (const PyRef& item : from) {
      auto v = ToPickledValue(name, item, classes, budget);
      if (!v.ok()) return v.status();
      to.push_back(*std::move(v));
    }
    return absl::OkStatus();
  };
  switch (o->kind) {
    case K::kNone: out.kind = V::kNone; return out;
    case K::kBool:
      out.kind = V::kBool;
      out.b = o->b;
      return out;
    case K::kInt:
      out.kind = V::kInt;
      out.i = o->i;
      return out;
    case K::kFloat:
      out.kind = V::kFloat;
      out.f = o->f;
      return out;
    case K::kStr:
      out.kind = V::kStr;
      out.s = o->s;
      return out;
    case K::kTuple:
    case K::kList: {
      out.kind = o->kind == K::kTuple ? V::kTuple : V::kList;
      absl::Status status = children(o->items, out.items);
      if (!status.ok()) return status;
      return out;
    }
    case K::kDict: {
      out.kind = V::kDict;
      out.entries.reserve(o->entries.size());
      for (const auto& [key, value] : o->entries) {
        auto k = ToPickledValue(name, key, classes, budget);
        if (!k.ok()) return k.status();
        auto v = ToPickledValue(name, value, classes, budget);
        if (!v.ok()) return v.status();
        out.entries.emplace_back(*std::move(k), *std::move(v));
      }
      return out;
    }
    case K::kGlobal:
      if (classes.count(o->s) == 0) {
        return absl::DataLossError(
            absl::StrCat(name, ": unsupported global ", o->s,
                         " (only the classes this format's metadata uses are read)"));
      }
      out.kind = V::kGlobal;
      out.s = o->s;
      return out;
    case K::kObject: {
      out.kind = V::kObject;
      out.s = o->s;
      absl::Status status = children(o->items, out.items);
      if (!status.ok()) return status;
      if (o->attributes != nullptr) {
        auto state = ToPickledValue(name, o->attributes, classes, budget);
        if (!state.ok()) return state.status();
        out.state.push_back(*std::move(state));
      }
      return out;
    }
    case K::kStorage:
    case K::kTensor: break;
  }
  return absl::DataLossError(absl::StrCat(name, ": tensor data in a pickle of plain objects"));
}

}  // namespace

absl::StatusOr<UnpickledArchive> UnpickleArchive(const std::string& path, const std::string& pickle,
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

absl::StatusOr<PickledValue> UnpickleObjects(const std::string& name, const std::string& pickle,
                                             const std::set<std::string>& classes) {
  Vm vm(name, pickle, classes);
  struct DismantleOnExit {
    Vm& vm;
    ~DismantleOnExit() { Dismantle(vm.Roots()); }
  } dismantle{vm};
  auto top = vm.Run();
  if (!top.ok()) return top.status();
  const int64_t depth = NestingDepth(top->get());
  if (depth < 0) {
    return absl::DataLossError(absl::StrCat(name, ": pickle holds an object that contains itself"));
  }
  if (depth > kMaxNesting) {
    return absl::DataLossError(absl::StrCat(name, ": pickle nests objects ", depth,
                                            " levels deep; at most ", kMaxNesting,
                                            " levels are read"));
  }
  // Plain metadata names each value about once: a few values per byte.
  int64_t budget = 4 * static_cast<int64_t>(pickle.size()) + 1024;
  return ToPickledValue(name, *top, classes, budget);
}

}  // namespace formats
