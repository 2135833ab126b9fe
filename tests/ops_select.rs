//! The selections and the product reductions: ArgMax, ArgMin, TopK, ReduceProd and CumProd,
//! on every backend and dtype, against float64 references written here from ONNX's
//! definitions (numpy's argmax, the reference TopK's sort): ties (first or last index),
//! NaN, negative axes, keepdims both ways, empty sets, and TopK's k fed at run time.

mod common;
use common::*;
use graphrun::graph::op::AttrValue as V;
use graphrun::rng::Rng;
use graphrun::{DType, Tensor};

/// Small integers in [-3, 3) as f64: exact in every dtype, and full of ties.
fn ties(shape: &[usize], seed: u64) -> Tensor {
    let mut r = Rng::new(seed);
    let v: Vec<f64> = (0..shape.iter().product())
        .map(|_| r.int_in(-3, 3) as f64)
        .collect();
    f64s(shape, &v)
}

/// `t` with NaN at every `every`-th element (from `from`).
fn with_nans(t: &Tensor, from: usize, every: usize) -> Tensor {
    let mut v = t.to_f64_vec();
    for x in v.iter_mut().skip(from).step_by(every) {
        *x = f64::NAN;
    }
    f64s(t.shape(), &v)
}

/// The lines of `shape` along axis `a`: for each (outer, inner) pair in row-major order,
/// the flat offsets of its elements.
fn lines(shape: &[usize], a: usize) -> Vec<Vec<usize>> {
    let outer: usize = shape[..a].iter().product();
    let inner: usize = shape[a + 1..].iter().product();
    let d = shape[a];
    (0..outer * inner)
        .map(|l| {
            let base = (l / inner) * d * inner + l % inner;
            (0..d).map(|s| base + s * inner).collect()
        })
        .collect()
}

fn norm(axis: i64, r: usize) -> usize {
    (if axis < 0 { axis + r as i64 } else { axis }) as usize
}

/// numpy's argmax (argmin with `min`): the first extreme, NaN the extreme; with `last` the
/// last one (numpy on the flipped line, as ONNX's reference).
fn arg_ref(line: &[f64], min: bool, last: bool) -> usize {
    let order: Vec<usize> = if last {
        (0..line.len()).rev().collect()
    } else {
        (0..line.len()).collect()
    };
    let mut best = order[0];
    for &i in &order[1..] {
        let (v, b) = (line[i], line[best]);
        if b.is_nan() {
            break;
        }
        if v.is_nan() || (min && v < b) || (!min && v > b) {
            best = i;
        }
    }
    best
}

fn arg_case(x: &Tensor, axis: i64, keepdims: bool, min: bool, last: bool) {
    let name = if min { "ArgMin" } else { "ArgMax" };
    let op_ = op(
        name,
        &[
            ("axis", V::Int(axis)),
            ("keepdims", V::Int(keepdims as i64)),
            ("select_last_index", V::Int(last as i64)),
        ],
    );
    let want = |a: &[Option<Tensor>]| {
        let t = a[0].as_ref().unwrap();
        let (v, s) = (t.to_f64_vec(), t.shape().to_vec());
        let ax = norm(axis, s.len());
        let out: Vec<f64> = lines(&s, ax)
            .iter()
            .map(|l| {
                let line: Vec<f64> = l.iter().map(|&o| v[o]).collect();
                arg_ref(&line, min, last) as f64
            })
            .collect();
        let mut shape = s.clone();
        if keepdims {
            shape[ax] = 1;
        } else {
            shape.remove(ax);
        }
        vec![(shape, out)]
    };
    if x.dtype().is_float() {
        check_exact(op_, &[inp(x.clone())], &FLOATS, want);
    } else {
        check_exact(op_, &[inp(x.clone())], &[DType::F32], want);
    }
}

