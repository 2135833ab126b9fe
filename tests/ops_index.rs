//! The indexing family: Pad (every mode, negative pads, axes, the constant as an input),
//! ScatterElements and ScatterND (every reduction, negative and repeated indices) and their
//! gradients as graphrun ops, and the ONNX ops the importer writes as graphrun's (Tile,
//! OneHot, EyeLike, Einsum), on every backend against float64 references written here.
//! Pads, repeats and depth are graph inputs fed at run time.

mod common;
use common::*;
use graphrun::graph::op::AttrValue;
use graphrun::graph::Op;
use graphrun::onnx::proto::{
    attr_type, AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto,
    TensorShapeProto, TypeProto, TypeProtoTensor, ValueInfoProto,
};
use graphrun::rng::Rng;
use graphrun::{BackendKind, DType, Session, SessionOptions, Tensor};
use prost::Message;
use std::collections::HashMap;

// ---- Pad ---------------------------------------------------------------------------------

/// The input index an output index `i` of a padded axis reads (None: the constant), by
/// walking reflections one at a time (numpy's definition), not by a closed form.
fn pad_source(mode: &str, i: i64, n: i64, b: i64, e: i64) -> Option<i64> {
    let lo = (-b).max(0);
    let m = n - lo - (-e).max(0);
    let mut j = i - b.max(0);
    if (0..m).contains(&j) {
        return Some(lo + j);
    }
    let j = match mode {
        "constant" => return None,
        "edge" => j.clamp(0, m - 1),
        "wrap" => ((j % m) + m) % m,
        _ if m == 1 => 0,
        _ => {
            while !(0..m).contains(&j) {
                j = if j < 0 { -j } else { 2 * (m - 1) - j };
            }
            j
        }
    };
    Some(lo + j)
}

/// Pad of `x` (shape `shape`) by per-dim (begin, end) pairs.
fn pad_ref(mode: &str, x: &[f64], shape: &[usize], pairs: &[(i64, i64)], c: f64) -> Expected {
    let out: Vec<usize> = shape
        .iter()
        .zip(pairs)
        .map(|(&n, &(b, e))| (n as i64 + b + e) as usize)
        .collect();
    let st = strides(shape);
    let vals = indices(&out)
        .iter()
        .map(|p| {
            let mut off = 0;
            for d in 0..shape.len() {
                let (b, e) = pairs[d];
                match pad_source(mode, p[d] as i64, shape[d] as i64, b, e) {
                    Some(k) => off += k as usize * st[d],
                    None => return c,
                }
            }
            x[off]
        })
        .collect();
    vec![(out, vals)]
}

