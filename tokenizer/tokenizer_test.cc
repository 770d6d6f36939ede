// Tokenizer's refusals, its errors on bad files and bad input, and what the
// golden test cannot show: long inputs, several threads at once, the bytes
// of a cut character.
#include "tokenizer/tokenizer.h"

#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tokenizer/testing/golden.h"

namespace tokenizer {
namespace {

using test_data::TestdataPath;
using json = nlohmann::json;
using ::testing::HasSubstr;

// A tokenizer.json (GPT-2's layout, Llama 3's) with one change.
absl::Status Load(const std::string& base, const std::function<void(json&)>& change) {
  json j = test_data::ReadTestdataJson(base + "/tokenizer.json");
  change(j);
  return Tokenizer::FromJson(j.dump(), "changed.json").status();
}

void ExpectRefused(const absl::Status& status, absl::StatusCode code, const std::string& text) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("tokenizer::Tokenizer::FromJson: "));
  EXPECT_THAT(std::string(status.message()), HasSubstr("changed.json: "));
  EXPECT_THAT(std::string(status.message()), HasSubstr(text));
}

TEST(Refusals, ModelsOtherThanBpe) {
  for (const char* type : {"WordPiece", "Unigram", "WordLevel"}) {
    ExpectRefused(Load("gpt2", [&](json& j) { j["model"]["type"] = type; }),
                  absl::StatusCode::kUnimplemented,
                  std::string("model.type = \"") + type + "\": not supported: expected \"BPE\"");
  }
}

TEST(Refusals, BpeOptionsItCannotHonour) {
  ExpectRefused(Load("gpt2", [](json& j) { j["model"]["dropout"] = 0.1; }),
                absl::StatusCode::kUnimplemented, "model.dropout = 0.1: not supported");
  ExpectRefused(Load("llama3", [](json& j) { j["model"]["byte_fallback"] = true; }),
                absl::StatusCode::kUnimplemented, "model.byte_fallback = true: not supported");
  ExpectRefused(Load("gpt2", [](json& j) { j["model"]["continuing_subword_prefix"] = "##"; }),
                absl::StatusCode::kUnimplemented,
                "model.continuing_subword_prefix = \"##\": not supported");
  ExpectRefused(Load("gpt2", [](json& j) { j["model"]["end_of_word_suffix"] = "</w>"; }),
                absl::StatusCode::kUnimplemented,
                "model.end_of_word_suffix = \"</w>\": not supported");
}

