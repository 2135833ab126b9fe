//! Attention and VarlenAttention on CUDA, forward with the optional LSE output and
//! backward from it. Attention with head sizes up to 64 (f32, f16, bf16) or 128 (f16/bf16
//! forward) runs the tiled flash kernels of cuda/flash.cu (tensor cores for f16/bf16:
//! `wgmma` on Hopper for heads up to 64, `mma.sync` elsewhere; f32 on tensor cores in
//! 3xTF32, or with `--dtype tf32` one TF32 pass, cuda/flash_tf32.cu, or on CUDA cores);
//! the rest (VarlenAttention, larger heads, f64) the row-per-warp kernels of
//! cuda/attention.cu. Shapes, masks and cu_seqlens are checked here; the kernels take one
//! `AttnGeom` that describes either layout.

use super::device::{launch_grid, suffix, Arg};
use super::{unsupported, Cuda, V};
use crate::backends::common::{self, wanted};
use crate::error::Result;
use crate::graph::infer::{qkv_parts, AttnDims, ValueType};
use crate::graph::Node;
use crate::tensor::DType;
use cudarc::driver::{CudaSlice, DeviceRepr};

/// Head sizes up to this run (32 lanes × ATT_VEC elements in cuda/attention.cu).
const MAX_HEAD: usize = 256;

/// cuda/common.cuh `AttnGeom`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnGeom {
    hq: i64,
    hkv: i64,
    sq: i64,
    skv: i64,
    d: i64,
    dv: i64,
    ms: [i64; 4],
    /// Element strides (batch, head, row) of Q, K, V, Y (and of dQ, dK, dV, dY); the head
    /// vectors are contiguous. See [`bhsd`] and [`bshd`].
    st: [[i64; 3]; 4],
    rows: i64,
    nseq: i64,
    scale: f64,
    varlen: i32,
    causal: i32,
    mask_kind: i32,
}
// Safety: plain old data laid out as the C struct.
unsafe impl DeviceRepr for AttnGeom {}

/// Strides of a contiguous `[B, H, S, D]` tensor (the 4-D Attention layout).
fn bhsd(h: usize, s: usize, d: usize) -> [i64; 3] {
    [(h * s * d) as i64, (s * d) as i64, d as i64]
}

/// Strides of a contiguous `[B, S, H, D]` tensor (ONNX's 3-D layout `[B, S, H·D]`, and
/// VarlenAttention's packed `[T, H, D]` as `S = T`).
fn bshd(h: usize, s: usize, d: usize) -> [i64; 3] {
    [(s * h * d) as i64, d as i64, (h * d) as i64]
}

/// Threads per block: 8 warps, one row each.
const BLOCK: u32 = 256;

fn grid(rows: usize) -> u32 {
    (rows * 32).div_ceil(BLOCK as usize) as u32
}

fn check_heads(node: &Node, q: &V, d: usize, dv: usize) -> Result<()> {
    if !q.dtype().is_float() {
        return Err(unsupported(node, q.dtype()));
    }
    common::check_heads(node, "cuda", MAX_HEAD, d, dv)
}

fn default_scale(d: usize, scale: Option<f32>) -> f64 {
    scale.map_or(1.0 / (d as f64).sqrt(), |s| s as f64)
}

/// The problem sizes of an Attention or AttentionGrad node from its Q, K and V.
fn dims(node: &Node, q: &V, k: &V, v: &V) -> Result<AttnDims> {
    AttnDims::new(&node.op, q.shape(), k.shape(), v.shape())
        .map_err(|e| crate::err!(Runtime, "{}: {e}", node.describe()))
}

/// The geometry of Attention `Q [B, Hq, Sq, D]`, `K, V [B, Hkv, Skv, D|Dv]`, or of its 3-D
/// form `[B, S, H·D]` read in place through the strides, and the mask (kind and broadcast
/// strides over `[B, Hq, Sq, Skv]`). LSE and delta are `[B, Hq, Sq]` in both forms.
fn attention_geom(
    node: &Node,
    a: &AttnDims,
    q: &V,
    mask: Option<&V>,
    causal: bool,
    scale: Option<f32>,
) -> Result<AttnGeom> {
    let (d, dv) = (a.d, a.dv);
    check_heads(node, q, d, dv)?;
    let (ms, kind) = common::attn_mask(node, q.dtype(), mask.map(|m| (m.dtype(), m.shape())))?;
    let st: fn(usize, usize, usize) -> [i64; 3] = if a.packed { bshd } else { bhsd };
    Ok(AttnGeom {
        hq: a.hq as i64,
        hkv: a.hkv as i64,
        sq: a.sq as i64,
        skv: a.skv as i64,
        d: d as i64,
        dv: dv as i64,
        ms,
        st: [
            st(a.hq, a.sq, d),
            st(a.hkv, a.skv, d),
            st(a.hkv, a.skv, dv),
            st(a.hq, a.sq, dv),
        ],
        rows: (a.b * a.hq * a.sq) as i64,
        nseq: 0,
        varlen: 0,
        causal: causal as i32,
        mask_kind: kind,
        scale: default_scale(d, scale),
    })
}

