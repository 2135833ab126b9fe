//! ONNX nodes → graphrun nodes. Each ONNX node becomes one graphrun node (attributes typed
//! by `Op::parse`, as the YAML loader does), except where the imported opset gives an op
//! semantics that graphrun's opset-17 op does not have: those nodes are rewritten here
//! into exact equivalents (`lower`), and where an ONNX operator graphrun has no kernel for
//! is an exact composition of its ops (`composite`). Problems are gathered, not returned at the first, so
//! that every op graphrun lacks is named in one error (SPEC §5).

use super::proto::{attr_type as T, AttributeProto, GraphProto, NodeProto};
use super::tensor::from_proto;
use super::MIN_OPSET;
use crate::error::{Error, Result};
use crate::graph::lower::{ForeignNode, Known, Lower};
use crate::graph::op::{Attr, AttrValue, OP_NAMES};
use crate::graph::{BinaryOp, Node, Op, UnaryOp};
use crate::tensor::{DType, Tensor};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

mod attention;
mod composite;
mod control;
mod conv;
mod deform;
mod det;
mod domains;
mod index;
mod linear_attention;
mod optional;
mod sequence;
pub use sequence::element_name;
mod quant;
mod random;
mod recurrent;
mod resize;
mod roi;
mod sample;
mod spectral;
mod tfidf;
mod trees;
use composite::{COMPOSITE, MS_COMPOSITE};

/// The opset in which ONNX introduced an op, for ops newer than graphrun's oldest
/// supported opset; a model that uses one under an older opset is not valid ONNX.
fn since(op: &str) -> i64 {
    if let Some(u) = UnaryOp::ALL.iter().find(|u| u.onnx_name() == op) {
        return u.since();
    }
    if let Some(b) = BinaryOp::ALL.iter().find(|b| b.onnx_name() == op) {
        return b.since();
    }
    match op {
        "Expand" => 8,
        "QuantizeLinear" | "DequantizeLinear" => 10,
        "DynamicQuantizeLinear" => 11,
        "MatMulInteger" | "QLinearMatMul" | "ConvInteger" | "QLinearConv" => 10,
        "Where" | "MeanVarianceNormalization" | "Shrink" | "OneHot" | "EyeLike" | "Scatter" => 9,
        "NonZero" | "Compress" => 9,
        "Range" | "GatherElements" | "GatherND" | "CumSum" | "ScatterElements" | "ScatterND" => 11,
        "Unique" => 11,
        "NonMaxSuppression" => 10,
        "SoftmaxCrossEntropyLoss" | "NegativeLogLikelihoodLoss" | "Einsum" => 12,
        "CumProd" | "BitCast" => 26,
        "Trilu" => 14,
        "LayerNormalization" | "HannWindow" | "HammingWindow" | "BlackmanWindow" => 17,
        "GroupNormalization" | "BitwiseNot" | "CenterCropPad" | "Col2Im" => 18,
        "Resize" => 10,
        "LpPool" => 2,
        "Attention" | "RMSNormalization" | "RotaryEmbedding" => 23,
        "ReverseSequence" => 10,
        "CausalConvWithState" | "LinearAttention" => 27,
        "Scan" => 8,
        "DeformConv" => 19,
        "RoiAlign" => 10,
        "Det" => 11,
        "TfIdfVectorizer" => 9,
        "MelWeightMatrix" => 17,
        "GridSample" => 16,
        "MaxUnpool" => 9,
        "TensorScatter" => 24,
        "Optional" | "OptionalHasElement" | "OptionalGetElement" => 15,
        op if sequence::SEQUENCE.contains(&op) => 11,
        "DFT" | "STFT" => 17,
        "AffineGrid" => 20,
        "Bernoulli" => 15,
        _ => MIN_OPSET,
    }
}

/// The ops whose definition at opset 7 dates from opset 6 or before, by that opset
/// (ONNX's schemas: `onnx.defs.get_schema(op, 7).since_version`). Under an older opset a
/// model may use these and no others: every other op changed at opset 7 or after.
#[rustfmt::skip]
const BEFORE_OPSET_7: &[(i64, &[&str])] = &[
    (1, &[
        "ArgMax", "ArgMin", "Constant", "Conv", "ConvTranspose", "DepthToSpace", "Flatten",
        "Gather", "GlobalAveragePool", "GlobalMaxPool", "Hardmax", "Identity", "If", "LRN",
        "LogSoftmax", "Loop", "LpNormalization", "MatMul", "MaxPool", "MaxRoiPool", "Not",
        "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "ReduceL1",
        "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
        "ReduceProd", "ReduceSum", "ReduceSumSquare", "Shape", "Size", "Slice", "Softmax",
        "Softplus", "Softsign", "SpaceToDepth", "Squeeze", "TopK", "Transpose", "Unsqueeze",
    ]),
    (2, &["GlobalLpPool", "LpPool", "Pad", "Split"]),
    (4, &["Concat"]),
    (5, &["Reshape"]),
    (6, &[
        "Abs", "Cast", "Ceil", "Clip", "Elu", "Exp", "Floor", "HardSigmoid",
        "InstanceNormalization", "LeakyRelu", "Log", "Max", "Mean", "Min", "Neg",
        "Reciprocal", "Relu", "Selu", "Sigmoid", "Sqrt", "Sum", "Tanh", "Tile",
    ]),
];

/// Whether `op` under `opset` (below 7) is the op opset 7 defines.
fn same_as_opset_7(op: &str, opset: i64) -> bool {
    BEFORE_OPSET_7
        .iter()
        .any(|&(since, ops)| since <= opset && ops.contains(&op))
}

/// ONNX's variadic maps, which take one or more broadcasting inputs: the importer writes
/// them as chains of graphrun's binary ops (`lower_variadic`).
const VARIADIC: &[&str] = &["Sum", "Mean", "Min", "Max"];

/// ONNX's one-input maps on bits, which the importer writes exactly with comparisons or
/// bitwise ops (`lower_predicate`): IsNaN(x) = (x == x) == false, IsInf(x) = |x| == inf
/// (or x == ±inf for one sign), Not(x) = x == false, BitwiseNot(x) = x ^ all-ones (-1
/// cast to x's type, which wraps to every bit set).
const PREDICATES: &[&str] = &["IsNaN", "IsInf", "Not", "BitwiseNot"];

/// Ops the importer writes as graphrun's ops: ConstantOfShape(shape) is Expand(value,
/// shape), the value a one-element tensor (f32 0 by default); the reductions graphrun has
/// no kernel for are ReduceSum or ReduceMax around elementwise maps (`lower_reduce`); Tile,
/// OneHot, EyeLike, Einsum and Compress are written in `index`; Scatter (opsets 9 and 10)
/// is ScatterElements; Hardmax is a one-hot of ArgMax (`lower_hardmax`).
const REWRITTEN: &[&str] = &[
    "ConstantOfShape",
    "Compress",
    "Tile",
    "OneHot",
    "EyeLike",
    "Einsum",
    "Scatter",
    "TensorScatter",
    "Hardmax",
    "ReduceMin",
    "ReduceL1",
    "ReduceL2",
    "ReduceSumSquare",
    "ReduceLogSum",
    "ReduceLogSumExp",
];

/// graphrun's ops that are not ONNX operators: a model file in the ai.onnx domain cannot
/// name them.
const NOT_ONNX: &[&str] = &["FusedMatMul", "GatedMatMul", "VarlenAttention"];

/// Whether the importer takes op `op` of `domain` ("" or "ai.onnx" for the default one).
pub fn imports_in(domain: &str, op: &str) -> bool {
    let n = NodeProto {
        domain: domain.to_string(),
        op_type: op.to_string(),
        ..Default::default()
    };
    lacked(&n).is_none()
}