type PadCase = (&'static str, Vec<usize>, Vec<i64>, Option<Vec<i64>>);

/// (mode, shape, pads, axes) cases: pads longer than the axis (reflect folds back more
/// than once), negative pads, axes negative and partial.
fn pad_cases() -> Vec<PadCase> {
    vec![
        ("constant", vec![2, 3, 4], vec![1, 0, 2, 0, 3, 1], None),
        ("constant", vec![3, 5], vec![-1, 2, 1, -2], None),
        (
            "constant",
            vec![2, 3, 4],
            vec![2, -1, 1, 3],
            Some(vec![-1, 0]),
        ),
        ("reflect", vec![2, 3, 4], vec![0, 2, 3, 1, 4, 2], None),
        ("reflect", vec![3, 1, 5], vec![2, 2, 7, 3], Some(vec![1, 2])),
        ("edge", vec![2, 3, 4], vec![1, 3, 0, 0, 2, 5], None),
        ("edge", vec![4, 3], vec![2, 1], Some(vec![-2])),
        ("wrap", vec![2, 3, 4], vec![1, 4, 2, 3, 0, 9], None),
        ("wrap", vec![3, 4], vec![5, 2], Some(vec![1])),
    ]
}

fn pairs_of(r: usize, pads: &[i64], axes: &Option<Vec<i64>>) -> Vec<(i64, i64)> {
    let axes: Vec<usize> = match axes {
        None => (0..r).collect(),
        Some(a) => a
            .iter()
            .map(|&a| {
                if a < 0 {
                    (a + r as i64) as usize
                } else {
                    a as usize
                }
            })
            .collect(),
    };
    let mut p = vec![(0, 0); r];
    for (k, &a) in axes.iter().enumerate() {
        p[a] = (pads[k], pads[axes.len() + k]);
    }
    p
}

fn pad_op(mode: &str) -> Op {
    op("Pad", &[("mode", AttrValue::Str(mode.into()))])
}

#[test]
fn pad_on_every_backend() {
    for (k, (mode, shape, pads, axes)) in pad_cases().into_iter().enumerate() {
        let pairs = pairs_of(shape.len(), &pads, &axes);
        let pads_t = i64s(&[pads.len()], &pads);
        let axes_arg = |c: bool| match &axes {
            None => Arg::None,
            Some(a) if c => cst(i64s(&[a.len()], a)),
            Some(a) => inp(i64s(&[a.len()], a)),
        };
        let x = randn(&shape, 10 + k as u64);
        let c = f64s(&[], &[if mode == "constant" { 2.5 } else { 0.0 }]);
        // Pads and axes as run-time graph inputs, the constant given and omitted.
        for with_c in [true, false] {
            let cv = if with_c { 2.5 } else { 0.0 };
            let c_arg = if with_c { inp(c.clone()) } else { Arg::None };
            let args = [inp(x.clone()), inp(pads_t.clone()), c_arg, axes_arg(false)];
            check_exact(pad_op(mode), &args, &FLOATS, |a| {
                let cv = if mode == "constant" { cv } else { 0.0 };
                pad_ref(
                    mode,
                    &a[0].as_ref().unwrap().to_f64_vec(),
                    &shape,
                    &pairs,
                    cv,
                )
            });
        }
        // Integers and bools move the same way (pads as initializers).
        let xi = rand_ints(&shape, 20 + k as u64, -50, 50);
        for xt in [xi.cast(DType::I32), xi.clone(), xi.cast(DType::Bool)] {
            let args = [
                inp(xt.clone()),
                cst(pads_t.clone()),
                Arg::None,
                axes_arg(true),
            ];
            check_exact(pad_op(mode), &args, &[DType::F32], |a| {
                pad_ref(
                    mode,
                    &a[0].as_ref().unwrap().to_f64_vec(),
                    &shape,
                    &pairs,
                    0.0,
                )
            });
        }
    }
}

#[test]
fn pad_gradients_on_every_backend() {
    for (k, (mode, shape, pads, axes)) in pad_cases().into_iter().enumerate() {
        let pairs = pairs_of(shape.len(), &pads, &axes);
        let out: Vec<usize> = shape
            .iter()
            .zip(&pairs)
            .map(|(&n, &(b, e))| (n as i64 + b + e) as usize)
            .collect();
        let dy = randn(&out, 30 + k as u64);
        let mut args = vec![inp(dy), cst(i64s(&[pads.len()], &pads))];
        if let Some(a) = &axes {
            args.push(inp(i64s(&[a.len()], a)));
        }
        let grad = pad_op(mode).grad_op().unwrap();
        check(grad, &args, &FLOATS, |a| {
            let g = a[0].as_ref().unwrap().to_f64_vec();
            // The forward's offsets: pad an iota of X and read where each dY goes.
            let n: usize = shape.iter().product();
            let iota: Vec<f64> = (0..n).map(|i| i as f64).collect();
            let (_, src) = pad_ref(mode, &iota, &shape, &pairs, -1.0).remove(0);
            let mut acc = vec![0.0; n];
            for (i, &s) in src.iter().enumerate() {
                if s >= 0.0 {
                    acc[s as usize] += g[i];
                }
            }
            vec![(shape.clone(), acc)]
        });
    }
}

/// Finite differences through a session's backward pass: dX of every mode, and the
/// constant's gradient.
#[test]
fn pad_backward_matches_finite_differences() {
    for (k, (mode, shape, pads, axes)) in pad_cases().into_iter().enumerate() {
        let x = randn(&shape, 40 + k as u64);
        let c = f64s(&[], &[0.7]);
        let mut ins = vec![
            Some(x.clone()),
            Some(i64s(&[pads.len()], &pads)),
            Some(c.clone()),
        ];
        if let Some(a) = &axes {
            ins.push(Some(i64s(&[a.len()], a)));
        }
        let node = node_of(pad_op(mode), &ins, &["y"]);
        let y = eval(&node, &ins).unwrap().remove(0);
        let dy = randn(y.shape(), 50 + k as u64);
        let mut args = vec![inp(x), cst(ins[1].clone().unwrap()), inp(c)];
        if let Some(Some(a)) = ins.get(3) {
            args.push(cst(a.clone()));
        }
        let grads = backward(pad_op(mode), &args, &dy);
        assert_grad(mode, &grads["in0"], &fd_grad(&node, &ins, 0, 0, &dy), 1e-6);
        if mode == "constant" {
            assert_grad(
                "constant",
                &grads["in2"],
                &fd_grad(&node, &ins, 2, 0, &dy),
                1e-6,
            );
        }
    }
}

/// The gradients of the graph inputs of a one-node graph, in f64, for output seed `dy`.
fn backward(op_: Op, args: &[Arg], dy: &Tensor) -> HashMap<String, Vec<f64>> {
    let g = one_node_graph(op_, args, 1);
    let mut s = Session::new(g, SessionOptions::unfused()).unwrap();
    let seeds = HashMap::from([("out0".to_string(), dy.clone())]);
    let r = s.backward(&feeds_of(args), &seeds).unwrap();
    r.grads
        .into_iter()
        .map(|(n, t)| (n, t.to_f64_vec()))
        .collect()
}

// ---- Scatter -------------------------------------------------------------------------------

const REDUCTIONS: [&str; 5] = ["none", "add", "mul", "max", "min"];

/// `data` with `upd[j]` combined into `at[j]` in order (Python's max/min: the element
/// stays unless the update is strictly beyond it).
fn scatter_ref(red: &str, data: &[f64], upd: &[f64], at: &[usize]) -> Vec<f64> {
    let mut out = data.to_vec();
    for (&t, &u) in at.iter().zip(upd) {
        let v = &mut out[t];
        *v = match red {
            "none" => u,
            "add" => *v + u,
            "mul" => *v * u,
            "max" => {
                if u > *v {
                    u
                } else {
                    *v
                }
            }
            _ => {
                if u < *v {
                    u
                } else {
                    *v
                }
            }
        };
    }
    out
}

fn norm(i: i64, d: usize) -> usize {
    (if i < 0 { i + d as i64 } else { i }) as usize
}

type ScatterCase = (Op, Vec<usize>, Tensor, Vec<usize>, Vec<usize>);

/// (op, data shape, indices, updates shape, where each update lands) per case; indices
/// repeat and are negative.
fn scatter_cases(red: &str) -> Vec<ScatterCase> {
    let r = AttrValue::Str(red.into());
    let mut v = vec![];
    for (axis, data, ishape) in [
        (0i64, vec![4usize, 3], vec![5usize, 3]),
        (1, vec![3, 5, 2], vec![2, 7, 2]),
        (-1, vec![2, 3, 4], vec![2, 2, 6]),
    ] {
        let a = norm(axis, data.len());
        let mut rng = Rng::new(60 + a as u64);
        let n: usize = ishape.iter().product();
        let d = data[a] as i64;
        let iv: Vec<i64> = (0..n).map(|_| rng.int_in(-d, d)).collect();
        let st = strides(&data);
        let at = indices(&ishape)
            .iter()
            .zip(&iv)
            .map(|(p, &i)| {
                (0..data.len())
                    .map(|k| if k == a { norm(i, data[a]) } else { p[k] } * st[k])
                    .sum()
            })
            .collect();
        let op_ = op(
            "ScatterElements",
            &[("axis", AttrValue::Int(axis)), ("reduction", r.clone())],
        );
        v.push((op_, data, i64s(&ishape, &iv), ishape, at));
    }
    for (data, ishape) in [
        (vec![4usize, 3, 2], vec![5usize, 1]),
        (vec![4, 3, 2], vec![3, 2, 2]),
        (vec![4, 3], vec![6, 2]),
    ] {
        let k = ishape[ishape.len() - 1];
        let mut rng = Rng::new(70 + k as u64 + ishape.len() as u64);
        let rows: usize = ishape[..ishape.len() - 1].iter().product();
        let iv: Vec<i64> = (0..rows * k)
            .map(|i| {
                let d = data[i % k] as i64;
                rng.int_in(-d, d)
            })
            .collect();
        let st = strides(&data);
        let slice: usize = data[k..].iter().product();
        let mut at = vec![];
        for row in 0..rows {
            let base: usize = (0..k).map(|j| norm(iv[row * k + j], data[j]) * st[j]).sum();
            at.extend((0..slice).map(|e| base + e));
        }
        let mut ushape = ishape[..ishape.len() - 1].to_vec();
        ushape.extend_from_slice(&data[k..]);
        v.push((
            op("ScatterND", &[("reduction", r.clone())]),
            data,
            i64s(&ishape, &iv),
            ushape,
            at,
        ));
    }
    v
}

#[test]
fn scatters_on_every_backend() {
    for red in REDUCTIONS {
        for (k, (op_, data, idx, ushape, at)) in scatter_cases(red).into_iter().enumerate() {
            let x = rand(&data, 80 + k as u64, 0.5, 1.5);
            let u = rand(&ushape, 90 + k as u64, 0.5, 1.5);
            let want = |a: &[Option<Tensor>]| {
                let (d, u) = (a[0].as_ref().unwrap(), a[2].as_ref().unwrap());
                vec![(
                    data.clone(),
                    scatter_ref(red, &d.to_f64_vec(), &u.to_f64_vec(), &at),
                )]
            };
            let args = [inp(x), inp(idx.clone()), inp(u)];
            // Products and sums of a few elements round once per step in f16/bf16.
            if red == "add" || red == "mul" {
                check(op_.clone(), &args, &FLOATS, want);
            } else {
                check_exact(op_.clone(), &args, &FLOATS, want);
            }
            let xi = rand_ints(&data, 100 + k as u64, -9, 9);
            let ui = rand_ints(&ushape, 110 + k as u64, -9, 9);
            for dt in [DType::I32, DType::I64] {
                let args = [inp(xi.cast(dt)), inp(idx.clone()), inp(ui.cast(dt))];
                check_exact(op_.clone(), &args, &[DType::F32], want);
            }
            if red == "none" {
                let (xb, ub) = (xi.cast(DType::Bool), ui.cast(DType::Bool));
                check_exact(op_, &[inp(xb), inp(idx), inp(ub)], &[DType::F32], want);
            }
        }
    }
}

#[test]
fn scatter_backward_matches_finite_differences() {
    for red in ["none", "add"] {
        for (k, (op_, data, idx, ushape, at)) in scatter_cases(red).into_iter().enumerate() {
            // Distinct targets, so that every update's effect is differentiable.
            let mut seen = std::collections::HashSet::new();
            if !at.iter().all(|t| seen.insert(*t)) && red == "none" {
                continue;
            }
            let x = randn(&data, 120 + k as u64);
            let u = randn(&ushape, 130 + k as u64);
            let ins = vec![Some(x.clone()), Some(idx.clone()), Some(u.clone())];
            let node = node_of(op_.clone(), &ins, &["y"]);
            let dy = randn(&data, 140 + k as u64);
            let grads = backward(op_, &[inp(x), cst(idx), inp(u)], &dy);
            assert_grad(
                "dData",
                &grads["in0"],
                &fd_grad(&node, &ins, 0, 0, &dy),
                1e-6,
            );
            assert_grad(
                "dUpdates",
                &grads["in2"],
                &fd_grad(&node, &ins, 2, 0, &dy),
                1e-6,
            );
        }
    }
    // The cases with repeated targets still give dData (the written-over elements get none).
    let (op_, data, idx, ushape, _) = scatter_cases("none").remove(0);
    let (x, u) = (randn(&data, 150), randn(&ushape, 151));
    let ins = vec![Some(x.clone()), Some(idx.clone()), Some(u.clone())];
    let node = node_of(op_.clone(), &ins, &["y"]);
    let dy = randn(&data, 152);
    let grads = backward(op_, &[inp(x), cst(idx), inp(u)], &dy);
    assert_grad(
        "dData",
        &grads["in0"],
        &fd_grad(&node, &ins, 0, 0, &dy),
        1e-6,
    );
}

#[test]
fn scatter_out_of_range_indices_name_the_node() {
    for backend in backends() {
        let e = run_op(
            backend,
            op("ScatterElements", &[]),
            &[
                inp(randn(&[2, 3], 1)),
                inp(i64s(&[1, 1], &[2])),
                inp(randn(&[1, 1], 2)),
            ],
            1,
            DType::F32,
        )
        .expect_err("index 2 on an axis of 2");
        assert!(
            e.to_string()
                .contains("index 2 is out of range for axis 0 of size 2"),
            "{e}"
        );
    }
}

// ---- ONNX ops the importer lowers --------------------------------------------------------------

fn value_info(name: &str, t: Option<&Tensor>) -> ValueInfoProto {
    ValueInfoProto {
        name: name.into(),
        r#type: t.map(|t| TypeProto {
            tensor_type: Some(TypeProtoTensor {
                elem_type: t.dtype().onnx_code(),
                shape: Some(TensorShapeProto {
                    dim: t
                        .shape()
                        .iter()
                        .map(|&d| graphrun::onnx::proto::Dimension {
                            dim_value: Some(d as i64),
                            dim_param: None,
                        })
                        .collect(),
                }),
            }),
            ..Default::default()
        }),
    }
}

