// Attention and VarlenAttention, forward and backward: tiled flash attention. Scores are
// never stored beyond one tile (memory O(S·D)); the backward recomputes probabilities from
// the forward's logsumexp, dQ and dK/dV in separate passes so no two threads write one
// element (deterministic, no atomics).
//
// A workgroup owns BQ (= 64) consecutive query positions (forward, dQ) or key positions
// (dK/dV) of one problem: a (batch, head) of Attention or a head of VarlenAttention,
// whose packed positions may span several sequences ("segments", handled in turn). It
// walks the other side in tiles of BK rows staged in workgroup memory, one thread per
// row of its own side with that row's head vectors in registers as HD4 vec4s (loops of
// constant length, so a driver can unroll them and keep the arrays in registers); the
// forward keeps a tile's scores in workgroup memory and rescales its running softmax once
// per tile. Causal problems stop at the tile that holds the block's last visible key
// (upper-left for Attention, bottom-right for VarlenAttention, as the CPU; the backward
// starts at the first query that sees the block's first key); grouped-query heads share
// their K/V head. BK and HD4 (= ceil(max(D, Dv) / 4)) come from the host.
//
// P: 0 Hq, 1 Hkv, 2 Sq (Tq for varlen), 3 Skv (Tk), 4 D, 5 Dv, 6-9 mask strides over
// [B, Hq, Sq, Skv], 10 rows, 11 sequences, 12 scale, 13 varlen, 14 causal, 15 mask kind
// (0 none, 1 bool, 2 additive), 16 dMask wanted, 17-19 / 20-22 / 23-25 row strides of
// the query side, the key side and the statistics (see `row_at`), 26 Attention's 3-D
// form. cu_seqlens are i32 words IW apart (2 for i64).

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

const BQ: u32 = 64u;
const KT: u32 = BK * HD4;

var<workgroup> Ts: array<vec4<f32>, KT>;  // K (forward, dQ) or Q (dK/dV) tile, [row][HD4]
var<workgroup> Us: array<vec4<f32>, KT>;  // V or dY tile
var<workgroup> Ss: array<f32, BK * BQ>;   // forward: the tile's scores, [key][thread]
var<workgroup> Ls: array<f32, BK>;        // dK/dV: LSE and delta of the query tile
var<workgroup> Ds: array<f32, BK>;

fn ninf() -> f32 { return bitcast<f32>(0xff800000u); }
fn cq(i: u32) -> i32 { return CQ[i * IW]; }
fn ck(i: u32) -> i32 { return CK[i * IW]; }

// The sequence of packed position t on the query (side 0) or key side: the largest b
// with cu[b] <= t.
fn seq_of(side: u32, t: i32) -> u32 {
    var lo = 0u;
    var hi = pu(11u) - 1u;
    while (lo < hi) {
        let mid = (lo + hi + 1u) / 2u;
        var c = ck(mid);
        if (side == 0u) { c = cq(mid); }
        if (c <= t) { lo = mid; } else { hi = mid - 1u; }
    }
    return lo;
}

// One problem's sequence: queries at positions q0..q1, keys k0..k1 (positions of the
// packed or per-problem layout), query i sees key j iff j <= i + shift when causal.
struct Seg { q0: i32, q1: i32, k0: i32, k1: i32, shift: i32 }

fn segment(b: u32) -> Seg {
    if (pu(13u) == 0u) { return Seg(0, i32(pu(2u)), 0, i32(pu(3u)), 0); }
    let q0 = cq(b);
    let q1 = cq(b + 1u);
    let k0 = ck(b);
    let k1 = ck(b + 1u);
    return Seg(q0, q1, k0, k1, (k1 - k0) - (q1 - q0));
}

// The segments a block of positions p0..p1 (p1 > p0) on one side spans.
fn segs_of(side: u32, p0: u32, p1: u32) -> vec2<u32> {
    if (pu(13u) == 0u) { return vec2<u32>(0u, 0u); }
    return vec2<u32>(seq_of(side, i32(p0)), seq_of(side, i32(p1) - 1));
}

