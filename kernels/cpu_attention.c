/* Paged decode attention for CPUs: one new query token per sequence against its cached
 * keys, read in place from the page pool through the block table (no gather copy).
 *
 * Built on first use by kernels/cpu_native.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes; its torch twin is kernels.decode_attention.paged_decode_attention_torch.
 *
 * Layout, in elements of the cache type T:
 *   q, out          (B, Hq, D) float32, contiguous
 *   k_cache/v_cache one layer's view: page p, slot t, KV head h, dim d at
 *                   p * page_stride + (t * Hkv + h) * D + d
 *   block_tables    (B, P) int64 page ids; context_lens (B,) int64
 * Keys are positions [lo, L) with L = context_lens[b] and lo = L - window when a window is
 * set. Offsets are int64.
 *
 * One OpenMP work item is a sequence. It walks its pages once, in order: for a page it
 * scores all of the page's keys for every query head (a KV head's row is loaded once for its
 * G query heads), folds them into a per-head online softmax, and adds the page's V rows.
 * Each page's K and V rows are consumed while hot, and the next page's rows are prefetched
 * into L2 as the current one is read: pages sit at random places in the pool, so without it
 * the loop waits on memory at every page. With AVX-512 and D a multiple of 16 (up to 256)
 * the math is vectorised by hand; elsewhere a plain two-pass loop runs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float ld1_f32(const float *p) { return *p; }
static inline float ld1_bf16(const uint16_t *p) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline float ld1_f16(const _Float16 *p) { return (float)*p; }

#if defined(__AVX512F__)
#define VEC_PATH 1
static inline __m512 ld16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 ld16_bf16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline __m512 ld16_f16(const _Float16 *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
#define MAX_CHUNKS 16 /* D <= 256 */
#else
#define VEC_PATH 0
#endif

/* Scratch per thread, in floats: scores (Hq, bs), accumulators (Hq, D), max and sum (Hq). */
#define WORK_FLOATS(Hq, D, bs) ((Hq) * (bs) + (Hq) * (D) + 2 * (Hq))

/* Per query head: running max m = -inf, sum l = 0, accumulator acc (Hq, D) = 0. */
static inline void start_softmax(float *acc, float *m, float *l, int64_t Hq, int64_t D) {
    for (int64_t g = 0; g < Hq; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * Hq * D);
}

/* out (Hq, D) = acc / l, per query head */
static inline void finish_softmax(const float *acc, const float *l, float *out, int64_t Hq,
                                  int64_t D) {
    for (int64_t g = 0; g < Hq; g++) {
        const float inv = 1.0f / l[g];
        for (int64_t d = 0; d < D; d++) out[g * D + d] = acc[g * D + d] * inv;
    }
}

/* Online softmax over one page's scores s (Hq, bs), nt valid: turns them into weights
 * relative to the running max m and rescales the accumulators when the max moves. */
static inline void fold_page(float *s, float *acc, float *m, float *l, int64_t Hq, int64_t D,
                             int64_t bs, int64_t nt) {
    for (int64_t g = 0; g < Hq; g++) {
        float *sg = s + g * bs;
        float mx = m[g];
        for (int64_t j = 0; j < nt; j++) mx = sg[j] > mx ? sg[j] : mx;
        const float corr = expf(m[g] - mx); /* 0 on the first page: m = -inf */
        float sum = 0.0f;
        for (int64_t j = 0; j < nt; j++) {
            sg[j] = expf(sg[j] - mx);
            sum += sg[j];
        }
        l[g] = l[g] * corr + sum;
        m[g] = mx;
        if (corr != 1.0f)
            for (int64_t d = 0; d < D; d++) acc[g * D + d] *= corr;
    }
}

