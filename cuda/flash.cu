// Tiled flash attention for Attention (not VarlenAttention), forward and backward.
//
// f16/bf16: tensor cores through `mma.sync.m16n8k16` (f32 accumulation), operands fed by
// `ldmatrix` from shared memory tiles that `cp.async` fills one tile ahead. A warp owns 16
// query rows (forward, dQ) or 16 key rows (dK/dV); S, P, dP and dS never leave registers:
// the accumulator layout of one mma is the A-operand layout of the next (FlashAttention-2).
// The online softmax runs in the log2 domain (one FFMA and an ex2 per score).
// On Hopper (sm_90a) heads up to 64 take the `_wg` kernels instead: warpgroup `wgmma`
// (operands from the swizzled shared tiles through descriptors, P/dS from registers; see
// Wg below), software-pipelined so that a tile's softmax runs under the previous tile's
// products (fa_fwd_wg). The forward there is warp-specialized and persistent (fa_fwd_wsp: a
// producer warpgroup streams K/V into an mbarrier ring for three consumer warpgroups, one CTA
// an SM taking item after item; fa_fwd_wg stays as `--tune cuda_attention=wg`).
// All kernels address Q, K, V, Y and their gradients through the strides of AttnGeom
// (batch, head, row; the head vector contiguous).
// f32 (and tf32 mode): the same tiling on CUDA cores in true FP32, each product a 64×64
// tile of shared memory (4×4 outputs per thread, float4 operand reads).
//
// Head sizes are padded with zeros to DP (64 or 128; 64 for f32); rows past the end are
// zero-filled, so any Sq, Skv, D, Dv ≤ DP work. Backward is FlashAttention-2 with dQ in
// its own pass (recomputing P per query tile) so that no two CTAs write one element: no
// atomics, the result is deterministic. On sm_90a (heads up to 64) the host takes the
// one-pass backward instead (fa_bwd_wg: dQ summed in f32 by atomics, not deterministic).
// Causal is upper-left (key j is seen by query i iff j ≤ i), as the CPU's Attention. Masks: bool (keep where true) or additive, broadcast
// through `AttnGeom::ms`.

// Dynamic shared memory of every kernel here.
extern __shared__ __align__(128) unsigned char fa_smem[];

// The dynamic shared memory from its first 1024-byte boundary (the swizzle pattern that
// wgmma reads repeats every 1024 bytes of address); hosts ask for 1 KiB more.
__device__ __forceinline__ unsigned char* fa_base();

#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ unsigned char* fa_base() {
    unsigned a = smem_u32(fa_smem);
    return fa_smem + (((a + 1023u) & ~1023u) - a);
}
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ void ldsm4(unsigned a, unsigned* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}
__device__ __forceinline__ void ldsm4t(unsigned a, unsigned* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}
// (ftz: one MUFU.EX2, without the subnormal fix-ups around it; results below 2^-126 of the
// row's largest weight are 0.)
__device__ __forceinline__ float fa_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The 16-bit element types' mma and packing.
template <class T> struct Mma;
template <> struct Mma<bf16> {
    static __device__ __forceinline__ void run(float* d, const unsigned* a, unsigned b0, unsigned b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // lo goes to the low half (the lower column index).
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        unsigned r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};
template <> struct Mma<f16> {
    static __device__ __forceinline__ void run(float* d, const unsigned* a, unsigned b0, unsigned b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        unsigned r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};

// Hopper (compiled for sm_90a): warpgroup MMA. `wgmma.mma_async.m64n64k16` computes a
// 64 × 64 product for the 4 warps of a warpgroup; warp w supplies A rows 16w..16w+15 in
// the same register layout as `mma.sync.m16n8k16`'s A and gets the same rows of D in the
// layout of eight m16n8 accumulators, so a warp's code around it keeps its 16 rows. B comes
// from shared memory through a descriptor: the 64-column tiles here (128-byte rows, 16-byte
// chunks XORed with row & 7, 1024-byte aligned) are exactly the 128-byte swizzle pattern.
// Elsewhere (other GPUs, or the `_mma` kernels kept to compare) the same code runs on
// `mma.sync`.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FA_HAVE_WG 1
#else
#define FA_HAVE_WG 0
#endif

// Descriptor of a 128-byte-swizzled operand at `addr`: `lbo` between 64-column blocks
// (MN-major; unused K-major), `sbo` between groups of 8 rows.
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)(lbo >> 4) << 16) | ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}
// B = Kᵀ-like: rows n (64 of them) of a tile whose columns are the reduction; k step `kc`
// of 16 columns is 32 bytes into the swizzled row.
__device__ __forceinline__ unsigned long long wg_desc_k(unsigned base, int kc) { return wg_desc(base + kc * 32, 16, 1024); }
// B = V-like: rows are the reduction (16 per k step, 2048 bytes), 64 columns the outputs.
__device__ __forceinline__ unsigned long long wg_desc_mn(unsigned base, int kc) { return wg_desc(base + kc * 2048, 8192, 1024); }

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Waits until at most n (a constant after inlining) committed groups are pending.
__device__ __forceinline__ void wg_wait_n(int n) {
    if (n <= 0) asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    else if (n == 1) asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
    else if (n == 2) asm volatile("wgmma.wait_group.sync.aligned 2;" ::: "memory");
    else asm volatile("wgmma.wait_group.sync.aligned 3;" ::: "memory");
}
// The same behind a branch the compiler cannot fold (g.hq > 0 always holds): ptxas hoists the
// waits of a basic block to its top, ahead of the softmax work meant to overlap the products.
__device__ __forceinline__ void wg_wait_late(const AttnGeom& g, int n) {
    if (g.hq > 0) wg_wait_n(n);
    else wg_wait_n(0);
}
// Keeps the compiler from touching accumulators between an mma_async and its wait.
__device__ __forceinline__ void wg_keep(float (*d)[4]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) asm volatile("" : "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])::"memory");
}
// The same for A fragments in registers: they stay untouched (and their registers not
// reused: ptxas did, see fa_fwd) until the wait.
__device__ __forceinline__ void wg_keep_a(unsigned (*a)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[i][0]), "+r"(a[i][1]), "+r"(a[i][2]), "+r"(a[i][3])::"memory");
}
// Shared memory written by ordinary stores or cp.async and read next by wgmma needs this in
// each writing thread before the barrier.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// The 32 accumulators of one m64n64 wgmma (this warp's 16 rows × 64 columns).
#define FA_WG_D                                                                                              \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), \
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define FA_WG_DREGS "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
// A from registers (this warp's 16 rows, mma.sync A layout); `acc` = 0 overwrites D.
#define FA_WGMMA_BODY(TY)                                                                                  \
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %38, 0;\n"                                               \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " FA_WG_DREGS ", "            \
                 "{%32,%33,%34,%35}, %36, p, 1, 1, %37; }"                                                \
                 : FA_WG_D                                                                                 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TB), "r"(acc))
// A from shared memory too (K-major, 128-byte swizzle: the 64 rows of the warpgroup).
#define FA_WGMMA_SS_BODY(TY)                                                                               \
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %35, 0;\n"                                               \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " FA_WG_DREGS ", "            \
                 "%32, %33, p, 1, 1, 0, %34; }"                                                            \
                 : FA_WG_D                                                                                 \
                 : "l"(adesc), "l"(desc), "n"(TB), "r"(acc))
// d[8][4] (64 columns) (+)= A · B(desc); TB = 1: B is MN-major (rows are the reduction).
template <class T, int TB> struct Wg;
template <int TB> struct Wg<bf16, TB> {
    static __device__ __forceinline__ void run(float (*d)[4], const unsigned* a, unsigned long long desc, int acc = 1) {
#if FA_HAVE_WG
        FA_WGMMA_BODY("bf16");
#endif
    }
    static __device__ __forceinline__ void ss(float (*d)[4], unsigned long long adesc, unsigned long long desc, int acc) {
#if FA_HAVE_WG
        FA_WGMMA_SS_BODY("bf16");
#endif
    }
};
template <int TB> struct Wg<f16, TB> {
    static __device__ __forceinline__ void run(float (*d)[4], const unsigned* a, unsigned long long desc, int acc = 1) {
#if FA_HAVE_WG
        FA_WGMMA_BODY("f16");
#endif
    }
    static __device__ __forceinline__ void ss(float (*d)[4], unsigned long long adesc, unsigned long long desc, int acc) {
#if FA_HAVE_WG
        FA_WGMMA_SS_BODY("f16");
#endif
    }
};

// m64n128k16 with both operands from shared memory (K-major, 128-byte swizzle): d[16][4]
// is two m64n64 accumulators side by side (columns 0..63, 64..127). The warp-specialized
// forward's S = Q·Kᵀ over 128 keys: each A (Q) read from shared memory feeds twice the
// columns of two m64n64 products.
#define FA_WG_D128 \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
    "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
    "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
    "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
    "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
    "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
    "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
    "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
#define FA_WG_DREGS128 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define FA_WGMMA128_SS_BODY(TY)                                                                           \
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"                                              \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " FA_WG_DREGS128 ", "         \
                 "%64, %65, p, 1, 1, 0, 0; }"                                                             \
                 : FA_WG_D128                                                                              \
                 : "l"(adesc), "l"(desc), "r"(acc))
template <class T> struct Wg128;
template <> struct Wg128<bf16> {
    static __device__ __forceinline__ void ss(float (*d)[4], unsigned long long adesc, unsigned long long desc, int acc) {
#if FA_HAVE_WG
        FA_WGMMA128_SS_BODY("bf16");
#endif
    }
};
template <> struct Wg128<f16> {
    static __device__ __forceinline__ void ss(float (*d)[4], unsigned long long adesc, unsigned long long desc, int acc) {
#if FA_HAVE_WG
        FA_WGMMA128_SS_BODY("f16");
#endif
    }
};

// A fragments (16 × 64, four k steps) from a 16 × 64 accumulator `p` (P, dS, ...).
template <class T> __device__ __forceinline__ void pack_a(unsigned (*a)[4], const float (*p)[4]) {
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) {
        a[kc][0] = Mma<T>::pack(p[2 * kc][0], p[2 * kc][1]);
        a[kc][1] = Mma<T>::pack(p[2 * kc][2], p[2 * kc][3]);
        a[kc][2] = Mma<T>::pack(p[2 * kc + 1][0], p[2 * kc + 1][1]);
        a[kc][3] = Mma<T>::pack(p[2 * kc + 1][2], p[2 * kc + 1][3]);
    }
}

// Shared-memory tiles of 16-bit elements, DP per row, stored in 16-byte chunks whose index
// is XORed with (row & 7): the 8 rows one ldmatrix reads hit 8 different bank groups.
template <int DP> __device__ __forceinline__ unsigned sw_addr(unsigned base, int row, int chunk) {
    return base + (unsigned)(row * DP + ((chunk ^ (row & 7)) << 3)) * 2u;
}

// Loads rows [0, rows) of a tile (`valid` of them real, the rest zero) of `width` columns
// (zero-padded to DP) from `src` (row stride `rs` elements) into the swizzled tile at
// `base`. With `vec`, 16-byte cp.async (width % 8 == 0, 16-byte aligned rows); otherwise
// element by element (small or odd head sizes).
template <int DP, int NT> __device__ __forceinline__ void load_tile(unsigned base, const unsigned short* src, i64 rs, int rows, int valid, int width, int vec) {
    constexpr int CPR = DP / 8;      // chunks per row
    constexpr int RSTEP = NT / CPR;  // rows per pass of the block
    static_assert(NT % CPR == 0 && RSTEP % 8 == 0, "tile passes must keep the swizzle");
    if (vec) {
        // A thread's chunks are rows r0 + k·RSTEP of one column chunk: same swizzle, so the
        // addresses only move by constants (the rows are compile-time constants: unrolled).
        int c = threadIdx.x % CPR, r0 = threadIdx.x / CPR;
        bool cok = c * 8 < width;
        const unsigned short* s = src + r0 * rs + c * 8;
        unsigned dst = sw_addr<DP>(base, r0, c);
#pragma unroll
        for (int k = 0; k < rows / RSTEP; ++k) {
            bool ok = cok && r0 + k * RSTEP < valid;
            cp_async16(dst + k * RSTEP * DP * 2, ok ? s + k * RSTEP * rs : src, ok ? 16 : 0);
        }
        return;
    }
    for (int idx = threadIdx.x; idx < rows * CPR; idx += NT) {
        int r = idx / CPR, c = idx % CPR;
        unsigned dst = sw_addr<DP>(base, r, c);
        bool ok = r < valid && c * 8 < width;
        {
            unsigned w[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int c0 = c * 8 + 2 * e;
                unsigned lo = (ok && c0 < width) ? src[r * rs + c0] : 0;
                unsigned hi = (ok && c0 + 1 < width) ? src[r * rs + c0 + 1] : 0;
                w[e] = lo | (hi << 16);
            }
            asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};" ::"r"(dst), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
        }
    }
}

// A fragments (16 rows × DP) of the warp's rows `r0..r0+16` of a tile.
template <int DP> __device__ __forceinline__ void load_afrag(unsigned base, int r0, unsigned (*a)[4]) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int kc = 0; kc < DP / 16; ++kc)
        ldsm4(sw_addr<DP>(base, r0 + (lane & 7) + ((lane >> 3) & 1) * 8, kc * 2 + (lane >> 4)), a[kc]);
}

// acc[n-block][4] += A(16 × DP) · Bᵀ where B is 64 rows × DP of a tile (rows n0..n0+64):
// S = Q·Kᵀ, dP = dY·Vᵀ and their transposes.
template <class T, int DP> __device__ __forceinline__ void mma_abt(float (*acc)[4], const unsigned (*a)[4], unsigned base, int n0) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int nb2 = 0; nb2 < 4; ++nb2) {
#pragma unroll
        for (int kc = 0; kc < DP / 16; ++kc) {
            unsigned b[4];
            ldsm4(sw_addr<DP>(base, n0 + nb2 * 16 + (lane & 7) + (lane >> 4) * 8, kc * 2 + ((lane >> 3) & 1)), b);
            Mma<T>::run(acc[2 * nb2], a[kc], b[0], b[1]);
            Mma<T>::run(acc[2 * nb2 + 1], a[kc], b[2], b[3]);
        }
    }
}

// acc[DP/8][4] += P(16 × 64, accumulator layout `p`) · B where B is 64 rows × DP of a tile
// (O += P·V, dV += Pᵀ·dY, dQ += dS·K, dK += dSᵀ·Q).
template <class T, int DP> __device__ __forceinline__ void mma_pb(float (*acc)[4], const float (*p)[4], unsigned base) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) {
        unsigned a[4];
        a[0] = Mma<T>::pack(p[2 * kc][0], p[2 * kc][1]);
        a[1] = Mma<T>::pack(p[2 * kc][2], p[2 * kc][3]);
        a[2] = Mma<T>::pack(p[2 * kc + 1][0], p[2 * kc + 1][1]);
        a[3] = Mma<T>::pack(p[2 * kc + 1][2], p[2 * kc + 1][3]);
#pragma unroll
        for (int nd2 = 0; nd2 < DP / 16; ++nd2) {
            unsigned b[4];
            ldsm4t(sw_addr<DP>(base, kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, nd2 * 2 + (lane >> 4)), b);
            Mma<T>::run(acc[2 * nd2], a, b[0], b[1]);
            Mma<T>::run(acc[2 * nd2 + 1], a, b[2], b[3]);
        }
    }
}

// The wgmma form of mma_pb (DP = 64, a whole warpgroup, the same tile for its 4 warps, A
// from registers): it only issues; the caller fences, commits and waits, so that several
// products share one wait. (The A·Bᵀ products take both operands from shared memory:
// Wg::ss.)
template <class T> __device__ __forceinline__ void wg_pb(float (*acc)[4], const unsigned (*a)[4], unsigned base) {
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) Wg<T, 1>::run(acc, a[kc], wg_desc_mn(base, kc));
}

// The additive (in log2 units) or bool mask at `off`: x stays, moves, or becomes -inf.
template <class T> __device__ __forceinline__ float fa_mask(const AttnGeom& g, const void* mask, i64 off, float x) {
    if (g.mask_kind == 1) return ((const unsigned char*)mask)[off] ? x : neg_inf(x);
    return x + ld(((const T*)mask)[off]) * FA_LOG2E;
}

// Masks a 16×64 score tile in accumulator layout (already in log2 units): this thread's
// rows are r0 and r0 + 8 (r0 includes its lane group), the tile's columns c0 + 0..64. `trans` = 0: rows are queries, columns keys
// (forward, dQ); 1: rows are keys, columns queries (dK/dV). Keys past Skv, keys after the
// query (causal) and mask-false entries become -inf; an additive mask is added.
template <class T, bool MASK> __device__ __forceinline__ void fa_edge(const AttnGeom& g, float (*s)[4], const void* mask, i64 b, i64 h, i64 r0, i64 c0, int trans) {
    int tq = threadIdx.x & 3;
    // key − query for (row r0, column c0), and the number of valid keys from c0 (trans 0).
    i64 dd = trans ? r0 - c0 : c0 - r0;
    int diff = (int)(dd < -(1 << 30) ? -(1 << 30) : dd > (1 << 30) ? (1 << 30) : dd);
    i64 kl = g.skv - c0;
    int klim = (int)(kl > 64 ? 64 : kl);
#pragma unroll
    for (int nb = 0; nb < 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int c = nb * 8 + 2 * tq + (e & 1), rr = (e >> 1) * 8;
            // key − query of this element
            int kq = trans ? diff + rr - c : diff + c - rr;
            bool out = (g.causal && kq > 0) || (!trans && c >= klim);
            if (out) s[nb][e] = neg_inf(0.f);
        }
    if (!MASK) return;
    i64 sq_stride = g.ms[2], sk_stride = g.ms[3];
    i64 base = b * g.ms[0] + h * g.ms[1];
#pragma unroll
    for (int nb = 0; nb < 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int c = nb * 8 + 2 * tq + (e & 1), rr = (e >> 1) * 8;
            i64 qi = trans ? c0 + c : r0 + rr, kj = trans ? r0 + rr : c0 + c;
            if (qi >= g.sq || kj >= g.skv || s[nb][e] == neg_inf(0.f)) continue;
            s[nb][e] = fa_mask<T>(g, mask, base + qi * sq_stride + kj * sk_stride, s[nb][e]);
        }
}

