//! Attention's shapes: its problem sizes in either layout ONNX defines (`AttnDims`), the
//! packed QKV form (`qkv_parts`), and the inference of Attention and VarlenAttention.

use super::*;

/// Attention's problem sizes, from Q, K and V in either form ONNX opset 23 defines:
/// 4-D `Q [B, Hq, Sq, D]`, `K [B, Hkv, Skv, D]`, `V [B, Hkv, Skv, Dv]`, or 3-D with the
/// heads packed in the last axis, `Q [B, Sq, Hq·D]`, `K [B, Skv, Hkv·D]`,
/// `V [B, Skv, Hkv·Dv]`, whose head counts come from `q_num_heads` and `kv_num_heads`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    pub b: usize,
    pub hq: usize,
    pub hkv: usize,
    pub sq: usize,
    pub skv: usize,
    pub d: usize,
    pub dv: usize,
    /// The 3-D form: Q, K, V, Y (and their gradients) are `[B, S, H·D]`.
    pub packed: bool,
}

impl AttnDims {
    /// From the op's attributes and the three shapes; the error says what disagrees.
    pub fn new(
        op: &Op,
        q: &[usize],
        k: &[usize],
        v: &[usize],
    ) -> std::result::Result<AttnDims, String> {
        let (Op::Attention {
            q_num_heads: nq,
            kv_num_heads: nkv,
            ..
        }
        | Op::AttentionGrad {
            q_num_heads: nq,
            kv_num_heads: nkv,
            ..
        }) = *op
        else {
            return Err(format!("{} is not Attention", op.name()));
        };
        let dims = match (q.len(), k.len(), v.len()) {
            (4, 4, 4) => {
                let (b, hq, sq, d) = (q[0], q[1], q[2], q[3]);
                let (hkv, skv) = (k[1], k[2]);
                if k[0] != b || v[0] != b || k[3] != d || v[1] != hkv || v[2] != skv {
                    return Err(format!(
                        "Q {}, K {} and V {} disagree (batch, heads, sequence or head size)",
                        fmt_shape(q),
                        fmt_shape(k),
                        fmt_shape(v)
                    ));
                }
                for (name, want, got) in [("q_num_heads", nq, hq), ("kv_num_heads", nkv, hkv)] {
                    if want.is_some_and(|n| n != got) {
                        return Err(format!(
                            "attribute {name} is {}, but the 4-D inputs have {got} heads",
                            want.unwrap_or(0)
                        ));
                    }
                }
                AttnDims { b, hq, hkv, sq, skv, d, dv: v[3], packed: false }
            }
            (3, 3, 3) => {
                let (Some(hq), Some(hkv)) = (nq, nkv) else {
                    return Err(
                        "3-D Q [B, Sq, Hq·D], K and V [B, Skv, Hkv·D] need the attributes q_num_heads and kv_num_heads"
                            .into(),
                    );
                };
                let heads = |what: &str, hidden: usize, h: usize, attr: &str| {
                    if !hidden.is_multiple_of(h) {
                        Err(format!("{what}'s hidden size {hidden} is not divisible by {attr} {h}"))
                    } else {
                        Ok(hidden / h)
                    }
                };
                let d = heads("Q", q[2], hq, "q_num_heads")?;
                let dk = heads("K", k[2], hkv, "kv_num_heads")?;
                let dv = heads("V", v[2], hkv, "kv_num_heads")?;
                if dk != d {
                    return Err(format!(
                        "K's head size {dk} ({} / kv_num_heads {hkv}) differs from Q's {d} ({} / q_num_heads {hq})",
                        k[2], q[2]
                    ));
                }
                if k[0] != q[0] || v[0] != q[0] || v[1] != k[1] {
                    return Err(format!(
                        "Q {}, K {} and V {} disagree (batch or key sequence)",
                        fmt_shape(q),
                        fmt_shape(k),
                        fmt_shape(v)
                    ));
                }
                AttnDims { b: q[0], hq, hkv, sq: q[1], skv: k[1], d, dv, packed: true }
            }
            (a, b, c) => {
                return Err(format!(
                    "Attention takes Q, K and V all 4-D [B, H, S, D] or all 3-D [B, S, H·D]; got ranks {a}, {b} and {c}"
                ))
            }
        };
        if dims.hkv == 0 || dims.hq % dims.hkv != 0 {
            return Err(format!(
                "query heads {} must be a multiple of key/value heads {}",
                dims.hq, dims.hkv
            ));
        }
        Ok(dims)
    }
    /// Y's shape (dY's, and with `d` for `dv` Q's).
    pub fn y_shape(&self) -> Vec<usize> {
        if self.packed {
            vec![self.b, self.sq, self.hq * self.dv]
        } else {
            vec![self.b, self.hq, self.sq, self.dv]
        }
    }
    /// Where the head vectors of Q (and of Y, dY, dQ) lie: head vector (b, h, i) is row
    /// `b·s[0] + h·s[1] + i·s[2]` of the tensor seen as rows of its head size.
    pub fn q_rows(&self) -> [usize; 3] {
        Self::rows(self.hq, self.sq, self.packed)
    }
    /// The same for K, V, dK and dV, over (b, kv head, key).
    pub fn k_rows(&self) -> [usize; 3] {
        Self::rows(self.hkv, self.skv, self.packed)
    }
    fn rows(h: usize, s: usize, packed: bool) -> [usize; 3] {
        if packed {
            [s * h, 1, h]
        } else {
            [h * s, s, 1]
        }
    }
}

