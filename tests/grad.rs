//! End-to-end gradients (SPEC §4, §8): for every differentiable operator, the backward
//! graph that `Session::backward` builds and runs (fused by the default passes, and
//! unfused) against central finite differences in f64 of the forward graph, on seeded
//! random inputs with broadcasting shapes; fused against unfused models; f32 against f64;
//! training steps with every optimizer.
//!
//! The differentiated scalar is Σ seed∘output over the floating graph outputs, with a
//! seeded random seed tensor per output (`Session::backward(feeds, seeds)`), so every
//! output of an op is checked at once. Every gradient `Session::backward` returns (each
//! floating graph input and trainable initializer) is compared, element by element, with
//! finite differences of the forward session run on perturbed inputs and initializers.

mod common;
use common::*;
use graphrun::exec::session::Gradients;
use graphrun::graph::op::AttrValue;
use graphrun::graph::{Dim, Graph, InitSource, Initializer, InputInfo, Node, Optimizer, Training};
use graphrun::passes::{autodiff, PassOptions, PASSES};
use graphrun::rng::Rng;
use graphrun::{DType, Model, Session, SessionOptions, Tensor};
use std::collections::{BTreeMap, HashMap};

type V = AttrValue;
/// An op's attributes.
type Attrs = Vec<(&'static str, V)>;
/// Reduction axes, when given.
type Axes<'a> = Option<&'a [i64]>;

// ---- the harness ---------------------------------------------------------------------------

/// A graph under construction, and the data fed to its inputs.
#[derive(Clone)]
struct Net {
    g: Graph,
    feeds: HashMap<String, Tensor>,
    /// Sessions run in training mode (Dropout applies its mask).
    training: bool,
}

/// A new, empty graph; `what` names it in failure messages.
fn net(what: &str) -> Net {
    Net {
        g: Graph {
            name: what.to_string(),
            dims: Default::default(),
            inputs: vec![],
            outputs: vec![],
            initializers: vec![],
            nodes: vec![],
            training: None,
            updates: vec![],
            file: None,
        },
        feeds: HashMap::new(),
        training: false,
    }
}

impl Net {
    /// A graph input fed `t`.
    fn input(mut self, name: &str, t: Tensor) -> Net {
        self.g.inputs.push(InputInfo {
            default: None,
            name: name.into(),
            dtype: t.dtype(),
            shape: t.shape().iter().map(|&d| Dim::Fixed(d)).collect(),
            range: None,
            loc: None,
        });
        self.feeds.insert(name.into(), t);
        self
    }
    fn init(mut self, name: &str, t: Tensor, trainable: bool) -> Net {
        self.g.initializers.push(Initializer {
            name: name.into(),
            tensor: t,
            trainable,
            source: InitSource::Data,
            loc: None,
        });
        self
    }
    /// A trainable initializer (it gets a gradient).
    fn param(self, name: &str, t: Tensor) -> Net {
        self.init(name, t, true)
    }
    /// A non-trainable initializer (no gradient; known when the plan is made).
    fn konst(self, name: &str, t: Tensor) -> Net {
        self.init(name, t, false)
    }
    /// A node of ONNX op `name` ("" in `ins` omits an optional input).
    fn op(mut self, name: &str, attrs: &[(&str, V)], ins: &[&str], outs: &[&str]) -> Net {
        let node = Node {
            name: format!("n{}", self.g.nodes.len()),
            op: op(name, attrs),
            inputs: ins.iter().map(|s| s.to_string()).collect(),
            outputs: outs.iter().map(|s| s.to_string()).collect(),
            loc: None,
        };
        self.g.nodes.push(node);
        self
    }
    fn outputs(mut self, outs: &[&str]) -> Net {
        self.g.outputs = outs.iter().map(|s| s.to_string()).collect();
        self
    }
    fn training(mut self) -> Net {
        self.training = true;
        self
    }
}

/// Finite-difference step and the relative error allowed against it.
#[derive(Clone, Copy)]
struct Fd {
    h: f64,
    tol: f64,
}
/// Central differences in f64: truncation (~h²) and rounding (~1e-16/h) errors near 1e-10.
const FD: Fd = Fd { h: 1e-6, tol: 1e-6 };

/// Every pass off: the backward graph runs exactly as the builder wrote it.
fn no_passes() -> PassOptions {
    PassOptions {
        disabled: PASSES.iter().map(|s| s.to_string()).collect(),
        training: false,
        ..Default::default()
    }
}

fn session(g: &Graph, training: bool, passes: PassOptions) -> graphrun::Result<Session> {
    Session::new(
        g.clone(),
        SessionOptions {
            training,
            passes,
            ..SessionOptions::unfused()
        },
    )
}

/// A seeded random seed gradient for each floating output: multiples of 1/64 in ±2, so
/// that they are exact in every float dtype (a Cast's gradient is a Cast of the seed).
fn seeds_for(outs: &[(String, Tensor)]) -> HashMap<String, Tensor> {
    outs.iter()
        .enumerate()
        .filter(|(_, (_, t))| t.dtype().is_float())
        .map(|(k, (n, t))| {
            let mut r = Rng::new(9000 + k as u64);
            let v: Vec<f64> = (0..t.numel())
                .map(|_| {
                    let m = r.int_in(1, 129) as f64 / 64.0;
                    if r.uniform() < 0.5 {
                        -m
                    } else {
                        m
                    }
                })
                .collect();
            (
                n.clone(),
                Tensor::from_f64(t.dtype(), t.shape(), &v).unwrap(),
            )
        })
        .collect()
}

/// Σ seed∘output over the floating outputs: the scalar whose gradient `backward` computes.
fn objective(outs: &[(String, Tensor)], seeds: &HashMap<String, Tensor>) -> f64 {
    outs.iter()
        .filter_map(|(n, t)| seeds.get(n).map(|s| (t, s)))
        .map(|(t, s)| {
            t.to_f64_vec()
                .iter()
                .zip(s.to_f64_vec())
                .map(|(y, d)| y * d)
                .sum::<f64>()
        })
        .sum()
}

/// The graph with every trainable floating initializer made a graph input (fed its value),
/// so that finite differences can perturb parameters like inputs.
fn params_as_inputs(n: &Net) -> (Graph, HashMap<String, Tensor>) {
    let mut g = n.g.clone();
    let mut feeds = n.feeds.clone();
    let (params, rest): (Vec<Initializer>, Vec<Initializer>) = g
        .initializers
        .drain(..)
        .partition(|i| i.trainable && i.tensor.dtype().is_float());
    g.initializers = rest;
    for p in params {
        g.inputs.push(InputInfo {
            default: None,
            name: p.name.clone(),
            dtype: p.tensor.dtype(),
            shape: p.tensor.shape().iter().map(|&d| Dim::Fixed(d)).collect(),
            range: None,
            loc: None,
        });
        feeds.insert(p.name, p.tensor);
    }
    (g, feeds)
}

/// The values `Session::backward` must differentiate: floating inputs, then trainable
/// floating initializers, in declaration order.
fn wanted(g: &Graph) -> Vec<String> {
    g.inputs
        .iter()
        .filter(|i| i.dtype.is_float())
        .map(|i| i.name.clone())
        .chain(
            g.initializers
                .iter()
                .filter(|i| i.trainable && i.tensor.dtype().is_float())
                .map(|i| i.name.clone()),
        )
        .collect()
}

/// The forward outputs for FD. At inference `Session::run`; in training mode the forward
/// of `Session::backward` (it draws the Dropout masks of the next training step, which
/// `run`, always inference, does not), whose outputs do not depend on the seeds.
fn forward(
    s: &mut Session,
    training: bool,
    feeds: &HashMap<String, Tensor>,
) -> graphrun::Result<Vec<(String, Tensor)>> {
    if training {
        Ok(s.backward(feeds, &HashMap::new())?.outputs)
    } else {
        s.run(feeds)
    }
}

/// Runs `Session::backward` with the backward graph fused (default passes) and unfused,
/// and checks every gradient of both against central finite differences of the forward
/// graph. Returns the fused run's gradients and the seeds used.
fn verify(n: &Net, fd: Fd) -> Result<(Gradients, HashMap<String, Tensor>), String> {
    let what = &n.g.name;
    let err = |stage: &str| {
        let what = what.clone();
        let stage = stage.to_string();
        move |e: graphrun::Error| format!("{what}: {stage}: {e}")
    };
    graphrun::validate(&n.g).map_err(err("the test graph is invalid"))?;
    let mut fwd = session(&n.g, n.training, PassOptions::default()).map_err(err("session"))?;
    let outs = forward(&mut fwd, n.training, &n.feeds).map_err(err("forward"))?;
    let seeds = seeds_for(&outs);
    let mut runs = vec![];
    for (how, passes) in [("fused", PassOptions::default()), ("unfused", no_passes())] {
        let mut s = session(&n.g, n.training, passes).map_err(err("session"))?;
        let gr = s
            .backward(&n.feeds, &seeds)
            .map_err(err(&format!("backward ({how})")))?;
        // The backward graph recomputes the forward outputs: they must not change.
        for ((name, want), (_, got)) in outs.iter().zip(&gr.outputs) {
            let e = rel_err(&got.to_f64_vec(), &want.to_f64_vec());
            if e > 1e-12 {
                return Err(format!(
                    "{what}: backward ({how}) computes output '{name}' differently: rel err {e:.3e}"
                ));
            }
        }
        let names: Vec<String> = gr.grads.iter().map(|(w, _)| w.clone()).collect();
        if names != wanted(&n.g) {
            return Err(format!(
                "{what}: backward ({how}) returned gradients of {names:?}, want {:?}",
                wanted(&n.g)
            ));
        }
        runs.push((how, gr));
    }
    let (fg, ffeeds) = params_as_inputs(n);
    let mut fs = session(&fg, n.training, PassOptions::default()).map_err(err("session"))?;
    let mut objective_at = |feeds: &HashMap<String, Tensor>| -> Result<f64, String> {
        let outs = forward(&mut fs, n.training, feeds).map_err(err("forward"))?;
        Ok(objective(&outs, &seeds))
    };
    let mut fails = vec![];
    for (w, _) in &runs[0].1.grads {
        let x = &ffeeds[w];
        let xv = x.to_f64_vec();
        let mut fdv = Vec::with_capacity(xv.len());
        for i in 0..xv.len() {
            let mut at = |d: f64| -> Result<f64, String> {
                let mut v = xv.clone();
                v[i] += d;
                let mut feeds = ffeeds.clone();
                feeds.insert(
                    w.clone(),
                    Tensor::from_f64(x.dtype(), x.shape(), &v).unwrap(),
                );
                objective_at(&feeds)
            };
            fdv.push((at(fd.h)? - at(-fd.h)?) / (2.0 * fd.h));
        }
        for (how, gr) in &runs {
            let t = &gr.grads.iter().find(|(n, _)| n == w).expect("checked").1;
            if t.dtype() != x.dtype() || t.shape() != x.shape() {
                fails.push(format!(
                    "{what}: d/d{w} ({how}) is {}{:?}, want {}{:?}",
                    t.dtype(),
                    t.shape(),
                    x.dtype(),
                    x.shape()
                ));
                continue;
            }
            let got = t.to_f64_vec();
            let e = rel_err(&got, &fdv);
            if e.is_nan() || e > fd.tol {
                fails.push(format!(
                    "{what}: d/d{w} ({how}): rel err {e:.3e} > {:.0e} against finite differences\n   got {:?}\n  want {:?}",
                    fd.tol,
                    &got[..got.len().min(8)],
                    &fdv[..fdv.len().min(8)]
                ));
            }
        }
    }
    if !fails.is_empty() {
        return Err(fails.join("\n"));
    }
    Ok((runs.swap_remove(0).1, seeds))
}

/// Checks one graph's gradients (see `verify`); panics on a mismatch.
fn check(n: &Net) -> (Gradients, HashMap<String, Tensor>) {
    verify(n, FD).unwrap_or_else(|e| panic!("{e}"))
}

/// Checks every graph, reporting all failures together.
fn check_all(nets: &[Net]) {
    check_all_fd(nets, FD)
}

fn check_all_fd(nets: &[Net], fd: Fd) {
    let fails: Vec<String> = nets.iter().filter_map(|n| verify(n, fd).err()).collect();
    assert!(
        fails.is_empty(),
        "{} of {} graphs failed:\n{}",
        fails.len(),
        nets.len(),
        fails.join("\n")
    );
}

/// The gradient of `name` in a result.
fn grad_of<'a>(g: &'a Gradients, name: &str) -> &'a Tensor {
    &g.grads.iter().find(|(n, _)| n == name).unwrap().1
}

