//! Attention in blocked online-softmax form (flash-style): never materialises the
//! Sq×Skv matrix; fully masked rows give 0.
//!
//! Both forward ops share one inner routine, [`attend`], which runs a block of at most
//! `QB` query rows of one head against the keys of one kv head, `KB` keys at a time,
//! keeping a running max, sum and output accumulator per query row. It also gives each
//! row's logsumexp (LSE), the forward's optional second output.
//!
//! Both backward ops share [`grad_kv_head`] (flash-attention-2 style): from the forward's
//! Y and LSE it recomputes the probabilities block by block, so the only Sq×Skv tensor
//! it ever writes is dMask, and only when asked for.

use super::simd::madd;
use crate::error::Result;
use crate::graph::infer::{qkv_parts, AttnDims};
use crate::graph::Node;
use crate::tensor::{DType, Elem, Float, Real, Tensor};
use num_traits::{Float as _, Zero};
use rayon::prelude::*;
use std::borrow::Cow;
use std::ops::Range;

/// Query rows per block (the forward's unit of parallelism) and keys per block.
const QB: usize = 32;
const KB: usize = 64;

/// ONNX opset-23 Attention: Q `[B, Hq, Sq, D]`, K `[B, Hkv, Skv, D]`, V `[B, Hkv, Skv, Dv]`
/// → Y `[B, Hq, Sq, Dv]`, or the 3-D form with the heads packed in the last axis (Q
/// `[B, Sq, Hq·D]`, ... → Y `[B, Sq, Hq·Dv]`, read in place through row strides); when
/// `outs` has a second tensor, LSE `[B, Hq, Sq]` in both forms (f32, f64 for f64 inputs;
/// −inf for a row that sees no key). Query head h reads kv head `h / (Hq/Hkv)`.
/// `mask` broadcasts to `[B, Hq, Sq, Skv]`: bool (false masks out) or additive.
/// Causal is upper-left aligned: query i sees key j iff `j <= i`.
/// With K and V omitted, Q is the packed QKV (`qkv_parts`).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    node: &Node,
    qkv: [Option<&Tensor>; 3],
    mask: Option<&Tensor>,
    is_causal: bool,
    scale: Option<f32>,
    outs: &mut [Tensor],
) -> Result<()> {
    let fail = |e: String| crate::err!(Runtime, "{}: {e}", node.describe());
    // The 3-D form's tensors are read in place, a packed QKV's parts included: each as
    // `[B, S, row]` with its heads from element `off` of a row.
    let (src, a) = match qkv {
        [Some(x), None, None] => {
            let [(qs, qo), (ks, ko), (vs, vo)] = qkv_parts(&node.op, x.shape()).map_err(fail)?;
            let a = AttnDims::new(&node.op, &qs, &ks, &vs).map_err(fail)?;
            let w = x.shape()[2];
            ([(x, w, qo), (x, w, ko), (x, w, vo)], a)
        }
        [Some(q), Some(k), Some(v)] => {
            let a = dims(node, q, k, v)?;
            let row = |t: &Tensor| *t.shape().last().unwrap_or(&1);
            ([(q, row(q), 0), (k, row(k), 0), (v, row(v), 0)], a)
        }
        _ => return Err(fail("Q, K and V, or the packed QKV alone".into())),
    };
    let dt = src[0].0.dtype();
    crate::with_float!(dt, T => attention_t::<T>(a, src, mask, is_causal, scale, outs),
        _ => Err(crate::err!(Runtime, "{}: needs float inputs, got {dt}", node.describe())))
}

/// Q, K and V of an AttentionGrad node: its inputs, or with K and V omitted
/// the parts of the packed QKV, copied out (the reference keeps to the plain layout).
fn inputs<'a>(node: &Node, qkv: [Option<&'a Tensor>; 3]) -> Result<[Cow<'a, Tensor>; 3]> {
    let fail = |e: String| crate::err!(Runtime, "{}: {e}", node.describe());
    match qkv {
        [Some(q), Some(k), Some(v)] => Ok([q, k, v].map(Cow::Borrowed)),
        [Some(x), None, None] => {
            let parts = qkv_parts(&node.op, x.shape()).map_err(fail)?;
            let mut t = parts.map(|(s, _)| Tensor::zeros(x.dtype(), &s));
            super::shape::split(x, -1, &mut t)?;
            Ok(t.map(Cow::Owned))
        }
        _ => Err(fail("Q, K and V, or the packed QKV alone".into())),
    }
}

/// The problem sizes of an Attention or AttentionGrad node from its Q, K and V.
fn dims(node: &Node, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<AttnDims> {
    AttnDims::new(&node.op, q.shape(), k.shape(), v.shape())
        .map_err(|e| crate::err!(Runtime, "{}: {e}", node.describe()))
}

/// Packed sequences: Q `[Tq, Hq, D]`, K `[Tk, Hkv, D]`, V `[Tk, Hkv, Dv]` → Y `[Tq, Hq, Dv]`
/// and optionally LSE `[Tq, Hq]`; sequence b is query rows `cu_q[b]..cu_q[b+1]` against
/// key rows `cu_k[b]..cu_k[b+1]` (cu_seqlens i32 or i64, validated here). Query rows of a
/// sequence with no keys give 0 (LSE −inf).
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
    outs: &mut [Tensor],
) -> Result<()> {
    let (cq, ck) = sequences(node, cu_q, cu_k, q, k)?;
    crate::with_float!(q.dtype(), T => varlen_t::<T>(q, k, v, &cq, &ck, is_causal, scale, outs),
        _ => Err(crate::err!(Runtime, "{}: needs float inputs, got {}", node.describe(), q.dtype())))
}

