// f32 Attention (not VarlenAttention) on tensor cores: `mma.sync.m16n8k8` with TF32
// operands and f32 accumulation, forward (with LSE) and backward (dQ, then dK/dV), for
// head sizes up to 64 (padded with zeros to 64). Used for `--dtype tf32` (NP = 1) and for
// f32 (NP = 2, 3xTF32): by default its forward, and with `--tune cuda_attention_f32=3xtf32`
// its backward too (src/backends/cuda/attention.rs f32_kernels; cuda/flash.cu's fs_*
// kernels on CUDA cores are the other choice; docs/bench-h100/attention-notes.md).
//
// Precision. NP = 2 (f32 with 3xtf32): 3xTF32, as PyTorch's f32 SDPA (the xformers /
// cutlass memory-efficient kernel: gemm_kernel_utils.h DefaultGemmType<Sm80+, float> is a
// TensorOp 16×8×8 with OpMultiplyAddFastF32): each operand x = big + small, big =
// cvt.rna.tf32(x), small = cvt.rna.tf32(x − big), and a·b ≈ small·big + big·small +
// big·big, accumulated in f32: about 21 bits of each operand instead of TF32's 10, errors
// at FP32's level. NP = 1 (`--dtype tf32`, TF32 allowed): big·big only.
//
// Layout. A warp owns 16 rows (queries: forward, dQ; keys: dK/dV); its A operands that do
// not change over the loop stay in registers (Q) or shared memory (dY; K, V); P and dS come
// from the accumulators (the k order inside a k step is free as long as A and B agree: PTX
// k = t holds column 2t, k = t + 4 column 2t + 1, so an accumulator (row, 2t | 2t+1) pair
// is directly an A fragment). B operands are f32 tiles in shared memory that cp.async
// fills one tile ahead (two stages). NP = 1 rounds everything to TF32 once — the A
// fragments when loaded, the B tiles in place when they land (ft_round_own) — so that
// its mma sections are LDS and HMMA only, eight independent accumulators in turn, without
// branches (every k block is summed, the padding being zeros; every key block of an
// entered tile too, those past the diagonal masked by selects), and it accumulates O, dQ,
// dK, dV in the tensor cores. NP = 2 splits the B tiles once when they land into big (in
// place) and small (a second buffer) TF32 halves (ft_split_own; dQ's V tile, for shared
// memory, is split per fragment), Q's split stays in registers (the forward's; the others
// split per use), the three passes go out one after another over all n blocks (ft_mma3,
// eight or more independent mma between dependent ones, no branches: masked blocks are
// summed as zeros), and long products (O, dQ, dK, dV) are summed four k blocks at a time
// in a fresh accumulator added in f32 (as cutlass's 3xTF32 "staging accumulation"): the
// tensor cores' own accumulation of small terms into large ones loses bits at f32's
// tolerance.
// The online softmax runs in the log2 domain in f32.
// LSE is stored in natural units as cuda/flash.cu's. Causal is upper-left (key j is seen
// by query i iff j ≤ i); masks bool (keep where true) or additive through AttnGeom::ms;
// rows that see no key give 0 and LSE −inf. Backward as fs_dq / fs_dkv: no atomics,
// deterministic.

#define FT_LOG2E 1.4426950408889634f
#define FT_LN2 0.6931471805599453f

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
    // Already TF32 (NP = 1): taken as is.
    __device__ __forceinline__ FtA(const float* x, int) {
#pragma unroll
        for (int i = 0; i < 4; ++i) hi[i] = x[i], lo[i] = 0.f;
    }
};
// From a fragment in registers: {a0, a1, a2, a3}, raw f32 for NP = 2, already rounded to
// TF32 (ft_round_a) for NP = 1.
template <int NP> __device__ __forceinline__ FtA<NP> ft_a(const float* x) {
    if constexpr (NP == 1) return FtA<NP>(x, 0);
    else return FtA<NP>(x[0], x[1], x[2], x[3]);
}
// From an accumulator block c (c0 = (g, 2t), c1 = (g, 2t+1), c2 = (g+8, 2t), c3 = (g+8, 2t+1)).
template <int NP> __device__ __forceinline__ FtA<NP> ft_acc(const float* c) { return FtA<NP>(c[0], c[2], c[1], c[3]); }

// Raw f32 tiles in shared memory, row-major with RS floats a row (64 columns used), filled
// by cp.async one tile ahead (for NP = 1 rounded to TF32 in place once they have landed,
// ft_round_own, so that the fragments go to the mma as read). A B fragment is read either along rows (n = tile row, k =
// tile column: one 8-byte load of columns 2t, 2t+1, conflict-free for RS ≡ 8 mod 32) or
// across them (n = tile column, k = tile row: two 4-byte loads, conflict-free for RS ≡ 4
// mod 32, 2-way for 8), and split into TF32 parts in registers.
#define FT_RN 72  // tiles read along rows (or both ways)
#define FT_RT 68  // tiles read only across rows

