// Row-wise family: ReduceSum/Mean/Max/Prod (kind 0/1/2/4, and 3: the mean of squares),
// ArgMax/ArgMin, TopK, Softmax/LogSoftmax and their gradient, LayerNormalization forward
// and backward, SoftmaxCrossEntropyLoss and its gradient. One block per row, accumulation
// in f32 (f64 for f64), as the CPU backend.

template <class T> struct Lowest { static __device__ typename Num<T>::A get() { return neg_inf((typename Num<T>::A)0); } };
// Integers: the type's smallest value (0 when unsigned), in its accumulation type.
#define INT_LOWEST(T) template <> struct Lowest<T> { static __device__ Num<T>::A get() { \
    return (Num<T>::A)int_min<T>(); } };
INT_LOWEST(i64) INT_LOWEST(int) INT_LOWEST(short) INT_LOWEST(signed char) INT_LOWEST(u64)
INT_LOWEST(unsigned int) INT_LOWEST(unsigned short) INT_LOWEST(unsigned char)
#undef INT_LOWEST

// What the reduce kinds fold with: max (2), product (4), else a sum (of squares for 3),
// from their identities; block_fold combines a block's partial results the same way.
struct ProdOp { template <class A> __device__ __forceinline__ A operator()(A a, A b) const { return a * b; } };
template <class T> __device__ __forceinline__ typename Num<T>::A fold_ident(int kind) {
    typedef typename Num<T>::A A;
    return kind == 2 ? Lowest<T>::get() : kind == 4 ? (A)1 : (A)0;
}
template <class A> __device__ __forceinline__ A fold(A acc, A v, int kind) {
    return kind == 2 ? nan_max(acc, v) : kind == 4 ? acc * v : acc + v;
}
template <class A> __device__ __forceinline__ A block_fold(A acc, A ident, int kind) {
    if (kind == 2) return block_reduce(acc, ident, MaxOp());
    if (kind == 4) return block_reduce(acc, ident, ProdOp());
    return block_reduce(acc, ident, SumOp());
}

// One block per output: `kept` walks the outputs (shape and x strides of the kept dims),
// `red` the reduced elements of one output.
template <class T> __device__ void reduce_k(const T* x, T* y, Strided kept, Strided red, i64 n_red, int kind) {
    typedef typename Num<T>::A A;
    i64 o = blockIdx.x;
    i64 base = offset_of(kept, 0, o);
    const A ident = fold_ident<T>(kind);
    A acc = ident;
    for (i64 r = threadIdx.x; r < n_red; r += blockDim.x) {
        A v = ld(x[base + offset_of(red, 0, r)]);
        if (kind == 3) v = v * v;  // mean of squares
        acc = fold(acc, v, kind);
    }
    acc = block_fold(acc, ident, kind);
    if (threadIdx.x == 0) {
        // An empty float mean is 0/0 = NaN; an integer one divides by 1.
        if (kind == 1 || kind == 3) {
            bool is_int = (A)0.5 == (A)0;
            acc = acc / (A)((is_int && n_red == 0) ? 1 : n_red);
        }
        y[o] = st<T>(acc);
    }
}

// The reduction of x viewed as [outer, mid, inner] over outer and inner into [mid] (a
// convolution's bias gradient: NCHW summed over N, H and W). Block (m, p) folds rows
// [o0, o1) of part p, its threads along the contiguous runs of inner, stepping (o, i) by
// additions: reduce_k's strided walk divides for every element (ResNet-50's bias gradients
// ran at a tenth of the memory's rate). With one part it writes y, else its part for
// reduce_fin.
template <class T> __device__ void reduce_oi_k(const T* x, T* y, typename Num<T>::A* part, i64 outer, i64 mid, i64 inner, i64 parts, int kind) {
    typedef typename Num<T>::A A;
    const i64 m = blockIdx.x / parts, p = blockIdx.x % parts;
    const i64 chunk = (outer + parts - 1) / parts, o0 = p * chunk;
    const i64 o1 = o0 + chunk < outer ? o0 + chunk : outer;
    const i64 bd = blockDim.x, step_o = bd / inner, step_i = bd % inner;
    const A ident = fold_ident<T>(kind);
    A acc = ident;
    i64 o = o0 + threadIdx.x / inner, i = threadIdx.x % inner;
    while (o < o1) {
        A v = ld(x[(o * mid + m) * inner + i]);
        if (kind == 3) v = v * v;  // mean of squares
        acc = fold(acc, v, kind);
        o += step_o;
        i += step_i;
        if (i >= inner) { i -= inner; ++o; }
    }
    acc = block_fold(acc, ident, kind);
    if (threadIdx.x != 0) return;
    if (parts > 1) { part[blockIdx.x] = acc; return; }
    const i64 n_red = outer * inner;
    if (kind == 1 || kind == 3) {
        bool is_int = (A)0.5 == (A)0;
        acc = acc / (A)((is_int && n_red == 0) ? 1 : n_red);
    }
    y[m] = st<T>(acc);
}

