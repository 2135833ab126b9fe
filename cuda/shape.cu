// Shape family: one strided copy serves Transpose, Slice, Concat, Split, Expand and
// SliceGrad (each is a walk over some shape with source and destination strides); tiled
// batched transposes (channels-first <-> channels-last); MaxPool and its gradient; Gather
// and its deterministic scatter-add (GatherGrad, PadGrad); Pad; ScatterElements/ScatterND.

// y[offset(s, 1, i)] = x[offset(s, 0, i)] over the shape of `s`.
template <class W> __device__ void copy_k(const W* x, W* y, Strided s, i64 n) {
    GRID_STRIDE(i, n) y[offset_of(s, 1, i)] = x[offset_of(s, 0, i)];
}

// out[o, q, c] = x[o, ids[q], c] for x `[outer, d, inner]`; ids already range-checked and
// made non-negative by the host.
template <class W> __device__ void gather_k(const W* x, const i64* ids, W* out, i64 nq, i64 d, i64 inner, i64 n) {
    GRID_STRIDE(i, n) {
        i64 c = i % inner, q = (i / inner) % nq, o = i / (inner * nq);
        out[i] = x[(o * d + ids[q]) * inner + c];
    }
}

// out[o, j, c] = Σ dy[o, q, c] over the q with ids[q] == j: `order` lists the q sorted by
// id and `starts[j]..starts[j+1]` are those of row j. Gathered rows are summed in a fixed
// order, without atomics, so the result is deterministic.
template <class T> __device__ void gather_grad_k(const T* dy, const i64* order, const i64* starts, T* out, i64 nq, i64 d, i64 inner, i64 n) {
    typedef typename Num<T>::A A;
    GRID_STRIDE(i, n) {
        i64 c = i % inner, j = (i / inner) % d, o = i / (inner * d);
        A acc = 0;
        for (i64 r = starts[j]; r < starts[j + 1]; ++r) acc += ld(dy[(o * nq + order[r]) * inner + c]);
        out[i] = st<T>(acc);
    }
}

// Pad: out[i] = x[offs[i]], or the constant c[0] where offs[i] < 0 (the host's
// `common::pad_plan` maps every output element to its source).
template <class W> __device__ void pad_k(const W* x, const i64* offs, const W* c, W* out, i64 n) {
    GRID_STRIDE(i, n) {
        i64 k = offs[i];
        out[i] = k < 0 ? c[0] : x[k];
    }
}

// ScatterElements / ScatterND: one thread per output element, so repeated indices never
// race. aux[i] is the group of updates landing on element i (-1: none); group g's updates
// are aux[order_at + q] for q in aux[starts_at + g] .. aux[starts_at + g + 1], in index
// order (`common::scatter_plan`). mode: 0 replace (the last update wins), 1 add, 2 mul,
// 3 max, 4 min (as Python's max/min: the element stays unless the update is strictly
// beyond it).
template <class T> __device__ void scatter_k(const T* data, const T* upd, const int* aux, T* out, i64 starts_at, i64 order_at, int mode, i64 n) {
    GRID_STRIDE(i, n) {
        int g = aux[i];
        T v = data[i];
        if (g >= 0) {
            for (int q = aux[starts_at + g]; q < aux[starts_at + g + 1]; ++q) {
                T u = upd[aux[order_at + q]];
                switch (mode) {
                    case 0: v = u; break;
                    case 1: v = st<T>(ld(v) + ld(u)); break;
                    case 2: v = st<T>(ld(v) * ld(u)); break;
                    case 3: if (ld(u) > ld(v)) v = u; break;
                    default: if (ld(u) < ld(v)) v = u; break;
                }
            }
        }
        out[i] = v;
    }
}

// A sliding window (src/backends/common.rs `WindowGeom`): spatial rank padded to 3.
struct WinGeom {
    i64 image[3], out[3], kernel[3], stride[3], dil[3], begin[3], end[3];
    i64 n, c, k, l, hw, spare;
};

// Where column entry (kernel offset j, output position o) reads: the image's flat
// spatial offset, -1 padding, -2 past the padding (ceil_mode's last windows). I is the
// index type: 32-bit when every index fits (64-bit divisions cost ten times as much).
template <class I> __device__ __forceinline__ long long win_source(const WinGeom& g, I j, I o) {
    long long off = 0, st = 1;
    bool pad = false;
    for (int d = 2; d >= 0; --d) {
        I kd = (I)g.kernel[d], od_n = (I)g.out[d];
        I jd = j % kd, od = o % od_n;
        j /= kd;
        o /= od_n;
        long long p = (long long)(od * (I)g.stride[d] + jd * (I)g.dil[d]) - g.begin[d];
        if (p >= g.image[d] + g.end[d]) return -2;
        if (p < 0 || p >= g.image[d]) pad = true;
        off += p * st;
        st *= g.image[d];
    }
    return pad ? -1 : off;
}

