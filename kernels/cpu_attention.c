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
 * One OpenMP work item is a sequence (with fewer than two sequences per thread, a part of
 * a sequence's pages: see seq_parts). It walks its pages once, in order: for a page it
 * scores all of the page's keys for every query head (a KV head's row is loaded once for its
 * G query heads), folds them into a per-head online softmax, and adds the page's V rows.
 * Each page's K and V rows are consumed while hot, and the next page's rows are prefetched
 * into L2 as the current one is read: pages sit at random places in the pool, so without it
 * the loop waits on memory at every page. The math is vectorised by hand, chosen at build
 * time: AVX-512 (16 floats) where the compiler targets it, else AVX2 with FMA and F16C (8
 * floats), for head sizes a multiple of the width up to 256; elsewhere a scalar loop runs.
 * Quantized pages: fp8 and int8 (and int4 on scalar builds or head sizes off the vector
 * width) are dequantized a page at a time into a float scratch (a page of K and V: L1-sized
 * for small heads, not for large Hkv * D * bs) and run through the same float page step;
 * int4 on the vector builds folds its key scales into q instead and dequantizes values in
 * registers (see page_int4_vec and, for D % 32 == 0, page_int4_fast).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(KVMESH_LIBMVEC)
/* glibc's vector expf (libmvec), so the scalar build's softmax exp loop vectorises where the
 * compiler can (as in cpu_ops.c); the vector builds use an inline polynomial (dec_exp) */
__attribute__((simd("notinbranch"))) float expf(float);
#endif

static inline float ld1_f32(const float *p) { return *p; }
static inline float ld1_bf16(const uint16_t *p) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline float ld1_f16(const _Float16 *p) { return (float)*p; }

/* The vector path, chosen at build time: AVX-512 (16 floats), else AVX2 + FMA + F16C (8),
 * else none. VF is the vector type, VW its width, V* the few operations the kernel uses. */
#if defined(__AVX512F__)
#define VEC_PATH 512
#define VW 16
typedef __m512 VF;
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VMUL _mm512_mul_ps
#define VFMA _mm512_fmadd_ps
#define VSET1 _mm512_set1_ps
#define VSUM _mm512_reduce_add_ps
#define VADD _mm512_add_ps
static inline VF ldv_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline VF ldv_bf16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline VF ldv_f16(const _Float16 *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VEC_PATH 256
#define VW 8
typedef __m256 VF;
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VMUL _mm256_mul_ps
#define VFMA _mm256_fmadd_ps
#define VSET1 _mm256_set1_ps
#define VADD _mm256_add_ps
static inline float VSUM(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline VF ldv_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline VF ldv_bf16(const uint16_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline VF ldv_f16(const _Float16 *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
#else
#define VEC_PATH 0
#define VW 1
#endif
#define MAX_CHUNKS (256 / VW) /* D <= 256 on the vector path */

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

/* Work items. A sequence is one item when there are at least two sequences per thread;
 * with fewer, each sequence's pages are cut into S parts (items of their own) so every thread
 * has work, each part ends with its online-softmax state (unnormalised accumulators, max,
 * sum) in a buffer of PART_FLOATS, and the parts of a sequence are merged at the end. */
#define PART_FLOATS(Hq, D) ((Hq) * (D) + 2 * (Hq))

static int64_t seq_parts(int64_t B, int num_threads, const int64_t *context_lens, int64_t bs,
                         int64_t window) {
    if (num_threads <= 1 || B >= 2 * num_threads) return 1;
    int64_t span = 0; /* the most keys a sequence reads */
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = context_lens[b], n = (window > 0 && L > window) ? window : L;
        span = n > span ? n : span;
    }
    const int64_t S = (2 * num_threads + B - 1) / B, cap = span / (4 * bs); /* >= 4 pages */
    return S < cap ? S : (cap > 1 ? cap : 1);
}

/* Part p of S of the pages [first, last]: [*pa, *pb], empty when *pa > *pb. */
static inline void part_range(int64_t first, int64_t last, int64_t p, int64_t S, int64_t *pa,
                              int64_t *pb) {
    const int64_t n = last - first + 1;
    *pa = first + n * p / S;
    *pb = first + n * (p + 1) / S - 1;
}

/* A sequence's (or part's) end: the normalised output into ob, or with part != NULL its
 * state into part. */
static inline void end_part(const float *acc, const float *m, const float *l, float *ob,
                            float *part, int64_t Hq, int64_t D) {
    if (part == NULL) {
        finish_softmax(acc, l, ob, Hq, D);
        return;
    }
    memcpy(part, acc, sizeof(float) * Hq * D);
    memcpy(part + Hq * D, m, sizeof(float) * Hq);
    memcpy(part + Hq * D + Hq, l, sizeof(float) * Hq);
}

/* out (Hq, D) of one sequence from its S parts' states */
static void merge_parts(const float *parts, int64_t S, float *ob, int64_t Hq, int64_t D) {
    const int64_t n = PART_FLOATS(Hq, D);
    for (int64_t g = 0; g < Hq; g++) {
        float M = -INFINITY, sum = 0.0f;
        for (int64_t p = 0; p < S; p++) M = fmaxf(M, parts[p * n + Hq * D + g]);
        float *o = ob + g * D;
        memset(o, 0, sizeof(float) * D);
        for (int64_t p = 0; p < S; p++) {
            const float *ps = parts + p * n;
            if (ps[Hq * D + g] == -INFINITY) continue; /* an empty part */
            const float w = expf(ps[Hq * D + g] - M);
            sum += w * ps[Hq * D + Hq + g];
            for (int64_t d = 0; d < D; d++) o[d] += w * ps[g * D + d];
        }
        const float inv = 1.0f / sum;
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
}

/* Every split sequence's output from its parts; frees parts (NULL: nothing was split). */
static void merge_all(float *parts, int64_t S, const int64_t *context_lens, int64_t window,
                      float *out, int64_t B, int64_t Hq, int64_t D, int failed) {
    if (parts == NULL) return;
    for (int64_t b = 0; b < B && !failed; b++) {
        const int64_t L = context_lens[b];
        if (L > ((window > 0 && L > window) ? L - window : 0))
            merge_parts(parts + b * S * PART_FLOATS(Hq, D), S, out + b * Hq * D, Hq, D);
    }
    free(parts);
}

/* The vector helpers shared by the decode softmax and the prefill kernels (below): 2^x by
 * a polynomial, masks, horizontal max. */
#if VEC_PATH
#define PF_MR 6 /* query rows per micro-tile, both prefill kernels (causal and runs) */
/* 2^f on [-0.5, 0.5]: a degree-5 polynomial fitted to the relative error (~8e-8, ~2.4e-7
 * with float rounding in Horner's scheme; a softmax weight needs no more) */
#define PF_E0 1.0000000710925994f
#define PF_E1 0.6931469679132952f
#define PF_E2 0.24022122257247966f
#define PF_E3 0.05550713273564509f
#define PF_E4 0.00967541348947018f
#define PF_E5 0.001327609911516945f
static inline VF pf_poly(VF f) { /* 2^f, |f| <= 0.5, by Horner's scheme */
    VF p = VSET1(PF_E5);
    p = VFMA(p, f, VSET1(PF_E4));
    p = VFMA(p, f, VSET1(PF_E3));
    p = VFMA(p, f, VSET1(PF_E2));
    p = VFMA(p, f, VSET1(PF_E1));
    return VFMA(p, f, VSET1(PF_E0));
}
#if VEC_PATH == 512
#define PF_NV 4  /* QK^T: 4 x 16 keys per micro-tile (24 accumulators) */
#define PF_NVD 4 /* PV: 4 x 16 dims of O per micro-tile (24 accumulators) */
#define VZERO _mm512_setzero_ps
#define VMAXV _mm512_max_ps
#define VSUB _mm512_sub_ps
static inline VF pf_keep_lt(VF x, int64_t lim, VF fill) { /* lanes >= lim -> fill */
    const __mmask16 m = lim >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (lim > 0 ? lim : 0)) - 1);
    return _mm512_mask_blend_ps(m, fill, x);
}
static inline float pf_hmax(VF x) { return _mm512_reduce_max_ps(x); }
static inline VF pf_exp2(VF x) { /* 2^x for x <= 0; 0 below -126 (and for -inf) */
    const __mmask16 ok = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
    const VF xc = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
#if defined(__AVX512DQ__)
    /* f = xc - nearest(xc) in one instruction (exact), nf = the integer part (exact) */
    const VF f = _mm512_reduce_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const VF nf = _mm512_sub_ps(xc, f);
#else
    const VF nf = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const VF f = _mm512_sub_ps(xc, nf);
#endif
    const VF p = pf_poly(f);
    return _mm512_maskz_scalef_ps(ok, p, nf); /* p * 2^nf, exact; 0 where x < -126 */
}
#else
#define PF_NV 2  /* QK^T: 2 x 8 keys (12 accumulators of 16 registers) */
#define PF_NVD 2 /* PV: 2 x 8 dims of O */
#define VZERO _mm256_setzero_ps
#define VMAXV _mm256_max_ps
#define VSUB _mm256_sub_ps
static inline VF pf_keep_lt(VF x, int64_t lim, VF fill) {
    const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 m = _mm256_cmp_ps(iota, _mm256_set1_ps((float)(lim > 8 ? 8 : lim)), _CMP_LT_OQ);
    return _mm256_blendv_ps(fill, x, m);
}
static inline float pf_hmax(VF x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline VF pf_exp2(VF x) {
    const __m256 ok = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_GE_OQ);
    const VF xc = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    const VF nf = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const VF f = _mm256_sub_ps(xc, nf);
    const VF p = pf_poly(f);
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(nf), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), ok);
}
#endif
#endif

/* Online softmax over one page's scores s (Hq, bs), nt valid: turns them into weights
 * relative to the running max m and rescales the accumulators when the max moves.
 * The vector builds take e^x as 2^(x log2 e) by pf_exp2, inline (a call to libmvec's expf
 * spills the caller's vector registers; its scalar expf for the correction cost as much as
 * a head's whole row), VW heads' corrections in one vector. Against expf: ~3e-7 relative
 * near the max, growing with |x| (the product x log2 e rounds: ~|x| 6e-8), and 0 below
 * x = -87 where expf returns denormals; e^0 is 1 + 1.2e-7, so a correction whose max did not
 * move is set to exactly 1. A NaN score stays NaN, as with expf. */
#if VEC_PATH
static inline VF dec_exp(VF x) { /* e^x for x <= 0; NaN stays NaN */
    const VF r = pf_exp2(VMUL(x, VSET1(1.4426950408889634f)));
#if VEC_PATH == 512
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, x);
#else
    return _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
#endif
}
static inline VF ld_first(const float *p, int64_t n, VF fill) { /* lanes >= n: fill */
#if VEC_PATH == 512
    return _mm512_mask_loadu_ps(fill, (__mmask16)((1u << n) - 1), p);
#else
    const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_blendv_ps(fill, _mm256_maskload_ps(p, k), _mm256_castsi256_ps(k));
#endif
}
static inline void st_first(float *p, int64_t n, VF x) { /* lanes < n only */
#if VEC_PATH == 512
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), x);
#else
    const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_maskstore_ps(p, k, x);
#endif
}
#endif

static inline void fold_page(float *s, float *acc, float *m, float *l, int64_t Hq, int64_t D,
                             int64_t bs, int64_t nt) {
#if VEC_PATH
    const VF ninf = VSET1(-INFINITY), zero = VSET1(0.0f);
    for (int64_t g0 = 0; g0 < Hq; g0 += VW) {
        const int64_t ng = Hq - g0 < VW ? Hq - g0 : VW;
        float mn[VW], cr[VW];
        for (int64_t i = 0; i < ng; i++) { /* the new max (a NaN score is skipped, as before) */
            const float *sg = s + (g0 + i) * bs;
            VF mv = ninf;
            int64_t j = 0;
            for (; j + VW <= nt; j += VW) mv = VMAXV(VLOAD(sg + j), mv);
            if (j < nt) mv = VMAXV(ld_first(sg + j, nt - j, ninf), mv);
            const float mx = pf_hmax(mv);
            mn[i] = mx > m[g0 + i] ? mx : m[g0 + i];
        }
        /* the corrections e^(m - mn): 0 on the first page (m = -inf), 1 where m stays */
        VSTORE(cr, dec_exp(VSUB(ld_first(m + g0, ng, zero), ld_first(mn, ng, zero))));
        for (int64_t i = 0; i < ng; i++) {
            const int64_t g = g0 + i;
            float *sg = s + g * bs;
            const float corr = m[g] == mn[i] ? 1.0f : cr[i];
            const VF mx = VSET1(mn[i]);
            VF sum = zero;
            int64_t j = 0;
            for (; j + VW <= nt; j += VW) {
                const VF e = dec_exp(VSUB(VLOAD(sg + j), mx));
                VSTORE(sg + j, e);
                sum = VADD(sum, e);
            }
            if (j < nt) {
                const VF e = pf_keep_lt(dec_exp(VSUB(ld_first(sg + j, nt - j, mx), mx)), nt - j, zero);
                st_first(sg + j, nt - j, e);
                sum = VADD(sum, e);
            }
            l[g] = l[g] * corr + VSUM(sum);
            m[g] = mn[i];
            if (corr != 1.0f)
                for (int64_t d = 0; d < D; d++) acc[g * D + d] *= corr;
        }
    }
#else
    for (int64_t g = 0; g < Hq; g++) {
        float *sg = s + g * bs;
        float mx = m[g];
#pragma omp simd reduction(max : mx)
        for (int64_t j = 0; j < nt; j++) mx = sg[j] > mx ? sg[j] : mx;
        const float corr = expf(m[g] - mx); /* 0 on the first page: m = -inf */
#pragma omp simd
        for (int64_t j = 0; j < nt; j++) sg[j] = expf(sg[j] - mx); /* libmvec: vectorised */
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < nt; j++) sum += sg[j];
        l[g] = l[g] * corr + sum;
        m[g] = mx;
        if (corr != 1.0f)
            for (int64_t d = 0; d < D; d++) acc[g * D + d] *= corr;
    }
#endif
}

/* One page's contribution: rows kp[j * row], vp[j * row] for j < nt (the page's valid
 * keys, already offset to the first), scored for every query head, folded into the online
 * softmax, and their V rows added. nk/nv: the next page's first rows to prefetch, or NULL. */
