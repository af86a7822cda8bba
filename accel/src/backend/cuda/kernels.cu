// Pagoda's CUDA kernels, compiled at run time by NVRTC (see cuda/module.rs).
//
// Written so that the same source can later be compiled by hipRTC: everything
// CUDA-specific (warp shuffles, f16 conversions, dp4a) sits in the
// portability section below, and the kernels use only its macros. No header
// is included, so NVRTC needs nothing but libnvrtc (and no toolkit).
//
// Conventions shared with the Rust side (cuda/mod.rs launches these):
// - activations are f32, row-major;
// - quantized weights are repacked at upload (cuda/weights.rs): all rows'
//   16-byte (Q4_0/Q4_1) or 32-byte (Q8_0) quant groups first, in GGUF's
//   order within a block, then from byte `scale_off` the f16 scales (Q4_1:
//   interleaved d, m pairs), one per 32-element block;
// - the KV cache follows ops::KvLayout: [num_blocks][n_kv][slab]; inside a
//   slab V is [block_size][head_dim] and K transposed [head_dim][block_size];
// - step metadata: `seq_meta` is [n_seqs][4] = (q_start, q_len, ctx_len,
//   table_start) into the flat `tables` array.

// ---------------------------------------------------------------------------
// Portability section.
// ---------------------------------------------------------------------------
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;

#if defined(__HIPCC_RTC__) || defined(__HIP_PLATFORM_AMD__)
// hipRTC: shuffles take a width (32 keeps wave64 hardware in 32-lane groups,
// which every kernel here assumes), f16 is the _Float16 builtin, and the
// 4-way int8 dot product is the sdot4 builtin.
#define PG_SHFL_XOR_F(v, m) __shfl_xor((v), (m), 32)
#define PG_SHFL_XOR_I(v, m) __shfl_xor((v), (m), 32)
__device__ __forceinline__ float pg_h2f(u16 h) {
    _Float16 f = __builtin_bit_cast(_Float16, h);
    return (float)f;
}
__device__ __forceinline__ u16 pg_f2h(float x) {
    return __builtin_bit_cast(u16, (_Float16)x);
}
__device__ __forceinline__ i32 pg_dp4a(i32 a, i32 b, i32 c) {
    return __builtin_amdgcn_sdot4(a, b, c, false);
}
#else
#define PG_SHFL_XOR_F(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#define PG_SHFL_XOR_I(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
__device__ __forceinline__ float pg_h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 pg_f2h(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
__device__ __forceinline__ i32 pg_dp4a(i32 a, i32 b, i32 c) {
    i32 r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
#endif

// bf16 is the top half of an f32 on every target: plain bit operations.
__device__ __forceinline__ float pg_bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ u16 pg_f2bf(float x) {
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((u >> 16) | 0x40u);  // NaN stays a (quiet) NaN
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even, like half::bf16
    return (u16)(u >> 16);
}

#define PG_NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ float pg_warp_sum(float v) {
    for (int m = 16; m > 0; m >>= 1) v += PG_SHFL_XOR_F(v, m);
    return v;
}
__device__ __forceinline__ float pg_warp_max(float v) {
    for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, PG_SHFL_XOR_F(v, m));
    return v;
}
__device__ __forceinline__ i32 pg_warp_sum_i(i32 v) {
    for (int m = 16; m > 0; m >>= 1) v += PG_SHFL_XOR_I(v, m);
    return v;
}

// ---------------------------------------------------------------------------
// Weight types (the codes match cuda/weights.rs `WeightKind::code`).
// ---------------------------------------------------------------------------
#define PG_W_F32 0
#define PG_W_F16 1
#define PG_W_BF16 2
#define PG_W_Q4_0 3
#define PG_W_Q4_1 4
#define PG_W_Q8_0 5

// Element `j` of row `r` of a weight in its device layout, as f32.
__device__ __forceinline__ float pg_weight_at(int ty, const u8* w, u64 scale_off, u32 nb,
                                              u32 cols, u32 r, u32 j) {
    u64 blk = (u64)r * nb + j / 32;
    u32 e = j % 32;
    switch (ty) {
    case PG_W_F32:
        return ((const float*)w)[(u64)r * cols + j];
    case PG_W_F16:
        return pg_h2f(((const u16*)w)[(u64)r * cols + j]);
    case PG_W_BF16:
        return pg_bf2f(((const u16*)w)[(u64)r * cols + j]);
    case PG_W_Q4_0: {
        u8 b = w[blk * 16 + (e % 16)];
        int q = e < 16 ? (b & 15) : (b >> 4);
        float d = pg_h2f(((const u16*)(w + scale_off))[blk]);
        return (float)(q - 8) * d;
    }
    case PG_W_Q4_1: {
        u8 b = w[blk * 16 + (e % 16)];
        int q = e < 16 ? (b & 15) : (b >> 4);
        const u16* dm = (const u16*)(w + scale_off) + 2 * blk;
        return (float)q * pg_h2f(dm[0]) + pg_h2f(dm[1]);
    }
    case PG_W_Q8_0: {
        int q = ((const i8*)w)[blk * 32 + e];
        return (float)q * pg_h2f(((const u16*)(w + scale_off))[blk]);
    }
    default:
        return 0.0f;
    }
}

// out[t] = row tokens[t] of the table. One thread block per token.
extern "C" __global__ void pg_embed(int ty, const u8* w, u64 scale_off, u32 nb, u32 cols,
                                    const u32* tokens, u32 n_tokens, float* out) {
    u32 t = blockIdx.x;
    if (t >= n_tokens) return;
    u32 r = tokens[t];
    for (u32 j = threadIdx.x; j < cols; j += blockDim.x) {
        out[(u64)t * cols + j] = pg_weight_at(ty, w, scale_off, nb, cols, r, j);
    }
}

// ---------------------------------------------------------------------------
// Quantized matmul: activations to int8 per 32-block, then dp4a.
// ---------------------------------------------------------------------------

// Quantizes x ([rows][k], k a multiple of 32, so block `g` of the whole
// buffer is elements 32g..32g+32) to int8 codes with one f32 scale per block:
// xd[g] = (d, sum of the block's codes), the sum serving the Q4_0 offset and
// the Q4_1 minimum. One warp per block; rounding half away from zero, like
// the CPU's quantizer.
extern "C" __global__ void pg_quantize_x(const float* x, u64 n_blocks, i8* xq, float2* xd) {
    u64 g = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    u32 lane = threadIdx.x % 32;
    if (g >= n_blocks) return;  // whole warps exit together: n_blocks is per warp
    float v = x[g * 32 + lane];
    float amax = pg_warp_max(fabsf(v));
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    int q = (int)roundf(v * id);
    q = max(-127, min(127, q));
    xq[g * 32 + lane] = (i8)q;
    int s = pg_warp_sum_i(q);
    if (lane == 0) xd[g] = make_float2(d, (float)s);
}

// Rows of activations one mmvq thread block handles (each weight read is
// reused this many times).
#define PG_MMVQ_COLS 8
// Warps (= output features) per mmvq thread block.
#define PG_MMVQ_WARPS 4

__device__ __forceinline__ u32 pg_ld32(const u8* p) { return *(const u32*)p; }

