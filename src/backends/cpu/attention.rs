//! Attention in blocked online-softmax form (flash-style): never materialises the
//! Sq×Skv matrix; fully masked rows give 0.
//!
//! Both ops share one inner routine, [`attend`], which runs a block of at most `QB` query
//! rows of one head against the keys of one kv head, `KB` keys at a time, keeping a
//! running max, sum and output accumulator per query row.

use crate::error::Result;
use crate::graph::Node;
use crate::tensor::{DType, Float, Real, Tensor};
use num_traits::{Float as _, One, Zero};
use rayon::prelude::*;
use std::ops::Range;

/// Query rows per task (the unit of parallelism) and keys per block.
const QB: usize = 32;
const KB: usize = 64;

/// ONNX opset-23 Attention on 4-D inputs: Q `[B, Hq, Sq, D]`, K `[B, Hkv, Skv, D]`,
/// V `[B, Hkv, Skv, Dv]` → `[B, Hq, Sq, Dv]`. Query head h reads kv head `h / (Hq/Hkv)`.
/// `mask` broadcasts to `[B, Hq, Sq, Skv]`: bool (false masks out) or additive.
/// Causal is upper-left aligned: query i sees key j iff `j <= i`.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    is_causal: bool,
    scale: Option<f32>,
    out: &mut Tensor,
) -> Result<()> {
    crate::with_float!(q.dtype(), T => attention_t::<T>(q, k, v, mask, is_causal, scale, out),
        _ => Err(crate::err!(Runtime, "Attention needs float inputs, got {}", q.dtype())))
}

/// Packed sequences: Q `[Tq, Hq, D]`, K `[Tk, Hkv, D]`, V `[Tk, Hkv, Dv]` → `[Tq, Hq, Dv]`;
/// sequence b is query rows `cu_q[b]..cu_q[b+1]` against key rows `cu_k[b]..cu_k[b+1]`
/// (cu_seqlens i32 or i64, validated here). Query rows of a sequence with no keys give 0.
///
/// Causal is **bottom-right** aligned, as in flash-attn's varlen API: in a sequence of
/// Lq queries and Lk keys, query i sees key j iff `j <= i + Lk - Lq` (the last query sees
/// every key). With Lq == Lk this is the usual upper-left mask; with Lq > Lk the first
/// `Lq - Lk` queries see nothing and give 0.
#[allow(clippy::too_many_arguments)]
pub fn varlen_attention(
    node: &Node,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_q: &Tensor,
    cu_k: &Tensor,
    is_causal: bool,
    scale: Option<f32>,
    out: &mut Tensor,
) -> Result<()> {
    let cq = cu_seqlens(node, cu_q, "cu_seqlens_q", q.shape()[0])?;
    let ck = cu_seqlens(node, cu_k, "cu_seqlens_k", k.shape()[0])?;
    if cq.len() != ck.len() {
        crate::bail!(
            Runtime,
            "{}: cu_seqlens_q has {} entries but cu_seqlens_k has {}",
            node.describe(),
            cq.len(),
            ck.len()
        );
    }
    crate::with_float!(q.dtype(), T => varlen_t::<T>(q, k, v, &cq, &ck, is_causal, scale, out),
        _ => Err(crate::err!(Runtime, "{}: needs float inputs, got {}", node.describe(), q.dtype())))
}

/// Checks that `cu` starts at 0, never decreases and ends at `total`, so every range it
/// names lies inside the packed tensor.
fn cu_seqlens(node: &Node, cu: &Tensor, what: &str, total: usize) -> Result<Vec<usize>> {
    let c = cu.to_i64_vec();
    let ok = c.first() == Some(&0)
        && c.windows(2).all(|w| w[0] <= w[1])
        && c.last() == Some(&(total as i64));
    if !ok {
        crate::bail!(Runtime, "{}: {what} must start at 0, never decrease and end at {total} (the packed length); got {c:?}", node.describe());
    }
    Ok(c.into_iter().map(|x| x as usize).collect())
}

fn default_scale(d: usize, scale: Option<f32>) -> f64 {
    scale.map_or(1.0 / (d as f64).sqrt(), |s| s as f64)
}

