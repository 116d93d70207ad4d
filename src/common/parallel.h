// mxmla internal — a small parallel loop, shared by the CPU references (src/cpu/) and the
// command-line tool (tools/): plain std::thread workers pulling indices from one counter.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace mxmla::detail {

// The threads for CPU work: `requested` when > 0, else every core.
inline int cpu_threads(int64_t requested) {
  if (requested > 0) return static_cast<int>(requested);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// Threads for `work` multiply-adds split in `tasks`: one below ~1M (thread start-up would dominate),
// else every core.
inline int threads_for(double work, int64_t tasks) {
  if (work < double(1 << 20) || tasks <= 1) return 1;
  return static_cast<int>(std::min<int64_t>(cpu_threads(0), tasks));
}

// fn(i) for i in [0, n) on up to `threads` threads (the calling one included; fewer when the system
// starts fewer); the first exception is rethrown after every thread has stopped.
template <typename Fn>
void parallel_for(int64_t n, int threads, Fn&& fn) {
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex em;
  auto work = [&] {
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> g(em);
        if (!error) error = std::current_exception();
        next.store(n);
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(std::max<int64_t>(0, std::min<int64_t>(threads, n) - 1)));
  for (int t = 1; t < std::min<int64_t>(threads, n); ++t) {
    // a thread the system cannot start (std::system_error) leaves the work to those that did start:
    // an exception escaping here would destroy the running ones unjoined (std::terminate)
    try {
      pool.emplace_back(work);
    } catch (const std::system_error&) {
      break;
    }
  }
  work();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace mxmla::detail