// Raw B fragment (b0, b1) of block (nb, kb) of a tile read along rows (TR = 0) or across
// (TR = 1).
template <int RS, int TR> __device__ __forceinline__ void ft_ldb(const float* tile, int nb, int kb, float& x0, float& x1) {
    int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    if (TR) {
        const float* p = tile + (kb * 8 + 2 * tq) * RS + nb * 8 + gq;
        x0 = p[0], x1 = p[RS];
    } else {
        float2 v = *(const float2*)(tile + (nb * 8 + gq) * RS + kb * 8 + 2 * tq);
        x0 = v.x, x1 = v.y;
    }
}

// d += A · B for B block (nb, kb). NP = 2: small·big and big·small, then big·big.
template <int NP, int RS, int TR> __device__ __forceinline__ void ft_mma_b(float* d, const FtA<NP>& a, const float* tile, int nb, int kb) {
    float x0, x1;
    ft_ldb<RS, TR>(tile, nb, kb, x0, x1);
    float h0 = NP == 1 ? x0 : ft_rna(x0), h1 = NP == 1 ? x1 : ft_rna(x1);
    if (NP == 2) {
        ft_mma(d, a.lo, h0, h1);
        ft_mma(d, a.hi, ft_rna(x0 - h0), ft_rna(x1 - h1));
    }
    ft_mma(d, a.hi, h0, h1);
}

// d[nb] += A · B(nb, kb) for the n blocks nb < min(NB, lim), k block kb. NP = 2 issues the
// three passes one after the other over all n blocks, so that consecutive mma are
// independent: a warp issues in order, and a product's three mma into one accumulator
// back to back each wait for the previous one's result.
template <int NP, int RS, int TR, int NB> __device__ __forceinline__ void ft_mma_row(float (*d)[4], const FtA<NP>& a, const float* tile, int kb, int lim) {
    if constexpr (NP == 1) {
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
            if (nb < lim) ft_mma_b<NP, RS, TR>(d[nb], a, tile, nb, kb);
    } else {
        float hi[NB][2], lo[NB][2];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            float x0 = 0.f, x1 = 0.f;
            if (nb < lim) ft_ldb<RS, TR>(tile, nb, kb, x0, x1);
            hi[nb][0] = ft_rna(x0), hi[nb][1] = ft_rna(x1);
            lo[nb][0] = ft_rna(x0 - hi[nb][0]), lo[nb][1] = ft_rna(x1 - hi[nb][1]);
        }
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
            if (nb < lim) ft_mma(d[nb], a.lo, hi[nb][0], hi[nb][1]);
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
            if (nb < lim) ft_mma(d[nb], a.hi, lo[nb][0], lo[nb][1]);
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
            if (nb < lim) ft_mma(d[nb], a.hi, hi[nb][0], hi[nb][1]);
    }
}

__device__ __forceinline__ unsigned ft_u32(const void* p) {
    unsigned r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ void ft_cp16(float* dst, const float* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(ft_u32(dst)), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void ft_cp4(float* dst, const float* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(ft_u32(dst)), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void ft_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void ft_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Starts filling tile `dst` (NR rows of RS floats) with `valid` rows of `width` columns of
// `src` (row stride `rs`), zeros elsewhere, by the CTA's NT threads: 16-byte cp.async with
// `vec` (width % 4 == 0, 16-byte aligned rows), plain element copies otherwise (rounded to
// TF32 there with RND; the cp.async ones are rounded by ft_round_own once landed).
template <int NR, int RS, int NT = 128, bool RND = false> __device__ __forceinline__ void ft_fill(float* dst, const float* src, i64 rs, int valid, int width, int vec) {
    if (vec) {
#pragma unroll
        for (int u = threadIdx.x; u < NR * 16; u += NT) {
            int r = u >> 4, c = (u & 15) * 4;
            bool in = r < valid && c < width;
            ft_cp16(dst + r * RS + c, in ? src + (i64)r * rs + c : src, in ? 16 : 0);
        }
        return;
    }
    for (int u = threadIdx.x; u < NR * 64; u += NT) {
        int r = u >> 6, c = u & 63;
        float x = r < valid && c < width ? src[(i64)r * rs + c] : 0.f;
        dst[r * RS + c] = RND ? ft_rna(x) : x;
    }
}

// Rounds to TF32 in place the 16-byte pieces of a tile that this thread's cp.async filled
// (ft_fill with `vec`; visible to this thread after its cp.async.wait_group, to the others
// after the barrier that follows).
template <int NR, int RS, int NT = 128> __device__ __forceinline__ void ft_round_own(float* t) {
#pragma unroll
    for (int u = threadIdx.x; u < NR * 16; u += NT) {
        float4* p = (float4*)(t + (u >> 4) * RS + (u & 15) * 4);
        float4 v = *p;
        *p = make_float4(ft_rna(v.x), ft_rna(v.y), ft_rna(v.z), ft_rna(v.w));
    }
}

// 3xTF32 B tiles: the 16-byte pieces of a tile that this thread's cp.async filled (or, after
// a barrier, any filling's pieces in the same pattern) split once into big (in place) and
// small (at `lo`, the same layout) TF32 halves, so that the mma read both as they are.
template <int NR, int RS, int NT = 128> __device__ __forceinline__ void ft_split_own(float* t, float* lo) {
#pragma unroll
    for (int u = threadIdx.x; u < NR * 16; u += NT) {
        int off = (u >> 4) * RS + (u & 15) * 4;
        float4 v = *(float4*)(t + off);
        float4 h = make_float4(ft_rna(v.x), ft_rna(v.y), ft_rna(v.z), ft_rna(v.w));
        *(float4*)(t + off) = h;
        *(float4*)(lo + off) = make_float4(ft_rna(v.x - h.x), ft_rna(v.y - h.y), ft_rna(v.z - h.z), ft_rna(v.w - h.w));
    }
}

// d[nb] += A · B(nb, kb) in 3xTF32 for all NB n blocks, B pre-split (big tile `hi`, small
// `lo`): the three passes one after another over the n blocks, so that NB independent mma
// separate dependent ones.
template <int RS, int TR, int NB> __device__ __forceinline__ void ft_mma3(float (*d)[4], const FtA<2>& a, const float* hi, const float* lo, int kb) {
    float bh[NB][2], bl[NB][2];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        ft_ldb<RS, TR>(hi, nb, kb, bh[nb][0], bh[nb][1]);
        ft_ldb<RS, TR>(lo, nb, kb, bl[nb][0], bl[nb][1]);
    }
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) ft_mma(d[nb], a.lo, bh[nb][0], bh[nb][1]);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) ft_mma(d[nb], a.hi, bl[nb][0], bl[nb][1]);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) ft_mma(d[nb], a.hi, bh[nb][0], bh[nb][1]);
}

