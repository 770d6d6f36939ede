// SaveSafetensors / LoadSafetensors against Python's safetensors package
// (tools/setup.sh --with-python pins it): every dtype both ways, bitwise;
// and every malformed file the loader must refuse.
#include "formats/safetensors/safetensors.h"

#include <dirent.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <new>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "formats/testing/file_bytes.h"
#include "formats/testing/python_interop.h"
#include "state_dict/module_state.h"

// The largest single operator new request while `g_counting` is set: the
// loader's header buffer is a std::string, so a refusal that comes before
// allocating it shows here as a small number. Every unaligned form of new
// and delete is replaced, so that they all pair up (malloc and free; the
// aligned forms stay the runtime's, and pair among themselves).
namespace {
std::atomic<bool> g_counting{false};
std::atomic<size_t> g_largest{0};

void* CountedMalloc(size_t size) noexcept {
  if (g_counting.load(std::memory_order_relaxed)) {
    size_t seen = g_largest.load(std::memory_order_relaxed);
    while (size > seen && !g_largest.compare_exchange_weak(seen, size)) {
    }
  }
  return std::malloc(size == 0 ? 1 : size);
}

// Not inlined: GCC would otherwise see free() of what operator new returned
// and warn (-Wmismatched-new-delete), not knowing that new is malloc here.
__attribute__((noinline)) void Free(void* p) noexcept { std::free(p); }
}  // namespace

void* operator new(size_t size) {
  if (void* p = CountedMalloc(size)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t size) {
  if (void* p = CountedMalloc(size)) return p;
  throw std::bad_alloc();
}
void* operator new(size_t size, const std::nothrow_t&) noexcept { return CountedMalloc(size); }
void* operator new[](size_t size, const std::nothrow_t&) noexcept { return CountedMalloc(size); }
void operator delete(void* p) noexcept { Free(p); }
void operator delete[](void* p) noexcept { Free(p); }
void operator delete(void* p, size_t) noexcept { Free(p); }
void operator delete[](void* p, size_t) noexcept { Free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { Free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { Free(p); }

namespace formats {
namespace {

using testing::PythonTorchAvailable;
using testing::RunPython;
using testing::Slurp;
using testing::Spit;
using testing::TempDir;

constexpr char kNoPython[] =
    "the Python of the build's torch wheel cannot import torch (run tools/setup.sh "
    "--with-python, which also installs safetensors)";

struct DtypeCase {
  torch::ScalarType type;
  const char* safetensors;  // the header's name
  const char* python;       // str(tensor.dtype) in Python
};

const std::vector<DtypeCase>& AllDtypes() {
  static const std::vector<DtypeCase> cases = {
      {torch::kBool, "BOOL", "torch.bool"},
      {torch::kUInt8, "U8", "torch.uint8"},
      {torch::kInt8, "I8", "torch.int8"},
      {torch::kInt16, "I16", "torch.int16"},
      {c10::ScalarType::UInt16, "U16", "torch.uint16"},
      {torch::kInt32, "I32", "torch.int32"},
      {c10::ScalarType::UInt32, "U32", "torch.uint32"},
      {torch::kInt64, "I64", "torch.int64"},
      {c10::ScalarType::UInt64, "U64", "torch.uint64"},
      {torch::kFloat16, "F16", "torch.float16"},
      {torch::kBFloat16, "BF16", "torch.bfloat16"},
      {torch::kFloat32, "F32", "torch.float32"},
      {torch::kFloat64, "F64", "torch.float64"},
      {torch::kComplexFloat, "C64", "torch.complex64"},
      {c10::ScalarType::Float8_e4m3fn, "F8_E4M3", "torch.float8_e4m3fn"},
      {c10::ScalarType::Float8_e5m2, "F8_E5M2", "torch.float8_e5m2"},
      {c10::ScalarType::Float8_e4m3fnuz, "F8_E4M3FNUZ", "torch.float8_e4m3fnuz"},
      {c10::ScalarType::Float8_e5m2fnuz, "F8_E5M2FNUZ", "torch.float8_e5m2fnuz"},
      {c10::ScalarType::Float8_e8m0fnu, "F8_E8M0", "torch.float8_e8m0fnu"},
  };
  return cases;
}

// Random bytes as a tensor of `type` (bools 0 or 1; floats may be NaN: the
// comparisons are of bytes).
torch::Tensor RandomTensor(torch::ScalarType type, std::vector<int64_t> shape) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(type));
  torch::Tensor raw = type == torch::kBool ? torch::randint(0, 2, {bytes}, torch::kUInt8)
                                           : torch::randint(0, 256, {bytes}, torch::kUInt8);
  return raw.view(type).reshape(shape);
}

// A tensor's bytes in row-major order (conjugate and negative views
// resolved), as hex.
std::string Hex(const torch::Tensor& t) {
  torch::Tensor c = t.resolve_conj().resolve_neg().contiguous();
  return absl::BytesToHexString(absl::string_view(
      static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()) * c.element_size()));
}

std::string Shape(const torch::Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.sizes(), ", "), "]");
}

