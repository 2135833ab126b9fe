//! GridSample and AffineGrid, written as compositions of graphrun's ops (as ONNX's
//! reference computes them, which follows PyTorch's `grid_sample` and `affine_grid`), so
//! every backend runs them and autodiff differentiates them: with respect to X through
//! GatherElements, with respect to the grid through the interpolation weights, and with
//! respect to theta through AffineGrid's MatMul.
//!
//! GridSample: each spatial axis's coordinate is unnormalised from the grid, moved inside
//! the image by the padding mode, and split into taps (1 for nearest, 2 for linear, 4 for
//! cubic) with their weights; every combination of one tap per axis is one GatherElements
//! of the flattened image at the taps' flat index, weighted by the product of the taps'
//! weights (and, for zeros padding, by whether every tap is inside the image).

use super::composite::{bin, inputs, reshape, shape, un, Attrs};
use super::Importer;
use crate::error::{Error, Result};
use crate::graph::{BinaryOp, Op, UnaryOp};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};

/// GridSample's gathers at most this many taps per output element (cubic in 3-D).
const MAX_TAPS: usize = 64;

#[derive(Clone, Copy, PartialEq)]
enum Interp {
    Nearest,
    Linear,
    Cubic,
}

#[derive(Clone, Copy, PartialEq)]
enum Padding {
    Zeros,
    Border,
    Reflection,
}

/// One spatial axis's tap: its flat-index term (`index · stride`, i64) and its weight
/// (X's dtype; `None` for 1).
struct Tap {
    offset: String,
    weight: Option<String>,
}

