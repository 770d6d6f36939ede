// --data PATH and --eval-every (issue 38, item 4 of the issue, item 3 of
// its work): LoadDataFile's layouts against files numpy writes as nanoGPT's
// prepare.py and llm.c's write_datafile do (GPT-2 uint16 and Llama 3 uint32
// ids), WriteTokenFile's round trips, the errors, the split and the
// sampler; then the built trainer on a text file and on .bin files (losses
// fall, a validation loss is logged; ids above 65535 reach the model), a
// restart mid-run (the same losses as an uninterrupted run) and bad files
// (one line naming --data, the value and what was expected).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <ATen/ops/equal.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "torch_python.h"
#include "trainer/data.h"
#include "trainer/testing/json_lines.h"
#include "trainer/testing/run_trainer.h"

namespace trainer::testing {
namespace {

using ::testing::HasSubstr;

// Runs `script` with the venv's Python (numpy); fails the test otherwise.
void RunPython(const std::string& script) {
  const std::string dir = TempDir("py");
  const std::string file = dir + "/script.py";
  std::ofstream(file) << script;
  const std::string command = std::string(kTorchPython) + " " + file;
  ASSERT_EQ(std::system(command.c_str()), 0) << script;
}

// A learnable text: sentences built from a small vocabulary, ~40 KB.
std::string WriteText(const std::string& path) {
  std::ofstream out(path);
  const char* words[] = {"the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"};
  uint64_t x = 12345;
  for (int i = 0; i < 8000; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    out << words[(x >> 33) % 10] << ((x >> 20) % 7 == 0 ? ".\n" : " ");
  }
  return path;
}

// nanoGPT's prepare.py: np.array(ids, dtype=np.uint16).tofile(path); the
// ids follow a pattern over 300 ids (learnable), the last one is `max_id`.
void WriteNanoGptBin(const std::string& path, int n, int max_id) {
  RunPython(
      "import numpy as np\n"
      "ids = [(i * 7 + (i // 5) % 3) % 300 for i in range(" +
      std::to_string(n) +
      ")]\n"
      "ids[-1] = " +
      std::to_string(max_id) +
      "\n"
      "np.array(ids, dtype=np.uint16).tofile('" +
      path + "')\n");
}

// llm.c's dev/data/data_common.py write_datafile (model_desc "gpt-2": magic
// 20240520, version 1, uint16 ids).
void WriteLlmcBin(const std::string& path, int n, int count_in_header) {
  RunPython(
      "import numpy as np\n"
      "ids = [(i * 7 + (i // 5) % 3) % 300 for i in range(" +
      std::to_string(n) +
      ")]\n"
      "header = np.zeros(256, dtype=np.int32)\n"
      "header[0] = 20240520; header[1] = 1; header[2] = " +
      std::to_string(count_in_header) +
      "\n"
      "with open('" +
      path +
      "', 'wb') as f:\n"
      "    f.write(header.tobytes()); f.write(np.array(ids, dtype=np.uint16).tobytes())\n");
}

// The same for model_desc "llama-3" (magic 20240801, version 7, uint32
// ids): id i is 70000 + (the pattern above), so every id is above 65535.
void WriteLlmcLlama3Bin(const std::string& path, int n) {
  RunPython(
      "import numpy as np\n"
      "ids = [70000 + (i * 7 + (i // 5) % 3) % 300 for i in range(" +
      std::to_string(n) +
      ")]\n"
      "header = np.zeros(256, dtype=np.int32)\n"
      "header[0] = 20240801; header[1] = 7; header[2] = len(ids)\n"
      "with open('" +
      path +
      "', 'wb') as f:\n"
      "    f.write(header.tobytes()); f.write(np.array(ids, dtype=np.uint32).tobytes())\n");
}

// An llm.c header (magic, version, count) and then `payload`, as raw bytes.
void WriteRawLlmc(const std::string& path, int32_t magic, int32_t version, int32_t count,
                  const std::string& payload) {
  std::string bytes(1024, '\0');
  const int32_t fields[] = {magic, version, count};
  for (int f = 0; f < 3; ++f) {
    for (int k = 0; k < 4; ++k) {
      bytes[4 * f + k] = static_cast<char>((static_cast<uint32_t>(fields[f]) >> (8 * k)) & 0xFF);
    }
  }
  std::ofstream(path, std::ios::binary) << bytes << payload;
}

// `ids` as little-endian uint32.
std::string Uint32Bytes(const std::vector<uint32_t>& ids) {
  std::string bytes;
  for (uint32_t id : ids) {
    for (int k = 0; k < 4; ++k) bytes.push_back(static_cast<char>((id >> (8 * k)) & 0xFF));
  }
  return bytes;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(DataFile, ReadsBytesNanoGptAndLlmcLayouts) {
  const std::string dir = TempDir("layouts");
  const std::string text = WriteText(dir + "/corpus.txt");
  auto bytes = LoadDataFile(text, DataFormat::kAuto, 256);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  std::ifstream in(text, std::ios::binary);
  const std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(bytes->tokens.size(), raw.size());
  for (size_t i = 0; i < raw.size(); ++i) ASSERT_EQ(bytes->tokens[i], uint8_t(raw[i])) << i;
  EXPECT_THAT(bytes->description, HasSubstr("bytes of " + text));

  WriteNanoGptBin(dir + "/train.bin", 1000, 299);
  auto nano = LoadDataFile(dir + "/train.bin", DataFormat::kAuto, 300);
  ASSERT_TRUE(nano.ok()) << nano.status();
  ASSERT_EQ(nano->tokens.size(), 1000u);
  for (int i = 0; i < 999; ++i) ASSERT_EQ(nano->tokens[i], (i * 7 + (i / 5) % 3) % 300) << i;
  EXPECT_EQ(nano->tokens[999], 299);
  EXPECT_EQ(nano->description,
            "1000 tokens (uint16, headerless nanoGPT .bin) of " + dir + "/train.bin");
  // Read as bytes when told.
  auto as_bytes = LoadDataFile(dir + "/train.bin", DataFormat::kBytes, 256);
  ASSERT_TRUE(as_bytes.ok());
  EXPECT_EQ(as_bytes->tokens.size(), 2000u);

  WriteLlmcBin(dir + "/shard.dat", 500, 500);  // the magic decides, not the name
  auto llmc = LoadDataFile(dir + "/shard.dat", DataFormat::kAuto, 300);
  ASSERT_TRUE(llmc.ok()) << llmc.status();
  ASSERT_EQ(llmc->tokens.size(), 500u);
  for (int i = 0; i < 500; ++i) ASSERT_EQ(llmc->tokens[i], (i * 7 + (i / 5) % 3) % 300) << i;
  EXPECT_EQ(llmc->description, "500 tokens (uint16, llm.c GPT-2 header) of " + dir + "/shard.dat");
  EXPECT_EQ(bytes->description, std::to_string(raw.size()) + " bytes of " + text);

  // llm.c's Llama 3 layout: uint32 ids, here all above 65535.
  WriteLlmcLlama3Bin(dir + "/llama3.dat", 600);
  auto llama3 = LoadDataFile(dir + "/llama3.dat", DataFormat::kAuto, 128256);
  ASSERT_TRUE(llama3.ok()) << llama3.status();
  ASSERT_EQ(llama3->tokens.size(), 600u);
  for (int i = 0; i < 600; ++i) {
    ASSERT_EQ(llama3->tokens[i], 70000u + (i * 7 + (i / 5) % 3) % 300) << i;
  }
  EXPECT_EQ(llama3->description,
            "600 tokens (uint32, llm.c Llama 3 header) of " + dir + "/llama3.dat");
  // --data-format=tokens reads the header too; bytes reads the bytes.
  auto forced = LoadDataFile(dir + "/llama3.dat", DataFormat::kTokens, 128256);
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_EQ(forced->tokens, llama3->tokens);
  auto raw_llama3 = LoadDataFile(dir + "/llama3.dat", DataFormat::kBytes, 256);
  ASSERT_TRUE(raw_llama3.ok());
  EXPECT_EQ(raw_llama3->tokens.size(), 1024u + 4 * 600);
}

TEST(DataFile, WriteTokenFileRoundTripsBothWidths) {
  const std::string dir = TempDir("write_tokens");
  // vocab <= 65536: llm.c's GPT-2 header, uint16 ids (65535 the largest).
  const std::vector<uint32_t> small = {0, 1, 50256, 65535, 7, 65535};
  ASSERT_TRUE(WriteTokenFile(dir + "/small.bin", small, 65536).ok());
  std::string bytes = ReadBytes(dir + "/small.bin");
  ASSERT_EQ(bytes.size(), 1024u + 2 * small.size());
  auto read = LoadDataFile(dir + "/small.bin", DataFormat::kAuto, 65536);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->tokens, small);
  EXPECT_EQ(read->description, "6 tokens (uint16, llm.c GPT-2 header) of " + dir + "/small.bin");

  // vocab > 65536: the Llama 3 header, uint32 ids; ids above 65535 survive.
  std::vector<uint32_t> large = {0, 65535, 65536, 128000, 128255, 151935, 3};
  for (uint32_t i = 0; i < 1000; ++i) large.push_back((i * 2654435761u) % 151936);
  ASSERT_TRUE(WriteTokenFile(dir + "/large.bin", large, 151936).ok());
  bytes = ReadBytes(dir + "/large.bin");
  ASSERT_EQ(bytes.size(), 1024u + 4 * large.size());
  read = LoadDataFile(dir + "/large.bin", DataFormat::kAuto, 151936);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->tokens, large);
  EXPECT_EQ(read->description,
            "1007 tokens (uint32, llm.c Llama 3 header) of " + dir + "/large.bin");
  // The header is llm.c's, byte for byte: numpy reads what llm.c's
  // train_llama3.py checks (magic, version, count; the ids as uint32).
  RunPython(
      "import numpy as np\n"
      "h = np.fromfile('" +
      dir +
      "/large.bin', dtype=np.int32, count=256)\n"
      "assert (h[0], h[1], h[2]) == (20240801, 7, 1007), h[:3]\n"
      "assert not h[3:].any()\n"
      "t = np.fromfile('" +
      dir +
      "/large.bin', dtype=np.uint32, offset=1024)\n"
      "assert len(t) == 1007 and t[5] == 151935 and t[2] == 65536, t[:8]\n"
      "h = np.fromfile('" +
      dir +
      "/small.bin', dtype=np.int32, count=256)\n"
      "assert (h[0], h[1], h[2]) == (20240520, 1, 6), h[:3]\n"
      "t = np.fromfile('" +
      dir +
      "/small.bin', dtype=np.uint16, offset=1024)\n"
      "assert list(t) == [0, 1, 50256, 65535, 7, 65535], t\n");

