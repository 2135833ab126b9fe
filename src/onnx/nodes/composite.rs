//! ONNX operators graphrun has no kernel for, written by the importer as exact compositions
//! of graphrun's ops: every backend then runs them, and autodiff differentiates them
//! through their parts. Each lowering follows the operator's ONNX definition (its function
//! body where it has one); what a composition needs of a shape it does not know at import
//! (a rank, a dim) comes from `Shape` arithmetic, which the plan folds on the host.

use super::Importer;
use crate::error::{Error, Result};
use crate::graph::op::{Attr, AttrValue, ReduceKind};
use crate::graph::{BinaryOp, Op, UnaryOp};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};

/// The ai.onnx operators written here. SimplifiedLayerNormalization is ONNX Runtime's RMS
/// normalization, which its transformer optimizer writes in the default domain.
pub(super) const COMPOSITE: &[&str] = &[
    "Size",
    "NegativeLogLikelihoodLoss",
    "SimplifiedLayerNormalization",
    "LpNormalization",
    "MeanVarianceNormalization",
    "Shrink",
    "DepthToSpace",
    "SpaceToDepth",
    "GlobalAveragePool",
    "GlobalMaxPool",
    "InstanceNormalization",
    "GroupNormalization",
    "BatchNormalization",
    "HannWindow",
    "HammingWindow",
    "BlackmanWindow",
    "RotaryEmbedding",
    "QuantizeLinear",
    "DequantizeLinear",
    "DynamicQuantizeLinear",
    "CenterCropPad",
    "LRN",
    // sample.rs
    "GridSample",
    "AffineGrid",
    // spectral.rs
    "DFT",
    "STFT",
    "MelWeightMatrix",
    // random.rs
    "Bernoulli",
    "Multinomial",
];

/// The com.microsoft (ONNX Runtime contrib) operators written here.
pub(super) const MS_COMPOSITE: &[&str] = &[
    "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization",
    "SkipLayerNormalization",
    "RotaryEmbedding",
];

/// A node's attributes, read by name; one left unread is an error (`finish`).
pub(super) struct Attrs {
    pub(super) what: String,
    pub(super) list: Vec<Attr>,
}

impl Attrs {
    /// The attributes of node `n` (shown as `shown` in messages), after checking that it
    /// has an output.
    pub(super) fn of(n: &NodeProto, shown: &str, list: Vec<Attr>) -> Result<Attrs> {
        let what = format!("node '{shown}' ({})", n.op_type);
        if n.output.is_empty() {
            return Err(Error::Graph(format!("{what} has no output")));
        }
        Ok(Attrs { what, list })
    }
    pub(super) fn take(&mut self, key: &str) -> Option<AttrValue> {
        super::take(&mut self.list, key)
    }
    pub(super) fn wrong(&self, key: &str, want: &str, v: &AttrValue) -> Error {
        Error::Graph(format!(
            "{}: attribute '{key}' must be {want}, got {v:?}",
            self.what
        ))
    }
    /// An error about attribute `key`'s value.
    pub(super) fn refuse(&self, key: &str, msg: &str) -> Error {
        Error::Graph(format!("{}: attribute '{key}' {msg}", self.what))
    }
    pub(super) fn opt_int(&mut self, key: &str) -> Result<Option<i64>> {
        match self.take(key) {
            None => Ok(None),
            Some(AttrValue::Int(v)) => Ok(Some(v)),
            Some(v) => Err(self.wrong(key, "an integer", &v)),
        }
    }
    pub(super) fn int(&mut self, key: &str, default: i64) -> Result<i64> {
        Ok(self.opt_int(key)?.unwrap_or(default))
    }
    /// A 0/1 attribute (default 0).
    pub(super) fn flag(&mut self, key: &str) -> Result<bool> {
        self.flag_or(key, false)
    }
    pub(super) fn flag_or(&mut self, key: &str, default: bool) -> Result<bool> {
        match self.int(key, default as i64)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(self.refuse(key, &format!("must be 0 or 1, got {v}"))),
        }
    }
    pub(super) fn float(&mut self, key: &str, default: f32) -> Result<f32> {
        match self.take(key) {
            None => Ok(default),
            Some(AttrValue::Float(v)) => Ok(v as f32),
            Some(AttrValue::Int(v)) => Ok(v as f32),
            Some(v) => Err(self.wrong(key, "a float", &v)),
        }
    }
    pub(super) fn string(&mut self, key: &str, default: &str) -> Result<String> {
        match self.take(key) {
            None => Ok(default.to_string()),
            Some(AttrValue::Str(s)) => Ok(s),
            Some(v) => Err(self.wrong(key, "a string", &v)),
        }
    }
    /// A list-of-floats attribute (empty when absent).
    pub(super) fn floats(&mut self, key: &str) -> Result<Vec<f32>> {
        match self.take(key) {
            None => Ok(vec![]),
            Some(AttrValue::Floats(v)) => Ok(v.into_iter().map(|f| f as f32).collect()),
            Some(AttrValue::Float(v)) => Ok(vec![v as f32]),
            Some(v) => Err(self.wrong(key, "a list of floats", &v)),
        }
    }
    /// `output_datatype` (default 1, f32): a type graphrun has.
    pub(super) fn output_datatype(&mut self) -> Result<DType> {
        let code = self.int("output_datatype", 1)?;
        DType::from_onnx(code).ok_or_else(|| {
            self.refuse(
                "output_datatype",
                &format!(
                    "names {} (ONNX code {code}), a type graphrun does not have",
                    crate::tensor::onnx_dtype_name(code)
                ),
            )
        })
    }
    pub(super) fn ints(&mut self, key: &str, default: &[i64]) -> Result<Vec<i64>> {
        Ok(self.opt_ints(key)?.unwrap_or_else(|| default.to_vec()))
    }
    pub(super) fn opt_ints(&mut self, key: &str) -> Result<Option<Vec<i64>>> {
        match self.take(key) {
            None => Ok(None),
            Some(AttrValue::Ints(v)) => Ok(Some(v)),
            Some(AttrValue::Int(v)) => Ok(Some(vec![v])),
            // An empty YAML list has no element type to tell.
            Some(AttrValue::Floats(v)) if v.is_empty() => Ok(Some(vec![])),
            Some(v) => Err(self.wrong(key, "a list of integers", &v)),
        }
    }
    /// A floating dtype given by its ONNX code (stash_type).
    fn float_dtype(&mut self, key: &str, default: i64) -> Result<DType> {
        let code = self.int(key, default)?;
        match DType::from_onnx(code) {
            Some(dt) if dt.is_float() => Ok(dt),
            _ => Err(self.refuse(
                key,
                &format!("must name a floating type (1, 10, 11 or 16), got {code}"),
            )),
        }
    }
    pub(super) fn finish(&self) -> Result<()> {
        match self.list.first() {
            None => Ok(()),
            Some(a) => Err(Error::Graph(format!(
                "{}: unknown attribute '{}'",
                self.what, a.name
            ))),
        }
    }
}

/// The node's inputs after checking the counts of inputs and outputs: the first
/// `want.0` (required), then the optional ones up to `want.1` (None where omitted).
pub(super) fn inputs(
    n: &NodeProto,
    what: &str,
    want: (usize, usize),
    outs: usize,
) -> Result<(Vec<String>, Vec<Option<String>>)> {
    let given = |v: &[String]| v.iter().rposition(|s| !s.is_empty()).map_or(0, |i| i + 1);
    let (ni, no) = (given(&n.input), given(&n.output));
    let required_missing = n.input.iter().take(want.0).any(|s| s.is_empty());
    let first_missing = n.output.first().is_none_or(|s| s.is_empty());
    if ni < want.0 || ni > want.1 || required_missing || no > outs || first_missing {
        let count = if want.0 == want.1 {
            format!("{}", want.0)
        } else {
            format!("{} to {} (the first {} required)", want.0, want.1, want.0)
        };
        return Err(Error::Graph(format!(
            "{what} takes {count} inputs and 1 to {outs} outputs (the first required), got {ni} inputs and {no} outputs"
        )));
    }
    let required = n.input[..want.0].to_vec();
    let optional = (want.0..want.1)
        .map(|k| n.input.get(k).filter(|s| !s.is_empty()).cloned())
        .collect();
    Ok((required, optional))
}

/// The output `k` of the node, when it is asked for.
pub(super) fn output(n: &NodeProto, k: usize) -> Option<&str> {
    n.output
        .get(k)
        .map(String::as_str)
        .filter(|s| !s.is_empty())
}

/// Reduction axes: fixed at import, or a value computed from shapes (`Shape` arithmetic).
pub(super) enum Axes {
    Fixed(Vec<i64>),
    From(String),
}

/// `kind` over `axes` of x: the op and its inputs.
pub(super) fn reduce_op(
    kind: ReduceKind,
    x: &str,
    axes: &Axes,
    keepdims: bool,
) -> (Op, Vec<String>) {
    let (fixed, ins) = match axes {
        Axes::Fixed(v) => (Some(v.clone()), vec![x.to_string()]),
        Axes::From(a) => (None, vec![x.to_string(), a.clone()]),
    };
    let op = Op::Reduce {
        kind,
        axes: fixed,
        keepdims,
        noop_with_empty_axes: false,
    };
    (op, ins)
}

/// The saturation range of QuantizeLinear's integer targets (8- and 16-bit, 4- and
/// 2-bit).
fn quant_range(dt: DType) -> Option<(f32, f32)> {
    match dt {
        DType::U8
        | DType::I8
        | DType::U16
        | DType::I16
        | DType::I4
        | DType::U4
        | DType::I2
        | DType::U2 => dt.int_range().map(|(lo, hi)| (lo as f32, hi as f32)),
        _ => None,
    }
}

/// QuantizeLinear's floating targets: the 8-bit floats and FLOAT4E2M1.
fn quant_float(dt: DType) -> bool {
    matches!(
        dt,
        DType::F8E4M3FN | DType::F8E4M3FNUZ | DType::F8E5M2 | DType::F8E5M2FNUZ | DType::F4E2M1
    )
}

/// The name of ONNX type `code` for messages: graphrun's dtype name, or ONNX's.
fn type_name(code: i64) -> String {
    crate::tensor::onnx_dtype_name(code)
}