impl Importer<'_> {
    pub(super) fn grid_sample(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let mode = a.string("mode", "linear")?;
        let interp = match mode.as_str() {
            "nearest" => Interp::Nearest,
            "linear" | "bilinear" => Interp::Linear,
            "cubic" | "bicubic" => Interp::Cubic,
            m => {
                return Err(a.refuse(
                    "mode",
                    &format!("must be linear, nearest or cubic (bilinear or bicubic before opset 20), got '{m}'"),
                ))
            }
        };
        let padding = a.string("padding_mode", "zeros")?;
        let padding = match padding.as_str() {
            "zeros" => Padding::Zeros,
            "border" => Padding::Border,
            "reflection" => Padding::Reflection,
            m => {
                return Err(a.refuse(
                    "padding_mode",
                    &format!("must be zeros, border or reflection, got '{m}'"),
                ))
            }
        };
        let align = a.flag("align_corners")?;
        a.finish()?;
        let (req, _) = inputs(n, what, (2, 2), 1)?;
        let x = req[0].clone();
        let r = self
            .ranks
            .get(&x)
            .copied()
            .or_else(|| self.ranks.get(&req[1]).copied())
            .ok_or_else(|| {
                Error::Graph(format!(
                    "{what}: the rank of X is unknown: declare it (a value_info or input type)"
                ))
            })?;
        if r < 3 {
            return Err(Error::Graph(format!(
                "{what}: X must be [N, C, spatial...] with at least one spatial axis, got rank {r}"
            )));
        }
        let r = r - 2;
        let per_axis = match interp {
            Interp::Nearest => 1usize,
            Interp::Linear => 2,
            Interp::Cubic => 4,
        };
        if per_axis.checked_pow(r as u32).is_none_or(|t| t > MAX_TAPS) {
            return Err(Error::Graph(format!(
                "{what}: {mode} sampling of {r} spatial axes reads {per_axis}^{r} taps per output; graphrun writes at most {MAX_TAPS}"
            )));
        }
        let grid = self.val(n, "grid", Op::CastLike, vec![req[1].clone(), x.clone()]);
        let f = |me: &mut Self, what: &str, v: f32| me.float_like(n, what, v, &x);
        let one = f(self, "one", 1.0);
        let half = f(self, "half", 0.5);
        let zero = f(self, "zero", 0.0);
        // Per axis (in X's order; the grid's last axis lists them in reverse): the taps,
        // and the stride of the axis in the flattened image.
        let mut axes_taps: Vec<Vec<Tap>> = vec![];
        let mut stride: Option<String> = None;
        for i in (0..r).rev() {
            let tag = |s: &str| format!("axis{i}_{s}");
            let di = self.val(
                n,
                &tag("size"),
                shape(2 + i as i64, Some(3 + i as i64)),
                vec![x.clone()],
            );
            let d = self.val(n, &tag("size_f"), Op::CastLike, vec![di.clone(), x.clone()]);
            let k = self.constant(n, &tag("component"), Tensor::scalar((r - 1 - i) as i64));
            let g = self.val(
                n,
                &tag("grid"),
                Op::Gather { axis: -1 },
                vec![grid.clone(), k],
            );
            let b = |me: &mut Self, s: &str, op: BinaryOp, l: &str, r: &str| {
                me.val(n, &tag(s), bin(op), vec![l.to_string(), r.to_string()])
            };
            let d1 = b(self, "size_m1", BinaryOp::Sub, &d, &one);
            // Unnormalised: align_corners maps -1 and 1 to the first and last pixel
            // centres, otherwise to the image's outer edges.
            let g1 = b(self, "g_p1", BinaryOp::Add, &g, &one);
            let mut v = if align {
                let h = b(self, "g_half", BinaryOp::Mul, &g1, &half);
                b(self, "coord", BinaryOp::Mul, &h, &d1)
            } else {
                let s = b(self, "g_scaled", BinaryOp::Mul, &g1, &d);
                let s = b(self, "g_shift", BinaryOp::Sub, &s, &one);
                b(self, "coord", BinaryOp::Mul, &s, &half)
            };
            if interp == Interp::Nearest {
                v = self.val(n, &tag("rounded"), un(UnaryOp::Round), vec![v]);
            }
            let (lo, hi) = if align {
                (zero.clone(), d1.clone())
            } else {
                let nh = f(self, &tag("neg_half"), -0.5);
                (nh, b(self, "edge", BinaryOp::Sub, &d, &half))
            };
            let bounds = Bounds {
                lo: lo.clone(),
                hi: hi.clone(),
                last: d1.clone(),
                zero: zero.clone(),
                one: one.clone(),
                half: half.clone(),
            };
            v = match padding {
                Padding::Zeros => v,
                Padding::Border => {
                    let out = self.outside(n, &tag("c"), &v, &bounds);
                    let c = self.clamp(n, &tag("c"), &v, &bounds);
                    self.val(n, &tag("coord_in"), Op::Where, vec![out, c, v])
                }
                Padding::Reflection => self.reflect(n, &tag("c"), &v, &bounds),
            };
            // The taps and their weights.
            let mut taps: Vec<(String, Option<String>)> = vec![];
            match interp {
                Interp::Nearest => taps.push((v, None)),
                Interp::Linear | Interp::Cubic => {
                    let x0 = self.val(n, &tag("floor"), un(UnaryOp::Floor), vec![v.clone()]);
                    let t = b(self, "frac", BinaryOp::Sub, &v, &x0);
                    let at = |me: &mut Self, k: i32| -> String {
                        if k == 0 {
                            return x0.clone();
                        }
                        let c = me.float_like(n, &tag(&format!("tap{k}_off")), k as f32, &x);
                        b(me, &format!("tap{k}"), BinaryOp::Add, &x0, &c)
                    };
                    if interp == Interp::Linear {
                        let w0 = b(self, "w0", BinaryOp::Sub, &one, &t);
                        taps.push((at(self, 0), Some(w0)));
                        taps.push((at(self, 1), Some(t)));
                    } else {
                        let ws = self.cubic_weights(n, &tag("cubic"), &t);
                        for (k, w) in (-1..=2).zip(ws) {
                            taps.push((at(self, k), Some(w)));
                        }
                    }
                }
            }
            let mut out = vec![];
            for (j, (idx, w)) in taps.into_iter().enumerate() {
                let tt = |s: &str| tag(&format!("t{j}_{s}"));
                // The tap's pixel: zeros padding reads 0 outside (its weight masked),
                // border the nearest edge pixel, reflection the mirrored one.
                let (idx, w) = match padding {
                    Padding::Zeros => {
                        let ge = self.val(
                            n,
                            &tt("ge0"),
                            bin(BinaryOp::GreaterOrEqual),
                            vec![idx.clone(), zero.clone()],
                        );
                        let le = self.val(
                            n,
                            &tt("le_last"),
                            bin(BinaryOp::LessOrEqual),
                            vec![idx.clone(), d1.clone()],
                        );
                        let inside = self.val(n, &tt("inside"), bin(BinaryOp::And), vec![ge, le]);
                        let m = self.val(n, &tt("mask"), Op::CastLike, vec![inside, x.clone()]);
                        let w = match w {
                            Some(w) => self.val(n, &tt("w_masked"), bin(BinaryOp::Mul), vec![w, m]),
                            None => m,
                        };
                        (self.clamp(n, &tt("idx"), &idx, &bounds), Some(w))
                    }
                    Padding::Border => (self.clamp(n, &tt("idx"), &idx, &bounds), w),
                    Padding::Reflection => {
                        let rf = self.reflect(n, &tt("idx"), &idx, &bounds);
                        (self.clamp(n, &tt("idx_in"), &rf, &bounds), w)
                    }
                };
                let idx = self.val(n, &tt("index"), Op::Cast { to: DType::I64 }, vec![idx]);
                let offset = match &stride {
                    None => idx,
                    Some(s) => self.val(n, &tt("offset"), bin(BinaryOp::Mul), vec![idx, s.clone()]),
                };
                out.push(Tap { offset, weight: w });
            }
            axes_taps.push(out);
            stride = Some(match stride {
                None => di,
                Some(s) => self.val(n, &tag("stride"), bin(BinaryOp::Mul), vec![s, di]),
            });
        }
        // Every combination of one tap per axis.
        let flat_shape = self.ints_const(n, "flat_shape", &[0, 0, -1])?;
        let xf = self.val(n, "x_flat", reshape(), vec![x.clone(), flat_shape]);
        let col_shape = self.ints_const(n, "col_shape", &[0, 1, -1])?;
        let c = self.val(n, "channels", shape(1, Some(2)), vec![x.clone()]);
        let unit = self.ints_const(n, "unit", &[1])?;
        let spread = self.val(
            n,
            "spread",
            Op::Concat { axis: 0 },
            vec![unit.clone(), c, unit],
        );
        let mut combos: Vec<(String, Option<String>)> = vec![(String::new(), None)];
        for taps in &axes_taps {
            let mut next = vec![];
            for (off, w) in &combos {
                for t in taps {
                    let k = next.len();
                    let off = if off.is_empty() {
                        t.offset.clone()
                    } else {
                        self.val(
                            n,
                            &format!("combo{k}_index"),
                            bin(BinaryOp::Add),
                            vec![off.clone(), t.offset.clone()],
                        )
                    };
                    let w = match (w, &t.weight) {
                        (Some(a), Some(b)) => Some(self.val(
                            n,
                            &format!("combo{k}_weight"),
                            bin(BinaryOp::Mul),
                            vec![a.clone(), b.clone()],
                        )),
                        (a, b) => a.clone().or(b.clone()),
                    };
                    next.push((off, w));
                }
            }
            combos = next;
        }
        let mut acc: Option<String> = None;
        for (k, (off, w)) in combos.into_iter().enumerate() {
            let col = self.val(
                n,
                &format!("tap{k}_col"),
                reshape(),
                vec![off, col_shape.clone()],
            );
            let col = self.val(
                n,
                &format!("tap{k}_cols"),
                Op::Expand,
                vec![col, spread.clone()],
            );
            let mut v = self.val(
                n,
                &format!("tap{k}_value"),
                Op::GatherElements { axis: 2 },
                vec![xf.clone(), col],
            );
            if let Some(w) = w {
                let w = self.val(
                    n,
                    &format!("tap{k}_w"),
                    reshape(),
                    vec![w, col_shape.clone()],
                );
                v = self.val(
                    n,
                    &format!("tap{k}_weighted"),
                    bin(BinaryOp::Mul),
                    vec![v, w],
                );
            }
            acc = Some(match acc {
                None => v,
                Some(s) => self.val(n, &format!("sum{k}"), bin(BinaryOp::Add), vec![s, v]),
            });
        }
        let nc = self.val(n, "nc", shape(0, Some(2)), vec![x]);
        let spatial = self.val(n, "out_spatial", shape(1, Some(-1)), vec![req[1].clone()]);
        let y_shape = self.val(n, "y_shape", Op::Concat { axis: 0 }, vec![nc, spatial]);
        self.out(
            n,
            0,
            reshape(),
            vec![acc.expect("at least one tap"), y_shape],
        );
        Ok(())
    }

    /// Whether v lies outside [lo, hi].
    fn outside(&mut self, n: &NodeProto, what: &str, v: &str, b: &Bounds) -> String {
        let below = self.val(
            n,
            &format!("{what}_below"),
            bin(BinaryOp::Less),
            vec![v.to_string(), b.lo.clone()],
        );
        let above = self.val(
            n,
            &format!("{what}_above"),
            bin(BinaryOp::Greater),
            vec![v.to_string(), b.hi.clone()],
        );
        self.val(
            n,
            &format!("{what}_outside"),
            bin(BinaryOp::Or),
            vec![below, above],
        )
    }

    /// v clamped to the image's pixels [0, size - 1].
    fn clamp(&mut self, n: &NodeProto, what: &str, v: &str, b: &Bounds) -> String {
        let lo = self.val(
            n,
            &format!("{what}_max0"),
            bin(BinaryOp::Max),
            vec![v.to_string(), b.zero.clone()],
        );
        self.val(
            n,
            &format!("{what}_clamped"),
            bin(BinaryOp::Min),
            vec![lo, b.last.clone()],
        )
    }

    /// v reflected by the borders [lo, hi] until inside them (v itself when inside): the
    /// distance past the border, less whole periods of the range, measured from the
    /// border an even number of reflections lands on. A range of 0 (one pixel with
    /// align_corners) gives lo.
    fn reflect(&mut self, n: &NodeProto, what: &str, v: &str, b: &Bounds) -> String {
        let t = |s: &str| format!("{what}_{s}");
        let bn = |me: &mut Self, s: &str, op: BinaryOp, l: &str, r: &str| {
            me.val(n, &t(s), bin(op), vec![l.to_string(), r.to_string()])
        };
        let out = self.outside(n, what, v, b);
        let below = bn(self, "below_lo", BinaryOp::Less, v, &b.lo);
        let range = bn(self, "range", BinaryOp::Sub, &b.hi, &b.lo);
        let empty = bn(self, "empty", BinaryOp::LessOrEqual, &range, &b.zero);
        let period = self.val(
            n,
            &t("period"),
            Op::Where,
            vec![empty.clone(), b.one.clone(), range],
        );
        let d_lo = bn(self, "past_lo", BinaryOp::Sub, &b.lo, v);
        let d_hi = bn(self, "past_hi", BinaryOp::Sub, v, &b.hi);
        let dx = self.val(n, &t("past"), Op::Where, vec![below.clone(), d_lo, d_hi]);
        let q = bn(self, "periods_f", BinaryOp::Div, &dx, &period);
        let nf = self.val(n, &t("periods"), un(UnaryOp::Floor), vec![q]);
        let whole = bn(self, "whole", BinaryOp::Mul, &nf, &period);
        let rem = bn(self, "rem", BinaryOp::Sub, &dx, &whole);
        let h = bn(self, "half_periods", BinaryOp::Mul, &nf, &b.half);
        let hf = self.val(n, &t("half_floor"), un(UnaryOp::Floor), vec![h.clone()]);
        let parity = bn(self, "odd", BinaryOp::Greater, &h, &hf);
        // Below lo: an even count lands on lo + rem, odd on hi - rem; above hi, the reverse.
        let from_lo = bn(self, "from_lo", BinaryOp::Xor, &below, &parity);
        let up = bn(self, "lo_plus", BinaryOp::Add, &b.lo, &rem);
        let down = bn(self, "hi_minus", BinaryOp::Sub, &b.hi, &rem);
        let r = self.val(n, &t("mirrored"), Op::Where, vec![from_lo, up, down]);
        let r = self.val(
            n,
            &t("mirrored_any"),
            Op::Where,
            vec![empty, b.lo.clone(), r],
        );
        self.val(n, &t("reflected"), Op::Where, vec![out, r, v.to_string()])
    }

    /// Keys' cubic convolution weights (a = -0.75, as PyTorch's) of the taps at offsets
    /// -1, 0, 1 and 2 from floor(x), t = x - floor(x).
    fn cubic_weights(&mut self, n: &NodeProto, what: &str, t: &str) -> Vec<String> {
        const A: f32 = -0.75;
        let c = |me: &mut Self, s: &str, v: f32| me.float_like(n, &format!("{what}_{s}"), v, t);
        let bn = |me: &mut Self, s: &str, op: BinaryOp, l: &str, r: &str| {
            me.val(
                n,
                &format!("{what}_{s}"),
                bin(op),
                vec![l.to_string(), r.to_string()],
            )
        };
        let one = c(self, "one", 1.0);
        let two = c(self, "two", 2.0);
        // Outer taps (distance s in [1, 2]): ((a·s - 5a)·s + 8a)·s - 4a.
        let outer = |me: &mut Self, k: &str, s: &str| -> String {
            let a = c(me, &format!("{k}_a"), A);
            let a5 = c(me, &format!("{k}_5a"), 5.0 * A);
            let a8 = c(me, &format!("{k}_8a"), 8.0 * A);
            let a4 = c(me, &format!("{k}_4a"), 4.0 * A);
            let p = bn(me, &format!("{k}_p1"), BinaryOp::Mul, &a, s);
            let p = bn(me, &format!("{k}_p2"), BinaryOp::Sub, &p, &a5);
            let p = bn(me, &format!("{k}_p3"), BinaryOp::Mul, &p, s);
            let p = bn(me, &format!("{k}_p4"), BinaryOp::Add, &p, &a8);
            let p = bn(me, &format!("{k}_p5"), BinaryOp::Mul, &p, s);
            bn(me, &format!("{k}_w"), BinaryOp::Sub, &p, &a4)
        };
        // Inner taps (distance s in [0, 1]): ((a + 2)·s - (a + 3))·s² + 1.
        let inner = |me: &mut Self, k: &str, s: &str| -> String {
            let a2 = c(me, &format!("{k}_a2"), A + 2.0);
            let a3 = c(me, &format!("{k}_a3"), A + 3.0);
            let p = bn(me, &format!("{k}_p1"), BinaryOp::Mul, &a2, s);
            let p = bn(me, &format!("{k}_p2"), BinaryOp::Sub, &p, &a3);
            let p = bn(me, &format!("{k}_p3"), BinaryOp::Mul, &p, s);
            let p = bn(me, &format!("{k}_p4"), BinaryOp::Mul, &p, s);
            bn(me, &format!("{k}_w"), BinaryOp::Add, &p, &one)
        };
        let t1 = bn(self, "t_p1", BinaryOp::Add, t, &one);
        let u = bn(self, "one_m_t", BinaryOp::Sub, &one, t);
        let u2 = bn(self, "two_m_t", BinaryOp::Sub, &two, t);
        vec![
            outer(self, "w0", &t1),
            inner(self, "w1", t),
            inner(self, "w2", &u),
            outer(self, "w3", &u2),
        ]
    }

    /// AffineGrid (theta [N, 2, 3] with size [N, C, H, W], or theta [N, 3, 4] with size
    /// [N, C, D, H, W]) -> grid [N, H, W, 2] or [N, D, H, W, 3]: the base grid of
    /// normalised pixel positions (x along the last axis first, then y, z, and 1), each
    /// position multiplied by theta. The positions come from `Range` over size's values,
    /// which must be known when the plan is made (they decide the output's shape).
    pub(super) fn affine_grid(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let align = a.flag("align_corners")?;
        a.finish()?;
        let (req, _) = inputs(n, what, (2, 2), 1)?;
        let (theta, size) = (req[0].clone(), req[1].clone());
        let from_size = self
            .dims
            .get(&size)
            .and_then(|d| d.first().copied().flatten());
        let from_theta = self
            .dims
            .get(&theta)
            .and_then(|d| d.get(1).copied().flatten())
            .map(|k| k + 2);
        let r = match from_size.or(from_theta) {
            Some(k @ (4 | 5)) => k - 2,
            Some(k) => {
                return Err(Error::Graph(format!(
                    "{what}: size must hold 4 values (2-D) or 5 (3-D), got {k}"
                )))
            }
            None => {
                return Err(Error::Graph(format!(
                    "{what}: whether the grid is 2-D or 3-D is unknown: declare the shape of size or theta"
                )))
            }
        };
        let f = |me: &mut Self, what: &str, v: f32| me.float_like(n, what, v, &theta);
        let one = f(self, "one", 1.0);
        let two = f(self, "two", 2.0);
        let zero_i = self.constant(n, "zero_i", Tensor::scalar(0i64));
        let one_i = self.constant(n, "one_i", Tensor::scalar(1i64));
        let lens: Vec<String> = (0..r)
            .map(|i| {
                let k = self.constant(n, &format!("axis{i}_at"), Tensor::scalar(2 + i as i64));
                self.val(
                    n,
                    &format!("axis{i}_len"),
                    Op::Gather { axis: 0 },
                    vec![size.clone(), k],
                )
            })
            .collect();
        let dims_1d: Vec<String> = lens
            .iter()
            .enumerate()
            .map(|(i, l)| {
                self.val(
                    n,
                    &format!("axis{i}_len_1d"),
                    super::composite::unsqueeze(0),
                    vec![l.clone()],
                )
            })
            .collect();
        let full = self.val(n, "spatial", Op::Concat { axis: 0 }, dims_1d.clone());
        // Per axis: the positions -1 + (2i + 1)/L, or with align_corners -1 + 2i/(L - 1)
        // (-1 alone when L = 1), shaped to broadcast along their axis.
        let mut planes = vec![];
        for (i, l) in lens.iter().enumerate() {
            let tag = |s: &str| format!("axis{i}_{s}");
            let idx = self.val(
                n,
                &tag("range"),
                Op::Range,
                vec![zero_i.clone(), l.clone(), one_i.clone()],
            );
            let idx = self.val(n, &tag("range_f"), Op::CastLike, vec![idx, theta.clone()]);
            let lf = self.val(
                n,
                &tag("len_f"),
                Op::CastLike,
                vec![l.clone(), theta.clone()],
            );
            let bn = |me: &mut Self, s: &str, op: BinaryOp, a: &str, b: &str| {
                me.val(n, &tag(s), bin(op), vec![a.to_string(), b.to_string()])
            };
            let pos = if align {
                let lm1 = bn(self, "len_m1", BinaryOp::Sub, &lf, &one);
                let lm1 = bn(self, "len_m1_pos", BinaryOp::Max, &lm1, &one);
                let s = bn(self, "step", BinaryOp::Div, &two, &lm1);
                bn(self, "scaled", BinaryOp::Mul, &idx, &s)
            } else {
                let i2 = bn(self, "twice", BinaryOp::Mul, &idx, &two);
                let i2 = bn(self, "twice_p1", BinaryOp::Add, &i2, &one);
                bn(self, "scaled", BinaryOp::Div, &i2, &lf)
            };
            let pos = bn(self, "pos", BinaryOp::Sub, &pos, &one);
            let mut view = vec![1i64; r];
            view[i] = -1;
            let view = self.ints_const(n, &tag("view"), &view)?;
            let pos = self.val(n, &tag("pos_view"), reshape(), vec![pos, view]);
            let pos = self.val(n, &tag("plane"), Op::Expand, vec![pos, full.clone()]);
            planes.push(self.val(
                n,
                &tag("plane_1"),
                super::composite::unsqueeze(-1),
                vec![pos],
            ));
        }
        let ones = self.val(n, "ones", Op::Expand, vec![one.clone(), full.clone()]);
        let ones = self.val(n, "ones_1", super::composite::unsqueeze(-1), vec![ones]);
        // x (the last axis) first.
        let mut cols: Vec<String> = planes.into_iter().rev().collect();
        cols.push(ones);
        let base = self.val(n, "base", Op::Concat { axis: -1 }, cols);
        let rows = self.ints_const(n, "rows", &[-1, r as i64 + 1])?;
        let base = self.val(n, "base_rows", reshape(), vec![base, rows]);
        let tt = self.val(
            n,
            "theta_t",
            Op::Transpose {
                perm: Some(vec![0usize, 2, 1]),
            },
            vec![theta.clone()],
        );
        let g = self.val(n, "grid_rows", Op::MatMul, vec![base, tt]);
        let batch = self.val(n, "batch", shape(0, Some(1)), vec![theta]);
        let comps = self.ints_const(n, "components", &[r as i64])?;
        let mut out_shape = vec![batch];
        out_shape.extend(dims_1d);
        out_shape.push(comps);
        let out_shape = self.val(n, "grid_shape", Op::Concat { axis: 0 }, out_shape);
        self.out(n, 0, reshape(), vec![g, out_shape]);
        Ok(())
    }
}

/// The borders a coordinate is reflected or clamped by, and constants in X's dtype.
struct Bounds {
    lo: String,
    hi: String,
    /// size - 1, the last pixel.
    last: String,
    zero: String,
    one: String,
    half: String,
}
