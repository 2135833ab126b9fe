// Row-wise family: ReduceSum/Mean/Max/Prod, ArgMax/ArgMin, TopK, Softmax/LogSoftmax and
// their gradient, LayerNormalization forward and backward, SoftmaxCrossEntropyLoss and its
// gradient. One workgroup of 256 threads per row, statistics in f32. The workgroup-wide
// wg_sum / wg_max / wg_prod come from rows_subgroup.wgsl when the device offers
// subgroups, else from rows_tree.wgsl (the host puts one of them in the kernel's defs).

@group(0) @binding(1) var<storage, read> X0: array<T>;
@group(0) @binding(2) var<storage, read> X1: array<T>;
@group(0) @binding(3) var<storage, read> X2: array<T>;
@group(0) @binding(4) var<storage, read_write> Y: array<T>;
@group(0) @binding(5) var<storage, read_write> S0: array<f32>;
@group(0) @binding(6) var<storage, read_write> S1: array<f32>;
@group(0) @binding(7) var<storage, read> F0: array<f32>;
@group(0) @binding(8) var<storage, read> F1: array<f32>;
@group(0) @binding(9) var<storage, read> L: array<i32>;
@group(0) @binding(10) var<storage, read_write> Y2: array<T>;
// i64 indices as (low, high) words.
@group(0) @binding(11) var<storage, read_write> I: array<u32>;
@group(0) @binding(12) var<storage, read> X3: array<T>;

const WG: u32 = 256u;
// The reductions' scratch (one slot per invocation, or per subgroup).
var<workgroup> red: array<f32, 256>;

// NaN-propagating maximum, as numpy's `maximum` and the CPU backend. NaN is tested on
// the bits: lavapipe folds `b != b` to false (a NaN row's max came out −∞).
fn nan_max(a: f32, b: f32) -> f32 { return select(a, b, b > a || is_nan(b)); }
fn ninf() -> f32 { return bitcast<f32>(0xff800000u); }
// exp(x − m) for x ≤ m, with x = m = −∞ (nothing seen yet) giving 1 rather than NaN; at
// x = m = +∞ it stays exp(∞ − ∞) = NaN, so a row holding +∞ is NaN as on the CPU
// (infinity tested on the bits: some drivers fold float infinity tests away).
fn rescale(x: f32, m: f32) -> f32 {
    return select(exp(x - m), 1.0, x == m && bitcast<u32>(x) != 0x7f800000u);
}
// Online (max, Σ exp(v − max)) update.
fn online(ms: vec2<f32>, v: f32) -> vec2<f32> {
    let m2 = nan_max(ms.x, v);
    return vec2<f32>(m2, ms.y * rescale(ms.x, m2) + rescale(v, m2));
}

fn row_id(wid: vec3<u32>, nwg: vec3<u32>) -> u32 { return wid.y * nwg.x + wid.x; }

// The reductions' folds by kind: max (2), product (4), else a sum (of squares for 3),
// from their identities.
fn fold_ident(kind: u32) -> f32 { return select(select(0.0, 1.0, kind == 4u), ninf(), kind == 2u); }
fn fold(acc: f32, v: f32, kind: u32) -> f32 {
    return select(select(acc + v, acc * v, kind == 4u), nan_max(acc, v), kind == 2u);
}

// One workgroup per output: the kept dims' descriptor at 16 gives its base in X, the
// reduced dims' at 52 the offsets of its P[0] elements. P[1]: 0 sum, 1 mean, 2 max,
// 3 mean of squares, 4 product.
@compute @workgroup_size(256)
fn reduce(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let o = row_id(wid, nwg);
    let n = pu(0u);
    let kind = pu(1u);
    let base = offset_at(16u, 0u, o);
    var acc = fold_ident(kind);
    for (var r = lid; r < n; r += WG) {
        let xv = f32(X0[base + offset_at(52u, 0u, r)]);
        acc = fold(acc, select(xv, xv * xv, kind == 3u), kind);
    }
    if (kind == 2u) { acc = wg_max(acc, lid); } else if (kind == 4u) { acc = wg_prod(acc, lid); } else { acc = wg_sum(acc, lid); }
    // An empty mean is 0/0 = NaN, as on the CPU.
    if (kind == 1u || kind == 3u) { acc = acc / f32(n); }
    if (lid == 0u) { Y[o] = T(acc); }
}

