// Shared by every kernel family: dtypes, their accumulation types, math overloads and the
// strided-index helper. NVRTC compiles these sources without the toolkit's headers (they
// are not found without an include path), so f16/bf16 are our own 16-bit structs with
// conversions written in PTX / bit operations, rounding to nearest even like the `half`
// crate the CPU backend uses.

typedef long long i64;
typedef unsigned long long u64;

struct f16 { unsigned short x; };
struct bf16 { unsigned short x; };
struct boolean { unsigned char x; };

// Num<T>: how a stored element is computed with. Floats compute in f32 (f64 for f64),
// integers in i64 (u64 when unsigned) with wrapping arithmetic, as on the CPU.
template <class T> struct Num;
template <> struct Num<float> {
    typedef float A;
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float store(float a) { return a; }
};
template <> struct Num<double> {
    typedef double A;
    static __device__ __forceinline__ double load(double v) { return v; }
    static __device__ __forceinline__ double store(double a) { return a; }
};
template <> struct Num<f16> {
    typedef float A;
    static __device__ __forceinline__ float load(f16 v) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
        return f;
    }
    static __device__ __forceinline__ f16 store(float a) {
        f16 r;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.x) : "f"(a));
        return r;
    }
};
template <> struct Num<bf16> {
    typedef float A;
    static __device__ __forceinline__ float load(bf16 v) {
        return __uint_as_float(((unsigned)v.x) << 16);
    }
    static __device__ __forceinline__ bf16 store(float a) {
        unsigned u = __float_as_uint(a);
        bf16 r;
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            r.x = (unsigned short)((u >> 16) | 0x0040u);  // quiet NaN, sign kept
        } else {
            u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
            r.x = (unsigned short)(u >> 16);
        }
        return r;
    }
};
// Integers: signed ones compute in i64, unsigned ones in u64, wrapping; a store narrows
// (two's complement), which is numpy's result in the narrow type.
template <class T, class W> struct IntNum {
    typedef W A;
    static __device__ __forceinline__ W load(T v) { return (W)v; }
    static __device__ __forceinline__ T store(W a) { return (T)a; }
};
template <> struct Num<i64> : IntNum<i64, i64> {};
template <> struct Num<int> : IntNum<int, i64> {};
template <> struct Num<short> : IntNum<short, i64> {};
template <> struct Num<signed char> : IntNum<signed char, i64> {};
template <> struct Num<u64> : IntNum<u64, u64> {};
template <> struct Num<unsigned int> : IntNum<unsigned int, u64> {};
template <> struct Num<unsigned short> : IntNum<unsigned short, u64> {};
template <> struct Num<unsigned char> : IntNum<unsigned char, u64> {};
// bool: one byte, 0 or 1.
template <> struct Num<boolean> {
    typedef i64 A;
    static __device__ __forceinline__ i64 load(boolean v) { return v.x != 0; }
    static __device__ __forceinline__ boolean store(i64 a) { boolean r; r.x = a != 0; return r; }
};
template <class T> struct IsInt { static const bool v = false; };
#define INT_TRAIT(T) template <> struct IsInt<T> { static const bool v = true; };
INT_TRAIT(i64) INT_TRAIT(int) INT_TRAIT(short) INT_TRAIT(signed char) INT_TRAIT(u64)
INT_TRAIT(unsigned int) INT_TRAIT(unsigned short) INT_TRAIT(unsigned char) INT_TRAIT(boolean)
#undef INT_TRAIT

template <class T> __device__ __forceinline__ typename Num<T>::A ld(T v) { return Num<T>::load(v); }
template <class T> __device__ __forceinline__ T st(typename Num<T>::A a) { return Num<T>::store(a); }

