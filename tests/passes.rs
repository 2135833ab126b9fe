//! The graph-rewrite passes: each rule on the smallest subgraph that shows it, the cases
//! where it must not fire, and the example models. Every optimized graph is validated
//! and run against the original on the CPU backend (relative error ≤ 1e-5).

use graphrun::graph::{Graph, Op};
use graphrun::passes::{optimize, PassOptions, Report, PASSES};
use graphrun::validate;
use graphrun::{Model, Session, SessionOptions};
use std::collections::BTreeMap;

// ---------------------------------------------------------------- harness

fn graph(body: &str) -> Graph {
    let text = format!("graphrun: 1\nname: t\n{body}");
    Model::from_str(&text, ".")
        .unwrap_or_else(|e| panic!("{e}\n{text}"))
        .graph
}

fn run_passes(g: &Graph, opts: &PassOptions) -> (Graph, Report) {
    let (o, r) = optimize(g, opts).unwrap_or_else(|e| panic!("optimize: {e}"));
    validate(&o).unwrap_or_else(|e| panic!("invalid result: {e}"));
    (o, r)
}

/// Runs `a` and `b` on the same seeded random inputs; every output must agree.
fn assert_same(a: &Graph, b: &Graph, dims: &[(&str, usize)]) {
    let dims: BTreeMap<String, usize> = dims.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    let feeds = Model { graph: a.clone() }.random_inputs(7, &dims).unwrap();
    let run = |g: &Graph| {
        let opts = SessionOptions {
            dims: dims.clone(),
            ..SessionOptions::unfused()
        };
        Session::new(g.clone(), opts)
            .unwrap()
            .run(&feeds)
            .unwrap_or_else(|e| panic!("run: {e}"))
    };
    let (ra, rb) = (run(a), run(b));
    assert_eq!(ra.len(), rb.len());
    for ((na, ta), (nb, tb)) in ra.iter().zip(&rb) {
        assert_eq!(na, nb);
        assert_eq!(
            (ta.dtype(), ta.shape()),
            (tb.dtype(), tb.shape()),
            "output {na}"
        );
        let (x, y) = (ta.to_f64_vec(), tb.to_f64_vec());
        assert!(
            x.iter().chain(&y).all(|v| v.is_finite()),
            "output {na} is not finite"
        );
        let diff: f64 = x
            .iter()
            .zip(&y)
            .map(|(p, q)| (p - q) * (p - q))
            .sum::<f64>()
            .sqrt();
        let norm: f64 = x.iter().map(|p| p * p).sum::<f64>().sqrt();
        let rel = if norm > 0.0 { diff / norm } else { diff };
        assert!(rel <= 1e-5, "output {na}: relative error {rel:e}");
    }
}

/// Runs the backward of `a` and `b` (gradients of every output, seeded with ones) on the
/// same seeded random inputs: every gradient must agree within 1e-4 (f32, summed in
/// another order by the fused kernels).
fn assert_same_grads(a: &Graph, b: &Graph, dims: &[(&str, usize)]) {
    let dims: BTreeMap<String, usize> = dims.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    let feeds = Model { graph: a.clone() }.random_inputs(7, &dims).unwrap();
    let grads = |g: &Graph| {
        let opts = SessionOptions {
            dims: dims.clone(),
            ..SessionOptions::unfused()
        };
        Session::new(g.clone(), opts)
            .unwrap()
            .backward(&feeds, &Default::default())
            .unwrap_or_else(|e| panic!("backward: {e}"))
            .grads
    };
    let (ga, gb) = (grads(a), grads(b));
    assert!(!gb.is_empty(), "no gradient to compare");
    for (n, x) in &ga {
        let x = x.to_f64_vec();
        // An initializer no output reads is pruned by the passes: its gradient is zero.
        let Some((_, y)) = gb.iter().find(|(m, _)| m == n) else {
            assert!(
                x.iter().all(|&v| v == 0.0),
                "{n} was pruned but has a gradient"
            );
            continue;
        };
        let y = y.to_f64_vec();
        let diff: f64 = x
            .iter()
            .zip(&y)
            .map(|(p, q)| (p - q) * (p - q))
            .sum::<f64>()
            .sqrt();
        let norm: f64 = x.iter().map(|p| p * p).sum::<f64>().sqrt();
        let rel = diff / norm.max(1e-6);
        assert!(rel <= 1e-4, "gradient of {n}: relative error {rel:e}");
    }
}

/// Outputs and gradients agree.
fn check_same(a: &Graph, b: &Graph, dims: &[(&str, usize)]) {
    assert_same(a, b, dims);
    assert_same_grads(a, b, dims);
}

/// Optimizes with the default pipeline and checks the result, and its gradients,
/// against the original.
fn fuse(body: &str) -> (Graph, Report) {
    let g = graph(body);
    let (o, r) = run_passes(&g, &PassOptions::default());
    check_same(&g, &o, &[]);
    (o, r)
}

/// Runs only the named pass.
fn only(pass: &str) -> PassOptions {
    PassOptions {
        disabled: PASSES
            .iter()
            .filter(|p| **p != pass)
            .map(|p| p.to_string())
            .collect(),
        training: false,
        ..Default::default()
    }
}

fn count(g: &Graph, op: &str) -> usize {
    g.nodes.iter().filter(|n| n.op.name() == op).count()
}

/// (activation, trans_b, inputs) of every FusedMatMul.
fn fused(g: &Graph) -> Vec<(&'static str, bool, Vec<String>)> {
    g.nodes
        .iter()
        .filter_map(|n| match n.op {
            Op::FusedMatMul {
                activation,
                trans_b,
            } => Some((activation.name(), trans_b, n.inputs.clone())),
            _ => None,
        })
        .collect()
}

/// (is_causal, scale, number of inputs) of every Attention.
fn attention(g: &Graph) -> Vec<(bool, f32, usize)> {
    g.nodes
        .iter()
        .filter_map(|n| match n.op {
            Op::Attention {
                is_causal, scale, ..
            } => Some((is_causal, scale.unwrap(), n.inputs.len())),
            _ => None,
        })
        .collect()
}

fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

// ---------------------------------------------------------------- MatMul epilogue

/// x[4, 8] @ w[8, 16] + b[16], a residual input and the constants of the expansions.
const MLP: &str = "
inputs:
  - {name: x, dtype: f32, shape: [4, 8]}
  - {name: res, dtype: f32, shape: [4, 16]}
initializers:
  - {name: w, dtype: f32, shape: [8, 16], init: {dist: xavier_uniform, seed: 1}}
  - {name: wt, dtype: f32, shape: [16, 8], init: {dist: xavier_uniform, seed: 4}}
  - {name: b, dtype: f32, shape: [16], init: {dist: uniform, low: -0.5, high: 0.5, seed: 2}}
  - {name: half, dtype: f32, shape: [], values: [0.5], trainable: false}
  - {name: one, dtype: f32, shape: [], values: [1.0], trainable: false}
  - {name: three, dtype: f32, shape: [], values: [3.0], trainable: false}
  - {name: gelu_c, dtype: f32, shape: [], values: [0.044715], trainable: false}
  - {name: s2pi, dtype: f32, shape: [], values: [0.7978845608028654], trainable: false}
  - {name: sqrt2, dtype: f32, shape: [], values: [1.4142135623730951], trainable: false}
  - {name: isqrt2, dtype: f32, shape: [], values: [0.7071067811865476], trainable: false}
";

fn mlp(outputs: &str, nodes: &str) -> String {
    format!("{MLP}outputs: [{outputs}]\nnodes:\n{nodes}")
}

const FC: &str = "  - {op: MatMul, inputs: [x, w], outputs: [h], name: fc}\n  - {op: Add, inputs: [h, b], outputs: [hb]}\n";

#[test]
fn bias_without_activation_fuses() {
    let (g, r) = fuse(&mlp("hb", FC));
    assert_eq!(fused(&g), vec![("none", false, strs(&["x", "w", "b"]))]);
    assert_eq!(g.nodes.len(), 1);
    assert_eq!(
        g.nodes[0].name, "fc",
        "the fused node keeps the MatMul's name"
    );
    assert_eq!(r.fired("matmul_epilogue"), 1);
}

#[test]
fn bias_first_operand_order_fuses() {
    let (g, _) = fuse(&mlp("y", "  - {op: MatMul, inputs: [x, w], outputs: [h]}\n  - {op: Add, inputs: [b, h], outputs: [y]}\n"));
    assert_eq!(fused(&g), vec![("none", false, strs(&["x", "w", "b"]))]);
}

#[test]
fn single_op_activations_fuse() {
    for (op, attrs, act) in [
        ("Relu", "", "relu"),
        ("Sigmoid", "", "sigmoid"),
        ("Tanh", "", "tanh"),
        ("Gelu", "", "gelu"),
        ("Gelu", ", attrs: {approximate: tanh}", "gelu_tanh"),
    ] {
        let (g, _) = fuse(&mlp(
            "y",
            &format!("{FC}  - {{op: {op}, inputs: [hb], outputs: [y]{attrs}}}\n"),
        ));
        assert_eq!(
            fused(&g),
            vec![(act, false, strs(&["x", "w", "b"]))],
            "{op}{attrs}"
        );
        assert_eq!(g.nodes.len(), 1);
    }
}

#[test]
fn activation_without_bias_fuses() {
    let (g, _) = fuse(&mlp("y", "  - {op: MatMul, inputs: [x, w], outputs: [h]}\n  - {op: Relu, inputs: [h], outputs: [y]}\n"));
    assert_eq!(fused(&g), vec![("relu", false, strs(&["x", "w"]))]);
}

#[test]
fn gelu_tanh_expansion_as_exporters_write_it() {
    let nodes = format!(
        "{FC}  - {{op: Pow, inputs: [hb, three], outputs: [hb3]}}
  - {{op: Mul, inputs: [hb3, gelu_c], outputs: [hb3c]}}
  - {{op: Add, inputs: [hb, hb3c], outputs: [inner]}}
  - {{op: Mul, inputs: [inner, s2pi], outputs: [inner_s]}}
  - {{op: Tanh, inputs: [inner_s], outputs: [t]}}
  - {{op: Add, inputs: [t, one], outputs: [t1]}}
  - {{op: Mul, inputs: [hb, half], outputs: [hb_half]}}
  - {{op: Mul, inputs: [hb_half, t1], outputs: [y]}}
"
    );
    let (g, _) = fuse(&mlp("y", &nodes));
    assert_eq!(
        fused(&g),
        vec![("gelu_tanh", false, strs(&["x", "w", "b"]))]
    );
    assert_eq!(g.nodes.len(), 1);
    assert!(
        g.initializers
            .iter()
            .all(|i| ["w", "wt", "b"].contains(&i.name.as_str())),
        "constants pruned"
    );
}

#[test]
fn gelu_tanh_expansion_other_orders() {
    // x·x·x instead of Pow, operands swapped everywhere, the 0.5 applied to the product.
    let nodes = format!(
        "{FC}  - {{op: Mul, inputs: [hb, hb], outputs: [hb2]}}
  - {{op: Mul, inputs: [hb, hb2], outputs: [hb3]}}
  - {{op: Mul, inputs: [gelu_c, hb3], outputs: [hb3c]}}
  - {{op: Add, inputs: [hb3c, hb], outputs: [inner]}}
  - {{op: Mul, inputs: [s2pi, inner], outputs: [inner_s]}}
  - {{op: Tanh, inputs: [inner_s], outputs: [t]}}
  - {{op: Add, inputs: [one, t], outputs: [t1]}}
  - {{op: Mul, inputs: [t1, hb], outputs: [p]}}
  - {{op: Mul, inputs: [half, p], outputs: [y]}}
"
    );
    let (g, _) = fuse(&mlp("y", &nodes));
    assert_eq!(
        fused(&g),
        vec![("gelu_tanh", false, strs(&["x", "w", "b"]))]
    );
    assert_eq!(g.nodes.len(), 1);
}

#[test]
fn gelu_tanh_expansion_with_x_factored_out() {
    // BLOOM's: x * 0.5 * (1 + tanh(0.79788456 * x * (1 + 0.044715 * x * x))).
    let bloom = |inner: &str| {
        format!(
            "{FC}  - {{op: Mul, inputs: [hb, half], outputs: [hh]}}
  - {{op: Mul, inputs: [hb, s2pi], outputs: [hs]}}
  - {{op: Mul, inputs: [hb, gelu_c], outputs: [hc]}}
{inner}  - {{op: Add, inputs: [hc2, one], outputs: [w1]}}
  - {{op: Mul, inputs: [hs, w1], outputs: [targ]}}
  - {{op: Tanh, inputs: [targ], outputs: [t]}}
  - {{op: Add, inputs: [t, one], outputs: [t1]}}
  - {{op: Mul, inputs: [hh, t1], outputs: [y]}}
"
        )
    };
    let (g, _) = fuse(&mlp(
        "y",
        &bloom(
            "  - {op: Mul, inputs: [hc, hb], outputs: [hc2]}
",
        ),
    ));
    assert_eq!(
        fused(&g),
        vec![("gelu_tanh", false, strs(&["x", "w", "b"]))]
    );
    assert_eq!(g.nodes.len(), 1);
    // Must not fire: x * (1 + c·x³) inside is not GELU.
    let (g, _) = fuse(&mlp(
        "y",
        &bloom(
            "  - {op: Mul, inputs: [hc, hb], outputs: [hcx]}
  - {op: Mul, inputs: [hcx, hb], outputs: [hc2]}
",
        ),
    ));
    assert_eq!(fused(&g), vec![("none", false, strs(&["x", "w", "b"]))]);
    assert!(g.nodes.len() > 1);
}

#[test]
fn gelu_erf_expansion_with_div() {
    let nodes = format!(
        "{FC}  - {{op: Div, inputs: [hb, sqrt2], outputs: [d]}}
  - {{op: Erf, inputs: [d], outputs: [e]}}
  - {{op: Add, inputs: [e, one], outputs: [e1]}}
  - {{op: Mul, inputs: [hb, half], outputs: [hh]}}
  - {{op: Mul, inputs: [hh, e1], outputs: [y]}}
"
    );
    let (g, _) = fuse(&mlp("y", &nodes));
    assert_eq!(fused(&g), vec![("gelu", false, strs(&["x", "w", "b"]))]);
    assert_eq!(g.nodes.len(), 1);
}

#[test]
fn gelu_erf_expansion_with_mul() {
    let nodes = format!(
        "{FC}  - {{op: Mul, inputs: [isqrt2, hb], outputs: [d]}}
  - {{op: Erf, inputs: [d], outputs: [e]}}
  - {{op: Add, inputs: [one, e], outputs: [e1]}}
  - {{op: Mul, inputs: [hb, e1], outputs: [p]}}
  - {{op: Mul, inputs: [p, half], outputs: [y]}}
"
    );
    let (g, _) = fuse(&mlp("y", &nodes));
    assert_eq!(fused(&g), vec![("gelu", false, strs(&["x", "w", "b"]))]);
}

#[test]
fn silu_expansion_either_order() {
    for mul in ["[hb, s]", "[s, hb]"] {
        let nodes = format!("{FC}  - {{op: Sigmoid, inputs: [hb], outputs: [s]}}\n  - {{op: Mul, inputs: {mul}, outputs: [y]}}\n");
        let (g, _) = fuse(&mlp("y", &nodes));
        assert_eq!(
            fused(&g),
            vec![("silu", false, strs(&["x", "w", "b"]))],
            "{mul}"
        );
        assert_eq!(g.nodes.len(), 1);
    }
}

#[test]
fn residual_add_either_order() {
    for add in ["[a, res]", "[res, a]"] {
        let nodes = format!("{FC}  - {{op: Relu, inputs: [hb], outputs: [a]}}\n  - {{op: Add, inputs: {add}, outputs: [y]}}\n");
        let (g, _) = fuse(&mlp("y", &nodes));
        assert_eq!(
            fused(&g),
            vec![("relu", false, strs(&["x", "w", "b", "res"]))],
            "{add}"
        );
        assert_eq!(g.nodes.len(), 1);
    }
}

#[test]
fn residual_without_bias_or_activation() {
    let (g, _) = fuse(&mlp("y", "  - {op: MatMul, inputs: [x, w], outputs: [h]}\n  - {op: Add, inputs: [res, h], outputs: [y]}\n"));
    assert_eq!(
        fused(&g),
        vec![("none", false, strs(&["x", "w", "", "res"]))]
    );
}

#[test]
fn gemm_with_trans_b_and_bias() {
    let (g, _) = fuse(&mlp("y", "  - {op: Gemm, inputs: [x, wt, b], outputs: [g0], attrs: {transB: 1}, name: gemm}\n  - {op: Relu, inputs: [g0], outputs: [y]}\n"));
    assert_eq!(fused(&g), vec![("relu", true, strs(&["x", "wt", "b"]))]);
    assert_eq!(g.nodes[0].name, "gemm");
}

#[test]
fn gemm_with_alpha_does_not_fuse() {
    let (g, r) = fuse(&mlp("y", "  - {op: Gemm, inputs: [x, wt, b], outputs: [y], attrs: {transB: 1, alpha: 2.0}, name: gemm}\n"));
    assert_eq!(count(&g, "Gemm"), 1);
    assert!(
        r.explain
            .iter()
            .any(|e| e.contains("gemm") && e.contains("alpha")),
        "{:?}",
        r.explain
    );
}

/// Gemm operands: a [8, 4] input used transposed, weights and biases both trainable and
/// constant, and a full [4, 16] C.
const GEMM: &str = "
inputs:
  - {name: xa, dtype: f32, shape: [8, 4]}
  - {name: x, dtype: f32, shape: [4, 8]}
  - {name: res, dtype: f32, shape: [4, 16]}
  - {name: xb, dtype: f32, shape: [8, 16]}
initializers:
  - {name: w, dtype: f32, shape: [8, 16], init: {dist: xavier_uniform, seed: 1}}
  - {name: wt, dtype: f32, shape: [16, 8], init: {dist: xavier_uniform, seed: 4}}
  - {name: rc, dtype: f32, shape: [4, 16], init: {dist: uniform, low: -1, high: 1, seed: 7}, trainable: false}
  - {name: wc, dtype: f32, shape: [8, 16], init: {dist: xavier_uniform, seed: 5}, trainable: false}
  - {name: ac, dtype: f32, shape: [8, 4], init: {dist: uniform, low: -1, high: 1, seed: 6}, trainable: false}
  - {name: b, dtype: f32, shape: [16], init: {dist: uniform, low: -0.5, high: 0.5, seed: 2}}
  - {name: bc, dtype: f32, shape: [16], init: {dist: uniform, low: -0.5, high: 0.5, seed: 3}, trainable: false}
";

fn gemm(outputs: &str, nodes: &str) -> String {
    format!("{GEMM}outputs: [{outputs}]\nnodes:\n{nodes}")
}

