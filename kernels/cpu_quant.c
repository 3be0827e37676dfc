/* Quantize full KV pages on CPU straight into the page pool: fp8 and int8 (symmetric, one
 * scale per token and head), int4 (keys per channel over the page, values per token in groups
 * of 32 with the clipping search). The byte layout and the arithmetic are kernels/quant.py's
 * (its torch quantizer is the twin): every product, quotient and sum rounds as torch's does
 * (built with -ffp-contract=off), scales round to fp16 before they divide, and rounding is
 * floor(y + 0.5). One difference is allowed and tested: int4 values sum each candidate
 * clipping's squared error in order, torch in its own vector order, so where two candidates'
 * errors tie to within rounding the two may keep different ones (both are the same error).
 *
 * Layout: k, v (n, bs, H, D) float32 contiguous, the full pages; page_ids (n,) int64; the
 * component bases (page 0 of the pool) and the page stride in bytes, as the decode kernel.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MIN_SCALE 6.103515625e-05f /* 2^-14, fp16's smallest normal */
enum { QFMT_FP8 = 1, QFMT_INT8 = 2, QFMT_INT4 = 3 };

static inline _Float16 scale16(float x) { return (_Float16)(x < MIN_SCALE ? MIN_SCALE : x); }

/* float -> float8_e4m3fn, round to nearest even; |x| <= 448 (the caller clamps) */
static inline uint8_t to_e4m3(float x) {
    const uint8_t sign = signbit(x) ? 0x80 : 0;
    const float a = fabsf(x);
    if (isnan(a)) return sign | 0x7f;
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.0f); /* subnormals (and 2^-6) */
    int e;
    const float fr = frexpf(a, &e); /* a = fr * 2^e, fr in [0.5, 1) */
    int m = (int)nearbyintf((fr * 2.0f - 1.0f) * 8.0f), E = e + 6;
    if (m == 8) {
        m = 0;
        E++;
    }
    return sign | (uint8_t)(E << 3) | (uint8_t)m;
}

/* one (token, head) row of D values, symmetric */
static inline void quant_sym_row(int fmt, const float *x, int64_t D, uint8_t *q, _Float16 *s) {
    const float qmax = fmt == QFMT_FP8 ? 448.0f : 127.0f;
    float amax = 0.0f;
    for (int64_t d = 0; d < D; d++) amax = fmaxf(amax, fabsf(x[d]));
    const _Float16 sc = scale16(amax / qmax);
    const float sf = (float)sc;
    *s = sc;
    for (int64_t d = 0; d < D; d++) {
        const float y = x[d] / sf;
        if (fmt == QFMT_FP8) {
            q[d] = to_e4m3(y < -448.0f ? -448.0f : (y > 448.0f ? 448.0f : y));
        } else {
            float r = floorf(y + 0.5f);
            r = r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r);
            q[d] = (uint8_t)(int8_t)r;
        }
    }
}

/* The int4 loops below are vectorised across lanes (channels, or value groups): GCC (12)
 * keeps a loop with floorf scalar under -ftrapping-math, so they are built without it. That
 * changes no result (every operation still rounds as IEEE says; only FP exception flags,
 * which nothing reads, may differ); -ffp-contract=off still holds. */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_TRAPS __attribute__((optimize("no-trapping-math")))
#else
#define NO_TRAPS
#endif

/* fminf / fmaxf as x86-64 glibc returns them (b when equal, so -0.0 vs 0.0 too; a when b
 * is NaN; aarch64's fminnm orders -0.0 below 0.0, so there a +-0 tie may differ),
 * as comparisons, so a loop of them vectorises instead of calling libm per value */
NO_TRAPS static inline float min_as_fminf(float a, float b) { return (a < b || b != b) ? a : b; }
NO_TRAPS static inline float max_as_fmaxf(float a, float b) { return (a > b || b != b) ? a : b; }

/* scale16 built as the int4 loops are, so that it inlines into them (GCC does not inline
 * across differing optimize attributes: a call per lane kept those loops scalar) */
NO_TRAPS static inline _Float16 scale16_nt(float x) {
    return (_Float16)(x < MIN_SCALE ? MIN_SCALE : x);
}

NO_TRAPS static inline float code4(float x, float z, float s) {
    const float r = floorf((x - z) / s + 0.5f);
    return r < 0.0f ? 0.0f : (r > 15.0f ? 15.0f : r);
}