// Many outputs of few elements each (a pool's window, a batch of weight gradients): a
// thread per output folds its elements in order, so neighbouring threads read
// neighbouring elements.
template <class T> __device__ void reduce_lines_k(const T* x, T* y, Strided kept, Strided red, i64 n_red, i64 n_out, int kind) {
    typedef typename Num<T>::A A;
    GRID_STRIDE(o, n_out) {
        i64 base = offset_of(kept, 0, o);
        A acc = fold_ident<T>(kind);
        for (i64 r = 0; r < n_red; ++r) {
            A v = ld(x[base + offset_of(red, 0, r)]);
            if (kind == 3) v = v * v;  // mean of squares
            acc = fold(acc, v, kind);
        }
        if (kind == 1 || kind == 3) {
            bool is_int = (A)0.5 == (A)0;
            acc = acc / (A)((is_int && n_red == 0) ? 1 : n_red);
        }
        y[o] = st<T>(acc);
    }
}

// Large reductions to few outputs in two passes: block (o, p) reduces part p of output o's
// elements into `part` (accumulation type), then one block per output combines the parts
// (in a fixed order: deterministic).
template <class T> __device__ void reduce_part_k(const T* x, typename Num<T>::A* part, Strided kept, Strided red, i64 n_red, i64 parts, int kind) {
    typedef typename Num<T>::A A;
    i64 o = blockIdx.x / parts, p = blockIdx.x % parts;
    i64 chunk = (n_red + parts - 1) / parts, r0 = p * chunk, r1 = r0 + chunk < n_red ? r0 + chunk : n_red;
    i64 base = offset_of(kept, 0, o);
    const A ident = fold_ident<T>(kind);
    A acc = ident;
    for (i64 r = r0 + threadIdx.x; r < r1; r += blockDim.x) {
        A v = ld(x[base + offset_of(red, 0, r)]);
        if (kind == 3) v = v * v;  // mean of squares
        acc = fold(acc, v, kind);
    }
    acc = block_fold(acc, ident, kind);
    if (threadIdx.x == 0) part[blockIdx.x] = acc;
}
template <class T> __device__ void reduce_fin_k(const typename Num<T>::A* part, T* y, i64 n_red, i64 parts, int kind) {
    typedef typename Num<T>::A A;
    i64 o = blockIdx.x;
    const A ident = fold_ident<T>(kind);
    A acc = ident;
    for (i64 p = threadIdx.x; p < parts; p += blockDim.x) acc = fold(acc, part[o * parts + p], kind);
    acc = block_fold(acc, ident, kind);
    if (threadIdx.x == 0) {
        if (kind == 1 || kind == 3) {
            bool is_int = (A)0.5 == (A)0;
            acc = acc / (A)((is_int && n_red == 0) ? 1 : n_red);
        }
        y[o] = st<T>(acc);
    }
}

// Whether v, met after best along the line, takes its place as ArgMax's pick (ArgMin's
// with is_min): NaN beats every number, as numpy's argmax and argmin; of equal values the
// first stays unless `last` (select_last_index). As the CPU backend's `beats`.
template <class A> __device__ __forceinline__ bool beats(A v, A best, int is_min, int last) {
    bool vn = v != v, bn = best != best;
    if (vn || bn) return vn && (last || !bn);
    return (is_min ? v < best : v > best) || (last && v == best);
}

// ArgMax / ArgMin: a thread per (outer, inner) line of d elements `inner` apart.
template <class T> __device__ void arg_reduce_k(const T* x, i64* y, i64 lines, i64 d, i64 inner, int is_min, int last) {
    typedef typename Num<T>::A A;
    GRID_STRIDE(l, lines) {
        const T* xl = x + (l / inner) * d * inner + l % inner;
        A best = ld(xl[0]);
        i64 at = 0;
        for (i64 s = 1; s < d; ++s) {
            A v = ld(xl[s * inner]);
            if (beats(v, best, is_min, last)) { best = v; at = s; }
        }
        y[l] = at;
    }
}

// Whether (a, ia) ranks before (b, ib) in TopK's order: the larger value first (smaller
// without `largest`), NaN above every number, equal values by lower index. As the CPU
// backend's `rank`.
template <class A> __device__ __forceinline__ bool ranks_before(A a, i64 ia, A b, i64 ib, int largest) {
    bool an = a != a, bn = b != b;
    int c;  // -1, 0, 1: a below, equal to, above b (ascending, NaN highest)
    if (an || bn) c = an && bn ? 0 : an ? 1 : -1;
    else c = a < b ? -1 : a > b ? 1 : 0;
    if (c == 0) return ia < ib;
    return largest ? c > 0 : c < 0;
}

// TopK: a thread per line picks its k elements one after the other, each the first in
// rank order of those ranking after the previous pick: O(k·d) per line and no scratch.
template <class T> __device__ void top_k_k(const T* x, T* vals, i64* idx, i64 lines, i64 d, i64 inner, i64 k, int largest) {
    typedef typename Num<T>::A A;
    GRID_STRIDE(l, lines) {
        const i64 o = l / inner, i = l % inner;
        const T* xl = x + o * d * inner + i;
        A pv = (A)0;
        i64 pi = -1;
        for (i64 j = 0; j < k; ++j) {
            A bv = (A)0;
            i64 bi = -1;
            for (i64 s = 0; s < d; ++s) {
                A v = ld(xl[s * inner]);
                if (pi >= 0 && !ranks_before(pv, pi, v, s, largest)) continue;
                if (bi < 0 || ranks_before(v, s, bv, bi, largest)) { bv = v; bi = s; }
            }
            vals[(o * k + j) * inner + i] = xl[bi * inner];
            idx[(o * k + j) * inner + i] = bi;
            pv = bv;
            pi = bi;
        }
    }
}