// The row (head vector) of position p of problem `prob` = batch·heads + head, through
// the strides over (batch, head, position) at P[at..at+3]: of the query side (Q, Y, dY,
// dQ), the key side (K, V, dK, dV) or the statistics (LSE, delta, dMask). They read
// [B, H, S, D] and Attention's 3-D [B, S, H·D] in place; a VarlenAttention problem is
// one head of the packed [T, H, D].
fn row_at(at: u32, prob: u32, p: u32, heads: u32) -> u32 {
    return (prob / heads) * pu(at) + (prob % heads) * pu(at + 1u) + p * pu(at + 2u);
}
fn qrow(prob: u32, p: u32) -> u32 { return row_at(17u, prob, p, pu(0u)); }
fn krow(prob: u32, p: u32) -> u32 { return row_at(20u, prob, p, pu(1u)); }
fn srow(prob: u32, p: u32) -> u32 { return row_at(23u, prob, p, pu(0u)); }

// The score of a key after the mask (P[15] read once per kernel, outside the key loops).
fn masked(kind: u32, off: i32, s: f32) -> f32 {
    switch kind {
        case 1u: { return select(ninf(), s, byte_at(MB[u32(off) >> 2u], u32(off)) != 0u); }
        case 2u: { return s + f32(MT[off]); }
        default: { return s; }
    }
}

fn load_row(x: ptr<function, array<vec4<f32>, HD4>>, which: u32, r: u32, n: u32, scale: f32) {
    for (var t = 0u; t < HD4; t += 1u) {
        var v = vec4<f32>(0.0);
        for (var c = 0u; c < 4u; c += 1u) {
            let e = t * 4u + c;
            if (e < n) {
                switch which {
                    case 0u: { v[c] = f32(Q[r * n + e]); }
                    case 1u: { v[c] = f32(DY[r * n + e]); }
                    case 2u: { v[c] = f32(K[r * n + e]); }
                    default: { v[c] = f32(V[r * n + e]); }
                }
            }
        }
        (*x)[t] = v * scale;
    }
}

// Stages rows kt.. (key positions, or query positions for which = 1) of a segment into
// Ts/Us: K and V, or Q and dY; rows past `count` are zero.
fn stage(which: u32, prob: u32, base: i32, kt: i32, count: i32, lid: u32) {
    let d = pu(4u);
    let dv = pu(5u);
    for (var e = lid; e < KT; e += BQ) {
        let j = i32(e / HD4);
        let t = e % HD4;
        var a = vec4<f32>(0.0);
        var b = vec4<f32>(0.0);
        if (kt + j < count) {
            var r = qrow(prob, u32(base + kt + j));
            if (which == 0u) { r = krow(prob, u32(base + kt + j)); }
            for (var c = 0u; c < 4u; c += 1u) {
                let x = t * 4u + c;
                if (which == 0u) {
                    if (x < d) { a[c] = f32(K[r * d + x]); }
                    if (x < dv) { b[c] = f32(V[r * dv + x]); }
                } else {
                    if (x < d) { a[c] = f32(Q[r * d + x]); }
                    if (x < dv) { b[c] = f32(DY[r * dv + x]); }
                }
            }
        }
        Ts[e] = a;
        Us[e] = b;
    }
}

fn dot4(a: ptr<function, array<vec4<f32>, HD4>>, off: u32) -> f32 {
    var s = vec4<f32>(0.0);
    for (var t = 0u; t < HD4; t += 1u) { s += (*a)[t] * Ts[off + t]; }
    return s.x + s.y + s.z + s.w;
}
fn dot4u(a: ptr<function, array<vec4<f32>, HD4>>, off: u32) -> f32 {
    var s = vec4<f32>(0.0);
    for (var t = 0u; t < HD4; t += 1u) { s += (*a)[t] * Us[off + t]; }
    return s.x + s.y + s.z + s.w;
}

// The query-side context of a workgroup: problem, its kv problem, mask offset of row i = 0.
struct QCtx { prob: u32, kprob: u32, moff: i32 }

