//! Row-wise family: Softmax/LogSoftmax, LayerNormalization, ReduceSum/Mean/Max/Prod,
//! ArgMax/ArgMin, TopK and SoftmaxCrossEntropyLoss. One pass per row, f32 (or f64)
//! accumulation.

use super::elementwise::{Bcast, Num};
use crate::backends::common;
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
    crate::bail!(
        Runtime,
        "CPU {what} kernel does not take dtype {}",
        x.dtype()
    )
}

/// Inference has checked the axis; an error rather than a panic if a caller has not.
fn checked_axis(axis: i64, x: &Tensor) -> Result<usize> {
    norm_axis(axis, x.shape().len()).ok_or_else(|| {
        crate::err!(
            Runtime,
            "axis {axis} is out of range for rank {}",
            x.shape().len()
        )
    })
}

/// Splits a shape around `axis` into (outer, n, inner).
fn around(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        numel(&shape[..axis]),
        shape[axis],
        numel(&shape[axis + 1..]),
    )
}

pub fn softmax(x: &Tensor, axis: i64, log: bool, out: &mut Tensor) -> Result<()> {
    let axis = checked_axis(axis, x)?;
    let (_, n, inner) = around(x.shape(), axis);
    with_float!(x.dtype(), T => softmax_t::<T>(x.as_slice(), n, inner, log, out.as_mut_slice()), _ => return not_float("Softmax", x));
    Ok(())
}

/// Softmax over the middle axis of `[outer, n, inner]` blocks. Each block keeps `inner`
/// running maxima and sums, so a non-last axis is still read row by row; exp(x - max)
/// is kept in scratch so each element costs one exp.
fn softmax_t<T: Float>(x: &[T], n: usize, inner: usize, log: bool, out: &mut [T]) {
    let block = n * inner;
    if block == 0 {
        return;
    }
    out.par_chunks_mut(block)
        .zip(x.par_chunks(block))
        .with_min_len(min_rows(block))
        .for_each_init(Vec::new, |scratch: &mut Vec<T::Acc>, (o, x)| {
            let block = SoftmaxBlock {
                x,
                inner,
                log,
                scratch,
                o,
            };
            super::simd::dispatch(block)
        });
}

/// [`softmax_block`]'s arguments, run as a [`Kernel`](super::simd::Kernel) (a closure
/// would not be inlined into the vectorised function).
struct SoftmaxBlock<'a, T: Float> {
    x: &'a [T],
    inner: usize,
    log: bool,
    scratch: &'a mut Vec<T::Acc>,
    o: &'a mut [T],
}
impl<T: Float> super::simd::Kernel for SoftmaxBlock<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        softmax_block(self.x, self.inner, self.log, self.scratch, self.o)
    }
}

/// [`softmax_t`] on one block of `n × inner` elements.
#[inline(always)]
fn softmax_block<T: Float>(
    x: &[T],
    inner: usize,
    log: bool,
    scratch: &mut Vec<T::Acc>,
    o: &mut [T],
) {
    if inner == 1 {
        return softmax_row(x, log, scratch, o);
    }
    scratch.clear();
    scratch.resize(2 * inner + x.len(), T::Acc::neg_infinity());
    let (m, rest) = scratch.split_at_mut(inner);
    let (s, e) = rest.split_at_mut(inner);
    for row in x.chunks(inner) {
        for (m, v) in m.iter_mut().zip(row) {
            *m = m.max(v.to_acc());
        }
    }
    s.fill(T::Acc::c(0.0));
    for (er, row) in e.chunks_mut(inner).zip(x.chunks(inner)) {
        for (((e, s), v), m) in er.iter_mut().zip(s.iter_mut()).zip(row).zip(&*m) {
            *e = (v.to_acc() - *m).exp_v();
            *s = *s + *e;
        }
    }
    if log {
        // log softmax = (x - max) - ln Σ exp(x - max). Subtracting max first keeps
        // x - max exact; max + ln Σ would round at the magnitude of x (1e4 in f32
        // loses ~1e-3).
        for s in s.iter_mut() {
            *s = s.ln();
        }
        for (o, x) in o.chunks_mut(inner).zip(x.chunks(inner)) {
            for (((o, v), m), l) in o.iter_mut().zip(x).zip(&*m).zip(&*s) {
                *o = T::from_acc((v.to_acc() - *m) - *l);
            }
        }
    } else {
        for s in s.iter_mut() {
            *s = s.recip();
        }
        for (o, e) in o.chunks_mut(inner).zip(e.chunks(inner)) {
            for ((o, e), r) in o.iter_mut().zip(e).zip(&*s) {
                *o = T::from_acc(*e * *r);
            }
        }
    }
}

