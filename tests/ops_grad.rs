//! Gradient ops against central finite differences (in f64) of their forward ops, each
//! also run in f32/f16/bf16 and compared with f64 within SPEC §8 tolerance.

mod common;
use common::*;
use graphrun::graph::op::AttrValue;
use graphrun::graph::Activation;
use graphrun::rng::Rng;
use graphrun::{DType, Tensor};

/// Relative error allowed between an analytic gradient and finite differences.
const FD_TOL: f64 = 1e-6;

/// Values with magnitudes in [lo, hi) and random signs: away from kinks at 0.
fn signed(shape: &[usize], seed: u64, lo: f64, hi: f64) -> Tensor {
    let mut r = Rng::new(seed);
    let v: Vec<f64> = (0..shape.iter().product())
        .map(|_| {
            let m = r.uniform_in(lo, hi);
            if r.uniform() < 0.5 {
                -m
            } else {
                m
            }
        })
        .collect();
    f64s(shape, &v)
}

fn i32s(shape: &[usize], v: &[i32]) -> Tensor {
    Tensor::from_vec(shape, v.to_vec()).unwrap()
}

fn shape_of(t: &Tensor) -> Tensor {
    let s: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
    i64s(&[s.len()], &s)
}

fn some(ts: &[&Tensor]) -> Vec<Option<Tensor>> {
    ts.iter().map(|&t| Some(t.clone())).collect()
}

fn run1(node: &graphrun::Node, ins: &[Option<Tensor>]) -> Vec<Tensor> {
    eval(node, ins).unwrap_or_else(|e| panic!("{e}"))
}

