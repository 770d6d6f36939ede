#include "formats/fuzz/harness.h"

#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <torch/types.h>

#include "absl/strings/str_cat.h"
#include "formats/fuzz/oracle.h"
#include "formats/hf/hf_checkpoint_files.h"
#include "formats/safetensors/safetensors.h"
#include "formats/safetensors/safetensors_file.h"
#include "formats/torch_save/torch_save.h"

namespace formats {
namespace fuzz {
namespace {

// Round trips of tensors larger than this are skipped: a crafted file can
// describe a huge tensor as a stride-0 view of a tiny storage, which loads
// fine (it is a view) but would be materialised by SaveTensorDict. The loads
// themselves are always checked.
constexpr int64_t kMaxRoundTripBytes = int64_t{16} << 20;

// Elements [numel / 3, numel / 3 + numel / 2) of the flattened tensor, read
// with `read`, against the same slice of `whole`.
template <typename Read>
void ExpectRangeRead(const std::string& name, const at::Tensor& whole, const Read& read,
                     const std::string& who) {
  const int64_t numel = whole.numel();
  const int64_t offset = numel / 3, count = numel / 2;
  auto part = read(name, offset, count);
  if (!part.ok()) {
    Violation(absl::StrCat(who, " refused elements [", offset, ", +", count, ") of '", name,
                           "': ", StatusText(part.status())));
  }
  if (!BitwiseEqual(*part, whole.reshape(-1).slice(0, offset, offset + count))) {
    Violation(absl::StrCat(who, " read elements [", offset, ", +", count, ") of '", name,
                           "' unlike the whole tensor's"));
  }
}

// SafetensorsFile against LoadSafetensors' result for the same file.
void CheckSafetensorsFile(const std::string& path,
                          const absl::StatusOr<LoadedSafetensors>& loaded) {
  auto file = SafetensorsFile::Open(path);
  if (!file.ok()) {
    if (file.status() != loaded.status()) {
      Violation(absl::StrCat("SafetensorsFile::Open: ", StatusText(file.status()),
                             "; LoadSafetensors: ", StatusText(loaded.status())));
    }
    return;
  }
  if (!loaded.ok()) {
    // Open reads no tensor bytes: only a BOOL byte may fail the load, and
    // then reading that tensor fails the same way.
    for (const std::string& name : file->names()) {
      if (file->info(name)->dtype != c10::ScalarType::Bool) continue;
      if (file->ReadAll(name).status() == loaded.status()) return;
    }
    Violation(
        "SafetensorsFile::Open accepted a file LoadSafetensors refuses, not for a BOOL "
        "byte: " +
        StatusText(loaded.status()));
  }
  if (file->names() != loaded->tensors.keys()) {
    Violation("SafetensorsFile's names differ from LoadSafetensors'");
  }
  if (file->metadata() != loaded->metadata) {
    Violation("SafetensorsFile's metadata differs from LoadSafetensors'");
  }
  for (const auto& item : loaded->tensors) {
    auto all = file->ReadAll(item.key());
    if (!all.ok()) {
      Violation(absl::StrCat("SafetensorsFile::ReadAll refused '", item.key(),
                             "', which LoadSafetensors loads: ", StatusText(all.status())));
    }
    if (!BitwiseEqual(*all, item.value())) {
      Violation(absl::StrCat("SafetensorsFile::ReadAll of '", item.key(), "' is ", Describe(*all),
                             ", unlike LoadSafetensors' ", Describe(item.value())));
    }
    ExpectRangeRead(
        item.key(), item.value(),
        [&](const std::string& name, int64_t offset, int64_t count) {
          return file->Read(name, offset, count);
        },
        "SafetensorsFile::Read");
  }
}

// The fixed directory of RunHfIndexInput: its shards' tensors by name, with
// the file holding each.
struct HfIndexFixture {
  std::string dir;
  std::map<std::string, std::pair<std::string, at::Tensor>> tensors;
};

const HfIndexFixture& IndexFixture() {
  static const HfIndexFixture* fixture = [] {
    auto* f = new HfIndexFixture;
    f->dir = ScratchDirectory() + "/hf_index";
    if (::mkdir(f->dir.c_str(), 0755) != 0) Violation("harness cannot create " + f->dir);
    TensorDict a, b;
    a.insert("x", torch::arange(6, torch::kFloat32).reshape({2, 3}));
    a.insert("y", torch::arange(4, torch::kInt64));
    b.insert("z", torch::arange(5, torch::kFloat32).to(torch::kBFloat16));
    const std::vector<std::pair<std::string, const TensorDict*>> shards = {{"a.safetensors", &a},
                                                                           {"b.safetensors", &b}};
    for (const auto& [file, dict] : shards) {
      absl::Status saved = SaveSafetensors(*dict, f->dir + "/" + file);
      if (!saved.ok()) Violation("harness cannot write its shards: " + StatusText(saved));
      for (const auto& item : *dict) f->tensors[item.key()] = {file, item.value()};
    }
    return f;
  }();
  return *fixture;
}

}  // namespace

void RunTorchFileInput(const uint8_t* data, size_t size) {
  const std::string path = ScratchDirectory() + "/input.pt";
  WriteBytesOrDie(path, data, size);
  // LoadIValue's value is dropped before LoadTensorDict runs: holding both
  // doubled the memory of a file whose records declare gigabytes.
  const absl::Status value = LoadIValue(path).status();
  auto dict = LoadTensorDict(path);
  if (!dict.ok()) return;
  if (!value.ok()) {
    Violation(
        absl::StrCat("LoadTensorDict accepted a file LoadIValue rejects: ", StatusText(value)));
  }
  const std::optional<int64_t> bytes = TotalBytes(dict->tensors);
  if (!bytes.has_value() || *bytes > kMaxRoundTripBytes) return;  // larger than any we make

  const std::string copy = ScratchDirectory() + "/roundtrip.pt";
  absl::Status saved = SaveTensorDict(dict->tensors, copy);
  if (!saved.ok()) Violation("SaveTensorDict rejected a loaded dict: " + StatusText(saved));
  auto reloaded = LoadTensorDict(copy);
  if (!reloaded.ok()) {
    Violation("LoadTensorDict rejected what SaveTensorDict wrote: " +
              StatusText(reloaded.status()));
  }
  ExpectSameTensors(dict->tensors, reloaded->tensors);
}

void RunSafetensorsInput(const uint8_t* data, size_t size) {
  const std::string path = ScratchDirectory() + "/input.safetensors";
  WriteBytesOrDie(path, data, size);
  auto loaded = LoadSafetensors(path);
  CheckSafetensorsFile(path, loaded);
  if (!loaded.ok()) return;
  const std::optional<int64_t> bytes = TotalBytes(loaded->tensors);
  if (!bytes.has_value()) Violation("LoadSafetensors accepted tensors whose byte count overflows");
  if (*bytes > static_cast<int64_t>(size)) {
    Violation(absl::StrCat("LoadSafetensors accepted ", *bytes, " tensor bytes from a file of ",
                           size, " bytes"));
  }

  const std::string copy = ScratchDirectory() + "/roundtrip.safetensors";
  absl::Status saved = SaveSafetensors(loaded->tensors, copy, loaded->metadata);
  if (!saved.ok()) Violation("SaveSafetensors rejected a loaded file: " + StatusText(saved));
  auto reloaded = LoadSafetensors(copy);
  if (!reloaded.ok()) {
    Violation("LoadSafetensors rejected what SaveSafetensors wrote: " +
              StatusText(reloaded.status()));
  }
  ExpectSameTensors(loaded->tensors, reloaded->tensors);
  std::map<std::string, std::string> expected = loaded->metadata;
  expected.emplace("format", "pt");
  if (reloaded->metadata != expected) {
    Violation("the round trip changed the metadata");
  }
}

absl::Status RunHfIndexInput(const uint8_t* data, size_t size) {
  const HfIndexFixture& fixture = IndexFixture();
  WriteBytesOrDie(fixture.dir + "/model.safetensors.index.json", data, size);
  auto ckpt = HfCheckpointFiles::Open(fixture.dir);
  if (!ckpt.ok()) return ckpt.status();
  if (!ckpt->sharded()) Violation("HfCheckpointFiles read an index but says it is not sharded");
  std::vector<std::string> expected;
  for (const std::string& file : ckpt->files()) {
    if (file != "a.safetensors" && file != "b.safetensors") {
      Violation("HfCheckpointFiles opened '" + file + "', not one of the directory's shards");
    }
    for (const auto& [name, where] : fixture.tensors) {
      if (where.first == file) expected.push_back(name);
    }
  }
  std::sort(expected.begin(), expected.end());
  if (ckpt->names() != expected) {
    Violation("HfCheckpointFiles' names are not exactly the tensors of the files it opened");
  }
  for (const std::string& name : expected) {
    const auto& [file, tensor] = fixture.tensors.at(name);
    auto info = ckpt->info(name);
    if (!info.ok() || info->file != file || info->dtype != tensor.scalar_type() ||
        info->shape != tensor.sizes().vec()) {
      Violation("HfCheckpointFiles::info of '" + name + "' disagrees with its shard");
    }
    auto all = ckpt->ReadAll(name);
    if (!all.ok() || !BitwiseEqual(*all, tensor)) {
      Violation("HfCheckpointFiles::ReadAll of '" + name + "' differs from what was written");
    }
    ExpectRangeRead(
        name, tensor,
        [&](const std::string& n, int64_t offset, int64_t count) {
          return ckpt->Read(n, offset, count);
        },
        "HfCheckpointFiles::Read");
  }
  return absl::OkStatus();
}

absl::Status WriteTorchFileSeeds(const std::string& torch_file_dir) {
  // A dict of every dtype, including views, a 0-dim and an empty tensor.
  TensorDict tensors;
  const torch::Tensor base = torch::arange(24, torch::kFloat).reshape({4, 6});
  tensors.insert("float", base);
  tensors.insert("transposed", base.t());
  tensors.insert("strided",
                 base.index({torch::indexing::Slice(), torch::indexing::Slice(1, 6, 2)}));
  tensors.insert("scalar", torch::tensor(3.25, torch::kDouble));
  tensors.insert("empty", torch::zeros({0, 3}, torch::kInt));
  for (auto dtype :
       {torch::kHalf, torch::kBFloat16, torch::kDouble, torch::kChar, torch::kByte, torch::kShort,
        torch::kInt, torch::kLong, torch::kBool, torch::kComplexFloat, torch::kComplexDouble}) {
    tensors.insert(absl::StrCat("dtype_", c10::toString(dtype)),
                   torch::arange(5, torch::kFloat).sub(2).to(dtype));
  }
  absl::Status status = SaveTensorDict(tensors, torch_file_dir + "/project_tensor_dict.pt");
  if (!status.ok()) return status;

  // An optimizer-like nested IValue: int keys, lists, tuples, strings,
  // floats, bools, None.
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  c10::impl::GenericDict slot(c10::StringType::get(), c10::AnyType::get());
  slot.insert("step", c10::IValue(torch::tensor(3.0)));
  slot.insert("exp_avg", c10::IValue(torch::ones({2, 2})));
  state.insert(0, c10::IValue(slot));
  c10::impl::GenericDict group(c10::StringType::get(), c10::AnyType::get());
  group.insert("lr", 0.001);
  group.insert("betas", c10::ivalue::Tuple::create({0.9, 0.999}));
  group.insert("amsgrad", false);
  group.insert("maximize", c10::IValue());
  group.insert("params", c10::List<int64_t>({0, 1}));
  group.insert("name", std::string("decoder"));
  c10::impl::GenericList groups(c10::AnyType::get());
  groups.push_back(c10::IValue(group));
  c10::impl::GenericDict optimizer(c10::StringType::get(), c10::AnyType::get());
  optimizer.insert("state", c10::IValue(state));
  optimizer.insert("param_groups", c10::IValue(groups));
  return SaveIValue(c10::IValue(optimizer), torch_file_dir + "/project_optimizer.pt");
}

}  // namespace fuzz
}  // namespace formats
