// HfCheckpointFiles and HfCheckpointWriter: the writer's plan (as
// huggingface_hub plans shards), its refused writes and directories, a
// previous export replaced and an abandoned one removed; every index the
// reader refuses; and Python: safetensors reading our shards,
// transformers' from_pretrained loading our export of its model, and a
// directory of Python's files read here.
#include "formats/hf/hf_checkpoint_files.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "formats/safetensors/safetensors.h"
#include "formats/testing/file_bytes.h"
#include "formats/testing/python_interop.h"

namespace formats {
namespace {

using testing::PythonTorchAvailable;
using testing::RunPython;
using testing::Slurp;
using testing::Spit;
using testing::TempDir;

constexpr char kNoPython[] =
    "the Python of the build's torch wheel cannot import torch (run tools/setup.sh "
    "--with-python, which also installs safetensors and transformers)";

std::vector<std::string> List(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return names;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

bool IsDirectory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string Hex(const torch::Tensor& t) {
  const torch::Tensor c = t.contiguous();
  return absl::BytesToHexString(absl::string_view(
      static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()) * c.element_size()));
}

torch::Tensor RandomTensor(torch::ScalarType type, std::vector<int64_t> shape) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(type));
  torch::Tensor raw = type == torch::kBool ? torch::randint(0, 2, {bytes}, torch::kUInt8)
                                           : torch::randint(0, 256, {bytes}, torch::kUInt8);
  return raw.view(type).reshape(shape);
}

std::vector<TensorSpec> SpecsOf(const std::vector<std::pair<std::string, torch::Tensor>>& ts) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : ts) specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  return specs;
}

constexpr char kConfig[] = "{\"model_type\": \"test\"}\n";

// Writes `tensors` to `dir` with the writer, committed.
void Export(const std::string& dir, const std::vector<std::pair<std::string, torch::Tensor>>& ts,
            int64_t max_shard_bytes,
            std::map<std::string, std::string> extra = {{"config.json", kConfig}}) {
  auto writer = HfCheckpointWriter::Create(dir, SpecsOf(ts), max_shard_bytes, std::move(extra));
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (const auto& [name, t] : ts) {
    absl::Status written = writer->Write(name, t);
    ASSERT_TRUE(written.ok()) << written;
  }
  absl::Status committed = writer->Commit();
  ASSERT_TRUE(committed.ok()) << committed;
}

