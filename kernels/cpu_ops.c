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
