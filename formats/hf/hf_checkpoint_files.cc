#include "formats/hf/hf_checkpoint_files.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>  // renameat2
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <unordered_set>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "formats/io/file_io.h"
#include "formats/safetensors/internal/safetensors_header.h"

namespace formats {
namespace {

using internal::Quote;
using internal::ShapeString;

// The index is read whole; a real one is ~100 bytes a tensor.
constexpr uint64_t kMaxIndexBytes = internal::kSafetensorsMaxHeaderBytes;
// Values the index has no use for are skipped, to this depth.
constexpr int kMaxIndexDepth = 64;

absl::Status ErrnoError(absl::string_view what, const std::string& path) {
  const int error = errno;
  return absl::Status(absl::ErrnoToStatusCode(error),
                      absl::StrCat(what, " ", path, ": ", std::strerror(error)));
}

std::string Join(const std::string& dir, absl::string_view name) {
  return absl::StrCat(dir, dir.empty() || dir.back() == '/' ? "" : "/", name);
}

// `dir` without trailing slashes ("/" stays).
std::string StripSlashes(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

bool IsPlainFileName(absl::string_view name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find('/') == absl::string_view::npos && name.find('\0') == absl::string_view::npos;
}

// The files an export holds: weights, the index, configs, tokenizer files.
bool IsExportFileName(absl::string_view name) {
  return IsPlainFileName(name) &&
         (absl::EndsWith(name, ".safetensors") || absl::EndsWith(name, ".json") ||
          absl::EndsWith(name, ".jinja") || name == "tokenizer.model" || name == "merges.txt" ||
          name == "vocab.txt");
}

// 0: missing; 1: present (stat follows links); an error otherwise.
absl::StatusOr<bool> Exists(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) return true;
  if (errno == ENOENT) return false;
  return ErrnoError("cannot stat", path);
}

std::string RandomHex() {
  std::random_device device;
  return absl::StrFormat("%08x", device());
}

// ---- the index ---------------------------------------------------------------

struct Index {
  std::vector<std::pair<std::string, std::string>> weight_map;  // in the index's order
  std::optional<uint64_t> total_size;
};

// nlohmann's SAX interface, parsing straight into an Index: "weight_map" an
// object of strings (no duplicate names), "metadata" an object whose
// "total_size" is a non-negative integer; every other value is skipped (to
// kMaxIndexDepth levels), so nothing of a crafted index grows but the map.
class IndexParser {
 public:
  using json = nlohmann::json;

  bool null() {
    if (expect_ == Expect::kMetadata) {  // no metadata
      expect_ = Expect::kNothing;
      return true;
    }
    return Scalar("null");
  }
  bool boolean(bool) { return Scalar("a boolean"); }
  bool binary(json::binary_t&) { return Scalar("binary data"); }
  bool number_integer(json::number_integer_t value) {  // negative ones only
    if (expect_ == Expect::kTotalSize && skip_depth_ < 0) {
      return Fail(absl::StrCat("metadata.total_size is ", value, "; expected an integer >= 0"));
    }
    return Scalar(absl::StrCat("the number ", value));
  }
  bool number_unsigned(json::number_unsigned_t value) {
    if (expect_ == Expect::kTotalSize && skip_depth_ < 0) {
      index_.total_size = value;
      expect_ = Expect::kNothing;
      return true;
    }
    return Scalar(absl::StrCat("the number ", value));
  }
  bool number_float(json::number_float_t value, const json::string_t& text) {
    if (expect_ == Expect::kTotalSize && skip_depth_ < 0) {
      // Some writers give it as a float: taken when it is a whole number
      // that a double holds exactly.
      if (value >= 0 && value <= 9007199254740992.0 &&
          value == static_cast<double>(static_cast<uint64_t>(value))) {
        index_.total_size = static_cast<uint64_t>(value);
        expect_ = Expect::kNothing;
        return true;
      }
      return Fail(absl::StrCat("metadata.total_size is ", text, "; expected an integer >= 0"));
    }
    return Scalar(absl::StrCat("the number ", text));
  }
  bool string(json::string_t& value) {
    if (expect_ == Expect::kFile && skip_depth_ < 0) {
      index_.weight_map.emplace_back(std::move(tensor_), std::move(value));
      expect_ = Expect::kNothing;
      return true;
    }
    return Scalar(absl::StrCat("the string ", Quote(value)));
  }

  bool start_object(std::size_t) {
    if (!Enter()) return false;
    if (skip_depth_ >= 0) return true;
    switch (expect_) {
      case Expect::kRoot: in_ = In::kRoot; break;
      case Expect::kWeightMap: in_ = In::kWeightMap; break;
      case Expect::kMetadata: in_ = In::kMetadata; break;
      case Expect::kSkipped: skip_depth_ = depth_ - 1; break;
      default: return Unexpected("an object");
    }
    expect_ = Expect::kNothing;
    return true;
  }
  bool start_array(std::size_t) {
    if (!Enter()) return false;
    if (skip_depth_ >= 0) return true;
    if (expect_ != Expect::kSkipped) return Unexpected("an array");
    skip_depth_ = depth_ - 1;
    expect_ = Expect::kNothing;
    return true;
  }
  bool end_object() { return Leave(); }
  bool end_array() { return Leave(); }

