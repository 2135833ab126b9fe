// f32 Attention (not VarlenAttention) on tensor cores: `mma.sync.m16n8k8` with TF32
// operands and f32 accumulation, forward (with LSE) and backward (dQ, then dK/dV), for
// head sizes up to 64 (padded with zeros to 64). cuda/flash.cu's fs_* kernels (CUDA cores)
// take the rest, and everything when GRAPHRUN_CUDA_ATTENTION_F32=simt.
//
// Precision. NP = 2 (f32, the default): 3xTF32, as PyTorch's f32 SDPA (the xformers /
// cutlass memory-efficient kernel: gemm_kernel_utils.h DefaultGemmType<Sm80+, float> is a
// TensorOp 16×8×8 with OpMultiplyAddFastF32): each operand x = big + small, big =
// cvt.rna.tf32(x), small = cvt.rna.tf32(x − big), and a·b ≈ small·big + big·small +
// big·big, accumulated in f32: about 21 bits of each operand instead of TF32's 10, errors
// at FP32's level. NP = 1 (`--dtype tf32`, TF32 allowed): big·big only.
//
// Layout. A warp owns 16 rows (queries: forward, dQ; keys: dK/dV); its A operands that do
// not change over the loop (Q, dY; K, V) stay in registers as raw f32 and are split per k
// step; P and dS come from the accumulators (the k order inside a k step is free as long
// as A and B agree: PTX k = t holds column 2t, k = t + 4 column 2t + 1, so an accumulator
// (row, 2t | 2t+1) pair is directly an A fragment). B operands live in shared memory in
// fragment order, already split: per (8-row n block, k block) 32 chunks, one per lane, of
// {b0 big, b0 small, b1 big, b1 small} (NP = 2; {b0, b1} for NP = 1): one conflict-free
// 16-byte (8-byte) load per fragment. The online softmax runs in the log2 domain in f32;
// LSE is stored in natural units as cuda/flash.cu's. Causal is upper-left (key j is seen
// by query i iff j ≤ i); masks bool (keep where true) or additive through AttnGeom::ms;
// rows that see no key give 0 and LSE −inf. Backward as fs_dq / fs_dkv: no atomics,
// deterministic.

#define FT_LOG2E 1.4426950408889634f
#define FT_LN2 0.6931471805599453f
#define FT_TQ 32  // dK/dV: queries per tile

extern __shared__ __align__(16) float ft_smem[];