#if VEC_PATH
#define DEFINE_PAGE_VEC(NAME, T, LD)                                                          \
    static inline __attribute__((always_inline)) void NAME(                                  \
        const float *qb, const T *kp, const T *vp, const T *nk, const T *nv, int64_t nt,     \
        float *s, float *acc, float *m, float *l, int64_t Hq, int64_t Hkv, const int64_t D,  \
        int64_t bs, float scale) {                                                           \
        const int64_t C = D / VW, row = Hkv * D, G = Hq / Hkv;                               \
        const int64_t row_bytes = row * (int64_t)sizeof(T);                                  \
        for (int64_t j = 0; j < nt; j++) {                                                   \
            const T *kr = kp + j * row;                                                      \
            if (nk)                                                                          \
                for (int64_t off = 0; off < row_bytes; off += 64)                            \
                    __builtin_prefetch((const char *)(nk + j * row) + off, 0, 2);            \
            for (int64_t h = 0; h < Hkv; h++) {                                              \
                VF kv[MAX_CHUNKS];                                                           \
                for (int64_t c = 0; c < C; c++) kv[c] = LD(kr + h * D + VW * c);             \
                for (int64_t g = h * G; g < (h + 1) * G; g++) {                              \
                    const float *qr = qb + g * D;                                            \
                    VF x = VMUL(VLOAD(qr), kv[0]);                                           \
                    for (int64_t c = 1; c < C; c++) x = VFMA(VLOAD(qr + VW * c), kv[c], x);  \
                    s[g * bs + j] = VSUM(x) * scale;                                         \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        fold_page(s, acc, m, l, Hq, D, bs, nt);                                              \
        for (int64_t j = 0; j < nt; j++) {                                                   \
            const T *vr = vp + j * row;                                                      \
            if (nv)                                                                          \
                for (int64_t off = 0; off < row_bytes; off += 64)                            \
                    __builtin_prefetch((const char *)(nv + j * row) + off, 0, 2);            \
            for (int64_t h = 0; h < Hkv; h++) {                                              \
                VF vv[MAX_CHUNKS];                                                           \
                for (int64_t c = 0; c < C; c++) vv[c] = LD(vr + h * D + VW * c);             \
                for (int64_t g = h * G; g < (h + 1) * G; g++) {                              \
                    const VF p = VSET1(s[g * bs + j]);                                       \
                    float *ar = acc + g * D;                                                 \
                    for (int64_t c = 0; c < C; c++)                                          \
                        VSTORE(ar + VW * c, VFMA(p, vv[c], VLOAD(ar + VW * c)));             \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }
DEFINE_PAGE_VEC(page_vec_f32, float, ldv_f32)
DEFINE_PAGE_VEC(page_vec_bf16, uint16_t, ldv_bf16)
DEFINE_PAGE_VEC(page_vec_f16, _Float16, ldv_f16)
#endif

/* The portable page step: the same math, scalar loops (two passes over the page). */
#define DEFINE_PAGE_SCALAR(NAME, T, LD)                                                       \
    static void NAME(const float *qb, const T *kp, const T *vp, const T *nk, const T *nv,    \
                     int64_t nt, float *s, float *acc, float *m, float *l, int64_t Hq,       \
                     int64_t Hkv, int64_t D, int64_t bs, float scale) {                      \
        (void)nk;                                                                            \
        (void)nv;                                                                            \
        const int64_t row = Hkv * D, G = Hq / Hkv;                                           \
        for (int64_t j = 0; j < nt; j++)                                                     \
            for (int64_t g = 0; g < Hq; g++) {                                               \
                const T *kr = kp + j * row + (g / G) * D;                                    \
                float dot = 0.0f;                                                            \
                for (int64_t d = 0; d < D; d++) dot += qb[g * D + d] * LD(kr + d);           \
                s[g * bs + j] = dot * scale;                                                 \
            }                                                                                \
        fold_page(s, acc, m, l, Hq, D, bs, nt);                                              \
        for (int64_t j = 0; j < nt; j++)                                                     \
            for (int64_t g = 0; g < Hq; g++) {                                               \
                const T *vr = vp + j * row + (g / G) * D;                                    \
                const float p = s[g * bs + j];                                               \
                for (int64_t d = 0; d < D; d++) acc[g * D + d] += p * LD(vr + d);            \
            }                                                                                \
    }
DEFINE_PAGE_SCALAR(page_scalar_f32, float, ld1_f32)
DEFINE_PAGE_SCALAR(page_scalar_bf16, uint16_t, ld1_bf16)
DEFINE_PAGE_SCALAR(page_scalar_f16, _Float16, ld1_f16)

/* Whether head size D takes the vector path. */
static inline int vec_ok(int64_t D) { return VEC_PATH && D % VW == 0 && D <= VW * MAX_CHUNKS; }

/* One page step with D as a compile-time constant for the common head sizes (64, 128), so the
 * chunk loops unroll; other sizes a multiple of the vector width run the generic instance,
 * the rest the scalar step. */
#if VEC_PATH
#define PAGE_STEP(SUFFIX, ...)                                                                \
    do {                                                                                      \
        if (D == 64)                                                                          \
            page_vec_##SUFFIX(qb, __VA_ARGS__, s, acc, m, l, Hq, Hkv, 64, bs, scale);         \
        else if (D == 128)                                                                    \
            page_vec_##SUFFIX(qb, __VA_ARGS__, s, acc, m, l, Hq, Hkv, 128, bs, scale);        \
        else if (vec_ok(D))                                                                   \
            page_vec_##SUFFIX(qb, __VA_ARGS__, s, acc, m, l, Hq, Hkv, D, bs, scale);          \
        else                                                                                  \
            page_scalar_##SUFFIX(qb, __VA_ARGS__, s, acc, m, l, Hq, Hkv, D, bs, scale);       \
    } while (0)
#else
#define PAGE_STEP(SUFFIX, ...)                                                                \
    page_scalar_##SUFFIX(qb, __VA_ARGS__, s, acc, m, l, Hq, Hkv, D, bs, scale)
#endif

/* Float pages: walk a sequence's pages in place. */
#define DEFINE_SEQ(NAME, T, SUFFIX)                                                           \
    static void NAME(const float *qb, const T *k_cache, const T *v_cache,                    \
                     const int64_t *table, int64_t lo, int64_t L, int64_t first,             \
                     int64_t last, float *ob, float *part, int64_t Hq, int64_t Hkv,          \
                     int64_t D, int64_t bs, int64_t page_stride, float scale, float *work) { \
        const int64_t row = Hkv * D;                                                         \
        float *s = work, *acc = s + Hq * bs, *m = acc + Hq * D, *l = m + Hq;                 \
        start_softmax(acc, m, l, Hq, D);                                                     \
        for (int64_t pg = first; pg <= last; pg++) {                                         \
            const int64_t t0 = pg * bs > lo ? pg * bs : lo;                                  \
            const int64_t t1 = (pg + 1) * bs < L ? (pg + 1) * bs : L;                        \
            const int64_t nt = t1 - t0, j0 = t0 - pg * bs;                                   \
            const T *kp = k_cache + table[pg] * page_stride + j0 * row;                      \
            const T *vp = v_cache + table[pg] * page_stride + j0 * row;                      \
            const T *nk = pg < last ? k_cache + table[pg + 1] * page_stride : NULL;          \
            const T *nv = pg < last ? v_cache + table[pg + 1] * page_stride : NULL;          \
            PAGE_STEP(SUFFIX, kp, vp, nk, nv, nt);                                           \
        }                                                                                    \
        end_part(acc, m, l, ob, part, Hq, D);                                                \
    }
DEFINE_SEQ(seq_f32, float, f32)
DEFINE_SEQ(seq_bf16, uint16_t, bf16)
DEFINE_SEQ(seq_f16, _Float16, f16)

/* Returns 0, or 1 when a thread could not allocate its scratch (out is then incomplete). */
#define DEFINE_DECODE(NAME, T, SUFFIX)                                                        \
    int NAME(const float *q, const T *k_cache, const T *v_cache, const int64_t *block_tables, \
             const int64_t *context_lens, float *out, int64_t B, int64_t P, int64_t Hq,       \
             int64_t Hkv, int64_t D, int64_t bs, int64_t page_stride, float scale,            \
             int64_t window, int num_threads) {                                               \
        int failed = 0;                                                                       \
        const int64_t S = seq_parts(B, num_threads, context_lens, bs, window);                \
        float *parts = NULL;                                                                  \
        if (S > 1 && (parts = malloc(sizeof(float) * B * S * PART_FLOATS(Hq, D))) == NULL)    \
            return 1;                                                                         \
        _Pragma("omp parallel num_threads(num_threads)") {                                   \
            float *work = malloc(sizeof(float) * WORK_FLOATS(Hq, D, bs));                     \
            if (work == NULL) {                                                               \
                _Pragma("omp atomic write") failed = 1;                                       \
            }                                                                                 \
            _Pragma("omp for schedule(dynamic, 1)")                                          \
            for (int64_t it = 0; it < B * S; it++) {                                          \
                const int64_t b = it / S, L = context_lens[b];                                \
                const int64_t lo = (window > 0 && L > window) ? L - window : 0;               \
                float *ob = out + b * Hq * D;                                                 \
                if (work == NULL) continue;                                                   \
                if (L <= lo) {                                                                \
                    memset(ob, 0, sizeof(float) * Hq * D);                                    \
                    continue;                                                                 \
                }                                                                             \
                int64_t pa, pb;                                                               \
                part_range(lo / bs, (L - 1) / bs, it % S, S, &pa, &pb);                       \
                seq_##SUFFIX(q + b * Hq * D, k_cache, v_cache, block_tables + b * P, lo, L,   \
                             pa, pb, ob, S > 1 ? parts + it * PART_FLOATS(Hq, D) : NULL, Hq,  \
                             Hkv, D, bs, page_stride, scale, work);                           \
            }                                                                                 \
            free(work);                                                                       \
        }                                                                                     \
        merge_all(parts, S, context_lens, window, out, B, Hq, D, failed);                     \
        return failed;                                                                        \
    }

DEFINE_DECODE(kvmesh_decode_attention_f32, float, f32)
DEFINE_DECODE(kvmesh_decode_attention_bf16, uint16_t, bf16)
DEFINE_DECODE(kvmesh_decode_attention_f16, _Float16, f16)

/* ------------------------------------------------------------------------------------------
 * Quantized pages (fp8, int8, int4; byte layout: kernels/quant.py, kernels/page_format.py).
 *
 * Every component of a page is dense and sits at the same byte stride from page to page (the
 * pool is one uint8 tensor, page-major), so a component is a base pointer plus page * stride.
 * fp8/int8 pages (and int4 pages where the int4 vector step does not run: scalar builds, head
 * sizes off the vector width) have their valid rows dequantized into a float scratch of
 * (bs, Hkv, D) per K and V, in each thread's heap work area (L1-sized only for small pages),
 * and the float page step runs over it: the pool is read once, as stored (an int4 page is a
 * sixth of an fp32 one), and nothing is written back. The pages a sequence's residual slots
 * name (its last W pages, or fewer) are read from the fp32 residual (R, bs, Hkv, D) instead. This
 * dequantization is the torch twin's arithmetic (q * scale [+ zero], two roundings), so the
 * dequantized rows are bit-equal to the twin's; the attention over them then differs by
 * float rounding (sum order). int4 on the vector builds (page_int4_vec) folds the scales into
 * q and the softmax weights instead: equal to the twin within float rounding, not bit-equal.
 */
enum { QFMT_FP8 = 1, QFMT_INT8 = 2, QFMT_INT4 = 3 };

static float fp8_lut[256]; /* float8_e4m3fn byte -> float, filled once */
static void fill_fp8_lut(void) {
    for (int b = 0; b < 256; b++) {
        const int sign = b >> 7, e = (b >> 3) & 15, mant = b & 7;
        float v;
        if (e == 15 && mant == 7)
            v = NAN;
        else if (e == 0)
            v = ldexpf((float)mant / 8.0f, -6);
        else
            v = ldexpf(1.0f + (float)mant / 8.0f, e - 7);
        fp8_lut[b] = sign ? -v : v;
    }
}

/* n packed int4 bytes -> 2n float codes in [0, 15], element 2j from byte j's low nibble. */
static inline void int4_codes(const uint8_t *src, int64_t n, float *dst) {
    int64_t j = 0;
#if VEC_PATH
    const __m128i mask = _mm_set1_epi8(15);
    for (; j + 16 <= n; j += 16) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(src + j));
        const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
        const __m128i e0 = _mm_unpacklo_epi8(lo, hi), e1 = _mm_unpackhi_epi8(lo, hi);
        float *o = dst + 2 * j;
#if VEC_PATH == 512
        _mm512_storeu_ps(o, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(e0)));
        _mm512_storeu_ps(o + 16, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(e1)));
#else
        _mm256_storeu_ps(o, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(e0)));
        _mm256_storeu_ps(o + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(e0, 8))));
        _mm256_storeu_ps(o + 16, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(e1)));
        _mm256_storeu_ps(o + 24, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(e1, 8))));
#endif
    }
#endif
    for (; j < n; j++) {
        dst[2 * j] = (float)(src[j] & 15);
        dst[2 * j + 1] = (float)(src[j] >> 4);
    }
}

#if VEC_PATH
/* A row of D int4 codes (D % 32 == 0) straight into D / VW float vectors, no store. */
static inline void int4_vecs(const uint8_t *src, int64_t D, VF *out) {
    const __m128i mask = _mm_set1_epi8(15);
    for (int64_t j = 0; j < D / 2; j += 16) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(src + j));
        const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
        const __m128i e0 = _mm_unpacklo_epi8(lo, hi), e1 = _mm_unpackhi_epi8(lo, hi);
        VF *o = out + (2 * j) / VW;
#if VEC_PATH == 512
        o[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(e0));
        o[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(e1));
#else
        o[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(e0));
        o[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(e0, 8)));
        o[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(e1));
        o[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(e1, 8)));
#endif
    }
}

/* D / VW vectors of the codes of one row: widened in registers when D % 32 == 0, else through
 * the codes scratch in memory. */
static inline void int4_row(const uint8_t *src, int64_t D, float *codes, VF *out) {
    if (D % 32 == 0) {
        int4_vecs(src, D, out);
        return;
    }
    int4_codes(src, D / 2, codes);
    for (int64_t c = 0; c < D / VW; c++) out[c] = VLOAD(codes + VW * c);
}
#endif

typedef struct {
    const uint8_t *k, *ks, *kz, *v, *vs, *vz; /* component bases (page 0) */
    int64_t stride;                           /* bytes from one page to the next */
} qpages;

/* Prefetching a quantized page ahead of the step that reads it. Part i of n of a page's
 * cache lines: the page steps spread the prefetches of the page QPF - 1 ahead over their
 * loops (the int4 vector steps a slice per four-token score block or per token for K and
 * per KV head or per token for V; the steps that dequantize a page first a slice per token)
 * instead of issuing them all at once. On this project's AMD EPYC (Zen 4) VM a burst of ~66
 * prefetches a page (an int4 page of 3 heads x 64 x 16 tokens, scales included) bought
 * nothing on pages evicted from cache: no look-ahead at all (each page prefetched as its own
 * step starts) ran as fast, and ~1.4x slower than on cached pages; the same prefetches spread
 * over the step made it ~1.4x faster there (bench/README, "int4 pass 6"). */