#if VEC_PATH
#define DEFINE_SEQ_VEC(NAME, T, LD)                                                           \
    static inline __attribute__((always_inline)) void NAME(                                  \
        const float *qb, const T *k_cache, const T *v_cache, const int64_t *table,           \
        int64_t lo, int64_t L, float *ob, int64_t Hq, int64_t Hkv, const int64_t D,          \
        int64_t bs, int64_t page_stride, float scale, float *work) {                         \
        const int64_t C = D / 16, row = Hkv * D, G = Hq / Hkv;                               \
        float *s = work, *acc = s + Hq * bs, *m = acc + Hq * D, *l = m + Hq;                 \
        start_softmax(acc, m, l, Hq, D);                                                     \
        const int64_t first = lo / bs, last = (L - 1) / bs;                                  \
        for (int64_t pg = first; pg <= last; pg++) {                                         \
            const T *kp = k_cache + table[pg] * page_stride;                                 \
            const T *vp = v_cache + table[pg] * page_stride;                                 \
            const T *nk = pg < last ? k_cache + table[pg + 1] * page_stride : NULL;          \
            const T *nv = pg < last ? v_cache + table[pg + 1] * page_stride : NULL;          \
            const int64_t t0 = pg * bs > lo ? pg * bs : lo;                                  \
            const int64_t t1 = (pg + 1) * bs < L ? (pg + 1) * bs : L;                        \
            const int64_t nt = t1 - t0, j0 = t0 - pg * bs;                                   \
            const int64_t row_bytes = row * (int64_t)sizeof(T);                              \
            for (int64_t j = 0; j < nt; j++) {                                               \
                const T *kr = kp + (j0 + j) * row;                                           \
                if (nk)                                                                      \
                    for (int64_t off = 0; off < row_bytes; off += 64)                        \
                        _mm_prefetch((const char *)(nk + j * row) + off, _MM_HINT_T1);       \
                for (int64_t h = 0; h < Hkv; h++) {                                          \
                    __m512 kv[MAX_CHUNKS];                                                   \
                    for (int64_t c = 0; c < C; c++) kv[c] = LD(kr + h * D + 16 * c);         \
                    for (int64_t g = h * G; g < (h + 1) * G; g++) {                          \
                        const float *qr = qb + g * D;                                        \
                        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(qr), kv[0]);                \
                        for (int64_t c = 1; c < C; c++)                                      \
                            x = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * c), kv[c], x);     \
                        s[g * bs + j] = _mm512_reduce_add_ps(x) * scale;                     \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
            fold_page(s, acc, m, l, Hq, D, bs, nt);                                          \
            for (int64_t j = 0; j < nt; j++) {                                               \
                const T *vr = vp + (j0 + j) * row;                                           \
                if (nv)                                                                      \
                    for (int64_t off = 0; off < row_bytes; off += 64)                        \
                        _mm_prefetch((const char *)(nv + j * row) + off, _MM_HINT_T1);       \
                for (int64_t h = 0; h < Hkv; h++) {                                          \
                    __m512 vv[MAX_CHUNKS];                                                   \
                    for (int64_t c = 0; c < C; c++) vv[c] = LD(vr + h * D + 16 * c);         \
                    for (int64_t g = h * G; g < (h + 1) * G; g++) {                          \
                        const __m512 p = _mm512_set1_ps(s[g * bs + j]);                      \
                        float *ar = acc + g * D;                                             \
                        for (int64_t c = 0; c < C; c++)                                      \
                            _mm512_storeu_ps(ar + 16 * c, _mm512_fmadd_ps(                   \
                                p, vv[c], _mm512_loadu_ps(ar + 16 * c)));                    \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        finish_softmax(acc, l, ob, Hq, D);                                                   \
    }
DEFINE_SEQ_VEC(seq_vec_f32, float, ld16_f32)
DEFINE_SEQ_VEC(seq_vec_bf16, uint16_t, ld16_bf16)
DEFINE_SEQ_VEC(seq_vec_f16, _Float16, ld16_f16)
#endif

/* The portable path: the same walk and online softmax, scalar loops. */
#define DEFINE_SEQ_SCALAR(NAME, T, LD)                                                        \
    static void NAME(const float *qb, const T *k_cache, const T *v_cache,                    \
                     const int64_t *table, int64_t lo, int64_t L, float *ob, int64_t Hq,     \
                     int64_t Hkv, int64_t D, int64_t bs, int64_t page_stride, float scale,   \
                     float *work) {                                                          \
        const int64_t row = Hkv * D, G = Hq / Hkv;                                           \
        float *s = work, *acc = s + Hq * bs, *m = acc + Hq * D, *l = m + Hq;                 \
        start_softmax(acc, m, l, Hq, D);                                                     \
        for (int64_t pg = lo / bs; pg <= (L - 1) / bs; pg++) {                               \
            const T *kp = k_cache + table[pg] * page_stride;                                 \
            const T *vp = v_cache + table[pg] * page_stride;                                 \
            const int64_t t0 = pg * bs > lo ? pg * bs : lo;                                  \
            const int64_t t1 = (pg + 1) * bs < L ? (pg + 1) * bs : L;                        \
            const int64_t nt = t1 - t0, j0 = t0 - pg * bs;                                   \
            for (int64_t j = 0; j < nt; j++)                                                 \
                for (int64_t g = 0; g < Hq; g++) {                                           \
                    const T *kr = kp + (j0 + j) * row + (g / G) * D;                         \
                    float dot = 0.0f;                                                        \
                    for (int64_t d = 0; d < D; d++) dot += qb[g * D + d] * LD(kr + d);       \
                    s[g * bs + j] = dot * scale;                                             \
                }                                                                            \
            fold_page(s, acc, m, l, Hq, D, bs, nt);                                          \
            for (int64_t j = 0; j < nt; j++)                                                 \
                for (int64_t g = 0; g < Hq; g++) {                                           \
                    const T *vr = vp + (j0 + j) * row + (g / G) * D;                         \
                    const float p = s[g * bs + j];                                           \
                    for (int64_t d = 0; d < D; d++) acc[g * D + d] += p * LD(vr + d);        \
                }                                                                            \
        }                                                                                    \
        finish_softmax(acc, l, ob, Hq, D);                                                   \
    }
DEFINE_SEQ_SCALAR(seq_scalar_f32, float, ld1_f32)
DEFINE_SEQ_SCALAR(seq_scalar_bf16, uint16_t, ld1_bf16)
DEFINE_SEQ_SCALAR(seq_scalar_f16, _Float16, ld1_f16)

#if VEC_PATH
/* D = 64 and 128 get their own instances, so the chunk loops unroll with constant trips. */
#define CALL_SEQ(SUFFIX)                                                                      \
    do {                                                                                      \
        if (D == 64)                                                                          \
            seq_vec_##SUFFIX(qb, k_cache, v_cache, table, lo, L, ob, Hq, Hkv, 64, bs,         \
                             page_stride, scale, work);                                       \
        else if (D == 128)                                                                    \
            seq_vec_##SUFFIX(qb, k_cache, v_cache, table, lo, L, ob, Hq, Hkv, 128, bs,        \
                             page_stride, scale, work);                                       \
        else if (D % 16 == 0 && D <= 16 * MAX_CHUNKS)                                         \
            seq_vec_##SUFFIX(qb, k_cache, v_cache, table, lo, L, ob, Hq, Hkv, D, bs,          \
                             page_stride, scale, work);                                       \
        else                                                                                  \
            seq_scalar_##SUFFIX(qb, k_cache, v_cache, table, lo, L, ob, Hq, Hkv, D, bs,       \
                                page_stride, scale, work);                                    \
    } while (0)
