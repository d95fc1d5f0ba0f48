/*
 * Fused float32 elementwise kernels for the CPU runtime: the optimiser steps, one pass over the
 * parameter, its gradient and its state, and the relu's backward, one pass over its three
 * arrays, where NumPy makes one per operation (tensile_db/runtime/fused.py, Note [Fused
 * optimiser steps] and Note [Fused relu backward]).
 *
 * A plain C library, loaded by ctypes: it uses no Python API (the package builds it as a
 * setuptools extension only to compile it at install; nothing imports it). Each element goes
 * through the same float32 operations, in the same order, as the NumPy kernels of
 * tensile_db/runtime/kernels.py, so the results are theirs bit for bit: the package compiles it
 * with -ffp-contract=off (no fused multiply-add) and without -ffast-math. An elementwise loop has
 * no reduction, so the results do not depend on the threads either.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
/* AVX-512 and AVX2 copies besides the baseline, chosen once at load by the CPU */
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* g + wd * w as the NumPy kernels compute it without a temporary: (g / wd + w) * wd */
static inline float with_decay(float g, float w, float wd)
{
    return wd != 0.0f ? ((g / wd) + w) * wd : g;
}

VECTOR_CLONES static void adam_range(float *restrict w, const float *restrict g, float *restrict m,
                                     float *restrict v, int64_t lo, int64_t hi, float lr_t, float beta1,
                                     float beta2, float inv_root_c2, float eps, float wd)
{
    for (int64_t i = lo; i < hi; i++) {
        float gi = with_decay(g[i], w[i], wd);
        float mi = ((m[i] - gi) * beta1) + gi;
        float g2 = gi * gi;
        float vi = ((v[i] - g2) * beta2) + g2;
        float denominator = (sqrtf(vi) * inv_root_c2) + eps;
        m[i] = mi;
        v[i] = vi;
        w[i] = w[i] - ((mi / denominator) * lr_t);
    }
}

VECTOR_CLONES static void sgd_range(float *restrict w, const float *restrict g, float *restrict velocity,
                                    int64_t lo, int64_t hi, float lr, float momentum, float wd)
{
    for (int64_t i = lo; i < hi; i++) {
        float vi = (velocity[i] * momentum) + with_decay(g[i], w[i], wd);
        velocity[i] = vi;
        w[i] = w[i] - (vi * lr);
    }
}

/* dx = (1 - (y <= 0)) * dy, the float32 operations of kernels.relu_backward: dy where y > 0 or y
   is NaN, else 0 * dy (so -0 for a negative dy, NaN for a NaN or an infinite one, as NumPy) */
VECTOR_CLONES static void relu_backward_range(const float *restrict y, const float *restrict dy,
                                              float *restrict dx, int64_t lo, int64_t hi)
{
    for (int64_t i = lo; i < hi; i++) {
        float mask = y[i] <= 0.0f ? 1.0f : 0.0f;
        dx[i] = (1.0f - mask) * dy[i];
    }
}

/* [lo, hi) of this thread's part of n elements cut into one part per thread of the team, each
   a multiple of 16 elements (a cache line); without OpenMP, all of them */
static void team_part(int64_t n, int64_t *lo, int64_t *hi)
{
#ifdef _OPENMP
    int64_t parts = omp_get_num_threads(), k = omp_get_thread_num();
#else
    int64_t parts = 1, k = 0;
#endif
    int64_t step = ((n + parts - 1) / parts + 15) & ~(int64_t)15;
    *lo = step * k < n ? step * k : n;
    *hi = step * (k + 1) < n ? step * (k + 1) : n;
}

/*
 * Adam, in place over n float32 elements: w, m, v written, g read. lr_t = lr / (1 - beta1^t),
 * inv_root_c2 = 1 / sqrt(1 - beta2^t), both rounded to float32 by the caller; wd the L2 weight
 * decay (0: none). threads > 1 splits the elements over that many OpenMP threads; 1 touches no
 * OpenMP at all (a process forked after the team started must not).
 */
void tensile_adam_f32(float *w, const float *g, float *m, float *v, int64_t n, float lr_t, float beta1,
                      float beta2, float inv_root_c2, float eps, float wd, int threads)
{
    if (threads <= 1) {
        adam_range(w, g, m, v, 0, n, lr_t, beta1, beta2, inv_root_c2, eps, wd);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi;
        team_part(n, &lo, &hi);
        adam_range(w, g, m, v, lo, hi, lr_t, beta1, beta2, inv_root_c2, eps, wd);
    }
}

