//! Ops whose outputs' shapes are decided by their input's values: NonZero, Unique, and
//! Compress (imported as a Gather of NonZero's indices). Their deciding input is fed at
//! run time as a graph input: the session plans for its value (NonZero and Unique run on
//! the host then, their outputs constants of the plan), makes a new plan for a value that
//! gives other shapes, and reuses the first plan when the first value comes back. Every
//! test runs on every available backend against references written here.

mod common;
#[path = "common/onnx_model.rs"]
mod onnx_model;

use common::*;
use graphrun::{BackendKind, DType, Model, Session, SessionOptions, Tensor};
use onnx_model::*;
use std::collections::HashMap;

fn session(g: &graphrun::Graph, backend: BackendKind) -> Session {
    Session::new(
        g.clone(),
        SessionOptions {
            backend,
            ..SessionOptions::unfused()
        },
    )
    .unwrap()
}

fn feeds(v: &[(&str, &Tensor)]) -> HashMap<String, Tensor> {
    v.iter()
        .map(|(k, t)| (k.to_string(), (*t).clone()))
        .collect()
}

/// A run's outputs against `want`: shapes exactly, values exactly (these ops copy).
fn assert_outputs(what: &str, got: &[(String, Tensor)], want: &Expected) {
    assert_eq!(got.len(), want.len(), "{what}: output count");
    for ((name, t), (shape, vals)) in got.iter().zip(want) {
        assert_eq!(t.shape(), &shape[..], "{what}: shape of '{name}'");
        assert_eq!(&t.to_f64_vec(), vals, "{what}: values of '{name}'");
    }
}

/// Runs `g` with each feed set in turn: the outputs against `want`, and the plans made so
/// far against `plans` (a new value that changes the shapes makes a plan; a value seen
/// before reuses its plan).
fn runs(g: &graphrun::Graph, cases: &[(HashMap<String, Tensor>, Expected, usize)], what: &str) {
    for be in backends() {
        let mut s = session(g, be);
        for (k, (f, want, plans)) in cases.iter().enumerate() {
            let what = format!("{what} on {be:?}, run {k}");
            let got = s.run(f).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_outputs(&what, &got, want);
            assert_eq!(s.plans_made(), *plans, "{what}: plans made");
        }
    }
}

/// numpy's nonzero: the coordinates of the non-zero elements, one row per dim.
fn ref_nonzero(shape: &[usize], v: &[f64]) -> (Vec<usize>, Vec<f64>) {
    let hits: Vec<Vec<usize>> = indices(shape)
        .into_iter()
        .zip(v)
        .filter(|(_, &x)| x != 0.0)
        .map(|(i, _)| i)
        .collect();
    let rows = (0..shape.len())
        .flat_map(|d| hits.iter().map(move |i| i[d] as f64))
        .collect();
    (vec![shape.len(), hits.len()], rows)
}

const NONZERO: &str = r#"
graphrun: 1
name: nonzero
inputs:
  - {name: m, dtype: f32, shape: [3, 4]}
  - {name: v, dtype: f32, shape: [3, 4]}
outputs: [idx, picked]
nodes:
  - {op: NonZero, name: nz, inputs: [m], outputs: [idx]}
  - {op: Transpose, inputs: [idx], outputs: [coords]}
  - {op: GatherND, inputs: [v, coords], outputs: [picked]}
"#;

/// NonZero of a fed mask, its indices read by a GatherND that runs on the device.
#[test]
fn nonzero_planned_per_value() {
    let g = Model::from_str(NONZERO, ".").unwrap().graph;
    let names: Vec<String> = graphrun::graph::infer::plan_time_inputs(&g)
        .into_iter()
        .map(|p| p.name)
        .collect();
    assert_eq!(names, ["m"]);
    let v = rand(&[3, 4], 1, -1.0, 1.0).cast(DType::F32);
    let vv = v.to_f64_vec();
    let mask = |bits: &[f64]| {
        Tensor::from_vec(&[3, 4], bits.to_vec())
            .unwrap()
            .cast(DType::F32)
    };
    let a = mask(&[0., 1., 0., 0., -2., 0., 0., 3., 0., 0., 0.5, 0.]);
    let b = mask(&[1., 1., 0., 0., 0., 0., 0., 0., 0., 0., 0., 0.]);
    let want = |m: &Tensor| -> Expected {
        let (shape, rows) = ref_nonzero(&[3, 4], &m.to_f64_vec());
        let n = shape[1];
        let picked = (0..n)
            .map(|k| vv[rows[k] as usize * 4 + rows[n + k] as usize])
            .collect();
        vec![(shape, rows), (vec![n], picked)]
    };
    let f = |m: &Tensor| feeds(&[("m", m), ("v", &v)]);
    runs(
        &g,
        &[
            (f(&a), want(&a), 1),
            (f(&b), want(&b), 2),
            (f(&a), want(&a), 2),
        ],
        "NonZero",
    );
}

