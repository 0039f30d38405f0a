/* Row copies of the copy engine (copy_rows.h): the copy of one unit of a job, and the shared
 * bookkeeping that lets several threads take units in order and publish each status entry as
 * soon as it and every entry before it are done. Addresses are computed while copying. */
#include "copy_rows.h"
#include "copy_row.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define TKV_CHUNK 16              /* tokens per host region of a chunked whole job */
#define TKV_UNIT_BYTES (256 << 10) /* about this many bytes per unit of a layer */
#define TKV_AHEAD 4 /* records prefetched this many tokens ahead */

int64_t tkv_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Tokens [t0, t1) of local layer l; each token's parts in record order (one host record is
 * read or written front to back). */
static void copy_tokens(const tkv_rows *j, int64_t l, int64_t t0, int64_t t1) {
    const int64_t *bases = j->dev_bases + l * j->nparts;
    char *host = (char *)(intptr_t)(j->host_base + l * j->host_layer_bytes);
    int nt = (int)j->nt;
    int64_t rec_bytes = j->part_bytes[j->nparts - 1] + j->row_bytes[j->nparts - 1];
    for (int64_t i = t0; i < t1; i++) {
        char *rec = host + j->host_tok[i];
        int64_t row = j->dev_rows[i];
        if (i + TKV_AHEAD < t1) { /* the record read TKV_AHEAD tokens later: scattered reads */
            const char *next = j->to_host ? (const char *)(intptr_t)bases[0] +
                                                j->dev_rows[i + TKV_AHEAD] * j->row_bytes[0]
                                          : host + j->host_tok[i + TKV_AHEAD];
            int64_t span = j->to_host ? j->row_bytes[0] : rec_bytes;
            for (int64_t b = 0; b < span; b += 64) __builtin_prefetch(next + b, 0, 0);
        }
        for (int64_t p = 0; p < j->nparts; p++) {
            int64_t rb = j->row_bytes[p];
            char *h = rec + j->part_bytes[p];
            char *d = (char *)(intptr_t)bases[p] + row * rb;
            if (j->to_host) tkv_copy_row(h, d, rb, nt);
            else tkv_copy_row(d, h, rb, nt);
        }
    }
}

/* Tokens [t0, t1) of every chosen layer, in chunks of TKV_CHUNK tokens each over every layer
 * (a chunk fills one region of a token-major host buffer). */
static void copy_chunks(const tkv_rows *j, int64_t t0, int64_t t1) {
    for (int64_t c = t0; c < t1; c += TKV_CHUNK) {
        int64_t e = c + TKV_CHUNK < t1 ? c + TKV_CHUNK : t1;
        for (int64_t k = 0; k < j->nlayers; k++) copy_tokens(j, j->layers[k], c, e);
    }
}

static int job_ok(const tkv_rows *j) {
    if (j->n < 0 || j->nparts < 1 || j->nlayers < 1 || j->threads < 1) return 0;
    if (j->chunked && !j->whole) return 0;
    if (j->n > 0 && (!j->dev_rows || !j->host_tok || !j->host_base)) return 0;
    if (!j->dev_bases || !j->row_bytes || !j->part_bytes || !j->layers) return 0;
    for (int64_t p = 0; p < j->nparts; p++)
        if (j->row_bytes[p] < 0) return 0;
    return 1;
}

void tkv_run_refuse(const tkv_rows *j) {
    int64_t entries = j->whole || j->nlayers < 1 ? 1 : j->nlayers;
    if (!j->status) return;
    for (int64_t k = 0; k < entries; k++) {
        if (j->ns) j->ns[k] = 0;
        __atomic_store_n(&j->status[k], -1, __ATOMIC_RELEASE);
    }
}

