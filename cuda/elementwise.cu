// Elementwise family: unary and binary maps with numpy broadcasting (through `Strided`),
// Pow, Clip, Where, Cast, Dropout, the Random draws, Trilu, the unary gradients and the FusedMatMul
// activation epilogue. The activation formulas are the CPU backend's
// (src/backends/cpu/elementwise.rs `act`), so fused and unfused graphs agree.

// The op codes OP_* come from cuda/opcodes.cuh, generated from the Rust declaration
// (src/graph/elementwise.rs); every switch over them ends in a trap.

#define K_SQRT_2_OVER_PI 0.7978845608028654
#define K_FRAC_1_SQRT_2 0.7071067811865476
#define K_FRAC_2_SQRT_PI 1.1283791670955126
#define K_GELU_C 0.044715

template <class A> __device__ __forceinline__ A sigmoid_(A v) { return (A)1 / ((A)1 + m_exp(-v)); }
template <class A> __device__ __forceinline__ A sign_(A v) { return v > (A)0 ? (A)1 : v < (A)0 ? (A)-1 : v; }
// ln(1 + e^x) without overflow.
template <class A> __device__ __forceinline__ A softplus_(A v) { return (v > (A)0 ? v : (A)0) + m_log1p(m_exp(-m_fabs(v))); }
template <class A> __device__ __forceinline__ A clamp01_(A v) { return v < (A)0 ? (A)0 : v > (A)1 ? (A)1 : v; }

// An op code without a case: stop the kernel (the launch fails) rather than compute a
// wrong value.
__device__ __forceinline__ void bad_op() { __trap(); }

template <class A> __device__ __forceinline__ A act_fwd(int op, A v, A alpha, A beta) {
    switch (op) {
    case OP_NONE: return v;
    case OP_RELU: return v < (A)0 ? (A)0 : v;
    case OP_GELU: return (A)0.5 * v * ((A)1 + m_erf(v * (A)K_FRAC_1_SQRT_2));
    case OP_GELU_TANH:
        return (A)0.5 * v * ((A)1 + m_tanh((A)K_SQRT_2_OVER_PI * (v + (A)K_GELU_C * v * v * v)));
    case OP_SILU: return v / ((A)1 + m_exp(-v));
    case OP_RELU6: return v < (A)0 ? (A)0 : v > (A)6 ? (A)6 : v;
    case OP_SIGMOID: return sigmoid_(v);
    case OP_TANH: return m_tanh(v);
    case OP_NEG: return -v;
    case OP_EXP: return m_exp(v);
    case OP_LOG: return m_log(v);
    case OP_SQRT: return m_sqrt(v);
    case OP_RECIPROCAL: return (A)1 / v;
    case OP_ABS: return v < (A)0 ? -v : v;
    case OP_ERF: return m_erf(v);
    case OP_LEAKY_RELU: return v >= (A)0 ? v : alpha * v;
    case OP_SIGN: return sign_(v);
    case OP_FLOOR: return m_floor(v);
    case OP_CEIL: return m_ceil(v);
    case OP_ROUND: return m_rint(v);
    case OP_SIN: return m_sin(v);
    case OP_COS: return m_cos(v);
    case OP_TAN: return m_tan(v);
    case OP_ASIN: return m_asin(v);
    case OP_ACOS: return m_acos(v);
    case OP_ATAN: return m_atan(v);
    case OP_SINH: return m_sinh(v);
    case OP_COSH: return m_cosh(v);
    case OP_ASINH: return m_asinh(v);
    case OP_ACOSH: return m_acosh(v);
    case OP_ATANH: return m_atanh(v);
    case OP_SOFTPLUS: return softplus_(v);
    case OP_SOFTSIGN: return v / ((A)1 + m_fabs(v));
    case OP_ELU: return v < (A)0 ? alpha * (m_exp(v) - (A)1) : v;
    case OP_SELU: return v > (A)0 ? beta * v : beta * alpha * (m_exp(v) - (A)1);
    case OP_CELU: return v > (A)0 ? v : alpha * (m_exp(v / alpha) - (A)1);
    case OP_HARD_SIGMOID: return clamp01_(alpha * v + beta);
    case OP_HARD_SWISH: return v * clamp01_(v / (A)6 + (A)0.5);
    case OP_MISH: return v * m_tanh(softplus_(v));
    case OP_THRESHOLDED_RELU: return v > alpha ? v : (A)0;
    case OP_SWISH: return v * sigmoid_(alpha * v);
    default: bad_op(); return v;
    }
}

