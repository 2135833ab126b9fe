//! Transpose, Concat, Split, Slice, Expand, Gather and Shape against naive references,
//! on every dtype (they move bytes, so ints and bools must come through unchanged).

mod common;
use common::*;
use graphrun::graph::op::AttrValue;
use graphrun::graph::Op;
use graphrun::{BackendKind, DType, Tensor};

/// `t` as data of dtype `dt`: floats as they are (`check` casts them), ints as
/// values in [-100, 100), bools as `t > 0`.
fn as_dtype(t: &Tensor, dt: DType) -> Tensor {
    let v: Vec<f64> = t
        .to_f64_vec()
        .iter()
        .map(|&x| match dt {
            DType::Bool => (x > 0.0) as u8 as f64,
            d if d.is_int() => (x * 100.0).floor(),
            _ => x,
        })
        .collect();
    Tensor::from_f64(if dt.is_float() { DType::F64 } else { dt }, t.shape(), &v).unwrap()
}

/// Runs `check` with the args `make(dt)` builds: over every float dtype, then i64, i32, bool.
fn check_all(
    op_: Op,
    make: impl Fn(DType) -> Vec<Arg>,
    reference: impl Fn(&[Option<Tensor>]) -> Expected,
) {
    check(op_.clone(), &make(DType::F64), &FLOATS, &reference);
    for dt in [DType::I64, DType::I32, DType::Bool] {
        check(op_.clone(), &make(dt), &[dt], &reference);
    }
}

fn arg(a: &[Option<Tensor>], i: usize) -> &Tensor {
    a[i].as_ref().unwrap()
}

fn flat(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(strides(shape)).map(|(i, s)| i * s).sum()
}

fn ints(v: &[i64]) -> Arg {
    cst(i64s(&[v.len()], v))
}

#[test]
fn transpose_rank4() {
    let x = rand(&[2, 3, 4, 5], 1, -1.0, 1.0);
    for perm in [
        Some(vec![0, 2, 1, 3]),
        Some(vec![3, 1, 0, 2]),
        Some(vec![0, 1, 3, 2]),
        Some(vec![1, 0, 2, 3]),
        None,
    ] {
        let attrs: Vec<(&str, AttrValue)> = match &perm {
            Some(p) => vec![(
                "perm",
                AttrValue::Ints(p.iter().map(|&d| d as i64).collect()),
            )],
            None => vec![],
        };
        let perm = perm.unwrap_or(vec![3, 2, 1, 0]);
        check_all(
            op("Transpose", &attrs),
            |dt| vec![inp(as_dtype(&x, dt))],
            |a| {
                let x = arg(a, 0);
                let v = x.to_f64_vec();
                let shape: Vec<usize> = perm.iter().map(|&p| x.shape()[p]).collect();
                let out = indices(&shape)
                    .iter()
                    .map(|oi| {
                        let mut ii = vec![0; 4];
                        for d in 0..4 {
                            ii[perm[d]] = oi[d];
                        }
                        v[flat(&ii, x.shape())]
                    })
                    .collect();
                vec![(shape, out)]
            },
        );
    }
    // Big enough for the parallel path.
    let x = rand(&[8, 64, 3, 40], 2, -1.0, 1.0);
    check(
        op("Transpose", &[("perm", AttrValue::Ints(vec![2, 0, 3, 1]))]),
        &[inp(x)],
        &FLOATS,
        |a| {
            let x = arg(a, 0);
            let v = x.to_f64_vec();
            let shape = vec![3, 8, 40, 64];
            let out = indices(&shape)
                .iter()
                .map(|o| v[flat(&[o[1], o[3], o[0], o[2]], x.shape())])
                .collect();
            vec![(shape, out)]
        },
    );
}

/// Concatenation of all args along `axis` (non-negative).
fn ref_concat(a: &[Option<Tensor>], axis: usize) -> Expected {
    let xs: Vec<&Tensor> = a.iter().flatten().collect();
    let mut shape = xs[0].shape().to_vec();
    shape[axis] = xs.iter().map(|x| x.shape()[axis]).sum();
    let out = indices(&shape)
        .iter()
        .map(|i| {
            let (mut j, mut k) = (i.clone(), 0);
            while j[axis] >= xs[k].shape()[axis] {
                j[axis] -= xs[k].shape()[axis];
                k += 1;
            }
            xs[k].to_f64_vec()[flat(&j, xs[k].shape())]
        })
        .collect();
    vec![(shape, out)]
}

