//! The opset-23 Attention forms graphrun's fused Attention does not take, written as its
//! definition in graphrun's ops: softcap (`softcap · tanh(S / softcap)` on the scaled
//! scores before the mask), the KV cache (past_key and past_value joined before the new
//! keys and values, and returned as present_key and present_value; the causal triangle
//! shifted by the past length; a mask shorter than the keys padded with -inf),
//! nonpad_kv_seqlen (each batch row's keys past its count masked), and the scores as a
//! fourth output (qk_matmul_output, at the point qk_matmul_output_mode names). Every
//! backend then runs it, autodiff differentiates it, and the attention fusion takes the
//! core back into one Attention where the form allows.

use super::composite::{bin, inputs, reshape, shape, un, unsqueeze, Attrs};
use super::Importer;
use crate::error::{Error, Result};
use crate::graph::op::Attr;
use crate::graph::{BinaryOp, Op, PadMode, UnaryOp};
use crate::onnx::proto::{GraphProto, NodeProto};
use crate::tensor::{DType, Tensor};

impl Importer<'_> {
    /// Whether an Attention node needs this lowering: a softcap, a KV-cache or
    /// nonpad_kv_seqlen input, or an output beyond Y.
    pub(super) fn attention_composite(n: &NodeProto, attrs: &[Attr]) -> bool {
        use crate::graph::op::AttrValue as V;
        let softcap = attrs.iter().any(|a| {
            a.name == "softcap"
                && (matches!(a.value, V::Float(x) if x != 0.0)
                    || matches!(a.value, V::Int(x) if x != 0))
        });
        softcap
            || n.input.iter().skip(4).any(|v| !v.is_empty())
            || n.output.iter().skip(1).any(|v| !v.is_empty())
    }

    /// Attention as ONNX defines it (`onnx.reference`'s op_attention): Q, K, V as `[B, H,
    /// S, D]` (3-D inputs `[B, S, H·D]` split by q_num_heads/kv_num_heads), past_key and
    /// past_value joined before K and V on the sequence axis (present_key and
    /// present_value), K and V heads repeated for grouped-query attention, scores
    /// `Q·Kᵀ·scale` capped, then the bias added: the mask (bool: -inf where false; float:
    /// added) padded with -inf to the keys' length, the causal triangle (query i sees key
    /// j iff j ≤ past + i) and the padding of nonpad_kv_seqlen; softmax, times V.
    pub(super) fn lower_attention_composite(
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
        let mode = a.int("qk_matmul_output_mode", 0)?;
        if !(0..=3).contains(&mode) {
            return Err(a.refuse(
                "qk_matmul_output_mode",
                &format!("must be 0 to 3, got {mode}"),
            ));
        }
        a.take("softmax_precision");
        a.finish()?;
        let (ins, opt) = inputs(n, &what, (3, 7), 4)?;
        let [q, k, v] = [0, 1, 2].map(|i| ins[i].clone());
        let [mask, past_k, past_v, nonpad] = [0, 1, 2, 3].map(|i| opt[i].clone());
        if past_k.is_some() != past_v.is_some() {
            return Err(Error::Graph(format!(
                "{what}: past_key and past_value come together"
            )));
        }
        let asked = |k: usize| n.output.get(k).is_some_and(|o| !o.is_empty());
        let rank = self.ranks.get(&q).copied();
        let three_d = match rank {
            Some(3) => true,
            Some(4) => false,
            _ => {
                return Err(Error::Graph(format!(
                    "{what}: Q must have a declared rank of 3 or 4"
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
        // The cache: past keys and values before the new ones; present_* are the joined.
        let past_len = past_k
            .as_ref()
            .map(|pk| self.val(n, "past_len", shape(2, Some(3)), vec![pk.clone()]));
        for (slot, x, past, tag) in [(1, &mut k4, &past_k, "key"), (2, &mut v4, &past_v, "value")] {
            let (op, ins) = match past {
                Some(p) => (Op::Concat { axis: 2 }, vec![p.clone(), x.clone()]),
                None if asked(slot) => (Op::Identity, vec![x.clone()]),
                None => continue,
            };
            if asked(slot) {
                self.out(n, slot, op, ins);
                *x = n.output[slot].clone();
            } else {
                *x = self.val(n, &format!("present_{tag}"), op, ins);
            }
        }
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
            k4 = self.repeat_heads(n, &k4, r, "k")?;
            v4 = self.repeat_heads(n, &v4, r, "v")?;
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
        let ninf = self.float_like(n, "ninf", f32::NEG_INFINITY, &q4);
        let (capped, ninf) = if softcap != 0.0 {
            let cap = self.float_like(n, "softcap", softcap, &q4);
            let div = self.val(
                n,
                "scores_over_cap",
                bin(BinaryOp::Div),
                vec![scaled, cap.clone()],
            );
            let th = self.val(n, "scores_tanh", un(UnaryOp::Tanh), vec![div]);
            let capped = self.val(n, "scores_capped", bin(BinaryOp::Mul), vec![th, cap]);
            (capped, ninf)
        } else {
            (scaled, ninf)
        };
        let mut s = capped.clone();
        let kv_len = self.val(n, "kv_len", shape(2, Some(3)), vec![k4.clone()]);
        if let Some(m) = mask {
            let mut bias = if self.dtypes.get(&m) == Some(&DType::Bool) {
                let zero = self.float_like(n, "mask_zero", 0.0, &q4);
                self.val(
                    n,
                    "mask_bias",
                    Op::Where,
                    vec![m.clone(), zero, ninf.clone()],
                )
            } else {
                m.clone()
            };
            // A mask shorter than the keys (the new ones only, say) is padded with -inf.
            let mr = self.ranks.get(&m).copied().unwrap_or(0);
            let (md, kd) = (self.static_dim(&m, mr.max(1) - 1), self.static_dim(&k, 2));
            if past_k.is_some() || md.is_none() || md != kd {
                if mr == 0 {
                    return Err(Error::Graph(format!(
                        "{what}: the mask must have a declared rank of 1 or more"
                    )));
                }
                let last = self.val(n, "mask_len", shape(-1, None), vec![bias.clone()]);
                let more = self.val(
                    n,
                    "mask_pad",
                    bin(BinaryOp::Sub),
                    vec![kv_len.clone(), last],
                );
                let zeros = self.ints_const(n, "mask_pads0", &vec![0; 2 * mr - 1])?;
                let pads = self.val(n, "mask_pads", Op::Concat { axis: 0 }, vec![zeros, more]);
                let op = Op::Pad {
                    mode: PadMode::Constant,
                };
                bias = self.val(n, "mask_padded", op, vec![bias, pads, ninf.clone()]);
            }
            s = self.val(n, "scores_masked", bin(BinaryOp::Add), vec![s, bias]);
        }
        if causal {
            let sq = self.val(n, "q_len", shape(2, Some(3)), vec![q4.clone()]);
            let ts = self.val(
                n,
                "causal_shape",
                Op::Concat { axis: 0 },
                vec![sq, kv_len.clone()],
            );
            let full = self.val(n, "causal_full", Op::Expand, vec![ninf.clone(), ts]);
            // Query i sees key j iff j ≤ past + i: the triangle above diagonal past + 1.
            let diag = match &past_len {
                Some(p) => {
                    let one = self.ints_const(n, "causal_one", &[1])?;
                    let d = self.val(n, "causal_diag", bin(BinaryOp::Add), vec![p.clone(), one]);
                    let scalar = self.ints_const(n, "causal_scalar", &[])?;
                    self.val(n, "causal_k", reshape(), vec![d, scalar])
                }
                None => self.constant(n, "causal_k", Tensor::scalar(1i64)),
            };
            let tri = self.val(
                n,
                "causal_bias",
                Op::Trilu { upper: true },
                vec![full, diag],
            );
            s = self.val(n, "scores_causal", bin(BinaryOp::Add), vec![s, tri]);
        }
        if let Some(len) = nonpad {
            // Key j of batch row b is padding when j ≥ nonpad_kv_seqlen[b].
            let scalar = self.ints_const(n, "kv_scalar", &[])?;
            let limit = self.val(n, "kv_limit", reshape(), vec![kv_len.clone(), scalar]);
            let zero = self.constant(n, "kv_start", Tensor::scalar(0i64));
            let step = self.constant(n, "kv_step", Tensor::scalar(1i64));
            let j = self.val(n, "kv_positions", Op::Range, vec![zero, limit, step]);
            let lens = self.val(n, "kv_counts", unsqueeze(1), vec![len]);
            let keep = self.val(n, "kv_keep", bin(BinaryOp::Less), vec![j, lens]);
            let fz = self.float_like(n, "kv_zero", 0.0, &q4);
            let pb = self.val(n, "kv_pad_bias", Op::Where, vec![keep, fz, ninf.clone()]);
            let axes = Op::Unsqueeze {
                axes: Some(vec![1, 2]),
            };
            let pb = self.val(n, "kv_pad_bias4", axes, vec![pb]);
            s = self.val(n, "scores_padded", bin(BinaryOp::Add), vec![s, pb]);
        }
        let p = self.val(n, "probs", Op::Softmax { axis: -1 }, vec![s.clone()]);
        if asked(3) {
            let at = match mode {
                0 | 1 => capped,
                2 => s,
                _ => p.clone(),
            };
            self.out(n, 3, Op::Identity, vec![at]);
        }
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

    /// `[B, Hkv, S, D]` with each head repeated `r` times in place, `[B, Hkv·r, S, D]`:
    /// grouped-query attention's keys and values for each query head.
    fn repeat_heads(&mut self, n: &NodeProto, x: &str, r: i64, tag: &str) -> Result<String> {
        let u = self.val(
            n,
            &format!("{tag}_group_axis"),
            unsqueeze(2),
            vec![x.into()],
        );
        let bh = self.val(n, &format!("{tag}_bh"), shape(0, Some(2)), vec![x.into()]);
        let rr = self.ints_const(n, &format!("{tag}_reps"), &[r])?;
        let sd = self.val(n, &format!("{tag}_sd"), shape(2, None), vec![x.into()]);
        let es = self.val(
            n,
            &format!("{tag}_expand_shape"),
            Op::Concat { axis: 0 },
            vec![bh, rr, sd.clone()],
        );
        let e = self.val(n, &format!("{tag}_repeated"), Op::Expand, vec![u, es]);
        let b = self.val(n, &format!("{tag}_b"), shape(0, Some(1)), vec![x.into()]);
        let m1 = self.ints_const(n, &format!("{tag}_all_heads"), &[-1])?;
        let rs = self.val(
            n,
            &format!("{tag}_merged_shape"),
            Op::Concat { axis: 0 },
            vec![b, m1, sd],
        );
        Ok(self.val(n, &format!("{tag}_grouped"), reshape(), vec![e, rs]))
    }

    /// ai.onnx.preview's FlexAttention as `onnx.reference` computes it: Q and K each
    /// multiplied by √scale in their own type (scale defaults to 1/√head size), K and V
    /// heads repeated for grouped-query attention, the scores `Q·Kᵀ` in the softmax's
    /// precision (`softmax_precision`; f32 for 16-bit inputs, else the input's), then
    /// `score_mod`, the softmax over the keys, `prob_mod` (each a one-input, one-output
    /// graph, written out here), times V in that precision, cast back to V's type.
    pub(super) fn flex_attention(
        &mut self,
        n: &NodeProto,
        what: &str,
        mut a: Attrs,
        mods: [Option<GraphProto>; 2],
    ) -> Result<()> {
        let scale = match a.take("scale") {
            None => None,
            Some(crate::graph::op::AttrValue::Float(s)) => Some(s as f32),
            Some(v) => return Err(a.wrong("scale", "a float", &v)),
        };
        let precision = a.opt_int("softmax_precision")?;
        a.finish()?;
        let (ins, _) = inputs(n, what, (3, 3), 3)?;
        let [q, k, v] = [0, 1, 2].map(|i| ins[i].clone());
        for x in [&q, &k, &v] {
            if self.ranks.get(x) != Some(&4) {
                return Err(Error::Graph(format!(
                    "{what}: '{x}' must have a declared rank of 4 ([batch, heads, sequence, head size])"
                )));
            }
        }
        let Some(dt) = self.dtypes.get(&q).copied() else {
            return Err(Error::Graph(format!(
                "{what}: the element type of Q '{q}' is not declared"
            )));
        };
        let compute = match precision {
            None if dt == DType::F64 => DType::F64,
            None => DType::F32,
            Some(c) => match DType::from_onnx(c) {
                Some(d @ (DType::F32 | DType::F16 | DType::BF16 | DType::F64)) => d,
                _ => {
                    return Err(a.refuse(
                        "softmax_precision",
                        &format!("must be FLOAT, FLOAT16, BFLOAT16 or DOUBLE, got {c}"),
                    ))
                }
            },
        };
        let (Some(hq), Some(hkv)) = (self.static_dim(&q, 1), self.static_dim(&k, 1)) else {
            return Err(Error::Graph(format!(
                "{what}: the head counts must be known (declare Q's and K's shapes)"
            )));
        };
        if hkv == 0 || hq % hkv != 0 {
            return Err(Error::Graph(format!(
                "{what}: {hq} query heads are not a multiple of {hkv} key/value heads"
            )));
        }
        let (mut k4, mut v4) = (k.clone(), v.clone());
        if hq != hkv {
            k4 = self.repeat_heads(n, &k4, hq / hkv, "k")?;
            v4 = self.repeat_heads(n, &v4, hq / hkv, "v")?;
        }
        // √scale as the reference takes it: the scale in f32, its root, in Q's type.
        let root = match (scale, self.static_dim(&q, 3)) {
            (Some(s), _) => Some(s.sqrt()),
            (None, Some(e)) => Some(((1.0 / (e as f64).sqrt()) as f32).sqrt()),
            (None, None) => None,
        };
        let root = match root {
            Some(r) => self.float_like(n, "sqrt_scale", r, &q),
            None => {
                let d = self.val(n, "head_size", shape(3, Some(4)), vec![q.clone()]);
                let df = self.val(n, "head_size_f", Op::Cast { to: DType::F32 }, vec![d]);
                let sq = self.val(n, "head_size_sqrt", un(UnaryOp::Sqrt), vec![df]);
                let inv = self.val(n, "scale_f", un(UnaryOp::Reciprocal), vec![sq]);
                let r = self.val(n, "sqrt_scale_f", un(UnaryOp::Sqrt), vec![inv]);
                self.val(n, "sqrt_scale", Op::CastLike, vec![r, q.clone()])
            }
        };
        let qs = self.val(n, "q_scaled", bin(BinaryOp::Mul), vec![q, root.clone()]);
        let ks = self.val(n, "k_scaled", bin(BinaryOp::Mul), vec![k4, root]);
        let perm = Some(vec![0, 1, 3, 2]);
        let kt = self.val(n, "k_t", Op::Transpose { perm }, vec![ks]);
        let mut s = self.val(n, "scores", Op::MatMul, vec![qs, kt]);
        let to = Op::Cast { to: compute };
        if compute != dt {
            s = self.val(n, "scores_precision", to.clone(), vec![s]);
        }
        let base = self.flow_name(n, what);
        let [score_mod, prob_mod] = mods;
        let modify = |me: &mut Self, x: String, g: Option<GraphProto>, tag: &str| {
            let Some(g) = g else { return Ok(x) };
            let outs = me.inline(what, &g, &[x], &format!("{base}/{tag}"))?;
            match <[String; 1]>::try_from(outs) {
                Ok([o]) => Ok(o),
                Err(o) => Err(Error::Graph(format!(
                    "{what}: its {tag} graph gives {} outputs; it must give one",
                    o.len()
                ))),
            }
        };
        s = modify(self, s, score_mod, "score_mod")?;
        let p = self.val(n, "probs", Op::Softmax { axis: -1 }, vec![s]);
        let p = modify(self, p, prob_mod, "prob_mod")?;
        let vc = match self.dtypes.get(&v4).copied().unwrap_or(dt) == compute {
            true => v4,
            false => self.val(n, "v_precision", to, vec![v4]),
        };
        let vt = self.dtypes.get(&v).copied().unwrap_or(dt);
        if vt == compute {
            self.out(n, 0, Op::MatMul, vec![p, vc]);
        } else {
            let y = self.val(n, "y_precision", Op::MatMul, vec![p, vc]);
            self.out(n, 0, Op::Cast { to: vt }, vec![y]);
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
