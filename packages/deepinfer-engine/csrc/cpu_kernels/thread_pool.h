// A small persistent thread pool for the decode step: run(fn) calls fn(thread_index) on every
// thread (the caller is thread 0) and returns when all are done. Work inside fn is shared
// through atomic counters (dynamic chunks), so a descheduled thread on a busy machine delays a
// step by one chunk, not by its whole share. Workers spin briefly between the ~150 parallel
// regions of a step, then sleep (futex) until the next one.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

namespace deepinfer::cpu {

class ThreadPool {
 public:
  explicit ThreadPool(int threads) : n_(threads < 1 ? 1 : threads) {
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this, i] { loop(i); });
  }
  ~ThreadPool() {
    stop_.store(true, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    for (auto& t : workers_) t.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_; }

  // Not reentrant; one caller at a time (the model serialises its steps).
  void run(const std::function<void(int)>& fn) {
    if (n_ == 1) {
      fn(0);
      return;
    }
    job_ = &fn;
    pending_.store(n_ - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    fn(0);
    for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
      if (spins < 4096) {
        pause();
      } else {
        std::this_thread::yield();  // a worker was descheduled: give the core back
      }
    }
  }

 private:
  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  void loop(int index) {
    uint64_t seen = 0;
    using clock = std::chrono::steady_clock;
    for (;;) {
      // spin ~200 us for the next region, then sleep until notified
      const auto until = clock::now() + std::chrono::microseconds(200);
      uint64_t g = generation_.load(std::memory_order_acquire);
      for (int spins = 0; g == seen; ++spins) {
        pause();
        if ((spins & 255) == 255 && clock::now() > until) {
          generation_.wait(seen, std::memory_order_acquire);
        }
        g = generation_.load(std::memory_order_acquire);
      }
      seen = g;
      if (stop_.load(std::memory_order_relaxed)) return;
      (*job_)(index);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  const int n_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int)>* job_ = nullptr;
};

}  // namespace deepinfer::cpu
