// The AMX path of the int8 matmul kernel (int8_matmul_amx.cc), for int8_matmul.cc.
#pragma once

#include <cstdint>
#include <vector>

namespace xlaserve_amx_int8 {

struct AmxInt8Problem {
  const int8_t* w;  // [N, K] (w_kn false) or [K, N]
  int32_t* out;     // [M, N]
  int64_t m, n, k;
  bool w_kn;
  int64_t kp = 0;      // K rounded up to 64 (AmxInt8Pack)
  int64_t groups = 0;  // 16-row groups of x, rounded up to an even count (AmxInt8Pack)
  // x packed by AmxInt8Pack, zeros past M and K:
  //   [K, N]: A tiles, x's rows as [16 groups, kp];
  //   [N, K]: B tiles, per group of 16 rows kp / 4 tile rows of 64 bytes (VNNI-4: byte 4 j + e of
  //           row r is x[16 g + j][4 r + e]).
  const int8_t* x = nullptr;
};

// True where the CPU has AMX-TILE and AMX-INT8 (and AVX512BW/VL for the packing) and Linux lent
// this process the tile registers (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
bool AmxInt8Available();

// Packs x ([M, K] int8) for the tiles into storage and points p at it (sets kp and groups).
void AmxInt8Pack(AmxInt8Problem& p, const int8_t* x, std::vector<int8_t>& storage);

// out[:, n0:n1] (n0 a multiple of 64) on the calling thread's tiles.
void AmxInt8Columns(const AmxInt8Problem& p, int64_t n0, int64_t n1);

}  // namespace xlaserve_amx_int8
