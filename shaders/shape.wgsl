// Shape and copy family: every op that moves elements without arithmetic (Transpose,
// Expand, Slice, Split, Concat, Trilu, Where, Gather, Pad, SliceGrad), plus Cast, the
// scatter-add of GatherGrad and ScatterElements/ScatterND. Data is seen as raw u32 words whatever its dtype: the
// element size ES (1, 2, 4 or 8 bytes) is a pipeline constant, and a thread owns one
// output word, so 1- and 2-byte elements (bool, f16) never race on a shared word.
//
// P: 0 output words, 1 output elements, 2 mode, 3.. the mode's scalars; the strided
// descriptor at 16 walks the output's shape.

@group(0) @binding(1) var<storage, read> SX: array<u32>;
@group(0) @binding(2) var<storage, read_write> SY: array<u32>;
@group(0) @binding(3) var<storage, read> AUX: array<u32>;
@group(0) @binding(4) var<storage, read> SX2: array<u32>;
@group(0) @binding(5) var<storage, read_write> ACC: array<atomic<u32>>;

const WG: u32 = 256u;

fn elem_of(w0: u32, w1: u32, e: u32, es: u32) -> u32 {
    if (es == 4u) { return w0; }
    if (es == 2u) { return (w0 >> ((e & 1u) * 16u)) & 0xffffu; }
    return byte_at(w0, e);
}
// Element `e` of SX / SX2 as (low, high) words.
fn elem_x(e: u32) -> vec2<u32> {
    if (ES == 8u) { return vec2<u32>(SX[2u * e], SX[2u * e + 1u]); }
    return vec2<u32>(elem_of(SX[e * ES / 4u], 0u, e, ES), 0u);
}
fn elem_x2(e: u32) -> vec2<u32> {
    if (ES == 8u) { return vec2<u32>(SX2[2u * e], SX2[2u * e + 1u]); }
    return vec2<u32>(elem_of(SX2[e * ES / 4u], 0u, e, ES), 0u);
}

// Where element `e` of the output comes from: x = 0 zero, 1 SX, 2 SX2, 3 keep the output's
// own value; y = the element offset.
fn source(e: u32) -> vec2<i32> {
    switch pu(2u) {
        // Strided view: Transpose, Expand, Slice, Split.
        case 0u: { return vec2<i32>(1, offset_of(0u, e)); }
        // Concat: one input's region [P[5], P[6]) along an axis of P[4] (P[3] inner).
        case 1u: {
            let c = (e / pu(3u)) % pu(4u);
            if (c >= pu(5u) && c < pu(6u)) { return vec2<i32>(1, offset_of(0u, e)); }
            return vec2<i32>(3, 0);
        }
        // Trilu over [.., P[3] rows, P[4] cols], diagonal k = P[5], P[6] = upper.
        case 2u: {
            let j = i32(e % pu(4u));
            let r = i32((e / pu(4u)) % pu(3u));
            let d = j - r;
            let keep = select(d <= pi(5u), d >= pi(5u), pu(6u) != 0u);
            return vec2<i32>(select(0, 1, keep), i32(e));
        }
        // Where: the condition byte (AUX) picks SX or SX2 (operands 0, 1, 2 broadcast).
        case 3u: {
            let ci = u32(offset_of(0u, e));
            if (byte_at(AUX[ci >> 2u], ci) != 0u) { return vec2<i32>(1, offset_of(1u, e)); }
            return vec2<i32>(2, offset_of(2u, e));
        }
        // Gather: P[3] inner, P[4] indices, P[5] axis length, P[6] words per index (1 for
        // i32, 2 for i64: the low word). Negative indices count from the end.
        case 4u: {
            let inner = pu(3u);
            let nidx = pu(4u);
            let dim = i32(pu(5u));
            let j = (e / inner) % nidx;
            var idx = bitcast<i32>(AUX[j * pu(6u)]);
            if (idx < 0) { idx += dim; }
            if (idx < 0 || idx >= dim) { return vec2<i32>(0, 0); }
            let outer = e / (inner * nidx);
            return vec2<i32>(1, (i32(outer) * dim + idx) * i32(inner) + i32(e % inner));
        }
        // Pad: AUX holds each output element's source offset in SX as i64 (read by its low
        // word), -1 where it takes the constant, SX2's element 0.
        case 6u: {
            let k = bitcast<i32>(AUX[2u * e]);
            if (k < 0) { return vec2<i32>(2, 0); }
            return vec2<i32>(1, k);
        }
        // Im2Col: the window at P[3..30] (src/backends/common.rs `WindowGeom::words`:
        // image 3.., out 6.., kernel 9.., stride 12.., dilation 15.., begin 18.., end 21..,
        // K 26, L 27, image size 28); SX2 holds the pad value (element 0) and what
        // ceil_mode's windows read past the padding (element 1).
        case 7u: {
            let l = pu(27u);
            let k = pu(26u);
            var o = e % l;
            var j = (e / l) % k;
            let plane = e / (l * k);
            var off = 0;
            var st = 1;
            var pad = false;
            for (var d = 2u; d < 3u; d -= 1u) {
                let jd = j % pu(9u + d);
                let od = o % pu(6u + d);
                j = j / pu(9u + d);
                o = o / pu(6u + d);
                let p = i32(od * pu(12u + d) + jd * pu(15u + d)) - pi(18u + d);
                let size = pi(3u + d);
                if (p >= size + pi(21u + d)) { return vec2<i32>(2, 1); }
                if (p < 0 || p >= size) { pad = true; }
                off += p * st;
                st *= size;
            }
            if (pad) { return vec2<i32>(2, 0); }
            return vec2<i32>(1, i32(plane * pu(28u)) + off);
        }
        // SliceGrad: dY placed into zeros. Per dim d (descriptor shape = dX): start
        // P[60+d], step P[68+d], length P[76+d]; operand 0's strides are dY's.
        default: {
            var r = e;
            var off = 0;
            let rank = i32(pu(16u));
            for (var d = rank - 1; d >= 0; d -= 1) {
                let n = pu(17u + u32(d));
                let c = i32(r % n);
                r = r / n;
                let k = c - pi(60u + u32(d));
                let step = pi(68u + u32(d));
                if (k % step != 0) { return vec2<i32>(0, 0); }
                let q = k / step;
                if (q < 0 || q >= pi(76u + u32(d))) { return vec2<i32>(0, 0); }
                off += q * pi(25u + u32(d));
            }
            return vec2<i32>(1, off);
        }
    }
}

