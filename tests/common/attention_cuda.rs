//! Attention on CUDA against the CPU, shared by tests/cuda.rs (the default kernels) and
//! tests/cuda_3xtf32.rs (f32 on the 3xTF32 tensor-core kernels of cuda/flash_tf32.cu).

use super::common::*;
use graphrun::graph::op::AttrValue as A;
use graphrun::{BackendKind, DType, Tensor};

const LOW: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// The tiled attention kernels (tensor cores for f16/bf16, FP32 tiles for f32), forward
/// and backward, against the CPU: tile-crossing and ragged lengths, GQA, causal with more
/// or fewer queries than keys, bool and additive masks (with dMask), head sizes that take
/// the 16-byte and the element-wise tile loads, Dv ≠ D.
pub fn tiled_kernels_forward_and_backward() {
    if !cuda_present() {
        return;
    }
    struct C {
        b: usize,
        hq: usize,
        hkv: usize,
        sq: usize,
        skv: usize,
        d: usize,
        dv: usize,
        causal: bool,
        mask: Option<Tensor>,
    }
    let c = |b, hq, hkv, sq, skv, d, dv, causal| C {
        b,
        hq,
        hkv,
        sq,
        skv,
        d,
        dv,
        causal,
        mask: None,
    };
    let mut keep: Vec<bool> = (0..70 * 150).map(|i| (i * 7919) % 10 < 7).collect();
    keep[3 * 150..4 * 150].fill(false); // a row that sees nothing
    let cases = [
        c(2, 4, 2, 200, 200, 64, 64, true),
        c(1, 1, 1, 64, 128, 64, 64, false),
        C {
            mask: Some(randn(&[1, 2, 130, 77], 501)),
            ..c(1, 2, 2, 130, 77, 64, 64, false)
        },
        C {
            mask: Some(bools(&[70, 150], &keep)),
            ..c(1, 2, 1, 70, 150, 8, 8, true)
        },
        c(1, 2, 2, 150, 20, 16, 24, true),
        c(1, 2, 2, 33, 300, 40, 40, false),
    ];
    for (n, cs) in cases.iter().enumerate() {
        let seed = 600 + 10 * n as u64;
        let q = randn(&[cs.b, cs.hq, cs.sq, cs.d], seed);
        let k = randn(&[cs.b, cs.hkv, cs.skv, cs.d], seed + 1);
        let v = randn(&[cs.b, cs.hkv, cs.skv, cs.dv], seed + 2);
        let dy = randn(&[cs.b, cs.hq, cs.sq, cs.dv], seed + 3);
        let causal = [("is_causal", A::Int(cs.causal as i64))];
        for dt in LOW {
            let cast = |t: &Tensor| {
                if t.dtype().is_float() {
                    t.cast(dt)
                } else {
                    t.clone()
                }
            };
            let mut fargs = vec![inp(cast(&q)), inp(cast(&k)), inp(cast(&v))];
            if let Some(m) = &cs.mask {
                fargs.push(inp(cast(m)));
            }
            let want = run_raw(BackendKind::Cpu, op("Attention", &causal), &fargs, 2)
                .unwrap_or_else(|e| panic!("case {n} cpu {dt}: {e}"));
            let got = run_raw(BackendKind::Cuda, op("Attention", &causal), &fargs, 2)
                .unwrap_or_else(|e| panic!("case {n} cuda {dt}: {e}"));
            for k_ in 0..2 {
                let e = rel_err(&got[k_].to_f64_vec(), &want[k_].to_f64_vec());
                assert!(
                    e <= tol(dt),
                    "case {n} {dt} forward output {k_}: rel err {e:.3e}"
                );
            }
            // The backward from the CPU's forward outputs.
            let mut bargs = vec![
                inp(cast(&dy)),
                inp(cast(&q)),
                inp(cast(&k)),
                inp(cast(&v)),
                inp(want[0].clone()),
                inp(want[1].clone()),
            ];
            let mut n_out = 3;
            if let Some(m) = &cs.mask {
                bargs.push(inp(cast(m)));
                if m.dtype().is_float() {
                    n_out = 4;
                }
            }
            let gw = run_raw(
                BackendKind::Cpu,
                op("AttentionGrad", &causal),
                &bargs,
                n_out,
            )
            .unwrap_or_else(|e| panic!("case {n} cpu grad {dt}: {e}"));
            let gg = run_raw(
                BackendKind::Cuda,
                op("AttentionGrad", &causal),
                &bargs,
                n_out,
            )
            .unwrap_or_else(|e| panic!("case {n} cuda grad {dt}: {e}"));
            for k_ in 0..n_out {
                let e = rel_err(&gg[k_].to_f64_vec(), &gw[k_].to_f64_vec());
                assert!(e <= tol(dt), "case {n} {dt} gradient {k_}: rel err {e:.3e}");
            }
        }
    }
}