fn qctx(prob: u32) -> QCtx {
    let hq = pu(0u);
    let hkv = pu(1u);
    let grp = hq / hkv;
    if (pu(13u) != 0u) { return QCtx(prob, prob / grp, 0); }
    let b = prob / hq;
    let h = prob % hq;
    return QCtx(prob, b * hkv + h / grp, i32(b) * pi(6u) + i32(h) * pi(7u));
}

@compute @workgroup_size(64)
fn attn_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let hq = pu(0u);
    let hkv = pu(1u);
    let nq = pu(2u);
    let nk = pu(3u);
    let d = pu(4u);
    let dv = pu(5u);
    let mk = pu(15u);
    let ms3 = pi(9u);
    let p0 = wid.x * BQ;
    let p1 = min(p0 + BQ, nq);
    let pos = p0 + lid;
    let cx = qctx(wid.y);
    let r = qrow(cx.prob, pos);
    let rs = srow(cx.prob, pos);
    var qv: array<vec4<f32>, HD4>;
    var acc: array<vec4<f32>, HD4>;
    for (var t = 0u; t < HD4; t += 1u) { acc[t] = vec4<f32>(0.0); }
    if (pos < nq) { load_row(&qv, 0u, r, d, pf(12u)); }
    var m = ninf();
    var l = 0.0;
    let sg = segs_of(0u, p0, p1);
    for (var b = sg.x; b <= sg.y; b += 1u) {
        let s = segment(b);
        let nkeys = s.k1 - s.k0;
        let last = min(i32(p1), s.q1) - 1 - s.q0; // the block's last query of this segment
        var klim = nkeys;
        if (pu(14u) != 0u) { klim = clamp(last + 1 + s.shift, 0, nkeys); }
        let mine = i32(pos) >= s.q0 && i32(pos) < s.q1 && pos < nq;
        let i = i32(pos) - s.q0;
        var lim = nkeys; // keys row i sees
        if (pu(14u) != 0u) { lim = clamp(i + 1 + s.shift, 0, nkeys); }
        let moff = cx.moff + i * pi(8u);
        for (var kt = 0; kt < klim; kt += i32(BK)) {
            stage(0u, cx.kprob, s.k0, kt, nkeys, lid);
            workgroupBarrier();
            let jl = min(lim - kt, i32(BK));
            if (mine && jl > 0) {
                var mt = ninf();
                for (var j = 0; j < jl; j += 1) {
                    let sc = masked(mk, moff + (kt + j) * ms3, dot4(&qv, u32(j) * HD4));
                    Ss[u32(j) * BQ + lid] = sc;
                    mt = max(mt, sc);
                }
                if (mt > ninf()) { // else the tile is wholly masked for this row
                    let mn = max(m, mt);
                    let alpha = exp(m - mn);
                    l *= alpha;
                    for (var t = 0u; t < HD4; t += 1u) { acc[t] *= alpha; }
                    for (var j = 0; j < jl; j += 1) {
                        let p = exp(Ss[u32(j) * BQ + lid] - mn);
                        l += p;
                        let o = u32(j) * HD4;
                        for (var t = 0u; t < HD4; t += 1u) { acc[t] += p * Us[o + t]; }
                    }
                    m = mn;
                }
            }
            workgroupBarrier();
        }
    }
    if (pos >= nq) { return; }
    // A row that sees no key gives 0 and LSE −∞.
    let inv = select(0.0, 1.0 / l, l > 0.0);
    for (var t = 0u; t < HD4; t += 1u) {
        for (var c = 0u; c < 4u; c += 1u) {
            let e = t * 4u + c;
            if (e < dv) { Y[r * dv + e] = T(acc[t][c] * inv); }
        }
    }
    LSE[rs] = select(ninf(), m + log(l), l > 0.0);
}