// Integer dot product of one 32-weight block with 32 activation codes.
template <int TY>
__device__ __forceinline__ i32 pg_block_dot(const u8* wq, const i8* xq) {
    const int4* xv = (const int4*)xq;
    int4 x0 = xv[0], x1 = xv[1];
    i32 xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    i32 acc = 0;
    if (TY == PG_W_Q8_0) {
        const int4* wv = (const int4*)wq;
        int4 w0 = wv[0], w1 = wv[1];
        i32 ws[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
        for (int k = 0; k < 8; k++) acc = pg_dp4a(ws[k], xs[k], acc);
    } else {
        // Byte j of the block holds weight j (low nibble) and j + 16 (high).
        int4 wv = *(const int4*)wq;
        i32 ws[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            acc = pg_dp4a(ws[k] & 0x0f0f0f0f, xs[k], acc);
            acc = pg_dp4a((ws[k] >> 4) & 0x0f0f0f0f, xs[4 + k], acc);
        }
    }
    return acc;
}

// out[r][n] = sum_k x[r][k] w[n][k] for quantized w. One warp per output
// feature n, PG_MMVQ_COLS activation rows per thread block (grid.y walks
// the rows, so many rows loop over the weight again). Lane l takes blocks
// l, l + 32, …: a warp reads 32 consecutive blocks' quants in one sweep.
template <int TY>
__device__ void pg_mmvq(const u8* w, u64 scale_off, u32 n, u32 nb, const i8* xq,
                        const float2* xd, u32 m, float* out) {
    u32 lane = threadIdx.x % 32;
    u32 feat = blockIdx.x * PG_MMVQ_WARPS + threadIdx.x / 32;
    u32 r0 = blockIdx.y * PG_MMVQ_COLS;
    if (feat >= n) return;
    u32 nr = min((u32)PG_MMVQ_COLS, m - r0);
    const u32 qb = TY == PG_W_Q8_0 ? 32 : 16;
    float acc[PG_MMVQ_COLS];
#pragma unroll
    for (int c = 0; c < PG_MMVQ_COLS; c++) acc[c] = 0.0f;
    for (u32 b = lane; b < nb; b += 32) {
        u64 wb = (u64)feat * nb + b;
        const u8* wq = w + wb * qb;
        float dw, mw = 0.0f;
        if (TY == PG_W_Q4_1) {
            u32 dm = pg_ld32(w + scale_off + 4 * wb);
            dw = pg_h2f((u16)(dm & 0xffff));
            mw = pg_h2f((u16)(dm >> 16));
        } else {
            dw = pg_h2f(((const u16*)(w + scale_off))[wb]);
        }
#pragma unroll
        for (int c = 0; c < PG_MMVQ_COLS; c++) {
            if ((u32)c < nr) {
                u64 xb = (u64)(r0 + c) * nb + b;
                i32 dot = pg_block_dot<TY>(wq, xq + xb * 32);
                float2 ds = xd[xb];
                if (TY == PG_W_Q4_0) {
                    acc[c] += dw * ds.x * (float)(dot - 8 * (i32)ds.y);
                } else if (TY == PG_W_Q4_1) {
                    acc[c] += dw * ds.x * (float)dot + mw * ds.x * ds.y;
                } else {
                    acc[c] += dw * ds.x * (float)dot;
                }
            }
        }
    }
#pragma unroll
    for (int c = 0; c < PG_MMVQ_COLS; c++) {
        float s = pg_warp_sum(acc[c]);
        if (lane == 0 && (u32)c < nr) out[(u64)(r0 + c) * n + feat] = s;
    }
}

extern "C" __global__ void pg_mmvq_q4_0(const u8* w, u64 scale_off, u32 n, u32 nb, const i8* xq,
                                        const float2* xd, u32 m, float* out) {
    pg_mmvq<PG_W_Q4_0>(w, scale_off, n, nb, xq, xd, m, out);
}
extern "C" __global__ void pg_mmvq_q4_1(const u8* w, u64 scale_off, u32 n, u32 nb, const i8* xq,
                                        const float2* xd, u32 m, float* out) {
    pg_mmvq<PG_W_Q4_1>(w, scale_off, n, nb, xq, xd, m, out);
}
extern "C" __global__ void pg_mmvq_q8_0(const u8* w, u64 scale_off, u32 n, u32 nb, const i8* xq,
                                        const float2* xd, u32 m, float* out) {
    pg_mmvq<PG_W_Q8_0>(w, scale_off, n, nb, xq, xd, m, out);
}

// The tiled kernel for many rows: a thread block computes a 64 × 64 tile of
// out (64 activation rows × 64 features), streaming K in chunks of
// PG_MMQ_KB blocks through shared memory, so each weight block is read once
// per 64 rows instead of once per PG_MMVQ_COLS. Q4 nibbles are unpacked to
// one int8 per weight on the way in, so the inner loop is the same dp4a
// sweep for every type. 256 threads; thread (ty, tx) owns rows ty + 16i and
// features tx + 16j (i, j < 4).
#define PG_MMQ_TILE 64
#define PG_MMQ_KB 4
#define PG_MMQ_THREADS 256
// Words per tile row in shared memory: 8 per block, plus one of padding so
// the 16 features a warp reads sit on distinct banks.
#define PG_MMQ_STRIDE (PG_MMQ_KB * 8 + 1)

template <int TY>
__device__ void pg_mmq(const u8* w, u64 scale_off, u32 n, u32 nb, const i8* xq,
                       const float2* xd, u32 m, float* out) {
    __shared__ i32 x_s[PG_MMQ_TILE * PG_MMQ_STRIDE];
    __shared__ i32 w_s[PG_MMQ_TILE * PG_MMQ_STRIDE];
    __shared__ float2 xd_s[PG_MMQ_TILE * PG_MMQ_KB];
    __shared__ float2 wd_s[PG_MMQ_TILE * PG_MMQ_KB];
    const u32 tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const u32 f0 = blockIdx.x * PG_MMQ_TILE, r0 = blockIdx.y * PG_MMQ_TILE;
    const i32* xw = (const i32*)xq;
    const i32* ww = (const i32*)w;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;

    for (u32 b0 = 0; b0 < nb; b0 += PG_MMQ_KB) {
        // Activation codes: row `row`, word `c` of its PG_MMQ_KB blocks.
        for (u32 idx = tid; idx < PG_MMQ_TILE * PG_MMQ_KB * 8; idx += PG_MMQ_THREADS) {
            u32 row = idx / (PG_MMQ_KB * 8), c = idx % (PG_MMQ_KB * 8);
            u32 b = b0 + c / 8;
            i32 v = 0;
            if (r0 + row < m && b < nb) v = xw[((u64)(r0 + row) * nb + b) * 8 + c % 8];
            x_s[row * PG_MMQ_STRIDE + c] = v;
        }
        // Weight codes as one signed byte per weight.
        if (TY == PG_W_Q8_0) {
            for (u32 idx = tid; idx < PG_MMQ_TILE * PG_MMQ_KB * 8; idx += PG_MMQ_THREADS) {
                u32 f = idx / (PG_MMQ_KB * 8), c = idx % (PG_MMQ_KB * 8);
                u32 b = b0 + c / 8;
                i32 v = 0;
                if (f0 + f < n && b < nb) v = ww[((u64)(f0 + f) * nb + b) * 8 + c % 8];
                w_s[f * PG_MMQ_STRIDE + c] = v;
            }
        } else {
            for (u32 idx = tid; idx < PG_MMQ_TILE * PG_MMQ_KB * 4; idx += PG_MMQ_THREADS) {
                u32 f = idx / (PG_MMQ_KB * 4), rem = idx % (PG_MMQ_KB * 4);
                u32 blk = rem / 4, k = rem % 4;
                i32 v = 0;
                if (f0 + f < n && b0 + blk < nb) v = ww[((u64)(f0 + f) * nb + b0 + blk) * 4 + k];
                w_s[f * PG_MMQ_STRIDE + blk * 8 + k] = v & 0x0f0f0f0f;
                w_s[f * PG_MMQ_STRIDE + blk * 8 + 4 + k] = (v >> 4) & 0x0f0f0f0f;
            }
        }
        for (u32 idx = tid; idx < PG_MMQ_TILE * PG_MMQ_KB; idx += PG_MMQ_THREADS) {
            u32 t = idx / PG_MMQ_KB, blk = idx % PG_MMQ_KB;
            u32 b = b0 + blk;
            float2 xs = make_float2(0.0f, 0.0f), ws = make_float2(0.0f, 0.0f);
            if (r0 + t < m && b < nb) xs = xd[(u64)(r0 + t) * nb + b];
            if (f0 + t < n && b < nb) {
                u64 wb = (u64)(f0 + t) * nb + b;
                if (TY == PG_W_Q4_1) {
                    u32 dm = pg_ld32(w + scale_off + 4 * wb);
                    ws = make_float2(pg_h2f((u16)(dm & 0xffff)), pg_h2f((u16)(dm >> 16)));
                } else {
                    ws = make_float2(pg_h2f(((const u16*)(w + scale_off))[wb]), 0.0f);
                }
            }
            xd_s[t * PG_MMQ_KB + blk] = xs;
            wd_s[t * PG_MMQ_KB + blk] = ws;
        }
        __syncthreads();
        for (u32 blk = 0; blk < PG_MMQ_KB && b0 + blk < nb; blk++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const u32 r = ty + 16 * i;
                const i32* xr = x_s + r * PG_MMQ_STRIDE + blk * 8;
                float2 xs = xd_s[r * PG_MMQ_KB + blk];
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const u32 f = tx + 16 * j;
                    const i32* wr = w_s + f * PG_MMQ_STRIDE + blk * 8;
                    i32 dot = 0;
#pragma unroll
                    for (int c = 0; c < 8; c++) dot = pg_dp4a(wr[c], xr[c], dot);
                    float2 ws = wd_s[f * PG_MMQ_KB + blk];
                    if (TY == PG_W_Q4_0) {
                        acc[i][j] += ws.x * xs.x * (float)(dot - 8 * (i32)xs.y);
                    } else if (TY == PG_W_Q4_1) {
                        acc[i][j] += ws.x * xs.x * (float)dot + ws.y * xs.x * xs.y;
                    } else {
                        acc[i][j] += ws.x * xs.x * (float)dot;
                    }
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 r = r0 + ty + 16 * i;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            u32 f = f0 + tx + 16 * j;
            if (r < m && f < n) out[(u64)r * n + f] = acc[i][j];
        }
    }
}

extern "C" __global__ void pg_mmq_q4_0(const u8* w, u64 scale_off, u32 n, u32 nb, const i8* xq,
                                       const float2* xd, u32 m, float* out) {
    pg_mmq<PG_W_Q4_0>(w, scale_off, n, nb, xq, xd, m, out);
}
extern "C" __global__ void pg_mmq_q4_1(const u8* w, u64 scale_off, u32 n, u32 nb, const i8* xq,
                                       const float2* xd, u32 m, float* out) {
    pg_mmq<PG_W_Q4_1>(w, scale_off, n, nb, xq, xd, m, out);
}
extern "C" __global__ void pg_mmq_q8_0(const u8* w, u64 scale_off, u32 n, u32 nb, const i8* xq,
                                       const float2* xd, u32 m, float* out) {
    pg_mmq<PG_W_Q8_0>(w, scale_off, n, nb, xq, xd, m, out);
}

// Dense matmuls run on cuBLAS with 16-bit inputs: activations are rounded
// to the weight's type first.
extern "C" __global__ void pg_f32_to_f16(const float* x, u64 n, u16* out) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = pg_f2h(x[i]);
}
extern "C" __global__ void pg_f32_to_bf16(const float* x, u64 n, u16* out) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = pg_f2bf(x[i]);
}

