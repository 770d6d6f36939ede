#include "formats/torch_save/torch_save.h"

#include <chrono>
#include <fstream>

#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "formats/io/crc32c.h"
#include "formats/testing/python_interop.h"
#include "state_dict/module_state.h"

namespace formats {
namespace {

using state_dict::LoadModuleStateDict;
using state_dict::ModuleStateDict;
using testing::PythonTorchAvailable;
using testing::RunPython;
using testing::TempDir;

uint32_t Crc(const std::string& bytes) { return Crc32c(bytes.data(), bytes.size()); }

torch::nn::Sequential MakeModel() {
  // The same architecture as Python's
  // nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).
  return torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::ReLU(), torch::nn::Linear(3, 2));
}

TEST(PytorchFormatTest, RoundTripKeepsOrderValuesAndDtypes) {
  const std::string path = TempDir("roundtrip") + "/sd.pt";
  TensorDict sd;
  sd.insert("z.last_inserted_first", torch::arange(6, torch::kFloat).view({2, 3}));
  sd.insert("a.long", torch::tensor({1, -2, 3}, torch::kLong));
  sd.insert("m.double", torch::randn({3, 1}, torch::kDouble));
  sd.insert("b.bool", torch::tensor({true, false}));
  sd.insert("s.scalar", torch::tensor(2.5));
  sd.insert("t.strided", torch::arange(12, torch::kFloat).view({3, 4}).t());
  ASSERT_TRUE(SaveTensorDict(sd, path).ok());
  auto loaded = LoadTensorDict(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->tensors.keys(), sd.keys());
  for (const auto& item : sd) {
    const torch::Tensor& got = loaded->tensors[item.key()];
    EXPECT_EQ(got.scalar_type(), item.value().scalar_type()) << item.key();
    EXPECT_TRUE(torch::equal(got, item.value())) << item.key();
  }
  EXPECT_TRUE(loaded->metadata.isNone());
}

// The streaming writer: each tensor is its own record of exactly its bytes
// (a view does not drag its whole storage along), its checksums are those of
// the bytes on disk, and Python reads every kind of tensor back identically.
TEST(PytorchFormatTest, StreamedFileHoldsEachTensorsOwnBytesWithItsChecksums) {
  const std::string dir = TempDir("streamed");
  const std::string path = dir + "/sd.pt";
  const torch::Tensor big = torch::arange(1 << 20, torch::kFloat);  // 4 MiB storage
  TensorDict sd;
  sd.insert("view.head", big.narrow(0, 0, 10));
  sd.insert("view.middle", big.narrow(0, 1000, 6).view({2, 3}));
  sd.insert("transposed", torch::arange(12, torch::kDouble).view({3, 4}).t());
  sd.insert("empty", torch::zeros({0, 5}, torch::kInt));
  sd.insert("half", torch::linspace(-1, 1, 7).to(torch::kHalf));
  sd.insert("bool", torch::tensor({true, false, true}));
  auto written = WriteTensorDict(sd, path);
  ASSERT_TRUE(written.ok()) << written.status();
  const std::string bytes = [&] {
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  }();
  EXPECT_EQ(written->bytes, bytes.size());
  EXPECT_LT(bytes.size(), 64u << 10) << "a view's whole 4 MiB storage was written";
  EXPECT_EQ(written->crc32c, Crc(bytes));
  ASSERT_EQ(written->tensor_crc32c.size(), sd.size());
  for (size_t i = 0; i < sd.size(); ++i) {
    const torch::Tensor c = sd[i].value().contiguous();
    EXPECT_EQ(written->tensor_crc32c[i],
              Crc(std::string(static_cast<const char*>(c.data_ptr()), c.nbytes())))
        << sd[i].key();
  }
  auto loaded = LoadTensorDict(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->tensors.keys(), sd.keys());
  for (const auto& item : sd) {
    EXPECT_EQ(loaded->tensors[item.key()].scalar_type(), item.value().scalar_type());
    EXPECT_TRUE(torch::equal(loaded->tensors[item.key()], item.value())) << item.key();
  }
  // Undefined and non-dense tensors are refused by name, nothing is left.
  TensorDict bad;
  bad.insert("undefined", torch::Tensor());
  auto refused = WriteTensorDict(bad, dir + "/bad.pt");
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("'undefined'"), std::string::npos) << refused.status();
  TensorDict sparse;
  sparse.insert("sparse", torch::eye(3).to_sparse());
  refused = WriteTensorDict(sparse, dir + "/bad.pt");
  EXPECT_NE(refused.status().message().find("'sparse'"), std::string::npos) << refused.status();
  std::ifstream leftover(dir + "/bad.pt");
  EXPECT_FALSE(leftover.good());

