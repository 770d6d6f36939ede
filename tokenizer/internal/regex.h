// The pre-tokenizers' regular expressions on PCRE2: `tokenizers` compiles
// them with Oniguruma (Ruby syntax, UTF-8); PCRE2 in UTF mode with Unicode
// properties (\p{L}, \p{N}, caseless matching by Unicode case folding,
// lookahead) and its JIT compiler runs the same patterns, after the
// translation TranslatePattern describes.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace tokenizer::internal {

// `pattern` (Oniguruma's syntax, as a tokenizer.json holds it) rewritten
// where PCRE2 reads the same text differently:
//   - \s: Oniguruma's Unicode \s also matches U+0085 (NEXT LINE), PCRE2's
//     does not; \s becomes [\s\x{85}] (inside a class, \s\x{85}) and \S
//     [^\s\x{85}].
//   - \w, \W, \d, \D: Oniguruma's Unicode \w is letters, marks, decimal
//     digits and connector punctuation; PCRE2's is letters, numbers and '_'.
//     \w becomes [\p{L}\p{M}\p{Nd}\p{Pc}], \d \p{Nd}.
// Refused (InvalidArgument, naming the construct): \h and \H (a hex digit in
// Oniguruma, horizontal space in PCRE2), \b and \B, and \S, \W or \D inside
// a character class.
absl::StatusOr<std::string> TranslatePattern(std::string_view pattern);

// A compiled pattern. Thread-safe; each thread matches with its own
// MatchState.
class Regex {
 public:
  // Compiles a tokenizer.json pattern (translated first). Errors
  // (InvalidArgument) give PCRE2's message and the offset.
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(std::string_view pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // One thread's match data and JIT stack.
  class MatchState {
   public:
    ~MatchState();
    MatchState(const MatchState&) = delete;
    MatchState& operator=(const MatchState&) = delete;

   private:
    friend class Regex;
    MatchState() = default;
    void* match_data_ = nullptr;
    void* match_context_ = nullptr;
    void* jit_stack_ = nullptr;
  };
  std::unique_ptr<MatchState> NewMatchState() const;

  // The first match in `subject` (well-formed UTF-8, not checked) at or after
  // byte `start`: 1 with [*begin, *end), 0 when there is none, or a negative
  // PCRE2 error code (ErrorMessage says what it means). Lookbehind and \b see
  // the subject before `start`.
  int Find(std::string_view subject, size_t start, MatchState* state, size_t* begin,
           size_t* end) const;

  static std::string ErrorMessage(int code);
  // Whether Find's error `code` is a limit (the JIT stack, the match or depth
  // limit) rather than a fault.
  static bool IsResourceLimit(int code);

 private:
  Regex() = default;
  void* code_ = nullptr;
  bool jit_ = false;
};

}  // namespace tokenizer::internal
