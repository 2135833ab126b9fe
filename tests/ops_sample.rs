//! GridSample, AffineGrid, DeformConv, RoiAlign, CausalConvWithState, MaxUnpool, TensorScatter, the
//! ai.onnx.preview.training optimizers
//! (Adagrad, Momentum, Adam) and ai.onnx.ml's Binarizer and ArrayFeatureExtractor,
//! imported as compositions: every backend against float64 references written here from
//! the operators' definitions, and gradients against finite differences.

mod common;
#[path = "common/onnx_case.rs"]
mod onnx_case;
#[path = "common/onnx_model.rs"]
mod onnx_model;

use common::*;
use graphrun::{DType, Tensor};
use onnx_case::*;
use onnx_model::*;

// ---------------------------------------------------------------------------------------
// GridSample

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Nearest,
    Linear,
    Cubic,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Pad {
    Zeros,
    Border,
    Reflection,
}

fn reflect(x: f64, lo: f64, hi: f64) -> f64 {
    let range = hi - lo;
    if x < lo {
        let dx = lo - x;
        let k = (dx / range).trunc();
        let r = dx - k * range;
        if k % 2.0 == 0.0 {
            lo + r
        } else {
            hi - r
        }
    } else if x > hi {
        let dx = x - hi;
        let k = (dx / range).trunc();
        let r = dx - k * range;
        if k % 2.0 == 0.0 {
            hi - r
        } else {
            lo + r
        }
    } else {
        x
    }
}

fn cubic(t: f64) -> [f64; 4] {
    let a = -0.75;
    let outer = |s: f64| ((a * s - 5.0 * a) * s + 8.0 * a) * s - 4.0 * a;
    let inner = |s: f64| ((a + 2.0) * s - (a + 3.0)) * s * s + 1.0;
    [outer(t + 1.0), inner(t), inner(1.0 - t), outer(2.0 - t)]
}

/// GridSample by its definition: per output element, every combination of one tap per
/// spatial axis.
fn grid_sample_ref(
    x: &[f64],
    xs: &[usize],
    g: &[f64],
    gs: &[usize],
    mode: Mode,
    pad: Pad,
    align: bool,
) -> Expected {
    let (n_, c_) = (xs[0], xs[1]);
    let sp = &xs[2..];
    let r = sp.len();
    let q_ = gs[1..1 + r].iter().product::<usize>();
    let p_ = sp.iter().product::<usize>();
    let mut out = vec![0.0; n_ * c_ * q_];
    for n in 0..n_ {
        for q in 0..q_ {
            // Per axis: (index, weight) taps.
            let mut taps: Vec<Vec<(i64, f64)>> = vec![];
            for i in 0..r {
                let d = sp[i] as f64;
                let gv = g[(n * q_ + q) * r + (r - 1 - i)];
                let mut v = if align {
                    (gv + 1.0) / 2.0 * (d - 1.0)
                } else {
                    ((gv + 1.0) * d - 1.0) / 2.0
                };
                if mode == Mode::Nearest {
                    v = v.round_ties_even();
                }
                let (lo, hi) = if align {
                    (0.0, d - 1.0)
                } else {
                    (-0.5, d - 0.5)
                };
                if v < lo || v > hi {
                    match pad {
                        Pad::Border => v = v.clamp(0.0, d - 1.0),
                        Pad::Reflection => v = reflect(v, lo, hi),
                        Pad::Zeros => {}
                    }
                }
                let x0 = v.floor();
                let t = v - x0;
                taps.push(match mode {
                    Mode::Nearest => vec![(v as i64, 1.0)],
                    Mode::Linear => vec![(x0 as i64, 1.0 - t), (x0 as i64 + 1, t)],
                    Mode::Cubic => {
                        let w = cubic(t);
                        (0..4).map(|k| (x0 as i64 - 1 + k as i64, w[k])).collect()
                    }
                });
            }
            let per = taps[0].len();
            for c in 0..c_ {
                let mut acc = 0.0;
                for combo in 0..per.pow(r as u32) {
                    let (mut flat, mut w, mut inside) = (0usize, 1.0, true);
                    let mut rest = combo;
                    for i in (0..r).rev() {
                        let (idx, wi) = taps[i][rest % per];
                        rest /= per;
                        let d = sp[i] as i64;
                        let lo_hi = if align {
                            (0.0, d as f64 - 1.0)
                        } else {
                            (-0.5, d as f64 - 0.5)
                        };
                        let idx = match pad {
                            Pad::Zeros => {
                                inside &= (0..d).contains(&idx);
                                idx.clamp(0, d - 1)
                            }
                            Pad::Border => idx.clamp(0, d - 1),
                            Pad::Reflection => reflect(idx as f64, lo_hi.0, lo_hi.1) as i64,
                        };
                        let stride: usize = sp[i + 1..].iter().product();
                        flat += idx as usize * stride;
                        w *= wi;
                    }
                    if inside {
                        acc += w * x[(n * c_ + c) * p_ + flat];
                    }
                }
                out[(n * c_ + c) * q_ + q] = acc;
            }
        }
    }
    let mut shape = vec![n_, c_];
    shape.extend_from_slice(&gs[1..1 + r]);
    vec![(shape, out)]
}

struct Gs {
    mode: Mode,
    pad: Pad,
    align: bool,
    x: Vec<usize>,
    grid: Vec<usize>,
    opset: i64,
}

impl Gs {
    fn case(&self, seed: u64) -> Case {
        let x = randn(&self.x, seed);
        // Coordinates past the borders too (some past twice the image), so every padding
        // mode acts and reflection folds more than once.
        let g = randn(&self.grid, seed + 1).to_f64_vec();
        let g: Vec<f64> = g.iter().map(|v| v * 0.9).collect();
        let g = Tensor::from_vec(&self.grid, g).unwrap();
        let names = if self.opset < 20 {
            ["nearest", "bilinear", "bicubic"]
        } else {
            ["nearest", "linear", "cubic"]
        };
        let mode = names[self.mode as usize];
        let pad = ["zeros", "border", "reflection"][self.pad as usize];
        Case::new(
            "GridSample",
            self.opset,
            vec![("x", Some(x)), ("grid", Some(g))],
        )
        .with(vec![
            str_attr("mode", mode),
            str_attr("padding_mode", pad),
            int_attr("align_corners", self.align as i64),
        ])
    }
    fn reference(&self) -> impl Fn(&[Vec<f64>]) -> Expected + '_ {
        move |v: &[Vec<f64>]| {
            grid_sample_ref(
                &v[0], &self.x, &v[1], &self.grid, self.mode, self.pad, self.align,
            )
        }
    }
}