fn value_of(s: vec2<i32>, part: u32) -> u32 {
    var v = vec2<u32>(0u, 0u);
    if (s.x == 1) { v = elem_x(u32(s.y)); } else if (s.x == 2) { v = elem_x2(u32(s.y)); }
    return select(v.x, v.y, part == 1u);
}

@compute @workgroup_size(256)
fn copy(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = linear(wid, nwg, lid, WG);
    if (w >= pu(0u)) { return; }
    if (ES >= 4u) {
        let per = max(ES / 4u, 1u);
        let s = source(w / per);
        if (s.x != 3) { SY[w] = value_of(s, w % per); }
        return;
    }
    // Reached for ES < 4 only (min keeps the constant shifts of other ES valid).
    let per = 4u / min(ES, 2u);
    let bits = min(ES, 2u) * 8u;
    let mask = (1u << bits) - 1u;
    var word = SY[w];
    for (var j = 0u; j < per; j += 1u) {
        let e = w * per + j;
        if (e < pu(1u)) {
            let s = source(e);
            if (s.x != 3) {
                let sh = j * bits;
                word = (word & ~(mask << sh)) | ((value_of(s, 0u) & mask) << sh);
            }
        }
    }
    SY[w] = word;
}

// Cast between dtypes by code (0 f32, 1 f16, 2 i32, 3 i64, 4 bool, 5 u8, 6 i8, 7 u16,
// 8 i16, 9 u32, 10 u64, 11 f64, 12 bf16, and the narrow storage types, a byte each: 13
// f8e4m3fn, 14 f8e4m3fnuz, 15 f8e5m2, 16 f8e5m2fnuz, 17 f4e2m1, 18 i4, 19 u4, 20 i2, 21
// u2, 22 f8e8m0; src/backends/wgpu/shape.rs `code`): SRC and DST
// are pipeline constants, ES the destination's element size. Integers travel as 64-bit
// (lo, hi) pairs, so casts between them are exact and wrap; floats go through f32 (f64
// and bf16 by their bits: WGSL has neither type, and the host casts them only to and
// from the other floats); float to integer saturates and NaN becomes 0 (Rust's `as`);
// bool is `v != 0`.
fn code_size(c: u32) -> u32 {
    switch c {
        case 3u, 10u, 11u: { return 8u; }
        case 1u, 7u, 8u, 12u: { return 2u; }
        case 4u, 5u, 6u, 13u, 14u, 15u, 16u, 17u, 18u, 19u, 20u, 21u, 22u: { return 1u; }
        default: { return 4u; }
    }
}
fn code_signed(c: u32) -> bool { return c == 2u || c == 3u || c == 6u || c == 8u || c == 18u || c == 20u; }
fn is_minifloat(c: u32) -> bool { return c >= 13u && c <= 17u; }

