//! Row-wise ops against naive float64 references: Softmax/LogSoftmax,
//! LayerNormalization, ReduceSum/Mean/Max, SoftmaxCrossEntropyLoss.

mod common;
use common::*;
use graphrun::graph::op::AttrValue;
use graphrun::graph::Op;
use graphrun::{DType, Tensor};

fn vals(t: &Option<Tensor>) -> Vec<f64> {
    t.as_ref().expect("argument present").to_f64_vec()
}
fn shp(t: &Option<Tensor>) -> Vec<usize> {
    t.as_ref().expect("argument present").shape().to_vec()
}
fn norm(axis: i64, r: usize) -> usize {
    if axis < 0 {
        (axis + r as i64) as usize
    } else {
        axis as usize
    }
}
fn flat(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(strides(shape)).map(|(i, s)| i * s).sum()
}
fn check_exact_f32(op_: Op, args: &[Arg], reference: impl Fn(&[Option<Tensor>]) -> Expected) {
    check_exact(op_, args, &[DType::F32], reference)
}

// ---- Softmax ----------------------------------------------------------------------------

fn softmax_ref(a: &Option<Tensor>, axis: i64, log: bool) -> Expected {
    let (s, v) = (shp(a), vals(a));
    let ax = norm(axis, s.len());
    let out = indices(&s)
        .iter()
        .map(|idx| {
            let along = |k: usize| {
                let mut j = idx.clone();
                j[ax] = k;
                v[flat(&j, &s)]
            };
            let m = (0..s[ax]).map(along).fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = (0..s[ax]).map(|k| (along(k) - m).exp()).sum();
            let x = v[flat(idx, &s)];
            if log {
                x - m - z.ln()
            } else {
                (x - m).exp() / z
            }
        })
        .collect();
    vec![(s, out)]
}

#[test]
fn softmax_and_log_softmax_any_axis() {
    // Large offsets: a kernel without max-subtraction overflows exp.
    let x = rand(&[2, 3, 4, 5], 1, -5.0, 5.0);
    let big = rand(&[3, 7], 2, 100.0, 110.0);
    for (name, log) in [("Softmax", false), ("LogSoftmax", true)] {
        for axis in [-1, 0, 1, 2, 3, -3] {
            check(
                op(name, &[("axis", AttrValue::Int(axis))]),
                &[inp(x.clone())],
                &FLOATS,
                |a| softmax_ref(&a[0], axis, log),
            );
        }
        check(op(name, &[]), &[inp(x.clone())], &FLOATS, |a| {
            softmax_ref(&a[0], -1, log)
        });
        check(
            op(name, &[]),
            &[inp(big.clone())],
            &[DType::F64, DType::F32],
            |a| softmax_ref(&a[0], -1, log),
        );
        // Offsets of 1e4 (ONNX's test_logsoftmax_large_number): x - (max + ln Σ) rounds at
        // f32's spacing near 1e4 (1e-3); (x - max) - ln Σ does not.
        let huge = rand(&[3, 7, 4], 4, 1e4, 1e4 + 10.0);
        for axis in [-1, 1] {
            check(
                op(name, &[("axis", AttrValue::Int(axis))]),
                &[inp(huge.clone())],
                &[DType::F64, DType::F32],
                |a| softmax_ref(&a[0], axis, log),
            );
        }
        // Many rows (parallel batches) and a long strided axis.
        let wide = randn(&[64, 130, 9], 3);
        check(
            op(name, &[("axis", AttrValue::Int(1))]),
            &[inp(wide.clone())],
            &FLOATS,
            |a| softmax_ref(&a[0], 1, log),
        );
        check(op(name, &[]), &[inp(wide)], &[DType::F32], |a| {
            softmax_ref(&a[0], -1, log)
        });
    }
}

// ---- LayerNormalization -------------------------------------------------------------------