// dQ_r = scale · Σ_j dS_rj K_j with dS = P∘(dY·Vᵀ − delta), from the forward's LSE and
// attn_delta's delta; dMask = dS where P[16] says it is wanted.
@compute @workgroup_size(64)
fn attn_dq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let hq = pu(0u);
    let hkv = pu(1u);
    let nq = pu(2u);
    let nk = pu(3u);
    let d = pu(4u);
    let dv = pu(5u);
    let scale = pf(12u);
    let mk = pu(15u);
    let ms3 = pi(9u);
    let p0 = wid.x * BQ;
    let p1 = min(p0 + BQ, nq);
    let pos = p0 + lid;
    let cx = qctx(wid.y);
    let r = qrow(cx.prob, pos);
    let rs = srow(cx.prob, pos);
    var qv: array<vec4<f32>, HD4>;
    var dy: array<vec4<f32>, HD4>;
    var dq: array<vec4<f32>, HD4>;
    for (var t = 0u; t < HD4; t += 1u) { dq[t] = vec4<f32>(0.0); }
    var L = ninf();
    var dl = 0.0;
    if (pos < nq) {
        load_row(&qv, 0u, r, d, scale);
        load_row(&dy, 1u, r, dv, 1.0);
        L = LSE[rs];
        dl = DELTA[rs];
    }
    let sg = segs_of(0u, p0, p1);
    for (var b = sg.x; b <= sg.y; b += 1u) {
        let s = segment(b);
        let nkeys = s.k1 - s.k0;
        let last = min(i32(p1), s.q1) - 1 - s.q0;
        var klim = nkeys;
        if (pu(14u) != 0u) { klim = clamp(last + 1 + s.shift, 0, nkeys); }
        let mine = i32(pos) >= s.q0 && i32(pos) < s.q1 && pos < nq && L > ninf();
        let i = i32(pos) - s.q0;
        var lim = nkeys;
        if (pu(14u) != 0u) { lim = clamp(i + 1 + s.shift, 0, nkeys); }
        let moff = cx.moff + i * pi(8u);
        for (var kt = 0; kt < klim; kt += i32(BK)) {
            stage(0u, cx.kprob, s.k0, kt, nkeys, lid);
            workgroupBarrier();
            let jl = min(lim - kt, i32(BK));
            if (mine) {
                for (var j = 0; j < jl; j += 1) {
                    let o = u32(j) * HD4;
                    let p = exp(masked(mk, moff + (kt + j) * ms3, dot4(&qv, o)) - L);
                    if (p == 0.0) { continue; }
                    let ds = p * (dot4u(&dy, o) - dl);
                    for (var t = 0u; t < HD4; t += 1u) { dq[t] += ds * Ts[o + t]; }
                    if (pu(16u) != 0u) { DM[rs * nk + u32(kt + j)] = T(ds); }
                }
            }
            workgroupBarrier();
        }
    }
    if (pos >= nq) { return; }
    for (var t = 0u; t < HD4; t += 1u) {
        for (var c = 0u; c < 4u; c += 1u) {
            let e = t * 4u + c;
            if (e < d) { DQ[r * d + e] = T(dq[t][c] * scale); }
        }
    }
}

// delta_r = dY_r · Y_r, written through the LSE binding into a scratch buffer; r counts
// statistics rows, whose dY and Y rows differ in the 3-D form.
@compute @workgroup_size(64)
fn attn_delta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = linear(wid, nwg, lid, BQ);
    if (r >= pu(10u)) { return; }
    let dv = pu(5u);
    var x = r;
    if (pu(26u) != 0u) { x = qrow(r / pu(2u), r % pu(2u)); }
    var s = 0.0;
    for (var t = 0u; t < dv; t += 1u) { s += f32(DY[x * dv + t]) * f32(Y[x * dv + t]); }
    LSE[r] = s;
}

