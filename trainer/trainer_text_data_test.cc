// --data TEXT --tokenizer tokenizer.json end to end (issue 46, item 2): the
// built trainer on a text file trains on exactly the ids //tools:tokenize
// writes for it, so its losses and validation losses equal those of a run
// on that token file bit for bit (1 and 2 ranks; the default transformer
// and a small --model llama; a SentencePiece tokenizer.model); and every
// refusal (a tokenizer larger than the model's vocabulary, a token file
// with --tokenizer, text without one under --model llama, a missing,
// malformed or separator-less tokenizer) stops the run before it writes
// anything, with one line naming the flag, the value and what was
// expected.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "trainer/testing/json_lines.h"
#include "trainer/testing/run_trainer.h"

namespace trainer::testing {
namespace {

using ::testing::HasSubstr;

// The golden test's Llama 3 layout (4,010 ids), a tokenizer without any of
// the usual end-of-text tokens, and a Hugging Face checkpoint of 128 ids.
const char kTokenizer[] = "tokenizer/testdata/llama3/tokenizer.json";
const char kNoEosTokenizer[] = "tokenizer/testdata/flags/tokenizer.json";
const char kSmallCheckpoint[] = "models/testdata/llama3_gqa";
const char kText[] = "/usr/share/common-licenses/GPL-3";  // 35 KB: 8,587 ids
// A SentencePiece tokenizer.model in Llama 2's layout (2,000 pieces, <s> 1,
// </s> 2).
const char kSentencePiece[] = "tokenizer/testdata/sentencepiece/llama2_bpe/tokenizer.model";

// The token file //tools:tokenize makes of kText.
std::string TokenFile() {
  const std::string out = TempDir("tokenized") + "/gpl3.bin";
  const std::string command = std::string("tools/tokenize --tokenizer ") + kTokenizer + " --out " +
                              out + " " + kText + " > /dev/null 2>&1";
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  return out;
}

// A Llama whose vocabulary (4,096) holds the tokenizer's 4,010 ids.
std::string SmallLlamaConfig() {
  const std::string path = TempDir("llama_config") + "/config.json";
  std::ofstream(path) << R"({"model_type": "llama", "vocab_size": 4096, "hidden_size": 32,
      "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5})";
  return path;
}

struct Losses {
  std::vector<double> train;
  std::vector<double> val;
};

Losses Run(const std::string& flags, const std::string& name, std::string* output = nullptr) {
  const std::string log = TempDir("log_" + name) + "/run.jsonl";
  RunResult r = RunTrainer(flags + " --log-json=" + log);
  EXPECT_EQ(r.exit_code, 0) << name << ": " << r.output;
  if (output != nullptr) *output = r.output;
  Losses losses;
  for (const std::string& line : ReadLines(log)) {
    auto object = ParseJsonLine(line);
    if (!object) continue;
    losses.train.push_back(object->at("loss").get<double>());
    if (object->count("val_loss")) losses.val.push_back(object->at("val_loss").get<double>());
  }
  return losses;
}

// Every run: 6 steps, a validation loss at steps 3 and 6 on the held-out
// tenth.
const char kSteps[] = " --seq=32 --global-batch=4 --steps=6 --warmup-steps=2 --eval-every=3";

void ExpectSameRuns(const std::string& model_flags, const std::string& what) {
  const std::string tokens = TokenFile();
  for (int nproc : {1, 2}) {
    const std::string common =
        model_flags + kSteps + " --nproc=" + std::to_string(nproc) + " --data=";
    std::string output;
    const Losses from_text =
        Run(common + kText + " --tokenizer=" + kTokenizer, what + "_text", &output);
    const Losses from_tokens = Run(common + tokens, what + "_tokens");
    const std::string where = what + ", " + std::to_string(nproc) + " rank(s)";
    ASSERT_EQ(from_text.train.size(), 6u) << where;
    EXPECT_EQ(from_text.train, from_tokens.train) << where;  // bit for bit
    ASSERT_EQ(from_text.val.size(), 2u) << where;
    EXPECT_EQ(from_text.val, from_tokens.val) << where;
    // Rank 0 says what it encoded, and the run what it trains on.
    EXPECT_THAT(output, HasSubstr(std::string("trainer: tokenised 1 document, 35149 bytes of ") +
                                  kText + " -> 8587 tokens (<|end_of_text|> after it) in "))
        << output;
    EXPECT_THAT(output, HasSubstr("MB/s")) << output;
    EXPECT_THAT(output, HasSubstr(std::string("(8587 tokens of ") + kText + " (text encoded with " +
                                  kTokenizer +
                                  ", <|end_of_text|> after it), the last 858 tokens held out)"))
        << output;
  }
}

TEST(TrainerTextDataTest, TheDefaultModelOnTextEqualsItsTokenFile) {
  ExpectSameRuns("--vocab=4096", "transformer");
}

TEST(TrainerTextDataTest, ALlamaOnTextEqualsItsTokenFile) {
  ExpectSameRuns("--model=llama --model-config=" + SmallLlamaConfig(), "llama");
}

// A tokenizer.model the same way: the run on the text trains on the ids
// //tools:tokenize writes with it (<s>, the text's pieces, </s>).
TEST(TrainerTextDataTest, ASentencePieceModelOnTextEqualsItsTokenFile) {
  const std::string tokens = TempDir("tokenized_sp") + "/gpl3.bin";
  const std::string command = std::string("tools/tokenize --tokenizer ") + kSentencePiece +
                              " --out " + tokens + " " + kText + " > /dev/null 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  for (int nproc : {1, 2}) {
    const std::string common =
        std::string("--vocab=2048") + kSteps + " --nproc=" + std::to_string(nproc) + " --data=";
    std::string output;
    // (Qualified: inside a TEST, Run is testing::Test's.)
    const Losses from_text =
        testing::Run(common + kText + " --tokenizer=" + kSentencePiece, "sp_text", &output);
    const Losses from_tokens = testing::Run(common + tokens, "sp_tokens");
    const std::string where = std::to_string(nproc) + " rank(s)";
    ASSERT_EQ(from_text.train.size(), 6u) << where;
    EXPECT_EQ(from_text.train, from_tokens.train) << where;  // bit for bit
    EXPECT_EQ(from_text.val, from_tokens.val) << where;
    EXPECT_THAT(output, HasSubstr(std::string(" tokens of ") + kText + " (text encoded with " +
                                  kSentencePiece + ", </s> after it)"))
        << output;
  }
}

// Each refused run: its flags and what its one error line must say. None
// writes its log, its checkpoint directory or its export.
TEST(TrainerTextDataTest, RefusalsNameTheFlagAndWriteNothing) {
  const std::string dir = TempDir("refused");
  const std::string tokens = TokenFile();
  const std::string bad_json = dir + "/bad.json";
  std::ofstream(bad_json) << "{\"model\": ";
  const std::string llama = "--model=llama --model-config=" + SmallLlamaConfig();
  const std::string golden = std::string("--model=llama --hf-checkpoint=") + kSmallCheckpoint;
  const std::string text = std::string(" --data=") + kText;
  const std::string tokenizer = std::string(" --tokenizer=") + kTokenizer;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--nproc=2" + text + tokenizer,
       std::string("--tokenizer='") + kTokenizer +
           "' has 4010 token ids: expected at most --vocab=256, the model's vocabulary: pass "
           "--vocab 4010 or more"},
      {golden + " --nproc=2" + text + tokenizer,
       std::string("--tokenizer='") + kTokenizer +
           "' has 4010 token ids: expected at most the model's vocab_size=128 (the config.json "
           "of --hf-checkpoint='" +
           kSmallCheckpoint + "'): its ids would index past the model's embedding"},
      {llama + " --nproc=2 --data=" + tokens + tokenizer,
       std::string("--tokenizer='") + kTokenizer + "' with --data='" + tokens +
           "', a token file (it starts with an llm.c token header or is named *.bin): expected "
           "a text file to encode"},
      {llama + " --nproc=1 --data-format=tokens --data=" + tokens + tokenizer,
       "expected --data-format=auto or text (it encodes text), got --data-format=tokens (a "
       "token file is already encoded: drop --tokenizer)"},
      {llama + " --nproc=2" + text,
       std::string("--data='") + kText +
           "' is text (it does not start with an llm.c token header and is not named *.bin): "
           "expected --tokenizer tokenizer.json to encode it with"},
      {llama + " --nproc=1 --data-format=text" + text,
       "--data-format=text: expected --tokenizer FILE, the tokenizer.json to encode it with"},
      {llama + " --nproc=2" + text + " --tokenizer=" + dir + "/missing.json",
       "--tokenizer: tokenizer::Tokenizer::FromFile: " + dir + "/missing.json: cannot be opened"},
      {llama + " --nproc=2" + text + " --tokenizer=" + bad_json,
       "--tokenizer: tokenizer::Tokenizer::FromFile: " + bad_json + ": "},
      {llama + " --nproc=1" + text + " --tokenizer=" + kNoEosTokenizer,
       std::string("--tokenizer: ") + kNoEosTokenizer +
           " has none of <|end_of_text|>, <|endoftext|>, </s>, <|im_end|>: expected one of them "
           "as the end-of-text token between documents, or a name for it: make the token file "
           "with //tools:tokenize --eos-token NAME"},
      {"--nproc=1 --data=synthetic" + tokenizer,
       std::string("--tokenizer='") + kTokenizer +
           "': expected --data PATH, a text file to encode (got --data=synthetic)"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& [flags, message] = cases[i];
    const std::string out = dir + "/case" + std::to_string(i);
    const bool is_llama = flags.find("--model=llama") != std::string::npos;
    RunResult r = RunTrainer(flags + " --seq=16 --global-batch=4 --steps=2 --log-json=" + out +
                             ".jsonl --checkpoint-dir=" + out + ".ckpt" +
                             (is_llama ? " --export-hf=" + out + ".hf" : ""));
    EXPECT_NE(r.exit_code, 0) << flags;
    EXPECT_THAT(r.output, HasSubstr(message)) << flags;
    EXPECT_THAT(r.output, ::testing::Not(HasSubstr("step 1"))) << flags;
    for (const char* written : {".jsonl", ".ckpt", ".hf"}) {
      EXPECT_FALSE(std::filesystem::exists(out + written)) << flags << ": wrote " << written;
    }
  }
}

}  // namespace
}  // namespace trainer::testing