/// Validated cu_seqlens (start 0, never decreasing, ending at the packed length) on the
/// device, and their sequence count.
fn cu_seqlens(
    c: &Cuda,
    node: &Node,
    cu: [&V; 2],
    totals: [usize; 2],
) -> Result<([CudaSlice<i64>; 2], usize)> {
    let (q, k) = (c.read(cu[0])?.to_i64_vec(), c.read(cu[1])?.to_i64_vec());
    if q.len() != k.len() || q.is_empty() {
        crate::bail!(
            Runtime,
            "{}: cu_seqlens_q and cu_seqlens_k must have the same number (B+1 >= 1) of entries, got {} and {}",
            node.describe(),
            q.len(),
            k.len()
        );
    }
    for (cu, what, total) in [
        (&q, "cu_seqlens_q", totals[0]),
        (&k, "cu_seqlens_k", totals[1]),
    ] {
        if cu[0] != 0 || cu.windows(2).any(|w| w[1] < w[0]) || cu[cu.len() - 1] != total as i64 {
            crate::bail!(
                Runtime,
                "{}: {what} must start at 0, never decrease and end at {total}, got {cu:?}",
                node.describe()
            );
        }
    }
    Ok(([c.upload_vec(&q)?, c.upload_vec(&k)?], q.len() - 1))
}

/// The geometry of VarlenAttention `Q [Tq, Hq, D]`, `K, V [Tk, Hkv, D|Dv]`.
fn varlen_geom(
    node: &Node,
    q: &V,
    k: &V,
    v: &V,
    nseq: usize,
    causal: bool,
    scale: Option<f32>,
) -> Result<AttnGeom> {
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    let (d, dv) = (qs[2], vs[2]);
    check_heads(node, q, d, dv)?;
    let (tq, tk, hq, hkv) = (qs[0], ks[0], qs[1], ks[1]);
    Ok(AttnGeom {
        st: [
            bshd(hq, tq, d),
            bshd(hkv, tk, d),
            bshd(hkv, tk, dv),
            bshd(hq, tq, dv),
        ],
        hq: qs[1] as i64,
        hkv: ks[1] as i64,
        d: d as i64,
        dv: dv as i64,
        rows: (qs[0] * qs[1]) as i64,
        nseq: nseq as i64,
        varlen: 1,
        causal: causal as i32,
        scale: default_scale(d, scale),
        ..Default::default()
    })
}

fn forward(
    c: &Cuda,
    g: AttnGeom,
    qkv: [&V; 3],
    mask: u64,
    cu: [u64; 2],
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let [q, k, v] = qkv;
    let lse = wanted(outs, want, 1).map_or(0, |l| l.p);
    if let Some(f) = fast(c, &g, q.dtype(), false) {
        return fast_forward(c, f, g, qkv, mask, outs[0].p, lse);
    }
    let args = [
        Arg::Attn(g),
        Arg::Ptr(q.p),
        Arg::Ptr(k.p),
        Arg::Ptr(v.p),
        Arg::Ptr(mask),
        Arg::Ptr(cu[0]),
        Arg::Ptr(cu[1]),
        Arg::Ptr(outs[0].p),
        Arg::Ptr(lse),
    ];
    c.launch(
        &format!("attn_fwd_{}", suffix(q.dtype())),
        grid(g.rows as usize),
        BLOCK,
        &args,
    )
}

/// Q, K and V of an Attention node: its inputs, or (K and V omitted) views of the parts
/// of the packed QKV (`qkv_parts`), which the kernels read, and the gradient kernels
/// write into dQKV, in place: rows of the packed width.
struct Qkv {
    tys: [ValueType; 3],
    /// Element offsets of the parts in a packed row (0 unpacked).
    offs: [usize; 3],
    ptrs: [u64; 3],
    /// The packed row's width.
    width: Option<usize>,
}

