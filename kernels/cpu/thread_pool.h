// The CPU kernels' own worker threads. parallel_for(begin, end, grain, f) keeps at::parallel_for's contract (f
// called on disjoint ranges [a, b) that cover [begin, end), inline when the range is at most one grain, an
// exception in any range rethrown in the caller), but the ranges are chunks that the caller and the workers claim
// one at a time, and an idle worker waits by spinning and yielding its core, then sleeps after a while.
//
// Why not torch's OpenMP team: a decode step is ~150 short parallel loops with serial work between them. With a
// short spin (GOMP_SPINCOUNT=1000, what the engine workers need beside other programs) the team's threads sleep
// between loops and the next loop pays a wake-up, on a VM an inter-processor interrupt (measured: ~130 sleeps a
// SmolLM2 step, 1.3x the step time of a long spin); with libgomp's long spin, a thread waiting at a barrier for a
// teammate that another process took off its core burns its own core for that whole time (4-10x slower steps).
// Here waiting costs neither: a worker that spins yields its core every few microseconds to whatever else wants it,
// and since chunks are claimed rather than assigned, a worker that is off its core holds up at most the one chunk
// it started; the caller takes the rest.
#pragma once
#include <cstdint>
#include <functional>

namespace kvmesh {
namespace pool {

using Body = std::function<void(int64_t, int64_t)>;

// f over [begin, end) in chunks of at least grain on at::get_num_threads() threads (the caller and workers).
// Runs inline with one thread, inside a worker or an OpenMP region, or while another thread's call holds the pool.
void run(int64_t begin, int64_t end, int64_t grain, const Body& f);

struct Stats {
  int64_t workers;        // threads started
  int64_t jobs;           // calls that went to the pool
  int64_t chunks;         // chunks of those calls
  int64_t worker_chunks;  // chunks a worker (not the caller) ran
};
Stats stats();

}  // namespace pool

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (end <= begin) return;
  if (end - begin <= grain) {
    f(begin, end);
    return;
  }
  pool::run(begin, end, grain, pool::Body(std::cref(f)));
}

}  // namespace kvmesh
