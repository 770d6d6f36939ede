// UTF-8 validation and the lossy conversion's maximal subparts (the cases of
// Unicode's chapter 3 table 3-8, which Rust's from_utf8_lossy and Python's
// "replace" follow).
#include "tokenizer/internal/utf8.h"

#include <string>

#include "gtest/gtest.h"

namespace tokenizer::internal {
namespace {

constexpr char kFffd[] = "\xEF\xBF\xBD";

std::string Lossy(const std::string& bytes) {
  std::string out;
  AppendUtf8Lossy(bytes, &out);
  return out;
}

TEST(Utf8, FindsTheFirstInvalidByte) {
  EXPECT_EQ(FindInvalidUtf8(""), std::string::npos);
  EXPECT_EQ(FindInvalidUtf8("plain ascii, longer than eight bytes"), std::string::npos);
  EXPECT_EQ(FindInvalidUtf8("caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80"), std::string::npos);
  EXPECT_EQ(FindInvalidUtf8("abcdefghij\xFF"), 10u);
  EXPECT_EQ(FindInvalidUtf8("\xC0\xAF"), 0u);          // overlong
  EXPECT_EQ(FindInvalidUtf8("ab\xED\xA0\x80"), 2u);    // surrogate
  EXPECT_EQ(FindInvalidUtf8("\xF4\x90\x80\x80"), 0u);  // above U+10FFFF
  EXPECT_EQ(FindInvalidUtf8("x\xE2\x82"), 1u);         // cut at the end
}

TEST(Utf8, LossyReplacesMaximalSubparts) {
  EXPECT_EQ(Lossy("ok"), "ok");
  EXPECT_EQ(Lossy("\xE2\x82"
                  "a"),
            std::string(kFffd) + "a");
  EXPECT_EQ(Lossy("\x80\x80"), std::string(kFffd) + kFffd);
  EXPECT_EQ(Lossy("\xF0\x80\x80"), std::string(kFffd) + kFffd + kFffd);
  EXPECT_EQ(Lossy("\xF0\x9F\x98"), kFffd);
  EXPECT_EQ(Lossy("\xED\xA0\x80"), std::string(kFffd) + kFffd + kFffd);
  EXPECT_EQ(Lossy("\xC0\xAF"), std::string(kFffd) + kFffd);
  EXPECT_EQ(Lossy("a\xFF\xFE"
                  "b"),
            std::string("a") + kFffd + kFffd + "b");
  // Table 3-8: 61 F1 80 80 E1 80 C2 62 80 63 80 BF 64.
  EXPECT_EQ(Lossy("\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64"),
            std::string("a") + kFffd + kFffd + kFffd + "b" + kFffd + "c" + kFffd + kFffd + "d");
}

TEST(Utf8, EncodesAndDecodesCodePoints) {
  for (char32_t c :
       {U'\u0000', U'A', U'\u00E9', U'\u0120', U'\u20AC', U'\U0001F600', U'\U0010FFFF'}) {
    std::string s;
    AppendUtf8(c, &s);
    EXPECT_EQ(FindInvalidUtf8(s), std::string::npos);
    size_t i = 0;
    EXPECT_EQ(DecodeUtf8(s, &i), c);
    EXPECT_EQ(i, s.size());
    EXPECT_EQ(Utf8SequenceLength(static_cast<unsigned char>(s[0])), s.size());
  }
}

}  // namespace
}  // namespace tokenizer::internal
