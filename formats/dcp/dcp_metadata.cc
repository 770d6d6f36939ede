#include "formats/dcp/dcp_metadata.h"

#include <cstring>
#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "formats/pickle/pickle_vm.h"

namespace formats {
namespace {

constexpr char kMetadataModule[] = "torch.distributed.checkpoint.metadata";
// Before torch 2.4 TensorProperties and its memory-format enum lived here.
constexpr char kShardedTensorModule[] = "torch.distributed._shard.sharded_tensor.metadata";
constexpr char kStorageInfo[] = "torch.distributed.checkpoint.filesystem._StorageInfo";

struct DtypeName {
  c10::ScalarType dtype;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {c10::ScalarType::Float, "float32"},
    {c10::ScalarType::Double, "float64"},
    {c10::ScalarType::Half, "float16"},
    {c10::ScalarType::BFloat16, "bfloat16"},
    {c10::ScalarType::Long, "int64"},
    {c10::ScalarType::Int, "int32"},
    {c10::ScalarType::Short, "int16"},
    {c10::ScalarType::Char, "int8"},
    {c10::ScalarType::Byte, "uint8"},
    {c10::ScalarType::Bool, "bool"},
    {c10::ScalarType::ComplexFloat, "complex64"},
    {c10::ScalarType::ComplexDouble, "complex128"},
};

const std::set<std::string>& AllowedClasses() {
  static const std::set<std::string> classes = [] {
    std::set<std::string> c;
    for (const char* cls :
         {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
          "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}) {
      c.insert(absl::StrCat(kMetadataModule, ".", cls));
    }
    c.insert(absl::StrCat(kShardedTensorModule, ".TensorProperties"));
    c.insert(absl::StrCat(kShardedTensorModule, "._MEM_FORMAT_ENCODING"));
    c.insert(kStorageInfo);
    c.insert("torch.Size");
    c.insert("torch.serialization._get_layout");
    c.insert("torch.strided");
    c.insert("pathlib.PosixPath");  // StorageMeta.checkpoint_id
    for (const DtypeName& d : kDtypes) c.insert(absl::StrCat("torch.", d.name));
    return c;
  }();
  return classes;
}

using V = PickledValue;
using Kind = PickledValue::Kind;

class Parser {
 public:
  explicit Parser(const std::string& name) : name_(name) {}

  absl::Status Error(absl::string_view what) const {
    return absl::DataLossError(absl::StrCat(name_, ": not DCP metadata this build reads: ", what));
  }

  bool IsObject(const V& v, absl::string_view cls) const {
    if (v.kind != Kind::kObject) return false;
    if (v.s == cls) return true;
    // The short name under either module that has held it.
    const size_t dot = v.s.rfind('.');
    const std::string module = v.s.substr(0, dot == std::string::npos ? 0 : dot);
    return (module == kMetadataModule || module == kShardedTensorModule) &&
           v.s.substr(dot + 1) == cls;
  }

  // The field `field` of a dataclass object (its BUILD state dict); nullptr
  // when absent.
  const V* Field(const V& object, absl::string_view field) const {
    if (object.state.empty() || object.state[0].kind != Kind::kDict) return nullptr;
    for (const auto& [key, value] : object.state[0].entries) {
      if (key.kind == Kind::kStr && key.s == field) return &value;
    }
    return nullptr;
  }

  absl::StatusOr<std::vector<int64_t>> Size(const V& v, absl::string_view what) const {
    // torch.Size(tuple): an object whose one argument is the tuple.
    const V* tuple = &v;
    if (v.kind == Kind::kObject && v.s == "torch.Size" && v.items.size() == 1) tuple = &v.items[0];
    if (tuple->kind != Kind::kTuple && tuple->kind != Kind::kList) {
      return Error(absl::StrCat(what, " is not a torch.Size"));
    }
    std::vector<int64_t> out;
    for (const V& item : tuple->items) {
      if (item.kind != Kind::kInt || item.i < 0) {
        return Error(absl::StrCat(what, " holds something other than a non-negative int"));
      }
      out.push_back(item.i);
    }
    return out;
  }

  absl::StatusOr<c10::ScalarType> Dtype(const V& v, const std::string& key) const {
    if (v.kind == Kind::kGlobal) {
      for (const DtypeName& d : kDtypes) {
        if (v.s == absl::StrCat("torch.", d.name)) return d.dtype;
      }
    }
    return Error(absl::StrCat("entry '", absl::CEscape(key), "' has an unsupported dtype ",
                              v.kind == Kind::kGlobal ? v.s : "(not a torch dtype)"));
  }

  absl::StatusOr<DcpEntry> Entry(const std::string& key, const V& v) const {
    DcpEntry entry;
    entry.key = key;
    if (IsObject(v, "BytesStorageMetadata")) {
      entry.is_bytes = true;
      return entry;
    }
    if (!IsObject(v, "TensorStorageMetadata")) {
      return Error(absl::StrCat("entry '", absl::CEscape(key),
                                "' is neither TensorStorageMetadata nor BytesStorageMetadata"));
    }
    const V* properties = Field(v, "properties");
    const V* size = Field(v, "size");
    const V* chunks = Field(v, "chunks");
    if (properties == nullptr || size == nullptr || chunks == nullptr ||
        !IsObject(*properties, "TensorProperties") || properties->state.empty() ||
        chunks->kind != Kind::kList) {
      return Error(
          absl::StrCat("entry '", absl::CEscape(key), "' lacks properties, size or chunks"));
    }
    // TensorProperties.__getstate__: (dtype, layout, requires_grad,
    // memory format, pin_memory[, strides]).
    const V& state = properties->state[0];
    if (state.kind != Kind::kTuple || state.items.size() < 5) {
      return Error(absl::StrCat("entry '", absl::CEscape(key), "' has malformed TensorProperties"));
    }
    auto dtype = Dtype(state.items[0], key);
    if (!dtype.ok()) return dtype.status();
    entry.dtype = *dtype;
    const V& layout = state.items[1];
    const bool strided =
        (layout.kind == Kind::kGlobal && layout.s == "torch.strided") ||
        (layout.kind == Kind::kObject && layout.s == "torch.serialization._get_layout" &&
         layout.items.size() == 1 && layout.items[0].kind == Kind::kStr &&
         layout.items[0].s == "torch.strided");
    if (!strided) {
      return Error(absl::StrCat("entry '", absl::CEscape(key),
                                "' is not a strided (dense) tensor; only dense tensors are read"));
    }
    auto shape = Size(*size, absl::StrCat("the size of '", absl::CEscape(key), "'"));
    if (!shape.ok()) return shape.status();
    entry.size = *shape;
    int64_t numel = 1;
    for (int64_t d : entry.size) {
      if (__builtin_mul_overflow(numel, d, &numel)) {
        return Error(absl::StrCat("the size of '", absl::CEscape(key), "' overflows"));
      }
    }
    for (const V& c : chunks->items) {
      const V* offsets = IsObject(c, "ChunkStorageMetadata") ? Field(c, "offsets") : nullptr;
      const V* sizes = IsObject(c, "ChunkStorageMetadata") ? Field(c, "sizes") : nullptr;
      if (offsets == nullptr || sizes == nullptr) {
        return Error(absl::StrCat("a chunk of '", absl::CEscape(key), "' is malformed"));
      }
      DcpChunk chunk;
      auto o = Size(*offsets, absl::StrCat("a chunk offset of '", absl::CEscape(key), "'"));
      if (!o.ok()) return o.status();
      auto s = Size(*sizes, absl::StrCat("a chunk size of '", absl::CEscape(key), "'"));
      if (!s.ok()) return s.status();
      chunk.offsets = *o;
      chunk.sizes = *s;
      if (chunk.offsets.size() != entry.size.size() || chunk.sizes.size() != entry.size.size()) {
        return Error(absl::StrCat("a chunk of '", absl::CEscape(key), "' has ",
                                  chunk.offsets.size(), " dimensions; the tensor has ",
                                  entry.size.size()));
      }
      for (size_t d = 0; d < entry.size.size(); ++d) {
        if (chunk.offsets[d] > entry.size[d] || chunk.sizes[d] > entry.size[d] - chunk.offsets[d]) {
          return Error(absl::StrCat("the chunk at [", absl::StrJoin(chunk.offsets, ", "),
                                    "] of size [", absl::StrJoin(chunk.sizes, ", "),
                                    "] lies outside '", absl::CEscape(key), "' of size [",
                                    absl::StrJoin(entry.size, ", "), "]"));
        }
      }
      entry.chunks.push_back(std::move(chunk));
    }
    return entry;
  }

  absl::Status Storage(const V& key, const V& value, DcpMetadata& out) const {
    if (!IsObject(key, "MetadataIndex") || value.kind != Kind::kObject || value.s != kStorageInfo) {
      return Error("storage_data maps something other than MetadataIndex to _StorageInfo");
    }
    DcpIndex index;
    const V* fqn = Field(key, "fqn");
    const V* offset = Field(key, "offset");
    if (fqn == nullptr || fqn->kind != Kind::kStr) return Error("a MetadataIndex has no fqn");
    index.fqn = fqn->s;
    if (offset != nullptr && offset->kind != Kind::kNone) {
      auto o = Size(*offset, absl::StrCat("a storage offset of '", absl::CEscape(index.fqn), "'"));
      if (!o.ok()) return o.status();
      index.offset = *o;
    }
    const V* path = Field(value, "relative_path");
    const V* at = Field(value, "offset");
    const V* length = Field(value, "length");
    const V* transforms = Field(value, "transform_descriptors");
    if (path == nullptr || path->kind != Kind::kStr || at == nullptr || at->kind != Kind::kInt ||
        length == nullptr || length->kind != Kind::kInt || at->i < 0 || length->i < 0) {
      return Error(
          absl::StrCat("the storage record of '", absl::CEscape(index.fqn), "' is malformed"));
    }
    if (transforms != nullptr && transforms->kind != Kind::kNone &&
        !((transforms->kind == Kind::kList || transforms->kind == Kind::kTuple) &&
          transforms->items.empty())) {
      return Error(
          absl::StrCat("'", absl::CEscape(index.fqn),
                       "' is stored through storage-writer extensions (transform_descriptors);"
                       " only plain FileSystemWriter items are read"));
    }
    // A file name in the checkpoint directory, never a path out of it.
    if (path->s.empty() || path->s.find('/') != std::string::npos || path->s == "." ||
        path->s == ".." || path->s.find('\0') != std::string::npos) {
      return Error(absl::StrCat("the storage record of '", absl::CEscape(index.fqn),
                                "' names the file '", absl::CEscape(path->s),
                                "', not a file of the checkpoint directory"));
    }
    out.storage[index] =
        DcpStorage{path->s, static_cast<uint64_t>(at->i), static_cast<uint64_t>(length->i)};
    return absl::OkStatus();
  }

  absl::StatusOr<DcpMetadata> Run(const V& top) const {
    if (!IsObject(top, "Metadata")) return Error("the pickle is not a Metadata object");
    DcpMetadata out;
    const V* entries = Field(top, "state_dict_metadata");
    if (entries == nullptr || entries->kind != Kind::kDict) return Error("no state_dict_metadata");
    std::set<std::string> seen;
    for (const auto& [key, value] : entries->entries) {
      if (key.kind != Kind::kStr) return Error("a state_dict_metadata key is not a str");
      if (!seen.insert(key.s).second)
        return Error(absl::StrCat("key '", absl::CEscape(key.s), "' twice"));
      auto entry = Entry(key.s, value);
      if (!entry.ok()) return entry.status();
      out.entries.push_back(*std::move(entry));
    }
    const V* storage = Field(top, "storage_data");
    if (storage == nullptr || storage->kind != Kind::kDict) {
      return Error("no storage_data (not written by FileSystemWriter?)");
    }
    for (const auto& [key, value] : storage->entries) {
      absl::Status status = Storage(key, value, out);
      if (!status.ok()) return status;
    }
    for (const DcpEntry& e : out.entries) {
      if (e.is_bytes) {
        if (out.storage.count(DcpIndex{e.key, std::nullopt}) == 0) {
          return Error(absl::StrCat("'", absl::CEscape(e.key), "' has no storage record"));
        }
        continue;
      }
      for (const DcpChunk& c : e.chunks) {
        if (out.storage.count(DcpIndex{e.key, c.offsets}) == 0) {
          return Error(absl::StrCat("the chunk of '", absl::CEscape(e.key), "' at [",
                                    absl::StrJoin(c.offsets, ", "), "] has no storage record"));
        }
      }
    }
    const V* planner = Field(top, "planner_data");
    if (planner != nullptr && planner->kind == Kind::kDict) {
      for (const auto& [key, value] : planner->entries) {
        if (key.kind != Kind::kStr || value.kind != Kind::kTuple) continue;
        DcpPath path;
        for (const V& part : value.items) {
          if (part.kind == Kind::kStr)
            path.emplace_back(part.s);
          else if (part.kind == Kind::kInt)
            path.emplace_back(part.i);
        }
        out.paths[key.s] = std::move(path);
      }
    }
    const V* version = Field(top, "version");
    if (version != nullptr && version->kind == Kind::kStr) out.version = version->s;
    return out;
  }

 private:
  const std::string& name_;
};

// A protocol-2 pickle writer for the few shapes the metadata has.
class Pickler {
 public:
  Pickler() { out_ += "\x80\x02"; }
  std::string Finish() {
    out_ += '.';
    return std::move(out_);
  }

  void Global(absl::string_view module, absl::string_view name) {
    absl::StrAppend(&out_, "c", module, "\n", name, "\n");
  }
  void Str(absl::string_view s) {
    out_ += 'X';
    Le32(static_cast<uint32_t>(s.size()));
    out_.append(s.data(), s.size());
  }
  void Int(int64_t v) {
    if (v >= 0 && v < 256) {
      out_ += 'K';
      out_ += static_cast<char>(v);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      out_ += 'J';
      Le32(static_cast<uint32_t>(static_cast<int32_t>(v)));
    } else {
      out_ += '\x8a';
      out_ += '\x08';
      for (int k = 0; k < 8; ++k)
        out_ += static_cast<char>((static_cast<uint64_t>(v) >> (8 * k)) & 0xff);
    }
  }
  void None() { out_ += 'N'; }
  void Bool(bool b) { out_ += b ? '\x88' : '\x89'; }
  void Mark() { out_ += '('; }
  void Tuple() { out_ += 't'; }  // from the mark
  void EmptyTuple() { out_ += ')'; }
  void EmptyDict() { out_ += '}'; }
  void EmptyList() { out_ += ']'; }
  void SetItems() { out_ += 'u'; }  // from the mark
  void Appends() { out_ += 'e'; }   // from the mark
  void NewObj() { out_ += '\x81'; }
  void Reduce() { out_ += 'R'; }
  void Build() { out_ += 'b'; }

  // torch.Size(dims)
  void Size(const std::vector<int64_t>& dims) {
    Global("torch", "Size");
    Mark();
    Mark();
    for (int64_t d : dims) Int(d);
    Tuple();
    Tuple();
    Reduce();
  }
  // cls.__new__(cls), then its __dict__ from the mark's key/value pairs.
  void BeginDataclass(absl::string_view module, absl::string_view cls) {
    Global(module, cls);
    EmptyTuple();
    NewObj();
    EmptyDict();
    Mark();
  }
  void EndDataclass() {
    SetItems();
    Build();
  }

 private:
  void Le32(uint32_t v) {
    for (int k = 0; k < 4; ++k) out_ += static_cast<char>((v >> (8 * k)) & 0xff);
  }
  std::string out_;
};

}  // namespace

std::optional<std::string> DcpDtypeName(c10::ScalarType dtype) {
  for (const DtypeName& d : kDtypes) {
    if (d.dtype == dtype) return std::string(d.name);
  }
  return std::nullopt;
}

absl::StatusOr<DcpMetadata> ParseDcpMetadata(const std::string& name, const std::string& pickle) {
  auto top = UnpickleObjects(name, pickle, AllowedClasses());
  if (!top.ok()) return top.status();
  return Parser(name).Run(*top);
}

std::string SerializeDcpMetadata(const DcpMetadata& m) {
  Pickler p;
  p.BeginDataclass(kMetadataModule, "Metadata");

  p.Str("state_dict_metadata");
  p.EmptyDict();
  p.Mark();
  for (const DcpEntry& e : m.entries) {
    p.Str(e.key);
    if (e.is_bytes) {
      p.Global(kMetadataModule, "BytesStorageMetadata");
      p.EmptyTuple();
      p.NewObj();
      continue;
    }
    p.BeginDataclass(kMetadataModule, "TensorStorageMetadata");
    p.Str("properties");
    // TensorProperties.__setstate__((dtype, layout, requires_grad,
    // memory format, pin_memory, strides)).
    p.Global(kMetadataModule, "TensorProperties");
    p.EmptyTuple();
    p.NewObj();
    p.Mark();
    p.Global("torch", DcpDtypeName(e.dtype).value_or("float32"));
    p.Global("torch.serialization", "_get_layout");
    p.Mark();
    p.Str("torch.strided");
    p.Tuple();
    p.Reduce();
    p.Bool(false);
    p.Global(kMetadataModule, "_MEM_FORMAT_ENCODING");
    p.Mark();
    p.Int(0);  // TORCH_CONTIGUOUS_FORMAT
    p.Tuple();
    p.Reduce();
    p.Bool(false);
    p.None();
    p.Tuple();
    p.Build();
    p.Str("size");
    p.Size(e.size);
    p.Str("chunks");
    p.EmptyList();
    if (!e.chunks.empty()) {
      p.Mark();
      for (const DcpChunk& c : e.chunks) {
        p.BeginDataclass(kMetadataModule, "ChunkStorageMetadata");
        p.Str("offsets");
        p.Size(c.offsets);
        p.Str("sizes");
        p.Size(c.sizes);
        p.EndDataclass();
      }
      p.Appends();
    }
    p.EndDataclass();
  }
  p.SetItems();

  p.Str("planner_data");
  p.EmptyDict();
  if (!m.paths.empty()) {
    p.Mark();
    for (const auto& [key, path] : m.paths) {
      p.Str(key);
      p.Mark();
      for (const auto& part : path) {
        if (std::holds_alternative<std::string>(part))
          p.Str(std::get<std::string>(part));
        else
          p.Int(std::get<int64_t>(part));
      }
      p.Tuple();
    }
    p.SetItems();
  }

  p.Str("storage_data");
  p.EmptyDict();
  if (!m.storage.empty()) {
    p.Mark();
    for (const auto& [index, where] : m.storage) {
      p.BeginDataclass(kMetadataModule, "MetadataIndex");
      p.Str("fqn");
      p.Str(index.fqn);
      p.Str("offset");
      if (index.offset.has_value())
        p.Size(*index.offset);
      else
        p.None();
      p.Str("index");
      p.None();
      p.EndDataclass();
      const size_t dot = std::strlen(kStorageInfo) - std::strlen("._StorageInfo");
      p.BeginDataclass(absl::string_view(kStorageInfo, dot), "_StorageInfo");
      p.Str("relative_path");
      p.Str(where.relative_path);
      p.Str("offset");
      p.Int(static_cast<int64_t>(where.offset));
      p.Str("length");
      p.Int(static_cast<int64_t>(where.length));
      p.EndDataclass();
    }
    p.SetItems();
  }

  p.Str("storage_meta");
  p.None();
  p.Str("version");
  p.Str(m.version.empty() ? "1.0.0" : m.version);
  p.EndDataclass();
  return p.Finish();
}

}  // namespace formats