// dy · f'(x).
template <class A> __device__ __forceinline__ A act_bwd(int op, A g, A v, A alpha, A beta) {
    switch (op) {
    case OP_NONE: return g;
    case OP_RELU: return v > (A)0 ? g : (A)0;
    case OP_GELU: {
        A cdf = (A)0.5 * ((A)1 + m_erf(v * (A)K_FRAC_1_SQRT_2));
        A pdf = (A)(0.5 * K_FRAC_2_SQRT_PI * K_FRAC_1_SQRT_2) * m_exp((A)-0.5 * v * v);
        return g * (cdf + v * pdf);
    }
    case OP_GELU_TANH: {
        A k = (A)K_SQRT_2_OVER_PI, x2 = v * v;
        A t = m_tanh(k * (v + (A)K_GELU_C * x2 * v));
        A du = k * ((A)1 + (A)(3.0 * K_GELU_C) * x2);
        A h = (A)0.5;
        return g * (h * ((A)1 + t) + h * v * ((A)1 - t * t) * du);
    }
    case OP_SILU: { A s = sigmoid_(v); return g * s * ((A)1 + v * ((A)1 - s)); }
    case OP_RELU6: return v > (A)0 && v < (A)6 ? g : (A)0;
    case OP_SIGMOID: { A s = sigmoid_(v); return g * s * ((A)1 - s); }
    case OP_TANH: { A t = m_tanh(v); return g * ((A)1 - t * t); }
    case OP_NEG: return -g;
    case OP_EXP: return g * m_exp(v);
    case OP_LOG: return g / v;
    case OP_SQRT: return g * (A)0.5 / m_sqrt(v);
    case OP_RECIPROCAL: return -g / (v * v);
    case OP_ABS: return v > (A)0 ? g : (v < (A)0 ? -g : (A)0);
    case OP_ERF: return g * (A)K_FRAC_2_SQRT_PI * m_exp(-v * v);
    case OP_LEAKY_RELU: return v > (A)0 ? g : alpha * g;
    case OP_SIN: return g * m_cos(v);
    case OP_COS: return -g * m_sin(v);
    case OP_TAN: { A t = m_tan(v); return g * ((A)1 + t * t); }
    case OP_ASIN: return g / m_sqrt((A)1 - v * v);
    case OP_ACOS: return -g / m_sqrt((A)1 - v * v);
    case OP_ATAN: return g / ((A)1 + v * v);
    case OP_SINH: return g * m_cosh(v);
    case OP_COSH: return g * m_sinh(v);
    case OP_ASINH: return g / m_sqrt(v * v + (A)1);
    case OP_ACOSH: return g / m_sqrt(v * v - (A)1);
    case OP_ATANH: return g / ((A)1 - v * v);
    case OP_SOFTPLUS: return g * sigmoid_(v);
    case OP_SOFTSIGN: { A d = (A)1 + m_fabs(v); return g / (d * d); }
    case OP_ELU: return v > (A)0 ? g : g * alpha * m_exp(v);
    case OP_SELU: return v > (A)0 ? g * beta : g * beta * alpha * m_exp(v);
    case OP_CELU: return v > (A)0 ? g : g * m_exp(v / alpha);
    case OP_HARD_SIGMOID: { A u = alpha * v + beta; return (u > (A)0 && u < (A)1) ? g * alpha : (A)0; }
    case OP_HARD_SWISH: return v < (A)-3 ? (A)0 : v > (A)3 ? g : g * (v / (A)3 + (A)0.5);
    case OP_MISH: { A t = m_tanh(softplus_(v)); return g * (t + v * ((A)1 - t * t) * sigmoid_(v)); }
    case OP_THRESHOLDED_RELU: return v > alpha ? g : (A)0;
    case OP_SWISH: { A s = sigmoid_(alpha * v); return g * s * ((A)1 + alpha * v * ((A)1 - s)); }
    default: bad_op(); return g;
    }
}

template <class T> __device__ void unary_k(const T* x, T* y, i64 n, int op, float alpha, float beta) {
    typedef typename Num<T>::A A;
    GRID_STRIDE(i, n) y[i] = st<T>(act_fwd<A>(op, ld(x[i]), (A)alpha, (A)beta));
}

// Neg, Abs, Relu, Sign on integers (wrapping negation, as the CPU).
template <class T> __device__ void signop_k(const T* x, T* y, i64 n, int op) {
    GRID_STRIDE(i, n) {
        i64 v = ld(x[i]);
        i64 neg = (i64)(0ull - (u64)v);
        i64 r;
        switch (op) {
        case OP_NEG: r = neg; break;
        case OP_ABS: r = v < 0 ? neg : v; break;
        case OP_RELU: r = v < 0 ? 0 : v; break;
        case OP_SIGN: r = v < 0 ? -1 : v > 0 ? 1 : 0; break;
        default: bad_op(); r = v;
        }
        y[i] = st<T>(r);
    }
}

// dX = dY · f'(X) with dY and X broadcast to the output (operands 0 and 1 of `s`).
template <class T> __device__ void unary_grad_k(const T* dy, const T* x, T* dx, Strided s, i64 n, int op, float alpha, float beta) {
    typedef typename Num<T>::A A;
    GRID_STRIDE(i, n) dx[i] = st<T>(act_bwd<A>(op, ld(dy[offset_of(s, 0, i)]), ld(x[offset_of(s, 1, i)]), (A)alpha, (A)beta));
}

// Y = act(Pre) + residual (residual broadcast as operand 0 of `s`; null for none).
template <class T> __device__ void act_epilogue_k(const T* pre, const T* res, T* y, Strided s, i64 n, int op) {
    typedef typename Num<T>::A A;
    GRID_STRIDE(i, n) {
        A v = act_fwd<A>(op, ld(pre[i]), (A)0, (A)0);
        if (res) v += ld(res[offset_of(s, 0, i)]);
        y[i] = st<T>(v);
    }
}

// A channels-last convolution's result x `[batch, P, C]` back in channels-first order with
// FusedConv's epilogue: s = x[b][p][c] + bias[c] + res[b][c][p], pre[b][c][p] = s and
// y[b][c][p] = act(s) (bias, res and pre may be null). One pass instead of a transpose,
// then a bias, a residual and an activation pass; tiles and grid as `transpose_k`
// (shape.cu).
template <class T> __device__ void conv_out_k(const T* x, const T* bias, const T* res, T* pre, T* y, i64 rows, i64 cols, int op) {
    typedef typename Num<T>::A A;
    __shared__ A tile[32][33];
    const i64 b = blockIdx.z, r0 = (i64)blockIdx.y * 32, c0 = (i64)blockIdx.x * 32;
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    const i64 at = b * rows * cols;
    for (int i = ty; i < 32; i += 8) {
        i64 r = r0 + i, c = c0 + tx;
        if (r < rows && c < cols) tile[i][tx] = ld(x[at + r * cols + c]) + (bias ? ld(bias[c]) : (A)0);
    }
    __syncthreads();
    for (int i = ty; i < 32; i += 8) {
        i64 c = c0 + i, r = r0 + tx;
        if (r < rows && c < cols) {
            i64 o = at + c * rows + r;
            A v = tile[tx][i];
            if (res) v += ld(res[o]);
            if (pre) pre[o] = st<T>(v);
            y[o] = st<T>(act_fwd<A>(op, v, (A)0, (A)0));
        }
    }
}