/// Softmax of one contiguous row (the last-axis case), in plain loops that vectorise.
#[inline(always)]
fn softmax_row<T: Float>(x: &[T], log: bool, e: &mut Vec<T::Acc>, o: &mut [T]) {
    e.clear();
    e.extend(x.iter().map(|v| v.to_acc()));
    let m = fold_lanes(e, T::Acc::neg_infinity(), |a, b| a.max(b));
    e.iter_mut().for_each(|v| *v = (*v - m).exp_v());
    let s = fold_lanes(e, T::Acc::c(0.0), |a, b| a + b);
    if log {
        // (x - max) - ln Σ, not x - (max + ln Σ): see softmax_t.
        let l = s.ln();
        o.iter_mut()
            .zip(x)
            .for_each(|(o, v)| *o = T::from_acc((v.to_acc() - m) - l));
    } else {
        let r = s.recip();
        o.iter_mut()
            .zip(e.iter())
            .for_each(|(o, e)| *o = T::from_acc(*e * r));
    }
}

/// `outs` holds Y and optionally Mean and InvStdDev (with `rms`, only InvStdDev: the
/// rows are not centred); with a `residual` R the rows are S = X + R, written to the last
/// of `outs`.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm(
    x: &Tensor,
    scale: &Tensor,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
    axis: i64,
    eps: f32,
    rms: bool,
    outs: &mut [Tensor],
) -> Result<()> {
    let axis = checked_axis(axis, x)?;
    with_float!(x.dtype(), T => layer_norm_t::<T>(x, scale, bias, residual, axis, eps, rms, outs), _ => not_float("LayerNormalization", x))
}

/// `t` broadcast to the normalised shape, once rather than per row (LayerNorm's Scale, B).
fn expand<T: Float>(t: &Tensor, norm: &[usize]) -> Vec<T::Acc> {
    let n = numel(norm);
    let (src, mut v) = (t.as_slice::<T>(), Vec::with_capacity(n));
    let bc = Bcast::new(norm, [t.shape()]);
    let [st] = bc.inner();
    bc.walk(0, n, |_, len, [off]| {
        v.extend((0..len).map(|i| src[off + i * st].to_acc()))
    });
    v
}

#[allow(clippy::too_many_arguments)]
fn layer_norm_t<T: Float>(
    x: &Tensor,
    scale: &Tensor,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
    axis: usize,
    eps: f32,
    rms: bool,
    outs: &mut [Tensor],
) -> Result<()> {
    let norm = &x.shape()[axis..];
    let n = numel(norm);
    let g = expand::<T>(scale, norm);
    let b = bias.map(|b| expand::<T>(b, norm));
    let (n_acc, eps) = (T::Acc::c(n as f64), T::Acc::c(eps as f64));
    let (y, rest) = outs.split_at_mut(1);
    let (stats, sum) = match residual {
        Some(_) => rest.split_at_mut(rest.len() - 1),
        None => (rest, &mut [][..]),
    };
    let nan = T::Acc::nan();
    // One row: its (mean, 1/σ), Y written.
    let row = |y: &mut [T], x: &[T]| {
        // Two passes: the variance of centred values does not cancel catastrophically.
        let mean = match rms {
            true => T::Acc::c(0.0),
            false => x.iter().map(|v| v.to_acc()).sum::<T::Acc>() / n_acc,
        };
        let var = x
            .iter()
            .map(|v| (v.to_acc() - mean).powi(2))
            .sum::<T::Acc>()
            / n_acc;
        let inv = (var + eps).sqrt().recip();
        for (j, (y, v)) in y.iter_mut().zip(x).enumerate() {
            let z = (v.to_acc() - mean) * inv * g[j];
            *y = T::from_acc(match &b {
                Some(b) => z + b[j],
                None => z,
            });
        }
        (mean, inv)
    };
    let (ys, xs) = (y[0].as_mut_slice::<T>(), x.as_slice::<T>());
    // An empty normalised shape has no statistics (NaN) and Y is empty.
    let stats_rows: Vec<(T::Acc, T::Acc)> = match residual {
        _ if n == 0 => vec![(nan, nan); numel(&x.shape()[..axis])],
        // S is rounded to T before it is normalized, as the Add and the normalization
        // it replaces compute it.
        Some(r) => ys
            .par_chunks_mut(n)
            .zip(sum[0].as_mut_slice::<T>().par_chunks_mut(n))
            .zip(xs.par_chunks(n).zip(r.as_slice::<T>().par_chunks(n)))
            .with_min_len(min_rows(n))
            .map(|((y, s), (x, r))| {
                for ((s, x), r) in s.iter_mut().zip(x).zip(r) {
                    *s = T::from_acc(x.to_acc() + r.to_acc());
                }
                row(y, s)
            })
            .collect(),
        None => ys
            .par_chunks_mut(n)
            .zip(xs.par_chunks(n))
            .with_min_len(min_rows(n))
            .map(|(y, x)| row(y, x))
            .collect(),
    };
    // Mean and InvStdDev have the dtype inference gave them (f32, or f64 for f64 input).
    for (k, s) in stats.iter_mut().enumerate() {
        with_float!(s.dtype(), S => {
            for (o, st) in s.as_mut_slice::<S>().iter_mut().zip(&stats_rows) {
                let v = if k == 0 && !rms { st.0 } else { st.1 };
                *o = S::from_f64(v.to_f64().unwrap_or(f64::NAN));
            }
        }, _ => return not_float("LayerNormalization statistics", s));
    }
    Ok(())
}

