// text_data_unavailable.cc, the CMake GPU build's text_data.h where CMake
// finds no PCRE2, ICU or SentencePiece: --tokenizer is refused naming why
// and what to do instead; without --tokenizer there is nothing to encode.
// (Bazel builds it only here, so that it compiles and says what it should.)
#include "comm/process_group.h"
#include "gtest/gtest.h"
#include "trainer/text_data.h"

namespace trainer {
namespace {

TEST(TextDataUnavailableTest, RefusesTheTokenizerNamingWhy) {
  Options o;
  o.data = DataKind::kFile;
  o.data_path = "corpus.txt";
  o.tokenizer = "tokenizer.json";
  const comm::ProcessGroup no_group;  // refused by each rank alone
  auto text = OpenTextData(o, no_group);
  EXPECT_EQ(text.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(text.status().message(),
            "--tokenizer='tokenizer.json': this trainer was built without the tokenizer: "
            "PCRE2/ICU/SentencePiece not found by CMake (or TORCHFSDP_TOKENIZER=OFF); make the "
            "token file with //tools:tokenize (bazel run //tools:tokenize -- --tokenizer "
            "tokenizer.json --out "
            "FILE.bin corpus.txt) and pass it as --data FILE.bin");
  o.tokenizer.clear();
  auto none = OpenTextData(o, no_group);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, nullptr);
}

}  // namespace
}  // namespace trainer
