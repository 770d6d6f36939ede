#include "tokenizer/testing/golden.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"

namespace tokenizer::test_data {

std::string TestdataPath(const std::string& name) {
  const std::string relative = "tokenizer/testdata/" + name;
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir != nullptr && workspace != nullptr) {
    return std::string(srcdir) + "/" + workspace + "/" + relative;
  }
  return relative;
}

nlohmann::json ReadTestdataJson(const std::string& name) {
  std::ifstream in(TestdataPath(name));
  EXPECT_TRUE(in) << TestdataPath(name);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return nlohmann::json::parse(buffer.str());
}

std::vector<TokenId> Ids(const nlohmann::json& value) { return value.get<std::vector<TokenId>>(); }

std::string FromHex(const std::string& hex) {
  std::string bytes;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    bytes.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return bytes;
}

std::string IdsDifference(const Tokenizer& tok, const std::vector<TokenId>& got,
                          const std::vector<TokenId>& want) {
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  std::ostringstream out;
  const auto show = [&](const std::vector<TokenId>& ids) {
    for (size_t k = (i >= 3 ? i - 3 : 0); k < ids.size() && k < i + 4; ++k) {
      auto token = tok.IdToToken(ids[k]);
      out << " " << ids[k] << "=" << nlohmann::json(std::string(token.value_or("?"))).dump();
    }
  };
  out << "first difference at " << i << " (got " << got.size() << " ids, want " << want.size()
      << ")\n  got: ";
  show(got);
  out << "\n want:";
  show(want);
  return out.str();
}

void ExpectBatchesEqual(const Tokenizer& tok, const std::vector<std::string>& strings,
                        const nlohmann::json& ids, const std::vector<int>& threads) {
  for (int n : threads) {
    absl::StatusOr<std::vector<std::vector<TokenId>>> batch =
        tok.EncodeBatch(strings, {.add_special_tokens = false}, n);
    ASSERT_TRUE(batch.ok()) << batch.status();
    ASSERT_EQ(batch->size(), strings.size());
    for (size_t i = 0; i < strings.size(); ++i) {
      EXPECT_EQ((*batch)[i], Ids(ids[i])) << "string " << i << ", " << n << " threads";
    }
  }
}

void ExpectDecodeCases(const Tokenizer& tok, const nlohmann::json& cases) {
  for (const nlohmann::json& c : cases) {
    const std::vector<TokenId> ids = Ids(c["ids"]);
    absl::StatusOr<std::string> got = tok.Decode(ids, {.skip_special_tokens = false});
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, c["text"].get<std::string>()) << c["ids"].dump();
    absl::StatusOr<std::string> got_skip = tok.Decode(ids);
    ASSERT_TRUE(got_skip.ok()) << got_skip.status();
    EXPECT_EQ(*got_skip, c["text_skip"].get<std::string>()) << c["ids"].dump();
  }
}

void ExpectInvalidUtf8Cases(const Tokenizer& tok, const nlohmann::json& cases) {
  for (const nlohmann::json& c : cases) {
    const std::string bytes = FromHex(c["hex"].get<std::string>());
    EncodeOptions options{.add_special_tokens = false,
                          .invalid_utf8 = EncodeOptions::InvalidUtf8::kReplace};
    absl::StatusOr<std::vector<TokenId>> got = tok.Encode(bytes, options);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, Ids(c["ids"])) << c["hex"];
    absl::StatusOr<std::vector<TokenId>> refused = tok.Encode(bytes);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << c["hex"];
  }
}

}  // namespace tokenizer::test_data