void ExpectSameBits(const TensorDict& expected, const TensorDict& actual) {
  ASSERT_EQ(actual.keys(), expected.keys());
  for (const auto& item : expected) {
    const torch::Tensor& got = actual[item.key()];
    EXPECT_EQ(got.scalar_type(), item.value().scalar_type()) << item.key();
    EXPECT_EQ(got.sizes(), item.value().sizes()) << item.key();
    EXPECT_EQ(Hex(got), Hex(item.value())) << item.key();
  }
}

// Every dtype, 0-dim, empty, and views that are not contiguous.
TensorDict MixedState() {
  torch::manual_seed(7);
  TensorDict sd;
  for (const DtypeCase& d : AllDtypes()) {
    sd.insert(absl::StrCat("t.", d.safetensors), RandomTensor(d.type, {3, 5}));
  }
  sd.insert("scalar.bf16", RandomTensor(torch::kBFloat16, {}));
  sd.insert("scalar.f64", RandomTensor(torch::kFloat64, {}));
  sd.insert("empty.f32", torch::empty({0, 4}, torch::kFloat32));
  sd.insert("empty.i8", torch::empty({2, 0, 3}, torch::kInt8));
  sd.insert("transposed.f32", RandomTensor(torch::kFloat32, {4, 6}).t());
  sd.insert("strided.i16", RandomTensor(torch::kInt16, {10, 6}).slice(0, 1, 9, 3));
  sd.insert("conj.c64", RandomTensor(torch::kFloat32, {4}).view(torch::kComplexFloat).conj());
  sd.insert("neg.f64", torch::randn({3}, torch::kFloat64)._neg_view());
  sd.insert("unicode.näme \"quoted\"\n", torch::arange(3, torch::kInt32));
  return sd;
}

TEST(SafetensorsTest, RoundTripsEveryDtypeBitwise) {
  const std::string path = TempDir("st_round_trip") + "/model.safetensors";
  const TensorDict sd = MixedState();
  ASSERT_FALSE(sd["transposed.f32"].is_contiguous());
  ASSERT_TRUE(sd["conj.c64"].is_conj());
  ASSERT_TRUE(SaveSafetensors(sd, path, {{"step", "12"}}).ok());
  auto loaded = LoadSafetensors(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameBits(sd, loaded->tensors);
  EXPECT_EQ(loaded->metadata,
            (std::map<std::string, std::string>{{"format", "pt"}, {"step", "12"}}));
  for (const auto& item : loaded->tensors) {
    EXPECT_TRUE(item.value().is_contiguous()) << item.key();
    EXPECT_FALSE(item.value().is_conj()) << item.key();
  }

  // The header is padded so that the data starts 8-byte aligned.
  const std::string bytes = Slurp(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes.substr(8, 31), "{\"__metadata__\":{\"format\":\"pt\",");

  // A caller's "format" is kept; no temporary files are left beside.
  const std::string dir = TempDir("st_format");
  ASSERT_TRUE(SaveSafetensors(sd, dir + "/a.safetensors", {{"format", "np"}}).ok());
  ASSERT_TRUE(SaveSafetensors(sd, dir + "/a.safetensors", {{"format", "np"}}).ok());
  loaded = LoadSafetensors(dir + "/a.safetensors");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->metadata, (std::map<std::string, std::string>{{"format", "np"}}));
  std::vector<std::string> entries;
  DIR* d = opendir(dir.c_str());
  ASSERT_NE(d, nullptr);
  while (dirent* e = readdir(d)) {
    if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") {
      entries.push_back(e->d_name);
    }
  }
  closedir(d);
  EXPECT_EQ(entries, std::vector<std::string>{"a.safetensors"});

  // An empty dict is a valid file too.
  ASSERT_TRUE(SaveSafetensors(TensorDict(), dir + "/empty.safetensors").ok());
  loaded = LoadSafetensors(dir + "/empty.safetensors");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(loaded->tensors.is_empty());
}

