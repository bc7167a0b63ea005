// CPU kernels of the teacher's forward for MindSpore's ops.Custom(func_type="aot"); built by kernels/cpu.py.
//
// Every entry point has MindSpore's AOT signature
//     int Name(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream, void *extra)
// with params = inputs then outputs, float32 / int32 (matmul weights float32 or float16) and C-contiguous; a nonzero
// return makes MindSpore raise.
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
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
#if (defined(__FMA__) || defined(__F16C__)) && defined(__AVX__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads / stores
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { return *(const v8u *)p; }
// the first n < 8 floats of p, zeros after: tails go through the same vector multiply-add as full chunks, so the
// float operations of an output never depend on how a loop was split (a scalar tail may be fused differently)
static inline v8 load_tail(const float *p, int64_t n) {
  v8 v = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < n; ++i) v[i] = p[i];
  return v;
}
static inline void store8(float *p, v8 v) { *(v8u *)p = v; }
// Weights may be stored as IEEE half floats (_Float16): a half converts to exactly one float, so a half-weight call
// runs the same float operations as a float32 call on the widened weights, and batch invariance holds unchanged.
// Activations, accumulators and caches stay float32. Eight halves widen in one F16C vcvtph2ps where the CPU has it
// (GCC 12 turns __builtin_convertvector of a half vector into eight scalar inserts, 1.7x slower than float32
// weights on the teacher's head: docs/cpu_kernels.md).
static inline v8 load8w(const float *p) { return load8(p); }
static inline v8 load8w(const _Float16 *p) {
#if defined(__F16C__) && defined(__AVX__)
  return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
  v8 v;
  for (int i = 0; i < 8; ++i) v[i] = (float)p[i];
  return v;
#endif
}
static inline v8 load_tailw(const float *p, int64_t n) { return load_tail(p, n); }
static inline v8 load_tailw(const _Float16 *p, int64_t n) {
  v8 v = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < n; ++i) v[i] = (float)p[i];
  return v;
}
// true when MindSpore's dtype string of an AOT argument names a half float (the weight may be float16)
static inline bool is_half(const char *dtype) { return dtype && std::strcmp(dtype, "float16") == 0; }
static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline v8 vmax8(v8 a, v8 b) { return a > b ? a : b; }   // lane by lane, as the scalar "a > b ? a : b"
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


// exp(x) on 8 lanes: Cephes' expf (range reduction by ln 2 in two parts, degree-6 polynomial, 2^n through the
// exponent bits), ~2 ulp for |x| < 88, clamped outside (exp(-88.4) -> 0). Lane-wise, so a value's exp never
// depends on its neighbours; scalar uses go through lane 0 (exp1).
static inline v8 exp8(v8 x) {
  const v8 hi = splat8(88.3762626647949f), lo = splat8(-88.3762626647949f);
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  const v8 fx = fma8(x, splat8(1.44269504088896341f), splat8(0.5f));
  v8 tf = __builtin_convertvector(__builtin_convertvector(fx, v8i), v8);
  tf = tf > fx ? tf - splat8(1.f) : tf;                                   // floor(x / ln 2 + 1/2)
  x = x - tf * splat8(0.693359375f);
  x = x - tf * splat8(-2.12194440e-4f);
  const v8 z = x * x;
  v8 y = splat8(1.9875691500e-4f);
  y = fma8(y, x, splat8(1.3981999507e-3f));
  y = fma8(y, x, splat8(8.3334519073e-3f));
  y = fma8(y, x, splat8(4.1665795894e-2f));
  y = fma8(y, x, splat8(1.6666665459e-1f));
  y = fma8(y, x, splat8(5.0000001201e-1f));
  y = fma8(y, z, x + splat8(1.f));
  const v8i e = (__builtin_convertvector(tf, v8i) + 127) << 23;
  return y * (v8)e;
}

// ---------------------------------------------------------------------------------------------- Threads
// The kernels' own thread pool (no OpenMP, so nothing process-wide is set for it). A parallel loop splits its range
// into g_threads contiguous parts (part p: [p n / P, (p + 1) n / P)); the calling thread runs part 0 and waits for
// the workers. Between calls a worker spins for g_spin_us microseconds (the next kernel of a forward usually comes
// within that) and then sleeps on a condition variable, so an idle pool never holds the cores that MindSpore's own
// ops (or any other library) run on next: an OpenMP pool that spins by default took them and needed a process-wide
// OMP_WAIT_POLICY=PASSIVE, which slowed every other OpenMP library in the process (docs/cpu_kernels.md, "Threads").
// Each output element is computed by one thread with the same float operations whichever thread it is, so the
// split never changes a result. A loop started while the pool is busy (a call from a second thread, or a loop
// inside a part) runs its parts one after another in the caller. One pool per thread count is made on first use and
// never destroyed, so SetThreads while another thread runs a loop cannot free a pool in use; a child after fork()
// makes fresh pools (the parent's workers are not in it).
static std::atomic<int> g_threads{1};
static std::atomic<int64_t> g_spin_us{50};
static thread_local bool t_in_part = false;  // this thread runs a part of a loop: a loop inside it runs serially
constexpr int MAX_POOL_THREADS = 256;

#if defined(__x86_64__) || defined(__i386__)
static inline void cpu_relax() { __builtin_ia32_pause(); }
#elif defined(__aarch64__)
static inline void cpu_relax() { asm volatile("yield"); }
#else
static inline void cpu_relax() {}
#endif

struct Job {
  void (*fn)(const void *ctx, int part, int parts);
  const void *ctx;
  int parts;
};

class Pool {
 public:
  explicit Pool(int workers) {
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this, i] { work(i + 1); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
      epoch_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto &t : threads_) t.join();
  }
  int size() const { return (int)threads_.size() + 1; }
  // runs job parts 0 .. size() - 1, part 0 in the caller, part i in worker i; false when the pool is busy
  bool run(const Job &job) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    job_ = job;
    left_.store(job.parts - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lk(m_);
      epoch_.fetch_add(1, std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire)) cv_.notify_all();
    job.fn(job.ctx, 0, job.parts);
    while (left_.load(std::memory_order_acquire) != 0) cpu_relax();
    return true;
  }

 private:
  void work(int id) {
    uint64_t seen = 0;
    for (;;) {
      const auto t0 = std::chrono::steady_clock::now();
      uint64_t e;
      int spins = 0;
      while ((e = epoch_.load(std::memory_order_acquire)) == seen) {
        if (++spins % 64 == 0 &&
            std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(g_spin_us.load(std::memory_order_relaxed))) {
          std::unique_lock<std::mutex> lk(m_);
          sleepers_.fetch_add(1);
          cv_.wait(lk, [&] { return epoch_.load() != seen; });
          sleepers_.fetch_sub(1);
        }
        cpu_relax();
      }
      seen = e;
      if (stop_) return;
      job_.fn(job_.ctx, id, job_.parts);
      left_.fetch_sub(1, std::memory_order_release);
    }
  }
  std::vector<std::thread> threads_;
  std::mutex m_, busy_;
  std::condition_variable cv_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> left_{0}, sleepers_{0};
  Job job_{};
  bool stop_ = false;
};

static std::mutex g_pool_mutex;
static Pool *g_pools[MAX_POOL_THREADS + 1] = {};  // by thread count; made on first use, never destroyed
static void pool_fork_prepare() { g_pool_mutex.lock(); }
static void pool_fork_parent() { g_pool_mutex.unlock(); }
static void pool_fork_child() {  // the workers are not in the child: forget (leak) the parent's pools
  for (auto &p : g_pools) p = nullptr;
  g_pool_mutex.unlock();
}

static Pool *pool(int threads) {
  if (threads < 2) return nullptr;
  if (threads > MAX_POOL_THREADS) threads = MAX_POOL_THREADS;
  std::lock_guard<std::mutex> lk(g_pool_mutex);
  static bool hooked = (pthread_atfork(pool_fork_prepare, pool_fork_parent, pool_fork_child), true);
  (void)hooked;
  if (!g_pools[threads]) g_pools[threads] = new Pool(threads - 1);
  return g_pools[threads];
}

// body(begin, end) over [0, n) in g_threads contiguous parts, one per thread (an empty part is skipped). The body
// must not throw (the kernels' bodies do not allocate inside a part except their scratch vectors; a bad_alloc there
// ends the process, as it would in an OpenMP region).
template <typename F>
static void parallel_for(int64_t n, const F &body) {
  if (n <= 0) return;
  Pool *p = n > 1 && !t_in_part ? pool(g_threads.load(std::memory_order_relaxed)) : nullptr;
  const int parts = p ? p->size() : 1;  // every worker takes part in every loop (an empty part does nothing)
  auto part = [](const void *ctx, int i, int P) {
    const auto &c = *(const std::pair<const F *, int64_t> *)ctx;
    const int64_t b = c.second * i / P, e = c.second * (i + 1) / P;
    t_in_part = true;
    if (b < e) (*c.first)(b, e);
    t_in_part = false;
  };
  const std::pair<const F *, int64_t> ctx{&body, n};
  if (parts > 1 && p->run(Job{part, &ctx, parts})) return;
  body(0, n);
}