// The two maps above 16 bytes a thread, where every operand is contiguous with the output
// (the residual may be null) and `nv` vectors cover it; the host checks alignment.
template <class T> union EVec { uint4 u; T t[16 / sizeof(T)]; };
template <class T> __device__ void unary_grad_vec_k(const T* dy, const T* x, T* dx, i64 nv, int op, float alpha, float beta) {
    typedef typename Num<T>::A A;
    constexpr int V = 16 / sizeof(T);
    GRID_STRIDE(i, nv) {
        EVec<T> d, v, o;
        d.u = ((const uint4*)dy)[i];
        v.u = ((const uint4*)x)[i];
#pragma unroll
        for (int k = 0; k < V; ++k) o.t[k] = st<T>(act_bwd<A>(op, ld(d.t[k]), ld(v.t[k]), (A)alpha, (A)beta));
        ((uint4*)dx)[i] = o.u;
    }
}
// A channels-last convolution's result x `[rows, cols]` (cols the channels) with FusedConv's
// epilogue: s = x + bias[c] + res, pre = s, y = act(s) (bias, res and pre may be null; x
// may be pre or y itself). With `vec`, 16 bytes a thread (cols a multiple of the vector
// and every pointer aligned: the host checks).
template <class T> __device__ void conv_last_out_k(const T* x, const T* bias, const T* res, T* pre, T* y, i64 n, i64 cols, int op, int vec) {
    typedef typename Num<T>::A A;
    constexpr int V = 16 / sizeof(T);
    if (vec) {
        GRID_STRIDE(i, n / V) {
            EVec<T> a, b, r, p, o;
            a.u = ((const uint4*)x)[i];
            if (bias) b.u = *(const uint4*)(bias + (i * V) % cols);
            if (res) r.u = ((const uint4*)res)[i];
#pragma unroll
            for (int k = 0; k < V; ++k) {
                A v = ld(a.t[k]);
                if (bias) v += ld(b.t[k]);
                if (res) v += ld(r.t[k]);
                p.t[k] = st<T>(v);
                o.t[k] = st<T>(act_fwd<A>(op, v, (A)0, (A)0));
            }
            if (pre) ((uint4*)pre)[i] = p.u;
            ((uint4*)y)[i] = o.u;
        }
        return;
    }
    GRID_STRIDE(i, n) {
        A v = ld(x[i]);
        if (bias) v += ld(bias[i % cols]);
        if (res) v += ld(res[i]);
        if (pre) pre[i] = st<T>(v);
        y[i] = st<T>(act_fwd<A>(op, v, (A)0, (A)0));
    }
}
template <class T> __device__ void act_epilogue_vec_k(const T* pre, const T* res, T* y, i64 nv, int op) {
    typedef typename Num<T>::A A;
    constexpr int V = 16 / sizeof(T);
    GRID_STRIDE(i, nv) {
        EVec<T> p, r, o;
        p.u = ((const uint4*)pre)[i];
        if (res) r.u = ((const uint4*)res)[i];
#pragma unroll
        for (int k = 0; k < V; ++k) {
            A v = act_fwd<A>(op, ld(p.t[k]), (A)0, (A)0);
            if (res) v += ld(r.t[k]);
            o.t[k] = st<T>(v);
        }
        ((uint4*)y)[i] = o.u;
    }
}

// GatedMatMul's gate, Y = act(G)·U, and its gradient GatedMatMulGrad, dU = dY·act(G) and
// dG = dY·U·act'(G): every operand contiguous, of one shape; `nv` 16-byte vectors where
// the host found every pointer aligned, else `n` elements one a thread (`vec` 0).
template <class T> __device__ void glu_k(const T* g, const T* u, T* y, i64 n, int op, int vec) {
    typedef typename Num<T>::A A;
    constexpr int V = 16 / sizeof(T);
    if (vec) {
        GRID_STRIDE(i, n) {
            EVec<T> gv, uv, o;
            gv.u = ((const uint4*)g)[i];
            uv.u = ((const uint4*)u)[i];
#pragma unroll
            for (int k = 0; k < V; ++k) o.t[k] = st<T>(act_fwd<A>(op, ld(gv.t[k]), (A)0, (A)0) * ld(uv.t[k]));
            ((uint4*)y)[i] = o.u;
        }
    } else {
        GRID_STRIDE(i, n) y[i] = st<T>(act_fwd<A>(op, ld(g[i]), (A)0, (A)0) * ld(u[i]));
    }
}
template <class A> __device__ __forceinline__ void glu_grad_one(int op, A d, A g, A u, A& dg, A& du) {
    du = d * act_fwd<A>(op, g, (A)0, (A)0);
    dg = act_bwd<A>(op, d * u, g, (A)0, (A)0);
}
template <class T> __device__ void glu_grad_k(const T* dy, const T* g, const T* u, T* dg, T* du, i64 n, int op, int vec) {
    typedef typename Num<T>::A A;
    constexpr int V = 16 / sizeof(T);
    if (vec) {
        GRID_STRIDE(i, n) {
            EVec<T> dv, gv, uv, og, ou;
            dv.u = ((const uint4*)dy)[i];
            gv.u = ((const uint4*)g)[i];
            uv.u = ((const uint4*)u)[i];
#pragma unroll
            for (int k = 0; k < V; ++k) {
                A a, b;
                glu_grad_one<A>(op, ld(dv.t[k]), ld(gv.t[k]), ld(uv.t[k]), a, b);
                og.t[k] = st<T>(a);
                ou.t[k] = st<T>(b);
            }
            ((uint4*)dg)[i] = og.u;
            ((uint4*)du)[i] = ou.u;
        }
    } else {
        GRID_STRIDE(i, n) {
            A a, b;
            glu_grad_one<A>(op, ld(dy[i]), ld(g[i]), ld(u[i]), a, b);
            dg[i] = st<T>(a);
            du[i] = st<T>(b);
        }
    }
}