// LayerNormalization's dScale and dBias in two passes: block (column group, row chunk)
// sums its rows for 32 columns (8 rows at a time, coalesced) into `part` [chunks][2][n];
// then one thread per column adds the chunks up.
template <class T> __device__ void ln_dparams_part_k(const T* dy, const T* x, const typename Num<T>::A* mean, const typename Num<T>::A* inv, typename Num<T>::A* part, i64 rows, i64 n, i64 chunk) {
    typedef typename Num<T>::A A;
    __shared__ A ss[8][33], sb[8][33];
    int c = threadIdx.x & 31, rl = threadIdx.x >> 5;
    i64 j = (i64)blockIdx.x * 32 + c;
    i64 r0 = (i64)blockIdx.y * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows;
    A s = 0, b = 0;
    if (j < n)
        for (i64 r = r0 + rl; r < r1; r += 8) {
            A d = ld(dy[r * n + j]);
            s += d * (ld(x[r * n + j]) - (mean ? mean[r] : (A)0)) * inv[r];
            b += d;
        }
    ss[rl][c] = s;
    sb[rl][c] = b;
    __syncthreads();
    if (rl == 0 && j < n) {
        for (int k = 1; k < 8; ++k) {
            s += ss[k][c];
            b += sb[k][c];
        }
        part[((i64)blockIdx.y * 2) * n + j] = s;
        part[((i64)blockIdx.y * 2 + 1) * n + j] = b;
    }
}
template <class T> __device__ void ln_dparams_fin_k(const typename Num<T>::A* part, T* ds, T* db, i64 n, i64 chunks) {
    typedef typename Num<T>::A A;
    GRID_STRIDE(j, n) {
        A s = 0, b = 0;
        for (i64 k = 0; k < chunks; ++k) {
            s += part[(k * 2) * n + j];
            b += part[(k * 2 + 1) * n + j];
        }
        if (ds) ds[j] = st<T>(s);
        if (db) db[j] = st<T>(b);
    }
}

// A reduction (`kind`, as reduce_oi's) over the rows of a [rows, n] matrix (a bias
// gradient, channels-first or channels-last) in two passes, coalesced: block (column
// group of 32, row chunk) folds its chunk 8 rows at a time into `part` [chunks][n], then
// one thread per column folds the chunks (fixed order).
template <class T> __device__ void colsum_part_k(const T* g, typename Num<T>::A* part, i64 rows, i64 n, i64 chunk, int kind) {
    typedef typename Num<T>::A A;
    __shared__ A sh[8][33];
    const A ident = fold_ident<T>(kind);
    int c = threadIdx.x & 31, rl = threadIdx.x >> 5;
    i64 j = (i64)blockIdx.x * 32 + c;
    i64 r0 = (i64)blockIdx.y * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows;
    A s = ident;
    if (j < n)
        for (i64 r = r0 + rl; r < r1; r += 8) {
            A v = ld(g[r * n + j]);
            if (kind == 3) v = v * v;  // mean of squares
            s = fold(s, v, kind);
        }
    sh[rl][c] = s;
    __syncthreads();
    if (rl == 0 && j < n) {
        for (int k = 1; k < 8; ++k) s = fold(s, sh[k][c], kind);
        part[(i64)blockIdx.y * n + j] = s;
    }
}
template <class T> __device__ void colsum_fin_k(const typename Num<T>::A* part, T* out, i64 n, i64 chunks, i64 rows, int kind) {
    typedef typename Num<T>::A A;
    GRID_STRIDE(j, n) {
        A s = fold_ident<T>(kind);
        for (i64 k = 0; k < chunks; ++k) s = fold(s, part[k * n + j], kind);
        if (kind == 1 || kind == 3) s = s / (A)rows;
        out[j] = st<T>(s);
    }
}

// One block per (outer, inner) row of n elements `inner` apart.
template <class T> __device__ void softmax_k(const T* x, T* y, i64 n, i64 inner, int log) {
    typedef typename Num<T>::A A;
    i64 row = blockIdx.x, o = row / inner, c = row % inner;
    const T* xr = x + o * n * inner + c;
    T* yr = y + o * n * inner + c;
    A m = neg_inf((A)0);
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) m = nan_max(m, ld(xr[j * inner]));
    m = block_max(m);
    A s = 0;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) s += m_exp(ld(xr[j * inner]) - m);
    s = block_sum(s);
    if (log) {
        // (x - max) - log(sum): x - (max + log(sum)) rounds at the magnitude of x.
        A l = m_log(s);
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) yr[j * inner] = st<T>((ld(xr[j * inner]) - m) - l);
    } else {
        A r = (A)1 / s;
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) yr[j * inner] = st<T>(m_exp(ld(xr[j * inner]) - m) * r);
    }
}

// y·(dy - Σ dy·y), or dy - exp(y)·Σ dy for LogSoftmax.
template <class T> __device__ void softmax_grad_k(const T* dy, const T* y, T* dx, i64 n, i64 inner, int log) {
    typedef typename Num<T>::A A;
    i64 row = blockIdx.x, off = (row / inner) * n * inner + row % inner;
    A s = 0;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
        A d = ld(dy[off + j * inner]);
        s += log ? d : d * ld(y[off + j * inner]);
    }
    s = block_sum(s);
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
        A d = ld(dy[off + j * inner]), v = ld(y[off + j * inner]);
        dx[off + j * inner] = st<T>(log ? d - m_exp(v) * s : v * (d - s));
    }
}