__device__ __forceinline__ float ft_rna(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return __uint_as_float(r);
}
__device__ __forceinline__ float ft_ex2(float x) {
    float y;
    asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float ft_inf() { return __int_as_float(0x7f800000); }

// d += A (16×8) · B (8×8) in TF32.
__device__ __forceinline__ void ft_mma(float* d, const float* a, float b0, float b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(__float_as_uint(a[0])), "r"(__float_as_uint(a[1])), "r"(__float_as_uint(a[2])),
          "r"(__float_as_uint(a[3])), "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}

// An A fragment (a0..a3 in mma order), split into big (`hi`) and, for NP = 2, small parts.
template <int NP> struct FtA {
    float hi[4], lo[4];
    __device__ __forceinline__ FtA(float a0, float a1, float a2, float a3) {
        float x[4] = {a0, a1, a2, a3};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            hi[i] = ft_rna(x[i]);
            lo[i] = NP == 2 ? ft_rna(x[i] - hi[i]) : 0.f;
        }
    }
};
// From a raw fragment in registers: {a0, a1, a2, a3}.
template <int NP> __device__ __forceinline__ FtA<NP> ft_a(const float* x) { return FtA<NP>(x[0], x[1], x[2], x[3]); }
// From an accumulator block c (c0 = (g, 2t), c1 = (g, 2t+1), c2 = (g+8, 2t), c3 = (g+8, 2t+1)).
template <int NP> __device__ __forceinline__ FtA<NP> ft_acc(const float* c) { return FtA<NP>(c[0], c[2], c[1], c[3]); }

// d += A · B(fragment at `tile` block (nb, kb); KB k blocks per n block). NP = 2: the small
// products first, then big·big.
template <int NP, int KB> __device__ __forceinline__ void ft_mma_b(float* d, const FtA<NP>& a, const float* tile, int nb, int kb) {
    const float* p = tile + ((nb * KB + kb) * 32 + (threadIdx.x & 31)) * 2 * NP;
    if (NP == 2) {
        float4 b = *(const float4*)p;
        ft_mma(d, a.lo, b.x, b.z);
        ft_mma(d, a.hi, b.y, b.w);
        ft_mma(d, a.hi, b.x, b.z);
    } else {
        float2 b = *(const float2*)p;
        ft_mma(d, a.hi, b.x, b.y);
    }
}

// Offset of the chunk holding B element (n, k) (and k ^ 1) of a tile with KB k blocks.
template <int NP, int KB> __device__ __forceinline__ int ft_chunk(int n, int k) {
    return ((((n >> 3) * KB + (k >> 3)) * 32 + (n & 7) * 4 + ((k & 7) >> 1)) * 2 * NP);
}
// Stores the pair of B elements (n, 2j) = x0, (n, 2j + 1) = x1 of a chunk, split.
template <int NP> __device__ __forceinline__ void ft_st(float* p, float x0, float x1) {
    float h0 = ft_rna(x0), h1 = ft_rna(x1);
    if (NP == 2)
        *(float4*)p = make_float4(h0, ft_rna(x0 - h0), h1, ft_rna(x1 - h1));
    else
        *(float2*)p = make_float2(h0, h1);
}

// Loads `valid` rows (of NR; the rest zero) of `width` columns (zero-padded to 64) from
// `src` (row stride `rs`) as B tiles: `nt` with n = row, k = column; `tt` with n = column,
// k = row (either may be null). A thread takes 2 rows × 4 columns at a time: float4 reads
// with `vec` (width % 4 == 0, 16-byte aligned rows), elements otherwise.
template <int NP, int NR> __device__ __forceinline__ void ft_load(float* nt, float* tt, const float* src, i64 rs, int valid, int width, int vec) {
#pragma unroll 2
    for (int u = threadIdx.x; u < NR / 2 * 16; u += 128) {
        int c = (u & 15) * 4, r = (u >> 4) * 2;
        float x[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float* p = src + (i64)(r + h) * rs + c;
            bool in = r + h < valid;
            if (vec) {
                float4 v = in && c < width ? *(const float4*)p : make_float4(0.f, 0.f, 0.f, 0.f);
                x[h][0] = v.x, x[h][1] = v.y, x[h][2] = v.z, x[h][3] = v.w;
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) x[h][i] = in && c + i < width ? p[i] : 0.f;
            }
        }
        if (nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                ft_st<NP>(nt + ft_chunk<NP, 8>(r + h, c), x[h][0], x[h][1]);
                ft_st<NP>(nt + ft_chunk<NP, 8>(r + h, c + 2), x[h][2], x[h][3]);
            }
        if (tt)
#pragma unroll
            for (int i = 0; i < 4; ++i) ft_st<NP>(tt + ft_chunk<NP, NR / 8>(c + i, r), x[0][i], x[1][i]);
    }
}

// The raw A fragments of this warp's rows r0 + g, r0 + g + 8 (< valid; rows of `src`,
// stride `rs`), columns kb·8 + 2t, + 1 (< width): a[kb] = {a0, a1, a2, a3}.
__device__ __forceinline__ void ft_load_a(float (*a)[4], const float* src, i64 rs, int r0, int valid, int width) {
    int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int kb = 0; kb < 8; ++kb)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int r = r0 + gq + 8 * h, c = kb * 8 + 2 * tq;
            const float* p = src + (i64)r * rs + c;
            a[kb][h] = r < valid && c < width ? p[0] : 0.f;
            a[kb][2 + h] = r < valid && c + 1 < width ? p[1] : 0.f;
        }
}

// The same fragments kept raw in shared memory (`sa`: this warp's 8 × 32 lanes × 4 floats)
// where registers are short; read back with ft_sa.
__device__ __forceinline__ void ft_stash_a(float* sa, const float* src, i64 rs, int r0, int valid, int width) {
    float a[8][4];
    ft_load_a(a, src, rs, r0, valid, width);
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) *(float4*)&sa[(kb * 32 + lane) * 4] = make_float4(a[kb][0], a[kb][1], a[kb][2], a[kb][3]);
}
template <int NP> __device__ __forceinline__ FtA<NP> ft_sa(const float* sa, int kb) {
    float4 x = *(const float4*)&sa[(kb * 32 + (threadIdx.x & 31)) * 4];
    return FtA<NP>(x.x, x.y, x.z, x.w);
}

