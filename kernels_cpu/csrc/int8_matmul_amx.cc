// The AMX path of the int8 matmul kernel (int8_matmul.cc): int8 x times int8 w on Intel AMX
// tiles (TDPBSSD: signed bytes by signed bytes, groups of 4 products summed into int32), for
// products of many rows (prefill chunks, decode batches of 8-64 int8 rows).
//
//   [N, K] w (a tied head):  C[n][m] += W[n0 + n][k..k+64] . x[m][k..k+64]  (A: 16 weight rows
//                            loaded as they are stored; B: x packed per call, VNNI-4 along k)
//   [K, N] w (a layer):      C[m][n] += x[m][k..k+64] . W[k..k+64][n0 + n]  (A: 16 x rows; B: the
//                            weight's 64 x 16 block with 4 rows interleaved, packed per call into
//                            a per-thread buffer, 64 columns at a time)
//
// Numerics: every product and sum is an exact integer (|sum| <= 127 * 128 * 65536 < 2^31), so
// the result is XLA's int32 dot bit for bit whatever the tile order or the rows beside a row
// (batch invariance at any row count).
//
// Register blocking: 2 x 2 result tiles (tiles 2..5) from 2 A tiles (0, 1) and 2 B tiles
// (6, 7), so 4 tile loads feed 4 TDPBSSD. x's rows are padded to an even count of 16-row
// groups (zeros), so every pass has both A or both B tiles.
//
// Linux lends the tile registers only after arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA); where
// that fails the path is unsupported. The caller's tile configuration (XLA's own AMX kernels may
// keep one per thread) is saved and restored around each use, as bf16_matmul_amx.cc does.

#include "int8_matmul_amx.h"

