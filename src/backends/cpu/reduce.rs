//! Row-wise family: Softmax/LogSoftmax, LayerNormalization, ReduceSum/Mean/Max, and
//! SoftmaxCrossEntropyLoss. One pass per row, f32 (or f64) accumulation.

use super::elementwise::{Bcast, Num};
use crate::error::Result;
use crate::graph::infer::norm_axis;
use crate::graph::op::LossReduction;
use crate::graph::{Node, ReduceKind};
use crate::tensor::{numel, Elem, Float, Real, Tensor};
use crate::{with_float, with_num};
use num_traits::{Float as _, ToPrimitive};
use rayon::prelude::*;

/// Rows are handed to rayon in batches of at least this many elements.
const GRAIN: usize = 1 << 12;

fn min_rows(row_len: usize) -> usize {
    (GRAIN / row_len.max(1)).max(1)
}

fn not_float(what: &str, x: &Tensor) -> Result<()> {
    crate::bail!(Runtime, "CPU {what} kernel does not take dtype {}", x.dtype())
}

/// Splits a shape around `axis` into (outer, n, inner).
fn around(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (numel(&shape[..axis]), shape[axis], numel(&shape[axis + 1..]))
}

pub fn softmax(x: &Tensor, axis: i64, log: bool, out: &mut Tensor) -> Result<()> {
    let axis = norm_axis(axis, x.shape().len()).expect("axis checked by inference");
    let (_, n, inner) = around(x.shape(), axis);
    with_float!(x.dtype(), T => softmax_t::<T>(x.as_slice(), n, inner, log, out.as_mut_slice()), _ => return not_float("Softmax", x));
    Ok(())
}

/// Softmax over the middle axis of `[outer, n, inner]` blocks. Each block keeps `inner`
/// running maxima and sums, so a non-last axis is still read row by row.
fn softmax_t<T: Float>(x: &[T], n: usize, inner: usize, log: bool, out: &mut [T]) {
    let block = n * inner;
    if block == 0 {
        return;
    }
    out.par_chunks_mut(block).zip(x.par_chunks(block)).with_min_len(min_rows(block)).for_each_init(
        Vec::new,
        |scratch: &mut Vec<T::Acc>, (o, x)| {
            scratch.clear();
            scratch.resize(2 * inner, T::Acc::neg_infinity());
            let (m, s) = scratch.split_at_mut(inner);
            for row in x.chunks(inner) {
                for (m, v) in m.iter_mut().zip(row) {
                    *m = m.max(v.to_acc());
                }
            }
            s.fill(T::Acc::c(0.0));
            for row in x.chunks(inner) {
                for ((s, v), m) in s.iter_mut().zip(row).zip(&*m) {
                    *s = *s + (v.to_acc() - *m).exp();
                }
            }
            if log {
                // log softmax = x - (max + ln Σ exp(x - max))
                for (m, s) in m.iter_mut().zip(&*s) {
                    *m = *m + s.ln();
                }
                for (o, x) in o.chunks_mut(inner).zip(x.chunks(inner)) {
                    for ((o, v), m) in o.iter_mut().zip(x).zip(&*m) {
                        *o = T::from_acc(v.to_acc() - *m);
                    }
                }
            } else {
                for s in s.iter_mut() {
                    *s = s.recip();
                }
                for (o, x) in o.chunks_mut(inner).zip(x.chunks(inner)) {
                    for (((o, v), m), r) in o.iter_mut().zip(x).zip(&*m).zip(&*s) {
                        *o = T::from_acc((v.to_acc() - *m).exp() * *r);
                    }
                }
            }
        },
    );
}

/// `outs` holds Y and optionally Mean and InvStdDev.
pub fn layer_norm(x: &Tensor, scale: &Tensor, bias: Option<&Tensor>, axis: i64, eps: f32, outs: &mut [Tensor]) -> Result<()> {
    let axis = norm_axis(axis, x.shape().len()).expect("axis checked by inference");
    with_float!(x.dtype(), T => layer_norm_t::<T>(x, scale, bias, axis, eps, outs), _ => not_float("LayerNormalization", x))
}

