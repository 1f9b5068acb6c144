// write_kv of the kvpage CuPy backend: store each new token's K and V at its slot,
// quantizing for int8 / fp8 caches exactly as kvpage.attention.quant specifies.
//
// Grid (num_tokens, 2 * num_kv_heads) (block y = w * num_kv_heads + h, w = 0 for K, 1 for V;
// grid.z would cap heads at 64), one warp per block; lanes stride head_dim.
// Template arguments: SRC (float, __half, __nv_bfloat16), DST (storage: SRC itself for
// KIND_PLAIN, signed char for int8, unsigned char for fp8), KIND (kvpage_common.cuh).
//   int8: scale = absmax / 127 (0 for an all-zero token); code = clamp(rint(x / scale),
//         -127, 127) (rintf rounds half to even, like torch.round)
//   fp8:  byte = fp8(clamp(x / scale, -fmax, fmax)), round to nearest even
// slot -1 = padding: nothing is written.
#include "kvpage_common.cuh"

namespace kvpage {

template <typename SRC, typename DST, int KIND>
__global__ void write_kv(const SRC* __restrict__ key, long long k_s0, long long k_s1,
                         const SRC* __restrict__ value, long long v_s0, long long v_s1,
                         DST* __restrict__ kv, long long kv_s0, long long kv_s1,
                         long long kv_s2, long long kv_s3,
                         float* __restrict__ tsc, long long ts_s0, long long ts_s1,
                         long long ts_s2, long long ts_s3,
                         const float* __restrict__ fsc,  // [2, num_kv_heads] (fp8 only)
                         const long long* __restrict__ slots, int num_kv_heads, int head_dim,
                         int block_size, float fmax) {
  const int t = blockIdx.x;
  const int w = blockIdx.y / num_kv_heads;
  const int h = blockIdx.y % num_kv_heads;
  const int lane = threadIdx.x;
  const long long slot = slots[t];
  if (slot < 0) return;
  const long long b = slot / block_size;
  const long long o = slot % block_size;
  const SRC* src = (w == 0) ? key + t * k_s0 + h * k_s1 : value + t * v_s0 + h * v_s1;
  DST* dst = kv + w * kv_s0 + b * kv_s1 + o * kv_s2 + h * kv_s3;
  if constexpr (KIND == KIND_PLAIN) {
    for (int d = lane; d < head_dim; d += 32) dst[d] = src[d];
  } else if constexpr (KIND == KIND_INT8) {
    float amax = 0.0f;
    for (int d = lane; d < head_dim; d += 32) amax = fmaxf(amax, fabsf(to_float(src[d])));
    amax = warp_max(amax);
    const float sc = amax / 127.0f;
    for (int d = lane; d < head_dim; d += 32) {
      float code = 0.0f;
      if (sc > 0.0f) code = fminf(fmaxf(rintf(to_float(src[d]) / sc), -127.0f), 127.0f);
      dst[d] = static_cast<signed char>(code);
    }
    if (lane == 0) tsc[w * ts_s0 + b * ts_s1 + o * ts_s2 + h * ts_s3] = sc;
  } else {
    const float sc = fsc[w * num_kv_heads + h];
    for (int d = lane; d < head_dim; d += 32) {
      dst[d] = static_cast<DST>(float_to_fp8<KIND>(to_float(src[d]) / sc, fmax));
    }
  }
}

}  // namespace kvpage