/// Y, Mean and InvStdDev over dims [axis..], with Scale and B broadcast to those dims.
fn layer_norm_ref(a: &[Option<Tensor>], axis: i64, eps: f64) -> Expected {
    let (s, x) = (shp(&a[0]), vals(&a[0]));
    let ax = norm(axis, s.len());
    let nshape = &s[ax..];
    let n: usize = nshape.iter().product();
    let rows = x.len() / n;
    let (g, gs) = (vals(&a[1]), shp(&a[1]));
    let b = a
        .get(2)
        .and_then(|b| b.as_ref())
        .map(|b| (b.to_f64_vec(), b.shape().to_vec()));
    let nidx = indices(nshape);
    let (mut y, mut means, mut invs) = (vec![], vec![], vec![]);
    for r in 0..rows {
        let row = &x[r * n..(r + 1) * n];
        let mean = row.iter().sum::<f64>() / n as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
        let inv = 1.0 / (var + eps).sqrt();
        for (j, idx) in nidx.iter().enumerate() {
            let mut v = (row[j] - mean) * inv * g[bcast_offset(idx, &gs)];
            if let Some((bv, bs)) = &b {
                v += bv[bcast_offset(idx, bs)];
            }
            y.push(v);
        }
        means.push(mean);
        invs.push(inv);
    }
    let mut stat = s.clone();
    for d in &mut stat[ax..] {
        *d = 1;
    }
    vec![(s, y), (stat.clone(), means), (stat, invs)]
}

#[test]
fn layer_norm_last_axis() {
    let x = randn(&[4, 6, 8], 10);
    let (g, b) = (rand(&[8], 11, 0.5, 1.5), randn(&[8], 12));
    check(
        op("LayerNormalization", &[]),
        &[inp(x.clone()), inp(g.clone()), inp(b.clone())],
        &FLOATS,
        |a| layer_norm_ref(a, -1, 1e-5f32 as f64)[..1].to_vec(),
    );
    check(
        op("LayerNormalization", &[]),
        &[inp(x.clone()), inp(g.clone())],
        &FLOATS,
        |a| layer_norm_ref(a, -1, 1e-5f32 as f64)[..1].to_vec(),
    );
    // Many rows: the parallel path.
    let x = randn(&[300, 64], 13);
    let (g, b) = (rand(&[64], 14, 0.5, 1.5), randn(&[64], 15));
    check(
        op("LayerNormalization", &[]),
        &[inp(x), inp(g), inp(b)],
        &FLOATS,
        |a| layer_norm_ref(a, -1, 1e-5f32 as f64)[..1].to_vec(),
    );
}

#[test]
fn layer_norm_inner_axis_with_stats() {
    // Small variance, so that epsilon matters.
    let x = rand(&[2, 3, 4, 5], 20, -0.1, 0.1);
    let eps = 1e-3;
    let attrs = [
        ("axis", AttrValue::Int(1)),
        ("epsilon", AttrValue::Float(eps)),
    ];
    // Scale over the whole normalised shape, B broadcast from its trailing dims.
    let (g, b) = (rand(&[3, 4, 5], 21, 0.5, 1.5), randn(&[4, 5], 22));
    check(
        op("LayerNormalization", &attrs),
        &[inp(x.clone()), inp(g.clone()), inp(b.clone())],
        &FLOATS,
        |a| layer_norm_ref(a, 1, eps as f32 as f64),
    );
    // Negative axis, Scale of shape [1, 5], no B, Mean only.
    let attrs = [
        ("axis", AttrValue::Int(-2)),
        ("epsilon", AttrValue::Float(eps)),
    ];
    let g = rand(&[1, 5], 23, 0.5, 1.5);
    check(
        op("LayerNormalization", &attrs),
        &[inp(x.clone()), inp(g.clone())],
        &FLOATS,
        |a| layer_norm_ref(a, -2, eps as f32 as f64)[..2].to_vec(),
    );
    // The statistics are f32 for f16 input and f64 for f64 input.
    let o = op("LayerNormalization", &attrs);
    let got = run_op(
        backends()[0],
        o.clone(),
        &[inp(x.clone()), inp(g.clone())],
        3,
        DType::F16,
    )
    .unwrap();
    assert_eq!(
        (got[0].dtype(), got[1].dtype(), got[2].dtype()),
        (DType::F16, DType::F32, DType::F32)
    );
    assert_eq!(got[1].shape(), &[2, 3, 1, 1]);
    let got = run_op(backends()[0], o, &[inp(x), inp(g)], 3, DType::F64).unwrap();
    assert_eq!(got[2].dtype(), DType::F64);
}

