//! Inference of the indexing ops: Gather, GatherElements, GatherND, the scatters, and
//! NonZero and Unique, whose outputs' shapes are their results (computed on the host).

use super::*;

pub(super) fn infer(cx: &Cx) -> Result<Vec<ValueType>> {
    let (node, consts) = (cx.node, cx.consts);
    let x = cx.x();
    match &node.op {
        Op::NonZero | Op::Unique { .. } | Op::NonMaxSuppression { .. } => {
            // The outputs' shapes are the op's result itself: computed here from the
            // inputs' values, which must be known on the host.
            for &(k, what) in shape_inputs(&node.op) {
                let given = node.inputs.get(k).is_some_and(|v| !v.is_empty());
                if given && consts.get(k).copied().flatten().is_none() {
                    return Err(cx.fail(format!(
                        "{what} ('{}') must be known when the plan is made: its values decide the output's shape, so it must be computed from initializers, Constants, Shape and graph inputs fed when planning (at most {} elements), through small nodes evaluated on the host; here it depends on a value computed on the device (or one too large to evaluate on the host)",
                        node.inputs[k],
                        PLAN_INPUT_LIMIT
                    )));
                }
            }
            let outs = cx
                .ev
                .eval_data_shaped(&node.op, consts)
                .map_err(|m| cx.fail(m))?;
            Ok(outs
                .iter()
                .take(node.outputs.len())
                .map(|t| ValueType::new(t.dtype(), t.shape()))
                .collect())
        }
        Op::Gather { axis } => {
            let idx = cx.t(1).unwrap();
            cx.need_int(idx, "indices")?;
            let r = x.shape.len();
            let Some(a) = norm_axis(*axis, r) else {
                return Err(cx.fail(format!("axis {axis} is out of range for rank {r}")));
            };
            // Indices known when planning (Compress's, from NonZero) are checked here, so
            // every backend refuses an out-of-range one: device kernels cannot report it.
            if let Some(c) = consts.get(1).copied().flatten() {
                let d = x.shape[a] as i64;
                if let Some(i) = c.to_i64_vec().into_iter().find(|&i| i < -d || i >= d) {
                    return Err(cx.fail(format!(
                        "index {i} is out of range for axis {a} of size {d}"
                    )));
                }
            }
            let mut shape = x.shape[..a].to_vec();
            shape.extend_from_slice(&idx.shape);
            shape.extend_from_slice(&x.shape[a + 1..]);
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::GatherElements { axis } => {
            let idx = cx.t(1).unwrap();
            cx.need_int(idx, "indices")?;
            let r = x.shape.len();
            let Some(a) = norm_axis(*axis, r) else {
                return Err(cx.fail(format!("axis {axis} is out of range for rank {r}")));
            };
            let fits = idx.shape.len() == r && (0..r).all(|d| d == a || idx.shape[d] <= x.shape[d]);
            if !fits {
                return Err(cx.fail(format!(
                    "indices {} must have data's rank and fit in data {} off axis {a}",
                    fmt_shape(&idx.shape),
                    fmt_shape(&x.shape)
                )));
            }
            one(ValueType {
                dtype: x.dtype,
                shape: idx.shape.clone(),
            })
        }
        Op::GatherND { batch_dims: b } => {
            let idx = cx.t(1).unwrap();
            cx.need_int(idx, "indices")?;
            let (r, q) = (x.shape.len(), idx.shape.len());
            let k = idx.shape.last().copied().unwrap_or(0);
            let ok = q >= 1 && *b < q.min(r) && k <= r - b && idx.shape[..*b] == x.shape[..*b];
            if !ok {
                return Err(cx.fail(format!(
                    "indices {} do not index data {} with batch_dims {b} (indices' last dim at most rank - batch_dims, their batch dims data's)",
                    fmt_shape(&idx.shape),
                    fmt_shape(&x.shape)
                )));
            }
            let mut shape = idx.shape[..q - 1].to_vec();
            shape.extend_from_slice(&x.shape[b + k..]);
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::ScatterElements { .. } | Op::ScatterND { .. } => {
            let (idx, upd) = (cx.t(1).unwrap(), cx.t(2).unwrap());
            cx.same_dtype(&x, upd)?;
            // Updates land where the matching gather would read: that gather's output type.
            let gather = match &node.op {
                Op::ScatterElements { axis, .. } => Op::GatherElements { axis: *axis },
                _ => Op::GatherND { batch_dims: 0 },
            };
            let read = cx.forward(gather, &[Some(&x), Some(idx)], &[None, None])?;
            if read[0].shape != upd.shape {
                return Err(cx.fail(format!(
                    "updates {} must have the shape {} that indices {} pick from data {}",
                    fmt_shape(&upd.shape),
                    fmt_shape(&read[0].shape),
                    fmt_shape(&idx.shape),
                    fmt_shape(&x.shape)
                )));
            }
            one(x)
        }
        _ => unreachable!("{} is not inferred here", node.op.name()),
    }
}