// ---- data ----------------------------------------------------------------------------------

/// Magnitudes in [0.3, 1.5) with random signs: away from kinks and poles at 0.
fn sg(shape: &[usize], seed: u64) -> Tensor {
    let mut r = Rng::new(seed);
    let v: Vec<f64> = (0..shape.iter().product())
        .map(|_| {
            let m = r.uniform_in(0.3, 1.5);
            if r.uniform() < 0.5 {
                -m
            } else {
                m
            }
        })
        .collect();
    f64s(shape, &v)
}
/// Uniform in [0.5, 2): inside the domain of Log, Sqrt and Pow's base.
fn pos(shape: &[usize], seed: u64) -> Tensor {
    rand(shape, seed, 0.5, 2.0)
}
/// Multiples of 1/16 in [-2.5, 2.5], non-zero: exact in f32, f16 and bf16, and stay so
/// when moved by a step of 1/16.
fn grid(shape: &[usize], seed: u64) -> Tensor {
    let mut r = Rng::new(seed);
    let v: Vec<f64> = (0..shape.iter().product())
        .map(|_| {
            let k = r.int_in(1, 41) as f64 / 16.0;
            if r.uniform() < 0.5 {
                -k
            } else {
                k
            }
        })
        .collect();
    f64s(shape, &v)
}
fn i64v(v: &[i64]) -> Tensor {
    i64s(&[v.len()], v)
}
fn i32v(v: &[i32]) -> Tensor {
    Tensor::from_vec(&[v.len()], v.to_vec()).unwrap()
}
fn ints(v: &[i64]) -> V {
    V::Ints(v.to_vec())
}

// ---- elementwise ---------------------------------------------------------------------------

#[test]
fn unary_ops() {
    let s = [3, 4];
    let cases: Vec<(&str, Attrs, Tensor)> = vec![
        ("Neg", vec![], randn(&s, 1)),
        ("Exp", vec![], randn(&s, 2)),
        ("Log", vec![], pos(&s, 3)),
        ("Sqrt", vec![], pos(&s, 4)),
        ("Reciprocal", vec![], sg(&s, 5)),
        ("Abs", vec![], sg(&s, 6)),
        ("Erf", vec![], randn(&s, 7)),
        ("Relu", vec![], sg(&s, 8)),
        ("Sigmoid", vec![], randn(&s, 9)),
        ("Tanh", vec![], randn(&s, 10)),
        ("Gelu", vec![], sg(&s, 11)),
        (
            "Gelu",
            vec![("approximate", V::Str("none".into()))],
            sg(&s, 12),
        ),
        (
            "Gelu",
            vec![("approximate", V::Str("tanh".into()))],
            sg(&s, 13),
        ),
        ("LeakyRelu", vec![], sg(&s, 14)),
        ("LeakyRelu", vec![("alpha", V::Float(0.3))], sg(&s, 15)),
        ("Identity", vec![], randn(&s, 16)),
    ];
    let mut nets = vec![];
    for (k, (name, attrs, x)) in cases.into_iter().enumerate() {
        // As a graph input, and as a trainable initializer read by two consumers (the
        // gradients of both must be summed).
        nets.push(
            net(&format!("{name} #{k} of an input"))
                .input("x", x.clone())
                .op(name, &attrs, &["x"], &["y"])
                .outputs(&["y"]),
        );
        nets.push(
            net(&format!("{name} #{k} of a parameter, twice"))
                .param("p", x)
                .op(name, &attrs, &["p"], &["y"])
                .op("Mul", &[], &["y", "p"], &["z"])
                .outputs(&["y", "z"]),
        );
    }
    check_all(&nets);
}

/// Operands for a binary op: (x, y) with y away from 0 for Div, x positive for Pow.
fn binary_args(op: &str, sx: &[usize], sy: &[usize], seed: u64) -> (Tensor, Tensor) {
    match op {
        "Div" => (randn(sx, seed), sg(sy, seed + 1)),
        "Pow" => (pos(sx, seed), rand(sy, seed + 1, -1.5, 1.5)),
        _ => (randn(sx, seed), randn(sy, seed + 1)),
    }
}

#[test]
fn binary_ops_with_broadcasting() {
    let shapes: [(&[usize], &[usize]); 6] = [
        (&[3, 1, 5], &[4, 1]),
        (&[4, 1], &[3, 1, 5]),
        (&[3, 4], &[3, 4]),
        (&[2, 3, 4], &[]),
        (&[], &[2, 3]),
        (&[2, 1, 4], &[2, 3, 1]),
    ];
    let mut nets = vec![];
    for (k, op_) in ["Add", "Sub", "Mul", "Div", "Pow"].into_iter().enumerate() {
        for (j, (sx, sy)) in shapes.iter().enumerate() {
            let (x, y) = binary_args(op_, sx, sy, 100 * k as u64 + 10 * j as u64);
            // x an input and y a parameter, then the other way round.
            nets.push(
                net(&format!("{op_} {sx:?}·{sy:?} (input, param)"))
                    .input("x", x.clone())
                    .param("y", y.clone())
                    .op(op_, &[], &["x", "y"], &["z"])
                    .outputs(&["z"]),
            );
            nets.push(
                net(&format!("{op_} {sx:?}·{sy:?} (param, input)"))
                    .param("x", x)
                    .input("y", y)
                    .op(op_, &[], &["x", "y"], &["z"])
                    .outputs(&["z"]),
            );
        }
        // The same value on both sides.
        let x = if op_ == "Pow" {
            pos(&[3, 4], 7)
        } else {
            sg(&[3, 4], 7)
        };
        nets.push(
            net(&format!("{op_}(x, x)"))
                .input("x", x)
                .op(op_, &[], &["x", "x"], &["z"])
                .outputs(&["z"]),
        );
    }
    check_all(&nets);
}

/// Min, Max, Mod (both forms) and PRelu: gradients through the operand each element
/// takes, with broadcasting, against finite differences.
#[test]
fn min_max_mod_prelu_with_broadcasting() {
    let shapes: [(&[usize], &[usize]); 4] = [
        (&[3, 1, 5], &[4, 1]),
        (&[3, 4], &[3, 4]),
        (&[2, 3, 4], &[]),
        (&[2, 1, 4], &[2, 3, 1]),
    ];
    let fmod = [("fmod", V::Int(1))];
    let ops: [(&str, &[(&str, V)]); 5] = [
        ("Min", &[]),
        ("Max", &[]),
        ("Mod", &[]),
        ("Mod", &fmod),
        ("PRelu", &[]),
    ];
    let mut nets = vec![];
    for (k, (op_, attrs)) in ops.into_iter().enumerate() {
        for (j, (sx, sy)) in shapes.iter().enumerate() {
            let seed = 500 + 100 * k as u64 + 10 * j as u64;
            // Mod's divisor away from 0; x spread over several periods.
            let (x, y) = match op_ {
                "Mod" => (rand(sx, seed, -4.0, 4.0), sg(sy, seed + 1)),
                _ => (randn(sx, seed), randn(sy, seed + 1)),
            };
            nets.push(
                net(&format!("{op_} {attrs:?} {sx:?}·{sy:?}"))
                    .input("x", x)
                    .param("y", y)
                    .op(op_, attrs, &["x", "y"], &["z"])
                    .outputs(&["z"]),
            );
        }
    }
    nets.push(
        net("Max(x, x)")
            .input("x", sg(&[3, 4], 9))
            .op("Max", &[], &["x", "x"], &["z"])
            .outputs(&["z"]),
    );
    check_all(&nets);
}

#[test]
fn pow_with_constant_and_integer_exponents() {
    check_all(&[
        net("Pow(x, 3.0 constant)")
            .input("x", sg(&[3, 4], 1))
            .konst("e", Tensor::scalar(3.0f64))
            .op("Pow", &[], &["x", "e"], &["y"])
            .outputs(&["y"]),
        net("Pow(x, i64 2)")
            .input("x", sg(&[3, 4], 2))
            .konst("e", Tensor::scalar(2i64))
            .op("Pow", &[], &["x", "e"], &["y"])
            .outputs(&["y"]),
        net("Pow(x, i64 input [4])")
            .input("x", pos(&[3, 4], 3))
            .input("e", i64v(&[1, 2, 3, -1]))
            .op("Pow", &[], &["x", "e"], &["y"])
            .outputs(&["y"]),
    ]);
}

#[test]
fn clip_with_and_without_bounds() {
    // Values in ±2.25 with bounds -0.5 and 0.8: some below, some above, some inside.
    let x = || {
        sg(&[4, 5], 3)
            .to_f64_vec()
            .iter()
            .map(|v| v * 1.5)
            .collect::<Vec<_>>()
    };
    let x = f64s(&[4, 5], &x());
    check_all(&[
        net("Clip(x, lo, hi) with lo, hi inputs")
            .input("x", x.clone())
            .input("lo", Tensor::scalar(-0.5f64))
            .input("hi", Tensor::scalar(0.8f64))
            .op("Clip", &[], &["x", "lo", "hi"], &["y"])
            .outputs(&["y"]),
        net("Clip(x, lo) with lo a parameter")
            .input("x", x.clone())
            .param("lo", Tensor::scalar(-0.5f64))
            .op("Clip", &[], &["x", "lo"], &["y"])
            .outputs(&["y"]),
        net("Clip(x, , hi) with hi constant")
            .param("x", x.clone())
            .konst("hi", Tensor::scalar(0.8f64))
            .op("Clip", &[], &["x", "", "hi"], &["y"])
            .outputs(&["y"]),
        net("Clip(x)")
            .input("x", x)
            .op("Clip", &[], &["x"], &["y"])
            .outputs(&["y"]),
    ]);
}

