/* kvpage native-cpu backend: paged attention on the CPU, compiled at first use by the
 * system C compiler (see build.py) and called through ctypes.
 *
 * One function, kvp_paged_attention, serves decode, prefill, chunked prefill and
 * prefix-cache hits. It walks each unit's block table and reads K/V in place from the
 * paged cache kv[2, num_blocks, block_size, num_kv_heads, head_dim] (the one layout of
 * kvpage.attention.metadata.kv_cache_shape). A unit (sequence, query rows r0..r1-1, KV
 * heads h0..h1-1) keeps a streaming softmax per (row, query head) (FlashAttention, Dao
 * et al. 2022), one step of keys at a time (a block, or consecutive small blocks up to
 * CHUNK_KEYS keys):
 *
 *     s_j = scale * q . k_j            (soft cap: cap * tanh(s_j / cap))
 *     m'  = max(m, max_j s_j);  a = exp(m - m')
 *     l   = a * l + sum_j exp(s_j - m');  acc = a * acc + sum_j exp(s_j - m') v_j
 *     out = acc / l
 *
 * Attention sinks (gpt-oss: sinks[h], one logit per query head that joins the
 * denominator only) are added when the unit is finished:
 *     out = acc / (l + exp(sink - m))     (rescaled by exp(m - sink) when sink > m)
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
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KVP_ABI 7

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
    const float *sinks;      /* [num_q_heads] sink logits, or NULL (none) */
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

/* acc = alpha * acc + sum_j p[j] * v[j * stride] over n keys. For head_dim <= 128 in
 * whole vectors the row lives in registers for the whole block, in two accumulators
 * (even and odd keys, added at the end) so that consecutive keys do not wait on each
 * other's multiply-add. */
#define PV_BODY(VT, W, LD, ST)                                                          \
    do {                                                                                \
        enum { MAXV = 128 / (W) };                                                      \
        const int64_t nv = d / (W);                                                     \
        VT o[MAXV], e[MAXV];                                                            \
        for (int64_t i = 0; i < nv; i++) { o[i] = LD(acc + (W) * i) * alpha; e[i] = o[i] * 0.0f; } \
        int64_t j = 0;                                                                  \
        for (; j + 1 < n; j += 2) {                                                     \
            const float *restrict v0 = v + j * stride, *restrict v1 = v0 + stride;      \
            const float p0 = p[j], p1 = p[j + 1];                                       \
            for (int64_t i = 0; i < nv; i++) {                                          \
                o[i] += p0 * LD(v0 + (W) * i);                                          \
                e[i] += p1 * LD(v1 + (W) * i);                                          \
            }                                                                           \
        }                                                                               \
        if (j < n)                                                                      \
            for (int64_t i = 0; i < nv; i++) o[i] += p[j] * LD(v + j * stride + (W) * i); \
        for (int64_t i = 0; i < nv; i++) ST(acc + (W) * i, o[i] + e[i]);                \
    } while (0)

