//! RoiAlign as a composition: per region of interest, a grid of `sampling_ratio`² sample
//! places per output bin (constants of the geometry scaled by the region's corners), each
//! sample interpolated bilinearly from X's image of the region's batch entry as ONNX's
//! reference does (a place more than a pixel outside counts 0; one inside the last pixel
//! row or column clamps to it), then averaged or maxed per bin. Gradients reach X (through
//! GatherElements) and the regions (through the interpolation weights).
//!
//! An adaptive sampling ratio (0: the ceiling of each region's size over the output's)
//! gives each region a grid of its own size, decided by the region's values; it is
//! refused by name. Written after shape inference, when X's spatial size is known.

use super::composite::{bin, inputs, reduce_op, un, Attrs, Axes};
use super::Importer;
use crate::error::{Error, Result};
use crate::graph::op::{Attr, ReduceKind};
use crate::graph::{BinaryOp, Op, UnaryOp};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};

/// The operator written here.
pub(super) const ROI_ALIGN: &str = "RoiAlign";

/// One spatial axis of the samples: the interpolation's two indices (i64) and weights.
struct Axis {
    low: String,
    high: String,
    w_low: String,
    w_high: String,
    inside: String,
}

impl Importer<'_> {
    pub(super) fn roi_align(&mut self, n: &NodeProto, shown: &str, attrs: Vec<Attr>) -> Result<()> {
        let mut a = Attrs::of(n, shown, attrs)?;
        let what = &a.what.clone();
        let (req, _) = inputs(n, what, (3, 3), 1)?;
        let (x, rois, batch) = (req[0].clone(), req[1].clone(), req[2].clone());
        // Opset 16 brought half_pixel, and made it the default; before, the regions were
        // read as output_half_pixel reads them.
        let default_mode = if self.opset >= 16 {
            "half_pixel"
        } else {
            "output_half_pixel"
        };
        let half = match a
            .string("coordinate_transformation_mode", default_mode)?
            .as_str()
        {
            "half_pixel" => true,
            "output_half_pixel" => false,
            m => {
                return Err(a.refuse(
                    "coordinate_transformation_mode",
                    &format!("must be half_pixel or output_half_pixel, got '{m}'"),
                ))
            }
        };
        let max = match a.string("mode", "avg")?.as_str() {
            "avg" => false,
            "max" => true,
            m => return Err(a.refuse("mode", &format!("must be avg or max, got '{m}'"))),
        };
        let oh = a.int("output_height", 1)?;
        let ow = a.int("output_width", 1)?;
        let sr = a.int("sampling_ratio", 0)?;
        let scale = a.float("spatial_scale", 1.0)?;
        a.finish()?;
        if oh < 1 || ow < 1 || sr < 0 {
            return Err(Error::Graph(format!(
                "{what}: output_height and output_width must be positive and sampling_ratio non-negative, got {oh}, {ow}, {sr}"
            )));
        }
        if sr == 0 {
            return Err(Error::Graph(format!(
                "{what}: sampling_ratio 0 (adaptive) gives each region a sampling grid of its own size, decided by the region's values when the model runs; graphrun writes RoiAlign with a fixed grid (sampling_ratio ≥ 1)"
            )));
        }
        let xd: Vec<Option<usize>> = self.dims.get(&x).cloned().unwrap_or_default();
        let (h, w) = match xd.as_slice() {
            [_, Some(c), Some(h), Some(w)] if *c > 0 && *h > 0 && *w > 0 => (*h, *w),
            _ => {
                return Err(Error::Graph(format!(
                    "{what}: X '{x}' must be [N, C, H, W] with C, H and W known when the model is loaded, got {xd:?}"
                )))
            }
        };
        let c = xd[1].unwrap_or(1);
        let (oh, ow, sr) = (oh as usize, ow as usize, sr as usize);
        let like = |me: &mut Self, what: &str, t: Tensor| me.const_like(n, what, t, &x);
        let f = |me: &mut Self, what: &str, v: f64| like(me, what, Tensor::scalar(v));
        let b = |me: &mut Self, what: &str, op: BinaryOp, l: &str, r: &str| {
            me.val(n, what, bin(op), vec![l.to_string(), r.to_string()])
        };
        let ints = |me: &mut Self, what: &str, v: &[i64]| me.ints_const(n, what, v);
        // The regions' corners, [R, 1] each: x1, y1, x2, y2 scaled, less half a pixel.
        let rois = self.val(n, "regions", Op::CastLike, vec![rois, x.clone()]);
        let sc = f(self, "spatial_scale", scale as f64);
        let shift = f(self, "shift", if half { 0.5 } else { 0.0 });
        let one = ints(self, "axis1", &[1])?;
        let mut corner = vec![];
        for (i, name) in ["x1", "y1", "x2", "y2"].iter().enumerate() {
            let s = ints(self, &format!("{name}_start"), &[i as i64])?;
            let e = ints(self, &format!("{name}_end"), &[i as i64 + 1])?;
            let v = self.val(n, name, Op::Slice, vec![rois.clone(), s, e, one.clone()]);
            let v = b(self, &format!("{name}_scaled"), BinaryOp::Mul, &v, &sc);
            corner.push(b(
                self,
                &format!("{name}_shifted"),
                BinaryOp::Sub,
                &v,
                &shift,
            ));
        }
        // Per axis: the sample places [R, out·sr] = start + bin size · (p + (i + ½) / sr).
        let mut axes = vec![];
        for (name, start, end, out, size) in [
            ("y", &corner[1], &corner[3], oh, h),
            ("x", &corner[0], &corner[2], ow, w),
        ] {
            let tag = |s: &str| format!("{name}_{s}");
            let mut extent = b(self, &tag("extent"), BinaryOp::Sub, end, start);
            if !half {
                let one_f = f(self, &tag("one"), 1.0);
                extent = b(
                    self,
                    &tag("extent_at_least_1"),
                    BinaryOp::Max,
                    &extent,
                    &one_f,
                );
            }
            let bins = f(self, &tag("bins"), out as f64);
            let size_bin = b(self, &tag("bin"), BinaryOp::Div, &extent, &bins);
            let steps: Vec<f64> = (0..out * sr)
                .map(|k| (k / sr) as f64 + ((k % sr) as f64 + 0.5) / sr as f64)
                .collect();
            let steps = like(
                self,
                &tag("steps"),
                Tensor::from_vec(&[1, out * sr], steps)?,
            );
            let off = b(self, &tag("offsets"), BinaryOp::Mul, &size_bin, &steps);
            let p = b(self, &tag("places"), BinaryOp::Add, start, &off);
            axes.push(self.roi_axis(n, &tag(""), &p, size)?);
        }
        // [R, A, 1] against [R, 1, B]: every sample of the region's grid.
        let col = ints(self, "column", &[-1])?;
        let row = ints(self, "row", &[1])?;
        let (ay, ax) = (&axes[0], &axes[1]);
        let u = |me: &mut Self, what: &str, v: &str, at: &str| {
            me.val(
                n,
                what,
                Op::Unsqueeze { axes: None },
                vec![v.to_string(), at.to_string()],
            )
        };
        let inside_y = u(self, "inside_y_col", &ay.inside, &col);
        let inside_x = u(self, "inside_x_row", &ax.inside, &row);
        let inside = b(self, "inside", BinaryOp::And, &inside_y, &inside_x);
        let inside = self.val(n, "inside_f", Op::CastLike, vec![inside, x.clone()]);
        // X's image of each region's batch entry, flattened: [R, C, H·W].
        let xr = self.val(n, "images", Op::Gather { axis: 0 }, vec![x.clone(), batch]);
        let flat = ints(self, "flat_shape", &[0, c as i64, (h * w) as i64])?;
        let xr = self.val(
            n,
            "images_flat",
            Op::Reshape { allowzero: false },
            vec![xr, flat],
        );
        let samples = (oh * sr * ow * sr) as i64;
        let idx_shape = ints(self, "index_shape", &[0, 1, samples])?;
        let expand = ints(self, "index_expand", &[1, c as i64, 1])?;
        let width = self.constant(n, "width", Tensor::scalar(w as i64));
        let mut terms = vec![];
        for (k, (yi, wy, xi, wx)) in [
            (&ay.low, &ay.w_low, &ax.low, &ax.w_low),
            (&ay.low, &ay.w_low, &ax.high, &ax.w_high),
            (&ay.high, &ay.w_high, &ax.low, &ax.w_low),
            (&ay.high, &ay.w_high, &ax.high, &ax.w_high),
        ]
        .into_iter()
        .enumerate()
        {
            let tag = |s: &str| format!("corner{k}_{s}");
            let yc = u(self, &tag("y"), yi, &col);
            let yr = b(self, &tag("row_start"), BinaryOp::Mul, &yc, &width);
            let xc = u(self, &tag("x"), xi, &row);
            let idx = b(self, &tag("index"), BinaryOp::Add, &yr, &xc);
            let idx = self.val(
                n,
                &tag("index_flat"),
                Op::Reshape { allowzero: false },
                vec![idx, idx_shape.clone()],
            );
            let idx = self.val(n, &tag("index_c"), Op::Expand, vec![idx, expand.clone()]);
            let v = self.val(
                n,
                &tag("value"),
                Op::GatherElements { axis: 2 },
                vec![xr.clone(), idx],
            );
            let wyc = u(self, &tag("wy"), wy, &col);
            let wxr = u(self, &tag("wx"), wx, &row);
            let wt = b(self, &tag("weight2"), BinaryOp::Mul, &wyc, &wxr);
            let wt = b(self, &tag("weight"), BinaryOp::Mul, &wt, &inside);
            let wt = self.val(
                n,
                &tag("weight_flat"),
                Op::Reshape { allowzero: false },
                vec![wt, idx_shape.clone()],
            );
            terms.push(b(self, &tag("term"), BinaryOp::Mul, &v, &wt));
        }
        let op = if max { BinaryOp::Max } else { BinaryOp::Add };
        let l = b(self, "pair0", op, &terms[0], &terms[1]);
        let r = b(self, "pair1", op, &terms[2], &terms[3]);
        let s = b(self, "samples", op, &l, &r);
        let grid = ints(
            self,
            "grid_shape",
            &[0, c as i64, oh as i64, sr as i64, ow as i64, sr as i64],
        )?;
        let s = self.val(n, "grid", Op::Reshape { allowzero: false }, vec![s, grid]);
        let axes = Axes::Fixed(vec![3, 5]);
        if max {
            let (op, ins) = reduce_op(ReduceKind::Max, &s, &axes, false);
            self.out(n, 0, op, ins);
        } else {
            let (op, ins) = reduce_op(ReduceKind::Sum, &s, &axes, false);
            let total = self.val(n, "sum", op, ins);
            let count = f(self, "count", 1.0 / (sr * sr) as f64);
            self.out(n, 0, bin(BinaryOp::Mul), vec![total, count]);
        }
        Ok(())
    }

    /// One axis of the sample places `p` [R, K] in an image axis of `size`: whether each
    /// is within a pixel of the image, and its two taps and weights as ONNX's reference
    /// takes them (clamped to [0, size − 1]; the upper tap clamped too).
    fn roi_axis(&mut self, n: &NodeProto, tag: &str, p: &str, size: usize) -> Result<Axis> {
        let x = n.input[0].clone();
        let c = |me: &mut Self, what: &str, v: f64| {
            me.const_like(n, &format!("{tag}{what}"), Tensor::scalar(v), &x)
        };
        let b = |me: &mut Self, what: &str, op: BinaryOp, l: &str, r: &str| {
            me.val(
                n,
                &format!("{tag}{what}"),
                bin(op),
                vec![l.to_string(), r.to_string()],
            )
        };
        let lo = c(self, "minus1", -1.0);
        let hi = c(self, "size", size as f64);
        let zero = c(self, "zero", 0.0);
        let last = c(self, "last", size as f64 - 1.0);
        let one = c(self, "one", 1.0);
        let above = b(self, "above", BinaryOp::GreaterOrEqual, p, &lo);
        let below = b(self, "below", BinaryOp::LessOrEqual, p, &hi);
        let inside = b(self, "inside", BinaryOp::And, &above, &below);
        let cl = b(self, "clamp_low", BinaryOp::Max, p, &zero);
        let cl = b(self, "clamped", BinaryOp::Min, &cl, &last);
        let fl = self.val(
            n,
            &format!("{tag}floor"),
            un(UnaryOp::Floor),
            vec![cl.clone()],
        );
        let w_high = b(self, "w_high", BinaryOp::Sub, &cl, &fl);
        let w_low = b(self, "w_low", BinaryOp::Sub, &one, &w_high);
        let low = self.val(
            n,
            &format!("{tag}low"),
            Op::Cast { to: DType::I64 },
            vec![fl],
        );
        let one_i = self.constant(n, &format!("{tag}one_i"), Tensor::scalar(1i64));
        let last_i = self.constant(n, &format!("{tag}last_i"), Tensor::scalar(size as i64 - 1));
        let high = b(self, "high1", BinaryOp::Add, &low, &one_i);
        let high = b(self, "high", BinaryOp::Min, &high, &last_i);
        Ok(Axis {
            low,
            high,
            w_low,
            w_high,
            inside,
        })
    }
}
