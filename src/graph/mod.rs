//! The IR: values (graph inputs, initializers, node outputs), nodes carrying the closed
//! `Op` enum, and the graph that holds them. Loading (yaml.rs), validation (validate.rs),
//! shape and dtype inference (infer/) and DOT output (dot.rs) live beside it. The IR
//! imports nothing above it (backends, exec, loaders of other formats): inference that
//! needs values computed takes a host evaluator (eval.rs) as a parameter.

pub mod dot;
pub mod elementwise;
pub mod eval;
pub mod infer;
pub mod loss;
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
    /// A fixed size.
    Fixed(usize),
    /// A named symbol (`batch`, `seq`), its size given at run time or by the graph's
    /// `dims` defaults.
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

/// A declared graph input: the value a run feeds.
#[derive(Clone, Debug, PartialEq)]
pub struct InputInfo {
    /// The value's name.
    pub name: String,
    /// Its element type.
    pub dtype: DType,
    /// Its shape; symbolic dims are bound by each run's feeds.
    pub shape: Vec<Dim>,
    /// Half-open range random data is drawn from.
    pub range: Option<(f64, f64)>,
    /// The value used when a run does not feed this input (an ONNX initializer that is
    /// also a graph input: a default the caller may override, not a constant).
    pub default: Option<Tensor>,
    /// Where it was declared in the model file, for error messages.
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
    File {
        /// The `.npy` or `.safetensors` file, as the model names it.
        path: PathBuf,
        /// The tensor's name inside a `.safetensors` file.
        key: Option<String>,
    },
}

/// An initializer's `init:` spec: how its values are generated (`graph::yaml::generate`).
#[derive(Clone, Debug, PartialEq)]
pub enum InitSpec {
    /// All zeros (`init: zeros`).
    Zeros,
    /// All ones (`init: ones`).
    Ones,
    /// Every element the same value (`init: {constant: V}`).
    Constant(f64),
    /// Seeded random values (`init: {dist: D, seed: N, ...}`).
    Dist {
        /// The distribution drawn from.
        dist: Dist,
        /// The seed of graphrun's generator (`rng::Rng`): the same seed gives the same
        /// values on every machine.
        seed: u64,
    },
}

/// A distribution an initializer's values are drawn from. The Xavier and Kaiming ones
/// read fan-in and fan-out from a weight laid out as MatMul takes it, `[..., in, out]`.
#[derive(Clone, Debug, PartialEq)]
pub enum Dist {
    /// The normal distribution `N(mean, std²)`.
    Normal {
        /// The mean.
        mean: f64,
        /// The standard deviation.
        std: f64,
    },
    /// The uniform distribution on `[low, high)`.
    Uniform {
        /// The lower bound.
        low: f64,
        /// The upper bound.
        high: f64,
    },
    /// Uniform on `±sqrt(6 / (fan_in + fan_out))` (Glorot).
    XavierUniform,
    /// Normal with std `sqrt(2 / (fan_in + fan_out))` (Glorot).
    XavierNormal,
    /// Uniform on `±sqrt(6 / fan_in)` (He, with ReLU's gain).
    KaimingUniform,
    /// Normal with std `sqrt(2 / fan_in)` (He, with ReLU's gain).
    KaimingNormal,
}

/// A named constant tensor of the graph: a weight, a bias, or any value known before a
/// run.
#[derive(Clone, Debug, PartialEq)]
pub struct Initializer {
    /// The value's name.
    pub name: String,
    /// Its value.
    pub tensor: Tensor,
    /// Whether training updates it (floating initializers are, unless the model says
    /// `trainable: false`).
    pub trainable: bool,
    /// How it was given, so that a written model gives it the same way.
    pub source: InitSource,
    /// Where it was declared in the model file, for error messages.
    pub loc: Option<Loc>,
}

