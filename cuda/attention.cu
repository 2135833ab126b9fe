// Attention and VarlenAttention, forward and backward, flash-style: scores are computed
// one key at a time with an online softmax and never stored, so memory stays O(S·D).
// One warp per query row (forward, dQ) or key row (dK/dV); lane l holds elements
// l, l+32, ... of a head vector (D, Dv <= 32·ATT_VEC). The backward recomputes the
// probabilities from the forward's logsumexp, as flash-attention 2; dQ and dK/dV are
// separate passes so that no two warps write one element (no atomics, deterministic).
// Causal is upper-left for Attention and bottom-right for VarlenAttention, as the CPU.

#define ATT_VEC 8

// Where one query row's problem lies: its row in LSE, the offsets of its vectors in Q (dQ)
// and Y (dY), of its key j in K (ko + j·kst) and V (vo + j·vst), how many keys it sees,
// and its mask offset.
struct QRow { i64 r, qo, yo, ko, kst, vo, vst, limit, i, shift, mask_off; };

// Largest b with cu[b] <= t: the sequence of packed token t (empty sequences skipped).
__device__ i64 seq_of(const i64* cu, i64 nseq, i64 t) {
    i64 lo = 0, hi = nseq - 1;
    while (lo < hi) {
        i64 mid = (lo + hi + 1) / 2;
        if (cu[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

__device__ QRow locate_q(const AttnGeom& g, const i64* cu_q, const i64* cu_k, i64 r) {
    QRow q;
    q.r = r;
    i64 grp = g.hq / g.hkv, nk, h;
    if (g.varlen) {
        i64 t = r / g.hq;
        h = r % g.hq;
        i64 b = seq_of(cu_q, g.nseq, t);
        i64 lq = cu_q[b + 1] - cu_q[b];
        nk = cu_k[b + 1] - cu_k[b];
        q.i = t - cu_q[b];
        // (Packed rows: batch 0, the row index is the token.)
        q.qo = att_off(g, ATT_Q, 0, h, t);
        q.yo = att_off(g, ATT_Y, 0, h, t);
        q.ko = att_off(g, ATT_K, 0, h / grp, cu_k[b]);
        q.vo = att_off(g, ATT_V, 0, h / grp, cu_k[b]);
        q.shift = nk - lq;
        q.mask_off = 0;
    } else {
        i64 b = r / (g.hq * g.sq);
        h = (r / g.sq) % g.hq;
        q.i = r % g.sq;
        nk = g.skv;
        q.qo = att_off(g, ATT_Q, b, h, q.i);
        q.yo = att_off(g, ATT_Y, b, h, q.i);
        q.ko = att_off(g, ATT_K, b, h / grp, 0);
        q.vo = att_off(g, ATT_V, b, h / grp, 0);
        q.shift = 0;
        q.mask_off = b * g.ms[0] + h * g.ms[1] + q.i * g.ms[2];
    }
    q.kst = g.st[ATT_K][2];
    q.vst = g.st[ATT_V][2];
    q.limit = nk;
    if (g.causal) {
        i64 l = q.i + 1 + q.shift;
        q.limit = l < 0 ? 0 : (l > nk ? nk : l);
    }
    return q;
}

template <class T, class A> __device__ __forceinline__ A masked(const AttnGeom& g, const void* mask, i64 off, A s) {
    if (g.mask_kind == 1) return ((const unsigned char*)mask)[off] ? s : neg_inf(s);
    if (g.mask_kind == 2) return s + ld(((const T*)mask)[off]);
    return s;
}

// Loads lane's elements of a head vector into registers (times `mul`).
template <class T, class A> __device__ __forceinline__ void load_vec(A* v, const T* src, i64 w, A mul) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < ATT_VEC; ++t) {
        i64 d = lane + 32 * t;
        v[t] = d < w ? ld(src[d]) * mul : (A)0;
    }
}
template <class T, class A> __device__ __forceinline__ A dot_vec(const A* v, const T* src, i64 w) {
    int lane = threadIdx.x & 31;
    A s = 0;
#pragma unroll
    for (int t = 0; t < ATT_VEC; ++t) {
        i64 d = lane + 32 * t;
        if (d < w) s += v[t] * ld(src[d]);
    }
    return warp_sum(s);
}
template <class T, class A> __device__ __forceinline__ void store_vec(T* dst, const A* v, i64 w, A mul) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < ATT_VEC; ++t) {
        i64 d = lane + 32 * t;
        if (d < w) dst[d] = st<T>(v[t] * mul);
    }
}

