//! Data-movement family: Transpose, Concat, Split, Slice, Expand, Gather, Shape. These
//! move bytes, so each is written once over element size rather than per dtype.
//!
//! Transpose, Slice and Expand are one strided copy: each output element reads the input
//! at `base + Σ index·stride`, with permuted strides (Transpose), scaled strides and a
//! start offset (Slice, negative steps included) or zero strides (Expand).

use crate::backends::common;
use crate::error::Result;
use crate::graph::infer::shape_range;
use crate::graph::{Node, ScatterReduction};
use crate::tensor::{numel, Float, Int, Tensor};
use bytemuck::Pod;
use num_traits::Zero;
use rayon::prelude::*;

/// Outputs at least this large are filled by several threads.
const PAR_BYTES: usize = 1 << 16;

/// Fills `dst` row by row (`row` elements each) with `f(row index, row)`, in parallel when
/// large. Rows of length 0 mean there is nothing to write.
fn for_rows<W: Send>(dst: &mut [W], row: usize, f: impl Fn(usize, &mut [W]) + Sync) {
    if row == 0 || dst.is_empty() {
        return;
    }
    let bytes = std::mem::size_of_val(dst);
    if bytes >= PAR_BYTES {
        // Keep each task at a few KiB or more so that tiny rows do not drown in overhead.
        let min = (1 << 12) / (row * std::mem::size_of::<W>()) + 1;
        dst.par_chunks_mut(row)
            .enumerate()
            .with_min_len(min)
            .for_each(|(i, r)| f(i, r));
    } else {
        dst.chunks_mut(row).enumerate().for_each(|(i, r)| f(i, r));
    }
}

/// Row-major element strides of a shape.
fn strides(shape: &[usize]) -> Vec<isize> {
    let mut s = vec![1isize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1] as isize;
    }
    s
}

/// `out[idx] = x[base + Σ idx[d]·st[d]]` over the output's shape (strides in elements).
fn strided_copy(x: &Tensor, base: isize, st: &[isize], out: &mut Tensor) {
    if out.numel() == 0 {
        return;
    }
    // Drop size-1 dims and merge dims that are contiguous in the input, so that rows are
    // as long as possible (a plain slice becomes a few memcpys).
    let (mut dims, mut sts) = (vec![], vec![]);
    for (&d, &s) in out.shape().iter().zip(st) {
        if d == 1 {
            continue;
        }
        match (dims.last_mut(), sts.last_mut()) {
            (Some(pd), Some(ps)) if *ps == s * d as isize => {
                *pd *= d;
                *ps = s;
            }
            _ => {
                dims.push(d);
                sts.push(s);
            }
        }
    }
    if dims.is_empty() {
        dims.push(1);
        sts.push(0);
    }
    // Copy whole elements as one machine word (storage is 8-byte aligned).
    let (src, dst) = (x.bytes(), out.bytes_mut());
    match x.dtype().size() {
        1 => copy_words::<u8>(src, base, &dims, &sts, dst),
        2 => copy_words::<u16>(
            bytemuck::cast_slice(src),
            base,
            &dims,
            &sts,
            bytemuck::cast_slice_mut(dst),
        ),
        4 => copy_words::<u32>(
            bytemuck::cast_slice(src),
            base,
            &dims,
            &sts,
            bytemuck::cast_slice_mut(dst),
        ),
        _ => copy_words::<u64>(
            bytemuck::cast_slice(src),
            base,
            &dims,
            &sts,
            bytemuck::cast_slice_mut(dst),
        ),
    }
}

fn copy_words<W: Pod + Send + Sync>(
    src: &[W],
    base: isize,
    dims: &[usize],
    st: &[isize],
    dst: &mut [W],
) {
    let r = dims.len() - 1;
    let (n, s) = (dims[r], st[r]);
    for_rows(dst, n, |i, row| {
        let mut off = base;
        let mut rem = i;
        for d in (0..r).rev() {
            off += (rem % dims[d]) as isize * st[d];
            rem /= dims[d];
        }
        if s == 1 {
            row.copy_from_slice(&src[off as usize..off as usize + n]);
        } else {
            for (j, o) in row.iter_mut().enumerate() {
                *o = src[(off + j as isize * s) as usize];
            }
        }
    });
}