fn layer_norm_t<T: Float>(x: &Tensor, scale: &Tensor, bias: Option<&Tensor>, axis: usize, eps: f32, outs: &mut [Tensor]) -> Result<()> {
    let norm = &x.shape()[axis..];
    let n = numel(norm);
    if x.numel() == 0 {
        return Ok(());
    }
    // Scale and B are broadcast to the normalised shape once, not per row.
    let expand = |t: &Tensor| -> Vec<T::Acc> {
        let (src, mut v) = (t.as_slice::<T>(), Vec::with_capacity(n));
        let bc = Bcast::new(norm, [t.shape()]);
        let [st] = bc.inner();
        bc.walk(0, n, |_, len, [off]| v.extend((0..len).map(|i| src[off + i * st].to_acc())));
        v
    };
    let g = expand(scale);
    let b = bias.map(expand);
    let (n_acc, eps) = (T::Acc::c(n as f64), T::Acc::c(eps as f64));
    let (y, stats) = outs.split_at_mut(1);
    let stats_rows: Vec<(T::Acc, T::Acc)> = y[0]
        .as_mut_slice::<T>()
        .par_chunks_mut(n)
        .zip(x.as_slice::<T>().par_chunks(n))
        .with_min_len(min_rows(n))
        .map(|(y, x)| {
            // Two passes: the variance of centred values does not cancel catastrophically.
            let mean = x.iter().map(|v| v.to_acc()).sum::<T::Acc>() / n_acc;
            let var = x.iter().map(|v| (v.to_acc() - mean).powi(2)).sum::<T::Acc>() / n_acc;
            let inv = (var + eps).sqrt().recip();
            for (j, (y, v)) in y.iter_mut().zip(x).enumerate() {
                let z = (v.to_acc() - mean) * inv * g[j];
                *y = T::from_acc(match &b {
                    Some(b) => z + b[j],
                    None => z,
                });
            }
            (mean, inv)
        })
        .collect();
    // Mean and InvStdDev have the dtype inference gave them (f32, or f64 for f64 input).
    for (k, s) in stats.iter_mut().enumerate() {
        with_float!(s.dtype(), S => {
            for (o, st) in s.as_mut_slice::<S>().iter_mut().zip(&stats_rows) {
                let v = if k == 0 { st.0 } else { st.1 };
                *o = S::from_f64(v.to_f64().unwrap_or(f64::NAN));
            }
        }, _ => return not_float("LayerNormalization statistics", s));
    }
    Ok(())
}

/// `axes` are normalised and non-empty; `out` is shaped with or without kept dims.
pub fn reduce(kind: ReduceKind, x: &Tensor, axes: &[usize], out: &mut Tensor) -> Result<()> {
    with_num!(x.dtype(), T => reduce_t::<T>(kind, x, axes, out), _ => {
        crate::bail!(Runtime, "CPU reduce kernel does not take dtype {}", x.dtype())
    });
    Ok(())
}

/// Dims are merged into alternating kept/reduced runs. Each output element reduces over
/// a precomputed list of offsets; when the last dim is kept, `inner` consecutive outputs
/// are reduced together so every read is a contiguous row.
fn reduce_t<T: Num>(kind: ReduceKind, x: &Tensor, axes: &[usize], out: &mut Tensor) {
    // (size, reduced) runs, size-1 dims dropped.
    let mut runs: Vec<(usize, bool)> = vec![];
    for (d, &size) in x.shape().iter().enumerate() {
        let red = axes.contains(&d);
        match runs.last_mut() {
            _ if size == 1 => {}
            Some((s, r)) if *r == red => *s *= size,
            _ => runs.push((size, red)),
        }
    }
    let mut stride = vec![0; runs.len()];
    let mut acc = 1;
    for i in (0..runs.len()).rev() {
        stride[i] = acc;
        acc *= runs[i].0;
    }
    let inner = match runs.last() {
        Some(&(s, false)) => s,
        _ => 1,
    };
    let outer_kept: Vec<(usize, usize)> = runs
        .iter()
        .zip(&stride)
        .take(runs.len() - (inner > 1) as usize)
        .filter(|((_, r), _)| !r)
        .map(|(&(s, _), &st)| (s, st))
        .collect();
    // Offsets of every reduced position (row-major over the reduced runs).
    let mut roffs = vec![0usize];
    for ((s, red), &st) in runs.iter().zip(&stride) {
        if *red {
            roffs = roffs.iter().flat_map(|&o| (0..*s).map(move |i| o + i * st)).collect();
        }
    }
    // An empty reduction: a float mean is 0/0 = NaN, an integer one 0 (no division by 0).
    let count = T::count(if T::INT { roffs.len().max(1) } else { roffs.len() });
    let xs = x.as_slice::<T>();
    let init = if kind == ReduceKind::Max { T::lowest() } else { T::zero() };
    let o = out.as_mut_slice::<T>();
    if o.is_empty() {
        return;
    }
    o.par_chunks_mut(inner).enumerate().with_min_len(min_rows(inner * roffs.len())).for_each_init(
        Vec::new,
        |accs: &mut Vec<T::A>, (g, o)| {
            // Base offset of this output group over the kept outer runs.
            let (mut rem, mut base) = (g, 0);
            for &(s, st) in outer_kept.iter().rev() {
                base += (rem % s) * st;
                rem /= s;
            }
            accs.clear();
            accs.resize(inner, init);
            for &r in &roffs {
                let row = &xs[base + r..base + r + inner];
                match kind {
                    ReduceKind::Max => accs.iter_mut().zip(row).for_each(|(a, v)| *a = T::max(*a, v.load())),
                    _ => accs.iter_mut().zip(row).for_each(|(a, v)| *a = T::add(*a, v.load())),
                }
            }
            for (o, &a) in o.iter_mut().zip(accs.iter()) {
                *o = T::store(if kind == ReduceKind::Mean { T::div(a, count) } else { a });
            }
        },
    );
}