// ---------------------------------------------------------------------------
// Element-wise and row operations.
// ---------------------------------------------------------------------------

// RMSNorm of each row: one thread block (a multiple of 32 threads, at most
// 1024) per row.
extern "C" __global__ void pg_rms_norm(const float* x, const float* weight, float eps, u32 d,
                                       float* out) {
    __shared__ float partial[32];
    const float* xr = x + (u64)blockIdx.x * d;
    float* orow = out + (u64)blockIdx.x * d;
    float ss = 0.0f;
    for (u32 j = threadIdx.x; j < d; j += blockDim.x) ss += xr[j] * xr[j];
    ss = pg_warp_sum(ss);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f;
        v = pg_warp_sum(v);
        if (threadIdx.x == 0) partial[0] = v;
    }
    __syncthreads();
    float inv = 1.0f / sqrtf(partial[0] / (float)d + eps);
    for (u32 j = threadIdx.x; j < d; j += blockDim.x) orow[j] = xr[j] * inv * weight[j];
}

extern "C" __global__ void pg_add(float* x, const float* y, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

extern "C" __global__ void pg_add_bias(float* x, const float* bias, u64 n, u32 d) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += bias[i % d];
}

extern "C" __global__ void pg_copy_columns(const float* src, u32 src_width, u32 src_col,
                                           float* dst, u32 dst_width, u32 dst_col, u32 width,
                                           u32 m) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)m * width) return;
    u64 r = i / width, c = i % width;
    dst[r * dst_width + dst_col + c] = src[r * src_width + src_col + c];
}

extern "C" __global__ void pg_silu_mul(const float* gate_up, u32 m, u32 ffn, float* out) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)m * ffn) return;
    u64 r = i / ffn, j = i % ffn;
    float g = gate_up[r * 2 * ffn + j];
    float u = gate_up[r * 2 * ffn + ffn + j];
    out[i] = g / (1.0f + expf(-g)) * u;
}

// Rotates every head of every token by its position, from the uploaded
// [max_positions][head_dim / 2] tables. One thread per rotated pair.
extern "C" __global__ void pg_rope(float* x, const float* cos_t, const float* sin_t,
                                   const u32* positions, u32 n_tokens, u32 n_heads, u32 head_dim,
                                   int neox) {
    u32 half = head_dim / 2;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)n_tokens * n_heads * half) return;
    u32 p = (u32)(i % half);
    u64 th = i / half;  // token * n_heads + head
    u64 t = th / n_heads;
    u64 pos = positions[t];
    float c = cos_t[pos * half + p], s = sin_t[pos * half + p];
    float* head = x + th * head_dim;
    u32 ia = neox ? p : 2 * p;
    u32 ib = neox ? p + half : 2 * p + 1;
    float x0 = head[ia], x1 = head[ib];
    head[ia] = x0 * c - x1 * s;
    head[ib] = x0 * s + x1 * c;
}

extern "C" __global__ void pg_gather_rows(const float* x, u32 d, const u32* rows, u32 n,
                                          float* out) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)n * d) return;
    u64 r = i / d, c = i % d;
    out[i] = x[(u64)rows[r] * d + c];
}

// ---------------------------------------------------------------------------
// KV cache element types.
// ---------------------------------------------------------------------------
struct KvF32 {
    typedef float T;
    static __device__ __forceinline__ float load(const T* p, u64 i) { return p[i]; }
    static __device__ __forceinline__ void store(T* p, u64 i, float v) { p[i] = v; }
};
struct KvF16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(const T* p, u64 i) { return pg_h2f(p[i]); }
    static __device__ __forceinline__ void store(T* p, u64 i, float v) { p[i] = pg_f2h(v); }
};
struct KvBf16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(const T* p, u64 i) { return pg_bf2f(p[i]); }
    static __device__ __forceinline__ void store(T* p, u64 i, float v) { p[i] = pg_f2bf(v); }
};

