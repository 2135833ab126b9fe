//! The closed set of operators. Attributes are typed here, once, at load time; nothing
//! downstream looks at attribute strings. Adding an op means adding a variant: the
//! compiler then lists every `match` that must learn it (inference, kernels, gradients).

use crate::error::{Error, Loc, Result};
use crate::tensor::{DType, Tensor};

pub use super::elementwise::UnaryOp;
pub use super::resize::Resize;
pub use super::window::{AutoPad, Window};

pub use super::elementwise::{BinaryKind, BinaryOp};

/// What a `Reduce` op computes over its axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceKind {
    /// The sum (ONNX `ReduceSum`).
    Sum,
    /// The arithmetic mean (ONNX `ReduceMean`).
    Mean,
    /// The maximum (ONNX `ReduceMax`).
    Max,
    /// The mean of the squares: internal (`ReduceMeanSquare`, not an ONNX op), what the
    /// `mean_square` rule makes of an MSE's `ReduceMean(Mul(d, d))`.
    MeanSquare,
    /// The product (1 over an empty set).
    Prod,
}

/// The activation a `FusedMatMul` applies after its bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// No activation: the output is `A·B + bias`.
    None,
    /// `max(x, 0)`.
    Relu,
    /// GELU with the exact erf form.
    Gelu,
    /// GELU with the tanh approximation (ONNX Gelu's `approximate = "tanh"`).
    GeluTanh,
    /// SiLU (swish), `x·sigmoid(x)`.
    Silu,
    /// The logistic sigmoid `1 / (1 + e^-x)`.
    Sigmoid,
    /// The hyperbolic tangent.
    Tanh,
    /// `min(max(x, 0), 6)`: ONNX `Clip(x, 0, 6)`, MobileNet's activation.
    Relu6,
}

impl Activation {
    /// Every activation, in declaration order.
    pub const ALL: [Activation; 8] = [
        Activation::None,
        Activation::Relu,
        Activation::Gelu,
        Activation::GeluTanh,
        Activation::Silu,
        Activation::Sigmoid,
        Activation::Tanh,
        Activation::Relu6,
    ];
    /// The unary op computing it (SiLU is Swish with alpha 1); none for no activation and
    /// for Relu6 (a Clip, no unary op).
    pub fn unary(self) -> Option<UnaryOp> {
        Some(match self {
            Activation::None | Activation::Relu6 => return None,
            Activation::Relu => UnaryOp::Relu,
            Activation::Gelu => UnaryOp::Gelu,
            Activation::GeluTanh => UnaryOp::GeluTanh,
            Activation::Silu => UnaryOp::Swish { alpha: 1.0 },
            Activation::Sigmoid => UnaryOp::Sigmoid,
            Activation::Tanh => UnaryOp::Tanh,
        })
    }
    /// The name written in a model's `activation` attribute (`"gelu_tanh"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Activation::None => "none",
            Activation::Relu => "relu",
            Activation::Gelu => "gelu",
            Activation::GeluTanh => "gelu_tanh",
            Activation::Silu => "silu",
            Activation::Sigmoid => "sigmoid",
            Activation::Tanh => "tanh",
            Activation::Relu6 => "relu6",
        }
    }
}

/// How Pad fills the border: a constant, the mirror image without the edge (`reflect`),
/// the edge repeated (`edge`), or the opposite side (`wrap`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PadMode {
    /// Fill with the constant value (ONNX `mode = "constant"`, the default).
    Constant,
    /// Mirror the input about its edge element, the edge itself not repeated
    /// (`"reflect"`).
    Reflect,
    /// Repeat the edge element (`"edge"`).
    Edge,
    /// Wrap around: take elements from the opposite side (`"wrap"`).
    Wrap,
}

impl PadMode {
    /// Every mode, in declaration order.
    pub const ALL: [PadMode; 4] = [
        PadMode::Constant,
        PadMode::Reflect,
        PadMode::Edge,
        PadMode::Wrap,
    ];
    /// The ONNX `mode` attribute's value for this mode.
    pub fn name(self) -> &'static str {
        match self {
            PadMode::Constant => "constant",
            PadMode::Reflect => "reflect",
            PadMode::Edge => "edge",
            PadMode::Wrap => "wrap",
        }
    }
}

/// How ScatterElements and ScatterND combine an update with the element it lands on:
/// `None` replaces it (with repeated indices the last update in index order wins, as
/// ONNX's reference does); the others fold every update into it in index order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScatterReduction {
    /// Replace the element (`reduction = "none"`, the default).
    None,
    /// Add the updates to the element (`"add"`).
    Add,
    /// Multiply the element by the updates (`"mul"`).
    Mul,
    /// Keep the largest of the element and the updates (`"max"`).
    Max,
    /// Keep the smallest of the element and the updates (`"min"`).
    Min,
}

impl ScatterReduction {
    /// Every reduction, in declaration order.
    pub const ALL: [ScatterReduction; 5] = [
        ScatterReduction::None,
        ScatterReduction::Add,
        ScatterReduction::Mul,
        ScatterReduction::Max,
        ScatterReduction::Min,
    ];
    /// The ONNX `reduction` attribute's value for this reduction.
    pub fn name(self) -> &'static str {
        match self {
            ScatterReduction::None => "none",
            ScatterReduction::Add => "add",
            ScatterReduction::Mul => "mul",
            ScatterReduction::Max => "max",
            ScatterReduction::Min => "min",
        }
    }
    /// The code cuda/shape.cu and shaders/shape.wgsl `scatter` switch on.
    pub fn code(self) -> i32 {
        self as i32
    }
}

/// How SoftmaxCrossEntropyLoss reduces the per-sample losses (its `reduction` attribute).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossReduction {
    /// The weighted mean over the samples not ignored (`"mean"`, the default).
    Mean,
    /// The sum (`"sum"`).
    Sum,
    /// No reduction: one loss per sample (`"none"`).
    None,
}

