#include "tokenizer/internal/byte_level.h"

#include <array>

#include "tokenizer/internal/utf8.h"

namespace tokenizer::internal {
namespace {

struct Tables {
  std::array<char32_t, 256> code_point{};
  // Indexed by code point; every character of the map is below U+0144.
  std::array<int16_t, 0x144> byte{};
};

bool StandsForItself(int b) {
  return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

const Tables& GetTables() {
  static const Tables tables = [] {
    Tables t;
    t.byte.fill(-1);
    char32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      t.code_point[b] = StandsForItself(b) ? static_cast<char32_t>(b) : next++;
      t.byte[t.code_point[b]] = static_cast<int16_t>(b);
    }
    return t;
  }();
  return tables;
}

}  // namespace

char32_t ByteToCodePoint(uint8_t byte) { return GetTables().code_point[byte]; }

int CodePointToByte(char32_t c) {
  const Tables& t = GetTables();
  return c < t.byte.size() ? t.byte[c] : -1;
}

void AppendByteLevel(std::string_view bytes, std::string* out) {
  const Tables& t = GetTables();
  for (unsigned char b : bytes) AppendUtf8(t.code_point[b], out);
}

bool ByteLevelToBytes(std::string_view token, std::string* bytes) {
  const size_t old_size = bytes->size();
  size_t i = 0;
  while (i < token.size()) {
    char32_t c = DecodeUtf8(token, &i);
    int b = CodePointToByte(c);
    if (b < 0) {
      bytes->resize(old_size);
      return false;
    }
    bytes->push_back(static_cast<char>(b));
  }
  return true;
}

}  // namespace tokenizer::internal