  if (!PythonTorchAvailable()) {
    GTEST_FAIL() << "the Python of the build's torch wheel cannot import torch (run tools/setup.sh "
                    "--with-python)";
  }
  std::string output;
  int rc = RunPython(R"(
import sys, torch
sd = torch.load(sys.argv[1])
big = torch.arange(1 << 20, dtype=torch.float)
want = {
    "view.head": big[:10],
    "view.middle": big[1000:1006].view(2, 3),
    "transposed": torch.arange(12, dtype=torch.double).view(3, 4).t(),
    "empty": torch.zeros(0, 5, dtype=torch.int),
    "half": torch.linspace(-1, 1, 7).half(),
    "bool": torch.tensor([True, False, True]),
}
assert list(sd) == list(want), list(sd)
for k, v in want.items():
    assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
print("ok")
)",
                     "'" + path + "'", &output);
  EXPECT_EQ(rc, 0) << output;
}

TEST(PytorchFormatTest, TruncatedAndForeignFilesAreClearErrors) {
  const std::string dir = TempDir("bad");
  TensorDict sd;
  sd.insert("w", torch::randn({64, 64}));
  ASSERT_TRUE(SaveTensorDict(sd, dir + "/sd.pt").ok());
  std::ifstream in(dir + "/sd.pt", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  {
    std::ofstream out(dir + "/short.pt", std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
  }
  auto truncated = LoadTensorDict(dir + "/short.pt");
  ASSERT_FALSE(truncated.ok());
  EXPECT_NE(truncated.status().message().find(dir + "/short.pt"), std::string::npos)
      << truncated.status();

  c10::impl::GenericDict mixed(c10::StringType::get(), c10::AnyType::get());
  mixed.insert("w", torch::ones({1}));
  mixed.insert("lr", 0.5);
  ASSERT_TRUE(SaveIValue(c10::IValue(mixed), dir + "/mixed.pt").ok());
  auto not_tensors = LoadTensorDict(dir + "/mixed.pt");
  ASSERT_FALSE(not_tensors.ok());
  EXPECT_NE(not_tensors.status().message().find("'lr'"), std::string::npos) << not_tensors.status();
  auto missing = LoadTensorDict(dir + "/nope.pt");
  EXPECT_FALSE(missing.ok());
}

TEST(PytorchFormatTest, LoadLeavesModuleUntouchedOnShapeMismatch) {
  auto model = MakeModel();
  TensorDict before;
  for (const auto& item : ModuleStateDict(*model)) before.insert(item.key(), item.value().clone());
  TensorDict bad;
  for (const auto& item : before) bad.insert(item.key(), item.value() + 1);
  bad["2.bias"] = torch::zeros({3});
  absl::Status status = LoadModuleStateDict(*model, bad);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("'2.bias'"), std::string::npos) << status;
  EXPECT_NE(status.message().find("[3]"), std::string::npos) << status;
  for (const auto& item : ModuleStateDict(*model)) {
    EXPECT_TRUE(torch::equal(item.value(), before[item.key()])) << item.key();
  }
  TensorDict unknown = before;
  unknown.insert("3.weight", torch::zeros({1}));
  status = LoadModuleStateDict(*model, unknown);
  EXPECT_NE(status.message().find("unknown tensor '3.weight'"), std::string::npos) << status;
}

// C++ writes a model's state dict; Python's torch.load opens it, loads it into
// the equivalent nn.Sequential (strict) and computes the forward pass of an
// input also written by C++. The outputs must agree.
TEST(PytorchFormatTest, PythonLoadsWhatCppSaves) {
  if (!PythonTorchAvailable()) {
    GTEST_FAIL() << "the Python of the build's torch wheel cannot import torch (run tools/setup.sh "
                    "--with-python)";
  }
  const std::string dir = TempDir("cpp_to_py");
  torch::manual_seed(3);
  auto model = MakeModel();
  ASSERT_TRUE(SaveTensorDict(ModuleStateDict(*model), dir + "/model.pt").ok());
  TensorDict io;
  io.insert("x", torch::randn({5, 4}));
  ASSERT_TRUE(SaveTensorDict(io, dir + "/x.pt").ok());
  std::string output;
  int rc = RunPython(R"(
import sys, torch
d = sys.argv[1]
sd = torch.load(d + "/model.pt")
assert isinstance(sd, dict), type(sd)
assert list(sd.keys()) == ["0.weight", "0.bias", "2.weight", "2.bias"], list(sd.keys())
m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
m.load_state_dict(sd, strict=True)
x = torch.load(d + "/x.pt")["x"]
torch.save({"y": m(x).detach()}, d + "/y.pt")
print("ok")
)",
                     "'" + dir + "'", &output);
  ASSERT_EQ(rc, 0) << output;
  auto y = LoadTensorDict(dir + "/y.pt");
  ASSERT_TRUE(y.ok()) << y.status();
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::allclose(y->tensors["y"], model->forward(io["x"])));
}