#[test]
fn argmax_argmin_every_axis_ties_and_nan() {
    let x = ties(&[3, 4, 5], 1);
    let nan = with_nans(&randn(&[3, 4, 5], 2), 3, 7);
    for axis in [0i64, 1, 2, -1, -3] {
        for keepdims in [true, false] {
            for (min, last) in [(false, false), (false, true), (true, false), (true, true)] {
                arg_case(&x, axis, keepdims, min, last);
                arg_case(&nan, axis, keepdims, min, last);
                for dt in [DType::I64, DType::I32] {
                    arg_case(&x.cast(dt), axis, keepdims, min, last);
                }
            }
        }
    }
    // A long line (one thread walks it on the GPUs), a 1-D input, and rank 0 output.
    arg_case(&ties(&[2, 3000], 3), -1, false, false, true);
    arg_case(&ties(&[7], 4), 0, false, true, false);
}

#[test]
fn argmax_of_an_empty_axis_is_an_error() {
    let x = f64s(&[2, 0], &[]);
    let e = run_op(
        graphrun::BackendKind::Cpu,
        op("ArgMax", &[("axis", V::Int(1))]),
        &[inp(x)],
        1,
        DType::F32,
    )
    .expect_err("nothing to pick")
    .to_string();
    assert!(e.contains("ArgMax") && e.contains("size 0"), "{e}");
}

/// The reference TopK: the line sorted by value (descending for the largest, NaN above
/// every number), equal values by index, the first k.
fn topk_ref(line: &[f64], k: usize, largest: bool) -> Vec<usize> {
    let mut ix: Vec<usize> = (0..line.len()).collect();
    let up = |a: f64, b: f64| match (a.is_nan(), b.is_nan()) {
        (true, true) => std::cmp::Ordering::Equal,
        (true, false) => std::cmp::Ordering::Greater,
        (false, true) => std::cmp::Ordering::Less,
        _ => a.partial_cmp(&b).unwrap(),
    };
    ix.sort_by(|&p, &q| {
        let o = up(line[p], line[q]);
        (if largest { o.reverse() } else { o }).then(p.cmp(&q))
    });
    ix.truncate(k);
    ix
}

/// TopK of `x` along `axis` with `k`, k fed as a graph input (`runtime`, the plan is
/// made for its value) or an initializer; `both`: Values and Indices, else Values only.
fn topk_case(x: &Tensor, axis: i64, k: usize, largest: bool, runtime: bool, both: bool) {
    let op_ = op(
        "TopK",
        &[("axis", V::Int(axis)), ("largest", V::Int(largest as i64))],
    );
    let kt = i64s(&[1], &[k as i64]);
    let args = [inp(x.clone()), if runtime { inp(kt) } else { cst(kt) }];
    let want = |a: &[Option<Tensor>]| {
        let t = a[0].as_ref().unwrap();
        let (v, s) = (t.to_f64_vec(), t.shape().to_vec());
        let ax = norm(axis, s.len());
        let (outer, inner) = (
            s[..ax].iter().product::<usize>(),
            s[ax + 1..].iter().product::<usize>(),
        );
        let mut shape = s.clone();
        shape[ax] = k;
        let n = outer * k * inner;
        let (mut vals, mut idx) = (vec![0.0; n], vec![0.0; n]);
        for (l, offs) in lines(&s, ax).iter().enumerate() {
            let line: Vec<f64> = offs.iter().map(|&o| v[o]).collect();
            for (j, &i) in topk_ref(&line, k, largest).iter().enumerate() {
                let at = ((l / inner) * k + j) * inner + l % inner;
                vals[at] = line[i];
                idx[at] = i as f64;
            }
        }
        let mut out = vec![(shape.clone(), vals)];
        if both {
            out.push((shape, idx));
        }
        out
    };
    if x.dtype().is_float() {
        check_exact(op_, &args, &FLOATS, want);
    } else {
        check_exact(op_, &args, &[DType::F32], want);
    }
}