// BIN_* and CMP_* come from cuda/opcodes.cuh. Mod takes the divisor's sign (Python's %),
// Fmod the dividend's (C's fmod); Min and Max propagate NaN, as numpy's.
template <class A> __device__ __forceinline__ A nan_min(A a, A b) { return (b < a || b != b) ? b : a; }
template <class A> __device__ __forceinline__ A arith(int op, A a, A b) {
    switch (op) {
    case BIN_ADD: return a + b;
    case BIN_SUB: return a - b;
    case BIN_MUL: return a * b;
    case BIN_DIV: return a / b;
    case BIN_FMOD: return m_fmod(a, b);
    case BIN_MOD: { A r = m_fmod(a, b); return (r != (A)0 && ((r < (A)0) != (b < (A)0))) ? r + b : r; }
    case BIN_MIN: return nan_min(a, b);
    case BIN_MAX: return nan_max(a, b);
    case BIN_PRELU: return a < (A)0 ? b * a : a;
    default: bad_op(); return a;
    }
}
// The bitwise maps and the integer power of the integer specializations (floats have
// none: the host refuses bitwise maps on them and runs their powers in `pow_k`). Narrow values arrive widened (sign- or zero-extended) and the store keeps the
// low bits; a shift by 64 or more shifts every bit out.
#define BITWISE_CASES(a, b)                                                        \
    case BIN_BITWISE_AND: return a & b;                                            \
    case BIN_BITWISE_OR: return a | b;                                             \
    case BIN_BITWISE_XOR: return a ^ b;                                            \
    case BIN_BIT_SHIFT_LEFT: return (u64)b >= 64 ? 0 : (decltype(a))((u64)a << b); \
    case BIN_BIT_SHIFT_RIGHT: return (u64)b >= 64 ? 0 : a >> b;                     \
    case BIN_POW: { /* the exact wrapping power (the host rules out e < 0) */          \
        u64 r = 1, x = (u64)a;                                                     \
        for (u64 e = (u64)b; e; e >>= 1) { if (e & 1) r *= x; x *= x; }           \
        return (decltype(a))r;                                                     \
    }