pub fn transpose(x: &Tensor, perm: Option<&[usize]>, out: &mut Tensor) -> Result<()> {
    let st = strides(x.shape());
    let r = st.len();
    let st: Vec<isize> = match perm {
        Some(p) => p.iter().map(|&d| st[d]).collect(),
        None => (0..r).rev().map(|d| st[d]).collect(),
    };
    strided_copy(x, 0, &st, out);
    Ok(())
}

/// `x` viewed as `[outer, x.shape[axis] · inner]` rows, `inner` in bytes.
fn axis_split(shape: &[usize], axis: usize, elem: usize) -> (usize, usize) {
    (
        shape[..axis].iter().product(),
        shape[axis + 1..].iter().product::<usize>() * elem,
    )
}

pub fn concat(ins: &[Option<&Tensor>], axis: i64, out: &mut Tensor) -> Result<()> {
    let r = out.shape().len();
    let a = common::axis_index(axis, r)?;
    let (_, inner) = axis_split(out.shape(), a, out.dtype().size());
    let xs: Vec<&Tensor> = ins.iter().flatten().copied().collect();
    // Each output row is the inputs' rows one after another.
    let row_len = out.shape()[a] * inner;
    for_rows(out.bytes_mut(), row_len, |o, row| {
        let mut at = 0;
        for x in &xs {
            let n = x.shape()[a] * inner;
            row[at..at + n].copy_from_slice(&x.bytes()[o * n..(o + 1) * n]);
            at += n;
        }
    });
    Ok(())
}

/// Output shapes already hold the split sizes.
pub fn split(x: &Tensor, axis: i64, outs: &mut [Tensor]) -> Result<()> {
    let r = x.shape().len();
    let a = common::axis_index(axis, r)?;
    let (_, inner) = axis_split(x.shape(), a, x.dtype().size());
    let x_row = x.shape()[a] * inner;
    let src = x.bytes();
    let mut at = 0;
    for out in outs.iter_mut() {
        let n = out.shape()[a] * inner;
        for_rows(out.bytes_mut(), n, |o, row| {
            row.copy_from_slice(&src[o * x_row + at..][..n])
        });
        at += n;
    }
    Ok(())
}

/// Slice's (start, step) per dim; `args` = starts, ends, [axes], [steps].
fn slice_steps(shape: &[usize], args: &[Option<&Tensor>]) -> Result<Vec<(i64, i64)>> {
    common::slice_steps(shape, |i| {
        Ok(args.get(i).copied().flatten().map(|t| t.to_i64_vec()))
    })
}

/// `ins` = data, starts, ends, [axes], [steps].
pub fn slice(x: &Tensor, ins: &[Option<&Tensor>], out: &mut Tensor) -> Result<()> {
    let mut st = strides(x.shape());
    let mut base = 0isize;
    for (a, (s, step)) in slice_steps(x.shape(), &ins[1..])?.into_iter().enumerate() {
        // An empty range may start at -1 or past the end: nothing is read then.
        if out.shape()[a] > 0 {
            base += s as isize * st[a];
        }
        // Saturating: a huge step only ever reads one element, whose stride is unused.
        st[a] = st[a].saturating_mul(step as isize);
    }
    strided_copy(x, base, &st, out);
    Ok(())
}

/// Bidirectional broadcast of `x` to the output's shape.
pub fn expand(x: &Tensor, out: &mut Tensor) -> Result<()> {
    let xs = strides(x.shape());
    let pad = out.shape().len() - x.shape().len();
    // Dims `x` lacks, or has as 1, repeat: stride 0.
    let st: Vec<isize> = (0..out.shape().len())
        .map(|d| {
            if d < pad || x.shape()[d - pad] == 1 {
                0
            } else {
                xs[d - pad]
            }
        })
        .collect();
    strided_copy(x, 0, &st, out);
    Ok(())
}