  // Overwrites whole (rename over the old file), leaving no temporary file.
  ASSERT_TRUE(WriteTokenFile(dir + "/large.bin", {5, 6}, 200000).ok());
  read = LoadDataFile(dir + "/large.bin", DataFormat::kAuto, 200000);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->tokens, (std::vector<uint32_t>{5, 6}));
  int entries = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    EXPECT_THAT(entry.path().filename().string(), ::testing::Not(HasSubstr(".tmp")));
    ++entries;
  }
  EXPECT_EQ(entries, 2);
}

TEST(DataFile, WriteTokenFileRefusesIdsOutsideTheVocabulary) {
  const std::string dir = TempDir("write_refused");
  absl::Status s = WriteTokenFile(dir + "/a.bin", {1, 2, 70000, 4}, 65536);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "trainer::WriteTokenFile('" + dir +
                             "/a.bin'): id 70000 at position 2: expected ids < vocab 65536");
  s = WriteTokenFile(dir + "/a.bin", {128256}, 128256);
  EXPECT_THAT(s.message(), HasSubstr("id 128256 at position 0: expected ids < vocab 128256"));
  s = WriteTokenFile(dir + "/a.bin", {1}, 0);
  EXPECT_THAT(s.message(), HasSubstr("vocab 0: expected a vocabulary size in [1, 4294967296]"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/a.bin"));  // nothing written
  s = WriteTokenFile(dir + "/no/such/dir/a.bin", {1}, 10);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("trainer::WriteTokenFile('" + dir + "/no/such/dir/a.bin')"));
}

