// Optimizer steps in place, PyTorch's rules as src/backends/cpu/optim.rs: parameters
// in T, state (momentum, Adam moments) in f32.
// P: 0 n, 1 kind (0 SGD, 1 SGD with momentum, 2 Adam, 3 AdamW), 2 lr, 3 momentum or
// beta1, 4 beta2, 5 eps, 6 weight decay, 7 Adam step size lr/bc1, 8 sqrt(bc2),
// 9 AdamW decay 1 − lr·wd, 10 the update's slot in the step.
// Kind 4 is gradient accumulation (Backend::accumulate), PARAM the accumulator: PARAM =
// P2·GRAD, or PARAM += P2·GRAD unless P11 (first) is 1.
// BAD[0] notes the smallest slot whose new value, as stored, is NaN or infinite (the
// check rides on the update's own pass; see Backend::take_nonfinite).

@group(0) @binding(1) var<storage, read_write> PARAM: array<T>;
@group(0) @binding(2) var<storage, read> GRAD: array<T>;
@group(0) @binding(3) var<storage, read_write> S0: array<f32>;
@group(0) @binding(4) var<storage, read_write> S1: array<f32>;
@group(0) @binding(5) var<storage, read_write> BAD: array<atomic<u32>>;

fn store_param(i: u32, v: f32) {
    let s = T(v);
    PARAM[i] = s;
    // By the bits: WGSL lets compilers assume floats are finite, so no comparison.
    if ((bitcast<u32>(f32(s)) & 0x7f800000u) == 0x7f800000u) {
        atomicMin(&BAD[0], pu(10u));
    }
}

@compute @workgroup_size(256)
fn step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = linear(wid, nwg, lid, 256u);
    if (i >= pu(0u)) { return; }
    let kind = pu(1u);
    var p = f32(PARAM[i]);
    var g = f32(GRAD[i]);
    if (kind == 4u) {
        let v = pf(2u) * g;
        PARAM[i] = T(select(p + v, v, pu(11u) == 1u));
        return;
    }
    if (kind <= 1u) {
        var d = g + pf(6u) * p;
        if (kind == 1u) {
            let b = pf(3u) * S0[i] + d;
            S0[i] = b;
            d = b;
        }
        store_param(i, p - pf(2u) * d);
        return;
    }
    if (kind == 3u) { p = p * pf(9u); } else { g = g + pf(6u) * p; }
    let b1 = pf(3u);
    let b2 = pf(4u);
    let m = b1 * S0[i] + (1.0 - b1) * g;
    let v = b2 * S1[i] + (1.0 - b2) * g * g;
    S0[i] = m;
    S1[i] = v;
    store_param(i, p - pf(7u) * m / (sqrt(v) / pf(8u) + pf(5u)));
}