// Integers wrap on overflow, as numpy (signed overflow is undefined in C: go unsigned).
// The host rules out zero divisors.
template <> __device__ __forceinline__ i64 arith<i64>(int op, i64 a, i64 b) {
    const bool wraps = a == (i64)0x8000000000000000ll && b == -1;
    switch (op) {
    case BIN_ADD: return (i64)((u64)a + (u64)b);
    case BIN_SUB: return (i64)((u64)a - (u64)b);
    case BIN_MUL: return (i64)((u64)a * (u64)b);
    case BIN_DIV: return wraps ? a : a / b;
    case BIN_FMOD: return wraps ? 0 : a % b;
    case BIN_MOD: { i64 r = wraps ? 0 : a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
    case BIN_MIN: return a < b ? a : b;
    case BIN_MAX: return a > b ? a : b;
    case BIN_PRELU: return a < 0 ? (i64)((u64)a * (u64)b) : a;
    BITWISE_CASES(a, b)
    default: bad_op(); return a;
    }
}

template <> __device__ __forceinline__ u64 arith<u64>(int op, u64 a, u64 b) {
    switch (op) {
    case BIN_ADD: return a + b;
    case BIN_SUB: return a - b;
    case BIN_MUL: return a * b;
    case BIN_DIV: return a / b;
    case BIN_FMOD:
    case BIN_MOD: return a % b;
    case BIN_MIN: return a < b ? a : b;
    case BIN_MAX: return a > b ? a : b;
    case BIN_PRELU: return a;
    BITWISE_CASES(a, b)
    default: bad_op(); return a;
    }
}

template <class T> __device__ void binary_k(const T* a, const T* b, T* out, Strided s, i64 n, int op) {
    typedef typename Num<T>::A A;
    GRID_STRIDE(i, n) out[i] = st<T>(arith<A>(op, ld(a[offset_of(s, 0, i)]), ld(b[offset_of(s, 1, i)])));
}

// The same map when both operands are contiguous with the output (or one is a scalar),
// 16 bytes a thread: the common case (residual adds, a loss's difference) without the
// index walk and with full-width loads. The host launches it only where every pointer is
// 16-byte aligned and `nv` vectors cover the output exactly; `sa`/`sb` are 0 for a scalar.
template <class T> __device__ void binary_vec_k(const T* a, const T* b, T* out, i64 nv, int op, int sa, int sb) {
    typedef typename Num<T>::A A;
    constexpr int V = 16 / sizeof(T);
    union Vec { uint4 u; T t[V]; };
    GRID_STRIDE(i, nv) {
        Vec x, y, z;
        if (sa) x.u = ((const uint4*)a)[i]; else for (int k = 0; k < V; ++k) x.t[k] = a[0];
        if (sb) y.u = ((const uint4*)b)[i]; else for (int k = 0; k < V; ++k) y.t[k] = b[0];
#pragma unroll
        for (int k = 0; k < V; ++k) z.t[k] = st<T>(arith<A>(op, ld(x.t[k]), ld(y.t[k])));
        ((uint4*)out)[i] = z.u;
    }
}

// Comparisons, and And/Or/Xor on bools (only bool operands reach those).
template <class T> __device__ void compare_k(const T* a, const T* b, unsigned char* out, Strided s, i64 n, int op) {
    GRID_STRIDE(i, n) {
        auto x = ld(a[offset_of(s, 0, i)]);
        auto y = ld(b[offset_of(s, 1, i)]);
        bool r;
        switch (op) {
        case CMP_EQUAL: r = x == y; break;
        case CMP_LESS: r = x < y; break;
        case CMP_GREATER: r = x > y; break;
        case CMP_LESS_OR_EQUAL: r = x <= y; break;
        case CMP_GREATER_OR_EQUAL: r = x >= y; break;
        case CMP_AND: r = (x != 0) && (y != 0); break;
        case CMP_OR: r = (x != 0) || (y != 0); break;
        case CMP_XOR: r = (x != 0) != (y != 0); break;
        default: bad_op(); r = false;
        }
        out[i] = r;
    }
}

// Pow with the exponent already in the base's accumulation type (the host casts it).
template <class A> __device__ __forceinline__ A pow_(A a, A e) { return m_pow(a, e); }
// Integer base, non-negative integer exponent (checked by the host): exact, wrapping.
template <> __device__ __forceinline__ i64 pow_<i64>(i64 a, i64 e) {
    u64 r = 1, b = (u64)a;
    while (e > 0) {
        if (e & 1) r *= b;
        b *= b;
        e >>= 1;
    }
    return (i64)r;
}
template <> __device__ __forceinline__ u64 pow_<u64>(u64 a, u64 e) { return (u64)pow_<i64>((i64)a, (i64)e); }
template <class T> __device__ void pow_k(const T* a, const typename Num<T>::A* e, T* out, Strided s, i64 n) {
    GRID_STRIDE(i, n) out[i] = st<T>(pow_(ld(a[offset_of(s, 0, i)]), e[offset_of(s, 1, i)]));
}

// A float base to an exponent of any numeric dtype (`E`), cast as the CPU does: through f64
// to the base's accumulation type.
template <class T, class E> __device__ void pow_x_k(const T* a, const E* e, T* out, Strided s, i64 n) {
    typedef typename Num<T>::A A;
    GRID_STRIDE(i, n) out[i] = st<T>(m_pow(ld(a[offset_of(s, 0, i)]), (A)to_f64(e[offset_of(s, 1, i)])));
}

// An integer base to a float exponent, as the CPU: a non-negative integral exponent is an
// exact wrapping integer power, any other `(a as f64).powf(e)` truncated (saturating).
// CUDA's pow is not correctly rounded (pow(9, 0.5) can come out as 2.9999999999999996,
// which truncates to 2), so a result within 4 ulps of an integer is that integer.
template <class B, class E> __device__ void pow_if_k(const B* a, const E* e, B* out, Strided s, i64 n) {
    GRID_STRIDE(i, n) {
        i64 x = ld(a[offset_of(s, 0, i)]);
        double p = to_f64(e[offset_of(s, 1, i)]);
        if (p >= 0.0 && p == floor(p)) {
            out[i] = st<B>(pow_<i64>(x, p > 4294967295.0 ? (i64)4294967295ll : (i64)p));
        } else {
            double r = pow((double)x, p), rr = rint(r);
            if (fabs(r - rr) <= 4.0 * 2.220446049250313e-16 * fabs(rr)) r = rr;
            out[i] = cast_from_f64<B>(r);
        }
    }
}

// Min first, then max: with min > max every value becomes max, as ONNX says.
template <class T> __device__ void clip_k(const T* x, const T* lo, const T* hi, T* y, i64 n) {
    GRID_STRIDE(i, n) {
        auto v = ld(x[i]);
        if (lo && v < ld(lo[0])) v = ld(lo[0]);
        if (hi && v > ld(hi[0])) v = ld(hi[0]);
        y[i] = st<T>(v);
    }
}

template <class W> __device__ void where_k(const unsigned char* c, const W* a, const W* b, W* out, Strided s, i64 n) {
    GRID_STRIDE(i, n) out[i] = c[offset_of(s, 0, i)] ? a[offset_of(s, 1, i)] : b[offset_of(s, 2, i)];
}

// Rotary, one thread per pair (a, b) of x's last axis (of size d): the two halves' j and
// j + d/2, or elements 2k and 2k + 1 when interleaved. y_a = a·c_a − b·s_a and
// y_b = b·c_b + a·s_b; `transposed` (the gradient dx = dy·c − rot(dy·s)) reads each sin
// at the partner: y_a = a·c_a + b·s_b, y_b = b·c_b − a·s_a. c and s are broadcast to y
// through `sd` (operands 1 and 2); the walk's last dim covers whole rows of d, so a row's
// offsets are its first element's plus the inner stride.
template <class T> __device__ void rotary_k(const T* x, const T* c, const T* s, T* y, Strided sd, i64 pairs, i64 d, int interleaved, int transposed) {
    typedef typename Num<T>::A A;
    i64 h = d / 2;
    i64 cs = sd.rank > 0 ? sd.st[1][sd.rank - 1] : 0, ss = sd.rank > 0 ? sd.st[2][sd.rank - 1] : 0;
    GRID_STRIDE(q, pairs) {
        // 64-bit division is emulated: 32 bits where the pairs fit.
        i64 row = sd.small ? (i64)((unsigned)q / (unsigned)h) : q / h, k = q - row * h;
        i64 ja = interleaved ? 2 * k : k, jb = interleaved ? 2 * k + 1 : k + h;
        i64 r0 = row * d, ia = r0 + ja, ib = r0 + jb;
        i64 c0 = offset_of(sd, 1, r0), s0 = offset_of(sd, 2, r0);
        A a = ld(x[ia]), b = ld(x[ib]);
        A ca = ld(c[c0 + ja * cs]), cb = ld(c[c0 + jb * cs]);
        A sa = ld(s[s0 + ja * ss]), sb = ld(s[s0 + jb * ss]);
        if (transposed) {
            y[ia] = st<T>(a * ca + b * sb);
            y[ib] = st<T>(b * cb - a * sa);
        } else {
            y[ia] = st<T>(a * ca - b * sa);
            y[ib] = st<T>(b * cb + a * sb);
        }
    }
}

// Rotary over the halves, four pairs a thread (a row's k..k+3 and k+h..k+h+3), x and y
// read and written as vectors of four: for rows whose half is a multiple of 4, with x and
// y aligned (the host checks). Same formulas as rotary_k.
template <class T> struct alignas(4 * sizeof(T)) Four { T v[4]; };
template <class T> __device__ void rotary_vec_k(const T* x, const T* c, const T* s, T* y, Strided sd, i64 groups, i64 d, int transposed) {
    typedef typename Num<T>::A A;
    i64 h = d / 2, hg = h / 4;
    i64 cs = sd.rank > 0 ? sd.st[1][sd.rank - 1] : 0, ss = sd.rank > 0 ? sd.st[2][sd.rank - 1] : 0;
    GRID_STRIDE(g, groups) {
        i64 row = sd.small ? (i64)((unsigned)g / (unsigned)hg) : g / hg, k = (g - row * hg) * 4;
        i64 r0 = row * d, ia = r0 + k, ib = ia + h;
        i64 c0 = offset_of(sd, 1, r0), s0 = offset_of(sd, 2, r0);
        Four<T> xa = *(const Four<T>*)(x + ia), xb = *(const Four<T>*)(x + ib), ya, yb;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            i64 ja = k + e, jb = k + h + e;
            A a = ld(xa.v[e]), b = ld(xb.v[e]);
            A ca = ld(c[c0 + ja * cs]), cb = ld(c[c0 + jb * cs]);
            A sa = ld(s[s0 + ja * ss]), sb = ld(s[s0 + jb * ss]);
            ya.v[e] = st<T>(transposed ? a * ca + b * sb : a * ca - b * sa);
            yb.v[e] = st<T>(transposed ? b * cb - a * sa : b * cb + a * sb);
        }
        *(Four<T>*)(y + ia) = ya;
        *(Four<T>*)(y + ib) = yb;
    }
}

