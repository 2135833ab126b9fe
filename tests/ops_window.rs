//! Convolutions and pools (Conv, ConvTranspose, MaxPool with and without Indices, AveragePool, LpPool,
//! GlobalLpPool, Col2Im) imported from one-node ONNX models, on every backend in f32 and
//! (where the backend computes it) f64, against direct-loop float64 references written
//! here from ONNX's definitions, over a grid of ranks, strides, dilations, pads, auto_pad,
//! ceil_mode and groups; gradients against central finite differences of the references.

mod common;
#[path = "common/onnx_case.rs"]
mod onnx_case;
#[path = "common/onnx_model.rs"]
mod onnx_model;

use common::*;
use graphrun::onnx::proto::AttributeProto;
use graphrun::{DType, Session, SessionOptions, Tensor};
use onnx_case::*;
use onnx_model::*;

/// Where windows sit on an image, by ONNX's definitions.
#[derive(Clone, Debug)]
struct Geo {
    k: Vec<usize>,
    s: Vec<usize>,
    d: Vec<usize>,
    pb: Vec<usize>,
    pe: Vec<usize>,
    out: Vec<usize>,
}

/// The window attributes of a case, as written in the model (empty: absent).
#[derive(Clone, Debug, Default)]
struct Win {
    strides: Vec<usize>,
    dilations: Vec<usize>,
    pads: Vec<usize>,
    auto_pad: &'static str,
    ceil: bool,
}

/// A window as written: strides, dilations, pads (empty: absent), auto_pad, ceil_mode.
fn win(
    strides: &[usize],
    dilations: &[usize],
    pads: &[usize],
    auto_pad: &'static str,
    ceil: bool,
) -> Win {
    Win {
        strides: strides.to_vec(),
        dilations: dilations.to_vec(),
        pads: pads.to_vec(),
        auto_pad,
        ceil,
    }
}

impl Win {
    fn attrs(&self) -> Vec<AttributeProto> {
        let ints = |v: &[usize]| v.iter().map(|&x| x as i64).collect::<Vec<_>>();
        let mut a = vec![];
        if !self.strides.is_empty() {
            a.push(ints_attr("strides", &ints(&self.strides)));
        }
        if !self.dilations.is_empty() {
            a.push(ints_attr("dilations", &ints(&self.dilations)));
        }
        if !self.pads.is_empty() {
            a.push(ints_attr("pads", &ints(&self.pads)));
        }
        if !self.auto_pad.is_empty() {
            a.push(str_attr("auto_pad", self.auto_pad));
        }
        if self.ceil {
            a.push(int_attr("ceil_mode", 1));
        }
        a
    }

    fn place(&self, spatial: &[usize], k: &[usize]) -> Geo {
        let r = k.len();
        let or = |v: &[usize], d: usize| if v.is_empty() { vec![d; r] } else { v.to_vec() };
        let (s, d) = (or(&self.strides, 1), or(&self.dilations, 1));
        let pads = if self.pads.is_empty() {
            vec![0; 2 * r]
        } else {
            self.pads.clone()
        };
        let (mut pb, mut pe, mut out) = (vec![0; r], vec![0; r], vec![0; r]);
        for i in 0..r {
            let span = (k[i] - 1) * d[i] + 1;
            match self.auto_pad {
                "SAME_UPPER" | "SAME_LOWER" => {
                    out[i] = spatial[i].div_ceil(s[i]);
                    let total = ((out[i] - 1) * s[i] + span).saturating_sub(spatial[i]);
                    let small = total / 2;
                    (pb[i], pe[i]) = if self.auto_pad == "SAME_UPPER" {
                        (small, total - small)
                    } else {
                        (total - small, small)
                    };
                }
                "VALID" => out[i] = (spatial[i] - span) / s[i] + 1,
                _ => {
                    (pb[i], pe[i]) = (pads[i], pads[r + i]);
                    let room = spatial[i] + pb[i] + pe[i] - span;
                    out[i] = room / s[i] + 1;
                    if self.ceil && !room.is_multiple_of(s[i]) {
                        out[i] += 1;
                        if (out[i] - 1) * s[i] >= spatial[i] + pb[i] {
                            out[i] -= 1;
                        }
                    }
                }
            }
        }
        Geo {
            k: k.to_vec(),
            s,
            d,
            pb,
            pe,
            out,
        }
    }
}

/// The input position (per axis, may be outside) of output `o`, kernel offset `j`.
fn at(g: &Geo, o: &[usize], j: &[usize]) -> Vec<i64> {
    (0..o.len())
        .map(|i| (o[i] * g.s[i] + j[i] * g.d[i]) as i64 - g.pb[i] as i64)
        .collect()
}

/// The flat offset of `p` in `dims` when inside.
fn inside(p: &[i64], dims: &[usize]) -> Option<usize> {
    let mut off = 0;
    for (&q, &n) in p.iter().zip(dims) {
        if q < 0 || q >= n as i64 {
            return None;
        }
        off = off * n + q as usize;
    }
    Some(off)
}