// Writes each token's K and V rows at its slot. One thread per element.
template <typename KV>
__device__ void pg_write_kv(const float* k, const float* v, const u32* slots, u32 n_tokens,
                            u32 n_kv, u32 head_dim, u32 block_size, u64 n_slots,
                            typename KV::T* kc, typename KV::T* vc) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 row = (u64)n_kv * head_dim;
    if (i >= n_tokens * row) return;
    u64 t = i / row;
    u32 h = (u32)((i % row) / head_dim), e = (u32)(i % head_dim);
    u64 slot = slots[t];
    if (slot >= n_slots) return;  // the host checked the step's slots already
    u64 blk = slot / block_size, off = slot % block_size;
    u64 slab = blk * n_kv + h;
    KV::store(kc, (slab * head_dim + e) * block_size + off, k[i]);
    KV::store(vc, (slab * block_size + off) * head_dim + e, v[i]);
}

#define PG_WRITE_KV(NAME, KV)                                                                   \
    extern "C" __global__ void NAME(const float* k, const float* v, const u32* slots,           \
                                    u32 n_tokens, u32 n_kv, u32 head_dim, u32 block_size,       \
                                    u64 n_slots, KV::T* kc, KV::T* vc) {                        \
        pg_write_kv<KV>(k, v, slots, n_tokens, n_kv, head_dim, block_size, n_slots, kc, vc);    \
    }
PG_WRITE_KV(pg_write_kv_f32, KvF32)
PG_WRITE_KV(pg_write_kv_f16, KvF16)
PG_WRITE_KV(pg_write_kv_bf16, KvBf16)

// ---------------------------------------------------------------------------
// Paged attention.
//
// One thread block per (x, kv head, sequence). Its rows are (query, q head of
// the group) pairs, so every K/V element read from the cache (into shared
// memory, widened to f32) serves all q heads of the group. The cache is
// streamed in tiles of PG_ATT_TILE positions with an online softmax per row.
//
// - decode (q_len == 1): x is a split of the context (split-KV flash
//   decoding); each split writes its unnormalized accumulator and (max, sum)
//   when there are several, and pg_attn_merge combines them;
// - prefill (q_len > 1): x is a tile of `nq` queries, which reads positions
//   0..=its last query's position, masking causally per row.
// ---------------------------------------------------------------------------
#define PG_ATT_THREADS 128
#define PG_ATT_TILE 16
// Accumulator registers per thread: rows × head_dim <= 128 × 32 = 4096.
#define PG_ATT_ACC 32

template <typename KV>
__device__ void pg_attention(const float* q, float* out, const typename KV::T* kc,
                             const typename KV::T* vc, const u32* seq_meta, const u32* tables,
                             u32 n_heads, u32 n_kv, u32 head_dim, u32 block_size, float scale,
                             u32 nq, u32 split_len, u32 n_splits, int decode, float* part_o,
                             float* part_ml) {
    extern __shared__ float smem[];
    const u32 D = head_dim, G = n_heads / n_kv;
    const u32 x = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
    const u32 q_start = seq_meta[4 * s], q_len = seq_meta[4 * s + 1];
    const u32 ctx = seq_meta[4 * s + 2], tstart = seq_meta[4 * s + 3];
    if (q_len == 0 || (decode != 0) != (q_len == 1)) return;

    u32 q_first, n_rows_q, kv_start, kv_end;
    if (decode) {
        q_first = 0;
        n_rows_q = 1;
        kv_start = x * split_len;
        if (kv_start >= ctx) return;
        kv_end = min(ctx, kv_start + split_len);
    } else {
        q_first = x * nq;
        if (q_first >= q_len) return;
        n_rows_q = min(nq, q_len - q_first);
        kv_start = 0;
        kv_end = ctx - q_len + q_first + n_rows_q;  // last query's position + 1
    }
    const u32 R = n_rows_q * G, RD = R * D;
    const u32 RMAX = nq * G;
    float* q_s = smem;                               // [RMAX][D], pre-scaled
    float* kv_s = q_s + RMAX * D;                    // [TILE][D + 1]
    float* s_s = kv_s + PG_ATT_TILE * (D + 1);       // [RMAX][TILE]
    float* m_s = s_s + RMAX * PG_ATT_TILE;           // [RMAX]
    float* l_s = m_s + RMAX;                         // [RMAX]
    float* a_s = l_s + RMAX;                         // [RMAX]
    const u32 tid = threadIdx.x;
    const u64 q_row = (u64)n_heads * D;
    const u64 p0 = ctx - q_len + q_first;  // position of the tile's first query

    for (u32 e = tid; e < RD; e += PG_ATT_THREADS) {
        u32 r = e / D, i = e % D;
        u32 qi = r / G, g = r % G;
        q_s[e] = q[(u64)(q_start + q_first + qi) * q_row + (u64)(h * G + g) * D + i] * scale;
    }
    for (u32 r = tid; r < R; r += PG_ATT_THREADS) {
        m_s[r] = PG_NEG_INF;
        l_s[r] = 0.0f;
    }
    float acc[PG_ATT_ACC];
#pragma unroll
    for (int k = 0; k < PG_ATT_ACC; k++) acc[k] = 0.0f;
    __syncthreads();

    const u32* table = tables + tstart;
    for (u32 t0 = kv_start; t0 < kv_end; t0 += PG_ATT_TILE) {
        // K tile, transposed in the cache: consecutive threads take
        // consecutive positions of one dimension (contiguous in a block).
        for (u32 idx = tid; idx < PG_ATT_TILE * D; idx += PG_ATT_THREADS) {
            u32 j = idx % PG_ATT_TILE, i = idx / PG_ATT_TILE;
            u32 p = t0 + j;
            float val = 0.0f;
            if (p < kv_end) {
                u64 slab = (u64)table[p / block_size] * n_kv + h;
                val = KV::load(kc, (slab * D + i) * block_size + p % block_size);
            }
            kv_s[j * (D + 1) + i] = val;
        }
        __syncthreads();
        // Scores; a row's masked positions get -inf.
        for (u32 pr = tid; pr < R * PG_ATT_TILE; pr += PG_ATT_THREADS) {
            u32 r = pr / PG_ATT_TILE, j = pr % PG_ATT_TILE;
            u32 p = t0 + j;
            u64 qpos = p0 + r / G;
            float sc = PG_NEG_INF;
            if (p < kv_end && p <= qpos) {
                const float* qr = q_s + r * D;
                const float* kr = kv_s + j * (D + 1);
                float dot = 0.0f;
                for (u32 i = 0; i < D; i++) dot = fmaf(qr[i], kr[i], dot);
                sc = dot;
            }
            s_s[r * PG_ATT_TILE + j] = sc;
        }
        __syncthreads();
        // Online softmax, one warp per row; meanwhile the V tile replaces
        // the K tile (the scores no longer need it).
        for (u32 r = tid / 32; r < R; r += PG_ATT_THREADS / 32) {
            u32 lane = tid % 32;
            float sc = lane < PG_ATT_TILE ? s_s[r * PG_ATT_TILE + lane] : PG_NEG_INF;
            float m_old = m_s[r];
            float m_new = fmaxf(m_old, pg_warp_max(sc));
            float alpha = m_old == PG_NEG_INF ? 0.0f : expf(m_old - m_new);
            float pr = sc == PG_NEG_INF ? 0.0f : expf(sc - m_new);
            if (lane < PG_ATT_TILE) s_s[r * PG_ATT_TILE + lane] = pr;
            float sum = pg_warp_sum(pr);
            if (lane == 0) {
                l_s[r] = l_s[r] * alpha + sum;
                m_s[r] = m_new;
                a_s[r] = alpha;
            }
        }
        for (u32 idx = tid; idx < PG_ATT_TILE * D; idx += PG_ATT_THREADS) {
            u32 j = idx / D, i = idx % D;
            u32 p = t0 + j;
            float val = 0.0f;
            if (p < kv_end) {
                u64 slab = (u64)table[p / block_size] * n_kv + h;
                val = KV::load(vc, (slab * block_size + p % block_size) * D + i);
            }
            kv_s[j * (D + 1) + i] = val;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < PG_ATT_ACC; k++) {
            u32 e = tid + PG_ATT_THREADS * k;
            if (e < RD) {
                u32 r = e / D, i = e % D;
                float a = acc[k] * a_s[r];
                const float* pr = s_s + r * PG_ATT_TILE;
                for (u32 j = 0; j < PG_ATT_TILE; j++) a = fmaf(pr[j], kv_s[j * (D + 1) + i], a);
                acc[k] = a;
            }
        }
        __syncthreads();
    }

    const bool direct = !decode || n_splits == 1;
#pragma unroll
    for (int k = 0; k < PG_ATT_ACC; k++) {
        u32 e = tid + PG_ATT_THREADS * k;
        if (e < RD) {
            u32 r = e / D, i = e % D;
            u32 qi = r / G, g = r % G;
            if (direct) {
                float l = l_s[r];
                out[(u64)(q_start + q_first + qi) * q_row + (u64)(h * G + g) * D + i] =
                    l > 0.0f ? acc[k] / l : 0.0f;
            } else {
                u64 part = ((u64)s * n_kv + h) * n_splits + x;
                part_o[(part * G + g) * D + i] = acc[k];
            }
        }
    }
    if (!direct) {
        for (u32 g = tid; g < G; g += PG_ATT_THREADS) {
            u64 part = ((u64)s * n_kv + h) * n_splits + x;
            part_ml[2 * (part * G + g)] = m_s[g];
            part_ml[2 * (part * G + g) + 1] = l_s[g];
        }
    }
}