#include "amx_tiles.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace xlaserve_amx_int8 {
namespace {

constexpr int kTile = 16;   // rows of a tile, and int32 columns of a result tile
constexpr int kStep = 64;   // int8 values along k in one A tile row (64 bytes)
constexpr int kPack = 64;   // [K, N]: columns of one packed block (4 B tiles, a cache line a k row)
constexpr int64_t kPackBytes = 512 << 10;  // [K, N]: packed blocks a thread holds at once (in L2)
constexpr int64_t kManyGroups = 8;         // [K, N]: from 128 rows of x, one packed block at a time

using xlaserve_amx_tiles::RequestTiles;
using xlaserve_amx_tiles::TileConfig;

#define AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl")))

void Configure() { xlaserve_amx_tiles::ConfigureTiles(8); }

// The 2 x 2 result tiles of one pass: C2 = A0 B6, C3 = A0 B7, C4 = A1 B6, C5 = A1 B7, over kp.
// a0/a1: A tiles' first rows (stride lda bytes), advanced by 64 bytes a k step; b6/b7: B tiles
// (stride 64), advanced by 16 rows of 64 bytes a k step. pre: when not null, a line of the next
// A block to prefetch each k step (prefetch_rows rows from pre, stride lda).
AMX_TARGET inline void Pass(const int8_t* a0, const int8_t* a1, int64_t lda, const int8_t* b6,
                            const int8_t* b7, int64_t kp, const int8_t* pre, int64_t prefetch_rows) {
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  for (int64_t k = 0, kb = 0; k < kp; k += kStep, kb += kTile * 64) {
    if (pre)
      for (int64_t i = 0; i < prefetch_rows; ++i) _mm_prefetch(reinterpret_cast<const char*>(pre + i * lda + k), _MM_HINT_T0);
    _tile_loadd(0, a0 + k, lda);
    _tile_loadd(6, b6 + kb, 64);
    _tile_dpbssd(2, 0, 6);
    _tile_loadd(7, b7 + kb, 64);
    _tile_dpbssd(3, 0, 7);
    _tile_loadd(1, a1 + k, lda);
    _tile_dpbssd(4, 1, 6);
    _tile_dpbssd(5, 1, 7);
  }
}

AMX_TARGET void StoreResults(int32_t (*r)[kTile * kTile]) {
  _tile_stored(2, r[0], 64);
  _tile_stored(3, r[1], 64);
  _tile_stored(4, r[2], 64);
  _tile_stored(5, r[3], 64);
}

// Result tile 2 + t stored at dst, rows stride bytes apart (the tile numbers are immediates).
AMX_TARGET void StoreResult(int t, int32_t* dst, int64_t stride) {
  switch (t) {
    case 0: _tile_stored(2, dst, stride); break;
    case 1: _tile_stored(3, dst, stride); break;
    case 2: _tile_stored(4, dst, stride); break;
    default: _tile_stored(5, dst, stride); break;
  }
}

// The 4 x 4 transpose of 4 vectors' 128-bit lanes: w[l] = (v[0].l, v[1].l, v[2].l, v[3].l).
AMX_TARGET inline void TransposeLanes(const __m512i v[4], __m512i w[4]) {
  const __m512i t0 = _mm512_shuffle_i64x2(v[0], v[1], _MM_SHUFFLE(1, 0, 1, 0));  // v0.0 v0.1 v1.0 v1.1
  const __m512i t1 = _mm512_shuffle_i64x2(v[2], v[3], _MM_SHUFFLE(1, 0, 1, 0));  // v2.0 v2.1 v3.0 v3.1
  const __m512i t2 = _mm512_shuffle_i64x2(v[0], v[1], _MM_SHUFFLE(3, 2, 3, 2));
  const __m512i t3 = _mm512_shuffle_i64x2(v[2], v[3], _MM_SHUFFLE(3, 2, 3, 2));
  w[0] = _mm512_shuffle_i64x2(t0, t1, _MM_SHUFFLE(2, 0, 2, 0));
  w[1] = _mm512_shuffle_i64x2(t0, t1, _MM_SHUFFLE(3, 1, 3, 1));
  w[2] = _mm512_shuffle_i64x2(t2, t3, _MM_SHUFFLE(2, 0, 2, 0));
  w[3] = _mm512_shuffle_i64x2(t2, t3, _MM_SHUFFLE(3, 1, 3, 1));
}

// t: a 16 x 16 int32 tile t[c][q]; writes its transpose's rows q < rows, columns c < cols, to
// dst + q * ld (32-bit interleave, 64-bit interleave, then the 128-bit lanes).
AMX_TARGET void StoreTransposed(const int32_t* t, int32_t* dst, int64_t ld, int64_t rows, int64_t cols) {
  __m512i s[16], u[16];
  for (int j = 0; j < 8; ++j) {
    const __m512i a = _mm512_load_si512(t + 2 * j * kTile), b = _mm512_load_si512(t + (2 * j + 1) * kTile);
    s[2 * j] = _mm512_unpacklo_epi32(a, b);
    s[2 * j + 1] = _mm512_unpackhi_epi32(a, b);
  }
  for (int j = 0; j < 4; ++j) {  // u[4 j + e], lane l: t[4 j .. 4 j + 3][4 l + e]
    u[4 * j] = _mm512_unpacklo_epi64(s[4 * j], s[4 * j + 2]);
    u[4 * j + 1] = _mm512_unpackhi_epi64(s[4 * j], s[4 * j + 2]);
    u[4 * j + 2] = _mm512_unpacklo_epi64(s[4 * j + 1], s[4 * j + 3]);
    u[4 * j + 3] = _mm512_unpackhi_epi64(s[4 * j + 1], s[4 * j + 3]);
  }
  const __mmask16 mask = cols >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  for (int e = 0; e < 4; ++e) {
    const __m512i v[4] = {u[e], u[4 + e], u[8 + e], u[12 + e]};
    __m512i w[4];
    TransposeLanes(v, w);
    for (int l = 0; l < 4; ++l)
      if (4 * l + e < rows) _mm512_mask_storeu_epi32(dst + (4 * l + e) * ld, mask, w[l]);
  }
}

// [N, K]: output columns n0..n1, 32 weight rows (two A tiles) a pass over every pair of x's
// row groups. The weight rows are read as stored where K is a multiple of 64 (a 32-row block is
// contiguous: the next block is prefetched line by line during the first pair's pass), else
// copied into a zero-padded block first.
AMX_TARGET void NkColumns(const AmxInt8Problem& p, int64_t n0, int64_t n1) {
  constexpr int64_t kRows = 2 * kTile;
  const int64_t bsize = p.kp / 4 * 64;  // bytes of one group's B tiles
  thread_local std::vector<int8_t> block;
  alignas(64) int32_t r[4][kTile * kTile];
  for (int64_t n = n0; n < n1; n += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, p.n - n);
    const int8_t* a = p.w + n * p.k;
    int64_t lda = p.k;
    const bool direct = p.k % kStep == 0 && rows == kRows;
    if (!direct) {
      block.assign(kRows * p.kp, 0);
      for (int64_t i = 0; i < rows; ++i) std::memcpy(block.data() + i * p.kp, p.w + (n + i) * p.k, p.k);
      a = block.data();
      lda = p.kp;
    }
    const int8_t* next = direct && n + 2 * kRows <= p.n ? p.w + (n + kRows) * p.k : nullptr;
    for (int64_t g = 0; g < p.groups; g += 2) {
      const int8_t* b = p.x + g * bsize;
      Pass(a, a + kTile * lda, lda, b, b + bsize, p.kp, g == 0 ? next : nullptr, kRows);
      StoreResults(r);  // r[2 i + j][c][q]: weight row n + 16 i + c, x row 16 (g + j) + q
      for (int i = 0; i < 2; ++i) {
        const int64_t cols = std::min<int64_t>(kTile, rows - i * kTile);
        for (int j = 0; j < 2 && cols > 0; ++j) {
          const int64_t m0 = (g + j) * kTile, ms = std::min<int64_t>(kTile, p.m - m0);
          if (ms > 0) StoreTransposed(r[2 * i + j], p.out + m0 * p.n + n + i * kTile, p.n, ms, cols);
        }
      }
    }
  }
}

