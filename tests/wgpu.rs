//! WebGPU-specific checks against the CPU backend: sizes that cross workgroup and GEMM
//! tile boundaries, the FusedMatMul epilogue and its backward, attention, the Dropout
//! mask bit for bit, optimizer steps, and the errors for dtypes WGSL does not have.
//! Shapes stay small: CI runs these on lavapipe (software Vulkan, ~1 GFLOP/s).

mod common;
use common::*;
use graphrun::graph::op::AttrValue as A;
use graphrun::{BackendKind, DType, Tensor};

/// Runs `op` on the CPU and on wgpu in `dt` and compares every output (SPEC §8).
fn same_as_cpu(name: &str, attrs: &[(&str, A)], args: &[Arg], n_out: usize, dts: &[DType]) {
    if !wgpu_present() {
        return;
    }
    for &dt in dts.iter().filter(|&&dt| computes(BackendKind::Wgpu, dt)) {
        let want = run_op(BackendKind::Cpu, op(name, attrs), args, n_out, dt)
            .unwrap_or_else(|e| panic!("{name} on cpu {dt}: {e}"));
        let got = run_op(BackendKind::Wgpu, op(name, attrs), args, n_out, dt)
            .unwrap_or_else(|e| panic!("{name} on wgpu {dt}: {e}"));
        for (k, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(w.shape(), g.shape(), "{name} {dt} output {k}");
            let tl = if w.dtype().is_float() { tol(dt) } else { 0.0 };
            let e = rel_err(&g.to_f64_vec(), &w.to_f64_vec());
            assert!(
                e <= tl,
                "{name} {dt} output {k}: rel err {e:.3e} > {tl:.0e}"
            );
        }
    }
}

const LOW: [DType; 2] = [DType::F32, DType::F16];

/// GatedMatMul (Y alone, and with G and U) and GatedMatMulGrad against the CPU, across
/// several thread blocks, for the gates the exporters' MLPs use.
#[test]
fn gated_matmul_matches_cpu() {
    for (name, attrs, args, n_out) in gated_matmul_cases() {
        same_as_cpu(name, &attrs, &args, n_out, &LOW);
    }
}

/// Rotary and its gradient against the CPU: both pairings, Cos and Sin broadcast from
/// [S, D] and [B, 1, S, D], across several thread blocks.
#[test]
fn rotary_matches_cpu() {
    let x = randn(&[2, 3, 70, 16], 60);
    for interleaved in [0, 1] {
        let attrs = [("interleaved", A::Int(interleaved))];
        for cs in [&[70, 16][..], &[2, 1, 70, 16]] {
            let (c, s) = (randn(cs, 61), randn(cs, 62));
            let args = [inp(x.clone()), inp(c.clone()), inp(s.clone())];
            same_as_cpu("Rotary", &attrs, &args, 1, &LOW);
            same_as_cpu("RotaryGrad", &attrs, &args, 1, &LOW);
        }
    }
}

#[test]
fn rows_and_elementwise_across_workgroups() {
    let x = randn(&[67, 300], 1);
    for name in ["Gelu", "Tanh", "Erf", "Sigmoid"] {
        same_as_cpu(name, &[], &[inp(x.clone())], 1, &LOW);
    }
    for axis in [-1, 0] {
        same_as_cpu(
            "Softmax",
            &[("axis", A::Int(axis))],
            &[inp(x.clone())],
            1,
            &LOW,
        );
    }
    same_as_cpu(
        "ReduceMax",
        &[("axes", A::Ints(vec![0]))],
        &[inp(x.clone())],
        1,
        &LOW,
    );
    same_as_cpu(
        "LayerNormalization",
        &[("axis", A::Int(-1))],
        &[inp(x.clone()), inp(randn(&[300], 2)), inp(randn(&[300], 3))],
        3,
        &LOW,
    );
    same_as_cpu(
        "RMSNormalization",
        &[("axis", A::Int(-1))],
        &[inp(x.clone()), inp(randn(&[300], 2))],
        2,
        &LOW,
    );
    // The residual forms: S = X + R written (the last output) and normalized.
    let r = randn(&[67, 300], 4);
    same_as_cpu(
        "AddLayerNormalization",
        &[("axis", A::Int(-1))],
        &[
            inp(x.clone()),
            inp(randn(&[300], 2)),
            inp(randn(&[300], 3)),
            inp(r.clone()),
        ],
        4,
        &LOW,
    );
    same_as_cpu(
        "AddRMSNormalization",
        &[("axis", A::Int(-1))],
        &[inp(x.clone()), inp(randn(&[300], 2)), inp(r)],
        3,
        &LOW,
    );
}

