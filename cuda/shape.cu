// Shape family: one strided copy serves Transpose, Slice, Concat, Split, Expand and
// SliceGrad (each is a walk over some shape with source and destination strides); Gather
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
// spatial offset, -1 padding, -2 past the padding (ceil_mode's last windows).
__device__ i64 win_source(const WinGeom& g, i64 j, i64 o) {
    i64 off = 0, st = 1;
    bool pad = false;
    for (int d = 2; d >= 0; --d) {
        i64 jd = j % g.kernel[d], od = o % g.out[d];
        j /= g.kernel[d];
        o /= g.out[d];
        i64 p = od * g.stride[d] + jd * g.dil[d] - g.begin[d];
        if (p >= g.image[d] + g.end[d]) return -2;
        if (p < 0 || p >= g.image[d]) pad = true;
        off += p * st;
        st *= g.image[d];
    }
    return pad ? -1 : off;
}

// Im2Col: y[plane, j, o] = x[plane, source(j, o)], or the fill (pad, beyond) given by
// its bits.
template <class W> __device__ void im2col_k(const W* x, W* y, u64 pad_bits, u64 beyond_bits, WinGeom g, i64 n) {
    W pad = *reinterpret_cast<const W*>(&pad_bits), beyond = *reinterpret_cast<const W*>(&beyond_bits);
    GRID_STRIDE(i, n) {
        i64 o = i % g.l, j = (i / g.l) % g.k, plane = i / (g.l * g.k);
        i64 s = win_source(g, j, o);
        y[i] = s == -1 ? pad : s == -2 ? beyond : x[plane * g.hw + s];
    }
}

// Col2Im: image element p of a plane sums the column entries (j, o) that read it (per
// axis o = (p + begin - j·dil) / stride where that divides and lies in [0, out)), in
// kernel-offset order, without atomics.
template <class T> __device__ void col2im_k(const T* cols, T* y, WinGeom g, i64 n) {
    typedef typename Num<T>::A A;
    GRID_STRIDE(i, n) {
        i64 plane = i / g.hw, r = i % g.hw;
        i64 pos[3];
        for (int d = 2; d >= 0; --d) {
            pos[d] = r % g.image[d];
            r /= g.image[d];
        }
        A acc = 0;
        for (i64 j = 0; j < g.k; ++j) {
            i64 jr = j, o = 0, ost = 1;
            bool ok = true;
            for (int d = 2; d >= 0; --d) {
                i64 jd = jr % g.kernel[d];
                jr /= g.kernel[d];
                i64 q = pos[d] + g.begin[d] - jd * g.dil[d];
                if (q < 0 || q % g.stride[d] != 0 || q / g.stride[d] >= g.out[d]) { ok = false; break; }
                o += (q / g.stride[d]) * ost;
                ost *= g.out[d];
            }
            if (ok) acc += ld(cols[(plane * g.k + j) * g.l + o]);
        }
        y[i] = st<T>(acc);
    }
}

// 16-byte words: a strided copy whose innermost dim is contiguous on both sides moves
// 16 bytes per index computation (the host divides the walk into such words).
struct __align__(16) w16 { unsigned x, y, z, w; };
extern "C" __global__ void copy_w16(const w16* x, w16* y, Strided s, i64 n) { copy_k<w16>(x, y, s, n); }

#define INST_SHAPE_WORD(W, S)                                                                     \
    extern "C" __global__ void copy_##S(const W* x, W* y, Strided s, i64 n) { copy_k<W>(x, y, s, n); } \
    extern "C" __global__ void gather_##S(const W* x, const i64* ids, W* o, i64 nq, i64 d, i64 inner, i64 n) { gather_k<W>(x, ids, o, nq, d, inner, n); } \
    extern "C" __global__ void pad_##S(const W* x, const i64* offs, const W* c, W* o, i64 n) { pad_k<W>(x, offs, c, o, n); } \
    extern "C" __global__ void im2col_##S(const W* x, W* y, u64 p, u64 b, WinGeom g, i64 n) { im2col_k<W>(x, y, p, b, g, n); }
FOR_WORDS(INST_SHAPE_WORD)

#define INST_SHAPE_FLOAT(T, S) \
    extern "C" __global__ void gather_grad_##S(const T* dy, const i64* order, const i64* starts, T* o, i64 nq, i64 d, i64 inner, i64 n) { gather_grad_k<T>(dy, order, starts, o, nq, d, inner, n); } \
    extern "C" __global__ void col2im_##S(const T* cols, T* y, WinGeom g, i64 n) { col2im_k<T>(cols, y, g, n); }
FOR_FLOATS(INST_SHAPE_FLOAT)

#define INST_SCATTER(T, S) \
    extern "C" __global__ void scatter_##S(const T* data, const T* upd, const int* aux, T* o, i64 starts_at, i64 order_at, int mode, i64 n) { scatter_k<T>(data, upd, aux, o, starts_at, order_at, mode, n); }
FOR_ALL(INST_SCATTER)