// Stores four 8 × 8 matrices of 16-bit elements (the A-fragment layout of mma.sync: lane
// 8i..8i+7 gives the row addresses of matrix i).
__device__ __forceinline__ void stsm4(unsigned a, const unsigned* r) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};" ::"r"(a), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
// The warp's 16 rows from r0 of a swizzled 64-column tile, from A fragments (the inverse
// of load_afrag).
__device__ __forceinline__ void store_afrag64(unsigned base, int r0, const unsigned (*a)[4]) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) stsm4(sw_addr<64>(base, r0 + (lane & 7) + ((lane >> 3) & 1) * 8, kc * 2 + (lane >> 4)), a[kc]);
}
// Stores a 16 × DP accumulator (rows row0 + g, row0 + g + 8; row stride `rs`) times
// per-row factors.
template <class T, int DP> __device__ __forceinline__ void store_acc(T* dst, i64 rs, const float (*acc)[4], i64 row0, i64 nrows, int width, float f0, float f1) {
    int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        i64 r = row0 + gq + half * 8;
        if (r >= nrows) continue;
        float f = half ? f1 : f0;
#pragma unroll
        for (int nd = 0; nd < DP / 8; ++nd) {
            int c = nd * 8 + 2 * tq;
            if (c < width) dst[r * rs + c] = st<T>(acc[nd][2 * half] * f);
            if (c + 1 < width) dst[r * rs + c + 1] = st<T>(acc[nd][2 * half + 1] * f);
        }
    }
}

// A named barrier of the 128 threads of one warpgroup.
__device__ __forceinline__ void fa_wg_bar(int id) { asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory"); }

// Stores a warpgroup's 64 × 64 accumulator (this warp's rows 16·warp .. + 15) times the row
// factors f0 / f1 (rows gq / gq + 8) to rows row0 .. row0 + 63 of `dst` (row stride `rs`;
// rows ≥ nrows left out): packed to 16-bit pairs, stmatrix'd into the warpgroup's swizzled
// 8 KiB tile at `buf` (free by now), then, after the warpgroup's named barrier `bar`, one
// 16-byte store per 8 columns of a row (4 a thread). Needs `vec` and 64 columns; otherwise
// store_acc. (store_acc's 16-bit stores, each waiting for the one before, took ~18 % of the
// consumers' time in ncu's warp-stall sampling of the warp-specialized kernels.)
template <class T> __device__ __forceinline__ void store_tile_wg(T* dst, i64 rs, const float (*acc)[4], i64 row0, i64 nrows, int width, int vec, float f0, float f1, unsigned buf, int bar) {
    const int warp = (threadIdx.x >> 5) & 3, t = threadIdx.x & 127;
    if (!vec || width != 64) {
        store_acc<T, 64>(dst, rs, acc, row0 + warp * 16, nrows, width, f0, f1);
        return;
    }
    float x[8][4];
#pragma unroll
    for (int nd = 0; nd < 8; ++nd) {
        x[nd][0] = acc[nd][0] * f0;
        x[nd][1] = acc[nd][1] * f0;
        x[nd][2] = acc[nd][2] * f1;
        x[nd][3] = acc[nd][3] * f1;
    }
    unsigned a[4][4];
    pack_a<T>(a, x);
    store_afrag64(buf, warp * 16, a);
    fa_wg_bar(bar);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int r = (t >> 3) + 16 * k, ch = t & 7;
        if (row0 + r < nrows) {
            unsigned v0, v1, v2, v3;
            asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];" : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3) : "r"(sw_addr<64>(buf, r, ch)) : "memory");
            asm volatile("st.global.v4.b32 [%0], {%1,%2,%3,%4};" ::"l"(dst + (row0 + r) * rs + ch * 8), "r"(v0), "r"(v1), "r"(v2), "r"(v3) : "memory");
        }
    }
}

// One key tile of the online softmax for a warp's 16 rows (this thread's gq and gq + 8):
// `s` times `mul` (log2 units, masked) becomes P; m and l move on; a[2] is what O is to be
// multiplied by. mul > 0: the scale moves into the exponent's FFMA (no mask to add).
__device__ __forceinline__ void fa_online(float (*s)[4], float* m, float* l, float* a, float mul) {
    float mx0 = neg_inf(0.f), mx1 = neg_inf(0.f);
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {
        mx0 = fmaxf(mx0, fmaxf(s[nb][0], s[nb][1]));
        mx1 = fmaxf(mx1, fmaxf(s[nb][2], s[nb][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    mx0 = fmaxf(m[0], mx0 * mul);
    mx1 = fmaxf(m[1], mx1 * mul);
    // A row that has seen only masked keys keeps m = -inf: measure from 0 instead.
    float ref0 = mx0 == neg_inf(mx0) ? 0.f : mx0, ref1 = mx1 == neg_inf(mx1) ? 0.f : mx1;
    a[0] = fa_ex2(m[0] - ref0);
    a[1] = fa_ex2(m[1] - ref1);
    m[0] = mx0;
    m[1] = mx1;
    float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {
        s[nb][0] = fa_ex2(fmaf(s[nb][0], mul, -ref0));
        s[nb][1] = fa_ex2(fmaf(s[nb][1], mul, -ref0));
        s[nb][2] = fa_ex2(fmaf(s[nb][2], mul, -ref1));
        s[nb][3] = fa_ex2(fmaf(s[nb][3], mul, -ref1));
        ps0 += s[nb][0] + s[nb][1];
        ps1 += s[nb][2] + s[nb][3];
    }
    l[0] = l[0] * a[0] + ps0;
    l[1] = l[1] * a[1] + ps1;
}

// Y and LSE of a warp's 16 rows from row0 (O not yet divided by l).
// WG (fa_fwd_wsp): Y through the warpgroup's tile at `buf` (store_tile_wg, barrier `bar`).
template <class T, int DP, bool WG = false> __device__ __forceinline__ void fa_finish(const AttnGeom& g, T* Y, float* lse, i64 b, i64 h, i64 bh, const float (*o)[4], i64 row0, const float* m, const float* l_, int vec = 0, unsigned buf = 0, int bar = 0) {
    int tq = threadIdx.x & 3, gq = (threadIdx.x & 31) >> 2;
    float l0 = l_[0], l1 = l_[1];
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    // A row that sees no key gives 0 and LSE -inf.
    const float f0 = l0 > 0.f ? 1.f / l0 : 0.f, f1 = l1 > 0.f ? 1.f / l1 : 0.f;
    if constexpr (WG) store_tile_wg<T>(Y + att_off(g, ATT_Y, b, h, 0), g.st[ATT_Y][2], o, row0 - 16 * ((threadIdx.x >> 5) & 3), g.sq, (int)g.dv, vec, f0, f1, buf, bar);
    else store_acc<T, DP>(Y + att_off(g, ATT_Y, b, h, 0), g.st[ATT_Y][2], o, row0, g.sq, (int)g.dv, f0, f1);
    i64 r0 = row0 + gq, r1 = r0 + 8;
    if (lse && tq == 0) {
        if (r0 < g.sq) lse[bh * g.sq + r0] = l0 > 0.f ? (m[0] + log2f(l0)) * FA_LN2 : neg_inf(0.f);
        if (r1 < g.sq) lse[bh * g.sq + r1] = l1 > 0.f ? (m[1] + log2f(l1)) * FA_LN2 : neg_inf(0.f);
    }
}

#define FA_BQ 128  // forward: query rows per CTA (8 warps × 16)
#define FA_BK 64   // keys per tile
#define FB_B 64    // backward: rows per CTA and per tile (4 warps × 16)

// Forward on mma.sync: grid (query blocks, B·Hq). Heads up to 64: 4 warps of 32 query
// rows (two m16 tiles: each K/V fragment read from shared memory feeds both, halving
// shared-memory traffic per mma); up to 128: 8 warps of 16 rows (registers). Y [B,Hq,Sq,Dv]
// (strided), LSE [B,Hq,Sq] f32.
#define FA_MT(DP) ((DP) == 64 ? 2 : 1)
template <class T, int DP, bool MASK> __device__ void fa_fwd(const AttnGeom& g, const T* Q, const T* K, const T* V, const void* mask, T* Y, float* lse, int vec) {
    constexpr int MT = FA_MT(DP), NT = FA_BQ / (16 * MT) * 32;  // threads
    unsigned sQ = smem_u32(fa_base());
    unsigned sK = sQ + FA_BQ * DP * 2, sV = sK + 2 * FA_BK * DP * 2;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2;
    i64 qb = g.causal ? (i64)gridDim.x - 1 - blockIdx.x : blockIdx.x;
    i64 bh = blockIdx.y, b = bh / g.hq, h = bh % g.hq, hk = h / (g.hq / g.hkv);
    i64 q0 = qb * FA_BQ;
    int qvalid = (int)(g.sq - q0 < FA_BQ ? g.sq - q0 : FA_BQ);
    i64 kend = g.skv;
    if (g.causal && q0 + FA_BQ < kend) kend = q0 + FA_BQ;
    int ntiles = (int)((kend + FA_BK - 1) / FA_BK);
    const i64 krs = g.st[ATT_K][2], vrs = g.st[ATT_V][2];
    const unsigned short* Kb = (const unsigned short*)K + att_off(g, ATT_K, b, hk, 0);
    const unsigned short* Vb = (const unsigned short*)V + att_off(g, ATT_V, b, hk, 0);
    load_tile<DP, NT>(sQ, (const unsigned short*)Q + att_off(g, ATT_Q, b, h, q0), g.st[ATT_Q][2], FA_BQ, qvalid, (int)g.d, vec);
    if (ntiles > 0) {
        int kv = (int)(g.skv < FA_BK ? g.skv : FA_BK);
        load_tile<DP, NT>(sK, Kb, krs, FA_BK, kv, (int)g.d, vec);
        load_tile<DP, NT>(sV, Vb, vrs, FA_BK, kv, (int)g.dv, vec);
    }
    cp_commit();
    cp_wait_all();
    __syncthreads();
    // The warp's rows: r0 + mt·16 + (gq, gq + 8).
    int r0 = warp * 16 * MT;
    unsigned qa[MT][DP / 16][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) load_afrag<DP>(sQ, r0 + mt * 16, qa[mt]);
    float o[MT][DP / 8][4];
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < DP / 8; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
        m[mt][0] = m[mt][1] = neg_inf(0.f);
        l[mt][0] = l[mt][1] = 0.f;
    }
    const float sl2 = (float)g.scale * FA_LOG2E;
    for (int t = 0; t < ntiles; ++t) {
        if (t > 0) {
            cp_wait_all();
            __syncthreads();
        }
        if (t + 1 < ntiles) {
            i64 j0 = (i64)(t + 1) * FA_BK;
            int kv = (int)(g.skv - j0 < FA_BK ? g.skv - j0 : FA_BK);
            unsigned off = ((t + 1) & 1) * FA_BK * DP * 2;
            load_tile<DP, NT>(sK + off, Kb + j0 * krs, krs, FA_BK, kv, (int)g.d, vec);
            load_tile<DP, NT>(sV + off, Vb + j0 * vrs, vrs, FA_BK, kv, (int)g.dv, vec);
        }
        cp_commit();
        unsigned off = (t & 1) * FA_BK * DP * 2;
        float s[MT][8][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < 8; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
        // S = Q·Kᵀ: each K fragment feeds every m tile.
#pragma unroll
        for (int nb2 = 0; nb2 < 4; ++nb2) {
#pragma unroll
            for (int kc = 0; kc < DP / 16; ++kc) {
                unsigned bb[4];
                ldsm4(sw_addr<DP>(sK + off, nb2 * 16 + (lane & 7) + (lane >> 4) * 8, kc * 2 + ((lane >> 3) & 1)), bb);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Mma<T>::run(s[mt][2 * nb2], qa[mt][kc], bb[0], bb[1]);
                    Mma<T>::run(s[mt][2 * nb2 + 1], qa[mt][kc], bb[2], bb[3]);
                }
            }
        }
        i64 j0 = (i64)t * FA_BK;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            i64 row0 = q0 + r0 + mt * 16 + gq;
            bool edge = MASK || j0 + FA_BK > g.skv || (g.causal && j0 + FA_BK - 1 > q0 + r0 + mt * 16);
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nb][e] *= sl2;
            if (edge) fa_edge<T, MASK>(g, s[mt], mask, b, h, row0, j0, 0);
            float a[2];
            fa_online(s[mt], m[mt], l[mt], a, 1.f);
#pragma unroll
            for (int nd = 0; nd < DP / 8; ++nd) {
                o[mt][nd][0] *= a[0];
                o[mt][nd][1] *= a[0];
                o[mt][nd][2] *= a[1];
                o[mt][nd][3] *= a[1];
            }
        }
        // O += P·V: each V fragment feeds every m tile.
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) {
            unsigned pa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                pa[mt][0] = Mma<T>::pack(s[mt][2 * kc][0], s[mt][2 * kc][1]);
                pa[mt][1] = Mma<T>::pack(s[mt][2 * kc][2], s[mt][2 * kc][3]);
                pa[mt][2] = Mma<T>::pack(s[mt][2 * kc + 1][0], s[mt][2 * kc + 1][1]);
                pa[mt][3] = Mma<T>::pack(s[mt][2 * kc + 1][2], s[mt][2 * kc + 1][3]);
            }
#pragma unroll
            for (int nd2 = 0; nd2 < DP / 16; ++nd2) {
                unsigned bb[4];
                ldsm4t(sw_addr<DP>(sV + off, kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, nd2 * 2 + (lane >> 4)), bb);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Mma<T>::run(o[mt][2 * nd2], pa[mt], bb[0], bb[1]);
                    Mma<T>::run(o[mt][2 * nd2 + 1], pa[mt], bb[2], bb[3]);
                }
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) fa_finish<T, DP>(g, Y, lse, b, h, bh, o[mt], q0 + r0 + mt * 16, m[mt], l[mt]);
}

