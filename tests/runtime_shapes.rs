//! Shapes decided at run time: a shape-deciding input (Reshape's shape, Slice's starts,
//! Reduce/Squeeze/Unsqueeze axes, Expand's shape, Split sizes) that is a graph input, or
//! computed from one. The session plans for the fed values, caches a plan per distinct
//! value, and refuses inputs that cannot be plan-time values. Every test runs on every
//! available backend against references computed here.

mod common;
use common::*;
use graphrun::graph::op::AttrValue;
use graphrun::{BackendKind, DType, Model, Session, SessionOptions, Tensor};
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

fn feeds(v: &[(&str, Tensor)]) -> HashMap<String, Tensor> {
    v.iter().map(|(k, t)| (k.to_string(), t.clone())).collect()
}

/// `out[idx] = x[src(idx)]` over every index of `out_shape` (flat offsets into `x`).
fn gather(x: &Tensor, out_shape: &[usize], src: impl Fn(&[usize]) -> usize) -> Expected {
    let xv = x.to_f64_vec();
    let vals = indices(out_shape).iter().map(|i| xv[src(i)]).collect();
    vec![(out_shape.to_vec(), vals)]
}

/// A run's outputs against `want` (shape exactly, values to f32 tolerance).
fn assert_outputs(what: &str, got: &[(String, Tensor)], want: &Expected) {
    assert_eq!(got.len(), want.len(), "{what}: output count");
    for ((name, t), (shape, vals)) in got.iter().zip(want) {
        assert_eq!(t.shape(), &shape[..], "{what}: shape of '{name}'");
        let e = rel_err(&t.to_f64_vec(), vals);
        assert!(e <= 1e-5, "{what}: '{name}' rel err {e:.3e}");
    }
}

#[test]
fn reshape_with_its_shape_fed() {
    let x = rand(&[2, 3, 4], 1, -1.0, 1.0);
    // -1 and 0 (copy the input's dim) resolved from the fed value.
    check(
        op("Reshape", &[]),
        &[inp(x.clone()), inp(i64s(&[3], &[4, 0, -1]))],
        &[DType::F32, DType::F64],
        |_| vec![(vec![4, 3, 2], x.to_f64_vec())],
    );
}

#[test]
fn slice_with_starts_ends_axes_steps_fed() {
    let x = rand(&[5, 7], 2, -1.0, 1.0);
    // Rows 4, 3, 2, 1 (step -1, end 0 exclusive); columns 1, 3, 5 (end clamped).
    check(
        op("Slice", &[]),
        &[
            inp(x.clone()),
            inp(i64s(&[2], &[-1, 1])),
            inp(i64s(&[2], &[0, 100])),
            inp(i64s(&[2], &[0, -1])),
            inp(i64s(&[2], &[-1, 2])),
        ],
        &[DType::F32],
        |_| gather(&x, &[4, 3], |i| (4 - i[0]) * 7 + 1 + 2 * i[1]),
    );
}

#[test]
fn reduce_axes_fed() {
    let x = rand(&[3, 4, 5], 3, -1.0, 1.0);
    let xv = x.to_f64_vec();
    let at = |a: usize, b: usize, c: usize| xv[a * 20 + b * 5 + c];
    // ReduceSum over axes [-1, 0], keeping dims: [1, 4, 1].
    let sum: Vec<f64> = (0..4)
        .map(|b| {
            (0..3)
                .flat_map(|a| (0..5).map(move |c| (a, c)))
                .map(|(a, c)| at(a, b, c))
                .sum()
        })
        .collect();
    check(
        op("ReduceSum", &[("keepdims", AttrValue::Int(1))]),
        &[inp(x.clone()), inp(i64s(&[2], &[-1, 0]))],
        &[DType::F32],
        |_| vec![(vec![1, 4, 1], sum.clone())],
    );
    // ReduceMean over axis 1, dropping it: [3, 5].
    let mean: Vec<f64> = (0..3)
        .flat_map(|a| (0..5).map(move |c| (a, c)))
        .map(|(a, c)| (0..4).map(|b| at(a, b, c)).sum::<f64>() / 4.0)
        .collect();
    check(
        op("ReduceMean", &[("keepdims", AttrValue::Int(0))]),
        &[inp(x.clone()), inp(i64s(&[1], &[1]))],
        &[DType::F32],
        |_| vec![(vec![3, 5], mean.clone())],
    );
}

