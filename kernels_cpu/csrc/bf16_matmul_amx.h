// The AMX path of the bfloat16 matmul kernel (bf16_matmul_amx.cc), for bf16_matmul.cc.
#pragma once

#include <cstdint>
#include <vector>

namespace xlaserve_amx {

struct AmxProblem {
  const uint16_t* w;  // bfloat16 bits: [N, K] (w_kn false) or [K, N]
  float* out;         // [M, N]
  int64_t m, n, k;
  bool w_kn;
  int64_t kp = 0;              // K rounded up to 32 (AmxPack)
  const uint16_t* xa = nullptr;  // [K, N]: x's rows, [16 ceil(M / 16), kp], zeros past M and K
  const uint16_t* xb = nullptr;  // [N, K]: per 16 rows of x, kp / 2 tile rows of 64 bytes (pairs)
};

// True where the CPU has AMX-TILE and AMX-BF16 and Linux lent this process the tile registers.
bool AmxAvailable();

// Packs x ([M, K] bfloat16 bits) for the tiles into storage and points p at it (sets kp).
void AmxPack(AmxProblem& p, const uint16_t* x, std::vector<uint16_t>& storage);

// out[:, n0:n1] (n0 a multiple of 16) on the calling thread's tiles.
void AmxColumns(const AmxProblem& p, int64_t n0, int64_t n1);

}  // namespace xlaserve_amx