// Short reductions over many outputs (a pool's window of 9, a small middle axis): a thread
// per output (P[3] of them) folds its P[0] elements in order, where a workgroup per
// output would leave all but a few of its threads idle (ResNet-50's max pool at batch 32:
// 26 ms on an H100 that way).
@compute @workgroup_size(256)
fn reduce_each(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let o = linear(wid, nwg, lid, WG);
    if (o >= pu(3u)) { return; }
    let n = pu(0u);
    let kind = pu(1u);
    let base = offset_at(16u, 0u, o);
    var acc = fold_ident(kind);
    for (var r = 0u; r < n; r += 1u) {
        let xv = f32(X0[base + offset_at(52u, 0u, r)]);
        acc = fold(acc, select(xv, xv * xv, kind == 3u), kind);
    }
    if (kind == 1u || kind == 3u) { acc = acc / f32(n); }
    Y[o] = T(acc);
}

// Integer reductions (T = i32) in i32's wrapping arithmetic, as the CPU's; a mean
// truncates toward zero (an empty one is 0, as on the CPU). `reduce_int`: a thread per
// output (P[3] of them) folds its few reduced elements in order.
fn int_ident(kind: u32) -> i32 { return select(select(0, 1, kind == 4u), -2147483647 - 1, kind == 2u); }
fn int_fold(acc: i32, v: i32, kind: u32) -> i32 {
    return select(select(acc + v, acc * v, kind == 4u), max(acc, v), kind == 2u);
}
fn int_mean(acc: i32, n: u32, kind: u32) -> i32 { return select(acc, acc / i32(max(n, 1u)), kind == 1u); }
@compute @workgroup_size(256)
fn reduce_int(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let o = linear(wid, nwg, lid, WG);
    if (o >= pu(3u)) { return; }
    let n = pu(0u);
    let kind = pu(1u);
    let base = offset_at(16u, 0u, o);
    var acc = int_ident(kind);
    for (var r = 0u; r < n; r += 1u) {
        acc = int_fold(acc, i32(X0[base + offset_at(52u, 0u, r)]), kind);
    }
    Y[o] = T(int_mean(acc, n, kind));
}

// `reduce_int` for long reductions: a workgroup per output, its threads' folds combined
// in a tree (i32's wrapping sum, product and max do not depend on the order, so this is
// still the CPU's result). A thread looping over all of them would stop early on
// lavapipe, which ends a loop after 65535 iterations (a sum of 70000 ones came out 21845).
var<workgroup> red_int: array<i32, 256>;
@compute @workgroup_size(256)
fn reduce_int_wg(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let o = row_id(wid, nwg);
    let n = pu(0u);
    let kind = pu(1u);
    let base = offset_at(16u, 0u, o);
    var acc = int_ident(kind);
    for (var r = lid; r < n; r += WG) {
        acc = int_fold(acc, i32(X0[base + offset_at(52u, 0u, r)]), kind);
    }
    red_int[lid] = acc;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) { red_int[lid] = int_fold(red_int[lid], red_int[lid + s], kind); }
        workgroupBarrier();
    }
    // (The grid may hold a few workgroups past the last output.)
    if (lid == 0u && o < pu(3u)) { Y[o] = T(int_mean(red_int[0], n, kind)); }
}

// A reduction too long for one workgroup per output (few outputs, many elements) in two
// passes: P[2] workgroups per output each fold every P[2]-th block of WG elements into
// S0, then `reduce_parts` folds each output's partials. (The mean of mlp_large's loss,
// 8M elements into one, took 20 ms in one workgroup on an H100.)
@compute @workgroup_size(256)
fn reduce_part(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let g = row_id(wid, nwg);
    let parts = pu(2u);
    let n = pu(0u);
    let kind = pu(1u);
    let base = offset_at(16u, 0u, g / parts);
    var acc = fold_ident(kind);
    for (var r = (g % parts) * WG + lid; r < n; r += WG * parts) {
        let xv = f32(X0[base + offset_at(52u, 0u, r)]);
        acc = fold(acc, select(xv, xv * xv, kind == 3u), kind);
    }
    if (kind == 2u) { acc = wg_max(acc, lid); } else if (kind == 4u) { acc = wg_prod(acc, lid); } else { acc = wg_sum(acc, lid); }
    if (lid == 0u) { S0[g] = acc; }
}

