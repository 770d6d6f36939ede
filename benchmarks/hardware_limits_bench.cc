// This machine's limits, measured in one run, to bound the workloads of the
// other benchmarks (issue 13: "Performance at the machine's limit"):
//
//   bazel run //benchmarks:hardware_limits_bench
//
//   BM_Sgemm/<workload>/MxKxN/onednn  the same through kernels::MmOut
//                               (oneDNN, kernels/cpu_matmul.h), what the
//                               Llama model's CPU linears run; on AMD
//                               processors about 2x the BLAS's.
//   BM_Sgemm/<workload>/MxKxN   float32 C = A B through torch::mm_out (ATen ->
//                               libblas.so.3, OpenBLAS here) at the shapes
//                               the workloads run: square 512 / 2048, the
//                               Hessian MLP's batched layer (1024 x 512 x
//                               512, hessian_bench), and the trainer_bench
//                               transformer's matmuls (2 rows x 32 tokens =
//                               64 rows per rank, dim 512, MLP 4 x 512; and
//                               1024 rows, its compute-bound MFU setting).
//                               Counter FLOP/s = 2 M K N per call; the
//                               summary prints the peak (max over shapes)
//                               and each shape as a fraction of it.
//   BM_Memcpy*, BM_TensorCopy   a 256 MiB buffer (8x the 32 MiB L3) copied
//                               into another, already faulted in. Convention:
//                               bytes_per_second = bytes COPIED per second
//                               (256 MiB per iteration); the counter
//                               "rd+wr/s" is the DRAM traffic that implies,
//                               2x (read the source + write the
//                               destination; the write-allocate read a
//                               non-streaming store may add is not counted).
//   BM_LoopbackTcp              one 64 MiB message over a TCP connection on
//                               127.0.0.1 (both ends in this process, the
//                               receiver on its own thread), sent and
//                               received in 4 MiB calls, then a 1-byte ack;
//                               bytes_per_second = payload bytes one way.
//                               The bound on what Gloo can do between two
//                               local ranks (comm_bench, flat_param_bench).
//
// All cases use real time: OpenBLAS and the copy threads run outside the
// benchmark thread, whose CPU time would undercount. Threads are left as the
// environment sets them (label: LibTorch intra-op threads, OpenBLAS's pool,
// the OPENBLAS_* variables as found; this binary never sets them).
#include <arpa/inet.h>
#include <benchmark/benchmark.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <torch/types.h>
#include <torch/utils.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "benchmarks/machine_report.h"
#include "kernels/cpu_matmul.h"

namespace {

// --- sgemm --------------------------------------------------------------

struct GemmShape {
  const char* workload;
  int64_t m, k, n;
};

// Workload shapes; why each is here is in its name.
const GemmShape kGemmShapes[] = {
    {"square", 512, 512, 512},
    {"square", 2048, 2048, 2048},
    // hessian_bench: vmap over 1024 points of a 512 -> 512 layer.
    {"hessian_mlp", 1024, 512, 512},
    // hessian_bench, forward-over-reverse: 1024 points x 3 outputs x 2
    // input directions batched into one matmul.
    {"hessian_mlp_fwd_over_rev", 6144, 512, 512},
    // trainer_bench TransformerLM (dim 512, 64 token rows per rank):
    {"transformer_fc1", 64, 512, 2048},        // [64,512] x [512,2048]
    {"transformer_fc2", 64, 2048, 512},        // [64,2048] x [2048,512]
    {"transformer_attn_in", 64, 512, 1536},    // q,k,v projection
    {"transformer_fc1_wgrad", 2048, 64, 512},  // dW = dY^T X, K = 64 rows
    // The same at the compute-bound configuration MFU is measured at
    // (TRAINER_BENCH_ROWS=8 TRAINER_BENCH_SEQ=128: 1024 token rows).
    {"transformer_mfu_fc1", 1024, 512, 2048},
    {"transformer_mfu_fc2", 1024, 2048, 512},
    {"transformer_mfu_attn_in", 1024, 512, 1536},
    {"transformer_mfu_fc1_wgrad", 2048, 1024, 512},
};

// at::mm_out (the BLAS: MKL in the torch wheel) or kernels::MmOut (oneDNN,
// kernels/cpu_matmul.h: what the Llama model's linear layers use on the
// CPU), by `onednn`.
void BM_Sgemm(benchmark::State& state, GemmShape s, bool onednn) {
  torch::manual_seed(0);
  const torch::Tensor a = torch::randn({s.m, s.k});
  const torch::Tensor b = torch::randn({s.k, s.n});
  torch::Tensor c = torch::empty({s.m, s.n});
  // The output is preallocated: this is the kernel's limit, not the
  // allocator's (the workloads allocate; tcmalloc keeps their blocks).
  if (onednn && !kernels::CpuMatmulUsesOneDnn(a, b)) {
    state.SkipWithError(
        "kernels::MmOut would not use oneDNN here (LibTorch without it, or "
        "fewer multiply-adds than kernels::kOneDnnMinMacs)");
    return;
  }
  for (auto _ : state) {
    if (onednn) {
      kernels::MmOut(c, a, b);
    } else {
      torch::mm_out(c, a, b);
    }
    benchmark::DoNotOptimize(c.data_ptr());
  }
  state.counters["FLOP/s"] = benchmark::Counter(2.0 * static_cast<double>(s.m * s.k * s.n),
                                                benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(benchmarks::ThreadsLabel());
}

// --- memory copy ----------------------------------------------------------

constexpr size_t kCopyBytes = size_t{256} << 20;

// Both buffers are written once before timing, so no page fault is timed.
struct CopyBuffers {
  std::vector<char> src = std::vector<char>(kCopyBytes, 1);
  std::vector<char> dst = std::vector<char>(kCopyBytes, 2);
};

void SetCopyCounters(benchmark::State& state) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kCopyBytes));
  state.counters["rd+wr/s"] = benchmark::Counter(
      2.0 * kCopyBytes, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1024);
}