/// f32 attention, forward and backward, against the CPU in f64: FP32's level — relative
/// error ≤ 2e-5, where one TF32 pass gives about 1e-3 (the CUDA-core kernels, or 3xTF32 on
/// tensor cores) — and a `--dtype tf32` session (one TF32 pass on tensor cores) within 2e-3.
pub fn f32_accuracy() {
    if !cuda_present() {
        return;
    }
    let (q, k, v, dy) = (
        randn(&[1, 2, 256, 64], 901),
        randn(&[1, 2, 256, 64], 902),
        randn(&[1, 2, 256, 64], 903),
        randn(&[1, 2, 256, 64], 904),
    );
    let causal = [("is_causal", A::Int(1))];
    let f64s =
        |ts: &[&Tensor]| -> Vec<Arg> { ts.iter().map(|t| inp(t.cast(DType::F64))).collect() };
    let f32s =
        |ts: &[&Tensor]| -> Vec<Arg> { ts.iter().map(|t| inp(t.cast(DType::F32))).collect() };
    let cuda = |name: &str, args: &[Arg], n_out: usize, tf32: bool| -> Vec<Tensor> {
        let g = one_node_graph(op(name, &causal), args, n_out);
        let feeds = feeds_of(args);
        let opts = graphrun::SessionOptions {
            backend: BackendKind::Cuda,
            tf32,
            ..graphrun::SessionOptions::unfused()
        };
        graphrun::Session::new(g, opts)
            .and_then(|mut s| s.run(&feeds))
            .unwrap_or_else(|e| panic!("{name} on cuda (tf32 {tf32}): {e}"))
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    };
    let want = run_raw(
        BackendKind::Cpu,
        op("Attention", &causal),
        &f64s(&[&q, &k, &v]),
        2,
    )
    .expect("cpu f64 forward");
    let bargs = |d: DType| -> Vec<Arg> {
        [&dy, &q, &k, &v, &want[0], &want[1]]
            .iter()
            .map(|t| inp(t.cast(d)))
            .collect()
    };
    let gwant = run_raw(
        BackendKind::Cpu,
        op("AttentionGrad", &causal),
        &bargs(DType::F64),
        3,
    )
    .expect("cpu f64 backward");
    for (tf32, limit) in [(false, 2e-5), (true, 2e-3)] {
        let got = cuda("Attention", &f32s(&[&q, &k, &v]), 2, tf32);
        let ggot = cuda("AttentionGrad", &bargs(DType::F32), 3, tf32);
        for (what, g, w) in [
            ("Y", &got[0], &want[0]),
            ("LSE", &got[1], &want[1]),
            ("dQ", &ggot[0], &gwant[0]),
            ("dK", &ggot[1], &gwant[1]),
            ("dV", &ggot[2], &gwant[2]),
        ] {
            let e = rel_err(&g.to_f64_vec(), &w.to_f64_vec());
            println!("tf32 {tf32}: {what} rel err {e:.3e}");
            assert!(
                e <= limit,
                "tf32 {tf32}: {what} rel err {e:.3e} > {limit:.0e}"
            );
        }
    }
}
