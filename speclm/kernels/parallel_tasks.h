// The one way speclm's CPU kernels share a call between threads: `RunTasks`.
//
// Tasks are handed out one at a time from a shared counter, to the calling thread and to
// helpers scheduled on XLA's own CPU thread pool (not OpenMP: a second pool of threads would
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

namespace speclm {

// One call's tasks, claimed from both ends: the caller takes them front to back and helpers
// back to front, so that each thread reads its share of a matrix as one sequential stream (the
// hardware prefetchers follow it; tasks dealt alternately left each thread a stride, and two
// threads then read a 4-bit matrix more slowly than one). `span` holds the unclaimed range
// [front, back) as front | back << 32.
struct TaskJob {
  std::atomic<uint64_t> span{0};
  std::atomic<int64_t> done{0};
  int64_t tasks = 0;
  std::function<void(int64_t)> run;  // runs task t

  void Reset(int64_t count) {
    tasks = count;
    span.store(static_cast<uint64_t>(count) << 32);
  }

  // The next unclaimed task from the front (or the back), or -1.
  int64_t Claim(bool from_back) {
    uint64_t s = span.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(s & 0xffffffffu);
      const int64_t back = static_cast<int64_t>(s >> 32);
      if (front >= back) return -1;
      const uint64_t claimed = from_back ? s - (uint64_t{1} << 32) : s + 1;
      if (span.compare_exchange_weak(s, claimed)) return from_back ? back - 1 : front;
    }
  }

  // Takes tasks until none is left; true if it ran any.
  bool Work(bool from_back) {
    int64_t finished = 0;
    for (int64_t t = Claim(from_back); t >= 0; t = Claim(from_back)) {
      run(t);
      ++finished;
    }
    if (finished) done.fetch_add(finished, std::memory_order_release);
    return finished > 0;
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
    if (job && job->Work(/*from_back=*/true)) {
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
  job->Reset(tasks);
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
  job->Work(/*from_back=*/false);
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

#endif  // SPECLM_KERNELS_PARALLEL_TASKS_H_
