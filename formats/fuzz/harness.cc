#include "formats/fuzz/harness.h"

#include <map>
#include <optional>
#include <string>

#include <torch/types.h>

#include "absl/strings/str_cat.h"
#include "formats/fuzz/oracle.h"
#include "formats/safetensors/safetensors.h"
#include "formats/torch_save/torch_save.h"

namespace formats {
namespace fuzz {
namespace {

// Round trips of tensors larger than this are skipped: a crafted file can
// describe a huge tensor as a stride-0 view of a tiny storage, which loads
// fine (it is a view) but would be materialised by SaveTensorDict. The loads
// themselves are always checked.
constexpr int64_t kMaxRoundTripBytes = int64_t{16} << 20;

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