#[test]
fn long_reductions_split_over_workgroups() {
    // Few outputs of more than 8192 elements each take the two-pass reduction: 3 outputs
    // of 9000 strided elements (2 parts each), and all 20100 elements into one (3 parts).
    let x = randn(&[30, 3, 300], 31);
    let all = randn(&[67, 300], 32);
    for name in ["ReduceSum", "ReduceMean", "ReduceMax"] {
        same_as_cpu(
            name,
            &[("axes", A::Ints(vec![0, 2]))],
            &[inp(x.clone())],
            1,
            &LOW,
        );
        same_as_cpu(
            name,
            &[("keepdims", A::Int(0))],
            &[inp(all.clone())],
            1,
            &LOW,
        );
    }
}

#[test]
fn gemm_tiles_and_fused_epilogue() {
    // 70 × 90 × 33 crosses the 64 × 64 output tile and the 16-deep K step.
    let a = randn(&[2, 70, 33], 4);
    let b = randn(&[33, 90], 5);
    same_as_cpu("MatMul", &[], &[inp(a.clone()), inp(b.clone())], 1, &LOW);
    for act in ["relu", "gelu", "gelu_tanh", "silu"] {
        same_as_cpu(
            "FusedMatMul",
            &[("activation", A::Str(act.into()))],
            &[
                inp(a.clone()),
                inp(b.clone()),
                inp(randn(&[90], 6)),
                inp(randn(&[2, 70, 90], 7)),
            ],
            2,
            &[DType::F32],
        );
    }
    let fwd = [("activation", A::Str("gelu".into()))];
    let pre = run_op(
        BackendKind::Cpu,
        op("FusedMatMul", &fwd),
        &[inp(a.clone()), inp(b.clone()), inp(randn(&[90], 6))],
        2,
        DType::F32,
    )
    .expect("cpu forward");
    same_as_cpu(
        "FusedMatMulGrad",
        &fwd,
        &[
            inp(randn(&[2, 70, 90], 8)),
            inp(a),
            inp(b),
            inp(pre[1].clone()),
        ],
        3,
        &[DType::F32],
    );
}

#[test]
fn gemm128_vec4_layouts_edges_and_backward() {
    // Shapes that take the 128 × 128 vec4 kernel (K a multiple of 4, at least 8 of its
    // tiles per product) with edges everywhere: M = 132 and N = 520 end inside a tile and
    // K = 132 inside the 8-deep step. The forward reads A along k and B along n (B along
    // k with trans_b); the backward's products read A along m (dB = Aᵀ·G) and B along k
    // (dA = G·Bᵀ), so every vec4 layout and the whole epilogue run through it.
    let a = randn(&[2, 132, 132], 21);
    same_as_cpu(
        "MatMul",
        &[],
        &[inp(a.clone()), inp(randn(&[132, 520], 22))],
        1,
        &LOW,
    );
    for trans_b in [false, true] {
        let b = if trans_b {
            randn(&[520, 132], 22)
        } else {
            randn(&[132, 520], 22)
        };
        let fwd = [
            ("activation", A::Str("gelu_tanh".into())),
            ("trans_b", A::Int(trans_b as i64)),
        ];
        let args = [inp(a.clone()), inp(b.clone()), inp(randn(&[520], 23))];
        let mut with_res = args.to_vec();
        with_res.push(inp(randn(&[2, 132, 520], 24)));
        same_as_cpu("FusedMatMul", &fwd, &with_res, 2, &LOW);
        let pre = run_op(
            BackendKind::Cpu,
            op("FusedMatMul", &fwd),
            &args,
            2,
            DType::F32,
        )
        .expect("cpu forward");
        same_as_cpu(
            "FusedMatMulGrad",
            &fwd,
            &[
                inp(randn(&[2, 132, 520], 25)),
                inp(a.clone()),
                inp(b),
                inp(pre[1].clone()),
            ],
            3,
            &[DType::F32],
        );
    }
}

