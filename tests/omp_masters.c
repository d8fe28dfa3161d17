/* An LD_PRELOAD probe for tests/test_one_compute_thread.py: records, per process, every thread that starts a
 * top-level OpenMP parallel region (the master of a team), one line per thread in $OMP_MASTERS_DIR/<pid>.
 * torch runs its CPU ops' parallel loops through GOMP_parallel; each calling thread gets its own team, and on a
 * small CPU two teams slow each other down (shared/engine/engine_thread.py). Nested regions (a team's worker
 * calling into an op that parallelises again) are not masters and are not recorded. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef void (*gomp_parallel_t)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_get_level_t)(void);
static __thread int recorded = 0;

void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags) {
    static gomp_parallel_t real = 0;
    static omp_get_level_t level = 0;
    if (!real) {
        real = (gomp_parallel_t)dlsym(RTLD_NEXT, "GOMP_parallel");
        Dl_info info; /* omp_get_level of the libgomp torch itself uses (its wheel bundles a copy) */
        if (real && dladdr((void *)real, &info)) {
            void *lib = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
            if (lib) level = (omp_get_level_t)dlsym(lib, "omp_get_level");
        }
    }
    if (!recorded && (!level || level() == 0)) {
        recorded = 1;
        const char *dir = getenv("OMP_MASTERS_DIR");
        if (dir) {
            char path[4096];
            snprintf(path, sizeof path, "%s/%d", dir, (int)getpid());
            FILE *f = fopen(path, "a");
            if (f) {
                fprintf(f, "%ld\n", (long)syscall(SYS_gettid));
                fclose(f);
            }
        }
    }
    real(fn, data, num_threads, flags);
}