// Forward on wgmma (sm_90a, heads up to 64): grid (query blocks of 128, B·Hq), one
// warpgroup. Q and K are both read by wgmma from their swizzled tiles (no A registers);
// m tile mt is tile rows mt·64.., of which warp w holds mt·64 + 16w... K/V tiles sit in a
// ring of 3 (loaded one tile ahead by cp.async) because the products are pipelined:
// iteration t issues S_t = Q·K_tᵀ and then O += P_{t−1}·V_{t−1}, waits for S_t only, and
// runs the softmax of tile t while the tensor cores do P_{t−1}·V_{t−1} (FlashAttention-3's
// intra-warpgroup overlap); O is rescaled after that product is done.
#define FA_ST 3
template <class T, bool MASK> __device__ void fa_fwd_wg(const AttnGeom& g, const T* Q, const T* K, const T* V, const void* mask, T* Y, float* lse, int vec) {
    constexpr int DP = 64, MT = 2, NT = 128, TILE = FA_BK * DP * 2;
    unsigned sQ = smem_u32(fa_base());
    unsigned sK = sQ + FA_BQ * DP * 2, sV = sK + FA_ST * TILE;
    int warp = threadIdx.x >> 5;
    i64 qb = g.causal ? (i64)gridDim.x - 1 - blockIdx.x : blockIdx.x;
    i64 bh = blockIdx.y, b = bh / g.hq, h = bh % g.hq, hk = h / (g.hq / g.hkv);
    i64 q0 = qb * FA_BQ;
    int qvalid = (int)(g.sq - q0 < FA_BQ ? g.sq - q0 : FA_BQ);
    i64 kend = g.skv;
    if (g.causal && q0 + FA_BQ < kend) kend = q0 + FA_BQ;
    int ntiles = (int)((kend + FA_BK - 1) / FA_BK);
    const i64 krs = g.st[ATT_K][2], vrs = g.st[ATT_V][2];
    const unsigned short* Kb = (const unsigned short*)K + att_off(g, ATT_K, b, hk, 0);
    const unsigned short* Vb = (const unsigned short*)V + att_off(g, ATT_V, b, hk, 0);
    auto load_kv = [&](int t) {
        i64 j0 = (i64)t * FA_BK;
        int kv = (int)(g.skv - j0 < FA_BK ? g.skv - j0 : FA_BK);
        unsigned off = (t % FA_ST) * TILE;
        load_tile<DP, NT>(sK + off, Kb + j0 * krs, krs, FA_BK, kv, (int)g.d, vec);
        load_tile<DP, NT>(sV + off, Vb + j0 * vrs, vrs, FA_BK, kv, (int)g.dv, vec);
    };
    load_tile<DP, NT>(sQ, (const unsigned short*)Q + att_off(g, ATT_Q, b, h, q0), g.st[ATT_Q][2], FA_BQ, qvalid, (int)g.d, vec);
    if (ntiles > 0) load_kv(0);
    cp_commit();
    float o[MT][8][4], s[MT][8][4];
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < 8; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
        m[mt][0] = m[mt][1] = neg_inf(0.f);
        l[mt][0] = l[mt][1] = 0.f;
    }
    unsigned pa[MT][4][4];  // P of the previous tile
    const float sl2 = (float)g.scale * FA_LOG2E;
    // Scores stay unscaled where no additive mask comes in and the scale is positive (the
    // row maximum of the scaled scores is then the scaled maximum).
    const bool raw = !MASK && sl2 > 0.f;
    int gq = (threadIdx.x & 31) >> 2;
    // The first iteration apart (no P·V yet): ptxas serializes every wgmma of a
    // kernel where a wait depends on a run-time condition.
    // (NVRTC takes no generic lambdas: `first` is a run-time flag, constant in each inlined
    // copy.)
    auto step = [&](int t, bool first) {
        // Tile t is in; every warp is past iteration t − 1, so slot (t + 1) % 3 (tile t − 2)
        // is free.
        cp_wait_all();
        fence_async_smem();
        __syncthreads();
        if (t + 1 < ntiles) load_kv(t + 1);
        cp_commit();
        unsigned kt = sK + (t % FA_ST) * TILE, vp = sV + ((t + FA_ST - 1) % FA_ST) * TILE;
        // One group per m tile's S, then one for P·V: the softmax of m tile 0 starts while
        // the tensor cores still have S of m tile 1 and P·V to do.
        wg_fence();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int kc = 0; kc < 4; ++kc) Wg<T, 0>::ss(s[mt], wg_desc_k(sQ + mt * 64 * DP * 2, kc), wg_desc_k(kt, kc), kc);
            wg_commit();
        }
        if (!first) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) wg_pb<T>(o[mt], pa[mt], vp);
            wg_commit();
        }
        i64 j0 = (i64)t * FA_BK;
        float a[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            wg_wait_late(g, MT - 1 - mt + (first ? 0 : 1));
            wg_keep(s[mt]);
            i64 rw = q0 + mt * 64 + warp * 16;  // the warp's first row
            bool edge = MASK || j0 + FA_BK > g.skv || (g.causal && j0 + FA_BK - 1 > rw);
            if (!raw) {
#pragma unroll
                for (int nb = 0; nb < 8; ++nb)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mt][nb][e] *= sl2;
            }
            if (edge) fa_edge<T, MASK>(g, s[mt], mask, b, h, rw + gq, j0, 0);
            fa_online(s[mt], m[mt], l[mt], a[mt], raw ? sl2 : 1.f);
        }
        if (!first) {
            // (The keeps of s first: the softmax ends before the wait, not after.)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) wg_keep(s[mt]);
            wg_wait_late(g, 0);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                wg_keep(o[mt]);
                wg_keep_a(pa[mt]);
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int nd = 0; nd < 8; ++nd) {
                o[mt][nd][0] *= a[mt][0];
                o[mt][nd][1] *= a[mt][0];
                o[mt][nd][2] *= a[mt][1];
                o[mt][nd][3] *= a[mt][1];
            }
            pack_a<T>(pa[mt], s[mt]);
        }
    };
    if (ntiles > 0) {
        step(0, true);
        for (int t = 1; t < ntiles; ++t) step(t, false);
        wg_fence();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) wg_pb<T>(o[mt], pa[mt], sV + ((ntiles - 1) % FA_ST) * TILE);
        wg_commit();
        wg_wait();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            wg_keep(o[mt]);
            wg_keep_a(pa[mt]);
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) fa_finish<T, DP>(g, Y, lse, b, h, bh, o[mt], q0 + mt * 64 + warp * 16, m[mt], l[mt]);
}

// Warp-specialized forward (sm_90a, heads up to 64; FlashAttention-3's layout for head size
// 64): grid (query blocks of 64·NC, B·Hq), NC + 1 warpgroups. Warpgroup 0 is the producer:
// it loads Q, then streams 128-key K/V tiles by cp.async into a ring of FA_WS_ST stages,
// each announced on its `full` mbarrier once its copies have landed (wait, proxy fence,
// release-arrive of all 128 producer threads), and reuses a stage once every consumer warp
// has arrived on its `empty` mbarrier. Consumer warpgroup c owns query rows 64c.. of the
// block: no loads, no __syncthreads, and `setmaxnreg` moves the producer's registers to the
// consumers. Each consumer runs fa_fwd_wg's pipeline on 64 × 128 score tiles (two m64n64
// products a tile): S_t issued before P_{t−1}·V_{t−1}, the softmax of tile t under the
// latter. Causal: a consumer computes only the tiles its rows see, and only waits for and
// releases the others (every consumer arrives once on every stage use).
#define FA_WS_ST 4    // K/V ring stages
#define FA_WS_BK 128  // keys per tile
__device__ __forceinline__ void mb_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mb_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Until the phase of parity `par` of the mbarrier at `bar` has completed (acquire).
__device__ __forceinline__ void mb_wait(unsigned bar, unsigned par) {
    unsigned ok;
    do {
        // (With a suspend-time hint the thread sleeps until the phase completes instead of
        // polling: waiting producer warps took a third of the issued instructions.)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3; selp.u32 %0, 1, 0, p; }"
                     : "=r"(ok) : "r"(bar), "r"(par), "r"(10000000u) : "memory");
    } while (!ok);
}
// Registers a thread of this warpgroup may hold from here on (a multiple of 8, 24..256).
template <int N> __device__ __forceinline__ void wg_setmaxnreg_dec() {
#if FA_HAVE_WG
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
#endif
}
template <int N> __device__ __forceinline__ void wg_setmaxnreg_inc() {
#if FA_HAVE_WG
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
#endif
}
// Register split (65536 a CTA of (NC + 1) · 128 threads): producer, consumers.
#define FA_WS_PREG(NC) ((NC) == 3 ? 32 : 24)
#define FA_WS_CREG(NC) ((NC) == 3 ? 160 : 240)

// fa_online for fa_fwd_wsp's 16 × 128 tiles of a warp (16 column blocks): the row maxima and
// sums run in 4 independent chains each instead of one (the same maxima; sums in another
// order).
__device__ __forceinline__ void fa_online_ws(float (*s)[4], float* m, float* l, float* a, float mul) {
    float x0[4], x1[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        x0[j] = fmaxf(s[j][0], s[j][1]);
        x1[j] = fmaxf(s[j][2], s[j][3]);
    }
#pragma unroll
    for (int nb = 4; nb < 16; ++nb) {
        x0[nb & 3] = fmaxf(x0[nb & 3], fmaxf(s[nb][0], s[nb][1]));
        x1[nb & 3] = fmaxf(x1[nb & 3], fmaxf(s[nb][2], s[nb][3]));
    }
    float mx0 = fmaxf(fmaxf(x0[0], x0[1]), fmaxf(x0[2], x0[3]));
    float mx1 = fmaxf(fmaxf(x1[0], x1[1]), fmaxf(x1[2], x1[3]));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    mx0 = fmaxf(m[0], mx0 * mul);
    mx1 = fmaxf(m[1], mx1 * mul);
    // A row that has seen only masked keys keeps m = -inf: measure from 0 instead.
    float ref0 = mx0 == neg_inf(mx0) ? 0.f : mx0, ref1 = mx1 == neg_inf(mx1) ? 0.f : mx1;
    a[0] = fa_ex2(m[0] - ref0);
    a[1] = fa_ex2(m[1] - ref1);
    m[0] = mx0;
    m[1] = mx1;
    float p0[4], p1[4];
#pragma unroll
    for (int nb = 0; nb < 16; ++nb) {
        s[nb][0] = fa_ex2(fmaf(s[nb][0], mul, -ref0));
        s[nb][1] = fa_ex2(fmaf(s[nb][1], mul, -ref0));
        s[nb][2] = fa_ex2(fmaf(s[nb][2], mul, -ref1));
        s[nb][3] = fa_ex2(fmaf(s[nb][3], mul, -ref1));
        float u0 = s[nb][0] + s[nb][1], u1 = s[nb][2] + s[nb][3];
        p0[nb & 3] = nb < 4 ? u0 : p0[nb & 3] + u0;
        p1[nb & 3] = nb < 4 ? u1 : p1[nb & 3] + u1;
    }
    l[0] = l[0] * a[0] + ((p0[0] + p0[1]) + (p0[2] + p0[3]));
    l[1] = l[1] * a[1] + ((p1[0] + p1[1]) + (p1[2] + p1[3]));
}

// Also tried and measured no faster on the H100, then removed: consumers taking turns to
// issue their products (FA3's scheduler barrier), P's row sums on the tensor cores
// (m64n72k16 against a tile of ones), persistent CTAs with one Q buffer that flushed the
// ring at each item (docs/bench-h100/attention-notes.md, "Session 5 — forward"). The
// one-CTA-an-item form fa_fwd_ws that fa_fwd_wsp below replaced (0.213 against 0.191 ms
// for the attention workload) is in the history at c482a73.

// load_tile for fa_fwd_wsp's producer (64 columns, 128 threads): the 16-byte path walks its
// rows by one pointer, so that no per-row offsets are hoisted out of the producer's loops
// into its 32 registers (they spilled).
__device__ __forceinline__ void load_tile_lean(unsigned base, const unsigned short* src, i64 rs, int rows, int valid, int width, int vec) {
    if (!vec) {
        load_tile<64, 128>(base, src, rs, rows, valid, width, vec);
        return;
    }
    const int c = threadIdx.x & 7, r0 = (threadIdx.x & 127) >> 3;
    const bool cok = c * 8 < width;
    const unsigned short* s = src + r0 * rs + c * 8;
    const i64 step = 16 * rs;
    const unsigned dst = sw_addr<64>(base, r0, c);
#pragma unroll
    for (int k = 0; k < rows / 16; ++k) {
        const bool ok = cok && r0 + k * 16 < valid;
        cp_async16(dst + k * 16 * 64 * 2, ok ? s : src, ok ? 16 : 0);
        s += step;
        asm volatile("" : "+l"(s));
    }
}

// The warp-specialized forward, persistent (the default on Hopper for heads ≤ 64): one CTA an
// SM runs item after item (query block, batch·head, in chunks of heads, a chunk's longest
// blocks first), the first its blockIdx.x, the next ones from
// the counter `work` (zeroed by the host before the launch), so that a CTA's prologue and
// epilogue overlap the work of its neighbours instead of leaving the tensor cores idle:
// - Q is double-buffered: the producer loads item k + 1's Q into the buffer item k − 1
//   released (its `qempty` mbarrier, arrived on by each consumer warp after its epilogue,
//   which stages Y through the warpgroup's own Q rows), right after item k's last K/V tile;
// - the K/V ring runs on across items (never flushed; ring position and parities count on);
// - the producer's thread 0 takes the next item and works out its geometry (32-bit), and
//   passes it to the others and the consumers through a slot next to the Q buffer (the
//   producer's named barrier, then Q's `qfull`); a slot with q0 < 0 ends the loop.
// Measured no faster (docs/bench-h100/attention-notes.md, "Session 6 — persistent
// forward"): static striding instead of the counter, the consumers taking turns at the
// block's rows, 5 stages, the next item's first S issued under this item's epilogue.
template <class T, bool MASK, int NC> __device__ void fa_fwd_wsp(const AttnGeom& g, const T* Q, const T* K, const T* V, const void* mask, T* Y, float* lse, int vec, int chunk, int nbh, int* work) {
    constexpr int DP = 64, BM = 64 * NC, BK = FA_WS_BK, TILE = BK * DP * 2, ST = FA_WS_ST, QT = BM * DP * 2;
    // Shared memory: Q's two buffers (BM rows each), ST stages of K and V (TILE each), then
    // the mbarriers full[ST], empty[ST], qfull[2], qempty[2], and the two item slots (32 bytes).
    const unsigned sQ = smem_u32(fa_base());
    const unsigned sKV = sQ + 2 * QT, bars = sKV + ST * 2 * TILE;
    auto full = [&](unsigned s) { return bars + 8u * s; };
    auto empty = [&](unsigned s) { return bars + 8u * (ST + s); };
    auto qfull = [&](unsigned qb) { return bars + 8u * (2 * ST + qb); };
    auto qempty = [&](unsigned qb) { return bars + 8u * (2 * ST + 2 + qb); };
    auto slot = [&](unsigned qb) { return bars + 8u * (2 * ST + 4) + 32u * qb; };
    const int wg = threadIdx.x >> 7;
    if (threadIdx.x == 0) {
        for (int s = 0; s < ST; ++s) {
            mb_init(full(s), 128);
            mb_init(empty(s), NC * 4);
        }
        for (int qb = 0; qb < 2; ++qb) {
            mb_init(qfull(qb), 128);
            mb_init(qempty(qb), NC * 4);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (wg == 0) {
        wg_setmaxnreg_dec<FA_WS_PREG(NC)>();
        // Each copy group (a Q tile or a K/V stage) is announced when it has landed: after the
        // next group is issued (or at the end), by every producer thread after its own wait
        // and proxy fence (wgmma reads what cp.async wrote).
        unsigned pend = 0;
        auto issued = [&](unsigned bar) {
            cp_commit();
            asm volatile("cp.async.wait_group 1;" ::: "memory");
            fence_async_smem();
            if (pend) mb_arrive(pend);
            pend = bar;
        };
        const i64 krs = g.st[ATT_K][2], vrs = g.st[ATT_V][2];
        unsigned kv = 0;  // K/V tiles so far (all items): the ring position
        for (unsigned k = 0;; ++k) {
            const unsigned qb = k & 1;
            // Q's buffer (and its slot) is free once every consumer warp has stored item
            // k − 2's Y.
            if (k >= 2) mb_wait(qempty(qb), ((k >> 1) - 1) & 1);
            if (threadIdx.x == 0) {
                const int nqb = (int)((g.sq + BM - 1) / BM), sq = (int)g.sq, skv = (int)g.skv, hq = (int)g.hq;
                // (work null: static striding, blockIdx.x + k·gridDim.x; the host always
                // passes the counter, static striding measured 25 % slower. Kept, with the
                // two `nt > 0` blocks of the consumer, because this is the form measured:
                // simpler forms compile to other SASS.)
                const unsigned it = k == 0 ? blockIdx.x : work ? gridDim.x + (unsigned)atomicAdd(work, 1) : blockIdx.x + k * gridDim.x;
                int b = 0, h = 0, hk = 0, q0 = -1, nt = 0;
                if (it < (unsigned)(nqb * nbh)) {
                    // The order: chunks of `chunk` heads, a chunk's longest blocks first.
                    const unsigned span = (unsigned)(chunk * nqb), ci = it / span, cr = it - ci * span;
                    const unsigned left = (unsigned)nbh - ci * chunk, chb = left < (unsigned)chunk ? left : (unsigned)chunk;
                    const unsigned qr = cr / chb, bh = ci * chunk + (cr - qr * chb);
                    b = (int)(bh / (unsigned)hq);
                    h = (int)bh - b * hq;
                    hk = h / (hq / (int)g.hkv);
                    q0 = (g.causal ? nqb - 1 - (int)qr : (int)qr) * BM;
                    // Keys: all, or under causal up to the end of the last consumer with rows.
                    int kend = skv;
                    if (g.causal) {
                        const int rows = sq - q0 < BM ? sq - q0 : BM, ce = q0 + ((rows + 63) & ~63);
                        if (ce < kend) kend = ce;
                    }
                    nt = (kend + BK - 1) / BK;
                }
                asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};" ::"r"(slot(qb)), "r"(b), "r"(h), "r"(q0), "r"(nt) : "memory");
                asm volatile("st.shared.b32 [%0], %1;" ::"r"(slot(qb) + 16u), "r"(hk) : "memory");
            }
            fa_wg_bar(1 + NC);  // the producer warpgroup's barrier (consumers use 1..NC)
            int b, h, q0, nt, hk;
            asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];" : "=r"(b), "=r"(h), "=r"(q0), "=r"(nt) : "r"(slot(qb)) : "memory");
            if (q0 < 0) {
                // No item left: the last tile announced, then the end (the slot) to the consumers.
                cp_wait_all();
                fence_async_smem();
                if (pend) mb_arrive(pend);
                mb_arrive(qfull(qb));
                break;
            }
            asm volatile("ld.shared.b32 %0, [%1];" : "=r"(hk) : "r"(slot(qb) + 16u) : "memory");
            const int qvalid = (int)g.sq - q0 < BM ? (int)g.sq - q0 : BM;
            load_tile_lean(sQ + qb * QT, (const unsigned short*)Q + att_off(g, ATT_Q, b, h, q0), g.st[ATT_Q][2], BM, qvalid, (int)g.d, vec);
            issued(qfull(qb));
            const unsigned short* Kb = (const unsigned short*)K + att_off(g, ATT_K, b, hk, 0);
            const unsigned short* Vb = (const unsigned short*)V + att_off(g, ATT_V, b, hk, 0);
            for (int t = 0; t < nt; ++t, ++kv) {
                const unsigned s = kv % ST;
                if (kv >= ST) mb_wait(empty(s), (kv / ST - 1) & 1);
                const int j0 = t * BK, kvalid = (int)g.skv - j0 < BK ? (int)g.skv - j0 : BK;
                const unsigned kt = sKV + s * 2 * TILE;
                load_tile_lean(kt, Kb + j0 * krs, krs, BK, kvalid, (int)g.d, vec);
                load_tile_lean(kt + TILE, Vb + j0 * vrs, vrs, BK, kvalid, (int)g.dv, vec);
                issued(full(s));
            }
        }
        return;
    }
    wg_setmaxnreg_inc<FA_WS_CREG(NC)>();
    const int c = wg - 1, warp = (threadIdx.x >> 5) & 3, gq = (threadIdx.x & 31) >> 2, lane = threadIdx.x & 31;
    const float sl2 = (float)g.scale * FA_LOG2E;
    const bool raw = !MASK && sl2 > 0.f;
    // Descriptors once: a stage, k step or Q buffer moves the start address, i.e. adds
    // bytes / 16 to the descriptor (shared addresses stay below 256 KiB: no carry out of its
    // field). (Q's is made per item: kept across the loop, it spilled.)
    const unsigned long long kdesc = wg_desc_k(sKV, 0), vdesc = wg_desc_mn(sKV + TILE, 0);
    auto arrive_warp = [&](unsigned bar) {
        __syncwarp();
        if (lane == 0) mb_arrive(bar);
    };
    // An item as this consumer sees it.
    struct Item {
        int b, h, ntiles;  // ntiles: the block's K/V tiles (ring positions)
        int nt;            // the tiles this consumer computes (its rows see them); it passes over the rest
        int rw;            // the warp's first row
        int elim;          // a 64-key half from c0 needs fa_edge iff c0 + 63 > elim
    };
    // Item k (false: none left), once its Q has landed.
    auto next_item = [&](unsigned k, Item& it) {
        const unsigned qb = k & 1;
        mb_wait(qfull(qb), (k >> 1) & 1);
        int q0;
        asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];" : "=r"(it.b), "=r"(it.h), "=r"(q0), "=r"(it.ntiles) : "r"(slot(qb)) : "memory");
        if (q0 < 0) return false;
        const int sq = (int)g.sq, skv = (int)g.skv;
        const int rc = q0 + c * 64;  // this consumer's first row
        it.nt = it.ntiles;
        if (rc >= sq) it.nt = 0;
        else if (g.causal) {
            const int ke = skv < rc + 64 ? skv : rc + 64, n = (ke + BK - 1) / BK;
            if (n < it.nt) it.nt = n;
        }
        it.rw = rc + warp * 16;
        // (keys past Skv, keys after the warp's first row, or any mask)
        it.elim = skv - 1;
        if (g.causal && it.rw < it.elim) it.elim = it.rw;
        if (MASK) it.elim = -1;
        return true;
    };
    // This consumer's Q rows of item k.
    auto q_rows = [&](unsigned k) { return sQ + (k & 1) * QT + c * 64 * DP * 2; };
    float o[8][4], s[16][4];
    float m[2], l[2], ap[2];  // ap: the factor of the previous tile's softmax for O
    unsigned pa[8][4];        // P of the previous tile (8 k steps of 16 keys)
    auto rescale = [&]() {
#pragma unroll
        for (int nd = 0; nd < 8; ++nd) {
            o[nd][0] *= ap[0];
            o[nd][1] *= ap[0];
            o[nd][2] *= ap[1];
            o[nd][3] *= ap[1];
        }
    };
    // O += P·V (8 k steps of 16 keys) from stage offset `so`.
    auto pv = [&](unsigned so) {
#pragma unroll
        for (int kc = 0; kc < 8; ++kc) Wg<T, 1>::run(o, pa[kc], vdesc + ((so + kc * 2048u) >> 4));
    };
    // S = Q·Kᵀ of ring tile `ut` issued (four m64n128k16), for item k.
    auto issue_s = [&](unsigned k, unsigned ut) {
        const unsigned long long qdesc = wg_desc_k(q_rows(k), 0);
        const unsigned so = (ut % ST) * 2 * TILE;
        mb_wait(full(ut % ST), (ut / ST) & 1);
        wg_fence();
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) Wg128<T>::ss(s, qdesc + 2 * kc, kdesc + ((so + kc * 32) >> 4), kc);
        wg_commit();
    };
    // S of item tile t (issued) to P: masked, softmax; `wait`: the wgmma groups left in flight.
    auto softmax = [&](const Item& it, int t, int wait) {
        wg_wait_late(g, wait);
        wg_keep(s);
        wg_keep(s + 8);
        if (!raw) {
#pragma unroll
            for (int nb = 0; nb < 16; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nb][e] *= sl2;
        }
        const int j0 = t * BK;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
            if (j0 + hf * 64 + 63 > it.elim) fa_edge<T, MASK>(g, s + 8 * hf, mask, it.b, it.h, it.rw + gq, j0 + hf * 64, 0);
        fa_online_ws(s, m, l, ap, raw ? sl2 : 1.f);
    };
    unsigned T0 = 0;  // K/V tiles of the earlier items: item tile t is ring tile T0 + t
    Item cur;
    bool have = next_item(0, cur);
    for (unsigned k = 0; have; ++k) {
        const int nt = cur.nt;
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
        m[0] = m[1] = neg_inf(0.f);
        l[0] = l[1] = 0.f;
        if (nt > 0) {
            issue_s(k, T0);
            softmax(cur, 0, 0);
            pack_a<T>(pa, s);
            pack_a<T>(pa + 4, s + 8);
        }
        if (nt > 0) {
            for (int t = 1; t < nt; ++t) {
                const unsigned ut = T0 + (unsigned)t;
                issue_s(k, ut);
                // O (up to tile t − 2) to the previous tile's maximum while S_t runs, then
                // O += P_{t−1}·V_{t−1}: after the P·V wait only P_t's packing is left.
                rescale();
                wg_fence();
                pv(((ut - 1) % ST) * 2 * TILE);
                wg_commit();
                softmax(cur, t, 1);
                wg_keep(s);
                wg_keep(s + 8);
                wg_wait_late(g, 0);
                wg_keep(o);
                wg_keep_a(pa);
                wg_keep_a(pa + 4);
                arrive_warp(empty((ut - 1) % ST));
                pack_a<T>(pa, s);
                pack_a<T>(pa + 4, s + 8);
            }
            rescale();
            wg_fence();
            pv(((T0 + (unsigned)nt - 1) % ST) * 2 * TILE);
            wg_commit();
            wg_wait();
            wg_keep(o);
            wg_keep_a(pa);
            wg_keep_a(pa + 4);
            arrive_warp(empty((T0 + (unsigned)nt - 1) % ST));
        }
        // The stages of tiles this consumer's rows do not see: arrive once each is filled.
        for (int t = nt; t < cur.ntiles; ++t) {
            const unsigned ut = T0 + (unsigned)t;
            mb_wait(full(ut % ST), (ut / ST) & 1);
            arrive_warp(empty(ut % ST));
        }
        const unsigned T1 = T0 + (unsigned)cur.ntiles;
        Item nxt;
        // Y through this consumer's Q rows (read by no product any more), then Q's buffer
        // is released.
        fa_finish<T, DP, true>(g, Y, lse, cur.b, cur.h, (i64)cur.b * g.hq + cur.h, o, cur.rw, m, l, vec, q_rows(k), 1 + c);
        arrive_warp(qempty(k & 1));
        have = next_item(k + 1, nxt);
        cur = nxt;
        T0 = T1;
    }
}

