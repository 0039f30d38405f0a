/* Copy engine for page transfers on CPU: a persistent copier thread that runs row-copy jobs
 * (copy_rows.h) in submission order and reports each status entry's completion in memory the
 * caller owns: 0 pending, 1 done, -1 refused, stored with release order after the bytes.
 *
 * A job that allows several threads is shared with persistent helper threads: every thread
 * takes the job's units in order with one atomic add, so there is no barrier between layers
 * and layer k is published as soon as its units and every earlier layer's are done. A thread
 * that waits for an entry helps with the job being copied until the entry is set (the units it
 * takes are the earliest left, so they are the ones it waits for): a waiting thread's core
 * copies instead of idling, and never competes with the copier for a core while it sleeps.
 *
 * The copier and its helpers spin spin_ns on an empty queue before sleeping (a job submitted
 * right after the last one starts without a wake-up); waiters spin as long as they are told.
 * The caller keeps every array of a job alive until its last status entry is set. */
#include "copy_rows.h"

#include <errno.h>
#include <stdlib.h>
#include <time.h>
#if defined(__linux__)
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#define TKV_PAUSE() _mm_pause()
#else
#define TKV_PAUSE() ((void)0)
#endif

#define TKV_MAX_HELPERS 63

typedef struct tkv_node {
    tkv_rows job;
    struct tkv_node *next;
} tkv_node;

typedef struct {
    pthread_mutex_t m;
    pthread_cond_t work, done, help;
    tkv_node *head, *tail;
    int stopping;
    int64_t spin_ns;
    int nice; /* added to the copier's and helpers' nice value: compute threads come first */
    pthread_t thread;
    /* helpers: the job being shared (cur, under m), its generation, how many may join it */
    pthread_t helpers[TKV_MAX_HELPERS];
    int nhelpers;
    tkv_run *cur;
    int64_t gen, may_join;
} tkv_engine;

static void spin_until(const int64_t *word, int64_t old, int64_t spin_ns) {
    int64_t until = tkv_now_ns() + spin_ns;
    while (__atomic_load_n(word, __ATOMIC_ACQUIRE) == old && tkv_now_ns() < until)
        for (int i = 0; i < 64; i++) TKV_PAUSE();
}

/* Lower this thread's priority by e->nice (Linux: per thread); elsewhere a no-op. */
static void lower_priority(const tkv_engine *e) {
#if defined(__linux__)
    if (e->nice > 0) {
        pid_t tid = (pid_t)syscall(SYS_gettid);
        int now = getpriority(PRIO_PROCESS, (id_t)tid);
        setpriority(PRIO_PROCESS, (id_t)tid, now + e->nice);
    }
#else
    (void)e;
#endif
}

static void *helper(void *arg) {
    tkv_engine *e = (tkv_engine *)arg;
    int64_t seen = 0;
    lower_priority(e);
    for (;;) {
        spin_until(&e->gen, seen, e->spin_ns);
        pthread_mutex_lock(&e->m);
        while (e->gen == seen && !e->stopping) pthread_cond_wait(&e->help, &e->m);
        if (e->stopping) {
            pthread_mutex_unlock(&e->m);
            return 0;
        }
        seen = e->gen;
        tkv_run *r = e->cur;
        if (r && e->may_join > 0) {
            e->may_join--;
            r->joined++;
        } else {
            r = 0;
        }
        pthread_mutex_unlock(&e->m);
        if (!r) continue;
        tkv_run_work(r);
        pthread_mutex_lock(&e->m);
        r->joined--;
        pthread_cond_broadcast(&e->done);
        pthread_mutex_unlock(&e->m);
    }
}

/* Run one job on the calling thread (the copier, or a caller of tkv_engine_run) with the
 * helpers it allows; one job at a time per engine, so jobs never overlap. */
