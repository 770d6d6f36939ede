// GPT-2's byte-to-unicode map, which byte-level BPE vocabularies (GPT-2,
// Llama 3, Qwen2/3; `tokenizers`' ByteLevel pre-tokenizer and decoder) spell
// their tokens in: each of the 256 bytes is one printable character. The
// printable bytes '!'..'~', 0xA1..0xAC and 0xAE..0xFF stand for themselves
// (as the Latin-1 code points of the same value); the other 68 (0x00..0x20,
// 0x7F..0xA0, 0xAD) are U+0100, U+0101, ... in byte order, so the space
// 0x20 is U+0120 'Ġ' and the newline 0x0A is U+010A 'Ċ'.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace tokenizer::internal {

// The character that stands for `byte`.
char32_t ByteToCodePoint(uint8_t byte);

// The byte that `c` stands for, or -1 when `c` is none of the 256 characters.
int CodePointToByte(char32_t c);

// Appends the byte-level spelling of `bytes` (UTF-8, two bytes per
// character at most) to `out`.
void AppendByteLevel(std::string_view bytes, std::string* out);

// The bytes a byte-level token stands for, appended to `bytes`; false (and
// `bytes` unchanged) when `token` (valid UTF-8) holds a character that is not
// one of the 256.
bool ByteLevelToBytes(std::string_view token, std::string* bytes);

}  // namespace tokenizer::internal