// Python's reference reader loads our file: the same names, dtypes, shapes
// and bytes, our metadata with "format": "pt" (what transformers'
// from_pretrained requires), the header padded and every tensor's data
// aligned to its element size.
TEST(SafetensorsTest, PythonReadsOurFile) {
  if (!PythonTorchAvailable()) GTEST_FAIL() << kNoPython;
  const std::string path = TempDir("st_to_python") + "/model.safetensors";
  const TensorDict sd = MixedState();
  ASSERT_TRUE(SaveSafetensors(sd, path, {{"note", "from C++"}}).ok());
  std::string output;
  const int rc = RunPython(R"(
import json, struct, sys
import torch
from safetensors import safe_open
sys.stdout.reconfigure(encoding="utf-8")
from safetensors.torch import load_file
path = sys.argv[1]
tensors = load_file(path)
with safe_open(path, framework="pt") as f:
    print("metadata", json.dumps(f.metadata(), sort_keys=True))
raw = open(path, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
assert n % 8 == 0, n
header = json.loads(raw[8:8 + n])
for name, info in header.items():
    if name == "__metadata__":
        continue
    size = tensors[name].element_size()
    assert info["data_offsets"][0] % size == 0, (name, info)
for name in header:
    if name == "__metadata__":
        continue
    t = tensors[name]
    print(repr(name), t.dtype, list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes().hex())
)",
                           "'" + path + "'", &output);
  ASSERT_EQ(rc, 0) << output;
  std::string expected = "metadata {\"format\": \"pt\", \"note\": \"from C++\"}\n";
  auto python_name = [](torch::ScalarType type) -> std::string {
    for (const DtypeCase& d : AllDtypes()) {
      if (d.type == type) return d.python;
    }
    return "?";
  };
  for (const auto& item : sd) {
    // Python's repr of the names used here: single quotes, \n escaped.
    std::string repr = item.key();
    if (repr.find('\n') != std::string::npos) repr = absl::StrReplaceAll(repr, {{"\n", "\\n"}});
    absl::StrAppend(&expected, "'", repr, "' ", python_name(item.value().scalar_type()), " ",
                    Shape(item.value()), " ", Hex(item.value()), "\n");
  }
  EXPECT_EQ(output, expected);
}

