/* Block copier for page transfers on CPU: copy n blocks, block i from src[i] to dst[i].
 *
 * The caller orders blocks by destination address, so each thread writes one long, nearly
 * sequential stream. Large transfers use non-temporal stores (they bypass the cache: the bytes
 * are not read again soon, and a read-for-ownership of every destination line is avoided).
 * Work is split into `threads` contiguous ranges, one pthread each; the GIL is released by ctypes
 * for the whole call. Returns 0, or -1 on bad arguments (nothing copied). */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "copy_row.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define TKV_MAX_THREADS 64

typedef struct {
    const int64_t *dst, *src, *sizes;
    int64_t n, bytes;
    int nt;
} tkv_job;

static void *tkv_run(void *arg) {
    const tkv_job *j = (const tkv_job *)arg;
    for (int64_t i = 0; i < j->n; i++) {
        int64_t bytes = j->sizes ? j->sizes[i] : j->bytes;
        tkv_copy_row((char *)(intptr_t)j->dst[i], (const char *)(intptr_t)j->src[i], bytes, j->nt);
    }
#if defined(__SSE2__)
    if (j->nt) _mm_sfence(); /* make streamed stores visible before the thread reports done */
#endif
    return 0;
}

int tkv_copy_blocks(const int64_t *dst, const int64_t *src, const int64_t *sizes, int64_t n,
                    int64_t bytes, int threads, int nt) {
    if (n < 0 || (!sizes && bytes < 0) || threads < 1) return -1;
    if (n == 0) return 0;
    if (threads > TKV_MAX_THREADS) threads = TKV_MAX_THREADS;
    if (n < threads) threads = (int)n;
    pthread_t tid[TKV_MAX_THREADS];
    tkv_job jobs[TKV_MAX_THREADS];
    int started[TKV_MAX_THREADS];
    int64_t per = n / threads, extra = n % threads, start = 0;
    for (int t = 0; t < threads; t++) {
        int64_t cnt = per + (t < extra);
        jobs[t].dst = dst + start;
        jobs[t].src = src + start;
        jobs[t].sizes = sizes ? sizes + start : 0;
        jobs[t].n = cnt;
        jobs[t].bytes = bytes;
        jobs[t].nt = nt;
        start += cnt;
    }
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&tid[t], 0, tkv_run, &jobs[t]) == 0;
    tkv_run(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], 0);
        else tkv_run(&jobs[t]); /* could not start a thread: do its share here */
    }
    return 0;
}