#[test]
fn concat_axes() {
    let (a, b, c) = (
        rand(&[2, 3, 4], 3, -1.0, 1.0),
        rand(&[2, 1, 4], 4, -1.0, 1.0),
        rand(&[2, 5, 4], 5, -1.0, 1.0),
    );
    check_all(
        op("Concat", &[("axis", AttrValue::Int(-2))]),
        |dt| {
            vec![
                inp(as_dtype(&a, dt)),
                inp(as_dtype(&b, dt)),
                inp(as_dtype(&c, dt)),
            ]
        },
        |x| ref_concat(x, 1),
    );
    let (d, e) = (
        rand(&[2, 3, 2], 6, -1.0, 1.0),
        rand(&[2, 3, 5], 7, -1.0, 1.0),
    );
    check_all(
        op("Concat", &[("axis", AttrValue::Int(-1))]),
        |dt| vec![inp(as_dtype(&d, dt)), inp(as_dtype(&e, dt))],
        |x| ref_concat(x, 2),
    );
    let f = rand(&[1, 3, 4], 8, -1.0, 1.0);
    check_all(
        op("Concat", &[("axis", AttrValue::Int(0))]),
        |dt| vec![inp(as_dtype(&a, dt)), inp(as_dtype(&f, dt))],
        |x| ref_concat(x, 0),
    );
    // Large, with an empty input.
    let (g, h, z) = (
        rand(&[64, 100, 3], 9, -1.0, 1.0),
        rand(&[64, 60, 3], 10, -1.0, 1.0),
        rand(&[64, 0, 3], 11, -1.0, 1.0),
    );
    check(
        op("Concat", &[("axis", AttrValue::Int(1))]),
        &[inp(g), inp(z), inp(h)],
        &FLOATS,
        |x| ref_concat(x, 1),
    );
}

/// Pieces of `x` along `axis` with the given sizes.
fn ref_split(x: &Tensor, axis: usize, sizes: &[usize]) -> Expected {
    let v = x.to_f64_vec();
    let mut at = 0;
    sizes
        .iter()
        .map(|&s| {
            let mut shape = x.shape().to_vec();
            shape[axis] = s;
            let out = indices(&shape)
                .iter()
                .map(|i| {
                    let mut j = i.clone();
                    j[axis] += at;
                    v[flat(&j, x.shape())]
                })
                .collect();
            at += s;
            (shape, out)
        })
        .collect()
}

#[test]
fn split_sizes_and_num_outputs() {
    let x = rand(&[3, 7, 4], 12, -1.0, 1.0);
    // Uneven sizes as an input, on a negative axis.
    check_all(
        op("Split", &[("axis", AttrValue::Int(-2))]),
        |dt| vec![inp(as_dtype(&x, dt)), ints(&[2, 4, 1])],
        |a| ref_split(arg(a, 0), 1, &[2, 4, 1]),
    );
    // Sizes as an attribute, with an empty piece.
    let attrs = [
        ("axis", AttrValue::Int(-1)),
        ("split", AttrValue::Ints(vec![3, 0, 1])),
    ];
    check_all(
        op("Split", &attrs),
        |dt| vec![inp(as_dtype(&x, dt))],
        |a| ref_split(arg(a, 0), 2, &[3, 0, 1]),
    );
    // num_outputs: chunks of ceil(7/3) = 3, the last one smaller.
    let attrs = [
        ("axis", AttrValue::Int(1)),
        ("num_outputs", AttrValue::Int(3)),
    ];
    check_all(
        op("Split", &attrs),
        |dt| vec![inp(as_dtype(&x, dt))],
        |a| ref_split(arg(a, 0), 1, &[3, 3, 1]),
    );
    // Even split by output count, axis 0.
    let y = rand(&[4, 5], 13, -1.0, 1.0);
    check_all(
        op("Split", &[]),
        |dt| vec![inp(as_dtype(&y, dt))],
        |a| ref_split(arg(a, 0), 0, &[2, 2]),
    );
}