/// An op's attributes.
type Attrs<'a> = &'a [(&'a str, AttrValue)];

// ---- UnaryGrad -----------------------------------------------------------------------------

#[test]
fn unary_grads_match_finite_differences() {
    let s = [3, 5];
    let general = rand(&s, 1, -2.0, 2.0);
    let kinked = signed(&s, 2, 0.1, 2.0);
    let positive = rand(&s, 3, 0.5, 3.0);
    let tanh = [("approximate", AttrValue::Str("tanh".into()))];
    let alpha = [("alpha", AttrValue::Float(0.2))];
    let cases: Vec<(&str, Attrs, &Tensor)> = vec![
        ("Neg", &[], &general),
        ("Exp", &[], &general),
        ("Log", &[], &positive),
        ("Sqrt", &[], &positive),
        ("Reciprocal", &[], &kinked),
        ("Abs", &[], &kinked),
        ("Erf", &[], &general),
        ("Relu", &[], &kinked),
        ("Sigmoid", &[], &general),
        ("Tanh", &[], &general),
        ("Gelu", &[], &general),
        ("Gelu", &tanh, &general),
        ("LeakyRelu", &alpha, &kinked),
    ];
    let dy = randn(&s, 4);
    for (name, attrs, x) in cases {
        let fwd = node_of(op(name, attrs), &some(&[x]), &["y"]);
        let ins = some(&[&dy, x]);
        let grad = node_of(op(&format!("{name}Grad"), attrs), &ins, &["dx"]);
        let got = eval_all_dtypes(&grad, &ins, &[]);
        let fd = fd_grad(&fwd, &some(&[x]), 0, 0, &dy);
        assert_grad(
            &format!("{name}Grad {attrs:?}"),
            &got[0].to_f64_vec(),
            &fd,
            FD_TOL,
        );
    }
}

// ---- SoftmaxGrad -----------------------------------------------------------------------------

#[test]
fn softmax_grads_on_every_axis() {
    let x = rand(&[2, 4, 3], 5, -2.0, 2.0);
    let dy = randn(x.shape(), 6);
    for name in ["Softmax", "LogSoftmax"] {
        for axis in [1, -1, 0] {
            let attrs = [("axis", AttrValue::Int(axis))];
            let fwd = node_of(op(name, &attrs), &some(&[&x]), &["y"]);
            let y = run1(&fwd, &some(&[&x])).remove(0);
            let ins = some(&[&dy, &y]);
            let grad = node_of(op(&format!("{name}Grad"), &attrs), &ins, &["dx"]);
            let got = eval_all_dtypes(&grad, &ins, &[]);
            let fd = fd_grad(&fwd, &some(&[&x]), 0, 0, &dy);
            assert_grad(
                &format!("{name}Grad axis {axis}"),
                &got[0].to_f64_vec(),
                &fd,
                FD_TOL,
            );
        }
    }
}

// ---- LayerNormalization ------------------------------------------------------------------

/// Forward LayerNorm with its statistics: (Y, Mean, InvStdDev).
fn layer_norm(x: &Tensor, scale: &Tensor, bias: Option<&Tensor>, axis: i64) -> Vec<Tensor> {
    let ins = vec![Some(x.clone()), Some(scale.clone()), bias.cloned()];
    let attrs = [
        ("axis", AttrValue::Int(axis)),
        ("epsilon", AttrValue::Float(1e-5)),
    ];
    run1(
        &node_of(
            op("LayerNormalization", &attrs),
            &ins,
            &["y", "mean", "inv"],
        ),
        &ins,
    )
}

#[test]
fn layer_norm_forward_writes_mean_and_inv_std_dev() {
    let x = rand(&[2, 3, 4], 7, -2.0, 2.0);
    let scale = rand(&[4], 8, 0.5, 1.5);
    for axis in [-1i64, 1] {
        let outs = layer_norm(&x, &scale, None, axis);
        let n = if axis == 1 { 12 } else { 4 };
        let stat_shape: &[usize] = if axis == 1 { &[2, 1, 1] } else { &[2, 3, 1] };
        let (mut mean, mut inv) = (vec![], vec![]);
        for row in x.to_f64_vec().chunks(n) {
            let m = row.iter().sum::<f64>() / n as f64;
            let var = row.iter().map(|v| (v - m).powi(2)).sum::<f64>() / n as f64;
            mean.push(m);
            inv.push(1.0 / (var + 1e-5).sqrt());
        }
        for (t, want) in [(&outs[1], mean), (&outs[2], inv)] {
            assert_eq!(t.shape(), stat_shape);
            assert!(rel_err(&t.to_f64_vec(), &want) < 1e-12, "axis {axis}");
        }
        // In f32 the statistics are f32, and as accurate.
        let outs = layer_norm(&x.cast(DType::F32), &scale.cast(DType::F32), None, axis);
        assert_eq!(outs[1].dtype(), DType::F32);
        let want = layer_norm(&x.cast(DType::F32).cast(DType::F64), &scale, None, axis);
        for k in 1..3 {
            assert!(rel_err(&outs[k].to_f64_vec(), &want[k].to_f64_vec()) < 1e-6);
        }
    }
}

#[test]
fn layer_norm_grads_last_and_middle_axis() {
    let x = rand(&[2, 3, 4], 9, -2.0, 2.0);
    let dy = randn(x.shape(), 10);
    // (axis, Scale, B): Scale and B smaller than the normalized shape, or absent.
    let cases = [
        (
            -1i64,
            rand(&[4], 11, 0.5, 1.5),
            Some(rand(&[4], 12, -1.0, 1.0)),
        ),
        (-1, rand(&[1], 13, 0.5, 1.5), None),
        (
            1,
            rand(&[4], 14, 0.5, 1.5),
            Some(rand(&[1, 4], 15, -1.0, 1.0)),
        ),
        (1, rand(&[3, 1], 16, 0.5, 1.5), None),
        (
            1,
            rand(&[3, 4], 17, 0.5, 1.5),
            Some(rand(&[3, 4], 18, -1.0, 1.0)),
        ),
    ];
    for (axis, scale, bias) in &cases {
        let what = format!(
            "axis {axis}, Scale {:?}, B {:?}",
            scale.shape(),
            bias.as_ref().map(|b| b.shape().to_vec())
        );
        let stats = layer_norm(&x, scale, bias.as_ref(), *axis);
        let ins = some(&[&dy, &x, scale, &stats[1], &stats[2]]);
        let grad = node_of(
            op("LayerNormalizationGrad", &[("axis", AttrValue::Int(*axis))]),
            &ins,
            &["dx", "dscale", "db"],
        );
        let got = eval_all_dtypes(&grad, &ins, &[3, 4]);
        let norm = &x.shape()[(*axis).rem_euclid(3) as usize..];
        assert_eq!(got[1].shape(), norm, "{what}");
        let fwd_ins = vec![Some(x.clone()), Some(scale.clone()), bias.clone()];
        let fwd = node_of(
            op("LayerNormalization", &[("axis", AttrValue::Int(*axis))]),
            &fwd_ins,
            &["y"],
        );
        let fd = |i: usize| fd_grad(&fwd, &fwd_ins, i, 0, &dy);
        assert_grad(&format!("dX, {what}"), &got[0].to_f64_vec(), &fd(0), FD_TOL);
        let ds = sum_to(&got[1].to_f64_vec(), norm, scale.shape());
        assert_grad(&format!("dScale, {what}"), &ds, &fd(1), FD_TOL);
        if let Some(b) = bias {
            let db = sum_to(&got[2].to_f64_vec(), norm, b.shape());
            assert_grad(&format!("dB, {what}"), &db, &fd(2), FD_TOL);
        }
        // Input 5 (the `ln_grad_residual` rule): a residual gradient added onto dX.
        let r = randn(x.shape(), 19);
        let mut ins_r = ins.clone();
        ins_r.push(Some(r.clone()));
        let grad_r = node_of(grad.op.clone(), &ins_r, &["dx", "dscale", "db"]);
        let got_r = eval_all_dtypes(&grad_r, &ins_r, &[3, 4]);
        let want: Vec<f64> = fd(0)
            .iter()
            .zip(r.to_f64_vec())
            .map(|(a, b)| a + b)
            .collect();
        assert_grad(
            &format!("dX + r, {what}"),
            &got_r[0].to_f64_vec(),
            &want,
            FD_TOL,
        );
        assert_eq!(got_r[1..], got[1..], "{what}: dScale, dB with r");
    }
}

/// RMSNormalization (Y, InvStdDev) against a direct f64 computation, and its gradient
/// (dX, dScale, with and without the residual input) against finite differences, over
/// the last and a middle axis and a Scale smaller than the normalized shape.
#[test]
fn rms_norm_forward_and_grads() {
    let x = rand(&[2, 3, 4], 31, -2.0, 2.0);
    let dy = randn(x.shape(), 32);
    let eps = 1e-3;
    for (axis, scale) in [
        (-1i64, rand(&[4], 33, 0.5, 1.5)),
        (1, rand(&[4], 34, 0.5, 1.5)),
        (1, rand(&[3, 4], 35, 0.5, 1.5)),
    ] {
        let what = format!("axis {axis}, Scale {:?}", scale.shape());
        let attrs = [
            ("axis", AttrValue::Int(axis)),
            ("epsilon", AttrValue::Float(eps)),
        ];
        let fwd_ins = some(&[&x, &scale]);
        let fwd = node_of(op("RMSNormalization", &attrs), &fwd_ins, &["y", "inv"]);
        let outs = run1(&fwd, &fwd_ins);
        let n = if axis == 1 { 12 } else { 4 };
        let xs = x.to_f64_vec();
        let sc = scale.to_f64_vec();
        let (mut y, mut inv) = (vec![], vec![]);
        for row in xs.chunks(n) {
            // epsilon is an f32 attribute.
            let ms = row.iter().map(|v| v * v).sum::<f64>() / n as f64;
            let r = 1.0 / (ms + eps as f32 as f64).sqrt();
            inv.push(r);
            y.extend(
                row.iter()
                    .enumerate()
                    .map(|(j, v)| v * r * sc[j % sc.len()]),
            );
        }
        let e = rel_err(&outs[0].to_f64_vec(), &y);
        assert!(e < 1e-12, "Y, {what}: rel err {e:.2e}");
        assert!(
            rel_err(&outs[1].to_f64_vec(), &inv) < 1e-12,
            "InvStdDev, {what}"
        );
        let ins = some(&[&dy, &x, &scale, &outs[1]]);
        let grad = node_of(
            op("RMSNormalizationGrad", &[("axis", AttrValue::Int(axis))]),
            &ins,
            &["dx", "dscale"],
        );
        let got = eval_all_dtypes(&grad, &ins, &[3]);
        let norm = &x.shape()[axis.rem_euclid(3) as usize..];
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].shape(), norm, "{what}");
        let fwd_y = node_of(op("RMSNormalization", &attrs), &fwd_ins, &["y"]);
        let fd = |i: usize| fd_grad(&fwd_y, &fwd_ins, i, 0, &dy);
        assert_grad(&format!("dX, {what}"), &got[0].to_f64_vec(), &fd(0), FD_TOL);
        let ds = sum_to(&got[1].to_f64_vec(), norm, scale.shape());
        assert_grad(&format!("dScale, {what}"), &ds, &fd(1), FD_TOL);
        // Input 4: a residual gradient added onto dX.
        let r = randn(x.shape(), 36);
        let mut ins_r = ins.clone();
        ins_r.push(Some(r.clone()));
        let grad_r = node_of(grad.op.clone(), &ins_r, &["dx", "dscale"]);
        let got_r = eval_all_dtypes(&grad_r, &ins_r, &[3]);
        let want: Vec<f64> = fd(0)
            .iter()
            .zip(r.to_f64_vec())
            .map(|(a, b)| a + b)
            .collect();
        assert_grad(
            &format!("dX + r, {what}"),
            &got_r[0].to_f64_vec(),
            &want,
            FD_TOL,
        );
        assert_eq!(got_r[1], got[1], "{what}: dScale with r");
    }
}