/// A one-node ONNX model of `op` over graph inputs `ins` (named as given), imported.
fn onnx_model(
    op_: &str,
    opset: i64,
    ins: &[(&str, &Tensor)],
    attrs: Vec<AttributeProto>,
) -> graphrun::Graph {
    let g = GraphProto {
        node: vec![NodeProto {
            op_type: op_.into(),
            input: ins.iter().map(|(n, _)| n.to_string()).collect(),
            output: vec!["y".into()],
            attribute: attrs,
            ..Default::default()
        }],
        input: ins.iter().map(|(n, t)| value_info(n, Some(t))).collect(),
        output: vec![value_info("y", None)],
        ..Default::default()
    };
    let m = ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: opset,
        }],
        graph: Some(g),
        ..Default::default()
    };
    graphrun::onnx::from_bytes(&m.encode_to_vec(), op_, std::path::Path::new("."))
        .unwrap_or_else(|e| panic!("{op_}: {e}"))
}

fn int_attr(name: &str, v: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attr_type::INT,
        i: v,
        ..Default::default()
    }
}

fn str_attr(name: &str, v: &str) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attr_type::STRING,
        s: v.as_bytes().to_vec(),
        ..Default::default()
    }
}

/// Runs an imported model on every backend and compares output y with `want` (shape,
/// values) within `tl`; wgpu skips dtypes it has no type for.
fn run_everywhere(
    g: &graphrun::Graph,
    feeds: &[(&str, Tensor)],
    want: &(Vec<usize>, Vec<f64>),
    tl: f64,
    what: &str,
) {
    let feeds: HashMap<String, Tensor> = feeds
        .iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect();
    for backend in backends() {
        if backend == BackendKind::Wgpu
            && feeds
                .values()
                .any(|t| graphrun::backends::not_on(backend, t.dtype()) && t.dtype().is_float())
        {
            continue;
        }
        let opts = SessionOptions {
            backend,
            ..SessionOptions::unfused()
        };
        let mut s = Session::new(g.clone(), opts).unwrap();
        let got = s
            .run(&feeds)
            .unwrap_or_else(|e| panic!("{what} on {backend:?}: {e}"));
        let t = &got[0].1;
        assert_eq!(t.shape(), &want.0[..], "{what} on {backend:?}");
        let e = rel_err(&t.to_f64_vec(), &want.1);
        assert!(
            e <= tl,
            "{what} on {backend:?}: rel err {e:.2e}\n got {:?}\nwant {:?}",
            t.to_f64_vec(),
            want.1
        );
    }
}