// One block per row of n; scale and bias already expanded to n by the host. Two passes:
// the variance of centred values does not cancel catastrophically. `rms`: the rows are
// not centred (RMSNormalization; the mean is 0 and not written). With a residual `r`
// (non-null) the rows are s = x + r, rounded to T, written to `s` and normalized from
// there (each thread reads back only the elements it wrote).
template <class T> __device__ void layer_norm_k(const T* x, const T* r, T* s_out, const T* g, const T* b, T* y, typename Num<T>::A* mean_out, typename Num<T>::A* inv_out, i64 n, float eps, int rms) {
    typedef typename Num<T>::A A;
    const T* xr = x + blockIdx.x * n;
    T* yr = y + blockIdx.x * n;
    if (r) {
        const T* rr = r + blockIdx.x * n;
        T* sr = s_out + blockIdx.x * n;
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) sr[j] = st<T>(ld(xr[j]) + ld(rr[j]));
        xr = sr;
    }
    A s = 0;
    if (!rms)
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) s += ld(xr[j]);
    A mean = rms ? (A)0 : block_sum(s) / (A)n;
    A v = 0;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) { A d = ld(xr[j]) - mean; v += d * d; }
    A var = block_sum(v) / (A)n;
    A inv = (A)1 / m_sqrt(var + (A)eps);
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
        A z = (ld(xr[j]) - mean) * inv * ld(g[j]);
        yr[j] = st<T>(b ? z + ld(b[j]) : z);
    }
    if (threadIdx.x == 0) {
        if (mean_out) mean_out[blockIdx.x] = mean;
        if (inv_out) inv_out[blockIdx.x] = inv;
    }
}

// dx = inv·(g - mean(g) - xhat·mean(g·xhat)) per row, with g = dy·scale, plus `res` (a
// residual branch's gradient) where given. A null `mean` is RMSNormalization's gradient:
// the mean is 0 and dx = inv·(g - xhat·mean(g·xhat)).
template <class T> __device__ void layer_norm_dx_k(const T* dy, const T* x, const T* scale, const typename Num<T>::A* mean, const typename Num<T>::A* inv, const T* res, T* dx, i64 n) {
    typedef typename Num<T>::A A;
    i64 off = blockIdx.x * n;
    A m = mean ? mean[blockIdx.x] : (A)0, iv = inv[blockIdx.x];
    A sg = 0, sgx = 0;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
        A gj = ld(dy[off + j]) * ld(scale[j]);
        sg += gj;
        sgx += gj * (ld(x[off + j]) - m) * iv;
    }
    A mg = block_sum(sg) / (A)n, mgx = block_sum(sgx) / (A)n;
    if (!mean) mg = 0;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
        A xhat = (ld(x[off + j]) - m) * iv;
        A v = iv * (ld(dy[off + j]) * ld(scale[j]) - mg - xhat * mgx);
        if (res) v += ld(res[off + j]);
        dx[off + j] = st<T>(v);
    }
}

// dScale = Σ_rows dy·xhat, dB = Σ_rows dy: one thread per column, rows in order.
template <class T> __device__ void layer_norm_dparams_k(const T* dy, const T* x, const typename Num<T>::A* mean, const typename Num<T>::A* inv, T* ds, T* db, i64 rows, i64 n) {
    typedef typename Num<T>::A A;
    GRID_STRIDE(j, n) {
        A s = 0, b = 0;
        for (i64 r = 0; r < rows; ++r) {
            A d = ld(dy[r * n + j]);
            s += d * (ld(x[r * n + j]) - (mean ? mean[r] : (A)0)) * inv[r];
            b += d;
        }
        if (ds) ds[j] = st<T>(s);
        if (db) db[j] = st<T>(b);
    }
}

// The same two kernels when a row is `nv` 16-byte vectors (every pointer aligned; the host
// checks) and fits in registers: thread t holds vectors t, t + blockDim, … (at most M of
// them). The forward reads x once and writes y once (the variance pass runs over the
// registers); the backward reads dy and x once for dX and dScale/dBias together.
template <class T> union LnVec { uint4 u; T t[16 / sizeof(T)]; };

template <class T, int M> __device__ void layer_norm_vec_k(const T* x, const T* r, T* s_out, const T* g, const T* b, T* y, typename Num<T>::A* mean_out, typename Num<T>::A* inv_out, i64 nv, float eps, int rms) {
    typedef typename Num<T>::A A;
    constexpr int V = 16 / sizeof(T);
    const uint4* xr = (const uint4*)x + blockIdx.x * nv;
    uint4* yr = (uint4*)y + blockIdx.x * nv;
    LnVec<T> v[M];
    A s = 0;
#pragma unroll
    for (int k = 0; k < M; ++k) {
        i64 j = threadIdx.x + (i64)k * blockDim.x;
        if (j < nv) {
            v[k].u = xr[j];
            if (r) {
                LnVec<T> rv;
                rv.u = ((const uint4*)r + blockIdx.x * nv)[j];
#pragma unroll
                for (int e = 0; e < V; ++e) v[k].t[e] = st<T>(ld(v[k].t[e]) + ld(rv.t[e]));
                ((uint4*)s_out + blockIdx.x * nv)[j] = v[k].u;
            }
#pragma unroll
            for (int e = 0; e < V; ++e) s += ld(v[k].t[e]);
        }
    }
    A n = (A)(nv * V);
    A mean = rms ? (A)0 : block_sum(s) / n;
    A q = 0;
#pragma unroll
    for (int k = 0; k < M; ++k)
        if (threadIdx.x + (i64)k * blockDim.x < nv)
#pragma unroll
            for (int e = 0; e < V; ++e) { A d = ld(v[k].t[e]) - mean; q += d * d; }
    A inv = (A)1 / m_sqrt(block_sum(q) / n + (A)eps);
#pragma unroll
    for (int k = 0; k < M; ++k) {
        i64 j = threadIdx.x + (i64)k * blockDim.x;
        if (j < nv) {
            LnVec<T> gv, bv, o;
            gv.u = ((const uint4*)g)[j];
            if (b) bv.u = ((const uint4*)b)[j];
#pragma unroll
            for (int e = 0; e < V; ++e) {
                A z = (ld(v[k].t[e]) - mean) * inv * ld(gv.t[e]);
                o.t[e] = st<T>(b ? z + ld(bv.t[e]) : z);
            }
            yr[j] = o.u;
        }
    }
    if (threadIdx.x == 0) {
        if (mean_out) mean_out[blockIdx.x] = mean;
        if (inv_out) inv_out[blockIdx.x] = inv;
    }
}