/// Conv by its definition: y[n, m, o] = b[m] + Σ_{c in m's group, j} x[n, c, o·s + j·d - pb]
/// · w[m, c - group start, j].
fn conv_ref(
    x: &[f64],
    xs: &[usize],
    w: &[f64],
    ws: &[usize],
    b: Option<&[f64]>,
    g: &Geo,
    groups: usize,
) -> Expected {
    let (n, c, m, cg) = (xs[0], xs[1], ws[0], ws[1]);
    let sp = &xs[2..];
    let hw: usize = sp.iter().product();
    let kk: usize = g.k.iter().product();
    let mg = m / groups;
    let shape = [vec![n, m], g.out.clone()].concat();
    let mut y = vec![];
    for ni in 0..n {
        for mi in 0..m {
            let grp = mi / mg;
            for o in indices(&g.out) {
                let mut acc = b.map_or(0.0, |b| b[mi]);
                for ci in 0..cg {
                    let ch = grp * cg + ci;
                    assert!(ch < c);
                    for (jk, j) in indices(&g.k).iter().enumerate() {
                        if let Some(off) = inside(&at(g, &o, j), sp) {
                            acc += x[(ni * c + ch) * hw + off] * w[(mi * cg + ci) * kk + jk];
                        }
                    }
                }
                y.push(acc);
            }
        }
    }
    vec![(shape, y)]
}

/// ConvTranspose by its definition: every x[n, c, i] · w[c, mi, j] lands on y[n, m,
/// i·s + j·d - pb] (m = c's group · M/G + mi), plus b[m].
#[allow(clippy::too_many_arguments)]
fn conv_transpose_ref(
    x: &[f64],
    xs: &[usize],
    w: &[f64],
    ws: &[usize],
    b: Option<&[f64]>,
    g: &Geo,
    out: &[usize],
    groups: usize,
) -> Expected {
    let (n, c, mg) = (xs[0], xs[1], ws[1]);
    let m = mg * groups;
    let sp = &xs[2..];
    let (hw, ohw): (usize, usize) = (sp.iter().product(), out.iter().product());
    let kk: usize = g.k.iter().product();
    let cgs = c / groups;
    let mut y = vec![0.0; n * m * ohw];
    for ni in 0..n {
        for ci in 0..c {
            let grp = ci / cgs;
            for (ii, i) in indices(sp).iter().enumerate() {
                for mi in 0..mg {
                    let mo = grp * mg + mi;
                    for (jk, j) in indices(&g.k).iter().enumerate() {
                        let q = at(g, i, j);
                        if let Some(off) = inside(&q, out) {
                            y[(ni * m + mo) * ohw + off] +=
                                x[(ni * c + ci) * hw + ii] * w[(ci * mg + mi) * kk + jk];
                        }
                    }
                }
            }
        }
    }
    if let Some(b) = b {
        for (k, v) in y.iter_mut().enumerate() {
            *v += b[(k / ohw) % m];
        }
    }
    vec![([vec![n, m], out.to_vec()].concat(), y)]
}

#[derive(Clone, Copy, PartialEq)]
enum Pool {
    Max,
    Avg { include_pad: bool },
    Lp(f64),
}

/// Pools by ONNX's definitions: over the window's positions inside the padded extent
/// (ceil_mode's reads past it count for nothing); the max and the Lp norm over the image's
/// elements, the average over them (and the padding when include_pad). The max's index is
/// the first one in window order, flat in x.
fn pool_ref(kind: Pool, x: &[f64], xs: &[usize], g: &Geo) -> Expected {
    let (n, c) = (xs[0], xs[1]);
    let sp = &xs[2..];
    let hw: usize = sp.iter().product();
    let shape = [vec![n, c], g.out.clone()].concat();
    let (mut y, mut idx) = (vec![], vec![]);
    for plane in 0..n * c {
        for o in indices(&g.out) {
            let (mut best, mut arg, mut sum, mut count) = (f64::NEG_INFINITY, 0usize, 0.0, 0.0);
            for j in indices(&g.k) {
                let p = at(g, &o, &j);
                let extent = p
                    .iter()
                    .zip(sp)
                    .zip(&g.pe)
                    .all(|((&q, &s), &e)| q < (s + e) as i64);
                if !extent {
                    continue;
                }
                match inside(&p, sp) {
                    Some(off) => {
                        let v = x[plane * hw + off];
                        // The first maximum in window order; a NaN wins (the first).
                        if v > best || (v.is_nan() && !best.is_nan()) {
                            (best, arg) = (v, plane * hw + off);
                        }
                        sum += match kind {
                            Pool::Lp(pw) => v.abs().powf(pw),
                            _ => v,
                        };
                        count += 1.0;
                    }
                    None if kind == (Pool::Avg { include_pad: true }) => count += 1.0,
                    None => {}
                }
            }
            y.push(match kind {
                Pool::Max => best,
                Pool::Avg { .. } => sum / count,
                Pool::Lp(pw) => sum.powf(1.0 / pw),
            });
            idx.push(arg as f64);
        }
    }
    let mut out = vec![(shape.clone(), y)];
    if kind == Pool::Max {
        out.push((shape, idx));
    }
    out
}

fn f(shape: &[usize], seed: u64) -> Tensor {
    randn(shape, seed)
}

// ---- Conv ---------------------------------------------------------------------------------

struct ConvCase {
    x: Vec<usize>,
    w: Vec<usize>,
    bias: bool,
    groups: usize,
    win: Win,
    /// Write kernel_shape (else it comes from W's dims).
    kernel_attr: bool,
}

