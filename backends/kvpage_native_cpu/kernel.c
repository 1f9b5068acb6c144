/* kvpage native-cpu backend: paged attention on the CPU, compiled at first use by the
 * system C compiler (see build.py) and called through ctypes.
 *
 * One function, kvp_paged_attention, serves decode, prefill, chunked prefill and
 * prefix-cache hits. It walks each unit's block table and reads K/V in place from the
 * paged cache kv[2, num_blocks, block_size, num_kv_heads, head_dim] (the one layout of
 * kvpage.attention.metadata.kv_cache_shape). A unit (sequence, query rows r0..r1-1, KV
 * heads h0..h1-1) keeps a streaming softmax per (row, query head) (FlashAttention, Dao
 * et al. 2022), one block of keys at a time:
 *
 *     s_j = scale * q . k_j            (soft cap: cap * tanh(s_j / cap))
 *     m'  = max(m, max_j s_j);  a = exp(m - m')
 *     l   = a * l + sum_j exp(s_j - m');  acc = a * acc + sum_j exp(s_j - m') v_j
 *     out = acc / l
 *
 * Vectorization is explicit (GCC/Clang vector extensions: 16, 8 or 4 float lanes, which
 * the compiler maps to AVX-512, AVX2, SSE or NEON registers), so no reassociation flag
 * is needed: every sum has an order fixed by this source and the head_dim, and a unit's
 * result does not depend on the batch, the other units or the thread that runs it.
 * exp of the probabilities is a vectorized Cody-Waite range reduction with the Cephes
 * single-precision polynomial (relative error ~2 ulp; exactly 0 below -87.3, which
 * covers the -inf of masked lanes); the rescale factor a uses libm's expf.
 *
 * Storage kinds: float32 read in place; bfloat16 bits widened by << 16 (exact); int8
 * codes times the float32 token scale; fp8 bits through a 256-entry float32 value table
 * times the per-head K/V scale. Non-float32 storage is converted block by block into a
 * small float32 tile first.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KVP_ABI 1

enum { KIND_FLOAT = 0, KIND_BF16 = 1, KIND_INT8 = 2, KIND_FP8 = 3 };

typedef float vf16 __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef int32_t vi16 __attribute__((vector_size(64)));

typedef struct {
    const float *q;          /* [num_tokens, num_q_heads, head_dim] */
    const void *kv;          /* [2, num_blocks, block_size, num_kv_heads, head_dim] */
    const float *tsc;        /* int8: [2, num_blocks, block_size, num_kv_heads] */
    const float *fsc;        /* fp8: [2, num_kv_heads] */
    const float *lut;        /* fp8: [256] */
    const void *block_tables;/* [num_seqs, bt_stride] int32 or int64 */
    const int64_t *query_start; /* [num_seqs + 1] */
    const int64_t *seq_lens; /* [num_seqs] */
    const int64_t *units;    /* [num_units, 5] (seq, r0, r1, h0, h1) */
    float *out;              /* [num_tokens, num_q_heads, head_dim] */
    int64_t u0, u1;          /* units u0 .. u1-1 */
    int64_t bt_stride, bt_int64;
    int64_t kind, num_q_heads, num_kv_heads, head_dim, num_blocks, block_size, window;
    float scale, soft_cap;
} kvp_args;

int kvp_abi_version(void) { return KVP_ABI; }

/* ---- vector helpers (unaligned loads/stores through memcpy) ---------------------- */
static inline vf16 ld16(const float *p) { vf16 v; memcpy(&v, p, sizeof v); return v; }
static inline vf8 ld8(const float *p) { vf8 v; memcpy(&v, p, sizeof v); return v; }
static inline vf4 ld4(const float *p) { vf4 v; memcpy(&v, p, sizeof v); return v; }
static inline void st16(float *p, vf16 v) { memcpy(p, &v, sizeof v); }
static inline void st8(float *p, vf8 v) { memcpy(p, &v, sizeof v); }
static inline void st4(float *p, vf4 v) { memcpy(p, &v, sizeof v); }

