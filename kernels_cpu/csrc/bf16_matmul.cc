// Weight-only bfloat16 matrix product for XLA:CPU, called through XLA's typed FFI.
//
//   out[m, n] = sum_k x[m, k] * w[n, k]      (w_kn = 0: the weight is [N, K], a tied head)
//   out[m, n] = sum_k x[m, k] * w[k, n]      (w_kn = 1: the weight is [K, N], a layer matrix)
//
// x: [M, K] bfloat16 or float32, w: bfloat16, out: [M, N] float32.
//
// Numerics: every weight is widened to float32 exactly (its 16 bits shifted into the high half
// of a 32-bit word) and every product is one float32 fused multiply-add into a float32 sum.
// With bfloat16 x (what model.compute.Compute.dot passes) each product is exact, so the result
// is the exact sum rounded at each addition: XLA's bf16 dot with preferred_element_type=f32
// computes the same sum in another order (the tests' tolerance is float32 summation error).
// No vdpbf16ps: it would round a float32 x to bfloat16 and flushes denormals (and on the 2-core
// Sapphire Rapids VM it ran at a quarter of the fused multiply-adds' rate). The amx path
// (bf16_matmul_amx.cc, a bfloat16 x only) sums pairs of exact products on AMX tiles instead.
//
// Batch invariance: each output element is summed in one fixed order, whatever M, the row
// block, the column block or the thread split: row r of an M-row call equals a 1-row call bit
// for bit. The order depends on the path (isa) and the layout:
//   [N, K]: avx512: 16 lane sums over k (k = lane mod 16, ascending), then a fixed shuffle tree;
//           avx2:   8 lane sums over k (k = lane mod 8), then a fixed tree;
//           scalar: k ascending.
//   [K, N]: every path but amx: k ascending (one lane per output column);
//   amx, both layouts: tiles of 32 k ascending, 16 pairs a tile in the hardware's fixed order.
//
// Paths, chosen at run time (attribute `isa`: 0 auto, 1 avx2, 2 avx512, 3 scalar, 4 amx), as the
// int8 kernel's: amx (AMX-BF16 with the tiles lent by Linux, a bfloat16 x; "auto" takes it for
// a [N, K] weight where it runs; a float32 x takes avx512), avx512 (AVX512F/BW), avx2 (AVX2 +
// FMA), scalar (any CPU, no fused multiply-add).
// Threads: as the int8 kernel, output columns in chunks over XLA's intra-op pool, products under
// $XLASERVE_CPU_KERNELS_PARALLEL_MACS (default 2**25) on the calling thread.

#include <immintrin.h>
#ifdef __linux__
#include <sched.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "bf16_matmul_amx.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Every loop over a register block (rows, columns, vectors) fully unrolled: GCC 12 otherwise
// keeps the accumulator arrays addressable and stores all of them to the stack on every k
// step. Unrolling does not reorder any floating-point sum.
#define XS_UNROLL _Pragma("GCC unroll 16")

