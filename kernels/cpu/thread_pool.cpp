// The kernels' worker threads (thread_pool.h says why they are not torch's OpenMP team).
//
// One job at a time. The caller writes the job while it is closed, then opens it by storing (job id, chunk 0) in
// `claim` and bumping `gen`, the word idle workers watch. Everyone, caller included, claims chunk i by a
// compare-and-swap of (id, i) -> (id, i + 1), so a worker that wakes late cannot take a chunk of a later job: the
// id no longer matches. The caller returns once `done` counts every chunk; the body and the job's fields are only
// read after a successful claim, so nothing outlives the call.
//
// On torch's OpenMP team instead (every loop to at::parallel_for) when the step's matmuls run there too: a model
// whose linear layers are torch's ops (oneDNN bf16, int4/int8) would otherwise hand the cores from one set of
// threads to the other a few hundred times a step. The model's loader chooses (pool_use_omp);
// KVMESH_CPU_POOL=omp|own overrides it for the process.
#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <pthread.h>
#include <sched.h>
#include <torch/library.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KVMESH_PAUSE() _mm_pause()
#else
#define KVMESH_PAUSE() ((void)0)
#endif

namespace kvmesh {
namespace pool {
namespace {

constexpr uint32_t kClosed = 0xffffffffu;
// Chunks a thread's share is cut into: what one thread off its core can hold up is one of them.
constexpr int64_t kChunksPerThread = 4;
// Spin checks between two sched_yield calls (a few microseconds), and how long a worker spins after its last
// chunk before it sleeps: longer than the serial gaps of a step, so a busy engine never sleeps inside one.
constexpr int kYieldEvery = 64;
constexpr auto kIdleSleep = std::chrono::milliseconds(2);

struct Pool {
  std::mutex run_mu;                // one job at a time; also guards starting workers
  std::atomic<uint32_t> gen{0};     // bumped when a job opens; idle workers watch it (futex word)
  std::atomic<int> sleepers{0};
  std::atomic<uint64_t> claim{kClosed};  // (job id << 32) | next chunk
  std::atomic<uint32_t> nchunks{0};
  std::atomic<int64_t> done{0};
  std::atomic<int> enlisted{0};    // workers [0, enlisted) may claim: at::get_num_threads() - 1 of them
  // The open job; written only while it is closed.
  const Body* body = nullptr;
  int64_t begin = 0, end = 0, chunk = 1;
  std::mutex err_mu;
  std::exception_ptr err;
  std::atomic<int> workers{0};
  std::atomic<int64_t> jobs{0}, chunks{0}, worker_chunks{0};
};

void forget_workers_after_fork();

// Never destroyed: at exit a worker may still be waiting on it.
Pool& the_pool() {
  static Pool* p = [] {
    pthread_atfork(nullptr, nullptr, forget_workers_after_fork);
    return new Pool();
  }();
  return *p;
}

// A forked child has none of its parent's threads: the next parallel loop starts its own.
void forget_workers_after_fork() {
  Pool& p = the_pool();
  p.workers.store(0);
  p.sleepers.store(0);
}

// Set on a pool worker, and on a caller while its job runs: a loop inside a chunk runs inline.
thread_local bool in_worker = false;

// KVMESH_CPU_POOL: "omp" or "own" decides for the process; otherwise the model's loader does (pool_use_omp), own
// threads until it has.
int env_choice() {
  static const int choice = [] {
    const char* v = std::getenv("KVMESH_CPU_POOL");
    if (v != nullptr && std::strcmp(v, "omp") == 0) return 1;
    if (v != nullptr && std::strcmp(v, "own") == 0) return 0;
    return -1;
  }();
  return choice;
}

std::atomic<bool> omp_chosen{false};

bool use_omp() {
  const int env = env_choice();
  return env >= 0 ? env == 1 : omp_chosen.load(std::memory_order_relaxed);
}

// Elsewhere than Linux a sleeping worker looks again every 100 us instead.
void futex_wait(std::atomic<uint32_t>* word, uint32_t value) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, value, nullptr, nullptr, 0);
#else
  if (word->load() == value) std::this_thread::sleep_for(std::chrono::microseconds(100));
#endif
}

void futex_wake_all(std::atomic<uint32_t>* word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

// Claims and runs chunks of the open job until none is left; returns how many this thread ran.
int64_t work(Pool& p) {
  int64_t ran = 0;
  for (;;) {
    uint64_t c = p.claim.load(std::memory_order_acquire);
    const uint32_t i = uint32_t(c);
    if (i == kClosed || i >= p.nchunks.load(std::memory_order_relaxed)) return ran;
    if (!p.claim.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_relaxed)) continue;
    const int64_t a = p.begin + int64_t(i) * p.chunk;
    const int64_t b = std::min(p.end, a + p.chunk);
    try {
      (*p.body)(a, b);
    } catch (...) {
      std::lock_guard<std::mutex> g(p.err_mu);
      if (!p.err) p.err = std::current_exception();
    }
    p.done.fetch_add(1, std::memory_order_release);
    ++ran;
  }
}

void worker_main(Pool* p, int index, uint32_t seen) {
  in_worker = true;
  for (;;) {
    uint32_t g;
    auto idle_since = std::chrono::steady_clock::now();
    int spins = 0;
    while ((g = p->gen.load(std::memory_order_acquire)) == seen) {
      KVMESH_PAUSE();
      if (++spins % kYieldEvery != 0) continue;
      sched_yield();  // another thread that wants this core gets it now
      if (std::chrono::steady_clock::now() - idle_since < kIdleSleep) continue;
      p->sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (p->gen.load(std::memory_order_seq_cst) == seen) futex_wait(&p->gen, seen);
      p->sleepers.fetch_sub(1, std::memory_order_seq_cst);
      idle_since = std::chrono::steady_clock::now();
    }
    seen = g;
    if (index < p->enlisted.load(std::memory_order_acquire)) {
      const int64_t ran = work(*p);
      if (ran) p->worker_chunks.fetch_add(ran, std::memory_order_relaxed);
    }
  }
}

// Called with run_mu held.
void ensure_workers(Pool& p, int n) {
  // New threads inherit the caller's CPU affinity: the engine's pinning covers them.
  for (int i = p.workers.load(); i < n; ++i) {
    std::thread(worker_main, &p, i, p.gen.load(std::memory_order_acquire)).detach();
    p.workers.store(i + 1, std::memory_order_release);
  }
}

}  // namespace