  bool key(json::string_t& key) {
    if (skip_depth_ >= 0) return true;
    switch (in_) {
      case In::kRoot:
        if (key == "weight_map" || key == "metadata") {
          bool& seen = key == "weight_map" ? seen_weight_map_ : seen_metadata_;
          if (seen) return Fail(absl::StrCat("the key \"", key, "\" appears twice"));
          seen = true;
          expect_ = key == "weight_map" ? Expect::kWeightMap : Expect::kMetadata;
        } else {
          expect_ = Expect::kSkipped;
        }
        return true;
      case In::kWeightMap:
        if (!names_.insert(key).second) {
          return Fail(absl::StrCat("weight_map: the tensor ", Quote(key), " appears twice"));
        }
        tensor_ = std::move(key);
        expect_ = Expect::kFile;
        return true;
      case In::kMetadata:
        if (key == "total_size") {
          if (seen_total_size_) return Fail("metadata: the key \"total_size\" appears twice");
          seen_total_size_ = true;
          expect_ = Expect::kTotalSize;
        } else {
          expect_ = Expect::kSkipped;
        }
        return true;
      default: return Fail("unexpected key");
    }
  }

  bool parse_error(std::size_t, const std::string&, const json::exception& e) {
    return Fail(absl::StrCat("not valid JSON: ", e.what()));
  }

  const std::string& error() const { return error_; }
  bool done() const { return in_ == In::kDone; }
  bool seen_weight_map() const { return seen_weight_map_; }
  Index TakeIndex() { return std::move(index_); }

 private:
  enum class Expect { kNothing, kRoot, kWeightMap, kMetadata, kFile, kTotalSize, kSkipped };
  enum class In { kTop, kRoot, kWeightMap, kMetadata, kDone };

  bool Enter() {
    if (++depth_ > kMaxIndexDepth) {
      return Fail(absl::StrCat("nests deeper than ", kMaxIndexDepth, " levels"));
    }
    return true;
  }
  bool Leave() {
    --depth_;
    if (skip_depth_ >= 0) {
      if (depth_ == skip_depth_) skip_depth_ = -1;
      return true;
    }
    switch (in_) {
      case In::kRoot: in_ = In::kDone; return true;
      case In::kWeightMap:
      case In::kMetadata: in_ = In::kRoot; return true;
      default: return Fail("unexpected end of an object");
    }
  }
  // A value that is not an object or array.
  bool Scalar(const std::string& what) {
    if (skip_depth_ >= 0) return true;
    if (expect_ == Expect::kSkipped) {
      expect_ = Expect::kNothing;
      return true;
    }
    return Unexpected(what);
  }
  bool Unexpected(const std::string& what) {
    switch (expect_) {
      case Expect::kRoot: return Fail(absl::StrCat("the index is ", what, ", not a JSON object"));
      case Expect::kWeightMap:
        return Fail(absl::StrCat("weight_map is ", what, "; expected an object {tensor: file}"));
      case Expect::kMetadata:
        return Fail(absl::StrCat("metadata is ", what, "; expected an object"));
      case Expect::kFile:
        return Fail(absl::StrCat("weight_map: tensor ", Quote(tensor_), " maps to ", what,
                                 "; expected a file name"));
      case Expect::kTotalSize:
        return Fail(absl::StrCat("metadata.total_size is ", what, "; expected an integer >= 0"));
      default: return Fail(absl::StrCat("unexpected ", what));
    }
  }
  bool Fail(std::string message) {
    if (error_.empty()) error_ = std::move(message);
    return false;
  }

  Expect expect_ = Expect::kRoot;
  In in_ = In::kTop;
  int depth_ = 0;
  int skip_depth_ = -1;  // >= 0 while skipping a value, its depth outside
  bool seen_weight_map_ = false;
  bool seen_metadata_ = false;
  bool seen_total_size_ = false;
  std::unordered_set<std::string> names_;
  std::string tensor_;  // the weight_map entry whose file comes next
  Index index_;
  std::string error_;
};

absl::StatusOr<Index> ReadIndex(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("cannot open", path);
  std::string text;
  absl::Status status;
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    status = ErrnoError("cannot stat", path);
  } else if (!S_ISREG(st.st_mode)) {
    status = absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  } else if (static_cast<uint64_t>(st.st_size) > kMaxIndexBytes) {
    status = absl::DataLossError(absl::StrCat(path, ": ", st.st_size, " bytes, more than the ",
                                              kMaxIndexBytes, " an index may take"));
  } else {
    text.resize(static_cast<size_t>(st.st_size));
    status = internal::ReadAt(fd, path, 0, text.data(), text.size(), "the index");
  }
  ::close(fd);
  if (!status.ok()) return status;
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat(path, ": ", what));
  };
  if (const void* nul = std::memchr(text.data(), '\0', text.size())) {
    return bad(absl::StrCat("holds a NUL byte at offset ",
                            static_cast<const char*>(nul) - text.data(), " (JSON has none)"));
  }
  IndexParser parser;
  bool parsed = false;
  try {
    parsed = nlohmann::json::sax_parse(text.data(), text.data() + text.size(), &parser);
  } catch (const nlohmann::json::exception& e) {  // not expected from the SAX parser
    return bad(absl::StrCat("not valid JSON: ", e.what()));
  }
  if (!parsed || !parser.done()) {
    return bad(parser.error().empty() ? "not a complete JSON object" : parser.error());
  }
  if (!parser.seen_weight_map()) return bad("no \"weight_map\"; expected {tensor: file}");
  return parser.TakeIndex();
}

}  // namespace