// Time spent inside each kernel (steady clock, ns) and its calls, for profiles: KernelStats / ResetKernelStats.
enum { K_LINEAR, K_NORM, K_ATTN, K_BLOCK, K_MLP, K_LAYER, K_STACK, K_COUNT };
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

// out [2 * K_COUNT] int64: (ns, calls) per kernel in the order of the enum above.
extern "C" int KernelStats(int64_t *out) {
  for (int i = 0; i < K_COUNT; ++i) out[2 * i] = g_ns[i], out[2 * i + 1] = g_calls[i];
  return K_COUNT;
}

extern "C" int ResetKernelStats() {
  for (int i = 0; i < K_COUNT; ++i) g_ns[i] = 0, g_calls[i] = 0;
  return 0;
}

extern "C" int SetThreads(int n) {
  g_threads = n < 1 ? 1 : (n > MAX_POOL_THREADS ? MAX_POOL_THREADS : n);
  return g_threads;
}

// microseconds an idle worker spins before it sleeps (0: sleep at once); returns the value now in force
extern "C" int SetSpinMicros(int us) {
  g_spin_us = us < 0 ? 0 : us;
  return (int)g_spin_us.load();
}

// A matrix w [N, K] of elements of E bytes (4: float32, 2: float16) rewritten in place into the packed layout
// [N / 16, K, 16] of "Packed matmul" below (kernels/cpu.py, pack): panel p occupies the bytes of rows 16 p ..
// 16 p + 15, so each panel is transposed through a scratch copy of its own, panels split over the threads. Called
// through ctypes at load (not a MindSpore op). Returns 1 when N is not a multiple of 16 or E is not 2 or 4.
template <typename T>
static void pack_panels(T *w, int64_t N, int64_t K) {
  parallel_for(N / 16, [&](int64_t p0, int64_t p1) {
    std::vector<T> panel(16 * K);
    for (int64_t p = p0; p < p1; ++p) {
      T *base = w + p * 16 * K;
      std::memcpy(panel.data(), base, 16 * K * sizeof(T));
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < 16; ++j) base[i * 16 + j] = panel[j * K + i];
    }
  });
}

extern "C" int PackInPlace(void *w, int64_t N, int64_t K, int E) {
  if (N % 16 || N < 0 || K < 0) return 1;
  if (E == 4) return pack_panels((uint32_t *)w, N, K), 0;
  if (E == 2) return pack_panels((uint16_t *)w, N, K), 0;
  return 1;
}

