// state_dict's loader of PyTorch files (issue 27, "Loading is linear"): the
// time to load files whose size grows by 10x per step, so that the time per
// key (or record, or container) shows whether loading is linear. A
// quadratic step shows as a time per key that grows 10x per step.
//
//   bazel run //benchmarks:loader_bench
//
//   BM_ManyKeys/N          LoadIValue of one dict of N str keys -> int
//                          (SaveIValue writes it as torch.save does: EMPTY_DICT,
//                          MARK, N key/value pairs, SETITEMS), N = 1e4..1e6
//   BM_ManyRecords/N       LoadTensorDict of N one-element tensors, each its
//                          own storage record in the zip, N = 1e3..1e5
//   BM_DictFloor/N         the c10 dict of N str keys that BM_ManyKeys's load
//                          returns, built from strings in memory: the floor
//   BM_DeepNesting/K       LoadIValue of a list of K lists, each nested
//                          kDepth levels deep (the loader's limit is 1000),
//                          K = 10..1000 (K * kDepth containers)
//
// The files are written once (under $TMPDIR, else /tmp) before the first
// iteration and read from the page cache; each iteration is one whole load.
// The summary prints the time per item of each case and the ratio of the
// largest case's to the smallest's (1.0 = linear).
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <torch/types.h>

#include "benchmarks/machine_report.h"
#include "state_dict/tensor_dict.h"

namespace {

constexpr int kDepth = 1000;

const std::string& Scratch() {
  static const std::string* dir = [] {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base != nullptr ? base : "/tmp") + "/loader_bench.XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      std::fprintf(stderr, "loader_bench: cannot create %s\n", pattern.c_str());
      std::exit(1);
    }
    auto* d = new std::string(pattern);
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(*dir, ignored);
    });
    return d;
  }();
  return *dir;
}

void Check(const absl::Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "loader_bench: %s: %s\n", what, std::string(status.message()).c_str());
  std::exit(1);
}

// Each file is made once per process, on the first run of its case.
std::string File(const std::string& name,
                 const std::function<absl::Status(const std::string&)>& write) {
  static std::map<std::string, std::string>* made = new std::map<std::string, std::string>;
  auto found = made->find(name);
  if (found != made->end()) return found->second;
  const std::string path = Scratch() + "/" + name + ".pt";
  Check(write(path), name.c_str());
  (*made)[name] = path;
  return path;
}

std::string ManyKeysFile(int64_t n) {
  return File("keys_" + std::to_string(n), [n](const std::string& path) {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    for (int64_t i = 0; i < n; ++i) dict.insert("layer." + std::to_string(i) + ".weight", i);
    return state_dict::SaveIValue(c10::IValue(dict), path);
  });
}

std::string ManyRecordsFile(int64_t n) {
  return File("records_" + std::to_string(n), [n](const std::string& path) {
    state_dict::TensorDict tensors;
    for (int64_t i = 0; i < n; ++i) {
      tensors.insert("p" + std::to_string(i), torch::full({1}, static_cast<float>(i)));
    }
    return state_dict::SaveTensorDict(tensors, path);
  });
}

std::string DeepNestingFile(int64_t k) {
  return File("nested_" + std::to_string(k), [k](const std::string& path) {
    c10::impl::GenericList outer(c10::AnyType::get());
    for (int64_t i = 0; i < k; ++i) {
      c10::IValue chain = c10::IValue(i);
      // kDepth - 1 levels here, the outer list makes kDepth.
      for (int d = 0; d + 1 < kDepth; ++d) {
        c10::impl::GenericList level(c10::AnyType::get());
        level.push_back(std::move(chain));
        chain = c10::IValue(level);
      }
      outer.push_back(std::move(chain));
    }
    return state_dict::SaveIValue(c10::IValue(outer), path);
  });
}

void SetCounters(benchmark::State& state, int64_t items, const std::string& path) {
  state.counters["items"] = static_cast<double>(items);
  state.counters["file_bytes"] = static_cast<double>(std::filesystem::file_size(path));
}

void BM_ManyKeys(benchmark::State& state) {
  const std::string path = ManyKeysFile(state.range(0));
  for (auto _ : state) {
    auto value = state_dict::LoadIValue(path);
    Check(value.status(), "LoadIValue");
    if (value->toGenericDict().size() != static_cast<size_t>(state.range(0))) {
      state.SkipWithError("wrong key count");
    }
  }
  SetCounters(state, state.range(0), path);
}
BENCHMARK(BM_ManyKeys)
    ->Arg(10000)
    ->Arg(100000)
    ->Arg(1000000)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The part of BM_ManyKeys no loader avoids: the c10 dict of N str keys a
// load returns, built from strings already in memory, and destroyed. Its
// time per key grows with N as BM_ManyKeys's does (hash tables and fresh
// memory outgrowing the caches), which is what that growth is.
void BM_DictFloor(benchmark::State& state) {
  std::vector<std::string> keys;
  for (int64_t i = 0; i < state.range(0); ++i)
    keys.push_back("layer." + std::to_string(i) + ".weight");
  for (auto _ : state) {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    dict.reserve(static_cast<int64_t>(keys.size()));
    for (size_t i = 0; i < keys.size(); ++i) {
      dict.insert_or_assign(c10::IValue(keys[i]), c10::IValue(static_cast<int64_t>(i)));
    }
    benchmark::DoNotOptimize(dict);
  }
  state.counters["items"] = static_cast<double>(state.range(0));
}
BENCHMARK(BM_DictFloor)
    ->Arg(10000)
    ->Arg(100000)
    ->Arg(1000000)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_ManyRecords(benchmark::State& state) {
  const std::string path = ManyRecordsFile(state.range(0));
  for (auto _ : state) {
    auto loaded = state_dict::LoadTensorDict(path);
    Check(loaded.status(), "LoadTensorDict");
    if (loaded->tensors.size() != static_cast<size_t>(state.range(0))) {
      state.SkipWithError("wrong tensor count");
    }
  }
  SetCounters(state, state.range(0), path);
}
BENCHMARK(BM_ManyRecords)
    ->Arg(1000)
    ->Arg(10000)
    ->Arg(100000)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_DeepNesting(benchmark::State& state) {
  const std::string path = DeepNestingFile(state.range(0));
  for (auto _ : state) {
    auto value = state_dict::LoadIValue(path);
    Check(value.status(), "LoadIValue");
  }
  SetCounters(state, state.range(0) * kDepth, path);
}
BENCHMARK(BM_DeepNesting)
    ->Arg(10)
    ->Arg(100)
    ->Arg(1000)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void Summary(const benchmarks::Results& results) {
  std::map<std::string, std::map<double, double>> per_item;  // case -> items -> ns/item
  for (const auto& [name, m] : results) {
    const std::string family = name.substr(0, name.find('/'));
    const double items = m.counters.at("items");
    per_item[family][items] = m.real_s * 1e9 / items;
  }
  std::printf("time per item (ns), and the largest case's over the smallest's (1.0 = linear):\n");
  for (const auto& [family, by_items] : per_item) {
    std::printf("  %-16s", family.c_str());
    for (const auto& [items, ns] : by_items) std::printf("  %9.0f: %7.1f", items, ns);
    if (by_items.size() > 1) {
      std::printf("   ratio %.2f", by_items.rbegin()->second / by_items.begin()->second);
    }
    std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmarks::UseAllCores("loader_bench");
  benchmarks::SummaryReporter reporter(Summary);
  return benchmarks::RunWithSummary(argc, argv, reporter);
}