namespace {

enum Isa : int64_t { kAuto = 0, kAvx2 = 1, kAvx512 = 2, kScalar = 3, kAmx = 4 };

constexpr int64_t kPrefetchBytes = 4096;  // [N, K]: bytes ahead of the weight loads
constexpr int64_t kPrefetchRows = 16;     // [K, N]: weight rows ahead

struct Problem {
  const float* x;  // [M, kp] float32, each row padded with zeros past k
  const uint16_t* w;
  float* out;
  int64_t m, n, k, kp;
  bool w_kn;
  const xlaserve_amx::AmxProblem* amx;  // the amx path's problem (x packed for the tiles)
};

inline float Bf16ToF32(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---------------------------------------------------------------------------------- scalar

void ScalarColumns(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < p.m; ++m) {
    const float* xr = p.x + m * p.kp;
    for (int64_t n = n0; n < n1; ++n) {
      float acc = 0.0f;
      if (p.w_kn) {
        for (int64_t k = 0; k < p.k; ++k) acc += xr[k] * Bf16ToF32(p.w[k * p.n + n]);
      } else {
        const uint16_t* wr = p.w + n * p.k;
        for (int64_t k = 0; k < p.k; ++k) acc += xr[k] * Bf16ToF32(wr[k]);
      }
      p.out[m * p.n + n] = acc;
    }
  }
}

// ---------------------------------------------------------------------------------- avx512

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

AVX512_TARGET inline __m512 Widen512(__m256i b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// Lane j of the result: the sum of v[j]'s 16 lanes, in an order that depends on nothing else
// (the other vectors' lanes never mix into lane j), so a 1-column block passes zeros.
AVX512_TARGET inline __m128 Sum4x512(const __m512 v[4]) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
  const __m512 u = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// w [N, K]: NB (1 or 4) columns from n, MB rows of x from m0.
template <int MB, int NB>
AVX512_TARGET void Avx512NkBlock(const Problem& p, int64_t m0, int64_t n) {
  __m512 acc[MB][4];
  XS_UNROLL for (int i = 0; i < MB; ++i)
    XS_UNROLL for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < p.k; k += 16) {
    const int64_t left = p.k - k;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    __m512 wv[NB];
    XS_UNROLL for (int j = 0; j < NB; ++j) {
      const uint16_t* wr = p.w + (n + j) * p.k + k;
      _mm_prefetch(reinterpret_cast<const char*>(wr) + kPrefetchBytes, _MM_HINT_T0);
      wv[j] = Widen512(_mm256_maskz_loadu_epi16(mask, wr));
    }
    XS_UNROLL for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_loadu_ps(p.x + (m0 + i) * p.kp + k);  // zeros past k
      XS_UNROLL for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  alignas(16) float sums[4];
  XS_UNROLL for (int i = 0; i < MB; ++i) {
    _mm_store_ps(sums, Sum4x512(acc[i]));
    XS_UNROLL for (int j = 0; j < NB; ++j) p.out[(m0 + i) * p.n + n + j] = sums[j];
  }
}

// w [K, N]: 64 columns from n0 (4 vectors; fewer at the end, masked), MB rows from m0.
template <int MB>
AVX512_TARGET void Avx512KnBlock(const Problem& p, int64_t m0, int64_t n0) {
  const int64_t cols = std::min<int64_t>(64, p.n - n0);
  __mmask16 mask[4];
  XS_UNROLL for (int v = 0; v < 4; ++v) {
    const int64_t c = std::clamp<int64_t>(cols - 16 * v, 0, 16);
    mask[v] = c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << c) - 1);
  }
  __m512 acc[MB][4];
  XS_UNROLL for (int r = 0; r < MB; ++r)
    XS_UNROLL for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < p.k; ++k) {
    const uint16_t* wr = p.w + k * p.n + n0;
    if (k + kPrefetchRows < p.k) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetchRows * p.n), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetchRows * p.n + 32), _MM_HINT_T0);
    }
    __m512 wv[4];
    XS_UNROLL for (int v = 0; v < 4; ++v) wv[v] = Widen512(_mm256_maskz_loadu_epi16(mask[v], wr + 16 * v));
    XS_UNROLL for (int r = 0; r < MB; ++r) {
      const __m512 xb = _mm512_set1_ps(p.x[(m0 + r) * p.kp + k]);
      XS_UNROLL for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
  XS_UNROLL for (int r = 0; r < MB; ++r)
    XS_UNROLL for (int v = 0; v < 4; ++v)
      _mm512_mask_storeu_ps(p.out + (m0 + r) * p.n + n0 + 16 * v, mask[v], acc[r][v]);
}

// ---------------------------------------------------------------------------------- avx2

#define AVX2_TARGET __attribute__((target("avx2,fma")))

AVX2_TARGET inline __m256 Widen256(__m128i b) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

// 8 bfloat16 from s, zeros past `count` (< 8: copied through a zeroed buffer).
AVX2_TARGET inline __m128i Load8(const uint16_t* s, int64_t count) {
  if (count >= 8) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  alignas(16) uint16_t t[8] = {0};
  std::memcpy(t, s, std::max<int64_t>(count, 0) * 2);
  return _mm_load_si128(reinterpret_cast<const __m128i*>(t));
}

// Lane j of the result: the sum of v[j]'s 8 lanes, independent of the other vectors.
AVX2_TARGET inline __m128 Sum4x256(const __m256 v[4]) {
  const __m256 t0 = _mm256_add_ps(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1]));
  const __m256 t1 = _mm256_add_ps(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3]));
  const __m256 u = _mm256_add_ps(
      _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(t0), _mm256_castps_pd(t1))),
      _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(t0), _mm256_castps_pd(t1))));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

template <int MB, int NB>
AVX2_TARGET void Avx2NkBlock(const Problem& p, int64_t m0, int64_t n) {
  __m256 acc[MB][4];
  XS_UNROLL for (int i = 0; i < MB; ++i)
    XS_UNROLL for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < p.k; k += 8) {
    __m256 wv[NB];
    XS_UNROLL for (int j = 0; j < NB; ++j) {
      const uint16_t* wr = p.w + (n + j) * p.k + k;
      _mm_prefetch(reinterpret_cast<const char*>(wr) + kPrefetchBytes, _MM_HINT_T0);
      wv[j] = Widen256(Load8(wr, p.k - k));
    }
    XS_UNROLL for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_loadu_ps(p.x + (m0 + i) * p.kp + k);
      XS_UNROLL for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  alignas(16) float sums[4];
  XS_UNROLL for (int i = 0; i < MB; ++i) {
    _mm_store_ps(sums, Sum4x256(acc[i]));
    XS_UNROLL for (int j = 0; j < NB; ++j) p.out[(m0 + i) * p.n + n + j] = sums[j];
  }
}

