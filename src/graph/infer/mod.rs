//! Dtype and shape inference for every operator, on concrete shapes. Inputs that decide
//! a shape (Reshape's shape, Slice's starts, ...) must be known when the plan is made:
//! they are initializers, Constants, graph inputs whose fed values the plan is made for
//! (`plan_time_inputs`), or computed from them and from `Shape` — the small
//! "shape arithmetic" subgraphs exporters emit are evaluated on the host while inferring,
//! by the evaluator the caller passes (`HostEval`). NonZero and Unique, whose outputs'
//! shapes are their results, take their input as such a value and are computed on the
//! host here (`computed_at_plan_time`).
//!
//! `infer_node` checks arities and required inputs, then hands the node to its op family's
//! file, each reading the node through a small context (`Cx`, cx.rs): elementwise.rs,
//! reduce.rs, shape.rs, index.rs, nn.rs, attention.rs and grad.rs.

mod attention;
mod cx;
mod elementwise;
mod grad;
mod index;
mod nn;
mod reduce;
mod resize;
mod shape;
pub mod symbolic;
mod window;

pub(crate) use attention::{qkv_parts, AttnDims};

use super::eval::{HostEval, PLAN_INPUT_LIMIT};
use super::op::LossReduction;
use super::*;
use crate::error::{Error, Result};
use crate::tensor::{fmt_shape, DType, Tensor};
use attention::attn_qkv;
use cx::Cx;
use std::collections::HashMap;

/// The type of a value: dtype and concrete shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValueType {
    /// The element type.
    pub dtype: DType,
    /// The concrete shape.
    pub shape: Vec<usize>,
}

impl ValueType {
    /// The type of a `dtype` tensor of `shape`.
    pub fn new(dtype: DType, shape: &[usize]) -> Self {
        ValueType {
            dtype,
            shape: shape.to_vec(),
        }
    }
    /// The number of elements.
    pub fn numel(&self) -> usize {
        crate::tensor::numel(&self.shape)
    }
    /// The size of its data in bytes.
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
}

impl std::fmt::Display for ValueType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}", self.dtype, fmt_shape(&self.shape))
    }
}

/// Values computed while inferring are kept when at most this many elements.
const CONST_LIMIT: usize = 1 << 16;

/// Everything inference learns about a graph for one set of input shapes.
#[derive(Clone, Debug, Default)]
pub struct Inferred {
    /// Every value's type, by name.
    pub types: HashMap<String, ValueType>,
    /// Values known on the host: small initializers, Constants, shape arithmetic.
    pub consts: HashMap<String, Tensor>,
    /// Node indices in a valid execution order.
    pub order: Vec<usize>,
}

/// Infers every value's type given each graph input's concrete shape; `ev` evaluates the
/// small nodes whose values decide shapes.
pub fn infer_graph(
    g: &Graph,
    input_shapes: &HashMap<String, Vec<usize>>,
    ev: &dyn HostEval,
) -> Result<Inferred> {
    infer_graph_with(g, input_shapes, &HashMap::new(), ev)
}

/// `infer_graph` with the values of some graph inputs known on the host: those that
/// decide shapes (`plan_time_inputs`), fed when the plan is made.
pub fn infer_graph_with(
    g: &Graph,
    input_shapes: &HashMap<String, Vec<usize>>,
    values: &HashMap<String, Tensor>,
    ev: &dyn HostEval,
) -> Result<Inferred> {
    let mut inf = Inferred::start(g, input_shapes, values)?;
    inf.order = validate::topo_order(g)?;
    for &ni in &inf.order.clone() {
        inf.step(&g.nodes[ni], ev)?;
    }
    for o in &g.outputs {
        if !inf.types.contains_key(o) {
            crate::bail!(
                Graph,
                "graph output '{o}' is not produced by any node, input or initializer"
            );
        }
    }
    Ok(inf)
}

