//! Every unary map × every backend × every dtype it takes, forward and gradient, against
//! float64 references written here (naive formulas; derivatives by a five-point finite
//! difference of those formulas). The ops come from the declaration table itself
//! (`UnaryOp::ALL`), so an op added there is tested here on every backend without a line
//! of this file changing — and fails if a backend lacks it. The only combinations skipped
//! are the dtypes a backend has no type for (`graphrun::backends::NOT_ON_BACKEND`, printed
//! under README's operator table).

mod common;
#[path = "common/conv_matrix.rs"]
mod conv_matrix;
use common::*;
use graphrun::graph::{Op, UnaryOp};
use graphrun::rng::Rng;
use graphrun::{DType, Tensor};

/// f64 reference of each map, independent of the crate's formulas.
fn reference(u: UnaryOp, x: f64) -> f64 {
    let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
    let softplus = |v: f64| (1.0 + v.exp()).ln();
    let [a, b] = u.params().map(|p| p as f64);
    match u {
        UnaryOp::Relu => x.max(0.0),
        UnaryOp::Gelu => 0.5 * x * (1.0 + erf(x / 2f64.sqrt())),
        UnaryOp::GeluTanh => {
            0.5 * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
        }
        UnaryOp::Sigmoid => sig(x),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Neg => -x,
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Reciprocal => 1.0 / x,
        UnaryOp::Abs => x.abs(),
        UnaryOp::Erf => erf(x),
        UnaryOp::LeakyRelu { .. } => {
            if x >= 0.0 {
                x
            } else {
                a * x
            }
        }
        UnaryOp::Sign => {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                0.0
            }
        }
        UnaryOp::Floor => x.floor(),
        UnaryOp::Ceil => x.ceil(),
        UnaryOp::Round => x.round_ties_even(),
        UnaryOp::Sin => x.sin(),
        UnaryOp::Cos => x.cos(),
        UnaryOp::Tan => x.tan(),
        UnaryOp::Asin => x.asin(),
        UnaryOp::Acos => x.acos(),
        UnaryOp::Atan => x.atan(),
        UnaryOp::Sinh => (x.exp() - (-x).exp()) / 2.0,
        UnaryOp::Cosh => (x.exp() + (-x).exp()) / 2.0,
        UnaryOp::Asinh => (x + (x * x + 1.0).sqrt()).ln(),
        UnaryOp::Acosh => (x + (x * x - 1.0).sqrt()).ln(),
        UnaryOp::Atanh => 0.5 * ((1.0 + x) / (1.0 - x)).ln(),
        UnaryOp::Softplus => softplus(x),
        UnaryOp::Softsign => x / (1.0 + x.abs()),
        UnaryOp::Elu { .. } => {
            if x < 0.0 {
                a * (x.exp() - 1.0)
            } else {
                x
            }
        }
        UnaryOp::Selu { .. } => b * if x > 0.0 { x } else { a * x.exp() - a },
        UnaryOp::Celu { .. } => x.max(0.0) + (a * ((x / a).exp() - 1.0)).min(0.0),
        UnaryOp::HardSigmoid { .. } => (a * x + b).clamp(0.0, 1.0),
        UnaryOp::HardSwish => x * (x / 6.0 + 0.5).clamp(0.0, 1.0),
        UnaryOp::Mish => x * softplus(x).tanh(),
        UnaryOp::ThresholdedRelu { .. } => {
            if x > a {
                x
            } else {
                0.0
            }
        }
        UnaryOp::Swish { .. } => x * sig(a * x),
    }
}