#[test]
fn gemm_alpha_beta_fold_into_constant_operands() {
    // alpha goes into the constant B, beta into the constant C: one FusedMatMul.
    let (g, _) = fuse(&gemm("y", "  - {op: Gemm, inputs: [x, wc, bc], outputs: [g0], attrs: {alpha: 0.5, beta: 2.0}, name: gemm}\n  - {op: Relu, inputs: [g0], outputs: [y]}\n"));
    assert_eq!(
        fused(&g),
        vec![("relu", false, strs(&["x", "gemm_b_alpha", "gemm_c_beta"]))]
    );
    assert_eq!(g.nodes.len(), 1);
    let (b, c) = (
        g.initializer("gemm_b_alpha").unwrap(),
        g.initializer("gemm_c_beta").unwrap(),
    );
    assert!(!b.trainable && !c.trainable);
    // With a constant A too, transA folds into it (and alpha into B first).
    let (g, _) = fuse(&gemm("y", "  - {op: Gemm, inputs: [ac, xb, bc], outputs: [y], attrs: {transA: 1, alpha: 0.5}, name: gemm}\n"));
    assert_eq!(
        fused(&g),
        vec![("none", false, strs(&["gemm_a_folded", "xb", "bc"]))]
    );
}

#[test]
fn gemm_trans_a_alpha_beta_become_nodes_in_front_when_that_pays() {
    // Gemm + Relu + residual Add (3 nodes) → Transpose(A), Mul(A, alpha), Mul(C, beta)
    // would be 4: not fused, and explained.
    let nodes = "  - {op: Gemm, inputs: [xa, w, b], outputs: [g0], attrs: {transA: 1, alpha: 0.5, beta: 2.0}, name: gemm}\n  - {op: Relu, inputs: [g0], outputs: [a]}\n  - {op: Add, inputs: [a, res], outputs: [y]}\n";
    let (g, r) = fuse(&gemm("y", nodes));
    assert!(fused(&g).is_empty());
    assert!(
        r.explain.iter().any(|e| e.starts_with("Gemm 'gemm'")
            && e.contains("no trans_a, alpha or beta")
            && e.contains("Transpose and Mul and Mul")),
        "{:?}",
        r.explain
    );
    // transA alone: Transpose + FusedMatMul(relu, residual) replace three nodes.
    let (g, _) = fuse(&gemm("y", &nodes.replace(", alpha: 0.5, beta: 2.0", "")));
    assert_eq!(
        fused(&g),
        vec![("relu", false, strs(&["gemm_a_t", "w", "b", "res"]))]
    );
    assert_eq!((g.nodes.len(), count(&g, "Transpose")), (2, 1));
    // alpha and beta on trainable operands: two Muls replace Gemm, Relu and Add.
    let (g, _) = fuse(&gemm(
        "y",
        &nodes.replace("xa", "x").replace("transA: 1, ", ""),
    ));
    assert_eq!(
        fused(&g),
        vec![(
            "relu",
            false,
            strs(&["gemm_a_alpha", "w", "gemm_c_beta", "res"])
        )]
    );
    assert_eq!((g.nodes.len(), count(&g, "Mul")), (3, 2));
}

#[test]
fn gemm_with_a_full_c_takes_the_residual_slot() {
    // C [4, 16] is no bias: act(A @ B + C) cannot be written as act(A @ B + bias) + residual,
    // so C becomes the residual and the Relu after it stays.
    let (g, r) = fuse(&gemm("y", "  - {op: Gemm, inputs: [x, w, res], outputs: [g0], name: gemm}\n  - {op: Relu, inputs: [g0], outputs: [y]}\n"));
    assert_eq!(
        fused(&g),
        vec![("none", false, strs(&["x", "w", "", "res"]))]
    );
    assert_eq!(count(&g, "Relu"), 1);
    assert_eq!(
        r.explain,
        vec!["FusedMatMul 'gemm' (activation none): matmul_epilogue: stopped before 'g0': Gemm's C took the residual slot"]
    );
    // A constant C takes beta; transB stays trans_b.
    let (g, _) = fuse(&gemm("y", "  - {op: Gemm, inputs: [x, wt, rc], outputs: [y], attrs: {beta: 0.5, transB: 1}, name: gemm}\n"));
    assert_eq!(
        fused(&g),
        vec![("none", true, strs(&["x", "wt", "", "gemm_c_beta"]))]
    );
    // A C that is an input would need a Mul by beta in front: one node for one, not fused.
    let (g, r) = fuse(&gemm("y", "  - {op: Gemm, inputs: [x, wt, res], outputs: [y], attrs: {beta: 0.5, transB: 1}, name: gemm}\n"));
    assert_eq!(count(&g, "Gemm"), 1);
    assert!(
        r.explain
            .iter()
            .any(|e| e.starts_with("Gemm 'gemm'") && e.contains("the Mul it would need")),
        "{:?}",
        r.explain
    );
}

#[test]
fn transposed_weight_becomes_trans_b() {
    let nodes = "  - {op: Transpose, inputs: [wt], outputs: [wtt], attrs: {perm: [1, 0]}}
  - {op: MatMul, inputs: [x, wtt], outputs: [h]}
  - {op: Add, inputs: [h, b], outputs: [y]}
";
    let (g, _) = fuse(&mlp("y", nodes));
    assert_eq!(fused(&g), vec![("none", true, strs(&["x", "wt", "b"]))]);
    assert_eq!(count(&g, "Transpose"), 0);
}

#[test]
fn batched_a_fuses() {
    let body = "
inputs: [{name: x, dtype: f32, shape: [batch, 3, 8]}]
dims: {batch: 2}
initializers:
  - {name: w, dtype: f32, shape: [8, 16], init: {dist: xavier_uniform, seed: 1}}
  - {name: b, dtype: f32, shape: [16], init: {dist: uniform, low: -0.5, high: 0.5, seed: 2}}
outputs: [y]
nodes:
  - {op: MatMul, inputs: [x, w], outputs: [h]}
  - {op: Add, inputs: [h, b], outputs: [hb]}
  - {op: Relu, inputs: [hb], outputs: [a]}
  - {op: Transpose, inputs: [w], outputs: [wt], attrs: {perm: [1, 0]}}
  - {op: MatMul, inputs: [a, wt], outputs: [y]}
";
    let g = graph(body);
    let (o, _) = run_passes(&g, &PassOptions::default());
    assert_eq!(
        fused(&o),
        vec![
            ("relu", false, strs(&["x", "w", "b"])),
            ("none", true, strs(&["a", "w"]))
        ]
    );
    check_same(&g, &o, &[("batch", 5)]);
}

#[test]
fn unbound_symbols_are_probed_not_baked_in() {
    // No default for `n`: shapes are inferred at probe sizes and the decision holds for any n.
    let body = "
inputs: [{name: x, dtype: f32, shape: [n, 8]}, {name: res, dtype: f32, shape: [n, 16]}]
initializers:
  - {name: w, dtype: f32, shape: [8, 16], init: {dist: xavier_uniform, seed: 1}}
  - {name: b, dtype: f32, shape: [16], init: {dist: uniform, low: -0.5, high: 0.5, seed: 2}}
outputs: [y]
nodes:
  - {op: MatMul, inputs: [x, w], outputs: [h]}
  - {op: Add, inputs: [h, b], outputs: [hb]}
  - {op: Sigmoid, inputs: [hb], outputs: [a]}
  - {op: Add, inputs: [res, a], outputs: [y]}
";
    let g = graph(body);
    let (o, _) = run_passes(&g, &PassOptions::default());
    assert_eq!(
        fused(&o),
        vec![("sigmoid", false, strs(&["x", "w", "b", "res"]))]
    );
    check_same(&g, &o, &[("n", 3)]);
}

#[test]
fn a_model_that_refuses_the_probe_size_is_probed_smaller() {
    // A position table of 6 rows read at Range(0, n): n = 32 (the probe) and its scaled
    // sizes are out of range, so shapes come from smaller sizes, and the residual (which
    // needs shapes) still fuses.
    let body = "
inputs: [{name: x, dtype: f32, shape: [n, 8]}, {name: res, dtype: f32, shape: [n, 16]}]
initializers:
  - {name: w, dtype: f32, shape: [8, 16], init: {dist: xavier_uniform, seed: 1}}
  - {name: table, dtype: f32, shape: [6, 16], init: {dist: uniform, low: -1, high: 1, seed: 3}}
  - {name: zero, dtype: i64, shape: [], values: [0]}
  - {name: one, dtype: i64, shape: [], values: [1]}
outputs: [y]
nodes:
  - {op: Shape, inputs: [x], outputs: [xs], attrs: {start: 0, end: 1}}
  - {op: Squeeze, inputs: [xs], outputs: [len]}
  - {op: Range, inputs: [zero, len, one], outputs: [pos]}
  - {op: Gather, inputs: [table, pos], outputs: [pe]}
  - {op: Add, inputs: [res, pe], outputs: [r2]}
  - {op: MatMul, inputs: [x, w], outputs: [h]}
  - {op: Add, inputs: [h, r2], outputs: [y]}
";
    let g = graph(body);
    let (o, _) = run_passes(&g, &PassOptions::default());
    assert_eq!(
        fused(&o),
        vec![("none", false, strs(&["x", "w", "", "r2"]))]
    );
    check_same(&g, &o, &[("n", 5)]);
}

/// A Linear on a 3-D input as the exporters write it (GPT-2's Conv1D): the rows
/// flattened, a Gemm with the bias, the result reshaped back to `[batch, seq, N]` (the
/// shape computed from the input's), then the activation and the residual. `BACK` is the
/// tail of the reshaped-back shape.
const ROWS: &str = "
inputs:
  - {name: x, dtype: f32, shape: [batch, seq, 8]}
  - {name: res, dtype: f32, shape: [batch, seq, BACK]}
initializers:
  - {name: w, dtype: f32, shape: [8, 16], init: {dist: xavier_uniform, seed: 1}}
  - {name: b, dtype: f32, shape: [16], init: {dist: uniform, low: -0.5, high: 0.5, seed: 2}}
  - {name: flat, dtype: i64, shape: [2], values: [-1, 8]}
  - {name: tail, dtype: i64, shape: [TAILN], values: [BACK]}
outputs: [y]
nodes:
  - {op: Reshape, inputs: [x, flat], outputs: [x2]}
  - {op: Gemm, inputs: [x2, w, b], outputs: [h]}
  - {op: Shape, inputs: [x], outputs: [bs], attrs: {start: 0, end: 2}}
  - {op: Concat, inputs: [bs, tail], outputs: [back], attrs: {axis: 0}}
  - {op: Reshape, inputs: [h, back], outputs: [h3]}
  - {op: Tanh, inputs: [h3], outputs: [a]}
  - {op: Add, inputs: [a, res], outputs: [y]}
";

#[test]
fn epilogue_through_the_reshape_back_to_rows() {
    let body = ROWS.replace("TAILN", "1").replace("BACK", "16");
    let g = graph(&body);
    let (o, r) = run_passes(&g, &PassOptions::default());
    let f = fused(&o);
    assert_eq!(f.len(), 1, "{:?}", o.nodes);
    assert_eq!(f[0].0, "tanh");
    assert_eq!(f[0].2.len(), 4, "bias and residual: {f:?}");
    assert_eq!(count(&o, "Tanh") + count(&o, "Add"), 0, "{:?}", o.nodes);
    assert_eq!(r.fired("matmul_epilogue"), 1);
    check_same(&g, &o, &[("batch", 3), ("seq", 5)]);
    // Must not fire through a Reshape that splits the last axis: the product's bias
    // still fuses, the Tanh and the residual stay.
    let body = ROWS
        .replace("TAILN", "2")
        .replace("[BACK]", "[4, 4]")
        .replace("BACK", "4, 4");
    let g = graph(&body);
    let (o, _) = run_passes(&g, &PassOptions::default());
    assert_eq!(fused(&o).len(), 1);
    assert_eq!(fused(&o)[0].0, "none");
    assert_eq!(count(&o, "Tanh"), 1);
    check_same(&g, &o, &[("batch", 2), ("seq", 3)]);
}

// ------------------------------------------------- MatMul epilogue: must not fire

#[test]
fn intermediate_used_twice_stops_the_fusion() {
    // hb feeds the Relu and another node: fuse up to hb only.
    let nodes = format!("{FC}  - {{op: Relu, inputs: [hb], outputs: [y]}}\n  - {{op: Sigmoid, inputs: [hb], outputs: [z]}}\n");
    let (g, _) = fuse(&mlp("y, z", &nodes));
    assert_eq!(fused(&g), vec![("none", false, strs(&["x", "w", "b"]))]);
    assert_eq!((count(&g, "Relu"), count(&g, "Sigmoid")), (1, 1));
    // h feeds the bias Add and another node: nothing fuses.
    let nodes = format!("{FC}  - {{op: Relu, inputs: [hb], outputs: [y]}}\n  - {{op: Sigmoid, inputs: [h], outputs: [z]}}\n");
    let (g, r) = fuse(&mlp("y, z", &nodes));
    assert!(fused(&g).is_empty());
    assert!(
        r.explain.iter().any(|e| e.starts_with("MatMul 'fc'")),
        "{:?}",
        r.explain
    );
}

#[test]
fn intermediate_graph_output_stops_the_fusion() {
    let nodes = format!("{FC}  - {{op: Relu, inputs: [hb], outputs: [y]}}\n");
    let (g, _) = fuse(&mlp("y, hb", &nodes));
    assert_eq!(fused(&g), vec![("none", false, strs(&["x", "w", "b"]))]);
    assert_eq!(count(&g, "Relu"), 1);
    let (g, r) = fuse(&mlp("y, h", &nodes));
    assert!(fused(&g).is_empty());
    assert!(
        r.explain.iter().any(|e| e.contains("graph output")),
        "{:?}",
        r.explain
    );
}

#[test]
fn bias_of_the_wrong_shape_is_not_fused() {
    // [4, 1] + [16] broadcasts up to [4, 16]: not a bias and not a residual.
    let body = "
inputs: [{name: x, dtype: f32, shape: [4, 8]}]
initializers:
  - {name: w, dtype: f32, shape: [8, 1], init: {dist: xavier_uniform, seed: 1}}
  - {name: b, dtype: f32, shape: [16], init: {dist: uniform, low: -0.5, high: 0.5, seed: 2}}
outputs: [y]
nodes:
  - {op: MatMul, inputs: [x, w], outputs: [h], name: fc}
  - {op: Add, inputs: [h, b], outputs: [hb]}
  - {op: Relu, inputs: [hb], outputs: [y]}
";
    let (g, r) = fuse(body);
    assert!(fused(&g).is_empty());
    assert_eq!(count(&g, "MatMul"), 1);
    assert!(
        r.explain.iter().any(|e| e.starts_with("MatMul 'fc'")),
        "{:?}",
        r.explain
    );
}

#[test]
fn column_bias_is_a_residual_not_a_bias() {
    // [4, 16] + [4, 1] is no bias; it may only be added after the activation, so the Relu stays.
    let body = format!("{MLP}  - {{name: col, dtype: f32, shape: [4, 1], values: [1, -2, 3, -4]}}\noutputs: [y]\nnodes:\n  - {{op: MatMul, inputs: [x, w], outputs: [h]}}\n  - {{op: Add, inputs: [h, col], outputs: [hb]}}\n  - {{op: Relu, inputs: [hb], outputs: [y]}}\n");
    let (g, _) = fuse(&body);
    assert_eq!(
        fused(&g),
        vec![("none", false, strs(&["x", "w", "", "col"]))]
    );
    assert_eq!(count(&g, "Relu"), 1);
}

#[test]
fn wrong_gelu_constant_is_not_gelu() {
    let nodes = format!(
        "{FC}  - {{op: Pow, inputs: [hb, three], outputs: [hb3]}}
  - {{op: Mul, inputs: [hb3, half], outputs: [hb3c]}}
  - {{op: Add, inputs: [hb, hb3c], outputs: [inner]}}
  - {{op: Mul, inputs: [inner, s2pi], outputs: [inner_s]}}
  - {{op: Tanh, inputs: [inner_s], outputs: [t]}}
  - {{op: Add, inputs: [t, one], outputs: [t1]}}
  - {{op: Mul, inputs: [hb, half], outputs: [hb_half]}}
  - {{op: Mul, inputs: [hb_half, t1], outputs: [y]}}
"
    );
    let (g, _) = fuse(&mlp("y", &nodes));
    assert_eq!(fused(&g), vec![("none", false, strs(&["x", "w", "b"]))]);
    assert_eq!(count(&g, "Tanh"), 1);
}

#[test]
fn activation_with_a_second_consumer_is_not_swallowed() {
    // The Sigmoid of a SiLU also feeds an output: the SiLU stays, the bias fuses.
    let nodes = format!("{FC}  - {{op: Sigmoid, inputs: [hb], outputs: [s]}}\n  - {{op: Mul, inputs: [hb, s], outputs: [y]}}\n");
    let (g, r) = fuse(&mlp("y, s", &nodes));
    assert_eq!(fused(&g), vec![("none", false, strs(&["x", "w", "b"]))]);
    assert_eq!((count(&g, "Sigmoid"), count(&g, "Mul")), (1, 1));
    // --explain-fusion says what the fused node left outside, and why.
    let line = r.explain.iter().find(|l| l.starts_with("FusedMatMul"));
    assert!(
        line.is_some_and(|l| l.contains("stopped before 'hb'") && l.contains("silu expansion")),
        "{:?}",
        r.explain
    );
    // A Relu read twice fuses, but the residual Add after it cannot take it.
    let nodes = format!("{FC}  - {{op: Relu, inputs: [hb], outputs: [a]}}\n  - {{op: Add, inputs: [a, res], outputs: [y]}}\n  - {{op: Tanh, inputs: [a], outputs: [z]}}\n");
    let (g, _) = fuse(&mlp("y, z", &nodes));
    assert_eq!(fused(&g), vec![("relu", false, strs(&["x", "w", "b"]))]);
    assert_eq!(count(&g, "Add"), 1);
    // A GELU expansion whose inner value is read elsewhere stays expanded.
    let nodes = format!(
        "{FC}  - {{op: Div, inputs: [hb, sqrt2], outputs: [d]}}
  - {{op: Erf, inputs: [d], outputs: [e]}}
  - {{op: Add, inputs: [e, one], outputs: [e1]}}
  - {{op: Mul, inputs: [hb, half], outputs: [hh]}}
  - {{op: Mul, inputs: [hh, e1], outputs: [y]}}
"
    );
    let (g, _) = fuse(&mlp("y, e", &nodes));
    assert_eq!(fused(&g), vec![("none", false, strs(&["x", "w", "b"]))]);
    assert_eq!(count(&g, "Erf"), 1);
}