static void run_job(tkv_engine *e, const tkv_rows *j) {
    tkv_run r;
    pthread_mutex_lock(&e->m);
    while (e->cur) pthread_cond_wait(&e->done, &e->m);
    if (!tkv_run_init(&r, j, &e->m, &e->done)) {
        tkv_run_refuse(j);
        pthread_cond_broadcast(&e->done);
        pthread_mutex_unlock(&e->m);
        return;
    }
    int64_t want = j->threads - 1 < TKV_MAX_HELPERS ? j->threads - 1 : TKV_MAX_HELPERS;
    if (r.total < 2) want = 0;
    while (e->nhelpers < want &&
           pthread_create(&e->helpers[e->nhelpers], 0, helper, e) == 0)
        e->nhelpers++;
    e->cur = &r; /* waiters may help with any job; helpers only where the job allows them */
    e->may_join = want;
    if (want > 0) {
        __atomic_add_fetch(&e->gen, 1, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&e->help);
    }
    pthread_mutex_unlock(&e->m);
    tkv_run_work(&r);
    tkv_run_publish(&r); /* a job without units (no tokens) is published here */
    pthread_mutex_lock(&e->m);
    e->may_join = 0;
    while (r.published < r.entries || r.joined > 0) pthread_cond_wait(&e->done, &e->m);
    e->cur = 0;
    pthread_cond_broadcast(&e->done); /* a job waiting for its turn may start */
    pthread_mutex_unlock(&e->m);
    tkv_run_free(&r);
}

/* Run *job now on the calling thread and the engine's helpers (j->threads - 1 of them), after
 * the job being copied; returns when every status entry is set: 0, or -1 if any was refused. */
int tkv_engine_run(void *handle, const tkv_rows *job) {
    tkv_engine *e = (tkv_engine *)handle;
    if (!job->status) return -1;
    run_job(e, job);
    int64_t entries = job->whole || job->nlayers < 1 ? 1 : job->nlayers;
    for (int64_t k = 0; k < entries; k++)
        if (__atomic_load_n(&job->status[k], __ATOMIC_ACQUIRE) != 1) return -1;
    return 0;
}

static tkv_node *take(tkv_engine *e) {
    int64_t until = tkv_now_ns() + e->spin_ns;
    while (!__atomic_load_n(&e->head, __ATOMIC_ACQUIRE) &&
           !__atomic_load_n(&e->stopping, __ATOMIC_ACQUIRE) && tkv_now_ns() < until)
        for (int i = 0; i < 64; i++) TKV_PAUSE();
    pthread_mutex_lock(&e->m);
    while (!e->head && !e->stopping) pthread_cond_wait(&e->work, &e->m);
    tkv_node *node = e->head;
    if (node) {
        e->head = node->next;
        if (!e->head) e->tail = 0;
    }
    pthread_mutex_unlock(&e->m);
    return node; /* 0: stopping with an empty queue */
}

static void *copier(void *arg) {
    tkv_engine *e = (tkv_engine *)arg;
    lower_priority(e);
    for (;;) {
        tkv_node *node = take(e);
        if (!node) return 0;
        run_job(e, &node->job);
        free(node);
    }
}

void *tkv_engine_start(int64_t spin_ns, int64_t nice) {
    tkv_engine *e = (tkv_engine *)calloc(1, sizeof(tkv_engine));
    if (!e) return 0;
    pthread_mutex_init(&e->m, 0);
    pthread_cond_init(&e->work, 0);
    pthread_cond_init(&e->done, 0);
    pthread_cond_init(&e->help, 0);
    e->spin_ns = spin_ns > 0 ? spin_ns : 0;
    e->nice = nice > 0 ? (int)(nice < 19 ? nice : 19) : 0;
    if (pthread_create(&e->thread, 0, copier, e) != 0) {
        free(e);
        return 0;
    }
    return e;
}

/* Queue a copy of *job; 0, or -1 when stopping, out of memory or without status entries
 * (nothing queued). */
int tkv_engine_submit(void *handle, const tkv_rows *job) {
    tkv_engine *e = (tkv_engine *)handle;
    if (!job->status) return -1; /* nobody could learn the job finished */
    tkv_node *node = (tkv_node *)malloc(sizeof(tkv_node));
    if (!node) return -1;
    node->job = *job;
    node->next = 0;
    pthread_mutex_lock(&e->m);
    if (e->stopping) {
        pthread_mutex_unlock(&e->m);
        free(node);
        return -1;
    }
    if (e->tail) e->tail->next = node;
    else __atomic_store_n(&e->head, node, __ATOMIC_RELEASE);
    e->tail = node;
    pthread_cond_signal(&e->work);
    pthread_mutex_unlock(&e->m);
    return 0;
}