/// Attention's packed form, K and V omitted: Q, K and V lie one after the other on the
/// last axis of one `[B, S, (Hq + 2·Hkv)·D]` tensor (what rule `attention_qkv` makes of a
/// QKV projection split in three); its gradient is one tensor of that shape too. Returns
/// the parts' shapes `[B, S, H·D]` and their offsets (elements) in a row of the packed
/// tensor.
pub fn qkv_parts(op: &Op, qkv: &[usize]) -> std::result::Result<[(Vec<usize>, usize); 3], String> {
    let (Op::Attention {
        q_num_heads: Some(hq),
        kv_num_heads: Some(hkv),
        ..
    }
    | Op::AttentionGrad {
        q_num_heads: Some(hq),
        kv_num_heads: Some(hkv),
        ..
    }) = *op
    else {
        return Err(
            "packed QKV (K and V omitted) needs the attributes q_num_heads and kv_num_heads".into(),
        );
    };
    let &[b, s, w] = qkv else {
        return Err(format!(
            "packed QKV (K and V omitted) must be 3-D [B, S, (Hq + 2·Hkv)·D], got {}",
            fmt_shape(qkv)
        ));
    };
    let heads = hq + 2 * hkv;
    if heads == 0 || !w.is_multiple_of(heads) {
        return Err(format!(
            "packed QKV's last axis {w} is not (q_num_heads {hq} + 2 · kv_num_heads {hkv}) · D"
        ));
    }
    let d = w / heads;
    Ok([
        (vec![b, s, hq * d], 0),
        (vec![b, s, hkv * d], hq * d),
        (vec![b, s, hkv * d], (hq + hkv) * d),
    ])
}

/// Q, K and V of Attention (`at` 0) or AttentionGrad (`at` 1): the inputs, or the parts of
/// the packed first one when K and V are omitted (see [`qkv_parts`]).
pub(super) fn attn_qkv(
    op: &Op,
    ins: &[Option<&ValueType>],
    at: usize,
) -> std::result::Result<[ValueType; 3], String> {
    let t = |i: usize| ins.get(at + i).copied().flatten();
    let q = t(0).ok_or("Q is required")?;
    match (t(1), t(2)) {
        (Some(k), Some(v)) => Ok([q.clone(), k.clone(), v.clone()]),
        (None, None) => Ok(qkv_parts(op, &q.shape)?.map(|(s, _)| ValueType::new(q.dtype, &s))),
        _ => Err("K and V are given or omitted together (omitted: Q is the packed QKV)".into()),
    }
}

pub(super) fn infer(cx: &Cx) -> Result<Vec<ValueType>> {
    let (node, ins) = (cx.node, cx.ins);
    let x = cx.x();
    match &node.op {
        Op::Attention { .. } => {
            let [q, k, v] = attn_qkv(&node.op, ins, 0).map_err(|m| cx.fail(m))?;
            cx.need_float(&x, "Q")?;
            cx.same_dtype(&x, &k)?;
            cx.same_dtype(&x, &v)?;
            let a =
                AttnDims::new(&node.op, &q.shape, &k.shape, &v.shape).map_err(|m| cx.fail(m))?;
            if let Some(m) = cx.t(3) {
                if m.dtype != DType::Bool && m.dtype != x.dtype {
                    return Err(cx.fail(format!(
                        "attn_mask must be bool or {}, got {}",
                        x.dtype, m.dtype
                    )));
                }
                let full = [a.b, a.hq, a.sq, a.skv];
                if broadcast(&m.shape, &full).as_deref() != Some(&full[..]) {
                    return Err(cx.fail(format!(
                        "attn_mask of shape {} does not broadcast to {}",
                        fmt_shape(&m.shape),
                        fmt_shape(&full)
                    )));
                }
            }
            let mut out = vec![ValueType {
                dtype: x.dtype,
                shape: a.y_shape(),
            }];
            if node.outputs.len() > 1 {
                out.push(ValueType::new(stat_dtype(x.dtype), &[a.b, a.hq, a.sq]));
            }
            Ok(out)
        }
        Op::VarlenAttention { .. } => {
            let (k, v, cq, ck) = (
                cx.t(1).unwrap(),
                cx.t(2).unwrap(),
                cx.t(3).unwrap(),
                cx.t(4).unwrap(),
            );
            cx.need_float(&x, "Q")?;
            cx.same_dtype(&x, k)?;
            cx.same_dtype(&x, v)?;
            if x.shape.len() != 3 || k.shape.len() != 3 || v.shape.len() != 3 {
                return Err(
                    cx.fail("VarlenAttention takes Q [Tq, Hq, D], K and V [Tk, Hkv, D]".into())
                );
            }
            let (hq, d, hkv) = (x.shape[1], x.shape[2], k.shape[1]);
            if k.shape[2] != d || v.shape[0] != k.shape[0] || v.shape[1] != hkv {
                return Err(cx.fail("Q, K and V shapes disagree".into()));
            }
            if hkv == 0 || hq % hkv != 0 {
                return Err(cx.fail(format!(
                    "query heads {hq} must be a multiple of key/value heads {hkv}"
                )));
            }
            cx.need_int(cq, "cu_seqlens_q")?;
            cx.need_int(ck, "cu_seqlens_k")?;
            if cq.shape.len() != 1 || cq.shape != ck.shape || cq.shape[0] == 0 {
                return Err(cx.fail("cu_seqlens_q and cu_seqlens_k must both be [B+1]".into()));
            }
            let mut out = vec![ValueType {
                dtype: x.dtype,
                shape: vec![x.shape[0], hq, v.shape[2]],
            }];
            if node.outputs.len() > 1 {
                out.push(ValueType::new(stat_dtype(x.dtype), &[x.shape[0], hq]));
            }
            Ok(out)
        }
        _ => unreachable!("{} is not inferred here", node.op.name()),
    }
}