#[test]
fn where_with_broadcasting() {
    let c: Vec<bool> = (0..12).map(|i| i % 3 != 1).collect();
    check_all(&[
        net("Where(c[3,4,1], x[4,5], y[3,1,5])")
            .input("c", bools(&[3, 4, 1], &c))
            .param("x", randn(&[4, 5], 1))
            .input("y", randn(&[3, 1, 5], 2))
            .op("Where", &[], &["c", "x", "y"], &["z"])
            .outputs(&["z"]),
        net("Where(c[12], x[], y[2,12])")
            .input("c", bools(&[12], &c))
            .input("x", Tensor::scalar(0.7f64))
            .param("y", randn(&[2, 12], 3))
            .op("Where", &[], &["c", "x", "y"], &["z"])
            .outputs(&["z"]),
    ]);
}

#[test]
fn cast_between_float_dtypes() {
    // On values exact in every float dtype, with a step of 1/16 that keeps them exact, the
    // casts are exact and finite differences of these (linear) graphs are exact too.
    let exact = Fd {
        h: 1.0 / 16.0,
        tol: 1e-12,
    };
    let mut nets = vec![];
    for mid in ["f32", "f16", "bf16"] {
        nets.push(
            net(&format!("Cast f64 -> {mid} -> f64"))
                .input("x", grid(&[3, 4], 1))
                .op("Cast", &[("to", V::Str(mid.into()))], &["x"], &["m"])
                .op("Cast", &[("to", V::Str("f64".into()))], &["m"], &["y"])
                .outputs(&["y"]),
        );
    }
    nets.push(
        net("Cast f32 input -> f64, times an f64 parameter")
            .input("x", grid(&[3, 4], 2).cast(DType::F32))
            .param("w", grid(&[3, 4], 3))
            .op("Cast", &[("to", V::Int(11))], &["x"], &["xd"])
            .op("Mul", &[], &["xd", "w"], &["y"])
            .outputs(&["y"]),
    );
    nets.push(
        net("Cast f64 parameter -> f32 output")
            .param("p", grid(&[2, 3], 4))
            .op("Cast", &[("to", V::Str("f32".into()))], &["p"], &["y"])
            .outputs(&["y"]),
    );
    check_all_fd(&nets, exact);
    // Through an integer Cast no gradient flows: only the direct path counts.
    check(
        &net("x + Cast(Cast(x, i64), f64)")
            .input("x", rand(&[3, 4], 5, 0.1, 0.9))
            .op("Cast", &[("to", V::Str("i64".into()))], &["x"], &["xi"])
            .op("Cast", &[("to", V::Str("f64".into()))], &["xi"], &["xf"])
            .op("Add", &[], &["x", "xf"], &["y"])
            .outputs(&["y"]),
    );
}

#[test]
fn dropout_at_inference_is_identity() {
    let (g, seeds) = check(
        &net("Dropout inference")
            .input("x", randn(&[4, 6], 1))
            .op("Dropout", &[("ratio", V::Float(0.5))], &["x"], &["y"])
            .outputs(&["y"]),
    );
    assert_eq!(grad_of(&g, "x").to_f64_vec(), seeds["y"].to_f64_vec());
}

/// Dropout of x·w (w a parameter) with outputs y and mask; `tm` feeds a training_mode
/// input.
fn dropout_net(what: &str, ratio: f64, ratio_input: bool, tm: Option<bool>) -> Net {
    let mut n = net(what)
        .input("x", randn(&[6, 8], 1))
        .param("w", randn(&[8], 2));
    let mut ins = vec!["xw", ""];
    if ratio_input {
        n = n.konst("r", Tensor::scalar(ratio));
        ins[1] = "r";
    }
    if let Some(t) = tm {
        n = n.input("tm", bools(&[], &[t]));
        ins.push("tm");
    }
    n.op("Mul", &[], &["x", "w"], &["xw"])
        .op(
            "Dropout",
            &[("ratio", V::Float(ratio))],
            &ins,
            &["y", "mask"],
        )
        .outputs(&["y", "mask"])
}

/// Checks d/dx = seed · mask / (1 − ratio) · w, with the mask the backward's forward drew.
fn check_dropout_grad(n: &Net, ratio: f64, masked: bool) {
    let (g, seeds) = check(n);
    let mask = g.outputs[1].1.to_f64_vec();
    let kept = mask.iter().filter(|&&m| m != 0.0).count();
    if masked {
        assert!(
            kept > 0 && kept < mask.len(),
            "{}: mask keeps {kept} of {}",
            n.g.name,
            mask.len()
        );
    } else {
        assert_eq!(kept, mask.len(), "{}: inference mask", n.g.name);
    }
    let scale = if masked { 1.0 / (1.0 - ratio) } else { 1.0 };
    let w = n.g.initializers[0].tensor.to_f64_vec();
    let dy = seeds["y"].to_f64_vec();
    let want: Vec<f64> = (0..mask.len())
        .map(|i| dy[i] * mask[i] * scale * w[i % 8])
        .collect();
    assert_grad(&n.g.name, &grad_of(&g, "x").to_f64_vec(), &want, 1e-12);
}

#[test]
fn dropout_in_training_scales_by_the_mask() {
    for (ratio, ratio_input) in [(0.5, false), (0.25, true)] {
        let what = format!("Dropout training ratio {ratio} (input: {ratio_input})");
        check_dropout_grad(
            &dropout_net(&what, ratio, ratio_input, None).training(),
            ratio,
            true,
        );
    }
    // Outside training, as the training_mode input says (known only at run time).
    for tm in [true, false] {
        let what = format!("Dropout at inference, training_mode input {tm}");
        check_dropout_grad(&dropout_net(&what, 0.5, false, Some(tm)), 0.5, tm);
    }
}

#[test]
fn training_backward_graph_runs_as_an_ordinary_graph() {
    // The backward graph of a training step, run by a plain session (inference, step 0):
    // its Dropout still applies the mask its gradient assumes.
    let n = dropout_net("Dropout backward graph", 0.5, false, None);
    let shapes = HashMap::from([("x".to_string(), vec![6, 8])]);
    let opts = autodiff::BackwardOptions {
        training: true,
        inputs: true,
        ..Default::default()
    };
    let bwd = autodiff::backward(&n.g, &["y".to_string()], &shapes, &opts).unwrap();
    let mut feeds = n.feeds.clone();
    let dy = randn(&[6, 8], 3);
    feeds.insert(bwd.seeds[0].1.clone(), dy.clone());
    let mut s = session(&bwd.graph, false, PassOptions::default()).unwrap();
    let outs: HashMap<String, Tensor> = s.run(&feeds).unwrap().into_iter().collect();
    let mask = outs["mask"].to_f64_vec();
    let kept = mask.iter().filter(|&&m| m != 0.0).count();
    assert!(
        kept > 0 && kept < mask.len(),
        "mask keeps {kept} of {}",
        mask.len()
    );
    let (x, y) = (n.feeds["x"].to_f64_vec(), outs["y"].to_f64_vec());
    let w = n.g.initializers[0].tensor.to_f64_vec();
    let dyv = dy.to_f64_vec();
    let dx = &bwd.grads.iter().find(|(v, _)| v == "x").unwrap().1;
    let got = outs[dx].to_f64_vec();
    for i in 0..mask.len() {
        assert!(
            (y[i] - mask[i] * 2.0 * x[i] * w[i % 8]).abs() < 1e-12,
            "y[{i}]"
        );
        assert!(
            (got[i] - dyv[i] * mask[i] * 2.0 * w[i % 8]).abs() < 1e-12,
            "dx[{i}]"
        );
    }
}

// ---- linear algebra ------------------------------------------------------------------------

#[test]
fn matmul_shapes() {
    let shapes: [(&[usize], &[usize]); 9] = [
        (&[3, 4], &[4, 5]),
        (&[2, 3, 4], &[2, 4, 5]),
        (&[2, 1, 3, 4], &[3, 4, 5]),
        (&[2, 3, 4], &[4, 5]),
        (&[3, 4], &[2, 4, 5]),
        (&[4], &[2, 4, 5]),
        (&[2, 3, 4], &[4]),
        (&[4], &[4, 3]),
        (&[4], &[4]),
    ];
    let mut nets = vec![];
    for (k, (sa, sb)) in shapes.iter().enumerate() {
        let (a, b) = (randn(sa, 10 * k as u64), randn(sb, 10 * k as u64 + 1));
        nets.push(
            net(&format!("MatMul {sa:?}·{sb:?} (input, param)"))
                .input("a", a.clone())
                .param("b", b.clone())
                .op("MatMul", &[], &["a", "b"], &["y"])
                .outputs(&["y"]),
        );
        nets.push(
            net(&format!("MatMul {sa:?}·{sb:?} (param, input)"))
                .param("a", a)
                .input("b", b)
                .op("MatMul", &[], &["a", "b"], &["y"])
                .outputs(&["y"]),
        );
    }
    nets.push(
        net("MatMul(x, x)")
            .input("x", randn(&[3, 3], 99))
            .op("MatMul", &[], &["x", "x"], &["y"])
            .outputs(&["y"]),
    );
    check_all(&nets);
}

#[test]
fn gemm_transposes_scales_and_c_broadcast() {
    let (m, k, n) = (3, 4, 5);
    let cs: [Option<&[usize]>; 6] = [
        None,
        Some(&[5]),
        Some(&[1, 5]),
        Some(&[]),
        Some(&[3, 5]),
        Some(&[3, 1]),
    ];
    let mut nets = vec![];
    let mut seed = 0;
    for ta in [0, 1] {
        for tb in [0, 1] {
            for (j, c) in cs.iter().enumerate() {
                // alpha and beta other than 1 on every other case.
                let (alpha, beta) = if j % 2 == 0 { (0.7, 1.3) } else { (1.0, 1.0) };
                seed += 10;
                let sa = if ta == 1 { [k, m] } else { [m, k] };
                let sb = if tb == 1 { [n, k] } else { [k, n] };
                let attrs = [
                    ("transA", V::Int(ta)),
                    ("transB", V::Int(tb)),
                    ("alpha", V::Float(alpha)),
                    ("beta", V::Float(beta)),
                ];
                let mut nt = net(&format!(
                    "Gemm transA {ta} transB {tb} alpha {alpha} beta {beta} C {c:?}"
                ))
                .input("a", randn(&sa, seed))
                .param("b", randn(&sb, seed + 1));
                let ins: &[&str] = match c {
                    Some(sc) => {
                        nt = nt.param("c", randn(sc, seed + 2));
                        &["a", "b", "c"]
                    }
                    None => &["a", "b"],
                };
                nets.push(nt.op("Gemm", &attrs, ins, &["y"]).outputs(&["y"]));
            }
        }
    }
    // C as a graph input.
    nets.push(
        net("Gemm with C an input")
            .param("a", randn(&[m, k], 1))
            .input("b", randn(&[k, n], 2))
            .input("c", randn(&[1, n], 3))
            .op("Gemm", &[("beta", V::Float(0.5))], &["a", "b", "c"], &["y"])
            .outputs(&["y"]),
    );
    check_all(&nets);
}

