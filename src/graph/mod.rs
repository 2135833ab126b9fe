//! The IR: values (graph inputs, initializers, node outputs), nodes carrying the closed
//! `Op` enum, and the graph that holds them. Loading (yaml.rs), validation (validate.rs),
//! shape and dtype inference (infer/) and DOT output (dot.rs) live beside it. The IR
//! imports nothing above it (backends, exec, loaders of other formats): inference that
//! needs values computed takes a host evaluator (eval.rs) as a parameter.

pub mod dot;
pub mod elementwise;
pub mod eval;
pub mod infer;
pub mod lower;
pub mod op;
pub mod resize;
pub mod validate;
pub mod window;
pub mod yaml;

pub use eval::HostEval;
pub use op::{
    Activation, AttrValue, BinaryKind, BinaryOp, Op, PadMode, ReduceKind, ScatterReduction, UnaryOp,
};

use crate::error::Loc;
use crate::tensor::{DType, Tensor};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// A dimension of a declared graph input: a number or a symbol bound at run time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dim {
    Fixed(usize),
    Sym(String),
}

impl std::fmt::Display for Dim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dim::Fixed(n) => write!(f, "{n}"),
            Dim::Sym(s) => f.write_str(s),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct InputInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<Dim>,
    /// Half-open range random data is drawn from.
    pub range: Option<(f64, f64)>,
    /// The value used when a run does not feed this input (an ONNX initializer that is
    /// also a graph input: a default the caller may override, not a constant).
    pub default: Option<Tensor>,
    pub loc: Option<Loc>,
}

/// How an initializer was given, so that `--emit-yaml` can write it back the same way.
#[derive(Clone, Debug, PartialEq)]
pub enum InitSource {
    /// `init:` (zeros, ones, constant, or a seeded distribution) — regenerated bit-exactly.
    Init(InitSpec),
    /// `values:` or anything computed (constant folding, `--dtype` casts).
    Data,
    /// `file:`; `key` for safetensors.
    File { path: PathBuf, key: Option<String> },
}

#[derive(Clone, Debug, PartialEq)]
pub enum InitSpec {
    Zeros,
    Ones,
    Constant(f64),
    Dist { dist: Dist, seed: u64 },
}