/// `axes` are normalised and non-empty; `out` is shaped with or without kept dims.
pub fn reduce(kind: ReduceKind, x: &Tensor, axes: &[usize], out: &mut Tensor) -> Result<()> {
    with_num!(x.dtype(), T => match kind {
        ReduceKind::Max => reduce_t::<T, MAX>(kind, x, axes, out),
        ReduceKind::MeanSquare => reduce_t::<T, SQUARE>(kind, x, axes, out),
        ReduceKind::Prod => reduce_t::<T, PROD>(kind, x, axes, out),
        ReduceKind::Sum | ReduceKind::Mean => reduce_t::<T, SUM>(kind, x, axes, out),
    }, _ => crate::bail!(Runtime, "CPU reduce kernel does not take dtype {}", x.dtype()));
    Ok(())
}

/// `reduce_t`'s folds: a sum, a max, a sum of squares, a product.
const SUM: u8 = 0;
const MAX: u8 = 1;
const SQUARE: u8 = 2;
const PROD: u8 = 3;

/// Dims are merged into alternating kept/reduced runs (size-1 dims dropped). Outputs are
/// reduced in groups of `inner` (the last run when kept, else 1) so that every read is a
/// contiguous row or segment, walking the other reduced runs with an odometer. `FOLD`
/// picks the fold at compile time, keeping the inner loops branch-free.
fn reduce_t<T: Num, const FOLD: u8>(
    kind: ReduceKind,
    x: &Tensor,
    axes: &[usize],
    out: &mut Tensor,
) {
    let (xs, o) = (x.as_slice::<T>(), out.as_mut_slice::<T>());
    if o.is_empty() {
        return;
    }
    let mut runs: Vec<(usize, bool)> = vec![];
    for (d, &size) in x.shape().iter().enumerate() {
        let red = axes.contains(&d);
        match runs.last_mut() {
            _ if size == 1 => {}
            Some((s, r)) if *r == red => *s *= size,
            _ => runs.push((size, red)),
        }
    }
    let step = |a: T::A, v: T::A| match FOLD {
        MAX => T::max(a, v),
        SQUARE => T::add(a, T::mul(v, v)),
        PROD => T::mul(a, v),
        _ => T::add(a, v),
    };
    let init = match FOLD {
        MAX => T::lowest(),
        PROD => T::count(1),
        _ => T::zero(),
    };
    let n: usize = runs.iter().filter(|r| r.1).map(|r| r.0).product();
    // An empty reduction: a float mean is 0/0 = NaN, an integer one 0 (no division by 0).
    let count = T::count(if T::INT { n.max(1) } else { n });
    let finish = |a: T::A| {
        T::store(
            if matches!(kind, ReduceKind::Mean | ReduceKind::MeanSquare) {
                T::div(a, count)
            } else {
                a
            },
        )
    };

    // Partial results combine unsquared.
    let combine = |a: T::A, v: T::A| match FOLD {
        MAX => T::max(a, v),
        PROD => T::mul(a, v),
        _ => T::add(a, v),
    };
    // A contiguous run folded in blocks whose results combine in order: an f32 sum's
    // rounding error then grows with the number of blocks, not of elements (6,480 f32
    // losses summed one by one missed ONNX's weighted mean by 2e-5).
    let fold_run = |acc: T::A, run: &[T]| {
        run.chunks(64).fold(acc, |a, c| {
            combine(a, c.iter().fold(init, |b, v| step(b, v.load())))
        })
    };
    if runs.iter().all(|r| r.1) {
        // Everything reduced: fixed chunks combined in order, so parallel yet deterministic.
        let parts: Vec<T::A> = xs
            .par_chunks(GRAIN * 4)
            .map(|c| fold_run(init, c))
            .collect();
        o[0] = finish(parts.into_iter().fold(init, combine));
        return;
    }
    let mut stride = vec![0; runs.len()];
    let mut acc = 1;
    for i in (0..runs.len()).rev() {
        stride[i] = acc;
        acc *= runs[i].0;
    }
    let (last, rest) = runs.split_last().expect("a kept run exists");
    let (inner, seg) = if last.1 { (1, last.0) } else { (last.0, 1) };
    let pick = |red: bool| -> Vec<(usize, usize)> {
        rest.iter()
            .zip(&stride)
            .filter(|(r, _)| r.1 == red)
            .map(|(r, &st)| (r.0, st))
            .collect()
    };
    let (kept, odo) = (pick(false), pick(true));
    o.par_chunks_mut(inner)
        .enumerate()
        .with_min_len(min_rows(inner * n))
        .for_each_init(
            || (Vec::new(), Vec::new()),
            |(accs, idx): &mut (Vec<T::A>, Vec<usize>), (g, o)| {
                let (mut rem, mut off) = (g, 0);
                for &(s, st) in kept.iter().rev() {
                    off += (rem % s) * st;
                    rem /= s;
                }
                accs.clear();
                accs.resize(inner, init);
                idx.clear();
                idx.resize(odo.len(), 0);
                // Empty reduced dims (n = 0) leave the initial value.
                let mut more = n > 0;
                while more {
                    if inner > 1 {
                        for (a, v) in accs.iter_mut().zip(&xs[off..off + inner]) {
                            *a = step(*a, v.load());
                        }
                    } else {
                        accs[0] = fold_run(accs[0], &xs[off..off + seg]);
                    }
                    more = advance(idx, &odo, &mut off);
                }
                for (o, &a) in o.iter_mut().zip(accs.iter()) {
                    *o = finish(a);
                }
            },
        );
}