static inline __attribute__((always_inline)) void pv(float *restrict acc, float alpha,
                                                     const float *restrict p,
                                                     const float *restrict v, int64_t stride,
                                                     int64_t n, int64_t d) {
    if (d % 16 == 0 && d <= 128) {
        PV_BODY(vf16, 16, ld16, st16);
    } else if (d % 8 == 0 && d <= 128) {
        PV_BODY(vf8, 8, ld8, st8);
    } else if (d % 4 == 0 && d <= 128) {
        PV_BODY(vf4, 4, ld4, st4);
    } else {
        for (int64_t x = 0; x < d; x++) acc[x] *= alpha;
        for (int64_t j = 0; j < n; j++)
            for (int64_t x = 0; x < d; x++) acc[x] += p[j] * v[j * stride + x];
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

/* K (tile rows 0..bs-1) and V (rows bs..2bs-1) of keys j0..j1-1 of block blk, KV
 * heads h0..h1-1, as float32 rows of (h1 - h0) * d in tile */
static void convert(const kvp_args *a, int64_t blk, int64_t j0, int64_t j1, int64_t h0,
                    int64_t h1, float *restrict tile) {
    const int64_t bs = a->block_size, hkv = a->num_kv_heads, d = a->head_dim, nh = h1 - h0;
    for (int64_t c = 0; c < 2; c++) {
        const int64_t plane = (c * a->num_blocks + blk) * bs;
        for (int64_t j = j0; j < j1; j++)
        for (int64_t h = h0; h < h1; h++) {
            const int64_t src = (plane + j) * hkv * d + h * d;
            float *restrict dst = tile + ((c * bs + j) * nh + h - h0) * d;
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

static const int64_t ELEM_SIZE[4] = {4, 2, 1, 1};

static inline int64_t max64(int64_t x, int64_t y) { return x > y ? x : y; }
static inline int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }

/* keys per softmax step: consecutive blocks of a sequence are taken together up to this
 * many keys (one block when blocks are larger), so that small blocks do not pay the
 * per-step bookkeeping (max, rescale, accumulator load/store) every few keys */
#define CHUNK_KEYS 64

/* the units u0..u1-1 with head_dim d (a constant in the specialized copies) */
static inline __attribute__((always_inline)) int run(const kvp_args *a, const int64_t d) {
    const int64_t nq = a->num_q_heads, hkv = a->num_kv_heads, bs = a->block_size;
    const int64_t nb = a->num_blocks, group = nq / hkv;
    const int64_t per = bs >= CHUNK_KEYS ? 1 : CHUNK_KEYS / bs; /* blocks per step */
    const int64_t sp = (per * bs + 15) / 16 * 16; /* score row padded to whole vectors */
    const int64_t es = ELEM_SIZE[a->kind];
    int64_t max_states = 1;
    for (int64_t u = a->u0; u < a->u1; u++) {
        const int64_t *un = a->units + 5 * u;
        max_states = max64(max_states, (un[2] - un[1]) * (un[4] - un[3]) * group);
    }
    const int64_t nsc = hkv * group * sp; /* scores of every head of a unit */
    const int64_t ntile = a->kind == KIND_FLOAT ? 0 : per * 2 * bs * hkv * d;
    float *mem = malloc(sizeof(float) * (size_t)(2 * max_states + max_states * d + nsc + ntile));
    if (!mem) return -1;
    float *restrict m = mem, *restrict l_sum = m + max_states, *restrict acc = l_sum + max_states;
    float *restrict s = acc + max_states * d, *restrict tile = s + nsc;
    const float *kvf = (const float *)a->kv;
    /* per block of a step: first key, key range, K/V rows and the next block's K */
    int64_t kp0[CHUNK_KEYS], j0[CHUNK_KEYS], j1[CHUNK_KEYS], a0[CHUNK_KEYS], a1[CHUNK_KEYS];
    const float *kb[CHUNK_KEYS], *vb[CHUNK_KEYS];
    const char *nk[CHUNK_KEYS];
    for (int64_t u = a->u0; u < a->u1; u++) {
        const int64_t *un = a->units + 5 * u;
        const int64_t seq = un[0], r0 = un[1], nr = un[2] - un[1], h0 = un[3];
        const int64_t nh = un[4] - h0, ns = nh * group;
        const int64_t qs = a->query_start[seq];
        const int64_t ctx = a->seq_lens[seq] - (a->query_start[seq + 1] - qs);
        for (int64_t i = 0; i < nr * ns; i++) { m[i] = -INFINITY; l_sum[i] = 0.0f; }
        memset(acc, 0, sizeof(float) * (size_t)(nr * ns * d));
        const int64_t last = ctx + r0 + nr - 1; /* last key any row of the unit sees */
        const int64_t first = a->window > 0 ? max64(0, ctx + r0 - a->window + 1) : 0;
        const int64_t blast = last / bs;
        const int64_t stride = a->kind == KIND_FLOAT ? hkv * d : nh * d;
        const int64_t nk_row = hkv * d * es, nk_len = nh * d * es;
        for (int64_t b = first / bs; b <= blast; b += per) {
            const int64_t cnt = min64(per, blast - b + 1);
            for (int64_t k = 0; k < cnt; k++) {
                kp0[k] = (b + k) * bs;
                j0[k] = max64(first - kp0[k], 0);
                j1[k] = min64(last + 1 - kp0[k], bs);
                const int64_t blk = block_id(a, seq, b + k);
                if (a->kind == KIND_FLOAT) {
                    kb[k] = kvf + (blk * bs) * hkv * d + h0 * d;
                    vb[k] = kvf + ((nb + blk) * bs) * hkv * d + h0 * d;
                } else {
                    float *t = tile + k * 2 * bs * nh * d;
                    convert(a, blk, j0[k], j1[k], h0, h0 + nh, t);
                    kb[k] = t;
                    vb[k] = t + bs * nh * d;
                }
                /* the block read after this one (this unit's or the next unit's first) */
                int64_t nblk = -1, nh0 = h0;
                if (b + k < blast) {
                    nblk = block_id(a, seq, b + k + 1);
                } else if (u + 1 < a->u1) {
                    const int64_t *nx = un + 5;
                    const int64_t nqs = a->query_start[nx[0]];
                    const int64_t nctx = a->seq_lens[nx[0]] - (a->query_start[nx[0] + 1] - nqs);
                    const int64_t nfirst =
                        a->window > 0 ? max64(0, nctx + nx[1] - a->window + 1) : 0;
                    nblk = block_id(a, nx[0], nfirst / bs);
                    nh0 = nx[3];
                }
                nk[k] = nblk >= 0 ? (const char *)a->kv + ((nblk * bs) * hkv + nh0) * d * es
                                  : NULL;
            }
            const int64_t len = (cnt * bs + 15) / 16 * 16;
            for (int64_t r = 0; r < nr; r++) {
                const int64_t pos = ctx + r0 + r;
                int any = 0;
                for (int64_t k = 0; k < cnt; k++) {
                    const int64_t lo = a->window > 0 ? pos - a->window + 1 - kp0[k] : 0;
                    a0[k] = max64(j0[k], lo);
                    a1[k] = min64(j1[k], pos + 1 - kp0[k]);
                    any |= a1[k] > a0[k];
                }
                if (!any) continue;
                const float *restrict qr = a->q + ((qs + r0 + r) * nq + h0 * group) * d;
                for (int64_t i = 0; i < ns; i++)
                    for (int64_t j = 0; j < len; j++) s[i * sp + j] = -INFINITY;
                /* scores, key by key: K rows are read in memory order (all the unit's
                 * heads of a key are one contiguous run). Prefetches: the V row of the
                 * key (read by the pass below) and, on the first row, K row j of the
                 * block after — a block is a few KiB in its own place in memory, where
                 * the hardware prefetcher would start cold (measured: 1.6x less time
                 * per decode call than prefetching nothing or the whole next block at
                 * once, docs/benchmarks.md) */
                for (int64_t k = 0; k < cnt; k++) {
                    for (int64_t j = a0[k]; j < a1[k]; j++) {
                        const float *restrict krow = kb[k] + j * stride;
                        for (int64_t off = 0; off < nh * d; off += 16)
                            __builtin_prefetch(vb[k] + j * stride + off, 0, 3);
                        if (nk[k] != NULL && r == 0)
                            for (int64_t off = 0; off < nk_len; off += 64)
                                __builtin_prefetch(nk[k] + j * nk_row + off, 0, 3);
                        for (int64_t hh = 0, i = 0; hh < nh; hh++) {
                            for (int64_t g = 0; g < group; g++, i++) {
                                float v = dot(qr + i * d, krow + hh * d, d) * a->scale;
                                if (a->soft_cap > 0.0f)
                                    v = a->soft_cap * tanhf(v / a->soft_cap);
                                s[i * sp + k * bs + j] = v;
                            }
                        }
                    }
                }
                for (int64_t i = 0; i < ns; i++) {
                    float *restrict si = s + i * sp;
                    const int64_t st = r * ns + i;
                    vf16 mv = (vf16){0} - INFINITY;
                    for (int64_t j = 0; j < len; j += 16) {
                        vf16 v = ld16(si + j);
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
                    float alpha = mx == mold ? 1.0f : expf(mold - mx);
                    m[st] = mx;
                    vf16 ps = (vf16){0};
                    for (int64_t j = 0; j < len; j += 16) {
                        vf16 p = vexp16(ld16(si + j) - mx);
                        ps += p;
                        st16(si + j, p);
                    }
                    l_sum[st] = l_sum[st] * alpha + hsum16(ps);
                    const int64_t hh = i / group;
                    for (int64_t k = 0; k < cnt; k++) {
                        if (a1[k] <= a0[k]) continue;
                        pv(acc + st * d, alpha, si + k * bs + a0[k],
                           vb[k] + hh * d + a0[k] * stride, stride, a1[k] - a0[k], d);
                        alpha = 1.0f;
                    }
                }
            }
        }
        for (int64_t r = 0; r < nr; r++) {
            const int64_t qrow = qs + r0 + r;
            for (int64_t i = 0; i < ns; i++) {
                const int64_t st = r * ns + i;
                float inv;
                if (a->sinks != NULL) {
                    const float sk = a->sinks[h0 * group + i], mm = m[st];
                    if (sk > mm) { /* rescale to the sink: no overflow of exp */
                        const float e = expf(mm - sk);
                        inv = e / (l_sum[st] * e + 1.0f);
                    } else {
                        inv = 1.0f / (l_sum[st] + expf(sk - mm));
                    }
                } else {
                    inv = 1.0f / l_sum[st];
                }
                float *restrict o = a->out + (qrow * nq + h0 * group + i) * d;
                for (int64_t x = 0; x < d; x++) o[x] = acc[st * d + x] * inv;
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


/* ---- layer ops: the small float32 ops around attention -----------------------------
 * One C call each instead of several torch ops (LayerOps in kvpage.attention.protocol;
 * the torch formulas in kvpage.models are the reference and the fallback). Rows are
 * contiguous float32 [rows, n] unless a stride is given; results equal the torch ops
 * up to float32 summation order (tested). */

/* sum of x[0..n-1]^2 in 16 lanes, then the lanes in a fixed order */
static inline float sumsq(const float *restrict x, int64_t n) {
    vf16 s = (vf16){0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) { vf16 v = ld16(x + j); s += v * v; }
    float t = hsum16(s);
    for (; j < n; j++) t += x[j] * x[j];
    return t;
}

/* out = x / sqrt(mean(x^2) + eps) * w per row (Llama RMSNorm, Zhang & Sennrich 2019);
 * with res != NULL first x = x + res, written to sum_out, and the norm is of the sum
 * (the residual add before a norm, as vLLM's fused_add_rms_norm) */
void kvp_rms_norm(const float *x, const float *res, const float *w, float eps, int64_t rows,
                  int64_t n, float *sum_out, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n; /* the row, or its sum with res (written below) */
        float *restrict o = out + r * n;
        if (res != NULL) {
            const float *restrict rr = res + r * n;
            float *sr = sum_out + r * n;
            int64_t j = 0;
            for (; j + 16 <= n; j += 16) st16(sr + j, ld16(xr + j) + ld16(rr + j));
            for (; j < n; j++) sr[j] = xr[j] + rr[j];
            xr = sr;
        }
        const float inv = 1.0f / sqrtf(sumsq(xr, n) / (float)n + eps);
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) st16(o + j, ld16(xr + j) * inv * ld16(w + j));
        for (; j < n; j++) o[j] = xr[j] * inv * w[j];
    }
}

/* no fused multiply-add in the functions marked with it: their products and sums round
 * one by one, as the torch ops they replace do */
#if defined(__clang__)
/* clang's -ffp-contract=fast ignores "fp contract(off)" pragmas; an arithmetic fence
 * around each product keeps it from being fused into the sum */
#define NO_CONTRACT
#if __has_builtin(__arithmetic_fence)
#define FENCE(x) __arithmetic_fence(x)
#else
#define FENCE(x) (*(volatile float *)&(float){x})
#endif
#else
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#define FENCE(x) (x)
#endif

/* RoPE of the q and k columns of a fused q/k/v projection (rotate-half layout, RoFormer,
 * Su et al. 2021): q_out/k_out[t, h, :] = x * cos[t] + swap_halves(x) * sin_signed[t],
 * where x is head h of row t of qkv (row stride qkv_stride floats) and sin_signed has
 * its first half negated: the products and the sum of
 * kvpage.models.rope.apply_rope_qkv, each rounded as there (bit-identical, tested) */
NO_CONTRACT void kvp_rope_qk(const float *qkv, int64_t qkv_stride, const float *cos,
                             const float *sin, int64_t rows, int64_t nq, int64_t nkv,
                             int64_t d, float *q_out, float *k_out) {
    const int64_t half = d / 2;
    for (int64_t t = 0; t < rows; t++) {
        const float *restrict c = cos + t * d, *restrict s = sin + t * d;
        for (int64_t h = 0; h < nq + nkv; h++) {
            const float *restrict x = qkv + t * qkv_stride + h * d;
            float *restrict o = h < nq ? q_out + (t * nq + h) * d : k_out + (t * nkv + h - nq) * d;
            for (int64_t j = 0; j < half; j++) {
                const float a = x[j] * c[j], b = x[j + half] * s[j];
                o[j] = FENCE(a) + FENCE(b);
            }
            for (int64_t j = half; j < d; j++) {
                const float a = x[j] * c[j], b = x[j - half] * s[j];
                o[j] = FENCE(a) + FENCE(b);
            }
        }
    }
}

/* silu(g) * u for 16 lanes: g * sigmoid(g), sigmoid from e = exp(-|g|) (never
 * overflows): 1 / (1 + e) for g >= 0, e / (1 + e) below; exp as in the attention
 * kernel (vexp16) */
static inline vf16 silu_mul16(vf16 g, vf16 u) {
    vi16 bits;
    memcpy(&bits, &g, sizeof bits);
    const vi16 neg = bits < 0;
    const vi16 nb = bits | ((vi16){0} + INT32_MIN); /* -|g| */
    vf16 na;
    memcpy(&na, &nb, sizeof na);
    const vf16 e = vexp16(na), one = (vf16){0} + 1.0f;
    vi16 eb, ob;
    memcpy(&eb, &e, sizeof eb);
    memcpy(&ob, &one, sizeof ob);
    const vi16 numb = (eb & neg) | (ob & ~neg);
    vf16 num;
    memcpy(&num, &numb, sizeof num);
    return g * (num / (one + e)) * u;
}

/* out[t, j] = silu(gu[t, j]) * gu[t, i + j] for j < i (SwiGLU, Shazeer 2020); every
 * element by the same 16-lane code (a row's tail through a zero-padded copy) */
void kvp_silu_mul(const float *gu, int64_t rows, int64_t i, float *out) {
    for (int64_t t = 0; t < rows; t++) {
        const float *restrict g = gu + t * 2 * i, *restrict u = g + i;
        float *restrict o = out + t * i;
        int64_t j = 0;
        for (; j + 16 <= i; j += 16) st16(o + j, silu_mul16(ld16(g + j), ld16(u + j)));
        if (j < i) {
            float gt[16] = {0}, ut[16] = {0}, ot[16];
            memcpy(gt, g + j, sizeof(float) * (size_t)(i - j));
            memcpy(ut, u + j, sizeof(float) * (size_t)(i - j));
            st16(ot, silu_mul16(ld16(gt), ld16(ut)));
            memcpy(o + j, ot, sizeof(float) * (size_t)(i - j));
        }
    }
}

/* ---- layer ops in bfloat16: bf16 in and out, float32 inside ----------------------
 * The same ops on bfloat16 tensors (raw uint16 bits), each element widened to float32
 * (exact: bits << 16), computed in float32 and rounded back to bfloat16 wherever the
 * torch ops they replace round (every bf16 tensor op rounds its float32 result: the
 * LlamaRMSNorm of kvpage.models.layers / transformers rounds the normalised row before
 * the weight multiply, SiLU·mul rounds silu(g) before the product, RoPE rounds each
 * product and the sum), so no whole tensor is upcast in memory. Rounding is to nearest
 * even by integer arithmetic (c10::BFloat16's round_to_nearest_even; NaN -> 0x7FC0),
 * in 16-lane vectors: where the compiler targets AVX512-BF16 (-march=native on such a
 * CPU) by its vcvtneps2bf16, else by integer arithmetic in 32-bit lanes
 * (c10::BFloat16's round_to_nearest_even: add 0x7FFF + the lowest kept bit, truncate;
 * NaN -> 0x7FC0) that the compiler maps to AVX-512, AVX2, SSE or NEON. The two agree
 * except on float32 subnormals (|x| < 2^-126), which vcvtneps2bf16 treats as zero: a
 * result that small comes out as a signed zero instead of a bf16 subnormal (tested
 * with that tolerance). A product of two bf16 values is exact in float32, so the
 * weight multiply and RoPE's products round once, as torch's. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif
typedef uint16_t vu16 __attribute__((vector_size(32)));
typedef uint32_t vu32 __attribute__((vector_size(64)));

static inline float bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7FC0;
#if defined(__AVX512BF16__)
    if ((u & 0x7F800000u) == 0) return (uint16_t)((u >> 16) & 0x8000u); /* as the vector form */
#endif
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline vf16 ldbf16(const uint16_t *p) {
    vf16 f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    memcpy(&f, &u, sizeof f);
#else
    vu16 h;
    memcpy(&h, p, sizeof h);
    const vu32 u = __builtin_convertvector(h, vu32) << 16;
    memcpy(&f, &u, sizeof f);
#endif
    return f;
}
#if !defined(__AVX512BF16__)
static inline vu32 rbits(vf16 f) { /* f rounded to bf16, in the high half of each lane */
    vu32 u;
    memcpy(&u, &f, sizeof u);
    const vu32 nan = (vu32)(f != f);
    const vu32 r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    return (r & ~nan) | (nan & 0x7FC00000u);
}
#endif
static inline void stbf16(uint16_t *p, vf16 f) {
#if defined(__AVX512BF16__)
    __m512 x;
    memcpy(&x, &f, sizeof x);
    const __m256bh h = _mm512_cvtneps_pbh(x);
    memcpy(p, &h, sizeof h);
#else
    const vu16 h = __builtin_convertvector(rbits(f) >> 16, vu16);
    memcpy(p, &h, sizeof h);
#endif
}
static inline vf16 round16(vf16 f) { /* f rounded to bf16, as float32 */
    vf16 r;
#if defined(__AVX512BF16__)
    __m512 x;
    memcpy(&x, &f, sizeof x);
    const __m256bh h = _mm512_cvtneps_pbh(x);
    __m256i hi;
    memcpy(&hi, &h, sizeof hi);
    const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16);
    memcpy(&r, &u, sizeof r);
#else
    const vu32 u = rbits(f);
    memcpy(&r, &u, sizeof r);
#endif
    return r;
}

/* kvp_rms_norm on bf16: s = bf16(x + res) (written to sum_out) when res != NULL; then
 * out = bf16(w * bf16(s / sqrt(mean(s^2) + eps))), mean(s^2) in float32 */
void kvp_rms_norm_bf16(const uint16_t *x, const uint16_t *res, const uint16_t *w, float eps,
                       int64_t rows, int64_t n, uint16_t *sum_out, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * n;
        uint16_t *restrict o = out + r * n;
        vf16 acc = (vf16){0};
        float tail = 0.0f;
        int64_t j = 0;
        if (res != NULL) {
            const uint16_t *restrict rr = res + r * n;
            uint16_t *sr = sum_out + r * n;
            for (; j + 16 <= n; j += 16) {
                const vf16 v = round16(ldbf16(xr + j) + ldbf16(rr + j));
                stbf16(sr + j, v);
                acc += v * v;
            }
            for (; j < n; j++) {
                const float v = bf2f(f2bf(bf2f(xr[j]) + bf2f(rr[j])));
                sr[j] = f2bf(v);
                tail += v * v;
            }
            xr = sr;
        } else {
            for (; j + 16 <= n; j += 16) { const vf16 v = ldbf16(xr + j); acc += v * v; }
            for (; j < n; j++) { const float v = bf2f(xr[j]); tail += v * v; }
        }
        const float inv = 1.0f / sqrtf((hsum16(acc) + tail) / (float)n + eps);
        j = 0;
        for (; j + 16 <= n; j += 16)
            stbf16(o + j, round16(ldbf16(xr + j) * inv) * ldbf16(w + j));
        for (; j < n; j++) o[j] = f2bf(bf2f(f2bf(bf2f(xr[j]) * inv)) * bf2f(w[j]));
    }
}

/* kvp_rope_qk on bf16: o = bf16(bf16(x * cos) + bf16(swap_halves(x) * sin_signed)),
 * the roundings of kvpage.models.rope.apply_rope_qkv's bf16 tensor ops (bit-identical,
 * tested) */
void kvp_rope_qk_bf16(const uint16_t *qkv, int64_t qkv_stride, const uint16_t *cos,
                      const uint16_t *sin, int64_t rows, int64_t nq, int64_t nkv, int64_t d,
                      uint16_t *q_out, uint16_t *k_out) {
    const int64_t half = d / 2;
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *restrict c = cos + t * d, *restrict s = sin + t * d;
        for (int64_t h = 0; h < nq + nkv; h++) {
            const uint16_t *restrict x = qkv + t * qkv_stride + h * d;
            uint16_t *restrict o =
                h < nq ? q_out + (t * nq + h) * d : k_out + (t * nkv + h - nq) * d;
            int64_t j = 0;
            if (half % 16 == 0) {
                for (; j < half; j += 16) {
                    const vf16 lo = ldbf16(x + j), hi = ldbf16(x + j + half);
                    stbf16(o + j, round16(lo * ldbf16(c + j)) + round16(hi * ldbf16(s + j)));
                    stbf16(o + j + half, round16(hi * ldbf16(c + j + half)) +
                                             round16(lo * ldbf16(s + j + half)));
                }
                continue;
            }
            for (; j < d; j++) {
                const float a = bf2f(f2bf(bf2f(x[j]) * bf2f(c[j])));
                const float b = bf2f(f2bf(bf2f(x[j < half ? j + half : j - half]) * bf2f(s[j])));
                o[j] = f2bf(a + b);
            }
        }
    }
}

/* kvp_silu_mul on bf16: out = bf16(bf16(silu(g)) * u), silu as silu_mul16 */
void kvp_silu_mul_bf16(const uint16_t *gu, int64_t rows, int64_t i, uint16_t *out) {
    const vf16 one = (vf16){0} + 1.0f;
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *restrict g = gu + t * 2 * i, *restrict u = g + i;
        uint16_t *restrict o = out + t * i;
        int64_t j = 0;
        for (; j + 16 <= i; j += 16)
            stbf16(o + j, round16(silu_mul16(ldbf16(g + j), one)) * ldbf16(u + j));
        if (j < i) {
            uint16_t gt[16] = {0}, ut[16] = {0}, ot[16];
            memcpy(gt, g + j, sizeof(uint16_t) * (size_t)(i - j));
            memcpy(ut, u + j, sizeof(uint16_t) * (size_t)(i - j));
            stbf16(ot, round16(silu_mul16(ldbf16(gt), one)) * ldbf16(ut));
            memcpy(o + j, ot, sizeof(uint16_t) * (size_t)(i - j));
        }
    }
}

/* ---- greedy argmax of logits rows -------------------------------------------------
 * out[r] = the index of the first maximum of row r of x ([rows, n], row stride
 * row_stride elements, float32 when bf16 == 0 else bfloat16 bits): torch.argmax's /
 * max(dim=-1).indices' answer (the first NaN when the row has one; -0 equals +0; an
 * all -inf row gives 0). One pass in 16 lanes: each lane keeps its maximum and the
 * index where it first reached it (a strictly greater value moves it), NaN lanes are
 * flagged; then the smallest index among the lanes whose maximum equals the row's
 * (the first occurrence overall), or, with a NaN, a scan for the first NaN. */
static inline int64_t argmax_row(const float *f, const uint16_t *b, int64_t n) {
    vf16 m = (vf16){0} - INFINITY;
    vi16 at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, nan = (vi16){0};
    const vi16 iota = at;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const vf16 v = f != NULL ? ld16(f + j) : ldbf16(b + j);
        nan |= v != v;
        const vi16 gt = v > m;
        vi16 vb, mb;
        memcpy(&vb, &v, sizeof vb);
        memcpy(&mb, &m, sizeof mb);
        mb = (vb & gt) | (mb & ~gt);
        memcpy(&m, &mb, sizeof m);
        at = ((iota + (int32_t)j) & gt) | (at & ~gt);
    }
    int any_nan = 0;
    float best = -INFINITY;
    int64_t arg = 0;
    if (j > 0) {
        best = hmax16(m);
        arg = INT64_MAX;
        for (int l = 0; l < 16; l++) {
            any_nan |= nan[l] != 0;
            if (m[l] == best && at[l] < arg) arg = at[l];
        }
    }
    for (; j < n; j++) { /* the tail: later indices, so only a greater value moves */
        const float v = f != NULL ? f[j] : bf2f(b[j]);
        any_nan |= v != v;
        if (v > best) { best = v; arg = j; }
    }
    if (any_nan)
        for (j = 0; j < n; j++) {
            const float v = f != NULL ? f[j] : bf2f(b[j]);
            if (v != v) return j;
        }
    return arg;
}

void kvp_argmax_rows(const void *x, int64_t bf16, int64_t rows, int64_t n, int64_t row_stride,
                     int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        if (bf16)
            out[r] = argmax_row(NULL, (const uint16_t *)x + r * row_stride, n);
        else
            out[r] = argmax_row((const float *)x + r * row_stride, NULL, n);
    }
}

/* ---- parts on a pool of worker threads ------------------------------------------
 * kvp_paged_attention_parts runs parts[0] on the calling thread and parts[1..n-1] on
 * persistent worker threads (created at first use, grown, never shrunk), one C call per
 * layer instead of one Python thread hand-off per part. A worker spins for a few tens
 * of microseconds after its part (the next layer's call follows soon) and then sleeps
 * on a condition variable; the caller spins likewise, then sleeps, while it waits for
 * the workers. Spinning is bounded, so an oversubscribed machine costs at most the
 * spin, not a time slice per call (the failure of unbounded OpenMP spinning,
 * docs/benchmarks.md "Threads"). One caller at a time uses the pool; a second
 * concurrent caller runs all its parts itself (same results: a unit's result does not
 * depend on the thread that computes it). A forked child starts with no workers. */
#define POOL_MAX 64
/* pause loops (~20-140 cycles each, by CPU) before sleeping: a worker between layers
 * (the next call is a layer's non-attention work away), the caller waiting for parts */
#define WORKER_SPIN 200
#define CALLER_SPIN 4000

typedef struct {
    pthread_t th;
    _Atomic int64_t posted;   /* generation of the last part handed to this worker */
    _Atomic int64_t finished; /* generation of the last part it completed */
    const kvp_args *job;
    int result;
} kvp_worker;

static kvp_worker pool_w[POOL_MAX];
static int pool_n = 0;
static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER; /* one caller at a time */
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;   /* guards the sleeps */
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;   /* workers wait here */
static pthread_cond_t pool_done = PTHREAD_COND_INITIALIZER;   /* the caller waits here */
static int pool_caller_sleeps = 0;
static int pool_atfork = 0;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *pool_main(void *arg) {
    kvp_worker *w = arg;
    int64_t seen = 0;
    for (;;) {
        int64_t g = atomic_load_explicit(&w->posted, memory_order_acquire);
        for (int i = 0; g == seen && i < WORKER_SPIN; i++) {
            cpu_relax();
            g = atomic_load_explicit(&w->posted, memory_order_acquire);
        }
        if (g == seen) {
            pthread_mutex_lock(&pool_mu);
            while ((g = atomic_load_explicit(&w->posted, memory_order_acquire)) == seen)
                pthread_cond_wait(&pool_wake, &pool_mu);
            pthread_mutex_unlock(&pool_mu);
        }
        seen = g;
        w->result = kvp_paged_attention(w->job);
        pthread_mutex_lock(&pool_mu);
        atomic_store_explicit(&w->finished, g, memory_order_release);
        if (pool_caller_sleeps) pthread_cond_signal(&pool_done);
        pthread_mutex_unlock(&pool_mu);
    }
    return NULL;
}

static void pool_before_fork(void) {
    /* no call in flight and no sleep being entered while the process forks */
    pthread_mutex_lock(&pool_busy);
    pthread_mutex_lock(&pool_mu);
}

static void pool_after_fork_parent(void) {
    pthread_mutex_unlock(&pool_mu);
    pthread_mutex_unlock(&pool_busy);
}

static void pool_forget(void) {
    /* in a forked child only the forking thread exists: no workers, fresh locks */
    pool_n = 0;
    pool_caller_sleeps = 0;
    pthread_mutex_init(&pool_busy, NULL);
    pthread_mutex_init(&pool_mu, NULL);
    pthread_cond_init(&pool_wake, NULL);
    pthread_cond_init(&pool_done, NULL);
}

/* at least n workers; returns how many there are (fewer if a thread failed to start) */
static int pool_grow(int n) {
    if (!pool_atfork) {
        pthread_atfork(pool_before_fork, pool_after_fork_parent, pool_forget);
        pool_atfork = 1;
    }
    while (pool_n < n && pool_n < POOL_MAX) {
        kvp_worker *w = &pool_w[pool_n];
        atomic_store(&w->posted, 0);
        atomic_store(&w->finished, 0);
        if (pthread_create(&w->th, NULL, pool_main, w) != 0) break;
        pthread_detach(w->th);
        pool_n++;
    }
    return pool_n;
}

/* Attention of parts[0..n-1] (each a kvp_args with its own u0..u1): parts[0] here,
 * the others on the pool's workers. Returns 0, or -1 when some part could not
 * allocate its scratch memory. */
int kvp_paged_attention_parts(const kvp_args *parts, int64_t n) {
    if (n <= 0) return 0;
    if (n == 1 || pthread_mutex_trylock(&pool_busy) != 0) {
        int rc = 0;
        for (int64_t i = 0; i < n; i++) rc |= kvp_paged_attention(&parts[i]);
        return rc;
    }
    const int nw = pool_grow((int)(n - 1));
    int64_t gen[POOL_MAX];
    pthread_mutex_lock(&pool_mu);
    for (int i = 0; i < nw && i + 1 < n; i++) {
        kvp_worker *w = &pool_w[i];
        w->job = &parts[i + 1];
        gen[i] = atomic_load_explicit(&w->posted, memory_order_relaxed) + 1;
        atomic_store_explicit(&w->posted, gen[i], memory_order_release);
    }
    pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_mu);
    int rc = kvp_paged_attention(&parts[0]);
    for (int64_t i = nw + 1; i < n; i++) rc |= kvp_paged_attention(&parts[i]); /* no worker */
    for (int i = 0; i < nw && i + 1 < n; i++) {
        kvp_worker *w = &pool_w[i];
        int k = 0;
        while (atomic_load_explicit(&w->finished, memory_order_acquire) != gen[i] &&
               k++ < CALLER_SPIN)
            cpu_relax();
        if (atomic_load_explicit(&w->finished, memory_order_acquire) != gen[i]) {
            pthread_mutex_lock(&pool_mu);
            pool_caller_sleeps = 1;
            while (atomic_load_explicit(&w->finished, memory_order_acquire) != gen[i])
                pthread_cond_wait(&pool_done, &pool_mu);
            pool_caller_sleeps = 0;
            pthread_mutex_unlock(&pool_mu);
        }
        rc |= w->result;
    }
    pthread_mutex_unlock(&pool_busy);
    return rc;
}

