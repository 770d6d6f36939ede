// Test-only: a strict parser for the trainer's JSON log lines — one flat
// object whose values are numbers, null or lists of numbers — so tests check
// that a line really is JSON of that shape, not just that it contains keys.
#pragma once

#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace trainer::testing {

struct JsonValue {
  bool is_null = false;
  bool is_list = false;
  double number = 0;
  std::vector<double> list;
};

using JsonObject = std::map<std::string, JsonValue>;

// nullopt when `line` is not exactly one such object (trailing garbage,
// unquoted keys, duplicate keys, nested objects, ... all fail).
inline std::optional<JsonObject> ParseJsonLine(const std::string& line) {
  size_t i = 0;
  auto ws = [&] {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
  };
  auto eat = [&](char c) {
    ws();
    if (i < line.size() && line[i] == c) {
      ++i;
      return true;
    }
    return false;
  };
  auto number = [&](double* out) {
    ws();
    const size_t start = i;
    if (i < line.size() && line[i] == '-') ++i;
    // JSON numbers: no leading '+', no bare '.', no hex, no inf/nan.
    if (i >= line.size() || line[i] < '0' || line[i] > '9') return false;
    while (i < line.size() && std::string("0123456789.eE+-").find(line[i]) !=
                                  std::string::npos) {
      ++i;
    }
    try {
      size_t used = 0;
      *out = std::stod(line.substr(start, i - start), &used);
      return used == i - start;
    } catch (...) {
      return false;
    }
  };
  JsonObject object;
  if (!eat('{')) return std::nullopt;
  if (eat('}')) return object;
  do {
    if (!eat('"')) return std::nullopt;
    const size_t end = line.find('"', i);
    if (end == std::string::npos) return std::nullopt;
    const std::string key = line.substr(i, end - i);
    i = end + 1;
    if (!eat(':')) return std::nullopt;
    JsonValue value;
    ws();
    if (line.compare(i, 4, "null") == 0) {
      value.is_null = true;
      i += 4;
    } else if (eat('[')) {
      value.is_list = true;
      if (!eat(']')) {
        do {
          double d = 0;
          if (!number(&d)) return std::nullopt;
          value.list.push_back(d);
        } while (eat(','));
        if (!eat(']')) return std::nullopt;
      }
    } else if (!number(&value.number)) {
      return std::nullopt;
    }
    if (!object.emplace(key, value).second) return std::nullopt;
  } while (eat(','));
  if (!eat('}')) return std::nullopt;
  ws();
  if (i != line.size()) return std::nullopt;
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
