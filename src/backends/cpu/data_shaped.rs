//! NonZero, Unique and NonMaxSuppression: ops whose outputs' shapes are decided by their
//! inputs' values. Inference runs these on the host when the plan is made
//! (`infer::computed_at_plan_time`) to learn the shapes, and the plan keeps the results as
//! constants, so they are written once here and no device kernel exists for them.

use crate::graph::infer::norm_axis;
use crate::graph::Op;
use crate::tensor::{fmt_shape, DType, Elem, Tensor};
use std::cmp::Ordering;

/// The outputs of NonZero, Unique (all four of Unique's) or NonMaxSuppression for inputs
/// `xs` (`None` where an optional one is omitted); the error says what is wrong with the
/// inputs or attributes.
pub fn eval(op: &Op, xs: &[Option<&Tensor>]) -> std::result::Result<Vec<Tensor>, String> {
    let x = xs
        .first()
        .copied()
        .flatten()
        .ok_or_else(|| format!("{} needs its first input", op.name()))?;
    match op {
        Op::NonZero => Ok(vec![nonzero(x)]),
        Op::Unique { sorted, axis } => {
            let axis = match axis {
                None => None,
                Some(a) => Some(norm_axis(*a, x.shape().len()).ok_or_else(|| {
                    format!(
                        "axis {a} is out of range for X of shape {}",
                        fmt_shape(x.shape())
                    )
                })?),
            };
            Ok(unique(x, *sorted, axis).to_vec())
        }
        Op::NonMaxSuppression { center_point_box } => {
            let arg = |k: usize| xs.get(k).copied().flatten();
            let scores = arg(1).ok_or("NonMaxSuppression needs scores (input 1)")?;
            Ok(vec![nms(
                x,
                scores,
                [arg(2), arg(3), arg(4)],
                *center_point_box,
            )?])
        }
        _ => Err(format!("{} is not computed at plan time", op.name())),
    }
}

/// NonMaxSuppression as ONNX's reference computes it: per batch and class, the boxes whose
/// score exceeds score_threshold (all of them without one), highest score first (the lower
/// index first among equal scores), each kept unless its IoU with a box kept before it
/// exceeds iou_threshold, until max_output_boxes_per_class are kept (none without it).
/// Areas and overlaps are computed in f64.
fn nms(
    boxes: &Tensor,
    scores: &Tensor,
    [max_out, iou, score_min]: [Option<&Tensor>; 3],
    center: bool,
) -> std::result::Result<Tensor, String> {
    let (bs, ss) = (boxes.shape(), scores.shape());
    if bs.len() != 3 || bs[2] != 4 || ss.len() != 3 || ss[0] != bs[0] || ss[2] != bs[1] {
        return Err(format!(
            "boxes must be [batches, boxes, 4] and scores [batches, classes, boxes], got {} and {}",
            fmt_shape(bs),
            fmt_shape(ss)
        ));
    }
    for (t, what) in [(boxes, "boxes"), (scores, "scores")] {
        if !t.dtype().is_float() {
            return Err(format!("{what} must be floating, got {}", t.dtype()));
        }
    }
    let scalar = |t: Option<&Tensor>, what: &str, int: bool| match t {
        None => Ok(None),
        Some(t) if t.numel() == 0 => Ok(None),
        Some(t) if t.numel() == 1 && t.dtype().is_int() == int && t.dtype() != DType::Bool => {
            Ok(Some(t.to_f64_vec()[0]))
        }
        Some(t) => Err(format!(
            "{what} must be one {} value, got {}{}",
            if int { "integer" } else { "floating" },
            t.dtype(),
            fmt_shape(t.shape())
        )),
    };
    let max_out = scalar(max_out, "max_output_boxes_per_class", true)?
        .unwrap_or(0.0)
        .max(0.0) as usize;
    let iou = scalar(iou, "iou_threshold", false)?.unwrap_or(0.0);
    let score_min = scalar(score_min, "score_threshold", false)?;
    let (b, c, n) = (ss[0], ss[1], ss[2]);
    let (bv, sv) = (boxes.to_f64_vec(), scores.to_f64_vec());
    // Each box as (x0, y0, x1, y1) with x0 <= x1 and y0 <= y1.
    let corners = |i: usize| -> [f64; 4] {
        let v = &bv[4 * i..4 * i + 4];
        if center {
            let (hw, hh) = (v[2] / 2.0, v[3] / 2.0);
            [v[0] - hw, v[1] - hh, v[0] + hw, v[1] + hh]
        } else {
            [
                v[1].min(v[3]),
                v[0].min(v[2]),
                v[1].max(v[3]),
                v[0].max(v[2]),
            ]
        }
    };
    let overlaps = |p: [f64; 4], q: [f64; 4]| {
        let (x0, x1) = (p[0].max(q[0]), p[2].min(q[2]));
        let (y0, y1) = (p[1].max(q[1]), p[3].min(q[3]));
        if x1 <= x0 || y1 <= y0 {
            return false;
        }
        let inter = (x1 - x0) * (y1 - y0);
        let area = |r: [f64; 4]| (r[2] - r[0]) * (r[3] - r[1]);
        let (a, bb) = (area(p), area(q));
        let union = a + bb - inter;
        a > 0.0 && bb > 0.0 && union > 0.0 && inter / union > iou
    };
    let mut rows: Vec<i64> = vec![];
    for batch in 0..b {
        for class in 0..c {
            let s = &sv[(batch * c + class) * n..][..n];
            let mut order: Vec<usize> = (0..n)
                .filter(|&i| score_min.is_none_or(|t| s[i] > t))
                .collect();
            order.sort_by(|&i, &j| {
                s[j].partial_cmp(&s[i])
                    .unwrap_or(Ordering::Equal)
                    .then(i.cmp(&j))
            });
            let mut kept: Vec<[f64; 4]> = vec![];
            for i in order {
                if kept.len() >= max_out {
                    break;
                }
                let r = corners(batch * n + i);
                if kept.iter().all(|&k| !overlaps(r, k)) {
                    kept.push(r);
                    rows.extend([batch as i64, class as i64, i as i64]);
                }
            }
        }
    }
    let k = rows.len() / 3;
    Tensor::from_vec(&[k, 3], rows).map_err(|e| e.to_string())
}

