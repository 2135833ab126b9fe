//! Reverse-mode differentiation as a graph transform (SPEC §4).
//!
//! `backward` walks the forward graph in reverse execution order, asks each node's
//! gradient rule (rules.rs: one function per op) for its inputs' gradients as new nodes,
//! and sums the gradients that reach a value from several consumers. The result is one
//! ordinary graph holding the forward nodes and the backward nodes: the planner keeps a
//! forward value alive exactly as long as some backward node still reads it, and the
//! passes and every backend run it like any other graph.
//!
//! Shapes are concrete: the graph is differentiated for one set of input shapes (the
//! session caches one backward graph per shape set), so broadcast reductions, Reshape
//! targets and Split sizes are plain constants.

mod rules;

use crate::error::{Error, Result};
use crate::graph::infer::{self, ValueType};
use crate::graph::{Dim, Graph, HostEval, Node, Op};
use crate::tensor::{DType, Tensor};
use std::collections::{HashMap, HashSet};

/// A differentiated graph.
#[derive(Clone, Debug)]
pub struct Backward {
    /// Forward and backward nodes; its outputs are the forward outputs, then the gradients.
    pub graph: Graph,
    /// (a floating graph input or trainable initializer, the value holding its gradient),
    /// graph inputs first, in declaration order.
    pub grads: Vec<(String, String)>,
    /// (a differentiated forward output, the graph input that seeds its gradient).
    pub seeds: Vec<(String, String)>,
}

/// How to differentiate. `Default` (given in `exec`, which knows the backends) uses the
/// CPU reference evaluator.
#[derive(Clone, Debug)]
pub struct BackwardOptions {
    /// Dropout applies its mask (training); otherwise Dropout is the identity.
    pub training: bool,
    /// Also differentiate with respect to the floating graph inputs (not only the
    /// trainable initializers); training needs only the latter.
    pub inputs: bool,
    /// Evaluates nodes on the host while the shapes are inferred.
    pub eval: &'static dyn HostEval,
}

/// Whether `op` passes no gradient to any input although it may read floats: rounding
/// maps (derivative zero wherever it exists), comparisons and logic (bool results), shapes,
/// index arithmetic and the indices of ArgMax and ArgMin. The backward graph treats their outputs as constants
/// (`graphrun inspect --backward` lists them).
pub fn treated_as_constant(op: &Op) -> bool {
    match op {
        Op::Unary(u) => !u.differentiable(),
        // Integer-only maps (bitwise) have no gradient either.
        Op::Binary(b) => b.is_comparison() || b.kind() == crate::graph::BinaryKind::Bitwise,
        // NonZero's and Unique's index outputs are integers; Unique's Y is given no
        // gradient either (which occurrence it copies is a choice of its values).
        Op::Shape { .. }
        | Op::Range
        | Op::ArgReduce { .. }
        | Op::NonZero
        | Op::Unique { .. }
        | Op::NonMaxSuppression { .. } => true,
        // Resize's weights read X for its type only; reinterpreted bits have no derivative.
        Op::ResizeMatrix { .. } | Op::BitCast { .. } => true,
        _ => false,
    }
}

/// Differentiates `outputs` of `g` (each seeded by a new graph input of its type) with
/// respect to every floating graph input and trainable initializer, for these input shapes.
pub fn backward(
    g: &Graph,
    outputs: &[String],
    input_shapes: &HashMap<String, Vec<usize>>,
    opts: &BackwardOptions,
) -> Result<Backward> {
    backward_with(g, outputs, input_shapes, &HashMap::new(), opts)
}