/* int4 keys of head h: per channel over the page's bs tokens. xk: the page (bs, H, D). The
 * channel's zero and scale are converted to float once (the same values), and the codes of a
 * row are formed for every channel before they are packed, so the loops vectorise. */
NO_TRAPS static void quant_int4_k(const float *xk, int64_t bs, int64_t H, int64_t D, int64_t h,
                         uint8_t *q, _Float16 *ks, _Float16 *kz) {
    float zf[D], sf[D], c[D], mn[D], mx[D];
    for (int64_t d = 0; d < D; d++) {
        mn[d] = INFINITY;
        mx[d] = -INFINITY;
    }
    for (int64_t t = 0; t < bs; t++) { /* each channel over the tokens in order, as fminf */
        const float *x = xk + (t * H + h) * D;
        for (int64_t d = 0; d < D; d++) {
            mn[d] = min_as_fminf(mn[d], x[d]);
            mx[d] = max_as_fmaxf(mx[d], x[d]);
        }
    }
    for (int64_t d = 0; d < D; d++) {
        const _Float16 z = (_Float16)mn[d];
        const _Float16 s = scale16_nt((mx[d] - (float)z) / 15.0f);
        ks[h * D + d] = s;
        kz[h * D + d] = z;
        zf[d] = (float)z;
        sf[d] = (float)s;
    }
    for (int64_t t = 0; t < bs; t++) {
        const float *x = xk + (t * H + h) * D;
        uint8_t *qr = q + (t * H + h) * (D / 2);
        for (int64_t d = 0; d < D; d++) { /* code4, spelled out so that it vectorises */
            float r = floorf((x[d] - zf[d]) / sf[d] + 0.5f);
            r = r < 0.0f ? 0.0f : r;
            c[d] = r > 15.0f ? 15.0f : r;
        }
        for (int64_t i = 0; i < D / 2; i++)
            qr[i] = (uint8_t)((int)c[2 * i] | ((int)c[2 * i + 1] << 4));
    }
}

/* int4 values of head h of one page: per (token, group of g) the clipping factor with the
 * least squared error, the first on a tie (kernels/quant.py: INT4_V_CLIP_STEPS = 6). The page's
 * bs * D / g groups of the head are the lanes: up to V4_LANES of them are transposed side by
 * side, so each candidate's error is summed for all of them at once, each in its own value
 * order (the same order and arithmetic as one group at a time: the same bytes on every build).
 * xv: the page (bs, H, D); q, vs, vz: the page's value components. */