/// The validated cu_seqlens of Q and K, as many entries each.
fn sequences(
    node: &Node,
    cu_q: &Tensor,
    cu_k: &Tensor,
    q: &Tensor,
    k: &Tensor,
) -> Result<(Vec<usize>, Vec<usize>)> {
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
    Ok((cq, ck))
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

/// The attn_mask input as the kernels read it.
fn read_mask<T: Float>(mask: Option<&Tensor>) -> Result<Mask<'_, T>> {
    let Some(m) = mask else {
        return Ok(Mask::None);
    };
    let st = mask_strides(m.shape());
    Ok(match m.dtype() {
        DType::Bool => Mask::Bool(m.bool_bytes(), st),
        dt if dt == T::DTYPE => Mask::Add(m.as_slice::<T>(), st),
        dt => crate::bail!(
            Runtime,
            "Attention: attn_mask must be bool or {}, got {dt}",
            T::DTYPE
        ),
    })
}

/// The forward's outputs as slices: Y, and LSE (into `spare` when the node has no second
/// output, so that one loop serves both cases; it is one value per row, cheap to drop).
fn fwd_outputs<'a, T: Float>(
    outs: &'a mut [Tensor],
    rows: usize,
    spare: &'a mut Vec<T::Acc>,
) -> Result<(&'a mut [T], &'a mut [T::Acc])>
where
    T::Acc: Elem,
{
    let [y, rest @ ..] = outs else {
        crate::bail!(Runtime, "attention: no output to write")
    };
    let lse = match rest.first_mut() {
        Some(t) => t.as_mut_slice::<T::Acc>(),
        None => {
            *spare = vec![T::Acc::zero(); rows];
            spare
        }
    };
    Ok((y.as_mut_slice::<T>(), lse))
}

/// Cuts `s` into consecutive pieces of the given lengths, one per task.
fn split<T>(mut s: &mut [T], lens: impl Iterator<Item = usize>) -> Vec<&mut [T]> {
    lens.map(|n| {
        let (a, rest) = std::mem::take(&mut s).split_at_mut(n);
        s = rest;
        a
    })
    .collect()
}

