// SafetensorsFile: every range of every dtype equals the same elements of
// LoadSafetensors' tensor; a Read touches only its range's bytes; Open
// refuses what LoadSafetensors refuses, with the same status, and truncated
// files or headers that claim more than the file holds.
#include "formats/safetensors/safetensors_file.h"

#include <dirent.h>
#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <torch/types.h>

#include "absl/strings/str_cat.h"
#include "formats/safetensors/safetensors.h"
#include "formats/testing/file_bytes.h"

namespace formats {
namespace {

using testing::Slurp;
using testing::Spit;

std::string TempDir(const std::string& name) {
  const char* base = getenv("TEST_TMPDIR");
  const std::string dir = std::string(base != nullptr ? base : "/tmp") + "/" + name;
  const std::string cmd = "rm -rf '" + dir + "' && mkdir -p '" + dir + "'";
  if (system(cmd.c_str()) != 0) abort();
  return dir;
}

const std::vector<torch::ScalarType>& AllDtypes() {
  static const std::vector<torch::ScalarType> types = {
      torch::kBool,
      torch::kUInt8,
      torch::kInt8,
      torch::kInt16,
      c10::ScalarType::UInt16,
      torch::kInt32,
      c10::ScalarType::UInt32,
      torch::kInt64,
      c10::ScalarType::UInt64,
      torch::kFloat16,
      torch::kBFloat16,
      torch::kFloat32,
      torch::kFloat64,
      torch::kComplexFloat,
      c10::ScalarType::Float8_e4m3fn,
      c10::ScalarType::Float8_e5m2,
      c10::ScalarType::Float8_e4m3fnuz,
      c10::ScalarType::Float8_e5m2fnuz,
      c10::ScalarType::Float8_e8m0fnu,
  };
  return types;
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

std::string Bytes(const torch::Tensor& t) {
  const torch::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()),
                     static_cast<size_t>(c.numel()) * c.element_size());
}

size_t OpenFds() {
  size_t n = 0;
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return 0;
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n;
}

TEST(SafetensorsFileTest, RangesOfEveryDtypeEqualLoadSafetensors) {
  torch::manual_seed(3);
  TensorDict sd;
  for (const torch::ScalarType type : AllDtypes()) {
    sd.insert(absl::StrCat("t.", c10::toString(type)), RandomTensor(type, {5, 7}));
  }
  sd.insert("scalar.bf16", RandomTensor(torch::kBFloat16, {}));
  sd.insert("empty.f16", torch::empty({0, 4}, torch::kFloat16));
  const std::string path = TempDir("stf_ranges") + "/model.safetensors";
  ASSERT_TRUE(SaveSafetensors(sd, path, {{"step", "3"}}).ok());
  auto loaded = LoadSafetensors(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->path(), path);
  EXPECT_EQ(file->metadata(), loaded->metadata);
  EXPECT_EQ(file->names(), loaded->tensors.keys());  // the header's order
  const std::string raw = Slurp(path);
  for (const auto& item : loaded->tensors) {
    const std::string& name = item.key();
    const torch::Tensor& whole = item.value();
    SCOPED_TRACE(name);
    ASSERT_TRUE(file->contains(name));
    auto info = file->info(name);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->dtype, whole.scalar_type());
    EXPECT_EQ(info->shape, whole.sizes().vec());
    EXPECT_EQ(info->numel, whole.numel());
    EXPECT_EQ(info->bytes, whole.numel() * static_cast<int64_t>(whole.element_size()));
    EXPECT_EQ(raw.substr(info->offset, info->bytes), Bytes(whole));

    const torch::Tensor flat = whole.reshape(-1);
    const int64_t n = whole.numel();
    std::vector<std::pair<int64_t, int64_t>> ranges = {{0, n}, {0, 0}, {n, 0}};
    if (n >= 3) ranges.insert(ranges.end(), {{1, n - 2}, {n - 1, 1}, {0, 1}, {n / 2, n - n / 2}});
    for (const auto& [offset, count] : ranges) {
      auto part = file->Read(name, offset, count);
      ASSERT_TRUE(part.ok()) << part.status();
      EXPECT_EQ(part->dim(), 1);
      EXPECT_EQ(part->numel(), count);
      EXPECT_EQ(part->scalar_type(), whole.scalar_type());
      EXPECT_TRUE(part->is_contiguous());
      EXPECT_TRUE(part->device().is_cpu());
      EXPECT_EQ(Bytes(*part), Bytes(flat.slice(0, offset, offset + count)))
          << "[" << offset << ", +" << count << ")";
    }
    auto all = file->ReadAll(name);
    ASSERT_TRUE(all.ok()) << all.status();
    EXPECT_EQ(all->sizes(), whole.sizes());
    EXPECT_EQ(Bytes(*all), Bytes(whole));
  }
}