// ---- HfCheckpointFiles ------------------------------------------------------------

absl::StatusOr<HfCheckpointFiles> HfCheckpointFiles::Open(const std::string& dir_arg) {
  constexpr char kWho[] = "formats::HfCheckpointFiles::Open";
  const std::string dir = StripSlashes(dir_arg);
  {
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0) {
      return ErrnoError(absl::StrCat(kWho, ": cannot open the checkpoint directory"), dir);
    }
    if (!S_ISDIR(st.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat(kWho, ": ", dir, " is not a directory; expected a checkpoint directory"));
    }
  }
  const std::string index_path = Join(dir, kHfSafetensorsIndexFile);
  const std::string single_path = Join(dir, kHfSafetensorsFile);
  auto has_index = Exists(index_path);
  if (!has_index.ok()) return has_index.status();
  auto has_single = Exists(single_path);
  if (!has_single.ok()) return has_single.status();

  HfCheckpointFiles out;
  out.dir_ = dir;
  if (*has_index && *has_single) {
    return absl::FailedPreconditionError(
        absl::StrCat(kWho, ": ", dir, " holds both ", kHfSafetensorsFile, " and ",
                     kHfSafetensorsIndexFile, "; expected one of them (transformers would read ",
                     kHfSafetensorsFile, " and ignore the index)"));
  }
  if (*has_single) {
    auto file = SafetensorsFile::Open(single_path);
    if (!file.ok()) return file.status();
    out.file_names_.push_back(kHfSafetensorsFile);
    out.names_ = file->names();
    for (const std::string& name : out.names_) out.tensors_.emplace(name, 0);
    out.files_.push_back(*std::move(file));
    std::sort(out.names_.begin(), out.names_.end());
    return out;
  }
  if (!*has_index) {
    std::string hint;
    for (const char* torch_file : {"pytorch_model.bin", "pytorch_model.bin.index.json"}) {
      auto exists = Exists(Join(dir, torch_file));
      if (exists.ok() && *exists) {
        hint = absl::StrCat(" (it holds ", torch_file,
                            ", a torch.save checkpoint: only safetensors checkpoints are read; "
                            "convert it, e.g. with transformers' save_pretrained)");
        break;
      }
    }
    return absl::NotFoundError(absl::StrCat(kWho, ": ", dir, " holds neither ", kHfSafetensorsFile,
                                            " nor ", kHfSafetensorsIndexFile, hint));
  }

  out.sharded_ = true;
  auto index = ReadIndex(index_path);
  if (!index.ok()) return index.status();
  // The files, in the order the index first names them.
  std::unordered_map<std::string, size_t> file_number;
  for (const auto& [tensor, file] : index->weight_map) {
    if (file_number.count(file) != 0) continue;
    if (!IsPlainFileName(file)) {
      return absl::InvalidArgumentError(absl::StrCat(
          kWho, ": ", index_path, ": tensor ", Quote(tensor), " maps to the file ", Quote(file),
          "; expected a plain file name inside ", dir, " (no '/', not '.' or '..')"));
    }
    const std::string path = Join(dir, file);
    auto exists = Exists(path);
    if (!exists.ok()) return exists.status();
    if (!*exists) {
      return absl::NotFoundError(absl::StrCat(kWho, ": ", index_path, " maps tensor ",
                                              Quote(tensor), " to the file ", Quote(file),
                                              ", which does not exist (", path, ")"));
    }
    auto opened = SafetensorsFile::Open(path);
    if (!opened.ok()) return opened.status();
    file_number.emplace(file, out.files_.size());
    out.file_names_.push_back(file);
    out.files_.push_back(*std::move(opened));
  }
  // Where the headers put each tensor.
  std::unordered_map<std::string, size_t> in_header;
  for (size_t f = 0; f < out.files_.size(); ++f) {
    for (const std::string& name : out.files_[f].names()) {
      auto [it, inserted] = in_header.emplace(name, f);
      if (!inserted) {
        return absl::DataLossError(
            absl::StrCat(kWho, ": ", dir, ": tensor ", Quote(name), " is in the headers of both ",
                         out.file_names_[it->second], " and ", out.file_names_[f],
                         "; expected each tensor in one file"));
      }
    }
  }
  for (const auto& [tensor, file] : index->weight_map) {
    auto it = in_header.find(tensor);
    if (it == in_header.end()) {
      return absl::DataLossError(absl::StrCat(kWho, ": ", index_path, " maps tensor ",
                                              Quote(tensor), " to ", file,
                                              ", whose header has no such tensor (nor has any "
                                              "other file's the index names)"));
    }
    if (out.file_names_[it->second] != file) {
      return absl::DataLossError(
          absl::StrCat(kWho, ": ", index_path, " maps tensor ", Quote(tensor), " to ", file,
                       ", whose header has no such tensor; it is in the header of ",
                       out.file_names_[it->second]));
    }
    out.tensors_.emplace(tensor, it->second);
  }
  for (size_t f = 0; f < out.files_.size(); ++f) {
    for (const std::string& name : out.files_[f].names()) {
      if (out.tensors_.count(name) == 0) {
        return absl::DataLossError(absl::StrCat(kWho, ": ", dir, ": tensor ", Quote(name),
                                                " is in the header of ", out.file_names_[f],
                                                " but not in ", kHfSafetensorsIndexFile));
      }
    }
  }
  if (index->total_size.has_value()) {
    uint64_t total = 0;
    for (const auto& [name, f] : out.tensors_) {
      total +=
          static_cast<uint64_t>(out.files_[f].info(name)->bytes);  // each below its file's size
    }
    if (total != *index->total_size) {
      return absl::DataLossError(absl::StrCat(
          kWho, ": ", index_path, ": metadata.total_size is ", *index->total_size,
          " bytes, but the ", out.tensors_.size(), " tensors of its files take ", total));
    }
  }
  out.names_.reserve(index->weight_map.size());
  for (auto& [tensor, file] : index->weight_map) out.names_.push_back(std::move(tensor));
  std::sort(out.names_.begin(), out.names_.end());
  return out;
}