// A file from Python's save_file (bf16, fp8, 0-dim, empty, metadata): we
// read what Python printed of it, bit for bit, in the header's order.
TEST(SafetensorsTest, ReadsPythonsFile) {
  if (!PythonTorchAvailable()) GTEST_FAIL() << kNoPython;
  const std::string path = TempDir("st_from_python") + "/py.safetensors";
  std::string output;
  const int rc = RunPython(R"(
import json, struct, sys
import torch
from safetensors.torch import save_file
torch.manual_seed(0)
def rand(dtype, shape):
    n = 1
    for d in shape:
        n *= d
    size = torch.empty((), dtype=dtype).element_size()
    high = 2 if dtype == torch.bool else 256
    return torch.randint(0, high, (n * size,), dtype=torch.uint8).view(dtype).reshape(shape)
tensors = {
    "embed.weight": torch.randn(7, 3, dtype=torch.bfloat16),
    "fc.weight": torch.randn(4, 3),
    "fc.bias": torch.randn(4, dtype=torch.float16),
    "fp8": rand(torch.float8_e4m3fn, [2, 2]),
    "mask": rand(torch.bool, [5]),
    "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "u16": rand(torch.uint16, [3]),
    "step": torch.tensor(3.5, dtype=torch.float64),
    "none": torch.empty(0, 2, dtype=torch.int32),
}
save_file(tensors, sys.argv[1], metadata={"format": "pt", "author": "python"})
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
for name in json.loads(raw[8:8 + n]):
    if name == "__metadata__":
        continue
    t = tensors[name]
    print(name, t.dtype, list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes().hex())
)",
                           "'" + path + "'", &output);
  ASSERT_EQ(rc, 0) << output;
  auto loaded = LoadSafetensors(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->metadata,
            (std::map<std::string, std::string>{{"author", "python"}, {"format", "pt"}}));
  auto python_name = [](torch::ScalarType type) -> std::string {
    for (const DtypeCase& d : AllDtypes()) {
      if (d.type == type) return d.python;
    }
    return "?";
  };
  std::string ours;
  for (const auto& item : loaded->tensors) {
    absl::StrAppend(&ours, item.key(), " ", python_name(item.value().scalar_type()), " ",
                    Shape(item.value()), " ", Hex(item.value()), "\n");
  }
  EXPECT_EQ(ours, output);
  EXPECT_EQ(loaded->tensors.size(), 9u);
  // Python's writer orders the data (and its header) by its dtype enum,
  // descending (I64 before F64), which is the order loaded here.
  EXPECT_EQ(loaded->tensors.keys()[0], "ids");
  EXPECT_EQ(loaded->tensors.keys()[1], "step");
}

// The README's snippet ("Checkpoints"), as it is there.
TEST(SafetensorsTest, ReadmeExample) {
  torch::nn::Linear model(3, 2);
  const std::string dir = TempDir("st_readme");
  const std::string path = dir + "/model.safetensors";
  absl::Status saved =
      formats::SaveSafetensors(state_dict::ModuleStateDict(*model), path, {{"step", "1000"}});
  ASSERT_TRUE(saved.ok()) << saved;
  auto loaded = formats::LoadSafetensors(path);  // or Python's save_file
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->tensors.keys(), (std::vector<std::string>{"weight", "bias"}));
  EXPECT_TRUE(torch::equal(loaded->tensors["weight"], model->weight));
  EXPECT_EQ(loaded->metadata["format"], "pt");
  EXPECT_EQ(loaded->metadata["step"], "1000");
}

// ---- files the loader refuses -----------------------------------------------

// A file of an 8-byte length `n`, then `header`, then `data`.
std::string File(uint64_t n, const std::string& header, const std::string& data = "") {
  std::string bytes(8, '\0');
  std::memcpy(bytes.data(), &n, 8);
  return bytes + header + data;
}
std::string File(const std::string& header, const std::string& data = "") {
  return File(header.size(), header, data);
}

// The error a load of `bytes` gives ("OK" when it loads).
std::string LoadError(const std::string& bytes, const LoadOptions& options = {}) {
  const std::string path = TempDir("st_bad") + "/bad.safetensors";
  Spit(path, bytes);
  auto loaded = LoadSafetensors(path, options);
  if (loaded.ok()) return "OK";
  std::string message(loaded.status().message());
  EXPECT_EQ(message.rfind(path, 0), 0u) << "the error names the file: " << message;
  return message;
}

absl::StatusCode LoadCode(const std::string& bytes, const LoadOptions& options = {}) {
  const std::string path = TempDir("st_bad") + "/bad.safetensors";
  Spit(path, bytes);
  return LoadSafetensors(path, options).status().code();
}

std::string Tensor(const std::string& name, const std::string& dtype, const std::string& shape,
                   const std::string& offsets) {
  return absl::StrCat("\"", name, "\":{\"dtype\":\"", dtype, "\",\"shape\":", shape,
                      ",\"data_offsets\":", offsets, "}");
}