// Python writes torch.save(model.state_dict()) (an OrderedDict with
// _metadata) plus an input and its output; C++ loads the state dict into the
// same architecture and reproduces the output.
TEST(PytorchFormatTest, CppLoadsPythonStateDict) {
  if (!PythonTorchAvailable()) {
    GTEST_FAIL() << "the Python of the build's torch wheel cannot import torch (run tools/setup.sh "
                    "--with-python)";
  }
  const std::string dir = TempDir("py_to_cpp");
  std::string output;
  int rc = RunPython(R"(
import sys, torch
d = sys.argv[1]
torch.manual_seed(7)
m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
m.register_buffer("steps", torch.tensor([3, 4], dtype=torch.int64))
torch.save(m.state_dict(), d + "/model.pt")
x = torch.randn(5, 4)
torch.save({"x": x, "y": m(x).detach()}, d + "/io.pt")
print("ok")
)",
                     "'" + dir + "'", &output);
  ASSERT_EQ(rc, 0) << output;
  auto loaded = LoadTensorDict(dir + "/model.pt");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->tensors.keys(),
            (std::vector<std::string>{"steps", "0.weight", "0.bias", "2.weight", "2.bias"}));
  EXPECT_EQ(loaded->tensors["steps"].scalar_type(), torch::kLong);
  EXPECT_TRUE(torch::equal(loaded->tensors["steps"], torch::tensor({3, 4}, torch::kLong)));
  ASSERT_TRUE(loaded->metadata.isGenericDict());
  auto metadata = loaded->metadata.toGenericDict();
  ASSERT_TRUE(metadata.contains(""));
  EXPECT_EQ(metadata.at("").toGenericDict().at("version").toInt(), 1);
  ASSERT_TRUE(metadata.contains("0"));

  auto model = MakeModel();
  TensorDict params = loaded->tensors;
  params.erase("steps");
  ASSERT_TRUE(LoadModuleStateDict(*model, params).ok());
  auto io = LoadTensorDict(dir + "/io.pt");
  ASSERT_TRUE(io.ok()) << io.status();
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::allclose(model->forward(io->tensors["x"]), io->tensors["y"]));
}

// Python's pre-1.6 (non-zip) format is not read; the error says so.
TEST(PytorchFormatTest, LegacyPythonFormatIsAClearError) {
  if (!PythonTorchAvailable()) {
    GTEST_FAIL() << "the Python of the build's torch wheel cannot import torch (run tools/setup.sh "
                    "--with-python)";
  }
  const std::string dir = TempDir("legacy");
  std::string output;
  int rc = RunPython(R"(
import sys, torch
torch.save({"w": torch.ones(2)}, sys.argv[1] + "/legacy.pt", _use_new_zipfile_serialization=False)
)",
                     "'" + dir + "'", &output);
  ASSERT_EQ(rc, 0) << output;
  auto loaded = LoadTensorDict(dir + "/legacy.pt");
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find(dir + "/legacy.pt: not a readable PyTorch archive"),
            std::string::npos)
      << loaded.status();
}

// A torch.save-style archive whose data.pkl is `pickle` (protocol 2, no
// tensors), written by LibTorch's own zip writer.
void WritePickleArchive(const std::string& path, const std::string& pickle) {
  caffe2::serialize::PyTorchStreamWriter writer(path);
  writer.writeRecord("data.pkl", pickle.data(), pickle.size());
  writer.writeEndOfFile();
}

