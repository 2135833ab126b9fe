//! Det as a composition: Gaussian elimination with partial pivoting, written out column by
//! column for the matrix size M known once shapes are inferred. Step k picks the row of
//! largest |A[r, k]| among r ≥ k, swaps it with row k through a permutation matrix
//! I − d·dᵀ (d = e_k − e_p, the identity when p = k), multiplies the running determinant
//! by the pivot (and by −1 for a swap), and subtracts multiples of row k from the rows
//! below. A zero pivot (the column all zero from row k down) makes the determinant 0; it
//! is divided by 1 instead, so nothing becomes NaN. Every step is a differentiable op, so
//! the gradient, det(A)·A⁻ᵀ where A is invertible, comes from the ops' own; where the
//! elimination meets a zero pivot, the gradient with respect to that column below the
//! diagonal is not the cofactor it should be: an exactly singular input of that kind gets
//! a wrong gradient for those entries.

use super::composite::{bin, inputs, un, unsqueeze, Attrs};
use super::Importer;
use crate::error::{Error, Result};
use crate::graph::op::Attr;
use crate::graph::{BinaryOp, Op, UnaryOp};
use crate::onnx::proto::NodeProto;
use crate::tensor::Tensor;

/// The operator written here.
pub(super) const DET: &str = "Det";

/// The largest matrix written out (M steps of about 20 nodes each).
const MAX_M: usize = 256;