// ---- Reduce -------------------------------------------------------------------------------

#[derive(Clone, Copy)]
enum Kind {
    Sum,
    Mean,
    Max,
    MeanSquare,
}

fn reduce_ref(a: &Option<Tensor>, axes: &[i64], keepdims: bool, kind: Kind) -> Expected {
    let (s, v) = (shp(a), vals(a));
    let r = s.len();
    let axes: Vec<usize> = if axes.is_empty() {
        (0..r).collect()
    } else {
        axes.iter().map(|&x| norm(x, r)).collect()
    };
    let kept: Vec<usize> = (0..r)
        .map(|d| if axes.contains(&d) { 1 } else { s[d] })
        .collect();
    let mut acc = vec![(0.0f64, 0usize, f64::NEG_INFINITY, 0.0f64); kept.iter().product()];
    for (idx, &x) in indices(&s).iter().zip(&v) {
        let o: Vec<usize> = idx
            .iter()
            .enumerate()
            .map(|(d, &i)| if axes.contains(&d) { 0 } else { i })
            .collect();
        let e = &mut acc[flat(&o, &kept)];
        e.0 += x;
        e.1 += 1;
        e.2 = e.2.max(x);
        e.3 += x * x;
    }
    let out = acc
        .iter()
        .map(|&(sum, n, max, sq)| match kind {
            Kind::Sum => sum,
            Kind::Mean => sum / n as f64,
            Kind::Max => max,
            Kind::MeanSquare => sq / n as f64,
        })
        .collect();
    let shape = if keepdims {
        kept
    } else {
        (0..r).filter(|d| !axes.contains(d)).map(|d| s[d]).collect()
    };
    vec![(shape, out)]
}

/// ReduceMeanSquare is internal (what the `mean_square` rule makes of an MSE).
const KINDS: [(&str, Kind); 4] = [
    ("ReduceSum", Kind::Sum),
    ("ReduceMean", Kind::Mean),
    ("ReduceMax", Kind::Max),
    ("ReduceMeanSquare", Kind::MeanSquare),
];

/// Every kind of `KINDS` over `axes` of `x`, keepdims 0, against `reduce_ref`.
fn check_every_kind(x: &Tensor, axes: &[i64]) {
    for (name, kind) in KINDS {
        let o = op(
            name,
            &[
                ("axes", AttrValue::Ints(axes.to_vec())),
                ("keepdims", AttrValue::Int(0)),
            ],
        );
        check(o, &[inp(x.clone())], &FLOATS, |a| {
            reduce_ref(&a[0], axes, false, kind)
        });
    }
}

#[test]
fn reduce_axes_attr_and_keepdims() {
    let x = randn(&[3, 4, 5], 30);
    let axes_sets: [&[i64]; 7] = [&[1], &[-1], &[0], &[0, 2], &[2, 0], &[-3, -2], &[0, 1, 2]];
    for (name, kind) in KINDS {
        for axes in axes_sets {
            for keep in [true, false] {
                let o = op(
                    name,
                    &[
                        ("axes", AttrValue::Ints(axes.to_vec())),
                        ("keepdims", AttrValue::Int(keep as i64)),
                    ],
                );
                check(o, &[inp(x.clone())], &FLOATS, |a| {
                    reduce_ref(&a[0], axes, keep, kind)
                });
            }
        }
        // No axes: every axis; keepdims defaults to 1.
        check(op(name, &[]), &[inp(x.clone())], &FLOATS, |a| {
            reduce_ref(&a[0], &[], true, kind)
        });
        check(
            op(name, &[("keepdims", AttrValue::Int(0))]),
            &[inp(x.clone())],
            &FLOATS,
            |a| reduce_ref(&a[0], &[], false, kind),
        );
    }
}

