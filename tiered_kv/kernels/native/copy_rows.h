/* Row-copy jobs of the copy engine: the job a caller describes (tkv_rows) and a job being run
 * (tkv_run), whose units of work any number of threads take in order. */
#ifndef TKV_COPY_ROWS_H
#define TKV_COPY_ROWS_H
#include <pthread.h>
#include <stdint.h>

/* A job copies, for each chosen local layer l, part p and token i, one row of row_bytes[p]
 * bytes between device row dev_rows[i] of the buffer at dev_bases[l * nparts + p] and the host
 * record at host_base + host_tok[i] + l * host_layer_bytes + part_bytes[p]. */
typedef struct {
    int64_t n;                 /* tokens */
    const int64_t *dev_rows;   /* n device rows */
    const int64_t *host_tok;   /* n byte offsets of each token's layer-0 record */
    int64_t host_base;         /* host buffer address */
    int64_t host_layer_bytes;  /* bytes between a record's consecutive layers */
    int64_t nparts;
    const int64_t *dev_bases;  /* total_layers x nparts buffer addresses */
    const int64_t *row_bytes;  /* nparts */
    const int64_t *part_bytes; /* nparts: byte offset of each part inside a record */
    int64_t total_layers;
    int64_t nlayers;           /* chosen layers */
    const int64_t *layers;     /* nlayers local layer indices, copied in this order */
    int64_t to_host;
    int64_t whole;             /* one status entry for the job (else one per chosen layer) */
    int64_t chunked;           /* with whole: tokens in chunks, each chunk over every layer */
    int64_t threads;           /* threads that may share the job (the copier and helpers) */
    int64_t nt;                /* non-temporal stores */
    int64_t *status;           /* nlayers entries, or 1 when whole */
    int64_t *ns;               /* same count: time from the previous entry's completion */
} tkv_rows;

/* A job being run. Units are taken in order with one atomic add: (layer, token range) pairs,
 * layer-major, or token ranges over every layer for a chunked whole job. An entry is published
 * (its status set, release order) once its units are done and every earlier entry is. */
typedef struct {
    const tkv_rows *j;
    int64_t unit_tokens, units_per_layer, total, entries, need;
    int64_t next;      /* atomic: the next unit to take */
    int64_t *done;     /* entries: units finished (atomic) */
    uint8_t *bad;      /* entries: refused (a layer out of range) */
    int64_t published; /* under m */
    int64_t t_last;    /* under m: when the last entry was published (or the job started) */
    int64_t joined;    /* helpers inside work() (under m) */
    pthread_mutex_t *m; /* 0: one thread, no locking */
    pthread_cond_t *cv; /* broadcast after each publish and when a helper leaves */
} tkv_run;

int64_t tkv_now_ns(void);
/* 0 when the job is refused as a whole (bad counts or pointers; for a whole job any layer). */
int tkv_run_init(tkv_run *r, const tkv_rows *j, pthread_mutex_t *m, pthread_cond_t *cv);
int tkv_run_one(tkv_run *r);
void tkv_run_work(tkv_run *r);
void tkv_run_publish(tkv_run *r);
void tkv_run_publish_locked(tkv_run *r);
void tkv_run_refuse(const tkv_rows *j);
void tkv_run_free(tkv_run *r);
/* One chosen layer of *j, every token, on the calling thread; 0 or -1 (nothing copied). */
int tkv_rows_copy_layer(const tkv_rows *j, int64_t k);
#endif