/// Steps a row-major multi-index over `dims` (size, stride), moving `off` with it; false
/// when it wraps back to the start.
fn advance(idx: &mut [usize], dims: &[(usize, usize)], off: &mut usize) -> bool {
    for d in (0..dims.len()).rev() {
        idx[d] += 1;
        *off += dims[d].1;
        if idx[d] < dims[d].0 {
            return true;
        }
        *off -= dims[d].0 * dims[d].1;
        idx[d] = 0;
    }
    false
}

/// Whether `v`, met after `best` along the line, takes its place as ArgMax's pick (ArgMin's
/// with `min`): NaN beats every number, as in numpy's argmax and argmin; of equal values
/// the first stays unless `last` (select_last_index).
#[allow(clippy::eq_op)]
fn beats<A: PartialOrd>(v: A, best: A, min: bool, last: bool) -> bool {
    let (v_nan, best_nan) = (v != v, best != best);
    if v_nan || best_nan {
        return v_nan && (last || !best_nan);
    }
    (if min { v < best } else { v > best }) || (last && v == best)
}

/// ArgMax (ArgMin with `min`) along `axis` into the i64 `out`, one line per output.
pub fn arg_reduce(
    node: &Node,
    x: &Tensor,
    axis: i64,
    min: bool,
    last: bool,
    out: &mut Tensor,
) -> Result<()> {
    let (_, d, inner) = common::line_dims(node, x.shape(), axis)?;
    let o = out.as_mut_slice::<i64>();
    if d == 0 && !o.is_empty() {
        crate::bail!(Runtime, "{}: the axis is empty", node.describe());
    }
    with_num!(x.dtype(), T => {
        let xs = x.as_slice::<T>();
        o.par_iter_mut()
            .enumerate()
            .with_min_len(min_rows(d))
            .for_each(|(l, o)| {
                let base = (l / inner) * d * inner + l % inner;
                let (mut best, mut at) = (xs[base].load(), 0);
                for s in 1..d {
                    let v = xs[base + s * inner].load();
                    if beats(v, best, min, last) {
                        (best, at) = (v, s);
                    }
                }
                *o = at as i64;
            });
        Ok(())
    }, _ => not_float(node.op.name(), x))
}

/// TopK's order: `Less` when `a` ranks before `b`, the larger first (the smaller without
/// `largest`), NaN above every number (the ONNX reference sorts ascending, NaN last, and
/// reads that backwards for the largest). Equal values are ordered by index by the caller.
#[allow(clippy::eq_op)]
fn rank<A: PartialOrd>(a: A, b: A, largest: bool) -> std::cmp::Ordering {
    use std::cmp::Ordering::*;
    let up = match (a != a, b != b) {
        (true, true) => Equal,
        (true, false) => Greater,
        (false, true) => Less,
        _ => a.partial_cmp(&b).unwrap_or(Equal),
    };
    if largest {
        up.reverse()
    } else {
        up
    }
}

