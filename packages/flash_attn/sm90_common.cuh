// Building blocks of the Hopper (sm_90a) attention kernels, forward (attention_sm90.cu) and backward
// (attention_sm90_bwd.cu): the generic ones (mbarriers, TMA, wgmma, device queries) are
// kcpp/kernel/sm90.cuh's; this adds the tensor maps over attention's operands.  See attention_sm90.cu's
// head comment for the swizzle, the descriptor strides and the fragment layouts.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "attention.h"
#include "kcpp/kernel/cuda.cuh"
#include "kcpp/kernel/error.h"
#include "kcpp/kernel/fast_math.h"
#include "softcap.cuh"
#include "kcpp/kernel/sm90.cuh"

namespace kcpp::flash {
namespace {

using kernel::DType;
using namespace kernel::sm90;

// A 4-d map (D, S, H, B) over operand `o`, boxes of 64 columns x `rows` rows, 128-byte swizzle; rows
// past S read as zeros.  False when the driver refuses it (the caller then takes another path).
bool make_map(CUtensorMap* map, const Operand& o, DType dt, int64_t d, int64_t s, int64_t heads, int64_t batch, int rows) {
  const auto fn = encode_fn();
  if (!fn) return false;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(s), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(batch)};
  // A dimension of extent 1 is never stepped: give it any legal stride (its own may be 0 or odd).
  auto stride = [](int64_t elems, int64_t extent, cuuint64_t fallback) {
    return extent > 1 ? static_cast<cuuint64_t>(elems) * 2 : fallback;
  };
  const cuuint64_t ss = stride(o.ss, s, 16 * ((d * 2 + 15) / 16));
  const cuuint64_t sh = stride(o.sh, heads, ss * static_cast<cuuint64_t>(s));
  const cuuint64_t sb = stride(o.sb, batch, sh * static_cast<cuuint64_t>(heads));
  const cuuint64_t strides[3] = {ss, sh, sb};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(rows), 1, 1};
  const cuuint32_t estr[4] = {1, 1, 1, 1};
  return fn(map, dt == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
            const_cast<void*>(o.data), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace
}  // namespace kcpp::flash
