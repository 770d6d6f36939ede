#include "trainer/text_data.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <future>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "comm/collectives.h"
#include "formats/io/file_io.h"
#include "tokenizer/documents.h"
#include "tokenizer/tokenizer.h"

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;

std::string TokenizerFlag(const Options& o) {
  return absl::StrCat("--tokenizer='", o.tokenizer, "'");
}
std::string DataFlag(const Options& o) { return absl::StrCat("--data='", o.data_path, "'"); }

absl::Status InContext(const std::string& what, const absl::Status& s) {
  return s.ok() ? s : absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

// ---- rank 0's results, sent to every rank ----------------------------------

// What the other ranks receive before a result: a heartbeat (kWorking) or
// the status code of rank 0's result, the number of ids and the length of
// the error message.
constexpr int64_t kWorking = -1;

at::Tensor Header(int64_t state, int64_t count, int64_t message_bytes) {
  at::Tensor header = at::empty({3}, at::kLong);
  int64_t* h = header.data_ptr<int64_t>();
  h[0] = state;
  h[1] = count;
  h[2] = message_bytes;
  return header;
}

// Rank 0's status (rank 0 passes it; the others pass anything) as every
// rank's, after rank 0 has sent `header` (its code and message length:
// Header(code, count, bytes)).
absl::Status ReceiveStatus(const comm::ProcessGroup& group, const at::Tensor& header,
                           const absl::Status& local) {
  const int64_t* h = header.data_ptr<int64_t>();
  std::string message = group.rank() == 0 ? std::string(local.message()) : std::string();
  message.resize(static_cast<size_t>(h[2]));
  if (h[2] > 0) {
    at::Tensor bytes = at::from_blob(message.data(), {h[2]}, at::kByte);
    comm::broadcast(group, bytes, 0).wait();
  }
  return absl::Status(static_cast<absl::StatusCode>(h[0]), message);
}

// Rank 0's `local` status, returned by every rank (and only rank 0 needs
// what it checked).
absl::Status ShareStatus(const comm::ProcessGroup& group, const absl::Status& local) {
  if (group.size() == 1) return local;
  const bool root = group.rank() == 0;
  at::Tensor header = Header(root ? static_cast<int64_t>(local.code()) : 0, 0,
                             root ? static_cast<int64_t>(local.message().size()) : 0);
  comm::broadcast(group, header, 0).wait();
  return ReceiveStatus(group, header, local);
}

// `ids` from rank 0 into every rank's `ids` (resized there), in chunks of
// 2^26 ids (256 MB), so no single message nears a transport's limits.
void BroadcastIds(const comm::ProcessGroup& group, std::vector<uint32_t>& ids, int64_t count) {
  if (group.rank() != 0) ids.resize(static_cast<size_t>(count));
  constexpr int64_t kChunk = int64_t{1} << 26;
  for (int64_t first = 0; first < count; first += kChunk) {
    const int64_t n = std::min(kChunk, count - first);
    // int32 on the wire: the same bits (every id is below 2^31, a TokenId).
    at::Tensor chunk = at::from_blob(ids.data() + first, {n}, at::kInt);
    comm::broadcast(group, chunk, 0).wait();
  }
}

// ---- the tokenizer and the text --------------------------------------------

class TokenizedText final : public TextData {
 public:
  TokenizedText(Options o, std::unique_ptr<tokenizer::Tokenizer> tok, tokenizer::EosToken eos)
      : o_(std::move(o)), tokenizer_(std::move(tok)), eos_(std::move(eos)) {}

  absl::StatusOr<TokenData> Encode(const comm::ProcessGroup& group) override {
    const bool root = group.rank() == 0;
    absl::StatusOr<TokenData> local = TokenData{};
    if (root) {
      // On a thread of its own, so that this one can send the heartbeats.
      std::future<absl::StatusOr<TokenData>> encoding =
          std::async(std::launch::async, [this]() -> absl::StatusOr<TokenData> {
            try {
              return EncodeOnRoot();
            } catch (const std::exception& e) {
              // Every rank's error, not rank 0's alone (std::bad_alloc).
              return absl::ResourceExhaustedError(
                  absl::StrCat(DataFlag(o_), ": encoding it failed: ", e.what()));
            }
          });
      if (group.size() > 1) {
        const auto beat =
            std::max<std::chrono::milliseconds>(std::chrono::milliseconds(1), group.timeout() / 4);
        while (encoding.wait_for(beat) != std::future_status::ready) {
          at::Tensor header = Header(kWorking, 0, 0);
          comm::broadcast(group, header, 0).wait();
        }
      }
      local = encoding.get();
    }
    if (group.size() == 1) return local;
    at::Tensor header = root ? Header(static_cast<int64_t>(local.status().code()),
                                      local.ok() ? static_cast<int64_t>(local->tokens.size()) : 0,
                                      static_cast<int64_t>(local.status().message().size()))
                             : Header(kWorking, 0, 0);
    do {
      comm::broadcast(group, header, 0).wait();
    } while (header.data_ptr<int64_t>()[0] == kWorking);
    const absl::Status status = ReceiveStatus(group, header, local.status());
    if (!status.ok()) return status;
    TokenData data = root ? std::move(*local) : TokenData{};
    BroadcastIds(group, data.tokens, header.data_ptr<int64_t>()[1]);
    if (!root) {
      data.description = absl::StrCat(data.tokens.size(), " tokens of ", o_.data_path,
                                      " (text encoded on rank 0)");
    }
    return data;
  }

 private:
  // Reads and encodes --data as //tools:tokenize encodes one text file (one
  // document: its ids, then the end-of-text token).
  absl::StatusOr<TokenData> EncodeOnRoot() const {
    const auto start = Clock::now();
    absl::StatusOr<std::string> text = formats::ReadFile(o_.data_path);
    if (!text.ok()) return InContext(DataFlag(o_), text.status());
    std::printf("trainer: tokenising %s (%zu bytes) with %s on rank 0\n", o_.data_path.c_str(),
                text->size(), o_.tokenizer.c_str());
    std::fflush(stdout);
    tokenizer::DocumentsOptions options;
    options.num_threads = 1;  // one document takes one thread
    options.document_name = [this](size_t) { return DataFlag(o_); };
    auto ids =
        tokenizer::EncodeDocuments(*tokenizer_, absl::MakeConstSpan(&*text, 1), eos_.id, options);
    if (!ids.ok()) return ids.status();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    std::printf(
        "trainer: tokenised 1 document, %zu bytes of %s -> %zu tokens (%s after it) in %.2f s, "
        "%.1f MB/s\n",
        text->size(), o_.data_path.c_str(), ids->size(), eos_.name.c_str(), seconds,
        seconds > 0 ? static_cast<double>(text->size()) / 1e6 / seconds : 0.0);
    std::fflush(stdout);
    TokenData data;
    data.tokens = std::move(*ids);
    data.description =
        absl::StrCat(data.tokens.size(), " tokens of ", o_.data_path, " (text encoded with ",
                     o_.tokenizer, ", ", eos_.name, " after it)");
    return data;
  }

  const Options o_;
  const std::unique_ptr<tokenizer::Tokenizer> tokenizer_;  // rank 0's; null elsewhere
  const tokenizer::EosToken eos_;
};

// OpenTextData's checks, on rank 0.
absl::StatusOr<std::unique_ptr<TokenizedText>> OpenOnRoot(const Options& o) {
  absl::StatusOr<tokenizer::Tokenizer> tok = tokenizer::Tokenizer::FromFile(o.tokenizer);
  if (!tok.ok()) return InContext("--tokenizer", tok.status());
  if (tok->vocab_size() > o.vocab) {
    const std::string model =
        o.model == ModelKind::kLlama
            ? absl::StrCat("the model's vocab_size=", o.vocab, " (the config.json of ",
                           o.hf_checkpoint.empty() ? "--model-config='" + o.model_config + "'"
                                                   : "--hf-checkpoint='" + o.hf_checkpoint + "'",
                           "): its ids would index past the model's embedding (a tokenizer of "
                           "another model?)")
            : absl::StrCat("--vocab=", o.vocab, ", the model's vocabulary: pass --vocab ",
                           tok->vocab_size(), " or more");
    return absl::InvalidArgumentError(absl::StrCat(TokenizerFlag(o), " has ", tok->vocab_size(),
                                                   " token ids: expected at most ", model));
  }
  auto eos = tokenizer::FindEosToken(*tok, "", o.tokenizer);
  if (!eos.ok()) {
    return InContext("--tokenizer",
                     absl::Status(eos.status().code(),
                                  absl::StrCat(eos.status().message(),
                                               ": make the token file with //tools:tokenize "
                                               "--eos-token NAME")));
  }
  // Readable, not empty, and text (a token file is encoded already).
  auto token_file = IsTokenFile(o.data_path);
  if (!token_file.ok()) return token_file.status();
  if (*token_file && o.data_format == DataFormat::kAuto) {
    return absl::InvalidArgumentError(absl::StrCat(
        TokenizerFlag(o), " with ", DataFlag(o),
        ", a token file (it starts with an llm.c token header or is named *.bin): expected a "
        "text file to encode (drop --tokenizer to train on the file's ids, or give "
        "--data-format=text if it is text)"));
  }
  return std::make_unique<TokenizedText>(o, std::make_unique<tokenizer::Tokenizer>(std::move(*tok)),
                                         std::move(*eos));
}

}  // namespace

absl::StatusOr<std::unique_ptr<TextData>> OpenTextData(const Options& o,
                                                       const comm::ProcessGroup& group) {
  if (o.tokenizer.empty()) return std::unique_ptr<TextData>();
  absl::StatusOr<std::unique_ptr<TokenizedText>> opened =
      group.rank() == 0 ? OpenOnRoot(o)
                        : std::make_unique<TokenizedText>(o, nullptr, tokenizer::EosToken{});
  if (auto s = ShareStatus(group, opened.status()); !s.ok()) return s;
  return std::unique_ptr<TextData>(std::move(*opened));
}

}  // namespace trainer
