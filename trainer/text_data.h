// --data TEXT --tokenizer tokenizer.json: a text file encoded once at start
// with a Hugging Face tokenizer, exactly as //tools:tokenize encodes one
// text file into a token file (tokenizer::EncodeDocuments: the
// post-processor's special tokens, e.g. Llama 3's <|begin_of_text|>, the
// text's ids, then the end-of-text token: the first of <|end_of_text|>,
// <|endoftext|>, </s>, <|im_end|> the tokenizer has). So a run on the text
// trains on the same ids, and gives the same losses, as a run on that token
// file; --eval-every holds out the last tenth of them the same way.
//
// Rank 0 alone reads the tokenizer and the text and encodes it; the other
// ranks receive its verdicts and the ids over the process group (a
// broadcast), so every rank trains on rank 0's ids and only rank 0 needs
// the files. Why not every rank, or each a part: a text file is one
// document, encoded on one thread, and the ids of a part of a text are not
// that part's ids in the whole (the pre-tokenizer's expressions and the
// merges look across any cut), so parts would change the ids; N ranks
// encoding the same text would take N cores for one core's work.
//
// The CMake GPU build links text_data_unavailable.cc instead where CMake
// finds no PCRE2 and ICU (the tokenizer's libraries): there OpenTextData
// refuses --tokenizer, naming why, and --data takes token files only.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "comm/process_group.h"
#include "trainer/data.h"
#include "trainer/options.h"

namespace trainer {

// A text file and its tokenizer, checked and ready to encode.
class TextData {
 public:
  virtual ~TextData() = default;

  // Rank 0 reads and encodes --data and prints what it encoded (bytes,
  // tokens, seconds, MB/s); every rank returns the ids (collective: every
  // rank calls it). The other ranks wait for the ids in broadcasts of a
  // heartbeat that rank 0 sends every quarter of the group's timeout, so a
  // long text does not time them out while a dead rank 0 still does. An
  // error (text that is not UTF-8, naming the byte's offset; a file that
  // can no longer be read) is rank 0's, returned by every rank.
  virtual absl::StatusOr<TokenData> Encode(const comm::ProcessGroup& group) = 0;
};

// Null without --tokenizer. With it, rank 0 checks, before anything is
// written: the tokenizer.json loads (its errors, naming --tokenizer); it
// has an end-of-text token; its ids fit the model's vocabulary (o.vocab:
// --vocab, or --model llama's vocab_size, which the caller has put there),
// else InvalidArgument naming both sizes; --data is readable text, not a
// token file (by --data-format auto's rule, data.h's IsTokenFile; not
// checked under --data-format=text). Every rank returns rank 0's verdict
// (collective: every rank calls it); only rank 0 holds the tokenizer.
absl::StatusOr<std::unique_ptr<TextData>> OpenTextData(const Options& o,
                                                       const comm::ProcessGroup& group);

}  // namespace trainer
