// int8 x int8 -> int32 matrix product for XLA:CPU, called through XLA's typed FFI.
//
//   out[m, n] = sum_k x[m, k] * w[n, k]      (w_kn = 0: the weight is [N, K], a tied head)
//   out[m, n] = sum_k x[m, k] * w[k, n]      (w_kn = 1: the weight is [K, N], a layer matrix)
//
// x: [M, K] int8, w: int8, out: [M, N] int32. Integer accumulation is exact, so the result
// never depends on M, on the order of the sums, on the instruction set or on the threads:
// each output element equals the XLA int32 dot's bit for bit.
//
// Paths, chosen at run time (attribute `isa`: 0 auto, 1 avx2, 2 avx512, 3 scalar, 4 amx):
//   amx:    AMX-INT8 tiles (int8_matmul_amx.cc), for products of many rows; only on request
//           ("auto" never takes it: the Python side routes products above the VNNI path's rows).
//   avx512: AVX512BW + AVX512_VNNI. vpdpbusd multiplies unsigned by signed bytes, so x is
//           taken as x + 128 (x ^ 0x80) and 128 * sum_k w subtracted (the sums by one more
//           vpdpbusd with a vector of ones).
//   avx2:   vpmaddubsw of |x| by w with x's sign (vpsignb): |x| * |w| <= 127 * 127, so the
//           16-bit pair sums never saturate; vpmaddwd widens them to 32 bits.
//   scalar: plain loops (any CPU).
// The output columns are split in chunks over XLA's intra-op thread pool (the caller takes
// chunks too, so the call finishes even if no pool thread ever runs); small products run on
// the calling thread alone.

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
#include "int8_matmul_amx.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Every loop over a register block (rows, columns, vectors) fully unrolled: GCC 12 otherwise
// keeps the accumulator arrays addressable and stores all of them to the stack on every k
// step. Unrolling does not reorder any floating-point sum.
#define XS_UNROLL _Pragma("GCC unroll 16")

namespace {

enum Isa : int64_t { kAuto = 0, kAvx2 = 1, kAvx512 = 2, kScalar = 3, kAmx = 4 };

// How far ahead of its loads a thread prefetches the weights it streams through ([N, K]: bytes;
// 1024 and 4096 measured, 4096 best).
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kPrefetchRows = 64;  // [K, N] strip walks: rows ahead (1, 16, 64 measured; 64 best)

struct Problem {
  const int8_t* x;
  const int8_t* w;
  int32_t* out;
  int64_t m, n, k;
  bool w_kn;
  // Per-path copies of x, rows padded to kp bytes with zeros.
  const uint8_t* xa;  // avx512: x ^ 0x80; avx2: |x|
  const int8_t* xs;   // avx2: x (its signs); avx512 with w [K, N]: x
  const int32_t* xsum;  // avx512 with w [K, N]: sum_k x[m, k] for each row
  bool kn_strips;       // avx512 with w [K, N]: the strip walk (Avx512KnBlock), a baseline
  int64_t kp;
  const xlaserve_amx_int8::AmxInt8Problem* amx;  // the amx path's problem (x packed for the tiles)
};

// ---------------------------------------------------------------------------------- scalar

void ScalarColumns(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < p.m; ++m) {
    const int8_t* xr = p.x + m * p.k;
    for (int64_t n = n0; n < n1; ++n) {
      int32_t acc = 0;
      if (p.w_kn) {
        for (int64_t k = 0; k < p.k; ++k) acc += int32_t(xr[k]) * p.w[k * p.n + n];
      } else {
        const int8_t* wr = p.w + n * p.k;
        for (int64_t k = 0; k < p.k; ++k) acc += int32_t(xr[k]) * wr[k];
      }
      p.out[m * p.n + n] = acc;
    }
  }
}

// ---------------------------------------------------------------------------------- avx512

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

AVX512_TARGET inline int32_t Sum512(__m512i v) { return _mm512_reduce_add_epi32(v); }