/// NonZero of each dtype's zero and non-zero values, and of a scalar (rank 1, as numpy
/// did for 0-d arrays); NaN is non-zero.
#[test]
fn nonzero_dtypes_and_scalar() {
    let cases = [
        Tensor::from_vec(&[2, 3], vec![0i32, 5, 0, -1, 0, 0]).unwrap(),
        bools(&[2, 3], &[true, false, false, false, true, true]),
        Tensor::from_vec(&[2, 3], vec![0.0f32, f32::NAN, -0.0, 0.0, 1e-30, 0.0]).unwrap(),
        Tensor::from_vec(&[2, 3], vec![0u8, 0, 0, 0, 0, 0]).unwrap(),
        Tensor::scalar(7i64),
        Tensor::scalar(0.0f64),
    ];
    for x in cases {
        let v = x.to_f64_vec();
        let nz: Vec<f64> = v
            .iter()
            .map(|&e| if e.is_nan() { 1.0 } else { e })
            .collect();
        let shape: Vec<usize> = if x.shape().is_empty() {
            vec![1]
        } else {
            x.shape().to_vec()
        };
        let (s, rows) = ref_nonzero(&shape, &nz);
        let what = format!("NonZero of {}{:?}", x.dtype(), x.shape());
        for be in backends() {
            let got = run_raw(be, op("NonZero", &[]), &[inp(x.clone())], 1)
                .unwrap_or_else(|e| panic!("{what} on {be:?}: {e}"));
            assert_eq!(got[0].dtype(), DType::I64, "{what}");
            assert_eq!(got[0].shape(), &s[..], "{what} on {be:?}");
            assert_eq!(got[0].to_f64_vec(), rows, "{what} on {be:?}");
        }
    }
}

/// ONNX Unique, written from its definition: the distinct slices along `axis` (elements
/// when None) in order of first occurrence, or ascending (lexicographically) when sorted;
/// each one's first index, each slice's index among them, and their counts.
fn ref_unique(x: &Tensor, axis: Option<usize>, sorted: bool) -> Expected {
    let shape = x.shape().to_vec();
    let v = x.to_f64_vec();
    let len = axis.map_or(v.len(), |a| shape[a]);
    let mut slices: Vec<Vec<f64>> = vec![vec![]; len];
    for (k, (i, &e)) in indices(&shape).into_iter().zip(&v).enumerate() {
        slices[axis.map_or(k, |a| i[a])].push(e);
    }
    let mut firsts: Vec<usize> = vec![];
    for k in 0..len {
        if !firsts.iter().any(|&f| slices[f] == slices[k]) {
            firsts.push(k);
        }
    }
    if sorted {
        firsts.sort_by(|&a, &b| slices[a].partial_cmp(&slices[b]).unwrap());
    }
    let group = |k: usize| firsts.iter().position(|&f| slices[f] == slices[k]).unwrap();
    let inverse: Vec<f64> = (0..len).map(|k| group(k) as f64).collect();
    let counts: Vec<f64> = (0..firsts.len())
        .map(|g| (0..len).filter(|&k| group(k) == g).count() as f64)
        .collect();
    let y: (Vec<usize>, Vec<f64>) = match axis {
        None => (
            vec![firsts.len()],
            firsts.iter().map(|&f| slices[f][0]).collect(),
        ),
        Some(a) => {
            let mut ys = shape.clone();
            ys[a] = firsts.len();
            let st = strides(&shape);
            let vals = indices(&ys)
                .iter()
                .map(|i| {
                    let mut src = i.clone();
                    src[a] = firsts[i[a]];
                    v[src.iter().zip(&st).map(|(i, s)| i * s).sum::<usize>()]
                })
                .collect();
            (ys, vals)
        }
    };
    let n = firsts.len();
    vec![
        y,
        (vec![n], firsts.iter().map(|&f| f as f64).collect()),
        (vec![len], inverse),
        (vec![n], counts),
    ]
}