static inline void prefetch_slice(const uint8_t *p, int64_t n_bytes, int64_t i, int64_t n) {
    /* the lines [p, p + n_bytes) touches: a component starts 16-byte aligned, not 64 */
    const uintptr_t a = (uintptr_t)p & ~(uintptr_t)63;
    const int64_t lines = (int64_t)(((uintptr_t)p + (uintptr_t)n_bytes - a + 63) / 64);
    for (int64_t x = i * lines / n; x < (i + 1) * lines / n; x++)
        __builtin_prefetch((const void *)(a + 64 * (uintptr_t)x), 0, 2);
}

/* K's side of page pg (codes, scales, int4's zeros), part i of n (pg < 0: nothing). */
static inline void prefetch_k_part(int fmt, const qpages *P, int64_t pg, int64_t bs, int64_t H,
                                   int64_t D, int64_t i, int64_t n) {
    if (pg < 0) return;
    const int64_t off = pg * P->stride;
    if (fmt == QFMT_INT4) {
        prefetch_slice(P->k + off, bs * H * (D / 2), i, n);
        prefetch_slice(P->ks + off, H * D * 2, i, n);
        prefetch_slice(P->kz + off, H * D * 2, i, n);
    } else {
        prefetch_slice(P->k + off, bs * H * D, i, n);
        prefetch_slice(P->ks + off, bs * H * 2, i, n);
    }
}

/* V's side of page pg, part i of n (pg < 0: nothing). */
static inline void prefetch_v_part(int fmt, const qpages *P, int64_t pg, int64_t bs, int64_t H,
                                   int64_t D, int64_t i, int64_t n) {
    if (pg < 0) return;
    const int64_t off = pg * P->stride;
    if (fmt == QFMT_INT4) {
        const int64_t Gn = D / (D < 32 ? D : 32);
        prefetch_slice(P->v + off, bs * H * (D / 2), i, n);
        prefetch_slice(P->vs + off, bs * H * Gn * 2, i, n);
        prefetch_slice(P->vz + off, bs * H * Gn * 2, i, n);
    } else {
        prefetch_slice(P->v + off, bs * H * D, i, n);
        prefetch_slice(P->vs + off, bs * H * 2, i, n);
    }
}

/* The whole page, part i of n (pg < 0: nothing). */
static inline void prefetch_part(int fmt, const qpages *P, int64_t pg, int64_t bs, int64_t H,
                                 int64_t D, int64_t i, int64_t n) {
    prefetch_k_part(fmt, P, pg, bs, H, D, i, n);
    prefetch_v_part(fmt, P, pg, bs, H, D, i, n);
}

/* Rows [j0, j0 + nt) of page pg, K into kb and V into vb, (nt, H, D) float each. kscr: 2*H*D
 * floats of scratch (int4: the page's K scales and zeros as float), from the heap work area. */
static inline void dequant_rows(int fmt, const qpages *P, int64_t pg, int64_t j0, int64_t nt,
                                int64_t H, int64_t D, float *kb, float *vb, float *kscr,
                                int64_t nxpg, int64_t bs) {
    const int64_t off = pg * P->stride;
    if (fmt == QFMT_INT8 || fmt == QFMT_FP8) {
        const _Float16 *ks = (const _Float16 *)(P->ks + off) + j0 * H;
        const _Float16 *vs = (const _Float16 *)(P->vs + off) + j0 * H;
        const uint8_t *kd = P->k + off + j0 * H * D, *vd = P->v + off + j0 * H * D;
        for (int64_t r = 0; r < nt * H; r++) {
            if (r % H == 0) prefetch_part(fmt, P, nxpg, bs, H, D, r / H, nt); /* per token */
            const float sk = (float)ks[r], sv = (float)vs[r];
            const uint8_t *kq = kd + r * D, *vq = vd + r * D;
            float *ko = kb + r * D, *vo = vb + r * D;
            if (fmt == QFMT_INT8) {
#pragma omp simd
                for (int64_t d = 0; d < D; d++) ko[d] = (float)(int8_t)kq[d] * sk;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) vo[d] = (float)(int8_t)vq[d] * sv;
            } else {
                for (int64_t d = 0; d < D; d++) ko[d] = fp8_lut[kq[d]] * sk;
                for (int64_t d = 0; d < D; d++) vo[d] = fp8_lut[vq[d]] * sv;
            }
        }
        return;
    }
    /* int4: K per channel (scale, zero of (H, D) per page), V per token in groups of g */
    const int64_t D2 = D / 2, g = D < 32 ? D : 32, Gn = D / g;
    const _Float16 *ks = (const _Float16 *)(P->ks + off), *kz = (const _Float16 *)(P->kz + off);
    const _Float16 *vs = (const _Float16 *)(P->vs + off) + j0 * H * Gn;
    const _Float16 *vz = (const _Float16 *)(P->vz + off) + j0 * H * Gn;
    const uint8_t *kd = P->k + off + j0 * H * D2, *vd = P->v + off + j0 * H * D2;
    float *ksf = kscr, *kzf = kscr + H * D; /* the page's K scales and zeros as float, once */
    for (int64_t i = 0; i < H * D; i++) {
        ksf[i] = (float)ks[i];
        kzf[i] = (float)kz[i];
    }
    for (int64_t t = 0; t < nt; t++) {
        prefetch_part(fmt, P, nxpg, bs, H, D, t, nt);
        for (int64_t h = 0; h < H; h++) {
            const int64_t r = t * H + h;
            const uint8_t *kq = kd + r * D2, *vq = vd + r * D2;
            const float *sc = ksf + h * D, *zp = kzf + h * D;
            float *ko = kb + r * D, *vo = vb + r * D;
            int4_codes(kq, D2, ko); /* codes, then scaled in place */
#pragma omp simd
            for (int64_t d = 0; d < D; d++) ko[d] = ko[d] * sc[d] + zp[d];
            int4_codes(vq, D2, vo);
            for (int64_t c = 0; c < Gn; c++) {
                const float s = (float)vs[r * Gn + c], z = (float)vz[r * Gn + c];
                float *voc = vo + c * g;
#pragma omp simd
                for (int64_t i = 0; i < g; i++) voc[i] = voc[i] * s + z;
            }
        }
    }
}

#if VEC_PATH
/* An int4 page step without a dequantized copy: keys' per-channel scales fold into the
 * query (q.(c*s + z) = (q*s).c + q.z, per page), values' per-token group scale and zero into
 * the softmax weight (p*(c*s + z) = (p*s)*c + p*z); only the 4-bit codes are widened, a row
 * at a time (in registers when D % 32 == 0, else through a D-float scratch). Same math as
 * dequantizing first, other rounding (float-level): equal to the twin within rounding. */
static void page_int4_vec(const float *qb, const qpages *P, int64_t pgid, int64_t j0,
                          int64_t nt, float *s, float *acc, float *m, float *l, int64_t Hq,
                          int64_t Hkv, const int64_t D, int64_t bs, float scale, float *qs,
                          float *qz, float *codes, int64_t nxpg) {
    const int64_t off = pgid * P->stride, D2 = D / 2, G = Hq / Hkv, C = D / VW;
    const int64_t g = D < 32 ? D : 32, Gn = D / g;
    const _Float16 *ks = (const _Float16 *)(P->ks + off), *kz = (const _Float16 *)(P->kz + off);
    const _Float16 *vs = (const _Float16 *)(P->vs + off), *vz = (const _Float16 *)(P->vz + off);
    const uint8_t *kd = P->k + off, *vd = P->v + off;
    float *ksf = codes + D, *kzf = ksf + Hkv * D; /* the page's K scales, zeros as float */
    for (int64_t i = 0; i < Hkv * D; i++) {
        ksf[i] = (float)ks[i];
        kzf[i] = (float)kz[i];
    }
    for (int64_t h = 0; h < Hkv; h++)
        for (int64_t gi = h * G; gi < (h + 1) * G; gi++) {
            VF z = VMUL(VLOAD(qb + gi * D), VLOAD(kzf + h * D));
            VSTORE(qs + gi * D, VMUL(VLOAD(qb + gi * D), VLOAD(ksf + h * D)));
            for (int64_t c = 1; c < C; c++) {
                const VF qv = VLOAD(qb + gi * D + VW * c);
                VSTORE(qs + gi * D + VW * c, VMUL(qv, VLOAD(ksf + h * D + VW * c)));
                z = VFMA(qv, VLOAD(kzf + h * D + VW * c), z);
            }
            qz[gi] = VSUM(z);
        }
    for (int64_t j = 0; j < nt; j++) {
        prefetch_part(QFMT_INT4, P, nxpg, bs, Hkv, D, j, nt);
        for (int64_t h = 0; h < Hkv; h++) {
            VF kv[MAX_CHUNKS];
            int4_row(kd + ((j0 + j) * Hkv + h) * D2, D, codes, kv);
            for (int64_t gi = h * G; gi < (h + 1) * G; gi++) {
                const float *qr = qs + gi * D;
                VF x = VMUL(VLOAD(qr), kv[0]);
                for (int64_t c = 1; c < C; c++) x = VFMA(VLOAD(qr + VW * c), kv[c], x);
                s[gi * bs + j] = (VSUM(x) + qz[gi]) * scale;
            }
        }
    }
    fold_page(s, acc, m, l, Hq, D, bs, nt);
    for (int64_t j = 0; j < nt; j++)
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t r = (j0 + j) * Hkv + h;
            VF cv[MAX_CHUNKS];
            int4_row(vd + r * D2, D, codes, cv);
            float sv[8], zv[8]; /* the row's group scales and zeros (Gn <= 8: D <= 256) */
            for (int64_t c = 0; c < Gn; c++) {
                sv[c] = (float)vs[r * Gn + c];
                zv[c] = (float)vz[r * Gn + c];
            }
            for (int64_t gi = h * G; gi < (h + 1) * G; gi++) {
                const float p = s[gi * bs + j];
                float *ar = acc + gi * D;
                for (int64_t c = 0; c < C; c++) {
                    const int64_t grp = (VW * c) / g;
                    const VF a = VSET1(p * sv[grp]), b = VSET1(p * zv[grp]);
                    VSTORE(ar + VW * c, VADD(VFMA(a, cv[c], VLOAD(ar + VW * c)), b));
                }
            }
        }
}
#endif

/* ------------------------------------------------------------------------------------------
 * The int4 fast step (vector builds, D a multiple of 32 up to 256: SmolLM2's 64, Llama's 128).
 *
 * A byte of codes holds dims 2i (low nibble) and 2i + 1 (high nibble). VW bytes widen to VW
 * int32 in one instruction; `& 15` and `>> 4` then give the codes of VW even and VW odd dims,
 * no byte shuffles. So the kernel works on "split" vectors: chunk c of a row covers dims
 * [2c*VW, 2(c+1)*VW), even dims in one vector and odd ones in the next. The query is split
 * that way once per sequence, a page's key scales once per KV head (the product of the two,
 * times the softmax scale, is the folded query of the page), and the output accumulators are
 * kept split until the sequence is done (or one of its fp32 residual pages is read), then put
 * back in dim order. A value group (32 dims) is a whole number of chunks: where a KV head's
 * accumulators fit in registers, a token's value row is dequantized there (code * group
 * scale + group zero, one FMA per vector, shared by the head's G query heads) and added with
 * its softmax weight; elsewhere the group scale folds into the weight and the zero term is
 * summed per page. Scores are reduced four tokens at a time (one shuffle tree for 4 dot
 * products instead of 4 horizontal sums), as are the query's zero terms; the page's fp16
 * scales are converted with vector instructions. */
#if VEC_PATH
#define C2MAX (128 / VW) /* split chunks of a row, D <= 256 */

static inline int int4_fast_ok(int64_t D) { return D % 32 == 0 && D <= 256; }

/* VW bytes of codes -> the float codes of VW even dims (lo) and VW odd dims (hi). */
static inline void int4_split(const uint8_t *p, VF *lo, VF *hi) {
#if VEC_PATH == 512
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
#else
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4));
#endif
}

/* Two vectors of consecutive dims (a: [0, VW), b: [VW, 2VW)) -> even dims, odd dims. */
static inline void deinterleave(VF a, VF b, VF *e, VF *o) {
#if VEC_PATH == 512
    const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    *e = _mm512_permutex2var_ps(a, ie, b);
    *o = _mm512_permutex2var_ps(a, io, b);
#else
    *e = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
    *o = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
#endif
}

/* deinterleave's inverse: even dims e and odd dims o -> dims [0, VW) in a, [VW, 2VW) in b. */
static inline void interleave(VF e, VF o, VF *a, VF *b) {
#if VEC_PATH == 512
    const __m512i ia = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i ib = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    *a = _mm512_permutex2var_ps(e, ia, o);
    *b = _mm512_permutex2var_ps(e, ib, o);
#else
    const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);
    *a = _mm256_permute2f128_ps(lo, hi, 0x20);
    *b = _mm256_permute2f128_ps(lo, hi, 0x31);
#endif
}

/* VW fp16 values -> floats */
static inline VF ldv_h(const _Float16 *p) { return ldv_f16(p); }

/* The sums of four vectors, as the four lanes of one 128-bit vector. */
static inline __m128 hsum4(VF x0, VF x1, VF x2, VF x3) {
#if VEC_PATH == 512
    const __m512 y0 =
        _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x44), _mm512_shuffle_f32x4(x0, x1, 0xEE));
    const __m512 y1 =
        _mm512_add_ps(_mm512_shuffle_f32x4(x2, x3, 0x44), _mm512_shuffle_f32x4(x2, x3, 0xEE));
    __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
    z = _mm512_add_ps(z, _mm512_permute_ps(z, 0x4E)); /* 128-bit lane k: x_k's partial sums */
    z = _mm512_add_ps(z, _mm512_permute_ps(z, 0xB1));
    return _mm512_castps512_ps128(
        _mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), z));
#else
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(x0, x1), _mm256_hadd_ps(x2, x3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
#endif
}

/* q (Hq, D) in dim order -> split order (chunk c: VW even dims, then VW odd dims). */
static void split_rows(const float *src, float *dst, int64_t rows, int64_t D) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < D / (2 * VW); c++) {
            const float *a = src + r * D + 2 * VW * c;
            float *e = dst + r * D + 2 * VW * c;
            for (int64_t i = 0; i < VW; i++) {
                e[i] = a[2 * i];
                e[VW + i] = a[2 * i + 1];
            }
        }
}

/* The inverse of split_rows, in place (tmp: 2 * VW floats). */
static void unsplit_rows(float *x, int64_t rows, int64_t D, float *tmp) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < D / (2 * VW); c++) {
            float *e = x + r * D + 2 * VW * c;
            memcpy(tmp, e, sizeof(float) * 2 * VW);
            for (int64_t i = 0; i < VW; i++) {
                e[2 * i] = tmp[i];
                e[2 * i + 1] = tmp[VW + i];
            }
        }
}

/* split_rows in place (tmp: 2 * VW floats): accumulators back to split order after a float
 * page step, when a pool page follows a residual one. */
static void resplit_rows(float *x, int64_t rows, int64_t D, float *tmp) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < D / (2 * VW); c++) {
            float *e = x + r * D + 2 * VW * c;
            memcpy(tmp, e, sizeof(float) * 2 * VW);
            for (int64_t i = 0; i < VW; i++) {
                e[i] = tmp[2 * i];
                e[VW + i] = tmp[2 * i + 1];
            }
        }
}