/// Whether the importer takes ONNX op `op` of the default domain: one of graphrun's ops, or
/// one it writes as graphrun's ops.
pub fn imports(op: &str) -> bool {
    [
        OP_NAMES.as_slice(),
        VARIADIC,
        PREDICATES,
        REWRITTEN,
        COMPOSITE,
        conv::WINDOWED,
        quant::QUANT,
        &[linear_attention::LINEAR_ATTENTION],
        control::CONTROL,
        &[deform::DEFORM_CONV, roi::ROI_ALIGN, det::DET, tfidf::TFIDF],
        resize::RESIZE,
        recurrent::RECURRENT,
        &[recurrent::REVERSE_SEQUENCE],
        optional::OPTIONAL,
        sequence::SEQUENCE,
    ]
    .iter()
    .any(|list| list.contains(&op))
        && !NOT_ONNX.contains(&op)
}

/// The op of `n` ("Op" or "domain::Op") when the importer does not take it.
fn lacked(n: &NodeProto) -> Option<String> {
    let op = n.op_type.as_str();
    if n.domain.is_empty() || n.domain == "ai.onnx" {
        (!imports(op)).then(|| op.to_string())
    } else {
        let taken = (n.domain == "com.microsoft" && MS_COMPOSITE.contains(&op))
            || domains::writes(&n.domain, op)
            || control::is_flex(n);
        (!taken).then(|| format!("{}::{op}", n.domain))
    }
}

/// An attribute as `Op::parse` takes it.
fn attr_value(a: &AttributeProto, base: &Path, what: &str) -> Result<AttrValue> {
    let err = |msg: &str| Error::Graph(format!("{what}: attribute '{}' {msg}", a.name));
    if !a.ref_attr_name.is_empty() {
        return Err(err(
            "refers to a function attribute; graphrun does not import functions",
        ));
    }
    let text =
        |b: &[u8]| String::from_utf8(b.to_vec()).map_err(|_| err("is a string that is not UTF-8"));
    Ok(match a.r#type {
        T::FLOAT => AttrValue::Float(a.f as f64),
        T::INT => AttrValue::Int(a.i),
        T::STRING => AttrValue::Str(text(&a.s)?),
        T::TENSOR => {
            let Some(t) = &a.t else {
                return Err(err("is a tensor attribute without a tensor"));
            };
            AttrValue::Tensor(from_proto(
                t,
                base,
                &format!("{what}: attribute '{}'", a.name),
            )?)
        }
        T::FLOATS => AttrValue::Floats(a.floats.iter().map(|&f| f as f64).collect()),
        T::INTS => AttrValue::Ints(a.ints.clone()),
        T::STRINGS => AttrValue::Strs(a.strings.iter().map(|s| text(s)).collect::<Result<_>>()?),
        T::GRAPH | T::GRAPHS => {
            return Err(err(
                "is a subgraph; graphrun takes subgraphs only as the bodies of If, Loop and Scan",
            ))
        }
        T::TENSORS | T::SPARSE_TENSOR | T::SPARSE_TENSORS | T::TYPE_PROTO | T::TYPE_PROTOS => {
            return Err(err(
                "has a type graphrun does not take (tensor list, sparse tensor or type)",
            ))
        }
        t => return Err(err(&format!("has no valid type (AttributeType {t})"))),
    })
}

/// Initializers with at most this many elements are kept readable (`Importer::small`).
const SMALL_INIT: i64 = 64;

/// Carries ranks the model does not declare through the ops whose first output's rank
/// follows from their inputs' ranks alone (elementwise and broadcasting ops, convolution,
/// pooling, normalization, Concat, Resize, ...), in node order. The TorchScript exporter
/// often writes no value_info, and a few lowerings (Resize's) need X's rank when the
/// node is imported. Only ranks: shapes are inferred later, on graphrun's own graph.
fn propagate_ranks(g: &GraphProto, ranks: &mut HashMap<String, usize>) {
    for n in &g.node {
        if !(n.domain.is_empty() || n.domain == "ai.onnx") {
            continue;
        }
        let Some(out) = n.output.first().filter(|o| !o.is_empty()) else {
            continue;
        };
        let given: Option<Vec<usize>> = n
            .input
            .iter()
            .filter(|i| !i.is_empty())
            .map(|i| ranks.get(i).copied())
            .collect();
        let first = n.input.first().and_then(|i| ranks.get(i).copied());
        let rank = match n.op_type.as_str() {
            "Abs"
            | "Acos"
            | "Acosh"
            | "Asin"
            | "Asinh"
            | "Atan"
            | "Atanh"
            | "Cos"
            | "Cosh"
            | "Sin"
            | "Sinh"
            | "Tan"
            | "Tanh"
            | "Ceil"
            | "Floor"
            | "Round"
            | "Sign"
            | "Erf"
            | "Exp"
            | "Log"
            | "Neg"
            | "Reciprocal"
            | "Sqrt"
            | "Not"
            | "IsNaN"
            | "IsInf"
            | "Relu"
            | "LeakyRelu"
            | "PRelu"
            | "Elu"
            | "Selu"
            | "Celu"
            | "Gelu"
            | "Mish"
            | "Sigmoid"
            | "HardSigmoid"
            | "HardSwish"
            | "Softplus"
            | "Softsign"
            | "ThresholdedRelu"
            | "Shrink"
            | "Clip"
            | "Cast"
            | "CastLike"
            | "Identity"
            | "Optional"
            | "OptionalGetElement"
            | "Dropout"
            | "Softmax"
            | "LogSoftmax"
            | "Hardmax"
            | "CumSum"
            | "Trilu"
            | "Conv"
            | "ConvTranspose"
            | "MaxPool"
            | "AveragePool"
            | "LpPool"
            | "GlobalAveragePool"
            | "GlobalMaxPool"
            | "GlobalLpPool"
            | "BatchNormalization"
            | "InstanceNormalization"
            | "GroupNormalization"
            | "LayerNormalization"
            | "RMSNormalization"
            | "LpNormalization"
            | "LRN"
            | "Resize"
            | "Upsample"
            | "Transpose"
            | "Concat"
            | "Pad"
            | "Tile"
            | "Slice"
            | "DepthToSpace"
            | "SpaceToDepth"
            | "ReverseSequence"
            | "ScatterND"
            | "ScatterElements"
            | "GatherElements"
            | "QuantizeLinear"
            | "DequantizeLinear"
            | "DynamicQuantizeLinear"
            | "ConvInteger"
            | "QLinearConv"
            | "LinearAttention" => first,
            "Add" | "Sub" | "Mul" | "Div" | "Pow" | "Mod" | "Max" | "Min" | "Sum" | "Mean"
            | "Where" | "Equal" | "Less" | "LessOrEqual" | "Greater" | "GreaterOrEqual" | "And"
            | "Or" | "Xor" | "BitwiseAnd" | "BitwiseOr" | "BitwiseXor" | "BitShift" => {
                given.and_then(|r| r.into_iter().max())
            }
            // Matrices (or stacks of them) on both sides: the stacks broadcast.
            "MatMul" | "MatMulInteger" | "QLinearMatMul" => {
                let operands = if n.op_type == "QLinearMatMul" {
                    [0, 3]
                } else {
                    [0, 1]
                };
                let r: Option<Vec<usize>> = operands
                    .iter()
                    .map(|&k| n.input.get(k).and_then(|i| ranks.get(i).copied()))
                    .collect();
                r.filter(|r| r.iter().all(|&k| k >= 2))
                    .and_then(|r| r.into_iter().max())
            }
            _ => None,
        };
        if let Some(r) = rank {
            ranks.entry(out.clone()).or_insert(r);
        }
        // Its scale and zero point are scalars.
        if n.op_type == "DynamicQuantizeLinear" {
            for o in n.output.iter().skip(1).filter(|o| !o.is_empty()) {
                ranks.entry(o.clone()).or_insert(0);
            }
        }
    }
}