/// Unique's four outputs for fed values, sorted and not, over elements and along an axis
/// (negative too); a second value with another number of distinct slices makes a second
/// plan, and the first value again reuses the first.
#[test]
fn unique_planned_per_value() {
    let f32s = |shape: &[usize], v: &[f64]| f64s(shape, v).cast(DType::F32);
    let cases: Vec<(Option<i64>, bool, Tensor, Tensor)> = vec![
        (
            None,
            true,
            f32s(&[6], &[2., 1., 1., 3., 4., 3.]),
            f32s(&[6], &[5., 5., 5., 5., -1., 5.]),
        ),
        (
            None,
            false,
            f32s(&[2, 3], &[2., 1., 1., 3., 4., 3.]),
            f32s(&[2, 3], &[0., -0., 7., 7., 7., 1.]),
        ),
        (
            Some(0),
            true,
            f32s(&[3, 3], &[1., 0., 0., 1., 0., 0., 2., 3., 4.]),
            f32s(&[3, 3], &[2., 3., 4., 1., 0., 0., 2., 3., 5.]),
        ),
        (
            Some(-1),
            true,
            f32s(&[3, 3], &[1., 0., 0., 1., 0., 0., 2., 3., 3.]),
            f32s(&[3, 3], &[1., 1., 1., 2., 2., 2., 3., 3., 3.]),
        ),
        (
            Some(1),
            false,
            f32s(
                &[2, 4, 2],
                &[
                    1., 1., 0., 1., 2., 1., 0., 1., 1., 1., 0., 1., 2., 1., 0., 1.,
                ],
            ),
            f32s(
                &[2, 4, 2],
                &[
                    9., 1., 0., 1., 2., 1., 0., 1., 1., 1., 0., 1., 2., 1., 0., 2.,
                ],
            ),
        ),
        (
            Some(0),
            false,
            Tensor::from_vec(&[4, 2], vec![3i64, 1, 2, 2, 3, 1, -5, 0]).unwrap(),
            Tensor::from_vec(&[4, 2], vec![3i64, 1, 3, 1, 3, 1, 3, 1]).unwrap(),
        ),
    ];
    for (axis, sorted, a, b) in cases {
        let mut attrs = format!("sorted: {}", sorted as i64);
        if let Some(ax) = axis {
            attrs += &format!(", axis: {ax}");
        }
        let dims: Vec<String> = a.shape().iter().map(|d| d.to_string()).collect();
        let text = format!(
            "graphrun: 1\nname: unique\ninputs:\n  - {{name: x, dtype: {}, shape: [{}]}}\n\
             outputs: [y, first, inverse, counts]\nnodes:\n  - {{op: Unique, name: u, \
             inputs: [x], outputs: [y, first, inverse, counts], attrs: {{{attrs}}}}}\n",
            a.dtype(),
            dims.join(", ")
        );
        let g = Model::from_str(&text, ".").unwrap().graph;
        let r = a.shape().len();
        let ax = axis.map(|x| {
            if x < 0 {
                (x + r as i64) as usize
            } else {
                x as usize
            }
        });
        let (wa, wb) = (ref_unique(&a, ax, sorted), ref_unique(&b, ax, sorted));
        assert_ne!(wa[0].0, wb[0].0, "the two values must give two shapes");
        runs(
            &g,
            &[
                (feeds(&[("x", &a)]), wa.clone(), 1),
                (feeds(&[("x", &b)]), wb, 2),
                (feeds(&[("x", &a)]), wa, 2),
            ],
            &format!("Unique axis {axis:?} sorted {sorted}"),
        );
    }
}

