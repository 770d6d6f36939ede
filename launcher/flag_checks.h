// CLI11 flag checks whose refusals name the flag, the value and what was
// expected — `--nproc='0': expected an integer >= 1` — written once for the
// command lines of //tools:launch (launcher/flags.h) and the trainer
// (trainer/options.h), which share --nproc, --threads-per-rank,
// --max-restarts and --timeout.
//
//   CLI::App app;
//   int nproc = 1;
//   launcher::add_integer(app, "--nproc", nproc, "ranks", 1, 1024);
//   if (absl::Status s = launcher::refuse_empty_values(app, args); !s.ok()) return s;
//   try {
//     app.parse(std::vector<std::string>(args.rbegin(), args.rend()));  // last-first
//   } catch (const CLI::ParseError& e) {
//     return launcher::flag_error(e);  // InvalidArgument "--nproc='0': expected ..."
//   }
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"

namespace launcher {

// A CLI11 transform: `expected` returns what a refused value should have
// been ("" when it takes the value, which it may rewrite into the spelling
// CLI11 converts). CLI11 words a refusal "--flag: 'value': expected ...",
// which flag_error turns into "--flag='value': expected ...".
CLI::Validator checked(std::function<std::string(std::string&)> expected);

// An integer in [min, max], "an integer >= min" when `unbounded`; passed on
// in decimal (CLI11 would read "010" as octal).
CLI::Validator integer_in(int64_t min, int64_t max, bool unbounded);

// --flag N into `out`: an integer in [min, max] (max: Int's largest unless
// given).
template <typename Int>
CLI::Option* add_integer(CLI::App& app, const std::string& flag, Int& out, const std::string& help,
                         int64_t min, int64_t max = std::numeric_limits<Int>::max()) {
  return app.add_option(flag, out, help)
      ->type_name("N")
      ->transform(integer_in(min, max, max == std::numeric_limits<Int>::max()));
}

// InvalidArgument "--flag='': expected a value" for the first of `args`
// that spells one of `app`'s flags "--flag=" with nothing after the '=':
// CLI11 would read it as a bare --flag and take the next argument as its
// value.
absl::Status refuse_empty_values(const CLI::App& app, const std::vector<std::string>& args);

// A CLI11 parse error as InvalidArgument with CLI11's words, a refusal by
// `checked` reworded "--flag='value': expected ...".
absl::Status flag_error(const CLI::ParseError& error);

}  // namespace launcher
