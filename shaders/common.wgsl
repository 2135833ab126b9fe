// Shared by every family. The host puts a few lines in front of each source: the storage
// type `T` of the data (f32, or f16 with `enable f16;`), `A` the type it is computed in,
// and op codes or sizes as constants, so each pipeline is specialised at build time.
//
// Binding 0 is the dispatch's parameters: u32 words (bitcast for i32/f32) written by the
// host into a per-dispatch slot (src/backends/wgpu/device.rs `Recorder::dispatch`).

@group(0) @binding(0) var<storage, read> P: array<u32>;

fn pu(i: u32) -> u32 { return P[i]; }
fn pi(i: u32) -> i32 { return bitcast<i32>(P[i]); }
fn pf(i: u32) -> f32 { return bitcast<f32>(P[i]); }

// The linear index of a thread over a grid spread on x and y (device.rs `groups_for`).
fn linear(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, wg: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * wg + lid;
}

// A row-major walk over a shape of up to 8 dims with up to 3 operands, each with its own
// element strides (0 where broadcast, negative for reversed slices) and base offset.
// Layout at word `at`: rank, shape[8], strides[3][8], base[3] (host: `Strided::words`).
fn offset_at(at: u32, k: u32, i: u32) -> i32 {
    var off = pi(at + 33u + k);
    var r = i;
    let rank = i32(pu(at));
    for (var d = rank - 1; d >= 0; d -= 1) {
        let n = max(pu(at + 1u + u32(d)), 1u);
        off += i32(r % n) * pi(at + 9u + k * 8u + u32(d));
        r = r / n;
    }
    return off;
}
// The first strided descriptor sits after 16 scalar parameters.
fn offset_of(k: u32, i: u32) -> i32 { return offset_at(16u, k, i); }

// Activations and unary maps, in f32. The op codes OP_* come from shaders/opcodes.wgsl,
// generated from the Rust declaration (src/graph/elementwise.rs) and put in front of this
// file; formulas as the CPU backend's, so fused and unfused graphs agree.
const SQRT_2_OVER_PI: f32 = 0.7978845608028654;
const FRAC_1_SQRT_2: f32 = 0.7071067811865476;
const FRAC_2_SQRT_PI: f32 = 1.1283791670955126;
const GELU_C: f32 = 0.044715;

// WGSL has no erf: a series near 0 (where the tail formula cancels) and Abramowitz &
// Stegun 7.1.26 beyond (absolute error below 1.5e-7).
fn erf_(x: f32) -> f32 {
    let a = abs(x);
    if (a < 0.5) {
        let x2 = x * x;
        return x * FRAC_2_SQRT_PI * (1.0 + x2 * (-1.0 / 3.0 + x2 * (0.1 + x2 * (-1.0 / 42.0 + x2 / 216.0))));
    }
    let t = 1.0 / (1.0 + 0.3275911 * a);
    let y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * exp(-a * a);
    return select(y, -y, x < 0.0);
}
// Some drivers' tanh overflows to NaN for large inputs; it is ±1 to f32 precision there.
fn tanh_(x: f32) -> f32 { return tanh(clamp(x, -15.0, 15.0)); }
fn sigmoid_(v: f32) -> f32 { return 1.0 / (1.0 + exp(-v)); }
// ln(1 + e^x) without overflow.
fn softplus_(v: f32) -> f32 { return max(v, 0.0) + log(1.0 + exp(-abs(v))); }
fn sign_(v: f32) -> f32 { return select(select(v, -1.0, v < 0.0), 1.0, v > 0.0); }
// WGSL has no trap: an op code without a case gives NaN, which every test catches.
fn bad_op() -> f32 { return bitcast<f32>(0x7fc00000u); }

fn act_fwd(op: u32, v: f32, alpha: f32, beta: f32) -> f32 {
    switch op {
        case OP_NONE: { return v; }
        case OP_RELU: { return max(v, 0.0); }
        case OP_GELU: { return 0.5 * v * (1.0 + erf_(v * FRAC_1_SQRT_2)); }
        case OP_GELU_TANH: { return 0.5 * v * (1.0 + tanh_(SQRT_2_OVER_PI * (v + GELU_C * v * v * v))); }
        case OP_SILU: { return v / (1.0 + exp(-v)); }
        case OP_RELU6: { return select(select(v, 6.0, v > 6.0), 0.0, v < 0.0); }
        case OP_SIGMOID: { return sigmoid_(v); }
        case OP_TANH: { return tanh_(v); }
        case OP_NEG: { return -v; }
        case OP_EXP: { return exp(v); }
        case OP_LOG: { return log(v); }
        case OP_SQRT: { return sqrt(v); }
        case OP_RECIPROCAL: { return 1.0 / v; }
        case OP_ABS: { return abs(v); }
        case OP_ERF: { return erf_(v); }
        case OP_LEAKY_RELU: { return select(alpha * v, v, v >= 0.0); }
        case OP_SIGN: { return sign_(v); }
        case OP_FLOOR: { return floor(v); }
        case OP_CEIL: { return ceil(v); }
        case OP_ROUND: { return round(v); }
        case OP_SIN: { return sin(v); }
        case OP_COS: { return cos(v); }
        case OP_TAN: { return tan(v); }
        // Through atan2: some drivers' asin and acos are far less precise than their atan.
        case OP_ASIN: { return atan2(v, sqrt((1.0 - v) * (1.0 + v))); }
        case OP_ACOS: { return atan2(sqrt((1.0 - v) * (1.0 + v)), v); }
        case OP_ATAN: { return atan(v); }
        case OP_SINH: { return sinh(v); }
        case OP_COSH: { return cosh(v); }
        case OP_ASINH: { return asinh(v); }
        case OP_ACOSH: { return acosh(v); }
        case OP_ATANH: { return atanh(v); }
        case OP_SOFTPLUS: { return softplus_(v); }
        case OP_SOFTSIGN: { return v / (1.0 + abs(v)); }
        case OP_ELU: { return select(v, alpha * (exp(v) - 1.0), v < 0.0); }
        case OP_SELU: { return select(beta * alpha * (exp(v) - 1.0), beta * v, v > 0.0); }
        case OP_CELU: { return select(alpha * (exp(v / alpha) - 1.0), v, v > 0.0); }
        case OP_HARD_SIGMOID: { return clamp(alpha * v + beta, 0.0, 1.0); }
        case OP_HARD_SWISH: { return v * clamp(v / 6.0 + 0.5, 0.0, 1.0); }
        case OP_MISH: { return v * tanh_(softplus_(v)); }
        case OP_THRESHOLDED_RELU: { return select(0.0, v, v > alpha); }
        case OP_SWISH: { return v * sigmoid_(alpha * v); }
        default: { return bad_op(); }
    }
}

