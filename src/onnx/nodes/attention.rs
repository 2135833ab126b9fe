//! The opset-23 Attention forms graphrun's fused Attention does not take, written as its
//! definition in graphrun's ops: softcap (`softcap · tanh(S / softcap)` on the scaled
//! scores before the mask). Every backend then runs it and autodiff differentiates it.

use super::composite::{bin, inputs, reshape, shape, un, unsqueeze, Attrs};
use super::Importer;
use crate::error::{Error, Result};
use crate::graph::op::Attr;
use crate::graph::{BinaryOp, Op, UnaryOp};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};

impl Importer<'_> {
    /// Whether `attrs` ask for a softcap (a nonzero `softcap`).
    pub(super) fn attention_softcap(attrs: &[Attr]) -> bool {
        use crate::graph::op::AttrValue as V;
        attrs.iter().any(|a| {
            a.name == "softcap"
                && (matches!(a.value, V::Float(x) if x != 0.0)
                    || matches!(a.value, V::Int(x) if x != 0))
        })
    }

    /// Attention with a softcap, as ONNX defines it: Q, K, V as `[B, H, S, D]` (3-D inputs
    /// `[B, S, H·D]` split by q_num_heads/kv_num_heads), K and V heads repeated for
    /// grouped-query attention, scores `Q·Kᵀ·scale` capped, the mask (bool: -inf where
    /// false; float: added) and the causal triangle added, softmax, times V.
    pub(super) fn lower_attention_softcap(
        &mut self,
        n: &NodeProto,
        shown: &str,
        attrs: Vec<Attr>,
    ) -> Result<()> {
        let mut a = Attrs::of(n, shown, attrs)?;
        let what = a.what.clone();
        let causal = a.flag("is_causal")?;
        let scale = a.take("scale");
        let softcap = a.float("softcap", 0.0)?;
        let hq = a.opt_int("q_num_heads")?;
        let hkv = a.opt_int("kv_num_heads")?;
        if a.int("qk_matmul_output_mode", 0)? != 0 {
            return Err(a.refuse(
                "qk_matmul_output_mode",
                "must be 0 (the qk_matmul_output output is not supported)",
            ));
        }
        a.take("softmax_precision");
        a.finish()?;
        let (ins, opt) = inputs(n, &what, (3, 4), 1)?;
        let [q, k, v] = [0, 1, 2].map(|i| ins[i].clone());
        let rank = self.ranks.get(&q).copied();
        let three_d = match rank {
            Some(3) => true,
            Some(4) => false,
            _ => {
                return Err(Error::Graph(format!(
                    "{what}: with a softcap, Q must have a declared rank of 3 or 4"
                )))
            }
        };
        // [B, S, H·D] → [B, H, S, D].
        let heads = |me: &mut Self, x: &str, h: Option<i64>, tag: &str| -> Result<String> {
            let Some(h) = h else {
                return Err(Error::Graph(format!(
                    "{what}: 3-D inputs need the q_num_heads and kv_num_heads attributes"
                )));
            };
            let s = me.ints_const(n, &format!("{tag}_split"), &[0, 0, h, -1])?;
            let x4 = me.val(
                n,
                &format!("{tag}_heads"),
                reshape(),
                vec![x.to_string(), s],
            );
            let perm = Some(vec![0, 2, 1, 3]);
            Ok(me.val(n, &format!("{tag}_bhsd"), Op::Transpose { perm }, vec![x4]))
        };
        let (q4, mut k4, mut v4) = if three_d {
            (
                heads(self, &q, hq, "q")?,
                heads(self, &k, hkv, "k")?,
                heads(self, &v, hkv, "v")?,
            )
        } else {
            (q.clone(), k.clone(), v.clone())
        };
        // Grouped-query attention: each K/V head serves Hq / Hkv query heads.
        let hq_n = hq.or_else(|| self.static_dim(&q, 1));
        let hkv_n = hkv.or_else(|| self.static_dim(&k, 1));
        let (Some(hq_n), Some(hkv_n)) = (hq_n, hkv_n) else {
            return Err(Error::Graph(format!(
                "{what}: the head counts must be known (declare Q's and K's shapes)"
            )));
        };
        if hkv_n == 0 || hq_n % hkv_n != 0 {
            return Err(Error::Graph(format!(
                "{what}: {hq_n} query heads are not a multiple of {hkv_n} key/value heads"
            )));
        }
        if hq_n != hkv_n {
            let r = hq_n / hkv_n;
            for (x, tag) in [(&mut k4, "k"), (&mut v4, "v")] {
                let u = self.val(
                    n,
                    &format!("{tag}_group_axis"),
                    unsqueeze(2),
                    vec![x.clone()],
                );
                let bh = self.val(n, &format!("{tag}_bh"), shape(0, Some(2)), vec![x.clone()]);
                let rr = self.ints_const(n, &format!("{tag}_reps"), &[r])?;
                let sd = self.val(n, &format!("{tag}_sd"), shape(2, None), vec![x.clone()]);
                let es = self.val(
                    n,
                    &format!("{tag}_expand_shape"),
                    Op::Concat { axis: 0 },
                    vec![bh, rr, sd.clone()],
                );
                let e = self.val(n, &format!("{tag}_repeated"), Op::Expand, vec![u, es]);
                let b = self.val(n, &format!("{tag}_b"), shape(0, Some(1)), vec![x.clone()]);
                let m1 = self.ints_const(n, &format!("{tag}_all_heads"), &[-1])?;
                let rs = self.val(
                    n,
                    &format!("{tag}_merged_shape"),
                    Op::Concat { axis: 0 },
                    vec![b, m1, sd],
                );
                *x = self.val(n, &format!("{tag}_grouped"), reshape(), vec![e, rs]);
            }
        }
        let perm = Some(vec![0, 1, 3, 2]);
        let kt = self.val(n, "k_t", Op::Transpose { perm }, vec![k4.clone()]);
        let raw = self.val(n, "scores_raw", Op::MatMul, vec![q4.clone(), kt]);
        let scale = match scale {
            Some(crate::graph::op::AttrValue::Float(s)) => {
                self.float_like(n, "scale", s as f32, &q4)
            }
            Some(other) => {
                return Err(a.refuse("scale", &format!("must be a float, got {other:?}")))
            }
            None => {
                // 1 / sqrt(head size), the head size read from Q's shape.
                let d = self.val(n, "head_size", shape(3, Some(4)), vec![q4.clone()]);
                let df = self.val(n, "head_size_f", Op::Cast { to: DType::F32 }, vec![d]);
                let sq = self.val(n, "head_size_sqrt", un(UnaryOp::Sqrt), vec![df]);
                let inv = self.val(n, "scale_f", un(UnaryOp::Reciprocal), vec![sq]);
                self.val(n, "scale", Op::CastLike, vec![inv, q4.clone()])
            }
        };
        let scaled = self.val(n, "scores", bin(BinaryOp::Mul), vec![raw, scale]);
        let cap = self.float_like(n, "softcap", softcap, &q4);
        let div = self.val(
            n,
            "scores_over_cap",
            bin(BinaryOp::Div),
            vec![scaled, cap.clone()],
        );
        let th = self.val(n, "scores_tanh", un(UnaryOp::Tanh), vec![div]);
        let mut s = self.val(n, "scores_capped", bin(BinaryOp::Mul), vec![th, cap]);
        if let Some(m) = opt[0].clone() {
            let bias = if self.dtypes.get(&m) == Some(&DType::Bool) {
                let zero = self.float_like(n, "mask_zero", 0.0, &q4);
                let ninf = self.float_like(n, "mask_ninf", f32::NEG_INFINITY, &q4);
                self.val(n, "mask_bias", Op::Where, vec![m, zero, ninf])
            } else {
                m
            };
            s = self.val(n, "scores_masked", bin(BinaryOp::Add), vec![s, bias]);
        }
        if causal {
            let ninf = self.float_like(n, "causal_ninf", f32::NEG_INFINITY, &q4);
            let sq = self.val(n, "q_len", shape(2, Some(3)), vec![q4.clone()]);
            let sk = self.val(n, "kv_len", shape(2, Some(3)), vec![k4.clone()]);
            let ts = self.val(n, "causal_shape", Op::Concat { axis: 0 }, vec![sq, sk]);
            let full = self.val(n, "causal_full", Op::Expand, vec![ninf, ts]);
            let one = self.constant(n, "causal_k", Tensor::scalar(1i64));
            let tri = self.val(n, "causal_bias", Op::Trilu { upper: true }, vec![full, one]);
            s = self.val(n, "scores_causal", bin(BinaryOp::Add), vec![s, tri]);
        }
        let p = self.val(n, "probs", Op::Softmax { axis: -1 }, vec![s]);
        if three_d {
            let y4 = self.val(n, "y_bhsd", Op::MatMul, vec![p, v4]);
            let perm = Some(vec![0, 2, 1, 3]);
            let t = self.val(n, "y_bshd", Op::Transpose { perm }, vec![y4]);
            let m = self.ints_const(n, "y_merge", &[0, 0, -1])?;
            self.out(n, 0, reshape(), vec![t, m]);
        } else {
            self.out(n, 0, Op::MatMul, vec![p, v4]);
        }
        Ok(())
    }

    /// Dim `d` of value `v` when the model gives it.
    fn static_dim(&self, v: &str, d: usize) -> Option<i64> {
        self.dims
            .get(v)?
            .get(d)
            .copied()
            .flatten()
            .map(|x| x as i64)
    }
}