void ExpectReadsBack(const std::string& dir,
                     const std::vector<std::pair<std::string, torch::Tensor>>& ts) {
  auto ckpt = HfCheckpointFiles::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  std::vector<std::string> names;
  for (const auto& [name, t] : ts) names.push_back(name);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(ckpt->names(), names);
  for (const auto& [name, t] : ts) {
    auto all = ckpt->ReadAll(name);
    ASSERT_TRUE(all.ok()) << all.status();
    EXPECT_EQ(all->scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(all->sizes(), t.sizes()) << name;
    EXPECT_EQ(Hex(*all), Hex(t)) << name;
  }
}

// ---- the writer's plan --------------------------------------------------------------

std::vector<std::pair<std::string, torch::Tensor>> PlanTensors() {
  torch::manual_seed(1);
  return {
      {"a", RandomTensor(torch::kFloat32, {10})},        // 40 bytes
      {"b", RandomTensor(torch::kFloat32, {2, 5})},      // 40
      {"c", RandomTensor(torch::kFloat32, {10})},        // 40: over 100 with a and b
      {"big", RandomTensor(torch::kFloat32, {30})},      // 120: over the limit, a file of its own
      {"d", RandomTensor(torch::kBFloat16, {4, 5})},     // 40
      {"e", RandomTensor(torch::kFloat16, {8})},         // 16: 96 with c and d
      {"empty", torch::empty({0, 3}, torch::kFloat32)},  // 0
  };
}

TEST(HfCheckpointWriterTest, PlansShardsAsHuggingFaceHub) {
  const std::string root = TempDir("hf_plan");
  const std::string dir = root + "/export";
  const auto ts = PlanTensors();
  auto writer = HfCheckpointWriter::Create(dir, SpecsOf(ts), 100, {{"config.json", kConfig}});
  ASSERT_TRUE(writer.ok()) << writer.status();
  const std::vector<HfShard>& shards = writer->shards();
  ASSERT_EQ(shards.size(), 3u);
  EXPECT_EQ(shards[0].file, "model-00001-of-00003.safetensors");
  EXPECT_EQ(shards[0].tensors, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(shards[0].bytes, 80);
  EXPECT_EQ(shards[1].file, "model-00002-of-00003.safetensors");
  EXPECT_EQ(shards[1].tensors, (std::vector<std::string>{"big"}));
  EXPECT_EQ(shards[1].bytes, 120);
  EXPECT_EQ(shards[2].file, "model-00003-of-00003.safetensors");
  EXPECT_EQ(shards[2].tensors, (std::vector<std::string>{"c", "d", "e", "empty"}));
  EXPECT_EQ(shards[2].bytes, 96);
  EXPECT_EQ(writer->total_bytes(), 296);
  EXPECT_EQ(writer->dir(), dir);
  // The temporary directory is beside, hidden, named for the export.
  const std::string temp = writer->temp_dir();
  EXPECT_EQ(temp.rfind(root + "/.export.tmp-" + std::to_string(getpid()) + "-", 0), 0u) << temp;
  EXPECT_EQ(List(root), (std::vector<std::string>{temp.substr(root.size() + 1)}));

  for (const auto& [name, t] : ts) {
    absl::Status written = writer->Write(name, t);
    ASSERT_TRUE(written.ok()) << written;
    EXPECT_FALSE(IsDirectory(dir));
  }
  // The finished shards are in the temporary directory; nothing under dir.
  EXPECT_EQ(List(temp), (std::vector<std::string>{"model-00001-of-00003.safetensors",
                                                  "model-00002-of-00003.safetensors",
                                                  "model-00003-of-00003.safetensors"}));
  absl::Status committed = writer->Commit();
  ASSERT_TRUE(committed.ok()) << committed;
  EXPECT_EQ(List(root), (std::vector<std::string>{"export"}));
  EXPECT_EQ(List(dir), (std::vector<std::string>{"config.json", "model-00001-of-00003.safetensors",
                                                 "model-00002-of-00003.safetensors",
                                                 "model-00003-of-00003.safetensors",
                                                 "model.safetensors.index.json"}));
  EXPECT_EQ(Slurp(dir + "/config.json"), kConfig);
  const nlohmann::json index = nlohmann::json::parse(Slurp(dir + "/model.safetensors.index.json"));
  EXPECT_EQ(index, nlohmann::json::parse(R"({
    "metadata": {"total_size": 296},
    "weight_map": {
      "a": "model-00001-of-00003.safetensors",
      "b": "model-00001-of-00003.safetensors",
      "big": "model-00002-of-00003.safetensors",
      "c": "model-00003-of-00003.safetensors",
      "d": "model-00003-of-00003.safetensors",
      "e": "model-00003-of-00003.safetensors",
      "empty": "model-00003-of-00003.safetensors"
    }})"));
  // Indented with sorted keys, as transformers writes it.
  const std::string head = "{\n  \"metadata\": {\n    \"total_size\": 296\n  },\n";
  EXPECT_EQ(Slurp(dir + "/model.safetensors.index.json").substr(0, head.size()), head);

  // Each shard: the tensors in spec order in the header with {"format":
  // "pt"}, the data largest elements first, each aligned to its element size.
  auto third = LoadSafetensors(dir + "/model-00003-of-00003.safetensors");
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->tensors.keys(), (std::vector<std::string>{"c", "d", "e", "empty"}));
  EXPECT_EQ(third->metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
  auto file = SafetensorsFile::Open(dir + "/model-00003-of-00003.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->info("c")->offset % 8, 0);
  EXPECT_EQ(file->info("d")->offset, file->info("c")->offset + 40);
  EXPECT_EQ(file->info("e")->offset, file->info("d")->offset + 40);
  ExpectReadsBack(dir, ts);

  auto ckpt = HfCheckpointFiles::Open(dir);
  ASSERT_TRUE(ckpt.ok());
  EXPECT_TRUE(ckpt->sharded());
  EXPECT_EQ(ckpt->info("big")->file, "model-00002-of-00003.safetensors");
  EXPECT_EQ(ckpt->info("d")->dtype, torch::kBFloat16);
  EXPECT_EQ(ckpt->info("d")->shape, (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(ckpt->info("d")->bytes, 40);
  EXPECT_EQ(ckpt->files(), (std::vector<std::string>{"model-00001-of-00003.safetensors",
                                                     "model-00002-of-00003.safetensors",
                                                     "model-00003-of-00003.safetensors"}));
}

TEST(HfCheckpointWriterTest, OneFileWhenEverythingFits) {
  const std::string dir = TempDir("hf_one_file") + "/export";
  const auto ts = PlanTensors();
  // Exactly the limit still fits: a new file only past it.
  auto writer = HfCheckpointWriter::Create(dir, SpecsOf(ts), 296, {});
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_EQ(writer->shards().size(), 1u);
  EXPECT_EQ(writer->shards()[0].file, "model.safetensors");
  Export(dir, ts, 296);
  EXPECT_EQ(List(dir), (std::vector<std::string>{"config.json", "model.safetensors"}));
  ExpectReadsBack(dir, ts);
  auto ckpt = HfCheckpointFiles::Open(dir);
  ASSERT_TRUE(ckpt.ok());
  EXPECT_FALSE(ckpt->sharded());
  EXPECT_EQ(ckpt->info("a")->file, "model.safetensors");

  // No tensors at all: one empty model.safetensors.
  const std::string empty = TempDir("hf_no_tensors") + "/export";
  Export(empty, {}, 100);
  EXPECT_EQ(List(empty), (std::vector<std::string>{"config.json", "model.safetensors"}));
  auto none = HfCheckpointFiles::Open(empty);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->names().empty());
}

TEST(HfCheckpointWriterTest, RefusesWritesOutOfOrderOrUnlikeTheirSpec) {
  const std::string dir = TempDir("hf_bad_writes") + "/export";
  const auto ts = PlanTensors();
  auto writer = HfCheckpointWriter::Create(dir, SpecsOf(ts), 100, {{"config.json", kConfig}});
  ASSERT_TRUE(writer.ok()) << writer.status();
  auto expect = [&](const std::string& name, const torch::Tensor& t, const std::string& message) {
    absl::Status status = writer->Write(name, t);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_EQ(status.message(),
              absl::StrCat("formats::HfCheckpointWriter::Write: ", dir, ": tensor '", name, "' ",
                           message, "; nothing was written"));
  };
  expect("b", ts[1].second,
         "(spec 1) is out of order; expected 'a' (spec 0) next: tensors are written in spec "
         "order");
  expect("z", ts[0].second, "is not one of the 7 specs; expected 'a' (spec 0) next");
  expect("a", ts[0].second.to(torch::kFloat64),
         "has dtype Double; expected its spec's Float (float32, bfloat16 and float16 are "
         "converted to each other)");
  expect("a", ts[0].second.reshape({2, 5}), "has shape [2, 5]; expected its spec's [10]");
  expect("a", torch::Tensor(), "is undefined");
  // Nothing was written: no file started.
  EXPECT_TRUE(List(writer->temp_dir()).empty());

  ASSERT_TRUE(writer->Write("a", ts[0].second).ok());
  expect("a", ts[0].second,
         "(spec 0) is already written; expected 'b' (spec 1) next: tensors are written in spec "
         "order");
  // Any strides and layout of the right dtype and shape.
  ASSERT_TRUE(writer->Write("b", ts[1].second.t().contiguous().t()).ok());

  // Commit before every tensor is written.
  absl::Status committed = writer->Commit();
  EXPECT_EQ(committed.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(committed.message(),
            absl::StrCat("formats::HfCheckpointWriter::Commit: ", dir,
                         ": tensor 'c' (spec 2 of 7) was not written; expected every tensor "
                         "before Commit"));
  EXPECT_FALSE(IsDirectory(dir));
  for (size_t i = 2; i < ts.size(); ++i) ASSERT_TRUE(writer->Write(ts[i].first, ts[i].second).ok());
  expect("a", ts[0].second, "given after all 7 tensors were written");
  ASSERT_TRUE(writer->Commit().ok());
  EXPECT_EQ(writer->Commit().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(writer->Write("a", ts[0].second).code(), absl::StatusCode::kFailedPrecondition);
  ExpectReadsBack(dir, ts);
}

// A float32 tensor for a bfloat16 (or float16) spec is converted a chunk at
// a time: the file holds what .to(dtype) gives, across chunk boundaries
// (the 32 MiB buffer: 16 Mi bfloat16 elements) and in the last partial one.
TEST(HfCheckpointWriterTest, ConvertsBetweenFloatDtypesInChunks) {
  const std::string dir = TempDir("hf_convert") + "/export";
  const torch::Tensor big = torch::randn({(int64_t{16} << 20) + 12345});
  const torch::Tensor small = torch::randn({3, 5}, torch::kBFloat16);
  const std::vector<TensorSpec> specs = {{"big", torch::kBFloat16, big.sizes().vec()},
                                         {"small", torch::kHalf, small.sizes().vec()}};
  auto writer =
      HfCheckpointWriter::Create(dir, specs, int64_t{1} << 30, {{"config.json", kConfig}});
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_TRUE(writer->Write("big", big).ok());
  ASSERT_TRUE(writer->Write("small", small).ok());
  ASSERT_TRUE(writer->Commit().ok());
  auto ckpt = HfCheckpointFiles::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_TRUE(torch::equal(*ckpt->ReadAll("big"), big.to(torch::kBFloat16)));
  EXPECT_TRUE(torch::equal(*ckpt->ReadAll("small"), small.to(torch::kHalf)));
}

TEST(HfCheckpointWriterTest, RefusesBadArguments) {
  const std::string root = TempDir("hf_bad_args");
  const std::string dir = root + "/export";
  auto code = [&](std::vector<TensorSpec> specs, int64_t max, std::map<std::string, std::string> x,
                  const std::string& part) {
    auto writer = HfCheckpointWriter::Create(dir, std::move(specs), max, std::move(x));
    EXPECT_FALSE(writer.ok());
    EXPECT_TRUE(absl::StrContains(writer.status().message(), part)) << writer.status();
    return writer.status().code();
  };
  const TensorSpec a{"a", torch::kFloat32, {2}};
  EXPECT_EQ(code({a}, 0, {}, "max_shard_bytes 0: expected >= 1"),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({a, a}, 100, {}, "spec 1, tensor 'a': named twice (spec 0 too)"),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{"c", torch::kComplexDouble, {2}}}, 100, {},
                 "dtype ComplexDouble, which safetensors has no name for"),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{"n", torch::kFloat32, {2, -1}}}, 100, {}, "shape [2, -1]: expected sizes >= 0"),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{"__metadata__", torch::kFloat32, {2}}}, 100, {}, "a reserved name"),
            absl::StatusCode::kInvalidArgument);
  for (const std::string& extra :
       {"../config.json", "/abs.json", "notes.txt", "model.safetensors", "x.safetensors",
        "model.safetensors.index.json", "sub/config.json", ""}) {
    EXPECT_EQ(code({a}, 100, {{extra, "{}"}}, "extra file '"), absl::StatusCode::kInvalidArgument)
        << extra;
  }
  EXPECT_EQ(HfCheckpointWriter::Create("", {a}, 100, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HfCheckpointWriter::Create(root + "/..", {a}, 100, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(List(root).empty());  // nothing written
}

TEST(HfCheckpointWriterTest, RefusesAnExistingDirectoryThatIsNotAnExport) {
  const std::string root = TempDir("hf_not_export");
  const std::string dir = root + "/export";
  const auto ts = PlanTensors();
  auto refused = [&](const std::string& part) {
    const std::vector<std::string> before = List(dir);
    auto writer = HfCheckpointWriter::Create(dir, SpecsOf(ts), 100, {{"config.json", kConfig}});
    ASSERT_FALSE(writer.ok());
    EXPECT_EQ(writer.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(
        absl::StrContains(writer.status().message(),
                          absl::StrCat("formats::HfCheckpointWriter: ", dir, " exists and ", part)))
        << writer.status();
    EXPECT_TRUE(absl::StrContains(writer.status().message(), "nothing was written"));
    EXPECT_EQ(List(root), (std::vector<std::string>{"export"}));  // no temporary directory
    EXPECT_EQ(List(dir), before);
  };
  ASSERT_EQ(mkdir(dir.c_str(), 0755), 0);
  Spit(dir + "/config.json", "{}");
  Spit(dir + "/model.safetensors", "x");
  Spit(dir + "/notes.txt", "mine");
  refused("holds 'notes.txt', which an export does not write");
  ASSERT_EQ(unlink((dir + "/notes.txt").c_str()), 0);
  ASSERT_EQ(mkdir((dir + "/sub").c_str(), 0755), 0);
  refused("holds 'sub', which is not a regular file");
  ASSERT_EQ(rmdir((dir + "/sub").c_str()), 0);
  ASSERT_EQ(unlink((dir + "/config.json").c_str()), 0);
  refused("holds no config.json");
  Spit(dir + "/config.json", "{}");
  ASSERT_EQ(unlink((dir + "/model.safetensors").c_str()), 0);
  refused("holds no model.safetensors or model.safetensors.index.json");
  ASSERT_EQ(unlink((dir + "/config.json").c_str()), 0);
  ASSERT_EQ(rmdir(dir.c_str()), 0);
  Spit(dir, "a file");
  refused("is not a directory");
  ASSERT_EQ(unlink(dir.c_str()), 0);

  // An empty directory is replaced.
  ASSERT_EQ(mkdir(dir.c_str(), 0755), 0);
  Export(dir, ts, 100);
  ExpectReadsBack(dir, ts);
  EXPECT_EQ(List(root), (std::vector<std::string>{"export"}));
}

TEST(HfCheckpointWriterTest, ReplacesAPreviousExport) {
  const std::string root = TempDir("hf_replace");
  const std::string dir = root + "/export";
  const auto first = PlanTensors();
  Export(dir, first, 100, {{"config.json", kConfig}, {"tokenizer.json", "{}"}});
  ASSERT_EQ(List(dir).size(), 6u);
  torch::manual_seed(2);
  const std::vector<std::pair<std::string, torch::Tensor>> second = {
      {"w", RandomTensor(torch::kBFloat16, {3, 3})}, {"a", RandomTensor(torch::kInt64, {2})}};
  // Checked at Create and again at Commit.
  auto writer =
      HfCheckpointWriter::Create(dir, SpecsOf(second), 1 << 20, {{"config.json", "{\"v\": 2}"}});
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (const auto& [name, t] : second) ASSERT_TRUE(writer->Write(name, t).ok());
  ASSERT_TRUE(writer->Commit().ok());
  EXPECT_EQ(List(dir), (std::vector<std::string>{"config.json", "model.safetensors"}));
  EXPECT_EQ(Slurp(dir + "/config.json"), "{\"v\": 2}");
  ExpectReadsBack(dir, second);
  EXPECT_EQ(List(root), (std::vector<std::string>{"export"}));  // the old one removed

  // A directory that stopped looking like an export before Commit: refused,
  // left as it is, and the new export's temporary directory removed.
  Export(dir, first, 100);
  auto late = HfCheckpointWriter::Create(dir, SpecsOf(second), 1 << 20, {});
  ASSERT_TRUE(late.ok()) << late.status();
  for (const auto& [name, t] : second) ASSERT_TRUE(late->Write(name, t).ok());
  Spit(dir + "/notes.txt", "mine");
  const absl::Status status = late->Commit();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "notes.txt")) << status;
  late = absl::UnknownError("dropped");
  EXPECT_EQ(List(root), (std::vector<std::string>{"export"}));
  EXPECT_EQ(Slurp(dir + "/notes.txt"), "mine");
  ExpectReadsBack(dir, first);
}

TEST(HfCheckpointWriterTest, AnUncommittedWriterLeavesNothing) {
  const std::string root = TempDir("hf_abandoned");
  const std::string dir = root + "/sub/export";  // missing parents are created
  const auto ts = PlanTensors();
  {
    auto writer = HfCheckpointWriter::Create(dir, SpecsOf(ts), 100, {{"config.json", kConfig}});
    ASSERT_TRUE(writer.ok()) << writer.status();
    for (size_t i = 0; i < 5; ++i) ASSERT_TRUE(writer->Write(ts[i].first, ts[i].second).ok());
    EXPECT_EQ(List(writer->temp_dir()).size(), 3u);  // two done, one open
    HfCheckpointWriter moved = *std::move(writer);   // the moved-from one owns nothing
    writer = absl::UnknownError("dropped");
    EXPECT_EQ(List(root + "/sub").size(), 1u);
  }
  EXPECT_TRUE(List(root + "/sub").empty());
  EXPECT_FALSE(IsDirectory(dir));
}

// ---- the reader's refusals ----------------------------------------------------------

// A sharded directory by hand: a.safetensors {x, y}, b.safetensors {z}.
std::string HandMadeShards(const std::string& name) {
  const std::string dir = TempDir(name);
  TensorDict a, b;
  a.insert("x", torch::arange(6, torch::kFloat32).reshape({2, 3}));
  a.insert("y", torch::arange(4, torch::kInt64));
  b.insert("z", torch::ones({5}, torch::kBFloat16));
  EXPECT_TRUE(SaveSafetensors(a, dir + "/a.safetensors").ok());
  EXPECT_TRUE(SaveSafetensors(b, dir + "/b.safetensors").ok());
  return dir;
}

constexpr char kGoodMap[] = R"({"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"})";

absl::Status OpenWithIndex(const std::string& dir, const std::string& index) {
  Spit(dir + "/model.safetensors.index.json", index);
  return HfCheckpointFiles::Open(dir).status();
}

void ExpectRefused(const std::string& dir, const std::string& index, absl::StatusCode code,
                   const std::string& message) {
  const absl::Status status = OpenWithIndex(dir, index);
  EXPECT_EQ(status.code(), code) << index << "\n" << status;
  EXPECT_EQ(status.message(), message) << index;
}

TEST(HfCheckpointFilesTest, ReadsAHandMadeShardedDirectory) {
  const std::string dir = HandMadeShards("hf_hand_made");
  ASSERT_TRUE(OpenWithIndex(dir, absl::StrCat(R"({"metadata": {"total_size": 66, "note": {"deep":
      [1, {"x": null}]}}, "weight_map": )",
                                              kGoodMap, R"(, "other": [[]]})"))
                  .ok());
  auto ckpt = HfCheckpointFiles::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->names(), (std::vector<std::string>{"x", "y", "z"}));
  EXPECT_EQ(ckpt->files(), (std::vector<std::string>{"a.safetensors", "b.safetensors"}));
  auto x = ckpt->Read("x", 2, 3);
  ASSERT_TRUE(x.ok()) << x.status();
  EXPECT_TRUE(torch::equal(*x, torch::arange(2, 5, torch::kFloat32)));
  auto z = ckpt->ReadAll("z");
  ASSERT_TRUE(z.ok()) << z.status();
  EXPECT_TRUE(torch::equal(*z, torch::ones({5}, torch::kBFloat16)));
  EXPECT_EQ(ckpt->Read("w", 0, 1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ckpt->info("w").status().message(),
            absl::StrCat("formats::HfCheckpointFiles::info: the checkpoint ", dir,
                         " has no tensor 'w' (3 tensors)"));
  // total_size as a float, no metadata, metadata null.
  EXPECT_TRUE(
      OpenWithIndex(
          dir, absl::StrCat(R"({"metadata": {"total_size": 66.0}, "weight_map": )", kGoodMap, "}"))
          .ok());
  EXPECT_TRUE(OpenWithIndex(dir, absl::StrCat(R"({"weight_map": )", kGoodMap, "}")).ok());
  EXPECT_TRUE(
      OpenWithIndex(dir, absl::StrCat(R"({"metadata": null, "weight_map": )", kGoodMap, "}")).ok());
  // A trailing slash on the directory is fine.
  EXPECT_TRUE(HfCheckpointFiles::Open(dir + "/").ok());
}