#[test]
fn squeeze_and_unsqueeze_axes_fed() {
    let x = rand(&[3, 1, 4, 1], 4, -1.0, 1.0);
    check(
        op("Squeeze", &[]),
        &[inp(x.clone()), inp(i64s(&[2], &[1, -1]))],
        &[DType::F32],
        |_| vec![(vec![3, 4], x.to_f64_vec())],
    );
    let y = rand(&[3, 4], 5, -1.0, 1.0);
    check(
        op("Unsqueeze", &[]),
        &[inp(y.clone()), inp(i64s(&[2], &[0, -1]))],
        &[DType::F32],
        |_| vec![(vec![1, 3, 4, 1], y.to_f64_vec())],
    );
}

#[test]
fn expand_shape_fed() {
    let x = rand(&[3, 1], 6, -1.0, 1.0);
    check(
        op("Expand", &[]),
        &[inp(x.clone()), inp(i64s(&[3], &[2, 1, 4]))],
        &[DType::F32],
        |_| gather(&x, &[2, 3, 4], |i| i[1]),
    );
}

#[test]
fn split_sizes_fed() {
    let x = rand(&[7, 2], 7, -1.0, 1.0);
    let xv = x.to_f64_vec();
    check(
        op("Split", &[("axis", AttrValue::Int(0))]),
        &[inp(x.clone()), inp(i64s(&[2], &[2, 5]))],
        &[DType::F32],
        |_| {
            vec![
                (vec![2, 2], xv[..4].to_vec()),
                (vec![5, 2], xv[4..].to_vec()),
            ]
        },
    );
}

/// y = Reshape(x, Concat(Shape(x)[0:1], s + 1)): the shape is arithmetic on a fed input
/// and on Shape. A second value gives another shape (a new plan); the first value again
/// reuses its plan.
const COMPUTED: &str = r#"
graphrun: 1
name: computed_shape
inputs:
  - {name: x, dtype: f32, shape: [2, 12]}
  - {name: s, dtype: i64, shape: [2]}
outputs: [y, z]
initializers:
  - {name: one, dtype: i64, shape: [1], values: [1]}
nodes:
  - {op: Shape, inputs: [x], outputs: [xs], attrs: {start: 0, end: 1}}
  - {op: Add, inputs: [s, one], outputs: [s1]}
  - {op: Concat, inputs: [xs, s1], outputs: [shape], attrs: {axis: 0}}
  - {op: Reshape, inputs: [x, shape], outputs: [r]}
  - {op: Neg, inputs: [r], outputs: [y]}
  - {op: Cast, inputs: [s], outputs: [z], attrs: {to: f32}}
"#;