// delta = rowsum(dY∘Y) of this thread's rows row0 and row0 + 8 (the 4 threads of a row
// take 16 columns each) into D[2], and into `delta` [B,Hq,Sq] for the dK/dV pass: the dQ
// kernels compute it on the way (no pass of its own).
template <class T> __device__ __forceinline__ void fa_delta(const AttnGeom& g, const T* dY, const T* Y, float* delta, i64 b, i64 h, i64 bh, i64 row0, int vec, float* D) {
    int tq = threadIdx.x & 3;
    const unsigned short* dyb = (const unsigned short*)dY + att_off(g, ATT_Y, b, h, 0);
    const unsigned short* yb = (const unsigned short*)Y + att_off(g, ATT_Y, b, h, 0);
    i64 rs = g.st[ATT_Y][2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        i64 r = row0 + half * 8;
        float acc = 0.f;
        if (r < g.sq) {
#pragma unroll
            for (int c8 = 0; c8 < 2; ++c8) {
                int c0 = tq * 16 + c8 * 8;
                if (c0 >= g.dv) continue;
                unsigned short x[8], y[8];
                if (vec) {  // (dv % 8 == 0, rows 16-byte aligned)
                    *(uint4*)x = *(const uint4*)(dyb + r * rs + c0);
                    *(uint4*)y = *(const uint4*)(yb + r * rs + c0);
                } else {
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        bool ok = c0 + e < g.dv;
                        x[e] = ok ? dyb[r * rs + c0 + e] : 0;
                        y[e] = ok ? yb[r * rs + c0 + e] : 0;
                    }
                }
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    T xt, yt;
                    xt.x = x[e];
                    yt.x = y[e];
                    acc += ld(xt) * ld(yt);
                }
            }
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        D[half] = acc;
        if (tq == 0 && r < g.sq) delta[bh * g.sq + r] = acc;
    }
}

// dQ (and dMask): grid (query blocks of FB_B, B·Hq), 4 warps. P is recomputed from LSE;
// dS = P∘(dY·Vᵀ − delta), dQ = scale·dS·K.
template <class T, int DP, bool MASK> __device__ void fa_dq(const AttnGeom& g, const T* dY, const T* Q, const T* K, const T* V, const void* mask, const float* lse, float* delta, T* dQ, T* dmask, int vec, const T* Y) {
    constexpr int NT = FB_B * 2;
    unsigned sQ = smem_u32(fa_base());
    unsigned sdY = sQ + FB_B * DP * 2, sK = sdY + FB_B * DP * 2, sV = sK + 2 * FA_BK * DP * 2;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    i64 qb = g.causal ? (i64)gridDim.x - 1 - blockIdx.x : blockIdx.x;
    i64 bh = blockIdx.y, b = bh / g.hq, h = bh % g.hq, hk = h / (g.hq / g.hkv);
    i64 q0 = qb * FB_B;
    int qvalid = (int)(g.sq - q0 < FB_B ? g.sq - q0 : FB_B);
    i64 kend = g.skv;
    if (g.causal && q0 + FB_B < kend) kend = q0 + FB_B;
    int ntiles = (int)((kend + FA_BK - 1) / FA_BK);
    const i64 krs = g.st[ATT_K][2], vrs = g.st[ATT_V][2];
    const unsigned short* Kb = (const unsigned short*)K + att_off(g, ATT_K, b, hk, 0);
    const unsigned short* Vb = (const unsigned short*)V + att_off(g, ATT_V, b, hk, 0);
    load_tile<DP, NT>(sQ, (const unsigned short*)Q + att_off(g, ATT_Q, b, h, q0), g.st[ATT_Q][2], FB_B, qvalid, (int)g.d, vec);
    load_tile<DP, NT>(sdY, (const unsigned short*)dY + att_off(g, ATT_Y, b, h, q0), g.st[ATT_Y][2], FB_B, qvalid, (int)g.dv, vec);
    if (ntiles > 0) {
        int kv = (int)(g.skv < FA_BK ? g.skv : FA_BK);
        load_tile<DP, NT>(sK, Kb, krs, FA_BK, kv, (int)g.d, vec);
        load_tile<DP, NT>(sV, Vb, vrs, FA_BK, kv, (int)g.dv, vec);
    }
    cp_commit();
    i64 row0 = q0 + warp * 16 + gq, row1 = row0 + 8;
    // log2-domain LSE per row; +inf where the row sees nothing (so P = 0 there).
    float L0 = row0 < g.sq ? lse[bh * g.sq + row0] : neg_inf(0.f);
    float L1 = row1 < g.sq ? lse[bh * g.sq + row1] : neg_inf(0.f);
    L0 = L0 == neg_inf(L0) ? -neg_inf(0.f) : L0 * FA_LOG2E;
    L1 = L1 == neg_inf(L1) ? -neg_inf(0.f) : L1 * FA_LOG2E;
    float Dr[2];
    fa_delta<T>(g, dY, Y, delta, b, h, bh, row0, vec, Dr);
    float D0 = Dr[0], D1 = Dr[1];
    float acc[DP / 8][4];
#pragma unroll
    for (int i = 0; i < DP / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    unsigned qa[DP / 16][4], da[DP / 16][4];
    const float sl2 = (float)g.scale * FA_LOG2E;
    cp_wait_all();
    __syncthreads();
    load_afrag<DP>(sQ, warp * 16, qa);
    load_afrag<DP>(sdY, warp * 16, da);
    for (int t = 0; t < ntiles; ++t) {
        if (t > 0) {
            cp_wait_all();
            __syncthreads();
        }
        if (t + 1 < ntiles) {
            i64 j0 = (i64)(t + 1) * FA_BK;
            int kv = (int)(g.skv - j0 < FA_BK ? g.skv - j0 : FA_BK);
            unsigned off = ((t + 1) & 1) * FA_BK * DP * 2;
            load_tile<DP, NT>(sK + off, Kb + j0 * krs, krs, FA_BK, kv, (int)g.d, vec);
            load_tile<DP, NT>(sV + off, Vb + j0 * vrs, vrs, FA_BK, kv, (int)g.dv, vec);
        }
        cp_commit();
        unsigned off = (t & 1) * FA_BK * DP * 2;
        float s[8][4], dp[8][4];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
            dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
        }
        mma_abt<T, DP>(s, qa, sK + off, 0);
        mma_abt<T, DP>(dp, da, sV + off, 0);
        i64 j0 = (i64)t * FA_BK;
        bool edge = MASK || j0 + FA_BK > g.skv || (g.causal && j0 + FA_BK - 1 > q0 + warp * 16);
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nb][e] *= sl2;
        if (edge) fa_edge<T, MASK>(g, s, mask, b, h, row0, j0, 0);
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float p = fa_ex2(s[nb][e] - (e < 2 ? L0 : L1));
                s[nb][e] = p * (dp[nb][e] - (e < 2 ? D0 : D1));
            }
        if (dmask) {
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    i64 j = j0 + nb * 8 + 2 * tq + (e & 1), i = e < 2 ? row0 : row1;
                    if (i < g.sq && j < g.skv) dmask[(bh * g.sq + i) * g.skv + j] = st<T>(s[nb][e]);
                }
        }
        mma_pb<T, DP>(acc, s, sK + off);
    }
    float sc = (float)g.scale;
    store_acc<T, DP>(dQ + att_off(g, ATT_Q, b, h, 0), g.st[ATT_Q][2], acc, q0 + warp * 16, g.sq, (int)g.d, sc, sc);
}

// dK, dV: grid (key blocks of FB_B, B·Hkv), 4 warps; each CTA walks the query tiles of
// every query head of its kv group. dV = Pᵀ·dY, dK = scale·dSᵀ·Q.
template <class T, int DP, bool MASK> __device__ void fa_dkv(const AttnGeom& g, const T* dY, const T* Q, const T* K, const T* V, const void* mask, const float* lse, const float* delta, T* dK, T* dV, int vec) {
    constexpr int NT = FB_B * 2;
    unsigned sK = smem_u32(fa_base());
    unsigned sV = sK + FB_B * DP * 2, sQ = sV + FB_B * DP * 2, sdY = sQ + 2 * FB_B * DP * 2;
    float* sL = (float*)(fa_base() + (2 * FB_B + 4 * FB_B) * DP * 2);  // [2][FB_B] log2 LSE
    float* sD = sL + 2 * FB_B;                                        // [2][FB_B] delta
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    i64 bhk = blockIdx.y, b = bhk / g.hkv, hk = bhk % g.hkv, grp = g.hq / g.hkv;
    i64 k0 = (i64)blockIdx.x * FB_B;
    int kvalid = (int)(g.skv - k0 < FB_B ? g.skv - k0 : FB_B);
    // Query tiles: causal starts at the tile holding query k0 (earlier ones see no key here).
    i64 i_start = g.causal ? (k0 / FB_B) * FB_B : 0;
    int ntq = g.sq > i_start ? (int)((g.sq - i_start + FB_B - 1) / FB_B) : 0;
    int total = (int)(ntq * grp);
    load_tile<DP, NT>(sK, (const unsigned short*)K + att_off(g, ATT_K, b, hk, k0), g.st[ATT_K][2], FB_B, kvalid, (int)g.d, vec);
    load_tile<DP, NT>(sV, (const unsigned short*)V + att_off(g, ATT_V, b, hk, k0), g.st[ATT_V][2], FB_B, kvalid, (int)g.dv, vec);
    // Stage 0 of the query tiles, and its LSE/delta.
    auto stage = [&](int it, int buf) {
        i64 h = hk * grp + it / ntq, i0 = i_start + (i64)(it % ntq) * FB_B;
        i64 bh = b * g.hq + h;
        int qv = (int)(g.sq - i0 < FB_B ? g.sq - i0 : FB_B);
        unsigned off = buf * FB_B * DP * 2;
        load_tile<DP, NT>(sQ + off, (const unsigned short*)Q + att_off(g, ATT_Q, b, h, i0), g.st[ATT_Q][2], FB_B, qv, (int)g.d, vec);
        load_tile<DP, NT>(sdY + off, (const unsigned short*)dY + att_off(g, ATT_Y, b, h, i0), g.st[ATT_Y][2], FB_B, qv, (int)g.dv, vec);
        for (int r = threadIdx.x; r < FB_B; r += NT) {
            float L = r < qv ? lse[bh * g.sq + i0 + r] : neg_inf(0.f);
            sL[buf * FB_B + r] = L == neg_inf(L) ? -neg_inf(0.f) : L * FA_LOG2E;
            sD[buf * FB_B + r] = r < qv ? delta[bh * g.sq + i0 + r] : 0.f;
        }
    };
    if (total > 0) stage(0, 0);
    cp_commit();
    float dk[DP / 8][4], dv[DP / 8][4];
#pragma unroll
    for (int i = 0; i < DP / 8; ++i) {
        dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.f;
        dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;
    }
    unsigned ka[DP / 16][4], va[DP / 16][4];
    const float sl2 = (float)g.scale * FA_LOG2E;
    i64 key0 = k0 + warp * 16 + gq;  // this thread's first key row (the other is key0 + 8)
    cp_wait_all();
    __syncthreads();
    load_afrag<DP>(sK, warp * 16, ka);
    load_afrag<DP>(sV, warp * 16, va);
    for (int it = 0; it < total; ++it) {
        if (it > 0) {
            cp_wait_all();
            __syncthreads();
        }
        if (it + 1 < total) stage(it + 1, (it + 1) & 1);
        cp_commit();
        int buf = it & 1;
        unsigned off = buf * FB_B * DP * 2;
        i64 h = hk * grp + it / ntq, i0 = i_start + (i64)(it % ntq) * FB_B;
        float s[8][4], dp[8][4];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
            dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
        }
        // Sᵀ[key][query], dPᵀ[key][query]
        mma_abt<T, DP>(s, ka, sQ + off, 0);
        mma_abt<T, DP>(dp, va, sdY + off, 0);
        bool edge = MASK || (g.causal && i0 < k0 + FB_B);
        const float* L = sL + buf * FB_B;
        const float* Dl = sD + buf * FB_B;
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nb][e] *= sl2;
        if (edge) fa_edge<T, MASK>(g, s, mask, b, h, key0, i0, 1);
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int qi = nb * 8 + 2 * tq + (e & 1);
                float p = fa_ex2(s[nb][e] - L[qi]);
                s[nb][e] = p;
                dp[nb][e] = p * (dp[nb][e] - Dl[qi]);
            }
        mma_pb<T, DP>(dv, s, sdY + off);
        mma_pb<T, DP>(dk, dp, sQ + off);
    }
    float sc = (float)g.scale;
    store_acc<T, DP>(dK + att_off(g, ATT_K, b, hk, 0), g.st[ATT_K][2], dk, k0 + warp * 16, g.skv, (int)g.d, sc, sc);
    store_acc<T, DP>(dV + att_off(g, ATT_V, b, hk, 0), g.st[ATT_V][2], dv, k0 + warp * 16, g.skv, (int)g.dv, 1.f, 1.f);
}

