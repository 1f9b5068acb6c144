// Paged attention (decode and varlen prefill with cached context) and the split-KV
// reduction of the kvpage CuPy backend. paged_attention (below) serves decode and any
// step with few rows; paged_attention_rows serves prefill with enough rows.
//
// One thread block (NUM_WARPS warps) per (query token, group of GT query heads sharing
// one KV head, KV split): K/V rows are read once for the GT heads (GQA). Each warp takes
// KEYS_PER_ITER keys at a time (keys j0 + warp * KEYS_PER_ITER ...); lanes split
// head_dim (lane + 32 * e), dot products are warp reductions, and every warp keeps an
// online-softmax state per head (FlashAttention, Dao et al. 2022). Warps merge through
// shared memory. With num_splits > 1 every block writes a partial output and its
// log-sum-exp, merged by split_reduce (FlashDecoding, Dao et al. 2023; vLLM paged
// attention v2).
//
// Template arguments: Q (query/output type: float, __half, __nv_bfloat16), KV (storage:
// float, __half, __nv_bfloat16, signed char, unsigned char for fp8), KIND (see
// kvpage_common.cuh), HEAD_DIM (exact head size, <= 256), GT (query heads per block).
// Sizes and strides are arguments (in elements); the launcher validates everything.
#include "kvpage_common.cuh"

namespace kvpage {

constexpr int NUM_WARPS = 4;
constexpr int KEYS_PER_ITER = 4;

template <int KIND>
__device__ __forceinline__ float row_scale(const float* __restrict__ tsc, long long ts_row,
                                           const float* __restrict__ fsc, int fsc_index) {
  if constexpr (KIND == KIND_INT8) {
    return tsc[ts_row];
  } else if constexpr (KIND == KIND_FP8_E4M3 || KIND == KIND_FP8_E5M2) {
    return fsc[fsc_index];
  } else {
    return 1.0f;
  }
}

// One tile of KEYS_PER_ITER keys j0.. (< end) for one warp: K and V of the whole tile are
// requested before any is used, so each warp keeps 2 * KEYS_PER_ITER rows of loads in
// flight; then the GT dot products (warp reductions) and the online-softmax update of the
// warp's state (m, l, acc), identical in every lane.
template <typename KV, int KIND, int HEAD_DIM, int GT, int E>
__device__ __forceinline__ void attend_tile(
    int j0, int end, int lane, const int* __restrict__ table, int block_size,
    const KV* __restrict__ kv, long long kv_s0, long long kv_s1, long long kv_s2,
    long long kv_s3, const float* __restrict__ tsc, long long ts_s0, long long ts_s1,
    long long ts_s2, long long ts_s3, const float* __restrict__ fsc, int kh,
    int num_kv_heads, float soft_cap, const float (&qr)[GT][E], float (&acc)[GT][E],
    float (&m)[GT], float (&l)[GT]) {
  long long row[KEYS_PER_ITER];
  float ks[KEYS_PER_ITER];
  float vs[KEYS_PER_ITER];
  bool valid[KEYS_PER_ITER];
#pragma unroll
  for (int u = 0; u < KEYS_PER_ITER; ++u) {
    const int j = j0 + u;
    valid[u] = j < end;
    row[u] = 0;
    ks[u] = vs[u] = 0.0f;
    if (valid[u]) {
      const long long blk = table[j / block_size];
      const long long off = j % block_size;
      row[u] = blk * kv_s1 + off * kv_s2 + kh * kv_s3;
      const long long tr = blk * ts_s1 + off * ts_s2 + kh * ts_s3;
      ks[u] = row_scale<KIND>(tsc, tr, fsc, kh);
      vs[u] = row_scale<KIND>(tsc, ts_s0 + tr, fsc, num_kv_heads + kh);
    }
  }
  // K and V of the KEYS_PER_ITER keys are all requested before any is used, so each
  // warp keeps 2 * KEYS_PER_ITER rows of loads in flight (memory-level parallelism)
  float kr[KEYS_PER_ITER][E];
  float vr[KEYS_PER_ITER][E];
#pragma unroll
  for (int u = 0; u < KEYS_PER_ITER; ++u)
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int d = lane + 32 * e;
      const bool ok = valid[u] && d < HEAD_DIM;
      kr[u][e] = ok ? load_kv<KV, KIND>(kv + row[u] + d) : 0.0f;
      vr[u][e] = ok ? load_kv<KV, KIND>(kv + kv_s0 + row[u] + d) : 0.0f;
    }
  float logit[KEYS_PER_ITER][GT];
#pragma unroll
  for (int u = 0; u < KEYS_PER_ITER; ++u)
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) dot += qr[g][e] * kr[u][e];
      dot = warp_sum(dot) * ks[u];
      if (soft_cap > 0.0f) dot = soft_cap * tanhf(dot / soft_cap);
      logit[u][g] = valid[u] ? dot : neg_inf();
    }
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    float mn = m[g];
#pragma unroll
    for (int u = 0; u < KEYS_PER_ITER; ++u) mn = fmaxf(mn, logit[u][g]);
    const float corr = expf(m[g] - mn);  // m = -inf -> 0
    l[g] *= corr;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] *= corr;
