// Matrix products: register-blocked tiled GEMMs for MatMul, Gemm, FusedMatMul and the
// products of FusedMatMulGrad, in two shapes:
// - `gemm128`: a workgroup of 16×16 threads computes a 128×128 tile of D, each thread 8×8
//   outputs in sixteen named vec4 accumulators (an array accumulator spills to memory on
//   NVIDIA's Vulkan driver: 0.37 against 12 TFLOP/s measured). Operands are read as vec4
//   along whichever of their dims is contiguous (A_K / B_K), K advances in steps of 8
//   through two workgroup buffers: the next step's loads are in flight while this one
//   computes, one barrier per step. The host picks it when both operands allow vec4 reads
//   (unit stride on one dim, the rest multiples of 4) and the product fills enough tiles.
// - `gemm`: any strides, a 64×64 tile, each thread 4×4 in four vec4 accumulators, K in
//   steps of 16; for unaligned operands and small products.
//
// D[z](m, n) = epilogue(alpha · Σ_k A[z](m, k) · B[z](k, n)), operands addressed through
// strides so transposes cost nothing: A(m, k) at a_z + m·P[3] + k·P[4], B(k, n) at
// b_z + k·P[5] + n·P[6]; the batch offsets a_z, b_z, r_z come from the strided
// descriptor over the output's batch dims (operands 0, 1, 2), D is dense.
//
// The whole FusedMatMul epilogue runs here: + bias[n], Pre stored, activation ACT (a
// constant of the pipeline), + rscale · R (residual or Gemm's C, strides P[10], P[11]),
// and + D itself when accumulating a gradient over broadcast batches.
// P: 0 M, 1 N, 2 K, 3-6 strides, 7 alpha, 8 flags (1 bias, 2 residual, 4 pre, 8 accumulate,
// 16 partial sums in D before the epilogue),
// 9 rscale, 10-11 residual strides, 12 offset of D.

@group(0) @binding(1) var<storage, read> MA: array<T>;
@group(0) @binding(2) var<storage, read> MB: array<T>;
@group(0) @binding(3) var<storage, read_write> D: array<T>;
@group(0) @binding(4) var<storage, read> BIAS: array<T>;
@group(0) @binding(5) var<storage, read> R: array<T>;
@group(0) @binding(6) var<storage, read_write> PRE: array<T>;
// A and B again as vec4s, for `gemm128`.
@group(0) @binding(7) var<storage, read> MA4: array<vec4<T>>;
@group(0) @binding(8) var<storage, read> MB4: array<vec4<T>>;

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
            let d = dz + m * N + n;
            var v = pf(7u) * acc[j];
            // A product split along K: D holds the partial sums so far.
            if ((flags & 16u) != 0u) { v += f32(D[d]); }
            if ((flags & 1u) != 0u) { v += f32(BIAS[n]); }
            if ((flags & 4u) != 0u) { PRE[d] = T(v); }
            v = act_fwd(ACT, v, 0.0, 0.0);
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

// gemm128's workgroup tiles: [2 stages][8 k][33 vec4]: 128 values of m (of n) per k and
// one vec4 of padding, so that the transposing stores of a k-contiguous operand (below)
// fall in distinct banks. 2 × 2 × 8.4 KiB.
const BK: u32 = 8u;
const ROW4: u32 = 33u;
const STAGE4: u32 = 264u;
var<workgroup> At: array<vec4<f32>, 528>;
var<workgroup> Bt: array<vec4<f32>, 528>;

// One vec4 of a 128 × 8 operand tile per thread t. With the operand contiguous along k
// (`along_k`), thread t reads k0 + 4·(t % 2) + 0..4 of row r0 + t / 2; otherwise rows
// r0 + 4·(t % 32) + 0..4 of k0 + t / 32. `rows` and `K` bound the reads (the host keeps
// the vec4 dim a multiple of 4, so a vec4 is wholly inside or outside).
fn tile_index(along_k: bool, t: u32, r0: u32, k0: u32, sr: u32, sk: u32) -> vec3<u32> {
    if (along_k) {
        let r = r0 + (t >> 1u);
        let k = k0 + (t & 1u) * 4u;
        return vec3<u32>(r, k, r * sr + k);
    }
    let r = r0 + (t & 31u) * 4u;
    let k = k0 + (t >> 5u);
    return vec3<u32>(r, k, k * sk + r);
}

// `g`: rows, K, row stride, k stride (read once per kernel, not per step).
fn load_a(t: u32, m0: u32, k0: u32, az: u32, g: vec4<u32>) -> vec4<f32> {
    let i = tile_index(A_K, t, m0, k0, g.z, g.w);
    if (i.x < g.x && i.y < g.y) { return vec4<f32>(MA4[(az + i.z) >> 2u]); }
    return vec4<f32>(0.0);
}

fn load_b(t: u32, n0: u32, k0: u32, bz: u32, g: vec4<u32>) -> vec4<f32> {
    let i = tile_index(B_K, t, n0, k0, g.z, g.w);
    if (i.x < g.x && i.y < g.y) { return vec4<f32>(MB4[(bz + i.z) >> 2u]); }
    return vec4<f32>(0.0);
}

