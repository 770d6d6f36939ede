// A CPU allocator that counts what LibTorch allocates, for kernels/'s
// memory tests (as formats/torch_save/loader_limits_test.cc's does):
// installed for a scope, it passes each request to the allocator it
// replaced and tracks the live and the peak bytes.
//
//   kernels::testing::ScopedCountingAllocator counting;
//   const uint64_t before = counting.live();
//   counting.ResetPeak();
//   ... run ...
//   uint64_t above = counting.peak() - before;
//
// Each DataPtr it returns has the data pointer as its context, and the
// allocator has a raw deleter (LibTorch's raw_allocate / raw_deallocate,
// which oneDNN's bf16 GEMMs use, assert both); the size and the base
// allocator's DataPtr are kept in a table keyed by the pointer. Memory
// allocated in the scope may outlive it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

namespace kernels::testing {

class ScopedCountingAllocator final : public c10::Allocator {
 public:
  ScopedCountingAllocator() : base_(c10::GetCPUAllocator()) {
    c10::SetCPUAllocator(this, /*priority=*/0);
  }
  ~ScopedCountingAllocator() override { c10::SetCPUAllocator(base_, /*priority=*/0); }
  ScopedCountingAllocator(const ScopedCountingAllocator&) = delete;
  ScopedCountingAllocator& operator=(const ScopedCountingAllocator&) = delete;

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    State& s = state();
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.held.emplace(data, std::make_pair(n, std::move(inner)));
    }
    const uint64_t live = s.live += n;
    uint64_t peak = s.peak.load();
    while (live > peak && !s.peak.compare_exchange_weak(peak, live)) {
    }
    return c10::DataPtr(data, data, &Release, c10::Device(c10::kCPU));
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  // raw_allocate / raw_deallocate (oneDNN's scratch buffers) go through here too.
  c10::DeleterFnPtr raw_deleter() const override { return &Release; }

  uint64_t live() const { return state().live; }
  uint64_t peak() const { return state().peak; }
  // The peak from now on starts at what is live now.
  void ResetPeak() { state().peak = state().live.load(); }

 private:
  struct State {
    std::mutex mutex;
    std::unordered_map<void*, std::pair<size_t, c10::DataPtr>> held;
    std::atomic<uint64_t> live{0};
    std::atomic<uint64_t> peak{0};
  };
  static State& state() {
    static State* s = new State();  // never destroyed: frees may come at exit
    return *s;
  }
  static void Release(void* data) {
    State& s = state();
    std::pair<size_t, c10::DataPtr> entry;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      auto it = s.held.find(data);
      if (it == s.held.end()) return;
      entry = std::move(it->second);
      s.held.erase(it);
    }
    s.live -= entry.first;
  }  // entry.second frees the memory

  c10::Allocator* base_;
};

}  // namespace kernels::testing
