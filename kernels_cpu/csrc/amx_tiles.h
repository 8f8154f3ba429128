// What both AMX kernels (bf16_matmul_amx.cc, int8_matmul_amx.cc) need of the tiles themselves:
// the tile configuration's memory layout (Intel SDM, LDTILECFG: palette, start row, 14 reserved
// bytes, each tile's bytes a row and rows) and Linux's permission to use the tile registers.
#pragma once

#include <immintrin.h>

#include <cstdint>
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace xlaserve_amx_tiles {

struct alignas(64) TileConfig {
  uint8_t palette = 0, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads a palette-1 configuration of `tiles` tiles (0..tiles-1), each 16 rows of 64 bytes: the
// only shape either kernel uses. Needs the tile registers granted (RequestTiles) first.
__attribute__((target("amx-tile"))) inline void ConfigureTiles(int tiles) {
  TileConfig c;
  c.palette = 1;
  for (int t = 0; t < tiles; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// Asks Linux for the tile registers (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); false
// where it refuses or the platform has no such call: the AMX paths are then unsupported.
inline bool RequestTiles() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

}  // namespace xlaserve_amx_tiles