// A float32 matrix w [N, K] rounded to IEEE half floats (round to nearest even, the rounding of numpy's
// astype(float16)) into a new buffer out: packed [N / 16, K, 16] as PackInPlace lays it out when packed != 0 (N a
// multiple of 16), else [N, K] in w's order. One pass over w, split over the threads (numpy's conversion of the
// 0.5B teacher's 2.5 GB took 3.9 s of a 10 s start; kernels/cpu.py, to_half). Returns 1 on a bad shape.
extern "C" int ToHalf(const float *w, _Float16 *out, int64_t N, int64_t K, int packed) {
  if (N < 0 || K < 0 || (packed && N % 16)) return 1;
  if (!packed) {
    parallel_for(N, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0 * K; i < r1 * K; ++i) out[i] = (_Float16)w[i];
    });
    return 0;
  }
  parallel_for(N / 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < 16; ++j) out[(p * K + i) * 16 + j] = (_Float16)w[(p * 16 + j) * K + i];
  });
  return 0;
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
// Threads split N into blocks of NR weight rows; a block runs tiles of NR weight rows x KR rows of x (then tiles
// of KR - 1, ..., 1 rows for the rows left), and prefetches the next block's weight rows at the same offset, so the
// weights come from memory one block's multiply-adds ahead (512 bytes ahead, the earlier distance, was 15 % slower
// at 8 rows). With AVX-512VL (32 vector registers): 4 x 4 for k <= 4 (a decode, a small tree, a drafter call),
// 4 x 6 for k < 8, 3 x 8 from 8 rows (24 accumulators); without, 1 x 4 for k <= 4 and 2 x 4 above. Weight rows
// left after the last full block: 1 x 1. Measured tiles: docs/cpu_kernels.md, "Tiles". Every output is one dot
// product accumulated in the same float order whatever the tile, so results do not depend on k (batch invariance).
// (Matrices packed as panels take the outer-product form of "Packed matmul" below instead.)
template <int NR, int KR, typename W>
static inline void micro(const float *x, const W *w, float *y, int64_t K, int64_t N, int64_t r0, int64_t n0) {
  v8 acc[KR][NR];
#pragma GCC unroll 8
  for (int a = 0; a < KR; ++a)
#pragma GCC unroll 8
    for (int b = 0; b < NR; ++b) acc[a][b] = splat8(0.f);
  int64_t i = 0;
  for (; i + 8 <= K; i += 8) {
    v8 wv[NR];
#pragma GCC unroll 8
    for (int b = 0; b < NR; ++b) wv[b] = load8w(w + (n0 + b) * K + i);
#pragma GCC unroll 8
    for (int b = 0; b < NR; ++b) __builtin_prefetch(w + (n0 + NR + b) * K + i);  // the next block's rows
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
    for (int b = 0; b < NR; ++b) wv[b] = load_tailw(w + (n0 + b) * K + i, t);
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

// rows r .. k - 1 in tiles of R rows, then R - 1, ..., 1: tile(std::integral_constant<int, rows>, first row).
// One pass over the weights per tile, so the fewest tiles: 8 rows are 6 + 2, not 6 + 1 + 1 (on AVX2, 20 ms
// instead of 26 for the 135M teacher's 30 layers)
template <int R, typename F>
static inline void row_tiles(int64_t k, int64_t r, const F &tile) {
  for (; r + R <= k; r += R) tile(std::integral_constant<int, R>{}, r);
  if constexpr (R > 1) row_tiles<R - 1>(k, r, tile);
}

// every row of x against the weight rows of blocks [b0, b1) of NR rows; the rows after N / NR blocks one at a time
template <int NR, int KR, typename W>
static void blocks_into(const float *x, const W *w, float *y, int64_t k, int64_t K, int64_t N, int64_t b0,
                        int64_t b1) {
  for (int64_t nb = b0; nb < b1; ++nb) {
    const int64_t n0 = nb * NR;
    if (n0 + NR > N) {
      for (int64_t r = 0; r < k; ++r)
        for (int64_t n = n0; n < N; ++n) micro<1, 1>(x, w, y, K, N, r, n);
      continue;
    }
    row_tiles<KR>(k, 0, [&](auto rows, int64_t r) { micro<NR, decltype(rows)::value>(x, w, y, K, N, r, n0); });
  }
}

template <int NR, int KR, typename W>
static void tiled(const float *x, const W *w, float *y, int64_t k, int64_t K, int64_t N) {
  parallel_for((N + NR - 1) / NR,
               [&](int64_t b0, int64_t b1) { blocks_into<NR, KR>(x, w, y, k, K, N, b0, b1); });
}

// ---------------------------------------------------------------------------------------------- Packed matmul
// A matrix w [N, K] may be stored packed, [N / 16, K, 16]: panel p holds rows 16 p .. 16 p + 15, column by column
// (wp[p][i][j] = w[16 p + j][i]; kernels/cpu.py, pack). Then y[r, n] = sum_i x[r, i] w[n, i] is one FMA chain
// per output, i = 0, 1, ..., K - 1 in order from 0 (no partial sums, no fold): the same float operations whatever
// the tile, the row count or the thread, so results do not depend on k (batch invariance). A tile of MR rows of x
// x NP panels keeps MR NP 16-lane accumulators; each step loads NP weight vectors, broadcasts one x value per row
// and runs MR NP multiply-adds (the outer-product form of BLAS micro-kernels, Goto & van de Geijn 2008). The
// panels stream in memory order and are prefetched 4 KB ahead. Measured: docs/cpu_kernels.md, "Packed matrices".
constexpr int64_t PANEL = 16;
#if defined(__AVX512F__)
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
static inline v16 fma16(v16 a, v16 b, v16 c) { return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#endif

// A panel row of 16 lanes is held as PV native vectors vp of VL lanes: one zmm with AVX-512, two ymm (or NEON
// pairs) otherwise. Each lane is one fma8-style fused multiply-add, so both widths give the same bits; the
// 8-lane form must stay native (a 16-lane GCC vector on AVX2 was lowered through the stack: 10x slower).
#if defined(__AVX512F__)
typedef v16 vp;
typedef v16u vpu;
constexpr int VL = 16;
static inline vp loadp(const float *p) { return *(const v16u *)p; }
static inline vp loadp(const _Float16 *p) { return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vp fmap(vp a, vp b, vp c) { return fma16(a, b, c); }
static inline vp splatp(float x) { return (vp)_mm512_set1_ps(x); }
#else
typedef v8 vp;
typedef v8u vpu;
constexpr int VL = 8;
static inline vp loadp(const float *p) { return load8(p); }
static inline vp loadp(const _Float16 *p) { return load8w(p); }
static inline vp fmap(vp a, vp b, vp c) { return fma8(a, b, c); }
static inline vp splatp(float x) { return splat8(x); }
#endif
constexpr int PV = PANEL / VL;

// pf, pf_lines: this pass's share of the next panels (pf_lines cache lines from pf, spread evenly over the K steps;
// 0: none). See otiled.
template <int MR, int NP, typename W>
static inline void otile(const float *x, const W *wp, float *y, int64_t K, int64_t N, int64_t r0, int64_t p0,
                         const char *pf, int64_t pf_lines) {
  vp acc[MR][NP * PV];
#pragma GCC unroll 8
  for (int a = 0; a < MR; ++a)
#pragma GCC unroll 8
    for (int b = 0; b < NP * PV; ++b) acc[a][b] = vp{};
  const W *wb[NP];
  for (int b = 0; b < NP; ++b) wb[b] = wp + (p0 + b) * K * PANEL;
  const float *xr = x + r0 * K;
  int64_t due = 0;
  for (int64_t i = 0; i < K; ++i) {
    for (due += pf_lines; due >= K; due -= K, pf += 64) __builtin_prefetch(pf);
    vp wv[NP * PV];
#pragma GCC unroll 8
    for (int b = 0; b < NP; ++b) {
#pragma GCC unroll 2
      for (int h = 0; h < PV; ++h) wv[b * PV + h] = loadp(wb[b] + i * PANEL + h * VL);
      __builtin_prefetch(wb[b] + i * PANEL + 4096 / sizeof(W));
    }
#pragma GCC unroll 8
    for (int a = 0; a < MR; ++a) {
      const vp xb = splatp(xr[a * K + i]);
#pragma GCC unroll 8
      for (int b = 0; b < NP * PV; ++b) acc[a][b] = fmap(xb, wv[b], acc[a][b]);
    }
  }
#pragma GCC unroll 8
  for (int a = 0; a < MR; ++a)
#pragma GCC unroll 8
    for (int b = 0; b < NP * PV; ++b) *(vpu *)(y + (r0 + a) * N + p0 * PANEL + b * VL) = acc[a][b];
}

// threads split the N / 16 panels into contiguous parts; a part runs NP panels at a time, then one at a time, each
// over all rows in tiles of MR rows, then MR - 1, ..., 1 (T = ceil(k / MR) passes over the panels). With T >= 2 the
// first pass would stream the panels from memory while the later ones find them in cache: so each pass also
// prefetches 1 / T of the next panels, and memory is read during all T passes instead of the first (the reads are
// prefetches only: the float operations are unchanged).
template <int MR, int NP, typename W>
static void otiled(const float *x, const W *wp, float *y, int64_t k, int64_t K, int64_t N) {
  const int64_t T = (k + MR - 1) / MR;
  parallel_for(N / PANEL, [&](int64_t p0, int64_t p1) {
    auto group = [&](auto np, int64_t p) {
      const int64_t next = p + np;                                          // the next panels to prefetch
      const int64_t panels = T > 1 ? std::min<int64_t>(np, p1 - next) : 0;   // this part's, none past p1
      const int64_t lines = panels * K * PANEL * (int64_t)sizeof(W) / 64;
      const int64_t share = (lines + T - 1) / T;
      const char *pf = (const char *)(wp + next * K * PANEL);
      row_tiles<MR>(k, 0, [&](auto rows, int64_t r) {
        const int64_t first = std::min(lines, r / MR * share);     // r / MR: the pass, 0 .. T - 1
        otile<decltype(rows)::value, decltype(np)::value>(x, wp, y, K, N, r, p, pf + 64 * first,
                                                          std::min(lines, first + share) - first);
      });
    };
    int64_t p = p0;
    for (; p + NP <= p1; p += NP) group(std::integral_constant<int, NP>{}, p);
    for (; p < p1; ++p) group(std::integral_constant<int, 1>{}, p);
  });
}

template <typename W>
static void packed_into(const float *x, const W *wp, float *y, int64_t k, int64_t K, int64_t N) {
#if defined(__AVX512F__)
  if (k <= 4)                           // bandwidth-bound: 4 panels stream side by side
    otiled<4, 4>(x, wp, y, k, K, N);
  else                                  // 24 accumulators of AVX-512's 32 registers
    otiled<8, 3>(x, wp, y, k, K, N);
#else                                   // 16 vector registers; a panel row is two of them
  if (k <= 2)
    otiled<2, 2>(x, wp, y, k, K, N);
  else if (k <= 4)
    otiled<4, 1>(x, wp, y, k, K, N);
  else
    otiled<6, 1>(x, wp, y, k, K, N);    // 12 accumulators, BLAS's 6 x 16 AVX2 micro-kernel
#endif
}

// A matmul weight argument i of an AOT call: [N, K] row-major or packed [N / 16, K, 16] (false: neither)
struct Mat {
  int64_t N, K;
  bool packed;
};
static inline bool mat_arg(const int *ndims, int64_t *const *shapes, int i, Mat *m) {
  if (ndims[i] == 2) {
    *m = {shapes[i][0], shapes[i][1], false};
    return true;
  }
  if (ndims[i] == 3 && shapes[i][2] == PANEL) {
    *m = {shapes[i][0] * PANEL, shapes[i][1], true};
    return true;
  }
  return false;
}

template <typename W>
static void linear_into(const float *x, const W *w, float *y, int64_t k, int64_t K, int64_t N, bool packed) {
  if (packed) return packed_into(x, w, y, k, K, N);
#if defined(__AVX512VL__)
  if (k <= 4)
    tiled<4, 4>(x, w, y, k, K, N);
  else if (k < 8)
    tiled<4, 6>(x, w, y, k, K, N);
  else
    tiled<3, 8>(x, w, y, k, K, N);
#else                                // 16 vector registers: 1 x 4 (as measured before), 2 x 4 (8 accumulators)
  if (k <= 4)
    tiled<1, 4>(x, w, y, k, K, N);
  else
    tiled<2, 4>(x, w, y, k, K, N);
#endif
}

// one row: y = x + d (+ b when b), h = y / sqrt(mean(y^2) + eps)
static inline void add_norm_row(const float *x, const float *d, const float *b, float eps, float *y, float *h,
                                int64_t H) {
  if (b)
    for (int64_t i = 0; i < H; ++i) y[i] = x[i] + (d[i] + b[i]);
  else
    for (int64_t i = 0; i < H; ++i) y[i] = x[i] + d[i];
  const float inv = 1.0f / std::sqrt(dot(y, y, H) / (float)H + eps);
  for (int64_t i = 0; i < H; ++i) h[i] = y[i] * inv;
}

// one row: out[0:F] = silu(g) * u for g = gu[0:F], u = gu[F:2F]
static inline void swiglu_row(const float *gu, float *out, int64_t F) {
  const float *g = gu, *u = gu + F;
  const v8 one = splat8(1.f);
  int64_t i = 0;
  for (; i + 8 <= F; i += 8) {
    const v8 gv = load8(g + i);
    store8(out + i, gv / (one + exp8(-gv)) * load8(u + i));
  }
  if (i < F) {
    const v8 gv = load_tail(g + i, F - i), y = gv / (one + exp8(-gv)) * load_tail(u + i, F - i);
    for (int64_t j = 0; j < F - i; ++j) out[i + j] = y[j];
  }
}

// x [k, K] f32, w [N, K] f32 or f16 (HF [out, in]) -> y [k, N] f32, y[r, n] = dot(x[r], w[n]).
enum LinearArg { LIN_X, LIN_W, LIN_Y, LIN_NARGS };  // x [k, K], w [N, K], y [k, N]
extern "C" int Linear(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                      void *extra) {
  Timed timed(K_LINEAR);
  Mat w;
  if (nparam != LIN_NARGS || ndims[LIN_X] != 2 || !mat_arg(ndims, shapes, LIN_W, &w) || shapes[LIN_X][1] != w.K)
    return 1;
  const float *x = (const float *)params[LIN_X];
  float *y = (float *)params[LIN_Y];
  if (is_half(dtypes[LIN_W]))
    linear_into(x, (const _Float16 *)params[LIN_W], y, shapes[LIN_X][0], w.K, w.N, w.packed);
  else
    linear_into(x, (const float *)params[LIN_W], y, shapes[LIN_X][0], w.K, w.N, w.packed);
  return 0;
}

// ---------------------------------------------------------------------------------------------- HeadTopK
// h [k, H] f32, w [V, H] f32 or f16, d2t [V] i32 -> top_logp [k, K] f32, top_ids [k, K] i32: the head's logits
// x = h @ w.T (linear_into), their log-softmax x - m - log(sum(exp(x - m))) with m = max(x) (exp8 over the row in
// index order, 8 partial sums folded by fold8), and the K largest, value descending then index ascending (ops.topk
// on CPU orders exact ties otherwise), each id mapped to i + d2t[i] (the EAGLE-3 draft-to-target offset,
// models/eagle3.py). One call instead of the head, log_softmax, topk and gather graph ops (~0.5 ms a call on a
// 2-core CPU, docs/cpu_kernels.md).
// one row of logits x [V] -> its K best log-probabilities tv [K] and ids ti [K] (+ d2t)
static void topk_logp_row(const float *x, const int32_t *d2t, float *tv, int32_t *ti, int64_t V, int64_t K) {
  float m = -INFINITY;
  for (int64_t i = 0; i < V; ++i) m = x[i] > m ? x[i] : m;
  v8 acc = splat8(0.f);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) acc = acc + exp8(load8(x + i) - splat8(m));
  if (i < V) {                                      // the tail's missing lanes at -inf: exp8 clamps them to 0
    v8 t = splat8(-INFINITY);
    for (int64_t j = 0; j < V - i; ++j) t[j] = x[i + j];
    acc = acc + exp8(t - splat8(m));
  }
  const float lse = m + std::log(fold8(acc));
  int64_t n = 0;                                    // insertion into the best K so far (sorted, ties: lower id)
  for (int64_t j = 0; j < V; ++j) {
    const float v = x[j];
    if (n == K && !(v > tv[K - 1])) continue;
    int64_t pos = n < K ? n++ : K - 1;
    while (pos > 0 && v > tv[pos - 1]) {
      tv[pos] = tv[pos - 1], ti[pos] = ti[pos - 1];
      --pos;
    }
    tv[pos] = v, ti[pos] = (int32_t)j;
  }
  for (int64_t j = 0; j < K; ++j) {
    tv[j] = tv[j] - lse;
    ti[j] = ti[j] + d2t[ti[j]];
  }
}

template <typename W>
static void head_topk(const float *h, const W *w, bool packed, const int32_t *d2t, float *top_logp,
                      int32_t *top_ids, int64_t k, int64_t H, int64_t V, int64_t K) {
  std::vector<float> logits(k * V);
  linear_into(h, w, logits.data(), k, H, V, packed);
  parallel_for(k, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) topk_logp_row(logits.data() + r * V, d2t, top_logp + r * K, top_ids + r * K, V, K);
  });
}

enum HeadTopKArg { TOP_H, TOP_W, TOP_D2T, TOP_VALUES, TOP_IDS, TOP_NARGS };
extern "C" int HeadTopK(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                        void *extra) {
  Timed timed(K_LINEAR);
  Mat w;
  if (nparam != TOP_NARGS || ndims[TOP_H] != 2 || !mat_arg(ndims, shapes, TOP_W, &w) || ndims[TOP_VALUES] != 2)
    return 1;
  const int64_t k = shapes[TOP_H][0], H = shapes[TOP_H][1], V = w.N, K = shapes[TOP_VALUES][1];
  if (w.K != H || shapes[TOP_D2T][0] != V || shapes[TOP_VALUES][0] != k || K < 1 || K > V) return 2;
  const float *h = (const float *)params[TOP_H];
  const int32_t *d2t = (const int32_t *)params[TOP_D2T];
  float *tv = (float *)params[TOP_VALUES];
  int32_t *ti = (int32_t *)params[TOP_IDS];
  if (is_half(dtypes[TOP_W]))
    head_topk(h, (const _Float16 *)params[TOP_W], w.packed, d2t, tv, ti, k, H, V, K);
  else
    head_topk(h, (const float *)params[TOP_W], w.packed, d2t, tv, ti, k, H, V, K);
  return 0;
}

// ---------------------------------------------------------------------------------------------- AddRmsNorm
// x [k, H], d [k, H], eps [1] -> y [k, H] = x + d, h [k, H] = y / sqrt(mean(y^2) + eps) (no weight: folded).
enum AddRmsNormArg { ARN_X, ARN_D, ARN_EPS, ARN_Y, ARN_H, ARN_NARGS };
extern "C" int AddRmsNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra) {
  Timed timed(K_NORM);
  if (nparam != ARN_NARGS || ndims[ARN_X] != 2) return 1;
  const float *x = (const float *)params[ARN_X], *d = (const float *)params[ARN_D];
  const float eps = ((const float *)params[ARN_EPS])[0];
  float *y = (float *)params[ARN_Y], *h = (float *)params[ARN_H];
  const int64_t k = shapes[ARN_X][0], H = shapes[ARN_X][1];
  for (int64_t r = 0; r < k; ++r) add_norm_row(x + r * H, d + r * H, nullptr, eps, y + r * H, h + r * H, H);
  return 0;
}