impl Importer<'_> {
    pub(super) fn det(&mut self, n: &NodeProto, shown: &str, attrs: Vec<Attr>) -> Result<()> {
        let a = Attrs::of(n, shown, attrs)?;
        let what = a.what.clone();
        a.finish()?;
        let (req, _) = inputs(n, &what, (1, 1), 1)?;
        let x = req[0].clone();
        let xd = self.dims.get(&x).cloned().unwrap_or_default();
        let m = match xd.as_slice() {
            [.., Some(r), Some(c)] if r == c && *r <= MAX_M => *r,
            _ => {
                return Err(Error::Graph(format!(
                    "{what}: X '{x}' must end in a square [M, M] with M known when the model is loaded (at most {MAX_M}), got {xd:?}"
                )))
            }
        };
        let f = |me: &mut Self, what: &str, t: Tensor| me.const_like(n, what, t, &x);
        let b = |me: &mut Self, what: &str, op: BinaryOp, l: &str, r: &str| {
            me.val(n, what, bin(op), vec![l.to_string(), r.to_string()])
        };
        let one = f(self, "one", Tensor::scalar(1.0f32));
        if m == 0 {
            // The determinant of an empty matrix is 1, one per batch entry.
            let shape = self.val(
                n,
                "batch",
                super::composite::shape(0, Some(-2)),
                vec![x.clone()],
            );
            self.out(n, 0, Op::Expand, vec![one, shape]);
            return Ok(());
        }
        let eye: Vec<f32> = (0..m * m).map(|i| f32::from(i / m == i % m)).collect();
        let eye = f(self, "eye", Tensor::from_vec(&[m, m], eye)?);
        let rows = self.ints_const(n, "rows", &(0..m as i64).collect::<Vec<_>>())?;
        let zero = f(self, "zero", Tensor::scalar(0.0f32));
        let minus_one = f(self, "minus_one", Tensor::scalar(-1.0f32));
        let (mut a, mut det, mut sign) = (x.clone(), one.clone(), one.clone());
        for k in 0..m {
            let s = |w: &str| format!("step{k}_{w}");
            let kk = self.constant(n, &s("k"), Tensor::scalar(k as i64));
            let ind = |me: &mut Self, w: &str, from: usize| {
                let v: Vec<f32> = (0..m).map(|r| f32::from(u8::from(r >= from))).collect();
                me.const_like(n, w, Tensor::from_vec(&[m], v).unwrap(), &x)
            };
            // The pivot row: the largest |A[r, k]| among r ≥ k.
            let col = self.val(
                n,
                &s("col"),
                Op::Gather { axis: -1 },
                vec![a.clone(), kk.clone()],
            );
            let abs = self.val(n, &s("abs"), un(UnaryOp::Abs), vec![col]);
            let below = ind(self, &s("from_k"), k);
            // Rows above k get −1, below any |A[r, k]|, so they are never picked (and an
            // all-zero column picks row k itself).
            let masked = b(self, &s("masked"), BinaryOp::Mul, &abs, &below);
            let above = b(self, &s("above"), BinaryOp::Sub, &below, &one);
            let cand = b(self, &s("candidates"), BinaryOp::Add, &masked, &above);
            let arg = Op::ArgReduce {
                min: false,
                axis: -1,
                keepdims: true,
                select_last_index: false,
            };
            let p = self.val(n, &s("pivot_row"), arg, vec![cand]);
            let is_p = b(self, &s("is_p"), BinaryOp::Equal, &p, &rows);
            let ep = self.val(n, &s("e_p"), Op::CastLike, vec![is_p, x.clone()]);
            let ek: Vec<f32> = (0..m).map(|r| f32::from(u8::from(r == k))).collect();
            let ek = f(self, &s("e_k"), Tensor::from_vec(&[m], ek)?);
            let d = b(self, &s("d"), BinaryOp::Sub, &ek, &ep);
            let dc = self.val(n, &s("d_col"), unsqueeze(-1), vec![d.clone()]);
            let dr = self.val(n, &s("d_row"), unsqueeze(-2), vec![d]);
            let ddt = b(self, &s("ddt"), BinaryOp::Mul, &dc, &dr);
            let perm = b(self, &s("perm"), BinaryOp::Sub, &eye, &ddt);
            a = self.val(n, &s("swapped"), Op::MatMul, vec![perm, a]);
            let same = b(self, &s("same"), BinaryOp::Equal, &p, &kk);
            let flip = self.val(
                n,
                &s("flip"),
                Op::Where,
                vec![same, one.clone(), minus_one.clone()],
            );
            let flip = self.val(n, &s("flip1"), super::composite::squeeze(-1), vec![flip]);
            sign = b(self, &s("sign"), BinaryOp::Mul, &sign, &flip);
            let rowk = self.val(
                n,
                &s("row"),
                Op::Gather { axis: -2 },
                vec![a.clone(), kk.clone()],
            );
            let piv = self.val(
                n,
                &s("pivot"),
                Op::Gather { axis: -1 },
                vec![rowk.clone(), kk.clone()],
            );
            det = b(self, &s("det"), BinaryOp::Mul, &det, &piv);
            if k + 1 == m {
                break;
            }
            // Rows below k lose their multiple of row k.
            let is_zero = b(self, &s("zero_pivot"), BinaryOp::Equal, &piv, &zero);
            let safe = self.val(n, &s("safe"), Op::Where, vec![is_zero, one.clone(), piv]);
            let safe = self.val(n, &s("safe1"), unsqueeze(-1), vec![safe]);
            let colk = self.val(n, &s("col_k"), Op::Gather { axis: -1 }, vec![a.clone(), kk]);
            let after = ind(self, &s("after_k"), k + 1);
            let lower = b(self, &s("lower"), BinaryOp::Mul, &colk, &after);
            let fac = b(self, &s("factors"), BinaryOp::Div, &lower, &safe);
            let fc = self.val(n, &s("factors_col"), unsqueeze(-1), vec![fac]);
            let rr = self.val(n, &s("row_row"), unsqueeze(-2), vec![rowk]);
            let sub = b(self, &s("update"), BinaryOp::Mul, &fc, &rr);
            a = b(self, &s("eliminated"), BinaryOp::Sub, &a, &sub);
        }
        self.out(n, 0, bin(BinaryOp::Mul), vec![det, sign]);
        Ok(())
    }
}
