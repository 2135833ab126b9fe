//! DFT and STFT, written as products by their transform matrices: the transformed axis is
//! moved last and multiplied by cos and sin of 2π·((k·n) mod N)/N (the product taken mod
//! N in integers, so the angle keeps float precision for long transforms). The matrices
//! are built from `Range`s of values the plan knows (the signal's length, dft_length,
//! frame_step and frame_length, which may be fed), so every backend runs them and the
//! gradients are the transposed products.

use super::composite::{bin, inputs, reshape, shape, squeeze, un, unsqueeze, Attrs};
use super::Importer;
use crate::error::{Error, Result};
use crate::graph::{BinaryOp, Op, UnaryOp};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};

/// Which transform of the last axis.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// Forward; with `onesided`, bins 0..=N/2 only.
    Forward { onesided: bool },
    /// Inverse of a full spectrum (divided by N).
    Inverse,
    /// Inverse of a one-sided spectrum of a real signal (numpy's irfft): real output.
    InverseReal,
}

impl Importer<'_> {
    /// The i64 scalar value of `v` (a fed one is read when the plan is made).
    fn scalar_i64(&mut self, n: &NodeProto, what: &str, v: &str) -> String {
        let c = self.val(
            n,
            &format!("{what}_i64"),
            Op::Cast { to: DType::I64 },
            vec![v.to_string()],
        );
        let flat = self.constant(
            n,
            &format!("{what}_shape"),
            Tensor::from_vec(&[0], Vec::<i64>::new()).expect("empty shape"),
        );
        self.val(n, what, reshape(), vec![c, flat])
    }

    pub(super) fn dft(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let inverse = a.flag("inverse")?;
        let onesided = a.flag("onesided")?;
        let axis_attr = if self.opset < 20 {
            Some(a.int("axis", 1)?)
        } else {
            None
        };
        a.finish()?;
        let (req, opt) = inputs(n, what, (1, 3), 1)?;
        let x = req[0].clone();
        let Some(&r) = self.ranks.get(&x) else {
            return Err(Error::Graph(format!(
                "{what}: the rank of input is unknown: declare it (a value_info or input type)"
            )));
        };
        if r < 2 {
            return Err(Error::Graph(format!(
                "{what}: the input must have a signal axis and a last axis of 1 or 2 values, got rank {r}"
            )));
        }
        let complex = self.complex_width(what, &x, r)?;
        let kind = match (inverse, onesided) {
            (false, o) => Kind::Forward { onesided: o },
            (true, false) => Kind::Inverse,
            (true, true) => Kind::InverseReal,
        };
        // The axis as an i64 [1] in 0..rank: it may be fed (read when the plan is made),
        // as only reshapes depend on it.
        let axis = match (axis_attr, opt.get(1).cloned().flatten()) {
            (Some(v), _) => self.ints_const(n, "axis", &[v])?,
            (None, Some(v)) => {
                let v = self.scalar_i64(n, "axis_value", &v);
                self.val(n, "axis", unsqueeze(0), vec![v])
            }
            (None, None) => self.ints_const(n, "axis", &[-2])?,
        };
        let rank = self.ints_const(n, "rank", &[r as i64])?;
        let axis = self.val(n, "axis_pos", bin(BinaryOp::Mod), vec![axis, rank]);
        let (xr, xi) = self.split_complex(n, &x, complex);
        // [before..., L, after...] as [P, Q, L]: the signal axis last, whichever it is.
        let dims = self.val(n, "dims", shape(0, None), vec![xr.clone()]);
        let zero1 = self.ints_const(n, "zero_1d", &[0])?;
        let one1 = self.ints_const(n, "one_1d", &[1])?;
        let end1 = self.ints_const(n, "end_1d", &[i64::MAX])?;
        let next = self.val(
            n,
            "axis_next",
            bin(BinaryOp::Add),
            vec![axis.clone(), one1.clone()],
        );
        let before = self.val(
            n,
            "dims_before",
            Op::Slice,
            vec![dims.clone(), zero1, axis.clone()],
        );
        let len1 = self.val(
            n,
            "signal_len",
            Op::Slice,
            vec![dims.clone(), axis, next.clone()],
        );
        let after = self.val(n, "dims_after", Op::Slice, vec![dims, next, end1]);
        let after1 = self.val(
            n,
            "dims_after_1",
            Op::Concat { axis: 0 },
            vec![after.clone(), one1],
        );
        let q = self.val(
            n,
            "inner",
            Op::Reduce {
                kind: crate::graph::op::ReduceKind::Prod,
                axes: None,
                keepdims: true,
                noop_with_empty_axes: false,
            },
            vec![after1],
        );
        let minus1 = self.ints_const(n, "outer", &[-1])?;
        let plq = self.val(
            n,
            "plq",
            Op::Concat { axis: 0 },
            vec![minus1, len1.clone(), q],
        );
        let swap = Op::Transpose {
            perm: Some(vec![0usize, 2, 1]),
        };
        let moved = |me: &mut Self, v: String, tag: &str| -> String {
            let v = me.val(n, &format!("{tag}_3d"), reshape(), vec![v, plq.clone()]);
            me.val(n, &format!("{tag}_moved"), swap.clone(), vec![v])
        };
        let xr = moved(self, xr, "re");
        let xi = xi.map(|v| moved(self, v, "im"));
        let len = self.val(n, "signal_len_scalar", squeeze(0), vec![len1]);
        let size = match opt.first().cloned().flatten() {
            Some(v) => self.scalar_i64(n, "dft_length", &v),
            None if kind == Kind::InverseReal => {
                let one = self.constant(n, "one", Tensor::scalar(1i64));
                let two = self.constant(n, "two", Tensor::scalar(2i64));
                let m = self.val(n, "len_m1", bin(BinaryOp::Sub), vec![len.clone(), one]);
                self.val(n, "dft_length", bin(BinaryOp::Mul), vec![m, two])
            }
            None => len.clone(),
        };
        let (re, im) = self.dft_last(n, &xr, xi.as_deref(), &len, &size, kind, &x)?;
        // Back: [P, Q, K] to [before..., K, after...].
        let k = self.val(n, "bins_len", shape(2, Some(3)), vec![re.clone()]);
        let out_dims = self.val(
            n,
            "out_dims",
            Op::Concat { axis: 0 },
            vec![before, k, after],
        );
        let back = |me: &mut Self, v: String, tag: &str| -> String {
            let v = me.val(n, &format!("{tag}_back"), swap.clone(), vec![v]);
            me.val(
                n,
                &format!("{tag}_placed"),
                reshape(),
                vec![v, out_dims.clone()],
            )
        };
        let re = back(self, re, "y_re");
        let im = im.map(|v| back(self, v, "y_im"));
        let y = self.stack_complex(n, re, im);
        self.out(n, 0, Op::Identity, vec![y]);
        Ok(())
    }

    /// STFT (signal [B, L, 1|2], frame_step, window?, frame_length?) -> [B, frames, bins,
    /// 2]: frames of frame_length samples every frame_step, each multiplied by the window
    /// and transformed (bins 0..=frame_length/2 with onesided, the default).
    pub(super) fn stft(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let onesided = a.flag_or("onesided", true)?;
        a.finish()?;
        let (req, opt) = inputs(n, what, (2, 4), 1)?;
        let (x, step) = (req[0].clone(), req[1].clone());
        let (window, flen) = (opt[0].clone(), opt[1].clone());
        if self.ranks.get(&x).is_some_and(|&r| r != 3) {
            return Err(Error::Graph(format!(
                "{what}: signal must be [batch, length, 1 or 2]"
            )));
        }
        let complex = self.complex_width(what, &x, 3)?;
        let step = self.scalar_i64(n, "frame_step", &step);
        let fl = match (&flen, &window) {
            (Some(v), _) => self.scalar_i64(n, "frame_length", v),
            (None, Some(w)) => {
                let s = self.val(n, "window_len", shape(0, Some(1)), vec![w.clone()]);
                self.val(n, "frame_length", squeeze(0), vec![s])
            }
            (None, None) => {
                return Err(Error::Graph(format!(
                    "{what}: give frame_length or a window (its length is the frame's)"
                )))
            }
        };
        let len = self.val(n, "signal_len", shape(1, Some(2)), vec![x.clone()]);
        let len = self.val(n, "signal_len_scalar", squeeze(0), vec![len]);
        let zero = self.constant(n, "zero", Tensor::scalar(0i64));
        let one = self.constant(n, "one", Tensor::scalar(1i64));
        let span = self.val(n, "span", bin(BinaryOp::Sub), vec![len, fl.clone()]);
        let frames = self.val(n, "frames_m1", bin(BinaryOp::Div), vec![span, step.clone()]);
        let frames = self.val(n, "frames", bin(BinaryOp::Add), vec![frames, one.clone()]);
        let starts = self.val(
            n,
            "frame_index",
            Op::Range,
            vec![zero.clone(), frames, one.clone()],
        );
        let starts = self.val(n, "frame_starts", bin(BinaryOp::Mul), vec![starts, step]);
        let starts = self.val(n, "frame_starts_col", unsqueeze(-1), vec![starts]);
        let offs = self.val(n, "frame_offsets", Op::Range, vec![zero, fl.clone(), one]);
        let offs = self.val(n, "frame_offsets_row", unsqueeze(0), vec![offs]);
        let idx = self.val(n, "sample_index", bin(BinaryOp::Add), vec![starts, offs]);
        let (xr, xi) = self.split_complex(n, &x, complex);
        let frame = |me: &mut Self, v: String, tag: &str| -> String {
            let f = me.val(
                n,
                &format!("{tag}_frames"),
                Op::Gather { axis: 1 },
                vec![v, idx.clone()],
            );
            match &window {
                Some(w) => {
                    let w = me.val(
                        n,
                        &format!("{tag}_window"),
                        Op::CastLike,
                        vec![w.clone(), f.clone()],
                    );
                    me.val(
                        n,
                        &format!("{tag}_windowed"),
                        bin(BinaryOp::Mul),
                        vec![f, w],
                    )
                }
                None => f,
            }
        };
        let fr = frame(self, xr, "re");
        let fi = xi.map(|v| frame(self, v, "im"));
        let (re, im) = self.dft_last(
            n,
            &fr,
            fi.as_deref(),
            &fl,
            &fl,
            Kind::Forward { onesided },
            &x,
        )?;
        let y = self.stack_complex(n, re, im);
        self.out(n, 0, Op::Identity, vec![y]);
        Ok(())
    }

    /// The input's last dim: 1 (real) or 2 (real and imaginary parts).
    fn complex_width(&self, what: &str, x: &str, r: usize) -> Result<usize> {
        match self.dims.get(x).and_then(|d| d.get(r - 1).copied().flatten()) {
            Some(w @ (1 | 2)) => Ok(w),
            Some(w) => Err(Error::Graph(format!(
                "{what}: the input's last axis holds 1 (real) or 2 (real, imaginary) values, got {w}"
            ))),
            None => Err(Error::Graph(format!(
                "{what}: the input's last dim (1 for real, 2 for complex) is unknown: declare it"
            ))),
        }
    }

    /// The real part (and the imaginary one for a complex input), the last axis dropped.
    fn split_complex(
        &mut self,
        n: &NodeProto,
        x: &str,
        complex: usize,
    ) -> (String, Option<String>) {
        let part = |me: &mut Self, k: i64, tag: &str| -> String {
            let i = me.constant(n, &format!("{tag}_at"), Tensor::scalar(k));
            me.val(n, tag, Op::Gather { axis: -1 }, vec![x.to_string(), i])
        };
        let re = part(self, 0, "re");
        let im = (complex == 2).then(|| part(self, 1, "im"));
        (re, im)
    }

    /// [..., K] real and imaginary parts as [..., K, 2] (or [..., K, 1] for a real result).
    fn stack_complex(&mut self, n: &NodeProto, re: String, im: Option<String>) -> String {
        let re = self.val(n, "re_out", unsqueeze(-1), vec![re]);
        match im {
            None => re,
            Some(im) => {
                let im = self.val(n, "im_out", unsqueeze(-1), vec![im]);
                self.val(n, "complex_out", Op::Concat { axis: -1 }, vec![re, im])
            }
        }
    }

    /// The transform of the last axis of xr (+ i·xi) of length `len` (i64 scalar) at
    /// transform size `size`: the input truncated (or implicitly zero-padded) to the
    /// positions the transform reads, times the cos and sin matrices. Returns the real
    /// and (except for `InverseReal`) imaginary parts.
    #[allow(clippy::too_many_arguments)]
    fn dft_last(
        &mut self,
        n: &NodeProto,
        xr: &str,
        xi: Option<&str>,
        len: &str,
        size: &str,
        kind: Kind,
        like: &str,
    ) -> Result<(String, Option<String>)> {
        let zero = self.constant(n, "m_zero", Tensor::scalar(0i64));
        let one = self.constant(n, "m_one", Tensor::scalar(1i64));
        let two = self.constant(n, "m_two", Tensor::scalar(2i64));
        let half = self.val(
            n,
            "half_size",
            bin(BinaryOp::Div),
            vec![size.to_string(), two.clone()],
        );
        let half1 = self.val(
            n,
            "half_size_p1",
            bin(BinaryOp::Add),
            vec![half, one.clone()],
        );
        // Positions read and bins written.
        let reads = match kind {
            Kind::InverseReal => half1.clone(),
            _ => size.to_string(),
        };
        let used = self.val(n, "used", bin(BinaryOp::Min), vec![len.to_string(), reads]);
        let out = match kind {
            Kind::Forward { onesided: true } => half1,
            _ => size.to_string(),
        };
        let pos = self.val(
            n,
            "positions",
            Op::Range,
            vec![zero.clone(), used.clone(), one.clone()],
        );
        let bins = self.val(n, "bins", Op::Range, vec![zero.clone(), out, one.clone()]);
        let pc = self.val(n, "positions_col", unsqueeze(-1), vec![pos.clone()]);
        let br = self.val(n, "bins_row", unsqueeze(0), vec![bins]);
        let kn = self.val(n, "kn", bin(BinaryOp::Mul), vec![pc, br]);
        let kn = self.val(n, "kn_mod", bin(BinaryOp::Mod), vec![kn, size.to_string()]);
        let kn = self.val(n, "kn_f", Op::CastLike, vec![kn, like.to_string()]);
        let nf = self.val(
            n,
            "size_f",
            Op::CastLike,
            vec![size.to_string(), like.to_string()],
        );
        // 2π in f64, cast like the input (an f32 constant would cost f64 inputs precision).
        let tau = self.constant(n, "tau", Tensor::scalar(std::f64::consts::TAU));
        let tau = self.val(n, "tau_like", Op::CastLike, vec![tau, like.to_string()]);
        let tau = self.val(n, "tau_n", bin(BinaryOp::Div), vec![tau, nf.clone()]);
        let angle = self.val(n, "angle", bin(BinaryOp::Mul), vec![kn, tau]);
        let mut c = self.val(n, "cos", un(UnaryOp::Cos), vec![angle.clone()]);
        let mut s = self.val(n, "sin", un(UnaryOp::Sin), vec![angle]);
        if kind == Kind::InverseReal {
            // Each bin stands for itself and its mirror, except bin 0 and bin N/2.
            let two_f = self.float_like(n, "w_two", 2.0, like);
            let z = self.val(n, "is_dc", bin(BinaryOp::Equal), vec![pos.clone(), zero]);
            let b2 = self.val(n, "bins2", bin(BinaryOp::Mul), vec![pos, two]);
            let ny = self.val(
                n,
                "is_nyquist",
                bin(BinaryOp::Equal),
                vec![b2, size.to_string()],
            );
            let single = self.val(n, "single", bin(BinaryOp::Or), vec![z, ny]);
            let single = self.val(n, "single_f", Op::CastLike, vec![single, like.to_string()]);
            let w = self.val(n, "weight", bin(BinaryOp::Sub), vec![two_f, single]);
            // The weights belong to the rows (the bins read); the matrix is [read, out].
            let w = self.val(n, "weight_col", unsqueeze(-1), vec![w]);
            c = self.val(n, "cos_w", bin(BinaryOp::Mul), vec![c, w.clone()]);
            s = self.val(n, "sin_w", bin(BinaryOp::Mul), vec![s, w]);
        }
        // Only the positions the transform reads.
        let end = self.val(n, "used_1d", unsqueeze(0), vec![used]);
        let start = self.ints_const(n, "start", &[0])?;
        let axes = self.ints_const(n, "last_axis", &[-1])?;
        let cut = |me: &mut Self, v: &str, s: &str| {
            me.val(
                n,
                s,
                Op::Slice,
                vec![v.to_string(), start.clone(), end.clone(), axes.clone()],
            )
        };
        let xr = cut(self, xr, "re_used");
        let xi = xi.map(|v| cut(self, v, "im_used"));
        let mm = |me: &mut Self, a: &str, m: &str, s: &str| {
            me.val(n, s, Op::MatMul, vec![a.to_string(), m.to_string()])
        };
        let rc = mm(self, &xr, &c, "re_cos");
        let rs = mm(self, &xr, &s, "re_sin");
        let (ic, is) = match &xi {
            Some(v) => (
                Some(mm(self, v, &c, "im_cos")),
                Some(mm(self, v, &s, "im_sin")),
            ),
            None => (None, None),
        };
        let add = |me: &mut Self, a: String, b: Option<String>, op: BinaryOp, s: &str| match b {
            Some(b) => me.val(n, s, bin(op), vec![a, b]),
            None => a,
        };
        let neg = |me: &mut Self, v: String, s: &str| me.val(n, s, un(UnaryOp::Neg), vec![v]);
        let (re, im) = match kind {
            // e^{-iθ}: re = xr·cos + xi·sin, im = xi·cos - xr·sin.
            Kind::Forward { .. } => {
                let re = add(self, rc, is, BinaryOp::Add, "y_re");
                let im = match ic {
                    Some(ic) => self.val(n, "y_im", bin(BinaryOp::Sub), vec![ic, rs]),
                    None => neg(self, rs, "y_im"),
                };
                (re, Some(im))
            }
            // e^{+iθ}/N: re = xr·cos - xi·sin, im = xr·sin + xi·cos.
            Kind::Inverse | Kind::InverseReal => {
                let re = add(self, rc, is, BinaryOp::Sub, "y_re_sum");
                let re = self.val(n, "y_re", bin(BinaryOp::Div), vec![re, nf.clone()]);
                let im = (kind == Kind::Inverse).then(|| {
                    let im = add(self, rs, ic, BinaryOp::Add, "y_im_sum");
                    self.val(n, "y_im", bin(BinaryOp::Div), vec![im, nf.clone()])
                });
                (re, im)
            }
        };
        Ok((re, im))
    }
}

