#include "launcher/flag_checks.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace launcher {

CLI::Validator checked(std::function<std::string(std::string&)> expected) {
  return CLI::Validator(
      [expected](std::string& value) {
        const std::string given = value, what = expected(value);
        return what.empty() ? what : absl::StrCat("'", given, "': expected ", what);
      },
      "");
}

CLI::Validator integer_in(int64_t min, int64_t max, bool unbounded) {
  const std::string range = unbounded ? absl::StrCat("an integer >= ", min)
                                      : absl::StrCat("an integer in [", min, ", ", max, "]");
  return checked([=](std::string& v) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(v, &n) || n < min || n > max) return range;
    v = std::to_string(n);
    return std::string();
  });
}

absl::Status refuse_empty_values(const CLI::App& app, const std::vector<std::string>& args) {
  for (const std::string& arg : args) {
    const size_t eq = arg.find('=');
    if (absl::StartsWith(arg, "--") && eq + 1 == arg.size() &&
        app.get_option_no_throw(arg.substr(0, eq)) != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(arg, "'': expected a value"));
    }
  }
  return absl::OkStatus();
}

absl::Status flag_error(const CLI::ParseError& error) {
  std::string what = error.what();
  if (dynamic_cast<const CLI::ValidationError*>(&error) != nullptr) {
    if (size_t at = what.find(": '"); at != std::string::npos) what.replace(at, 2, "=");
  }
  return absl::InvalidArgumentError(what);
}

}  // namespace launcher
