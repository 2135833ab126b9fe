// Elementwise family: unary maps, their gradients, binary arithmetic and comparisons
// with numpy broadcasting (operands walked through the strided descriptor), Pow, Clip
// Dropout and the Random draws. One generic path: `T` is the storage type, `A` the compute type (f32 for
// f32/f16, i32 for i32), both set by the host per pipeline.
//
// Scalars: P[0] = element count, P[1] = op code, P[2], P[3] = the op's f32 attributes
// (alpha, and beta or gamma).

@group(0) @binding(1) var<storage, read> X0: array<T>;
@group(0) @binding(2) var<storage, read> X1: array<T>;
@group(0) @binding(3) var<storage, read_write> Y: array<T>;
@group(0) @binding(4) var<storage, read_write> M: array<u32>;
@group(0) @binding(5) var<storage, read> X2: array<T>;
@group(0) @binding(6) var<storage, read> E: array<f32>;
@group(0) @binding(7) var<storage, read> B0: array<u32>;
@group(0) @binding(8) var<storage, read> B1: array<u32>;

const WG: u32 = 256u;

@compute @workgroup_size(256)
fn unary(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = linear(wid, nwg, lid, WG);
    if (i >= pu(0u)) { return; }
    Y[i] = T(act_fwd(pu(1u), f32(X0[i]), pf(2u), pf(3u)));
}

// Neg, Abs, Relu, Sign on i32 (WGSL's integer negation wraps, as numpy's).
@compute @workgroup_size(256)
fn signop(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = linear(wid, nwg, lid, WG);
    if (i >= pu(0u)) { return; }
    // In i32 whatever `A` is, so that the module also builds where `A` is u32.
    let v = i32(X0[i]);
    var r = v;
    switch pu(1u) {
        case OP_NEG: { r = -v; }
        case OP_ABS: { r = select(v, -v, v < 0); }
        case OP_RELU: { r = max(v, 0); }
        case OP_SIGN: { r = sign(v); }
        default: { r = i32(bad_op()); }
    }
    Y[i] = T(r);
}

// dX = dY · f'(X), dY and X broadcast to the output (operands 0 and 1).
@compute @workgroup_size(256)
fn unary_grad(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = linear(wid, nwg, lid, WG);
    if (i >= pu(0u)) { return; }
    let g = f32(X0[offset_of(0u, i)]);
    let v = f32(X1[offset_of(1u, i)]);
    Y[i] = T(act_bwd(pu(1u), g, v, pf(2u), pf(3u)));
}

// GatedMatMul's gate, Y = act(G)·U (X0 = G, X1 = U; P[2] = 0), and its gradient from X0 =
// dY, X1 = G, X2 = U: P[2] = 1 writes dG = dY·U·act'(G), P[2] = 2 writes dU = dY·act(G).
// Every operand contiguous, of Y's shape.
@compute @workgroup_size(256)
fn glu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = linear(wid, nwg, lid, WG);
    if (i >= pu(0u)) { return; }
    let op = pu(1u);
    let a = f32(X0[i]);
    let b = f32(X1[i]);
    switch pu(2u) {
        case 0u: { Y[i] = T(act_fwd(op, a, 0.0, 0.0) * b); }
        case 1u: { Y[i] = T(act_bwd(op, a * f32(X2[i]), b, 0.0, 0.0)); }
        default: { Y[i] = T(a * act_fwd(op, b, 0.0, 0.0)); }
    }
}

// Integer division by zero is defined in WGSL (it yields the dividend); the host checks.
fn div_(a: A, b: A) -> A { return a / b; }