#[test]
fn reduce_alternating_axes() {
    // Several separate reduced runs: the kernel's offset walk must wrap correctly.
    let x = randn(&[2, 3, 4, 5, 3], 35);
    let axes_sets: [&[i64]; 5] = [&[0, 2], &[1, 3], &[0, 2, 4], &[0, 1, 3], &[1, 2, 4]];
    for axes in axes_sets {
        check_every_kind(&x, axes);
    }
}

#[test]
fn reduce_axes_input() {
    let x = randn(&[2, 3, 4, 5], 31);
    for (name, kind) in KINDS {
        for axes in [vec![-1, 1], vec![0], vec![2], vec![3, 0, 1]] {
            for keep in [true, false] {
                let o = op(name, &[("keepdims", AttrValue::Int(keep as i64))]);
                check(
                    o,
                    &[inp(x.clone()), cst(i64s(&[axes.len()], &axes))],
                    &FLOATS,
                    |a| reduce_ref(&a[0], &axes, keep, kind),
                );
            }
        }
    }
    // noop_with_empty_axes with an empty axes input: identity.
    let o = op("ReduceSum", &[("noop_with_empty_axes", AttrValue::Int(1))]);
    check(o, &[inp(x.clone()), cst(i64s(&[0], &[]))], &FLOATS, |a| {
        vec![(shp(&a[0]), vals(&a[0]))]
    });
}

#[test]
fn reduce_large_parallel() {
    // A max pool's window axis (Im2Col's columns viewed as [N, C, K, H, W]): many outputs
    // of a few elements, a thread each on WebGPU.
    check_every_kind(&randn(&[2, 3, 9, 20, 20], 33), &[2]);
    // Everything reduced takes the chunked-partials path.
    let x = randn(&[50, 64, 30], 32);
    for axes in [vec![1], vec![0], vec![2], vec![0, 2], vec![0, 1, 2]] {
        check_every_kind(&x, &axes);
    }
}

#[test]
fn reduce_leading_axes_keeping_the_last() {
    // A channels-last convolution's bias gradient (NHWC summed over N, H and W) and a
    // LayerNorm's parameter gradients: CUDA folds the columns in row chunks (33 and 300
    // columns do not divide its groups of 32; a size-1 axis sits among the reduced ones).
    let shapes: [(&[usize], &[i64]); 3] = [
        (&[4, 9, 7, 33], &[0, 1, 2]),
        (&[300, 1, 300], &[0, 1]),
        (&[2, 600, 64], &[0, 1]),
    ];
    for (i, (shape, axes)) in shapes.into_iter().enumerate() {
        check_every_kind(&randn(shape, 70 + i as u64), axes);
    }
}

#[test]
fn reduce_over_batch_and_space_keeping_channels() {
    // A convolution's bias gradient (NCHW summed over N, H and W) and a global pool (the
    // spatial axes alone): CUDA reads these as [outer, channels, inner], split into parts
    // of the outer rows where there are few channels (the first shape); inner runs of 42
    // and 400 elements do not divide a block of threads. The integer sums of 25600
    // elements an output need more than one thread each on lavapipe, which ends a shader
    // loop after 65535 iterations.
    let shapes: [(&[usize], &[i64]); 4] = [
        (&[64, 3, 20, 20], &[0, 2, 3]),
        (&[8, 5, 6, 7], &[0, 2, 3]),
        (&[8, 5, 1, 6, 7], &[0, 2, 3, 4]),
        (&[3, 5, 6, 7], &[2, 3]),
    ];
    for (i, (shape, axes)) in shapes.into_iter().enumerate() {
        check_every_kind(&randn(shape, 40 + i as u64), axes);
        let ints = rand_ints(shape, 50 + i as u64, -1000, 1000).cast(DType::I32);
        let o = op("ReduceSum", &[("axes", AttrValue::Ints(axes.to_vec()))]);
        check_exact_f32(o, &[inp(ints)], |a| {
            reduce_ref(&a[0], axes, true, Kind::Sum)
        });
    }
}

