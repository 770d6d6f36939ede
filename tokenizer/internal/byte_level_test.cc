// GPT-2's byte-to-unicode map, from its definition alone (no Python): the
// printable bytes are themselves, the other 68 take U+0100 on in byte order.
#include "tokenizer/internal/byte_level.h"

#include <set>
#include <string>

#include "gtest/gtest.h"

namespace tokenizer::internal {
namespace {

TEST(ByteLevel, PrintableBytesAreThemselves) {
  for (int b = '!'; b <= '~'; ++b) EXPECT_EQ(ByteToCodePoint(b), static_cast<char32_t>(b)) << b;
  for (int b = 0xA1; b <= 0xAC; ++b) EXPECT_EQ(ByteToCodePoint(b), static_cast<char32_t>(b)) << b;
  for (int b = 0xAE; b <= 0xFF; ++b) EXPECT_EQ(ByteToCodePoint(b), static_cast<char32_t>(b)) << b;
}

TEST(ByteLevel, TheOthersFromU0100InByteOrder) {
  EXPECT_EQ(ByteToCodePoint(0x00), U'\u0100');
  EXPECT_EQ(ByteToCodePoint('\t'), U'\u0109');
  EXPECT_EQ(ByteToCodePoint('\n'), U'\u010A');  // 'Ċ'
  EXPECT_EQ(ByteToCodePoint(' '), U'\u0120');   // 'Ġ'
  EXPECT_EQ(ByteToCodePoint(0x7F), U'\u0121');  // after the 33 bytes 0x00..0x20
  EXPECT_EQ(ByteToCodePoint(0xA0), U'\u0142');
  EXPECT_EQ(ByteToCodePoint(0xAD), U'\u0143');  // the last one, 'Ń'
}

TEST(ByteLevel, IsABijectionWithItsInverse) {
  std::set<char32_t> seen;
  for (int b = 0; b < 256; ++b) {
    const char32_t c = ByteToCodePoint(b);
    EXPECT_TRUE(seen.insert(c).second) << b;
    EXPECT_EQ(CodePointToByte(c), b);
  }
  EXPECT_EQ(CodePointToByte(U' '), -1);  // a space is spelled U+0120
  EXPECT_EQ(CodePointToByte(U'\u0144'), -1);
  EXPECT_EQ(CodePointToByte(U'\u20AC'), -1);
}

TEST(ByteLevel, StringsBothWays) {
  std::string spelled;
  AppendByteLevel("Hello world\n\xE2\x82\xAC", &spelled);
  EXPECT_EQ(spelled, "Hello\xC4\xA0world\xC4\x8A\xC3\xA2\xC4\xA4\xC2\xAC");  // HelloĠworldĊâĤ¬
  std::string bytes;
  ASSERT_TRUE(ByteLevelToBytes(spelled, &bytes));
  EXPECT_EQ(bytes, "Hello world\n\xE2\x82\xAC");
  std::string kept = "x";
  EXPECT_FALSE(ByteLevelToBytes("a b", &kept));  // ' ' is not one of the 256
  EXPECT_EQ(kept, "x");
}

}  // namespace
}  // namespace tokenizer::internal