std::vector<std::string> HfCheckpointFiles::files() const {
  std::vector<std::string> names = file_names_;
  std::sort(names.begin(), names.end());
  return names;
}

absl::StatusOr<const SafetensorsFile*> HfCheckpointFiles::FileOf(const std::string& name,
                                                                 const char* who) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(who, ": the checkpoint ", dir_, " has no tensor ",
                                            Quote(name), " (", names_.size(), " tensors)"));
  }
  return &files_[it->second];
}

absl::StatusOr<HfTensorInfo> HfCheckpointFiles::info(const std::string& name) const {
  auto file = FileOf(name, "formats::HfCheckpointFiles::info");
  if (!file.ok()) return file.status();
  auto info = (*file)->info(name);
  if (!info.ok()) return info.status();
  HfTensorInfo out;
  out.dtype = info->dtype;
  out.shape = std::move(info->shape);
  out.numel = info->numel;
  out.bytes = info->bytes;
  out.file = file_names_[tensors_.at(name)];
  return out;
}

absl::StatusOr<at::Tensor> HfCheckpointFiles::Read(const std::string& name, int64_t element_offset,
                                                   int64_t numel) const {
  auto file = FileOf(name, "formats::HfCheckpointFiles::Read");
  if (!file.ok()) return file.status();
  return (*file)->Read(name, element_offset, numel);
}

absl::Status HfCheckpointFiles::ReadInto(const std::string& name, int64_t element_offset,
                                         const at::Tensor& out) const {
  auto file = FileOf(name, "formats::HfCheckpointFiles::ReadInto");
  if (!file.ok()) return file.status();
  return (*file)->ReadInto(name, element_offset, out);
}

absl::StatusOr<at::Tensor> HfCheckpointFiles::ReadAll(const std::string& name) const {
  auto file = FileOf(name, "formats::HfCheckpointFiles::ReadAll");
  if (!file.ok()) return file.status();
  return (*file)->ReadAll(name);
}

// ---- HfCheckpointWriter -----------------------------------------------------------

namespace {

constexpr char kWriterWho[] = "formats::HfCheckpointWriter";

std::string Dirname(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string Basename(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

absl::Status WriteAllAt(int fd, const std::string& path, const void* data, uint64_t size,
                        uint64_t offset) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(size, uint64_t{1} << 30));
    const ssize_t n = ::pwrite(fd, p, chunk, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("cannot write", path);
    }
    p += n;
    offset += static_cast<uint64_t>(n);
    size -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status FsyncAndClose(int fd, const std::string& path) {
  if (::fsync(fd) != 0) {
    absl::Status status = ErrnoError("cannot fsync", path);
    ::close(fd);
    return status;
  }
  if (::close(fd) != 0) return ErrnoError("cannot close", path);
  return absl::OkStatus();
}

// OK when `dir` does not exist or may be replaced: an empty directory, or a
// previous export (see Create's comment).
absl::Status CheckReplaceable(const std::string& dir, bool* exists) {
  *exists = false;
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return ErrnoError(absl::StrCat(kWriterWho, ": cannot stat"), dir);
  }
  *exists = true;
  auto refuse = [&](const std::string& why) {
    return absl::FailedPreconditionError(
        absl::StrCat(kWriterWho, ": ", dir, " exists and ", why,
                     "; expected a previous export (config.json with model.safetensors or ",
                     kHfSafetensorsIndexFile,
                     ", and only *.safetensors, *.json, *.jinja, tokenizer.model, merges.txt or "
                     "vocab.txt files) or no such directory; nothing was written"));
  };
  if (!S_ISDIR(st.st_mode)) return refuse("is not a directory");
  auto entries = ListDirectory(dir);
  if (!entries.ok()) return entries.status();
  std::sort(entries->begin(), entries->end());
  if (entries->empty()) return absl::OkStatus();
  bool has_config = false, has_weights = false;
  for (const std::string& entry : *entries) {
    struct stat est;
    const std::string path = Join(dir, entry);
    if (::lstat(path.c_str(), &est) != 0) return ErrnoError("cannot stat", path);
    if (!S_ISREG(est.st_mode)) {
      return refuse(absl::StrCat("holds ", Quote(entry), ", which is not a regular file"));
    }
    if (!IsExportFileName(entry)) {
      return refuse(absl::StrCat("holds ", Quote(entry), ", which an export does not write"));
    }
    has_config |= entry == "config.json";
    has_weights |= entry == kHfSafetensorsFile || entry == kHfSafetensorsIndexFile;
  }
  if (!has_config || !has_weights) {
    return refuse(absl::StrCat("holds no ", !has_config ? "config.json" : "model.safetensors or ",
                               !has_config ? "" : kHfSafetensorsIndexFile));
  }
  return absl::OkStatus();
}

// Removes the regular files of `dir`, then `dir`.
absl::Status RemoveExport(const std::string& dir) {
  auto entries = ListDirectory(dir);
  if (!entries.ok()) return entries.status();
  for (const std::string& entry : *entries) {
    const std::string path = Join(dir, entry);
    if (::unlink(path.c_str()) != 0) return ErrnoError("cannot remove", path);
  }
  if (::rmdir(dir.c_str()) != 0) return ErrnoError("cannot remove directory", dir);
  return absl::OkStatus();
}

}  // namespace