// A [K, N] weight's columns [n0, n0 + span) (span a multiple of 64) as B tiles: 64-column block
// b at b + b * 4 * tile (tile = kp / 4 * 64 bytes), its tile t (columns n0 + 64 b + 16 t ..) at
// + t * tile: kp / 4 rows of 64 bytes, byte 4 j + e of row r = w[4 r + e][n0 + 64 b + 16 t + j];
// zeros past K and N. The k rows are read in order, each row's span from left to right (4
// streams of contiguous bytes: what the hardware prefetchers follow; one 64-column block at a
// time down K read one cache line per 2 KB row and ran at ~3 GB/s from memory). Each k row's 64
// columns are one load; 4 rows are interleaved bytewise (unpack 8 then 16 bits gives, in
// 128-bit lane l of vector i, columns 16 l + 4 i .. + 3 with their 4 k), then the 4 x 4 lanes
// transposed.
AMX_TARGET void PackKn(const AmxInt8Problem& p, int64_t n0, int64_t span, int8_t* b) {
  const int64_t tile = p.kp / 4 * 64;
  for (int64_t r = 0; r < p.kp / 4; ++r) {
    for (int64_t n = n0; n < n0 + span; n += kPack) {
      const int64_t cols = std::min<int64_t>(kPack, p.n - n);
      __m512i v[4];
      if (cols <= 0) {
        for (int e = 0; e < 4; ++e) v[e] = _mm512_setzero_si512();
      } else {
        const __mmask64 mask = cols >= 64 ? ~__mmask64(0) : ((__mmask64(1) << cols) - 1);
        for (int e = 0; e < 4; ++e) {
          const int64_t k = 4 * r + e;
          v[e] = k < p.k ? _mm512_maskz_loadu_epi8(mask, p.w + k * p.n + n) : _mm512_setzero_si512();
        }
      }
      const __m512i ab_lo = _mm512_unpacklo_epi8(v[0], v[1]), ab_hi = _mm512_unpackhi_epi8(v[0], v[1]);
      const __m512i cd_lo = _mm512_unpacklo_epi8(v[2], v[3]), cd_hi = _mm512_unpackhi_epi8(v[2], v[3]);
      const __m512i g[4] = {_mm512_unpacklo_epi16(ab_lo, cd_lo), _mm512_unpackhi_epi16(ab_lo, cd_lo),
                            _mm512_unpacklo_epi16(ab_hi, cd_hi), _mm512_unpackhi_epi16(ab_hi, cd_hi)};
      __m512i o[4];
      TransposeLanes(g, o);
      int8_t* dst = b + (n - n0) / kPack * 4 * tile + r * 64;
      for (int t = 0; t < 4; ++t) _mm512_store_si512(dst + t * tile, o[t]);
    }
  }
}

// An aligned per-thread buffer of at least `bytes` (the packed weight columns).
int8_t* ThreadBuffer(int64_t bytes) {
  thread_local std::vector<int8_t> storage;
  if (int64_t(storage.size()) < bytes + 64) storage.resize(bytes + 64);
  const auto at = reinterpret_cast<uintptr_t>(storage.data());
  return storage.data() + ((64 - at % 64) % 64);
}