// BIN_* and CMP_* come from shaders/opcodes.wgsl. WGSL's % truncates (C's fmod); Mod
// takes the divisor's sign. Min and Max propagate NaN (tested on the bits: a shader
// compiler may fold `b != b` away; integers are never NaN).
fn mod_(a: A, b: A) -> A {
    let r = a % b;
    return select(r, r + b, r != A(0) && ((r < A(0)) != (b < A(0))));
}
// a^e by squaring, wrapping in 32 bits (the low bits of any wider power).
fn ipow(a: u32, e: u32) -> u32 {
    var r = 1u;
    var x = a;
    var k = e;
    while (k != 0u) {
        if ((k & 1u) != 0u) { r *= x; }
        x *= x;
        k >>= 1u;
    }
    return r;
}
fn arith(op: u32, a: A, b: A) -> A {
    switch op {
        case BIN_ADD: { return a + b; }
        case BIN_SUB: { return a - b; }
        case BIN_MUL: { return a * b; }
        case BIN_DIV: { return div_(a, b); }
        case BIN_FMOD: { return a % b; }
        case BIN_MOD: { return mod_(a, b); }
        case BIN_MIN: { return select(select(a, b, b < a), b, is_nan(f32(b))); }
        case BIN_MAX: { return select(select(a, b, b > a), b, is_nan(f32(b))); }
        case BIN_PRELU: { return select(a, a * b, a < A(0)); }
        // Bitwise maps (integers only; the host refuses floats), on the 32-bit pattern,
        // which also serves packed lanes: the store keeps their low bits. A shift by 32
        // or more shifts every bit out.
        case BIN_BITWISE_AND: { return bitcast<A>(bitcast<u32>(a) & bitcast<u32>(b)); }
        case BIN_BITWISE_OR: { return bitcast<A>(bitcast<u32>(a) | bitcast<u32>(b)); }
        case BIN_BITWISE_XOR: { return bitcast<A>(bitcast<u32>(a) ^ bitcast<u32>(b)); }
        case BIN_BIT_SHIFT_LEFT: {
            let s = bitcast<u32>(b);
            return bitcast<A>(select(0u, bitcast<u32>(a) << (s & 31u), s < 32u));
        }
        case BIN_BIT_SHIFT_RIGHT: {
            let s = bitcast<u32>(b);
            return bitcast<A>(select(0u, bitcast<u32>(a) >> (s & 31u), s < 32u));
        }
        // Integer bases only (floats take `power`): the exact wrapping power (the host
        // rules out negative exponents).
        case BIN_POW: { return bitcast<A>(ipow(bitcast<u32>(a), bitcast<u32>(b))); }
        // No trap in WGSL: an unknown code gives a value no test accepts.
        default: { return A(bad_op()); }
    }
}

@compute @workgroup_size(256)
fn binary(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = linear(wid, nwg, lid, WG);
    if (i >= pu(0u)) { return; }
    Y[i] = T(arith(pu(1u), A(X0[offset_of(0u, i)]), A(X1[offset_of(1u, i)])));
}

// Rotary: y[i] = x[i]·c[i] + sgn(i)·x[p]·s[i], p being i's partner on the last axis of
// P[1] elements (j and j ± P[1]/2, or 2k and 2k + 1 with P[2] bit 0) and sgn −1 for the
// pair's first element; P[2] bit 1 (the gradient) reads s at the partner with its sign,
// y[i] = x[i]·c[i] − sgn(i)·x[p]·s[p]. X0 = x (contiguous with Y), X1 = cos, X2 = sin,
// strided operands 1 and 2.
@compute @workgroup_size(256)
fn rotary(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = linear(wid, nwg, lid, WG);
    if (i >= pu(0u)) { return; }
    let d = pu(1u);
    let h = d / 2u;
    let j = i % d;
    let il = (pu(2u) & 1u) != 0u;
    let tr = (pu(2u) & 2u) != 0u;
    let first = select(j < h, j % 2u == 0u, il);
    let step = select(h, 1u, il);
    let p = select(i - step, i + step, first);
    let r = A(X0[p]) * A(X2[offset_of(2u, select(i, p, tr))]);
    let v = A(X0[i]) * A(X1[offset_of(1u, i)]);
    Y[i] = T(select(v + r, v - r, first != tr));
}

// A comparison's bool (0 or 1) in the low byte; And, Or, Xor take their operands as
// truths (only bool operands reach them). An unknown code gives 0xff, no bool, which no
// test accepts.
fn compare_op(op: u32, a: A, b: A) -> u32 {
    var r = false;
    switch op {
        case CMP_EQUAL: { r = a == b; }
        case CMP_LESS: { r = a < b; }
        case CMP_GREATER: { r = a > b; }
        case CMP_LESS_OR_EQUAL: { r = a <= b; }
        case CMP_GREATER_OR_EQUAL: { r = a >= b; }
        case CMP_AND: { r = a != A(0) && b != A(0); }
        case CMP_OR: { r = a != A(0) || b != A(0); }
        case CMP_XOR: { r = (a != A(0)) != (b != A(0)); }
        default: { return 0xffu; }
    }
    return select(0u, 1u, r);
}