/// Compares two elements with NaN equal to NaN and above every number (numpy's unique
/// sorts NaNs last and keeps one), and -0 equal to 0.
fn total<T: Elem>(a: T, b: T) -> Ordering {
    let nan = |v: T| v.partial_cmp(&v).is_none();
    match a.partial_cmp(&b) {
        Some(o) => o,
        None => nan(a).cmp(&nan(b)),
    }
}

/// i64 `[rank, nnz]`: the coordinates of every non-zero element in row-major order
/// (column k holds the k-th one's index in each dim). A scalar is treated as rank 1, as
/// numpy's `nonzero` did for 0-d arrays.
fn nonzero(x: &Tensor) -> Tensor {
    let shape = if x.shape().is_empty() {
        vec![1]
    } else {
        x.shape().to_vec()
    };
    let hits: Vec<usize> = crate::with_any!(x.dtype(), T => {
        let zero = T::from_f64(0.0);
        x.as_slice::<T>()
            .iter()
            .enumerate()
            .filter(|(_, &v)| total(v, zero) != Ordering::Equal)
            .map(|(i, _)| i)
            .collect()
    });
    let (r, n) = (shape.len(), hits.len());
    let mut out = vec![0i64; r * n];
    for (k, &flat) in hits.iter().enumerate() {
        let mut rest = flat;
        for d in (0..r).rev() {
            out[d * n + k] = (rest % shape[d]) as i64;
            rest /= shape[d];
        }
    }
    Tensor::from_vec(&[r, n], out).expect("sized above")
}

/// Unique over elements (`axis` None: X flattened) or over the slices along `axis`:
/// `[Y, indices, inverse_indices, counts]` as ONNX defines them.
fn unique(x: &Tensor, sorted: bool, axis: Option<usize>) -> [Tensor; 4] {
    // X seen as [outer, len, inner]: slice k is x[o, k, i] over every (o, i), row-major.
    let (outer, len, inner) = match axis {
        None => (1, x.numel(), 1),
        Some(a) => {
            let s = x.shape();
            (s[..a].iter().product(), s[a], s[a + 1..].iter().product())
        }
    };
    let cmp_slices = |a: usize, b: usize| -> Ordering {
        crate::with_any!(x.dtype(), T => {
            let v = x.as_slice::<T>();
            (0..outer)
                .flat_map(|o| (0..inner).map(move |i| (o * len * inner, i)))
                .map(|(base, i)| total(v[base + a * inner + i], v[base + b * inner + i]))
                .find(|o| o.is_ne())
                .unwrap_or(Ordering::Equal)
        })
    };
    // Slices in ascending order; a stable sort keeps equal ones in their order, so each
    // group starts with its first occurrence.
    let mut order: Vec<usize> = (0..len).collect();
    order.sort_by(|&a, &b| cmp_slices(a, b));
    // Groups of equal slices: first occurrence and members, ascending.
    let mut groups: Vec<(usize, Vec<usize>)> = vec![];
    for &k in &order {
        match groups.last_mut() {
            Some((first, members)) if cmp_slices(*first, k).is_eq() => members.push(k),
            _ => groups.push((k, vec![k])),
        }
    }
    if !sorted {
        groups.sort_by_key(|(first, _)| *first);
    }
    let mut inverse = vec![0i64; len];
    for (g, (_, members)) in groups.iter().enumerate() {
        for &k in members {
            inverse[k] = g as i64;
        }
    }
    let u = groups.len();
    // Y: the first occurrence of each group, along the axis.
    let es = x.dtype().size();
    let mut y_bytes = Vec::with_capacity(outer * u * inner * es);
    for o in 0..outer {
        for (first, _) in &groups {
            let at = (o * len + first) * inner * es;
            y_bytes.extend_from_slice(&x.bytes()[at..at + inner * es]);
        }
    }
    let y_shape = match axis {
        None => vec![u],
        Some(a) => {
            let mut s = x.shape().to_vec();
            s[a] = u;
            s
        }
    };
    let ints = |v: Vec<i64>| Tensor::from_vec(&[v.len()], v).expect("1-D");
    [
        Tensor::from_bytes(x.dtype(), &y_shape, &y_bytes).expect("sized above"),
        ints(groups.iter().map(|(f, _)| *f as i64).collect()),
        ints(inverse),
        ints(groups.iter().map(|(_, m)| m.len() as i64).collect()),
    ]
}
