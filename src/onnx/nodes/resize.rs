//! Resize (opsets 10 to 19) and Upsample (7 and 9), written on `ResizeMatrix`
//! (graph/resize.rs). Resize is separable, so each axis that may change is resampled on
//! its own: its weights, computed on the host when the plan is made from X's shape and the
//! values of roi, scales and sizes, are applied by a MatMul over that axis (linear and
//! cubic), or by a Gather of the input position each output reads (nearest, which also
//! takes integer X); tf_crop_and_resize's outside positions take extrapolation_value
//! through a Where. Every backend then runs Resize without a kernel of its own, and
//! autodiff differentiates it with respect to X through those ops.

use super::composite::{inputs, shape, Attrs};
use super::Importer;
use crate::error::{Error, Result};
use crate::graph::op::{Attr, AttrValue};
use crate::graph::resize::{CoordMode, NearestMode, Resize, ResizeMode};
use crate::graph::{Node, Op};
use crate::onnx::proto::NodeProto;
use crate::tensor::Tensor;

/// The ai.onnx operators written here.
pub(super) const RESIZE: &[&str] = &["Resize", "Upsample"];

/// Resize's plan-time inputs, by name ("" where omitted).
struct Given {
    roi: String,
    scales: String,
    sizes: String,
}

impl Importer<'_> {
    /// Writes Resize or Upsample.
    pub(super) fn lower_resize(
        &mut self,
        n: &NodeProto,
        shown: &str,
        attrs: Vec<Attr>,
    ) -> Result<()> {
        let op = n.op_type.as_str();
        let mut a = Attrs::of(n, shown, attrs)?;
        let what = a.what.clone();
        // Upsample and Resize-10 take X and scales, and sample as ONNX Runtime does for
        // them: asymmetric coordinates, nearest reads floor when growing, ceil when
        // shrinking (their definitions' examples).
        let old = op == "Upsample" || self.opset < 11;
        let (x, given, resize, axes, fill) = if old {
            let mode = Resize::parse(|k| if k == "mode" { a.take(k) } else { None })
                .map_err(|m| Error::Graph(format!("{what}: {m}")))?;
            if mode.mode == ResizeMode::Cubic {
                return Err(a.refuse("mode", "cubic needs Resize from opset 11 on"));
            }
            let resize = Resize {
                coord: CoordMode::Asymmetric,
                nearest: NearestMode::Simple,
                ..mode
            };
            let (x, scales) = if op == "Upsample" && self.opset < 9 {
                let (req, _) = inputs(n, &what, (1, 1), 1)?;
                let scales = match a.take("scales") {
                    Some(AttrValue::Floats(v)) => v,
                    Some(v) => return Err(a.wrong("scales", "a list of floats", &v)),
                    None => return Err(a.refuse("scales", "is required before opset 9")),
                };
                let v: Vec<f32> = scales.iter().map(|&s| s as f32).collect();
                let t = Tensor::from_vec(&[v.len()], v)?;
                (req[0].clone(), self.constant(n, "scales", t))
            } else {
                let (req, _) = inputs(n, &what, (2, 2), 1)?;
                (req[0].clone(), req[1].clone())
            };
            let given = Given {
                roi: String::new(),
                scales,
                sizes: String::new(),
            };
            (x, given, resize, None, 0.0)
        } else {
            let (req, opt) = inputs(n, &what, (1, 4), 1)?;
            let name = |k: usize| opt[k].clone().unwrap_or_default();
            let given = Given {
                roi: name(0),
                scales: name(1),
                sizes: name(2),
            };
            let resize =
                Resize::parse(|k| a.take(k)).map_err(|m| Error::Graph(format!("{what}: {m}")))?;
            let extrapolation = a.float("extrapolation_value", 0.0)?;
            let axes = a.opt_ints("axes")?;
            (req[0].clone(), given, resize, axes, extrapolation)
        };
        a.finish()?;
        if given.scales.is_empty() && given.sizes.is_empty() {
            return Err(Error::Graph(format!(
                "{what}: one of scales and sizes is required"
            )));
        }

        let rank = self.resize_rank(&x, &given, axes.as_deref(), &what)?;
        let axes: Vec<usize> = match axes {
            None => (0..rank).collect(),
            Some(v) => {
                let mut out = vec![];
                for &d in &v {
                    let ok = (-(rank as i64)..rank as i64).contains(&d);
                    let d = if d < 0 { d + rank as i64 } else { d } as usize;
                    if !ok || out.contains(&d) {
                        return Err(a.refuse(
                            "axes",
                            &format!("must name distinct axes of X (rank {rank}), got {v:?}"),
                        ));
                    }
                    out.push(d);
                }
                out
            }
        };
        // Where an output takes a fill value instead of what it reads: tf_crop_and_resize
        // outside the input, and a nearest read that exclude_outside removed (0).
        let masked = resize.coord == CoordMode::TfCropAndResize
            || (resize.mode == ResizeMode::Nearest && resize.exclude_outside);
        let fill = if resize.coord == CoordMode::TfCropAndResize {
            fill
        } else {
            0.0
        };
        let fill = masked.then(|| self.float_like(n, "fill", fill, &x));

        let mut y = x.clone();
        for (i, &d) in axes.iter().enumerate() {
            if self.resize_leaves(&x, d, i, &given, &resize) {
                continue;
            }
            let op = Op::ResizeMatrix {
                resize: resize.clone(),
                axes: axes.clone(),
                axis: d,
            };
            let ins = vec![
                x.clone(),
                given.roi.clone(),
                given.scales.clone(),
                given.sizes.clone(),
            ];
            let (m, mask) = self.resize_matrix(n, d, op, ins, masked);
            y = self.resample(n, &y, &m, d, rank, resize.mode);
            if let (Some(mask), Some(fill)) = (mask, &fill) {
                let mask = if d + 1 < rank {
                    let axes = Some((1..(rank - d) as i64).collect());
                    self.val(n, &format!("mask{d}_b"), Op::Unsqueeze { axes }, vec![mask])
                } else {
                    mask
                };
                y = self.val(
                    n,
                    &format!("fill{d}"),
                    Op::Where,
                    vec![mask, fill.clone(), y],
                );
            }
        }
        self.out(n, 0, Op::Identity, vec![y]);
        Ok(())
    }

    /// X's rank: declared, else (without axes) the length of a scales, sizes or roi
    /// whose length is known.
    fn resize_rank(
        &self,
        x: &str,
        given: &Given,
        axes: Option<&[i64]>,
        what: &str,
    ) -> Result<usize> {
        if let Some(&r) = self.ranks.get(x) {
            return Ok(r);
        }
        if axes.is_none() {
            let len = |v: &str| -> Option<usize> {
                match self.constant_value(v) {
                    Some(t) => Some(t.numel()),
                    None => self.dims.get(v)?.first().copied().flatten(),
                }
                .filter(|&l| l > 0)
            };
            if let Some(l) = len(&given.scales).or_else(|| len(&given.sizes)) {
                return Ok(l);
            }
            if let Some(l) = len(&given.roi) {
                return Ok(l / 2);
            }
        }
        Err(Error::Graph(format!(
            "{what}: the rank of X is unknown: declare it (a value_info or input type)"
        )))
    }

    /// Whether axis `d` (the `i`-th of the axes) is known at import to keep its length and
    /// values, so that no work is written for it: its scale is 1, or its size is X's and
    /// the sizes are taken as they are. The plan would find the same (an identity matrix).
    fn resize_leaves(&self, x: &str, d: usize, i: usize, given: &Given, r: &Resize) -> bool {
        if r.coord == CoordMode::TfCropAndResize {
            return false;
        }
        let nonempty = |v: &str| self.constant_value(v).filter(|t| t.numel() > 0);
        if let Some(s) = nonempty(&given.scales) {
            return s.to_f64_vec().get(i) == Some(&1.0);
        }
        if let Some(s) = nonempty(&given.sizes) {
            let dim = self.dims.get(x).and_then(|v| v.get(d).copied().flatten());
            return r.policy == crate::graph::resize::AspectPolicy::Stretch
                && dim.is_some()
                && s.to_i64_vec().get(i).map(|&v| v as usize) == dim;
        }
        false
    }

    /// The ResizeMatrix node for axis `d`: its weights (or indices), and its mask when
    /// asked for.
    fn resize_matrix(
        &mut self,
        n: &NodeProto,
        d: usize,
        op: Op,
        ins: Vec<String>,
        masked: bool,
    ) -> (String, Option<String>) {
        let base = &n.output[0];
        let m = self.fresh(&format!("{base}/resize{d}"));
        let mut outputs = vec![m.clone()];
        if masked {
            outputs.push(self.fresh(&format!("{base}/resize{d}_mask")));
        }
        self.nodes.push(Node {
            name: super::helper_name(n, &format!("resize{d}")),
            op,
            inputs: ins,
            outputs: outputs.clone(),
            loc: None,
        });
        (m, outputs.get(1).cloned())
    }

    /// `y` resampled along axis `d` by `m`: a Gather of the positions (nearest), else the
    /// `[out, in]` weights times the axis. On the last axis that is `y · mᵀ`; on the one
    /// before, `m · y` over the batch of trailing matrices; further in, the axes after `d`
    /// are merged into one for that product and split again after it.
    fn resample(
        &mut self,
        n: &NodeProto,
        y: &str,
        m: &str,
        d: usize,
        rank: usize,
        mode: ResizeMode,
    ) -> String {
        let name = |s: &str| format!("{s}{d}");
        if mode == ResizeMode::Nearest {
            let op = Op::Gather { axis: d as i64 };
            return self.val(n, &name("gather"), op, vec![y.into(), m.into()]);
        }
        if d + 1 == rank {
            let op = Op::FusedMatMul {
                activation: crate::graph::Activation::None,
                trans_b: true,
            };
            return self.val(n, &name("matmul"), op, vec![y.into(), m.into()]);
        }
        if d + 2 == rank {
            return self.val(n, &name("matmul"), Op::MatMul, vec![m.into(), y.into()]);
        }
        // [.., in, rest...] → [.., in, R] → [.., out, R] → [.., out, rest...]
        let head = self.val(
            n,
            &name("head"),
            shape(0, Some(d as i64 + 1)),
            vec![y.into()],
        );
        let minus = self.constant(
            n,
            &name("merged"),
            Tensor::from_vec(&[1], vec![-1i64]).expect("1-D"),
        );
        let merged_shape = self.val(
            n,
            &name("merged_shape"),
            Op::Concat { axis: 0 },
            vec![head, minus],
        );
        let reshape = Op::Reshape { allowzero: false };
        let merged = self.val(
            n,
            &name("merged"),
            reshape.clone(),
            vec![y.into(), merged_shape],
        );
        let z = self.val(n, &name("matmul"), Op::MatMul, vec![m.into(), merged]);
        let mut parts = vec![];
        if d > 0 {
            parts.push(self.val(n, &name("before"), shape(0, Some(d as i64)), vec![y.into()]));
        }
        parts.push(self.val(n, &name("out"), shape(0, Some(1)), vec![m.into()]));
        parts.push(self.val(n, &name("after"), shape(d as i64 + 1, None), vec![y.into()]));
        let split_shape = self.val(n, &name("split_shape"), Op::Concat { axis: 0 }, parts);
        self.val(n, &name("split"), reshape, vec![z, split_shape])
    }
}
