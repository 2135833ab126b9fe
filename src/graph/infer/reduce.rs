//! Inference of the ops that reduce or scan along axes: reductions, ArgMax/ArgMin, TopK,
//! CumSum/CumProd and Softmax/LogSoftmax.

use super::*;

pub(super) fn infer(cx: &Cx) -> Result<Vec<ValueType>> {
    let node = cx.node;
    let x = cx.x();
    match &node.op {
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            cx.need_float(&x, "input")?;
            if norm_axis(*axis, x.shape.len()).is_none() {
                return Err(cx.fail(format!(
                    "axis {axis} is out of range for rank {}",
                    x.shape.len()
                )));
            }
            one(x)
        }
        Op::Reduce {
            kind,
            axes,
            keepdims,
            noop_with_empty_axes,
        } => {
            // ONNX defines all three on floats and ints (an int mean truncates); the
            // internal mean of squares only exists for floats.
            if x.dtype == DType::Bool
                || (*kind == crate::graph::ReduceKind::MeanSquare && !x.dtype.is_float())
            {
                return Err(cx.fail(format!("{} is not defined for {}", node.op.name(), x.dtype)));
            }
            let r = x.shape.len();
            let axes = match (axes.clone(), cx.known(1, "axes")?) {
                (Some(_), Some(_)) => {
                    return Err(cx.fail("axes given both as attribute and as input".into()))
                }
                (Some(a), None) | (None, Some(a)) => a.clone(),
                (None, None) => vec![],
            };
            if axes.is_empty() && *noop_with_empty_axes {
                return one(x);
            }
            let axes = if axes.is_empty() {
                (0..r).collect()
            } else {
                cx.axes_norm(&axes, r)?
            };
            let mut shape = vec![];
            for (i, &d) in x.shape.iter().enumerate() {
                if axes.contains(&i) {
                    // An empty axis is allowed: ONNX (opset 18) defines ReduceMax of
                    // nothing as the lowest value (-inf), as the kernels' identity gives.
                    if *keepdims {
                        shape.push(1);
                    }
                } else {
                    shape.push(d);
                }
            }
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Cumulative { .. } => {
            let axis = cx.t(1).unwrap();
            cx.need_int(axis, "axis")?;
            let name = node.op.name();
            if axis.numel() != 1 || x.dtype == DType::Bool {
                return Err(cx.fail(format!(
                    "{name} takes numbers and a one-element axis, got {} and axis {}",
                    x.dtype,
                    fmt_shape(&axis.shape)
                )));
            }
            if x.shape.is_empty() {
                return Err(cx.fail(format!("{name} needs rank 1 or more")));
            }
            one(x)
        }
        Op::ArgReduce { axis, keepdims, .. } => {
            if x.dtype == DType::Bool {
                return Err(cx.fail(format!("{} takes numbers, got bool", node.op.name())));
            }
            let r = x.shape.len();
            let Some(a) = norm_axis(*axis, r) else {
                return Err(cx.fail(format!("axis {axis} is out of range for rank {r}")));
            };
            // Nothing to pick from (the ONNX reference fails too), unless nothing is asked.
            let others: usize = (0..r).filter(|&d| d != a).map(|d| x.shape[d]).product();
            if x.shape[a] == 0 && others > 0 {
                return Err(cx.fail(format!(
                    "{} over axis {a} of size 0 has no element to pick",
                    node.op.name()
                )));
            }
            let mut shape = x.shape.clone();
            if *keepdims {
                shape[a] = 1;
            } else {
                shape.remove(a);
            }
            one(ValueType {
                dtype: DType::I64,
                shape,
            })
        }
        Op::TopK { axis, .. } => {
            if x.dtype == DType::Bool {
                return Err(cx.fail("TopK takes numbers, got bool".into()));
            }
            let r = x.shape.len();
            let Some(a) = norm_axis(*axis, r) else {
                return Err(cx.fail(format!("axis {axis} is out of range for rank {r}")));
            };
            let k = cx.known(1, "k")?.unwrap_or_default();
            let [k] = k[..] else {
                return Err(cx.fail(format!("k must hold one value, got {}", k.len())));
            };
            if k < 0 || k as usize > x.shape[a] {
                return Err(cx.fail(format!(
                    "k = {k} is not in [0, {}] (the size of axis {a})",
                    x.shape[a]
                )));
            }
            let mut shape = x.shape.clone();
            shape[a] = k as usize;
            Ok(vec![
                ValueType::new(x.dtype, &shape),
                ValueType::new(DType::I64, &shape),
            ])
        }
        _ => unreachable!("{} is not inferred here", node.op.name()),
    }
}
