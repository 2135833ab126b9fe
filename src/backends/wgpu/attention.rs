//! Attention and VarlenAttention on wgpu (shaders/attention.wgsl), forward with the
//! optional LSE output and backward from it. Shapes and masks are checked here; the
//! shaders take one geometry that describes either layout. cu_seqlens stay on the device
//! (not validated against the packed lengths, unlike the CPU: that would need a
//! readback; WebGPU's bounds-checked buffer access keeps bad ones from reading outside).

use super::device::{groups_for, Family, Kernel};
use super::{float_defs, unsupported, Params, Wgpu, V};
use crate::backends::common::{self, wanted};
use crate::error::Result;
use crate::graph::infer::{qkv_parts, AttnDims, ValueType};
use crate::graph::Node;
use crate::tensor::DType;

/// Head sizes up to this run (the shaders keep head vectors in registers).
const MAX_HEAD: usize = 256;

/// Query or key positions per workgroup (shaders/attention.wgsl `BQ`).
const BQ: usize = 64;

/// The shaders' parameter block (see shaders/attention.wgsl).
#[derive(Clone, Copy, Default)]
struct Geom {
    /// Attention's batch (problems are batch × heads); 1 for VarlenAttention, whose
    /// problems are its heads.
    batch: usize,
    hq: usize,
    hkv: usize,
    /// Query and key positions per problem (the packed lengths for VarlenAttention).
    sq: usize,
    skv: usize,
    d: usize,
    dv: usize,
    ms: [i64; 4],
    rows: usize,
    nseq: usize,
    scale: f32,
    varlen: bool,
    causal: bool,
    mask_kind: usize,
    /// Index words of cu_seqlens (2 for i64).
    iw: usize,
    /// Row strides over (batch, head, position) of the query side, the key side and
    /// the statistics (shaders/attention.wgsl `row_at`), and Attention's 3-D form.
    qr: [usize; 3],
    kr: [usize; 3],
    sr: [usize; 3],
    packed: bool,
}

impl Geom {
    fn params(&self) -> Params {
        let mut p = Params::new()
            .u(0, self.hq)
            .u(1, self.hkv)
            .u(2, self.sq)
            .u(3, self.skv)
            .u(4, self.d)
            .u(5, self.dv)
            .u(10, self.rows)
            .u(11, self.nseq)
            .f(12, self.scale)
            .u(13, self.varlen as usize)
            .u(14, self.causal as usize)
            .u(15, self.mask_kind)
            .u(26, self.packed as usize);
        for (i, &s) in self.ms.iter().enumerate() {
            p = p.i(6 + i, s);
        }
        for (at, st) in [(17, self.qr), (20, self.kr), (23, self.sr)] {
            for (i, &s) in st.iter().enumerate() {
                p = p.u(at + i, s);
            }
        }
        p
    }
    fn kernel<'a>(&self, w: &Wgpu, node: &Node, entry: &'a str, dt: DType) -> Result<Kernel<'a>> {
        // Head vectors as vec4s; tiles of BK rows keep K and V (or Q and dY) within 8 KiB
        // and the forward's scores within 8 KiB of workgroup memory (lavapipe has 32). On
        // the H100 (Vulkan) the forward at D = 64 took 22.9 ms with BK = 16, 34.7 with 32
        // and 64.4 with 64 (docs/WGPU_BENCHMARKS.md): smaller tiles, more workgroups per SM.
        let hd4 = self.d.max(self.dv).div_ceil(4).max(1);
        // `Tuning::wgpu_attn_bk` overrides the tile's rows, to compare tile sizes on a GPU
        // (an adapter without the workgroup memory for it fails the pipeline's build).
        // The backward kernels prefer twice the rows: at D = 64 AttentionGrad took 101.8 ms
        // with BK = 32 against 126.6 with 16 (attention workload; gpt_block's 26.9 vs 35.6).
        let budget = if entry == "attn_fwd" { 256 } else { 512 };
        let bk = crate::backends::tuning::tuning()
            .wgpu_attn_bk
            .map_or((budget / hd4).clamp(1, 32), |b| b.clamp(1, BQ));
        let defs = format!(
            "{}const IW: u32 = {}u;\nconst HD4: u32 = {hd4}u;\nconst BK: u32 = {bk}u;\n",
            float_defs(w, node, dt)?,
            self.iw.max(1)
        );
        Ok(Wgpu::kernel(Family::Attention, entry, defs))
    }
    /// A workgroup per BQ query positions of each problem.
    fn query_groups(&self) -> [u32; 3] {
        let heads = if self.varlen {
            self.hq
        } else {
            self.batch * self.hq
        };
        [self.sq.div_ceil(BQ) as u32, heads as u32, 1]
    }
    /// A workgroup per BQ key positions of each K/V problem.
    fn key_groups(&self) -> [u32; 3] {
        let heads = if self.varlen {
            self.hkv
        } else {
            self.batch * self.hkv
        };
        [self.skv.div_ceil(BQ) as u32, heads as u32, 1]
    }
}