impl Qkv {
    fn new(node: &Node, qkv: [Option<&V>; 3]) -> Result<Qkv> {
        match qkv {
            [Some(q), Some(k), Some(v)] => Ok(Qkv {
                tys: [q.ty.clone(), k.ty.clone(), v.ty.clone()],
                offs: [0; 3],
                ptrs: [q.p, k.p, v.p],
                width: None,
            }),
            [Some(x), None, None] => {
                let parts = qkv_parts(&node.op, x.shape())
                    .map_err(|e| crate::err!(Runtime, "{}: {e}", node.describe()))?;
                let offs = parts.clone().map(|(_, o)| o);
                let mut q = Qkv {
                    tys: parts.map(|(s, _)| ValueType::new(x.dtype(), &s)),
                    offs,
                    ptrs: [0; 3],
                    width: x.shape().last().copied(),
                };
                q.ptrs = q.at(x.p);
                Ok(q)
            }
            _ => crate::bail!(
                Runtime,
                "{}: Q, K and V, or the packed QKV alone",
                node.describe()
            ),
        }
    }
    /// The parts' addresses in a packed tensor at `p` (of dQKV, say).
    fn at(&self, p: u64) -> [u64; 3] {
        let esz = self.tys[0].dtype.size() as u64;
        self.offs.map(|o| p + o as u64 * esz)
    }
    fn views(&self, ptrs: [u64; 3]) -> [V<'_>; 3] {
        [0, 1, 2].map(|i| V {
            p: ptrs[i],
            ty: &self.tys[i],
            buf: None,
        })
    }
    /// Packed: Q's, K's and V's rows (and dQ's, dK's, dV's) are the packed width apart,
    /// `[S·W, D, W]` where unpacked 3-D tensors have `[S·H·D, D, H·D]`.
    fn strides(&self, a: &AttnDims, g: &mut AttnGeom) {
        if let Some(w) = self.width {
            let row = |s: usize, d: usize| [(s * w) as i64, d as i64, w as i64];
            g.st[0] = row(a.sq, a.d);
            g.st[1] = row(a.skv, a.d);
            g.st[2] = row(a.skv, a.dv);
        }
    }
}

/// With K and V omitted, Q is the packed QKV (`qkv_parts`).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    c: &Cuda,
    node: &Node,
    qkv: [Option<&V>; 3],
    mask: Option<V>,
    causal: bool,
    scale: Option<f32>,
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let parts = Qkv::new(node, qkv)?;
    let [q, k, v] = parts.views(parts.ptrs);
    let a = dims(node, &q, &k, &v)?;
    let mut g = attention_geom(node, &a, &q, mask.as_ref(), causal, scale)?;
    parts.strides(&a, &mut g);
    forward(
        c,
        g,
        [&q, &k, &v],
        mask.map_or(0, |m| m.p),
        [0, 0],
        outs,
        want,
    )
}

#[allow(clippy::too_many_arguments)]
pub fn varlen(
    c: &Cuda,
    node: &Node,
    qkv: [&V; 3],
    cu: [&V; 2],
    causal: bool,
    scale: Option<f32>,
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let [q, k, v] = qkv;
    let (cus, nseq) = cu_seqlens(c, node, cu, [q.shape()[0], k.shape()[0]])?;
    let g = varlen_geom(node, q, k, v, nseq, causal, scale)?;
    forward(c, g, qkv, 0, [c.addr(&cus[0]), c.addr(&cus[1])], outs, want)
}

/// The backward passes: delta = rowsum(dY∘Y), then dQ (and dMask) per query row, then dK
/// and dV per key row; `key_rows` is how many key rows there are.
#[allow(clippy::too_many_arguments)]
fn backward(
    c: &Cuda,
    g: AttnGeom,
    key_rows: usize,
    ins: [&V; 4],
    yl: [&V; 2],
    mask: u64,
    cu: [u64; 2],
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let [dy, q, k, v] = ins;
    let [y, lse] = yl;
    let sfx = suffix(q.dtype());
    let acc = if q.dtype() == DType::F64 { 8 } else { 4 };
    if lse.dtype().size() != acc {
        crate::bail!(
            Runtime,
            "attention backward: LSE must be the statistics dtype, got {}",
            lse.dtype()
        );
    }
    let dp = c.scratch(g.rows as usize * acc)?;
    let rows = grid(g.rows as usize);
    let f = fast(c, &g, q.dtype(), true);
    // The tensor-core dQ kernels compute delta themselves.
    if !matches!(f, Some(Fast::Mma(_))) {
        c.launch(
            &format!("attn_delta_{sfx}"),
            rows,
            BLOCK,
            &[Arg::Attn(g), Arg::Ptr(dy.p), Arg::Ptr(y.p), Arg::Ptr(dp)],
        )?;
    }
    let dmask = wanted(outs, want, 3);
    if let Some(m) = dmask {
        c.memset0(m)?; // masked and skipped entries stay 0
    }
    if let Some(f) = f {
        let [dq, dk, dv] = [0, 1, 2].map(|i| outs[i].p);
        return fast_backward(
            c,
            f,
            g,
            ins,
            [mask, y.p],
            lse.p,
            dp,
            [dq, dk, dv, dmask.map_or(0, |m| m.p)],
        );
    }
    let common = |g: AttnGeom| {
        [
            Arg::Attn(g),
            Arg::Ptr(dy.p),
            Arg::Ptr(q.p),
            Arg::Ptr(k.p),
            Arg::Ptr(v.p),
            Arg::Ptr(mask),
            Arg::Ptr(cu[0]),
            Arg::Ptr(cu[1]),
            Arg::Ptr(lse.p),
            Arg::Ptr(dp),
        ]
    };
    let (dq, dk, dv) = (
        wanted(outs, want, 0),
        wanted(outs, want, 1),
        wanted(outs, want, 2),
    );
    if dq.is_some() || dmask.is_some() {
        let mut args: Vec<Arg> = common(g).into();
        args.push(Arg::Ptr(dq.map_or(0, |v| v.p)));
        args.push(Arg::Ptr(dmask.map_or(0, |v| v.p)));
        c.launch(&format!("attn_dq_{sfx}"), rows, BLOCK, &args)?;
    }
    if dk.is_some() || dv.is_some() {
        let gk = AttnGeom {
            rows: key_rows as i64,
            ..g
        };
        let mut args: Vec<Arg> = common(gk).into();
        args.push(Arg::Ptr(dk.map_or(0, |v| v.p)));
        args.push(Arg::Ptr(dv.map_or(0, |v| v.p)));
        c.launch(&format!("attn_dkv_{sfx}"), grid(key_rows), BLOCK, &args)?;
    }
    Ok(())
}