// The sums of 4 vectors: lane j of the result is the sum of v[j]'s 16 lanes.
AVX512_TARGET inline __m128i Sum4x512(const __m512i v[4]) {
  const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
  const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
  const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// w [N, K]: each output column is a contiguous row of w. NB columns (1 or 4) from n times MB
// rows of x from m0; the 4-column form only shares the horizontal sums' shuffles, each
// (row, column) sum is formed the same way in both.
template <int MB, int NB>
AVX512_TARGET void Avx512NkBlock(const Problem& p, int64_t m0, int64_t n) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i acc[MB][4], wsum[4];
  XS_UNROLL for (int j = 0; j < 4; ++j) {
    wsum[j] = _mm512_setzero_si512();
    XS_UNROLL for (int i = 0; i < MB; ++i) acc[i][j] = _mm512_setzero_si512();
  }
  for (int64_t k = 0; k < p.k; k += 64) {
    const int64_t left = p.k - k;
    const __mmask64 mask = left >= 64 ? ~__mmask64(0) : ((__mmask64(1) << left) - 1);
    __m512i wv[NB];
    XS_UNROLL for (int j = 0; j < NB; ++j) {
      // Hardware prefetch alone left the head's product at ~2/3 of the speed (measured).
      _mm_prefetch(reinterpret_cast<const char*>(p.w + (n + j) * p.k + k + kPrefetchBytes), _MM_HINT_T0);
      wv[j] = _mm512_maskz_loadu_epi8(mask, p.w + (n + j) * p.k + k);
      wsum[j] = _mm512_dpbusd_epi32(wsum[j], ones, wv[j]);
    }
    XS_UNROLL for (int i = 0; i < MB; ++i) {
      const __m512i xv = _mm512_loadu_si512(p.xa + (m0 + i) * p.kp + k);
      XS_UNROLL for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xv, wv[j]);
    }
  }
  alignas(16) int32_t bias[4], sums[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(bias), _mm_slli_epi32(Sum4x512(wsum), 7));  // 128 * sum_k w
  XS_UNROLL for (int i = 0; i < MB; ++i) {
    _mm_store_si128(reinterpret_cast<__m128i*>(sums), Sum4x512(acc[i]));
    XS_UNROLL for (int j = 0; j < NB; ++j) p.out[(m0 + i) * p.n + n + j] = sums[j] - bias[j];
  }
}

// Four rows of w [K, N] (k .. k+3, 64 columns from n0) as 4 vectors whose 32-bit lanes hold
// one column's 4 consecutive k: vector i, lane e <-> column n0 + 16 * (e / 4) + 4 * i + e % 4.
// Rows past K read as zeros.
AVX512_TARGET inline void Avx512Interleave(const Problem& p, int64_t k, int64_t n0, __mmask64 mask,
                                           __m512i g[4], bool prefetch = false) {
  __m512i r[4];
  XS_UNROLL for (int j = 0; j < 4; ++j) {
    if (prefetch && k + j + kPrefetchRows < p.k)  // the strip walk's (Avx512KnBlock)
      _mm_prefetch(reinterpret_cast<const char*>(p.w + (k + j + kPrefetchRows) * p.n + n0), _MM_HINT_T0);
    r[j] = (k + j < p.k) ? _mm512_maskz_loadu_epi8(mask, p.w + (k + j) * p.n + n0) : _mm512_setzero_si512();
  }
  const __m512i ab_lo = _mm512_unpacklo_epi8(r[0], r[1]), ab_hi = _mm512_unpackhi_epi8(r[0], r[1]);
  const __m512i cd_lo = _mm512_unpacklo_epi8(r[2], r[3]), cd_hi = _mm512_unpackhi_epi8(r[2], r[3]);
  g[0] = _mm512_unpacklo_epi16(ab_lo, cd_lo);
  g[1] = _mm512_unpackhi_epi16(ab_lo, cd_lo);
  g[2] = _mm512_unpacklo_epi16(ab_hi, cd_hi);
  g[3] = _mm512_unpackhi_epi16(ab_hi, cd_hi);
}