// The minifloats as src/tensor/narrow.rs has them: (exponent bits, mantissa bits, bias,
// specials: 0 IEEE infinities and NaNs, 1 no infinity and the all-ones NaN, 2 no infinity
// and no -0 with 0x80 the NaN, 3 finite only).
fn mf_format(c: u32) -> vec4<u32> {
    switch c {
        case 13u: { return vec4<u32>(4u, 3u, 7u, 1u); }
        case 14u: { return vec4<u32>(4u, 3u, 8u, 2u); }
        case 15u: { return vec4<u32>(5u, 2u, 15u, 0u); }
        case 16u: { return vec4<u32>(5u, 2u, 16u, 2u); }
        default: { return vec4<u32>(2u, 1u, 1u, 3u); }
    }
}
// Every minifloat value is an f32 exactly.
fn mf_decode(c: u32, code: u32) -> f32 {
    let f = mf_format(c);
    let sb = 1u << (f.x + f.y);
    let mag = code & (sb - 1u);
    let ex = mag >> f.y;
    let man = mag & ((1u << f.y) - 1u);
    let neg = (code & sb) != 0u;
    let nan = bitcast<f32>(0x7fc00000u);
    if (f.w == 2u && code == 0x80u) { return nan; }
    if (f.w == 1u && mag == sb - 1u) { return nan; }
    if (f.w == 0u && ex == (1u << f.x) - 1u) {
        if (man != 0u) { return nan; }
        return bitcast<f32>(select(0x7f800000u, 0xff800000u, neg));
    }
    // Subnormals (exponent field 0) share the smallest normal binade's quantum.
    let units = select(man | (1u << f.y), man, ex == 0u);
    let v = ldexp(f32(units), i32(max(ex, 1u)) - i32(f.z) - i32(f.y));
    return select(v, -v, neg);
}
// f rounded to nearest even, saturating to the largest finite value (Cast's default; the
// importer writes `saturate` 0 around it); NaN as ml_dtypes writes it.
fn mf_encode(c: u32, v: f32) -> u32 {
    let f = mf_format(c);
    let sb = 1u << (f.x + f.y);
    let neg = (bitcast<u32>(v) >> 31u) != 0u;
    let sign = select(0u, sb, neg);
    let top = (1u << f.x) - 1u;
    let full = (1u << f.y) - 1u;
    if (is_nan(v)) {
        switch f.w {
            case 0u: { return sign | (top << f.y) | (1u << (f.y - 1u)); }
            case 1u: { return sign | (sb - 1u); }
            case 2u: { return 0x80u; }
            default: { return sb - sign; }
        }
    }
    var max_code = (top << f.y) | full;
    if (f.w == 0u) { max_code = ((top - 1u) << f.y) | full; }
    if (f.w == 1u) { max_code = (top << f.y) | (full - 1u); }
    let a = abs(v);
    let a_exp = (bitcast<u32>(a) >> 23u) & 0xffu;
    if (a_exp == 0xffu) { return sign | max_code; }
    // a in units of the quantum of its binade (no finer than the subnormals'), rounded:
    // the code is the binade's offset from the smallest plus those units, a carry into
    // the next binade included. f32 subnormals lie far below every minifloat's quantum.
    let emin = 1 - i32(f.z);
    let e = max(i32(a_exp) - 127, emin);
    let units = u32(round(ldexp(a, i32(f.y) - e)));
    let code = (u32(e - emin) << f.y) + units;
    if (code > max_code) { return sign | max_code; }
    if (code == 0u && f.w == 2u) { return 0u; }
    return sign | code;
}
// E8M0 (src/tensor/narrow.rs F8E8M0): code c is 2^(c - 127), 0xff NaN. Code 0 is an f32
// subnormal, written by its bits.
fn e8m0_decode(code: u32) -> f32 {
    if (code == 0xffu) { return bitcast<f32>(0x7fc00000u); }
    if (code == 0u) { return bitcast<f32>(0x00400000u); }
    return bitcast<f32>(code << 23u);
}
// f's exponent bits, one higher where a mantissa bit is set (Cast's round_mode "up"),
// staying at 2^127 (saturate); infinity and NaN are 0xff.
fn e8m0_encode(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    let e = (b >> 23u) & 0xffu;
    if (e == 0xffu) { return 0xffu; }
    if ((b & 0x7fffffu) != 0u && e != 0xfeu) { return e + 1u; }
    return e;
}
// f or the integer (lo, hi) wrapped to a narrow integer's `bits`, as its low word
// (sign-extended when signed): floats truncate toward zero and saturate to i64 first.
fn narrow_int(f: f32, lo: u32, is_float: bool, bits: u32, signed: bool) -> u32 {
    var low = lo;
    if (is_float) {
        let t = trunc(f);
        if (is_nan(f)) {
            low = 0u;
        } else if (t >= 9.2233720e18) {
            low = 0xffffffffu;
        } else if (abs(t) >= 2147483648.0) {
            // i64::MIN, or a multiple of 2^8: the low bits are zero.
            low = 0u;
        } else {
            low = bitcast<u32>(i32(t));
        }
    }
    if (signed) { return bitcast<u32>(extractBits(bitcast<i32>(low), 0u, bits)); }
    return extractBits(low, 0u, bits);
}
fn src_bits(e: u32) -> vec2<u32> {
    switch code_size(SRC) {
        case 8u: { return vec2<u32>(SX[2u * e], SX[2u * e + 1u]); }
        case 2u: { return vec2<u32>((SX[e >> 1u] >> ((e & 1u) * 16u)) & 0xffffu, 0u); }
        case 1u: { return vec2<u32>(byte_at(SX[e >> 2u], e), 0u); }
        default: { return vec2<u32>(SX[e], 0u); }
    }
}
fn sat_i32(f: f32) -> u32 {
    if (is_nan(f)) { return 0u; }
    if (f >= 2147483647.0) { return 0x7fffffffu; }
    if (f <= -2147483648.0) { return 0x80000000u; }
    return bitcast<u32>(i32(f));
}
// f to an integer of `bits` (at most 32) bits, saturating, as its low word.
fn sat_narrow(f: f32, bits: u32, signed: bool) -> u32 {
    if (is_nan(f)) { return 0u; }
    if (bits == 32u) {
        if (signed) { return sat_i32(f); }
        if (f >= 4294967295.0) { return 0xffffffffu; }
        return u32(max(f, 0.0));
    }
    var lo = 0.0;
    var hi = f32((1u << bits) - 1u);
    if (signed) {
        lo = -f32(1u << (bits - 1u));
        hi = f32((1u << (bits - 1u)) - 1u);
    }
    return bitcast<u32>(i32(clamp(trunc(f), lo, hi)));
}
// f64 bits (lo, hi) to the nearest f32 (ties to even).
fn f64_to_f32(lo: u32, hi: u32) -> f32 {
    let sign = hi & 0x80000000u;
    let e = (hi >> 20u) & 0x7ffu;
    let mhi = hi & 0xfffffu;
    if (e == 0x7ffu) {
        if ((mhi | lo) != 0u) { return bitcast<f32>(sign | 0x7fc00000u); }
        return bitcast<f32>(sign | 0x7f800000u);
    }
    let ex = i32(e) - 1023 + 127;
    if (ex >= 255) { return bitcast<f32>(sign | 0x7f800000u); }
    if (ex <= 0) {
        // An f32 subnormal (or 0): its 24 top bits, scaled once (rounds there).
        if (e == 0u) { return bitcast<f32>(sign); }
        let m24 = 0x800000u | (mhi << 3u) | (lo >> 29u);
        let v = ldexp(f32(m24), i32(e) - 1023 - 23);
        return select(v, -v, sign != 0u);
    }
    var m = (mhi << 3u) | (lo >> 29u);
    let rest = lo & 0x1fffffffu;
    var exb = u32(ex);
    if (rest > 0x10000000u || (rest == 0x10000000u && (m & 1u) == 1u)) {
        m += 1u;
        if (m == 0x800000u) {
            m = 0u;
            exb += 1u;
            if (exb == 255u) { return bitcast<f32>(sign | 0x7f800000u); }
        }
    }
    return bitcast<f32>(sign | (exb << 23u) | m);
}
// f32 to f64 bits (lo, hi): exact.
fn f32_to_f64(f: f32) -> vec2<u32> {
    let u = bitcast<u32>(f);
    let sign = u & 0x80000000u;
    var e = (u >> 23u) & 0xffu;
    var m = u & 0x7fffffu;
    if (e == 0xffu) { return vec2<u32>(m << 29u, sign | 0x7ff00000u | (m >> 3u)); }
    if (e == 0u) {
        if (m == 0u) { return vec2<u32>(0u, sign); }
        // Subnormal: normalise (the leading bit becomes the implicit one).
        let p = firstLeadingBit(m);
        m = (m << (23u - p)) & 0x7fffffu;
        let e64 = u32(i32(p) - 149 + 1023);
        return vec2<u32>(m << 29u, sign | (e64 << 20u) | (m >> 3u));
    }
    let e64 = e - 127u + 1023u;
    return vec2<u32>(m << 29u, sign | (e64 << 20u) | (m >> 3u));
}
// f32 to bf16 bits, ties to even (NaN stays a quiet NaN).
fn f32_to_bf16(f: f32) -> u32 {
    let u = bitcast<u32>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) { return (u >> 16u) | 0x40u; }
    return (u + 0x7fffu + ((u >> 16u) & 1u)) >> 16u;
}
fn cast_elem(e: u32) -> vec2<u32> {
    let b = src_bits(e);
    let is_float = SRC <= 1u || SRC == 11u || SRC == 12u || SRC == 22u || is_minifloat(SRC);
    var f = 0.0;
    var lo = 0u;
    var hi = 0u;
    if (SRC == 0u) { f = bitcast<f32>(b.x); }
    if (SRC == 1u) { f = unpack2x16float(b.x).x; }
    if (SRC == 11u) { f = f64_to_f32(b.x, b.y); }
    if (SRC == 12u) { f = bitcast<f32>(b.x << 16u); }
    if (is_minifloat(SRC)) { f = mf_decode(SRC, b.x); }
    if (SRC == 22u) { f = e8m0_decode(b.x); }
    if (SRC == 4u) { lo = select(0u, 1u, b.x != 0u); }
    if (!is_float && SRC != 4u) {
        let bits = code_size(SRC) * 8u;
        if (bits == 64u) {
            lo = b.x;
            hi = b.y;
        } else if (code_signed(SRC)) {
            lo = bitcast<u32>(extractBits(bitcast<i32>(b.x), 0u, bits));
            hi = select(0u, 0xffffffffu, bitcast<i32>(lo) < 0);
        } else {
            lo = extractBits(b.x, 0u, bits);
        }
    }
    if (!is_float) {
        // Integers that fit i32 convert directly (hi·2^32 + lo would round lo away).
        let fits = hi == select(0u, 0xffffffffu, bitcast<i32>(lo) < 0);
        if (fits) {
            f = f32(bitcast<i32>(lo));
        } else if (code_signed(SRC)) {
            f = f32(bitcast<i32>(hi)) * 4294967296.0 + f32(lo);
        } else {
            f = f32(hi) * 4294967296.0 + f32(lo);
        }
    }
    switch DST {
        case 0u: { return vec2<u32>(bitcast<u32>(f), 0u); }
        case 1u: { return vec2<u32>(pack2x16float(vec2<f32>(f, 0.0)) & 0xffffu, 0u); }
        case 11u: { return f32_to_f64(f); }
        case 12u: { return vec2<u32>(f32_to_bf16(f), 0u); }
        case 4u: {
            // NaN is true; `f != 0.0` alone may be compiled as an ordered compare.
            if (is_float) { return vec2<u32>(select(0u, 1u, f != 0.0 || is_nan(f)), 0u); }
            return vec2<u32>(select(0u, 1u, (lo | hi) != 0u), 0u);
        }
        case 3u: {
            if (!is_float) { return vec2<u32>(lo, hi); }
            if (is_nan(f)) { return vec2<u32>(0u, 0u); }
            if (f >= 9.2233720e18) { return vec2<u32>(0xffffffffu, 0x7fffffffu); }
            if (f <= -9.2233720e18) { return vec2<u32>(0u, 0x80000000u); }
            let t = trunc(f);
            // Within i32 exactly; beyond, f32 values are multiples of 2^8 and split exactly.
            if (abs(t) < 2147483648.0) {
                let i = i32(t);
                return vec2<u32>(bitcast<u32>(i), select(0u, 0xffffffffu, i < 0));
            }
            let h = floor(t / 4294967296.0);
            return vec2<u32>(u32(t - h * 4294967296.0), bitcast<u32>(i32(h)));
        }
        case 10u: {
            if (!is_float) { return vec2<u32>(lo, hi); }
            if (is_nan(f) || f <= 0.0) { return vec2<u32>(0u, 0u); }
            if (f >= 1.8446744e19) { return vec2<u32>(0xffffffffu, 0xffffffffu); }
            let t = trunc(f);
            let h = floor(t / 4294967296.0);
            return vec2<u32>(u32(t - h * 4294967296.0), u32(h));
        }
        case 2u: {
            if (is_float) { return vec2<u32>(sat_i32(f), 0u); }
            return vec2<u32>(lo, 0u);
        }
        case 13u, 14u, 15u, 16u, 17u: { return vec2<u32>(mf_encode(DST, f), 0u); }
        case 18u, 19u: { return vec2<u32>(narrow_int(f, lo, is_float, 4u, DST == 18u), 0u); }
        case 20u, 21u: { return vec2<u32>(narrow_int(f, lo, is_float, 2u, DST == 20u), 0u); }
        case 22u: { return vec2<u32>(e8m0_encode(f), 0u); }
        // The narrower integers: the low bits (exact, wrapping) or f saturated.
        default: {
            if (is_float) { return vec2<u32>(sat_narrow(f, code_size(DST) * 8u, code_signed(DST)), 0u); }
            return vec2<u32>(lo, 0u);
        }
    }
}