// Block b takes rows b, b + gridDim, … (a fixed assignment: deterministic). dX as
// layer_norm_dx_k (null: not wanted); each thread also sums dy·xhat and dy of its columns
// over the block's rows into `part` [gridDim][2][n] (null: not wanted), which
// ln_dparams_fin2_k adds up.
template <class T, int M> __device__ void layer_norm_grad_vec_k(const T* dy, const T* x, const T* scale, const typename Num<T>::A* mean, const typename Num<T>::A* inv, const T* res, T* dx, typename Num<T>::A* part, i64 rows, i64 nv) {
    typedef typename Num<T>::A A;
    constexpr int V = 16 / sizeof(T);
    A ps[M][V], pb[M][V];
    LnVec<T> gv[M];
#pragma unroll
    for (int k = 0; k < M; ++k) {
        i64 j = threadIdx.x + (i64)k * blockDim.x;
        if (dx && j < nv) gv[k].u = ((const uint4*)scale)[j];
#pragma unroll
        for (int e = 0; e < V; ++e) ps[k][e] = pb[k][e] = 0;
    }
    A n = (A)(nv * V);
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        A m = mean ? mean[r] : (A)0, iv = inv[r];
        LnVec<T> d[M], xv[M];
        A sg = 0, sgx = 0;
#pragma unroll
        for (int k = 0; k < M; ++k) {
            i64 j = threadIdx.x + (i64)k * blockDim.x;
            if (j < nv) {
                d[k].u = ((const uint4*)dy)[r * nv + j];
                xv[k].u = ((const uint4*)x)[r * nv + j];
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    A dd = ld(d[k].t[e]), xh = (ld(xv[k].t[e]) - m) * iv;
                    ps[k][e] += dd * xh;
                    pb[k][e] += dd;
                    if (dx) {
                        A gj = dd * ld(gv[k].t[e]);
                        sg += gj;
                        sgx += gj * xh;
                    }
                }
            }
        }
        if (!dx) continue;
        A mg = mean ? block_sum(sg) / n : (A)0, mgx = block_sum(sgx) / n;
#pragma unroll
        for (int k = 0; k < M; ++k) {
            i64 j = threadIdx.x + (i64)k * blockDim.x;
            if (j < nv) {
                LnVec<T> rv, o;
                if (res) rv.u = ((const uint4*)res)[r * nv + j];
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    A xh = (ld(xv[k].t[e]) - m) * iv;
                    A w = iv * (ld(d[k].t[e]) * ld(gv[k].t[e]) - mg - xh * mgx);
                    if (res) w += ld(rv.t[e]);
                    o.t[e] = st<T>(w);
                }
                ((uint4*)dx)[r * nv + j] = o.u;
            }
        }
    }
    if (!part) return;
    i64 nn = nv * V;
#pragma unroll
    for (int k = 0; k < M; ++k) {
        i64 j = threadIdx.x + (i64)k * blockDim.x;
        if (j < nv)
#pragma unroll
            for (int e = 0; e < V; ++e) {
                part[((i64)blockIdx.x * 2) * nn + j * V + e] = ps[k][e];
                part[((i64)blockIdx.x * 2 + 1) * nn + j * V + e] = pb[k][e];
            }
    }
}

// Σ over the `chunks` rows of `part` [chunks][2n]: block of 1024 = 32 columns × 32 lanes,
// lane l adding chunks l, l + 32, …, then the lanes in order (deterministic). Columns below
// n are dScale, the others dBias.
template <class T> __device__ void ln_dparams_fin2_k(const typename Num<T>::A* part, T* ds, T* db, i64 n, i64 chunks) {
    typedef typename Num<T>::A A;
    __shared__ A sh[32][33];
    int c = threadIdx.x & 31, l = threadIdx.x >> 5;
    i64 j = (i64)blockIdx.x * 32 + c;
    A s = 0;
    if (j < 2 * n)
        for (i64 k = l; k < chunks; k += 32) s += part[k * 2 * n + j];
    sh[l][c] = s;
    __syncthreads();
    if (l == 0 && j < 2 * n) {
        for (int k = 1; k < 32; ++k) s += sh[k][c];
        if (j < n) {
            if (ds) ds[j] = st<T>(s);
        } else if (db) {
            db[j - n] = st<T>(s);
        }
    }
}