// w [K, N], output columns [n0, n1), every row of x: a sweep down w's rows, kKnSweepRows at a
// time, each read front to back across the columns (strips of 64), the sums of every (row of
// x, strip) kept in `acc` between row blocks. Here the weight is vpdpbusd's unsigned operand
// (w ^ 0x80 = w + 128) and x its signed one, so the correction is 128 * sum_k x[m, k], one
// number a row (`xsum`). Walking one 64-column strip down all of K instead (a stride of N bytes
// between loads, 2 KB for Gemma's [640, 2048], so most likely every row of a strip in the same
// L1 sets) read the layers' matrices at 1/3 of the [N, K] path's speed (benchmarks/RESULTS.md,
// 2026-12-07). Sums stay exact: |sum_k (w + 128) x| <= 255 * 128 * K < 2^31 for K <= 65536.
constexpr int64_t kKnSweepRows = 32;  // rows of w a block (8, 16, 32, 64 measured; 32 best)

// Rows [m0, m0 + MB) of x (MB <= 4: 4 * MB sums in registers) over w's rows [kb, ke) in the strip
// of 64 columns from c0; `a` holds the rows' sums of that strip, [MB][4 vectors of 16 lanes].
template <int MB>
AVX512_TARGET void Avx512KnSweepBlock(const Problem& p, int64_t m0, int64_t kb, int64_t ke, int64_t c0,
                                      __mmask64 mask, int32_t* a) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  __m512i r[MB][4];
  XS_UNROLL for (int m = 0; m < MB; ++m)
    XS_UNROLL for (int i = 0; i < 4; ++i) r[m][i] = _mm512_loadu_si512(a + 64 * m + 16 * i);
  for (int64_t k = kb; k < ke; k += 4) {
    __m512i g[4];
    Avx512Interleave(p, k, c0, mask, g);
    XS_UNROLL for (int i = 0; i < 4; ++i) g[i] = _mm512_xor_si512(g[i], flip);
    XS_UNROLL for (int m = 0; m < MB; ++m) {
      int32_t x4;
      std::memcpy(&x4, p.xs + (m0 + m) * p.kp + k, 4);
      const __m512i xb = _mm512_set1_epi32(x4);
      XS_UNROLL for (int i = 0; i < 4; ++i) r[m][i] = _mm512_dpbusd_epi32(r[m][i], g[i], xb);
    }
  }
  XS_UNROLL for (int m = 0; m < MB; ++m)
    XS_UNROLL for (int i = 0; i < 4; ++i) _mm512_storeu_si512(a + 64 * m + 16 * i, r[m][i]);
}

AVX512_TARGET void Avx512KnSweep(const Problem& p, const int32_t* xsum, int64_t n0, int64_t n1) {
  const int64_t strips = (n1 - n0 + 63) / 64;
  std::vector<int32_t> acc(strips * p.m * 64, 0);  // [strip][row of x][4 vectors of 16 lanes]
  for (int64_t kb = 0; kb < p.k; kb += kKnSweepRows) {
    const int64_t ke = std::min(p.k, kb + kKnSweepRows);
    for (int64_t s = 0; s < strips; ++s) {
      const int64_t c0 = n0 + 64 * s, cols = std::min<int64_t>(64, n1 - c0);
      const __mmask64 mask = cols >= 64 ? ~__mmask64(0) : ((__mmask64(1) << cols) - 1);
      int32_t* a = acc.data() + s * p.m * 64;
      int64_t m0 = 0;
      for (; m0 + 4 <= p.m; m0 += 4) Avx512KnSweepBlock<4>(p, m0, kb, ke, c0, mask, a + m0 * 64);
      switch (p.m - m0) {
        case 3: Avx512KnSweepBlock<3>(p, m0, kb, ke, c0, mask, a + m0 * 64); break;
        case 2: Avx512KnSweepBlock<2>(p, m0, kb, ke, c0, mask, a + m0 * 64); break;
        case 1: Avx512KnSweepBlock<1>(p, m0, kb, ke, c0, mask, a + m0 * 64); break;
        default: break;
      }
    }
  }
  for (int64_t s = 0; s < strips; ++s) {
    const int64_t c0 = n0 + 64 * s, cols = std::min<int64_t>(64, n1 - c0);
    for (int64_t m = 0; m < p.m; ++m) {
      const int32_t* a = acc.data() + (s * p.m + m) * 64;
      const int32_t bias = xsum[m] * 128;
      int32_t* o = p.out + m * p.n + c0;
      for (int i = 0; i < 4; ++i)
        for (int e = 0; e < 16; ++e) {
          const int64_t c = 16 * (e / 4) + 4 * i + e % 4;
          if (c < cols) o[c] = a[16 * i + e] - bias;
        }
    }
  }
}