// Comparisons write one bool byte per element: a thread owns a whole output word.
@compute @workgroup_size(256)
fn compare(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = linear(wid, nwg, lid, WG);
    let n = pu(0u);
    if (w * 4u >= n) { return; }
    var word = 0u;
    for (var j = 0u; j < 4u; j += 1u) {
        let i = w * 4u + j;
        if (i < n) {
            let r = compare_op(pu(1u), A(X0[offset_of(0u, i)]), A(X1[offset_of(1u, i)]));
            word |= r << (j * 8u);
        }
    }
    M[w] = word;
}

// Packed operands: bools and 8- and 16-bit integers, elements packed in u32 words (B0, B1;
// output words M), P[2] bits a lane, P[3] 1 when signed. They compute in i32 (`A`): every
// value and every Add/Sub/Mul of two fits or wraps in i32 with the right low bits, and the
// store keeps the low bits, which is numpy's wrap in the narrow type.
fn packed_at(w: u32, off: u32, bits: u32) -> A {
    let at = (off % (32u / bits)) * bits;
    if (pu(3u) != 0u) { return A(extractBits(bitcast<i32>(w), at, bits)); }
    return A(extractBits(w, at, bits));
}

// Arithmetic: a thread owns one output word of 32 / bits elements.
@compute @workgroup_size(256)
fn binary_packed(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = linear(wid, nwg, lid, WG);
    let n = pu(0u);
    let bits = pu(2u);
    let per = 32u / bits;
    if (w * per >= n) { return; }
    var word = 0u;
    for (var j = 0u; j < per; j += 1u) {
        let i = w * per + j;
        if (i < n) {
            let oa = u32(offset_of(0u, i));
            let ob = u32(offset_of(1u, i));
            let r = arith(pu(1u), packed_at(B0[oa / per], oa, bits), packed_at(B1[ob / per], ob, bits));
            word |= extractBits(bitcast<u32>(i32(r)), 0u, bits) << (j * bits);
        }
    }
    M[w] = word;
}

// Comparisons and And/Or/Xor: a thread owns one output word of four bools.
@compute @workgroup_size(256)
fn compare_packed(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = linear(wid, nwg, lid, WG);
    let n = pu(0u);
    let bits = pu(2u);
    let per = 32u / bits;
    if (w * 4u >= n) { return; }
    var word = 0u;
    for (var j = 0u; j < 4u; j += 1u) {
        let i = w * 4u + j;
        if (i < n) {
            let oa = u32(offset_of(0u, i));
            let ob = u32(offset_of(1u, i));
            let r = compare_op(pu(1u), packed_at(B0[oa / per], oa, bits), packed_at(B1[ob / per], ob, bits));
            word |= r << (j * 8u);
        }
    }
    M[w] = word;
}