/// Unique with Y alone, and an axis out of range (an error naming the node).
#[test]
fn unique_one_output_and_bad_axis() {
    let x = f64s(&[5], &[3., 1., 3., 2., 1.]);
    let got = run_raw(BackendKind::Cpu, op("Unique", &[]), &[inp(x.clone())], 1).unwrap();
    assert_eq!(got[0].to_f64_vec(), [1., 2., 3.]);
    let attrs = [("axis", graphrun::graph::op::AttrValue::Int(1))];
    let e = run_raw(BackendKind::Cpu, op("Unique", &attrs), &[inp(x)], 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("(Unique)") && e.contains("axis 1 is out of range for X of shape [5]"),
        "{e}"
    );
}

/// numpy's compress: the slices along `axis` (elements of x flattened when None) whose
/// condition is true; a condition shorter than the axis keeps nothing past its end.
fn ref_compress(x: &Tensor, cond: &[bool], axis: Option<usize>) -> (Vec<usize>, Vec<f64>) {
    let v = x.to_f64_vec();
    let kept = |k: usize| cond.get(k).copied().unwrap_or(false);
    match axis {
        None => {
            let y: Vec<f64> = (0..v.len()).filter(|&k| kept(k)).map(|k| v[k]).collect();
            (vec![y.len()], y)
        }
        Some(a) => {
            let shape = x.shape();
            let keep: Vec<usize> = (0..shape[a]).filter(|&k| kept(k)).collect();
            let mut ys = shape.to_vec();
            ys[a] = keep.len();
            let st = strides(shape);
            let vals = indices(&ys)
                .iter()
                .map(|i| {
                    let mut src = i.clone();
                    src[a] = keep[i[a]];
                    v[src.iter().zip(&st).map(|(i, s)| i * s).sum::<usize>()]
                })
                .collect();
            (ys, vals)
        }
    }
}

/// A one-node ONNX Compress model with x and the condition as graph inputs.
fn compress_model(x: &Tensor, cond_len: usize, axis: Option<i64>) -> graphrun::Graph {
    let attrs = axis.map(|a| vec![int_attr("axis", a)]).unwrap_or_default();
    let n = node("Compress", "", &["x", "cond"], &["y"], attrs);
    let c = input("cond", DType::Bool, &[Some(cond_len)]);
    import_one_node(n, 11, vec![input_like("x", x), c], vec![]).unwrap()
}

/// Compress along an axis (negative too) and over x flattened, with conditions shorter
/// than the axis; the condition decides the plan, x does not (a new x reuses the plan).
#[test]
fn compress_planned_per_condition() {
    let x = rand(&[3, 4], 3, -1.0, 1.0).cast(DType::F32);
    let x2 = rand(&[3, 4], 4, -1.0, 1.0).cast(DType::F32);
    let cases: [(Option<i64>, Vec<bool>, Vec<bool>); 5] = [
        (Some(0), vec![false, true, true], vec![true, false, false]),
        (Some(1), vec![true, false, true, true], vec![false; 4]),
        (Some(-1), vec![false, true, true], vec![true, true, false]),
        (None, vec![false, true, false, false, true], vec![true; 5]),
        (
            None,
            vec![true; 12],
            vec![
                false, true, false, true, false, true, false, true, false, true, false, true,
            ],
        ),
    ];
    for (axis, a, b) in cases {
        let g = compress_model(&x, a.len(), axis);
        let r = x.shape().len() as i64;
        let ax = axis.map(|v| (if v < 0 { v + r } else { v }) as usize);
        let want = |x: &Tensor, c: &[bool]| vec![ref_compress(x, c, ax)];
        let f = |x: &Tensor, c: &[bool]| feeds(&[("x", x), ("cond", &bools(&[c.len()], c))]);
        runs(
            &g,
            &[
                (f(&x, &a), want(&x, &a), 1),
                (f(&x, &b), want(&x, &b), 2),
                (f(&x2, &a), want(&x2, &a), 2),
            ],
            &format!("Compress axis {axis:?}"),
        );
    }
}