#[test]
fn bare_matmul_is_left_and_explained() {
    let (g, r) = fuse(&mlp(
        "h",
        "  - {op: MatMul, inputs: [x, w], outputs: [h], name: fc}\n",
    ));
    assert_eq!(count(&g, "MatMul"), 1);
    assert_eq!(r.explain.len(), 1);
    assert!(
        r.explain[0].starts_with("MatMul 'fc': matmul_epilogue: "),
        "{:?}",
        r.explain
    );
}

// ---------------------------------------------------------------- attention

/// q, k, v [2, 2, 8, 4], an additive mask input and scalar constants.
const ATT: &str = "
inputs:
  - {name: q, dtype: f32, shape: [2, 2, 8, 4]}
  - {name: k, dtype: f32, shape: [2, 2, 8, 4]}
  - {name: v, dtype: f32, shape: [2, 2, 8, 4]}
  - {name: m, dtype: f32, shape: [2, 1, 8, 8]}
initializers:
  - {name: half, dtype: f32, shape: [], values: [0.5], trainable: false}
  - {name: two, dtype: f32, shape: [], values: [2.0], trainable: false}
  - {name: one, dtype: f32, shape: [], values: [1.0], trainable: false}
  - {name: thr, dtype: f32, shape: [], values: [-0.9], trainable: false}
  - {name: neg, dtype: f32, shape: [], values: [-1.0e9], trainable: false}
";

fn att(outputs: &str, nodes: &str) -> String {
    format!("{ATT}outputs: [{outputs}]\nnodes:\n{nodes}")
}

const QK: &str = "  - {op: Transpose, inputs: [k], outputs: [kt], attrs: {perm: [0, 1, 3, 2]}}\n  - {op: MatMul, inputs: [q, kt], outputs: [s], name: qk}\n";
const PV: &str = "  - {op: Softmax, inputs: [z], outputs: [p], attrs: {axis: -1}, name: sm}\n  - {op: MatMul, inputs: [p, v], outputs: [o], name: pv}\n";

#[test]
fn attention_with_div_scale() {
    let (g, r) = fuse(&att(
        "o",
        &format!("{QK}  - {{op: Div, inputs: [s, two], outputs: [z]}}\n{PV}"),
    ));
    assert_eq!(attention(&g), vec![(false, 0.5, 3)]);
    assert_eq!(g.nodes.len(), 1);
    assert_eq!(g.nodes[0].name, "pv");
    assert_eq!(r.fired("attention"), 1);
}

#[test]
fn attention_with_mul_scale_and_no_scale() {
    let (g, _) = fuse(&att(
        "o",
        &format!("{QK}  - {{op: Mul, inputs: [half, s], outputs: [z]}}\n{PV}"),
    ));
    assert_eq!(attention(&g), vec![(false, 0.5, 3)]);
    let (g, _) = fuse(&att(
        "o",
        &format!("{QK}  - {{op: Identity, inputs: [s], outputs: [z]}}\n{PV}"),
    ));
    assert_eq!(attention(&g), vec![(false, 1.0, 3)]);
}

#[test]
fn attention_with_scale_on_q_and_k() {
    let nodes = "  - {op: Mul, inputs: [q, half], outputs: [qs]}
  - {op: Mul, inputs: [k, half], outputs: [ks]}
  - {op: Transpose, inputs: [ks], outputs: [kt], attrs: {perm: [0, 1, 3, 2]}}
  - {op: MatMul, inputs: [qs, kt], outputs: [z]}
";
    let (g, _) = fuse(&att("o", &format!("{nodes}{PV}")));
    assert_eq!(attention(&g), vec![(false, 0.25, 3)]);
    assert_eq!(g.nodes.len(), 1);
}

#[test]
fn attention_with_additive_mask() {
    let nodes = format!("{QK}  - {{op: Div, inputs: [s, two], outputs: [sd]}}\n  - {{op: Add, inputs: [m, sd], outputs: [z]}}\n{PV}");
    let (g, _) = fuse(&att("o", &nodes));
    assert_eq!(attention(&g), vec![(false, 0.5, 4)]);
    assert_eq!(g.nodes[0].inputs[3], "m");
}

/// PyTorch's guard on fully masked rows, `Where(IsNaN(p), 0, p)` between the softmax and
/// P·V (the torchscript exports of GPT-2 write it; IsNaN as the importer writes it).
const NAN_GUARD: &str = "  - {op: Softmax, inputs: [z], outputs: [p], attrs: {axis: -1}, name: sm}\n  - {op: IsNaN, inputs: [p], outputs: [nan]}\n  - {op: Where, inputs: [nan, zero, p], outputs: [pg]}\n  - {op: MatMul, inputs: [pg, v], outputs: [o], name: pv}\n";

#[test]
fn attention_through_the_nan_guard() {
    let mask = format!("{QK}  - {{op: Div, inputs: [s, two], outputs: [sd]}}\n  - {{op: Add, inputs: [m, sd], outputs: [z]}}\n");
    let body = att("o", &format!("{mask}{NAN_GUARD}")).replace(
        "initializers:\n",
        "initializers:\n  - {name: zero, dtype: f32, shape: [], values: [0.0], trainable: false}\n  - {name: onef, dtype: f32, shape: [], values: [1.0], trainable: false}\n",
    );
    let (g, r) = fuse(&body);
    assert_eq!(attention(&g), vec![(false, 0.5, 4)]);
    assert_eq!(g.nodes.len(), 1, "{:?}", g.nodes);
    assert_eq!(r.fired("attention"), 1);
    // Must not fire: a guard that writes another value than 0 changes the result.
    let (g, _) = fuse(&body.replace("inputs: [nan, zero, p]", "inputs: [nan, onef, p]"));
    assert_eq!(attention(&g), vec![]);
    // Nor when the mask of NaNs is itself an output.
    let (g, _) = fuse(&body.replace("outputs: [o]\n", "outputs: [o, nan]\n"));
    assert_eq!(attention(&g), vec![]);
}

#[test]
fn attention_with_bool_mask() {
    let nodes = format!(
        "  - {{op: Greater, inputs: [m, thr], outputs: [keep]}}\n{QK}  - {{op: Div, inputs: [s, two], outputs: [sd]}}\n  - {{op: Where, inputs: [keep, sd, neg], outputs: [z]}}\n{PV}"
    );
    let (g, _) = fuse(&att("o", &nodes));
    assert_eq!(attention(&g), vec![(false, 0.5, 4)]);
    assert_eq!(
        g.nodes
            .iter()
            .find(|n| n.op.name() == "Attention")
            .unwrap()
            .inputs[3],
        "keep"
    );
}

/// An [8, 8] mask's values, element (i, j) from `f`.
fn mask_values(f: impl Fn(usize, usize) -> f64) -> String {
    let v: Vec<String> = (0..8)
        .flat_map(|i| (0..8).map(move |j| (i, j)))
        .map(|(i, j)| f(i, j).to_string())
        .collect();
    v.join(", ")
}

#[test]
fn attention_with_constant_causal_additive_mask() {
    let body = format!(
        "{ATT}  - {{name: cm, dtype: f32, shape: [8, 8], values: [{}], trainable: false}}\noutputs: [o]\nnodes:\n{QK}  - {{op: Div, inputs: [s, two], outputs: [sd]}}\n  - {{op: Add, inputs: [sd, cm], outputs: [z]}}\n{PV}",
        mask_values(|i, j| if j <= i { 0.0 } else { -1e9 })
    );
    let (g, _) = fuse(&body);
    assert_eq!(attention(&g), vec![(true, 0.5, 3)]);
    assert!(g.initializer("cm").is_none(), "the mask is dropped");
}

#[test]
fn attention_with_constant_mask_that_is_not_causal_keeps_it() {
    let body = format!(
        "{ATT}  - {{name: cm, dtype: f32, shape: [8, 8], values: [{}], trainable: false}}\noutputs: [o]\nnodes:\n{QK}  - {{op: Add, inputs: [s, cm], outputs: [z]}}\n{PV}",
        mask_values(|i, j| if j >= i { 0.0 } else { -1e9 })
    );
    let (g, _) = fuse(&body);
    assert_eq!(attention(&g), vec![(false, 1.0, 4)]);
}

#[test]
fn attention_with_trilu_causal_mask_on_static_shapes() {
    // Static shapes: constant folding turns the Shape/Expand/Trilu/Cast chain into a
    // constant lower-triangular mask, which attention fusion reads as causal.
    let nodes = format!(
        "{QK}  - {{op: Div, inputs: [s, two], outputs: [sd]}}
  - {{op: Shape, inputs: [sd], outputs: [ss], attrs: {{start: 2}}}}
  - {{op: Expand, inputs: [one, ss], outputs: [ones]}}
  - {{op: Trilu, inputs: [ones], outputs: [tril], attrs: {{upper: 0}}}}
  - {{op: Cast, inputs: [tril], outputs: [keepc], attrs: {{to: bool}}}}
  - {{op: Where, inputs: [keepc, sd, neg], outputs: [z]}}
{PV}"
    );
    let (g, r) = fuse(&att("o", &nodes));
    assert_eq!(attention(&g), vec![(true, 0.5, 3)]);
    assert_eq!(g.nodes.len(), 1);
    assert!(
        r.fired("fold_shape") == 1 && r.fired("fold_constant") == 3,
        "{r}"
    );
    assert!(
        g.initializers.is_empty(),
        "{:?}",
        g.initializers.iter().map(|i| &i.name).collect::<Vec<_>>()
    );
    // With constant folding off, the chain itself is recognised.
    let g0 = graph(&att("o", &nodes));
    let (g, _) = run_passes(
        &g0,
        &PassOptions {
            disabled: vec!["constant_folding".into()],
            training: false,
            ..Default::default()
        },
    );
    assert_eq!(attention(&g), vec![(true, 0.5, 3)]);
    assert_eq!(g.nodes.len(), 1);
}

#[test]
fn attention_with_head_split_transpose_0231() {
    let body = "
inputs:
  - {name: xq, dtype: f32, shape: [batch, seq, 16]}
  - {name: xk, dtype: f32, shape: [batch, seq, 16]}
  - {name: xv, dtype: f32, shape: [batch, seq, 16]}
dims: {batch: 2, seq: 8}
initializers:
  - {name: heads, dtype: i64, shape: [4], values: [0, 0, 2, 8]}
  - {name: merged, dtype: i64, shape: [3], values: [0, 0, 16]}
  - {name: sqrt_d, dtype: f32, shape: [], values: [2.8284271247461903], trainable: false}
outputs: [y]
nodes:
  - {op: Reshape, inputs: [xq, heads], outputs: [q1]}
  - {op: Transpose, inputs: [q1], outputs: [q], attrs: {perm: [0, 2, 1, 3]}}
  - {op: Reshape, inputs: [xk, heads], outputs: [k1]}
  - {op: Transpose, inputs: [k1], outputs: [kt], attrs: {perm: [0, 2, 3, 1]}}
  - {op: Reshape, inputs: [xv, heads], outputs: [v1]}
  - {op: Transpose, inputs: [v1], outputs: [v], attrs: {perm: [0, 2, 1, 3]}}
  - {op: MatMul, inputs: [q, kt], outputs: [s]}
  - {op: Div, inputs: [s, sqrt_d], outputs: [z]}
  - {op: Softmax, inputs: [z], outputs: [p], attrs: {axis: -1}}
  - {op: MatMul, inputs: [p, v], outputs: [ctx], name: pv}
  - {op: Transpose, inputs: [ctx], outputs: [ctx_t], attrs: {perm: [0, 2, 1, 3]}}
  - {op: Reshape, inputs: [ctx_t, merged], outputs: [y]}
";
    let g = graph(body);
    let (o, r) = run_passes(&g, &PassOptions::default());
    let a = attention(&o);
    assert_eq!(a.len(), 1);
    assert!(!a[0].0 && (a[0].1 - 0.353_553_38).abs() < 1e-6);
    // The head split/merge copies are absorbed: the 3-D form reads the unsplit tensors
    // and writes the merged output.
    assert_eq!(r.fired("attention_heads"), 1);
    assert_eq!(o.nodes.len(), 1, "{:?}", o.nodes);
    assert_eq!(attention_inputs(&o), strs(&["xq", "xk", "xv"]));
    assert!(matches!(
        o.nodes[0].op,
        Op::Attention {
            q_num_heads: Some(2),
            kv_num_heads: Some(2),
            ..
        }
    ));
    assert_eq!(o.nodes[0].outputs, strs(&["y"]));
    assert_eq!(o.nodes[0].name, "pv");
    check_same(&g, &o, &[("batch", 3), ("seq", 5)]);
    // A second reader of a split value keeps that copy, and the 4-D form is fused with K
    // entering as [B, H, S, D].
    let body2 = body.replace("outputs: [y]\nnodes:", "outputs: [y, k1]\nnodes:");
    let g = graph(&body2);
    let (o, r) = run_passes(&g, &PassOptions::default());
    assert_eq!(r.fired("attention_heads"), 0);
    assert_eq!(attention(&o).len(), 1);
    let t: Vec<_> = o
        .nodes
        .iter()
        .filter_map(|n| match &n.op {
            Op::Transpose { perm } if n.inputs[0] == "k1" => perm.clone(),
            _ => None,
        })
        .collect();
    assert_eq!(
        t,
        vec![vec![0, 2, 1, 3]],
        "K enters Attention as [B, H, S, D]"
    );
    assert_eq!(count(&o, "MatMul") + count(&o, "Softmax"), 0);
    check_same(&g, &o, &[("batch", 3), ("seq", 5)]);
}

#[test]
fn attention_with_masked_fill_causal_mask() {
    // PyTorch's `att.masked_fill(mask == 0, -inf)` exports as Where(drop, -inf, scores):
    // the mask is true where scores are dropped (above the diagonal).
    let body = format!(
        "{ATT}  - {{name: drop, dtype: bool, shape: [1, 1, 8, 8], values: [{}]}}\n  - {{name: ninf, dtype: f32, shape: [], values: [-.inf], trainable: false}}\noutputs: [o]\nnodes:\n{QK}  - {{op: Div, inputs: [s, two], outputs: [sd]}}\n  - {{op: Where, inputs: [drop, ninf, sd], outputs: [z]}}\n{PV}",
        mask_values(|i, j| (j > i) as u8 as f64).replace('1', "true").replace('0', "false")
    );
    let g = graph(&body);
    let (o, _) = run_passes(&g, &PassOptions::default());
    assert_eq!(attention(&o), vec![(true, 0.5, 3)]);
    assert_eq!(o.nodes.len(), 1);
    check_same(&g, &o, &[]);
    // A drop-mask that is not causal cannot be given to Attention (its bool mask keeps
    // where true), and says so.
    let body = body.replace("values: [false", "values: [true");
    let (o, r) = run_passes(&graph(&body), &PassOptions::default());
    assert!(attention(&o).is_empty());
    assert!(
        r.explain
            .iter()
            .any(|e| e.contains("masks out where its mask is true")),
        "{:?}",
        r.explain
    );
}

#[test]
fn attention_with_kt_through_merged_heads() {
    // The dynamo exporter writes scaled_dot_product_attention's Kᵀ over merged heads:
    // Reshape [B·H, S, D] → Transpose [0, 2, 1] → Reshape [B, H, D, S], with the scale
    // split as sqrt(scale) on Q and on Kᵀ.
    let body = format!(
        "{ATT}  - {{name: flat, dtype: i64, shape: [3], values: [-1, 8, 4]}}
  - {{name: heads, dtype: i64, shape: [4], values: [2, 2, 4, 8]}}
  - {{name: rs, dtype: f32, shape: [1], values: [0.7071067811865476], trainable: false}}
outputs: [o]
nodes:
  - {{op: Reshape, inputs: [k, flat], outputs: [k3]}}
  - {{op: Transpose, inputs: [k3], outputs: [k3t], attrs: {{perm: [0, 2, 1]}}}}
  - {{op: Reshape, inputs: [k3t, heads], outputs: [kt]}}
  - {{op: Mul, inputs: [q, rs], outputs: [qs]}}
  - {{op: Mul, inputs: [kt, rs], outputs: [kts]}}
  - {{op: MatMul, inputs: [qs, kts], outputs: [z]}}
{PV}"
    );
    let g = graph(&body);
    let (o, _) = run_passes(&g, &PassOptions::default());
    let a = attention(&o);
    assert_eq!(a.len(), 1);
    assert!((a[0].1 - 0.5).abs() < 1e-6 && a[0].2 == 3, "{a:?}");
    assert_eq!(o.nodes.len(), 1, "the Kᵀ chain goes: {:?}", o.nodes);
    check_same(&g, &o, &[]);
}

#[test]
fn attention_with_kt_through_merged_heads_at_symbolic_sizes() {
    // The same chain as the dynamo exporter writes it for symbolic batch and sequence: the
    // reshapes' shapes computed from Shape(K). The merge-and-split is checked in every
    // inference run, so it fuses for any sizes.
    let body = "
inputs:
  - {name: q, dtype: f32, shape: [batch, 2, seq, 4]}
  - {name: k, dtype: f32, shape: [batch, 2, seq, 4]}
  - {name: v, dtype: f32, shape: [batch, 2, seq, 4]}
initializers:
  - {name: minus1, dtype: i64, shape: [1], values: [-1]}
  - {name: rs, dtype: f32, shape: [1], values: [0.7071067811865476], trainable: false}
outputs: [o]
nodes:
  - {op: Shape, inputs: [k], outputs: [bh], attrs: {start: 0, end: 2}}
  - {op: Shape, inputs: [k], outputs: [sl], attrs: {start: 2, end: 3}}
  - {op: Shape, inputs: [k], outputs: [dl], attrs: {start: 3}}
  - {op: Concat, inputs: [minus1, sl, dl], outputs: [flat], attrs: {axis: 0}}
  - {op: Concat, inputs: [bh, dl, sl], outputs: [heads], attrs: {axis: 0}}
  - {op: Reshape, inputs: [k, flat], outputs: [k3]}
  - {op: Transpose, inputs: [k3], outputs: [k3t], attrs: {perm: [0, 2, 1]}}
  - {op: Reshape, inputs: [k3t, heads], outputs: [kt]}
  - {op: Mul, inputs: [q, rs], outputs: [qs]}
  - {op: Mul, inputs: [kt, rs], outputs: [kts]}
  - {op: MatMul, inputs: [qs, kts], outputs: [z]}
  - {op: Softmax, inputs: [z], outputs: [p], attrs: {axis: -1}, name: sm}
  - {op: MatMul, inputs: [p, v], outputs: [o], name: pv}
";
    let g = graph(body);
    let (o, _) = run_passes(&g, &PassOptions::default());
    let a = attention(&o);
    assert_eq!(a.len(), 1, "{:?}", o.nodes);
    assert!((a[0].1 - 0.5).abs() < 1e-6, "{a:?}");
    check_same(&g, &o, &[("batch", 3), ("seq", 5)]);
}

