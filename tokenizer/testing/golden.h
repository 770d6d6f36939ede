// Test-only: what the tokenizer's tests read from tokenizer/testdata/ (the
// files tools/golden/tokenizer_golden.py and sentencepiece_golden.py write)
// and the comparisons both golden tests make.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer.h"

namespace tokenizer::test_data {

// tokenizer/testdata/<name> in the test's runfiles (or relative to the
// workspace root when run outside `bazel test`).
std::string TestdataPath(const std::string& name);

// tokenizer/testdata/<name> parsed as JSON (a file that cannot be read
// fails the test).
nlohmann::json ReadTestdataJson(const std::string& name);

// A JSON list of ids.
std::vector<TokenId> Ids(const nlohmann::json& value);

// "e29c" -> the bytes 0xe2 0x9c.
std::string FromHex(const std::string& hex);

// The first difference of two id lists, with the tokens around it spelled.
std::string IdsDifference(const Tokenizer& tok, const std::vector<TokenId>& got,
                          const std::vector<TokenId>& want);

// EncodeBatch of `strings` (no special tokens) on each number of `threads`
// gives `ids` (a JSON list of id lists, one per string).
void ExpectBatchesEqual(const Tokenizer& tok, const std::vector<std::string>& strings,
                        const nlohmann::json& ids, const std::vector<int>& threads);

// expected.json's "decode_cases" ({"ids", "text", "text_skip"}: id lists
// whose bytes are not UTF-8 across tokens): Decode with and without the
// special tokens gives each text.
void ExpectDecodeCases(const Tokenizer& tok, const nlohmann::json& cases);

// expected.json's "invalid_utf8" ({"hex", "ids"}): the bytes encode to the
// ids with InvalidUtf8::kReplace and are refused (InvalidArgument) by
// default.
void ExpectInvalidUtf8Cases(const Tokenizer& tok, const nlohmann::json& cases);

}  // namespace tokenizer::test_data