#define V4_LANES 64
NO_TRAPS static void quant_int4_v_head(const float *xv, int64_t bs, int64_t H, int64_t D, int64_t h,
                              uint8_t *q, _Float16 *vs, _Float16 *vz) {
    const int64_t g = D < 32 ? D : 32, Gn = D / g, NG = bs * Gn;
    float xt[32][V4_LANES];
    float mid[V4_LANES], half[V4_LANES], zf[V4_LANES], sf[V4_LANES], err[V4_LANES];
    float best[V4_LANES], bz[V4_LANES], bsc[V4_LANES], mn[V4_LANES], mx[V4_LANES];
    for (int64_t l0 = 0; l0 < NG; l0 += V4_LANES) {
        const int64_t m = NG - l0 < V4_LANES ? NG - l0 : V4_LANES;
        const int64_t mp = (m + 15) / 16 * 16; /* lanes computed: whole vectors, not all 64 */
        for (int64_t j = 0; j < m; j++) {
            const int64_t grp = l0 + j, t = grp / Gn, c = grp % Gn;
            const float *xg = xv + (t * H + h) * D + c * g;
            for (int64_t i = 0; i < g; i++) xt[i][j] = xg[i];
        }
        for (int64_t j = 0; j < V4_LANES; j++) {
            mn[j] = INFINITY;
            mx[j] = -INFINITY;
        }
        for (int64_t i = 0; i < g; i++) /* each group's values in order, as fminf */
            for (int64_t j = 0; j < m; j++) {
                mn[j] = min_as_fminf(mn[j], xt[i][j]);
                mx[j] = max_as_fmaxf(mx[j], xt[i][j]);
            }
        for (int64_t j = 0; j < m; j++) {
            mid[j] = (mn[j] + mx[j]) * 0.5f;
            half[j] = (mx[j] - mn[j]) * 0.5f;
        }
        for (int64_t j = m; j < mp; j++) { /* idle lanes: harmless values */
            mid[j] = half[j] = 0.0f;
            for (int64_t i = 0; i < g; i++) xt[i][j] = 0.0f;
        }
        for (int step = 0; step < 6; step++) {
            const float alpha = (float)((20 - step) / 20.0);
            for (int64_t j = 0; j < mp; j++) {
                const _Float16 z = (_Float16)(mid[j] - alpha * half[j]);
                zf[j] = (float)z;
                sf[j] = (float)scale16_nt(((mid[j] + alpha * half[j]) - (float)z) / 15.0f);
                err[j] = 0.0f;
            }
            for (int64_t i = 0; i < g; i++)
                for (int64_t j = 0; j < mp; j++) {
                    const float x = xt[i][j];
                    float r = floorf((x - zf[j]) / sf[j] + 0.5f); /* code4 */
                    r = r < 0.0f ? 0.0f : r;
                    r = r > 15.0f ? 15.0f : r;
                    const float e = (r * sf[j] + zf[j]) - x;
                    err[j] += e * e;
                }
            for (int64_t j = 0; j < m; j++)
                if (step == 0 || err[j] < best[j]) {
                    best[j] = err[j];
                    bz[j] = zf[j];
                    bsc[j] = sf[j];
                }
        }
        for (int64_t j = 0; j < m; j++) {
            const int64_t grp = l0 + j, t = grp / Gn, c = grp % Gn, r = t * H + h;
            const float *xg = xv + r * D + c * g;
            vs[r * Gn + c] = (_Float16)bsc[j]; /* exact: both came from fp16 */
            vz[r * Gn + c] = (_Float16)bz[j];
            uint8_t *qg = q + r * (D / 2) + c * g / 2;
            for (int64_t i = 0; i < g / 2; i++)
                qg[i] = (uint8_t)((int)code4(xg[2 * i], bz[j], bsc[j]) |
                                  ((int)code4(xg[2 * i + 1], bz[j], bsc[j]) << 4));
        }
    }
}

/* Pages i < n of k, v (n, bs, H, D) into pool pages page_ids[i]. The format is checked. */
static void quantize_pages(int fmt, const float *k, const float *v, int64_t n, int64_t bs,
                           int64_t H, int64_t D, const int64_t *page_ids, uint8_t *kd,
                           uint8_t *ks, uint8_t *kz, uint8_t *vd, uint8_t *vs, uint8_t *vz,
                           int64_t page_stride, int num_threads) {
    const int64_t g = D < 32 ? D : 32;
    const int64_t page = bs * H * D;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads) if (n * H > 1)
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t off = page_ids[i] * page_stride;
            const float *xk = k + i * page, *xv = v + i * page;
            if (fmt == QFMT_INT4) {
                quant_int4_k(xk, bs, H, D, h, kd + off, (_Float16 *)(ks + off),
                             (_Float16 *)(kz + off));
                quant_int4_v_head(xv, bs, H, D, h, vd + off, (_Float16 *)(vs + off),
                                  (_Float16 *)(vz + off));
            } else {
                for (int64_t t = 0; t < bs; t++) {
                    const int64_t r = t * H + h;
                    quant_sym_row(fmt, xk + r * D, D, kd + off + r * D, (_Float16 *)(ks + off) + r);
                    quant_sym_row(fmt, xv + r * D, D, vd + off + r * D, (_Float16 *)(vs + off) + r);
                }
            }
        }
    (void)g;
}

static int bad_format(int fmt, int64_t D) {
    if (fmt != QFMT_FP8 && fmt != QFMT_INT8 && fmt != QFMT_INT4) return 1;
    const int64_t g = D < 32 ? D : 32;
    return fmt == QFMT_INT4 && (D % 2 || D % g);
}

/* Returns 0, or 2 for an unknown format or a head size int4 cannot take. */
int kvmesh_quantize_pages(int fmt, const float *k, const float *v, int64_t n, int64_t bs,
                          int64_t H, int64_t D, const int64_t *page_ids, uint8_t *kd,
                          uint8_t *ks, uint8_t *kz, uint8_t *vd, uint8_t *vs, uint8_t *vz,
                          int64_t page_stride, int num_threads) {
    if (bad_format(fmt, D)) return 2;
    quantize_pages(fmt, k, v, n, bs, H, D, page_ids, kd, ks, kz, vd, vs, vz, page_stride,
                   num_threads);
    return 0;
}