/// BLOOM's attention as exporters write its `baddbmm` (rule `attention_flat`): Q, K and
/// V [2, 2, 8, 4] merged to [B·H, S, D], `MatMul(Q, Kᵀ) · scale + bias` with a per-head
/// bias [B·H, 1, S] (ALiBi; `bias` gives its shape), split back to [B, H, S, S], plus the
/// mask, Softmax, merged again for P·V and the output split to [B, H, S, D].
fn flat_attention(outputs: &str, bias: &str) -> String {
    format!(
        "{}  - {{name: bias, dtype: f32, shape: {bias}}}
initializers:
  - {{name: flat, dtype: i64, shape: [3], values: [-1, 8, 4]}}
  - {{name: flat_s, dtype: i64, shape: [3], values: [-1, 8, 8]}}
  - {{name: heads_s, dtype: i64, shape: [4], values: [2, 2, 8, 8]}}
  - {{name: heads, dtype: i64, shape: [4], values: [2, 2, 8, 4]}}
  - {{name: alpha, dtype: f32, shape: [], values: [0.5], trainable: false}}
outputs: [{outputs}]
nodes:
  - {{op: Reshape, inputs: [q, flat], outputs: [q3]}}
  - {{op: Reshape, inputs: [k, flat], outputs: [k3]}}
  - {{op: Transpose, inputs: [k3], outputs: [k3t], attrs: {{perm: [0, 2, 1]}}}}
  - {{op: Reshape, inputs: [v, flat], outputs: [v3]}}
  - {{op: MatMul, inputs: [q3, k3t], outputs: [s3]}}
  - {{op: Mul, inputs: [s3, alpha], outputs: [ss]}}
  - {{op: Add, inputs: [ss, bias], outputs: [sb]}}
  - {{op: Reshape, inputs: [sb, heads_s], outputs: [s4]}}
  - {{op: Add, inputs: [s4, m], outputs: [z]}}
  - {{op: Softmax, inputs: [z], outputs: [p], attrs: {{axis: -1}}, name: sm}}
  - {{op: Reshape, inputs: [p, flat_s], outputs: [p3]}}
  - {{op: MatMul, inputs: [p3, v3], outputs: [o3], name: pv}}
  - {{op: Reshape, inputs: [o3, heads], outputs: [o]}}
",
        ATT.split("initializers:").next().unwrap()
    )
}

#[test]
fn attention_on_merged_heads_with_a_per_head_bias() {
    let (g, r) = fuse(&flat_attention("o", "[4, 1, 8]"));
    assert_eq!(attention(&g), vec![(false, 0.5, 4)]);
    assert_eq!(r.fired("attention_flat"), 1, "{r}");
    let att = g.nodes.iter().find(|n| n.name == "pv").unwrap();
    assert_eq!(&att.inputs[..3], &strs(&["q", "k", "v"])[..]);
    assert!(
        !g.nodes
            .iter()
            .any(|n| matches!(n.op, Op::MatMul | Op::Softmax { .. })),
        "{:?}",
        g.nodes
    );
    // A bias for every query, [B·H, S, S], too.
    let (g, _) = fuse(&flat_attention("o", "[4, 8, 8]"));
    assert_eq!(attention(&g), vec![(false, 0.5, 4)]);
    // Must not fire: the probabilities also an output; a bias shared by every head
    // ([1, 1, S]: no per-head view of it) is left as written.
    let (g, _) = fuse(&flat_attention("o, p", "[4, 1, 8]"));
    assert_eq!(attention(&g), vec![]);
    let (g, _) = fuse(&flat_attention("o", "[1, 1, 8]"));
    assert_eq!(attention(&g), vec![]);
    // The output's target shape computed from Shape(output), as the TorchScript exporter
    // writes it: that Shape reads Q's stack instead (same shape, D = Dv).
    let ts = flat_attention("o", "[4, 1, 8]").replace(
        "  - {op: Reshape, inputs: [o3, heads], outputs: [o]}\n",
        "  - {op: Shape, inputs: [o3], outputs: [o3s], attrs: {start: 1}}
  - {op: Concat, inputs: [bh, o3s], outputs: [heads_dyn], attrs: {axis: 0}}
  - {op: Reshape, inputs: [o3, heads_dyn], outputs: [o]}\n",
    );
    let ts = ts.replace(
        "initializers:\n",
        "initializers:\n  - {name: bh, dtype: i64, shape: [2], values: [2, 2]}\n",
    );
    let g0 = graph(&ts);
    assert!(g0.nodes.iter().any(|n| matches!(n.op, Op::Shape { .. })));
    let (g, r) = run_passes(&g0, &PassOptions::default());
    assert_eq!(attention(&g), vec![(false, 0.5, 4)], "{r}");
    check_same(&g0, &g, &[]);
}

/// Grouped-query attention: q [B, 4, S, 4] against k0, v0 [B, 2, S, 4] (or one kv head),
/// repeated to 4 heads by the nodes `repeat` writes (`KV` in them is k0 or v0).
fn gqa(kv_heads: usize, repeat: &str) -> String {
    let r = |x: &str, v: &str| repeat.replace("KV", x).replace("OUT", v).replace("TAG", x);
    format!(
        "
inputs:
  - {{name: q, dtype: f32, shape: [batch, 4, seq, 4]}}
  - {{name: k0, dtype: f32, shape: [batch, {kv_heads}, seq, 4]}}
  - {{name: v0, dtype: f32, shape: [batch, {kv_heads}, seq, 4]}}
dims: {{batch: 2, seq: 8}}
initializers:
  - {{name: two, dtype: f32, shape: [], values: [2.0], trainable: false}}
  - {{name: rep, dtype: i64, shape: [5], values: [1, 1, 2, 1, 1]}}
  - {{name: rep_tile, dtype: i64, shape: [5], values: [1, 2, 1, 1, 1]}}
  - {{name: rep1, dtype: i64, shape: [4], values: [1, 4, 1, 1]}}
  - {{name: heads, dtype: i64, shape: [4], values: [0, 4, -1, 4]}}
  - {{name: ax2, dtype: i64, shape: [1], values: [2]}}
outputs: [o]
nodes:
{}{}  - {{op: Transpose, inputs: [k], outputs: [kt], attrs: {{perm: [0, 1, 3, 2]}}}}
  - {{op: MatMul, inputs: [q, kt], outputs: [s]}}
  - {{op: Div, inputs: [s, two], outputs: [z]}}
  - {{op: Softmax, inputs: [z], outputs: [p], attrs: {{axis: -1}}}}
  - {{op: MatMul, inputs: [p, v], outputs: [o], name: pv}}
",
        r("k0", "k"),
        r("v0", "v")
    )
}

/// HF's repeat_kv: x[:, :, None].expand(B, Hkv, n, S, D).reshape(B, Hkv·n, S, D).
const REPEAT_KV: &str = "  - {op: Unsqueeze, inputs: [KV, ax2], outputs: [TAG_u]}
  - {op: Expand, inputs: [TAG_u, rep], outputs: [TAG_e]}
  - {op: Reshape, inputs: [TAG_e, heads], outputs: [OUT]}
";

/// The Attention node's inputs.
fn attention_inputs(g: &Graph) -> Vec<String> {
    let a: Vec<_> = g
        .nodes
        .iter()
        .filter(|n| n.op.name() == "Attention")
        .collect();
    assert_eq!(a.len(), 1, "{:?}", g.op_counts());
    a[0].inputs.clone()
}

#[test]
fn grouped_query_attention_reads_k_and_v_before_the_repeat() {
    for body in [
        gqa(2, REPEAT_KV),
        gqa(
            2,
            &REPEAT_KV
                .replace("Unsqueeze", "Unsqueeze, attrs: {axes: [2]}")
                .replace(", ax2]", "]"),
        ),
    ] {
        let g = graph(&body);
        let (o, r) = run_passes(&g, &PassOptions::default());
        assert_eq!(attention_inputs(&o), strs(&["q", "k0", "v0"]));
        assert_eq!(o.nodes.len(), 1, "the repeats go: {:?}", o.op_counts());
        assert_eq!(r.fired("attention"), 1);
        check_same(&g, &o, &[("batch", 3), ("seq", 5)]);
    }
    // A repeated K that another node reads stays for it; Attention still reads k0.
    let body = gqa(2, REPEAT_KV).replace("outputs: [o]\nnodes:", "outputs: [o, k]\nnodes:");
    let (o, _) = run_passes(&graph(&body), &PassOptions::default());
    assert_eq!(attention_inputs(&o), strs(&["q", "k0", "v0"]));
    assert_eq!(count(&o, "Expand"), 1);
}

/// `gqa(2, REPEAT_KV)` with Q, K and V split into heads from `[B, S, H·4]` inputs and
/// the output merged back to `[B, S, 16]`.
fn gqa_3d() -> String {
    gqa(2, REPEAT_KV)
        .replace(
            "  - {name: q, dtype: f32, shape: [batch, 4, seq, 4]}\n  - {name: k0, dtype: f32, shape: [batch, 2, seq, 4]}\n  - {name: v0, dtype: f32, shape: [batch, 2, seq, 4]}",
            "  - {name: xq, dtype: f32, shape: [batch, seq, 16]}\n  - {name: xk, dtype: f32, shape: [batch, seq, 8]}\n  - {name: xv, dtype: f32, shape: [batch, seq, 8]}",
        )
        .replace(
            "outputs: [o]\nnodes:\n",
            "  - {name: split4, dtype: i64, shape: [4], values: [0, 0, 4, 4]}
  - {name: split2, dtype: i64, shape: [4], values: [0, 0, 2, 4]}
  - {name: merged, dtype: i64, shape: [3], values: [0, 0, 16]}
outputs: [y]
nodes:
  - {op: Reshape, inputs: [xq, split4], outputs: [q1]}
  - {op: Transpose, inputs: [q1], outputs: [q], attrs: {perm: [0, 2, 1, 3]}}
  - {op: Reshape, inputs: [xk, split2], outputs: [k1]}
  - {op: Transpose, inputs: [k1], outputs: [k0], attrs: {perm: [0, 2, 1, 3]}}
  - {op: Reshape, inputs: [xv, split2], outputs: [v1]}
  - {op: Transpose, inputs: [v1], outputs: [v0], attrs: {perm: [0, 2, 1, 3]}}
  - {op: Transpose, inputs: [o], outputs: [ot], attrs: {perm: [0, 2, 1, 3]}}
  - {op: Reshape, inputs: [ot, merged], outputs: [y]}
",
        )
}

#[test]
fn grouped_query_attention_in_3d_absorbs_the_head_copies() {
    let g = graph(&gqa_3d());
    let (o, r) = run_passes(&g, &PassOptions::default());
    assert_eq!(r.fired("attention_heads"), 1, "{}", r);
    assert_eq!(o.nodes.len(), 1, "{:?}", o.op_counts());
    assert_eq!(attention_inputs(&o), strs(&["xq", "xk", "xv"]));
    assert!(matches!(
        o.nodes[0].op,
        Op::Attention {
            q_num_heads: Some(4),
            kv_num_heads: Some(2),
            ..
        }
    ));
    check_same(&g, &o, &[("batch", 3), ("seq", 5)]);
    // The merged output read by another node as well as the Reshape: the 4-D form, and
    // the split copies stay for it.
    for extra in ["o", "ot", "k0", "q1"] {
        let body = gqa_3d().replace("outputs: [y]\n", &format!("outputs: [y, {extra}]\n"));
        let g = graph(&body);
        let (o, r) = run_passes(&g, &PassOptions::default());
        assert_eq!(r.fired("attention_heads"), 0, "{extra}");
        assert_eq!(r.fired("attention"), 1, "{extra}");
        assert!(count(&o, "Transpose") > 0, "{extra}");
        check_same(&g, &o, &[("batch", 3), ("seq", 5)]);
    }
    // A second consumer (not a graph output) of the transposed Q blocks it too.
    let body = gqa_3d()
        .replace("outputs: [y]\n", "outputs: [y, q2]\n")
        .replace(
            "  - {op: Transpose, inputs: [o],",
            "  - {op: Neg, inputs: [q], outputs: [q2]}\n  - {op: Transpose, inputs: [o],",
        );
    let g = graph(&body);
    let (o, r) = run_passes(&g, &PassOptions::default());
    assert_eq!((r.fired("attention_heads"), r.fired("attention")), (0, 1));
    check_same(&g, &o, &[("batch", 3), ("seq", 5)]);
}

#[test]
fn multi_query_attention_with_expand_or_broadcast() {
    // One kv head expanded to the four query heads.
    let g = graph(&gqa(
        1,
        "  - {op: Expand, inputs: [KV, rep1], outputs: [OUT]}\n",
    ));
    let (o, _) = run_passes(&g, &PassOptions::default());
    assert_eq!(attention_inputs(&o), strs(&["q", "k0", "v0"]));
    assert_eq!(o.nodes.len(), 1);
    check_same(&g, &o, &[("batch", 3), ("seq", 5)]);
    // ... or left to MatMul broadcasting.
    let g = graph(&gqa(
        1,
        "  - {op: Identity, inputs: [KV], outputs: [OUT]}\n",
    ));
    let (o, _) = run_passes(&g, &PassOptions::default());
    assert_eq!(attention_inputs(&o), strs(&["q", "k0", "v0"]));
    check_same(&g, &o, &[("batch", 3), ("seq", 5)]);
}

#[test]
fn repeats_in_another_layout_are_not_grouped_query_heads() {
    // K.repeat(1, 2, 1, 1) as Unsqueeze(1) → Expand → Reshape: head h reads kv head h mod 2,
    // not Attention's h / 2. Attention takes the repeated K and V as they are.
    let tile = REPEAT_KV
        .replace("ax2", "ax1")
        .replace("[TAG_u, rep]", "[TAG_u, rep_tile]");
    let body = gqa(2, &tile).replace(
        "  - {name: ax2,",
        "  - {name: ax1, dtype: i64, shape: [1], values: [1]}\n  - {name: ax2,",
    );
    let g = graph(&body);
    let (o, _) = run_passes(&g, &PassOptions::default());
    assert_eq!(attention_inputs(&o), strs(&["q", "k", "v"]));
    check_same(&g, &o, &[("batch", 3), ("seq", 5)]);
    // K repeated and V not (V has all four heads): neither is read before a repeat.
    let body = gqa(2, REPEAT_KV)
        .replace("  - {op: Unsqueeze, inputs: [v0, ax2], outputs: [v0_u]}\n  - {op: Expand, inputs: [v0_u, rep], outputs: [v0_e]}\n  - {op: Reshape, inputs: [v0_e, heads], outputs: [v]}\n", "")
        .replace("[p, v]", "[p, vf]")
        .replace("  - {name: v0, dtype: f32, shape: [batch, 2, seq, 4]}", "  - {name: vf, dtype: f32, shape: [batch, 4, seq, 4]}");
    let g = graph(&body);
    let (o, _) = run_passes(&g, &PassOptions::default());
    assert_eq!(attention_inputs(&o), strs(&["q", "k", "vf"]));
    check_same(&g, &o, &[("batch", 3), ("seq", 5)]);
}

// ------------------------------------------------------- attention: must not fire

#[test]
fn softmax_on_a_non_last_axis_is_not_attention() {
    let nodes = format!("{QK}  - {{op: Div, inputs: [s, two], outputs: [z]}}\n  - {{op: Softmax, inputs: [z], outputs: [p], attrs: {{axis: 2}}, name: sm}}\n  - {{op: MatMul, inputs: [p, v], outputs: [o], name: pv}}\n");
    let (g, r) = fuse(&att("o", &nodes));
    assert!(attention(&g).is_empty());
    assert!(
        r.explain
            .iter()
            .any(|e| e.starts_with("Softmax 'sm': attention: Softmax axis 2")),
        "{:?}",
        r.explain
    );
}

#[test]
fn scores_needed_elsewhere_block_attention() {
    let nodes = format!("{QK}  - {{op: Div, inputs: [s, two], outputs: [z]}}\n{PV}");
    let (g, r) = fuse(&att("o, z", &nodes));
    assert!(attention(&g).is_empty());
    assert!(
        r.explain
            .iter()
            .any(|e| e.starts_with("Softmax 'sm'") && e.contains("graph output")),
        "{:?}",
        r.explain
    );
    let (g, _) = fuse(&att("o, p", &nodes));
    assert!(attention(&g).is_empty());
}

#[test]
fn non_constant_scale_is_not_attention() {
    let body = att(
        "o",
        &format!("{QK}  - {{op: Div, inputs: [s, t], outputs: [z]}}\n{PV}"),
    )
    .replace(
        "inputs:\n",
        "inputs:\n  - {name: t, dtype: f32, shape: []}\n",
    );
    let (g, r) = fuse(&body);
    assert!(attention(&g).is_empty());
    assert!(
        r.explain
            .iter()
            .any(|e| e.starts_with("Softmax 'sm'") && e.contains("not a MatMul(Q, Kᵀ)")),
        "{:?}",
        r.explain
    );
}

#[test]
fn mask_of_the_wrong_rank_is_not_attention() {
    // A rank-5 mask broadcasts the scores to rank 5: no 4-D Attention computes that.
    let body = att(
        "o",
        &format!("{QK}  - {{op: Add, inputs: [s, m5], outputs: [z]}}\n{PV}"),
    )
    .replace(
        "inputs:\n",
        "inputs:\n  - {name: m5, dtype: f32, shape: [3, 1, 1, 8, 8]}\n",
    );
    let (g, r) = fuse(&body);
    assert!(attention(&g).is_empty());
    assert!(
        r.explain.iter().any(|e| e.starts_with("Softmax 'sm'")
            && e.contains("attn_mask of shape [3, 1, 1, 8, 8] does not broadcast")),
        "{:?}",
        r.explain
    );
}

// ---------------------------------------------------------------- cleanup passes

#[test]
fn constant_folding_of_initializer_arithmetic() {
    let body = "
inputs: [{name: x, dtype: f32, shape: [2, 3]}]
initializers:
  - {name: a, dtype: f32, shape: [3], values: [1, 2, 3], trainable: false}
  - {name: c, dtype: f32, shape: [], values: [0.5], trainable: false}
outputs: [y]
nodes:
  - {op: Mul, inputs: [a, c], outputs: [ac]}
  - {op: Neg, inputs: [ac], outputs: [nac]}
  - {op: Add, inputs: [x, nac], outputs: [y]}
";
    let g = graph(body);
    let (o, r) = run_passes(&g, &only("constant_folding"));
    assert_eq!(
        o.op_counts().into_iter().collect::<Vec<_>>(),
        vec![("Add", 1)]
    );
    let nac = o.initializer("nac").unwrap();
    assert!(!nac.trainable && nac.source == graphrun::graph::InitSource::Data);
    assert_eq!(nac.tensor.to_f64_vec(), vec![-0.5, -1.0, -1.5]);
    assert!(
        o.initializer("a").is_none() && o.initializer("c").is_none(),
        "inputs of folded nodes pruned"
    );
    assert_eq!(r.fired("fold_constant"), 2);
    assert_same(&g, &o, &[]);
}

