// The work order of the grouped GEMMs' tiles (host and device): which tile a persistent block's item
// is, and which group a tile of rows belongs to.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KCPP_TILE_HD __host__ __device__ __forceinline__
#else
#define KCPP_TILE_HD inline
#endif

namespace kcpp::kernel {

// Item w of m_tiles x n_tiles in panels of `panel` m tiles (the last one holding what is left), n
// tiles outer and the panel's m tiles inner.  Writes item w's m tile and n tile; every (m, n) pair is
// the item of exactly one w in [0, m_tiles n_tiles).
KCPP_TILE_HD void panel_item(int64_t w, int m_tiles, int n_tiles, int panel, int* mt, int* nt) {
  const int64_t per_panel = static_cast<int64_t>(panel) * n_tiles;
  const int first = static_cast<int>(w / per_panel) * panel;  // the panel's first m tile
  const int rows = m_tiles - first < panel ? m_tiles - first : panel;  // its m tiles
  const int rem = static_cast<int>(w % per_panel);
  *mt = first + rem % rows;
  *nt = rem / rows;
}

// The group of m tile mt: the last g with tile_offsets[g] <= mt (a binary search over groups >= 1
// prefix sums of the groups' tile counts, tile_offsets[0] = 0).
KCPP_TILE_HD int group_of_tile(const int32_t* tile_offsets, int groups, int mt) {
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tile_offsets[mid] <= mt) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

}  // namespace kcpp::kernel