TEST(DataFile, BadFilesAreOneLineNamingDataValueAndExpectation) {
  const std::string dir = TempDir("bad_files");
  auto message = [](const std::string& path, DataFormat format, int64_t vocab) {
    auto loaded = LoadDataFile(path, format, vocab);
    EXPECT_FALSE(loaded.ok());
    const std::string m(loaded.status().message());
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    return m;
  };
  std::ofstream(dir + "/odd.bin", std::ios::binary) << "abc";
  EXPECT_EQ(message(dir + "/odd.bin", DataFormat::kAuto, 300),
            "--data='" + dir +
                "/odd.bin': 3 bytes: expected a whole number of uint16 token ids (an even "
                "size), as nanoGPT's .bin (or --data-format=bytes for text)");
  WriteNanoGptBin(dir + "/big.bin", 100, 5000);
  EXPECT_EQ(message(dir + "/big.bin", DataFormat::kAuto, 300),
            "--data='" + dir +
                "/big.bin': token 99 is id 5000: expected ids < --vocab=300 (pass the "
                "tokenizer's vocabulary size, e.g. --vocab 50257 for GPT-2, 128256 for "
                "Llama 3)");
  WriteLlmcBin(dir + "/cut.bin", 400, 500);
  EXPECT_EQ(message(dir + "/cut.bin", DataFormat::kAuto, 300),
            "--data='" + dir +
                "/cut.bin': llm.c GPT-2 header (uint16 ids) says 500 tokens, so 2024 bytes: "
                "expected that size, the file has 1824 (truncated?)");
  // The Llama 3 layout: a size that is not 1024 + 4 * count (here the
  // size a uint16 file of that count would have).
  WriteRawLlmc(dir + "/cut32.bin", 20240801, 7, 3, Uint32Bytes({1, 2, 3}).substr(0, 6));
  EXPECT_EQ(message(dir + "/cut32.bin", DataFormat::kAuto, 300),
            "--data='" + dir +
                "/cut32.bin': llm.c Llama 3 header (uint32 ids) says 3 tokens, so 1036 bytes: "
                "expected that size, the file has 1030 (truncated?)");
  // Versions llm.c does not write under a magic.
  WriteRawLlmc(dir + "/v2.bin", 20240520, 2, 3, Uint32Bytes({1, 2, 3}));
  EXPECT_EQ(message(dir + "/v2.bin", DataFormat::kAuto, 300),
            "--data='" + dir +
                "/v2.bin': llm.c header (magic 20240520) version 2: expected 1 (uint16 GPT-2 "
                "ids; llm.c writes uint32 ids under magic 20240801, version 7)");
  WriteRawLlmc(dir + "/v1.bin", 20240801, 1, 3, Uint32Bytes({1, 2, 3}));
  EXPECT_EQ(message(dir + "/v1.bin", DataFormat::kTokens, 300),
            "--data='" + dir +
                "/v1.bin': llm.c header (magic 20240801) version 1: expected 7 (uint32 Llama 3 "
                "ids)");
  // An id >= --vocab in a uint32 file: its position, the id, --vocab.
  WriteRawLlmc(dir + "/big32.dat", 20240801, 7, 4, Uint32Bytes({5, 128255, 128256, 9}));
  EXPECT_EQ(message(dir + "/big32.dat", DataFormat::kAuto, 128256),
            "--data='" + dir +
                "/big32.dat': token 2 is id 128256: expected ids < --vocab=128256 (pass the "
                "tokenizer's vocabulary size, e.g. --vocab 50257 for GPT-2, 128256 for "
                "Llama 3)");
  WriteRawLlmc(dir + "/huge32.bin", 20240801, 7, 1, Uint32Bytes({4294967295u}));
  EXPECT_THAT(message(dir + "/huge32.bin", DataFormat::kAuto, 151936),
              HasSubstr("token 0 is id 4294967295: expected ids < --vocab=151936"));
  // A magic, then less than the header.
  std::ofstream(dir + "/stub.bin", std::ios::binary) << Uint32Bytes({20240801, 7});
  EXPECT_EQ(message(dir + "/stub.bin", DataFormat::kAuto, 300),
            "--data='" + dir +
                "/stub.bin': starts with llm.c's Llama 3 magic 20240801 but has 8 bytes: "
                "expected at least its 1024-byte header (truncated?)");
  EXPECT_THAT(message(dir + "/none.txt", DataFormat::kAuto, 300),
              HasSubstr("--data='" + dir + "/none.txt': no such file"));
  std::ofstream(dir + "/empty.txt");
  EXPECT_THAT(message(dir + "/empty.txt", DataFormat::kAuto, 300), HasSubstr("the file is empty"));
  std::ofstream(dir + "/t.txt") << "hello";
  EXPECT_THAT(message(dir + "/t.txt", DataFormat::kBytes, 64),
              HasSubstr("--vocab=64: expected >= 256 to read --data='"));
  // Shorter than one sequence.
  auto split = SplitTokens(10, 17, false, "--data='x'");
  EXPECT_EQ(split.status().message(),
            "--data='x': 10 tokens to train on: expected at least one sequence of --seq + 1 = "
            "17 tokens");
  split = SplitTokens(100, 17, true, "--data='x'");
  EXPECT_THAT(split.status().message(), HasSubstr("held-out last tenth (--eval-every) is 10"));
}