/* n fp16 values -> float */
static inline void halves_to_floats(const _Float16 *src, int64_t n, float *dst) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) VSTORE(dst + i, ldv_h(src + i));
    for (; i < n; i++) dst[i] = (float)src[i];
}

/* The values of one KV head's rows of a page (nt tokens, row stride Hkv * D / 2 bytes, the
 * page's V scales and zeros as floats at sv / zv, stride Hkv * Gn) into the split
 * accumulators of its G query heads (acc, weights s, stride bs): head-major, so the G * D
 * accumulators stay in registers over the page (loaded and stored once, not once per token).
 * Each row is dequantized once in registers for the G heads: 1.22x on the kernel against
 * folding the group scale into each head's weight and summing the zero terms (16 x 160
 * tokens, int4 pages in cache, 1 thread). G * 2 * C2 <= 16 vectors. */
static inline __attribute__((always_inline)) void int4_v_regs(
    const uint8_t *vd, const float *sv, const float *zv, const float *s, float *acc,
    int64_t nt, const int64_t G, int64_t Hkv, const int64_t D, int64_t bs) {
    const int64_t C2 = D / (2 * VW), Gn = D / 32, D2 = D / 2;
    VF a[4 * 2 * C2MAX]; /* sized for any G <= 4 (the caller keeps G * 2 * C2 <= 16) */
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < 2 * C2; c++) a[g * 2 * C2 + c] = VLOAD(acc + g * D + VW * c);
    for (int64_t j = 0; j < nt; j++) {
        VF lo[C2MAX], hi[C2MAX];
        const uint8_t *vr = vd + j * Hkv * D2;
        const float *svj = sv + j * Hkv * Gn, *zvj = zv + j * Hkv * Gn;
        for (int64_t c = 0; c < C2; c++) { /* the row's values: code * scale + zero */
            const VF sc = VSET1(svj[(2 * VW * c) / 32]), zc = VSET1(zvj[(2 * VW * c) / 32]);
            int4_split(vr + VW * c, &lo[c], &hi[c]);
            lo[c] = VFMA(lo[c], sc, zc);
            hi[c] = VFMA(hi[c], sc, zc);
        }
        for (int64_t g = 0; g < G; g++) {
            const VF p = VSET1(s[g * bs + j]);
            for (int64_t c = 0; c < C2; c++) {
                a[g * 2 * C2 + 2 * c] = VFMA(p, lo[c], a[g * 2 * C2 + 2 * c]);
                a[g * 2 * C2 + 2 * c + 1] = VFMA(p, hi[c], a[g * 2 * C2 + 2 * c + 1]);
            }
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < 2 * C2; c++) VSTORE(acc + g * D + VW * c, a[g * 2 * C2 + c]);
}

/* Floats of the fast step's scratch. */
#define INT4_FAST_FLOATS(Hq, Hkv, D, bs) \
    (2 * (Hq) * (D) + (Hq) + 2 * (bs) * (Hkv) * ((D) / 32) + (Hq) * ((D) / 32) + 4 * (Hq) * VW + 2 * VW)

/* One int4 page's rows [j0, j0 + nt) against the split query qsp, into the split
 * accumulators acc. qb: the query in dim order (for the key zeros' term). */
static inline __attribute__((always_inline)) void page_int4_fast(
    const float *qb, const float *qsp, const qpages *P, int64_t pgid, int64_t j0, int64_t nt,
    float *s, float *acc, float *m, float *l, int64_t Hq, int64_t Hkv, const int64_t D,
    int64_t bs, float scale, float *scr, int64_t nxpg) {
    const int64_t off = pgid * P->stride, D2 = D / 2, G = Hq / Hkv, C2 = D / (2 * VW);
    const int64_t Gn = D / 32;
    const int64_t n_iter = (nt + 3) / 4; /* score iterations: the next page's K in slices */
    const _Float16 *ks = (const _Float16 *)(P->ks + off), *kz = (const _Float16 *)(P->kz + off);
    const _Float16 *vs = (const _Float16 *)(P->vs + off) + j0 * Hkv * Gn;
    const _Float16 *vz = (const _Float16 *)(P->vz + off) + j0 * Hkv * Gn;
    const uint8_t *kd = P->k + off + j0 * Hkv * D2, *vd = P->v + off + j0 * Hkv * D2;
    float *qs = scr, *qz = qs + Hq * D, *vsf = qz + Hq, *vzf = vsf + bs * Hkv * Gn;
    float *zsum = vzf + bs * Hkv * Gn, *xs = zsum + Hq * Gn;
    /* the page's folded query: split q times split key scales times the softmax scale, and
     * scale * q . zero per query head */
    const VF vscale = VSET1(scale);
    for (int64_t h = 0; h < Hkv; h++) {
        VF se[C2MAX], so[C2MAX];
        for (int64_t c = 0; c < C2; c++) {
            const _Float16 *p = ks + h * D + 2 * VW * c;
            deinterleave(ldv_h(p), ldv_h(p + VW), &se[c], &so[c]);
            se[c] = VMUL(se[c], vscale);
            so[c] = VMUL(so[c], vscale);
        }
        VF kzv[2 * C2MAX]; /* the zeros, converted once for the G heads */
        for (int64_t c = 0; c < 2 * C2; c++) kzv[c] = ldv_h(kz + h * D + VW * c);
        for (int64_t g0 = h * G; g0 < (h + 1) * G; g0 += 4) { /* q . zero, 4 heads a sum tree */
            const int64_t n = (h + 1) * G - g0 < 4 ? (h + 1) * G - g0 : 4;
            VF z[4];
            for (int64_t t = 0; t < 4; t++) {
                z[t] = VSET1(0.0f);
                if (t < n)
                    for (int64_t c = 0; c < 2 * C2; c++)
                        z[t] = VFMA(VLOAD(qb + (g0 + t) * D + VW * c), kzv[c], z[t]);
            }
            float zt[4];
            _mm_storeu_ps(zt, _mm_mul_ps(hsum4(z[0], z[1], z[2], z[3]), _mm_set1_ps(scale)));
            for (int64_t t = 0; t < n; t++) qz[g0 + t] = zt[t];
        }
        for (int64_t g = h * G; g < (h + 1) * G; g++) {
            const float *qr = qsp + g * D;
            float *qo = qs + g * D;
            for (int64_t c = 0; c < C2; c++) {
                VSTORE(qo + 2 * VW * c, VMUL(VLOAD(qr + 2 * VW * c), se[c]));
                VSTORE(qo + 2 * VW * c + VW, VMUL(VLOAD(qr + 2 * VW * c + VW), so[c]));
            }
        }
    }
    /* scores, four tokens at a time */
    for (int64_t j = 0; j < nt; j += 4) {
        const int64_t n4 = nt - j < 4 ? nt - j : 4;
        prefetch_k_part(QFMT_INT4, P, nxpg, bs, Hkv, D, j / 4, n_iter);
        for (int64_t h = 0; h < Hkv; h++) {
            for (int64_t t = 0; t < 4; t++) {
                if (t >= n4) {
                    for (int64_t g = 0; g < G; g++) VSTORE(xs + (g * 4 + t) * VW, VSET1(0.0f));
                    continue;
                }
                VF lo[C2MAX], hi[C2MAX];
                const uint8_t *kr = kd + ((j + t) * Hkv + h) * D2;
                for (int64_t c = 0; c < C2; c++) int4_split(kr + VW * c, &lo[c], &hi[c]);
                for (int64_t g = 0; g < G; g++) {
                    const float *qr = qs + (h * G + g) * D;
                    VF x = VMUL(VLOAD(qr), lo[0]);
                    x = VFMA(VLOAD(qr + VW), hi[0], x);
                    for (int64_t c = 1; c < C2; c++) {
                        x = VFMA(VLOAD(qr + 2 * VW * c), lo[c], x);
                        x = VFMA(VLOAD(qr + 2 * VW * c + VW), hi[c], x);
                    }
                    VSTORE(xs + (g * 4 + t) * VW, x);
                }
            }
            for (int64_t g = 0; g < G; g++) {
                const float *x = xs + g * 4 * VW;
                const int64_t gi = h * G + g;
                const __m128 r = _mm_add_ps(
                    hsum4(VLOAD(x), VLOAD(x + VW), VLOAD(x + 2 * VW), VLOAD(x + 3 * VW)),
                    _mm_set1_ps(qz[gi]));
                if (n4 == 4) {
                    _mm_storeu_ps(s + gi * bs + j, r);
                } else {
                    float tmp[4];
                    _mm_storeu_ps(tmp, r);
                    for (int64_t t = 0; t < n4; t++) s[gi * bs + j + t] = tmp[t];
                }
            }
        }
    }
    fold_page(s, acc, m, l, Hq, D, bs, nt);
    /* values: dequantized in registers where a KV head's accumulators fit; else weight *
     * group scale on the codes, weight * group zero summed per group */
    halves_to_floats(vs, nt * Hkv * Gn, vsf);
    halves_to_floats(vz, nt * Hkv * Gn, vzf);
    if (G * 2 * C2 <= 16 && G <= 4) { /* a KV head's accumulators fit in registers */
        for (int64_t h = 0; h < Hkv; h++) {
            const uint8_t *vh = vd + h * D2;
            prefetch_v_part(QFMT_INT4, P, nxpg, bs, Hkv, D, h, Hkv);
            const float *sh = s + h * G * bs;
            float *ah = acc + h * G * D;
            if (G == 1) /* G a constant: the loops unroll and a[] lives in registers */
                int4_v_regs(vh, vsf + h * Gn, vzf + h * Gn, sh, ah, nt, 1, Hkv, D, bs);
            else if (G == 2)
                int4_v_regs(vh, vsf + h * Gn, vzf + h * Gn, sh, ah, nt, 2, Hkv, D, bs);
            else if (G == 3)
                int4_v_regs(vh, vsf + h * Gn, vzf + h * Gn, sh, ah, nt, 3, Hkv, D, bs);
            else
                int4_v_regs(vh, vsf + h * Gn, vzf + h * Gn, sh, ah, nt, 4, Hkv, D, bs);
        }
        return;
    }
    for (int64_t i = 0; i < Hq * Gn; i++) zsum[i] = 0.0f;
    for (int64_t j = 0; j < nt; j++) { /* token-major: an accumulator's updates 1 row apart */
        prefetch_v_part(QFMT_INT4, P, nxpg, bs, Hkv, D, j, nt);
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t r = j * Hkv + h;
            VF lo[C2MAX], hi[C2MAX];
            for (int64_t c = 0; c < C2; c++) int4_split(vd + r * D2 + VW * c, &lo[c], &hi[c]);
            const float *sv = vsf + r * Gn, *zv = vzf + r * Gn;
            for (int64_t gi = h * G; gi < (h + 1) * G; gi++) {
                const float p = s[gi * bs + j];
                float *ar = acc + gi * D;
                for (int64_t c = 0; c < C2; c++) {
                    const VF a = VSET1(p * sv[(2 * VW * c) / 32]);
                    VSTORE(ar + 2 * VW * c, VFMA(a, lo[c], VLOAD(ar + 2 * VW * c)));
                    VSTORE(ar + 2 * VW * c + VW, VFMA(a, hi[c], VLOAD(ar + 2 * VW * c + VW)));
                }
                for (int64_t k = 0; k < Gn; k++) zsum[gi * Gn + k] += p * zv[k];
            }
        }
    }
    for (int64_t gi = 0; gi < Hq; gi++)
        for (int64_t c = 0; c < C2; c++) {
            const VF z = VSET1(zsum[gi * Gn + (2 * VW * c) / 32]);
            float *ar = acc + gi * D + 2 * VW * c;
            VSTORE(ar, VADD(VLOAD(ar), z));
            VSTORE(ar + VW, VADD(VLOAD(ar + VW), z));
        }
}

/* The fast step with D a compile-time constant for the common head sizes. */
static void page_int4_fast_any(const float *qb, const float *qsp, const qpages *P, int64_t pgid,
                               int64_t j0, int64_t nt, float *s, float *acc, float *m, float *l,
                               int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale,
                               float *scr, int64_t nxpg) {
    if (D == 64)
        page_int4_fast(qb, qsp, P, pgid, j0, nt, s, acc, m, l, Hq, Hkv, 64, bs, scale, scr, nxpg);
    else if (D == 128)
        page_int4_fast(qb, qsp, P, pgid, j0, nt, s, acc, m, l, Hq, Hkv, 128, bs, scale, scr, nxpg);
    else
        page_int4_fast(qb, qsp, P, pgid, j0, nt, s, acc, m, l, Hq, Hkv, D, bs, scale, scr, nxpg);
}
#endif

/* Floats of seq_quant's work area past WORK_FLOATS: a page of dequantized K and V, int4's
 * folded query, its zeros, a codes row, the page's K scales and zeros; on the vector builds
 * the split query and the fast int4 step's scratch. */
static inline int64_t quant_work_floats(int64_t Hq, int64_t Hkv, int64_t D, int64_t bs) {
    int64_t n = WORK_FLOATS(Hq, D, bs) + 2 * bs * Hkv * D + Hq * D + Hq + D + 2 * Hkv * D;
#if VEC_PATH
    n += Hq * D + INT4_FAST_FLOATS(Hq, Hkv, D, bs);
#endif
    return n;
}

/* The residual slot that holds page pg of a sequence whose W slots name the pages [base,
 * base + W) (base = its last page - W + 1), or -1: page pg is read from the pool. */
static inline int64_t res_slot(const int64_t *slots, int64_t W, int64_t base, int64_t pg) {
    const int64_t i = pg - base;
    return (pg >= 0 && i >= 0 && i < W && slots[i] >= 0) ? slots[i] : -1;
}

