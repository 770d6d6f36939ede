// Hugging Face checkpoints in and out of a module: the golden checkpoints of
// tools/golden/llama_golden.py (models/testdata/), our exports read back
// bitwise, and transformers' from_pretrained on our export giving our
// logits.
#include "state_dict/hf_checkpoint.h"

#include <filesystem>
#include <fstream>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "formats/hf/hf_checkpoint_files.h"
#include "formats/testing/python_interop.h"
#include "models/llama.h"
#include "testing/golden_fixture.h"

namespace state_dict {
namespace {

using ::testing::HasSubstr;

std::string CaseDir(const std::string& name) {
  return test_data::RunfilePath("models/testdata/" + name);
}

models::LlamaConfig ConfigOf(const std::string& name) {
  auto config = models::ReadLlamaConfig(CaseDir(name) + "/config.json");
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

void ExpectSameParameters(torch::nn::Module& a, torch::nn::Module& b) {
  auto pb = b.named_parameters();
  for (const auto& p : a.named_parameters()) {
    ASSERT_TRUE(pb.contains(p.key())) << p.key();
    EXPECT_TRUE(torch::equal(p.value(), pb[p.key()])) << p.key();
  }
  EXPECT_EQ(a.named_parameters().size(), pb.size());
}

TEST(HfCheckpoint, LoadsShardedCheckpointIntoTheModel) {
  models::LlamaForCausalLM model(ConfigOf("llama3_gqa"));
  ASSERT_TRUE(LoadHfCheckpoint(*model, CaseDir("llama3_gqa")).ok());
  const test_data::GoldenFixture golden(CaseDir("llama3_gqa") + "/golden.pt");
  const torch::Tensor batch = golden["batch"];
  const torch::Tensor logits = model->forward(batch.narrow(1, 0, batch.size(1) - 1));
  EXPECT_LE((logits - golden["logits"]).abs().max().item<double>(), 1e-4);
}

TEST(HfCheckpoint, Bf16FileConvertsToTheModelsFloat32) {
  models::LlamaForCausalLM model(ConfigOf("llama3_gqa_bf16"));
  ASSERT_TRUE(LoadHfCheckpoint(*model, CaseDir("llama3_gqa_bf16")).ok());
  const test_data::GoldenFixture golden(CaseDir("llama3_gqa_bf16") + "/golden.pt");
  for (const auto& p : model->named_parameters()) {
    EXPECT_EQ(p.value().scalar_type(), torch::kFloat);
    EXPECT_TRUE(torch::equal(p.value(), golden["params." + p.key()])) << p.key();
  }
}

TEST(HfCheckpoint, ReadHfShardsReadsTheRequestedRanges) {
  auto files = formats::HfCheckpointFiles::Open(CaseDir("llama3_gqa"));
  ASSERT_TRUE(files.ok()) << files.status();
  const std::string name = "model.layers.1.mlp.down_proj.weight";
  auto info = files->info(name);
  ASSERT_TRUE(info.ok());
  ShardRequest request;
  request.global_shape = info->shape;
  request.dtype = torch::kBFloat16;
  request.ranges = {{5, 100}, {info->numel - 7, 7}};
  auto shards = ReadHfShards(*files, {{name, request}});
  ASSERT_TRUE(shards.ok()) << shards.status();
  const torch::Tensor full = files->ReadAll(name)->flatten();
  const ShardedTensor& t = (*shards)[name];
  ASSERT_EQ(t.pieces.size(), 2u);
  EXPECT_TRUE(torch::equal(t.pieces[0].data, full.narrow(0, 5, 100).to(torch::kBFloat16)));
  EXPECT_TRUE(
      torch::equal(t.pieces[1].data, full.narrow(0, info->numel - 7, 7).to(torch::kBFloat16)));
}

// Straight into the caller's tensor through the two staging buffers: chunks
// of 64 bytes here (16 float32 elements: many chunks, a partial last one),
// converted to the destination's dtype; refusals leave it as it was.
TEST(HfCheckpoint, HfRangeReaderStreamsRangesIntoTheDestination) {
  auto files = formats::HfCheckpointFiles::Open(CaseDir("llama3_gqa_bf16"));
  ASSERT_TRUE(files.ok()) << files.status();
  const std::string name = "model.layers.1.mlp.down_proj.weight";
  const torch::Tensor full = files->ReadAll(name)->flatten();
  HfRangeReader reader(*files, /*chunk_bytes=*/64);
  for (const FlatRange range :
       {FlatRange{5, 301}, FlatRange{0, 16}, FlatRange{full.numel() - 3, 3}, FlatRange{7, 0}}) {
    torch::Tensor into = torch::full({range.numel}, -1.0f);
    ASSERT_TRUE(reader.ReadInto(name, range, into).ok()) << range.offset;
    EXPECT_TRUE(torch::equal(into, full.narrow(0, range.offset, range.numel).to(torch::kFloat)))
        << range.offset;
  }
  torch::Tensor strided = torch::zeros({20, 2}).select(1, 0);
  absl::Status s = reader.ReadInto(name, {0, 20}, strided);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("expected a contiguous CPU destination of 20 elements"));
  EXPECT_TRUE(torch::equal(strided, torch::zeros({20})));
  torch::Tensor ints = torch::zeros({20}, torch::kInt64);
  s = reader.ReadInto(name, {0, 20}, ints);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("is BFloat16: the model expects Long"));
  s = reader.ReadInto(name, {full.numel() - 3, 3}, torch::zeros({3}).add_(0).narrow(0, 0, 3));
  EXPECT_TRUE(s.ok());
  s = reader.ReadInto(name, {full.numel() - 2, 3}, torch::zeros({3}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

TEST(HfCheckpoint, MismatchedModelsAreRefusedNamingTheTensor) {
  auto refused = [](models::LlamaConfig config, const std::string& expected) {
    models::LlamaForCausalLM model(config);
    const torch::Tensor before = model->model->norm->weight.clone();
    const absl::Status s = LoadHfCheckpoint(*model, CaseDir("llama3_gqa"));
    EXPECT_FALSE(s.ok());
    EXPECT_THAT(std::string(s.message()), HasSubstr(expected)) << s;
    EXPECT_TRUE(torch::equal(before, model->model->norm->weight)) << "written before the error";
  };
  models::LlamaConfig more_layers = ConfigOf("llama3_gqa");
  more_layers.num_hidden_layers = 3;
  refused(more_layers, "no tensor 'model.layers.2.");
  models::LlamaConfig fewer_layers = ConfigOf("llama3_gqa");
  fewer_layers.num_hidden_layers = 1;
  refused(fewer_layers, "tensor 'model.layers.1.");
  models::LlamaConfig other_vocab = ConfigOf("llama3_gqa");
  other_vocab.vocab_size = 100;
  refused(other_vocab,
          "'model.embed_tokens.weight' in model-00001-of-00003.safetensors has shape "
          "[128, 64]: the model expects [100, 64]");
  models::LlamaConfig tied = ConfigOf("llama3_gqa");
  tied.tie_word_embeddings = true;
  refused(tied, "tensor 'lm_head.weight' in");
}

TEST(HfCheckpoint, ExportReadsBackBitwiseInEveryLayout) {
  for (const std::string& name : {"llama3_gqa", "llama_tied", "qwen3"}) {
    models::LlamaForCausalLM model(ConfigOf(name));
    ASSERT_TRUE(LoadHfCheckpoint(*model, CaseDir(name)).ok());
    const std::string dir = formats::testing::TempDir("export_" + name) + "/out";
    // 20 KB shards: several files and an index.
    ASSERT_TRUE(SaveHfCheckpoint(*model, dir, torch::kFloat, 20000,
                                 models::LlamaConfigJson(model->config(), torch::kFloat))
                    .ok());
    auto files = formats::HfCheckpointFiles::Open(dir);
    ASSERT_TRUE(files.ok()) << files.status();
    EXPECT_TRUE(files->sharded());
    EXPECT_EQ(files->contains("lm_head.weight"), !model->config().tie_word_embeddings);
    auto config = models::ReadLlamaConfig(dir + "/config.json");
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_EQ(config->dtype, torch::kFloat);
    models::LlamaForCausalLM back(*config);
    ASSERT_TRUE(LoadHfCheckpoint(*back, dir).ok());
    ExpectSameParameters(*model, *back);
  }
}

TEST(HfCheckpoint, Bf16ExportHoldsTheRoundedValues) {
  models::LlamaForCausalLM model(ConfigOf("llama3_gqa"));
  ASSERT_TRUE(LoadHfCheckpoint(*model, CaseDir("llama3_gqa")).ok());
  const std::string dir = formats::testing::TempDir("export_bf16") + "/out";
  ASSERT_TRUE(SaveHfCheckpoint(*model, dir, torch::kBFloat16, int64_t{1} << 30,
                               models::LlamaConfigJson(model->config(), torch::kBFloat16))
                  .ok());
  auto files = formats::HfCheckpointFiles::Open(dir);
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_FALSE(files->sharded());
  for (const auto& p : model->named_parameters()) {
    auto t = files->ReadAll(p.key());
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(t->scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(*t, p.value().to(torch::kBFloat16))) << p.key();
  }
}

TEST(HfCheckpoint, ExportIntoADirectoryThatIsNotAnExportIsRefused) {
  models::LlamaForCausalLM model(ConfigOf("llama_tied"));
  const std::string dir = formats::testing::TempDir("export_refused") + "/mine";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/notes.txt") << "keep me";
  const absl::Status s = SaveHfCheckpoint(*model, dir, torch::kFloat, int64_t{1} << 30,
                                          models::LlamaConfigJson(model->config(), torch::kFloat));
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("notes.txt"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/config.json"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/notes.txt"));
}

// transformers' from_pretrained (the pinned version) loads what we export,
// sharded and bf16 included, and computes our logits.
TEST(HfCheckpoint, TransformersLoadsOurExportAndComputesOurLogits) {
  if (!formats::testing::PythonTorchAvailable()) {
    GTEST_FAIL() << "the Python of the build's torch wheel cannot import torch (run "
                    "tools/setup.sh --with-python, which also installs transformers)";
  }
  // Every export first, then one Python process for all (its imports take
  // seconds).
  struct Export {
    std::string label, dir, ids_path;
    torch::Tensor ours;
  };
  std::vector<Export> exports;
  const std::string root = formats::testing::TempDir("to_transformers");
  for (const std::string& name : {"llama3_gqa", "llama_tied", "qwen3", "qwen2", "mistral"}) {
    for (const torch::Dtype dtype : {torch::kFloat, torch::kBFloat16}) {
      models::LlamaForCausalLM model(ConfigOf(name));
      model->InitializeWeights(3);
      // Weights far from transformers' defaults, so a dropped or defaulted
      // tensor would show.
      {
        torch::NoGradGuard no_grad;
        for (auto& p : model->parameters()) p.add_(torch::randn_like(p) * 0.2);
      }
      Export e;
      e.label = name + "_" + c10::toString(dtype);
      e.dir = root + "/" + e.label;
      ASSERT_TRUE(SaveHfCheckpoint(*model, e.dir, dtype, 30000,
                                   models::LlamaConfigJson(model->config(), dtype))
                      .ok());
      // Our logits with the exported (possibly rounded) weights.
      models::LlamaForCausalLM exported(model->config());
      ASSERT_TRUE(LoadHfCheckpoint(*exported, e.dir).ok());
      const torch::Tensor ids = torch::randint(model->config().vocab_size, {2, 11});
      e.ours = exported->forward(ids).detach();
      e.ids_path = e.dir + "_ids.pt";
      const std::vector<char> bytes = torch::pickle_save(ids);
      std::ofstream(e.ids_path, std::ios::binary).write(bytes.data(), bytes.size());
      exports.push_back(std::move(e));
    }
  }
  std::string args;
  for (const Export& e : exports) args += " " + e.dir + " " + e.ids_path;
  std::string output;
  const int status = formats::testing::RunPython(R"(
import sys, torch, transformers
for d, ids_path in zip(sys.argv[1::2], sys.argv[2::2]):
    ids = torch.load(ids_path)
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                          attn_implementation="sdpa")
    with torch.no_grad():
        logits = m(input_ids=ids).logits
    torch.save(logits, ids_path + ".logits")
    print("loaded", d, type(m).__name__, tuple(logits.shape))
)",
                                                 args, &output);
  ASSERT_EQ(status, 0) << output;
  for (const Export& e : exports) {
    std::ifstream in(e.ids_path + ".logits", std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                  std::istreambuf_iterator<char>());
    const torch::Tensor theirs = torch::pickle_load(bytes).toTensor();
    EXPECT_LE((e.ours - theirs).abs().max().item<double>(), 1e-4) << e.label << ": " << output;
  }
}

}  // namespace
}  // namespace state_dict
