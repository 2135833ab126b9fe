// Attention and VarlenAttention, forward and backward, flash-style: scores are made one
// key at a time with an online softmax and never stored (memory O(S·D)); the backward
// recomputes probabilities from the forward's logsumexp, dQ and dK/dV in separate passes
// so no two threads write one element (deterministic, no atomics). Causal rows stop at
// their last visible key (upper-left for Attention, bottom-right for VarlenAttention, as
// the CPU); grouped-query heads share their K/V head.
//
// One thread per query row (forward, dQ) or key row (dK/dV), the head vectors in
// registers of HD (a pipeline constant ≥ D, Dv) elements.
// P: 0 Hq, 1 Hkv, 2 Sq, 3 Skv, 4 D, 5 Dv, 6-9 mask strides over [B, Hq, Sq, Skv],
// 10 rows, 11 sequences, 12 scale, 13 varlen, 14 causal, 15 mask kind (0 none, 1 bool,
// 2 additive). cu_seqlens are i32 words IW apart (2 for i64).

@group(0) @binding(1) var<storage, read> Q: array<T>;
@group(0) @binding(2) var<storage, read> K: array<T>;
@group(0) @binding(3) var<storage, read> V: array<T>;
@group(0) @binding(4) var<storage, read> MB: array<u32>;
@group(0) @binding(5) var<storage, read> MT: array<T>;
@group(0) @binding(6) var<storage, read> CQ: array<i32>;
@group(0) @binding(7) var<storage, read> CK: array<i32>;
@group(0) @binding(8) var<storage, read_write> Y: array<T>;
@group(0) @binding(9) var<storage, read_write> LSE: array<f32>;
@group(0) @binding(10) var<storage, read> DY: array<T>;
@group(0) @binding(11) var<storage, read> DELTA: array<f32>;
@group(0) @binding(12) var<storage, read_write> DQ: array<T>;
@group(0) @binding(13) var<storage, read_write> DK: array<T>;
@group(0) @binding(14) var<storage, read_write> DV: array<T>;
@group(0) @binding(15) var<storage, read_write> DM: array<T>;

const WG: u32 = 64u;

fn ninf() -> f32 { return bitcast<f32>(0xff800000u); }
fn cq(i: u32) -> i32 { return CQ[i * IW]; }
fn ck(i: u32) -> i32 { return CK[i * IW]; }

// The sequence of packed token t: the largest b with cu[b] <= t.
fn seq_of_q(t: i32) -> u32 {
    var lo = 0u;
    var hi = pu(11u) - 1u;
    while (lo < hi) {
        let mid = (lo + hi + 1u) / 2u;
        if (cq(mid) <= t) { lo = mid; } else { hi = mid - 1u; }
    }
    return lo;
}
fn seq_of_k(t: i32) -> u32 {
    var lo = 0u;
    var hi = pu(11u) - 1u;
    while (lo < hi) {
        let mid = (lo + hi + 1u) / 2u;
        if (ck(mid) <= t) { lo = mid; } else { hi = mid - 1u; }
    }
    return lo;
}

// Where query row r's problem lies: x = first key row, y = key row stride,
// z = keys it sees, w = mask offset.
fn locate_q(r: u32) -> vec4<i32> {
    let hq = pu(0u);
    let hkv = pu(1u);
    let grp = hq / hkv;
    var k0 = 0;
    var ks = 1;
    var nk = 0;
    var i = 0;
    var shift = 0;
    var moff = 0;
    if (pu(13u) != 0u) {
        let t = i32(r / hq);
        let h = r % hq;
        let b = seq_of_q(t);
        let lq = cq(b + 1u) - cq(b);
        nk = ck(b + 1u) - ck(b);
        i = t - cq(b);
        k0 = ck(b) * i32(hkv) + i32(h / grp);
        ks = i32(hkv);
        shift = nk - lq;
    } else {
        let sq = pu(2u);
        let b = r / (hq * sq);
        let h = (r / sq) % hq;
        i = i32(r % sq);
        nk = i32(pu(3u));
        k0 = i32((b * hkv + h / grp) * pu(3u));
        moff = i32(b) * pi(6u) + i32(h) * pi(7u) + i * pi(8u);
    }
    var limit = nk;
    if (pu(14u) != 0u) { limit = clamp(i + 1 + shift, 0, nk); }
    return vec4<i32>(k0, ks, limit, moff);
}