TEST(HfCheckpointFilesTest, RefusesIndexesThatNameFilesOutsideOrMissing) {
  const std::string dir = HandMadeShards("hf_bad_files");
  const std::string index = dir + "/model.safetensors.index.json";
  for (const std::string& file :
       {"../x.safetensors", "/abs.safetensors", "sub/a.safetensors", ".", "..", ""}) {
    ExpectRefused(
        dir, absl::StrCat(R"({"weight_map": {"x": "a.safetensors", "y": ")", file, "\"}}"),
        absl::StatusCode::kInvalidArgument,
        absl::StrCat("formats::HfCheckpointFiles::Open: ", index, ": tensor 'y' maps to the file '",
                     file, "'; expected a plain file name inside ", dir,
                     " (no '/', not '.' or '..')"));
  }
  ExpectRefused(dir, R"({"weight_map": {"x": "a.safetensors", "y": "c.safetensors"}})",
                absl::StatusCode::kNotFound,
                absl::StrCat("formats::HfCheckpointFiles::Open: ", index,
                             " maps tensor 'y' to the file 'c.safetensors', which does not exist (",
                             dir, "/c.safetensors)"));
}

TEST(HfCheckpointFilesTest, RefusesIndexesThatDisagreeWithTheHeaders) {
  const std::string dir = HandMadeShards("hf_disagree");
  const std::string index = dir + "/model.safetensors.index.json";
  const std::string who = "formats::HfCheckpointFiles::Open: ";
  // y is in a.safetensors' header, not in the index.
  ExpectRefused(dir, R"({"weight_map": {"x": "a.safetensors", "z": "b.safetensors"}})",
                absl::StatusCode::kDataLoss,
                absl::StrCat(who, dir,
                             ": tensor 'y' is in the header of a.safetensors but not in "
                             "model.safetensors.index.json"));
  // The index puts z in a.safetensors.
  ExpectRefused(
      dir, R"({"weight_map": {"x": "a.safetensors", "y": "a.safetensors", "z": "a.safetensors"}})",
      absl::StatusCode::kDataLoss,
      absl::StrCat(who, index,
                   " maps tensor 'z' to a.safetensors, whose header has no such tensor (nor has "
                   "any other file's the index names)"));
  ExpectRefused(
      dir, R"({"weight_map": {"x": "a.safetensors", "y": "b.safetensors", "z": "b.safetensors"}})",
      absl::StatusCode::kDataLoss,
      absl::StrCat(who, index,
                   " maps tensor 'y' to b.safetensors, whose header has no such tensor; it is in "
                   "the header of a.safetensors"));
  // A tensor in two files' headers.
  TensorDict c;
  c.insert("y", torch::zeros({1}));
  ASSERT_TRUE(SaveSafetensors(c, dir + "/c.safetensors").ok());
  ExpectRefused(
      dir,
      R"({"weight_map": {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors",
          "w": "c.safetensors"}})",
      absl::StatusCode::kDataLoss,
      absl::StrCat(who, dir,
                   ": tensor 'y' is in the headers of both a.safetensors and c.safetensors; "
                   "expected each tensor in one file"));
  // total_size: 6*4 + 4*8 + 5*2 = 66 bytes.
  ExpectRefused(dir,
                absl::StrCat(R"({"metadata": {"total_size": 65}, "weight_map": )", kGoodMap, "}"),
                absl::StatusCode::kDataLoss,
                absl::StrCat(who, index,
                             ": metadata.total_size is 65 bytes, but the 3 tensors of its files "
                             "take 66"));
  EXPECT_TRUE(OpenWithIndex(dir, absl::StrCat(R"({"metadata": {"total_size": 66}, "weight_map": )",
                                              kGoodMap, "}"))
                  .ok());
}

