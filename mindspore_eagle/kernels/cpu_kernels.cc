// CPU kernels of the teacher's forward for MindSpore's ops.Custom(func_type="aot"); built by kernels/cpu.py.
//
// Every entry point has MindSpore's AOT signature
//     int Name(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream, void *extra)
// with params = inputs then outputs, all float32 / int32 and C-contiguous; a nonzero return makes MindSpore raise.
// The tensor contracts are in kernels/cpu.py (the numpy references of the same math are there too).
//
// Batch invariance: every output row is computed by the same sequence of float operations whatever the number of
// rows in the call, the row's position in the call and the other rows: the 8-lane partial sums of a dot product
// run over the reduction index in one fixed order and are folded by one fixed tree; attention visits a row's
// visible cache slots in slot order and skips hidden ones. So a token's logits are bit-identical in a decode step,
// a tree verification and a batched step (docs/cpu_kernels.md, "Batch invariance").
//
// Vectors are GCC vector extensions (8 floats): AVX2 + FMA with -march=native on x86-64, NEON pairs on aarch64,
// plain scalar code elsewhere; the same source, so the arithmetic order is the same on every target (whether a
// multiply-add is fused differs between targets, never between two calls on one machine: see fma8).
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads / stores

static inline v8 load8(const float *p) { return *(const v8u *)p; }
// the first n < 8 floats of p, zeros after: tails go through the same vector multiply-add as full chunks, so the
// float operations of an output never depend on how a loop was split (a scalar tail may be fused differently)
static inline v8 load_tail(const float *p, int64_t n) {
  v8 v = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < n; ++i) v[i] = p[i];
  return v;
}
static inline void store8(float *p, v8 v) { *(v8u *)p = v; }
static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }
// a * b + c: one fused multiply-add where the CPU has FMA, else a multiply then an add. Built with
// -ffp-contract=off, so the compiler fuses nothing by itself: whether a product is fused must not depend on how a
// loop was inlined or unrolled (it did, once: one output column of a tail block differed between call shapes).
static inline v8 fma8(v8 a, v8 b, v8 c) {
#if defined(__FMA__) && defined(__AVX__)
  return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
static inline float fold8(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

static int g_threads = 1;

// Time spent inside each kernel (steady clock, ns) and its calls, for profiles: KernelStats / ResetKernelStats.
enum { K_LINEAR, K_NORM, K_ROPE, K_SWIGLU, K_ATTN, K_COUNT };
static std::atomic<int64_t> g_ns[K_COUNT], g_calls[K_COUNT];
struct Timed {
  int id;
  std::chrono::steady_clock::time_point t0;
  explicit Timed(int i) : id(i), t0(std::chrono::steady_clock::now()) {}
  ~Timed() {
    g_ns[id] += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    g_calls[id] += 1;
  }
};

// out [2 * K_COUNT] int64: (ns, calls) per kernel in the order linear, add_rms_norm, rope_qkv, swiglu, attention.
extern "C" int KernelStats(int64_t *out) {
  for (int i = 0; i < K_COUNT; ++i) out[2 * i] = g_ns[i], out[2 * i + 1] = g_calls[i];
  return K_COUNT;
}

extern "C" int ResetKernelStats() {
  for (int i = 0; i < K_COUNT; ++i) g_ns[i] = 0, g_calls[i] = 0;
  return 0;
}

extern "C" int SetThreads(int n) {
  g_threads = n < 1 ? 1 : n;
  return g_threads;
}

// dot(a, b) over n floats: 8-lane partial sums over i = 0, 8, 16, ... in order (the tail zero-padded), folded by
// fold8.
static inline float dot(const float *a, const float *b, int64_t n) {
  v8 acc = splat8(0.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = fma8(load8(a + i), load8(b + i), acc);
  if (i < n) acc = fma8(load_tail(a + i, n - i), load_tail(b + i, n - i), acc);
  return fold8(acc);
}

// ---------------------------------------------------------------------------------------------- Linear
// x [k, K] f32, w [N, K] f32 (HF [out, in]) -> y [k, N] f32, y[r, n] = dot(x[r], w[n]).
// Threads split N. k < 8 (memory-bound): blocks of 4 weight rows, each row of x in turn; k >= 8 (compute-bound on a
// 2-core CPU): each weight row against 8 rows of x at a time. Same float order per output either way.
template <int NR, int KR>
static inline void micro(const float *x, const float *w, float *y, int64_t K, int64_t N, int64_t r0, int64_t n0) {
  v8 acc[KR][NR];
#pragma GCC unroll 8
  for (int a = 0; a < KR; ++a)
#pragma GCC unroll 8
    for (int b = 0; b < NR; ++b) acc[a][b] = splat8(0.f);
  int64_t i = 0;
  for (; i + 8 <= K; i += 8) {
    v8 wv[NR];
#pragma GCC unroll 8
    for (int b = 0; b < NR; ++b) wv[b] = load8(w + (n0 + b) * K + i);
#pragma GCC unroll 8
    for (int a = 0; a < KR; ++a) {
      const v8 xv = load8(x + (r0 + a) * K + i);
#pragma GCC unroll 8
      for (int b = 0; b < NR; ++b) acc[a][b] = fma8(xv, wv[b], acc[a][b]);
    }
  }
  if (i < K) {
    const int64_t t = K - i;
    v8 wv[NR];
#pragma GCC unroll 8
    for (int b = 0; b < NR; ++b) wv[b] = load_tail(w + (n0 + b) * K + i, t);
#pragma GCC unroll 8
    for (int a = 0; a < KR; ++a) {
      const v8 xv = load_tail(x + (r0 + a) * K + i, t);
#pragma GCC unroll 8
      for (int b = 0; b < NR; ++b) acc[a][b] = fma8(xv, wv[b], acc[a][b]);
    }
  }
#pragma GCC unroll 8
  for (int a = 0; a < KR; ++a)
#pragma GCC unroll 8
    for (int b = 0; b < NR; ++b) y[(r0 + a) * N + n0 + b] = fold8(acc[a][b]);
}

extern "C" int Linear(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                      void *extra) {
  Timed timed(K_LINEAR);
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 2 || shapes[0][1] != shapes[1][1]) return 1;
  const float *x = (const float *)params[0], *w = (const float *)params[1];
  float *y = (float *)params[2];
  const int64_t k = shapes[0][0], K = shapes[0][1], N = shapes[1][0];
  if (k < 8) {  // memory-bound: 4 weight rows per block, one query row at a time
    const int64_t blocks = (N + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(g_threads)
    for (int64_t nb = 0; nb < blocks; ++nb) {
      const int64_t n0 = nb * 4;
      for (int64_t r = 0; r < k; ++r) {
        if (n0 + 4 <= N) micro<4, 1>(x, w, y, K, N, r, n0);
        else for (int64_t n = n0; n < N; ++n) micro<1, 1>(x, w, y, K, N, r, n);
      }
    }
  } else {      // compute-bound: one weight row against 8 query rows at a time
#pragma omp parallel for schedule(static) num_threads(g_threads)
    for (int64_t n = 0; n < N; ++n) {
      int64_t r = 0;
      for (; r + 8 <= k; r += 8) micro<1, 8>(x, w, y, K, N, r, n);
      for (; r < k; ++r) micro<1, 1>(x, w, y, K, N, r, n);
    }
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------- AddRmsNorm
// x [k, H], d [k, H], eps [1] -> y [k, H] = x + d, h [k, H] = y / sqrt(mean(y^2) + eps) (no weight: folded).
extern "C" int AddRmsNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra) {
  Timed timed(K_NORM);
  if (nparam != 5 || ndims[0] != 2) return 1;
  const float *x = (const float *)params[0], *d = (const float *)params[1];
  const float eps = ((const float *)params[2])[0];
  float *y = (float *)params[3], *h = (float *)params[4];
  const int64_t k = shapes[0][0], H = shapes[0][1];
  for (int64_t r = 0; r < k; ++r) {
    const float *xr = x + r * H, *dr = d + r * H;
    float *yr = y + r * H, *hr = h + r * H;
    for (int64_t i = 0; i < H; ++i) yr[i] = xr[i] + dr[i];
    const float inv = 1.0f / std::sqrt(dot(yr, yr, H) / (float)H + eps);
    for (int64_t i = 0; i < H; ++i) hr[i] = yr[i] * inv;
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------- RopeQKV
// qkv [k, (nh + 2 n_kv) hd] (q rows, k rows, v rows per token), cos [k, hd], sin_signed [k, hd], heads [2] i32
// = (nh, n_kv) -> q [k, nh, hd], key [k, n_kv, hd] rotated (x * cos + swap_halves(x) * sin_signed), value
// [k, n_kv, hd] copied.
extern "C" int RopeQKV(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                       void *extra) {
  Timed timed(K_ROPE);
  if (nparam != 7) return 1;
  const float *qkv = (const float *)params[0], *cs = (const float *)params[1], *sn = (const float *)params[2];
  const int32_t *heads = (const int32_t *)params[3];
  float *q = (float *)params[4], *kk = (float *)params[5], *v = (float *)params[6];
  const int64_t k = shapes[0][0], width = shapes[0][1], hd = shapes[1][1], half = hd / 2;
  const int64_t nh = heads[0], nkv = heads[1];
  if ((nh + 2 * nkv) * hd != width || hd % 2) return 2;
  for (int64_t r = 0; r < k; ++r) {
    const float *row = qkv + r * width, *c = cs + r * hd, *s = sn + r * hd;
    for (int64_t h = 0; h < nh + nkv; ++h) {
      const float *src = row + h * hd;
      float *dst = h < nh ? q + (r * nh + h) * hd : kk + (r * nkv + h - nh) * hd;
      for (int64_t i = 0; i < half; ++i) dst[i] = src[i] * c[i] + src[i + half] * s[i];
      for (int64_t i = half; i < hd; ++i) dst[i] = src[i] * c[i] + src[i - half] * s[i];
    }
    std::memcpy(v + r * nkv * hd, row + (nh + nkv) * hd, nkv * hd * sizeof(float));
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------- SwiGLU
// gu [k, 2F] (gate columns then up columns) -> out [k, F] = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
extern "C" int SwiGLU(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                      void *extra) {
  Timed timed(K_SWIGLU);
  if (nparam != 2 || ndims[0] != 2) return 1;
  const float *gu = (const float *)params[0];
  float *out = (float *)params[1];
  const int64_t k = shapes[0][0], F = shapes[0][1] / 2;
  for (int64_t r = 0; r < k; ++r) {
    const float *g = gu + r * 2 * F, *u = g + F;
    float *o = out + r * F;
    for (int64_t i = 0; i < F; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------- PagedAttention
// q [k, nh, hd]; key_cache / value_cache [R, hd] (head-major slot rows, kernels/kv.py); read_rows [n_kv, S] i32
// or [G, n_kv, S] (G groups of k / G query rows, each over its own rows); mask [k, S] f32 additive; scale [1]
// -> ctx [k, nh * hd]. Query head h reads KV head h / (nh / n_kv). A column whose mask is <= -1e4 is hidden and
// skipped; a row with no visible column gets zeros. Per (row, head): scores of the visible columns in column order,
// their max, then exp-weighted sum of values in the same order, divided once by the sum of weights.
extern "C" int PagedAttention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  Timed timed(K_ATTN);
  if (nparam != 7 || ndims[0] != 3) return 1;
  const float *q = (const float *)params[0], *kc = (const float *)params[1], *vc = (const float *)params[2];
  const int32_t *rows = (const int32_t *)params[3];
  const float *mask = (const float *)params[4];
  const float scale = ((const float *)params[5])[0];
  float *ctx = (float *)params[6];
  const int64_t k = shapes[0][0], nh = shapes[0][1], hd = shapes[0][2];
  const int64_t G = ndims[3] == 3 ? shapes[3][0] : 1, nkv = shapes[3][ndims[3] - 2], S = shapes[3][ndims[3] - 1];
  const int64_t R = shapes[1][0];
  if (k % G || nh % nkv || shapes[4][0] != k || shapes[4][1] != S) return 2;
  const int64_t kg = k / G, group = nh / nkv;
  int bad = 0;
#pragma omp parallel num_threads(g_threads)
  {
    std::vector<float> sc(S);
    std::vector<int32_t> vis(S);
    std::vector<v8> acc((hd + 7) / 8);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < k * nh; ++item) {
      const int64_t r = item / nh, h = item % nh, g = r / kg, kvh = h / group;
      const int32_t *rr = rows + (g * nkv + kvh) * S;
      const float *mr = mask + r * S, *qr = q + (r * nh + h) * hd;
      float *out = ctx + (r * nh + h) * hd;
      int64_t n = 0;
      float mx = -INFINITY;
      for (int64_t j = 0; j < S; ++j) {
        if (mr[j] <= -1e4f) continue;
        const int32_t row = rr[j];
        if (row < 0 || row >= R) { bad = 1; continue; }
        const float s = dot(qr, kc + (int64_t)row * hd, hd) * scale + mr[j];
        sc[n] = s;
        vis[n++] = row;
        mx = s > mx ? s : mx;
      }
      for (auto &a : acc) a = splat8(0.f);
      float den = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        const float p = std::exp(sc[t] - mx);
        den += p;
        const float *vr = vc + (int64_t)vis[t] * hd;
        const v8 pv = splat8(p);
        int64_t i = 0;
        for (; i + 8 <= hd; i += 8) acc[i / 8] = fma8(pv, load8(vr + i), acc[i / 8]);
        for (; i < hd; ++i) acc[i / 8][i % 8] += p * vr[i];
      }
      const float inv = n ? 1.0f / den : 0.f;
      int64_t i = 0;
      for (; i + 8 <= hd; i += 8) store8(out + i, acc[i / 8] * splat8(inv));
      for (; i < hd; ++i) out[i] = acc[i / 8][i % 8] * inv;
    }
  }
  return bad ? 3 : 0;
}