// Log-sum-exp over the C classes of element (i, p) of scores `[N, C, d]`.
template <class T> __device__ typename Num<T>::A class_lse(const T* xb, i64 c, i64 d) {
    typedef typename Num<T>::A A;
    A m = neg_inf((A)0), s = 0;
    for (i64 k = 0; k < c; ++k) m = nan_max(m, ld(xb[k * d]));
    for (i64 k = 0; k < c; ++k) s += m_exp(ld(xb[k * d]) - m);
    return m + m_log(s);
}

// Per element e = (i, p): its weight (0 where ignored, w[label] or 1) and loss; log_prob
// when asked for. Labels are validated i64 (host).
template <class T> __device__ void sce_rows_k(const T* x, const i64* labels, const T* weights, typename Num<T>::A* loss, typename Num<T>::A* wt, T* logp, i64 c, i64 d, i64 ne, i64 ignore, int has_ignore) {
    typedef typename Num<T>::A A;
    GRID_STRIDE(e, ne) {
        i64 i = e / d, p = e % d;
        const T* xb = x + i * c * d + p;
        A lse = class_lse(xb, c, d);
        i64 l = labels[e];
        A w = (has_ignore && l == ignore) ? (A)0 : (weights ? ld(weights[l]) : (A)1);
        wt[e] = w;
        loss[e] = w == (A)0 ? (A)0 : -w * (ld(xb[l * d]) - lse);
        if (logp)
            for (i64 k = 0; k < c; ++k) logp[i * c * d + k * d + p] = st<T>(ld(xb[k * d]) - lse);
    }
}

// Scores `[N, C]` (d = 1, each row contiguous; a language model's logits): one block per
// row, its threads reading the row coalesced and each keeping a running max and sum of
// its columns (one pass), merged across the block. A per-element thread walking 50 257
// classes alone (the loop above) is two orders of magnitude slower there. Each thread
// loads ROW_UNROLL columns before folding them in, so that many loads are in flight (one
// at a time left the kernel waiting on memory) and the running sum is rescaled once per
// group rather than per new maximum.
#define ROW_UNROLL 4
template <class T> __device__ typename Num<T>::A row_lse(const T* xr, i64 c) {
    typedef typename Num<T>::A A;
    const A ninf = neg_inf((A)0);
    const i64 bd = blockDim.x;
    A m = ninf, s = 0;
    for (i64 k0 = threadIdx.x; k0 < c; k0 += ROW_UNROLL * bd) {
        A v[ROW_UNROLL];
#pragma unroll
        for (int j = 0; j < ROW_UNROLL; ++j) {
            i64 k = k0 + j * bd;
            v[j] = k < c ? ld(xr[k]) : ninf;
        }
        A mx = m;
#pragma unroll
        for (int j = 0; j < ROW_UNROLL; ++j) mx = v[j] > mx ? v[j] : mx;  // NaN never wins
        if (mx == ninf) {
            // Nothing but -inf so far adds nothing; a NaN among them makes the sum NaN.
#pragma unroll
            for (int j = 0; j < ROW_UNROLL; ++j) s += v[j] != v[j] ? v[j] : (A)0;
            continue;
        }
        A t = s == (A)0 ? (A)0 : s * m_exp(m - mx);
#pragma unroll
        for (int j = 0; j < ROW_UNROLL; ++j) t += m_exp(v[j] - mx);  // -inf adds 0, NaN stays
        s = t;
        m = mx;
    }
    A mm = block_max(m);
    A total = block_sum(s == (A)0 ? (A)0 : s * m_exp(m - mm));
    return mm + m_log(total);
}

template <class T> __device__ void sce_rows_row_k(const T* x, const i64* labels, const T* weights, typename Num<T>::A* loss, typename Num<T>::A* wt, T* logp, i64 c, i64 ignore, int has_ignore) {
    typedef typename Num<T>::A A;
    i64 i = blockIdx.x;
    const T* xr = x + i * c;
    A lse = row_lse(xr, c);
    if (threadIdx.x == 0) {
        i64 l = labels[i];
        A w = (has_ignore && l == ignore) ? (A)0 : (weights ? ld(weights[l]) : (A)1);
        wt[i] = w;
        loss[i] = w == (A)0 ? (A)0 : -w * (ld(xr[l]) - lse);
    }
    if (logp)
        for (i64 k = threadIdx.x; k < c; k += blockDim.x) logp[i * c + k] = st<T>(ld(xr[k]) - lse);
}

// The gradient's denominator, once: Σ w for mean, else 1 (one block).
template <class T> __device__ void sce_denom_k(const typename Num<T>::A* wt, typename Num<T>::A* denom, i64 ne, int reduction) {
    typedef typename Num<T>::A A;
    A w = 0;
    if (reduction == 2)
        for (i64 e = threadIdx.x; e < ne; e += blockDim.x) w += wt[e];
    w = block_sum(w);
    if (threadIdx.x == 0) denom[0] = reduction == 2 ? w : (A)1;
}

template <class T> __device__ void sce_grad_row_k(const T* x, const i64* labels, const typename Num<T>::A* wt, const typename Num<T>::A* denom, const T* dloss, T* dx, i64 c, int reduction) {
    typedef typename Num<T>::A A;
    i64 i = blockIdx.x;
    const T* xr = x + i * c;
    T* dr = dx + i * c;
    A w = wt[i];
    if (w == (A)0) {
        for (i64 k = threadIdx.x; k < c; k += blockDim.x) dr[k] = st<T>((A)0);
        return;
    }
    A coef = w * ld(dloss[reduction == 0 ? i : 0]) / denom[0];
    A lse = row_lse(xr, c);
    i64 l = labels[i];
#pragma unroll ROW_UNROLL
    for (i64 k = threadIdx.x; k < c; k += blockDim.x)
        dr[k] = st<T>((m_exp(ld(xr[k]) - lse) - (k == l ? (A)1 : (A)0)) * coef);
}