#define PG_ATTENTION(NAME, KV)                                                                  \
    extern "C" __global__ void NAME(const float* q, float* out, const KV::T* kc,                \
                                    const KV::T* vc, const u32* seq_meta, const u32* tables,    \
                                    u32 n_heads, u32 n_kv, u32 head_dim, u32 block_size,        \
                                    float scale, u32 nq, u32 split_len, u32 n_splits,           \
                                    int decode, float* part_o, float* part_ml) {                \
        pg_attention<KV>(q, out, kc, vc, seq_meta, tables, n_heads, n_kv, head_dim,             \
                         block_size, scale, nq, split_len, n_splits, decode, part_o, part_ml);  \
    }
PG_ATTENTION(pg_attention_f32, KvF32)
PG_ATTENTION(pg_attention_f16, KvF16)
PG_ATTENTION(pg_attention_bf16, KvBf16)

// Combines the splits of each decode row: grid (n_heads, n_seqs), head_dim
// threads. Splits past a sequence's context were never run and are skipped.
extern "C" __global__ void pg_attn_merge(const float* part_o, const float* part_ml,
                                         const u32* seq_meta, u32 n_heads, u32 n_kv,
                                         u32 head_dim, u32 split_len, u32 n_splits, float* out) {
    const u32 hq = blockIdx.x, s = blockIdx.y, i = threadIdx.x;
    const u32 q_start = seq_meta[4 * s], q_len = seq_meta[4 * s + 1], ctx = seq_meta[4 * s + 2];
    if (q_len != 1 || i >= head_dim) return;
    const u32 G = n_heads / n_kv, h = hq / G, g = hq % G;
    const u32 used = min(n_splits, (ctx + split_len - 1) / split_len);
    const u64 base = ((u64)s * n_kv + h) * n_splits;
    float m = PG_NEG_INF;
    for (u32 x = 0; x < used; x++) m = fmaxf(m, part_ml[2 * ((base + x) * G + g)]);
    float l = 0.0f, o = 0.0f;
    for (u32 x = 0; x < used; x++) {
        u64 pg = (base + x) * G + g;
        float mx = part_ml[2 * pg];
        float w = mx == PG_NEG_INF ? 0.0f : expf(mx - m);
        l += part_ml[2 * pg + 1] * w;
        o += part_o[pg * head_dim + i] * w;
    }
    out[(u64)q_start * n_heads * head_dim + (u64)hq * head_dim + i] = l > 0.0f ? o / l : 0.0f;
}

// ---------------------------------------------------------------------------
// Sampling (Backend::sample; ops::sample defines every step, cuda/emulate.rs
// transliterates these kernels). One block of PG_SAMPLE_THREADS per row:
// pg_sample_process applies the logit processors, pg_sample_pick chooses
// the token, pg_sample_logprobs describes it under the raw logits (copied
// aside by pg_sample_process for the rows that ask).
//
// Per row, `rows_u` holds PG_SU words: logit row, flags, top-k (0: off),
// logprobs k, grammar mask offset (PG_NO_MASK: none), offset into the top
// lists, raw-copy slot, 0; `rows_f` holds PG_SF floats: temperature,
// top-p, min-p, repetition, presence and frequency penalties, 0, 0. The
// per-row lists are CSR: row r's entries are [off[r], off[r + 1]).
//
// Every choice the CPU makes with f64 sums in sorted order is made here
// with masses in 2^-62 fixed point (integer sums, so atomics leave them
// deterministic), over the same order: probability descending, then id
// ascending, as 32-bit keys that order like f32::total_cmp. Selections
// walk those keys 8 bits at a time from the top (radix select) instead of
// sorting: the k-th element, the mass up to an element, and the element
// where the mass crosses a target.
// ---------------------------------------------------------------------------
#define PG_SAMPLE_THREADS 256
#define PG_SU 8
#define PG_SF 8
#define PG_S_GREEDY 1u
#define PG_S_LOGPROBS 2u
#define PG_S_RESTRICTED 4u
#define PG_NO_MASK 0xffffffffu
#define PG_NO_TOKEN 0xffffffffu
#define PG_FX_ONE 4611686018427387904.0  // 2^62