#[test]
fn topk_every_axis_ties_nan_and_k_at_run_time() {
    let x = ties(&[3, 6, 5], 10);
    let nan = with_nans(&randn(&[3, 6, 5], 11), 2, 5);
    for axis in [0i64, 1, 2, -1, -2] {
        let d = x.shape()[norm(axis, 3)];
        for k in [0, 1, 2, d] {
            for largest in [true, false] {
                topk_case(&x, axis, k, largest, false, true);
                topk_case(&nan, axis, k, largest, true, true);
                topk_case(&x.cast(DType::I64), axis, k, largest, true, true);
                topk_case(&x.cast(DType::I32), axis, k, largest, false, true);
            }
        }
    }
    // Values alone (the indices go to scratch), and a long line.
    topk_case(&x, 1, 3, true, true, false);
    topk_case(&ties(&[2, 700], 12), -1, 9, false, true, true);
    // Many picks from a long line, two lines side by side (inner axis): k·d far past
    // 65535 steps (llvmpipe stops a shader loop there).
    topk_case(&randn(&[3375, 2], 13), 0, 450, true, false, true);
}

/// k fed at run time: each value gets its own plan, in one session.
#[test]
fn topk_k_fed_at_run_time_replans() {
    use graphrun::{Session, SessionOptions};
    let x = randn(&[4, 9], 20).cast(DType::F32);
    for backend in backends() {
        let g = one_node_graph(op("TopK", &[]), &[inp(x.clone()), inp(i64s(&[1], &[1]))], 2);
        let opts = SessionOptions {
            backend,
            ..SessionOptions::unfused()
        };
        let mut s = Session::new(g, opts).unwrap();
        for k in [1usize, 4, 9, 2] {
            let feeds = feeds_of(&[inp(x.clone()), inp(i64s(&[1], &[k as i64]))]);
            let out = s
                .run(&feeds)
                .unwrap_or_else(|e| panic!("{backend:?} k {k}: {e}"));
            assert_eq!(out[0].1.shape(), &[4, k], "{backend:?}");
            let xv = x.to_f64_vec();
            let want: Vec<f64> = (0..4)
                .flat_map(|r| topk_ref(&xv[r * 9..(r + 1) * 9], k, true).into_iter())
                .map(|i| i as f64)
                .collect();
            assert_eq!(out[1].1.to_f64_vec(), want, "{backend:?} k {k}");
        }
        // A k beyond the axis is an error naming the node, not a panic.
        let feeds = feeds_of(&[inp(x.clone()), inp(i64s(&[1], &[10]))]);
        let e = s.run(&feeds).expect_err("k > 9").to_string();
        assert!(e.contains("TopK") && e.contains("k = 10"), "{e}");
    }
}

/// Products of values near 1 (and exact zeros), over the given axes.
fn prod_case(x: &Tensor, axes: Option<&[i64]>, as_input: bool, keepdims: bool, noop: bool) {
    let mut attrs = vec![
        ("keepdims", V::Int(keepdims as i64)),
        ("noop_with_empty_axes", V::Int(noop as i64)),
    ];
    let mut args = vec![inp(x.clone())];
    match (axes, as_input) {
        (Some(a), false) => attrs.push(("axes", V::Ints(a.to_vec()))),
        (Some(a), true) => args.push(cst(i64s(&[a.len()], a))),
        (None, _) => {}
    }
    let op_ = op("ReduceProd", &attrs);
    let want = |a: &[Option<Tensor>]| {
        let t = a[0].as_ref().unwrap();
        let (v, s) = (t.to_f64_vec(), t.shape().to_vec());
        let r = s.len();
        let red: Vec<usize> = match axes {
            Some(a) if !a.is_empty() => a.iter().map(|&x| norm(x, r)).collect(),
            _ if noop => return vec![(s, v)],
            _ => (0..r).collect(),
        };
        let kept: Vec<usize> = s
            .iter()
            .enumerate()
            .map(|(d, &n)| if red.contains(&d) { 1 } else { n })
            .collect();
        let mut out = vec![1.0; kept.iter().product()];
        for (p, x) in indices(&s).iter().zip(&v) {
            let q: Vec<usize> = p
                .iter()
                .enumerate()
                .map(|(d, &i)| if red.contains(&d) { 0 } else { i })
                .collect();
            out[q
                .iter()
                .zip(strides(&kept))
                .map(|(a, b)| a * b)
                .sum::<usize>()] *= x;
        }
        let shape = if keepdims {
            kept
        } else {
            (0..r).filter(|d| !red.contains(d)).map(|d| s[d]).collect()
        };
        vec![(shape, out)]
    };
    if x.dtype().is_float() {
        check(op_, &args, &FLOATS, want);
    } else {
        check_exact(op_, &args, &[DType::F32], want);
    }
}