@compute @workgroup_size(256)
fn convert(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = linear(wid, nwg, lid, WG);
    if (w >= pu(0u)) { return; }
    if (ES >= 4u) {
        let per = max(ES / 4u, 1u);
        let v = cast_elem(w / per);
        SY[w] = select(v.x, v.y, w % per == 1u);
        return;
    }
    let per = 4u / min(ES, 2u);
    let bits = min(ES, 2u) * 8u;
    var word = 0u;
    for (var j = 0u; j < per; j += 1u) {
        let e = w * per + j;
        if (e < pu(1u)) { word |= (cast_elem(e).x & ((1u << bits) - 1u)) << (j * bits); }
    }
    SY[w] = word;
}

// GatherGrad: dY rows added into an f32 accumulator (zeroed by the host) at their index,
// with a compare-and-swap loop (WGSL has no float atomics). SRC is dY's dtype code;
// P[1] dY elements, P[3] inner, P[4] indices, P[5] axis length, P[6] words per index.
@compute @workgroup_size(256)
fn gather_grad(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let e = linear(wid, nwg, lid, WG);
    if (e >= pu(1u)) { return; }
    let inner = pu(3u);
    let nidx = pu(4u);
    let dim = i32(pu(5u));
    let j = (e / inner) % nidx;
    var idx = bitcast<i32>(AUX[j * pu(6u)]);
    if (idx < 0) { idx += dim; }
    if (idx < 0 || idx >= dim) { return; }
    let outer = e / (inner * nidx);
    let o = (outer * u32(dim) + u32(idx)) * inner + e % inner;
    let b = src_bits(e);
    let v = select(bitcast<f32>(b.x), unpack2x16float(b.x).x, SRC == 1u);
    var old = atomicLoad(&ACC[o]);
    loop {
        let r = atomicCompareExchangeWeak(&ACC[o], old, bitcast<u32>(bitcast<f32>(old) + v));
        if (r.exchanged) { break; }
        old = r.old_value;
    }
}