__device__ __forceinline__ u32 pg_order_key(float v) {
    u32 b = __float_as_uint(v);
    return (b >> 31) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float pg_key_float(u32 k) {
    return __uint_as_float((k >> 31) ? (k & 0x7fffffffu) : ~k);
}
// A probability as a fixed-point mass (0 for NaN and anything not above 0).
__device__ __forceinline__ u64 pg_fx(float p) {
    return p > 0.0f ? (u64)((double)p * PG_FX_ONE) : 0ull;
}

extern "C" __global__ void pg_sample_process(
    float* logits, float* raw, u32 vocab, const u32* rows_u, const float* rows_f,
    const u32* pen_off, const u32* pen, const u32* out_off, const u32* out_tok,
    const u32* out_cnt, const u32* bias_off, const u32* bias_tok, const float* bias_val,
    const u32* ban_off, const u32* ban, const u32* allow_off, const u32* allow,
    const u32* masks, u32* bits) {
    const u32 r = blockIdx.x, tid = threadIdx.x, T = blockDim.x;
    const u32* pu = rows_u + (u64)r * PG_SU;
    const float* pf = rows_f + (u64)r * PG_SF;
    float* row = logits + (u64)pu[0] * vocab;
    const u32 words = (vocab + 31) / 32;
    u32* allowed = bits + (u64)r * 2 * words;
    u32* seen = allowed + words;
    // The raw row for its logprobs, and clean bit sets.
    if (pu[1] & PG_S_LOGPROBS) {
        float* dst = raw + (u64)pu[6] * vocab;
        for (u32 j = tid; j < vocab; j += T) dst[j] = row[j];
    }
    for (u32 w = tid; w < words; w += T) {
        allowed[w] = 0u;
        seen[w] = 0u;
    }
    __syncthreads();
    const u32 a0 = allow_off[r], a1 = allow_off[r + 1];
    if (a1 > a0) {
        for (u32 i = a0 + tid; i < a1; i += T) {
            u32 t = allow[i];
            if (t < vocab) atomicOr(&allowed[t / 32], 1u << (t % 32));
        }
        __syncthreads();
        for (u32 j = tid; j < vocab; j += T) {
            if (!((allowed[j / 32] >> (j % 32)) & 1u)) row[j] = PG_NEG_INF;
        }
    }
    __syncthreads();
    // Biases of one token add up in list order: one thread.
    if (tid == 0) {
        for (u32 i = bias_off[r]; i < bias_off[r + 1]; i++) {
            u32 t = bias_tok[i];
            if (t < vocab) row[t] = row[t] + bias_val[i];
        }
    }
    __syncthreads();
    const float rp = pf[3];
    if (rp != 1.0f) {
        // Each distinct token once: whoever sets its bit applies it.
        for (u32 i = pen_off[r] + tid; i < pen_off[r + 1]; i += T) {
            u32 t = pen[i];
            if (t >= vocab) continue;
            u32 bit = 1u << (t % 32);
            if (!(atomicOr(&seen[t / 32], bit) & bit)) {
                float l = row[t];
                row[t] = l > 0.0f ? l / rp : l * rp;
            }
        }
    }
    __syncthreads();
    const float pp = pf[4], fp = pf[5];
    if (pp != 0.0f || fp != 0.0f) {
        // Output tokens are distinct. No contraction into an FMA: the CPU
        // rounds the product, then the sum.
        for (u32 i = out_off[r] + tid; i < out_off[r + 1]; i += T) {
            u32 t = out_tok[i];
            if (t < vocab) row[t] = row[t] - __fadd_rn(pp, __fmul_rn(fp, (float)out_cnt[i]));
        }
    }
    __syncthreads();
    for (u32 i = ban_off[r] + tid; i < ban_off[r + 1]; i += T) {
        u32 t = ban[i];
        if (t < vocab) row[t] = PG_NEG_INF;
    }
    __syncthreads();
    if (pu[4] != PG_NO_MASK) {
        const u32* m = masks + pu[4];
        for (u32 j = tid; j < vocab; j += T) {
            if (!((m[j / 32] >> (j % 32)) & 1u)) row[j] = PG_NEG_INF;
        }
    }
}

struct PgSampleShared {
    u32 hist[256];
    u64 hmass[256];
    u64 seg[PG_SAMPLE_THREADS];
    double dred[PG_SAMPLE_THREADS];
    float fred[PG_SAMPLE_THREADS];
    u32 ured[PG_SAMPLE_THREADS];
    u32 word, rem, id;
    u64 acc;
    int found;
};

__device__ float pg_block_max(float v, PgSampleShared* sh) {
    const u32 tid = threadIdx.x;
    sh->fred[tid] = v;
    __syncthreads();
    for (u32 s = PG_SAMPLE_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) sh->fred[tid] = fmaxf(sh->fred[tid], sh->fred[tid + s]);
        __syncthreads();
    }
    float r = sh->fred[0];
    __syncthreads();
    return r;
}
__device__ double pg_block_sum_d(double v, PgSampleShared* sh) {
    const u32 tid = threadIdx.x;
    sh->dred[tid] = v;
    __syncthreads();
    for (u32 s = PG_SAMPLE_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) sh->dred[tid] += sh->dred[tid + s];
        __syncthreads();
    }
    double r = sh->dred[0];
    __syncthreads();
    return r;
}
__device__ u64 pg_block_sum_u64(u64 v, PgSampleShared* sh) {
    const u32 tid = threadIdx.x;
    sh->seg[tid] = v;
    __syncthreads();
    for (u32 s = PG_SAMPLE_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) sh->seg[tid] += sh->seg[tid + s];
        __syncthreads();
    }
    u64 r = sh->seg[0];
    __syncthreads();
    return r;
}
// Whether any thread's `v` is set.
__device__ bool pg_block_any(bool v, PgSampleShared* sh) {
    return pg_block_sum_u64(v ? 1ull : 0ull, sh) > 0;
}

// The first index of the largest value above −∞ (NaN never), or
// PG_NO_TOKEN: the scan `if (v > best)` over the row, as ops::sample's
// argmax defines it.
__device__ u32 pg_block_argmax(const float* x, u32 n, PgSampleShared* sh) {
    const u32 tid = threadIdx.x;
    float bv = PG_NEG_INF;
    u32 bi = PG_NO_TOKEN;
    for (u32 j = tid; j < n; j += PG_SAMPLE_THREADS) {
        float v = x[j];
        if (v > bv) {
            bv = v;
            bi = j;
        }
    }
    sh->fred[tid] = bv;
    sh->ured[tid] = bi;
    __syncthreads();
    for (u32 s = PG_SAMPLE_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) {
            float ov = sh->fred[tid + s];
            u32 oi = sh->ured[tid + s];
            float mv = sh->fred[tid];
            u32 mi = sh->ured[tid];
            if (ov > mv || (ov == mv && oi < mi)) {
                sh->fred[tid] = ov;
                sh->ured[tid] = oi;
            }
        }
        __syncthreads();
    }
    u32 r = sh->ured[0];
    __syncthreads();
    return r;
}

// Whether element (key, j) is among the first elements up to the boundary
// (lim_key, lim_id) in the order (key descending, id ascending).
__device__ __forceinline__ bool pg_upto(u32 key, u32 j, u32 lim_key, u32 lim_id) {
    return key > lim_key || (key == lim_key && j <= lim_id);
}