void BM_Memcpy_1Thread(benchmark::State& state) {
  CopyBuffers buf;
  for (auto _ : state) {
    std::memcpy(buf.dst.data(), buf.src.data(), kCopyBytes);
    benchmark::ClobberMemory();
  }
  SetCopyCounters(state);
  state.SetLabel("glibc memcpy, 1 thread");
}

// One core may not saturate the memory system: the same copy split in
// halves over two threads (one per core here; threads started per
// iteration, ~0.1 ms against a copy of tens of ms).
void BM_Memcpy_2Threads(benchmark::State& state) {
  CopyBuffers buf;
  const size_t half = kCopyBytes / 2;
  for (auto _ : state) {
    std::thread other([&] { std::memcpy(buf.dst.data() + half, buf.src.data() + half, half); });
    std::memcpy(buf.dst.data(), buf.src.data(), half);
    other.join();
    benchmark::ClobberMemory();
  }
  SetCopyCounters(state);
  state.SetLabel("glibc memcpy, 2 threads");
}

// What LibTorch's own copy achieves (parallelised over the intra-op threads).
void BM_TensorCopy(benchmark::State& state) {
  const int64_t floats = static_cast<int64_t>(kCopyBytes / sizeof(float));
  const torch::Tensor src = torch::ones({floats});
  torch::Tensor dst = torch::zeros({floats});
  for (auto _ : state) {
    dst.copy_(src);
    benchmark::DoNotOptimize(dst.data_ptr());
  }
  SetCopyCounters(state);
  state.SetLabel("Tensor::copy_ float32; " + benchmarks::ThreadsLabel());
}

// --- loopback TCP ---------------------------------------------------------

constexpr size_t kMessageBytes = size_t{64} << 20;
constexpr size_t kChunkBytes = size_t{4} << 20;
// Every socket call gives up after this long, so a stuck peer fails the
// benchmark instead of hanging it.
constexpr int kSocketTimeoutS = 10;

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

std::string Errno(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

bool SetTimeouts(int fd) {
  timeval tv{};
  tv.tv_sec = kSocketTimeoutS;
  return setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) == 0 &&
         setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) == 0;
}