fn conv_cases() -> Vec<ConvCase> {
    vec![
        // 1-D, stride 2, uneven padding.
        ConvCase {
            x: vec![2, 3, 7],
            w: vec![4, 3, 3],
            bias: true,
            groups: 1,
            win: win(&[2], &[], &[1, 0], "", false),
            kernel_attr: true,
        },
        // 2-D, two groups, dilation and stride on different axes.
        ConvCase {
            x: vec![2, 4, 6, 5],
            w: vec![6, 2, 3, 2],
            bias: true,
            groups: 2,
            win: win(&[1, 2], &[2, 1], &[1, 0, 2, 1], "", false),
            kernel_attr: false,
        },
        // Depthwise with SAME_UPPER and stride 2.
        ConvCase {
            x: vec![1, 3, 5, 5],
            w: vec![3, 1, 3, 3],
            bias: false,
            groups: 3,
            win: win(&[2, 2], &[], &[], "SAME_UPPER", false),
            kernel_attr: true,
        },
        // Odd total padding: SAME_LOWER puts the extra one first.
        ConvCase {
            x: vec![1, 2, 4, 5],
            w: vec![3, 2, 2, 2],
            bias: true,
            groups: 1,
            win: win(&[], &[], &[], "SAME_LOWER", false),
            kernel_attr: false,
        },
        ConvCase {
            x: vec![1, 2, 6, 5],
            w: vec![2, 2, 3, 2],
            bias: false,
            groups: 1,
            win: win(&[2, 1], &[], &[], "VALID", false),
            kernel_attr: true,
        },
        // 3-D.
        ConvCase {
            x: vec![1, 2, 4, 3, 5],
            w: vec![2, 2, 2, 2, 3],
            bias: true,
            groups: 1,
            win: win(&[1, 1, 2], &[], &[1, 0, 1, 0, 1, 1], "", false),
            kernel_attr: false,
        },
        // Few output positions and many channels: the weights' gradient is one GEMM over
        // the batch moved inside.
        ConvCase {
            x: vec![3, 6, 3, 3],
            w: vec![5, 6, 2, 2],
            bias: true,
            groups: 1,
            win: win(&[2, 2], &[], &[], "", false),
            kernel_attr: true,
        },
        // Depthwise with a channel multiplier of 2, dilated and padded.
        ConvCase {
            x: vec![2, 3, 6, 6],
            w: vec![6, 1, 3, 3],
            bias: true,
            groups: 3,
            win: win(&[1, 1], &[2, 2], &[2, 1, 2, 1], "", false),
            kernel_attr: true,
        },
        // Images large enough to be taken in turn, gemm threading within each.
        ConvCase {
            x: vec![2, 32, 16, 16],
            w: vec![64, 32, 3, 3],
            bias: true,
            groups: 1,
            win: win(&[], &[], &[1, 1, 1, 1], "", false),
            kernel_attr: true,
        },
        // Outputs small enough (4×4) that images are multiplied several at a time, the
        // last block short (5 images, 4 at a time), grouped.
        ConvCase {
            x: vec![5, 4, 4, 4],
            w: vec![6, 2, 3, 3],
            bias: true,
            groups: 2,
            win: win(&[], &[], &[1, 1, 1, 1], "", false),
            kernel_attr: true,
        },
        // Kernels wider than the image: MobileNetV3's 5×5 depthwise padded by 2 on its
        // last 2×2 and 1×1 maps, where whole taps read only padding, and a dense one.
        ConvCase {
            x: vec![2, 4, 2, 2],
            w: vec![4, 1, 5, 5],
            bias: true,
            groups: 4,
            win: win(&[], &[], &[2, 2, 2, 2], "", false),
            kernel_attr: true,
        },
        ConvCase {
            x: vec![1, 3, 2, 1],
            w: vec![3, 1, 5, 5],
            bias: false,
            groups: 3,
            win: win(&[2, 2], &[], &[2, 2, 2, 2], "", false),
            kernel_attr: true,
        },
        ConvCase {
            x: vec![2, 3, 1, 2],
            w: vec![4, 3, 5, 5],
            bias: true,
            groups: 1,
            win: win(&[], &[], &[2, 2, 2, 2], "", false),
            kernel_attr: true,
        },
        // A 1×1 convolution (a per-position matrix product).
        ConvCase {
            x: vec![2, 5, 3, 3],
            w: vec![4, 5, 1, 1],
            bias: true,
            groups: 1,
            win: win(&[], &[], &[], "", false),
            kernel_attr: true,
        },
        // Many output channels on a 7×7 map (ResNet's last blocks at batch 1), and a 1×1
        // convolution on 45 positions: products narrower than a few vectors.
        ConvCase {
            x: vec![1, 90, 7, 7],
            w: vec![100, 90, 3, 3],
            bias: true,
            groups: 1,
            win: win(&[], &[], &[1, 1, 1, 1], "", false),
            kernel_attr: true,
        },
        ConvCase {
            x: vec![1, 100, 5, 9],
            w: vec![100, 100, 1, 1],
            bias: false,
            groups: 1,
            win: win(&[], &[], &[], "", false),
            kernel_attr: true,
        },
        // Few channels on a wide image: several blocks of output rows.
        ConvCase {
            x: vec![1, 3, 40, 37],
            w: vec![20, 3, 3, 3],
            bias: true,
            groups: 1,
            win: win(&[], &[], &[1, 1, 1, 1], "", false),
            kernel_attr: true,
        },
        // Depthwise rows longer than several vectors, and a strided, dilated one (summed
        // densely along the row, every third column kept).
        ConvCase {
            x: vec![1, 2, 9, 140],
            w: vec![2, 1, 3, 3],
            bias: true,
            groups: 2,
            win: win(&[], &[], &[1, 1, 1, 1], "", false),
            kernel_attr: true,
        },
        // Padding and strides far past a tiny image: three outputs a side, each reading
        // mostly padding (a padded copy of the plane would hold 4·10¹⁰ values).
        ConvCase {
            x: vec![1, 2, 3, 3],
            w: vec![2, 1, 3, 3],
            bias: true,
            groups: 2,
            win: win(
                &[100_000, 100_000],
                &[],
                &[100_000, 100_000, 100_000, 100_000],
                "",
                false,
            ),
            kernel_attr: true,
        },
        ConvCase {
            x: vec![2, 3, 11, 150],
            w: vec![3, 1, 3, 3],
            bias: false,
            groups: 3,
            win: win(&[2, 3], &[2, 2], &[2, 1, 2, 1], "", false),
            kernel_attr: true,
        },
    ]
}