// reduction 0 none (grid-wide), 1 sum, 2 mean (Σ w·loss / Σ w; one block).
template <class T> __device__ void sce_reduce_k(const typename Num<T>::A* loss, const typename Num<T>::A* wt, T* out, i64 ne, int reduction) {
    typedef typename Num<T>::A A;
    if (reduction == 0) {
        GRID_STRIDE(e, ne) out[e] = st<T>(loss[e]);
        return;
    }
    A s = 0, w = 0;
    for (i64 e = threadIdx.x; e < ne; e += blockDim.x) { s += loss[e]; w += wt[e]; }
    s = block_sum(s);
    w = block_sum(w);
    if (threadIdx.x == 0) out[0] = st<T>(reduction == 2 ? s / w : s);
}

// (softmax - onehot) · w · dloss / denom; denom = Σ w for mean, else 1.
template <class T> __device__ void sce_grad_k(const T* x, const i64* labels, const typename Num<T>::A* wt, const T* dloss, T* dx, i64 c, i64 d, i64 ne, int reduction) {
    typedef typename Num<T>::A A;
    __shared__ A denom_s;
    if (reduction == 2) {
        A w = 0;
        for (i64 e = threadIdx.x; e < ne; e += blockDim.x) w += wt[e];
        w = block_sum(w);
        if (threadIdx.x == 0) denom_s = w;
        __syncthreads();
    }
    A denom = reduction == 2 ? denom_s : (A)1;
    GRID_STRIDE(e, ne) {
        i64 i = e / d, p = e % d;
        const T* xb = x + i * c * d + p;
        A w = wt[e];
        A coef = w == (A)0 ? (A)0 : w * ld(dloss[reduction == 0 ? e : 0]) / denom;
        A lse = class_lse(xb, c, d);
        for (i64 k = 0; k < c; ++k) {
            A hot = labels[e] == k ? (A)1 : (A)0;
            dx[i * c * d + k * d + p] = st<T>((m_exp(ld(xb[k * d]) - lse) - hot) * coef);
        }
    }
}

#define INST_REDUCE_NUM(T, S) \
    extern "C" __global__ void reduce_##S(const T* x, T* y, Strided kept, Strided red, i64 n_red, int kind) { reduce_k<T>(x, y, kept, red, n_red, kind); } \
    extern "C" __global__ void reduce_lines_##S(const T* x, T* y, Strided kept, Strided red, i64 n_red, i64 n_out, int kind) { reduce_lines_k<T>(x, y, kept, red, n_red, n_out, kind); } \
    extern "C" __global__ void arg_reduce_##S(const T* x, i64* y, i64 lines, i64 d, i64 inner, int is_min, int last) { arg_reduce_k<T>(x, y, lines, d, inner, is_min, last); } \
    extern "C" __global__ void top_k_##S(const T* x, T* v, i64* ix, i64 lines, i64 d, i64 inner, i64 k, int largest) { top_k_k<T>(x, v, ix, lines, d, inner, k, largest); }
FOR_NUMS(INST_REDUCE_NUM)

#define INST_REDUCE_FLOAT(T, S)                                                                   \
    extern "C" __global__ void softmax_##S(const T* x, T* y, i64 n, i64 inner, int log) { softmax_k<T>(x, y, n, inner, log); } \
    extern "C" __global__ void softmax_grad_##S(const T* dy, const T* y, T* dx, i64 n, i64 inner, int log) { softmax_grad_k<T>(dy, y, dx, n, inner, log); } \
    extern "C" __global__ void layer_norm_##S(const T* x, const T* r, T* s, const T* g, const T* b, T* y, Num<T>::A* m, Num<T>::A* iv, i64 n, float eps, int rms) { layer_norm_k<T>(x, r, s, g, b, y, m, iv, n, eps, rms); } \
    extern "C" __global__ void layer_norm_dx_##S(const T* dy, const T* x, const T* g, const Num<T>::A* m, const Num<T>::A* iv, const T* res, T* dx, i64 n) { layer_norm_dx_k<T>(dy, x, g, m, iv, res, dx, n); } \
    extern "C" __global__ void layer_norm_dparams_##S(const T* dy, const T* x, const Num<T>::A* m, const Num<T>::A* iv, T* ds, T* db, i64 rows, i64 n) { layer_norm_dparams_k<T>(dy, x, m, iv, ds, db, rows, n); } \
    extern "C" __global__ void sce_rows_##S(const T* x, const i64* l, const T* w, Num<T>::A* loss, Num<T>::A* wt, T* lp, i64 c, i64 d, i64 ne, i64 ig, int hi) { sce_rows_k<T>(x, l, w, loss, wt, lp, c, d, ne, ig, hi); } \
    extern "C" __global__ void sce_reduce_##S(const Num<T>::A* loss, const Num<T>::A* wt, T* o, i64 ne, int r) { sce_reduce_k<T>(loss, wt, o, ne, r); } \
    extern "C" __global__ void sce_grad_##S(const T* x, const i64* l, const Num<T>::A* wt, const T* dl, T* dx, i64 c, i64 d, i64 ne, int r) { sce_grad_k<T>(x, l, wt, dl, dx, c, d, ne, r); } \
    extern "C" __global__ void sce_rows_row_##S(const T* x, const i64* l, const T* w, Num<T>::A* loss, Num<T>::A* wt, T* lp, i64 c, i64 ig, int hi) { sce_rows_row_k<T>(x, l, w, loss, wt, lp, c, ig, hi); } \
    extern "C" __global__ void sce_denom_##S(const Num<T>::A* wt, Num<T>::A* dn, i64 ne, int r) { sce_denom_k<T>(wt, dn, ne, r); } \
    extern "C" __global__ void sce_grad_row_##S(const T* x, const i64* l, const Num<T>::A* wt, const Num<T>::A* dn, const T* dl, T* dx, i64 c, int r) { sce_grad_row_k<T>(x, l, wt, dn, dl, dx, c, r); }
FOR_FLOATS(INST_REDUCE_FLOAT)

#define INST_REDUCE2(T, S)                                                                        \
    extern "C" __global__ void reduce_part_##S(const T* x, Num<T>::A* part, Strided kept, Strided red, i64 n_red, i64 parts, int kind) { reduce_part_k<T>(x, part, kept, red, n_red, parts, kind); } \
    extern "C" __global__ void reduce_fin_##S(const Num<T>::A* part, T* y, i64 n_red, i64 parts, int kind) { reduce_fin_k<T>(part, y, n_red, parts, kind); } \
    extern "C" __global__ void reduce_oi_##S(const T* x, T* y, Num<T>::A* part, i64 outer, i64 mid, i64 inner, i64 parts, int kind) { reduce_oi_k<T>(x, y, part, outer, mid, inner, parts, kind); }
FOR_NUMS(INST_REDUCE2)
#define INST_LN2(T, S)                                                                            \
    extern "C" __global__ void ln_dparams_part_##S(const T* dy, const T* x, const Num<T>::A* m, const Num<T>::A* iv, Num<T>::A* part, i64 rows, i64 n, i64 chunk) { ln_dparams_part_k<T>(dy, x, m, iv, part, rows, n, chunk); } \
    extern "C" __global__ void ln_dparams_fin_##S(const Num<T>::A* part, T* ds, T* db, i64 n, i64 chunks) { ln_dparams_fin_k<T>(part, ds, db, n, chunks); }
FOR_FLOATS(INST_LN2)
#define INST_LN_VEC(T, S, M)                                                                      \
    extern "C" __global__ void layer_norm_vec##M##_##S(const T* x, const T* r, T* s, const T* g, const T* b, T* y, Num<T>::A* m, Num<T>::A* iv, i64 nv, float eps, int rms) { layer_norm_vec_k<T, M>(x, r, s, g, b, y, m, iv, nv, eps, rms); } \
    extern "C" __global__ void layer_norm_grad_vec##M##_##S(const T* dy, const T* x, const T* g, const Num<T>::A* m, const Num<T>::A* iv, const T* res, T* dx, Num<T>::A* part, i64 rows, i64 nv) { layer_norm_grad_vec_k<T, M>(dy, x, g, m, iv, res, dx, part, rows, nv); }
#define INST_LN_VECS(T, S) INST_LN_VEC(T, S, 1) INST_LN_VEC(T, S, 2) INST_LN_VEC(T, S, 4) \
    extern "C" __global__ void ln_dparams_fin2_##S(const Num<T>::A* part, T* ds, T* db, i64 n, i64 chunks) { ln_dparams_fin2_k<T>(part, ds, db, n, chunks); }
FOR_FLOATS(INST_LN_VECS)
#define INST_COLSUM(T, S)                                                                         \
    extern "C" __global__ void colsum_part_##S(const T* g, Num<T>::A* part, i64 rows, i64 n, i64 chunk, int kind) { colsum_part_k<T>(g, part, rows, n, chunk, kind); } \
    extern "C" __global__ void colsum_fin_##S(const Num<T>::A* part, T* o, i64 n, i64 chunks, i64 rows, int kind) { colsum_fin_k<T>(part, o, n, chunks, rows, kind); }
FOR_FLOATS(INST_COLSUM)

// Labels to i64, checked: one that is neither a class in [0, classes) nor the ignore_index
// stores `code << 48 | label` into the error flag (mapped host memory; the host reports it
// after the step) and reads as class 0 (or ignored) so that nothing indexes out of bounds.
template <class L> __device__ void labels_k(const L* in, i64* out, i64 n, i64 classes, i64 ignore, int has_ignore, u64* flag, u64 code) {
    GRID_STRIDE(i, n) {
        i64 v = (i64)in[i];
        bool ok = (v >= 0 && v < classes) || (has_ignore && v == ignore);
        if (!ok) {
            *(volatile u64*)flag = (code << 48) | ((u64)v & 0xffffffffffffull);
            v = has_ignore ? ignore : 0;
        }
        out[i] = v;
    }
}
extern "C" __global__ void labels_i64(const i64* in, i64* out, i64 n, i64 c, i64 ig, int hi, u64* flag, u64 code) { labels_k<i64>(in, out, n, c, ig, hi, flag, code); }
extern "C" __global__ void labels_i32(const int* in, i64* out, i64 n, i64 c, i64 ig, int hi, u64* flag, u64 code) { labels_k<int>(in, out, n, c, ig, hi, flag, code); }