// Write's conversion (float32 <-> bfloat16 <-> float16) goes through a
// buffer of this many bytes of the spec's dtype.
constexpr int64_t kConvertChunkBytes = int64_t{32} << 20;

struct HfCheckpointWriter::State {
  std::string dir, parent, temp_dir;
  std::vector<TensorSpec> specs;
  std::unordered_map<std::string, size_t> spec_index;
  std::vector<const internal::SafetensorsDtype*> dtypes;  // specs[i]'s
  std::vector<uint64_t> bytes;                            // specs[i]'s
  std::vector<size_t> shard_of;                           // specs[i]'s file
  std::vector<uint64_t> begin;                            // specs[i]'s place in its file's data
  std::vector<HfShard> shards;
  std::vector<int> fds;              // shards[s]'s while it is being written
  std::vector<uint64_t> data_start;  // shards[s]'s, once started
  std::vector<size_t> remaining;     // tensors of shards[s] not yet written
  std::map<std::string, std::string> extra_files;
  int64_t total_bytes = 0;
  size_t next = 0;
  std::vector<std::string> created;  // names made in temp_dir
  bool committed = false;
  absl::Status error;  // the first I/O failure; later calls repeat it
  at::Tensor staging;  // Write's conversion buffer, reused

  ~State() {
    for (int& fd : fds) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
    if (committed || temp_dir.empty()) return;
    for (const std::string& name : created) ::unlink(Join(temp_dir, name).c_str());
    ::rmdir(temp_dir.c_str());
  }

  absl::Status StartShard(size_t s);
  absl::Status FinishShard(size_t s);
  absl::Status WriteFile(const std::string& name, absl::string_view contents);
  std::vector<internal::SafetensorsEntry> Entries(size_t s) const;
};

std::vector<internal::SafetensorsEntry> HfCheckpointWriter::State::Entries(size_t s) const {
  std::vector<internal::SafetensorsEntry> entries;
  entries.reserve(shards[s].tensors.size());
  for (const std::string& name : shards[s].tensors) {
    const size_t i = spec_index.at(name);
    internal::SafetensorsEntry& e = entries.emplace_back();
    e.name = name;
    e.dtype = dtypes[i];
    e.shape = specs[i].shape;
    e.bytes = bytes[i];
    e.begin = begin[i];
  }
  return entries;
}

absl::Status HfCheckpointWriter::State::StartShard(size_t s) {
  const std::string path = Join(temp_dir, shards[s].file);
  const std::vector<internal::SafetensorsEntry> entries = Entries(s);
  const std::string header = internal::SafetensorsHeaderText({{"format", "pt"}}, entries);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return error = ErrnoError("cannot create", path);
  created.push_back(shards[s].file);
  fds[s] = fd;
  char length[8];
  const uint64_t header_bytes = header.size();
  std::memcpy(length, &header_bytes, sizeof(length));  // little-endian (internal/ asserts it)
  absl::Status status = WriteAllAt(fd, path, length, sizeof(length), 0);
  if (status.ok()) status = WriteAllAt(fd, path, header.data(), header.size(), sizeof(length));
  data_start[s] = sizeof(length) + header_bytes;
  // Its final size at once: the tensors' bytes are written at their places.
  if (status.ok() &&
      ::ftruncate(fd, static_cast<off_t>(data_start[s] + static_cast<uint64_t>(shards[s].bytes))) !=
          0) {
    status = ErrnoError("cannot size", path);
  }
  if (!status.ok()) error = status;
  return status;
}

absl::Status HfCheckpointWriter::State::FinishShard(size_t s) {
  const int fd = std::exchange(fds[s], -1);
  absl::Status status = FsyncAndClose(fd, Join(temp_dir, shards[s].file));
  if (!status.ok()) error = status;
  return status;
}

absl::Status HfCheckpointWriter::State::WriteFile(const std::string& name,
                                                  absl::string_view contents) {
  const std::string path = Join(temp_dir, name);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return error = ErrnoError("cannot create", path);
  created.push_back(name);
  absl::Status status = WriteAllAt(fd, path, contents.data(), contents.size(), 0);
  if (!status.ok()) {
    ::close(fd);
    return error = status;
  }
  status = FsyncAndClose(fd, path);
  if (!status.ok()) error = status;
  return status;
}