// Two independent products d1 += A1 · B1(nb, kb), d2 += A2 · B2(nb, kb) (B along rows,
// pre-split) with their passes interleaved: 2·NB independent mma between dependent ones.
template <int RS, int NB> __device__ __forceinline__ void ft_mma3x2(float (*d1)[4], const FtA<2>& a1, const float* hi1, const float* lo1, float (*d2)[4], const FtA<2>& a2, const float* hi2, const float* lo2, int kb) {
    float bh[2][NB][2], bl[2][NB][2];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        ft_ldb<RS, 0>(hi1, nb, kb, bh[0][nb][0], bh[0][nb][1]);
        ft_ldb<RS, 0>(lo1, nb, kb, bl[0][nb][0], bl[0][nb][1]);
        ft_ldb<RS, 0>(hi2, nb, kb, bh[1][nb][0], bh[1][nb][1]);
        ft_ldb<RS, 0>(lo2, nb, kb, bl[1][nb][0], bl[1][nb][1]);
    }
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) ft_mma(d1[nb], a1.lo, bh[0][nb][0], bh[0][nb][1]), ft_mma(d2[nb], a2.lo, bh[1][nb][0], bh[1][nb][1]);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) ft_mma(d1[nb], a1.hi, bl[0][nb][0], bl[0][nb][1]), ft_mma(d2[nb], a2.hi, bl[1][nb][0], bl[1][nb][1]);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) ft_mma(d1[nb], a1.hi, bh[0][nb][0], bh[0][nb][1]), ft_mma(d2[nb], a2.hi, bh[1][nb][0], bh[1][nb][1]);
}

// acc[nb] += Σ_{kc < KC} A(kc) · B(nb, kc) in 3xTF32 (B read across rows, pre-split), A from
// the accumulator blocks c[kc] (P or dS), summed four k blocks at a time in a fresh
// accumulator and added in f32 (staging: the tensor cores' own accumulation of small
// products into a large sum loses bits at f32's tolerance).
template <int RS, int KC = 8> __device__ __forceinline__ void ft_staged3(float (*acc)[4], const float (*c)[4], const float* hi, const float* lo) {
#pragma unroll
    for (int k0 = 0; k0 < KC; k0 += 4) {
        float tt[8][4];
#pragma unroll
        for (int nb = 0; nb < 8; ++nb) tt[nb][0] = tt[nb][1] = tt[nb][2] = tt[nb][3] = 0.f;
#pragma unroll
        for (int kc = k0; kc < k0 + 4; ++kc) ft_mma3<RS, 1, 8>(tt, ft_acc<2>(c[kc]), hi, lo, kc);
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[nb][e] += tt[nb][e];
    }
}