@compute @workgroup_size(256)
fn reduce_parts(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let o = row_id(wid, nwg);
    let parts = pu(2u);
    let kind = pu(1u);
    var acc = fold_ident(kind);
    for (var c = lid; c < parts; c += WG) { acc = fold(acc, F0[o * parts + c], kind); }
    if (kind == 2u) { acc = wg_max(acc, lid); } else if (kind == 4u) { acc = wg_prod(acc, lid); } else { acc = wg_sum(acc, lid); }
    if (kind == 1u || kind == 3u) { acc = acc / f32(pu(0u)); }
    if (lid == 0u) { Y[o] = T(acc); }
}

// Selections (ArgMax, ArgMin, TopK) compare elements as stored (T may be i32 here); NaN
// is tested on the bits (see is_nan).
fn nan_of(v: T) -> bool { return is_nan(f32(v)); }

// Whether v, met after best along the line, takes its place as ArgMax's pick (ArgMin's
// with is_min): NaN beats every number, as numpy's argmax and argmin; of equal values the
// first stays unless `last` (select_last_index). As the CPU backend's `beats`.
fn beats(v: T, best: T, is_min: bool, last: bool) -> bool {
    let vn = nan_of(v);
    let bn = nan_of(best);
    if (vn || bn) { return vn && (last || !bn); }
    return select((v > best), (v < best), is_min) || (last && v == best);
}

// ArgMax / ArgMin: a thread per line of P[1] elements P[2] apart (P[0] lines); P[3] bit 0
// ArgMin, bit 1 select_last_index. Each index goes to I as an i64.
@compute @workgroup_size(256)
fn arg_reduce(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let l = linear(wid, nwg, lid, WG);
    if (l >= pu(0u)) { return; }
    let d = pu(1u);
    let inner = pu(2u);
    let is_min = (pu(3u) & 1u) != 0u;
    let last = (pu(3u) & 2u) != 0u;
    let base = (l / inner) * d * inner + l % inner;
    var best = X0[base];
    var at = 0u;
    for (var s = 1u; s < d; s += 1u) {
        let v = X0[base + s * inner];
        if (beats(v, best, is_min, last)) { best = v; at = s; }
    }
    I[2u * l] = at;
    I[2u * l + 1u] = 0u;
}

// `arg_reduce` for long lines: a workgroup per line, each thread's pick over every WG-th
// element combined in a tree by value, then by index (the first of equal values, the last
// with select_last_index). A thread walking a whole line stops early on lavapipe, which
// ends a loop after 65535 iterations.
var<workgroup> arg_v: array<T, 256>;
var<workgroup> arg_i: array<u32, 256>;
@compute @workgroup_size(256)
fn arg_reduce_wg(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let l = row_id(wid, nwg);
    let d = pu(1u);
    let inner = pu(2u);
    let is_min = (pu(3u) & 1u) != 0u;
    let last = (pu(3u) & 2u) != 0u;
    let base = (l / inner) * d * inner + l % inner;
    var at = min(lid, d - 1u);
    var best = X0[base + at * inner];
    for (var s = lid + WG; s < d; s += WG) {
        let v = X0[base + s * inner];
        if (beats(v, best, is_min, last)) { best = v; at = s; }
    }
    arg_v[lid] = best;
    arg_i[lid] = at;
    workgroupBarrier();
    for (var h = WG / 2u; h > 0u; h >>= 1u) {
        if (lid < h) {
            let a = arg_v[lid];
            let b = arg_v[lid + h];
            let ia = arg_i[lid];
            let ib = arg_i[lid + h];
            let same = (nan_of(a) && nan_of(b)) || a == b;
            if ((same && select((ib < ia), (ib > ia), last)) || (!same && beats(b, a, is_min, false))) {
                arg_v[lid] = b;
                arg_i[lid] = ib;
            }
        }
        workgroupBarrier();
    }
    // (The grid may hold a few workgroups past the last line.)
    if (lid == 0u && l < pu(0u)) {
        I[2u * l] = arg_i[0];
        I[2u * l + 1u] = 0u;
    }
}