#[test]
fn attention_forward_and_backward() {
    // GQA (4 query heads on 2 KV heads), causal.
    let (q, k, v) = (
        randn(&[1, 4, 19, 8], 9),
        randn(&[1, 2, 23, 8], 10),
        randn(&[1, 2, 23, 8], 11),
    );
    let attrs = [("is_causal", A::Int(1))];
    same_as_cpu(
        "Attention",
        &attrs,
        &[inp(q.clone()), inp(k.clone()), inp(v.clone())],
        2,
        &LOW,
    );
    let fwd = run_op(
        BackendKind::Cpu,
        op("Attention", &attrs),
        &[inp(q.clone()), inp(k.clone()), inp(v.clone())],
        2,
        DType::F32,
    )
    .expect("cpu forward");
    same_as_cpu(
        "AttentionGrad",
        &attrs,
        &[
            inp(randn(&[1, 4, 19, 8], 12)),
            inp(q),
            inp(k),
            inp(v),
            inp(fwd[0].clone()),
            inp(fwd[1].clone()),
        ],
        3,
        &[DType::F32],
    );
}

/// Forward (f32, f16) then backward (f32, from the CPU's Y and LSE) of an attention op
/// against the CPU. `ins` are the forward's inputs with `extra` (a mask) after Y and LSE
/// in the backward for Attention, while VarlenAttention's cu_seqlens stay before them.
fn attention_same_as_cpu(
    name: &str,
    attrs: &[(&str, A)],
    ins: &[Arg],
    mask: Option<Arg>,
    n_grads: usize,
) {
    let mut fwd_args = ins.to_vec();
    fwd_args.extend(mask.clone());
    same_as_cpu(name, attrs, &fwd_args, 2, &LOW);
    let yl =
        run_op(BackendKind::Cpu, op(name, attrs), &fwd_args, 2, DType::F32).expect("cpu forward");
    let q = match &ins[0] {
        Arg::In(t) => t.shape().to_vec(),
        _ => unreachable!(),
    };
    let mut dy_shape = q.clone();
    *dy_shape.last_mut().unwrap() = yl[0].shape().last().copied().unwrap();
    let mut args = vec![inp(randn(&dy_shape, 77))];
    args.extend(ins.iter().cloned());
    args.extend(yl.into_iter().map(inp));
    args.extend(mask);
    same_as_cpu(&format!("{name}Grad"), attrs, &args, n_grads, &[DType::F32]);
}

/// LayerNormalization's and RMSNormalization's gradients (all three outputs, and dX with
/// the residual input) against the CPU's, from the CPU's statistics, in f32.
#[test]
fn normalization_grads_match_cpu() {
    let (x, g) = (randn(&[37, 300], 50), rand(&[300], 51, 0.5, 1.5));
    let (dy, r) = (randn(&[37, 300], 52), randn(&[37, 300], 53));
    for (fwd, outs) in [("LayerNormalization", 3), ("RMSNormalization", 2)] {
        let ins = [inp(x.clone()), inp(g.clone())];
        let stats = run_op(BackendKind::Cpu, op(fwd, &[]), &ins, outs, DType::F32).unwrap();
        let mut args = vec![inp(dy.clone()), inp(x.clone()), inp(g.clone())];
        args.extend(stats[1..].iter().map(|s| inp(s.clone())));
        let grad = format!("{fwd}Grad");
        same_as_cpu(&grad, &[], &args, outs, &[DType::F32]);
        args.push(inp(r.clone()));
        same_as_cpu(&grad, &[], &args, outs, &[DType::F32]);
    }
}