// 64-bit integers (i64, u64) as (lo, hi) word pairs, which WGSL lacks: operands in B0,
// B1 (element k at words 2k, 2k + 1), output words in M; P[3] 1 when signed. Arithmetic
// wraps (two's complement), as numpy's. Dropout's SplitMix64 below uses them too.
struct QR { q: vec2<u32>, r: vec2<u32> }
fn add64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let lo = a.x + b.x;
    return vec2<u32>(lo, a.y + b.y + select(0u, 1u, lo < a.x));
}
fn neg64(a: vec2<u32>) -> vec2<u32> { return add64(~a, vec2<u32>(1u, 0u)); }
fn is_neg64(a: vec2<u32>) -> bool { return bitcast<i32>(a.y) < 0; }
fn neg64_if(a: vec2<u32>, c: bool) -> vec2<u32> { return select(a, neg64(a), c); }
// The full 64-bit product of two words, from 16-bit halves.
fn mul32_wide(a: u32, b: u32) -> vec2<u32> {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    return vec2<u32>((p00 & 0xffffu) | (mid << 16u), a1 * b1 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u));
}
fn mul64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let p = mul32_wide(a.x, b.x);
    return vec2<u32>(p.x, p.y + a.x * b.y + a.y * b.x);
}
fn lt64(a: vec2<u32>, b: vec2<u32>, signed: bool) -> bool {
    if (a.y != b.y) {
        if (signed) { return bitcast<i32>(a.y) < bitcast<i32>(b.y); }
        return a.y < b.y;
    }
    return a.x < b.x;
}
// Logical shifts; 64 or more shifts every bit out.
fn shl64(a: vec2<u32>, s: u32) -> vec2<u32> {
    if (s >= 64u) { return vec2<u32>(0u, 0u); }
    if (s >= 32u) { return vec2<u32>(0u, a.x << (s - 32u)); }
    if (s == 0u) { return a; }
    return vec2<u32>(a.x << s, (a.y << s) | (a.x >> (32u - s)));
}
fn shr64(a: vec2<u32>, s: u32) -> vec2<u32> {
    if (s >= 64u) { return vec2<u32>(0u, 0u); }
    if (s >= 32u) { return vec2<u32>(a.y >> (s - 32u), 0u); }
    if (s == 0u) { return a; }
    return vec2<u32>((a.x >> s) | (a.y << (32u - s)), a.y >> s);
}
// Unsigned long division, a bit at a time (the host rules out a zero divisor).
fn divmod64(a: vec2<u32>, b: vec2<u32>) -> QR {
    var q = vec2<u32>(0u, 0u);
    var r = vec2<u32>(0u, 0u);
    for (var i = 63i; i >= 0; i -= 1) {
        let bit = select(a.x >> u32(i), a.y >> u32(i - 32), i >= 32) & 1u;
        r = shl64(r, 1u) | vec2<u32>(bit, 0u);
        if (!lt64(r, b, false)) {
            r = add64(r, neg64(b));
            q = q | shl64(vec2<u32>(1u, 0u), u32(i));
        }
    }
    return QR(q, r);
}
fn arith64(op: u32, a: vec2<u32>, b: vec2<u32>, signed: bool) -> vec2<u32> {
    switch op {
        case BIN_ADD: { return add64(a, b); }
        case BIN_SUB: { return add64(a, neg64(b)); }
        case BIN_MUL: { return mul64(a, b); }
        case BIN_DIV, BIN_MOD, BIN_FMOD: {
            // On magnitudes, then signs: the quotient truncates, the remainder takes the
            // dividend's sign (Fmod) or the divisor's (Mod).
            let na = signed && is_neg64(a);
            let nb = signed && is_neg64(b);
            let qr = divmod64(neg64_if(a, na), neg64_if(b, nb));
            if (op == BIN_DIV) { return neg64_if(qr.q, na != nb); }
            let r = neg64_if(qr.r, na);
            if (op == BIN_MOD && (r.x | r.y) != 0u && is_neg64(r) != nb) { return add64(r, b); }
            return r;
        }
        case BIN_MIN: { return select(a, b, lt64(b, a, signed)); }
        case BIN_MAX: { return select(a, b, lt64(a, b, signed)); }
        case BIN_PRELU: { return select(a, mul64(a, b), signed && is_neg64(a)); }
        case BIN_BITWISE_AND: { return a & b; }
        case BIN_BITWISE_OR: { return a | b; }
        case BIN_BITWISE_XOR: { return a ^ b; }
        case BIN_BIT_SHIFT_LEFT: { return shl64(a, select(64u, b.x, b.y == 0u)); }
        case BIN_BIT_SHIFT_RIGHT: { return shr64(a, select(64u, b.x, b.y == 0u)); }
        case BIN_POW: {
            var r = vec2<u32>(1u, 0u);
            var x = a;
            for (var i = 0u; i < 64u; i += 1u) {
                if ((select(b.x >> i, b.y >> (i - 32u), i >= 32u) & 1u) != 0u) { r = mul64(r, x); }
                x = mul64(x, x);
            }
            return r;
        }
        // No trap in WGSL: an unknown code gives a value no test accepts.
        default: { return vec2<u32>(0xdeadbeefu, 0xdeadbeefu); }
    }
}
fn compare64(op: u32, a: vec2<u32>, b: vec2<u32>, signed: bool) -> u32 {
    var r = false;
    switch op {
        case CMP_EQUAL: { r = all(a == b); }
        case CMP_LESS: { r = lt64(a, b, signed); }
        case CMP_GREATER: { r = lt64(b, a, signed); }
        case CMP_LESS_OR_EQUAL: { r = !lt64(b, a, signed); }
        case CMP_GREATER_OR_EQUAL: { r = !lt64(a, b, signed); }
        default: { return 0xffu; }
    }
    return select(0u, 1u, r);
}
fn b0_64(off: u32) -> vec2<u32> { return vec2<u32>(B0[2u * off], B0[2u * off + 1u]); }
fn b1_64(off: u32) -> vec2<u32> { return vec2<u32>(B1[2u * off], B1[2u * off + 1u]); }