/* SGD with momentum, in place over n float32 elements: w and velocity written, g read. */
void tensile_sgd_f32(float *w, const float *g, float *velocity, int64_t n, float lr, float momentum, float wd,
                     int threads)
{
    if (threads <= 1) {
        sgd_range(w, g, velocity, 0, n, lr, momentum, wd);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi;
        team_part(n, &lo, &hi);
        sgd_range(w, g, velocity, lo, hi, lr, momentum, wd);
    }
}

/* The relu's backward over n float32 elements from its forward output y: dx written, y and dy
   read (dx overlapping neither). threads as for tensile_adam_f32. */
void tensile_relu_backward_f32(const float *y, const float *dy, float *dx, int64_t n, int threads)
{
    if (threads <= 1) {
        relu_backward_range(y, dy, dx, 0, n);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi;
        team_part(n, &lo, &hi);
        relu_backward_range(y, dy, dx, lo, hi);
    }
}

/* memcpy of n bytes from src to dst (not overlapping), split over threads OpenMP threads in parts
   of whole cache lines; threads as for tensile_adam_f32. */
void tensile_copy(void *dst, const void *src, int64_t n, int threads)
{
    if (threads <= 1) {
        memcpy(dst, src, (size_t)n);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi;
        team_part((n + 3) / 4, &lo, &hi);          /* in 4-byte words: parts of 64-byte lines */
        lo *= 4;
        hi = hi * 4 < n ? hi * 4 : n;
        if (hi > lo)
            memcpy((char *)dst + lo, (const char *)src + lo, (size_t)(hi - lo));
    }
}

/* One row's part of the column moments below: s1[j] and s2[j] gain (row[j] - shift[j]) and its
   square, in double precision. */
static inline void add_moments(const float *restrict row, int64_t f, const double *restrict shift,
                               double *restrict s1, double *restrict s2)
{
    for (int64_t j = 0; j < f; j++) {
        double d = (double)row[j] - shift[j];
        s1[j] += d;
        s2[j] += d * d;
    }
}

/* Column moments of n rows of f float32 columns, row-major: s1[j] and s2[j] gain the sums of
   (x[i][j] - shift[j]) and of its square, in double precision, row after row (one thread: the
   same sums on every run). The shifted sums give the mean and the variance in one pass over x
   (tensile_db/runtime/preprocess.py fit_scaling). */
VECTOR_CLONES void tensile_moments_f32(const float *restrict x, int64_t n, int64_t f, const double *restrict shift,
                                       double *restrict s1, double *restrict s2)
{
    for (int64_t i = 0; i < n; i++)
        add_moments(x + i * f, f, shift, s1, s2);
}

/* tensile_moments_f32 of the rows rows[0..n) of x, in that order (the same sums as on a copy of
   them gathered first); every index is in x (the caller checks). */
VECTOR_CLONES void tensile_moments_rows_f32(const float *restrict x, const int64_t *restrict rows, int64_t n,
                                            int64_t f, const double *restrict shift, double *restrict s1,
                                            double *restrict s2)
{
    for (int64_t i = 0; i < n; i++)
        add_moments(x + rows[i] * f, f, shift, s1, s2);
}

/* The affine scaling of n rows of f float32 columns, row-major: out[i][j] = (x[i][j] -
   center[j]) / spread[j], a float32 subtraction then a float32 division, as NumPy's
   np.subtract(x, center, dtype=float32) and the in-place division compute it (the same bits).
   out may be x (each element is read before it is written), so neither is restrict. One pass
   and one thread: NumPy broadcasts the (f,) row over x in f-element inner loops, one call a
   row (tensile_db/runtime/model.py standardize). */
VECTOR_CLONES void tensile_scale_rows_f32(const float *x, int64_t n, int64_t f, const float *restrict center,
                                          const float *restrict spread, float *out)
{
    for (int64_t i = 0; i < n; i++) {
        const float *row = x + i * f;
        float *to = out + i * f;
        for (int64_t j = 0; j < f; j++)
            to[j] = (row[j] - center[j]) / spread[j];
    }
}