// dQ on wgmma (sm_90a, heads up to 64): grid and rows as fa_dq, one warpgroup. S = Q·Kᵀ
// and dP = dY·Vᵀ read Q and dY from their tiles (A from shared memory); K/V in a ring of 3,
// pipelined as fa_fwd_wg: iteration t issues S_t and dP_t, then dQ += dS_{t−1}·K_{t−1},
// and computes dS_t while the last runs.
template <class T, bool MASK> __device__ void fa_dq_wg(const AttnGeom& g, const T* dY, const T* Q, const T* K, const T* V, const void* mask, const float* lse, float* delta, T* dQ, T* dmask, int vec, const T* Y) {
    constexpr int DP = 64, NT = 128, TILE = FA_BK * DP * 2;
    unsigned sQ = smem_u32(fa_base());
    unsigned sdY = sQ + TILE, sK = sdY + TILE, sV = sK + FA_ST * TILE;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    i64 qb = g.causal ? (i64)gridDim.x - 1 - blockIdx.x : blockIdx.x;
    i64 bh = blockIdx.y, b = bh / g.hq, h = bh % g.hq, hk = h / (g.hq / g.hkv);
    i64 q0 = qb * FB_B;
    int qvalid = (int)(g.sq - q0 < FB_B ? g.sq - q0 : FB_B);
    i64 kend = g.skv;
    if (g.causal && q0 + FB_B < kend) kend = q0 + FB_B;
    int ntiles = (int)((kend + FA_BK - 1) / FA_BK);
    const i64 krs = g.st[ATT_K][2], vrs = g.st[ATT_V][2];
    const unsigned short* Kb = (const unsigned short*)K + att_off(g, ATT_K, b, hk, 0);
    const unsigned short* Vb = (const unsigned short*)V + att_off(g, ATT_V, b, hk, 0);
    auto load_kv = [&](int t) {
        i64 j0 = (i64)t * FA_BK;
        int kv = (int)(g.skv - j0 < FA_BK ? g.skv - j0 : FA_BK);
        unsigned off = (t % FA_ST) * TILE;
        load_tile<DP, NT>(sK + off, Kb + j0 * krs, krs, FA_BK, kv, (int)g.d, vec);
        load_tile<DP, NT>(sV + off, Vb + j0 * vrs, vrs, FA_BK, kv, (int)g.dv, vec);
    };
    load_tile<DP, NT>(sQ, (const unsigned short*)Q + att_off(g, ATT_Q, b, h, q0), g.st[ATT_Q][2], FB_B, qvalid, (int)g.d, vec);
    load_tile<DP, NT>(sdY, (const unsigned short*)dY + att_off(g, ATT_Y, b, h, q0), g.st[ATT_Y][2], FB_B, qvalid, (int)g.dv, vec);
    if (ntiles > 0) load_kv(0);
    cp_commit();
    i64 row0 = q0 + warp * 16 + gq, row1 = row0 + 8;
    // log2-domain LSE per row; +inf where the row sees nothing (so P = 0 there).
    float L0 = row0 < g.sq ? lse[bh * g.sq + row0] : neg_inf(0.f);
    float L1 = row1 < g.sq ? lse[bh * g.sq + row1] : neg_inf(0.f);
    L0 = L0 == neg_inf(L0) ? -neg_inf(0.f) : L0 * FA_LOG2E;
    L1 = L1 == neg_inf(L1) ? -neg_inf(0.f) : L1 * FA_LOG2E;
    float Dr[2];
    fa_delta<T>(g, dY, Y, delta, b, h, bh, row0, vec, Dr);
    float D0 = Dr[0], D1 = Dr[1];
    float acc[8][4], s[8][4], dp[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    unsigned da[4][4];  // dS of the previous tile
    const float sl2 = (float)g.scale * FA_LOG2E;
    // (First iteration apart: see fa_fwd_wg.)
    auto step = [&](int t, bool first) {
        cp_wait_all();
        fence_async_smem();
        __syncthreads();
        if (t + 1 < ntiles) load_kv(t + 1);
        cp_commit();
        unsigned kt = sK + (t % FA_ST) * TILE, vt = sV + (t % FA_ST) * TILE;
        unsigned kp = sK + ((t + FA_ST - 1) % FA_ST) * TILE;
        // Groups: S, dP, then dQ of the previous tile; P is computed while dP and dQ run.
        wg_fence();
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) Wg<T, 0>::ss(s, wg_desc_k(sQ, kc), wg_desc_k(kt, kc), kc);
        wg_commit();
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) Wg<T, 0>::ss(dp, wg_desc_k(sdY, kc), wg_desc_k(vt, kc), kc);
        wg_commit();
        if (!first) {
            wg_pb<T>(acc, da, kp);
            wg_commit();
        }
        wg_wait_n(first ? 1 : 2);
        wg_keep(s);
        i64 j0 = (i64)t * FA_BK;
        bool edge = MASK || j0 + FA_BK > g.skv || (g.causal && j0 + FA_BK - 1 > q0 + warp * 16);
        // log2 P = scale·log2(e)·S − LSE (+ the mask, in fa_edge)
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nb][e] = fmaf(s[nb][e], sl2, -(e < 2 ? L0 : L1));
        if (edge) fa_edge<T, MASK>(g, s, mask, b, h, row0, j0, 0);
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nb][e] = fa_ex2(s[nb][e]);
        wg_wait_late(g, first ? 0 : 1);
        wg_keep(dp);
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nb][e] *= dp[nb][e] - (e < 2 ? D0 : D1);
        if (dmask) {
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    i64 j = j0 + nb * 8 + 2 * tq + (e & 1), i = e < 2 ? row0 : row1;
                    if (i < g.sq && j < g.skv) dmask[(bh * g.sq + i) * g.skv + j] = st<T>(s[nb][e]);
                }
        }
        if (!first) {
            wg_keep(s);  // (the dS computation before the wait)
            wg_wait_late(g, 0);
            wg_keep(acc);
            wg_keep_a(da);
        }
        pack_a<T>(da, s);
    };
    if (ntiles > 0) {
        step(0, true);
        for (int t = 1; t < ntiles; ++t) step(t, false);
        wg_fence();
        wg_pb<T>(acc, da, sK + ((ntiles - 1) % FA_ST) * TILE);
        wg_commit();
        wg_wait();
        wg_keep(acc);
        wg_keep_a(da);
    }
    float sc = (float)g.scale;
    store_acc<T, DP>(dQ + att_off(g, ATT_Q, b, h, 0), g.st[ATT_Q][2], acc, q0 + warp * 16, g.sq, (int)g.d, sc, sc);
}

// dK, dV on wgmma (sm_90a, heads up to 64): grid and rows as fa_dkv, one warpgroup. Sᵀ =
// K·Qᵀ and dPᵀ = V·dYᵀ read K and V from their tiles; the query tiles (Q, dY, LSE, delta)
// in a ring of 3, pipelined as fa_fwd_wg: iteration it issues Sᵀ and dPᵀ of tile it, then
// dV += Pᵀ·dY and dK += dSᵀ·Q of tile it − 1, and computes P, dS of tile it meanwhile.
template <class T, bool MASK> __device__ void fa_dkv_wg(const AttnGeom& g, const T* dY, const T* Q, const T* K, const T* V, const void* mask, const float* lse, const float* delta, T* dK, T* dV, int vec) {
    constexpr int DP = 64, NT = 128, TILE = FB_B * DP * 2;
    unsigned sK = smem_u32(fa_base());
    unsigned sV = sK + TILE, sQ = sV + TILE, sdY = sQ + FA_ST * TILE;
    float* sL = (float*)(fa_base() + (2 + 2 * FA_ST) * TILE);  // [FA_ST][FB_B] log2 LSE
    float* sD = sL + FA_ST * FB_B;                              // [FA_ST][FB_B] delta
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    i64 bhk = blockIdx.y, b = bhk / g.hkv, hk = bhk % g.hkv, grp = g.hq / g.hkv;
    i64 k0 = (i64)blockIdx.x * FB_B;
    int kvalid = (int)(g.skv - k0 < FB_B ? g.skv - k0 : FB_B);
    // Query tiles: causal starts at the tile holding query k0 (earlier ones see no key here).
    i64 i_start = g.causal ? (k0 / FB_B) * FB_B : 0;
    int ntq = g.sq > i_start ? (int)((g.sq - i_start + FB_B - 1) / FB_B) : 0;
    int total = (int)(ntq * grp);
    load_tile<DP, NT>(sK, (const unsigned short*)K + att_off(g, ATT_K, b, hk, k0), g.st[ATT_K][2], FB_B, kvalid, (int)g.d, vec);
    load_tile<DP, NT>(sV, (const unsigned short*)V + att_off(g, ATT_V, b, hk, k0), g.st[ATT_V][2], FB_B, kvalid, (int)g.dv, vec);
    auto stage = [&](int it) {
        i64 h = hk * grp + it / ntq, i0 = i_start + (i64)(it % ntq) * FB_B;
        i64 bh = b * g.hq + h;
        int qv = (int)(g.sq - i0 < FB_B ? g.sq - i0 : FB_B);
        int buf = it % FA_ST;
        load_tile<DP, NT>(sQ + buf * TILE, (const unsigned short*)Q + att_off(g, ATT_Q, b, h, i0), g.st[ATT_Q][2], FB_B, qv, (int)g.d, vec);
        load_tile<DP, NT>(sdY + buf * TILE, (const unsigned short*)dY + att_off(g, ATT_Y, b, h, i0), g.st[ATT_Y][2], FB_B, qv, (int)g.dv, vec);
        for (int r = threadIdx.x; r < FB_B; r += NT) {
            float L = r < qv ? lse[bh * g.sq + i0 + r] : neg_inf(0.f);
            sL[buf * FB_B + r] = L == neg_inf(L) ? -neg_inf(0.f) : L * FA_LOG2E;
            sD[buf * FB_B + r] = r < qv ? delta[bh * g.sq + i0 + r] : 0.f;
        }
    };
    if (total > 0) stage(0);
    cp_commit();
    float dk[8][4], dv[8][4], s[8][4], dp[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.f;
        dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;
    }
    unsigned pa[4][4], da[4][4];  // Pᵀ and dSᵀ of the previous tile
    const float sl2 = (float)g.scale * FA_LOG2E;
    i64 key0 = k0 + warp * 16 + gq;  // this thread's first key row (the other is key0 + 8)
    // (First iteration apart: see fa_fwd_wg.)
    auto step = [&](int it, bool first) {
        cp_wait_all();
        fence_async_smem();
        __syncthreads();
        if (it + 1 < total) stage(it + 1);
        cp_commit();
        int buf = it % FA_ST, pbuf = (it + FA_ST - 1) % FA_ST;
        i64 h = hk * grp + it / ntq, i0 = i_start + (i64)(it % ntq) * FB_B;
        // Groups: Sᵀ[key][query], dPᵀ[key][query], then dV and dK of the previous tile; P
        // is computed while dPᵀ and those run.
        wg_fence();
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) Wg<T, 0>::ss(s, wg_desc_k(sK, kc), wg_desc_k(sQ + buf * TILE, kc), kc);
        wg_commit();
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) Wg<T, 0>::ss(dp, wg_desc_k(sV, kc), wg_desc_k(sdY + buf * TILE, kc), kc);
        wg_commit();
        if (!first) {
            wg_pb<T>(dv, pa, sdY + pbuf * TILE);
            wg_pb<T>(dk, da, sQ + pbuf * TILE);
            wg_commit();
        }
        wg_wait_n(first ? 1 : 2);
        wg_keep(s);
        bool edge = MASK || (g.causal && i0 < k0 + FB_B);
        const float* L = sL + buf * FB_B;
        const float* Dl = sD + buf * FB_B;
        // log2 P = scale·log2(e)·S − LSE (+ the mask, in fa_edge)
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nb][e] = fmaf(s[nb][e], sl2, -L[nb * 8 + 2 * tq + (e & 1)]);
        if (edge) fa_edge<T, MASK>(g, s, mask, b, h, key0, i0, 1);
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nb][e] = fa_ex2(s[nb][e]);
        wg_wait_late(g, first ? 0 : 1);
        wg_keep(dp);
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[nb][e] = s[nb][e] * (dp[nb][e] - Dl[nb * 8 + 2 * tq + (e & 1)]);
        if (!first) {
            wg_keep(s);  // (P and dS before the wait)
            wg_keep(dp);
            wg_wait_late(g, 0);
            wg_keep(dv);
            wg_keep(dk);
            wg_keep_a(pa);
            wg_keep_a(da);
        }
        pack_a<T>(pa, s);
        pack_a<T>(da, dp);
    };
    if (total > 0) {
        step(0, true);
        for (int it = 1; it < total; ++it) step(it, false);
        int pbuf = (total - 1) % FA_ST;
        wg_fence();
        wg_pb<T>(dv, pa, sdY + pbuf * TILE);
        wg_pb<T>(dk, da, sQ + pbuf * TILE);
        wg_commit();
        wg_wait();
        wg_keep(dv);
        wg_keep(dk);
        wg_keep_a(pa);
        wg_keep_a(da);
    }
    float sc = (float)g.scale;
    store_acc<T, DP>(dK + att_off(g, ATT_K, b, hk, 0), g.st[ATT_K][2], dk, k0 + warp * 16, g.skv, (int)g.d, sc, sc);
    store_acc<T, DP>(dV + att_off(g, ATT_V, b, hk, 0), g.st[ATT_V][2], dv, k0 + warp * 16, g.skv, (int)g.dv, 1.f, 1.f);
}

// ---------------------------------------------------------------------------------------
// Backward in one pass (sm_90a, heads up to 64; FlashAttention-2/3's structure): per key
// tile, S, P, dP and dS of each query tile are computed once and feed all three gradients:
// dV += Pᵀ·dY and dK += dSᵀ·Q stay in registers, dQ_i += dS·K is added into an f32
// accumulator `dqa` (every key tile of a query tile adds its part: the order of those
// sums, and so the last bits of dQ, vary from run to run). `dqa` holds 64 × 64 tiles of
// 16 KiB, [B·Hq, ⌈Sq/64⌉, 4096], each in the order of the accumulator registers (FA_DQA:
// a warp's 32 lanes add 256 contiguous bytes), added with `red.global.add.v2.f32` (in
// that order 0.71 ms on the H100 for the attention workload, in row-major order 0.88;
// staging the tile in shared memory for one bulk reduction, `cp.reduce.async.bulk .add.f32`,
// was tried, measured 0.74 ms and removed: docs/bench-h100/attention-notes.md, "Session 5 —
// backward"). Five products per
// tile pair instead of the two passes' seven. fa_bwd_pre computes delta = rowsum(dY∘Y)
// and zeroes `dqa` first; fa_dq_out scales and converts it to dQ.
// (`--tune cuda_attention=bwd2` keeps the deterministic two passes, fa_dq + fa_dkv.)

// A operand MN-major (stored transposed: rows are the reduction, 64 contiguous M) from
// shared memory, B as Wg (TB = 1: MN-major).
#define FA_WGMMA_SST_BODY(TY)                                                                              \
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %35, 0;\n"                                               \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " FA_WG_DREGS ", "            \
                 "%32, %33, p, 1, 1, 1, %34; }"                                                            \
                 : FA_WG_D                                                                                 \
                 : "l"(adesc), "l"(desc), "n"(TB), "r"(acc))
