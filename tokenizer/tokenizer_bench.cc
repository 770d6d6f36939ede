// Encoding throughput, MB/s of UTF-8 text: one thread (Encode of each
// document in turn) and N threads (EncodeBatch), with a tokenizer.json and a
// corpus from this machine. tokenizer/tokenizer_bench.py runs `tokenizers`
// and tiktoken on the same bytes and then this binary, and prints the ratios.
//
//   bazel run -c opt //tokenizer:tokenizer_bench -- \
//       [--tokenizer=FILE] [--corpus=FILE] [--write_ids=FILE] [benchmark flags]
//
// --tokenizer: default tokenizer/testdata/llama3/tokenizer.json (Llama 3's
// layout, a 4,000-token vocabulary trained here). --corpus: a UTF-8 file;
// default, the corpus tokenizer_bench.py also builds: the licence texts
// (/usr/share/common-licenses), then man pages (/usr/share/man/man1/*.gz, in
// name order, decompressed) up to 4 MB, then C headers (/usr/include/*.h, in
// name order) up to 8 MB; bytes that are not UTF-8 replaced by U+FFFD. The
// corpus is cut into documents at the first line end after every 8 KiB.
// --write_ids: the ids of each document first (add_special_tokens false), as
// little-endian int32: the count, then the ids; tokenizer_bench.py compares
// them with `tokenizers`' ids.
#include <benchmark/benchmark.h>
#include <libdeflate.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tokenizer/internal/utf8.h"
#include "tokenizer/tokenizer.h"

namespace {

namespace fs = std::filesystem;

constexpr size_t kManPagesUpTo = 4 << 20;
constexpr size_t kHeadersUpTo = 8 << 20;
constexpr size_t kDocumentBytes = 8 << 10;

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

std::string Gunzip(const std::string& gz) {
  if (gz.size() < 18) return "";
  uint32_t size;
  std::memcpy(&size, gz.data() + gz.size() - 4, 4);  // ISIZE, little-endian
  std::string out(size, '\0');
  libdeflate_decompressor* d = libdeflate_alloc_decompressor();
  size_t actual = 0;
  const libdeflate_result r =
      libdeflate_gzip_decompress(d, gz.data(), gz.size(), out.data(), out.size(), &actual);
  libdeflate_free_decompressor(d);
  if (r != LIBDEFLATE_SUCCESS) return "";
  out.resize(actual);
  return out;
}

std::vector<fs::path> Sorted(const fs::path& dir, const std::string& suffix) {
  std::vector<fs::path> paths;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && name.size() >= suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      paths.push_back(entry.path());
    }
  }
  std::sort(paths.begin(), paths.end());
  return paths;
}

void AppendText(const std::string& bytes, std::string* corpus) {
  tokenizer::internal::AppendUtf8Lossy(bytes, corpus);
}

std::string MachineCorpus() {
  std::string corpus;
  for (const fs::path& p : Sorted("/usr/share/common-licenses", ""))
    AppendText(ReadFile(p), &corpus);
  for (const fs::path& p : Sorted("/usr/share/man/man1", ".gz")) {
    if (corpus.size() >= kManPagesUpTo) break;
    AppendText(Gunzip(ReadFile(p)), &corpus);
  }
  for (const fs::path& p : Sorted("/usr/include", ".h")) {
    if (corpus.size() >= kHeadersUpTo) break;
    AppendText(ReadFile(p), &corpus);
  }
  return corpus;
}

std::vector<std::string> Documents(const std::string& corpus) {
  std::vector<std::string> docs;
  size_t start = 0;
  while (start < corpus.size()) {
    size_t end = start + kDocumentBytes;
    if (end >= corpus.size()) {
      end = corpus.size();
    } else {
      const size_t newline = corpus.find('\n', end);
      end = newline == std::string::npos ? corpus.size() : newline + 1;
    }
    docs.push_back(corpus.substr(start, end - start));
    start = end;
  }
  return docs;
}

struct Setup {
  std::string tokenizer_path = "tokenizer/testdata/llama3/tokenizer.json";
  std::string corpus_path;
  std::string ids_path;
  std::optional<tokenizer::Tokenizer> tok;
  std::vector<std::string> docs;
  size_t bytes = 0;
};

Setup& Get() {
  static Setup setup;
  return setup;
}