// Arithmetic: a thread an element (two output words).
@compute @workgroup_size(256)
fn binary64(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = linear(wid, nwg, lid, WG);
    if (i >= pu(0u)) { return; }
    let a = b0_64(u32(offset_of(0u, i)));
    let b = b1_64(u32(offset_of(1u, i)));
    let r = arith64(pu(1u), a, b, pu(3u) != 0u);
    M[2u * i] = r.x;
    M[2u * i + 1u] = r.y;
}

// Comparisons: a thread owns one output word of four bools.
@compute @workgroup_size(256)
fn compare64_(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = linear(wid, nwg, lid, WG);
    let n = pu(0u);
    if (w * 4u >= n) { return; }
    var word = 0u;
    for (var j = 0u; j < 4u; j += 1u) {
        let i = w * 4u + j;
        if (i < n) {
            let a = b0_64(u32(offset_of(0u, i)));
            let b = b1_64(u32(offset_of(1u, i)));
            word |= compare64(pu(1u), a, b, pu(3u) != 0u) << (j * 8u);
        }
    }
    M[w] = word;
}

// TopK of 64-bit integers (pairs in B0), as shaders/reduce.wgsl `top_k`: a thread per
// line picks its K one after another, the larger first (smaller without `largest`), equal
// values by lower index. P[0] lines, P[1] axis length, P[2] inner, P[3] K, P[4] largest,
// P[5] signed; values to M (pairs), indices to Y (i64 as (lo, hi) words).
fn ranks_before64(a: vec2<u32>, ia: u32, b: vec2<u32>, ib: u32, largest: bool, sg: bool) -> bool {
    if (all(a == b)) { return ia < ib; }
    return select(lt64(a, b, sg), lt64(b, a, sg), largest);
}
@compute @workgroup_size(256)
fn top_k64(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let l = linear(wid, nwg, lid, WG);
    if (l >= pu(0u)) { return; }
    let d = pu(1u);
    let inner = pu(2u);
    let k = pu(3u);
    let largest = pu(4u) != 0u;
    let sg = pu(5u) != 0u;
    let o = l / inner;
    let base = o * d * inner + l % inner;
    var pv = b0_64(base);
    var pi = 0u;
    for (var j = 0u; j < k; j += 1u) {
        var bv = b0_64(base);
        var bi = 0u;
        var found = false;
        for (var s = 0u; s < d; s += 1u) {
            let v = b0_64(base + s * inner);
            if (j > 0u && !ranks_before64(pv, pi, v, s, largest, sg)) { continue; }
            if (!found || ranks_before64(v, s, bv, bi, largest, sg)) { bv = v; bi = s; found = true; }
        }
        let at = (o * k + j) * inner + l % inner;
        M[2u * at] = bv.x;
        M[2u * at + 1u] = bv.y;
        // T is i32 in this kernel's pipeline (written as T so that every pipeline builds).
        Y[2u * at] = T(bi);
        Y[2u * at + 1u] = T(0);
        pv = bv;
        pi = bi;
    }
}

