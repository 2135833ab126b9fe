//! CUDA-specific checks against the CPU backend: ops in every float dtype at sizes that
//! cross block and tile boundaries, GEMM epilogues, long-sequence attention and its
//! backward. Each test skips with a printed reason where there is no GPU.

mod common;
use common::*;
#[path = "common/attention_cuda.rs"]
mod attention_cuda;
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

/// Runs `node` in a `--dtype tf32` CUDA session (f32 inputs, TF32 products) and checks
/// every output within SPEC §8's 1e-3 of the CPU's true f32.
fn tf32_same_as_cpu(what: &str, node: graphrun::graph::Op, args: &[Arg], n_out: usize) {
    let args: Vec<Arg> = args
        .iter()
        .map(|x| match x {
            Arg::In(t) => inp(t.cast(DType::F32)),
            x => x.clone(),
        })
        .collect();
    let want = run_op(BackendKind::Cpu, node.clone(), &args, n_out, DType::F32).expect("cpu");
    let feeds = feeds_of(&args);
    let opts = graphrun::SessionOptions {
        backend: BackendKind::Cuda,
        tf32: true,
        ..graphrun::SessionOptions::unfused()
    };
    let got = graphrun::Session::new(one_node_graph(node, &args, n_out), opts)
        .and_then(|mut s| s.run(&feeds))
        .unwrap_or_else(|e| panic!("{what} on cuda tf32: {e}"));
    for (k, (w, (_, g))) in want.iter().zip(&got).enumerate() {
        let e = rel_err(&g.to_f64_vec(), &w.to_f64_vec());
        assert!(e <= 1e-3, "{what} tf32 output {k}: rel err {e:.3e} > 1e-3");
    }
}

/// Rotary and its gradient against the CPU: both pairings, Cos and Sin broadcast from
/// [S, D] and [B, 1, S, D], across several thread blocks; halves of 8 (four pairs a
/// thread) and of 6 (one pair a thread).
/// GatedMatMul (Y alone, and with G and U) and GatedMatMulGrad against the CPU, across
/// several thread blocks, for the gates the exporters' MLPs use.
#[test]
fn gated_matmul_matches_cpu() {
    for (name, attrs, args, n_out) in gated_matmul_cases() {
        same_as_cpu(name, &attrs, &args, n_out, &LOW);
    }
}