// w [K, N]: 32 columns from n0 (4 vectors of 8), MB rows from m0.
template <int MB>
AVX2_TARGET void Avx2KnBlock(const Problem& p, int64_t m0, int64_t n0) {
  const int64_t cols = std::min<int64_t>(32, p.n - n0);
  __m256 acc[MB][4];
  XS_UNROLL for (int r = 0; r < MB; ++r)
    XS_UNROLL for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < p.k; ++k) {
    const uint16_t* wr = p.w + k * p.n + n0;
    if (k + kPrefetchRows < p.k) _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetchRows * p.n), _MM_HINT_T0);
    __m256 wv[4];
    XS_UNROLL for (int v = 0; v < 4; ++v) wv[v] = Widen256(Load8(wr + 8 * v, cols - 8 * v));
    XS_UNROLL for (int r = 0; r < MB; ++r) {
      const __m256 xb = _mm256_set1_ps(p.x[(m0 + r) * p.kp + k]);
      XS_UNROLL for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
  alignas(32) float lanes[8];
  XS_UNROLL for (int r = 0; r < MB; ++r)
    for (int v = 0; v < 4 && 8 * v < cols; ++v) {
      _mm256_store_ps(lanes, acc[r][v]);
      std::memcpy(p.out + (m0 + r) * p.n + n0 + 8 * v, lanes, std::min<int64_t>(8, cols - 8 * v) * 4);
    }
}

// ---------------------------------------------------------------------------------- driver

template <int MB> struct A512Nk4 { static void Run(const Problem& p, int64_t m0, int64_t n) { Avx512NkBlock<MB, 4>(p, m0, n); } };
template <int MB> struct A512Nk1 { static void Run(const Problem& p, int64_t m0, int64_t n) { Avx512NkBlock<MB, 1>(p, m0, n); } };
template <int MB> struct A512Kn { static void Run(const Problem& p, int64_t m0, int64_t n) { Avx512KnBlock<MB>(p, m0, n); } };
template <int MB> struct A2Nk4 { static void Run(const Problem& p, int64_t m0, int64_t n) { Avx2NkBlock<MB, 4>(p, m0, n); } };
template <int MB> struct A2Nk1 { static void Run(const Problem& p, int64_t m0, int64_t n) { Avx2NkBlock<MB, 1>(p, m0, n); } };
template <int MB> struct A2Kn { static void Run(const Problem& p, int64_t m0, int64_t n) { Avx2KnBlock<MB>(p, m0, n); } };

// Rows in blocks of 4 (the last 1-3): a row's sums are the same instructions in any block.
template <template <int> class B>
void AllRows(const Problem& p, int64_t col) {
  int64_t m0 = 0;
  for (; m0 + 4 <= p.m; m0 += 4) B<4>::Run(p, m0, col);
  switch (p.m - m0) {
    case 3: B<3>::Run(p, m0, col); break;
    case 2: B<2>::Run(p, m0, col); break;
    case 1: B<1>::Run(p, m0, col); break;
    default: break;
  }
}

void Columns(const Problem& p, Isa isa, int64_t n0, int64_t n1) {
  if (isa == kAmx) return xlaserve_amx::AmxColumns(*p.amx, n0, n1);
  if (isa == kScalar) return ScalarColumns(p, n0, n1);
  if (p.w_kn) {
    const int64_t step = isa == kAvx512 ? 64 : 32;
    for (int64_t n = n0; n < n1; n += step) {
      if (isa == kAvx512) AllRows<A512Kn>(p, n); else AllRows<A2Kn>(p, n);
    }
    return;
  }
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    if (isa == kAvx512) AllRows<A512Nk4>(p, n); else AllRows<A2Nk4>(p, n);
  }
  for (; n < n1; ++n) {
    if (isa == kAvx512) AllRows<A512Nk1>(p, n); else AllRows<A2Nk1>(p, n);
  }
}

bool Supports(Isa isa) {
  switch (isa) {
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kScalar:
      return true;
    case kAmx:
      return xlaserve_amx::AmxAvailable();
    default:
      return false;
  }
}

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoll(v) : fallback;
}

int64_t AllowedCores() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max<int64_t>(1, std::thread::hardware_concurrency());
}

