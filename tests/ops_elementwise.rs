//! Elementwise ops against naive float64 references: unary maps, broadcasting binary ops
//! (float and integer), comparisons, Clip, Where, Dropout, the Random draws and Trilu.

mod common;
use common::*;
use graphrun::graph::op::AttrValue;
use graphrun::rng::Rng;
use graphrun::{BackendKind, DType, Op, Tensor};

// ---- helpers ------------------------------------------------------------------------

fn vals(t: &Option<Tensor>) -> Vec<f64> {
    t.as_ref().expect("argument present").to_f64_vec()
}
fn shp(t: &Option<Tensor>) -> Vec<usize> {
    t.as_ref().expect("argument present").shape().to_vec()
}

/// Seeded integers in [lo, hi), skipping zero when `nonzero`.
fn ints(shape: &[usize], seed: u64, lo: i64, hi: i64, nonzero: bool) -> Tensor {
    let mut r = Rng::new(seed);
    let n: usize = shape.iter().product();
    let v: Vec<i64> = (0..n)
        .map(|_| loop {
            let x = r.int_in(lo, hi);
            if !(nonzero && x == 0) {
                break x;
            }
        })
        .collect();
    i64s(shape, &v)
}

/// Floats that repeat (small integers), so that Equal has true cases.
fn coarse(shape: &[usize], seed: u64) -> Tensor {
    ints(shape, seed, -3, 4, false).cast(DType::F64)
}

/// Numpy broadcast of several shapes, written out independently of the crate.
fn bshape(shapes: &[Vec<usize>]) -> Vec<usize> {
    let r = shapes.iter().map(|s| s.len()).max().unwrap();
    (0..r)
        .map(|i| {
            let ds: Vec<usize> = shapes
                .iter()
                .map(|s| {
                    if i + s.len() >= r {
                        s[i + s.len() - r]
                    } else {
                        1
                    }
                })
                .collect();
            let d = ds.iter().copied().max().unwrap();
            assert!(
                ds.iter().all(|&x| x == 1 || x == d),
                "test shapes do not broadcast"
            );
            d
        })
        .collect()
}

/// Reference of a broadcasting binary op.
fn bin_ref(a: &Option<Tensor>, b: &Option<Tensor>, f: impl Fn(f64, f64) -> f64) -> Expected {
    let (sa, sb) = (shp(a), shp(b));
    let (va, vb) = (vals(a), vals(b));
    let out = bshape(&[sa.clone(), sb.clone()]);
    let v = indices(&out)
        .iter()
        .map(|i| f(va[bcast_offset(i, &sa)], vb[bcast_offset(i, &sb)]))
        .collect();
    vec![(out, v)]
}

fn un_ref(a: &Option<Tensor>, f: impl Fn(f64) -> f64) -> Expected {
    vec![(shp(a), vals(a).into_iter().map(f).collect())]
}

