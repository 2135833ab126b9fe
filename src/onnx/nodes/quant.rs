//! The integer products of quantized models: MatMulInteger and ConvInteger (int32 sums of
//! zero-point-centred 8-bit operands, as ONNX Runtime's dynamic quantization writes them)
//! and QLinearMatMul and QLinearConv (the same sums rescaled and requantized, as its static
//! quantization writes them). Each is written as graphrun's float product of the centred
//! operands: the 8-bit values and their differences are exact in f32, and so is every sum
//! below 2^24 in magnitude (a 255 x 255 product summed 258 times), which covers the
//! products these models make up to rounding of the last unit on larger sums.

use super::composite::{bin, inputs, un, unsqueeze, Attrs};
use super::Importer;
use crate::error::{Error, Result};
use crate::graph::op::Attr;
use crate::graph::{BinaryOp, Op, UnaryOp};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};

/// The ai.onnx operators written here.
pub(super) const QUANT: &[&str] = &[
    "MatMulInteger",
    "QLinearMatMul",
    "ConvInteger",
    "QLinearConv",
];

/// Where a zero point or scale sits against its operand.
#[derive(Clone, Copy, PartialEq)]
enum Per {
    /// A's: one per row (a 1-D value of M), which must broadcast along K.
    Row,
    /// B's: one per column (1-D of N), which broadcasts as it is.
    Column,
    /// A filter's: one per output channel (1-D of M) against W [M, C/g, k...].
    Filter,
    /// A convolution's output: one per channel against Y [N, M, spatial...].
    Channel,
}