// The strip walk this file had before Avx512KnSweep (one 64-column strip down all of K, x as the
// unsigned operand, the weights' sums beside): the baseline of benchmarks.cpu_kernels'
// "kernel-strips" ($XLASERVE_CPU_KERNELS_KN=strips).
template <int MB>
AVX512_TARGET void Avx512KnBlock(const Problem& p, int64_t m0, int64_t n0) {
  const int64_t cols = std::min<int64_t>(64, p.n - n0);
  const __mmask64 mask = cols >= 64 ? ~__mmask64(0) : ((__mmask64(1) << cols) - 1);
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i acc[MB][4], wsum[4];
  XS_UNROLL for (int i = 0; i < 4; ++i) {
    wsum[i] = _mm512_setzero_si512();
    XS_UNROLL for (int r = 0; r < MB; ++r) acc[r][i] = _mm512_setzero_si512();
  }
  for (int64_t k = 0; k < p.k; k += 4) {
    __m512i g[4];
    Avx512Interleave(p, k, n0, mask, g, /*prefetch=*/true);
    XS_UNROLL for (int i = 0; i < 4; ++i) wsum[i] = _mm512_dpbusd_epi32(wsum[i], ones, g[i]);
    XS_UNROLL for (int r = 0; r < MB; ++r) {
      int32_t x4;
      std::memcpy(&x4, p.xa + (m0 + r) * p.kp + k, 4);
      const __m512i xb = _mm512_set1_epi32(x4);
      XS_UNROLL for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], xb, g[i]);
    }
  }
  alignas(64) int32_t lanes[4][16];
  XS_UNROLL for (int r = 0; r < MB; ++r) {
    XS_UNROLL for (int i = 0; i < 4; ++i) {
      const __m512i bias = _mm512_slli_epi32(wsum[i], 7);  // 128 * sum_k w
      _mm512_store_si512(lanes[i], _mm512_sub_epi32(acc[r][i], bias));
    }
    int32_t* o = p.out + (m0 + r) * p.n + n0;
    XS_UNROLL for (int i = 0; i < 4; ++i)
      XS_UNROLL for (int e = 0; e < 16; ++e) {
        const int64_t c = 16 * (e / 4) + 4 * i + e % 4;
        if (c < cols) o[c] = lanes[i][e];
      }
  }
}

// ---------------------------------------------------------------------------------- avx2

#define AVX2_TARGET __attribute__((target("avx2,fma")))

AVX2_TARGET inline int32_t Sum256(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// |x| (u8) times w with x's sign, 4 bytes to each 32-bit lane.
AVX2_TARGET inline __m256i Avx2Dot4(__m256i acc, __m256i xabs, __m256i xsgn, __m256i w) {
  const __m256i p16 = _mm256_maddubs_epi16(xabs, _mm256_sign_epi8(w, xsgn));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

template <int MB>
AVX2_TARGET void Avx2NkBlock(const Problem& p, int64_t m0, int64_t n) {
  const int8_t* wr = p.w + n * p.k;
  __m256i acc[MB];
  XS_UNROLL for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_si256();
  const int64_t kv = p.k - p.k % 32;
  for (int64_t k = 0; k < kv; k += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(wr + k + kPrefetchBytes), _MM_HINT_T0);
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k));
    XS_UNROLL for (int i = 0; i < MB; ++i) {
      const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.xa + (m0 + i) * p.kp + k));
      const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.xs + (m0 + i) * p.kp + k));
      acc[i] = Avx2Dot4(acc[i], xa, xs, wv);
    }
  }
  XS_UNROLL for (int i = 0; i < MB; ++i) {
    int32_t s = Sum256(acc[i]);
    const int8_t* xr = p.x + (m0 + i) * p.k;
    for (int64_t k = kv; k < p.k; ++k) s += int32_t(xr[k]) * wr[k];
    p.out[(m0 + i) * p.n + n] = s;
  }
}