template <class T, int TB> struct WgT;
template <int TB> struct WgT<bf16, TB> {
    static __device__ __forceinline__ void ss(float (*d)[4], unsigned long long adesc, unsigned long long desc, int acc) {
#if FA_HAVE_WG
        FA_WGMMA_SST_BODY("bf16");
#endif
    }
};
template <int TB> struct WgT<f16, TB> {
    static __device__ __forceinline__ void ss(float (*d)[4], unsigned long long adesc, unsigned long long desc, int acc) {
#if FA_HAVE_WG
        FA_WGMMA_SST_BODY("f16");
#endif
    }
};

__device__ __forceinline__ void red_add2(float* p, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
}
// Element (warp w's accumulator n block nb, row half `half`, lane, e) of a dqa tile: that is
// row 16w + 8·half + lane / 4, column 8·nb + 2·(lane % 4) + e.
#define FA_DQA(w, nb, half, lane) ((((w) * 8 + (nb)) * 2 + (half)) * 64 + (lane) * 2)

// delta (as fa_delta) for 64 query rows a CTA of 128 threads, and those rows of `dqa` set
// to zero. (A driver memset of dqa instead, with delta alone here, measured no faster.) Grid (query blocks of 64, B·Hq).
template <class T> __device__ void fa_bwd_pre(const AttnGeom& g, const T* dY, const T* Y, float* delta, float* dqa, int vec) {
    int warp = threadIdx.x >> 5, gq = (threadIdx.x & 31) >> 2;
    i64 bh = blockIdx.y, b = bh / g.hq, h = bh % g.hq, q0 = (i64)blockIdx.x * FB_B;
    float D[2];
    fa_delta<T>(g, dY, Y, delta, b, h, bh, q0 + warp * 16 + gq, vec, D);
    // The tile: 4096 floats, 8 float4 a thread.
    float4* z = (float4*)(dqa + (bh * gridDim.x + blockIdx.x) * 4096);
#pragma unroll
    for (int k = 0; k < 8; ++k) z[threadIdx.x + k * 128] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// dQ = scale · dqa, in dQ's layout: 64 rows a CTA of 128 threads, 8 columns a thread.
template <class T> __device__ void fa_dq_out(const AttnGeom& g, const float* dqa, T* dQ, int vec) {
    i64 bh = blockIdx.y, b = bh / g.hq, h = bh % g.hq, q0 = (i64)blockIdx.x * FB_B;
    const float sc = (float)g.scale;
    T* dst = dQ + att_off(g, ATT_Q, b, h, 0);
    i64 rs = g.st[ATT_Q][2];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        int idx = threadIdx.x + k * 128, r = idx / 8, c0 = (idx % 8) * 8;
        i64 row = q0 + r;
        if (row >= g.sq || c0 >= g.d) continue;
        // (the 8 columns of a row's n block are lanes 4·(r % 8) .. + 3 of one store)
        const float4* s = (const float4*)(dqa + (bh * gridDim.x + blockIdx.x) * 4096 + FA_DQA(r >> 4, c0 >> 3, (r >> 3) & 1, (r & 7) * 4));
        float4 x = s[0], y = s[1];
        float v[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
        if (vec) {  // (d % 8 == 0, rows 16-byte aligned)
            unsigned short o[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = st<T>(v[e] * sc).x;
            *(uint4*)(dst + row * rs + c0) = *(const uint4*)o;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (c0 + e < g.d) dst[row * rs + c0 + e] = st<T>(v[e] * sc);
        }
    }
}

// The one-pass backward: grid and rows as fa_dkv_wg (key blocks of 64, B·Hkv; every query
// tile of every query head of the kv group), one warpgroup. Iteration it issues Sᵀ and dPᵀ
// of query tile it, then dV += Pᵀ·dY, dK += dSᵀ·Q and dQ = dS·K of tile it − 1, computes P
// and dS of tile it meanwhile, then adds that dQ into `dqa` (`red.global`) and leaves dSᵀ
// of tile it in shared memory (a ring of 2: the A operand of tile it's dK and, transposed,
// of its dQ).
template <class T, bool MASK> __device__ void fa_bwd_wg(const AttnGeom& g, const T* dY, const T* Q, const T* K, const T* V, const void* mask, const float* lse, const float* delta, float* dqa, T* dK, T* dV, T* dmask, int vec) {
    constexpr int DP = 64, NT = 128, TILE = FB_B * DP * 2;
    unsigned sK = smem_u32(fa_base());
    unsigned sV = sK + TILE, sQ = sV + TILE, sdY = sQ + FA_ST * TILE, sdS = sdY + FA_ST * TILE;
    // (Two tiles after dSᵀ's are unused: they held the removed bulk form's f32 dQ tile; kept
    // so that the SASS, LSE's and delta's addresses included, stays as measured.)
    float* sL = (float*)(fa_base() + (6 + 2 * FA_ST) * TILE);  // [FA_ST][FB_B] log2 LSE
    float* sD = sL + FA_ST * FB_B;                              // [FA_ST][FB_B] delta
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    i64 bhk = blockIdx.y, b = bhk / g.hkv, hk = bhk % g.hkv, grp = g.hq / g.hkv;
    i64 k0 = (i64)blockIdx.x * FB_B;
    const i64 ntqa = (g.sq + FB_B - 1) / FB_B;  // dqa tiles a head
    int kvalid = (int)(g.skv - k0 < FB_B ? g.skv - k0 : FB_B);
    i64 i_start = g.causal ? (k0 / FB_B) * FB_B : 0;
    int ntq = g.sq > i_start ? (int)((g.sq - i_start + FB_B - 1) / FB_B) : 0;
    int total = (int)(ntq * grp);
    load_tile<DP, NT>(sK, (const unsigned short*)K + att_off(g, ATT_K, b, hk, k0), g.st[ATT_K][2], FB_B, kvalid, (int)g.d, vec);
    load_tile<DP, NT>(sV, (const unsigned short*)V + att_off(g, ATT_V, b, hk, k0), g.st[ATT_V][2], FB_B, kvalid, (int)g.dv, vec);
    auto stage = [&](int it) {
        i64 h = hk * grp + it / ntq, i0 = i_start + (i64)(it % ntq) * FB_B;
        i64 bh = b * g.hq + h;
        int qv = (int)(g.sq - i0 < FB_B ? g.sq - i0 : FB_B);
        int buf = it % FA_ST;
        load_tile<DP, NT>(sQ + buf * TILE, (const unsigned short*)Q + att_off(g, ATT_Q, b, h, i0), g.st[ATT_Q][2], FB_B, qv, (int)g.d, vec);
        load_tile<DP, NT>(sdY + buf * TILE, (const unsigned short*)dY + att_off(g, ATT_Y, b, h, i0), g.st[ATT_Y][2], FB_B, qv, (int)g.dv, vec);
        for (int r = threadIdx.x; r < FB_B; r += NT) {
            float L = r < qv ? lse[bh * g.sq + i0 + r] : neg_inf(0.f);
            sL[buf * FB_B + r] = L == neg_inf(L) ? -neg_inf(0.f) : L * FA_LOG2E;
            sD[buf * FB_B + r] = r < qv ? delta[bh * g.sq + i0 + r] : 0.f;
        }
    };
    if (total > 0) stage(0);
    cp_commit();
    float dk[8][4], dv[8][4], dq[8][4], s[8][4], dp[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.f;
        dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;
    }
    unsigned pa[4][4];  // Pᵀ of the previous tile (dSᵀ goes through shared memory)
    const float sl2 = (float)g.scale * FA_LOG2E;
    i64 key0 = k0 + warp * 16 + gq;  // this thread's first key row (the other is key0 + 8)
    // Issues dV, dK and dQ of tile it (its Q/dY stage and dSᵀ buffer); one group.
    auto grads = [&](int it) {
        int buf = it % FA_ST;
        unsigned ds = sdS + (it & 1) * TILE;
        wg_pb<T>(dv, pa, sdY + buf * TILE);
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) Wg<T, 1>::ss(dk, wg_desc_k(ds, kc), wg_desc_mn(sQ + buf * TILE, kc), 1);
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) WgT<T, 1>::ss(dq, wg_desc_mn(ds, kc), wg_desc_mn(sK, kc), kc);
        wg_commit();
    };
    // dqa's tile of query tile it.
    auto dqa_tile = [&](int it) { return dqa + ((b * g.hq + hk * grp + it / ntq) * ntqa + (i_start / FB_B + it % ntq)) * 4096; };
    // dQ of tile it (this warp's 16 query rows) added into dqa.
    auto add_dq = [&](int it) {
        float* p = dqa_tile(it);
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int nb = 0; nb < 8; ++nb) red_add2(p + FA_DQA(warp, nb, half, lane), dq[nb][2 * half], dq[nb][2 * half + 1]);
    };
    // (First iteration apart: see fa_fwd_wg.)
    auto step = [&](int it, bool first) {
        cp_wait_all();
        fence_async_smem();
        __syncthreads();
        if (it + 1 < total) stage(it + 1);
        cp_commit();
        int buf = it % FA_ST;
        i64 h = hk * grp + it / ntq, i0 = i_start + (i64)(it % ntq) * FB_B;
        wg_fence();
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) Wg<T, 0>::ss(s, wg_desc_k(sK, kc), wg_desc_k(sQ + buf * TILE, kc), kc);
        wg_commit();
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) Wg<T, 0>::ss(dp, wg_desc_k(sV, kc), wg_desc_k(sdY + buf * TILE, kc), kc);
        wg_commit();
        if (!first) grads(it - 1);
        wg_wait_n(first ? 1 : 2);
        wg_keep(s);
        bool edge = MASK || (g.causal && i0 < k0 + FB_B);
        const float* L = sL + buf * FB_B;
        const float* Dl = sD + buf * FB_B;
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nb][e] = fmaf(s[nb][e], sl2, -L[nb * 8 + 2 * tq + (e & 1)]);
        if (edge) fa_edge<T, MASK>(g, s, mask, b, h, key0, i0, 1);
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nb][e] = fa_ex2(s[nb][e]);
        wg_wait_late(g, first ? 0 : 1);
        wg_keep(dp);
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[nb][e] = s[nb][e] * (dp[nb][e] - Dl[nb * 8 + 2 * tq + (e & 1)]);
        if (dmask) {
            i64 bh = b * g.hq + h;
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    i64 j = key0 + (e >> 1) * 8, i = i0 + nb * 8 + 2 * tq + (e & 1);
                    if (i < g.sq && j < g.skv) dmask[(bh * g.sq + i) * g.skv + j] = st<T>(dp[nb][e]);
                }
        }
        if (!first) {
            wg_keep(s);  // (P and dS before the wait)
            wg_keep(dp);
            wg_wait_late(g, 0);
            wg_keep(dv);
            wg_keep(dk);
            wg_keep(dq);
            wg_keep_a(pa);
            add_dq(it - 1);
        }
        pack_a<T>(pa, s);
        unsigned da[4][4];
        pack_a<T>(da, dp);
        store_afrag64(sdS + (it & 1) * TILE, warp * 16, da);
    };
    if (total > 0) {
        step(0, true);
        for (int it = 1; it < total; ++it) step(it, false);
        fence_async_smem();
        __syncthreads();
        wg_fence();
        grads(total - 1);
        wg_wait();
        wg_keep(dv);
        wg_keep(dk);
        wg_keep(dq);
        wg_keep_a(pa);
        add_dq(total - 1);
    }
    float sc = (float)g.scale;
    store_acc<T, DP>(dK + att_off(g, ATT_K, b, hk, 0), g.st[ATT_K][2], dk, k0 + warp * 16, g.skv, (int)g.d, sc, sc);
    store_acc<T, DP>(dV + att_off(g, ATT_V, b, hk, 0), g.st[ATT_V][2], dv, k0 + warp * 16, g.skv, (int)g.dv, 1.f, 1.f);
}

// Forward for head sizes up to 64 and 128; backward up to 64 (at 128 its accumulators
// spill: larger heads take the SIMT kernels of attention.cu).
// Kernels without a mask (`_m` with one: its loads cost registers the common case does
// not need); forward for head sizes up to 64 and 128, backward up to 64 (at 128 its
// accumulators spill: larger heads take the row-per-warp kernels of attention.cu).
// WG: wgmma where the chip has it (heads up to 64); the `_mma` kernels keep mma.sync, to
// compare the two on one device (`--tune cuda_attention=mma`).
#define FA_WG_FOR(DP) (FA_HAVE_WG && (DP) == 64)
#define INST_FA_FWD(T, S, DP, M, MS, WG)                                                                            \
    extern "C" __global__ void __launch_bounds__(FA_BQ / (16 * FA_MT(DP)) * 32, 128 / DP) fa_fwd_##S##_##DP##MS(       \
        AttnGeom g, const T* q, const T* k, const T* v, const void* m, T* y, float* lse, int vec) {                \
        if constexpr (WG) fa_fwd_wg<T, M>(g, q, k, v, m, y, lse, vec); else fa_fwd<T, DP, M>(g, q, k, v, m, y, lse, vec); \
    }
#define INST_FA_BWD(T, S, M, MS, WG)                                                                                        \
    extern "C" __global__ void __launch_bounds__(FB_B * 2, M ? 1 : 3) fa_dq_##S##_64##MS(                                   \
        AttnGeom g, const T* dy, const T* q, const T* k, const T* v, const void* m, const float* lse, float* delta, T* dq, T* dm, int vec, const T* y) { \
        if constexpr (WG) fa_dq_wg<T, M>(g, dy, q, k, v, m, lse, delta, dq, dm, vec, y);                                 \
        else fa_dq<T, 64, M>(g, dy, q, k, v, m, lse, delta, dq, dm, vec, y);                                               \
    }                                                                                                                      \
    extern "C" __global__ void __launch_bounds__(FB_B * 2, M ? 1 : WG ? 2 : 3) fa_dkv_##S##_64##MS(                        \
        AttnGeom g, const T* dy, const T* q, const T* k, const T* v, const void* m, const float* lse, const float* delta, T* dk, T* dv, int vec) { \
        if constexpr (WG) fa_dkv_wg<T, M>(g, dy, q, k, v, m, lse, delta, dk, dv, vec);                                   \
        else fa_dkv<T, 64, M>(g, dy, q, k, v, m, lse, delta, dk, dv, vec);                                                 \
    }
#define INST_FA(T, S)                                                                                       \
    INST_FA_FWD(T, S, 64, false, , FA_WG_FOR(64)) INST_FA_FWD(T, S, 64, true, _m, FA_WG_FOR(64))            \
    INST_FA_FWD(T, S, 128, false, , false) INST_FA_FWD(T, S, 128, true, _m, false)                          \
    INST_FA_BWD(T, S, false, , FA_WG_FOR(64)) INST_FA_BWD(T, S, true, _m, FA_WG_FOR(64))                    \
    INST_FA_FWD(T, S, 64, false, _mma, false) INST_FA_BWD(T, S, false, _mma, false)
INST_FA(bf16, bf16)
INST_FA(f16, f16)
// The persistent warp-specialized forward (sm_90a only; elsewhere an empty body the host
// never launches): NC consumer warpgroups of 64 query rows.
#define INST_FA_WSP(T, S, NC, M, MS)                                                                             \
    extern "C" __global__ void __launch_bounds__(((NC) + 1) * 128, 1) fa_fwd_wsp##NC##_##S##_64##MS(             \
        AttnGeom g, const T* q, const T* k, const T* v, const void* m, T* y, float* lse, int vec, int chunk, int nbh, \
        int* work) {                                                                                                  \
        if constexpr (FA_HAVE_WG) fa_fwd_wsp<T, M, NC>(g, q, k, v, m, y, lse, vec, chunk, nbh, work);        \
    }
#define INST_FA_WSP_M(T, S, NC) INST_FA_WSP(T, S, NC, false, ) INST_FA_WSP(T, S, NC, true, _m)
INST_FA_WSP_M(bf16, bf16, 3)
INST_FA_WSP_M(f16, f16, 3)

// The one-pass backward (fa_bwd_wg; sm_90a only: elsewhere the host keeps fa_dq + fa_dkv)
// and its pre- and post-passes.
#define INST_FA_BWD1(T, S, M, MS)                                                                                           \
    extern "C" __global__ void __launch_bounds__(FB_B * 2, M ? 1 : 2) fa_bwd_##S##_64##MS(                                  \
        AttnGeom g, const T* dy, const T* q, const T* k, const T* v, const void* m, const float* lse, const float* delta,   \
        float* dqa, T* dk, T* dv, T* dm, int vec) {                                                                          \
        if constexpr (FA_WG_FOR(64)) fa_bwd_wg<T, M>(g, dy, q, k, v, m, lse, delta, dqa, dk, dv, dm, vec);           \
    }
#define INST_FA_BWD1_ALL(T, S)                                                                                              \
    INST_FA_BWD1(T, S, false, ) INST_FA_BWD1(T, S, true, _m)                                                                \
    extern "C" __global__ void __launch_bounds__(FB_B * 2) fa_bwd_pre_##S(AttnGeom g, const T* dy, const T* y, float* delta, float* dqa, int vec) { \
        fa_bwd_pre<T>(g, dy, y, delta, dqa, vec);                                                                           \
    }                                                                                                                      \
    extern "C" __global__ void __launch_bounds__(FB_B * 2) fa_dq_out_##S(AttnGeom g, const float* dqa, T* dq, int vec) {    \
        fa_dq_out<T>(g, dqa, dq, vec);                                                                                      \
    }
