// What radixkv's AMX tile code shares (the attention's products in cpu_attention_amx.cpp, the
// bf16 GEMM in cpu_linear.cpp): the target attribute, the one tile configuration both load, and
// the process's tile-state permission. Used only in AVX512-BF16 builds, on hosts with AMX-BF16.
#pragma once

#include <cstdint>

// AMX tile code (AMX-TILE + AMX-BF16 instructions; compiled for these functions only, and run
// only where the host has them and the kernel granted the tile state).
#define RADIXKV_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))

namespace radixkv_amx {

// Palette 1, tiles 0-7 all 16 rows x 64 bytes (16 float32 or 32 bf16 a row).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = 16;
    }
  }
};
inline const TileConfig kTileConfig;

}  // namespace radixkv_amx

// Asks Linux once for this process's AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA; oneDNN asks the same for its own AMX kernels): without it a tile instruction
// faults. False off Linux. (cpu_attention_amx.cpp)
bool amx_tiles_permitted();
// Whether this build and host can run radixkv's AMX tile code: an AVX512-BF16 build, a host
// whose oneDNN packs bf16 for AMX, and the tile state granted. (cpu_attention_amx.cpp)
bool amx_available();
