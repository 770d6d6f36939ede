// Added tokens (a tokenizer.json's "added_tokens": special tokens such as
// <|endoftext|> and any other added text) found in text before it is split
// and merged, as `tokenizers`' AddedVocabulary finds them: the leftmost
// match, the longest at that place, then the next after its end (its
// AhoCorasick with MatchKind::LeftmostLongest), with each token's options
// applied to the match:
//   single_word  the match is dropped when a word character (Rust regex's
//                Unicode \w: Alphabetic, marks, decimal digits, connector
//                punctuation, Join_Control) touches it on either side;
//   lstrip       the match takes in the whitespace (White_Space) before it,
//                up to the end of the previous match;
//   rstrip       the match takes in the whitespace after it.
// Character properties come from ICU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tokenizer::internal {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
};

class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;
  // `patterns[i]` is the text that `tokens[i]` matches (its content, or its
  // content normalized); empty patterns never match. Of two tokens with the
  // same pattern the first wins.
  AddedTokenMatcher(const std::vector<std::string>& patterns,
                    const std::vector<const AddedToken*>& tokens);

  bool empty() const { return tokens_.empty(); }

  // Splits `text` into pieces of text and added tokens, in order: calls
  // on_text(piece) for each non-empty stretch between tokens and
  // on_token(id) for each token. Returns false when one of the calls does.
  template <typename OnText, typename OnToken>
  bool Split(std::string_view text, OnText&& on_text, OnToken&& on_token) const {
    size_t offset = 0;  // the end of the previous piece
    size_t search = 0;
    size_t begin, end;
    const AddedToken* token;
    while (FindNext(text, search, &begin, &end, &token)) {
      search = end;
      if (!Accept(text, *token, offset, &begin, &end)) continue;
      if (offset < begin && !on_text(text.substr(offset, begin - offset))) return false;
      if (!on_token(token->id)) return false;
      offset = end;
    }
    if (offset < text.size() && !on_text(text.substr(offset))) return false;
    return true;
  }

 private:
  // The leftmost-longest match at or after `from`.
  bool FindNext(std::string_view text, size_t from, size_t* begin, size_t* end,
                const AddedToken** token) const;
  // Applies single_word, lstrip and rstrip; false when the match is dropped.
  static bool Accept(std::string_view text, const AddedToken& token, size_t offset, size_t* begin,
                     size_t* end);

  struct Node {
    int32_t token = -1;  // index into tokens_
    std::vector<std::pair<unsigned char, int32_t>> children;
  };
  std::vector<Node> nodes_;
  std::vector<const AddedToken*> tokens_;
  bool first_byte_[256] = {};
  int single_first_byte_ = -1;  // the one first byte of every pattern, if there is one
};

}  // namespace tokenizer::internal