// A file of one F32 tensor "x" of 100 elements and one BOOL tensor "b" of 10.
struct TwoTensors {
  std::string path;
  torch::Tensor x, b;
};

TwoTensors WriteTwoTensors(const std::string& dir) {
  TwoTensors out;
  out.path = TempDir(dir) + "/model.safetensors";
  out.x = torch::arange(100, torch::kFloat32);
  out.b = torch::tensor({1, 0, 1, 1, 0, 0, 1, 0, 1, 1}, torch::kBool);
  TensorDict sd;
  sd.insert("x", out.x);
  sd.insert("b", out.b);
  EXPECT_TRUE(SaveSafetensors(sd, out.path).ok());
  return out;
}

TEST(SafetensorsFileTest, ReadsOnlyTheRangesBytes) {
  const TwoTensors f = WriteTwoTensors("stf_only_range");
  auto file = SafetensorsFile::Open(f.path);
  ASSERT_TRUE(file.ok()) << file.status();
  const SafetensorsTensorInfo x = *file->info("x");
  const SafetensorsTensorInfo b = *file->info("b");
  // Corrupt every byte of x outside elements [10, 60), and b's element 7.
  std::string raw = Slurp(f.path);
  for (int64_t i = 0; i < x.bytes; ++i) {
    if (i < 10 * 4 || i >= 60 * 4) raw[x.offset + i] = '\xff';
  }
  raw[b.offset + 7] = 5;
  Spit(f.path, raw);

  auto part = file->Read("x", 10, 50);
  ASSERT_TRUE(part.ok()) << part.status();
  EXPECT_TRUE(torch::equal(*part, f.x.slice(0, 10, 60)));
  auto whole = file->ReadAll("x");
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_NE(Bytes(*whole), Bytes(f.x));  // the corruption is there to be read
  EXPECT_TRUE(torch::equal(whole->slice(0, 10, 60), f.x.slice(0, 10, 60)));

  // BOOL bytes are checked in the range read, as LoadSafetensors checks them.
  auto bools = file->Read("b", 0, 7);
  ASSERT_TRUE(bools.ok()) << bools.status();
  EXPECT_TRUE(torch::equal(*bools, f.b.slice(0, 0, 7)));
  bools = file->Read("b", 8, 2);
  ASSERT_TRUE(bools.ok()) << bools.status();
  bools = file->Read("b", 5, 3);
  ASSERT_FALSE(bools.ok());
  EXPECT_EQ(bools.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(bools.status().message(),
            f.path + ": tensor 'b' (BOOL) holds the byte 5 at element 7; expected 0 or 1");
  auto loaded = LoadSafetensors(f.path);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status(), file->ReadAll("b").status());
}