/// An operator with its typed attributes: the ONNX ops graphrun runs (named as in ONNX,
/// with ONNX's attribute defaults), the gradient ops the backward builder emits, and a
/// few internal ops the passes and the importer write. A node's inputs and outputs are
/// positional, as in ONNX; `arity` gives their counts.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// An elementwise unary map (ONNX `Relu`, `Exp`, `Gelu`, ...).
    Unary(UnaryOp),
    /// A broadcasting elementwise binary map (ONNX `Add`, `Equal`, `And`, ...).
    Binary(BinaryOp),
    /// ONNX `Clip`: `(X, [min], [max])`, X clamped to `[min, max]`.
    Clip,
    /// ONNX `Where`: `(condition, X, Y)`, X where the condition holds, else Y
    /// (broadcasting).
    Where,
    /// ONNX `Cast`: the input converted to another dtype.
    Cast {
        /// The dtype to convert to.
        to: DType,
    },
    /// Cast to the dtype of the second input (only its dtype is read).
    CastLike,
    /// ONNX `BitCast`: the input's bytes read as another dtype of the same element size.
    BitCast {
        /// The dtype to read the bytes as.
        to: DType,
    },
    /// `start + i·delta` for i in 0..max(ceil((limit - start) / delta), 0), from three
    /// scalars known when the plan is made (they decide the length).
    Range,
    /// The indices of X's non-zero elements, i64 `[rank, nnz]` in row-major order (a
    /// scalar counts as rank 1). Its output's shape depends on X's values: X must be known
    /// when the plan is made, and the op is computed on the host then (`infer`), its output
    /// a constant of the plan on every backend.
    NonZero,
    /// X's distinct elements (or slices along `axis`): Y, the index of each one's first
    /// occurrence, each element's (slice's) index in Y, and the counts. `sorted` orders Y
    /// ascending (slices lexicographically), else by first occurrence. Computed on the
    /// host when the plan is made, as NonZero is.
    Unique {
        /// Order Y ascending (else by first occurrence); ONNX's default is sorted.
        sorted: bool,
        /// The axis whose slices are compared; None flattens X first.
        axis: Option<i64>,
    },
    /// ONNX `NonMaxSuppression`: (boxes [B, N, 4], scores [B, C, N], max boxes per class,
    /// IoU threshold, score threshold) → i64 `[selected, 3]` (batch, class, box) rows, each
    /// class's boxes taken by descending score and dropped where they overlap one already
    /// taken by more than the IoU threshold. Computed on the host when the plan is made, as
    /// NonZero is (its output's length is its result).
    NonMaxSuppression {
        /// Boxes as [x_center, y_center, width, height] (else two corners [y1, x1, y2, x2]).
        center_point_box: bool,
    },
    /// CumSum, or CumProd with `prod`: running sums (products) along the axis its second
    /// input names (a scalar read when the node runs); `exclusive` leaves each element out
    /// of its own sum, `reverse` runs from the end.
    Cumulative {
        /// CumProd (running products) rather than CumSum.
        prod: bool,
        /// Leave each element out of its own sum (product).
        exclusive: bool,
        /// Accumulate from the end of the axis towards its start.
        reverse: bool,
    },
    /// ArgMax, or ArgMin with `min`: the i64 index of the extreme element along `axis`, the
    /// first of equal ones (the last with `select_last_index`); NaN counts as the extreme,
    /// as numpy's argmax and argmin.
    ArgReduce {
        /// ArgMin (the smallest element) rather than ArgMax.
        min: bool,
        /// The axis reduced over (negative counts from the end).
        axis: i64,
        /// Keep the reduced axis as a dimension of size 1.
        keepdims: bool,
        /// Among equal extremes, return the last index rather than the first.
        select_last_index: bool,
    },
    /// `(X, K) -> (Values, Indices)`: the K largest (smallest without `largest`) elements
    /// along `axis` in order, equal values by lower index first; NaN ranks above every
    /// number. K (a one-element integer) decides the shape: it is known when the plan is
    /// made. `sorted: false` allows any order; graphrun always returns them sorted.
    TopK {
        /// The axis to select along (negative counts from the end).
        axis: i64,
        /// Select the largest elements (else the smallest).
        largest: bool,
        /// The ONNX `sorted` attribute (graphrun sorts either way).
        sorted: bool,
    },
    /// ONNX `Identity`: the input unchanged.
    Identity,
    /// ONNX `MatMul`: the matrix product with numpy's `matmul` semantics (1-D operands
    /// promoted, leading batch dims broadcast).
    MatMul,
    /// ONNX `Gemm`: `(A, B, [C]) -> alpha·A'·B' + beta·C` for 2-D A and B, where A' and B'
    /// are A and B, transposed when asked, and C broadcasts to the product's shape.
    Gemm {
        /// The product's scale.
        alpha: f32,
        /// C's scale.
        beta: f32,
        /// Transpose A first (ONNX `transA`).
        trans_a: bool,
        /// Transpose B first (ONNX `transB`).
        trans_b: bool,
    },
    /// ONNX `Softmax` (opset 13 semantics): the softmax along one axis.
    Softmax {
        /// The axis normalized over (default -1, the last).
        axis: i64,
    },
    /// ONNX `LogSoftmax` (opset 13 semantics): the log of the softmax along one axis.
    LogSoftmax {
        /// The axis normalized over (default -1, the last).
        axis: i64,
    },
    /// `(X, Scale, [B]) -> (Y, [Mean], [InvStdDev])`: each row (the axes `axis..`)
    /// normalized, `(x − mean) / sqrt(var + epsilon) · Scale + B`. With `rms` it is ONNX's
    /// RMSNormalization, `(X, Scale) -> (Y, [InvStdDev])`: `x / sqrt(mean(x²) + epsilon) ·
    /// Scale`, nothing subtracted and no bias. The statistics are per row, f32 (f64 for f64).
    ///
    /// With `residual` (`AddLayerNormalization`, `AddRMSNormalization`: what the
    /// `residual_norm` rule makes of an `Add` feeding a normalization) the rows normalized
    /// are `S = X + R` for an R of X's shape and type, and S is an output too (the
    /// residual stream the block passes on): `(X, Scale, B or "", R) -> (Y, [Mean],
    /// [InvStdDev], [S])`, without the bias slot for RMS (`norm_residual_input`,
    /// `norm_sum_output`).
    LayerNormalization {
        /// The first normalized axis (negative counts from the end).
        axis: i64,
        /// Added to the variance (the mean square) before the square root.
        epsilon: f32,
        /// RMSNormalization: no mean subtracted, no bias.
        rms: bool,
        /// The rows are X + R, and the sum is an output.
        residual: bool,
    },
    /// ONNX `ReduceSum`, `ReduceMean`, `ReduceMax`, `ReduceProd` (and the internal
    /// `ReduceMeanSquare`): `(data, [axes])` reduced over the axes.
    /// `axes: None` means the axes come from the second input (or all axes).
    Reduce {
        /// What is computed over the reduced axes.
        kind: ReduceKind,
        /// The axes reduced over (negative count from the end), when given as the
        /// attribute.
        axes: Option<Vec<i64>>,
        /// Keep each reduced axis as a dimension of size 1.
        keepdims: bool,
        /// With no axes given, return the input unchanged rather than reduce over all
        /// axes.
        noop_with_empty_axes: bool,
    },
    /// ONNX `Reshape`: `(data, shape)`, where a -1 in shape is inferred from the element
    /// count and a 0 copies the input's dimension.
    Reshape {
        /// A 0 in shape means a dimension of size 0 rather than a copy of the input's.
        allowzero: bool,
    },
    /// ONNX `Transpose`: the axes permuted.
    Transpose {
        /// Output axis i is input axis `perm[i]`; None reverses the axes.
        perm: Option<Vec<usize>>,
    },
    /// ONNX `Concat`: the inputs joined along one axis.
    Concat {
        /// The axis joined along (negative counts from the end).
        axis: i64,
    },
    /// ONNX `Split`: `(input, [split]) -> outputs`, the input cut along one axis into
    /// parts of the sizes `split` gives (attribute or input), else into equal parts.
    Split {
        /// The axis cut along (negative counts from the end).
        axis: i64,
        /// The size of each part, when given as the attribute (older opsets).
        split: Option<Vec<i64>>,
        /// How many equal parts (opset 18), when given; it must match the outputs.
        num_outputs: Option<usize>,
    },
    /// ONNX `Slice`: `(data, starts, ends, [axes], [steps])`, numpy-style slicing.
    Slice,
    /// ONNX `Squeeze`: `(data, [axes])`, the size-1 axes removed.
    Squeeze {
        /// The axes to remove, when given as the attribute (older opsets); with no axes
        /// at all, every size-1 axis is removed.
        axes: Option<Vec<i64>>,
    },
    /// ONNX `Unsqueeze`: `(data, [axes])`, size-1 axes inserted.
    Unsqueeze {
        /// The positions of the new axes in the output, when given as the attribute
        /// (older opsets).
        axes: Option<Vec<i64>>,
    },
    /// ONNX `Flatten`: the input reshaped to 2-D, `[d0·…·d(axis-1), d(axis)·…]`.
    Flatten {
        /// The axes before it make the first output dimension, the rest the second
        /// (default 1).
        axis: i64,
    },
    /// ONNX `Expand`: `(input, shape)`, the input broadcast to the shape (numpy rules).
    Expand,
    /// ONNX `Gather`: `(data, indices)`, the slices of data along `axis` at the indices.
    Gather {
        /// The axis indexed (negative counts from the end).
        axis: i64,
    },
    /// `out[p] = data[p with p[axis] = indices[p]]`: indices of data's rank, output of
    /// theirs.
    GatherElements {
        /// The axis indexed (negative counts from the end).
        axis: i64,
    },
    /// Slices of data picked by the last axis of indices, after `batch_dims` shared
    /// leading dims.
    GatherND {
        /// How many leading dims data and indices share (not indexed).
        batch_dims: usize,
    },
    /// `(data, pads, [constant_value], [axes])`: pads (begin values, then end values, one
    /// pair per axis of `axes`, else of every axis) are plan-time values; negative ones
    /// remove elements. The constant (default 0) is a one-element tensor of data's dtype.
    Pad {
        /// How the border is filled.
        mode: PadMode,
    },
    /// `out = data` with `updates` put at the positions GatherElements would read with
    /// `indices` (same shape as updates), combined per `reduction`.
    ScatterElements {
        /// The axis indexed (negative counts from the end).
        axis: i64,
        /// How an update combines with the element it lands on.
        reduction: ScatterReduction,
    },
    /// `out = data` with the slices of `updates` put where GatherND (batch_dims 0) would
    /// read them, combined per `reduction`.
    ScatterND {
        /// How an update combines with the element it lands on.
        reduction: ScatterReduction,
    },
    /// ONNX `Shape`: the input's shape as a 1-D i64 tensor, optionally only the dims
    /// `start..end`.
    Shape {
        /// The first dim included (negative counts from the end; default 0).
        start: i64,
        /// The dim after the last one included (negative counts from the end); None runs
        /// to the end.
        end: Option<i64>,
    },
    /// ONNX `Constant`: no inputs, the tensor as output (any of ONNX's `value*`
    /// attributes, read into one tensor).
    Constant {
        /// The output tensor.
        value: Tensor,
    },
    /// ONNX `Trilu`: `(input, [k])`, the upper or lower triangle of every trailing matrix
    /// (relative to diagonal k, default 0), the rest zeroed.
    Trilu {
        /// Keep the upper triangle (`j - i >= k`), else the lower (`j - i <= k`).
        upper: bool,
    },
    /// ONNX `SoftmaxCrossEntropyLoss`: `(scores [N, C, ...], labels [N, ...], [weights
    /// [C]]) -> (loss, [log_prob])`, the cross entropy of softmax(scores) along axis 1
    /// against integer class labels.
    SoftmaxCrossEntropyLoss {
        /// How the per-sample losses are reduced.
        reduction: LossReduction,
        /// A label value whose samples contribute no loss (and no weight to the mean).
        ignore_index: Option<i64>,
    },
    /// ONNX `Dropout`: `(data, [ratio], [training_mode]) -> (output, [mask])`. In a plain
    /// run (not a training step) with `training_mode` absent or false, the output is the
    /// input and the mask all true; otherwise each element is zeroed with probability
    /// `ratio` and the kept ones scaled by `1 / (1 - ratio)`.
    Dropout {
        /// The drop probability, in `[0, 1)` (default 0.5); a `ratio` input overrides it.
        ratio: f32,
        /// The seed of the mask; None derives one from the node's name. Each training
        /// step mixes in its step number, so every step draws a fresh, reproducible
        /// mask.
        seed: Option<i64>,
    },
    /// ONNX `RandomUniform`, `RandomNormal` and their `Like` forms: `([like]) -> (output)`,
    /// each element drawn independently from U[a, b) or N(a, b²). The output's shape is
    /// `shape` (the plain forms, no input) or the input's (the `Like` forms, which read
    /// nothing else of it).
    Random {
        /// Normal (mean a, scale b) rather than uniform (low a, high b).
        normal: bool,
        /// The low bound or the mean (default 0).
        a: f32,
        /// The high bound or the scale (default 1).
        b: f32,
        /// The seed; None derives one from the node's name. As Dropout's, each training
        /// step mixes in its step number.
        seed: Option<f64>,
        /// The output's element type (a float); None is the input's (`Like`) or f32.
        dtype: Option<DType>,
        /// The output's shape for the plain forms; None for the `Like` forms.
        shape: Option<Vec<usize>>,
    },
    /// `(A, B, [bias], [residual]) -> (Y, [Pre])`: `Y = act(A·B + bias) + residual`, a
    /// MatMul with its epilogue fused (not an ONNX op: the fusion passes write it, and a
    /// model may use it directly). B is `[K, N]` (or batched) and bias `[N]`; the
    /// residual broadcasts to Y.
    /// `Pre = A·B + bias` is what FusedMatMulGrad reads.
    FusedMatMul {
        /// The activation applied after the bias.
        activation: Activation,
        /// B is given transposed (`[N, K]`).
        trans_b: bool,
    },
    /// `(A, Bg, Bu, [bias_g], [bias_u]) -> (Y, [G], [U])`: a gated linear unit, `Y =
    /// act(G) · U` with `G = A·Bg + bias_g` and `U = A·Bu + bias_u` (SwiGLU with SiLU,
    /// GeGLU with GELU), the two products of one A and their gate in one node (not an ONNX
    /// op: what the gated-MLP fusion makes of `act(x·Wg) * (x·Wu)`). Bg and Bu are `[K,
    /// N]` (or batched; `[N, K]` with trans_b), the biases `[N]`. G and U are what
    /// GatedMatMulGrad reads.
    GatedMatMul {
        /// The gate's activation.
        activation: Activation,
        /// Bg and Bu are given transposed (`[N, K]`).
        trans_b: bool,
    },
    /// `q_num_heads`/`kv_num_heads` are required for the 3-D form (Q `[B, Sq, Hq·D]`,
    /// heads packed in the last axis) and, when given with 4-D inputs, must agree with them.
    /// With K and V omitted (rule `attention_qkv`), Q is the packed QKV `[B, S, (Hq +
    /// 2·Hkv)·D]`: Q, K and V one after the other on the last axis (`infer::qkv_parts`).
    Attention {
        /// Causal masking, upper-left aligned: query i sees key j iff `j <= i`.
        is_causal: bool,
        /// The factor the scores `Q·Kᵀ` are multiplied by; None is `1/sqrt(D)`.
        scale: Option<f32>,
        /// The number of query heads (ONNX `q_num_heads`).
        q_num_heads: Option<usize>,
        /// The number of key/value heads (ONNX `kv_num_heads`); query head h reads kv head
        /// `h / (Hq / Hkv)` (grouped-query attention).
        kv_num_heads: Option<usize>,
    },
    /// `(X, Cos, Sin) -> Y`: a rotary position embedding (not an ONNX op; what the
    /// rotary fusion makes of the rotate-half form exporters write, and ONNX's
    /// RotaryEmbedding is written with), `Y = X·Cos + rot(X)·Sin` with Cos and Sin
    /// broadcast to X. rot pairs the elements of X's last axis (of even size D): element
    /// j with j + D/2 (or, `interleaved`, 2k with 2k + 1), and maps a pair (a, b) to
    /// (−b, a).
    Rotary {
        /// The pairs are adjacent elements rather than the two halves.
        interleaved: bool,
    },
    /// `(Q [Tq, Hq, D], K [Tk, Hkv, D], V [Tk, Hkv, Dv], cu_seqlens_q, cu_seqlens_k) ->
    /// (Y [Tq, Hq, Dv], [LSE [Tq, Hq]])`: attention over packed variable-length
    /// sequences (not an ONNX op): sequence b is query rows `cu_seqlens_q[b]..[b+1]`
    /// against key rows `cu_seqlens_k[b]..[b+1]`, both `[B+1]`.
    VarlenAttention {
        /// Causal masking, bottom-right aligned as in flash-attn's varlen API: in a
        /// sequence of Lq queries and Lk keys, query i sees key j iff `j <= i + Lk - Lq`.
        is_causal: bool,
        /// The factor the scores `Q·Kᵀ` are multiplied by; None is `1/sqrt(D)`.
        scale: Option<f32>,
    },

    // Gradient ops: what the backward builder (src/passes/autodiff) emits where a gradient
    // is not a short chain of the ops above. They are ordinary ops: they parse, print,
    // infer and run like any other (`GRAD_OP_NAMES`).
    /// `<Unary>Grad(dY, X) -> dX = dY * f'(X)`, e.g. `ReluGrad`, `GeluGrad`.
    UnaryGrad(UnaryOp),
    /// `SoftmaxGrad(dY, Y)` / `LogSoftmaxGrad(dY, Y)` along `axis`.
    SoftmaxGrad {
        /// The forward op's axis.
        axis: i64,
        /// The gradient of LogSoftmax (else of Softmax).
        log: bool,
    },
    /// `(dY, X, Scale, Mean, InvStdDev, [R]) -> (dX, dScale, dB)`; dScale and dB have the
    /// normalized shape `X.shape[axis..]`, R (a residual's gradient) is added onto dX.
    /// With `rms`, RMSNormalization's: `(dY, X, Scale, InvStdDev, [R]) -> (dX, dScale)`.
    /// Unneeded outputs may be omitted ("").
    LayerNormalizationGrad {
        /// The forward op's first normalized axis.
        axis: i64,
        /// RMSNormalization's gradient.
        rms: bool,
    },
    /// `(dLoss, Scores, Labels, [Weights]) -> dScores`.
    SoftmaxCrossEntropyLossGrad {
        /// The forward op's reduction.
        reduction: LossReduction,
        /// The forward op's ignored label.
        ignore_index: Option<i64>,
    },
    /// `(dY, Indices, DataShape) -> dData`: scatter-add of dY rows into zeros.
    GatherGrad {
        /// The forward Gather's axis.
        axis: i64,
    },
    /// `(dY, Indices, DataShape) -> dData`, for GatherElements.
    GatherElementsGrad {
        /// The forward GatherElements' axis.
        axis: i64,
    },
    /// `(dY, Indices, DataShape) -> dData`, for GatherND.
    GatherNDGrad {
        /// The forward GatherND's batch dims.
        batch_dims: usize,
    },
    /// `(dY, XShape, starts, ends, [axes], [steps]) -> dX`: dY placed into zeros.
    SliceGrad,
    /// `(X [N, C, *spatial], W [M, C/group, *kernel], [B [M]]) -> Y [N, M, *out]`: ONNX's
    /// Conv (1-, 2- or 3-D), the kernel's dims read from W's shape. One op rather than its
    /// Im2Col-and-MatMul form, so a backend can hand it whole to a library (cuDNN) or to a
    /// kernel that never lays out all the columns at once.
    Conv {
        /// The kernel's spatial dims as written (ONNX `kernel_shape`, checked against W's);
        /// empty when not written.
        kernel: Vec<usize>,
        /// Strides, dilations and padding of the sliding window.
        window: Window,
        /// The number of channel groups.
        group: usize,
    },
    /// `(X, W, [B], [Z]) -> (Y, [Pre])`: `Y = act(conv(X, W) + B + Z)`, a Conv with its
    /// epilogue fused (not an ONNX op: the `conv_epilogue` rule writes it, and a model may
    /// use it directly). Z, the residual, has Y's shape and is added before the
    /// activation, as a residual block's `Relu(conv + shortcut)` does. `Pre = conv + B + Z`
    /// is what the gradient reads for activations other than none and Relu (Relu's
    /// derivative is read from Y).
    FusedConv {
        /// The kernel's spatial dims as written (`kernel_shape`); empty when not written.
        kernel: Vec<usize>,
        /// Strides, dilations and padding of the sliding window.
        window: Window,
        /// The number of channel groups.
        group: usize,
        /// The activation applied last.
        activation: Activation,
    },
    /// `(dY, X, W) -> ([dX], [dW])`: Conv's gradients with respect to X and W, each
    /// computed only when its output is named (the bias gradient is a ReduceSum).
    ConvGrad {
        /// The forward Conv's `kernel_shape`.
        kernel: Vec<usize>,
        /// The forward Conv's window.
        window: Window,
        /// The forward Conv's groups.
        group: usize,
    },
    /// `(X, [kernel_shape]) -> [N, C·K, *out]`: every window of the `[N, C, *spatial]`
    /// image laid out as a column (K = the kernel's size, `window.rs`); `pad_value` fills
    /// the padding and `beyond_value` what ceil_mode's last windows read past it. The
    /// kernel's dims are the attribute `kernel_shape` or, when that is empty, the input's
    /// plan-time value. Internal: the importer writes Conv and the pools on it.
    Im2Col {
        /// The kernel's spatial dims (ONNX `kernel_shape`); empty when they come from
        /// the second input.
        kernel: Vec<usize>,
        /// Strides, dilations and padding of the sliding window.
        window: Window,
        /// The value read from the padding.
        pad_value: f64,
        /// The value read past the padding by ceil_mode's last windows.
        beyond_value: f64,
    },
    /// `(cols [N, C·K, L], image_shape, [block_shape]) -> [N, C, *image_shape]`: ONNX's
    /// Col2Im, each image element the sum of the column entries that read it (padding
    /// read none): Im2Col's gradient, and ConvTranspose's last step. The block's dims are
    /// the attribute `block` or, when that is empty, the input's plan-time value.
    Col2Im {
        /// The block's spatial dims (ONNX's `block_shape` input, as an attribute); empty
        /// when they come from the third input.
        block: Vec<usize>,
        /// Strides, dilations and padding of the sliding window.
        window: Window,
    },
    /// `(X [N, C, *spatial]) -> Y [N, C, *out]`: ONNX MaxPool's Y for a floating X, each
    /// window's largest element (NaN where it holds one). Padding, and what ceil_mode's
    /// last windows reach past it, never count; a window that reads none of the image
    /// gives -inf. One op rather than a reduction over Im2Col's columns, so that no backend
    /// lays the windows out. The importer writes it for MaxPool without Indices (which it
    /// writes on Im2Col).
    MaxPool {
        /// The window's spatial dims (ONNX `kernel_shape`).
        kernel: Vec<usize>,
        /// Strides, dilations, padding and ceil_mode of the sliding window.
        window: Window,
    },
    /// `(dY, X) -> dX`: MaxPool's gradient, each window's dY added at the first element of
    /// the window (in window order) that holds its maximum, as PyTorch's max pooling routes
    /// it.
    MaxPoolGrad {
        /// The forward MaxPool's `kernel_shape`.
        kernel: Vec<usize>,
        /// The forward MaxPool's window.
        window: Window,
    },
    /// `(X, [roi], [scales], [sizes]) -> (M, [mask])`: how Resize samples axis `axis` of X
    /// (graph/resize.rs). roi, scales and sizes (ONNX's, naming the axes `axes`) are
    /// plan-time values and X is read for its type only, so the op is computed on the host
    /// when the plan is made and no backend runs it. M is the `[out, in]` weights in X's
    /// dtype (linear, cubic) or the i64 `[out]` input position each output reads
    /// (nearest); the bool `[out]` mask marks the outputs that take a fill value instead.
    /// Internal: the importer writes Resize and Upsample on it.
    ResizeMatrix {
        /// The Resize node's sampling attributes.
        resize: Resize,
        /// The axes the roi, scales and sizes inputs name (ONNX Resize's `axes`).
        axes: Vec<usize>,
        /// The axis of X this op samples.
        axis: usize,
    },
    /// `(dY, pads, [axes]) -> dX`: each dY element added to the X element Pad read it from
    /// (constant positions read none).
    PadGrad {
        /// The forward Pad's mode.
        mode: PadMode,
    },
    /// `(dY, A, B, [Pre], [PreA]) -> (dA, dB, [dBias], [dBiasA])` for `Y = act(A·B + bias) +
    /// residual`, where `Pre = A·B + bias` is the forward's second output (needed unless
    /// activation none). With `a_activation` (set by the `dact_into_da` rule, never by
    /// autodiff) dA leaves multiplied by `a_activation'(PreA)`: the gradient at the Pre of
    /// the FusedMatMul that produced A, which that node's gradient then takes as its dY.
    /// dBiasA (also only from that rule) is dA summed over its rows, `[K]`: that
    /// FusedMatMul's bias gradient.
    FusedMatMulGrad {
        /// The forward FusedMatMul's activation.
        activation: Activation,
        /// The forward FusedMatMul's `trans_b`.
        trans_b: bool,
        /// The activation of the FusedMatMul that produced A, whose derivative dA is
        /// multiplied by (`Activation::None`: dA as is).
        a_activation: Activation,
    },
    /// `(dY, Q, K, V, Y, LSE, [attn_mask]) -> (dQ, dK, dV, [dMask])`: flash-style, from
    /// the forward's per-row logsumexp (its second output). dMask has the full
    /// `[B, Hq, Sq, Skv]` shape and is only computed when asked for. With packed QKV (K and
    /// V omitted) dQKV, packed the same way, is output 0 and outputs 1 and 2 are omitted.
    AttentionGrad {
        /// The forward Attention's `is_causal`.
        is_causal: bool,
        /// The forward Attention's `scale`.
        scale: Option<f32>,
        /// The forward Attention's `q_num_heads`.
        q_num_heads: Option<usize>,
        /// The forward Attention's `kv_num_heads`.
        kv_num_heads: Option<usize>,
    },
    /// `(dY, G, U) -> (dG, dU)`: the gradient at GatedMatMul's two products, `dG = dY·U·
    /// act'(G)` and `dU = dY·act(G)`, one pass; the products' own gradients (dA, dBg, dBu,
    /// the biases') are FusedMatMulGrads of dG and dU.
    GatedMatMulGrad {
        /// The forward GatedMatMul's activation.
        activation: Activation,
        /// The forward GatedMatMul's `trans_b` (kept so that the op names its forward).
        trans_b: bool,
    },
    /// `(dY, Cos, Sin) -> dX`: Rotary's gradient with respect to X, `dY·Cos − rot(dY·Sin)`
    /// (rot's transpose is −rot).
    RotaryGrad {
        /// The forward Rotary's `interleaved`.
        interleaved: bool,
    },
    /// `(dY, Q, K, V, cu_seqlens_q, cu_seqlens_k, Y, LSE) -> (dQ, dK, dV)`.
    VarlenAttentionGrad {
        /// The forward VarlenAttention's `is_causal`.
        is_causal: bool,
        /// The forward VarlenAttention's `scale`.
        scale: Option<f32>,
    },
}

