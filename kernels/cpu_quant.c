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

static inline float code4(float x, float z, float s) {
    const float r = floorf((x - z) / s + 0.5f);
    return r < 0.0f ? 0.0f : (r > 15.0f ? 15.0f : r);
}

/* int4 keys of head h: per channel over the page's bs tokens. xk: the page (bs, H, D). */
static void quant_int4_k(const float *xk, int64_t bs, int64_t H, int64_t D, int64_t h,
                         uint8_t *q, _Float16 *ks, _Float16 *kz) {
    for (int64_t d = 0; d < D; d++) {
        float mn = INFINITY, mx = -INFINITY;
        for (int64_t t = 0; t < bs; t++) {
            const float x = xk[(t * H + h) * D + d];
            mn = fminf(mn, x);
            mx = fmaxf(mx, x);
        }
        const _Float16 z = (_Float16)mn;
        const _Float16 s = scale16((mx - (float)z) / 15.0f);
        ks[h * D + d] = s;
        kz[h * D + d] = z;
    }
    for (int64_t t = 0; t < bs; t++) {
        const float *x = xk + (t * H + h) * D;
        uint8_t *qr = q + (t * H + h) * (D / 2);
        for (int64_t i = 0; i < D / 2; i++) {
            const int64_t a = h * D + 2 * i, b = a + 1;
            const float lo = code4(x[2 * i], (float)kz[a], (float)ks[a]);
            const float hi = code4(x[2 * i + 1], (float)kz[b], (float)ks[b]);
            qr[i] = (uint8_t)((int)lo | ((int)hi << 4));
        }
    }
}

/* int4 values of one (token, head) row: groups of g, the clipping factor with the least
 * squared error, the first on a tie (kernels/quant.py: INT4_V_CLIP_STEPS = 6). */
static void quant_int4_v_row(const float *x, int64_t D, uint8_t *q, _Float16 *vs, _Float16 *vz) {
    const int64_t g = D < 32 ? D : 32;
    for (int64_t c = 0; c < D / g; c++) {
        const float *xg = x + c * g;
        float mn = INFINITY, mx = -INFINITY;
        for (int64_t i = 0; i < g; i++) {
            mn = fminf(mn, xg[i]);
            mx = fmaxf(mx, xg[i]);
        }
        const float mid = (mn + mx) * 0.5f, half = (mx - mn) * 0.5f;
        float best = INFINITY;
        _Float16 bs_ = 0, bz = 0;
        for (int step = 0; step < 6; step++) {
            const float alpha = (float)((20 - step) / 20.0);
            const _Float16 z = (_Float16)(mid - alpha * half);
            const _Float16 s = scale16(((mid + alpha * half) - (float)z) / 15.0f);
            const float zf = (float)z, sf = (float)s;
            float err = 0.0f;
            for (int64_t i = 0; i < g; i++) {
                const float e = (code4(xg[i], zf, sf) * sf + zf) - xg[i];
                err += e * e;
            }
            if (step == 0 || err < best) {
                best = err;
                bs_ = s;
                bz = z;
            }
        }
        vs[c] = bs_;
        vz[c] = bz;
        const float zf = (float)bz, sf = (float)bs_;
        uint8_t *qg = q + c * g / 2;
        for (int64_t i = 0; i < g / 2; i++)
            qg[i] = (uint8_t)((int)code4(xg[2 * i], zf, sf) | ((int)code4(xg[2 * i + 1], zf, sf) << 4));
    }
}

/* Returns 0, or 2 for an unknown format or a head size int4 cannot take. */
int kvmesh_quantize_pages(int fmt, const float *k, const float *v, int64_t n, int64_t bs,
                          int64_t H, int64_t D, const int64_t *page_ids, uint8_t *kd,
                          uint8_t *ks, uint8_t *kz, uint8_t *vd, uint8_t *vs, uint8_t *vz,
                          int64_t page_stride, int num_threads) {
    if (fmt != QFMT_FP8 && fmt != QFMT_INT8 && fmt != QFMT_INT4) return 2;
    const int64_t g = D < 32 ? D : 32;
    if (fmt == QFMT_INT4 && (D % 2 || D % g)) return 2;
    const int64_t page = bs * H * D;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads) if (n * H > 1)
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t off = page_ids[i] * page_stride;
            const float *xk = k + i * page, *xv = v + i * page;
            if (fmt == QFMT_INT4) {
                quant_int4_k(xk, bs, H, D, h, kd + off, (_Float16 *)(ks + off),
                             (_Float16 *)(kz + off));
                for (int64_t t = 0; t < bs; t++) {
                    const int64_t r = t * H + h;
                    quant_int4_v_row(xv + r * D, D, vd + off + r * (D / 2),
                                     (_Float16 *)(vs + off) + r * (D / g),
                                     (_Float16 *)(vz + off) + r * (D / g));
                }
            } else {
                for (int64_t t = 0; t < bs; t++) {
                    const int64_t r = t * H + h;
                    quant_sym_row(fmt, xk + r * D, D, kd + off + r * D, (_Float16 *)(ks + off) + r);
                    quant_sym_row(fmt, xv + r * D, D, vd + off + r * D, (_Float16 *)(vs + off) + r);
                }
            }
        }
    return 0;
}