TEST(SafetensorsFileTest, RefusesRangesOutsideTheTensorAndUnknownNames) {
  const TwoTensors f = WriteTwoTensors("stf_out_of_range");
  auto file = SafetensorsFile::Open(f.path);
  ASSERT_TRUE(file.ok()) << file.status();
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  for (const auto& [offset, count] : std::vector<std::pair<int64_t, int64_t>>{
           {-1, 1}, {0, -1}, {0, 101}, {100, 1}, {101, 0}, {99, 2}, {1, kMax}, {kMax, kMax}}) {
    auto part = file->Read("x", offset, count);
    ASSERT_FALSE(part.ok()) << offset << " " << count;
    EXPECT_EQ(part.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(part.status().message(),
              absl::StrCat("formats::SafetensorsFile::Read: ", f.path, ": tensor 'x': elements [",
                           offset, ", ", offset, " + ", count,
                           "): expected a range within [0, 100) (its numel) with a non-negative "
                           "offset and count"));
  }
  auto missing = file->Read("y", 0, 1);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(f.path + ": no tensor 'y'"), std::string::npos)
      << missing.status();
  EXPECT_EQ(file->info("y").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(file->ReadAll("y").status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(file->contains("y"));
}

TEST(SafetensorsFileTest, TruncatedFileIsDataLossAtOpen) {
  const TwoTensors f = WriteTwoTensors("stf_truncated");
  const std::string raw = Slurp(f.path);
  for (const size_t cut : {size_t{1}, size_t{10}, size_t{11}, size_t{200}}) {
    Spit(f.path, raw.substr(0, raw.size() - cut));
    auto file = SafetensorsFile::Open(f.path);
    ASSERT_FALSE(file.ok()) << cut;
    EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss);
    const std::string message(file.status().message());
    EXPECT_EQ(message.rfind(f.path + ": tensor '", 0), 0u) << message;
    EXPECT_NE(message.find("run past the end of the data"), std::string::npos) << message;
    // The same status as LoadSafetensors: one implementation.
    EXPECT_EQ(file.status(), LoadSafetensors(f.path).status());
  }
  // Bytes after the last tensor: the header claims less than the file holds.
  Spit(f.path, raw + "zz");
  auto file = SafetensorsFile::Open(f.path);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(file.status().message().find("2 bytes after the last tensor"), std::string::npos)
      << file.status();
}

// A file of an 8-byte length, `header`, then `data`.
std::string File(const std::string& header, const std::string& data = "") {
  std::string bytes(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(bytes.data(), &n, 8);
  return bytes + header + data;
}

// Open refuses every malformed file LoadSafetensors refuses, with its status.
TEST(SafetensorsFileTest, OpenRefusesWhatLoadSafetensorsRefuses) {
  const std::string path = TempDir("stf_bad") + "/bad.safetensors";
  const std::vector<std::string> files = {
      "",
      "abc",
      File("{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", std::string(8, 0)),
      File("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", std::string(16, 0)),
      File("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
           "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
           std::string(12, 0)),
      File("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
           "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
           std::string(8, 0)),
      File("{\"a\":{\"dtype\":\"F4\",\"shape\":[2],\"data_offsets\":[0,1]}}", std::string(1, 0)),
      File("{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", std::string(8, 0)),
      File("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}",
           std::string(8, 0)),
      File("{\"__metadata__\":{\"k\":1}}"),
      File("[]"),
      File("{\"a\":{\"dtype\":\"F32\",\"shape\":[[2]],\"data_offsets\":[0,8]}}", std::string(8, 0)),
      File("{\"a\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],"
           "\"data_offsets\":[0,8]}}",
           std::string(8, 0)),
  };
  for (const std::string& bytes : files) {
    Spit(path, bytes);
    auto file = SafetensorsFile::Open(path);
    const absl::Status loaded = LoadSafetensors(path).status();
    ASSERT_FALSE(loaded.ok()) << bytes;
    EXPECT_EQ(file.status(), loaded) << bytes;
    EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss) << bytes;
  }
  EXPECT_EQ(SafetensorsFile::Open(path + ".missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(SafetensorsFile::Open(TempDir("stf_dir")).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsFileTest, MovesAndClosesItsFile) {
  const TwoTensors f = WriteTwoTensors("stf_moves");
  const size_t before = OpenFds();
  {
    auto opened = SafetensorsFile::Open(f.path);
    ASSERT_TRUE(opened.ok()) << opened.status();
    EXPECT_EQ(OpenFds(), before + 1);
    SafetensorsFile moved = *std::move(opened);
    EXPECT_EQ(OpenFds(), before + 1);
    auto other = SafetensorsFile::Open(f.path);
    ASSERT_TRUE(other.ok());
    EXPECT_EQ(OpenFds(), before + 2);
    *other = std::move(moved);  // closes other's file
    EXPECT_EQ(OpenFds(), before + 1);
    auto x = other->ReadAll("x");
    ASSERT_TRUE(x.ok()) << x.status();
    EXPECT_TRUE(torch::equal(*x, f.x));
    EXPECT_EQ(other->names(), (std::vector<std::string>{"x", "b"}));
    EXPECT_EQ(other->metadata().at("format"), "pt");
  }
  EXPECT_EQ(OpenFds(), before);
}

}  // namespace
}  // namespace formats
