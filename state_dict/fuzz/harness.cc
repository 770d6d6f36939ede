#include "state_dict/fuzz/harness.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "formats/fuzz/oracle.h"
#include "formats/io/crc32c.h"
#include "state_dict/checkpoint.h"
#include "state_dict/dcp.h"
#include "state_dict/manifest.h"
#include "state_dict/sharded_tensor.h"
#include "state_dict/tensor_dict.h"

namespace state_dict {
namespace fuzz {
namespace {

using formats::fuzz::BitwiseEqual;
using formats::fuzz::Describe;
using formats::fuzz::ExpectSameTensors;
using formats::fuzz::ReadBytesOrDie;
using formats::fuzz::ScratchDirectory;
using formats::fuzz::StatusText;
using formats::fuzz::Violation;
using formats::fuzz::WriteBytesOrDie;

// ---------------------------------------------------------------------------
// Checkpoint template.

constexpr int kWorldSize = 2;
const char* const kCheckpointFiles[CheckpointInputLayout::kFiles] = {"MANIFEST", "rank_00000.pt",
                                                                     "rank_00001.pt"};

// The full tensors of the template; every rank file holds pieces of several.
TensorDict TemplateTensors() {
  TensorDict full;
  full.insert("layer.weight", torch::arange(12, torch::kFloat).reshape({3, 4}) / 7);
  full.insert("layer.bias", torch::linspace(-1, 1, 5, torch::kDouble));
  full.insert("embed", torch::arange(6, torch::kFloat).reshape({2, 3}).to(torch::kBFloat16));
  full.insert("mask", torch::tensor({true, false, true, true}));
  full.insert("steps", torch::tensor({3, -4, 5}, torch::kLong));
  full.insert("half", torch::full({7}, 0.5, torch::kHalf));
  full.insert("scalar", torch::tensor(2.5));
  return full;
}

std::vector<ShardedStateDict> TemplateShards() {
  std::vector<ShardedStateDict> shards(kWorldSize);
  for (const auto& item : TemplateTensors()) {
    const int64_t numel = item.value().numel();
    for (int r = 0; r < kWorldSize; ++r) {
      // "steps" lives wholly on rank 0, so rank 1 records it without data.
      const FlatRange range = item.key() == "steps" ? FlatRange{0, r == 0 ? numel : 0}
                                                    : EvenShardRange(numel, kWorldSize, r);
      std::vector<FlatRange> ranges;
      if (range.numel > 0) ranges.push_back(range);
      shards[static_cast<size_t>(r)].insert(item.key(), ShardFullTensor(item.value(), ranges));
    }
  }
  return shards;
}

struct CheckpointTemplate {
  std::string step_dir;  // holds the pristine files
  std::string contents[CheckpointInputLayout::kFiles];
  Manifest manifest;
  std::vector<std::pair<std::string, ShardRequest>> whole_requests;
};

std::vector<std::pair<std::string, ShardRequest>> WholeTensorRequests(const Manifest& m) {
  std::vector<std::pair<std::string, ShardRequest>> requests;
  std::map<std::string, bool> seen;
  for (const ManifestFile& f : m.files) {
    for (const ManifestTensor& t : f.tensors) {
      if (!seen.emplace(t.name, true).second) continue;
      ShardRequest request;
      request.global_shape = t.global_shape;
      request.dtype = t.dtype;
      // Saturates on overflow (a fuzzed shape); such a manifest fails
      // validation in every load anyway.
      int64_t numel = 1;
      for (int64_t d : t.global_shape) {
        if (__builtin_mul_overflow(numel, d, &numel)) numel = INT64_MAX;
      }
      request.ranges.push_back(FlatRange{0, numel});
      requests.emplace_back(t.name, std::move(request));
    }
  }
  return requests;
}

const CheckpointTemplate& Template() {
  static const CheckpointTemplate* made = [] {
    auto* t = new CheckpointTemplate;
    const std::string root = ScratchDirectory() + "/template";
    absl::Status status = SaveShardedCheckpoint(root, 1, TemplateShards());
    if (!status.ok()) Violation("cannot save the template checkpoint: " + StatusText(status));
    t->step_dir = StepDirectory(root, 1);
    status = VerifyCheckpoint(t->step_dir);
    if (!status.ok()) Violation("the template checkpoint does not verify: " + StatusText(status));
    for (int i = 0; i < CheckpointInputLayout::kFiles; ++i) {
      t->contents[i] = ReadBytesOrDie(t->step_dir + "/" + kCheckpointFiles[i]);
    }
    auto manifest = ReadManifest(t->step_dir);
    if (!manifest.ok())
      Violation("cannot read the template manifest: " + StatusText(manifest.status()));
    t->manifest = *std::move(manifest);
    t->whole_requests = WholeTensorRequests(t->manifest);
    return t;
  }();
  return *made;
}

// Names of the manifest's files that hold at least one piece with data: the
// files a request for every tensor whole has to read.
bool SomeFileHoldsNoData(const Manifest& m) {
  for (const ManifestFile& f : m.files) {
    bool has_data = false;
    for (const ManifestTensor& t : f.tensors) has_data |= (t.key != "-" && t.range.numel > 0);
    if (!has_data) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------
// DCP template.

const char* const kDcpFileNames[kDcpFiles] = {".metadata", "__0_0.distcp", "__1_0.distcp"};

struct DcpTemplate {
  std::string contents[kDcpFiles];
  TensorDict tensors;  // the full tensors, by flattened key
  std::vector<std::pair<std::string, c10::IValue>> objects;
};

// Each tensor split evenly over the two ranks (EvenShardRange), so that the
// pieces cut rows as FSDP's flat shards do: SaveDcpShard writes a partial
// row, whole rows and a partial row as separate chunks.
TensorDict DcpTemplateTensors() {
  TensorDict full;
  // 6 + 6 of rows of 4: rank 0 ends mid-row.
  full.insert("model.layer.weight", torch::arange(12, torch::kFloat).reshape({3, 4}) / 7);
  full.insert("model.layer.bias", torch::linspace(-1, 1, 5, torch::kDouble));
  // 14 + 13 of a 3x3x3 block: a partial plane, whole rows, a partial row.
  full.insert("model.cube", torch::arange(27, torch::kLong).reshape({3, 3, 3}) - 13);
  full.insert("model.embed", torch::linspace(-3, 3, 15).to(torch::kBFloat16).reshape({5, 3}));
  full.insert("model.mask", torch::tensor({true, false, true, true, false}));
  full.insert("model.empty", torch::zeros({0, 3}));
  full.insert("optim.state.layer.weight.step", torch::tensor(7.0, torch::kDouble));
  return full;
}

DcpKeyPath DcpPathOf(const std::string& key) {
  DcpKeyPath path;
  size_t begin = 0;
  while (true) {
    const size_t dot = key.find('.', begin);
    const std::string part = key.substr(begin, dot == std::string::npos ? dot : dot - begin);
    if (!part.empty() && part.find_first_not_of("0123456789") == std::string::npos) {
      path.emplace_back(static_cast<int64_t>(std::stoll(part)));
    } else {
      path.emplace_back(part);
    }
    if (dot == std::string::npos) return path;
    begin = dot + 1;
  }
}

const DcpTemplate& TemplateDcp() {
  static const DcpTemplate* made = [] {
    auto* t = new DcpTemplate;
    t->tensors = DcpTemplateTensors();
    t->objects = {
        {"optim.param_groups.0.lr", c10::IValue(0.01)},
        {"optim.param_groups.0.betas",
         c10::IValue(c10::ivalue::Tuple::create({c10::IValue(0.9), c10::IValue(0.999)}))},
    };
    std::vector<DcpShard> shards(kWorldSize);
    for (const auto& item : t->tensors) {
      const torch::Tensor& full = item.value();
      for (int r = 0; r < kWorldSize; ++r) {
        // The 0-dim step is replicated, as FSDP's ranks each hold it; the
        // commit keeps one copy.
        const FlatRange range =
            full.dim() == 0 ? FlatRange{0, 1} : EvenShardRange(full.numel(), kWorldSize, r);
        std::vector<FlatRange> ranges;
        if (range.numel > 0) ranges.push_back(range);
        shards[static_cast<size_t>(r)].tensors.push_back(
            DcpShard::Tensor{DcpPathOf(item.key()), ShardFullTensor(full, ranges)});
      }
    }
    for (const auto& [key, value] : t->objects) {
      shards[0].objects.push_back(DcpShard::Object{DcpPathOf(key), value});
    }
    const std::string dir = ScratchDirectory() + "/dcp_template";
    for (int r = 0; r < kWorldSize; ++r) {
      absl::Status status = SaveDcpShard(dir, r, shards[static_cast<size_t>(r)]);
      if (!status.ok()) Violation("cannot save the template DCP shard: " + StatusText(status));
    }
    absl::Status status = CommitDcpCheckpoint(dir, kWorldSize);
    if (!status.ok()) Violation("cannot commit the template DCP checkpoint: " + StatusText(status));
    for (int i = 0; i < kDcpFiles; ++i) {
      t->contents[i] = ReadBytesOrDie(dir + "/" + kDcpFileNames[i]);
    }
    return t;
  }();
  return *made;
}

// One LoadResharded request of `info`'s [offset, offset + numel).
absl::StatusOr<ShardedStateDict> LoadRange(const DcpCheckpoint& ckpt,
                                           const DcpCheckpoint::TensorInfo& info, int64_t offset,
                                           int64_t numel) {
  ShardRequest request;
  request.global_shape = info.shape;
  request.dtype = info.dtype;
  request.ranges.push_back(FlatRange{offset, numel});
  return ckpt.LoadResharded({{info.key, request}});
}

// The one piece a one-range load returns for `key`, checked to be the range
// asked for; else a violation.
const torch::Tensor& OnePiece(const ShardedStateDict& loaded, const std::string& key,
                              FlatRange range, const std::string& results) {
  const ShardedTensor* t = loaded.find(key);
  if (t == nullptr || loaded.size() != 1 || t->pieces.size() != 1 ||
      !(t->pieces[0].range == range) || t->pieces[0].data.dim() != 1 ||
      t->pieces[0].data.numel() != range.numel) {
    Violation(absl::StrCat("a load of '", key, "' [", range.offset, ", ", range.end(),
                           ") returned other pieces than the range asked for", results));
  }
  return t->pieces[0].data;
}

}  // namespace

CheckpointInputLayout DecodeCheckpointSelector(uint8_t first_byte) {
  CheckpointInputLayout layout;
  layout.file = first_byte % CheckpointInputLayout::kFiles;
  layout.fix_file_checksum = (first_byte / CheckpointInputLayout::kFiles) % 2 == 1;
  return layout;
}

// The MANIFEST text with its own checksum recomputed (the "end crc32c" line
// replaced), so that a mutated manifest reaches the checks of its fields
// instead of stopping at its checksum. Text without that line is returned
// as it is.
std::string ResealManifest(const std::string& text) {
  const size_t end = text.rfind("end crc32c ");
  if (end == std::string::npos || (end != 0 && text[end - 1] != '\n')) return text;
  const uint32_t crc = formats::Crc32c(text.data(), end);
  return absl::StrCat(text.substr(0, end), "end crc32c ", absl::Hex(crc, absl::kZeroPad8), "\n");
}

void RunCheckpointInput(const uint8_t* data, size_t size) {
  if (size == 0) return;
  const CheckpointTemplate& t = Template();
  const CheckpointInputLayout layout = DecodeCheckpointSelector(data[0]);
  const std::string root = ScratchDirectory() + "/input";
  const std::string step_dir = StepDirectory(root, 1);
  std::error_code error;
  std::filesystem::create_directories(step_dir, error);
  if (error) Violation(absl::StrCat("harness cannot create ", step_dir, ": ", error.message()));

  std::string replacement(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::string files[CheckpointInputLayout::kFiles];
  for (int i = 0; i < CheckpointInputLayout::kFiles; ++i) files[i] = t.contents[i];
  if (layout.file == 0 && layout.fix_file_checksum) replacement = ResealManifest(replacement);
  files[layout.file] = replacement;
  if (layout.file != 0 && layout.fix_file_checksum) {
    // Lets the input get past the whole-file checksum to the per-tensor
    // checks: the manifest records the replaced file's real size and CRC.
    Manifest m = t.manifest;
    for (ManifestFile& f : m.files) {
      if (f.name != kCheckpointFiles[layout.file]) continue;
      f.bytes = replacement.size();
      f.crc32c = formats::Crc32c(replacement.data(), replacement.size());
    }
    files[0] = FormatManifest(m);
  }
  for (int i = 0; i < CheckpointInputLayout::kFiles; ++i) {
    WriteBytesOrDie(step_dir + "/" + kCheckpointFiles[i], files[i].data(), files[i].size());
  }

  const absl::Status verified = VerifyCheckpoint(step_dir);
  auto full = LoadFullStateDict(step_dir);
  auto manifest = ReadManifest(step_dir);
  const auto& requests = manifest.ok() ? WholeTensorRequests(*manifest) : t.whole_requests;
  auto resharded = LoadResharded(step_dir, requests);
  auto local = LoadLocalShard(step_dir, 0, kWorldSize);

  const std::string results = absl::StrCat(
      "\n  verify:    ", StatusText(verified), "\n  full:      ", StatusText(full.status()),
      "\n  resharded: ", StatusText(resharded.status()),
      "\n  local:     ", StatusText(local.status()), "\n  (input replaced ",
      kCheckpointFiles[layout.file],
      layout.fix_file_checksum ? ", manifest checksum fixed up)" : ")");
  // `ckpt convert`: the full state dict written as one torch.save file, which
  // must load back bitwise equal.
  absl::Status converted = full.status();
  if (full.ok()) {
    const std::string out = ScratchDirectory() + "/converted.pt";
    converted = SaveTensorDict(*full, out);
    if (converted.ok()) {
      auto back = LoadTensorDict(out);
      converted = back.status();
      if (back.ok()) ExpectSameTensors(*full, back->tensors, " (convert):" + results);
    }
  }
  if (verified.ok() != converted.ok()) {
    Violation(absl::StrCat("verify and convert disagree (convert: ", StatusText(converted),
                           "):", results));
  }
  if (verified.ok()) {
    if (!full.ok() || !resharded.ok() || !local.ok()) {
      Violation("the checkpoint verifies but a load fails:" + results);
    }
    for (const auto& item : *full) {
      const ShardedTensor* piece = resharded->find(item.key());
      if (piece == nullptr || piece->pieces.size() != 1 ||
          !BitwiseEqual(piece->pieces[0].data, item.value().reshape({-1}))) {
        Violation(absl::StrCat("full and resharded loads disagree on '", item.key(), "'", results));
      }
    }
    return;
  }
  if (full.ok()) Violation("verify fails but the full load succeeds:" + results);
  if (resharded.ok() && !(manifest.ok() && SomeFileHoldsNoData(*manifest))) {
    Violation("verify fails but the resharded load of every tensor succeeds:" + results);
  }
}

void RunDcpInput(const uint8_t* data, size_t size) {
  if (size == 0) return;
  const DcpTemplate& t = TemplateDcp();
  const int file = data[0] % kDcpFiles;
  const std::string dir = ScratchDirectory() + "/dcp_input";
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) Violation(absl::StrCat("harness cannot create ", dir, ": ", error.message()));
  const std::string replacement(reinterpret_cast<const char*>(data) + 1, size - 1);
  // The template's own bytes: everything must load as it was saved.
  const bool pristine = replacement == t.contents[file];
  for (int i = 0; i < kDcpFiles; ++i) {
    const std::string& bytes = i == file ? replacement : t.contents[i];
    WriteBytesOrDie(dir + "/" + kDcpFileNames[i], bytes.data(), bytes.size());
  }
  const std::string input = absl::StrCat("\n  (input replaced ", kDcpFileNames[file],
                                         pristine ? " with its own bytes)" : ")");

  auto ckpt = DcpCheckpoint::Open(dir);
  if (!ckpt.ok()) {
    if (pristine)
      Violation("the template DCP checkpoint does not open: " + StatusText(ckpt.status()) + input);
    return;
  }
  const std::vector<DcpCheckpoint::TensorInfo> tensors = ckpt->tensors();
  if (pristine) {
    std::vector<std::string> keys;
    for (const auto& info : tensors) keys.push_back(info.key);
    if (keys != t.tensors.keys()) Violation("the template's tensors open as other keys" + input);
  }
  for (const DcpCheckpoint::TensorInfo& info : tensors) {
    // Open checked that the size does not overflow.
    int64_t numel = 1;
    for (int64_t d : info.shape) numel *= d;
    const int64_t half = numel / 2;
    auto whole = LoadRange(*ckpt, info, 0, numel);
    auto first = LoadRange(*ckpt, info, 0, half);
    auto second = LoadRange(*ckpt, info, half, numel - half);
    const std::string results = absl::StrCat(
        "\n  tensor:      '", info.key, "' ", c10::toString(info.dtype), " [",
        absl::StrJoin(info.shape, ", "), "]", "\n  whole:       ", StatusText(whole.status()),
        "\n  first half:  ", StatusText(first.status()),
        "\n  second half: ", StatusText(second.status()), input);
    if (whole.ok() != (first.ok() && second.ok())) {
      Violation("the whole load and the loads of its halves disagree:" + results);
    }
    if (pristine && !whole.ok()) Violation("a tensor of the template does not load:" + results);
    if (!whole.ok()) continue;
    const torch::Tensor& w = OnePiece(*whole, info.key, FlatRange{0, numel}, results);
    const torch::Tensor& a = OnePiece(*first, info.key, FlatRange{0, half}, results);
    const torch::Tensor& b = OnePiece(*second, info.key, FlatRange{half, numel - half}, results);
    if (!BitwiseEqual(torch::cat({a, b}), w)) {
      Violation("the halves concatenated differ from the whole:" + results);
    }
    if (pristine) {
      const torch::Tensor* expected = t.tensors.find(info.key);
      if (expected == nullptr || !BitwiseEqual(w, expected->reshape({-1})) ||
          info.shape != expected->sizes().vec()) {
        Violation("a tensor of the template loads with other values:" + results);
      }
    }
  }
  const std::vector<std::string> objects = ckpt->objects();
  if (pristine && objects.size() != t.objects.size()) {
    Violation(absl::StrCat("the template's ", t.objects.size(), " objects open as ", objects.size(),
                           input));
  }
  for (size_t i = 0; i < objects.size(); ++i) {
    auto value = ckpt->LoadObject(objects[i]);
    if (!pristine) continue;
    if (!value.ok() || objects[i] != t.objects[i].first || !(*value == t.objects[i].second)) {
      Violation(
          absl::StrCat("the template's object '", t.objects[i].first, "' loads as '", objects[i],
                       "': ", value.ok() ? c10::str(*value) : StatusText(value.status()), input));
    }
  }
}

absl::Status WriteProjectSeeds(const std::string& checkpoint_dir, const std::string& dcp_dir) {
  // The template checkpoint's files as inputs of RunCheckpointInput: the
  // selector byte, then the file.
  const CheckpointTemplate& t = Template();
  for (int i = 0; i < CheckpointInputLayout::kFiles; ++i) {
    for (bool fix : {false, true}) {
      const uint8_t selector = static_cast<uint8_t>(i + (fix ? CheckpointInputLayout::kFiles : 0));
      std::string seed(1, static_cast<char>(selector));
      seed += t.contents[i];
      WriteBytesOrDie(absl::StrCat(checkpoint_dir, "/project_", kCheckpointFiles[i],
                                   fix ? "_fixed_checksum" : ""),
                      seed.data(), seed.size());
    }
  }

  // The template DCP directory's files as inputs of RunDcpInput.
  const DcpTemplate& dcp = TemplateDcp();
  for (int i = 0; i < kDcpFiles; ++i) {
    std::string seed(1, static_cast<char>(i));
    seed += dcp.contents[i];
    // Named without the leading dot: "project_metadata", "project___0_0.distcp".
    const std::string name = kDcpFileNames[i][0] == '.' ? kDcpFileNames[i] + 1 : kDcpFileNames[i];
    WriteBytesOrDie(absl::StrCat(dcp_dir, "/project_", name), seed.data(), seed.size());
  }
  return absl::OkStatus();
}

}  // namespace fuzz
}  // namespace state_dict