TEST(Refusals, PreTokenizers) {
  ExpectRefused(Load("gpt2",
                     [](json& j) {
                       j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "_"}};
                     }),
                absl::StatusCode::kUnimplemented, "pre_tokenizer.type = \"Metaspace\"");
  ExpectRefused(Load("llama3",
                     [](json& j) {
                       j["pre_tokenizer"]["pretokenizers"].insert(
                           j["pre_tokenizer"]["pretokenizers"].begin() + 1,
                           json{{"type", "Digits"}, {"individual_digits", true}});
                     }),
                absl::StatusCode::kUnimplemented,
                "pre_tokenizer.pretokenizers[1].type = \"Digits\"");
  ExpectRefused(
      Load("llama3",
           [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; }),
      absl::StatusCode::kUnimplemented,
      "pre_tokenizer.pretokenizers[0].behavior = \"Removed\": not supported");
  ExpectRefused(
      Load("llama3", [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["invert"] = true; }),
      absl::StatusCode::kUnimplemented, "pre_tokenizer.pretokenizers[0].invert = true");
  ExpectRefused(Load("llama3",
                     [](json& j) {
                       j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"String", " "}};
                     }),
                absl::StatusCode::kUnimplemented,
                "pre_tokenizer.pretokenizers[0].pattern = {\"String\":\" \"}");
  // A byte-level vocabulary needs the ByteLevel pre-tokenizer.
  ExpectRefused(
      Load("llama3", [](json& j) { j["pre_tokenizer"] = j["pre_tokenizer"]["pretokenizers"][0]; }),
      absl::StatusCode::kUnimplemented, "pre_tokenizer = {\"behavior\"");
  ExpectRefused(Load("gpt2", [](json& j) { j["pre_tokenizer"] = nullptr; }),
                absl::StatusCode::kUnimplemented, "pre_tokenizer = null");
  // A pattern construct that Oniguruma and PCRE2 read differently.
  ExpectRefused(
      Load("llama3",
           [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\h+|."; }),
      absl::StatusCode::kUnimplemented,
      "pre_tokenizer.pretokenizers[0].pattern.Regex = \"\\\\h+|.\": \\h at offset 0");
}

TEST(Refusals, NormalizersPostProcessorsDecoders) {
  ExpectRefused(Load("gpt2",
                     [](json& j) {
                       j["normalizer"] = {{"type", "Lowercase"}};
                     }),
                absl::StatusCode::kUnimplemented, "normalizer.type = \"Lowercase\"");
  ExpectRefused(Load("gpt2",
                     [](json& j) {
                       j["normalizer"] = {
                           {"type", "Sequence"},
                           {"normalizers", {{{"type", "NFC"}}, {{"type", "Strip"}}}}};
                     }),
                absl::StatusCode::kUnimplemented, "normalizer.normalizers[1].type = \"Strip\"");
  ExpectRefused(Load("gpt2",
                     [](json& j) {
                       j["post_processor"] = {{"type", "BertProcessing"}};
                     }),
                absl::StatusCode::kUnimplemented, "post_processor.type = \"BertProcessing\"");
  ExpectRefused(Load("llama3",
                     [](json& j) {
                       j["post_processor"]["processors"][1] = {{"type", "RobertaProcessing"}};
                     }),
                absl::StatusCode::kUnimplemented,
                "post_processor.processors[1].type = \"RobertaProcessing\"");
  ExpectRefused(Load("gpt2",
                     [](json& j) {
                       j["decoder"] = {{"type", "WordPiece"}};
                     }),
                absl::StatusCode::kUnimplemented, "decoder.type = \"WordPiece\"");
  ExpectRefused(Load("gpt2",
                     [](json& j) {
                       j["truncation"] = {{"max_length", 512}};
                     }),
                absl::StatusCode::kUnimplemented,
                "truncation = {\"max_length\":512}: not supported: expected null");
}

TEST(BadFiles, MergeOfATokenNotInTheVocabulary) {
  ExpectRefused(Load("gpt2", [](json& j) { j["model"]["merges"][5] = "Ġt zzz"; }),
                absl::StatusCode::kDataLoss,
                "model.merges[5] = \"Ġt zzz\": expected tokens in model.vocab (\"zzz\" is not)");
  ExpectRefused(
      Load("llama3",
           [](json& j) {
             j["model"]["merges"][7] = {"Ġ", "q"};
           }),
      absl::StatusCode::kDataLoss,
      "model.merges[7] = [\"Ġ\",\"q\"]: expected tokens in model.vocab (\"Ġq\", the two joined, "
      "is not)");
  ExpectRefused(Load("gpt2", [](json& j) { j["model"]["merges"][0] = "a b c"; }),
                absl::StatusCode::kDataLoss,
                "model.merges[0] = \"a b c\": expected two tokens separated by one space");
  ExpectRefused(Load("llama3", [](json& j) { j["model"]["merges"][0] = {"a"}; }),
                absl::StatusCode::kDataLoss, "model.merges[0] = [\"a\"]: expected \"a b\" or");
}

TEST(BadFiles, MalformedJsonAndMissingFields) {
  absl::Status malformed = Tokenizer::FromJson("{\"model\": {", "changed.json").status();
  ExpectRefused(malformed, absl::StatusCode::kDataLoss, "malformed JSON: ");
  ExpectRefused(Load("gpt2", [](json& j) { j.erase("model"); }), absl::StatusCode::kDataLoss,
                "model is missing: expected the BPE model");
  ExpectRefused(Load("gpt2", [](json& j) { j["model"].erase("vocab"); }),
                absl::StatusCode::kDataLoss, "model.vocab is missing: expected an object");
  ExpectRefused(Load("gpt2", [](json& j) { j["model"].erase("merges"); }),
                absl::StatusCode::kDataLoss, "model.merges is missing");
  ExpectRefused(Load("gpt2", [](json& j) { j["model"]["vocab"]["Ġthe"] = "x"; }),
                absl::StatusCode::kDataLoss,
                "model.vocab[\"Ġthe\"] = \"x\": expected an id in [0, 2^31)");
  ExpectRefused(Load("gpt2", [](json& j) { j["model"]["vocab"]["zzz"] = 5; }),
                absl::StatusCode::kDataLoss, "model.vocab[\"zzz\"] = 5: expected an id of its own");
  ExpectRefused(Load("qwen2", [](json& j) { j["added_tokens"][1].erase("id"); }),
                absl::StatusCode::kDataLoss, "added_tokens[1].id is missing");
  ExpectRefused(Load("flags", [](json& j) { j["model"]["unk_token"] = "<nope>"; }),
                absl::StatusCode::kDataLoss,
                "model.unk_token = \"<nope>\": expected a token of model.vocab");
  ExpectRefused(Load("llama3",
                     [](json& j) {
                       j["post_processor"]["processors"][1]["single"] =
                           json::array({j["post_processor"]["processors"][1]["single"][0]});
                     }),
                absl::StatusCode::kDataLoss, "post_processor.processors[1].single = ");
  ExpectRefused(Load("gpt2", [](json& j) { j = json::array(); }), absl::StatusCode::kDataLoss,
                "the file = []: expected a JSON object");
}

TEST(BadFiles, FileThatCannotBeRead) {
  absl::StatusOr<Tokenizer> tok = Tokenizer::FromFile("/nonexistent/tokenizer.json");
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(tok.status().message()),
              HasSubstr("tokenizer::Tokenizer::FromFile: /nonexistent/tokenizer.json: cannot be "
                        "opened"));
}

class TokenizerTest : public testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<Tokenizer> tok = Tokenizer::FromFile(TestdataPath("llama3/tokenizer.json"));
    ASSERT_TRUE(tok.ok()) << tok.status();
    tok_.emplace(std::move(*tok));
  }
  std::optional<Tokenizer> tok_;
};