impl ConvCase {
    fn case(&self, symbolic: bool) -> Case {
        let mut ins = vec![("x", Some(f(&self.x, 1))), ("w", Some(f(&self.w, 2)))];
        if self.bias {
            ins.push(("b", Some(f(&[self.w[0]], 3))));
        }
        let mut attrs = self.win.attrs();
        if self.groups > 1 {
            attrs.push(int_attr("group", self.groups as i64));
        }
        if self.kernel_attr {
            let k: Vec<i64> = self.w[2..].iter().map(|&d| d as i64).collect();
            attrs.push(ints_attr("kernel_shape", &k));
        }
        let mut c = Case::new("Conv", 11, ins).with(attrs);
        c.symbolic = symbolic;
        c
    }
    fn reference(&self) -> impl Fn(&[Vec<f64>]) -> Expected + '_ {
        move |v: &[Vec<f64>]| {
            let g = self.win.place(&self.x[2..], &self.w[2..]);
            conv_ref(
                &v[0],
                &self.x,
                &v[1],
                &self.w,
                v.get(2).map(|b| &b[..]),
                &g,
                self.groups,
            )
        }
    }
}

#[test]
fn conv_on_every_backend() {
    for (k, c) in conv_cases().iter().enumerate() {
        // Symbolic dims: the kernel comes from W's shape when the plan is made.
        for symbolic in [false, true] {
            if symbolic && c.kernel_attr {
                continue;
            }
            let what = format!("Conv case {k} (symbolic dims: {symbolic})");
            check_case(&what, &c.case(symbolic), &BOTH, 1e-5, c.reference());
        }
    }
}

#[test]
fn conv_has_gradients() {
    // (Finite differences over every element: the case sized for threading is left to
    // the forward test and tests/op_matrix.rs's gradient comparison.)
    for (k, c) in conv_cases()
        .iter()
        .enumerate()
        .filter(|(_, c)| c.x.iter().product::<usize>() < 4096)
    {
        let wrt: Vec<usize> = if c.bias { vec![0, 1, 2] } else { vec![0, 1] };
        check_grads(
            &format!("Conv case {k}"),
            &c.case(false),
            &wrt,
            10 + k as u64,
            c.reference(),
        );
    }
}

/// The case too large for element-wise finite differences: autodiff's gradients checked
/// along random directions u, ⟨grad, u⟩ against the reference loss's central difference
/// (exact up to rounding: the loss is linear in each input).
#[test]
fn large_conv_gradients_along_random_directions() {
    use std::collections::HashMap;
    let cases = conv_cases();
    let c = cases
        .iter()
        .find(|c| c.x.iter().product::<usize>() >= 4096)
        .expect("a large case");
    let case = c.case(false);
    let args = case.args(DType::F64);
    let vals: Vec<Vec<f64>> = args
        .iter()
        .map(|t| t.as_ref().map(Tensor::to_f64_vec).unwrap_or_default())
        .collect();
    let reference = c.reference();
    let (shape, _) = reference(&vals).remove(0);
    let dy = randn(&shape, 5).to_f64_vec();
    let seeds = HashMap::from([(case.outputs[0].to_string(), f64s(&shape, &dy))]);
    let mut s = Session::new(case.graph(DType::F64), SessionOptions::unfused()).unwrap();
    let grads = s.backward(&case.feeds(&args), &seeds).unwrap().grads;
    let loss = |v: &[Vec<f64>]| -> f64 {
        let (_, y) = reference(v).remove(0);
        y.iter().zip(&dy).map(|(a, b)| a * b).sum()
    };
    for (k, (name, _)) in case.inputs.iter().enumerate() {
        let got = grads
            .iter()
            .find(|(n, _)| n == name)
            .unwrap()
            .1
            .to_f64_vec();
        for seed in 0..2 {
            let u = randn(&[vals[k].len()], 40 + seed).to_f64_vec();
            let h = 1e-2;
            let (mut p, mut m) = (vals.clone(), vals.clone());
            for i in 0..u.len() {
                p[k][i] += h * u[i];
                m[k][i] -= h * u[i];
            }
            let fd = (loss(&p) - loss(&m)) / (2.0 * h);
            let dot: f64 = got.iter().zip(&u).map(|(g, u)| g * u).sum();
            assert!(
                (fd - dot).abs() <= 1e-8 * fd.abs().max(1.0),
                "d/d{name} along direction {seed}: autodiff {dot}, difference {fd}"
            );
        }
    }
}