// Whether (a, ia) ranks before (b, ib) in TopK's order: the larger value first (smaller
// without `largest`), NaN above every number, equal values by lower index. As the CPU
// backend's `rank`.
fn ranks_before(a: T, ia: u32, b: T, ib: u32, largest: bool) -> bool {
    let an = nan_of(a);
    let bn = nan_of(b);
    // -1, 0, 1: a below, equal to, above b (ascending, NaN highest).
    var c = 0;
    if (an || bn) {
        c = select(select(-1, 1, an), 0, an && bn);
    } else {
        c = select(select(0, 1, (a > b)), -1, (a < b));
    }
    if (c == 0) { return ia < ib; }
    return select((c < 0), (c > 0), largest);
}

// TopK: a workgroup per line (P[0] lines of P[1] elements P[2] apart) picks its P[3]
// elements one after the other, each the first in rank order of those ranking after the
// previous pick: each thread scans a 256th of the line, then a tree over the threads.
// (One thread scanning the whole line k times ran past llvmpipe's 65535 iterations a
// loop, which it stops silently.) P[4] = largest. Values to Y, indices to I (i64).
var<workgroup> tk_v: array<T, 256>;
var<workgroup> tk_i: array<u32, 256>;
var<workgroup> tk_found: array<u32, 256>;
var<workgroup> tk_k: u32;

@compute @workgroup_size(256)
fn top_k(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let l = row_id(wid, nwg);
    let d = pu(1u);
    let inner = pu(2u);
    let largest = pu(4u) != 0u;
    // The pick count, as a value every thread of the workgroup agrees on (barriers run
    // in its loop); none for a workgroup past the last line.
    if (lid == 0u) { tk_k = select(0u, pu(3u), l < pu(0u)); }
    let k = workgroupUniformLoad(&tk_k);
    let o = l / max(inner, 1u);
    let i = l % max(inner, 1u);
    let base = o * d * inner + i;
    var pv = X0[0];
    var pi = 0u;
    for (var j = 0u; j < k; j += 1u) {
        var bv = X0[0];
        var bi = 0u;
        var found = false;
        for (var s = lid; s < d; s += WG) {
            let v = X0[base + s * inner];
            if (j > 0u && !ranks_before(pv, pi, v, s, largest)) { continue; }
            if (!found || ranks_before(v, s, bv, bi, largest)) { bv = v; bi = s; found = true; }
        }
        tk_v[lid] = bv;
        tk_i[lid] = bi;
        tk_found[lid] = select(0u, 1u, found);
        workgroupBarrier();
        for (var w = WG / 2u; w > 0u; w = w / 2u) {
            if (lid < w && tk_found[lid + w] != 0u
                && (tk_found[lid] == 0u || ranks_before(tk_v[lid + w], tk_i[lid + w], tk_v[lid], tk_i[lid], largest))) {
                tk_v[lid] = tk_v[lid + w];
                tk_i[lid] = tk_i[lid + w];
                tk_found[lid] = 1u;
            }
            workgroupBarrier();
        }
        pv = tk_v[0];
        pi = tk_i[0];
        if (lid == 0u) {
            let at = (o * k + j) * inner + i;
            Y[at] = pv;
            I[2u * at] = pi;
            I[2u * at + 1u] = 0u;
        }
        workgroupBarrier();
    }
}

// One workgroup per (outer, inner) row of P[0] elements P[1] apart; P[2] = 1 for
// LogSoftmax. Max and sum in one pass (online rescaling), then the outputs.
@compute @workgroup_size(256)
fn softmax(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = row_id(wid, nwg);
    let n = pu(0u);
    let inner = pu(1u);
    let off = (row / inner) * n * inner + row % inner;
    var ms = vec2<f32>(ninf(), 0.0);
    for (var j = lid; j < n; j += WG) { ms = online(ms, f32(X0[off + j * inner])); }
    let mx = wg_max(ms.x, lid);
    let sum = wg_sum(ms.y * rescale(ms.x, mx), lid);
    if (pu(2u) != 0u) {
        // (x − max) − ln Σ, not x − (max + ln Σ): for large x the sum rounds away ln Σ.
        let ls = log(sum);
        for (var j = lid; j < n; j += WG) { Y[off + j * inner] = T((f32(X0[off + j * inner]) - mx) - ls); }
    } else {
        let r = 1.0 / sum;
        for (var j = lid; j < n; j += WG) { Y[off + j * inner] = T(exp(f32(X0[off + j * inner]) - mx) * r); }
    }
}