// Rounds fragments kept in registers to TF32 (NP = 1: done once, not per use).
template <int N> __device__ __forceinline__ void ft_round_a(float (*a)[4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) a[i][e] = ft_rna(a[i][e]);
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
template <int NP> __device__ __forceinline__ void ft_stash_a(float* sa, const float* src, i64 rs, int r0, int valid, int width) {
    float a[8][4];
    ft_load_a(a, src, rs, r0, valid, width);
    if (NP == 1) ft_round_a<8>(a);
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) *(float4*)&sa[(kb * 32 + lane) * 4] = make_float4(a[kb][0], a[kb][1], a[kb][2], a[kb][3]);
}
template <int NP> __device__ __forceinline__ FtA<NP> ft_sa(const float* sa, int kb) {
    float4 x = *(const float4*)&sa[(kb * 32 + (threadIdx.x & 31)) * 4];
    float v[4] = {x.x, x.y, x.z, x.w};
    return ft_a<NP>(v);
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

// Scores of a warp's 16 query rows (qw + g, + 8) × the 64 keys of the tile at j0, in log2
// units: s · scale · log2 e, the mask applied, −inf past Skv and (causal) after the query.
// Tiles inside every bound skip the checks; no branch per element.
__device__ __forceinline__ void ft_scores(const AttnGeom& g, const void* mask, float (*s)[4], i64 b, i64 h, i64 qw, i64 j0, float sl2) {
    int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    int kv = (int)(g.skv - j0 < 64 ? g.skv - j0 : 64);
#pragma unroll
    for (int nb = 0; nb < 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nb][e] *= sl2;
    if (g.mask_kind) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            i64 qi = qw + gq + 8 * hh;
            if (qi >= g.sq) continue;
            i64 mrow = b * g.ms[0] + h * g.ms[1] + qi * g.ms[2] + j0 * g.ms[3];
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    int c = nb * 8 + 2 * tq + e;
                    if (c < kv) s[nb][2 * hh + e] = ft_mask(g, mask, mrow + c * g.ms[3], s[nb][2 * hh + e]);
                }
        }
    }
    if (j0 + 64 > g.skv || (g.causal && j0 + 63 > qw)) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            // Key columns c < lim of the tile are seen: c < kv, and (causal) c ≤ qi − j0.
            int lim = kv;
            if (g.causal) {
                i64 r = qw + gq + 8 * hh - j0 + 1;
                if (r < lim) lim = r < 0 ? 0 : (int)r;
            }
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    int c = nb * 8 + 2 * tq + e;
                    s[nb][2 * hh + e] = c < lim ? s[nb][2 * hh + e] : -ft_inf();
                }
        }
    }
}

