// The AMX path of the bfloat16 matmul kernel (bf16_matmul.cc): bfloat16 x times bfloat16 w on
// Intel AMX tiles (TDPBF16PS), float32 sums.
//
//   [N, K] w (a tied head):  C[n][m] += W[n0 + n][k..k+32] . x[m][k..k+32]  (A: 16 weight rows
//                            loaded as they are stored; B: x packed per call, pairs along k)
//   [K, N] w (a layer):      C[m][n] += x[m][k..k+32] . W[k..k+32][n0 + n]  (A: 16 x rows; B: the
//                            weight's 32 x 16 block with row pairs interleaved, packed on the fly)
//
// Numerics: each TDPBF16PS adds, per output element, 16 pairs of exact bfloat16 products to the
// float32 sum in the hardware's fixed order (rounded to nearest even; denormals flushed); the k
// tiles of 32 follow in ascending order. An element's sum depends only on its own x row and
// weight column: measured bitwise the same at every tile position and with any other rows
// beside it (zero or not), so a row's result does not depend on the row count (batch
// invariance). It differs from the other paths' order (float32 summation error).
//
// Linux lends the tile registers only after arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA); where
// that fails the path is unsupported. The caller's tile configuration (XLA's own AMX kernels
// may keep one per thread) is saved and restored around each use.

#include "bf16_matmul_amx.h"

#include "amx_tiles.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace xlaserve_amx {
namespace {

constexpr int kTile = 16;   // rows of a tile, and float32 columns of a result tile
constexpr int kPair = 32;   // bfloat16 values along k in one tile row (64 bytes)
constexpr int kGroups = 4;  // result tiles (16 rows of x each) per pass over a weight block

using xlaserve_amx_tiles::RequestTiles;
using xlaserve_amx_tiles::TileConfig;

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")))

// Tiles: 0 and 6 = A, 1 = B, 2..5 = the result tiles of up to kGroups groups of 16 x rows (or,
// with one group, of 4 blocks of 16 weight rows).
void Configure() { xlaserve_amx_tiles::ConfigureTiles(7); }

// Stores result tile t (16 x 16 float32) into s.
AMX_TARGET void StoreResult(int t, float* s) {
  switch (t) {
    case 0: _tile_stored(2, s, 64); break;
    case 1: _tile_stored(3, s, 64); break;
    case 2: _tile_stored(4, s, 64); break;
    default: _tile_stored(5, s, 64); break;
  }
}

AMX_TARGET void ZeroResults() {
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
}

// Result tile g += A . B (the tile numbers are immediates, hence the switch).
AMX_TARGET inline void Accumulate(int g) {
  switch (g) {
    case 0: _tile_dpbf16ps(2, 0, 1); break;
    case 1: _tile_dpbf16ps(3, 0, 1); break;
    case 2: _tile_dpbf16ps(4, 0, 1); break;
    default: _tile_dpbf16ps(5, 0, 1); break;
  }
}

// [N, K] with at most 16 rows of x: 64 output columns a pass (4 result tiles, the weight tiles
// loaded into tiles 0 and 6 in turn), so 4 blocks of weight rows stream at once. Each result
// element is summed as in NkColumns (the same tiles of k in the same order).
AMX_TARGET void NkColumnsOneGroup(const AmxProblem& p, int64_t n0, int64_t n1) {
  constexpr int64_t kWide = 4 * kTile;
  std::vector<uint16_t> block;
  alignas(64) float result[kTile * kTile];
  for (int64_t n = n0; n < n1; n += kWide) {
    const int64_t cols = std::min<int64_t>(kWide, n1 - n);  // n1 <= N; chunks are 64 columns
    const uint16_t* a = p.w + n * p.k;
    int64_t lda = p.k;
    if (p.k % kPair != 0 || cols < kWide) {
      block.assign(kWide * p.kp, 0);
      for (int64_t i = 0; i < cols; ++i) std::memcpy(block.data() + i * p.kp, p.w + (n + i) * p.k, p.k * 2);
      a = block.data();
      lda = p.kp;
    }
    const int64_t stride = lda * 2, step = kTile * lda;
    ZeroResults();
    for (int64_t k = 0; k < p.kp; k += kPair) {
      _tile_loadd(1, p.xb + (k / 2) * kPair, 64);
      _tile_loadd(0, a + k, stride);
      _tile_dpbf16ps(2, 0, 1);
      _tile_loadd(6, a + step + k, stride);
      _tile_dpbf16ps(3, 6, 1);
      _tile_loadd(0, a + 2 * step + k, stride);
      _tile_dpbf16ps(4, 0, 1);
      _tile_loadd(6, a + 3 * step + k, stride);
      _tile_dpbf16ps(5, 6, 1);
    }
    for (int64_t t = 0; t < 4 && t * kTile < cols; ++t) {
      StoreResult(int(t), result);  // result[i][j]: column n + 16 t + i, row j
      const int64_t c = std::min<int64_t>(kTile, cols - t * kTile);
      for (int64_t j = 0; j < p.m; ++j)
        for (int64_t i = 0; i < c; ++i) p.out[j * p.n + n + t * kTile + i] = result[i * kTile + j];
    }
  }
}

// [N, K]: output columns n0..n1 (n0 a multiple of 16).
AMX_TARGET void NkColumns(const AmxProblem& p, int64_t n0, int64_t n1) {
  if (p.m <= kTile) return NkColumnsOneGroup(p, n0, n1);
  const int64_t groups = (p.m + kTile - 1) / kTile;
  const bool direct = p.k % kPair == 0;
  std::vector<uint16_t> block;  // a weight block padded with zeros (K not a multiple of 32, or N's tail)
  alignas(64) float result[kTile * kTile];
  for (int64_t n = n0; n < n1; n += kTile) {
    const int64_t cols = std::min<int64_t>(kTile, p.n - n);
    const uint16_t* a = p.w + n * p.k;
    int64_t lda = p.k;
    if (!direct || cols < kTile) {
      block.assign(kTile * p.kp, 0);
      for (int64_t i = 0; i < cols; ++i) std::memcpy(block.data() + i * p.kp, p.w + (n + i) * p.k, p.k * 2);
      a = block.data();
      lda = p.kp;
    }
    for (int64_t g0 = 0; g0 < groups; g0 += kGroups) {
      const int64_t gs = std::min<int64_t>(kGroups, groups - g0);
      ZeroResults();
      for (int64_t k = 0; k < p.kp; k += kPair) {
        _tile_loadd(0, a + k, lda * 2);
        for (int64_t g = 0; g < gs; ++g) {
          _tile_loadd(1, p.xb + (g0 + g) * (p.kp / 2) * kPair + (k / 2) * kPair, 64);
          Accumulate(int(g));
        }
      }
      for (int64_t g = 0; g < gs; ++g) {
        StoreResult(int(g), result);  // result[i][j]: column n + i, row 16 (g0 + g) + j
        const int64_t m0 = (g0 + g) * kTile, rows = std::min<int64_t>(kTile, p.m - m0);
        for (int64_t j = 0; j < rows; ++j)
          for (int64_t i = 0; i < cols; ++i) p.out[(m0 + j) * p.n + n + i] = result[i * kTile + j];
      }
    }
  }
}

// The B tiles of a [K, N] weight's 16 columns from n: for each k tile, 16 rows of 64 bytes,
// row r = (w[k + 2r][n + j], w[k + 2r + 1][n + j]) for j = 0..15; zeros past K and N.
AMX_TARGET void PackKn(const AmxProblem& p, int64_t n, uint16_t* b) {
  const int64_t cols = std::min<int64_t>(kTile, p.n - n);
  const __mmask16 mask = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t r = 0; r < p.kp / 2; ++r) {
    const int64_t k = 2 * r;
    const __m256i lo = k < p.k ? _mm256_maskz_loadu_epi16(mask, p.w + k * p.n + n) : _mm256_setzero_si256();
    const __m256i hi = k + 1 < p.k ? _mm256_maskz_loadu_epi16(mask, p.w + (k + 1) * p.n + n) : _mm256_setzero_si256();
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    _mm512_storeu_si512(b + r * kPair, _mm512_permutexvar_epi16(order, both));
  }
}