void run(int64_t begin, int64_t end, int64_t grain, const Body& f) {
  if (end <= begin) return;
  if (use_omp()) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int threads = at::get_num_threads();
  const int64_t range = end - begin;
  grain = std::max<int64_t>(1, grain);
  if (threads <= 1 || in_worker || at::in_parallel_region() || range <= grain) {
    f(begin, end);
    return;
  }
  Pool& p = the_pool();
  std::unique_lock<std::mutex> lock(p.run_mu, std::try_to_lock);
  if (!lock.owns_lock()) {
    f(begin, end);
    return;
  }
  const int64_t want = std::min<int64_t>((range + grain - 1) / grain, int64_t(threads) * kChunksPerThread);
  const int64_t chunk = (range + want - 1) / want;
  const int64_t n = (range + chunk - 1) / chunk;
  if (n <= 1) {
    f(begin, end);
    return;
  }
  ensure_workers(p, threads - 1);
  in_worker = true;
  const uint32_t id = p.gen.load(std::memory_order_relaxed) + 1;
  p.claim.store(uint64_t(id) << 32 | kClosed, std::memory_order_relaxed);
  p.body = &f;
  p.begin = begin;
  p.end = end;
  p.chunk = chunk;
  p.nchunks.store(uint32_t(n), std::memory_order_relaxed);
  p.done.store(0, std::memory_order_relaxed);
  p.enlisted.store(threads - 1, std::memory_order_relaxed);
  p.claim.store(uint64_t(id) << 32, std::memory_order_release);
  p.gen.store(id, std::memory_order_seq_cst);
  if (p.sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(&p.gen);
  work(p);
  for (int spins = 1; p.done.load(std::memory_order_acquire) < n; ++spins) {
    KVMESH_PAUSE();
    if (spins % kYieldEvery == 0) sched_yield();
  }
  in_worker = false;
  p.jobs.fetch_add(1, std::memory_order_relaxed);
  p.chunks.fetch_add(n, std::memory_order_relaxed);
  std::exception_ptr err;
  {
    std::lock_guard<std::mutex> g(p.err_mu);
    std::swap(err, p.err);
  }
  if (err) std::rethrow_exception(err);
}

Stats stats() {
  Pool& p = the_pool();
  return Stats{p.workers.load(), p.jobs.load(), p.chunks.load(), p.worker_chunks.load()};
}

namespace {

std::vector<int64_t> pool_stats_op() {
  const Stats s = stats();
  return {s.workers, s.jobs, s.chunks, s.worker_chunks, use_omp() ? 1 : 0};
}

// Between steps only (a loop already running finishes where it started); returns what loops will use.
bool pool_use_omp_op(bool omp) {
  omp_chosen.store(omp, std::memory_order_relaxed);
  return use_omp();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  // [workers, jobs, chunks, chunks run by workers, 1 when loops go to torch's team]; no tensor argument: catch-all.
  m.def("pool_stats() -> int[]", &pool_stats_op);
  // Run the kernels' loops on torch's OpenMP team (true) or their own threads; KVMESH_CPU_POOL overrides. Returns
  // whether loops now go to torch's team.
  m.def("pool_use_omp(bool omp) -> bool", &pool_use_omp_op);
}

}  // namespace pool
}  // namespace kvmesh