// ScatterElements / ScatterND: SX data, SX2 updates, SY the output; a thread owns one
// output word (so 2-byte elements never race) and folds into each of its elements the
// updates that land there, in index order. AUX (i32) is the host's plan
// (`common::scatter_plan`): AUX[e] the group of element e (-1: none), group g's updates
// AUX[P[5] + q] for q in AUX[P[4] + g] .. AUX[P[4] + g + 1]. P[2] the reduction (0
// replace: the last update wins, 1 add, 2 mul, 3 max, 4 min), P[3] the dtype (0 f32,
// 1 f16, 2 i32, 3 bool: replace only).
fn scatter_fold(v: u32, u: u32) -> u32 {
    let m = pu(2u);
    if (m == 0u) { return u; }
    switch pu(3u) {
        case 0u, 1u: {
            let h = pu(3u) == 1u;
            let a = select(bitcast<f32>(v), unpack2x16float(v).x, h);
            let b = select(bitcast<f32>(u), unpack2x16float(u).x, h);
            // max/min as Python's: the element stays unless the update is strictly beyond.
            if (m == 3u) { return select(v, u, b > a); }
            if (m == 4u) { return select(v, u, b < a); }
            let r = select(a * b, a + b, m == 1u);
            return select(bitcast<u32>(r), pack2x16float(vec2<f32>(r, 0.0)) & 0xffffu, h);
        }
        default: {
            let a = bitcast<i32>(v);
            let b = bitcast<i32>(u);
            if (m == 3u) { return select(v, u, b > a); }
            if (m == 4u) { return select(v, u, b < a); }
            return bitcast<u32>(select(a * b, a + b, m == 1u));
        }
    }
}
fn scatter_elem(e: u32, v0: u32) -> u32 {
    let g = bitcast<i32>(AUX[e]);
    if (g < 0) { return v0; }
    var v = v0;
    let lo = bitcast<i32>(AUX[pu(4u) + u32(g)]);
    let hi = bitcast<i32>(AUX[pu(4u) + u32(g) + 1u]);
    for (var q = lo; q < hi; q += 1) {
        v = scatter_fold(v, elem_x2(u32(bitcast<i32>(AUX[pu(5u) + u32(q)]))).x);
    }
    return v;
}