/// Where LayerNormalization's statistics are among its outputs: (Mean, InvStdDev).
/// RMSNormalization (`rms`) has no Mean, so its InvStdDev is output 1.
pub fn norm_stat_outputs(rms: bool) -> (Option<usize>, usize) {
    if rms {
        (None, 1)
    } else {
        (Some(1), 2)
    }
}

/// Where a residual normalization's R is among its inputs: after Scale and B (RMS has no B).
pub fn norm_residual_input(rms: bool) -> usize {
    if rms {
        2
    } else {
        3
    }
}

/// Where a normalization's optional inputs are, when it has them: (B, R). B is
/// LayerNormalization's alone, R the residual forms'.
pub fn norm_optional_inputs(rms: bool, residual: bool) -> (Option<usize>, Option<usize>) {
    (
        (!rms).then_some(2),
        residual.then(|| norm_residual_input(rms)),
    )
}

/// Where a residual normalization's sum `S = X + R` is among its outputs: after the
/// statistics.
pub fn norm_sum_output(rms: bool) -> usize {
    norm_stat_outputs(rms).1 + 1
}

/// Where LayerNormalizationGrad's statistics and residual gradient are among its inputs:
/// (Mean, InvStdDev, R). RMSNormalizationGrad (`rms`) reads no Mean, so the others come
/// one earlier.
pub fn norm_grad_inputs(rms: bool) -> (Option<usize>, usize, usize) {
    if rms {
        (None, 3, 4)
    } else {
        (Some(3), 4, 5)
    }
}

/// The gradient ops the backward builder emits (not part of SPEC §2, but accepted in a
/// model file so that a backward graph written with `--emit-yaml` loads again).
pub static GRAD_OP_NAMES: std::sync::LazyLock<Vec<&'static str>> = std::sync::LazyLock::new(|| {
    let mut v: Vec<&'static str> = vec![];
    for u in UnaryOp::ALL.iter().filter(|u| u.differentiable()) {
        if !v.contains(&u.grad_name()) {
            v.push(u.grad_name());
        }
    }
    v.extend([
        "SoftmaxGrad",
        "LogSoftmaxGrad",
        "LayerNormalizationGrad",
        "RMSNormalizationGrad",
        "SoftmaxCrossEntropyLossGrad",
        "GatherGrad",
        "GatherElementsGrad",
        "GatherNDGrad",
        "SliceGrad",
        "PadGrad",
        "FusedMatMulGrad",
        "GatedMatMulGrad",
        "AttentionGrad",
        "VarlenAttentionGrad",
        "RotaryGrad",
        "ConvGrad",
        "MaxPoolGrad",
    ]);
    v
});