// Forward: grid (query blocks of 16·W, B·Hq), W warps of 16 queries; K and V tiles of 64
// keys, two stages. Y [B,Hq,Sq,Dv] through AttnGeom's strides, LSE [B,Hq,Sq]. NP = 1 works
// on TF32-rounded tiles and fragments, computes every key block of a tile it enters (those
// past the causal diagonal or Skv become −inf) and accumulates O in the tensor cores, so
// that its mma go out eight independent ones at a time without branches between them.
#define FT_FWD_STAGE (64 * FT_RN + 64 * FT_RT)
template <int NP, int W> __device__ void ft_fwd(const AttnGeom& g, const float* Q, const float* K, const float* V, const void* mask, float* Y, float* lse, int vec) {
    constexpr int NT = 32 * W, BQ = 16 * W;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    i64 qb = g.causal ? (i64)gridDim.x - 1 - blockIdx.x : blockIdx.x;
    i64 bh = blockIdx.y, b = bh / g.hq, h = bh % g.hq, hk = h / (g.hq / g.hkv);
    i64 q0 = qb * BQ, qw = q0 + warp * 16;
    i64 kend = g.skv;
    if (g.causal && q0 + BQ < kend) kend = q0 + BQ;
    const i64 krs = g.st[ATT_K][2], vrs = g.st[ATT_V][2];
    const float* Kb = K + att_off(g, ATT_K, b, hk, 0);
    const float* Vb = V + att_off(g, ATT_V, b, hk, 0);
    // Stage s: K (read along rows: n = key, k = d), then V (across: n = dv, k = key).
    auto fill = [&](i64 t) {
        float* sK = ft_smem + (t & 1) * FT_FWD_STAGE;
        i64 j0 = t * 64;
        int kv = (int)(g.skv - j0 < 64 ? g.skv - j0 : 64);
        ft_fill<64, FT_RN, NT, NP == 1>(sK, Kb + j0 * krs, krs, kv, (int)g.d, vec);
        ft_fill<64, FT_RT, NT, NP == 1>(sK + 64 * FT_RN, Vb + j0 * vrs, vrs, kv, (int)g.dv, vec);
        ft_commit();
    };
    i64 ntiles = (kend + 63) / 64;
    fill(0);
    float qa[8][4];
    ft_load_a(qa, Q + att_off(g, ATT_Q, b, h, q0), g.st[ATT_Q][2], warp * 16, (int)(g.sq - q0 < BQ ? g.sq - q0 : BQ), (int)g.d);
    if (NP == 1) ft_round_a<8>(qa);
    float qlo[NP == 2 ? 8 : 1][4];  // 3xTF32: Q split once, big parts in qa
    if constexpr (NP == 2) {
#pragma unroll
        for (int kb = 0; kb < 8; ++kb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = qa[kb][e];
                qa[kb][e] = ft_rna(x);
                qlo[kb][e] = ft_rna(x - qa[kb][e]);
            }
    }
    // 3xTF32: the small halves of the current K and V tiles (one buffer: written after the
    // barrier that ends the previous tile's reads).
    float* sKlo = ft_smem + 2 * FT_FWD_STAGE;
    float* sVlo = sKlo + 64 * FT_RN;
    float o[8][4], m[2] = {-ft_inf(), -ft_inf()}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) o[nb][0] = o[nb][1] = o[nb][2] = o[nb][3] = 0.f;
    const float sl2 = (float)g.scale * FT_LOG2E;
    for (i64 t = 0; t < ntiles; ++t) {
        if (t + 1 < ntiles) {
            fill(t + 1);
            ft_wait<1>();
        } else {
            ft_wait<0>();
        }
        float* sK = ft_smem + (t & 1) * FT_FWD_STAGE;
        float* sV = sK + 64 * FT_RN;
        if (NP == 1 && vec) {
            ft_round_own<64, FT_RN, NT>(sK);
            ft_round_own<64, FT_RT, NT>(sV);
        }
        if constexpr (NP == 2) {
            if (!vec) __syncthreads();  // (plain stores: other threads' pieces)
            ft_split_own<64, FT_RN, NT>(sK, sKlo);
            ft_split_own<64, FT_RT, NT>(sV, sVlo);
        }
        __syncthreads();
        i64 j0 = t * 64;
        int nbl = ft_key_blocks(g, j0, qw);  // (warp-uniform) 0: every key after this warp's queries
        if (nbl > 0) {
            float s[8][4];
#pragma unroll
            for (int nb = 0; nb < 8; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
            if constexpr (NP == 1) {
#pragma unroll
                for (int kb = 0; kb < 8; ++kb) ft_mma_row<NP, FT_RN, 0, 8>(s, ft_a<NP>(qa[kb]), sK, kb, 8);
            } else {
#pragma unroll
                for (int kb = 0; kb < 8; ++kb) {
                    FtA<2> a(qa[kb], 0);
#pragma unroll
                    for (int e = 0; e < 4; ++e) a.lo[e] = qlo[kb][e];
                    ft_mma3<FT_RN, 0, 8>(s, a, sK, sKlo, kb);
                }
            }
            ft_scores(g, mask, s, b, h, qw, j0, sl2);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                float mx = m[hh];
#pragma unroll
                for (int nb = 0; nb < 8; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * hh], s[nb][2 * hh + 1]));
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
            if constexpr (NP == 1) {
                // O += P · V, straight into O (eight independent accumulators per key block)
#pragma unroll
                for (int kc = 0; kc < 8; ++kc) {
                    FtA<NP> a = ft_acc<NP>(s[kc]);
#pragma unroll
                    for (int nb = 0; nb < 8; ++nb) ft_mma_b<NP, FT_RT, 1>(o[nb], a, sV, nb, kc);
                }
            } else {
                // O += P · V, staged (every key block: those masked have P = 0)
                ft_staged3<FT_RT>(o, s, sV, sVlo);
            }
        }
        __syncthreads();  // before the next fill overwrites this stage
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