// y·(dy − Σ dy·y), or dy − exp(y)·Σ dy for LogSoftmax (X0 = dY, X1 = Y).
@compute @workgroup_size(256)
fn softmax_grad(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = row_id(wid, nwg);
    let n = pu(0u);
    let inner = pu(1u);
    let log_ = pu(2u) != 0u;
    let off = (row / inner) * n * inner + row % inner;
    var s = 0.0;
    for (var j = lid; j < n; j += WG) {
        let d = f32(X0[off + j * inner]);
        s += select(d * f32(X1[off + j * inner]), d, log_);
    }
    s = wg_sum(s, lid);
    for (var j = lid; j < n; j += WG) {
        let d = f32(X0[off + j * inner]);
        let v = f32(X1[off + j * inner]);
        Y[off + j * inner] = T(select(v * (d - s), d - exp(v) * s, log_));
    }
}

// The row element layer_norm normalizes: X0's, or with a residual the sum it wrote to Y2
// (each invocation reads back only the elements it wrote).
fn ln_x(i: u32, res: bool) -> f32 {
    if (res) { return f32(Y2[i]); }
    return f32(X0[i]);
}

// Rows of P[0]; X1 = scale and X2 = bias (P[2] bit 0) expanded to the row by the host,
// P[1] = epsilon. Mean and 1/σ go to S0 and S1 (f32). Centred variance: no cancellation.
// P[2] bit 1: RMSNormalization, the rows are not centred (the mean is 0). P[2] bit 2: a
// residual X3, the rows are X0 + X3 (rounded to T), written to Y2.
@compute @workgroup_size(256)
fn layer_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = row_id(wid, nwg);
    let n = pu(0u);
    let off = row * n;
    let rms = (pu(2u) & 2u) != 0u;
    let res = (pu(2u) & 4u) != 0u;
    if (res) { for (var j = lid; j < n; j += WG) { Y2[off + j] = T(f32(X0[off + j]) + f32(X3[off + j])); } }
    var s = 0.0;
    if (!rms) { for (var j = lid; j < n; j += WG) { s += ln_x(off + j, res); } }
    let mean = select(wg_sum(s, lid) / f32(n), 0.0, rms);
    var v = 0.0;
    for (var j = lid; j < n; j += WG) { let d = ln_x(off + j, res) - mean; v += d * d; }
    let inv = 1.0 / sqrt(wg_sum(v, lid) / f32(n) + pf(1u));
    let has_b = (pu(2u) & 1u) != 0u;
    for (var j = lid; j < n; j += WG) {
        let z = (ln_x(off + j, res) - mean) * inv * f32(X1[j]);
        Y[off + j] = T(select(z, z + f32(X2[j]), has_b));
    }
    if (lid == 0u) {
        S0[row] = mean;
        S1[row] = inv;
    }
}

// dx = inv·(g − mean(g) − x̂·mean(g·x̂)) per row, g = dy·scale (X0 = dY, X1 = X,
// X2 = scale expanded, F0 = mean, F1 = 1/σ), plus Y2 (a residual gradient, read only)
// when P[1] bit 0 is set. P[1] bit 1: RMSNormalization's, no mean (F0 not read).
@compute @workgroup_size(256)
fn layer_norm_dx(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = row_id(wid, nwg);
    let n = pu(0u);
    let off = row * n;
    let rms = (pu(1u) & 2u) != 0u;
    var m = 0.0;
    if (!rms) { m = F0[row]; }
    let iv = F1[row];
    var sg = 0.0;
    var sgx = 0.0;
    for (var j = lid; j < n; j += WG) {
        let g = f32(X0[off + j]) * f32(X2[j]);
        sg += g;
        sgx += g * (f32(X1[off + j]) - m) * iv;
    }
    let mg = select(wg_sum(sg, lid) / f32(n), 0.0, rms);
    let mgx = wg_sum(sgx, lid) / f32(n);
    for (var j = lid; j < n; j += WG) {
        let xhat = (f32(X1[off + j]) - m) * iv;
        var v = iv * (f32(X0[off + j]) * f32(X2[j]) - mg - xhat * mgx);
        if ((pu(1u) & 1u) != 0u) { v += f32(Y2[off + j]); }
        Y[off + j] = T(v);
    }
}