// [K, N]: output columns n0..n1 (n0 a multiple of 64).
AMX_TARGET void KnColumns(const AmxInt8Problem& p, int64_t n0, int64_t n1) {
  const int64_t tile = p.kp / 4 * 64;
  // Columns packed at once: with few rows (reading the weight is the cost) as many 64-column
  // blocks as fit kPackBytes, read row by row; with many (the tiles' work is the cost) one
  // block, so that its B tiles stay in L1 while every row group passes over them.
  const int64_t span = p.groups >= kManyGroups ? kPack : std::max<int64_t>(1, kPackBytes / (4 * tile)) * kPack;
  int8_t* packed = ThreadBuffer(span / kPack * 4 * tile);
  alignas(64) int32_t r[kTile * kTile];
  for (int64_t n = n0; n < n1; n += kPack) {
    const int64_t cols = std::min<int64_t>(kPack, p.n - n);
    if ((n - n0) % span == 0) PackKn(p, n, std::min<int64_t>(span, (n1 - n + kPack - 1) / kPack * kPack), packed);
    const int8_t* block = packed + (n - n0) % span / kPack * 4 * tile;
    for (int64_t t = 0; t * kTile < cols; t += 2) {
      for (int64_t g = 0; g < p.groups; g += 2) {
        const int8_t* a = p.x + g * kTile * p.kp;
        Pass(a, a + kTile * p.kp, p.kp, block + t * tile, block + (t + 1) * tile, p.kp, nullptr, 0);
        // Result tile 2 i + j: x rows 16 (g + i) + q, columns n + 16 (t + j) + c; whole tiles
        // stored straight into out, partial ones through r.
        for (int i = 0; i < 2; ++i) {
          const int64_t m0 = (g + i) * kTile, ms = std::min<int64_t>(kTile, p.m - m0);
          for (int j = 0; j < 2; ++j) {
            const int64_t c0 = (t + j) * kTile, cs = std::min<int64_t>(kTile, cols - c0);
            if (cs <= 0 || ms <= 0) continue;
            int32_t* dst = p.out + m0 * p.n + n + c0;
            if (ms == kTile && cs == kTile) {
              StoreResult(2 * i + j, dst, p.n * 4);
              continue;
            }
            StoreResult(2 * i + j, r, 64);
            for (int64_t q = 0; q < ms; ++q) std::memcpy(dst + q * p.n, r + q * kTile, cs * 4);
          }
        }
      }
    }
  }
}

}  // namespace

bool AmxInt8Available() {
  static const bool ok = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         RequestTiles();
  return ok;
}

void AmxInt8Pack(AmxInt8Problem& p, const int8_t* x, std::vector<int8_t>& storage) {
  p.kp = (p.k + kStep - 1) / kStep * kStep;
  p.groups = ((p.m + kTile - 1) / kTile + 1) / 2 * 2;
  storage.assign(p.groups * kTile * p.kp + 64, 0);
  const auto at = reinterpret_cast<uintptr_t>(storage.data());
  int8_t* s = storage.data() + ((64 - at % 64) % 64);
  if (p.w_kn) {  // A tiles: x's rows
    for (int64_t m = 0; m < p.m; ++m) std::memcpy(s + m * p.kp, x + m * p.k, p.k);
  } else {  // B tiles: per group, row r holds x[16 g + j][4 r .. 4 r + 3] at bytes 4 j ..
    const int64_t bsize = p.kp / 4 * 64;
    for (int64_t m = 0; m < p.m; ++m) {
      int8_t* g = s + (m / kTile) * bsize + 4 * (m % kTile);
      const int8_t* xr = x + m * p.k;
      int64_t k = 0;
      for (; k + 4 <= p.k; k += 4) std::memcpy(g + k * 16, xr + k, 4);  // row k / 4, 64 bytes a row
      for (; k < p.k; ++k) g[(k / 4) * 64 + k % 4] = xr[k];
    }
  }
  p.x = s;
}

AMX_TARGET void AmxInt8Columns(const AmxInt8Problem& p, int64_t n0, int64_t n1) {
  TileConfig saved;
  _tile_storeconfig(&saved);
  Configure();
  if (p.w_kn) KnColumns(p, n0, n1); else NkColumns(p, n0, n1);
  _tile_loadconfig(&saved);  // palette 0 (nothing was configured): the tiles released
}

}  // namespace xlaserve_amx_int8