// Casts as the CPU's `cast_into`: between integers (and bool) exactly, wrapping; otherwise
// through f64, which holds every float exactly; float to integer saturates and NaN
// becomes 0 (Rust's `as`); bool is `v != 0`.
template <class T> __device__ __forceinline__ double to_f64(T v) { return (double)Num<T>::load(v); }
template <class D> __device__ __forceinline__ D cast_from_f64(double v);
template <> __device__ __forceinline__ float cast_from_f64<float>(double v) { return (float)v; }
template <> __device__ __forceinline__ double cast_from_f64<double>(double v) { return v; }
template <> __device__ __forceinline__ f16 cast_from_f64<f16>(double v) { return Num<f16>::store((float)v); }
template <> __device__ __forceinline__ bf16 cast_from_f64<bf16>(double v) { return Num<bf16>::store((float)v); }
template <> __device__ __forceinline__ boolean cast_from_f64<boolean>(double v) { boolean r; r.x = v != 0.0; return r; }
// An integer type's largest and smallest values (the unsigned ones' smallest is 0).
template <class T> __device__ __forceinline__ bool int_signed() { return (T)~(T)0 < (T)0; }
template <class T> __device__ __forceinline__ T int_max() {
    return int_signed<T>() ? (T)((((u64)1) << (sizeof(T) * 8 - 1)) - 1) : (T)~(T)0;
}
template <class T> __device__ __forceinline__ T int_min() {
    return int_signed<T>() ? (T)(((u64)1) << (sizeof(T) * 8 - 1)) : (T)0;
}
// lo and hi are the type's limits as doubles (2^63 and 2^64 exactly for the 64-bit ones).
#define SAT_CAST(T, lo, hi) \
    template <> __device__ __forceinline__ T cast_from_f64<T>(double v) { \
        if (v != v) return 0; \
        if (v >= (hi)) return int_max<T>(); \
        if (v <= (lo)) return int_min<T>(); \
        return (T)v; \
    }
SAT_CAST(i64, -9223372036854775808.0, 9223372036854775807.0)
SAT_CAST(int, -2147483648.0, 2147483647.0)
SAT_CAST(short, -32768.0, 32767.0)
SAT_CAST(signed char, -128.0, 127.0)
SAT_CAST(u64, 0.0, 18446744073709551615.0)
SAT_CAST(unsigned int, 0.0, 4294967295.0)
SAT_CAST(unsigned short, 0.0, 65535.0)
SAT_CAST(unsigned char, 0.0, 255.0)
#undef SAT_CAST
template <class S, class D> __device__ __forceinline__ D cast_val(S v) {
    if (IsInt<S>::v && IsInt<D>::v) return Num<D>::store((typename Num<D>::A)Num<S>::load(v));
    return cast_from_f64<D>(to_f64(v));
}

// Math in the accumulation type.
__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float m_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double m_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float m_erf(float x) { return erff(x); }
__device__ __forceinline__ double m_erf(double x) { return erf(x); }
__device__ __forceinline__ float m_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double m_tanh(double x) { return tanh(x); }
// The rest of the unary maps' math, float and double.
#define M1(name) \
    __device__ __forceinline__ float m_##name(float x) { return name##f(x); } \
    __device__ __forceinline__ double m_##name(double x) { return name(x); }
M1(sin) M1(cos) M1(tan) M1(asin) M1(acos) M1(atan) M1(sinh) M1(cosh) M1(asinh) M1(acosh)
M1(atanh) M1(floor) M1(ceil) M1(rint) M1(log1p) M1(fabs)
#undef M1
__device__ __forceinline__ float m_fmod(float x, float y) { return fmodf(x, y); }
__device__ __forceinline__ double m_fmod(double x, double y) { return fmod(x, y); }
__device__ __forceinline__ float m_pow(float x, float e) { return powf(x, e); }
__device__ __forceinline__ double m_pow(double x, double e) { return pow(x, e); }
__device__ __forceinline__ float neg_inf(float) { return __int_as_float(0xff800000); }
__device__ __forceinline__ double neg_inf(double) { return __longlong_as_double(0xfff0000000000000ll); }
// NaN-propagating maximum, as numpy's `maximum` and the CPU backend.
template <class A> __device__ __forceinline__ A nan_max(A a, A b) { return (b > a || b != b) ? b : a; }

// A row-major walk over `shape` with up to 3 operands, each with its own element strides
// (0 along broadcast dims, negative for reversed slices) and base offset.
#define MAXR 8
struct Strided {
    int rank;
    int small;  // fewer than 2^31 elements: 32-bit index arithmetic

    i64 shape[MAXR];
    i64 st[3][MAXR];
    i64 base[3];
};

// Offset of operand k for the row-major linear index i over `s.shape`.
__device__ __forceinline__ i64 offset_of(const Strided& s, int k, i64 i) {
    // Rank 0 and 1 (after the host merged contiguous dims) need no division.
    if (s.rank <= 1) return s.base[k] + (s.rank == 1 ? i * s.st[k][0] : 0);
    i64 off = s.base[k];
    if (s.small) {
        // 64-bit division is emulated; these walks fit 32 bits.
        unsigned u = (unsigned)i;
        for (int d = s.rank - 1; d >= 0; --d) {
            unsigned n = (unsigned)s.shape[d];
            off += (i64)(u % n) * s.st[k][d];
            u /= n;
        }
        return off;
    }
    for (int d = s.rank - 1; d >= 0; --d) {
        i64 n = s.shape[d];
        off += (i % n) * s.st[k][d];
        i /= n;
    }
    return off;
}

