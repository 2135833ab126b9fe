//! Inference of the ops that move data without computing: Reshape, Transpose, Concat,
//! Split, Slice, Squeeze, Unsqueeze, Flatten, Expand, Pad, and the generators Shape,
//! Constant and Range. Their shape-deciding inputs must be known on the host (`Cx::known`).

use super::*;

pub(super) fn infer(cx: &Cx) -> Result<Vec<ValueType>> {
    let (node, ins, consts) = (cx.node, cx.ins, cx.consts);
    let x = cx.x();
    match &node.op {
        Op::Range => {
            let mut v = [0.0; 3];
            for (i, what) in ["start", "limit", "delta"].into_iter().enumerate() {
                let ti = cx.t(i).unwrap();
                if ti.dtype != x.dtype || ti.dtype == DType::Bool {
                    return Err(cx.fail(format!(
                        "start, limit and delta must be numbers of one dtype, got {} {what}",
                        ti.dtype
                    )));
                }
                if ti.numel() != 1 {
                    return Err(cx.fail(format!(
                        "{what} must be a scalar, got shape {}",
                        fmt_shape(&ti.shape)
                    )));
                }
                let Some(c) = consts.get(i).copied().flatten() else {
                    return Err(cx.fail(format!(
                        "{what} (input '{}') must be known when the plan is made: it decides the output's length",
                        node.inputs[i]
                    )));
                };
                v[i] = c.to_f64_vec()[0];
            }
            let [start, limit, delta] = v;
            if delta == 0.0 || !delta.is_finite() || !start.is_finite() || !limit.is_finite() {
                return Err(cx.fail(format!(
                    "Range({start}, {limit}, {delta}) has no length: delta must be non-zero and every value finite"
                )));
            }
            let n = ((limit - start) / delta).ceil().max(0.0);
            if n > (1u64 << 48) as f64 {
                return Err(cx.fail(format!("Range({start}, {limit}, {delta}) has {n} elements")));
            }
            one(ValueType {
                dtype: x.dtype,
                shape: vec![n as usize],
            })
        }
        Op::Reshape { allowzero } => {
            let spec = cx.known(1, "shape")?.unwrap();
            let mut shape = vec![];
            let mut infer_at = None;
            for (i, &d) in spec.iter().enumerate() {
                match d {
                    -1 if infer_at.is_none() => {
                        infer_at = Some(i);
                        shape.push(1);
                    }
                    -1 => return Err(cx.fail(format!("shape {spec:?} has more than one -1"))),
                    0 if !allowzero => match x.shape.get(i) {
                        Some(&s) => shape.push(s),
                        None => return Err(cx.fail(format!("shape {spec:?}: 0 at position {i} copies an input dim that does not exist"))),
                    },
                    d if d < 0 => return Err(cx.fail(format!("shape {spec:?} has invalid dim {d}"))),
                    d => shape.push(d as usize),
                }
            }
            let total = x.numel();
            if let Some(i) = infer_at {
                let rest: usize = shape
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| *j != i)
                    .map(|(_, d)| *d)
                    .product();
                if rest == 0 || !total.is_multiple_of(rest) {
                    return Err(cx.fail(format!(
                        "cannot reshape {} ({} elements) to {spec:?}",
                        fmt_shape(&x.shape),
                        total
                    )));
                }
                shape[i] = total / rest;
            }
            if crate::tensor::checked_numel(&shape) != Some(total) {
                return Err(cx.fail(format!(
                    "cannot reshape {} ({} elements) to {spec:?}",
                    fmt_shape(&x.shape),
                    total
                )));
            }
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Transpose { perm } => {
            let r = x.shape.len();
            let perm: Vec<usize> = perm.clone().unwrap_or_else(|| (0..r).rev().collect());
            if perm.len() != r {
                return Err(cx.fail(format!(
                    "perm {perm:?} has {} entries for rank {r}",
                    perm.len()
                )));
            }
            one(ValueType {
                dtype: x.dtype,
                shape: perm.iter().map(|&p| x.shape[p]).collect(),
            })
        }
        Op::Concat { axis } => {
            let r = x.shape.len();
            let Some(a) = norm_axis(*axis, r) else {
                return Err(cx.fail(format!("axis {axis} is out of range for rank {r}")));
            };
            let mut shape = x.shape.clone();
            shape[a] = 0;
            for (i, v) in ins.iter().enumerate() {
                let Some(v) = v else {
                    return Err(cx.fail(format!("input {i} is omitted")));
                };
                cx.same_dtype(&x, v)?;
                let ok = v.shape.len() == r && (0..r).all(|d| d == a || v.shape[d] == x.shape[d]);
                if !ok {
                    return Err(cx.fail(format!(
                        "input {i} of shape {} does not match {} outside axis {a}",
                        fmt_shape(&v.shape),
                        fmt_shape(&x.shape)
                    )));
                }
                shape[a] += v.shape[a];
            }
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Split {
            axis,
            split,
            num_outputs,
        } => {
            let r = x.shape.len();
            let Some(a) = norm_axis(*axis, r) else {
                return Err(cx.fail(format!("axis {axis} is out of range for rank {r}")));
            };
            let d = x.shape[a];
            let n_out = node.outputs.len();
            let sizes: Vec<usize> = match (split.clone(), cx.known(1, "split")?) {
                (Some(_), Some(_)) => {
                    return Err(cx.fail("split given both as attribute and as input".into()))
                }
                (Some(s), None) | (None, Some(s)) => {
                    if s.iter().any(|&v| v < 0)
                        || s.iter().sum::<i64>() != d as i64
                        || s.len() != n_out
                    {
                        return Err(cx.fail(format!(
                            "split {s:?} must have {n_out} non-negative sizes summing to {d}"
                        )));
                    }
                    s.iter().map(|&v| v as usize).collect()
                }
                (None, None) => {
                    let n = num_outputs.unwrap_or(n_out);
                    if n != n_out {
                        return Err(cx.fail(format!(
                            "num_outputs is {n} but the node has {n_out} outputs"
                        )));
                    }
                    // ONNX: equal chunks of ceil(d/n), the last one smaller.
                    let chunk = d.div_ceil(n);
                    let sizes: Vec<usize> = (0..n)
                        .map(|i| chunk.min(d.saturating_sub(i * chunk)))
                        .collect();
                    if num_outputs.is_none() && !d.is_multiple_of(n) {
                        return Err(cx.fail(format!(
                            "axis {a} of size {d} does not split evenly into {n} outputs"
                        )));
                    }
                    sizes
                }
            };
            Ok(sizes
                .iter()
                .map(|&s| {
                    let mut sh = x.shape.clone();
                    sh[a] = s;
                    ValueType {
                        dtype: x.dtype,
                        shape: sh,
                    }
                })
                .collect())
        }
        Op::Slice => {
            let r = x.shape.len();
            let starts = cx.known(1, "starts")?.unwrap();
            let ends = cx.known(2, "ends")?.unwrap();
            let axes = cx
                .known(3, "axes")?
                .unwrap_or_else(|| (0..starts.len() as i64).collect());
            let steps = cx
                .known(4, "steps")?
                .unwrap_or_else(|| vec![1; starts.len()]);
            if ends.len() != starts.len()
                || axes.len() != starts.len()
                || steps.len() != starts.len()
            {
                return Err(
                    cx.fail("starts, ends, axes and steps must have the same length".into())
                );
            }
            let axes = cx.axes_norm(&axes, r)?;
            let mut shape = x.shape.clone();
            for (k, &a) in axes.iter().enumerate() {
                let (s, e) = slice_range(starts[k], ends[k], steps[k], x.shape[a])
                    .map_err(|m| cx.fail(m))?;
                // i128: hostile steps like i64::MIN must not overflow.
                let (s, e, st) = (s as i128, e as i128, steps[k] as i128);
                shape[a] = if st > 0 {
                    if e > s {
                        ((e - s + st - 1) / st) as usize
                    } else {
                        0
                    }
                } else if s > e {
                    ((s - e - st - 1) / (-st)) as usize
                } else {
                    0
                };
            }
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Squeeze { axes } => {
            let r = x.shape.len();
            let axes = match (axes.clone(), cx.known(1, "axes")?) {
                (Some(a), None) | (None, Some(a)) => Some(a.clone()),
                (None, None) => None,
                _ => return Err(cx.fail("axes given both as attribute and as input".into())),
            };
            let shape = match axes {
                None => x.shape.iter().copied().filter(|&d| d != 1).collect(),
                Some(a) => {
                    let a = cx.axes_norm(&a, r)?;
                    for &i in &a {
                        if x.shape[i] != 1 {
                            return Err(
                                cx.fail(format!("cannot squeeze axis {i} of size {}", x.shape[i]))
                            );
                        }
                    }
                    x.shape
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| !a.contains(i))
                        .map(|(_, &d)| d)
                        .collect()
                }
            };
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Unsqueeze { axes } => {
            let axes = match (axes.clone(), cx.known(1, "axes")?) {
                (Some(a), None) | (None, Some(a)) => a.clone(),
                (None, None) => {
                    return Err(cx.fail("Unsqueeze needs axes (attribute or input)".into()))
                }
                _ => return Err(cx.fail("axes given both as attribute and as input".into())),
            };
            let r = x.shape.len() + axes.len();
            let a = cx.axes_norm(&axes, r)?;
            let mut src = x.shape.iter();
            let shape = (0..r)
                .map(|i| {
                    if a.contains(&i) {
                        1
                    } else {
                        *src.next().unwrap()
                    }
                })
                .collect();
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Flatten { axis } => {
            let r = x.shape.len() as i64;
            let a = if *axis < 0 { axis + r } else { *axis };
            if a < 0 || a > r {
                return Err(cx.fail(format!("axis {axis} is out of range for rank {r}")));
            }
            let a = a as usize;
            let shape = vec![x.shape[..a].iter().product(), x.shape[a..].iter().product()];
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Expand => {
            let s = cx.known(1, "shape")?.unwrap();
            if s.iter().any(|&d| d < 0) {
                return Err(cx.fail(format!("shape {s:?} has a negative dim")));
            }
            let s: Vec<usize> = s.iter().map(|&d| d as usize).collect();
            let Some(shape) = broadcast(&x.shape, &s) else {
                return Err(cx.fail(format!(
                    "cannot expand {} to {}",
                    fmt_shape(&x.shape),
                    fmt_shape(&s)
                )));
            };
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Pad { mode } => {
            let r = x.shape.len();
            let pads = cx.known(1, "pads")?.unwrap_or_default();
            let axes = cx.known(3, "axes")?;
            let pairs = pad_pairs(r, &pads, axes.as_deref()).map_err(|m| cx.fail(m))?;
            if let Some(c) = cx.t(2) {
                cx.same_dtype(&x, c)?;
                if c.numel() != 1 {
                    return Err(cx.fail(format!(
                        "constant_value must have one element, got shape {}",
                        fmt_shape(&c.shape)
                    )));
                }
            }
            let shape = pad_shape(&x.shape, &pairs, 1).map_err(|m| cx.fail(m))?;
            if *mode != PadMode::Constant {
                if let Some(d) =
                    (0..r).find(|&d| pairs[d] != (0, 0) && pad_kept(x.shape[d], pairs[d]) == 0)
                {
                    return Err(cx.fail(format!(
                        "{} padding of axis {d} needs at least one element left, and it has none",
                        mode.name()
                    )));
                }
            }
            one(ValueType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Shape { start, end } => {
            let (s, e) = shape_range(*start, *end, x.shape.len());
            one(ValueType {
                dtype: DType::I64,
                shape: vec![e - s],
            })
        }
        Op::Constant { value } => one(ValueType::new(value.dtype(), value.shape())),
        _ => unreachable!("{} is not inferred here", node.op.name()),
    }
}