#[test]
fn rotary_matches_cpu() {
    for d in [16, 12] {
        let x = randn(&[2, 3, 70, d], 60);
        for interleaved in [0, 1] {
            let attrs = [("interleaved", A::Int(interleaved))];
            for cs in [&[70, d][..], &[2, 1, 70, d]] {
                let (c, s) = (randn(cs, 61), randn(cs, 62));
                let args = [inp(x.clone()), inp(c.clone()), inp(s.clone())];
                same_as_cpu("Rotary", &attrs, &args, 1, &LOW);
                same_as_cpu("RotaryGrad", &attrs, &args, 1, &LOW);
            }
        }
    }
}

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
fn contiguous_binary_maps_take_the_vector_path() {
    // Same-shape operands and scalar ones, in sizes that fill whole 16-byte vectors for
    // every dtype (the vector kernel) and sizes that do not (the strided walk), against
    // the CPU; integers exactly.
    for shape in [&[64usize, 1024][..], &[8, 129]] {
        let a = randn(shape, 11);
        let b = rand(shape, 12, 0.5, 2.0);
        let s = rand(&[], 13, 0.5, 2.0);
        for name in ["Add", "Sub", "Mul", "Div"] {
            same_as_cpu(name, &[], &[inp(a.clone()), inp(b.clone())], 1, &LOW);
            same_as_cpu(name, &[], &[inp(a.clone()), cst(s.clone())], 1, &LOW);
            same_as_cpu(name, &[], &[cst(s.clone()), inp(b.clone())], 1, &LOW);
        }
        // dY·f'(X) takes the 16-byte path as well where the operands are the output's shape.
        for name in ["GeluGrad", "SigmoidGrad", "TanhGrad", "ReluGrad"] {
            same_as_cpu(name, &[], &[inp(a.clone()), inp(b.clone())], 1, &LOW);
        }
        let (i, j) = (rand_ints(shape, 14, -50, 50), rand_ints(shape, 15, 1, 9));
        for name in ["Add", "Sub", "Mul", "Div"] {
            same_as_cpu(
                name,
                &[],
                &[inp(i.clone()), inp(j.clone())],
                1,
                &[DType::I64],
            );
        }
    }
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
            let what = format!("{act} ({} inputs)", args.len());
            tf32_same_as_cpu(&what, op("FusedMatMul", &at), &args, n_out);
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

/// More (query block, head) items than an H100 has SMs, so that the persistent forward
/// (cuda/flash.cu fa_fwd_wsp) runs several items a CTA (Q's two buffers, the K/V ring
/// across items, the work counter), with partial query blocks, GQA, causal with Sq > Skv,
/// head counts that leave a partial chunk, and a mask; each run four times in one session,
/// so that the later runs replay a recorded CUDA graph (the counter's memset included).
#[test]
fn attention_many_query_blocks() {
    if !cuda_present() {
        return;
    }
    let keep: Vec<bool> = (0..130 * 257).map(|i| (i * 7919) % 10 < 8).collect();
    let cases = [
        (3, 20, 5, 400, 300, true, None),
        (4, 48, 16, 130, 257, false, None),
        (4, 48, 16, 130, 257, true, Some(bools(&[130, 257], &keep))),
    ];
    for (n, (b, hq, hkv, sq, skv, causal, mask)) in cases.into_iter().enumerate() {
        let seed = 700 + 10 * n as u64;
        let mut args = vec![
            inp(randn(&[b, hq, sq, 64], seed)),
            inp(randn(&[b, hkv, skv, 64], seed + 1)),
            inp(randn(&[b, hkv, skv, 64], seed + 2)),
        ];
        if let Some(m) = mask {
            args.push(inp(m));
        }
        let attrs = [("is_causal", A::Int(causal as i64))];
        for dt in [DType::F16, DType::BF16] {
            let args: Vec<Arg> = args
                .iter()
                .map(|a| match a {
                    Arg::In(t) if t.dtype().is_float() => inp(t.cast(dt)),
                    a => a.clone(),
                })
                .collect();
            let want = run_raw(BackendKind::Cpu, op("Attention", &attrs), &args, 2).expect("cpu");
            let feeds = feeds_of(&args);
            let mut s = graphrun::Session::new(
                one_node_graph(op("Attention", &attrs), &args, 2),
                graphrun::SessionOptions {
                    backend: BackendKind::Cuda,
                    ..graphrun::SessionOptions::unfused()
                },
            )
            .expect("cuda session");
            for run in 0..4 {
                let got = s.run(&feeds).expect("cuda attention");
                for (k, (w, (_, g))) in want.iter().zip(&got).enumerate() {
                    let e = rel_err(&g.to_f64_vec(), &w.to_f64_vec());
                    assert!(
                        e <= tol(dt),
                        "case {n} {dt} run {run} output {k}: rel err {e:.3e}"
                    );
                }
            }
        }
    }
}

/// Forward (f32, f16, bf16) and backward (f32, from the CPU's Y and LSE) of the
/// 3-D form `[B, S, H·D]` against the CPU: `extra` goes after Q, K, V (forward) and after
/// Y and LSE (backward).
fn attention_3d_same_as_cpu(
    attrs: &[(&str, A)],
    qkv: [Tensor; 3],
    extra: Option<Arg>,
    n_grads: usize,
) {
    let mut fargs: Vec<Arg> = qkv.iter().cloned().map(inp).collect();
    fargs.extend(extra.clone());
    same_as_cpu("Attention", attrs, &fargs, 2, &LOW);
    let fwd = run_op(
        BackendKind::Cpu,
        op("Attention", attrs),
        &fargs,
        2,
        DType::F32,
    )
    .expect("cpu attention");
    let mut args = vec![inp(randn(fwd[0].shape(), 99))];
    args.extend(qkv.into_iter().map(inp));
    args.extend(fwd.into_iter().map(inp));
    args.extend(extra);
    same_as_cpu("AttentionGrad", attrs, &args, n_grads, &[DType::F32]);
}

#[test]
fn attention_3d_matches_cpu() {
    let heads = |hq, hkv, causal| heads_attrs(hq, hkv, causal == 1);
    let qkv =
        |b, hq, hkv, sq, skv, d, dv, seed| attention_qkv([b, hq, hkv, sq, skv, d, dv], seed, true);
    // gpt_block's heads of 64 (the tiled kernels), GQA, causal with Sq ≠ Skv.
    attention_3d_same_as_cpu(&heads(4, 2, 1), qkv(2, 4, 2, 300, 200, 64, 64, 80), None, 3);
    attention_3d_same_as_cpu(&heads(2, 2, 1), qkv(1, 2, 2, 130, 260, 64, 64, 83), None, 3);
    // An additive key-padding mask; heads of 96 (the row-per-warp kernels backward).
    let add = randn(&[2, 1, 1, 150], 86);
    attention_3d_same_as_cpu(
        &heads(2, 1, 0),
        qkv(2, 2, 1, 70, 150, 96, 96, 87),
        Some(inp(add)),
        4,
    );
    let keep: Vec<bool> = (0..70 * 150).map(|i| i % 5 != 0).collect();
    attention_3d_same_as_cpu(
        &heads(2, 2, 1),
        qkv(1, 2, 2, 70, 150, 32, 16, 90),
        Some(inp(bools(&[70, 150], &keep))),
        3,
    );
}

#[test]
fn dropout_mask_matches_cpu() {
    if !cuda_present() {
        return;
    }
    let x = randn(&[4097], 15);
    let node = op("Dropout", &[("ratio", A::Float(0.3)), ("seed", A::Int(7))]);
    let training = Tensor::scalar(graphrun::Bool::TRUE);
    let ratio = Tensor::scalar(0.3f32);
    let args = [inp(x), cst(ratio), cst(training)];
    let cpu = run_op(BackendKind::Cpu, node.clone(), &args, 2, DType::F32).expect("cpu");
    let gpu = run_op(BackendKind::Cuda, node, &args, 2, DType::F32).expect("cuda");
    assert_eq!(cpu[1], gpu[1], "masks differ");
    assert_eq!(cpu[0], gpu[0], "outputs differ");
}

/// The tiled attention kernels against the CPU, forward and backward
/// (attention_cuda::tiled_kernels_forward_and_backward); f32 on the default kernels.
#[test]
fn attention_tiled_kernels_forward_and_backward() {
    attention_cuda::tiled_kernels_forward_and_backward();
}

/// f32 attention (the default kernels) within 2e-5 of the CPU in f64, and a `--dtype
/// tf32` session (TF32 tensor cores, one pass) within 2e-3.
#[test]
fn attention_f32_and_tf32_accuracy() {
    attention_cuda::f32_accuracy();
}

#[test]
fn device_out_of_memory_is_an_error_naming_the_node() {
    if !cuda_present() {
        return;
    }
    out_of_memory_names_the_node(BackendKind::Cuda);
}

/// FusedMatMulGrad with `a_activation` (fc2's gradient after `dact_into_da`): dA times
/// act'(PreA) and dBiasA (its row sum), for gelu_tanh in bf16/f16 through cuBLASLt's
/// DGELU epilogue (DGELU_BGRAD with `Tuning::cublaslt_dgelu_bgrad`), otherwise by our
/// kernel after the product, then a row sum (a batched B takes that path too); under
/// tf32 within 1e-3 of the CPU's true f32.
#[test]
fn fused_matmul_grad_with_a_activation() {
    if !cuda_present() {
        return;
    }
    a_activation_cases(&["gelu_tanh", "relu", "gelu", "silu"], |act, at, args| {
        same_as_cpu("FusedMatMulGrad", at, args, 4, &LOW);
        if act == "gelu_tanh" {
            tf32_same_as_cpu(act, op("FusedMatMulGrad", at), args, 4);
        }
    });
}

/// Products whose rows are an odd number of elements long (as a vocabulary of 50 257 makes
/// them), big enough (2²⁴ multiply-adds) to run on copies with rows padded to 16 bytes:
/// every operand stored either way, C accumulated onto, a bias and an activation, and an
/// LM head's gradient (`x · Wᵀ` with 1001 columns), against the CPU.
#[test]
fn products_with_rows_of_odd_length() {
    let (m, k, n) = (131, 129, 1001);
    let mm = [inp(randn(&[m, k], 70)), inp(randn(&[k, n], 71))];
    same_as_cpu("MatMul", &[], &mm, 1, &LOW);
    for ta in [false, true] {
        for tb in [false, true] {
            let sa = if ta { [k, m] } else { [m, k] };
            let sb = if tb { [n, k] } else { [k, n] };
            let args = [
                inp(randn(&sa, 72)),
                inp(randn(&sb, 73)),
                inp(randn(&[m, n], 74)),
            ];
            let at = [
                ("beta", A::Float(-1.5)),
                ("transA", A::Int(ta as i64)),
                ("transB", A::Int(tb as i64)),
            ];
            same_as_cpu("Gemm", &at, &args, 1, &LOW);
        }
    }
    let fused = [
        inp(randn(&[m, k], 75)),
        inp(randn(&[n, k], 76)),
        inp(randn(&[n], 77)),
    ];
    let at = [
        ("activation", A::Str("relu".into())),
        ("trans_b", A::Int(1)),
    ];
    same_as_cpu("FusedMatMul", &at, &fused, 1, &LOW);
    let at = [
        ("activation", A::Str("none".into())),
        ("trans_b", A::Int(1)),
    ];
    let grad = [
        inp(randn(&[3, 45, 1001], 78)),
        inp(randn(&[3, 45, 129], 79)),
        inp(randn(&[1001, 129], 80)),
    ];
    same_as_cpu("FusedMatMulGrad", &at, &grad, 3, &LOW);
}

/// Attention on a packed QKV (K and V omitted): the kernels read the parts in place and
/// the backward writes them into one packed dQKV, against the CPU.
#[test]
fn packed_qkv_attention_in_place() {
    if !cuda_present() {
        return;
    }
    packed_qkv_same_as_cpu(BackendKind::Cuda, &LOW);
}

#[test]
fn layer_norm_rows_in_registers_and_scalar() {
    // Row lengths that take the vector kernels with 1, 2 and 4 vectors a thread (1024,
    // 4096; 24 is whole vectors for f32/f16/bf16), and ones that do not (1031, 8200,
    // 9000 for f32: too long), with and without bias, and RMSNormalization; then the
    // gradients (dX with and without the residual input, dScale, dB) from the CPU's
    // statistics, over more rows than the one-pass kernel has blocks.
    for (rows, n) in [
        (1100, 1024),
        (9, 4096),
        (33, 24),
        (7, 1031),
        (5, 8200),
        (3, 9000),
    ] {
        let x = randn(&[rows, n], 40 + n as u64);
        let g = rand(&[n], 41, 0.5, 1.5);
        let b = randn(&[n], 42);
        same_as_cpu(
            "LayerNormalization",
            &[],
            &[inp(x.clone()), inp(g.clone()), inp(b.clone())],
            3,
            &LOW,
        );
        same_as_cpu(
            "LayerNormalization",
            &[],
            &[inp(x.clone()), inp(g.clone())],
            1,
            &LOW,
        );
        same_as_cpu(
            "RMSNormalization",
            &[],
            &[inp(x.clone()), inp(g.clone())],
            2,
            &LOW,
        );
        // The residual forms: the sum written as the rows are read.
        let r = randn(&[rows, n], 45);
        same_as_cpu(
            "AddLayerNormalization",
            &[],
            &[
                inp(x.clone()),
                inp(g.clone()),
                inp(b.clone()),
                inp(r.clone()),
            ],
            4,
            &LOW,
        );
        same_as_cpu(
            "AddRMSNormalization",
            &[],
            &[inp(x.clone()), inp(g.clone()), inp(r)],
            3,
            &LOW,
        );
        if !cuda_present() {
            continue;
        }
        let dy = randn(&[rows, n], 43);
        let r = randn(&[rows, n], 44);
        for (dt, rms) in LOW.into_iter().flat_map(|dt| [(dt, false), (dt, true)]) {
            let c = |t: &Tensor| t.cast(dt);
            let (fwd, grad, outs) = match rms {
                false => ("LayerNormalization", "LayerNormalizationGrad", 3),
                true => ("RMSNormalization", "RMSNormalizationGrad", 2),
            };
            let ins = [inp(x.clone()), inp(g.clone())];
            let stats = run_op(BackendKind::Cpu, op(fwd, &[]), &ins, outs, dt).unwrap();
            for res in [false, true] {
                let mut args = vec![inp(c(&dy)), inp(c(&x)), inp(c(&g))];
                args.extend(stats[1..].iter().map(|s| inp(s.clone())));
                if res {
                    args.push(inp(c(&r)));
                }
                let run = |k| run_raw(k, op(grad, &[]), &args, outs).unwrap();
                let (want, got) = (run(BackendKind::Cpu), run(BackendKind::Cuda));
                for (k, (w, o)) in want.iter().zip(&got).enumerate() {
                    let e = rel_err(&o.to_f64_vec(), &w.to_f64_vec());
                    assert!(
                        e <= tol(dt),
                        "{grad} [{rows}, {n}] {dt} res {res} output {k}: rel err {e:.3e}"
                    );
                }
            }
        }
    }
}

/// A training step on CUDA against the CPU: 20 parameters (more than one `sgd_multi`
/// launch takes), SGD with and without momentum and weight decay, and Adam; losses
/// every step and the trained parameters within 1e-4.
#[test]
fn training_steps_match_cpu() {
    if !cuda_present() {
        return;
    }
    let layers = 10;
    let mut y = String::from(
        "graphrun: 1\nname: deep\ninputs:\n  - {name: x, dtype: f32, shape: [16, 24]}\n  \
         - {name: t, dtype: f32, shape: [16, 24]}\noutputs: [loss]\ninitializers:\n",
    );
    for l in 0..layers {
        y += &format!(
            "  - {{name: w{l}, dtype: f32, shape: [24, 24], init: {{dist: normal, std: 0.2, seed: {l}}}}}\n  \
             - {{name: b{l}, dtype: f32, shape: [24], init: {{dist: normal, std: 0.1, seed: {}}}}}\n",
            l + 100
        );
    }
    y += "nodes:\n";
    let mut prev = "x".to_string();
    for l in 0..layers {
        y += &format!(
            "  - {{op: MatMul, inputs: [{prev}, w{l}], outputs: [m{l}]}}\n  \
             - {{op: Add, inputs: [m{l}, b{l}], outputs: [a{l}]}}\n  \
             - {{op: Tanh, inputs: [a{l}], outputs: [h{l}]}}\n"
        );
        prev = format!("h{l}");
    }
    y += &format!(
        "  - {{op: Sub, inputs: [{prev}, t], outputs: [d]}}\n  \
         - {{op: Mul, inputs: [d, d], outputs: [d2]}}\n  \
         - {{op: ReduceMean, inputs: [d2], outputs: [loss], attrs: {{keepdims: 0}}}}\n\
         training:\n  loss: loss\n  optimizer: OPT\n"
    );
    let feeds: std::collections::HashMap<String, Tensor> = [
        ("x".to_string(), randn(&[16, 24], 1).cast(DType::F32)),
        ("t".to_string(), randn(&[16, 24], 2).cast(DType::F32)),
    ]
    .into();
    for opt in [
        "{sgd: {lr: 0.05}}",
        "{sgd: {lr: 0.05, momentum: 0.9, weight_decay: 0.01}}",
        "{adam: {lr: 0.01}}",
    ] {
        let text = y.replace("OPT", opt);
        let run = |backend| {
            let model = graphrun::Model::from_str(&text, ".").expect("model");
            let opts = graphrun::SessionOptions {
                backend,
                training: true,
                ..graphrun::SessionOptions::unfused()
            };
            let mut s = graphrun::Session::new(model.graph, opts).expect("session");
            let losses: Vec<f64> = (0..4).map(|_| s.train_step(&feeds).unwrap()).collect();
            let g = s.trained_graph().unwrap().clone();
            (losses, g)
        };
        let (lc, gc) = run(BackendKind::Cpu);
        let (lg, gg) = run(BackendKind::Cuda);
        for (k, (a, b)) in lc.iter().zip(&lg).enumerate() {
            assert!(
                (a - b).abs() <= 1e-4 * a.abs().max(1.0),
                "{opt} step {k}: {a} vs {b}"
            );
        }
        for (ic, ig) in gc.initializers.iter().zip(&gg.initializers) {
            let e = rel_err(&ig.tensor.to_f64_vec(), &ic.tensor.to_f64_vec());
            assert!(
                e <= 1e-4,
                "{opt}: '{}' trained on cuda: rel err {e:.2e}",
                ic.name
            );
        }
    }
}

/// Sessions on one GPU in several threads at once, each running convolutions of shapes of
/// its own (cuDNN loads each kernel at its first launch) several times over (the repeats
/// are recorded and replayed as CUDA graphs, and the first searches cuDNN's algorithms):
/// every result as the CPU's.
#[test]
fn sessions_in_threads_share_the_device() {
    if !cuda_present() {
        return;
    }
    let threads: Vec<_> = (0..6usize)
        .map(|t| {
            std::thread::spawn(move || {
                for k in 0..4usize {
                    let (c, hw) = (3 + t + k, 6 + (t * 3 + k) % 9);
                    let seed = (t * 10 + k) as u64;
                    let args = [
                        inp(rand(&[2, c, hw, hw], seed, -1.0, 1.0)),
                        inp(rand(&[8, c, 3, 3], seed + 100, -1.0, 1.0)),
                    ];
                    let stride = 1 + (k % 2) as i64;
                    let conv = || {
                        op(
                            "Conv",
                            &[
                                ("pads", A::Ints(vec![1, 1, 1, 1])),
                                ("strides", A::Ints(vec![stride, stride])),
                            ],
                        )
                    };
                    let want = run_raw(BackendKind::Cpu, conv(), &args, 1).unwrap();
                    let g = one_node_graph(conv(), &args, 1);
                    let opts = graphrun::SessionOptions {
                        backend: BackendKind::Cuda,
                        ..Default::default()
                    };
                    let mut s = graphrun::Session::new(g, opts).unwrap();
                    for run in 0..4 {
                        let got = s
                            .run(&feeds_of(&args))
                            .unwrap_or_else(|e| panic!("thread {t} conv {k} run {run}: {e}"));
                        let e = rel_err(&got[0].1.to_f64_vec(), &want[0].to_f64_vec());
                        assert!(e <= 1e-5, "thread {t} conv {k} run {run}: rel err {e:.2e}");
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}