// Loading `bytes` fails with a message that contains `expected`.
void ExpectError(const std::string& bytes, const std::string& expected) {
  const std::string error = LoadError(bytes);
  EXPECT_NE(error.find(expected), std::string::npos)
      << "expected the error to contain: " << expected << "\n                   it is: " << error;
}

TEST(SafetensorsTest, RefusesShortFilesAndHeaderLengthsBeforeAllocating) {
  ExpectError("", "only 0 bytes; a safetensors file starts with an 8-byte header length");
  ExpectError("abc", "only 3 bytes");
  EXPECT_EQ(LoadCode("abc"), absl::StatusCode::kDataLoss);

  // Lengths no file could back: refused from the 8 bytes, nothing allocated.
  for (const uint64_t n : {~uint64_t{0}, uint64_t{1} << 62, uint64_t{100'000'001}}) {
    g_largest = 0;
    g_counting = true;
    const std::string error = LoadError(File(n, "{}"));
    g_counting = false;
    EXPECT_NE(error.find(absl::StrCat("header length ", n,
                                      " is more than safetensors' limit of 100000000 bytes")),
              std::string::npos)
        << error;
    EXPECT_LT(g_largest.load(), size_t{1} << 20) << n;
  }
  for (const uint64_t n : {uint64_t{100'000'000}, uint64_t{99'999'999}, uint64_t{3}}) {
    g_largest = 0;
    g_counting = true;
    const std::string error = LoadError(File(n, "{}"));
    g_counting = false;
    EXPECT_NE(error.find(absl::StrCat("header length ", n,
                                      " runs past the end of the file (10 bytes: at most 2 "
                                      "bytes of header)")),
              std::string::npos)
        << error;
    EXPECT_LT(g_largest.load(), size_t{1} << 20) << n;
  }
  // The counter sees a header that is allocated (4 MiB of spaces after {}).
  const std::string big_header = File("{}" + std::string(size_t{4} << 20, ' '));
  g_largest = 0;
  g_counting = true;
  EXPECT_EQ(LoadError(big_header), "OK");
  g_counting = false;
  EXPECT_GE(g_largest.load(), size_t{4} << 20);
}

TEST(SafetensorsTest, RefusesHeadersThatAreNotTheFormatsJson) {
  ExpectError(File(""), "the header is not valid JSON");
  ExpectError(File("{\"a\":"), "the header is not valid JSON");
  ExpectError(File("{}x"), "the header is not valid JSON");
  // nlohmann's parser would stop at a NUL as at the end of its input.
  ExpectError(File(std::string("{}\0\0", 4)),
              "the header holds a NUL byte at offset 2 (JSON has none)");
  ExpectError(File(std::string("{\"a\0b\":1}", 9)), "NUL byte at offset 3");
  ExpectError(File("{\"\xff\":{}}"), "not valid JSON");
  ExpectError(File("{\"\xc0\xaf\":{}}"), "not valid JSON");  // an overlong '/'
  ExpectError(File("[]"), "the header is an array, not a JSON object");
  ExpectError(File("\"x\""), "the header is the string 'x', not a JSON object");
  ExpectError(File("7"), "the header is the number 7, not a JSON object");
  EXPECT_EQ(LoadCode(File("[]")), absl::StatusCode::kDataLoss);

  // Nesting beyond the format's three levels stops at its first step, so
  // ten million brackets (10 MB of header) cost neither stack nor time.
  ExpectError(File(std::string(10'000'000, '[')), "the header is an array, not a JSON object");
  ExpectError(File("{\"a\":" + std::string(10'000'000, '[')),
              "tensor 'a' is an array; expected an object {dtype, shape, data_offsets}");
  ExpectError(File("{\"a\":{\"dtype\":\"U8\",\"shape\":" + std::string(10'000'000, '[')),
              "tensor 'a': shape holds an array; expected integers");
  ExpectError(File("{\"__metadata__\":{\"k\":{\"x\":{}}}}"),
              "__metadata__ value of 'k' is an object; expected a string");
  ExpectError(File("{\"a\":{\"dtype\":{\"x\":1}}}"),
              "tensor 'a': dtype is an object; expected a string");

  ExpectError(File("{\"__metadata__\":{\"k\":1}}"),
              "__metadata__ value of 'k' is the number 1; expected a string");
  ExpectError(File("{\"__metadata__\":{\"k\":null}}"),
              "__metadata__ value of 'k' is null; expected a string");
  ExpectError(File("{\"__metadata__\":\"pt\"}"),
              "__metadata__ is the string 'pt'; expected an object of strings");
  ExpectError(File("{\"__metadata__\":{\"k\":\"a\",\"k\":\"b\"}}"),
              "__metadata__: the key 'k' appears twice");
  ExpectError(File("{\"__metadata__\":{},\"__metadata__\":{}}"),
              "the key \"__metadata__\" appears twice");
  // As the reference: null metadata is none, and {} is an empty file.
  EXPECT_EQ(LoadError(File("{\"__metadata__\":null}")), "OK");
  EXPECT_EQ(LoadError(File("  {}  ")), "OK");
}