#define GRID_STRIDE(i, n) for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// Instantiation lists: `M(type, suffix)`; the suffix is what the host appends to a kernel
// name (src/backends/cuda/device.rs `suffix`).
#define FOR_FLOATS(M) M(float, f32) M(double, f64) M(f16, f16) M(bf16, bf16)
#define FOR_INTS(M) M(i64, i64) M(int, i32) M(short, i16) M(signed char, i8) M(u64, u64) \
    M(unsigned int, u32) M(unsigned short, u16) M(unsigned char, u8)
#define FOR_NUMS(M) FOR_FLOATS(M) FOR_INTS(M)
#define FOR_ALL(M) FOR_NUMS(M) M(boolean, bool)
// The same list again, for a macro that expands one inside the other (casts).
#define FOR_INTS_TO(M, S, SS) M(i64, i64, S, SS) M(int, i32, S, SS) M(short, i16, S, SS) \
    M(signed char, i8, S, SS) M(u64, u64, S, SS) M(unsigned int, u32, S, SS) \
    M(unsigned short, u16, S, SS) M(unsigned char, u8, S, SS)
#define FOR_ALL_TO(M, S, SS) M(float, f32, S, SS) M(double, f64, S, SS) M(f16, f16, S, SS) \
    M(bf16, bf16, S, SS) M(i64, i64, S, SS) M(int, i32, S, SS) M(short, i16, S, SS) \
    M(signed char, i8, S, SS) M(u64, u64, S, SS) M(unsigned int, u32, S, SS) \
    M(unsigned short, u16, S, SS) M(unsigned char, u8, S, SS) M(boolean, bool, S, SS)
// Dtype-agnostic copies move words of the element's size.
#define FOR_WORDS(M) M(unsigned char, w1) M(unsigned short, w2) M(unsigned int, w4) M(u64, w8)

struct SumOp { template <class A> __device__ __forceinline__ A operator()(A a, A b) const { return a + b; } };
struct MaxOp { template <class A> __device__ __forceinline__ A operator()(A a, A b) const { return nan_max(a, b); } };

// Block-wide reduction of one value per thread (blockDim.x a multiple of 32, at most
// 1024); every thread gets the result.
template <class A, class Op> __device__ A block_reduce(A v, A ident, Op op) {
    __shared__ A part[32];
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) part[w] = v;
    __syncthreads();
    int nw = blockDim.x >> 5;
    v = ((int)threadIdx.x < nw) ? part[threadIdx.x] : ident;
    if (w == 0)
        for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x == 0) part[0] = v;
    __syncthreads();
    A r = part[0];
    __syncthreads();
    return r;
}
template <class A> __device__ __forceinline__ A block_sum(A v) { return block_reduce(v, (A)0, SumOp()); }
template <class A> __device__ __forceinline__ A block_max(A v) { return block_reduce(v, neg_inf(v), MaxOp()); }

// Warp-wide sum; every lane gets the result.
template <class A> __device__ __forceinline__ A warp_sum(A v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The geometry of one Attention / VarlenAttention launch, here because cuda/attention.cu
// and cuda/flash.cu are separate modules (src/backends/cuda/attention.rs mirrors it).
struct AttnGeom {
    i64 hq, hkv, sq, skv, d, dv;
    i64 ms[4];        // attn_mask strides over [B, Hq, Sq, Skv] (0 where broadcast)
    // Element strides (batch, head, row; the head vector itself contiguous) of Q, K, V and
    // Y, indexed by ATT_Q.. below; dQ, dK, dV and dY share those of Q, K, V and Y. [B,H,S,D]
    // contiguous: (H·S·D, S·D, D); [B,S,H,D] (ONNX's 3-D layout): (S·H·D, D, H·D).
    // VarlenAttention's packed [T,H,D] is [1,T,H,D]: batch stride unused, row = token.
    i64 st[4][3];
    i64 rows;         // query rows (forward, dQ) or key rows (dK/dV) in all
    i64 nseq;         // VarlenAttention: sequences
    double scale;
    int varlen, causal, mask_kind;  // mask_kind: 0 none, 1 bool, 2 additive
};
#define ATT_Q 0
#define ATT_K 1
#define ATT_V 2
#define ATT_Y 3
// Offset of row `i` of head `h` of batch `b` in tensor `t` (ATT_Q..ATT_Y).
__device__ __forceinline__ i64 att_off(const AttnGeom& g, int t, i64 b, i64 h, i64 i) {
    return b * g.st[t][0] + h * g.st[t][1] + i * g.st[t][2];
}