fn erf(x: f64) -> f64 {
    // Maclaurin series; exact to ~1e-13 for |x| <= 3.5, which is all the tests feed it.
    let (mut term, mut sum) = (x, x);
    for n in 1..100 {
        term *= -x * x / n as f64;
        sum += term / (2 * n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

/// The inputs each map is defined on, and the kinks its data must stay away from (where
/// the derivative jumps and finite differences say nothing).
fn domain(u: UnaryOp) -> ((f64, f64), Vec<f64>) {
    let [a, b] = u.params().map(|p| p as f64);
    match u {
        UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Reciprocal => ((0.2, 4.0), vec![]),
        UnaryOp::Asin | UnaryOp::Acos | UnaryOp::Atanh => ((-0.9, 0.9), vec![]),
        UnaryOp::Acosh => ((1.1, 4.0), vec![]),
        UnaryOp::Tan => ((-1.3, 1.3), vec![]),
        UnaryOp::HardSigmoid { .. } => ((-4.0, 4.0), vec![-b / a, (1.0 - b) / a]),
        UnaryOp::HardSwish => ((-4.5, 4.5), vec![-3.0, 3.0]),
        UnaryOp::ThresholdedRelu { .. } => ((-3.0, 3.0), vec![a]),
        _ => ((-3.0, 3.0), vec![0.0]),
    }
}

/// Seeded data in the op's domain, at least 0.05 from its kinks; the maps that round
/// also get exact halves (Round's ties) and integers.
fn data(u: UnaryOp, seed: u64) -> Tensor {
    let ((lo, hi), kinks) = domain(u);
    let mut r = Rng::new(seed);
    let mut v: Vec<f64> = (0..60)
        .map(|_| loop {
            let x = r.uniform_in(lo, hi);
            if kinks.iter().all(|k| (x - k).abs() > 0.05) {
                break x;
            }
        })
        .collect();
    if !u.differentiable() {
        v.extend([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, -2.0, 0.0, 3.0]);
    }
    f64s(&[v.len()], &v)
}

/// The ops under test: each with its default attributes, and once with other values.
fn ops() -> Vec<UnaryOp> {
    let mut v = UnaryOp::ALL.to_vec();
    v.extend([
        UnaryOp::LeakyRelu { alpha: 0.3 },
        UnaryOp::Elu { alpha: 0.7 },
        UnaryOp::Selu {
            alpha: 1.5,
            gamma: 2.0,
        },
        UnaryOp::Celu { alpha: 2.0 },
        UnaryOp::HardSigmoid {
            alpha: 0.3,
            beta: 0.4,
        },
        UnaryOp::ThresholdedRelu { alpha: 0.5 },
        UnaryOp::Swish { alpha: 1.7 },
    ]);
    v
}

/// Runs `f` for every item and fails once at the end, naming every item that failed.
fn each<T: std::fmt::Debug + Copy>(items: impl IntoIterator<Item = T>, f: impl Fn(T)) {
    let failed: Vec<String> = items
        .into_iter()
        .filter_map(|it| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(it)))
                .err()
                .map(|e| {
                    let msg = e
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    format!("{it:?}: {}", msg.lines().next().unwrap_or(""))
                })
        })
        .collect();
    assert!(
        failed.is_empty(),
        "{} failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

#[test]
fn every_unary_map_on_every_backend() {
    each(ops().into_iter().enumerate(), |(k, u)| {
        let x = data(u, 100 + k as u64);
        let want = |a: &[Option<Tensor>]| {
            let t = a[0].as_ref().unwrap();
            vec![(
                t.shape().to_vec(),
                t.to_f64_vec().iter().map(|&v| reference(u, v)).collect(),
            )]
        };
        // The rounding maps have exact answers.
        match u.differentiable() {
            true => check(Op::Unary(u), &[inp(x)], &FLOATS, want),
            false => check_exact(Op::Unary(u), &[inp(x)], &FLOATS, want),
        }
    });
}

#[test]
fn every_unary_gradient_on_every_backend() {
    let ops = ops()
        .into_iter()
        .enumerate()
        .filter(|(_, u)| u.differentiable());
    each(ops, |(k, u)| {
        let x = data(u, 200 + k as u64);
        let dy = randn(x.shape(), 300 + k as u64);
        check(Op::UnaryGrad(u), &[inp(dy), inp(x)], &FLOATS, |a| {
            let (g, x) = (a[0].as_ref().unwrap(), a[1].as_ref().unwrap());
            let d: Vec<f64> = g
                .to_f64_vec()
                .iter()
                .zip(x.to_f64_vec())
                .map(|(&g, x)| g * derivative(|v| reference(u, v), x))
                .collect();
            vec![(x.shape().to_vec(), d)]
        });
    });
}

/// f'(x) by the five-point stencil (truncation error ~h⁴, rounding ~1e-16/h).
fn derivative(f: impl Fn(f64) -> f64, x: f64) -> f64 {
    let h = 2e-4;
    (-f(x + 2.0 * h) + 8.0 * f(x + h) - 8.0 * f(x - h) + f(x - 2.0 * h)) / (12.0 * h)
}

/// The one list of (backend, dtype) pairs an elementwise map may refuse (README prints it).
use graphrun::backends::not_on;

/// The maps defined on signed integers, exactly, on every backend that does integer maths.
#[test]
fn integer_unary_maps() {
    let v: Vec<i64> = (-20..20).map(|i| i * 7 % 23).collect();
    for u in UnaryOp::ALL.iter().copied().filter(|u| u.takes_ints()) {
        for dt in [DType::I64, DType::I32] {
            let x = Tensor::from_vec(&[v.len()], v.clone()).unwrap().cast(dt);
            for backend in backends() {
                if let Err(e) = run_op(backend, Op::Unary(u), &[inp(x.clone())], 1, DType::F32) {
                    assert!(not_on(backend, dt), "{u:?} {dt} on {backend:?}: {e}");
                }
            }
            check_exact(Op::Unary(u), &[inp(x)], &[DType::F32], |a| {
                let t = a[0].as_ref().unwrap();
                let out = t.to_f64_vec().iter().map(|&x| reference(u, x)).collect();
                vec![(t.shape().to_vec(), out)]
            });
        }
    }
}

// ---- binary maps -----------------------------------------------------------------------

use graphrun::graph::{BinaryKind, BinaryOp};

/// f64 reference of each binary map (bools as 0/1).
fn reference2(b: BinaryOp, x: f64, y: f64) -> f64 {
    let t = |c: bool| c as i32 as f64;
    match b {
        BinaryOp::Add => x + y,
        BinaryOp::Sub => x - y,
        BinaryOp::Mul => x * y,
        BinaryOp::Div => x / y,
        BinaryOp::Mod => x - y * (x / y).floor(),
        BinaryOp::Fmod => x - y * (x / y).trunc(),
        BinaryOp::Min => {
            if x.is_nan() || y.is_nan() {
                f64::NAN
            } else {
                x.min(y)
            }
        }
        BinaryOp::Max => {
            if x.is_nan() || y.is_nan() {
                f64::NAN
            } else {
                x.max(y)
            }
        }
        BinaryOp::PRelu => {
            if x < 0.0 {
                y * x
            } else {
                x
            }
        }
        BinaryOp::Pow => x.powf(y),
        BinaryOp::Equal => t(x == y),
        BinaryOp::Less => t(x < y),
        BinaryOp::Greater => t(x > y),
        BinaryOp::LessOrEqual => t(x <= y),
        BinaryOp::GreaterOrEqual => t(x >= y),
        BinaryOp::And => t(x != 0.0 && y != 0.0),
        BinaryOp::Or => t(x != 0.0 || y != 0.0),
        BinaryOp::Xor => t((x != 0.0) != (y != 0.0)),
        // On the two's-complement values (wrapped to the dtype by the caller); shifts
        // take unsigned operands only, and move every bit out at the type's width (which
        // the wrap does).
        BinaryOp::BitwiseAnd => (x as i128 & y as i128) as f64,
        BinaryOp::BitwiseOr => (x as i128 | y as i128) as f64,
        BinaryOp::BitwiseXor => (x as i128 ^ y as i128) as f64,
        BinaryOp::BitShiftLeft => ((x as i128) << (y as u32)) as f64,
        BinaryOp::BitShiftRight => ((x as i128) >> (y as u32)) as f64,
    }
}

fn want2(b: BinaryOp) -> impl Fn(&[Option<Tensor>]) -> Expected {
    move |a: &[Option<Tensor>]| {
        let (x, y) = (a[0].as_ref().unwrap(), a[1].as_ref().unwrap());
        let (sx, sy) = (x.shape().to_vec(), y.shape().to_vec());
        let out = broadcast(&sx, &sy);
        let (vx, vy) = (x.to_f64_vec(), y.to_f64_vec());
        // Integer division truncates.
        let int_div = x.dtype().is_int() && b == BinaryOp::Div;
        let dt = x.dtype();
        let v = indices(&out)
            .iter()
            .map(|i| reference2(b, vx[bcast_offset(i, &sx)], vy[bcast_offset(i, &sy)]))
            .map(|v| if int_div { v.trunc() } else { v })
            .map(|v| {
                if dt.is_int() && !b.is_comparison() {
                    wrap(v, dt)
                } else {
                    v
                }
            })
            .collect();
        vec![(out, v)]
    }
}

/// An integer result wrapped to `dt`'s width, two's complement (numpy's overflow).
fn wrap(v: f64, dt: DType) -> f64 {
    let m = 1i128 << (dt.size() * 8);
    let r = (v as i128).rem_euclid(m);
    let signed = !dt.is_unsigned();
    (if signed && r >= m / 2 { r - m } else { r }) as f64
}

fn broadcast(a: &[usize], b: &[usize]) -> Vec<usize> {
    let r = a.len().max(b.len());
    let at = |s: &[usize], i: usize| {
        if i + s.len() >= r {
            s[i + s.len() - r]
        } else {
            1
        }
    };
    (0..r).map(|i| at(a, i).max(at(b, i))).collect()
}

/// Operands of a binary map: small integers (so that comparisons have ties and Mod exact
/// answers) with divisors away from 0, broadcast against each other.
fn operands(b: BinaryOp, seed: u64, dt: DType) -> (Tensor, Tensor) {
    let mut r = Rng::new(seed);
    let (sx, sy) = ([3usize, 1, 5], [4usize, 1]);
    let mut draw = |n: usize, nonzero: bool| -> Vec<f64> {
        (0..n)
            .map(|_| loop {
                let v = r.int_in(-9, 10) as f64 * if dt.is_float() { 0.5 } else { 1.0 };
                // Unsigned operands are non-negative; their differences wrap.
                let v = if dt.is_unsigned() { v.abs() } else { v };
                if !(nonzero && v == 0.0) {
                    break v;
                }
            })
            .collect()
    };
    let divides = matches!(b, BinaryOp::Div | BinaryOp::Mod | BinaryOp::Fmod);
    let (x, y) = (draw(15, false), draw(4, divides));
    let t = |s: &[usize], v: Vec<f64>| match dt {
        DType::Bool => bools(s, &v.iter().map(|&v| v > 0.0).collect::<Vec<_>>()),
        _ => f64s(s, &v).cast(dt),
    };
    (t(&sx, x), t(&sy, y))
}

#[test]
fn every_binary_map_on_every_backend() {
    let maps = BinaryOp::ALL
        .iter()
        .copied()
        .filter(|b| *b != BinaryOp::Pow);
    each(maps.enumerate(), |(k, b)| {
        let ints = DType::ALL.into_iter().filter(|d| d.is_int());
        let dts: Vec<DType> = match b.kind() {
            BinaryKind::Logic => vec![DType::Bool],
            BinaryKind::Bitwise
                if matches!(b, BinaryOp::BitShiftLeft | BinaryOp::BitShiftRight) =>
            {
                ints.filter(|d| d.is_unsigned()).collect()
            }
            BinaryKind::Bitwise => ints.collect(),
            BinaryKind::Compare if b == BinaryOp::Equal => {
                [DType::F32, DType::Bool].into_iter().chain(ints).collect()
            }
            _ => [DType::F32].into_iter().chain(ints).collect(),
        };
        for dt in dts {
            let (x, y) = operands(b, 400 + k as u64, dt);
            // `check_exact` lets wgpu refuse integer dtypes; only the ones WGSL has no
            // type for may be refused.
            for backend in backends() {
                let r = run_op(
                    backend,
                    Op::Binary(b),
                    &[inp(x.clone()), inp(y.clone())],
                    1,
                    DType::F32,
                );
                if let Err(e) = r {
                    assert!(not_on(backend, dt), "{b:?} {dt} on {backend:?}: {e}");
                }
            }
            if dt == DType::F32 && b == BinaryOp::Div {
                check(Op::Binary(b), &[inp(x), inp(y)], &FLOATS, want2(b));
            } else if dt == DType::F32 {
                // Every float dtype, from the same f32 data (halves: exact in each).
                check_exact(Op::Binary(b), &[inp(x), inp(y)], &FLOATS, want2(b));
            } else {
                check_exact(Op::Binary(b), &[inp(x), inp(y)], &[DType::F32], want2(b));
            }
        }
    });
}

/// Range on every backend and dtype: its bounds as initializers, and fed at run time (the
/// plan is made for their values).
#[test]
fn range_on_every_backend() {
    let want = |a: &[Option<Tensor>]| {
        let v: Vec<f64> = a
            .iter()
            .map(|t| t.as_ref().unwrap().to_f64_vec()[0])
            .collect();
        let n = ((v[1] - v[0]) / v[2]).ceil().max(0.0) as usize;
        vec![(vec![n], (0..n).map(|i| v[0] + i as f64 * v[2]).collect())]
    };
    // The last is too long to be evaluated while planning: the backend's kernel makes it.
    let bounds = [
        (3.0, 9.0, 3.0),
        (10.0, 4.0, -2.0),
        (-1.0, 7.5, 0.5),
        (2.0, 2.0, 1.0),
        (5.0, 1.0, 1.0),
        (-7.0, 69993.0, 1.0),
    ];
    for (s, l, d) in bounds {
        let t = |v: f64| f64s(&[], &[v]);
        for make in [cst as fn(Tensor) -> Arg, inp] {
            let args = [make(t(s)), make(t(l)), make(t(d))];
            // f16 cannot hold the long one's limit.
            let dts: &[DType] = if l > 65504.0 {
                &[DType::F64, DType::F32, DType::BF16]
            } else {
                &FLOATS
            };
            check(Op::Range, &args, dts, want);
            if [s, l, d].iter().all(|v| v.fract() == 0.0) {
                for dt in [DType::I64, DType::I32] {
                    let ti = |v: f64| Tensor::from_vec(&[], vec![v as i64]).unwrap().cast(dt);
                    let args = [make(ti(s)), make(ti(l)), make(ti(d))];
                    for backend in backends() {
                        if let Err(e) = run_op(backend, Op::Range, &args, 1, DType::F32) {
                            assert!(not_on(backend, dt), "Range {dt} on {backend:?}: {e}");
                        }
                    }
                    check_exact(Op::Range, &args, &[DType::F32], want);
                }
            }
        }
    }
}

/// CumSum along every axis (negative too), inclusive and exclusive, forward and reverse,
/// on every backend and dtype.
#[test]
fn cumsum_on_every_backend() {
    let shape = [3usize, 4, 5];
    let x = f64s(
        &shape,
        &(0..60)
            .map(|i| ((i * 7) % 11) as f64 - 5.0)
            .collect::<Vec<_>>(),
    );
    for axis in [0i64, 1, 2, -1] {
        for (exclusive, reverse) in [(false, false), (true, false), (false, true), (true, true)] {
            let want = |a: &[Option<Tensor>]| {
                let v = a[0].as_ref().unwrap().to_f64_vec();
                let ax = axis.rem_euclid(3) as usize;
                let st = strides(&shape);
                let out = indices(&shape)
                    .iter()
                    .map(|p| {
                        (0..shape[ax])
                            .filter(|&j| match (exclusive, reverse) {
                                (false, false) => j <= p[ax],
                                (true, false) => j < p[ax],
                                (false, true) => j >= p[ax],
                                (true, true) => j > p[ax],
                            })
                            .map(|j| {
                                let mut q = p.clone();
                                q[ax] = j;
                                v[q.iter().zip(&st).map(|(a, b)| a * b).sum::<usize>()]
                            })
                            .sum()
                    })
                    .collect();
                vec![(shape.to_vec(), out)]
            };
            let op = Op::Cumulative {
                prod: false,
                exclusive,
                reverse,
            };
            let ax = cst(i64s(&[], &[axis]));
            // Small integers: exact in every dtype.
            check_exact(op.clone(), &[inp(x.clone()), ax.clone()], &FLOATS, want);
            for dt in [DType::I64, DType::I32] {
                let xi = x.cast(dt);
                for backend in backends() {
                    match run_op(
                        backend,
                        op.clone(),
                        &[inp(xi.clone()), ax.clone()],
                        1,
                        DType::F32,
                    ) {
                        Ok(got) => assert_eq!(
                            got[0].to_f64_vec(),
                            want(&[Some(xi.clone())])[0].1,
                            "CumSum {dt} on {backend:?}, axis {axis}"
                        ),
                        Err(e) => {
                            assert!(not_on(backend, dt), "CumSum {dt} on {backend:?}: {e}")
                        }
                    }
                }
                check_exact(op.clone(), &[inp(xi), ax.clone()], &[DType::F32], want);
            }
        }
    }
}

/// The indexing ops (every Pad mode, every Scatter reduction) × every backend × every
/// dtype: each combination runs and agrees with the CPU bit for bit (tests/ops_index.rs
/// checks the CPU against float64 references), or is one that `NOT_ON_BACKEND` lists, or
/// (a reduction over bools) is refused everywhere.
#[test]
fn indexing_ops_on_every_backend_and_dtype() {
    use graphrun::graph::op::AttrValue;
    use graphrun::BackendKind;
    let s = |v: &str| AttrValue::Str(v.into());
    let x = rand_ints(&[3, 4], 1, -5, 5);
    let pads = cst(i64s(&[4], &[1, 2, 2, 1]));
    let idx = i64s(&[2, 4], &[0, -1, 2, 0, 2, 1, 0, 0]);
    let nd_idx = i64s(&[3, 1], &[2, -1, 2]);
    let upd = rand_ints(&[2, 4], 2, -5, 5);
    let nd_upd = rand_ints(&[3, 4], 3, -5, 5);
    let mut cases: Vec<(Op, Vec<Tensor>, bool)> = vec![];
    for mode in ["constant", "reflect", "edge", "wrap"] {
        cases.push((op("Pad", &[("mode", s(mode))]), vec![], true));
    }
    for red in ["none", "add", "mul", "max", "min"] {
        let r = [("reduction", s(red))];
        let el = op(
            "ScatterElements",
            &[("axis", AttrValue::Int(0)), r[0].clone()],
        );
        cases.push((el, vec![idx.clone(), upd.clone()], red == "none"));
        cases.push((
            op("ScatterND", &r),
            vec![nd_idx.clone(), nd_upd.clone()],
            red == "none",
        ));
    }
    let dtypes = [
        DType::F64,
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::I32,
        DType::Bool,
    ];
    each(0..cases.len(), |k| {
        let (op_, rest, bools) = &cases[k];
        let bools = *bools;
        for dt in dtypes {
            let args: Vec<Arg> = match rest.as_slice() {
                [] => vec![inp(x.cast(dt)), pads.clone(), Arg::None, Arg::None],
                [i, u] => vec![inp(x.cast(dt)), inp(i.clone()), inp(u.cast(dt))],
                _ => unreachable!(),
            };
            let cpu = run_raw(BackendKind::Cpu, op_.clone(), &args, 1);
            for backend in backends() {
                let got = run_raw(backend, op_.clone(), &args, 1);
                match (&cpu, got) {
                    (Ok(want), Ok(got)) => assert_eq!(
                        got[0].to_f64_vec(),
                        want[0].to_f64_vec(),
                        "{} {dt} on {backend:?}",
                        op_.name()
                    ),
                    (Err(_), Err(_)) if dt == DType::Bool && !bools => {}
                    (Ok(_), Err(e)) if not_on(backend, dt) => {
                        assert!(e.to_string().contains("node"), "{e}")
                    }
                    (c, g) => panic!(
                        "{} {dt} on {backend:?}: cpu {:?}, got {:?}",
                        op_.name(),
                        c.as_ref().err().map(|e| e.to_string()),
                        g.err().map(|e| e.to_string())
                    ),
                }
            }
        }
    });
}

/// Im2Col (a copy with fills: every dtype) and Col2Im (a sum: the floating dtypes) ×
/// every backend, 1-, 2- and 3-D with strides, dilations, padding and ceil_mode: each
/// agrees with the CPU bit for bit (tests/ops_window.rs checks the CPU against float64
/// references), or the backend has no type for the dtype (`NOT_ON_BACKEND`).
#[test]
fn windows_on_every_backend_and_dtype() {
    use graphrun::graph::op::AttrValue as V;
    use graphrun::BackendKind;
    let ints = |v: &[i64]| V::Ints(v.to_vec());
    // (X's shape, Im2Col's attributes)
    type Setting = (Vec<usize>, Vec<(&'static str, V)>);
    let settings: Vec<Setting> = vec![
        (
            vec![2, 3, 7],
            vec![
                ("kernel_shape", ints(&[3])),
                ("strides", ints(&[2])),
                ("pads", ints(&[1, 2])),
                ("ceil_mode", V::Int(1)),
            ],
        ),
        (
            vec![1, 2, 5, 6],
            vec![
                ("kernel_shape", ints(&[2, 3])),
                ("dilations", ints(&[2, 1])),
                ("pads", ints(&[1, 0, 0, 1])),
            ],
        ),
        (
            vec![1, 2, 3, 4, 3],
            vec![
                ("kernel_shape", ints(&[2, 2, 2])),
                ("auto_pad", V::Str("SAME_LOWER".into())),
            ],
        ),
    ];
    let fills = [
        ("pad_value", V::Str("-inf".into())),
        ("beyond_value", V::Float(7.0)),
    ];
    for (k, (shape, attrs)) in settings.iter().enumerate() {
        let x = rand_ints(shape, 10 + k as u64, -100, 100);
        let mut a = attrs.clone();
        a.extend(fills.iter().cloned());
        let im2col = op("Im2Col", &a);
        for dt in DType::ALL {
            let args = [inp(x.cast(dt))];
            let cpu = run_raw(BackendKind::Cpu, im2col.clone(), &args, 1)
                .unwrap_or_else(|e| panic!("Im2Col {dt} on the CPU: {e}"));
            for backend in backends() {
                match run_raw(backend, im2col.clone(), &args, 1) {
                    Ok(got) => {
                        assert_eq!(got[0].bytes(), cpu[0].bytes(), "Im2Col {dt} on {backend:?}")
                    }
                    Err(e) => assert!(not_on(backend, dt), "Im2Col {dt} on {backend:?}: {e}"),
                }
            }
            if !dt.is_float() {
                continue;
            }
            // Col2Im of those columns back onto the image.
            let cols = &cpu[0];
            let l: usize = cols.shape()[2..].iter().product();
            let flat = cols
                .clone()
                .reshaped(&[cols.shape()[0], cols.shape()[1], l])
                .unwrap();
            let image = i64s(
                &[shape.len() - 2],
                &shape[2..].iter().map(|&d| d as i64).collect::<Vec<_>>(),
            );
            let mut ca = attrs.clone();
            let kernel = ca.remove(0).1;
            ca.push(("block", kernel));
            let col2im = op("Col2Im", &ca);
            let args = [inp(flat), cst(image)];
            let want = run_raw(BackendKind::Cpu, col2im.clone(), &args, 1)
                .unwrap_or_else(|e| panic!("Col2Im {dt} on the CPU: {e}"));
            assert_eq!(want[0].shape(), &shape[..]);
            for backend in backends() {
                match run_raw(backend, col2im.clone(), &args, 1) {
                    Ok(got) => assert_eq!(
                        got[0].to_f64_vec(),
                        want[0].to_f64_vec(),
                        "Col2Im {dt} on {backend:?}"
                    ),
                    Err(e) => assert!(not_on(backend, dt), "Col2Im {dt} on {backend:?}: {e}"),
                }
            }
        }
    }
}

/// ArgMax, ArgMin, TopK, ReduceProd and CumProd × every backend × every dtype they take:
/// each runs, or the backend has no type for the dtype (`NOT_ON_BACKEND`), and each
/// result equals the CPU's exactly (the data, ±1 and ±2 with ties, keeps every product and
/// pick exact). tests/ops_select.rs checks the CPU against float64 references.
#[test]
fn selections_and_products_on_every_backend() {
    use graphrun::graph::op::AttrValue as V;
    let mut r = Rng::new(77);
    let v: Vec<f64> = (0..60)
        .map(|_| [-2.0, -1.0, 1.0, 2.0][r.int_in(0, 4) as usize])
        .collect();
    let x = f64s(&[3, 4, 5], &v);
    let k = i64s(&[1], &[2]);
    let axis = i64s(&[], &[-2]);
    let cases: Vec<(Op, Vec<Tensor>, usize)> = vec![
        (op("ArgMax", &[("axis", V::Int(1))]), vec![], 1),
        (
            op(
                "ArgMin",
                &[("axis", V::Int(-1)), ("select_last_index", V::Int(1))],
            ),
            vec![],
            1,
        ),
        (op("TopK", &[("axis", V::Int(1))]), vec![k], 2),
        (
            op("ReduceProd", &[("axes", V::Ints(vec![0, 2]))]),
            vec![],
            1,
        ),
        (op("CumProd", &[("reverse", V::Int(1))]), vec![axis], 1),
    ];
    each(cases.iter().enumerate(), |(_, (op_, extra, n_out))| {
        for dt in [
            DType::F64,
            DType::F32,
            DType::F16,
            DType::BF16,
            DType::I64,
            DType::I32,
        ] {
            let mut args = vec![inp(x.cast(dt))];
            args.extend(extra.iter().map(|t| cst(t.clone())));
            let run = |b| run_op(b, op_.clone(), &args, *n_out, dt);
            let want = run(graphrun::BackendKind::Cpu)
                .unwrap_or_else(|e| panic!("{} {dt} on the CPU: {e}", op_.name()));
            for backend in backends() {
                // f16 on an adapter without SHADER_F16 (tests/wgpu.rs checks that error).
                if dt == DType::F16 && !computes(backend, dt) {
                    continue;
                }
                match run(backend) {
                    Ok(got) => {
                        for (g, w) in got.iter().zip(&want) {
                            assert_eq!(g.shape(), w.shape(), "{} {dt} on {backend:?}", op_.name());
                            assert_eq!(
                                g.to_f64_vec(),
                                w.to_f64_vec(),
                                "{} {dt} on {backend:?}",
                                op_.name()
                            );
                        }
                    }
                    Err(e) => assert!(
                        not_on(backend, dt),
                        "{} {dt} on {backend:?}: {e}",
                        op_.name()
                    ),
                }
            }
        }
    });
}

/// Conv and ConvGrad × every backend × every floating dtype (tests/common/conv_matrix.rs).
#[test]
fn convolutions_on_every_backend_and_dtype() {
    conv_matrix::convolutions_match_the_cpu(&backends());
}