TEST_F(TokenizerTest, TextThatIsNotUtf8) {
  absl::StatusOr<std::vector<TokenId>> ids = tok_->Encode("caf\xC3 au lait");
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ids.status().message()),
              HasSubstr("tokenizer::Tokenizer::Encode: text has byte 0xc3 at offset 3 that is not "
                        "UTF-8: expected UTF-8 text"));
  // kReplace: as the text with U+FFFD.
  ids = tok_->Encode("caf\xC3 au lait", {.invalid_utf8 = EncodeOptions::InvalidUtf8::kReplace});
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, *tok_->Encode("caf\xEF\xBF\xBD au lait"));

  std::vector<std::string> texts = {"fine", "also fine", "not \xFF fine", "bad \xC0"};
  absl::StatusOr<std::vector<std::vector<TokenId>>> batch = tok_->EncodeBatch(texts, {}, 2);
  EXPECT_EQ(batch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(batch.status().message()),
              HasSubstr("tokenizer::Tokenizer::EncodeBatch: texts[2]: text has byte 0xff at "
                        "offset 4"));
}

TEST_F(TokenizerTest, DecodeOfAnUnknownId) {
  absl::StatusOr<std::string> text = tok_->Decode({10, 20, 99999});
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(text.status().message()),
              HasSubstr("tokenizer::Tokenizer::Decode: ids[2] = 99999: expected an id of the "
                        "vocabulary or of an added token"));
  EXPECT_EQ(tok_->Decode({-1}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(TokenizerTest, DecodeBytesKeepsACutCharacter) {
  // "€" is E2 82 AC: its first two bytes alone.
  const TokenId e2 = *tok_->TokenToId("â");   // byte 0xE2
  const TokenId x82 = *tok_->TokenToId("Ĥ");  // byte 0x82 is the 0x24th unprintable: U+0124
  absl::StatusOr<std::string> bytes = tok_->DecodeBytes({e2, x82});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, "\xE2\x82");
  EXPECT_EQ(*tok_->Decode({e2, x82}), "\xEF\xBF\xBD");
}

TEST_F(TokenizerTest, TokensAndIds) {
  EXPECT_EQ(tok_->TokenToId("<|begin_of_text|>"), 4000);
  EXPECT_EQ(tok_->IdToToken(4000), "<|begin_of_text|>");
  EXPECT_TRUE(tok_->IsSpecial(4000));
  EXPECT_FALSE(tok_->IsSpecial(5));
  EXPECT_EQ(tok_->TokenToId("no such token"), std::nullopt);
  EXPECT_EQ(tok_->IdToToken(123456), std::nullopt);
  EXPECT_EQ(tok_->vocab_size(), 4010);
  // The vocabulary spells a space as U+0120.
  const std::optional<TokenId> the = tok_->TokenToId("Ġthe");
  ASSERT_TRUE(the.has_value());
  EXPECT_EQ(*tok_->Encode(" the", {.add_special_tokens = false}), std::vector<TokenId>{*the});
}

TEST_F(TokenizerTest, LongWordsAndRuns) {
  // Pieces of 100,000 to 200,000 bytes (merged on the heap, not cached); the
  // counts are what `tokenizers` 0.23.3 gives with this file.
  const std::vector<std::pair<std::string, size_t>> cases = {
      {std::string(200000, 'a'), 200000},  // no merge joins "a"s
      {std::string(200000, ' '), 6250},    // 32 spaces a token
      {std::string(200000, '\n'), 100000}, {"x" + std::string(200000, ' ') + "y", 6254},
      {std::string(100000, '7'), 100000},  // digits in groups of 3, no merges
  };
  for (const auto& [text, count] : cases) {
    absl::StatusOr<std::vector<TokenId>> ids = tok_->Encode(text, {.add_special_tokens = false});
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(ids->size(), count);
    EXPECT_EQ(*tok_->Decode(*ids), text);
  }
}

TEST_F(TokenizerTest, ThreadsShareOneTokenizer) {
  std::vector<std::string> texts;
  for (int i = 0; i < 64; ++i) {
    texts.push_back("Document " + std::to_string(i) + ": the quick brown fox jumps over " +
                    std::string(i, 'z') + " <|eot_id|> naïve café 😀 " + std::to_string(i * i));
  }
  std::vector<std::vector<TokenId>> want;
  for (const std::string& t : texts) want.push_back(*tok_->Encode(t));
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round) {
        for (size_t i = 0; i < texts.size(); ++i) {
          if (*tok_->Encode(texts[(i + t) % texts.size()]) != want[(i + t) % texts.size()]) {
            ++mismatches[t];
          }
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
  absl::StatusOr<std::vector<std::vector<TokenId>>> batch = tok_->EncodeBatch(texts, {}, 0);
  ASSERT_TRUE(batch.ok());
  EXPECT_EQ(*batch, want);
  EXPECT_TRUE(tok_->EncodeBatch(std::vector<std::string>{}, {}, 4)->empty());
}

}  // namespace
}  // namespace tokenizer