/// `backward` for these values of the graph inputs that decide shapes
/// (`infer::plan_time_inputs`): the backward graph holds for them only.
pub fn backward_with(
    g: &Graph,
    outputs: &[String],
    input_shapes: &HashMap<String, Vec<usize>>,
    values: &HashMap<String, Tensor>,
    opts: &BackwardOptions,
) -> Result<Backward> {
    let inf = infer::infer_graph_with(g, input_shapes, values, opts.eval)?;
    let mut out = g.clone();
    // The backward graph holds for these shapes only: say so in its inputs.
    for i in &mut out.inputs {
        i.shape = inf.types[&i.name]
            .shape
            .iter()
            .map(|&d| Dim::Fixed(d))
            .collect();
    }
    let wrt: Vec<String> = g
        .inputs
        .iter()
        .filter(|i| opts.inputs && i.dtype.is_float())
        .map(|i| i.name.clone())
        .chain(
            g.initializers
                .iter()
                .filter(|i| i.trainable && i.tensor.dtype().is_float())
                .map(|i| i.name.clone()),
        )
        .collect();
    let mut b = Builder {
        taken: g
            .inputs
            .iter()
            .map(|i| i.name.clone())
            .chain(g.initializers.iter().map(|i| i.name.clone()))
            .chain(g.nodes.iter().flat_map(|n| n.outputs.iter().cloned()))
            .chain(g.nodes.iter().map(|n| n.name.clone()))
            .collect(),
        types: inf.types,
        consts: inf.consts,
        requires: HashSet::new(),
        created: HashSet::new(),
        training: opts.training,
        eval: opts.eval,
        g: out,
        cur: String::new(),
    };

    // Which values depend on something differentiated, through floating values.
    b.requires.extend(wrt.iter().cloned());
    for &ni in &inf.order {
        let n = &g.nodes[ni];
        // ResizeMatrix reads X for its type only: its weights depend on nothing
        // differentiated, and computing their gradient would be wasted work.
        if matches!(n.op, Op::ResizeMatrix { .. }) {
            continue;
        }
        if n.inputs.iter().any(|i| b.requires.contains(i)) {
            for o in n.outputs.iter().filter(|o| !o.is_empty()) {
                if b.types[o].dtype.is_float() {
                    b.requires.insert(o.clone());
                }
            }
        }
    }

    // Seeds.
    let mut acc: HashMap<String, Vec<String>> = HashMap::new();
    let mut seeds = vec![];
    for o in outputs {
        let Some(ty) = b.types.get(o).cloned() else {
            crate::bail!(
                Input,
                "'{o}' is not a value of the graph; it cannot be differentiated"
            );
        };
        if !ty.dtype.is_float() {
            crate::bail!(
                Input,
                "output '{o}' is {}: only floating outputs have gradients",
                ty.dtype
            );
        }
        let name = b.fresh(&format!("{o}.grad"));
        b.g.inputs.push(crate::graph::InputInfo {
            default: None,
            name: name.clone(),
            dtype: ty.dtype,
            shape: ty.shape.iter().map(|&d| Dim::Fixed(d)).collect(),
            range: None,
            loc: None,
        });
        b.types.insert(name.clone(), ty);
        acc.entry(o.clone()).or_default().push(name.clone());
        seeds.push((o.clone(), name));
    }

    // The reverse walk.
    for &ni in inf.order.iter().rev() {
        let node = b.g.nodes[ni].clone();
        if !node.inputs.iter().any(|i| b.requires.contains(i)) {
            continue;
        }
        let mut dys = vec![];
        for o in &node.outputs {
            dys.push(match acc.remove(o) {
                Some(parts) => Some(b.sum(parts)?),
                None => None,
            });
        }
        if dys.iter().all(|d| d.is_none()) {
            continue;
        }
        b.cur = node.name.clone();
        let dxs = rules::grad(&mut b, ni, &node, &dys).map_err(|e| match e {
            Error::Graph(m) if !m.contains(&node.name) => {
                Error::Graph(format!("backward of {}: {m}", node.describe()))
            }
            e => e,
        })?;
        for (i, dx) in node.inputs.iter().zip(dxs) {
            if let Some(dx) = dx {
                if b.requires.contains(i) {
                    debug_assert_eq!(
                        b.types[&dx], b.types[i],
                        "gradient of '{i}' at {}",
                        node.name
                    );
                    acc.entry(i.clone()).or_default().push(dx);
                }
            }
        }
    }

    // Name each gradient `<value>.grad`, and list it as an output. All sums are made
    // first: a value that is the gradient of several parameters (or a forward value, or a
    // seed) gets an Identity per name; one made here for a single parameter is renamed.
    b.cur = "grad".into();
    let mut finals = vec![];
    for w in &wrt {
        let v = match acc.remove(w) {
            Some(parts) => b.sum(parts)?,
            None => {
                let ty = b.types[w].clone();
                b.zeros(&ty)?
            }
        };
        finals.push((w.clone(), v));
    }
    let mut uses: HashMap<String, usize> = HashMap::new();
    for (_, v) in &finals {
        *uses.entry(v.clone()).or_default() += 1;
    }
    let mut grads = vec![];
    for (w, v) in finals {
        let want = b.fresh(&format!("{w}.grad"));
        let v = if b.created.contains(&v) && uses[&v] == 1 {
            b.rename(&v, &want);
            want
        } else {
            b.op1(Op::Identity, &[&v], &want)?
        };
        b.g.outputs.push(v.clone());
        grads.push((w, v));
    }
    crate::graph::validate::validate(&b.g, opts.eval).map_err(|e| {
        Error::Graph(format!(
            "the backward graph is invalid (a graphrun bug): {e}"
        ))
    })?;
    Ok(Backward {
        graph: b.g,
        grads,
        seeds,
    })
}

