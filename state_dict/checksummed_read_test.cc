// formats::ReadChecksummedTensorDict, the one-pass reader under every
// checkpoint load and verify (issue #16): it must read what LoadTensorDict
// reads, accept and reject the same files, and checksum exactly the file's
// bytes (ChecksumFile's values), in both of its modes.
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/types.h>

#include "absl/strings/str_cat.h"
#include "formats/io/crc32c.h"
#include "formats/io/file_io.h"
#include "formats/testing/file_bytes.h"
#include "formats/testing/python_interop.h"
#include "formats/torch_save/tensor_dict_io.h"
#include "state_dict/checkpoint.h"
#include "state_dict/manifest.h"
#include "state_dict/tensor_dict.h"

namespace state_dict {
namespace {

using formats::testing::Slurp;
using formats::testing::Spit;

using formats::TensorData;
using formats::testing::TempDir;

bool BitwiseEqual(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const torch::Tensor ca = a.contiguous(), cb = b.contiguous();
  return ca.nbytes() == cb.nbytes() &&
         (ca.nbytes() == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0);
}

uint32_t CrcOf(const torch::Tensor& t) {
  const torch::Tensor c = t.contiguous();
  return c.nbytes() == 0 ? 0u : formats::Crc32c(c.data_ptr(), c.nbytes());
}

bool HasData(const torch::Tensor& t) { return t.storage().data() != nullptr; }

// Several dtypes, a 0-dim and an empty tensor, and one of 3 MiB (records
// are read in 1 MiB pieces).
TensorDict Sample() {
  TensorDict sd;
  sd.insert("weight", torch::arange(12, torch::kFloat).view({3, 4}) / 7);
  sd.insert("big", torch::randn({3 << 18}, torch::TensorOptions().dtype(torch::kFloat)));
  sd.insert("steps", torch::tensor({3, -4, 5}, torch::kLong));
  sd.insert("scalar", torch::tensor(2.5, torch::kDouble));
  sd.insert("empty", torch::zeros({0, 5}, torch::kInt));
  sd.insert("half", torch::linspace(-1, 1, 7).to(torch::kHalf));
  sd.insert("mask", torch::tensor({true, false, true}));
  return sd;
}

// Both modes of ReadChecksummedTensorDict against LoadTensorDict and
// ChecksumFile on an intact file.
void ExpectAgreesWithLoadTensorDict(const std::string& path) {
  auto plain = LoadTensorDict(path);
  ASSERT_TRUE(plain.ok()) << plain.status();
  auto sum = formats::ChecksumFile(path);
  ASSERT_TRUE(sum.ok()) << sum.status();
  for (TensorData mode : {TensorData::kRead, TensorData::kChecksumOnly}) {
    SCOPED_TRACE(mode == TensorData::kRead ? "kRead" : "kChecksumOnly");
    auto got = formats::ReadChecksummedTensorDict(path, mode);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->bytes, sum->bytes);
    EXPECT_EQ(got->crc32c, sum->crc32c);
    ASSERT_EQ(got->loaded.tensors.keys(), plain->tensors.keys());
    for (const auto& item : plain->tensors) {
      const torch::Tensor& t = got->loaded.tensors[item.key()];
      EXPECT_EQ(t.scalar_type(), item.value().scalar_type()) << item.key();
      EXPECT_EQ(t.sizes(), item.value().sizes()) << item.key();
      EXPECT_EQ(t.strides(), item.value().strides()) << item.key();
      EXPECT_EQ(t.storage_offset(), item.value().storage_offset()) << item.key();
      const std::optional<uint32_t> crc = formats::TensorCrc32c(got->record_crc32c, t);
      ASSERT_TRUE(crc.has_value()) << item.key();
      EXPECT_EQ(*crc, CrcOf(item.value())) << item.key();
      if (mode == TensorData::kRead) {
        EXPECT_TRUE(BitwiseEqual(t, item.value())) << item.key();
      }
    }
  }
}

TEST(ChecksummedReadTest, SavedFileReadsAsLoadTensorDictReadsIt) {
  const std::string path = TempDir("checksummed_saved") + "/sd.pt";
  ASSERT_TRUE(SaveTensorDict(Sample(), path).ok());
  ExpectAgreesWithLoadTensorDict(path);
}

// A byte changed in a late piece of a large record changes that record's
// CRC and the file's as ChecksumFile sees them.
TEST(ChecksummedReadTest, DamageInALatePieceOfALargeRecordIsSeen) {
  const std::string path = TempDir("checksummed_late_piece") + "/sd.pt";
  const TensorDict sample = Sample();
  ASSERT_TRUE(SaveTensorDict(sample, path).ok());
  const std::string intact = Slurp(path);
  const torch::Tensor big = sample["big"];
  const std::string big_bytes(static_cast<const char*>(big.data_ptr()), big.nbytes());
  const size_t record = intact.find(big_bytes);
  ASSERT_NE(record, std::string::npos);
  const size_t late = record + big.nbytes() - 1000;  // in the record's last 256 KiB

  std::string damaged = intact;
  damaged[late] = static_cast<char>(damaged[late] ^ 0x10);
  Spit(path, damaged);
  auto sum = formats::ChecksumFile(path);
  ASSERT_TRUE(sum.ok()) << sum.status();
  for (TensorData mode : {TensorData::kRead, TensorData::kChecksumOnly}) {
    auto got = formats::ReadChecksummedTensorDict(path, mode);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->crc32c, sum->crc32c);
    const std::optional<uint32_t> crc =
        formats::TensorCrc32c(got->record_crc32c, got->loaded.tensors["big"]);
    ASSERT_TRUE(crc.has_value());
    EXPECT_NE(*crc, CrcOf(big));
  }
}