@compute @workgroup_size(256)
fn scatter(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = linear(wid, nwg, lid, WG);
    if (w >= pu(0u)) { return; }
    if (ES >= 4u) {
        SY[w] = scatter_elem(w, SX[w]);
        return;
    }
    // Reached for ES < 4 only (min keeps the constant shifts of other ES valid).
    let per = 4u / min(ES, 2u);
    let bits = min(ES, 2u) * 8u;
    let mask = (1u << bits) - 1u;
    var word = SX[w];
    for (var j = 0u; j < per; j += 1u) {
        let e = w * per + j;
        if (e < pu(1u)) {
            let sh = j * bits;
            let v = scatter_elem(e, (word >> sh) & mask);
            word = (word & ~(mask << sh)) | ((v & mask) << sh);
        }
    }
    SY[w] = word;
}

// The position (per axis) of element i within its plane's image (the window at
// P[3..30] as Im2Col's).
fn image_pos(i: u32) -> array<i32, 3> {
    var r = i % pu(28u);
    var pos: array<i32, 3>;
    for (var d = 2u; d < 3u; d -= 1u) {
        pos[d] = i32(r % pu(3u + d));
        r = r / pu(3u + d);
    }
    return pos;
}

// The output position o whose window reads image position `pos` at kernel offset j (per
// axis o = (p + begin - j·dil) / stride where that divides and lies in [0, out)), or -1.
fn reader(pos: array<i32, 3>, j: u32) -> i32 {
    var jr = j;
    var o = 0u;
    var ost = 1u;
    for (var d = 2u; d < 3u; d -= 1u) {
        let jd = jr % pu(9u + d);
        jr = jr / pu(9u + d);
        let q = pos[d] + pi(18u + d) - i32(jd * pu(15u + d));
        let s = pi(12u + d);
        if (q < 0 || q % s != 0 || q / s >= pi(6u + d)) { return -1; }
        o += u32(q / s) * ost;
        ost *= pu(6u + d);
    }
    return i32(o);
}

