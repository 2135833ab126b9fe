// Matrix products: one register-blocked tiled GEMM for MatMul, Gemm, FusedMatMul and the
// products of FusedMatMulGrad. A workgroup of 16×16 threads computes a 64×64 tile of D;
// each thread a 4×4 block held in four vec4 accumulators (an array accumulator spills to
// memory on NVIDIA's Vulkan driver: 0.37 against 12 TFLOP/s measured). K advances in
// steps of 16 through workgroup memory.
//
// D[z](m, n) = epilogue(alpha · Σ_k A[z](m, k) · B[z](k, n)), operands addressed through
// strides so transposes cost nothing: A(m, k) at a_z + m·P[3] + k·P[4], B(k, n) at
// b_z + k·P[5] + n·P[6]; the batch offsets a_z, b_z, r_z come from the strided
// descriptor over the output's batch dims (operands 0, 1, 2), D is dense.
//
// The whole FusedMatMul epilogue runs here: + bias[n], Pre stored, activation ACT (a
// constant of the pipeline), + rscale · R (residual or Gemm's C, strides P[10], P[11]),
// and + D itself when accumulating a gradient over broadcast batches.
// P: 0 M, 1 N, 2 K, 3-6 strides, 7 alpha, 8 flags (1 bias, 2 residual, 4 pre, 8 accumulate),
// 9 rscale, 10-11 residual strides, 12 offset of D.

@group(0) @binding(1) var<storage, read> MA: array<T>;
@group(0) @binding(2) var<storage, read> MB: array<T>;
@group(0) @binding(3) var<storage, read_write> D: array<T>;
@group(0) @binding(4) var<storage, read> BIAS: array<T>;
@group(0) @binding(5) var<storage, read> R: array<T>;
@group(0) @binding(6) var<storage, read_write> PRE: array<T>;

var<workgroup> As: array<vec4<f32>, 256>; // [k][m / 4]
var<workgroup> Bs: array<vec4<f32>, 256>; // [k][n / 4]

fn store_row(z: u32, m: u32, n0: u32, acc: vec4<f32>) {
    let M = pu(0u);
    let N = pu(1u);
    if (m >= M) { return; }
    let flags = pu(8u);
    let dz = pu(12u) + z * M * N;
    let rz = offset_of(2u, z);
    for (var j = 0u; j < 4u; j += 1u) {
        let n = n0 + j;
        if (n < N) {
            var v = pf(7u) * acc[j];
            if ((flags & 1u) != 0u) { v += f32(BIAS[n]); }
            let d = dz + m * N + n;
            if ((flags & 4u) != 0u) { PRE[d] = T(v); }
            v = act_fwd(ACT, v, 0.0);
            if ((flags & 2u) != 0u) { v += pf(9u) * f32(R[u32(rz + i32(m * pu(10u) + n * pu(11u)))]); }
            if ((flags & 8u) != 0u) { v += f32(D[d]); }
            D[d] = T(v);
        }
    }
}

@compute @workgroup_size(16, 16)
fn gemm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) l: vec3<u32>) {
    let M = pu(0u);
    let N = pu(1u);
    let K = pu(2u);
    let sam = pu(3u);
    let sak = pu(4u);
    let sbk = pu(5u);
    let sbn = pu(6u);
    let t = l.y * 16u + l.x;
    let m0 = wid.y * 64u;
    let n0 = wid.x * 64u;
    let z = wid.z;
    let az = u32(offset_of(0u, z));
    let bz = u32(offset_of(1u, z));
    var c0 = vec4<f32>(0.0);
    var c1 = vec4<f32>(0.0);
    var c2 = vec4<f32>(0.0);
    var c3 = vec4<f32>(0.0);
    // Thread t loads A(m0 + 4·(t / 16) + 0..4, k0 + t % 16) and B(k0 + t / 16, n0 + 4·(t % 16) + 0..4):
    // neighbouring threads read neighbouring k of A and n of B.
    let ka = t & 15u;
    let ma = m0 + (t >> 4u) * 4u;
    let kb = t >> 4u;
    let nb = n0 + (t & 15u) * 4u;
    for (var k0 = 0u; k0 < K; k0 += 16u) {
        var av = vec4<f32>(0.0);
        if (k0 + ka < K) {
            let base = az + (k0 + ka) * sak;
            for (var j = 0u; j < 4u; j += 1u) {
                if (ma + j < M) { av[j] = f32(MA[base + (ma + j) * sam]); }
            }
        }
        As[ka * 16u + (t >> 4u)] = av;
        var bv = vec4<f32>(0.0);
        if (k0 + kb < K) {
            let base = bz + (k0 + kb) * sbk;
            for (var j = 0u; j < 4u; j += 1u) {
                if (nb + j < N) { bv[j] = f32(MB[base + (nb + j) * sbn]); }
            }
        }
        Bs[kb * 16u + (t & 15u)] = bv;
        workgroupBarrier();
        for (var kk = 0u; kk < 16u; kk += 1u) {
            let a = As[kk * 16u + l.y];
            let b = Bs[kk * 16u + l.x];
            c0 += a.x * b;
            c1 += a.y * b;
            c2 += a.z * b;
            c3 += a.w * b;
        }
        workgroupBarrier();
    }
    let m = m0 + l.y * 4u;
    let n = n0 + l.x * 4u;
    store_row(z, m, n, c0);
    store_row(z, m + 1u, n, c1);
    store_row(z, m + 2u, n, c2);
    store_row(z, m + 3u, n, c3);
}