// ---------------------------------------------------------------------------------------------- MlpAddNorm
// h [k, H], w_gate_up [2F, H], w_down [H, F] (both f32 or both f16), resid [k, H], eps [1] -> y = resid +
// down(silu(gate) * up), h' = rms(y): the SwiGLU MLP (silu(g) = g / (1 + exp(-g)), exp8), the residual add and the
// next norm.
template <typename W>
static void mlp_add_norm(const float *x, const W *wgu, const W *wd, bool packed_gu, bool packed_d, const float *res,
                         float eps, float *y, float *hn, int64_t k, int64_t H, int64_t F) {
  std::vector<float> gu(k * 2 * F), act(k * F), d(k * H);
  linear_into(x, wgu, gu.data(), k, H, 2 * F, packed_gu);
  for (int64_t r = 0; r < k; ++r) swiglu_row(gu.data() + r * 2 * F, act.data() + r * F, F);
  linear_into(act.data(), wd, d.data(), k, F, H, packed_d);
  for (int64_t r = 0; r < k; ++r) add_norm_row(res + r * H, d.data() + r * H, nullptr, eps, y + r * H, hn + r * H, H);
}

enum MlpAddNormArg { MLP_X, MLP_WGU, MLP_WD, MLP_RES, MLP_EPS, MLP_Y, MLP_H, MLP_NARGS };
extern "C" int MlpAddNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra) {
  Timed timed(K_MLP);
  Mat gu, dn;
  if (nparam != MLP_NARGS || !mat_arg(ndims, shapes, MLP_WGU, &gu) || !mat_arg(ndims, shapes, MLP_WD, &dn)) return 1;
  const float *x = (const float *)params[MLP_X], *res = (const float *)params[MLP_RES];
  const float eps = ((const float *)params[MLP_EPS])[0];
  float *y = (float *)params[MLP_Y], *hn = (float *)params[MLP_H];
  const int64_t k = shapes[MLP_X][0], H = shapes[MLP_X][1], F = gu.N / 2;
  if (gu.K != H || dn.N != H || dn.K != F || is_half(dtypes[MLP_WGU]) != is_half(dtypes[MLP_WD])) return 2;
  if (is_half(dtypes[MLP_WGU]))
    mlp_add_norm(x, (const _Float16 *)params[MLP_WGU], (const _Float16 *)params[MLP_WD], gu.packed, dn.packed, res,
                 eps, y, hn, k, H, F);
  else
    mlp_add_norm(x, (const float *)params[MLP_WGU], (const float *)params[MLP_WD], gu.packed, dn.packed, res, eps,
                 y, hn, k, H, F);
  return 0;
}

// ---------------------------------------------------------------------------------------------- PagedAttention
// q [k, nh, hd]; key_cache / value_cache [R, hd] (head-major slot rows, kernels/kv.py); read_rows [n_kv, S] i32
// or [G, n_kv, S] (G groups of k / G query rows, each over its own rows); mask [k, S] f32 additive; scale [1]
// -> ctx [k, nh * hd]. Query head h reads KV head h / (nh / n_kv). A column whose mask is <= -1e4 is hidden and
// skipped; a row with no visible column gets zeros. Per (row, head): scores of the visible columns in column order,
// their max, their exp8(score - max), then the weighted sum of values in the same order, divided once by the sum
// of weights.
// out[j] = fold8(a[j]) for the 8 vectors a[0..7]: the same additions in the same order as fold8 (lane l + lane
// l + 4 first, then ((0 + 1) + (2 + 3))), done for eight dot products at once by a transpose instead of eight
// horizontal folds.
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define MSEAGLE_SHUFFLE 1
#endif
#endif
static inline v8 fold8x8(const v8 *a) {
#if defined(MSEAGLE_SHUFFLE)
  typedef float v4 __attribute__((vector_size(16)));
  v4 b[8], o[2];
  for (int j = 0; j < 8; ++j)
    b[j] = __builtin_shufflevector(a[j], a[j], 0, 1, 2, 3) + __builtin_shufflevector(a[j], a[j], 4, 5, 6, 7);
  for (int h = 0; h < 2; ++h) {
    const v4 *c = b + 4 * h;
    const v4 t0 = __builtin_shufflevector(c[0], c[1], 0, 4, 1, 5), t1 = __builtin_shufflevector(c[0], c[1], 2, 6, 3, 7);
    const v4 t2 = __builtin_shufflevector(c[2], c[3], 0, 4, 1, 5), t3 = __builtin_shufflevector(c[2], c[3], 2, 6, 3, 7);
    const v4 l0 = __builtin_shufflevector(t0, t2, 0, 1, 4, 5), l1 = __builtin_shufflevector(t0, t2, 2, 3, 6, 7);
    const v4 l2 = __builtin_shufflevector(t1, t3, 0, 1, 4, 5), l3 = __builtin_shufflevector(t1, t3, 2, 3, 6, 7);
    o[h] = (l0 + l1) + (l2 + l3);
  }
  return __builtin_shufflevector(o[0], o[1], 0, 1, 2, 3, 4, 5, 6, 7);
#else
  v8 out;
  for (int j = 0; j < 8; ++j) out[j] = fold8(a[j]);
  return out;
#endif
}