/// Builds the node list, gathering every problem.
pub(super) struct Importer<'a> {
    opset: i64,
    base: &'a Path,
    nodes: Vec<Node>,
    /// Every value name in the model, so that values the importer adds are fresh.
    taken: HashSet<String>,
    /// The rank of each value whose type the model gives (inputs, initializers,
    /// value_info, outputs).
    ranks: HashMap<String, usize>,
    /// The dtype of each such value, where graphrun has it.
    dtypes: HashMap<String, crate::tensor::DType>,
    /// The dims of each such value, where the model gives them (`None`: symbolic).
    dims: HashMap<String, Vec<Option<usize>>>,
    /// The values of the small initializers (a few elements: scales, sizes), which some
    /// lowerings read to leave out work that is known to be a no-op.
    small: HashMap<String, Tensor>,
    /// Ops graphrun lacks: "Conv" or "domain::Op" → the nodes that use them.
    unsupported: BTreeMap<String, Vec<String>>,
    errors: Vec<Error>,
    /// BatchNormalization's mode whatever the node says: Some(true) training, Some(false)
    /// inference (`ImportOptions::mode`).
    pub(super) batch_norm_mode: Option<bool>,
    /// The nodes written after shape inference (the recurrences, control flow, a Resize
    /// of an X of unknown rank), in model order.
    pub(super) deferred: Vec<ForeignNode>,
    /// The bodies of the control-flow nodes kept aside: their graph attributes hold an
    /// index into this list.
    pub(super) graphs: Vec<GraphProto>,
    /// The values that are empty optionals (`optional`).
    empty: HashSet<String>,
    /// The values that are sequences, each the list of its elements' values (`sequence`).
    pub(super) seqs: HashMap<String, Vec<String>>,
}

impl<'a> Importer<'a> {
    pub(super) fn new(g: &GraphProto, opset: i64, base: &'a Path) -> Self {
        let mut taken: HashSet<String> = g.input.iter().map(|v| v.name.clone()).collect();
        taken.extend(g.initializer.iter().map(|t| t.name.clone()));
        taken.extend(g.node.iter().flat_map(|n| n.output.iter().cloned()));
        let mut ranks: HashMap<String, usize> = HashMap::new();
        let mut dtypes = HashMap::new();
        let mut dims = HashMap::new();
        let mut small = HashMap::new();
        for t in &g.initializer {
            if t.dims.iter().product::<i64>() <= SMALL_INIT && t.dims.len() <= 1 {
                if let Ok(v) = from_proto(t, base, "initializer") {
                    small.insert(t.name.clone(), v);
                }
            }
            ranks.insert(t.name.clone(), t.dims.len());
            dims.insert(
                t.name.clone(),
                t.dims.iter().map(|&d| usize::try_from(d).ok()).collect(),
            );
            if let Some(dt) = crate::tensor::DType::from_onnx(t.data_type as i64) {
                dtypes.insert(t.name.clone(), dt);
            }
        }
        let mut im = Importer {
            opset,
            base,
            nodes: vec![],
            taken,
            ranks,
            dtypes,
            dims,
            small,
            unsupported: BTreeMap::new(),
            errors: vec![],
            batch_norm_mode: None,
            deferred: vec![],
            graphs: vec![],
            empty: HashSet::new(),
            seqs: HashMap::new(),
        };
        im.declare_types(g);
        im
    }