// Element e of SX (f32, or f16 where SRC is 1) as f32.
fn src_f32(e: u32) -> f32 {
    let b = src_bits(e);
    return select(bitcast<f32>(b.x), unpack2x16float(b.x).x, SRC == 1u);
}

// Col2Im and MaxPoolGrad's second step: image element i sums, in kernel-offset order and
// in f32, what the windows that read it hold for it. Col2Im (P[2] = 0): their column
// entries. MaxPoolGrad (P[2] = 1): dY (SX) of those windows whose argmax (AUX, from
// max_pool_arg) it is. SRC is the dtype code (0 f32, 1 f16), P[1] the elements, the window
// at P[3..30] as Im2Col's; a thread owns one output word (two f16).
fn window_sum_elem(i: u32) -> f32 {
    let k = pu(26u);
    let l = pu(27u);
    let argmax = pu(2u) == 1u;
    let plane = i / pu(28u);
    let me = bitcast<i32>(i % pu(28u));
    let pos = image_pos(i);
    var acc = 0.0;
    for (var j = 0u; j < k; j += 1u) {
        let o = reader(pos, j);
        if (o < 0) { continue; }
        let w = plane * l + u32(o);
        if (!argmax) {
            acc += src_f32((plane * k + j) * l + u32(o));
        } else if (bitcast<i32>(AUX[w]) == me) {
            acc += src_f32(w);
        }
    }
    return acc;
}