#[test]
fn computed_shape_planned_per_value_and_cached() {
    let m = Model::from_str(COMPUTED, ".").unwrap();
    let x = rand(&[2, 12], 8, -1.0, 1.0).cast(DType::F32);
    let neg: Vec<f64> = x.to_f64_vec().iter().map(|v| -v).collect();
    let want = |shape: &[usize], s: &[i64]| -> Expected {
        vec![
            (shape.to_vec(), neg.clone()),
            (vec![2], s.iter().map(|&v| v as f64).collect()),
        ]
    };
    for be in backends() {
        let mut s = session(&m.graph, be);
        let names: Vec<&str> = s
            .plan_time_inputs()
            .iter()
            .map(|p| p.name.as_str())
            .collect();
        assert_eq!(names, ["s"], "{be:?}");
        let a = i64s(&[2], &[2, 3]); // → [2, 3, 4]
        let b = i64s(&[2], &[5, 1]); // → [2, 6, 2]
        let run = |s: &mut Session, v: &Tensor| {
            s.run(&feeds(&[("x", x.clone()), ("s", v.clone())]))
                .unwrap()
        };
        // Each value twice in a row, then alternating: on CUDA the repeated step is
        // recorded, and each plan's recording is replayed only for its own values.
        for (k, (v, shape)) in [
            (&a, [2, 3, 4]),
            (&a, [2, 3, 4]),
            (&b, [2, 6, 2]),
            (&b, [2, 6, 2]),
            (&a, [2, 3, 4]),
            (&b, [2, 6, 2]),
            (&a, [2, 3, 4]),
        ]
        .into_iter()
        .enumerate()
        {
            let sv: Vec<i64> = v.to_f64_vec().iter().map(|&d| d as i64).collect();
            assert_outputs(
                &format!("{be:?} run {k}"),
                &run(&mut s, v),
                &want(&shape, &sv),
            );
            let plans = if k < 2 { 1 } else { 2 };
            assert_eq!(
                s.plans_made(),
                plans,
                "{be:?} run {k}: a plan per distinct value"
            );
        }
        // Values that give no valid shape are an error naming the node, not a panic.
        let e = s
            .run(&feeds(&[("x", x.clone()), ("s", i64s(&[2], &[4, 4]))]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("Reshape"), "{e}");
    }
}

/// y = MatMul(Reshape(x, s), w): the gradients for two values of s (two output shapes)
/// against the analytic ones, seeded with a random dY.
#[test]
fn backward_through_reshape_with_fed_shape() {
    let text = r#"
graphrun: 1
name: reshape_grad
inputs:
  - {name: x, dtype: f32, shape: [2, 6]}
  - {name: s, dtype: i64, shape: [n]}
outputs: [y]
initializers:
  - {name: w, dtype: f32, shape: [3, 5], init: {dist: normal, seed: 3}}
nodes:
  - {op: Reshape, inputs: [x, s], outputs: [r]}
  - {op: MatMul, inputs: [r, w], outputs: [y]}
"#;
    // s's length (symbolic) differs between the runs.
    let m = Model::from_str(text, ".").unwrap();
    let w = m.graph.initializer("w").unwrap().tensor.to_f64_vec();
    let x = rand(&[2, 6], 9, -1.0, 1.0).cast(DType::F32);
    let xv = x.to_f64_vec();
    for be in backends() {
        let mut sess = session(&m.graph, be);
        for (k, sv) in [vec![4i64, 3], vec![2, -1, 3], vec![4, 3]]
            .iter()
            .enumerate()
        {
            let out_shape: Vec<usize> = if sv.len() == 2 {
                vec![4, 5]
            } else {
                vec![2, 2, 5]
            };
            let dy = rand(&out_shape, 10 + k as u64, -1.0, 1.0).cast(DType::F32);
            let dyv = dy.to_f64_vec();
            let f = feeds(&[("x", x.clone()), ("s", i64s(&[sv.len()], sv))]);
            let g = sess.backward(&f, &feeds(&[("y", dy)])).unwrap();
            // Rows of r are x's elements in threes: r[i, c] = x_flat[3i + c].
            let y: Vec<f64> = (0..4)
                .flat_map(|i| (0..5).map(move |j| (i, j)))
                .map(|(i, j)| (0..3).map(|c| xv[3 * i + c] * w[c * 5 + j]).sum())
                .collect();
            let dx: Vec<f64> = (0..12)
                .map(|e| {
                    (0..5)
                        .map(|j| dyv[(e / 3) * 5 + j] * w[(e % 3) * 5 + j])
                        .sum()
                })
                .collect();
            let dw: Vec<f64> = (0..15)
                .map(|e| (0..4).map(|i| xv[3 * i + e / 5] * dyv[i * 5 + e % 5]).sum())
                .collect();
            let what = format!("{be:?} s={sv:?}");
            assert_outputs(&what, &g.outputs, &vec![(out_shape.clone(), y)]);
            let grads: Vec<&str> = g.grads.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(grads, ["x", "w"], "{what}");
            assert_outputs(&what, &g.grads, &vec![(vec![2, 6], dx), (vec![3, 5], dw)]);
        }
        // The third run's values were the first's: its backward plan was reused.
        assert_eq!(sess.plans_made(), 2, "{be:?}");
    }
}

/// A training step whose loss reads a Reshape with a fed shape: the same plan-time
/// values key the training plans.
#[test]
fn train_step_with_fed_shape() {
    let text = r#"
graphrun: 1
name: reshape_train
inputs:
  - {name: x, dtype: f32, shape: [2, 6]}
  - {name: s, dtype: i64, shape: [2]}
outputs: [loss]
initializers:
  - {name: w, dtype: f32, shape: [3], init: {dist: normal, seed: 4}}
nodes:
  - {op: Reshape, inputs: [x, s], outputs: [r]}
  - {op: Mul, inputs: [r, w], outputs: [p]}
  - {op: ReduceSum, inputs: [p], outputs: [loss], attrs: {keepdims: 0}}
training:
  loss: loss
  optimizer: {sgd: {lr: 0.5}}
"#;
    let m = Model::from_str(text, ".").unwrap();
    let w0 = m.graph.initializer("w").unwrap().tensor.to_f64_vec();
    let x = rand(&[2, 6], 11, -1.0, 1.0).cast(DType::F32);
    let xv = x.to_f64_vec();
    // loss = Σ_e x_e w[e % 3]; dL/dw[c] = Σ_{e % 3 = c} x_e.
    let loss = |w: &[f64]| (0..12).map(|e| xv[e] * w[e % 3]).sum::<f64>();
    let grad: Vec<f64> = (0..3)
        .map(|c| (0..4).map(|i| xv[3 * i + c]).sum())
        .collect();
    for be in backends() {
        let mut s = session(&m.graph, be);
        let f = feeds(&[("x", x.clone()), ("s", i64s(&[2], &[4, 3]))]);
        let l0 = s.train_step(&f).unwrap();
        let l1 = s.train_step(&f).unwrap();
        let w1: Vec<f64> = w0.iter().zip(&grad).map(|(w, g)| w - 0.5 * g).collect();
        assert!(
            (l0 - loss(&w0)).abs() < 1e-4,
            "{be:?}: {l0} vs {}",
            loss(&w0)
        );
        assert!(
            (l1 - loss(&w1)).abs() < 1e-4,
            "{be:?}: {l1} vs {}",
            loss(&w1)
        );
        assert_eq!(s.plans_made(), 1, "{be:?}");
    }
}

#[test]
fn plan_time_inputs_must_be_small_integers() {
    // A float input cast to the shape.
    let float = r#"
graphrun: 1
name: float_shape
inputs:
  - {name: x, dtype: f32, shape: [2, 6]}
  - {name: sf, dtype: f32, shape: [2]}
outputs: [y]
nodes:
  - {op: Cast, inputs: [sf], outputs: [si], attrs: {to: i64}}
  - {op: Reshape, name: r, inputs: [x, si], outputs: [y]}
"#;
    let m = Model::from_str(float, ".").unwrap();
    let x = rand(&[2, 6], 12, -1.0, 1.0).cast(DType::F32);
    let sf = Tensor::from_vec(&[2], vec![4.0f32, 3.0]).unwrap();
    let e = session(&m.graph, BackendKind::Cpu)
        .run(&feeds(&[("x", x.clone()), ("sf", sf)]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("input 'sf' decides the shape of node 'r' (Reshape)")
            && e.contains("i64 or i32 tensor, got f32[2]"),
        "{e}"
    );
    // An integer input too large to be a plan-time value: as a shape itself it is
    // refused; through a computation (a ReduceMax to Slice's starts) the session runs
    // that first, in a stage of its own.
    let large = |starts: &str| {
        format!(
            r#"
graphrun: 1
name: large_shape
inputs:
  - {{name: x, dtype: f32, shape: [2, 6]}}
  - {{name: big, dtype: i64, shape: [2000]}}
outputs: [y]
nodes:
  - {{op: ReduceMax, inputs: [big], outputs: [k], attrs: {{keepdims: 1}}}}
  - {{op: Slice, name: sl, inputs: [x, {starts}, k], outputs: [y]}}
"#
        )
    };
    let big = rand_ints(&[2000], 13, 0, 3);
    let run = |starts: &str| {
        let m = Model::from_str(&large(starts), ".").unwrap();
        session(&m.graph, BackendKind::Cpu).run(&feeds(&[("x", x.clone()), ("big", big.clone())]))
    };
    let e = run("big").unwrap_err().to_string();
    assert!(
        e.contains("input 'big' decides the starts of node 'sl' (Slice)")
            && e.contains("at most 1024 elements, got i64[2000]"),
        "{e}"
    );
    // k = [2]: rows 2.. of x's 2 rows, none.
    let got = run("k").unwrap();
    assert_eq!(got[0].1.shape(), &[0, 6]);
}

/// A shape that depends on a value no plan can know in advance (here a reduction over
/// an initializer too large to evaluate on the host): the model loads, and a run computes
/// the value first, in a stage of its own.
#[test]
fn shape_from_a_large_initializer_runs_in_stages() {
    let text = r#"
graphrun: 1
name: data_shape
inputs:
  - {name: x, dtype: f32, shape: [4, 6]}
outputs: [y]
initializers:
  - {name: big, dtype: i64, shape: [70000], init: {constant: 1}}
nodes:
  - {op: ReduceMax, inputs: [big], outputs: [k], attrs: {keepdims: 1}}
  - {op: Constant, outputs: [end], attrs: {value: {dtype: i64, shape: [1], values: [3]}}}
  - {op: Slice, name: sl, inputs: [x, k, end], outputs: [y]}
"#;
    let m = Model::from_str(text, ".").unwrap();
    let x = rand(&[4, 6], 16, -1.0, 1.0).cast(DType::F32);
    let want = gather(&x, &[2, 6], |i| (i[0] + 1) * 6 + i[1]);
    // (WGSL has no 64-bit integers to reduce.)
    for be in backends()
        .into_iter()
        .filter(|&b| !graphrun::backends::not_on(b, DType::I64))
    {
        let got = session(&m.graph, be)
            .run(&feeds(&[("x", x.clone())]))
            .unwrap();
        assert_outputs(&format!("{be:?}"), &got, &want);
    }
}

/// The CLI plans for a fed shape (`--input`), and names the input it needs otherwise.
#[test]
fn cli_takes_the_shape_input() {
    let d = std::env::temp_dir().join(format!("graphrun_rtshape_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let model = d.join("m.yaml");
    std::fs::write(&model, COMPUTED).unwrap();
    let x = rand(&[2, 12], 14, -1.0, 1.0).cast(DType::F32);
    x.write_npy(&d.join("x.npy")).unwrap();
    i64s(&[2], &[5, 1]).write_npy(&d.join("s.npy")).unwrap();
    let graphrun = |args: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_graphrun"))
            .args(args)
            .current_dir(&d)
            .output()
            .unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (o.status.code(), text(&o.stdout), text(&o.stderr))
    };
    let (code, out, err) = graphrun(&[
        "m.yaml",
        "--input",
        "x=x.npy",
        "--input",
        "s=s.npy",
        "--out-dir",
        ".",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("y: f32 [2, 6, 2]") && out.contains("z: f32 [2]"),
        "{out}"
    );
    let y = Tensor::read_npy(&d.join("y.npy")).unwrap();
    let neg: Vec<f64> = x.to_f64_vec().iter().map(|v| -v).collect();
    assert_eq!(y.shape(), &[2, 6, 2]);
    assert_eq!(y.to_f64_vec(), neg);
    let (code, out, err) = graphrun(&["inspect", "m.yaml", "--input", "s=s.npy"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("y: f32[2, 6, 2]"), "{out}");
    // Without s: random data would decide the shape, so it is asked for.
    for args in [
        &["m.yaml"][..],
        &["inspect", "m.yaml"],
        &["bench", "m.yaml", "--iters", "1"],
    ] {
        let (code, _, err) = graphrun(args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(
            err.contains("input 's' decides the shape of node 'Reshape_3' (Reshape)")
                && err.contains("--input s=FILE.npy"),
            "{args:?}: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// Shapes that depend on values computed inside the graph from a large input: the
/// values of x above 0.5 (NonZero of a comparison, as a detection head thresholds its
/// scores), how many of those are above 0.9 (a second NonZero, on the first one's
/// result), and a Range to a count read from the data. The session runs it in stages.
const STAGED: &str = r#"
graphrun: 1
name: staged
inputs:
  - {name: x, dtype: f32, shape: [40, 30]}
nodes:
  - {op: Constant, outputs: [half], attrs: {value: {dtype: f32, shape: [], values: [0.5]}}}
  - {op: Greater, inputs: [x, half], outputs: [hot]}
  - {op: NonZero, inputs: [hot], outputs: [idx]}
  - {op: Transpose, inputs: [idx], outputs: [at]}
  - {op: GatherND, inputs: [x, at], outputs: [vals]}
  - {op: Constant, outputs: [hi], attrs: {value: {dtype: f32, shape: [], values: [0.9]}}}
  - {op: Greater, inputs: [vals, hi], outputs: [top]}
  - {op: NonZero, inputs: [top], outputs: [topi]}
  - {op: Shape, inputs: [topi], outputs: [topn]}
  - {op: Cast, inputs: [topn], outputs: [count], attrs: {to: f32}}
  - {op: ReduceMax, inputs: [x], outputs: [mx], attrs: {keepdims: 0}}
  - {op: Constant, outputs: [ten], attrs: {value: {dtype: f32, shape: [], values: [10]}}}
  - {op: Mul, inputs: [mx, ten], outputs: [mx10]}
  - {op: Floor, inputs: [mx10], outputs: [n]}
  - {op: Constant, outputs: [zero], attrs: {value: {dtype: f32, shape: [], values: [0]}}}
  - {op: Constant, outputs: [one], attrs: {value: {dtype: f32, shape: [], values: [1]}}}
  - {op: Range, inputs: [zero, n, one], outputs: [r]}
outputs: [vals, count, r]
"#;

#[test]
fn shapes_decided_by_values_computed_inside_the_graph_run_in_stages() {
    let m = Model::from_str(STAGED, ".").unwrap();
    for (k, scale) in [1.0, 0.7].into_iter().enumerate() {
        let x = rand(&[40, 30], 20 + k as u64, 0.0, scale).cast(DType::F32);
        let xv = x.to_f64_vec();
        let vals: Vec<f64> = xv.iter().copied().filter(|&v| v > 0.5).collect();
        let top = vals.iter().filter(|&&v| v > 0.9).count();
        let mx = xv.iter().copied().fold(f64::MIN, f64::max);
        let n = (mx as f32 * 10.0).floor() as usize;
        let want: Expected = vec![
            (vec![vals.len()], vals.clone()),
            (vec![2], vec![1.0, top as f64]),
            (vec![n], (0..n).map(|i| i as f64).collect()),
        ];
        for be in backends() {
            let mut s = session(&m.graph, be);
            let got = s
                .run(&feeds(&[("x", x.clone())]))
                .unwrap_or_else(|e| panic!("x·{scale} on {be:?}: {e}"));
            assert_outputs(&format!("x·{scale} on {be:?}"), &got, &want);
        }
    }
}