// As Avx512Interleave for 32 columns: vector i, lane e <-> column n0 + 16 * (e / 4) + 4 * i + e % 4.
AVX2_TARGET inline void Avx2Interleave(const Problem& p, int64_t k, int64_t n0, int64_t cols, __m256i g[4]) {
  __m256i r[4];
  XS_UNROLL for (int j = 0; j < 4; ++j) {
    if (k + j + kPrefetchRows < p.k)
      _mm_prefetch(reinterpret_cast<const char*>(p.w + (k + j + kPrefetchRows) * p.n + n0), _MM_HINT_T0);
    if (k + j >= p.k) {
      r[j] = _mm256_setzero_si256();
    } else if (cols >= 32) {
      r[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.w + (k + j) * p.n + n0));
    } else {
      alignas(32) int8_t tail[32] = {0};
      std::memcpy(tail, p.w + (k + j) * p.n + n0, cols);
      r[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
    }
  }
  const __m256i ab_lo = _mm256_unpacklo_epi8(r[0], r[1]), ab_hi = _mm256_unpackhi_epi8(r[0], r[1]);
  const __m256i cd_lo = _mm256_unpacklo_epi8(r[2], r[3]), cd_hi = _mm256_unpackhi_epi8(r[2], r[3]);
  g[0] = _mm256_unpacklo_epi16(ab_lo, cd_lo);
  g[1] = _mm256_unpackhi_epi16(ab_lo, cd_lo);
  g[2] = _mm256_unpacklo_epi16(ab_hi, cd_hi);
  g[3] = _mm256_unpackhi_epi16(ab_hi, cd_hi);
}

template <int MB>
AVX2_TARGET void Avx2KnBlock(const Problem& p, int64_t m0, int64_t n0) {
  const int64_t cols = std::min<int64_t>(32, p.n - n0);
  __m256i acc[MB][4];
  XS_UNROLL for (int r = 0; r < MB; ++r)
    XS_UNROLL for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_si256();
  for (int64_t k = 0; k < p.k; k += 4) {
    __m256i g[4];
    Avx2Interleave(p, k, n0, cols, g);
    XS_UNROLL for (int r = 0; r < MB; ++r) {
      int32_t a4, s4;
      std::memcpy(&a4, p.xa + (m0 + r) * p.kp + k, 4);
      std::memcpy(&s4, p.xs + (m0 + r) * p.kp + k, 4);
      const __m256i xa = _mm256_set1_epi32(a4), xs = _mm256_set1_epi32(s4);
      XS_UNROLL for (int i = 0; i < 4; ++i) acc[r][i] = Avx2Dot4(acc[r][i], xa, xs, g[i]);
    }
  }
  alignas(32) int32_t lanes[4][8];
  XS_UNROLL for (int r = 0; r < MB; ++r) {
    XS_UNROLL for (int i = 0; i < 4; ++i) _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[i]), acc[r][i]);
    int32_t* o = p.out + (m0 + r) * p.n + n0;
    XS_UNROLL for (int i = 0; i < 4; ++i)
      XS_UNROLL for (int e = 0; e < 8; ++e) {
        const int64_t c = 16 * (e / 4) + 4 * i + e % 4;
        if (c < cols) o[c] = lanes[i][e];
      }
  }
}

// ---------------------------------------------------------------------------------- driver

// Rows in blocks of 4 (the last block 1-3 rows): every row's dot is computed by the same
// instructions whatever the block, so the row count never changes a result (and could not:
// the sums are integers).
template <int MB>
struct A512Nk4 { static void Run(const Problem& p, int64_t m0, int64_t n) { Avx512NkBlock<MB, 4>(p, m0, n); } };
template <int MB>
struct A512Nk1 { static void Run(const Problem& p, int64_t m0, int64_t n) { Avx512NkBlock<MB, 1>(p, m0, n); } };
template <int MB>
struct A512Kn { static void Run(const Problem& p, int64_t m0, int64_t n) { Avx512KnBlock<MB>(p, m0, n); } };
template <int MB>
struct A2Nk { static void Run(const Problem& p, int64_t m0, int64_t n) { Avx2NkBlock<MB>(p, m0, n); } };
template <int MB>
struct A2Kn { static void Run(const Problem& p, int64_t m0, int64_t n) { Avx2KnBlock<MB>(p, m0, n); } };

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