TEST(SafetensorsTest, RefusesBadTensorEntries) {
  const std::string u8x2 = Tensor("a", "U8", "[2]", "[0,2]");
  EXPECT_EQ(LoadError(File("{" + u8x2 + "}", "xy")), "OK");
  ExpectError(File("{" + u8x2 + "," + u8x2 + "}", "xy"), "the tensor name 'a' appears twice");
  ExpectError(File("{\"a\":{\"dtype\":\"U8\",\"dtype\":\"U8\"}}"),
              "tensor 'a': the field dtype appears twice");
  ExpectError(File("{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2],\"x\":1}}", "xy"),
              "tensor 'a': unknown field 'x'; expected dtype, shape and data_offsets");
  ExpectError(File("{\"a\":{\"dtype\":\"U8\",\"shape\":[2]}}", "xy"),
              "tensor 'a': no data_offsets field");
  ExpectError(File("{\"a\":{\"shape\":[2],\"data_offsets\":[0,2]}}", "xy"),
              "tensor 'a': no dtype field");
  ExpectError(File("{\"a\":7}"), "tensor 'a' is the number 7; expected an object");

  // dtypes
  ExpectError(File("{" + Tensor("a", "F128", "[2]", "[0,2]") + "}", "xy"),
              "tensor 'a': dtype 'F128' is not a safetensors dtype; expected one of BOOL, U8");
  ExpectError(File("{" + Tensor("a", "F4", "[4]", "[0,2]") + "}", "xy"),
              "tensor 'a': dtype 'F4' (packed, less than a byte an element) is not supported");
  ExpectError(File("{\"a\":{\"dtype\":32}}"),
              "tensor 'a': dtype is the number 32; expected a string");

  // shapes
  ExpectError(File("{" + Tensor("a", "U8", "[-2]", "[0,2]") + "}", "xy"),
              "tensor 'a': shape entry -2 is negative");
  ExpectError(File("{" + Tensor("a", "U8", "[2.0]", "[0,2]") + "}", "xy"),
              "tensor 'a': shape entry 2.0 is not an integer");
  ExpectError(File("{" + Tensor("a", "U8", "[9223372036854775808]", "[0,2]") + "}", "xy"),
              "tensor 'a': shape entry 9223372036854775808 is beyond 2^63 - 1");
  ExpectError(File("{" + Tensor("a", "U8", "[99999999999999999999]", "[0,2]") + "}", "xy"),
              "tensor 'a': shape entry 99999999999999999999 is not an integer");
  ExpectError(File("{" + Tensor("a", "U8", "[4294967296,4294967296]", "[0,2]") + "}", "xy"),
              "tensor 'a': shape [4294967296, 4294967296]: the product of its sizes overflows");
  ExpectError(File("{" + Tensor("a", "U8", "[0,4294967296,4294967296]", "[0,0]") + "}"),
              "the product of its sizes overflows");
  ExpectError(File("{" + Tensor("a", "F64", "[2305843009213693952]", "[0,2]") + "}", "xy"),
              "tensor 'a': shape [2305843009213693952] of F64 is more than 2^64 - 1 bytes");
  ExpectError(File("{\"a\":{\"dtype\":\"U8\",\"shape\":\"2\"}}"),
              "tensor 'a': shape is the string '2'; expected an array of integers");

  // data_offsets
  ExpectError(File("{" + Tensor("a", "U8", "[2]", "[2]") + "}", "xy"),
              "tensor 'a': data_offsets has 1 entries; expected [begin, end]");
  ExpectError(File("{" + Tensor("a", "U8", "[2]", "[0,2,2]") + "}", "xy"),
              "tensor 'a': data_offsets has more than two entries");
  ExpectError(File("{" + Tensor("a", "U8", "[2]", "[2,0]") + "}", "xy"),
              "tensor 'a': data_offsets [2, 0] decrease");
  ExpectError(File("{" + Tensor("a", "U8", "[2]", "[-1,1]") + "}", "xy"),
              "tensor 'a': data_offsets entry -1 is negative");
  ExpectError(File("{" + Tensor("a", "U8", "[2]", "[\"0\",2]") + "}", "xy"),
              "tensor 'a': data_offsets holds the string '0'; expected integers");
  ExpectError(File("{" + Tensor("a", "U8", "[2]", "{}") + "}", "xy"),
              "tensor 'a': data_offsets is an object; expected [begin, end]");
  ExpectError(File("{" + Tensor("a", "F32", "[3]", "[0,8]") + "}", std::string(8, 'x')),
              "tensor 'a': data_offsets [0, 8] hold 8 bytes, but F32 of shape [3] takes "
              "3 * 4 = 12");
  ExpectError(File("{" + Tensor("a", "U8", "[8]", "[0,8]") + "}", "xyzw"),
              "tensor 'a': data_offsets [0, 8] run past the end of the data, which holds 4 "
              "bytes after the header");
  ExpectError(
      File("{" + Tensor("a", "U8", "[4]", "[18446744073709551612,18446744073709551616]") + "}"),
      "data_offsets entry 18446744073709551616 is not an integer");

  // Tiling: overlaps, gaps and trailing bytes.
  ExpectError(
      File("{" + Tensor("a", "U8", "[4]", "[0,4]") + "," + Tensor("b", "U8", "[4]", "[2,6]") + "}",
           "xxxxxx"),
      "tensors 'a' [0, 4) and 'b' [2, 6) overlap");
  ExpectError(
      File("{" + Tensor("a", "U8", "[2]", "[0,2]") + "," + Tensor("b", "U8", "[2]", "[0,2]") + "}",
           "xx"),
      "tensors 'a' [0, 2) and 'b' [0, 2) overlap");
  ExpectError(
      File("{" + Tensor("a", "U8", "[2]", "[0,2]") + "," + Tensor("b", "U8", "[2]", "[3,5]") + "}",
           "xxxxx"),
      "no tensor holds bytes [2, 3) of the data (a gap before tensor 'b')");
  ExpectError(File("{" + Tensor("a", "U8", "[2]", "[1,3]") + "}", "xxx"),
              "no tensor holds bytes [0, 1) of the data (a gap before tensor 'a')");
  ExpectError(File("{" + u8x2 + "}", "xyz"),
              "1 bytes after the last tensor (the tensors end at byte 2 of the data, which "
              "holds 3 bytes after the header)");
  ExpectError(File("{}", "z"), "1 bytes after the last tensor");
  // Out of order in the header, zero-sized ones anywhere: as the reference.
  const std::string out_of_order = TempDir("st_order") + "/o.safetensors";
  Spit(out_of_order,
       File("{" + Tensor("b", "U8", "[1]", "[1,2]") + "," + Tensor("e", "F32", "[0,3]", "[1,1]") +
                "," + Tensor("a", "U8", "[1]", "[0,1]") + "}",
            "AB"));
  auto swapped = LoadSafetensors(out_of_order);
  ASSERT_TRUE(swapped.ok()) << swapped.status();
  EXPECT_EQ(swapped->tensors.keys(), (std::vector<std::string>{"b", "e", "a"}));
  EXPECT_EQ(swapped->tensors["a"].item<uint8_t>(), 'A');
  EXPECT_EQ(swapped->tensors["b"].item<uint8_t>(), 'B');

  // BOOL bytes other than 0 and 1.
  ExpectError(File("{" + Tensor("m", "BOOL", "[3]", "[0,3]") + "}", std::string("\1\0\2", 3)),
              "tensor 'm' (BOOL) holds the byte 2 at element 2; expected 0 or 1");
  // Long or unprintable names are shown escaped and cut.
  const std::string error = LoadError(
      File("{" + Tensor(std::string(1000, 'n') + "\\u0001", "F128", "[1]", "[0,1]") + "}", "x"));
  EXPECT_NE(error.find("tensor 'nnnn"), std::string::npos) << error;
  EXPECT_NE(error.find("'... (1001 bytes)"), std::string::npos) << error;
  EXPECT_LT(error.size(), 600u) << error;
}