// The `k`-th (1-based, k <= n) element of `p` in the order: its key and id.
__device__ void pg_select_kth(const float* p, u32 n, u32 k, PgSampleShared* sh, u32* key_out,
                              u32* id_out) {
    const u32 tid = threadIdx.x, T = PG_SAMPLE_THREADS;
    u32 prefix = 0, mask = 0, rem = k;
    for (int pass = 0; pass < 4; pass++) {
        const u32 shift = 24 - 8 * pass;
        for (u32 b = tid; b < 256; b += T) sh->hist[b] = 0;
        __syncthreads();
        for (u32 j = tid; j < n; j += T) {
            u32 key = pg_order_key(p[j]);
            if ((key & mask) == prefix) atomicAdd(&sh->hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            u32 b = 255;
            while (b > 0 && rem > sh->hist[b]) {
                rem -= sh->hist[b];
                b--;
            }
            sh->word = b;
            sh->rem = rem;
        }
        __syncthreads();
        prefix |= sh->word << shift;
        mask |= 255u << shift;
        rem = sh->rem;
        __syncthreads();
    }
    // The rem-th element of key `prefix` in id order: each thread counts
    // its contiguous segment, then the one holding it walks.
    const u32 len = (n + T - 1) / T, lo = min(n, tid * len), hi = min(n, lo + len);
    u32 c = 0;
    for (u32 j = lo; j < hi; j++) c += pg_order_key(p[j]) == prefix;
    sh->seg[tid] = c;
    __syncthreads();
    if (tid == 0) {
        u64 at = 0;
        for (u32 t = 0; t < T; t++) {
            u64 here = sh->seg[t];
            sh->seg[t] = at;
            at += here;
        }
        sh->id = PG_NO_TOKEN;
    }
    __syncthreads();
    u64 before = sh->seg[tid];
    if (before < rem && rem <= before + c) {
        u64 seen = before;
        for (u32 j = lo; j < hi; j++) {
            if (pg_order_key(p[j]) == prefix && ++seen == rem) {
                sh->id = j;
                break;
            }
        }
    }
    __syncthreads();
    *key_out = prefix;
    *id_out = sh->id;
    __syncthreads();
}

// The mass of the elements up to (lim_key, lim_id) whose probability is at
// least `floor_p`.
__device__ u64 pg_mass_upto(const float* p, u32 n, u32 lim_key, u32 lim_id, float floor_p,
                            PgSampleShared* sh) {
    u64 m = 0;
    for (u32 j = threadIdx.x; j < n; j += PG_SAMPLE_THREADS) {
        float v = p[j];
        if (pg_upto(pg_order_key(v), j, lim_key, lim_id) && v >= floor_p) m += pg_fx(v);
    }
    return pg_block_sum_u64(m, sh);
}

// Among the elements up to (lim_key, lim_id) with probability at least
// `floor_p`, taken in order, the first at which the running mass reaches
// `target`. Returns whether there is one, and sets its key and id.
__device__ bool pg_cross(const float* p, u32 n, u32 lim_key, u32 lim_id, float floor_p,
                         u64 target, PgSampleShared* sh, u32* key_out, u32* id_out) {
    const u32 tid = threadIdx.x, T = PG_SAMPLE_THREADS;
    u32 prefix = 0, mask = 0;
    u64 acc = 0;
    for (int pass = 0; pass < 4; pass++) {
        const u32 shift = 24 - 8 * pass;
        for (u32 b = tid; b < 256; b += T) {
            sh->hist[b] = 0;
            sh->hmass[b] = 0;
        }
        __syncthreads();
        for (u32 j = tid; j < n; j += T) {
            float v = p[j];
            u32 key = pg_order_key(v);
            if ((key & mask) == prefix && pg_upto(key, j, lim_key, lim_id) && v >= floor_p) {
                u32 d = (key >> shift) & 255u;
                atomicAdd(&sh->hist[d], 1u);
                atomicAdd(&sh->hmass[d], pg_fx(v));
            }
        }
        __syncthreads();
        if (tid == 0) {
            int found = 0;
            for (int b = 255; b >= 0; b--) {
                if (sh->hist[b] > 0 && acc + sh->hmass[b] >= target) {
                    sh->word = (u32)b;
                    found = 1;
                    break;
                }
                acc += sh->hmass[b];
            }
            sh->found = found;
            sh->acc = acc;
        }
        __syncthreads();
        if (!sh->found) {
            __syncthreads();
            return false;
        }
        prefix |= sh->word << shift;
        mask |= 255u << shift;
        acc = sh->acc;
        __syncthreads();
    }
    // Among the elements of key `prefix` (in the set), in id order.
    const u32 len = (n + T - 1) / T, lo = min(n, tid * len), hi = min(n, lo + len);
    u64 m = 0;
    u32 c = 0;
    for (u32 j = lo; j < hi; j++) {
        float v = p[j];
        if (pg_order_key(v) == prefix && pg_upto(prefix, j, lim_key, lim_id) && v >= floor_p) {
            m += pg_fx(v);
            c++;
        }
    }
    sh->seg[tid] = m;
    __syncthreads();
    if (tid == 0) {
        u64 at = acc;
        for (u32 t = 0; t < T; t++) {
            u64 here = sh->seg[t];
            sh->seg[t] = at;
            at += here;
        }
        sh->id = PG_NO_TOKEN;
    }
    __syncthreads();
    u64 run = sh->seg[tid];
    if (c > 0 && run + m >= target) {
        for (u32 j = lo; j < hi; j++) {
            float v = p[j];
            if (pg_order_key(v) == prefix && pg_upto(prefix, j, lim_key, lim_id) &&
                v >= floor_p) {
                run += pg_fx(v);
                if (run >= target) {
                    // Later segments may cross too; the first one wins.
                    atomicMin(&sh->id, j);
                    break;
                }
            }
        }
    }
    __syncthreads();
    *key_out = prefix;
    *id_out = sh->id;
    __syncthreads();
    return true;
}

// The draw over the whole row in id order: the first positive entry at or
// after the point where the running mass reaches `target`, else the argmax.
__device__ u32 pg_draw_in_order(const float* p, u32 n, u64 target, PgSampleShared* sh) {
    const u32 tid = threadIdx.x, T = PG_SAMPLE_THREADS;
    const u32 len = (n + T - 1) / T, lo = min(n, tid * len), hi = min(n, lo + len);
    u64 m = 0;
    for (u32 j = lo; j < hi; j++) m += pg_fx(p[j]);
    sh->seg[tid] = m;
    __syncthreads();
    if (tid == 0) {
        u64 at = 0;
        for (u32 t = 0; t < T; t++) {
            u64 here = sh->seg[t];
            sh->seg[t] = at;
            at += here;
        }
        sh->id = PG_NO_TOKEN;
    }
    __syncthreads();
    u64 run = sh->seg[tid];
    if (hi > lo && run + m >= target) {
        for (u32 j = lo; j < hi; j++) {
            run += pg_fx(p[j]);
            if (run >= target) {
                atomicMin(&sh->id, j);
                break;
            }
        }
    }
    __syncthreads();
    const u32 cross = sh->id;
    __syncthreads();
    if (cross != PG_NO_TOKEN) {
        if (tid == 0) sh->id = PG_NO_TOKEN;
        __syncthreads();
        for (u32 j = cross + tid; j < n; j += T) {
            if (p[j] > 0.0f) {
                atomicMin(&sh->id, j);
                break;
            }
        }
        __syncthreads();
        const u32 first = sh->id;
        __syncthreads();
        if (first != PG_NO_TOKEN) return first;
    }
    u32 a = pg_block_argmax(p, n, sh);
    return a == PG_NO_TOKEN ? 0 : a;
}

extern "C" __global__ void pg_sample_pick(float* logits, u32 vocab, const u32* rows_u,
                                          const float* rows_f, const double* uniform,
                                          u32* tokens) {
    __shared__ PgSampleShared sh;
    const u32 r = blockIdx.x, tid = threadIdx.x;
    const u32* pu = rows_u + (u64)r * PG_SU;
    const float* pf = rows_f + (u64)r * PG_SF;
    float* p = logits + (u64)pu[0] * vocab;
    const u32 flags = pu[1];
    u32 token;
    if (flags & PG_S_GREEDY) {
        token = pg_block_argmax(p, vocab, &sh);
        if (token == PG_NO_TOKEN) token = (flags & PG_S_RESTRICTED) ? PG_NO_TOKEN : 0;
        if (tid == 0) tokens[r] = token;
        return;
    }
    if (flags & PG_S_RESTRICTED) {
        bool any = false;
        for (u32 j = tid; j < vocab; j += PG_SAMPLE_THREADS) any |= p[j] > PG_NEG_INF;
        if (!pg_block_any(any, &sh)) {
            if (tid == 0) tokens[r] = PG_NO_TOKEN;
            return;
        }
    }
    // Temperature, then the softmax as ops::softmax_inplace computes it:
    // the maximum, e^(x - max) summed in f64, times 1 / sum.
    const float inv_t = 1.0f / pf[0];
    float mx = PG_NEG_INF;
    for (u32 j = tid; j < vocab; j += PG_SAMPLE_THREADS) {
        float v = p[j];
        if (inv_t != 1.0f) {
            v *= inv_t;
            p[j] = v;
        }
        mx = fmaxf(mx, v);
    }
    mx = pg_block_max(mx, &sh);
    double part = 0.0;
    for (u32 j = tid; j < vocab; j += PG_SAMPLE_THREADS) {
        float e = expf(p[j] - mx);
        p[j] = e;
        part += (double)e;
    }
    const float inv = (float)(1.0 / pg_block_sum_d(part, &sh));
    for (u32 j = tid; j < vocab; j += PG_SAMPLE_THREADS) p[j] *= inv;
    __syncthreads();

    const double u = uniform[r];
    const u32 top_k = pu[2] > 0 ? min(pu[2], vocab) : vocab;
    const float top_p = pf[1], min_p = pf[2];
    if (top_k == vocab && top_p >= 1.0f && min_p <= 0.0f) {
        token = pg_draw_in_order(p, vocab, (u64)(u * PG_FX_ONE), &sh);
        if (tid == 0) tokens[r] = token;
        return;
    }
    // The candidates: the top k for k = top-k, or 64, 512, ... until their
    // mass reaches top-p (the CPU's k-growing search, same checkpoints).
    u32 k = top_k < vocab ? top_k : min(64u, vocab);
    u32 lim_key, lim_id;
    u64 kept;
    for (;;) {
        pg_select_kth(p, vocab, k, &sh, &lim_key, &lim_id);
        kept = pg_mass_upto(p, vocab, lim_key, lim_id, PG_NEG_INF, &sh);
        if (k == top_k || k == vocab || kept >= (u64)((double)top_p * PG_FX_ONE)) break;
        k = min(min(k * 8, top_k), vocab);
    }
    u32 first_key, first_id;
    pg_select_kth(p, vocab, 1, &sh, &first_key, &first_id);
    if (top_p < 1.0f) {
        // The shortest prefix holding top-p of the kept mass.
        u32 ck, ci;
        if (pg_cross(p, vocab, lim_key, lim_id, PG_NEG_INF, (u64)((double)top_p * (double)kept),
                     &sh, &ck, &ci)) {
            lim_key = ck;
            lim_id = ci;
        }
    }
    // Min-p keeps a prefix too: probabilities of at least min-p times the
    // likeliest.
    const float floor_p = min_p > 0.0f ? pg_key_float(first_key) * min_p : PG_NEG_INF;
    const u64 sum = pg_mass_upto(p, vocab, lim_key, lim_id, floor_p, &sh);
    u32 ck, ci;
    bool hit = pg_cross(p, vocab, lim_key, lim_id, floor_p, (u64)(u * (double)sum), &sh, &ck, &ci);
    token = hit ? ci : first_id;
    if (tid == 0) tokens[r] = token;
}

// For the rows that ask: the chosen token's log-probability under the raw
// logits, its rank, and the top alternatives (log-probability descending,
// then id), as ops::sample computes them.
extern "C" __global__ void pg_sample_logprobs(const float* raw, u32 vocab, const u32* rows_u,
                                              const u32* tokens, float* lp_out, u32* rank_out,
                                              u32* top_ids, float* top_lps) {
    __shared__ PgSampleShared sh;
    const u32 r = blockIdx.x, tid = threadIdx.x, T = PG_SAMPLE_THREADS;
    const u32* pu = rows_u + (u64)r * PG_SU;
    if (!(pu[1] & PG_S_LOGPROBS)) return;
    const float* x = raw + (u64)pu[6] * vocab;
    float mx = PG_NEG_INF;
    for (u32 j = tid; j < vocab; j += T) mx = fmaxf(mx, x[j]);
    mx = pg_block_max(mx, &sh);
    double part = 0.0;
    for (u32 j = tid; j < vocab; j += T) part += exp((double)(x[j] - mx));
    const double lse = (double)mx + log(pg_block_sum_d(part, &sh));
    const u32 token = tokens[r];
    if (token == PG_NO_TOKEN || token >= vocab) {
        if (tid == 0) {
            lp_out[r] = 0.0f;
            rank_out[r] = 0;
        }
        return;
    }
    const float chosen = (float)((double)x[token] - lse);
    u64 better = 0;
    for (u32 j = tid; j < vocab; j += T) better += (float)((double)x[j] - lse) > chosen;
    better = pg_block_sum_u64(better, &sh);
    if (tid == 0) {
        lp_out[r] = chosen;
        rank_out[r] = (u32)better + 1;
    }
    // The top k, one per pass: the best element after the previous one.
    const u32 k = min(pu[3], vocab), off = pu[5];
    u32 prev_key = 0xffffffffu, prev_id = 0;
    bool first = true;
    for (u32 i = 0; i < k; i++) {
        u32 bk = 0, bi = PG_NO_TOKEN;
        for (u32 j = tid; j < vocab; j += T) {
            u32 key = pg_order_key((float)((double)x[j] - lse));
            bool after = first || key < prev_key || (key == prev_key && j > prev_id);
            if (after && (bi == PG_NO_TOKEN || key > bk)) {
                bk = key;
                bi = j;
            }
        }
        sh.ured[tid] = bk;
        sh.seg[tid] = bi;
        __syncthreads();
        for (u32 s = T / 2; s > 0; s >>= 1) {
            if (tid < s) {
                u32 ok = sh.ured[tid + s], mk = sh.ured[tid];
                u64 oi = sh.seg[tid + s], mi = sh.seg[tid];
                bool other = oi != PG_NO_TOKEN && (mi == PG_NO_TOKEN || ok > mk || (ok == mk && oi < mi));
                if (other) {
                    sh.ured[tid] = ok;
                    sh.seg[tid] = oi;
                }
            }
            __syncthreads();
        }
        prev_key = sh.ured[0];
        prev_id = (u32)sh.seg[0];
        first = false;
        __syncthreads();
        if (tid == 0) {
            top_ids[off + i] = prev_id;
            top_lps[off + i] = pg_key_float(prev_key);
        }
    }
}

// ---------------------------------------------------------------------------
// LoRA deltas (ops/lora.rs): for the tokens of one adapter slot, h = scale ·
// A x, then out[:, col..col + out_dim] += h · Bᵀ. Launched once per slot that
// holds factors; tokens of other slots return at once. The factors are F32,
// F16 or BF16 (`--lora-dtype`), arithmetic f32.
// ---------------------------------------------------------------------------

// Element `i` of a dense factor, as f32.
__device__ __forceinline__ float pg_lora_at(int ty, const u8* m, u64 i) {
    switch (ty) {
    case PG_W_F16:
        return pg_h2f(((const u16*)m)[i]);
    case PG_W_BF16:
        return pg_bf2f(((const u16*)m)[i]);
    default:
        return ((const float*)m)[i];
    }
}

// h[t][k] = scale · Σ_i A[k][i] · x[t][i]. One thread block per token; warp
// w computes k = w, w + warps, …: its lanes stride over the input, then a
// warp sum.
extern "C" __global__ void pg_lora_shrink(int ty, const u8* a, const float* x, u32 in_dim,
                                          u32 rank, float scale, const u32* token_slots,
                                          u32 slot, float* h, u32 h_stride) {
    u32 t = blockIdx.x;
    if (token_slots[t] != slot) return;
    u32 warps = blockDim.x / 32, w = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float* xt = x + (u64)t * in_dim;
    for (u32 k = w; k < rank; k += warps) {
        float s = 0.0f;
        for (u32 i = lane; i < in_dim; i += 32) {
            s = fmaf(pg_lora_at(ty, a, (u64)k * in_dim + i), xt[i], s);
        }
        s = pg_warp_sum(s);
        if (lane == 0) h[(u64)t * h_stride + k] = scale * s;
    }
}

// out[t][col + j] += Σ_k h[t][k] · Bᵀ[k][j]: one thread per (token, output
// column), adding its rank terms in k order, fused, as the CPU kernel does.
extern "C" __global__ void pg_lora_expand(int ty, const u8* bt, const float* h, u32 h_stride,
                                          u32 rank, const u32* token_slots, u32 slot,
                                          u32 n_tokens, float* out, u32 out_stride, u32 col,
                                          u32 out_dim) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)n_tokens * out_dim) return;
    u32 t = (u32)(i / out_dim), j = (u32)(i % out_dim);
    if (token_slots[t] != slot) return;
    const float* ht = h + (u64)t * h_stride;
    float* o = out + (u64)t * out_stride + col + j;
    // Summed from zero, then added: the CPU op's order.
    float acc = 0.0f;
    for (u32 k = 0; k < rank; k++) {
        acc = fmaf(ht[k], pg_lora_at(ty, bt, (u64)k * out_dim + j), acc);
    }
    *o = *o + acc;
}