// Pow as the CPU's powf: negative bases take integer exponents, x^0 = 1. The exponent
// comes as f32 (the host casts it), operand 1.
fn pow_(a: f32, e: f32) -> f32 {
    if (e == 0.0) { return 1.0; }
    if (a < 0.0) {
        if (e != floor(e)) { return bitcast<f32>(0x7fc00000u); }
        let r = pow(-a, e);
        return select(r, -r, fract(e * 0.5) != 0.0);
    }
    if (a == 0.0) { return select(bitcast<f32>(0x7f800000u), 0.0, e > 0.0); }
    return pow(a, e);
}

@compute @workgroup_size(256)
fn power(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = linear(wid, nwg, lid, WG);
    if (i >= pu(0u)) { return; }
    Y[i] = T(pow_(f32(X0[offset_of(0u, i)]), E[offset_of(1u, i)]));
}

// Range: start (X0[0]) + i·delta (X1[0]), computed in A.
@compute @workgroup_size(256)
fn range_(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = linear(wid, nwg, lid, WG);
    if (i >= pu(0u)) { return; }
    Y[i] = T(A(X0[0]) + A(i) * A(X1[0]));
}

// CumSum (CumProd with P[4] bit 2): a thread a line; P[1] = outer, P[2] = length,
// P[3] = inner, P[4] bit 0 exclusive, bit 1 reverse. A dispatch covers steps [P[5], P[6])
// of each line and carries on from what the previous one wrote (lavapipe ends a shader
// loop after 65535 iterations, so a long line takes several).
@compute @workgroup_size(256)
fn cumulative(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let line = linear(wid, nwg, lid, WG);
    if (line >= pu(1u) * pu(3u)) { return; }
    let c = cum_line(line);
    var acc = select(A(0), A(1), c.prod);
    if (c.s0 > 0u) {
        let prev = cum_at(c, c.s0 - 1u);
        acc = A(Y[prev]);
        if (c.excl) { acc = select(acc + A(X0[prev]), acc * A(X0[prev]), c.prod); }
    }
    for (var s = c.s0; s < c.s1; s += 1u) {
        let at = cum_at(c, s);
        let v = A(X0[at]);
        if (!c.excl) { acc = select(acc + v, acc * v, c.prod); }
        Y[at] = T(acc);
        if (c.excl) { acc = select(acc + v, acc * v, c.prod); }
    }
}

// `cumulative` for 64-bit integers: word pairs in B0, out in M (wrapping, as numpy's).
@compute @workgroup_size(256)
fn cumulative64(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let line = linear(wid, nwg, lid, WG);
    if (line >= pu(1u) * pu(3u)) { return; }
    let c = cum_line(line);
    var acc = select(vec2<u32>(0u, 0u), vec2<u32>(1u, 0u), c.prod);
    if (c.s0 > 0u) {
        let prev = cum_at(c, c.s0 - 1u);
        acc = vec2<u32>(M[2u * prev], M[2u * prev + 1u]);
        if (c.excl) { acc = select(add64(acc, b0_64(prev)), mul64(acc, b0_64(prev)), c.prod); }
    }
    for (var s = c.s0; s < c.s1; s += 1u) {
        let at = cum_at(c, s);
        let v = b0_64(at);
        if (!c.excl) { acc = select(add64(acc, v), mul64(acc, v), c.prod); }
        M[2u * at] = acc.x;
        M[2u * at + 1u] = acc.y;
        if (c.excl) { acc = select(add64(acc, v), mul64(acc, v), c.prod); }
    }
}

// One line of a cumulative sum or product (P: 1 outer, 2 length, 3 inner
// stride, 4 flags: 1 exclusive, 2 reverse, 4 product; 5, 6 the steps of this dispatch).
struct CumLine { base: u32, d: u32, inner: u32, excl: bool, rev: bool, prod: bool, s0: u32, s1: u32 }

fn cum_line(line: u32) -> CumLine {
    let d = pu(2u);
    let inner = pu(3u);
    let f = pu(4u);
    return CumLine((line / inner) * d * inner + line % inner, d, inner, (f & 1u) != 0u, (f & 2u) != 0u, (f & 4u) != 0u, pu(5u), pu(6u));
}

// Element s of the line, counted from its end when reversed.
fn cum_at(c: CumLine, s: u32) -> u32 {
    return c.base + select(s, c.d - 1u - s, c.rev) * c.inner;
}