template <class I, class W> __device__ __forceinline__ void im2col_body(const W* x, W* y, W pad, W beyond, const WinGeom& g, I n) {
    I l = (I)g.l, k = (I)g.k, hw = (I)g.hw;
    for (I i = blockIdx.x * (I)blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x) {
        I o = i % l, r = i / l, j = r % k, plane = r / k;
        long long s = win_source<I>(g, j, o);
        y[i] = s == -1 ? pad : s == -2 ? beyond : x[(long long)plane * hw + s];
    }
}

// Im2Col: y[plane, j, o] = x[plane, source(j, o)], or the fill (pad, beyond) given by
// its bits.
template <class W> __device__ void im2col_k(const W* x, W* y, u64 pad_bits, u64 beyond_bits, WinGeom g, i64 n) {
    W pad = *reinterpret_cast<const W*>(&pad_bits), beyond = *reinterpret_cast<const W*>(&beyond_bits);
    if (n < (1LL << 31)) im2col_body<unsigned>(x, y, pad, beyond, g, (unsigned)n);
    else im2col_body<i64>(x, y, pad, beyond, g, n);
}

// Calls f(j, o) for each column entry (kernel offset j, output position o) that reads
// image position r of a plane (per axis o = (p + begin - j·dil) / stride where that
// divides and lies in [0, out)), in kernel-offset order.
template <class I, class F> __device__ __forceinline__ void for_each_reader(const WinGeom& g, I r, F f) {
    int pos[3];
    for (int d = 2; d >= 0; --d) {
        pos[d] = (int)(r % (I)g.image[d]);
        r /= (I)g.image[d];
    }
    for (I j = 0; j < (I)g.k; ++j) {
        I jr = j, o = 0, ost = 1;
        bool ok = true;
        for (int d = 2; d >= 0; --d) {
            I kd = (I)g.kernel[d];
            int jd = (int)(jr % kd);
            jr /= kd;
            int q = pos[d] + (int)g.begin[d] - jd * (int)g.dil[d];
            int s = (int)g.stride[d];
            if (q < 0 || q % s != 0 || q / s >= (int)g.out[d]) { ok = false; break; }
            o += (I)(q / s) * ost;
            ost *= (I)g.out[d];
        }
        if (ok) f(j, o);
    }
}

// Col2Im: image element p of a plane sums the column entries that read it, without
// atomics.
template <class I, class T> __device__ __forceinline__ void col2im_body(const T* cols, T* y, const WinGeom& g, I n) {
    typedef typename Num<T>::A A;
    I hw = (I)g.hw, k = (I)g.k, l = (I)g.l;
    for (I i = blockIdx.x * (I)blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x) {
        I plane = i / hw;
        A acc = 0;
        for_each_reader<I>(g, i % hw, [&](I j, I o) { acc += ld(cols[((long long)plane * k + j) * l + o]); });
        y[i] = st<T>(acc);
    }
}
template <class T> __device__ void col2im_k(const T* cols, T* y, WinGeom g, i64 n) {
    if (n < (1LL << 31) && g.n * g.c * g.k * g.l < (1LL << 31)) col2im_body<unsigned>(cols, y, g, (unsigned)n);
    else col2im_body<i64>(cols, y, g, n);
}