#[test]
fn reduce_sum_max_on_ints() {
    for dt in [DType::I64, DType::I32] {
        let x = rand_ints(&[3, 4, 5], 33, -1000, 1000).cast(dt);
        for (name, kind) in [("ReduceSum", Kind::Sum), ("ReduceMax", Kind::Max)] {
            for axes in [vec![1], vec![-1, 0], vec![]] {
                for keep in [true, false] {
                    let mut attrs = vec![("keepdims", AttrValue::Int(keep as i64))];
                    if !axes.is_empty() {
                        attrs.push(("axes", AttrValue::Ints(axes.clone())));
                    }
                    check_exact_f32(op(name, &attrs), &[inp(x.clone())], |a| {
                        reduce_ref(&a[0], &axes, keep, kind)
                    });
                }
            }
        }
        // All-negative values: Max must not start from 0.
        let neg = rand_ints(&[4, 6], 34, -100, -1).cast(dt);
        check_exact_f32(
            op("ReduceMax", &[("axes", AttrValue::Ints(vec![1]))]),
            &[inp(neg)],
            |a| reduce_ref(&a[0], &[1], true, Kind::Max),
        );
    }
}

#[test]
fn reduce_max_over_an_empty_axis_is_the_lowest_value() {
    // ONNX (opset 18, test_reduce_max_empty_set): reducing nothing gives the dtype's
    // lowest value, -inf for floats; the other axes keep their (empty or not) sizes.
    let x = Tensor::zeros(DType::F32, &[2, 0, 4]);
    let max = op("ReduceMax", &[("axes", AttrValue::Ints(vec![1]))]);
    for backend in backends() {
        let y = run_op(backend, max.clone(), &[inp(x.clone())], 1, DType::F32).unwrap();
        assert_eq!(y[0].shape(), [2, 1, 4]);
        assert!(y[0].to_f64_vec().iter().all(|v| *v == f64::NEG_INFINITY));
    }
}

// ---- SoftmaxCrossEntropyLoss ----------------------------------------------------------------

/// ONNX SoftmaxCrossEntropyLoss: loss and log_prob for scores [N, C, d...].
fn sce_ref(a: &[Option<Tensor>], reduction: &str, ignore: Option<i64>) -> Expected {
    let (s, x) = (shp(&a[0]), vals(&a[0]));
    let labels = a[1].as_ref().unwrap().to_i64_vec();
    let w = a.get(2).and_then(|w| w.as_ref()).map(|w| w.to_f64_vec());
    let (n, c) = (s[0], s[1]);
    let d: usize = s[2..].iter().product();
    let at = |i: usize, k: usize, p: usize| x[(i * c + k) * d + p];
    let mut logp = vec![0.0; x.len()];
    let (mut losses, mut wsum) = (vec![], 0.0);
    for i in 0..n {
        for p in 0..d {
            let m = (0..c)
                .map(|k| at(i, k, p))
                .fold(f64::NEG_INFINITY, f64::max);
            let lse = m + (0..c).map(|k| (at(i, k, p) - m).exp()).sum::<f64>().ln();
            for k in 0..c {
                logp[(i * c + k) * d + p] = at(i, k, p) - lse;
            }
            let l = labels[i * d + p];
            if Some(l) == ignore {
                losses.push(0.0);
                continue;
            }
            let wl = w.as_ref().map(|w| w[l as usize]).unwrap_or(1.0);
            wsum += wl;
            losses.push(-wl * (at(i, l as usize, p) - lse));
        }
    }
    let mut lshape = vec![n];
    lshape.extend_from_slice(&s[2..]);
    let loss = match reduction {
        "none" => (lshape, losses),
        "sum" => (vec![], vec![losses.iter().sum()]),
        _ => (vec![], vec![losses.iter().sum::<f64>() / wsum]),
    };
    vec![loss, (s, logp)]
}