#ifndef QPF
#define QPF 3 /* prefetch distance + 1: the table entry QPF - 1 pages ahead */
#endif
#if QPF < 1
#error "QPF must be at least 1 (it indexes table[pg + QPF - 1])"
#endif
static void seq_quant(int fmt, const float *qb, const qpages *P, const float *res_k,
                      const float *res_v, const int64_t *slots, int64_t W, const int64_t *table,
                      int64_t lo, int64_t L, int64_t first, int64_t last, float *ob, float *part,
                      int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale, float *work) {
    const int64_t row = Hkv * D;
    float *s = work, *acc = s + Hq * bs, *m = acc + Hq * D, *l = m + Hq;
    float *kb = l + Hq, *vb = kb + bs * row;
    float *kscr = vb + bs * row + Hq * D + Hq + D; /* 2 * row floats: int4's K scales, zeros */
    start_softmax(acc, m, l, Hq, D);
    const int64_t base = (L - 1) / bs - W + 1; /* the page slots[0] names (L >= 1 here) */
#if VEC_PATH
    /* the fast int4 step on pool pages: acc stays in split order while it runs (put back
     * before a residual or other float page step, split again after it, put back at the end) */
    float *qsp = kscr + 2 * row, *fscr = qsp + Hq * D;
    const int fast = fmt == QFMT_INT4 && int4_fast_ok(D);
    int split = fast; /* acc starts at zero: in either order */
    if (fast) split_rows(qb, qsp, Hq, D);
#endif
    /* pool pages are prefetched QPF - 1 pages ahead: the first ones before the loop, then
     * page pg + QPF - 1 in slices over page pg's step (prefetch_part) */
    for (int64_t pg = first; pg < first + QPF - 1 && pg <= last; pg++)
        if (res_slot(slots, W, base, pg) < 0) prefetch_part(fmt, P, table[pg], bs, Hkv, D, 0, 1);
    for (int64_t pg = first; pg <= last; pg++) {
        const int64_t t0 = pg * bs > lo ? pg * bs : lo;
        const int64_t t1 = (pg + 1) * bs < L ? (pg + 1) * bs : L;
        const int64_t nt = t1 - t0, j0 = t0 - pg * bs;
        const int64_t slot = res_slot(slots, W, base, pg);
        const float *kp, *vp;
        const int64_t nxpg = (pg + QPF - 1 <= last && res_slot(slots, W, base, pg + QPF - 1) < 0)
                                 ? table[pg + QPF - 1] : -1;
#if VEC_PATH
        if (fast && slot < 0) {
            if (!split) resplit_rows(acc, Hq, D, fscr);
            split = 1;
            page_int4_fast_any(qb, qsp, P, table[pg], j0, nt, s, acc, m, l, Hq, Hkv, D, bs,
                               scale, fscr, nxpg);
            continue;
        }
        if (split) { /* a residual page: a float step, on accumulators in dim order */
            unsplit_rows(acc, Hq, D, fscr);
            split = 0;
        }
#endif
        if (slot >= 0) { /* no pool page step to spread the next page's prefetch over */
            prefetch_part(fmt, P, nxpg, bs, Hkv, D, 0, 1);
            kp = res_k + slot * bs * row + j0 * row;
            vp = res_v + slot * bs * row + j0 * row;
#if VEC_PATH
        } else if (fmt == QFMT_INT4 && vec_ok(D)) {
            float *qs = vb + bs * row, *qz = qs + Hq * D;
            page_int4_vec(qb, P, table[pg], j0, nt, s, acc, m, l, Hq, Hkv, D, bs, scale, qs, qz,
                          qz + Hq, nxpg);
            continue;
#endif
        } else {
            dequant_rows(fmt, P, table[pg], j0, nt, Hkv, D, kb, vb, kscr, nxpg, bs);
            kp = kb;
            vp = vb;
        }
        PAGE_STEP(f32, kp, vp, (const float *)NULL, (const float *)NULL, nt);
    }
#if VEC_PATH
    if (split) unsplit_rows(acc, Hq, D, fscr);
#endif
    end_part(acc, m, l, ob, part, Hq, D);
}

static void hadamard_rows(float *x, int64_t n, int64_t D, int64_t block, float scale);

/* kvmesh_decode_attention_quant (below); rot_block > 0: each sequence's output rows then
 * rotated as hadamard_rows rotates them, by the thread that computed them (after the merge
 * where a sequence was split into parts), not on one thread after the loop. */
static int decode_quant(int fmt, const float *q, const uint8_t *k, const uint8_t *ks,
                        const uint8_t *kz, const uint8_t *v, const uint8_t *vs, const uint8_t *vz,
                        const float *res_k, const float *res_v, const int64_t *block_tables,
                        const int64_t *context_lens, const int64_t *res_slots, float *out,
                        int64_t B, int64_t P, int64_t res_pages, int64_t Hq, int64_t Hkv,
                        int64_t D, int64_t bs, int64_t page_stride, float scale, int64_t window,
                        int num_threads, int64_t rot_block, float rot_scale) {
    if (res_pages < 1) return 3;
    if (fmt != QFMT_FP8 && fmt != QFMT_INT8 && fmt != QFMT_INT4) return 2;
    if (fmt == QFMT_INT4 && (D % 2 || D % (D < 32 ? D : 32))) return 2;
    if (fmt == QFMT_FP8) {
        _Pragma("omp critical(kvmesh_fp8_lut)") if (fp8_lut[0x38] != 1.0f) fill_fp8_lut();
    }
    const qpages pages = {k, ks, kz, v, vs, vz, page_stride};
    int failed = 0;
    const int64_t S = seq_parts(B, num_threads, context_lens, bs, window);
    float *parts = NULL;
    if (S > 1 && (parts = malloc(sizeof(float) * B * S * PART_FLOATS(Hq, D))) == NULL) return 1;
#pragma omp parallel num_threads(num_threads)
    {
        /* + dequantized K and V of a page; int4's folded query, its zeros, codes, K scales */
        float *work = malloc(sizeof(float) * quant_work_floats(Hq, Hkv, D, bs));
        if (work == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < B * S; it++) {
            const int64_t b = it / S, L = context_lens[b];
            const int64_t lo = (window > 0 && L > window) ? L - window : 0;
            float *ob = out + b * Hq * D;
            if (work == NULL) continue;
            if (L <= lo) {
                memset(ob, 0, sizeof(float) * Hq * D);
            } else {
                int64_t pa, pb;
                part_range(lo / bs, (L - 1) / bs, it % S, S, &pa, &pb);
                seq_quant(fmt, q + b * Hq * D, &pages, res_k, res_v, res_slots + b * res_pages,
                          res_pages, block_tables + b * P, lo, L, pa, pb, ob,
                          S > 1 ? parts + it * PART_FLOATS(Hq, D) : NULL, Hq, Hkv, D, bs,
                          scale, work);
            }
            if (rot_block && S == 1) hadamard_rows(ob, Hq, D, rot_block, rot_scale);
        }
        free(work);
    }
    merge_all(parts, S, context_lens, window, out, B, Hq, D, failed);
    if (rot_block && S > 1 && !failed) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t b = 0; b < B; b++)
            hadamard_rows(out + b * Hq * D, Hq, D, rot_block, rot_scale);
    }
    return failed;
}

/* fmt: QFMT_*. kz, vz: NULL for fp8/int8. res_k/res_v: (R, bs, Hkv, D) fp32. res_slots
 * (B, res_pages) int64 row-major: entry [b, i] is the residual slot holding page
 * (L_b - 1) / bs - res_pages + 1 + i of sequence b (read wholly from there, positions >= L_b
 * masked), -1 where that page is read from the pool. page_stride in bytes. */
int kvmesh_decode_attention_quant(int fmt, const float *q, const uint8_t *k, const uint8_t *ks,
                                  const uint8_t *kz, const uint8_t *v, const uint8_t *vs,
                                  const uint8_t *vz, const float *res_k, const float *res_v,
                                  const int64_t *block_tables, const int64_t *context_lens,
                                  const int64_t *res_slots, float *out, int64_t B, int64_t P,
                                  int64_t res_pages, int64_t Hq, int64_t Hkv, int64_t D,
                                  int64_t bs, int64_t page_stride, float scale, int64_t window,
                                  int num_threads) {
    return decode_quant(fmt, q, k, ks, kz, v, vs, vz, res_k, res_v, block_tables, context_lens,
                        res_slots, out, B, P, res_pages, Hq, Hkv, D, bs, page_stride, scale,
                        window, num_threads, 0, 0.0f);
}

/* int4 page pg's KV head h, its bs tokens, as kernels/quant.py dequantizes them, bit for bit
 * (a code times an fp16 scale is exact in float, so the one rounding is the add, as in
 * torch): token t's K row into kout + t * ldko, its V row into vout + t * ldvo. */
static inline void int4_page_head(const qpages *P, int64_t pg, int64_t bs, int64_t H, int64_t D,
                                  int64_t h, float *kout, int64_t ldko, float *vout,
                                  int64_t ldvo) {
    const int64_t g = D < 32 ? D : 32, D2 = D / 2, Gn = D / g, off = pg * P->stride;
    const _Float16 *sc = (const _Float16 *)(P->ks + off) + h * D;
    const _Float16 *zp = (const _Float16 *)(P->kz + off) + h * D;
    const _Float16 *vsp = (const _Float16 *)(P->vs + off), *vzp = (const _Float16 *)(P->vz + off);
#if VEC_PATH
    if (int4_fast_ok(D)) { /* whole vectors of codes: the same products and sums as below,
                            * in vector registers (a multiply, then an add: bit for bit) */
        const int64_t C2 = D / (2 * VW);
        VF s2[2 * C2MAX], z2[2 * C2MAX]; /* K's per-dim scales and zeros, dim order */
        for (int64_t c = 0; c < 2 * C2; c++) {
            s2[c] = ldv_h(sc + VW * c);
            z2[c] = ldv_h(zp + VW * c);
        }
        for (int64_t t = 0; t < bs; t++) {
            const int64_t r = t * H + h;
            const uint8_t *kb = P->k + off + r * D2, *vb = P->v + off + r * D2;
            float *kr = kout + t * ldko, *vr = vout + t * ldvo;
            for (int64_t c = 0; c < C2; c++) {
                VF e, o, a, b;
                int4_split(kb + VW * c, &e, &o);
                interleave(e, o, &a, &b);
                VSTORE(kr + 2 * VW * c, VADD(VMUL(a, s2[2 * c]), z2[2 * c]));
                VSTORE(kr + 2 * VW * c + VW, VADD(VMUL(b, s2[2 * c + 1]), z2[2 * c + 1]));
                int4_split(vb + VW * c, &e, &o);
                interleave(e, o, &a, &b);
                /* a chunk: 2 VW (16 or 32) dims from a multiple of 2 VW, so in one 32-dim group */
                const int64_t grp = (2 * VW * c) / 32;
                const VF s0 = VSET1((float)vsp[r * Gn + grp]), z0 = VSET1((float)vzp[r * Gn + grp]);
                VSTORE(vr + 2 * VW * c, VADD(VMUL(a, s0), z0));
                VSTORE(vr + 2 * VW * c + VW, VADD(VMUL(b, s0), z0));
            }
        }
        return;
    }
#endif
    for (int64_t t = 0; t < bs; t++) {
        const int64_t r = t * H + h;
        const uint8_t *kb = P->k + off + r * D2, *vb = P->v + off + r * D2;
        float *kr = kout + t * ldko, *vr = vout + t * ldvo;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) {
            const float c = (float)((kb[d / 2] >> (4 * (d & 1))) & 15);
            kr[d] = c * (float)sc[d] + (float)zp[d];
        }
        for (int64_t c0 = 0; c0 < Gn; c0++) {
            const float s1 = (float)vsp[r * Gn + c0], z1 = (float)vzp[r * Gn + c0];
#pragma omp simd
            for (int64_t d = c0 * g; d < (c0 + 1) * g; d++) {
                const float c = (float)((vb[d / 2] >> (4 * (d & 1))) & 15);
                vr[d] = c * s1 + z1;
            }
        }
    }
}

static inline int int4_head_ok(int64_t D) {
    return D >= 2 && D % 2 == 0 && D % (D < 32 ? D : 32) == 0;
}

/* int4 pages dequantized to float, kernels.quant.dequantize_pages' twin bit for bit: pages
 * (n,) of the pool (component bases and page stride in bytes as the decode kernel) -> ko, vo
 * (n, bs, H, D) float32 contiguous. The own-page prefill's SDPA path reads a chunk's complete
 * pages so, straight into its key/value buffers (the C kernel path reads them itself,
 * kvmesh_prefill_attention_runs_int4_f32). Returns 0, or 2 for a head size int4 cannot take. */
int kvmesh_dequantize_int4_pages(const uint8_t *k, const uint8_t *ks, const uint8_t *kz,
                                 const uint8_t *v, const uint8_t *vs, const uint8_t *vz,
                                 int64_t stride, const int64_t *pages, int64_t n, int64_t bs,
                                 int64_t H, int64_t D, float *ko, float *vo, int num_threads) {
    if (!int4_head_ok(D)) return 2;
    const qpages P = {k, ks, kz, v, vs, vz, stride};
    const int64_t rows = bs * H;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * rows * D >= 32768)
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < H; h++)
            int4_page_head(&P, pages[i], bs, H, D, h, ko + i * rows * D + h * D, H * D,
                           vo + i * rows * D + h * D, H * D);
    return 0;
}

/* The ABI version kernels/cpu_native.py checks, bumped with any signature change. */
int kvmesh_cpu_abi(void) { return 7; }

/* The vector path this build has: 512 (AVX-512), 256 (AVX2), 0 (scalar). */
int kvmesh_cpu_attention_vectorized(void) { return VEC_PATH; }

/* int4 pages keep V rotated by a normalised Hadamard matrix (kernels/quant.py): the backend
 * rotates each new V row before writing it and the attention output back. x (n, D) float32
 * -> out (n, D) (may be x): every `block` consecutive dims times the Hadamard matrix, then
 * times `scale` (1 / sqrt(block)), with kernels.quant.hadamard_transform's butterflies in its
 * order (stage h pairs dims i and i + h, h = 1, 2, 4, ...): bit-equal to it, without its ~30
 * torch ops per call. */
#if VEC_PATH
/* Butterfly stage h < VW inside one vector: lane i gets x[i] + x[i + h] where bit h of i is
 * clear, x[i - h] - x[i] where it is set: the scalar stage's a + b and a - b, the same bits. */
static inline VF hadamard_lanes(VF x, int64_t h) {
#if VEC_PATH == 512
    __m512 s;
    __mmask16 m;
    if (h == 1) {
        s = _mm512_permute_ps(x, 0xB1);
        m = 0xAAAA;
    } else if (h == 2) {
        s = _mm512_permute_ps(x, 0x4E);
        m = 0xCCCC;
    } else if (h == 4) {
        s = _mm512_shuffle_f32x4(x, x, 0xB1);
        m = 0xF0F0;
    } else {
        s = _mm512_shuffle_f32x4(x, x, 0x4E);
        m = 0xFF00;
    }
    return _mm512_mask_sub_ps(_mm512_add_ps(x, s), m, s, x);
#else
    if (h == 1) {
        const __m256 s = _mm256_permute_ps(x, 0xB1);
        return _mm256_blend_ps(_mm256_add_ps(x, s), _mm256_sub_ps(s, x), 0xAA);
    }
    if (h == 2) {
        const __m256 s = _mm256_permute_ps(x, 0x4E);
        return _mm256_blend_ps(_mm256_add_ps(x, s), _mm256_sub_ps(s, x), 0xCC);
    }
    const __m256 s = _mm256_permute2f128_ps(x, x, 0x01);
    return _mm256_blend_ps(_mm256_add_ps(x, s), _mm256_sub_ps(s, x), 0xF0);
#endif
}

/* hadamard_block for block = NV * VW (NV <= 16), the block held in registers: the stages
 * inside a vector, then those across vectors, in the scalar loop's order (h = 1, 2, 4, ...),
 * each butterfly the same a + b, a - b; then the scale. Bit-equal to the scalar loop. */