const MODES: [Mode; 3] = [Mode::Nearest, Mode::Linear, Mode::Cubic];
const PADS: [Pad; 3] = [Pad::Zeros, Pad::Border, Pad::Reflection];

#[test]
fn grid_sample_every_mode_padding_and_alignment() {
    let shapes: [(&[usize], &[usize]); 3] = [
        (&[2, 3, 4, 5], &[2, 3, 6, 2]),
        (&[1, 2, 7], &[1, 5, 1]),
        (&[1, 2, 3, 4, 3], &[1, 2, 3, 2, 3]),
    ];
    for (x, grid) in shapes {
        for mode in MODES {
            for pad in PADS {
                for align in [false, true] {
                    let s = Gs {
                        mode,
                        pad,
                        align,
                        x: x.to_vec(),
                        grid: grid.to_vec(),
                        opset: 22,
                    };
                    let what = format!("GridSample {mode:?} {pad:?} align {align} x {x:?}");
                    check_case(&what, &s.case(7), &BOTH, 1e-5, s.reference());
                }
            }
        }
    }
}

#[test]
fn grid_sample_opset_16_names() {
    for mode in MODES {
        let s = Gs {
            mode,
            pad: Pad::Border,
            align: false,
            x: vec![1, 2, 3, 4],
            grid: vec![1, 2, 5, 2],
            opset: 16,
        };
        check_case(&format!("{mode:?}"), &s.case(3), &BOTH, 1e-5, s.reference());
    }
}

#[test]
fn grid_sample_gradients() {
    for (k, (mode, pad, align)) in [
        (Mode::Linear, Pad::Zeros, false),
        (Mode::Linear, Pad::Reflection, true),
        (Mode::Cubic, Pad::Border, false),
        (Mode::Cubic, Pad::Zeros, true),
        (Mode::Nearest, Pad::Reflection, false),
    ]
    .into_iter()
    .enumerate()
    {
        let s = Gs {
            mode,
            pad,
            align,
            x: vec![1, 2, 4, 3],
            grid: vec![1, 3, 2, 2],
            opset: 22,
        };
        // The nearest pixel does not move with the grid: X's gradient only.
        let wrt: &[usize] = if mode == Mode::Nearest { &[0] } else { &[0, 1] };
        let what = format!("GridSample {mode:?} {pad:?} align {align}");
        check_grads(
            &what,
            &s.case(20 + k as u64),
            wrt,
            30 + k as u64,
            s.reference(),
        );
    }
}

#[test]
fn grid_sample_refusals_say_why() {
    let x = Tensor::zeros(DType::F32, &[1, 1, 2, 2]);
    let g = Tensor::zeros(DType::F32, &[1, 2, 2, 2]);
    let import = |attrs| {
        let n = node("GridSample", "", &["x", "grid"], &["y"], attrs);
        import_one_node(
            n,
            22,
            vec![input_like("x", &x), input_like("grid", &g)],
            vec![],
        )
        .unwrap_err()
        .to_string()
    };
    let e = import(vec![str_attr("mode", "area")]);
    assert!(e.contains("must be linear, nearest or cubic"), "{e}");
    let e = import(vec![str_attr("padding_mode", "wrap")]);
    assert!(e.contains("must be zeros, border or reflection"), "{e}");
    let e = import(vec![int_attr("align_corners", 2)]);
    assert!(e.contains("align_corners"), "{e}");
    // Cubic over 4 spatial axes reads 256 taps per output.
    let x5 = Tensor::zeros(DType::F32, &[1, 1, 2, 2, 2, 2]);
    let g5 = Tensor::zeros(DType::F32, &[1, 1, 1, 1, 1, 4]);
    let n = node(
        "GridSample",
        "",
        &["x", "grid"],
        &["y"],
        vec![str_attr("mode", "cubic")],
    );
    let e = import_one_node(
        n,
        22,
        vec![input_like("x", &x5), input_like("grid", &g5)],
        vec![],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("4^4 taps"), "{e}");
}

// ---------------------------------------------------------------------------------------
// AffineGrid

fn affine_grid_ref(theta: &[f64], size: &[usize], align: bool) -> Expected {
    let n_ = size[0];
    let sp = &size[2..];
    let r = sp.len();
    let pos = |i: usize, l: usize| -> f64 {
        if align {
            if l == 1 {
                -1.0
            } else {
                -1.0 + 2.0 * i as f64 / (l - 1) as f64
            }
        } else {
            -1.0 + (2.0 * i as f64 + 1.0) / l as f64
        }
    };
    let p_: usize = sp.iter().product();
    let mut out = vec![];
    for n in 0..n_ {
        for p in 0..p_ {
            // Homogeneous position: x (last axis) first, then y, z, 1.
            let mut idx = vec![0; r];
            let mut rest = p;
            for i in (0..r).rev() {
                idx[i] = rest % sp[i];
                rest /= sp[i];
            }
            let mut h: Vec<f64> = (0..r).rev().map(|i| pos(idx[i], sp[i])).collect();
            h.push(1.0);
            for row in 0..r {
                let t = &theta[(n * r + row) * (r + 1)..(n * r + row + 1) * (r + 1)];
                out.push(t.iter().zip(&h).map(|(a, b)| a * b).sum());
            }
        }
    }
    let mut shape = vec![n_];
    shape.extend_from_slice(sp);
    shape.push(r);
    vec![(shape, out)]
}

#[test]
fn affine_grid_2d_and_3d_with_gradients() {
    for (size, align) in [
        (vec![2usize, 3, 4, 5], false),
        (vec![2, 3, 4, 5], true),
        (vec![1, 1, 1, 3], true),
        (vec![2, 2, 3, 2, 4], false),
        (vec![1, 2, 2, 3, 2], true),
    ] {
        let r = size.len() - 2;
        let theta = randn(&[size[0], r, r + 1], 11);
        let sizes: Vec<i64> = size.iter().map(|&d| d as i64).collect();
        let case = Case::new(
            "AffineGrid",
            20,
            vec![
                ("theta", Some(theta)),
                ("size", Some(i64s(&[sizes.len()], &sizes))),
            ],
        )
        .with(vec![int_attr("align_corners", align as i64)]);
        let reference = |v: &[Vec<f64>]| affine_grid_ref(&v[0], &size, align);
        let what = format!("AffineGrid {size:?} align {align}");
        check_case(&what, &case, &BOTH, 1e-5, reference);
        check_grads(&what, &case, &[0], 5, reference);
    }
}