INST_FA_BWD1_ALL(bf16, bf16)
INST_FA_BWD1_ALL(f16, f16)

// The warp-specialized one-pass backward (sm_90a), persistent: fa_bwd_wg's math for two
// 64-key tiles a CTA item (128 keys), one consumer warpgroup each, and a producer warpgroup
// that streams the query tiles (Q, dY, LSE and delta) of the key block's walk into a ring of
// FA_BWS_ST stages for both (producer 24 registers, consumers 240). Each consumer adds its
// own dQ parts into `dqa` (red.v2, as fa_bwd_wg). Causal: the second consumer passes over
// the query tile of its first 64 keys (waits and releases it). No mask, no dMask (the host
// keeps fa_bwd_wg for those). The one-CTA-an-item form fa_bwd_ws it replaced (fa_bws, 582
// against 520 µs for the attention workload) is in the history at c482a73.
#define FA_BWS_ST 4
// One CTA an SM takes (128-key block, kv head) items — the same chunked,
// longest-first order — one after another, from a counter `work` (zeroed by the host before
// the launch; null: item blockIdx.x + j·gridDim.x). K/V are double-buffered: the producer
// loads item j + 1's K/V as soon as item j − 1's consumers have stored dK/dV through them
// (their `kvempty` arrivals), and the Q/dY ring runs on across items (its stage counter never
// restarts), so that a CTA's prologue (K/V landing, the first stages) and the previous
// item's epilogue overlap. Item fields are decoded once by the producer's thread 0 into a
// slot beside the K/V buffer (b, kv head, first key; first key −1 ends the walk). Index
// math in 32 bits (the dqa tile and LSE/delta rows as counters, no 64-bit division).
// LATE: a tile's dQ atomics issued after the dSᵀ barrier instead of before its stores (the
// barrier's proxy fence waited for them: 585-590 µs against 520-525 for the attention
// workload on the H100; only LATE is instantiated). ALD: LSE and delta copied by cp.async
// with the stage (rows past Sq zero-filled: their Q and dY rows are zero, so they add
// nothing) and scaled by log2 e in the consumer, instead of loaded and stored by the
// producer (3-4 µs faster). (Small edits here moved the kernel by ±10 µs through ptxas's
// schedule — the diagonal tile tested as ti == tmin instead of ti == c cost 11-15 µs: check
// the SASS and measure against this form. Also measured and removed: the next stage's phase
// tested early (mbarrier.test_wait under the products), +5-9 µs; dQ by red.v4 with lane
// pairs swapping halves by shuffle, +35 µs; the consumers' tiles pipelined across items (an
// item's last gradients issued with the next item's first Sᵀ/dPᵀ), ±0:
// docs/bench-h100/attention-notes.md, session 6.)
template <class T, bool LATE, bool ALD> __device__ void fa_bwd_wsp(const AttnGeom& g, const T* dY, const T* Q, const T* K, const T* V, const float* lse, const float* delta, float* dqa, T* dK, T* dV, int vec, int chunk, int nbh, int* work) {
    constexpr int DP = 64, TILE = FB_B * DP * 2, ST = FA_BWS_ST;
    static_assert(ST == 4, "stage index and parity are shifts");
    // Shared memory: K[2 buffers][2 consumers], V[2][2], dSᵀ[2 consumers][2], ST stages of
    // (Q, dY), [ST][2][64] floats (log2 LSE, delta), the mbarriers full[ST], empty[ST],
    // kvfull[2], kvempty[2], then the item slots [2][4] ints.
    const unsigned sK = smem_u32(fa_base()), sV = sK + 4 * TILE, sdS = sK + 8 * TILE, sQ = sK + 12 * TILE;
    float* sLD = (float*)(fa_base() + (12 + 2 * ST) * TILE);
    const unsigned bars = sK + (12 + 2 * ST) * TILE + ST * 2 * FB_B * 4;
    auto full = [&](unsigned s) { return bars + 8u * s; };
    auto empty = [&](unsigned s) { return bars + 8u * (ST + s); };
    auto kvfull = [&](int buf) { return bars + 8u * (2 * ST + buf); };
    auto kvempty = [&](int buf) { return bars + 8u * (2 * ST + 2 + buf); };
    volatile int* slot = (volatile int*)(fa_base() + (12 + 2 * ST) * TILE + ST * 2 * FB_B * 4 + 8 * (2 * ST + 4));
    const int wg = threadIdx.x >> 7;
    const int sq = (int)g.sq, skv = (int)g.skv, hq = (int)g.hq, grp = (int)(g.hq / g.hkv);
    const bool causal = g.causal != 0;
    if (threadIdx.x == 0) {
        for (int s = 0; s < ST; ++s) {
            mb_init(full(s), 128);
            mb_init(empty(s), 8);
        }
        for (int b = 0; b < 2; ++b) {
            mb_init(kvfull(b), 128);
            mb_init(kvempty(b), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (wg == 0) {
        wg_setmaxnreg_dec<24>();
        unsigned pend = 0;
        auto issued = [&](unsigned bar) {
            cp_commit();
            asm volatile("cp.async.wait_group 1;" ::: "memory");
            fence_async_smem();
            if (pend) mb_arrive(pend);
            pend = bar;
        };
        const int nkb = (skv + 2 * FB_B - 1) / (2 * FB_B);
        unsigned gs = 0;  // stream tiles issued (all items)
#pragma unroll 1
        for (int j = 0;; ++j) {
            const int buf = j & 1;
            if (j >= 2) mb_wait(kvempty(buf), (unsigned)(((j >> 1) - 1) & 1));
            volatile int* sl = slot + 4 * buf;
            if (threadIdx.x == 0) {
                const int t = work ? atomicAdd(work, 1) : (int)blockIdx.x + j * (int)gridDim.x;
                if (t >= nkb * nbh) {
                    sl[2] = -1;
                } else {
                    const int ci = t / (chunk * nkb), cr = t - ci * chunk * nkb;
                    const int chb = nbh - ci * chunk < chunk ? nbh - ci * chunk : chunk;  // heads of this chunk
                    const int kb = cr / chb, bhk = ci * chunk + (cr - kb * chb), b = bhk / (int)g.hkv;
                    sl[0] = b;
                    sl[1] = bhk - b * (int)g.hkv;
                    sl[2] = kb * 2 * FB_B;
                }
            }
            asm volatile("bar.sync 3, 128;" ::: "memory");
            const int b = sl[0], hk = sl[1], k0 = sl[2];
            if (k0 < 0) {
                cp_wait_all();
                fence_async_smem();
                if (pend) mb_arrive(pend);
                mb_arrive(kvfull(buf));
                return;
            }
#pragma unroll 1
            for (int c = 0; c < 2; ++c) {
                const int kc0 = k0 + c * FB_B, kv = skv - kc0 < FB_B ? (skv - kc0 > 0 ? skv - kc0 : 0) : FB_B, kr = kv > 0 ? kc0 : 0;
                const unsigned t = (2 * buf + c) * TILE;
                load_tile<DP, 128>(sK + t, (const unsigned short*)K + att_off(g, ATT_K, b, hk, kr), g.st[ATT_K][2], FB_B, kv, (int)g.d, vec);
                load_tile<DP, 128>(sV + t, (const unsigned short*)V + att_off(g, ATT_V, b, hk, kr), g.st[ATT_V][2], FB_B, kv, (int)g.dv, vec);
            }
            issued(kvfull(buf));
            // The walk: every query tile from i_start of every query head of the kv group.
            const int i_start = causal ? k0 : 0, ntq = sq > i_start ? (sq - i_start + FB_B - 1) / FB_B : 0;
#pragma unroll 1
            for (int hi = 0; hi < grp; ++hi) {
                const int h = hk * grp + hi, bh = b * hq + h;
#pragma unroll 1
                for (int ti = 0; ti < ntq; ++ti, ++gs) {
                    const unsigned s = gs & (ST - 1);
                    if (gs >= ST) mb_wait(empty(s), ((gs >> 2) - 1) & 1);
                    const int i0 = i_start + ti * FB_B, qv = sq - i0 < FB_B ? sq - i0 : FB_B;
                    const unsigned st = sQ + s * 2 * TILE;
                    load_tile<DP, 128>(st, (const unsigned short*)Q + att_off(g, ATT_Q, b, h, i0), g.st[ATT_Q][2], FB_B, qv, (int)g.d, vec);
                    load_tile<DP, 128>(st + TILE, (const unsigned short*)dY + att_off(g, ATT_Y, b, h, i0), g.st[ATT_Y][2], FB_B, qv, (int)g.dv, vec);
                    const int r = threadIdx.x & 63;
                    const i64 row = (i64)bh * sq + i0 + r;
                    if (ALD) {
                        const float* src = threadIdx.x < 64 ? lse : delta;
                        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_u32(sLD + s * 128 + threadIdx.x)), "l"(r < qv ? src + row : src), "r"(r < qv ? 4 : 0) : "memory");
                    } else if (threadIdx.x < 64) {
                        float L = r < qv ? lse[row] : neg_inf(0.f);
                        sLD[s * 128 + r] = L == neg_inf(L) ? -neg_inf(0.f) : L * FA_LOG2E;
                    } else {
                        sLD[s * 128 + 64 + r] = r < qv ? delta[row] : 0.f;
                    }
                    issued(full(s));
                }
            }
        }
    }
    wg_setmaxnreg_inc<240>();
    const int c = wg - 1, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    const int ntqa = (sq + FB_B - 1) / FB_B;  // dqa tiles a head
    const unsigned sdSc = sdS + c * 2 * TILE;
    auto arrive_warp = [&](unsigned bar) {
        __syncwarp();
        if (lane == 0) mb_arrive(bar);
    };
    float dk[8][4], dv[8][4], dq[8][4], s[8][4], dp[8][4];
    unsigned pa[4][4];  // Pᵀ of the previous tile (dSᵀ goes through shared memory)
    const float sl2 = (float)g.scale * FA_LOG2E;
    // Issues dV, dK and dQ of the stream tile in stage `sb` (the n-th this consumer computes
    // in the item); one group.
    auto grads = [&](unsigned sb, int n, unsigned sKc) {
        const unsigned st = sQ + sb * 2 * TILE, ds = sdSc + (n & 1) * TILE;
        wg_pb<T>(dv, pa, st + TILE);
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) Wg<T, 1>::ss(dk, wg_desc_k(ds, kc), wg_desc_mn(st, kc), 1);
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) WgT<T, 1>::ss(dq, wg_desc_mn(ds, kc), wg_desc_mn(sKc, kc), kc);
        wg_commit();
    };
    auto add_dq = [&](int dqi) {
        float* p = dqa + (size_t)(unsigned)dqi * 4096u;
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int nb = 0; nb < 8; ++nb) red_add2(p + FA_DQA(warp, nb, half, lane), dq[nb][2 * half], dq[nb][2 * half + 1]);
    };
    // Stream tile in stage `sb` (the n-th computed; `psb`/`pdqi` the stage and dqa tile of
    // the one before, n > 0): Sᵀ and dPᵀ of it, the gradients of the previous under its
    // softmax, then P and dSᵀ of it left for the next. `edge`: the causal diagonal tile (its
    // first query is this consumer's first key).
    auto step = [&](unsigned sb, bool edge, unsigned psb, int pdqi, int n, bool first, unsigned sKc, unsigned sVc) {
        const unsigned st = sQ + sb * 2 * TILE;
        wg_fence();
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) Wg<T, 0>::ss(s, wg_desc_k(sKc, kc), wg_desc_k(st, kc), kc);
        wg_commit();
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) Wg<T, 0>::ss(dp, wg_desc_k(sVc, kc), wg_desc_k(st + TILE, kc), kc);
        wg_commit();
        if (!first) grads(psb, n - 1, sKc);
        wg_wait_n(first ? 1 : 2);
        wg_keep(s);
        const float* L = sLD + sb * 128;
        const float* Dl = L + 64;
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nb][e] = fmaf(s[nb][e], sl2, -(ALD ? L[nb * 8 + 2 * tq + (e & 1)] * FA_LOG2E : L[nb * 8 + 2 * tq + (e & 1)]));
        if (edge) {
            // key − query of element (row gq + 8·(e / 2), column 8·nb + 2·tq + e % 2)
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (warp * 16 + gq + (e >> 1) * 8 - (nb * 8 + 2 * tq + (e & 1)) > 0) s[nb][e] = neg_inf(0.f);
        }
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nb][e] = fa_ex2(s[nb][e]);
        wg_wait_late(g, first ? 0 : 1);
        wg_keep(dp);
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[nb][e] = s[nb][e] * (dp[nb][e] - Dl[nb * 8 + 2 * tq + (e & 1)]);
        if (!first) {
            wg_keep(s);  // (P and dS before the wait)
            wg_keep(dp);
            wg_wait_late(g, 0);
            wg_keep(dv);
            wg_keep(dk);
            wg_keep(dq);
            wg_keep_a(pa);
            if (!LATE) add_dq(pdqi);
            arrive_warp(empty(psb));
        }
        pack_a<T>(pa, s);
        unsigned da[4][4];
        pack_a<T>(da, dp);
        store_afrag64(sdSc + (n & 1) * TILE, warp * 16, da);
        // (dSᵀ is read by the next grads: every warp's rows, through the async proxy)
        fence_async_smem();
        fa_wg_bar(1 + c);
        if (LATE && !first) add_dq(pdqi);
    };
    unsigned gs = 0;  // stream tiles consumed (all items)
#pragma unroll 1
    for (int j = 0;; ++j) {
        const int buf = j & 1;
        mb_wait(kvfull(buf), (unsigned)((j >> 1) & 1));
        volatile int* sl = slot + 4 * buf;
        const int k0 = sl[2];
        if (k0 < 0) break;
        const int kc0 = k0 + c * FB_B;
        const unsigned sKc = sK + (2 * buf + c) * TILE, sVc = sV + (2 * buf + c) * TILE;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.f;
            dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;
        }
        {
            const int i_start = causal ? k0 : 0, ntq = sq > i_start ? (sq - i_start + FB_B - 1) / FB_B : 0, total = ntq * grp;
            // This consumer's keys see query tile ti of a head iff it has keys and (causal)
            // the tile's first row ≥ kc0, i.e. ti ≥ c; the diagonal tile is ti == c.
            const int tmin = kc0 >= skv ? ntq : causal ? c : 0;
            // The walk's position: tile ti of the head, dqi its dqa tile.
            int ti = 0, dqi = ((sl[0] * hq + sl[1] * grp) * ntqa + (i_start >> 6));
            auto next = [&]() {
                ++gs;
                ++dqi;
                if (++ti == ntq) {
                    ti = 0;
                    dqi += ntqa - ntq;
                }
            };
            // (The first computed tile apart, so that `first` is a constant in each step: a
            // run-time wgmma wait count serializes the products.)
            int t = 0;
#pragma unroll 1
            for (; t < total; ++t) {
                mb_wait(full(gs & (ST - 1)), (gs >> 2) & 1);
                if (ti >= tmin) break;
                arrive_warp(empty(gs & (ST - 1)));
                next();
            }
            if (t < total) {
                step(gs & (ST - 1), causal && ti == c, 0, 0, 0, true, sKc, sVc);
                unsigned psb = gs & (ST - 1);
                int pdqi = dqi, n = 1;
                next();
#pragma unroll 1
                for (++t; t < total; ++t) {
                    const unsigned sb = gs & (ST - 1);
                    mb_wait(full(sb), (gs >> 2) & 1);
                    if (ti < tmin) {
                        arrive_warp(empty(sb));
                        next();
                        continue;
                    }
                    step(sb, causal && ti == c, psb, pdqi, n, false, sKc, sVc);
                    psb = sb;
                    pdqi = dqi;
                    ++n;
                    next();
                }
                wg_fence();
                grads(psb, n - 1, sKc);
                wg_wait();
                wg_keep(dv);
                wg_keep(dk);
                wg_keep(dq);
                wg_keep_a(pa);
                add_dq(pdqi);
                arrive_warp(empty(psb));
            }
        }
        const int b = sl[0], hk = sl[1];
        float sc = (float)g.scale;
        // (through this consumer's K and V tiles, read by no product any more; then the
        // buffer goes back to the producer)
        store_tile_wg<T>(dK + att_off(g, ATT_K, b, hk, 0), g.st[ATT_K][2], dk, kc0, skv, (int)g.d, vec, sc, sc, sKc, 1 + c);
        store_tile_wg<T>(dV + att_off(g, ATT_V, b, hk, 0), g.st[ATT_V][2], dv, kc0, skv, (int)g.dv, vec, 1.f, 1.f, sVc, 1 + c);
        arrive_warp(kvempty(buf));
    }
}
// (fa_bwsp<LATE><ALD>_*)
#define INST_FA_BWSP(T, S, LATE, ALD)                                                                                         \
    extern "C" __global__ void __launch_bounds__(384, 1) fa_bwsp##LATE##ALD##_##S##_64(AttnGeom g, const T* dy, const T* q,   \
        const T* k, const T* v, const float* lse, const float* delta, float* dqa, T* dk, T* dv, int vec, int chunk, int nbh, \
        int* work) {                                                                                                          \
        if constexpr (FA_HAVE_WG) fa_bwd_wsp<T, LATE, ALD>(g, dy, q, k, v, lse, delta, dqa, dk, dv, vec, chunk, nbh, work);   \
    }