/// Rotary against a direct f64 computation (both pairings, Cos and Sin broadcast from
/// [S, D] and [1, S, 1, D]... shapes), and RotaryGrad against finite differences.
#[test]
fn rotary_forward_and_grad() {
    let x = rand(&[2, 3, 4, 6], 41, -2.0, 2.0);
    let dy = randn(x.shape(), 42);
    for interleaved in [false, true] {
        for cs_shape in [&[4, 6][..], &[1, 3, 1, 6], &[2, 3, 4, 6]] {
            let what = format!("interleaved {interleaved}, Cos/Sin {cs_shape:?}");
            let (c, sn) = (randn(cs_shape, 43), randn(cs_shape, 44));
            let attrs = [("interleaved", AttrValue::Int(interleaved as i64))];
            let ins = some(&[&x, &c, &sn]);
            let fwd = node_of(op("Rotary", &attrs), &ins, &["y"]);
            let got = eval_all_dtypes(&fwd, &ins, &[]);
            // The reference: each pair (a, b) becomes (a·c − b·s, b·c + a·s) with c and s
            // read at each element's own position.
            let bc = |t: &Tensor| {
                let v = t.to_f64_vec();
                let sh = t.shape().to_vec();
                move |idx: &[usize]| {
                    let off = idx.len() - sh.len();
                    let mut k = 0;
                    for (d, &n) in sh.iter().enumerate() {
                        k = k * n + if n == 1 { 0 } else { idx[off + d] };
                    }
                    v[k]
                }
            };
            let (cf, sf) = (bc(&c), bc(&sn));
            let xs = x.to_f64_vec();
            let shape = x.shape();
            let mut want = vec![0.0; xs.len()];
            for (i, w) in want.iter_mut().enumerate() {
                let mut idx = vec![0; 4];
                let mut r = i;
                for d in (0..4).rev() {
                    idx[d] = r % shape[d];
                    r /= shape[d];
                }
                let j = idx[3];
                let (first, p) = match interleaved {
                    true => (
                        j.is_multiple_of(2),
                        if j.is_multiple_of(2) { i + 1 } else { i - 1 },
                    ),
                    false => (j < 3, if j < 3 { i + 3 } else { i - 3 }),
                };
                let rot = if first { -xs[p] } else { xs[p] };
                *w = xs[i] * cf(&idx) + rot * sf(&idx);
            }
            let e = rel_err(&got[0].to_f64_vec(), &want);
            assert!(e < 1e-12, "Rotary, {what}: rel err {e:.2e}");
            let gins = some(&[&dy, &c, &sn]);
            let grad = node_of(op("RotaryGrad", &attrs), &gins, &["dx"]);
            let dx = eval_all_dtypes(&grad, &gins, &[]);
            let fd = fd_grad(&fwd, &ins, 0, 0, &dy);
            assert_grad(&format!("dX, {what}"), &dx[0].to_f64_vec(), &fd, FD_TOL);
        }
    }
}