/// Refuses a constant of `shape` that the importer would build for `what` when it is
/// over the memory cap (`crate::tensor::max_bytes`): a model's attributes decide such
/// sizes, and an allocation that fails aborts.
pub(super) fn check_size(what: &str, dt: DType, shape: &[usize]) -> Result<()> {
    let bytes = shape
        .iter()
        .try_fold(dt.size(), |a, &d| a.checked_mul(d))
        .unwrap_or(usize::MAX);
    let cap = crate::tensor::max_bytes();
    if bytes > cap {
        return Err(Error::Graph(format!(
            "{what} needs a {dt} constant of shape {} ({bytes} bytes), over the memory limit of {cap} bytes",
            crate::tensor::fmt_shape(shape)
        )));
    }
    Ok(())
}

pub(super) fn bin(b: BinaryOp) -> Op {
    Op::Binary(b)
}

pub(super) fn un(u: UnaryOp) -> Op {
    Op::Unary(u)
}

pub(super) fn squeeze(axis: i64) -> Op {
    Op::Squeeze {
        axes: Some(vec![axis]),
    }
}

pub(super) fn unsqueeze(axis: i64) -> Op {
    Op::Unsqueeze {
        axes: Some(vec![axis]),
    }
}

pub(super) fn shape(start: i64, end: Option<i64>) -> Op {
    Op::Shape { start, end }
}

pub(super) fn reshape() -> Op {
    Op::Reshape { allowzero: false }
}

fn concat_last() -> Op {
    Op::Concat { axis: -1 }
}