// dQ (and dMask): grid as the forward; K (read both ways) and V tiles, two stages; dY's
// A fragments stashed raw in shared memory after them.
#define FT_DQ_STAGE (2 * 64 * FT_RN)
template <int NP> __device__ void ft_dq(const AttnGeom& g, const float* dY, const float* Q, const float* K, const float* V, const void* mask, const float* lse, const float* delta, float* dQ, float* dmask, int vec) {
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
    auto fill = [&](i64 t) {
        float* sK = ft_smem + (t & 1) * FT_DQ_STAGE;
        i64 j0 = t * 64;
        int kv = (int)(g.skv - j0 < 64 ? g.skv - j0 : 64);
        ft_fill<64, FT_RN, 128, NP == 1>(sK, Kb + j0 * krs, krs, kv, (int)g.d, vec);
        ft_fill<64, FT_RN, 128, NP == 1>(sK + 64 * FT_RN, Vb + j0 * vrs, vrs, kv, (int)g.dv, vec);
        ft_commit();
    };
    i64 ntiles = (kend + 63) / 64;
    fill(0);
    float* sYa = ft_smem + 2 * FT_DQ_STAGE + warp * 8 * 32 * 4;
    // 3xTF32: the small half of the current K tile (read twice: S and dQ; V is split per
    // fragment, its small half would take the second CTA's shared memory)
    float* sKlo = ft_smem + 2 * FT_DQ_STAGE + 4 * 8 * 32 * 4;
    float qa[8][4];
    ft_load_a(qa, Q + att_off(g, ATT_Q, b, h, q0), g.st[ATT_Q][2], warp * 16, qv, (int)g.d);
    if (NP == 1) ft_round_a<8>(qa);
    ft_stash_a<NP>(sYa, dY + att_off(g, ATT_Y, b, h, q0), g.st[ATT_Y][2], warp * 16, qv, (int)g.dv);
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
    for (i64 t = 0; t < ntiles; ++t) {
        if (t + 1 < ntiles) {
            fill(t + 1);
            ft_wait<1>();
        } else {
            ft_wait<0>();
        }
        float* sK = ft_smem + (t & 1) * FT_DQ_STAGE;
        float* sV = sK + 64 * FT_RN;
        if (NP == 1 && vec) {
            ft_round_own<64, FT_RN>(sK);
            ft_round_own<64, FT_RN>(sV);
        }
        if constexpr (NP == 2) {
            if (!vec) __syncthreads();  // (plain stores: other threads' pieces)
            ft_split_own<64, FT_RN>(sK, sKlo);
        }
        __syncthreads();
        i64 j0 = t * 64;
        int kv = (int)(g.skv - j0 < 64 ? g.skv - j0 : 64);
        int nbl = ft_key_blocks(g, j0, qw);
        if (nbl > 0) {
            float s[8][4], dp[8][4];
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nb][e] = dp[nb][e] = 0.f;
            // (Head columns past d / dv are zeros in the tiles and fragments: every k block
            // is summed; NP = 1 also every key block, those past nbl being masked.)
            if constexpr (NP == 1) {
#pragma unroll
                for (int kb = 0; kb < 8; ++kb) ft_mma_row<NP, FT_RN, 0, 8>(s, ft_a<NP>(qa[kb]), sK, kb, 8);
#pragma unroll
                for (int kb = 0; kb < 8; ++kb) ft_mma_row<NP, FT_RN, 0, 8>(dp, ft_sa<NP>(sYa, kb), sV, kb, 8);
            } else {
#pragma unroll
                for (int kb = 0; kb < 8; ++kb) {
                    ft_mma3<FT_RN, 0, 8>(s, ft_a<NP>(qa[kb]), sK, sKlo, kb);
                    ft_mma_row<NP, FT_RN, 0, 8>(dp, ft_sa<NP>(sYa, kb), sV, kb, 8);
                }
            }
            ft_scores(g, mask, s, b, h, qw, j0, sl2);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                i64 qi = qw + gq + 8 * hh;
                float* drow = dmask && qi < g.sq ? dmask + (bh * g.sq + qi) * g.skv + j0 : nullptr;
#pragma unroll
                for (int nb = 0; nb < 8; ++nb)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        int c = nb * 8 + 2 * tq + e;
                        float p = ft_ex2(s[nb][2 * hh + e] - L[hh]);
                        float ds = p * (dp[nb][2 * hh + e] - Dl[hh]);
                        s[nb][2 * hh + e] = ds;
                        if (drow && c < kv) drow[c] = ds;
                    }
            }
            if constexpr (NP == 1) {
                // dQ += dS · K, straight into dQ
#pragma unroll
                for (int kc = 0; kc < 8; ++kc) {
                    FtA<NP> a = ft_acc<NP>(s[kc]);
#pragma unroll
                    for (int nb = 0; nb < 8; ++nb) ft_mma_b<NP, FT_RN, 1>(acc[nb], a, sK, nb, kc);
                }
            } else {
                // dQ += dS · K, staged (every key block: those masked have dS = 0)
                ft_staged3<FT_RN>(acc, s, sK, sKlo);
            }
        }
        __syncthreads();
    }
    float f[2] = {(float)g.scale, (float)g.scale};
    ft_store(dQ + att_off(g, ATT_Q, b, h, 0), g.st[ATT_Q][2], acc, qw, g.sq, (int)g.d, f);
}