fn attention_t<T: Float>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    causal: bool,
    scale: Option<f32>,
    out: &mut Tensor,
) -> Result<()> {
    let &[_, hq, sq, d] = q.shape() else {
        crate::bail!(Runtime, "Attention: Q must be 4-D")
    };
    let (hkv, skv, dv) = (k.shape()[1], k.shape()[2], v.shape()[3]);
    let scale = T::Acc::c(default_scale(d, scale));
    let mask = match mask {
        None => Mask::None,
        Some(m) => {
            let st = mask_strides(m.shape());
            match m.dtype() {
                DType::Bool => Mask::Bool(m.as_slice::<u8>(), st),
                dt if dt == T::DTYPE => Mask::Add(m.as_slice::<T>(), st),
                dt => crate::bail!(
                    Runtime,
                    "Attention: attn_mask must be bool or {}, got {dt}",
                    T::DTYPE
                ),
            }
        }
    };
    let (qs, ks, vs) = (q.as_slice::<T>(), k.as_slice::<T>(), v.as_slice::<T>());
    let out = out.as_mut_slice::<T>();
    if out.is_empty() {
        return Ok(());
    }
    let group = hq / hkv;
    // Tasks: one per (batch·head, block of QB query rows), each owning its output rows.
    out.par_chunks_mut(sq * dv)
        .enumerate()
        .flat_map(|(bh, o)| {
            o.par_chunks_mut(QB * dv)
                .enumerate()
                .map(move |(blk, o)| (bh, blk, o))
        })
        .for_each_init(
            || Scratch::new(d, dv),
            |sc, (bh, blk, o)| {
                let (b, h) = (bh / hq, bh % hq);
                let kvh = b * hkv + h / group;
                let rows = blk * QB..(blk * QB + QB).min(sq);
                let job = Job {
                    q: Rows {
                        data: qs,
                        off: bh * sq * d,
                        stride: d,
                        width: d,
                    },
                    k: Rows {
                        data: ks,
                        off: kvh * skv * d,
                        stride: d,
                        width: d,
                    },
                    v: Rows {
                        data: vs,
                        off: kvh * skv * dv,
                        stride: dv,
                        width: dv,
                    },
                    nk: skv,
                    causal_shift: causal.then_some(0),
                    mask: mask.for_head(b, h),
                    scale,
                };
                attend(&job, rows, o, dv, sc);
            },
        );
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn varlen_t<T: Float>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cq: &[usize],
    ck: &[usize],
    causal: bool,
    scale: Option<f32>,
    out: &mut Tensor,
) -> Result<()> {
    let (hq, d, hkv, dv) = (q.shape()[1], q.shape()[2], k.shape()[1], v.shape()[2]);
    let scale = T::Acc::c(default_scale(d, scale));
    let (qs, ks, vs) = (q.as_slice::<T>(), k.as_slice::<T>(), v.as_slice::<T>());
    let mut out = out.as_mut_slice::<T>();
    if out.is_empty() {
        return Ok(());
    }
    let group = hq / hkv;
    // Tasks: (sequence, block of QB query tokens) with every head; a token's output row
    // [Hq, Dv] is contiguous, so the validated cu_seqlens split the output in order.
    let mut tasks = vec![];
    for b in 0..cq.len() - 1 {
        for t0 in (cq[b]..cq[b + 1]).step_by(QB) {
            let t1 = (t0 + QB).min(cq[b + 1]);
            let (o, rest) = std::mem::take(&mut out).split_at_mut((t1 - t0) * hq * dv);
            out = rest;
            tasks.push((b, t0..t1, o));
        }
    }
    tasks.into_par_iter().for_each_init(
        || Scratch::new(d, dv),
        |sc, (b, toks, o)| {
            let (q0, k0) = (cq[b], ck[b]);
            let (lq, lk) = (cq[b + 1] - q0, ck[b + 1] - k0);
            let rows = toks.start - q0..toks.end - q0;
            for h in 0..hq {
                let g = h / group;
                let job = Job {
                    q: Rows {
                        data: qs,
                        off: (q0 * hq + h) * d,
                        stride: hq * d,
                        width: d,
                    },
                    k: Rows {
                        data: ks,
                        off: (k0 * hkv + g) * d,
                        stride: hkv * d,
                        width: d,
                    },
                    v: Rows {
                        data: vs,
                        off: (k0 * hkv + g) * dv,
                        stride: hkv * dv,
                        width: dv,
                    },
                    nk: lk,
                    causal_shift: causal.then_some(lk as isize - lq as isize),
                    mask: Mask::None,
                    scale,
                };
                attend(&job, rows.clone(), &mut o[h * dv..], hq * dv, sc);
            }
        },
    );
    Ok(())
}

