// OpenTextData and TextData::Encode on 2 real ranks: rank 0 encodes, both
// ranks return the same ids (those of tokenizer::EncodeDocuments, as
// //tools:tokenize writes them) and the same errors; a text whose encoding
// takes longer than the group's collective timeout does not time the
// waiting rank out (rank 0's heartbeats).
#include "trainer/text_data.h"

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <ATen/ops/empty.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/collectives.h"
#include "testing/multiprocess.h"
#include "tokenizer/documents.h"
#include "tokenizer/tokenizer.h"

namespace trainer {
namespace {

using ::testing::HasSubstr;

const char kTokenizer[] = "tokenizer/testdata/llama3/tokenizer.json";

std::string TestDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

Options TextOptions(const std::string& path) {
  Options o;
  o.data = DataKind::kFile;
  o.data_path = path;
  o.tokenizer = kTokenizer;
  o.vocab = 4096;
  return o;
}

// Words of 3 to 6 syllables drawn from a fixed generator: almost every
// word is new to the tokenizer's word cache, so it encodes at about
// 20 MB/s on the 2-core development machine (about a token per 2.6 bytes).
void WriteWords(const std::string& path, size_t bytes) {
  static const char* kSyllables[] = {"the", "and", "ing", "tion", "er",  "re",  "on",  "at",
                                     "en",  "ed",  "or",  "es",   "is",  "it",  "al",  "ar",
                                     "ent", "ion", "ate", "ver",  "ter", "con", "com", "pro",
                                     "per", "est", "ous", "ine",  "ure", "ble", "ity", "ment"};
  std::string text;
  text.reserve(bytes + 64);
  uint64_t x = 88172645463325252ull;
  while (text.size() < bytes) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    for (uint64_t k = 0, n = 3 + x % 4; k < n; ++k) text += kSyllables[(x >> (8 + 5 * k)) % 32];
    text += (x >> 60) == 0 ? ".\n" : " ";
  }
  std::ofstream(path, std::ios::binary) << text;
}

// Each rank waits until every rank has arrived (files in TEST_TMPDIR), so
// that the short collective timeout below measures the encoding, not the
// ranks' start-up skew.
void FileBarrier(const comm::ProcessGroup& group, const std::string& name) {
  const std::string dir = TestDir() + "/" + name;
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/" + std::to_string(group.rank()));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int r = 0; r < group.size(); ++r) {
    while (!std::filesystem::exists(dir + "/" + std::to_string(r))) {
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "rank " << r << " never came";
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
}

// FNV-1a over the ids: what the ranks compare instead of sending them again.
int64_t Checksum(const std::vector<uint32_t>& ids) {
  uint64_t h = 1469598103934665603ull;
  for (uint32_t id : ids) h = (h ^ id) * 1099511628211ull;
  return static_cast<int64_t>(h >> 1);
}

constexpr auto kCollectiveTimeout = std::chrono::milliseconds(500);

TEST(TextDataTest, EveryRankGetsRankZerosIdsThoughTheEncodingOutlastsTheTimeout) {
  comm::testing::RunOptions options;
  options.collective_timeout = kCollectiveTimeout;
  comm::testing::RunOnRanks(
      2,
      [](comm::ProcessGroup& group) {
        // 30 MB: about 1.5 s of encoding, three times the timeout.
        const std::string path = TestDir() + "/words.txt";
        if (group.rank() == 0) WriteWords(path, 30'000'000);  // only rank 0 reads it
        FileBarrier(group, "ready");
        auto text = OpenTextData(TextOptions(path), group);
        ASSERT_TRUE(text.ok()) << text.status();
        ASSERT_NE(*text, nullptr);
        const auto start = std::chrono::steady_clock::now();
        auto data = (*text)->Encode(group);
        ASSERT_TRUE(data.ok()) << data.status();
        const auto took = std::chrono::steady_clock::now() - start;
        // Otherwise this machine encodes too fast for the test to show
        // anything: make the text larger.
        EXPECT_GT(took, 2 * kCollectiveTimeout);

        at::Tensor summary = at::empty({2}, at::kLong);
        summary.data_ptr<int64_t>()[0] = static_cast<int64_t>(data->tokens.size());
        summary.data_ptr<int64_t>()[1] = Checksum(data->tokens);
        const at::Tensor mine = summary.clone();
        comm::broadcast(group, summary, 0).wait();
        EXPECT_TRUE(summary.equal(mine))
            << "rank " << group.rank() << "'s ids differ from rank 0's";
        if (group.rank() == 0) {
          EXPECT_THAT(data->description, HasSubstr(" tokens of " + path + " (text encoded with " +
                                                   kTokenizer + ", <|end_of_text|> after it)"));
          // tokenize's ids (its encoding is EncodeDocuments of the file),
          // here the last of them: the text's, then the end-of-text token.
          auto tok = tokenizer::Tokenizer::FromFile(kTokenizer);
          ASSERT_TRUE(tok.ok()) << tok.status();
          EXPECT_EQ(data->tokens.front(),
                    static_cast<uint32_t>(*tok->TokenToId("<|begin_of_text|>")));
          EXPECT_EQ(data->tokens.back(), static_cast<uint32_t>(*tok->TokenToId("<|end_of_text|>")));
        } else {
          EXPECT_EQ(data->description, std::to_string(data->tokens.size()) + " tokens of " + path +
                                           " (text encoded on rank 0)");
        }
      },
      options);
}

TEST(TextDataTest, EveryRankReturnsRankZerosErrors) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& group) {
    const std::string dir = TestDir();
    // A refusal when opening: the tokenizer's ids exceed the vocabulary.
    Options small = TextOptions("/usr/share/common-licenses/GPL-3");
    small.vocab = 1000;
    auto refused = OpenTextData(small, group);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(refused.status().message(),
              std::string("--tokenizer='") + kTokenizer +
                  "' has 4010 token ids: expected at most --vocab=1000, the model's vocabulary: "
                  "pass --vocab 4010 or more");
    // An error when encoding: a byte that is not UTF-8.
    const std::string bad = dir + "/bad.txt";
    if (group.rank() == 0) std::ofstream(bad, std::ios::binary) << "fine text, then \xff";
    auto text = OpenTextData(TextOptions(bad), group);
    ASSERT_TRUE(text.ok()) << text.status();
    auto data = (*text)->Encode(group);
    EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(data.status().message(),
              "--data='" + bad +
                  "': tokenizer::Tokenizer::Encode: text has byte 0xff at offset 16 that is not "
                  "UTF-8: expected UTF-8 text (or EncodeOptions::InvalidUtf8::kReplace)");
    // No --tokenizer: nothing to encode, nothing sent.
    Options none = TextOptions(bad);
    none.tokenizer.clear();
    auto nothing = OpenTextData(none, group);
    ASSERT_TRUE(nothing.ok());
    EXPECT_EQ(*nothing, nullptr);
  });
}

}  // namespace
}  // namespace trainer