fn masked(off: i32, s: f32) -> f32 {
    switch pu(15u) {
        case 1u: { return select(ninf(), s, byte_at(MB[u32(off) >> 2u], u32(off)) != 0u); }
        case 2u: { return s + f32(MT[off]); }
        default: { return s; }
    }
}

@compute @workgroup_size(64)
fn attn_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = linear(wid, nwg, lid, WG);
    if (r >= pu(10u)) { return; }
    let d = pu(4u);
    let dv = pu(5u);
    let q = locate_q(r);
    var qv: array<f32, HD>;
    var acc: array<f32, HD>;
    let scale = pf(12u);
    for (var t = 0u; t < d; t += 1u) { qv[t] = f32(Q[r * d + t]) * scale; }
    for (var t = 0u; t < dv; t += 1u) { acc[t] = 0.0; }
    var m = ninf();
    var l = 0.0;
    for (var j = 0; j < q.z; j += 1) {
        let kr = u32(q.x + j * q.y);
        var s = 0.0;
        for (var t = 0u; t < d; t += 1u) { s += qv[t] * f32(K[kr * d + t]); }
        s = masked(q.w + j * pi(9u), s);
        if (s == ninf()) { continue; } // masked out: nothing flows through it
        let mn = max(m, s);
        let alpha = exp(m - mn);
        let p = exp(s - mn);
        l = l * alpha + p;
        for (var t = 0u; t < dv; t += 1u) { acc[t] = acc[t] * alpha + p * f32(V[kr * dv + t]); }
        m = mn;
    }
    // A row that sees no key gives 0 and LSE −∞.
    let inv = select(0.0, 1.0 / l, l > 0.0);
    for (var t = 0u; t < dv; t += 1u) { Y[r * dv + t] = T(acc[t] * inv); }
    LSE[r] = select(ninf(), m + log(l), l > 0.0);
}

// dQ_r = scale · Σ_j dS_rj K_j with dS = P∘(dY·Vᵀ − delta), from the forward's LSE and
// attn_delta's delta; dMask = dS where P[16] says it is wanted.
@compute @workgroup_size(64)
fn attn_dq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = linear(wid, nwg, lid, WG);
    if (r >= pu(10u)) { return; }
    let d = pu(4u);
    let dv = pu(5u);
    let q = locate_q(r);
    var qv: array<f32, HD>;
    var dy: array<f32, HD>;
    var dq: array<f32, HD>;
    let scale = pf(12u);
    for (var t = 0u; t < d; t += 1u) { qv[t] = f32(Q[r * d + t]) * scale; dq[t] = 0.0; }
    for (var t = 0u; t < dv; t += 1u) { dy[t] = f32(DY[r * dv + t]); }
    let L = LSE[r];
    let dl = DELTA[r];
    var limit = q.z;
    if (L == ninf()) { limit = 0; }
    let skv = pu(3u);
    for (var j = 0; j < limit; j += 1) {
        let kr = u32(q.x + j * q.y);
        var s = 0.0;
        for (var t = 0u; t < d; t += 1u) { s += qv[t] * f32(K[kr * d + t]); }
        let p = exp(masked(q.w + j * pi(9u), s) - L);
        if (p == 0.0) { continue; }
        var dp = 0.0;
        for (var t = 0u; t < dv; t += 1u) { dp += dy[t] * f32(V[kr * dv + t]); }
        let ds = p * (dp - dl);
        for (var t = 0u; t < d; t += 1u) { dq[t] += ds * f32(K[kr * d + t]); }
        if (pu(16u) != 0u) { DM[r * skv + u32(j)] = T(ds); }
    }
    for (var t = 0u; t < d; t += 1u) { DQ[r * d + t] = T(dq[t] * scale); }
}