// ---------------------------------------------------------------------------------------
// CausalConvWithState

fn causal_conv_ref(v: &[Vec<f64>], b: usize, c: usize, l: usize, k: usize, silu: bool) -> Expected {
    let (x, w, bias, past) = (&v[0], &v[1], &v[2], &v[3]);
    let lp = l + k - 1;
    // The input with the past state (zeros when none) before it.
    let mut padded = vec![0.0; b * c * lp];
    for bc in 0..b * c {
        for t in 0..k - 1 {
            if !past.is_empty() {
                padded[bc * lp + t] = past[bc * (k - 1) + t];
            }
        }
        for t in 0..l {
            padded[bc * lp + k - 1 + t] = x[bc * l + t];
        }
    }
    let mut y = vec![0.0; b * c * l];
    for bc in 0..b * c {
        let ch = bc % c;
        for t in 0..l {
            let mut s = if bias.is_empty() { 0.0 } else { bias[ch] };
            for j in 0..k {
                s += w[ch * k + j] * padded[bc * lp + t + j];
            }
            y[bc * l + t] = if silu { s / (1.0 + (-s).exp()) } else { s };
        }
    }
    let state: Vec<f64> = (0..b * c)
        .flat_map(|bc| padded[bc * lp + l..(bc + 1) * lp].to_vec())
        .collect();
    vec![(vec![b, c, l], y), (vec![b, c, k - 1], state)]
}

#[test]
fn causal_conv_with_state_every_form_with_gradients() {
    let (b, c, l) = (2, 3, 6);
    for (k, bias, past, act) in [
        (4, false, false, "none"),
        (4, true, true, "silu"),
        (3, true, false, "swish"),
        (2, false, true, "none"),
        (1, true, false, "none"),
        (5, false, true, "silu"),
    ] {
        let mut inputs = vec![
            ("input", Some(randn(&[b, c, l], 1))),
            ("weight", Some(randn(&[c, 1, k], 2))),
        ];
        inputs.push(if bias {
            ("bias", Some(randn(&[c], 3)))
        } else {
            ("", None)
        });
        if past {
            inputs.push(("past", Some(randn(&[b, c, k - 1], 4))));
        }
        let mut case =
            Case::new("CausalConvWithState", 27, inputs).with(vec![str_attr("activation", act)]);
        case.outputs = vec!["y", "state"];
        // The gradients of y alone (an omitted state output is not computed).
        let mut y_only = case.clone();
        y_only.outputs = vec!["y"];
        let silu = act != "none";
        let reference = |v: &[Vec<f64>]| {
            let mut v = v.to_vec();
            v.resize(4, vec![]);
            causal_conv_ref(&v, b, c, l, k, silu)
        };
        let what = format!("CausalConvWithState k {k} bias {bias} past {past} {act}");
        check_case(&what, &case, &BOTH, 1e-5, reference);
        let mut wrt = vec![0, 1];
        if bias {
            wrt.push(2);
        }
        if past {
            wrt.push(3);
        }
        check_grads(&what, &y_only, &wrt, 9, reference);
    }
}

// ---------------------------------------------------------------------------------------
// ai.onnx.preview.training and ai.onnx.ml

/// One optimizer step of `op` on two tensors, by its definition.
fn optimizer_ref(op: &str, v: &[Vec<f64>], shapes: &[Vec<usize>], attrs: &[f64]) -> Expected {
    let (r, t) = (v[0][0], v[1][0]);
    let per = if op == "Adam" { 4 } else { 3 };
    let count = (v.len() - 2) / per;
    let mut outs: Vec<Vec<(Vec<usize>, Vec<f64>)>> = vec![vec![]; per - 1];
    for k in 0..count {
        let inp = |j: usize| &v[2 + j * count + k];
        let (x, g) = (inp(0), inp(1));
        let shape = shapes[k].clone();
        let norm = attrs[0];
        let g: Vec<f64> = x.iter().zip(g).map(|(x, g)| norm * x + g).collect();
        match op {
            "Adagrad" => {
                let (decay, eps) = (attrs[1], attrs[2]);
                let rate = r / (1.0 + t * decay);
                let h: Vec<f64> = inp(2).iter().zip(&g).map(|(h, g)| h + g * g).collect();
                let xn = (0..x.len())
                    .map(|i| x[i] - rate * g[i] / (h[i].sqrt() + eps))
                    .collect();
                outs[0].push((shape.clone(), xn));
                outs[1].push((shape, h));
            }
            "Momentum" => {
                let (alpha, beta, nesterov) = (attrs[1], attrs[2], attrs[3] != 0.0);
                let beta = if t > 0.0 { beta } else { 1.0 };
                let vn: Vec<f64> = inp(2)
                    .iter()
                    .zip(&g)
                    .map(|(v, g)| alpha * v + beta * g)
                    .collect();
                let xn = (0..x.len())
                    .map(|i| {
                        let d = if nesterov {
                            g[i] + alpha * vn[i]
                        } else {
                            vn[i]
                        };
                        x[i] - r * d
                    })
                    .collect();
                outs[0].push((shape.clone(), xn));
                outs[1].push((shape, vn));
            }
            _ => {
                let (alpha, beta, eps, post) = (attrs[1], attrs[2], attrs[3], attrs[4]);
                let vn: Vec<f64> = inp(2)
                    .iter()
                    .zip(&g)
                    .map(|(v, g)| alpha * v + (1.0 - alpha) * g)
                    .collect();
                let hn: Vec<f64> = inp(3)
                    .iter()
                    .zip(&g)
                    .map(|(h, g)| beta * h + (1.0 - beta) * g * g)
                    .collect();
                let rate = if t > 0.0 {
                    r * (1.0 - beta.powf(t)).sqrt() / (1.0 - alpha.powf(t))
                } else {
                    r
                };
                let xn = (0..x.len())
                    .map(|i| (1.0 - post) * (x[i] - rate * vn[i] / (hn[i].sqrt() + eps)))
                    .collect();
                outs[0].push((shape.clone(), xn));
                outs[1].push((shape.clone(), vn));
                outs[2].push((shape, hn));
            }
        }
    }
    outs.into_iter().flatten().collect()
}