#[test]
fn tile_on_every_backend_with_run_time_repeats() {
    for (k, (shape, reps)) in [
        (vec![2usize, 3], vec![2i64, 3]),
        (vec![3, 1, 2], vec![1, 4, 2]),
        (vec![4], vec![3]),
        (vec![2, 2], vec![0, 2]),
    ]
    .into_iter()
    .enumerate()
    {
        let x = randn(&shape, 200 + k as u64).cast(DType::F32);
        let r = i64s(&[reps.len()], &reps);
        let g = onnx_model("Tile", 13, &[("x", &x), ("repeats", &r)], vec![]);
        let out: Vec<usize> = shape
            .iter()
            .zip(&reps)
            .map(|(&d, &r)| d * r as usize)
            .collect();
        let xv = x.to_f64_vec();
        let vals = indices(&out)
            .iter()
            .map(|p| {
                let q: Vec<usize> = p.iter().zip(&shape).map(|(&i, &d)| i % d).collect();
                xv[q.iter()
                    .zip(strides(&shape))
                    .map(|(a, b)| a * b)
                    .sum::<usize>()]
            })
            .collect();
        run_everywhere(
            &g,
            &[("x", x.clone()), ("repeats", r.clone())],
            &(out.clone(), vals),
            0.0,
            "Tile",
        );
        // Its gradient sums over the tiles.
        let x64 = x.cast(DType::F64);
        let g = onnx_model("Tile", 13, &[("x", &x64), ("repeats", &r)], vec![]);
        let mut s = Session::new(g, SessionOptions::unfused()).unwrap();
        let dy = randn(&out, 210 + k as u64);
        let feeds = HashMap::from([
            ("x".to_string(), x64.clone()),
            ("repeats".to_string(), r.clone()),
        ]);
        let grads = s
            .backward(&feeds, &HashMap::from([("y".to_string(), dy.clone())]))
            .unwrap()
            .grads;
        let got = grads.iter().find(|(n, _)| n == "x").unwrap().1.to_f64_vec();
        let mut want = vec![0.0; xv.len()];
        for (p, d) in indices(&out).iter().zip(dy.to_f64_vec()) {
            let q: usize = p
                .iter()
                .zip(&shape)
                .zip(strides(&shape))
                .map(|((&i, &n), s)| (i % n) * s)
                .sum();
            want[q] += d;
        }
        assert_grad("Tile", &got, &want, 1e-12);
    }
}

