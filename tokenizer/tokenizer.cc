#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <fstream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "tokenizer/internal/added_tokens.h"
#include "tokenizer/internal/bpe.h"
#include "tokenizer/internal/byte_level.h"
#include "tokenizer/internal/normalizer.h"
#include "tokenizer/internal/regex.h"
#include "tokenizer/internal/sentencepiece_tokenizer.h"
#include "tokenizer/internal/utf8.h"

namespace tokenizer {
namespace {

using json = nlohmann::json;

// GPT-2's pre-tokenizer expression: the one a ByteLevel pre-tokenizer with
// use_regex applies (`tokenizers`' byte_level.rs).
constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

constexpr char kNormalizers[] = "NFC, NFD, NFKC, NFKD or a Sequence of them";
constexpr char kPreTokenizers[] =
    "ByteLevel, or a Sequence of Split pre-tokenizers ending with ByteLevel (byte-level BPE as "
    "GPT-2, Llama 3 and Qwen2 use it)";
constexpr char kPostProcessors[] = "TemplateProcessing, ByteLevel or a Sequence of them";
constexpr char kDecoders[] = "ByteLevel or null";

// Debian's Abseil has its own string_view, which std::string_view does not
// convert to.
absl::string_view Absl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// A JSON value as an error message shows it: at most 80 characters.
std::string Show(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

// Reads the fields of a tokenizer.json, with the file named in every error.
class Reader {
 public:
  Reader(std::string_view who, std::string_view origin) : who_(who), origin_(origin) {}

  absl::Status DataLoss(absl::string_view where, const json* value,
                        absl::string_view expected) const {
    if (value == nullptr) {
      return absl::DataLossError(
          absl::StrCat(who_, ": ", origin_, ": ", where, " is missing: expected ", expected));
    }
    return absl::DataLossError(absl::StrCat(who_, ": ", origin_, ": ", where, " = ", Show(*value),
                                            ": expected ", expected));
  }

  absl::Status Unimplemented(absl::string_view where, const json& value,
                             absl::string_view expected) const {
    return absl::UnimplementedError(absl::StrCat(who_, ": ", origin_, ": ", where, " = ",
                                                 Show(value), ": not supported: expected ",
                                                 expected));
  }

  absl::Status Error(absl::StatusCode code, absl::string_view message) const {
    return absl::Status(code, absl::StrCat(who_, ": ", origin_, ": ", message));
  }

  // The member `key` of object `object`, or nullptr when it is absent.
  static const json* Find(const json& object, const char* key) {
    auto it = object.find(key);
    return it == object.end() ? nullptr : &*it;
  }

  absl::StatusOr<const json*> Require(const json& object, const char* key, absl::string_view where,
                                      absl::string_view expected) const {
    const json* value = Find(object, key);
    if (value == nullptr) return DataLoss(where, nullptr, expected);
    return value;
  }

  absl::StatusOr<std::string> String(const json& object, const char* key, absl::string_view where,
                                     absl::string_view expected = "a string") const {
    const json* value = Find(object, key);
    if (value == nullptr || !value->is_string()) return DataLoss(where, value, expected);
    return value->get<std::string>();
  }

  // A boolean member; `fallback` when it is absent.
  absl::StatusOr<bool> Bool(const json& object, const char* key, absl::string_view where,
                            bool fallback) const {
    const json* value = Find(object, key);
    if (value == nullptr) return fallback;
    if (!value->is_boolean()) return DataLoss(where, value, "true or false");
    return value->get<bool>();
  }

  absl::StatusOr<TokenId> Id(const json& value, absl::string_view where) const {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
        value.get<int64_t>() > std::numeric_limits<TokenId>::max()) {
      return DataLoss(where, &value, "an id in [0, 2^31)");
    }
    return static_cast<TokenId>(value.get<int64_t>());
  }

 private:
  std::string who_;
  std::string origin_;
};

#define TOKENIZER_ASSIGN_OR_RETURN(lhs, expr)   \
  auto lhs##_or = (expr);                       \
  if (!lhs##_or.ok()) return lhs##_or.status(); \
  auto lhs = std::move(*lhs##_or)

#define TOKENIZER_RETURN_IF_ERROR(expr) \
  do {                                  \
    absl::Status status_ = (expr);      \
    if (!status_.ok()) return status_;  \
  } while (0)

// One thread's state: match data for each expression, the BPE buffers and
// word cache, and the buffers of the text it rewrites.
struct Scratch {
  std::vector<std::unique_ptr<internal::Regex::MatchState>> match;
  internal::BpeScratch bpe;
  std::string prefixed;
  std::string normalized;
  std::string replaced;
  absl::Status error;
};

}  // namespace

struct internal::TokenizerImpl {
  std::string origin;

  // A tokenizer.model: everything below but the scratch pool is unused.
  std::unique_ptr<internal::SentencePieceTokenizer> sentencepiece;

  // Encoding, in order.
  internal::AddedTokenMatcher raw_added;  // tokens with "normalized": false
  std::optional<internal::Normalizer> normalizer;
  internal::AddedTokenMatcher normalized_added;
  // The Split expressions, then ByteLevel's own when it has use_regex.
  std::vector<std::unique_ptr<internal::Regex>> splits;
  size_t byte_level_stage = 0;  // the number of Splits before ByteLevel
  bool add_prefix_space = false;
  std::unique_ptr<internal::Bpe> bpe;
  std::vector<TokenId> template_prefix;
  std::vector<TokenId> template_suffix;

  // Tokens by id, and decoding.
  std::vector<internal::AddedToken> added_tokens;
  std::vector<std::string> tokens;  // by id: the added token's content, else the vocabulary's
  std::vector<bool> known;
  std::vector<bool> special;
  std::vector<std::string> token_bytes;  // by id, what the ByteLevel decoder makes of it
  bool byte_level_decoder = false;
  absl::flat_hash_map<std::string, TokenId> token_to_id;

  mutable std::mutex pool_mutex;
  mutable std::vector<std::unique_ptr<Scratch>> pool;

  std::unique_ptr<Scratch> Acquire() const {
    {
      std::lock_guard<std::mutex> lock(pool_mutex);
      if (!pool.empty()) {
        std::unique_ptr<Scratch> scratch = std::move(pool.back());
        pool.pop_back();
        return scratch;
      }
    }
    auto scratch = std::make_unique<Scratch>();
    for (const auto& regex : splits) scratch->match.push_back(regex->NewMatchState());
    return scratch;
  }

  void Release(std::unique_ptr<Scratch> scratch) const {
    scratch->error = absl::OkStatus();
    std::lock_guard<std::mutex> lock(pool_mutex);
    pool.push_back(std::move(scratch));
  }

  absl::Status EncodeOne(std::string_view text, const EncodeOptions& options, Scratch& s,
                         std::vector<TokenId>* out, std::string_view who) const;
  bool EncodeSegment(std::string_view piece, Scratch& s, std::vector<TokenId>* out) const;
  bool PreTokenize(std::string_view piece, size_t stage, Scratch& s,
                   std::vector<TokenId>* out) const;
  absl::StatusOr<std::string> DecodeImpl(absl::Span<const TokenId> ids,
                                         const DecodeOptions& options, bool lossy) const;
};

namespace {

absl::Status ParseNormalizer(const Reader& r, const json& value, const std::string& where,
                             std::vector<internal::NormalizationForm>* forms) {
  if (value.is_null()) return absl::OkStatus();
  if (!value.is_object()) return r.DataLoss(where, &value, "an object or null");
  TOKENIZER_ASSIGN_OR_RETURN(type, r.String(value, "type", where + ".type"));
  if (type == "Sequence") {
    TOKENIZER_ASSIGN_OR_RETURN(
        list, r.Require(value, "normalizers", where + ".normalizers", "a list of normalizers"));
    if (!list->is_array()) return r.DataLoss(where + ".normalizers", list, "a list");
    for (size_t i = 0; i < list->size(); ++i) {
      TOKENIZER_RETURN_IF_ERROR(
          ParseNormalizer(r, (*list)[i], absl::StrCat(where, ".normalizers[", i, "]"), forms));
    }
    return absl::OkStatus();
  }
  static const std::pair<const char*, internal::NormalizationForm> kForms[] = {
      {"NFC", internal::NormalizationForm::kNfc},
      {"NFD", internal::NormalizationForm::kNfd},
      {"NFKC", internal::NormalizationForm::kNfkc},
      {"NFKD", internal::NormalizationForm::kNfkd}};
  for (const auto& [name, form] : kForms) {
    if (type == name) {
      forms->push_back(form);
      return absl::OkStatus();
    }
  }
  return r.Unimplemented(where + ".type", value["type"], kNormalizers);
}

struct PreTokenizerSpec {
  std::vector<std::string> split_patterns;
  std::vector<std::string> split_wheres;  // where each pattern is in the file
  bool byte_level = false;
  bool add_prefix_space = false;
  bool use_regex = false;
};

absl::Status ParsePreTokenizerStep(const Reader& r, const json& value, const std::string& where,
                                   PreTokenizerSpec* spec) {
  if (!value.is_object()) return r.DataLoss(where, &value, "a pre-tokenizer object");
  TOKENIZER_ASSIGN_OR_RETURN(type, r.String(value, "type", where + ".type"));
  if (spec->byte_level) {
    return r.Unimplemented(where + ".type", value["type"],
                           "nothing after the ByteLevel pre-tokenizer");
  }
  if (type == "Split") {
    TOKENIZER_ASSIGN_OR_RETURN(
        pattern, r.Require(value, "pattern", where + ".pattern", "{\"Regex\": \"...\"}"));
    if (!pattern->is_object()) return r.DataLoss(where + ".pattern", pattern, "an object");
    const json* regex = Reader::Find(*pattern, "Regex");
    if (regex == nullptr) {
      if (Reader::Find(*pattern, "String") != nullptr) {
        return r.Unimplemented(where + ".pattern", *pattern, "a Regex pattern");
      }
      return r.DataLoss(where + ".pattern", pattern, "{\"Regex\": \"...\"}");
    }
    if (!regex->is_string()) return r.DataLoss(where + ".pattern.Regex", regex, "a string");
    TOKENIZER_ASSIGN_OR_RETURN(behavior, r.String(value, "behavior", where + ".behavior"));
    if (behavior != "Isolated") {
      return r.Unimplemented(where + ".behavior", value["behavior"], "\"Isolated\"");
    }
    TOKENIZER_ASSIGN_OR_RETURN(invert, r.Bool(value, "invert", where + ".invert", false));
    if (invert) return r.Unimplemented(where + ".invert", value["invert"], "false");
    spec->split_patterns.push_back(regex->get<std::string>());
    spec->split_wheres.push_back(where + ".pattern.Regex");
    return absl::OkStatus();
  }
  if (type == "ByteLevel") {
    // `tokenizers`' defaults for absent fields.
    TOKENIZER_ASSIGN_OR_RETURN(
        prefix, r.Bool(value, "add_prefix_space", where + ".add_prefix_space", true));
    TOKENIZER_ASSIGN_OR_RETURN(use_regex, r.Bool(value, "use_regex", where + ".use_regex", true));
    TOKENIZER_RETURN_IF_ERROR(
        r.Bool(value, "trim_offsets", where + ".trim_offsets", true).status());
    spec->byte_level = true;
    spec->add_prefix_space = prefix;
    spec->use_regex = use_regex;
    return absl::OkStatus();
  }
  return r.Unimplemented(where + ".type", value["type"], kPreTokenizers);
}

absl::Status ParsePreTokenizer(const Reader& r, const json* value, PreTokenizerSpec* spec) {
  const std::string where = "pre_tokenizer";
  if (value == nullptr || value->is_null()) {
    return r.Unimplemented(where, value == nullptr ? json() : *value, kPreTokenizers);
  }
  if (value->is_object() && value->value("type", "") == "Sequence") {
    TOKENIZER_ASSIGN_OR_RETURN(list, r.Require(*value, "pretokenizers", where + ".pretokenizers",
                                               "a list of pre-tokenizers"));
    if (!list->is_array()) return r.DataLoss(where + ".pretokenizers", list, "a list");
    for (size_t i = 0; i < list->size(); ++i) {
      TOKENIZER_RETURN_IF_ERROR(ParsePreTokenizerStep(
          r, (*list)[i], absl::StrCat(where, ".pretokenizers[", i, "]"), spec));
    }
  } else {
    TOKENIZER_RETURN_IF_ERROR(ParsePreTokenizerStep(r, *value, where, spec));
  }
  if (!spec->byte_level) return r.Unimplemented(where, *value, kPreTokenizers);
  return absl::OkStatus();
}

// The ids TemplateProcessing's single template puts before and after $A.
absl::Status ParseTemplate(const Reader& r, const json& value, const std::string& where,
                           std::vector<TokenId>* prefix, std::vector<TokenId>* suffix) {
  TOKENIZER_ASSIGN_OR_RETURN(
      single, r.Require(value, "single", where + ".single", "the single-sequence template"));
  if (!single->is_array()) return r.DataLoss(where + ".single", single, "a list");
  const json* special = Reader::Find(value, "special_tokens");
  int sequences = 0;
  for (size_t i = 0; i < single->size(); ++i) {
    const json& item = (*single)[i];
    const std::string item_where = absl::StrCat(where, ".single[", i, "]");
    if (!item.is_object()) return r.DataLoss(item_where, &item, "an object");
    if (const json* seq = Reader::Find(item, "Sequence")) {
      if (!seq->is_object() || seq->value("id", "") != "A") {
        return r.DataLoss(item_where, &item, "{\"Sequence\": {\"id\": \"A\", ...}}");
      }
      ++sequences;
      continue;
    }
    const json* tok = Reader::Find(item, "SpecialToken");
    if (tok == nullptr || !tok->is_object()) {
      return r.DataLoss(item_where, &item, "a Sequence or a SpecialToken");
    }
    TOKENIZER_ASSIGN_OR_RETURN(name, r.String(*tok, "id", item_where + ".SpecialToken.id"));
    const json* entry = special == nullptr ? nullptr : Reader::Find(*special, name.c_str());
    const std::string entry_where = absl::StrCat(where, ".special_tokens[\"", name, "\"]");
    if (entry == nullptr || !entry->is_object()) {
      return r.DataLoss(entry_where, entry, "the special token the template names");
    }
    TOKENIZER_ASSIGN_OR_RETURN(ids, r.Require(*entry, "ids", entry_where + ".ids", "its ids"));
    if (!ids->is_array()) return r.DataLoss(entry_where + ".ids", ids, "a list of ids");
    for (size_t k = 0; k < ids->size(); ++k) {
      TOKENIZER_ASSIGN_OR_RETURN(id, r.Id((*ids)[k], absl::StrCat(entry_where, ".ids[", k, "]")));
      (sequences == 0 ? prefix : suffix)->push_back(id);
    }
  }
  if (sequences != 1) return r.DataLoss(where + ".single", single, "exactly one $A");
  return absl::OkStatus();
}

absl::Status ParsePostProcessor(const Reader& r, const json* value, std::vector<TokenId>* prefix,
                                std::vector<TokenId>* suffix) {
  if (value == nullptr || value->is_null()) return absl::OkStatus();
  const std::string where = "post_processor";
  if (!value->is_object()) return r.DataLoss(where, value, "an object or null");
  std::vector<std::pair<const json*, std::string>> steps;
  TOKENIZER_ASSIGN_OR_RETURN(type, r.String(*value, "type", where + ".type"));
  if (type == "Sequence") {
    TOKENIZER_ASSIGN_OR_RETURN(
        list, r.Require(*value, "processors", where + ".processors", "a list of post-processors"));
    if (!list->is_array()) return r.DataLoss(where + ".processors", list, "a list");
    for (size_t i = 0; i < list->size(); ++i) {
      steps.emplace_back(&(*list)[i], absl::StrCat(where, ".processors[", i, "]"));
    }
  } else {
    steps.emplace_back(value, where);
  }
  bool have_template = false;
  for (const auto& [step, step_where] : steps) {
    if (!step->is_object()) return r.DataLoss(step_where, step, "an object");
    TOKENIZER_ASSIGN_OR_RETURN(step_type, r.String(*step, "type", step_where + ".type"));
    if (step_type == "ByteLevel") continue;  // offsets only
    if (step_type == "TemplateProcessing" && !have_template) {
      have_template = true;
      TOKENIZER_RETURN_IF_ERROR(ParseTemplate(r, *step, step_where, prefix, suffix));
      continue;
    }
    return r.Unimplemented(step_where + ".type", (*step)["type"], kPostProcessors);
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> ParseDecoder(const Reader& r, const json* value) {
  if (value == nullptr || value->is_null()) return false;
  const std::string where = "decoder";
  if (!value->is_object()) return r.DataLoss(where, value, "an object or null");
  TOKENIZER_ASSIGN_OR_RETURN(type, r.String(*value, "type", where + ".type"));
  if (type == "ByteLevel") return true;
  if (type == "Sequence") {
    const json* list = Reader::Find(*value, "decoders");
    if (list != nullptr && list->is_array() && list->size() == 1 && (*list)[0].is_object() &&
        (*list)[0].value("type", "") == "ByteLevel") {
      return true;
    }
    return r.Unimplemented(where, *value, kDecoders);
  }
  return r.Unimplemented(where + ".type", (*value)["type"], kDecoders);
}

std::string Quote(std::string_view s) { return absl::StrCat("\"", Absl(s), "\""); }

absl::StatusOr<std::unique_ptr<internal::TokenizerImpl>> Build(const Reader& r, const json& root,
                                                               std::string_view origin);

}  // namespace

namespace {

std::unique_ptr<internal::TokenizerImpl> SentencePieceImpl(
    std::unique_ptr<internal::SentencePieceTokenizer> sentencepiece, std::string_view origin) {
  auto impl = std::make_unique<internal::TokenizerImpl>();
  impl->origin = std::string(origin);
  impl->sentencepiece = std::move(sentencepiece);
  return impl;
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<internal::TokenizerImpl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

absl::StatusOr<Tokenizer> Tokenizer::FromFile(const std::string& path) {
  const char* who = "tokenizer::Tokenizer::FromFile";
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(who, ": ", path,
                                            ": cannot be opened: expected a readable "
                                            "tokenizer.json or tokenizer.model"));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return absl::NotFoundError(absl::StrCat(who, ": ", path, ": read failed"));
  const std::string text = buffer.str();
  const Reader r(who, path);
  if (text.empty()) {
    return r.Error(absl::StatusCode::kDataLoss,
                   "the file is empty: expected a tokenizer.json or a SentencePiece "
                   "tokenizer.model");
  }
  // Which of the two: a tokenizer.json is a JSON object; a tokenizer.model a
  // protobuf message, whose first byte is its first piece's key (0x0A, a
  // newline to JSON) and whose second that piece's length, which may be '{'
  // (123): text that looks like JSON but does not parse is tried as a model
  // too, unless the name says .json.
  const size_t first = text.find_first_not_of(" \t\r\n");
  const bool json_name = absl::EndsWith(path, ".json");
  if (json_name || (first != std::string::npos && text[first] == '{')) {
    json root;
    try {
      root = json::parse(text);
    } catch (const json::exception& e) {
      if (!json_name && text[0] == '\x0a') {
        auto sentencepiece = internal::SentencePieceTokenizer::Load(text, who, path);
        if (sentencepiece.ok())
          return Tokenizer(SentencePieceImpl(std::move(*sentencepiece), path));
      }
      return r.Error(absl::StatusCode::kDataLoss,
                     absl::StrCat("malformed JSON: ", e.what(), ": expected a tokenizer.json"));
    }
    TOKENIZER_ASSIGN_OR_RETURN(impl, Build(r, root, path));
    return Tokenizer(std::move(impl));
  }
  std::string library_error;
  auto sentencepiece = internal::SentencePieceTokenizer::Load(text, who, path, &library_error);
  // A *.model, or a model the library read (and this library refused), says
  // what is wrong with it as a model.
  if (sentencepiece.ok()) return Tokenizer(SentencePieceImpl(std::move(*sentencepiece), path));
  if (library_error.empty() || absl::EndsWith(path, ".model")) return sentencepiece.status();
  return r.Error(
      absl::StatusCode::kDataLoss,
      absl::StrFormat("neither a tokenizer.json (it starts with byte 0x%02x, not '{') nor a "
                      "SentencePiece tokenizer.model (libsentencepiece: %s)",
                      static_cast<unsigned char>(text[first == std::string::npos ? 0 : first]),
                      library_error));
}

absl::StatusOr<Tokenizer> Tokenizer::FromSentencePiece(std::string_view model,
                                                       std::string_view origin) {
  TOKENIZER_ASSIGN_OR_RETURN(sentencepiece,
                             internal::SentencePieceTokenizer::Load(
                                 model, "tokenizer::Tokenizer::FromSentencePiece", origin));
  return Tokenizer(SentencePieceImpl(std::move(sentencepiece), origin));
}

absl::StatusOr<Tokenizer> Tokenizer::FromJson(std::string_view json_text, std::string_view origin) {
  const Reader r("tokenizer::Tokenizer::FromJson", origin);
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    return r.Error(absl::StatusCode::kDataLoss,
                   absl::StrCat("malformed JSON: ", e.what(), ": expected a tokenizer.json"));
  }
  TOKENIZER_ASSIGN_OR_RETURN(impl, Build(r, root, origin));
  return Tokenizer(std::move(impl));
}

namespace {

absl::StatusOr<std::unique_ptr<internal::TokenizerImpl>> Build(const Reader& r, const json& root,
                                                               std::string_view origin) {
  if (!root.is_object()) return r.DataLoss("the file", &root, "a JSON object");
  auto impl = std::make_unique<internal::TokenizerImpl>();
  impl->origin = std::string(origin);

  for (const char* key : {"truncation", "padding"}) {
    const json* value = Reader::Find(root, key);
    if (value != nullptr && !value->is_null()) return r.Unimplemented(key, *value, "null");
  }

  // The model.
  TOKENIZER_ASSIGN_OR_RETURN(model, r.Require(root, "model", "model", "the BPE model"));
  if (!model->is_object()) return r.DataLoss("model", model, "an object");
  const json* type = Reader::Find(*model, "type");
  if (type != nullptr && (!type->is_string() || type->get<std::string>() != "BPE")) {
    if (!type->is_string()) return r.DataLoss("model.type", type, "a string");
    return r.Unimplemented("model.type", *type, "\"BPE\"");
  }
  if (const json* dropout = Reader::Find(*model, "dropout");
      dropout != nullptr && !dropout->is_null() &&
      !(dropout->is_number() && dropout->get<double>() == 0.0)) {
    return r.Unimplemented("model.dropout", *dropout, "null (no BPE dropout)");
  }
  TOKENIZER_ASSIGN_OR_RETURN(byte_fallback,
                             r.Bool(*model, "byte_fallback", "model.byte_fallback", false));
  if (byte_fallback) return r.Unimplemented("model.byte_fallback", true, "false");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const json* value = Reader::Find(*model, key);
    if (value != nullptr && !value->is_null() &&
        !(value->is_string() && value->get<std::string>().empty())) {
      return r.Unimplemented(absl::StrCat("model.", key), *value, "null or \"\"");
    }
  }
  TOKENIZER_ASSIGN_OR_RETURN(ignore_merges,
                             r.Bool(*model, "ignore_merges", "model.ignore_merges", false));
  TOKENIZER_ASSIGN_OR_RETURN(fuse_unk, r.Bool(*model, "fuse_unk", "model.fuse_unk", false));

  TOKENIZER_ASSIGN_OR_RETURN(
      vocab, r.Require(*model, "vocab", "model.vocab", "an object of tokens and their ids"));
  if (!vocab->is_object()) return r.DataLoss("model.vocab", vocab, "an object of tokens and ids");
  absl::flat_hash_map<std::string_view, TokenId> vocab_ids;
  vocab_ids.reserve(vocab->size());
  TokenId max_id = -1;
  std::vector<const std::string*> vocab_by_id;
  for (const auto& [token, value] : vocab->items()) {
    const std::string where = absl::StrCat("model.vocab[", Quote(token), "]");
    TOKENIZER_ASSIGN_OR_RETURN(id, r.Id(value, where));
    vocab_ids.emplace(token, id);
    if (static_cast<size_t>(id) >= vocab_by_id.size()) vocab_by_id.resize(id + 1, nullptr);
    if (vocab_by_id[id] != nullptr) {
      return r.DataLoss(
          where, &value,
          absl::StrCat("an id of its own (", id, " is also ", Quote(*vocab_by_id[id]), "'s)"));
    }
    vocab_by_id[id] = &token;
    max_id = std::max(max_id, id);
  }

  std::optional<TokenId> unk_id;
  if (const json* unk = Reader::Find(*model, "unk_token"); unk != nullptr && !unk->is_null()) {
    if (!unk->is_string()) return r.DataLoss("model.unk_token", unk, "a string or null");
    auto it = vocab_ids.find(unk->get<std::string>());
    if (it == vocab_ids.end()) return r.DataLoss("model.unk_token", unk, "a token of model.vocab");
    unk_id = it->second;
  }

  TOKENIZER_ASSIGN_OR_RETURN(merges,
                             r.Require(*model, "merges", "model.merges", "the list of merges"));
  if (!merges->is_array()) return r.DataLoss("model.merges", merges, "a list of merges");
  std::vector<internal::Bpe::Merge> bpe_merges;
  bpe_merges.reserve(merges->size());
  std::string merged;
  for (size_t i = 0; i < merges->size(); ++i) {
    const json& m = (*merges)[i];
    const std::string where = absl::StrCat("model.merges[", i, "]");
    std::string_view left, right;
    std::string line;
    if (m.is_string()) {
      line = m.get<std::string>();
      const size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        return r.DataLoss(where, &m, "two tokens separated by one space, \"a b\"");
      }
      left = std::string_view(line).substr(0, space);
      right = std::string_view(line).substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get_ref<const std::string&>();
      right = m[1].get_ref<const std::string&>();
    } else {
      return r.DataLoss(where, &m, "\"a b\" or [\"a\", \"b\"]");
    }
    merged.assign(left);
    merged.append(right);
    TokenId ids[3];
    const std::string_view parts[3] = {left, right, merged};
    for (int k = 0; k < 3; ++k) {
      auto it = vocab_ids.find(parts[k]);
      if (it == vocab_ids.end()) {
        return r.DataLoss(where, &m,
                          absl::StrCat("tokens in model.vocab (", Quote(parts[k]),
                                       k == 2 ? ", the two joined, " : " ", "is not)"));
      }
      ids[k] = it->second;
    }
    bpe_merges.push_back({ids[0], ids[1], ids[2]});
  }
  std::vector<std::pair<std::string, TokenId>> byte_vocab;
  byte_vocab.reserve(vocab_ids.size());
  for (const auto& [token, id] : vocab_ids) {
    std::string bytes;
    if (internal::ByteLevelToBytes(token, &bytes)) byte_vocab.emplace_back(std::move(bytes), id);
  }
  impl->bpe =
      std::make_unique<internal::Bpe>(byte_vocab, bpe_merges, ignore_merges, unk_id, fuse_unk);

  // The normalizer.
  std::vector<internal::NormalizationForm> forms;
  if (const json* n = Reader::Find(root, "normalizer")) {
    TOKENIZER_RETURN_IF_ERROR(ParseNormalizer(r, *n, "normalizer", &forms));
  }
  if (!forms.empty()) {
    absl::StatusOr<internal::Normalizer> normalizer = internal::Normalizer::Create(forms);
    if (!normalizer.ok()) {
      return r.Error(normalizer.status().code(),
                     absl::StrCat("normalizer: ", normalizer.status().message()));
    }
    impl->normalizer = std::move(*normalizer);
  }

  // The pre-tokenizers.
  PreTokenizerSpec pre;
  TOKENIZER_RETURN_IF_ERROR(ParsePreTokenizer(r, Reader::Find(root, "pre_tokenizer"), &pre));
  for (size_t i = 0; i < pre.split_patterns.size() + (pre.use_regex ? 1 : 0); ++i) {
    const bool gpt2 = i == pre.split_patterns.size();
    const std::string& pattern = gpt2 ? std::string(kGpt2Pattern) : pre.split_patterns[i];
    absl::StatusOr<std::unique_ptr<internal::Regex>> regex = internal::Regex::Compile(pattern);
    if (!regex.ok()) {
      return r.Error(absl::StatusCode::kUnimplemented,
                     absl::StrCat(pre.split_wheres[i], " = ", Show(json(pattern)), ": ",
                                  regex.status().message()));
    }
    impl->splits.push_back(std::move(*regex));
  }
  impl->byte_level_stage = pre.split_patterns.size();
  impl->add_prefix_space = pre.add_prefix_space;

  // Added tokens.
  std::vector<internal::AddedToken>& added = impl->added_tokens;
  if (const json* list = Reader::Find(root, "added_tokens"); list != nullptr && !list->is_null()) {
    if (!list->is_array()) return r.DataLoss("added_tokens", list, "a list of added tokens");
    for (size_t i = 0; i < list->size(); ++i) {
      const json& t = (*list)[i];
      const std::string where = absl::StrCat("added_tokens[", i, "]");
      if (!t.is_object()) return r.DataLoss(where, &t, "an object");
      internal::AddedToken token;
      TOKENIZER_ASSIGN_OR_RETURN(id_value, r.Require(t, "id", where + ".id", "its id"));
      TOKENIZER_ASSIGN_OR_RETURN(id, r.Id(*id_value, where + ".id"));
      token.id = id;
      TOKENIZER_ASSIGN_OR_RETURN(content, r.String(t, "content", where + ".content"));
      token.content = std::move(content);
      TOKENIZER_ASSIGN_OR_RETURN(sw, r.Bool(t, "single_word", where + ".single_word", false));
      TOKENIZER_ASSIGN_OR_RETURN(ls, r.Bool(t, "lstrip", where + ".lstrip", false));
      TOKENIZER_ASSIGN_OR_RETURN(rs, r.Bool(t, "rstrip", where + ".rstrip", false));
      TOKENIZER_ASSIGN_OR_RETURN(norm, r.Bool(t, "normalized", where + ".normalized", true));
      TOKENIZER_ASSIGN_OR_RETURN(sp, r.Bool(t, "special", where + ".special", false));
      token.single_word = sw;
      token.lstrip = ls;
      token.rstrip = rs;
      token.normalized = norm;
      token.special = sp;
      max_id = std::max(max_id, id);
      added.push_back(std::move(token));
    }
  }
  // `tokenizers` matches the special tokens first, then the others, each set
  // in the file's order.
  std::vector<std::string> raw_patterns, normalized_patterns;
  std::vector<const internal::AddedToken*> raw_tokens, normalized_tokens;
  absl::flat_hash_map<TokenId, std::string> normalized_contents;
  for (int pass = 0; pass < 2; ++pass) {
    for (const internal::AddedToken& token : added) {
      if (token.special != (pass == 0)) continue;
      if (!token.normalized) {
        raw_patterns.push_back(token.content);
        raw_tokens.push_back(&token);
        continue;
      }
      std::string pattern = token.content;
      if (impl->normalizer) {
        std::string out;
        bool changed = false;
        TOKENIZER_RETURN_IF_ERROR(impl->normalizer->Normalize(token.content, &out, &changed));
        if (changed) pattern = std::move(out);
      }
      // `tokenizers` gives the token back (id_to_token, decode) as it
      // matches it: normalized.
      if (pattern != token.content) normalized_contents.emplace(token.id, pattern);
      normalized_patterns.push_back(std::move(pattern));
      normalized_tokens.push_back(&token);
    }
  }
  impl->raw_added = internal::AddedTokenMatcher(raw_patterns, raw_tokens);
  impl->normalized_added = internal::AddedTokenMatcher(normalized_patterns, normalized_tokens);

  // The post-processor and the decoder.
  TOKENIZER_RETURN_IF_ERROR(ParsePostProcessor(r, Reader::Find(root, "post_processor"),
                                               &impl->template_prefix, &impl->template_suffix));
  TOKENIZER_ASSIGN_OR_RETURN(byte_level_decoder, ParseDecoder(r, Reader::Find(root, "decoder")));
  impl->byte_level_decoder = byte_level_decoder;

  // Tokens by id, and ids by token (added tokens first).
  const size_t size = static_cast<size_t>(max_id + 1);
  impl->tokens.resize(size);
  impl->known.assign(size, false);
  impl->special.assign(size, false);
  absl::flat_hash_set<std::string_view> special_contents;
  for (const internal::AddedToken& token : added) {
    if (token.special) special_contents.insert(token.content);
  }
  for (TokenId id = 0; id < static_cast<TokenId>(vocab_by_id.size()); ++id) {
    if (vocab_by_id[id] != nullptr) {
      impl->tokens[id] = *vocab_by_id[id];
      impl->known[id] = true;
    }
  }
  for (const internal::AddedToken& token : added) {
    auto normalized = normalized_contents.find(token.id);
    impl->tokens[token.id] =
        normalized == normalized_contents.end() ? token.content : normalized->second;
    impl->known[token.id] = true;
    impl->token_to_id.emplace(token.content, token.id);
  }
  for (const auto& [token, id] : vocab_ids) impl->token_to_id.emplace(std::string(token), id);
  impl->token_bytes.resize(size);
  for (size_t id = 0; id < size; ++id) {
    if (!impl->known[id]) continue;
    impl->special[id] = special_contents.contains(impl->tokens[id]);
    if (!internal::ByteLevelToBytes(impl->tokens[id], &impl->token_bytes[id])) {
      impl->token_bytes[id] = impl->tokens[id];
    }
  }
  for (TokenId id : impl->template_prefix) {
    if (static_cast<size_t>(id) >= size || !impl->known[id]) {
      return r.DataLoss(
          "post_processor", Reader::Find(root, "post_processor"),
          absl::StrCat("ids of the vocabulary or the added tokens (", id, " is not)"));
    }
  }
  for (TokenId id : impl->template_suffix) {
    if (static_cast<size_t>(id) >= size || !impl->known[id]) {
      return r.DataLoss(
          "post_processor", Reader::Find(root, "post_processor"),
          absl::StrCat("ids of the vocabulary or the added tokens (", id, " is not)"));
    }
  }
  return impl;
}

}  // namespace

// ---- Encoding -------------------------------------------------------------

absl::Status internal::TokenizerImpl::EncodeOne(std::string_view text, const EncodeOptions& options,
                                                Scratch& s, std::vector<TokenId>* out,
                                                std::string_view who) const {
  const size_t bad = internal::FindInvalidUtf8(text);
  if (bad != std::string_view::npos) {
    if (options.invalid_utf8 == EncodeOptions::InvalidUtf8::kError) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: text has byte 0x%02x at offset %d that is not UTF-8: expected UTF-8 text (or "
          "EncodeOptions::InvalidUtf8::kReplace)",
          who, static_cast<unsigned char>(text[bad]), bad));
    }
    s.replaced.clear();
    internal::AppendUtf8Lossy(text, &s.replaced);
    text = s.replaced;
  }
  if (sentencepiece != nullptr) {
    absl::Status status = sentencepiece->Encode(text, options.add_special_tokens, out);
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat(Absl(who), ": ", status.message()));
    }
    return absl::OkStatus();
  }
  if (options.add_special_tokens) {
    out->insert(out->end(), template_prefix.begin(), template_prefix.end());
  }
  bool ok;
  if (raw_added.empty()) {
    ok = text.empty() || EncodeSegment(text, s, out);
  } else {
    ok = raw_added.Split(
        text, [&](std::string_view piece) { return EncodeSegment(piece, s, out); },
        [&](TokenId id) {
          out->push_back(id);
          return true;
        });
  }
  if (!ok) {
    return absl::Status(s.error.code(), absl::StrCat(Absl(who), ": ", s.error.message()));
  }
  if (options.add_special_tokens) {
    out->insert(out->end(), template_suffix.begin(), template_suffix.end());
  }
  return absl::OkStatus();
}