static inline __attribute__((always_inline)) void hadamard_block_vec(float *o, const int64_t NV,
                                                                     float scale) {
    VF r[16];
    for (int64_t c = 0; c < NV; c++) {
        r[c] = VLOAD(o + VW * c);
        for (int64_t h = 1; h < VW; h *= 2) r[c] = hadamard_lanes(r[c], h);
    }
    for (int64_t hv = 1; hv < NV; hv *= 2) /* h = hv * VW */
        for (int64_t i = 0; i < NV; i += 2 * hv)
            for (int64_t j = i; j < i + hv; j++) {
                const VF a = r[j], b = r[j + hv];
                r[j] = VADD(a, b);
#if VEC_PATH == 512
                r[j + hv] = _mm512_sub_ps(a, b);
#else
                r[j + hv] = _mm256_sub_ps(a, b);
#endif
            }
    const VF sc = VSET1(scale);
    for (int64_t c = 0; c < NV; c++) VSTORE(o + VW * c, VMUL(r[c], sc));
}
#endif

static inline void hadamard_block(float *o, int64_t block, float scale) {
#if VEC_PATH
    if (block == 4 * VW) { /* SmolLM2's 64 (AVX-512), or 32 on AVX2: unrolled */
        hadamard_block_vec(o, 4, scale);
        return;
    }
    if (block == 8 * VW) {
        hadamard_block_vec(o, 8, scale);
        return;
    }
    if (block % VW == 0 && block <= 16 * VW) {
        hadamard_block_vec(o, block / VW, scale);
        return;
    }
#endif
    for (int64_t h = 1; h < block; h *= 2)
        for (int64_t i = 0; i < block; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const float a = o[j], b = o[j + h];
                o[j] = a + b;
                o[j + h] = a - b;
            }
    for (int64_t j = 0; j < block; j++) o[j] *= scale;
}

int kvmesh_hadamard_f32(const float *x, float *out, int64_t n, int64_t D, int64_t block,
                        float scale, int num_threads) {
    if (block < 1 || (block & (block - 1)) || D % block) return 2;
    const int64_t rows = n * (D / block);
#pragma omp parallel for num_threads(num_threads) if (rows * block >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + r * block;
        if (o != x + r * block) memcpy(o, x + r * block, sizeof(float) * block);
        hadamard_block(o, block, scale);
    }
    return 0;
}

/* kvmesh_hadamard_f32 in place on one thread, for the kernels that fuse int4's rotations
 * (the V rows a write stores, a decode step's output): the same butterflies, the same bits.
 * x (n, D), block a power of two dividing D (the caller checks). */
static void hadamard_rows(float *x, int64_t n, int64_t D, int64_t block, float scale) {
    for (int64_t r = 0; r < n * (D / block); r++) hadamard_block(x + r * block, block, scale);
}

void kvmesh_hadamard_rows_(float *x, int64_t n, int64_t D, int64_t block, float scale) {
    hadamard_rows(x, n, D, block, scale);
}

/* A fused rotation's block: 0 (no rotation) or a power of two dividing D. */
static int rot_ok(int64_t rot_block, int64_t D) {
    return rot_block >= 0 && !(rot_block & (rot_block - 1)) && (!rot_block || D % rot_block == 0);
}

/* A quantized cache's exact run for one prefill chunk (worker/attention/own_page.py,
 * exact_own_pages), in one call instead of ~10 torch ops a layer: out_k, out_v (lx, HD)
 * each get rows [0, head) from the request's residual ring (res_k/res_v (R, bs, HD), ring
 * pages ring[0..nring), whole pages in order, their first head rows), rows [head, head + n)
 * from the chunk's k, v (token rows ldk, ldv floats apart), zeros after. rot_block > 0: the
 * ring's V rows (stored rotated) are rotated back as kvmesh_hadamard_f32 rotates them (the
 * rotation is its own inverse), over D-wide heads. Returns 0, or 2 for bad sizes or a ring
 * page out of range. */
int kvmesh_exact_rows_f32(const float *res_k, const float *res_v, int64_t R, const int64_t *ring,
                          int64_t nring, int64_t bs, const float *k, int64_t ldk, const float *v,
                          int64_t ldv, int64_t n, int64_t head, int64_t lx, int64_t HD, int64_t D,
                          float *out_k, float *out_v, int64_t rot_block, float rot_scale) {
    if (bs < 1 || HD < 1 || D < 1 || HD % D || n < 0 || head < 0 || nring < 0) return 2;
    if (head > nring * bs || head + n > lx || ldk < HD || ldv < HD) return 2;
    if (!rot_ok(rot_block, D)) return 2;
    for (int64_t i = 0; i < nring; i++)
        if (ring[i] < 0 || ring[i] >= R) return 2;
    for (int64_t r = 0; r < head; r++) {
        const int64_t off = (ring[r / bs] * bs + r % bs) * HD;
        memcpy(out_k + r * HD, res_k + off, sizeof(float) * HD);
        memcpy(out_v + r * HD, res_v + off, sizeof(float) * HD);
    }
    for (int64_t t = 0; t < n; t++) {
        memcpy(out_k + (head + t) * HD, k + t * ldk, sizeof(float) * HD);
        memcpy(out_v + (head + t) * HD, v + t * ldv, sizeof(float) * HD);
    }
    memset(out_k + (head + n) * HD, 0, sizeof(float) * (lx - head - n) * HD);
    memset(out_v + (head + n) * HD, 0, sizeof(float) * (lx - head - n) * HD);
    if (rot_block) hadamard_rows(out_v, head, HD, rot_block, rot_scale);
    return 0;
}

/* kvmesh_decode_attention_quant, then the output rotated back (int4 keeps V rotated): out
 * as kvmesh_hadamard_f32(out, block, scale) leaves it. rot_block 0: no rotation; else a power
 * of two dividing D (2 if not). */
int kvmesh_decode_attention_quant_rot(int fmt, const float *q, const uint8_t *k,
                                      const uint8_t *ks, const uint8_t *kz, const uint8_t *v,
                                      const uint8_t *vs, const uint8_t *vz, const float *res_k,
                                      const float *res_v, const int64_t *block_tables,
                                      const int64_t *context_lens, const int64_t *res_slots,
                                      float *out, int64_t B, int64_t P, int64_t res_pages,
                                      int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                                      int64_t page_stride, float scale, int64_t window,
                                      int num_threads, int64_t rot_block, float rot_scale) {
    if (!rot_ok(rot_block, D)) return 2;
    return decode_quant(fmt, q, k, ks, kz, v, vs, vz, res_k, res_v, block_tables, context_lens,
                        res_slots, out, B, P, res_pages, Hq, Hkv, D, bs, page_stride, scale,
                        window, num_threads, rot_block, rot_scale);
}

/* ------------------------------------------------------------------------------------------
 * Causal prefill attention (flash style) over token-major fp32 Q/K/V:
 *   q, out (n, Hq, D); k, v (ctx, Hkv, D), q/k/v token rows at any stride (the fused qkv
 *   projection's output is read where it lies); query t sits at position ctx - n + t and
 *   sees the keys at positions <= its own (the fresh prefill is ctx == n; a later chunk
 *   whose K/V are contiguous has ctx > n). Query head g reads KV head g / G (G = Hq / Hkv), as SDPA's
 *   enable_gqa does. Its torch twin is SDPA (is_causal / a bottom-right causal mask).
 *
 * A work item is (KV head, block of bq query tokens): its rows are the bq tokens x G query
 * heads of that KV head, so each K/V block is loaded once for the whole group. Per key block
 * of bk keys: S = Q K^T by a register-blocked micro-kernel (PF_MR rows x PF_NV vectors of
 * keys, K packed transposed so a row's q[d] is broadcast against 16 (8) keys' d-th
 * component), an online softmax in base 2 (q is pre-scaled by scale * log2(e); exp2 by a
 * degree-5 polynomial, relative error ~2.4e-7, exactly 0 below 2^-126; each row's sum kept
 * per lane), then O += P V by a second micro-kernel (PF_MR rows x PF_NVD vectors of O held
 * in registers across the keys).
 * Key blocks past a block's last query are never visited; inside the diagonal block a group
 * of rows only computes and sums the keys it can see. Items are handed out largest first
 * (schedule dynamic), which balances the triangle's uneven cost over the threads. The scalar
 * build (or D off the vector width) runs a plain two-pass loop per query row.
 * ---------------------------------------------------------------------------------------- */
#define PF_LOG2E 1.4426950408889634f

static int pf_scalar(const float *q, int64_t ldq, const float *k, int64_t ldk, const float *v,
                     int64_t ldv, float *out, int64_t n, int64_t ctx, int64_t Hq, int64_t Hkv,
                     int64_t D, float scale, int num_threads) {
    const int64_t G = Hq / Hkv;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (n * ctx * Hq >= 65536)
    {
        float *s = (float *)malloc(sizeof(float) * (ctx > 0 ? ctx : 1));
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 16)
        for (int64_t i = 0; i < n * Hq; i++) {
            if (!s) continue;
            const int64_t t = (n - 1) - i / Hq, g = i % Hq, h = g / G;
            const int64_t nk = ctx - n + t + 1; /* keys 0 .. pos */
            const float *qr = q + t * ldq + g * D;
            float m = -INFINITY;
            for (int64_t j = 0; j < nk; j++) {
                const float *kr = k + j * ldk + h * D;
                float dot = 0.0f;
                for (int64_t d = 0; d < D; d++) dot += qr[d] * kr[d];
                s[j] = dot * scale;
                m = s[j] > m ? s[j] : m;
            }
            float l = 0.0f;
            for (int64_t j = 0; j < nk; j++) {
                s[j] = expf(s[j] - m);
                l += s[j];
            }
            float *o = out + (t * Hq + g) * D;
            for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
            for (int64_t j = 0; j < nk; j++) {
                const float *vr = v + j * ldv + h * D, p = s[j];
                for (int64_t d = 0; d < D; d++) o[d] += p * vr[d];
            }
            const float inv = 1.0f / l;
            for (int64_t d = 0; d < D; d++) o[d] *= inv;
        }
        free(s);
    }
    return failed;
}

#if VEC_PATH
#define PF_KT (PF_NV * VW) /* keys per QK micro-tile */