int tkv_run_init(tkv_run *r, const tkv_rows *j, pthread_mutex_t *m, pthread_cond_t *cv) {
    memset(r, 0, sizeof(*r));
    if (!job_ok(j)) return 0;
    r->j = j;
    r->m = m;
    r->cv = cv;
    r->entries = j->whole ? 1 : j->nlayers;
    r->done = (int64_t *)calloc((size_t)r->entries, sizeof(int64_t));
    r->bad = (uint8_t *)calloc((size_t)r->entries, 1);
    if (!r->done || !r->bad) {
        tkv_run_free(r);
        return 0;
    }
    int64_t any_bad = 0;
    for (int64_t k = 0; k < j->nlayers; k++) {
        int bad = j->layers[k] < 0 || j->layers[k] >= j->total_layers;
        any_bad |= bad;
        if (!j->whole) r->bad[k] = (uint8_t)bad;
    }
    if (j->whole && any_bad) {
        tkv_run_free(r);
        return 0;
    }
    int64_t token_bytes = 0;
    for (int64_t p = 0; p < j->nparts; p++) token_bytes += j->row_bytes[p];
    if (j->chunked) {
        r->unit_tokens = TKV_CHUNK;
    } else {
        int64_t ut = token_bytes > 0 ? TKV_UNIT_BYTES / token_bytes : j->n;
        r->unit_tokens = ut < 16 ? 16 : ut;
    }
    r->units_per_layer = (j->n + r->unit_tokens - 1) / r->unit_tokens;
    r->total = j->chunked ? r->units_per_layer : r->units_per_layer * j->nlayers;
    r->need = j->whole ? r->total : r->units_per_layer;
    r->t_last = tkv_now_ns();
    return 1;
}

void tkv_run_free(tkv_run *r) {
    free(r->done);
    free(r->bad);
    r->done = 0;
    r->bad = 0;
}

/* Set every status entry whose units are done, in order, once the entries before it are; the
 * caller holds r->m (if any). */
void tkv_run_publish_locked(tkv_run *r) {
    const tkv_rows *j = r->j;
    int64_t now = tkv_now_ns();
    while (r->published < r->entries &&
           __atomic_load_n(&r->done[r->published], __ATOMIC_ACQUIRE) == r->need) {
        int64_t k = r->published;
        if (j->ns) j->ns[k] = now - r->t_last;
        r->t_last = now;
        if (j->status) __atomic_store_n(&j->status[k], r->bad[k] ? -1 : 1, __ATOMIC_RELEASE);
        r->published++;
    }
    if (r->cv) pthread_cond_broadcast(r->cv);
}

void tkv_run_publish(tkv_run *r) {
    if (r->m) pthread_mutex_lock(r->m);
    tkv_run_publish_locked(r);
    if (r->m) pthread_mutex_unlock(r->m);
}

/* Take and copy one unit; 0 when none is left. Whoever finishes an entry's last unit
 * publishes. */
int tkv_run_one(tkv_run *r) {
    const tkv_rows *j = r->j;
    int64_t u = __atomic_fetch_add(&r->next, 1, __ATOMIC_RELAXED);
    if (u >= r->total) return 0;
    int64_t entry = 0;
    if (j->chunked) {
        int64_t t0 = u * r->unit_tokens;
        copy_chunks(j, t0, t0 + r->unit_tokens < j->n ? t0 + r->unit_tokens : j->n);
    } else {
        int64_t k = u / r->units_per_layer;
        int64_t t0 = (u % r->units_per_layer) * r->unit_tokens;
        int64_t t1 = t0 + r->unit_tokens < j->n ? t0 + r->unit_tokens : j->n;
        entry = j->whole ? 0 : k;
        if (!r->bad[entry]) copy_tokens(j, j->layers[k], t0, t1);
    }
#if defined(__SSE2__)
    if (j->nt) _mm_sfence(); /* streamed stores visible before the unit counts as done */
#endif
    if (__atomic_add_fetch(&r->done[entry], 1, __ATOMIC_ACQ_REL) == r->need) tkv_run_publish(r);
    return 1;
}

void tkv_run_work(tkv_run *r) {
    while (tkv_run_one(r)) {
    }
}

/* Every token of chosen layer k of *j on the calling thread, with no status entry and no
 * allocation: the per-layer step of a layer-wise load whose job was built once. 0, or -1 when
 * the job is not a valid per-layer job or k (or its layer) is out of range; nothing copied. */
int tkv_rows_copy_layer(const tkv_rows *j, int64_t k) {
    if (!job_ok(j) || j->chunked || k < 0 || k >= j->nlayers) return -1;
    int64_t l = j->layers[k];
    if (l < 0 || l >= j->total_layers) return -1;
    copy_tokens(j, l, 0, j->n);
#if defined(__SSE2__)
    if (j->nt) _mm_sfence(); /* streamed stores visible before the caller uses the layer */
#endif
    return 0;
}