TEST(HfCheckpointFilesTest, RefusesMalformedIndexes) {
  const std::string dir = HandMadeShards("hf_malformed");
  const std::string index = dir + "/model.safetensors.index.json";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "not valid JSON"},
      {"[]", "the index is an array, not a JSON object"},
      {"5", "the index is the number 5, not a JSON object"},
      {"{}", "no \"weight_map\"; expected {tensor: file}"},
      {R"({"weight_map": []})", "weight_map is an array; expected an object {tensor: file}"},
      {R"({"weight_map": {"x": 1}})", "weight_map: tensor 'x' maps to the number 1"},
      {R"({"weight_map": {"x": {}}})", "weight_map: tensor 'x' maps to an object"},
      {R"({"weight_map": {"x": "a.safetensors", "x": "a.safetensors"}})",
       "weight_map: the tensor 'x' appears twice"},
      {absl::StrCat(R"({"weight_map": )", kGoodMap, R"(, "weight_map": {}})"),
       "the key \"weight_map\" appears twice"},
      {absl::StrCat(R"({"metadata": {"total_size": -1}, "weight_map": )", kGoodMap, "}"),
       "metadata.total_size is -1; expected an integer >= 0"},
      {absl::StrCat(R"({"metadata": {"total_size": 1.5}, "weight_map": )", kGoodMap, "}"),
       "metadata.total_size is 1.5; expected an integer >= 0"},
      {absl::StrCat(R"({"metadata": {"total_size": "66"}, "weight_map": )", kGoodMap, "}"),
       "metadata.total_size is the string '66'"},
      {absl::StrCat(R"({"metadata": [], "weight_map": )", kGoodMap, "}"),
       "metadata is an array; expected an object"},
      {absl::StrCat(R"({"metadata": {"x": )", std::string(100, '['), std::string(100, ']'),
                    R"(}, "weight_map": )", kGoodMap, "}"),
       "nests deeper than 64 levels"},
      {absl::StrCat(R"({"weight_map": )", kGoodMap, "} x"), "not valid JSON"},
      {std::string("{\"weight_map\": {}}\0", 19), "holds a NUL byte at offset 18"},
  };
  for (const auto& [text, part] : cases) {
    const absl::Status status = OpenWithIndex(dir, text);
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << text << "\n" << status;
    EXPECT_EQ(status.message().rfind(index + ": ", 0), 0u) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), part)) << text << "\n" << status;
  }
}