/// With K and V omitted (packed QKV), output 0 is dQKV, packed the same way and written
/// in place by the kernels.
#[allow(clippy::too_many_arguments)]
pub fn attention_grad(
    c: &Cuda,
    node: &Node,
    dy: &V,
    qkv: [Option<&V>; 3],
    mask: Option<V>,
    yl: [&V; 2],
    causal: bool,
    scale: Option<f32>,
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let parts = Qkv::new(node, qkv)?;
    let [q, k, v] = parts.views(parts.ptrs);
    let a = dims(node, &q, &k, &v)?;
    let mut g = attention_geom(node, &a, &q, mask.as_ref(), causal, scale)?;
    parts.strides(&a, &mut g);
    let key_rows = a.b * a.hkv * a.skv;
    let grads;
    let (outs, want) = if parts.width.is_some() {
        // dQ, dK and dV: views of dQKV (output 0), wanted with it.
        let mut o: Vec<V> = parts.views(parts.at(outs[0].p)).into();
        o.extend(outs.get(3).copied());
        let w0 = want.first().copied().unwrap_or(false);
        grads = (o, [w0, w0, w0, want.get(3).copied().unwrap_or(false)]);
        (&grads.0[..], &grads.1[..])
    } else {
        (outs, want)
    };
    backward(
        c,
        g,
        key_rows,
        [dy, &q, &k, &v],
        yl,
        mask.map_or(0, |m| m.p),
        [0, 0],
        outs,
        want,
    )
}

#[allow(clippy::too_many_arguments)]
pub fn varlen_grad(
    c: &Cuda,
    node: &Node,
    ins: [&V; 4],
    cu: [&V; 2],
    yl: [&V; 2],
    causal: bool,
    scale: Option<f32>,
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let [_, q, k, v] = ins;
    let (cus, nseq) = cu_seqlens(c, node, cu, [q.shape()[0], k.shape()[0]])?;
    let g = varlen_geom(node, q, k, v, nseq, causal, scale)?;
    let key_rows = k.shape()[0] * k.shape()[1];
    backward(
        c,
        g,
        key_rows,
        ins,
        yl,
        0,
        [c.addr(&cus[0]), c.addr(&cus[1])],
        outs,
        want,
    )
}

/// The tiled kernels of cuda/flash.cu that take a problem.
#[derive(Clone, Copy, Debug)]
enum Fast {
    /// Tensor cores (f16/bf16), head sizes padded to this.
    Mma(usize),
    /// CUDA cores in true FP32, head sizes padded to 64.
    Simt,
    /// f32 on TF32 tensor cores (cuda/flash_tf32.cu), head sizes padded to 64: 3xTF32
    /// (FP32-level accuracy) with 3 passes, plain TF32 (`--dtype tf32`) with 1.
    Tf32 { passes: u8 },
}

/// The attention kernel variant asked for (`Tuning::cuda_attention`, which lists the
/// choices; "" for the default), read once.
fn kernel_choice() -> &'static str {
    static CHOICE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    CHOICE.get_or_init(|| crate::backends::tuning::tuning().cuda_attention)
}

fn rows_only() -> bool {
    kernel_choice() == "rows"
}

/// Which kernels take f32 attention (head sizes up to 64), from
/// `Tuning::cuda_attention_f32`, read once. Forward and backward choose apart (they share
/// only the LSE, the same f32 statistic either way). By default f32 runs both in 3xTF32 on
/// tensor cores (FP32-level accuracy; on the H100 the fastest in both passes, ahead of the
/// CUDA-core kernels fs_* in true FP32: docs/bench-h100/attention-notes.md), and
/// `--dtype tf32` one TF32 pass. `simt` or `3xtf32` forces one kind for both passes (tf32
/// sessions included for `simt`), `FWD/BWD` (e.g. `3xtf32/simt`) each pass's for f32.
fn f32_choice() -> &'static str {
    static CHOICE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    CHOICE.get_or_init(|| crate::backends::tuning::tuning().cuda_attention_f32)
}