#[test]
fn one_hot_on_every_backend_with_run_time_depth() {
    for (k, (ishape, axis, depth)) in [
        (vec![2usize, 3], None, 5i64),
        (vec![2, 3], Some(0), 4),
        (vec![2, 3], Some(1), 3),
        (vec![4], Some(-2), 6),
        (vec![2, 2, 2], Some(-3), 3),
    ]
    .into_iter()
    .enumerate()
    {
        // Indices in [-depth - 1, depth + 1): out-of-range ones give all-off rows.
        let idx = rand_ints(&ishape, 300 + k as u64, -depth - 1, depth + 1);
        let d = Tensor::scalar(depth as f32);
        let values = f64s(&[2], &[-2.0, 7.0]).cast(DType::F32);
        let attrs = axis.map(|a| vec![int_attr("axis", a)]).unwrap_or_default();
        let g = onnx_model(
            "OneHot",
            11,
            &[("i", &idx), ("depth", &d), ("values", &values)],
            attrs,
        );
        let r = ishape.len() as i64 + 1;
        let a = axis.map(|a| if a < 0 { a + r } else { a }).unwrap_or(r - 1) as usize;
        let mut out = ishape.clone();
        out.insert(a, depth as usize);
        let iv = idx.to_f64_vec();
        let vals = indices(&out)
            .iter()
            .map(|p| {
                let mut q = p.clone();
                let j = q.remove(a) as f64;
                let q: usize = q.iter().zip(strides(&ishape)).map(|(a, b)| a * b).sum();
                let i = if iv[q] < 0.0 {
                    iv[q] + depth as f64
                } else {
                    iv[q]
                };
                if i == j {
                    7.0
                } else {
                    -2.0
                }
            })
            .collect();
        let feeds = [
            ("i", idx.clone()),
            ("depth", d.clone()),
            ("values", values.clone()),
        ];
        run_everywhere(&g, &feeds, &(out, vals), 0.0, "OneHot");
    }
}