TEST(HfCheckpointFilesTest, RefusesDirectoriesWithoutOneSafetensorsCheckpoint) {
  const std::string dir = TempDir("hf_no_checkpoint");
  const std::string who = "formats::HfCheckpointFiles::Open: ";
  absl::Status status = HfCheckpointFiles::Open(dir).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(status.message(), absl::StrCat(who, dir,
                                           " holds neither model.safetensors nor "
                                           "model.safetensors.index.json"));
  Spit(dir + "/pytorch_model.bin", "x");
  status = HfCheckpointFiles::Open(dir).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(status.message(),
                                "(it holds pytorch_model.bin, a torch.save checkpoint: only "
                                "safetensors checkpoints are read"))
      << status;
  EXPECT_EQ(HfCheckpointFiles::Open(dir + "/missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(HfCheckpointFiles::Open(dir + "/pytorch_model.bin").status().code(),
            absl::StatusCode::kInvalidArgument);

  const std::string both = HandMadeShards("hf_both");
  ASSERT_TRUE(OpenWithIndex(both, absl::StrCat(R"({"weight_map": )", kGoodMap, "}")).ok());
  TensorDict one;
  one.insert("x", torch::zeros({1}));
  ASSERT_TRUE(SaveSafetensors(one, both + "/model.safetensors").ok());
  status = HfCheckpointFiles::Open(both).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(status.message(),
                                "holds both model.safetensors and "
                                "model.safetensors.index.json"))
      << status;
  // A corrupt shard: its own error, naming it.
  const std::string torn = HandMadeShards("hf_torn");
  const std::string b = Slurp(torn + "/b.safetensors");
  Spit(torn + "/b.safetensors", b.substr(0, b.size() - 1));
  status = OpenWithIndex(torn, absl::StrCat(R"({"weight_map": )", kGoodMap, "}"));
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(status.message().rfind(torn + "/b.safetensors: tensor 'z'", 0), 0u) << status;
}