// delta_r = dY_r · Y_r, written through the LSE binding into a scratch buffer.
@compute @workgroup_size(64)
fn attn_delta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = linear(wid, nwg, lid, WG);
    if (r >= pu(10u)) { return; }
    let dv = pu(5u);
    var s = 0.0;
    for (var t = 0u; t < dv; t += 1u) { s += f32(DY[r * dv + t]) * f32(Y[r * dv + t]); }
    LSE[r] = s;
}

// dK_j = Σ_{heads of its group, rows i seeing j} dS_ij · scale·Q_i, dV_j = Σ P_ij dY_i,
// from the forward's LSE and delta as in attn_dq.
@compute @workgroup_size(64)
fn attn_dkv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let kr = linear(wid, nwg, lid, WG);
    if (kr >= pu(10u)) { return; }
    let hq = pu(0u);
    let hkv = pu(1u);
    let grp = hq / hkv;
    let d = pu(4u);
    let dv = pu(5u);
    let scale = pf(12u);
    var hk = 0u;
    var j = 0;
    var lq = 0;
    var q0 = 0u;
    var qstride = 1u;
    var qhead = 1u;
    var b = 0u;
    var shift = 0;
    if (pu(13u) != 0u) {
        let u = i32(kr / hkv);
        hk = kr % hkv;
        b = seq_of_k(u);
        j = u - ck(b);
        lq = cq(b + 1u) - cq(b);
        shift = (ck(b + 1u) - ck(b)) - lq;
        q0 = u32(cq(b)) * hq;
        qstride = hq;
    } else {
        let skv = pu(3u);
        b = kr / (hkv * skv);
        hk = (kr / skv) % hkv;
        j = i32(kr % skv);
        lq = i32(pu(2u));
        q0 = b * hq * pu(2u);
        qhead = pu(2u);
    }
    var kv: array<f32, HD>;
    var vv: array<f32, HD>;
    var dk: array<f32, HD>;
    var dvv: array<f32, HD>;
    for (var t = 0u; t < d; t += 1u) { kv[t] = f32(K[kr * d + t]); dk[t] = 0.0; }
    for (var t = 0u; t < dv; t += 1u) { vv[t] = f32(V[kr * dv + t]); dvv[t] = 0.0; }
    // Query i sees key j iff j <= i + shift.
    var i0 = 0;
    if (pu(14u) != 0u) { i0 = max(j - shift, 0); }
    for (var hh = 0u; hh < grp; hh += 1u) {
        let h = hk * grp + hh;
        for (var i = i0; i < lq; i += 1) {
            let r = q0 + h * qhead + u32(i) * qstride;
            let L = LSE[r];
            if (L == ninf()) { continue; }
            var s = 0.0;
            for (var t = 0u; t < d; t += 1u) { s += kv[t] * f32(Q[r * d + t]); }
            var moff = 0;
            if (pu(13u) == 0u) { moff = i32(b) * pi(6u) + i32(h) * pi(7u) + i * pi(8u) + j * pi(9u); }
            let p = exp(masked(moff, s * scale) - L);
            if (p == 0.0) { continue; }
            var dp = 0.0;
            for (var t = 0u; t < dv; t += 1u) { dp += vv[t] * f32(DY[r * dv + t]); }
            let ds = p * (dp - DELTA[r]);
            for (var t = 0u; t < dv; t += 1u) { dvv[t] += p * f32(DY[r * dv + t]); }
            for (var t = 0u; t < d; t += 1u) { dk[t] += ds * f32(Q[r * d + t]) * scale; }
        }
    }
    for (var t = 0u; t < d; t += 1u) { DK[kr * d + t] = T(dk[t]); }
    for (var t = 0u; t < dv; t += 1u) { DV[kr * dv + t] = T(dvv[t]); }
}