static inline float hsum4(vf4 v) { return (v[0] + v[2]) + (v[1] + v[3]); }
static inline float hsum8(vf8 v) {
    vf4 a, b;
    memcpy(&a, &v, sizeof a);
    memcpy(&b, (const char *)&v + sizeof a, sizeof b);
    return hsum4(a + b);
}
static inline float hsum16(vf16 v) {
    vf8 a, b;
    memcpy(&a, &v, sizeof a);
    memcpy(&b, (const char *)&v + sizeof a, sizeof b);
    return hsum8(a + b);
}
static inline float hmax16(vf16 v) {
    float m = v[0];
    for (int i = 1; i < 16; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* q . k over d floats; the lane width follows d (constant after inlining) */
static inline __attribute__((always_inline)) float dot(const float *restrict a,
                                                       const float *restrict b, int64_t d) {
    if (d % 16 == 0) {
        vf16 s = ld16(a) * ld16(b);
        for (int64_t x = 16; x < d; x += 16) s += ld16(a + x) * ld16(b + x);
        return hsum16(s);
    }
    if (d % 8 == 0) {
        vf8 s = ld8(a) * ld8(b);
        for (int64_t x = 8; x < d; x += 8) s += ld8(a + x) * ld8(b + x);
        return hsum8(s);
    }
    if (d % 4 == 0) {
        vf4 s = ld4(a) * ld4(b);
        for (int64_t x = 4; x < d; x += 4) s += ld4(a + x) * ld4(b + x);
        return hsum4(s);
    }
    float s = 0.0f;
    for (int64_t x = 0; x < d; x++) s += a[x] * b[x];
    return s;
}

/* acc[x] = acc[x] * alpha (the running output's rescale) */
static inline __attribute__((always_inline)) void scale_row(float *restrict acc, float alpha,
                                                            int64_t d) {
    for (int64_t x = 0; x < d; x++) acc[x] *= alpha;
}

/* acc[x] += p * v[x] */
static inline __attribute__((always_inline)) void axpy(float *restrict acc, float p,
                                                       const float *restrict v, int64_t d) {
    if (d % 16 == 0) {
        for (int64_t x = 0; x < d; x += 16) st16(acc + x, ld16(acc + x) + p * ld16(v + x));
    } else if (d % 8 == 0) {
        for (int64_t x = 0; x < d; x += 8) st8(acc + x, ld8(acc + x) + p * ld8(v + x));
    } else if (d % 4 == 0) {
        for (int64_t x = 0; x < d; x += 4) st4(acc + x, ld4(acc + x) + p * ld4(v + x));
    } else {
        for (int64_t x = 0; x < d; x++) acc[x] += p * v[x];
    }
}

/* exp(x) for 16 lanes with x <= 0 (or -inf): Cody-Waite reduction x = n ln2 + r and the
 * Cephes expf polynomial; lanes below -87.33 (exp < FLT_MIN) give exactly 0. */
static inline vf16 vexp16(vf16 x) {
    const vf16 lo = (vf16){0} - 87.3365447f;
    vi16 under = x < lo;
    vf16 xc = x;
    vi16 xb, lb;
    memcpy(&xb, &xc, sizeof xb);
    memcpy(&lb, &lo, sizeof lb);
    xb = (xb & ~under) | (lb & under);
    memcpy(&xc, &xb, sizeof xc);
    const vf16 magic = (vf16){0} + 12582912.0f; /* 1.5 * 2^23: round to nearest */
    vf16 t = xc * 1.44269504088896341f + magic;
    vf16 fn = t - magic;
    vf16 r = xc - fn * 0.693359375f;
    r = r - fn * -2.12194440e-4f;
    vf16 z = r * r;
    vf16 y = 1.9875691500E-4f * r + 1.3981999507E-3f;
    y = y * r + 8.3334519073E-3f;
    y = y * r + 4.1665795894E-2f;
    y = y * r + 1.6666665459E-1f;
    y = y * r + 5.0000001201E-1f;
    y = y * z + r + 1.0f;
    /* t = magic + n exactly (ulp 1 near 1.5 * 2^23): its low bits are n */
    vi16 tb;
    memcpy(&tb, &t, sizeof tb);
    vi16 pw = (tb - 0x4B400000 + 127) << 23;
    vf16 p2;
    memcpy(&p2, &pw, sizeof p2);
    y = y * p2;
    vi16 yb;
    memcpy(&yb, &y, sizeof yb);
    yb &= ~under;
    memcpy(&y, &yb, sizeof y);
    return y;
}

/* K (tile rows 0..bs-1) and V (rows bs..2bs-1) of keys j0..j1-1 of block blk, KV head
 * h, as float32 rows of d in tile */
static void convert(const kvp_args *a, int64_t blk, int64_t j0, int64_t j1, int64_t h,
                    float *restrict tile) {
    const int64_t bs = a->block_size, hkv = a->num_kv_heads, d = a->head_dim;
    for (int64_t c = 0; c < 2; c++) {
        const int64_t plane = (c * a->num_blocks + blk) * bs;
        for (int64_t j = j0; j < j1; j++) {
            const int64_t src = (plane + j) * hkv * d + h * d;
            float *restrict dst = tile + (c * bs + j) * d;
            if (a->kind == KIND_BF16) {
                const uint16_t *restrict s = (const uint16_t *)a->kv + src;
                uint32_t *restrict o = (uint32_t *)dst;
                for (int64_t x = 0; x < d; x++) o[x] = (uint32_t)s[x] << 16;
            } else if (a->kind == KIND_INT8) {
                const int8_t *restrict s = (const int8_t *)a->kv + src;
                const float sc = a->tsc[(plane + j) * hkv + h];
                for (int64_t x = 0; x < d; x++) dst[x] = (float)s[x] * sc;
            } else {
                const uint8_t *restrict s = (const uint8_t *)a->kv + src;
                const float sc = a->fsc[c * hkv + h];
                for (int64_t x = 0; x < d; x++) dst[x] = a->lut[s[x]] * sc;
            }
        }
    }
}

static inline int64_t block_id(const kvp_args *a, int64_t seq, int64_t b) {
    if (a->bt_int64) return ((const int64_t *)a->block_tables)[seq * a->bt_stride + b];
    return ((const int32_t *)a->block_tables)[seq * a->bt_stride + b];
}

static inline int64_t max64(int64_t x, int64_t y) { return x > y ? x : y; }
static inline int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }

/* the units u0..u1-1 with head_dim d (a constant in the specialized copies) */
static inline __attribute__((always_inline)) int run(const kvp_args *a, const int64_t d) {
    const int64_t nq = a->num_q_heads, hkv = a->num_kv_heads, bs = a->block_size;
    const int64_t nb = a->num_blocks, group = nq / hkv;
    const int64_t sp = (bs + 15) / 16 * 16; /* score row padded to whole vectors */
    int64_t max_states = 1;
    for (int64_t u = a->u0; u < a->u1; u++) {
        const int64_t *un = a->units + 5 * u;
        max_states = max64(max_states, (un[2] - un[1]) * (un[4] - un[3]) * group);
    }
    float *mem = malloc(sizeof(float) * (size_t)(2 * max_states + max_states * d + sp +
                                                 (a->kind == KIND_FLOAT ? 0 : 2 * bs * d)));
    if (!mem) return -1;
    float *restrict m = mem, *restrict l_sum = m + max_states, *restrict acc = l_sum + max_states;
    float *restrict s = acc + max_states * d, *restrict tile = s + sp;
    const float *kvf = (const float *)a->kv;
    for (int64_t u = a->u0; u < a->u1; u++) {
        const int64_t *un = a->units + 5 * u;
        const int64_t seq = un[0], r0 = un[1], nr = un[2] - un[1], h0 = un[3];
        const int64_t nh = un[4] - h0;
        const int64_t qs = a->query_start[seq];
        const int64_t ctx = a->seq_lens[seq] - (a->query_start[seq + 1] - qs);
        const int64_t nst = nr * nh * group;
        for (int64_t i = 0; i < nst; i++) { m[i] = -INFINITY; l_sum[i] = 0.0f; }
        memset(acc, 0, sizeof(float) * (size_t)(nst * d));
        const int64_t last = ctx + r0 + nr - 1; /* last key any row of the unit sees */
        const int64_t first = a->window > 0 ? max64(0, ctx + r0 - a->window + 1) : 0;
        for (int64_t b = first / bs; b <= last / bs; b++) {
            const int64_t kp0 = b * bs;
            const int64_t j0 = max64(first - kp0, 0), j1 = min64(last + 1 - kp0, bs);
            const int64_t blk = block_id(a, seq, b);
            for (int64_t hh = 0; hh < nh; hh++) {
                const int64_t h = h0 + hh;
                const float *kb, *vb;
                int64_t stride;
                if (a->kind == KIND_FLOAT) {
                    kb = kvf + (blk * bs) * hkv * d + h * d;
                    vb = kvf + ((nb + blk) * bs) * hkv * d + h * d;
                    stride = hkv * d;
                } else {
                    convert(a, blk, j0, j1, h, tile);
                    kb = tile;
                    vb = tile + bs * d;
                    stride = d;
                }
                for (int64_t r = 0; r < nr; r++) {
                    const int64_t pos = ctx + r0 + r;
                    const int64_t lo = a->window > 0 ? pos - a->window + 1 - kp0 : 0;
                    const int64_t a0 = max64(j0, lo), a1 = min64(j1, pos + 1 - kp0);
                    if (a1 <= a0) continue;
                    const int64_t c0 = a0 / 16 * 16, c1 = (a1 + 15) / 16 * 16;
                    const int64_t qrow = qs + r0 + r;
                    for (int64_t g = 0; g < group; g++) {
                        const float *restrict qv = a->q + (qrow * nq + h * group + g) * d;
                        const int64_t st = (r * nh + hh) * group + g;
                        for (int64_t j = c0; j < a0; j++) s[j] = -INFINITY;
                        for (int64_t j = a0; j < a1; j++) {
                            float v = dot(qv, kb + j * stride, d) * a->scale;
                            if (a->soft_cap > 0.0f) v = a->soft_cap * tanhf(v / a->soft_cap);
                            s[j] = v;
                        }
                        for (int64_t j = a1; j < c1; j++) s[j] = -INFINITY;
                        vf16 mv = (vf16){0} - INFINITY;
                        for (int64_t j = c0; j < c1; j += 16) {
                            vf16 v = ld16(s + j);
                            vi16 gt = v > mv;
                            vi16 vb_, mb;
                            memcpy(&vb_, &v, sizeof vb_);
                            memcpy(&mb, &mv, sizeof mb);
                            mb = (vb_ & gt) | (mb & ~gt);
                            memcpy(&mv, &mb, sizeof mv);
                        }
                        const float mold = m[st];
                        float mx = hmax16(mv);
                        if (!(mx > mold)) mx = mold;
                        const float alpha = expf(mold - mx);
                        m[st] = mx;
                        vf16 ps = (vf16){0};
                        for (int64_t j = c0; j < c1; j += 16) {
                            vf16 p = vexp16(ld16(s + j) - mx);
                            ps += p;
                            st16(s + j, p);
                        }
                        l_sum[st] = l_sum[st] * alpha + hsum16(ps);
                        float *restrict ab = acc + st * d;
                        if (alpha != 1.0f) scale_row(ab, alpha, d);
                        for (int64_t j = a0; j < a1; j++) axpy(ab, s[j], vb + j * stride, d);
                    }
                }
            }
        }
        for (int64_t r = 0; r < nr; r++) {
            const int64_t qrow = qs + r0 + r;
            for (int64_t hh = 0; hh < nh; hh++) {
                for (int64_t g = 0; g < group; g++) {
                    const int64_t st = (r * nh + hh) * group + g;
                    const float inv = 1.0f / l_sum[st];
                    float *restrict o = a->out + (qrow * nq + (h0 + hh) * group + g) * d;
                    for (int64_t x = 0; x < d; x++) o[x] = acc[st * d + x] * inv;
                }
            }
        }
    }
    free(mem);
    return 0;
}

/* Attention of units a->u0 .. a->u1-1 into a->out (nothing else is written).
 * Returns 0, or -1 when the scratch memory could not be allocated. */
int kvp_paged_attention(const kvp_args *a) {
    switch (a->head_dim) {
    case 8: return run(a, 8);
    case 16: return run(a, 16);
    case 32: return run(a, 32);
    case 64: return run(a, 64);
    case 128: return run(a, 128);
    case 256: return run(a, 256);
    default: return run(a, a->head_dim);
    }
}
