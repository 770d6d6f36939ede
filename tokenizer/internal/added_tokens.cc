#include "tokenizer/internal/added_tokens.h"

#include <unicode/uchar.h>

#include <cstring>

#include "tokenizer/internal/utf8.h"

namespace tokenizer::internal {
namespace {

// Rust regex's Unicode \w.
bool IsWordChar(char32_t c) {
  const UChar32 u = static_cast<UChar32>(c);
  if (u_hasBinaryProperty(u, UCHAR_ALPHABETIC) || u_hasBinaryProperty(u, UCHAR_JOIN_CONTROL)) {
    return true;
  }
  return (U_GET_GC_MASK(u) & (U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) != 0;
}

// Rust regex's Unicode \s.
bool IsSpace(char32_t c) { return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_WHITE_SPACE); }

// The start of the character that ends text[..end].
size_t PreviousCharStart(std::string_view text, size_t end) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) --i;
  return i;
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(const std::vector<std::string>& patterns,
                                     const std::vector<const AddedToken*>& tokens) {
  nodes_.emplace_back();
  for (size_t t = 0; t < patterns.size(); ++t) {
    const std::string& pattern = patterns[t];
    if (pattern.empty()) continue;
    int32_t node = 0;
    for (unsigned char b : pattern) {
      int32_t next = -1;
      for (const auto& [byte, child] : nodes_[node].children) {
        if (byte == b) next = child;
      }
      if (next < 0) {
        next = static_cast<int32_t>(nodes_.size());
        nodes_[node].children.emplace_back(b, next);
        nodes_.emplace_back();
      }
      node = next;
    }
    if (nodes_[node].token >= 0) continue;
    nodes_[node].token = static_cast<int32_t>(tokens_.size());
    tokens_.push_back(tokens[t]);
    first_byte_[static_cast<unsigned char>(pattern[0])] = true;
  }
  int count = 0;
  for (int b = 0; b < 256; ++b) {
    if (first_byte_[b]) {
      ++count;
      single_first_byte_ = b;
    }
  }
  if (count != 1) single_first_byte_ = -1;
}

bool AddedTokenMatcher::FindNext(std::string_view text, size_t from, size_t* begin, size_t* end,
                                 const AddedToken** token) const {
  if (tokens_.empty()) return false;
  const auto* data = reinterpret_cast<const unsigned char*>(text.data());
  for (size_t start = from; start < text.size(); ++start) {
    if (single_first_byte_ >= 0) {
      const void* hit = std::memchr(data + start, single_first_byte_, text.size() - start);
      if (hit == nullptr) return false;
      start = static_cast<const unsigned char*>(hit) - data;
    } else if (!first_byte_[data[start]]) {
      continue;
    }
    int32_t node = 0;
    int32_t found = -1;
    size_t found_end = 0;
    for (size_t i = start; i < text.size(); ++i) {
      int32_t next = -1;
      for (const auto& [byte, child] : nodes_[node].children) {
        if (byte == data[i]) next = child;
      }
      if (next < 0) break;
      node = next;
      if (nodes_[node].token >= 0) {
        found = nodes_[node].token;
        found_end = i + 1;
      }
    }
    if (found >= 0) {
      *begin = start;
      *end = found_end;
      *token = tokens_[found];
      return true;
    }
  }
  return false;
}

bool AddedTokenMatcher::Accept(std::string_view text, const AddedToken& token, size_t offset,
                               size_t* begin, size_t* end) {
  if (token.single_word) {
    if (*begin > 0) {
      size_t i = PreviousCharStart(text, *begin);
      if (IsWordChar(DecodeUtf8(text, &i))) return false;
    }
    if (*end < text.size()) {
      size_t i = *end;
      if (IsWordChar(DecodeUtf8(text, &i))) return false;
    }
  }
  if (token.lstrip) {
    size_t start = *begin;
    while (start > 0) {
      const size_t prev = PreviousCharStart(text, start);
      size_t i = prev;
      if (!IsSpace(DecodeUtf8(text, &i))) break;
      start = prev;
    }
    *begin = start > offset ? start : offset;
  }
  if (token.rstrip) {
    size_t stop = *end;
    while (stop < text.size()) {
      size_t i = stop;
      if (!IsSpace(DecodeUtf8(text, &i))) break;
      stop = i;
    }
    *end = stop;
  }
  return true;
}

}  // namespace tokenizer::internal
