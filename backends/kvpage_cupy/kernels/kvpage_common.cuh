// Shared device helpers of the kvpage CuPy backend: element conversions, fp8 encode /
// decode with explicit clamping, warp reductions. Compiled by NVRTC (cupy.RawModule) on
// a GPU and by `nvcc -cubin` in the tests; no host headers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace kvpage {

// KV storage kinds (template argument KIND)
constexpr int KIND_PLAIN = 0;     // float / __half / __nv_bfloat16 storage
constexpr int KIND_INT8 = 1;      // int8 codes * per-token, per-head float32 scale
constexpr int KIND_FP8_E4M3 = 2;  // fp8 bytes * per-tensor/per-head float32 scale
constexpr int KIND_FP8_E5M2 = 3;

// -inf without <math.h> (NVRTC does not guarantee the INFINITY macro)
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(signed char x) { return static_cast<float>(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// fp8 byte -> float (exact: every fp8 value is a half value)
template <int KIND>
__device__ __forceinline__ float fp8_to_float(unsigned char b) {
  const __nv_fp8_interpretation_t fmt = (KIND == KIND_FP8_E4M3) ? __NV_E4M3 : __NV_E5M2;
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), fmt);
  return __half2float(__half(h));
}

// float -> fp8 byte, round to nearest even. Clamps to +-fmax first (the kvpage spec:
// out-of-range saturates on every backend); NaN keeps its sign as sign|0x7F (torch).
template <int KIND>
__device__ __forceinline__ unsigned char float_to_fp8(float y, float fmax) {
  if (y != y) return (__float_as_uint(y) >> 31) ? 0xFF : 0x7F;  // NaN keeps its sign
  y = fminf(fmaxf(y, -fmax), fmax);
  const __nv_fp8_interpretation_t fmt = (KIND == KIND_FP8_E4M3) ? __NV_E4M3 : __NV_E5M2;
  return static_cast<unsigned char>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, fmt));
}

// one stored K/V element, before its scale
template <typename KV, int KIND>
__device__ __forceinline__ float load_kv(const KV* p) {
  if constexpr (KIND == KIND_FP8_E4M3 || KIND == KIND_FP8_E5M2) {
    return fp8_to_float<KIND>(static_cast<unsigned char>(*p));
  } else {
    return to_float(*p);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace kvpage