// ---- ConvTranspose ------------------------------------------------------------------------

struct TransposeCase {
    x: Vec<usize>,
    w: Vec<usize>,
    groups: usize,
    win: Win,
    output_padding: Vec<usize>,
    output_shape: Option<Vec<usize>>,
}

impl TransposeCase {
    /// The output's spatial dims and the padding, by the operator's definition.
    fn geometry(&self) -> (Geo, Vec<usize>) {
        let r = self.w.len() - 2;
        let k = &self.w[2..];
        let sp = &self.x[2..];
        let mut g = Win {
            auto_pad: "",
            ..self.win.clone()
        }
        .place(&vec![100; r], k);
        let op = if self.output_padding.is_empty() {
            vec![0; r]
        } else {
            self.output_padding.clone()
        };
        let span = |i: usize| (k[i] - 1) * g.d[i] + 1;
        let out: Vec<usize> = match self.win.auto_pad {
            "SAME_UPPER" | "SAME_LOWER" => {
                let out: Vec<usize> = match &self.output_shape {
                    Some(o) => o.clone(),
                    None => (0..r).map(|i| sp[i] * g.s[i]).collect(),
                };
                for i in 0..r {
                    let total = g.s[i] * (sp[i] - 1) + op[i] + span(i) - out[i];
                    (g.pb[i], g.pe[i]) = if self.win.auto_pad == "SAME_UPPER" {
                        (total / 2, total - total / 2)
                    } else {
                        (total - total / 2, total / 2)
                    };
                }
                out
            }
            _ => match &self.output_shape {
                Some(o) => o.clone(),
                None => (0..r)
                    .map(|i| g.s[i] * (sp[i] - 1) + op[i] + span(i) - g.pb[i] - g.pe[i])
                    .collect(),
            },
        };
        (g, out)
    }
    fn case(&self) -> Case {
        let ins = vec![
            ("x", Some(f(&self.x, 4))),
            ("w", Some(f(&self.w, 5))),
            ("b", Some(f(&[self.w[1] * self.groups], 6))),
        ];
        let mut attrs = self.win.attrs();
        if self.groups > 1 {
            attrs.push(int_attr("group", self.groups as i64));
        }
        let ints = |v: &[usize]| v.iter().map(|&x| x as i64).collect::<Vec<_>>();
        if !self.output_padding.is_empty() {
            attrs.push(ints_attr("output_padding", &ints(&self.output_padding)));
        }
        if let Some(o) = &self.output_shape {
            attrs.push(ints_attr("output_shape", &ints(o)));
        }
        Case::new("ConvTranspose", 11, ins).with(attrs)
    }
    fn reference(&self) -> impl Fn(&[Vec<f64>]) -> Expected + '_ {
        move |v: &[Vec<f64>]| {
            let (g, out) = self.geometry();
            conv_transpose_ref(
                &v[0],
                &self.x,
                &v[1],
                &self.w,
                Some(&v[2]),
                &g,
                &out,
                self.groups,
            )
        }
    }
}

fn transpose_cases() -> Vec<TransposeCase> {
    vec![
        TransposeCase {
            x: vec![1, 2, 4],
            w: vec![2, 3, 3],
            groups: 1,
            win: win(&[2], &[], &[1, 0], "", false),
            output_padding: vec![1],
            output_shape: None,
        },
        TransposeCase {
            x: vec![2, 4, 3, 3],
            w: vec![4, 1, 2, 3],
            groups: 2,
            win: win(&[2, 1], &[1, 2], &[], "", false),
            output_padding: vec![],
            output_shape: None,
        },
        TransposeCase {
            x: vec![1, 2, 3, 3],
            w: vec![2, 2, 3, 3],
            groups: 1,
            win: win(&[3, 2], &[], &[], "", false),
            output_padding: vec![],
            output_shape: Some(vec![10, 8]),
        },
        TransposeCase {
            x: vec![1, 1, 3, 3],
            w: vec![1, 2, 3, 3],
            groups: 1,
            win: win(&[2, 2], &[], &[], "SAME_UPPER", false),
            output_padding: vec![],
            output_shape: None,
        },
        TransposeCase {
            x: vec![1, 2, 2, 3, 2],
            w: vec![2, 1, 2, 2, 2],
            groups: 1,
            win: win(&[1, 2, 1], &[], &[0, 1, 0, 1, 0, 0], "", false),
            output_padding: vec![],
            output_shape: None,
        },
    ]
}