/// Negative indices count from the end; out-of-range indices are an error naming the node.
pub fn gather(node: &Node, x: &Tensor, idx: &Tensor, axis: i64, out: &mut Tensor) -> Result<()> {
    let (a, ids) = gather_indices(node, x.shape(), idx, axis)?;
    let d = x.shape()[a];
    // Output rows are [outer, indices, inner]: row (o, q) is input row (o, ids[q]).
    let (_, inner) = axis_split(x.shape(), a, x.dtype().size());
    let src = x.bytes();
    for_rows(out.bytes_mut(), inner, |i, row| {
        let (o, q) = (i / ids.len(), i % ids.len());
        row.copy_from_slice(&src[(o * d + ids[q]) * inner..][..inner]);
    });
    Ok(())
}

/// GatherElements and GatherND: a flat gather at `common::take_offsets`.
pub fn take(node: &Node, x: &Tensor, idx: &Tensor, out: &mut Tensor) -> Result<()> {
    let offs = common::take_offsets(node, x.shape(), idx.shape(), &idx.to_i64_vec())?;
    let flat = Tensor::from_bytes(x.dtype(), &[x.numel()], x.bytes())?;
    let offs = Tensor::from_vec(&[offs.len()], offs)?;
    gather(node, &flat, &offs, 0, out)
}

/// Their gradients: dY scattered (added) at the same offsets, as Gather's gradient.
pub fn take_grad(node: &Node, dy: &Tensor, idx: &Tensor, out: &mut Tensor) -> Result<()> {
    let offs = common::take_offsets(node, out.shape(), idx.shape(), &idx.to_i64_vec())?;
    let offs = Tensor::from_vec(&[offs.len()], offs)?;
    let dy = Tensor::from_bytes(dy.dtype(), &[dy.numel()], dy.bytes())?;
    let mut flat = Tensor::zeros(out.dtype(), &[out.numel()]);
    gather_grad(node, &dy, &offs, 0, &mut flat)?;
    out.bytes_mut().copy_from_slice(flat.bytes());
    Ok(())
}

/// The gather axis of data of shape `shape`, and the indices along it: negative ones count
/// from the end; out-of-range ones are an error naming the node.
fn gather_indices(
    node: &Node,
    shape: &[usize],
    idx: &Tensor,
    axis: i64,
) -> Result<(usize, Vec<usize>)> {
    let r = shape.len();
    let a = common::axis_index(axis, r)?;
    let ids = idx
        .to_i64_vec()
        .into_iter()
        .map(|i| Ok(common::index_in(node, i, shape[a], a)? as usize))
        .collect::<Result<Vec<usize>>>()?;
    Ok((a, ids))
}

pub fn shape(x: &Tensor, start: i64, end: Option<i64>, out: &mut Tensor) -> Result<()> {
    let (s, e) = shape_range(start, end, x.shape().len());
    for (o, &d) in out.as_mut_slice::<i64>().iter_mut().zip(&x.shape()[s..e]) {
        *o = d as i64;
    }
    Ok(())
}