/* s[i][c0 .. c0 + nv * VW) = qp[i] . kt[:, col] for mr rows: one micro-tile of nv vectors */
static inline __attribute__((always_inline)) void pf_qk_tile(const float *qp, int64_t D,
                                                             const float *kt, int64_t ldk,
                                                             int64_t bk, float *s, int64_t c0,
                                                             const int mr, const int nv) {
    VF acc[PF_MR][PF_NV];
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < nv; c++) acc[i][c] = VZERO();
    for (int64_t d = 0; d < D; d++) {
        VF kv[PF_NV];
        for (int c = 0; c < nv; c++) kv[c] = VLOAD(kt + d * ldk + c0 + c * VW);
        for (int i = 0; i < mr; i++) {
            const VF qb = VSET1(qp[i * D + d]);
            for (int c = 0; c < nv; c++) acc[i][c] = VFMA(qb, kv[c], acc[i][c]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < nv; c++) VSTORE(s + i * bk + c0 + c * VW, acc[i][c]);
}

/* s[i][0 .. ncol) = qp[i] . kt[:, col] for mr rows, ncol a multiple of VW: whole micro-tiles
 * of PF_KT keys, then one narrower tile for the rest (a row's range rounded up to VW keys,
 * not to PF_KT: the own-page kernel's exact windows are ~17-32 keys wide, and a 64-key tile
 * there computed twice the scores it needed). Each score is the same dot product in the same
 * order whatever the tile's width. */
static inline __attribute__((always_inline)) void pf_qk(const float *qp, int64_t D,
                                                        const float *kt, int64_t ldk,
                                                        int64_t bk, float *s, int64_t ncol,
                                                        const int mr) {
    int64_t c0 = 0;
    for (; c0 + PF_KT <= ncol; c0 += PF_KT) pf_qk_tile(qp, D, kt, ldk, bk, s, c0, mr, PF_NV);
    switch ((ncol - c0) / VW) {
#if PF_NV > 3
    case 3: pf_qk_tile(qp, D, kt, ldk, bk, s, c0, mr, 3); break;
#endif
#if PF_NV > 2
    case 2: pf_qk_tile(qp, D, kt, ldk, bk, s, c0, mr, 2); break;
#endif
    case 1: pf_qk_tile(qp, D, kt, ldk, bk, s, c0, mr, 1); break;
    default: break;
    }
}

/* o[i][:] = o[i][:] * alpha[i] + sum_{j < jn} p[i][j] * v[j][:] for mr rows */
static inline __attribute__((always_inline)) void pf_pv(const float *p, int64_t bk,
                                                        const float *vb, int64_t vstride,
                                                        int64_t jn, float *o, int64_t D,
                                                        const float *alpha, const int mr) {
    for (int64_t d0 = 0; d0 < D; d0 += PF_NVD * VW) {
        VF acc[PF_MR][PF_NVD];
        for (int i = 0; i < mr; i++) {
            const VF a = VSET1(alpha[i]);
            for (int c = 0; c < PF_NVD; c++) acc[i][c] = VMUL(VLOAD(o + i * D + d0 + c * VW), a);
        }
        for (int64_t j = 0; j < jn; j++) {
            VF vv[PF_NVD];
            for (int c = 0; c < PF_NVD; c++) vv[c] = VLOAD(vb + j * vstride + d0 + c * VW);
            for (int i = 0; i < mr; i++) {
                const VF pb = VSET1(p[i * bk + j]);
                for (int c = 0; c < PF_NVD; c++) acc[i][c] = VFMA(pb, vv[c], acc[i][c]);
            }
        }
        for (int i = 0; i < mr; i++)
            for (int c = 0; c < PF_NVD; c++) VSTORE(o + i * D + d0 + c * VW, acc[i][c]);
    }
}

#define PF_DISPATCH(mr, call_with_mr)                                                          \
    switch (mr) {                                                                              \
    case 6: call_with_mr(6); break;                                                            \
    case 5: call_with_mr(5); break;                                                            \
    case 4: call_with_mr(4); break;                                                            \
    case 3: call_with_mr(3); break;                                                            \
    case 2: call_with_mr(2); break;                                                            \
    default: call_with_mr(1); break;                                                           \
    }

static inline int pf_vec_ok(int64_t D, int64_t bk) {
    return D % (PF_NVD * VW) == 0 && D <= 256 && bk % PF_KT == 0;
}

/* One work item: KV head h, query tokens [t0, t1). ktr: the head's keys transposed, (D,
 * ldk), zero past ctx. q, v: rows of ldq, ldv floats (token t's query head g at q + t * ldq
 * + g * D). Scratch: qp, o (R x D), s (R x bk), lv (R x VW: each row's softmax sum, kept
 * per lane and summed once at the end), m, alpha (R), R = (t1 - t0) x G. */
static void pf_block(const float *q, int64_t ldq, const float *ktr, int64_t ldk, const float *v,
                     int64_t ldv, float *out, int64_t n, int64_t ctx, int64_t Hq, int64_t Hkv,
                     int64_t D, float qscale, int64_t h, int64_t t0, int64_t t1, int64_t bk,
                     float *work) {
    const int64_t G = Hq / Hkv, R = (t1 - t0) * G, off = ctx - n;
    float *qp = work, *o = qp + R * D, *s = o + R * D, *lv = s + R * bk;
    float *m = lv + R * VW, *alpha = m + R;
    for (int64_t r = 0; r < R; r++) {
        const float *src = q + (t0 + r / G) * ldq + (h * G + r % G) * D;
        for (int64_t d = 0; d < D; d++) qp[r * D + d] = src[d] * qscale;
        m[r] = -INFINITY;
    }
    memset(o, 0, sizeof(float) * R * D);
    memset(lv, 0, sizeof(float) * R * VW);
    const int64_t last = off + t1 - 1; /* the block's last query position */
    for (int64_t j0 = 0; j0 <= last; j0 += bk) {
        const int64_t nkb = (ctx - j0 < bk ? ctx - j0 : bk); /* keys in this block */
        const int64_t full = j0 + nkb - 1 <= off + t0;      /* no row masks a key of it */
        const float *kt = ktr + j0;
        for (int64_t r0 = 0; r0 < R; r0 += PF_MR) {
            const int mr = (int)(R - r0 < PF_MR ? R - r0 : PF_MR);
            /* the keys any row of this group sees: up to its last row's position */
            int64_t lim = full ? nkb : off + t0 + (r0 + mr - 1) / G - j0 + 1;
            lim = lim < 0 ? 0 : (lim > nkb ? nkb : lim);
            if (!lim) continue;
            const int64_t ncol = (lim + VW - 1) / VW * VW;
#define PF_QK(MR) pf_qk(qp + r0 * D, D, kt, ldk, bk, s + r0 * bk, ncol, MR)
            PF_DISPATCH(mr, PF_QK)
#undef PF_QK
            /* online softmax per row over its visible keys [0, lr); p = 0 beyond, up to
             * the group's ncol (what PV reads). A row that sees every column of the tile
             * (the blocks below the diagonal) takes no lane masks. */
            for (int i = 0; i < mr; i++) {
                const int64_t r = r0 + i;
                int64_t lr = full ? nkb : off + t0 + r / G - j0 + 1;
                lr = lr < 0 ? 0 : (lr > nkb ? nkb : lr);
                float *sr = s + r * bk;
                if (!lr) {
                    alpha[i] = 1.0f;
                    for (int64_t jj = 0; jj < ncol; jj += VW) VSTORE(sr + jj, VZERO());
                    continue;
                }
                const VF ninf = VSET1(-INFINITY);
                VF mx = ninf;
                if (lr == ncol) {
                    for (int64_t jj = 0; jj < ncol; jj += VW) mx = VMAXV(mx, VLOAD(sr + jj));
                } else {
                    for (int64_t jj = 0; jj < lr; jj += VW)
                        mx = VMAXV(mx, pf_keep_lt(VLOAD(sr + jj), lr - jj, ninf));
                }
                const float mb = pf_hmax(mx), mo = m[r], mn = mb > mo ? mb : mo;
                alpha[i] = exp2f(mo - mn); /* 0 when mo = -inf */
                const VF mv = VSET1(mn);
                VF sum = VMUL(VLOAD(lv + r * VW), VSET1(alpha[i]));
                for (int64_t jj = 0; jj < ncol; jj += VW) {
                    VF p = pf_exp2(VSUB(VLOAD(sr + jj), mv));
                    if (jj + VW > lr) p = pf_keep_lt(p, lr - jj, VZERO());
                    VSTORE(sr + jj, p);
                    sum = VADD(sum, p);
                }
                VSTORE(lv + r * VW, sum);
                m[r] = mn;
            }
#define PF_PV(MR)                                                                              \
    pf_pv(s + r0 * bk, bk, v + j0 * ldv + h * D, ldv, lim, o + r0 * D, D, alpha, MR)
            PF_DISPATCH(mr, PF_PV)
#undef PF_PV
        }
    }
    for (int64_t r = 0; r < R; r++) {
        float *dst = out + ((t0 + r / G) * Hq + h * G + r % G) * D;
        const float inv = 1.0f / VSUM(VLOAD(lv + r * VW));
        for (int64_t d = 0; d < D; d++) dst[d] = o[r * D + d] * inv;
    }
}
#endif /* VEC_PATH */

/* Returns 0, 1 (scratch allocation failed) or 2 (bad shape: Hq % Hkv, n > ctx, n < 0, a row
 * stride shorter than a row). q, k, v: token rows ldq, ldk, ldv floats apart, each row's
 * heads dense (the fused qkv projection's output is read in place: ldq = ldk = ldv = its
 * width); out (n, Hq, D) contiguous. bq, bk: query tokens and keys per block (<= 0: the
 * defaults, 64 tokens (fewer for G > 3) and 256 keys; a bk that is not a multiple of the QK
 * micro-tile's 64 (AVX-512) or 16 (AVX2) keys runs the scalar loop). force_scalar: the
 * plain loop even on a vector build (tests, benchmarks). */
int kvmesh_prefill_attention_f32(const float *q, int64_t ldq, const float *k, int64_t ldk_in,
                                 const float *v, int64_t ldv, float *out, int64_t n,
                                 int64_t ctx, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                                 int64_t bq, int64_t bk, int force_scalar, int num_threads) {
    if (n < 0 || ctx < n || Hkv < 1 || Hq % Hkv || D < 1) return 2;
    if (ldq < Hq * D || ldk_in < Hkv * D || ldv < Hkv * D) return 2;
    if (n == 0) return 0;
    /* 64 tokens (192 rows at G = 3); fewer for large groups, so a block's q, O and S stay
     * within ~half of a 1 MiB L2 (G = 8, D = 128: 24 tokens, 192 rows, ~250 KB) */
    if (bq <= 0) bq = Hq / Hkv <= 3 ? 64 : (192 / (Hq / Hkv) > 16 ? 192 / (Hq / Hkv) : 16);
    /* 256 keys: the per-row cost of a block (max, rescale) spread over more keys; 1.08x
     * faster than 64 at 2,048 tokens on Zen 4 (bench/README.md) */
    bk = bk > 0 ? bk : 256;
#if VEC_PATH
    if (!force_scalar && pf_vec_ok(D, bk)) {
        const int64_t G = Hq / Hkv, nqb = (n + bq - 1) / bq, items = Hkv * nqb;
        const int64_t R = bq * G;
        const int64_t floats = 2 * R * D + R * bk + R * VW + 2 * R + 16;
        const float qscale = scale * PF_LOG2E;
        /* K transposed once per KV head, (Hkv, D, ldk), zero past ctx (a key block reads up
         * to bk); +16 floats so rows d, d + 1 do not alias one L1 set at power-of-two ctx */
        const int64_t ldk = (ctx + bk - 1) / bk * bk + 16;
        float *ktr = (float *)aligned_alloc(64, (sizeof(float) * Hkv * D * ldk + 63) / 64 * 64);
        if (!ktr) return 1;
        int failed = 0;
#pragma omp parallel num_threads(num_threads) if (items > 1 && n * ctx * Hq >= 65536)
        {
#pragma omp for schedule(static)
            for (int64_t hd = 0; hd < Hkv * D; hd++) {
                const int64_t h = hd / D, d = hd % D;
                float *row = ktr + hd * ldk;
                for (int64_t j = 0; j < ctx; j++) row[j] = k[j * ldk_in + h * D + d];
                for (int64_t j = ctx; j < ldk; j++) row[j] = 0.0f;
            }
            float *work = (float *)aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
            if (!work) {
#pragma omp atomic write
                failed = 1;
            }
            /* largest items (the last query blocks see the most keys) first */
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < items; i++) {
                if (!work) continue;
                const int64_t qb = nqb - 1 - i / Hkv, h = i % Hkv;
                const int64_t t0 = qb * bq, t1 = t0 + bq < n ? t0 + bq : n;
                pf_block(q, ldq, ktr + h * D * ldk, ldk, v, ldv, out, n, ctx, Hq, Hkv, D, qscale,
                         h, t0, t1, bk, work);
            }
            free(work);
        }
        free(ktr);
        return failed;
    }
#endif
    (void)bq;
    (void)force_scalar;
    return pf_scalar(q, ldq, k, ldk_in, v, ldv, out, n, ctx, Hq, Hkv, D, scale, num_threads);
}

/* ------------------------------------------------------------------------------------------
 * Prefill attention over two runs of keys, each query reading one range of each (the own-page
 * view of a chunk over a quantized cache, worker/attention/own_page.py): run A (la keys, the
 * complete pages, read quantized) and run B (lb keys, the exact pages), fp32:
 *   q (n, Hq, D), token t's heads at q + t * ldq; out (n, Hq, D) contiguous;
 *   run A: ka, va (la, Hkv, D) token rows ldka, ldva floats apart, or int4 pages
 *     (kvmesh_prefill_attention_runs_int4_f32: la = pages x bs, dequantized in the kernel);
 *   run B: kb, vb (lb, Hkv, D), token rows ldkb, ldvb floats apart;
 *   ranges (n, 4) int64: query t reads A's keys [r0, r1) and B's keys [r2, r3).
 * One online softmax over both runs, each key read once, no mask tensor. The twin is SDPA
 * over cat(A, B) with the bool mask those ranges make (own_page_mask). The vector path is the
 * causal kernel's (pf_qk, pf_pv, pf_exp2 above); a key block's columns start at the first key
 * some row of the micro-tile reads, and each row keeps the lanes of its own range. Every
 * query must read at least one key.
 * rot_block > 0 (int4 keeps V rotated, as kvmesh_hadamard_f32(v, rot_block, rot_scale) leaves
 * it): run A's V holds rotated rows and run B's plain ones, and the output is plain: each
 * row's sum over run A is rotated back before run B's keys add to it (the rotation is
 * linear, so the softmax's later rescales commute with it). That saves rotating the chunk's
 * V and the whole output in separate passes (worker/attention/torch_backend.py).
 * ---------------------------------------------------------------------------------------- */
static int pr_scalar(const float *q, int64_t ldq, const float *const *ks,
                     const int64_t *ldks, const float *const *vs, const int64_t *ldvs,
                     const int64_t *lens, const int64_t *ranges, float *out, int64_t n,
                     int64_t Hq, int64_t Hkv, int64_t D, float scale, int64_t rot_block,
                     float rot_scale, int num_threads) {
    const int64_t G = Hq / Hkv;
    const int64_t cap = lens[0] + lens[1] > 0 ? lens[0] + lens[1] : 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (n * cap * Hq >= 65536)
    {
        float *s = (float *)malloc(sizeof(float) * cap);
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 16)
        for (int64_t i = 0; i < n * Hq; i++) {
            if (!s) continue;
            const int64_t t = i / Hq, g = i % Hq, h = g / G;
            const float *qr = q + t * ldq + g * D;
            float m = -INFINITY;
            int64_t ns = 0;
            for (int run = 0; run < 2; run++)
                for (int64_t j = ranges[t * 4 + 2 * run]; j < ranges[t * 4 + 2 * run + 1]; j++) {
                    const float *kr = ks[run] + j * ldks[run] + h * D;
                    float dot = 0.0f;
                    for (int64_t d = 0; d < D; d++) dot += qr[d] * kr[d];
                    s[ns] = dot * scale;
                    m = s[ns] > m ? s[ns] : m;
                    ns++;
                }
            float l = 0.0f;
            for (int64_t j = 0; j < ns; j++) {
                s[j] = expf(s[j] - m);
                l += s[j];
            }
            float *o = out + (t * Hq + g) * D;
            for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
            ns = 0;
            for (int run = 0; run < 2; run++) {
                for (int64_t j = ranges[t * 4 + 2 * run]; j < ranges[t * 4 + 2 * run + 1]; j++) {
                    const float *vr = vs[run] + j * ldvs[run] + h * D, p = s[ns++];
                    for (int64_t d = 0; d < D; d++) o[d] += p * vr[d];
                }
                if (run == 0 && rot_block) hadamard_rows(o, 1, D, rot_block, rot_scale);
            }
            const float inv = 1.0f / l;
            for (int64_t d = 0; d < D; d++) o[d] *= inv;
        }
        free(s);
    }
    return failed;
}

#if VEC_PATH
/* lanes of x outside [lo, hi) (relative to x's first lane) -> fill */
static inline VF pr_keep_in(VF x, int64_t lo, int64_t hi, VF fill) {
    lo = lo < 0 ? 0 : (lo > VW ? VW : lo);
    hi = hi < 0 ? 0 : (hi > VW ? VW : hi);
#if VEC_PATH == 512
    const uint32_t up = (1u << hi) - 1, down = (1u << lo) - 1;
    return _mm512_mask_blend_ps((__mmask16)(up & ~down), fill, x);
#else
    const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 m = _mm256_and_ps(_mm256_cmp_ps(iota, _mm256_set1_ps((float)lo), _CMP_GE_OQ),
                                   _mm256_cmp_ps(iota, _mm256_set1_ps((float)hi), _CMP_LT_OQ));
    return _mm256_blendv_ps(fill, x, m);
#endif
}

/* One work item: KV head h, query tokens [t0, t1), over both runs. ktr[run]: that run's keys
 * of head h transposed, (D, ldk[run]), zero past its length up to ldk. Scratch as pf_block. */