bool internal::TokenizerImpl::EncodeSegment(std::string_view piece, Scratch& s,
                                            std::vector<TokenId>* out) const {
  std::string_view text = piece;
  if (normalizer) {
    bool changed = false;
    absl::Status status = normalizer->Normalize(piece, &s.normalized, &changed);
    if (!status.ok()) {
      s.error = status;
      return false;
    }
    if (changed) text = s.normalized;
  }
  if (normalized_added.empty()) return text.empty() || PreTokenize(text, 0, s, out);
  return normalized_added.Split(
      text, [&](std::string_view p) { return PreTokenize(p, 0, s, out); },
      [&](TokenId id) {
        out->push_back(id);
        return true;
      });
}

// `piece` (not empty) through the pre-tokenizers from `stage` on, then the
// model. The Split behaviour Isolated: each match and each stretch between
// matches is a piece of its own. Empty matches are stepped over as
// Oniguruma's iterator (which `tokenizers` uses) steps over them.
bool internal::TokenizerImpl::PreTokenize(std::string_view piece, size_t stage, Scratch& s,
                                          std::vector<TokenId>* out) const {
  if (stage == byte_level_stage && add_prefix_space && piece[0] != ' ') {
    s.prefixed.assign(1, ' ');
    s.prefixed.append(piece);
    piece = s.prefixed;
  }
  if (stage == splits.size()) {
    bpe->EncodeWord(piece, &s.bpe, out);
    return true;
  }
  const internal::Regex& regex = *splits[stage];
  internal::Regex::MatchState* state = s.match[stage].get();
  size_t prev = 0;
  size_t search = 0;
  bool matched = false;
  size_t last_end = 0;
  while (search <= piece.size()) {
    size_t begin, end;
    const int rc = regex.Find(piece, search, state, &begin, &end);
    if (rc == 0) break;
    if (rc < 0) {
      s.error =
          absl::Status(internal::Regex::IsResourceLimit(rc) ? absl::StatusCode::kResourceExhausted
                                                            : absl::StatusCode::kInternal,
                       absl::StrCat("the pre-tokenizer's regular expression failed on a piece of ",
                                    piece.size(), " bytes: ", internal::Regex::ErrorMessage(rc)));
      return false;
    }
    if (begin == end && matched && last_end == end) {
      if (end >= piece.size()) break;
      search = end + internal::Utf8SequenceLength(static_cast<unsigned char>(piece[end]));
      continue;
    }
    search = end;
    matched = true;
    last_end = end;
    if (prev < begin && !PreTokenize(piece.substr(prev, begin - prev), stage + 1, s, out)) {
      return false;
    }
    if (begin < end && !PreTokenize(piece.substr(begin, end - begin), stage + 1, s, out)) {
      return false;
    }
    prev = end;
  }
  if (prev < piece.size() && !PreTokenize(piece.substr(prev), stage + 1, s, out)) return false;
  return true;
}