#[test]
fn conv_transpose_on_every_backend_with_gradients() {
    for (k, c) in transpose_cases().iter().enumerate() {
        let what = format!("ConvTranspose case {k}");
        check_case(&what, &c.case(), &BOTH, 1e-5, c.reference());
        check_grads(&what, &c.case(), &[0, 1, 2], 30 + k as u64, c.reference());
    }
}

// ---- Pools --------------------------------------------------------------------------------

fn pool_case(
    op: &'static str,
    x: &[usize],
    k: &[usize],
    win: &Win,
    extra: Vec<AttributeProto>,
    outs: Vec<&'static str>,
) -> Case {
    let mut attrs = win.attrs();
    attrs.push(ints_attr(
        "kernel_shape",
        &k.iter().map(|&d| d as i64).collect::<Vec<_>>(),
    ));
    attrs.extend(extra);
    let mut c = Case::new(op, 19, vec![("x", Some(f(x, 7)))]).with(attrs);
    c.outputs = outs;
    c
}

/// (x, kernel, window) settings every pool runs under.
fn pool_settings() -> Vec<(Vec<usize>, Vec<usize>, Win)> {
    vec![
        (
            vec![2, 3, 7, 6],
            vec![3, 3],
            win(&[2, 2], &[], &[1, 1, 1, 1], "", false),
        ),
        // ceil_mode: the last windows read past the padding.
        (
            vec![1, 2, 6, 7],
            vec![3, 2],
            win(&[2, 3], &[], &[1, 0, 0, 1], "", true),
        ),
        (
            vec![1, 2, 7, 5],
            vec![2, 2],
            win(&[1, 2], &[2, 1], &[], "", false),
        ),
        (
            vec![1, 2, 5, 6],
            vec![3, 3],
            win(&[2, 2], &[], &[], "SAME_UPPER", false),
        ),
        (
            vec![1, 2, 5, 6],
            vec![2, 3],
            win(&[2, 1], &[], &[], "SAME_LOWER", false),
        ),
        (vec![2, 2, 9], vec![4], win(&[3], &[], &[2, 1], "", true)),
        (
            vec![1, 2, 4, 3, 5],
            vec![2, 2, 3],
            win(&[2, 1, 2], &[], &[1, 0, 0, 0, 1, 1], "", false),
        ),
    ]
}

#[test]
fn max_pool_on_every_backend_with_indices_and_gradients() {
    for (k, (x, kernel, win)) in pool_settings().iter().enumerate() {
        let what = format!("MaxPool setting {k}");
        let c = pool_case("MaxPool", x, kernel, win, vec![], vec!["y", "indices"]);
        let reference = |v: &[Vec<f64>]| pool_ref(Pool::Max, &v[0], x, &win.place(&x[2..], kernel));
        check_case(&what, &c, &BOTH, 0.0, reference);
        let c = pool_case("MaxPool", x, kernel, win, vec![], vec!["y"]);
        check_grads(&what, &c, &[0], 50 + k as u64, reference);
    }
    // storage_order = 1: indices count the spatial axes in reverse order.
    let (x, kernel, win) = pool_settings().remove(0);
    let c = pool_case(
        "MaxPool",
        &x,
        &kernel,
        &win,
        vec![int_attr("storage_order", 1)],
        vec!["y", "indices"],
    );
    let (h, w) = (x[2], x[3]);
    check_case("MaxPool storage_order 1", &c, &BOTH, 0.0, |v| {
        let mut out = pool_ref(Pool::Max, &v[0], &x, &win.place(&x[2..], &kernel));
        for i in out[1].1.iter_mut() {
            let k = *i as usize;
            let (plane, hh, ww) = (k / (h * w), (k / w) % h, k % w);
            *i = (plane * h * w + ww * h + hh) as f64;
        }
        out
    });
}

/// A MaxPool without Indices is graphrun's own op: its output on every backend and dtype
/// (the data on a coarse grid, so that windows hold tied maxima, and a NaN), and its
/// gradient op on every backend, each window's dY at the first maximum in window order.
#[test]
fn max_pool_op_and_its_gradient_on_every_backend_with_ties_and_nan() {
    use graphrun::graph::op::AttrValue as A;
    for (k, (xs, kernel, win)) in pool_settings().iter().enumerate() {
        let what = format!("MaxPool (no Indices) setting {k}");
        let mut c = pool_case("MaxPool", xs, kernel, win, vec![], vec!["y"]);
        let mut x: Vec<f64> = f(xs, 90 + k as u64)
            .to_f64_vec()
            .iter()
            .map(|v| (v * 2.0).round() / 2.0)
            .collect();
        x[k % 5] = f64::NAN;
        c.inputs[0].1 = Some(f64s(xs, &x));
        let geo = win.place(&xs[2..], kernel);
        let reference = |v: &[Vec<f64>]| pool_ref(Pool::Max, &v[0], xs, &geo)[..1].to_vec();
        check_case(
            &what,
            &c,
            &[DType::F32, DType::F64, DType::F16],
            0.0,
            reference,
        );
        // MaxPoolGrad(dY, X) against dY summed at each window's index.
        let want = pool_ref(Pool::Max, &x, xs, &geo);
        let dy = f(&want[0].0, 300 + k as u64);
        let mut dx = vec![0.0; x.len()];
        for (i, d) in want[1].1.iter().zip(dy.to_f64_vec()) {
            dx[*i as usize] += d;
        }
        let ints = |v: &[usize]| A::Ints(v.iter().map(|&d| d as i64).collect());
        let mut attrs = vec![("kernel_shape", ints(kernel))];
        for (key, v) in [
            ("strides", &win.strides),
            ("dilations", &win.dilations),
            ("pads", &win.pads),
        ] {
            if !v.is_empty() {
                attrs.push((key, ints(v)));
            }
        }
        if !win.auto_pad.is_empty() {
            attrs.push(("auto_pad", A::Str(win.auto_pad.into())));
        }
        attrs.push(("ceil_mode", A::Int(win.ceil as i64)));
        let grad = op("MaxPoolGrad", &attrs);
        for backend in backends() {
            for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
                if !computes(backend, dt) {
                    continue;
                }
                let args = [inp(dy.cast(dt)), inp(f64s(xs, &x).cast(dt))];
                let got = run_raw(backend, grad.clone(), &args, 1)
                    .unwrap_or_else(|e| panic!("MaxPoolGrad {what} {dt} on {backend:?}: {e}"));
                // The argmax of the rounded data is the f64 one (the grid is exact in
                // every dtype); only dY's rounding differs.
                let err = rel_err(&got[0].to_f64_vec(), &dx);
                assert!(
                    err <= tol(dt).max(1e-12),
                    "MaxPoolGrad {what} {dt} on {backend:?}: error {err}"
                );
            }
        }
    }
}

