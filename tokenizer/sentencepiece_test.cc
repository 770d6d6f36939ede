// SentencePiece tokenizer.model files through Tokenizer: which reader
// FromFile picks, the BOS, the reserved ids, decoding's corners, and every
// way a file can be wrong (missing, empty, neither format, a corrupt or cut
// model, an option not implemented): an error naming the file, never a
// crash. The ids themselves are sentencepiece_golden_test's.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tokenizer/testing/golden.h"
#include "tokenizer/documents.h"
#include "tokenizer/tokenizer.h"

namespace tokenizer {
namespace {

using test_data::TestdataPath;
using ::testing::HasSubstr;

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << path;
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return (dir != nullptr ? std::string(dir) : std::filesystem::temp_directory_path().string()) +
         "/" + name;
}

std::string WriteTemp(const std::string& name, const std::string& bytes) {
  const std::string path = TempPath(name);
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

const std::string& Llama2Model() {
  static const std::string* bytes =
      new std::string(ReadBytes(TestdataPath("sentencepiece/llama2_bpe/tokenizer.model")));
  return *bytes;
}

Tokenizer Load(const std::string& name) {
  absl::StatusOr<Tokenizer> tok =
      Tokenizer::FromFile(TestdataPath("sentencepiece/" + name + "/tokenizer.model"));
  EXPECT_TRUE(tok.ok()) << tok.status();
  return std::move(*tok);
}

std::vector<TokenId> Encode(const Tokenizer& tok, const std::string& text, bool special) {
  absl::StatusOr<std::vector<TokenId>> ids = tok.Encode(text, {.add_special_tokens = special});
  EXPECT_TRUE(ids.ok()) << ids.status();
  return ids.ok() ? *ids : std::vector<TokenId>{};
}

TEST(SentencePieceTest, BosOnlyWithSpecialTokensAndNeverEos) {
  const Tokenizer tok = Load("llama2_bpe");
  ASSERT_EQ(tok.bos_id(), 1);
  ASSERT_EQ(tok.eos_id(), 2);
  EXPECT_EQ(tok.unk_id(), 0);
  EXPECT_EQ(tok.pad_id(), std::nullopt);  // Llama 2's pad_id is -1
  EXPECT_EQ(tok.IdToToken(1), "<s>");
  EXPECT_EQ(tok.IdToToken(2), "</s>");
  const std::vector<TokenId> bare = Encode(tok, "Hello world", false);
  ASSERT_FALSE(bare.empty());
  EXPECT_NE(bare.front(), 1);
  EXPECT_NE(bare.back(), 2);
  std::vector<TokenId> with_bos = {1};
  with_bos.insert(with_bos.end(), bare.begin(), bare.end());
  EXPECT_EQ(Encode(tok, "Hello world", true), with_bos);
  EXPECT_EQ(Encode(tok, "", true), std::vector<TokenId>{1});
  EXPECT_EQ(Encode(tok, "", false), std::vector<TokenId>{});
  // Written in the text, the special pieces are found either way.
  EXPECT_EQ(Encode(tok, "</s>", false), std::vector<TokenId>{2});
  EXPECT_EQ(Encode(tok, "<s></s>", true), (std::vector<TokenId>{1, 1, 2}));
}

TEST(SentencePieceTest, AModelWithoutBosAddsNothing) {
  const Tokenizer tok = Load("bpe_nodummy");
  EXPECT_EQ(tok.bos_id(), std::nullopt);
  EXPECT_EQ(tok.eos_id(), 1);
  EXPECT_EQ(Encode(tok, "Hello", true), Encode(tok, "Hello", false));
}

TEST(SentencePieceTest, DecodeWritesOrSkipsSpecialPieces) {
  const Tokenizer tok = Load("llama2_bpe");
  const std::vector<TokenId> ids = Encode(tok, "Hello world", true);
  absl::StatusOr<std::string> skipped = tok.Decode(ids);
  ASSERT_TRUE(skipped.ok()) << skipped.status();
  EXPECT_EQ(*skipped, "Hello world");
  // transformers' LlamaTokenizer: "<s> Hello world" (the space after a
  // written special piece stays).
  absl::StatusOr<std::string> written = tok.Decode(ids, {.skip_special_tokens = false});
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(*written, "<s> Hello world");
  // <unk> is special too: skipped, or written as spelled (not
  // sentencepiece's " ⁇ ").
  std::vector<TokenId> unk = {0};
  const std::vector<TokenId> world = Encode(tok, "world", false);
  unk.insert(unk.end(), world.begin(), world.end());
  EXPECT_EQ(*tok.Decode(unk), "world");
  EXPECT_EQ(*tok.Decode(unk, {.skip_special_tokens = false}), "<unk> world");
}

TEST(SentencePieceTest, DecodeBytesKeepsInvalidBytes) {
  const Tokenizer tok = Load("llama2_bpe");
  const std::vector<TokenId> cut = {*tok.TokenToId("<0xE6>"), *tok.TokenToId("<0x97>")};
  absl::StatusOr<std::string> bytes = tok.DecodeBytes(cut);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, "\xE6\x97");
  // Decode: one U+FFFD per byte, as sentencepiece (Python would give one).
  EXPECT_EQ(*tok.Decode(cut), "\xEF\xBF\xBD\xEF\xBF\xBD");
  // Streaming: the rest of the character in the next call.
  std::vector<TokenId> whole = cut;
  whole.push_back(*tok.TokenToId("<0xA5>"));
  EXPECT_EQ(*tok.Decode(whole), "\xE6\x97\xA5");
}

TEST(SentencePieceTest, UnknownIdsAreRefusedNamingTheirIndex) {
  const Tokenizer tok = Load("llama2_bpe");
  for (TokenId bad : {-1, 2000, 1 << 30}) {
    absl::StatusOr<std::string> text = tok.Decode({5, bad});
    ASSERT_FALSE(text.ok());
    EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(text.status().message(), HasSubstr("ids[1] = " + std::to_string(bad)));
    EXPECT_THAT(text.status().message(), HasSubstr("2000 pieces"));
    EXPECT_EQ(tok.DecodeBytes({bad}).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(SentencePieceTest, InvalidUtf8IsRefusedNamingTheOffset) {
  const Tokenizer tok = Load("llama2_bpe");
  absl::StatusOr<std::vector<TokenId>> ids = tok.Encode("ab\xff");
  ASSERT_FALSE(ids.ok());
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ids.status().message(),
              HasSubstr("tokenizer::Tokenizer::Encode: text has byte 0xff at offset 2"));
}

TEST(SentencePieceTest, EosTokenIsTheModels) {
  absl::StatusOr<EosToken> eos = FindEosToken(Load("llama2_bpe"));
  ASSERT_TRUE(eos.ok()) << eos.status();
  EXPECT_EQ(eos->id, 2);
  EXPECT_EQ(eos->name, "</s>");
  // A name still wins.
  absl::StatusOr<EosToken> named = FindEosToken(Load("llama2_bpe"), "<s>");
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->id, 1);
}

TEST(SentencePieceTest, TheContentDecidesNotTheName) {
  // A tokenizer.model under another name, a tokenizer.json named .model.
  const std::string model = WriteTemp("llama2.bin", Llama2Model());
  absl::StatusOr<Tokenizer> from_model = Tokenizer::FromFile(model);
  ASSERT_TRUE(from_model.ok()) << from_model.status();
  EXPECT_EQ(from_model->vocab_size(), 2000);
  EXPECT_EQ(from_model->bos_id(), 1);
  const std::string json =
      WriteTemp("flags.model", ReadBytes(TestdataPath("flags/tokenizer.json")));
  absl::StatusOr<Tokenizer> from_json = Tokenizer::FromFile(json);
  ASSERT_TRUE(from_json.ok()) << from_json.status();
  EXPECT_EQ(from_json->bos_id(), std::nullopt);
  // FromSentencePiece on the bytes.
  absl::StatusOr<Tokenizer> from_bytes = Tokenizer::FromSentencePiece(Llama2Model());
  ASSERT_TRUE(from_bytes.ok()) << from_bytes.status();
  EXPECT_EQ(from_bytes->Encode("Hello world")->size(), from_model->Encode("Hello world")->size());
}

// A model whose first piece is 123 bytes long starts "\x0a{": JSON sees a
// newline and an object, which does not parse, so it is read as a model.
TEST(SentencePieceTest, AModelThatLooksLikeJsonIsStillAModel) {
  const std::string& model = Llama2Model();
  ASSERT_EQ(model.substr(0, 2), std::string("\x0a", 1) + static_cast<char>(model[1]));
  const size_t length = static_cast<unsigned char>(model[1]);
  ASSERT_LT(length, 128u);
  const std::string entry = model.substr(2, length);
  ASSERT_EQ(entry.substr(0, 7), "\x0a\x05<unk>");  // the piece's text, then its score and type
  const std::string rest = entry.substr(7);
  const size_t piece_length = 123 - 2 - rest.size();
  const std::string piece = "<" + std::string(piece_length - 2, 'u') + ">";
  const std::string braced = std::string("\x0a{\x0a") + static_cast<char>(piece_length) + piece +
                             rest + model.substr(2 + length);
  const std::string path = WriteTemp("braced.bin", braced);
  absl::StatusOr<Tokenizer> tok = Tokenizer::FromFile(path);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ(tok->vocab_size(), 2000);
  EXPECT_EQ(tok->IdToToken(0), piece);
  // Named .json, it is JSON, and malformed.
  absl::StatusOr<Tokenizer> json = Tokenizer::FromFile(WriteTemp("braced.json", braced));
  ASSERT_FALSE(json.ok());
  EXPECT_THAT(json.status().message(), HasSubstr("braced.json: malformed JSON"));
}

TEST(SentencePieceTest, BadFilesAreRefusedNamingThem) {
  struct Case {
    std::string name;
    std::string bytes;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"empty.model", "", absl::StatusCode::kDataLoss,
       "the file is empty: expected a tokenizer.json or a SentencePiece tokenizer.model"},
      {"garbage.model", "\x0e\x01garbage", absl::StatusCode::kDataLoss,
       "not a SentencePiece model (libsentencepiece: "},
      {"notes.txt", "just some text\n", absl::StatusCode::kDataLoss,
       "neither a tokenizer.json (it starts with byte 0x6a, not '{') nor a SentencePiece "
       "tokenizer.model (libsentencepiece: "},
      {"half.model", Llama2Model().substr(0, Llama2Model().size() / 2), absl::StatusCode::kDataLoss,
       "not a SentencePiece model"},
      {"bad.json", "\x0e\x01", absl::StatusCode::kDataLoss, "malformed JSON"},
  };
  for (const Case& c : cases) {
    const std::string path = WriteTemp(c.name, c.bytes);
    absl::StatusOr<Tokenizer> tok = Tokenizer::FromFile(path);
    ASSERT_FALSE(tok.ok()) << c.name;
    EXPECT_EQ(tok.status().code(), c.code) << tok.status();
    EXPECT_THAT(tok.status().message(), HasSubstr("tokenizer::Tokenizer::FromFile: " + path + ": "))
        << c.name;
    EXPECT_THAT(tok.status().message(), HasSubstr(c.message)) << c.name;
  }
  absl::StatusOr<Tokenizer> missing = Tokenizer::FromFile(TempPath("missing/tokenizer.model"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(),
              HasSubstr(TempPath("missing/tokenizer.model") +
                        ": cannot be opened: expected a readable tokenizer.json or "
                        "tokenizer.model"));
  absl::StatusOr<Tokenizer> bytes = Tokenizer::FromSentencePiece("\xff\xff", "weights.bin");
  ASSERT_FALSE(bytes.ok());
  EXPECT_EQ(bytes.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(bytes.status().message(),
              HasSubstr("tokenizer::Tokenizer::FromSentencePiece: weights.bin: not a "
                        "SentencePiece model"));
}

TEST(SentencePieceTest, WhitespaceAsSuffixIsRefused) {
  // trainer_spec (field 2) { treat_whitespace_as_suffix (24): true },
  // appended: protobuf merges it into the model's trainer_spec.
  const std::string model = Llama2Model() + std::string("\x12\x03\xC0\x01\x01", 5);
  absl::StatusOr<Tokenizer> tok = Tokenizer::FromSentencePiece(model, "suffix.model");
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(tok.status().message(),
              HasSubstr("suffix.model: trainer_spec.treat_whitespace_as_suffix = true: not "
                        "supported"));
}

// Whatever the bytes, loading gives a tokenizer or an error, and a tokenizer
// that loads encodes and decodes without crashing: every cut of the model,
// and random bytes changed in it.
TEST(SentencePieceTest, CorruptModelsNeverCrash) {
  const std::string& model = Llama2Model();
  int loaded = 0, refused = 0;
  const auto exercise = [&](const std::string& bytes) {
    absl::StatusOr<Tokenizer> tok = Tokenizer::FromSentencePiece(bytes, "corrupt.model");
    if (!tok.ok()) {
      ++refused;
      EXPECT_THAT(tok.status().message(), HasSubstr("corrupt.model: ")) << tok.status();
      return;
    }
    ++loaded;
    for (const char* text : {"Hello <s> world </s>", "日本語 😀 ", ""}) {
      absl::StatusOr<std::vector<TokenId>> ids = tok->Encode(text);
      if (!ids.ok()) continue;
      EXPECT_TRUE(tok->Decode(*ids, {.skip_special_tokens = false}).ok());
    }
    std::vector<TokenId> every(tok->vocab_size());
    for (TokenId id = 0; id < tok->vocab_size(); ++id) every[id] = id;
    EXPECT_TRUE(tok->Decode(every).ok());
  };
  for (size_t cut = 0; cut < model.size(); cut += 97) exercise(model.substr(0, cut));
  std::mt19937 random(20261128);
  for (int trial = 0; trial < 300; ++trial) {
    std::string bytes = model;
    const int changes = 1 + static_cast<int>(random() % 4);
    for (int k = 0; k < changes; ++k) {
      bytes[random() % bytes.size()] = static_cast<char>(random() % 256);
    }
    exercise(bytes);
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(loaded, 0);
}

}  // namespace
}  // namespace tokenizer
