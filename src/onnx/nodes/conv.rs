//! Transposed convolutions and pools, written on graphrun's `Im2Col` and `Col2Im`
//! (graph/window.rs): ConvTranspose is the weights' transpose times the input summed back
//! into an image by Col2Im, and a pool a reduction over the window axis of the columns.
//! Every backend then runs them and autodiff differentiates them through their parts.
//! (Conv is graphrun's own op, and so is a floating MaxPool without Indices.)

use super::composite::{bin, inputs, output, reshape, shape, squeeze, un, Attrs};
use super::Importer;
use crate::error::{Error, Result};
use crate::graph::op::Attr;
use crate::graph::window::{AutoPad, Window};
use crate::graph::{BinaryOp, Op, ReduceKind, UnaryOp};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};

/// The ai.onnx operators written here.
pub(super) const WINDOWED: &[&str] = &[
    "ConvTranspose",
    "MaxPool",
    "AveragePool",
    "LpPool",
    "GlobalLpPool",
    "CausalConvWithState",
    "MaxUnpool",
];

fn reduce(kind: ReduceKind, axes: Vec<i64>, keepdims: bool) -> Op {
    Op::Reduce {
        kind,
        axes: Some(axes),
        keepdims,
        noop_with_empty_axes: false,
    }
}

impl Attrs {
    /// strides, dilations, pads, auto_pad (and ceil_mode for the pools).
    fn window(&mut self, ceil: bool) -> Result<Window> {
        Window::parse(|k| self.take(k), ceil)
            .map_err(|m| Error::Graph(format!("{}: {m}", self.what)))
    }
    /// kernel_shape, when given.
    fn kernel(&mut self) -> Result<Option<Vec<usize>>> {
        match self.opt_ints("kernel_shape")? {
            None => Ok(None),
            Some(v) if !v.is_empty() && v.iter().all(|&d| d >= 1) => {
                Ok(Some(v.iter().map(|&d| d as usize).collect()))
            }
            Some(v) => Err(self.refuse(
                "kernel_shape",
                &format!("must hold one positive value per spatial axis, got {v:?}"),
            )),
        }
    }
    fn group(&mut self) -> Result<i64> {
        match self.int("group", 1)? {
            g if g >= 1 => Ok(g),
            g => Err(self.refuse("group", &format!("must be positive, got {g}"))),
        }
    }
}