/// ONNX Slice, written out from the operator's definition.
fn ref_slice(
    x: &Tensor,
    starts: &[i64],
    ends: &[i64],
    axes: Option<&[i64]>,
    steps: Option<&[i64]>,
) -> Expected {
    let r = x.shape().len();
    let mut picks: Vec<Vec<usize>> = x.shape().iter().map(|&d| (0..d).collect()).collect();
    for k in 0..starts.len() {
        let a = axes.map(|v| v[k]).unwrap_or(k as i64);
        let a = if a < 0 { a + r as i64 } else { a } as usize;
        let step = steps.map(|v| v[k]).unwrap_or(1);
        let d = x.shape()[a] as i64;
        let (mut s, mut e) = (starts[k], ends[k]);
        if s < 0 {
            s += d;
        }
        if e < 0 {
            e += d;
        }
        let mut pick = vec![];
        if step > 0 {
            let (s, e) = (s.clamp(0, d), e.clamp(0, d));
            let mut i = s;
            while i < e {
                pick.push(i as usize);
                i += step;
            }
        } else {
            let (s, e) = (s.clamp(0, d - 1), e.clamp(-1, d - 1));
            let mut i = s;
            while i > e {
                pick.push(i as usize);
                i += step;
            }
        }
        picks[a] = pick;
    }
    let shape: Vec<usize> = picks.iter().map(|p| p.len()).collect();
    let v = x.to_f64_vec();
    let out = indices(&shape)
        .iter()
        .map(|i| {
            let j: Vec<usize> = i.iter().enumerate().map(|(d, &k)| picks[d][k]).collect();
            v[flat(&j, x.shape())]
        })
        .collect();
    vec![(shape, out)]
}

#[test]
fn slice_steps_clamping_axes() {
    let x = rand(&[4, 6, 5], 14, -1.0, 1.0);
    type Case = (
        &'static [i64],
        &'static [i64],
        Option<&'static [i64]>,
        Option<&'static [i64]>,
    );
    let cases: [Case; 8] = [
        (&[3, -1], &[0, 0], None, Some(&[-1, -2])),
        (&[1, 0], &[3, 6], None, None),
        (&[-1], &[-7], Some(&[1]), Some(&[-1])), // whole axis reversed
        (&[4, -100], &[0, 100], Some(&[-1, 0]), Some(&[-2, 1])), // negative step, clamping
        (&[i64::MAX], &[i64::MIN], Some(&[2]), Some(&[-3])), // extreme bounds
        (&[1, 5], &[100, 0], Some(&[0, 1]), Some(&[2, -2])),
        (&[2], &[2], Some(&[1]), None), // empty
        (&[0, 1, 0], &[4, 5, 5], Some(&[2, 1, 0]), Some(&[3, 2, 1])),
    ];
    for (starts, ends, axes, steps) in cases {
        let mut rest = vec![ints(starts), ints(ends)];
        match (axes, steps) {
            (Some(a), Some(s)) => rest.extend([ints(a), ints(s)]),
            (Some(a), None) => rest.push(ints(a)),
            (None, Some(s)) => rest.extend([Arg::None, ints(s)]),
            (None, None) => {}
        }
        check_all(
            op("Slice", &[]),
            |dt| [vec![inp(as_dtype(&x, dt))], rest.clone()].concat(),
            |a| vec![ref_slice(arg(a, 0), starts, ends, axes, steps).remove(0)],
        );
    }
    // Large, parallel path: every other row, reversed columns.
    let y = rand(&[300, 80], 15, -1.0, 1.0);
    let rest = [
        ints(&[0, -1]),
        ints(&[300, -81]),
        ints(&[0, 1]),
        ints(&[2, -1]),
    ];
    check(
        op("Slice", &[]),
        &[vec![inp(y)], rest.to_vec()].concat(),
        &FLOATS,
        |a| {
            ref_slice(
                arg(a, 0),
                &[0, -1],
                &[300, -81],
                Some(&[0, 1]),
                Some(&[2, -1]),
            )
        },
    );
}

fn ref_expand(x: &Tensor, shape: &[usize]) -> Expected {
    let r = shape.len().max(x.shape().len());
    let dim = |s: &[usize], i: usize| {
        if i + s.len() >= r {
            s[i + s.len() - r]
        } else {
            1
        }
    };
    let out_shape: Vec<usize> = (0..r)
        .map(|i| dim(x.shape(), i).max(dim(shape, i)))
        .collect();
    let v = x.to_f64_vec();
    vec![(
        out_shape.clone(),
        indices(&out_shape)
            .iter()
            .map(|i| v[bcast_offset(i, x.shape())])
            .collect(),
    )]
}

#[test]
fn expand_both_directions() {
    let x = rand(&[3, 1, 4], 16, -1.0, 1.0);
    for shape in [vec![2, 3, 5, 4], vec![5, 1], vec![1, 1, 1], vec![3, 2, 1]] {
        let s: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        check_all(
            op("Expand", &[]),
            |dt| vec![inp(as_dtype(&x, dt)), ints(&s)],
            |a| ref_expand(arg(a, 0), &shape),
        );
    }
    let y = rand(&[1, 100], 17, -1.0, 1.0);
    check(
        op("Expand", &[]),
        &[inp(y), ints(&[8, 300, 1])],
        &FLOATS,
        |a| ref_expand(arg(a, 0), &[8, 300, 1]),
    );
}