#[test]
fn optimizers_of_the_training_domain() {
    let shapes = [vec![3usize, 2], vec![4]];
    // Attribute values as f32 (the model stores them so), each optimizer at T = 0 and 3.
    let f = |v: f32| v as f64;
    let cases: [(&str, Vec<graphrun::onnx::proto::AttributeProto>, Vec<f64>); 4] = [
        (
            "Adagrad",
            vec![
                float_attr("decay_factor", 0.1),
                float_attr("epsilon", 1e-5),
                float_attr("norm_coefficient", 0.01),
            ],
            vec![f(0.01), f(0.1), f(1e-5)],
        ),
        (
            "Momentum",
            vec![
                float_attr("alpha", 0.9),
                float_attr("beta", 0.5),
                float_attr("norm_coefficient", 0.02),
                str_attr("mode", "standard"),
            ],
            vec![f(0.02), f(0.9), f(0.5), 0.0],
        ),
        (
            "Momentum",
            vec![
                float_attr("alpha", 0.8),
                float_attr("beta", 0.7),
                float_attr("norm_coefficient", 0.0),
                str_attr("mode", "nesterov"),
            ],
            vec![0.0, f(0.8), f(0.7), 1.0],
        ),
        (
            "Adam",
            vec![
                float_attr("alpha", 0.85),
                float_attr("beta", 0.99),
                float_attr("epsilon", 1e-4),
                float_attr("norm_coefficient", 0.01),
                float_attr("norm_coefficient_post", 0.05),
            ],
            vec![f(0.01), f(0.85), f(0.99), f(1e-4), f(0.05)],
        ),
    ];
    const NAMES: [[&str; 2]; 4] = [["x1", "x2"], ["g1", "g2"], ["v1", "v2"], ["h1", "h2"]];
    const OUTS: [[&str; 2]; 3] = [
        ["x1_new", "x2_new"],
        ["s1_new", "s2_new"],
        ["h1_new", "h2_new"],
    ];
    for (op, attrs, vals) in &cases {
        let per = if *op == "Adam" { 4 } else { 3 };
        for t in [0i64, 3] {
            let mut inputs = vec![
                ("r", Some(Tensor::scalar(0.1f32))),
                ("t", Some(Tensor::scalar(t))),
            ];
            for (j, names) in NAMES.iter().take(per).enumerate() {
                for (k, name) in names.iter().enumerate() {
                    let v = randn(&shapes[k], 10 + (j * 2 + k) as u64);
                    // Squared-gradient accumulators are not negative.
                    let v = if j == 3 || (j == 2 && *op == "Adagrad") {
                        Tensor::from_vec(
                            &shapes[k],
                            v.to_f64_vec().iter().map(|a| a.abs()).collect::<Vec<f64>>(),
                        )
                        .unwrap()
                    } else {
                        v
                    };
                    inputs.push((name, Some(v)));
                }
            }
            let mut case = Case::new(op, 22, inputs).with(attrs.clone());
            case.domain = "ai.onnx.preview.training";
            case.outputs = OUTS.iter().take(per - 1).flatten().copied().collect();
            let reference = |v: &[Vec<f64>]| optimizer_ref(op, v, &shapes, vals);
            check_case(&format!("{op} t {t}"), &case, &BOTH, 1e-5, reference);
        }
    }
}

#[test]
fn binarizer_and_array_feature_extractor() {
    let x = randn(&[3, 4, 5], 2);
    let mut case =
        Case::new("Binarizer", 22, vec![("x", Some(x))]).with(vec![float_attr("threshold", 0.3)]);
    case.domain = "ai.onnx.ml";
    let th = 0.3f32 as f64;
    check_case("Binarizer", &case, &BOTH, 0.0, |v| {
        vec![(
            vec![3, 4, 5],
            v[0].iter().map(|&a| (a > th) as i32 as f64).collect(),
        )]
    });
    for shape in [vec![3usize, 4], vec![5], vec![2, 3, 4]] {
        let x = randn(&shape, 3);
        let idx = i64s(&[1, 3], &[2, 0, 2]);
        let mut case = Case::new(
            "ArrayFeatureExtractor",
            22,
            vec![("x", Some(x)), ("i", Some(idx))],
        );
        case.domain = "ai.onnx.ml";
        let last = *shape.last().unwrap();
        let rows = shape.iter().product::<usize>() / last;
        let mut out_shape = if shape.len() == 1 {
            vec![1]
        } else {
            shape[..shape.len() - 1].to_vec()
        };
        out_shape.push(3);
        check_case(
            &format!("ArrayFeatureExtractor {shape:?}"),
            &case,
            &BOTH,
            0.0,
            |v| {
                let y = (0..rows)
                    .flat_map(|r| [2, 0, 2].map(|i| v[0][r * last + i]))
                    .collect();
                vec![(out_shape.clone(), y)]
            },
        );
    }
}

#[test]
fn optimizer_refusals_say_why() {
    let s = Tensor::scalar(0.1f32);
    let t = Tensor::scalar(1i64);
    let x = Tensor::zeros(DType::F32, &[2]);
    let infos = |names: &[&str]| -> Vec<_> {
        names
            .iter()
            .map(|n| match *n {
                "r" => input_like(n, &s),
                "t" => input_like(n, &t),
                _ => input_like(n, &x),
            })
            .collect()
    };
    let import = |op: &str, ins: &[&str], outs: &[&str], attrs| {
        let n = node(op, "ai.onnx.preview.training", ins, outs, attrs);
        import_one_node(n, 22, infos(ins), vec![])
            .unwrap_err()
            .to_string()
    };
    let e = import(
        "Momentum",
        &["r", "t", "x", "g", "v"],
        &["x_new", "v_new"],
        vec![
            float_attr("alpha", 0.9),
            float_attr("beta", 1.0),
            float_attr("norm_coefficient", 0.0),
        ],
    );
    assert!(e.contains("'mode' is required"), "{e}");
    let e = import("Adagrad", &["r", "t", "x", "g"], &["x_new"], vec![]);
    assert!(
        e.contains("takes R, T and 3 inputs per updated tensor, got 4"),
        "{e}"
    );
}

// ---------------------------------------------------------------------------------------
// MaxUnpool and TensorScatter