/// `outs` holds the loss and optionally log_prob.
pub fn softmax_cross_entropy(node: &Node, scores: &Tensor, labels: &Tensor, weights: Option<&Tensor>, reduction: LossReduction, ignore_index: Option<i64>, outs: &mut [Tensor]) -> Result<()> {
    let c = scores.shape()[1];
    let labels = labels.to_i64_vec();
    if let Some(&bad) = labels.iter().find(|&&l| (l < 0 || l >= c as i64) && Some(l) != ignore_index) {
        crate::bail!(Runtime, "{}: label {bad} is out of range for {c} classes{}", node.describe(),
            ignore_index.map(|i| format!(" (ignore_index is {i})")).unwrap_or_default());
    }
    with_float!(scores.dtype(), T => sce_t::<T>(scores, &labels, weights, reduction, ignore_index, outs), _ => return not_float("SoftmaxCrossEntropyLoss", scores));
    Ok(())
}

fn sce_t<T: Float>(scores: &Tensor, labels: &[i64], weights: Option<&Tensor>, reduction: LossReduction, ignore_index: Option<i64>, outs: &mut [Tensor]) {
    let (n, c) = (scores.shape()[0], scores.shape()[1]);
    let d = numel(&scores.shape()[2..]);
    let x = scores.as_slice::<T>();
    let zero = T::Acc::c(0.0);
    // The weight of each element: 0 where ignored, else w[label] (1 without weights).
    let wts: Vec<T::Acc> = labels
        .iter()
        .map(|&l| match (Some(l) == ignore_index, weights) {
            (true, _) => zero,
            (false, Some(w)) => w.as_slice::<T>()[l as usize].to_acc(),
            (false, None) => T::Acc::c(1.0),
        })
        .collect();
    let mut loss = vec![zero; n * d];
    // One task per sample: its [C, d] block of log-probabilities, column by column.
    let body = |i: usize, loss: &mut [T::Acc], lp: Option<&mut [T]>, scratch: &mut Vec<T::Acc>| {
        let xb = &x[i * c * d..(i + 1) * c * d];
        scratch.clear();
        scratch.resize(2 * d, zero);
        let (lse, sums) = scratch.split_at_mut(d);
        lse.fill(T::Acc::neg_infinity());
        for row in xb.chunks(d) {
            for (m, v) in lse.iter_mut().zip(row) {
                *m = m.max(v.to_acc());
            }
        }
        for row in xb.chunks(d) {
            for ((s, v), m) in sums.iter_mut().zip(row).zip(lse.iter()) {
                *s = *s + (v.to_acc() - *m).exp();
            }
        }
        // lse = max + ln Σ exp(x - max)
        for (m, s) in lse.iter_mut().zip(sums.iter()) {
            *m = *m + s.ln();
        }
        for p in 0..d {
            let (l, w) = (labels[i * d + p], wts[i * d + p]);
            loss[p] = if w == zero { zero } else { -w * (xb[l as usize * d + p].to_acc() - lse[p]) };
        }
        if let Some(lp) = lp {
            for (o, x) in lp.chunks_mut(d).zip(xb.chunks(d)) {
                for ((o, v), m) in o.iter_mut().zip(x).zip(lse.iter()) {
                    *o = T::from_acc(v.to_acc() - *m);
                }
            }
        }
    };
    let (out, lp) = outs.split_at_mut(1);
    if d > 0 {
        let rows = loss.par_chunks_mut(d).enumerate().with_min_len(min_rows(c * d));
        match lp.first_mut() {
            Some(lp) => rows
                .zip(lp.as_mut_slice::<T>().par_chunks_mut(c * d))
                .for_each_init(Vec::new, |s, ((i, l), lp)| body(i, l, Some(lp), s)),
            None => rows.for_each_init(Vec::new, |s, (i, l)| body(i, l, None, s)),
        }
    }
    let o = out[0].as_mut_slice::<T>();
    match reduction {
        LossReduction::None => o.iter_mut().zip(&loss).for_each(|(o, &l)| *o = T::from_acc(l)),
        LossReduction::Sum => o[0] = T::from_acc(loss.iter().copied().sum()),
        // Σ w·loss / Σ w over non-ignored elements (0/0 = NaN when all are ignored, as ONNX).
        LossReduction::Mean => o[0] = T::from_acc(loss.iter().copied().sum::<T::Acc>() / wts.iter().copied().sum::<T::Acc>()),
    }
}