// The additive (in log2 units) or bool mask at `off`: x stays, moves, or becomes −inf.
__device__ __forceinline__ float ft_mask(const AttnGeom& g, const void* mask, i64 off, float x) {
    if (g.mask_kind == 1) return ((const unsigned char*)mask)[off] ? x : -ft_inf();
    return x + ((const float*)mask)[off] * FT_LOG2E;
}

__device__ __forceinline__ float ft_quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float ft_quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Stores a warp's 16 × 64 accumulator (rows r0 + g, + 8 < nrows; columns < width) times f.
__device__ __forceinline__ void ft_store(float* dst, i64 rs, const float (*acc)[4], i64 r0, i64 nrows, int width, const float* f) {
    int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        i64 r = r0 + gq + 8 * h;
        if (r >= nrows) continue;
#pragma unroll
        for (int nb = 0; nb < 8; ++nb) {
            int c = nb * 8 + 2 * tq;
            if (c < width) dst[r * rs + c] = acc[nb][2 * h] * f[h];
            if (c + 1 < width) dst[r * rs + c + 1] = acc[nb][2 * h + 1] * f[h];
        }
    }
}

// How many 8-key blocks of the 64-key tile at j0 this warp (queries qw..qw+15) needs.
__device__ __forceinline__ int ft_key_blocks(const AttnGeom& g, i64 j0, i64 qw) {
    i64 lim = g.skv - j0 < 64 ? g.skv - j0 : 64;
    if (g.causal && qw + 16 - j0 < lim) lim = qw + 16 - j0;
    return lim <= 0 ? 0 : (int)((lim + 7) >> 3);
}

// Forward: grid (query blocks of 64, B·Hq), 4 warps of 16 queries; K and V tiles of 64
// keys. Y [B,Hq,Sq,Dv] through AttnGeom's strides, LSE [B,Hq,Sq].
template <int NP> __device__ void ft_fwd(const AttnGeom& g, const float* Q, const float* K, const float* V, const void* mask, float* Y, float* lse, int vec) {
    float* sK = ft_smem;             // K: n = key, k = d
    float* sV = sK + 64 * 64 * NP;   // V: n = dv, k = key
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    i64 qb = g.causal ? (i64)gridDim.x - 1 - blockIdx.x : blockIdx.x;
    i64 bh = blockIdx.y, b = bh / g.hq, h = bh % g.hq, hk = h / (g.hq / g.hkv);
    i64 q0 = qb * 64, qw = q0 + warp * 16;
    i64 kend = g.skv;
    if (g.causal && q0 + 64 < kend) kend = q0 + 64;
    const i64 krs = g.st[ATT_K][2], vrs = g.st[ATT_V][2];
    const float* Kb = K + att_off(g, ATT_K, b, hk, 0);
    const float* Vb = V + att_off(g, ATT_V, b, hk, 0);
    float qa[8][4];
    ft_load_a(qa, Q + att_off(g, ATT_Q, b, h, q0), g.st[ATT_Q][2], warp * 16, (int)(g.sq - q0 < 64 ? g.sq - q0 : 64), (int)g.d);
    float o[8][4], m[2] = {-ft_inf(), -ft_inf()}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) o[nb][0] = o[nb][1] = o[nb][2] = o[nb][3] = 0.f;
    const float sl2 = (float)g.scale * FT_LOG2E;
    for (i64 j0 = 0; j0 < kend; j0 += 64) {
        int kv = (int)(g.skv - j0 < 64 ? g.skv - j0 : 64);
        __syncthreads();
        ft_load<NP, 64>(sK, nullptr, Kb + j0 * krs, krs, kv, (int)g.d, vec);
        ft_load<NP, 64>(nullptr, sV, Vb + j0 * vrs, vrs, kv, (int)g.dv, vec);
        __syncthreads();
        int nbl = ft_key_blocks(g, j0, qw);
        if (nbl == 0) continue;  // (warp-uniform) every key of the tile after this warp's queries
        float s[8][4];
#pragma unroll
        for (int nb = 0; nb < 8; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
#pragma unroll
        for (int kb = 0; kb < 8; ++kb) {
            if (kb * 8 >= g.d) break;
            FtA<NP> a = ft_a<NP>(qa[kb]);
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)
                if (nb < nbl) ft_mma_b<NP, 8>(s[nb], a, sK, nb, kb);
        }
        // Only tiles at the end of the keys, on the causal diagonal or with a mask check
        // each score (the key blocks past nbl are among them: their scores become −inf).
        bool edge = g.mask_kind || j0 + 64 > g.skv || (g.causal && j0 + 63 > qw);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            i64 qi = qw + gq + 8 * hh;
            // Key columns c of the tile: c ≥ klim past Skv, c > qrel after the query.
            int klim = kv, qrel = (int)(qi - j0 < 64 ? qi - j0 : 64);
            i64 mrow = b * g.ms[0] + h * g.ms[1] + qi * g.ms[2] + j0 * g.ms[3];
            float mx = m[hh];
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float x = s[nb][2 * hh + e] * sl2;
                    int c = nb * 8 + 2 * tq + e;
                    if (edge && (c >= klim || (g.causal && c > qrel))) x = -ft_inf();
                    else if (edge && g.mask_kind && qi < g.sq) x = ft_mask(g, mask, mrow + c * g.ms[3], x);
                    s[nb][2 * hh + e] = x;
                    mx = fmaxf(mx, x);
                }
            mx = ft_quad_max(mx);
            float ref = mx == -ft_inf() ? 0.f : mx;
            float alpha = ft_ex2(m[hh] - ref);
            m[hh] = mx;
            float ps = 0.f;
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float p = ft_ex2(s[nb][2 * hh + e] - ref);
                    s[nb][2 * hh + e] = p;
                    ps += p;
                    o[nb][2 * hh + e] *= alpha;
                }
            l[hh] = l[hh] * alpha + ps;
        }
        // O += P · V