#[test]
fn eye_like_on_every_backend() {
    for (k, (shape, kk, dtype)) in [
        (vec![3usize, 4], 0i64, None),
        (vec![4, 3], 1, Some(1)),
        (vec![4, 5], -2, Some(6)),
        (vec![3, 3], 5, Some(9)),
    ]
    .into_iter()
    .enumerate()
    {
        let x = rand_ints(&shape, 400 + k as u64, 0, 9).cast(DType::I32);
        let mut attrs = vec![int_attr("k", kk)];
        attrs.extend(dtype.map(|d| int_attr("dtype", d)));
        let g = onnx_model("EyeLike", 22, &[("x", &x)], attrs);
        let vals = indices(&shape)
            .iter()
            .map(|p| (p[1] as i64 - p[0] as i64 == kk) as i32 as f64)
            .collect();
        run_everywhere(
            &g,
            &[("x", x.clone())],
            &(shape.clone(), vals),
            0.0,
            "EyeLike",
        );
    }
}

/// numpy's einsum in f64 for the equations below: every assignment of the labels, summed.
fn einsum_ref(eq: &str, ops: &[(&Tensor, &[usize])]) -> (Vec<usize>, Vec<f64>) {
    let eq: String = eq.chars().filter(|c| !c.is_whitespace()).collect();
    let (lhs, out) = eq.split_once("->").unwrap();
    let terms: Vec<Vec<char>> = lhs.split(',').map(|t| t.chars().collect()).collect();
    let mut size = HashMap::new();
    for (t, (_, shape)) in terms.iter().zip(ops) {
        for (c, &d) in t.iter().zip(shape.iter()) {
            size.insert(*c, d);
        }
    }
    let mut labels: Vec<char> = size.keys().copied().collect();
    labels.sort();
    let out: Vec<char> = out.chars().collect();
    let oshape: Vec<usize> = out.iter().map(|c| size[c]).collect();
    let mut res = vec![0.0; oshape.iter().product()];
    let all: Vec<usize> = labels.iter().map(|c| size[c]).collect();
    for p in indices(&all) {
        let at = |c: &char| p[labels.iter().position(|x| x == c).unwrap()];
        let mut v = 1.0;
        for (t, (x, shape)) in terms.iter().zip(ops) {
            let off: usize = t.iter().zip(strides(shape)).map(|(c, s)| at(c) * s).sum();
            v *= x.to_f64_vec()[off];
        }
        let o: usize = out
            .iter()
            .zip(strides(&oshape))
            .map(|(c, s)| at(c) * s)
            .sum();
        res[o] += v;
    }
    (oshape, res)
}

