// tokenize: text in, token ids out, with a Hugging Face tokenizer.json or a
// SentencePiece tokenizer.model (tokenizer/tokenizer.h).
//
//   # the ids of a prompt, as JSON (debugging what the model will see)
//   bazel run //tools:tokenize -- --tokenizer tokenizer.json --text "Hello, world"
//   {"ids": [128000, 9906, 11, 1917], "tokens": ["<|begin_of_text|>", "Hello", ",", "Ġworld"]}
//
//   # text files or JSON Lines into a token file the trainer reads (--data)
//   bazel run //tools:tokenize -- --tokenizer tokenizer.json --out train.bin \
//       corpus/*.txt [--jsonl-field text] [--eos-token "<|end_of_text|>"]
//
// A file is one document; with --jsonl-field F every line of a file is a
// JSON object whose string field F is one document. Each document is encoded
// (with the tokenizer's post-processor: e.g. Llama 3's BOS, or a
// tokenizer.model's, unless --no-special-tokens) and followed by the EOS
// token (--eos-token, else a tokenizer.model's own, else the first of the
// usual names the vocabulary has), so documents never run into
// each other unseparated. The token file is llm.c's layout
// (trainer::WriteTokenFile): uint16 ids with the GPT-2 header when the
// vocabulary fits in 16 bits, uint32 with the Llama 3 header otherwise,
// written atomically; the trainer reads either (`--data train.bin`).
// Documents are encoded on --threads threads (0: every core); progress goes
// to stderr, the throughput at the end. The encoding itself is
// tokenizer::EncodeDocuments (tokenizer/documents.h), which the trainer's
// `--data TEXT --tokenizer tokenizer.json` also calls: a text file gives the
// trainer the ids it would give this tool's token file.
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "formats/io/file_io.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tokenizer/documents.h"
#include "tokenizer/tokenizer.h"
#include "trainer/data.h"

namespace {

using Clock = std::chrono::steady_clock;

int Fail(const std::string& message) {
  std::fprintf(stderr, "tokenize: %s\n", message.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app(
      "tokenize: text in, token ids out, with a Hugging Face tokenizer.json or a SentencePiece "
      "tokenizer.model");
  std::string tokenizer_path, text, out, jsonl_field, eos_token;
  std::vector<std::string> inputs;
  bool no_special_tokens = false;
  int threads = 0;
  app.add_option("--tokenizer", tokenizer_path, "the tokenizer.json or tokenizer.model")
      ->required();
  app.add_option("--text", text, "print this text's ids and tokens as JSON");
  app.add_option("--out", out, "write the inputs' ids here as a token file (llm.c's layout)");
  app.add_option("inputs", inputs, "text files (or JSON Lines with --jsonl-field)");
  app.add_option("--jsonl-field", jsonl_field,
                 "each line of an input is a JSON object; this field "
                 "is a document");
  app.add_option("--eos-token", eos_token,
                 "the token after each document (default: a tokenizer.model's EOS, else "
                 "<|end_of_text|>, <|endoftext|>, </s> or <|im_end|>, the first the vocabulary "
                 "has)");
  app.add_flag("--no-special-tokens", no_special_tokens,
               "encode without the post-processor's special tokens (e.g. BOS; a "
               "tokenizer.model's BOS)");
  app.add_option("--threads", threads, "encoding threads (0: every core)")
      ->check(CLI::NonNegativeNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (text.empty() == out.empty()) {
    return Fail("expected --text TEXT (print its ids) or --out FILE with inputs, one of the two");
  }
  auto tokenizer = tokenizer::Tokenizer::FromFile(tokenizer_path);
  if (!tokenizer.ok()) return Fail(std::string(tokenizer.status().message()));
  if (!text.empty()) {
    auto ids = tokenizer->Encode(text, {.add_special_tokens = !no_special_tokens});
    if (!ids.ok()) return Fail(std::string(ids.status().message()));
    nlohmann::json json;
    json["ids"] = *ids;
    json["tokens"] = nlohmann::json::array();
    for (tokenizer::TokenId id : *ids) {
      const auto token = tokenizer->IdToToken(id);
      json["tokens"].push_back(token ? std::string(*token) : std::string());
    }
    std::printf("%s\n",
                json.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return 0;
  }

  if (inputs.empty()) return Fail("--out: expected input files after the flags");
  auto eos = tokenizer::FindEosToken(*tokenizer, eos_token, tokenizer_path);
  if (!eos.ok()) {
    return Fail(absl::StrCat(eos_token.empty() ? "" : "--eos-token: ", eos.status().message(),
                             eos_token.empty() ? ": --eos-token NAME" : ""));
  }

  std::vector<std::string> documents;
  std::vector<std::string> names;  // each document's origin, for errors
  int64_t bytes = 0;
  for (const std::string& path : inputs) {
    auto read = formats::ReadFile(path);
    if (!read.ok()) return Fail(absl::StrCat(path, ": cannot be read"));
    std::string& contents = *read;
    if (jsonl_field.empty()) {
      bytes += static_cast<int64_t>(contents.size());
      documents.push_back(std::move(contents));
      names.push_back(path);
      continue;
    }
    std::istringstream lines(contents);
    std::string line;
    for (int64_t number = 1; std::getline(lines, line); ++number) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json object;
      try {
        object = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        return Fail(absl::StrCat(path, ":", number, ": not JSON: ", e.what()));
      }
      if (!object.is_object() || !object.contains(jsonl_field) ||
          !object[jsonl_field].is_string()) {
        return Fail(absl::StrCat(path, ":", number, ": expected an object with a string field '",
                                 jsonl_field, "'"));
      }
      documents.push_back(object[jsonl_field].get<std::string>());
      names.push_back(absl::StrCat(path, ":", number));
      bytes += static_cast<int64_t>(documents.back().size());
    }
  }

  const auto start = Clock::now();
  tokenizer::DocumentsOptions options;
  options.encode.add_special_tokens = !no_special_tokens;
  options.num_threads = threads;
  options.document_name = [&names](size_t i) { return names[i]; };
  options.progress = [&](size_t done, size_t ids) {
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    std::fprintf(stderr, "\rtokenize: %zu/%zu documents, %zu tokens, %.1f MB/s", done,
                 documents.size(), ids,
                 seconds > 0 ? bytes / 1e6 * done / documents.size() / seconds : 0.0);
  };
  auto ids = tokenizer::EncodeDocuments(*tokenizer, documents, eos->id, options);
  if (!ids.ok()) return Fail(std::string(ids.status().message()));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::fprintf(stderr, "\n");
  if (auto s = trainer::WriteTokenFile(out, *ids, tokenizer->vocab_size()); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  std::printf(
      "tokenize: %zu documents, %.1f MB of text -> %zu tokens (%s after each) in %s, %s ids; "
      "%.1f MB/s\n",
      documents.size(), bytes / 1e6, ids->size(), eos->name.c_str(), out.c_str(),
      tokenizer->vocab_size() <= 65536 ? "uint16" : "uint32",
      seconds > 0 ? bytes / 1e6 / seconds : 0.0);
  return 0;
}