/// Gather backward: zeros of `out`'s shape, then dY's slices added at their indices.
/// Each output row sums the dY rows that read it (an index list per row, in order), so
/// rows are independent: parallel, and deterministic with repeated indices.
pub fn gather_grad(
    node: &Node,
    dy: &Tensor,
    indices: &Tensor,
    axis: i64,
    out: &mut Tensor,
) -> Result<()> {
    let (a, ids) = gather_indices(node, out.shape(), indices, axis)?;
    let (d, inner, nq) = (out.shape()[a], numel(&out.shape()[a + 1..]), ids.len());
    if inner == 0 || out.numel() == 0 {
        return Ok(());
    }
    // The positions q reading each row j, grouped by j (a stable sort: in order of q).
    let mut readers: Vec<usize> = (0..nq).collect();
    readers.sort_by_key(|&q| ids[q]);
    let readers_of = |j: usize| {
        let lo = readers.partition_point(|&q| ids[q] < j);
        let hi = readers.partition_point(|&q| ids[q] <= j);
        &readers[lo..hi]
    };
    crate::with_float!(out.dtype(), T => {
        let src = dy.as_slice::<T>();
        let min = (1 << 12) / inner + 1;
        out.as_mut_slice::<T>().par_chunks_mut(inner).enumerate().with_min_len(min).for_each_init(
            Vec::new,
            |acc: &mut Vec<<T as Float>::Acc>, (i, row)| {
                let (o, j) = (i / d, i % d);
                acc.clear();
                acc.resize(inner, Zero::zero());
                for &q in readers_of(j) {
                    let s = &src[(o * nq + q) * inner..][..inner];
                    acc.iter_mut().zip(s).for_each(|(a, v)| *a += v.to_acc());
                }
                row.iter_mut().zip(acc.iter()).for_each(|(o, &a)| *o = T::from_acc(a));
            },
        );
        Ok(())
    }, _ => crate::bail!(Runtime, "GatherGrad takes floating tensors, got {}", out.dtype()))
}

/// Slice backward: zeros of `out`'s shape with dY written where Slice read.
/// `ins` are the node's inputs: dY, XShape, starts, ends, [axes], [steps].
///
/// Walks `out` by rows (last dim), so threads write disjoint rows: a row is zero unless
/// its index along every other dim is one Slice read, and then gets one dY row written at
/// start + k·step.
pub fn slice_grad(dy: &Tensor, ins: &[Option<&Tensor>], out: &mut Tensor) -> Result<()> {
    let sel = slice_steps(out.shape(), ins.get(2..).unwrap_or_default())?;
    let (xs, ys) = (out.shape().to_vec(), dy.shape().to_vec());
    let r = xs.len();
    if r == 0 || dy.numel() == 0 {
        out.bytes_mut().fill(0);
        return Ok(());
    }
    let yst = strides(&ys);
    // Position k of dY along dim `d` that X index `i` is, if any.
    let pos = |d: usize, i: usize| {
        let (s, step) = sel[d];
        let off = i as i64 - s;
        let k = off / step;
        (off % step == 0 && (0..ys[d] as i64).contains(&k)).then_some(k as usize)
    };
    let (n, (s_last, step_last)) = (xs[r - 1], sel[r - 1]);
    crate::with_any!(out.dtype(), T => {
        let src = dy.as_slice::<T>();
        for_rows(out.as_mut_slice::<T>(), n, |i, row| {
            row.fill(bytemuck::Zeroable::zeroed());
            let (mut rem, mut off) = (i, 0);
            for d in (0..r - 1).rev() {
                let Some(k) = pos(d, rem % xs[d]) else { return };
                off += k * yst[d] as usize;
                rem /= xs[d];
            }
            for (k, &v) in src[off..off + ys[r - 1]].iter().enumerate() {
                row[(s_last + k as i64 * step_last) as usize] = v;
            }
        });
    });
    Ok(())
}

/// Pad: a gather at `common::pad_plan`'s offsets, the constant (input 2, default 0) where
/// an offset is -1.
pub fn pad(node: &Node, x: &Tensor, ins: &[Option<&Tensor>], out: &mut Tensor) -> Result<()> {
    let offs = common::pad_plan(node, x.shape(), |i| {
        Ok(ins.get(i).copied().flatten().map(Tensor::to_i64_vec))
    })?;
    let c = ins.get(2).copied().flatten();
    crate::with_any!(x.dtype(), T => {
        let src = x.as_slice::<T>();
        let c: T = c.map(|c| c.as_slice::<T>()[0]).unwrap_or(bytemuck::Zeroable::zeroed());
        out.as_mut_slice::<T>()
            .par_iter_mut()
            .zip(offs.par_iter())
            .with_min_len(1 << 12)
            .for_each(|(o, &k)| *o = if k < 0 { c } else { src[k as usize] });
    });
    Ok(())
}