impl Importer<'_> {
    /// MelWeightMatrix: the `[dft_length/2 + 1, num_mel_bins]` triangular filters that map
    /// a one-sided spectrum to mel bins, as ONNX's reference computes them in float64: the
    /// num_mel_bins + 2 band edges evenly spaced in mel (2595·log10(1 + f/700)) between
    /// the two edge frequencies, each turned back to hertz and to a whole spectrum bin
    /// ⌊(dft_length + 1)·f / sample_rate⌋; filter i rises from edge i to edge i+1 and
    /// falls to edge i+2 (a filter whose rising edge is empty is 1 at its centre). Cast to
    /// output_datatype. Its two lengths decide the shape, so they are read when the plan
    /// is made.
    pub(super) fn mel_weight_matrix(
        &mut self,
        n: &NodeProto,
        what: &str,
        mut a: Attrs,
    ) -> Result<()> {
        let to = a.output_datatype()?;
        a.finish()?;
        let (ins, _) = inputs(n, what, (5, 5), 1)?;
        let mels = self.scalar_i64(n, "mels", &ins[0]);
        let dft = self.scalar_i64(n, "dft", &ins[1]);
        let f64_of = |me: &mut Self, tag: &str, v: &str| {
            me.val(n, tag, Op::Cast { to: DType::F64 }, vec![v.to_string()])
        };
        let c = |me: &mut Self, tag: &str, v: f64| me.constant(n, tag, Tensor::scalar(v));
        let ci = |me: &mut Self, tag: &str, v: i64| me.constant(n, tag, Tensor::scalar(v));
        let b = |me: &mut Self, tag: &str, op: BinaryOp, l: &str, r: &str| {
            me.val(n, tag, bin(op), vec![l.to_string(), r.to_string()])
        };
        let rate = f64_of(self, "rate", &ins[2]);
        let lo = f64_of(self, "lower_hz", &ins[3]);
        let hi = f64_of(self, "upper_hz", &ins[4]);
        // Hertz to mel: 2595·log10(1 + f/700).
        let c700 = c(self, "c700", 700.0);
        let c2595 = c(self, "c2595", 2595.0);
        let one = c(self, "one", 1.0);
        let ln10 = c(self, "ln10", std::f64::consts::LN_10);
        let mel = |me: &mut Self, tag: &str, f: &str| {
            let r = b(me, &format!("{tag}_r"), BinaryOp::Div, f, &c700);
            let r = b(me, &format!("{tag}_r1"), BinaryOp::Add, &r, &one);
            let l = me.val(n, &format!("{tag}_ln"), un(UnaryOp::Log), vec![r]);
            let l = b(me, &format!("{tag}_log10"), BinaryOp::Div, &l, &ln10);
            b(me, tag, BinaryOp::Mul, &l, &c2595)
        };
        let lo_mel = mel(self, "lower_mel", &lo);
        let hi_mel = mel(self, "upper_mel", &hi);
        // num_mel_bins + 2 edges, evenly spaced by (hi - lo)/(num_mel_bins + 2).
        let two = ci(self, "two", 2);
        let edges = b(self, "edges", BinaryOp::Add, &mels, &two);
        let zero_i = ci(self, "zero_i", 0);
        let one_i = ci(self, "one_i", 1);
        let k = self.val(
            n,
            "k",
            Op::Range,
            vec![zero_i.clone(), edges.clone(), one_i.clone()],
        );
        let k = f64_of(self, "k_f", &k);
        let count = f64_of(self, "edges_f", &edges);
        let span = b(self, "mel_span", BinaryOp::Sub, &hi_mel, &lo_mel);
        let step = b(self, "mel_step", BinaryOp::Div, &span, &count);
        let m = b(self, "edge_mel", BinaryOp::Mul, &k, &step);
        let m = b(self, "edge_mel_lo", BinaryOp::Add, &m, &lo_mel);
        // Mel to hertz: 700·(10^(m/2595) - 1).
        let ten = c(self, "ten", 10.0);
        let e = b(self, "edge_exp", BinaryOp::Div, &m, &c2595);
        let e = b(self, "edge_pow", BinaryOp::Pow, &ten, &e);
        let e = b(self, "edge_pow1", BinaryOp::Sub, &e, &one);
        let hz = b(self, "edge_hz", BinaryOp::Mul, &e, &c700);
        // To a spectrum bin: ⌊(dft_length + 1)·f / sample_rate⌋.
        let dft1 = b(self, "dft1", BinaryOp::Add, &dft, &one_i);
        let dft1 = f64_of(self, "dft1_f", &dft1);
        let bin_f = b(self, "edge_scaled", BinaryOp::Mul, &dft1, &hz);
        let bin_f = b(self, "edge_bin_f", BinaryOp::Div, &bin_f, &rate);
        let bin_f = self.val(n, "edge_bin", un(UnaryOp::Floor), vec![bin_f]);
        // Edges i, i+1, i+2 of filter i, each [1, num_mel_bins]; j, the bin, [nspec, 1].
        let axis = self.ints_const(n, "edge_axis", &[0])?;
        let edge = |me: &mut Self, tag: &str, from: i64| -> Result<String> {
            let s = me.ints_const(n, &format!("{tag}_start"), &[from])?;
            let f = me.constant(n, &format!("{tag}_from"), Tensor::scalar(from));
            let end = b(me, &format!("{tag}_end0"), BinaryOp::Add, &mels, &f);
            let end = me.val(n, &format!("{tag}_end"), unsqueeze(0), vec![end]);
            let v = me.val(n, tag, Op::Slice, vec![bin_f.clone(), s, end, axis.clone()]);
            Ok(me.val(n, &format!("{tag}_row"), unsqueeze(0), vec![v]))
        };
        let l = edge(self, "left", 0)?;
        let ctr = edge(self, "centre", 1)?;
        let r = edge(self, "right", 2)?;
        let half = b(self, "half", BinaryOp::Div, &dft, &two);
        let nspec = b(self, "nspec", BinaryOp::Add, &half, &one_i);
        let j = self.val(n, "j", Op::Range, vec![zero_i, nspec, one_i]);
        let j = f64_of(self, "j_f", &j);
        let j = self.val(n, "j_col", unsqueeze(1), vec![j]);
        let zero = c(self, "zero", 0.0);
        // Rising: (j - l)/(c - l) for l <= j <= c where c > l; else 1 at j = c.
        let up = b(self, "up_span", BinaryOp::Sub, &ctr, &l);
        let up_some = b(self, "up_some", BinaryOp::Greater, &up, &zero);
        let jl = b(self, "j_minus_l", BinaryOp::Sub, &j, &l);
        let rise = b(self, "rise", BinaryOp::Div, &jl, &up);
        let ge_l = b(self, "j_ge_l", BinaryOp::GreaterOrEqual, &j, &l);
        let le_c = b(self, "j_le_c", BinaryOp::LessOrEqual, &j, &ctr);
        let in_up = b(self, "in_rise", BinaryOp::And, &ge_l, &le_c);
        let rise = self.val(n, "rise_in", Op::Where, vec![in_up, rise, zero.clone()]);
        let at_c = b(self, "j_at_c", BinaryOp::Equal, &j, &ctr);
        let spike = self.val(n, "spike", Op::Where, vec![at_c, one.clone(), zero.clone()]);
        let rising = self.val(n, "rising", Op::Where, vec![up_some, rise, spike]);
        // Falling: (r - j)/(r - c) for c <= j < r where r > c, written over the rising.
        let down = b(self, "down_span", BinaryOp::Sub, &r, &ctr);
        let down_some = b(self, "down_some", BinaryOp::Greater, &down, &zero);
        let rj = b(self, "r_minus_j", BinaryOp::Sub, &r, &j);
        let fall = b(self, "fall", BinaryOp::Div, &rj, &down);
        let ge_c = b(self, "j_ge_c", BinaryOp::GreaterOrEqual, &j, &ctr);
        let lt_r = b(self, "j_lt_r", BinaryOp::Less, &j, &r);
        let in_down = b(self, "in_fall", BinaryOp::And, &ge_c, &lt_r);
        let in_down = b(self, "falls", BinaryOp::And, &in_down, &down_some);
        let w = self.val(n, "weights", Op::Where, vec![in_down, fall, rising]);
        self.out(n, 0, Op::Cast { to }, vec![w]);
        Ok(())
    }
}
