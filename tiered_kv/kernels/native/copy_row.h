/* One block copy shared by the block copier and the copy engine: memcpy, or non-temporal
 * stores (they bypass the cache: the bytes are not read again soon, and a read-for-ownership
 * of every destination line is avoided) when asked and the block is 16-byte aligned and a
 * whole number of 64-byte lines. The caller fences (_mm_sfence) before reporting completion. */
#ifndef TKV_COPY_ROW_H
#define TKV_COPY_ROW_H
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static inline void tkv_copy_row(char *d, const char *s, int64_t bytes, int nt) {
#if defined(__SSE2__)
    if (nt && ((uintptr_t)d & 15) == 0 && (bytes & 63) == 0) {
        for (int64_t i = 0; i < bytes; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
            _mm_stream_si128((__m128i *)(d + i), a);
            _mm_stream_si128((__m128i *)(d + i + 16), b);
            _mm_stream_si128((__m128i *)(d + i + 32), c);
            _mm_stream_si128((__m128i *)(d + i + 48), e);
        }
        return;
    }
#endif
    (void)nt;
    memcpy(d, s, (size_t)bytes);
}
#endif