#[derive(Clone, Debug, PartialEq)]
pub enum Dist {
    Normal { mean: f64, std: f64 },
    Uniform { low: f64, high: f64 },
    XavierUniform,
    XavierNormal,
    KaimingUniform,
    KaimingNormal,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Initializer {
    pub name: String,
    pub tensor: Tensor,
    pub trainable: bool,
    pub source: InitSource,
    pub loc: Option<Loc>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub name: String,
    pub op: Op,
    /// Input value names; "" marks an omitted optional input, as in ONNX.
    pub inputs: Vec<String>,
    pub outputs: Vec<String>,
    pub loc: Option<Loc>,
}

impl Node {
    /// "node 'fc1' (MatMul)" — how errors name a node.
    pub fn describe(&self) -> String {
        match &self.loc {
            Some(l) => format!("node '{}' ({}) at {}", self.name, self.op.name(), l),
            None => format!("node '{}' ({})", self.name, self.op.name()),
        }
    }
    /// `f` of each input name, None for an omitted input (named ""): the per-input view
    /// (types, constants, buffers) that inference, planning and autodiff build.
    pub fn map_inputs<T>(&self, mut f: impl FnMut(&str) -> Option<T>) -> Vec<Option<T>> {
        self.inputs
            .iter()
            .map(|i| if i.is_empty() { None } else { f(i) })
            .collect()
    }
    /// The i-th input if present (not omitted).
    pub fn input(&self, i: usize) -> Option<&str> {
        self.inputs
            .get(i)
            .map(|s| s.as_str())
            .filter(|s| !s.is_empty())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Optimizer {
    Sgd {
        lr: f64,
        momentum: f64,
        weight_decay: f64,
    },
    Adam {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
    AdamW {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
}

impl Optimizer {
    /// The hyper-parameters checked as PyTorch's optimizers check them: `Err((field,
    /// why))` for the first bad one. Every way of setting them (the model file, `--lr`,
    /// the library) goes through here.
    pub fn check(&self) -> std::result::Result<(), (&'static str, String)> {
        let bad =
            |f: &'static str, v: f64, want: &str| Err((f, format!("{f} must be {want}, got {v}")));
        let (lr, wd) = match *self {
            Optimizer::Sgd {
                lr, weight_decay, ..
            }
            | Optimizer::Adam {
                lr, weight_decay, ..
            }
            | Optimizer::AdamW {
                lr, weight_decay, ..
            } => (lr, weight_decay),
        };
        if !(lr.is_finite() && lr > 0.0) {
            return bad("lr", lr, "a finite number > 0");
        }
        if !(wd.is_finite() && wd >= 0.0) {
            return bad("weight_decay", wd, "a finite number >= 0");
        }
        match *self {
            Optimizer::Sgd { momentum, .. } => {
                if !(momentum.is_finite() && momentum >= 0.0) {
                    return bad("momentum", momentum, "a finite number >= 0");
                }
            }
            Optimizer::Adam {
                beta1, beta2, eps, ..
            }
            | Optimizer::AdamW {
                beta1, beta2, eps, ..
            } => {
                for (f, b) in [("beta1", beta1), ("beta2", beta2)] {
                    if !(0.0..1.0).contains(&b) {
                        return bad(f, b, "in [0, 1)");
                    }
                }
                if !(eps.is_finite() && eps > 0.0) {
                    return bad("eps", eps, "a finite number > 0");
                }
            }
        }
        Ok(())
    }

    /// The learning rate.
    pub fn lr_mut(&mut self) -> &mut f64 {
        match self {
            Optimizer::Sgd { lr, .. }
            | Optimizer::Adam { lr, .. }
            | Optimizer::AdamW { lr, .. } => lr,
        }
    }
}

/// The scalars of one optimizer step (SPEC §4, PyTorch's rules), computed once here so
/// that every backend's update reads the same numbers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StepScalars {
    Sgd {
        lr: f64,
        momentum: f64,
        weight_decay: f64,
    },
    /// Adam and AdamW.
    Adam {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        /// AdamW: the parameter decays by `decay` instead of the gradient taking
        /// `weight_decay · p`.
        decoupled: bool,
        /// `lr / (1 − beta1^t)`: the step size with the first moment's bias correction.
        step_size: f64,
        /// `sqrt(1 − beta2^t)`: the second moment's bias correction, under the root.
        sqrt_bc2: f64,
        /// `1 − lr · weight_decay`: AdamW's factor on the parameter.
        decay: f64,
    },
}

impl Optimizer {
    /// The scalars of step `t` (counting from 1).
    pub fn step_scalars(&self, t: u64) -> StepScalars {
        match *self {
            Optimizer::Sgd {
                lr,
                momentum,
                weight_decay,
            } => StepScalars::Sgd {
                lr,
                momentum,
                weight_decay,
            },
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            }
            | Optimizer::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                let ti = t.min(i32::MAX as u64) as i32;
                let (bc1, bc2) = (1.0 - beta1.powi(ti), 1.0 - beta2.powi(ti));
                StepScalars::Adam {
                    lr,
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                    decoupled: matches!(self, Optimizer::AdamW { .. }),
                    step_size: lr / bc1,
                    sqrt_bc2: bc2.sqrt(),
                    decay: 1.0 - lr * weight_decay,
                }
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Training {
    pub loss: String,
    pub optimizer: Optimizer,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Graph {
    pub name: String,
    /// Default sizes of symbolic dims.
    pub dims: BTreeMap<String, usize>,
    pub inputs: Vec<InputInfo>,
    pub outputs: Vec<String>,
    pub initializers: Vec<Initializer>,
    pub nodes: Vec<Node>,
    pub training: Option<Training>,
    /// The file the graph was loaded from, for messages.
    pub file: Option<PathBuf>,
}

impl Graph {
    /// Each node output's producing node (by index).
    pub fn producers(&self) -> std::collections::HashMap<&str, usize> {
        self.nodes
            .iter()
            .enumerate()
            .flat_map(|(i, n)| n.outputs.iter().map(move |o| (o.as_str(), i)))
            .collect()
    }
    pub fn input(&self, name: &str) -> Option<&InputInfo> {
        self.inputs.iter().find(|i| i.name == name)
    }
    pub fn initializer(&self, name: &str) -> Option<&Initializer> {
        self.initializers.iter().find(|i| i.name == name)
    }
    /// Number of elements in all initializers (the parameter count `inspect` prints).
    pub fn param_count(&self) -> usize {
        self.initializers.iter().map(|i| i.tensor.numel()).sum()
    }
    /// Every symbol used by the graph inputs, in order of first use.
    pub fn symbols(&self) -> Vec<String> {
        let mut out: Vec<String> = vec![];
        for i in &self.inputs {
            for d in &i.shape {
                if let Dim::Sym(s) = d {
                    if !out.contains(s) {
                        out.push(s.clone());
                    }
                }
            }
        }
        out
    }
    /// Counts of each op, sorted by name.
    pub fn op_counts(&self) -> BTreeMap<&'static str, usize> {
        let mut m = BTreeMap::new();
        for n in &self.nodes {
            *m.entry(n.op.name()).or_insert(0) += 1;
        }
        m
    }
}
