// TorchZipWriter against the independent reference, LibTorch's own writer:
// the files must be the bytes torch::jit::pickle_save (PyTorchStreamWriter,
// miniz) produces for the same value, so everything that reads PyTorch's
// files (torch.load, Python's zipfile, our readers) reads ours.
#include "formats/torch_save/internal/torch_zip_writer.h"

#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>

#include "formats/io/crc32c.h"
#include "formats/io/file_io.h"
#include "formats/testing/file_bytes.h"
#include "formats/torch_save/torch_save.h"

namespace formats {
namespace {

using testing::Slurp;

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

// "" when equal, else where they first differ, with the bytes around it
// (the files are too large for gtest to print usefully).
std::string FirstDifference(const std::string& ours, const std::string& theirs) {
  size_t i = 0;
  while (i < ours.size() && i < theirs.size() && ours[i] == theirs[i]) ++i;
  if (i == ours.size() && i == theirs.size()) return "";
  auto around = [&](const std::string& s) {
    std::string hex;
    const size_t from = i < 16 ? 0 : i - 16;
    for (size_t k = from; k < std::min(s.size(), i + 16); ++k) {
      static const char* digits = "0123456789abcdef";
      hex += std::string(k == i ? "[" : "") + digits[(s[k] >> 4) & 0xF] + digits[s[k] & 0xF] +
             (k == i ? "]" : "") + " ";
    }
    return hex;
  };
  return "sizes " + std::to_string(ours.size()) + " vs " + std::to_string(theirs.size()) +
         ", first difference at byte " + std::to_string(i) + "\n  ours:   " + around(ours) +
         "\n  theirs: " + around(theirs);
}

// What LibTorch's own writer (PyTorchStreamWriter, as torch::pickle_save
// drives it) makes of `value` pickled as Python's torch.save pickles it:
// plain dicts, no torch.jit type tags (pickle_save's tags are refused by
// Python 2.x's default torch.load).
std::string PickleSaveBytes(const c10::IValue& value) {
  std::string pickle;
  torch::jit::Pickler pickler([&](const char* data, size_t size) { pickle.append(data, size); },
                              nullptr, nullptr, nullptr, nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  std::string bytes;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) {
    bytes.append(static_cast<const char*>(data), size);
    return size;
  });
  const std::vector<at::Tensor>& records = pickler.tensorData();
  for (size_t i = 0; i < records.size(); ++i) {
    const torch::jit::WriteableTensorData data = torch::jit::getWriteableTensorData(records[i]);
    writer.writeRecord("data/" + std::to_string(i), data.data(), data.sizeInBytes());
  }
  writer.writeRecord("data.pkl", pickle.data(), pickle.size());
  writer.writeEndOfFile();
  return bytes;
}

// `bytes` with the 40 digits of its .data/serialization_id record (and their
// CRC-32, in the data descriptor and the central directory) zeroed.
// LibTorch 2.x folds the records' names and CRC-32s into that id; ours is
// made the same way in spirit (TorchZipWriter::Finish) but its digits are
// not LibTorch's, whose exact folding is not reproduced. Nothing reads the
// value but to compare the ids of files of one checkpoint.
std::string WithoutSerializationId(std::string bytes) {
  const std::string name = "archive/.data/serialization_id";
  const size_t at = bytes.find(name);  // the local header (before the directory)
  if (at == std::string::npos || at < 30) return bytes;
  const size_t header = at - 30;
  const auto u16 = [&](size_t i) {
    return static_cast<size_t>(static_cast<unsigned char>(bytes[i])) |
           static_cast<size_t>(static_cast<unsigned char>(bytes[i + 1])) << 8;
  };
  const size_t data = header + 30 + u16(header + 26) + u16(header + 28);
  if (data + 48 > bytes.size()) return bytes;
  bytes.replace(data, 40, 40, '0');
  bytes.replace(data + 44, 4, 4, '\0');  // its CRC-32 in the data descriptor
  const size_t central = bytes.rfind(name);
  if (central != at && central >= 46) bytes.replace(central - 46 + 16, 4, 4, '\0');
  return bytes;
}

// Tensors of several dtypes and sizes: empty, scalar, under and over the
// writer's 64 KiB direct-write threshold, and over its 256 KiB CRC pieces
// (not a multiple of them).
TensorDict MixedTensors() {
  torch::manual_seed(3);
  TensorDict tensors;
  tensors.insert("weight", torch::randn({3, 4}));
  tensors.insert("empty", torch::empty({0, 5}, torch::kInt64));
  tensors.insert("scalar", torch::tensor(2.5, torch::kFloat64));
  tensors.insert("flags", torch::rand({17}) > 0.5);
  tensors.insert("bytes", torch::randint(0, 256, {70001}, torch::kUInt8));
  tensors.insert("big", torch::randn({300007}));
  tensors.insert("half", torch::randn({999}).to(torch::kBFloat16));
  return tensors;
}

TEST(TorchZipWriterTest, WriteTensorDictWritesWhatPickleSaveWrites) {
  const auto tensors = MixedTensors();
  const std::string path = TempDir() + "/mixed.pt";
  auto written = WriteTensorDict(tensors, path);
  ASSERT_TRUE(written.ok()) << written.status();
  const std::string bytes = Slurp(path);
  // Clones: the pickler memoizes a tensor only when something else also
  // holds it (use_count > 1), which would change data.pkl, not the format.
  c10::Dict<std::string, at::Tensor> same;
  for (const auto& item : tensors) same.insert(item.key(), item.value().clone());
  EXPECT_EQ(FirstDifference(WithoutSerializationId(bytes),
                            WithoutSerializationId(PickleSaveBytes(c10::IValue(same)))),
            "");

  // The checksums it reports are those of the file and of each tensor's data.
  EXPECT_EQ(written->bytes, bytes.size());
  EXPECT_EQ(written->crc32c, Crc32c(bytes.data(), bytes.size()));
  ASSERT_EQ(written->tensor_crc32c.size(), tensors.size());
  size_t i = 0;
  for (const auto& item : tensors) {
    const at::Tensor& t = item.value();
    EXPECT_EQ(written->tensor_crc32c[i++], Crc32c(t.data_ptr(), t.nbytes())) << item.key();
  }
}

TEST(TorchZipWriterTest, SaveIValueWritesWhatPickleSaveWrites) {
  // Nested containers, a view sharing its storage with another entry (one
  // record for both, the whole storage), a non-contiguous tensor.
  const at::Tensor base = torch::arange(24, torch::kFloat32).reshape({4, 6});
  c10::impl::GenericList list(c10::AnyType::get());
  list.push_back(base);
  list.push_back(base.slice(1, 2, 5));
  list.push_back(base.t());
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("tensors", list);
  dict.insert("step", int64_t{7});
  dict.insert("lr", 0.25);
  dict.insert("name", std::string("adamw"));
  dict.insert("big", torch::randn({100003}));
  const c10::IValue value(dict);

  const std::string path = TempDir() + "/nested.pt";
  ASSERT_TRUE(SaveIValue(value, path).ok());
  EXPECT_EQ(FirstDifference(WithoutSerializationId(Slurp(path)),
                            WithoutSerializationId(PickleSaveBytes(value))),
            "");
  auto loaded = LoadIValue(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const auto loaded_list = loaded->toGenericDict().at("tensors").toList();
  EXPECT_TRUE(torch::equal(loaded_list.get(1).toTensor(), base.slice(1, 2, 5)));
}

TEST(TorchZipWriterTest, RecordAfterFinishIsRefused) {
  const std::string path = TempDir() + "/finished.zip";
  auto file = AtomicFileWriter::Open(path);
  ASSERT_TRUE(file.ok());
  internal::TorchZipWriter zip(**file);
  ASSERT_TRUE(zip.WriteRecord("data.pkl", "x", 1).ok());
  ASSERT_TRUE(zip.Finish().ok());
  const auto late = zip.WriteRecord("data/0", "y", 1);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(late.status().message().find("'data/0'"), std::string::npos) << late.status();
  EXPECT_NE(late.status().message().find("finished"), std::string::npos) << late.status();
}

TEST(TorchZipWriterTest, OverlongRecordNameIsRefused) {
  const std::string path = TempDir() + "/long_name.zip";
  auto file = AtomicFileWriter::Open(path);
  ASSERT_TRUE(file.ok());
  internal::TorchZipWriter zip(**file);
  const auto written = zip.WriteRecord(std::string(70000, 'n'), "x", 1);
  EXPECT_EQ(written.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(written.status().message().find("65535"), std::string::npos) << written.status();
}

// ZIP64 records (a record of 4 GiB + 5 bytes, and records whose headers start
// past 4 GiB) against PyTorchStreamWriter writing the same records. Needs
// ~4 GiB of memory and ~9 GB of disk, so it runs only when asked:
//   bazel test //formats:torch_zip_writer_test --test_arg=--gtest_also_run_disabled_tests
TEST(TorchZipWriterTest, DISABLED_Zip64RecordsMatchPyTorchStreamWriter) {
  const size_t big = (size_t{1} << 32) + 5;
  std::string data(big, '\0');
  for (size_t i = 0; i < big; i += 4093) data[i] = static_cast<char>(i * 31);
  const std::string small = "small record after 4 GiB";

  const std::string ours_path = TempDir() + "/zip64_ours.zip";
  {
    auto file = AtomicFileWriter::Open(ours_path);
    ASSERT_TRUE(file.ok());
    internal::TorchZipWriter zip(**file);
    ASSERT_TRUE(zip.WriteRecord("data/0", data.data(), data.size()).ok());
    ASSERT_TRUE(zip.WriteRecord("data/1", small.data(), small.size()).ok());
    ASSERT_TRUE(zip.WriteRecord("data.pkl", small.data(), small.size()).ok());
    ASSERT_TRUE(zip.Finish().ok());
    ASSERT_TRUE((*file)->Commit().ok());
  }
  const std::string theirs_path = TempDir() + "/zip64_theirs.zip";
  {
    std::ofstream out(theirs_path, std::ios::binary | std::ios::trunc);
    caffe2::serialize::PyTorchStreamWriter zip([&](const void* p, size_t n) {
      out.write(static_cast<const char*>(p), static_cast<std::streamsize>(n));
      return n;
    });
    zip.writeRecord("data/0", data.data(), data.size());
    zip.writeRecord("data/1", small.data(), small.size());
    zip.writeRecord("data.pkl", small.data(), small.size());
    zip.writeEndOfFile();
  }
  std::string().swap(data);
  std::ifstream ours(ours_path, std::ios::binary);
  std::ifstream theirs(theirs_path, std::ios::binary);
  std::string a(size_t{1} << 24, '\0');
  std::string b(size_t{1} << 24, '\0');
  uint64_t offset = 0;
  while (true) {
    ours.read(&a[0], static_cast<std::streamsize>(a.size()));
    theirs.read(&b[0], static_cast<std::streamsize>(b.size()));
    ASSERT_EQ(ours.gcount(), theirs.gcount()) << "files differ in size after " << offset;
    const size_t n = static_cast<size_t>(ours.gcount());
    if (n == 0) break;
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(a[i], b[i]) << "first difference at byte " << offset + i;
    }
    offset += n;
  }
  EXPECT_GT(offset, big);
}

}  // namespace
}  // namespace formats