#[test]
fn fused_matmul_activations_bias_residual() {
    let acts = [
        "none",
        "relu",
        "gelu",
        "gelu_tanh",
        "silu",
        "sigmoid",
        "tanh",
    ];
    let mut nets = vec![];
    for (k, act) in acts.iter().enumerate() {
        let s = 100 * k as u64;
        let a = |tb: bool| {
            vec![
                ("activation", V::Str(act.to_string())),
                ("trans_b", V::Int(tb as i64)),
            ]
        };
        nets.push(
            net(&format!("FusedMatMul {act} bias residual"))
                .input("a", randn(&[3, 4], s))
                .param("b", randn(&[4, 5], s + 1))
                .param("bias", randn(&[5], s + 2))
                .input("r", randn(&[3, 5], s + 3))
                .op("FusedMatMul", &a(false), &["a", "b", "bias", "r"], &["y"])
                .outputs(&["y"]),
        );
        nets.push(
            net(&format!("FusedMatMul {act} trans_b, batched A, bias"))
                .input("a", randn(&[2, 3, 4], s + 4))
                .param("b", randn(&[5, 4], s + 5))
                .param("bias", randn(&[5], s + 6))
                .op("FusedMatMul", &a(true), &["a", "b", "bias"], &["y"])
                .outputs(&["y"]),
        );
        nets.push(
            net(&format!("FusedMatMul {act} no bias, residual, parameter A"))
                .param("a", randn(&[2, 3, 4], s + 7))
                .input("b", randn(&[4, 5], s + 8))
                .input("r", randn(&[2, 3, 5], s + 9))
                .op("FusedMatMul", &a(false), &["a", "b", "", "r"], &["y"])
                .outputs(&["y"]),
        );
        nets.push(
            net(&format!("FusedMatMul {act} batched B"))
                .input("a", randn(&[2, 3, 4], s + 10))
                .param("b", randn(&[2, 4, 5], s + 11))
                .input("bias", randn(&[5], s + 12))
                .op("FusedMatMul", &a(false), &["a", "b", "bias"], &["y"])
                .outputs(&["y"]),
        );
    }
    check_all(&nets);
}

// ---- normalization and reductions ----------------------------------------------------------

#[test]
fn softmax_and_log_softmax_axes() {
    let mut nets = vec![];
    for op_ in ["Softmax", "LogSoftmax"] {
        for axis in [0, 1, 2, -1] {
            nets.push(
                net(&format!("{op_} axis {axis}"))
                    .input("x", randn(&[2, 3, 4], (axis + 7) as u64))
                    .op(op_, &[("axis", V::Int(axis))], &["x"], &["y"])
                    .outputs(&["y"]),
            );
        }
    }
    check_all(&nets);
}

#[test]
fn layer_normalization_axes_scale_bias() {
    let x = || randn(&[2, 3, 4], 1);
    let ln = |axis: i64| vec![("axis", V::Int(axis)), ("epsilon", V::Float(1e-5))];
    check_all(&[
        net("LayerNormalization axis -1 with B")
            .input("x", x())
            .param("s", randn(&[4], 2))
            .param("b", randn(&[4], 3))
            .op("LayerNormalization", &ln(-1), &["x", "s", "b"], &["y"])
            .outputs(&["y"]),
        net("LayerNormalization axis -1 without B")
            .input("x", x())
            .param("s", randn(&[4], 4))
            .op("LayerNormalization", &ln(-1), &["x", "s"], &["y"])
            .outputs(&["y"]),
        net("LayerNormalization axis 1 with B")
            .input("x", x())
            .param("s", randn(&[3, 4], 5))
            .param("b", randn(&[3, 4], 6))
            .op("LayerNormalization", &ln(1), &["x", "s", "b"], &["y"])
            .outputs(&["y"]),
        net("LayerNormalization axis 1, Scale [4] and B [1,4] smaller than [3,4]")
            .input("x", x())
            .param("s", randn(&[4], 7))
            .param("b", randn(&[1, 4], 8))
            .op("LayerNormalization", &ln(1), &["x", "s", "b"], &["y"])
            .outputs(&["y"]),
        net("LayerNormalization axis 0, Scale an input")
            .param("x", x())
            .input("s", randn(&[3, 4], 9))
            .op("LayerNormalization", &ln(0), &["x", "s"], &["y"])
            .outputs(&["y"]),
        net("LayerNormalization axis -1, Mean and InvStdDev outputs too")
            .input("x", x())
            .param("s", randn(&[4], 10))
            .param("b", randn(&[4], 11))
            .op(
                "LayerNormalization",
                &ln(-1),
                &["x", "s", "b"],
                &["y", "mu", "r"],
            )
            .outputs(&["y", "mu", "r"]),
        net("LayerNormalization axis 1, only InvStdDev used")
            .param("x", x())
            .param("s", randn(&[3, 4], 12))
            .op("LayerNormalization", &ln(1), &["x", "s"], &["y", "", "r"])
            .outputs(&["r"]),
        net("LayerNormalization axis 1, only Mean used")
            .input("x", x())
            .param("s", randn(&[3, 4], 13))
            .op("LayerNormalization", &ln(1), &["x", "s"], &["y", "mu"])
            .op("Exp", &[], &["mu"], &["e"])
            .outputs(&["e"]),
    ]);
}

/// The residual normalizations (what `residual_norm` makes): S = X + R normalized, S an
/// output too; X and R get the same gradient, S's own gradient joins the normalization's.
#[test]
fn residual_normalizations() {
    let x = || randn(&[2, 3, 4], 51);
    let ln = |axis: i64| vec![("axis", V::Int(axis)), ("epsilon", V::Float(1e-5))];
    check_all(&[
        net("AddLayerNormalization axis -1 with B, S read")
            .input("x", x())
            .input("r", randn(&[2, 3, 4], 52))
            .param("s", randn(&[4], 53))
            .param("b", randn(&[4], 54))
            .op(
                "AddLayerNormalization",
                &ln(-1),
                &["x", "s", "b", "r"],
                &["y", "", "", "sum"],
            )
            .op("Tanh", &[], &["sum"], &["t"])
            .outputs(&["y", "t"]),
        net("AddLayerNormalization axis 1 without B, statistics read, S unread")
            .input("x", x())
            .param("r", randn(&[2, 3, 4], 55))
            .param("s", randn(&[3, 4], 56))
            .op(
                "AddLayerNormalization",
                &ln(1),
                &["x", "s", "", "r"],
                &["y", "mu", "iv", ""],
            )
            .outputs(&["y", "mu", "iv"]),
        net("AddRMSNormalization axis -1, S read")
            .param("x", x())
            .input("r", randn(&[2, 3, 4], 57))
            .param("s", randn(&[4], 58))
            .op(
                "AddRMSNormalization",
                &ln(-1),
                &["x", "s", "r"],
                &["y", "iv", "sum"],
            )
            .outputs(&["y", "sum"]),
        net("AddRMSNormalization, the same value as X and R")
            .input("x", x())
            .param("s", randn(&[4], 59))
            .op(
                "AddRMSNormalization",
                &ln(-1),
                &["x", "s", "x"],
                &["y", "", ""],
            )
            .outputs(&["y"]),
    ]);
}

#[test]
fn rotary_x_cos_and_sin() {
    let x = || randn(&[2, 3, 4, 6], 31);
    let il = |v: i64| vec![("interleaved", V::Int(v))];
    check_all(&[
        net("Rotary, Cos and Sin [4, 6] parameters")
            .input("x", x())
            .param("c", randn(&[4, 6], 32))
            .param("s", randn(&[4, 6], 33))
            .op("Rotary", &il(0), &["x", "c", "s"], &["y"])
            .outputs(&["y"]),
        net("Rotary interleaved, Cos and Sin [1, 3, 1, 6] parameters")
            .input("x", x())
            .param("c", randn(&[1, 3, 1, 6], 34))
            .param("s", randn(&[1, 3, 1, 6], 35))
            .op("Rotary", &il(1), &["x", "c", "s"], &["y"])
            .outputs(&["y"]),
        net("Rotary, x a parameter, Cos and Sin inputs")
            .param("x", x())
            .input("c", randn(&[6], 36))
            .input("s", randn(&[6], 37))
            .op("Rotary", &il(0), &["x", "c", "s"], &["y"])
            .outputs(&["y"]),
    ]);
}

/// GatedMatMul (what the gated-MLP fusion writes): gradients of A, both weights and both
/// biases through GatedMatMulGrad and the products' FusedMatMulGrads, for every gate
/// activation, weights plain and transposed, A batched; without biases; and with G and U
/// read as outputs too (their gradients join dG and dU).
#[test]
fn gated_matmul_every_activation() {
    let mut nets = vec![];
    let attrs =
        |act: &str, t: i64| vec![("activation", V::Str(act.into())), ("trans_b", V::Int(t))];
    for act in [
        "silu",
        "gelu",
        "gelu_tanh",
        "sigmoid",
        "tanh",
        "relu",
        "relu6",
    ] {
        for t in [0, 1] {
            let w = if t == 1 { [3, 4] } else { [4, 3] };
            nets.push(
                net(&format!("GatedMatMul {act}, trans_b {t}"))
                    .input("a", rand(&[2, 5, 4], 61, -1.5, 1.5))
                    .param("wg", randn(&w, 62))
                    .param("wu", randn(&w, 63))
                    .param("bg", randn(&[3], 64))
                    .param("bu", randn(&[3], 65))
                    .op(
                        "GatedMatMul",
                        &attrs(act, t),
                        &["a", "wg", "wu", "bg", "bu"],
                        &["y"],
                    )
                    .outputs(&["y"]),
            );
        }
    }
    nets.push(
        net("GatedMatMul without biases")
            .input("a", rand(&[6, 4], 66, -1.5, 1.5))
            .param("wg", randn(&[4, 5], 67))
            .param("wu", randn(&[4, 5], 68))
            .op("GatedMatMul", &attrs("silu", 0), &["a", "wg", "wu"], &["y"])
            .outputs(&["y"]),
    );
    nets.push(
        net("GatedMatMul with G and U read")
            .input("a", rand(&[6, 4], 69, -1.5, 1.5))
            .param("wg", randn(&[4, 5], 70))
            .param("wu", randn(&[4, 5], 71))
            .param("bu", randn(&[5], 72))
            .op(
                "GatedMatMul",
                &attrs("gelu", 0),
                &["a", "wg", "wu", "", "bu"],
                &["y", "g", "u"],
            )
            .outputs(&["y", "g", "u"]),
    );
    check_all(&nets);
}