/// ±1 with a 2 and a 0.5 every thousand elements: every partial product is a power of two
/// in range, exact in every dtype, whatever order a backend multiplies in.
fn signs_and_halves(shape: &[usize], seed: u64) -> Tensor {
    let mut r = Rng::new(seed);
    let v: Vec<f64> = (0..shape.iter().product::<usize>())
        .map(|i| {
            let m = match i % 1000 {
                0 => 2.0,
                500 => 0.5,
                _ => 1.0,
            };
            if r.uniform() < 0.5 {
                -m
            } else {
                m
            }
        })
        .collect();
    f64s(shape, &v)
}

#[test]
fn reduce_prod_axes_keepdims_and_empty_sets() {
    let mut x = rand(&[3, 4, 5], 30, 0.6, 1.5).to_f64_vec();
    x[7] = 0.0;
    let x = f64s(&[3, 4, 5], &x);
    let all: &[i64] = &[];
    for axes in [
        Some(&[0i64][..]),
        Some(&[-1]),
        Some(&[0, 2]),
        Some(&[-3, 1, 2]),
        None,
    ] {
        for keepdims in [true, false] {
            for as_input in [false, true] {
                prod_case(&x, axes, as_input, keepdims, false);
            }
        }
    }
    // No axes: all of them, or (noop_with_empty_axes) the input itself.
    prod_case(&x, Some(all), true, true, true);
    prod_case(&x, None, false, false, true);
    // An empty set's product is 1; a long reduction (split on the GPUs).
    prod_case(&f64s(&[2, 0, 3], &[]), Some(&[1]), false, true, false);
    prod_case(
        &signs_and_halves(&[3, 70000], 31),
        Some(&[1]),
        false,
        false,
        false,
    );
    let xi = rand_ints(&[3, 4, 5], 32, -2, 3);
    for dt in [DType::I64, DType::I32] {
        prod_case(&xi.cast(dt), Some(&[1]), false, true, false);
    }
}

/// CumProd along every axis and direction, with zeros, on every backend and dtype.
#[test]
fn cumprod_every_direction() {
    let shape = [3usize, 4, 5];
    let mut v = rand(&shape, 40, 0.5, 2.0).to_f64_vec();
    v[9] = 0.0;
    // Halves and doubles: every running product is exact in every float dtype.
    let v: Vec<f64> = v
        .iter()
        .map(|&x| if x == 0.0 { 0.0 } else if x < 1.0 { 0.5 } else { 2.0 } * if x > 1.7 { -1.0 } else { 1.0 })
        .collect();
    let x = f64s(&shape, &v);
    for axis in [0i64, 1, 2, -1] {
        for (exclusive, reverse) in [(false, false), (true, false), (false, true), (true, true)] {
            let op_ = op(
                "CumProd",
                &[
                    ("exclusive", V::Int(exclusive as i64)),
                    ("reverse", V::Int(reverse as i64)),
                ],
            );
            let want = |a: &[Option<Tensor>]| {
                let t = a[0].as_ref().unwrap();
                let v = t.to_f64_vec();
                let mut out = vec![0.0; v.len()];
                for l in lines(&shape, norm(axis, 3)) {
                    let d = l.len();
                    for p in 0..d {
                        out[l[p]] = (0..d)
                            .filter(|&j| match (exclusive, reverse) {
                                (false, false) => j <= p,
                                (true, false) => j < p,
                                (false, true) => j >= p,
                                (true, true) => j > p,
                            })
                            .map(|j| v[l[j]])
                            .product();
                    }
                }
                vec![(shape.to_vec(), out)]
            };
            let ax = cst(i64s(&[], &[axis]));
            check_exact(op_.clone(), &[inp(x.clone()), ax.clone()], &FLOATS, want);
            let xi = rand_ints(&shape, 41, -2, 3);
            for dt in [DType::I64, DType::I32] {
                check_exact(
                    op_.clone(),
                    &[inp(xi.cast(dt)), ax.clone()],
                    &[DType::F32],
                    want,
                );
            }
        }
    }
}
