//! Inference of the gradient ops autodiff emits. Each is checked by its forward op's rules
//! (`Cx::forward`): dY must have the forward output's type (`Cx::need_grad`).

use super::*;

pub(super) fn infer(cx: &Cx) -> Result<Vec<ValueType>> {
    let (node, ins, consts) = (cx.node, cx.ins, cx.consts);
    let x = cx.x();
    match &node.op {
        Op::PadGrad { .. } => {
            cx.need_float(&x, "dY")?;
            let r = x.shape.len();
            let pads = cx.known(1, "pads")?.unwrap_or_default();
            let axes = cx.known(2, "axes")?;
            let pairs = pad_pairs(r, &pads, axes.as_deref()).map_err(|m| cx.fail(m))?;
            one(ValueType {
                dtype: x.dtype,
                shape: pad_shape(&x.shape, &pairs, -1).map_err(|m| cx.fail(m))?,
            })
        }
        Op::UnaryGrad(u) => {
            // dY and X: the types the forward op took and gave.
            let xt = cx.t(1).unwrap();
            cx.need_float(xt, "X")?;
            let fwd = cx.forward(Op::Unary(*u), &[Some(xt)], &[None])?;
            cx.need_grad(&x, &fwd[0])?;
            one(xt.clone())
        }
        Op::SoftmaxGrad { axis, log } => {
            let y = cx.t(1).unwrap();
            let op = if *log {
                Op::LogSoftmax { axis: *axis }
            } else {
                Op::Softmax { axis: *axis }
            };
            let fwd = cx.forward(op, &[Some(y)], &[None])?;
            cx.need_grad(&x, &fwd[0])?;
            one(y.clone())
        }
        Op::LayerNormalizationGrad { axis, rms } => {
            let (m, i, r) = crate::graph::op::norm_grad_inputs(*rms);
            let (xt, scale, inv) = (cx.t(1).unwrap(), cx.t(2).unwrap(), cx.t(i).unwrap());
            let mean = m.and_then(|m| cx.t(m));
            let op = Op::LayerNormalization {
                axis: *axis,
                epsilon: 1e-5,
                rms: *rms,
                residual: false,
            };
            let fwd = cx.forward(op, &[Some(xt), Some(scale)], &[None, None])?;
            cx.need_grad(&x, &fwd[0])?;
            let a = norm_axis(*axis, xt.shape.len()).unwrap();
            let mut stat = xt.shape.clone();
            for d in &mut stat[a..] {
                *d = 1;
            }
            let stats = mean
                .map(|m| (m, "Mean"))
                .into_iter()
                .chain([(inv, "InvStdDev")]);
            for (v, what) in stats {
                if v.shape != stat || v.dtype != stat_dtype(xt.dtype) {
                    return Err(cx.fail(format!(
                        "{what} must be {}{}, got {v}",
                        stat_dtype(xt.dtype),
                        fmt_shape(&stat)
                    )));
                }
            }
            // The last input (from the `ln_grad_residual` rule): a gradient added onto dX.
            if let Some(r) = cx.t(r).filter(|r| *r != xt) {
                return Err(cx.fail(format!("the residual gradient must be {xt}, got {r}")));
            }
            let p = ValueType::new(xt.dtype, &xt.shape[a..]);
            Ok(vec![xt.clone(), p.clone(), p][..node.outputs.len()].to_vec())
        }
        Op::GatedMatMulGrad { .. } => {
            // dY, G and U: one shape and dtype, that of each output.
            cx.need_float(&x, "dY")?;
            for i in [1, 2] {
                let v = cx.t(i).unwrap();
                if *v != x {
                    return Err(cx.fail(format!("dY, G and U must have one type; got {x} and {v}")));
                }
            }
            Ok(vec![x.clone(); node.outputs.len()])
        }
        Op::RotaryGrad { interleaved } => {
            // dY has X's type: the forward's checks on (dY, Cos, Sin).
            let op = Op::Rotary {
                interleaved: *interleaved,
            };
            cx.forward(op, ins, consts)?;
            one(x)
        }
        Op::SoftmaxCrossEntropyLossGrad {
            reduction,
            ignore_index,
        } => {
            let op = Op::SoftmaxCrossEntropyLoss {
                reduction: *reduction,
                ignore_index: *ignore_index,
            };
            let fwd = cx.forward(op, &ins[1..], &consts[1..])?;
            cx.need_grad(&x, &fwd[0])?;
            one(cx.t(1).unwrap().clone())
        }
        Op::GatherGrad { axis } => {
            let shape = cx.grad_shape(2)?;
            let data = ValueType::new(x.dtype, &shape);
            let fwd = cx.forward(
                Op::Gather { axis: *axis },
                &[Some(&data), cx.t(1)],
                &[None, None],
            )?;
            cx.need_grad(&x, &fwd[0])?;
            one(data)
        }
        Op::GatherElementsGrad { .. } | Op::GatherNDGrad { .. } => {
            let shape = cx.grad_shape(2)?;
            let data = ValueType::new(x.dtype, &shape);
            let fwd_op = node.op.grad_base().expect("a gradient op");
            let fwd = cx.forward(fwd_op, &[Some(&data), cx.t(1)], &[None, None])?;
            cx.need_grad(&x, &fwd[0])?;
            one(data)
        }
        Op::SliceGrad => {
            let shape = cx.grad_shape(1)?;
            let data = ValueType::new(x.dtype, &shape);
            let mut fins = vec![Some(&data)];
            fins.extend_from_slice(&ins[2..]);
            let mut fconsts = vec![None];
            fconsts.extend_from_slice(&consts[2..]);
            let fwd = cx.forward(Op::Slice, &fins, &fconsts)?;
            cx.need_grad(&x, &fwd[0])?;
            one(data)
        }
        Op::FusedMatMulGrad {
            activation,
            trans_b,
            a_activation,
        } => {
            let (a, b) = (cx.t(1).unwrap(), cx.t(2).unwrap());
            // PreA: the Pre at which dA's activation derivative is taken, A's type.
            match cx.t(4) {
                Some(p) if p != a => return Err(cx.fail(format!("PreA must be {a}, got {p}"))),
                None if *a_activation != Activation::None => {
                    return Err(cx.fail(format!(
                        "a_activation {} needs A's pre-activation (input 4)",
                        a_activation.name()
                    )))
                }
                Some(_) if *a_activation == Activation::None => {
                    return Err(cx.fail("PreA (input 4) needs an a_activation".into()))
                }
                _ => {}
            }
            let op = Op::FusedMatMul {
                activation: *activation,
                trans_b: *trans_b,
            };
            let fwd = cx.forward(op, &[Some(a), Some(b)], &[None, None])?;
            cx.need_grad(&x, &fwd[0])?;
            match cx.t(3) {
                Some(pre) if *pre != fwd[0] => {
                    return Err(cx.fail(format!("Pre must be {}, got {pre}", fwd[0])))
                }
                None if *activation != Activation::None => {
                    return Err(cx.fail(format!(
                        "activation {} needs the forward's pre-activation (input 3)",
                        activation.name()
                    )))
                }
                _ => {}
            }
            // dBiasA is dA's row sum: it needs dA.
            if node.outputs.get(3).is_some_and(|o| !o.is_empty()) && node.outputs[0].is_empty() {
                return Err(cx.fail("dBiasA (output 3) needs dA (output 0)".into()));
            }
            let n = *fwd[0].shape.last().unwrap();
            let k = *a.shape.last().unwrap();
            Ok(vec![
                a.clone(),
                b.clone(),
                ValueType::new(a.dtype, &[n]),
                ValueType::new(a.dtype, &[k]),
            ][..node.outputs.len()]
                .to_vec())
        }
        Op::AttentionGrad { .. } => {
            let [q, k, v] = attn_qkv(&node.op, ins, 1).map_err(|m| cx.fail(m))?;
            let op = node.op.grad_base().expect("AttentionGrad has a forward op");
            let fwd = cx.forward(op, &[cx.t(1), cx.t(2), cx.t(3), cx.t(6)], &[None; 4])?;
            cx.need_grad(&x, &fwd[0])?;
            let a =
                AttnDims::new(&node.op, &q.shape, &k.shape, &v.shape).map_err(|m| cx.fail(m))?;
            let (y, lse) = (cx.t(4).unwrap(), cx.t(5).unwrap());
            let want = [a.b, a.hq, a.sq];
            if *y != fwd[0] || lse.shape != want || lse.dtype != stat_dtype(q.dtype) {
                return Err(cx.fail(format!(
                    "Y and LSE must be {} and {}{}, got {y} and {lse}",
                    fwd[0],
                    stat_dtype(q.dtype),
                    fmt_shape(&want)
                )));
            }
            let full = ValueType::new(q.dtype, &[a.b, a.hq, a.sq, a.skv]);
            if cx.t(2).is_some() {
                if node.outputs.len() < 3 {
                    return Err(
                        cx.fail("has outputs dQ, dK, dV and optionally dMask: 3 or 4".into())
                    );
                }
                return Ok(vec![q, k, v, full][..node.outputs.len()].to_vec());
            }
            // Packed: dQKV is output 0; dK and dV are in it (their slots hold nothing).
            if node.outputs.iter().skip(1).take(2).any(|o| !o.is_empty()) {
                return Err(cx.fail(
                    "with packed QKV, dK and dV are part of dQKV (output 0): outputs 1 and 2 must be omitted".into(),
                ));
            }
            let none = ValueType::new(q.dtype, &[0]);
            let qkv = cx.t(1).unwrap().clone();
            Ok(vec![qkv, none.clone(), none, full][..node.outputs.len()].to_vec())
        }
        Op::VarlenAttentionGrad { is_causal, scale } => {
            let (q, k, v) = (cx.t(1).unwrap(), cx.t(2).unwrap(), cx.t(3).unwrap());
            let op = Op::VarlenAttention {
                is_causal: *is_causal,
                scale: *scale,
            };
            let fwd = cx.forward(op, &ins[1..6], &[None; 5])?;
            cx.need_grad(&x, &fwd[0])?;
            let (y, lse) = (cx.t(6).unwrap(), cx.t(7).unwrap());
            let want = [q.shape[0], q.shape[1]];
            if *y != fwd[0] || lse.shape != want || lse.dtype != stat_dtype(q.dtype) {
                return Err(cx.fail(format!(
                    "Y and LSE must be {} and {}{}, got {y} and {lse}",
                    fwd[0],
                    stat_dtype(q.dtype),
                    fmt_shape(&want)
                )));
            }
            Ok(vec![q.clone(), k.clone(), v.clone()])
        }
        _ => unreachable!("{} is not inferred here", node.op.name()),
    }
}

impl Cx<'_> {
    /// A gradient op's dY must have the type of the forward output.
    fn need_grad(&self, dy: &ValueType, y: &ValueType) -> Result<()> {
        if dy == y {
            Ok(())
        } else {
            Err(self.fail(format!(
                "dY must have the forward output's type {y}, got {dy}"
            )))
        }
    }

    /// A gradient op's target shape input (the forward input's `Shape`), known on the host.
    fn grad_shape(&self, i: usize) -> Result<Vec<usize>> {
        let (Some(t), Some(c)) = (self.ins[i], self.consts.get(i).copied().flatten()) else {
            return Err(self.fail(format!(
                "input {i} (the forward input's shape) must be known when the plan is made"
            )));
        };
        let v = c.to_i64_vec();
        if t.dtype != DType::I64 || t.shape.len() != 1 || v.iter().any(|&d| d < 0) {
            return Err(self.fail(format!(
                "input {i} must be a shape: a 1-D i64 tensor of sizes"
            )));
        }
        Ok(v.into_iter().map(|d| d as usize).collect())
    }
}