absl::StatusOr<std::vector<TokenId>> Tokenizer::Encode(std::string_view text,
                                                       const EncodeOptions& options) const {
  std::unique_ptr<Scratch> scratch = impl_->Acquire();
  std::vector<TokenId> ids;
  ids.reserve(text.size() / 3 + 4);
  absl::Status status =
      impl_->EncodeOne(text, options, *scratch, &ids, "tokenizer::Tokenizer::Encode");
  impl_->Release(std::move(scratch));
  if (!status.ok()) return status;
  return ids;
}

absl::StatusOr<std::vector<std::vector<TokenId>>> Tokenizer::EncodeBatch(
    absl::Span<const std::string_view> texts, const EncodeOptions& options, int num_threads) const {
  const char* who = "tokenizer::Tokenizer::EncodeBatch";
  std::vector<std::vector<TokenId>> results(texts.size());
  std::vector<absl::Status> errors(texts.size());
  size_t threads = num_threads > 0 ? static_cast<size_t>(num_threads)
                                   : std::max(1u, std::thread::hardware_concurrency());
  threads = std::max<size_t>(1, std::min(threads, texts.size()));
  std::atomic<size_t> next{0};
  const auto work = [&] {
    std::unique_ptr<Scratch> scratch;
    size_t i = 0;
    try {
      scratch = impl_->Acquire();
      for (i = next.fetch_add(1); i < texts.size(); i = next.fetch_add(1)) {
        results[i].reserve(texts[i].size() / 3 + 4);
        errors[i] = impl_->EncodeOne(texts[i], options, *scratch, &results[i],
                                     absl::StrCat(who, ": texts[", i, "]"));
      }
      impl_->Release(std::move(scratch));
    } catch (const std::exception& e) {
      // Nothing is thrown out of a thread: the text it was on fails.
      if (i < texts.size()) {
        errors[i] = absl::ResourceExhaustedError(absl::StrCat(who, ": texts[", i, "]: ", e.what()));
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& thread : pool) thread.join();
  for (const absl::Status& error : errors) {
    if (!error.ok()) return error;
  }
  return results;
}

absl::StatusOr<std::vector<std::vector<TokenId>>> Tokenizer::EncodeBatch(
    absl::Span<const std::string> texts, const EncodeOptions& options, int num_threads) const {
  std::vector<std::string_view> views(texts.begin(), texts.end());
  return EncodeBatch(absl::MakeConstSpan(views), options, num_threads);
}

// ---- Decoding -------------------------------------------------------------

absl::StatusOr<std::string> internal::TokenizerImpl::DecodeImpl(absl::Span<const TokenId> ids,
                                                                const DecodeOptions& options,
                                                                bool lossy) const {
  if (sentencepiece != nullptr) {
    const int size = sentencepiece->size();
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= size) {
        return absl::InvalidArgumentError(
            absl::StrCat("tokenizer::Tokenizer::", lossy ? "Decode" : "DecodeBytes", ": ids[", i,
                         "] = ", ids[i], ": expected an id of the model (", origin, " has ", size,
                         " pieces, ids 0 to ", size - 1, ")"));
      }
    }
    std::string bytes = sentencepiece->DecodeBytes(ids, options.skip_special_tokens);
    if (!lossy || internal::FindInvalidUtf8(bytes) == std::string_view::npos) return bytes;
    return internal::SentencePieceTokenizer::ReplaceInvalidUtf8(bytes);
  }
  std::string bytes;
  bool first = true;
  for (size_t i = 0; i < ids.size(); ++i) {
    const TokenId id = ids[i];
    if (id < 0 || static_cast<size_t>(id) >= known.size() || !known[id]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tokenizer::Tokenizer::", lossy ? "Decode" : "DecodeBytes", ": ids[", i, "] = ", id,
          ": expected an id of the vocabulary or of an added token (", origin, " has ",
          known.size(), " ids, 0 to ", known.size() - 1, ", not all used)"));
    }
    if (options.skip_special_tokens && special[id]) continue;
    if (byte_level_decoder) {
      bytes += token_bytes[id];
    } else {
      if (!first) bytes += ' ';
      bytes += tokens[id];
    }
    first = false;
  }
  if (!lossy || !byte_level_decoder) return bytes;
  if (internal::FindInvalidUtf8(bytes) == std::string_view::npos) return bytes;
  std::string text;
  text.reserve(bytes.size() + 8);
  internal::AppendUtf8Lossy(bytes, &text);
  return text;
}