#[test]
fn max_unpool_with_and_without_output_shape() {
    // X [1, 2, 2, 3] pooled by a 2×2 window, stride 2, from a [1, 2, 4, 6] image; each
    // value goes back to one distinct position of its channel's plane.
    let (n, c, h, w) = (1usize, 2usize, 2usize, 3usize);
    let (oh, ow) = (4usize, 6usize);
    let x = randn(&[n, c, h, w], 5);
    let mut idx = vec![];
    for ch in 0..n * c {
        for i in 0..h {
            for j in 0..w {
                let (di, dj) = ((i + j + ch) % 2, (i * 3 + j + ch) % 2);
                idx.push((ch * oh * ow + (2 * i + di) * ow + 2 * j + dj) as i64);
            }
        }
    }
    let idx_t = i64s(&[n, c, h, w], &idx);
    let attrs = vec![
        ints_attr("kernel_shape", &[2, 2]),
        ints_attr("strides", &[2, 2]),
    ];
    for out_shape in [None, Some([1i64, 2, 5, 7])] {
        let mut inputs = vec![("x", Some(x.clone())), ("i", Some(idx_t.clone()))];
        if let Some(s) = out_shape {
            inputs.push(("shape", Some(i64s(&[4], &s))));
        }
        let case = Case::new("MaxUnpool", 22, inputs).with(attrs.clone());
        let (fh, fw) = out_shape.map_or((oh, ow), |s| (s[2] as usize, s[3] as usize));
        let reference = |v: &[Vec<f64>]| {
            let mut y = vec![0.0; n * c * oh * ow];
            for (k, &i) in idx.iter().enumerate() {
                y[i as usize] = v[0][k];
            }
            // Placed at the start of each axis of the (larger) output shape.
            let mut out = vec![0.0; n * c * fh * fw];
            for ch in 0..n * c {
                for i in 0..oh {
                    for j in 0..ow {
                        out[(ch * fh + i) * fw + j] = y[(ch * oh + i) * ow + j];
                    }
                }
            }
            vec![(vec![n, c, fh, fw], out)]
        };
        let what = format!("MaxUnpool to {out_shape:?}");
        check_case(&what, &case, &BOTH, 1e-6, reference);
        check_grads(&what, &case, &[0], 6, reference);
    }
}

fn tensor_scatter_ref(
    past: &[f64],
    ps: &[usize],
    upd: &[f64],
    us: &[usize],
    w: Option<&[f64]>,
    axis: usize,
    circular: bool,
) -> Expected {
    let mut out = past.to_vec();
    let inner: usize = ps[axis + 1..].iter().product();
    let outer: usize = ps[..axis].iter().product();
    let rows_per_batch = outer / ps[0];
    let (lc, lu) = (ps[axis], us[axis]);
    for o in 0..outer {
        let start = w.map_or(0, |w| w[o / rows_per_batch] as usize);
        for s in 0..lu {
            let mut p = start + s;
            if circular {
                p %= lc;
            }
            for i in 0..inner {
                out[(o * lc + p) * inner + i] = upd[(o * lu + s) * inner + i];
            }
        }
    }
    vec![(ps.to_vec(), out)]
}

#[test]
fn tensor_scatter_linear_and_circular_with_gradients() {
    for (ps, us, axis, write, circular) in [
        (
            vec![2usize, 3, 6, 4],
            vec![2usize, 3, 2, 4],
            -2i64,
            Some(vec![1i64, 4]),
            false,
        ),
        (
            vec![2, 3, 6, 4],
            vec![2, 3, 3, 4],
            -2,
            Some(vec![5, 2]),
            true,
        ),
        (vec![3, 5, 2], vec![3, 2, 2], 1, None, false),
        (vec![2, 7], vec![2, 3], -1, Some(vec![0, 6]), true),
    ] {
        let mut inputs = vec![
            ("past", Some(randn(&ps, 1))),
            ("update", Some(randn(&us, 2))),
        ];
        if let Some(w) = &write {
            inputs.push(("write", Some(i64s(&[w.len()], w))));
        }
        let mode = if circular { "circular" } else { "linear" };
        let case = Case::new("TensorScatter", 24, inputs)
            .with(vec![str_attr("mode", mode), int_attr("axis", axis)]);
        let ax = if axis < 0 {
            axis + ps.len() as i64
        } else {
            axis
        } as usize;
        let reference = |v: &[Vec<f64>]| {
            let w = write.as_ref().map(|_| v[2].as_slice());
            tensor_scatter_ref(&v[0], &ps, &v[1], &us, w, ax, circular)
        };
        let what = format!("TensorScatter {ps:?} {us:?} axis {axis} {mode} from {write:?}");
        check_case(&what, &case, &BOTH, 0.0, reference);
        check_grads(&what, &case, &[0, 1], 8, reference);
    }
}

// ---------------------------------------------------------------------------------------
// DFT and STFT

/// The DFT of `x` ([..., 1|2], the signal along `axis`) by its definition: forward or
/// inverse (÷N), one-sided forward bins, and irfft (inverse of a one-sided spectrum).
fn dft_ref(
    x: &[f64],
    shape: &[usize],
    axis: usize,
    inverse: bool,
    onesided: bool,
    size: Option<usize>,
) -> Expected {
    let r = shape.len();
    let cw = shape[r - 1];
    let len = shape[axis];
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..r - 1].iter().product();
    let n = size.unwrap_or(if inverse && onesided {
        2 * (len - 1)
    } else {
        len
    });
    let real_out = inverse && onesided;
    let bins = if !inverse && onesided { n / 2 + 1 } else { n };
    let ow = if real_out { 1 } else { 2 };
    let mut y = vec![0.0; outer * bins * inner * ow];
    let at = |o: usize, p: usize, i: usize, c: usize| -> f64 {
        if p >= len || c >= cw {
            0.0
        } else {
            x[((o * len + p) * inner + i) * cw + c]
        }
    };
    for o in 0..outer {
        for i in 0..inner {
            for k in 0..bins {
                let (mut re, mut im) = (0.0, 0.0);
                if real_out {
                    // Hermitian extension of the first n/2 + 1 bins.
                    for p in 0..n {
                        let (a, b) = if p <= n / 2 {
                            (at(o, p, i, 0), at(o, p, i, 1))
                        } else {
                            (at(o, n - p, i, 0), -at(o, n - p, i, 1))
                        };
                        let th = 2.0 * std::f64::consts::PI * (k * p) as f64 / n as f64;
                        re += a * th.cos() - b * th.sin();
                    }
                    re /= n as f64;
                } else {
                    let sign = if inverse { 1.0 } else { -1.0 };
                    for p in 0..n {
                        let (a, b) = (at(o, p, i, 0), at(o, p, i, 1));
                        let th = sign * 2.0 * std::f64::consts::PI * (k * p) as f64 / n as f64;
                        re += a * th.cos() - b * th.sin();
                        im += a * th.sin() + b * th.cos();
                    }
                    if inverse {
                        re /= n as f64;
                        im /= n as f64;
                    }
                }
                let base = ((o * bins + k) * inner + i) * ow;
                y[base] = re;
                if !real_out {
                    y[base + 1] = im;
                }
            }
        }
    }
    let mut s = shape.to_vec();
    s[axis] = bins;
    s[r - 1] = ow;
    vec![(s, y)]
}