// [K, N]: output columns n0..n1 (n0 a multiple of 16).
AMX_TARGET void KnColumns(const AmxProblem& p, int64_t n0, int64_t n1) {
  const int64_t groups = (p.m + kTile - 1) / kTile;
  std::vector<uint16_t> packed(p.kp / 2 * kPair);
  alignas(64) float result[kTile * kTile];
  for (int64_t n = n0; n < n1; n += kTile) {
    const int64_t cols = std::min<int64_t>(kTile, p.n - n);
    PackKn(p, n, packed.data());
    for (int64_t g0 = 0; g0 < groups; g0 += kGroups) {
      const int64_t gs = std::min<int64_t>(kGroups, groups - g0);
      ZeroResults();
      for (int64_t k = 0; k < p.kp; k += kPair) {
        _tile_loadd(1, packed.data() + (k / 2) * kPair, 64);
        for (int64_t g = 0; g < gs; ++g) {
          _tile_loadd(0, p.xa + (g0 + g) * kTile * p.kp + k, p.kp * 2);
          Accumulate(int(g));
        }
      }
      for (int64_t g = 0; g < gs; ++g) {
        StoreResult(int(g), result);  // result[j][i]: row 16 (g0 + g) + j, column n + i
        const int64_t m0 = (g0 + g) * kTile, rows = std::min<int64_t>(kTile, p.m - m0);
        for (int64_t j = 0; j < rows; ++j)
          std::memcpy(p.out + (m0 + j) * p.n + n, result + j * kTile, cols * 4);
      }
    }
  }
}

}  // namespace

bool AmxAvailable() {
  static const bool ok = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         RequestTiles();
  return ok;
}

void AmxPack(AmxProblem& p, const uint16_t* x, std::vector<uint16_t>& storage) {
  p.kp = (p.k + kPair - 1) / kPair * kPair;
  const int64_t groups = (p.m + kTile - 1) / kTile;
  storage.assign(groups * kTile * p.kp, 0);
  if (p.w_kn) {  // A tiles: x's rows, padded with zeros to 16 rows a group and kp columns
    for (int64_t m = 0; m < p.m; ++m) std::memcpy(storage.data() + m * p.kp, x + m * p.k, p.k * 2);
    p.xa = storage.data();
  } else {  // B tiles: per group of 16 rows, B[r][2j + e] = x[16 g + j][2r + e]
    for (int64_t m = 0; m < p.m; ++m) {
      uint16_t* g = storage.data() + (m / kTile) * (p.kp / 2) * kPair + 2 * (m % kTile);
      for (int64_t k = 0; k < p.k; ++k) g[(k / 2) * kPair + (k % 2)] = x[m * p.k + k];
    }
    p.xb = storage.data();
  }
}

AMX_TARGET void AmxColumns(const AmxProblem& p, int64_t n0, int64_t n1) {
  TileConfig saved;
  _tile_storeconfig(&saved);
  Configure();
  if (p.w_kn) KnColumns(p, n0, n1); else NkColumns(p, n0, n1);
  _tile_loadconfig(&saved);  // palette 0 (nothing was configured): the tiles released
}

}  // namespace xlaserve_amx