// Verify's mode keeps no tensor's data (bounded memory), except the ones it
// is asked to keep; their data is the file's.
TEST(ChecksummedReadTest, ChecksumOnlyKeepsNoDataButWhatItIsAskedFor) {
  const std::string path = TempDir("checksummed_keep") + "/sd.pt";
  const TensorDict sd = Sample();
  ASSERT_TRUE(SaveTensorDict(sd, path).ok());
  auto got = formats::ReadChecksummedTensorDict(path, TensorData::kChecksumOnly, {"weight"});
  ASSERT_TRUE(got.ok()) << got.status();
  for (const auto& item : got->loaded.tensors) {
    if (item.key() == "weight") {
      EXPECT_TRUE(BitwiseEqual(item.value(), sd["weight"]));
    } else {
      EXPECT_FALSE(HasData(item.value())) << item.key() << " was kept";
    }
  }
}

// Records Python's zipfile re-compressed (deflated) are inflated by
// LibTorch's reader; the others, now unaligned, are read directly.
TEST(ChecksummedReadTest, DeflatedRecordsReadAsLoadTensorDictReadsThem) {
  const std::string dir = TempDir("checksummed_deflated");
  ASSERT_TRUE(SaveTensorDict(Sample(), dir + "/stored.pt").ok());
  std::string output;
  const int rc = formats::testing::RunPython(
      "import sys, zipfile\n"
      "with zipfile.ZipFile(sys.argv[1]) as src, zipfile.ZipFile(sys.argv[2], 'w') as dst:\n"
      "    for i, info in enumerate(src.infolist()):\n"
      "        kind = zipfile.ZIP_DEFLATED if i % 2 == 0 else zipfile.ZIP_STORED\n"
      "        dst.writestr(info.filename, src.read(info.filename), compress_type=kind)\n",
      absl::StrCat(dir, "/stored.pt ", dir, "/mixed.pt"), &output);
  if (rc != 0) GTEST_SKIP() << "python3 with zipfile unavailable: " << output;
  ExpectAgreesWithLoadTensorDict(dir + "/mixed.pt");
}

// torch::pickle_save writes a storage once for all its views: a tensor that
// is part of a record needs its data for its checksum, so even verify's mode
// keeps that record.
TEST(ChecksummedReadTest, ViewsOfOneStorageKeepTheirData) {
  const std::string path = TempDir("checksummed_views") + "/views.pt";
  const torch::Tensor whole = torch::arange(100, torch::kFloat);
  c10::Dict<std::string, torch::Tensor> dict;
  dict.insert("whole", whole);
  dict.insert("head", whole.narrow(0, 0, 10));
  dict.insert("strided", whole.view({10, 10}).t());
  ASSERT_TRUE(SaveIValue(c10::IValue(dict), path).ok());
  ExpectAgreesWithLoadTensorDict(path);
  auto got = formats::ReadChecksummedTensorDict(path, TensorData::kChecksumOnly);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(HasData(got->loaded.tensors["head"]));
}