#[test]
fn attention_several_tiles_match_cpu() {
    // Query blocks of 64 and key tiles of 32 rows (D = 16) or 25 (D = 40): several of
    // each, the last ones partial; causal with fewer and more queries than keys, GQA,
    // both mask kinds (one fully masked row), VarlenAttention across block boundaries.
    let causal = [("is_causal", A::Int(1))];
    let qkv = |b, hq, hkv, sq, skv, d, dv, seed| {
        attention_qkv([b, hq, hkv, sq, skv, d, dv], seed, false).map(inp)
    };
    attention_same_as_cpu(
        "Attention",
        &causal,
        &qkv(2, 4, 2, 150, 100, 16, 16, 30),
        None,
        3,
    );
    attention_same_as_cpu(
        "Attention",
        &[],
        &qkv(1, 4, 1, 70, 130, 16, 16, 33),
        None,
        3,
    );
    let add = randn(&[1, 2, 1, 200], 36);
    attention_same_as_cpu(
        "Attention",
        &causal,
        &qkv(1, 2, 2, 70, 200, 40, 24, 37),
        Some(inp(add)),
        4,
    );
    let (sq, skv) = (130, 70);
    let mut r = graphrun::rng::Rng::new(40);
    let mut keep: Vec<bool> = (0..sq * skv).map(|_| r.uniform() < 0.7).collect();
    keep[66 * skv..67 * skv].fill(false); // row 66 sees nothing: output 0
    attention_same_as_cpu(
        "Attention",
        &[],
        &qkv(2, 2, 2, sq, skv, 16, 16, 41),
        Some(inp(bools(&[sq, skv], &keep))),
        3,
    );
    // VarlenAttention: an empty sequence, one with queries but no keys, blocks of 64
    // packed positions spanning several sequences.
    let cu = |l: &[i32]| {
        let mut c = vec![0i32];
        for &x in l {
            c.push(c.last().unwrap() + x);
        }
        c
    };
    let (lq, lk) = ([70, 0, 5, 90, 3], [40, 3, 0, 130, 9]);
    let (cq, ck) = (cu(&lq), cu(&lk));
    let (tq, tk) = (*cq.last().unwrap() as usize, *ck.last().unwrap() as usize);
    for attrs in [&causal[..], &[]] {
        let ins = [
            inp(randn(&[tq, 4, 16], 50)),
            inp(randn(&[tk, 2, 16], 51)),
            inp(randn(&[tk, 2, 8], 52)),
            inp(Tensor::from_vec(&[cq.len()], cq.clone()).unwrap()),
            inp(Tensor::from_vec(&[ck.len()], ck.clone()).unwrap()),
        ];
        attention_same_as_cpu("VarlenAttention", attrs, &ins, None, 3);
    }
}

#[test]
fn attention_3d_matches_cpu() {
    // The 3-D form [B, S, H·D], read in place through the shaders' row strides: GQA and
    // causal with more queries than keys over several tiles, both mask kinds, Dv ≠ D.
    let heads = |hq, hkv, causal| heads_attrs(hq, hkv, causal == 1);
    let qkv = |b, hq, hkv, sq, skv, d, dv, seed| {
        attention_qkv([b, hq, hkv, sq, skv, d, dv], seed, true).map(inp)
    };
    attention_same_as_cpu(
        "Attention",
        &heads(4, 2, 1),
        &qkv(2, 4, 2, 150, 100, 16, 16, 60),
        None,
        3,
    );
    let add = randn(&[2, 1, 1, 130], 63);
    attention_same_as_cpu(
        "Attention",
        &heads(2, 1, 0),
        &qkv(2, 2, 1, 70, 130, 16, 8, 64),
        Some(inp(add)),
        4,
    );
    let (sq, skv) = (90, 70);
    let mut r = graphrun::rng::Rng::new(67);
    let mut keep: Vec<bool> = (0..sq * skv).map(|_| r.uniform() < 0.7).collect();
    keep[66 * skv..67 * skv].fill(false); // row 66 sees nothing: output 0
    attention_same_as_cpu(
        "Attention",
        &heads(2, 2, 1),
        &qkv(1, 2, 2, sq, skv, 16, 16, 68),
        Some(inp(bools(&[sq, skv], &keep))),
        3,
    );
}