fn sce_op(reduction: &str, ignore: Option<i64>) -> Op {
    let mut attrs = vec![("reduction", AttrValue::Str(reduction.into()))];
    if let Some(i) = ignore {
        attrs.push(("ignore_index", AttrValue::Int(i)));
    }
    op("SoftmaxCrossEntropyLoss", &attrs)
}

#[test]
fn softmax_cross_entropy_2d() {
    let scores = randn(&[8, 5], 40);
    let labels = i64s(&[8], &[0, 4, 2, 1, 1, 3, 4, 2]);
    let w = rand(&[5], 41, 0.2, 2.0);
    for red in ["mean", "sum", "none"] {
        // Plain, with weights, with ignore_index (a valid class and an out-of-range one),
        // and both; log_prob as a second output.
        check(
            sce_op(red, None),
            &[inp(scores.clone()), inp(labels.clone())],
            &FLOATS,
            |a| sce_ref(a, red, None),
        );
        check(
            sce_op(red, None),
            &[inp(scores.clone()), inp(labels.clone()), inp(w.clone())],
            &FLOATS,
            |a| sce_ref(a, red, None),
        );
        check(
            sce_op(red, Some(1)),
            &[inp(scores.clone()), inp(labels.clone()), inp(w.clone())],
            &FLOATS,
            |a| sce_ref(a, red, Some(1)),
        );
        check(
            sce_op(red, Some(1)),
            &[inp(scores.clone()), inp(labels.clone())],
            &FLOATS,
            |a| sce_ref(a, red, Some(1)),
        );
        let with_pad = i64s(&[8], &[0, -100, 2, 1, -100, 3, 4, 2]);
        check(
            sce_op(red, Some(-100)),
            &[inp(scores.clone()), inp(with_pad.clone()), inp(w.clone())],
            &FLOATS,
            |a| sce_ref(a, red, Some(-100)),
        );
        // Loss alone (one output).
        check(
            sce_op(red, Some(-100)),
            &[inp(scores.clone()), inp(with_pad.cast(DType::I32))],
            &FLOATS,
            |a| sce_ref(a, red, Some(-100))[..1].to_vec(),
        );
    }
}

/// Rows of many classes (a language model's vocabulary, here 700: each of a row's
/// threads on CUDA takes several), with a padded position.
#[test]
fn softmax_cross_entropy_many_classes() {
    let scores = randn(&[6, 700], 44);
    let labels = i64s(&[6], &[0, 699, -100, 350, 1, 257]);
    for red in ["mean", "sum", "none"] {
        check(
            sce_op(red, Some(-100)),
            &[inp(scores.clone()), inp(labels.clone())],
            &FLOATS,
            |a| sce_ref(a, red, Some(-100)),
        );
    }
}