TEST(DataFile, SplitAndSampler) {
  auto split = SplitTokens(1000, 17, true, "x");
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(split->train_end, 900);
  EXPECT_EQ(split->val_begin, 900);
  EXPECT_EQ(split->val_end, 1000);
  split = SplitTokens(1000, 17, false, "x");
  EXPECT_EQ(split->train_end, 1000);
  EXPECT_EQ(split->val_end, split->val_begin);

  // The token sampler over widened bytes is the text sampler.
  std::vector<uint8_t> corpus(5000);
  for (size_t i = 0; i < corpus.size(); ++i) corpus[i] = static_cast<uint8_t>(i * 31 % 251);
  const std::vector<uint32_t> widened(corpus.begin(), corpus.end());
  for (int64_t step : {1, 2, 77}) {
    BatchSpec spec{3, step, 8, 17, 1, 2};
    auto a = SampleTextBatch(corpus, spec);
    auto b = SampleTokenBatch(widened, 0, 5000, spec);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE(at::equal(*a, *b)) << step;
  }
  // Rows of a range stay inside it: ids equal positions here.
  std::vector<uint32_t> positions(3000);
  for (size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<uint32_t>(i);
  for (int64_t step = 0; step < 50; ++step) {
    auto rows = SampleTokenBatch(positions, 2700, 3000, {0, step, 4, 17, 0, 1});
    ASSERT_TRUE(rows.ok());
    EXPECT_GE(rows->min().item<int64_t>(), 2700);
    EXPECT_LT(rows->max().item<int64_t>(), 3000);
  }
  // 32-bit ids reach the batch unchanged.
  std::vector<uint32_t> wide(100);
  for (size_t i = 0; i < wide.size(); ++i) wide[i] = 4294967295u - static_cast<uint32_t>(i);
  auto rows = SampleTokenBatch(wide, 0, 100, {0, 3, 2, 100, 0, 1});
  ASSERT_TRUE(rows.ok());
  EXPECT_EQ(rows->max().item<int64_t>(), 4294967295);
  EXPECT_EQ(rows->min().item<int64_t>(), 4294967196);
}

struct Log {
  std::vector<int64_t> steps;
  std::vector<double> losses;
  std::vector<std::pair<int64_t, double>> val;  // (step, val_loss)
};

Log ReadDataLog(const std::string& path) {
  Log log;
  for (const std::string& line : ReadLines(path)) {
    auto object = ParseJsonLine(line);
    if (!object) continue;
    log.steps.push_back(object->at("step").get<int64_t>());
    log.losses.push_back(object->at("loss").get<double>());
    if (object->count("val_loss")) {
      log.val.emplace_back(log.steps.back(), object->at("val_loss").get<double>());
    }
  }
  return log;
}

double Mean(const std::vector<double>& v, size_t begin, size_t end) {
  double sum = 0;
  for (size_t i = begin; i < end; ++i) sum += v[i];
  return sum / static_cast<double>(end - begin);
}

constexpr char kModel[] =
    "--layers 1 --dim 32 --heads 4 --seq 32 --global-batch 8 --warmup-steps 5 --lr 1e-2 ";

TEST(TrainerData, LossesFallOnATextFileWithAValidationLoss) {
  const std::string dir = TempDir("text_run");
  const std::string text = WriteText(dir + "/corpus.txt");
  const RunResult r = RunTrainer(std::string(kModel) + "--nproc 2 --steps 60 --eval-every 20 " +
                                 "--data " + text + " --log-json " + dir + "/log.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("bytes of " + text + ", the last "));
  EXPECT_THAT(r.output, HasSubstr("step 20  val loss "));
  EXPECT_THAT(r.output, HasSubstr(" perplexity "));
  const Log log = ReadDataLog(dir + "/log.jsonl");
  ASSERT_EQ(log.losses.size(), 60u);
  EXPECT_LT(Mean(log.losses, 50, 60), Mean(log.losses, 0, 10) - 1.0);
  ASSERT_EQ(log.val.size(), 3u);
  EXPECT_EQ(log.val[0].first, 20);
  EXPECT_EQ(log.val[2].first, 60);
  EXPECT_LT(log.val[2].second, log.val[0].second);
}

TEST(TrainerData, LossesFallOnABinFile) {
  const std::string dir = TempDir("bin_run");
  WriteNanoGptBin(dir + "/train.bin", 20000, 511);
  const RunResult r = RunTrainer(std::string(kModel) + "--nproc 1 --vocab 512 --steps 60 " +
                                 "--data " + dir + "/train.bin --log-json " + dir + "/log.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("20000 tokens (uint16, headerless nanoGPT .bin) of " + dir));
  const Log log = ReadDataLog(dir + "/log.jsonl");
  ASSERT_EQ(log.losses.size(), 60u);
  EXPECT_GT(Mean(log.losses, 0, 5), 5.5);  // ~ln 512 = 6.24 at the start
  EXPECT_LT(Mean(log.losses, 50, 60), Mean(log.losses, 0, 10) - 2.0);
}

// A small run (a 70300-row embedding makes each step costly on 2 cores): the
// uint32 file reaches the model, the first loss is ln(--vocab), it falls.
TEST(TrainerData, LossesFallOnALlama3FileWithIdsAbove65535) {
  const std::string dir = TempDir("llama3_run");
  WriteLlmcLlama3Bin(dir + "/train.bin", 20000);  // ids 70000..70299
  const RunResult r = RunTrainer(
      "--layers 1 --dim 32 --heads 4 --seq 16 --global-batch 4 --warmup-steps 2 --lr 3e-2 "
      "--nproc 1 --vocab 70300 --steps 12 --data " +
      dir + "/train.bin --log-json " + dir + "/log.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("20000 tokens (uint32, llm.c Llama 3 header) of " + dir));
  const Log log = ReadDataLog(dir + "/log.jsonl");
  ASSERT_EQ(log.losses.size(), 12u);
  EXPECT_NEAR(log.losses[0], std::log(70300.0), 0.3);  // 11.16
  EXPECT_LT(Mean(log.losses, 9, 12), log.losses[0] - 2.0);
}

TEST(TrainerData, ARestartMidRunContinuesWithTheSameLosses) {
  const std::string dir = TempDir("restart_run");
  const std::string text = WriteText(dir + "/corpus.txt");
  // A constant schedule: a cosine one depends on --steps, which differs
  // between the interrupted run's two parts.
  const std::string model = std::string(kModel) + "--lr-schedule constant ";
  const std::string args =
      model + "--nproc 2 --steps 20 --eval-every 5 --data " + text + " --checkpoint-every 5 ";
  RunResult r = RunTrainer(args + "--checkpoint-dir " + dir + "/a --log-json " + dir + "/a.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = RunTrainer(model + "--nproc 2 --steps 10 --eval-every 5 --data " + text +
                 " --checkpoint-every 5 --checkpoint-dir " + dir + "/b --log-json " + dir +
                 "/b.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = RunTrainer(args + "--resume --checkpoint-dir " + dir + "/b --log-json " + dir + "/b.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const Log a = ReadDataLog(dir + "/a.jsonl");
  const Log b = ReadDataLog(dir + "/b.jsonl");
  ASSERT_EQ(b.steps.size(), 20u);
  EXPECT_EQ(a.steps, b.steps);
  EXPECT_EQ(a.losses, b.losses);  // bit for bit: the same batches, the same state
  EXPECT_EQ(a.val, b.val);
  ASSERT_EQ(a.val.size(), 4u);
}

TEST(TrainerData, BadFilesStopTheRunBeforeStepOne) {
  const std::string dir = TempDir("bad_run");
  std::ofstream(dir + "/odd.bin", std::ios::binary) << "abc";
  RunResult r = RunTrainer(std::string(kModel) + "--nproc 1 --steps 3 --data " + dir + "/odd.bin");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("trainer: --data='" + dir +
                                  "/odd.bin': 3 bytes: expected a "
                                  "whole number of uint16 token ids"));
  WriteNanoGptBin(dir + "/big.bin", 1000, 700);
  r = RunTrainer(std::string(kModel) + "--nproc 2 --steps 3 --vocab 512 --data " + dir +
                 "/big.bin");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("token 999 is id 700: expected ids < --vocab=512"));
  std::ofstream(dir + "/short.txt") << "too short";
  r = RunTrainer(std::string(kModel) + "--nproc 1 --steps 3 --data " + dir + "/short.txt");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--data='" + dir +
                                  "/short.txt': 9 tokens to train on: "
                                  "expected at least one sequence of --seq + 1 = 33 tokens"));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("step 1")));
}

}  // namespace
}  // namespace trainer::testing