@compute @workgroup_size(256)
fn window_sum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = linear(wid, nwg, lid, WG);
    if (w >= pu(0u)) { return; }
    if (SRC == 1u) {
        let lo = window_sum_elem(2u * w);
        var hi = 0.0;
        if (2u * w + 1u < pu(1u)) { hi = window_sum_elem(2u * w + 1u); }
        SY[w] = pack2x16float(vec2<f32>(lo, hi));
    } else {
        SY[w] = bitcast<u32>(window_sum_elem(w));
    }
}

// MaxPool over the window of output i (the window at P[3..30] as Im2Col's; SRC the dtype
// code, 0 f32 or 1 f16): x the maximum as f32 bits, y the plane offset of its first
// position in window order (the first NaN wins), as i32 bits, -1 where the window reads
// none of the image.
fn pool_arg(i: u32) -> vec2<u32> {
    let l = pu(27u);
    let plane = i / l;
    var best = 0.0;
    var at = -1;
    for (var j = 0u; j < pu(26u); j += 1u) {
        var o = i % l;
        var jr = j;
        var off = 0;
        var st = 1;
        var inside = true;
        for (var d = 2u; d < 3u; d -= 1u) {
            let jd = jr % pu(9u + d);
            let od = o % pu(6u + d);
            jr = jr / pu(9u + d);
            o = o / pu(6u + d);
            let p = i32(od * pu(12u + d) + jd * pu(15u + d)) - pi(18u + d);
            let size = pi(3u + d);
            if (p < 0 || p >= size) { inside = false; }
            off += p * st;
            st *= size;
        }
        if (!inside) { continue; }
        let v = src_f32(plane * pu(28u) + u32(off));
        if (at < 0 || v > best || (is_nan(v) && !is_nan(best))) {
            best = v;
            at = off;
        }
    }
    return vec2<u32>(bitcast<u32>(best), bitcast<u32>(at));
}

// Output i's maximum in its dtype's bits (f16 in the low half), -inf for none.
fn pool_bits(i: u32) -> u32 {
    let r = pool_arg(i);
    if (SRC == 1u) {
        return select(pack2x16float(vec2<f32>(bitcast<f32>(r.x), 0.0)) & 0xffffu, 0xfc00u, bitcast<i32>(r.y) < 0);
    }
    return select(r.x, 0xff800000u, bitcast<i32>(r.y) < 0);
}

// MaxPool: a thread per output word (two f16).
@compute @workgroup_size(256)
fn max_pool(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = linear(wid, nwg, lid, WG);
    if (w >= pu(0u)) { return; }
    if (SRC == 1u) {
        var word = pool_bits(2u * w);
        if (2u * w + 1u < pu(1u)) { word |= pool_bits(2u * w + 1u) << 16u; }
        SY[w] = word;
    } else {
        SY[w] = pool_bits(w);
    }
}

// MaxPoolGrad's first step: each window's argmax (`pool_arg`'s y) into SY, one a thread.
@compute @workgroup_size(256)
fn max_pool_arg(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = linear(wid, nwg, lid, WG);
    if (w >= pu(0u)) { return; }
    SY[w] = pool_arg(w).y;
}

