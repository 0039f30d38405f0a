/* HiSparse swap-in bookkeeping for one layer call (host/swap_plan.py): one pass over the
 * selected positions instead of a dozen numpy passes.
 *
 * index_of: position -> buffer index for this layer (-1: not resident; b: the newest token).
 * lru: last use per buffer index, b + 1 entries (entry b is never a victim).
 *
 * On success (returns 0): slot_of[i] = index_of[sel[i]] (-1 for a miss), every hit's lru entry
 * set to clock, missing[] the indices into sel of the misses, free[] the buffer indices in
 * [0, b) not used by this call (ascending), counts = {misses, newest hits, free}.
 * free must hold b entries (it also keeps the stamped entries' old values, to undo them).
 * On bad input nothing is changed and it returns 1 (a position outside [0, n)), 2 (a position
 * repeated) or 3 (more than b positions besides the newest token). */
#include <stdint.h>
#include <string.h>

int tkv_swap_plan(const int64_t *sel, int64_t k, int64_t n, int32_t *index_of, int64_t *lru,
                  int64_t b, int64_t clock, int32_t *slot_of, int64_t *missing, int64_t *free_out,
                  int64_t *counts) {
    for (int64_t i = 0; i < k; i++)
        if ((uint64_t)sel[i] >= (uint64_t)n) return 1;
    int64_t m = 0, newest = 0, hits = 0, bad = 0;
    for (int64_t i = 0; i < k; i++) {
        int32_t s = index_of[sel[i]];
        slot_of[i] = s;
        if (s < 0) {
            missing[m++] = i;
        } else if (s == b) {
            newest++;
        } else if (lru[s] == clock) {
            bad = 1; /* a position twice: its slot already stamped by this call */
            break;
        } else {
            free_out[hits++] = lru[s]; /* kept to undo the stamp on bad input */
            lru[s] = clock;
        }
    }
    if (!bad && newest > 1) bad = 1;
    if (!bad) { /* repeats among the misses: mark each through the map, then clear */
        int64_t j = 0;
        for (; j < m; j++) {
            int64_t p = sel[missing[j]];
            if (index_of[p] != -1) {
                bad = 1;
                break;
            }
            index_of[p] = -2;
        }
        for (int64_t q = 0; q < j; q++) index_of[sel[missing[q]]] = -1;
    }
    if (bad || k - newest > b) { /* undo the stamps, in order: the hits come first in sel */
        int64_t h = 0;
        for (int64_t i = 0; i < k && h < hits; i++) {
            int32_t s = slot_of[i];
            if (s >= 0 && s < b) lru[s] = free_out[h++];
        }
        counts[1] = newest;
        return bad ? 2 : 3;
    }
    int64_t f = 0;
    for (int64_t s = 0; s < b; s++)
        if (lru[s] != clock) free_out[f++] = s;
    counts[0] = m;
    counts[1] = newest;
    counts[2] = f;
    return 0;
}