/// GatedMatMul against its definition computed here in f64 (`act(A·Bg + bg) · (A·Bu +
/// bu)`, G and U), for every gate activation, weights plain and transposed, with and
/// without biases, Y alone (the gate in the product's epilogue) and with G and U (the
/// gate as a pass); each dtype within tolerance of f64. GatedMatMulGrad against finite
/// differences of the gate `act(G)·U` with respect to G and U.
#[test]
fn gated_matmul_forward_and_gate_grad() {
    let (m, k, n) = (7, 5, 6);
    let a = rand(&[2, m, k], 51, -1.5, 1.5);
    let gelu = |x: f64| 0.5 * x * (1.0 + libm::erf(x / 2f64.sqrt()));
    let gelu_tanh = |x: f64| {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
    };
    let sigmoid = |x: f64| 1.0 / (1.0 + (-x).exp());
    let acts: [(Activation, &dyn Fn(f64) -> f64); 7] = [
        (Activation::Silu, &|x| x * sigmoid(x)),
        (Activation::Gelu, &gelu),
        (Activation::GeluTanh, &gelu_tanh),
        (Activation::Sigmoid, &sigmoid),
        (Activation::Tanh, &|x: f64| x.tanh()),
        (Activation::Relu, &|x: f64| x.max(0.0)),
        (Activation::Relu6, &|x: f64| x.clamp(0.0, 6.0)),
    ];
    for (act, f) in acts {
        for trans_b in [false, true] {
            let ws: [usize; 2] = if trans_b { [n, k] } else { [k, n] };
            let (wg, wu) = (randn(&ws, 52), randn(&ws, 53));
            let (bg, bu) = (randn(&[n], 54), randn(&[n], 55));
            for (biased, outs) in [
                (false, &["y"][..]),
                (true, &["y"]),
                (true, &["y", "g", "u"]),
            ] {
                let what = format!(
                    "{}, trans_b {trans_b}, biases {biased}, {outs:?}",
                    act.name()
                );
                let attrs = [
                    ("activation", AttrValue::Str(act.name().into())),
                    ("trans_b", AttrValue::Int(trans_b as i64)),
                ];
                let mut ins = vec![Some(a.clone()), Some(wg.clone()), Some(wu.clone())];
                if biased {
                    ins.extend([Some(bg.clone()), Some(bu.clone())]);
                }
                let node = node_of(op("GatedMatMul", &attrs), &ins, outs);
                let got = eval_all_dtypes(&node, &ins, &[]);
                let (av, wgv, wuv) = (a.to_f64_vec(), wg.to_f64_vec(), wu.to_f64_vec());
                let (bgv, buv) = (bg.to_f64_vec(), bu.to_f64_vec());
                let w_at = |w: &[f64], kk: usize, j: usize| {
                    if trans_b {
                        w[j * k + kk]
                    } else {
                        w[kk * n + j]
                    }
                };
                let (mut y, mut gs, mut us) = (vec![], vec![], vec![]);
                for r in 0..2 * m {
                    for j in 0..n {
                        let dot = |w: &[f64]| {
                            (0..k)
                                .map(|kk| av[r * k + kk] * w_at(w, kk, j))
                                .sum::<f64>()
                        };
                        let b = |v: &[f64]| if biased { v[j] } else { 0.0 };
                        let (g, u) = (dot(&wgv) + b(&bgv), dot(&wuv) + b(&buv));
                        y.push(f(g) * u);
                        gs.push(g);
                        us.push(u);
                    }
                }
                for (k, want) in [y, gs, us].iter().enumerate().take(outs.len()) {
                    let e = rel_err(&got[k].to_f64_vec(), want);
                    assert!(e < 1e-12, "GatedMatMul {what}: output {k} rel err {e:.2e}");
                }
            }
        }
        // The gate's gradient: dG and dU of Σ dY·act(G)·U, as GatedMatMul's with A = I
        // (so that G and U are the weights themselves).
        let attrs = [("activation", AttrValue::Str(act.name().into()))];
        let eye = f64s(
            &[n, n],
            &(0..n * n)
                .map(|i| (i % (n + 1) == 0) as u8 as f64)
                .collect::<Vec<_>>(),
        );
        let (g, u) = (signed(&[n, n], 56, 0.05, 2.0), randn(&[n, n], 57));
        let dy = randn(&[n, n], 58);
        let fwd_ins = some(&[&eye, &g, &u]);
        let fwd = node_of(op("GatedMatMul", &attrs), &fwd_ins, &["y"]);
        let gins = some(&[&dy, &g, &u]);
        let grad = node_of(op("GatedMatMulGrad", &attrs), &gins, &["dg", "du"]);
        let got = eval_all_dtypes(&grad, &gins, &[]);
        for (i, what) in [(1, "dG"), (2, "dU")] {
            let fd = fd_grad(&fwd, &fwd_ins, i, 0, &dy);
            assert_grad(
                &format!("{what}, {}", act.name()),
                &got[i - 1].to_f64_vec(),
                &fd,
                FD_TOL,
            );
        }
    }
}

#[test]
fn layer_norm_grad_computes_only_wanted_outputs() {
    let x = rand(&[3, 5], 19, -2.0, 2.0);
    let (dy, scale) = (randn(x.shape(), 20), rand(&[5], 21, 0.5, 1.5));
    let stats = layer_norm(&x, &scale, None, -1);
    let ins = some(&[&dy, &x, &scale, &stats[1], &stats[2]]);
    let grad = |outs: &[&str]| {
        let node = node_of(op("LayerNormalizationGrad", &[]), &ins, outs);
        eval_all_dtypes(&node, &ins, &[3, 4])
    };
    let all = grad(&["dx", "ds", "db"]);
    for outs in [
        &["dx"][..],
        &["dx", "", "db"],
        &["", "ds", ""],
        &["", "", "db"],
    ] {
        let got = grad(outs);
        assert_eq!(got.len(), outs.len());
        for (k, name) in outs.iter().enumerate() {
            if !name.is_empty() {
                assert_eq!(got[k], all[k], "{outs:?} output {k}");
            }
        }
    }
}