// Every single-byte change and every truncation of a small file: the one-pass
// reader accepts exactly when LoadTensorDict does, in both modes, with the
// same values and ChecksumFile's size and checksum. Nothing crashes.
TEST(ChecksummedReadTest, DamagedFilesAcceptedExactlyWhenLoadTensorDictAcceptsThem) {
  const std::string dir = TempDir("checksummed_damaged");
  TensorDict sd;
  sd.insert("a", torch::arange(6, torch::kFloat).view({2, 3}));
  sd.insert("b", torch::tensor({7, 8}, torch::kLong));
  ASSERT_TRUE(SaveTensorDict(sd, dir + "/pristine.pt").ok());
  const std::string pristine = Slurp(dir + "/pristine.pt");
  const std::string path = dir + "/damaged.pt";
  std::mt19937 rng(16);
  int accepted = 0, rejected = 0;
  for (size_t trial = 0; trial < pristine.size() + pristine.size() / 4; ++trial) {
    std::string bytes = pristine;
    std::string what;
    if (trial < pristine.size()) {
      bytes[trial] = static_cast<char>(bytes[trial] ^ (1 + rng() % 255));
      what = absl::StrCat("byte ", trial, " changed");
    } else {
      bytes.resize(rng() % pristine.size());
      what = absl::StrCat("truncated to ", bytes.size());
    }
    SCOPED_TRACE(what);
    Spit(path, bytes);
    auto plain = LoadTensorDict(path);
    for (TensorData mode : {TensorData::kRead, TensorData::kChecksumOnly}) {
      auto got = formats::ReadChecksummedTensorDict(path, mode);
      ASSERT_EQ(got.ok(), plain.ok())
          << "one pass: " << got.status() << "\nLoadTensorDict: " << plain.status();
      if (!got.ok()) continue;
      EXPECT_EQ(got->bytes, bytes.size());
      EXPECT_EQ(got->crc32c, formats::Crc32c(bytes.data(), bytes.size()));
      ASSERT_EQ(got->loaded.tensors.keys(), plain->tensors.keys());
      for (const auto& item : plain->tensors) {
        const torch::Tensor& t = got->loaded.tensors[item.key()];
        if (mode == TensorData::kRead) {
          EXPECT_TRUE(BitwiseEqual(t, item.value())) << item.key();
        }
        const std::optional<uint32_t> crc = formats::TensorCrc32c(got->record_crc32c, t);
        ASSERT_TRUE(crc.has_value()) << item.key();
        EXPECT_EQ(*crc, CrcOf(item.value())) << item.key();
      }
    }
    (plain.ok() ? accepted : rejected)++;
  }
  std::cout << accepted << " damaged files accepted by both, " << rejected << " rejected by both\n";
  EXPECT_GT(accepted, 0);
  EXPECT_GT(rejected, 0);
}

// A rank file re-compressed by Python's zipfile, with the MANIFEST's size
// and checksum of it updated (its tensors' own checksums still hold): verify
// and every load accept it and give the saved values.
TEST(ChecksummedReadTest, CheckpointWithADeflatedRankFileVerifiesAndLoads) {
  const std::string root = TempDir("checksummed_checkpoint");
  TensorDict state = Sample();
  std::vector<ShardedStateDict> shards(2);
  for (const auto& item : state) {
    const int64_t numel = item.value().numel();
    for (int r = 0; r < 2; ++r) {
      const FlatRange range = EvenShardRange(numel, 2, r);
      std::vector<FlatRange> ranges;
      if (range.numel > 0) ranges.push_back(range);
      shards[static_cast<size_t>(r)].insert(item.key(), ShardFullTensor(item.value(), ranges));
    }
  }
  ASSERT_TRUE(SaveShardedCheckpoint(root, 1, shards).ok());
  const std::string dir = StepDirectory(root, 1);
  std::string output;
  const int rc = formats::testing::RunPython(
      "import sys, zipfile\n"
      "with zipfile.ZipFile(sys.argv[1]) as src, zipfile.ZipFile(sys.argv[2], 'w',\n"
      "        compression=zipfile.ZIP_DEFLATED) as dst:\n"
      "    for info in src.infolist():\n"
      "        dst.writestr(info.filename, src.read(info.filename))\n",
      absl::StrCat(dir, "/rank_00000.pt ", dir, "/deflated.pt"), &output);
  if (rc != 0) GTEST_SKIP() << "python3 with zipfile unavailable: " << output;
  const std::string deflated = Slurp(dir + "/deflated.pt");
  ASSERT_NE(deflated, Slurp(dir + "/rank_00000.pt"));
  Spit(dir + "/rank_00000.pt", deflated);
  ::unlink((dir + "/deflated.pt").c_str());
  auto manifest = ReadManifest(dir);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  for (ManifestFile& f : manifest->files) {
    if (f.rank != 0) continue;
    f.bytes = deflated.size();
    f.crc32c = formats::Crc32c(deflated.data(), deflated.size());
  }
  ASSERT_TRUE(formats::WriteFileAtomically(dir + "/MANIFEST", FormatManifest(*manifest)).ok());

  EXPECT_TRUE(VerifyCheckpoint(dir).ok()) << VerifyCheckpoint(dir);
  auto full = LoadFullStateDict(dir);
  ASSERT_TRUE(full.ok()) << full.status();
  for (const auto& item : state) {
    EXPECT_TRUE(BitwiseEqual((*full)[item.key()], item.value())) << item.key();
  }
  auto local = LoadLocalShard(dir, 0, 2);
  ASSERT_TRUE(local.ok()) << local.status();

  // One flipped byte in the deflated file: every reader of it refuses it.
  std::string damaged = deflated;
  damaged[damaged.size() / 3] ^= 0x40;
  Spit(dir + "/rank_00000.pt", damaged);
  const absl::Status verify = VerifyCheckpoint(dir);
  EXPECT_FALSE(verify.ok());
  EXPECT_NE(verify.message().find(dir + "/rank_00000.pt"), std::string::npos) << verify;
  EXPECT_FALSE(LoadFullStateDict(dir).ok());
  EXPECT_FALSE(LoadLocalShard(dir, 0, 2).ok());
}

}  // namespace
}  // namespace state_dict