/* The status entry once it is set: first helping with the job being copied (help != 0), then
 * spinning up to spin_ns, then sleeping; 0 after timeout_ns (< 0: no timeout; the help is not
 * bounded by it, a unit is short). */
int64_t tkv_engine_wait(void *handle, const int64_t *status, int64_t timeout_ns,
                        int64_t spin_ns, int64_t help) {
    tkv_engine *e = (tkv_engine *)handle;
    int64_t v = __atomic_load_n(status, __ATOMIC_ACQUIRE);
    if (v) return v;
    int64_t start = tkv_now_ns();
    if (help) {
        pthread_mutex_lock(&e->m);
        tkv_run *r = e->cur;
        if (r) r->joined++;
        pthread_mutex_unlock(&e->m);
        if (r) {
            while (!__atomic_load_n(status, __ATOMIC_ACQUIRE) && tkv_run_one(r)) {
            }
            pthread_mutex_lock(&e->m);
            r->joined--;
            pthread_cond_broadcast(&e->done);
            pthread_mutex_unlock(&e->m);
        }
    }
    if (timeout_ns >= 0 && spin_ns > timeout_ns) spin_ns = timeout_ns;
    spin_until(status, 0, spin_ns);
    v = __atomic_load_n(status, __ATOMIC_ACQUIRE);
    if (v) return v;
    struct timespec until;
    if (timeout_ns >= 0) {
        clock_gettime(CLOCK_REALTIME, &until);
        int64_t ns = until.tv_nsec + (timeout_ns - (tkv_now_ns() - start));
        if (ns < 0) ns = 0;
        until.tv_sec += ns / 1000000000LL;
        until.tv_nsec = ns % 1000000000LL;
    }
    pthread_mutex_lock(&e->m);
    while (!(v = __atomic_load_n(status, __ATOMIC_ACQUIRE))) {
        if (timeout_ns < 0) pthread_cond_wait(&e->done, &e->m);
        else if (pthread_cond_timedwait(&e->done, &e->m, &until) == ETIMEDOUT) break;
    }
    pthread_mutex_unlock(&e->m);
    return v;
}

/* Run *job on the calling thread alone (no queue); 0, or -1 when any entry was refused. */
int tkv_rows_copy(const tkv_rows *job) {
    tkv_run r;
    if (!tkv_run_init(&r, job, 0, 0)) {
        tkv_run_refuse(job);
        return -1;
    }
    tkv_run_work(&r);
    tkv_run_publish(&r);
    int bad = 0;
    for (int64_t k = 0; k < r.entries; k++) bad |= r.bad[k];
    tkv_run_free(&r);
    return bad ? -1 : 0;
}

/* Finish every queued job and stop the copier and helpers; waiters already inside
 * tkv_engine_wait return (every entry is set). Free with tkv_engine_free once no caller is
 * inside it. */
void tkv_engine_stop(void *handle) {
    tkv_engine *e = (tkv_engine *)handle;
    pthread_mutex_lock(&e->m);
    __atomic_store_n(&e->stopping, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&e->work);
    pthread_mutex_unlock(&e->m);
    pthread_join(e->thread, 0);
    pthread_mutex_lock(&e->m);
    pthread_cond_broadcast(&e->help);
    pthread_mutex_unlock(&e->m);
    for (int i = 0; i < e->nhelpers; i++) pthread_join(e->helpers[i], 0);
}

void tkv_engine_free(void *handle) {
    tkv_engine *e = (tkv_engine *)handle;
    pthread_cond_destroy(&e->work);
    pthread_cond_destroy(&e->done);
    pthread_cond_destroy(&e->help);
    pthread_mutex_destroy(&e->m);
    free(e);
}

/* A status entry, read with acquire order (a 1 read here makes the entry's bytes visible). */
int64_t tkv_status(const int64_t *status) { return __atomic_load_n(status, __ATOMIC_ACQUIRE); }