#pragma unroll
        for (int kb = 0; kb < 8; ++kb) {
            if (kb >= nbl) break;
            FtA<NP> a = ft_acc<NP>(s[kb]);
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)
                if (nb * 8 < g.dv) ft_mma_b<NP, 8>(o[nb], a, sV, nb, kb);
        }
    }
    float f[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        l[hh] = ft_quad_sum(l[hh]);
        f[hh] = l[hh] > 0.f ? 1.f / l[hh] : 0.f;
    }
    ft_store(Y + att_off(g, ATT_Y, b, h, 0), g.st[ATT_Y][2], o, qw, g.sq, (int)g.dv, f);
    if (lse && tq == 0)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            i64 qi = qw + gq + 8 * hh;
            if (qi < g.sq) lse[bh * g.sq + qi] = l[hh] > 0.f ? m[hh] * FT_LN2 + logf(l[hh]) : -ft_inf();
        }
}

// dQ (and dMask): grid as the forward; K tiles in both orientations and V.
template <int NP> __device__ void ft_dq(const AttnGeom& g, const float* dY, const float* Q, const float* K, const float* V, const void* mask, const float* lse, const float* delta, float* dQ, float* dmask, int vec) {
    float* sK = ft_smem;             // K: n = key, k = d (S = Q·Kᵀ)
    float* sKt = sK + 64 * 64 * NP;  // K: n = d, k = key (dQ += dS·K)
    float* sV = sKt + 64 * 64 * NP;  // V: n = key, k = dv (dP = dY·Vᵀ)
    float* sYa = sV + 64 * 64 * NP;  // raw A fragments of dY: 4 warps × 8 × 32 × 4
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    i64 qb = g.causal ? (i64)gridDim.x - 1 - blockIdx.x : blockIdx.x;
    i64 bh = blockIdx.y, b = bh / g.hq, h = bh % g.hq, hk = h / (g.hq / g.hkv);
    i64 q0 = qb * 64, qw = q0 + warp * 16;
    int qv = (int)(g.sq - q0 < 64 ? g.sq - q0 : 64);
    i64 kend = g.skv;
    if (g.causal && q0 + 64 < kend) kend = q0 + 64;
    const i64 krs = g.st[ATT_K][2], vrs = g.st[ATT_V][2];
    const float* Kb = K + att_off(g, ATT_K, b, hk, 0);
    const float* Vb = V + att_off(g, ATT_V, b, hk, 0);
    float qa[8][4];
    ft_load_a(qa, Q + att_off(g, ATT_Q, b, h, q0), g.st[ATT_Q][2], warp * 16, qv, (int)g.d);
    sYa += warp * 8 * 32 * 4;
    ft_stash_a(sYa, dY + att_off(g, ATT_Y, b, h, q0), g.st[ATT_Y][2], warp * 16, qv, (int)g.dv);
    float L[2], Dl[2], acc[8][4];
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.f;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        i64 qi = qw + gq + 8 * hh;
        float x = qi < g.sq ? lse[bh * g.sq + qi] : -ft_inf();
        L[hh] = x == -ft_inf() ? ft_inf() : x * FT_LOG2E;
        Dl[hh] = qi < g.sq ? delta[bh * g.sq + qi] : 0.f;
    }
    const float sl2 = (float)g.scale * FT_LOG2E;
    for (i64 j0 = 0; j0 < kend; j0 += 64) {
        int kv = (int)(g.skv - j0 < 64 ? g.skv - j0 : 64);
        __syncthreads();
        ft_load<NP, 64>(sK, sKt, Kb + j0 * krs, krs, kv, (int)g.d, vec);
        ft_load<NP, 64>(sV, nullptr, Vb + j0 * vrs, vrs, kv, (int)g.dv, vec);
        __syncthreads();
        int nbl = ft_key_blocks(g, j0, qw);
        if (nbl == 0) continue;
        float s[8][4], dp[8][4];
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nb][e] = dp[nb][e] = 0.f;
#pragma unroll
        for (int kb = 0; kb < 8; ++kb) {
            if (kb * 8 >= g.d) break;
            FtA<NP> a = ft_a<NP>(qa[kb]);
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)
                if (nb < nbl) ft_mma_b<NP, 8>(s[nb], a, sK, nb, kb);
        }