// Stores thread t's vec4 into stage `s` as [k][row]: k-contiguous vec4s are spread over
// four k (one float each; threads t and t + 1 land 4·33 floats apart, 16 banks).
fn stash_a(s: u32, t: u32, v: vec4<f32>) {
    if (A_K) {
        let r = t >> 1u;
        let q = s + (t & 1u) * 4u * ROW4 + (r >> 2u);
        let c = r & 3u;
        At[q][c] = v.x;
        At[q + ROW4][c] = v.y;
        At[q + 2u * ROW4][c] = v.z;
        At[q + 3u * ROW4][c] = v.w;
    } else {
        At[s + (t >> 5u) * ROW4 + (t & 31u)] = v;
    }
}

fn stash_b(s: u32, t: u32, v: vec4<f32>) {
    if (B_K) {
        let r = t >> 1u;
        let q = s + (t & 1u) * 4u * ROW4 + (r >> 2u);
        let c = r & 3u;
        Bt[q][c] = v.x;
        Bt[q + ROW4][c] = v.y;
        Bt[q + 2u * ROW4][c] = v.z;
        Bt[q + 3u * ROW4][c] = v.w;
    } else {
        Bt[s + (t >> 5u) * ROW4 + (t & 31u)] = v;
    }
}

// Thread (x, y) owns rows m0 + 4y + 0..4 and m0 + 64 + 4y + 0..4, columns n0 + 4x + 0..4
// and n0 + 64 + 4x + 0..4: its reads of a k row are two vec4s of A and two of B, and a
// warp's B reads are 16 consecutive vec4s.
@compute @workgroup_size(16, 16)
fn gemm128(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) l: vec3<u32>) {
    let K = pu(2u);
    let t = l.y * 16u + l.x;
    let m0 = wid.y * 128u;
    let n0 = wid.x * 128u;
    let z = wid.z;
    let az = u32(offset_of(0u, z));
    let bz = u32(offset_of(1u, z));
    let ga = vec4<u32>(pu(0u), K, pu(3u), pu(4u));
    let gb = vec4<u32>(pu(1u), K, pu(6u), pu(5u));
    var c00 = vec4<f32>(0.0); var c01 = vec4<f32>(0.0);
    var c10 = vec4<f32>(0.0); var c11 = vec4<f32>(0.0);
    var c20 = vec4<f32>(0.0); var c21 = vec4<f32>(0.0);
    var c30 = vec4<f32>(0.0); var c31 = vec4<f32>(0.0);
    var c40 = vec4<f32>(0.0); var c41 = vec4<f32>(0.0);
    var c50 = vec4<f32>(0.0); var c51 = vec4<f32>(0.0);
    var c60 = vec4<f32>(0.0); var c61 = vec4<f32>(0.0);
    var c70 = vec4<f32>(0.0); var c71 = vec4<f32>(0.0);
    stash_a(0u, t, load_a(t, m0, 0u, az, ga));
    stash_b(0u, t, load_b(t, n0, 0u, bz, gb));
    workgroupBarrier();
    var s = 0u;
    for (var k0 = 0u; k0 < K; k0 += BK) {
        // The next step's tiles (zeros past K), read while this one computes.
        let na = load_a(t, m0, k0 + BK, az, ga);
        let nb = load_b(t, n0, k0 + BK, bz, gb);
        for (var kk = 0u; kk < BK; kk += 1u) {
            let r = s + kk * ROW4;
            let a0 = At[r + l.y];
            let a1 = At[r + 16u + l.y];
            let b0 = Bt[r + l.x];
            let b1 = Bt[r + 16u + l.x];
            c00 += a0.x * b0; c01 += a0.x * b1;
            c10 += a0.y * b0; c11 += a0.y * b1;
            c20 += a0.z * b0; c21 += a0.z * b1;
            c30 += a0.w * b0; c31 += a0.w * b1;
            c40 += a1.x * b0; c41 += a1.x * b1;
            c50 += a1.y * b0; c51 += a1.y * b1;
            c60 += a1.z * b0; c61 += a1.z * b1;
            c70 += a1.w * b0; c71 += a1.w * b1;
        }
        // The other stage was last read before the previous barrier.
        s = STAGE4 - s;
        stash_a(s, t, na);
        stash_b(s, t, nb);
        workgroupBarrier();
    }
    let m = m0 + l.y * 4u;
    let n = n0 + l.x * 4u;
    store_row(z, m, n, c00); store_row(z, m, n + 64u, c01);
    store_row(z, m + 1u, n, c10); store_row(z, m + 1u, n + 64u, c11);
    store_row(z, m + 2u, n, c20); store_row(z, m + 2u, n + 64u, c21);
    store_row(z, m + 3u, n, c30); store_row(z, m + 3u, n + 64u, c31);
    store_row(z, m + 64u, n, c40); store_row(z, m + 64u, n + 64u, c41);
    store_row(z, m + 65u, n, c50); store_row(z, m + 65u, n + 64u, c51);
    store_row(z, m + 66u, n, c60); store_row(z, m + 66u, n + 64u, c61);
    store_row(z, m + 67u, n, c70); store_row(z, m + 67u, n + 64u, c71);
}