impl Importer<'_> {
    /// Writes one of `COMPOSITE` or `MS_COMPOSITE`.
    pub(super) fn lower_composite(
        &mut self,
        n: &NodeProto,
        shown: &str,
        attrs: Vec<Attr>,
    ) -> Result<()> {
        let a = Attrs::of(n, shown, attrs)?;
        let what = a.what.clone();
        match n.op_type.as_str() {
            "Size" => self.size(n, &what, a),
            "NegativeLogLikelihoodLoss" => self.nll(n, &what, a),
            "SimplifiedLayerNormalization" => self.rms_norm(n, &what, a),
            "SkipSimplifiedLayerNormalization" => self.skip_rms_norm(n, &what, a),
            "SkipLayerNormalization" => self.skip_layer_norm(n, &what, a),
            "LpNormalization" => self.lp_norm(n, &what, a),
            "MeanVarianceNormalization" => self.mvn(n, &what, a),
            "Shrink" => self.shrink(n, &what, a),
            "DepthToSpace" | "SpaceToDepth" => self.block_shuffle(n, &what, a),
            "GlobalAveragePool" | "GlobalMaxPool" => self.global_pool(n, &what, a),
            "InstanceNormalization" | "GroupNormalization" => self.group_norm(n, &what, a),
            "BatchNormalization" => self.batch_norm(n, &what, a),
            "RotaryEmbedding" => self.rotary(n, &what, a),
            "QuantizeLinear" => self.quantize(n, &what, a),
            "DequantizeLinear" => self.dequantize(n, &what, a),
            "DynamicQuantizeLinear" => self.dynamic_quantize(n, &what, a),
            "CenterCropPad" => self.center_crop_pad(n, &what, a),
            "LRN" => self.lrn(n, &what, a),
            "GridSample" => self.grid_sample(n, &what, a),
            "AffineGrid" => self.affine_grid(n, &what, a),
            "DFT" => self.dft(n, &what, a),
            "STFT" => self.stft(n, &what, a),
            "MelWeightMatrix" => self.mel_weight_matrix(n, &what, a),
            "Bernoulli" => self.bernoulli(n, &what, a),
            "Multinomial" => self.multinomial(n, &what, a),
            _ => self.window(n, &what, a),
        }
    }

    /// A helper node `op(ins)` whose one output is a new value named after the node's
    /// first output (and the node after the node, with the same suffix).
    pub(super) fn val(&mut self, n: &NodeProto, what: &str, op: Op, ins: Vec<String>) -> String {
        let out = &n.output[0];
        let v = self.fresh(&format!("{out}/{what}"));
        self.push(n, &v[out.len() + 1..], op, ins, &v);
        v
    }

    /// The node that writes output `k` of the ONNX node (the first keeps its name).
    pub(super) fn out(&mut self, n: &NodeProto, k: usize, op: Op, ins: Vec<String>) {
        let what = if k == 0 {
            String::new()
        } else {
            format!("out{k}")
        };
        let y = n.output[k].clone();
        self.push(n, &what, op, ins, &y);
    }

    /// A scalar `v` in the dtype of value `like` (an f32 constant cast like it, as ONNX's
    /// function bodies write their constants).
    pub(super) fn float_like(&mut self, n: &NodeProto, what: &str, v: f32, like: &str) -> String {
        self.const_like(n, what, Tensor::scalar(v), like)
    }

    /// Constant `t` cast to the dtype of value `like` (f64 constants keep every digit in
    /// an f64 model).
    pub(super) fn const_like(
        &mut self,
        n: &NodeProto,
        what: &str,
        t: Tensor,
        like: &str,
    ) -> String {
        let c = self.constant(n, what, t);
        self.val(
            n,
            &format!("{what}_cast"),
            Op::CastLike,
            vec![c, like.to_string()],
        )
    }

    /// A 1-D i64 constant.
    pub(super) fn ints_const(&mut self, n: &NodeProto, what: &str, v: &[i64]) -> Result<String> {
        let t = Tensor::from_vec(&[v.len()], v.to_vec())?;
        Ok(self.constant(n, what, t))
    }

    /// The axes `from..rank(x)`; from a negative `from` they are fixed (`from..0`),
    /// otherwise they need x's rank: `Range(from, Size(Shape(x)), 1)`.
    pub(super) fn axes_from(&mut self, n: &NodeProto, x: &str, from: i64) -> Result<Axes> {
        if from < 0 {
            return Ok(Axes::Fixed((from..0).collect()));
        }
        let s = self.val(n, "shape", shape(0, None), vec![x.to_string()]);
        let r = self.val(n, "rank_1d", shape(0, None), vec![s]);
        let rank = self.val(n, "rank", squeeze(0), vec![r]);
        let start = self.constant(n, "axes_start", Tensor::scalar(from));
        let one = self.constant(n, "axes_step", Tensor::scalar(1i64));
        Ok(Axes::From(self.val(
            n,
            "axes",
            Op::Range,
            vec![start, rank, one],
        )))
    }

    /// The logical negation of the bool value `v` (v = false).
    pub(super) fn not(&mut self, n: &NodeProto, what: &str, v: String) -> Result<String> {
        let f = self.constant(
            n,
            &format!("{what}_false"),
            Tensor::from_f64(DType::Bool, &[], &[0.0])?,
        );
        Ok(self.val(n, what, bin(BinaryOp::Equal), vec![v, f]))
    }

    /// `kind` over `axes` of x.
    pub(super) fn reduce(
        &mut self,
        n: &NodeProto,
        what: &str,
        kind: ReduceKind,
        x: &str,
        axes: &Axes,
        keepdims: bool,
    ) -> String {
        let (op, ins) = reduce_op(kind, x, axes, keepdims);
        self.val(n, what, op, ins)
    }

    /// Size(x) = the one dim of Flatten(x, 0)'s second axis: the element count as an i64
    /// scalar, known once x's shape is (folded when the plan is made).
    fn size(&mut self, n: &NodeProto, what: &str, a: Attrs) -> Result<()> {
        a.finish()?;
        let (ins, _) = inputs(n, what, (1, 1), 1)?;
        let x = ins[0].clone();
        let flat = self.val(n, "flat", Op::Flatten { axis: 0 }, vec![x]);
        let count = self.val(n, "count", shape(1, None), vec![flat]);
        self.out(n, 0, squeeze(0), vec![count]);
        Ok(())
    }

    /// NegativeLogLikelihoodLoss: loss[n, d..] = -input[n, target[n, d..], d..] ·
    /// weight[target[n, d..]] (weight 1 when absent), 0 where target = ignore_index; then
    /// none, sum, or mean = sum / Σ of the weights of the targets not ignored (the mean of
    /// the elements when there is neither weight nor ignore_index). The picked element is
    /// GatherElements along axis 1, which differentiates into a scatter.
    fn nll(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let reduction = a.string("reduction", "mean")?;
        if !["none", "sum", "mean"].contains(&reduction.as_str()) {
            return Err(a.refuse(
                "reduction",
                &format!("must be \"none\", \"sum\" or \"mean\", got \"{reduction}\""),
            ));
        }
        let ignore = a.opt_int("ignore_index")?;
        // The comparison with ignore_index runs in i32 (the WebGPU backend compares no
        // i64); class indices fit, and so must the ignored value.
        let ignore = match ignore.map(i32::try_from) {
            None => None,
            Some(Ok(v)) => Some(v),
            Some(Err(_)) => {
                return Err(a.refuse(
                    "ignore_index",
                    "is outside the 32-bit range graphrun compares targets in",
                ))
            }
        };
        a.finish()?;
        let (ins, opt) = inputs(n, what, (2, 3), 1)?;
        let (x, target) = (ins[0].clone(), ins[1].clone());
        let weight = opt[0].clone();
        // Ignored targets may lie outside [0, C): they are replaced by class 0 before the
        // gathers, and their weight is then set to 0.
        let (index, ignored) = match ignore {
            None => (target, None),
            Some(ii) => {
                let t32 = self.val(n, "target_i32", Op::Cast { to: DType::I32 }, vec![target]);
                let ii = self.constant(n, "ignore_index", Tensor::scalar(ii));
                let hit = self.val(n, "ignored", bin(BinaryOp::Equal), vec![t32.clone(), ii]);
                let zero = self.constant(n, "class0", Tensor::scalar(0i32));
                let safe = self.val(n, "target_safe", Op::Where, vec![hit.clone(), zero, t32]);
                (safe, Some(hit))
            }
        };
        let idx = self.val(n, "index", unsqueeze(1), vec![index.clone()]);
        let picked = self.val(
            n,
            "picked",
            Op::GatherElements { axis: 1 },
            vec![x.clone(), idx],
        );
        let picked = self.val(n, "picked_sq", squeeze(1), vec![picked]);
        let neg = self.val(n, "neg", un(UnaryOp::Neg), vec![picked]);
        // The per-element weight: weight[target], or 1; 0 where ignored.
        let w = weight.map(|w| self.val(n, "weight_at", Op::Gather { axis: 0 }, vec![w, index]));
        let w = match (w, ignored) {
            (w, None) => w,
            (w, Some(hit)) => {
                let zero = self.float_like(n, "zero", 0.0, &x);
                let kept = match w {
                    Some(w) => w,
                    None => self.float_like(n, "one", 1.0, &x),
                };
                Some(self.val(n, "weight_kept", Op::Where, vec![hit, zero, kept]))
            }
        };
        let loss = match &w {
            Some(w) if reduction == "none" => {
                self.out(n, 0, bin(BinaryOp::Mul), vec![neg, w.clone()]);
                return Ok(());
            }
            Some(w) => self.val(n, "weighted", bin(BinaryOp::Mul), vec![neg, w.clone()]),
            None if reduction == "none" => {
                self.out(n, 0, Op::Identity, vec![neg]);
                return Ok(());
            }
            None => neg,
        };
        let all = |kind| Op::Reduce {
            kind,
            axes: None,
            keepdims: false,
            noop_with_empty_axes: false,
        };
        match (reduction.as_str(), w) {
            ("sum", _) => self.out(n, 0, all(ReduceKind::Sum), vec![loss]),
            (_, None) => self.out(n, 0, all(ReduceKind::Mean), vec![loss]),
            (_, Some(w)) => {
                let total = self.val(n, "total", all(ReduceKind::Sum), vec![loss]);
                let wsum = self.val(n, "weight_sum", all(ReduceKind::Sum), vec![w]);
                self.out(n, 0, bin(BinaryOp::Div), vec![total, wsum]);
            }
        }
        Ok(())
    }

    /// x / sqrt(mean(x², axes axis..) + epsilon), computed in `stash` (x cast to it, the
    /// result cast back, as RMSNormalization's function body does); returns the result
    /// and the root (in `stash`).
    fn rms_core(
        &mut self,
        n: &NodeProto,
        x: &str,
        axis: i64,
        epsilon: f32,
        stash: DType,
    ) -> Result<(String, String)> {
        let axes = self.axes_from(n, x, axis)?;
        let xu = self.val(n, "x_stash", Op::Cast { to: stash }, vec![x.to_string()]);
        let sq = self.val(
            n,
            "square",
            bin(BinaryOp::Mul),
            vec![xu.clone(), xu.clone()],
        );
        let ms = self.reduce(n, "mean_square", ReduceKind::Mean, &sq, &axes, true);
        let eps = Tensor::from_f64(stash, &[], &[epsilon as f64])?;
        let eps = self.constant(n, "epsilon", eps);
        let ms = self.val(n, "mean_square_eps", bin(BinaryOp::Add), vec![ms, eps]);
        let rms = self.val(n, "rms", un(UnaryOp::Sqrt), vec![ms]);
        let y = self.val(n, "normalized", bin(BinaryOp::Div), vec![xu, rms.clone()]);
        let y = self.val(n, "normalized_cast", Op::CastLike, vec![y, x.to_string()]);
        Ok((y, rms))
    }

    /// ONNX Runtime's SimplifiedLayerNormalization (RMSNormalization with an optional
    /// second output inv_std_var = 1 / rms): Y = rms_core(X) · scale. The stash type is
    /// kept as written, so this stays a chain for the normalization fusion to find.
    fn rms_norm(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let axis = a.int("axis", -1)?;
        let epsilon = a.float("epsilon", 1e-5)?;
        let stash = a.float_dtype("stash_type", 1)?;
        a.finish()?;
        let (ins, _) = inputs(n, what, (2, 2), 2)?;
        let (x, scale) = (ins[0].clone(), ins[1].clone());
        let (y, rms) = self.rms_core(n, &x, axis, epsilon, stash)?;
        self.out(n, 0, bin(BinaryOp::Mul), vec![y, scale]);
        if output(n, 1).is_some() {
            self.out(n, 1, un(UnaryOp::Reciprocal), vec![rms]);
        }
        Ok(())
    }

    /// ONNX Runtime's SkipSimplifiedLayerNormalization: s = input + skip (+ bias), output
    /// = rms_core(s, last axis) · gamma, computed in f32 as ONNX Runtime does for f16;
    /// outputs inv_std_var (1 / rms) and input_skip_bias_sum (s) on request. Its "mean"
    /// output is not defined for an RMS normalization and is refused.
    fn skip_rms_norm(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let epsilon = a.float("epsilon", 1e-12)?;
        a.finish()?;
        let (ins, opt) = inputs(n, what, (3, 4), 4)?;
        if output(n, 1).is_some() {
            return Err(Error::Graph(format!(
                "{what}: output 1 (mean) is not computed by an RMS normalization; leave it unnamed"
            )));
        }
        let [x, skip, gamma] = [0, 1, 2].map(|k| ins[k].clone());
        let s = self.skip_sum(n, x, skip, opt[0].clone());
        let (y, rms) = self.rms_core(n, &s, -1, epsilon, DType::F32)?;
        self.out(n, 0, bin(BinaryOp::Mul), vec![y, gamma]);
        if output(n, 2).is_some() {
            self.out(n, 2, un(UnaryOp::Reciprocal), vec![rms]);
        }
        Ok(())
    }

    /// ONNX Runtime's SkipLayerNormalization: s = input + skip (+ bias), output =
    /// LayerNormalization(s, last axis) · gamma (+ beta); mean and inv_std_var (per row,
    /// float) and input_skip_bias_sum (s) on request. The Add and the normalization are
    /// fused again by the `residual_norm` rule where skip has the input's shape.
    fn skip_layer_norm(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let epsilon = a.float("epsilon", 1e-12)?;
        a.finish()?;
        let (ins, opt) = inputs(n, what, (3, 5), 4)?;
        let [x, skip, gamma] = [0, 1, 2].map(|k| ins[k].clone());
        let s = self.skip_sum(n, x, skip, opt[1].clone());
        let mut ins = vec![s, gamma];
        ins.extend(opt[0].clone());
        let mut outputs: Vec<String> = (0..3)
            .map(|k| output(n, k).unwrap_or("").to_string())
            .collect();
        while outputs.last().is_some_and(|o| o.is_empty()) {
            outputs.pop();
        }
        let op = Op::LayerNormalization {
            axis: -1,
            epsilon,
            rms: false,
            residual: false,
        };
        self.nodes.push(crate::graph::Node {
            name: n.name.clone(),
            op,
            inputs: ins,
            outputs,
            loc: None,
        });
        Ok(())
    }

    /// The Skip normalizations' `input + skip (+ bias)`, written to their output 3
    /// (input_skip_bias_sum) when the node names it.
    fn skip_sum(&mut self, n: &NodeProto, x: String, skip: String, bias: Option<String>) -> String {
        let sum_out = output(n, 3).map(str::to_string);
        let mut s = match (&bias, &sum_out) {
            (None, Some(o)) => {
                self.out(n, 3, bin(BinaryOp::Add), vec![x, skip]);
                o.clone()
            }
            _ => self.val(n, "sum", bin(BinaryOp::Add), vec![x, skip]),
        };
        if let Some(bias) = bias {
            let ins = vec![s, bias];
            s = match &sum_out {
                Some(o) => {
                    self.out(n, 3, bin(BinaryOp::Add), ins);
                    o.clone()
                }
                None => self.val(n, "sum_bias", bin(BinaryOp::Add), ins),
            };
        }
        s
    }

    /// LpNormalization: x / ‖x‖_p along `axis` (p 1 or 2), 0 where the norm is 0 (then x
    /// is 0 there, so dividing by 1 instead gives it without a 0/0).
    fn lp_norm(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let axis = a.int("axis", -1)?;
        let p = a.int("p", 2)?;
        if p != 1 && p != 2 {
            return Err(a.refuse("p", &format!("must be 1 or 2, got {p}")));
        }
        a.finish()?;
        let (ins, _) = inputs(n, what, (1, 1), 1)?;
        let x = ins[0].clone();
        let axes = Axes::Fixed(vec![axis]);
        let norm = if p == 1 {
            let abs = self.val(n, "abs", un(UnaryOp::Abs), vec![x.clone()]);
            self.reduce(n, "norm", ReduceKind::Sum, &abs, &axes, true)
        } else {
            let sq = self.val(n, "square", bin(BinaryOp::Mul), vec![x.clone(), x.clone()]);
            let ss = self.reduce(n, "sum_square", ReduceKind::Sum, &sq, &axes, true);
            self.val(n, "norm", un(UnaryOp::Sqrt), vec![ss])
        };
        let zero = self.float_like(n, "zero", 0.0, &x);
        let one = self.float_like(n, "one", 1.0, &x);
        let is0 = self.val(
            n,
            "norm_is_0",
            bin(BinaryOp::Equal),
            vec![norm.clone(), zero],
        );
        let safe = self.val(n, "norm_safe", Op::Where, vec![is0, one, norm]);
        self.out(n, 0, bin(BinaryOp::Div), vec![x, safe]);
        Ok(())
    }

    /// MeanVarianceNormalization: (x - mean) / (sqrt(var) + 1e-9) over `axes` (default
    /// [0, 2, 3]). The function body takes var = E[x²] - E[x]²; E[(x - mean)²] is the
    /// same value without the cancellation (never negative).
    fn mvn(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let axes = Axes::Fixed(a.ints("axes", &[0, 2, 3])?);
        a.finish()?;
        let (ins, _) = inputs(n, what, (1, 1), 1)?;
        let x = ins[0].clone();
        let mean = self.reduce(n, "mean", ReduceKind::Mean, &x, &axes, true);
        let d = self.val(n, "centered", bin(BinaryOp::Sub), vec![x.clone(), mean]);
        let sq = self.val(n, "square", bin(BinaryOp::Mul), vec![d.clone(), d.clone()]);
        let var = self.reduce(n, "variance", ReduceKind::Mean, &sq, &axes, true);
        let std = self.val(n, "std", un(UnaryOp::Sqrt), vec![var]);
        let eps = self.float_like(n, "epsilon", 1e-9, &x);
        let den = self.val(n, "std_eps", bin(BinaryOp::Add), vec![std, eps]);
        self.out(n, 0, bin(BinaryOp::Div), vec![d, den]);
        Ok(())
    }

    /// Shrink, as its function body: x + bias where x < -lambd, x - bias where x > lambd,
    /// else 0, the attributes cast like x.
    fn shrink(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let bias = a.float("bias", 0.0)?;
        let lambd = a.float("lambd", 0.5)?;
        a.finish()?;
        let (ins, _) = inputs(n, what, (1, 1), 1)?;
        let x = ins[0].clone();
        let l = self.float_like(n, "lambd", lambd, &x);
        let b = self.float_like(n, "bias", bias, &x);
        let zero = self.float_like(n, "zero", 0.0, &x);
        let neg_l = self.val(n, "neg_lambd", un(UnaryOp::Neg), vec![l.clone()]);
        let below = self.val(n, "below", bin(BinaryOp::Less), vec![x.clone(), neg_l]);
        let above = self.val(n, "above", bin(BinaryOp::Less), vec![l, x.clone()]);
        let plus = self.val(
            n,
            "plus_bias",
            bin(BinaryOp::Add),
            vec![x.clone(), b.clone()],
        );
        let minus = self.val(n, "minus_bias", bin(BinaryOp::Sub), vec![x, b]);
        let upper = self.val(n, "upper", Op::Where, vec![above, minus, zero]);
        self.out(n, 0, Op::Where, vec![below, plus, upper]);
        Ok(())
    }

    /// DepthToSpace (DCR or CRD) and SpaceToDepth on [N, C, H, W]: Reshape to 6-D,
    /// Transpose, Reshape back, as ONNX defines them; the reshape targets take H and W
    /// from `Shape` (0 keeps N, -1 infers the channel dim).
    fn block_shuffle(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let Some(b) = a.opt_int("blocksize")? else {
            return Err(Error::Graph(format!(
                "{what}: attribute 'blocksize' is required"
            )));
        };
        if b <= 0 {
            return Err(a.refuse("blocksize", &format!("must be positive, got {b}")));
        }
        let to_space = n.op_type == "DepthToSpace";
        let mode = if to_space {
            a.string("mode", "DCR")?
        } else {
            String::new()
        };
        if to_space && mode != "DCR" && mode != "CRD" {
            return Err(a.refuse(
                "mode",
                &format!("must be \"DCR\" or \"CRD\", got \"{mode}\""),
            ));
        }
        a.finish()?;
        let (ins, _) = inputs(n, what, (1, 1), 1)?;
        let x = ins[0].clone();
        let hw = self.val(n, "hw", shape(2, Some(4)), vec![x.clone()]);
        let bb = self.ints_const(n, "blocks", &[b, b])?;
        let (first, perm, hw_out) = if to_space {
            let (head, perm) = if mode == "DCR" {
                ([0, b, b, -1], vec![0, 3, 4, 1, 5, 2])
            } else {
                ([0, -1, b, b], vec![0, 1, 4, 2, 5, 3])
            };
            let head = self.ints_const(n, "split_head", &head)?;
            let first = self.val(
                n,
                "split_shape",
                Op::Concat { axis: 0 },
                vec![head, hw.clone()],
            );
            let hw_out = self.val(n, "hw_out", bin(BinaryOp::Mul), vec![hw, bb]);
            (first, perm, hw_out)
        } else {
            let w = self.val(n, "w", shape(3, Some(4)), vec![x.clone()]);
            let bk = self.ints_const(n, "block", &[b])?;
            let wb = self.val(n, "w_blocks", bin(BinaryOp::Div), vec![w, bk.clone()]);
            let head = self.ints_const(n, "split_head", &[0, 0, -1, b])?;
            let first = self.val(n, "split_shape", Op::Concat { axis: 0 }, vec![head, wb, bk]);
            let hw_out = self.val(n, "hw_out", bin(BinaryOp::Div), vec![hw, bb]);
            (first, vec![0, 3, 5, 1, 2, 4], hw_out)
        };
        let split = self.val(n, "split", reshape(), vec![x, first]);
        let moved = self.val(n, "moved", Op::Transpose { perm: Some(perm) }, vec![split]);
        let head = self.ints_const(n, "out_head", &[0, -1])?;
        let last = self.val(n, "out_shape", Op::Concat { axis: 0 }, vec![head, hw_out]);
        self.out(n, 0, reshape(), vec![moved, last]);
        Ok(())
    }

    /// GlobalAveragePool / GlobalMaxPool: ReduceMean / ReduceMax over axes 2.., kept.
    fn global_pool(&mut self, n: &NodeProto, what: &str, a: Attrs) -> Result<()> {
        a.finish()?;
        let (ins, _) = inputs(n, what, (1, 1), 1)?;
        let x = ins[0].clone();
        let kind = if n.op_type == "GlobalMaxPool" {
            ReduceKind::Max
        } else {
            ReduceKind::Mean
        };
        let axes = self.axes_from(n, &x, 2)?;
        let (op, ins) = reduce_op(kind, &x, &axes, true);
        self.out(n, 0, op, ins);
        Ok(())
    }

    /// Rows of a 3-D `x` normalized along their last axis, (x - mean) / sqrt(var + eps):
    /// graphrun's LayerNormalization with a unit scale (Expand of 1 to the row length).
    fn normalize_rows(&mut self, n: &NodeProto, x3: &str, epsilon: f32) -> String {
        let one = self.float_like(n, "one", 1.0, x3);
        let len = self.val(n, "row_len", shape(2, None), vec![x3.to_string()]);
        let ones = self.val(n, "unit_scale", Op::Expand, vec![one, len]);
        self.val(
            n,
            "normalized",
            Op::LayerNormalization {
                axis: -1,
                epsilon,
                rms: false,
                residual: false,
            },
            vec![x3.to_string(), ones],
        )
    }

    /// `v` · scale + bias with [C] scale and bias broadcast over [N, C, L] (unsqueezed to
    /// [C, 1]).
    fn channel_affine(&mut self, n: &NodeProto, v: &str, scale: &str, bias: &str) -> String {
        let s = self.val(n, "scale_c1", unsqueeze(1), vec![scale.to_string()]);
        let b = self.val(n, "bias_c1", unsqueeze(1), vec![bias.to_string()]);
        let m = self.val(n, "scaled", bin(BinaryOp::Mul), vec![v.to_string(), s]);
        self.val(n, "affine", bin(BinaryOp::Add), vec![m, b])
    }

    /// InstanceNormalization: each [n, c] plane normalized (x viewed as [N, C, L]), then
    /// scale[c] · x̂ + B[c]. GroupNormalization: each group of C / num_groups channels
    /// normalized (x viewed as [N, G, L]), then the affine per channel (opset 21) or, as
    /// opset 18 defined it, per group. stash_type (opset 21) only selects the
    /// accumulation type; graphrun's LayerNormalization accumulates in f32 or wider.
    fn group_norm(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let epsilon = a.float("epsilon", 1e-5)?;
        let instance = n.op_type == "InstanceNormalization";
        let groups = if instance {
            None
        } else {
            match a.opt_int("num_groups")? {
                Some(g) if g > 0 => Some(g),
                Some(g) => {
                    return Err(a.refuse("num_groups", &format!("must be positive, got {g}")))
                }
                None => {
                    return Err(Error::Graph(format!(
                        "{what}: attribute 'num_groups' is required"
                    )))
                }
            }
        };
        if !instance {
            a.float_dtype("stash_type", 1)?;
        }
        a.finish()?;
        let (ins, _) = inputs(n, what, (3, 3), 1)?;
        let [x, scale, bias] = [0, 1, 2].map(|k| ins[k].clone());
        let full = self.val(n, "x_shape", shape(0, None), vec![x.clone()]);
        let rows = match groups {
            None => self.ints_const(n, "rows_shape", &[0, 0, -1])?,
            Some(g) => self.ints_const(n, "rows_shape", &[0, g, -1])?,
        };
        let x3 = self.val(n, "rows", reshape(), vec![x.clone(), rows]);
        let mut norm = self.normalize_rows(n, &x3, epsilon);
        if groups.is_some() && self.opset >= 21 {
            // Back to [N, C, L] for the per-channel affine.
            let nc = self.val(n, "nc", shape(0, Some(2)), vec![x]);
            let rest = self.ints_const(n, "rest", &[-1])?;
            let ncl = self.val(n, "ncl_shape", Op::Concat { axis: 0 }, vec![nc, rest]);
            norm = self.val(n, "channels", reshape(), vec![norm, ncl]);
        }
        let y3 = self.channel_affine(n, &norm, &scale, &bias);
        self.out(n, 0, reshape(), vec![y3, full]);
        Ok(())
    }

    /// BatchNormalization. Inference form: (x - mean) · scale / sqrt(var + epsilon) + B per
    /// channel (axis 1). Training form (training_mode = 1, opset 14 on): the same with the
    /// batch's statistics (the mean and biased variance over every axis but 1), and the
    /// running statistics as outputs 1 and 2: momentum · running + (1 - momentum) · batch.
    /// Imported for training (`batch_norm_mode`), an inference-form node takes the
    /// training form as PyTorch's train() runs it: the running variance then moves
    /// towards the unbiased batch variance (n / (n - 1) times the biased one, n the
    /// number of values per channel). Imported for eval, every node takes the inference
    /// form.
    fn batch_norm(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let epsilon = a.float("epsilon", 1e-5)?;
        let momentum = a.float("momentum", 0.9)?;
        let written = a.flag("training_mode")?;
        let training = self.batch_norm_mode.unwrap_or(written);
        let unbiased = training && !written;
        // Before opset 9: spatial=0 gives per-element statistics, which graphrun does not run.
        if a.int("spatial", 1)? != 1 {
            return Err(a.refuse("spatial", "= 0 is not supported"));
        }
        a.finish()?;
        let outs = if training { 3 } else { 1 };
        if n.output.iter().skip(outs).any(|o| !o.is_empty()) {
            return Err(Error::Graph(format!(
                "{what}: outputs beyond {} (the saved statistics of opsets before 14) are not supported",
                if training { "Y and the running statistics" } else { "Y (running statistics need training_mode = 1)" }
            )));
        }
        let (ins, _) = inputs(n, what, (5, 5), outs)?;
        let [x, scale, bias, mean, var] = [0, 1, 2, 3, 4].map(|k| ins[k].clone());
        let full = self.val(n, "x_shape", shape(0, None), vec![x.clone()]);
        let rows = self.ints_const(n, "rows_shape", &[0, 0, -1])?;
        let x3 = self.val(n, "rows", reshape(), vec![x, rows]);
        let (m, v) = if training {
            // [1, C, 1] statistics of the [N, C, L] rows.
            let stat = |me: &mut Self, what: &str, v: String| {
                let (op, ins) = reduce_op(ReduceKind::Mean, &v, &Axes::Fixed(vec![0, 2]), true);
                me.val(n, what, op, ins)
            };
            let m = stat(self, "batch_mean", x3.clone());
            let d = self.val(
                n,
                "batch_centered",
                bin(BinaryOp::Sub),
                vec![x3.clone(), m.clone()],
            );
            let d2 = self.val(n, "batch_sq", bin(BinaryOp::Mul), vec![d.clone(), d]);
            let v = stat(self, "batch_var", d2);
            let flat = self.ints_const(n, "stat_flat", &[-1])?;
            let keep = self.float_like(n, "momentum", momentum, &mean);
            let take = self.float_like(n, "one_minus_momentum", 1.0 - momentum, &mean);
            let mut running_var = v.clone();
            if unbiased && n.output.get(2).is_some_and(|o| !o.is_empty()) {
                // n / (n - 1) from the shape of the [N, C, L] rows: n = N · L.
                let first = self.val(n, "count_n", shape(0, Some(1)), vec![x3.clone()]);
                let last = self.val(n, "count_l", shape(2, None), vec![x3.clone()]);
                let count = self.val(n, "count", bin(BinaryOp::Mul), vec![first, last]);
                let count = self.val(n, "count_f", Op::CastLike, vec![count, v.clone()]);
                let one = self.float_like(n, "one", 1.0, &v);
                let less = self.val(
                    n,
                    "count_less",
                    bin(BinaryOp::Sub),
                    vec![count.clone(), one],
                );
                let ratio = self.val(n, "bessel", bin(BinaryOp::Div), vec![count, less]);
                running_var = self.val(
                    n,
                    "batch_var_unbiased",
                    bin(BinaryOp::Mul),
                    vec![v.clone(), ratio],
                );
            }
            for (k, run, batch) in [(1, mean.clone(), m.clone()), (2, var.clone(), running_var)] {
                if n.output.get(k).is_none_or(|o| o.is_empty()) {
                    continue;
                }
                let b = self.val(
                    n,
                    &format!("batch_stat{k}"),
                    reshape(),
                    vec![batch, flat.clone()],
                );
                let old = self.val(
                    n,
                    &format!("kept{k}"),
                    bin(BinaryOp::Mul),
                    vec![run, keep.clone()],
                );
                let new = self.val(
                    n,
                    &format!("taken{k}"),
                    bin(BinaryOp::Mul),
                    vec![b, take.clone()],
                );
                self.out(n, k, bin(BinaryOp::Add), vec![old, new]);
            }
            (m, v)
        } else {
            let m = self.val(n, "mean_c1", unsqueeze(1), vec![mean]);
            let v = self.val(n, "var_c1", unsqueeze(1), vec![var]);
            (m, v)
        };
        let eps = self.float_like(n, "epsilon", epsilon, &v);
        let ve = self.val(n, "var_eps", bin(BinaryOp::Add), vec![v, eps]);
        let sd = self.val(n, "std", un(UnaryOp::Sqrt), vec![ve]);
        let d = self.val(n, "centered", bin(BinaryOp::Sub), vec![x3, m]);
        let normed = self.val(n, "normalized", bin(BinaryOp::Div), vec![d, sd]);
        let y3 = self.channel_affine(n, &normed, &scale, &bias);
        self.out(n, 0, reshape(), vec![y3, full]);
        Ok(())
    }

    /// HannWindow, HammingWindow and BlackmanWindow, as their function bodies: in f32,
    /// a0 - a1·cos(k·τ/N') + a2·cos(2k·τ/N') for k in 0..size, N' = size (periodic) or
    /// size - 1 (symmetric), cast to output_datatype. The length is the value of `size`,
    /// known when the plan is made.
    fn window(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let periodic = a.int("periodic", 1)?;
        if periodic != 0 && periodic != 1 {
            return Err(a.refuse("periodic", &format!("must be 0 or 1, got {periodic}")));
        }
        let to = a.output_datatype()?;
        a.finish()?;
        let (ins, _) = inputs(n, what, (1, 1), 1)?;
        let size = ins[0].clone();
        let (a0, a1, a2) = match n.op_type.as_str() {
            "HannWindow" => (0.5f32, 0.5f32, 0.0f32),
            "HammingWindow" => (25.0 / 46.0, 21.0 / 46.0, 0.0),
            _ => (0.42, 0.5, 0.08),
        };
        let c = |me: &mut Self, what: &str, v: f32| me.constant(n, what, Tensor::scalar(v));
        let len = self.val(n, "size_f", Op::Cast { to: DType::F32 }, vec![size]);
        let one = c(self, "one", 1.0);
        let period = if periodic == 1 {
            len.clone()
        } else {
            self.val(
                n,
                "period",
                bin(BinaryOp::Sub),
                vec![len.clone(), one.clone()],
            )
        };
        let tau = c(self, "tau", std::f32::consts::TAU);
        let step = self.val(n, "step", bin(BinaryOp::Div), vec![tau, period]);
        let zero = c(self, "zero", 0.0);
        let k = self.val(n, "k", Op::Range, vec![zero, len, one]);
        let angle = self.val(n, "angle", bin(BinaryOp::Mul), vec![k, step]);
        let cos1 = self.val(n, "cos1", un(UnaryOp::Cos), vec![angle.clone()]);
        let a1 = c(self, "a1", a1);
        let t1 = self.val(n, "a1_term", bin(BinaryOp::Mul), vec![a1, cos1]);
        let a0 = c(self, "a0", a0);
        let mut w = self.val(n, "a0_minus", bin(BinaryOp::Sub), vec![a0, t1]);
        if a2 != 0.0 {
            let two = c(self, "two", 2.0);
            let angle2 = self.val(n, "angle2", bin(BinaryOp::Mul), vec![angle, two]);
            let cos2 = self.val(n, "cos2", un(UnaryOp::Cos), vec![angle2]);
            let a2 = c(self, "a2", a2);
            let t2 = self.val(n, "a2_term", bin(BinaryOp::Mul), vec![a2, cos2]);
            w = self.val(n, "window", bin(BinaryOp::Add), vec![w, t2]);
        }
        self.out(n, 0, Op::Cast { to }, vec![w]);
        Ok(())
    }

    /// Slice of x's last axis: `starts`, `ends` (and `steps`) are i64 values.
    fn slice_last(
        &mut self,
        n: &NodeProto,
        what: &str,
        x: &str,
        range: [&str; 2],
        steps: Option<&str>,
    ) -> Result<String> {
        let axes = self.ints_const(n, &format!("{what}_axes"), &[-1])?;
        let mut ins = vec![
            x.to_string(),
            range[0].to_string(),
            range[1].to_string(),
            axes,
        ];
        ins.extend(steps.map(str::to_string));
        Ok(self.val(n, what, Op::Slice, ins))
    }

    /// RotaryEmbedding (ai.onnx opset 23; inputs X, cos_cache, sin_cache, position_ids?)
    /// and ONNX Runtime's com.microsoft one (inputs X, position_ids, cos_cache,
    /// sin_cache), as ONNX's reference computes it. X is [B, H, S, D], or [B, S, N·D]
    /// viewed as [B, S, N, D]; in either layout the caches, gathered at the positions to
    /// [B, S, d/2] (or given so without position_ids), get a unit axis for the heads (-3
    /// or -2), so no transpose is needed. Which layout applies comes from X's rank at
    /// plan time (`Shape(Shape(X))`), so X's rank need not be declared. The first d =
    /// rotary_embedding_dim (default D) elements of each head are rotated, the rest pass
    /// through: with x1, x2 the two halves (or the even and odd elements, interleaved),
    /// x1·cos - x2·sin and x2·cos + x1·sin take their places (graphrun's Rotary).
    fn rotary(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let ms = n.domain == "com.microsoft";
        let interleaved = a.flag("interleaved")?;
        let heads = a.int("num_heads", 0)?;
        if heads < 0 {
            return Err(a.refuse("num_heads", &format!("must be positive, got {heads}")));
        }
        let dim = a.int("rotary_embedding_dim", 0)?;
        if dim < 0 || dim % 2 != 0 {
            return Err(a.refuse(
                "rotary_embedding_dim",
                &format!("must be a non-negative even number, got {dim}"),
            ));
        }
        if ms {
            // ONNX Runtime reads `scale` only to regenerate caches too short for the
            // sequence, which its kernels do not implement.
            let scale = a.float("scale", 1.0)?;
            if scale != 1.0 {
                return Err(a.refuse("scale", &format!("= {scale} is not supported (only 1)")));
            }
            if a.flag("is_packed_batching")? {
                return Err(a.refuse(
                    "is_packed_batching",
                    "= 1 (ragged batches) is not supported",
                ));
            }
            if dim > 0 && heads == 0 {
                return Err(a.refuse(
                    "rotary_embedding_dim",
                    "needs num_heads (as ONNX Runtime requires)",
                ));
            }
        }
        a.finish()?;
        let (x, cos, sin, pos) = if ms {
            let (ins, _) = inputs(n, what, (4, 4), 1)?;
            let [x, p, c, s] = [0, 1, 2, 3].map(|k| ins[k].clone());
            (x, c, s, Some(p))
        } else {
            let (ins, opt) = inputs(n, what, (3, 4), 1)?;
            let [x, c, s] = [0, 1, 2].map(|k| ins[k].clone());
            (x, c, s, opt[0].clone())
        };
        if heads == 0 && dim > 0 && self.ranks.get(&x) == Some(&3) {
            return Err(a.refuse(
                "num_heads",
                "is required for a 3-D input with rotary_embedding_dim",
            ));
        }
        // The layout, decided at plan time: is X 3-D?
        let x_shape = self.val(n, "x_shape", shape(0, None), vec![x.clone()]);
        let rank = self.val(n, "x_rank", shape(0, None), vec![x_shape.clone()]);
        let three = self.ints_const(n, "three", &[3])?;
        let is3 = self.val(n, "x_is_3d", bin(BinaryOp::Equal), vec![rank, three]);
        let pick = |me: &mut Self, what: &str, if3: &[i64], if4: &[i64]| -> Result<String> {
            let a3 = me.ints_const(n, &format!("{what}_3d"), if3)?;
            let a4 = me.ints_const(n, &format!("{what}_4d"), if4)?;
            Ok(me.val(n, what, Op::Where, vec![is3.clone(), a3, a4]))
        };
        // [B, S, N·D] splits into [B, S, N, D]: N from num_heads, or (ONNX Runtime's
        // rule, for a full rotation) D from the caches' width, 2·(D/2). A 4-D X keeps its
        // shape; so would a 3-D one without either rule, which Reshape then refuses.
        let split = if heads > 0 {
            pick(self, "heads_split", &[0, 0, heads, -1], &[0, 0, 0, 0])?
        } else if dim > 0 {
            self.ints_const(n, "heads_split", &[0, 0, 0, 0])?
        } else {
            let width = self.val(n, "cache_width", shape(-1, None), vec![cos.clone()]);
            let two = self.ints_const(n, "two", &[2])?;
            let d = self.val(n, "head_dim", bin(BinaryOp::Mul), vec![width, two]);
            let head = self.ints_const(n, "heads_split_head", &[0, 0, -1])?;
            let a3 = self.val(n, "heads_split_3d", Op::Concat { axis: 0 }, vec![head, d]);
            let a4 = self.ints_const(n, "heads_split_4d", &[0, 0, 0, 0])?;
            self.val(n, "heads_split", Op::Where, vec![is3.clone(), a3, a4])
        };
        let x4 = self.val(n, "x4", reshape(), vec![x, split]);
        let (cos, sin) = match pos {
            None => (cos, sin),
            Some(p) => {
                let at = if ms {
                    self.ms_positions(n, &x_shape, &is3, p)?
                } else {
                    p
                };
                let g = Op::Gather { axis: 0 };
                let c = self.val(n, "cos_at", g.clone(), vec![cos, at.clone()]);
                let s = self.val(n, "sin_at", g, vec![sin, at]);
                (c, s)
            }
        };
        let head_axis = pick(self, "cache_head_axis", &[-2], &[-3])?;
        let cos = self.val(
            n,
            "cos4",
            Op::Unsqueeze { axes: None },
            vec![cos, head_axis.clone()],
        );
        let sin = self.val(
            n,
            "sin4",
            Op::Unsqueeze { axes: None },
            vec![sin, head_axis],
        );
        let end = self.ints_const(n, "end", &[i64::MAX])?;
        let (rot, pass) = if dim > 0 {
            let zero = self.ints_const(n, "zero", &[0])?;
            let d = self.ints_const(n, "rotary_dim", &[dim])?;
            let rot = self.slice_last(n, "rotated_part", &x4, [&zero, &d], None)?;
            let pass = self.slice_last(n, "passed_part", &x4, [&d, &end], None)?;
            (rot, Some(pass))
        } else {
            (x4.clone(), None)
        };
        // graphrun's Rotary takes Cos and Sin as wide as the rotated part: each cache value
        // for both elements of its pair (the two halves, or adjacent elements).
        let widen = |me: &mut Self, what: &str, c: String| -> Result<String> {
            if !interleaved {
                return Ok(me.val(n, what, concat_last(), vec![c.clone(), c]));
            }
            // [.., d/2] → [.., d/2, 2] → [.., d], whatever the caches' rank.
            let lead = me.val(
                n,
                &format!("{what}_lead"),
                shape(0, Some(-1)),
                vec![c.clone()],
            );
            let last = me.ints_const(n, &format!("{what}_last"), &[-1])?;
            let flat = me.val(
                n,
                &format!("{what}_flat"),
                Op::Concat { axis: 0 },
                vec![lead, last],
            );
            let pair = me.val(n, &format!("{what}_pair"), unsqueeze(-1), vec![c]);
            let pairs = me.val(
                n,
                &format!("{what}_pairs"),
                concat_last(),
                vec![pair.clone(), pair],
            );
            Ok(me.val(n, what, reshape(), vec![pairs, flat]))
        };
        let cos = widen(self, "cos_wide", cos)?;
        let sin = widen(self, "sin_wide", sin)?;
        let rotated = self.val(
            n,
            "rotated",
            Op::Rotary { interleaved },
            vec![rot, cos, sin],
        );
        let y4 = match pass {
            Some(p) => self.val(n, "joined", concat_last(), vec![rotated, p]),
            None => rotated,
        };
        self.out(n, 0, reshape(), vec![y4, x_shape]);
        Ok(())
    }

    /// ONNX Runtime's position_ids: [B, S] positions, or one start position p (shape [1])
    /// with token s at p + s. Both are p + Range(0, S)·(rank(p) < 2), which adds zeros to
    /// the first form; S is X's dim 1 (3-D) or 2 (4-D).
    fn ms_positions(
        &mut self,
        n: &NodeProto,
        x_shape: &str,
        is3: &str,
        p: String,
    ) -> Result<String> {
        let a3 = self.ints_const(n, "seq_axis_3d", &[1])?;
        let a4 = self.ints_const(n, "seq_axis_4d", &[2])?;
        let axis = self.val(n, "seq_axis", Op::Where, vec![is3.to_string(), a3, a4]);
        let seq = self.val(
            n,
            "seq_len_1d",
            Op::Gather { axis: 0 },
            vec![x_shape.to_string(), axis],
        );
        let seq = self.val(n, "seq_len", squeeze(0), vec![seq]);
        let zero = self.constant(n, "seq_start", Tensor::scalar(0i64));
        let one = self.constant(n, "seq_step", Tensor::scalar(1i64));
        let steps = self.val(n, "seq_steps", Op::Range, vec![zero, seq, one]);
        let p_shape = self.val(n, "pos_shape", shape(0, None), vec![p.clone()]);
        let p_rank = self.val(n, "pos_rank", shape(0, None), vec![p_shape]);
        let two = self.ints_const(n, "pos_rank_2", &[2])?;
        let start_form = self.val(n, "pos_is_start", bin(BinaryOp::Less), vec![p_rank, two]);
        let start_form = self.val(
            n,
            "pos_is_start_i64",
            Op::Cast { to: DType::I64 },
            vec![start_form],
        );
        let offsets = self.val(
            n,
            "pos_offsets",
            bin(BinaryOp::Mul),
            vec![steps, start_form],
        );
        Ok(self.val(n, "positions", bin(BinaryOp::Add), vec![p, offsets]))
    }

    /// A scale or zero point `v` of (De)QuantizeLinear shaped to broadcast against x, as
    /// ONNX's reference does: a scalar or one element as it is; per axis, the [C] vector
    /// reshaped to [C, 1, .., 1] with as many ones as x has dims after `axis` (from
    /// `Shape` arithmetic for a non-negative axis); blocked (`block`), each element
    /// repeated `block` times along `axis` and cut to x's dim there — a Gather of
    /// index i / block for each i < dim, which differentiates into a scatter.
    fn quant_param(
        &mut self,
        n: &NodeProto,
        x: &str,
        v: &str,
        axis: i64,
        block: i64,
    ) -> Result<String> {
        if block > 0 {
            let end = if axis == -1 { None } else { Some(axis + 1) };
            let dim = self.val(n, "block_dim", shape(axis, end), vec![x.to_string()]);
            let dim = self.val(n, "block_dim_scalar", squeeze(0), vec![dim]);
            let zero = self.constant(n, "block_start", Tensor::scalar(0i64));
            let one = self.constant(n, "block_step", Tensor::scalar(1i64));
            let i = self.val(n, "block_positions", Op::Range, vec![zero, dim, one]);
            let b = self.constant(n, "block_size", Tensor::scalar(block));
            let at = self.val(n, "block_of", bin(BinaryOp::Div), vec![i, b]);
            return Ok(self.val(
                n,
                "per_element",
                Op::Gather { axis },
                vec![v.to_string(), at],
            ));
        }
        // Ones after the vector's dims: a fixed count for a negative axis, else
        // max(rank(x) - axis - 1, 0) (a scalar x with a per-tensor scale has none).
        let ones = if axis < 0 {
            self.ints_const(n, "trailing_ones", &vec![1; (-axis - 1) as usize])?
        } else {
            let xs = self.val(n, "x_shape", shape(0, None), vec![x.to_string()]);
            let rank = self.val(n, "x_rank", shape(0, None), vec![xs]);
            let after = self.ints_const(n, "axis_next", &[axis + 1])?;
            let k = self.val(n, "trailing", bin(BinaryOp::Sub), vec![rank, after]);
            let zero = self.ints_const(n, "no_trailing", &[0])?;
            let k = self.val(n, "trailing_count", bin(BinaryOp::Max), vec![k, zero]);
            let one = self.ints_const(n, "one", &[1])?;
            self.val(n, "trailing_ones", Op::Expand, vec![one, k])
        };
        let vs = self.val(n, "param_shape", shape(0, None), vec![v.to_string()]);
        let target = self.val(n, "param_target", Op::Concat { axis: 0 }, vec![vs, ones]);
        Ok(self.val(n, "per_axis", reshape(), vec![v.to_string(), target]))
    }

    /// axis and block_size of (De)QuantizeLinear.
    fn quant_layout(a: &mut Attrs) -> Result<(i64, i64)> {
        let axis = a.int("axis", 1)?;
        let block = a.int("block_size", 0)?;
        if block < 0 {
            return Err(a.refuse("block_size", &format!("must be non-negative, got {block}")));
        }
        Ok((axis, block))
    }

    /// QuantizeLinear: saturate(round(x / scale) + zero_point), rounding half to even and
    /// saturating to the output type's range, as ONNX's reference computes it (the
    /// division in x's type, or in `precision`'s). The output type is the zero point's,
    /// else output_dtype's, else uint8: an 8-, 16-, 4- or 2-bit integer, or a float
    /// (FLOAT8*, where the zero point is 0, and FLOAT4E2M1), which takes x / scale (+ the
    /// zero point for FLOAT4E2M1) rounded to it by Cast, saturating (`saturate` 0 is
    /// refused).
    fn quantize(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let (axis, block) = Self::quant_layout(&mut a)?;
        if !a.flag_or("saturate", true)? {
            return Err(a.refuse(
                "saturate",
                "only the default (1): graphrun's Cast to the 8-bit floats saturates",
            ));
        }
        let out_code = a.int("output_dtype", 0)?;
        let precision = match a.int("precision", 0)? {
            0 => None,
            code => match DType::from_onnx(code) {
                Some(dt) if dt.is_float() => Some(dt),
                _ => {
                    return Err(a.refuse(
                        "precision",
                        &format!(
                            "must name a floating type graphrun has, got {}",
                            type_name(code)
                        ),
                    ))
                }
            },
        };
        a.finish()?;
        let (ins, opt) = inputs(n, what, (2, 3), 1)?;
        let (x, scale, zp) = (ins[0].clone(), ins[1].clone(), opt[0].clone());
        // The zero point's type decides the output's; it must be known at import, for
        // the saturation bounds: declared for the zero point or the output.
        let declared = zp
            .as_ref()
            .and_then(|z| self.dtypes.get(z))
            .or_else(|| self.dtypes.get(&n.output[0]))
            .map(|dt| dt.onnx_code() as i64);
        let code = match (&zp, declared, out_code) {
            (Some(_), Some(d), o) if o != 0 && o != d => {
                return Err(a.refuse(
                    "output_dtype",
                    &format!("names {} but the zero point is {}", type_name(o), type_name(d)),
                ))
            }
            (_, Some(d), _) => d,
            (_, None, o) if o != 0 => o,
            (None, None, _) => DType::U8.onnx_code() as i64,
            (Some(z), None, _) => {
                return Err(Error::Graph(format!(
                    "{what}: the element type of the zero point '{z}' is not declared (nor the output's), and graphrun needs it to saturate"
                )))
            }
        };
        let to = DType::from_onnx(code).filter(|&dt| quant_range(dt).is_some() || quant_float(dt));
        let Some(to) = to else {
            return Err(Error::Graph(format!(
                "{what}: output type {} is not a quantized type graphrun has (UINT8, INT8, UINT16, INT16, UINT4, INT4, UINT2, INT2, FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ, FLOAT4E2M1)",
                type_name(code)
            )));
        };
        let s = self.quant_param(n, &x, &scale, axis, block)?;
        let z = match zp {
            Some(z) => Some(self.quant_param(n, &x, &z, axis, block)?),
            None => None,
        };
        match quant_range(to) {
            Some(range) => self.quantize_core(n, &x, &s, z, precision, range, to),
            None => {
                let (num, den) = self.quant_operands(n, &x, &s, precision);
                let mut q = self.val(n, "scaled", bin(BinaryOp::Div), vec![num, den]);
                if let Some(z) = z.filter(|_| to == DType::F4E2M1) {
                    let z = self.val(n, "zero_point_like", Op::CastLike, vec![z, q.clone()]);
                    q = self.val(n, "shifted", bin(BinaryOp::Add), vec![q, z]);
                }
                self.out(n, 0, Op::Cast { to }, vec![q]);
            }
        }
        Ok(())
    }

    /// Cast or CastLike with `saturate` 0 to an 8-bit float `to`: where x rounds past the
    /// largest finite value the result is infinity (E5M2) or NaN rather than that value.
    /// The saturating Cast, then a Where on |x| at or beyond the rounding bound, compared
    /// in x's own float type where the bound is exact in it (so that WebGPU, which has no
    /// f64, runs it), else in f64, which holds every input exactly.
    pub(super) fn unsaturated_cast(&mut self, n: &NodeProto, to: DType) -> Result<()> {
        let Some((bound, inclusive, [pos, neg])) = crate::tensor::narrow::overflow(to) else {
            return Err(Error::Graph(format!("Cast to {to}: not an 8-bit float")));
        };
        let x = n.input[0].clone();
        let y = self.val(n, "saturated", Op::Cast { to }, vec![x.clone()]);
        let exact_in = |d: DType| {
            d.is_float()
                && d.narrow_bits().is_none()
                && Tensor::scalar(bound).cast(d).to_f64_vec() == [bound]
        };
        let (xf, cmp_ty) = match self.dtypes.get(&x).copied().filter(|&d| exact_in(d)) {
            Some(d) => (x, d),
            None => (
                self.val(n, "x_f64", Op::Cast { to: DType::F64 }, vec![x]),
                DType::F64,
            ),
        };
        let mag = self.val(n, "magnitude", un(UnaryOp::Abs), vec![xf.clone()]);
        let b = self.constant(n, "bound", Tensor::scalar(bound).cast(cmp_ty));
        let cmp = match inclusive {
            true => BinaryOp::GreaterOrEqual,
            false => BinaryOp::Greater,
        };
        let over = self.val(n, "overflows", bin(cmp), vec![mag, b]);
        let zero = self.constant(n, "zero", Tensor::scalar(0.0f64).cast(cmp_ty));
        let negative = self.val(n, "negative", bin(BinaryOp::Less), vec![xf, zero]);
        let p = self.constant(n, "overflow_pos", Tensor::from_bytes(to, &[], &[pos])?);
        let q = self.constant(n, "overflow_neg", Tensor::from_bytes(to, &[], &[neg])?);
        let special = self.val(n, "overflow", Op::Where, vec![negative, q, p]);
        self.out(n, 0, Op::Where, vec![over, special, y]);
        Ok(())
    }

    /// Cast to E8M0 with `round_mode` "down" or "nearest", or without saturation: x's
    /// f32 bits (sign dropped) get the rounding increment added below the exponent and the
    /// mantissa cleared, so that the saturating Cast, which rounds a set mantissa up, sees
    /// a power of two and keeps its exponent. "up" adds 0x7fffff (any mantissa carries),
    /// "nearest" half of it as ONNX's reference rounds (a tie carries, except between 0
    /// and the smallest normal, where only more than half does); a carry out of 2^127 stays
    /// there when saturating, else becomes infinity, which the Cast writes as NaN.
    pub(super) fn e8m0_cast(&mut self, n: &NodeProto, round: &str, saturate: bool) -> Result<()> {
        let x = n.input[0].clone();
        let u = |v: u32| Tensor::from_vec(&[], vec![v]);
        let f = self.val(n, "x_f32", Op::Cast { to: DType::F32 }, vec![x]);
        let bits = self.val(n, "bits", Op::BitCast { to: DType::U32 }, vec![f]);
        let abs = self.constant(n, "abs_mask", u(0x7fff_ffff)?);
        let xb = self.val(n, "abs_bits", bin(BinaryOp::BitwiseAnd), vec![bits, abs]);
        let inf = self.constant(n, "inf_bits", u(0x7f80_0000)?);
        let special = self.val(
            n,
            "special",
            bin(BinaryOp::GreaterOrEqual),
            vec![xb.clone(), inf.clone()],
        );
        let add = match round {
            "down" => None,
            "up" => Some(self.constant(n, "carry", u(0x7f_ffff)?)),
            _ => {
                let normal = self.constant(n, "min_normal_bits", u(0x80_0000)?);
                let sub = self.val(
                    n,
                    "subnormal",
                    bin(BinaryOp::Less),
                    vec![xb.clone(), normal],
                );
                let lo = self.constant(n, "half_below", u(0x3f_ffff)?);
                let hi = self.constant(n, "half", u(0x40_0000)?);
                Some(self.val(n, "carry", Op::Where, vec![sub, lo, hi]))
            }
        };
        let t = match add {
            Some(a) => self.val(n, "carried", bin(BinaryOp::Add), vec![xb, a]),
            None => xb,
        };
        let mut t = self.val(n, "power", bin(BinaryOp::BitwiseAnd), vec![t, inf.clone()]);
        if saturate && round != "down" {
            let over = self.val(
                n,
                "past_max",
                bin(BinaryOp::Equal),
                vec![t.clone(), inf.clone()],
            );
            let max = self.constant(n, "max_bits", u(0x7f00_0000)?);
            t = self.val(n, "saturated", Op::Where, vec![over, max, t]);
        }
        let t = self.val(n, "kept_special", Op::Where, vec![special, inf, t]);
        let f = self.val(n, "power_f32", Op::BitCast { to: DType::F32 }, vec![t]);
        self.out(n, 0, Op::Cast { to: DType::F8E8M0 }, vec![f]);
        Ok(())
    }

    /// x and scale in the type the division runs in: `precision`'s, else x's.
    fn quant_operands(
        &mut self,
        n: &NodeProto,
        x: &str,
        scale: &str,
        precision: Option<DType>,
    ) -> (String, String) {
        match precision {
            Some(p) => (
                self.val(n, "x_precision", Op::Cast { to: p }, vec![x.to_string()]),
                self.val(
                    n,
                    "scale_precision",
                    Op::Cast { to: p },
                    vec![scale.to_string()],
                ),
            ),
            None => (
                x.to_string(),
                self.val(
                    n,
                    "scale_like_x",
                    Op::CastLike,
                    vec![scale.to_string(), x.to_string()],
                ),
            ),
        }
    }

    /// Output 0 = Cast(Clip(f32(Round(x / scale)) + f32(zero point), lo, hi), to), with
    /// scale and zero point already broadcastable against x. The sum runs in f32, where
    /// every value that survives the clip is exact (as ONNX's int32 sum).
    #[allow(clippy::too_many_arguments)]
    fn quantize_core(
        &mut self,
        n: &NodeProto,
        x: &str,
        scale: &str,
        zp: Option<String>,
        precision: Option<DType>,
        (lo, hi): (f32, f32),
        to: DType,
    ) {
        let (num, den) = self.quant_operands(n, x, scale, precision);
        let q = self.val(n, "scaled", bin(BinaryOp::Div), vec![num, den]);
        let q = self.val(n, "rounded", un(UnaryOp::Round), vec![q]);
        let mut q = self.val(n, "rounded_f32", Op::Cast { to: DType::F32 }, vec![q]);
        if let Some(z) = zp {
            let z = self.val(n, "zero_point_f32", Op::Cast { to: DType::F32 }, vec![z]);
            q = self.val(n, "shifted", bin(BinaryOp::Add), vec![q, z]);
        }
        let lo = self.constant(n, "type_min", Tensor::scalar(lo));
        let hi = self.constant(n, "type_max", Tensor::scalar(hi));
        let q = self.val(n, "saturated", Op::Clip, vec![q, lo, hi]);
        self.out(n, 0, Op::Cast { to }, vec![q]);
    }

    /// DequantizeLinear: (f32(x) - f32(zero point)) · f32(scale), cast to output_dtype
    /// (opset 23) or the scale's type, as ONNX's reference computes it.
    fn dequantize(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let (axis, block) = Self::quant_layout(&mut a)?;
        let to = match a.int("output_dtype", 0)? {
            0 => None,
            code => match DType::from_onnx(code) {
                Some(dt) if dt.is_float() => Some(dt),
                _ => {
                    return Err(a.refuse(
                        "output_dtype",
                        &format!(
                            "must name a floating type graphrun has, got {}",
                            type_name(code)
                        ),
                    ))
                }
            },
        };
        a.finish()?;
        let (ins, opt) = inputs(n, what, (2, 3), 1)?;
        let (x, scale, zp) = (ins[0].clone(), ins[1].clone(), opt[0].clone());
        let f32_of = |me: &mut Self, what: &str, v: String| {
            me.val(n, what, Op::Cast { to: DType::F32 }, vec![v])
        };
        let mut d = f32_of(self, "x_f32", x.clone());
        if let Some(z) = zp {
            let z = self.quant_param(n, &x, &z, axis, block)?;
            let z = f32_of(self, "zero_point_f32", z);
            d = self.val(n, "centered", bin(BinaryOp::Sub), vec![d, z]);
        }
        let s = self.quant_param(n, &x, &scale, axis, block)?;
        let s = f32_of(self, "scale_f32", s);
        let y = self.val(n, "scaled", bin(BinaryOp::Mul), vec![d, s]);
        match to {
            Some(to) => self.out(n, 0, Op::Cast { to }, vec![y]),
            None => self.out(n, 0, Op::CastLike, vec![y, scale]),
        }
        Ok(())
    }

    /// DynamicQuantizeLinear, as its function body: over all of x (f32), lo = min(min x,
    /// 0), hi = max(max x, 0), scale = (hi - lo) / 255, zero point = uint8(round(clip(0 -
    /// lo / scale, 0, 255))), y = QuantizeLinear(x, scale, zero point). ReduceMin is
    /// -ReduceMax(-x).
    fn dynamic_quantize(&mut self, n: &NodeProto, what: &str, a: Attrs) -> Result<()> {
        a.finish()?;
        let (ins, _) = inputs(n, what, (1, 1), 3)?;
        let x = ins[0].clone();
        let all_max = || Op::Reduce {
            kind: ReduceKind::Max,
            axes: None,
            keepdims: false,
            noop_with_empty_axes: false,
        };
        let max = self.val(n, "x_max", all_max(), vec![x.clone()]);
        let neg = self.val(n, "x_neg", un(UnaryOp::Neg), vec![x.clone()]);
        let neg_min = self.val(n, "x_neg_max", all_max(), vec![neg]);
        let min = self.val(n, "x_min", un(UnaryOp::Neg), vec![neg_min]);
        let c = |me: &mut Self, what: &str, v: f32| me.constant(n, what, Tensor::scalar(v));
        let q_min = c(self, "q_min", 0.0);
        let q_max = c(self, "q_max", 255.0);
        let lo = self.val(
            n,
            "x_min_adjusted",
            bin(BinaryOp::Min),
            vec![min, q_min.clone()],
        );
        let hi = self.val(
            n,
            "x_max_adjusted",
            bin(BinaryOp::Max),
            vec![max, q_min.clone()],
        );
        let range = self.val(n, "x_range", bin(BinaryOp::Sub), vec![hi, lo.clone()]);
        let scale = match output(n, 1) {
            Some(_) => {
                self.out(n, 1, bin(BinaryOp::Div), vec![range, q_max.clone()]);
                n.output[1].clone()
            }
            None => self.val(n, "scale", bin(BinaryOp::Div), vec![range, q_max.clone()]),
        };
        let lo_scaled = self.val(n, "min_scaled", bin(BinaryOp::Div), vec![lo, scale.clone()]);
        let zp = self.val(
            n,
            "zero_point_initial",
            bin(BinaryOp::Sub),
            vec![q_min.clone(), lo_scaled],
        );
        let zp = self.val(n, "zero_point_clipped", Op::Clip, vec![zp, q_min, q_max]);
        let zp = self.val(n, "zero_point_rounded", un(UnaryOp::Round), vec![zp]);
        let zp_u8 = match output(n, 2) {
            Some(_) => {
                self.out(n, 2, Op::Cast { to: DType::U8 }, vec![zp]);
                n.output[2].clone()
            }
            None => self.val(n, "zero_point", Op::Cast { to: DType::U8 }, vec![zp]),
        };
        self.quantize_core(n, &x, &scale, Some(zp_u8), None, (0.0, 255.0), DType::U8);
        Ok(())
    }

    /// CenterCropPad (opset 18): each of `axes` (default all) cropped or zero-padded to
    /// the matching element of `shape`, centred as ONNX's reference does: a crop by d =
    /// dim - size starts at floor(d/2); a pad by d = size - dim puts floor(d/2) before and
    /// the rest after. A Slice, then a Pad, both from `Shape` arithmetic on shape's value
    /// (which must be known when the plan is made, as the output's shape depends on it).
    fn center_crop_pad(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let axes = a.opt_ints("axes")?;
        a.finish()?;
        let (ins, _) = inputs(n, what, (2, 2), 1)?;
        let x = ins[0].clone();
        let size = self.val(n, "size", Op::Cast { to: DType::I64 }, vec![ins[1].clone()]);
        let full = self.val(n, "x_shape", shape(0, None), vec![x.clone()]);
        let axes = match axes {
            None => None,
            Some(v) => Some(self.ints_const(n, "axes", &v)?),
        };
        let dims = match &axes {
            None => full,
            Some(ax) => self.val(n, "dims", Op::Gather { axis: 0 }, vec![full, ax.clone()]),
        };
        let zero = self.ints_const(n, "zero", &[0])?;
        let two = self.ints_const(n, "two", &[2])?;
        let i64_op = |me: &mut Self, what: &str, b: BinaryOp, l: &str, r: &str| {
            me.val(n, what, bin(b), vec![l.to_string(), r.to_string()])
        };
        let shrink = i64_op(self, "shrink", BinaryOp::Sub, &dims, &size);
        let shrink = i64_op(self, "crop", BinaryOp::Max, &shrink, &zero);
        let start = i64_op(self, "crop_start", BinaryOp::Div, &shrink, &two);
        let kept = i64_op(self, "kept", BinaryOp::Min, &dims, &size);
        let end = i64_op(self, "crop_end", BinaryOp::Add, &start, &kept);
        let grow = i64_op(self, "grow", BinaryOp::Sub, &size, &dims);
        let grow = i64_op(self, "pad", BinaryOp::Max, &grow, &zero);
        let before = i64_op(self, "pad_before", BinaryOp::Div, &grow, &two);
        let after = i64_op(self, "pad_after", BinaryOp::Sub, &grow, &before);
        let pads = self.val(n, "pads", Op::Concat { axis: 0 }, vec![before, after]);
        let mut slice_ins = vec![x, start, end];
        slice_ins.extend(axes.clone());
        let cropped = self.val(n, "cropped", Op::Slice, slice_ins);
        let mut pad_ins = vec![cropped, pads];
        if let Some(ax) = axes {
            pad_ins.extend([String::new(), ax]);
        }
        let pad = Op::Pad {
            mode: crate::graph::op::PadMode::Constant,
        };
        self.out(n, 0, pad, pad_ins);
        Ok(())
    }

    /// LRN: y = x / (bias + alpha/size · s)^beta, s the sum of x² over the channels
    /// c - floor((size-1)/2) ..= c + ceil((size-1)/2) that exist: x² zero-padded on axis
    /// 1 and `size` shifted slices of it added. The constants are cast like x, alpha/size
    /// divided there (as ONNX's reference computes it in x's type).
    fn lrn(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        // One slice per window element: beyond this many the graph would be huge.
        const MAX_SIZE: i64 = 256;
        let size = match a.opt_int("size")? {
            None => {
                return Err(Error::Graph(format!(
                    "{what}: attribute 'size' is required"
                )))
            }
            Some(s) if (1..=MAX_SIZE).contains(&s) => s,
            Some(s) => return Err(a.refuse("size", &format!("must be in 1..={MAX_SIZE}, got {s}"))),
        };
        let alpha = a.float("alpha", 1e-4)?;
        let beta = a.float("beta", 0.75)?;
        let bias = a.float("bias", 1.0)?;
        a.finish()?;
        let (ins, _) = inputs(n, what, (1, 1), 1)?;
        let x = ins[0].clone();
        let sq = self.val(n, "square", bin(BinaryOp::Mul), vec![x.clone(), x.clone()]);
        let before = (size - 1) / 2;
        let pads = self.ints_const(n, "pads", &[before, size - 1 - before])?;
        let axis = self.ints_const(n, "channel_axis", &[1])?;
        let pad = Op::Pad {
            mode: crate::graph::op::PadMode::Constant,
        };
        let padded = self.val(
            n,
            "padded",
            pad,
            vec![sq, pads, String::new(), axis.clone()],
        );
        let c = self.val(n, "channels", shape(1, Some(2)), vec![x.clone()]);
        let window = |me: &mut Self, k: i64| -> Result<String> {
            let start = me.ints_const(n, "window_start", &[k])?;
            let end = me.val(
                n,
                "window_end",
                bin(BinaryOp::Add),
                vec![c.clone(), start.clone()],
            );
            let ins = vec![padded.clone(), start, end, axis.clone()];
            Ok(me.val(n, "window", Op::Slice, ins))
        };
        let mut sum = window(self, 0)?;
        for k in 1..size {
            let w = window(self, k)?;
            sum = self.val(n, "window_sum", bin(BinaryOp::Add), vec![sum, w]);
        }
        let alpha = self.float_like(n, "alpha", alpha, &x);
        let count = self.float_like(n, "size", size as f32, &x);
        let ratio = self.val(n, "alpha_over_size", bin(BinaryOp::Div), vec![alpha, count]);
        let scaled = self.val(n, "scaled_sum", bin(BinaryOp::Mul), vec![ratio, sum]);
        let bias = self.float_like(n, "bias", bias, &x);
        let base = self.val(n, "base", bin(BinaryOp::Add), vec![bias, scaled]);
        let beta = self.float_like(n, "beta", beta, &x);
        let den = self.val(n, "denominator", bin(BinaryOp::Pow), vec![base, beta]);
        self.out(n, 0, bin(BinaryOp::Div), vec![x, den]);
        Ok(())
    }
}