// ---- SoftmaxCrossEntropyLoss -------------------------------------------------------------

#[test]
fn sce_grads_reductions_weights_ignore_index() {
    // (scores, labels): 2-D, and 3-D [N, C, d] with labels [N, d]; each has labels 1 and -1.
    let data = [
        (rand(&[5, 4], 23, -3.0, 3.0), i64s(&[5], &[1, 0, 3, -1, 1])),
        (
            rand(&[2, 4, 3], 24, -3.0, 3.0),
            i64s(&[2, 3], &[2, 1, -1, 1, 0, 3]),
        ),
        // Many classes: CUDA's block-per-row kernel strides each row several times.
        (rand(&[3, 300], 26, -3.0, 3.0), i64s(&[3], &[299, -1, 1])),
    ];
    for (scores, labels) in &data {
        let weights = rand(&[scores.shape()[1]], 22, 0.5, 2.0);
        for reduction in ["mean", "sum", "none"] {
            for w in [None, Some(&weights)] {
                for ignore in [None, Some(1), Some(-1)] {
                    // Without ignore_index the label -1 would be out of range.
                    let labels = match ignore {
                        Some(-1) => labels.clone(),
                        _ => i64s(
                            labels.shape(),
                            &labels
                                .to_i64_vec()
                                .iter()
                                .map(|&l| l.max(0))
                                .collect::<Vec<_>>(),
                        ),
                    };
                    let mut attrs = vec![("reduction", AttrValue::Str(reduction.into()))];
                    if let Some(i) = ignore {
                        attrs.push(("ignore_index", AttrValue::Int(i)));
                    }
                    let what = format!(
                        "{reduction}, weights {}, ignore_index {ignore:?}, scores {:?}",
                        w.is_some(),
                        scores.shape()
                    );
                    let dloss = if reduction == "none" {
                        randn(labels.shape(), 25)
                    } else {
                        f64s(&[], &[0.7])
                    };
                    let fwd_ins = vec![Some(scores.clone()), Some(labels.clone()), w.cloned()];
                    let fwd = node_of(op("SoftmaxCrossEntropyLoss", &attrs), &fwd_ins, &["loss"]);
                    let ins = vec![
                        Some(dloss.clone()),
                        Some(scores.clone()),
                        Some(labels.clone()),
                        w.cloned(),
                    ];
                    let grad = node_of(
                        op("SoftmaxCrossEntropyLossGrad", &attrs),
                        &ins,
                        &["dscores"],
                    );
                    let got = eval_all_dtypes(&grad, &ins, &[]);
                    let fd = fd_grad(&fwd, &fwd_ins, 0, 0, &dloss);
                    assert_grad(&what, &got[0].to_f64_vec(), &fd, FD_TOL);
                }
            }
        }
    }
}

#[test]
fn sce_grad_all_ignored_is_zero_and_bad_label_names_node() {
    let scores = rand(&[2, 3], 26, -1.0, 1.0);
    let attrs = [("ignore_index", AttrValue::Int(2))];
    let ins = some(&[&f64s(&[], &[1.0]), &scores, &i64s(&[2], &[2, 2])]);
    let got = run1(
        &node_of(op("SoftmaxCrossEntropyLossGrad", &attrs), &ins, &["d"]),
        &ins,
    );
    assert_eq!(got[0].to_f64_vec(), vec![0.0; 6]);
    let ins = some(&[&f64s(&[], &[1.0]), &scores, &i64s(&[2], &[0, 3])]);
    let err = eval(
        &node_of(op("SoftmaxCrossEntropyLossGrad", &attrs), &ins, &["d"]),
        &ins,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("node 'node' (SoftmaxCrossEntropyLossGrad)") && err.contains("label 3"),
        "{err}"
    );
}

// ---- GatherGrad --------------------------------------------------------------------------

#[test]
fn gather_grads_repeated_and_negative_indices() {
    // (data, indices, axis): indices repeat and count from the end.
    let cases = [
        (
            rand(&[4, 3], 27, -1.0, 1.0),
            i64s(&[2, 3], &[0, -1, 2, 0, 0, 3]),
            0i64,
        ),
        (
            rand(&[2, 4, 3], 28, -1.0, 1.0),
            i32s(&[5], &[1, -4, 1, 3, -1]),
            1,
        ),
        (rand(&[2, 4, 3], 29, -1.0, 1.0), i64s(&[], &[-2]), -1),
    ];
    for (data, idx, axis) in &cases {
        let attrs = [("axis", AttrValue::Int(*axis))];
        let fwd_ins = some(&[data, idx]);
        let fwd = node_of(op("Gather", &attrs), &fwd_ins, &["y"]);
        let y = run1(&fwd, &fwd_ins).remove(0);
        let dy = randn(y.shape(), 30);
        let ins = some(&[&dy, idx, &shape_of(data)]);
        let got = eval_all_dtypes(&node_of(op("GatherGrad", &attrs), &ins, &["dx"]), &ins, &[]);
        assert_eq!(got[0].shape(), data.shape());
        let fd = fd_grad(&fwd, &fwd_ins, 0, 0, &dy);
        assert_grad(
            &format!("GatherGrad axis {axis}"),
            &got[0].to_f64_vec(),
            &fd,
            FD_TOL,
        );
    }
}