#[test]
fn average_pool_on_every_backend_with_gradients() {
    for (k, (x, kernel, win)) in pool_settings().iter().enumerate() {
        for include_pad in [false, true] {
            let what = format!("AveragePool setting {k} (count_include_pad {include_pad})");
            let extra = vec![int_attr("count_include_pad", include_pad as i64)];
            let c = pool_case("AveragePool", x, kernel, win, extra, vec!["y"]);
            let kind = Pool::Avg { include_pad };
            let reference = |v: &[Vec<f64>]| pool_ref(kind, &v[0], x, &win.place(&x[2..], kernel));
            check_case(&what, &c, &BOTH, 1e-6, reference);
            check_grads(&what, &c, &[0], 70 + k as u64, reference);
        }
    }
}

#[test]
fn lp_pool_on_every_backend_with_gradients() {
    for (k, (x, kernel, win)) in pool_settings().iter().enumerate() {
        for p in [2i64, 3] {
            let what = format!("LpPool setting {k} (p {p})");
            let c = pool_case("LpPool", x, kernel, win, vec![int_attr("p", p)], vec!["y"]);
            let reference = |v: &[Vec<f64>]| {
                pool_ref(Pool::Lp(p as f64), &v[0], x, &win.place(&x[2..], kernel))
            };
            check_case(&what, &c, &BOTH, 1e-5, reference);
            check_grads(&what, &c, &[0], 90 + k as u64, reference);
        }
    }
}

#[test]
fn global_lp_pool_on_every_backend_with_gradients() {
    for (x, p) in [
        (vec![2usize, 3, 4, 5], 2i64),
        (vec![1, 2, 7], 3),
        (vec![1, 2, 2, 3, 2], 1),
    ] {
        let what = format!("GlobalLpPool {x:?} p {p}");
        let c =
            Case::new("GlobalLpPool", 11, vec![("x", Some(f(&x, 8)))]).with(vec![int_attr("p", p)]);
        let reference = |v: &[Vec<f64>]| {
            let hw: usize = x[2..].iter().product();
            let y = v[0]
                .chunks(hw)
                .map(|c| {
                    c.iter()
                        .map(|v| v.abs().powf(p as f64))
                        .sum::<f64>()
                        .powf(1.0 / p as f64)
                })
                .collect();
            let shape = [x[..2].to_vec(), vec![1; x.len() - 2]].concat();
            vec![(shape, y)]
        };
        check_case(&what, &c, &BOTH, 1e-5, reference);
        check_grads(&what, &c, &[0], 110, reference);
    }
}

// ---- Col2Im -------------------------------------------------------------------------------

#[test]
fn col2im_on_every_backend_with_gradients_and_run_time_shapes() {
    // (image, block, window): the image and block shapes are graph inputs fed at run time.
    let settings = [
        (
            vec![5usize, 5],
            vec![2usize, 2],
            Win {
                strides: vec![1, 1],
                ..Default::default()
            },
        ),
        (
            vec![6, 5],
            vec![3, 2],
            Win {
                strides: vec![2, 1],
                dilations: vec![1, 2],
                pads: vec![1, 0, 0, 1],
                ..Default::default()
            },
        ),
        (
            vec![7],
            vec![3],
            Win {
                strides: vec![2],
                pads: vec![1, 1],
                ..Default::default()
            },
        ),
    ];
    for (k, (image, block, win)) in settings.iter().enumerate() {
        let g = win.place(image, block);
        let (n, c) = (2, 3);
        let kk: usize = block.iter().product();
        let l: usize = g.out.iter().product();
        let cols = f(&[n, c * kk, l], 120 + k as u64);
        let to = |v: &[usize]| i64s(&[v.len()], &v.iter().map(|&d| d as i64).collect::<Vec<_>>());
        let case = Case::new(
            "Col2Im",
            18,
            vec![
                ("cols", Some(cols)),
                ("image", Some(to(image))),
                ("block", Some(to(block))),
            ],
        )
        .with(win.attrs());
        let reference = |v: &[Vec<f64>]| {
            let hw: usize = image.iter().product();
            let mut y = vec![0.0; n * c * hw];
            for plane in 0..n * c {
                for (jk, j) in indices(block).iter().enumerate() {
                    for (ok, o) in indices(&g.out).iter().enumerate() {
                        if let Some(off) = inside(&at(&g, o, j), image) {
                            y[plane * hw + off] += v[0][(plane * kk + jk) * l + ok];
                        }
                    }
                }
            }
            vec![([vec![n, c], image.clone()].concat(), y)]
        };
        let what = format!("Col2Im setting {k}");
        check_case(&what, &case, &BOTH, 1e-5, reference);
        check_grads(&what, &case, &[0], 130 + k as u64, reference);
    }
}