#else
#define CALL_SEQ(SUFFIX)                                                                      \
    seq_scalar_##SUFFIX(qb, k_cache, v_cache, table, lo, L, ob, Hq, Hkv, D, bs, page_stride,  \
                        scale, work)
#endif

/* Returns 0, or 1 when a thread could not allocate its scratch (out is then incomplete). */
#define DEFINE_DECODE(NAME, T, SUFFIX)                                                        \
    int NAME(const float *q, const T *k_cache, const T *v_cache, const int64_t *block_tables, \
             const int64_t *context_lens, float *out, int64_t B, int64_t P, int64_t Hq,       \
             int64_t Hkv, int64_t D, int64_t bs, int64_t page_stride, float scale,            \
             int64_t window, int num_threads) {                                               \
        int failed = 0;                                                                       \
        _Pragma("omp parallel num_threads(num_threads)") {                                   \
            float *work = malloc(sizeof(float) * WORK_FLOATS(Hq, D, bs));                     \
            if (work == NULL) {                                                               \
                _Pragma("omp atomic write") failed = 1;                                       \
            }                                                                                 \
            _Pragma("omp for schedule(dynamic, 1)")                                          \
            for (int64_t b = 0; b < B; b++) {                                                 \
                const int64_t L = context_lens[b];                                            \
                const int64_t lo = (window > 0 && L > window) ? L - window : 0;               \
                const float *qb = q + b * Hq * D;                                             \
                float *ob = out + b * Hq * D;                                                 \
                const int64_t *table = block_tables + b * P;                                  \
                if (work == NULL) continue;                                                   \
                if (L <= lo) {                                                                \
                    memset(ob, 0, sizeof(float) * Hq * D);                                    \
                    continue;                                                                 \
                }                                                                             \
                CALL_SEQ(SUFFIX);                                                             \
            }                                                                                 \
            free(work);                                                                       \
        }                                                                                     \
        return failed;                                                                        \
    }

DEFINE_DECODE(kvmesh_decode_attention_f32, float, f32)
DEFINE_DECODE(kvmesh_decode_attention_bf16, uint16_t, bf16)
DEFINE_DECODE(kvmesh_decode_attention_f16, _Float16, f16)

/* The ABI version kernels/cpu_native.py checks, bumped with any signature change. */
int kvmesh_cpu_abi(void) { return 2; }

/* Whether this build has the hand-vectorised path (for tests and logs). */
int kvmesh_cpu_attention_vectorized(void) { return VEC_PATH; }