impl Importer<'_> {
    /// Writes one of `QUANT`.
    pub(super) fn lower_quant(
        &mut self,
        n: &NodeProto,
        shown: &str,
        attrs: Vec<Attr>,
    ) -> Result<()> {
        let conv = n.op_type.contains("Conv");
        // A convolution's window attributes are Conv's; the products have none.
        let window = if conv {
            Some(Op::parse("Conv", &attrs, shown, None)?)
        } else {
            Attrs::of(n, shown, attrs)?.finish()?;
            None
        };
        let what = format!("node '{shown}' ({})", n.op_type);
        let (a_at, b_at) = match n.op_type.as_str() {
            "MatMulInteger" | "ConvInteger" => (0, 1),
            _ => (0, 3),
        };
        let (a_per, b_per) = if conv {
            (Per::Row, Per::Filter)
        } else {
            (Per::Row, Per::Column)
        };
        let linear = n.op_type.starts_with("QLinear");
        let (req, opt) = match (linear, conv) {
            (false, _) => inputs(n, &what, (2, 4), 1)?,
            (true, false) => inputs(n, &what, (8, 8), 1)?,
            (true, true) => inputs(n, &what, (8, 9), 1)?,
        };
        let (a, b) = (req[a_at].clone(), req[b_at].clone());
        let (a_zp, b_zp) = if linear {
            (Some(req[2].clone()), Some(req[5].clone()))
        } else {
            (opt[0].clone(), opt[1].clone())
        };
        for v in [&a, &b] {
            match self.dtypes.get(v) {
                Some(DType::U8 | DType::I8) | None => {}
                Some(dt) => {
                    return Err(Error::Graph(format!(
                        "{what}: input '{v}' must be uint8 or int8, got {dt}"
                    )))
                }
            }
        }
        // A conv's input takes one zero point for the whole tensor.
        let a_per = if conv { None } else { Some(a_per) };
        let a = self.centred(&what, n, "a", &a, a_zp, a_per)?;
        let b = self.centred(&what, n, "b", &b, b_zp, Some(b_per))?;
        let mut prod_ins = vec![a, b];
        if let Some(bias) = opt.first().cloned().flatten().filter(|_| linear && conv) {
            prod_ins.push(self.val(n, "bias_f32", Op::Cast { to: DType::F32 }, vec![bias]));
        }
        let sums = self.val(n, "sums", window.unwrap_or(Op::MatMul), prod_ins);
        if !linear {
            self.out(n, 0, Op::Cast { to: DType::I32 }, vec![sums]);
            return Ok(());
        }
        // (a_scale · b_scale / y_scale) in the scales' own type, then the sums rescaled in
        // f32, shifted by y's zero point, rounded half to even and saturated to its type.
        let y_zp = req[7].clone();
        let to = match self.dtypes.get(&y_zp).or_else(|| self.dtypes.get(&req[0])) {
            Some(&dt @ (DType::U8 | DType::I8)) => dt,
            Some(dt) => {
                return Err(Error::Graph(format!(
                    "{what}: y_zero_point '{y_zp}' must be uint8 or int8, got {dt}"
                )))
            }
            None => {
                return Err(Error::Graph(format!(
                    "{what}: the element type of y_zero_point '{y_zp}' is not declared, and graphrun needs it to saturate"
                )))
            }
        };
        let (a_name, b_name) = (n.input[a_at].clone(), n.input[b_at].clone());
        let a_scale = match conv {
            true => self.per(&what, n, "x_scale", &req[1], None, &a_name)?,
            false => self.per(&what, n, "a_scale", &req[1], Some(Per::Row), &a_name)?,
        };
        let b_scale = match conv {
            true => self.per(&what, n, "w_scale", &req[4], Some(Per::Channel), &a_name)?,
            false => self.per(&what, n, "b_scale", &req[4], Some(Per::Column), &b_name)?,
        };
        let scale = self.val(n, "scale_ab", bin(BinaryOp::Mul), vec![a_scale, b_scale]);
        let scale = self.val(n, "scale", bin(BinaryOp::Div), vec![scale, req[6].clone()]);
        let scale = self.val(n, "scale_f32", Op::Cast { to: DType::F32 }, vec![scale]);
        let y = self.val(n, "rescaled", bin(BinaryOp::Mul), vec![sums, scale]);
        let zp = self.val(
            n,
            "y_zero_point_f32",
            Op::Cast { to: DType::F32 },
            vec![y_zp],
        );
        let y = self.val(n, "shifted", bin(BinaryOp::Add), vec![y, zp]);
        let y = self.val(n, "rounded", un(UnaryOp::Round), vec![y]);
        let (lo, hi) = to.int_range().expect("an 8-bit integer type");
        let lo = self.constant(n, "type_min", Tensor::scalar(lo as f32));
        let hi = self.constant(n, "type_max", Tensor::scalar(hi as f32));
        let y = self.val(n, "saturated", Op::Clip, vec![y, lo, hi]);
        self.out(n, 0, Op::Cast { to }, vec![y]);
        Ok(())
    }

    /// f32(x) - f32(zero point), the zero point placed against x as `per` says.
    fn centred(
        &mut self,
        node: &str,
        n: &NodeProto,
        what: &str,
        x: &str,
        zp: Option<String>,
        per: Option<Per>,
    ) -> Result<String> {
        let xf = self.val(
            n,
            &format!("{what}_f32"),
            Op::Cast { to: DType::F32 },
            vec![x.into()],
        );
        let Some(zp) = zp else { return Ok(xf) };
        let zp = self.per(node, n, &format!("{what}_zero_point"), &zp, per, x)?;
        let zp = self.val(
            n,
            &format!("{what}_zero_point_f32"),
            Op::Cast { to: DType::F32 },
            vec![zp],
        );
        Ok(self.val(
            n,
            &format!("{what}_centred"),
            bin(BinaryOp::Sub),
            vec![xf, zp],
        ))
    }

    /// A zero point or scale `v` shaped to broadcast against `operand` as `per` says: a
    /// scalar as it is, a 1-D value along the axis `per` names (`None`: it must be one
    /// value).
    fn per(
        &mut self,
        node: &str,
        n: &NodeProto,
        what: &str,
        v: &str,
        per: Option<Per>,
        operand: &str,
    ) -> Result<String> {
        let rank = |me: &Self, x: &str| me.ranks.get(x).copied();
        if let Some(r) = rank(self, v).filter(|&r| r > 1) {
            return Err(Error::Graph(format!(
                "{node}: {what} '{v}' must be a scalar or a 1-D tensor, got rank {r}"
            )));
        }
        // A scalar unsqueezed as a 1-D value would be still broadcasts as one value, so a
        // value of undeclared rank is placed as a 1-D one.
        let trailing = match per {
            None | Some(Per::Column) => 0,
            // A 1-D A has no rows: its zero point is one value.
            Some(Per::Row) => usize::from(rank(self, operand) != Some(1)),
            Some(p) => {
                let Some(r) = rank(self, operand) else {
                    return Err(Error::Graph(format!(
                        "{node}: the rank of '{operand}' is not declared, and graphrun needs it to place {what} '{v}' per channel"
                    )));
                };
                // W [M, C/g, k...] or Y [N, M, spatial...]: M then r-1 or r-2 axes.
                r.saturating_sub(if p == Per::Filter { 1 } else { 2 })
            }
        };
        let mut out = v.to_string();
        for k in 0..trailing {
            out = self.val(n, &format!("{what}_axis{k}"), unsqueeze(-1), vec![out]);
        }
        Ok(out)
    }
}
