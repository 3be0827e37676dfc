/* Fused elementwise ops of a Llama decoder layer for CPUs, float32, row-major (T, ...):
 * RMSNorm, residual add + RMSNorm, rotary embedding in place, SiLU(gate) * up.
 *
 * Each replaces several torch ops that each walk the whole activation (and allocate a fresh
 * tensor, on CPU a fresh mapping for a prefill chunk) with one pass. Built by
 * kernels/cpu_native.py with -ffp-contract=off, so every multiply and add rounds as torch's
 * do; torch twins in kernels/cpu_ops.py. Rows are split across OpenMP threads when the
 * tensor is large enough to pay for the fork.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PAR_MIN 65536 /* elements; below this one thread is faster */

#if defined(KVMESH_LIBMVEC)
/* glibc's vector expf (libmvec), so the SiLU loop vectorises; cpu_native.py links -lmvec */
__attribute__((simd("notinbranch"))) float expf(float);
#endif

/* o = w * (x * (1 / sqrt(mean(x^2) + eps))), as HF's LlamaRMSNorm in float32 */
static inline void rms_row(const float *x, const float *w, float *o, int64_t H, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)H + eps);
#pragma omp simd
    for (int64_t i = 0; i < H; i++) o[i] = w[i] * (x[i] * r);
}

int kvmesh_rmsnorm_f32(const float *x, const float *w, float *out, int64_t T, int64_t H,
                       float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T * H >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) rms_row(x + t * H, w, out + t * H, H, eps);
    return 0;
}

/* x += y (the residual stream, in place), then out = rmsnorm(x) */
int kvmesh_add_rmsnorm_f32(float *x, const float *y, const float *w, float *out, int64_t T,
                           int64_t H, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T * H >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        float *xr = x + t * H;
        const float *yr = y + t * H;
#pragma omp simd
        for (int64_t i = 0; i < H; i++) xr[i] = xr[i] + yr[i];
        rms_row(xr, w, out + t * H, H, eps);
    }
    return 0;
}

/* Half-split rotary in place: x (T, heads, D) with row stride ld (elements), cos and a
 * signed sin [-s, s] (T, D). x*cos + rotate_half(x)*sin, the torch twin's order of ops. */
int kvmesh_rotary_f32(float *x, const float *cos_, const float *sin_, int64_t T, int64_t heads,
                      int64_t D, int64_t ld, int num_threads) {
    if (D > 1024 || D % 2) return 1;
    const int64_t h2 = D / 2;
#pragma omp parallel for num_threads(num_threads) if (T * heads * D >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_ + t * D, *s = sin_ + t * D;
        float a[1024];
        for (int64_t h = 0; h < heads; h++) {
            float *r = x + t * ld + h * D;
            memcpy(a, r, sizeof(float) * D);
#pragma omp simd
            for (int64_t i = 0; i < h2; i++) r[i] = a[i] * c[i] + a[i + h2] * s[i];
#pragma omp simd
            for (int64_t i = h2; i < D; i++) r[i] = a[i] * c[i] + a[i - h2] * s[i];
        }
    }
    return 0;
}

/* out (T, I) = silu(gate) * up, from gu (T, 2I) = [gate | up] */
int kvmesh_silu_mul_f32(const float *gu, float *out, int64_t T, int64_t I, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T * I >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------
 * Page payloads into the pool (a restore from the host tier, Redis or a peer): n copies of
 * page_nbytes, payload i from srcs[i] (any alignment) to pool + ids[i] * page_nbytes.
 *
 * The destination is written with non-temporal (streaming) stores where the build has them:
 * a restore writes tens of MB that no cache holds until the next step reads them, and a
 * plain store first reads each destination line in (a write-allocate), so a streamed copy
 * moves a third fewer bytes through memory: 1.7x faster than memcpy per page on 1 thread on
 * the Zen 4 dev VM (bench/README.md, issue 21). The bytes are the same either way.
 * ---------------------------------------------------------------------------------------- */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static void copy_streaming(uint8_t *dst, const uint8_t *src, int64_t n) {
#if defined(__AVX512F__) || defined(__AVX2__)
    /* up to the first 64-byte boundary of dst by memcpy, then whole 256-byte steps streamed,
     * the tail by memcpy */
    int64_t i = (int64_t)((64 - ((uintptr_t)dst & 63)) & 63);
    i = i < n ? i : n;
    memcpy(dst, src, (size_t)i);
    for (; i + 256 <= n; i += 256) {
#if defined(__AVX512F__)
        const __m512i a = _mm512_loadu_si512((const void *)(src + i));
        const __m512i b = _mm512_loadu_si512((const void *)(src + i + 64));
        const __m512i c = _mm512_loadu_si512((const void *)(src + i + 128));
        const __m512i d = _mm512_loadu_si512((const void *)(src + i + 192));
        _mm512_stream_si512((void *)(dst + i), a);
        _mm512_stream_si512((void *)(dst + i + 64), b);
        _mm512_stream_si512((void *)(dst + i + 128), c);
        _mm512_stream_si512((void *)(dst + i + 192), d);
#else
        for (int64_t j = 0; j < 256; j += 32)
            _mm256_stream_si256((__m256i *)(dst + i + j),
                                _mm256_loadu_si256((const __m256i *)(src + i + j)));
#endif
    }
    memcpy(dst + i, src + i, (size_t)(n - i));
    _mm_sfence(); /* this thread's streamed stores ordered before what follows (the join) */
#else
    memcpy(dst, src, (size_t)n);
#endif
}

/* Returns 0, or 2: a bad argument (n or page_nbytes negative, an id outside [0, num_pages)),
 * checked before any byte is written. */
int kvmesh_copy_pages(uint8_t *pool, int64_t num_pages, int64_t page_nbytes, const int64_t *ids,
                      const uint64_t *srcs, int64_t n, int num_threads) {
    if (n < 0 || page_nbytes < 0 || num_pages < 0) return 2;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= num_pages) return 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n > 1 && num_threads > 1)
    for (int64_t i = 0; i < n; i++)
        copy_streaming(pool + ids[i] * page_nbytes, (const uint8_t *)(uintptr_t)srcs[i],
                       page_nbytes);
    return 0;
}