#[test]
fn gather_grad_out_of_range_index_names_node() {
    let ins = some(&[
        &randn(&[2, 3], 31),
        &i64s(&[2], &[0, 4]),
        &i64s(&[2], &[4, 3]),
    ]);
    let err = eval(&node_of(op("GatherGrad", &[]), &ins, &["dx"]), &ins)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("node 'node' (GatherGrad)") && err.contains("index 4 is out of range"),
        "{err}"
    );
}

// ---- SliceGrad ---------------------------------------------------------------------------

#[test]
fn slice_grads_negative_steps_and_axes() {
    let x = rand(&[4, 5, 6], 32, -1.0, 1.0);
    // (starts, ends, axes, steps); absent axes/steps take their defaults.
    let cases: Vec<[Option<Tensor>; 4]> = vec![
        [
            Some(i64s(&[2], &[3, -1])),
            Some(i64s(&[2], &[0, -6])),
            Some(i64s(&[2], &[0, -1])),
            Some(i64s(&[2], &[-1, -2])),
        ],
        [Some(i32s(&[1], &[1])), Some(i32s(&[1], &[100])), None, None],
        [
            Some(i64s(&[2], &[-1, 0])),
            Some(i64s(&[2], &[-100, 5])),
            Some(i64s(&[2], &[1, 2])),
            Some(i64s(&[2], &[-3, 2])),
        ],
        [
            Some(i64s(&[1], &[2])),
            Some(i64s(&[1], &[2])),
            Some(i64s(&[1], &[-2])),
            None,
        ], // empty
    ];
    for args in &cases {
        let mut fwd_ins = vec![Some(x.clone())];
        fwd_ins.extend(args.iter().cloned());
        let fwd = node_of(op("Slice", &[]), &fwd_ins, &["y"]);
        let y = run1(&fwd, &fwd_ins).remove(0);
        let dy = randn(y.shape(), 33);
        let mut ins = vec![Some(dy.clone()), Some(shape_of(&x))];
        ins.extend(args.iter().cloned());
        let got = eval_all_dtypes(&node_of(op("SliceGrad", &[]), &ins, &["dx"]), &ins, &[]);
        let fd = fd_grad(&fwd, &fwd_ins, 0, 0, &dy);
        assert_grad(
            &format!("SliceGrad {args:?}"),
            &got[0].to_f64_vec(),
            &fd,
            FD_TOL,
        );
    }
}

// ---- FusedMatMul -------------------------------------------------------------------------

fn fused_attrs(act: Activation, trans_b: bool) -> Vec<(&'static str, AttrValue)> {
    vec![
        ("activation", AttrValue::Str(act.name().into())),
        ("trans_b", AttrValue::Int(trans_b as i64)),
    ]
}

#[test]
fn fused_matmul_pre_output_is_product_plus_bias() {
    let (a, b) = (randn(&[2, 3, 4], 34), randn(&[4, 5], 35));
    let (bias, res) = (randn(&[5], 36), randn(&[3, 5], 37));
    for act in Activation::ALL {
        for dt in FLOATS {
            let c = |t: &Tensor| Some(t.cast(dt));
            let ins = vec![c(&a), c(&b), c(&bias), c(&res)];
            let both = run1(
                &node_of(
                    op("FusedMatMul", &fused_attrs(act, false)),
                    &ins,
                    &["y", "pre"],
                ),
                &ins,
            );
            let y = run1(
                &node_of(op("FusedMatMul", &fused_attrs(act, false)), &ins, &["y"]),
                &ins,
            );
            let pre_ins = vec![c(&a), c(&b), c(&bias)];
            let pre = run1(
                &node_of(
                    op("FusedMatMul", &fused_attrs(Activation::None, false)),
                    &pre_ins,
                    &["y"],
                ),
                &pre_ins,
            );
            assert_eq!(both[1], pre[0], "{act:?} {dt}: Pre");
            let e = rel_err(&both[0].to_f64_vec(), &y[0].to_f64_vec());
            assert!(
                e <= tol(dt),
                "{act:?} {dt}: Y with Pre differs from Y alone by {e:.3e}"
            );
        }
    }
}

/// Checks FusedMatMulGrad against finite differences of FusedMatMul for one shape case.
fn check_fused_grad(
    sa: &[usize],
    sb: &[usize],
    trans_b: bool,
    bias: bool,
    residual: Option<&[usize]>,
    seed: u64,
) {
    let (a, b) = (randn(sa, seed), randn(sb, seed + 1));
    let n = if trans_b {
        sb[sb.len() - 2]
    } else {
        sb[sb.len() - 1]
    };
    let bias = bias.then(|| randn(&[n], seed + 2));
    let res = residual.map(|s| randn(s, seed + 3));
    for act in Activation::ALL {
        let what = format!(
            "A {sa:?}, B {sb:?}, trans_b {trans_b}, bias {}, {act:?}",
            bias.is_some()
        );
        let attrs = fused_attrs(act, trans_b);
        let fwd_ins = vec![Some(a.clone()), Some(b.clone()), bias.clone(), res.clone()];
        let outs = run1(
            &node_of(op("FusedMatMul", &attrs), &fwd_ins, &["y", "pre"]),
            &fwd_ins,
        );
        let dy = randn(outs[0].shape(), seed + 4);
        let ins = some(&[&dy, &a, &b, &outs[1]]);
        let names: &[&str] = if bias.is_some() {
            &["da", "db", "dbias"]
        } else {
            &["da", "db"]
        };
        let got = eval_all_dtypes(
            &node_of(op("FusedMatMulGrad", &attrs), &ins, names),
            &ins,
            &[],
        );
        let fwd = node_of(op("FusedMatMul", &attrs), &fwd_ins, &["y"]);
        for (k, what_k) in ["dA", "dB", "dBias"].iter().enumerate().take(names.len()) {
            let fd = fd_grad(&fwd, &fwd_ins, k, 0, &dy);
            assert_grad(
                &format!("{what_k}, {what}"),
                &got[k].to_f64_vec(),
                &fd,
                FD_TOL,
            );
        }
        if act == Activation::None {
            // Pre is optional without an activation.
            let ins = some(&[&dy, &a, &b]);
            let plain = run1(&node_of(op("FusedMatMulGrad", &attrs), &ins, names), &ins);
            assert_eq!(plain, got, "{what}: without Pre");
        }
    }
}