#[test]
fn rms_normalization_axes_scale_and_inv_std_dev() {
    let x = || randn(&[2, 3, 4], 21);
    let rms = |axis: i64| vec![("axis", V::Int(axis)), ("epsilon", V::Float(1e-3))];
    check_all(&[
        net("RMSNormalization axis -1")
            .input("x", x())
            .param("s", randn(&[4], 22))
            .op("RMSNormalization", &rms(-1), &["x", "s"], &["y"])
            .outputs(&["y"]),
        net("RMSNormalization axis 1, Scale [4] smaller than [3, 4]")
            .input("x", x())
            .param("s", randn(&[4], 23))
            .op("RMSNormalization", &rms(1), &["x", "s"], &["y"])
            .outputs(&["y"]),
        net("RMSNormalization axis 0, Scale an input")
            .param("x", x())
            .input("s", randn(&[3, 4], 24))
            .op("RMSNormalization", &rms(0), &["x", "s"], &["y"])
            .outputs(&["y"]),
        net("RMSNormalization axis -1, InvStdDev output too")
            .input("x", x())
            .param("s", randn(&[4], 25))
            .op("RMSNormalization", &rms(-1), &["x", "s"], &["y", "r"])
            .outputs(&["y", "r"]),
        net("RMSNormalization axis 1, only InvStdDev used")
            .input("x", x())
            .param("s", randn(&[3, 4], 26))
            .op("RMSNormalization", &rms(1), &["x", "s"], &["y", "r"])
            .op("Exp", &[], &["r"], &["e"])
            .outputs(&["e"]),
    ]);
}

#[test]
fn reductions_axes_keepdims() {
    let mut nets = vec![];
    for op_ in ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMeanSquare"] {
        // (axes attribute, axes input, keepdims)
        let cases: [(Axes, Axes, i64); 7] = [
            (Some(&[1]), None, 1),
            (Some(&[0, 2]), None, 0),
            (Some(&[-1]), None, 1),
            (None, Some(&[-1]), 0),
            (None, Some(&[0, 1]), 1),
            (None, None, 0),
            (None, None, 1),
        ];
        for (k, (attr, input, kd)) in cases.iter().enumerate() {
            let mut attrs = vec![("keepdims", V::Int(*kd))];
            if let Some(a) = attr {
                attrs.push(("axes", ints(a)));
            }
            // Continuous random values: no ties for ReduceMax.
            let mut n = net(&format!(
                "{op_} axes attr {attr:?} input {input:?} keepdims {kd}"
            ))
            .input("x", randn(&[2, 3, 4], k as u64 + 20));
            let ins: &[&str] = match input {
                Some(a) => {
                    n = n.konst("axes", i64v(a));
                    &["x", "axes"]
                }
                None => &["x"],
            };
            nets.push(n.op(op_, &attrs, ins, &["y"]).outputs(&["y"]));
        }
    }
    nets.push(
        net("ReduceSum noop_with_empty_axes")
            .input("x", randn(&[2, 3], 1))
            .op(
                "ReduceSum",
                &[("noop_with_empty_axes", V::Int(1))],
                &["x"],
                &["y"],
            )
            .outputs(&["y"]),
    );
    nets.push(
        net("ReduceMean of a parameter [3,1] broadcast by Mul")
            .param("p", randn(&[3, 1], 2))
            .input("x", randn(&[3, 4], 3))
            .op("Mul", &[], &["x", "p"], &["m"])
            .op(
                "ReduceMean",
                &[("axes", ints(&[0])), ("keepdims", V::Int(0))],
                &["m"],
                &["y"],
            )
            .outputs(&["y"]),
    );
    check_all(&nets);
}

#[test]
fn reduce_max_shares_ties_equally() {
    // A documented choice (PyTorch's amax): tied maxima share the gradient. Finite
    // differences are not defined at ties, so this checks the values directly.
    let x = f64s(&[2, 3], &[1.0, 3.0, 3.0, -1.0, -1.0, -2.0]);
    let n = net("ReduceMax ties")
        .input("x", x)
        .op(
            "ReduceMax",
            &[("axes", ints(&[1])), ("keepdims", V::Int(0))],
            &["x"],
            &["y"],
        )
        .outputs(&["y"]);
    let mut s = session(&n.g, false, PassOptions::default()).unwrap();
    let seeds = HashMap::from([("y".to_string(), f64s(&[2], &[2.0, 4.0]))]);
    let g = s.backward(&n.feeds, &seeds).unwrap();
    assert_eq!(
        grad_of(&g, "x").to_f64_vec(),
        vec![0.0, 1.0, 1.0, 2.0, 2.0, 0.0]
    );
}

#[test]
fn softmax_cross_entropy_loss() {
    let labels = i64v(&[1, 4, 0, 2, 4, 3]);
    let w = f64s(&[5], &[0.5, 1.0, 1.5, 2.0, 0.8]);
    let mut nets = vec![];
    for red in ["mean", "sum", "none"] {
        let r = || vec![("reduction", V::Str(red.into()))];
        let ri = || {
            vec![
                ("reduction", V::Str(red.into())),
                ("ignore_index", V::Int(4)),
            ]
        };
        nets.push(
            net(&format!("SCE {red}"))
                .input("s", randn(&[6, 5], 1))
                .input("l", labels.clone())
                .op("SoftmaxCrossEntropyLoss", &r(), &["s", "l"], &["loss"])
                .outputs(&["loss"]),
        );
        nets.push(
            net(&format!("SCE {red} with weights"))
                .input("s", randn(&[6, 5], 2))
                .input("l", labels.clone())
                .konst("w", w.clone())
                .op("SoftmaxCrossEntropyLoss", &r(), &["s", "l", "w"], &["loss"])
                .outputs(&["loss"]),
        );
        nets.push(
            net(&format!("SCE {red} ignore_index 4"))
                .input("s", randn(&[6, 5], 3))
                .input("l", labels.clone())
                .op("SoftmaxCrossEntropyLoss", &ri(), &["s", "l"], &["loss"])
                .outputs(&["loss"]),
        );
        nets.push(
            net(&format!(
                "SCE {red} weights, ignore_index 4, log_prob output"
            ))
            .input("s", randn(&[6, 5], 4))
            .input("l", labels.clone())
            .konst("w", w.clone())
            .op(
                "SoftmaxCrossEntropyLoss",
                &ri(),
                &["s", "l", "w"],
                &["loss", "logp"],
            )
            .outputs(&["loss", "logp"]),
        );
        nets.push(
            net(&format!("SCE {red} of MatMul(x, w), scores [2,5,3]"))
                .input("x", randn(&[2, 3, 4], 5))
                .param("w", randn(&[4, 5], 6))
                .input("l", i64s(&[2, 3], &[0, 4, 2, 1, 1, 3]))
                .op("MatMul", &[], &["x", "w"], &["z"])
                .op("Transpose", &[("perm", ints(&[0, 2, 1]))], &["z"], &["s"])
                .op(
                    "SoftmaxCrossEntropyLoss",
                    &r(),
                    &["s", "l"],
                    &["loss", "logp"],
                )
                .outputs(&["loss", "logp"]),
        );
        // Weights with a gradient: a graph input, and a trainable parameter with an
        // ignore_index outside the class range (-100, ONNX's usual one).
        nets.push(
            net(&format!("SCE {red} weights an input"))
                .input("s", randn(&[6, 5], 7))
                .input("l", labels.clone())
                .input("w", w.clone())
                .op("SoftmaxCrossEntropyLoss", &r(), &["s", "l", "w"], &["loss"])
                .outputs(&["loss"]),
        );
        nets.push(
            net(&format!(
                "SCE {red} weights a parameter, ignore_index -100, [2,5,3]"
            ))
            .input("s", randn(&[2, 5, 3], 8))
            .input("l", i64s(&[2, 3], &[0, -100, 2, 1, 1, -100]))
            .param("w", w.clone())
            .op(
                "SoftmaxCrossEntropyLoss",
                &[
                    ("reduction", V::Str(red.into())),
                    ("ignore_index", V::Int(-100)),
                ],
                &["s", "l", "w"],
                &["loss", "logp"],
            )
            .outputs(&["loss", "logp"]),
        );
        nets.push(
            net(&format!(
                "SCE {red} weights an input, ignore_index 4, scores constant"
            ))
            .konst("s", randn(&[6, 5], 9))
            .input("l", labels.clone())
            .input("w", w.clone())
            .op(
                "SoftmaxCrossEntropyLoss",
                &ri(),
                &["s", "l", "w"],
                &["loss"],
            )
            .outputs(&["loss"]),
        );
    }
    check_all(&nets);
}

// ---- shape ops -----------------------------------------------------------------------------

#[test]
fn reshape_transpose_flatten_squeeze_unsqueeze_expand() {
    let x = || randn(&[2, 3, 4], 1);
    check_all(&[
        net("Reshape [2,3,4] -> [0,-1]")
            .input("x", x())
            .konst("s", i64v(&[0, -1]))
            .op("Reshape", &[], &["x", "s"], &["y"])
            .outputs(&["y"]),
        net("Reshape param [2,3,4] -> [4,-1,2]")
            .param("x", x())
            .konst("s", i64v(&[4, -1, 2]))
            .op("Reshape", &[], &["x", "s"], &["y"])
            .outputs(&["y"]),
        net("Transpose [2,0,1]")
            .input("x", x())
            .op("Transpose", &[("perm", ints(&[2, 0, 1]))], &["x"], &["y"])
            .outputs(&["y"]),
        net("Transpose default perm")
            .param("x", x())
            .op("Transpose", &[], &["x"], &["y"])
            .outputs(&["y"]),
        net("Flatten axis 2")
            .input("x", x())
            .op("Flatten", &[("axis", V::Int(2))], &["x"], &["y"])
            .outputs(&["y"]),
        net("Flatten axis 0")
            .input("x", x())
            .op("Flatten", &[("axis", V::Int(0))], &["x"], &["y"])
            .outputs(&["y"]),
        net("Squeeze axes input [1,3]")
            .input("x", randn(&[2, 1, 3, 1], 2))
            .konst("a", i64v(&[1, 3]))
            .op("Squeeze", &[], &["x", "a"], &["y"])
            .outputs(&["y"]),
        net("Squeeze all")
            .param("x", randn(&[1, 3, 1], 3))
            .op("Squeeze", &[], &["x"], &["y"])
            .outputs(&["y"]),
        net("Unsqueeze axes [0,3]")
            .input("x", randn(&[2, 3], 4))
            .konst("a", i64v(&[0, 3]))
            .op("Unsqueeze", &[], &["x", "a"], &["y"])
            .outputs(&["y"]),
        net("Unsqueeze axes attr [-1]")
            .input("x", randn(&[2, 3], 5))
            .op("Unsqueeze", &[("axes", ints(&[-1]))], &["x"], &["y"])
            .outputs(&["y"]),
        net("Expand [3,1] -> [2,3,4]")
            .input("x", randn(&[3, 1], 6))
            .konst("s", i64v(&[2, 3, 4]))
            .op("Expand", &[], &["x", "s"], &["y"])
            .outputs(&["y"]),
        net("Expand param [4] -> [2,3,1] (to [2,3,4])")
            .param("x", randn(&[4], 7))
            .konst("s", i64v(&[2, 3, 1]))
            .op("Expand", &[], &["x", "s"], &["y"])
            .outputs(&["y"]),
    ]);
}