fn f32_kernels(c: &Cuda, backward: bool) -> Fast {
    let choice = f32_choice();
    let pass = match choice.split_once('/') {
        Some((fwd, bwd)) => {
            if backward {
                bwd
            } else {
                fwd
            }
        }
        None => choice,
    };
    match (c.blas.tf32(), pass) {
        (_, "simt") => Fast::Simt,
        (true, _) => Fast::Tf32 { passes: 1 },
        (false, _) => Fast::Tf32 { passes: 3 },
    }
}

fn fast(c: &Cuda, g: &AttnGeom, dt: DType, backward: bool) -> Option<Fast> {
    if g.varlen != 0 || rows_only() || g.hkv == 0 || g.hq % g.hkv != 0 {
        return None;
    }
    let w = g.d.max(g.dv);
    match dt {
        DType::BF16 | DType::F16 if w <= 64 => Some(Fast::Mma(64)),
        DType::BF16 | DType::F16 if w <= 128 && !backward => Some(Fast::Mma(128)),
        DType::F32 if w <= 64 => Some(f32_kernels(c, backward)),
        _ => None,
    }
}

/// Rows of the tiles of cuda/flash.cu: forward query rows per CTA on tensor cores; every
/// other tile.
const FA_BQ: usize = 128;
const FA_T: usize = 64;
/// The warp-specialized forward's K/V ring (flash.cu FA_WS_ST stages of FA_WS_BK keys).
const FA_WS_ST: usize = 4;
const FA_WS_BK: usize = 128;
/// The warp-specialized backward's Q/dY ring (flash.cu FA_BWS_ST).
const FA_BWS_ST: usize = 4;
/// An f32 tile: 64 × 64 floats.
const FS_TILE: usize = 64 * 64 * 4;
/// cuda/flash_tf32.cu's shared memory (floats): two stages of raw f32 tiles (rows of 72
/// floats, or 68 where only read across rows) — forward K and V, dQ K and V, dK/dV query
/// tiles of Q and dY with their LSE and delta — plus the 4 warps' raw A fragments (16 rows ×
/// 64 each) of dY (dQ) or of K and V (dK/dV).
const FT_SMEM_FWD: usize = 2 * (64 * 72 + 64 * 68) * 4;
/// 3xTF32 adds the small halves of the current K and V tiles.
const fn ft_smem_fwd(passes: u8) -> usize {
    if passes == 1 {
        FT_SMEM_FWD
    } else {
        FT_SMEM_FWD * 3 / 2
    }
}
/// 3xTF32 adds the small half of the current K tile.
const fn ft_smem_dq(passes: u8) -> usize {
    let lo = if passes == 1 { 0 } else { 64 * 72 };
    (2 * 2 * 64 * 72 + 4 * 16 * 64 + lo) * 4
}
/// dK/dV's query tiles are 64 rows for one pass, 32 for 3xTF32, which adds the small
/// halves of the current Q and dY tiles.
const fn ft_smem_dkv(passes: u8) -> usize {
    let (t, lo) = if passes == 1 {
        (64, 0)
    } else {
        (32, 2 * 32 * 72)
    };
    (2 * (2 * t * 72 + 2 * t) + 2 * 4 * 16 * 64 + lo) * 4
}

/// The tf32 kernels' names for `passes`.
fn ft_name(kernel: &str, passes: u8) -> String {
    format!("{kernel}_{passes}")
}

/// The tensor-core kernels come without and with (`_m`) mask support, and without a mask
/// also on `mma.sync` only (`_mma`).
fn mask_sfx(g: &AttnGeom) -> &'static str {
    if g.mask_kind != 0 {
        "_m"
    } else if kernel_choice() == "mma" {
        "_mma"
    } else {
        ""
    }
}

/// The tensor-core kernels start their tiles at a 1024-byte boundary of shared memory.
const SMEM_ALIGN: usize = 1024;

/// Whether the f16/bf16 backward (heads up to 64) takes the one-pass kernel `fa_bwd`
/// (wgmma: Hopper only) rather than the two passes `fa_dq` and `fa_dkv`.
fn one_pass_backward(c: &Cuda) -> bool {
    c.dev.cc == (9, 0) && !matches!(kernel_choice(), "mma" | "bwd2")
}

fn batch(g: &AttnGeom) -> usize {
    (g.rows / (g.hq * g.sq).max(1)) as usize
}

