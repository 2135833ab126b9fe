// Shape family: one strided copy serves Transpose, Slice, Concat, Split, Expand and
// SliceGrad (each is a walk over some shape with source and destination strides); Gather
// and its deterministic scatter-add (GatherGrad).

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

// 16-byte words: a strided copy whose innermost dim is contiguous on both sides moves
// 16 bytes per index computation (the host divides the walk into such words).
struct __align__(16) w16 { unsigned x, y, z, w; };
extern "C" __global__ void copy_w16(const w16* x, w16* y, Strided s, i64 n) { copy_k<w16>(x, y, s, n); }

#define INST_SHAPE_WORD(W, S)                                                                     \
    extern "C" __global__ void copy_##S(const W* x, W* y, Strided s, i64 n) { copy_k<W>(x, y, s, n); } \
    extern "C" __global__ void gather_##S(const W* x, const i64* ids, W* o, i64 nq, i64 d, i64 inner, i64 n) { gather_k<W>(x, ids, o, nq, d, inner, n); }
FOR_WORDS(INST_SHAPE_WORD)

#define INST_SHAPE_FLOAT(T, S) \
    extern "C" __global__ void gather_grad_##S(const T* dy, const i64* order, const i64* starts, T* o, i64 nq, i64 d, i64 inner, i64 n) { gather_grad_k<T>(dy, order, starts, o, nq, d, inner, n); }
FOR_FLOATS(INST_SHAPE_FLOAT)