#[test]
fn concat_and_split() {
    check_all(&[
        net("Concat axis 1 of input, param, constant")
            .input("x", randn(&[2, 3, 4], 1))
            .param("p", randn(&[2, 1, 4], 2))
            .konst("c", randn(&[2, 2, 4], 3))
            .op("Concat", &[("axis", V::Int(1))], &["x", "p", "c"], &["y"])
            .outputs(&["y"]),
        net("Concat axis -1 of x with itself")
            .input("x", randn(&[2, 3], 4))
            .op("Concat", &[("axis", V::Int(-1))], &["x", "x"], &["y"])
            .outputs(&["y"]),
        net("Split by input sizes, middle part unused")
            .input("x", randn(&[2, 6], 5))
            .konst("sp", i64v(&[1, 2, 3]))
            .op(
                "Split",
                &[("axis", V::Int(1))],
                &["x", "sp"],
                &["a", "b", "c"],
            )
            .op("Mul", &[], &["a", "c"], &["y"])
            .outputs(&["y"]),
        net("Split num_outputs 2 axis 0, both outputs")
            .param("x", randn(&[4, 3], 6))
            .op(
                "Split",
                &[("axis", V::Int(0)), ("num_outputs", V::Int(2))],
                &["x"],
                &["a", "b"],
            )
            .outputs(&["a", "b"]),
        net("Split attr sizes, only the last output used")
            .input("x", randn(&[3, 5], 7))
            .op(
                "Split",
                &[("axis", V::Int(-1)), ("split", ints(&[2, 3]))],
                &["x"],
                &["a", "b"],
            )
            .op("Exp", &[], &["b"], &["y"])
            .outputs(&["y"]),
    ]);
}

#[test]
fn slice_steps_and_axes() {
    check_all(&[
        net("Slice negative steps on both axes")
            .input("x", randn(&[5, 6], 1))
            .konst("st", i64v(&[4, -1]))
            .konst("en", i64v(&[0, -7]))
            .konst("ax", i64v(&[0, 1]))
            .konst("sp", i64v(&[-1, -2]))
            .op("Slice", &[], &["x", "st", "en", "ax", "sp"], &["y"])
            .outputs(&["y"]),
        net("Slice step 2 on axis -1 of a parameter")
            .param("x", randn(&[2, 3, 6], 2))
            .konst("st", i64v(&[1]))
            .konst("en", i64v(&[100]))
            .konst("ax", i64v(&[-1]))
            .konst("sp", i64v(&[2]))
            .op("Slice", &[], &["x", "st", "en", "ax", "sp"], &["y"])
            .outputs(&["y"]),
        net("Slice without axes and steps")
            .input("x", randn(&[4, 5], 3))
            .konst("st", i64v(&[1, 0]))
            .konst("en", i64v(&[3, -1]))
            .op("Slice", &[], &["x", "st", "en"], &["y"])
            .outputs(&["y"]),
        net("Slice reversed whole axis")
            .input("x", randn(&[3, 4], 4))
            .konst("st", i64v(&[-1]))
            .konst("en", i64v(&[i64::MIN]))
            .konst("ax", i64v(&[0]))
            .konst("sp", i64v(&[-1]))
            .op("Slice", &[], &["x", "st", "en", "ax", "sp"], &["y"])
            .outputs(&["y"]),
    ]);
}

#[test]
fn gather_axes_and_repeated_indices() {
    check_all(&[
        net("Gather axis 0, repeated indices")
            .param("e", randn(&[4, 3], 1))
            .input("i", i64s(&[2, 2], &[0, 2, 2, 3]))
            .op("Gather", &[], &["e", "i"], &["y"])
            .outputs(&["y"]),
        net("Gather axis 1, repeated and negative indices")
            .input("x", randn(&[2, 4, 3], 2))
            .konst("i", i64v(&[1, 1, -1, 0, 1]))
            .op("Gather", &[("axis", V::Int(1))], &["x", "i"], &["y"])
            .outputs(&["y"]),
        net("Gather axis 0, scalar index")
            .input("x", randn(&[4, 3], 3))
            .konst("i", Tensor::scalar(2i64))
            .op("Gather", &[], &["x", "i"], &["y"])
            .outputs(&["y"]),
    ]);
}

#[test]
fn trilu_upper_lower_k() {
    check_all(&[
        net("Trilu upper")
            .input("x", randn(&[3, 4], 1))
            .op("Trilu", &[], &["x"], &["y"])
            .outputs(&["y"]),
        net("Trilu lower k=1, batched")
            .param("x", randn(&[2, 3, 4], 2))
            .konst("k", Tensor::scalar(1i64))
            .op("Trilu", &[("upper", V::Int(0))], &["x", "k"], &["y"])
            .outputs(&["y"]),
        net("Trilu upper k=-1")
            .input("x", randn(&[4, 3], 3))
            .konst("k", Tensor::scalar(-1i64))
            .op("Trilu", &[("upper", V::Int(1))], &["x", "k"], &["y"])
            .outputs(&["y"]),
    ]);
}

// ---- attention -----------------------------------------------------------------------------

/// Attention with Q [1,Hq,3,4], K and V [1,Hkv,5,4] (K and V parameters).
fn attention(
    what: &str,
    hq: usize,
    hkv: usize,
    attrs: &[(&str, V)],
    mask: Option<Tensor>,
    mask_param: bool,
) -> Net {
    let n = net(what)
        .input("q", randn(&[1, hq, 3, 4], 1))
        .param("k", randn(&[1, hkv, 5, 4], 2))
        .param("v", randn(&[1, hkv, 5, 4], 3));
    let (n, ins): (Net, &[&str]) = match mask {
        None => (n, &["q", "k", "v"]),
        Some(m) if mask_param => (n.param("m", m), &["q", "k", "v", "m"]),
        Some(m) => (n.input("m", m), &["q", "k", "v", "m"]),
    };
    n.op("Attention", attrs, ins, &["y"]).outputs(&["y"])
}

#[test]
fn attention_plain_causal_scale() {
    let causal = [("is_causal", V::Int(1))];
    check_all(&[
        attention("Attention", 2, 2, &[], None, false),
        attention("Attention causal", 2, 2, &causal, None, false),
        attention(
            "Attention scale 0.3",
            2,
            2,
            &[("scale", V::Float(0.3))],
            None,
            false,
        ),
        attention("Attention GQA 4/2 causal", 4, 2, &causal, None, false),
        attention("Attention GQA 4/1", 4, 1, &[], None, false),
    ]);
}

#[test]
fn attention_masks() {
    let keep: Vec<bool> = (0..2 * 3 * 5).map(|i| i % 5 == 0 || i % 3 != 1).collect();
    check_all(&[
        attention(
            "Attention additive mask input [1,1,3,5]",
            2,
            2,
            &[],
            Some(randn(&[1, 1, 3, 5], 4)),
            false,
        ),
        attention(
            "Attention additive mask input [1,2,3,5]",
            2,
            2,
            &[],
            Some(randn(&[1, 2, 3, 5], 5)),
            false,
        ),
        attention(
            "Attention additive mask parameter [3,5], causal",
            2,
            2,
            &[("is_causal", V::Int(1))],
            Some(randn(&[3, 5], 6)),
            true,
        ),
        attention(
            "Attention additive mask parameter [5], GQA",
            4,
            2,
            &[],
            Some(randn(&[5], 7)),
            true,
        ),
        attention(
            "Attention bool mask [1,2,3,5]",
            2,
            2,
            &[],
            Some(bools(&[1, 2, 3, 5], &keep)),
            false,
        ),
        attention(
            "Attention bool mask [3,5], GQA",
            4,
            2,
            &[],
            Some(bools(&[3, 5], &keep[..15])),
            false,
        ),
    ]);
}

#[test]
fn varlen_attention_with_empty_sequences() {
    let varlen = |what: &str, cu_q: &[i32], cu_k: &[i32], hq: usize, hkv: usize, causal: bool| {
        let (tq, tk) = (
            *cu_q.last().unwrap() as usize,
            *cu_k.last().unwrap() as usize,
        );
        net(what)
            .input("q", randn(&[tq, hq, 4], 1))
            .param("k", randn(&[tk, hkv, 4], 2))
            .input("v", randn(&[tk, hkv, 4], 3))
            .konst("cq", i32v(cu_q))
            .input("ck", i32v(cu_k))
            .op(
                "VarlenAttention",
                &[("is_causal", V::Int(causal as i64))],
                &["q", "k", "v", "cq", "ck"],
                &["y"],
            )
            .outputs(&["y"])
    };
    check_all(&[
        varlen(
            "VarlenAttention, empty middle sequence",
            &[0, 2, 2, 5],
            &[0, 3, 3, 7],
            2,
            2,
            false,
        ),
        varlen(
            "VarlenAttention causal, GQA 2/1",
            &[0, 2, 2, 5],
            &[0, 3, 3, 7],
            2,
            1,
            true,
        ),
        varlen(
            "VarlenAttention, queries without keys",
            &[0, 2, 4],
            &[0, 3, 3],
            2,
            2,
            false,
        ),
    ]);
}

#[test]
fn values_without_a_path_get_zero_gradients() {
    // x reaches the output only through its shape; a second parameter is unused.
    check(
        &net("no path")
            .input("x", randn(&[2, 3], 1))
            .param("p", randn(&[3], 2))
            .param("unused", randn(&[2], 3))
            .op("Shape", &[], &["x"], &["s"])
            .op("Expand", &[], &["p", "s"], &["y"])
            .outputs(&["y"]),
    );
}

// ---- whole models --------------------------------------------------------------------------

fn dims(pairs: &[(&str, usize)]) -> BTreeMap<String, usize> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