fn ref_gather(x: &Tensor, idx: &Tensor, axis: usize) -> Expected {
    let d = x.shape()[axis] as i64;
    let ids: Vec<usize> = idx
        .to_i64_vec()
        .iter()
        .map(|&i| if i < 0 { i + d } else { i } as usize)
        .collect();
    let mut shape = x.shape()[..axis].to_vec();
    shape.extend(idx.shape());
    shape.extend(&x.shape()[axis + 1..]);
    let q = idx.shape().len();
    let v = x.to_f64_vec();
    let out = indices(&shape)
        .iter()
        .map(|i| {
            let flat_q = flat(&i[axis..axis + q], idx.shape());
            let mut j = i[..axis].to_vec();
            j.push(ids[flat_q]);
            j.extend(&i[axis + q..]);
            v[flat(&j, x.shape())]
        })
        .collect();
    vec![(shape, out)]
}

#[test]
fn gather_embeddings_axes_and_index_dtypes() {
    let table = rand(&[10, 6], 18, -1.0, 1.0);
    let ids = i64s(&[2, 4], &[3, 3, 0, -1, 9, -10, 5, 3]);
    for idx in [ids.clone(), ids.cast(DType::I32)] {
        check_all(
            op("Gather", &[]),
            |dt| vec![inp(as_dtype(&table, dt)), inp(idx.clone())],
            |a| ref_gather(arg(a, 0), arg(a, 1), 0),
        );
    }
    let x = rand(&[3, 5, 4], 19, -1.0, 1.0);
    let idx = i64s(&[3], &[4, -5, 2]);
    check_all(
        op("Gather", &[("axis", AttrValue::Int(1))]),
        |dt| vec![inp(as_dtype(&x, dt)), inp(idx.clone())],
        |a| ref_gather(arg(a, 0), arg(a, 1), 1),
    );
    let idx2 = i64s(&[2, 2], &[0, 3, -1, 1]);
    check_all(
        op("Gather", &[("axis", AttrValue::Int(-1))]),
        |dt| vec![inp(as_dtype(&x, dt)), inp(idx2.clone())],
        |a| ref_gather(arg(a, 0), arg(a, 1), 2),
    );
    // Scalar index drops the axis.
    check_all(
        op("Gather", &[]),
        |dt| vec![inp(as_dtype(&x, dt)), inp(i64s(&[], &[-2]))],
        |a| ref_gather(arg(a, 0), arg(a, 1), 0),
    );
    // A large embedding lookup.
    let big = rand(&[500, 64], 20, -1.0, 1.0);
    let ids: Vec<i64> = (0..700).map(|i| (i * 37 % 1000) - 500).collect();
    check(
        op("Gather", &[]),
        &[inp(big), inp(i64s(&[7, 100], &ids))],
        &FLOATS,
        |a| ref_gather(arg(a, 0), arg(a, 1), 0),
    );
}

#[test]
fn gather_out_of_range_is_an_error_naming_the_node() {
    let table = rand(&[5, 3], 21, -1.0, 1.0);
    for bad in [5, -6, 1000] {
        let args = [inp(table.clone()), inp(i64s(&[3], &[0, bad, 1]))];
        let e = run_op(BackendKind::Cpu, op("Gather", &[]), &args, 1, DType::F32)
            .expect_err("out-of-range index must fail");
        let msg = e.to_string();
        assert!(
            msg.contains("node 'node' (Gather)")
                && msg.contains(&format!("index {bad}"))
                && msg.contains("size 5"),
            "{msg}"
        );
    }
}

#[test]
fn shape_start_end() {
    let x = rand(&[2, 3, 4, 5], 22, -1.0, 1.0);
    let cases: [(Option<i64>, Option<i64>); 6] = [
        (None, None),
        (Some(1), None),
        (Some(-3), Some(-1)),
        (None, Some(2)),
        (Some(-10), Some(10)),
        (Some(3), Some(1)),
    ];
    for (start, end) in cases {
        let mut attrs = vec![];
        if let Some(s) = start {
            attrs.push(("start", AttrValue::Int(s)));
        }
        if let Some(e) = end {
            attrs.push(("end", AttrValue::Int(e)));
        }
        let want = |_: &[Option<Tensor>]| {
            let c = |v: i64| (if v < 0 { v + 4 } else { v }).clamp(0, 4) as usize;
            let (s, e) = (c(start.unwrap_or(0)), c(end.unwrap_or(4)));
            let dims: Vec<f64> = [2.0, 3.0, 4.0, 5.0][s..e.max(s)].to_vec();
            vec![(vec![dims.len()], dims)]
        };
        check_all(op("Shape", &attrs), |dt| vec![inp(as_dtype(&x, dt))], want);
        // The kernel itself (a session folds Shape at plan time).
        let node = one_node_graph(op("Shape", &attrs), &[inp(x.clone())], 1)
            .nodes
            .remove(0);
        let got = graphrun::backends::cpu::eval_node(&node, &[Some(&x)]).unwrap();
        assert_eq!(got[0].to_f64_vec(), want(&[])[0].1);
    }
}