/// Ops the passes make that are not in SPEC §2, accepted in a model file so that a graph
/// written with `--emit-yaml` loads again.
/// (A model's MaxPool is ONNX's, with its Indices output, and the importer writes it; the
/// op MaxPool is what it writes where no Indices are asked for.)
pub const INTERNAL_OP_NAMES: &[&str] = &["ReduceMeanSquare", "Im2Col", "ResizeMatrix", "MaxPool"];

/// The op names that are not elementwise maps (`for_each_binary!`, `for_each_unary!`).
const OTHER_OP_NAMES: &[&str] = &[
    "Clip",
    "Where",
    "Cast",
    "CastLike",
    "BitCast",
    "Range",
    "NonZero",
    "Unique",
    "NonMaxSuppression",
    "CumSum",
    "CumProd",
    "ArgMax",
    "ArgMin",
    "TopK",
    "Identity",
    "MatMul",
    "Gemm",
    "Softmax",
    "LogSoftmax",
    "LayerNormalization",
    "RMSNormalization",
    "AddLayerNormalization",
    "AddRMSNormalization",
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceProd",
    "Reshape",
    "Transpose",
    "Concat",
    "Split",
    "Slice",
    "Squeeze",
    "Unsqueeze",
    "Flatten",
    "Expand",
    "Gather",
    "GatherElements",
    "GatherND",
    "Pad",
    "ScatterElements",
    "ScatterND",
    "Col2Im",
    "Conv",
    "FusedConv",
    "Shape",
    "Constant",
    "Trilu",
    "SoftmaxCrossEntropyLoss",
    "Dropout",
    "RandomUniform",
    "RandomUniformLike",
    "RandomNormal",
    "RandomNormalLike",
    "FusedMatMul",
    "GatedMatMul",
    "Attention",
    "VarlenAttention",
    "Rotary",
];

/// Every op name graphrun reads: the binary maps, then the unary ones, in their tables'
/// order, then the rest.
pub static OP_NAMES: std::sync::LazyLock<Vec<&'static str>> = std::sync::LazyLock::new(|| {
    let mut v: Vec<&'static str> = vec![];
    for b in BinaryOp::ALL {
        if !v.contains(&b.onnx_name()) {
            v.push(b.onnx_name());
        }
    }
    for u in UnaryOp::ALL {
        if !v.contains(&u.onnx_name()) {
            v.push(u.onnx_name());
        }
    }
    v.extend(OTHER_OP_NAMES);
    v
});

/// An attribute as written in the model, before it is typed by its op.
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    /// An integer (ONNX `INT`; also a 0/1 flag).
    Int(i64),
    /// A float (ONNX `FLOAT`).
    Float(f64),
    /// A string (ONNX `STRING`).
    Str(String),
    /// A list of integers (ONNX `INTS`).
    Ints(Vec<i64>),
    /// A list of floats (ONNX `FLOATS`).
    Floats(Vec<f64>),
    /// A list of strings (ONNX `STRINGS`).
    Strs(Vec<String>),
    /// A tensor (ONNX `TENSOR`).
    Tensor(Tensor),
}

impl AttrValue {
    fn kind(&self) -> &'static str {
        match self {
            AttrValue::Int(_) => "an integer",
            AttrValue::Float(_) => "a float",
            AttrValue::Str(_) => "a string",
            AttrValue::Ints(_) => "a list of integers",
            AttrValue::Floats(_) => "a list of floats",
            AttrValue::Strs(_) => "a list of strings",
            AttrValue::Tensor(_) => "a tensor",
        }
    }
}

/// A named attribute and where it was written.
#[derive(Clone, Debug)]
pub struct Attr {
    /// The attribute's name.
    pub name: String,
    /// Its value as written.
    pub value: AttrValue,
    /// Where it was written in the model file, for error messages (None for an
    /// attribute that does not come from a YAML file).
    pub loc: Option<Loc>,
}

/// Reads typed attributes for one node; every unread attribute is an error at the end.
struct Attrs<'a> {
    op: &'a str,
    node: &'a str,
    node_loc: Option<&'a Loc>,
    attrs: &'a [Attr],
    used: Vec<bool>,
    /// Every attribute name the op's parser asked for, written or not: the op's valid
    /// attributes, which the error for an unknown one lists (the parser is their only
    /// declaration, so the list cannot drift from what is accepted).
    asked: Vec<String>,
}

/// The candidate closest to `word` when it is close enough to be a likely typo: equal
/// but for case, or within an edit distance of about a third of its length.
pub fn did_you_mean<'c>(
    word: &str,
    candidates: impl IntoIterator<Item = &'c str>,
) -> Option<&'c str> {
    let lower = word.to_lowercase();
    let mut best: Option<(usize, &str)> = None;
    for c in candidates {
        let d = if c.to_lowercase() == lower {
            0
        } else {
            edit_distance(&lower, &c.to_lowercase())
        };
        if best.is_none_or(|(b, _)| d < b) {
            best = Some((d, c));
        }
    }
    let limit = (word.chars().count() / 3).max(1);
    best.filter(|(d, _)| *d <= limit).map(|(_, c)| c)
}