#[allow(clippy::too_many_arguments)]
fn attention_t<T: Float>(
    a: AttnDims,
    src: [(&Tensor, usize, usize); 3],
    mask: Option<&Tensor>,
    causal: bool,
    scale: Option<f32>,
    outs: &mut [Tensor],
) -> Result<()>
where
    T::Acc: Elem,
{
    let AttnDims {
        b,
        hq,
        hkv,
        sq,
        skv,
        d,
        dv,
        ..
    } = a;
    let scale = T::Acc::c(default_scale(d, scale));
    let mask = read_mask::<T>(mask)?;
    let [(q, qw, qo), (k, kw, ko), (v, vw, vo)] = src;
    let (qs, ks, vs) = (q.as_slice::<T>(), k.as_slice::<T>(), v.as_slice::<T>());
    let mut spare = vec![];
    let (out, lse) = fwd_outputs::<T>(outs, b * hq * sq, &mut spare)?;
    let group = hq / hkv;
    let ([qb, qh, qr], [kb, kh, kr]) = (a.q_rows(), a.k_rows());
    // Head h of batch bi (s positions), read in place: [B, H, S, width] in the 4-D form,
    // [B, S, row] with the heads from element `off` of a row in the 3-D form.
    let rows = |data, width, (bs, hs, ss): (usize, usize, usize), (row, off), bi, h, s| {
        if a.packed {
            Rows {
                data,
                off: bi * s * row + off + h * width,
                stride: row,
                width,
            }
        } else {
            Rows {
                data,
                off: (bi * bs + h * hs) * width,
                stride: ss * width,
                width,
            }
        }
    };
    // Query head h of batch bi against its kv head.
    let job = |bi: usize, h: usize| {
        let kvh = h / group;
        Job {
            q: rows(qs, d, (qb, qh, qr), (qw, qo), bi, h, sq),
            k: rows(ks, d, (kb, kh, kr), (kw, ko), bi, kvh, skv),
            v: rows(vs, dv, (kb, kh, kr), (vw, vo), bi, kvh, skv),
            nk: skv,
            causal_shift: causal.then_some(0),
            mask: mask.for_head(bi, h),
            scale,
        }
    };
    if !a.packed {
        // Tasks: one per (batch·head, block of QB query rows), each owning its output rows.
        let blocks: Vec<(usize, Range<usize>)> = (0..b * hq)
            .flat_map(|bh| (0..sq).step_by(QB).map(move |i| (bh, i..(i + QB).min(sq))))
            .collect();
        let lens = |w: usize| blocks.iter().map(move |(_, r)| r.len() * w);
        let tasks: Vec<_> = (blocks.iter())
            .zip(split(out, lens(dv)))
            .zip(split(lse, lens(1)))
            .collect();
        tasks.into_par_iter().for_each_init(
            || Scratch::new(d, dv),
            |sc, ((&(bh, ref rows), o), l)| {
                attend(&job(bh / hq, bh % hq), rows.clone(), (o, 1), (l, 1), sc);
            },
        );
        return Ok(());
    }
    // 3-D: tasks of (batch, block of PB query positions) with every head, whose output
    // rows [positions, Hq·Dv] are contiguous. Their LSE rows ([B, Hq, Sq]) are not: each
    // task keeps them and they are placed afterwards (one value per row). A task runs
    // its QB-row blocks of one head one after another, so that head's keys and values
    // (rows strided by the other heads) are still in cache for the next block.
    const PB: usize = 4 * QB;
    let blocks: Vec<(usize, Range<usize>)> = (0..b)
        .flat_map(|bi| (0..sq).step_by(PB).map(move |i| (bi, i..(i + PB).min(sq))))
        .collect();
    let lens = blocks.iter().map(|(_, r)| r.len() * hq * dv);
    let tasks: Vec<_> = blocks.iter().zip(split(out, lens)).collect();
    let lses: Vec<Vec<T::Acc>> = tasks
        .into_par_iter()
        .map_init(
            || Scratch::new(d, dv),
            |sc, (&(bi, ref rows), o)| {
                let n = rows.len();
                let mut l = vec![T::Acc::zero(); hq * n];
                for h in 0..hq {
                    let job = job(bi, h);
                    for i in rows.clone().step_by(QB) {
                        let r = i - rows.start;
                        let (o, l) = (&mut o[r * hq * dv + h * dv..], &mut l[h * n + r..]);
                        attend(&job, i..(i + QB).min(rows.end), (o, hq), (l, 1), sc);
                    }
                }
                l
            },
        )
        .collect();
    for ((bi, rows), l) in blocks.iter().zip(lses) {
        for h in 0..hq {
            let at = (bi * hq + h) * sq + rows.start;
            lse[at..at + rows.len()].copy_from_slice(&l[h * rows.len()..][..rows.len()]);
        }
    }
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
    outs: &mut [Tensor],
) -> Result<()>
where
    T::Acc: Elem,
{
    let &[tq, hq, d] = q.shape() else {
        crate::bail!(Runtime, "VarlenAttention: Q must be 3-D")
    };
    let (hkv, dv) = (k.shape()[1], v.shape()[2]);
    let scale = T::Acc::c(default_scale(d, scale));
    let (qs, ks, vs) = (q.as_slice::<T>(), k.as_slice::<T>(), v.as_slice::<T>());
    let mut spare = vec![];
    let (out, lse) = fwd_outputs::<T>(outs, tq * hq, &mut spare)?;
    let group = hq / hkv;
    // Tasks: (sequence, block of QB query tokens) with every head; a token's output row
    // [Hq, Dv] (and LSE row [Hq]) is contiguous, so the validated cu_seqlens split the
    // outputs in order.
    let blocks: Vec<(usize, Range<usize>)> = (0..cq.len() - 1)
        .flat_map(|b| {
            (cq[b]..cq[b + 1])
                .step_by(QB)
                .map(move |t| (b, t..(t + QB).min(cq[b + 1])))
        })
        .collect();
    let lens = |w: usize| blocks.iter().map(move |(_, r)| r.len() * hq * w);
    let tasks: Vec<_> = (blocks.iter())
        .zip(split(out, lens(dv)))
        .zip(split(lse, lens(1)))
        .collect();
    tasks.into_par_iter().for_each_init(
        || Scratch::new(d, dv),
        |sc, ((&(b, ref toks), o), l)| {
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
                attend(
                    &job,
                    rows.clone(),
                    (&mut o[h * dv..], hq),
                    (&mut l[h..], hq),
                    sc,
                );
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
    #[inline(always)]
    fn row(&self, r: usize) -> &'a [T] {
        &self.data[self.off + r * self.stride..][..self.width]
    }
}
impl<'a, T: Float> Rows<'a, T> {
    /// Rows `r` in the accumulation type, one after another: read in place where they
    /// already are so (f32 or f64, rows adjacent), else widened into `buf`.
    #[inline(always)]
    fn block<'b>(&self, r: Range<usize>, buf: &'b mut [T::Acc]) -> &'b [T::Acc]
    where
        'a: 'b,
    {
        let w = self.width;
        if self.stride == w {
            if let Some(s) = T::as_acc(&self.data[self.off + r.start * w..][..r.len() * w]) {
                return s;
            }
        }
        for (c, i) in r.clone().enumerate() {
            widen(&mut buf[c * w..][..w], self.row(i));
        }
        &buf[..r.len() * w]
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
    #[inline(always)]
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

/// With causal masking (`shift` given), query i sees key j iff `j <= i + shift`: the keys
/// it sees are `0..key_limit(..)`.
#[inline(always)]
fn key_limit(shift: Option<isize>, nk: usize, i: usize) -> usize {
    match shift {
        Some(sh) => (i as isize + 1 + sh).clamp(0, nk as isize) as usize,
        None => nk,
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
/// The queries and scores are held transposed, `[·, QB]`: one key's scores against the
/// block's queries are one contiguous run, so the score product, the online softmax (its
/// max and sums run down the keys) and the probability-weighted sum of V all vectorise
/// across the queries.
struct Scratch<A> {
    qt: Vec<A>,  // [D, QB] scaled queries, transposed
    k: Vec<A>,   // [KB, D]
    v: Vec<A>,   // [KB, Dv]
    st: Vec<A>,  // [KB, QB] scores, then probabilities, transposed
    m: Vec<A>,   // [QB] running max
    l: Vec<A>,   // [QB] running sum of exp
    acc: Vec<A>, // [QB, Dv] running weighted sum of V
}
impl<A: Real> Scratch<A> {
    fn new(d: usize, dv: usize) -> Self {
        let z = A::zero();
        Scratch {
            qt: vec![z; d * QB],
            k: vec![z; KB * d],
            v: vec![z; KB * dv],
            st: vec![z; KB * QB],
            m: vec![z; QB],
            l: vec![z; QB],
            acc: vec![z; QB * dv],
        }
    }
}

/// Attends query rows `rows` (at most QB) of `job`, writing row `rows.start + r` to
/// `out[r*os*Dv..][..Dv]` and its logsumexp to `lse[r*ls]`, for `out = (out, os)` and
/// `lse = (lse, ls)`. A row that sees no key (all masked) gets 0 and LSE −inf.
fn attend<T: Float>(
    job: &Job<T>,
    rows: Range<usize>,
    out: (&mut [T], usize),
    lse: (&mut [T::Acc], usize),
    sc: &mut Scratch<T::Acc>,
) {
    super::simd::dispatch(Block {
        job,
        rows,
        out,
        lse,
        sc,
    });
}

/// [`attend`]'s arguments, run as a [`Kernel`](super::simd::Kernel): blocks of more than
/// 8 rows on the full QB-wide tile, smaller ones (decoding a few tokens) 8 rows at a time
/// so that they do not pay for QB.
struct Block<'a, 'j, T: Float> {
    job: &'a Job<'j, T>,
    rows: Range<usize>,
    out: (&'a mut [T], usize),
    lse: (&'a mut [T::Acc], usize),
    sc: &'a mut Scratch<T::Acc>,
}
impl<T: Float> super::simd::Kernel for Block<'_, '_, T> {
    type Output = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        let Block {
            job,
            rows,
            out: (out, os),
            lse: (lse, ls),
            sc,
        } = self;
        if rows.len() > 8 {
            return attend_tile::<T, QB, FMA>(job, rows, (out, os), (lse, ls), sc);
        }
        let dv = job.v.width;
        for i in rows.clone().step_by(8) {
            let r = i - rows.start;
            let sub = i..(i + 8).min(rows.end);
            let (o, l) = (&mut out[r * os * dv..], &mut lse[r * ls..]);
            attend_tile::<T, 8, FMA>(job, sub, (o, os), (l, ls), sc);
        }
    }
}

/// [`attend`] on a tile of `Q` (≤ QB) query columns; rows past `rows` are padding (zero
/// queries, never written out).
#[inline(always)]
fn attend_tile<T: Float, const Q: usize, const FMA: bool>(
    job: &Job<T>,
    rows: Range<usize>,
    (out, os): (&mut [T], usize),
    (lse, ls): (&mut [T::Acc], usize),
    sc: &mut Scratch<T::Acc>,
) {
    let (d, dv, nq) = (job.q.width, job.v.width, rows.len());
    let zero = T::Acc::zero();
    let neg_inf = T::Acc::neg_infinity();
    let m: &mut [T::Acc; Q] = (&mut sc.m[..Q]).try_into().unwrap();
    let l: &mut [T::Acc; Q] = (&mut sc.l[..Q]).try_into().unwrap();
    m.fill(neg_inf);
    l.fill(zero);
    sc.acc[..Q * dv].fill(zero);
    let qt = &mut sc.qt[..d * Q];
    qt.fill(zero);
    for (r, i) in rows.clone().enumerate() {
        for (t, &y) in job.q.row(i).iter().enumerate() {
            qt[t * Q + r] = y.to_acc() * job.scale;
        }
    }
    // The visible keys 0..limit(i) grow with i, so the block's last row bounds the keys
    // any row needs: blocks above the causal diagonal are skipped, and only blocks the
    // diagonal crosses (or a mask) need masking.
    let limit = |i: usize| key_limit(job.causal_shift, job.nk, i);
    let kend = if nq == 0 { 0 } else { limit(rows.end - 1) };
    for j0 in (0..kend).step_by(KB) {
        let kc = (j0 + KB).min(kend) - j0;
        let k = job.k.block(j0..j0 + kc, &mut sc.k);
        let v = job.v.block(j0..j0 + kc, &mut sc.v);
        let st = &mut sc.st[..kc * Q];
        scores::<_, Q, FMA>(&sc.qt[..d * Q], k, st);
        if !matches!(job.mask, Mask::None) {
            for (c, s) in st.chunks_exact_mut(Q).enumerate() {
                for (r, i) in rows.clone().enumerate() {
                    let j = j0 + c;
                    s[r] = if j < limit(i) {
                        job.mask.apply(i, j, s[r])
                    } else {
                        neg_inf
                    };
                }
            }
        } else if let Some(shift) = job.causal_shift.filter(|_| limit(rows.start) < j0 + kc) {
            // Key j is seen by the block's queries from i = j − shift on.
            for (c, s) in st.chunks_exact_mut(Q).enumerate() {
                let first = (j0 + c) as isize - shift - rows.start as isize;
                s[..first.clamp(0, nq as isize) as usize].fill(neg_inf);
            }
        }
        let alpha = online_softmax::<_, Q>(st, m, l);
        accumulate::<_, Q, FMA>(st, v, &alpha, &mut sc.acc[..Q * dv]);
    }
    for r in 0..nq {
        let o = &mut out[r * os * dv..][..dv];
        if l[r] > zero {
            let inv = l[r].recip();
            for (o, &a) in o.iter_mut().zip(&sc.acc[r * dv..][..dv]) {
                *o = T::from_acc(a * inv);
            }
            lse[r * ls] = m[r] + l[r].ln();
        } else {
            o.fill(T::from_acc(zero));
            lse[r * ls] = neg_inf;
        }
    }
}

/// `st[c][r] = k[c]·qt[·][r]`: the scores of `st.len() / Q` keys (rows of `k`) against
/// `Q` queries, [`KT`] keys at a time held in registers across the `d` products.
#[inline(always)]
fn scores<A: Real, const Q: usize, const FMA: bool>(qt: &[A], k: &[A], st: &mut [A]) {
    let d = qt.len() / Q;
    let mut keys = st.chunks_exact_mut(KT * Q);
    let mut kr = k.chunks_exact(KT * d);
    for (s, k) in (&mut keys).zip(&mut kr) {
        score_tile::<A, Q, KT, FMA>(qt, k, s);
    }
    for (s, k) in keys
        .into_remainder()
        .chunks_exact_mut(Q)
        .zip(kr.remainder().chunks_exact(d))
    {
        score_tile::<A, Q, 1, FMA>(qt, k, s);
    }
}

/// Keys per tile of [`scores`].
const KT: usize = 4;

/// `N` keys' scores (rows of `k`, `[N, d]`) against the `Q` queries of `qt` into `s`.
#[inline(always)]
fn score_tile<A: Real, const Q: usize, const N: usize, const FMA: bool>(
    qt: &[A],
    k: &[A],
    s: &mut [A],
) {
    let d = qt.len() / Q;
    let mut t = [[A::zero(); Q]; N];
    for (e, q) in qt.chunks_exact(Q).enumerate() {
        for (u, t) in t.iter_mut().enumerate() {
            let kv = k[u * d + e];
            for (t, &q) in t.iter_mut().zip(q) {
                *t = madd::<A, FMA>(kv, q, *t);
            }
        }
    }
    for (s, t) in s.chunks_exact_mut(Q).zip(&t) {
        s.copy_from_slice(t);
    }
}

/// One block of the online softmax, down the keys of `st` (`[keys, Q]`) for each query:
/// the running max `m` takes the block's, the scores become exp(s − m), the running sum
/// `l` is rescaled and adds them; returns each query's rescaling factor exp(m_old − m).
/// A query whose max is still −inf has seen no key: its probabilities are exp(−inf) = 0.
#[inline(always)]
fn online_softmax<A: Real, const Q: usize>(st: &mut [A], m: &mut [A; Q], l: &mut [A; Q]) -> [A; Q] {
    let neg_inf = A::neg_infinity();
    let mut top = *m;
    for s in st.chunks_exact(Q) {
        for (t, &s) in top.iter_mut().zip(s) {
            *t = t.max(s);
        }
    }
    let safe = top.map(|t| if t == neg_inf { A::zero() } else { t });
    let mut alpha = [A::zero(); Q];
    for r in 0..Q {
        alpha[r] = (m[r] - safe[r]).exp_v();
    }
    *m = top;
    let mut sum = [A::zero(); Q];
    for s in st.chunks_exact_mut(Q) {
        for r in 0..Q {
            let p = (s[r] - safe[r]).exp_v();
            s[r] = p;
            sum[r] = sum[r] + p;
        }
    }
    for r in 0..Q {
        l[r] = l[r] * alpha[r] + sum[r];
    }
    alpha
}

/// `acc[r] = alpha[r]·acc[r] + Σ_c pt[c][r]·v[c]` for the `Q` rows of `acc` (`[Q, Dv]`):
/// tiles of four rows by 64 columns (then 16, then the rest) held in registers across the
/// keys.
#[inline(always)]
fn accumulate<A: Real, const Q: usize, const FMA: bool>(
    pt: &[A],
    v: &[A],
    alpha: &[A; Q],
    acc: &mut [A],
) {
    let dv = acc.len() / Q;
    for r0 in (0..Q).step_by(4) {
        let mut col = 0;
        while dv - col >= 64 {
            acc_tile::<A, Q, 64, FMA>(pt, v, alpha, acc, r0, col, 64);
            col += 64;
        }
        while dv - col >= 16 {
            acc_tile::<A, Q, 16, FMA>(pt, v, alpha, acc, r0, col, 16);
            col += 16;
        }
        if col < dv {
            acc_tile::<A, Q, 16, FMA>(pt, v, alpha, acc, r0, col, dv - col);
        }
    }
}

/// One tile of [`accumulate`]: rows `r0..r0 + 4`, columns `col..col + w` (`w ≤ W`; the
/// loops run over all `W` only when `w == W`, so a full tile stays in registers).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn acc_tile<A: Real, const Q: usize, const W: usize, const FMA: bool>(
    pt: &[A],
    v: &[A],
    alpha: &[A; Q],
    acc: &mut [A],
    r0: usize,
    col: usize,
    w: usize,
) {
    let dv = acc.len() / Q;
    let mut t = [[A::zero(); W]; 4];
    for (u, t) in t.iter_mut().enumerate() {
        let a = alpha[r0 + u];
        for (t, &x) in t.iter_mut().zip(&acc[(r0 + u) * dv + col..][..w]) {
            *t = x * a;
        }
    }
    for (p, v) in pt.chunks_exact(Q).zip(v.chunks_exact(dv)) {
        let v = &v[col..][..w];
        for (u, t) in t.iter_mut().enumerate() {
            let p = p[r0 + u];
            for (t, &v) in t.iter_mut().zip(v) {
                *t = madd::<A, FMA>(p, v, *t);
            }
        }
    }
    for (u, t) in t.iter().enumerate() {
        acc[(r0 + u) * dv + col..][..w].copy_from_slice(&t[..w]);
    }
}

#[inline(always)]
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

/// `y += a·x`.
#[inline]
fn axpy<A: Real>(y: &mut [A], a: A, x: &[A]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = *y + a * x;
    }
}

/// Row r of `s` viewed as rows of `w` elements.
#[inline]
fn row<T>(s: &[T], r: usize, w: usize) -> &[T] {
    &s[r * w..][..w]
}
#[inline]
fn row_mut<T>(s: &mut [T], r: usize, w: usize) -> &mut [T] {
    &mut s[r * w..][..w]
}

/// Attention backward (flash-style, from the forward's Y and LSE): outs = [dQ, dK, dV,
/// (dMask)]; `want[i]` false means output i is not read and is left unwritten. dMask, the
/// gradient of the additive mask in full `[B, Hq, Sq, Skv]` shape, is the only output
/// of that size and is computed only when asked for; a bool mask has none.
/// With K and V omitted (packed QKV), output 0 is dQKV, packed the same way.
#[allow(clippy::too_many_arguments)]
pub fn attention_grad(
    node: &Node,
    dy: &Tensor,
    qkv: [Option<&Tensor>; 3],
    mask: Option<&Tensor>,
    y: &Tensor,
    lse: &Tensor,
    is_causal: bool,
    scale: Option<f32>,
    want: &[bool],
    outs: &mut [Tensor],
) -> Result<()> {
    let packed = qkv[1].is_none();
    let [q, k, v] = inputs(node, qkv)?;
    let (q, k, v) = (&*q, &*k, &*v);
    let a = dims(node, q, k, v)?;
    let inp = [dy, q, k, v, y];
    let run = |want: &[bool], outs: &mut [Tensor]| {
        crate::with_float!(q.dtype(), T => attention_grad_t::<T>(a, inp, mask, lse, is_causal, scale, want, outs),
            _ => Err(crate::err!(Runtime, "{}: needs float inputs, got {}", node.describe(), q.dtype())))
    };
    if !packed {
        return run(want, outs);
    }
    // dQ, dK and dV apart (dMask moved in beside them), then packed into output 0.
    let w = |i: usize| want.get(i).copied().unwrap_or(true);
    let mut parts: Vec<Tensor> = [q, k, v]
        .iter()
        .map(|t| Tensor::zeros(t.dtype(), t.shape()))
        .collect();
    if let Some(m) = outs.get_mut(3) {
        parts.push(std::mem::replace(m, Tensor::zeros(q.dtype(), &[0])));
    }
    run(&[w(0), w(0), w(0), w(3)], &mut parts)?;
    if let Some(m) = parts.get_mut(3) {
        std::mem::swap(m, &mut outs[3]);
    }
    if w(0) {
        let ins: Vec<Option<&Tensor>> = parts[..3].iter().map(Some).collect();
        super::shape::concat(&ins, -1, &mut outs[0])?;
    }
    Ok(())
}

/// VarlenAttention backward: `[dY, Q, K, V]`, cu_seqlens, the forward's Y and LSE;
/// outs = [dQ, dK, dV]. Gradients of a sequence without queries or keys are 0.
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
    let [dy, q, k, v] = t;
    let (cq, ck) = sequences(node, cu_q, cu_k, q, k)?;
    let inp = [dy, q, k, v, y];
    crate::with_float!(q.dtype(), T => varlen_grad_t::<T>(inp, lse, &cq, &ck, is_causal, scale, want, outs),
        _ => Err(crate::err!(Runtime, "{}: needs float inputs, got {}", node.describe(), q.dtype())))
}

/// The backward's inputs as rows: Q `[Nq, D]`, dY and Y `[Nq, Dv]`, LSE `[Nq]`, K
/// `[Nk, D]`, V `[Nk, Dv]`, where a row is one head's vector at one position (Nq =
/// B·Hq·Sq for Attention, Tq·Hq for VarlenAttention).
#[derive(Clone, Copy)]
struct GradIn<'a, T: Float> {
    q: &'a [T],
    dy: &'a [T],
    y: &'a [T],
    lse: &'a [T::Acc],
    k: &'a [T],
    v: &'a [T],
    d: usize,
    dv: usize,
    scale: T::Acc,
}
impl<'a, T: Float> GradIn<'a, T>
where
    T::Acc: Elem,
{
    /// From `[dY, Q, K, V, Y]`, LSE and the head sizes of Q and V.
    fn new(
        t: [&'a Tensor; 5],
        lse: &'a Tensor,
        scale: Option<f32>,
        (d, dv): (usize, usize),
    ) -> Self {
        let [dy, q, k, v, y] = t;
        GradIn {
            q: q.as_slice(),
            dy: dy.as_slice(),
            y: y.as_slice(),
            lse: lse.as_slice(),
            k: k.as_slice(),
            v: v.as_slice(),
            d,
            dv,
            scale: T::Acc::c(default_scale(d, scale)),
        }
    }
}
impl<T: Float> GradIn<'_, T> {
    /// The rows one task reads: query rows `q`, key rows `k`.
    fn rows(&self, q: &Range<usize>, k: &Range<usize>) -> Self {
        let (d, dv) = (self.d, self.dv);
        GradIn {
            q: &self.q[q.start * d..q.end * d],
            dy: &self.dy[q.start * dv..q.end * dv],
            y: &self.y[q.start * dv..q.end * dv],
            lse: &self.lse[q.clone()],
            k: &self.k[k.start * d..k.end * d],
            v: &self.v[k.start * dv..k.end * dv],
            ..*self
        }
    }
}

/// The gradients one task writes, as rows of the same views as [`GradIn`] (dMask `[Nq,
/// Skv]`); `None` where not wanted.
struct GradOut<'a, T> {
    dq: Option<&'a mut [T]>,
    dk: Option<&'a mut [T]>,
    dv: Option<&'a mut [T]>,
    dmask: Option<&'a mut [T]>,
}