fn default_scale(d: usize, scale: Option<f32>) -> f32 {
    scale.unwrap_or(1.0 / (d as f32).sqrt())
}

/// Attention `Q [B, Hq, Sq, D]`, `K, V [B, Hkv, Skv, D|Dv]` or their 3-D form `[B, S, H·D]`,
/// mask broadcast over `[B, Hq, Sq, Skv]`.
fn attention_geom(
    node: &Node,
    [q, k, v]: [&V; 3],
    mask: Option<&V>,
    causal: bool,
    scale: Option<f32>,
) -> Result<Geom> {
    let a = AttnDims::new(&node.op, q.shape(), k.shape(), v.shape())
        .map_err(|e| crate::err!(Runtime, "{}: {e}", node.describe()))?;
    common::check_heads(node, "wgpu", MAX_HEAD, a.d, a.dv)?;
    let (ms, kind) = common::attn_mask(node, q.dtype(), mask.map(|m| (m.dtype(), m.shape())))?;
    Ok(Geom {
        batch: a.b,
        hq: a.hq,
        hkv: a.hkv,
        sq: a.sq,
        skv: a.skv,
        d: a.d,
        dv: a.dv,
        ms,
        rows: a.b * a.hq * a.sq,
        causal,
        mask_kind: kind as usize,
        scale: default_scale(a.d, scale),
        qr: a.q_rows(),
        kr: a.k_rows(),
        sr: [a.hq * a.sq, a.sq, 1],
        packed: a.packed,
        ..Default::default()
    })
}

/// VarlenAttention `Q [Tq, Hq, D]`, `K, V [Tk, Hkv, D|Dv]`, `cu_seqlens [B+1]`.
fn varlen_geom(
    node: &Node,
    [q, k, v]: [&V; 3],
    cu: [&V; 2],
    causal: bool,
    scale: Option<f32>,
) -> Result<Geom> {
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    let (d, dv) = (qs[2], vs[2]);
    common::check_heads(node, "wgpu", MAX_HEAD, d, dv)?;
    let iw = match cu[0].dtype() {
        DType::I64 => 2,
        DType::I32 => 1,
        dt => return Err(unsupported(node, dt)),
    };
    if cu[0].numel() != cu[1].numel() || cu[0].numel() == 0 || cu[1].dtype() != cu[0].dtype() {
        crate::bail!(
            Runtime,
            "{}: cu_seqlens_q and cu_seqlens_k must have the same number (B+1 >= 1) of entries and dtype",
            node.describe()
        );
    }
    Ok(Geom {
        batch: 1,
        hq: qs[1],
        hkv: ks[1],
        sq: qs[0],
        skv: ks[0],
        d,
        dv,
        rows: qs[0] * qs[1],
        nseq: cu[0].numel() - 1,
        varlen: true,
        causal,
        scale: default_scale(d, scale),
        iw,
        // A problem is one head of the packed rows.
        qr: [0, 1, qs[1]],
        kr: [0, 1, ks[1]],
        sr: [0, 1, qs[1]],
        ..Default::default()
    })
}