#pragma unroll
    for (int u = 0; u < KEYS_PER_ITER; ++u) {
      const float pw = valid[u] ? expf(logit[u][g] - mn) : 0.0f;
      l[g] += pw;
      const float pv = pw * vs[u];
#pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] += pv * vr[u][e];
    }
    m[g] = mn;
  }
}

// Loads this lane's slice of query row ``t`` (heads h0 .. h0+GT-1), pre-scaled, and
// resets the online-softmax state (m = -inf, l = 0, acc = 0).
template <typename Q, int HEAD_DIM, int GT, int E>
__device__ __forceinline__ void init_row_state(
    const Q* __restrict__ q, int t, long long q_s0, long long q_s1, int h0, int lane,
    float scale, float (&qr)[GT][E], float (&acc)[GT][E], float (&m)[GT], float (&l)[GT]) {
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    m[g] = neg_inf();
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int d = lane + 32 * e;
      qr[g][e] = d < HEAD_DIM ? to_float(q[t * q_s0 + (h0 + g) * q_s1 + d]) * scale : 0.0f;
      acc[g][e] = 0.0f;
    }
  }
}

template <typename Q, typename KV, int KIND, int HEAD_DIM, int GT>
__global__ void __launch_bounds__(NUM_WARPS * 32) paged_attention(
    const Q* __restrict__ q, long long q_s0, long long q_s1,
    const KV* __restrict__ kv, long long kv_s0, long long kv_s1, long long kv_s2,
    long long kv_s3,
    const float* __restrict__ tsc, long long ts_s0, long long ts_s1, long long ts_s2,
    long long ts_s3,
    const float* __restrict__ fsc,  // [2, num_kv_heads] (fp8 only)
    const int* __restrict__ block_tables, long long bt_s0,
    const int* __restrict__ token_seq, const int* __restrict__ token_pos,
    Q* __restrict__ out,               // [num_tokens, num_q_heads, HEAD_DIM] contiguous
    float* __restrict__ part_out,      // [num_tokens, num_q_heads, num_splits, HEAD_DIM]
    float* __restrict__ part_lse,      // [num_tokens, num_q_heads, num_splits]
    int num_q_heads, int num_kv_heads, int block_size, float scale, int window,
    float soft_cap, int chunk, int num_splits) {
  constexpr int E = (HEAD_DIM + 31) / 32;
  const int t = blockIdx.x;
  const int h0 = blockIdx.y * GT;
  const int z = blockIdx.z;
  const int kh = h0 / (num_q_heads / num_kv_heads);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int s = token_seq[t];
  const int p = token_pos[t];
  const int lo = window > 0 ? max(0, p - window + 1) : 0;
  const int start = lo + z * chunk;
  const int end = min(p + 1, start + chunk);

  float qr[GT][E];
  float acc[GT][E];
  float m[GT];
  float l[GT];
  init_row_state<Q, HEAD_DIM, GT, E>(q, t, q_s0, q_s1, h0, lane, scale, qr, acc, m, l);
  const int* table = block_tables + s * bt_s0;

  for (int j0 = start + warp * KEYS_PER_ITER; j0 < end; j0 += NUM_WARPS * KEYS_PER_ITER) {
    attend_tile<KV, KIND, HEAD_DIM, GT, E>(j0, end, lane, table, block_size, kv, kv_s0, kv_s1,
                                           kv_s2, kv_s3, tsc, ts_s0, ts_s1, ts_s2, ts_s3, fsc,
                                           kh, num_kv_heads, soft_cap, qr, acc, m, l);
  }

  __shared__ float sm_m[NUM_WARPS][GT];
  __shared__ float sm_l[NUM_WARPS][GT];
  __shared__ float sm_acc[NUM_WARPS][GT][E * 32];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    if (lane == 0) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) sm_acc[warp][g][lane + 32 * e] = acc[g][e];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < GT * HEAD_DIM; idx += NUM_WARPS * 32) {
    const int g = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    float big = neg_inf();
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) big = fmaxf(big, sm_m[w][g]);
    float total = 0.0f;
    float val = 0.0f;
    if (big > neg_inf()) {
#pragma unroll
      for (int w = 0; w < NUM_WARPS; ++w) {
        if (sm_m[w][g] > neg_inf()) {
          const float f = expf(sm_m[w][g] - big);
          total += sm_l[w][g] * f;
          val += sm_acc[w][g][d] * f;
        }
      }
    }
    const long long hrow = static_cast<long long>(t) * num_q_heads + h0 + g;
    if (num_splits == 1) {
      out[hrow * HEAD_DIM + d] = from_float<Q>(val / total);
    } else {
      part_out[(hrow * num_splits + z) * HEAD_DIM + d] = total > 0.0f ? val / total : 0.0f;
      if (d == 0) part_lse[hrow * num_splits + z] = total > 0.0f ? big + logf(total) : neg_inf();
    }
  }
}