template <class T> __device__ void attn_fwd_k(AttnGeom g, const T* Q, const T* K, const T* V, const void* mask, const i64* cu_q, const i64* cu_k, T* Y, typename Num<T>::A* lse) {
    typedef typename Num<T>::A A;
    i64 r = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
    if (r >= g.rows) return;
    QRow q = locate_q(g, cu_q, cu_k, r);
    A qv[ATT_VEC], acc[ATT_VEC];
    load_vec(qv, Q + q.qo, g.d, (A)g.scale);
#pragma unroll
    for (int t = 0; t < ATT_VEC; ++t) acc[t] = 0;
    A m = neg_inf((A)0), l = 0;
    for (i64 j = 0; j < q.limit; ++j) {
        A s = masked<T>(g, mask, q.mask_off + j * g.ms[3], dot_vec(qv, K + q.ko + j * q.kst, g.d));
        if (s == neg_inf(s)) continue;  // masked out: nothing flows through it
        A mn = nan_max(m, s);
        A alpha = m_exp(m - mn), p = m_exp(s - mn);
        l = l * alpha + p;
        const T* vr = V + q.vo + j * q.vst;
        int lane = threadIdx.x & 31;
#pragma unroll
        for (int t = 0; t < ATT_VEC; ++t) {
            i64 d = lane + 32 * t;
            if (d < g.dv) acc[t] = acc[t] * alpha + p * ld(vr[d]);
        }
        m = mn;
    }
    // A row that sees no key gives 0 and LSE -inf.
    bool any = l > (A)0;
    store_vec(Y + q.yo, acc, g.dv, any ? (A)1 / l : (A)0);
    if (lse && (threadIdx.x & 31) == 0) lse[r] = any ? m + m_log(l) : neg_inf(m);
}

// delta_r = dY_r · Y_r.
template <class T> __device__ void attn_delta_k(AttnGeom g, const T* dY, const T* Y, typename Num<T>::A* delta) {
    typedef typename Num<T>::A A;
    i64 r = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
    if (r >= g.rows) return;
    i64 yo = g.varlen ? att_off(g, ATT_Y, 0, r % g.hq, r / g.hq)
                      : att_off(g, ATT_Y, r / (g.hq * g.sq), (r / g.sq) % g.hq, r % g.sq);
    A dy[ATT_VEC];
    load_vec(dy, dY + yo, g.dv, (A)1);
    A s = dot_vec(dy, Y + yo, g.dv);
    if ((threadIdx.x & 31) == 0) delta[r] = s;
}

// dQ_r = scale · Σ_j dS_rj K_j with dS = P∘(dY·Vᵀ − delta); dMask = dS (zeroed by the
// host where not written).
template <class T> __device__ void attn_dq_k(AttnGeom g, const T* dY, const T* Q, const T* K, const T* V, const void* mask, const i64* cu_q, const i64* cu_k, const typename Num<T>::A* lse, const typename Num<T>::A* delta, T* dQ, T* dmask) {
    typedef typename Num<T>::A A;
    i64 r = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
    if (r >= g.rows) return;
    QRow q = locate_q(g, cu_q, cu_k, r);
    A qv[ATT_VEC], dy[ATT_VEC], dq[ATT_VEC];
    load_vec(qv, Q + q.qo, g.d, (A)g.scale);
    load_vec(dy, dY + q.yo, g.dv, (A)1);
#pragma unroll
    for (int t = 0; t < ATT_VEC; ++t) dq[t] = 0;
    A L = lse[r], dl = delta[r];
    int lane = threadIdx.x & 31;
    // A row that sees no key has P = 0 (and S − LSE would be NaN).
    i64 limit = L == neg_inf(L) ? 0 : q.limit;
    for (i64 j = 0; j < limit; ++j) {
        const T* kj = K + q.ko + j * q.kst;
        A p = m_exp(masked<T>(g, mask, q.mask_off + j * g.ms[3], dot_vec(qv, kj, g.d)) - L);
        if (p == (A)0) continue;
        A ds = p * (dot_vec(dy, V + q.vo + j * q.vst, g.dv) - dl);
#pragma unroll
        for (int t = 0; t < ATT_VEC; ++t) {
            i64 d = lane + 32 * t;
            if (d < g.d) dq[t] += ds * ld(kj[d]);
        }
        if (dmask && lane == 0) dmask[r * g.skv + j] = st<T>(ds);
    }
    if (dQ) store_vec(dQ + q.qo, dq, g.d, (A)g.scale);
}