const SHAPE_ARITH: &str = "
initializers:
  - {name: i0, dtype: i64, shape: [1], values: [0]}
  - {name: minus1, dtype: i64, shape: [1], values: [-1]}
outputs: [y]
nodes:
  - {op: Shape, inputs: [x], outputs: [sx]}
  - {op: Gather, inputs: [sx, i0], outputs: [b]}
  - {op: Concat, inputs: [b, minus1], outputs: [shape], attrs: {axis: 0}}
  - {op: Reshape, inputs: [x, shape], outputs: [y]}
";

#[test]
fn constant_folding_of_static_shape_arithmetic() {
    let g = graph(&format!(
        "inputs: [{{name: x, dtype: f32, shape: [2, 3, 4]}}]\n{SHAPE_ARITH}"
    ));
    let (o, r) = run_passes(&g, &PassOptions::default());
    assert_eq!(
        o.op_counts().into_iter().collect::<Vec<_>>(),
        vec![("Reshape", 1)]
    );
    assert_eq!(
        o.initializer("shape").unwrap().tensor.to_i64_vec(),
        vec![2, -1]
    );
    assert_eq!((r.fired("fold_shape"), r.fired("fold_constant")), (1, 2));
    assert_same(&g, &o, &[]);
}

#[test]
fn constant_folding_leaves_symbolic_shapes() {
    let g = graph(&format!(
        "inputs: [{{name: x, dtype: f32, shape: [n, 3, 4]}}]\ndims: {{n: 2}}\n{SHAPE_ARITH}"
    ));
    let (o, r) = run_passes(&g, &PassOptions::default());
    assert_eq!(count(&o, "Shape"), 1);
    assert_eq!(r.fired("fold_shape"), 0);
    assert_same(&g, &o, &[("n", 5)]);
}

#[test]
fn constant_folding_leaves_trainable_weights() {
    let body = "
inputs: [{name: x, dtype: f32, shape: [2, 3]}]
initializers:
  - {name: w, dtype: f32, shape: [3, 3], init: {dist: normal, seed: 1}}
outputs: [y]
nodes:
  - {op: Transpose, inputs: [w], outputs: [wt], attrs: {perm: [1, 0]}}
  - {op: Relu, inputs: [wt], outputs: [wr]}
  - {op: MatMul, inputs: [x, wr], outputs: [y]}
";
    let g = graph(body);
    let (o, r) = run_passes(&g, &only("constant_folding"));
    assert_eq!(o.nodes.len(), 3);
    assert_eq!(r.total(), 0);
}

#[test]
fn dead_nodes_and_unused_initializers_go() {
    let body = "
inputs: [{name: x, dtype: f32, shape: [2, 3]}]
initializers:
  - {name: c, dtype: f32, shape: [3], values: [1, 2, 3], trainable: false}
  - {name: unused, dtype: f32, shape: [3], values: [1, 2, 3], trainable: false}
outputs: [y]
nodes:
  - {op: Relu, inputs: [x], outputs: [y], name: keep}
  - {op: Add, inputs: [x, c], outputs: [dead1], name: dead_a}
  - {op: Exp, inputs: [dead1], outputs: [dead2], name: dead_b}
";
    let g = graph(body);
    let (o, r) = run_passes(&g, &only("dead_node_elimination"));
    assert_eq!(
        o.nodes.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(),
        vec!["keep"]
    );
    assert!(o.initializers.is_empty());
    assert_eq!(
        (r.fired("dead_node"), r.fired("unused_initializer")),
        (2, 2)
    );
    assert_same(&g, &o, &[]);
}

const NOOP_HEAD: &str = "
inputs: [{name: x, dtype: f32, shape: [2, 3, 4]}]
initializers:
  - {name: same, dtype: i64, shape: [3], values: [0, 3, -1]}
";

fn noop(outputs: &str, nodes: &str) -> (Graph, Report) {
    let g = graph(&format!("{NOOP_HEAD}outputs: [{outputs}]\nnodes:\n{nodes}"));
    let (o, r) = run_passes(&g, &only("noop_removal"));
    assert_same(&g, &o, &[]);
    (o, r)
}

#[test]
fn noop_identity_dropout_cast_reshape() {
    let nodes = "  - {op: Identity, inputs: [x], outputs: [a]}
  - {op: Dropout, inputs: [a], outputs: [b], attrs: {ratio: 0.3}}
  - {op: Cast, inputs: [b], outputs: [c], attrs: {to: f32}}
  - {op: Reshape, inputs: [c, same], outputs: [d]}
  - {op: Relu, inputs: [d], outputs: [y]}
";
    let (g, r) = noop("y", nodes);
    assert_eq!(
        g.op_counts().into_iter().collect::<Vec<_>>(),
        vec![("Relu", 1)]
    );
    assert_eq!(g.nodes[0].inputs, vec!["x"]);
    for rule in [
        "identity",
        "dropout",
        "cast_same_dtype",
        "reshape_same_shape",
    ] {
        assert_eq!(r.fired(rule), 1, "{rule}");
    }
}

#[test]
fn noop_cast_to_another_dtype_and_real_reshape_stay() {
    let nodes = "  - {op: Cast, inputs: [x], outputs: [c], attrs: {to: f64}}
  - {op: Cast, inputs: [c], outputs: [c2], attrs: {to: f32}}
  - {op: Reshape, inputs: [c2, flat], outputs: [y]}
";
    let g = graph(&format!("{NOOP_HEAD}  - {{name: flat, dtype: i64, shape: [2], values: [0, -1]}}\noutputs: [y]\nnodes:\n{nodes}"));
    let (o, r) = run_passes(&g, &only("noop_removal"));
    assert_eq!(o.nodes.len(), 3);
    assert_eq!(r.total(), 0);
}

#[test]
fn noop_dropout_kept_while_training() {
    let nodes = "  - {op: Dropout, inputs: [x], outputs: [y], attrs: {ratio: 0.3}}\n  - {op: Dropout, inputs: [x], outputs: [z], attrs: {ratio: 0.0}}\n";
    let g = graph(&format!("{NOOP_HEAD}outputs: [y2, z2]\nnodes:\n{nodes}  - {{op: Relu, inputs: [y], outputs: [y2]}}\n  - {{op: Relu, inputs: [z], outputs: [z2]}}\n"));
    let opts = PassOptions {
        training: true,
        ..only("noop_removal")
    };
    let (o, _) = run_passes(&g, &opts);
    assert_eq!(count(&o, "Dropout"), 1, "only the ratio-0 Dropout goes");
}

#[test]
fn noop_transposes() {
    let nodes = "  - {op: Transpose, inputs: [x], outputs: [t0], attrs: {perm: [0, 1, 2]}}
  - {op: Transpose, inputs: [t0], outputs: [t1], attrs: {perm: [1, 2, 0]}}
  - {op: Transpose, inputs: [t1], outputs: [t2], attrs: {perm: [0, 2, 1]}}
  - {op: Transpose, inputs: [t2], outputs: [t3], attrs: {perm: [2, 1, 0]}}
  - {op: Relu, inputs: [t3], outputs: [y]}
";
    // [1,2,0] then [0,2,1] is [1,0,2]; then [2,1,0] gives [2,0,1]: one Transpose left.
    let (g, r) = noop("y", nodes);
    let perms: Vec<_> = g
        .nodes
        .iter()
        .filter_map(|n| match &n.op {
            Op::Transpose { perm } => perm.clone(),
            _ => None,
        })
        .collect();
    assert_eq!(perms, vec![vec![2, 0, 1]]);
    assert_eq!(r.fired("transpose_identity"), 1);
    assert_eq!(r.fired("transpose_pair"), 2);
    // A pair that composes to the identity disappears.
    let nodes = "  - {op: Transpose, inputs: [x], outputs: [t1], attrs: {perm: [1, 2, 0]}}
  - {op: Transpose, inputs: [t1], outputs: [t2], attrs: {perm: [2, 0, 1]}}
  - {op: Relu, inputs: [t2], outputs: [y]}
";
    let (g, _) = noop("y", nodes);
    assert_eq!(
        g.op_counts().into_iter().collect::<Vec<_>>(),
        vec![("Relu", 1)]
    );
}

#[test]
fn noop_never_removes_a_graph_output() {
    let (g, r) = noop("a", "  - {op: Identity, inputs: [x], outputs: [a]}\n");
    assert_eq!(count(&g, "Identity"), 1);
    assert_eq!(r.total(), 0);
}

#[test]
fn cse_merges_identical_nodes() {
    let body = "
inputs: [{name: x, dtype: f32, shape: [2, 3]}]
outputs: [y]
nodes:
  - {op: Exp, inputs: [x], outputs: [e1], name: first}
  - {op: Exp, inputs: [x], outputs: [e2], name: second}
  - {op: Relu, inputs: [e1], outputs: [r1]}
  - {op: Relu, inputs: [e2], outputs: [r2]}
  - {op: Softmax, inputs: [x], outputs: [s1], attrs: {axis: 0}}
  - {op: Softmax, inputs: [x], outputs: [s2], attrs: {axis: 1}}
  - {op: Add, inputs: [r1, r2], outputs: [a]}
  - {op: Add, inputs: [s1, s2], outputs: [b]}
  - {op: Add, inputs: [a, b], outputs: [y]}
";
    let g = graph(body);
    let (o, r) = run_passes(&g, &only("cse"));
    assert_eq!(
        (count(&o, "Exp"), count(&o, "Relu"), count(&o, "Softmax")),
        (1, 1, 2),
        "different attrs are different nodes"
    );
    assert_eq!(
        o.nodes.iter().find(|n| n.op.name() == "Exp").unwrap().name,
        "first"
    );
    assert_eq!(r.fired("cse"), 2);
    assert_same(&g, &o, &[]);
}

#[test]
fn cse_keeps_the_node_that_produces_a_graph_output() {
    let body = "
inputs: [{name: x, dtype: f32, shape: [2, 3]}]
outputs: [e2, y]
nodes:
  - {op: Exp, inputs: [x], outputs: [e1]}
  - {op: Exp, inputs: [x], outputs: [e2]}
  - {op: Relu, inputs: [e1], outputs: [y]}
";
    let g = graph(body);
    let (o, _) = run_passes(&g, &only("cse"));
    assert_eq!(count(&o, "Exp"), 1);
    assert_eq!(
        o.nodes
            .iter()
            .find(|n| n.op.name() == "Relu")
            .unwrap()
            .inputs,
        vec!["e2"]
    );
    assert_same(&g, &o, &[]);
}

// ---------------------------------------------------------------- manager