// dK, dV: grid (key blocks of 64, B·Hkv), 4 warps of 16 keys (their K and V A fragments
// stashed raw in shared memory); over the query heads of the group (GQA) and their query
// tiles of T (32 for 3xTF32, 64 for one pass: its registers allow twice the queries per
// barrier and per A fragment read), two stages of Q and dY (read both ways), LSE and delta.
#define FT_DKV_STAGE(T) (2 * (T) * FT_RN + 2 * (T))
template <int NP, int T> __device__ void ft_dkv(const AttnGeom& g, const float* dY, const float* Q, const float* K, const float* V, const void* mask, const float* lse, const float* delta, float* dK, float* dV, int vec) {
    constexpr int TB = T / 8;
    static_assert(NP == 1 || T == 32, "3xTF32's staged sums take 4 query blocks");
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    i64 bhk = blockIdx.y, b = bhk / g.hkv, hk = bhk % g.hkv, grp = g.hq / g.hkv;
    i64 k0 = (i64)blockIdx.x * 64, kw = k0 + warp * 16;
    int kvalid = (int)(g.skv - k0 < 64 ? g.skv - k0 : 64);
    i64 i_start = g.causal ? (k0 / T) * T : 0;
    i64 nq = i_start < g.sq ? (g.sq - i_start + T - 1) / T : 0;  // query tiles per head
    // Stage s: Q, dY (T rows of FT_RN), LSE, delta (T each).
    auto fill = [&](i64 t) {
        float* sQ = ft_smem + (t & 1) * FT_DKV_STAGE(T);
        i64 h = hk * grp + t / nq, i0 = i_start + (t % nq) * T, bh = b * g.hq + h;
        int qv = (int)(g.sq - i0 < T ? g.sq - i0 : T);
        ft_fill<T, FT_RN, 128, NP == 1>(sQ, Q + att_off(g, ATT_Q, b, h, i0), g.st[ATT_Q][2], qv, (int)g.d, vec);
        ft_fill<T, FT_RN, 128, NP == 1>(sQ + T * FT_RN, dY + att_off(g, ATT_Y, b, h, i0), g.st[ATT_Y][2], qv, (int)g.dv, vec);
        int r = threadIdx.x & (T - 1);
        if (threadIdx.x < 2 * T) {
            const float* src = (threadIdx.x < T ? lse : delta) + bh * g.sq + i0;
            ft_cp4(sQ + 2 * T * FT_RN + threadIdx.x, r < qv ? src + r : src, r < qv ? 4 : 0);
        }
        ft_commit();
    };
    i64 ntiles = grp * nq;
    if (ntiles > 0) fill(0);
    float* sKa = ft_smem + 2 * FT_DKV_STAGE(T) + warp * 8 * 32 * 4;
    float* sVa = sKa + 4 * 8 * 32 * 4;
    // 3xTF32: the small halves of the current Q and dY tiles (one buffer, as the forward's)
    float* sQlo = ft_smem + 2 * FT_DKV_STAGE(T) + 2 * 4 * 8 * 32 * 4;
    float* sYlo = sQlo + T * FT_RN;
    ft_stash_a<NP>(sKa, K + att_off(g, ATT_K, b, hk, k0), g.st[ATT_K][2], warp * 16, kvalid, (int)g.d);
    ft_stash_a<NP>(sVa, V + att_off(g, ATT_V, b, hk, k0), g.st[ATT_V][2], warp * 16, kvalid, (int)g.dv);
    float dk[8][4], dv[8][4];
#pragma unroll
    for (int nb = 0; nb < 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[nb][e] = dv[nb][e] = 0.f;
    const float sl2 = (float)g.scale * FT_LOG2E;
    for (i64 t = 0; t < ntiles; ++t) {
        if (t + 1 < ntiles) {
            fill(t + 1);
            ft_wait<1>();
        } else {
            ft_wait<0>();
        }
        float* sQ = ft_smem + (t & 1) * FT_DKV_STAGE(T);
        float* sY = sQ + T * FT_RN;
        if (NP == 1 && vec) {
            ft_round_own<T, FT_RN>(sQ);
            ft_round_own<T, FT_RN>(sY);
        }
        if constexpr (NP == 2) {
            if (!vec) __syncthreads();  // (plain stores: other threads' pieces)
            ft_split_own<T, FT_RN>(sQ, sQlo);
            ft_split_own<T, FT_RN>(sY, sYlo);
        }
        __syncthreads();
        const float* sL = sY + T * FT_RN;  // LSE (natural units; −inf: the row sees nothing)
        const float* sD = sL + T;
        i64 h = hk * grp + t / nq, i0 = i_start + (t % nq) * T;
        int qv = (int)(g.sq - i0 < T ? g.sq - i0 : T);
        // (warp-uniform) no key of this warp, or (causal) every query before its keys
        if (!(kw >= g.skv || (g.causal && i0 + T - 1 < kw))) {
            float s[TB][4], dp[TB][4];
#pragma unroll
            for (int nb = 0; nb < TB; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nb][e] = dp[nb][e] = 0.f;
            if constexpr (NP == 1) {
#pragma unroll
                for (int kb = 0; kb < 8; ++kb) ft_mma_row<NP, FT_RN, 0, TB>(s, ft_sa<NP>(sKa, kb), sQ, kb, TB);  // Sᵀ = K·Qᵀ
#pragma unroll
                for (int kb = 0; kb < 8; ++kb) ft_mma_row<NP, FT_RN, 0, TB>(dp, ft_sa<NP>(sVa, kb), sY, kb, TB);  // dPᵀ = V·dYᵀ
            } else {
#pragma unroll
                for (int kb = 0; kb < 8; ++kb) ft_mma3x2<FT_RN, TB>(s, ft_sa<NP>(sKa, kb), sQ, sQlo, dp, ft_sa<NP>(sVa, kb), sY, sYlo, kb);
            }
            // (Queries past Sq: LSE slots zero-filled, rows qq ≥ qv are skipped below.)
#pragma unroll
            for (int nb = 0; nb < TB; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nb][e] *= sl2;
            if (g.mask_kind) {
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    i64 kj = kw + gq + 8 * hr;
                    i64 mcol = b * g.ms[0] + h * g.ms[1] + i0 * g.ms[2] + kj * g.ms[3];
#pragma unroll
                    for (int nb = 0; nb < TB; ++nb)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            int qq = nb * 8 + 2 * tq + e;
                            if (qq < qv && kj < g.skv) s[nb][2 * hr + e] = ft_mask(g, mask, mcol + qq * g.ms[2], s[nb][2 * hr + e]);
                        }
                }
            }
            bool edge = g.causal && kw + 15 > i0;
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                i64 kj = kw + gq + 8 * hr;
                // Query columns qq of the tile: qq < krel come before the key.
                int krel = (int)(kj - i0 > T ? T : kj - i0);
#pragma unroll
                for (int nb = 0; nb < TB; ++nb)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        int qq = nb * 8 + 2 * tq + e;
                        float x = edge && qq < krel ? -ft_inf() : s[nb][2 * hr + e];
                        float lq = sL[qq];
                        // (ex2(−inf) = 0: a query that sees no key has LSE −inf and P 0.)
                        float p = ft_ex2(x - (lq == -ft_inf() ? ft_inf() : lq * FT_LOG2E));
                        p = qq < qv ? p : 0.f;
                        s[nb][2 * hr + e] = p;
                        dp[nb][2 * hr + e] = p * (dp[nb][2 * hr + e] - sD[qq]);
                    }
            }
            // dV += Pᵀ · dY, dK += dSᵀ · Q (the tile's 32 queries summed apart, then added)
            if constexpr (NP == 1) {
                // straight into dV and dK, eight independent accumulators per query block
#pragma unroll
                for (int kb = 0; kb < TB; ++kb) {
                    FtA<NP> pa = ft_acc<NP>(s[kb]);
#pragma unroll
                    for (int nb = 0; nb < 8; ++nb) ft_mma_b<NP, FT_RN, 1>(dv[nb], pa, sY, nb, kb);
                }
#pragma unroll
                for (int kb = 0; kb < TB; ++kb) {
                    FtA<NP> da = ft_acc<NP>(dp[kb]);
#pragma unroll
                    for (int nb = 0; nb < 8; ++nb) ft_mma_b<NP, FT_RN, 1>(dk[nb], da, sQ, nb, kb);
                }
            } else {
                ft_staged3<FT_RN, TB>(dv, s, sY, sYlo);
                ft_staged3<FT_RN, TB>(dk, dp, sQ, sQlo);
            }
        }
        __syncthreads();
    }
    float fk[2] = {(float)g.scale, (float)g.scale}, fv[2] = {1.f, 1.f};
    ft_store(dK + att_off(g, ATT_K, b, hk, 0), g.st[ATT_K][2], dk, kw, g.skv, (int)g.d, fk);
    ft_store(dV + att_off(g, ATT_V, b, hk, 0), g.st[ATT_V][2], dv, kw, g.skv, (int)g.dv, fv);
}