/// Gradients of a loaded model (fused by the default passes or not) with seeded random
/// seeds for every floating output.
fn model_grads(
    g: &Graph,
    feeds: &HashMap<String, Tensor>,
    d: &BTreeMap<String, usize>,
    passes: PassOptions,
) -> Gradients {
    let mut s = Session::new(
        g.clone(),
        SessionOptions {
            dims: d.clone(),
            passes,
            ..SessionOptions::unfused()
        },
    )
    .unwrap();
    let outs = s.run(feeds).unwrap();
    s.backward(feeds, &seeds_for(&outs))
        .unwrap_or_else(|e| panic!("{}: {e}", g.name))
}

/// Compares two sets of gradients by name: the same names, each within `tol`.
fn compare_grads(what: &str, a: &Gradients, b: &Gradients, tol: f64) {
    let names = |g: &Gradients| g.grads.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(a), names(b), "{what}: gradient names");
    let mut fails = vec![];
    for ((n, x), (_, y)) in a.grads.iter().zip(&b.grads) {
        assert_eq!(x.shape(), y.shape(), "{what}: d/d{n} shape");
        let e = rel_err(&x.to_f64_vec(), &y.to_f64_vec());
        if e.is_nan() || e > tol {
            fails.push(format!("d/d{n}: rel err {e:.3e} > {tol:.0e}"));
        }
    }
    assert!(fails.is_empty(), "{what}:\n{}", fails.join("\n"));
}

/// The fused graph (default passes, forward and backward) and the unfused one (no pass
/// at all) give the same gradients.
fn fused_matches_unfused(path: &str, d: &[(&str, usize)], fused_ops: &[&str]) {
    let model = Model::load(path).unwrap();
    let d = dims(d);
    let feeds = model.random_inputs(3, &d).unwrap();
    let (fused, _) = graphrun::passes::optimize(&model.graph, &PassOptions::default()).unwrap();
    let counts = fused.op_counts();
    for op_ in fused_ops {
        assert!(
            counts.contains_key(op_),
            "{path}: no {op_} after the passes: {counts:?}"
        );
    }
    let gf = model_grads(&fused, &feeds, &d, PassOptions::default());
    let gu = model_grads(&model.graph, &feeds, &d, no_passes());
    assert!(gf.grads.len() > 2, "{path}: {} gradients", gf.grads.len());
    compare_grads(&format!("{path} fused vs unfused"), &gf, &gu, 1e-4);
}

#[test]
fn mlp_fused_and_unfused_gradients_agree() {
    fused_matches_unfused("models/mlp.yaml", &[("batch", 4)], &["FusedMatMul"]);
}

#[test]
fn gpt_block_fused_and_unfused_gradients_agree() {
    fused_matches_unfused(
        "models/gpt_block.yaml",
        &[("batch", 1), ("seq", 8)],
        &["FusedMatMul", "Attention"],
    );
}

#[test]
fn f32_gradients_match_f64_within_tolerance() {
    let model = Model::load("models/gpt_block.yaml").unwrap();
    let d = dims(&[("batch", 1), ("seq", 8)]);
    let feeds = model.random_inputs(5, &d).unwrap();
    let g64 = graphrun::exec::with_float_dtype(&model.graph, DType::F64);
    let feeds64: HashMap<String, Tensor> = feeds
        .iter()
        .map(|(k, t)| {
            (
                k.clone(),
                if t.dtype().is_float() {
                    t.cast(DType::F64)
                } else {
                    t.clone()
                },
            )
        })
        .collect();
    let a = model_grads(&model.graph, &feeds, &d, PassOptions::default());
    let b = model_grads(&g64, &feeds64, &d, PassOptions::default());
    assert!(a.grads.iter().all(|(_, t)| t.dtype() == DType::F32));
    compare_grads("gpt_block f32 vs f64", &a, &b, tol(DType::F32));
}

// ---- training ------------------------------------------------------------------------------

/// mlp.yaml with `opt`, trained `steps` steps on one fixed seeded batch; the losses.
fn train_mlp(opt: Option<Optimizer>, steps: usize) -> Vec<f64> {
    let mut model = Model::load("models/mlp.yaml").unwrap();
    if let (Some(o), Some(t)) = (opt, model.graph.training.as_mut()) {
        t.optimizer = o;
    }
    let d = dims(&[("batch", 8)]);
    let feeds = model.random_inputs(11, &d).unwrap();
    let mut s = Session::new(
        model.graph,
        SessionOptions {
            dims: d,
            training: true,
            ..SessionOptions::unfused()
        },
    )
    .unwrap();
    (0..steps).map(|_| s.train_step(&feeds).unwrap()).collect()
}

fn assert_falls(what: &str, losses: &[f64]) {
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(
        losses.iter().all(|l| l.is_finite()) && last < 0.5 * first,
        "{what}: loss {first} -> {last} (want < half): {losses:?}"
    );
}

#[test]
fn mlp_loss_falls_with_sgd_momentum() {
    assert_falls(
        "SGD lr 0.01 momentum 0.9 (the model's own)",
        &train_mlp(None, 20),
    );
    let sgd = Optimizer::Sgd {
        lr: 0.05,
        momentum: 0.5,
        weight_decay: 1e-4,
    };
    assert_falls("SGD lr 0.05 momentum 0.5", &train_mlp(Some(sgd), 20));
}

