// End-to-end test of the ckpt binary on a 3-rank sharded checkpoint.
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <vector>
#include <map>
#include <string>

#include <gtest/gtest.h>
#include <torch/types.h>

#include "formats/safetensors/safetensors.h"
#include "state_dict/checkpoint.h"
#include "torch_python.h"

namespace {

std::string TempDir(const std::string& name) {
  std::string dir = std::string(getenv("TEST_TMPDIR")) + "/" + name;
  std::string cmd = "rm -rf '" + dir + "' && mkdir -p '" + dir + "'";
  if (system(cmd.c_str()) != 0) abort();
  return dir;
}

// Runs the tool; returns its exit status, stdout+stderr in *output.
int Ckpt(const std::string& args, std::string* output) {
  const std::string tool =
      std::string(getenv("TEST_SRCDIR")) + "/" + getenv("TEST_WORKSPACE") + "/tools/ckpt";
  FILE* pipe = popen((tool + " " + args + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buf[4096];
  size_t n;
  output->clear();
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) output->append(buf, n);
  int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

state_dict::TensorDict MakeState() {
  state_dict::TensorDict sd;
  sd.insert("layer.weight", torch::randn({5, 3}));
  sd.insert("layer.bias", torch::randn({5}));
  sd.insert("head.weight", torch::randn({2, 5}, torch::kDouble));
  return sd;
}

std::vector<state_dict::ShardedStateDict> Shard(const state_dict::TensorDict& sd, int world) {
  std::vector<state_dict::ShardedStateDict> out(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    for (const auto& item : sd) {
      out[static_cast<size_t>(r)].insert(
          item.key(),
          state_dict::ShardFullTensor(
              item.value(), {state_dict::EvenShardRange(item.value().numel(), world, r)}));
    }
  }
  return out;
}

TEST(CkptToolTest, InspectVerifyConvert) {
  const std::string root = TempDir("ckpt_root");
  const state_dict::TensorDict state = MakeState();
  ASSERT_TRUE(state_dict::SaveShardedCheckpoint(root, 3, Shard(state, 3)).ok());
  ASSERT_TRUE(state_dict::SaveShardedCheckpoint(root, 8, Shard(state, 3)).ok());
  std::string out;

  ASSERT_EQ(Ckpt("inspect " + root, &out), 0) << out;  // root -> latest (step 8)
  EXPECT_NE(out.find("step 8\n"), std::string::npos) << out;
  EXPECT_NE(out.find("world_size 3\n"), std::string::npos) << out;
  EXPECT_NE(out.find("kind sharded"), std::string::npos) << out;
  EXPECT_NE(out.find("layer.weight  Float  [5, 3]  pieces: rank 0 [0, 5), rank 1 [5, 10), "
                     "rank 2 [10, 15)"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("head.weight  Double  [2, 5]"), std::string::npos) << out;

  ASSERT_EQ(Ckpt("verify " + root + "/step_3", &out), 0) << out;
  EXPECT_NE(out.find("OK"), std::string::npos) << out;

  const std::string full = root + "/full.pt";
  ASSERT_EQ(Ckpt("convert " + root + " --to-full " + full, &out), 0) << out;
  auto loaded = state_dict::LoadTensorDict(full);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->tensors.keys(), state.keys());
  for (const auto& item : state) {
    EXPECT_TRUE(torch::equal(loaded->tensors[item.key()], item.value())) << item.key();
  }
  {
    // Python 2.x's torch.load default (weights_only=True) reads it.
    const std::string py = std::string("'") + kTorchPython +
                           "' -c \"import torch; d = torch.load('" + full +
                           "'); assert list(d) == ['layer.weight', 'layer.bias', "
                           "'head.weight'], list(d); assert d['head.weight'].shape == (2, 5)\"";
    EXPECT_EQ(system(py.c_str()), 0);
  }

  // A corrupted rank file: verify and convert fail, naming the file.
  const std::string rank1 = root + "/step_8/rank_00001.pt";
  {
    std::fstream f(rank1, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(40);
    f.put('\x7f');
  }
  EXPECT_EQ(Ckpt("verify " + root, &out), 1);
  EXPECT_NE(out.find(rank1), std::string::npos) << out;
  EXPECT_EQ(Ckpt("convert " + root + " --to-full " + root + "/x.pt", &out), 1);
  EXPECT_NE(out.find(rank1), std::string::npos) << out;

  EXPECT_EQ(Ckpt("inspect", &out), 2);
  EXPECT_NE(out.find("ckpt: inspect: DIR is required"), std::string::npos) << out;
  EXPECT_EQ(Ckpt("frobnicate " + root, &out), 2);
  EXPECT_NE(out.find("ckpt: unknown command 'frobnicate': expected inspect, verify or convert"),
            std::string::npos)
      << out;
  EXPECT_EQ(Ckpt("", &out), 2);
  EXPECT_NE(out.find("ckpt: expected a command"), std::string::npos) << out;
  EXPECT_EQ(Ckpt("convert " + root, &out), 2);
  EXPECT_NE(out.find("ckpt: convert: expected --to-full OUT.pt or --to-safetensors "
                     "OUT.safetensors"),
            std::string::npos)
      << out;
  EXPECT_EQ(Ckpt("convert " + root + " --to-full a.pt --to-safetensors b.safetensors", &out), 2);
  EXPECT_NE(out.find("ckpt: convert: --to-full excludes --to-safetensors"), std::string::npos)
      << out;
  EXPECT_EQ(Ckpt("verify " + root + " extra", &out), 2);
  EXPECT_NE(out.find("extra"), std::string::npos) << out;
  EXPECT_EQ(Ckpt("inspect " + root + "/nothing_here", &out), 1);
  EXPECT_EQ(Ckpt("--help", &out), 0);
  EXPECT_NE(out.find("convert"), std::string::npos) << out;
  EXPECT_EQ(Ckpt("convert --help", &out), 0);
  EXPECT_NE(out.find("--to-full"), std::string::npos) << out;
  EXPECT_NE(out.find("--to-safetensors"), std::string::npos) << out;
  EXPECT_NE(out.find("skips optimizer state"), std::string::npos) << out;
}

// Runs `script` with the venv's Python (which has torch and safetensors:
// tools/setup.sh --with-python); its exit status, stdout+stderr in *output.
int RunPython(const std::string& script, const std::string& args, std::string* output) {
  const std::string path = TempDir("ckpt_python") + "/script.py";
  {
    std::ofstream o(path);
    o << script;
  }
  FILE* pipe =
      popen((std::string("'") + kTorchPython + "' '" + path + "' " + args + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buf[4096];
  size_t n;
  output->clear();
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) output->append(buf, n);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

void ExpectModelWeights(const std::string& path, const state_dict::TensorDict& model) {
  auto loaded = formats::LoadSafetensors(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->tensors.keys(), model.keys());
  for (const auto& item : model) {
    EXPECT_TRUE(torch::equal(loaded->tensors[item.key()], item.value())) << item.key();
  }
  EXPECT_EQ(loaded->metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
}

// --to-safetensors writes the model's weights of a sharded checkpoint
// (assembled from its 3 ranks) without the optimizer state and the trainer's
// entries; Python's safetensors reads the same tensors that --to-full wrote.
TEST(CkptToolTest, ConvertToSafetensorsWritesModelWeightsOnly) {
  const std::string root = TempDir("ckpt_safetensors");
  const state_dict::TensorDict model = MakeState();
  state_dict::TensorDict everything = model;  // as the trainer's sharded checkpoints
  everything.insert("layer.weight/exp_avg", torch::randn({5, 3}));
  everything.insert("layer.weight/step", torch::tensor({4.0f}));
  everything.insert("trainer.step", torch::tensor({4}, torch::kInt64));
  everything.insert("trainer.seed", torch::tensor({1}, torch::kInt64));
  ASSERT_TRUE(state_dict::SaveShardedCheckpoint(root, 4, Shard(everything, 3)).ok());
  std::string out;
  const std::string weights = root + "/model.safetensors";
  ASSERT_EQ(Ckpt("convert " + root + " --to-safetensors " + weights, &out), 0) << out;
  EXPECT_NE(out.find("wrote " + weights + ": 3 model tensors from " + root +
                     "/step_4 (skipped 4 entries of optimizer state and the trainer's step "
                     "and seed)"),
            std::string::npos)
      << out;
  ExpectModelWeights(weights, model);

  const std::string full = root + "/full.pt";
  ASSERT_EQ(Ckpt("convert " + root + " --to-full " + full, &out), 0) << out;
  ASSERT_EQ(RunPython(R"(
import sys
import torch
from safetensors import safe_open
from safetensors.torch import load_file
weights, full = load_file(sys.argv[1]), torch.load(sys.argv[2])
assert sorted(weights) == ["head.weight", "layer.bias", "layer.weight"], list(weights)
assert len(full) == 7, list(full)
for name, t in weights.items():
    assert t.dtype == full[name].dtype and torch.equal(t, full[name]), name
with safe_open(sys.argv[1], framework="pt") as f:
    assert f.metadata() == {"format": "pt"}, f.metadata()
print("ok")
)",
                      "'" + weights + "' '" + full + "'", &out),
            0)
      << out;

  // The trainer's FULL layout: "model." entries, without the prefix.
  state_dict::TensorDict trainer_full;
  for (const auto& item : model) trainer_full.insert("model." + item.key(), item.value());
  trainer_full.insert("optim.layer.weight.exp_avg", torch::randn({5, 3}));
  trainer_full.insert("trainer.step", torch::tensor({9}, torch::kInt64));
  trainer_full.insert("trainer.seed", torch::tensor({1}, torch::kInt64));
  ASSERT_TRUE(state_dict::SaveFullCheckpoint(root, 9, trainer_full).ok());
  ASSERT_EQ(Ckpt("convert " + root + " --to-safetensors " + weights, &out), 0) << out;
  EXPECT_NE(out.find(": 3 model tensors from " + root + "/step_9 (skipped 3 entries"),
            std::string::npos)
      << out;
  ExpectModelWeights(weights, model);

  // Nothing but optimizer state: an error, no file.
  state_dict::TensorDict optimizer_only;
  optimizer_only.insert("w/exp_avg", torch::zeros({2}));
  ASSERT_TRUE(state_dict::SaveFullCheckpoint(root, 10, optimizer_only).ok());
  EXPECT_EQ(Ckpt("convert " + root + " --to-safetensors " + root + "/none.safetensors", &out), 1);
  EXPECT_NE(out.find("ckpt: " + root +
                     "/step_10 holds no model weights: its 1 entries are "
                     "all optimizer state or the trainer's"),
            std::string::npos)
      << out;
  EXPECT_NE(access((root + "/none.safetensors").c_str(), F_OK), 0);
}

// verify used to stop at checksums: a MANIFEST whose piece offset moved by
// one passed verify and then failed the load. Now verify runs the same
// manifest checks as every load.
TEST(CkptToolTest, VerifyRejectsWhatLoadingRejects) {
  const std::string root = TempDir("ckpt_offset");
  ASSERT_TRUE(state_dict::SaveShardedCheckpoint(root, 2, Shard(MakeState(), 2)).ok());
  const std::string dir = root + "/step_2";
  // The ranks' .meta files do not outlive the commit: nothing reads them,
  // so no unchecked file is left in the checkpoint.
  EXPECT_NE(access((dir + "/rank_00000.meta").c_str(), F_OK), 0);
  EXPECT_NE(access((dir + "/rank_00001.meta").c_str(), F_OK), 0);
  std::string out;
  ASSERT_EQ(Ckpt("verify " + dir, &out), 0) << out;

  const std::string manifest_path = dir + "/MANIFEST";
  // Rank 1's piece of layer.weight (15 elements) starts at 8; move it to 9,
  // and reseal the MANIFEST (its own checksum would catch a bare edit) so
  // that the field checks are what speaks.
  auto manifest = state_dict::ReadManifest(dir);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  bool moved = false;
  for (auto& f : manifest->files) {
    for (auto& t : f.tensors) {
      if (f.rank == 1 && t.name == "layer.weight" && t.range.offset == 8) {
        t.range.offset = 9;
        moved = true;
      }
    }
  }
  ASSERT_TRUE(moved) << state_dict::FormatManifest(*manifest);
  {
    std::ofstream o(manifest_path, std::ios::trunc);
    o << state_dict::FormatManifest(*manifest);
  }
  EXPECT_EQ(Ckpt("verify " + dir, &out), 1) << out;
  EXPECT_NE(out.find("manifest " + manifest_path +
                     ": tensor 'layer.weight' in file "
                     "rank_00001.pt: its piece of 7 elements at offset 9 lies outside "
                     "its 15 elements"),
            std::string::npos)
      << out;
  std::string convert_out;
  EXPECT_EQ(Ckpt("convert " + dir + " --to-full " + root + "/x.pt", &convert_out), 1);
  EXPECT_EQ(convert_out, out);  // the same check, the same message
}

// Issue 27: a MANIFEST edited by hand (a shape changed to another of the
// same element count, which a sharded checkpoint's 1-D pieces cannot
// contradict) or damaged into an absurd world size. verify, convert and
// every load refuse it with the manifest's checksum; nothing is sized by
// the edited numbers.
TEST(CkptToolTest, EditedManifestIsRefusedByVerifyAndConvert) {
  const std::string root = TempDir("ckpt_edited");
  ASSERT_TRUE(state_dict::SaveShardedCheckpoint(root, 2, Shard(MakeState(), 2)).ok());
  const std::string dir = root + "/step_2";
  const std::string manifest_path = dir + "/MANIFEST";
  std::string pristine;
  {
    std::ifstream in(manifest_path);
    pristine.assign(std::istreambuf_iterator<char>(in), {});
  }
  struct Edit {
    std::string from, to;
  };
  for (const Edit& edit : {Edit{"shape 5,3 ", "shape 3,5 "}, Edit{"shape 5,3 ", "shape 15 "},
                           Edit{"world_size 2\n", "world_size 2000000000\n"}}) {
    SCOPED_TRACE(edit.from + " -> " + edit.to);
    std::string edited = pristine;
    size_t at = 0;
    while ((at = edited.find(edit.from, at)) != std::string::npos) {
      edited.replace(at, edit.from.size(), edit.to);
      at += edit.to.size();
    }
    ASSERT_NE(edited, pristine);
    {
      std::ofstream o(manifest_path, std::ios::trunc);
      o << edited;
    }
    std::string out, convert_out;
    EXPECT_EQ(Ckpt("verify " + dir, &out), 1) << out;
    EXPECT_NE(out.find("manifest " + manifest_path + " is damaged: its "), std::string::npos)
        << out;
    EXPECT_EQ(Ckpt("convert " + dir + " --to-full " + root + "/x.pt", &convert_out), 1);
    EXPECT_EQ(convert_out, out);
    EXPECT_FALSE(state_dict::LoadFullStateDict(dir).ok());
  }
}

// The DCP directories Python's FSDP1 (SHARDED_STATE_DICT) and FSDP2 wrote
// (tools/golden/dcp_fixtures.py): ckpt lists the tensors and values
// Python's dcp_to_torch_save gives, and converts to the same tensors.
std::string Fixture(const std::string& name) {
  return std::string(getenv("TEST_SRCDIR")) + "/" + getenv("TEST_WORKSPACE") + "/tools/testdata/" +
         name;
}

std::vector<std::string> ReadLinesOf(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) lines.push_back(line);
  }
  return lines;
}

// `ckpt inspect`'s tensors and objects as the fixture's expected.txt
// spells them: "tensor KEY DTYPE [SHAPE]", "object KEY", sorted.
std::vector<std::string> ListedEntries(const std::string& inspect_output) {
  std::vector<std::string> out;
  std::istringstream in(inspect_output);
  std::string section;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("tensors ", 0) == 0) section = "tensor";
    if (line.rfind("objects ", 0) == 0) section = "object";
    if (line.rfind("  ", 0) != 0 || (section != "tensor" && section != "object")) continue;
    std::vector<std::string> fields;
    for (size_t at = 2; at < line.size();) {
      const size_t end = line.find("  ", at);
      fields.push_back(line.substr(at, end == std::string::npos ? std::string::npos : end - at));
      at = end == std::string::npos ? line.size() : end + 2;
    }
    if (section == "tensor" && fields.size() >= 3) {
      out.push_back("tensor " + fields[0] + " " + fields[1] + " " + fields[2]);
    } else if (section == "object" && !fields.empty()) {
      out.push_back("object " + fields[0]);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

class CkptDcpTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CkptDcpTest, ListsVerifiesAndConvertsWhatPythonSaved) {
  const std::string dir = Fixture(GetParam());
  std::string out;
  ASSERT_EQ(Ckpt("inspect " + dir, &out), 0) << out;
  EXPECT_NE(out.find("kind dcp"), std::string::npos) << out;
  EXPECT_EQ(ListedEntries(out), ReadLinesOf(dir + ".expected.txt")) << out;
  // Two ranks saved each parameter's rows: two chunks, one per file.
  EXPECT_NE(out.find("  model.0.weight  Float  [6, 4]  chunks: [0, 0]+[3, 4] in __0_0.distcp"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("[3, 0]+[3, 4] in __1_0.distcp"), std::string::npos) << out;

  ASSERT_EQ(Ckpt("verify " + dir, &out), 0) << out;
  EXPECT_NE(out.find("OK " + dir + ": 16 tensors"), std::string::npos) << out;

  const std::string root = TempDir("dcp_convert_" + GetParam());
  ASSERT_EQ(Ckpt("convert " + dir + " --to-full " + root + "/full.pt", &out), 0) << out;
  auto ours = state_dict::LoadTensorDict(root + "/full.pt");
  auto python = state_dict::LoadTensorDict(dir + ".expected.pt");
  ASSERT_TRUE(ours.ok()) << ours.status();
  ASSERT_TRUE(python.ok()) << python.status();
  ASSERT_EQ(ours->tensors.size(), python->tensors.size());
  for (const auto& item : python->tensors) {
    const torch::Tensor* mine = ours->tensors.find(item.key());
    ASSERT_NE(mine, nullptr) << item.key();
    EXPECT_TRUE(torch::equal(*mine, item.value())) << item.key();
  }
  ASSERT_EQ(Ckpt("convert " + dir + " --to-safetensors " + root + "/model.safetensors", &out), 0)
      << out;
  auto weights = formats::LoadSafetensors(root + "/model.safetensors");
  ASSERT_TRUE(weights.ok()) << weights.status();
  ASSERT_EQ(weights->tensors.size(), 4u);
  EXPECT_TRUE(torch::equal(weights->tensors["0.weight"], python->tensors["model.0.weight"]));
}

INSTANTIATE_TEST_SUITE_P(Fsdp, CkptDcpTest, ::testing::Values("dcp_fsdp1", "dcp_fsdp2"));

TEST(CkptDcpTest, MissingOrTruncatedChunksAreClearErrors) {
  const std::string root = TempDir("dcp_damaged");
  const std::string dir = root + "/dcp";
  // -L: the runfiles are links to the source tree, which must stay whole.
  const std::string copy =
      "cp -rL '" + Fixture("dcp_fsdp2") + "' '" + dir + "' && chmod -R u+w '" + dir + "'";
  ASSERT_EQ(system(copy.c_str()), 0);
  ASSERT_EQ(truncate((dir + "/__1_0.distcp").c_str(), 1000), 0);
  std::string out;
  EXPECT_EQ(Ckpt("verify " + dir, &out), 1) << out;
  EXPECT_NE(out.find("ckpt: "), std::string::npos) << out;
  EXPECT_NE(out.find("__1_0.distcp"), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;  // one line
  EXPECT_EQ(Ckpt("convert " + dir + " --to-full " + root + "/x.pt", &out), 1) << out;
  EXPECT_NE(out.find("__1_0.distcp"), std::string::npos) << out;

  ASSERT_EQ(unlink((dir + "/__1_0.distcp").c_str()), 0);
  EXPECT_EQ(Ckpt("verify " + dir, &out), 1) << out;
  EXPECT_NE(out.find("__1_0.distcp"), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
}

}  // namespace