// The visible columns of one query row: their cache rows vis[0..n) and mask values mv[0..n), in column order
// (a column is hidden when its mask is <= -1e4). Returns n, or -1 when a visible column's row is outside [0, R).
static int64_t visible_columns(const int32_t *rr, const float *mr, int64_t S, int64_t R, int32_t *vis, float *mv) {
  int64_t n = 0;
  for (int64_t j = 0; j < S; ++j) {
    if (mr[j] <= -1e4f) continue;
    if (rr[j] < 0 || rr[j] >= R) return -1;
    vis[n] = rr[j], mv[n++] = mr[j];
  }
  return n;
}

// exp8(sc[t] - mx) in place over t < n, 8 at a time (the tail's missing lanes computed and dropped)
static void exp_shifted(float *sc, int64_t n, float mx) {
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) store8(&sc[t], exp8(load8(&sc[t]) - splat8(mx)));
  if (t < n) {
    const v8 p = exp8(load_tail(&sc[t], n - t) - splat8(mx));
    for (int64_t j = 0; j < n - t; ++j) sc[t + j] = p[j];
  }
}

// One (query row, head) over its n visible cache rows, any head size (accumulators in memory, the head's tail
// zero-padded as in dot).
static void attend_any(const float *qr, const float *kc, const float *vc, const int32_t *vis, const float *mv,
                       int64_t n, float scale, float *sc, v8 *acc, int64_t hd, float *out) {
  float mx = -INFINITY;
  for (int64_t t = 0; t < n; ++t) {
    const float s = dot(qr, kc + (int64_t)vis[t] * hd, hd) * scale + mv[t];
    sc[t] = s;
    mx = s > mx ? s : mx;
  }
  exp_shifted(sc, n, mx);
  for (int64_t c = 0; c < (hd + 7) / 8; ++c) acc[c] = splat8(0.f);
  float den = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    const float p = sc[t];
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

// Attention's vectors hold U pairs (row, head) side by side, 8 lanes each: U = 2 (16 lanes) where AVX-512 makes a
// 16-lane multiply-add one instruction, else U = 1. Lane by lane a U = 2 vector runs the 8-lane operations of each
// of its pairs (fma16 fuses as fma8), so packing two pairs never changes a bit.
#if defined(__AVX512F__) && defined(MSEAGLE_SHUFFLE)
constexpr int ATTN_UNIT = 2;
#else
constexpr int ATTN_UNIT = 1;
#endif
template <int U> struct Lanes;
template <> struct Lanes<1> {
  typedef v8 V;
  static V fma(V a, V b, V c) { return fma8(a, b, c); }
  static V join(v8 a, v8) { return a; }                 // pair A's lanes (and B's, when U = 2)
  static V dup(const float *p) { return load8(p); }     // the same 8 floats for every pair
  static v8 part(V v, int) { return v; }                // one pair's 8 lanes
  static void fold(const V *a, v8 *f) { f[0] = fold8x8(a); }   // f[u] = fold8x8 of pair u's lanes of a[0..7]
};
#if defined(__AVX512F__) && defined(MSEAGLE_SHUFFLE)
template <> struct Lanes<2> {
  typedef v16 V;
  static V fma(V a, V b, V c) { return fma16(a, b, c); }
  static V join(v8 a, v8 b) { return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static V dup(const float *p) {                        // one vbroadcastf32x8 from memory where AVX512DQ has it
#if defined(__AVX512DQ__)
    return (V)_mm512_broadcast_f32x8(_mm256_loadu_ps(p));
#else
    const v8 a = load8(p);
    return join(a, a);
#endif
  }
  static v8 part(V v, int u) {
    return u ? __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)
             : __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  }
  // fold8x8 of both pairs at once: the same additions on the same operands, its 4-lane shuffles done in each
  // 128-bit lane of the 16 (lanes 0-3 carry pair 0, lanes 8-11 pair 1; the others are dropped)
  static void fold(const V *a, v8 *f) {
    V b[8], o[2];
    for (int j = 0; j < 8; ++j)
      b[j] = a[j] + __builtin_shufflevector(a[j], a[j], 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    for (int h = 0; h < 2; ++h) {
      const V *c = b + 4 * h;
#define MSEAGLE_LO(x, y) __builtin_shufflevector(x, y, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29)
#define MSEAGLE_HI(x, y) __builtin_shufflevector(x, y, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31)
      const V t0 = MSEAGLE_LO(c[0], c[1]), t1 = MSEAGLE_HI(c[0], c[1]);
      const V t2 = MSEAGLE_LO(c[2], c[3]), t3 = MSEAGLE_HI(c[2], c[3]);
#undef MSEAGLE_LO
#undef MSEAGLE_HI
#define MSEAGLE_L2(x, y) __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
#define MSEAGLE_H2(x, y) __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31)
      const V l0 = MSEAGLE_L2(t0, t2), l1 = MSEAGLE_H2(t0, t2), l2 = MSEAGLE_L2(t1, t3), l3 = MSEAGLE_H2(t1, t3);
#undef MSEAGLE_L2
#undef MSEAGLE_H2
      o[h] = (l0 + l1) + (l2 + l3);
    }
    const V r = __builtin_shufflevector(o[0], o[1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    f[0] = part(r, 0), f[1] = part(r, 1);
  }
};
#endif

// Scores, weights and outputs of the pairs (query row, head) of one chunk that read the same KV head, hd = 8 NC:
// per pair the same float operations, in the same order, as attend_any above (hence as dot, exp8 and the
// sequential sums it uses; eight scores folded at once by fold8x8, the query and the accumulators in registers), so
// a result never depends on the path, the chunk or the other pairs. The loops are turned so that a block of
// KEY_BLOCK cache rows is read once, from L1, for every pair of the chunk (rows of one sequence see the same
// prefix; the heads of a KV group read the same cache rows), and two heads of one row (same visible columns) share
// each vector (Lanes<U>; a head left alone fills both halves and keeps one). Per pair p: its visible rows vis[p]
// (n[p] of them) and mask values mv[p]; sc + p S, acc + p NC, mx[p] and den[p] its scores, accumulators, running
// max (lane by lane: exact) and sum of weights (scratch); its output goes to out[p].
constexpr int64_t KEY_BLOCK = 32;
template <int NC>
static void attend_group(const float *const *qr, const float *kc, const float *vc, const int32_t *const *vis,
                         const float *const *mv, const int64_t *n, int64_t np, int64_t S, float scale, float *sc,
                         v8 *acc, v8 *mx, float *den, float *const *out) {
  constexpr int U = ATTN_UNIT;
  typedef Lanes<U> L;
  typedef typename L::V V;
  constexpr int64_t hd = 8 * NC;
  constexpr int QH = U == 2 ? NC : 4;            // query vectors held at once in the score loop
  int64_t nmax = 0;
  for (int64_t p = 0; p < np; ++p) nmax = n[p] > nmax ? n[p] : nmax;
  for (int64_t p = 0; p < np; ++p) mx[p] = splat8(-INFINITY), den[p] = 0.f;
  // unit (p, p2): p2 = p + 1 when U = 2 and both pairs see the same columns, else p2 = p (one pair)
  auto second = [&](int64_t p) { return U == 2 && p + 1 < np && vis[p + 1] == vis[p] ? p + 1 : p; };
  for (int64_t b0 = 0; b0 < nmax; b0 += KEY_BLOCK)
    for (int64_t p = 0, p2; p < np; p = p2 + 1) {
      p2 = second(p);
      const int32_t *vp = vis[p];
      const float *mp = mv[p];
      const int64_t b1 = b0 + KEY_BLOCK < n[p] ? b0 + KEY_BLOCK : n[p];
      for (int64_t t0 = b0; t0 < b1; t0 += 8) {
        const int64_t m = b1 - t0 < 8 ? b1 - t0 : 8;
        const float *kr[8];                       // a key past the block's end reads the first one's row (dropped)
        for (int j = 0; j < 8; ++j) kr[j] = kc + (int64_t)vp[t0 + (j < m ? j : 0)] * hd;
        V a[8];
        for (int j = 0; j < 8; ++j) a[j] = V{};
        // the query a part of QH vectors at a time, so that the part and the eight accumulators stay in registers
        // (AVX2 has 16): each accumulator takes the same multiply-adds in the same order, c = 0 .. NC - 1
        for (int c0 = 0; c0 < NC; c0 += QH) {
          V qh[QH];
          for (int c = 0; c < QH; ++c)
            qh[c] = L::join(load8(qr[p] + 8 * (c0 + c)), load8(qr[p2] + 8 * (c0 + c)));
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j)
#pragma GCC unroll 16
            for (int c = 0; c < QH; ++c) a[j] = L::fma(qh[c], L::dup(kr[j] + 8 * (c0 + c)), a[j]);
        }
        const v8 mk = m == 8 ? load8(mp + t0) : load_tail(mp + t0, m);
        v8 f[U];
        L::fold(a, f);
        for (int u = 0; u < (p2 > p ? 2 : 1); ++u) {
          const int64_t pu = u ? p2 : p;
          const v8 sv = f[u] * splat8(scale) + mk;
          if (m == 8) {
            store8(sc + pu * S + t0, sv);
            mx[pu] = vmax8(mx[pu], sv);
          } else {
            for (int64_t j = 0; j < m; ++j)
              sc[pu * S + t0 + j] = sv[j], mx[pu][j] = sv[j] > mx[pu][j] ? sv[j] : mx[pu][j];
          }
        }
      }
    }
  for (int64_t p = 0; p < np; ++p) {
    float m = -INFINITY;
    for (int j = 0; j < 8; ++j) m = mx[p][j] > m ? mx[p][j] : m;
    exp_shifted(sc + p * S, n[p], m);
    for (int c = 0; c < NC; ++c) acc[p * NC + c] = splat8(0.f);
  }
  for (int64_t b0 = 0; b0 < nmax; b0 += KEY_BLOCK)
    for (int64_t p = 0, p2; p < np; p = p2 + 1) {
      p2 = second(p);
      const int64_t b1 = b0 + KEY_BLOCK < n[p] ? b0 + KEY_BLOCK : n[p];
      if (b0 >= b1) continue;
      V ac[NC];
      float d = den[p], d2 = den[p2];
      for (int c = 0; c < NC; ++c) ac[c] = L::join(acc[p * NC + c], acc[p2 * NC + c]);
      const float *w = sc + p * S, *w2 = sc + p2 * S;
      for (int64_t t = b0; t < b1; ++t) {
        d += w[t];                                          // the weights' sums, in column order
        if constexpr (U == 2) d2 += w2[t];
        const float *vr = vc + (int64_t)vis[p][t] * hd;
        const V pv = L::join(splat8(w[t]), splat8(w2[t]));
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) ac[c] = L::fma(pv, L::dup(vr + 8 * c), ac[c]);
      }
      den[p] = d;
      for (int c = 0; c < NC; ++c) acc[p * NC + c] = L::part(ac[c], 0);
      if constexpr (U == 2) {                               // p2 == p: the same sums and lanes again
        den[p2] = d2;
        for (int c = 0; c < NC; ++c) acc[p2 * NC + c] = L::part(ac[c], 1);
      }
    }
  for (int64_t p = 0; p < np; ++p) {
    const float inv = n[p] ? 1.0f / den[p] : 0.f;
    for (int c = 0; c < NC; ++c) store8(out[p] + 8 * c, acc[p * NC + c] * splat8(inv));
  }
}

// Work items of attention: chunks of the pairs (row, head) that read one KV head of one sequence, ordered (row,
// head); chunks of up to `per` pairs, enough of them to give every thread about four.
static int64_t pairs_per_chunk(int64_t groups, int64_t pairs) {
  const int64_t want = 4 * (int64_t)g_threads.load(std::memory_order_relaxed);
  const int64_t per = (groups * pairs + want - 1) / want;
  return per < 1 ? 1 : (per > pairs ? pairs : per);
}

static int attention_into(const float *q, const float *kc, const float *vc, const int32_t *rows, const float *mask,
                          float scale, float *ctx, int64_t k, int64_t nh, int64_t hd, int64_t G, int64_t nkv,
                          int64_t S, int64_t R) {
  const int64_t kg = k / G, group = nh / nkv, pairs = kg * group;
  const int64_t per = hd == 64 || hd == 128 ? pairs_per_chunk(G * nkv, pairs) : 1;
  const int64_t chunks = (pairs + per - 1) / per;
  std::atomic<int> bad{0};
  parallel_for(G * nkv * chunks, [&](int64_t i0, int64_t i1) {
    std::vector<float> sc(per * S), mv(per * S);
    std::vector<int32_t> vis(per * S);
    std::vector<int64_t> n(per);
    std::vector<v8> acc(per * ((hd + 7) / 8)), mx(per);
    std::vector<float> den(per);
    std::vector<const float *> qr(per), mvp(per);
    std::vector<const int32_t *> visp(per);
    std::vector<float *> out(per);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t g = item / (nkv * chunks), kvh = item / chunks % nkv, c0 = item % chunks * per;
      const int64_t np = pairs - c0 < per ? pairs - c0 : per;
      for (int64_t p = 0, last = -1; p < np; ++p) {          // the heads of one row share its visible columns
        const int64_t r = g * kg + (c0 + p) / group, h = kvh * group + (c0 + p) % group;
        qr[p] = q + (r * nh + h) * hd, out[p] = ctx + (r * nh + h) * hd;
        if (r != last) {
          n[p] = visible_columns(rows + (g * nkv + kvh) * S, mask + r * S, S, R, vis.data() + p * S,
                                 mv.data() + p * S);
          if (n[p] < 0) bad = 1, n[p] = 0;
          visp[p] = vis.data() + p * S, mvp[p] = mv.data() + p * S, last = r;
        } else {
          n[p] = n[p - 1], visp[p] = visp[p - 1], mvp[p] = mvp[p - 1];
        }
      }
      if (hd == 64)
        attend_group<8>(qr.data(), kc, vc, visp.data(), mvp.data(), n.data(), np, S, scale, sc.data(), acc.data(),
                        mx.data(), den.data(), out.data());
      else if (hd == 128)
        attend_group<16>(qr.data(), kc, vc, visp.data(), mvp.data(), n.data(), np, S, scale, sc.data(), acc.data(),
                         mx.data(), den.data(), out.data());
      else
        attend_any(qr[0], kc, vc, visp[0], mvp[0], n[0], scale, sc.data(), acc.data(), hd, out[0]);
    }
  });
  return bad.load() ? 3 : 0;
}

enum PagedAttentionArg { PA_Q, PA_KC, PA_VC, PA_ROWS, PA_MASK, PA_SCALE, PA_OUT, PA_NARGS };
extern "C" int PagedAttention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  Timed timed(K_ATTN);
  if (nparam != PA_NARGS || ndims[PA_Q] != 3) return 1;
  const int64_t k = shapes[PA_Q][0], nh = shapes[PA_Q][1], hd = shapes[PA_Q][2];
  const int64_t *rs = shapes[PA_ROWS];
  const int64_t G = ndims[PA_ROWS] == 3 ? rs[0] : 1, nkv = rs[ndims[PA_ROWS] - 2], S = rs[ndims[PA_ROWS] - 1];
  if (k % G || nh % nkv || shapes[PA_MASK][0] != k || shapes[PA_MASK][1] != S || shapes[PA_KC][1] != hd) return 2;
  return attention_into((const float *)params[PA_Q], (const float *)params[PA_KC], (const float *)params[PA_VC],
                        (const int32_t *)params[PA_ROWS], (const float *)params[PA_MASK],
                        ((const float *)params[PA_SCALE])[0], (float *)params[PA_OUT], k, nh, hd, G, nkv, S,
                        shapes[PA_KC][0]);
}