absl::StatusOr<std::string> Tokenizer::Decode(absl::Span<const TokenId> ids,
                                              const DecodeOptions& options) const {
  return impl_->DecodeImpl(ids, options, /*lossy=*/true);
}

absl::StatusOr<std::string> Tokenizer::DecodeBytes(absl::Span<const TokenId> ids,
                                                   const DecodeOptions& options) const {
  return impl_->DecodeImpl(ids, options, /*lossy=*/false);
}

int Tokenizer::vocab_size() const {
  if (impl_->sentencepiece != nullptr) return impl_->sentencepiece->size();
  return static_cast<int>(impl_->known.size());
}

std::optional<TokenId> Tokenizer::TokenToId(std::string_view token) const {
  if (impl_->sentencepiece != nullptr) return impl_->sentencepiece->Find(token);
  auto it = impl_->token_to_id.find(Absl(token));
  if (it == impl_->token_to_id.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string_view> Tokenizer::IdToToken(TokenId id) const {
  if (impl_->sentencepiece != nullptr) {
    if (id < 0 || id >= impl_->sentencepiece->size()) return std::nullopt;
    return impl_->sentencepiece->piece(id);
  }
  if (id < 0 || static_cast<size_t>(id) >= impl_->known.size() || !impl_->known[id]) {
    return std::nullopt;
  }
  return impl_->tokens[id];
}

bool Tokenizer::IsSpecial(TokenId id) const {
  if (impl_->sentencepiece != nullptr) return impl_->sentencepiece->IsSpecial(id);
  return id >= 0 && static_cast<size_t>(id) < impl_->special.size() && impl_->special[id];
}

std::optional<TokenId> Tokenizer::bos_id() const {
  if (impl_->sentencepiece == nullptr) return std::nullopt;
  return impl_->sentencepiece->bos_id();
}

std::optional<TokenId> Tokenizer::eos_id() const {
  if (impl_->sentencepiece == nullptr) return std::nullopt;
  return impl_->sentencepiece->eos_id();
}

std::optional<TokenId> Tokenizer::unk_id() const {
  if (impl_->sentencepiece == nullptr) return std::nullopt;
  return impl_->sentencepiece->unk_id();
}

std::optional<TokenId> Tokenizer::pad_id() const {
  if (impl_->sentencepiece == nullptr) return std::nullopt;
  return impl_->sentencepiece->pad_id();
}

}  // namespace tokenizer