// ---- Python -----------------------------------------------------------------------

std::string PythonDtype(torch::ScalarType type) {
  switch (type) {
    case torch::kBFloat16: return "torch.bfloat16";
    case torch::kFloat16: return "torch.float16";
    case torch::kFloat32: return "torch.float32";
    case torch::kInt64: return "torch.int64";
    case torch::kBool: return "torch.bool";
    case torch::kUInt8: return "torch.uint8";
    default: return "?";
  }
}

// Python's safetensors reads every shard of ours (safe_open), the index maps
// each tensor to the shard holding it, and huggingface_hub plans the same
// shards for the same tensors and limit.
TEST(HfCheckpointPythonTest, PythonReadsOurShards) {
  if (!PythonTorchAvailable()) GTEST_FAIL() << kNoPython;
  const std::string dir = TempDir("hf_to_python") + "/export";
  torch::manual_seed(5);
  const std::vector<std::pair<std::string, torch::Tensor>> ts = {
      {"embed.weight", RandomTensor(torch::kBFloat16, {16, 8})},
      {"layers.0.mask", RandomTensor(torch::kBool, {7})},
      {"layers.0.w", RandomTensor(torch::kFloat32, {8, 8})},
      {"layers.0.b", RandomTensor(torch::kFloat16, {8})},
      {"layers.1.w", RandomTensor(torch::kFloat32, {8, 8})},
      {"layers.1.ids", RandomTensor(torch::kInt64, {3})},
      {"head.weight", RandomTensor(torch::kBFloat16, {16, 16})},  // over the limit
      {"u8", RandomTensor(torch::kUInt8, {5})},
  };
  Export(dir, ts, 300);
  auto writer = HfCheckpointWriter::Create(TempDir("hf_to_python_plan") + "/x", SpecsOf(ts), 300);
  ASSERT_TRUE(writer.ok());
  std::string plan;
  for (const HfShard& shard : writer->shards()) {
    absl::StrAppend(&plan, "plan ", shard.file, " ", absl::StrJoin(shard.tensors, ","), "\n");
  }
  ASSERT_GT(writer->shards().size(), 2u);
  std::vector<std::string> names;
  for (const auto& [name, t] : ts) names.push_back(name);

  std::string output;
  const int rc = RunPython(R"(
import json, os, sys
import torch
from safetensors import safe_open
from huggingface_hub import split_torch_state_dict_into_shards
d = sys.argv[1]
index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
seen = {}
out = {}
for f in sorted(set(index["weight_map"].values())):
    with safe_open(os.path.join(d, f), framework="pt") as st:
        assert st.metadata() == {"format": "pt"}, st.metadata()
        for k in st.keys():
            seen[k] = f
            out[k] = st.get_tensor(k)
assert seen == index["weight_map"], (seen, index["weight_map"])
assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
order = sys.argv[2].split(",")
for k in order:
    t = out[k]
    print(k, t.dtype, list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes().hex())
split = split_torch_state_dict_into_shards({k: out[k] for k in order}, max_shard_size=300)
for f, names in split.filename_to_tensors.items():
    print("plan", f, ",".join(names))
)",
                           absl::StrCat("'", dir, "' '", absl::StrJoin(names, ","), "'"), &output);
  ASSERT_EQ(rc, 0) << output;
  std::string expected;
  for (const auto& [name, t] : ts) {
    absl::StrAppend(&expected, name, " ", PythonDtype(t.scalar_type()), " [",
                    absl::StrJoin(t.sizes(), ", "), "] ", Hex(t), "\n");
  }
  EXPECT_EQ(output, expected + plan);
}

