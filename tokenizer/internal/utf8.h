// UTF-8 as the tokenizer needs it: validation (the regular expressions run
// without their own check), the lossy conversion of decoded bytes (Rust's
// String::from_utf8_lossy, which `tokenizers`' ByteLevel decoder calls, and
// Python's bytes.decode("utf-8", "replace")), and encoding and decoding of
// single code points. UTF-8's structure only; no character properties.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace tokenizer::internal {

// The offset of the first byte of `text` that does not begin a well-formed
// UTF-8 sequence (RFC 3629: no overlong forms, no surrogates, nothing above
// U+10FFFF), or std::string_view::npos when `text` is all UTF-8.
size_t FindInvalidUtf8(std::string_view text);

// Appends `bytes` to `out` with each maximal subpart of an ill-formed
// sequence replaced by U+FFFD (Unicode's recommended practice, chapter 3
// "U+FFFD Substitution of Maximal Subparts"): "\xE2\x82a" gives "\uFFFDa",
// "\x80\x80" gives two U+FFFD, "\xF0\x80" two (0x80 cannot follow 0xF0).
void AppendUtf8Lossy(std::string_view bytes, std::string* out);

// Appends the UTF-8 encoding of `c` (at most U+10FFFF) to `out`.
void AppendUtf8(char32_t c, std::string* out);

// The code point at text[*i] of well-formed UTF-8 `text`; advances *i past it.
char32_t DecodeUtf8(std::string_view text, size_t* i);

// The length of the UTF-8 sequence that starts with lead byte `b` (1 for a
// byte that is no lead byte).
inline size_t Utf8SequenceLength(unsigned char b) {
  return b < 0xC0 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
}

}  // namespace tokenizer::internal
