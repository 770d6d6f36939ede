// The tokenizer against Python `tokenizers` 0.23.3: the fixtures of
// tools/golden/tokenizer_golden.py (tokenizer/testdata/), six tokenizer.json
// files (GPT-2's, Llama 3's and Qwen2's layouts, GPT-2's with
// add_prefix_space, and two exercising the added tokens' options, NFKC,
// unk_token and missing bytes), each with the ids `tokenizers` gives for
// every test string, with and without add_special_tokens, and what its
// decode gives back.
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tokenizer/testing/golden.h"
#include "tokenizer/tokenizer.h"

namespace tokenizer {
namespace {

using test_data::Ids;
using test_data::IdsDifference;
using test_data::TestdataPath;
using json = nlohmann::json;

class GoldenTest : public testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    strings_ = test_data::ReadTestdataJson("strings.json").get<std::vector<std::string>>();
    expected_ = test_data::ReadTestdataJson(GetParam() + "/expected.json");
    absl::StatusOr<Tokenizer> tok =
        Tokenizer::FromFile(TestdataPath(GetParam() + "/tokenizer.json"));
    ASSERT_TRUE(tok.ok()) << tok.status();
    tok_.emplace(std::move(*tok));
  }

  std::vector<std::string> strings_;
  json expected_;
  std::optional<Tokenizer> tok_;
};

TEST_P(GoldenTest, IdsEqualTokenizers) {
  ASSERT_EQ(expected_["ids"].size(), strings_.size());
  const std::vector<TokenId> prefix = Ids(expected_["prefix"]);
  const std::vector<TokenId> suffix = Ids(expected_["suffix"]);
  int failures = 0;
  for (size_t i = 0; i < strings_.size() && failures < 5; ++i) {
    const std::vector<TokenId> want = Ids(expected_["ids"][i]);
    absl::StatusOr<std::vector<TokenId>> got =
        tok_->Encode(strings_[i], {.add_special_tokens = false});
    ASSERT_TRUE(got.ok()) << got.status();
    if (*got != want) {
      ++failures;
      ADD_FAILURE() << "string " << i << " " << json(strings_[i]).dump().substr(0, 300) << "\n"
                    << IdsDifference(*tok_, *got, want);
    }
    std::vector<TokenId> want_special = prefix;
    want_special.insert(want_special.end(), want.begin(), want.end());
    want_special.insert(want_special.end(), suffix.begin(), suffix.end());
    absl::StatusOr<std::vector<TokenId>> got_special = tok_->Encode(strings_[i]);
    ASSERT_TRUE(got_special.ok()) << got_special.status();
    EXPECT_EQ(*got_special, want_special) << "string " << i << " with add_special_tokens";
  }
}

TEST_P(GoldenTest, DecodeEqualsTokenizers) {
  for (size_t i = 0; i < strings_.size(); ++i) {
    const std::vector<TokenId> ids = Ids(expected_["ids"][i]);
    const json& decoded = expected_["decoded"][i];
    const json& decoded_skip = expected_["decoded_skip"][i];
    const std::string want = decoded.is_null() ? strings_[i] : decoded.get<std::string>();
    const std::string want_skip = decoded_skip.is_null() ? want : decoded_skip.get<std::string>();
    absl::StatusOr<std::string> got = tok_->Decode(ids, {.skip_special_tokens = false});
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, want) << "string " << i;
    absl::StatusOr<std::string> got_skip = tok_->Decode(ids, {.skip_special_tokens = true});
    ASSERT_TRUE(got_skip.ok()) << got_skip.status();
    EXPECT_EQ(*got_skip, want_skip) << "string " << i << " skipping special tokens";
  }
}

TEST_P(GoldenTest, InvalidUtf8AcrossTokensDecodesAsTokenizers) {
  ASSERT_FALSE(expected_["decode_cases"].empty());
  test_data::ExpectDecodeCases(*tok_, expected_["decode_cases"]);
}

TEST_P(GoldenTest, InvalidUtf8IsReplacedAsPythonDoes) {
  test_data::ExpectInvalidUtf8Cases(*tok_, expected_["invalid_utf8"]);
}

TEST_P(GoldenTest, VocabularyAndSpecialTokens) {
  EXPECT_EQ(tok_->vocab_size(), expected_["vocab"]["size"].get<int>());
  const std::vector<TokenId> special = Ids(expected_["vocab"]["special"]);
  for (TokenId id = 0; id < tok_->vocab_size(); ++id) {
    const bool want = std::find(special.begin(), special.end(), id) != special.end();
    EXPECT_EQ(tok_->IsSpecial(id), want) << id;
  }
}

TEST_P(GoldenTest, BatchEqualsSingle) {
  test_data::ExpectBatchesEqual(*tok_, strings_, expected_["ids"], {1, 2, 3, 8});
}

TEST_P(GoldenTest, DecodeOfEncodeIsTheText) {
  // Where the tokenizer keeps every byte: no normalizer (or the text is
  // already normalized), no bytes missing from the vocabulary, no prefix.
  const std::string name = GetParam();
  if (name == "gpt2_prefix" || name == "flags" || name == "flags_nounk") GTEST_SKIP();
  int checked = 0;
  for (size_t i = 0; i < strings_.size(); ++i) {
    if (!expected_["decoded"][i].is_null()) continue;  // NFC changes it
    absl::StatusOr<std::vector<TokenId>> ids = tok_->Encode(strings_[i]);
    ASSERT_TRUE(ids.ok()) << ids.status();
    absl::StatusOr<std::string> text = tok_->Decode(*ids, {.skip_special_tokens = false});
    ASSERT_TRUE(text.ok()) << text.status();
    std::string want = strings_[i];
    if (name == "llama3") want = "<|begin_of_text|>" + want;
    EXPECT_EQ(*text, want) << "string " << i;
    ++checked;
  }
  EXPECT_GT(checked, 80);
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, GoldenTest,
                         testing::Values("gpt2", "gpt2_prefix", "llama3", "qwen2", "flags",
                                         "flags_nounk"),
                         [](const testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace tokenizer