// transformers' from_pretrained loads our export of a model it made: the
// Python model's tensors are read here from its save_file output (so this
// also reads Python's files), written with small shards, and loaded back
// bit for bit.
TEST(HfCheckpointPythonTest, TransformersLoadsOurExport) {
  if (!PythonTorchAvailable()) GTEST_FAIL() << kNoPython;
  const std::string root = TempDir("hf_transformers");
  const std::string src = root + "/src";
  const std::string out = root + "/export";
  std::string output;
  int rc = RunPython(R"(
import os, sys
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                     tie_word_embeddings=False)
model = LlamaForCausalLM(config).to(torch.bfloat16)
os.makedirs(sys.argv[1])
sd = {k: v.contiguous() for k, v in model.state_dict().items()}
save_file(sd, os.path.join(sys.argv[1], "model.safetensors"), metadata={"format": "pt"})
config.save_pretrained(sys.argv[1])
print(len(sd))
)",
                     absl::StrCat("'", src, "'"), &output);
  ASSERT_EQ(rc, 0) << output;

  auto source = HfCheckpointFiles::Open(src);
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_EQ(std::to_string(source->names().size()) + "\n", output);
  std::vector<TensorSpec> specs;
  for (const std::string& name : source->names()) {
    auto info = source->info(name);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->dtype, torch::kBFloat16) << name;
    specs.push_back({name, info->dtype, info->shape});
  }
  auto writer =
      HfCheckpointWriter::Create(out, specs, 3000, {{"config.json", Slurp(src + "/config.json")}});
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_GT(writer->shards().size(), 3u);
  for (const TensorSpec& spec : specs) {
    auto tensor = source->ReadAll(spec.key);
    ASSERT_TRUE(tensor.ok()) << tensor.status();
    ASSERT_TRUE(writer->Write(spec.key, *tensor).ok());
  }
  ASSERT_TRUE(writer->Commit().ok());

  rc = RunPython(R"(
import sys
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.bfloat16)
want = load_file(sys.argv[1] + "/model.safetensors")
got = model.state_dict()
assert sorted(got) == sorted(want), (sorted(got), sorted(want))
for k in want:
    assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