// dScale = Σ_rows dy·x̂ into Y, dB = Σ_rows dy into Y2: one thread per column, rows in
// order (P[0] = n; P[2] = 1: RMSNormalization's, no mean, F0 not read). A dispatch takes
// rows [P[3], P[1]) and adds onto what the one before it wrote (lavapipe ends a shader
// loop after 65535 iterations).
@compute @workgroup_size(256)
fn layer_norm_dparams(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let j = linear(wid, nwg, lid, WG);
    let n = pu(0u);
    if (j >= n) { return; }
    let rms = pu(2u) == 1u;
    let r0 = pu(3u);
    var s = select(0.0, f32(Y[j]), r0 > 0u);
    var b = select(0.0, f32(Y2[j]), r0 > 0u);
    for (var r = r0; r < pu(1u); r += 1u) {
        let d = f32(X0[r * n + j]);
        var m = 0.0;
        if (!rms) { m = F0[r]; }
        s += d * (f32(X1[r * n + j]) - m) * F1[r];
        b += d;
    }
    Y[j] = T(s);
    Y2[j] = T(b);
}

// Σ over P[1] rows of P[0] columns (the bias gradient), one thread per column and part
// of P[2] rows: with one part the sums go to Y; with several, each part's to S0 (f32,
// [part][column]) and `sum_parts` adds the P[3] parts up. A thread per column walking all
// rows in sequence left the GPU idle: in mlp_large's fc1 gradient (8192 rows, 4096
// columns) about 12 of the node's 15 ms on an H100 were not its GEMM.
@compute @workgroup_size(256)
fn sum_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = linear(wid, nwg, lid, WG);
    let n = pu(0u);
    let parts = pu(3u);
    if (i >= n * parts) { return; }
    let j = i % n;
    let r0 = (i / n) * pu(2u);
    let r1 = min(r0 + pu(2u), pu(1u));
    var s = 0.0;
    for (var r = r0; r < r1; r += 1u) { s += f32(X0[r * n + j]); }
    if (parts == 1u) { Y[j] = T(s); } else { S0[i] = s; }
}

@compute @workgroup_size(256)
fn sum_parts(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let j = linear(wid, nwg, lid, WG);
    let n = pu(0u);
    if (j >= n) { return; }
    var s = 0.0;
    for (var c = 0u; c < pu(3u); c += 1u) { s += F0[c * n + j]; }
    Y[j] = T(s);
}

// SoftmaxCrossEntropyLoss over scores [N, C, d]: element e = (i, p), its class row C
// values d apart. Labels are i32 words IW apart (2 for i64: the low word).
// P: 0 C, 1 d, 2 elements, 3 ignore_index, 4 flags (1 ignore, 2 weights, 4 log_prob).
fn label(e: u32) -> i32 { return L[e * IW]; }
fn class_lse(base: u32, c: u32, d: u32) -> f32 {
    var ms = vec2<f32>(ninf(), 0.0);
    for (var k = 0u; k < c; k += 1u) { ms = online(ms, f32(X0[base + k * d])); }
    return ms.x + log(ms.y);
}
fn weight_of(l: i32) -> f32 {
    let flags = pu(4u);
    if ((flags & 1u) != 0u && l == pi(3u)) { return 0.0; }
    if ((flags & 2u) != 0u) { return f32(X1[u32(l)]); }
    return 1.0;
}

// `class_lse` by a workgroup (classes past LONG_LINE: a thread's loop over them would stop
// early on lavapipe, which ends a loop after 65535 iterations).
fn wg_lse(base: u32, c: u32, d: u32, lid: u32) -> f32 {
    var ms = vec2<f32>(ninf(), 0.0);
    for (var k = lid; k < c; k += WG) { ms = online(ms, f32(X0[base + k * d])); }
    let m = wg_max(ms.x, lid);
    return m + log(wg_sum(ms.y * rescale(ms.x, m), lid));
}
fn sce_base(e: u32) -> u32 {
    let d = pu(1u);
    return (e / d) * pu(0u) * d + e % d;
}