    /// Records the types `g` declares of its values (inputs, value_info, outputs), and
    /// the ranks that follow from them through its nodes.
    pub(super) fn declare_types(&mut self, g: &GraphProto) {
        for v in g.input.iter().chain(&g.value_info).chain(&g.output) {
            let Some(t) = v.r#type.as_ref().and_then(|t| t.tensor()) else {
                continue;
            };
            if let Some(s) = &t.shape {
                self.ranks.insert(v.name.clone(), s.dim.len());
                let known = s
                    .dim
                    .iter()
                    .map(|d| d.dim_value.and_then(|v| usize::try_from(v).ok()));
                self.dims
                    .entry(v.name.clone())
                    .or_insert_with(|| known.collect());
            }
            if let Some(dt) = crate::tensor::DType::from_onnx(t.elem_type as i64) {
                self.dtypes.insert(v.name.clone(), dt);
            }
        }
        propagate_ranks(g, &mut self.ranks);
    }

    /// An importer for single nodes of a YAML model (`YamlLowering`), given what is known
    /// of the values they read.
    fn from_known<'b>(
        known: &HashMap<String, Known>,
        taken: HashSet<String>,
        base: &'b Path,
    ) -> Importer<'b> {
        let mut im = Importer {
            opset: super::MAX_OPSET,
            base,
            nodes: vec![],
            taken,
            ranks: HashMap::new(),
            dtypes: HashMap::new(),
            dims: HashMap::new(),
            small: HashMap::new(),
            unsupported: BTreeMap::new(),
            errors: vec![],
            batch_norm_mode: None,
            deferred: vec![],
            graphs: vec![],
            empty: HashSet::new(),
            seqs: HashMap::new(),
        };
        for (name, k) in known {
            im.ranks.insert(name.clone(), k.dims.len());
            im.dtypes.insert(name.clone(), k.dtype);
            im.dims.insert(name.clone(), k.dims.clone());
            if let Some(v) = k.value.as_ref().filter(|v| v.numel() as i64 <= SMALL_INIT) {
                im.small.insert(name.clone(), v.clone());
            }
        }
        im
    }

    /// The value of `v` when the model gives it: a small initializer or a Constant.
    pub(super) fn constant_value(&self, v: &str) -> Option<Tensor> {
        if v.is_empty() {
            return None;
        }
        if let Some(t) = self.small.get(v) {
            return Some(t.clone());
        }
        self.nodes.iter().rev().find_map(|n| match &n.op {
            Op::Constant { value } if n.outputs.first().is_some_and(|o| o == v) => {
                Some(value.clone())
            }
            _ => None,
        })
    }

    /// Makes a new initializer known to the nodes that read it.
    pub(super) fn declare(&mut self, name: &str, t: &Tensor) {
        self.taken.insert(name.to_string());
        self.ranks.insert(name.to_string(), t.shape().len());
        self.dims.insert(
            name.to_string(),
            t.shape().iter().map(|&d| Some(d)).collect(),
        );
        self.dtypes.insert(name.to_string(), t.dtype());
    }

    /// A value name not used anywhere in the model, derived from `base`.
    pub(super) fn fresh(&mut self, base: &str) -> String {
        let mut name = base.to_string();
        let mut k = 1;
        while self.taken.contains(&name) {
            name = format!("{base}_{k}");
            k += 1;
        }
        self.taken.insert(name.clone());
        name
    }

    /// Converts the `index`-th node of the graph.
    pub(super) fn node(&mut self, index: usize, n: &NodeProto) {
        let shown = if n.name.is_empty() {
            format!("#{index}")
        } else {
            n.name.clone()
        };
        let op_type = n.op_type.as_str();
        let default_domain = n.domain.is_empty() || n.domain == "ai.onnx";
        if let Some(key) = lacked(n) {
            self.unsupported.entry(key).or_default().push(shown);
            return;
        }
        if default_domain && self.opset < MIN_OPSET && !same_as_opset_7(op_type, self.opset) {
            self.errors.push(Error::Graph(format!(
                "node '{shown}' ({op_type}): ONNX changed {op_type} after opset {} (the model's), \
                 and graphrun implements its definitions from opset {MIN_OPSET} on; convert the \
                 model to opset {MIN_OPSET} or newer (onnx.version_converter)",
                self.opset
            )));
            return;
        }
        if default_domain && self.opset >= MIN_OPSET && self.opset < since(op_type) {
            self.errors.push(Error::Graph(format!(
                "node '{shown}' ({op_type}): {op_type} exists from opset {} on; the model imports opset {}",
                since(op_type),
                self.opset
            )));
            return;
        }
        if default_domain && self.is_sequence_node(n) {
            if let Err(e) = self.lower_sequence(n, &shown) {
                self.errors.push(e);
            }
            return;
        }
        // An If or Loop that carries sequences is written out now, while the sequences'
        // elements are known (`control`): the recurrences kept aside until shapes are
        // inferred see tensors only.
        if default_domain && matches!(op_type, "If" | "Loop") && self.carries_sequences(n) {
            let mut inputs = n.input.clone();
            let result = self
                .control_attrs(n, &shown, &mut inputs)
                .and_then(|attrs| {
                    let mut m = n.clone();
                    m.input = inputs;
                    self.lower(&m, &shown, attrs)
                });
            if let Err(e) = result {
                self.errors.push(e);
            }
            return;
        }
        if let Some(s) = n.input.iter().find(|i| self.seqs.contains_key(*i)) {
            self.errors.push(Error::Graph(format!(
                "node '{shown}' ({op_type}) reads the sequence '{s}'; graphrun takes sequences in the sequence ops, Identity and the optional ops only (a sequence it writes out when the model is loaded)"
            )));
            return;
        }
        if default_domain && optional::OPTIONAL.contains(&op_type) {
            if let Err(e) = self.lower_optional(n, &shown) {
                self.errors.push(e);
            }
            return;
        }
        let replaced = self.without_empty(n);
        let n = replaced.as_ref().unwrap_or(n);
        let what = format!("node '{shown}' ({op_type})");
        let control = default_domain && control::CONTROL.contains(&op_type) || control::is_flex(n);
        let mut inputs = n.input.clone();
        let attrs: Result<Vec<Attr>> = if control {
            self.control_attrs(n, &shown, &mut inputs)
        } else {
            n.attribute
                .iter()
                .map(|a| {
                    Ok(Attr {
                        name: a.name.clone(),
                        value: attr_value(a, self.base, &what)?,
                        loc: None,
                    })
                })
                .collect()
        };
        // The recurrences are unrolled once shapes are inferred, which needs the rest of
        // the graph, and a Resize is written for X's rank, which the TorchScript exporter
        // may not declare (an X reshaped to a computed shape): they are kept aside
        // (`graph_of` writes them).
        let after_inference = control
            || (default_domain
                && (recurrent::RECURRENT.contains(&op_type)
                    || op_type == deform::DEFORM_CONV
                    || op_type == roi::ROI_ALIGN
                    || op_type == det::DET
                    || ((resize::RESIZE.contains(&op_type)
                        || op_type == "GridSample"
                        || op_type == "DFT")
                        && n.input.first().is_some_and(|x| !self.ranks.contains_key(x)))));
        let result = match attrs {
            Ok(attrs) if after_inference => {
                self.deferred.push(ForeignNode {
                    index,
                    name: n.name.clone(),
                    // Another domain's op travels as `domain::op` (`lower_known`).
                    op: match default_domain {
                        true => op_type.to_string(),
                        false => format!("{}::{op_type}", n.domain),
                    },
                    attrs,
                    inputs,
                    outputs: n.output.clone(),
                    loc: None,
                });
                Ok(())
            }
            attrs => attrs.and_then(|attrs| self.lower(n, &shown, attrs)),
        };
        if let Err(e) = result {
            self.errors.push(e);
        }
    }

    /// Adds the graphrun node(s) for one ONNX node, rewriting the forms older opsets give.
    fn lower(&mut self, n: &NodeProto, shown: &str, mut attrs: Vec<Attr>) -> Result<()> {
        let mut inputs = n.input.clone();
        if domains::writes(&n.domain, &n.op_type) {
            return self.lower_domain(n, shown, attrs);
        }
        if control::is_flex(n) {
            return self.lower_control(n, shown, attrs);
        }
        // Cast's `saturate` reads only for the 8-bit floats, `round_mode` only for E8M0.
        let cast = matches!(n.op_type.as_str(), "Cast" | "CastLike");
        if cast {
            let saturate = !take(&mut attrs, "saturate").is_some_and(|v| v == AttrValue::Int(0));
            let round = match take(&mut attrs, "round_mode") {
                None => "up".to_string(),
                Some(AttrValue::Str(s)) if ["up", "down", "nearest"].contains(&s.as_str()) => s,
                Some(v) => {
                    return Err(Error::Graph(format!(
                        "node '{shown}' ({}): attribute 'round_mode' must be \"up\", \"down\" or \"nearest\", got {v:?}",
                        n.op_type
                    )))
                }
            };
            if !saturate || round != "up" {
                let to = match n.op_type.as_str() {
                    "Cast" => match attrs.iter().find(|a| a.name == "to").map(|a| &a.value) {
                        Some(AttrValue::Int(c)) => DType::from_onnx(*c),
                        _ => None,
                    },
                    _ => inputs.get(1).and_then(|t| self.dtypes.get(t)).copied(),
                };
                match to {
                    Some(DType::F8E8M0) => return self.e8m0_cast(n, &round, saturate),
                    Some(to) if !saturate && crate::tensor::narrow::overflow(to).is_some() => {
                        return self.unsaturated_cast(n, to)
                    }
                    Some(_) => {}
                    None => {
                        return Err(Error::Graph(format!(
                            "node '{shown}' ({}): saturate 0 and round_mode need the target type known when the model is imported (declare the type of '{}')",
                            n.op_type,
                            inputs.get(1).map_or("", String::as_str)
                        )))
                    }
                }
            }
        }
        match n.op_type.as_str() {
            op if control::CONTROL.contains(&op) => return self.lower_control(n, shown, attrs),
            "DeformConv" => return self.deform_conv(n, shown, attrs),
            "RoiAlign" => return self.roi_align(n, shown, attrs),
            "Det" => return self.det(n, shown, attrs),
            tfidf::TFIDF => return self.tfidf(n, shown, attrs),
            // A training_mode written as a constant does not decide (PyTorch's dynamo
            // exporter writes `true` into eval-mode exports): a plain run is inference and
            // a training step trains, as ONNX Runtime and `graphrun train` run the model.
            // Fed at run time, it decides.
            "Dropout" if inputs.len() == 3 && self.constant_value(&inputs[2]).is_some() => {
                inputs.truncate(2);
            }
            op if VARIADIC.contains(&op) && (inputs.len() != 2 || op == "Sum" || op == "Mean") => {
                return self.lower_variadic(n, shown, &attrs)
            }
            op if PREDICATES.contains(&op) => return self.lower_predicate(n, shown, attrs),
            "ConstantOfShape" => return self.lower_constant_of_shape(n, shown, attrs),
            "Tile" => return self.lower_tile(n, shown, &attrs),
            "Compress" => return self.lower_compress(n, shown, &attrs),
            "TensorScatter" => return self.lower_tensor_scatter(n, shown, attrs),
            "OneHot" => return self.lower_one_hot(n, shown, &attrs),
            "EyeLike" => return self.lower_eye_like(n, shown, &attrs),
            "Einsum" => return self.lower_einsum(n, shown, &attrs),
            // Scatter is ScatterElements under its old name (removed in opset 11).
            "Scatter" if self.opset >= 11 => {
                return Err(Error::Graph(format!(
                    "node '{shown}' (Scatter): Scatter was removed in opset 11 (the model imports opset {}); ScatterElements replaces it",
                    self.opset
                )))
            }
            "Scatter" => {
                let op = Op::parse("ScatterElements", &attrs, shown, None)?;
                self.nodes.push(Node {
                    name: n.name.clone(),
                    op,
                    inputs,
                    outputs: n.output.clone(),
                    loc: None,
                });
                return Ok(());
            }
            // Before opset 11 Pad's pads (`paddings` in Pad-1) and constant are attributes.
            "Pad" if self.opset < 11 => {
                let pads = take(&mut attrs, "pads").or_else(|| take(&mut attrs, "paddings"));
                let Some(AttrValue::Ints(pads)) = pads else {
                    return Err(Error::Graph(format!(
                        "node '{shown}' (Pad): attribute 'pads' (a list of integers) is required before opset 11"
                    )));
                };
                let t = Tensor::from_vec(&[pads.len()], pads)?;
                inputs.push(self.constant(n, "pads", t));
                match take(&mut attrs, "value") {
                    None => {}
                    Some(AttrValue::Float(v)) => {
                        let c = self.constant(n, "value", Tensor::scalar(v as f32));
                        let like = self.fresh(&format!("{}/value_cast", n.output.first().map(String::as_str).unwrap_or("onnx")));
                        self.push(n, "value_cast", Op::CastLike, vec![c, inputs[0].clone()], &like);
                        inputs.push(like);
                    }
                    Some(v) => {
                        return Err(Error::Graph(format!(
                            "node '{shown}' (Pad): attribute 'value' must be a float, got {v:?}"
                        )))
                    }
                }
            }
            "Hardmax" => return self.lower_hardmax(n, shown, attrs),
            // Before opset 10 TopK's k is an attribute.
            "TopK" if self.opset < 10 => {
                let k = match take(&mut attrs, "k") {
                    Some(AttrValue::Int(k)) => k,
                    other => {
                        return Err(Error::Graph(format!(
                            "node '{shown}' (TopK): attribute 'k' must be an integer, got {other:?}"
                        )))
                    }
                };
                let name = self.constant(n, "k", Tensor::from_vec(&[1], vec![k])?);
                inputs.truncate(1);
                inputs.push(name);
            }
            op if op.starts_with("Reduce") && REWRITTEN.contains(&op) => {
                return self.lower_reduce(n, shown, attrs)
            }
            "ReduceMax" if n.input.first().and_then(|v| self.dtypes.get(v)) == Some(&DType::Bool) => {
                return self.lower_reduce(n, shown, attrs)
            }
            op if conv::WINDOWED.contains(&op) => return self.lower_windowed(n, shown, attrs),
            op if quant::QUANT.contains(&op) => return self.lower_quant(n, shown, attrs),
            op if resize::RESIZE.contains(&op) => return self.lower_resize(n, shown, attrs),
            op if recurrent::RECURRENT.contains(&op) => {
                let a = composite::Attrs::of(n, shown, attrs)?;
                let what = a.what.clone();
                return self.recurrent(n, &what, a);
            }
            linear_attention::LINEAR_ATTENTION => {
                let a = composite::Attrs::of(n, shown, attrs)?;
                let what = a.what.clone();
                return self.linear_attention(n, &what, a);
            }
            recurrent::REVERSE_SEQUENCE => {
                let a = composite::Attrs::of(n, shown, attrs)?;
                let what = a.what.clone();
                return self.reverse_sequence_node(n, &what, a);
            }
            op if COMPOSITE.contains(&op) || MS_COMPOSITE.contains(&op) => {
                return self.lower_composite(n, shown, attrs)
            }
            // ONNX's K and V are required; graphrun's packed-QKV form (K and V omitted)
            // is its own.
            "Attention" if inputs.len() < 3 || inputs[1..3].iter().any(|v| v.is_empty()) => {
                return Err(Error::Graph(format!(
                    "node '{shown}' (Attention): inputs K and V are required"
                )))
            }
            // Softcap, the KV-cache forms (past_key, past_value, nonpad_kv_seqlen) and the
            // present_* and qk_matmul_output outputs: written as the definition.
            "Attention" if Self::attention_composite(n, &attrs) => {
                return self.lower_attention_composite(n, shown, attrs)
            }
            // Before opset 13 Softmax and LogSoftmax flatten their input to 2-D at `axis`
            // (default 1) and normalise each row.
            "Softmax" | "LogSoftmax" if self.opset < 13 => {
                return self.lower_coerced_softmax(n, shown, attrs)
            }
            // Before opset 11 Clip's bounds are float attributes; after, optional inputs.
            "Clip" if self.opset < 11 => {
                for (k, key) in ["min", "max"].into_iter().enumerate() {
                    let v = take(&mut attrs, key);
                    let name = match v {
                        None => String::new(),
                        Some(AttrValue::Float(x)) => {
                            self.constant(n, key, Tensor::scalar(x as f32))
                        }
                        Some(v) => {
                            return Err(Error::Graph(format!(
                            "node '{shown}' (Clip): attribute '{key}' must be a float, got {v:?}"
                        )))
                        }
                    };
                    inputs.resize(k + 2, String::new());
                    inputs[k + 1] = name;
                }
            }
            // Before opset 10 Slice takes starts, ends and axes as attributes.
            "Slice" if self.opset < 10 => {
                for key in ["starts", "ends", "axes"] {
                    match take(&mut attrs, key) {
                        Some(AttrValue::Ints(v)) => {
                            let t = Tensor::from_vec(&[v.len()], v)?;
                            let name = self.constant(n, key, t);
                            inputs.push(name);
                        }
                        None if key == "axes" => {}
                        other => {
                            return Err(Error::Graph(format!(
                                "node '{shown}' (Slice): attribute '{key}' must be a list of integers, got {other:?}"
                            )))
                        }
                    }
                }
            }
            _ => {}
        }
        let op = Op::parse(&n.op_type, &attrs, shown, None)?;
        self.nodes.push(Node {
            name: n.name.clone(),
            op,
            inputs,
            outputs: n.output.clone(),
            loc: None,
        });
        Ok(())
    }

    /// Sum, Mean, Min, Max of any number of inputs: a chain of binary Add/Min/Max (numpy
    /// broadcasting composes), Mean then divided by the count, cast to the sum's dtype.
    fn lower_variadic(&mut self, n: &NodeProto, shown: &str, attrs: &[Attr]) -> Result<()> {
        let op = n.op_type.as_str();
        if let Some(a) = attrs.first() {
            return Err(Error::Graph(format!(
                "node '{shown}' ({op}): unknown attribute '{}'",
                a.name
            )));
        }
        let ins: Vec<&String> = n.input.iter().filter(|v| !v.is_empty()).collect();
        let (Some(first), Some(y), 1) = (ins.first(), n.output.first(), n.output.len()) else {
            return Err(Error::Graph(format!(
                "node '{shown}' ({op}) needs at least one input and exactly one output"
            )));
        };
        let bin = match op {
            "Min" => BinaryOp::Min,
            "Max" => BinaryOp::Max,
            _ => BinaryOp::Add,
        };
        let mean = op == "Mean";
        let mut acc = (*first).clone();
        let last = ins.len() - 1;
        for (k, v) in ins.iter().enumerate().skip(1) {
            let out = if k == last && !mean {
                y.clone()
            } else {
                self.fresh(&format!("{y}/{op}{k}"))
            };
            self.push(
                n,
                &format!("{k}"),
                Op::Binary(bin),
                vec![acc, (*v).clone()],
                &out,
            );
            acc = out;
        }
        if mean {
            let count = self.constant(n, "count", Tensor::scalar(ins.len() as f32));
            let like = self.fresh(&format!("{y}/count_cast"));
            self.push(
                n,
                "count_cast",
                Op::CastLike,
                vec![count, acc.clone()],
                &like,
            );
            self.push(n, "", Op::Binary(BinaryOp::Div), vec![acc, like], y);
        } else if last == 0 {
            self.push(n, "", Op::Identity, vec![acc], y);
        }
        Ok(())
    }

    /// ConstantOfShape(shape) = Expand(value, shape): the shape (a plan-time value, as
    /// Expand's) decides the output, every element the attribute's one value.
    fn lower_constant_of_shape(
        &mut self,
        n: &NodeProto,
        shown: &str,
        mut attrs: Vec<Attr>,
    ) -> Result<()> {
        let value = match take(&mut attrs, "value") {
            None => Tensor::scalar(0.0f32),
            Some(AttrValue::Tensor(t)) if t.numel() == 1 => t.reshaped(&[])?,
            Some(v) => {
                return Err(Error::Graph(format!(
                    "node '{shown}' (ConstantOfShape): attribute 'value' must be a one-element tensor, got {}",
                    match v {
                        AttrValue::Tensor(t) => format!("shape {:?}", t.shape()),
                        v => format!("{v:?}"),
                    }
                )))
            }
        };
        if let Some(a) = attrs.first() {
            return Err(Error::Graph(format!(
                "node '{shown}' (ConstantOfShape): unknown attribute '{}'",
                a.name
            )));
        }
        let (Some(shape), Some(y), 1) = (n.input.first(), n.output.first(), n.input.len()) else {
            return Err(Error::Graph(format!(
                "node '{shown}' (ConstantOfShape) needs exactly one input (the shape) and one output"
            )));
        };
        let (shape, y) = (shape.clone(), y.clone());
        let v = self.constant(n, "value", value);
        self.push(n, "", Op::Expand, vec![v, shape], &y);
        Ok(())
    }

    /// ReduceMin = -ReduceMax(-x), ReduceL1 = ReduceSum(|x|), ReduceSumSquare =
    /// ReduceSum(x·x), ReduceL2 = its square root, ReduceLogSum = log ReduceSum(x), and
    /// ReduceLogSumExp = log ReduceSum(exp(x - m)) + m with m = ReduceMax(x) (kept as a
    /// dim for the subtraction), which does not overflow. The inner reductions take the
    /// node's axes (input or attribute), keepdims and noop_with_empty_axes as they are.
    fn lower_reduce(&mut self, n: &NodeProto, shown: &str, attrs: Vec<Attr>) -> Result<()> {
        let op = n.op_type.as_str();
        let (Some(x), Some(y)) = (n.input.first(), n.output.first()) else {
            return Err(Error::Graph(format!(
                "node '{shown}' ({op}) needs an input and an output"
            )));
        };
        let (x, y) = (x.clone(), y.clone());
        let axes: Vec<String> = n.input.iter().skip(1).cloned().collect();
        let reduce = |kind: &str, attrs: &[Attr]| Op::parse(kind, attrs, shown, None);
        let un = |u: UnaryOp| Op::Unary(u);
        // A value named after the output; the last step writes the output itself.
        let step = |me: &mut Self, what: &str, op: Op, ins: Vec<String>, last: bool| {
            let out = if last {
                y.clone()
            } else {
                me.fresh(&format!("{y}/{what}"))
            };
            me.push(n, if last { "" } else { what }, op, ins, &out);
            out
        };
        let with_axes =
            |v: String| -> Vec<String> { std::iter::once(v).chain(axes.iter().cloned()).collect() };
        let dtype = self.dtypes.get(&x).copied();
        match op {
            // On bools Max is Or and Min is And: both on the 0/1 values as i32.
            "ReduceMax" | "ReduceMin" if dtype == Some(DType::Bool) => {
                let to = |d: DType| Op::Cast { to: d };
                let v = step(self, "as_i32", to(DType::I32), vec![x], false);
                let r = if op == "ReduceMax" {
                    step(
                        self,
                        "max",
                        reduce("ReduceMax", &attrs)?,
                        with_axes(v),
                        false,
                    )
                } else {
                    let neg = step(self, "neg", un(UnaryOp::Neg), vec![v], false);
                    let m = step(
                        self,
                        "max",
                        reduce("ReduceMax", &attrs)?,
                        with_axes(neg),
                        false,
                    );
                    step(self, "min", un(UnaryOp::Neg), vec![m], false)
                };
                step(self, "", to(DType::Bool), vec![r], true);
            }
            // min(x) = ~max(~x) on integers: bitwise NOT reverses their order for signed and
            // unsigned types alike, where -x overflows (i8's -128) or wraps (unsigned).
            "ReduceMin" if dtype.is_some_and(|d| d.is_int()) => {
                let c = self.constant(n, "ones", Tensor::scalar(-1i64));
                let ones = step(self, "ones_cast", Op::CastLike, vec![c, x.clone()], false);
                let flip = Op::Binary(BinaryOp::BitwiseXor);
                let nx = step(self, "not", flip.clone(), vec![x, ones.clone()], false);
                let max = step(
                    self,
                    "max",
                    reduce("ReduceMax", &attrs)?,
                    with_axes(nx),
                    false,
                );
                step(self, "", flip, vec![max, ones], true);
            }
            "ReduceMin" => {
                let neg = step(self, "neg", un(UnaryOp::Neg), vec![x], false);
                let max = step(
                    self,
                    "max",
                    reduce("ReduceMax", &attrs)?,
                    with_axes(neg),
                    false,
                );
                step(self, "", un(UnaryOp::Neg), vec![max], true);
            }
            "ReduceL1" => {
                let abs = step(self, "abs", un(UnaryOp::Abs), vec![x], false);
                step(self, "", reduce("ReduceSum", &attrs)?, with_axes(abs), true);
            }
            "ReduceSumSquare" | "ReduceL2" => {
                let sq = step(
                    self,
                    "square",
                    Op::Binary(BinaryOp::Mul),
                    vec![x.clone(), x],
                    false,
                );
                let l2 = op == "ReduceL2";
                let sum = step(
                    self,
                    "sum",
                    reduce("ReduceSum", &attrs)?,
                    with_axes(sq),
                    !l2,
                );
                if l2 {
                    step(self, "", un(UnaryOp::Sqrt), vec![sum], true);
                }
            }
            "ReduceLogSum" => {
                let sum = step(
                    self,
                    "sum",
                    reduce("ReduceSum", &attrs)?,
                    with_axes(x),
                    false,
                );
                step(self, "", un(UnaryOp::Log), vec![sum], true);
            }
            _ => {
                let mut kept: Vec<Attr> = attrs
                    .iter()
                    .filter(|a| a.name != "keepdims")
                    .cloned()
                    .collect();
                kept.push(Attr {
                    name: "keepdims".into(),
                    value: AttrValue::Int(1),
                    loc: None,
                });
                let m1 = step(
                    self,
                    "max_kept",
                    reduce("ReduceMax", &kept)?,
                    with_axes(x.clone()),
                    false,
                );
                let d = step(
                    self,
                    "shifted",
                    Op::Binary(BinaryOp::Sub),
                    vec![x.clone(), m1],
                    false,
                );
                let e = step(self, "exp", un(UnaryOp::Exp), vec![d], false);
                let s = step(
                    self,
                    "sum",
                    reduce("ReduceSum", &attrs)?,
                    with_axes(e),
                    false,
                );
                let l = step(self, "log", un(UnaryOp::Log), vec![s], false);
                let m2 = step(
                    self,
                    "max",
                    reduce("ReduceMax", &attrs)?,
                    with_axes(x),
                    false,
                );
                step(self, "", Op::Binary(BinaryOp::Add), vec![l, m2], true);
            }
        }
        Ok(())
    }

    /// Hardmax(x) along `axis` is 1 at the first maximum of each line and 0 elsewhere:
    /// `CastLike(Equal(position, ArgMax(x, keepdims)), x)`, where position is each
    /// element's index along the axis, an exclusive CumSum of ones of x's shape (so that
    /// the rank need not be known here), in i32 (exact, and computed by every backend).
    /// Before opset 13 Hardmax takes the input as 2-D at `axis` (default 1), as
    /// Softmax does: Flatten, Hardmax of the rows, Reshape back.
    fn lower_hardmax(&mut self, n: &NodeProto, shown: &str, mut attrs: Vec<Attr>) -> Result<()> {
        let coerced = self.opset < 13;
        let axis = match take(&mut attrs, "axis") {
            None => {
                if coerced {
                    1
                } else {
                    -1
                }
            }
            Some(AttrValue::Int(a)) => a,
            Some(v) => {
                return Err(Error::Graph(format!(
                    "node '{shown}' (Hardmax): attribute 'axis' must be an integer, got {v:?}"
                )))
            }
        };
        if let Some(a) = attrs.first() {
            return Err(Error::Graph(format!(
                "node '{shown}' (Hardmax): unknown attribute '{}'",
                a.name
            )));
        }
        let (Some(x), Some(y), 1, 1) = (
            n.input.first(),
            n.output.first(),
            n.input.len(),
            n.output.len(),
        ) else {
            return Err(Error::Graph(format!(
                "node '{shown}' (Hardmax) needs exactly one input and one output"
            )));
        };
        let (x, y) = (x.clone(), y.clone());
        let shape = self.fresh(&format!("{y}/shape"));
        let whole = Op::Shape {
            start: 0,
            end: None,
        };
        self.push(n, "shape", whole, vec![x.clone()], &shape);
        let (data, axis, hard) = if coerced {
            let flat = self.fresh(&format!("{y}/flat"));
            self.push(n, "flatten", Op::Flatten { axis }, vec![x.clone()], &flat);
            (flat, -1, self.fresh(&format!("{y}/rows")))
        } else {
            (x.clone(), axis, y.clone())
        };
        let arg = self.fresh(&format!("{y}/argmax"));
        let argmax = Op::ArgReduce {
            min: false,
            axis,
            keepdims: true,
            select_last_index: false,
        };
        self.push(n, "argmax", argmax, vec![data.clone()], &arg);
        let arg32 = self.fresh(&format!("{y}/argmax_i32"));
        let to_i32 = Op::Cast {
            to: crate::tensor::DType::I32,
        };
        self.push(n, "argmax_i32", to_i32, vec![arg], &arg32);
        let data_shape = if coerced {
            let s = self.fresh(&format!("{y}/rows_shape"));
            let whole = Op::Shape {
                start: 0,
                end: None,
            };
            self.push(n, "rows_shape", whole, vec![data.clone()], &s);
            s
        } else {
            shape.clone()
        };
        let one = self.constant(n, "one", Tensor::scalar(1i32));
        let ones = self.fresh(&format!("{y}/ones"));
        self.push(n, "ones", Op::Expand, vec![one, data_shape], &ones);
        let ax = self.constant(n, "axis", Tensor::scalar(axis));
        let pos = self.fresh(&format!("{y}/position"));
        let scan = Op::Cumulative {
            prod: false,
            exclusive: true,
            reverse: false,
        };
        self.push(n, "position", scan, vec![ones, ax], &pos);
        let hit = self.fresh(&format!("{y}/hit"));
        let eq = Op::Binary(BinaryOp::Equal);
        self.push(n, "hit", eq, vec![pos, arg32], &hit);
        let last = if coerced { "cast" } else { "" };
        self.push(n, last, Op::CastLike, vec![hit, data], &hard);
        if coerced {
            let op = Op::Reshape { allowzero: false };
            self.push(n, "", op, vec![hard, shape], &y);
        }
        Ok(())
    }

    /// IsNaN, IsInf and Not as comparisons (see `PREDICATES`).
    fn lower_predicate(&mut self, n: &NodeProto, shown: &str, mut attrs: Vec<Attr>) -> Result<()> {
        let op = n.op_type.as_str();
        let (Some(x), Some(y), 1, 1) = (
            n.input.first(),
            n.output.first(),
            n.input.len(),
            n.output.len(),
        ) else {
            return Err(Error::Graph(format!(
                "node '{shown}' ({op}) needs exactly one input and one output"
            )));
        };
        let (x, y) = (x.clone(), y.clone());
        let mut flag = |key: &str| -> Result<bool> {
            match take(&mut attrs, key) {
                None => Ok(true),
                Some(AttrValue::Int(v)) => Ok(v != 0),
                Some(v) => Err(Error::Graph(format!(
                    "node '{shown}' ({op}): attribute '{key}' must be an integer, got {v:?}"
                ))),
            }
        };
        let (neg, pos) = if op == "IsInf" {
            (flag("detect_negative")?, flag("detect_positive")?)
        } else {
            (true, true)
        };
        if let Some(a) = attrs.first() {
            return Err(Error::Graph(format!(
                "node '{shown}' ({op}): unknown attribute '{}'",
                a.name
            )));
        }
        let eq = Op::Binary(BinaryOp::Equal);
        match op {
            "BitwiseNot" => {
                let c = self.constant(n, "ones", Tensor::scalar(-1i64));
                let ones = self.fresh(&format!("{y}/ones_cast"));
                self.push(n, "ones_cast", Op::CastLike, vec![c, x.clone()], &ones);
                self.push(n, "", Op::Binary(BinaryOp::BitwiseXor), vec![x, ones], &y);
            }
            "Not" => {
                let f = self.constant(
                    n,
                    "false",
                    Tensor::from_f64(crate::tensor::DType::Bool, &[], &[0.0])?,
                );
                self.push(n, "", eq, vec![x, f], &y);
            }
            "IsNaN" => {
                let same = self.fresh(&format!("{y}/self_equal"));
                self.push(n, "self_equal", eq.clone(), vec![x.clone(), x], &same);
                let f = self.constant(
                    n,
                    "false",
                    Tensor::from_f64(crate::tensor::DType::Bool, &[], &[0.0])?,
                );
                self.push(n, "", eq, vec![same, f], &y);
            }
            _ if !neg && !pos => {
                // Nothing detected: false everywhere (x < x is false, NaN included).
                self.push(n, "", Op::Binary(BinaryOp::Less), vec![x.clone(), x], &y);
            }
            _ => {
                let inf = if pos {
                    f32::INFINITY
                } else {
                    f32::NEG_INFINITY
                };
                let c = self.constant(n, "inf", Tensor::scalar(inf));
                let like = self.fresh(&format!("{y}/inf_cast"));
                self.push(n, "inf_cast", Op::CastLike, vec![c, x.clone()], &like);
                let v = if neg && pos {
                    let a = self.fresh(&format!("{y}/abs"));
                    self.push(n, "abs", Op::Unary(UnaryOp::Abs), vec![x], &a);
                    a
                } else {
                    x
                };
                self.push(n, "", eq, vec![v, like], &y);
            }
        }
        Ok(())
    }

    /// Adds a node for `n` (its own name where `what` is empty, else a helper's).
    fn push(&mut self, n: &NodeProto, what: &str, op: Op, inputs: Vec<String>, out: &str) {
        let name = match what {
            "" => n.name.clone(),
            w => helper_name(n, w),
        };
        self.nodes.push(Node {
            name,
            op,
            inputs,
            outputs: vec![out.to_string()],
            loc: None,
        });
    }

    /// A Constant node holding `t`, named after the node's first output; returns its value.
    fn constant(&mut self, n: &NodeProto, what: &str, t: Tensor) -> String {
        let out = n.output.first().map(String::as_str).unwrap_or("onnx");
        let value = self.fresh(&format!("{out}/{what}"));
        // The node takes the value's suffix, which `fresh` keeps unique.
        let suffix = &value[out.len() + 1..];
        self.nodes.push(Node {
            name: helper_name(n, suffix),
            op: Op::Constant { value: t },
            inputs: vec![],
            outputs: vec![value.clone()],
            loc: None,
        });
        value
    }

    /// Softmax-1/11 semantics: `Reshape(Softmax(Flatten(x, axis), axis=1), Shape(x))`.
    /// Along the last axis (axis -1) that is plain Softmax, which is kept.
    fn lower_coerced_softmax(
        &mut self,
        n: &NodeProto,
        shown: &str,
        attrs: Vec<Attr>,
    ) -> Result<()> {
        let axis = match attrs.iter().find(|a| a.name == "axis").map(|a| &a.value) {
            None => 1,
            Some(AttrValue::Int(a)) => *a,
            Some(v) => {
                return Err(Error::Graph(format!(
                    "node '{shown}' ({}): attribute 'axis' must be an integer, got {v:?}",
                    n.op_type
                )))
            }
        };
        if let Some(a) = attrs.iter().find(|a| a.name != "axis") {
            return Err(Error::Graph(format!(
                "node '{shown}' ({}): unknown attribute '{}'",
                n.op_type, a.name
            )));
        }
        let norm = |axis| match n.op_type.as_str() {
            "Softmax" => Op::Softmax { axis },
            _ => Op::LogSoftmax { axis },
        };
        let (Some(x), Some(y)) = (n.input.first(), n.output.first()) else {
            return Err(Error::Graph(format!(
                "node '{shown}' ({}) needs one input and one output",
                n.op_type
            )));
        };
        if axis == -1 {
            self.nodes.push(Node {
                name: n.name.clone(),
                op: norm(-1),
                inputs: vec![x.clone()],
                outputs: n.output.clone(),
                loc: None,
            });
            return Ok(());
        }
        let shape = self.fresh(&format!("{y}/shape"));
        let flat = self.fresh(&format!("{y}/flat"));
        let rows = self.fresh(&format!("{y}/rows"));
        let mut push = |name: String, op, inputs: Vec<String>, out: String| {
            self.nodes.push(Node {
                name,
                op,
                inputs,
                outputs: vec![out],
                loc: None,
            })
        };
        push(
            helper_name(n, "shape"),
            Op::Shape {
                start: 0,
                end: None,
            },
            vec![x.clone()],
            shape.clone(),
        );
        push(
            helper_name(n, "flatten"),
            Op::Flatten { axis },
            vec![x.clone()],
            flat.clone(),
        );
        push(n.name.clone(), norm(1), vec![flat], rows.clone());
        push(
            helper_name(n, "reshape"),
            Op::Reshape { allowzero: false },
            vec![rows, shape],
            y.clone(),
        );
        Ok(())
    }

    /// The nodes, or every problem found (the unsupported ops first, in one error).
    pub(super) fn finish(mut self) -> Result<Vec<Node>> {
        if !self.unsupported.is_empty() {
            let total: usize = self.unsupported.values().map(Vec::len).sum();
            let list: Vec<String> = self
                .unsupported
                .iter()
                .map(|(op, nodes)| {
                    let mut names: Vec<String> =
                        nodes.iter().take(3).map(|n| format!("'{n}'")).collect();
                    if nodes.len() > 3 {
                        names.push(format!("and {} more", nodes.len() - 3));
                    }
                    let s = if nodes.len() == 1 { "" } else { "s" };
                    format!("{op} ({} node{s}: {})", nodes.len(), names.join(", "))
                })
                .collect();
            self.errors.insert(
                0,
                Error::Graph(format!(
                    "graphrun does not support {} op{} of this model ({total} node{}): {}",
                    self.unsupported.len(),
                    if self.unsupported.len() == 1 { "" } else { "s" },
                    if total == 1 { "" } else { "s" },
                    list.join("; ")
                )),
            );
        }
        match self.errors.len() {
            0 => Ok(self.nodes),
            1 => Err(self.errors.remove(0)),
            _ => Err(Error::Many(self.errors)),
        }
    }
}