/// Compress's gradient with respect to x (Gather's: dY back at the kept positions, zero
/// elsewhere) against central finite differences of Σ dY ∘ Compress(x).
#[test]
fn compress_gradient() {
    let x = rand(&[3, 4], 5, -1.0, 1.0).cast(DType::F32);
    for (axis, cond) in [
        (Some(1), vec![true, false, true]),
        (None, vec![false, true, true, false, false, false, true]),
    ] {
        let g = compress_model(&x, cond.len(), axis);
        let (ys, _) = ref_compress(&x, &cond, axis.map(|a| a as usize));
        let dy = rand(&ys, 6, -1.0, 1.0).cast(DType::F32);
        let dyv = dy.to_f64_vec();
        let xv = x.to_f64_vec();
        let loss = |v: &[f64]| -> f64 {
            let xt = f64s(&[3, 4], v);
            let (_, y) = ref_compress(&xt, &cond, axis.map(|a| a as usize));
            y.iter().zip(&dyv).map(|(y, d)| y * d).sum()
        };
        let fd: Vec<f64> = (0..xv.len())
            .map(|i| {
                let (mut p, mut m) = (xv.clone(), xv.clone());
                p[i] += 1e-3;
                m[i] -= 1e-3;
                (loss(&p) - loss(&m)) / 2e-3
            })
            .collect();
        for be in backends() {
            let mut s = session(&g, be);
            let c = bools(&[cond.len()], &cond);
            let gr = s
                .backward(&feeds(&[("x", &x), ("cond", &c)]), &feeds(&[("y", &dy)]))
                .unwrap_or_else(|e| panic!("{be:?} axis {axis:?}: {e}"));
            let names: Vec<&str> = gr.grads.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, ["x"], "{be:?}: only x is differentiable");
            assert_grad(
                &format!("Compress axis {axis:?} on {be:?}"),
                &gr.grads[0].1.to_f64_vec(),
                &fd,
                1e-5,
            );
        }
    }
}

/// A deciding value too large to know when the plan is made (computed from a large
/// initializer, or a graph input too large to plan for) is computed by a run in stages:
/// the model loads, and each run computes it first, on the device, then the rest.
#[test]
fn large_deciding_values_run_in_stages() {
    let big = r#"
graphrun: 1
name: big_mask
inputs:
  - {name: x, dtype: f32, shape: [2]}
outputs: [idx]
initializers:
  - {name: big, dtype: f32, shape: [70000], init: zeros}
nodes:
  - {op: Relu, inputs: [big], outputs: [m]}
  - {op: NonZero, name: nz, inputs: [m], outputs: [idx]}
"#;
    let gb = Model::from_str(big, ".").unwrap().graph;
    let large = r#"
graphrun: 1
name: large_unique
inputs:
  - {name: x, dtype: f32, shape: [40, 40]}
outputs: [y]
nodes:
  - {op: Relu, inputs: [x], outputs: [r]}
  - {op: Unique, name: u, inputs: [r], outputs: [y]}
"#;
    let g = Model::from_str(large, ".").unwrap().graph;
    let x = rand(&[40, 40], 7, -1.0, 1.0).cast(DType::F32);
    let mut uniq: Vec<f64> = x.to_f64_vec().iter().map(|v| v.max(0.0)).collect();
    uniq.sort_by(f64::total_cmp);
    uniq.dedup();
    let keep: Vec<bool> = (0..2000).map(|i| i % 3 != 0).collect();
    let cond = bools(&[2000], &keep);
    let cx = rand(&[2000], 8, -1.0, 1.0).cast(DType::F32);
    let kept: Vec<f64> = cx
        .to_f64_vec()
        .iter()
        .zip(&keep)
        .filter(|(_, &k)| k)
        .map(|(v, _)| *v)
        .collect();
    let gc = compress_model(&cx, 2000, Some(0));
    for be in backends() {
        let y = session(&g, be).run(&feeds(&[("x", &x)])).unwrap();
        assert_eq!(y[0].1.to_f64_vec(), uniq, "Unique on {be:?}");
        let y = session(&gc, be)
            .run(&feeds(&[("x", &cx), ("cond", &cond)]))
            .unwrap();
        assert_eq!(y[0].1.to_f64_vec(), kept, "Compress on {be:?}");
        // (WGSL has no 64-bit integers for NonZero's indices.)
        if !graphrun::backends::not_on(be, DType::I64) {
            let x2 = rand(&[2], 9, -1.0, 1.0).cast(DType::F32);
            let idx = session(&gb, be).run(&feeds(&[("x", &x2)])).unwrap();
            assert_eq!(idx[0].1.shape(), &[1, 0], "NonZero on {be:?}");
        }
    }
}