static void pr_block(const float *q, int64_t ldq, const float *const *ktr, const int64_t *ldk,
                     const float *const *vs, const int64_t *ldvs, const int64_t *lens,
                     const int64_t *ranges, float *out, int64_t Hq, int64_t Hkv, int64_t D,
                     float qscale, int64_t h, int64_t t0, int64_t t1, int64_t bk,
                     int64_t rot_block, float rot_scale, float *work) {
    const int64_t G = Hq / Hkv, R = (t1 - t0) * G;
    float *qp = work, *o = qp + R * D, *s = o + R * D;
    float *m = s + R * bk, *l = m + R, *alpha = l + R;
    for (int64_t r = 0; r < R; r++) {
        const float *src = q + (t0 + r / G) * ldq + (h * G + r % G) * D;
        for (int64_t d = 0; d < D; d++) qp[r * D + d] = src[d] * qscale;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(o, 0, sizeof(float) * R * D);
    int a_read = 0; /* some row of the block read run A */
    for (int run = 0; run < 2; run++) {
        /* the keys of this run any query of the block reads */
        int64_t jlo = lens[run], jhi = 0;
        for (int64_t t = t0; t < t1; t++) {
            const int64_t a = ranges[t * 4 + 2 * run], b = ranges[t * 4 + 2 * run + 1];
            if (a >= b) continue;
            jlo = a < jlo ? a : jlo;
            jhi = b > jhi ? b : jhi;
        }
        if (run == 0) a_read = jlo < jhi;
        /* run A's V rotated (int4's Hadamard, rot_block > 0), run B's plain: the rows' sums
         * over run A turned back before run B adds to them (the rotation is linear, so the
         * later rescales by alpha commute with it) */
        if (run == 1 && rot_block && a_read) hadamard_rows(o, R, D, rot_block, rot_scale);
        const float *vrun = vs[run] + h * D;
        const int64_t vstride = ldvs[run];
        for (int64_t j0 = jlo; j0 < jhi; j0 += bk) {
            const int64_t nkb = jhi - j0 < bk ? jhi - j0 : bk;
            const float *kt = ktr[run] + j0;
            for (int64_t r0 = 0; r0 < R; r0 += PF_MR) {
                const int mr = (int)(R - r0 < PF_MR ? R - r0 : PF_MR);
                /* the micro-tile's columns: [glo, ghi) of this block, glo down to a vector */
                int64_t glo = nkb, ghi = 0;
                for (int i = 0; i < mr; i++) {
                    const int64_t t = t0 + (r0 + i) / G;
                    int64_t a = ranges[t * 4 + 2 * run] - j0, b = ranges[t * 4 + 2 * run + 1] - j0;
                    a = a < 0 ? 0 : a;
                    b = b > nkb ? nkb : b;
                    if (a >= b) continue;
                    glo = a < glo ? a : glo;
                    ghi = b > ghi ? b : ghi;
                }
                if (glo >= ghi) continue;
                /* columns [c0v, c0v + ncol), whole vectors from the one holding glo, inside
                 * the bk-wide rows of s: c0v + ncol rounds ghi <= nkb <= bk up to a vector, and
                 * bk is a multiple of VW (pf_vec_ok), so they end by bk */
                const int64_t c0v = glo / VW * VW;
                const int64_t ncol = (ghi - c0v + VW - 1) / VW * VW;
#define PR_QK(MR) pf_qk(qp + r0 * D, D, kt + c0v, ldk[run], bk, s + r0 * bk + c0v, ncol, MR)
                PF_DISPATCH(mr, PR_QK)
#undef PR_QK
                for (int i = 0; i < mr; i++) {
                    const int64_t r = r0 + i, t = t0 + r / G;
                    const int64_t a = ranges[t * 4 + 2 * run] - j0;
                    const int64_t b = ranges[t * 4 + 2 * run + 1] - j0;
                    float *sr = s + r * bk;
                    const int64_t lo = a < 0 ? 0 : a, hi = b > nkb ? nkb : b;
                    if (lo >= hi) {
                        alpha[i] = 1.0f;
                        for (int64_t jj = c0v; jj < c0v + ncol; jj += VW) VSTORE(sr + jj, VZERO());
                        continue;
                    }
                    const VF ninf = VSET1(-INFINITY);
                    VF mx = ninf;
                    for (int64_t jj = c0v; jj < c0v + ncol; jj += VW)
                        mx = VMAXV(mx, pr_keep_in(VLOAD(sr + jj), lo - jj, hi - jj, ninf));
                    const float mb = pf_hmax(mx), mo = m[r], mn = mb > mo ? mb : mo;
                    alpha[i] = exp2f(mo - mn); /* 0 when mo = -inf */
                    const VF mv = VSET1(mn);
                    VF sum = VZERO();
                    for (int64_t jj = c0v; jj < c0v + ncol; jj += VW) {
                        const VF p =
                            pr_keep_in(pf_exp2(VSUB(VLOAD(sr + jj), mv)), lo - jj, hi - jj, VZERO());
                        VSTORE(sr + jj, p);
                        sum = VADD(sum, p);
                    }
                    m[r] = mn;
                    l[r] = l[r] * alpha[i] + VSUM(sum);
                }
#define PR_PV(MR)                                                                              \
    pf_pv(s + r0 * bk + c0v, bk, vrun + (j0 + c0v) * vstride, vstride, ghi - c0v, o + r0 * D, D,  \
          alpha, MR)
                PF_DISPATCH(mr, PR_PV)
#undef PR_PV
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        float *dst = out + ((t0 + r / G) * Hq + h * G + r % G) * D;
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; d++) dst[d] = o[r * D + d] * inv;
    }
}
#endif /* VEC_PATH */

/* Run A of the two-run kernel: float rows, or int4 pages (P != NULL) of bs tokens each. */
typedef struct {
    const float *k, *v;
    int64_t ldk, ldv;
    const qpages *P;
    const int64_t *pages;
    int64_t bs;
} pr_run_a;

static int pr_checks(const int64_t *ranges, int64_t n, int64_t la, int64_t lb, int64_t Hq,
                     int64_t Hkv, int64_t D) {
    if (n < 0 || la < 0 || lb < 0 || Hkv < 1 || Hq % Hkv || D < 1) return 2;
    for (int64_t t = 0; t < n; t++) {
        const int64_t *r = ranges + t * 4;
        if (r[0] < 0 || r[0] > r[1] || r[1] > la || r[2] < 0 || r[2] > r[3] || r[3] > lb)
            return 2;
        if (r[0] == r[1] && r[2] == r[3]) return 2;
    }
    return 0;
}

static int pr_run(const float *q, int64_t ldq, const pr_run_a *A, int64_t la, const float *kb,
                  int64_t ldkb, const float *vb, int64_t ldvb, int64_t lb,
                  const int64_t *ranges, float *out, int64_t n, int64_t Hq, int64_t Hkv,
                  int64_t D, float scale, int64_t bq, int64_t bk, int64_t rot_block,
                  float rot_scale, int force_scalar, int num_threads) {
    if (n == 0) return 0;
    const int64_t HD = Hkv * D;
    if (bq <= 0) bq = Hq / Hkv <= 3 ? 64 : (192 / (Hq / Hkv) > 16 ? 192 / (Hq / Hkv) : 16);
    bk = bk > 0 ? bk : 256;
    const int quant = A->P != NULL;
#if VEC_PATH
    if (!force_scalar && pf_vec_ok(D, bk)) {
        const int64_t G = Hq / Hkv, nqb = (n + bq - 1) / bq, items = Hkv * nqb;
        const int64_t R = bq * G;
        int64_t floats = 2 * R * D + R * bk + 3 * R + 16;
        if (quant && floats < A->bs * D) floats = A->bs * D; /* an int4 page's K tile */
        const float qscale = scale * PF_LOG2E;
        /* each run's K transposed once per KV head, (Hkv, D, ldk), zero past its length (a
         * QK tile reads whole vectors: up to VW - 1 keys past a run's end, pf_qk); +16: see
         * kvmesh_prefill_attention_f32.
         * int4 pages: their V dequantized into vq, token-major (la, Hkv, D) */
        int64_t ldk[2], base[2];
        ldk[0] = (la + VW + 31) / 32 * 32 + 16; /* 16 mod 32: never a power of two */
        ldk[1] = (lb + VW + 31) / 32 * 32 + 16;
        base[0] = 0;
        base[1] = Hkv * D * ldk[0];
        const int64_t total = Hkv * D * (ldk[0] + ldk[1]) + (quant ? la * HD : 0);
        float *ktr = (float *)aligned_alloc(64, (sizeof(float) * total + 63) / 64 * 64);
        if (!ktr) return 1;
        float *vq = quant ? ktr + Hkv * D * (ldk[0] + ldk[1]) : NULL;
        const float *ks[2] = {A->k, kb}, *vs[2] = {quant ? vq : A->v, vb};
        const int64_t ldks[2] = {A->ldk, ldkb}, ldvs[2] = {quant ? HD : A->ldv, ldvb};
        const int64_t lens[2] = {la, lb};
        int failed = 0;
        const int64_t work_est = n * (la + lb) * Hq;
#pragma omp parallel num_threads(num_threads) if (items > 1 && work_est >= 65536)
        {
            float *work = (float *)aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
            if (!work) {
#pragma omp atomic write
                failed = 1;
            }
            for (int run = 0; run < 2; run++) {
                const int64_t L = lens[run], ld = ldk[run];
                if (run == 0 && quant) {
                    /* page i's head h: K rows into the tile (bs, D), then into the transposed
                     * rows h * D + d at columns i * bs.., V rows into vq */
                    const int64_t bs = A->bs, np = la / bs;
#pragma omp for schedule(static)
                    for (int64_t it = 0; it < np * Hkv; it++) {
                        if (!work) continue;
                        const int64_t i = it / Hkv, hh = it % Hkv;
                        int4_page_head(A->P, A->pages[i], bs, Hkv, D, hh, work, D,
                                       vq + i * bs * HD + hh * D, HD);
                        for (int64_t d = 0; d < D; d++) {
                            float *row = ktr + base[0] + (hh * D + d) * ld + i * bs;
                            for (int64_t t = 0; t < bs; t++) row[t] = work[t * D + d];
                        }
                    }
#pragma omp for schedule(static)
                    for (int64_t hd = 0; hd < Hkv * D; hd++)
                        for (int64_t j = L; j < ld; j++) ktr[base[0] + hd * ld + j] = 0.0f;
                    continue;
                }
#pragma omp for schedule(static)
                for (int64_t hd = 0; hd < Hkv * D; hd++) {
                    const int64_t hh = hd / D, d = hd % D;
                    float *row = ktr + base[run] + hd * ld;
                    const float *src = ks[run] + hh * D + d;
                    const int64_t lds = ldks[run];
                    for (int64_t j = 0; j < L; j++) row[j] = src[j * lds];
                    for (int64_t j = L; j < ld; j++) row[j] = 0.0f;
                }
            }
            /* a thread without scratch left keys unwritten: then no thread computes (every
             * thread reads `failed` after the fills' barriers, so all see the same value) */
            int skip;
#pragma omp atomic read
            skip = failed;
            /* later query blocks read the most keys: first */
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < items; i++) {
                if (!work || skip) continue;
                const int64_t qb = nqb - 1 - i / Hkv, h = i % Hkv;
                const int64_t t0 = qb * bq, t1 = t0 + bq < n ? t0 + bq : n;
                const float *kt[2] = {ktr + base[0] + h * D * ldk[0],
                                      ktr + base[1] + h * D * ldk[1]};
                pr_block(q, ldq, kt, ldk, vs, ldvs, lens, ranges, out, Hq, Hkv, D, qscale, h, t0,
                         t1, bk, rot_block, rot_scale, work);
            }
            free(work);
        }
        free(ktr);
        return failed;
    }
#endif
    (void)bq;
    (void)force_scalar;
    float *deq = NULL;
    const float *ks[2] = {A->k, kb}, *vs[2] = {A->v, vb};
    int64_t ldks[2] = {A->ldk, ldkb}, ldvs[2] = {A->ldv, ldvb};
    if (quant) { /* the scalar loop reads int4 pages dequantized first */
        deq = (float *)malloc(sizeof(float) * (2 * la * HD > 0 ? 2 * la * HD : 1));
        if (!deq) return 1;
        for (int64_t i = 0; i < la / A->bs; i++)
            for (int64_t h = 0; h < Hkv; h++)
                int4_page_head(A->P, A->pages[i], A->bs, Hkv, D, h, deq + i * A->bs * HD + h * D,
                               HD, deq + la * HD + i * A->bs * HD + h * D, HD);
        ks[0] = deq;
        vs[0] = deq + la * HD;
        ldks[0] = ldvs[0] = HD;
    }
    const int64_t lens[2] = {la, lb};
    const int rc = pr_scalar(q, ldq, ks, ldks, vs, ldvs, lens, ranges, out, n, Hq, Hkv, D,
                             scale, rot_block, rot_scale, num_threads);
    free(deq);
    return rc;
}

/* Returns 0, 1 (scratch allocation failed) or 2 (bad shape or ranges: a range outside its
 * run, or a query reading no key; a token row stride shorter than a row). bq, force_scalar
 * as kvmesh_prefill_attention_f32; bk (<= 0: 256 keys, as the causal kernel; 1.05-1.12x
 * faster than 64 on an int4 engine's own chunks of a 1,024-token prompt, bench/README.md). */
int kvmesh_prefill_attention_runs_f32(const float *q, int64_t ldq, const float *ka, int64_t ldka,
                                      const float *va, int64_t ldva, int64_t la,
                                      const float *kb, int64_t ldkb, const float *vb,
                                      int64_t ldvb, int64_t lb, const int64_t *ranges,
                                      float *out, int64_t n, int64_t Hq, int64_t Hkv, int64_t D,
                                      float scale, int64_t bq, int64_t bk, int64_t rot_block,
                                      float rot_scale, int force_scalar, int num_threads) {
    if (pr_checks(ranges, n, la, lb, Hq, Hkv, D) || !rot_ok(rot_block, D)) return 2;
    const int64_t HD = Hkv * D;
    if (ldq < Hq * D || ldka < HD || ldva < HD || ldkb < HD || ldvb < HD) return 2;
    const pr_run_a A = {ka, va, ldka, ldva, NULL, NULL, 0};
    return pr_run(q, ldq, &A, la, kb, ldkb, vb, ldvb, lb, ranges, out, n, Hq, Hkv, D, scale, bq,
                  bk, rot_block, rot_scale, force_scalar, num_threads);
}

/* The same over run A stored as int4 pages (the pool's components k, ks, kz, v, vs, vz, page
 * stride in bytes, as kvmesh_dequantize_int4_pages): la = np x bs keys, page ids pages (np,)
 * each in [0, num_pages), dequantized inside the kernel (K straight into its transposed rows,
 * V once into scratch) to the bits kvmesh_dequantize_int4_pages gives, so the result is the
 * float kernel's over those pages. Returns as kvmesh_prefill_attention_runs_f32, and 2 for a
 * head size int4 cannot take or a page id out of range. */
int kvmesh_prefill_attention_runs_int4_f32(
    const float *q, int64_t ldq, const uint8_t *k, const uint8_t *ks, const uint8_t *kz,
    const uint8_t *v, const uint8_t *vs, const uint8_t *vz, int64_t stride, const int64_t *pages,
    int64_t np, int64_t num_pages, int64_t bs, const float *kb, int64_t ldkb, const float *vb,
    int64_t ldvb, int64_t lb, const int64_t *ranges, float *out, int64_t n, int64_t Hq,
    int64_t Hkv, int64_t D, float scale, int64_t bq, int64_t bk, int64_t rot_block,
    float rot_scale, int force_scalar, int num_threads) {
    if (np < 0 || bs < 1 || !int4_head_ok(D) || !rot_ok(rot_block, D)) return 2;
    const int64_t la = np * bs, HD = Hkv * D;
    if (pr_checks(ranges, n, la, lb, Hq, Hkv, D)) return 2;
    if (ldq < Hq * D || ldkb < HD || ldvb < HD) return 2;
    for (int64_t i = 0; i < np; i++)
        if (pages[i] < 0 || pages[i] >= num_pages) return 2;
    const qpages P = {k, ks, kz, v, vs, vz, stride};
    const pr_run_a A = {NULL, NULL, 0, 0, &P, pages, bs};
    return pr_run(q, ldq, &A, la, kb, ldkb, vb, ldvb, lb, ranges, out, n, Hq, Hkv, D, scale, bq,
                  bk, rot_block, rot_scale, force_scalar, num_threads);
}
