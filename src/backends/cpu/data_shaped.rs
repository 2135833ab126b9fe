//! NonZero and Unique: ops whose outputs' shapes are decided by their input's values.
//! Inference runs these on the host when the plan is made (`infer::computed_at_plan_time`)
//! to learn the shapes, and the plan keeps the results as constants, so they are written
//! once here and no device kernel exists for them.

use crate::graph::infer::norm_axis;
use crate::graph::Op;
use crate::tensor::{fmt_shape, Elem, Tensor};
use std::cmp::Ordering;

/// The outputs of NonZero or Unique (all four of Unique's) for input `x`; the error says
/// what is wrong with the attributes.
pub fn eval(op: &Op, x: &Tensor) -> std::result::Result<Vec<Tensor>, String> {
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
        _ => Err(format!("{} is not computed at plan time", op.name())),
    }
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