// MaxPool over the window of output i (plane, o): the maximum (NaN where the window holds
// one, -inf where it reads none of the image) into *best, and the plane offset of its
// first position in window order (-1 for none), which is where the gradient goes. Loops
// per axis, so that a window costs three divisions instead of several per position
// (win_source's).
// Channels-last (`spare` = C, the channel count), output i is (n, o, c) and position s of
// the image reads x[(n·hw + s)·C + c].
template <class I, class T> __device__ __forceinline__ int pool_argmax(const T* x, const WinGeom& g, I i, typename Num<T>::A* best) {
    typedef typename Num<T>::A A;
    I l = (I)g.l, o;
    const T* img;
    long long cs = 1;
    if (g.spare) {
        I ch = (I)g.spare, t = i / ch;
        o = t % l;
        img = x + (long long)(t / l) * g.hw * g.spare + (long long)(i % ch);
        cs = g.spare;
    } else {
        o = i % l;
        img = x + (long long)(i / l) * g.hw;
    }
    int first[3];  // the window's first position along each axis
    for (int d = 2; d >= 0; --d) {
        I od = (I)g.out[d];
        first[d] = (int)(o % od) * (int)g.stride[d] - (int)g.begin[d];
        o /= od;
    }
    const int h = (int)g.image[0], w = (int)g.image[1], v2 = (int)g.image[2];
    int at = -1;
    A b = neg_inf(A(0));
    for (int j0 = 0; j0 < (int)g.kernel[0]; ++j0) {
        int q0 = first[0] + j0 * (int)g.dil[0];
        if (q0 < 0 || q0 >= h) continue;
        for (int j1 = 0; j1 < (int)g.kernel[1]; ++j1) {
            int q1 = first[1] + j1 * (int)g.dil[1];
            if (q1 < 0 || q1 >= w) continue;
            for (int j2 = 0; j2 < (int)g.kernel[2]; ++j2) {
                int q2 = first[2] + j2 * (int)g.dil[2];
                if (q2 < 0 || q2 >= v2) continue;
                int s = (q0 * w + q1) * v2 + q2;
                A v = ld(img[s * cs]);
                if (at < 0 || v > b || (v != v && b == b)) { b = v; at = s; }
            }
        }
    }
    *best = b;
    return at;
}

// MaxPool: a thread per output. With `at` (MaxPoolGrad's first step) it writes each
// window's argmax there instead of the maximum to y.
template <class I, class T> __device__ __forceinline__ void max_pool_body(const T* x, T* y, int* at, const WinGeom& g, I n) {
    typedef typename Num<T>::A A;
    for (I i = blockIdx.x * (I)blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x) {
        A b;
        int a = pool_argmax<I, T>(x, g, i, &b);
        if (at) at[i] = a;
        else y[i] = st<T>(b);
    }
}
template <class T> __device__ void max_pool_k(const T* x, T* y, int* at, WinGeom g, i64 n) {
    if (n < (1LL << 31) && g.n * g.c * g.hw < (1LL << 31)) max_pool_body<unsigned, T>(x, y, at, g, (unsigned)n);
    else max_pool_body<i64, T>(x, y, at, g, n);
}

// The outputs along one axis whose window reads position p there, as the range [lo, hi]
// walked from hi down (kernel offsets ascending); with a dilation only every such that
// lands on a kernel tap counts (`pool_tap`).
struct AxisRange { int lo, hi; };
__device__ __forceinline__ AxisRange pool_range(int p, int begin, int k, int s, int dil, int out) {
    int t = p + begin;  // the window start of output 0 is -begin
    AxisRange r;
    r.hi = t < 0 ? -1 : min(t / s, out - 1);
    int low = t - (k - 1) * dil;  // the earliest window start that still reaches p
    r.lo = low <= 0 ? 0 : (low + s - 1) / s;
    return r;
}
// Kernel offset of output od's window at position p along an axis, or -1 past the taps.
__device__ __forceinline__ int pool_tap(int p, int begin, int od, int s, int dil, int k) {
    int t = p + begin - od * s;
    if (dil != 1) {
        if (t % dil != 0) return -1;
        t /= dil;
    }
    return t < k ? t : -1;
}

// Calls f(o) for each window o (flat over the output's spatial dims) that reads image
// position (p0, p1, p2) at a kernel tap, given the ranges along each axis (`pool_range`),
// latest window first along each axis (kernel offsets ascending).
template <class F> __device__ __forceinline__ void for_each_window(const WinGeom& g, int p0, int p1, int p2, AxisRange a0, AxisRange a1, AxisRange a2, F f) {
    const int o1n = (int)g.out[1], o2n = (int)g.out[2];
    for (int o0 = a0.hi; o0 >= a0.lo; --o0) {
        if (pool_tap(p0, (int)g.begin[0], o0, (int)g.stride[0], (int)g.dil[0], (int)g.kernel[0]) < 0) continue;
        for (int o1 = a1.hi; o1 >= a1.lo; --o1) {
            if (pool_tap(p1, (int)g.begin[1], o1, (int)g.stride[1], (int)g.dil[1], (int)g.kernel[1]) < 0) continue;
            for (int o2 = a2.hi; o2 >= a2.lo; --o2) {
                if (pool_tap(p2, (int)g.begin[2], o2, (int)g.stride[2], (int)g.dil[2], (int)g.kernel[2]) < 0) continue;
                f(((long long)o0 * o1n + o1) * o2n + o2);
            }
        }
    }
}