/// Where one kv head's problem lies in a task's rows: query row i of the group's hh-th
/// head is row `q0 + hh*q_head + i*q_row` of Q, dY, Y and dQ, and row
/// `s0 + hh*s_head + i*s_row` of LSE and dMask (the same but for 3-D Attention, whose
/// statistics stay `[B, Hq, Sq]`); key j is row `k0 + j*k_row` (of K, V, dK and dV).
#[derive(Clone, Copy)]
struct Layout {
    q0: usize,
    q_head: usize,
    q_row: usize,
    s0: usize,
    s_head: usize,
    s_row: usize,
    k0: usize,
    k_row: usize,
}
impl Layout {
    /// Statistics laid out as the data.
    fn same(q0: usize, q_head: usize, q_row: usize, k0: usize, k_row: usize) -> Layout {
        Layout {
            q0,
            q_head,
            q_row,
            s0: q0,
            s_head: q_head,
            s_row: q_row,
            k0,
            k_row,
        }
    }
    #[inline]
    fn q(&self, hh: usize, i: usize) -> usize {
        self.q0 + hh * self.q_head + i * self.q_row
    }
    #[inline]
    fn s(&self, hh: usize, i: usize) -> usize {
        self.s0 + hh * self.s_head + i * self.s_row
    }
    #[inline]
    fn k(&self, j: usize) -> usize {
        self.k0 + j * self.k_row
    }
}