// dK_j = scale · Σ_{heads of its group, rows i seeing j} dS_ij Q_i, dV_j = Σ P_ij dY_i,
// from the forward's LSE and delta as in attn_dq. The workgroup owns BQ key positions of
// one K/V problem and walks query tiles of each head of its group.
@compute @workgroup_size(64)
fn attn_dkv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let hq = pu(0u);
    let hkv = pu(1u);
    let grp = hq / hkv;
    let nq = pu(2u);
    let nk = pu(3u);
    let d = pu(4u);
    let dv = pu(5u);
    let scale = pf(12u);
    let mk = pu(15u);
    let ms2 = pi(8u);
    let kprob = wid.y;
    let p0 = wid.x * BQ;
    let p1 = min(p0 + BQ, nk);
    let pos = p0 + lid;
    let kr = krow(kprob, pos);
    var kv: array<vec4<f32>, HD4>;
    var vv: array<vec4<f32>, HD4>;
    var dk: array<vec4<f32>, HD4>;
    var dvv: array<vec4<f32>, HD4>;
    for (var t = 0u; t < HD4; t += 1u) { dk[t] = vec4<f32>(0.0); dvv[t] = vec4<f32>(0.0); }
    if (pos < nk) {
        load_row(&kv, 2u, kr, d, scale);
        load_row(&vv, 3u, kr, dv, 1.0);
    }
    // Attention: kprob = b·Hkv + hk; varlen: kprob = hk.
    var b0 = 0u;
    var hk = kprob;
    if (pu(13u) == 0u) { b0 = kprob / hkv; hk = kprob % hkv; }
    let sg = segs_of(1u, p0, p1);
    for (var b = sg.x; b <= sg.y; b += 1u) {
        let s = segment(b);
        let nqs = s.q1 - s.q0;
        let first = max(i32(p0), s.k0) - s.k0; // the block's first key of this segment
        var i0 = 0; // the first query that sees it
        if (pu(14u) != 0u) { i0 = clamp(first - s.shift, 0, nqs); }
        let mine = i32(pos) >= s.k0 && i32(pos) < s.k1 && pos < nk;
        let j = i32(pos) - s.k0;
        for (var hh = 0u; hh < grp; hh += 1u) {
            let h = hk * grp + hh;
            var qprob = h;
            var moff = 0;
            if (pu(13u) == 0u) {
                qprob = b0 * hq + h;
                moff = i32(b0) * pi(6u) + i32(h) * pi(7u) + j * pi(9u);
            }
            for (var it = i0; it < nqs; it += i32(BK)) {
                stage(1u, qprob, s.q0, it, nqs, lid);
                if (lid < BK) {
                    var lv = ninf();
                    var dl = 0.0;
                    if (it + i32(lid) < nqs) {
                        let r = srow(qprob, u32(s.q0 + it + i32(lid)));
                        lv = LSE[r];
                        dl = DELTA[r];
                    }
                    Ls[lid] = lv;
                    Ds[lid] = dl;
                }
                workgroupBarrier();
                if (mine) {
                    let il = min(nqs - it, i32(BK));
                    // Query i sees key j iff j <= i + shift.
                    var ia = 0;
                    if (pu(14u) != 0u) { ia = clamp(j - s.shift - it, 0, il); }
                    for (var ii = ia; ii < il; ii += 1) {
                        let Lq = Ls[ii];
                        if (Lq == ninf()) { continue; }
                        let o = u32(ii) * HD4;
                        let p = exp(masked(mk, moff + (it + ii) * ms2, dot4(&kv, o)) - Lq);
                        if (p == 0.0) { continue; }
                        let ds = p * (dot4u(&vv, o) - Ds[ii]);
                        for (var t = 0u; t < HD4; t += 1u) {
                            dvv[t] += p * Us[o + t];
                            dk[t] += ds * Ts[o + t];
                        }
                    }
                }
                workgroupBarrier();
            }
        }
    }
    if (pos >= nk) { return; }
    for (var t = 0u; t < HD4; t += 1u) {
        for (var c = 0u; c < 4u; c += 1u) {
            let e = t * 4u + c;
            if (e < d) { DK[kr * d + e] = T(dk[t][c] * scale); }
            if (e < dv) { DV[kr * dv + e] = T(dvv[t][c]); }
        }
    }
}
