//! The ONNX reductions the importer writes as graphrun ops (ReduceMin, ReduceL1, ReduceL2,
//! ReduceSumSquare, ReduceLogSum, ReduceLogSumExp): forward on every backend against float64
//! references written here, gradients against finite differences, with axes as an
//! attribute (opset 17) and as an input (opset 18), keepdims on and off.

mod common;
#[path = "common/onnx_model.rs"]
mod onnx_model;
use common::*;
use graphrun::{DType, Session, SessionOptions, Tensor};
use onnx_model::{import_one_node, initializer, input, int_attr, ints_attr, node};
use std::collections::HashMap;

const OPS: [&str; 6] = [
    "ReduceMin",
    "ReduceL1",
    "ReduceL2",
    "ReduceSumSquare",
    "ReduceLogSum",
    "ReduceLogSumExp",
];

/// A one-node model of `op` over x (of `dtype` and shape `shape`).
fn model(
    op: &str,
    opset: i64,
    dtype: DType,
    shape: &[usize],
    axes: &[i64],
    keepdims: i64,
) -> graphrun::Graph {
    let dims: Vec<Option<usize>> = shape.iter().map(|&d| Some(d)).collect();
    let mut attrs = vec![int_attr("keepdims", keepdims)];
    let mut inputs = vec!["x"];
    let mut inits = vec![];
    if opset >= 18 {
        inputs.push("axes");
        let t = Tensor::from_vec(&[axes.len()], axes.to_vec()).unwrap();
        inits.push(initializer("axes", &t));
    } else {
        attrs.push(ints_attr("axes", axes));
    }
    let n = node(op, "", &inputs, &["y"], attrs);
    import_one_node(n, opset, vec![input("x", dtype, &dims)], inits).unwrap()
}

/// The reduction of `v` (shape `shape`) over `axes`, in f64.
fn reference(
    op: &str,
    v: &[f64],
    shape: &[usize],
    axes: &[usize],
    keepdims: bool,
) -> (Vec<usize>, Vec<f64>) {
    let out_shape: Vec<usize> = (0..shape.len())
        .filter_map(|d| match (axes.contains(&d), keepdims) {
            (true, true) => Some(1),
            (true, false) => None,
            _ => Some(shape[d]),
        })
        .collect();
    let groups: Vec<Vec<f64>> = groups(shape, axes)
        .iter()
        .map(|g| g.iter().map(|&i| v[i]).collect())
        .collect();
    let f = |g: &Vec<f64>| -> f64 {
        match op {
            "ReduceMin" => g.iter().copied().fold(f64::INFINITY, f64::min),
            "ReduceL1" => g.iter().map(|x| x.abs()).sum(),
            "ReduceL2" => g.iter().map(|x| x * x).sum::<f64>().sqrt(),
            "ReduceSumSquare" => g.iter().map(|x| x * x).sum(),
            "ReduceLogSum" => g.iter().sum::<f64>().ln(),
            _ => g.iter().map(|x| x.exp()).sum::<f64>().ln(),
        }
    };
    (out_shape, groups.iter().map(f).collect())
}

/// Positive data for the logarithms, both signs for the others.
fn data(op: &str, shape: &[usize], seed: u64) -> Tensor {
    match op {
        "ReduceLogSum" => rand(shape, seed, 0.5, 3.0),
        "ReduceLogSumExp" => rand(shape, seed, 20.0, 40.0), // exp(x) alone would lose digits
        _ => rand(shape, seed, -3.0, 3.0),
    }
}

#[test]
fn rewritten_reductions_on_every_backend() {
    let shape = [3usize, 4, 5];
    for (k, op) in OPS.into_iter().enumerate() {
        for (opset, axes, norm) in [
            (17, vec![1i64], vec![1usize]),
            (18, vec![-1, 0], vec![0, 2]),
        ] {
            for keepdims in [0, 1] {
                let x = data(op, &shape, 10 + k as u64);
                let g = model(op, opset, DType::F32, &shape, &axes, keepdims);
                let (want_shape, want) = reference(
                    op,
                    &x.cast(DType::F32).to_f64_vec(),
                    &shape,
                    &norm,
                    keepdims == 1,
                );
                for backend in backends() {
                    let opts = SessionOptions {
                        backend,
                        ..SessionOptions::unfused()
                    };
                    let mut s = Session::new(g.clone(), opts).unwrap();
                    let feeds = HashMap::from([("x".to_string(), x.cast(DType::F32))]);
                    let got = s
                        .run(&feeds)
                        .unwrap_or_else(|e| panic!("{op} on {backend:?}: {e}"));
                    let t = &got[0].1;
                    assert_eq!(
                        t.shape(),
                        &want_shape[..],
                        "{op} opset {opset} keepdims {keepdims} on {backend:?}"
                    );
                    let e = rel_err(&t.to_f64_vec(), &want);
                    assert!(
                        e <= 1e-5,
                        "{op} opset {opset} keepdims {keepdims} on {backend:?}: rel err {e:.2e}"
                    );
                }
            }
        }
    }
}

#[test]
fn rewritten_reductions_have_gradients() {
    let shape = [3usize, 4];
    for (k, op) in OPS.into_iter().enumerate() {
        let x = data(op, &shape, 30 + k as u64).cast(DType::F64);
        let g = model(op, 18, DType::F64, &shape, &[1], 0);
        let mut s = Session::new(g, SessionOptions::unfused()).unwrap();
        let dy = randn(&[3], 40 + k as u64);
        let seeds = HashMap::from([("y".to_string(), dy.clone())]);
        let feeds = HashMap::from([("x".to_string(), x.clone())]);
        let grads = s.backward(&feeds, &seeds).unwrap().grads;
        let got = grads.iter().find(|(n, _)| n == "x").unwrap().1.to_f64_vec();
        let xv = x.to_f64_vec();
        let loss = |v: &[f64]| -> f64 {
            let (_, y) = reference(op, v, &shape, &[1], false);
            y.iter().zip(dy.to_f64_vec()).map(|(a, b)| a * b).sum()
        };
        let fd: Vec<f64> = (0..xv.len())
            .map(|i| {
                let h = 1e-6;
                let (mut p, mut m) = (xv.clone(), xv.clone());
                p[i] += h;
                m[i] -= h;
                (loss(&p) - loss(&m)) / (2.0 * h)
            })
            .collect();
        assert_grad(op, &got, &fd, 1e-6);
    }
}