/// Strided rows of one head: row r is `data[off + r*stride..][..width]`.
#[derive(Clone, Copy)]
struct Rows<'a, T> {
    data: &'a [T],
    off: usize,
    stride: usize,
    width: usize,
}
impl<'a, T> Rows<'a, T> {
    #[inline]
    fn row(&self, r: usize) -> &'a [T] {
        &self.data[self.off + r * self.stride..][..self.width]
    }
}

/// Element strides of a mask broadcast to `[B, Hq, Sq, Skv]` (0 along broadcast dims); for one
/// (batch, head) the offset is folded in by `for_head`, leaving (query, key) strides.
#[derive(Clone, Copy)]
struct MaskStrides([usize; 4]);

fn mask_strides(shape: &[usize]) -> MaskStrides {
    let mut st = [0; 4];
    let mut s = 1;
    for (i, &n) in shape.iter().enumerate().rev() {
        let axis = 4 - shape.len() + i;
        st[axis] = if n == 1 { 0 } else { s };
        s *= n;
    }
    MaskStrides(st)
}

#[derive(Clone, Copy)]
enum Mask<'a, T> {
    None,
    Bool(&'a [u8], MaskStrides),
    Add(&'a [T], MaskStrides),
}
impl<'a, T: Float> Mask<'a, T> {
    /// The same mask with the (batch, head) offset folded into the slice.
    fn for_head(&self, b: usize, h: usize) -> Mask<'a, T> {
        match *self {
            Mask::None => Mask::None,
            Mask::Bool(m, s) => Mask::Bool(&m[b * s.0[0] + h * s.0[1]..], s),
            Mask::Add(m, s) => Mask::Add(&m[b * s.0[0] + h * s.0[1]..], s),
        }
    }
    #[inline]
    fn apply(&self, i: usize, j: usize, x: T::Acc) -> T::Acc {
        match *self {
            Mask::None => x,
            Mask::Bool(m, s) => {
                if m[i * s.0[2] + j * s.0[3]] != 0 {
                    x
                } else {
                    T::Acc::neg_infinity()
                }
            }
            Mask::Add(m, s) => x + m[i * s.0[2] + j * s.0[3]].to_acc(),
        }
    }
}

/// One head's attention problem: queries against `nk` keys.
struct Job<'a, T: Float> {
    q: Rows<'a, T>,
    k: Rows<'a, T>,
    v: Rows<'a, T>,
    nk: usize,
    /// With causal masking, query i sees key j iff `j <= i + shift`.
    causal_shift: Option<isize>,
    mask: Mask<'a, T>,
    scale: T::Acc,
}

/// Per-task buffers, reused across every block a task runs (no allocation inside loops).
struct Scratch<A> {
    q: Vec<A>,   // [QB, D] scaled queries
    k: Vec<A>,   // [KB, D]
    v: Vec<A>,   // [KB, Dv]
    s: Vec<A>,   // [KB] scores of one row
    m: Vec<A>,   // [QB] running max
    l: Vec<A>,   // [QB] running sum of exp
    acc: Vec<A>, // [QB, Dv] running weighted sum of V
}
impl<A: Real> Scratch<A> {
    fn new(d: usize, dv: usize) -> Self {
        let z = A::zero();
        Scratch {
            q: vec![z; QB * d],
            k: vec![z; KB * d],
            v: vec![z; KB * dv],
            s: vec![z; KB],
            m: vec![z; QB],
            l: vec![z; QB],
            acc: vec![z; QB * dv],
        }
    }
}