impl Inferred {
    /// The types (and host values) of the graph's inputs and initializers, before any
    /// node: `step` then adds nodes one at a time, in an execution order.
    pub fn start(
        g: &Graph,
        input_shapes: &HashMap<String, Vec<usize>>,
        values: &HashMap<String, Tensor>,
    ) -> Result<Inferred> {
        let mut inf = Inferred::default();
        for i in &g.inputs {
            let shape = input_shapes
                .get(&i.name)
                .ok_or_else(|| crate::err!(Input, "no shape for graph input '{}'", i.name))?;
            if crate::tensor::checked_numel(shape)
                .and_then(|n| n.checked_mul(8))
                .is_none()
            {
                crate::bail!(
                    Input,
                    "graph input '{}' of shape {} is too large (its size overflows)",
                    i.name,
                    fmt_shape(shape)
                );
            }
            inf.types
                .insert(i.name.clone(), ValueType::new(i.dtype, shape));
            if let Some(v) = values.get(&i.name) {
                if v.dtype() != i.dtype || v.shape() != &shape[..] {
                    crate::bail!(
                        Input,
                        "the value of graph input '{}' must be {}, got {}{}",
                        i.name,
                        ValueType::new(i.dtype, shape),
                        v.dtype(),
                        fmt_shape(v.shape())
                    );
                }
                inf.consts.insert(i.name.clone(), v.clone());
            }
        }
        for init in &g.initializers {
            inf.types.insert(
                init.name.clone(),
                ValueType::new(init.tensor.dtype(), init.tensor.shape()),
            );
            // A weight that training changes is no constant: a value computed from it
            // when the plan is made would keep its first value.
            if init.tensor.numel() <= CONST_LIMIT && !g.varies(init) {
                inf.consts.insert(init.name.clone(), init.tensor.clone());
            }
        }
        Ok(inf)
    }

    /// Infers `node`'s outputs from what is known of its inputs, and host-evaluates it
    /// when it is small and its inputs are known.
    pub fn step(&mut self, node: &Node, ev: &dyn HostEval) -> Result<()> {
        let inf = self;
        let ins: Vec<Option<&ValueType>> = node.map_inputs(|n| inf.types.get(n));
        let consts: Vec<Option<&Tensor>> = node.map_inputs(|n| inf.consts.get(n));
        let outs = infer_node(node, &ins, &consts, ev)?;
        // Host-evaluate small nodes whose inputs are all known: this is what resolves
        // Shape → Gather → Concat → Reshape chains.
        let all_known = node
            .inputs
            .iter()
            .zip(&consts)
            .all(|(n, c)| n.is_empty() || c.is_some());
        let small = outs.iter().all(|t| t.numel() <= CONST_LIMIT)
            && ins.iter().flatten().all(|t| t.numel() <= CONST_LIMIT);
        let mut values = None;
        if let (Op::Shape { start, end }, Some(x)) = (&node.op, ins.first().copied().flatten()) {
            // Shape needs only the input's type, never its data.
            let (s, e) = shape_range(*start, *end, x.shape.len());
            let dims: Vec<i64> = x.shape[s..e].iter().map(|&d| d as i64).collect();
            values = Some(vec![Tensor::from_vec(&[dims.len()], dims)?]);
        } else if let Op::ResizeMatrix { .. } = node.op {
            // X is read for its type only; `infer_node` checked the rest.
            values = Some(resize::values(node, &ins, &consts).map_err(|m| fail(node, &ins, m))?);
        } else if computed_at_plan_time(&node.op) {
            // Its input is known (`infer_node` refused it otherwise) and at most
            // CONST_LIMIT elements; its outputs are no larger than a few times that.
            values = Some(ev.eval(node, &consts, &outs)?);
        } else if small && all_known && !node.op.is_random() {
            let args: Vec<Option<&Tensor>> = consts.clone();
            values = ev.eval(node, &args, &outs).ok();
        }
        for t in &outs {
            if crate::tensor::checked_numel(&t.shape)
                .and_then(|n| n.checked_mul(8))
                .is_none()
            {
                return Err(fail(
                    node,
                    &ins,
                    format!(
                        "output shape {} is too large (its size overflows)",
                        fmt_shape(&t.shape)
                    ),
                ));
            }
        }
        for (k, (name, t)) in node.outputs.iter().zip(outs).enumerate() {
            if name.is_empty() {
                continue;
            }
            if let Some(v) = values.as_mut().and_then(|v: &mut Vec<Tensor>| v.get_mut(k)) {
                inf.consts.insert(
                    name.clone(),
                    std::mem::replace(v, Tensor::zeros(DType::F32, &[0])),
                );
            }
            inf.types.insert(name.clone(), t);
        }
        Ok(())
    }
}

/// What stops a graph from being planned whole.
pub enum Blocked {
    /// Node `.0` needs a value that is not known on the host (a shape-deciding input, or
    /// NonZero's data); `.1` is inference's error.
    Value(usize, Error),
    /// Node `.0` is an If whose branches give different shapes, as the importer writes it
    /// when the condition is computed (a Where of the two branches, named `<If>/select<k>`),
    /// and the condition is now known: it is the branch input `.1`.
    Branch(usize, usize),
}

/// The first node, in execution order, that stops `g` from being planned whole; None
/// when the whole graph infers.
pub fn first_blocked(
    g: &Graph,
    shapes: &HashMap<String, Vec<usize>>,
    values: &HashMap<String, Tensor>,
    ev: &dyn HostEval,
) -> Result<Option<Blocked>> {
    let mut inf = Inferred::start(g, shapes, values)?;
    for ni in super::validate::topo_order(g)? {
        let node = &g.nodes[ni];
        if let Err(e) = inf.step(node, ev) {
            let cond = node.input(0).and_then(|v| inf.consts.get(v));
            let from_if = node.op == Op::Where
                && node
                    .name
                    .rsplit_once('/')
                    .is_some_and(|(_, s)| s.starts_with("select"));
            if from_if {
                // The condition decides the shape: known, it picks a branch; computed
                // from data, it is what a stage must compute first.
                match cond {
                    Some(c) if c.numel() == 1 => {
                        let pick = if c.to_f64_vec()[0] != 0.0 { 1 } else { 2 };
                        return Ok(Some(Blocked::Branch(ni, pick)));
                    }
                    None => return Ok(Some(Blocked::Value(ni, e))),
                    Some(_) => {}
                }
            }
            let unknown = infer::shape_inputs(&node.op)
                .iter()
                .any(|&(k, _)| node.input(k).is_some_and(|v| !inf.consts.contains_key(v)));
            return if unknown {
                Ok(Some(Blocked::Value(ni, e)))
            } else {
                Err(e)
            };
        }
    }
    Ok(None)
}

/// Ops whose outputs' shapes depend on their input's values, not only on its shape:
/// inference computes them on the host (their input must be known when the plan is
/// made), so a plan holds their outputs as constants and no backend runs them.
pub fn computed_at_plan_time(op: &Op) -> bool {
    matches!(
        op,
        Op::NonZero | Op::Unique { .. } | Op::NonMaxSuppression { .. } | Op::ResizeMatrix { .. }
    )
}

/// The inputs of `op` that decide its output's shape (by index, with what each is): their
/// values must be known on the host when the plan is made (`infer_node`'s `known`).
pub fn shape_inputs(op: &Op) -> &'static [(usize, &'static str)] {
    match op {
        Op::Reshape { .. } | Op::Expand => &[(1, "shape")],
        Op::Reduce { .. } | Op::Squeeze { .. } | Op::Unsqueeze { .. } => &[(1, "axes")],
        Op::Split { .. } => &[(1, "split")],
        Op::Slice => &[(1, "starts"), (2, "ends"), (3, "axes"), (4, "steps")],
        Op::Range => &[(0, "start"), (1, "limit"), (2, "delta")],
        Op::TopK { .. } => &[(1, "k")],
        Op::NonZero | Op::Unique { .. } => &[(0, "input X")],
        Op::NonMaxSuppression { .. } => &[
            (0, "boxes"),
            (1, "scores"),
            (2, "max_output_boxes_per_class"),
            (3, "iou_threshold"),
            (4, "score_threshold"),
        ],
        Op::ResizeMatrix { .. } => &[(1, "roi"), (2, "scales"), (3, "sizes")],
        Op::GatherGrad { .. } | Op::GatherElementsGrad { .. } | Op::GatherNDGrad { .. } => {
            &[(2, "the forward input's shape")]
        }
        Op::Pad { .. } => &[(1, "pads"), (3, "axes")],
        Op::PadGrad { .. } => &[(1, "pads"), (2, "axes")],
        Op::Im2Col { .. } => &[(1, "kernel_shape")],
        Op::Col2Im { .. } => &[(1, "image_shape"), (2, "block_shape")],
        Op::SliceGrad => &[
            (1, "the forward input's shape"),
            (2, "starts"),
            (3, "ends"),
            (4, "axes"),
            (5, "steps"),
        ],
        Op::Unary(_)
        | Op::Binary(_)
        | Op::Clip
        | Op::Where
        | Op::Cast { .. }
        | Op::CastLike
        | Op::BitCast { .. }
        | Op::Identity
        | Op::MatMul
        | Op::Gemm { .. }
        | Op::Softmax { .. }
        | Op::LogSoftmax { .. }
        | Op::LayerNormalization { .. }
        | Op::Transpose { .. }
        | Op::Concat { .. }
        | Op::Flatten { .. }
        | Op::Gather { .. }
        | Op::GatherElements { .. }
        | Op::GatherND { .. }
        | Op::ScatterElements { .. }
        | Op::ScatterND { .. }
        | Op::Cumulative { .. }
        | Op::ArgReduce { .. }
        | Op::Shape { .. }
        | Op::Constant { .. }
        | Op::Trilu { .. }
        | Op::SoftmaxCrossEntropyLoss { .. }
        | Op::Dropout { .. }
        | Op::Random { .. }
        | Op::FusedMatMul { .. }
        | Op::GatedMatMul { .. }
        | Op::GatedMatMulGrad { .. }
        | Op::Attention { .. }
        | Op::VarlenAttention { .. }
        | Op::UnaryGrad(_)
        | Op::SoftmaxGrad { .. }
        | Op::LayerNormalizationGrad { .. }
        | Op::SoftmaxCrossEntropyLossGrad { .. }
        | Op::FusedMatMulGrad { .. }
        | Op::AttentionGrad { .. }
        | Op::VarlenAttentionGrad { .. }
        | Op::Rotary { .. }
        | Op::RotaryGrad { .. }
        | Op::Conv { .. }
        | Op::FusedConv { .. }
        | Op::ConvGrad { .. }
        | Op::MaxPool { .. }
        | Op::MaxPoolGrad { .. } => &[],
    }
}

/// A graph input whose value decides a shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanTimeInput {
    /// The graph input's name.
    pub name: String,
    /// A node whose shape-deciding input is computed from it, and which input.
    pub node: usize,
    /// Which input of that node (its position).
    pub slot: usize,
}

/// The graph inputs whose values decide shapes: those a shape-deciding input
/// (`shape_inputs`) is computed from, walking producers back (`Shape` reads only its
/// input's type, so the walk stops there). A plan is made for their fed values, in
/// declaration order.
pub fn plan_time_inputs(g: &Graph) -> Vec<PlanTimeInput> {
    let found = shape_deciding(g);
    g.inputs
        .iter()
        .filter_map(|i| {
            found
                .get(i.name.as_str())
                .map(|&(node, slot)| PlanTimeInput {
                    name: i.name.clone(),
                    node,
                    slot,
                })
        })
        .collect()
}

/// Every value a shape-deciding input (`shape_inputs`) is computed from, walking
/// producers back (`Shape` reads only its input's type, so the walk stops there), with
/// the first node and input that needs it. Graph inputs among them are planned for their
/// fed values; initializers among them cannot be trained (the loaders mark them so).
pub fn shape_deciding(g: &Graph) -> HashMap<&str, (usize, usize)> {
    let producer = g.producers();
    let mut found: HashMap<&str, (usize, usize)> = HashMap::new();
    for (ni, n) in g.nodes.iter().enumerate() {
        for &(slot, _) in shape_inputs(&n.op) {
            let Some(v) = n.input(slot) else { continue };
            let mut stack = vec![v];
            while let Some(v) = stack.pop() {
                if found.contains_key(v) {
                    continue;
                }
                found.insert(v, (ni, slot));
                if let Some(&p) = producer.get(v) {
                    // Shape reads only its input's type, and ResizeMatrix its X's.
                    let skip = match g.nodes[p].op {
                        Op::Shape { .. } => g.nodes[p].inputs.len(),
                        Op::ResizeMatrix { .. } => 1,
                        _ => 0,
                    };
                    stack.extend(
                        g.nodes[p].inputs[skip..]
                            .iter()
                            .filter(|s| !s.is_empty())
                            .map(|s| s.as_str()),
                    );
                }
            }
        }
    }
    found
}

/// Marks the initializers that decide a shape not trainable: their values are read when
/// the plan is made, so a training step could not change what they decide.
pub fn freeze_shape_deciding(g: &mut Graph) {
    let found: std::collections::HashSet<String> =
        shape_deciding(g).into_keys().map(str::to_string).collect();
    for i in &mut g.initializers {
        if found.contains(&i.name) {
            i.trainable = false;
        }
    }
}

/// Numpy broadcasting of two shapes.
pub fn broadcast(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

/// Normalises a possibly negative axis for rank `r`.
pub fn norm_axis(axis: i64, r: usize) -> Option<usize> {
    let a = if axis < 0 { axis + r as i64 } else { axis };
    (a >= 0 && a < r as i64).then_some(a as usize)
}

/// Output shape of numpy `matmul` for `a @ b` (1-D operands promoted and squeezed).
pub fn matmul_shape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    if a.is_empty() || b.is_empty() {
        return None;
    }
    let a2: Vec<usize> = if a.len() == 1 {
        vec![1, a[0]]
    } else {
        a.to_vec()
    };
    let b2: Vec<usize> = if b.len() == 1 {
        vec![b[0], 1]
    } else {
        b.to_vec()
    };
    let (m, k) = (a2[a2.len() - 2], a2[a2.len() - 1]);
    let (k2, n) = (b2[b2.len() - 2], b2[b2.len() - 1]);
    if k != k2 {
        return None;
    }
    let mut out = broadcast(&a2[..a2.len() - 2], &b2[..b2.len() - 2])?;
    if a.len() > 1 {
        out.push(m);
    }
    if b.len() > 1 {
        out.push(n);
    }
    Some(out)
}

/// A failure of inference, naming the node and the types of all its inputs.
fn fail(node: &Node, ins: &[Option<&ValueType>], msg: impl std::fmt::Display) -> Error {
    let types: Vec<String> = node
        .inputs
        .iter()
        .zip(ins)
        .map(|(n, t)| match t {
            Some(t) => format!("{n}: {t}"),
            None if n.is_empty() => "(omitted)".into(),
            None => format!("{n}: ?"),
        })
        .collect();
    Error::Graph(format!(
        "{}: {msg} (inputs {})",
        node.describe(),
        types.join(", ")
    ))
}

/// Infers the output types of one node. `ins[i]` is `None` for an omitted optional input;
/// `consts[i]` holds the input's value when known on the host; `ev` computes NonZero and
/// Unique, whose outputs' shapes are their results.
pub fn infer_node(
    node: &Node,
    ins: &[Option<&ValueType>],
    consts: &[Option<&Tensor>],
    ev: &dyn HostEval,
) -> Result<Vec<ValueType>> {
    let f = |msg: String| fail(node, ins, msg);
    let (min_in, max_in, min_out, max_out) = node.op.arity();
    if ins.len() < min_in || ins.len() > max_in {
        return Err(f(format!(
            "takes {} inputs, got {}",
            arity_text(min_in, max_in),
            ins.len()
        )));
    }
    if node.outputs.len() < min_out || node.outputs.len() > max_out {
        return Err(f(format!(
            "has {} outputs, expected {}",
            node.outputs.len(),
            arity_text(min_out, max_out)
        )));
    }
    // Required inputs are the first `min_in` (Split/Concat/Slice included), except
    // Attention's K and V, which its packed form omits (checked by its rule).
    for (i, t) in ins.iter().enumerate().take(min_in) {
        if t.is_none() && !node.op.may_omit(i) {
            return Err(f(format!("input {i} is required")));
        }
    }
    let cx = Cx {
        node,
        ins,
        consts,
        ev,
    };
    match &node.op {
        Op::Unary(_)
        | Op::Binary(_)
        | Op::Clip
        | Op::Where
        | Op::Cast { .. }
        | Op::CastLike
        | Op::BitCast { .. }
        | Op::Identity
        | Op::Trilu { .. } => elementwise::infer(&cx),
        Op::Reduce { .. }
        | Op::ArgReduce { .. }
        | Op::TopK { .. }
        | Op::Cumulative { .. }
        | Op::Softmax { .. }
        | Op::LogSoftmax { .. } => reduce::infer(&cx),
        Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Concat { .. }
        | Op::Split { .. }
        | Op::Slice
        | Op::Squeeze { .. }
        | Op::Unsqueeze { .. }
        | Op::Flatten { .. }
        | Op::Expand
        | Op::Pad { .. }
        | Op::Shape { .. }
        | Op::Constant { .. }
        | Op::Range => shape::infer(&cx),
        Op::Gather { .. }
        | Op::GatherElements { .. }
        | Op::GatherND { .. }
        | Op::ScatterElements { .. }
        | Op::ScatterND { .. }
        | Op::NonZero
        | Op::Unique { .. }
        | Op::NonMaxSuppression { .. } => index::infer(&cx),
        Op::MatMul
        | Op::Gemm { .. }
        | Op::FusedMatMul { .. }
        | Op::GatedMatMul { .. }
        | Op::LayerNormalization { .. }
        | Op::SoftmaxCrossEntropyLoss { .. }
        | Op::Dropout { .. }
        | Op::Random { .. }
        | Op::Rotary { .. } => nn::infer(&cx),
        Op::Attention { .. } | Op::VarlenAttention { .. } => attention::infer(&cx),
        Op::Im2Col { .. }
        | Op::Col2Im { .. }
        | Op::Conv { .. }
        | Op::FusedConv { .. }
        | Op::ConvGrad { .. }
        | Op::MaxPool { .. }
        | Op::MaxPoolGrad { .. } => window::infer(&cx),
        Op::ResizeMatrix { .. } => resize::infer(&cx),
        Op::UnaryGrad(_)
        | Op::SoftmaxGrad { .. }
        | Op::LayerNormalizationGrad { .. }
        | Op::SoftmaxCrossEntropyLossGrad { .. }
        | Op::GatherGrad { .. }
        | Op::GatherElementsGrad { .. }
        | Op::GatherNDGrad { .. }
        | Op::SliceGrad
        | Op::PadGrad { .. }
        | Op::FusedMatMulGrad { .. }
        | Op::GatedMatMulGrad { .. }
        | Op::AttentionGrad { .. }
        | Op::VarlenAttentionGrad { .. }
        | Op::RotaryGrad { .. } => grad::infer(&cx),
    }
}

/// A single output of type `v`.
fn one(v: ValueType) -> Result<Vec<ValueType>> {
    Ok(vec![v])
}

