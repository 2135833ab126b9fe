//! DeformConv (2-D) as a composition: each kernel tap of each output position samples X
//! bilinearly at its place moved by the offset input (GridSample, zeros outside the image,
//! as ONNX's reference samples it), scaled by the mask; the samples are the columns of a
//! convolution, multiplied by the filters per group. Gradients reach X, W, the offsets
//! (through the interpolation weights), the mask and B.
//!
//! The sampling places are constants of the geometry plus the offsets, so the node is
//! written after shape inference, when X's spatial size and the output's are known.

use super::composite::{bin, inputs, unsqueeze, Attrs};
use super::Importer;
use crate::error::{Error, Result};
use crate::graph::op::{Attr, AttrValue};
use crate::graph::{BinaryOp, Op};
use crate::onnx::proto::NodeProto;
use crate::tensor::Tensor;

/// The operator written here.
pub(super) const DEFORM_CONV: &str = "DeformConv";

impl Importer<'_> {
    pub(super) fn deform_conv(
        &mut self,
        n: &NodeProto,
        shown: &str,
        attrs: Vec<Attr>,
    ) -> Result<()> {
        let mut a = Attrs::of(n, shown, attrs)?;
        let what = &a.what.clone();
        let (req, opt) = inputs(n, what, (3, 5), 1)?;
        let (x, w, offset) = (req[0].clone(), req[1].clone(), req[2].clone());
        let (b, mask) = (opt[0].clone(), opt[1].clone());
        let dims = |me: &Self, v: &str, name: &str| -> Result<Vec<usize>> {
            let d = me.dims.get(v).cloned().unwrap_or_default();
            if d.len() != 4 {
                return Err(Error::Graph(format!(
                    "{what}: {name} '{v}' must be 4-D (graphrun's DeformConv is 2-D), got rank {}",
                    d.len()
                )));
            }
            d.into_iter()
                .collect::<Option<Vec<usize>>>()
                .ok_or_else(|| {
                    Error::Graph(format!(
                        "{what}: the shape of {name} '{v}' must be known when the model is loaded (its sampling places are constants of it)"
                    ))
                })
        };
        let xd = dims(self, &x, "X")?;
        let wd = dims(self, &w, "W")?;
        let od = dims(self, &offset, "offset")?;
        let (c, h, wi) = (xd[1], xd[2], xd[3]);
        let (oc, (oh, ow)) = (wd[0], (od[2], od[3]));
        let kernel = a.ints("kernel_shape", &[wd[2] as i64, wd[3] as i64])?;
        let strides = a.ints("strides", &[1, 1])?;
        let dilations = a.ints("dilations", &[1, 1])?;
        let pads = a.ints("pads", &[0, 0, 0, 0])?;
        let group = a.int("group", 1)?;
        let og = a.int("offset_group", 1)?;
        a.finish()?;
        let positive = |v: &[i64]| v.iter().all(|&d| d > 0);
        if kernel.len() != 2
            || strides.len() != 2
            || dilations.len() != 2
            || pads.len() != 4
            || !positive(&kernel)
            || !positive(&strides)
            || !positive(&dilations)
            || pads.iter().any(|&p| p < 0)
        {
            return Err(Error::Graph(format!(
                "{what}: kernel_shape, strides and dilations must be 2 positive ints and pads 4 non-negative ones, got {kernel:?}, {strides:?}, {dilations:?}, {pads:?}"
            )));
        }
        let (kh, kw) = (kernel[0] as usize, kernel[1] as usize);
        let k = kh * kw;
        let bad = |msg: String| Err(Error::Graph(format!("{what}: {msg}")));
        if group < 1 || og < 1 {
            return bad(format!(
                "group ({group}) and offset_group ({og}) must be positive"
            ));
        }
        let (group, og) = (group as usize, og as usize);
        if c != wd[1] * group || oc % group != 0 || (wd[2], wd[3]) != (kh, kw) {
            return bad(format!(
                "X {xd:?} and W {wd:?} do not fit group {group} and kernel_shape {kernel:?}"
            ));
        }
        if c % og != 0 || od[1] != og * k * 2 || od[0] != xd[0] {
            return bad(format!(
                "offset {od:?} must be [N, offset_group·kH·kW·2, oH, oW] for X {xd:?}, offset_group {og} and kernel {kh}×{kw}, with C divisible by offset_group"
            ));
        }
        let span = |i: usize| (kernel[i] - 1) * dilations[i] + 1;
        let out = |i: usize, size: usize| {
            (size as i64 + pads[i] + pads[i + 2] - span(i)).div_euclid(strides[i]) + 1
        };
        if (out(0, h), out(1, wi)) != (oh as i64, ow as i64) {
            return bad(format!(
                "offset's spatial size {oh}×{ow} is not the output size {}×{} of X {h}×{wi} under these pads, strides and dilations",
                out(0, h),
                out(1, wi)
            ));
        }
        if let Some(m) = &mask {
            let md = dims(self, m, "mask")?;
            if md != [xd[0], og * k, oh, ow] {
                return bad(format!(
                    "mask {md:?} must be [N, offset_group·kH·kW, oH, oW] = {:?}",
                    [xd[0], og * k, oh, ow]
                ));
            }
        }
        // Where each tap of each output position samples before its offset, as GridSample's
        // coordinates without align_corners: (2p + 1) / size - 1 for pixel p.
        let l = oh * ow;
        let mut base = [vec![0f64; k * l], vec![0f64; k * l]];
        for (t, (i, j)) in (0..kh)
            .flat_map(|i| (0..kw).map(move |j| (i, j)))
            .enumerate()
        {
            for (q, (y, z)) in (0..oh)
                .flat_map(|y| (0..ow).map(move |z| (y, z)))
                .enumerate()
            {
                let py = y as i64 * strides[0] - pads[0] + i as i64 * dilations[0];
                let px = z as i64 * strides[1] - pads[1] + j as i64 * dilations[1];
                base[0][t * l + q] = py as f64;
                base[1][t * l + q] = px as f64;
            }
        }
        let like = |me: &mut Self, what: &str, t: Tensor| me.const_like(n, what, t, &x);
        // In f64, cast like X: an f64 model keeps every digit.
        let scale = |me: &mut Self, v: &str, axis: &str, size: usize| {
            let s = like(
                me,
                &format!("{axis}_scale"),
                Tensor::scalar(2.0 / size as f64),
            );
            let o = like(
                me,
                &format!("{axis}_shift"),
                Tensor::scalar(1.0 / size as f64 - 1.0),
            );
            let m = me.val(
                n,
                &format!("{axis}_scaled"),
                bin(BinaryOp::Mul),
                vec![v.into(), s],
            );
            me.val(n, &format!("{axis}_norm"), bin(BinaryOp::Add), vec![m, o])
        };
        let shape_of = |me: &mut Self, what: &str, v: &[i64]| me.ints_const(n, what, v);
        let reshape = |me: &mut Self, what: &str, v: &str, to: &str| {
            me.val(
                n,
                what,
                Op::Reshape { allowzero: false },
                vec![v.into(), to.into()],
            )
        };
        let slice =
            |me: &mut Self, what: &str, v: &str, from: usize, to: usize| -> Result<String> {
                let s = shape_of(me, &format!("{what}_start"), &[from as i64])?;
                let e = shape_of(me, &format!("{what}_end"), &[to as i64])?;
                let ax = shape_of(me, &format!("{what}_axis"), &[1])?;
                Ok(me.val(n, what, Op::Slice, vec![v.into(), s, e, ax]))
            };
        let base_y = like(
            self,
            "base_y",
            Tensor::from_vec(&[k, oh, ow], base[0].clone())?,
        );
        let base_x = like(
            self,
            "base_x",
            Tensor::from_vec(&[k, oh, ow], base[1].clone())?,
        );
        let off_shape = shape_of(
            self,
            "offset_shape",
            &[0, k as i64, 2, oh as i64, ow as i64],
        )?;
        let grid_shape = shape_of(self, "grid_shape", &[0, (k * oh) as i64, ow as i64, 2])?;
        let cg = c / og;
        let col_shape = shape_of(self, "column_shape", &[0, cg as i64, k as i64, l as i64])?;
        let mask_shape = shape_of(self, "mask_shape", &[0, 1, k as i64, l as i64])?;
        let mut cols = vec![];
        for g in 0..og {
            let tag = |s: &str| format!("g{g}_{s}");
            let (xg, off) = if og == 1 {
                (x.clone(), offset.clone())
            } else {
                (
                    slice(self, &tag("x"), &x, g * cg, (g + 1) * cg)?,
                    slice(self, &tag("offset"), &offset, g * k * 2, (g + 1) * k * 2)?,
                )
            };
            let off = reshape(self, &tag("offsets"), &off, &off_shape);
            let mut coords = vec![];
            for (axis, comp, basev, size) in [("x", 1i64, &base_x, wi), ("y", 0, &base_y, h)] {
                let idx = self.constant(n, &tag(&format!("{axis}_index")), Tensor::scalar(comp));
                let d = self.val(
                    n,
                    &tag(&format!("{axis}_offset")),
                    Op::Gather { axis: 2 },
                    vec![off.clone(), idx],
                );
                let p = self.val(
                    n,
                    &tag(&format!("{axis}_place")),
                    bin(BinaryOp::Add),
                    vec![d, basev.clone()],
                );
                let norm = scale(self, &p, &tag(axis), size);
                coords.push(self.val(n, &tag(&format!("{axis}_last")), unsqueeze(-1), vec![norm]));
            }
            let grid = self.val(n, &tag("grid5"), Op::Concat { axis: -1 }, coords);
            let grid = reshape(self, &tag("grid"), &grid, &grid_shape);
            let sampled = self.fresh(&format!("{}/{}", n.output[0], tag("sampled")));
            let gs = NodeProto {
                name: format!("{}/{}", n.name, tag("sample")),
                op_type: "GridSample".into(),
                input: vec![xg.clone(), grid],
                output: vec![sampled.clone()],
                ..Default::default()
            };
            self.ranks.insert(xg.clone(), 4);
            let align = Attr {
                name: "align_corners".into(),
                value: AttrValue::Int(0),
                loc: None,
            };
            let ga = Attrs::of(&gs, &gs.name, vec![align])?;
            self.grid_sample(&gs, what, ga)?;
            let mut col = reshape(self, &tag("columns"), &sampled, &col_shape);
            if let Some(m) = &mask {
                let mg = if og == 1 {
                    m.clone()
                } else {
                    slice(self, &tag("mask"), m, g * k, (g + 1) * k)?
                };
                let mg = reshape(self, &tag("mask_k"), &mg, &mask_shape);
                col = self.val(n, &tag("masked"), bin(BinaryOp::Mul), vec![col, mg]);
            }
            cols.push(col);
        }
        let cols = if cols.len() == 1 {
            cols.remove(0)
        } else {
            self.val(n, "columns", Op::Concat { axis: 1 }, cols)
        };
        // [N, C, K, L] → [N, group, C/group·K, L] against W as [group, M/group, C/group·K].
        let per = (c / group * k) as i64;
        let cs = shape_of(self, "grouped_shape", &[0, group as i64, per, l as i64])?;
        let cols = reshape(self, "grouped", &cols, &cs);
        let ws = shape_of(
            self,
            "filters_shape",
            &[group as i64, (oc / group) as i64, per],
        )?;
        let wm = reshape(self, "filters", &w, &ws);
        let y = self.val(n, "products", Op::MatMul, vec![wm, cols]);
        let ys = shape_of(self, "output_shape", &[0, oc as i64, oh as i64, ow as i64])?;
        match b {
            None => self.out(n, 0, Op::Reshape { allowzero: false }, vec![y, ys]),
            Some(b) => {
                let y = reshape(self, "unbiased", &y, &ys);
                let bs = shape_of(self, "bias_shape", &[oc as i64, 1, 1])?;
                let b = reshape(self, "bias", &b, &bs);
                self.out(n, 0, bin(BinaryOp::Add), vec![y, b]);
            }
        }
        Ok(())
    }
}