// `depth` lists nested in one another: push them all, then APPEND each into
// the one below it.
std::string NestedListPickle(size_t depth) {
  return "\x80\x02" + std::string(depth, ']') + std::string(depth - 1, 'a') + ".";
}

// A crafted file nesting lists a million deep (Python's torch.load reads it)
// used to overflow the stack. Now the depth is bounded before any recursive
// conversion, and the error names the limit and the depth found.
TEST(PytorchFormatTest, DeeplyNestedPickleIsRefusedNotACrash) {
  const std::string dir = TempDir("deep");
  WritePickleArchive(dir + "/deep.pt", NestedListPickle(1000000));
  auto deep = LoadIValue(dir + "/deep.pt");
  ASSERT_FALSE(deep.ok());
  EXPECT_NE(deep.status().message().find(
                dir + "/deep.pt: pickle nests containers 1000000 levels deep; at "
                      "most 1000 levels are read"),
            std::string::npos)
      << deep.status();

  // The limit itself loads (and its IValue is destroyed without trouble).
  WritePickleArchive(dir + "/limit.pt", NestedListPickle(1000));
  auto limit = LoadIValue(dir + "/limit.pt");
  ASSERT_TRUE(limit.ok()) << limit.status();
  int levels = 0;
  for (c10::IValue v = *limit; v.isList(); ++levels) {
    auto list = v.toList();
    v = list.empty() ? c10::IValue() : list.get(0);
  }
  EXPECT_EQ(levels, 1000);
  WritePickleArchive(dir + "/over.pt", NestedListPickle(1001));
  auto over = LoadIValue(dir + "/over.pt");
  EXPECT_NE(over.status().message().find("1001 levels deep"), std::string::npos) << over.status();

  // The same through dicts as LoadTensorDict reads them: {"a": {"a": ...}}.
  // Push the outer dict, then ("a", next dict) per level; SETITEM each into
  // the one below.
  const std::string key_a(
      "X\x01\x00\x00\x00"
      "a",
      6);
  std::string dicts = "\x80\x02}";
  for (int k = 1; k < 200000; ++k) dicts += key_a + "}";
  dicts += std::string(200000 - 1, 's') + ".";
  WritePickleArchive(dir + "/dicts.pt", dicts);
  auto nested_dicts = LoadTensorDict(dir + "/dicts.pt");
  EXPECT_NE(nested_dicts.status().message().find("200000 levels deep"), std::string::npos)
      << nested_dicts.status();
}

// The memo lets a pickle make a list that contains itself (Python reads it as
// a recursive list); it has no IValue form and is refused, not recursed into
// forever.
TEST(PytorchFormatTest, SelfContainingPickleIsRefused) {
  const std::string dir = TempDir("cycle");
  // []; memo[0] = it; push memo[0]; APPEND -> l = [l]
  WritePickleArchive(dir + "/cycle.pt", std::string("\x80\x02]q\x00h\x00"
                                                    "a.",
                                                    9));
  auto cycle = LoadIValue(dir + "/cycle.pt");
  ASSERT_FALSE(cycle.ok());
  EXPECT_NE(cycle.status().message().find("contains itself"), std::string::npos) << cycle.status();
}

// One list shared 2^60 ways through the memo (60 levels of [x, x]) stays
// shared, as in Python, instead of being copied out exponentially.
TEST(PytorchFormatTest, SharedObjectsStayShared) {
  const std::string dir = TempDir("shared");
  std::string pickle = std::string(
      "\x80\x02]q\x00"
      "0",
      6);  // [] memoized, popped
  for (int k = 1; k <= 60; ++k) {
    pickle += "(h";
    pickle += static_cast<char>(k - 1);
    pickle += "h";
    pickle += static_cast<char>(k - 1);
    pickle += "lq";
    pickle += static_cast<char>(k);
    pickle += "0";  // POP: the list stays reachable through the memo
  }
  pickle += "h";
  pickle += static_cast<char>(60);
  pickle += ".";
  WritePickleArchive(dir + "/shared.pt", pickle);
  const auto start = std::chrono::steady_clock::now();
  auto shared = LoadIValue(dir + "/shared.pt");
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  auto top = shared->toList();
  ASSERT_EQ(top.size(), 2u);
  EXPECT_TRUE(top.get(0).is(top.get(1)));
}

}  // namespace
}  // namespace formats