/// Builds backward nodes into the graph, inferring each new value's type as it goes.
pub(crate) struct Builder {
    g: Graph,
    types: HashMap<String, ValueType>,
    /// Values known on the host (forward constants and the Constants added here).
    consts: HashMap<String, Tensor>,
    /// Values whose gradient is wanted (they depend on a differentiated value).
    requires: HashSet<String>,
    /// Values the builder made (they may be renamed).
    created: HashSet<String>,
    /// Every value and node name in use.
    taken: HashSet<String>,
    training: bool,
    /// The forward node being differentiated (names the new nodes).
    cur: String,
    eval: &'static dyn HostEval,
}

impl Builder {
    fn fresh(&mut self, base: &str) -> String {
        let name = if self.taken.contains(base) {
            (2..)
                .map(|k| format!("{base}_{k}"))
                .find(|s| !self.taken.contains(s))
                .expect("some name is free")
        } else {
            base.to_string()
        };
        self.taken.insert(name.clone());
        name
    }

    pub fn ty(&self, v: &str) -> &ValueType {
        &self.types[v]
    }
    pub fn shape(&self, v: &str) -> Vec<usize> {
        self.types[v].shape.clone()
    }
    pub fn dtype(&self, v: &str) -> DType {
        self.types[v].dtype
    }
    pub fn konst(&self, v: &str) -> Option<&Tensor> {
        self.consts.get(v)
    }
    /// Whether `v`'s gradient is wanted.
    pub fn needs(&self, v: &str) -> bool {
        !v.is_empty() && self.requires.contains(v)
    }
    pub fn training(&self) -> bool {
        self.training
    }

    /// The output types of `n` from the types and host constants known so far.
    fn infer(&self, n: &Node) -> Result<Vec<ValueType>> {
        let tys = n.map_inputs(|i| self.types.get(i));
        let cs = n.map_inputs(|i| self.consts.get(i));
        infer::infer_node(n, &tys, &cs, self.eval)
    }

    /// Adds a node; `outs` are value-name hints ("" leaves that output unnamed).
    pub fn node(&mut self, op: Op, ins: &[&str], outs: &[&str]) -> Result<Vec<String>> {
        let name = self.fresh(&format!("{}/{}", self.cur, op.name()));
        let outputs: Vec<String> = outs
            .iter()
            .map(|o| {
                if o.is_empty() {
                    String::new()
                } else {
                    self.fresh(o)
                }
            })
            .collect();
        let node = Node {
            name,
            op,
            inputs: ins.iter().map(|s| s.to_string()).collect(),
            outputs,
            loc: None,
        };
        let out_types = self.infer(&node)?;
        if let Op::Constant { value } = &node.op {
            self.consts.insert(node.outputs[0].clone(), value.clone());
        }
        for (o, t) in node.outputs.iter().zip(out_types) {
            if !o.is_empty() {
                self.types.insert(o.clone(), t);
                self.created.insert(o.clone());
            }
        }
        let outs = node.outputs.clone();
        self.g.nodes.push(node);
        Ok(outs)
    }

    /// A one-output node; its value is named from `hint`.
    pub fn op1(&mut self, op: Op, ins: &[&str], hint: &str) -> Result<String> {
        Ok(self.node(op, ins, &[hint])?.remove(0))
    }

    fn hint(&self) -> String {
        format!("{}/d", self.cur)
    }

    pub fn un(&mut self, op: Op, x: &str) -> Result<String> {
        let h = self.hint();
        self.op1(op, &[x], &h)
    }
    pub fn bin(&mut self, op: crate::graph::BinaryOp, a: &str, b: &str) -> Result<String> {
        let h = self.hint();
        self.op1(Op::Binary(op), &[a, b], &h)
    }

