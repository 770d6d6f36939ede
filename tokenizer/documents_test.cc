// EncodeDocuments against Encode of each document (the golden test holds
// Encode to Python's `tokenizers`): order, separators, threads, batches of
// 256, progress; FindEosToken's order and refusals; errors naming the
// document.
#include "tokenizer/documents.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tokenizer/testing/golden.h"

namespace tokenizer {
namespace {

using test_data::TestdataPath;
using ::testing::HasSubstr;

Tokenizer Load(const std::string& name) {
  auto tok = Tokenizer::FromFile(TestdataPath(name + "/tokenizer.json"));
  EXPECT_TRUE(tok.ok()) << tok.status();
  return std::move(*tok);
}

TEST(FindEosTokenTest, TheUsualNamesInOrderOrTheOneNamed) {
  const Tokenizer llama3 = Load("llama3");
  auto eos = FindEosToken(llama3);
  ASSERT_TRUE(eos.ok()) << eos.status();
  EXPECT_EQ(eos->name, "<|end_of_text|>");
  EXPECT_EQ(eos->id, *llama3.TokenToId("<|end_of_text|>"));
  // Qwen2's layout has <|endoftext|> and <|im_end|>: the base model's first.
  auto qwen = FindEosToken(Load("qwen2"));
  ASSERT_TRUE(qwen.ok()) << qwen.status();
  EXPECT_EQ(qwen->name, "<|endoftext|>");
  auto named = FindEosToken(Load("qwen2"), "<|im_end|>");
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->name, "<|im_end|>");

  auto missing = FindEosToken(llama3, "<nope>", "llama3/tokenizer.json");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(),
            "end-of-text token '<nope>': not in the vocabulary or the added tokens of "
            "llama3/tokenizer.json");
  // A tokenizer with none of the usual names (<unk>, <mask>, ... only).
  auto none = FindEosToken(Load("flags"), "", "flags/tokenizer.json");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(none.status().message(),
            "flags/tokenizer.json has none of <|end_of_text|>, <|endoftext|>, </s>, <|im_end|>: "
            "expected one of them as the end-of-text token between documents, or a name for it");
}

TEST(EncodeDocumentsTest, EachDocumentThenTheSeparatorOnAnyNumberOfThreads) {
  const Tokenizer tok = Load("llama3");
  const TokenId eos = *tok.TokenToId("<|end_of_text|>");
  // 600 documents: three batches of at most 256, of different lengths,
  // some empty (their ids: the post-processor's BOS alone).
  std::vector<std::string> documents;
  for (int i = 0; i < 600; ++i) {
    documents.push_back(i % 7 == 0 ? std::string()
                                   : std::string(static_cast<size_t>(i % 13), ' ') + "document " +
                                         std::to_string(i * 7919) + " héllo, wörld\n");
  }
  for (bool special : {true, false}) {
    std::vector<uint32_t> expected;
    for (const std::string& document : documents) {
      auto ids = tok.Encode(document, {.add_special_tokens = special});
      ASSERT_TRUE(ids.ok()) << ids.status();
      expected.insert(expected.end(), ids->begin(), ids->end());
      expected.push_back(static_cast<uint32_t>(eos));
    }
    for (int threads : {1, 3}) {
      std::vector<std::pair<size_t, size_t>> progress;
      DocumentsOptions options;
      options.encode.add_special_tokens = special;
      options.num_threads = threads;
      options.progress = [&](size_t done, size_t ids) { progress.emplace_back(done, ids); };
      auto ids = EncodeDocuments(tok, documents, eos, options);
      ASSERT_TRUE(ids.ok()) << ids.status();
      EXPECT_EQ(*ids, expected) << "threads " << threads << ", special tokens " << special;
      ASSERT_EQ(progress.size(), 3u);
      EXPECT_EQ(progress[0].first, 256u);
      EXPECT_EQ(progress[1].first, 512u);
      EXPECT_EQ(progress[2], std::make_pair(size_t{600}, expected.size()));
    }
  }
  auto none = EncodeDocuments(tok, {}, eos);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

TEST(EncodeDocumentsTest, TextThatIsNotUtf8IsRefusedNamingTheDocument) {
  const Tokenizer tok = Load("gpt2");
  std::vector<std::string> documents(300, "fine");
  documents[290] = "bad \xff byte";
  auto ids = EncodeDocuments(tok, documents, 0);
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ids.status().message(), HasSubstr("document 290: "));
  EXPECT_THAT(ids.status().message(), HasSubstr("byte 0xff at offset 4 that is not UTF-8"));
  DocumentsOptions options;
  options.document_name = [](size_t i) { return "corpus.jsonl:" + std::to_string(i + 1); };
  auto named = EncodeDocuments(tok, documents, 0, options);
  EXPECT_THAT(named.status().message(), HasSubstr("corpus.jsonl:291: "));
}

}  // namespace
}  // namespace tokenizer