void BM_EncodeOneThread(benchmark::State& state) {
  Setup& s = Get();
  size_t ids = 0;
  for (auto _ : state) {
    ids = 0;
    for (const std::string& doc : s.docs) {
      absl::StatusOr<std::vector<tokenizer::TokenId>> out =
          s.tok->Encode(doc, {.add_special_tokens = false});
      if (!out.ok()) {
        state.SkipWithError(std::string(out.status().message()).c_str());
        return;
      }
      ids += out->size();
      benchmark::DoNotOptimize(out->data());
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * s.bytes));
  state.counters["ids"] = static_cast<double>(ids);
}

void BM_EncodeBatch(benchmark::State& state) {
  Setup& s = Get();
  const int threads = static_cast<int>(state.range(0));
  for (auto _ : state) {
    auto out = s.tok->EncodeBatch(s.docs, {.add_special_tokens = false}, threads);
    if (!out.ok()) {
      state.SkipWithError(std::string(out.status().message()).c_str());
      return;
    }
    benchmark::DoNotOptimize(out->data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * s.bytes));
}

void BM_Load(benchmark::State& state) {
  const std::string text = ReadFile(Get().tokenizer_path);
  for (auto _ : state) {
    auto tok = tokenizer::Tokenizer::FromJson(text);
    if (!tok.ok()) state.SkipWithError(std::string(tok.status().message()).c_str());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
}

}  // namespace

int main(int argc, char** argv) {
  Setup& s = Get();
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--tokenizer=", 0) == 0) {
      s.tokenizer_path = arg.substr(12);
    } else if (arg.rfind("--corpus=", 0) == 0) {
      s.corpus_path = arg.substr(9);
    } else if (arg.rfind("--write_ids=", 0) == 0) {
      s.ids_path = arg.substr(12);
    } else {
      rest.push_back(argv[i]);
    }
  }
  // bazel run starts in the runfiles; a relative path is the caller's.
  if (const char* cwd = std::getenv("BUILD_WORKING_DIRECTORY")) {
    for (std::string* p : {&s.tokenizer_path, &s.corpus_path, &s.ids_path}) {
      if (!p->empty() && (*p)[0] != '/') {
        *p = (fs::path(cwd) / *p).string();
      }
    }
  }
  absl::StatusOr<tokenizer::Tokenizer> tok = tokenizer::Tokenizer::FromFile(s.tokenizer_path);
  if (!tok.ok()) {
    std::cerr << tok.status() << "\n";
    return 1;
  }
  s.tok.emplace(std::move(*tok));
  const std::string corpus = s.corpus_path.empty() ? MachineCorpus() : ReadFile(s.corpus_path);
  s.docs = Documents(corpus);
  s.bytes = corpus.size();
  std::cerr << "tokenizer " << s.tokenizer_path << "; corpus "
            << (s.corpus_path.empty() ? "of this machine" : s.corpus_path) << ": " << corpus.size()
            << " bytes, " << s.docs.size() << " documents\n";
  if (!s.ids_path.empty()) {
    std::ofstream out(s.ids_path, std::ios::binary);
    for (const std::string& doc : s.docs) {
      absl::StatusOr<std::vector<tokenizer::TokenId>> ids =
          s.tok->Encode(doc, {.add_special_tokens = false});
      if (!ids.ok()) {
        std::cerr << ids.status() << "\n";
        return 1;
      }
      const auto n = static_cast<int32_t>(ids->size());
      out.write(reinterpret_cast<const char*>(&n), sizeof(n));
      out.write(reinterpret_cast<const char*>(ids->data()), n * sizeof(int32_t));
    }
    if (!out) {
      std::cerr << s.ids_path << ": write failed\n";
      return 1;
    }
  }

  benchmark::RegisterBenchmark("BM_EncodeOneThread", BM_EncodeOneThread)
      ->Unit(benchmark::kMillisecond)
      ->MinTime(2.0)
      ->UseRealTime();
  const int cores = std::max(2u, std::thread::hardware_concurrency());
  for (int t = 1; t <= cores; t *= 2) {
    benchmark::RegisterBenchmark("BM_EncodeBatch", BM_EncodeBatch)
        ->Arg(t)
        ->Unit(benchmark::kMillisecond)
        ->MinTime(2.0)
        ->UseRealTime();
  }
  benchmark::RegisterBenchmark("BM_Load", BM_Load)->Unit(benchmark::kMillisecond);
  int rest_argc = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_argc, rest.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