// Output columns [n0, n1) on one thread.
void Columns(const Problem& p, Isa isa, int64_t n0, int64_t n1) {
  if (isa == kScalar) return ScalarColumns(p, n0, n1);
  if (isa == kAmx) return xlaserve_amx_int8::AmxInt8Columns(*p.amx, n0, n1);
  if (p.w_kn) {
    if (isa == kAvx512 && !p.kn_strips) return Avx512KnSweep(p, p.xsum, n0, n1);
    for (int64_t n = n0; n < n1; n += isa == kAvx512 ? 64 : 32) {
      if (isa == kAvx512) AllRows<A512Kn>(p, n); else AllRows<A2Kn>(p, n);
    }
  } else {
    int64_t n = n0;
    if (isa == kAvx512)
      for (; n + 4 <= n1; n += 4) AllRows<A512Nk4>(p, n);
    for (; n < n1; ++n) {
      if (isa == kAvx512) AllRows<A512Nk1>(p, n); else AllRows<A2Nk>(p, n);
    }
  }
}

bool Supports(Isa isa) {
  switch (isa) {
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    case kAvx2:
      return __builtin_cpu_supports("avx2");
    case kScalar:
      return true;
    case kAmx:
      return xlaserve_amx_int8::AmxInt8Available();
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

// Work shared by the threads of one call; held by shared_ptr so that a pool task that starts
// after the call returned finds no chunk left and touches nothing else.
struct Shared {
  Problem p;
  Isa isa;
  int64_t chunk, chunks;
  std::atomic<int64_t> next{0}, done{0};
  void Work() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      Columns(p, isa, c * chunk, std::min(p.n, (c + 1) * chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// The product of x (xd: [M, K]) by the 2-D weight matrix at w (wd: its two dimensions).
ffi::Error Int8MatmulCore(ffi::ThreadPool& pool, const int8_t* x, ffi::Span<const int64_t> xd,
                          const int8_t* w, int64_t w0, int64_t w1, ffi::Result<ffi::Buffer<ffi::S32>>& out,
                          int64_t w_kn, int64_t isa_attr) {
  const auto od = out->dimensions();
  if (xd.size() != 2 || od.size() != 2)
    return ffi::Error::InvalidArgument("int8_matmul: x, w and out must be 2-D");
  Problem p{};
  p.x = x;
  p.w = w;
  p.out = out->typed_data();
  p.m = xd[0];
  p.k = xd[1];
  p.w_kn = w_kn != 0;
  p.n = p.w_kn ? w1 : w0;
  if ((p.w_kn ? w0 : w1) != p.k || od[0] != p.m || od[1] != p.n)
    return ffi::Error::InvalidArgument("int8_matmul: shapes do not agree");
  if (p.k > 65536) return ffi::Error::InvalidArgument("int8_matmul: K over 65536 could overflow int32");
  Isa isa = static_cast<Isa>(isa_attr);
  if (isa == kAuto) isa = Supports(kAvx512) ? kAvx512 : Supports(kAvx2) ? kAvx2 : kScalar;
  if (!Supports(isa)) return ffi::Error::InvalidArgument("int8_matmul: this CPU lacks the requested isa");
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();

  // x's per-path copy, rows padded with zeros to a whole vector (and 4 more bytes).
  p.kp = (p.k + 63) / 64 * 64 + 64;
  std::vector<uint8_t> xa;
  std::vector<int8_t> xs;
  std::vector<int32_t> xsum;
  if (const char* kn = std::getenv("XLASERVE_CPU_KERNELS_KN")) p.kn_strips = std::strcmp(kn, "strips") == 0;
  const bool kn512 = isa == kAvx512 && p.w_kn && !p.kn_strips;  // Avx512KnSweep: x as is, and its row sums
  std::vector<int8_t> xt;  // the amx path's packed x
  xlaserve_amx_int8::AmxInt8Problem amx{p.w, p.out, p.m, p.n, p.k, p.w_kn};
  if (isa == kAmx) {
    xlaserve_amx_int8::AmxInt8Pack(amx, p.x, xt);
    p.amx = &amx;
  } else if (isa != kScalar) {
    xa.assign(p.m * p.kp, 0);
    if (isa == kAvx2 || kn512) xs.assign(p.m * p.kp, 0);
    if (kn512) xsum.assign(p.m, 0);
    for (int64_t m = 0; m < p.m; ++m)
      for (int64_t k = 0; k < p.k; ++k) {
        const int8_t v = p.x[m * p.k + k];
        if (kn512) {
          xs[m * p.kp + k] = v;
          xsum[m] += v;
        } else if (isa == kAvx512) {
          xa[m * p.kp + k] = uint8_t(v) ^ 0x80;
        } else {
          xa[m * p.kp + k] = uint8_t(v < 0 ? -v : v);
          xs[m * p.kp + k] = v;
        }
      }
    p.xa = xa.data();
    p.xs = xs.data();
    p.xsum = xsum.data();
  }
  // (Padding bytes meet weights read as zeros, so they add nothing on either path.)

  const int64_t macs = p.m * p.n * p.k;
  // Handing work to the pool costs ~40 us a call (measured: a [2, 640] x [640, 2048] product
  // took 0.093 ms on one thread, 0.135 ms on two): a layer matrix runs on the calling thread,
  // the output head (3e8 multiply-adds a token row) is split.
  const int64_t min_macs = EnvInt("XLASERVE_CPU_KERNELS_PARALLEL_MACS", int64_t(1) << 25);
  int64_t threads = std::min<int64_t>(EnvInt("XLASERVE_CPU_KERNELS_THREADS", AllowedCores()),
                                      std::max<int64_t>(1, pool.num_threads()));
  const int64_t unit = p.w_kn || isa == kAmx ? 64 : 16;
  if (macs < min_macs || threads <= 1) {
    Columns(p, isa, 0, p.n);
    return ffi::Error::Success();
  }
  auto shared = std::make_shared<Shared>();
  shared->p = p;
  shared->isa = isa;
  // About 8 chunks a thread: uneven thread speeds even out, each chunk still long.
  const int64_t units = (p.n + unit - 1) / unit;
  const int64_t per = std::max<int64_t>(1, units / (8 * threads));
  shared->chunk = per * unit;
  shared->chunks = (p.n + shared->chunk - 1) / shared->chunk;
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([shared] { shared->Work(); });
  shared->Work();
  while (shared->done.load(std::memory_order_acquire) < shared->chunks) _mm_pause();
  return ffi::Error::Success();
}


ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w,
                          ffi::ResultBuffer<ffi::S32> out, int64_t w_kn, int64_t isa_attr) {
  const auto wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("int8_matmul: x, w and out must be 2-D");
  return Int8MatmulCore(pool, x.typed_data(), x.dimensions(), w.typed_data(), wd[0], wd[1], out, w_kn,
                        isa_attr);
}

// w: [L, ., .] int8, every layer's matrix; layer: int32 scalar. Layer `layer` (clamped to
// [0, L - 1], as XLA's dynamic-slice clamps) is read where it lies in the stack, so a layer
// scan hands the kernel the stacked weight without copying its slice out first.
ffi::Error Int8MatmulStackedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w,
                                 ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::S32> out, int64_t w_kn,
                                 int64_t isa_attr) {
  const auto wd = w.dimensions();
  if (wd.size() != 3 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("int8_matmul_stacked: w must be 3-D and layer a scalar");
  if (wd[0] == 0) return ffi::Error::InvalidArgument("int8_matmul_stacked: no layers");
  const int64_t l = std::clamp<int64_t>(*layer.typed_data(), 0, wd[0] - 1);
  return Int8MatmulCore(pool, x.typed_data(), x.dimensions(), w.typed_data() + l * wd[1] * wd[2], wd[1],
                        wd[2], out, w_kn, isa_attr);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveInt8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("w_kn")
                                  .Attr<int64_t>("isa"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveInt8MatmulStacked, Int8MatmulStackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("w_kn")
                                  .Attr<int64_t>("isa"));

// The instruction sets this CPU runs (bit 1: avx2, bit 2: avx512 with VNNI, bit 3: amx, the bf16
// kernel's tiles, bit 4: amx-int8, this kernel's tiles), for the Python side.
extern "C" int xlaserve_cpu_kernels_isas() {
  return (Supports(kAvx2) ? 2 : 0) | (Supports(kAvx512) ? 4 : 0) | (xlaserve_amx::AmxAvailable() ? 8 : 0) |
         (Supports(kAmx) ? 16 : 0);
}
