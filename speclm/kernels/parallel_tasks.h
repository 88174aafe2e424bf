// The one way speclm's CPU kernels share a call between threads: `RunTasks`.
//
// Tasks are handed out one at a time, from a range of its own to each thread (`TaskJob`), to
// the calling thread and to helpers scheduled on XLA's own CPU thread pool (not OpenMP: a second pool of threads would
// fight XLA's for the two cores, and waking it cost up to a third of a speculative round).
// The caller works too and then waits until every claimed task is done, so it is correct
// whether or not a helper ever runs; a helper that starts late finds no task left and only
// touches the shared counters, which it co-owns.
//
// A decode step is a chain of a few hundred small calls (SmolLM2's 4-bit products take 5-30 µs
// each), and waking a sleeping pool thread for every one of them took about as long as the
// work: the helper arrived when the caller had done most of it. So a helper that runs out of
// tasks stays a little while (`kLinger`), spinning on a board where each call posts its job,
// and takes the next call's tasks at once; a call schedules a new helper only when none is
// there. A helper leaves once nothing has come for kLinger, handing its thread back to XLA.

#ifndef SPECLM_KERNELS_PARALLEL_TASKS_H_
#define SPECLM_KERNELS_PARALLEL_TASKS_H_

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

// Hidden: the board below is one per library. With default visibility GCC makes a static
// inside an inline function a process-wide (STB_GNU_UNIQUE) symbol, so two kernel libraries
// loaded side by side (scripts/compare_cache_attention.py loads a revision's and the working
// tree's) would share one board, and one library's helpers would run the other's jobs.
#pragma GCC visibility push(hidden)
namespace speclm {

// One call's tasks, in as many contiguous ranges as threads are expected. Each thread starts
// on a range of its own (the caller on the first, the i-th helper to join on range i + 1) and
// claims its tasks front to back. A thread whose range is exhausted takes the back half of
// the largest range left (work stealing by halves) and goes on through it front to back. So
// each thread reads its share of a matrix as a few forward runs, which the hardware
// prefetchers follow. Three earlier schemes lost to this one: tasks dealt alternately left
// each thread a stride (two threads then read a 4-bit matrix more slowly than one); a helper
// claiming single tasks from the back read its stretch group by group backwards, which the
// prefetchers did not follow either (a 4-bit 1,536 x 576 matrix streamed from memory took
// 2.8x as long as with both threads forward); and fixed halves, once exhausted, had the two
// threads claim the rest of a range alternately again.
struct TaskJob {
  struct alignas(64) Range {  // [front, back) as front | back << 32; a cache line each
    std::atomic<uint64_t> span{0};
  };
  std::unique_ptr<Range[]> ranges;
  int64_t tasks = 0, count = 1;  // tasks; ranges
  std::atomic<int> joined{0};    // helpers that took part, for their starting ranges
  std::atomic<int64_t> done{0};
  std::function<void(int64_t)> run;  // runs task t

  static uint64_t Span(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << 32;
  }
  static int64_t Front(uint64_t s) { return static_cast<int64_t>(s & 0xffffffffu); }
  static int64_t Back(uint64_t s) { return static_cast<int64_t>(s >> 32); }

  void Reset(int64_t tasks_, int64_t threads) {
    tasks = tasks_;
    count = std::max<int64_t>(1, std::min(threads, tasks));
    ranges.reset(new Range[count]);
    for (int64_t i = 0; i < count; ++i)
      ranges[i].span.store(Span(tasks * i / count, tasks * (i + 1) / count));
  }