/// Whether 16-byte copies may load the rows: head sizes and strides a multiple of 16
/// bytes (of elements of `dt`) and 16-byte aligned buffers.
fn vec_ok(g: &AttnGeom, dt: DType, ptrs: &[u64]) -> i32 {
    let n = (16 / dt.size()) as i64;
    let strides = g.st.iter().flatten().all(|s| s % n == 0);
    (g.d % n == 0 && g.dv % n == 0 && strides && ptrs.iter().all(|p| p % 16 == 0)) as i32
}

/// For a persistent kernel (one CTA an SM taking items from a counter): the device's SM
/// count, and the counter, 4 bytes of scratch set to zero on the stream (a memset node when
/// the step is recorded).
fn persistent_launch(c: &Cuda) -> Result<(usize, u64)> {
    let sms = c
        .dev
        .ctx
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .map_err(|e| crate::err!(Runtime, "CUDA device attribute: {e:?}"))?;
    let work = c.scratch(4)?;
    // Safety: `work` addresses 4 bytes of scratch that live until the node ends.
    unsafe { cudarc::driver::result::memset_d8_async(work, 0, 4, c.stream.cu_stream()) }
        .map_err(|e| crate::err!(Runtime, "CUDA memset failed: {e:?}"))?;
    Ok((sms.max(1) as usize, work))
}

fn fast_forward(
    c: &Cuda,
    f: Fast,
    g: AttnGeom,
    qkv: [&V; 3],
    mask: u64,
    y: u64,
    lse: u64,
) -> Result<()> {
    let [q, k, v] = qkv;
    let bh = (batch(&g) * g.hq as usize) as u32;
    let sq = g.sq as usize;
    let args = vec![
        Arg::Attn(g),
        Arg::Ptr(q.p),
        Arg::Ptr(k.p),
        Arg::Ptr(v.p),
        Arg::Ptr(mask),
        Arg::Ptr(y),
        Arg::Ptr(lse),
        // (y too: the warp-specialized kernel stores Y's rows 16 bytes at a time)
        Arg::I32(vec_ok(&g, q.dtype(), &[q.p, k.p, v.p, y])),
    ];
    match f {
        Fast::Mma(64) if c.dev.cc == (9, 0) && !matches!(kernel_choice(), "mma" | "wg") => {
            // Warp-specialized (cuda/flash.cu fa_fwd_wsp): a producer warpgroup
            // and NC consumer warpgroups of 64 query rows; Q, then a ring of 128-key K/V
            // stages, then the mbarriers.
            let nc = 3; // consumer warpgroups (2 measured slower: fewer warps)
            let sfx = if g.mask_kind != 0 { "_m" } else { "" };
            let bm = 64 * nc;
            let items = sq.div_ceil(bm) as u32 * bh;
            // Persistent (fa_fwd_wsp, the default): one CTA an SM taking items in the order
            // below, the first by its index, the others from a counter zeroed here (a
            // memset node when recorded); Q double-buffered, then the item slots.
            // One dimension of (query block, head) items in chunks of heads, a chunk's
            // longest blocks first, so that the short blocks fill the tail of the launch and
            // a chunk's K/V stay in L2: chunks of up to 16 MiB of K/V, at most 32
            // heads (the attention workload, 512 KiB a head: 32 measured 4–5 % faster than
            // 8, ~1 % than 16; 128 as 32; docs/bench-h100/attention-notes.md, "forward,
            // second step" and "persistent forward"). `fwspcN` takes chunks of N, to compare.
            let group = (g.hq / g.hkv.max(1)).max(1) as usize; // q heads a kv head
            let kv_head = g.skv as usize * (g.d + g.dv) as usize * 2 / group;
            let chunk = kernel_choice()
                .strip_prefix("fwspc")
                .and_then(|n| n.parse().ok())
                .unwrap_or(((16usize << 20) / kv_head.max(1)).clamp(4, 32) as i32);
            let mut args = args;
            args.push(Arg::I32(chunk));
            let (sms, work) = persistent_launch(c)?;
            args.push(Arg::I32(bh as i32));
            args.push(Arg::Ptr(work));
            let name = format!("fa_fwd_wsp{nc}_{}_64{sfx}", suffix(q.dtype()));
            let smem = 2 * bm * 64 * 2 + FA_WS_ST * 2 * FA_WS_BK * 64 * 2 + 256 + SMEM_ALIGN;
            let grid = (items.min(sms as u32), 1, 1);
            launch_grid(
                &c.dev,
                &c.stream,
                &name,
                grid,
                128 * (nc as u32 + 1),
                smem,
                &args,
            )
        }
        Fast::Mma(dp) => {
            // (`_mma` exists for heads up to 64, where wgmma runs.)
            let sfx = if dp == 64 || g.mask_kind != 0 {
                mask_sfx(&g)
            } else {
                ""
            };
            let name = format!("fa_fwd_{}_{dp}{sfx}", suffix(q.dtype()));
            // Q and K/V tiles: a ring of 3 for heads up to 64 (the wgmma kernel; mma.sync
            // uses 2 of them), 2 for larger.
            let stages = if dp == 64 { 3 } else { 2 };
            let smem = (FA_BQ + 2 * stages * FA_T) * dp * 2 + SMEM_ALIGN;
            // Warps of 32 query rows for heads up to 64, of 16 for larger (flash.cu FA_MT).
            let threads = if dp == 64 { 128 } else { 256 };
            let grid = (sq.div_ceil(FA_BQ) as u32, bh, 1);
            launch_grid(&c.dev, &c.stream, &name, grid, threads, smem, &args)
        }
        Fast::Simt => {
            let grid = (sq.div_ceil(FA_T) as u32, bh, 1);
            launch_grid(&c.dev, &c.stream, "fs_fwd", grid, 256, 4 * FS_TILE, &args)
        }
        Fast::Tf32 { passes } => {
            // Warps of 16 queries: 8 a CTA for one pass, 4 for 3xTF32 (its registers).
            let warps = if passes == 1 { 8 } else { 4 };
            let grid = (sq.div_ceil(16 * warps) as u32, bh, 1);
            let name = ft_name("ft_fwd", passes);
            launch_grid(
                &c.dev,
                &c.stream,
                &name,
                grid,
                32 * warps as u32,
                ft_smem_fwd(passes),
                &args,
            )
        }
    }
}