// ---------------------------------------------------------------------------------------------- AttnBlock
// The attention half of a decoder layer in one call:
//   x [k, H] residual, h [k, Hin] normed input (rms(x) in a teacher layer, Hin = H; the EAGLE-3 drafter's first
//   layer feeds [rms(embedding), rms(feature)], Hin = 2 H), wqkv [(nh + 2 n_kv) hd, Hin], wo [H, nh hd] (both
//   f32 or both f16; biases f32),
//   cos / sin_signed [k, hd],
//   heads [2] i32 = (nh, n_kv), key_cache / value_cache [R, hd] (written in place), write_rows [k n_kv] i32 (row
//   of token r, KV head j at r n_kv + j), read_rows [(G,) n_kv, S] i32, mask [k, S], eps [1][, bqkv[, bo]]
//   -> y = x + (attention(h) @ wo.T (+ bo)) [k, H], rms(y) [k, H].
// Steps: q/k/v = h @ wqkv.T (+ bqkv) split by head, NeoX RoPE on q and k; k / v rows written into the caches (in
// row order: padding rows that share a pad slot leave the last one); attention of q over read_rows as
// PagedAttention (scale 1: q carries 1/sqrt(hd)); output projection, residual add, norm.
// AttnBlock's inputs; then the optional biases bqkv, bo (AB_BIAS, AB_BIAS + 1), then the outputs y, rms(y).
enum AttnBlockArg { AB_X, AB_H, AB_WQKV, AB_WO, AB_COS, AB_SIN, AB_HEADS, AB_KC, AB_VC, AB_WROWS, AB_RROWS, AB_MASK,
                    AB_EPS, AB_BIAS };