#pragma unroll
        for (int kb = 0; kb < 8; ++kb) {
            if (kb * 8 >= g.dv) break;
            FtA<NP> a = ft_sa<NP>(sYa, kb);
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)
                if (nb < nbl) ft_mma_b<NP, 8>(dp[nb], a, sV, nb, kb);
        }
        bool edge = g.mask_kind || j0 + 64 > g.skv || (g.causal && j0 + 63 > qw);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            i64 qi = qw + gq + 8 * hh;
            int klim = kv, qrel = (int)(qi - j0 < 64 ? qi - j0 : 64);
            i64 mrow = b * g.ms[0] + h * g.ms[1] + qi * g.ms[2] + j0 * g.ms[3];
            float* drow = dmask && qi < g.sq ? dmask + (bh * g.sq + qi) * g.skv + j0 : nullptr;
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    int c = nb * 8 + 2 * tq + e;
                    float x = s[nb][2 * hh + e] * sl2;
                    if (edge && (c >= klim || (g.causal && c > qrel))) x = -ft_inf();
                    else if (edge && g.mask_kind && qi < g.sq) x = ft_mask(g, mask, mrow + c * g.ms[3], x);
                    float p = ft_ex2(x - L[hh]);
                    float ds = p * (dp[nb][2 * hh + e] - Dl[hh]);
                    s[nb][2 * hh + e] = ds;
                    if (drow && c < klim) drow[c] = ds;
                }
        }
        // dQ += dS · K
#pragma unroll
        for (int kb = 0; kb < 8; ++kb) {
            if (kb >= nbl) break;
            FtA<NP> a = ft_acc<NP>(s[kb]);
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)
                if (nb * 8 < g.d) ft_mma_b<NP, 8>(acc[nb], a, sKt, nb, kb);
        }
    }
    float f[2] = {(float)g.scale, (float)g.scale};
    ft_store(dQ + att_off(g, ATT_Q, b, h, 0), g.st[ATT_Q][2], acc, qw, g.sq, (int)g.d, f);
}