HfCheckpointWriter::HfCheckpointWriter(std::unique_ptr<State> state) : state_(std::move(state)) {}
HfCheckpointWriter::HfCheckpointWriter(HfCheckpointWriter&&) noexcept = default;
HfCheckpointWriter& HfCheckpointWriter::operator=(HfCheckpointWriter&&) noexcept = default;
HfCheckpointWriter::~HfCheckpointWriter() = default;

const std::string& HfCheckpointWriter::dir() const { return state_->dir; }
const std::string& HfCheckpointWriter::temp_dir() const { return state_->temp_dir; }
const std::vector<HfShard>& HfCheckpointWriter::shards() const { return state_->shards; }
int64_t HfCheckpointWriter::total_bytes() const { return state_->total_bytes; }

absl::StatusOr<HfCheckpointWriter> HfCheckpointWriter::Create(
    const std::string& dir_arg, std::vector<TensorSpec> specs, int64_t max_shard_bytes,
    std::map<std::string, std::string> extra_files) {
  const std::string who = absl::StrCat(kWriterWho, "::Create");
  auto invalid = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": ", what));
  };
  const std::string dir = StripSlashes(dir_arg);
  const std::string base = Basename(dir);
  if (dir.empty() || base.empty() || base == "." || base == "..") {
    return invalid(
        absl::StrCat("dir ", Quote(dir_arg), ": expected a directory path ending in a name"));
  }
  if (max_shard_bytes < 1) {
    return invalid(absl::StrCat("max_shard_bytes ", max_shard_bytes, ": expected >= 1"));
  }
  auto state = std::make_unique<State>();
  state->dir = dir;
  state->parent = Dirname(dir);
  for (const auto& [name, contents] : extra_files) {
    if (!IsExportFileName(name) || absl::EndsWith(name, ".safetensors") ||
        name == kHfSafetensorsIndexFile) {
      return invalid(
          absl::StrCat("extra file ", Quote(name),
                       ": expected a plain file name of a kind an export holds (*.json, *.jinja, "
                       "tokenizer.model, merges.txt, vocab.txt), other than the weights' files"));
    }
  }
  state->dtypes.reserve(specs.size());
  state->bytes.reserve(specs.size());
  uint64_t total = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& spec = specs[i];
    const std::string what = absl::StrCat("spec ", i, ", tensor ", Quote(spec.key));
    if (spec.key == "__metadata__") return invalid(absl::StrCat(what, ": a reserved name"));
    if (!internal::IsValidUtf8(spec.key)) {
      return invalid(absl::StrCat(what, ": the name is not valid UTF-8"));
    }
    if (!state->spec_index.emplace(spec.key, i).second) {
      return invalid(
          absl::StrCat(what, ": named twice (spec ", state->spec_index[spec.key], " too)"));
    }
    const internal::SafetensorsDtype* dtype = internal::SafetensorsDtypeOf(spec.dtype);
    if (dtype == nullptr) {
      return invalid(absl::StrCat(what, ": dtype ", c10::toString(spec.dtype),
                                  ", which safetensors has no name for; it holds ",
                                  internal::SafetensorsDtypeNames()));
    }
    uint64_t bytes = c10::elementSize(spec.dtype);
    for (const int64_t d : spec.shape) {
      if (d < 0 || __builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes) ||
          bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return invalid(absl::StrCat(what, ": shape ", ShapeString(spec.shape),
                                    ": expected sizes >= 0 of fewer than 2^63 bytes in all"));
      }
    }
    if (__builtin_add_overflow(total, bytes, &total) ||
        total > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return invalid("the specs take 2^63 bytes or more in all");
    }
    state->dtypes.push_back(dtype);
    state->bytes.push_back(bytes);
  }
  state->total_bytes = static_cast<int64_t>(total);

  // The plan, as huggingface_hub's split_state_dict_into_shards_factory:
  // in spec order, a new file when the next tensor would take the current
  // one over the limit, and a file of its own (listed when it is met) for a
  // tensor over the limit.
  const uint64_t limit = static_cast<uint64_t>(max_shard_bytes);
  std::vector<std::vector<size_t>> plan;
  std::vector<size_t> current;
  uint64_t current_bytes = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (state->bytes[i] > limit) {
      plan.push_back({i});
      continue;
    }
    if (current_bytes + state->bytes[i] > limit) {
      plan.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current.push_back(i);
    current_bytes += state->bytes[i];
  }
  if (!current.empty() || plan.empty()) plan.push_back(std::move(current));
  state->specs = std::move(specs);
  state->shard_of.resize(state->specs.size());
  state->begin.resize(state->specs.size());
  for (size_t s = 0; s < plan.size(); ++s) {
    HfShard& shard = state->shards.emplace_back();
    shard.file = plan.size() == 1
                     ? std::string(kHfSafetensorsFile)
                     : absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, plan.size());
    for (const size_t i : plan[s]) {
      shard.tensors.push_back(state->specs[i].key);
      shard.bytes += static_cast<int64_t>(state->bytes[i]);
      state->shard_of[i] = s;
    }
    std::vector<internal::SafetensorsEntry> entries = state->Entries(s);
    internal::LayOutBySize(entries);
    for (size_t k = 0; k < entries.size(); ++k) state->begin[plan[s][k]] = entries[k].begin;
    const size_t header_bytes = internal::SafetensorsHeaderText({{"format", "pt"}}, entries).size();
    if (header_bytes > internal::kSafetensorsMaxHeaderBytes) {
      return invalid(absl::StrCat(shard.file, "'s header would take ", header_bytes,
                                  " bytes, more than the ", internal::kSafetensorsMaxHeaderBytes,
                                  " that safetensors readers accept (", entries.size(),
                                  " tensors)"));
    }
    state->remaining.push_back(plan[s].size());
  }
  state->fds.assign(state->shards.size(), -1);
  state->data_start.assign(state->shards.size(), 0);
  state->extra_files = std::move(extra_files);

  bool exists = false;
  absl::Status status = CheckReplaceable(dir, &exists);
  if (!status.ok()) return status;
  if (!PathExists(state->parent)) {
    status = CreateDirectories(state->parent);
    if (!status.ok()) return status;
  }
  for (int attempt = 0;; ++attempt) {
    const std::string temp =
        Join(state->parent, absl::StrCat(".", base, ".tmp-", ::getpid(), "-", RandomHex()));
    if (::mkdir(temp.c_str(), 0755) == 0) {
      state->temp_dir = temp;
      break;
    }
    if (errno != EEXIST || attempt == 16) {
      return ErrnoError(absl::StrCat(who, ": cannot create the temporary directory"), temp);
    }
  }
  return HfCheckpointWriter(std::move(state));
}