TEST(SafetensorsTest, LoadBudgetIsCheckedBeforeReading) {
  const std::string dir = TempDir("st_budget");
  TensorDict sd;
  sd.insert("w", torch::zeros({1000}, torch::kFloat32));
  ASSERT_TRUE(SaveSafetensors(sd, dir + "/w.safetensors").ok());
  const std::string bytes = Slurp(dir + "/w.safetensors");
  LoadOptions options;
  options.max_bytes = 4000;  // the tensor alone; the header does not fit beside it
  EXPECT_EQ(LoadCode(bytes, options), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(LoadError(bytes, options)
                .find(absl::StrCat("its header and tensors take ", bytes.size() - 8, " bytes")),
            std::string::npos)
      << LoadError(bytes, options);
  EXPECT_NE(LoadError(bytes, options)
                .find("more than the load's budget of 4000 bytes "
                      "(max_bytes); refused before reading any of them"),
            std::string::npos);
  options.max_bytes = bytes.size() - 8;
  EXPECT_EQ(LoadError(bytes, options), "OK");
}

TEST(SafetensorsTest, SaveRefusesWhatTheFormatCannotHold) {
  const std::string dir = TempDir("st_save_errors");
  const std::string path = dir + "/x.safetensors";
  auto error = [&](const TensorDict& sd, const std::map<std::string, std::string>& meta = {}) {
    absl::Status status = SaveSafetensors(sd, path, meta);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_FALSE(std::ifstream(path).good()) << "nothing is written";
    return std::string(status.message());
  };
  TensorDict sd;
  sd.insert("z", torch::zeros({2}, torch::kComplexDouble));
  std::string e = error(sd);
  EXPECT_NE(e.find("cannot save " + path +
                   " as safetensors: tensor 'z' has dtype ComplexDouble, "
                   "which safetensors has no name for; it holds BOOL, U8"),
            std::string::npos)
      << e;
  sd = TensorDict();
  sd.insert("s", torch::eye(3).to_sparse());
  e = error(sd);
  EXPECT_NE(e.find("tensor 's' has layout Sparse; safetensors holds dense (strided) tensors"),
            std::string::npos)
      << e;
  sd = TensorDict();
  sd.insert("__metadata__", torch::zeros({1}));
  EXPECT_NE(error(sd).find("a tensor may not be named \"__metadata__\""), std::string::npos);
  sd = TensorDict();
  sd.insert("bad\xff", torch::zeros({1}));
  EXPECT_NE(error(sd).find("tensor 'bad\\xff': the name is not valid UTF-8"), std::string::npos);
  EXPECT_NE(error(TensorDict(), {{"k", "\xed\xa0\x80"}})  // a UTF-16 surrogate
                .find("metadata entry 'k': not valid UTF-8"),
            std::string::npos);
  sd = TensorDict();
  sd.insert("u", torch::Tensor());
  EXPECT_NE(error(sd).find("tensor 'u' is undefined"), std::string::npos);
}

}  // namespace
}  // namespace formats
