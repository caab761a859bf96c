// ThreadPool::run_chunks (csrc/cpu_kernels/thread_pool.h): every index of the range is handed out
// exactly once, in pieces that are whole granules (but the range's last) and shrink along the
// range, for 1..4 threads; a thread that stalls inside a piece still loses no work.
#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "check.h"
#include "cpu_kernels/thread_pool.h"

using deepinfer::cpu::ThreadPool;

namespace {

// The pieces one run_chunks call handed out, sorted by their start. With stall_worker every piece
// sleeps: the caller's briefly, a worker's long (a descheduled thread).
std::vector<std::pair<int, int>> pieces_of(ThreadPool& pool, int total, int granule, bool stall_worker = false) {
  std::mutex m;
  std::vector<std::pair<int, int>> out;
  pool.run_chunks(total, granule, [&](int thread, int lo, int hi) {
    // the caller slow enough for the workers to join, a worker stalled much longer
    if (stall_worker) std::this_thread::sleep_for(std::chrono::microseconds(thread == 0 ? 100 : 2000));
    std::lock_guard<std::mutex> lock(m);
    out.emplace_back(lo, hi);
  });
  std::sort(out.begin(), out.end());
  return out;
}

void check_cover(const std::vector<std::pair<int, int>>& pieces, int total, int granule, int threads) {
  int at = 0;
  int previous = total;  // piece sizes never grow along the range
  for (const auto& [lo, hi] : pieces) {
    CHECK_EQ(lo, at);  // no gap, no overlap
    CHECK(hi > lo);
    const int size = hi - lo;
    if (hi < total) CHECK_EQ(size % granule, 0);
    CHECK(size <= previous);
    // about a (2 * threads)-th of what was left, never less than one granule
    CHECK(size <= std::max(granule, ((total - lo) / (2 * threads) + granule - 1) / granule * granule));
    previous = size;
    at = hi;
  }
  CHECK_EQ(at, total);
}

}  // namespace

int main() {
  for (int threads = 1; threads <= 4; ++threads) {
    ThreadPool pool(threads);
    for (int granule : {1, 16}) {
      for (int total : {0, 1, 15, 16, 17, 100, 576, 960, 1536, 49152}) {
        const auto pieces = pieces_of(pool, total, granule);
        check_cover(pieces, total, granule, threads);
        if (total > 0) CHECK(static_cast<int>(pieces.size()) <= total);
      }
    }
    // a worker that stalls in every piece it takes: still all covered, once
    check_cover(pieces_of(pool, 4096, 16, /*stall_worker=*/true), 4096, 16, threads);
    // solo: the caller alone, same pieces rule
    pool.set_solo(true);
    check_cover(pieces_of(pool, 1000, 16), 1000, 16, threads);
    pool.set_solo(false);
  }
  return 0;
}