/// The importer's lowering for YAML models: a YAML node may name any ai.onnx operator the
/// importer writes as graphrun's ops (with the newest opset's semantics), and the variadic
/// Sum, Mean, Min and Max with other than two inputs.
pub struct YamlLowering;

impl Lower for YamlLowering {
    fn lowers(&self, op: &str, inputs: usize) -> bool {
        imports(op) && (!OP_NAMES.contains(&op) || (VARIADIC.contains(&op) && inputs != 2))
    }
    fn lower(
        &self,
        f: &ForeignNode,
        known: &HashMap<String, Known>,
        taken: &mut HashSet<String>,
    ) -> Result<Vec<Node>> {
        let written = lower_known(
            f,
            super::MAX_OPSET,
            Path::new(""),
            &mut vec![],
            known,
            taken,
        )?;
        flat(f, written)
    }
}

/// The nodes written for `f`, where none of them waits for shape inference (only the
/// nodes of a control-flow body, which YAML has none of, do).
fn flat(f: &ForeignNode, (nodes, more): (Vec<Node>, Vec<ForeignNode>)) -> Result<Vec<Node>> {
    match more.first() {
        None => Ok(nodes),
        Some(m) => Err(Error::Graph(format!(
            "node '{}' ({}): its body's node '{}' ({}) is written after shape inference",
            f.name, f.op, m.name, m.op
        ))),
    }
}