// Element e's weight (S1) and weighted loss (S0) when `stats`, and its log_prob into Y
// when asked, over classes k0, k0 + step, ...
fn sce_row_out(e: u32, lse: f32, k0: u32, step: u32, stats: bool) {
    let d = pu(1u);
    let base = sce_base(e);
    if (stats) {
        let l = label(e);
        let w = weight_of(l);
        S1[e] = w;
        S0[e] = select(-w * (f32(X0[base + u32(l) * d]) - lse), 0.0, w == 0.0);
    }
    if ((pu(4u) & 4u) != 0u) {
        for (var k = k0; k < pu(0u); k += step) { Y[base + k * d] = T(f32(X0[base + k * d]) - lse); }
    }
}

// Per element: weight (S1) and weighted loss (S0); log_prob into Y when asked. A thread
// per element, or (`sce_rows_wg`) a workgroup.
@compute @workgroup_size(256)
fn sce_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let e = linear(wid, nwg, lid, WG);
    if (e >= pu(2u)) { return; }
    sce_row_out(e, class_lse(sce_base(e), pu(0u), pu(1u)), 0u, 1u, true);
}
@compute @workgroup_size(256)
fn sce_rows_wg(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    // (The grid may hold a few workgroups past the last element: they read the last.)
    let e = row_id(wid, nwg);
    let ec = min(e, pu(2u) - 1u);
    let lse = wg_lse(sce_base(ec), pu(0u), pu(1u), lid);
    if (e < pu(2u)) { sce_row_out(e, lse, lid, WG, lid == 0u); }
}

// P[0] elements; P[1] reduction: 0 none, 1 sum, 2 mean (Σ w·loss / Σ w). F0 loss, F1 w.
@compute @workgroup_size(256)
fn sce_reduce(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let ne = pu(0u);
    let r = pu(1u);
    if (r == 0u) {
        let e = linear(wid, nwg, lid, WG);
        if (e < ne) { Y[e] = T(F0[e]); }
        return;
    }
    var s = 0.0;
    var w = 0.0;
    for (var e = lid; e < ne; e += WG) { s += F0[e]; w += F1[e]; }
    s = wg_sum(s, lid);
    w = wg_sum(w, lid);
    if (lid == 0u) { Y[0] = T(select(s, s / w, r == 2u)); }
}

// (softmax − onehot)·w·dloss/denom, X0 = scores, X2 = dloss, F1 = weights; P[3] = denom
// (Σ w for mean, from a sce_reduce pass into S-scratch read as F0[0]), P[5] reduction.
// Element e's classes k0, k0 + step, ...
fn sce_grad_out(e: u32, lse: f32, k0: u32, step: u32) {
    let c = pu(0u);
    let d = pu(1u);
    let r = pu(5u);
    let base = sce_base(e);
    let w = F1[e];
    let denom = select(1.0, F0[0], r == 2u);
    let coef = select(w * f32(X2[select(0u, e, r == 0u)]) / denom, 0.0, w == 0.0);
    let l = label(e);
    for (var k = k0; k < c; k += step) {
        let hot = select(0.0, 1.0, i32(k) == l);
        Y[base + k * d] = T((exp(f32(X0[base + k * d]) - lse) - hot) * coef);
    }
}
@compute @workgroup_size(256)
fn sce_grad(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let e = linear(wid, nwg, lid, WG);
    if (e >= pu(2u)) { return; }
    sce_grad_out(e, class_lse(sce_base(e), pu(0u), pu(1u)), 0u, 1u);
}
@compute @workgroup_size(256)
fn sce_grad_wg(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let e = row_id(wid, nwg);
    let ec = min(e, pu(2u) - 1u);
    let lse = wg_lse(sce_base(ec), pu(0u), pu(1u), lid);
    if (e < pu(2u)) { sce_grad_out(e, lse, lid, WG); }
}

// Σ F1 into S0[0] (the mean loss's denominator for sce_grad).
@compute @workgroup_size(256)
fn wsum(@builtin(local_invocation_index) lid: u32) {
    var w = 0.0;
    for (var e = lid; e < pu(0u); e += WG) { w += F1[e]; }
    w = wg_sum(w, lid);
    if (lid == 0u) { S0[0] = w; }
}