/// A DFT case: (x shape, axis, inverse, onesided, dft_length, opset: 19 writes axis as an
/// attribute, 20 feeds it).
type DftCase = (&'static [usize], i64, bool, bool, Option<usize>, i64);

#[test]
fn dft_forward_inverse_onesided_and_lengths_with_gradients() {
    let cases: [DftCase; 8] = [
        (&[2, 5, 3, 1], 1, false, false, None, 19),
        (&[2, 4, 6, 2], -2, false, true, None, 20),
        (&[2, 4, 6, 2], 1, false, true, Some(7), 20),
        (&[1, 4, 3, 2], 1, true, false, Some(6), 19),
        (&[1, 4, 3, 2], 1, true, true, None, 20),
        (&[1, 4, 3, 2], 2, true, true, Some(5), 20),
        (&[3, 7, 1], 1, false, false, Some(4), 20),
        (&[2, 3, 4, 5, 2], 2, false, false, None, 20),
    ];
    for (k, &(shape, axis, inverse, onesided, size, opset)) in cases.iter().enumerate() {
        let r = shape.len() as i64;
        let ax = if axis < 0 { axis + r } else { axis } as usize;
        let mut inputs = vec![("x", Some(randn(shape, 40 + k as u64)))];
        inputs.push(match size {
            Some(s) => ("len", Some(Tensor::scalar(s as i64))),
            None => ("", None),
        });
        let mut attrs = vec![
            int_attr("inverse", inverse as i64),
            int_attr("onesided", onesided as i64),
        ];
        if opset < 20 {
            attrs.push(int_attr("axis", axis));
        } else {
            inputs.push(("axis", Some(Tensor::scalar(axis))));
        }
        let case = Case::new("DFT", opset, inputs).with(attrs);
        let reference = |v: &[Vec<f64>]| dft_ref(&v[0], shape, ax, inverse, onesided, size);
        let what = format!("DFT {shape:?} axis {axis} inverse {inverse} onesided {onesided} length {size:?} opset {opset}");
        check_case(&what, &case, &BOTH, 1e-5, reference);
        check_grads(&what, &case, &[0], 50 + k as u64, reference);
    }
}

#[test]
fn stft_with_and_without_window() {
    // Real signal, Hann-like window, one-sided (the default); complex signal, no window,
    // both sides.
    let (b, l, step, fl) = (2usize, 20usize, 3usize, 8usize);
    let sig = randn(&[b, l, 1], 60);
    let win = randn(&[fl], 61);
    let case = Case::new(
        "STFT",
        17,
        vec![
            ("signal", Some(sig)),
            ("step", Some(Tensor::scalar(step as i64))),
            ("window", Some(win)),
        ],
    );
    let frames = (l - fl) / step + 1;
    let frame_ref =
        |v: &[Vec<f64>], cw: usize, fl: usize, step: usize, window: bool, onesided: bool| {
            let l = v[0].len() / (b * cw);
            let frames = (l - fl) / step + 1;
            let mut out = vec![];
            let mut shape = vec![];
            for bb in 0..b {
                for f in 0..frames {
                    let mut fr = vec![0.0; fl * cw];
                    for t in 0..fl {
                        let w = if window { v[2][t] } else { 1.0 };
                        for c in 0..cw {
                            fr[t * cw + c] = v[0][(bb * l + f * step + t) * cw + c] * w;
                        }
                    }
                    let (s, y) = dft_ref(&fr, &[1, fl, cw], 1, false, onesided, None).remove(0);
                    shape = s;
                    out.extend(y);
                }
            }
            vec![(vec![b, frames, shape[1], 2], out)]
        };
    let reference = |v: &[Vec<f64>]| frame_ref(v, 1, fl, step, true, true);
    check_case("STFT windowed", &case, &BOTH, 1e-5, reference);
    check_grads("STFT windowed", &case, &[0, 2], 62, reference);
    assert_eq!(frames, 5);
    let sig = randn(&[b, 16, 2], 63);
    let case = Case::new(
        "STFT",
        17,
        vec![
            ("signal", Some(sig)),
            ("step", Some(Tensor::scalar(4i64))),
            ("", None),
            ("flen", Some(Tensor::scalar(6i64))),
        ],
    )
    .with(vec![int_attr("onesided", 0)]);
    let reference = |v: &[Vec<f64>]| frame_ref(v, 2, 6, 4, false, false);
    check_case("STFT complex", &case, &BOTH, 1e-5, reference);
    check_grads("STFT complex", &case, &[0], 64, reference);
}

// ---------------------------------------------------------------------------------------
// DeformConv

/// One DeformConv setting: X [n, c, h, w], W [m, c/group, kh, kw].
struct Deform {
    x: [usize; 4],
    m: usize,
    k: [usize; 2],
    group: usize,
    og: usize,
    strides: [usize; 2],
    dilations: [usize; 2],
    /// top, left, bottom, right
    pads: [usize; 4],
    bias: bool,
    mask: bool,
}

impl Deform {
    fn out(&self) -> [usize; 2] {
        let o = |i: usize| {
            let span = (self.k[i] - 1) * self.dilations[i] + 1;
            (self.x[2 + i] + self.pads[i] + self.pads[i + 2] - span) / self.strides[i] + 1
        };
        [o(0), o(1)]
    }
}

/// X[n, c] at (py, px), bilinear, each corner outside the image counting 0.
fn bilinear(x: &[f64], h: usize, w: usize, base: usize, py: f64, px: f64) -> f64 {
    let (y0, x0) = (py.floor(), px.floor());
    let (fy, fx) = (py - y0, px - x0);
    let mut v = 0.0;
    for (dy, wy) in [(0.0, 1.0 - fy), (1.0, fy)] {
        for (dx, wx) in [(0.0, 1.0 - fx), (1.0, fx)] {
            let (yy, xx) = (y0 + dy, x0 + dx);
            if yy >= 0.0 && xx >= 0.0 && yy < h as f64 && xx < w as f64 {
                v += wy * wx * x[base + yy as usize * w + xx as usize];
            }
        }
    }
    v
}

/// DeformConv by its definition, per output element (inputs X, W, offset, B, mask).
fn deform_ref(d: &Deform, v: &[Vec<f64>]) -> Expected {
    let [n, c, h, w] = d.x;
    let [kh, kw] = d.k;
    let [oh, ow] = d.out();
    let (k, cw, cog) = (kh * kw, c / d.group, c / d.og);
    let mut y = vec![0.0; n * d.m * oh * ow];
    for (i, out) in y.iter_mut().enumerate() {
        let (b, o, r, q) = (
            i / (d.m * oh * ow),
            i / (oh * ow) % d.m,
            i / ow % oh,
            i % ow,
        );
        let grp = o / (d.m / d.group);
        for ci in 0..cw {
            let ic = grp * cw + ci;
            let g = ic / cog;
            for t in 0..k {
                let (u, s) = (t / kw, t % kw);
                let at = |ch: usize| ((b * d.og * k * 2 + ch) * oh + r) * ow + q;
                let oy = v[2][at(g * k * 2 + t * 2)];
                let ox = v[2][at(g * k * 2 + t * 2 + 1)];
                let py = (r * d.strides[0] + u * d.dilations[0]) as f64 - d.pads[0] as f64 + oy;
                let px = (q * d.strides[1] + s * d.dilations[1]) as f64 - d.pads[1] as f64 + ox;
                let mut val = bilinear(&v[0], h, w, (b * c + ic) * h * w, py, px);
                if d.mask {
                    val *= v[4][((b * d.og * k + g * k + t) * oh + r) * ow + q];
                }
                *out += v[1][((o * cw + ci) * kh + u) * kw + s] * val;
            }
        }
        if d.bias {
            *out += v[3][o];
        }
    }
    vec![(vec![n, d.m, oh, ow], y)]
}

/// DeformConv on every backend against the definition over groups, offset groups,
/// strides, dilations, asymmetric pads, a one-row image, masks and biases; offsets that
/// move taps outside the image; gradients of X, W, the offsets, B and the mask.
#[test]
fn deform_conv_on_every_backend_with_gradients() {
    let base = Deform {
        x: [2, 4, 5, 6],
        m: 4,
        k: [3, 3],
        group: 2,
        og: 2,
        strides: [1, 1],
        dilations: [1, 1],
        pads: [1, 1, 1, 1],
        bias: true,
        mask: true,
    };
    let settings = [
        base,
        Deform {
            x: [1, 3, 6, 7],
            m: 2,
            k: [2, 3],
            group: 1,
            og: 1,
            strides: [2, 1],
            dilations: [2, 1],
            pads: [1, 0, 0, 2],
            bias: false,
            mask: false,
        },
        Deform {
            x: [1, 2, 1, 5],
            m: 3,
            k: [1, 2],
            group: 1,
            og: 2,
            strides: [1, 2],
            dilations: [1, 1],
            pads: [0, 1, 0, 1],
            bias: true,
            mask: true,
        },
    ];
    for (s, d) in settings.iter().enumerate() {
        let [n, c, _, _] = d.x;
        let [oh, ow] = d.out();
        let k = d.k[0] * d.k[1];
        let seed = 40 + 10 * s as u64;
        let ints = |v: &[usize]| v.iter().map(|&a| a as i64).collect::<Vec<_>>();
        let case = Case::new(
            "DeformConv",
            19,
            vec![
                ("x", Some(rand(&d.x, seed, -1.0, 1.0))),
                (
                    "w",
                    Some(rand(
                        &[d.m, c / d.group, d.k[0], d.k[1]],
                        seed + 1,
                        -1.0,
                        1.0,
                    )),
                ),
                (
                    "offset",
                    Some(rand(&[n, d.og * k * 2, oh, ow], seed + 2, -2.0, 2.0)),
                ),
                ("b", d.bias.then(|| rand(&[d.m], seed + 3, -1.0, 1.0))),
                (
                    "mask",
                    d.mask
                        .then(|| rand(&[n, d.og * k, oh, ow], seed + 4, 0.0, 1.0)),
                ),
            ],
        )
        .with(vec![
            ints_attr("strides", &ints(&d.strides)),
            ints_attr("dilations", &ints(&d.dilations)),
            ints_attr("pads", &ints(&d.pads)),
            int_attr("group", d.group as i64),
            int_attr("offset_group", d.og as i64),
        ]);
        let mut case = case;
        if !d.mask {
            case.inputs.truncate(if d.bias { 4 } else { 3 });
        }
        let what = format!("DeformConv setting {s}");
        check_case(&what, &case, &BOTH, 1e-5, |v| deform_ref(d, v));
        let wrt: Vec<usize> = (0..case.inputs.len())
            .filter(|&i| case.inputs[i].1.is_some())
            .collect();
        check_grads(&what, &case, &wrt, seed + 5, |v| deform_ref(d, v));
    }
}

// ---------------------------------------------------------------------------------------
// RoiAlign

/// One sample of RoiAlign as ONNX's reference takes it: its four taps' weighted values.
fn roi_taps(x: &[f64], base: usize, h: usize, w: usize, y: f64, xx: f64) -> [f64; 4] {
    if y < -1.0 || y > h as f64 || xx < -1.0 || xx > w as f64 {
        return [0.0; 4];
    }
    let axis = |v: f64, size: usize| {
        let v = v.max(0.0);
        let low = v.floor() as usize;
        if low >= size - 1 {
            (size - 1, size - 1, 0.0)
        } else {
            (low, low + 1, v - low as f64)
        }
    };
    let (y0, y1, ly) = axis(y, h);
    let (x0, x1, lx) = axis(xx, w);
    let at = |yy: usize, xc: usize| x[base + yy * w + xc];
    [
        (1.0 - ly) * (1.0 - lx) * at(y0, x0),
        (1.0 - ly) * lx * at(y0, x1),
        ly * (1.0 - lx) * at(y1, x0),
        ly * lx * at(y1, x1),
    ]
}

/// RoiAlign by ONNX's reference (inputs X [n, c, h, w], rois [r, 4], batch_indices).
fn roi_align_ref(
    xs: [usize; 4],
    out: [usize; 2],
    sr: usize,
    scale: f64,
    half: bool,
    max: bool,
    v: &[Vec<f64>],
) -> Expected {
    let [_, c, h, w] = xs;
    let [oh, ow] = out;
    let r = v[1].len() / 4;
    let mut y = vec![0.0; r * c * oh * ow];
    for k in 0..r {
        let off = if half { 0.5 } else { 0.0 };
        let q = |i: usize| v[1][k * 4 + i] * scale - off;
        let (sx, sy, ex, ey) = (q(0), q(1), q(2), q(3));
        let (mut rw, mut rh) = (ex - sx, ey - sy);
        if !half {
            rw = rw.max(1.0);
            rh = rh.max(1.0);
        }
        let (bh, bw) = (rh / oh as f64, rw / ow as f64);
        let b = v[2][k] as usize;
        for ch in 0..c {
            for ph in 0..oh {
                for pw in 0..ow {
                    let mut acc: Option<f64> = None;
                    for iy in 0..sr {
                        let yy = sy + ph as f64 * bh + (iy as f64 + 0.5) * bh / sr as f64;
                        for ix in 0..sr {
                            let xx = sx + pw as f64 * bw + (ix as f64 + 0.5) * bw / sr as f64;
                            let t = roi_taps(&v[0], (b * c + ch) * h * w, h, w, yy, xx);
                            let val = if max {
                                t.iter().cloned().fold(f64::MIN, f64::max)
                            } else {
                                t.iter().sum()
                            };
                            acc = Some(match (acc, max) {
                                (None, _) => val,
                                (Some(a), true) => a.max(val),
                                (Some(a), false) => a + val,
                            });
                        }
                    }
                    let a = acc.unwrap_or(0.0);
                    y[((k * c + ch) * oh + ph) * ow + pw] =
                        if max { a } else { a / (sr * sr) as f64 };
                }
            }
        }
    }
    vec![(vec![r, c, oh, ow], y)]
}

/// RoiAlign on every backend against ONNX's reference: both coordinate modes, avg and
/// max, regions reaching past the image and smaller than a pixel, several batch entries;
/// gradients of X (and, for avg, of the regions).
#[test]
fn roi_align_on_every_backend_with_gradients() {
    let xs = [2usize, 3, 7, 9];
    let rois = Tensor::from_vec(
        &[4, 4],
        vec![
            0.5f64, 1.2, 6.3, 5.9, // inside
            -2.1, -1.7, 3.4, 2.2, // past the top left
            5.5, 3.3, 10.6, 8.8, // past the bottom right
            2.2, 2.3, 2.6, 2.5, // under a pixel
        ],
    )
    .unwrap();
    let batch = Tensor::from_vec(&[4], vec![1i64, 0, 1, 0]).unwrap();
    for (half, max, sr, out, scale) in [
        (true, false, 2, [3, 4], 1.0f32),
        (false, false, 1, [2, 2], 0.5),
        (true, true, 3, [2, 3], 1.0),
        (false, true, 2, [4, 2], 1.0),
    ] {
        let mode = if max { "max" } else { "avg" };
        let ctm = if half {
            "half_pixel"
        } else {
            "output_half_pixel"
        };
        let case = Case::new(
            "RoiAlign",
            16,
            vec![
                ("x", Some(rand(&xs, 7, -1.0, 1.0))),
                ("rois", Some(rois.clone())),
                ("batch", Some(batch.clone())),
            ],
        )
        .with(vec![
            str_attr("coordinate_transformation_mode", ctm),
            str_attr("mode", mode),
            int_attr("output_height", out[0] as i64),
            int_attr("output_width", out[1] as i64),
            int_attr("sampling_ratio", sr as i64),
            float_attr("spatial_scale", scale),
        ]);
        let reference = |v: &[Vec<f64>]| roi_align_ref(xs, out, sr, scale as f64, half, max, v);
        let what = format!("RoiAlign {ctm} {mode} sr {sr}");
        check_case(&what, &case, &BOTH, 1e-5, reference);
        let wrt: &[usize] = if max { &[0] } else { &[0, 1] };
        check_grads(&what, &case, wrt, 3, reference);
    }
}

/// The determinant by Laplace expansion along the first row (the definition, no
/// elimination), for the small matrices of the test.
fn laplace_det(a: &[f64], m: usize) -> f64 {
    if m == 1 {
        return a[0];
    }
    (0..m)
        .map(|c| {
            let minor: Vec<f64> = (1..m)
                .flat_map(|r| (0..m).filter(move |&j| j != c).map(move |j| (r, j)))
                .map(|(r, j)| a[r * m + j])
                .collect();
            let sign = if c % 2 == 0 { 1.0 } else { -1.0 };
            sign * a[c] * laplace_det(&minor, m - 1)
        })
        .sum()
}

/// Det of single matrices and batches against the Laplace expansion, on every backend,
/// with matrices that need row swaps (a zero leading entry) and, for the values only, a
/// singular one (a column of zeros, where the elimination meets a zero pivot); gradients
/// against finite differences where the matrices are invertible.
#[test]
fn det_on_every_backend_with_gradients() {
    for (shape, seed) in [
        (vec![2usize, 2], 3u64),
        (vec![3, 3, 3], 5),
        (vec![2, 4, 4], 8),
    ] {
        let m = shape[shape.len() - 1];
        let batch: usize = shape[..shape.len() - 2].iter().product();
        let case_of = |singular: bool| {
            let mut x = rand(&shape, seed, -1.0, 1.0).to_f64_vec();
            x[0] = 0.0;
            if singular {
                for r in 0..m {
                    x[(batch - 1) * m * m + r * m + 1] = 0.0;
                }
            }
            Case::new(
                "Det",
                11,
                vec![("x", Some(Tensor::from_vec(&shape, x).unwrap()))],
            )
        };
        let out: Vec<usize> = shape[..shape.len() - 2].to_vec();
        let reference = |v: &[Vec<f64>]| {
            let d = (0..batch)
                .map(|b| laplace_det(&v[0][b * m * m..][..m * m], m))
                .collect();
            vec![(out.clone(), d)]
        };
        let what = format!("Det {shape:?}");
        check_case(&what, &case_of(false), &BOTH, 1e-5, reference);
        check_case(
            &format!("{what} singular"),
            &case_of(true),
            &BOTH,
            1e-5,
            reference,
        );
        check_grads(&what, &case_of(false), &[0], 2, reference);
    }
}