/// Reshape, Flatten, Identity and Squeeze/Unsqueeze are views in the plan: no step, the
/// output in its input's slot, which no later value may take while a view of it lives.
/// Views next to graph outputs are still copies (the caller gets its own tensor; outputs
/// are updated in place by optimizers). Every backend computes the same values.
#[test]
fn views_share_their_input_slot() {
    let text = r#"
graphrun: 1
name: views
inputs:
  - {name: x, dtype: f32, shape: [4, 6]}
outputs: [y, z, w, y2]
initializers:
  - {name: two, dtype: f32, shape: [], values: [2.0]}
  - {name: three, dtype: f32, shape: [], values: [3.0]}
  - {name: s38, dtype: i64, shape: [2], values: [3, 8]}
  - {name: s46, dtype: i64, shape: [2], values: [4, 6]}
  - {name: s24, dtype: i64, shape: [1], values: [24]}
  - {name: ax0, dtype: i64, shape: [1], values: [0]}
nodes:
  - {op: Mul, inputs: [x, two], outputs: [a]}
  - {op: Reshape, inputs: [a, s38], outputs: [r]}
  - {op: Mul, inputs: [x, three], outputs: [b]}
  - {op: Unsqueeze, inputs: [r, ax0], outputs: [u]}
  - {op: Mul, inputs: [b, three], outputs: [b3]}
  - {op: Squeeze, inputs: [u, ax0], outputs: [sq]}
  - {op: Flatten, inputs: [sq], outputs: [f], attrs: {axis: 1}}
  - {op: Identity, inputs: [f], outputs: [i]}
  - {op: Reshape, inputs: [i, s46], outputs: [back]}
  - {op: Add, inputs: [back, b], outputs: [y0]}
  - {op: Add, inputs: [y0, b3], outputs: [y]}
  - {op: Reshape, inputs: [x, s24], outputs: [z]}
  - {op: Reshape, inputs: [b, s24], outputs: [w]}
  - {op: Identity, inputs: [y], outputs: [q]}
  - {op: Mul, inputs: [q, q], outputs: [y2]}
"#;
    let m = graphrun::Model::from_str(text, ".").unwrap();
    let x = rand(&[4, 6], 7, -1.0, 1.0);
    let xv = x.to_f64_vec();
    let feeds: std::collections::HashMap<String, Tensor> =
        [("x".to_string(), x.cast(DType::F32))].into();
    // y = 2x + 3x + 9x; z = x; w = 3x; y2 = y².
    let want = |o: &str| -> Vec<f64> {
        xv.iter()
            .map(|&v| match o {
                "y" => 14.0 * v,
                "z" => v,
                "w" => 3.0 * v,
                _ => (14.0 * v) * (14.0 * v),
            })
            .collect()
    };
    for be in backends() {
        let mut s = graphrun::Session::new(
            m.graph.clone(),
            graphrun::SessionOptions {
                backend: be,
                ..graphrun::SessionOptions::unfused()
            },
        )
        .unwrap();
        let plan = s.plan_for(&feeds).unwrap();
        let views: Vec<&str> = plan
            .steps
            .iter()
            .map(|st| m.graph.nodes[st.node].op.name())
            .filter(|n| ["Reshape", "Flatten", "Identity", "Squeeze", "Unsqueeze"].contains(n))
            .collect();
        // Only z (a view of a graph input and itself an output), w (an output) and
        // q (a view of an output) are copied.
        assert_eq!(views, ["Reshape", "Reshape", "Identity"], "{be:?}");
        let slot = |v: &str| plan.places[v];
        assert_eq!(slot("r"), slot("a"));
        assert_eq!(slot("back"), slot("a"));
        assert_ne!(slot("b"), slot("a"));
        assert_ne!(slot("b3"), slot("a"));
        assert_ne!(slot("z"), slot("x"));
        let outs = s.run(&feeds).unwrap();
        for (o, t) in &outs {
            let e = rel_err(&t.to_f64_vec(), &want(o));
            assert!(e <= 1e-6, "{be:?} {o}: rel err {e:.2e}");
        }
        assert_eq!(outs.iter().find(|(o, _)| o == "z").unwrap().1.shape(), [24]);
    }
}