#[test]
fn dropout_mask_matches_cpu() {
    if !wgpu_present() {
        return;
    }
    let x = randn(&[1027], 15);
    let node = op("Dropout", &[("ratio", A::Float(0.3)), ("seed", A::Int(7))]);
    let args = [inp(x), Arg::None, cst(Tensor::scalar(graphrun::Bool::TRUE))];
    let cpu = run_op(BackendKind::Cpu, node.clone(), &args, 2, DType::F32).expect("cpu");
    let gpu = run_op(BackendKind::Wgpu, node, &args, 2, DType::F32).expect("wgpu");
    assert_eq!(cpu[1], gpu[1], "masks differ");
    assert_eq!(cpu[0], gpu[0], "outputs differ");
}

#[test]
fn dtypes_without_wgsl_type_are_errors() {
    if !wgpu_present() {
        return;
    }
    for dt in [DType::F64, DType::BF16] {
        let e = run_op(
            BackendKind::Wgpu,
            op("Relu", &[]),
            &[inp(randn(&[4], 1))],
            1,
            dt,
        )
        .expect_err("no silent fallback")
        .to_string();
        assert!(
            e.contains("node 'node'")
                && e.contains("Relu")
                && e.contains(dt.name())
                && e.contains("wgpu"),
            "{e}"
        );
    }
}

#[test]
fn shape_ops_move_any_dtype() {
    // i64, bool and f16 elements are moved as raw words.
    let x = i64s(&[3, 5], &(0..15).collect::<Vec<_>>());
    same_as_cpu("Transpose", &[], &[inp(x.clone())], 1, &[DType::F32]);
    let m = bools(&[3, 5], &[true, false, true, true, false].repeat(3));
    same_as_cpu("Transpose", &[], &[inp(m.clone())], 1, &[DType::F32]);
    same_as_cpu(
        "Where",
        &[],
        &[inp(m), inp(randn(&[3, 5], 3)), inp(randn(&[5], 4))],
        1,
        &LOW,
    );
    same_as_cpu(
        "Concat",
        &[("axis", A::Int(1))],
        &[inp(randn(&[3, 5], 5)), inp(randn(&[3, 2], 6))],
        1,
        &LOW,
    );
    same_as_cpu(
        "Gather",
        &[],
        &[inp(randn(&[7, 3], 7)), inp(i64s(&[4], &[0, 6, -1, 2]))],
        1,
        &LOW,
    );
    same_as_cpu(
        "Cast",
        &[("to", A::Str("int64".into()))],
        &[inp(randn(&[9], 8))],
        1,
        &LOW,
    );
}

#[test]
fn device_out_of_memory_is_an_error_naming_the_node() {
    if !wgpu_present() {
        return;
    }
    out_of_memory_names_the_node(BackendKind::Wgpu);
}

/// Attention on a packed QKV (K and V omitted; the parts are copied around the shaders),
/// forward and backward, against the CPU.
#[test]
fn packed_qkv_attention() {
    if !wgpu_present() {
        return;
    }
    packed_qkv_same_as_cpu(BackendKind::Wgpu, &LOW);
}

/// FusedMatMulGrad with `a_activation` (fc2's gradient after `dact_into_da`): dA times
/// act'(PreA), the product through scratch, with a shared and a batched B.
#[test]
fn fused_matmul_grad_with_a_activation() {
    a_activation_cases(&["gelu_tanh", "relu", "silu"], |_, at, args| {
        same_as_cpu("FusedMatMulGrad", at, args, 4, &LOW);
    });
}
