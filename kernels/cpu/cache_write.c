/* Scatter the new tokens' K and V rows into their paged-cache slots on CPU, one call per layer.
 *
 * Why: the torch reference is a mask, a check and two index_put ops per layer (~4-6 small
 * ops with their dispatch). Rows are copied as bytes, so any dtype the cache shares with
 * K/V works; a negative slot means padding (skipped), a slot past the cache is refused.
 * Built at first use by kernels/cpu/native_build.py; kernels/cpu/cache_write.py calls it.
 */
#include <stdint.h>
#include <string.h>

/* key/value: token t's row (kv_heads x head_dim values, contiguous) at base + t * stride bytes;
 * caches: rows of row_bytes by slot. Returns how many slots were past num_slots (nothing is
 * written then: every slot is checked first). */
int64_t write_kv_cache(const char* key, int64_t key_stride, const char* value, int64_t value_stride,
                       char* key_cache, char* value_cache, const int64_t* slots, int64_t tokens, int64_t row_bytes,
                       int64_t num_slots) {
    int64_t bad = 0;
    for (int64_t t = 0; t < tokens; ++t)
        bad += slots[t] >= num_slots;
    if (bad)
        return bad;
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0)
            continue;
        memcpy(key_cache + slot * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(value_cache + slot * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
    return 0;
}
