// Test-only: reads the trainer's JSON log lines with nlohmann::json, and
// checks their shape — one flat object whose values are numbers, null or
// lists of numbers — so tests check that a line really is JSON of that
// shape, not just that it contains keys.
#pragma once

#include <algorithm>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace trainer::testing {

// nullopt when `line` is not exactly one such object (trailing garbage, NaN,
// a key given twice, a nested object, ... all fail).
inline std::optional<nlohmann::json> ParseJsonLine(const std::string& line) {
  std::set<std::string> keys;
  bool key_repeated = false;
  const nlohmann::json object = nlohmann::json::parse(
      line,
      [&](int /*depth*/, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
        if (event == nlohmann::json::parse_event_t::key) {
          key_repeated |= !keys.insert(parsed.get<std::string>()).second;
        }
        return true;
      },
      /*allow_exceptions=*/false);
  if (object.is_discarded() || key_repeated || !object.is_object()) return std::nullopt;
  for (const nlohmann::json& value : object) {
    const bool numbers =
        value.is_array() && std::all_of(value.begin(), value.end(),
                                        [](const nlohmann::json& v) { return v.is_number(); });
    if (!value.is_number() && !value.is_null() && !numbers) return std::nullopt;
  }
  return object;
}

// The lines of a file (empty when it cannot be read).
inline std::vector<std::string> ReadLines(const std::string& path) {
  std::vector<std::string> lines;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

}  // namespace trainer::testing