/// One kv head's backward problem: `group` query heads of `nq` rows each, against `nk`
/// keys.
struct GradJob<'a, T: Float> {
    lay: Layout,
    group: usize,
    nq: usize,
    nk: usize,
    causal_shift: Option<isize>,
    /// Offset to the group's first query head; head hh adds `for_head(0, hh)`.
    mask: Mask<'a, T>,
}

/// A unit of parallel work: query rows `q` and key rows `k` of the row views, which no
/// other task touches, and the kv-head problems that lie in them.
struct Task<'a, T: Float> {
    q: Range<usize>,
    k: Range<usize>,
    jobs: Vec<GradJob<'a, T>>,
}

#[allow(clippy::too_many_arguments)]
fn attention_grad_t<T: Float>(
    a: AttnDims,
    t: [&Tensor; 5],
    mask: Option<&Tensor>,
    lse: &Tensor,
    causal: bool,
    scale: Option<f32>,
    want: &[bool],
    outs: &mut [Tensor],
) -> Result<()>
where
    T::Acc: Elem,
{
    let AttnDims {
        b,
        hq,
        hkv,
        sq,
        skv,
        ..
    } = a;
    let mask = read_mask::<T>(mask)?;
    if matches!(mask, Mask::Bool(..)) && want.get(3) == Some(&true) {
        crate::bail!(
            Runtime,
            "AttentionGrad: dMask (output 3) was asked for, but a bool attn_mask has no gradient"
        );
    }
    let group = hq / hkv;
    let job = |lay: Layout, bi: usize, g: usize| GradJob {
        lay,
        group,
        nq: sq,
        nk: skv,
        causal_shift: causal.then_some(0),
        mask: mask.for_head(bi, g * group),
    };
    let tasks = if a.packed {
        // One task per batch, with every head: in [B, S, H·D] layout (and [B, Hq, Sq] for
        // LSE and dMask) a batch's rows are contiguous, a head's are not.
        (0..b)
            .map(|bi| Task {
                q: bi * hq * sq..(bi + 1) * hq * sq,
                k: bi * hkv * skv..(bi + 1) * hkv * skv,
                jobs: (0..hkv)
                    .map(|g| {
                        let lay = Layout {
                            s0: g * group * sq,
                            s_head: sq,
                            s_row: 1,
                            ..Layout::same(g * group, 1, hq, g, hkv)
                        };
                        job(lay, bi, g)
                    })
                    .collect(),
            })
            .collect()
    } else {
        // One task per (batch, kv head): it owns that head's dK/dV rows and the dQ (and
        // dMask) rows of its query heads, which are contiguous in [B, Hq, ...] layout.
        (0..b * hkv)
            .map(|bg| Task {
                q: bg * group * sq..(bg + 1) * group * sq,
                k: bg * skv..(bg + 1) * skv,
                jobs: vec![job(Layout::same(0, sq, 1, 0, 1), bg / hkv, bg % hkv)],
            })
            .collect()
    };
    run_grad(
        GradIn::new(t, lse, scale, (a.d, a.dv)),
        tasks,
        skv,
        want,
        outs,
    );
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn varlen_grad_t<T: Float>(
    t: [&Tensor; 5],
    lse: &Tensor,
    cq: &[usize],
    ck: &[usize],
    causal: bool,
    scale: Option<f32>,
    want: &[bool],
    outs: &mut [Tensor],
) -> Result<()>
where
    T::Acc: Elem,
{
    let (hq, hkv) = (t[1].shape()[1], t[2].shape()[1]);
    let group = hq / hkv;
    // One task per sequence, with every head: a token's rows of all heads are contiguous
    // in [T, H, ...] layout, so a sequence's rows are too.
    let tasks = (0..cq.len() - 1)
        .map(|b| {
            let (lq, lk) = (cq[b + 1] - cq[b], ck[b + 1] - ck[b]);
            let job = |g: usize| GradJob {
                lay: Layout::same(g * group, 1, hq, g, hkv),
                group,
                nq: lq,
                nk: lk,
                causal_shift: causal.then_some(lk as isize - lq as isize),
                mask: Mask::<T>::None,
            };
            Task {
                q: cq[b] * hq..cq[b + 1] * hq,
                k: ck[b] * hkv..ck[b + 1] * hkv,
                jobs: (0..hkv).map(job).collect(),
            }
        })
        .collect();
    let heads = (t[1].shape()[2], t[3].shape()[2]);
    run_grad(GradIn::new(t, lse, scale, heads), tasks, 0, want, outs);
    Ok(())
}

/// Runs the backward `tasks` in parallel; they cover the row views in order, each owning
/// its rows of every output, so no two tasks write the same element. `skv` is dMask's
/// row width.
fn run_grad<T: Float>(
    inp: GradIn<T>,
    tasks: Vec<Task<T>>,
    skv: usize,
    want: &[bool],
    outs: &mut [Tensor],
) {
    let q_rows: Vec<usize> = tasks.iter().map(|t| t.q.len()).collect();
    let k_rows: Vec<usize> = tasks.iter().map(|t| t.k.len()).collect();
    let mut grads = (outs.iter_mut().zip(want)).map(|(t, &w)| w.then(|| t.as_mut_slice::<T>()));
    // The next output, cut into the tasks' pieces (rows of `width` elements).
    let mut next = |rows: &[usize], width: usize| {
        let lens = rows.iter().map(|n| n * width);
        match grads.next().flatten() {
            Some(s) => split(s, lens).into_iter().map(Some).collect(),
            None => lens.map(|_| None).collect::<Vec<_>>(),
        }
    };
    let (dq, dk) = (next(&q_rows, inp.d), next(&k_rows, inp.d));
    let (dv, dmask) = (next(&k_rows, inp.dv), next(&q_rows, skv));
    let work: Vec<_> = (tasks.iter())
        .zip(dq.into_iter().zip(dk))
        .zip(dv.into_iter().zip(dmask))
        .map(|((t, (dq, dk)), (dv, dmask))| (t, GradOut { dq, dk, dv, dmask }))
        .collect();
    work.into_par_iter().for_each_init(
        || GradScratch::new(inp.d, inp.dv),
        |sc, (task, mut out)| {
            let inp = inp.rows(&task.q, &task.k);
            if let Some(m) = out.dmask.as_deref_mut() {
                m.fill(T::from_acc(T::Acc::zero())); // masked and skipped entries stay 0
            }
            for job in &task.jobs {
                grad_kv_head(&inp, job, &mut out, sc);
            }
        },
    );
}

/// Per-task buffers of the backward, reused across its jobs and blocks.
struct GradScratch<A> {
    q: Vec<A>,     // [QB, D] scaled queries
    dy: Vec<A>,    // [QB, Dv]
    delta: Vec<A>, // [QB] dY_i·Y_i
    lse: Vec<A>,   // [QB]
    dq: Vec<A>,    // [QB, D] dQ accumulator (before the scale)
    k: Vec<A>,     // [nk, D] the kv head's keys
    v: Vec<A>,     // [nk, Dv]
    dk: Vec<A>,    // [nk, D] dK accumulator
    dv: Vec<A>,    // [nk, Dv] dV accumulator
}
impl<A: Real> GradScratch<A> {
    fn new(d: usize, dv: usize) -> Self {
        let z = A::zero();
        GradScratch {
            q: vec![z; QB * d],
            dy: vec![z; QB * dv],
            delta: vec![z; QB],
            lse: vec![z; QB],
            dq: vec![z; QB * d],
            k: vec![],
            v: vec![],
            dk: vec![],
            dv: vec![],
        }
    }
}

/// Backward of one kv head's problem: widens its keys and values once, runs every query
/// block of every query head of the group (writing their dQ and dMask rows), and writes
/// dK and dV, which sum over all of them.
fn grad_kv_head<T: Float>(
    inp: &GradIn<T>,
    job: &GradJob<T>,
    out: &mut GradOut<T>,
    sc: &mut GradScratch<T::Acc>,
) {
    let (d, dv, nk, lay) = (inp.d, inp.dv, job.nk, job.lay);
    let zero = T::Acc::zero();
    for (buf, w) in [
        (&mut sc.k, d),
        (&mut sc.v, dv),
        (&mut sc.dk, d),
        (&mut sc.dv, dv),
    ] {
        buf.clear();
        buf.resize(nk * w, zero);
    }
    for j in 0..nk {
        widen(row_mut(&mut sc.k, j, d), row(inp.k, lay.k(j), d));
        widen(row_mut(&mut sc.v, j, dv), row(inp.v, lay.k(j), dv));
    }
    for hh in 0..job.group {
        for i in (0..job.nq).step_by(QB) {
            grad_block(inp, job, hh, i..(i + QB).min(job.nq), out, sc);
        }
    }
    let narrow = |dst: &mut [T], src: &[T::Acc]| {
        for (o, &a) in dst.iter_mut().zip(src) {
            *o = T::from_acc(a);
        }
    };
    for j in 0..nk {
        if let Some(o) = out.dk.as_deref_mut() {
            narrow(row_mut(o, lay.k(j), d), row(&sc.dk, j, d));
        }
        if let Some(o) = out.dv.as_deref_mut() {
            narrow(row_mut(o, lay.k(j), dv), row(&sc.dv, j, dv));
        }
    }
}

/// Query rows `rows` (at most QB) of head `hh` of `job`: recomputes P = exp(S − LSE) one
/// key block at a time, exactly as the forward computed S, and accumulates
/// dV += Pᵀ·dY, dS = P∘(dY·Vᵀ − D) with D_i = dY_i·Y_i, dQ += scale·dS·K and
/// dK += scale·dSᵀ·Q; dMask = dS.
fn grad_block<T: Float>(
    inp: &GradIn<T>,
    job: &GradJob<T>,
    hh: usize,
    rows: Range<usize>,
    out: &mut GradOut<T>,
    sc: &mut GradScratch<T::Acc>,
) {
    let (d, dv, lay) = (inp.d, inp.dv, job.lay);
    let zero = T::Acc::zero();
    let mask = job.mask.for_head(0, hh);
    let GradScratch {
        q,
        dy,
        delta,
        lse,
        dq,
        k,
        v,
        dk,
        dv: dvs,
    } = sc;
    for (r, i) in rows.clone().enumerate() {
        let at = lay.q(hh, i);
        for (x, &y) in row_mut(q, r, d).iter_mut().zip(row(inp.q, at, d)) {
            *x = y.to_acc() * inp.scale;
        }
        widen(row_mut(dy, r, dv), row(inp.dy, at, dv));
        let y = row(inp.y, at, dv).iter().map(|y| y.to_acc());
        delta[r] = row(dy, r, dv).iter().zip(y).map(|(&a, b)| a * b).sum();
        lse[r] = inp.lse[lay.s(hh, i)];
    }
    dq[..rows.len() * d].fill(zero);
    let (want_dk, want_dv) = (out.dk.is_some(), out.dv.is_some());
    let limit = |i: usize| key_limit(job.causal_shift, job.nk, i);
    let kend = rows.clone().last().map_or(0, limit);
    for j0 in (0..kend).step_by(KB) {
        let j1 = (j0 + KB).min(kend);
        for (r, i) in rows.clone().enumerate() {
            if lse[r] == T::Acc::neg_infinity() {
                continue; // the row sees no key: P = 0 (and S − LSE would be NaN)
            }
            let (qr, dyr, dqr) = (row(q, r, d), row(dy, r, dv), row_mut(dq, r, d));
            for j in j0..limit(i).min(j1) {
                let kj = row(k, j, d);
                let p = (mask.apply(i, j, dot(qr, kj)) - lse[r]).exp();
                if p == zero {
                    continue; // masked out (or underflowed): nothing flows through it
                }
                if want_dv {
                    axpy(row_mut(dvs, j, dv), p, dyr);
                }
                let ds = p * (dot(dyr, row(v, j, dv)) - delta[r]);
                axpy(dqr, ds, kj);
                if want_dk {
                    axpy(row_mut(dk, j, d), ds, qr); // qr is scale·Q_i
                }
                if let Some(m) = out.dmask.as_deref_mut() {
                    m[lay.s(hh, i) * job.nk + j] = T::from_acc(ds);
                }
            }
        }
    }
    if let Some(o) = out.dq.as_deref_mut() {
        for (r, i) in rows.enumerate() {
            let dst = row_mut(o, lay.q(hh, i), d);
            for (o, &a) in dst.iter_mut().zip(row(dq, r, d)) {
                *o = T::from_acc(a * inp.scale);
            }
        }
    }
}