/// dQ (and dMask) per query tile, then dK and dV per key tile; `delta` is ready for the
/// f32 kernels, and written by the dQ pass from Y (`my`: mask and Y) for the others. On
/// Hopper f16/bf16 take one pass instead (`one_pass_backward`): delta first, then dK, dV,
/// dMask and dQ per key tile, dQ summed in f32 by atomics (so its last bits vary from run
/// to run), then dQ converted.
#[allow(clippy::too_many_arguments)]
fn fast_backward(
    c: &Cuda,
    f: Fast,
    g: AttnGeom,
    ins: [&V; 4],
    my: [u64; 2],
    lse: u64,
    delta: u64,
    outs: [u64; 4],
) -> Result<()> {
    let [dy, q, k, v] = ins;
    let [dq, dk, dv, dmask] = outs;
    let [mask, y] = my;
    let b = batch(&g);
    let (sq, skv) = (g.sq as usize, g.skv as usize);
    let common = |g: AttnGeom| {
        vec![
            Arg::Attn(g),
            Arg::Ptr(dy.p),
            Arg::Ptr(q.p),
            Arg::Ptr(k.p),
            Arg::Ptr(v.p),
            Arg::Ptr(mask),
            Arg::Ptr(lse),
            Arg::Ptr(delta),
        ]
    };
    let qgrid = (sq.div_ceil(FA_T) as u32, (b * g.hq as usize) as u32, 1);
    let kgrid = (skv.div_ceil(FA_T) as u32, (b * g.hkv as usize) as u32, 1);
    // (dK and dV too: fa_bws stores their rows 16 bytes at a time)
    let vec = vec_ok(&g, q.dtype(), &[dy.p, q.p, k.p, v.p, y, dk, dv]);
    let mut aq = common(g);
    aq.extend([Arg::Ptr(dq), Arg::Ptr(dmask), Arg::I32(vec)]);
    if let Fast::Mma(_) = f {
        aq.push(Arg::Ptr(y));
    }
    let mut akv = common(g);
    akv.extend([Arg::Ptr(dk), Arg::Ptr(dv), Arg::I32(vec)]);
    match f {
        Fast::Mma(64) if one_pass_backward(c) => {
            let sfx = suffix(q.dtype());
            // dQ accumulates in f32, 64 × 64 tiles [B·Hq, ⌈Sq/64⌉, 4096], zeroed by the
            // pre-pass (which computes delta too).
            let dqa = c.scratch(b * g.hq as usize * sq.div_ceil(FA_T) * FA_T * 64 * 4)?;
            let pre = [
                Arg::Attn(g),
                Arg::Ptr(dy.p),
                Arg::Ptr(y),
                Arg::Ptr(delta),
                Arg::Ptr(dqa),
                Arg::I32(vec),
            ];
            launch_grid(
                &c.dev,
                &c.stream,
                &format!("fa_bwd_pre_{sfx}"),
                qgrid,
                128,
                0,
                &pre,
            )?;
            if g.mask_kind == 0 && dmask == 0 && kernel_choice() != "bwd1" {
                // Warp-specialized and persistent (cuda/flash.cu fa_bwd_wsp): 128 keys an
                // item, a producer warpgroup streaming Q/dY into a ring for two consumer
                // warpgroups. Shared memory: K and V of both in two buffers, two dSᵀ tiles
                // each, the ring of (Q, dY) tiles, its LSE and delta, the mbarriers, the item
                // slots.
                let tile = FA_T * 64 * 2;
                let smem = (8 + 4 + 2 * FA_BWS_ST) * tile
                    + FA_BWS_ST * 2 * FA_T * 4
                    + (2 * FA_BWS_ST + 4) * 8
                    + 32
                    + SMEM_ALIGN;
                let mut a = common(g);
                a.truncate(5); // (no mask)
                a.extend([
                    Arg::Ptr(lse),
                    Arg::Ptr(delta),
                    Arg::Ptr(dqa),
                    Arg::Ptr(dk),
                    Arg::Ptr(dv),
                    Arg::I32(vec),
                ]);
                // Items in chunks of 8 kv heads, the longest (first) key blocks of a chunk
                // first (measured against head after head in session 5: 654 vs 677 µs; 16
                // in session 6: the same).
                a.push(Arg::I32(8));
                let items = skv.div_ceil(2 * FA_T) * kgrid.1 as usize;
                // One CTA an SM taking the items in turn: from a counter zeroed here
                // (`bpst`: item blockIdx.x + j·gridDim.x, no counter). `bp2` / `bps2`:
                // the same on 2 CTAs (tests: many items a CTA).
                let choice = kernel_choice();
                let (sms, work) = persistent_launch(c)?;
                let work = if matches!(choice, "bpst" | "bps2") {
                    0
                } else {
                    work
                };
                a.extend([Arg::I32(kgrid.1 as i32), Arg::Ptr(work)]);
                let ctas = if choice.ends_with('2') { 2 } else { sms };
                let grid = (items.min(ctas) as u32, 1, 1);
                // (flash.cu fa_bwd_wsp<LATE, ALD>: `bp10` LSE/delta loaded by the producer)
                let form = if choice == "bp10" { "10" } else { "11" };
                let name = format!("fa_bwsp{form}_{sfx}_64");
                launch_grid(&c.dev, &c.stream, &name, grid, 384, smem, &a)?;
            } else {
                let mut a = common(g);
                a.extend([
                    Arg::Ptr(dqa),
                    Arg::Ptr(dk),
                    Arg::Ptr(dv),
                    Arg::Ptr(dmask),
                    Arg::I32(vec),
                ]);
                let kind = if g.mask_kind != 0 { "_m" } else { "" };
                let name = format!("fa_bwd_{sfx}_64{kind}");
                // Tiles: K, V, rings of 3 for Q and dY, 2 of dSᵀ; 16 KiB unused (the kernel's
                // layout: see fa_bwd_wg); LSE and delta per stage.
                let smem = 10 * FA_T * 64 * 2 + FA_T * 64 * 4 + 3 * 2 * FA_T * 4 + SMEM_ALIGN;
                launch_grid(&c.dev, &c.stream, &name, kgrid, 128, smem, &a)?;
            }
            let out = [
                Arg::Attn(g),
                Arg::Ptr(dqa),
                Arg::Ptr(dq),
                Arg::I32(vec_ok(&g, q.dtype(), &[dq])),
            ];
            launch_grid(
                &c.dev,
                &c.stream,
                &format!("fa_dq_out_{sfx}"),
                qgrid,
                128,
                0,
                &out,
            )
        }
        Fast::Mma(dp) => {
            let sfx = suffix(q.dtype());
            // Two tiles that stay and a ring of 3 of two tiles each (the wgmma kernels; the
            // mma.sync ones use 2 of the ring), and the dK/dV pass's LSE and delta per stage.
            let (sm_q, sm_kv) = (
                8 * FA_T * dp * 2 + SMEM_ALIGN,
                8 * FA_T * dp * 2 + 3 * 2 * FA_T * 4 + SMEM_ALIGN,
            );
            launch_grid(
                &c.dev,
                &c.stream,
                &format!("fa_dq_{sfx}_{dp}{}", mask_sfx(&g)),
                qgrid,
                128,
                sm_q,
                &aq,
            )?;
            launch_grid(
                &c.dev,
                &c.stream,
                &format!("fa_dkv_{sfx}_{dp}{}", mask_sfx(&g)),
                kgrid,
                128,
                sm_kv,
                &akv,
            )
        }
        Fast::Tf32 { passes } => {
            let (dq, dkv) = (ft_name("ft_dq", passes), ft_name("ft_dkv", passes));
            launch_grid(&c.dev, &c.stream, &dq, qgrid, 128, ft_smem_dq(passes), &aq)?;
            launch_grid(
                &c.dev,
                &c.stream,
                &dkv,
                kgrid,
                128,
                ft_smem_dkv(passes),
                &akv,
            )
        }
        Fast::Simt => {
            launch_grid(&c.dev, &c.stream, "fs_dq", qgrid, 256, 6 * FS_TILE, &aq)?;
            launch_grid(
                &c.dev,
                &c.stream,
                "fs_dkv",
                kgrid,
                256,
                7 * FS_TILE + 2 * 64 * 4,
                &akv,
            )
        }
    }
}