fn forward(
    w: &mut Wgpu,
    node: &Node,
    g: Geom,
    [q, k, v]: [&V; 3],
    mask: Option<V>,
    cu: [Option<&wgpu::Buffer>; 2],
    outs: &[V],
) -> Result<()> {
    if g.nseq == 0 && g.varlen {
        return Ok(());
    }
    let kern = g.kernel(w, node, "attn_fwd", q.dtype())?;
    let (dr, lse_s) = (w.scratch(16), w.scratch(g.rows * 4));
    let lse = outs.get(1).map_or(&lse_s, |l| l.buf);
    let (mb, mt) = match (g.mask_kind, &mask) {
        (1, Some(m)) => (m.buf, &dr),
        (2, Some(m)) => (&dr, m.buf),
        _ => (&dr, &dr),
    };
    w.run_kernel(
        &kern,
        &g.params(),
        &[
            (1, q.buf),
            (2, k.buf),
            (3, v.buf),
            (4, mb),
            (5, mt),
            (6, cu[0].unwrap_or(&dr)),
            (7, cu[1].unwrap_or(&dr)),
            (8, outs[0].buf),
            (9, lse),
            (10, &dr), // dY: the shared loaders name it, the forward never reads it
        ],
        g.query_groups(),
    )
}

/// The packed-QKV form's parts (K and V omitted: `qkv_parts`) in scratch buffers: the
/// shaders take Q, K and V (and dQ, dK, dV) apart, so the parts are copied out of (and
/// the gradients into) the packed tensor around them.
struct Parts {
    tys: [ValueType; 3],
    bufs: [wgpu::Buffer; 3],
}

impl Parts {
    fn new(w: &Wgpu, node: &Node, qkv: &V) -> Result<Parts> {
        let p = qkv_parts(&node.op, qkv.shape())
            .map_err(|e| crate::err!(Runtime, "{}: {e}", node.describe()))?;
        let tys = p.map(|(s, _)| ValueType::new(qkv.dtype(), &s));
        let bufs = [0, 1, 2].map(|i| w.scratch(tys[i].bytes()));
        Ok(Parts { tys, bufs })
    }
    fn views(&self) -> [V<'_>; 3] {
        [0, 1, 2].map(|i| V {
            buf: &self.bufs[i],
            ty: &self.tys[i],
        })
    }
}

/// Q, K and V as given, or (K and V omitted) copied out of the packed QKV into `parts`.
fn unpack<'a>(
    w: &mut Wgpu,
    node: &Node,
    qkv: [Option<&'a V<'a>>; 3],
    parts: &'a mut Option<Parts>,
) -> Result<[V<'a>; 3]> {
    match qkv {
        [Some(q), Some(k), Some(v)] => Ok([*q, *k, *v]),
        [Some(x), None, None] => {
            let p = parts.insert(Parts::new(w, node, x)?);
            let views = p.views();
            super::shape::split(w, x, -1, &views)?;
            Ok(views)
        }
        _ => crate::bail!(
            Runtime,
            "{}: Q, K and V, or the packed QKV alone",
            node.describe()
        ),
    }
}

/// With K and V omitted, Q is the packed QKV (`qkv_parts`).
pub fn attention(
    w: &mut Wgpu,
    node: &Node,
    qkv: [Option<&V>; 3],
    mask: Option<V>,
    causal: bool,
    scale: Option<f32>,
    outs: &[V],
) -> Result<()> {
    let mut parts = None;
    let [q, k, v] = unpack(w, node, qkv, &mut parts)?;
    let g = attention_geom(node, [&q, &k, &v], mask.as_ref(), causal, scale)?;
    forward(w, node, g, [&q, &k, &v], mask, [None, None], outs)
}

#[allow(clippy::too_many_arguments)]
pub fn varlen(
    w: &mut Wgpu,
    node: &Node,
    qkv: [&V; 3],
    cu: [&V; 2],
    causal: bool,
    scale: Option<f32>,
    outs: &[V],
) -> Result<()> {
    let g = varlen_geom(node, qkv, cu, causal, scale)?;
    forward(
        w,
        node,
        g,
        qkv,
        None,
        [Some(cu[0].buf), Some(cu[1].buf)],
        outs,
    )
}