bool SendAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t r = send(fd, p, std::min(n, kChunkBytes), MSG_NOSIGNAL);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// False on error, timeout or end of stream (*eof tells the last apart).
bool RecvAll(int fd, char* p, size_t n, bool* eof) {
  *eof = false;
  while (n > 0) {
    const ssize_t r = recv(fd, p, std::min(n, kChunkBytes), 0);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) *eof = true;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

void BM_LoopbackTcp(benchmark::State& state) {
  // A listener on 127.0.0.1 only, port picked by the kernel.
  Fd listener(socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (listener.get() < 0 ||
      bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener.get(), 1) != 0 ||
      getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    state.SkipWithError(Errno("listen on 127.0.0.1").c_str());
    return;
  }
  // A loopback connect completes against the backlog; accept then returns
  // at once, so both ends are set up on this thread.
  Fd sender(socket(AF_INET, SOCK_STREAM, 0));
  if (sender.get() < 0 || !SetTimeouts(sender.get()) ||
      connect(sender.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    state.SkipWithError(Errno("connect to 127.0.0.1").c_str());
    return;
  }
  Fd receiver(accept(listener.get(), nullptr, nullptr));
  const int one = 1;
  if (receiver.get() < 0 || !SetTimeouts(receiver.get()) ||
      setsockopt(receiver.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) {
    state.SkipWithError(Errno("accept on 127.0.0.1").c_str());
    return;
  }

  std::vector<char> src(kMessageBytes, 3);
  std::vector<char> dst(kMessageBytes, 0);
  std::atomic<bool> receiver_failed{false};
  std::thread receiving([&] {
    char ack = 1;
    bool eof = false;
    while (RecvAll(receiver.get(), dst.data(), kMessageBytes, &eof)) {
      if (send(receiver.get(), &ack, 1, MSG_NOSIGNAL) != 1) {
        receiver_failed = true;
        return;
      }
    }
    // The sender's shutdown ends the stream between messages; anything else
    // is a failure (the main thread then times out on its ack).
    if (!eof) receiver_failed = true;
  });

  for (auto _ : state) {
    char ack = 0;
    bool eof = false;
    if (!SendAll(sender.get(), src.data(), kMessageBytes) ||
        !RecvAll(sender.get(), &ack, 1, &eof)) {
      state.SkipWithError(Errno("loopback transfer (timeout or peer failure)").c_str());
      break;
    }
  }
  shutdown(sender.get(), SHUT_WR);
  receiving.join();
  if (receiver_failed && !state.error_occurred()) {
    state.SkipWithError("loopback receiver failed");
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kMessageBytes));
  state.SetLabel("64 MiB messages, 4 MiB send/recv calls, one direction, 127.0.0.1");
}

// --- summary ---------------------------------------------------------------

// The nominal float32 FMA peak, for scale only: 2 x 256-bit FMA pipes per
// core (16 multiply-adds = 32 FLOP per cycle: Haswell..Skylake client, Zen
// 2..4 with AVX2) at the clock /proc/cpuinfo reports, which is the base
// clock on a VM; turbo can exceed it.
double NominalPeakFlops() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  double mhz = 0;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("cpu MHz", 0) == 0) {
      mhz = std::stod(line.substr(line.find(':') + 1));
      break;
    }
  }
  return mhz * 1e6 * 32.0 * static_cast<double>(std::thread::hardware_concurrency());
}

void PrintSummary(const benchmarks::Results& results) {
  std::printf("== machine limits (medians; %s)\n", benchmarks::ThreadsLabel().c_str());
  double peak = 0;
  std::string peak_name;
  for (const auto& [name, m] : results) {
    auto it = m.counters.find("FLOP/s");
    if (name.rfind("BM_Sgemm/", 0) == 0 && it != m.counters.end() && it->second > peak) {
      peak = it->second;
      peak_name = name;
    }
  }
  if (peak > 0) {
    std::printf("sgemm peak (max over shapes): %.1f GFLOP/s at %s\n", peak / 1e9,
                peak_name.c_str());
    const double nominal = NominalPeakFlops();
    if (nominal > 0) {
      std::printf(
          "  = %.2f of the nominal AVX2-FMA peak %.1f GFLOP/s (%u cores x 32 FLOP/cycle "
          "at /proc/cpuinfo's clock; turbo can exceed it)\n",
          peak / nominal, nominal / 1e9, std::thread::hardware_concurrency());
    }
    for (const auto& [name, m] : results) {
      auto it = m.counters.find("FLOP/s");
      if (name.rfind("BM_Sgemm/", 0) != 0 || it == m.counters.end()) continue;
      std::printf("  %-50s %7.1f GFLOP/s  %.2f of peak\n", name.c_str(), it->second / 1e9,
                  it->second / peak);
    }
  }
  double memcpy_bw = 0;
  for (const auto& [name, m] : results) {
    auto it = m.counters.find("bytes_per_second");
    if (it == m.counters.end()) continue;
    if (name.rfind("BM_Memcpy", 0) == 0) memcpy_bw = std::max(memcpy_bw, it->second);
    std::printf("%-30s %7.2f GB/s (%s)\n", name.c_str(), it->second / 1e9,
                name.rfind("BM_LoopbackTcp", 0) == 0
                    ? "payload bytes one way"
                    : "bytes copied; DRAM read+write traffic is 2x");
  }
  auto tcp = results.find("BM_LoopbackTcp");
  if (tcp != results.end() && memcpy_bw > 0) {
    std::printf("loopback TCP / best memcpy (bytes copied): %.2f\n",
                tcp->second.counters.at("bytes_per_second") / memcpy_bw);
  }
}

}  // namespace

BENCHMARK(BM_Memcpy_1Thread)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Memcpy_2Threads)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TensorCopy)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LoopbackTcp)->UseRealTime()->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  benchmarks::UseAllCores("hardware_limits_bench");
  for (const GemmShape& s : kGemmShapes) {
    const std::string name = "BM_Sgemm/" + std::string(s.workload) + "/" + std::to_string(s.m) +
                             "x" + std::to_string(s.k) + "x" + std::to_string(s.n);
    benchmark::RegisterBenchmark(name.c_str(), BM_Sgemm, s, /*onednn=*/false)
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark((name + "/onednn").c_str(), BM_Sgemm, s, /*onednn=*/true)
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
  benchmarks::SummaryReporter reporter(PrintSummary);
  return benchmarks::RunWithSummary(argc, argv, reporter);
}
