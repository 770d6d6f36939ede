// Replays the committed fuzz corpus and regressions of the file formats'
// fuzzers through the fuzz harness (so its oracles run in every test run,
// not only when fuzzing), checks that
// the seeds Python's torch.save wrote load as torch.load reads them, and that
// archives LibTorch's zip reader would throw on after opening them (and leak)
// are refused first, naming what is wrong.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/types.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "formats/fuzz/corpus.h"
#include "formats/fuzz/harness.h"
#include "formats/torch_save/torch_save.h"

namespace formats {
namespace fuzz {
namespace {

namespace fs = std::filesystem;

fs::path FuzzDirectory() { return formats::fuzz::FuzzDirectory("formats/fuzz"); }

TEST(CorpusReplayTest, TorchFileCorpusAndRegressionsKeepTheOracles) {
  ReplayCorpus(FuzzDirectory(), "torch_file", 10, RunTorchFileInput);
}

// As safetensors_fuzzer.cc runs each input: as a safetensors file and as an
// index.
TEST(CorpusReplayTest, SafetensorsCorpusAndRegressionsKeepTheOracles) {
  ReplayCorpus(FuzzDirectory(), "safetensors", 17, [](const uint8_t* data, size_t size) {
    RunSafetensorsInput(data, size);
    RunHfIndexInput(data, size).IgnoreError();
  });
}

// The hand-written index seeds (corpus/safetensors/hf_index_*.json) open or
// fail as they are meant to, so that the oracle's accepting path runs.
TEST(CorpusReplayTest, IndexSeedsOpenOrFailAsMeant) {
  const std::map<std::string, absl::StatusCode> expected = {
      {"good", absl::StatusCode::kOk},
      {"one_file", absl::StatusCode::kOk},
      {"metadata_extra", absl::StatusCode::kOk},
      {"total_size_wrong", absl::StatusCode::kDataLoss},
      {"outside", absl::StatusCode::kInvalidArgument},
      {"missing_file", absl::StatusCode::kNotFound},
      {"not_in_index", absl::StatusCode::kDataLoss},
      {"wrong_file", absl::StatusCode::kDataLoss},
  };
  for (const auto& [name, code] : expected) {
    const std::string bytes =
        ReadAll(FuzzDirectory() / "corpus" / "safetensors" / ("hf_index_" + name + ".json"));
    ASSERT_FALSE(bytes.empty()) << name;
    const absl::Status status =
        RunHfIndexInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    EXPECT_EQ(status.code(), code) << name << ": " << status;
  }
}

double ValueSum(const torch::Tensor& t) {
  torch::Tensor values = t.is_complex() ? torch::view_as_real(t) : t;
  return values.to(torch::kDouble).sum().item<double>();
}

void CollectTensors(const c10::IValue& v, std::vector<torch::Tensor>& out) {
  if (v.isTensor()) {
    out.push_back(v.toTensor());
  } else if (v.isGenericDict()) {
    for (const auto& entry : v.toGenericDict()) CollectTensors(entry.value(), out);
  } else if (v.isList()) {
    for (const c10::IValue& item : v.toListRef()) CollectTensors(item, out);
  } else if (v.isTuple()) {
    for (const c10::IValue& item : v.toTupleRef().elements()) CollectTensors(item, out);
  }
}

void ExpectClose(double expected, double got, const std::string& what) {
  EXPECT_NEAR(got, expected, 1e-9 * std::max(1.0, std::abs(expected))) << what;
}

// corpus/python_seeds.txt, written by tools/fuzz/make_seed_corpus.py from
// the objects it saved: each tensor's dtype, shape and element sum.
TEST(CorpusReplayTest, PythonSeedsLoadAsTorchLoadReadsThem) {
  const fs::path torch_files = FuzzDirectory() / "corpus" / "torch_file";
  std::istringstream lines(ReadAll(FuzzDirectory() / "corpus" / "python_seeds.txt"));
  std::map<std::string, std::vector<std::string>> keys_of;  // tensor dicts, in order
  std::string line;
  int checked = 0;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') continue;
    const std::vector<std::string> f = absl::StrSplit(line, ' ');
    ASSERT_GE(f.size(), 4u) << line;
    const std::string path = (torch_files / f[0]).string();
    SCOPED_TRACE(line);
    if (f[1] == "tensor") {
      ASSERT_EQ(f.size(), 6u);
      auto loaded = LoadTensorDict(path);
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      const torch::Tensor* t = loaded->tensors.find(f[2]);
      ASSERT_NE(t, nullptr) << "missing key " << f[2];
      EXPECT_EQ(c10::toString(t->scalar_type()), f[3]);
      std::vector<std::string> dims;
      for (int64_t d : t->sizes()) dims.push_back(std::to_string(d));
      EXPECT_EQ(dims.empty() ? "-" : absl::StrJoin(dims, ","), f[4]);
      ExpectClose(std::stod(f[5]), ValueSum(*t), "sum of " + f[2]);
      keys_of[f[0]].push_back(f[2]);
    } else {
      ASSERT_EQ(f[1], "value");
      auto loaded = LoadIValue(path);
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      std::vector<torch::Tensor> tensors;
      CollectTensors(*loaded, tensors);
      ASSERT_EQ(std::to_string(tensors.size()), f[2]);
      double sum = 0;
      for (const torch::Tensor& t : tensors) sum += ValueSum(t);
      ExpectClose(std::stod(f[3]), sum, "sum of all tensors");
    }
    ++checked;
  }
  EXPECT_GE(checked, 40);
  for (const auto& file : keys_of) {  // same keys, same order as Python's dict
    auto loaded = LoadTensorDict((torch_files / file.first).string());
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->tensors.keys(), file.second) << file.first;
  }
  // A state_dict() keeps its _metadata.
  auto mlp = LoadTensorDict((torch_files / "py_state_dict_mlp.pt").string());
  ASSERT_TRUE(mlp.ok()) << mlp.status();
  EXPECT_TRUE(mlp->metadata.isGenericDict());
}

// --- Archives the zip reader would throw on after opening them. ----------

uint32_t ZipCrc32(const std::string& data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char c : data) {
    crc ^= c;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

void Put16(std::string& out, uint32_t v) {
  out.push_back(static_cast<char>(v & 0xFF));
  out.push_back(static_cast<char>((v >> 8) & 0xFF));
}
void Put32(std::string& out, uint32_t v) {
  Put16(out, v & 0xFFFF);
  Put16(out, v >> 16);
}

struct Record {
  std::string name;
  std::string data;
  bool corrupt_crc = false;
  uint32_t external_attributes = 0;  // 0x10: DOS directory
};

// A minimal zip of stored records (what PyTorch writes, minus alignment).
std::string Zip(const std::vector<Record>& records) {
  std::string out, directory;
  for (const Record& r : records) {
    const uint32_t crc = ZipCrc32(r.data) ^ (r.corrupt_crc ? 1u : 0u);
    const uint32_t offset = static_cast<uint32_t>(out.size());
    Put32(out, 0x04034b50);
    Put16(out, 20);
    Put16(out, 0);
    Put16(out, 0);
    Put16(out, 0);
    Put16(out, 0);
    Put32(out, crc);
    Put32(out, r.data.size());
    Put32(out, r.data.size());
    Put16(out, r.name.size());
    Put16(out, 0);
    out += r.name + r.data;
    Put32(directory, 0x02014b50);
    Put16(directory, 20);
    Put16(directory, 20);
    Put16(directory, 0);
    Put16(directory, 0);
    Put16(directory, 0);
    Put16(directory, 0);
    Put32(directory, crc);
    Put32(directory, r.data.size());
    Put32(directory, r.data.size());
    Put16(directory, r.name.size());
    Put16(directory, 0);
    Put16(directory, 0);
    Put16(directory, 0);
    Put16(directory, 0);
    Put32(directory, r.external_attributes);
    Put32(directory, offset);
    directory += r.name;
  }
  const uint32_t directory_offset = static_cast<uint32_t>(out.size());
  out += directory;
  Put32(out, 0x06054b50);
  Put16(out, 0);
  Put16(out, 0);
  Put16(out, records.size());
  Put16(out, records.size());
  Put32(out, directory.size());
  Put32(out, directory_offset);
  Put16(out, 0);
  return out;
}

std::string LoadError(const std::string& name, const std::string& bytes) {
  const std::string path =
      std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp") + "/" + name;
  std::ofstream(path, std::ios::binary) << bytes;
  auto loaded = LoadIValue(path);
  if (loaded.ok()) return "loaded";
  std::string message(loaded.status().message());
  EXPECT_EQ(message.rfind(path + ": not a readable PyTorch archive", 0), 0u) << message;
  return message;
}

bool Has(const std::string& message, const std::string& part) {
  return message.find(part) != std::string::npos;
}

TEST(CorpusReplayTest, ArchivesTheReaderWouldLeakOnAreRefusedByName) {
  const Record pickle{"archive/data.pkl", std::string("\x80\x02K\x07.", 5)};  // the int 7
  // Sanity: the minimal writer's archive is read.
  EXPECT_EQ(LoadError("ok.pt", Zip({pickle, {"archive/version", "3\n"}})), "loaded");
  auto value = LoadIValue(std::string(std::getenv("TEST_TMPDIR")) + "/ok.pt");
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(value->toInt(), 7);
  // A deflated-free but otherwise odd, valid variant: ".data/version" wins.
  EXPECT_EQ(LoadError("data_version.pt",
                      Zip({pickle, {"archive/.data/version", "3"}, {"archive/version", "x"}})),
            "loaded");

  std::string m = LoadError("empty.pt", Zip({}));
  EXPECT_TRUE(Has(m, "holds no records")) << m;
  m = LoadError("no_folder.pt", Zip({{"data.pkl", pickle.data}, {"archive/version", "3\n"}}));
  EXPECT_TRUE(Has(m, "first record 'data.pkl' is not inside a folder")) << m;
  m = LoadError("no_version.pt", Zip({pickle, {"archive/versino", "3\n"}}));
  EXPECT_TRUE(Has(m, "no version record")) << m;
  m = LoadError("bad_crc.pt", Zip({pickle, {"archive/version", "3\n", true}}));
  EXPECT_TRUE(Has(m, "fails its CRC-32 check")) << m;
  m = LoadError("not_a_number.pt", Zip({pickle, {"archive/version", "three"}}));
  EXPECT_TRUE(Has(m, "holds 'three', not a file format version")) << m;
  m = LoadError("too_new.pt", Zip({pickle, {"archive/VERSION", "99\n"}}));
  EXPECT_TRUE(Has(m, "version 99 is outside the 1..10")) << m;
  m = LoadError("zero.pt", Zip({pickle, {"archive/version", ""}}));
  EXPECT_TRUE(Has(m, "not a file format version")) << m;
  m = LoadError("version_dir.pt", Zip({pickle, {"archive/version", "", false, 0x10}}));
  EXPECT_TRUE(Has(m, "version record 'archive/version' is marked as a directory")) << m;
  m = LoadError("version_dir_with_bytes.pt",
                Zip({pickle, {"archive/version", "3\n", false, 0x10}}));
  EXPECT_TRUE(Has(m, "('archive/version') holds 2 bytes but is marked as a directory")) << m;
  m = LoadError("pickle_dir.pt",
                Zip({{"archive/data.pkl", pickle.data, false, 0x10}, {"archive/version", "3\n"}}));
  EXPECT_TRUE(Has(m, "holds 5 bytes but is marked as a directory")) << m;
  m = LoadError("not_zip.pt", "PYTORCH1 and then something else entirely");
  EXPECT_TRUE(Has(m, "no end of central directory record")) << m;
  std::string truncated = Zip({pickle, {"archive/version", "3\n"}});
  truncated.resize(truncated.size() - 30);
  m = LoadError("truncated.pt", truncated);
  EXPECT_TRUE(Has(m, "not a readable PyTorch archive")) << m;
}

}  // namespace
}  // namespace fuzz
}  // namespace formats