/// delta = rowsum(dY∘Y), then dQ (and dMask) per query row, then dK and dV per key row.
#[allow(clippy::too_many_arguments)]
fn backward(
    w: &mut Wgpu,
    node: &Node,
    g: Geom,
    [dy, q, k, v]: [&V; 4],
    [y, lse]: [&V; 2],
    mask: Option<V>,
    cu: [Option<&wgpu::Buffer>; 2],
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    if lse.dtype() != DType::F32 {
        crate::bail!(
            Runtime,
            "{}: LSE must be the statistics dtype f32, got {}",
            node.describe(),
            lse.dtype()
        );
    }
    let dt = q.dtype();
    let delta = w.scratch(g.rows * 4);
    let kd = g.kernel(w, node, "attn_delta", dt)?;
    w.run_kernel(
        &kd,
        &g.params(),
        &[(10, dy.buf), (8, y.buf), (9, &delta)],
        groups_for(g.rows, 64),
    )?;
    let dr = w.scratch(16);
    let (mb, mt) = match (g.mask_kind, &mask) {
        (1, Some(m)) => (m.buf, &dr),
        (2, Some(m)) => (&dr, m.buf),
        _ => (&dr, &dr),
    };
    let out = |i: usize| wanted(outs, want, i);
    fn with<'b>(
        mut v: Vec<(u32, &'b wgpu::Buffer)>,
        extra: [(u32, &'b wgpu::Buffer); 2],
    ) -> Vec<(u32, &'b wgpu::Buffer)> {
        v.extend(extra);
        v
    }
    let common = vec![
        (1, q.buf),
        (2, k.buf),
        (3, v.buf),
        (4, mb),
        (5, mt),
        (6, cu[0].unwrap_or(&dr)),
        (7, cu[1].unwrap_or(&dr)),
        (9, lse.buf),
        (10, dy.buf),
        (11, &delta),
    ];
    let dmask = out(3);
    if let Some(m) = dmask {
        w.rec.clear(m.buf, m.ty.bytes()); // masked and skipped entries stay 0
    }
    if out(0).is_some() || dmask.is_some() {
        let (s_dq, s_dm) = (w.scratch(q.ty.bytes()), w.scratch(16));
        let dq = out(0).map_or(&s_dq, |v| v.buf);
        let dm = dmask.map_or(&s_dm, |v| v.buf);
        let kq = g.kernel(w, node, "attn_dq", dt)?;
        let p = g.params().u(16, dmask.is_some() as usize);
        w.run_kernel(
            &kq,
            &p,
            &with(common.clone(), [(12, dq), (15, dm)]),
            g.query_groups(),
        )?;
    }
    if out(1).is_some() || out(2).is_some() {
        let (s_dk, s_dv) = (w.scratch(k.ty.bytes()), w.scratch(v.ty.bytes()));
        let dk = out(1).map_or(&s_dk, |v| v.buf);
        let dv = out(2).map_or(&s_dv, |v| v.buf);
        let kk = g.kernel(w, node, "attn_dkv", dt)?;
        w.run_kernel(
            &kk,
            &g.params(),
            &with(common.clone(), [(13, dk), (14, dv)]),
            g.key_groups(),
        )?;
    }
    Ok(())
}

/// With K and V omitted (packed QKV), output 0 is dQKV, packed the same way.
#[allow(clippy::too_many_arguments)]
pub fn attention_grad(
    w: &mut Wgpu,
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
    let packed = qkv[1].is_none();
    let mut parts = None;
    let [q, k, v] = unpack(w, node, qkv, &mut parts)?;
    let g = attention_geom(node, [&q, &k, &v], mask.as_ref(), causal, scale)?;
    let ins = [dy, &q, &k, &v];
    if !packed {
        return backward(w, node, g, ins, yl, mask, [None, None], outs, want);
    }
    // dQ, dK and dV apart, then packed into output 0.
    let grads = Parts::new(w, node, qkv[0].expect("packed QKV"))?;
    let mut gouts: Vec<V> = grads.views().into();
    gouts.extend(outs.get(3).copied());
    let w0 = want.first().copied().unwrap_or(false);
    let gwant = [w0, w0, w0, want.get(3).copied().unwrap_or(false)];
    backward(w, node, g, ins, yl, mask, [None, None], &gouts, &gwant)?;
    if w0 {
        let parts: Vec<Option<V>> = gouts[..3].iter().copied().map(Some).collect();
        super::shape::concat(w, &parts, -1, &outs[0])?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub fn varlen_grad(
    w: &mut Wgpu,
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
    let g = varlen_geom(node, [q, k, v], cu, causal, scale)?;
    if g.nseq == 0 {
        return Ok(());
    }
    backward(
        w,
        node,
        g,
        ins,
        yl,
        None,
        [Some(cu[0].buf), Some(cu[1].buf)],
        outs,
        want,
    )
}