// _3: 3xTF32 (f32); _1: one TF32 pass (`--dtype tf32`). Shared memory (floats): forward
// 2 stages of FT_FWD_STAGE; dQ 2 of FT_DQ_STAGE + 4 warps' dY fragments (4096); dK/dV 2 of
// FT_DKV_STAGE(T) + 4 warps' K and V fragments (8192).
#define INST_FT(NP, S, W, MB)                                                                                                                                                                               \
    extern "C" __global__ void __launch_bounds__(32 * W, MB) ft_fwd_##S(AttnGeom g, const float* Q, const float* K, const float* V, const void* mask, float* Y, float* lse, int vec) {             \
        ft_fwd<NP, W>(g, Q, K, V, mask, Y, lse, vec);                                                                                                                                                   \
    }                                                                                                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(128, 2) ft_dq_##S(AttnGeom g, const float* dY, const float* Q, const float* K, const float* V, const void* mask, const float* lse, const float* delta, \
                                                                    float* dQ, float* dmask, int vec) {                                                                                                  \
        ft_dq<NP>(g, dY, Q, K, V, mask, lse, delta, dQ, dmask, vec);                                                                                                                                    \
    }                                                                                                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(128, 2) ft_dkv_##S(AttnGeom g, const float* dY, const float* Q, const float* K, const float* V, const void* mask, const float* lse, const float* delta, \
                                                                     float* dK, float* dV, int vec) {                                                                                                    \
        ft_dkv<NP, NP == 1 ? 64 : 32>(g, dY, Q, K, V, mask, lse, delta, dK, dV, vec);                                                                                                                                      \
    }
INST_FT(2, 3, 4, 2)
INST_FT(1, 1, 8, 2)