absl::Status HfCheckpointWriter::Write(const std::string& name, const at::Tensor& tensor) {
  State& st = *state_;
  const std::string who = absl::StrCat(kWriterWho, "::Write");
  auto invalid = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": ", st.dir, ": tensor ", Quote(name), " ",
                                                   what, "; nothing was written"));
  };
  if (st.committed) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, ": ", st.dir, ": already committed; tensor ", Quote(name)));
  }
  if (!st.error.ok()) return st.error;
  if (st.next == st.specs.size()) {
    return invalid(absl::StrCat("given after all ", st.specs.size(), " tensors were written"));
  }
  const TensorSpec& spec = st.specs[st.next];
  if (name != spec.key) {
    auto it = st.spec_index.find(name);
    if (it == st.spec_index.end()) {
      return invalid(absl::StrCat("is not one of the ", st.specs.size(), " specs; expected ",
                                  Quote(spec.key), " (spec ", st.next, ") next"));
    }
    return invalid(absl::StrCat("(spec ", it->second, ") is ",
                                it->second < st.next ? "already written" : "out of order",
                                "; expected ", Quote(spec.key), " (spec ", st.next,
                                ") next: tensors are written in spec order"));
  }
  if (!tensor.defined()) return invalid("is undefined");
  if (tensor.layout() != c10::kStrided) {
    return invalid(absl::StrCat("has layout ", c10::str(tensor.layout()),
                                "; expected a dense (strided) tensor"));
  }
  const auto float16or32 = [](c10::ScalarType t) {
    return t == c10::kFloat || t == c10::kBFloat16 || t == c10::kHalf;
  };
  const bool convert = tensor.scalar_type() != spec.dtype;
  if (convert && !(float16or32(tensor.scalar_type()) && float16or32(spec.dtype))) {
    return invalid(absl::StrCat("has dtype ", c10::toString(tensor.scalar_type()),
                                "; expected its spec's ", c10::toString(spec.dtype),
                                " (float32, bfloat16 and float16 are converted to each other)"));
  }
  if (tensor.sizes() != c10::IntArrayRef(spec.shape)) {
    return invalid(absl::StrCat("has shape ", ShapeString(tensor.sizes().vec()),
                                "; expected its spec's ", ShapeString(spec.shape)));
  }
  const size_t i = st.next;
  const size_t s = st.shard_of[i];
  at::Tensor data;
  if (st.bytes[i] > 0) {
    try {
      // Conjugate and negative views are lazy bits over unchanged data:
      // resolve them, then bring the bytes to the CPU in row-major order.
      data = tensor.detach().resolve_conj().resolve_neg();
      if (!data.device().is_cpu()) data = data.to(c10::kCPU);
      data = data.contiguous();
    } catch (const c10::Error& error) {
      return invalid(absl::StrCat("cannot be copied to the CPU: ", error.what_without_backtrace()));
    }
  }
  absl::Status status;
  if (st.fds[s] < 0) {
    status = st.StartShard(s);
    if (!status.ok()) return status;
  }
  if (st.bytes[i] > 0) {
    const std::string path = Join(st.temp_dir, st.shards[s].file);
    const uint64_t offset = st.data_start[s] + st.begin[i];
    if (!convert) {
      status = WriteAllAt(st.fds[s], path, data.data_ptr(), st.bytes[i], offset);
    } else {
      // Converted a chunk at a time through one reused buffer: no copy of
      // the whole tensor in the spec's dtype.
      const int64_t chunk = kConvertChunkBytes / static_cast<int64_t>(c10::elementSize(spec.dtype));
      if (!st.staging.defined() || st.staging.scalar_type() != spec.dtype) {
        st.staging = at::empty({chunk}, at::TensorOptions().dtype(spec.dtype));
      }
      const at::Tensor flat = data.reshape({-1});
      const uint64_t element = c10::elementSize(spec.dtype);
      for (int64_t start = 0; status.ok() && start < flat.numel(); start += chunk) {
        const int64_t n = std::min(chunk, flat.numel() - start);
        at::Tensor converted = st.staging.narrow(0, 0, n);
        converted.copy_(flat.narrow(0, start, n));
        status =
            WriteAllAt(st.fds[s], path, converted.data_ptr(), static_cast<uint64_t>(n) * element,
                       offset + static_cast<uint64_t>(start) * element);
      }
    }
    if (!status.ok()) return st.error = status;
    // Starts writing these bytes back without waiting, so that the disk
    // works while the caller gathers and converts the next tensor and the
    // shard's fsync finds little left (as AtomicFileWriter does). A hint
    // only: where it does nothing, FinishShard's fsync does it all.
    ::sync_file_range(st.fds[s], static_cast<off64_t>(offset), static_cast<off64_t>(st.bytes[i]),
                      SYNC_FILE_RANGE_WRITE);
  }
  data = at::Tensor();
  ++st.next;
  if (--st.remaining[s] == 0) return st.FinishShard(s);
  return absl::OkStatus();
}