// dK, dV: grid (key blocks of 64, B·Hkv), 4 warps of 16 keys; over the query heads of
// the group (GQA) and their query tiles of FT_TQ: Q and dY in both orientations, LSE and
// delta.
template <int NP> __device__ void ft_dkv(const AttnGeom& g, const float* dY, const float* Q, const float* K, const float* V, const void* mask, const float* lse, const float* delta, float* dK, float* dV, int vec) {
    constexpr int T = FT_TQ, TB = FT_TQ / 8;
    float* sQ = ft_smem;            // Q: n = query, k = d (Sᵀ = K·Qᵀ)
    float* sQt = sQ + T * 64 * NP;  // Q: n = d, k = query (dK += dSᵀ·Q)
    float* sY = sQt + T * 64 * NP;  // dY: n = query, k = dv (dPᵀ = V·dYᵀ)
    float* sYt = sY + T * 64 * NP;  // dY: n = dv, k = query (dV += Pᵀ·dY)
    float* sL = sYt + T * 64 * NP;  // [T] LSE·log2e (+inf where a row sees nothing)
    float* sD = sL + T;             // [T] delta
    float* sKa = sD + T;            // raw A fragments of K, then V: 4 warps × 8 × 32 × 4
    float* sVa = sKa + 4 * 8 * 32 * 4;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    i64 bhk = blockIdx.y, b = bhk / g.hkv, hk = bhk % g.hkv, grp = g.hq / g.hkv;
    i64 k0 = (i64)blockIdx.x * 64, kw = k0 + warp * 16;
    int kvalid = (int)(g.skv - k0 < 64 ? g.skv - k0 : 64);
    sKa += warp * 8 * 32 * 4;
    sVa += warp * 8 * 32 * 4;
    ft_stash_a(sKa, K + att_off(g, ATT_K, b, hk, k0), g.st[ATT_K][2], warp * 16, kvalid, (int)g.d);
    ft_stash_a(sVa, V + att_off(g, ATT_V, b, hk, k0), g.st[ATT_V][2], warp * 16, kvalid, (int)g.dv);
    float dk[8][4], dv[8][4];
#pragma unroll
    for (int nb = 0; nb < 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[nb][e] = dv[nb][e] = 0.f;
    const float sl2 = (float)g.scale * FT_LOG2E;
    i64 i_start = g.causal ? (k0 / T) * T : 0;
    for (i64 hh = 0; hh < grp; ++hh) {
        i64 h = hk * grp + hh, bh = b * g.hq + h;
        for (i64 i0 = i_start; i0 < g.sq; i0 += T) {
            int qv = (int)(g.sq - i0 < T ? g.sq - i0 : T);
            __syncthreads();
            ft_load<NP, T>(sQ, sQt, Q + att_off(g, ATT_Q, b, h, i0), g.st[ATT_Q][2], qv, (int)g.d, vec);
            ft_load<NP, T>(sY, sYt, dY + att_off(g, ATT_Y, b, h, i0), g.st[ATT_Y][2], qv, (int)g.dv, vec);
            for (int r = threadIdx.x; r < T; r += 128) {
                float x = r < qv ? lse[bh * g.sq + i0 + r] : -ft_inf();
                sL[r] = x == -ft_inf() ? ft_inf() : x * FT_LOG2E;
                sD[r] = r < qv ? delta[bh * g.sq + i0 + r] : 0.f;
            }
            __syncthreads();
            // (warp-uniform) no key of this warp, or (causal) every query before its keys
            if (kw >= g.skv || (g.causal && i0 + T - 1 < kw)) continue;
            float s[TB][4], dp[TB][4];
#pragma unroll
            for (int nb = 0; nb < TB; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nb][e] = dp[nb][e] = 0.f;
#pragma unroll
            for (int kb = 0; kb < 8; ++kb) {
                if (kb * 8 >= g.d) break;
                FtA<NP> a = ft_sa<NP>(sKa, kb);
#pragma unroll
                for (int nb = 0; nb < TB; ++nb) ft_mma_b<NP, 8>(s[nb], a, sQ, nb, kb);
            }
#pragma unroll
            for (int kb = 0; kb < 8; ++kb) {
                if (kb * 8 >= g.dv) break;
                FtA<NP> a = ft_sa<NP>(sVa, kb);
#pragma unroll
                for (int nb = 0; nb < TB; ++nb) ft_mma_b<NP, 8>(dp[nb], a, sY, nb, kb);
            }
            // (Queries past Sq have LSE +inf, so P = 0 there without a check.)
            bool edge = g.mask_kind || (g.causal && kw + 15 > i0);
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                i64 kj = kw + gq + 8 * hr;
                // Query columns qq of the tile: qq < krel come before the key.
                int krel = (int)(kj - i0 > T ? T : kj - i0), qlim = qv;
                i64 mcol = b * g.ms[0] + h * g.ms[1] + i0 * g.ms[2] + kj * g.ms[3];
#pragma unroll
                for (int nb = 0; nb < TB; ++nb)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        int qq = nb * 8 + 2 * tq + e;
                        float x = s[nb][2 * hr + e] * sl2;
                        if (edge && g.causal && qq < krel) x = -ft_inf();
                        else if (edge && g.mask_kind && qq < qlim && kj < g.skv) x = ft_mask(g, mask, mcol + qq * g.ms[2], x);
                        float p = ft_ex2(x - sL[qq]);
                        s[nb][2 * hr + e] = p;
                        dp[nb][2 * hr + e] = p * (dp[nb][2 * hr + e] - sD[qq]);
                    }
            }
            // dV += Pᵀ · dY, dK += dSᵀ · Q
#pragma unroll
            for (int kb = 0; kb < TB; ++kb) {
                FtA<NP> a = ft_acc<NP>(s[kb]);
#pragma unroll
                for (int nb = 0; nb < 8; ++nb)
                    if (nb * 8 < g.dv) ft_mma_b<NP, TB>(dv[nb], a, sYt, nb, kb);
            }
#pragma unroll
            for (int kb = 0; kb < TB; ++kb) {
                FtA<NP> a = ft_acc<NP>(dp[kb]);
#pragma unroll
                for (int nb = 0; nb < 8; ++nb)
                    if (nb * 8 < g.d) ft_mma_b<NP, TB>(dk[nb], a, sQt, nb, kb);
            }
        }
    }
    float fk[2] = {(float)g.scale, (float)g.scale}, fv[2] = {1.f, 1.f};
    ft_store(dK + att_off(g, ATT_K, b, hk, 0), g.st[ATT_K][2], dk, kw, g.skv, (int)g.d, fk);
    ft_store(dV + att_off(g, ATT_V, b, hk, 0), g.st[ATT_V][2], dv, kw, g.skv, (int)g.dv, fv);
}