ids = torch.tensor([[1, 2, 3]])
print("loaded", type(model).__name__, len(want), model(ids).logits.shape[-1])
)",
                 absl::StrCat("'", src, "' '", out, "'"), &output);
  ASSERT_EQ(rc, 0) << output;
  EXPECT_TRUE(
      absl::StrContains(output, absl::StrCat("loaded LlamaForCausalLM ", specs.size(), " 64\n")))
      << output;
}

// A sharded directory of Python's save_file shards and a hand-written index:
// every tensor read here, whole and by range, bit for bit.
TEST(HfCheckpointPythonTest, ReadsPythonsShardedDirectory) {
  if (!PythonTorchAvailable()) GTEST_FAIL() << kNoPython;
  const std::string dir = TempDir("hf_from_python");
  std::string output;
  const int rc = RunPython(R"(
import json, os, sys
import torch
from safetensors.torch import save_file
torch.manual_seed(0)
d = sys.argv[1]
shards = {
    "model-00001-of-00002.safetensors": {
        "model.embed_tokens.weight": torch.randn(11, 4, dtype=torch.bfloat16),
        "model.norm.weight": torch.randn(4, dtype=torch.float16),
        "mask": torch.tensor([True, False, True]),
    },
    "model-00002-of-00002.safetensors": {
        "lm_head.weight": torch.randn(11, 4),
        "step": torch.tensor(7, dtype=torch.int64),
    },
}
weight_map, total = {}, 0
for f, tensors in shards.items():
    save_file(tensors, os.path.join(d, f), metadata={"format": "pt"})
    for k, t in tensors.items():
        weight_map[k] = f
        total += t.numel() * t.element_size()
with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2,
              sort_keys=True)
for f, tensors in sorted(shards.items()):
    for k, t in sorted(tensors.items()):
        print(k, f, t.dtype, list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes().hex())
)",
                           absl::StrCat("'", dir, "'"), &output);
  ASSERT_EQ(rc, 0) << output;
  auto ckpt = HfCheckpointFiles::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  std::map<std::string, std::string> ours;  // by file, then name, as printed
  for (const std::string& name : ckpt->names()) {
    auto info = ckpt->info(name);
    ASSERT_TRUE(info.ok());
    auto t = ckpt->ReadAll(name);
    ASSERT_TRUE(t.ok()) << t.status();
    ours[info->file + " " + name] =
        absl::StrCat(name, " ", info->file, " ", PythonDtype(t->scalar_type()), " [",
                     absl::StrJoin(t->sizes(), ", "), "] ", Hex(*t), "\n");
    // Every range of one element is that element.
    for (int64_t i = 0; i < info->numel; ++i) {
      auto one = ckpt->Read(name, i, 1);
      ASSERT_TRUE(one.ok()) << one.status();
      EXPECT_EQ(Hex(*one), Hex(t->reshape(-1).slice(0, i, i + 1))) << name << " " << i;
    }
  }
  std::string joined;
  for (const auto& [key, line] : ours) joined += line;
  EXPECT_EQ(joined, output);
  EXPECT_EQ(ckpt->names().size(), 5u);
}

}  // namespace
}  // namespace formats
