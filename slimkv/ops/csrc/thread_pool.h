/* The kernel's threads: one pool per library, started on first use and kept (included by decode_attention.c).
 *
 * Starting POSIX threads on every call cost about 0.2-0.3 ms on the development VM, more than a
 * decode step's attention over a few thousand keys takes, so calls started threads only above a
 * large size. The pool's workers stay alive between calls: each polls a generation counter for
 * POOL_SPIN_NS after its work (a decode step calls the kernel again within that time; a count of
 * polls instead ran out too soon on a CPU with a short pause) and then sleeps on a condition
 * variable, so an idle process holds no CPU. Both waits yield the core now and then: a worker and
 * the caller that the scheduler put on one core (it happened here, costing 0.1-0.2 ms a call while
 * the other core idled) would otherwise spin through each other's time slices. A call hands each worker a
 * range of jobs under the pool's lock, runs the first range itself, and spins until the workers'
 * count of ranges left reaches zero.
 *
 * One call at a time uses the pool (another thread calling meanwhile starts its own threads, as
 * before the pool); a forked child starts a pool of its own (pthread_atfork), and a worker that
 * cannot be started leaves its range to the caller. run_on_threads_started is the plain runner the
 * pool replaces, kept for those cases.
 */
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

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

#ifndef POOL_SPIN_NS
#define POOL_SPIN_NS 200000 /* how long a worker polls for the next call before it sleeps: waking a sleeping one took about 0.1 ms here */
#endif

static inline void cpu_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static struct {
    pthread_mutex_t call; /* held by the one call using the pool */
    pthread_mutex_t lock; /* guards the dispatch fields below and the sleep */
    pthread_cond_t wake;
    atomic_uint_fast64_t generation; /* bumped (under lock) by every dispatch */
    atomic_int left;                 /* ranges of this dispatch the workers have not finished */
    JobRange *ranges;                /* this dispatch's ranges: worker t runs ranges[t] if t < count */
    int count;
    int workers; /* started so far; worker t (1..workers) */
    uint_fast64_t born[64]; /* worker t's first generation to wait past: the one before the dispatch that started it */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, NULL, 0, 0, {0}};

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void *pool_worker(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint_fast64_t seen = pool.born[index]; /* not the generation now: the dispatch that started this worker may have bumped it already */
    for (;;) {
        const int64_t until = now_ns() + POOL_SPIN_NS;
        for (int polls = 1; atomic_load_explicit(&pool.generation, memory_order_acquire) == seen; polls++) {
            cpu_pause();
            if (polls % 64 == 0 && now_ns() > until) break; /* the clock read now and then: a poll is a few nanoseconds */
        }
        pthread_mutex_lock(&pool.lock);
        while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
        seen = atomic_load(&pool.generation); /* this dispatch's fields, read under the lock it wrote them under */
        JobRange *range = index < pool.count ? &pool.ranges[index] : NULL;
        pthread_mutex_unlock(&pool.lock);
        if (range) {
            run_job_range(range);
            atomic_fetch_sub_explicit(&pool.left, 1, memory_order_release);
        }
    }
    return NULL;
}

/* In a forked child only the forking thread exists: forget the parent's workers and locks. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.call, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.workers = 0;
    pool.count = 0;
    atomic_store(&pool.left, 0);
}

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static void pool_register_fork(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

/* Runs ``work`` on each of ``count`` jobs (``jobs``: an array of ``job_size``-byte structs, at most
 * 64) on at most ``threads`` threads, each a contiguous share of the jobs in turn (jobs of equal work
 * then balance: e.g. 3 heads cut into 6 key ranges on 2 threads): the first share on the caller's
 * thread, the others on the pool's workers. Every job is done when it returns. The one thread
 * runner of every entry point in this library. */
static void run_on_threads(void *(*work)(void *), void *jobs, size_t job_size, int count, int threads) {
    if (threads > count) threads = count;
    if (threads < 1) threads = 1;
    JobRange ranges[64];
    for (int t = 0; t < threads; t++) ranges[t] = (JobRange){work, (char *)jobs, job_size, count * t / threads, count * (t + 1) / threads};
    if (threads == 1) {
        run_job_range(&ranges[0]);
        return;
    }
    pthread_once(&pool_once, pool_register_fork);
    if (pthread_mutex_trylock(&pool.call) != 0) { /* another thread's call holds the pool */
        run_on_threads_started(ranges, threads);
        return;
    }
    while (pool.workers < threads - 1) {
        pthread_t id;
        pool.born[pool.workers + 1] = atomic_load(&pool.generation);
        if (pthread_create(&id, NULL, pool_worker, (void *)(intptr_t)(pool.workers + 1)) != 0) break;
        pthread_detach(id);
        pool.workers++;
    }
    const int pooled = pool.workers + 1 < threads ? pool.workers + 1 : threads; /* ranges the caller and the workers take */
    pthread_mutex_lock(&pool.lock);
    pool.ranges = ranges;
    pool.count = pooled;
    atomic_store(&pool.left, pooled - 1);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    for (int t = pooled; t < threads; t++) run_job_range(&ranges[t]); /* workers that could not start: here */
    run_job_range(&ranges[0]);
    for (int polls = 1; atomic_load_explicit(&pool.left, memory_order_acquire) > 0; polls++) {
        cpu_pause();
        if (polls % 64 == 0) sched_yield(); /* a worker the scheduler put on this core runs */
    }
    pthread_mutex_unlock(&pool.call);
}