// MaxPoolGrad's second step: image element p of a plane sums dY over the windows that
// read it and whose argmax it is (in kernel-offset order, without atomics). The windows
// are found per axis from p's coordinates. A thread takes a run of POOL_RUN elements along
// the last axis, so that the divisions that place the run and its ranges along the other
// axes are shared: what is left per element is two (the last axis's range); testing every
// kernel offset took several per offset, and ResNet-50's max pool gradient at batch 64
// cost 4 ms on an H100.
#define POOL_RUN 4
template <class I, class T> __device__ __forceinline__ void max_pool_grad_body(const T* dy, const int* at, T* dx, const WinGeom& g, I runs) {
    typedef typename Num<T>::A A;
    const int w = (int)g.image[2], rw = (w + POOL_RUN - 1) / POOL_RUN;
    const I rows01 = (I)(g.image[0] * g.image[1]);
    const int o2n = (int)g.out[2];
    for (I i = blockIdx.x * (I)blockDim.x + threadIdx.x; i < runs; i += (I)gridDim.x * blockDim.x) {
        const I row = i / (I)rw, plane = row / rows01, r01 = row % rows01;
        const int x0 = (int)(i % (I)rw) * POOL_RUN;
        const int p1 = (int)(r01 % (I)g.image[1]), p0 = (int)(r01 / (I)g.image[1]);
        const AxisRange a0 = pool_range(p0, (int)g.begin[0], (int)g.kernel[0], (int)g.stride[0], (int)g.dil[0], (int)g.out[0]);
        const AxisRange a1 = pool_range(p1, (int)g.begin[1], (int)g.kernel[1], (int)g.stride[1], (int)g.dil[1], (int)g.out[1]);
        const long long base = (long long)plane * g.l;
        const int p01 = p0 * (int)g.image[1] + p1;
        for (int x = x0; x < x0 + POOL_RUN && x < w; ++x) {
            const int p = p01 * w + x;
            const AxisRange a2 = pool_range(x, (int)g.begin[2], (int)g.kernel[2], (int)g.stride[2], (int)g.dil[2], o2n);
            A acc = 0;
            for_each_window(g, p0, p1, x, a0, a1, a2, [&](long long o) {
                if (at[base + o] == p) acc += ld(dy[base + o]);
            });
            dx[(long long)plane * g.hw + p] = st<T>(acc);
        }
    }
}
// The same channels-last (`spare` = C): a thread takes a run of POOL_RUN channels at one
// image position, whose windows are the same for the whole run.
template <class I, class T> __device__ __forceinline__ void max_pool_grad_last_body(const T* dy, const int* at, T* dx, const WinGeom& g, I runs) {
    typedef typename Num<T>::A A;
    const I ch = (I)g.spare, rc = (ch + POOL_RUN - 1) / POOL_RUN, hw = (I)g.hw;
    const int w = (int)g.image[2], o2n = (int)g.out[2];
    for (I i = blockIdx.x * (I)blockDim.x + threadIdx.x; i < runs; i += (I)gridDim.x * blockDim.x) {
        const I t = i / rc, n = t / hw;
        const int c0 = (int)(i % rc) * POOL_RUN, p = (int)(t % hw);
        const int x = p % w, r01 = p / w;
        const int p1 = r01 % (int)g.image[1], p0 = r01 / (int)g.image[1];
        const AxisRange a0 = pool_range(p0, (int)g.begin[0], (int)g.kernel[0], (int)g.stride[0], (int)g.dil[0], (int)g.out[0]);
        const AxisRange a1 = pool_range(p1, (int)g.begin[1], (int)g.kernel[1], (int)g.stride[1], (int)g.dil[1], (int)g.out[1]);
        const AxisRange a2 = pool_range(x, (int)g.begin[2], (int)g.kernel[2], (int)g.stride[2], (int)g.dil[2], o2n);
        const int run = min((int)POOL_RUN, (int)(ch - c0));
        A acc[POOL_RUN];
#pragma unroll
        for (int k = 0; k < POOL_RUN; ++k) acc[k] = 0;
        for_each_window(g, p0, p1, x, a0, a1, a2, [&](long long o) {
            long long wi = ((long long)n * g.l + o) * g.spare + c0;
#pragma unroll
            for (int k = 0; k < POOL_RUN; ++k)
                if (k < run && at[wi + k] == p) acc[k] += ld(dy[wi + k]);
        });
        long long base = ((long long)n * hw + p) * g.spare + c0;
#pragma unroll
        for (int k = 0; k < POOL_RUN; ++k)
            if (k < run) dx[base + k] = st<T>(acc[k]);
    }
}
// n: the runs (image rows of every plane × runs a row; channels-last, positions × runs
// of channels).
template <class T> __device__ void max_pool_grad_k(const T* dy, const int* at, T* dx, WinGeom g, i64 n) {
    bool small = n < (1LL << 31) && g.n * g.c * g.l < (1LL << 31) && g.n * g.c * g.hw < (1LL << 31);
    if (g.spare) {
        if (small) max_pool_grad_last_body<unsigned, T>(dy, at, dx, g, (unsigned)n);
        else max_pool_grad_last_body<i64, T>(dy, at, dx, g, n);
    } else if (small) max_pool_grad_body<unsigned, T>(dy, at, dx, g, (unsigned)n);
    else max_pool_grad_body<i64, T>(dy, at, dx, g, n);
}