#[test]
fn passes_can_be_disabled_and_unknown_names_are_errors() {
    let g = graph(&mlp(
        "y",
        &format!("{FC}  - {{op: Relu, inputs: [hb], outputs: [y]}}\n"),
    ));
    let (o, r) = run_passes(
        &g,
        &PassOptions {
            disabled: vec!["matmul_epilogue_fusion".into()],
            training: false,
            ..Default::default()
        },
    );
    assert!(fused(&o).is_empty());
    assert!(
        !r.passes
            .iter()
            .find(|p| p.name == "matmul_epilogue_fusion")
            .unwrap()
            .enabled
    );
    assert!(
        r.explain.iter().any(|e| e.contains("disabled")),
        "{:?}",
        r.explain
    );
    let e = optimize(
        &g,
        &PassOptions {
            disabled: vec!["fusion".into()],
            training: false,
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("unknown pass 'fusion'"), "{e}");
}

#[test]
fn report_lists_every_pass_in_order_and_logs_rules() {
    let g = graph(&mlp(
        "y",
        &format!("{FC}  - {{op: Relu, inputs: [hb], outputs: [y]}}\n"),
    ));
    let (_, r) = run_passes(&g, &PassOptions::default());
    assert_eq!(
        r.passes.iter().map(|p| p.name).collect::<Vec<_>>(),
        PASSES.to_vec()
    );
    assert!(
        r.log
            .iter()
            .any(|l| l == "matmul_epilogue_fusion: matmul_epilogue at 'fc'"),
        "{:?}",
        r.log
    );
    let text = r.to_string();
    assert!(text.contains("matmul_epilogue ×1"), "{text}");
}

#[test]
fn optimize_is_pure_and_idempotent() {
    for name in ["mlp", "mlp_large", "gpt_block", "attention"] {
        let g = Model::load(format!("{}/models/{name}.yaml", env!("CARGO_MANIFEST_DIR")))
            .unwrap()
            .graph;
        let before = g.clone();
        let (a, _) = run_passes(&g, &PassOptions::default());
        let (b, _) = run_passes(&g, &PassOptions::default());
        assert_eq!(g, before, "{name}: the input is untouched");
        assert_eq!(a, b, "{name}: same input, same output");
        let (_, again) = run_passes(&a, &PassOptions::default());
        assert_eq!(
            again.total(),
            0,
            "{name}: a second run finds nothing: {:?}",
            again.log
        );
    }
}

// ---------------------------------------------------------------- models

fn model(name: &str, dims: &[(&str, usize)]) -> (Graph, Report) {
    let g = Model::load(format!("{}/models/{name}.yaml", env!("CARGO_MANIFEST_DIR")))
        .unwrap()
        .graph;
    let (o, r) = run_passes(&g, &PassOptions::default());
    assert_same(&g, &o, dims);
    (o, r)
}

#[test]
fn model_mlp() {
    let (g, r) = model("mlp", &[("batch", 4)]);
    let acts: Vec<_> = fused(&g).into_iter().map(|f| f.0).collect();
    assert_eq!(acts, vec!["relu", "relu", "none"]);
    assert_eq!(
        g.op_counts().into_iter().collect::<Vec<_>>(),
        vec![("FusedMatMul", 3), ("SoftmaxCrossEntropyLoss", 1)]
    );
    assert_eq!(
        g.nodes.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(),
        vec!["fc1", "fc2", "fc3", "loss"]
    );
    assert!(r.explain.is_empty(), "{:?}", r.explain);
}

#[test]
fn model_mlp_large() {
    let (g, _) = model("mlp_large", &[("batch", 8)]);
    let f = fused(&g);
    assert_eq!(f.len(), 2);
    assert_eq!((f[0].0, f[0].2.len()), ("gelu_tanh", 3));
    assert_eq!(f[1], ("none", false, strs(&["g", "w2", "b2", "x"])));
    assert_eq!(
        g.op_counts().into_iter().collect::<Vec<_>>(),
        vec![("FusedMatMul", 2), ("ReduceMeanSquare", 1), ("Sub", 1)]
    );
}

#[test]
fn model_gpt_block() {
    let dims = [("batch", 2), ("seq", 32)];
    let (g, r) = model("gpt_block", &dims);
    assert_eq!(attention(&g), vec![(true, 0.125, 3)]);
    // The head split/merge copies went into the 3-D Attention, and then the qkv Split:
    // it reads the packed projection; gradients agree with the unfused graph's.
    assert_eq!(r.fired("attention_heads"), 1, "{}", r);
    assert_eq!(r.fired("attention_qkv"), 1, "{}", r);
    assert_eq!(attention_inputs(&g), strs(&["qkv", "", ""]));
    for op in ["Transpose", "Reshape", "Split"] {
        assert_eq!(count(&g, op), 0, "{op} left");
    }
    let g0 = Model::load(format!(
        "{}/models/gpt_block.yaml",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
    .graph;
    assert_same_grads(&g0, &g, &dims);
    let acts: Vec<_> = fused(&g).into_iter().map(|f| (f.0, f.2.len())).collect();
    assert_eq!(
        acts,
        vec![("none", 3), ("none", 4), ("gelu_tanh", 3), ("none", 4)]
    );
    for op in ["MatMul", "Softmax", "Where", "Trilu", "Tanh", "Pow"] {
        assert_eq!(count(&g, op), 0, "{op} left");
    }
    assert_eq!(
        count(&g, "LayerNormalization"),
        2,
        "the LayerNorms are left"
    );
    assert!(r.explain.is_empty(), "{:?}", r.explain);
}

#[test]
fn model_attention() {
    let (g, _) = model("attention", &[("batch", 2), ("seq", 32), ("heads", 2)]);
    assert_eq!(attention(&g), vec![(true, 0.125, 3)]);
    assert_eq!(g.nodes.len(), 1);
    assert!(g.initializers.is_empty());
}

#[test]
fn cse_merges_commutative_ops_with_swapped_inputs_only() {
    let body = "
inputs: [{name: x, dtype: f32, shape: [2, 3]}, {name: z, dtype: f32, shape: [2, 3]}]
outputs: [y]
nodes:
  - {op: Add, inputs: [x, z], outputs: [a1]}
  - {op: Add, inputs: [z, x], outputs: [a2]}
  - {op: Mul, inputs: [x, z], outputs: [m1]}
  - {op: Mul, inputs: [z, x], outputs: [m2]}
  - {op: Sub, inputs: [x, z], outputs: [s1]}
  - {op: Sub, inputs: [z, x], outputs: [s2]}
  - {op: Add, inputs: [a1, a2], outputs: [p]}
  - {op: Add, inputs: [m1, m2], outputs: [q]}
  - {op: Add, inputs: [s1, s2], outputs: [r]}
  - {op: Add, inputs: [p, q], outputs: [t]}
  - {op: Add, inputs: [t, r], outputs: [y]}
";
    let g = graph(body);
    let (o, r) = run_passes(&g, &only("cse"));
    assert_eq!(r.fired("cse"), 2, "Add and Mul merge; Sub does not commute");
    assert_eq!(count(&o, "Sub"), 2);
    assert_same(&g, &o, &[]);
}

// ---------------------------------------------------------------- backward fusion

#[path = "common/mod.rs"]
mod common;

/// An MLP as the epilogue pass leaves it: y = fc2(act(fc1(x))), loss = mean(y²).
fn two_layer(act: &str) -> Graph {
    graph(&format!(
        "
inputs:
  - {{name: x, dtype: f32, shape: [6, 8]}}
outputs: [loss]
initializers:
  - {{name: w1, dtype: f32, shape: [8, 16], init: {{dist: xavier_uniform, seed: 1}}}}
  - {{name: b1, dtype: f32, shape: [16], init: {{dist: uniform, low: -0.5, high: 0.5, seed: 2}}}}
  - {{name: w2, dtype: f32, shape: [16, 8], init: {{dist: xavier_uniform, seed: 3}}}}
  - {{name: b2, dtype: f32, shape: [8], init: {{dist: uniform, low: -0.5, high: 0.5, seed: 4}}}}
nodes:
  - {{op: FusedMatMul, inputs: [x, w1, b1], outputs: [g], name: fc1, attrs: {{activation: {act}}}}}
  - {{op: FusedMatMul, inputs: [g, w2, b2, x], outputs: [y], name: fc2}}
  - {{op: Mul, inputs: [y, y], outputs: [y2]}}
  - {{op: ReduceMean, inputs: [y2], outputs: [loss], attrs: {{keepdims: 0}}}}
"
    ))
}

/// Sessions on `be` of `g` with every pass, and without `matmul_epilogue_fusion` (whose
/// backward-graph rules the tests below compare against the plain backward).
fn fused_and_plain(g: &Graph, be: graphrun::BackendKind) -> (Session, Session) {
    with_and_without(g, be, false, "matmul_epilogue_fusion", &[])
}

/// Sessions on `be` of `g` (the forward optimized when `fuse`; the backward always is)
/// with every pass, and without `pass`.
fn with_and_without(
    g: &Graph,
    be: graphrun::BackendKind,
    fuse: bool,
    pass: &str,
    dims: &[(&str, usize)],
) -> (Session, Session) {
    let session = |disabled: Vec<String>| {
        let opts = SessionOptions {
            fuse,
            backend: be,
            dims: dims.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            passes: PassOptions {
                disabled,
                training: false,
                ..Default::default()
            },
            ..Default::default()
        };
        Session::new(g.clone(), opts).unwrap()
    };
    (session(vec![]), session(vec![pass.into()]))
}

/// Every gradient of `fused` within 1e-5 of `plain`'s, and none all zeros.
fn same_gradients(
    what: &str,
    fused: &mut Session,
    plain: &mut Session,
    feeds: &std::collections::HashMap<String, graphrun::Tensor>,
) {
    let none = Default::default();
    let a = fused.backward(feeds, &none).unwrap().grads;
    let b = plain.backward(feeds, &none).unwrap().grads;
    assert_eq!(a.len(), b.len());
    for ((n, x), (m, y)) in a.iter().zip(&b) {
        assert_eq!(n, m);
        let e = common::rel_err(&x.to_f64_vec(), &y.to_f64_vec());
        assert!(e <= 1e-5, "{what} gradient of {n}: rel err {e:.2e}");
        assert!(
            x.to_f64_vec().iter().any(|&v| v != 0.0),
            "{what}: {n} all zeros"
        );
    }
}

/// `dact_into_da`: fc1's activation derivative moves into fc2's dA product (fc2's
/// FusedMatMulGrad gets a_activation and fc1's Pre; fc1's runs without activation), and
/// fc1's bias gradient with it (fc2's output 3, dBiasA; fc1's keeps dA and dW), and every
/// gradient is what the unfused backward computes, on every backend.
#[test]
fn activation_derivative_moves_into_the_next_layers_da() {
    for act in ["gelu_tanh", "relu", "silu", "gelu"] {
        let g = two_layer(act);
        let feeds = Model { graph: g.clone() }
            .random_inputs(3, &BTreeMap::new())
            .unwrap();
        for be in common::backends() {
            let (mut fused, mut plain) = fused_and_plain(&g, be);
            let (bwd, _) = fused.backward_graph(&feeds).unwrap();
            let grads: Vec<(String, usize, &str, Vec<String>)> = bwd
                .graph
                .nodes
                .iter()
                .filter_map(|n| match n.op {
                    Op::FusedMatMulGrad {
                        activation,
                        a_activation,
                        ..
                    } => Some((
                        n.name.clone(),
                        n.inputs.len(),
                        a_activation.name(),
                        n.outputs.clone(),
                    ))
                    .filter(|_| activation.name() == "none"),
                    _ => None,
                })
                .collect();
            assert_eq!(grads.len(), 2, "{act} {be:?}: {grads:?}");
            let find = |name: &str| grads.iter().find(|g| g.0 == name).expect(name);
            let (_, ins, a_act, outs) = find("fc2/FusedMatMulGrad");
            assert_eq!((*ins, *a_act), (5, act), "{act} {be:?}: {grads:?}");
            assert_eq!(outs.len(), 4, "{act} {be:?}: {outs:?}");
            let (_, ins, a_act, outs1) = find("fc1/FusedMatMulGrad");
            assert_eq!(
                (*ins, *a_act, outs1.len()),
                (3, "none", 2),
                "{act} {be:?}: {grads:?}"
            );
            // fc2's dBiasA is the gradient the optimizer reads for b1.
            let b1 = &bwd.grads.iter().find(|(p, _)| p == "b1").expect("b1").1;
            assert_eq!(&outs[3], b1, "{act} {be:?}");
            same_gradients(&format!("{act} {be:?}"), &mut fused, &mut plain, &feeds);
        }
    }
}

/// An MSE written as Sub/Mul/ReduceMean: the mean of the square becomes one
/// ReduceMeanSquare (outputs and gradients as before); not where the squares are read
/// elsewhere or the product is not a square.
#[test]
fn mse_mean_of_a_square_fuses() {
    let body = |outputs: &str, sq: &str| {
        format!(
            "
inputs:
  - {{name: y, dtype: f32, shape: [4, 6]}}
  - {{name: t, dtype: f32, shape: [4, 6]}}
outputs: [{outputs}]
nodes:
  - {{op: Sub, inputs: [y, t], outputs: [d]}}
  - {{op: Mul, inputs: [{sq}], outputs: [d2]}}
  - {{op: ReduceMean, inputs: [d2], outputs: [loss], attrs: {{keepdims: 0}}}}
"
        )
    };
    let (g, r) = fuse(&body("loss", "d, d"));
    assert_eq!(r.fired("mean_square"), 1);
    assert_eq!(count(&g, "ReduceMeanSquare"), 1);
    assert_eq!(count(&g, "Mul") + count(&g, "ReduceMean"), 0);
    let (g, r) = fuse(&body("loss, d2", "d, d"));
    assert_eq!((r.fired("mean_square"), count(&g, "Mul")), (0, 1));
    let (g, r) = fuse(&body("loss", "d, y"));
    assert_eq!((r.fired("mean_square"), count(&g, "Mul")), (0, 1));
}

/// `ln_grad_residual`: a pre-LayerNorm residual block's `Add(dX, residual gradient)` is
/// folded into the LayerNormalizationGrad (its input 5); gradients as unfused, on every
/// backend.
#[test]
fn residual_gradient_folds_into_layer_norm_grad() {
    let g = graph(
        "
inputs:
  - {name: x, dtype: f32, shape: [6, 8]}
outputs: [loss]
initializers:
  - {name: s, dtype: f32, shape: [8], init: {dist: uniform, low: 0.5, high: 1.5, seed: 1}}
  - {name: b, dtype: f32, shape: [8], init: {dist: uniform, low: -0.5, high: 0.5, seed: 2}}
  - {name: w, dtype: f32, shape: [8, 8], init: {dist: xavier_uniform, seed: 3}}
nodes:
  - {op: LayerNormalization, inputs: [x, s, b], outputs: [n], attrs: {axis: -1}}
  - {op: FusedMatMul, inputs: [n, w, '', x], outputs: [y], name: fc}
  - {op: Mul, inputs: [y, y], outputs: [y2]}
  - {op: ReduceMean, inputs: [y2], outputs: [loss], attrs: {keepdims: 0}}
",
    );
    let feeds = Model { graph: g.clone() }
        .random_inputs(5, &BTreeMap::new())
        .unwrap();
    for be in common::backends() {
        let (mut fused, mut plain) = fused_and_plain(&g, be);
        let (bwd, _) = fused.backward_graph(&feeds).unwrap();
        let lng: Vec<usize> = bwd
            .graph
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::LayerNormalizationGrad { .. }))
            .map(|n| n.inputs.len())
            .collect();
        assert_eq!(lng, [6], "{be:?}");
        same_gradients(&format!("{be:?}"), &mut fused, &mut plain, &feeds);
    }
}

/// `attention_qkv`: a 3-D Attention whose Q, K and V are a Split of one projection on the
/// last axis into Hq·D, Hkv·D, Hkv·D reads the projection packed (K and V omitted); the
/// Split goes, and the backward's Concat with it (one packed dQKV). Multi-head and
/// grouped-query; not where a part has a second reader, the split is not Hq·D, Hkv·D,
/// Hkv·D (V's head size differs) or is on another axis. Outputs and gradients as unfused
/// on every backend.
#[test]
fn attention_reads_a_split_qkv_packed() {
    let body = |x: &str, split: &str, axis: i64, heads: (usize, usize), outputs: &str| {
        format!(
            "
inputs:
  - {{name: x, dtype: f32, shape: {x}}}
initializers:
  - {{name: sizes, dtype: i64, shape: [3], values: {split}}}
outputs: [{outputs}]
nodes:
  - {{op: Split, inputs: [x, sizes], outputs: [q, k, v], attrs: {{axis: {axis}}}}}
  - {{op: Attention, inputs: [q, k, v], outputs: [y], name: att, attrs: {{is_causal: 1, q_num_heads: {}, kv_num_heads: {}}}}}
",
            heads.0, heads.1
        )
    };
    let packed = |g: &Graph| {
        g.nodes
            .iter()
            .find(|n| n.op.name() == "Attention")
            .map(|n| n.inputs.clone())
    };
    for (x, split, heads) in [
        ("[2, 5, 48]", "[16, 16, 16]", (2, 2)),
        ("[2, 5, 32]", "[16, 8, 8]", (2, 1)),
    ] {
        let g = graph(&body(x, split, -1, heads, "y"));
        let (o, r) = run_passes(&g, &PassOptions::default());
        assert_eq!(r.fired("attention_qkv"), 1, "{split}: {r}");
        assert_eq!(packed(&o), Some(strs(&["x", "", ""])), "{split}");
        assert_eq!((count(&o, "Split"), o.nodes.len()), (0, 1), "{split}");
        check_same(&g, &o, &[]);
        // The backward has no Concat: AttentionGrad writes dQKV, the gradient of x.
        let feeds = Model { graph: g.clone() }
            .random_inputs(3, &BTreeMap::new())
            .unwrap();
        for be in common::backends() {
            let opts = |disabled: Vec<String>| SessionOptions {
                fuse: false,
                backend: be,
                passes: PassOptions {
                    disabled,
                    training: false,
                    ..Default::default()
                },
                ..Default::default()
            };
            // Fused before differentiating, as the CLI does.
            let mut fused = Session::new(o.clone(), opts(vec![])).unwrap();
            let mut plain = Session::new(g.clone(), opts(vec!["attention_fusion".into()])).unwrap();
            let (bwd, _) = fused.backward_graph(&feeds).unwrap();
            let ops = bwd.graph.op_counts();
            assert!(!ops.contains_key("Concat"), "{split} {be:?}: {ops:?}");
            let ag: Vec<&Vec<String>> = bwd
                .graph
                .nodes
                .iter()
                .filter(|n| n.op.name() == "AttentionGrad")
                .map(|n| &n.outputs)
                .collect();
            assert_eq!(ag.len(), 1);
            assert!(!ag[0][0].is_empty() && ag[0][1..].iter().all(|o| o.is_empty()));
            let (a, b) = (fused.run(&feeds).unwrap(), plain.run(&feeds).unwrap());
            let e = common::rel_err(&a[0].1.to_f64_vec(), &b[0].1.to_f64_vec());
            assert!(e <= 1e-5, "{split} {be:?}: y rel err {e:.2e}");
            let none = Default::default();
            let a = fused.backward(&feeds, &none).unwrap().grads;
            let b = plain.backward(&feeds, &none).unwrap().grads;
            let e = common::rel_err(&a[0].1.to_f64_vec(), &b[0].1.to_f64_vec());
            assert!(e <= 1e-5, "{split} {be:?}: dx rel err {e:.2e}");
            assert!(a[0].1.to_f64_vec().iter().any(|&v| v != 0.0));
        }
    }
    // Not fused: a second reader of K, V's head size twice Q's (an unequal split), the
    // sequence axis.
    for (b, why) in [
        (
            body("[2, 5, 48]", "[16, 16, 16]", -1, (2, 2), "y, k"),
            "read by another node",
        ),
        (
            body("[2, 5, 64]", "[16, 16, 32]", 2, (2, 2), "y"),
            "Hq·D, Hkv·D, Hkv·D",
        ),
        (
            body("[2, 15, 16]", "[5, 5, 5]", 1, (2, 2), "y"),
            "Hq·D, Hkv·D, Hkv·D",
        ),
    ] {
        let g = graph(&b);
        let (o, r) = run_passes(&g, &PassOptions::default());
        assert_eq!(r.fired("attention_qkv"), 0, "{why}");
        assert_eq!(packed(&o), Some(strs(&["q", "k", "v"])), "{why}");
        check_same(&g, &o, &[]);
    }
}

/// `residual_norm`: an `Add` of two values of one shape feeding a LayerNormalization or
/// RMSNormalization becomes one AddLayerNormalization / AddRMSNormalization that writes
/// the sum too: the pre-norm stream whose sum the next residual reads, the post-norm sum
/// read by nothing else, the statistics and the sum as graph outputs. Outputs and
/// gradients as unfused, and as with the pass off on every backend. Not where the Add
/// broadcasts (a bias), the scale is computed from the sum, or a MatMul epilogue took the
/// Add first (the residual then costs nothing in the product).
#[test]
fn residual_norms_fuse() {
    let body = |nodes: &str, outputs: &str| {
        format!(
            "
inputs:
  - {{name: x, dtype: f32, shape: [batch, 5, 8]}}
  - {{name: h, dtype: f32, shape: [batch, 5, 8]}}
outputs: [{outputs}]
initializers:
  - {{name: s, dtype: f32, shape: [8], init: {{dist: uniform, low: 0.5, high: 1.5, seed: 1}}}}
  - {{name: b, dtype: f32, shape: [8], init: {{dist: uniform, low: -0.5, high: 0.5, seed: 2}}}}
  - {{name: w, dtype: f32, shape: [8, 8], init: {{dist: xavier_uniform, seed: 3}}}}
nodes:
{nodes}"
        )
    };
    let fires = [
        (
            "pre-norm, the sum read on",
            "AddLayerNormalization",
            "  - {op: Add, inputs: [x, h], outputs: [r]}
  - {op: LayerNormalization, inputs: [r, s, b], outputs: [n], attrs: {axis: -1}}
  - {op: MatMul, inputs: [n, w], outputs: [m]}
  - {op: Add, inputs: [m, r], outputs: [y]}
",
            "y",
        ),
        (
            "post-norm RMS, the sum read by nothing else",
            "AddRMSNormalization",
            "  - {op: Tanh, inputs: [x], outputs: [t]}
  - {op: Add, inputs: [h, t], outputs: [r]}
  - {op: RMSNormalization, inputs: [r, s], outputs: [y], attrs: {axis: -1, epsilon: 0.01}}
",
            "y",
        ),
        (
            "the statistics and the sum as outputs",
            "AddLayerNormalization",
            "  - {op: Add, inputs: [x, h], outputs: [r]}
  - {op: LayerNormalization, inputs: [r, s], outputs: [y, mean, inv], attrs: {axis: 1}}
",
            "y, mean, inv, r",
        ),
    ];
    let dims = [("batch", 2)];
    for (what, op, nodes, outputs) in fires {
        let g = graph(&body(nodes, outputs));
        let (o, r) = run_passes(&g, &PassOptions::default());
        assert_eq!(r.fired("residual_norm"), 1, "{what}: {r}");
        assert_eq!(
            (count(&o, op), count(&o, "Add")),
            (1, 0),
            "{what}: {:?}",
            o.nodes
        );
        check_same(&g, &o, &dims);
        // Every backend: as with the pass off, forward and backward.
        let feeds = Model { graph: g.clone() }
            .random_inputs(4, &dims.iter().map(|(k, v)| (k.to_string(), *v)).collect())
            .unwrap();
        for be in common::backends() {
            let (mut fused, mut plain) =
                with_and_without(&g, be, true, "residual_norm_fusion", &dims);
            let (a, b) = (fused.run(&feeds).unwrap(), plain.run(&feeds).unwrap());
            for ((n, x), (_, y)) in a.iter().zip(&b) {
                let e = common::rel_err(&x.to_f64_vec(), &y.to_f64_vec());
                assert!(e <= 1e-5, "{what} on {be:?}: {n} rel err {e:.2e}");
            }
            same_gradients(&format!("{what} on {be:?}"), &mut fused, &mut plain, &feeds);
        }
    }
    let stays = [
        (
            "a broadcast Add (a bias)",
            "  - {op: Add, inputs: [x, b], outputs: [r]}
  - {op: LayerNormalization, inputs: [r, s, b], outputs: [y], attrs: {axis: -1}}
",
        ),
        (
            "a scale computed from the sum",
            "  - {op: Add, inputs: [x, h], outputs: [r]}
  - {op: ReduceMean, inputs: [r], outputs: [c], attrs: {axes: [0, 1], keepdims: 0}}
  - {op: LayerNormalization, inputs: [r, c], outputs: [y], attrs: {axis: -1}}
",
        ),
        (
            "an Add a MatMul epilogue took",
            "  - {op: MatMul, inputs: [x, w], outputs: [m]}
  - {op: Add, inputs: [m, h], outputs: [r]}
  - {op: LayerNormalization, inputs: [r, s, b], outputs: [y], attrs: {axis: -1}}
",
        ),
    ];
    for (what, nodes) in stays {
        let g = graph(&body(nodes, "y"));
        let (o, r) = run_passes(&g, &PassOptions::default());
        assert_eq!(r.fired("residual_norm"), 0, "{what}");
        assert_eq!(count(&o, "AddLayerNormalization"), 0, "{what}");
        assert_eq!(count(&o, "LayerNormalization"), 1, "{what}");
        assert_same(&g, &o, &dims);
    }
}

/// `rms_norm`: the RMS normalizations exporters write as elementwise chains become one
/// RMSNormalization: `Pow(x, 2)` or `x·x`, `ReduceMean` over the trailing axes, `+ eps`,
/// `Sqrt`, then `Reciprocal` and a Mul, `1 / root` and a Mul, or `x / root`, then the
/// scale (absent: ones). Outputs and gradients as unfused. Not where eps is not a
/// constant, an intermediate is read elsewhere, the mean is not over the trailing axes
/// or not of a square; a scale that broadcasts beyond the normalized axes stays outside.
#[test]
fn rms_norm_chains_fuse() {
    let body = |inputs: &str, nodes: &str, outputs: &str| {
        format!(
            "
inputs:
  - {{name: x, dtype: f32, shape: [3, 5, 8]}}
{inputs}outputs: [{outputs}]
initializers:
  - {{name: s, dtype: f32, shape: [8], init: {{dist: uniform, low: 0.5, high: 1.5, seed: 1}}}}
  - {{name: s58, dtype: f32, shape: [5, 8], init: {{dist: uniform, low: 0.5, high: 1.5, seed: 2}}}}
  - {{name: two, dtype: f32, shape: [], values: [2.0], trainable: false}}
  - {{name: four, dtype: f32, shape: [], values: [4.0], trainable: false}}
  - {{name: one, dtype: f32, shape: [], values: [1.0], trainable: false}}
  - {{name: eps, dtype: f32, shape: [], values: [1.0e-5], trainable: false}}
nodes:
{nodes}"
        )
    };
    let chain = |square: &str, axes: &str, inv: &str, tail: &str| {
        format!(
            "  {square}
  - {{op: ReduceMean, inputs: [sq], outputs: [ms], attrs: {{axes: {axes}, keepdims: 1}}}}
  - {{op: Add, inputs: [ms, eps], outputs: [v]}}
  - {{op: Sqrt, inputs: [v], outputs: [root]}}
{inv}{tail}"
        )
    };
    let pow = "- {op: Pow, inputs: [x, two], outputs: [sq]}";
    let mul = "- {op: Mul, inputs: [x, x], outputs: [sq]}";
    let recip = "  - {op: Reciprocal, inputs: [root], outputs: [r]}
  - {op: Mul, inputs: [x, r], outputs: [y]}
";
    let div_one = "  - {op: Div, inputs: [one, root], outputs: [r]}
  - {op: Mul, inputs: [r, x], outputs: [y]}
";
    let div_x = "  - {op: Div, inputs: [x, root], outputs: [y]}\n";
    let scaled = "  - {op: Mul, inputs: [s, y], outputs: [out]}\n";
    let rms = |g: &Graph| {
        g.nodes
            .iter()
            .filter_map(|n| match n.op {
                Op::LayerNormalization {
                    axis, rms: true, ..
                } => Some(axis),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    // (what, nodes, outputs, the axis of the RMSNormalization made, Muls left)
    let fires = [
        (
            "Pow, Reciprocal",
            chain(pow, "[-1]", recip, scaled),
            "out",
            2,
            0,
        ),
        (
            "x·x, 1 / root",
            chain(mul, "[2]", div_one, scaled),
            "out",
            2,
            0,
        ),
        ("x / root", chain(mul, "[-1]", div_x, scaled), "out", 2, 0),
        (
            "two trailing axes, Scale [5, 8]",
            chain(
                pow,
                "[2, 1]",
                div_x,
                "  - {op: Mul, inputs: [y, s58], outputs: [out]}\n",
            ),
            "out",
            1,
            0,
        ),
        ("no scale", chain(pow, "[-1]", recip, ""), "y", 2, 0),
        (
            "a scale beyond the normalized axes stays outside",
            chain(
                pow,
                "[-1]",
                recip,
                "  - {op: Mul, inputs: [y, s58], outputs: [out]}\n",
            ),
            "out",
            2,
            1,
        ),
    ];
    for (what, nodes, outputs, axis, muls) in fires {
        let (g, r) = fuse(&body("", &nodes, outputs));
        assert_eq!(r.fired("rms_norm"), 1, "{what}");
        assert_eq!(rms(&g), [axis], "{what}");
        assert_eq!(count(&g, "Mul"), muls, "{what}");
        for op in ["Pow", "ReduceMean", "Add", "Sqrt", "Reciprocal", "Div"] {
            assert_eq!(count(&g, op), 0, "{what}: {op} left");
        }
    }
    let eps_input = "  - {name: e, dtype: f32, shape: [], range: [0.001, 0.01]}\n";
    let stays = [
        (
            "eps an input",
            eps_input,
            chain(pow, "[-1]", recip, scaled).replace("[ms, eps]", "[ms, e]"),
            "out",
        ),
        (
            "the squares an output",
            "",
            chain(pow, "[-1]", recip, scaled),
            "out, sq",
        ),
        (
            "the root an output",
            "",
            chain(pow, "[-1]", recip, scaled),
            "out, root",
        ),
        (
            "the mean over a middle axis",
            "",
            chain(pow, "[1]", recip, scaled),
            "out",
        ),
        (
            "a fourth power",
            "",
            chain(pow, "[-1]", recip, scaled).replace("[x, two]", "[x, four]"),
            "out",
        ),
        (
            "the root divides another value",
            "",
            chain(
                pow,
                "[-1]",
                "  - {op: Div, inputs: [s, root], outputs: [y]}\n",
                scaled,
            ),
            "out",
        ),
    ];
    for (what, inputs, nodes, outputs) in stays {
        let (g, r) = fuse(&body(inputs, &nodes, outputs));
        assert_eq!(r.fired("rms_norm"), 0, "{what}");
        assert!(rms(&g).is_empty(), "{what}");
        assert_eq!(count(&g, "Sqrt"), 1, "{what}");
    }
}

/// `rms_norm` in the f16 form (LLaMA's): x widened to f32 by a Cast, the chain in f32,
/// cast back to f16 and scaled in f16: one RMSNormalization on the f16 x, outputs as
/// unfused within f16's tolerance.
#[test]
fn rms_norm_fuses_through_the_widening_casts() {
    let g = graph(
        "
inputs:
  - {name: x, dtype: f16, shape: [4, 16]}
outputs: [out]
initializers:
  - {name: s, dtype: f16, shape: [16], init: {dist: uniform, low: 0.5, high: 1.5, seed: 1}}
  - {name: two, dtype: f32, shape: [], values: [2.0], trainable: false}
  - {name: eps, dtype: f32, shape: [], values: [1.0e-6], trainable: false}
nodes:
  - {op: Cast, inputs: [x], outputs: [xf], attrs: {to: 1}}
  - {op: Pow, inputs: [xf, two], outputs: [sq]}
  - {op: ReduceMean, inputs: [sq], outputs: [ms], attrs: {axes: [-1], keepdims: 1}}
  - {op: Add, inputs: [ms, eps], outputs: [v]}
  - {op: Sqrt, inputs: [v], outputs: [root]}
  - {op: Reciprocal, inputs: [root], outputs: [r]}
  - {op: Mul, inputs: [xf, r], outputs: [yf]}
  - {op: Cast, inputs: [yf], outputs: [y], attrs: {to: 10}}
  - {op: Mul, inputs: [s, y], outputs: [out]}
",
    );
    let (o, r) = run_passes(&g, &PassOptions::default());
    assert_eq!(r.fired("rms_norm"), 1);
    assert_eq!(o.nodes.len(), 1, "{:?}", o.nodes);
    assert_eq!(o.nodes[0].inputs, ["x", "s"]);
    let feeds = Model { graph: g.clone() }
        .random_inputs(3, &BTreeMap::new())
        .unwrap();
    let run = |g: &Graph| {
        Session::new(g.clone(), SessionOptions::unfused())
            .unwrap()
            .run(&feeds)
            .unwrap()
    };
    let (a, b) = (run(&g), run(&o));
    assert_eq!(a[0].1.dtype(), graphrun::DType::F16);
    let e = common::rel_err(&a[0].1.to_f64_vec(), &b[0].1.to_f64_vec());
    assert!(e < 2e-3, "rel err {e:.2e}");
}

/// `rotary`: `q·cos + rotate_half(q)·sin` as exporters write it (two Slices of the
/// halves on the last axis, with bounds constant or computed from q's last dim as
/// `D / 2`, a Neg, a Concat, two Muls and an Add) becomes one Rotary reading q, cos and
/// sin; outputs and gradients (of q, cos and sin) as unfused. Not where the halves are
/// swapped, the Neg is on the other half, the Slices are on another axis or a part is
/// read elsewhere.
#[test]
fn rotate_half_chains_fuse() {
    let body = |half: &str, nodes: &str, outputs: &str| {
        format!(
            "
inputs:
  - {{name: q, dtype: f32, shape: [batch, 4, 5, 8]}}
outputs: [{outputs}]
initializers:
  - {{name: cos, dtype: f32, shape: [1, 1, 5, 8], init: {{dist: normal, std: 1.0, seed: 1}}}}
  - {{name: sin, dtype: f32, shape: [1, 1, 5, 8], init: {{dist: normal, std: 1.0, seed: 2}}}}
  - {{name: zero, dtype: i64, shape: [1], values: [0], trainable: false}}
  - {{name: big, dtype: i64, shape: [1], values: [9223372036854775807], trainable: false}}
  - {{name: last, dtype: i64, shape: [1], values: [-1], trainable: false}}
  - {{name: third, dtype: i64, shape: [1], values: [2], trainable: false}}
  - {{name: two, dtype: i64, shape: [], values: [2], trainable: false}}
  - {{name: three, dtype: i64, shape: [], values: [3], trainable: false}}
  - {{name: four, dtype: i64, shape: [1], values: [4], trainable: false}}
nodes:
{half}  - {{op: Slice, inputs: [q, zero, h, last], outputs: [x1]}}
  - {{op: Slice, inputs: [q, h, big, last], outputs: [x2]}}
{nodes}"
        )
    };
    let constant = "  - {op: Identity, inputs: [four], outputs: [h]}\n";
    let computed = "  - {op: Shape, inputs: [q], outputs: [qs]}
  - {op: Gather, inputs: [qs, three], outputs: [d], attrs: {axis: 0}}
  - {op: Div, inputs: [d, two], outputs: [hd]}
  - {op: Unsqueeze, inputs: [hd, zero], outputs: [h]}
";
    let tail = |neg: &str, cat: &str| {
        format!(
            "  - {{op: Neg, inputs: [{neg}], outputs: [n]}}
  - {{op: Concat, inputs: [{cat}], outputs: [r], attrs: {{axis: -1}}}}
  - {{op: Mul, inputs: [q, cos], outputs: [qc]}}
  - {{op: Mul, inputs: [sin, r], outputs: [rs]}}
  - {{op: Add, inputs: [rs, qc], outputs: [y]}}
"
        )
    };
    let ok = tail("x2", "n, x1");
    for (what, half, nodes, outputs) in [
        ("constant halves", constant, ok.clone(), "y"),
        ("halves computed from Shape", computed, ok.clone(), "y"),
    ] {
        let g = graph(&body(half, &nodes, outputs));
        let (o, r) = run_passes(&g, &PassOptions::default());
        assert_eq!(r.fired("rotary"), 1, "{what}");
        assert_eq!(count(&o, "Rotary"), 1, "{what}");
        for op in ["Slice", "Neg", "Concat", "Mul", "Add"] {
            assert_eq!(count(&o, op), 0, "{what}: {op} left");
        }
        check_same(&g, &o, &[("batch", 3)]);
    }
    let stays = [
        ("the halves swapped", constant, tail("x1", "n, x2"), "y"),
        (
            "the Neg on the second half",
            constant,
            tail("x2", "x1, n"),
            "y",
        ),
        ("the negated half an output", constant, ok.clone(), "y, n"),
        ("the first half an output", constant, ok.clone(), "y, x1"),
        ("Slices of the third axis", constant, ok.clone(), "y"),
    ];
    for (what, half, nodes, outputs) in stays {
        let mut text = body(half, &nodes, outputs);
        if what.starts_with("Slices of the third") {
            text = text
                .replace("[q, zero, h, last]", "[q, zero, h, third]")
                .replace("[q, h, big, last]", "[q, h, big, third]")
                .replace("shape: [batch, 4, 5, 8]", "shape: [batch, 4, 8, 8]")
                .replace("shape: [1, 1, 5, 8]", "shape: [1, 1, 8, 8]")
                .replace("attrs: {axis: -1}", "attrs: {axis: 2}");
        }
        let g = graph(&text);
        let (o, r) = run_passes(&g, &PassOptions::default());
        assert_eq!(r.fired("rotary"), 0, "{what}");
        assert_eq!(count(&o, "Rotary"), 0, "{what}");
        assert_same(&g, &o, &[("batch", 3)]);
    }
}

/// `rotary_heads`: a rotation of heads split as exporters write them (`[B, S, H·D]` →
/// Reshape `[B, S, H, D]` → Transpose `[0, 2, 1, 3]` → rotate) runs in the `[B, S, H, D]`
/// layout with the head transpose after it, for tables of rank 2, 3 and 4; outputs and
/// gradients (of x, cos and sin) as unfused. Not where the transposed x is read
/// elsewhere. With attention after it, the attention reads the rotated heads unsplit (a
/// 3-D Attention, no Transpose left).
#[test]
fn rotation_moves_before_the_head_transpose() {
    let body = |table: &str, outputs: &str, tail: &str| {
        format!(
            "
inputs:
  - {{name: x, dtype: f32, shape: [batch, 5, 16]}}
outputs: [{outputs}]
initializers:
  - {{name: cos, dtype: f32, shape: {table}, init: {{dist: normal, std: 1.0, seed: 1}}}}
  - {{name: sin, dtype: f32, shape: {table}, init: {{dist: normal, std: 1.0, seed: 2}}}}
  - {{name: split, dtype: i64, shape: [4], values: [0, 0, 2, 8], trainable: false}}
  - {{name: merge, dtype: i64, shape: [3], values: [0, 0, 16], trainable: false}}
  - {{name: zero, dtype: i64, shape: [1], values: [0], trainable: false}}
  - {{name: four, dtype: i64, shape: [1], values: [4], trainable: false}}
  - {{name: big, dtype: i64, shape: [1], values: [9223372036854775807], trainable: false}}
  - {{name: last, dtype: i64, shape: [1], values: [-1], trainable: false}}
  - {{name: scale, dtype: f32, shape: [], values: [0.35], trainable: false}}
nodes:
  - {{op: Reshape, inputs: [x, split], outputs: [xs]}}
  - {{op: Transpose, inputs: [xs], outputs: [q], attrs: {{perm: [0, 2, 1, 3]}}}}
  - {{op: Slice, inputs: [q, zero, four, last], outputs: [x1]}}
  - {{op: Slice, inputs: [q, four, big, last], outputs: [x2]}}
  - {{op: Neg, inputs: [x2], outputs: [n]}}
  - {{op: Concat, inputs: [n, x1], outputs: [r], attrs: {{axis: -1}}}}
  - {{op: Mul, inputs: [q, cos], outputs: [qc]}}
  - {{op: Mul, inputs: [r, sin], outputs: [rs]}}
  - {{op: Add, inputs: [qc, rs], outputs: [y]}}
{tail}"
        )
    };
    for table in ["[5, 8]", "[1, 5, 8]", "[1, 1, 5, 8]"] {
        let g = graph(&body(table, "y", ""));
        let (o, r) = run_passes(&g, &PassOptions::default());
        assert_eq!(
            (r.fired("rotary"), r.fired("rotary_heads")),
            (1, 1),
            "{table}"
        );
        let rot = o.nodes.iter().find(|n| n.op.name() == "Rotary").unwrap();
        assert_eq!(
            rot.inputs[0], "xs",
            "{table}: the rotation reads the split heads"
        );
        check_same(&g, &o, &[("batch", 3)]);
    }
    // The transposed heads read elsewhere: the rotation stays on them.
    let g = graph(&body("[5, 8]", "y, q", ""));
    let (o, r) = run_passes(&g, &PassOptions::default());
    assert_eq!((r.fired("rotary"), r.fired("rotary_heads")), (1, 0));
    assert_same(&g, &o, &[("batch", 3)]);
    // Self-attention of the rotated heads, merged back: one 3-D Attention, no copies.
    let attn = "  - {op: Reshape, inputs: [x, split], outputs: [ks]}
  - {op: Transpose, inputs: [ks], outputs: [k], attrs: {perm: [0, 2, 1, 3]}}
  - {op: Transpose, inputs: [k], outputs: [kt], attrs: {perm: [0, 1, 3, 2]}}
  - {op: MatMul, inputs: [y, kt], outputs: [s0]}
  - {op: Mul, inputs: [s0, scale], outputs: [s]}
  - {op: Softmax, inputs: [s], outputs: [p], attrs: {axis: -1}}
  - {op: Reshape, inputs: [x, split], outputs: [vs]}
  - {op: Transpose, inputs: [vs], outputs: [v], attrs: {perm: [0, 2, 1, 3]}}
  - {op: MatMul, inputs: [p, v], outputs: [c]}
  - {op: Transpose, inputs: [c], outputs: [ct], attrs: {perm: [0, 2, 1, 3]}}
  - {op: Reshape, inputs: [ct, merge], outputs: [out]}
";
    let g = graph(&body("[5, 8]", "out", attn));
    let (o, r) = run_passes(&g, &PassOptions::default());
    assert_eq!(r.fired("rotary_heads"), 1);
    assert_eq!(r.fired("attention_heads"), 1, "{}", r.explain.join("\n"));
    assert_eq!(count(&o, "Transpose"), 0, "{:?}", o.nodes);
    check_same(&g, &o, &[("batch", 3)]);
    // K's split `[B, S, H, D]` also read by a Shape (as the dynamo exporter's Kᵀ reshape
    // reads the repeated K's shape): the 3-D form still fuses, the split staying for the
    // Shape alone (known when the plan is made, so the split is not computed).
    let shaped = format!("{attn}  - {{op: Shape, inputs: [ks], outputs: [ks_shape]}}\n");
    let g = graph(&body("[5, 8]", "out, ks_shape", &shaped));
    let (o, r) = run_passes(&g, &PassOptions::default());
    assert_eq!(r.fired("attention_heads"), 1, "{}", r.explain.join("\n"));
    assert_same(&g, &o, &[("batch", 3)]);
}

/// `gated_matmul`: `act(x·Wg [+ bg]) * (x·Wu [+ bu])`, the gated MLP of LLaMA-style
/// models (SiLU written as g·Sigmoid(g), GELU, either operand order, with biases),
/// becomes one GatedMatMul; outputs and every gradient as unfused. Not where the up
/// projection is read elsewhere, the two products read different A, or neither has an
/// activation.
#[test]
fn gated_mlps_fuse() {
    let body = |up_a: &str, nodes: &str, outputs: &str| {
        format!(
            "
inputs:
  - {{name: x, dtype: f32, shape: [batch, 5, 8]}}
  - {{name: x2, dtype: f32, shape: [batch, 5, 8]}}
outputs: [{outputs}]
initializers:
  - {{name: wg, dtype: f32, shape: [8, 6], init: {{dist: normal, std: 0.5, seed: 1}}}}
  - {{name: wu, dtype: f32, shape: [8, 6], init: {{dist: normal, std: 0.5, seed: 2}}}}
  - {{name: wd, dtype: f32, shape: [6, 8], init: {{dist: normal, std: 0.5, seed: 3}}}}
  - {{name: bg, dtype: f32, shape: [6], init: {{dist: normal, std: 0.5, seed: 4}}}}
  - {{name: bu, dtype: f32, shape: [6], init: {{dist: normal, std: 0.5, seed: 5}}}}
nodes:
  - {{op: MatMul, inputs: [x, wg], outputs: [g0]}}
  - {{op: MatMul, inputs: [{up_a}, wu], outputs: [u0]}}
{nodes}  - {{op: MatMul, inputs: [h, wd], outputs: [y]}}
"
        )
    };
    let silu = "  - {op: Sigmoid, inputs: [g0], outputs: [gs]}
  - {op: Mul, inputs: [g0, gs], outputs: [ga]}
  - {op: Mul, inputs: [ga, u0], outputs: [h]}
";
    let gelu_biased = "  - {op: Add, inputs: [g0, bg], outputs: [gb]}
  - {op: Gelu, inputs: [gb], outputs: [ga]}
  - {op: Add, inputs: [bu, u0], outputs: [ub]}
  - {op: Mul, inputs: [ub, ga], outputs: [h]}
";
    for (what, nodes) in [("SiLU", silu), ("GELU with biases", gelu_biased)] {
        let g = graph(&body("x", nodes, "y"));
        let (o, r) = run_passes(&g, &PassOptions::default());
        assert_eq!(r.fired("gated_matmul"), 1, "{what}");
        assert_eq!(count(&o, "GatedMatMul"), 1, "{what}: {:?}", o.nodes);
        // What is left: the down projection alone.
        assert_eq!(o.nodes.len(), 2, "{what}: {:?}", o.nodes);
        check_same(&g, &o, &[("batch", 2)]);
    }
    let ungated = "  - {op: Mul, inputs: [g0, u0], outputs: [h]}\n";
    for (what, up_a, nodes, outputs) in [
        ("the up projection read elsewhere", "x", silu, "y, u0"),
        ("products of different A", "x2", silu, "y"),
        ("no activation", "x", ungated, "y"),
    ] {
        let g = graph(&body(up_a, nodes, outputs));
        let (o, r) = run_passes(&g, &PassOptions::default());
        assert_eq!(r.fired("gated_matmul"), 0, "{what}");
        assert_eq!(count(&o, "GatedMatMul"), 0, "{what}");
        assert_same(&g, &o, &[("batch", 2)]);
    }
}

/// `unpack_gate_up`: Phi-3's packed `gate_up_proj`, one product cut into a gate and an up
/// half, becomes a GatedMatMul like two separate projections: cut by a Split (trained
/// weight, through Slices), by two Slices whose bounds come from the product's shape as
/// the TorchScript exporter writes them (constant weight, cut once), and as a Gemm with
/// `transB` and a bias. Not where the halves do not gate each other, the product is read
/// elsewhere, or the cut is uneven.
#[test]
fn packed_gate_up_unpacks() {
    let body = |trainable: bool, nodes: &str, outputs: &str| {
        format!(
            "
inputs:
  - {{name: x, dtype: f32, shape: [batch, 5, 8]}}
outputs: [{outputs}]
initializers:
  - {{name: w, dtype: f32, shape: [8, 12], init: {{dist: normal, std: 0.5, seed: 1}}, trainable: {trainable}}}
  - {{name: wt, dtype: f32, shape: [12, 8], init: {{dist: normal, std: 0.5, seed: 2}}, trainable: {trainable}}}
  - {{name: b, dtype: f32, shape: [12], init: {{dist: normal, std: 0.5, seed: 3}}, trainable: {trainable}}}
  - {{name: wd, dtype: f32, shape: [6, 8], init: {{dist: normal, std: 0.5, seed: 4}}}}
  - {{name: two, dtype: i64, shape: [1], values: [2]}}
  - {{name: last, dtype: i64, shape: [1], values: [-1]}}
  - {{name: zero, dtype: i64, shape: [1], values: [0]}}
  - {{name: big, dtype: i64, shape: [1], values: [9223372036854775807]}}
  - {{name: flat, dtype: i64, shape: [2], values: [-1, 8]}}
  - {{name: thirds, dtype: i64, shape: [3], values: [6, 3, 3]}}
nodes:
{nodes}  - {{op: MatMul, inputs: [h, wd], outputs: [y]}}
"
        )
    };
    let silu = |g: &str, u: &str| {
        format!(
            "  - {{op: Sigmoid, inputs: [{g}], outputs: [gs]}}
  - {{op: Mul, inputs: [{g}, gs], outputs: [ga]}}
  - {{op: Mul, inputs: [{u}, ga], outputs: [h]}}
"
        )
    };
    let split = format!(
        "  - {{op: MatMul, inputs: [x, w], outputs: [gu]}}
  - {{op: Split, inputs: [gu], outputs: [g, u], attrs: {{axis: -1, num_outputs: 2}}}}
{}",
        silu("g", "u")
    );
    // TorchScript's `gate_up.chunk(2, -1)`: the half computed from the product's shape.
    let slices = format!(
        "  - {{op: MatMul, inputs: [x, w], outputs: [gu]}}
  - {{op: Shape, inputs: [gu], outputs: [shp]}}
  - {{op: Gather, inputs: [shp, last], outputs: [d], attrs: {{axis: 0}}}}
  - {{op: Div, inputs: [d, two], outputs: [half]}}
  - {{op: Slice, inputs: [gu, zero, half, last], outputs: [g]}}
  - {{op: Slice, inputs: [gu, half, big, last], outputs: [u]}}
{}",
        silu("g", "u")
    );
    let gemm = format!(
        "  - {{op: Reshape, inputs: [x, flat], outputs: [x2]}}
  - {{op: Gemm, inputs: [x2, wt, b], outputs: [gu], attrs: {{transB: 1}}}}
  - {{op: Split, inputs: [gu], outputs: [u, g], attrs: {{axis: 1, num_outputs: 2}}}}
{}",
        silu("g", "u")
    );
    for (what, trainable, nodes, slices_left) in [
        ("Split, trained weight", true, &split, 1),
        ("Slices from the shape, constant weight", false, &slices, 0),
        ("Gemm with transB and a bias, trained", true, &gemm, 2),
    ] {
        let g = graph(&body(trainable, nodes, "y"));
        let (o, r) = run_passes(&g, &PassOptions::default());
        assert_eq!(r.fired("unpack_gate_up"), 1, "{what}");
        assert_eq!(count(&o, "GatedMatMul"), 1, "{what}: {:?}", o.nodes);
        for op in ["Split", "Shape", "Sigmoid", "Mul"] {
            assert_eq!(count(&o, op), 0, "{what}: {op} left: {:?}", o.nodes);
        }
        // A trained weight is cut by Slices (its gradient flows back through them).
        assert_eq!(count(&o, "Slice"), slices_left * 2, "{what}: {:?}", o.nodes);
        check_same(&g, &o, &[("batch", 2)]);
    }
    let stays = [
        (
            "halves that do not gate each other",
            "  - {op: MatMul, inputs: [x, w], outputs: [gu]}
  - {op: Split, inputs: [gu], outputs: [g, u], attrs: {axis: -1, num_outputs: 2}}
  - {op: Sigmoid, inputs: [g], outputs: [gs]}
  - {op: Add, inputs: [u, gs], outputs: [h]}
"
            .to_string(),
            "y",
        ),
        ("the packed product read elsewhere", split.clone(), "y, gu"),
        (
            "a cut into three",
            format!(
                "  - {{op: MatMul, inputs: [x, w], outputs: [gu]}}
  - {{op: Split, inputs: [gu, thirds], outputs: [g, u1, u2], attrs: {{axis: -1}}}}
  - {{op: Concat, inputs: [u2, u1], outputs: [u], attrs: {{axis: -1}}}}
{}",
                silu("g", "u")
            ),
            "y",
        ),
    ];
    for (what, nodes, outputs) in stays {
        let g = graph(&body(true, &nodes, outputs));
        let (o, r) = run_passes(&g, &PassOptions::default());
        assert_eq!(r.fired("unpack_gate_up"), 0, "{what}");
        assert_eq!(count(&o, "GatedMatMul"), 0, "{what}");
        assert_same(&g, &o, &[("batch", 2)]);
    }
}

/// `conv_affine`: a per-channel affine map after a Conv with constant weights folds into
/// the weights and bias — BatchNormalization's inference form, Mul/Add and Sub/Div by
/// per-channel or scalar constants, `c - y` — with the outputs unchanged (`fuse` checks);
/// it stays out where the convolution's output is read elsewhere, a constant varies along
/// a spatial axis, the map is `c / y`, or the weights are an input or trainable — until
/// `passes::freeze` makes them constants for a forward-only run.
#[test]
fn conv_affine_folds_per_channel_maps() {
    let body = |inputs: &str, nodes: &str, outputs: &str| {
        format!(
            "
inputs:
  - {{name: x, dtype: f32, shape: [2, 3, 8, 8]}}
{inputs}outputs: [{outputs}]
initializers:
  - {{name: w, dtype: f32, shape: [4, 3, 3, 3], init: {{dist: uniform, low: -1, high: 1, seed: 1}}, trainable: false}}
  - {{name: b, dtype: f32, shape: [4], init: {{dist: uniform, low: -1, high: 1, seed: 2}}, trainable: false}}
  - {{name: g, dtype: f32, shape: [4], init: {{dist: uniform, low: 0.5, high: 1.5, seed: 3}}, trainable: false}}
  - {{name: beta, dtype: f32, shape: [4], init: {{dist: uniform, low: -1, high: 1, seed: 4}}, trainable: false}}
  - {{name: mean, dtype: f32, shape: [4], init: {{dist: uniform, low: -1, high: 1, seed: 5}}, trainable: false}}
  - {{name: var, dtype: f32, shape: [4], init: {{dist: uniform, low: 0.5, high: 1.5, seed: 6}}, trainable: false}}
  - {{name: c411, dtype: f32, shape: [4, 1, 1], init: {{dist: uniform, low: 0.5, high: 1.5, seed: 7}}, trainable: false}}
  - {{name: c88, dtype: f32, shape: [8, 8], init: {{dist: uniform, low: 0.5, high: 1.5, seed: 8}}, trainable: false}}
  - {{name: half, dtype: f32, shape: [], values: [0.5], trainable: false}}
nodes:
  - {{op: Conv, inputs: [x, w, b], outputs: [y], attrs: {{pads: [1, 1, 1, 1]}}}}
{nodes}"
        )
    };
    let bn = "  - {op: BatchNormalization, inputs: [y, g, beta, mean, var], outputs: [out], attrs: {epsilon: 0.001}}\n";
    let fires = [
        ("BatchNormalization", bn.to_string()),
        (
            "Mul then Add by [4, 1, 1]",
            "  - {op: Mul, inputs: [y, c411], outputs: [s]}
  - {op: Add, inputs: [c411, s], outputs: [out]}
"
            .to_string(),
        ),
        (
            "Sub then Div by a scalar",
            "  - {op: Sub, inputs: [y, half], outputs: [s]}
  - {op: Div, inputs: [s, half], outputs: [out]}
"
            .to_string(),
        ),
        (
            "c - y",
            "  - {op: Sub, inputs: [c411, y], outputs: [out]}\n".to_string(),
        ),
    ];
    for (what, nodes) in &fires {
        let (g, r) = fuse(&body("", nodes, "out"));
        assert_eq!(r.fired("conv_affine"), 1, "{what}");
        assert_eq!(count(&g, "Conv"), 1, "{what}");
        for op in ["Add", "Sub", "Mul", "Div", "Sqrt"] {
            assert_eq!(count(&g, op), 0, "{what}: {op} left");
        }
    }
    let w_input = "  - {name: wi, dtype: f32, shape: [4, 3, 3, 3]}\n";
    let stays = [
        (
            "the convolution's output read elsewhere",
            "",
            bn.to_string(),
            "out, y",
        ),
        (
            "a constant varying along a spatial axis",
            "",
            "  - {op: Mul, inputs: [y, c88], outputs: [out]}\n".to_string(),
            "out",
        ),
        (
            "c / y",
            "",
            "  - {op: Div, inputs: [c411, y], outputs: [out]}\n".to_string(),
            "out",
        ),
        (
            "the weights an input",
            w_input,
            "  - {op: Mul, inputs: [y, c411], outputs: [out]}\n".to_string(),
            "out",
        ),
    ];
    for (what, inputs, nodes, outputs) in stays {
        let text = body(inputs, &nodes, outputs);
        let text = if inputs.is_empty() {
            text
        } else {
            text.replace("inputs: [x, w, b]", "inputs: [x, wi, b]")
        };
        let (_, r) = fuse(&text);
        assert_eq!(r.fired("conv_affine"), 0, "{what}");
    }
    // Trainable weights stay apart (their gradients are asked for) until frozen.
    let trained = body("", bn, "out").replace("seed: 1}, trainable: false}", "seed: 1}}");
    let (_, r) = fuse(&trained);
    assert_eq!(r.fired("conv_affine"), 0, "trainable weights");
    assert!(
        r.explain
            .iter()
            .any(|l| l.starts_with("Conv '") && l.contains("trainable")),
        "{:?}",
        r.explain
    );
    let g = graph(&trained);
    let (frozen, r) = graphrun::passes::freeze(&g, &PassOptions::default()).unwrap();
    assert_eq!(r.fired("conv_affine"), 1, "trainable weights, frozen");
    assert_eq!(count(&frozen, "Conv"), 1);
    assert_same(&g, &frozen, &[]);
}

/// `conv_epilogue`: `Conv → Add(Z) → activation` (each of the two optional) becomes one
/// FusedConv, its outputs and gradients (with respect to X, W, B and Z) those of the
/// unfused graph on every backend; it stays out where Z is a per-channel constant (a
/// broadcast, no residual), where a swallowed value is read elsewhere or is a graph
/// output, and where nothing it takes follows the convolution.
#[test]
fn conv_epilogue_fuses_residual_and_activation() {
    let body = |nodes: &str, outputs: &str| {
        // Z is an input only where the nodes read it (every input's gradient is checked).
        let z = match nodes.contains(" z]") || nodes.contains("[z,") {
            true => "  - {name: z, dtype: f32, shape: [2, 4, 3, 6]}\n",
            false => "",
        };
        format!(
            "
inputs:
  - {{name: x, dtype: f32, shape: [2, 3, 7, 6]}}
{z}outputs: [loss{outputs}]
initializers:
  - {{name: w, dtype: f32, shape: [4, 3, 3, 3], init: {{dist: uniform, low: -0.5, high: 0.5, seed: 1}}}}
  - {{name: b, dtype: f32, shape: [4], init: {{dist: uniform, low: -0.5, high: 0.5, seed: 2}}}}
  - {{name: c411, dtype: f32, shape: [4, 1, 1], init: {{dist: uniform, low: -0.5, high: 0.5, seed: 3}}, trainable: false}}
  - {{name: zero, dtype: f32, shape: [], values: [0], trainable: false}}
  - {{name: six, dtype: f32, shape: [], values: [6], trainable: false}}
  - {{name: five, dtype: f32, shape: [], values: [5], trainable: false}}
nodes:
  - {{op: Conv, inputs: [x, w, b], outputs: [y], attrs: {{pads: [1, 1, 0, 1], strides: [2, 1]}}}}
{nodes}  - {{op: Mul, inputs: [out, out], outputs: [sq]}}
  - {{op: ReduceMean, inputs: [sq], outputs: [loss], attrs: {{keepdims: 0}}}}
"
        )
    };
    let fires = [
        (
            "Relu",
            "  - {op: Relu, inputs: [y], outputs: [out]}\n",
            "relu",
            3,
        ),
        (
            "a residual, then Relu",
            "  - {op: Add, inputs: [z, y], outputs: [s]}\n  - {op: Relu, inputs: [s], outputs: [out]}\n",
            "relu",
            4,
        ),
        (
            "a residual alone",
            "  - {op: Add, inputs: [y, z], outputs: [out]}\n",
            "none",
            4,
        ),
        (
            "a residual, then SiLU as x·Sigmoid(x)",
            "  - {op: Add, inputs: [y, z], outputs: [s]}\n  - {op: Sigmoid, inputs: [s], outputs: [sg]}\n  - {op: Mul, inputs: [s, sg], outputs: [out]}\n",
            "silu",
            4,
        ),
        (
            "Tanh",
            "  - {op: Tanh, inputs: [y], outputs: [out]}\n",
            "tanh",
            3,
        ),
        (
            "a residual, then ReLU6 as Clip(0, 6)",
            "  - {op: Add, inputs: [y, z], outputs: [s]}\n  - {op: Clip, inputs: [s, zero, six], outputs: [out]}\n",
            "relu6",
            4,
        ),
    ];
    for (what, nodes, act, inputs) in fires {
        let (g, r) = fuse(&body(nodes, ""));
        assert_eq!(r.fired("conv_epilogue"), 1, "{what}");
        let f: Vec<_> = g
            .nodes
            .iter()
            .filter_map(|n| match n.op {
                Op::FusedConv { activation, .. } => Some((activation.name(), n.inputs.len())),
                _ => None,
            })
            .collect();
        assert_eq!(f, [(act, inputs)], "{what}");
        assert_eq!(
            count(&g, "Conv") + count(&g, "Relu") + count(&g, "Sigmoid"),
            0,
            "{what}"
        );
        // The same outputs and gradients on every backend.
        let plain = graph(&body(nodes, ""));
        let feeds = Model {
            graph: plain.clone(),
        }
        .random_inputs(5, &BTreeMap::new())
        .unwrap();
        for be in common::backends() {
            let session = |disabled: Vec<String>| {
                let opts = SessionOptions {
                    backend: be,
                    passes: PassOptions {
                        disabled,
                        ..Default::default()
                    },
                    ..Default::default()
                };
                Session::new(plain.clone(), opts).unwrap()
            };
            let (mut fused, mut unfused) = (session(vec![]), session(vec!["conv_fusion".into()]));
            let (a, b) = (fused.run(&feeds).unwrap(), unfused.run(&feeds).unwrap());
            let e = common::rel_err(&a[0].1.to_f64_vec(), &b[0].1.to_f64_vec());
            assert!(e <= 1e-5, "{what} {be:?}: loss rel err {e:.2e}");
            same_gradients(&format!("{what} {be:?}"), &mut fused, &mut unfused, &feeds);
        }
    }
    let stays = [
        (
            "Clip to other bounds",
            "  - {op: Clip, inputs: [y, zero, five], outputs: [out]}\n",
            "",
        ),
        (
            "a per-channel constant added",
            "  - {op: Add, inputs: [y, c411], outputs: [out]}\n",
            "",
        ),
        (
            "the convolution's output a graph output",
            "  - {op: Relu, inputs: [y], outputs: [out]}\n",
            ", y",
        ),
        (
            "the convolution's output read twice",
            "  - {op: Relu, inputs: [y], outputs: [r]}\n  - {op: Add, inputs: [r, y], outputs: [out]}\n",
            "",
        ),
        (
            "a Neg after it",
            "  - {op: Neg, inputs: [y], outputs: [out]}\n",
            "",
        ),
    ];
    for (what, nodes, outputs) in stays {
        let (g, r) = fuse(&body(nodes, outputs));
        assert_eq!(r.fired("conv_epilogue"), 0, "{what}");
        assert_eq!(count(&g, "FusedConv"), 0, "{what}");
    }
    // The sum taken, the activation left where the sum is read elsewhere: the fused node
    // says where it stopped.
    let (g, r) = fuse(&body(
        "  - {op: Add, inputs: [y, z], outputs: [s]}\n  - {op: Relu, inputs: [s], outputs: [out]}\n",
        ", s",
    ));
    assert_eq!(count(&g, "FusedConv"), 1);
    assert_eq!(count(&g, "Relu"), 1);
    assert!(
        r.explain
            .iter()
            .any(|l| l.starts_with("FusedConv '") && l.contains("graph output")),
        "{:?}",
        r.explain
    );
}