#[test]
fn mlp_loss_falls_with_adam_and_adamw() {
    let adam = Optimizer::Adam {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    assert_falls("Adam", &train_mlp(Some(adam), 20));
    let adamw = Optimizer::AdamW {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    assert_falls("AdamW", &train_mlp(Some(adamw), 20));
}

#[test]
fn sgd_steps_match_the_update_rule_by_hand() {
    let mut model = Model::load("models/mlp.yaml").unwrap();
    let (lr, mu) = (0.05, 0.9);
    model.graph.training.as_mut().unwrap().optimizer = Optimizer::Sgd {
        lr,
        momentum: mu,
        weight_decay: 0.0,
    };
    let d = dims(&[("batch", 4)]);
    let feeds = model.random_inputs(2, &d).unwrap();
    let mut s = Session::new(
        model.graph.clone(),
        SessionOptions {
            dims: d,
            training: true,
            ..SessionOptions::unfused()
        },
    )
    .unwrap();
    // The gradient of the loss alone: seed the logits with zeros.
    let outs = s.run(&feeds).unwrap();
    let seeds: HashMap<String, Tensor> = outs
        .iter()
        .map(|(n, t)| {
            let v = if n == "loss" { 1.0 } else { 0.0 };
            (
                n.clone(),
                Tensor::from_f64(t.dtype(), t.shape(), &vec![v; t.numel()]).unwrap(),
            )
        })
        .collect();
    let params = |s: &mut Session| -> HashMap<String, Vec<f64>> {
        s.trained_graph()
            .unwrap()
            .initializers
            .iter()
            .map(|i| (i.name.clone(), i.tensor.to_f64_vec()))
            .collect()
    };
    let mut p = params(&mut s);
    let mut velocity: HashMap<String, Vec<f64>> = HashMap::new();
    for step in 1..=2 {
        let g = s.backward(&feeds, &seeds).unwrap();
        let loss = s.train_step(&feeds).unwrap();
        assert!(
            (loss - g.outputs[1].1.to_f64_vec()[0]).abs() < 1e-6,
            "step {step}: train_step's loss {loss} vs backward's {:?}",
            g.outputs[1].1
        );
        let after = params(&mut s);
        for (name, grad) in g.grads.iter().filter(|(n, _)| n != "x") {
            // PyTorch's SGD: v = μ·v + g; p −= lr·v.
            let gv = grad.to_f64_vec();
            let v = velocity
                .entry(name.clone())
                .or_insert_with(|| vec![0.0; gv.len()]);
            for (vi, gi) in v.iter_mut().zip(&gv) {
                *vi = mu * *vi + gi;
            }
            let want: Vec<f64> = p[name]
                .iter()
                .zip(v.iter())
                .map(|(p, v)| p - lr * v)
                .collect();
            let e = rel_err(&after[name], &want);
            assert!(
                e < 1e-6,
                "step {step}: {name} rel err {e:.3e} from p − lr·v"
            );
            let moved = rel_err(&after[name], &p[name]);
            assert!(moved > 0.0, "step {step}: {name} did not move");
        }
        p = after;
    }
}

#[test]
fn dropout_draws_a_new_mask_every_training_step() {
    // loss = Σ Dropout(x·w): with SGD lr 1, each step moves w by −mask·2·x, so two steps'
    // moves show their masks.
    let x = pos(&[4, 8], 1);
    let mut n = net("dropout steps")
        .input("x", x.clone())
        .param("w", randn(&[4, 8], 2))
        .op("Mul", &[], &["x", "w"], &["xw"])
        .op("Dropout", &[("ratio", V::Float(0.5))], &["xw"], &["y"])
        .op("ReduceSum", &[("keepdims", V::Int(0))], &["y"], &["loss"])
        .outputs(&["loss"]);
    n.g.training = Some(Training {
        loss: "loss".into(),
        optimizer: Optimizer::Sgd {
            lr: 1.0,
            momentum: 0.0,
            weight_decay: 0.0,
        },
    });
    let xv = x.to_f64_vec();
    for training in [true, false] {
        let mut s = session(&n.g, training, PassOptions::default()).unwrap();
        let w = |s: &mut Session| {
            s.trained_graph().unwrap().initializers[0]
                .tensor
                .to_f64_vec()
        };
        let mut ws = vec![w(&mut s)];
        for _ in 0..2 {
            s.train_step(&n.feeds).unwrap();
            ws.push(w(&mut s));
        }
        let masks: Vec<Vec<bool>> = (0..2)
            .map(|k| {
                (0..xv.len())
                    .map(|i| {
                        let dw = ws[k][i] - ws[k + 1][i];
                        // Either dropped (0) or kept and scaled (2·x).
                        assert!(
                            dw.abs() < 1e-12 || (dw - 2.0 * xv[i]).abs() < 1e-9,
                            "training {training}, step {}: w moved by {dw}, want 0 or {}",
                            k + 1,
                            2.0 * xv[i]
                        );
                        dw.abs() >= 1e-12
                    })
                    .collect()
            })
            .collect();
        for m in &masks {
            let kept = m.iter().filter(|&&b| b).count();
            assert!(
                kept > 4 && kept < 28,
                "training {training}: mask keeps {kept} of 32"
            );
        }
        assert_ne!(
            masks[0], masks[1],
            "training {training}: two steps drew the same mask"
        );
    }
}

/// A draw reads only its input's shape: x·RandomNormalLike(x) differentiates to the draw
/// (a plain run draws the same values every time, so finite differences see them fixed).
#[test]
fn random_draws_pass_no_gradient() {
    let (g, _) = check(
        &net("x · RandomNormalLike(x)")
            .input("x", randn(&[5, 7], 1))
            .op(
                "RandomNormalLike",
                &[("seed", V::Float(3.0))],
                &["x"],
                &["r"],
            )
            .op("Mul", &[], &["x", "r"], &["y"])
            .outputs(&["y", "r"]),
    );
    assert_eq!(g.grads.len(), 1, "only x has a gradient");
}

#[test]
fn random_draws_afresh_every_training_step() {
    // loss = Σ w·U with U = RandomUniformLike(w): SGD with lr 1 moves w by −U, so each
    // step's move is its draw.
    let mut n = net("random steps")
        .param("w", randn(&[6, 9], 2))
        .op("RandomUniformLike", &[], &["w"], &["u"])
        .op("Mul", &[], &["w", "u"], &["wu"])
        .op("ReduceSum", &[("keepdims", V::Int(0))], &["wu"], &["loss"])
        .outputs(&["loss"]);
    n.g.training = Some(Training {
        loss: "loss".into(),
        optimizer: Optimizer::Sgd {
            lr: 1.0,
            momentum: 0.0,
            weight_decay: 0.0,
        },
    });
    let mut s = session(&n.g, true, PassOptions::default()).unwrap();
    let w = |s: &mut Session| {
        s.trained_graph().unwrap().initializers[0]
            .tensor
            .to_f64_vec()
    };
    let mut ws = vec![w(&mut s)];
    for _ in 0..2 {
        s.train_step(&n.feeds).unwrap();
        ws.push(w(&mut s));
    }
    let draws: Vec<Vec<f64>> = (0..2)
        .map(|k| ws[k].iter().zip(&ws[k + 1]).map(|(a, b)| a - b).collect())
        .collect();
    for d in &draws {
        assert!(
            d.iter().all(|u| (0.0..1.0).contains(u)),
            "a step's draw left [0, 1): {d:?}"
        );
    }
    assert!(
        draws[0].iter().zip(&draws[1]).all(|(a, b)| a != b),
        "two steps drew the same values"
    );
}

// ---- errors --------------------------------------------------------------------------------

#[test]
fn differentiating_an_integer_output_is_a_clear_error() {
    let n = net("int output")
        .input("x", randn(&[2, 3], 1))
        .op("Cast", &[("to", V::Str("i64".into()))], &["x"], &["xi"])
        .op("Shape", &[], &["x"], &["s"])
        .op("Relu", &[], &["x"], &["y"])
        .outputs(&["y", "xi", "s"]);
    let shapes = HashMap::from([("x".to_string(), vec![2, 3])]);
    let opts = autodiff::BackwardOptions {
        training: false,
        inputs: true,
        ..Default::default()
    };
    for bad in ["xi", "s"] {
        let e = autodiff::backward(&n.g, &[bad.to_string()], &shapes, &opts)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(bad) && e.contains("i64") && e.contains("only floating outputs"),
            "{e}"
        );
    }
    let e = autodiff::backward(&n.g, &["nope".to_string()], &shapes, &opts)
        .unwrap_err()
        .to_string();
    assert!(e.contains("'nope' is not a value"), "{e}");
    // Session::backward differentiates the floating outputs only, and refuses a seed for
    // an integer one.
    let mut s = session(&n.g, false, PassOptions::default()).unwrap();
    let g = s.backward(&n.feeds, &HashMap::new()).unwrap();
    assert_eq!(g.grads.len(), 1);
    assert_eq!(g.outputs.len(), 3);
    let seeds = HashMap::from([("xi".to_string(), i64s(&[2, 3], &[1; 6]))]);
    let e = s.backward(&n.feeds, &seeds).unwrap_err().to_string();
    assert!(
        e.contains("xi") && e.contains("not a floating output"),
        "{e}"
    );
    // A training loss that is an integer.
    let mut g = n.g.clone();
    g.initializers.push(Initializer {
        name: "w".into(),
        tensor: randn(&[3], 2),
        trainable: true,
        source: InitSource::Data,
        loc: None,
    });
    g.training = Some(Training {
        loss: "xi".into(),
        optimizer: Optimizer::Sgd {
            lr: 0.1,
            momentum: 0.0,
            weight_decay: 0.0,
        },
    });
    let mut s = session(&g, true, PassOptions::default()).unwrap();
    let e = s.train_step(&n.feeds).unwrap_err().to_string();
    assert!(
        e.contains("xi") && e.contains("must be a floating scalar"),
        "{e}"
    );
}

#[test]
fn wrong_seed_shape_is_a_clear_error() {
    let n = net("seed shape")
        .input("x", randn(&[2, 3], 1))
        .op("Exp", &[], &["x"], &["y"])
        .outputs(&["y"]);
    let mut s = session(&n.g, false, PassOptions::default()).unwrap();
    let seeds = HashMap::from([("y".to_string(), randn(&[3, 2], 2))]);
    let e = s.backward(&n.feeds, &seeds).unwrap_err().to_string();
    assert!(e.contains("'y'") && e.contains("[2, 3]"), "{e}");
}

/// GatherElements and GatherND through autodiff (repeated and negative indices: the
/// gradient adds up where data is read twice), against finite differences.
#[test]
fn gather_elements_and_nd() {
    let idx = |shape: &[usize], v: &[i64]| Tensor::from_vec(shape, v.to_vec()).unwrap();
    check_all(&[
        net("GatherElements axis 1")
            .param("x", randn(&[3, 4], 1))
            .konst("i", idx(&[3, 3], &[0, 3, 3, -1, 2, 0, 1, 1, -4]))
            .op(
                "GatherElements",
                &[("axis", V::Int(1))],
                &["x", "i"],
                &["y"],
            )
            .outputs(&["y"]),
        net("GatherND batch_dims 0")
            .param("x", randn(&[2, 3, 4], 2))
            .konst("i", idx(&[3, 2], &[0, 1, 1, -1, 0, 1]))
            .op("GatherND", &[], &["x", "i"], &["y"])
            .outputs(&["y"]),
        net("GatherND batch_dims 1")
            .param("x", randn(&[2, 3, 4], 3))
            .konst("i", idx(&[2, 2, 1], &[2, 2, 0, -1]))
            .op(
                "GatherND",
                &[("batch_dims", V::Int(1))],
                &["x", "i"],
                &["y"],
            )
            .outputs(&["y"]),
    ]);
}

#[test]
fn cumsum_every_direction() {
    let mut nets = vec![];
    for (exclusive, reverse) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
        nets.push(
            net(&format!("CumSum exclusive {exclusive} reverse {reverse}"))
                .param("x", randn(&[3, 4], 5))
                .konst("a", Tensor::scalar(-1i64))
                .op(
                    "CumSum",
                    &[
                        ("exclusive", V::Int(exclusive)),
                        ("reverse", V::Int(reverse)),
                    ],
                    &["x", "a"],
                    &["y"],
                )
                .outputs(&["y"]),
        );
    }
    check_all(&nets);
}

/// `t` with zeros written at `at`.
fn zeros_at(t: &Tensor, at: &[usize]) -> Tensor {
    let mut v = t.to_f64_vec();
    for &i in at {
        v[i] = 0.0;
    }
    f64s(t.shape(), &v)
}

/// ReduceProd over several axes, kept or not, with groups of no, one and two zeros: the
/// gradient is the product of the other elements, not Y / X.
#[test]
fn reduce_prod_with_zeros() {
    // Rows of [4, 3, 5] reduced over axis 2: row 0 has one zero, row 1 two, the rest none;
    // over axes (0, 2) the groups mix them.
    let x = zeros_at(&sg(&[4, 3, 5], 61), &[2, 5, 9, 33]);
    let mut nets = vec![];
    for (axes, keepdims) in [(vec![2i64], 1), (vec![-1], 0), (vec![0, 2], 1), (vec![], 0)] {
        let mut attrs: Attrs = vec![("keepdims", V::Int(keepdims))];
        if !axes.is_empty() {
            attrs.push(("axes", V::Ints(axes.clone())));
        }
        nets.push(
            net(&format!("ReduceProd axes {axes:?} keepdims {keepdims}"))
                .param("x", x.clone())
                .op("ReduceProd", &attrs, &["x"], &["y"])
                .outputs(&["y"]),
        );
    }
    // Axes as the second input (opset 18).
    nets.push(
        net("ReduceProd axes input")
            .param("x", x.clone())
            .konst("a", Tensor::from_vec(&[1], vec![1i64]).unwrap())
            .op("ReduceProd", &[], &["x", "a"], &["y"])
            .outputs(&["y"]),
    );
    check_all(&nets);
}

/// CumProd in every direction, on lines with no zero, one zero and two zeros.
#[test]
fn cumprod_every_direction_with_zeros() {
    let x = zeros_at(&sg(&[3, 5], 62), &[6, 10, 13]);
    let mut nets = vec![];
    for axis in [1i64, 0] {
        for (exclusive, reverse) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
            nets.push(
                net(&format!(
                    "CumProd axis {axis} exclusive {exclusive} reverse {reverse}"
                ))
                .param("x", x.clone())
                .konst("a", Tensor::scalar(axis))
                .op(
                    "CumProd",
                    &[
                        ("exclusive", V::Int(exclusive)),
                        ("reverse", V::Int(reverse)),
                    ],
                    &["x", "a"],
                    &["y"],
                )
                .outputs(&["y"]),
            );
        }
    }
    check_all(&nets);
}

/// TopK's values carry the gradient back to the elements picked (distinct values: no
/// ties for finite differences to straddle), with and without the indices output; the
/// indices, ArgMax and ArgMin pass none.
#[test]
fn topk_values_and_argmax_as_constant() {
    let x = randn(&[3, 6], 63);
    let k = Tensor::from_vec(&[1], vec![3i64]).unwrap();
    check_all(&[
        net("TopK values and indices")
            .param("x", x.clone())
            .konst("k", k.clone())
            .op("TopK", &[("axis", V::Int(-1))], &["x", "k"], &["v", "i"])
            .outputs(&["v", "i"]),
        net("TopK values only, smallest, axis 0")
            .param("x", x.clone())
            .konst("k", Tensor::from_vec(&[1], vec![2i64]).unwrap())
            .op(
                "TopK",
                &[("axis", V::Int(0)), ("largest", V::Int(0))],
                &["x", "k"],
                &["v"],
            )
            .outputs(&["v"]),
        // x · (1 + ArgMax(x)) + x · ArgMin(x): the indices are constants.
        net("ArgMax and ArgMin as constants")
            .param("x", x.clone())
            .op("ArgMax", &[("axis", V::Int(1))], &["x"], &["am"])
            .op("ArgMin", &[("axis", V::Int(1))], &["x"], &["an"])
            .op("CastLike", &[], &["am", "x"], &["amf"])
            .op("CastLike", &[], &["an", "x"], &["anf"])
            .op("Mul", &[], &["x", "amf"], &["p"])
            .op("Mul", &[], &["x", "anf"], &["q"])
            .op("Add", &[], &["p", "q"], &["y"])
            .outputs(&["y"]),
    ]);
}