// As the int8 kernel's: held by shared_ptr, so a pool task that starts late finds no chunk.
struct Shared {
  Problem p;
  Isa isa;
  std::vector<float> x;  // keeps p.x alive for late tasks' (empty) loop
  std::vector<uint16_t> xt;  // the amx path's packed x
  xlaserve_amx::AmxProblem amx;
  int64_t chunk, chunks;
  std::atomic<int64_t> next{0}, done{0};
  void Work() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      Columns(p, isa, c * chunk, std::min(p.n, (c + 1) * chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Bf16MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::BF16> w,
                          ffi::ResultBuffer<ffi::F32> out, int64_t w_kn, int64_t isa_attr) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || od.size() != 2)
    return ffi::Error::InvalidArgument("bf16_matmul: x, w and out must be 2-D");
  const ffi::DataType xt = x.element_type();
  if (xt != ffi::DataType::BF16 && xt != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("bf16_matmul: x must be bfloat16 or float32");
  auto shared = std::make_shared<Shared>();
  Problem& p = shared->p;
  p.w = w.typed_data();
  p.out = out->typed_data();
  p.m = xd[0];
  p.k = xd[1];
  p.w_kn = w_kn != 0;
  p.n = p.w_kn ? wd[1] : wd[0];
  if ((p.w_kn ? wd[0] : wd[1]) != p.k || od[0] != p.m || od[1] != p.n)
    return ffi::Error::InvalidArgument("bf16_matmul: shapes do not agree");
  Isa isa = static_cast<Isa>(isa_attr);
  if (isa == kAuto)  // amx for [N, K] only: a [K, N] weight is repacked per call (slower at few rows)
    isa = Supports(kAmx) && !p.w_kn && xt == ffi::DataType::BF16 ? kAmx
          : Supports(kAvx512)                                    ? kAvx512
          : Supports(kAvx2)                                      ? kAvx2
                                                                 : kScalar;
  if (!Supports(isa)) return ffi::Error::InvalidArgument("bf16_matmul: this CPU lacks the requested isa");
  if (isa == kAmx && xt != ffi::DataType::BF16) isa = kAvx512;  // the tiles take bfloat16 x only
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  if (p.k == 0) {
    std::fill(p.out, p.out + p.m * p.n, 0.0f);
    return ffi::Error::Success();
  }

  if (isa == kAmx) {
    xlaserve_amx::AmxProblem& a = shared->amx;
    a.w = p.w;
    a.out = p.out;
    a.m = p.m;
    a.n = p.n;
    a.k = p.k;
    a.w_kn = p.w_kn;
    xlaserve_amx::AmxPack(a, static_cast<const uint16_t*>(x.untyped_data()), shared->xt);
    p.amx = &a;
    p.kp = a.kp;
  } else {
    p.amx = nullptr;
  }
  if (isa != kAmx) {  // x as float32 (exact from bfloat16), rows padded with zeros to a whole vector
    p.kp = (p.k + 15) / 16 * 16;
    shared->x.assign(p.m * p.kp, 0.0f);
    for (int64_t m = 0; m < p.m; ++m) {
      float* dst = shared->x.data() + m * p.kp;
      if (xt == ffi::DataType::F32) {
        std::memcpy(dst, static_cast<const float*>(x.untyped_data()) + m * p.k, p.k * 4);
      } else {
        const uint16_t* src = static_cast<const uint16_t*>(x.untyped_data()) + m * p.k;
        for (int64_t k = 0; k < p.k; ++k) dst[k] = Bf16ToF32(src[k]);
      }
    }
    p.x = shared->x.data();
  }

  const int64_t macs = p.m * p.n * p.k;
  const int64_t min_macs = EnvInt("XLASERVE_CPU_KERNELS_PARALLEL_MACS", int64_t(1) << 25);
  const int64_t threads = std::min<int64_t>(EnvInt("XLASERVE_CPU_KERNELS_THREADS", AllowedCores()),
                                            std::max<int64_t>(1, pool.num_threads()));
  if (macs < min_macs || threads <= 1) {
    Columns(p, isa, 0, p.n);
    return ffi::Error::Success();
  }
  shared->isa = isa;
  const int64_t unit = 64;  // columns; the amx path takes 64 a pass
  const int64_t units = (p.n + unit - 1) / unit;
  const int64_t per = std::max<int64_t>(1, units / (8 * threads));
  shared->chunk = per * unit;
  shared->chunks = (p.n + shared->chunk - 1) / shared->chunk;
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([shared] { shared->Work(); });
  shared->Work();
  while (shared->done.load(std::memory_order_acquire) < shared->chunks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveBf16Matmul, Bf16MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("w_kn")
                                  .Attr<int64_t>("isa"));
