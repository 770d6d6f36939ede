// The data sampler and the models: determinism, world-size independence,
// tied weights, the causal mask and the single block call site.
#include <sys/stat.h>

#include <cmath>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include <torch/types.h>
#include <torch/utils.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/data.h"
#include "trainer/models.h"

namespace trainer {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

const std::vector<uint8_t>& Corpus() {
  static const auto* corpus = [] {
    auto loaded = LoadTextCorpus();
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    return new std::vector<uint8_t>(loaded.ok() ? *loaded : std::vector<uint8_t>{});
  }();
  return *corpus;
}

TEST(CorpusTest, EveryLicenseFileOnceSymlinksNotDuplicated) {
  // Expected size: the regular files, plus symlinks to targets outside the
  // directory (none on Debian 12, but the rule is "each target once").
  namespace fs = std::filesystem;
  std::set<std::pair<dev_t, ino_t>> seen;
  uintmax_t expected = 0;
  for (const auto& entry : fs::directory_iterator(kLicenseDir)) {
    struct stat st {};
    ASSERT_EQ(::stat(entry.path().c_str(), &st), 0);
    if (S_ISREG(st.st_mode) && seen.insert({st.st_dev, st.st_ino}).second) {
      expected += static_cast<uintmax_t>(st.st_size);
    }
  }
  EXPECT_EQ(Corpus().size(), expected);
  EXPECT_GT(Corpus().size(), 100000u);  // the license texts are ~240 KB
  const std::string text(Corpus().begin(), Corpus().end());
  EXPECT_THAT(text, HasSubstr("GNU GENERAL PUBLIC LICENSE"));

  auto missing = LoadTextCorpus("/nonexistent-dir");
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("/nonexistent-dir"));
}

TEST(SamplerTest, SameSeedAndStepSameBatchOtherStepOtherBatch) {
  BatchSpec spec{7, 3, 8, 17, 0, 1};
  auto a = SampleTextBatch(Corpus(), spec);
  auto b = SampleTextBatch(Corpus(), spec);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->sizes(), (std::vector<int64_t>{8, 17}));
  EXPECT_EQ(a->dtype(), torch::kInt64);
  EXPECT_TRUE(torch::equal(*a, *b));
  spec.step = 4;
  EXPECT_FALSE(torch::equal(*a, *SampleTextBatch(Corpus(), spec)));
  spec.step = 3;
  spec.seed = 8;
  EXPECT_FALSE(torch::equal(*a, *SampleTextBatch(Corpus(), spec)));
  // Rows are consecutive corpus bytes.
  EXPECT_GE(a->min().item<int64_t>(), 0);
  EXPECT_LT(a->max().item<int64_t>(), 256);
}

TEST(SamplerTest, RanksPartitionTheGlobalBatchForEveryWorldSize) {
  for (bool synthetic : {false, true}) {
    BatchSpec spec{1, 5, 12, 9, 0, 1};
    auto sample = [&](const BatchSpec& s) {
      return synthetic ? SampleSyntheticBatch(256, s) : SampleTextBatch(Corpus(), s);
    };
    const torch::Tensor whole = *sample(spec);
    for (int world : {2, 3, 4, 6, 12}) {
      std::vector<torch::Tensor> parts;
      for (int rank = 0; rank < world; ++rank) {
        spec.rank = rank;
        spec.world_size = world;
        auto part = sample(spec);
        ASSERT_TRUE(part.ok()) << part.status();
        EXPECT_EQ(part->size(0), 12 / world);
        parts.push_back(*part);
      }
      EXPECT_TRUE(torch::equal(torch::cat(parts), whole)) << "world " << world;
    }
  }
}

TEST(SamplerTest, IndivisibleGlobalBatchNamesBoth) {
  BatchSpec spec{0, 1, 10, 5, 0, 4};
  auto s = SampleTextBatch(Corpus(), spec);
  EXPECT_THAT(std::string(s.status().message()),
              AllOf(HasSubstr("global batch 10"), HasSubstr("world size 4")));
}

