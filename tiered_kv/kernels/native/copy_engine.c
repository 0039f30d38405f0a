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

/* The job being copied: its run, the queue node it came from, how many helper threads may
 * still join it. Any thread may start it and any may finish it: the last thread to leave it
 * once every unit is taken frees it. */
typedef struct {
    tkv_run r;
    tkv_node *node;
    int64_t may_join;
} tkv_cur;

typedef struct {
    pthread_mutex_t m;
    pthread_cond_t work, done;
    tkv_node *head, *tail;
    int stopping;
    int64_t spin_ns;
    int nice; /* added to the copier's and helpers' nice value: compute threads come first */
    pthread_t thread;
    pthread_t helpers[TKV_MAX_HELPERS];
    int nhelpers;
    tkv_cur *cur; /* under m */
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

static int units_left(const tkv_cur *c) {
    return __atomic_load_n(&c->r.next, __ATOMIC_ACQUIRE) < c->r.total;
}

static void *helper(void *arg);

/* Under e->m: clear and free the current job (every unit done and published). */
static void finalize(tkv_engine *e, tkv_cur *c) {
    e->cur = 0;
    tkv_run_free(&c->r);
    free(c->node);
    free(c);
    pthread_cond_broadcast(&e->done);
    pthread_cond_broadcast(&e->work);
}

/* Under e->m, no job current: make node's job current (its helpers started and woken), or
 * refuse it. */
static void start_job(tkv_engine *e, tkv_node *node) {
    tkv_cur *c = (tkv_cur *)calloc(1, sizeof(tkv_cur));
    if (!c || !tkv_run_init(&c->r, &node->job, &e->m, &e->done)) {
        tkv_run_refuse(&node->job);
        free(c);
        free(node);
        pthread_cond_broadcast(&e->done);
        return;
    }
    c->node = node;
    const tkv_rows *j = &node->job;
    int64_t want = j->threads - 1 < TKV_MAX_HELPERS ? j->threads - 1 : TKV_MAX_HELPERS;
    c->may_join = c->r.total < 2 ? 0 : want;
    while (e->nhelpers < c->may_join &&
           pthread_create(&e->helpers[e->nhelpers], 0, helper, e) == 0)
        e->nhelpers++;
    e->cur = c;
    if (c->r.total == 0) { /* no tokens: nothing to copy, publish at once */
        tkv_run_publish_locked(&c->r);
        finalize(e, c);
        return;
    }
    pthread_cond_broadcast(&e->work);
}

/* Under e->m (released while copying): take units of the current job c until none is left or
 * *status (if given) is set. The last thread out of a job whose units are all taken frees it;
 * one leaving early leaves it current for the copier. */
static void work_on(tkv_engine *e, tkv_cur *c, const int64_t *status) {
    c->r.joined++;
    pthread_mutex_unlock(&e->m);
    while (!(status && __atomic_load_n(status, __ATOMIC_ACQUIRE)) && tkv_run_one(&c->r)) {
    }
    pthread_mutex_lock(&e->m);
    c->r.joined--;
    if (c->r.joined == 0 && !units_left(c)) finalize(e, c);
    else if (c->r.joined == 0) pthread_cond_broadcast(&e->work); /* the copier takes over */
}

/* Under e->m: one step of work for a thread that may start queued jobs; 0 if there was none. */
static int step(tkv_engine *e, const int64_t *status) {
    if (e->cur && units_left(e->cur)) {
        work_on(e, e->cur, status);
        return 1;
    }
    if (!e->cur && e->head) {
        tkv_node *node = e->head;
        e->head = node->next;
        if (!e->head) e->tail = 0;
        start_job(e, node);
        if (e->cur && e->cur->node == node) work_on(e, e->cur, status);
        return 1;
    }
    return 0;
}

static void *helper(void *arg) {
    tkv_engine *e = (tkv_engine *)arg;
    lower_priority(e);
    pthread_mutex_lock(&e->m);
    for (;;) {
        tkv_cur *c = e->cur;
        if (c && c->may_join > 0 && units_left(c)) {
            c->may_join--;
            work_on(e, c, 0);
            continue;
        }
        if (e->stopping) break;
        pthread_cond_wait(&e->work, &e->m);
    }
    pthread_mutex_unlock(&e->m);
    return 0;
}

static void *copier(void *arg) {
    tkv_engine *e = (tkv_engine *)arg;
    lower_priority(e);
    pthread_mutex_lock(&e->m);
    for (;;) {
        if (step(e, 0)) continue;
        if (e->stopping && !e->head && !e->cur) break;
        /* Spin on an empty queue for spin_ns before sleeping: the next job often follows. */
        pthread_mutex_unlock(&e->m);
        int64_t until = tkv_now_ns() + e->spin_ns;
        while (!__atomic_load_n(&e->head, __ATOMIC_ACQUIRE) &&
               !__atomic_load_n(&e->stopping, __ATOMIC_ACQUIRE) && tkv_now_ns() < until)
            for (int i = 0; i < 64; i++) TKV_PAUSE();
        pthread_mutex_lock(&e->m);
        /* Sleep unless there is work; stopping, only until the job being finished is freed. */
        if (!e->head && !(e->cur && units_left(e->cur)) && (!e->stopping || e->cur))
            pthread_cond_wait(&e->work, &e->m);
    }
    pthread_mutex_unlock(&e->m);
    return 0;
}

void *tkv_engine_start(int64_t spin_ns, int64_t nice) {
    tkv_engine *e = (tkv_engine *)calloc(1, sizeof(tkv_engine));
    if (!e) return 0;
    pthread_mutex_init(&e->m, 0);
    pthread_cond_init(&e->work, 0);
    pthread_cond_init(&e->done, 0);
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
    pthread_cond_broadcast(&e->work);
    pthread_mutex_unlock(&e->m);
    return 0;
}

/* Run *job now on the calling thread and the engine's helpers (j->threads - 1 of them), after
 * every queued job; returns when every status entry is set: 0, or -1 if any was refused. */
int tkv_engine_run(void *handle, const tkv_rows *job) {
    tkv_engine *e = (tkv_engine *)handle;
    if (!job->status) return -1;
    tkv_node *node = (tkv_node *)malloc(sizeof(tkv_node));
    if (!node) return -1;
    node->job = *job;
    node->next = 0;
    int64_t entries = job->whole || job->nlayers < 1 ? 1 : job->nlayers;
    const int64_t *last = &job->status[entries - 1];
    pthread_mutex_lock(&e->m);
    while (e->cur || e->head) {
        if (!step(e, 0)) pthread_cond_wait(&e->done, &e->m); /* help the jobs before it */
    }
    start_job(e, node);
    while (!__atomic_load_n(last, __ATOMIC_ACQUIRE)) {
        if (e->cur && units_left(e->cur)) work_on(e, e->cur, 0);
        else pthread_cond_wait(&e->done, &e->m);
    }
    pthread_mutex_unlock(&e->m);
    for (int64_t k = 0; k < entries; k++)
        if (__atomic_load_n(&job->status[k], __ATOMIC_ACQUIRE) != 1) return -1;
    return 0;
}

/* The status entry once it is set: helping (help != 0: running the queue's next job if none is
 * being copied, else taking units of the current one), spinning up to spin_ns, sleeping until
 * something is published, and again; 0 after timeout_ns (< 0: no timeout; help is not bounded
 * by it, a unit is short). */
int64_t tkv_engine_wait(void *handle, const int64_t *status, int64_t timeout_ns,
                        int64_t spin_ns, int64_t help) {
    tkv_engine *e = (tkv_engine *)handle;
    int64_t v = __atomic_load_n(status, __ATOMIC_ACQUIRE);
    if (v) return v;
    int64_t start = tkv_now_ns();
    struct timespec until;
    if (timeout_ns >= 0) {
        clock_gettime(CLOCK_REALTIME, &until);
        int64_t ns = until.tv_nsec + timeout_ns;
        until.tv_sec += ns / 1000000000LL;
        until.tv_nsec = ns % 1000000000LL;
    }
    for (;;) {
        if (help) {
            pthread_mutex_lock(&e->m);
            while (!__atomic_load_n(status, __ATOMIC_ACQUIRE) && step(e, status)) {
            }
            pthread_mutex_unlock(&e->m);
        }
        int64_t left = timeout_ns < 0 ? spin_ns : timeout_ns - (tkv_now_ns() - start);
        spin_until(status, 0, left < spin_ns ? left : spin_ns);
        if ((v = __atomic_load_n(status, __ATOMIC_ACQUIRE))) return v;
        pthread_mutex_lock(&e->m);
        int timed_out = 0;
        if (!__atomic_load_n(status, __ATOMIC_ACQUIRE) && !(help && (e->head || (e->cur && units_left(e->cur))))) {
            if (timeout_ns < 0) pthread_cond_wait(&e->done, &e->m);
            else timed_out = pthread_cond_timedwait(&e->done, &e->m, &until) == ETIMEDOUT;
        }
        pthread_mutex_unlock(&e->m);
        if ((v = __atomic_load_n(status, __ATOMIC_ACQUIRE)) || timed_out) return v;
    }
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
    pthread_cond_broadcast(&e->work);
    pthread_mutex_unlock(&e->m);
    for (int i = 0; i < e->nhelpers; i++) pthread_join(e->helpers[i], 0);
}

void tkv_engine_free(void *handle) {
    tkv_engine *e = (tkv_engine *)handle;
    pthread_cond_destroy(&e->work);
    pthread_cond_destroy(&e->done);
    pthread_mutex_destroy(&e->m);
    free(e);
}

/* A status entry, read with acquire order (a 1 read here makes the entry's bytes visible). */
int64_t tkv_status(const int64_t *status) { return __atomic_load_n(status, __ATOMIC_ACQUIRE); }