/// One operator application: an op reading named values and writing named values.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// The node's name (unique in the graph; unnamed nodes are given one when loaded).
    pub name: String,
    /// The operator and its attributes.
    pub op: Op,
    /// Input value names; "" marks an omitted optional input, as in ONNX.
    pub inputs: Vec<String>,
    /// Output value names, positional as the op defines them; "" marks an output not
    /// asked for.
    pub outputs: Vec<String>,
    /// Where it was written in the model file, for error messages.
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

/// A training run's optimizer and its hyper-parameters, with PyTorch's update rules.
#[derive(Clone, Debug, PartialEq)]
pub enum Optimizer {
    /// Stochastic gradient descent, with optional momentum.
    Sgd {
        /// The learning rate.
        lr: f64,
        /// The momentum factor (0: none).
        momentum: f64,
        /// L2 penalty: `weight_decay · p` is added to the gradient.
        weight_decay: f64,
    },
    /// Adam.
    Adam {
        /// The learning rate.
        lr: f64,
        /// The decay rate of the first moment estimate.
        beta1: f64,
        /// The decay rate of the second moment estimate.
        beta2: f64,
        /// Added to the second moment's root, for numerical stability.
        eps: f64,
        /// L2 penalty: `weight_decay · p` is added to the gradient.
        weight_decay: f64,
    },
    /// AdamW: Adam with decoupled weight decay.
    AdamW {
        /// The learning rate.
        lr: f64,
        /// The decay rate of the first moment estimate.
        beta1: f64,
        /// The decay rate of the second moment estimate.
        beta2: f64,
        /// Added to the second moment's root, for numerical stability.
        eps: f64,
        /// Decoupled decay: each step multiplies the parameter by `1 − lr · weight_decay`.
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
pub(crate) enum StepScalars {
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
    pub(crate) fn step_scalars(&self, t: u64) -> StepScalars {
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

/// A model's `training:` section: what training minimizes and how.
#[derive(Clone, Debug, PartialEq)]
pub struct Training {
    /// The value minimized: a scalar floating value of the graph.
    pub loss: String,
    /// The optimizer that updates the trainable initializers.
    pub optimizer: Optimizer,
}

/// An initializer that each training step sets to a value the step computes (not by a
/// gradient: a running statistic, say).
#[derive(Clone, Debug, PartialEq)]
pub struct StateUpdate {
    /// The initializer written (not trainable; same type as `value`).
    pub target: String,
    /// The graph output it takes after each training step.
    pub value: String,
}

/// A model's computation: declared inputs, initializers, nodes and outputs.
#[derive(Clone, Debug, PartialEq)]
pub struct Graph {
    /// The graph's name.
    pub name: String,
    /// Default sizes of symbolic dims.
    pub dims: BTreeMap<String, usize>,
    /// The values a run feeds.
    pub inputs: Vec<InputInfo>,
    /// The names of the values a run returns.
    pub outputs: Vec<String>,
    /// The constant tensors (weights and the like).
    pub initializers: Vec<Initializer>,
    /// The nodes, in any order (`validate::topo_order` gives one they can run in).
    pub nodes: Vec<Node>,
    /// How to train the graph, when the model says.
    pub training: Option<Training>,
    /// State that a training step writes back: after each step, each `target`
    /// initializer takes the value of its `value` (a graph output). BatchNormalization's
    /// running statistics move this way.
    pub updates: Vec<StateUpdate>,
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
    /// The graph input named `name`.
    pub fn input(&self, name: &str) -> Option<&InputInfo> {
        self.inputs.iter().find(|i| i.name == name)
    }
    /// The initializer named `name`.
    pub fn initializer(&self, name: &str) -> Option<&Initializer> {
        self.initializers.iter().find(|i| i.name == name)
    }
    /// Whether training changes initializer `init`: by its gradient (trainable) or as
    /// the target of a state update. Its value is then no constant of the model.
    pub fn varies(&self, init: &Initializer) -> bool {
        init.trainable || self.updates.iter().any(|u| u.target == init.name)
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