// benchmarks/torchtitan/synthetic_tokens.py reproduces these batches so
// that TorchTitan trains on our tokens; both hold to the same values.
TEST(SamplerTest, SyntheticBatchesArePinned) {
  struct Case {
    BatchSpec spec;
    int64_t vocab;
    std::vector<int64_t> rows;
  };
  const std::vector<Case> cases = {
      {{0, 1, 2, 5, 0, 1},
       32000,
       {8503, 25159, 22545, 4616, 9050, 15241, 5872, 15186, 13348, 5303}},
      {{7, 3, 3, 4, 0, 1},
       128256,
       {39161, 29351, 58593, 32362, 44658, 37890, 36703, 117420, 65456, 6413, 53811, 124315}},
      {{0, -2, 2, 3, 0, 1}, 256, {76, 19, 103, 6, 215, 34}},
  };
  for (const Case& c : cases) {
    auto batch = SampleSyntheticBatch(c.vocab, c.spec);
    ASSERT_TRUE(batch.ok()) << batch.status();
    const torch::Tensor flat = batch->flatten();
    EXPECT_EQ(
        std::vector<int64_t>(flat.data_ptr<int64_t>(), flat.data_ptr<int64_t>() + flat.numel()),
        c.rows)
        << "seed " << c.spec.seed << " step " << c.spec.step;
  }
}
ModelConfig Tiny() { return ModelConfig{2, 16, 2, 256, 8}; }

TEST(ModelTest, InitDependsOnlyOnSeed) {
  auto a = BuildModel(ModelType::kTransformer, Tiny(), 5);
  auto b = BuildModel(ModelType::kTransformer, Tiny(), 5);
  auto c = BuildModel(ModelType::kTransformer, Tiny(), 6);
  auto pa = a->named_parameters(), pb = b->named_parameters(), pc = c->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  bool any_differs = false;
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i].key(), pb[i].key());
    EXPECT_TRUE(torch::equal(pa[i].value(), pb[i].value())) << pa[i].key();
    any_differs |= !torch::equal(pa[i].value(), pc[i].value());
  }
  EXPECT_TRUE(any_differs);
}

TEST(ModelTest, OutputProjectionIsTiedToTheTokenEmbedding) {
  auto model = std::make_shared<TransformerLM>(Tiny());
  // One parameter, not two: no other parameter has the embedding's storage.
  const torch::Tensor emb = model->token_embedding()->weight;
  int sharing = 0;
  for (const auto& p : model->parameters()) {
    if (p.storage().data() == emb.storage().data()) ++sharing;
  }
  EXPECT_EQ(sharing, 1);

  // The gradient is the sum of the input-embedding and output-projection
  // uses: it reaches rows of tokens that never appear as input (only the
  // projection touches them), and it differs from the gradient with the
  // projection's use detached.
  torch::Tensor tokens = torch::tensor({{1, 2, 3, 4}}, torch::kInt64);
  model->forward(tokens).sum().backward();
  const torch::Tensor full_grad = emb.grad().clone();
  EXPECT_GT(full_grad[200].abs().sum().item<double>(), 0);  // never an input

  model->zero_grad();
  torch::Tensor h = model->token_embedding()->forward(tokens);
  // Same gradient through the embedding lookup alone is zero on row 200.
  h.sum().backward();
  EXPECT_EQ(emb.grad()[200].abs().sum().item<double>(), 0);
}

TEST(ModelTest, TransformerIsCausal) {
  auto model = std::make_shared<TransformerLM>(Tiny());
  model->eval();
  torch::NoGradGuard no_grad;
  torch::Tensor a = torch::tensor({{10, 20, 30, 40, 50, 60, 70, 80}}, torch::kInt64);
  torch::Tensor b = a.clone();
  b.index_put_({0, torch::indexing::Slice(5)}, torch::tensor({1, 2, 3}));
  torch::Tensor la = model->forward(a), lb = model->forward(b);
  // Positions 0..4 saw identical prefixes: identical outputs.
  EXPECT_TRUE(torch::allclose(la.narrow(1, 0, 5), lb.narrow(1, 0, 5), 0, 0));
  EXPECT_FALSE(torch::allclose(la.narrow(1, 5, 3), lb.narrow(1, 5, 3)));

  EXPECT_TRUE(torch::equal(
      CausalMask(3).isinf(),
      torch::tensor({{false, true, true}, {false, false, true}, {false, false, false}})));
}

