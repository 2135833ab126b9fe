//! LinearAttention (opset 27): attention through a recurrent state instead of scores, as
//! gated linear attention and the (gated) delta rule compute it. Written as its
//! definition, unrolled one step per time step as the RNNs are (recurrent.rs): per KV head
//! a state S [d_k, d_v] (past_state, else zeros) decayed by exp(decay_t) (`gated`),
//! corrected by beta_t·(v_t − Sᵀk_t) in place of v_t (`delta`), then S += k_tᵀ·v_t, and the
//! output o_t = scale · q_t·S read by every query head of the KV head's group. Every
//! backend then runs it, and autodiff differentiates it through its parts.

use super::composite::{bin, inputs, reshape, un, Attrs};
use super::recurrent::MAX_STEPS;
use super::Importer;
use crate::error::{Error, Result};
use crate::graph::{BinaryOp, Op, UnaryOp};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};

pub(super) const LINEAR_ATTENTION: &str = "LinearAttention";

fn transpose(perm: &[usize]) -> Op {
    Op::Transpose {
        perm: Some(perm.to_vec()),
    }
}

impl Importer<'_> {
    pub(super) fn linear_attention(
        &mut self,
        n: &NodeProto,
        what: &str,
        mut a: Attrs,
    ) -> Result<()> {
        let rule = a.string("update_rule", "gated_delta")?;
        let (gated, delta) = match rule.as_str() {
            "linear" => (false, false),
            "gated" => (true, false),
            "delta" => (false, true),
            "gated_delta" => (true, true),
            _ => {
                return Err(a.refuse(
                    "update_rule",
                    &format!("must be linear, gated, delta or gated_delta, got '{rule}'"),
                ))
            }
        };
        let heads = |a: &mut Attrs, key: &str| match a.opt_int(key)? {
            Some(h) if h > 0 => Ok(h as usize),
            Some(h) => Err(a.refuse(key, &format!("must be positive, got {h}"))),
            None => Err(a.refuse(key, "is required")),
        };
        let hq = heads(&mut a, "q_num_heads")?;
        let hkv = heads(&mut a, "kv_num_heads")?;
        if hq % hkv != 0 {
            return Err(a.refuse(
                "q_num_heads",
                &format!("({hq}) must be a multiple of kv_num_heads ({hkv})"),
            ));
        }
        let scale = a.float("scale", 0.0)?;
        // A tuning hint of chunked kernels: the result does not depend on it.
        let _ = a.take("chunk_size");
        a.finish()?;
        let (req, opt) = inputs(n, what, (3, 6), 2)?;
        let [q, k, v] = [0, 1, 2].map(|i| req[i].clone());
        let (past, decay, beta) = (opt[0].clone(), opt[1].clone(), opt[2].clone());
        for (name, given, want) in [("decay", &decay, gated), ("beta", &beta, delta)] {
            if given.is_some() != want {
                return Err(Error::Graph(format!(
                    "{what}: update_rule '{rule}' {} input {name}",
                    if want { "needs" } else { "takes no" }
                )));
            }
        }
        let dims = |me: &Self, x: &str| me.dims.get(x).cloned().unwrap_or_default();
        for x in [&q, &k, &v] {
            if self.ranks.get(x).is_some_and(|&r| r != 3) {
                return Err(Error::Graph(format!(
                    "{what}: '{x}' must have rank 3 [batch, time, heads x head size]"
                )));
            }
        }
        let qd = dims(self, &q);
        let Some(steps) = qd.get(1).copied().flatten() else {
            return Err(Error::Graph(format!(
                "{what}: graphrun unrolls the recurrence, one step per time step, so it needs the sequence length (the second dim of query '{q}') when the model is loaded; give the shapes that will be fed when loading, or export with a fixed length"
            )));
        };
        if steps == 0 || steps > MAX_STEPS {
            return Err(Error::Graph(format!(
                "{what}: query '{q}' has {steps} time steps; graphrun unrolls the recurrence and takes 1 to {MAX_STEPS}"
            )));
        }
        let width = |me: &Self, x: &str| dims(me, x).get(2).copied().flatten();
        let dk = width(self, &k).map(|w| w / hkv);
        // The input type; the steps run in f32 (f16 and bf16 widened), as the reference.
        let dt = self.dtypes.get(&q).copied();
        let widen = !matches!(dt, Some(DType::F32 | DType::F64) | None);
        let cdt = if widen {
            DType::F32
        } else {
            dt.unwrap_or(DType::F32)
        };
        let f32_of = |me: &mut Self, name: &str, x: String| match widen {
            true => me.val(n, name, Op::Cast { to: DType::F32 }, vec![x]),
            false => x,
        };

        // [B, T, H·D] -> [B, H, T, D].
        let heads_first = |me: &mut Self, name: &str, x: &str, h: usize| -> Result<String> {
            let x = f32_of(me, &format!("{name}_f32"), x.to_string());
            let s = me.ints_const(n, &format!("{name}_split_shape"), &[0, 0, h as i64, -1])?;
            let x = me.val(n, &format!("{name}_split"), reshape(), vec![x, s]);
            Ok(me.val(
                n,
                &format!("{name}_heads"),
                transpose(&[0, 2, 1, 3]),
                vec![x],
            ))
        };
        let q4 = heads_first(self, "q", &q, hq)?;
        let k4 = heads_first(self, "k", &k, hkv)?;
        let v4 = heads_first(self, "v", &v, hkv)?;
        // exp(decay) as [B, Hkv, X, T] (X = d_k, or 1 per head): column t scales S's rows.
        let decay_cols = match &decay {
            None => None,
            Some(g) => {
                let last = width(self, g).ok_or_else(|| {
                    Error::Graph(format!("{what}: the last dim of decay '{g}' must be known when the model is loaded"))
                })?;
                if last != hkv && Some(last) != dk.map(|d| d * hkv) {
                    return Err(Error::Graph(format!(
                        "{what}: decay's last dim ({last}) must be kv_num_heads ({hkv}) or kv_num_heads x d_k"
                    )));
                }
                let g4 = heads_first(self, "decay", g, hkv)?;
                let e = self.val(n, "decay_exp", un(UnaryOp::Exp), vec![g4]);
                Some(self.val(n, "decay_cols", transpose(&[0, 1, 3, 2]), vec![e]))
            }
        };
        // beta as [B, Hkv or 1, T, 1].
        let beta4 = match &beta {
            None => None,
            Some(b) => {
                let last = width(self, b).filter(|&w| w == hkv || w == 1).ok_or_else(|| {
                    Error::Graph(format!("{what}: beta's last dim must be kv_num_heads ({hkv}) or 1, and known when the model is loaded"))
                })?;
                let b = f32_of(self, "beta_f32", b.clone());
                let s = self.ints_const(n, "beta_split_shape", &[0, 0, last as i64, 1])?;
                let b = self.val(n, "beta_split", reshape(), vec![b, s]);
                Some(self.val(n, "beta_heads", transpose(&[0, 2, 1, 3]), vec![b]))
            }
        };
        let mut state = match &past {
            Some(p) if self.dtypes.get(p).is_some_and(|&d| d != cdt) => {
                Some(self.val(n, "past_widened", Op::Cast { to: cdt }, vec![p.clone()]))
            }
            p => p.clone(),
        };
        let group = hq / hkv;
        let group_shape =
            self.ints_const(n, "q_group_shape", &[0, hkv as i64, group as i64, -1])?;
        let step_shape = self.ints_const(n, "o_step_shape", &[0, hq as i64, 1, -1])?;
        let mut outs = vec![];
        for t in 0..steps {
            let at = |me: &mut Self, name: &str, x: &str, axis: i64| -> Result<String> {
                let s = me.ints_const(n, &format!("{name}{t}_start"), &[t as i64])?;
                let e = me.ints_const(n, &format!("{name}{t}_end"), &[t as i64 + 1])?;
                let ax = me.ints_const(n, &format!("{name}{t}_axis"), &[axis])?;
                Ok(me.val(
                    n,
                    &format!("{name}{t}"),
                    Op::Slice,
                    vec![x.into(), s, e, ax],
                ))
            };
            // k_t, v_t [B, Hkv, 1, D]; k_tᵀ [B, Hkv, d_k, 1].
            let kt = at(self, "k", &k4, 2)?;
            let kt_col = self.val(
                n,
                &format!("k{t}_col"),
                transpose(&[0, 1, 3, 2]),
                vec![kt.clone()],
            );
            let mut vt = at(self, "v", &v4, 2)?;
            if let (Some(cols), Some(s)) = (&decay_cols, &state) {
                let g = at(self, "decay", cols, 3)?;
                state = Some(self.val(
                    n,
                    &format!("state{t}_decayed"),
                    bin(BinaryOp::Mul),
                    vec![s.clone(), g],
                ));
            }
            if let Some(b4) = &beta4 {
                if let Some(s) = &state {
                    let got = self.val(
                        n,
                        &format!("state{t}_read"),
                        Op::MatMul,
                        vec![kt.clone(), s.clone()],
                    );
                    vt = self.val(
                        n,
                        &format!("v{t}_residual"),
                        bin(BinaryOp::Sub),
                        vec![vt, got],
                    );
                }
                let bt = at(self, "beta", b4, 2)?;
                vt = self.val(
                    n,
                    &format!("v{t}_corrected"),
                    bin(BinaryOp::Mul),
                    vec![vt, bt],
                );
            }
            let write = self.val(n, &format!("state{t}_write"), Op::MatMul, vec![kt_col, vt]);
            state = Some(match state {
                Some(s) => self.val(n, &format!("state{t}"), bin(BinaryOp::Add), vec![s, write]),
                None => write,
            });
            // The group's query heads [B, Hkv, G, d_k] read their KV head's state.
            let qt = at(self, "q", &q4, 2)?;
            let qg = self.val(
                n,
                &format!("q{t}_groups"),
                reshape(),
                vec![qt, group_shape.clone()],
            );
            let s = state.clone().expect("written above");
            let o = self.val(n, &format!("o{t}_groups"), Op::MatMul, vec![qg, s]);
            outs.push(self.val(n, &format!("o{t}"), reshape(), vec![o, step_shape.clone()]));
        }
        // [B, Hq, T, d_v] -> [B, T, Hq·d_v], scaled, in the input's type.
        let o = match outs.len() {
            1 => outs.pop().expect("one step"),
            _ => self.val(n, "o_steps", Op::Concat { axis: 2 }, outs),
        };
        let o = self.val(n, "o_time_first", transpose(&[0, 2, 1, 3]), vec![o]);
        let flat = self.ints_const(n, "o_shape", &[0, 0, -1])?;
        let o = self.val(n, "o_flat", reshape(), vec![o, flat]);
        let scale = match scale {
            s if s != 0.0 => s as f64,
            _ => {
                let d = width(self, &q).map(|w| w / hq).ok_or_else(|| {
                    Error::Graph(format!("{what}: the last dim of query '{q}' must be known when the model is loaded (the default scale is 1/sqrt(d_k))"))
                })?;
                1.0 / (d as f64).sqrt()
            }
        };
        let sc = match cdt {
            DType::F64 => Tensor::scalar(scale),
            _ => Tensor::scalar(scale as f32),
        };
        let sc = self.constant(n, "scale", sc);
        match dt.filter(|_| widen) {
            Some(to) => {
                let y = self.val(n, "o_scaled", bin(BinaryOp::Mul), vec![o, sc]);
                self.out(n, 0, Op::Cast { to }, vec![y]);
            }
            None => self.out(n, 0, bin(BinaryOp::Mul), vec![o, sc]),
        }
        if n.output.get(1).is_some_and(|o| !o.is_empty()) {
            let s = state.expect("at least one step");
            // present_state in past_state's type, else the query's.
            let to = past
                .as_ref()
                .and_then(|p| self.dtypes.get(p).copied())
                .or(dt);
            match to.filter(|&d| d != cdt) {
                Some(to) => self.out(n, 1, Op::Cast { to }, vec![s]),
                None => self.out(n, 1, Op::Identity, vec![s]),
            }
        }
        Ok(())
    }
}
