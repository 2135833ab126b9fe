//! One-node ONNX cases fed at run time, checked on every backend against a float64
//! reference written in the test, and their gradients against finite differences of it.
#![allow(dead_code)]

use crate::common::*;
use crate::onnx_model::*;
use graphrun::onnx::proto::AttributeProto;
use graphrun::{DType, Session, SessionOptions, Tensor};
use std::collections::HashMap;

/// One ONNX node and its inputs, every one fed at run time (fixed shapes).
#[derive(Clone)]
pub struct Case {
    pub op: &'static str,
    pub domain: &'static str,
    pub opset: i64,
    pub attrs: Vec<AttributeProto>,
    /// In order; "" and None where omitted. Floating inputs take the run's dtype.
    pub inputs: Vec<(&'static str, Option<Tensor>)>,
    pub outputs: Vec<&'static str>,
    /// Declare the inputs' dims symbolic (only their ranks known at import), so every
    /// shape the lowering needs comes from `Shape` arithmetic when the plan is made.
    pub symbolic: bool,
}

impl Case {
    pub fn new(op: &'static str, opset: i64, inputs: Vec<(&'static str, Option<Tensor>)>) -> Case {
        Case {
            op,
            domain: "",
            opset,
            attrs: vec![],
            inputs,
            outputs: vec!["y"],
            symbolic: false,
        }
    }
    pub fn with(mut self, attrs: Vec<AttributeProto>) -> Case {
        self.attrs = attrs;
        self
    }
    /// The inputs, floating ones cast to `dt`.
    pub fn args(&self, dt: DType) -> Vec<Option<Tensor>> {
        self.inputs
            .iter()
            .map(|(_, t)| {
                t.as_ref().map(|t| {
                    if t.dtype().is_float() {
                        t.cast(dt)
                    } else {
                        t.clone()
                    }
                })
            })
            .collect()
    }
    pub fn graph(&self, dt: DType) -> graphrun::Graph {
        let args = self.args(dt);
        let names: Vec<&str> = self.inputs.iter().map(|(n, _)| *n).collect();
        let infos = self
            .inputs
            .iter()
            .zip(&args)
            .filter_map(|((n, _), t)| {
                t.as_ref().map(|t| match self.symbolic {
                    true => input(n, t.dtype(), &vec![None; t.shape().len()]),
                    false => input_like(n, t),
                })
            })
            .collect();
        let n = node(
            self.op,
            self.domain,
            &names,
            &self.outputs,
            self.attrs.clone(),
        );
        import_one_node(n, self.opset, infos, vec![])
            .unwrap_or_else(|e| panic!("{}: import: {e}", self.op))
    }
    /// Runs `g` (this case's graph for `dt`) unfused on `backend`, fed the inputs in `dt`.
    pub fn run_on(
        &self,
        g: &graphrun::Graph,
        backend: graphrun::BackendKind,
        dt: DType,
        what: &str,
    ) -> Vec<(String, Tensor)> {
        let opts = SessionOptions {
            backend,
            ..SessionOptions::unfused()
        };
        Session::new(g.clone(), opts)
            .and_then(|mut s| s.run(&self.feeds(&self.args(dt))))
            .unwrap_or_else(|e| panic!("{what} on {backend:?}: {e}"))
    }
    pub fn feeds(&self, args: &[Option<Tensor>]) -> HashMap<String, Tensor> {
        self.inputs
            .iter()
            .zip(args)
            .filter_map(|((n, _), t)| t.clone().map(|t| (n.to_string(), t)))
            .collect()
    }
}

/// Runs `case` on every backend in each of `dtypes` the backend computes, and compares
/// every output with `reference` of the inputs as rounded to that dtype (f64 values; empty
/// where omitted). f32 results must be within `tol32`, f64 ones within 1e-10.
pub fn check_case(
    what: &str,
    case: &Case,
    dtypes: &[DType],
    tol32: f64,
    reference: impl Fn(&[Vec<f64>]) -> Expected,
) {
    for &dt in dtypes {
        let args = case.args(dt);
        let vals: Vec<Vec<f64>> = args
            .iter()
            .map(|t| t.as_ref().map(Tensor::to_f64_vec).unwrap_or_default())
            .collect();
        let want = reference(&vals);
        let g = case.graph(dt);
        for backend in backends() {
            if !computes(backend, dt) {
                continue;
            }
            let got = case.run_on(&g, backend, dt, &format!("{what} {dt}"));
            assert_outputs(
                &format!("{what} {dt} on {backend:?}"),
                &got,
                &want,
                dt,
                tol32,
            );
        }
    }
}