/// A condition longer than the axis with a true past its end (numpy refuses it) is an
/// error naming the Gather the importer wrote, on every backend (inference checks the
/// indices known when planning); so is a condition that is not 1-D.
#[test]
fn compress_condition_out_of_range_is_an_error() {
    let x = rand(&[3, 2], 9, -1.0, 1.0).cast(DType::F32);
    let long = bools(&[4], &[true, false, false, true]);
    let g = compress_model(&x, 4, Some(0));
    for be in backends() {
        let e = session(&g, be)
            .run(&feeds(&[("x", &x), ("cond", &long)]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("node 'Compress_node' (Gather)")
                && e.contains("index 3 is out of range for axis 0 of size 3"),
            "{be:?}: {e}"
        );
    }
    let attrs = vec![int_attr("axis", 0)];
    let n = node("Compress", "", &["x", "cond"], &["y"], attrs);
    let c = input("cond", DType::Bool, &[Some(3), Some(1)]);
    let g = import_one_node(n, 11, vec![input_like("x", &x), c], vec![]).unwrap();
    let e = session(&g, BackendKind::Cpu)
        .run(&feeds(&[("x", &x), ("cond", &bools(&[3, 1], &[true; 3]))]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("Compress_node/indices") && e.contains("(Squeeze)"),
        "{e}"
    );
}

/// NonMaxSuppression by brute force: per batch and class, repeatedly the best remaining
/// candidate (highest score, lowest index among equals), kept when its IoU with every
/// box kept so far is at most `iou`.
fn ref_nms(
    boxes: &[f64],
    scores: &[f64],
    [b, c, n]: [usize; 3],
    max_out: usize,
    iou: f64,
    score_min: Option<f64>,
    center: bool,
) -> Expected {
    let rect = |i: usize| {
        let v = &boxes[4 * i..4 * i + 4];
        if center {
            (
                v[0] - v[2] / 2.0,
                v[1] - v[3] / 2.0,
                v[0] + v[2] / 2.0,
                v[1] + v[3] / 2.0,
            )
        } else {
            (
                v[1].min(v[3]),
                v[0].min(v[2]),
                v[1].max(v[3]),
                v[0].max(v[2]),
            )
        }
    };
    let iou_of = |p: (f64, f64, f64, f64), q: (f64, f64, f64, f64)| {
        let w = (p.2.min(q.2) - p.0.max(q.0)).max(0.0);
        let h = (p.3.min(q.3) - p.1.max(q.1)).max(0.0);
        let inter = w * h;
        let area = |r: (f64, f64, f64, f64)| (r.2 - r.0) * (r.3 - r.1);
        inter / (area(p) + area(q) - inter)
    };
    let mut rows = vec![];
    for bi in 0..b {
        for ci in 0..c {
            let s = |i: usize| scores[(bi * c + ci) * n + i];
            let mut left: Vec<usize> = (0..n)
                .filter(|&i| score_min.is_none_or(|t| s(i) > t))
                .collect();
            let mut kept: Vec<usize> = vec![];
            while kept.len() < max_out && !left.is_empty() {
                let best = (0..left.len())
                    .reduce(|a, k| if s(left[k]) > s(left[a]) { k } else { a })
                    .unwrap();
                let i = left.remove(best);
                if kept
                    .iter()
                    .all(|&k| iou_of(rect(bi * n + i), rect(bi * n + k)) <= iou)
                {
                    kept.push(i);
                    rows.extend([bi as f64, ci as f64, i as f64]);
                }
            }
        }
    }
    vec![(vec![rows.len() / 3, 3], rows)]
}

/// NonMaxSuppression with every input fed at run time, in both box formats, with and
/// without the score threshold, with tied scores and flipped corners: planned for the fed
/// values on every backend (a new plan for new scores, the first reused when they come back);
/// without max_output_boxes_per_class nothing is selected; malformed boxes are refused.
#[test]
fn non_max_suppression_planned_per_value() {
    let (b, c, n) = (2usize, 3usize, 12usize);
    for center in [false, true] {
        let mut bx = rand(&[b, n, 4], 40 + center as u64, 0.0, 1.0).to_f64_vec();
        for k in 0..b * n {
            if center {
                // Centres in [0, 1), sizes in [0.2, 0.7).
                bx[4 * k + 2] = 0.2 + bx[4 * k + 2] / 2.0;
                bx[4 * k + 3] = 0.2 + bx[4 * k + 3] / 2.0;
            }
        }
        let boxes = Tensor::from_vec(&[b, n, 4], bx.clone())
            .unwrap()
            .cast(DType::F32);
        let mut sv = rand(&[b, c, n], 50, 0.0, 1.0).to_f64_vec();
        sv[3] = sv[7]; // a tie within one class
        let scores = Tensor::from_vec(&[b, c, n], sv).unwrap().cast(DType::F32);
        let other = rand(&[b, c, n], 51, 0.0, 1.0).cast(DType::F32);
        for score_min in [None, Some(0.2f32)] {
            let mut names = vec!["boxes", "scores", "max", "iou"];
            let mut infos = vec![
                input_like("boxes", &boxes),
                input_like("scores", &scores),
                input("max", DType::I64, &[Some(1)]),
                input("iou", DType::F32, &[Some(1)]),
            ];
            if score_min.is_some() {
                names.push("score_min");
                infos.push(input("score_min", DType::F32, &[Some(1)]));
            }
            let attrs = vec![int_attr("center_point_box", center as i64)];
            let nd = node("NonMaxSuppression", "", &names, &["sel"], attrs);
            let g = import_one_node(nd, 11, infos, vec![]).unwrap();
            let max = Tensor::from_vec(&[1], vec![4i64]).unwrap();
            let iou = Tensor::from_vec(&[1], vec![0.3f32]).unwrap();
            let thr = Tensor::from_vec(&[1], vec![score_min.unwrap_or(0.0)]).unwrap();
            let f = |s: &Tensor| {
                let mut v = vec![
                    ("boxes", &boxes),
                    ("scores", s),
                    ("max", &max),
                    ("iou", &iou),
                ];
                if score_min.is_some() {
                    v.push(("score_min", &thr));
                }
                feeds(&v)
            };
            let want = |s: &Tensor| {
                let sv = s.cast(DType::F32).to_f64_vec();
                let bv = boxes.to_f64_vec();
                let t = score_min.map(|t| t as f64);
                ref_nms(&bv, &sv, [b, c, n], 4, 0.3f32 as f64, t, center)
            };
            let what = format!("NonMaxSuppression center {center} threshold {score_min:?}");
            // A plan for each value fed, the first reused when it comes back.
            runs(
                &g,
                &[
                    (f(&scores), want(&scores), 1),
                    (f(&other), want(&other), 2),
                    (f(&scores), want(&scores), 2),
                ],
                &what,
            );
        }
    }
    // No max_output_boxes_per_class: no box is selected.
    let boxes = rand(&[1, 3, 4], 60, 0.0, 1.0).cast(DType::F32);
    let scores = rand(&[1, 1, 3], 61, 0.0, 1.0).cast(DType::F32);
    let infos = vec![input_like("boxes", &boxes), input_like("scores", &scores)];
    let nd = node(
        "NonMaxSuppression",
        "",
        &["boxes", "scores"],
        &["sel"],
        vec![],
    );
    let g = import_one_node(nd, 11, infos, vec![]).unwrap();
    let f = feeds(&[("boxes", &boxes), ("scores", &scores)]);
    runs(
        &g,
        &[(f, vec![(vec![0, 3], vec![])], 1)],
        "NonMaxSuppression without a maximum",
    );
    // Boxes of 3 coordinates.
    let bad = rand(&[1, 3, 3], 62, 0.0, 1.0).cast(DType::F32);
    let infos = vec![input_like("boxes", &bad), input_like("scores", &scores)];
    let nd = node(
        "NonMaxSuppression",
        "",
        &["boxes", "scores"],
        &["sel"],
        vec![],
    );
    let g = import_one_node(nd, 11, infos, vec![]).unwrap();
    let e = session(&g, BackendKind::Cpu)
        .run(&feeds(&[("boxes", &bad), ("scores", &scores)]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("boxes must be [batches, boxes, 4]") && e.contains("[1, 3, 3]"),
        "{e}"
    );
}