/// Attends query rows `rows` (at most QB) of `job`, writing row `rows.start + r` to
/// `out[r*out_stride..][..Dv]`. A row that sees no key (all masked) gets 0.
fn attend<T: Float>(
    job: &Job<T>,
    rows: Range<usize>,
    out: &mut [T],
    out_stride: usize,
    sc: &mut Scratch<T::Acc>,
) {
    let (d, dv, nq) = (job.q.width, job.v.width, rows.len());
    let neg_inf = T::Acc::neg_infinity();
    sc.m[..nq].fill(neg_inf);
    sc.l[..nq].fill(T::Acc::zero());
    sc.acc[..nq * dv].fill(T::Acc::zero());
    for (r, i) in rows.clone().enumerate() {
        for (x, &y) in sc.q[r * d..][..d].iter_mut().zip(job.q.row(i)) {
            *x = y.to_acc() * job.scale;
        }
    }
    // Keys visible to query i are 0..limit(i); limit grows with i, so the block's last
    // row bounds the keys any row needs: blocks above the causal diagonal are skipped.
    let limit = |i: usize| match job.causal_shift {
        Some(sh) => (i as isize + 1 + sh).clamp(0, job.nk as isize) as usize,
        None => job.nk,
    };
    let kend = if nq == 0 { 0 } else { limit(rows.end - 1) };
    for j0 in (0..kend).step_by(KB) {
        let j1 = (j0 + KB).min(kend);
        for c in 0..j1 - j0 {
            widen(&mut sc.k[c * d..][..d], job.k.row(j0 + c));
            widen(&mut sc.v[c * dv..][..dv], job.v.row(j0 + c));
        }
        for (r, i) in rows.clone().enumerate() {
            let jl = limit(i).min(j1);
            if jl <= j0 {
                continue;
            }
            let qi = &sc.q[r * d..][..d];
            let s = &mut sc.s[..jl - j0];
            let mut bmax = neg_inf;
            for (c, x) in s.iter_mut().enumerate() {
                *x = job.mask.apply(i, j0 + c, dot(qi, &sc.k[c * d..][..d]));
                bmax = bmax.max(*x);
            }
            if bmax == neg_inf {
                continue; // every key of this block is masked for this row
            }
            // Rescale what was accumulated under the old max (exp(-inf) = 0 on the first
            // visible block, when the accumulator is still 0).
            let m_new = sc.m[r].max(bmax);
            let alpha = (sc.m[r] - m_new).exp();
            let acc = &mut sc.acc[r * dv..][..dv];
            if alpha != T::Acc::one() {
                acc.iter_mut().for_each(|a| *a = *a * alpha);
            }
            let mut sum = T::Acc::zero();
            for (c, &x) in s.iter().enumerate() {
                let p = (x - m_new).exp();
                if p != T::Acc::zero() {
                    sum = sum + p;
                    for (a, &y) in acc.iter_mut().zip(&sc.v[c * dv..][..dv]) {
                        *a = *a + p * y;
                    }
                }
            }
            sc.l[r] = sc.l[r] * alpha + sum;
            sc.m[r] = m_new;
        }
    }
    for r in 0..nq {
        let o = &mut out[r * out_stride..][..dv];
        let l = sc.l[r];
        if l > T::Acc::zero() {
            let inv = l.recip();
            for (o, &a) in o.iter_mut().zip(&sc.acc[r * dv..][..dv]) {
                *o = T::from_acc(a * inv);
            }
        } else {
            o.fill(T::from_acc(T::Acc::zero()));
        }
    }
}

fn widen<T: Float>(dst: &mut [T::Acc], src: &[T]) {
    for (x, &y) in dst.iter_mut().zip(src) {
        *x = y.to_acc();
    }
}

/// Dot product with 8 independent partial sums, which lets the compiler vectorise
/// (a single running sum is a serial dependency chain).
#[inline]
fn dot<A: Real>(a: &[A], b: &[A]) -> A {
    let mut p = [A::zero(); 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: A = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(&x, &y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            p[l] = p[l] + x[l] * y[l];
        }
    }
    p.iter().copied().sum::<A>() + tail
}

/// Attention backward (flash-style, from the forward's LSE): outs = [dQ, dK, dV, (dMask)].
#[allow(clippy::too_many_arguments)]
pub fn attention_grad(
    dy: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    y: &Tensor,
    lse: &Tensor,
    is_causal: bool,
    scale: Option<f32>,
    want: &[bool],
    outs: &mut [Tensor],
) -> Result<()> {
    let _ = (dy, q, k, v, mask, y, lse, is_causal, scale, want, outs);
    Err(crate::err!(Runtime, "AttentionGrad: not implemented yet"))
}

/// VarlenAttention backward: `[dY, Q, K, V]`, cu_seqlens, the forward's Y and LSE;
/// outs = [dQ, dK, dV].
#[allow(clippy::too_many_arguments)]
pub fn varlen_attention_grad(
    node: &Node,
    t: [&Tensor; 4],
    cu_q: &Tensor,
    cu_k: &Tensor,
    y: &Tensor,
    lse: &Tensor,
    is_causal: bool,
    scale: Option<f32>,
    want: &[bool],
    outs: &mut [Tensor],
) -> Result<()> {
    let _ = (node, t, cu_q, cu_k, y, lse, is_causal, scale, want, outs);
    Err(crate::err!(
        Runtime,
        "VarlenAttentionGrad: not implemented yet"
    ))
}