/// TopK along `axis`: `outs` holds Values and, when the graph reads it, Indices (i64);
/// K is the size of Values along the axis (inference read it). Per line, a partial
/// selection of the first K in `rank` order (ties by index), then a sort of those K.
pub fn topk(node: &Node, x: &Tensor, axis: i64, largest: bool, outs: &mut [Tensor]) -> Result<()> {
    let (outer, d, inner) = common::line_dims(node, x.shape(), axis)?;
    let a = common::node_axis(node, axis, x.shape().len())?;
    let k = outs[0].shape()[a];
    let block = k * inner;
    if block == 0 || outer == 0 {
        return Ok(());
    }
    // Indices go to the output when there is one, else to scratch of Values' size.
    let mut scratch = vec![];
    let (vals, idx) = match outs {
        [v, i, ..] => (v, i.as_mut_slice::<i64>()),
        [v] => {
            scratch.try_reserve_exact(v.numel()).map_err(|_| {
                crate::err!(
                    Runtime,
                    "{}: out of memory for the indices",
                    node.describe()
                )
            })?;
            scratch.resize(v.numel(), 0i64);
            (v, &mut scratch[..])
        }
        [] => return Ok(()),
    };
    with_num!(x.dtype(), T => {
        let xs = x.as_slice::<T>();
        vals.as_mut_slice::<T>()
            .par_chunks_mut(block)
            .zip(idx.par_chunks_mut(block))
            .enumerate()
            .with_min_len(min_rows(d * inner))
            .for_each_init(Vec::new, |ord: &mut Vec<usize>, (o, (vo, io))| {
                for i in 0..inner {
                    let at = |s: usize| xs[(o * d + s) * inner + i].load();
                    let cmp = |p: &usize, q: &usize| rank(at(*p), at(*q), largest).then(p.cmp(q));
                    ord.clear();
                    ord.extend(0..d);
                    if k < d {
                        ord.select_nth_unstable_by(k - 1, cmp);
                        ord.truncate(k);
                    }
                    ord.sort_unstable_by(cmp);
                    for (j, &s) in ord.iter().enumerate() {
                        vo[j * inner + i] = xs[(o * d + s) * inner + i];
                        io[j * inner + i] = s as i64;
                    }
                }
            });
        Ok(())
    }, _ => not_float("TopK", x))
}

/// `outs` holds the loss and optionally log_prob.
pub fn softmax_cross_entropy(
    node: &Node,
    scores: &Tensor,
    labels: &Tensor,
    weights: Option<&Tensor>,
    reduction: LossReduction,
    ignore_index: Option<i64>,
    outs: &mut [Tensor],
) -> Result<()> {
    let labels = checked_labels(node, scores, labels, ignore_index)?;
    with_float!(scores.dtype(), T => sce_t::<T>(scores, &labels, weights, reduction, ignore_index, outs), _ => return not_float("SoftmaxCrossEntropyLoss", scores));
    Ok(())
}

/// The labels as i64, each a class of `scores` (axis 1) or `ignore_index`.
fn checked_labels(
    node: &Node,
    scores: &Tensor,
    labels: &Tensor,
    ignore_index: Option<i64>,
) -> Result<Vec<i64>> {
    let c = scores.shape()[1];
    let labels = labels.to_i64_vec();
    if let Some(&bad) = labels
        .iter()
        .find(|&&l| (l < 0 || l >= c as i64) && Some(l) != ignore_index)
    {
        crate::bail!(
            Runtime,
            "{}: label {bad} is out of range for {c} classes{}",
            node.describe(),
            ignore_index
                .map(|i| format!(" (ignore_index is {i})"))
                .unwrap_or_default()
        );
    }
    Ok(labels)
}

/// The weight of each element: 0 where ignored, else w[label] (1 without weights).
fn element_weights<T: Float>(
    labels: &[i64],
    weights: Option<&Tensor>,
    ignore_index: Option<i64>,
) -> Vec<T::Acc> {
    labels
        .iter()
        .map(|&l| match (Some(l) == ignore_index, weights) {
            (true, _) => T::Acc::c(0.0),
            (false, Some(w)) => w.as_slice::<T>()[l as usize].to_acc(),
            (false, None) => T::Acc::c(1.0),
        })
        .collect()
}

/// The log-sum-exp over classes of each of the `d` columns of one sample's `[C, d]` block
/// of scores, into `lse` (`sums` is scratch of the same length).
fn block_lse<T: Float>(xb: &[T], lse: &mut [T::Acc], sums: &mut [T::Acc]) {
    let d = lse.len();
    lse.fill(T::Acc::neg_infinity());
    sums.fill(T::Acc::c(0.0));
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
}