// _3: 3xTF32 (f32); _1: one TF32 pass (`--dtype tf32`). Shared memory (bytes): forward
// 2 · 64·64·4·NP; dQ 3 · 64·64·4·NP + 16 KiB; dK/dV 4 · FT_TQ·64·4·NP + 2 · FT_TQ · 4 + 2 · 16 KiB.
#define INST_FT(NP, S)                                                                                                                                                                                   \
    extern "C" __global__ void __launch_bounds__(128, 2) ft_fwd_##S(AttnGeom g, const float* Q, const float* K, const float* V, const void* mask, float* Y, float* lse, int vec) {                    \
        ft_fwd<NP>(g, Q, K, V, mask, Y, lse, vec);                                                                                                                                                      \
    }                                                                                                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(128, 2) ft_dq_##S(AttnGeom g, const float* dY, const float* Q, const float* K, const float* V, const void* mask, const float* lse, const float* delta, \
                                                                    float* dQ, float* dmask, int vec) {                                                                                                  \
        ft_dq<NP>(g, dY, Q, K, V, mask, lse, delta, dQ, dmask, vec);                                                                                                                                    \
    }                                                                                                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(128, 2) ft_dkv_##S(AttnGeom g, const float* dY, const float* Q, const float* K, const float* V, const void* mask, const float* lse, const float* delta, \
                                                                     float* dK, float* dV, int vec) {                                                                                                    \
        ft_dkv<NP>(g, dY, Q, K, V, mask, lse, delta, dK, dV, vec);                                                                                                                                      \
    }
INST_FT(2, 3)
INST_FT(1, 1)