/// Each output against its expected shape and values: f64 ones within 1e-10, the others
/// within `tol32`.
pub fn assert_outputs(
    what: &str,
    got: &[(String, Tensor)],
    want: &Expected,
    dt: DType,
    tol32: f64,
) {
    assert_eq!(got.len(), want.len(), "{what}: outputs");
    for ((name, t), (shape, w)) in got.iter().zip(want) {
        assert_eq!(t.shape(), &shape[..], "{what}: output '{name}'");
        let tol = if dt == DType::F64 { 1e-10 } else { tol32 };
        let e = rel_err(&t.to_f64_vec(), w);
        assert!(
            e <= tol,
            "{what}: output '{name}': rel err {e:.2e}\n got {:?}\nwant {:?}",
            &t.to_f64_vec()[..w.len().min(8)],
            &w[..w.len().min(8)]
        );
    }
}

/// The gradients (f64, CPU) of Σ dy·(output 0) with respect to the inputs `wrt`, against
/// central finite differences of `reference`.
pub fn check_grads(
    what: &str,
    case: &Case,
    wrt: &[usize],
    seed: u64,
    reference: impl Fn(&[Vec<f64>]) -> Expected,
) {
    let args = case.args(DType::F64);
    let names: Vec<&str> = case.inputs.iter().map(|(n, _)| *n).collect();
    let fed = Fed {
        names: &names,
        feeds: case.feeds(&args),
        vals: args
            .iter()
            .map(|t| t.as_ref().map(Tensor::to_f64_vec).unwrap_or_default())
            .collect(),
    };
    grads_match_fd(
        what,
        case.graph(DType::F64),
        case.outputs[0],
        &fed,
        wrt,
        seed,
        reference,
    );
}

/// A graph's f64 inputs as fed: their names, the feeds, and their values in name order.
pub struct Fed<'a> {
    pub names: &'a [&'a str],
    pub feeds: HashMap<String, Tensor>,
    pub vals: Vec<Vec<f64>>,
}

/// The gradients (CPU) of Σ dy·`out` of graph `g` with respect to the inputs `wrt` (indices
/// into `fed.names`), against central finite differences of `reference` (whose first
/// entry is `out`). `g` must have `out` as its only output: a backward pass seeds the
/// others with ones.
pub fn grads_match_fd(
    what: &str,
    g: graphrun::Graph,
    out: &str,
    fed: &Fed,
    wrt: &[usize],
    seed: u64,
    reference: impl Fn(&[Vec<f64>]) -> Expected,
) {
    let vals = &fed.vals;
    let (shape, _) = reference(vals).remove(0);
    let dy = randn(&shape, seed);
    let mut s = Session::new(g, SessionOptions::unfused()).unwrap();
    let seeds = HashMap::from([(out.to_string(), dy.clone())]);
    let grads = s
        .backward(&fed.feeds, &seeds)
        .unwrap_or_else(|e| panic!("{what}: backward: {e}"))
        .grads;
    let dyv = dy.to_f64_vec();
    let loss = |v: &[Vec<f64>]| -> f64 {
        let (_, y) = reference(v).remove(0);
        y.iter().zip(&dyv).map(|(a, b)| a * b).sum()
    };
    for &k in wrt {
        let name = fed.names[k];
        let got = grads
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("{what}: no gradient for '{name}'"))
            .1
            .to_f64_vec();
        let fd: Vec<f64> = (0..vals[k].len())
            .map(|i| {
                let h = 1e-6;
                let (mut p, mut m) = (vals.clone(), vals.clone());
                p[k][i] += h;
                m[k][i] -= h;
                (loss(&p) - loss(&m)) / (2.0 * h)
            })
            .collect();
        assert_grad(&format!("{what}: d/d{name}"), &got, &fd, 1e-6);
    }
}

pub const BOTH: [DType; 2] = [DType::F32, DType::F64];