/* kvp_paged_attention_parts of copies of parts[0..n-1] (a step's prepared arguments,
 * shared by the layers of a KV group) with this layer's q, kv, out and sinks (NULL =
 * none): one call per layer that sets four pointers instead of every field. parts is
 * not written. */
int kvp_paged_attention_layer(const kvp_args *parts, int64_t n, const float *q, const void *kv,
                              float *out, const float *sinks) {
    kvp_args loc[POOL_MAX + 1]; /* every part of one call at once (more run in turns) */
    int rc = 0;
    for (int64_t i0 = 0; i0 < n; i0 += POOL_MAX + 1) {
        const int64_t m = n - i0 < POOL_MAX + 1 ? n - i0 : POOL_MAX + 1;
        for (int64_t i = 0; i < m; i++) {
            loc[i] = parts[i0 + i];
            loc[i].q = q;
            loc[i].kv = kv;
            loc[i].out = out;
            loc[i].sinks = sinks;
        }
        rc |= kvp_paged_attention_parts(loc, m);
    }
    return rc;
}

/* Store n tokens' K and V rows (row_bytes each: num_kv_heads * head_dim values of the
 * cache's storage dtype, already converted) at their slots of kv: K of token t at
 * kv[0] slot slots[t], V at kv[1]; a slot of -1 is skipped. key/value rows are
 * key_stride/value_stride bytes apart (a row's own values contiguous). */
void kvp_write_kv(const char *key, int64_t key_stride, const char *value,
                  int64_t value_stride, const int64_t *slots, int64_t n, char *kv,
                  int64_t num_slots, int64_t row_bytes) {
    for (int64_t t = 0; t < n; t++) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        memcpy(kv + s * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(kv + (num_slots + s) * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
}
