#include "formats/safetensors/internal/safetensors_header.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace formats {
namespace internal {
namespace {

// The bytes of a tensor are copied as they are in memory.
static_assert(std::endian::native == std::endian::little,
              "safetensors files are little-endian; this host is not");

constexpr uint64_t kMaxHeaderBytes = kSafetensorsMaxHeaderBytes;

using Dtype = SafetensorsDtype;

constexpr Dtype kDtypes[] = {
    {"BOOL", c10::ScalarType::Bool},
    {"U8", c10::ScalarType::Byte},
    {"I8", c10::ScalarType::Char},
    {"I16", c10::ScalarType::Short},
    {"U16", c10::ScalarType::UInt16},
    {"I32", c10::ScalarType::Int},
    {"U32", c10::ScalarType::UInt32},
    {"I64", c10::ScalarType::Long},
    {"U64", c10::ScalarType::UInt64},
    {"F16", c10::ScalarType::Half},
    {"BF16", c10::ScalarType::BFloat16},
    {"F32", c10::ScalarType::Float},
    {"F64", c10::ScalarType::Double},
    {"C64", c10::ScalarType::ComplexFloat},
    {"F8_E4M3", c10::ScalarType::Float8_e4m3fn},
    {"F8_E5M2", c10::ScalarType::Float8_e5m2},
    {"F8_E4M3FNUZ", c10::ScalarType::Float8_e4m3fnuz},
    {"F8_E5M2FNUZ", c10::ScalarType::Float8_e5m2fnuz},
    {"F8_E8M0", c10::ScalarType::Float8_e8m0fnu},
};

// safetensors dtypes of fewer than 8 bits, packed: no torch dtype holds them
// one element per element.
constexpr absl::string_view kPackedDtypes[] = {"F4", "F6_E2M3", "F6_E3M2"};

}  // namespace

std::string SafetensorsDtypeNames() {
  std::vector<absl::string_view> names;
  for (const Dtype& d : kDtypes) names.push_back(d.name);
  return absl::StrJoin(names, ", ");
}

const SafetensorsDtype* SafetensorsDtypeOf(c10::ScalarType type) {
  for (const Dtype& d : kDtypes) {
    if (d.type == type) return &d;
  }
  return nullptr;
}

namespace {

const Dtype* ByName(absl::string_view name) {
  for (const Dtype& d : kDtypes) {
    if (d.name == name) return &d;
  }
  return nullptr;
}

}  // namespace

std::string Quote(absl::string_view s) {
  constexpr size_t kMaxShown = 200;
  if (s.size() <= kMaxShown) return absl::StrCat("'", absl::CHexEscape(s), "'");
  return absl::StrCat("'", absl::CHexEscape(s.substr(0, kMaxShown)), "'... (", s.size(), " bytes)");
}

bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (s.size() - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      const unsigned char d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    constexpr uint32_t kSmallest[] = {0, 0, 0x80, 0x800, 0x10000};  // no overlong forms
    if (cp < kSmallest[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

namespace {

void AppendJsonString(std::string* out, absl::string_view s) {
  out->push_back('"');
  for (const char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      case '\b': out->append("\\b"); break;
      case '\f': out->append("\\f"); break;
      default:
        if (c < 0x20) {
          absl::StrAppend(out, "\\u00", absl::Hex(c, absl::kZeroPad2));
        } else {
          out->push_back(ch);
        }
    }
  }
  out->push_back('"');
}

absl::Status ErrnoError(absl::string_view what, const std::string& path) {
  const int error = errno;
  return absl::Status(absl::ErrnoToStatusCode(error),
                      absl::StrCat(what, " ", path, ": ", std::strerror(error)));
}

// ---- reading the header -----------------------------------------------------

struct HeaderTensor {
  std::string name;
  const Dtype* dtype = nullptr;
  bool has_dtype = false;
  std::vector<int64_t> shape;
  bool has_shape = false;
  uint64_t offsets[2] = {0, 0};
  size_t offsets_seen = 0;
  bool has_offsets = false;
};

struct Header {
  std::vector<HeaderTensor> tensors;  // in the header's order
  std::map<std::string, std::string> metadata;
};

// nlohmann's SAX interface, parsing straight into a Header. Every value must
// be one the format has a place for; anything else (a nested object or
// array included) stops the parse at once, so the nesting never exceeds the
// format's three levels and no parse state grows with a crafted header.
class HeaderParser {
 public:
  using json = nlohmann::json;

  bool null() {
    if (expect_ == Expect::kMetadataObject) {  // the reference reads null as no metadata
      expect_ = Expect::kNothing;
      return true;
    }
    return Unexpected("null");
  }
  bool boolean(bool) { return Unexpected("a boolean"); }
  bool binary(json::binary_t&) { return Unexpected("binary data"); }

  bool number_unsigned(json::number_unsigned_t value) {
    if (in_ == In::kShape) {
      if (value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Fail(absl::StrCat(TensorWhat(), ": shape entry ", value,
                                 " is beyond 2^63 - 1, the largest torch size"));
      }
      current().shape.push_back(static_cast<int64_t>(value));
      return true;
    }
    if (in_ == In::kOffsets) {
      HeaderTensor& t = current();
      if (t.offsets_seen == 2) {
        return Fail(absl::StrCat(TensorWhat(),
                                 ": data_offsets has more than two entries; "
                                 "expected [begin, end]"));
      }
      t.offsets[t.offsets_seen++] = value;
      return true;
    }
    return Unexpected(absl::StrCat("the number ", value));
  }
  bool number_integer(json::number_integer_t value) {  // only negative ones arrive here
    if (in_ == In::kShape) {
      return Fail(absl::StrCat(TensorWhat(), ": shape entry ", value, " is negative"));
    }
    if (in_ == In::kOffsets) {
      return Fail(absl::StrCat(TensorWhat(), ": data_offsets entry ", value, " is negative"));
    }
    return Unexpected(absl::StrCat("the number ", value));
  }
  bool number_float(json::number_float_t, const json::string_t& text) {
    if (in_ == In::kShape || in_ == In::kOffsets) {
      return Fail(absl::StrCat(TensorWhat(), ": ", in_ == In::kShape ? "shape" : "data_offsets",
                               " entry ", text, " is not an integer from 0 to 2^64 - 1"));
    }
    return Unexpected(absl::StrCat("the number ", text));
  }

  bool string(json::string_t& value) {
    switch (expect_) {
      case Expect::kMetadataString:
        metadata_.emplace(std::move(metadata_key_), std::move(value));
        expect_ = Expect::kNothing;
        return true;
      case Expect::kDtype: {
        const Dtype* dtype = ByName(value);
        if (dtype == nullptr) {
          const bool packed = std::find(std::begin(kPackedDtypes), std::end(kPackedDtypes),
                                        value) != std::end(kPackedDtypes);
          return Fail(absl::StrCat(TensorWhat(), ": dtype ", Quote(value),
                                   packed
                                       ? " (packed, less than a byte an element) is not supported"
                                       : " is not a safetensors dtype",
                                   "; expected one of ", SafetensorsDtypeNames()));
        }
        current().dtype = dtype;
        expect_ = Expect::kNothing;
        return true;
      }
      default: return Unexpected(absl::StrCat("the string ", Quote(value)));
    }
  }

  bool start_object(std::size_t) {
    switch (expect_) {
      case Expect::kRoot: in_ = In::kRoot; break;
      case Expect::kMetadataObject: in_ = In::kMetadata; break;
      case Expect::kTensorObject:
        in_ = In::kTensor;
        header_.tensors.emplace_back();
        header_.tensors.back().name = std::move(name_);
        break;
      default: return Unexpected("an object");
    }
    expect_ = Expect::kNothing;
    return true;
  }

  bool key(json::string_t& key) {
    switch (in_) {
      case In::kRoot:
        if (key == "__metadata__") {
          if (seen_metadata_) return Fail("the key \"__metadata__\" appears twice");
          seen_metadata_ = true;
          expect_ = Expect::kMetadataObject;
        } else {
          name_ = std::move(key);
          expect_ = Expect::kTensorObject;
        }
        return true;
      case In::kMetadata:
        if (metadata_.count(key) != 0) {
          return Fail(absl::StrCat("__metadata__: the key ", Quote(key), " appears twice"));
        }
        metadata_key_ = std::move(key);
        expect_ = Expect::kMetadataString;
        return true;
      case In::kTensor: {
        HeaderTensor& t = current();
        bool* seen = key == "dtype"          ? &t.has_dtype
                     : key == "shape"        ? &t.has_shape
                     : key == "data_offsets" ? &t.has_offsets
                                             : nullptr;
        if (seen == nullptr) {
          return Fail(absl::StrCat(TensorWhat(), ": unknown field ", Quote(key),
                                   "; expected dtype, shape and data_offsets"));
        }
        if (*seen) return Fail(absl::StrCat(TensorWhat(), ": the field ", key, " appears twice"));
        *seen = true;
        expect_ = key == "dtype"   ? Expect::kDtype
                  : key == "shape" ? Expect::kShape
                                   : Expect::kOffsets;
        return true;
      }
      default:  // keys only come inside objects
        return Fail("unexpected key");
    }
  }

  bool end_object() {
    switch (in_) {
      case In::kRoot: in_ = In::kDone; return true;
      case In::kMetadata: in_ = In::kRoot; return true;
      case In::kTensor: {
        const HeaderTensor& t = current();
        for (const auto& [seen, field] :
             {std::pair{t.has_dtype, "dtype"}, std::pair{t.has_shape, "shape"},
              std::pair{t.has_offsets, "data_offsets"}}) {
          if (!seen) return Fail(absl::StrCat(TensorWhat(), ": no ", field, " field"));
        }
        in_ = In::kRoot;
        return true;
      }
      default: return Fail("unexpected end of an object");
    }
  }

  bool start_array(std::size_t) {
    if (expect_ == Expect::kShape) {
      in_ = In::kShape;
    } else if (expect_ == Expect::kOffsets) {
      in_ = In::kOffsets;
    } else {
      return Unexpected("an array");
    }
    expect_ = Expect::kNothing;
    return true;
  }

  bool end_array() {
    if (in_ == In::kOffsets && current().offsets_seen != 2) {
      return Fail(absl::StrCat(TensorWhat(), ": data_offsets has ", current().offsets_seen,
                               " entries; expected [begin, end]"));
    }
    in_ = In::kTensor;
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const json::exception& e) {
    return Fail(absl::StrCat("the header is not valid JSON: ", e.what()));
  }

  const std::string& error() const { return error_; }
  bool done() const { return in_ == In::kDone; }
  Header TakeHeader() {
    header_.metadata = std::move(metadata_);
    return std::move(header_);
  }

 private:
  // What the next value is for (set by a key, or at the start).
  enum class Expect {
    kNothing,
    kRoot,
    kMetadataObject,
    kMetadataString,
    kTensorObject,
    kDtype,
    kShape,
    kOffsets
  };
  // The innermost object or array the parse is in.
  enum class In { kTop, kRoot, kMetadata, kTensor, kShape, kOffsets, kDone };

  HeaderTensor& current() { return header_.tensors.back(); }

  std::string TensorWhat() {
    return absl::StrCat("tensor ",
                        Quote(expect_ == Expect::kTensorObject ? name_ : current().name));
  }

  bool Fail(std::string message) {
    if (error_.empty()) error_ = std::move(message);
    return false;
  }

  // `what` where the format has no place for it.
  bool Unexpected(const std::string& what) {
    switch (expect_) {
      case Expect::kRoot: return Fail(absl::StrCat("the header is ", what, ", not a JSON object"));
      case Expect::kMetadataObject:
        return Fail(absl::StrCat("__metadata__ is ", what, "; expected an object of strings"));
      case Expect::kMetadataString:
        return Fail(absl::StrCat("__metadata__ value of ", Quote(metadata_key_), " is ", what,
                                 "; expected a string"));
      case Expect::kTensorObject:
        return Fail(absl::StrCat(TensorWhat(), " is ", what,
                                 "; expected an object {dtype, shape, data_offsets}"));
      case Expect::kDtype:
        return Fail(absl::StrCat(TensorWhat(), ": dtype is ", what, "; expected a string"));
      case Expect::kShape:
        return Fail(
            absl::StrCat(TensorWhat(), ": shape is ", what, "; expected an array of integers"));
      case Expect::kOffsets:
        return Fail(
            absl::StrCat(TensorWhat(), ": data_offsets is ", what, "; expected [begin, end]"));
      case Expect::kNothing: break;
    }
    if (in_ == In::kShape || in_ == In::kOffsets) {
      return Fail(absl::StrCat(TensorWhat(), ": ", in_ == In::kShape ? "shape" : "data_offsets",
                               " holds ", what,
                               "; expected integers (the header nests no "
                               "deeper than its three levels)"));
    }
    return Fail(absl::StrCat("unexpected ", what));
  }

  Expect expect_ = Expect::kRoot;
  In in_ = In::kTop;
  Header header_;
  std::map<std::string, std::string> metadata_;
  std::string name_;          // the tensor whose object comes next
  std::string metadata_key_;  // the metadata entry whose string comes next
  bool seen_metadata_ = false;
  std::string error_;
};

}  // namespace

absl::Status ReadAt(int fd, const std::string& path, uint64_t offset, void* out, uint64_t size,
                    absl::string_view what) {
  char* p = static_cast<char*>(out);
  while (size > 0) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(size, uint64_t{1} << 30));
    const ssize_t n = ::pread(fd, p, chunk, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(absl::StrCat("cannot read ", what, " of"), path);
    }
    if (n == 0) {
      return absl::DataLossError(absl::StrCat(path, ": ends at byte ", offset, " while reading ",
                                              what, " (did it shrink while being read?)"));
    }
    p += n;
    offset += static_cast<uint64_t>(n);
    size -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

namespace {

// Each tensor's byte length against its dtype and shape and the data
// buffer's `data_bytes`; then that the tensors tile the buffer exactly.
absl::Status CheckLayout(const std::string& path, const Header& header, uint64_t data_bytes) {
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat(path, ": ", what));
  };
  for (const HeaderTensor& t : header.tensors) {
    const std::string name = absl::StrCat("tensor ", Quote(t.name));
    // Torch's strides are products of the sizes after a dimension, so the
    // nonzero sizes' product must fit too (an empty [0, 2^62, 2^62] too).
    int64_t numel = 1, nonzero = 1;
    for (const int64_t d : t.shape) {
      if (__builtin_mul_overflow(nonzero, std::max<int64_t>(d, 1), &nonzero)) {
        return bad(absl::StrCat(name, ": shape ", ShapeString(t.shape),
                                ": the product of its sizes overflows 2^63 - 1"));
      }
      numel *= d;
    }
    const uint64_t element = c10::elementSize(t.dtype->type);
    uint64_t bytes;
    if (__builtin_mul_overflow(static_cast<uint64_t>(numel), element, &bytes)) {
      return bad(absl::StrCat(name, ": shape ", ShapeString(t.shape), " of ", t.dtype->name,
                              " is more than 2^64 - 1 bytes"));
    }
    const uint64_t begin = t.offsets[0], end = t.offsets[1];
    if (begin > end) {
      return bad(absl::StrCat(name, ": data_offsets [", begin, ", ", end,
                              "] decrease; expected [begin, end] with begin <= end"));
    }
    if (end - begin != bytes) {
      return bad(absl::StrCat(name, ": data_offsets [", begin, ", ", end, "] hold ", end - begin,
                              " bytes, but ", t.dtype->name, " of shape ", ShapeString(t.shape),
                              " takes ", numel, " * ", element, " = ", bytes));
    }
    if (end > data_bytes) {
      return bad(absl::StrCat(name, ": data_offsets [", begin, ", ", end,
                              "] run past the end of the data, which holds ", data_bytes,
                              " bytes after the header"));
    }
  }
  std::vector<size_t> order(header.tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  auto offsets = [&](size_t i) {
    return std::pair(header.tensors[i].offsets[0], header.tensors[i].offsets[1]);
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return offsets(a) < offsets(b); });
  uint64_t covered = 0;
  const HeaderTensor* previous = nullptr;
  for (const size_t i : order) {
    const HeaderTensor& t = header.tensors[i];
    if (t.offsets[0] < covered) {
      return bad(absl::StrCat("tensors ", Quote(previous->name), " [", previous->offsets[0], ", ",
                              previous->offsets[1], ") and ", Quote(t.name), " [", t.offsets[0],
                              ", ", t.offsets[1], ") overlap"));
    }
    if (t.offsets[0] > covered) {
      return bad(absl::StrCat("no tensor holds bytes [", covered, ", ", t.offsets[0],
                              ") of the data (a gap before tensor ", Quote(t.name),
                              "); the tensors must cover it without gaps"));
    }
    covered = t.offsets[1];
    previous = &t;
  }
  if (covered != data_bytes) {
    return bad(absl::StrCat(data_bytes - covered,
                            " bytes after the last tensor (the tensors "
                            "end at byte ",
                            covered, " of the data, which holds ", data_bytes,
                            " bytes after the header)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(int fd, const std::string& path,
                                                        uint64_t max_bytes) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoError("cannot stat", path);
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat(path, ": ", what));
  };
  if (file_bytes < 8) {
    return bad(absl::StrCat("only ", file_bytes,
                            " bytes; a safetensors file starts with an "
                            "8-byte header length"));
  }
  uint64_t header_bytes = 0;
  {
    char length[8];
    absl::Status status = ReadAt(fd, path, 0, length, sizeof(length), "the header length");
    if (!status.ok()) return status;
    std::memcpy(&header_bytes, length, sizeof(length));
  }
  if (header_bytes > kMaxHeaderBytes) {
    return bad(absl::StrCat("header length ", header_bytes, " is more than safetensors' limit of ",
                            kMaxHeaderBytes, " bytes"));
  }
  if (header_bytes > file_bytes - 8) {
    return bad(absl::StrCat("header length ", header_bytes, " runs past the end of the file (",
                            file_bytes, " bytes: at most ", file_bytes - 8, " bytes of header)"));
  }
  // Everything after the length: the header and the tensors' bytes, which a
  // valid file's tensors cover exactly.
  if (max_bytes != 0 && file_bytes - 8 > max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat(path, ": its header and tensors take ", file_bytes - 8, " bytes (",
                     header_bytes, " of them the header), more than the load's budget of ",
                     max_bytes, " bytes (max_bytes); refused before reading any of them"));
  }
  const uint64_t data_start = 8 + header_bytes;
  const uint64_t data_bytes = file_bytes - data_start;

  Header header;
  {
    std::string text(header_bytes, '\0');
    absl::Status status = ReadAt(fd, path, 8, text.data(), header_bytes, "the header");
    if (!status.ok()) return status;
    // JSON has no raw NUL bytes (in strings they are escaped), and
    // nlohmann's parser would take one for the end of its input.
    if (const void* nul = std::memchr(text.data(), '\0', text.size())) {
      return bad(absl::StrCat("the header holds a NUL byte at offset ",
                              static_cast<const char*>(nul) - text.data(), " (JSON has none)"));
    }
    HeaderParser parser;
    bool parsed = false;
    try {
      parsed = nlohmann::json::sax_parse(text.data(), text.data() + text.size(), &parser);
    } catch (const nlohmann::json::exception& e) {  // not expected from the SAX parser
      return bad(absl::StrCat("the header is not valid JSON: ", e.what()));
    }
    if (!parsed || !parser.done()) {
      return bad(parser.error().empty() ? "the header is not a complete JSON object"
                                        : parser.error());
    }
    header = parser.TakeHeader();
  }
  {
    // Duplicate names (the reference keeps the last; a file that says two
    // things about one name is refused here).
    std::vector<const std::string*> names;
    names.reserve(header.tensors.size());
    for (const HeaderTensor& t : header.tensors) names.push_back(&t.name);
    std::sort(names.begin(), names.end(),
              [](const std::string* a, const std::string* b) { return *a < *b; });
    for (size_t i = 1; i < names.size(); ++i) {
      if (*names[i] == *names[i - 1]) {
        return bad(absl::StrCat("the tensor name ", Quote(*names[i]), " appears twice"));
      }
    }
  }
  absl::Status status = CheckLayout(path, header, data_bytes);
  if (!status.ok()) return status;

  SafetensorsHeader out;
  out.metadata = std::move(header.metadata);
  out.data_start = data_start;
  out.data_bytes = data_bytes;
  out.tensors.reserve(header.tensors.size());
  for (HeaderTensor& t : header.tensors) {
    SafetensorsHeaderTensor& o = out.tensors.emplace_back();
    o.name = std::move(t.name);
    o.dtype = t.dtype;
    o.numel = 1;
    for (const int64_t d : t.shape) o.numel *= d;  // CheckLayout: no overflow
    o.shape = std::move(t.shape);
    o.begin = t.offsets[0];
    o.end = t.offsets[1];
  }
  return out;
}

absl::Status CheckBoolBytes(const std::string& path, const std::string& tensor, const void* bytes,
                            uint64_t count, uint64_t first_element) {
  // A bool byte other than 0 or 1 is undefined behaviour for whoever reads
  // it as a bool.
  const uint8_t* b = static_cast<const uint8_t*>(bytes);
  for (uint64_t i = 0; i < count; ++i) {
    if (b[i] > 1) {
      return absl::DataLossError(absl::StrCat(
          path, ": tensor ", Quote(tensor), " (BOOL) holds the byte ", static_cast<int>(b[i]),
          " at element ", first_element + i, "; expected 0 or 1"));
    }
  }
  return absl::OkStatus();
}

uint64_t LayOutBySize(std::vector<SafetensorsEntry>& entries) {
  std::vector<size_t> layout(entries.size());
  std::iota(layout.begin(), layout.end(), size_t{0});
  std::stable_sort(layout.begin(), layout.end(), [&](size_t a, size_t b) {
    return c10::elementSize(entries[a].dtype->type) > c10::elementSize(entries[b].dtype->type);
  });
  uint64_t data_bytes = 0;
  for (const size_t i : layout) {
    entries[i].begin = data_bytes;
    data_bytes += entries[i].bytes;
  }
  return data_bytes;
}

std::string SafetensorsHeaderText(const std::map<std::string, std::string>& metadata,
                                  const std::vector<SafetensorsEntry>& entries) {
  std::string header = "{\"__metadata__\":{";
  bool first = true;
  for (const auto& [key, value] : metadata) {
    if (!first) header.push_back(',');
    first = false;
    AppendJsonString(&header, key);
    header.push_back(':');
    AppendJsonString(&header, value);
  }
  header.push_back('}');
  for (const SafetensorsEntry& e : entries) {
    header.push_back(',');
    AppendJsonString(&header, e.name);
    absl::StrAppend(&header, ":{\"dtype\":\"", e.dtype->name, "\",\"shape\":[",
                    absl::StrJoin(e.shape, ","), "],\"data_offsets\":[", e.begin, ",",
                    e.begin + e.bytes, "]}");
  }
  header.push_back('}');
  // Spaces up to a multiple of 8, as Python's writer pads: the data then
  // starts 8-byte aligned (8 bytes of length + the header).
  header.append((8 - header.size() % 8) % 8, ' ');
  return header;
}

}  // namespace internal
}  // namespace formats
