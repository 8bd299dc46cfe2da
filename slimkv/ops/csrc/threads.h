/* The kernel's threads (included by decode_attention.c): torch's own OpenMP team.
 *
 * The library is built with -fopenmp, and its libgomp.so.1 is the one torch has already loaded (the
 * dynamic loader matches the name), so a threaded call runs on the threads torch keeps for its own
 * parallel work: no thread is started per call (which cost about 0.2-0.3 ms here, more than a small
 * decode step takes), and no second set of threads spins beside torch's. A pool of the library's
 * own, tried first, gained as much on the kernel calls alone but lost to torch's spinning threads
 * in a whole model: MLA and LRKV decode, whose steps also run torch's matmuls, ran slower on two
 * threads than on one (0.62x and 0.53x at 4K, SmolLM2 on this VM), against 1.31x and 1.23x here.
 * Built without OpenMP, or in a child forked after the library loaded (GNU OpenMP's team does not
 * survive fork(): a threaded call there would wait for threads that do not exist), a call starts its threads
 * (run_on_threads_started).
 */

/* A contiguous range of jobs that one thread runs in turn (more jobs than threads share out evenly). */
typedef struct {
    void *(*work)(void *);
    char *jobs;
    size_t job_size;
    int first, last;
} JobRange;

static void *run_job_range(void *arg) {
    const JobRange *range = (const JobRange *)arg;
    for (int j = range->first; j < range->last; j++) range->work(range->jobs + (size_t)j * range->job_size);
    return NULL;
}

/* Runs ranges[0..threads) on freshly started POSIX threads, ranges[0] on the caller's (and any range
 * whose thread cannot start); every range is done when it returns. */
static void run_on_threads_started(JobRange *ranges, int threads) {
    pthread_t ids[64];
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&ids[t], NULL, run_job_range, &ranges[t]) != 0) break;
        started = t;
    }
    for (int t = started + 1; t < threads; t++) run_job_range(&ranges[t]);
    run_job_range(&ranges[0]);
    for (int t = 1; t <= started; t++) pthread_join(ids[t], NULL);
}

#ifdef _OPENMP
static int forked_child; /* set in a child forked after this library loaded (torch's team may have run in the parent) */
static void note_fork(void) { forked_child = 1; }
__attribute__((constructor)) static void watch_forks(void) { pthread_atfork(NULL, NULL, note_fork); }
#endif

/* How a threaded call gets its threads here: what slimkv.ops.native.kernel_threading reports. */
const char *slimkv_kernel_threading(void) {
#ifdef _OPENMP
    return forked_child ? "started per call (a child forked after the library loaded)" : "torch's OpenMP team";
#else
    return "started per call (built without OpenMP)";
#endif
}

/* Runs ``work`` on each of ``count`` jobs (``jobs``: an array of ``job_size``-byte structs, at most
 * 64) on at most ``threads`` threads, each a contiguous share of the jobs in turn (jobs of equal work
 * then balance: e.g. 3 heads cut into 6 key ranges on 2 threads). Every job is done when it returns.
 * The one thread runner of every entry point in this library. */
static void run_on_threads(void *(*work)(void *), void *jobs, size_t job_size, int count, int threads) {
    if (threads > count) threads = count;
    if (threads < 1) threads = 1;
    JobRange ranges[64];
    for (int t = 0; t < threads; t++) ranges[t] = (JobRange){work, (char *)jobs, job_size, count * t / threads, count * (t + 1) / threads};
    if (threads == 1) {
        run_job_range(&ranges[0]);
        return;
    }
#ifdef _OPENMP
    if (!forked_child) {
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int t = 0; t < threads; t++) run_job_range(&ranges[t]);
        return;
    }
#endif
    run_on_threads_started(ranges, threads);
}
