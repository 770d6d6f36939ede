#include "tokenizer/internal/regex.h"

#include <pcre2.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tokenizer::internal {
namespace {

constexpr char kSpaceClass[] = R"(\s\x{85})";
constexpr char kWordClass[] = R"(\p{L}\p{M}\p{Nd}\p{Pc})";

// JIT stacks grow to this size; deeper matching fails with
// PCRE2_ERROR_JIT_STACKLIMIT instead of overflowing the thread's stack.
constexpr size_t kJitStackStart = 32 * 1024;
constexpr size_t kJitStackMax = 8 * 1024 * 1024;

}  // namespace

absl::StatusOr<std::string> TranslatePattern(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 16);
  int class_depth = 0;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[++i];
      const bool in_class = class_depth > 0;
      switch (e) {
        case 's':
          out += in_class ? std::string(kSpaceClass) : absl::StrCat("[", kSpaceClass, "]");
          continue;
        case 'w':
          out += in_class ? std::string(kWordClass) : absl::StrCat("[", kWordClass, "]");
          continue;
        case 'd': out += R"(\p{Nd})"; continue;
        case 'S':
        case 'W':
        case 'D':
          if (in_class) {
            return absl::InvalidArgumentError(
                absl::StrCat("\\", std::string(1, e), " inside a character class at offset ", i - 1,
                             ": expected it outside classes (Oniguruma and PCRE2 differ on it)"));
          }
          out += e == 'S'   ? absl::StrCat("[^", kSpaceClass, "]")
                 : e == 'W' ? absl::StrCat("[^", kWordClass, "]")
                            : std::string(R"(\P{Nd})");
          continue;
        case 'h':
        case 'H':
        case 'b':
        case 'B':
          return absl::InvalidArgumentError(
              absl::StrCat("\\", std::string(1, e), " at offset ", i - 1,
                           ": not supported (Oniguruma and PCRE2 read it differently)"));
        default:
          out += '\\';
          out += e;
          continue;
      }
    }
    if (c == '[') {
      ++class_depth;
      out += c;
      // A ']' or '^]' right after '[' is a literal.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (c == ']' && class_depth > 0) --class_depth;
    out += c;
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Regex>> Regex::Compile(std::string_view pattern) {
  absl::StatusOr<std::string> translated = TranslatePattern(pattern);
  if (!translated.ok()) return translated.status();
  int error = 0;
  PCRE2_SIZE offset = 0;
  // Ruby syntax: ^ and $ are line anchors.
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated->data()), translated->size(),
                    PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &error, &offset, nullptr);
  if (code == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("PCRE2 cannot compile it (as \"", *translated,
                                                   "\"): ", ErrorMessage(error), " at offset ",
                                                   offset));
  }
  std::unique_ptr<Regex> regex(new Regex);
  regex->code_ = code;
  regex->jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return regex;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

Regex::MatchState::~MatchState() {
  pcre2_match_data_free(static_cast<pcre2_match_data*>(match_data_));
  pcre2_match_context_free(static_cast<pcre2_match_context*>(match_context_));
  pcre2_jit_stack_free(static_cast<pcre2_jit_stack*>(jit_stack_));
}

std::unique_ptr<Regex::MatchState> Regex::NewMatchState() const {
  std::unique_ptr<MatchState> state(new MatchState);
  state->match_data_ =
      pcre2_match_data_create_from_pattern(static_cast<pcre2_code*>(code_), nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  state->match_context_ = context;
  if (jit_) {
    pcre2_jit_stack* stack = pcre2_jit_stack_create(kJitStackStart, kJitStackMax, nullptr);
    state->jit_stack_ = stack;
    pcre2_jit_stack_assign(context, nullptr, stack);
  }
  return state;
}

int Regex::Find(std::string_view subject, size_t start, MatchState* state, size_t* begin,
                size_t* end) const {
  auto* code = static_cast<pcre2_code*>(code_);
  auto* data = static_cast<pcre2_match_data*>(state->match_data_);
  auto* context = static_cast<pcre2_match_context*>(state->match_context_);
  const auto* text = reinterpret_cast<PCRE2_SPTR>(subject.data());
  const int rc =
      jit_ ? pcre2_jit_match(code, text, subject.size(), start, 0, data, context)
           : pcre2_match(code, text, subject.size(), start, PCRE2_NO_UTF_CHECK, data, context);
  if (rc == PCRE2_ERROR_NOMATCH) return 0;
  if (rc < 0) return rc;
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data);
  *begin = ovector[0];
  *end = ovector[1];
  return 1;
}

bool Regex::IsResourceLimit(int code) {
  return code == PCRE2_ERROR_JIT_STACKLIMIT || code == PCRE2_ERROR_MATCHLIMIT ||
         code == PCRE2_ERROR_DEPTHLIMIT || code == PCRE2_ERROR_HEAPLIMIT ||
         code == PCRE2_ERROR_NOMEMORY;
}

std::string Regex::ErrorMessage(int code) {
  PCRE2_UCHAR buffer[256];
  const int n = pcre2_get_error_message(code, buffer, sizeof(buffer));
  if (n < 0) return absl::StrCat("PCRE2 error ", code);
  return std::string(reinterpret_cast<const char*>(buffer), n);
}

}  // namespace tokenizer::internal
