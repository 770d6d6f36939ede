// The key/value cache and generation against transformers: greedy
// generate() of tools/golden/llama_golden.py (generate.prompt_a/greedy_a,
// prompt_b/greedy_b: 8 new tokens) token for token with the cache and
// without, alone and as one left-padded batch; the cached logits against the
// full forward's at every position; sampling from a seed; the refusals.
#include "models/generation.h"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "models/kv_cache.h"
#include "models/llama.h"
#include "models/testing/golden_cases.h"
#include "testing/golden_fixture.h"

namespace models {
namespace {

// The full forward and the cached one differ in matmul shapes (one row
// against many), so in the reduction order: float32 noise, as in
// llama_test's kLogitTol.
constexpr double kLogitTol = 1e-4;

using testing::CaseDir;
using testing::LoadModel;

std::vector<int64_t> Row(const torch::Tensor& t) {
  const torch::Tensor c = t.reshape({-1}).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

double MaxAbsDiff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

std::vector<std::vector<int64_t>> Tokens(const std::vector<Generated>& out) {
  std::vector<std::vector<int64_t>> tokens;
  for (const auto& g : out) tokens.push_back(g.tokens);
  return tokens;
}

struct GoldenGreedy {
  std::vector<int64_t> prompt_a, new_a, prompt_b, new_b;
  // The script's generate() ran with pad_token_id 0 and no attention mask,
  // so transformers took every 0 in a prompt for padding and masked it
  // (_prepare_attention_mask_for_generation): qwen2's prompt_b has a 0 at
  // index 7, and its greedy_b is that masked prompt's continuation (with an
  // all-ones mask transformers gives ours, 16 52 14 82 81 36 26 79). Such a
  // prompt is not compared.
  bool b_has_pad = false;
};

GoldenGreedy ReadGreedy(const std::string& name) {
  const test_data::GoldenFixture golden(CaseDir(name) + "/golden.pt");
  GoldenGreedy g;
  g.prompt_a = Row(golden["generate.prompt_a"]);
  g.prompt_b = Row(golden["generate.prompt_b"]);
  const std::vector<int64_t> a = Row(golden["generate.greedy_a"]);
  const std::vector<int64_t> b = Row(golden["generate.greedy_b"]);
  // transformers returns the prompt followed by the new tokens.
  EXPECT_EQ(std::vector<int64_t>(a.begin(), a.begin() + g.prompt_a.size()), g.prompt_a);
  g.new_a.assign(a.begin() + g.prompt_a.size(), a.end());
  g.new_b.assign(b.begin() + g.prompt_b.size(), b.end());
  g.b_has_pad = std::find(g.prompt_b.begin(), g.prompt_b.end(), 0) != g.prompt_b.end();
  EXPECT_EQ(std::find(g.prompt_a.begin(), g.prompt_a.end(), 0), g.prompt_a.end());
  return g;
}

class GenerationGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(GenerationGolden, GreedyEqualsTransformersAloneAndBatchedWithAndWithoutCache) {
  LlamaForCausalLM model = LoadModel(GetParam());
  const GoldenGreedy golden = ReadGreedy(GetParam());
  ASSERT_EQ(golden.new_a.size(), 8u);
  ASSERT_NE(golden.prompt_a.size(), golden.prompt_b.size());
  for (bool use_cache : {true, false}) {
    SCOPED_TRACE(use_cache ? "with the cache" : "without the cache");
    GenerationOptions options;
    options.max_new_tokens = 8;
    options.use_cache = use_cache;
    auto a = Generate(*model, {golden.prompt_a}, options);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ((*a)[0].tokens, golden.new_a);
    EXPECT_EQ((*a)[0].stop, Generated::Stop::kLength);
    auto b = Generate(*model, {golden.prompt_b}, options);
    ASSERT_TRUE(b.ok()) << b.status();
    // Batched, each row must be its unbatched result in any case.
    const std::vector<int64_t> new_b = golden.b_has_pad ? (*b)[0].tokens : golden.new_b;
    EXPECT_EQ((*b)[0].tokens, new_b);
    // One batch, the shorter prompt left-padded (with a real token id, so
    // that the mask, not the id, is what keeps it out), in both orders.
    options.pad_id = golden.prompt_b[0];
    auto ab = Generate(*model, {golden.prompt_a, golden.prompt_b}, options);
    ASSERT_TRUE(ab.ok()) << ab.status();
    EXPECT_EQ(Tokens(*ab), (std::vector<std::vector<int64_t>>{golden.new_a, new_b}));
    auto ba = Generate(*model, {golden.prompt_b, golden.prompt_a}, options);
    ASSERT_TRUE(ba.ok()) << ba.status();
    EXPECT_EQ(Tokens(*ba), (std::vector<std::vector<int64_t>>{new_b, golden.new_a}));
  }
}

// Prefill of a prefix, then one token at a time: every position's logits are
// the full forward's, for each row of a batch, and for a row left-padded by
// three tokens.
TEST_P(GenerationGolden, CachedLogitsEqualTheFullForwardAtEveryPosition) {
  LlamaForCausalLM model = LoadModel(GetParam());
  torch::NoGradGuard no_grad;
  const test_data::GoldenFixture golden(CaseDir(GetParam()) + "/golden.pt");
  const torch::Tensor batch = golden["batch"];
  const torch::Tensor input = batch.narrow(1, 0, batch.size(1) - 1);
  const int64_t rows = input.size(0), length = input.size(1), prefix = 3;
  const torch::Tensor full = model->forward(input);

  KvCache cache(model->config(), rows, length, torch::kCPU, torch::kFloat);
  // The prefix, two tokens at once after it (a causal mask offset by the
  // prefix), then one at a time.
  std::vector<torch::Tensor> steps = {model->ForwardCached(input.narrow(1, 0, prefix), {}, &cache),
                                      model->ForwardCached(input.narrow(1, prefix, 2), {}, &cache)};
  for (int64_t t = prefix + 2; t < length; ++t) {
    steps.push_back(model->ForwardCached(input.narrow(1, t, 1), {}, &cache));
  }
  EXPECT_EQ(cache.length(), length);
  EXPECT_LE(MaxAbsDiff(torch::cat(steps, 1), full), kLogitTol);

  // Row 0 behind three pads (id 0, masked), row 1 unpadded but cut by three
  // at the end: each row's logits at its real positions are the full ones.
  const int64_t pads = 3;
  torch::Tensor padded = torch::zeros({2, length}, torch::kLong);
  padded[0].narrow(0, pads, length - pads).copy_(input[0].narrow(0, 0, length - pads));
  padded[1].copy_(input[1]);
  torch::Tensor mask = torch::ones({2, length}, torch::kBool);
  mask[0].narrow(0, 0, pads).fill_(false);
  KvCache padded_cache(model->config(), 2, length, torch::kCPU, torch::kFloat);
  std::vector<torch::Tensor> padded_steps = {model->ForwardCached(
      padded.narrow(1, 0, pads + prefix), mask.narrow(1, 0, pads + prefix), &padded_cache)};
  for (int64_t t = pads + prefix; t < length; ++t) {
    padded_steps.push_back(model->ForwardCached(padded.narrow(1, t, 1), {}, &padded_cache));
  }
  const torch::Tensor got = torch::cat(padded_steps, 1);
  EXPECT_LE(MaxAbsDiff(got[0].narrow(0, pads, length - pads), full[0].narrow(0, 0, length - pads)),
            kLogitTol);
  EXPECT_LE(MaxAbsDiff(got[1], full[1]), kLogitTol);
  EXPECT_TRUE(torch::equal(padded_cache.seen(), torch::tensor({length - pads, length})));

  // Without a cache, the masked path over the whole padded batch at once.
  const torch::Tensor whole = model->ForwardCached(padded, mask, nullptr);
  EXPECT_LE(
      MaxAbsDiff(whole[0].narrow(0, pads, length - pads), full[0].narrow(0, 0, length - pads)),
      kLogitTol);
}

INSTANTIATE_TEST_SUITE_P(Cases, GenerationGolden,
                         ::testing::Values("llama3_gqa", "qwen3", "llama_tied", "qwen2",
                                           "mistral"));

TEST(Generation, SampledRunIsReproducibleFromItsSeed) {
  LlamaForCausalLM model = LoadModel("llama3_gqa");
  const GoldenGreedy golden = ReadGreedy("llama3_gqa");
  GenerationOptions options;
  options.max_new_tokens = 24;
  options.temperature = 1.5;
  options.top_k = 50;
  options.top_p = 0.95;
  options.seed = 7;
  const std::vector<std::vector<int64_t>> prompts = {golden.prompt_a, golden.prompt_b};
  auto first = Generate(*model, prompts, options);
  auto second = Generate(*model, prompts, options);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(Tokens(*first), Tokens(*second));
  options.use_cache = false;
  auto uncached = Generate(*model, prompts, options);
  ASSERT_TRUE(uncached.ok());
  EXPECT_EQ(Tokens(*uncached), Tokens(*first));
  options.use_cache = true;
  options.seed = 8;
  auto other = Generate(*model, prompts, options);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(Tokens(*other), Tokens(*first));
}

TEST(Generation, TopKOneAndTinyTopPAreGreedy) {
  LlamaForCausalLM model = LoadModel("qwen3");
  const GoldenGreedy golden = ReadGreedy("qwen3");
  GenerationOptions options;
  options.max_new_tokens = 8;
  options.temperature = 0.7;
  options.top_k = 1;
  auto top_k = Generate(*model, {golden.prompt_a}, options);
  ASSERT_TRUE(top_k.ok());
  EXPECT_EQ((*top_k)[0].tokens, golden.new_a);
  options.top_k = 0;
  options.top_p = 1e-6;
  auto top_p = Generate(*model, {golden.prompt_a}, options);
  ASSERT_TRUE(top_p.ok());
  EXPECT_EQ((*top_p)[0].tokens, golden.new_a);
}

TEST(Generation, StopsAtEosPerRow) {
  LlamaForCausalLM model = LoadModel("llama3_gqa");
  const GoldenGreedy golden = ReadGreedy("llama3_gqa");
  GenerationOptions options;
  options.max_new_tokens = 8;
  // Row a's third new token is its EOS; row b runs on to its length unless
  // the same id comes up in it.
  options.eos_ids = {golden.new_a[2]};
  auto out = Generate(*model, {golden.prompt_a, golden.prompt_b}, options);
  ASSERT_TRUE(out.ok());
  const auto first_eos = std::find(golden.new_a.begin(), golden.new_a.end(), golden.new_a[2]);
  EXPECT_EQ((*out)[0].tokens, std::vector<int64_t>(golden.new_a.begin(), first_eos + 1));
  EXPECT_EQ((*out)[0].stop, Generated::Stop::kEos);
  const auto b_eos = std::find(golden.new_b.begin(), golden.new_b.end(), golden.new_a[2]);
  EXPECT_EQ(
      (*out)[1].tokens,
      std::vector<int64_t>(golden.new_b.begin(), b_eos == golden.new_b.end() ? b_eos : b_eos + 1));
}

// Generate runs under InferenceMode; the RoPE tables it leaves in the model's
// cache must still serve a training forward and backward of the same length.
TEST(Generation, TrainingAfterGenerationStillBackpropagates) {
  LlamaForCausalLM model = LoadModel("qwen3");
  GenerationOptions options;
  options.max_new_tokens = 2;
  ASSERT_TRUE(Generate(*model, {{1, 2, 3}}, options).ok());
  const int64_t positions = model->config().max_position_embeddings;
  const torch::Tensor batch = torch::randint(0, 112, {1, positions + 1}, torch::kLong);
  model->Loss(batch).backward();
  EXPECT_TRUE(model->model->embed_tokens->weight.grad().defined());
}

TEST(Generation, BadInputIsRefused) {
  LlamaForCausalLM model = LoadModel("qwen3");  // vocab 112, 256 positions
  GenerationOptions options;
  auto message = [&](const std::vector<std::vector<int64_t>>& prompts) {
    auto out = Generate(*model, prompts, options);
    EXPECT_FALSE(out.ok());
    return out.ok() ? std::string() : std::string(out.status().message());
  };
  EXPECT_NE(message({{1, 2}, {3, 112}}).find("prompt 1: id 112 at index 1"), std::string::npos);
  EXPECT_NE(message({{1}, {}}).find("prompt 1 is empty"), std::string::npos);
  EXPECT_NE(message({}).find("no prompts"), std::string::npos);
  options.max_new_tokens = 250;
  EXPECT_NE(message({std::vector<int64_t>(7, 1)}).find("max_position_embeddings 256"),
            std::string::npos);
  options.max_new_tokens = 8;
  options.top_p = 0;
  EXPECT_NE(message({{1}}).find("top_p 0"), std::string::npos);
  options.top_p = 1;
  options.eos_ids = {500};
  EXPECT_NE(message({{1}}).find("EOS id 500"), std::string::npos);
}

}  // namespace
}  // namespace models