// dK_j = Σ_{heads of its group, rows i seeing j} dS_ij · scale·Q_i, dV_j = Σ P_ij dY_i.
template <class T> __device__ void attn_dkv_k(AttnGeom g, const T* dY, const T* Q, const T* K, const T* V, const void* mask, const i64* cu_q, const i64* cu_k, const typename Num<T>::A* lse, const typename Num<T>::A* delta, T* dK, T* dV) {
    typedef typename Num<T>::A A;
    i64 kr = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
    if (kr >= g.rows) return;
    // q0 + h·qhead + i·qstride: the LSE/delta row of query i of head h; qb + h·Q's head
    // stride + i·its row stride: its offset in Q (dY: qyb with Y's strides).
    i64 grp = g.hq / g.hkv, hk, j, lq, q0, qstride, qhead, b = 0, shift, ko, vo, qb, yb;
    if (g.varlen) {
        i64 u = kr / g.hkv;
        hk = kr % g.hkv;
        b = seq_of(cu_k, g.nseq, u);
        j = u - cu_k[b];
        lq = cu_q[b + 1] - cu_q[b];
        shift = (cu_k[b + 1] - cu_k[b]) - lq;
        q0 = cu_q[b] * g.hq;  // row of (token cu_q[b] + i, head h) is q0 + i·Hq + h
        qstride = g.hq;
        qhead = 1;
        ko = att_off(g, ATT_K, 0, hk, u);
        vo = att_off(g, ATT_V, 0, hk, u);
        qb = att_off(g, ATT_Q, 0, 0, cu_q[b]);
        yb = att_off(g, ATT_Y, 0, 0, cu_q[b]);
    } else {
        b = kr / (g.hkv * g.skv);
        hk = (kr / g.skv) % g.hkv;
        j = kr % g.skv;
        lq = g.sq;
        shift = 0;
        q0 = b * g.hq * g.sq;  // row of (b, h, i) is q0 + h·Sq + i
        qstride = 1;
        qhead = g.sq;
        ko = att_off(g, ATT_K, b, hk, j);
        vo = att_off(g, ATT_V, b, hk, j);
        qb = att_off(g, ATT_Q, b, 0, 0);
        yb = att_off(g, ATT_Y, b, 0, 0);
    }
    A kv[ATT_VEC], vv[ATT_VEC], dk[ATT_VEC], dv[ATT_VEC];
    load_vec(kv, K + ko, g.d, (A)1);
    load_vec(vv, V + vo, g.dv, (A)1);
#pragma unroll
    for (int t = 0; t < ATT_VEC; ++t) { dk[t] = 0; dv[t] = 0; }
    int lane = threadIdx.x & 31;
    // Query i sees key j iff j <= i + shift.
    i64 i0 = g.causal ? (j - shift > 0 ? j - shift : 0) : 0;
    for (i64 hh = 0; hh < grp; ++hh) {
        i64 h = hk * grp + hh;
        for (i64 i = i0; i < lq; ++i) {
            i64 r = q0 + h * qhead + i * qstride;
            A L = lse[r];
            if (L == neg_inf(L)) continue;
            const T* qr = Q + qb + h * g.st[ATT_Q][1] + i * g.st[ATT_Q][2];
            const T* dyr = dY + yb + h * g.st[ATT_Y][1] + i * g.st[ATT_Y][2];
            i64 moff = g.varlen ? 0 : b * g.ms[0] + h * g.ms[1] + i * g.ms[2] + j * g.ms[3];
            A p = m_exp(masked<T>(g, mask, moff, dot_vec(kv, qr, g.d) * (A)g.scale) - L);
            if (p == (A)0) continue;
            A ds = p * (dot_vec(vv, dyr, g.dv) - delta[r]);
#pragma unroll
            for (int t = 0; t < ATT_VEC; ++t) {
                i64 d = lane + 32 * t;
                if (d < g.dv) dv[t] += p * ld(dyr[d]);
                if (d < g.d) dk[t] += ds * ld(qr[d]) * (A)g.scale;
            }
        }
    }
    if (dK) store_vec(dK + ko, dk, g.d, (A)1);
    if (dV) store_vec(dV + vo, dv, g.dv, (A)1);
}

#define INST_ATTN(T, S)                                                                           \
    extern "C" __global__ void attn_fwd_##S(AttnGeom g, const T* q, const T* k, const T* v, const void* m, const i64* cq, const i64* ck, T* y, Num<T>::A* lse) { attn_fwd_k<T>(g, q, k, v, m, cq, ck, y, lse); } \
    extern "C" __global__ void attn_delta_##S(AttnGeom g, const T* dy, const T* y, Num<T>::A* delta) { attn_delta_k<T>(g, dy, y, delta); } \
    extern "C" __global__ void attn_dq_##S(AttnGeom g, const T* dy, const T* q, const T* k, const T* v, const void* m, const i64* cq, const i64* ck, const Num<T>::A* lse, const Num<T>::A* delta, T* dq, T* dm) { attn_dq_k<T>(g, dy, q, k, v, m, cq, ck, lse, delta, dq, dm); } \
    extern "C" __global__ void attn_dkv_##S(AttnGeom g, const T* dy, const T* q, const T* k, const T* v, const void* m, const i64* cq, const i64* ck, const Num<T>::A* lse, const Num<T>::A* delta, T* dk, T* dv) { attn_dkv_k<T>(g, dy, q, k, v, m, cq, ck, lse, delta, dk, dv); }
FOR_FLOATS(INST_ATTN)