#[test]
fn fused_matmul_grads_2d_with_and_without_bias() {
    check_fused_grad(&[3, 4], &[4, 5], false, true, None, 40);
    check_fused_grad(&[3, 4], &[5, 4], true, false, Some(&[5]), 50);
}

#[test]
fn fused_matmul_grads_batched_a_2d_b() {
    check_fused_grad(&[2, 3, 4], &[4, 5], false, false, None, 60);
    check_fused_grad(&[2, 3, 4], &[5, 4], true, true, Some(&[2, 3, 5]), 70);
}

#[test]
fn fused_matmul_grads_batched_and_broadcast_b() {
    check_fused_grad(&[2, 3, 4], &[2, 4, 5], false, true, Some(&[3, 5]), 80);
    check_fused_grad(&[2, 3, 4], &[2, 5, 4], true, false, None, 90);
    // A broadcast over B's batch, and both broadcast against each other.
    check_fused_grad(&[3, 4], &[2, 5, 4], true, true, None, 100);
    check_fused_grad(&[2, 1, 3, 4], &[3, 4, 5], false, true, None, 110);
}

#[test]
fn fused_matmul_grad_computes_only_wanted_outputs() {
    let (a, b, dy) = (
        randn(&[2, 3, 4], 120),
        randn(&[4, 5], 121),
        randn(&[2, 3, 5], 122),
    );
    let attrs = fused_attrs(Activation::None, false);
    let ins = some(&[&dy, &a, &b]);
    let all = run1(
        &node_of(op("FusedMatMulGrad", &attrs), &ins, &["da", "db", "dbias"]),
        &ins,
    );
    for outs in [&["da", "", ""][..], &["", "db"], &["", "", "dbias"]] {
        let got = eval_all_dtypes(
            &node_of(op("FusedMatMulGrad", &attrs), &ins, outs),
            &ins,
            &[],
        );
        for (k, name) in outs.iter().enumerate() {
            if !name.is_empty() {
                assert_eq!(got[k], all[k], "{outs:?} output {k}");
            }
        }
    }
}

// ---- Large shapes: the parallel paths (row groups summed in order) -------------------------

/// Σ over the rows of a row-major [rows, n] matrix.
fn col_sums(v: &[f64], n: usize) -> Vec<f64> {
    let mut s = vec![0.0; n];
    for row in v.chunks(n) {
        s.iter_mut().zip(row).for_each(|(s, x)| *s += x);
    }
    s
}

#[test]
fn large_shapes_match_naive_sums() {
    // LayerNorm over 900 rows of 16: dB = Σ dY, dScale = Σ dY·xhat.
    let x = rand(&[30, 30, 16], 130, -2.0, 2.0);
    let (dy, scale) = (randn(x.shape(), 131), rand(&[16], 132, 0.5, 1.5));
    let stats = layer_norm(&x, &scale, None, -1);
    let ins = some(&[&dy, &x, &scale, &stats[1], &stats[2]]);
    let got = eval_all_dtypes(
        &node_of(op("LayerNormalizationGrad", &[]), &ins, &["dx", "ds", "db"]),
        &ins,
        &[3, 4],
    );
    let (dyv, xv, m, inv) = (
        dy.to_f64_vec(),
        x.to_f64_vec(),
        stats[1].to_f64_vec(),
        stats[2].to_f64_vec(),
    );
    let dyx: Vec<f64> = (0..xv.len())
        .map(|i| dyv[i] * (xv[i] - m[i / 16]) * inv[i / 16])
        .collect();
    assert!(rel_err(&got[1].to_f64_vec(), &col_sums(&dyx, 16)) < 1e-12);
    assert!(rel_err(&got[2].to_f64_vec(), &col_sums(&dyv, 16)) < 1e-12);

    // FusedMatMul over 1200 rows: dBias = Σ dY, dB = Aᵀ·dY over every row, dA = dY·Bᵀ.
    let (a, b) = (randn(&[4, 300, 8], 133), randn(&[8, 6], 134));
    let dy = randn(&[4, 300, 6], 136);
    let ins = some(&[&dy, &a, &b]);
    let attrs = fused_attrs(Activation::None, false);
    let got = eval_all_dtypes(
        &node_of(op("FusedMatMulGrad", &attrs), &ins, &["da", "db", "dbias"]),
        &ins,
        &[],
    );
    let (av, bv, dyv) = (a.to_f64_vec(), b.to_f64_vec(), dy.to_f64_vec());
    let db: Vec<f64> = (0..48)
        .map(|e| {
            (0..1200)
                .map(|r| av[r * 8 + e / 6] * dyv[r * 6 + e % 6])
                .sum()
        })
        .collect();
    let da: Vec<f64> = (0..9600)
        .map(|e| (0..6).map(|j| dyv[e / 8 * 6 + j] * bv[e % 8 * 6 + j]).sum())
        .collect();
    assert!(rel_err(&got[0].to_f64_vec(), &da) < 1e-12);
    assert!(rel_err(&got[1].to_f64_vec(), &db) < 1e-12);
    assert!(rel_err(&got[2].to_f64_vec(), &col_sums(&dyv, 6)) < 1e-12);

    // GatherGrad of 3000 embedding lookups into 1000 rows: a naive scatter-add.
    let idx = rand_ints(&[3000], 137, 0, 1000);
    let dy = randn(&[3000, 8], 138);
    let ins = some(&[&dy, &idx, &i64s(&[2], &[1000, 8])]);
    let got = eval_all_dtypes(&node_of(op("GatherGrad", &[]), &ins, &["dx"]), &ins, &[]);
    let (mut want, dyv) = (vec![0.0; 8000], dy.to_f64_vec());
    for (q, &i) in idx.to_i64_vec().iter().enumerate() {
        for j in 0..8 {
            want[i as usize * 8 + j] += dyv[q * 8 + j];
        }
    }
    assert!(rel_err(&got[0].to_f64_vec(), &want) < 1e-12);
}

