// A small persistent thread pool for the decode step: run(fn) calls fn(thread_index) on the
// caller (index 0) and on every worker that joins the region in time, and returns when the
// caller's fn returned and every joined worker finished.
//
// fn shares its work through atomic counters (dynamic chunks) and returns when none is left, so
// a worker that is not scheduled while a region runs (a busy machine) simply does not join it:
// the caller and the other workers do its share, and the step never waits for a thread that has
// not started. Workers spin briefly between the ~150 regions of a step, and sleep (futex) once
// the caller parks the pool or after ~200 us without work. A worker that joined a region and
// then lost its core (another process took it) does hold the caller up until it is scheduled
// again: the caller measures those waits (take_wait_seconds) and may run alone for a while
// (set_solo), see DecodeModel.
#pragma once

#include <algorithm>
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
    stop_.store(true);
    generation_.fetch_add(1);
    generation_.notify_all();
    for (auto& t : workers_) t.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_; }

  // The caller's parallel work is over for now (end of a step): workers sleep at once instead
  // of spinning, leaving the cores to the Python and torch work between steps.
  void park() { parked_.store(true, std::memory_order_relaxed); }

  // Solo: the caller runs every region alone (workers stay asleep) until set back.
  void set_solo(bool solo) { solo_ = solo; }
  bool solo() const { return n_ == 1 || solo_; }

  // Seconds the caller spent waiting, after its own share, for workers to finish theirs (since
  // the last call; resets). Long waits mean a worker lost its core mid-region.
  double take_wait_seconds() {
    const double w = wait_seconds_;
    wait_seconds_ = 0.0;
    return w;
  }

  // run() over the range [0, total), handed out from one shared counter in pieces that shrink
  // as the range runs out (guided scheduling): a piece is a multiple of `granule`, about
  // 1 / (2 * threads) of what is left, at least one granule. Large first pieces keep the
  // counter updates few; small last ones leave the threads at most one granule apart at the
  // end of the region, instead of one thread idling for most of a large last piece.
  // fn(thread_index, lo, hi) for each piece a thread takes.
  template <class Fn>
  void run_chunks(int total, int granule, Fn&& fn) {
    std::atomic<int> next{0};
    const int parts = 2 * size();
    run([&](int index) {
      int lo = next.load(std::memory_order_relaxed);
      for (;;) {
        if (lo >= total) return;
        const int want = (total - lo) / parts;
        const int piece = std::max(granule, (want + granule - 1) / granule * granule);
        const int hi = std::min(lo + piece, total);
        if (!next.compare_exchange_weak(lo, hi, std::memory_order_relaxed)) continue;  // lo reloaded
        fn(index, lo, hi);
        lo = next.load(std::memory_order_relaxed);
      }
    });
  }

  // One caller at a time (the model serialises its steps).
  void run(const std::function<void(int)>& fn) {
    if (solo()) {
      fn(0);
      return;
    }
    job_ = &fn;
    parked_.store(false, std::memory_order_relaxed);
    open_.store(true);
    generation_.fetch_add(1);
    generation_.notify_all();
    fn(0);
    // Close the region, then wait for the workers that joined it (seq_cst on both sides: a
    // worker either sees it closed or is counted in joined_ here).
    open_.store(false);
    if (joined_.load() == 0) return;
    const auto t0 = std::chrono::steady_clock::now();
    for (int spins = 0; joined_.load() != 0; ++spins) {
      if (spins < 4096) {
        pause();
      } else {
        std::this_thread::yield();  // a joined worker was descheduled mid-chunk
      }
    }
    wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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
      const auto until = clock::now() + std::chrono::microseconds(200);
      uint64_t g = generation_.load();
      for (int spins = 0; g == seen; ++spins) {
        pause();
        if (parked_.load(std::memory_order_relaxed) || ((spins & 255) == 255 && clock::now() > until))
          generation_.wait(seen);
        g = generation_.load();
      }
      seen = g;
      if (stop_.load()) return;
      joined_.fetch_add(1);
      if (open_.load() && generation_.load() == g) (*job_)(index);
      joined_.fetch_sub(1);
    }
  }

  const int n_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> joined_{0};
  std::atomic<bool> open_{false};
  std::atomic<bool> stop_{false};
  std::atomic<bool> parked_{false};
  const std::function<void(int)>* job_ = nullptr;
  bool solo_ = false;
  double wait_seconds_ = 0.0;
};

}  // namespace deepinfer::cpu