fn erf_ref(x: f64) -> f64 {
    // Maclaurin series; exact to ~1e-13 for |x| <= 3, which is all the tests feed it.
    let mut term = x;
    let mut sum = x;
    for n in 1..80 {
        term *= -x * x / n as f64;
        sum += term / (2 * n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

const INTS: [DType; 2] = [DType::I64, DType::I32];

/// Broadcasting shape pairs every binary op is checked on.
fn shape_pairs() -> Vec<(Vec<usize>, Vec<usize>)> {
    vec![
        (vec![3, 1, 5], vec![4, 1]),
        (vec![2, 3, 4], vec![]),
        (vec![], vec![2, 3]),
        (vec![5, 6], vec![5, 6]),
        (vec![4, 1], vec![1, 6]),
        (vec![2, 1, 3, 1], vec![4, 1, 5]),
        (vec![3, 4], vec![4]),
    ]
}

// ---- unary ----------------------------------------------------------------------------

#[test]
fn unary_float_ops() {
    let sym = rand(&[3, 4, 5], 1, -3.0, 3.0);
    let pos = rand(&[3, 4, 5], 2, 0.2, 4.0);
    let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
    type Case<'a> = (
        &'a str,
        Vec<(&'a str, AttrValue)>,
        &'a Tensor,
        Box<dyn Fn(f64) -> f64>,
    );
    let cases: Vec<Case> = vec![
        ("Neg", vec![], &sym, Box::new(|v| -v)),
        ("Exp", vec![], &sym, Box::new(|v| v.exp())),
        ("Log", vec![], &pos, Box::new(|v| v.ln())),
        ("Sqrt", vec![], &pos, Box::new(|v| v.sqrt())),
        ("Reciprocal", vec![], &pos, Box::new(|v| 1.0 / v)),
        ("Abs", vec![], &sym, Box::new(|v| v.abs())),
        ("Erf", vec![], &sym, Box::new(erf_ref)),
        (
            "Relu",
            vec![],
            &sym,
            Box::new(|v| if v > 0.0 { v } else { 0.0 }),
        ),
        ("Sigmoid", vec![], &sym, Box::new(sig)),
        ("Tanh", vec![], &sym, Box::new(|v| v.tanh())),
        // ONNX float attributes are f32: alpha is f32(0.2), not the f64 0.2.
        (
            "LeakyRelu",
            vec![("alpha", AttrValue::Float(0.2))],
            &sym,
            Box::new(|v| if v >= 0.0 { v } else { 0.2f32 as f64 * v }),
        ),
        (
            "LeakyRelu",
            vec![],
            &sym,
            Box::new(|v| if v >= 0.0 { v } else { 0.01f32 as f64 * v }),
        ),
    ];
    for (name, attrs, x, f) in cases {
        check(op(name, &attrs), &[inp(x.clone())], &FLOATS, |a| {
            un_ref(&a[0], &f)
        });
    }
}

#[test]
fn gelu_exact_and_tanh() {
    let x = rand(&[4, 7], 3, -3.0, 3.0);
    let exact = |v: f64| 0.5 * v * (1.0 + erf_ref(v / 2f64.sqrt()));
    let approx = |v: f64| {
        0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh())
    };
    check(op("Gelu", &[]), &[inp(x.clone())], &FLOATS, |a| {
        un_ref(&a[0], exact)
    });
    check(
        op("Gelu", &[("approximate", AttrValue::Str("none".into()))]),
        &[inp(x.clone())],
        &FLOATS,
        |a| un_ref(&a[0], exact),
    );
    check(
        op("Gelu", &[("approximate", AttrValue::Str("tanh".into()))]),
        &[inp(x.clone())],
        &FLOATS,
        |a| un_ref(&a[0], approx),
    );
    // The two forms differ by more than f64 tolerance, so each check pins its own mode.
    let d: f64 = x
        .to_f64_vec()
        .iter()
        .map(|&v| (exact(v) - approx(v)).abs())
        .fold(0.0, f64::max);
    assert!(d > 1e-5, "test data does not separate the two Gelu forms");
}

#[test]
fn unary_int_ops() {
    for dt in INTS {
        let x = ints(&[4, 6], 4, -50, 50, false).cast(dt);
        check_exact(op("Neg", &[]), &[inp(x.clone())], &[DType::F32], |a| {
            un_ref(&a[0], |v| -v)
        });
        check_exact(op("Abs", &[]), &[inp(x.clone())], &[DType::F32], |a| {
            un_ref(&a[0], f64::abs)
        });
        check_exact(op("Relu", &[]), &[inp(x.clone())], &[DType::F32], |a| {
            un_ref(&a[0], |v| v.max(0.0))
        });
    }
}

// ---- binary ---------------------------------------------------------------------------

#[test]
fn binary_float_broadcast() {
    for (i, (sa, sb)) in shape_pairs().into_iter().enumerate() {
        let s = 10 + 2 * i as u64;
        let a = randn(&sa, s);
        let b = randn(&sb, s + 1);
        let pos_a = rand(&sa, s, 0.3, 2.0);
        let den = rand(&sb, s + 1, 0.5, 2.0);
        check(
            op("Add", &[]),
            &[inp(a.clone()), inp(b.clone())],
            &FLOATS,
            |x| bin_ref(&x[0], &x[1], |p, q| p + q),
        );
        check(
            op("Sub", &[]),
            &[inp(a.clone()), inp(b.clone())],
            &FLOATS,
            |x| bin_ref(&x[0], &x[1], |p, q| p - q),
        );
        check(
            op("Mul", &[]),
            &[inp(a.clone()), inp(b.clone())],
            &FLOATS,
            |x| bin_ref(&x[0], &x[1], |p, q| p * q),
        );
        check(
            op("Div", &[]),
            &[inp(a.clone()), inp(den.clone())],
            &FLOATS,
            |x| bin_ref(&x[0], &x[1], |p, q| p / q),
        );
        check(
            op("Pow", &[]),
            &[inp(pos_a.clone()), inp(b.clone())],
            &FLOATS,
            |x| bin_ref(&x[0], &x[1], f64::powf),
        );
    }
}

#[test]
fn binary_large_broadcast_parallel() {
    // Big enough to be split across threads, with chunk edges inside broadcast runs.
    let a = randn(&[64, 33, 40], 30);
    let b = randn(&[33, 1], 31);
    let c = randn(&[40], 32);
    check(
        op("Add", &[]),
        &[inp(a.clone()), inp(b.clone())],
        &FLOATS,
        |x| bin_ref(&x[0], &x[1], |p, q| p + q),
    );
    check(
        op("Mul", &[]),
        &[inp(c.clone()), inp(a.clone())],
        &FLOATS,
        |x| bin_ref(&x[0], &x[1], |p, q| p * q),
    );
    let den = rand(&[1, 33, 1], 34, 0.5, 2.0);
    check(op("Div", &[]), &[inp(a.clone()), inp(den)], &FLOATS, |x| {
        bin_ref(&x[0], &x[1], |p, q| p / q)
    });
    let d = randn(&[64, 1, 40], 33);
    check_exact(
        op("Greater", &[]),
        &[inp(a.clone()), inp(d)],
        &[DType::F32, DType::BF16],
        |x| bin_ref(&x[0], &x[1], |p, q| (p > q) as u8 as f64),
    );
}

#[test]
fn pow_exponent_of_another_dtype() {
    // Float base, integer exponent: output keeps the base dtype.
    // |base| in [0.5, 2) with mixed signs: odd integer powers keep the sign.
    let mag = rand(&[3, 4], 40, 0.5, 2.0).to_f64_vec();
    let base = f64s(
        &[3, 4],
        &mag.iter()
            .enumerate()
            .map(|(i, &v)| if i % 3 == 0 { -v } else { v })
            .collect::<Vec<_>>(),
    );
    let e = ints(&[4], 41, -3, 4, false);
    check(
        op("Pow", &[]),
        &[inp(base.clone()), inp(e.clone())],
        &FLOATS,
        |x| bin_ref(&x[0], &x[1], f64::powf),
    );
    check(
        op("Pow", &[]),
        &[inp(base.clone()), inp(e.cast(DType::I32))],
        &[DType::F32],
        |x| bin_ref(&x[0], &x[1], f64::powf),
    );
    // Integer base, float exponent: computed in float, truncated to the base dtype.
    let ib = i64s(&[5], &[4, 9, 10, 2, 7]);
    let fe = f64s(&[1], &[0.5]);
    check_exact(op("Pow", &[]), &[inp(ib.clone()), inp(fe)], &FLOATS, |x| {
        bin_ref(&x[0], &x[1], |p, q| p.powf(q).trunc())
    });
    // Integer base and exponent: exact integer power.
    let ie = ints(&[2, 5], 42, 0, 5, false);
    for dt in INTS {
        check_exact(
            op("Pow", &[]),
            &[inp(ib.cast(dt)), inp(ie.clone())],
            &[DType::F32],
            |x| bin_ref(&x[0], &x[1], f64::powf),
        );
    }
    let got = run_op(
        backends()[0],
        op("Pow", &[]),
        &[inp(ib.cast(DType::I32)), inp(f64s(&[], &[2.0]))],
        1,
        DType::F16,
    )
    .unwrap();
    assert_eq!(
        (got[0].dtype(), got[0].to_f64_vec()),
        (DType::I32, vec![16.0, 81.0, 100.0, 4.0, 49.0])
    );
}

#[test]
fn binary_int_broadcast() {
    for dt in INTS {
        for (i, (sa, sb)) in shape_pairs().into_iter().enumerate() {
            let s = 50 + 2 * i as u64;
            let a = ints(&sa, s, -100, 100, false).cast(dt);
            let b = ints(&sb, s + 1, -9, 10, true).cast(dt);
            let go = |name: &str, f: fn(f64, f64) -> f64| {
                check_exact(
                    op(name, &[]),
                    &[inp(a.clone()), inp(b.clone())],
                    &[DType::F32],
                    |x| bin_ref(&x[0], &x[1], f),
                )
            };
            go("Add", |p, q| p + q);
            go("Sub", |p, q| p - q);
            go("Mul", |p, q| p * q);
            // Truncation toward zero: -7 / 2 = -3, as ONNX (C semantics), not floor.
            go("Div", |p, q| (p / q).trunc());
        }
    }
    check_exact(
        op("Div", &[]),
        &[
            inp(i64s(&[4], &[-7, 7, -7, 7])),
            inp(i64s(&[4], &[2, -2, -2, 2])),
        ],
        &[DType::F32],
        |_| vec![(vec![4], vec![-3.0, -3.0, 3.0, 3.0])],
    );
}

#[test]
fn int_div_by_zero_is_an_error() {
    for dt in INTS {
        let a = i64s(&[2, 3], &[1, 2, 3, 4, 5, 6]).cast(dt);
        let b = i64s(&[3], &[1, 0, 2]).cast(dt);
        let r = run_op(
            backends()[0],
            op("Div", &[]),
            &[inp(a), inp(b)],
            1,
            DType::F32,
        );
        let e = r
            .expect_err("integer division by zero must fail")
            .to_string();
        assert!(
            e.contains("node 'node'") && e.contains("Div") && e.contains("zero"),
            "{e}"
        );
    }
    // Float division by zero is IEEE: inf, not an error.
    let got = run_op(
        backends()[0],
        op("Div", &[]),
        &[inp(f64s(&[2], &[1.0, -1.0])), inp(f64s(&[], &[0.0]))],
        1,
        DType::F32,
    )
    .unwrap();
    assert_eq!(got[0].to_f64_vec(), vec![f64::INFINITY, f64::NEG_INFINITY]);
}

#[test]
fn comparisons() {
    type Cmp = fn(f64, f64) -> bool;
    let cmps: [(&str, Cmp); 3] = [
        ("Equal", |p, q| p == q),
        ("Less", |p, q| p < q),
        ("Greater", |p, q| p > q),
    ];
    for (i, (sa, sb)) in shape_pairs().into_iter().enumerate() {
        let s = 70 + 2 * i as u64;
        let (a, b) = (coarse(&sa, s), coarse(&sb, s + 1));
        for (name, f) in cmps {
            let r = |x: &[Option<Tensor>]| bin_ref(&x[0], &x[1], |p, q| f(p, q) as u8 as f64);
            check_exact(op(name, &[]), &[inp(a.clone()), inp(b.clone())], &FLOATS, r);
            for dt in INTS {
                check_exact(
                    op(name, &[]),
                    &[inp(a.cast(dt)), inp(b.cast(dt))],
                    &[DType::F32],
                    r,
                );
            }
        }
    }
    // Fractional floats: Less must see the exact values, not a rounding of them.
    let (a, b) = (randn(&[3, 1, 5], 80), randn(&[4, 1], 81));
    check_exact(op("Less", &[]), &[inp(a), inp(b)], &FLOATS, |x| {
        bin_ref(&x[0], &x[1], |p, q| (p < q) as u8 as f64)
    });
    // Equal on bool, broadcast.
    let ba = bools(&[2, 3], &[true, false, true, false, false, true]);
    let bb = bools(&[3], &[true, false, false]);
    check_exact(op("Equal", &[]), &[inp(ba), inp(bb)], &[DType::F32], |_| {
        vec![(vec![2, 3], vec![1.0, 1.0, 0.0, 0.0, 1.0, 0.0])]
    });
    let got = run_op(
        backends()[0],
        op("Less", &[]),
        &[inp(f64s(&[2], &[1.0, 2.0])), inp(f64s(&[1], &[1.5]))],
        1,
        DType::BF16,
    )
    .unwrap();
    assert_eq!(got[0].dtype(), DType::Bool);
}

// ---- Clip, Where ------------------------------------------------------------------------

#[test]
fn clip_min_max_optional() {
    let x = randn(&[4, 5], 90);
    let lo = f64s(&[], &[-0.5]);
    let hi = f64s(&[], &[0.7]);
    let clip = |v: f64, lo: Option<f64>, hi: Option<f64>| {
        let v = if let Some(l) = lo {
            if v < l {
                l
            } else {
                v
            }
        } else {
            v
        };
        if let Some(h) = hi {
            if v > h {
                h
            } else {
                v
            }
        } else {
            v
        }
    };
    check(
        op("Clip", &[]),
        &[inp(x.clone()), inp(lo.clone()), inp(hi.clone())],
        &FLOATS,
        |a| {
            let (l, h) = (vals(&a[1])[0], vals(&a[2])[0]);
            un_ref(&a[0], |v| clip(v, Some(l), Some(h)))
        },
    );
    check(
        op("Clip", &[]),
        &[inp(x.clone()), inp(lo.clone())],
        &FLOATS,
        |a| {
            let l = vals(&a[1])[0];
            un_ref(&a[0], |v| clip(v, Some(l), None))
        },
    );
    check(
        op("Clip", &[]),
        &[inp(x.clone()), Arg::None, inp(hi.clone())],
        &FLOATS,
        |a| {
            let h = vals(&a[2])[0];
            un_ref(&a[0], |v| clip(v, None, Some(h)))
        },
    );
    check(op("Clip", &[]), &[inp(x.clone())], &FLOATS, |a| {
        un_ref(&a[0], |v| v)
    });
    // NaN stays NaN under the bounds (every comparison with it is false).
    let xn = f64s(&[3], &[f64::NAN, -2.0, 2.0]);
    check(
        op("Clip", &[]),
        &[inp(xn), inp(lo.clone()), inp(hi.clone())],
        &FLOATS,
        |a| {
            let (l, h) = (vals(&a[1])[0], vals(&a[2])[0]);
            un_ref(&a[0], |v| clip(v, Some(l), Some(h)))
        },
    );
    // min > max: everything becomes max (ONNX).
    check(
        op("Clip", &[]),
        &[inp(x.clone()), inp(hi.clone()), inp(lo.clone())],
        &[DType::F64, DType::F32],
        |a| un_ref(&a[0], |_| -0.5),
    );
    for dt in INTS {
        let xi = ints(&[3, 7], 91, -20, 20, false).cast(dt);
        check_exact(
            op("Clip", &[]),
            &[
                inp(xi.clone()),
                inp(i64s(&[], &[-5]).cast(dt)),
                inp(i64s(&[1], &[8]).cast(dt)),
            ],
            &[DType::F32],
            |a| un_ref(&a[0], |v| v.clamp(-5.0, 8.0)),
        );
        check_exact(
            op("Clip", &[]),
            &[inp(xi.clone()), Arg::None, inp(i64s(&[], &[3]).cast(dt))],
            &[DType::F32],
            |a| un_ref(&a[0], |v| v.min(3.0)),
        );
    }
}

fn where_ref(a: &[Option<Tensor>]) -> Expected {
    let s: Vec<Vec<usize>> = a.iter().map(shp).collect();
    let v: Vec<Vec<f64>> = a.iter().map(vals).collect();
    let out = bshape(&s);
    let r = indices(&out)
        .iter()
        .map(|i| {
            if v[0][bcast_offset(i, &s[0])] != 0.0 {
                v[1][bcast_offset(i, &s[1])]
            } else {
                v[2][bcast_offset(i, &s[2])]
            }
        })
        .collect();
    vec![(out, r)]
}

fn rand_bools(shape: &[usize], seed: u64) -> Tensor {
    let mut r = Rng::new(seed);
    let n: usize = shape.iter().product();
    bools(
        shape,
        &(0..n).map(|_| r.uniform() < 0.5).collect::<Vec<_>>(),
    )
}

#[test]
fn where_broadcast() {
    let cases: Vec<[Vec<usize>; 3]> = vec![
        [vec![3, 1, 5], vec![4, 1], vec![]],
        [vec![4, 5], vec![4, 5], vec![4, 5]],
        [vec![], vec![2, 3], vec![3]],
        [vec![5], vec![3, 1], vec![2, 1, 1]],
        [vec![50, 1, 30], vec![1, 40, 1], vec![40, 30]],
    ];
    for (i, [sc, sa, sb]) in cases.into_iter().enumerate() {
        let s = 100 + 3 * i as u64;
        let c = rand_bools(&sc, s);
        let (a, b) = (randn(&sa, s + 1), randn(&sb, s + 2));
        check(
            op("Where", &[]),
            &[inp(c.clone()), inp(a.clone()), inp(b.clone())],
            &FLOATS,
            where_ref,
        );
        let (ai, bi) = (
            ints(&sa, s + 1, -9, 9, false),
            ints(&sb, s + 2, -9, 9, false),
        );
        check_exact(
            op("Where", &[]),
            &[inp(c.clone()), inp(ai.clone()), inp(bi.clone())],
            &[DType::F32],
            where_ref,
        );
        check_exact(
            op("Where", &[]),
            &[
                inp(c.clone()),
                inp(ai.cast(DType::I32)),
                inp(bi.cast(DType::I32)),
            ],
            &[DType::F32],
            where_ref,
        );
        let (ab, bb) = (rand_bools(&sa, s + 3), rand_bools(&sb, s + 4));
        check_exact(
            op("Where", &[]),
            &[inp(c), inp(ab), inp(bb)],
            &[DType::F32],
            where_ref,
        );
    }
}

// ---- Dropout ----------------------------------------------------------------------------

#[test]
fn dropout_identity_at_inference() {
    let x = randn(&[6, 7], 120);
    let ident = |a: &[Option<Tensor>]| {
        let n = vals(&a[0]).len();
        vec![(shp(&a[0]), vals(&a[0])), (shp(&a[0]), vec![1.0; n])]
    };
    check(
        op("Dropout", &[("ratio", AttrValue::Float(0.3))]),
        &[inp(x.clone())],
        &FLOATS,
        ident,
    );
    check(
        op("Dropout", &[("seed", AttrValue::Int(3))]),
        &[inp(x.clone()), cst(f64s(&[], &[0.9]))],
        &FLOATS,
        ident,
    );
    check(
        op("Dropout", &[]),
        &[inp(x.clone()), Arg::None, cst(bools(&[], &[false]))],
        &FLOATS,
        ident,
    );
    check(op("Dropout", &[]), &[inp(x.clone())], &FLOATS, |a| {
        vec![(shp(&a[0]), vals(&a[0]))]
    });
}

#[test]
fn dropout_training_mask() {
    let x = rand(&[100, 101], 121, 0.5, 1.5);
    let train = cst(bools(&[], &[true]));
    for dt in [DType::F64, DType::F32, DType::BF16] {
        for (ratio, ratio_arg) in [(0.5, Arg::None), (0.25, cst(f64s(&[], &[0.25])))] {
            // The ratio input overrides the attribute (0.5 by default).
            let o = op("Dropout", &[("seed", AttrValue::Int(42))]);
            let args = [inp(x.clone()), ratio_arg, train.clone()];
            let got = run_op(backends()[0], o.clone(), &args, 2, dt).unwrap();
            let again = run_op(backends()[0], o, &args, 2, dt).unwrap();
            assert_eq!(got[0], again[0], "same seed, same output");
            let (y, m) = (got[0].to_f64_vec(), got[1].to_f64_vec());
            assert_eq!(got[1].dtype(), DType::Bool);
            let xs = x.cast(dt).to_f64_vec();
            let mut kept = 0;
            for i in 0..y.len() {
                if m[i] != 0.0 {
                    kept += 1;
                    let want = xs[i] / (1.0 - ratio);
                    assert!(
                        (y[i] - want).abs() <= 1e-2 * want,
                        "{dt}: kept value {} != {want}",
                        y[i]
                    );
                } else {
                    assert_eq!(y[i], 0.0, "dropped value must be 0");
                }
            }
            let frac = kept as f64 / y.len() as f64;
            assert!(
                (frac - (1.0 - ratio)).abs() < 0.02,
                "{dt}: kept {frac}, want {}",
                1.0 - ratio
            );
        }
    }
    // Another seed gives another mask.
    let a = run_op(
        backends()[0],
        op("Dropout", &[("seed", AttrValue::Int(1))]),
        &[inp(x.clone()), Arg::None, train.clone()],
        2,
        DType::F32,
    )
    .unwrap();
    let b = run_op(
        backends()[0],
        op("Dropout", &[("seed", AttrValue::Int(2))]),
        &[inp(x.clone()), Arg::None, train.clone()],
        2,
        DType::F32,
    )
    .unwrap();
    assert_ne!(a[1], b[1]);
}

// ---- Random draws -----------------------------------------------------------------------

/// SplitMix64's first output for `seed`, written out here independently of the crate.
fn splitmix(seed: u64) -> u64 {
    const G: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut z = (seed ^ G).wrapping_add(G);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The documented draw of element i: `bits` (53 for f64 outputs, 24 otherwise) of
/// SplitMix64 at counter seed + i (uniform), or Box–Muller from counters seed + 2i and
/// seed + 2i + 1 (normal).
fn random_ref(normal: bool, a: f64, b: f64, seed: u64, n: usize, bits: u32) -> Vec<f64> {
    let unit = |c: u64| (splitmix(c) >> (64 - bits)) as f64 / 2f64.powi(bits as i32);
    (0..n as u64)
        .map(|i| {
            if normal {
                let c = seed.wrapping_add(2 * i);
                let (u1, u2) = (1.0 - unit(c), unit(c.wrapping_add(1)));
                a + b * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
            } else {
                a + (b - a) * unit(seed.wrapping_add(i))
            }
        })
        .collect()
}

fn random_op(normal: bool, like: bool, a: f64, b: f64, extra: &[(&str, AttrValue)]) -> Op {
    let name = match (normal, like) {
        (false, false) => "RandomUniform",
        (false, true) => "RandomUniformLike",
        (true, false) => "RandomNormal",
        (true, true) => "RandomNormalLike",
    };
    let (an, bn) = if normal {
        ("mean", "scale")
    } else {
        ("low", "high")
    };
    let mut attrs = vec![(an, AttrValue::Float(a)), (bn, AttrValue::Float(b))];
    attrs.extend(extra.iter().cloned());
    op(name, &attrs)
}

#[test]
fn random_draws_are_the_documented_values_on_every_backend() {
    let shape = [37usize, 53];
    let n = 37 * 53;
    let seed = 5.0f64;
    for backend in backends() {
        for dt in FLOATS {
            if !computes(backend, dt) {
                continue;
            }
            let bits = if dt == DType::F64 { 53 } else { 24 };
            for (normal, a, b) in [(false, -2.0, 3.0), (true, 1.5, 0.5)] {
                let want = random_ref(normal, a, b, seed.to_bits(), n, bits);
                // The plain form (shape and dtype attributes) and the Like form (the
                // input's shape and type; its values are not read).
                let plain = random_op(
                    normal,
                    false,
                    a,
                    b,
                    &[
                        ("seed", AttrValue::Float(seed)),
                        ("shape", AttrValue::Ints(vec![37, 53])),
                        ("dtype", AttrValue::Int(dt.onnx_code() as i64)),
                    ],
                );
                let like = random_op(normal, true, a, b, &[("seed", AttrValue::Float(seed))]);
                let x = randn(&shape, 130);
                for (form, o, args) in [("plain", plain, vec![]), ("like", like, vec![inp(x)])] {
                    let what = format!("{} {form} {dt} on {backend:?}", o.name());
                    let got =
                        run_op(backend, o, &args, 1, dt).unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_eq!(got[0].dtype(), dt, "{what}");
                    assert_eq!(got[0].shape(), &shape, "{what}");
                    // Rounding to the output type (and WebGPU's f32 log and cos).
                    let t = match dt {
                        DType::F64 => 1e-12,
                        DType::F32 => 2e-6,
                        DType::F16 => 1e-3,
                        _ => 8e-3,
                    };
                    for (i, (g, w)) in got[0].to_f64_vec().iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() <= t * (w.abs() + b.abs()),
                            "{what}: element {i} is {g}, want {w}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn random_draws_have_their_distributions() {
    let n = 200_000usize;
    let shape = ("shape", AttrValue::Ints(vec![n as i64]));
    let f64_out = ("dtype", AttrValue::Int(11));
    let draw = |o: Op| run_op(backends()[0], o, &[], 1, DType::F64).unwrap()[0].to_f64_vec();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let frac = |v: &[f64], f: &dyn Fn(f64) -> bool| {
        v.iter().filter(|&&x| f(x)).count() as f64 / v.len() as f64
    };
    // Uniform on [-2, 3): inside the bounds, mean 0.5 (σ of the mean 5/√(12n)), each
    // fifth of the range holding a fifth of the draws.
    let u = draw(random_op(
        false,
        false,
        -2.0,
        3.0,
        &[shape.clone(), f64_out.clone()],
    ));
    assert!(u.iter().all(|&x| (-2.0..3.0).contains(&x)));
    let sd = 5.0 / (12.0 * n as f64).sqrt();
    assert!(
        (mean(&u) - 0.5).abs() < 5.0 * sd,
        "uniform mean {}",
        mean(&u)
    );
    for k in 0..5 {
        let lo = -2.0 + k as f64;
        let f = frac(&u, &|x| x >= lo && x < lo + 1.0);
        assert!((f - 0.2).abs() < 0.005, "uniform fifth {k}: {f}");
    }
    // Normal with mean 1.5 and scale 0.5: its mean, deviation and the mass within 1σ and
    // 2σ (0.6827, 0.9545).
    let z = draw(random_op(
        true,
        false,
        1.5,
        0.5,
        &[shape.clone(), f64_out.clone()],
    ));
    let m = mean(&z);
    let sdev = (z.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / n as f64).sqrt();
    assert!(
        (m - 1.5).abs() < 5.0 * 0.5 / (n as f64).sqrt(),
        "normal mean {m}"
    );
    assert!((sdev - 0.5).abs() < 0.005, "normal deviation {sdev}");
    let one = frac(&z, &|x| (x - 1.5).abs() < 0.5);
    let two = frac(&z, &|x| (x - 1.5).abs() < 1.0);
    assert!(
        (one - 0.6827).abs() < 0.005 && (two - 0.9545).abs() < 0.003,
        "{one} {two}"
    );
    // Another seed draws other values; the same seed the same ones.
    let seeded = |s: f64| {
        draw(random_op(
            false,
            false,
            0.0,
            1.0,
            &[
                shape.clone(),
                f64_out.clone(),
                ("seed", AttrValue::Float(s)),
            ],
        ))
    };
    assert_eq!(seeded(1.0), seeded(1.0));
    let (a, b) = (seeded(1.0), seeded(2.0));
    let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
    assert!(same < 5, "seeds 1 and 2 agree on {same} draws");
}

#[test]
fn random_attributes_and_types_are_checked() {
    let parse = |name: &str, attrs: &[(&str, AttrValue)]| {
        let attrs: Vec<graphrun::graph::op::Attr> = attrs
            .iter()
            .map(|(k, v)| graphrun::graph::op::Attr {
                name: k.to_string(),
                value: v.clone(),
                loc: None,
            })
            .collect();
        Op::parse(name, &attrs, "r", None)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let e = parse("RandomUniform", &[]);
    assert!(
        e.contains("node 'r' (RandomUniform)") && e.contains("'shape' is required"),
        "{e}"
    );
    let e = parse("RandomNormal", &[("shape", AttrValue::Ints(vec![2, -1]))]);
    assert!(e.contains("must not be negative, got -1"), "{e}");
    let e = parse("RandomUniformLike", &[("dtype", AttrValue::Int(7))]);
    assert!(e.contains("'dtype' must be a float type, got i64"), "{e}");
    let e = parse("RandomNormalLike", &[("dtype", AttrValue::Int(99))]);
    assert!(e.contains("attribute 'dtype': unsupported dtype"), "{e}");
    // A Like form on an integer input must name a float output type.
    let like = random_op(false, true, 0.0, 1.0, &[]);
    let e = run_raw(BackendKind::Cpu, like, &[inp(i64s(&[2], &[1, 2]))], 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the input is i64, so attribute 'dtype' must name a float type"),
        "{e}"
    );
    let like = random_op(true, true, 0.0, 1.0, &[("dtype", AttrValue::Int(1))]);
    let got = run_raw(
        BackendKind::Cpu,
        like,
        &[inp(i64s(&[2, 3], &[1, 2, 3, 4, 5, 6]))],
        1,
    )
    .unwrap();
    assert_eq!(
        (got[0].dtype(), got[0].shape()),
        (DType::F32, &[2usize, 3][..])
    );
}

// ---- Trilu ------------------------------------------------------------------------------

fn trilu_ref(a: &[Option<Tensor>], upper: bool) -> Expected {
    let s = shp(&a[0]);
    let v = vals(&a[0]);
    let k = a
        .get(1)
        .and_then(|k| k.as_ref())
        .map(|k| k.to_i64_vec()[0])
        .unwrap_or(0);
    let r = indices(&s)
        .iter()
        .zip(&v)
        .map(|(idx, &x)| {
            let (i, j) = (idx[idx.len() - 2] as i64, idx[idx.len() - 1] as i64);
            let keep = if upper { j - i >= k } else { j - i <= k };
            if keep {
                x
            } else {
                0.0
            }
        })
        .collect();
    vec![(s, r)]
}

#[test]
fn trilu_upper_lower_k() {
    for shape in [vec![2, 3, 4, 5], vec![6, 3], vec![3, 4, 4]] {
        let x = rand(&shape, 130, 0.5, 2.0);
        for upper in [true, false] {
            let o = op("Trilu", &[("upper", AttrValue::Int(upper as i64))]);
            check(o.clone(), &[inp(x.clone())], &FLOATS, |a| {
                trilu_ref(a, upper)
            });
            for k in [1, -1, 2, -2, 7, -7] {
                check(
                    o.clone(),
                    &[inp(x.clone()), cst(i64s(&[], &[k]))],
                    &FLOATS,
                    |a| trilu_ref(a, upper),
                );
            }
            let xi = ints(&shape, 131, 1, 9, false);
            check_exact(
                o.clone(),
                &[inp(xi.clone()), cst(i64s(&[], &[-1]).cast(DType::I32))],
                &[DType::F32],
                |a| trilu_ref(a, upper),
            );
        }
    }
    // Default is upper.
    let x = rand(&[4, 4], 132, 0.5, 2.0);
    check(op("Trilu", &[]), &[inp(x)], &[DType::F64], |a| {
        trilu_ref(a, true)
    });
}