/// FusedMatMulGrad with `a_activation` (what the `dact_into_da` rule makes of fc2's
/// gradient behind fc1): dA leaves as the gradient at PreA of Σ dY ∘ FusedMatMul(act(PreA),
/// B), against finite differences of that composite, and dBiasA (output 3) as the
/// gradient of a bias added to PreA (finite differences summed over the rows); dB and
/// dBias as without it.
#[test]
fn fused_matmul_grad_applies_a_activation_to_da() {
    for (sa, sb, trans_b) in [
        (vec![3, 4], vec![4, 5], false),
        (vec![2, 3, 4], vec![5, 4], true),
        (vec![2, 3, 4], vec![2, 4, 5], false),
    ] {
        let n = if trans_b { sb[0] } else { sb[sb.len() - 1] };
        let (pa, b, bias) = (randn(&sa, 120), randn(&sb, 121), randn(&[n], 122));
        for act in Activation::ALL.into_iter().skip(1) {
            let what = format!("A {sa:?}, B {sb:?}, trans_b {trans_b}, {act:?}");
            // A = act(PreA): a FusedMatMul of PreA by the identity.
            let k = *sa.last().unwrap();
            let eye: Vec<f64> = (0..k * k).map(|i| (i / k == i % k) as u8 as f64).collect();
            let eye = f64s(&[k, k], &eye);
            let act_of = |p: &Tensor| {
                let ins = some(&[p, &eye]);
                run1(
                    &node_of(op("FusedMatMul", &fused_attrs(act, false)), &ins, &["y"]),
                    &ins,
                )
                .remove(0)
            };
            let a = act_of(&pa);
            let attrs = fused_attrs(Activation::None, trans_b);
            let fwd = node_of(op("FusedMatMul", &attrs), &some(&[&a, &b, &bias]), &["y"]);
            let y = run1(&fwd, &some(&[&a, &b, &bias])).remove(0);
            let dy = randn(y.shape(), 123);
            let mut gattrs = attrs.clone();
            gattrs.push(("a_activation", AttrValue::Str(act.name().into())));
            let ins = vec![
                Some(dy.clone()),
                Some(a.clone()),
                Some(b.clone()),
                None,
                Some(pa.clone()),
            ];
            let outs = ["da", "db", "dbias", "dbias_a"];
            let node = node_of(op("FusedMatMulGrad", &gattrs), &ins, &outs);
            let got = eval_all_dtypes(&node, &ins, &[]);
            // Σ dY ∘ FusedMatMul(act(PreA), B, bias), differentiated at PreA.
            let loss = |p: &Tensor| -> f64 {
                let y = run1(&fwd, &some(&[&act_of(p), &b, &bias])).remove(0);
                y.to_f64_vec()
                    .iter()
                    .zip(dy.to_f64_vec())
                    .map(|(y, d)| y * d)
                    .sum()
            };
            let pv = pa.to_f64_vec();
            let fd: Vec<f64> = (0..pv.len())
                .map(|i| {
                    let at = |h: f64| {
                        let mut v = pv.clone();
                        v[i] += h;
                        loss(&f64s(pa.shape(), &v))
                    };
                    (at(1e-6) - at(-1e-6)) / 2e-6
                })
                .collect();
            assert_grad(&format!("dPreA, {what}"), &got[0].to_f64_vec(), &fd, FD_TOL);
            assert_eq!(got[3].shape(), [k], "{what}: dBiasA");
            assert_grad(
                &format!("dBiasA, {what}"),
                &got[3].to_f64_vec(),
                &col_sums(&fd, k),
                FD_TOL,
            );
            let plain_ins = some(&[&dy, &a, &b]);
            let plain = run1(
                &node_of(
                    op("FusedMatMulGrad", &attrs),
                    &plain_ins,
                    &["da", "db", "dbias"],
                ),
                &plain_ins,
            );
            assert_eq!(got[1..3], plain[1..], "{what}: dB, dBias");
        }
    }
    // dBiasA is dA's row sum: without dA it is an error naming the output.
    let (a, b, dy) = (
        randn(&[3, 4], 124),
        randn(&[4, 5], 125),
        randn(&[3, 5], 126),
    );
    let attrs = [
        ("activation", AttrValue::Str("none".into())),
        ("a_activation", AttrValue::Str("relu".into())),
    ];
    let ins = vec![Some(dy), Some(a.clone()), Some(b), None, Some(a)];
    let node = node_of(
        op("FusedMatMulGrad", &attrs),
        &ins,
        &["", "db", "", "dbias_a"],
    );
    let e = eval(&node, &ins).unwrap_err().to_string();
    assert!(e.contains("dBiasA (output 3) needs dA"), "{e}");
}