// Varlen prefill, one warp per (query row, group of GT heads): NUM_WARPS consecutive rows
// per block (usually neighbouring positions of one sequence, so their K/V reads hit L1),
// each warp walking all of its row's keys; no cross-warp merge, no KV split. Same
// parameters as paged_attention (chunk and the split buffers unused) plus num_tokens.
template <typename Q, typename KV, int KIND, int HEAD_DIM, int GT>
__global__ void __launch_bounds__(NUM_WARPS * 32) paged_attention_rows(
    const Q* __restrict__ q, long long q_s0, long long q_s1,
    const KV* __restrict__ kv, long long kv_s0, long long kv_s1, long long kv_s2,
    long long kv_s3,
    const float* __restrict__ tsc, long long ts_s0, long long ts_s1, long long ts_s2,
    long long ts_s3,
    const float* __restrict__ fsc,
    const int* __restrict__ block_tables, long long bt_s0,
    const int* __restrict__ token_seq, const int* __restrict__ token_pos,
    Q* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_lse,
    int num_q_heads, int num_kv_heads, int block_size, float scale, int window,
    float soft_cap, int chunk, int num_splits, int num_tokens) {
  constexpr int E = (HEAD_DIM + 31) / 32;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int t = blockIdx.x * NUM_WARPS + warp;
  if (t >= num_tokens) return;  // warp-uniform; no block-wide barrier follows
  const int h0 = blockIdx.y * GT;
  const int kh = h0 / (num_q_heads / num_kv_heads);
  const int s = token_seq[t];
  const int p = token_pos[t];
  const int start = window > 0 ? max(0, p - window + 1) : 0;
  const int end = p + 1;

  float qr[GT][E];
  float acc[GT][E];
  float m[GT];
  float l[GT];
  init_row_state<Q, HEAD_DIM, GT, E>(q, t, q_s0, q_s1, h0, lane, scale, qr, acc, m, l);
  const int* table = block_tables + s * bt_s0;
  for (int j0 = start; j0 < end; j0 += KEYS_PER_ITER) {
    attend_tile<KV, KIND, HEAD_DIM, GT, E>(j0, end, lane, table, block_size, kv, kv_s0, kv_s1,
                                           kv_s2, kv_s3, tsc, ts_s0, ts_s1, ts_s2, ts_s3, fsc,
                                           kh, num_kv_heads, soft_cap, qr, acc, m, l);
  }
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    const long long hrow = static_cast<long long>(t) * num_q_heads + h0 + g;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int d = lane + 32 * e;
      if (d < HEAD_DIM) out[hrow * HEAD_DIM + d] = from_float<Q>(acc[g][e] / l[g]);
    }
  }
}

// out[row, d] = sum_z w_z part_out[row, z, d] / sum_z w_z, w_z = exp(lse_z - max lse).
// Grid (num_tokens * num_q_heads,), block >= head_dim threads (strided if fewer).
template <typename Q>
__global__ void split_reduce(const float* __restrict__ part_out,
                             const float* __restrict__ part_lse, Q* __restrict__ out,
                             int num_splits, int head_dim) {
  const long long r = blockIdx.x;
  float big = neg_inf();
  for (int z = 0; z < num_splits; ++z) big = fmaxf(big, part_lse[r * num_splits + z]);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float num = 0.0f;
    float den = 0.0f;
    for (int z = 0; z < num_splits; ++z) {
      const float lse = part_lse[r * num_splits + z];
      if (lse > neg_inf()) {
        const float w = expf(lse - big);
        num += w * part_out[(r * num_splits + z) * head_dim + d];
        den += w;
      }
    }
    out[r * head_dim + d] = from_float<Q>(num / den);
  }
}

}  // namespace kvpage