/// A vocabulary of 70000 classes, loss and gradient: WebGPU gives each element a
/// workgroup past 4096 classes (a thread's loop over them would stop early on lavapipe,
/// which ends a loop after 65535 iterations).
#[test]
fn softmax_cross_entropy_past_65535_classes() {
    let c = 70000;
    let scores = randn(&[3, c], 45);
    let labels = i64s(&[3], &[69999, -100, 12345]);
    for red in ["mean", "sum"] {
        check(
            sce_op(red, Some(-100)),
            &[inp(scores.clone()), inp(labels.clone())],
            &[DType::F32],
            |a| sce_ref(a, red, Some(-100)),
        );
    }
    // The gradient of the mean loss, seeded with 0.5: (softmax − one-hot) · 0.5 / 2 for
    // the two counted rows, 0 for the padded one.
    let grad = op(
        "SoftmaxCrossEntropyLossGrad",
        &[
            ("reduction", AttrValue::Str("mean".into())),
            ("ignore_index", AttrValue::Int(-100)),
        ],
    );
    let args = [
        inp(f64s(&[], &[0.5])),
        inp(scores.clone()),
        inp(labels.clone()),
    ];
    check(grad, &args, &[DType::F32], |a| {
        let x = vals(&a[1]);
        let mut g = vec![0.0; x.len()];
        for (row, &l) in [69999i64, -100, 12345].iter().enumerate() {
            if l < 0 {
                continue;
            }
            let r = &x[row * c..][..c];
            let m = r.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = r.iter().map(|v| (v - m).exp()).sum();
            for k in 0..c {
                let hot = if k as i64 == l { 1.0 } else { 0.0 };
                g[row * c + k] = ((r[k] - m).exp() / z - hot) * 0.5 / 2.0;
            }
        }
        vec![(vec![3, c], g)]
    });
}

#[test]
fn softmax_cross_entropy_nd() {
    let scores = randn(&[3, 4, 2, 3], 50);
    let mut labels = rand_ints(&[3, 2, 3], 51, 0, 4).to_i64_vec();
    labels[4] = 7; // ignored below
    let labels = i64s(&[3, 2, 3], &labels);
    let w = rand(&[4], 52, 0.2, 2.0);
    for red in ["mean", "sum", "none"] {
        check(
            sce_op(red, Some(7)),
            &[inp(scores.clone()), inp(labels.clone()), inp(w.clone())],
            &FLOATS,
            |a| sce_ref(a, red, Some(7)),
        );
        check(
            sce_op(red, Some(7)),
            &[inp(scores.clone()), inp(labels.cast(DType::I32))],
            &FLOATS,
            |a| sce_ref(a, red, Some(7)),
        );
    }
    // Many samples: the parallel path.
    let scores = randn(&[200, 10, 7], 53);
    let labels = rand_ints(&[200, 7], 54, 0, 10);
    check(
        sce_op("mean", None),
        &[inp(scores), inp(labels)],
        &FLOATS,
        |a| sce_ref(a, "mean", None),
    );
}

#[test]
fn softmax_cross_entropy_bad_label_is_an_error() {
    let scores = randn(&[4, 5], 60);
    for (bad, ignore) in [(5, None), (-1, None), (9, Some(-100)), (-100, Some(0))] {
        let labels = i64s(&[4], &[0, bad, 2, 3]);
        let r = run_op(
            backends()[0],
            sce_op("mean", ignore),
            &[inp(scores.clone()), inp(labels)],
            1,
            DType::F32,
        );
        let e = r.expect_err("an out-of-range label must fail").to_string();
        assert!(
            e.contains("node 'node' (SoftmaxCrossEntropyLoss)") && e.contains(&bad.to_string()),
            "{e}"
        );
    }
}