fn sce_t<T: Float>(
    scores: &Tensor,
    labels: &[i64],
    weights: Option<&Tensor>,
    reduction: LossReduction,
    ignore_index: Option<i64>,
    outs: &mut [Tensor],
) {
    let (n, c) = (scores.shape()[0], scores.shape()[1]);
    let d = numel(&scores.shape()[2..]);
    let x = scores.as_slice::<T>();
    let zero = T::Acc::c(0.0);
    let wts = element_weights::<T>(labels, weights, ignore_index);
    let mut loss = vec![zero; n * d];
    // One task per sample: its [C, d] block of log-probabilities, column by column.
    let body = |i: usize, loss: &mut [T::Acc], lp: Option<&mut [T]>, scratch: &mut Vec<T::Acc>| {
        let xb = &x[i * c * d..(i + 1) * c * d];
        scratch.clear();
        scratch.resize(2 * d, zero);
        let (lse, sums) = scratch.split_at_mut(d);
        block_lse(xb, lse, sums);
        for p in 0..d {
            let (l, w) = (labels[i * d + p], wts[i * d + p]);
            loss[p] = if w == zero {
                zero
            } else {
                -w * (xb[l as usize * d + p].to_acc() - lse[p])
            };
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
    if d > 0 && c > 0 {
        let rows = loss
            .par_chunks_mut(d)
            .enumerate()
            .with_min_len(min_rows(c * d));
        match lp.first_mut() {
            Some(lp) => rows
                .zip(lp.as_mut_slice::<T>().par_chunks_mut(c * d))
                .for_each_init(Vec::new, |s, ((i, l), lp)| body(i, l, Some(lp), s)),
            None => rows.for_each_init(Vec::new, |s, (i, l)| body(i, l, None, s)),
        }
    }
    let o = out[0].as_mut_slice::<T>();
    match reduction {
        LossReduction::None => o
            .iter_mut()
            .zip(&loss)
            .for_each(|(o, &l)| *o = T::from_acc(l)),
        LossReduction::Sum => o[0] = T::from_acc(block_sum(&loss)),
        // Σ w·loss / Σ w over non-ignored elements (0/0 = NaN when all are ignored, as ONNX).
        LossReduction::Mean => o[0] = T::from_acc(block_sum(&loss) / block_sum(&wts)),
    }
}

/// `f` folded over `v` in 16 interleaved lanes combined at the end, so that the loop
/// vectorises (one running value is a chain of dependent operations).
#[inline(always)]
fn fold_lanes<A: Copy>(v: &[A], init: A, f: impl Fn(A, A) -> A) -> A {
    let mut acc = [init; 16];
    let chunks = v.chunks_exact(16);
    let rest = chunks.remainder().iter().fold(init, |a, &b| f(a, b));
    for c in chunks {
        for (a, &b) in acc.iter_mut().zip(c) {
            *a = f(*a, b);
        }
    }
    acc.into_iter().fold(rest, &f)
}

/// A sum in blocks of 64 whose results add in order: the rounding error grows with the
/// number of blocks, not of terms (as `reduce_t`'s runs).
fn block_sum<A>(v: &[A]) -> A
where
    A: Copy + std::iter::Sum<A> + num_traits::Zero,
{
    v.chunks(64)
        .map(|c| c.iter().copied().sum::<A>())
        .fold(A::zero(), |a, b| a + b)
}

/// `dX` of Softmax (`log: false`) or LogSoftmax (`log: true`) from dY and the forward Y:
/// `y·(dy - Σ dy·y)`, or `dy - exp(y)·Σ dy`, the sums along `axis`.
pub fn softmax_grad(dy: &Tensor, y: &Tensor, axis: i64, log: bool, out: &mut Tensor) -> Result<()> {
    let axis = checked_axis(axis, y)?;
    let (_, n, inner) = around(y.shape(), axis);
    with_float!(y.dtype(), T => softmax_grad_t::<T>(dy.as_slice(), y.as_slice(), n, inner, log, out.as_mut_slice()), _ => return not_float("SoftmaxGrad", y));
    Ok(())
}

/// Over `[outer, n, inner]` blocks, like `softmax_t`: `inner` sums per block, read row by row.
fn softmax_grad_t<T: Float>(dy: &[T], y: &[T], n: usize, inner: usize, log: bool, out: &mut [T]) {
    let block = n * inner;
    if block == 0 {
        return;
    }
    out.par_chunks_mut(block)
        .zip(dy.par_chunks(block).zip(y.par_chunks(block)))
        .with_min_len(min_rows(block))
        .for_each_init(Vec::new, |s: &mut Vec<T::Acc>, (o, (dy, y))| {
            s.clear();
            s.resize(inner, T::Acc::c(0.0));
            for (dr, yr) in dy.chunks(inner).zip(y.chunks(inner)) {
                for ((s, d), y) in s.iter_mut().zip(dr).zip(yr) {
                    let d = d.to_acc();
                    *s = *s + if log { d } else { d * y.to_acc() };
                }
            }
            for ((or, dr), yr) in o
                .chunks_mut(inner)
                .zip(dy.chunks(inner))
                .zip(y.chunks(inner))
            {
                for (((o, d), y), &s) in or.iter_mut().zip(dr).zip(yr).zip(s.iter()) {
                    let (d, y) = (d.to_acc(), y.to_acc());
                    *o = T::from_acc(if log { d - y.exp() * s } else { y * (d - s) });
                }
            }
        });
}

/// LayerNormalization backward: outs = [dX, dScale, dB] (dScale, dB of the normalized
/// shape X.shape[axis..]); `want[i]` false means output i is not read. `res`, where
/// given, is added onto dX (a residual branch's gradient).
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_grad(
    dy: &Tensor,
    x: &Tensor,
    scale: &Tensor,
    mean: Option<&Tensor>,
    inv_std: &Tensor,
    res: Option<&Tensor>,
    axis: i64,
    want: &[bool],
    outs: &mut [Tensor],
) -> Result<()> {
    let axis = checked_axis(axis, x)?;
    let want = |i: usize| i < outs.len() && want.get(i).copied().unwrap_or(true);
    let want = [want(0), want(1), want(2)];
    with_float!(x.dtype(), T => layer_norm_grad_t::<T>(dy, x, scale, mean, inv_std, res, axis, want, outs), _ => not_float("LayerNormalizationGrad", x))
}

/// Per row, with xhat = (x - mean)·inv and g = dy·scale:
/// dx = inv·(g - mean(g) - xhat·mean(g·xhat)); dScale = Σ_rows dy·xhat, dB = Σ_rows dy.
/// Without `mean` (RMSNormalization) xhat = x·inv and dx = inv·(g - xhat·mean(g·xhat)).
#[allow(clippy::too_many_arguments)]
fn layer_norm_grad_t<T: Float>(
    dy: &Tensor,
    x: &Tensor,
    scale: &Tensor,
    mean: Option<&Tensor>,
    inv_std: &Tensor,
    res: Option<&Tensor>,
    axis: usize,
    want: [bool; 3],
    outs: &mut [Tensor],
) -> Result<()> {
    let res: Option<&[T]> = res.map(|r| r.as_slice::<T>());
    let norm = &x.shape()[axis..];
    let n = numel(norm);
    let g = expand::<T>(scale, norm);
    // The statistics are few (one per row): read once into the accumulation type.
    let stat = |t: &Tensor| -> Vec<T::Acc> { t.to_f64_vec().into_iter().map(T::Acc::c).collect() };
    let inv = stat(inv_std);
    let rms = mean.is_none();
    let mean = mean.map(stat);
    let n_acc = T::Acc::c(n as f64);
    let zero = T::Acc::c(0.0);
    let (dx, params) = outs.split_at_mut(1);
    if n == 0 || x.numel() == 0 {
        // No rows, or empty rows: dScale and dB are sums of nothing.
        for p in params.iter_mut() {
            p.as_mut_slice::<T>().fill(T::from_acc(zero));
        }
        return Ok(());
    }
    // Columns summed for dScale (first n) and dB (last n); none when neither is read.
    let width = if want[1] || want[2] { 2 * n } else { 0 };
    let rows = dx[0]
        .as_mut_slice::<T>()
        .par_chunks_mut(n)
        .zip(
            dy.as_slice::<T>()
                .par_chunks(n)
                .zip(x.as_slice::<T>().par_chunks(n)),
        )
        .enumerate();
    let sums = sum_rows(rows, n, width, |acc: &mut [T::Acc], (r, (dx, (dy, x)))| {
        let (m, inv) = (mean.as_ref().map_or(zero, |m| m[r]), inv[r]);
        let xhat = |j: usize| (x[j].to_acc() - m) * inv;
        if width > 0 {
            let (ds, db) = acc.split_at_mut(n);
            for j in 0..n {
                let d = dy[j].to_acc();
                ds[j] = ds[j] + d * xhat(j);
                db[j] = db[j] + d;
            }
        }
        if want[0] {
            let (mut sg, mut sgx) = (zero, zero);
            for j in 0..n {
                let gj = dy[j].to_acc() * g[j];
                sg = sg + gj;
                sgx = sgx + gj * xhat(j);
            }
            let mg = if rms { zero } else { sg / n_acc };
            let mgx = sgx / n_acc;
            let res = res.map(|s| &s[r * n..(r + 1) * n]);
            for (j, o) in dx.iter_mut().enumerate() {
                let v = inv * (dy[j].to_acc() * g[j] - mg - xhat(j) * mgx);
                *o = T::from_acc(match res {
                    Some(s) => v + s[j].to_acc(),
                    None => v,
                });
            }
        }
    });
    for (k, p) in params.iter_mut().enumerate() {
        if want[k + 1] {
            for (o, &v) in p.as_mut_slice::<T>().iter_mut().zip(&sums[k * n..]) {
                *o = T::from_acc(v);
            }
        }
    }
    Ok(())
}

/// Σ over rows (of `row_len` elements each) of what `add` contributes per row into `width`
/// accumulators. Rows are summed in fixed groups, in parallel, and the groups combined in
/// order: the result does not depend on how many threads ran. At most `SUM_GROUPS`
/// groups, so the partial sums stay small next to the rows.
pub(super) fn sum_rows<F: Real, I>(
    rows: I,
    row_len: usize,
    width: usize,
    add: impl Fn(&mut [F], I::Item) + Sync + Send,
) -> Vec<F>
where
    I: IndexedParallelIterator,
{
    const SUM_GROUPS: usize = 64;
    let group = min_rows(row_len).max(rows.len().div_ceil(SUM_GROUPS));
    rows.fold_chunks(
        group,
        || vec![F::zero(); width],
        |mut acc, row| {
            add(&mut acc, row);
            acc
        },
    )
    .collect::<Vec<_>>()
    .into_iter()
    .reduce(|mut a, b| {
        a.iter_mut().zip(b).for_each(|(a, b)| *a = *a + b);
        a
    })
    .unwrap_or_else(|| vec![F::zero(); width])
}

/// dScores of SoftmaxCrossEntropyLoss given dLoss (scalar, or [N, d1..] for reduction none):
/// `(softmax(scores) - onehot(label)) · w[label] · dloss / denom`, denom being the forward's
/// (Σ of the weights of non-ignored elements for mean, else 1).
#[allow(clippy::too_many_arguments)]
pub fn softmax_cross_entropy_grad(
    node: &Node,
    dloss: &Tensor,
    scores: &Tensor,
    labels: &Tensor,
    weights: Option<&Tensor>,
    reduction: LossReduction,
    ignore_index: Option<i64>,
    out: &mut Tensor,
) -> Result<()> {
    let labels = checked_labels(node, scores, labels, ignore_index)?;
    with_float!(scores.dtype(), T => sce_grad_t::<T>(dloss, scores, &labels, weights, reduction, ignore_index, out), _ => return not_float("SoftmaxCrossEntropyLossGrad", scores));
    Ok(())
}

fn sce_grad_t<T: Float>(
    dloss: &Tensor,
    scores: &Tensor,
    labels: &[i64],
    weights: Option<&Tensor>,
    reduction: LossReduction,
    ignore_index: Option<i64>,
    out: &mut Tensor,
) {
    let c = scores.shape()[1];
    let d = numel(&scores.shape()[2..]);
    let zero = T::Acc::c(0.0);
    let wts = element_weights::<T>(labels, weights, ignore_index);
    let dl = dloss.as_slice::<T>();
    // The factor of each element's loss in the reduced one: w · dloss / denom.
    let denom = match reduction {
        LossReduction::Mean => wts.iter().copied().sum::<T::Acc>(),
        _ => T::Acc::c(1.0),
    };
    let coef: Vec<T::Acc> = wts
        .iter()
        .enumerate()
        .map(|(e, &w)| {
            // Ignored (zero-weight) elements give 0 even when every element is ignored.
            if w == zero {
                return zero;
            }
            let g = match reduction {
                LossReduction::None => dl[e],
                _ => dl[0],
            };
            w * g.to_acc() / denom
        })
        .collect();
    let (x, block) = (scores.as_slice::<T>(), c * d);
    if block == 0 {
        return;
    }
    out.as_mut_slice::<T>()
        .par_chunks_mut(block)
        .zip(x.par_chunks(block))
        .enumerate()
        .with_min_len(min_rows(block))
        .for_each_init(Vec::new, |scratch: &mut Vec<T::Acc>, (i, (o, xb))| {
            scratch.clear();
            scratch.resize(2 * d, zero);
            let (lse, sums) = scratch.split_at_mut(d);
            block_lse(xb, lse, sums);
            let (labels, coef) = (&labels[i * d..(i + 1) * d], &coef[i * d..(i + 1) * d]);
            for (k, (or, xr)) in o.chunks_mut(d).zip(xb.chunks(d)).enumerate() {
                for p in 0..d {
                    let p_k = (xr[p].to_acc() - lse[p]).exp();
                    let hot = if labels[p] == k as i64 {
                        T::Acc::c(1.0)
                    } else {
                        zero
                    };
                    or[p] = T::from_acc((p_k - hot) * coef[p]);
                }
            }
        });
}