  // The next task of range `own`; once it is exhausted, the back half of the largest other
  // range becomes `own`'s. -1 when no task is left unclaimed.
  int64_t Claim(int64_t own) {
    for (;;) {
      uint64_t s = ranges[own].span.load(std::memory_order_relaxed);
      while (Front(s) < Back(s)) {
        if (ranges[own].span.compare_exchange_weak(s, s + 1)) return Front(s);
      }
      int64_t largest = -1, most = 0;
      for (int64_t i = 0; i < count; ++i) {
        const uint64_t t = ranges[i].span.load(std::memory_order_relaxed);
        if (i != own && Back(t) - Front(t) > most) largest = i, most = Back(t) - Front(t);
      }
      if (largest < 0) return -1;
      uint64_t t = ranges[largest].span.load(std::memory_order_relaxed);
      const int64_t front = Front(t), back = Back(t);
      if (front >= back) continue;  // taken meanwhile: look again
      // One task left: take it; more: leave the owner the front half, take the back half.
      const int64_t middle = back - front == 1 ? front : front + (back - front + 1) / 2;
      if (!ranges[largest].span.compare_exchange_strong(t, Span(front, middle))) continue;
      // No thread changes an exhausted range, so `own` can be replaced outright.
      ranges[own].span.store(Span(middle, back));
    }
  }

  // Takes tasks until none is left, starting on range `own` (this thread's alone); true if
  // it ran any.
  bool Work(int64_t own) {
    int64_t finished = 0;
    for (int64_t t = Claim(own); t >= 0; t = Claim(own)) {
      run(t);
      ++finished;
    }
    if (finished) done.fetch_add(finished, std::memory_order_release);
    return finished > 0;
  }

  // A helper's turn on the next range after the caller's; a helper beyond the call's ranges
  // (or the same helper coming back) takes no part, so that each range has one owner.
  bool Help() {
    const int64_t slot = 1 + joined.fetch_add(1, std::memory_order_relaxed);
    return slot < count && Work(slot);
  }
};

// Where calls post their jobs for lingering helpers (one per process: XLA's CPU client runs
// every call of a process on the same pool).
struct TaskBoard {
  std::shared_ptr<TaskJob> job;  // read and written with std::atomic_load / atomic_store
  std::atomic<int> helpers{0};   // helpers running or lingering
};

inline TaskBoard& Board() {
  static TaskBoard* board = new TaskBoard();  // never destroyed: helpers may outlive main
  return *board;
}

// How long a helper waits for the next call's tasks before handing its thread back.
constexpr std::chrono::microseconds kLinger(200);

inline void Linger() {
  TaskBoard& board = Board();
  auto until = std::chrono::steady_clock::now() + kLinger;
  for (int spins = 0;; ++spins) {
    std::shared_ptr<TaskJob> job = std::atomic_load(&board.job);
    if (job && job->Help()) {
      until = std::chrono::steady_clock::now() + kLinger;
      continue;
    }
    if ((spins & 63) == 0) {
      if (std::chrono::steady_clock::now() > until) break;
      std::this_thread::yield();  // another process's threads go first (tests run two)
    }
    _mm_pause();
  }
  board.helpers.fetch_sub(1);
}

// Runs `body(first, end)` over [0, items) in tasks of `per_task` items each; returns when
// every task has finished.
template <typename Body>
void RunTasks(xla::ffi::ThreadPool& pool, int64_t items, int64_t per_task, Body body) {
  const int64_t tasks = (items + per_task - 1) / per_task;
  auto job = std::make_shared<TaskJob>();
  job->Reset(tasks, pool.num_threads());
  job->run = [body, per_task, items](int64_t t) {
    body(t * per_task, std::min((t + 1) * per_task, items));
  };
  TaskBoard& board = Board();
  if (tasks > 1) {
    std::atomic_store(&board.job, job);
    // A helper for each pool thread but the caller's, counted before it runs so that calls
    // in quick succession do not schedule more.
    for (int want = std::min<int64_t>(pool.num_threads() - 1, tasks - 1), now = board.helpers;
         now < want;) {
      if (board.helpers.compare_exchange_weak(now, now + 1)) {
        pool.Schedule([] { Linger(); });
        ++now;
      }
    }
  }
  job->Work(/*own=*/0);
  for (int spins = 0; job->done.load(std::memory_order_acquire) < tasks; ++spins) {
    if (spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();  // a helper holding a task was descheduled
    }
  }
  if (tasks > 1) {
    std::shared_ptr<TaskJob> expected = job;  // leave the board to a newer call's job
    std::atomic_compare_exchange_strong(&board.job, &expected, std::shared_ptr<TaskJob>());
  }
}

}  // namespace speclm
#pragma GCC visibility pop

#endif  // SPECLM_KERNELS_PARALLEL_TASKS_H_