#[test]
fn long_lines_on_every_backend() {
    // Lines of 70000 and 40000 elements: WebGPU's thread-per-line kernels took them in one
    // loop, which lavapipe ends after 65535 iterations (an ArgMax stopped at the first
    // 99.9 it met, a CumSum left the tail at 0).
    let n = 70000;
    let mut v = rand(&[2, n], 60, -4.0, 4.0).to_f64_vec();
    v[10] = 10.0; // line 0: the maximum twice, the minimum twice
    v[n - 10] = 10.0;
    v[100] = -10.0;
    v[n - 1] = -10.0;
    v[n + 50000] = f64::NAN; // line 1: NaN twice
    v[n + 60000] = f64::NAN;
    let x = Tensor::from_f64(DType::F32, &[2, n], &v).unwrap();
    for (name, min) in [("ArgMax", false), ("ArgMin", true)] {
        for last in [false, true] {
            let o = op(
                name,
                &[
                    ("axis", AttrValue::Int(1)),
                    ("keepdims", AttrValue::Int(0)),
                    ("select_last_index", AttrValue::Int(last as i64)),
                ],
            );
            check_exact_f32(o, &[inp(x.clone())], |a| {
                let v = vals(&a[0]);
                let pick = |line: &[f64]| {
                    let mut at = 0;
                    for (i, &x) in line.iter().enumerate().skip(1) {
                        let b = line[at];
                        let better = match (x.is_nan(), b.is_nan()) {
                            (true, true) => last,
                            (true, false) => true,
                            (false, true) => false,
                            _ => (if min { x < b } else { x > b }) || (last && x == b),
                        };
                        if better {
                            at = i;
                        }
                    }
                    at as f64
                };
                vec![(vec![2], vec![pick(&v[..n]), pick(&v[n..])])]
            });
        }
    }
    // CumSum of whole numbers (exact in f32) and of i64s, every direction.
    let m = 40000;
    let whole = rand_ints(&[3, m], 61, -4, 5);
    for x in [whole.cast(DType::F32), whole.clone()] {
        for (excl, rev) in [(false, false), (true, false), (false, true), (true, true)] {
            let o = op(
                "CumSum",
                &[
                    ("exclusive", AttrValue::Int(excl as i64)),
                    ("reverse", AttrValue::Int(rev as i64)),
                ],
            );
            check_exact_f32(o, &[inp(x.clone()), cst(i64s(&[], &[1]))], |a| {
                let v = vals(&a[0]);
                let mut out = vec![0.0; v.len()];
                for line in 0..3 {
                    let mut acc = 0.0;
                    for s in 0..m {
                        let i = line * m + if rev { m - 1 - s } else { s };
                        if !excl {
                            acc += v[i];
                        }
                        out[i] = acc;
                        if excl {
                            acc += v[i];
                        }
                    }
                }
                vec![(vec![3, m], out)]
            });
        }
    }
}

/// LayerNormalization's parameter gradients summed over 70000 rows: WebGPU sums a
/// column's rows in chunks of dispatches (lavapipe ends a shader loop after 65535
/// iterations). Whole numbers, so that every sum is exact in f32.
#[test]
fn layer_norm_parameter_gradients_over_70000_rows() {
    let (rows, n) = (70000, 2);
    let dy = rand_ints(&[rows, n], 70, -2, 3).cast(DType::F64);
    let x = rand_ints(&[rows, n], 71, -3, 4).cast(DType::F64);
    let g = f64s(&[n], &[2.0, -1.0]);
    let (mean, inv) = (
        f64s(&[rows, 1], &vec![0.0; rows]),
        f64s(&[rows, 1], &vec![1.0; rows]),
    );
    let args = [inp(dy), inp(x), inp(g), inp(mean), inp(inv)];
    check_exact_f32(op("LayerNormalizationGrad", &[]), &args, |a| {
        let (dy, x, g) = (vals(&a[0]), vals(&a[1]), vals(&a[2]));
        let (mut dx, mut ds, mut db) = (vec![0.0; rows * n], vec![0.0; n], vec![0.0; n]);
        for r in 0..rows {
            let row = |v: &[f64], j: usize| v[r * n + j];
            let mg = (0..n).map(|j| row(&dy, j) * g[j]).sum::<f64>() / n as f64;
            let mgx = (0..n).map(|j| row(&dy, j) * g[j] * row(&x, j)).sum::<f64>() / n as f64;
            for j in 0..n {
                dx[r * n + j] = row(&dy, j) * g[j] - mg - row(&x, j) * mgx;
                ds[j] += row(&dy, j) * row(&x, j);
                db[j] += row(&dy, j);
            }
        }
        vec![(vec![rows, n], dx), (vec![n], ds), (vec![n], db)]
    });
}