TEST(ModelTest, BlocksAreCalledThroughTheBlockRunner) {
  auto model = std::make_shared<TransformerLM>(Tiny());
  torch::NoGradGuard no_grad;
  torch::Tensor tokens = torch::randint(256, {2, 8}, torch::kInt64);
  const torch::Tensor direct = model->forward(tokens);
  std::vector<int64_t> calls;
  model->set_block_runner([&](int64_t index, TransformerBlock& block, const torch::Tensor& x,
                              const torch::Tensor& mask) {
    calls.push_back(index);
    return block(x, mask);
  });
  EXPECT_TRUE(torch::equal(model->forward(tokens), direct));
  EXPECT_EQ(calls, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(model->blocks()->size(), 2u);
}

// SDPA attention (the default) computes what LibTorch's MultiheadAttention
// with CausalMask computed before issue 36, from the same parameters under
// the same names: same losses and gradients within float rounding; a mask
// of the wrong shape is an error.
TEST(ModelTest, SdpaAttentionEqualsMultiheadAttention) {
  ModelConfig sdpa_config = Tiny();
  ModelConfig mha_config = Tiny();
  mha_config.attention = AttentionKernel::kMultiheadAttention;
  auto sdpa = BuildModel(ModelType::kTransformer, sdpa_config, 7);
  auto mha = BuildModel(ModelType::kTransformer, mha_config, 7);
  const auto sdpa_params = sdpa->named_parameters(), mha_params = mha->named_parameters();
  ASSERT_EQ(sdpa_params.keys(), mha_params.keys());
  EXPECT_TRUE(sdpa_params.contains("blocks.0.attn.in_proj_weight"));
  EXPECT_TRUE(sdpa_params.contains("blocks.1.attn.out_proj.bias"));
  for (const auto& item : sdpa_params) {
    EXPECT_TRUE(torch::equal(item.value(), mha_params[item.key()])) << item.key();
  }
  BatchSpec spec{0, 1, 3, Tiny().seq + 1, 0, 1};
  const torch::Tensor batch = *SampleTextBatch(Corpus(), spec);
  torch::Tensor a = sdpa->Loss(batch), b = mha->Loss(batch);
  EXPECT_NEAR(a.item<double>(), b.item<double>(), 1e-5);
  a.backward();
  b.backward();
  for (const auto& item : sdpa_params) {
    const torch::Tensor& g = item.value().grad();
    const torch::Tensor& want = mha_params[item.key()].grad();
    EXPECT_TRUE(torch::allclose(g, want, 1e-4, 1e-6))
        << item.key() << ": max |diff| " << (g - want).abs().max().item<double>();
  }

  auto block =
      std::dynamic_pointer_cast<TransformerLM>(sdpa)->blocks()->ptr<TransformerBlockImpl>(0);
  try {
    block->forward(torch::randn({2, 6, Tiny().dim}), CausalMask(5));
    ADD_FAILURE() << "no error for a [5, 5] mask on 6 positions";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(),
                HasSubstr("TransformerBlock: causal_mask of shape [5, 5]: expected CausalMask(6), "
                          "[6, 6]"));
  }
}

TEST(ModelTest, LossesAreFiniteAndNearUniformAtInit) {
  for (ModelType type : {ModelType::kTransformer, ModelType::kMlp}) {
    auto model = BuildModel(type, Tiny(), 0);
    BatchSpec spec{0, 1, 4, Tiny().seq + 1, 0, 1};
    torch::Tensor loss = model->Loss(*SampleTextBatch(Corpus(), spec));
    EXPECT_EQ(loss.dim(), 0);
    // ln(256) = 5.545: an untrained model is close to uniform.
    EXPECT_NEAR(loss.item<double>(), std::log(256.0), 0.5);
  }
}

}  // namespace
}  // namespace trainer