// g · f'(v).
fn act_bwd(op: u32, g: f32, v: f32, alpha: f32, beta: f32) -> f32 {
    switch op {
        case OP_NONE: { return g; }
        case OP_RELU: { return select(0.0, g, v > 0.0); }
        case OP_GELU: {
            let cdf = 0.5 * (1.0 + erf_(v * FRAC_1_SQRT_2));
            let pdf = 0.5 * FRAC_2_SQRT_PI * FRAC_1_SQRT_2 * exp(-0.5 * v * v);
            return g * (cdf + v * pdf);
        }
        case OP_GELU_TANH: {
            let x2 = v * v;
            let t = tanh_(SQRT_2_OVER_PI * (v + GELU_C * x2 * v));
            let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x2);
            return g * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * du);
        }
        case OP_SILU: { let s = sigmoid_(v); return g * s * (1.0 + v * (1.0 - s)); }
        case OP_RELU6: { return select(0.0, g, v > 0.0 && v < 6.0); }
        case OP_SIGMOID: { let s = sigmoid_(v); return g * s * (1.0 - s); }
        case OP_TANH: { let t = tanh_(v); return g * (1.0 - t * t); }
        case OP_NEG: { return -g; }
        case OP_EXP: { return g * exp(v); }
        case OP_LOG: { return g / v; }
        case OP_SQRT: { return g * 0.5 / sqrt(v); }
        case OP_RECIPROCAL: { return -g / (v * v); }
        case OP_ABS: { return select(select(0.0, -g, v < 0.0), g, v > 0.0); }
        case OP_ERF: { return g * FRAC_2_SQRT_PI * exp(-v * v); }
        case OP_LEAKY_RELU: { return select(alpha * g, g, v > 0.0); }
        case OP_SIN: { return g * cos(v); }
        case OP_COS: { return -g * sin(v); }
        case OP_TAN: { let t = tan(v); return g * (1.0 + t * t); }
        case OP_ASIN: { return g / sqrt(1.0 - v * v); }
        case OP_ACOS: { return -g / sqrt(1.0 - v * v); }
        case OP_ATAN: { return g / (1.0 + v * v); }
        case OP_SINH: { return g * cosh(v); }
        case OP_COSH: { return g * sinh(v); }
        case OP_ASINH: { return g / sqrt(v * v + 1.0); }
        case OP_ACOSH: { return g / sqrt(v * v - 1.0); }
        case OP_ATANH: { return g / (1.0 - v * v); }
        case OP_SOFTPLUS: { return g * sigmoid_(v); }
        case OP_SOFTSIGN: { let d = 1.0 + abs(v); return g / (d * d); }
        case OP_ELU: { return select(g * alpha * exp(v), g, v > 0.0); }
        case OP_SELU: { return select(g * beta * alpha * exp(v), g * beta, v > 0.0); }
        case OP_CELU: { return select(g * exp(v / alpha), g, v > 0.0); }
        case OP_HARD_SIGMOID: { let u = alpha * v + beta; return select(0.0, g * alpha, u > 0.0 && u < 1.0); }
        case OP_HARD_SWISH: { return select(select(g * (v / 3.0 + 0.5), g, v > 3.0), 0.0, v < -3.0); }
        case OP_MISH: { let t = tanh_(softplus_(v)); return g * (t + v * (1.0 - t * t) * sigmoid_(v)); }
        case OP_THRESHOLDED_RELU: { return select(0.0, g, v > alpha); }
        case OP_SWISH: { let s = sigmoid_(alpha * v); return g * s * (1.0 + alpha * v * (1.0 - s)); }
        default: { return bad_op(); }
    }
}

// Bytes in u32 words: bool masks are one byte per element.
fn byte_at(w: u32, j: u32) -> u32 { return (w >> ((j & 3u) * 8u)) & 0xffu; }

// NaN by its bits: `x != x` may be folded away by a shader compiler.
fn is_nan(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }
