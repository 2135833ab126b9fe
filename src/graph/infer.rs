//! Dtype and shape inference for every operator, on concrete shapes. Inputs that decide
//! a shape (Reshape's shape, Slice's starts, ...) must be known when the plan is made:
//! they are initializers, Constants, graph inputs whose fed values the plan is made for
//! (`plan_time_inputs`), or computed from them and from `Shape` — the small
//! "shape arithmetic" subgraphs exporters emit are evaluated on the host by the CPU
//! reference kernels while inferring. NonZero and Unique, whose outputs' shapes are their
//! results, take their input as such a value and are computed on the host here
//! (`computed_at_plan_time`).

use super::op::LossReduction;
use super::*;
use crate::error::{Error, Result};
use crate::tensor::{fmt_shape, DType, Tensor};
use std::collections::HashMap;

/// The type of a value: dtype and concrete shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValueType {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl ValueType {
    pub fn new(dtype: DType, shape: &[usize]) -> Self {
        ValueType {
            dtype,
            shape: shape.to_vec(),
        }
    }
    pub fn numel(&self) -> usize {
        crate::tensor::numel(&self.shape)
    }
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
    pub types: HashMap<String, ValueType>,
    /// Values known on the host: small initializers, Constants, shape arithmetic.
    pub consts: HashMap<String, Tensor>,
    /// Node indices in a valid execution order.
    pub order: Vec<usize>,
}

/// Attention's problem sizes, from Q, K and V in either form ONNX opset 23 defines:
/// 4-D `Q [B, Hq, Sq, D]`, `K [B, Hkv, Skv, D]`, `V [B, Hkv, Skv, Dv]`, or 3-D with the
/// heads packed in the last axis, `Q [B, Sq, Hq·D]`, `K [B, Skv, Hkv·D]`,
/// `V [B, Skv, Hkv·Dv]`, whose head counts come from `q_num_heads` and `kv_num_heads`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    pub b: usize,
    pub hq: usize,
    pub hkv: usize,
    pub sq: usize,
    pub skv: usize,
    pub d: usize,
    pub dv: usize,
    /// The 3-D form: Q, K, V, Y (and their gradients) are `[B, S, H·D]`.
    pub packed: bool,
}

impl AttnDims {
    /// From the op's attributes and the three shapes; the error says what disagrees.
    pub fn new(
        op: &Op,
        q: &[usize],
        k: &[usize],
        v: &[usize],
    ) -> std::result::Result<AttnDims, String> {
        let (Op::Attention {
            q_num_heads: nq,
            kv_num_heads: nkv,
            ..
        }
        | Op::AttentionGrad {
            q_num_heads: nq,
            kv_num_heads: nkv,
            ..
        }) = *op
        else {
            return Err(format!("{} is not Attention", op.name()));
        };
        let dims = match (q.len(), k.len(), v.len()) {
            (4, 4, 4) => {
                let (b, hq, sq, d) = (q[0], q[1], q[2], q[3]);
                let (hkv, skv) = (k[1], k[2]);
                if k[0] != b || v[0] != b || k[3] != d || v[1] != hkv || v[2] != skv {
                    return Err(format!(
                        "Q {}, K {} and V {} disagree (batch, heads, sequence or head size)",
                        fmt_shape(q),
                        fmt_shape(k),
                        fmt_shape(v)
                    ));
                }
                for (name, want, got) in [("q_num_heads", nq, hq), ("kv_num_heads", nkv, hkv)] {
                    if want.is_some_and(|n| n != got) {
                        return Err(format!(
                            "attribute {name} is {}, but the 4-D inputs have {got} heads",
                            want.unwrap_or(0)
                        ));
                    }
                }
                AttnDims { b, hq, hkv, sq, skv, d, dv: v[3], packed: false }
            }
            (3, 3, 3) => {
                let (Some(hq), Some(hkv)) = (nq, nkv) else {
                    return Err(
                        "3-D Q [B, Sq, Hq·D], K and V [B, Skv, Hkv·D] need the attributes q_num_heads and kv_num_heads"
                            .into(),
                    );
                };
                let heads = |what: &str, hidden: usize, h: usize, attr: &str| {
                    if !hidden.is_multiple_of(h) {
                        Err(format!("{what}'s hidden size {hidden} is not divisible by {attr} {h}"))
                    } else {
                        Ok(hidden / h)
                    }
                };
                let d = heads("Q", q[2], hq, "q_num_heads")?;
                let dk = heads("K", k[2], hkv, "kv_num_heads")?;
                let dv = heads("V", v[2], hkv, "kv_num_heads")?;
                if dk != d {
                    return Err(format!(
                        "K's head size {dk} ({} / kv_num_heads {hkv}) differs from Q's {d} ({} / q_num_heads {hq})",
                        k[2], q[2]
                    ));
                }
                if k[0] != q[0] || v[0] != q[0] || v[1] != k[1] {
                    return Err(format!(
                        "Q {}, K {} and V {} disagree (batch or key sequence)",
                        fmt_shape(q),
                        fmt_shape(k),
                        fmt_shape(v)
                    ));
                }
                AttnDims { b: q[0], hq, hkv, sq: q[1], skv: k[1], d, dv, packed: true }
            }
            (a, b, c) => {
                return Err(format!(
                    "Attention takes Q, K and V all 4-D [B, H, S, D] or all 3-D [B, S, H·D]; got ranks {a}, {b} and {c}"
                ))
            }
        };
        if dims.hkv == 0 || dims.hq % dims.hkv != 0 {
            return Err(format!(
                "query heads {} must be a multiple of key/value heads {}",
                dims.hq, dims.hkv
            ));
        }
        Ok(dims)
    }
    /// Y's shape (dY's, and with `d` for `dv` Q's).
    pub fn y_shape(&self) -> Vec<usize> {
        if self.packed {
            vec![self.b, self.sq, self.hq * self.dv]
        } else {
            vec![self.b, self.hq, self.sq, self.dv]
        }
    }
    /// Where the head vectors of Q (and of Y, dY, dQ) lie: head vector (b, h, i) is row
    /// `b·s[0] + h·s[1] + i·s[2]` of the tensor seen as rows of its head size.
    pub fn q_rows(&self) -> [usize; 3] {
        Self::rows(self.hq, self.sq, self.packed)
    }
    /// The same for K, V, dK and dV, over (b, kv head, key).
    pub fn k_rows(&self) -> [usize; 3] {
        Self::rows(self.hkv, self.skv, self.packed)
    }
    fn rows(h: usize, s: usize, packed: bool) -> [usize; 3] {
        if packed {
            [s * h, 1, h]
        } else {
            [h * s, s, 1]
        }
    }
}

/// Attention's packed form, K and V omitted: Q, K and V lie one after the other on the
/// last axis of one `[B, S, (Hq + 2·Hkv)·D]` tensor (what rule `attention_qkv` makes of a
/// QKV projection split in three); its gradient is one tensor of that shape too. Returns
/// the parts' shapes `[B, S, H·D]` and their offsets (elements) in a row of the packed
/// tensor.
pub fn qkv_parts(op: &Op, qkv: &[usize]) -> std::result::Result<[(Vec<usize>, usize); 3], String> {
    let (Op::Attention {
        q_num_heads: Some(hq),
        kv_num_heads: Some(hkv),
        ..
    }
    | Op::AttentionGrad {
        q_num_heads: Some(hq),
        kv_num_heads: Some(hkv),
        ..
    }) = *op
    else {
        return Err(
            "packed QKV (K and V omitted) needs the attributes q_num_heads and kv_num_heads".into(),
        );
    };
    let &[b, s, w] = qkv else {
        return Err(format!(
            "packed QKV (K and V omitted) must be 3-D [B, S, (Hq + 2·Hkv)·D], got {}",
            fmt_shape(qkv)
        ));
    };
    let heads = hq + 2 * hkv;
    if heads == 0 || !w.is_multiple_of(heads) {
        return Err(format!(
            "packed QKV's last axis {w} is not (q_num_heads {hq} + 2 · kv_num_heads {hkv}) · D"
        ));
    }
    let d = w / heads;
    Ok([
        (vec![b, s, hq * d], 0),
        (vec![b, s, hkv * d], hq * d),
        (vec![b, s, hkv * d], (hq + hkv) * d),
    ])
}

/// Q, K and V of Attention (`at` 0) or AttentionGrad (`at` 1): the inputs, or the parts of
/// the packed first one when K and V are omitted (see [`qkv_parts`]).
fn attn_qkv(
    op: &Op,
    ins: &[Option<&ValueType>],
    at: usize,
) -> std::result::Result<[ValueType; 3], String> {
    let t = |i: usize| ins.get(at + i).copied().flatten();
    let q = t(0).ok_or("Q is required")?;
    match (t(1), t(2)) {
        (Some(k), Some(v)) => Ok([q.clone(), k.clone(), v.clone()]),
        (None, None) => Ok(qkv_parts(op, &q.shape)?.map(|(s, _)| ValueType::new(q.dtype, &s))),
        _ => Err("K and V are given or omitted together (omitted: Q is the packed QKV)".into()),
    }
}

/// Infers every value's type given each graph input's concrete shape.
pub fn infer_graph(g: &Graph, input_shapes: &HashMap<String, Vec<usize>>) -> Result<Inferred> {
    infer_graph_with(g, input_shapes, &HashMap::new())
}

/// `infer_graph` with the values of some graph inputs known on the host: those that
/// decide shapes (`plan_time_inputs`), fed when the plan is made.
pub fn infer_graph_with(
    g: &Graph,
    input_shapes: &HashMap<String, Vec<usize>>,
    values: &HashMap<String, Tensor>,
) -> Result<Inferred> {
    let mut inf = Inferred {
        order: validate::topo_order(g)?,
        ..Default::default()
    };
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
        if init.tensor.numel() <= CONST_LIMIT {
            inf.consts.insert(init.name.clone(), init.tensor.clone());
        }
    }
    for &ni in &inf.order.clone() {
        let node = &g.nodes[ni];
        let ins: Vec<Option<&ValueType>> = node.map_inputs(|n| inf.types.get(n));
        let consts: Vec<Option<&Tensor>> = node.map_inputs(|n| inf.consts.get(n));
        let outs = infer_node(node, &ins, &consts)?;
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
            values = Some(resize_values(node, &ins, &consts).map_err(|m| fail(node, &ins, m))?);
        } else if computed_at_plan_time(&node.op) {
            // Its input is known (`infer_node` refused it otherwise) and at most
            // CONST_LIMIT elements; its outputs are no larger than a few times that.
            values = Some(crate::backends::cpu::eval_node_with_types(
                node, &consts, &outs,
            )?);
        } else if small && all_known && !is_random(&node.op) {
            let args: Vec<Option<&Tensor>> = consts.clone();
            values = crate::backends::cpu::eval_node_with_types(node, &args, &outs).ok();
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

fn is_random(op: &Op) -> bool {
    matches!(op, Op::Dropout { .. })
}

/// Ops whose outputs' shapes depend on their input's values, not only on its shape:
/// inference computes them on the host (their input must be known when the plan is
/// made), so a plan holds their outputs as constants and no backend runs them.
pub fn computed_at_plan_time(op: &Op) -> bool {
    matches!(
        op,
        Op::NonZero | Op::Unique { .. } | Op::ResizeMatrix { .. }
    )
}

/// ResizeMatrix's outputs, from X's type and the host values of roi, scales and sizes.
fn resize_values(
    node: &Node,
    ins: &[Option<&ValueType>],
    consts: &[Option<&Tensor>],
) -> std::result::Result<Vec<Tensor>, String> {
    let x = ins
        .first()
        .copied()
        .flatten()
        .ok_or("input X is required")?;
    let mut vals = [None; 3];
    for (k, what) in [(1, "roi"), (2, "scales"), (3, "sizes")] {
        if ins.get(k).copied().flatten().is_none() {
            continue;
        }
        vals[k - 1] = Some(consts.get(k).copied().flatten().ok_or_else(|| {
            format!(
                "{what} (input '{}') must be known when the plan is made (computed from initializers, Constants, Shape and the graph inputs fed when planning, through small nodes evaluated on the host), but it depends on a value that is not",
                node.inputs[k]
            )
        })?);
    }
    super::resize::eval(&node.op, x.dtype, &x.shape, vals[0], vals[1], vals[2])
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
        | Op::FusedMatMul { .. }
        | Op::Attention { .. }
        | Op::VarlenAttention { .. }
        | Op::UnaryGrad(_)
        | Op::SoftmaxGrad { .. }
        | Op::LayerNormalizationGrad { .. }
        | Op::SoftmaxCrossEntropyLossGrad { .. }
        | Op::FusedMatMulGrad { .. }
        | Op::AttentionGrad { .. }
        | Op::VarlenAttentionGrad { .. } => &[],
    }
}

/// A graph input whose value decides a shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanTimeInput {
    pub name: String,
    /// A node whose shape-deciding input is computed from it, and which input.
    pub node: usize,
    pub slot: usize,
}

/// The graph inputs whose values decide shapes: those a shape-deciding input
/// (`shape_inputs`) is computed from, walking producers back (`Shape` reads only its
/// input's type, so the walk stops there). A plan is made for their fed values, in
/// declaration order.
pub fn plan_time_inputs(g: &Graph) -> Vec<PlanTimeInput> {
    let producer = g.producers();
    let mut found: HashMap<&str, (usize, usize)> = HashMap::new();
    let mut seen: std::collections::HashSet<&str> = Default::default();
    for (ni, n) in g.nodes.iter().enumerate() {
        for &(slot, _) in shape_inputs(&n.op) {
            let Some(v) = n.input(slot) else { continue };
            let mut stack = vec![v];
            while let Some(v) = stack.pop() {
                if !seen.insert(v) {
                    continue;
                }
                if g.input(v).is_some() {
                    found.entry(v).or_insert((ni, slot));
                } else if let Some(&p) = producer.get(v) {
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

/// A window's kernel dims: the attribute, else the plan-time input.
fn window_dims(
    attr: &[usize],
    input: Option<Vec<i64>>,
    what: &str,
) -> std::result::Result<Vec<usize>, String> {
    match input {
        _ if !attr.is_empty() => Ok(attr.to_vec()),
        Some(v) => super::window::dims_of(&v, what),
        None => Err(format!(
            "{what} is required (as the input or the attribute)"
        )),
    }
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
/// `consts[i]` holds the input's value when known on the host.
pub fn infer_node(
    node: &Node,
    ins: &[Option<&ValueType>],
    consts: &[Option<&Tensor>],
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
    let t = |i: usize| ins.get(i).copied().flatten();
    let x = t(0).cloned().unwrap_or(ValueType::new(DType::F32, &[]));
    let need_float = |v: &ValueType, what: &str| -> Result<()> {
        if v.dtype.is_float() {
            Ok(())
        } else {
            Err(f(format!(
                "{what} must be a floating dtype, got {}",
                v.dtype
            )))
        }
    };
    let need_int = |v: &ValueType, what: &str| -> Result<()> {
        if v.dtype.is_int() {
            Ok(())
        } else {
            Err(f(format!("{what} must be i64 or i32, got {}", v.dtype)))
        }
    };
    let same_dtype = |a: &ValueType, b: &ValueType| -> Result<()> {
        if a.dtype == b.dtype {
            Ok(())
        } else {
            Err(f(format!(
                "input dtypes differ: {} and {}",
                a.dtype, b.dtype
            )))
        }
    };
    // A shape-deciding input that must be known on the host.
    let known = |i: usize, what: &str| -> Result<Option<Vec<i64>>> {
        // `plan_time_inputs` finds the graph inputs to plan with from that table.
        debug_assert!(shape_inputs(&node.op).iter().any(|&(k, _)| k == i));
        match (t(i), consts.get(i).copied().flatten()) {
            (None, _) => Ok(None),
            (Some(v), _) if !v.dtype.is_int() => Err(f(format!("{what} (input {i}) must be i64 or i32, got {}", v.dtype))),
            (Some(_), Some(c)) => Ok(Some(c.to_i64_vec())),
            (Some(_), None) => Err(f(format!(
                "{what} (input '{}') must be known when the plan is made (computed from initializers, Constants, Shape and the graph inputs fed when planning, through small nodes evaluated on the host), but it depends on a value that is not (one computed at run time, or a tensor too large to evaluate on the host)",
                node.inputs[i]
            ))),
        }
    };
    let one = |v: ValueType| Ok(vec![v]);
    let axes_norm = |axes: &[i64], r: usize| -> Result<Vec<usize>> {
        let mut out = vec![];
        for &a in axes {
            let Some(n) = norm_axis(a, r) else {
                return Err(f(format!("axis {a} is out of range for rank {r}")));
            };
            if out.contains(&n) {
                return Err(f(format!("axis {a} is repeated")));
            }
            out.push(n);
        }
        Ok(out)
    };

    match &node.op {
        Op::Unary(u) => {
            let ok = x.dtype.is_float() || (u.takes_ints() && x.dtype.is_int());
            if !ok {
                return Err(f(format!(
                    "{} is not defined for dtype {}",
                    node.op.name(),
                    x.dtype
                )));
            }
            one(x)
        }
        Op::Binary(b) => {
            let y = t(1).unwrap();
            let bool_in = x.dtype == DType::Bool;
            match b.kind() {
                BinaryKind::Pow => {
                    if !x.dtype.is_float() && !x.dtype.is_int()
                        || !y.dtype.is_float() && !y.dtype.is_int()
                    {
                        return Err(f("Pow takes numeric inputs".into()));
                    }
                }
                BinaryKind::Logic => {
                    same_dtype(&x, y)?;
                    if !bool_in {
                        return Err(f(format!(
                            "{} takes bool inputs, got {}",
                            node.op.name(),
                            x.dtype
                        )));
                    }
                }
                BinaryKind::Bitwise => {
                    same_dtype(&x, y)?;
                    // ONNX shifts only unsigned integers (a signed right shift would have
                    // to choose between arithmetic and logical).
                    let shift = matches!(b, BinaryOp::BitShiftLeft | BinaryOp::BitShiftRight);
                    if !x.dtype.is_int() || shift && !x.dtype.is_unsigned() {
                        let want = if shift { "unsigned integer" } else { "integer" };
                        return Err(f(format!(
                            "{} takes {want} inputs, got {}",
                            node.op.name(),
                            x.dtype
                        )));
                    }
                }
                BinaryKind::Arith | BinaryKind::Compare => {
                    same_dtype(&x, y)?;
                    if bool_in && *b != BinaryOp::Equal {
                        return Err(f(format!("{} is not defined for bool", node.op.name())));
                    }
                }
            }
            let Some(shape) = broadcast(&x.shape, &y.shape) else {
                return Err(f(format!(
                    "shapes {} and {} do not broadcast",
                    fmt_shape(&x.shape),
                    fmt_shape(&y.shape)
                )));
            };
            one(ValueType {
                dtype: if b.is_comparison() {
                    DType::Bool
                } else {
                    x.dtype
                },
                shape,
            })
        }
        Op::Clip => {
            if x.dtype == DType::Bool {
                return Err(f("Clip is not defined for bool".into()));
            }
            for i in 1..3 {
                if let Some(b) = t(i) {
                    same_dtype(&x, b)?;
                    if b.numel() != 1 {
                        return Err(f(format!(
                            "Clip's {} must be a scalar, got shape {}",
                            if i == 1 { "min" } else { "max" },
                            fmt_shape(&b.shape)
                        )));
                    }
                }
            }
            one(x)
        }
        Op::Where => {
            let (c, a, b) = (x, t(1).unwrap(), t(2).unwrap());
            if c.dtype != DType::Bool {
                return Err(f(format!("condition must be bool, got {}", c.dtype)));
            }
            same_dtype(a, b)?;
            let s = broadcast(&c.shape, &a.shape).and_then(|s| broadcast(&s, &b.shape));
            let Some(shape) = s else {
                return Err(f("shapes do not broadcast".into()));
            };
            one(ValueType {
                dtype: a.dtype,
                shape,
            })
        }
        Op::Cast { to } => one(ValueType {
            dtype: *to,
            shape: x.shape,
        }),
        Op::CastLike => one(ValueType {
            dtype: t(1).unwrap().dtype,
            shape: x.shape,
        }),
        Op::Range => {
            let mut v = [0.0; 3];
            for (i, what) in ["start", "limit", "delta"].into_iter().enumerate() {
                let ti = t(i).unwrap();
                if ti.dtype != x.dtype || ti.dtype == DType::Bool {
                    return Err(f(format!(
                        "start, limit and delta must be numbers of one dtype, got {} {what}",
                        ti.dtype
                    )));
                }
                if ti.numel() != 1 {
                    return Err(f(format!(
                        "{what} must be a scalar, got shape {}",
                        fmt_shape(&ti.shape)
                    )));
                }
                let Some(c) = consts.get(i).copied().flatten() else {
                    return Err(f(format!(
                        "{what} (input '{}') must be known when the plan is made: it decides the output's length",
                        node.inputs[i]
                    )));
                };
                v[i] = c.to_f64_vec()[0];
            }
            let [start, limit, delta] = v;
            if delta == 0.0 || !delta.is_finite() || !start.is_finite() || !limit.is_finite() {
                return Err(f(format!(
                    "Range({start}, {limit}, {delta}) has no length: delta must be non-zero and every value finite"
                )));
            }
            let n = ((limit - start) / delta).ceil().max(0.0);
            if n > (1u64 << 48) as f64 {
                return Err(f(format!(
                    "Range({start}, {limit}, {delta}) has {n} elements"
                )));
            }
            one(ValueType {
                dtype: x.dtype,
                shape: vec![n as usize],
            })
        }
        Op::NonZero | Op::Unique { .. } => {
            // The outputs' shapes are the op's result itself: computed here from X's
            // value, which must be known on the host.
            let Some(v) = consts.first().copied().flatten() else {
                return Err(f(format!(
                    "input X ('{}') must be known when the plan is made: its values decide the output's shape, so it must be computed from initializers, Constants, Shape and graph inputs fed when planning (at most {} elements), through small nodes evaluated on the host; here it depends on a value computed on the device (or one too large to evaluate on the host)",
                    node.inputs[0],
                    crate::exec::PLAN_INPUT_LIMIT
                )));
            };
            let outs = crate::backends::cpu::eval_data_shaped(&node.op, v).map_err(f)?;
            Ok(outs
                .iter()
                .take(node.outputs.len())
                .map(|t| ValueType::new(t.dtype(), t.shape()))
                .collect())
        }
        Op::ResizeMatrix { .. } => {
            let outs = resize_values(node, ins, consts).map_err(f)?;
            Ok(outs
                .iter()
                .take(node.outputs.len())
                .map(|t| ValueType::new(t.dtype(), t.shape()))
                .collect())
        }
        Op::Identity => one(x),
        Op::MatMul => {
            let b = t(1).unwrap();
            need_float(&x, "A")?;
            same_dtype(&x, b)?;
            let Some(shape) = matmul_shape(&x.shape, &b.shape) else {
                return Err(f(format!(
                    "cannot multiply {} by {}",
                    fmt_shape(&x.shape),
                    fmt_shape(&b.shape)
                )));
            };
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Gemm {
            trans_a, trans_b, ..
        } => {
            let b = t(1).unwrap();
            need_float(&x, "A")?;
            same_dtype(&x, b)?;
            if x.shape.len() != 2 || b.shape.len() != 2 {
                return Err(f("Gemm takes 2-D A and B".into()));
            }
            let (m, k) = if *trans_a {
                (x.shape[1], x.shape[0])
            } else {
                (x.shape[0], x.shape[1])
            };
            let (k2, n) = if *trans_b {
                (b.shape[1], b.shape[0])
            } else {
                (b.shape[0], b.shape[1])
            };
            if k != k2 {
                return Err(f(format!("inner dimensions differ: {k} and {k2}")));
            }
            if let Some(c) = t(2) {
                same_dtype(&x, c)?;
                if broadcast(&c.shape, &[m, n]).as_deref() != Some(&[m, n][..]) {
                    return Err(f(format!(
                        "C of shape {} does not broadcast to [{m}, {n}]",
                        fmt_shape(&c.shape)
                    )));
                }
            }
            one(ValueType {
                dtype: x.dtype,
                shape: vec![m, n],
            })
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            need_float(&x, "input")?;
            if norm_axis(*axis, x.shape.len()).is_none() {
                return Err(f(format!(
                    "axis {axis} is out of range for rank {}",
                    x.shape.len()
                )));
            }
            one(x)
        }
        Op::LayerNormalization { axis, .. } => {
            need_float(&x, "X")?;
            let r = x.shape.len();
            let Some(a) = norm_axis(*axis, r) else {
                return Err(f(format!("axis {axis} is out of range for rank {r}")));
            };
            let norm = &x.shape[a..];
            for i in 1..3 {
                if let Some(s) = t(i) {
                    same_dtype(&x, s)?;
                    if broadcast(&s.shape, norm).as_deref() != Some(norm) {
                        return Err(f(format!(
                            "{} of shape {} does not broadcast to the normalized shape {}",
                            if i == 1 { "Scale" } else { "B" },
                            fmt_shape(&s.shape),
                            fmt_shape(norm)
                        )));
                    }
                }
            }
            let mut stat = x.shape.clone();
            for d in &mut stat[a..] {
                *d = 1;
            }
            let sd = stat_dtype(x.dtype);
            let mut out = vec![x.clone()];
            for _ in 1..node.outputs.len() {
                out.push(ValueType {
                    dtype: sd,
                    shape: stat.clone(),
                });
            }
            Ok(out)
        }
        Op::Reduce {
            kind,
            axes,
            keepdims,
            noop_with_empty_axes,
        } => {
            // ONNX defines all three on floats and ints (an int mean truncates); the
            // internal mean of squares only exists for floats.
            if x.dtype == DType::Bool
                || (*kind == crate::graph::ReduceKind::MeanSquare && !x.dtype.is_float())
            {
                return Err(f(format!(
                    "{} is not defined for {}",
                    node.op.name(),
                    x.dtype
                )));
            }
            let r = x.shape.len();
            let axes = match (axes.clone(), known(1, "axes")?) {
                (Some(_), Some(_)) => {
                    return Err(f("axes given both as attribute and as input".into()))
                }
                (Some(a), None) | (None, Some(a)) => a.clone(),
                (None, None) => vec![],
            };
            if axes.is_empty() && *noop_with_empty_axes {
                return one(x);
            }
            let axes = if axes.is_empty() {
                (0..r).collect()
            } else {
                axes_norm(&axes, r)?
            };
            let mut shape = vec![];
            for (i, &d) in x.shape.iter().enumerate() {
                if axes.contains(&i) {
                    // An empty axis is allowed: ONNX (opset 18) defines ReduceMax of
                    // nothing as the lowest value (-inf), as the kernels' identity gives.
                    if *keepdims {
                        shape.push(1);
                    }
                } else {
                    shape.push(d);
                }
            }
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Reshape { allowzero } => {
            let spec = known(1, "shape")?.unwrap();
            let mut shape = vec![];
            let mut infer_at = None;
            for (i, &d) in spec.iter().enumerate() {
                match d {
                    -1 if infer_at.is_none() => {
                        infer_at = Some(i);
                        shape.push(1);
                    }
                    -1 => return Err(f(format!("shape {spec:?} has more than one -1"))),
                    0 if !allowzero => match x.shape.get(i) {
                        Some(&s) => shape.push(s),
                        None => return Err(f(format!("shape {spec:?}: 0 at position {i} copies an input dim that does not exist"))),
                    },
                    d if d < 0 => return Err(f(format!("shape {spec:?} has invalid dim {d}"))),
                    d => shape.push(d as usize),
                }
            }
            let total = x.numel();
            if let Some(i) = infer_at {
                let rest: usize = shape
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| *j != i)
                    .map(|(_, d)| *d)
                    .product();
                if rest == 0 || total % rest != 0 {
                    return Err(f(format!(
                        "cannot reshape {} ({} elements) to {spec:?}",
                        fmt_shape(&x.shape),
                        total
                    )));
                }
                shape[i] = total / rest;
            }
            if crate::tensor::checked_numel(&shape) != Some(total) {
                return Err(f(format!(
                    "cannot reshape {} ({} elements) to {spec:?}",
                    fmt_shape(&x.shape),
                    total
                )));
            }
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Transpose { perm } => {
            let r = x.shape.len();
            let perm: Vec<usize> = perm.clone().unwrap_or_else(|| (0..r).rev().collect());
            if perm.len() != r {
                return Err(f(format!(
                    "perm {perm:?} has {} entries for rank {r}",
                    perm.len()
                )));
            }
            one(ValueType {
                dtype: x.dtype,
                shape: perm.iter().map(|&p| x.shape[p]).collect(),
            })
        }
        Op::Concat { axis } => {
            let r = x.shape.len();
            let Some(a) = norm_axis(*axis, r) else {
                return Err(f(format!("axis {axis} is out of range for rank {r}")));
            };
            let mut shape = x.shape.clone();
            shape[a] = 0;
            for (i, v) in ins.iter().enumerate() {
                let Some(v) = v else {
                    return Err(f(format!("input {i} is omitted")));
                };
                same_dtype(&x, v)?;
                let ok = v.shape.len() == r && (0..r).all(|d| d == a || v.shape[d] == x.shape[d]);
                if !ok {
                    return Err(f(format!(
                        "input {i} of shape {} does not match {} outside axis {a}",
                        fmt_shape(&v.shape),
                        fmt_shape(&x.shape)
                    )));
                }
                shape[a] += v.shape[a];
            }
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Split {
            axis,
            split,
            num_outputs,
        } => {
            let r = x.shape.len();
            let Some(a) = norm_axis(*axis, r) else {
                return Err(f(format!("axis {axis} is out of range for rank {r}")));
            };
            let d = x.shape[a];
            let n_out = node.outputs.len();
            let sizes: Vec<usize> = match (split.clone(), known(1, "split")?) {
                (Some(_), Some(_)) => {
                    return Err(f("split given both as attribute and as input".into()))
                }
                (Some(s), None) | (None, Some(s)) => {
                    if s.iter().any(|&v| v < 0)
                        || s.iter().sum::<i64>() != d as i64
                        || s.len() != n_out
                    {
                        return Err(f(format!(
                            "split {s:?} must have {n_out} non-negative sizes summing to {d}"
                        )));
                    }
                    s.iter().map(|&v| v as usize).collect()
                }
                (None, None) => {
                    let n = num_outputs.unwrap_or(n_out);
                    if n != n_out {
                        return Err(f(format!(
                            "num_outputs is {n} but the node has {n_out} outputs"
                        )));
                    }
                    // ONNX: equal chunks of ceil(d/n), the last one smaller.
                    let chunk = d.div_ceil(n);
                    let sizes: Vec<usize> = (0..n)
                        .map(|i| chunk.min(d.saturating_sub(i * chunk)))
                        .collect();
                    if num_outputs.is_none() && d % n != 0 {
                        return Err(f(format!(
                            "axis {a} of size {d} does not split evenly into {n} outputs"
                        )));
                    }
                    sizes
                }
            };
            Ok(sizes
                .iter()
                .map(|&s| {
                    let mut sh = x.shape.clone();
                    sh[a] = s;
                    ValueType {
                        dtype: x.dtype,
                        shape: sh,
                    }
                })
                .collect())
        }
        Op::Slice => {
            let r = x.shape.len();
            let starts = known(1, "starts")?.unwrap();
            let ends = known(2, "ends")?.unwrap();
            let axes = known(3, "axes")?.unwrap_or_else(|| (0..starts.len() as i64).collect());
            let steps = known(4, "steps")?.unwrap_or_else(|| vec![1; starts.len()]);
            if ends.len() != starts.len()
                || axes.len() != starts.len()
                || steps.len() != starts.len()
            {
                return Err(f(
                    "starts, ends, axes and steps must have the same length".into()
                ));
            }
            let axes = axes_norm(&axes, r)?;
            let mut shape = x.shape.clone();
            for (k, &a) in axes.iter().enumerate() {
                let (s, e) = slice_range(starts[k], ends[k], steps[k], x.shape[a]).map_err(&f)?;
                // i128: hostile steps like i64::MIN must not overflow.
                let (s, e, st) = (s as i128, e as i128, steps[k] as i128);
                shape[a] = if st > 0 {
                    if e > s {
                        ((e - s + st - 1) / st) as usize
                    } else {
                        0
                    }
                } else if s > e {
                    ((s - e - st - 1) / (-st)) as usize
                } else {
                    0
                };
            }
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Squeeze { axes } => {
            let r = x.shape.len();
            let axes = match (axes.clone(), known(1, "axes")?) {
                (Some(a), None) | (None, Some(a)) => Some(a.clone()),
                (None, None) => None,
                _ => return Err(f("axes given both as attribute and as input".into())),
            };
            let shape = match axes {
                None => x.shape.iter().copied().filter(|&d| d != 1).collect(),
                Some(a) => {
                    let a = axes_norm(&a, r)?;
                    for &i in &a {
                        if x.shape[i] != 1 {
                            return Err(f(format!(
                                "cannot squeeze axis {i} of size {}",
                                x.shape[i]
                            )));
                        }
                    }
                    x.shape
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| !a.contains(i))
                        .map(|(_, &d)| d)
                        .collect()
                }
            };
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Unsqueeze { axes } => {
            let axes = match (axes.clone(), known(1, "axes")?) {
                (Some(a), None) | (None, Some(a)) => a.clone(),
                (None, None) => return Err(f("Unsqueeze needs axes (attribute or input)".into())),
                _ => return Err(f("axes given both as attribute and as input".into())),
            };
            let r = x.shape.len() + axes.len();
            let a = axes_norm(&axes, r)?;
            let mut src = x.shape.iter();
            let shape = (0..r)
                .map(|i| {
                    if a.contains(&i) {
                        1
                    } else {
                        *src.next().unwrap()
                    }
                })
                .collect();
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Flatten { axis } => {
            let r = x.shape.len() as i64;
            let a = if *axis < 0 { axis + r } else { *axis };
            if a < 0 || a > r {
                return Err(f(format!("axis {axis} is out of range for rank {r}")));
            }
            let a = a as usize;
            let shape = vec![x.shape[..a].iter().product(), x.shape[a..].iter().product()];
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Expand => {
            let s = known(1, "shape")?.unwrap();
            if s.iter().any(|&d| d < 0) {
                return Err(f(format!("shape {s:?} has a negative dim")));
            }
            let s: Vec<usize> = s.iter().map(|&d| d as usize).collect();
            let Some(shape) = broadcast(&x.shape, &s) else {
                return Err(f(format!(
                    "cannot expand {} to {}",
                    fmt_shape(&x.shape),
                    fmt_shape(&s)
                )));
            };
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Gather { axis } => {
            let idx = t(1).unwrap();
            need_int(idx, "indices")?;
            let r = x.shape.len();
            let Some(a) = norm_axis(*axis, r) else {
                return Err(f(format!("axis {axis} is out of range for rank {r}")));
            };
            // Indices known when planning (Compress's, from NonZero) are checked here, so
            // every backend refuses an out-of-range one: device kernels cannot report it.
            if let Some(c) = consts.get(1).copied().flatten() {
                let d = x.shape[a] as i64;
                if let Some(i) = c.to_i64_vec().into_iter().find(|&i| i < -d || i >= d) {
                    return Err(f(format!(
                        "index {i} is out of range for axis {a} of size {d}"
                    )));
                }
            }
            let mut shape = x.shape[..a].to_vec();
            shape.extend_from_slice(&idx.shape);
            shape.extend_from_slice(&x.shape[a + 1..]);
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::GatherElements { axis } => {
            let idx = t(1).unwrap();
            need_int(idx, "indices")?;
            let r = x.shape.len();
            let Some(a) = norm_axis(*axis, r) else {
                return Err(f(format!("axis {axis} is out of range for rank {r}")));
            };
            let fits = idx.shape.len() == r && (0..r).all(|d| d == a || idx.shape[d] <= x.shape[d]);
            if !fits {
                return Err(f(format!(
                    "indices {} must have data's rank and fit in data {} off axis {a}",
                    fmt_shape(&idx.shape),
                    fmt_shape(&x.shape)
                )));
            }
            one(ValueType {
                dtype: x.dtype,
                shape: idx.shape.clone(),
            })
        }
        Op::GatherND { batch_dims: b } => {
            let idx = t(1).unwrap();
            need_int(idx, "indices")?;
            let (r, q) = (x.shape.len(), idx.shape.len());
            let k = idx.shape.last().copied().unwrap_or(0);
            let ok = q >= 1 && *b < q.min(r) && k <= r - b && idx.shape[..*b] == x.shape[..*b];
            if !ok {
                return Err(f(format!(
                    "indices {} do not index data {} with batch_dims {b} (indices' last dim at most rank - batch_dims, their batch dims data's)",
                    fmt_shape(&idx.shape),
                    fmt_shape(&x.shape)
                )));
            }
            let mut shape = idx.shape[..q - 1].to_vec();
            shape.extend_from_slice(&x.shape[b + k..]);
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::ScatterElements { .. } | Op::ScatterND { .. } => {
            let (idx, upd) = (t(1).unwrap(), t(2).unwrap());
            same_dtype(&x, upd)?;
            // Updates land where the matching gather would read: that gather's output type.
            let gather = match &node.op {
                Op::ScatterElements { axis, .. } => Op::GatherElements { axis: *axis },
                _ => Op::GatherND { batch_dims: 0 },
            };
            let read = infer_forward(node, gather, &[Some(&x), Some(idx)], &[None, None])?;
            if read[0].shape != upd.shape {
                return Err(f(format!(
                    "updates {} must have the shape {} that indices {} pick from data {}",
                    fmt_shape(&upd.shape),
                    fmt_shape(&read[0].shape),
                    fmt_shape(&idx.shape),
                    fmt_shape(&x.shape)
                )));
            }
            one(x)
        }
        Op::Pad { mode } => {
            let r = x.shape.len();
            let pads = known(1, "pads")?.unwrap_or_default();
            let axes = known(3, "axes")?;
            let pairs = pad_pairs(r, &pads, axes.as_deref()).map_err(&f)?;
            if let Some(c) = t(2) {
                same_dtype(&x, c)?;
                if c.numel() != 1 {
                    return Err(f(format!(
                        "constant_value must have one element, got shape {}",
                        fmt_shape(&c.shape)
                    )));
                }
            }
            let shape = pad_shape(&x.shape, &pairs, 1).map_err(&f)?;
            if *mode != PadMode::Constant {
                if let Some(d) =
                    (0..r).find(|&d| pairs[d] != (0, 0) && pad_kept(x.shape[d], pairs[d]) == 0)
                {
                    return Err(f(format!(
                        "{} padding of axis {d} needs at least one element left, and it has none",
                        mode.name()
                    )));
                }
            }
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Im2Col { kernel, window, .. } => {
            let k = window_dims(kernel, known(1, "kernel_shape")?, "kernel_shape").map_err(f)?;
            let shape = super::window::im2col_shape(window, &x.shape, &k).map_err(f)?;
            one(ValueType::new(x.dtype, &shape))
        }
        Op::Col2Im { block, window } => {
            need_float(&x, "the columns")?;
            let image = known(1, "image_shape")?.unwrap_or_default();
            let block = window_dims(block, known(2, "block_shape")?, "block_shape").map_err(f)?;
            let shape = super::window::col2im_shape(window, &x.shape, &image, &block).map_err(f)?;
            one(ValueType::new(x.dtype, &shape))
        }
        Op::PadGrad { .. } => {
            need_float(&x, "dY")?;
            let r = x.shape.len();
            let pads = known(1, "pads")?.unwrap_or_default();
            let axes = known(2, "axes")?;
            let pairs = pad_pairs(r, &pads, axes.as_deref()).map_err(&f)?;
            one(ValueType {
                dtype: x.dtype,
                shape: pad_shape(&x.shape, &pairs, -1).map_err(&f)?,
            })
        }
        Op::Shape { start, end } => {
            let (s, e) = shape_range(*start, *end, x.shape.len());
            one(ValueType {
                dtype: DType::I64,
                shape: vec![e - s],
            })
        }
        Op::Constant { value } => one(ValueType::new(value.dtype(), value.shape())),
        Op::Cumulative { .. } => {
            let axis = t(1).unwrap();
            need_int(axis, "axis")?;
            let name = node.op.name();
            if axis.numel() != 1 || x.dtype == DType::Bool {
                return Err(f(format!(
                    "{name} takes numbers and a one-element axis, got {} and axis {}",
                    x.dtype,
                    fmt_shape(&axis.shape)
                )));
            }
            if x.shape.is_empty() {
                return Err(f(format!("{name} needs rank 1 or more")));
            }
            one(x)
        }
        Op::ArgReduce { axis, keepdims, .. } => {
            if x.dtype == DType::Bool {
                return Err(f(format!("{} takes numbers, got bool", node.op.name())));
            }
            let r = x.shape.len();
            let Some(a) = norm_axis(*axis, r) else {
                return Err(f(format!("axis {axis} is out of range for rank {r}")));
            };
            // Nothing to pick from (the ONNX reference fails too), unless nothing is asked.
            let others: usize = (0..r).filter(|&d| d != a).map(|d| x.shape[d]).product();
            if x.shape[a] == 0 && others > 0 {
                return Err(f(format!(
                    "{} over axis {a} of size 0 has no element to pick",
                    node.op.name()
                )));
            }
            let mut shape = x.shape.clone();
            if *keepdims {
                shape[a] = 1;
            } else {
                shape.remove(a);
            }
            one(ValueType {
                dtype: DType::I64,
                shape,
            })
        }
        Op::TopK { axis, .. } => {
            if x.dtype == DType::Bool {
                return Err(f("TopK takes numbers, got bool".into()));
            }
            let r = x.shape.len();
            let Some(a) = norm_axis(*axis, r) else {
                return Err(f(format!("axis {axis} is out of range for rank {r}")));
            };
            let k = known(1, "k")?.unwrap_or_default();
            let [k] = k[..] else {
                return Err(f(format!("k must hold one value, got {}", k.len())));
            };
            if k < 0 || k as usize > x.shape[a] {
                return Err(f(format!(
                    "k = {k} is not in [0, {}] (the size of axis {a})",
                    x.shape[a]
                )));
            }
            let mut shape = x.shape.clone();
            shape[a] = k as usize;
            Ok(vec![
                ValueType::new(x.dtype, &shape),
                ValueType::new(DType::I64, &shape),
            ])
        }
        Op::Trilu { .. } => {
            if x.shape.len() < 2 {
                return Err(f("Trilu needs rank 2 or more".into()));
            }
            if let Some(k) = t(1) {
                need_int(k, "k")?;
                if k.numel() != 1 {
                    return Err(f("k must be a scalar".into()));
                }
            }
            one(x)
        }
        Op::SoftmaxCrossEntropyLoss { reduction, .. } => {
            let labels = t(1).unwrap();
            need_float(&x, "scores")?;
            need_int(labels, "labels")?;
            if x.shape.len() < 2 {
                return Err(f(format!(
                    "scores must be [N, C, ...], got {}",
                    fmt_shape(&x.shape)
                )));
            }
            let mut want: Vec<usize> = vec![x.shape[0]];
            want.extend_from_slice(&x.shape[2..]);
            if labels.shape != want {
                return Err(f(format!(
                    "labels must have shape {} for scores {}, got {}",
                    fmt_shape(&want),
                    fmt_shape(&x.shape),
                    fmt_shape(&labels.shape)
                )));
            }
            if let Some(w) = t(2) {
                same_dtype(&x, w)?;
                if w.shape != [x.shape[1]] {
                    return Err(f(format!(
                        "weights must have shape [{}], got {}",
                        x.shape[1],
                        fmt_shape(&w.shape)
                    )));
                }
            }
            let loss = match reduction {
                LossReduction::None => ValueType {
                    dtype: x.dtype,
                    shape: want,
                },
                _ => ValueType::new(x.dtype, &[]),
            };
            let mut out = vec![loss];
            if node.outputs.len() > 1 {
                out.push(x.clone());
            }
            Ok(out)
        }
        Op::Dropout { .. } => {
            need_float(&x, "data")?;
            if let Some(r) = t(1) {
                need_float(r, "ratio")?;
                if r.numel() != 1 {
                    return Err(f(format!(
                        "ratio must be a scalar, got shape {}",
                        fmt_shape(&r.shape)
                    )));
                }
            }
            if let Some(m) = t(2) {
                if m.dtype != DType::Bool || m.numel() != 1 {
                    return Err(f("training_mode must be a bool scalar".into()));
                }
            }
            let mut out = vec![x.clone()];
            if node.outputs.len() > 1 {
                out.push(ValueType {
                    dtype: DType::Bool,
                    shape: x.shape.clone(),
                });
            }
            Ok(out)
        }
        Op::FusedMatMul { trans_b, .. } => {
            let b = t(1).unwrap();
            need_float(&x, "A")?;
            same_dtype(&x, b)?;
            if b.shape.len() < 2 || x.shape.len() < 2 {
                return Err(f(
                    "FusedMatMul takes A [..., M, K] and B [K, N] (or batched)".into(),
                ));
            }
            let mut bs = b.shape.clone();
            if *trans_b {
                let n = bs.len();
                bs.swap(n - 1, n - 2);
            }
            let Some(shape) = matmul_shape(&x.shape, &bs) else {
                return Err(f(format!(
                    "cannot multiply {} by {}{}",
                    fmt_shape(&x.shape),
                    fmt_shape(&b.shape),
                    if *trans_b { "ᵀ" } else { "" }
                )));
            };
            let n = *shape.last().unwrap();
            if let Some(bias) = t(2) {
                same_dtype(&x, bias)?;
                if bias.shape != [n] {
                    return Err(f(format!(
                        "bias must have shape [{n}], got {}",
                        fmt_shape(&bias.shape)
                    )));
                }
            }
            if let Some(res) = t(3) {
                same_dtype(&x, res)?;
                if broadcast(&res.shape, &shape).as_deref() != Some(&shape[..]) {
                    return Err(f(format!(
                        "residual of shape {} does not broadcast to {}",
                        fmt_shape(&res.shape),
                        fmt_shape(&shape)
                    )));
                }
            }
            let y = ValueType {
                dtype: x.dtype,
                shape,
            };
            Ok(vec![y; node.outputs.len()])
        }
        Op::Attention { .. } => {
            let [q, k, v] = attn_qkv(&node.op, ins, 0).map_err(&f)?;
            need_float(&x, "Q")?;
            same_dtype(&x, &k)?;
            same_dtype(&x, &v)?;
            let a = AttnDims::new(&node.op, &q.shape, &k.shape, &v.shape).map_err(&f)?;
            if let Some(m) = t(3) {
                if m.dtype != DType::Bool && m.dtype != x.dtype {
                    return Err(f(format!(
                        "attn_mask must be bool or {}, got {}",
                        x.dtype, m.dtype
                    )));
                }
                let full = [a.b, a.hq, a.sq, a.skv];
                if broadcast(&m.shape, &full).as_deref() != Some(&full[..]) {
                    return Err(f(format!(
                        "attn_mask of shape {} does not broadcast to {}",
                        fmt_shape(&m.shape),
                        fmt_shape(&full)
                    )));
                }
            }
            let mut out = vec![ValueType {
                dtype: x.dtype,
                shape: a.y_shape(),
            }];
            if node.outputs.len() > 1 {
                out.push(ValueType::new(stat_dtype(x.dtype), &[a.b, a.hq, a.sq]));
            }
            Ok(out)
        }
        Op::VarlenAttention { .. } => {
            let (k, v, cq, ck) = (t(1).unwrap(), t(2).unwrap(), t(3).unwrap(), t(4).unwrap());
            need_float(&x, "Q")?;
            same_dtype(&x, k)?;
            same_dtype(&x, v)?;
            if x.shape.len() != 3 || k.shape.len() != 3 || v.shape.len() != 3 {
                return Err(f(
                    "VarlenAttention takes Q [Tq, Hq, D], K and V [Tk, Hkv, D]".into(),
                ));
            }
            let (hq, d, hkv) = (x.shape[1], x.shape[2], k.shape[1]);
            if k.shape[2] != d || v.shape[0] != k.shape[0] || v.shape[1] != hkv {
                return Err(f("Q, K and V shapes disagree".into()));
            }
            if hkv == 0 || hq % hkv != 0 {
                return Err(f(format!(
                    "query heads {hq} must be a multiple of key/value heads {hkv}"
                )));
            }
            need_int(cq, "cu_seqlens_q")?;
            need_int(ck, "cu_seqlens_k")?;
            if cq.shape.len() != 1 || cq.shape != ck.shape || cq.shape[0] == 0 {
                return Err(f("cu_seqlens_q and cu_seqlens_k must both be [B+1]".into()));
            }
            let mut out = vec![ValueType {
                dtype: x.dtype,
                shape: vec![x.shape[0], hq, v.shape[2]],
            }];
            if node.outputs.len() > 1 {
                out.push(ValueType::new(stat_dtype(x.dtype), &[x.shape[0], hq]));
            }
            Ok(out)
        }
        Op::UnaryGrad(u) => {
            // dY and X: the types the forward op took and gave.
            let xt = t(1).unwrap();
            need_float(xt, "X")?;
            let fwd = infer_forward(node, Op::Unary(*u), &[Some(xt)], &[None])?;
            need_grad(node, ins, &x, &fwd[0])?;
            one(xt.clone())
        }
        Op::SoftmaxGrad { axis, log } => {
            let y = t(1).unwrap();
            let op = if *log {
                Op::LogSoftmax { axis: *axis }
            } else {
                Op::Softmax { axis: *axis }
            };
            let fwd = infer_forward(node, op, &[Some(y)], &[None])?;
            need_grad(node, ins, &x, &fwd[0])?;
            one(y.clone())
        }
        Op::LayerNormalizationGrad { axis } => {
            let (xt, scale, mean, inv) =
                (t(1).unwrap(), t(2).unwrap(), t(3).unwrap(), t(4).unwrap());
            let op = Op::LayerNormalization {
                axis: *axis,
                epsilon: 1e-5,
            };
            let fwd = infer_forward(node, op, &[Some(xt), Some(scale)], &[None, None])?;
            need_grad(node, ins, &x, &fwd[0])?;
            let a = norm_axis(*axis, xt.shape.len()).unwrap();
            let mut stat = xt.shape.clone();
            for d in &mut stat[a..] {
                *d = 1;
            }
            for (v, what) in [(mean, "Mean"), (inv, "InvStdDev")] {
                if v.shape != stat || v.dtype != stat_dtype(xt.dtype) {
                    return Err(f(format!(
                        "{what} must be {}{}, got {v}",
                        stat_dtype(xt.dtype),
                        fmt_shape(&stat)
                    )));
                }
            }
            // Input 5 (from the `ln_grad_residual` rule): a gradient added onto dX.
            if let Some(r) = t(5).filter(|r| *r != xt) {
                return Err(f(format!("the residual gradient must be {xt}, got {r}")));
            }
            let p = ValueType::new(xt.dtype, &xt.shape[a..]);
            Ok(vec![xt.clone(), p.clone(), p][..node.outputs.len()].to_vec())
        }
        Op::SoftmaxCrossEntropyLossGrad {
            reduction,
            ignore_index,
        } => {
            let op = Op::SoftmaxCrossEntropyLoss {
                reduction: *reduction,
                ignore_index: *ignore_index,
            };
            let fwd = infer_forward(node, op, &ins[1..], &consts[1..])?;
            need_grad(node, ins, &x, &fwd[0])?;
            one(t(1).unwrap().clone())
        }
        Op::GatherGrad { axis } => {
            let shape = grad_shape(node, ins, consts, 2)?;
            let data = ValueType::new(x.dtype, &shape);
            let fwd = infer_forward(
                node,
                Op::Gather { axis: *axis },
                &[Some(&data), t(1)],
                &[None, None],
            )?;
            need_grad(node, ins, &x, &fwd[0])?;
            one(data)
        }
        Op::GatherElementsGrad { .. } | Op::GatherNDGrad { .. } => {
            let shape = grad_shape(node, ins, consts, 2)?;
            let data = ValueType::new(x.dtype, &shape);
            let fwd_op = node.op.grad_base().expect("a gradient op");
            let fwd = infer_forward(node, fwd_op, &[Some(&data), t(1)], &[None, None])?;
            need_grad(node, ins, &x, &fwd[0])?;
            one(data)
        }
        Op::SliceGrad => {
            let shape = grad_shape(node, ins, consts, 1)?;
            let data = ValueType::new(x.dtype, &shape);
            let mut fins = vec![Some(&data)];
            fins.extend_from_slice(&ins[2..]);
            let mut fconsts = vec![None];
            fconsts.extend_from_slice(&consts[2..]);
            let fwd = infer_forward(node, Op::Slice, &fins, &fconsts)?;
            need_grad(node, ins, &x, &fwd[0])?;
            one(data)
        }
        Op::FusedMatMulGrad {
            activation,
            trans_b,
            a_activation,
        } => {
            let (a, b) = (t(1).unwrap(), t(2).unwrap());
            // PreA: the Pre at which dA's activation derivative is taken, A's type.
            match t(4) {
                Some(p) if p != a => return Err(f(format!("PreA must be {a}, got {p}"))),
                None if *a_activation != Activation::None => {
                    return Err(f(format!(
                        "a_activation {} needs A's pre-activation (input 4)",
                        a_activation.name()
                    )))
                }
                Some(_) if *a_activation == Activation::None => {
                    return Err(f("PreA (input 4) needs an a_activation".into()))
                }
                _ => {}
            }
            let op = Op::FusedMatMul {
                activation: *activation,
                trans_b: *trans_b,
            };
            let fwd = infer_forward(node, op, &[Some(a), Some(b)], &[None, None])?;
            need_grad(node, ins, &x, &fwd[0])?;
            match t(3) {
                Some(pre) if *pre != fwd[0] => {
                    return Err(f(format!("Pre must be {}, got {pre}", fwd[0])))
                }
                None if *activation != Activation::None => {
                    return Err(f(format!(
                        "activation {} needs the forward's pre-activation (input 3)",
                        activation.name()
                    )))
                }
                _ => {}
            }
            // dBiasA is dA's row sum: it needs dA.
            if node.outputs.get(3).is_some_and(|o| !o.is_empty()) && node.outputs[0].is_empty() {
                return Err(f("dBiasA (output 3) needs dA (output 0)".into()));
            }
            let n = *fwd[0].shape.last().unwrap();
            let k = *a.shape.last().unwrap();
            Ok(vec![
                a.clone(),
                b.clone(),
                ValueType::new(a.dtype, &[n]),
                ValueType::new(a.dtype, &[k]),
            ][..node.outputs.len()]
                .to_vec())
        }
        Op::AttentionGrad { .. } => {
            let [q, k, v] = attn_qkv(&node.op, ins, 1).map_err(&f)?;
            let op = node.op.grad_base().expect("AttentionGrad has a forward op");
            let fwd = infer_forward(node, op, &[t(1), t(2), t(3), t(6)], &[None; 4])?;
            need_grad(node, ins, &x, &fwd[0])?;
            let a = AttnDims::new(&node.op, &q.shape, &k.shape, &v.shape).map_err(&f)?;
            let (y, lse) = (t(4).unwrap(), t(5).unwrap());
            let want = [a.b, a.hq, a.sq];
            if *y != fwd[0] || lse.shape != want || lse.dtype != stat_dtype(q.dtype) {
                return Err(f(format!(
                    "Y and LSE must be {} and {}{}, got {y} and {lse}",
                    fwd[0],
                    stat_dtype(q.dtype),
                    fmt_shape(&want)
                )));
            }
            let full = ValueType::new(q.dtype, &[a.b, a.hq, a.sq, a.skv]);
            if t(2).is_some() {
                if node.outputs.len() < 3 {
                    return Err(f(
                        "has outputs dQ, dK, dV and optionally dMask: 3 or 4".into()
                    ));
                }
                return Ok(vec![q, k, v, full][..node.outputs.len()].to_vec());
            }
            // Packed: dQKV is output 0; dK and dV are in it (their slots hold nothing).
            if node.outputs.iter().skip(1).take(2).any(|o| !o.is_empty()) {
                return Err(f(
                    "with packed QKV, dK and dV are part of dQKV (output 0): outputs 1 and 2 must be omitted".into(),
                ));
            }
            let none = ValueType::new(q.dtype, &[0]);
            let qkv = t(1).unwrap().clone();
            Ok(vec![qkv, none.clone(), none, full][..node.outputs.len()].to_vec())
        }
        Op::VarlenAttentionGrad { is_causal, scale } => {
            let (q, k, v) = (t(1).unwrap(), t(2).unwrap(), t(3).unwrap());
            let op = Op::VarlenAttention {
                is_causal: *is_causal,
                scale: *scale,
            };
            let fwd = infer_forward(node, op, &ins[1..6], &[None; 5])?;
            need_grad(node, ins, &x, &fwd[0])?;
            let (y, lse) = (t(6).unwrap(), t(7).unwrap());
            let want = [q.shape[0], q.shape[1]];
            if *y != fwd[0] || lse.shape != want || lse.dtype != stat_dtype(q.dtype) {
                return Err(f(format!(
                    "Y and LSE must be {} and {}{}, got {y} and {lse}",
                    fwd[0],
                    stat_dtype(q.dtype),
                    fmt_shape(&want)
                )));
            }
            Ok(vec![q.clone(), k.clone(), v.clone()])
        }
    }
}

/// The dtype of per-row statistics (LayerNorm's Mean/InvStdDev, attention's LSE).
pub fn stat_dtype(d: DType) -> DType {
    if d == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Infers the forward op a gradient op differentiates, on the forward's input types, so
/// a gradient op is checked by exactly the rules of its forward op.
fn infer_forward(
    node: &Node,
    op: Op,
    ins: &[Option<&ValueType>],
    consts: &[Option<&Tensor>],
) -> Result<Vec<ValueType>> {
    let fwd = Node {
        name: node.name.clone(),
        op,
        inputs: (0..ins.len()).map(|i| format!("in{i}")).collect(),
        outputs: vec!["y".into()],
        loc: node.loc.clone(),
    };
    infer_node(&fwd, ins, consts).map_err(|e| match e {
        Error::Graph(m) => Error::Graph(m.replace(
            &format!("({})", fwd.op.name()),
            &format!("({})", node.op.name()),
        )),
        e => e,
    })
}

/// A gradient op's dY must have the type of the forward output.
fn need_grad(node: &Node, ins: &[Option<&ValueType>], dy: &ValueType, y: &ValueType) -> Result<()> {
    if dy == y {
        Ok(())
    } else {
        Err(fail(
            node,
            ins,
            format!("dY must have the forward output's type {y}, got {dy}"),
        ))
    }
}

/// A gradient op's target shape input (the forward input's `Shape`), known on the host.
fn grad_shape(
    node: &Node,
    ins: &[Option<&ValueType>],
    consts: &[Option<&Tensor>],
    i: usize,
) -> Result<Vec<usize>> {
    let (Some(t), Some(c)) = (ins[i], consts.get(i).copied().flatten()) else {
        return Err(fail(
            node,
            ins,
            format!("input {i} (the forward input's shape) must be known when the plan is made"),
        ));
    };
    let v = c.to_i64_vec();
    if t.dtype != DType::I64 || t.shape.len() != 1 || v.iter().any(|&d| d < 0) {
        return Err(fail(
            node,
            ins,
            format!("input {i} must be a shape: a 1-D i64 tensor of sizes"),
        ));
    }
    Ok(v.into_iter().map(|d| d as usize).collect())
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
        _ => 0,
    }
}