// 16-byte words: a strided copy whose innermost dim is contiguous on both sides moves
// 16 bytes per index computation (the host divides the walk into such words).
struct __align__(16) w16 { unsigned x, y, z, w; };
// Batched transposes y[b][j][i] = x[b][i][j] for x `[batch, rows, cols]`: the channels-first
// <-> channels-last copies around cuDNN's NHWC convolutions (src/backends/cuda/conv.rs).
// Through a 32x32 tile in shared memory, so that reads and writes are both coalesced (the
// strided copy would make one side 32 times as many transactions). Grid (tiles of cols,
// tiles of rows, batch), 256 threads: each moves 4 elements of its tile each way.
template <class W> __device__ void transpose_k(const W* x, W* y, i64 rows, i64 cols) {
    __shared__ W tile[32][33];
    const i64 b = blockIdx.z, r0 = (i64)blockIdx.y * 32, c0 = (i64)blockIdx.x * 32;
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    x += b * rows * cols;
    y += b * rows * cols;
    for (int i = ty; i < 32; i += 8) {
        i64 r = r0 + i, c = c0 + tx;
        if (r < rows && c < cols) tile[i][tx] = x[r * cols + c];
    }
    __syncthreads();
    for (int i = ty; i < 32; i += 8) {
        i64 c = c0 + i, r = r0 + tx;
        if (r < rows && c < cols) y[c * rows + r] = tile[tx][i];
    }
}

extern "C" __global__ void copy_w16(const w16* x, w16* y, Strided s, i64 n) { copy_k<w16>(x, y, s, n); }

#define INST_SHAPE_WORD(W, S)                                                                     \
    extern "C" __global__ void copy_##S(const W* x, W* y, Strided s, i64 n) { copy_k<W>(x, y, s, n); } \
    extern "C" __global__ void gather_##S(const W* x, const i64* ids, W* o, i64 nq, i64 d, i64 inner, i64 n) { gather_k<W>(x, ids, o, nq, d, inner, n); } \
    extern "C" __global__ void pad_##S(const W* x, const i64* offs, const W* c, W* o, i64 n) { pad_k<W>(x, offs, c, o, n); } \
    extern "C" __global__ void im2col_##S(const W* x, W* y, u64 p, u64 b, WinGeom g, i64 n) { im2col_k<W>(x, y, p, b, g, n); } \
    extern "C" __global__ void transpose_##S(const W* x, W* y, i64 rows, i64 cols) { transpose_k<W>(x, y, rows, cols); }
FOR_WORDS(INST_SHAPE_WORD)

#define INST_SHAPE_FLOAT(T, S) \
    extern "C" __global__ void gather_grad_##S(const T* dy, const i64* order, const i64* starts, T* o, i64 nq, i64 d, i64 inner, i64 n) { gather_grad_k<T>(dy, order, starts, o, nq, d, inner, n); } \
    extern "C" __global__ void col2im_##S(const T* cols, T* y, WinGeom g, i64 n) { col2im_k<T>(cols, y, g, n); } \
    extern "C" __global__ void max_pool_##S(const T* x, T* y, int* at, WinGeom g, i64 n) { max_pool_k<T>(x, y, at, g, n); } \
    extern "C" __global__ void max_pool_grad_##S(const T* dy, const int* at, T* dx, WinGeom g, i64 n) { max_pool_grad_k<T>(dy, at, dx, g, n); }
FOR_FLOATS(INST_SHAPE_FLOAT)

#define INST_SCATTER(T, S) \
    extern "C" __global__ void scatter_##S(const T* data, const T* upd, const int* aux, T* o, i64 starts_at, i64 order_at, int mode, i64 n) { scatter_k<T>(data, upd, aux, o, starts_at, order_at, mode, n); }
FOR_ALL(INST_SCATTER)
