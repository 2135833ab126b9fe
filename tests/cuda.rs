//! CUDA-specific checks against the CPU backend: ops in every float dtype at sizes that
//! cross block and tile boundaries, GEMM epilogues, long-sequence attention and its
//! backward. Each test skips with a printed reason where there is no GPU.

mod common;
use common::*;
use graphrun::graph::op::AttrValue as A;
use graphrun::{BackendKind, DType, Tensor};

/// Runs `op` on the CPU and on CUDA in `dt` and compares every output (SPEC §8).
fn same_as_cpu(name: &str, attrs: &[(&str, A)], args: &[Arg], n_out: usize, dts: &[DType]) {
    if !cuda_present() {
        return;
    }
    for &dt in dts {
        let want = run_op(BackendKind::Cpu, op(name, attrs), args, n_out, dt)
            .unwrap_or_else(|e| panic!("{name} on cpu {dt}: {e}"));
        let got = run_op(BackendKind::Cuda, op(name, attrs), args, n_out, dt)
            .unwrap_or_else(|e| panic!("{name} on cuda {dt}: {e}"));
        for (k, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(w.shape(), g.shape(), "{name} {dt} output {k}");
            let tl = if w.dtype().is_float() {
                tol(dt).max(1e-9)
            } else {
                0.0
            };
            let e = rel_err(&g.to_f64_vec(), &w.to_f64_vec());
            assert!(
                e <= tl,
                "{name} {dt} output {k}: rel err {e:.3e} > {tl:.0e}"
            );
        }
    }
}

const LOW: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

#[test]
fn big_elementwise_and_rows() {
    let x = randn(&[257, 1031], 1);
    for name in ["Gelu", "Sigmoid", "Tanh", "Exp", "Relu"] {
        same_as_cpu(name, &[], &[inp(x.clone())], 1, &LOW);
    }
    same_as_cpu(
        "Softmax",
        &[("axis", A::Int(-1))],
        &[inp(x.clone())],
        1,
        &LOW,
    );
    same_as_cpu(
        "Softmax",
        &[("axis", A::Int(0))],
        &[inp(x.clone())],
        1,
        &LOW,
    );
    same_as_cpu(
        "ReduceSum",
        &[("axes", A::Ints(vec![0]))],
        &[inp(x.clone())],
        1,
        &LOW,
    );
    same_as_cpu(
        "ReduceMax",
        &[("axes", A::Ints(vec![1]))],
        &[inp(x.clone())],
        1,
        &LOW,
    );
    let g = randn(&[1031], 2);
    let b = randn(&[1031], 3);
    same_as_cpu(
        "LayerNormalization",
        &[],
        &[inp(x.clone()), inp(g), inp(b)],
        3,
        &LOW,
    );
    same_as_cpu(
        "Add",
        &[],
        &[inp(x.clone()), inp(randn(&[1, 1031], 4))],
        1,
        &LOW,
    );
}

#[test]
fn gemm_epilogues() {
    let a = randn(&[3, 70, 130], 5);
    let b = randn(&[130, 90], 6);
    let bias = randn(&[90], 7);
    let res = randn(&[3, 70, 90], 8);
    for act in [
        "none",
        "relu",
        "gelu",
        "gelu_tanh",
        "silu",
        "sigmoid",
        "tanh",
    ] {
        let at = [("activation", A::Str(act.into()))];
        same_as_cpu(
            "FusedMatMul",
            &at,
            &[inp(a.clone()), inp(b.clone()), inp(bias.clone())],
            1,
            &LOW,
        );
        same_as_cpu(
            "FusedMatMul",
            &at,
            &[
                inp(a.clone()),
                inp(b.clone()),
                inp(bias.clone()),
                inp(res.clone()),
            ],
            2,
            &LOW,
        );
    }
    same_as_cpu(
        "MatMul",
        &[],
        &[inp(randn(&[2, 1, 33, 17], 9)), inp(randn(&[3, 17, 41], 10))],
        1,
        &LOW,
    );
}