impl Importer<'_> {
    /// Writes one of `WINDOWED`.
    pub(super) fn lower_windowed(
        &mut self,
        n: &NodeProto,
        shown: &str,
        attrs: Vec<Attr>,
    ) -> Result<()> {
        let a = Attrs::of(n, shown, attrs)?;
        let what = a.what.clone();
        match n.op_type.as_str() {
            "ConvTranspose" => self.conv_transpose(n, &what, a),
            "GlobalLpPool" => self.global_lp_pool(n, &what, a),
            "CausalConvWithState" => self.causal_conv(n, &what, a),
            "MaxUnpool" => self.max_unpool(n, &what, a),
            _ => self.pool(n, &what, a),
        }
    }

    /// CausalConvWithState (input [B, C, L], weight [C, 1, k], bias?, past_state?
    /// [B, C, k-1]) -> (output, present_state), as ONNX defines it: the input with the
    /// past state (zeros when none) before it along the length, a depthwise Conv of that
    /// without padding, SiLU when asked; the present state is the last k-1 positions of
    /// the padded input. k comes from `Shape(weight)`, so only C must be known (the Conv's
    /// group count).
    fn causal_conv(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let act = a.string("activation", "none")?;
        let silu = match act.as_str() {
            "none" => false,
            "silu" | "swish" => true,
            _ => {
                return Err(a.refuse(
                    "activation",
                    &format!("must be none, silu or swish, got '{act}'"),
                ))
            }
        };
        a.finish()?;
        let (req, opt) = inputs(n, what, (2, 4), 2)?;
        let (x, w) = (req[0].clone(), req[1].clone());
        let channels = [(&w, 0), (&x, 1)]
            .iter()
            .find_map(|(v, d)| self.dims.get(*v).and_then(|s| s.get(*d).copied().flatten()))
            .ok_or_else(|| {
                Error::Graph(format!(
                    "{what}: the number of channels is unknown: declare the shape of weight or input"
                ))
            })?;
        let axis = self.ints_const(n, "length_axis", &[2])?;
        let k = self.val(n, "k", shape(2, Some(3)), vec![w.clone()]);
        let one = self.ints_const(n, "one", &[1])?;
        let kept = self.val(n, "state_length", bin(BinaryOp::Sub), vec![k, one]);
        let padded = match opt.get(1).cloned().flatten() {
            Some(past) => self.val(n, "padded", Op::Concat { axis: 2 }, vec![past, x]),
            None => {
                let zero = self.ints_const(n, "zero", &[0])?;
                let pads = self.val(n, "pads", Op::Concat { axis: 0 }, vec![kept.clone(), zero]);
                let pad = Op::Pad {
                    mode: crate::graph::op::PadMode::Constant,
                };
                self.val(n, "padded", pad, vec![x, pads, String::new(), axis.clone()])
            }
        };
        let mut conv_ins = vec![padded.clone(), w];
        conv_ins.extend(opt.first().cloned().flatten());
        let conv = Op::Conv {
            kernel: vec![],
            window: Window {
                strides: vec![1],
                dilations: vec![1],
                pads: vec![0, 0],
                auto_pad: AutoPad::NotSet,
                ..Default::default()
            },
            group: channels,
        };
        if silu {
            let y = self.val(n, "conv", conv, conv_ins);
            let s = self.val(n, "sigmoid", un(UnaryOp::Sigmoid), vec![y.clone()]);
            self.out(n, 0, bin(BinaryOp::Mul), vec![y, s]);
        } else {
            self.out(n, 0, conv, conv_ins);
        }
        if output(n, 1).is_some() {
            let len = self.val(n, "padded_length", shape(2, Some(3)), vec![padded.clone()]);
            let start = self.val(
                n,
                "state_start",
                bin(BinaryOp::Sub),
                vec![len.clone(), kept],
            );
            self.out(n, 1, Op::Slice, vec![padded, start, len, axis]);
        }
        Ok(())
    }

    /// MaxUnpool (X, I, output_shape?) as ONNX's reference computes it: X's values put
    /// at the flat positions I (MaxPool's Indices) of zeros shaped as MaxPool's input
    /// would be, `(in - 1)·stride - pads + kernel` per spatial axis, then zero-padded at
    /// the end of each axis to output_shape when given. A ScatterElements, so X's
    /// gradient is a gather at I.
    fn max_unpool(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let Some(kernel) = a.kernel()? else {
            return Err(a.refuse("kernel_shape", "is required"));
        };
        let r = kernel.len();
        let strides = a.ints("strides", &vec![1; r])?;
        let pads = a.ints("pads", &vec![0; 2 * r])?;
        if strides.len() != r || strides.iter().any(|&s| s < 1) {
            return Err(a.refuse(
                "strides",
                &format!("must hold {r} positive values, got {strides:?}"),
            ));
        }
        if pads.len() != 2 * r || pads.iter().any(|&p| p < 0) {
            return Err(a.refuse(
                "pads",
                &format!(
                    "must hold {} values that are not negative, got {pads:?}",
                    2 * r
                ),
            ));
        }
        a.finish()?;
        let (req, opt) = inputs(n, what, (2, 3), 1)?;
        let (x, idx) = (req[0].clone(), req[1].clone());
        // The unpooled shape: N, C, then per axis (in - 1)·stride - pads + kernel.
        let mut dims = vec![self.val(n, "nc", shape(0, Some(2)), vec![x.clone()])];
        for d in 0..r {
            let i = 2 + d as i64;
            let size = self.val(n, &format!("in{d}"), shape(i, Some(i + 1)), vec![x.clone()]);
            let one = self.ints_const(n, &format!("one{d}"), &[1])?;
            let s = self.ints_const(n, &format!("stride{d}"), &[strides[d]])?;
            let extra = kernel[d] as i64 - pads[d] - pads[r + d];
            let extra = self.ints_const(n, &format!("extra{d}"), &[extra])?;
            let v = self.val(n, &format!("in{d}_m1"), bin(BinaryOp::Sub), vec![size, one]);
            let v = self.val(n, &format!("in{d}_strided"), bin(BinaryOp::Mul), vec![v, s]);
            dims.push(self.val(n, &format!("out{d}"), bin(BinaryOp::Add), vec![v, extra]));
        }
        let full = self.val(n, "unpooled_shape", Op::Concat { axis: 0 }, dims);
        let total = self.val(
            n,
            "total",
            Op::Reduce {
                kind: ReduceKind::Prod,
                axes: None,
                keepdims: true,
                noop_with_empty_axes: false,
            },
            vec![full.clone()],
        );
        let zero = self.constant(n, "zero", Tensor::scalar(0f32));
        let zero = self.val(n, "zero_like", Op::CastLike, vec![zero, x.clone()]);
        let zeros = self.val(n, "zeros", Op::Expand, vec![zero, total]);
        let flat = self.ints_const(n, "flat", &[-1])?;
        let xf = self.val(n, "x_flat", reshape(), vec![x, flat.clone()]);
        let idf = self.val(n, "i_flat", reshape(), vec![idx, flat]);
        let put = Op::ScatterElements {
            axis: 0,
            reduction: crate::graph::op::ScatterReduction::None,
        };
        let y = self.val(n, "scattered", put, vec![zeros, idf, xf]);
        match opt.first().cloned().flatten() {
            None => self.out(n, 0, reshape(), vec![y, full]),
            Some(out_shape) => {
                let y = self.val(n, "unpooled", reshape(), vec![y, full.clone()]);
                let want = self.val(n, "out_shape", Op::Cast { to: DType::I64 }, vec![out_shape]);
                let grow = self.val(n, "grow", bin(BinaryOp::Sub), vec![want, full]);
                let before = self.ints_const(n, "pads_before", &vec![0; r + 2])?;
                let pads = self.val(n, "pads", Op::Concat { axis: 0 }, vec![before, grow]);
                let pad = Op::Pad {
                    mode: crate::graph::op::PadMode::Constant,
                };
                self.out(n, 0, pad, vec![y, pads]);
            }
        }
        Ok(())
    }

    /// The value's dims when the model gives all of them.
    fn static_dims(&self, v: &str) -> Option<Vec<usize>> {
        self.dims.get(v)?.iter().copied().collect()
    }

    /// The kernel's dims: the attribute, else the weight's dims past the first two.
    fn kernel_dims(&self, attr: Option<Vec<usize>>, w: &str) -> Option<Vec<usize>> {
        attr.or_else(|| {
            self.static_dims(w)
                .filter(|d| d.len() >= 3)
                .map(|d| d[2..].to_vec())
        })
    }

    /// The number of spatial axes, from the kernel or the declared ranks.
    fn spatial_rank(&self, what: &str, kernel: &Option<Vec<usize>>, of: &[&str]) -> Result<usize> {
        if let Some(k) = kernel {
            return Ok(k.len());
        }
        of.iter()
            .find_map(|v| self.ranks.get(*v).filter(|&&r| r >= 3).map(|r| r - 2))
            .ok_or_else(|| {
                Error::Graph(format!(
                    "{what}: the number of spatial axes is unknown: give kernel_shape, or declare the rank of X or W"
                ))
            })
    }

    fn dims_of(
        &mut self,
        n: &NodeProto,
        what: &str,
        v: &str,
        start: i64,
        end: Option<i64>,
    ) -> String {
        self.val(n, what, shape(start, end), vec![v.to_string()])
    }

    fn concat(&mut self, n: &NodeProto, what: &str, parts: Vec<String>) -> String {
        self.val(n, what, Op::Concat { axis: 0 }, parts)
    }

    /// Im2Col of `x`: the kernel's dims as the attribute when known, else read from the
    /// weight's shape when the plan is made.
    #[allow(clippy::too_many_arguments)]
    fn columns(
        &mut self,
        n: &NodeProto,
        what: &str,
        x: &str,
        kernel: &Option<Vec<usize>>,
        w: Option<&str>,
        window: &Window,
        pad_value: f64,
        beyond_value: f64,
    ) -> String {
        let mut ins = vec![x.to_string()];
        if let (None, Some(w)) = (kernel, w) {
            ins.push(self.dims_of(n, "kernel_dims", w, 2, None));
        }
        let op = Op::Im2Col {
            kernel: kernel.clone().unwrap_or_default(),
            window: window.clone(),
            pad_value,
            beyond_value,
        };
        self.val(n, what, op, ins)
    }

    /// `[N, G·R, L]` from `[N, G, R, L]` (or the reverse split with `split`): reshapes
    /// that keep N and L, read from the value's own shape.
    fn regroup(
        &mut self,
        n: &NodeProto,
        what: &str,
        v: &str,
        groups: Option<i64>,
    ) -> Result<String> {
        let shape_v = match groups {
            // [N, R, L] → [N, G, R/G, L]
            Some(g) => {
                let head = self.ints_const(n, &format!("{what}_head"), &[0, g, -1])?;
                let l = self.dims_of(n, &format!("{what}_len"), v, 2, Some(3));
                self.concat(n, &format!("{what}_shape"), vec![head, l])
            }
            // [N, G, R, L] → [N, G·R, L]
            None => {
                let nn = self.dims_of(n, &format!("{what}_n"), v, 0, Some(1));
                let mid = self.ints_const(n, &format!("{what}_mid"), &[-1])?;
                let l = self.dims_of(n, &format!("{what}_len"), v, 3, Some(4));
                self.concat(n, &format!("{what}_shape"), vec![nn, mid, l])
            }
        };
        Ok(self.val(n, what, reshape(), vec![v.to_string(), shape_v]))
    }

    /// `y + bias` with the `[M]` bias broadcast over the spatial axes.
    fn add_bias(&mut self, n: &NodeProto, y: String, bias: Option<String>, r: usize) {
        match bias {
            None => self.out(n, 0, Op::Identity, vec![y]),
            Some(b) => {
                let axes = (1..=r as i64).collect();
                let b = self.val(n, "bias_c", Op::Unsqueeze { axes: Some(axes) }, vec![b]);
                self.out(n, 0, bin(BinaryOp::Add), vec![y, b]);
            }
        }
    }

    /// ConvTranspose: the columns Wᵀ · X[n] (per group) summed into the output image by
    /// Col2Im, plus the bias. The image is output_shape, or stride·(in - 1) +
    /// output_padding + dilated kernel - pads; auto_pad SAME_* splits the padding that
    /// makes it in·stride (this needs X's spatial dims in the model).
    fn conv_transpose(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let window = a.window(false)?;
        let group = a.group()?;
        let kattr = a.kernel()?;
        let output_padding = a.ints("output_padding", &[])?;
        let output_shape = a.opt_ints("output_shape")?;
        a.finish()?;
        let (ins, opt) = inputs(n, what, (2, 3), 1)?;
        let (x, w) = (ins[0].clone(), ins[1].clone());
        let kernel = self.kernel_dims(kattr, &w);
        let r = self.spatial_rank(what, &kernel, &[&w, &x])?;
        let fixed = |v: &[usize], d: usize, what: &str| -> Result<Vec<i64>> {
            match v.len() {
                0 => Ok(vec![d as i64; r]),
                k if k == r => Ok(v.iter().map(|&x| x as i64).collect()),
                k => Err(Error::Graph(format!(
                    "{what}: attribute has {k} values for {r} spatial axes"
                ))),
            }
        };
        let strides = fixed(&window.strides, 1, what)?;
        let dilations = fixed(&window.dilations, 1, what)?;
        let out_pad = match output_padding.len() {
            0 => vec![0; r],
            k if k == r => output_padding.clone(),
            k => {
                return Err(Error::Graph(format!(
                    "{what}: attribute 'output_padding' has {k} values for {r} spatial axes"
                )))
            }
        };
        let out_shape = match output_shape {
            None => None,
            Some(v) if v.len() == r => Some(v),
            Some(v) if v.len() == r + 2 => Some(v[2..].to_vec()),
            Some(v) => {
                return Err(Error::Graph(format!(
                    "{what}: attribute 'output_shape' {v:?} must give the {r} spatial dims"
                )))
            }
        };
        // The padding (begin, end per axis).
        let (begin, end): (Vec<i64>, Vec<i64>) = match window.auto_pad {
            AutoPad::SameUpper | AutoPad::SameLower => {
                let (Some(k), Some(xd)) = (&kernel, self.static_dims(&x)) else {
                    return Err(Error::Graph(format!(
                        "{what}: auto_pad {} needs the kernel's and X's spatial dims in the model (declare X's shape)",
                        window.auto_pad.name()
                    )));
                };
                (0..r)
                    .map(|d| {
                        let s = xd[d + 2] as i64;
                        let out = out_shape.as_ref().map_or(s * strides[d], |o| o[d]);
                        let span = (k[d] as i64 - 1) * dilations[d] + 1;
                        let total = (strides[d] * (s - 1) + out_pad[d] + span - out).max(0);
                        if window.auto_pad == AutoPad::SameUpper {
                            (total / 2, total - total / 2)
                        } else {
                            (total - total / 2, total / 2)
                        }
                    })
                    .unzip()
            }
            AutoPad::Valid => (vec![0; r], vec![0; r]),
            AutoPad::NotSet => match window.pads.len() {
                0 => (vec![0; r], vec![0; r]),
                k if k == 2 * r => (
                    window.pads[..r].iter().map(|&x| x as i64).collect(),
                    window.pads[r..].iter().map(|&x| x as i64).collect(),
                ),
                k => {
                    return Err(Error::Graph(format!(
                        "{what}: attribute 'pads' has {k} values; {r} spatial axes need {}",
                        2 * r
                    )));
                }
            },
        };
        // The image: output_shape, or computed from X's spatial dims when the plan is made.
        let image = match &out_shape {
            Some(o) => self.ints_const(n, "image_shape", o)?,
            None => {
                let s = self.dims_of(n, "in_dims", &x, 2, None);
                let one = self.ints_const(n, "ones", &vec![1; r])?;
                let sm1 = self.val(n, "in_dims_m1", bin(BinaryOp::Sub), vec![s, one]);
                let st = self.ints_const(n, "strides", &strides)?;
                let grown = self.val(n, "strided", bin(BinaryOp::Mul), vec![sm1, st]);
                // + output_padding - pads + the dilated kernel.
                let rest: Vec<i64> = (0..r).map(|d| out_pad[d] - begin[d] - end[d]).collect();
                let span = match &kernel {
                    Some(k) => {
                        let v: Vec<i64> = (0..r)
                            .map(|d| (k[d] as i64 - 1) * dilations[d] + 1 + rest[d])
                            .collect();
                        self.ints_const(n, "span", &v)?
                    }
                    None => {
                        let k = self.dims_of(n, "kernel_dims_t", &w, 2, None);
                        let one = self.ints_const(n, "ones_k", &vec![1; r])?;
                        let km1 = self.val(n, "kernel_m1", bin(BinaryOp::Sub), vec![k, one]);
                        let dl = self.ints_const(n, "dilations", &dilations)?;
                        let kd = self.val(n, "kernel_dilated", bin(BinaryOp::Mul), vec![km1, dl]);
                        let c: Vec<i64> = rest.iter().map(|&x| x + 1).collect();
                        let c = self.ints_const(n, "span_rest", &c)?;
                        self.val(n, "span", bin(BinaryOp::Add), vec![kd, c])
                    }
                };
                self.val(n, "image_shape", bin(BinaryOp::Add), vec![grown, span])
            }
        };
        if begin.iter().chain(&end).any(|&p| p < 0) {
            return Err(Error::Graph(format!(
                "{what}: output_shape is larger than the input can reach (negative padding)"
            )));
        }
        let flat = self.ints_const(n, "x_flat", &[0, 0, -1])?;
        let x3 = self.val(n, "x_3d", reshape(), vec![x, flat]);
        let wshape = self.ints_const(n, "weight_flat", &[0, -1])?;
        let wf = self.val(n, "weight_2d", reshape(), vec![w.clone(), wshape]);
        let cols = if group == 1 {
            let wt = self.val(n, "weight_t", Op::Transpose { perm: None }, vec![wf]);
            self.val(n, "cols", Op::MatMul, vec![wt, x3])
        } else {
            // [G, M/G·K, C/G] × [N, G, C/G, L] → [N, G, M/G·K, L].
            let xg = self.regroup(n, "x_grouped", &x3, Some(group))?;
            let head = self.ints_const(n, "weight_head", &[group, -1])?;
            let mk = self.dims_of(n, "weight_mk", &wf, 1, Some(2));
            let wgs = self.concat(n, "weight_grouped_shape", vec![head, mk]);
            let wg = self.val(n, "weight_grouped", reshape(), vec![wf, wgs]);
            let perm = Some(vec![0, 2, 1]);
            let wgt = self.val(n, "weight_grouped_t", Op::Transpose { perm }, vec![wg]);
            let c4 = self.val(n, "cols_grouped", Op::MatMul, vec![wgt, xg]);
            self.regroup(n, "cols", &c4, None)?
        };
        let pads: Vec<usize> = begin.iter().chain(&end).map(|&p| p as usize).collect();
        let win = Window {
            strides: strides.iter().map(|&s| s as usize).collect(),
            dilations: dilations.iter().map(|&d| d as usize).collect(),
            pads,
            auto_pad: AutoPad::NotSet,
            ..Default::default()
        };
        let mut c2i = vec![cols, image];
        if kernel.is_none() {
            c2i.push(self.dims_of(n, "block_dims", &w, 2, None));
        }
        let op = Op::Col2Im {
            block: kernel.unwrap_or_default(),
            window: win,
        };
        let y = self.val(n, "unbiased", op, c2i);
        self.add_bias(n, y, opt[0].clone(), r);
        Ok(())
    }

    /// MaxPool, AveragePool and LpPool: a reduction over the window axis of the columns
    /// viewed as `[N, C, K, *out]`.
    fn pool(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let op = n.op_type.clone();
        let Some(kernel) = a.kernel()? else {
            return Err(Error::Graph(format!(
                "{what}: attribute 'kernel_shape' is required"
            )));
        };
        let window = a.window(true)?;
        let include_pad = op == "AveragePool" && a.flag("count_include_pad")?;
        let p = if op == "LpPool" {
            a.float("p", 2.0)?
        } else {
            2.0
        };
        let storage_order = if op == "MaxPool" {
            a.int("storage_order", 0)?
        } else {
            0
        };
        a.finish()?;
        let max = op == "MaxPool";
        let (ins, _) = inputs(n, what, (1, 1), if max { 2 } else { 1 })?;
        let x = ins[0].clone();
        // graphrun's own MaxPool where no Indices are asked for: no backend lays out the
        // windows, and its gradient goes to one position per window. Its X is floating
        // (most often a value the importer has no type for, such as a Relu's output); an
        // 8-bit one known here keeps the columns form, which every backend reduces.
        let float = self
            .dtypes
            .get(&x)
            .is_none_or(|d| matches!(d, DType::F16 | DType::BF16 | DType::F32 | DType::F64));
        if max && float && output(n, 1).is_none() && (1..=3).contains(&kernel.len()) {
            self.out(n, 0, Op::MaxPool { kernel, window }, vec![x]);
            return Ok(());
        }
        let k: usize = kernel.iter().product();
        let r = kernel.len();
        let fill = if max { f64::NEG_INFINITY } else { 0.0 };
        let cols = self.columns(
            n,
            "cols",
            &x,
            &Some(kernel.clone()),
            None,
            &window,
            fill,
            fill,
        );
        let nc = self.dims_of(n, "nc", &x, 0, Some(2));
        let kd = self.ints_const(n, "window", &[k as i64])?;
        let spatial = self.dims_of(n, "out_dims", &cols, 2, None);
        let c4shape = self.concat(n, "windows_shape", vec![nc, kd, spatial]);
        let cols4 = self.val(n, "windows", reshape(), vec![cols, c4shape.clone()]);
        match op.as_str() {
            "MaxPool" => {
                // 8- and 16-bit integers take their maximum as i32 (exact), which every
                // backend reduces; WebGPU has no 8/16-bit arithmetic beyond the binary maps.
                match self
                    .dtypes
                    .get(&x)
                    .copied()
                    .filter(|d| d.is_int() && d.size() < 4)
                {
                    Some(dt) => {
                        let wide = Op::Cast { to: DType::I32 };
                        let w = self.val(n, "windows_i32", wide, vec![cols4.clone()]);
                        let m = self.val(
                            n,
                            "max_i32",
                            reduce(ReduceKind::Max, vec![2], false),
                            vec![w],
                        );
                        self.out(n, 0, Op::Cast { to: dt }, vec![m]);
                    }
                    None => self.out(
                        n,
                        0,
                        reduce(ReduceKind::Max, vec![2], false),
                        vec![cols4.clone()],
                    ),
                }
                if output(n, 1).is_some() {
                    let idx = self.flat_indices(n, &x, r, storage_order == 1)?;
                    let icols = self.columns(
                        n,
                        "index_cols",
                        &idx,
                        &Some(kernel),
                        None,
                        &window,
                        -1.0,
                        -1.0,
                    );
                    let icols4 = self.val(n, "index_windows", reshape(), vec![icols, c4shape]);
                    let arg = Op::ArgReduce {
                        min: false,
                        axis: 2,
                        keepdims: true,
                        select_last_index: false,
                    };
                    let am = self.val(n, "argmax", arg, vec![cols4]);
                    let g = self.val(
                        n,
                        "picked",
                        Op::GatherElements { axis: 2 },
                        vec![icols4, am],
                    );
                    self.out(n, 1, squeeze(2), vec![g]);
                }
            }
            "AveragePool" => {
                let sum = self.val(
                    n,
                    "sum",
                    reduce(ReduceKind::Sum, vec![2], false),
                    vec![cols4],
                );
                // Every window counts K entries unless padding is left out or ceil_mode's
                // last windows reach past the padding.
                let count =
                    if include_pad && (!window.ceil_mode || window.auto_pad != AutoPad::NotSet) {
                        self.float_like(n, "count", k as f32, &x)
                    } else {
                        let one = self.float_like(n, "one", 1.0, &x);
                        let head = self.ints_const(n, "ones_head", &[1, 1])?;
                        let sp = self.dims_of(n, "in_dims", &x, 2, None);
                        let os = self.concat(n, "ones_shape", vec![head, sp]);
                        let ones = self.val(n, "ones", Op::Expand, vec![one, os]);
                        let pad = if include_pad { 1.0 } else { 0.0 };
                        let c = self.columns(
                            n,
                            "count_cols",
                            &ones,
                            &Some(kernel),
                            None,
                            &window,
                            pad,
                            0.0,
                        );
                        self.val(n, "count", reduce(ReduceKind::Sum, vec![1], true), vec![c])
                    };
                self.out(n, 0, bin(BinaryOp::Div), vec![sum, count]);
            }
            _ => {
                let pw = self.lp_power(n, &cols4, p)?;
                let sum = self.val(n, "sum", reduce(ReduceKind::Sum, vec![2], false), vec![pw]);
                self.lp_root(n, sum, p)?;
            }
        }
        Ok(())
    }

    /// |v|^p (v·v for p = 2).
    fn lp_power(&mut self, n: &NodeProto, v: &str, p: f32) -> Result<String> {
        if p <= 0.0 || !p.is_finite() {
            return Err(Error::Graph(format!(
                "node '{}' ({}): attribute 'p' must be positive, got {p}",
                n.name, n.op_type
            )));
        }
        Ok(if p == 2.0 {
            self.val(
                n,
                "squares",
                bin(BinaryOp::Mul),
                vec![v.to_string(), v.to_string()],
            )
        } else {
            let abs = self.val(n, "abs", un(UnaryOp::Abs), vec![v.to_string()]);
            let pv = self.float_like(n, "p", p, v);
            self.val(n, "powers", bin(BinaryOp::Pow), vec![abs, pv])
        })
    }

    /// The node's output: sum^(1/p) (sqrt for p = 2).
    fn lp_root(&mut self, n: &NodeProto, sum: String, p: f32) -> Result<()> {
        if p == 2.0 {
            self.out(n, 0, un(UnaryOp::Sqrt), vec![sum]);
        } else {
            // 1/p computed in the input's dtype (an f32 constant of 1/3 is off in f64).
            let one = self.float_like(n, "one", 1.0, &sum);
            let pv = self.float_like(n, "p_root", p, &sum);
            let inv = self.val(n, "inv_p", bin(BinaryOp::Div), vec![one, pv]);
            self.out(n, 0, bin(BinaryOp::Pow), vec![sum, inv]);
        }
        Ok(())
    }

    /// GlobalLpPool: (Σ |x|^p over the spatial axes)^(1/p), the axes kept.
    fn global_lp_pool(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let p = a.float("p", 2.0)?;
        a.finish()?;
        let (ins, _) = inputs(n, what, (1, 1), 1)?;
        let x = ins[0].clone();
        let pw = self.lp_power(n, &x, p)?;
        let axes = self.axes_from(n, &x, 2)?;
        let (op, ins) = super::composite::reduce_op(ReduceKind::Sum, &pw, &axes, true);
        let sum = self.val(n, "sum", op, ins);
        self.lp_root(n, sum, p)
    }

    /// Each element's flat index into `x` (i64, x's shape): MaxPool's Indices read them
    /// through the same windows. With `column_major` the spatial axes count in reverse
    /// order (storage_order = 1).
    fn flat_indices(
        &mut self,
        n: &NodeProto,
        x: &str,
        r: usize,
        column_major: bool,
    ) -> Result<String> {
        let full = self.dims_of(n, "x_shape", x, 0, None);
        let size = self.val(
            n,
            "size",
            Op::Reduce {
                kind: ReduceKind::Prod,
                axes: Some(vec![0]),
                keepdims: false,
                noop_with_empty_axes: false,
            },
            vec![full.clone()],
        );
        let start = self.constant(n, "iota_start", Tensor::scalar(0i64));
        let step = self.constant(n, "iota_step", Tensor::scalar(1i64));
        let iota = self.val(n, "iota", Op::Range, vec![start, size, step]);
        if !column_major {
            return Ok(self.val(n, "flat_index", reshape(), vec![iota, full]));
        }
        let mut parts = vec![self.dims_of(n, "x_nc", x, 0, Some(2))];
        for d in (0..r as i64).rev() {
            parts.push(self.dims_of(n, &format!("x_dim{d}"), x, 2 + d, Some(3 + d)));
        }
        let rev = self.concat(n, "x_shape_rev", parts);
        let t = self.val(n, "flat_index_rev", reshape(), vec![iota, rev]);
        let perm: Vec<usize> = [0, 1].into_iter().chain((2..2 + r).rev()).collect();
        Ok(self.val(n, "flat_index", Op::Transpose { perm: Some(perm) }, vec![t]))
    }
}
