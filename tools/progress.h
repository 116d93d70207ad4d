// mxmla command-line tool — progress of long phases (and the library's parallel loop).
//
// Progress: a phase that runs longer than 2 s gets a line on stderr then and every 5 s after —
// percent, elapsed time and an estimate of what is left where the phase counts its work — and a
// closing "done in" line; shorter phases print nothing. MXMLA_PROGRESS_INTERVAL=seconds sets
// both intervals (the tests use it). A background thread prints, so a phase needs no hooks inside long calls.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/parallel.h"

namespace mxmla::tool {

class Progress {
 public:
  using Clock = std::chrono::steady_clock;

  explicit Progress(std::string who) : who_(std::move(who)) {
    if (const char* e = std::getenv("MXMLA_PROGRESS_INTERVAL")) {
      char* end = nullptr;
      const double v = std::strtod(e, &end);
      if (end != e && v >= 0) first_ = every_ = std::max(v, 0.01);
    }
    thread_ = std::thread([this] { loop(); });
  }
  ~Progress() {
    end();
    {
      std::lock_guard<std::mutex> g(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Starts a phase (ending the previous one); `total` units of `unit` (0: not counted).
  void begin(const std::string& phase, int64_t total = 0, const std::string& unit = "") {
    end();
    std::fflush(stdout);  // what the phase prints after this comes after what came before
    std::lock_guard<std::mutex> g(m_);
    phase_ = phase, unit_ = unit, total_ = total, done_ = 0, reported_ = false, active_ = true;
    start_ = last_ = Clock::now();
  }
  void advance(int64_t n = 1) { done_.fetch_add(n, std::memory_order_relaxed); }
  // Ends the phase; if it reported progress, says how long it took.
  void end() {
    std::lock_guard<std::mutex> g(m_);
    if (active_ && reported_) {
      std::fprintf(stderr, "%s: %s: done in %.1f s\n", who_.c_str(), phase_.c_str(), seconds(Clock::now() - start_));
      std::fflush(stderr);
    }
    active_ = false;
  }

 private:
  static double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

  void loop() {
    std::unique_lock<std::mutex> lk(m_);
    auto dur = [](double s) { return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s)); };
    const auto first = dur(first_), every = dur(every_);
    while (!stop_) {
      cv_.wait_for(lk, std::min<Clock::duration>(first, std::chrono::milliseconds(100)));
      const auto now = Clock::now();
      if (stop_ || !active_ || now - last_ < (reported_ ? every : first)) continue;
      last_ = now;
      reported_ = true;
      const double el = seconds(now - start_);
      const int64_t done = done_.load(std::memory_order_relaxed);
      if (total_ > 0) {
        const double f = std::min(1.0, double(done) / double(total_));
        std::string left = f > 0 ? ", about " + std::to_string(int64_t(el / f - el + 0.5)) + " s left" : "";
        std::fprintf(stderr, "%s: %s: %3d %% (%lld of %lld %s), %.*f s%s\n", who_.c_str(), phase_.c_str(),
                     int(f * 100), (long long)done, (long long)total_, unit_.c_str(), el < 10 ? 1 : 0, el, left.c_str());
      } else {
        std::fprintf(stderr, "%s: %s: %.*f s\n", who_.c_str(), phase_.c_str(), el < 10 ? 1 : 0, el);
      }
      std::fflush(stderr);
    }
  }

  std::string who_;
  double first_ = 2.0, every_ = 5.0;
  std::mutex m_;
  std::condition_variable cv_;
  std::thread thread_;
  bool stop_ = false, active_ = false, reported_ = false;
  std::string phase_, unit_;
  int64_t total_ = 0;
  std::atomic<int64_t> done_{0};
  Clock::time_point start_, last_;
};

// The parallel loop of the CPU references (src/common/parallel.h), under the tool's names.
using detail::cpu_threads;
using detail::parallel_for;

}  // namespace mxmla::tool
