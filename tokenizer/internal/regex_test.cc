// The pre-tokenizer patterns on PCRE2: the translation of what Oniguruma
// reads differently, and matching as `tokenizers` matches (U+0085 is
// whitespace; contractions in any case; lookahead at the end of a piece).
#include "tokenizer/internal/regex.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tokenizer::internal {
namespace {

constexpr char kLlama3[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::vector<std::string> Matches(const std::string& pattern, const std::string& text) {
  auto regex = Regex::Compile(pattern);
  EXPECT_TRUE(regex.ok()) << regex.status();
  auto state = (*regex)->NewMatchState();
  std::vector<std::string> out;
  size_t at = 0, begin, end;
  while (at < text.size() && (*regex)->Find(text, at, state.get(), &begin, &end) == 1) {
    out.push_back(text.substr(begin, end - begin));
    at = end;
  }
  return out;
}

TEST(Regex, TranslatesWhatOnigurumaReadsDifferently) {
  EXPECT_EQ(*TranslatePattern(R"(\s+(?!\S))"), R"([\s\x{85}]+(?![^\s\x{85}]))");
  EXPECT_EQ(*TranslatePattern(R"([^\s\p{L}\p{N}]+)"), R"([^\s\x{85}\p{L}\p{N}]+)");
  EXPECT_EQ(*TranslatePattern(R"(\w+\d)"), R"([\p{L}\p{M}\p{Nd}\p{Pc}]+\p{Nd})");
  EXPECT_EQ(*TranslatePattern(R"(\\s[]s])"), R"(\\s[]s])");  // an escaped backslash, a ']' first
  EXPECT_FALSE(TranslatePattern(R"(\h)").ok());
  EXPECT_FALSE(TranslatePattern(R"(\bword\b)").ok());
  EXPECT_FALSE(TranslatePattern(R"([\S])").ok());
}

TEST(Regex, MatchesAsTokenizers) {
  // Pieces as `tokenizers`' Split with Llama 3's pattern gives them.
  EXPECT_EQ(Matches(kLlama3,
                    "a\xC2\x85\xC2\x85"
                    "b"),
            (std::vector<std::string>{"a", "\xC2\x85",
                                      "\xC2\x85"
                                      "b"}));
  EXPECT_EQ(Matches(kLlama3, "x'LLama it'S"),
            (std::vector<std::string>{"x", "'LL", "ama", " it", "'S"}));
  EXPECT_EQ(Matches(kLlama3, "1234567"), (std::vector<std::string>{"123", "456", "7"}));
  EXPECT_EQ(Matches(kLlama3, "a  b"), (std::vector<std::string>{"a", " ", " b"}));
  EXPECT_EQ(Matches(kLlama3, "end  "), (std::vector<std::string>{"end", "  "}));
}

TEST(Regex, CompileErrorsNameTheOffset) {
  auto regex = Regex::Compile("(unclosed");
  ASSERT_FALSE(regex.ok());
  EXPECT_NE(std::string(regex.status().message()).find("at offset 9"), std::string::npos)
      << regex.status();
}

}  // namespace
}  // namespace tokenizer::internal