// Keeps the upper (j - i >= k) or lower (j - i <= k) triangle of every trailing matrix.
template <class W> __device__ void trilu_k(const W* x, W* y, i64 n, i64 rows, i64 cols, i64 k, int upper) {
    GRID_STRIDE(i, n) {
        i64 j = i % cols, r = (i / cols) % rows, d = j - r;
        y[i] = ((upper && d >= k) || (!upper && d <= k)) ? x[i] : (W)0;
    }
}

// SplitMix64, bit for bit the CPU's (src/rng.rs): the top `bits` bits of
// Rng::new(seed).next_u64() as a number in [0, 1). Dropout's element i keeps iff
// unit(base + i, 53) >= ratio, so CPU and CUDA masks are identical.
__device__ __forceinline__ double splitmix_unit(u64 seed, int bits) {
    u64 z = (seed ^ 0x9E3779B97F4A7C15ull) + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> (64 - bits)) / (double)(1ull << bits);
}
// The mask's base seed of training step *stepp (0: `base0` itself), as the CPU:
// Rng::new(base0 ^ t·φ).next_u64().
__device__ __forceinline__ u64 step_seed(u64 base0, const u64* stepp) {
    u64 t = *stepp;
    if (t == 0) return base0;
    u64 z = ((base0 ^ (t * 0x9E3779B97F4A7C15ull)) ^ 0x9E3779B97F4A7C15ull) + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
template <class T> __device__ void dropout_k(const T* x, T* y, unsigned char* mask, i64 n, u64 base0, const u64* stepp, double ratio, double scale) {
    typedef typename Num<T>::A A;
    u64 base = step_seed(base0, stepp);
    GRID_STRIDE(i, n) {
        bool keep = splitmix_unit(base + (u64)i, 53) >= ratio;
        y[i] = st<T>(keep ? ld(x[i]) * (A)scale : (A)0);
        if (mask) mask[i] = keep;
    }
}

// RandomUniform / RandomNormal, as src/backends/common.rs `random_value`: uniform in
// [a, b) from counter base + i, or Box–Muller from counters base + 2i and base + 2i + 1.
template <class T> __device__ void random_k(T* y, i64 n, u64 base0, const u64* stepp, int normal, double a, double b, int bits) {
    typedef typename Num<T>::A A;
    u64 base = step_seed(base0, stepp);
    GRID_STRIDE(i, n) {
        double v;
        if (normal) {
            const u64 c = base + 2 * (u64)i;
            const double u1 = 1.0 - splitmix_unit(c, bits), u2 = splitmix_unit(c + 1, bits);
            v = a + b * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
        } else {
            v = a + (b - a) * splitmix_unit(base + (u64)i, bits);
        }
        y[i] = st<T>((A)v);
    }
}

// Range: start + i·delta in the accumulation type (integers wrap, as the CPU's).
template <class T> __device__ void range_k(const T* start, const T* delta, T* y, i64 n) {
    typedef typename Num<T>::A A;
    const A s = ld(start[0]), d = ld(delta[0]);
    GRID_STRIDE(i, n) y[i] = st<T>(arith<A>(BIN_ADD, s, arith<A>(BIN_MUL, (A)i, d)));
}

// CumSum (CumProd with `prod`): a thread a (outer, inner) line, summing (multiplying)
// along the axis in the accumulation type.
template <class T> __device__ void cumulative_k(const T* x, T* y, i64 outer, i64 d, i64 inner, int excl, int rev, int prod) {
    typedef typename Num<T>::A A;
    const int op = prod ? BIN_MUL : BIN_ADD;
    GRID_STRIDE(line, outer * inner) {
        const i64 base = (line / inner) * d * inner + line % inner;
        A acc = prod ? (A)1 : (A)0;
        for (i64 s = 0; s < d; ++s) {
            const i64 at = base + (rev ? d - 1 - s : s) * inner;
            const A v = ld(x[at]);
            if (!excl) acc = arith<A>(op, acc, v);
            y[at] = st<T>(acc);
            if (excl) acc = arith<A>(op, acc, v);
        }
    }
}

template <class S, class D> __device__ void cast_k(const S* x, D* y, i64 n) {
    GRID_STRIDE(i, n) y[i] = cast_val<S, D>(x[i]);
}

// The narrow storage types (src/tensor/narrow.rs), a byte an element. Formats 0-4 are
// the minifloats E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ, E2M1; 5-8 the integers I4, U4, I2,
// U2 (stored sign- or zero-extended); 9 the power-of-two scale E8M0.
struct Minifloat { int e, m, bias, special; };  // special: 0 IEEE, 1 FN, 2 FNUZ, 3 finite
__device__ __forceinline__ Minifloat minifloat(int fmt) {
    switch (fmt) {
        case 0: return {4, 3, 7, 1};
        case 1: return {4, 3, 8, 2};
        case 2: return {5, 2, 15, 0};
        case 3: return {5, 2, 16, 2};
        default: return {2, 1, 1, 3};
    }
}
__device__ double mf_decode(int fmt, unsigned c) {
    const Minifloat f = minifloat(fmt);
    const unsigned sb = 1u << (f.e + f.m), mag = c & (sb - 1u);
    const unsigned ex = mag >> f.m, man = mag & ((1u << f.m) - 1u);
    const bool neg = (c & sb) != 0;
    if ((f.special == 2 && c == 0x80u) || (f.special == 1 && mag == sb - 1u)) return __longlong_as_double(0x7ff8000000000000ll);
    if (f.special == 0 && ex == (1u << f.e) - 1u)
        return __longlong_as_double(man ? 0x7ff8000000000000ll : neg ? 0xfff0000000000000ll : 0x7ff0000000000000ll);
    // Subnormals (exponent field 0) share the smallest normal binade's quantum.
    const unsigned units = ex ? man | (1u << f.m) : man;
    const double v = ldexp((double)units, (int)(ex ? ex : 1u) - f.bias - f.m);
    return neg ? -v : v;
}
// v rounded to nearest even, saturating to the largest finite value (Cast's default; the
// importer writes `saturate` 0 around it); NaN as ml_dtypes writes it.
__device__ unsigned mf_encode(int fmt, double v) {
    const Minifloat f = minifloat(fmt);
    const unsigned sb = 1u << (f.e + f.m), top = (1u << f.e) - 1u, full = (1u << f.m) - 1u;
    const bool neg = __double_as_longlong(v) < 0;
    const unsigned sign = neg ? sb : 0u;
    if (v != v) {
        switch (f.special) {
            case 0: return sign | (top << f.m) | (1u << (f.m - 1));
            case 1: return sign | (sb - 1u);
            case 2: return 0x80u;
            default: return sb - sign;
        }
    }
    const unsigned max_code = f.special == 0 ? ((top - 1u) << f.m) | full
                              : f.special == 1 ? (top << f.m) | (full - 1u)
                                               : (top << f.m) | full;
    const double a = fabs(v);
    const int a_exp = (int)((__double_as_longlong(a) >> 52) & 0x7ff);
    if (a_exp == 0x7ff) return sign | max_code;
    // a in units of its binade's quantum (no finer than the subnormals'), rounded: the
    // code is the binade's offset from the smallest plus those units, a carry included.
    const int emin = 1 - f.bias;
    // f64 subnormals lie far below every format's quantum.
    const int e = max(a_exp - 1023, emin);
    const double units = rint(ldexp(a, f.m - e));
    if (units > 4096.0) return sign | max_code;  // far past every format's range
    const unsigned code = ((unsigned)(e - emin) << f.m) + (unsigned)units;
    if (code > max_code) return sign | max_code;
    if (code == 0u && f.special == 2) return 0u;
    return sign | code;
}
// E8M0: code c is 2^(c - 127), 0xff NaN. From v rounded to f32 (as ONNX's reference): its
// exponent bits, one higher where a mantissa bit is set (round_mode "up"), staying at
// 2^127 (saturate); infinity and NaN are 0xff.
__device__ __forceinline__ double e8m0_decode(unsigned c) {
    return c == 0xffu ? __longlong_as_double(0x7ff8000000000000ll) : ldexp(1.0, (int)c - 127);
}
__device__ __forceinline__ unsigned e8m0_encode(double v) {
    const unsigned b = __float_as_uint((float)v), e = (b >> 23) & 0xffu;
    if (e == 0xffu) return 0xffu;
    return (b & 0x7fffffu) && e != 0xfeu ? e + 1u : e;
}
// An integer wrapped to a narrow integer format's bits (sign-extended when signed).
__device__ __forceinline__ unsigned char narrow_wrap(int fmt, i64 v) {
    const int bits = fmt <= 6 ? 4 : 2;
    const i64 low = v & ((1ll << bits) - 1);
    const bool sext = (fmt == 5 || fmt == 7) && (low >> (bits - 1));
    return (unsigned char)(sext ? low - (1ll << bits) : low);
}
// Cast to or from a narrow type: the other side is T, or also narrow (`sfmt`/`dfmt` the
// narrow format of the source/destination, -1 for T). As the CPU's `cast_into`: between
// integers exactly and wrapping, otherwise through f64; a float to a narrow integer
// truncates, saturates to i64 and wraps.
template <class T> __device__ void narrow_cast_k(const void* xv, void* yv, i64 n, int sfmt, int dfmt) {
    GRID_STRIDE(i, n) {
        bool is_int;
        i64 iv = 0;
        double fv;
        if (sfmt < 0) {
            const T x = ((const T*)xv)[i];
            is_int = IsInt<T>::v;
            if (is_int) iv = (i64)ld(x);
            fv = to_f64(x);
        } else {
            const unsigned char c = ((const unsigned char*)xv)[i];
            is_int = sfmt >= 5 && sfmt <= 8;
            if (is_int) {
                iv = (sfmt == 5 || sfmt == 7) ? (i64)(signed char)c : (i64)c;
                fv = (double)iv;
            } else {
                fv = sfmt == 9 ? e8m0_decode(c) : mf_decode(sfmt, c);
            }
        }
        if (dfmt < 0) {
            ((T*)yv)[i] = (is_int && IsInt<T>::v) ? Num<T>::store((typename Num<T>::A)iv) : cast_from_f64<T>(fv);
        } else if (dfmt == 9) {
            ((unsigned char*)yv)[i] = (unsigned char)e8m0_encode(fv);
        } else if (dfmt >= 5) {
            ((unsigned char*)yv)[i] = narrow_wrap(dfmt, is_int ? iv : cast_from_f64<i64>(trunc(fv)));
        } else {
            ((unsigned char*)yv)[i] = (unsigned char)mf_encode(dfmt, fv);
        }
    }
}

#define INST_FLOAT(T, S)                                                                          \
    extern "C" __global__ void unary_##S(const T* x, T* y, i64 n, int op, float alpha, float beta) { unary_k<T>(x, y, n, op, alpha, beta); } \
    extern "C" __global__ void unary_grad_##S(const T* dy, const T* x, T* dx, Strided s, i64 n, int op, float alpha, float beta) { unary_grad_k<T>(dy, x, dx, s, n, op, alpha, beta); } \
    extern "C" __global__ void act_epilogue_##S(const T* p, const T* r, T* y, Strided s, i64 n, int op) { act_epilogue_k<T>(p, r, y, s, n, op); } \
    extern "C" __global__ void unary_grad_vec_##S(const T* dy, const T* x, T* dx, i64 nv, int op, float alpha, float beta) { unary_grad_vec_k<T>(dy, x, dx, nv, op, alpha, beta); } \
    extern "C" __global__ void conv_out_##S(const T* x, const T* b, const T* r, T* p, T* y, i64 rows, i64 cols, int op) { conv_out_k<T>(x, b, r, p, y, rows, cols, op); } \
    extern "C" __global__ void act_epilogue_vec_##S(const T* p, const T* r, T* y, i64 nv, int op) { act_epilogue_vec_k<T>(p, r, y, nv, op); } \
    extern "C" __global__ void conv_last_out_##S(const T* x, const T* b, const T* r, T* p, T* y, i64 n, i64 cols, int op, int vec) { conv_last_out_k<T>(x, b, r, p, y, n, cols, op, vec); } \
    extern "C" __global__ void glu_##S(const T* g, const T* u, T* y, i64 n, int op, int vec) { glu_k<T>(g, u, y, n, op, vec); } \
    extern "C" __global__ void glu_grad_##S(const T* dy, const T* g, const T* u, T* dg, T* du, i64 n, int op, int vec) { glu_grad_k<T>(dy, g, u, dg, du, n, op, vec); } \
    extern "C" __global__ void dropout_##S(const T* x, T* y, unsigned char* m, i64 n, u64 base, const u64* stepp, double ratio, double scale) { dropout_k<T>(x, y, m, n, base, stepp, ratio, scale); } \
    extern "C" __global__ void random_##S(T* y, i64 n, u64 base, const u64* stepp, int normal, double a, double b, int bits) { random_k<T>(y, n, base, stepp, normal, a, b, bits); } \
    extern "C" __global__ void rotary_##S(const T* x, const T* c, const T* s, T* y, Strided sd, i64 pairs, i64 d, int il, int tr) { rotary_k<T>(x, c, s, y, sd, pairs, d, il, tr); } \
    extern "C" __global__ void rotary_vec_##S(const T* x, const T* c, const T* s, T* y, Strided sd, i64 groups, i64 d, int tr) { rotary_vec_k<T>(x, c, s, y, sd, groups, d, tr); }
FOR_FLOATS(INST_FLOAT)

#define INST_INT(T, S) \
    extern "C" __global__ void signop_##S(const T* x, T* y, i64 n, int op) { signop_k<T>(x, y, n, op); }
FOR_INTS(INST_INT)

#define INST_NUM(T, S)                                                                            \
    extern "C" __global__ void binary_##S(const T* a, const T* b, T* o, Strided s, i64 n, int op) { binary_k<T>(a, b, o, s, n, op); } \
    extern "C" __global__ void binary_vec_##S(const T* a, const T* b, T* o, i64 nv, int op, int sa, int sb) { binary_vec_k<T>(a, b, o, nv, op, sa, sb); } \
    extern "C" __global__ void pow_##S(const T* a, const Num<T>::A* e, T* o, Strided s, i64 n) { pow_k<T>(a, e, o, s, n); } \
    extern "C" __global__ void clip_##S(const T* x, const T* lo, const T* hi, T* y, i64 n) { clip_k<T>(x, lo, hi, y, n); } \
    extern "C" __global__ void range_##S(const T* s, const T* d, T* y, i64 n) { range_k<T>(s, d, y, n); } \
    extern "C" __global__ void cumulative_##S(const T* x, T* y, i64 outer, i64 d, i64 inner, int excl, int rev, int prod) { cumulative_k<T>(x, y, outer, d, inner, excl, rev, prod); }
FOR_NUMS(INST_NUM)

#define INST_ALL(T, S) \
    extern "C" __global__ void compare_##S(const T* a, const T* b, unsigned char* o, Strided s, i64 n, int op) { compare_k<T>(a, b, o, s, n, op); }
FOR_ALL(INST_ALL)

#define INST_POW_E(E, ES)                                                                         \
    extern "C" __global__ void pow_x_f32_##ES(const float* a, const E* e, float* o, Strided s, i64 n) { pow_x_k<float, E>(a, e, o, s, n); } \
    extern "C" __global__ void pow_x_f64_##ES(const double* a, const E* e, double* o, Strided s, i64 n) { pow_x_k<double, E>(a, e, o, s, n); } \
    extern "C" __global__ void pow_x_f16_##ES(const f16* a, const E* e, f16* o, Strided s, i64 n) { pow_x_k<f16, E>(a, e, o, s, n); } \
    extern "C" __global__ void pow_x_bf16_##ES(const bf16* a, const E* e, bf16* o, Strided s, i64 n) { pow_x_k<bf16, E>(a, e, o, s, n); }
FOR_NUMS(INST_POW_E)
#define INST_POW_IF_B(B, BS, E, ES) \
    extern "C" __global__ void pow_if_##BS##_##ES(const B* a, const E* e, B* o, Strided s, i64 n) { pow_if_k<B, E>(a, e, o, s, n); }
#define INST_POW_IF(E, ES) FOR_INTS_TO(INST_POW_IF_B, E, ES)
FOR_FLOATS(INST_POW_IF)

#define INST_WORD(W, S)                                                                           \
    extern "C" __global__ void where_##S(const unsigned char* c, const W* a, const W* b, W* o, Strided s, i64 n) { where_k<W>(c, a, b, o, s, n); } \
    extern "C" __global__ void trilu_##S(const W* x, W* y, i64 n, i64 rows, i64 cols, i64 k, int upper) { trilu_k<W>(x, y, n, rows, cols, k, upper); }
FOR_WORDS(INST_WORD)

#define INST_NARROW(T, S) \
    extern "C" __global__ void narrow_cast_##S(const void* x, void* y, i64 n, int sfmt, int dfmt) { narrow_cast_k<T>(x, y, n, sfmt, dfmt); }
FOR_ALL(INST_NARROW)

#define INST_CAST_TO(D, DS, S, SS) \
    extern "C" __global__ void cast_##SS##_##DS(const S* x, D* y, i64 n) { cast_k<S, D>(x, y, n); }
#define INST_CAST_FROM(S, SS) FOR_ALL_TO(INST_CAST_TO, S, SS)
FOR_ALL(INST_CAST_FROM)