/// The dtype of per-row statistics (LayerNorm's Mean/InvStdDev, attention's LSE).
pub fn stat_dtype(d: DType) -> DType {
    if d == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

fn arity_text(lo: usize, hi: usize) -> String {
    if lo == hi {
        lo.to_string()
    } else if hi == usize::MAX {
        format!("at least {lo}")
    } else {
        format!("{lo} to {hi}")
    }
}

/// Pad's (begin, end) count per dim of a rank-`r` input, from `pads` (all begin values,
/// then all end values) over `axes` (default every dim; negative ones count from the end).
pub fn pad_pairs(
    r: usize,
    pads: &[i64],
    axes: Option<&[i64]>,
) -> std::result::Result<Vec<(i64, i64)>, String> {
    let all: Vec<i64> = (0..r as i64).collect();
    let axes = axes.unwrap_or(&all);
    if pads.len() != 2 * axes.len() {
        return Err(format!(
            "pads has {} values; it needs 2 per padded axis ({})",
            pads.len(),
            axes.len()
        ));
    }
    let mut pairs = vec![(0, 0); r];
    let mut seen = vec![false; r];
    for (k, &a) in axes.iter().enumerate() {
        let Some(d) = norm_axis(a, r) else {
            return Err(format!("axis {a} is out of range for rank {r}"));
        };
        if std::mem::replace(&mut seen[d], true) {
            return Err(format!("axis {a} is repeated"));
        }
        pairs[d] = (pads[k], pads[axes.len() + k]);
    }
    Ok(pairs)
}

/// The elements of an axis of `n` that a (begin, end) pad keeps (negative pads remove).
pub fn pad_kept(n: usize, (b, e): (i64, i64)) -> i64 {
    n as i64 + b.min(0) + e.min(0)
}

/// The shape after padding `shape` by `pairs` (`sign` 1), or before it (`sign` -1, the
/// input shape of the Pad whose output has `shape`).
fn pad_shape(
    shape: &[usize],
    pairs: &[(i64, i64)],
    sign: i64,
) -> std::result::Result<Vec<usize>, String> {
    shape
        .iter()
        .zip(pairs)
        .map(|(&n, &(b, e))| {
            let m = b
                .checked_add(e)
                .and_then(|p| p.checked_mul(sign))
                .and_then(|p| p.checked_add(n as i64))
                .filter(|&m| m >= 0)
                .ok_or_else(|| format!("pads ({b}, {e}) do not fit an axis of {n}"))?;
            Ok(m as usize)
        })
        .collect()
}

/// ONNX Shape's start/end, clamped.
pub fn shape_range(start: i64, end: Option<i64>, r: usize) -> (usize, usize) {
    let r = r as i64;
    let c = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
    let s = c(start);
    let e = c(end.unwrap_or(r));
    (s, e.max(s))
}

/// ONNX Slice's effective start and end for one axis of size `d` (clamped, negative
/// indices resolved). For negative steps the range runs from `start` down to `end`
/// exclusive, where `end` may be -1 meaning "through index 0".
pub fn slice_range(
    start: i64,
    end: i64,
    step: i64,
    d: usize,
) -> std::result::Result<(i64, i64), String> {
    if step == 0 {
        return Err("Slice step must not be 0".into());
    }
    let d = d as i64;
    let fix = |v: i64| if v < 0 { v.saturating_add(d) } else { v };
    let (s, e) = (fix(start), fix(end));
    Ok(if step > 0 {
        (s.clamp(0, d), e.clamp(0, d))
    } else {
        (s.clamp(-1, d - 1), e.clamp(-1, d - 1))
    })
}

/// Floating-point operations of one node (multiply-adds count 2), for `inspect`.
pub fn flops(node: &Node, ins: &[Option<&ValueType>], outs: &[ValueType]) -> u64 {
    let out_n = outs.first().map(|o| o.numel() as u64).unwrap_or(0);
    match &node.op {
        Op::MatMul | Op::FusedMatMul { .. } => {
            let a = ins[0].map(|t| t.shape.clone()).unwrap_or_default();
            let k = if a.is_empty() {
                0
            } else {
                a[a.len() - 1] as u64
            };
            2 * out_n * k
        }
        Op::Gemm { trans_a, .. } => {
            let a = ins[0].map(|t| t.shape.clone()).unwrap_or_default();
            let k = if a.len() == 2 {
                if *trans_a {
                    a[0]
                } else {
                    a[1]
                }
            } else {
                0
            } as u64;
            2 * out_n * k
        }
        // QKᵀ and PV; causal counts half, as ../shared/bench counts it.
        Op::Attention { is_causal, .. } => {
            let Ok([q, k, v]) = attn_qkv(&node.op, ins, 0) else {
                return 0;
            };
            let Ok(a) = AttnDims::new(&node.op, &q.shape, &k.shape, &v.shape) else {
                return 0;
            };
            let f = 2 * (a.b * a.hq * a.sq * a.skv * (a.d + a.dv)) as u64;
            if *is_causal {
                f / 2
            } else {
                f
            }
        }
        // Sequence boundaries are data, so this is the bound of one sequence holding all rows.
        Op::VarlenAttention { .. } => {
            let (q, k, v) = (ins[0].unwrap(), ins[1].unwrap(), ins[2].unwrap());
            2 * (q.shape[0] * q.shape[1] * (q.shape[2] + v.shape[2])) as u64 * k.shape[0] as u64
        }
        Op::Softmax { .. } | Op::LogSoftmax { .. } | Op::LayerNormalization { .. } => 5 * out_n,
        Op::Unary(_) | Op::Binary(_) | Op::Clip | Op::Where => out_n,
        Op::Reduce { .. } | Op::ArgReduce { .. } | Op::Cumulative { .. } => {
            ins[0].map(|t| t.numel() as u64).unwrap_or(0)
        }
        Op::SoftmaxCrossEntropyLoss { .. } => 5 * ins[0].map(|t| t.numel() as u64).unwrap_or(0),
        // One forward-sized product per gradient asked for (dA and/or dB).
        Op::FusedMatMulGrad { .. } => {
            let (Some(dy), Some(a)) = (ins[0], ins[1]) else {
                return 0;
            };
            let k = a.shape.last().copied().unwrap_or(0) as u64;
            let wanted = node
                .outputs
                .iter()
                .take(2)
                .filter(|o| !o.is_empty())
                .count() as u64;
            2 * dy.numel() as u64 * k * wanted
        }
        // Recomputing QKᵀ, then dV, dP, dQ and dK: 2.5× the forward (FlashAttention-2).
        Op::AttentionGrad { .. } | Op::VarlenAttentionGrad { .. } => {
            let fwd = Node {
                op: node.op.grad_base().expect("a gradient op has a forward op"),
                ..node.clone()
            };
            flops(&fwd, &ins[1..], outs) * 5 / 2
        }
        Op::UnaryGrad(_) => 2 * out_n,
        Op::SoftmaxGrad { .. } | Op::LayerNormalizationGrad { .. } => 5 * out_n,
        Op::SoftmaxCrossEntropyLossGrad { .. } => 5 * out_n,
        Op::Rotary { .. } | Op::RotaryGrad { .. } => 3 * out_n,
        // Two products, and the gate.
        Op::GatedMatMul { .. } => {
            let k = ins[0].and_then(|t| t.shape.last()).copied().unwrap_or(0) as u64;
            4 * out_n * k + 2 * out_n
        }
        Op::GatedMatMulGrad { .. } => 4 * out_n,
        // 2·(C/group)·K multiply-adds per output element; the gradient one such product
        // per gradient asked for.
        Op::Conv { .. } | Op::FusedConv { .. } => {
            let w = ins[1].map(|t| t.numel() as u64).unwrap_or(0);
            let m = ins[1]
                .and_then(|t| t.shape.first())
                .copied()
                .unwrap_or(1)
                .max(1) as u64;
            2 * out_n * (w / m)
        }
        Op::ConvGrad { .. } => {
            let (Some(dy), Some(w)) = (ins[0], ins[2]) else {
                return 0;
            };
            let m = w.shape.first().copied().unwrap_or(1).max(1) as u64;
            let wanted = node.outputs.iter().filter(|o| !o.is_empty()).count() as u64;
            2 * dy.numel() as u64 * (w.numel() as u64 / m) * wanted
        }
        _ => 0,
    }
}
