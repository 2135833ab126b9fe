//! Inference of the neural-network ops: matrix products (MatMul, Gemm, FusedMatMul),
//! LayerNormalization, SoftmaxCrossEntropyLoss, Dropout and the random draws.

use super::*;

pub(super) fn infer(cx: &Cx) -> Result<Vec<ValueType>> {
    let node = cx.node;
    let x = cx.x();
    match &node.op {
        Op::MatMul => {
            let b = cx.t(1).unwrap();
            cx.need_float(&x, "A")?;
            cx.same_dtype(&x, b)?;
            let Some(shape) = matmul_shape(&x.shape, &b.shape) else {
                return Err(cx.fail(format!(
                    "cannot multiply {} by {}",
                    fmt_shape(&x.shape),
                    fmt_shape(&b.shape)
                )));
            };
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Gemm {
            trans_a, trans_b, ..
        } => {
            let b = cx.t(1).unwrap();
            cx.need_float(&x, "A")?;
            cx.same_dtype(&x, b)?;
            if x.shape.len() != 2 || b.shape.len() != 2 {
                return Err(cx.fail("Gemm takes 2-D A and B".into()));
            }
            let (m, k) = if *trans_a {
                (x.shape[1], x.shape[0])
            } else {
                (x.shape[0], x.shape[1])
            };
            let (k2, n) = if *trans_b {
                (b.shape[1], b.shape[0])
            } else {
                (b.shape[0], b.shape[1])
            };
            if k != k2 {
                return Err(cx.fail(format!("inner dimensions differ: {k} and {k2}")));
            }
            if let Some(c) = cx.t(2) {
                cx.same_dtype(&x, c)?;
                if broadcast(&c.shape, &[m, n]).as_deref() != Some(&[m, n][..]) {
                    return Err(cx.fail(format!(
                        "C of shape {} does not broadcast to [{m}, {n}]",
                        fmt_shape(&c.shape)
                    )));
                }
            }
            one(ValueType {
                dtype: x.dtype,
                shape: vec![m, n],
            })
        }
        Op::LayerNormalization {
            axis,
            rms,
            residual,
            ..
        } => {
            cx.need_float(&x, "X")?;
            let r = x.shape.len();
            let Some(a) = norm_axis(*axis, r) else {
                return Err(cx.fail(format!("axis {axis} is out of range for rank {r}")));
            };
            let sum = residual.then(|| crate::graph::op::norm_sum_output(*rms));
            if *residual {
                let k = crate::graph::op::norm_residual_input(*rms);
                let Some(res) = cx.t(k) else {
                    return Err(cx.fail("the residual R is missing".to_string()));
                };
                if res.dtype != x.dtype || res.shape != x.shape {
                    return Err(cx.fail(format!(
                        "the residual R ({} {}) must have X's type and shape ({} {})",
                        res.dtype,
                        fmt_shape(&res.shape),
                        x.dtype,
                        fmt_shape(&x.shape)
                    )));
                }
            }
            let norm = &x.shape[a..];
            for i in 1..3 {
                if *rms && i == 2 {
                    break;
                }
                if let Some(s) = cx.t(i) {
                    cx.same_dtype(&x, s)?;
                    if broadcast(&s.shape, norm).as_deref() != Some(norm) {
                        return Err(cx.fail(format!(
                            "{} of shape {} does not broadcast to the normalized shape {}",
                            if i == 1 { "Scale" } else { "B" },
                            fmt_shape(&s.shape),
                            fmt_shape(norm)
                        )));
                    }
                }
            }
            let mut stat = x.shape.clone();
            for d in &mut stat[a..] {
                *d = 1;
            }
            let sd = stat_dtype(x.dtype);
            let mut out = vec![x.clone()];
            for k in 1..node.outputs.len() {
                out.push(match sum == Some(k) {
                    true => x.clone(),
                    false => ValueType {
                        dtype: sd,
                        shape: stat.clone(),
                    },
                });
            }
            Ok(out)
        }
        Op::Rotary { .. } => {
            cx.need_float(&x, "X")?;
            if x.shape.last().is_none_or(|d| d % 2 != 0) {
                return Err(cx.fail(format!(
                    "X's last dim must be even (it is rotated in pairs), got {}",
                    fmt_shape(&x.shape)
                )));
            }
            for (i, what) in [(1, "Cos"), (2, "Sin")] {
                let t = cx.t(i).unwrap();
                cx.same_dtype(&x, t)?;
                if broadcast(&t.shape, &x.shape).as_deref() != Some(&x.shape[..]) {
                    return Err(cx.fail(format!(
                        "{what} of shape {} does not broadcast to X's {}",
                        fmt_shape(&t.shape),
                        fmt_shape(&x.shape)
                    )));
                }
            }
            one(x)
        }
        Op::SoftmaxCrossEntropyLoss { reduction, .. } => {
            let labels = cx.t(1).unwrap();
            cx.need_float(&x, "scores")?;
            cx.need_int(labels, "labels")?;
            if x.shape.len() < 2 {
                return Err(cx.fail(format!(
                    "scores must be [N, C, ...], got {}",
                    fmt_shape(&x.shape)
                )));
            }
            let mut want: Vec<usize> = vec![x.shape[0]];
            want.extend_from_slice(&x.shape[2..]);
            if labels.shape != want {
                return Err(cx.fail(format!(
                    "labels must have shape {} for scores {}, got {}",
                    fmt_shape(&want),
                    fmt_shape(&x.shape),
                    fmt_shape(&labels.shape)
                )));
            }
            if let Some(w) = cx.t(2) {
                cx.same_dtype(&x, w)?;
                if w.shape != [x.shape[1]] {
                    return Err(cx.fail(format!(
                        "weights must have shape [{}], got {}",
                        x.shape[1],
                        fmt_shape(&w.shape)
                    )));
                }
            }
            let loss = match reduction {
                LossReduction::None => ValueType {
                    dtype: x.dtype,
                    shape: want,
                },
                _ => ValueType::new(x.dtype, &[]),
            };
            let mut out = vec![loss];
            if node.outputs.len() > 1 {
                out.push(x.clone());
            }
            Ok(out)
        }
        Op::Random { dtype, shape, .. } => {
            // The plain forms default to f32; the `Like` forms to their input's type.
            let (dtype, shape) = match shape {
                Some(s) => (dtype.unwrap_or(DType::F32), s.clone()),
                None => (dtype.unwrap_or(x.dtype), x.shape.clone()),
            };
            if !dtype.is_float() {
                return Err(cx.fail(format!(
                    "draws floats: the input is {dtype}, so attribute 'dtype' must name a float type"
                )));
            }
            one(ValueType { dtype, shape })
        }
        Op::Dropout { .. } => {
            cx.need_float(&x, "data")?;
            if let Some(r) = cx.t(1) {
                cx.need_float(r, "ratio")?;
                if r.numel() != 1 {
                    return Err(cx.fail(format!(
                        "ratio must be a scalar, got shape {}",
                        fmt_shape(&r.shape)
                    )));
                }
            }
            if let Some(m) = cx.t(2) {
                if m.dtype != DType::Bool || m.numel() != 1 {
                    return Err(cx.fail("training_mode must be a bool scalar".into()));
                }
            }
            let mut out = vec![x.clone()];
            if node.outputs.len() > 1 {
                out.push(ValueType {
                    dtype: DType::Bool,
                    shape: x.shape.clone(),
                });
            }
            Ok(out)
        }
        Op::GatedMatMul {
            activation,
            trans_b,
        } => {
            // Each product as a FusedMatMul with its bias; the two must agree.
            let (bg, bu) = (cx.t(1).unwrap(), cx.t(2).unwrap());
            if bg.shape != bu.shape {
                return Err(cx.fail(format!(
                    "the gate's and the up projection's weights differ: {} and {}",
                    fmt_shape(&bg.shape),
                    fmt_shape(&bu.shape)
                )));
            }
            let op = Op::FusedMatMul {
                activation: *activation,
                trans_b: *trans_b,
            };
            let mut y = vec![];
            for (w, bias) in [(1, 3), (2, 4)] {
                let ins = [cx.ins[0], cx.ins[w], cx.ins.get(bias).copied().flatten()];
                let consts = [None, None, None];
                y = cx.forward(op.clone(), &ins, &consts)?;
            }
            Ok(vec![y[0].clone(); node.outputs.len()])
        }
        Op::FusedMatMul { trans_b, .. } => {
            let b = cx.t(1).unwrap();
            cx.need_float(&x, "A")?;
            cx.same_dtype(&x, b)?;
            if b.shape.len() < 2 || x.shape.len() < 2 {
                return Err(
                    cx.fail("FusedMatMul takes A [..., M, K] and B [K, N] (or batched)".into())
                );
            }
            let mut bs = b.shape.clone();
            if *trans_b {
                let n = bs.len();
                bs.swap(n - 1, n - 2);
            }
            let Some(shape) = matmul_shape(&x.shape, &bs) else {
                return Err(cx.fail(format!(
                    "cannot multiply {} by {}{}",
                    fmt_shape(&x.shape),
                    fmt_shape(&b.shape),
                    if *trans_b { "ᵀ" } else { "" }
                )));
            };
            let n = *shape.last().unwrap();
            if let Some(bias) = cx.t(2) {
                cx.same_dtype(&x, bias)?;
                if bias.shape != [n] {
                    return Err(cx.fail(format!(
                        "bias must have shape [{n}], got {}",
                        fmt_shape(&bias.shape)
                    )));
                }
            }
            if let Some(res) = cx.t(3) {
                cx.same_dtype(&x, res)?;
                if broadcast(&res.shape, &shape).as_deref() != Some(&shape[..]) {
                    return Err(cx.fail(format!(
                        "residual of shape {} does not broadcast to {}",
                        fmt_shape(&res.shape),
                        fmt_shape(&shape)
                    )));
                }
            }
            let y = ValueType {
                dtype: x.dtype,
                shape,
            };
            Ok(vec![y; node.outputs.len()])
        }
        _ => unreachable!("{} is not inferred here", node.op.name()),
    }
}
