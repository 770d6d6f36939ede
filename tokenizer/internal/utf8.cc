#include "tokenizer/internal/utf8.h"

#include <cstdint>
#include <cstring>

namespace tokenizer::internal {
namespace {

// The length of the well-formed sequence at text[i] (1 to 4), or, when it is
// ill-formed, minus the length of its maximal subpart (-1 to -3).
int SequenceAt(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char b = byte(i);
  if (b < 0x80) return 1;
  int need;
  unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b >= 0xE0 && b <= 0xEF) {
    need = 2;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    need = 3;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    return -1;
  }
  size_t k = i + 1;
  for (int n = 0; n < need; ++n, ++k) {
    if (k >= text.size()) return -static_cast<int>(k - i);
    const unsigned char c = byte(k);
    if (n == 0 ? (c < lo || c > hi) : (c < 0x80 || c > 0xBF)) return -static_cast<int>(k - i);
  }
  return need + 1;
}

}  // namespace

size_t FindInvalidUtf8(std::string_view text) {
  size_t i = 0;
  const size_t n = text.size();
  while (i < n) {
    // Eight ASCII bytes at a time.
    while (i + 8 <= n) {
      uint64_t word;
      std::memcpy(&word, text.data() + i, 8);
      if (word & 0x8080808080808080ULL) break;
      i += 8;
    }
    if (i >= n) break;
    if (static_cast<unsigned char>(text[i]) < 0x80) {
      ++i;
      continue;
    }
    const int len = SequenceAt(text, i);
    if (len < 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

void AppendUtf8Lossy(std::string_view bytes, std::string* out) {
  size_t i = 0;
  while (i < bytes.size()) {
    const size_t bad = FindInvalidUtf8(bytes.substr(i));
    if (bad == std::string_view::npos) {
      out->append(bytes.substr(i));
      return;
    }
    out->append(bytes.substr(i, bad));
    i += bad;
    out->append("\xEF\xBF\xBD");
    i += -SequenceAt(bytes, i);
  }
}

void AppendUtf8(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

char32_t DecodeUtf8(std::string_view text, size_t* i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char b = byte(*i);
  const size_t len = Utf8SequenceLength(b);
  char32_t c = len == 1 ? b : len == 2 ? (b & 0x1F) : len == 3 ? (b & 0x0F) : (b & 0x07);
  for (size_t k = 1; k < len; ++k) c = (c << 6) | (byte(*i + k) & 0x3F);
  *i += len;
  return c;
}

}  // namespace tokenizer::internal