    pub fn constant(&mut self, value: Tensor) -> Result<String> {
        let h = format!("{}/c", self.cur);
        self.op1(Op::Constant { value }, &[], &h)
    }
    pub fn i64s(&mut self, v: &[i64]) -> Result<String> {
        self.constant(Tensor::from_vec(&[v.len()], v.to_vec())?)
    }
    pub fn shape_const(&mut self, shape: &[usize]) -> Result<String> {
        let v: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        self.i64s(&v)
    }
    pub fn scalar(&mut self, dtype: DType, v: f64) -> Result<String> {
        self.constant(Tensor::from_f64(dtype, &[], &[v])?)
    }

    pub fn reshape(&mut self, x: &str, shape: &[usize]) -> Result<String> {
        if self.types[x].shape == shape {
            return Ok(x.to_string());
        }
        let s = self.shape_const(shape)?;
        let h = self.hint();
        self.op1(Op::Reshape { allowzero: false }, &[x, &s], &h)
    }

    pub fn transpose(&mut self, x: &str, perm: Vec<usize>) -> Result<String> {
        self.un(Op::Transpose { perm: Some(perm) }, x)
    }

    /// Sums a broadcast gradient back to `shape` (numpy's un-broadcast).
    pub fn sum_to(&mut self, g: &str, shape: &[usize]) -> Result<String> {
        let gs = self.shape(g);
        if gs == shape {
            return Ok(g.to_string());
        }
        let lead = gs.len() - shape.len();
        let axes: Vec<i64> = (0..gs.len())
            .filter(|&a| a < lead || (shape[a - lead] == 1 && gs[a] != 1))
            .map(|a| a as i64)
            .collect();
        // Only leading axes summed (the usual bias case): drop them, no Reshape after.
        let keepdims = axes.iter().any(|&a| a as usize >= lead);
        let r = if axes.is_empty() {
            g.to_string()
        } else {
            self.un(
                Op::Reduce {
                    kind: crate::graph::ReduceKind::Sum,
                    axes: Some(axes),
                    keepdims,
                    noop_with_empty_axes: false,
                },
                g,
            )?
        };
        self.reshape(&r, shape)
    }

    /// Zeros of a type (a broadcast scalar: no large constant in the graph).
    pub fn zeros(&mut self, ty: &ValueType) -> Result<String> {
        let z = self.scalar(ty.dtype, 0.0)?;
        let s = self.shape_const(&ty.shape)?;
        let h = self.hint();
        self.op1(Op::Expand, &[&z, &s], &h)
    }

    /// The sum of gradient contributions (a chain of Adds).
    fn sum(&mut self, parts: Vec<String>) -> Result<String> {
        let mut it = parts.into_iter();
        let mut s = it.next().expect("at least one part");
        for p in it {
            s = self.bin(crate::graph::BinaryOp::Add, &s, &p)?;
        }
        Ok(s)
    }

    /// Names output `k` of forward node `ni` (adding unnamed outputs up to it), so a
    /// gradient rule can read a forward by-product such as FusedMatMul's Pre.
    pub fn aux_output(&mut self, ni: usize, k: usize, hint: &str) -> Result<String> {
        if let Some(o) = self.g.nodes[ni].outputs.get(k).filter(|o| !o.is_empty()) {
            return Ok(o.clone());
        }
        let name = self.fresh(&format!("{}/{hint}", self.g.nodes[ni].name));
        let n = &mut self.g.nodes[ni];
        while n.outputs.len() <= k {
            n.outputs.push(String::new());
        }
        n.outputs[k] = name.clone();
        let n = &self.g.nodes[ni];
        let t = self.infer(n)?.swap_remove(k);
        self.types.insert(name.clone(), t);
        Ok(name)
    }

    /// Sets forward Dropout node `ni`'s training_mode input to a constant true, so that
    /// it applies its mask whatever mode the backend runs in.
    pub fn force_training_mode(&mut self, ni: usize) -> Result<()> {
        let on = self.constant(Tensor::scalar(crate::tensor::Bool::TRUE))?;
        let n = &mut self.g.nodes[ni];
        while n.inputs.len() < 3 {
            n.inputs.push(String::new());
        }
        n.inputs[2] = on;
        Ok(())
    }

    /// Renames a value the builder made, everywhere it appears.
    fn rename(&mut self, from: &str, to: &str) {
        for n in &mut self.g.nodes {
            for v in n.inputs.iter_mut().chain(n.outputs.iter_mut()) {
                if v == from {
                    *v = to.to_string();
                }
            }
        }
        for v in &mut self.g.outputs {
            if v == from {
                *v = to.to_string();
            }
        }
        if let Some(t) = self.types.remove(from) {
            self.types.insert(to.to_string(), t);
        }
        self.created.remove(from);
    }
}