#[test]
fn einsum_on_every_backend() {
    let cases: Vec<(&str, Vec<Vec<usize>>)> = vec![
        ("bij, bjk -> bik", vec![vec![2, 3, 4], vec![2, 4, 5]]),
        ("i,i->", vec![vec![5], vec![5]]),
        ("i,j->ij", vec![vec![3], vec![4]]),
        ("ij->i", vec![vec![3, 4]]),
        ("ij->ji", vec![vec![3, 4]]),
        ("ii->i", vec![vec![4, 4]]),
        ("bii->bi", vec![vec![2, 3, 3]]),
        ("ij,jk,kl->il", vec![vec![2, 3], vec![3, 4], vec![4, 2]]),
        ("bhqd,bhkd->bhqk", vec![vec![2, 2, 3, 4], vec![2, 2, 5, 4]]),
        ("abc,cd->abd", vec![vec![2, 3, 4], vec![4, 5]]),
        ("ijk,ikl->jl", vec![vec![2, 3, 4], vec![2, 4, 5]]),
        ("ij,ij->i", vec![vec![3, 4], vec![3, 4]]),
    ];
    for (k, (eq, shapes)) in cases.into_iter().enumerate() {
        let names = ["a", "b", "c"];
        let xs: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| randn(s, 500 + 10 * k as u64 + i as u64).cast(DType::F32))
            .collect();
        let ins: Vec<(&str, &Tensor)> = names.iter().copied().zip(&xs).collect();
        let g = onnx_model("Einsum", 12, &ins, vec![str_attr("equation", eq)]);
        let ops: Vec<(&Tensor, &[usize])> =
            xs.iter().zip(&shapes).map(|(x, s)| (x, &s[..])).collect();
        let want = einsum_ref(eq, &ops);
        let feeds: Vec<(&str, Tensor)> = names.iter().copied().zip(xs.iter().cloned()).collect();
        run_everywhere(&g, &feeds, &want, 1e-5, eq);
        // Gradients against finite differences of the reference, in f64.
        let x64: Vec<Tensor> = xs.iter().map(|x| x.cast(DType::F64)).collect();
        let ins: Vec<(&str, &Tensor)> = names.iter().copied().zip(&x64).collect();
        let g = onnx_model("Einsum", 12, &ins, vec![str_attr("equation", eq)]);
        let mut s = Session::new(g, SessionOptions::unfused()).unwrap();
        let dy = randn(&want.0, 600 + k as u64);
        let feeds: HashMap<String, Tensor> = ins
            .iter()
            .map(|(n, t)| (n.to_string(), (*t).clone()))
            .collect();
        let grads = s
            .backward(&feeds, &HashMap::from([("y".to_string(), dy.clone())]))
            .unwrap()
            .grads;
        for (i, (name, x)) in ins.iter().enumerate() {
            let got = grads
                .iter()
                .find(|(n, _)| n == name)
                .unwrap()
                .1
                .to_f64_vec();
            let xv = x.to_f64_vec();
            let fd: Vec<f64> = (0..xv.len())
                .map(|j| {
                    let at = |h: f64| {
                        let mut v = xv.clone();
                        v[j] += h;
                        let t = f64s(x.shape(), &v);
                        let mut ops = ops.clone();
                        ops[i].0 = &t;
                        let (_, y) =
                            einsum_ref(eq, &ops.iter().map(|(x, s)| (*x, *s)).collect::<Vec<_>>());
                        y.iter()
                            .zip(dy.to_f64_vec())
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                    };
                    (at(1e-6) - at(-1e-6)) / 2e-6
                })
                .collect();
            assert_grad(&format!("{eq} d{name}"), &got, &fd, 1e-6);
        }
    }
}

#[test]
fn einsum_forms_it_does_not_take_are_named() {
    let x = randn(&[3, 3], 1);
    for (eq, msg) in [("ij->k", "output label 'k'"), ("i1->i", "not a letter")] {
        let g = GraphProto {
            node: vec![NodeProto {
                op_type: "Einsum".into(),
                name: "e".into(),
                input: vec!["x".into()],
                output: vec!["y".into()],
                attribute: vec![str_attr("equation", eq)],
                ..Default::default()
            }],
            input: vec![value_info("x", Some(&x))],
            output: vec![value_info("y", None)],
            ..Default::default()
        };
        let m = ModelProto {
            ir_version: 8,
            opset_import: vec![OperatorSetIdProto {
                domain: String::new(),
                version: 12,
            }],
            graph: Some(g),
            ..Default::default()
        };
        let e = graphrun::onnx::from_bytes(&m.encode_to_vec(), "e", std::path::Path::new("."))
            .expect_err(eq);
        assert!(
            e.to_string().contains("node 'e' (Einsum)") && e.to_string().contains(msg),
            "{e}"
        );
    }
}