// ---- Errors -------------------------------------------------------------------------------

/// The error of importing and running `c` in f32 (whichever step refuses it).
fn refusal(c: &Case) -> String {
    let feeds = c.feeds(&c.args(DType::F32));
    let g = std::panic::catch_unwind(|| c.graph(DType::F32));
    let g = match g {
        Ok(g) => g,
        Err(e) => return e.downcast_ref::<String>().cloned().unwrap_or_default(),
    };
    Session::new(g, SessionOptions::unfused())
        .and_then(|mut s| s.run(&feeds).map(|_| ()))
        .expect_err("the case must be refused")
        .to_string()
}

#[test]
fn bad_windows_are_refused_with_the_node_named() {
    let x = f(&[1, 2, 3, 3], 1);
    let w = f(&[2, 2, 5, 5], 2);
    // A window larger than the padded input: refused when the plan is made (here at
    // import, where the shapes are known), naming the node.
    for symbolic in [false, true] {
        let mut c = Case::new(
            "Conv",
            11,
            vec![("x", Some(x.clone())), ("w", Some(w.clone()))],
        );
        c.symbolic = symbolic;
        let e = refusal(&c);
        assert!(
            e.contains("Conv_node") && e.contains("larger than the padded input (3)"),
            "{e}"
        );
    }
    // Pads of the wrong length.
    let c = pool_case(
        "MaxPool",
        &[1, 2, 3, 3],
        &[2, 2],
        &Win {
            pads: vec![1, 1],
            ..Default::default()
        },
        vec![],
        vec!["y"],
    );
    let e = refusal(&c);
    assert!(e.contains("MaxPool") && e.contains("'pads'"), "{e}");
    // A pool needs kernel_shape.
    let n = node("AveragePool", "", &["x"], &["y"], vec![]);
    let e = import_one_node(n, 19, vec![input_like("x", &x)], vec![])
        .unwrap_err()
        .to_string();
    assert!(e.contains("kernel_shape") && e.contains("required"), "{e}");
    // Groups that do not divide the channels.
    let c = Case::new(
        "Conv",
        11,
        vec![
            ("x", Some(f(&[1, 3, 4, 4], 1))),
            ("w", Some(f(&[2, 1, 2, 2], 2))),
        ],
    )
    .with(vec![int_attr("group", 2)]);
    let e = refusal(&c);
    assert!(e.contains("Conv_node"), "{e}");
}

/// An integer MaxPool whose input's type the model leaves undeclared (here a Cast's output)
/// takes graphrun's floating MaxPool op, which refuses it naming the node and saying how to
/// declare the type; declared (a graph input), it runs in the columns form.
#[test]
fn integer_max_pool_of_an_undeclared_type_is_refused_with_the_way_out() {
    let pool = || {
        node(
            "MaxPool",
            "",
            &["q"],
            &["y"],
            vec![ints_attr("kernel_shape", &[2, 2])],
        )
    };
    let dims = [Some(1), Some(1), Some(4), Some(4)];
    let bytes = model_bytes(
        vec![
            node("Cast", "", &["x"], &["q"], vec![int_attr("to", 2)]),
            pool(),
        ],
        19,
        vec![input("x", DType::F32, &dims)],
        vec![],
        &["y"],
    );
    let e = graphrun::onnx::from_bytes(&bytes, "m", std::path::Path::new("."))
        .and_then(|g| Session::new(g, SessionOptions::unfused()).map(|_| ()))
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("'MaxPool_node'") && e.contains("value_info"),
        "{e}"
    );
    let bytes = model_bytes(
        vec![pool()],
        19,
        vec![input("q", DType::U8, &dims)],
        vec![],
        &["y"],
    );
    let g = graphrun::onnx::from_bytes(&bytes, "m", std::path::Path::new(".")).unwrap();
    let q = Tensor::from_vec(&[1, 1, 4, 4], (0..16u8).rev().collect::<Vec<u8>>()).unwrap();
    let y = Session::new(g, SessionOptions::unfused())
        .unwrap()
        .run(&[("q".to_string(), q)].into())
        .unwrap();
    assert_eq!(
        y[0].1.to_f64_vec(),
        vec![15.0, 14.0, 13.0, 11.0, 10.0, 9.0, 7.0, 6.0, 5.0]
    );
}
