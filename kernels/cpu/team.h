// One parallel region for a whole small step (the decoder stack's decode steps), instead of one per kernel.
//
// A decode step of a small model calls ~120 parallel loops (four matmuls a layer, and the head), each a few tens
// of microseconds of work. Through at::parallel_for each is an OpenMP fork/join, and between them the OpenMP
// threads wait by the runtime's policy: spinning for long (libgomp's default) costs nothing quiet but collapses
// beside another busy process (a waiter spins on a core its preempted team mate needs: 10x slower measured), and
// sleeping soon (GOMP_SPINCOUNT=1000, the engine workers' default) pays a wake-up, tens of microseconds in a VM,
// at every one of those loops (1.7x slower a token at batch 1, measured). A team keeps the threads of one
// OpenMP region for the whole step: the first thread runs the step's code and hands each parallel loop's chunks
// out; the others take chunks, and between loops spin for a bounded time (kSpinEnv, microseconds), then sleep on
// a futex. Chunks are claimed one at a time, so a team mate the OS preempted holds up only the chunk it holds.
//
// Inside a team the kernels' parallel_for (below) splits across the team; outside it is at::parallel_for.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace kvmesh {
namespace team {

// Microseconds a waiting team thread spins before it sleeps; 0 turns teams off (every loop its own region).
constexpr const char* kSpinEnv = "KVMESH_CPU_TEAM_SPIN_US";
constexpr int64_t kDefaultSpinUs = 200;

inline int64_t spin_us() {
  static const int64_t us = [] {
    const char* v = std::getenv(kSpinEnv);
    if (v == nullptr || *v == '\0') return kDefaultSpinUs;
    try {
      return std::max<int64_t>(0, std::stoll(v));
    } catch (...) {
      return kDefaultSpinUs;
    }
  }();
  return us;
}

inline bool enabled() {
#ifdef _OPENMP
  return spin_us() > 0;
#else
  return false;
#endif
}

inline void relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

inline void futex_wait(std::atomic<uint32_t>& word, uint32_t old) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, old, nullptr, nullptr, 0);
#else
  (void)word;
  (void)old;
  std::this_thread::yield();
#endif
}

inline void futex_wake(std::atomic<uint32_t>& word) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

// Spin until done() for the budget, then sleep on word (woken by whoever makes done() true and bumps word).
template <typename Done>
inline void wait_until(Done&& done, std::atomic<uint32_t>& word, std::atomic<int>& sleepers) {
  if (done()) return;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us());
  for (int i = 1;; ++i) {
    relax();
    if (done()) return;
    if ((i & 63) == 0 && std::chrono::steady_clock::now() > deadline) break;
  }
  for (;;) {
    const uint32_t seen = word.load();
    sleepers.fetch_add(1);
    if (done()) {
      sleepers.fetch_sub(1);
      return;
    }
    futex_wait(word, seen);
    sleepers.fetch_sub(1);
    if (done()) return;
  }
}

class Team {
 public:
  // The team's first thread: run f over [begin, end) in chunks of at least grain, with the others.
  template <typename F>
  void run_loop(int64_t begin, int64_t end, int64_t grain, const F& f) {
    const int64_t chunk = std::max<int64_t>(grain, (end - begin + 4 * size_ - 1) / (4 * size_));
    fn_ = [](const void* ctx, int64_t a, int64_t b) { (*static_cast<const F*>(ctx))(a, b); };
    ctx_ = &f;
    end_ = end;
    chunk_ = chunk;
    next_.store(begin);
    error_ = nullptr;
    // Open the loop for joining (active 0, not closed), then tell the waiters.
    state_.store(uint64_t(++loop_) << 33);
    publish();
    work();
    // Close it: nobody joins from here on; wait for the ones that did to finish their chunks.
    const uint64_t closed = state_.fetch_or(kClosed) | kClosed;
    if (active(closed) != 0) wait_until([&] { return active(state_.load()) == 0; }, drained_, drain_sleepers_);
    if (error_) std::rethrow_exception(error_);
  }

  // The other threads: take chunks of each loop until the first thread says stop.
  void help() {
    uint32_t seen = 0;
    for (;;) {
      wait_until([&] { return seq_.load() != seen; }, seq_, seq_sleepers_);
      seen = seq_.load();
      if (stop_.load()) return;
      if (join()) {
        work();
        leave();
      }
    }
  }

  void stop() {
    stop_.store(true);
    publish();
  }

  void set_size(int n) { size_ = std::max(1, n); }

 private:
  static constexpr uint64_t kClosed = uint64_t(1) << 32;
  static uint32_t active(uint64_t s) { return uint32_t(s); }

  void publish() {
    seq_.fetch_add(1);
    if (seq_sleepers_.load() > 0) futex_wake(seq_);
  }

  // Join the open loop, if any: its chunks and job are valid until this thread leaves.
  bool join() {
    uint64_t s = state_.load();
    while ((s & kClosed) == 0 && (s >> 33) != 0) {
      if (state_.compare_exchange_weak(s, s + 1)) return true;
    }
    return false;
  }

  void leave() {
    const uint64_t before = state_.fetch_sub(1);
    if ((before & kClosed) && active(before) == 1) {
      drained_.fetch_add(1);
      if (drain_sleepers_.load() > 0) futex_wake(drained_);
    }
  }

  void work() {
    for (;;) {
      const int64_t a = next_.fetch_add(chunk_);
      if (a >= end_) return;
      try {
        fn_(ctx_, a, std::min(end_, a + chunk_));
      } catch (...) {
        std::lock_guard<std::mutex> g(error_mu_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  int size_ = 1;
  uint64_t loop_ = 0;
  void (*fn_)(const void*, int64_t, int64_t) = nullptr;
  const void* ctx_ = nullptr;
  int64_t end_ = 0, chunk_ = 1;
  std::atomic<int64_t> next_{0};
  std::atomic<uint64_t> state_{0};  // loop number << 33 | closed << 32 | threads working on it
  std::atomic<uint32_t> seq_{0}, drained_{0};
  std::atomic<int> seq_sleepers_{0}, drain_sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex error_mu_;
  std::exception_ptr error_;
};

// The team whose first thread this is (only that thread hands loops out).
inline Team*& current() {
  static thread_local Team* t = nullptr;
  return t;
}

// The kernels' parallel loop: across the current team, else at::parallel_for. As at::parallel_for, a range of at
// most grain runs on the calling thread.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  Team* t = current();
  if (t == nullptr) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  if (begin >= end) return;
  if (end - begin <= grain) {
    f(begin, end);
    return;
  }
  t->run_loop(begin, end, grain, f);
}

// body() on this thread with threads - 1 others helping in its parallel loops; returns body's result. Runs body
// alone when teams are off, there is one thread, or this thread is already inside a parallel region; *teamed
// says which.
template <typename F>
inline auto run(int threads, F&& body, bool* teamed) -> decltype(body()) {
  *teamed = false;
#ifdef _OPENMP
  if (!enabled() || threads <= 1 || at::in_parallel_region() || current() != nullptr) return body();
  *teamed = true;
  Team team;
  decltype(body()) result;
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    if (omp_get_thread_num() == 0) {
      team.set_size(omp_get_num_threads());
      current() = &team;
      try {
        result = body();
      } catch (...) {
        error = std::current_exception();
      }
      current() = nullptr;
      team.stop();
    } else {
      team.help();
    }
  }
  if (error) std::rethrow_exception(error);
  return result;
#else
  (void)threads;
  return body();
#endif
}

}  // namespace team
}  // namespace kvmesh