void kvmesh_hadamard_rows_(float *x, int64_t n, int64_t D, int64_t block, float scale);

/* One layer's write of a step over a quantized cache with an fp32 residual ring, in one call
 * (kernels/cache_write.py's write_kv_cache_torch is the twin, kernels/cpu_quant.py the caller):
 *   1. the n completing pages are assembled, token by token, from complete_src (n, bs): a
 *      value < R * bs is a residual row (the ring as it was before this step), else the new
 *      token src - R * bs of k/v; then quantized into pool pages complete_pages (n,);
 *   2. each new token t with res_rows[t] >= 0 is stored into that residual row.
 * k, v: T new tokens, row t at k + t * k_row (H * D contiguous floats each: the fused qkv
 * output's K columns need no copy); rk, rv: the residual rows (R * bs, H, D) contiguous.
 * v_rot_block > 0: the new V rows are first rotated as kvmesh_hadamard_f32(v, v_rot_block,
 * v_rot_scale) rotates them (int4 keeps V rotated; the same bits), in a scratch copy.
 * Every index is checked before anything is written. Returns 0; 2 for a format, head size or
 * rotation block the kernel cannot take; 4 for an index out of range; 1 if the scratch
 * cannot be had. */
int kvmesh_write_kv_quant(int fmt, const float *k, const float *v, int64_t k_row, int64_t v_row,
                          int64_t T, const int64_t *res_rows, float *rk, float *rv, int64_t R,
                          int64_t n, const int64_t *complete_pages, const int64_t *complete_src,
                          int64_t num_pages, int64_t bs, int64_t H, int64_t D, uint8_t *kd,
                          uint8_t *ks, uint8_t *kz, uint8_t *vd, uint8_t *vs, uint8_t *vz,
                          int64_t page_stride, int num_threads, int64_t v_rot_block,
                          float v_rot_scale) {
    if (bad_format(fmt, D)) return 2;
    if (v_rot_block < 0 || (v_rot_block & (v_rot_block - 1)) || (v_rot_block && D % v_rot_block))
        return 2;
    const int64_t HD = H * D, rows = R * bs;
    for (int64_t t = 0; t < T; t++)
        if (res_rows[t] >= rows) return 4;
    for (int64_t i = 0; i < n; i++) {
        if (complete_pages[i] < 0 || complete_pages[i] >= num_pages) return 4;
        for (int64_t j = 0; j < bs; j++) {
            const int64_t src = complete_src[i * bs + j];
            if (src < 0 || src >= rows + T) return 4;
        }
    }
    float *vrot = NULL;
    if (v_rot_block && T) {
        if (!(vrot = malloc(sizeof(float) * T * HD))) return 1;
        /* threads where kvmesh_hadamard_f32 (the pass this replaces) takes them */
#pragma omp parallel for num_threads(num_threads) if (T * HD >= 65536)
        for (int64_t t = 0; t < T; t++) {
            memcpy(vrot + t * HD, v + t * v_row, sizeof(float) * HD);
            kvmesh_hadamard_rows_(vrot + t * HD, H, D, v_rot_block, v_rot_scale);
        }
        v = vrot;
        v_row = HD;
    }
    if (n) {
        float *full = malloc(sizeof(float) * 2 * n * bs * HD);
        if (!full) {
            free(vrot);
            return 1;
        }
        float *fk = full, *fv = full + n * bs * HD;
        for (int64_t r = 0; r < n * bs; r++) {
            const int64_t src = complete_src[r];
            const float *sk = src < rows ? rk + src * HD : k + (src - rows) * k_row;
            const float *sv = src < rows ? rv + src * HD : v + (src - rows) * v_row;
            memcpy(fk + r * HD, sk, sizeof(float) * HD);
            memcpy(fv + r * HD, sv, sizeof(float) * HD);
        }
        quantize_pages(fmt, fk, fv, n, bs, H, D, complete_pages, kd, ks, kz, vd, vs, vz,
                       page_stride, num_threads);
        free(full);
    }
    for (int64_t t = 0; t < T; t++) {
        const int64_t r = res_rows[t];
        if (r < 0) continue;
        memcpy(rk + r * HD, k + t * k_row, sizeof(float) * HD);
        memcpy(rv + r * HD, v + t * v_row, sizeof(float) * HD);
    }
    free(vrot);
    return 0;
}