absl::Status HfCheckpointWriter::Commit() {
  State& st = *state_;
  const std::string who = absl::StrCat(kWriterWho, "::Commit");
  if (st.committed) {
    return absl::FailedPreconditionError(absl::StrCat(who, ": ", st.dir, ": already committed"));
  }
  if (!st.error.ok()) return st.error;
  if (st.next < st.specs.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, ": ", st.dir, ": tensor ", Quote(st.specs[st.next].key), " (spec ", st.next, " of ",
        st.specs.size(), ") was not written; expected every tensor before Commit"));
  }
  absl::Status status;
  if (st.specs.empty()) {  // one file of no tensors
    status = st.StartShard(0);
    if (status.ok()) status = st.FinishShard(0);
    if (!status.ok()) return status;
  }
  if (st.shards.size() > 1) {
    nlohmann::json index;
    index["metadata"]["total_size"] = st.total_bytes;
    nlohmann::json& weight_map = index["weight_map"];
    weight_map = nlohmann::json::object();
    for (const HfShard& shard : st.shards) {
      for (const std::string& name : shard.tensors) weight_map[name] = shard.file;
    }
    // As transformers writes it: json.dumps(index, indent=2, sort_keys=True) + "\n".
    status = st.WriteFile(kHfSafetensorsIndexFile, index.dump(2) + "\n");
    if (!status.ok()) return status;
  }
  for (const auto& [name, contents] : st.extra_files) {
    status = st.WriteFile(name, contents);
    if (!status.ok()) return status;
  }
  status = FsyncDirectory(st.temp_dir);
  if (!status.ok()) return st.error = status;

  bool exists = false;
  status = CheckReplaceable(st.dir, &exists);  // again: it may have changed since Create
  if (!status.ok()) return status;
  if (!exists) {
    if (::renameat2(AT_FDCWD, st.temp_dir.c_str(), AT_FDCWD, st.dir.c_str(), RENAME_NOREPLACE) !=
        0) {
      if (errno != EINVAL && errno != ENOSYS) {
        return ErrnoError(absl::StrCat(who, ": cannot rename ", st.temp_dir, " to"), st.dir);
      }
      if (::rename(st.temp_dir.c_str(), st.dir.c_str()) != 0) {
        return ErrnoError(absl::StrCat(who, ": cannot rename ", st.temp_dir, " to"), st.dir);
      }
    }
    st.committed = true;
    return FsyncDirectory(st.parent);
  }
  // Replacing a previous export: exchanged in one step where the file system
  // can, so that `dir` always names a whole export; else renamed aside first.
  std::string old = st.temp_dir;  // after the exchange, the previous export
  if (::renameat2(AT_FDCWD, st.temp_dir.c_str(), AT_FDCWD, st.dir.c_str(), RENAME_EXCHANGE) != 0) {
    if (errno != EINVAL && errno != ENOSYS) {
      return ErrnoError(absl::StrCat(who, ": cannot exchange ", st.temp_dir, " with"), st.dir);
    }
    old =
        Join(st.parent, absl::StrCat(".", Basename(st.dir), ".old-", ::getpid(), "-", RandomHex()));
    if (::rename(st.dir.c_str(), old.c_str()) != 0) {
      return ErrnoError(
          absl::StrCat(who, ": cannot rename the previous export aside to ", old, " from"), st.dir);
    }
    if (::rename(st.temp_dir.c_str(), st.dir.c_str()) != 0) {
      status = ErrnoError(absl::StrCat(who, ": cannot rename ", st.temp_dir, " to"), st.dir);
      ::rename(old.c_str(), st.dir.c_str());  // the previous export back
      return status;
    }
  }
  st.committed = true;
  status = FsyncDirectory(st.parent);
  if (!status.ok()) return status;
  status = RemoveExport(old);
  if (!status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat(who, ": the export at ", st.dir,
                                     " is complete, but the previous one, moved to ", old,
                                     ", could not be removed: ", status.message()));
  }
  return FsyncDirectory(st.parent);
}

absl::Status CheckHfExportTarget(const std::string& dir) {
  bool exists = false;
  return CheckReplaceable(dir, &exists);
}

}  // namespace formats