#define INST_FA_BWSP_ALL(T, S) INST_FA_BWSP(T, S, 1, 0) INST_FA_BWSP(T, S, 1, 1)
INST_FA_BWSP_ALL(bf16, bf16)
INST_FA_BWSP_ALL(f16, f16)

// ---------------------------------------------------------------------------------------
// f32: 64×64 tiles on CUDA cores, 256 threads; thread (ty, tx) = (tid / 16, tid % 16) holds
// rows ty·4 + i and columns tx·4 + j (i, j < 4) of every 64×64 product. A product's step k
// reads one float4 of A (4 rows) and one of B (4 columns) for 16 FMAs. Tiles are 64 × 64
// floats in two layouts: T (transposed: element (r, c) at row c, so 4 consecutive r are one
// float4) for the left operand and the right operand of A·Bᵀ, N (as stored) for the right
// operand of A·B. Both XOR-swizzle 4-float groups so that the tile loads, the P/dS stores
// and the float4 reads spread over the banks.

#define FS_T 64
#define FS_TILE (FS_T * FS_T)

// Offsets of element (r, c) in the T and N layouts.
__device__ __forceinline__ int fs_t(int r, int c) { return c * FS_T + (r ^ (((c ^ (c >> 2)) & 7) << 2)); }
__device__ __forceinline__ int fs_n(int r, int c) { return r * FS_T + (c ^ ((r & 7) << 3)); }

// Loads `valid` rows of `width` floats (zero-padded to 64 × 64) into a T tile and/or an N
// tile (null: not wanted). With `vec` (width % 4 == 0, 16-byte aligned rows) a thread reads
// float4s, a warp two whole rows; otherwise a warp reads 4 rows × 8 columns, 32-byte pieces
// of rows, and stores that hit 32 different banks in either layout.
__device__ __forceinline__ void fs_load(float* t, float* n, const float* src, i64 rs, int valid, int width, int vec) {
    if (vec) {
#pragma unroll
        for (int it = 0; it < FS_TILE / 4 / 256; ++it) {
            int idx = threadIdx.x + it * 256, r = idx >> 4, c = (idx & 15) * 4;
            float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
            if (r < valid && c < width) x = *(const float4*)(src + r * rs + c);
            if (t) {
                t[fs_t(r, c)] = x.x;
                t[fs_t(r, c + 1)] = x.y;
                t[fs_t(r, c + 2)] = x.z;
                t[fs_t(r, c + 3)] = x.w;
            }
            if (n) *(float4*)&n[fs_n(r, c)] = x;
        }
        return;
    }
    for (int idx = threadIdx.x; idx < FS_TILE; idx += 256) {
        int w = idx >> 5, l = idx & 31;
        int r = (w >> 3) * 4 + (l & 3), c = (w & 7) * 8 + (l >> 2);
        float x = (r < valid && c < width) ? src[r * rs + c] : 0.f;
        if (t) t[fs_t(r, c)] = x;
        if (n) n[fs_n(r, c)] = x;
    }
}
// acc[i][j] += Σ_k A[ty·4+i][k] · B[k][tx·4+j]: A a T tile (of A, rows × k); B a T tile of
// Bᵀ (BT: A·Bᵀ with B stored rows × k) or an N tile (k × columns).
template <bool BT> __device__ __forceinline__ void fs_mm(float (*acc)[4], const float* A, const float* B) {
    int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
#pragma unroll
    for (int k = 0; k < FS_T; ++k) {
        float4 a = *(const float4*)&A[fs_t(ty * 4, k)];
        float4 b = BT ? *(const float4*)&B[fs_t(tx * 4, k)] : *(const float4*)&B[fs_n(k, tx * 4)];
        float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
}
// Stores this thread's 4 × 4 values x[i][j] (row ty·4+i, column tx·4+j of a product) as a
// T tile: the left operand of the next product (P·V, dS·K, Pᵀ·dY, dSᵀ·Q).
__device__ __forceinline__ void fs_store_t(float* t, const float (*x)[4]) {
    int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
#pragma unroll
    for (int j = 0; j < 4; ++j) *(float4*)&t[fs_t(ty * 4, tx * 4 + j)] = make_float4(x[0][j], x[1][j], x[2][j], x[3][j]);
}
__device__ __forceinline__ void fs_zero(float (*a)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i][0] = a[i][1] = a[i][2] = a[i][3] = 0.f;
}
__device__ __forceinline__ float fs_mask(const AttnGeom& g, const void* mask, i64 off, float x) {
    if (g.mask_kind == 1) return ((const unsigned char*)mask)[off] ? x : neg_inf(x);
    return x + ((const float*)mask)[off];
}
__device__ __forceinline__ float sum16(float v) {
    for (int o = 1; o < 16; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float max16(float v) {
    for (int o = 1; o < 16; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Stores rows r0 + ty·4 + i (< nrows; row stride rs), columns tx·4 + j (< width), times f[i].
__device__ __forceinline__ void fs_store(float* dst, i64 rs, const float (*acc)[4], i64 r0, i64 nrows, int width, const float* f) {
    int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        i64 r = r0 + ty * 4 + i;
        if (r >= nrows) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (tx * 4 + j < width) dst[r * rs + tx * 4 + j] = acc[i][j] * f[i];
    }
}

// Forward: shared memory Qᵀ, Kᵀ, V (N), Pᵀ: 4 tiles.
extern "C" __global__ void __launch_bounds__(256, 2) fs_fwd(AttnGeom g, const float* Q, const float* K, const float* V, const void* mask, float* Y, float* lse, int vec) {
    float* sQ = (float*)fa_smem;
    float *sK = sQ + FS_TILE, *sV = sK + FS_TILE, *sP = sV + FS_TILE;
    int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
    i64 qb = g.causal ? (i64)gridDim.x - 1 - blockIdx.x : blockIdx.x;
    i64 bh = blockIdx.y, b = bh / g.hq, h = bh % g.hq, hk = h / (g.hq / g.hkv);
    i64 q0 = qb * FS_T;
    i64 kend = g.skv;
    if (g.causal && q0 + FS_T < kend) kend = q0 + FS_T;
    const i64 krs = g.st[ATT_K][2], vrs = g.st[ATT_V][2];
    const float* Kb = K + att_off(g, ATT_K, b, hk, 0);
    const float* Vb = V + att_off(g, ATT_V, b, hk, 0);
    fs_load(sQ, nullptr, Q + att_off(g, ATT_Q, b, h, q0), g.st[ATT_Q][2], (int)(g.sq - q0 < FS_T ? g.sq - q0 : FS_T), (int)g.d, vec);
    float o[4][4], m[4], l[4];
    fs_zero(o);
    for (int i = 0; i < 4; ++i) m[i] = neg_inf(0.f), l[i] = 0.f;
    float sc = (float)g.scale;
    for (i64 j0 = 0; j0 < kend; j0 += FS_T) {
        int kv = (int)(g.skv - j0 < FS_T ? g.skv - j0 : FS_T);
        __syncthreads();
        fs_load(sK, nullptr, Kb + j0 * krs, krs, kv, (int)g.d, vec);
        fs_load(nullptr, sV, Vb + j0 * vrs, vrs, kv, (int)g.dv, vec);
        __syncthreads();
        float s[4][4];
        fs_zero(s);
        fs_mm<true>(s, sQ, sK);
        // Only tiles at the end of the keys, on the causal diagonal or with a mask check
        // each score.
        bool edge = g.mask_kind || j0 + FS_T > g.skv || (g.causal && j0 + FS_T - 1 > q0);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            i64 qi = q0 + ty * 4 + i;
            float mx = m[i];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                i64 kj = j0 + tx * 4 + j;
                float x = s[i][j] * sc;
                if (edge) {
                    if (kj >= g.skv || (g.causal && kj > qi)) x = neg_inf(x);
                    else if (g.mask_kind && qi < g.sq) x = fs_mask(g, mask, b * g.ms[0] + h * g.ms[1] + qi * g.ms[2] + kj * g.ms[3], x);
                }
                s[i][j] = x;
                mx = fmaxf(mx, x);
            }
            mx = max16(mx);
            float ref = mx == neg_inf(mx) ? 0.f : mx;
            float a = expf(m[i] - ref);
            m[i] = mx;
            float ps = 0.f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float p = expf(s[i][j] - ref);
                ps += p;
                s[i][j] = p;
                o[i][j] *= a;
            }
            l[i] = l[i] * a + ps;
        }
        fs_store_t(sP, s);
        __syncthreads();
        fs_mm<false>(o, sP, sV);
    }
    float f[4];
    for (int i = 0; i < 4; ++i) {
        l[i] = sum16(l[i]);
        f[i] = l[i] > 0.f ? 1.f / l[i] : 0.f;
    }
    fs_store(Y + att_off(g, ATT_Y, b, h, 0), g.st[ATT_Y][2], o, q0, g.sq, (int)g.dv, f);
    if (lse && tx == 0)
        for (int i = 0; i < 4; ++i) {
            i64 qi = q0 + ty * 4 + i;
            if (qi < g.sq) lse[bh * g.sq + qi] = l[i] > 0.f ? m[i] + logf(l[i]) : neg_inf(0.f);
        }
}

// dQ (and dMask): shared memory Qᵀ, dYᵀ, Kᵀ, Vᵀ, K (N), dSᵀ: 6 tiles.
extern "C" __global__ void __launch_bounds__(256, 2) fs_dq(AttnGeom g, const float* dY, const float* Q, const float* K, const float* V, const void* mask, const float* lse, const float* delta, float* dQ, float* dmask, int vec) {
    float* sQ = (float*)fa_smem;
    float *sdY = sQ + FS_TILE, *sK = sdY + FS_TILE, *sV = sK + FS_TILE, *sKn = sV + FS_TILE, *sS = sKn + FS_TILE;
    int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
    i64 qb = g.causal ? (i64)gridDim.x - 1 - blockIdx.x : blockIdx.x;
    i64 bh = blockIdx.y, b = bh / g.hq, h = bh % g.hq, hk = h / (g.hq / g.hkv);
    i64 q0 = qb * FS_T;
    int qv = (int)(g.sq - q0 < FS_T ? g.sq - q0 : FS_T);
    i64 kend = g.skv;
    if (g.causal && q0 + FS_T < kend) kend = q0 + FS_T;
    const i64 krs = g.st[ATT_K][2], vrs = g.st[ATT_V][2];
    const float* Kb = K + att_off(g, ATT_K, b, hk, 0);
    const float* Vb = V + att_off(g, ATT_V, b, hk, 0);
    fs_load(sQ, nullptr, Q + att_off(g, ATT_Q, b, h, q0), g.st[ATT_Q][2], qv, (int)g.d, vec);
    fs_load(sdY, nullptr, dY + att_off(g, ATT_Y, b, h, q0), g.st[ATT_Y][2], qv, (int)g.dv, vec);
    float L[4], Dl[4], acc[4][4];
    fs_zero(acc);
    for (int i = 0; i < 4; ++i) {
        i64 qi = q0 + ty * 4 + i;
        float x = qi < g.sq ? lse[bh * g.sq + qi] : neg_inf(0.f);
        L[i] = x == neg_inf(x) ? -neg_inf(0.f) : x;
        Dl[i] = qi < g.sq ? delta[bh * g.sq + qi] : 0.f;
    }
    float sc = (float)g.scale;
    for (i64 j0 = 0; j0 < kend; j0 += FS_T) {
        int kv = (int)(g.skv - j0 < FS_T ? g.skv - j0 : FS_T);
        __syncthreads();
        fs_load(sK, sKn, Kb + j0 * krs, krs, kv, (int)g.d, vec);
        fs_load(sV, nullptr, Vb + j0 * vrs, vrs, kv, (int)g.dv, vec);
        __syncthreads();
        float s[4][4], dp[4][4];
        fs_zero(s);
        fs_zero(dp);
        fs_mm<true>(s, sQ, sK);
        fs_mm<true>(dp, sdY, sV);
        bool edge = g.mask_kind || j0 + FS_T > g.skv || (g.causal && j0 + FS_T - 1 > q0);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            i64 qi = q0 + ty * 4 + i;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                i64 kj = j0 + tx * 4 + j;
                float x = s[i][j] * sc;
                if (edge) {
                    if (kj >= g.skv || (g.causal && kj > qi)) x = neg_inf(x);
                    else if (g.mask_kind && qi < g.sq) x = fs_mask(g, mask, b * g.ms[0] + h * g.ms[1] + qi * g.ms[2] + kj * g.ms[3], x);
                }
                float p = expf(x - L[i]);
                float ds = p * (dp[i][j] - Dl[i]);
                s[i][j] = ds;
                if (dmask && qi < g.sq && kj < g.skv) dmask[(bh * g.sq + qi) * g.skv + kj] = ds;
            }
        }
        fs_store_t(sS, s);
        __syncthreads();
        fs_mm<false>(acc, sS, sKn);
    }
    float f[4] = {sc, sc, sc, sc};
    fs_store(dQ + att_off(g, ATT_Q, b, h, 0), g.st[ATT_Q][2], acc, q0, g.sq, (int)g.d, f);
}

// dK, dV: shared memory Kᵀ, Vᵀ, Qᵀ, dYᵀ, Q (N), dY (N), (Pᵀ|dSᵀ)ᵀ: 7 tiles, LSE and delta.
extern "C" __global__ void __launch_bounds__(256, 2) fs_dkv(AttnGeom g, const float* dY, const float* Q, const float* K, const float* V, const void* mask, const float* lse, const float* delta, float* dK, float* dV, int vec) {
    float* sK = (float*)fa_smem;
    float *sV = sK + FS_TILE, *sQ = sV + FS_TILE, *sdY = sQ + FS_TILE, *sQn = sdY + FS_TILE, *sdYn = sQn + FS_TILE, *sS = sdYn + FS_TILE;
    float* sL = sS + FS_TILE;  // [64] LSE (+inf where a row sees nothing)
    float* sD = sL + FS_T;     // [64] delta
    int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
    i64 bhk = blockIdx.y, b = bhk / g.hkv, hk = bhk % g.hkv, grp = g.hq / g.hkv;
    i64 k0 = (i64)blockIdx.x * FS_T;
    int kvalid = (int)(g.skv - k0 < FS_T ? g.skv - k0 : FS_T);
    fs_load(sK, nullptr, K + att_off(g, ATT_K, b, hk, k0), g.st[ATT_K][2], kvalid, (int)g.d, vec);
    fs_load(sV, nullptr, V + att_off(g, ATT_V, b, hk, k0), g.st[ATT_V][2], kvalid, (int)g.dv, vec);
    float dk[4][4], dv[4][4];
    fs_zero(dk);
    fs_zero(dv);
    float sc = (float)g.scale;
    i64 i_start = g.causal ? (k0 / FS_T) * FS_T : 0;
    for (i64 hh = 0; hh < grp; ++hh) {
        i64 h = hk * grp + hh, bh = b * g.hq + h;
        for (i64 i0 = i_start; i0 < g.sq; i0 += FS_T) {
            int qv = (int)(g.sq - i0 < FS_T ? g.sq - i0 : FS_T);
            __syncthreads();
            fs_load(sQ, sQn, Q + att_off(g, ATT_Q, b, h, i0), g.st[ATT_Q][2], qv, (int)g.d, vec);
            fs_load(sdY, sdYn, dY + att_off(g, ATT_Y, b, h, i0), g.st[ATT_Y][2], qv, (int)g.dv, vec);
            for (int r = threadIdx.x; r < FS_T; r += 256) {
                float x = r < qv ? lse[bh * g.sq + i0 + r] : neg_inf(0.f);
                sL[r] = x == neg_inf(x) ? -neg_inf(0.f) : x;
                sD[r] = r < qv ? delta[bh * g.sq + i0 + r] : 0.f;
            }
            __syncthreads();
            float s[4][4], dp[4][4];
            fs_zero(s);
            fs_zero(dp);
            fs_mm<true>(s, sK, sQ);   // Sᵀ[key][query]
            fs_mm<true>(dp, sV, sdY); // dPᵀ[key][query]
            // (Rows past Sq have LSE +inf, so P = 0 there without a check.)
            bool edge = g.mask_kind || (g.causal && k0 + FS_T - 1 > i0);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                i64 kj = k0 + ty * 4 + i;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    int qq = tx * 4 + j;
                    i64 qi = i0 + qq;
                    float x = s[i][j] * sc;
                    if (edge) {
                        if (g.causal && kj > qi) x = neg_inf(x);
                        else if (g.mask_kind && qi < g.sq && kj < g.skv) x = fs_mask(g, mask, b * g.ms[0] + h * g.ms[1] + qi * g.ms[2] + kj * g.ms[3], x);
                    }
                    float p = expf(x - sL[qq]);
                    s[i][j] = p;
                    dp[i][j] = p * (dp[i][j] - sD[qq]);
                }
            }
            fs_store_t(sS, s);  // Pᵀ as the left operand
            __syncthreads();
            fs_mm<false>(dv, sS, sdYn);
            __syncthreads();
            fs_store_t(sS, dp);
            __syncthreads();
            fs_mm<false>(dk, sS, sQn);
        }
    }
    float fk[4] = {sc, sc, sc, sc}, fv[4] = {1.f, 1.f, 1.f, 1.f};
    fs_store(dK + att_off(g, ATT_K, b, hk, 0), g.st[ATT_K][2], dk, k0, g.skv, (int)g.d, fk);
    fs_store(dV + att_off(g, ATT_V, b, hk, 0), g.st[ATT_V][2], dv, k0, g.skv, (int)g.dv, fv);
}