/// The importer's own lowering of the nodes it kept aside until shapes were inferred
/// (`Importer::deferred`): as `YamlLowering`, with the model's opset; the bodies of
/// control-flow nodes are `graphs` (`Importer::graphs`), and the nodes of a body that are
/// kept aside in turn come back as foreign nodes.
pub(super) struct Deferred<'a> {
    pub(super) opset: i64,
    pub(super) base: &'a Path,
    pub(super) graphs: std::cell::RefCell<Vec<GraphProto>>,
}

impl Lower for Deferred<'_> {
    fn lowers(&self, _: &str, _: usize) -> bool {
        true
    }
    fn lower(
        &self,
        f: &ForeignNode,
        known: &HashMap<String, Known>,
        taken: &mut HashSet<String>,
    ) -> Result<Vec<Node>> {
        flat(f, self.lower_nested(f, known, taken)?)
    }
    fn lower_nested(
        &self,
        f: &ForeignNode,
        known: &HashMap<String, Known>,
        taken: &mut HashSet<String>,
    ) -> Result<(Vec<Node>, Vec<ForeignNode>)> {
        let mut graphs = self.graphs.borrow_mut();
        lower_known(f, self.opset, self.base, &mut graphs, known, taken)
    }
}

/// Writes one kept-aside node as graphrun's ops at `opset`, given what is known of the
/// values it reads; with the nodes of a control-flow body that are kept aside in turn.
fn lower_known(
    f: &ForeignNode,
    opset: i64,
    base: &Path,
    graphs: &mut Vec<GraphProto>,
    known: &HashMap<String, Known>,
    taken: &mut HashSet<String>,
) -> Result<(Vec<Node>, Vec<ForeignNode>)> {
    let (domain, op) = f.op.split_once("::").unwrap_or(("", &f.op));
    let n = NodeProto {
        name: f.name.clone(),
        domain: domain.to_string(),
        op_type: op.to_string(),
        input: f.inputs.clone(),
        output: f.outputs.clone(),
        ..Default::default()
    };
    let shown = if f.name.is_empty() {
        format!("#{}", f.index)
    } else {
        f.name.clone()
    };
    let mut im = Importer::from_known(known, std::mem::take(taken), base);
    im.opset = opset;
    im.graphs = std::mem::take(graphs);
    let result = im.lower(&n, &shown, f.attrs.clone());
    *taken = std::mem::take(&mut im.taken);
    *graphs = std::mem::take(&mut im.graphs);
    result?;
    let more = std::mem::take(&mut im.deferred);
    Ok((im.finish()?, more))
}

/// Removes and returns attribute `key`.
fn take(attrs: &mut Vec<Attr>, key: &str) -> Option<AttrValue> {
    let i = attrs.iter().position(|a| a.name == key)?;
    Some(attrs.remove(i).value)
}

/// The name of a node the importer adds for `n`: derived from n's name, or left empty
/// (named `<op>_<index>` later) when n has none.
fn helper_name(n: &NodeProto, what: &str) -> String {
    if n.name.is_empty() {
        String::new()
    } else {
        format!("{}/{what}", n.name)
    }
}