/// PadGrad: every dY element added to the X element it was read from, in order.
pub fn pad_grad(node: &Node, dy: &Tensor, ins: &[Option<&Tensor>], out: &mut Tensor) -> Result<()> {
    let offs = common::pad_plan(node, out.shape(), |i| {
        Ok(ins.get(i).copied().flatten().map(Tensor::to_i64_vec))
    })?;
    crate::with_float!(out.dtype(), T => {
        let g = dy.as_slice::<T>();
        let mut acc = vec![<<T as Float>::Acc as Zero>::zero(); out.numel()];
        for (i, &k) in offs.iter().enumerate() {
            if k >= 0 {
                acc[k as usize] += g[i].to_acc();
            }
        }
        out.as_mut_slice::<T>().iter_mut().zip(acc).for_each(|(o, a)| *o = T::from_acc(a));
        Ok(())
    }, _ => crate::bail!(Runtime, "{}: PadGrad takes floating tensors, got {}", node.describe(), out.dtype()))
}

/// ScatterElements and ScatterND: data copied, then each update combined into the element
/// `common::take_offsets` puts it on, in index order (so with repeated indices and no
/// reduction the last update wins, as ONNX's reference does).
pub fn scatter(
    node: &Node,
    data: &Tensor,
    idx: &Tensor,
    upd: &Tensor,
    reduction: ScatterReduction,
    out: &mut Tensor,
) -> Result<()> {
    let tgt = common::take_offsets(node, data.shape(), idx.shape(), &idx.to_i64_vec())?;
    out.bytes_mut().copy_from_slice(data.bytes());
    fn fold<T: Copy + PartialOrd>(
        out: &mut [T],
        upd: &[T],
        tgt: &[i64],
        r: ScatterReduction,
        add: impl Fn(T, T) -> T,
        mul: impl Fn(T, T) -> T,
    ) {
        for (&t, &u) in tgt.iter().zip(upd) {
            let v = &mut out[t as usize];
            *v = match r {
                ScatterReduction::None => u,
                ScatterReduction::Add => add(*v, u),
                ScatterReduction::Mul => mul(*v, u),
                // As Python's max(v, u) and min(v, u): v unless u is strictly beyond it.
                ScatterReduction::Max => {
                    if u > *v {
                        u
                    } else {
                        *v
                    }
                }
                ScatterReduction::Min => {
                    if u < *v {
                        u
                    } else {
                        *v
                    }
                }
            };
        }
    }
    let dt = data.dtype();
    if reduction == ScatterReduction::None {
        crate::with_any!(dt, T => fold(out.as_mut_slice::<T>(), upd.as_slice::<T>(), &tgt, reduction, |a, _| a, |a, _| a));
        return Ok(());
    }
    crate::with_float!(dt, T => {
        fold(out.as_mut_slice::<T>(), upd.as_slice::<T>(), &tgt, reduction,
            |a: T, b: T| T::from_acc(a.to_acc() + b.to_acc()),
            |a: T, b: T| T::from_acc(a.to_acc() * b.to_acc()));
        Ok(())
    }, _ => crate::with_dtypes!(dt, T => {
        fold(out.as_mut_slice::<T>(), upd.as_slice::<T>(), &tgt, reduction,
            |a: T, b: T| T::from_i64(a.to_i64().wrapping_add(b.to_i64())),
            |a: T, b: T| T::from_i64(a.to_i64().wrapping_mul(b.to_i64())));
        Ok(())
    }, [I64 i64, I32 i32], _ => crate::bail!(
        Runtime,
        "{}: reduction '{}' is not defined for {dt}",
        node.describe(),
        reduction.name()
    )))
}