/// `--dtype tf32`: f32 products on TF32 and, for `gelu_tanh`, cuBLASLt's own GELU
/// epilogues (GELU_BIAS, and GELU_AUX_BIAS when Pre is asked for), within SPEC §8's 1e-3
/// of the CPU's true f32. The residual variants take our epilogue kernel after it.
#[test]
fn gemm_epilogues_tf32() {
    if !cuda_present() {
        return;
    }
    let a = randn(&[3, 70, 130], 5);
    let b = randn(&[130, 90], 6);
    let bias = randn(&[90], 7);
    let res = randn(&[3, 70, 90], 8);
    for act in ["gelu_tanh", "relu", "gelu"] {
        let at = [("activation", A::Str(act.into()))];
        for (args, n_out) in [
            (vec![inp(a.clone()), inp(b.clone()), inp(bias.clone())], 1),
            (vec![inp(a.clone()), inp(b.clone()), inp(bias.clone())], 2),
            (
                vec![
                    inp(a.clone()),
                    inp(b.clone()),
                    inp(bias.clone()),
                    inp(res.clone()),
                ],
                1,
            ),
        ] {
            let node = op("FusedMatMul", &at);
            let want =
                run_op(BackendKind::Cpu, node.clone(), &args, n_out, DType::F32).expect("cpu");
            let g = one_node_graph(node, &args, n_out);
            let feeds = args
                .iter()
                .enumerate()
                .filter_map(|(i, x)| match x {
                    Arg::In(t) => Some((format!("in{i}"), t.clone())),
                    _ => None,
                })
                .collect();
            let opts = graphrun::SessionOptions {
                backend: BackendKind::Cuda,
                tf32: true,
                ..Default::default()
            };
            let got = graphrun::Session::new(g, opts)
                .and_then(|mut s| s.run(&feeds))
                .unwrap_or_else(|e| panic!("{act} on cuda tf32: {e}"));
            for (k, (w, (_, g))) in want.iter().zip(&got).enumerate() {
                let e = rel_err(&g.to_f64_vec(), &w.to_f64_vec());
                assert!(
                    e <= 1e-3,
                    "{act} tf32 ({} inputs) output {k}: rel err {e:.3e} > 1e-3",
                    args.len()
                );
            }
        }
    }
}

#[test]
fn attention_long_sequence() {
    let q = randn(&[1, 4, 1024, 64], 11);
    let k = randn(&[1, 2, 1024, 64], 12);
    let v = randn(&[1, 2, 1024, 64], 13);
    for causal in [0, 1] {
        same_as_cpu(
            "Attention",
            &[("is_causal", A::Int(causal))],
            &[inp(q.clone()), inp(k.clone()), inp(v.clone())],
            2,
            &LOW,
        );
    }
    let dy = randn(&[1, 4, 1024, 64], 14);
    // A bool mask that hides every third key, with causal masking on top.
    let keep: Vec<bool> = (0..1024 * 1024).map(|i| i % 3 != 0).collect();
    let mask = bools(&[1024, 1024], &keep);
    let qkvm = [
        inp(q.clone()),
        inp(k.clone()),
        inp(v.clone()),
        cst(mask.clone()),
    ];
    let causal = [("is_causal", A::Int(1))];
    same_as_cpu("Attention", &causal, &qkvm, 2, &LOW);
    // The backward from the CPU's forward outputs, so only the gradient kernels differ.
    let fwd = run_op(
        BackendKind::Cpu,
        op("Attention", &causal),
        &qkvm,
        2,
        DType::F32,
    )
    .expect("cpu attention");
    same_as_cpu(
        "AttentionGrad",
        &causal,
        &[
            inp(dy),
            inp(q),
            inp(k),
            inp(v),
            inp(fwd[0].clone()),
            cst(fwd[1].clone()),
            cst(mask),
        ],
        3,
        &[DType::F32],
    );
}

#[test]
fn dropout_mask_matches_cpu() {
    if !cuda_present() {
        return;
    }
    let x = randn(&[4097], 15);
    let node = op("Dropout", &[("ratio", A::Float(0.3)), ("seed", A::Int(7))]);
    let training = Tensor::scalar(1u8);
    let ratio = Tensor::scalar(0.3f32);
    let args = [inp(x), cst(ratio), cst(training)];
    let cpu = run_op(BackendKind::Cpu, node.clone(), &args, 2, DType::F32).expect("cpu");
    let gpu = run_op(BackendKind::Cuda, node, &args, 2, DType::F32).expect("cuda");
    assert_eq!(cpu[1], gpu[1], "masks differ");
    assert_eq!(cpu[0], gpu[0], "outputs differ");
}

/// The tiled attention kernels (tensor cores for f16/bf16, FP32 tiles for f32), forward
/// and backward, against the CPU: tile-crossing and ragged lengths, GQA, causal with more
/// or fewer queries than keys, bool and additive masks (with dMask), head sizes that take
/// the 16-byte and the element-wise tile loads, Dv ≠ D.
#[test]
fn attention_tiled_kernels_forward_and_backward() {
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

/// f32 attention on tensor cores (cuda/flash_tf32.cu), forward and backward, against the
/// CPU in f64: 3xTF32 (the default) must stay at FP32's level — relative error ≤ 2e-5,
/// where one TF32 pass gives about 1e-3 — and a `--dtype tf32` session (one pass) within
/// 2e-3.
#[test]
fn attention_f32_tensor_cores_accuracy() {
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
        let feeds = args
            .iter()
            .enumerate()
            .filter_map(|(i, a)| match a {
                Arg::In(t) => Some((format!("in{i}"), t.clone())),
                _ => None,
            })
            .collect();
        let opts = graphrun::SessionOptions {
            backend: BackendKind::Cuda,
            tf32,
            ..Default::default()
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

#[test]
fn device_out_of_memory_is_an_error_naming_the_node() {
    if !cuda_present() {
        return;
    }
    out_of_memory_names_the_node(BackendKind::Cuda);
}
