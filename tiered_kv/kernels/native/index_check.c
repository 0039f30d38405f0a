/* Index checks of a copy-engine job, in one pass per index array: every value in range and
 * none repeated, with a caller-owned zeroed bitmap that is left zeroed. */
#include <stdint.h>

static int64_t check_indices(const int64_t *idx, int64_t n, int64_t low, int64_t high,
                             uint8_t *seen) {
    int64_t bad = -1, i = 0;
    for (; i < n; i++) {
        int64_t v = idx[i];
        if (v < low || v >= high || (seen[v >> 3] >> (v & 7)) & 1) {
            bad = i;
            break;
        }
        seen[v >> 3] |= (uint8_t)(1u << (v & 7));
    }
    for (int64_t k = 0; k < i; k++) seen[idx[k] >> 3] = 0;
    return bad;
}

/* Validate a transfer's index pair and write each host token's layer-0 record offset in bytes
 * (token h: (h / page) * s_page + (h % page) * s_token elements). dev_seen 0 skips the device
 * check. Returns -1 when valid, else 0 for a bad host value, 1 for a bad device value. */
int64_t tkv_rows_prepare(const int64_t *host, const int64_t *dev, int64_t n, int64_t host_size,
                         int64_t dev_low, int64_t dev_high, uint8_t *host_seen,
                         uint8_t *dev_seen, int64_t page, int64_t s_page, int64_t s_token,
                         int64_t elt, int64_t *tok) {
    if (check_indices(host, n, 0, host_size, host_seen) >= 0) return 0;
    if (dev_seen && check_indices(dev, n, dev_low, dev_high, dev_seen) >= 0) return 1;
    for (int64_t i = 0; i < n; i++)
        tok[i] = ((host[i] / page) * s_page + (host[i] % page) * s_token) * elt;
    return -1;
}
