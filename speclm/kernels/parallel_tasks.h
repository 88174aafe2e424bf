// The one way speclm's CPU kernels share a call between threads: `RunTasks`.
//
// Tasks are handed out one at a time from a shared counter, to the calling thread and to
// helpers scheduled on XLA's own CPU thread pool (not OpenMP: a second pool of threads would
// fight XLA's for the two cores, and waking it cost up to a third of a speculative round).
// The caller works too and then waits until every claimed task is done, so it is correct
// whether or not a helper ever runs; a helper that starts late finds no task left and only
// touches the shared counters, which it co-owns (hence `body` is copied, never referenced).

#ifndef SPECLM_KERNELS_PARALLEL_TASKS_H_
#define SPECLM_KERNELS_PARALLEL_TASKS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace speclm {

struct TaskQueue {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Runs `body(first, end)` over [0, items) in tasks of `per_task` items each; returns when
// every task has finished.
template <typename Body>
void RunTasks(xla::ffi::ThreadPool& pool, int64_t items, int64_t per_task, Body body) {
  const int64_t tasks = (items + per_task - 1) / per_task;
  auto queue = std::make_shared<TaskQueue>();
  auto work = [=](TaskQueue* q) {
    int64_t finished = 0;
    for (int64_t t = q->next.fetch_add(1); t < tasks; t = q->next.fetch_add(1)) {
      body(t * per_task, std::min((t + 1) * per_task, items));
      ++finished;
    }
    if (finished) q->done.fetch_add(finished, std::memory_order_release);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([queue, work] { work(queue.get()); });
  work(queue.get());
  while (queue->done.load(std::memory_order_acquire) < tasks) std::this_thread::yield();
}

}  // namespace speclm

#endif  // SPECLM_KERNELS_PARALLEL_TASKS_H_