/// Edit distance counting an insertion, a deletion, a substitution or a swap of two
/// neighbouring characters (the commonest typo, `alpah`) as one edit each.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    // d[i][j]: distance between a[..i] and b[..j].
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, v) in d[0].iter_mut().enumerate() {
        *v = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let sub = d[i - 1][j - 1] + (a[i - 1] != b[j - 1]) as usize;
            let mut best = sub.min(d[i - 1][j] + 1).min(d[i][j - 1] + 1);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

impl<'a> Attrs<'a> {
    fn err(&self, a: Option<&Attr>, msg: String) -> Error {
        let loc = a.and_then(|a| a.loc.as_ref()).or(self.node_loc);
        let m = format!("node '{}' ({}): {}", self.node, self.op, msg);
        match loc {
            Some(l) => Error::model(l, m),
            None => Error::Graph(m),
        }
    }
    fn get(&mut self, name: &str) -> Option<&'a Attr> {
        if !self.asked.iter().any(|a| a == name) {
            self.asked.push(name.to_string());
        }
        let i = self.attrs.iter().position(|a| a.name == name)?;
        self.used[i] = true;
        Some(&self.attrs[i])
    }
    fn wrong(&self, a: &Attr, want: &str) -> Error {
        self.err(
            Some(a),
            format!(
                "attribute '{}' must be {}, got {}",
                a.name,
                want,
                a.value.kind()
            ),
        )
    }
    fn int(&mut self, name: &str) -> Result<Option<i64>> {
        match self.get(name) {
            None => Ok(None),
            Some(a) => match &a.value {
                AttrValue::Int(v) => Ok(Some(*v)),
                _ => Err(self.wrong(a, "an integer")),
            },
        }
    }
    /// A positive integer (a count such as a number of heads).
    fn count(&mut self, name: &str) -> Result<Option<usize>> {
        match self.int(name)? {
            Some(n) if n <= 0 => {
                let a = self.attrs.iter().find(|a| a.name == name);
                Err(self.err(a, format!("attribute '{name}' must be positive, got {n}")))
            }
            n => Ok(n.map(|n| n as usize)),
        }
    }
    fn int_or(&mut self, name: &str, d: i64) -> Result<i64> {
        Ok(self.int(name)?.unwrap_or(d))
    }
    fn flag(&mut self, name: &str, d: bool) -> Result<bool> {
        match self.int(name)? {
            None => Ok(d),
            Some(0) => Ok(false),
            Some(1) => Ok(true),
            Some(v) => {
                let a = self.attrs.iter().find(|a| a.name == name);
                Err(self.err(a, format!("attribute '{name}' must be 0 or 1, got {v}")))
            }
        }
    }
    fn float(&mut self, name: &str) -> Result<Option<f64>> {
        match self.get(name) {
            None => Ok(None),
            Some(a) => match &a.value {
                AttrValue::Float(v) => Ok(Some(*v)),
                AttrValue::Int(v) => Ok(Some(*v as f64)),
                _ => Err(self.wrong(a, "a number")),
            },
        }
    }
    /// A FusedMatMul activation by name (default none).
    fn activation(&mut self, name: &str) -> Result<Activation> {
        Ok(match self.string(name)? {
            None => Activation::None,
            Some((s, at)) => match Activation::ALL.iter().find(|x| x.name() == s) {
                Some(x) => *x,
                None => {
                    return Err(self.err(
                        Some(at),
                        format!("attribute '{name}' must be one of none, relu, gelu, gelu_tanh, silu, sigmoid, tanh, relu6; got \"{s}\""),
                    ))
                }
            },
        })
    }

    /// ScatterElements' and ScatterND's `reduction` (default none).
    fn scatter_reduction(&mut self) -> Result<ScatterReduction> {
        Ok(match self.string("reduction")? {
            None => ScatterReduction::None,
            Some((s, at)) => match ScatterReduction::ALL.iter().find(|r| r.name() == s) {
                Some(r) => *r,
                None => {
                    return Err(self.err(
                        Some(at),
                        format!("attribute 'reduction' must be one of none, add, mul, max, min; got \"{s}\""),
                    ))
                }
            },
        })
    }

    fn string(&mut self, name: &str) -> Result<Option<(String, &'a Attr)>> {
        match self.get(name) {
            None => Ok(None),
            Some(a) => match &a.value {
                AttrValue::Str(v) => Ok(Some((v.clone(), a))),
                _ => Err(self.wrong(a, "a string")),
            },
        }
    }
    /// An element type, by name or ONNX code.
    fn dtype(&mut self, name: &str) -> Result<Option<DType>> {
        let Some(at) = self.get(name) else {
            return Ok(None);
        };
        let to = match &at.value {
            AttrValue::Str(s) => DType::parse(s),
            AttrValue::Int(c) => DType::from_onnx(*c),
            _ => return Err(self.wrong(at, "a dtype name or ONNX dtype code")),
        };
        match to {
            Some(d) => Ok(Some(d)),
            None => {
                let given = match &at.value {
                    AttrValue::Int(c) => {
                        format!("{} (ONNX code {c})", crate::tensor::onnx_dtype_name(*c))
                    }
                    v => format!("{v:?}"),
                };
                Err(self.err(
                    Some(at),
                    format!(
                        "attribute '{name}': unsupported dtype {given}; use one of {}",
                        DType::ALL.map(|d| d.name()).join(", ")
                    ),
                ))
            }
        }
    }
    fn ints(&mut self, name: &str) -> Result<Option<Vec<i64>>> {
        match self.get(name) {
            None => Ok(None),
            Some(a) => match &a.value {
                AttrValue::Ints(v) => Ok(Some(v.clone())),
                AttrValue::Int(v) => Ok(Some(vec![*v])),
                // An empty YAML list has no element type to tell.
                AttrValue::Floats(v) if v.is_empty() => Ok(Some(vec![])),
                _ => Err(self.wrong(a, "a list of integers")),
            },
        }
    }
    /// Accepted-and-ignored ONNX attributes: only at values where ignoring is exact.
    fn ignore_if(&mut self, name: &str, ok: impl Fn(&AttrValue) -> bool, why: &str) -> Result<()> {
        if let Some(a) = self.get(name) {
            if !ok(&a.value) {
                return Err(self.err(
                    Some(a),
                    format!("attribute '{name}' is not supported: {why}"),
                ));
            }
        }
        Ok(())
    }
    fn finish(self) -> Result<()> {
        for (a, used) in self.attrs.iter().zip(&self.used) {
            if !used {
                let valid = if self.asked.is_empty() {
                    format!("{} takes no attributes", self.op)
                } else {
                    format!("{} takes: {}", self.op, self.asked.join(", "))
                };
                let hint = did_you_mean(&a.name, self.asked.iter().map(|s| s.as_str()))
                    .map(|s| format!("did you mean '{s}'? "))
                    .unwrap_or_default();
                return Err(self.err(
                    Some(a),
                    format!(
                        "unknown attribute '{}' for op {}; {hint}({valid})",
                        a.name, self.op
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl Op {
    /// The op's name as a model writes it (`ReduceSum`, `ArgMin`, `LogSoftmaxGrad`, ...):
    /// for an ONNX op, its ONNX name.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Unary(u) => u.onnx_name(),
            Op::Binary(b) => b.onnx_name(),
            Op::Clip => "Clip",
            Op::Where => "Where",
            Op::Cast { .. } => "Cast",
            Op::CastLike => "CastLike",
            Op::BitCast { .. } => "BitCast",
            Op::Range => "Range",
            Op::Cumulative { prod: false, .. } => "CumSum",
            Op::Cumulative { prod: true, .. } => "CumProd",
            Op::ArgReduce { min: false, .. } => "ArgMax",
            Op::ArgReduce { min: true, .. } => "ArgMin",
            Op::TopK { .. } => "TopK",
            Op::NonZero => "NonZero",
            Op::Unique { .. } => "Unique",
            Op::NonMaxSuppression { .. } => "NonMaxSuppression",
            Op::GatherElements { .. } => "GatherElements",
            Op::GatherND { .. } => "GatherND",
            Op::GatherElementsGrad { .. } => "GatherElementsGrad",
            Op::GatherNDGrad { .. } => "GatherNDGrad",
            Op::Pad { .. } => "Pad",
            Op::PadGrad { .. } => "PadGrad",
            Op::Conv { .. } => "Conv",
            Op::FusedConv { .. } => "FusedConv",
            Op::ConvGrad { .. } => "ConvGrad",
            Op::Im2Col { .. } => "Im2Col",
            Op::Col2Im { .. } => "Col2Im",
            Op::MaxPool { .. } => "MaxPool",
            Op::MaxPoolGrad { .. } => "MaxPoolGrad",
            Op::ResizeMatrix { .. } => "ResizeMatrix",
            Op::ScatterElements { .. } => "ScatterElements",
            Op::ScatterND { .. } => "ScatterND",
            Op::Identity => "Identity",
            Op::MatMul => "MatMul",
            Op::Gemm { .. } => "Gemm",
            Op::Softmax { .. } => "Softmax",
            Op::LogSoftmax { .. } => "LogSoftmax",
            Op::LayerNormalization {
                rms: false,
                residual: false,
                ..
            } => "LayerNormalization",
            Op::LayerNormalization {
                rms: true,
                residual: false,
                ..
            } => "RMSNormalization",
            Op::LayerNormalization { rms: false, .. } => "AddLayerNormalization",
            Op::LayerNormalization { rms: true, .. } => "AddRMSNormalization",
            Op::Reduce {
                kind: ReduceKind::Sum,
                ..
            } => "ReduceSum",
            Op::Reduce {
                kind: ReduceKind::Mean,
                ..
            } => "ReduceMean",
            Op::Reduce {
                kind: ReduceKind::Max,
                ..
            } => "ReduceMax",
            Op::Reduce {
                kind: ReduceKind::MeanSquare,
                ..
            } => "ReduceMeanSquare",
            Op::Reduce {
                kind: ReduceKind::Prod,
                ..
            } => "ReduceProd",
            Op::Reshape { .. } => "Reshape",
            Op::Transpose { .. } => "Transpose",
            Op::Concat { .. } => "Concat",
            Op::Split { .. } => "Split",
            Op::Slice => "Slice",
            Op::Squeeze { .. } => "Squeeze",
            Op::Unsqueeze { .. } => "Unsqueeze",
            Op::Flatten { .. } => "Flatten",
            Op::Expand => "Expand",
            Op::Gather { .. } => "Gather",
            Op::Shape { .. } => "Shape",
            Op::Constant { .. } => "Constant",
            Op::Trilu { .. } => "Trilu",
            Op::SoftmaxCrossEntropyLoss { .. } => "SoftmaxCrossEntropyLoss",
            Op::Dropout { .. } => "Dropout",
            Op::Random { normal, shape, .. } => match (normal, shape.is_some()) {
                (false, true) => "RandomUniform",
                (false, false) => "RandomUniformLike",
                (true, true) => "RandomNormal",
                (true, false) => "RandomNormalLike",
            },
            Op::FusedMatMul { .. } => "FusedMatMul",
            Op::GatedMatMul { .. } => "GatedMatMul",
            Op::Attention { .. } => "Attention",
            Op::VarlenAttention { .. } => "VarlenAttention",
            Op::Rotary { .. } => "Rotary",
            Op::UnaryGrad(u) => u.grad_name(),
            Op::SoftmaxGrad { log: false, .. } => "SoftmaxGrad",
            Op::SoftmaxGrad { log: true, .. } => "LogSoftmaxGrad",
            Op::LayerNormalizationGrad { rms: false, .. } => "LayerNormalizationGrad",
            Op::LayerNormalizationGrad { rms: true, .. } => "RMSNormalizationGrad",
            Op::SoftmaxCrossEntropyLossGrad { .. } => "SoftmaxCrossEntropyLossGrad",
            Op::GatherGrad { .. } => "GatherGrad",
            Op::SliceGrad => "SliceGrad",
            Op::FusedMatMulGrad { .. } => "FusedMatMulGrad",
            Op::GatedMatMulGrad { .. } => "GatedMatMulGrad",
            Op::AttentionGrad { .. } => "AttentionGrad",
            Op::VarlenAttentionGrad { .. } => "VarlenAttentionGrad",
            Op::RotaryGrad { .. } => "RotaryGrad",
        }
    }

    /// The gradient op of a forward op that has one (what `<Name>Grad` parses to).
    pub fn grad_op(&self) -> Option<Op> {
        Some(match self.clone() {
            Op::Unary(u) => Op::UnaryGrad(u),
            Op::Softmax { axis } => Op::SoftmaxGrad { axis, log: false },
            Op::LogSoftmax { axis } => Op::SoftmaxGrad { axis, log: true },
            Op::LayerNormalization { axis, rms, .. } => Op::LayerNormalizationGrad { axis, rms },
            Op::SoftmaxCrossEntropyLoss {
                reduction,
                ignore_index,
            } => Op::SoftmaxCrossEntropyLossGrad {
                reduction,
                ignore_index,
            },
            Op::Gather { axis } => Op::GatherGrad { axis },
            Op::GatherElements { axis } => Op::GatherElementsGrad { axis },
            Op::GatherND { batch_dims } => Op::GatherNDGrad { batch_dims },
            Op::Slice => Op::SliceGrad,
            Op::Pad { mode } => Op::PadGrad { mode },
            Op::FusedMatMul {
                activation,
                trans_b,
            } => Op::FusedMatMulGrad {
                activation,
                trans_b,
                a_activation: Activation::None,
            },
            Op::GatedMatMul {
                activation,
                trans_b,
            } => Op::GatedMatMulGrad {
                activation,
                trans_b,
            },
            Op::Attention {
                is_causal,
                scale,
                q_num_heads,
                kv_num_heads,
            } => Op::AttentionGrad {
                is_causal,
                scale,
                q_num_heads,
                kv_num_heads,
            },
            Op::VarlenAttention { is_causal, scale } => {
                Op::VarlenAttentionGrad { is_causal, scale }
            }
            Op::Rotary { interleaved } => Op::RotaryGrad { interleaved },
            Op::Conv {
                kernel,
                window,
                group,
            }
            | Op::FusedConv {
                kernel,
                window,
                group,
                ..
            } => Op::ConvGrad {
                kernel,
                window,
                group,
            },
            Op::MaxPool { kernel, window } => Op::MaxPoolGrad { kernel, window },
            _ => return None,
        })
    }

    /// The forward op whose attributes a gradient op carries (the inverse of `grad_op`).
    pub(crate) fn grad_base(&self) -> Option<Op> {
        Some(match self.clone() {
            Op::UnaryGrad(u) => Op::Unary(u),
            Op::SoftmaxGrad { axis, log: false } => Op::Softmax { axis },
            Op::SoftmaxGrad { axis, log: true } => Op::LogSoftmax { axis },
            Op::LayerNormalizationGrad { axis, rms } => Op::LayerNormalization {
                axis,
                epsilon: 1e-5,
                rms,
                residual: false,
            },
            Op::SoftmaxCrossEntropyLossGrad {
                reduction,
                ignore_index,
            } => Op::SoftmaxCrossEntropyLoss {
                reduction,
                ignore_index,
            },
            Op::GatherGrad { axis } => Op::Gather { axis },
            Op::GatherElementsGrad { axis } => Op::GatherElements { axis },
            Op::GatherNDGrad { batch_dims } => Op::GatherND { batch_dims },
            Op::SliceGrad => Op::Slice,
            Op::PadGrad { mode } => Op::Pad { mode },
            Op::FusedMatMulGrad {
                activation,
                trans_b,
                ..
            } => Op::FusedMatMul {
                activation,
                trans_b,
            },
            Op::GatedMatMulGrad {
                activation,
                trans_b,
            } => Op::GatedMatMul {
                activation,
                trans_b,
            },
            Op::AttentionGrad {
                is_causal,
                scale,
                q_num_heads,
                kv_num_heads,
            } => Op::Attention {
                is_causal,
                scale,
                q_num_heads,
                kv_num_heads,
            },
            Op::VarlenAttentionGrad { is_causal, scale } => {
                Op::VarlenAttention { is_causal, scale }
            }
            Op::RotaryGrad { interleaved } => Op::Rotary { interleaved },
            Op::ConvGrad {
                kernel,
                window,
                group,
            } => Op::Conv {
                kernel,
                window,
                group,
            },
            Op::MaxPoolGrad { kernel, window } => Op::MaxPool { kernel, window },
            _ => return None,
        })
    }

    /// Whether this op is one of the gradient ops (`GRAD_OP_NAMES`).
    pub fn is_grad(&self) -> bool {
        matches!(
            self,
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
                | Op::RotaryGrad { .. }
                | Op::ConvGrad { .. }
                | Op::MaxPoolGrad { .. }
        )
    }

    /// Ops that draw random values: two such nodes are not the same computation, and
    /// none is folded or evaluated when a plan is made.
    pub fn is_random(&self) -> bool {
        matches!(self, Op::Dropout { .. } | Op::Random { .. })
    }

    /// Whether input `i`, among the first `arity().0`, may still be omitted: Attention's K
    /// and V (and its gradient's), which its packed-QKV form leaves out
    /// (`infer::qkv_parts`).
    pub fn may_omit(&self, i: usize) -> bool {
        match self {
            Op::Attention { .. } => i == 1 || i == 2,
            Op::AttentionGrad { .. } => i == 2 || i == 3,
            // B, before a residual normalization's R.
            Op::LayerNormalization {
                rms: false,
                residual: true,
                ..
            } => i == 2,
            _ => false,
        }
    }

    /// (min inputs, max inputs, min outputs, max outputs), counting omitted optional
    /// inputs ("") as present.
    pub fn arity(&self) -> (usize, usize, usize, usize) {
        match self {
            Op::Unary(_) | Op::Cast { .. } | Op::BitCast { .. } | Op::Identity => (1, 1, 1, 1),
            Op::Softmax { .. } => (1, 1, 1, 1),
            Op::LogSoftmax { .. } | Op::Transpose { .. } | Op::Flatten { .. } => (1, 1, 1, 1),
            Op::ArgReduce { .. } => (1, 1, 1, 1),
            // Indices are optional: a gradient asks for them (`aux_output`) when missing.
            Op::TopK { .. } => (2, 2, 1, 2),
            Op::Shape { .. } | Op::NonZero => (1, 1, 1, 1),
            Op::NonMaxSuppression { .. } => (2, 5, 1, 1),
            Op::Unique { .. } => (1, 1, 1, 4),
            Op::Binary(_) | Op::MatMul | Op::Reshape { .. } | Op::Expand => (2, 2, 1, 1),
            Op::Gather { .. } | Op::CastLike | Op::Cumulative { .. } => (2, 2, 1, 1),
            Op::GatherElements { .. } | Op::GatherND { .. } => (2, 2, 1, 1),
            Op::GatherElementsGrad { .. } | Op::GatherNDGrad { .. } => (3, 3, 1, 1),
            Op::ScatterElements { .. } | Op::ScatterND { .. } => (3, 3, 1, 1),
            Op::Pad { .. } => (2, 4, 1, 1),
            Op::PadGrad { .. } => (2, 3, 1, 1),
            Op::Conv { .. } => (2, 3, 1, 1),
            Op::FusedConv { .. } => (2, 4, 1, 2),
            Op::ConvGrad { .. } => (3, 3, 1, 2),
            Op::Im2Col { .. } => (1, 2, 1, 1),
            Op::Col2Im { .. } => (2, 3, 1, 1),
            Op::MaxPool { .. } => (1, 1, 1, 1),
            Op::MaxPoolGrad { .. } => (2, 2, 1, 1),
            Op::ResizeMatrix { .. } => (1, 4, 1, 2),
            Op::Clip => (1, 3, 1, 1),
            Op::Where | Op::Range => (3, 3, 1, 1),
            Op::Gemm { .. } => (2, 3, 1, 1),
            Op::LayerNormalization {
                rms,
                residual: true,
                ..
            } => {
                // S's slot is always there (named "" when nothing reads it).
                let (n, m) = (norm_residual_input(*rms) + 1, norm_sum_output(*rms) + 1);
                (n, n, m, m)
            }
            Op::LayerNormalization { rms: false, .. } => (2, 3, 1, 3),
            Op::LayerNormalization { rms: true, .. } => (2, 2, 1, 2),
            Op::Reduce { .. } | Op::Squeeze { .. } | Op::Unsqueeze { .. } => (1, 2, 1, 1),
            Op::Concat { .. } => (1, usize::MAX, 1, 1),
            Op::Split { .. } => (1, 2, 1, usize::MAX),
            Op::Slice => (3, 5, 1, 1),
            Op::Constant { .. } => (0, 0, 1, 1),
            Op::Trilu { .. } => (1, 2, 1, 1),
            Op::SoftmaxCrossEntropyLoss { .. } => (2, 3, 1, 2),
            Op::Dropout { .. } => (1, 3, 1, 2),
            Op::Random { shape: Some(_), .. } => (0, 0, 1, 1),
            Op::Random { shape: None, .. } => (1, 1, 1, 1),
            // The second outputs (Pre, LSE) are what the gradient ops read.
            Op::FusedMatMul { .. } => (2, 4, 1, 2),
            Op::GatedMatMul { .. } => (3, 5, 1, 3),
            Op::GatedMatMulGrad { .. } => (3, 3, 2, 2),
            Op::Attention { .. } => (3, 4, 1, 2),
            Op::VarlenAttention { .. } => (5, 5, 1, 2),
            Op::Rotary { .. } | Op::RotaryGrad { .. } => (3, 3, 1, 1),
            Op::UnaryGrad(_) | Op::SoftmaxGrad { .. } => (2, 2, 1, 1),
            Op::LayerNormalizationGrad { rms: false, .. } => (5, 6, 1, 3),
            Op::LayerNormalizationGrad { rms: true, .. } => (4, 5, 1, 2),
            Op::SoftmaxCrossEntropyLossGrad { .. } => (3, 4, 1, 1),
            Op::GatherGrad { .. } => (3, 3, 1, 1),
            Op::SliceGrad => (4, 6, 1, 1),
            Op::FusedMatMulGrad { .. } => (3, 5, 2, 4),
            Op::AttentionGrad { .. } => (6, 7, 1, 4),
            Op::VarlenAttentionGrad { .. } => (8, 8, 3, 3),
        }
    }

    /// Builds an op from its ONNX name and written attributes. `node` and `node_loc`
    /// only serve the messages.
    pub fn parse(name: &str, attrs: &[Attr], node: &str, node_loc: Option<&Loc>) -> Result<Op> {
        // A gradient op takes the attributes of the forward op it differentiates.
        if let Some(base) = name
            .strip_suffix("Grad")
            .filter(|_| GRAD_OP_NAMES.contains(&name))
        {
            // FusedMatMulGrad's own attribute (the rest are its forward op's).
            let (own, attrs): (Vec<Attr>, Vec<Attr>) = attrs
                .iter()
                .cloned()
                .partition(|a| name == "FusedMatMulGrad" && a.name == "a_activation");
            let fwd = Op::parse(base, &attrs, node, node_loc)?;
            let mut op = fwd
                .grad_op()
                .expect("every GRAD_OP_NAMES entry has a base op");
            if let (Op::FusedMatMulGrad { a_activation, .. }, false) = (&mut op, own.is_empty()) {
                let mut a = Attrs {
                    op: name,
                    node,
                    node_loc,
                    attrs: &own,
                    used: vec![false; own.len()],
                    asked: vec![],
                };
                *a_activation = a.activation("a_activation")?;
            }
            return Ok(op);
        }
        use BinaryOp as B;
        use UnaryOp as U;
        let mut a = Attrs {
            op: name,
            node,
            node_loc,
            attrs,
            used: vec![false; attrs.len()],
            asked: vec![],
        };
        let reduce = |a: &mut Attrs, kind| -> Result<Op> {
            Ok(Op::Reduce {
                kind,
                axes: a.ints("axes")?,
                keepdims: a.flag("keepdims", true)?,
                noop_with_empty_axes: a.flag("noop_with_empty_axes", false)?,
            })
        };
        let op = match name {
            "BitShift" => match a.string("direction")? {
                Some((d, _)) if d == "LEFT" => Op::Binary(B::BitShiftLeft),
                Some((d, _)) if d == "RIGHT" => Op::Binary(B::BitShiftRight),
                Some((d, at)) => {
                    return Err(a.err(
                        Some(at),
                        format!("attribute 'direction' must be \"LEFT\" or \"RIGHT\", got \"{d}\""),
                    ))
                }
                None => return Err(a.err(None, "attribute 'direction' is required".into())),
            },
            "Mod" => match a.int_or("fmod", 0)? {
                0 => Op::Binary(B::Mod),
                1 => Op::Binary(B::Fmod),
                f => {
                    let at = attrs.iter().find(|x| x.name == "fmod");
                    return Err(a.err(at, format!("attribute 'fmod' must be 0 or 1, got {f}")));
                }
            },
            "Gelu" => {
                let tanh = match a.string("approximate")? {
                    None => false,
                    Some((s, _)) if s == "none" => false,
                    Some((s, _)) if s == "tanh" => true,
                    Some((s, at)) => {
                        return Err(a.err(
                            Some(at),
                            format!(
                                "attribute 'approximate' must be \"none\" or \"tanh\", got \"{s}\""
                            ),
                        ))
                    }
                };
                Op::Unary(if tanh { U::GeluTanh } else { U::Gelu })
            }
            "Clip" => Op::Clip,
            "Where" => Op::Where,
            "Identity" => Op::Identity,
            "Cast" | "BitCast" => {
                let Some(to) = a.dtype("to")? else {
                    return Err(a.err(None, "attribute 'to' is required".into()));
                };
                if name == "BitCast" {
                    Op::BitCast { to }
                } else {
                    a.ignore_if(
                        "saturate",
                        |v| *v == AttrValue::Int(1),
                        "only the default (1) is supported",
                    )?;
                    Op::Cast { to }
                }
            }
            "CastLike" => {
                a.ignore_if(
                    "saturate",
                    |v| *v == AttrValue::Int(1),
                    "only the default (1) is supported",
                )?;
                Op::CastLike
            }
            "Range" => Op::Range,
            "NonZero" => Op::NonZero,
            "NonMaxSuppression" => Op::NonMaxSuppression {
                center_point_box: a.flag("center_point_box", false)?,
            },
            "Unique" => Op::Unique {
                sorted: a.flag("sorted", true)?,
                axis: a.int("axis")?,
            },
            "CumSum" | "CumProd" => Op::Cumulative {
                prod: name == "CumProd",
                exclusive: a.flag("exclusive", false)?,
                reverse: a.flag("reverse", false)?,
            },
            "ArgMax" | "ArgMin" => Op::ArgReduce {
                min: name == "ArgMin",
                axis: a.int_or("axis", 0)?,
                keepdims: a.flag("keepdims", true)?,
                select_last_index: a.flag("select_last_index", false)?,
            },
            "TopK" => Op::TopK {
                axis: a.int_or("axis", -1)?,
                largest: a.flag("largest", true)?,
                sorted: a.flag("sorted", true)?,
            },
            "GatherElements" => Op::GatherElements {
                axis: a.int_or("axis", 0)?,
            },
            "GatherND" => match a.int_or("batch_dims", 0)? {
                b if b >= 0 => Op::GatherND {
                    batch_dims: b as usize,
                },
                b => {
                    let at = attrs.iter().find(|x| x.name == "batch_dims");
                    return Err(a.err(at, format!("attribute 'batch_dims' must be >= 0, got {b}")));
                }
            },
            "Pad" => {
                let mode = match a.string("mode")? {
                    None => PadMode::Constant,
                    Some((s, at)) => match PadMode::ALL.iter().find(|m| m.name() == s) {
                        Some(m) => *m,
                        None => {
                            return Err(a.err(
                                Some(at),
                                format!("attribute 'mode' must be \"constant\", \"reflect\", \"edge\" or \"wrap\", got \"{s}\""),
                            ))
                        }
                    },
                };
                Op::Pad { mode }
            }
            "ScatterElements" => Op::ScatterElements {
                axis: a.int_or("axis", 0)?,
                reduction: a.scatter_reduction()?,
            },
            "ScatterND" => Op::ScatterND {
                reduction: a.scatter_reduction()?,
            },
            "Conv" | "FusedConv" => {
                let mut window = Window::parse(|k| a.get(k).map(|at| at.value.clone()), false)
                    .map_err(|m| a.err(None, m))?;
                window.channels_last = a.flag("channels_last", false)?;
                let kernel = a.ints("kernel_shape")?.unwrap_or_default();
                let group = a.int_or("group", 1)?;
                if kernel.iter().any(|&d| d < 1) || group < 1 {
                    return Err(a.err(
                        None,
                        format!(
                            "kernel_shape must hold positive values and group be positive, got {kernel:?} and {group}"
                        ),
                    ));
                }
                let (kernel, group) = (
                    kernel.into_iter().map(|d| d as usize).collect(),
                    group as usize,
                );
                match name {
                    "Conv" => Op::Conv {
                        kernel,
                        window,
                        group,
                    },
                    _ => Op::FusedConv {
                        kernel,
                        window,
                        group,
                        activation: a.activation("activation")?,
                    },
                }
            }
            "MaxPool" => {
                let mut window = Window::parse(|k| a.get(k).map(|at| at.value.clone()), true)
                    .map_err(|m| a.err(None, m))?;
                window.channels_last = a.flag("channels_last", false)?;
                let kernel = a.ints("kernel_shape")?.unwrap_or_default();
                if kernel.is_empty() || kernel.len() > 3 || kernel.iter().any(|&d| d < 1) {
                    return Err(a.err(
                        None,
                        format!("kernel_shape must hold 1 to 3 positive values, got {kernel:?}"),
                    ));
                }
                Op::MaxPool {
                    kernel: kernel.into_iter().map(|d| d as usize).collect(),
                    window,
                }
            }
            "Im2Col" | "Col2Im" => {
                let window = Window::parse(|k| a.get(k).map(|at| at.value.clone()), true)
                    .map_err(|m| a.err(None, m))?;
                let dims = |a: &mut Attrs, key: &str| -> Result<Vec<usize>> {
                    let v = a.ints(key)?.unwrap_or_default();
                    if v.iter().any(|&d| d < 1) {
                        let at = attrs.iter().find(|x| x.name == key);
                        return Err(a.err(
                            at,
                            format!("attribute '{key}' must hold positive values, got {v:?}"),
                        ));
                    }
                    Ok(v.into_iter().map(|d| d as usize).collect())
                };
                if name == "Col2Im" {
                    Op::Col2Im {
                        block: dims(&mut a, "block")?,
                        window,
                    }
                } else {
                    let kernel = dims(&mut a, "kernel_shape")?;
                    let mut num = |key: &str| -> Result<f64> {
                        Ok(match a.get(key) {
                            None => 0.0,
                            Some(at) => match &at.value {
                                AttrValue::Float(v) => *v,
                                AttrValue::Int(v) => *v as f64,
                                AttrValue::Str(s) if s == "-inf" => f64::NEG_INFINITY,
                                AttrValue::Str(s) if s == "inf" => f64::INFINITY,
                                _ => return Err(a.wrong(at, "a number (or \"inf\", \"-inf\")")),
                            },
                        })
                    };
                    Op::Im2Col {
                        kernel,
                        window,
                        pad_value: num("pad_value")?,
                        beyond_value: num("beyond_value")?,
                    }
                }
            }
            "ResizeMatrix" => {
                let resize = Resize::parse(|k| a.get(k).map(|at| at.value.clone()))
                    .map_err(|m| a.err(None, m))?;
                let index = |a: &mut Attrs, v: i64, key: &str| -> Result<usize> {
                    usize::try_from(v).map_err(|_| {
                        let at = attrs.iter().find(|x| x.name == key);
                        a.err(
                            at,
                            format!("attribute '{key}' must hold axes >= 0, got {v}"),
                        )
                    })
                };
                let axes = a.ints("axes")?.unwrap_or_default();
                let axes = axes
                    .into_iter()
                    .map(|v| index(&mut a, v, "axes"))
                    .collect::<Result<Vec<usize>>>()?;
                let Some(axis) = a.int("axis")? else {
                    return Err(a.err(None, "attribute 'axis' is required".into()));
                };
                Op::ResizeMatrix {
                    resize,
                    axes,
                    axis: index(&mut a, axis, "axis")?,
                }
            }
            "MatMul" => Op::MatMul,
            "Gemm" => Op::Gemm {
                alpha: a.float("alpha")?.unwrap_or(1.0) as f32,
                beta: a.float("beta")?.unwrap_or(1.0) as f32,
                trans_a: a.flag("transA", false)?,
                trans_b: a.flag("transB", false)?,
            },
            "Softmax" => Op::Softmax {
                axis: a.int_or("axis", -1)?,
            },
            "LogSoftmax" => Op::LogSoftmax {
                axis: a.int_or("axis", -1)?,
            },
            "LayerNormalization"
            | "RMSNormalization"
            | "AddLayerNormalization"
            | "AddRMSNormalization" => {
                // stash_type only selects the accumulation type; graphrun always accumulates
                // in f32 or wider, so any floating type gives the same result within
                // tolerance.
                a.ignore_if(
                    "stash_type",
                    |v| matches!(v, AttrValue::Int(1 | 10 | 11 | 16)),
                    "it must name a floating type (1, 10, 11 or 16)",
                )?;
                Op::LayerNormalization {
                    axis: a.int_or("axis", -1)?,
                    epsilon: a.float("epsilon")?.unwrap_or(1e-5) as f32,
                    rms: name.ends_with("RMSNormalization"),
                    residual: name.starts_with("Add"),
                }
            }
            "ReduceSum" => reduce(&mut a, ReduceKind::Sum)?,
            "ReduceMean" => reduce(&mut a, ReduceKind::Mean)?,
            "ReduceMax" => reduce(&mut a, ReduceKind::Max)?,
            "ReduceProd" => reduce(&mut a, ReduceKind::Prod)?,
            "ReduceMeanSquare" => reduce(&mut a, ReduceKind::MeanSquare)?,
            "Reshape" => Op::Reshape {
                allowzero: a.flag("allowzero", false)?,
            },
            "Transpose" => {
                let perm = match a.ints("perm")? {
                    None => None,
                    Some(p) => {
                        let n = p.len() as i64;
                        let mut seen = vec![false; p.len()];
                        for &v in &p {
                            if v < 0 || v >= n || seen[v as usize] {
                                let at = attrs.iter().find(|x| x.name == "perm");
                                return Err(a.err(
                                    at,
                                    format!(
                                        "attribute 'perm' {p:?} is not a permutation of 0..{n}"
                                    ),
                                ));
                            }
                            seen[v as usize] = true;
                        }
                        Some(p.into_iter().map(|v| v as usize).collect())
                    }
                };
                Op::Transpose { perm }
            }
            "Concat" => {
                let Some(axis) = a.int("axis")? else {
                    return Err(a.err(None, "attribute 'axis' is required".into()));
                };
                Op::Concat { axis }
            }
            "Split" => {
                let num_outputs = match a.int("num_outputs")? {
                    Some(n) if n < 1 => {
                        let at = attrs.iter().find(|x| x.name == "num_outputs");
                        return Err(a.err(
                            at,
                            format!("attribute 'num_outputs' must be at least 1, got {n}"),
                        ));
                    }
                    n => n.map(|n| n as usize),
                };
                Op::Split {
                    axis: a.int_or("axis", 0)?,
                    split: a.ints("split")?,
                    num_outputs,
                }
            }
            "Slice" => Op::Slice,
            "Squeeze" => Op::Squeeze {
                axes: a.ints("axes")?,
            },
            "Unsqueeze" => Op::Unsqueeze {
                axes: a.ints("axes")?,
            },
            "Flatten" => Op::Flatten {
                axis: a.int_or("axis", 1)?,
            },
            "Expand" => Op::Expand,
            "Gather" => Op::Gather {
                axis: a.int_or("axis", 0)?,
            },
            "Shape" => Op::Shape {
                start: a.int_or("start", 0)?,
                end: a.int("end")?,
            },
            "Constant" => {
                let mut value = None;
                for key in [
                    "value",
                    "value_float",
                    "value_floats",
                    "value_int",
                    "value_ints",
                ] {
                    let Some(at) = a.get(key) else { continue };
                    if value.is_some() {
                        return Err(a.err(Some(at), "Constant takes exactly one of value, value_float, value_floats, value_int, value_ints".into()));
                    }
                    let t = match (key, &at.value) {
                        ("value", AttrValue::Tensor(t)) => t.clone(),
                        ("value_float", AttrValue::Float(v)) => Tensor::scalar(*v as f32),
                        ("value_float", AttrValue::Int(v)) => Tensor::scalar(*v as f32),
                        ("value_floats", AttrValue::Floats(v)) => {
                            Tensor::from_vec(&[v.len()], v.iter().map(|&x| x as f32).collect())?
                        }
                        ("value_floats", AttrValue::Ints(v)) => {
                            Tensor::from_vec(&[v.len()], v.iter().map(|&x| x as f32).collect())?
                        }
                        ("value_int", AttrValue::Int(v)) => Tensor::scalar(*v),
                        ("value_ints", AttrValue::Ints(v)) => {
                            Tensor::from_vec(&[v.len()], v.clone())?
                        }
                        ("value_ints", AttrValue::Floats(v)) if v.is_empty() => {
                            Tensor::from_vec::<i64>(&[0], vec![])?
                        }
                        _ => {
                            let want = match key {
                                "value" => "a tensor ({dtype, shape, values})",
                                "value_float" => "a float",
                                "value_floats" => "a list of floats",
                                "value_int" => "an integer",
                                _ => "a list of integers",
                            };
                            return Err(a.wrong(at, want));
                        }
                    };
                    value = Some(t);
                }
                let Some(value) = value else {
                    return Err(a.err(None, "Constant needs one of value, value_float, value_floats, value_int, value_ints".into()));
                };
                Op::Constant { value }
            }
            "Trilu" => Op::Trilu {
                upper: a.flag("upper", true)?,
            },
            "SoftmaxCrossEntropyLoss" => {
                let reduction = match a.string("reduction")? {
                    None => LossReduction::Mean,
                    Some((s, at)) => match s.as_str() {
                        "mean" => LossReduction::Mean,
                        "sum" => LossReduction::Sum,
                        "none" => LossReduction::None,
                        _ => {
                            return Err(a.err(
                                Some(at),
                                format!("attribute 'reduction' must be \"mean\", \"sum\" or \"none\", got \"{s}\""),
                            ))
                        }
                    },
                };
                Op::SoftmaxCrossEntropyLoss {
                    reduction,
                    ignore_index: a.int("ignore_index")?,
                }
            }
            "Dropout" => {
                let ratio = a.float("ratio")?.unwrap_or(0.5);
                if !(0.0..1.0).contains(&ratio) {
                    let at = attrs.iter().find(|x| x.name == "ratio");
                    return Err(a.err(
                        at,
                        format!("attribute 'ratio' must be in [0, 1), got {ratio}"),
                    ));
                }
                Op::Dropout {
                    ratio: ratio as f32,
                    seed: a.int("seed")?,
                }
            }
            "RandomUniform" | "RandomUniformLike" | "RandomNormal" | "RandomNormalLike" => {
                let normal = name.starts_with("RandomNormal");
                let (an, bn) = if normal {
                    ("mean", "scale")
                } else {
                    ("low", "high")
                };
                let dtype = a.dtype("dtype")?;
                if let Some(d) = dtype.filter(|d| !d.is_float()) {
                    let at = attrs.iter().find(|x| x.name == "dtype");
                    return Err(a.err(
                        at,
                        format!("attribute 'dtype' must be a float type, got {}", d.name()),
                    ));
                }
                let shape = if name.ends_with("Like") {
                    None
                } else {
                    let Some(s) = a.ints("shape")? else {
                        return Err(a.err(None, "attribute 'shape' is required".into()));
                    };
                    if let Some(d) = s.iter().find(|&&d| d < 0) {
                        let at = attrs.iter().find(|x| x.name == "shape");
                        return Err(a.err(
                            at,
                            format!("attribute 'shape' must not be negative, got {d}"),
                        ));
                    }
                    Some(s.iter().map(|&d| d as usize).collect())
                };
                Op::Random {
                    normal,
                    a: a.float(an)?.unwrap_or(0.0) as f32,
                    b: a.float(bn)?.unwrap_or(1.0) as f32,
                    seed: a.float("seed")?,
                    dtype,
                    shape,
                }
            }
            "FusedMatMul" => Op::FusedMatMul {
                activation: a.activation("activation")?,
                trans_b: a.flag("trans_b", false)?,
            },
            "GatedMatMul" => Op::GatedMatMul {
                activation: a.activation("activation")?,
                trans_b: a.flag("trans_b", false)?,
            },
            "Attention" => {
                let op = Op::Attention {
                    is_causal: a.flag("is_causal", false)?,
                    scale: a.float("scale")?.map(|s| s as f32),
                    q_num_heads: a.count("q_num_heads")?,
                    kv_num_heads: a.count("kv_num_heads")?,
                };
                // Opset-23 attributes that only matter for forms graphrun does not take
                // (softcap, extra outputs) are accepted at their defaults.
                a.ignore_if(
                    "softcap",
                    |v| matches!(v, AttrValue::Float(x) if *x == 0.0) || *v == AttrValue::Int(0),
                    "only softcap 0 is supported",
                )?;
                a.ignore_if(
                    "qk_matmul_output_mode",
                    |v| *v == AttrValue::Int(0),
                    "only mode 0 is supported",
                )?;
                a.ignore_if("softmax_precision", |_| true, "")?;
                op
            }
            "VarlenAttention" => Op::VarlenAttention {
                is_causal: a.flag("is_causal", false)?,
                scale: a.float("scale")?.map(|s| s as f32),
            },
            "Rotary" => Op::Rotary {
                interleaved: a.flag("interleaved", false)?,
            },
            _ => {
                if let Some(b) = BinaryOp::parse(name) {
                    a.finish()?;
                    return Ok(Op::Binary(b));
                }
                let float = |a: &mut Attrs, k: &str, d: f64| Ok(a.float(k)?.unwrap_or(d));
                if let Some(u) = UnaryOp::parse(name, |k, d| float(&mut a, k, d)) {
                    let op = Op::Unary(u?);
                    a.finish()?;
                    return Ok(op);
                }
                let known = OP_NAMES
                    .iter()
                    .chain(GRAD_OP_NAMES.iter())
                    .chain(INTERNAL_OP_NAMES)
                    .copied();
                let msg = match did_you_mean(name, known) {
                    Some(s) => format!("unknown op '{name}'; did you mean '{s}'?"),
                    None => format!("unknown op '{name}'"),
                };
                return Err(match node_loc {
                    Some(l) => Error::model(l, format!("node '{node}': {msg}")),
                    None => Error::Graph(format!("node '{node}': {msg}")),
                });
            }
        };
        a.finish()?;
        Ok(op)
    }

    /// The attributes to write back; defaults are left out. Parsing these gives `self`.
    pub fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        use AttrValue as V;
        let mut v: Vec<(&'static str, AttrValue)> = vec![];
        if let Some(base) = self.grad_base() {
            v = base.attrs();
            if let Op::LayerNormalizationGrad { .. } = self {
                v.retain(|(k, _)| *k == "axis");
            }
            if let Op::FusedMatMulGrad { a_activation, .. } = self {
                if *a_activation != Activation::None {
                    v.push(("a_activation", V::Str(a_activation.name().into())));
                }
            }
            return v;
        }
        let b = |x: bool| V::Int(x as i64);
        match self {
            Op::Unary(UnaryOp::GeluTanh) => v.push(("approximate", V::Str("tanh".into()))),
            Op::Binary(BinaryOp::Fmod) => v.push(("fmod", V::Int(1))),
            Op::Binary(BinaryOp::BitShiftLeft) => v.push(("direction", V::Str("LEFT".into()))),
            Op::Binary(BinaryOp::BitShiftRight) => v.push(("direction", V::Str("RIGHT".into()))),
            Op::Unary(u) => v.extend(u.attrs().into_iter().map(|(k, x)| (k, f32_attr(x)))),
            Op::Cast { to } | Op::BitCast { to } => v.push(("to", V::Str(to.name().into()))),
            Op::Gemm {
                alpha,
                beta,
                trans_a,
                trans_b,
            } => {
                v.push(("alpha", f32_attr(*alpha)));
                v.push(("beta", f32_attr(*beta)));
                v.push(("transA", b(*trans_a)));
                v.push(("transB", b(*trans_b)));
            }
            Op::Softmax { axis } | Op::LogSoftmax { axis } | Op::Concat { axis } => {
                v.push(("axis", V::Int(*axis)))
            }
            Op::Flatten { axis } | Op::Gather { axis } | Op::GatherElements { axis } => {
                v.push(("axis", V::Int(*axis)))
            }
            Op::GatherND { batch_dims } => v.push(("batch_dims", V::Int(*batch_dims as i64))),
            Op::Pad { mode } => v.push(("mode", V::Str(mode.name().into()))),
            Op::ScatterElements { axis, reduction } => {
                v.push(("axis", V::Int(*axis)));
                v.push(("reduction", V::Str(reduction.name().into())));
            }
            Op::ScatterND { reduction } => v.push(("reduction", V::Str(reduction.name().into()))),
            Op::Im2Col {
                kernel,
                window,
                pad_value,
                beyond_value,
            } => v.extend(super::window::im2col_attrs(
                kernel,
                window,
                *pad_value,
                *beyond_value,
            )),
            Op::Conv {
                kernel,
                window,
                group,
            }
            | Op::FusedConv {
                kernel,
                window,
                group,
                ..
            } => {
                if let Op::FusedConv { activation, .. } = self {
                    v.push(("activation", V::Str(activation.name().into())));
                }
                if !kernel.is_empty() {
                    v.push((
                        "kernel_shape",
                        V::Ints(kernel.iter().map(|&d| d as i64).collect()),
                    ));
                }
                v.extend(window.attrs());
                if *group != 1 {
                    v.push(("group", V::Int(*group as i64)));
                }
            }
            Op::MaxPool { kernel, window } | Op::MaxPoolGrad { kernel, window } => {
                v.push((
                    "kernel_shape",
                    V::Ints(kernel.iter().map(|&d| d as i64).collect()),
                ));
                v.extend(window.attrs())
            }
            Op::Col2Im { block, window } => {
                if !block.is_empty() {
                    v.push(("block", V::Ints(block.iter().map(|&d| d as i64).collect())));
                }
                v.extend(window.attrs())
            }
            Op::ResizeMatrix { resize, axes, axis } => {
                v.extend(resize.attrs());
                v.push(("axes", V::Ints(axes.iter().map(|&d| d as i64).collect())));
                v.push(("axis", V::Int(*axis as i64)));
            }
            Op::NonMaxSuppression { center_point_box } => {
                v.push(("center_point_box", b(*center_point_box)));
            }
            Op::Unique { sorted, axis } => {
                v.push(("sorted", b(*sorted)));
                if let Some(a) = axis {
                    v.push(("axis", V::Int(*a)));
                }
            }
            Op::Cumulative {
                exclusive, reverse, ..
            } => {
                v.push(("exclusive", b(*exclusive)));
                v.push(("reverse", b(*reverse)));
            }
            Op::ArgReduce {
                axis,
                keepdims,
                select_last_index,
                ..
            } => {
                v.push(("axis", V::Int(*axis)));
                v.push(("keepdims", b(*keepdims)));
                v.push(("select_last_index", b(*select_last_index)));
            }
            Op::TopK {
                axis,
                largest,
                sorted,
            } => {
                v.push(("axis", V::Int(*axis)));
                v.push(("largest", b(*largest)));
                v.push(("sorted", b(*sorted)));
            }
            Op::LayerNormalization { axis, epsilon, .. } => {
                v.push(("axis", V::Int(*axis)));
                v.push(("epsilon", f32_attr(*epsilon)));
            }
            Op::Reduce {
                axes,
                keepdims,
                noop_with_empty_axes,
                ..
            } => {
                if let Some(ax) = axes {
                    v.push(("axes", V::Ints(ax.clone())));
                }
                v.push(("keepdims", b(*keepdims)));
                if *noop_with_empty_axes {
                    v.push(("noop_with_empty_axes", V::Int(1)));
                }
            }
            Op::Reshape { allowzero: true } => v.push(("allowzero", V::Int(1))),
            Op::Transpose { perm: Some(p) } => {
                v.push(("perm", V::Ints(p.iter().map(|&x| x as i64).collect())))
            }
            Op::Split {
                axis,
                split,
                num_outputs,
            } => {
                v.push(("axis", V::Int(*axis)));
                if let Some(s) = split {
                    v.push(("split", V::Ints(s.clone())));
                }
                if let Some(n) = num_outputs {
                    v.push(("num_outputs", V::Int(*n as i64)));
                }
            }
            Op::Squeeze { axes: Some(ax) } | Op::Unsqueeze { axes: Some(ax) } => {
                v.push(("axes", V::Ints(ax.clone())))
            }
            Op::Shape { start, end } => {
                if *start != 0 {
                    v.push(("start", V::Int(*start)));
                }
                if let Some(e) = end {
                    v.push(("end", V::Int(*e)));
                }
            }
            Op::Constant { value } => v.push(("value", V::Tensor(value.clone()))),
            Op::Trilu { upper } => v.push(("upper", b(*upper))),
            Op::Rotary { interleaved: true } => v.push(("interleaved", b(true))),
            Op::SoftmaxCrossEntropyLoss {
                reduction,
                ignore_index,
            } => {
                let r = match reduction {
                    LossReduction::Mean => "mean",
                    LossReduction::Sum => "sum",
                    LossReduction::None => "none",
                };
                v.push(("reduction", V::Str(r.into())));
                if let Some(i) = ignore_index {
                    v.push(("ignore_index", V::Int(*i)));
                }
            }
            Op::Random {
                normal,
                a,
                b,
                seed,
                dtype,
                shape,
            } => {
                let (an, bn) = if *normal {
                    ("mean", "scale")
                } else {
                    ("low", "high")
                };
                v.push((an, f32_attr(*a)));
                v.push((bn, f32_attr(*b)));
                if let Some(s) = seed {
                    v.push(("seed", V::Float(*s)));
                }
                if let Some(d) = dtype {
                    v.push(("dtype", V::Str(d.name().into())));
                }
                if let Some(s) = shape {
                    v.push(("shape", V::Ints(s.iter().map(|&d| d as i64).collect())));
                }
            }
            Op::Dropout { ratio, seed } => {
                v.push(("ratio", f32_attr(*ratio)));
                if let Some(s) = seed {
                    v.push(("seed", V::Int(*s)));
                }
            }
            Op::FusedMatMul {
                activation,
                trans_b,
            }
            | Op::GatedMatMul {
                activation,
                trans_b,
            } => {
                v.push(("activation", V::Str(activation.name().into())));
                v.push(("trans_b", b(*trans_b)));
            }
            Op::Attention {
                is_causal, scale, ..
            }
            | Op::VarlenAttention { is_causal, scale } => {
                v.push(("is_causal", b(*is_causal)));
                if let Some(s) = scale {
                    v.push(("scale", f32_attr(*s)));
                }
                if let Op::Attention {
                    q_num_heads,
                    kv_num_heads,
                    ..
                } = self
                {
                    for (name, n) in [("q_num_heads", q_num_heads), ("kv_num_heads", kv_num_heads)]
                    {
                        if let Some(n) = n {
                            v.push((name, V::Int(*n as i64)));
                        }
                    }
                }
            }
            _ => {}
        }
        v
    }
}

/// An f32 attribute as the shortest decimal that reads back as the same f32, so that a
/// written model says `epsilon: 1e-5`, not `9.999999747378752e-6`.
fn f32_attr(x: f32) -> AttrValue {
    AttrValue::Float(x.to_string().parse().unwrap_or(x as f64))
}

/// The operator table of README.md, generated from the code (tests/readme.rs keeps the
/// README in step with it): each op, its family, and the backends that run it.
pub fn op_table_markdown() -> String {
    let family = |n: &str| match n {
        "MatMul" | "Gemm" | "FusedMatMul" | "GatedMatMul" => "linear algebra",
        "Softmax"
        | "LogSoftmax"
        | "LayerNormalization"
        | "RMSNormalization"
        | "AddLayerNormalization"
        | "AddRMSNormalization"
        | "ReduceSum"
        | "ReduceMean"
        | "ReduceMax"
        | "ReduceProd" => "normalization / reduction",
        "ArgMax" | "ArgMin" | "TopK" => "selection",
        "Reshape" | "Transpose" | "Concat" | "Split" | "Slice" | "Squeeze" | "Unsqueeze"
        | "Flatten" | "Expand" | "Gather" | "Shape" | "Constant" | "Trilu" | "BitCast" => "shape",
        "GatherElements" | "GatherND" | "Pad" | "ScatterElements" | "ScatterND" => "indexing",
        "NonZero" | "Unique" | "NonMaxSuppression" => "data-dependent shape (host, at plan time)",
        "Col2Im" => "sliding window (ConvTranspose and the pools are written on it)",
        "MaxPool" => "pooling",
        "Conv" | "FusedConv" => "convolution",
        "SoftmaxCrossEntropyLoss" => "loss",
        "Attention" | "VarlenAttention" => "attention (fused)",
        "Rotary" => "rotary position embedding (fused)",
        "Dropout" => "regularization",
        "RandomUniform" | "RandomUniformLike" | "RandomNormal" | "RandomNormalLike" => "random",
        _ => "elementwise",
    };
    let mut s = String::from("| op | family | cpu | cuda | wgpu |\n|---|---|---|---|---|\n");
    for n in OP_NAMES.iter() {
        s.push_str(&format!("| `{n}` | {} | ✓ | ✓ | ✓ |\n", family(n)));
    }
    s
}