// Min first, then max: with min > max every value becomes max, as ONNX says.
// P[1] bit 0: a min (X1[0]) is given; bit 1: a max (X2[0]).
@compute @workgroup_size(256)
fn clip(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = linear(wid, nwg, lid, WG);
    if (i >= pu(0u)) { return; }
    var v = A(X0[i]);
    if ((pu(1u) & 1u) != 0u && v < A(X1[0])) { v = A(X1[0]); }
    if ((pu(1u) & 2u) != 0u && v > A(X2[0])) { v = A(X2[0]); }
    Y[i] = T(v);
}

// SplitMix64 on (lo, hi) pairs (add64, mul64 above).
fn xorshr64(a: vec2<u32>, s: u32) -> vec2<u32> {
    return vec2<u32>(a.x ^ ((a.x >> s) | (a.y << (32u - s))), a.y ^ (a.y >> s));
}
// SplitMix64 of `seed`, bit for bit src/rng.rs `Rng::new(seed).next_u64()`.
fn splitmix(seed: vec2<u32>) -> vec2<u32> {
    let g = vec2<u32>(0x7F4A7C15u, 0x9E3779B9u);
    var z = add64(seed ^ g, g);
    z = mul64(xorshr64(z, 30u), vec2<u32>(0x1CE4E5B9u, 0xBF58476Du));
    z = mul64(xorshr64(z, 27u), vec2<u32>(0x133111EBu, 0x94D049BBu));
    return xorshr64(z, 31u);
}

// The CPU's counter-based mask: element i keeps iff uniform(Rng::new(base + i)) >= ratio,
// i.e. the draw's top 53 bits >= ceil(ratio · 2^53) (the host's exact threshold).
// P[1..3] base, P[3..5] threshold, P[5] scale (f32), P[6] whether the mask is written.
fn keep(i: u32) -> bool {
    let z = splitmix(add64(vec2<u32>(pu(1u), pu(2u)), vec2<u32>(i, 0u)));
    let k = vec2<u32>((z.x >> 11u) | (z.y << 21u), z.y >> 11u);
    let t = vec2<u32>(pu(3u), pu(4u));
    return k.y > t.y || (k.y == t.y && k.x >= t.x);
}

@compute @workgroup_size(256)
fn dropout(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = linear(wid, nwg, lid, WG);
    let n = pu(0u);
    if (w * 4u >= n) { return; }
    var word = 0u;
    for (var j = 0u; j < 4u; j += 1u) {
        let i = w * 4u + j;
        if (i < n) {
            let k = keep(i);
            Y[i] = T(select(0.0, f32(X0[i]) * pf(5u), k));
            word |= select(0u, 1u, k) << (j * 8u);
        }
    }
    if (pu(6u) != 0u) { M[w] = word; }
}

// The top 24 bits of Rng::new(seed).next_u64() as a number in [0, 1), exact in f32.
fn unit24(seed: vec2<u32>) -> f32 {
    return f32(splitmix(seed).y >> 8u) * (1.0 / 16777216.0);
}

// RandomUniform / RandomNormal in f32, as src/backends/common.rs `random_value` with 24
// bits: uniform in [a, b) from counter base + i, or Box–Muller from counters base + 2i
// and base + 2i + 1. P[1..3] base, P[3] normal, P[4] a, P[5] b (f32). The cosine's
// argument is kept in [-π, π) (cos(2πu) = -cos(2π(u - ½))), where WGSL bounds its error.
@compute @workgroup_size(256)
fn random(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = linear(wid, nwg, lid, WG);
    if (i >= pu(0u)) { return; }
    let base = vec2<u32>(pu(1u), pu(2u));
    let a = pf(4u);
    let b = pf(5u);
    var v: f32;
    if (pu(3u) != 0u) {
        let c = add64(base, vec2<u32>(i << 1u, i >> 31u));
        let u1 = 1.0 - unit24(c);
        let u2 = unit24(add64(c, vec2<u32>(1u, 0u)));
        v = a - b * sqrt(-2.0 * log(u1)) * cos(6.2831853 * (u2 - 0.5));
    } else {
        v = a + (b - a) * unit24(add64(base, vec2<u32>(i, 0u)));
    }
    Y[i] = T(v);
}