template <typename W>
static int attn_block(int nparam, void **params, int *ndims, int64_t **shapes) {
  const int nb = nparam - (AB_BIAS + 2);                       // biases given: 0, 1 (bqkv) or 2 (bqkv, bo)
  const float *x = (const float *)params[AB_X], *hin = (const float *)params[AB_H];
  const W *wqkv = (const W *)params[AB_WQKV], *wo = (const W *)params[AB_WO];
  const float *cs = (const float *)params[AB_COS], *sn = (const float *)params[AB_SIN];
  const int32_t *heads = (const int32_t *)params[AB_HEADS];
  float *kc = (float *)params[AB_KC], *vc = (float *)params[AB_VC];
  const int32_t *wrows = (const int32_t *)params[AB_WROWS], *rrows = (const int32_t *)params[AB_RROWS];
  const float *mask = (const float *)params[AB_MASK];
  const float eps = ((const float *)params[AB_EPS])[0];
  const float *bqkv = nb >= 1 ? (const float *)params[AB_BIAS] : nullptr;
  const float *bo = nb == 2 ? (const float *)params[AB_BIAS + 1] : nullptr;
  float *y = (float *)params[AB_BIAS + nb], *hout = (float *)params[AB_BIAS + nb + 1];
  Mat mq, mo;
  if (!mat_arg(ndims, shapes, AB_WQKV, &mq) || !mat_arg(ndims, shapes, AB_WO, &mo)) return 2;
  const int64_t k = shapes[AB_X][0], H = shapes[AB_X][1], Hin = shapes[AB_H][1], width = mq.N;
  const int64_t hd = shapes[AB_COS][1];
  const int64_t half = hd / 2;
  const int64_t nh = heads[0], nkv = heads[1], R = shapes[AB_KC][0];
  const int64_t G = ndims[AB_RROWS] == 3 ? shapes[AB_RROWS][0] : 1, S = shapes[AB_RROWS][ndims[AB_RROWS] - 1];
  if ((nh + 2 * nkv) * hd != width || hd % 2 || shapes[AB_H][0] != k || mq.K != Hin || mo.N != H ||
      mo.K != nh * hd || shapes[AB_KC][1] != hd ||
      shapes[AB_WROWS][0] != k * nkv || shapes[AB_RROWS][ndims[AB_RROWS] - 2] != nkv || k % G ||
      shapes[AB_MASK][0] != k || shapes[AB_MASK][1] != S)
    return 2;
  std::vector<float> qkv(k * width), q(k * nh * hd), ctx(k * nh * hd), o(k * H);
  linear_into(hin, wqkv, qkv.data(), k, Hin, width, mq.packed);
  for (int64_t r = 0; r < k; ++r) {
    float *row = qkv.data() + r * width;
    if (bqkv)
      for (int64_t i = 0; i < width; ++i) row[i] += bqkv[i];
    const float *c = cs + r * hd, *s = sn + r * hd;
    for (int64_t h = 0; h < nh + nkv; ++h) {
      const float *src = row + h * hd;
      const int32_t dst_row = h < nh ? 0 : wrows[r * nkv + h - nh];
      if (h >= nh && (dst_row < 0 || dst_row >= R)) return 3;
      float *dst = h < nh ? q.data() + (r * nh + h) * hd : kc + (int64_t)dst_row * hd;
      for (int64_t i = 0; i < half; ++i) dst[i] = src[i] * c[i] + src[i + half] * s[i];
      for (int64_t i = half; i < hd; ++i) dst[i] = src[i] * c[i] + src[i - half] * s[i];
    }
    for (int64_t j = 0; j < nkv; ++j)
      std::memcpy(vc + (int64_t)wrows[r * nkv + j] * hd, row + (nh + nkv + j) * hd, hd * sizeof(float));
  }
  const int rc = attention_into(q.data(), kc, vc, rrows, mask, 1.0f, ctx.data(), k, nh, hd, G, nkv, S, R);
  if (rc) return rc;
  linear_into(ctx.data(), wo, o.data(), k, nh * hd, H, mo.packed);
  for (int64_t r = 0; r < k; ++r) add_norm_row(x + r * H, o.data() + r * H, bo, eps, y + r * H, hout + r * H, H);
  return 0;
}

extern "C" int AttnBlock(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                         void *extra) {
  Timed timed(K_BLOCK);
  if (nparam < AB_BIAS + 2 || nparam > AB_BIAS + 4 || is_half(dtypes[AB_WQKV]) != is_half(dtypes[AB_WO])) return 1;
  return is_half(dtypes[AB_WQKV]) ? attn_block<_Float16>(nparam, params, ndims, shapes)
                                  : attn_block<float>(nparam, params, ndims, shapes);
}

// ---------------------------------------------------------------------------------------------- DecoderLayer
// A whole decoder layer in one call: AttnBlock's inputs (x, h, wqkv, wo, cos, sin_signed, heads, key_cache,
// value_cache, write_rows, read_rows, mask, eps[, bqkv[, bo]]), then w_gate_up [2F, H] and w_down [H, F] (the same
// dtype as wqkv) -> y = x' + down(silu(gate) * up) of h' = rms(x'), rms(y) [k, H] each, where (x', h') is
// AttnBlock's output. The same two functions as AttnBlock then MlpAddNorm, so the result is theirs bit for bit;
// one graph node instead of two saves MindSpore's cost per op (~50 us on a 2-core CPU, docs/cpu_kernels.md).
template <typename W>
static int decoder_layer(int nparam, void **params, int *ndims, int64_t **shapes) {
  // AttnBlock's inputs (x .. eps and its biases), then w_gate_up, w_down, then the outputs y, rms(y)
  const int nin = nparam - 4, wgu = nin, wd = nin + 1, out_y = nin + 2, out_h = nin + 3;
  const int64_t k = shapes[AB_X][0], H = shapes[AB_X][1];
  Mat gu, dn;
  if (!mat_arg(ndims, shapes, wgu, &gu) || !mat_arg(ndims, shapes, wd, &dn)) return 2;
  const int64_t F = dn.K;
  if (gu.N != 2 * F || gu.K != H || dn.N != H) return 2;
  std::vector<float> y1(k * H), h1(k * H);
  int64_t out_shape[2] = {k, H};
  std::vector<void *> p(params, params + nin);
  std::vector<int> nd(ndims, ndims + nin);
  std::vector<int64_t *> sh(shapes, shapes + nin);
  p.push_back(y1.data()), p.push_back(h1.data());
  nd.push_back(2), nd.push_back(2);
  sh.push_back(out_shape), sh.push_back(out_shape);
  const int rc = attn_block<W>(nin + 2, p.data(), nd.data(), sh.data());
  if (rc) return rc;
  const float eps = ((const float *)params[AB_EPS])[0];
  mlp_add_norm(h1.data(), (const W *)params[wgu], (const W *)params[wd], gu.packed, dn.packed, y1.data(), eps,
               (float *)params[out_y], (float *)params[out_h], k, H, F);
  return 0;
}

extern "C" int DecoderLayer(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  Timed timed(K_LAYER);
  if (nparam < AB_BIAS + 4 || nparam > AB_BIAS + 6) return 1;      // AttnBlock's inputs + 2 weights + 2 outputs
  const bool half = is_half(dtypes[AB_WQKV]);
  if (half != is_half(dtypes[AB_WO]) || half != is_half(dtypes[nparam - 4]) || half != is_half(dtypes[nparam - 3]))
    return 1;
  return half ? decoder_layer<_Float16>(nparam, params, ndims, shapes)
              : decoder_layer<float>(nparam, params, ndims, shapes);
}

// ---------------------------------------------------------------------------------------------- DecoderStack
// A teacher's trunk in one call, from token ids to the last layer: spec [7] i32 = (nh, n_kv, biases, L, a0, a1,
// a2), tokens [k] i32, positions [k] i32, slots [k] i32, block_table [S / B] or [G, S / B] i32 (G sequences of k / G
// rows each), mask [k, S] f32 additive, embed [V, H] f32 or packed [V / 16, H, 16], cos / sin_signed [P, hd] f32
// (RoPE tables), eps [1]; then per layer (wqkv, wo, [bqkv, [bo,]] w_gate_up, w_down, key_cache, value_cache) as
// DecoderLayer takes them (biases = 0, 1 or 2 of them; caches [n_kv (NB + 1) B, hd], written in place)
// -> x [k, H] after the last layer, rms(x) [k, H], aux [k, 3 H] = the residual stream entering layers a0, a1, a2
// side by side (EAGLE-3's captured features).
// It does what the graph did around L DecoderLayer nodes, with the same float operations: the embedding rows
// (cpu.rows), the first norm (AddRmsNorm with a zero addend), the RoPE rows of the positions, the cache rows of
// PortableKVOps.indices (write: head j's row of slot s is j (NB + 1) B + s; read: block_table[c / B] B + c % B of
// column c, per head), then each layer as DecoderLayer on the previous layer's output. One graph node instead of
// ~45 takes ~1 ms of MindSpore's host work off every forward of the 135M teacher (docs/cpu_kernels.md, "Host work
// around a forward"). Returns 1 on a malformed call, 3 on an index out of range (a token, a position, a block), else
// what a layer returns.
enum DecoderStackArg { DS_SPEC, DS_TOKENS, DS_POS, DS_SLOTS, DS_TABLE, DS_MASK, DS_EMBED, DS_COS, DS_SIN, DS_EPS,
                       DS_LAYERS };
template <typename W>
static int decoder_stack(void **params, int *ndims, int64_t **shapes, int per) {
  const int32_t *spec = (const int32_t *)params[DS_SPEC];
  const int nb = spec[2], L = spec[3];
  const int64_t nkv = spec[1], k = shapes[DS_TOKENS][0], S = shapes[DS_MASK][1];
  const int64_t H = shapes[DS_EMBED][1];
  const int64_t V = ndims[DS_EMBED] == 3 ? shapes[DS_EMBED][0] * shapes[DS_EMBED][2] : shapes[DS_EMBED][0];
  const int64_t P = shapes[DS_COS][0], hd = shapes[DS_COS][1];
  const int64_t G = ndims[DS_TABLE] == 2 ? shapes[DS_TABLE][0] : 1, nblk = shapes[DS_TABLE][ndims[DS_TABLE] - 1];
  const int64_t R = shapes[DS_LAYERS + 4 + nb][0], span = R / nkv, B = S / nblk;
  const int32_t *tokens = (const int32_t *)params[DS_TOKENS], *pos = (const int32_t *)params[DS_POS];
  const int32_t *slots = (const int32_t *)params[DS_SLOTS], *table = (const int32_t *)params[DS_TABLE];
  const float *embed = (const float *)params[DS_EMBED];
  const float *cos_t = (const float *)params[DS_COS], *sin_t = (const float *)params[DS_SIN];
  const float eps = ((const float *)params[DS_EPS])[0];
  const int out_y = DS_LAYERS + L * per, out_h = out_y + 1, out_aux = out_y + 2;
  float *aux = (float *)params[out_aux];
  // the prologue: embedding rows, their norm, RoPE rows, cache rows
  std::vector<float> x0(k * H), h0(k * H), zero(H, 0.f), tmp(H), cs(k * hd), sn(k * hd), buf(4 * k * H);
  std::vector<int32_t> wrows(k * nkv), rrows(G * nkv * S);
  for (int64_t r = 0; r < k; ++r) {
    const int64_t t = tokens[r], p = pos[r];
    if (t < 0 || t >= V || p < 0 || p >= P || slots[r] < 0 || slots[r] >= span) return 3;
    if (ndims[DS_EMBED] == 3)
      for (int64_t i = 0; i < H; ++i) x0[r * H + i] = embed[(t / PANEL * H + i) * PANEL + t % PANEL];
    else
      std::memcpy(x0.data() + r * H, embed + t * H, H * sizeof(float));
    add_norm_row(zero.data(), x0.data() + r * H, nullptr, eps, tmp.data(), h0.data() + r * H, H);
    std::memcpy(cs.data() + r * hd, cos_t + p * hd, hd * sizeof(float));
    std::memcpy(sn.data() + r * hd, sin_t + p * hd, hd * sizeof(float));
    for (int64_t j = 0; j < nkv; ++j) wrows[r * nkv + j] = (int32_t)(j * span + slots[r]);
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < S; ++c) {
      const int64_t blk = table[g * nblk + c / B];
      if (blk < 0 || (blk + 1) * B > span) return 3;
      for (int64_t j = 0; j < nkv; ++j) rrows[(g * nkv + j) * S + c] = (int32_t)(j * span + blk * B + c % B);
    }
  int64_t kh[2] = {k, H}, khd[2] = {k, hd}, wsh[1] = {k * nkv}, rsh3[3] = {G, nkv, S}, two[1] = {2};
  int64_t *rsh = ndims[DS_TABLE] == 2 ? rsh3 : rsh3 + 1;
  const int rnd = ndims[DS_TABLE] == 2 ? 3 : 2;
  const float *x = x0.data(), *h = h0.data();
  for (int l = 0; l < L; ++l) {
    for (int j = 0; j < 3; ++j)
      if (spec[4 + j] == l)
        for (int64_t r = 0; r < k; ++r) std::memcpy(aux + r * 3 * H + j * H, x + r * H, H * sizeof(float));
    const int base = DS_LAYERS + l * per;
    float *y = l + 1 == L ? (float *)params[out_y] : buf.data() + (l % 2) * 2 * k * H;
    float *hn = l + 1 == L ? (float *)params[out_h] : y + k * H;
    // DecoderLayer's arguments: x, h, wqkv, wo, cos, sin, heads, kc, vc, write_rows, read_rows, mask, eps[, bqkv
    // [, bo]], w_gate_up, w_down, y, rms(y)
    void *p[AB_BIAS + 6] = {(void *)x, (void *)h, params[base], params[base + 1], cs.data(), sn.data(),
                            (void *)spec, params[base + 4 + nb], params[base + 5 + nb], wrows.data(), rrows.data(),
                            params[DS_MASK], params[DS_EPS]};
    int nd[AB_BIAS + 6] = {2, 2, ndims[base], ndims[base + 1], 2, 2, 1, ndims[base + 4 + nb], ndims[base + 5 + nb],
                           1, rnd, ndims[DS_MASK], ndims[DS_EPS]};
    int64_t *sh[AB_BIAS + 6] = {kh, kh, shapes[base], shapes[base + 1], khd, khd, two, shapes[base + 4 + nb],
                                shapes[base + 5 + nb], wsh, rsh, shapes[DS_MASK], shapes[DS_EPS]};
    int n = AB_BIAS;
    for (int i = 2; i < 4 + nb; ++i)       // the biases, then w_gate_up, w_down
      p[n] = params[base + i], nd[n] = ndims[base + i], sh[n++] = shapes[base + i];
    p[n] = y, nd[n] = 2, sh[n++] = kh;
    p[n] = hn, nd[n] = 2, sh[n++] = kh;
    const int rc = decoder_layer<W>(n, p, nd, sh);
    if (rc) return rc;
    x = y, h = hn;
  }
  return 0;
}

extern "C" int DecoderStack(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  Timed timed(K_STACK);
  if (nparam < DS_LAYERS + 3 || ndims[DS_SPEC] != 1 || shapes[DS_SPEC][0] != 7) return 1;
  const int32_t *spec = (const int32_t *)params[DS_SPEC];
  const int nb = spec[2], L = spec[3], per = 6 + nb;
  if (nb < 0 || nb > 2 || L < 1 || spec[1] < 1 || nparam != DS_LAYERS + L * per + 3) return 1;
  for (int j = 0; j < 3; ++j)
    if (spec[4 + j] < 0 || spec[4 + j] >= L) return 1;
  const int o = DS_LAYERS + L * per, et = ndims[DS_EMBED];
  if (ndims[DS_TOKENS] != 1 || ndims[DS_MASK] != 2 || (et != 2 && et != 3) || (et == 3 && shapes[DS_EMBED][2] != PANEL) ||
      std::strcmp(dtypes[DS_EMBED], "float32") != 0 || ndims[DS_COS] != 2 || ndims[DS_SIN] != 2 ||
      shapes[DS_SIN][0] != shapes[DS_COS][0] || shapes[DS_SIN][1] != shapes[DS_COS][1] ||
      (ndims[DS_TABLE] != 1 && ndims[DS_TABLE] != 2))
    return 1;
  const int64_t k = shapes[DS_TOKENS][0], H = shapes[DS_EMBED][1], S = shapes[DS_MASK][1];
  const int64_t nblk = shapes[DS_TABLE][ndims[DS_TABLE] - 1], G = ndims[DS_TABLE] == 2 ? shapes[DS_TABLE][0] : 1;
  const int64_t R = shapes[DS_LAYERS + 4 + nb][0];
  if (shapes[DS_POS][0] != k || shapes[DS_SLOTS][0] != k || shapes[DS_MASK][0] != k || nblk < 1 || S % nblk ||
      k % G || R % spec[1] || shapes[o][0] != k || shapes[o][1] != H || shapes[o + 2][1] != 3 * H)
    return 1;
  const bool half = is_half(dtypes[DS_LAYERS]);
  for (int l = 0; l < L; ++l) {
    const int base = DS_LAYERS + l * per;
    for (int i : {0, 1, 2 + nb, 3 + nb})
      if (is_half(dtypes[base + i]) != half) return 1;
    if (shapes[base + 4 + nb][0] != R || shapes[base + 5 + nb][0] != R) return 1;
  }
  return half ? decoder_stack<_Float16>(params, ndims, shapes, per) : decoder_stack<float>(params, ndims, shapes, per);
}

// ---------------------------------------------------------------------------------------------- MoveRows
// src [P] i32, dst [P] i32 cache rows, then C caches [R, D] f32, then out [1] f32 (a dummy, zeroed): in every
// cache, the rows src[i] are copied to dst[i], all read before any is written (overlapping ranges are safe: the
// commit of an accepted tree path, models/llama.py KVCompactor). One call moves the rows of every layer's K and V
// cache, where gathers and scatters per layer cost ~4 ms of graph ops a commit (docs/cpu_kernels.md).
// Returns 1 on a malformed call, 3 when an index is outside [0, R) (nothing is written then).
extern "C" int MoveRows(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                        void *extra) {
  if (nparam < 4 || ndims[0] != 1 || ndims[1] != 1 || shapes[0][0] != shapes[1][0]) return 1;
  const int64_t P = shapes[0][0], C = nparam - 3;
  const int32_t *src = (const int32_t *)params[0], *dst = (const int32_t *)params[1];
  for (int64_t c = 0; c < C; ++c) {
    const int i = 2 + (int)c;
    if (ndims[i] != 2 || shapes[i][0] != shapes[2][0] || shapes[i][1] != shapes[2][1] ||
        std::strcmp(dtypes[i], "float32") != 0)
      return 1;
  }
  const int64_t R = shapes[2][0];
  for (int64_t j = 0; j < P; ++j)
    if (src[j] < 0 || src[j] >= R || dst[j] < 0 || dst[j] >= R) return 3;
  *(float *)params[nparam - 1] = 0.f;
  const int64_t row = shapes[2][1] * (int64_t)sizeof(float);
  std::vector<char> tmp(P * row);
  for (int64_t c = 0; c < C; ++c) {
    char *cache = (char *)params[2 + c];
    for (int64_t j = 0; j < P; ++j) std::memcpy(tmp.data() + j * row, cache + src[j] * row, row);
    for (int64_t j = 0; j < P; ++j) std::memcpy(cache + dst[j] * row, tmp.data() + j * row, row);
  }
  return 0;
}
