//! Matrix products on wgpu (shaders/matmul.wgsl): MatMul (batched, broadcast), Gemm,
//! FusedMatMul with its whole epilogue in the GEMM shader, and FusedMatMulGrad as GEMMs
//! over strided views (transposes are strides, never copies).

use super::device::Family;
use super::elementwise::grad_kernel;
use super::reduce::sum_rows;
use super::{bcast_strides, float_defs, strides, Params, Strided, Wgpu, V};
use crate::backends::common::{act_code, wanted};
use crate::error::Result;
use crate::graph::{Activation, Node};
use crate::tensor::{numel, DType};

/// Output tiles of one workgroup (shaders/matmul.wgsl): `gemm` and `gemm128`.
const TILE: usize = 64;
const BIG: usize = 128;
/// gemm128 only for products of at least this many of its tiles: fewer leave most of a
/// large GPU idle, where the 64×64 kernel has four times the workgroups.
const BIG_MIN_TILES: usize = 8;

const BIAS: usize = 1;
const RES: usize = 2;
const PRE: usize = 4;
pub(super) const ACCUM: usize = 8;
/// D holds partial sums of the product, added before the epilogue (`split_k`).
const PARTIAL: usize = 16;
/// The most of K one dispatch sums: lavapipe (Mesa's software Vulkan) ends a shader loop
/// after 65535 iterations, and the GEMM's loop over K stopped there (a K of 70000 ones
/// summed to 58253).
const K_STEP: usize = 32768;

/// One (batched) product `D[z] = epi(alpha · op(A)[z] · op(B)[z])` over strided operands.
#[derive(Clone)]
pub(super) struct Product {
    pub(super) dt: DType,
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    /// A(m, k) strides and B(k, n) strides, in elements.
    pub(super) a: (i64, i64),
    pub(super) b: (i64, i64),
    /// The output's batch dims and each operand's (A, B, R) strides over them.
    pub(super) batch: Vec<usize>,
    pub(super) bst: [Vec<i64>; 3],
    pub(super) base: [i64; 3],
    pub(super) d_off: usize,
    pub(super) alpha: f32,
    pub(super) flags: usize,
    pub(super) rscale: f32,
    pub(super) r: (i64, i64),
}

impl Product {
    pub(super) fn new(
        dt: DType,
        m: usize,
        n: usize,
        k: usize,
        a: (i64, i64),
        b: (i64, i64),
    ) -> Product {
        Product {
            dt,
            m,
            n,
            k,
            a,
            b,
            batch: vec![],
            bst: Default::default(),
            base: [0; 3],
            d_off: 0,
            alpha: 1.0,
            flags: 0,
            rscale: 1.0,
            r: (0, 0),
        }
    }
}

/// Buffers of a product; absent optional ones are bound to scratch.
#[derive(Clone, Copy)]
pub(super) struct Bufs<'a> {
    pub(super) a: &'a wgpu::Buffer,
    pub(super) b: &'a wgpu::Buffer,
    pub(super) d: &'a wgpu::Buffer,
    pub(super) bias: Option<&'a wgpu::Buffer>,
    pub(super) res: Option<&'a wgpu::Buffer>,
    pub(super) pre: Option<&'a wgpu::Buffer>,
}

pub(super) fn launch(
    w: &mut Wgpu,
    node: &Node,
    act: Activation,
    p: &Product,
    bufs: Bufs,
) -> Result<()> {
    let dt = float_defs(w, node, p.dt)?;
    let batch = numel(&p.batch);
    if p.m == 0 || p.n == 0 || batch == 0 {
        return Ok(());
    }
    if p.k > K_STEP {
        return split_k(w, node, act, p, bufs);
    }
    if batch > 65535 {
        crate::bail!(
            Runtime,
            "{}: {batch} batched products are more than the wgpu backend dispatches at once (65535)",
            node.describe()
        );
    }
    let mut s = Strided::new(&p.batch, &[&p.bst[0][..], &p.bst[1][..], &p.bst[2][..]]);
    s.base = p.base;
    let mut flags = p.flags;
    flags |= if bufs.bias.is_some() { BIAS } else { 0 };
    flags |= if bufs.res.is_some() { RES } else { 0 };
    flags |= if bufs.pre.is_some() { PRE } else { 0 };
    let params = Params::new()
        .u(0, p.m)
        .u(1, p.n)
        .u(2, p.k)
        .i(3, p.a.0)
        .i(4, p.a.1)
        .i(5, p.b.0)
        .i(6, p.b.1)
        .f(7, p.alpha)
        .u(8, flags)
        .f(9, p.rscale)
        .i(10, p.r.0)
        .i(11, p.r.1)
        .u(12, p.d_off)
        .strided(16, &s)?;
    // gemm128 where both operands read as vec4s and the product fills enough of its
    // tiles to keep the GPU busy; the 64×64 kernel otherwise.
    let a_k = vec4_dim(p.m, p.k, p.a, &p.bst[0], p.base[0]);
    let b_k = vec4_dim(p.n, p.k, (p.b.1, p.b.0), &p.bst[1], p.base[1]);
    let big = match (a_k, b_k) {
        (Some(a_k), Some(b_k)) if !small_only() => {
            (p.m.div_ceil(BIG) * p.n.div_ceil(BIG) * batch >= BIG_MIN_TILES).then_some((a_k, b_k))
        }
        _ => None,
    };
    let (a_k, b_k) = big.unwrap_or((false, false));
    let defs = format!(
        "{dt}const ACT: u32 = {}u;\nconst A_K: bool = {a_k};\nconst B_K: bool = {b_k};\n",
        act_code(act)
    );
    let (ro, wo) = (w.scratch(16), w.scratch(16));
    let (entry, tile, a_bind, b_bind) = match big {
        Some(_) => ("gemm128", BIG, 7, 8),
        None => ("gemm", TILE, 1, 2),
    };
    let k = Wgpu::kernel(Family::Matmul, entry, defs);
    let groups = [
        p.n.div_ceil(tile) as u32,
        p.m.div_ceil(tile) as u32,
        batch as u32,
    ];
    w.run_kernel(
        &k,
        &params,
        &[
            (a_bind, bufs.a),
            (b_bind, bufs.b),
            (3, bufs.d),
            (4, bufs.bias.unwrap_or(&ro)),
            (5, bufs.res.unwrap_or(&ro)),
            (6, bufs.pre.unwrap_or(&wo)),
        ],
        groups,
    )
}

/// A product with K past `K_STEP` as dispatches of `K_STEP` each, the partial sums
/// accumulating in D and the epilogue run with the last.
fn split_k(w: &mut Wgpu, node: &Node, act: Activation, p: &Product, bufs: Bufs) -> Result<()> {
    let epilogue =
        act != Activation::None || bufs.bias.is_some() || bufs.res.is_some() || bufs.pre.is_some();
    if epilogue && p.flags & ACCUM != 0 {
        crate::bail!(
            Runtime,
            "{}: on wgpu a product with K = {} (over {K_STEP}) cannot both run an epilogue \
             and add onto its output",
            node.describe(),
            p.k
        );
    }
    let plain = Bufs {
        bias: None,
        res: None,
        pre: None,
        ..bufs
    };
    let steps = p.k.div_ceil(K_STEP);
    for c in 0..steps {
        let k0 = c * K_STEP;
        let mut q = p.clone();
        q.k = K_STEP.min(p.k - k0);
        q.base[0] += k0 as i64 * p.a.1;
        q.base[1] += k0 as i64 * p.b.0;
        let first_flags = if epilogue { 0 } else { p.flags };
        q.flags = match c {
            0 => first_flags,
            _ if c + 1 == steps && epilogue => p.flags | PARTIAL,
            _ => p.flags | ACCUM,
        };
        match c + 1 == steps && epilogue {
            true => launch(w, node, act, &q, bufs)?,
            false => launch(w, node, Activation::None, &q, plain)?,
        }
    }
    Ok(())
}

/// `Tuning::wgpu_gemm64` keeps every product on the 64×64 kernel: for comparing the two
/// in one build (docs/WGPU_BENCHMARKS.md). Read once.
fn small_only() -> bool {
    static SMALL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SMALL.get_or_init(|| crate::backends::tuning::tuning().wgpu_gemm64)
}

/// How gemm128 can read an operand of `rows × k` (A: m × k; B: n × k) with strides
/// `(row, k)`, batch strides `bst` and base offset `base`, all in elements: `Some(true)`
/// as vec4s along k, `Some(false)` as vec4s along its rows, `None` when neither is
/// aligned (every vec4 must start at a multiple of 4 elements and lie wholly in or out).
fn vec4_dim(rows: usize, k: usize, (sr, sk): (i64, i64), bst: &[i64], base: i64) -> Option<bool> {
    let by4 = |x: i64| x >= 0 && x % 4 == 0;
    if !by4(base) || !bst.iter().all(|&x| by4(x)) {
        return None;
    }
    if sk == 1 && by4(sr) && k.is_multiple_of(4) {
        Some(true)
    } else if sr == 1 && by4(sk) && rows.is_multiple_of(4) {
        Some(false)
    } else {
        None
    }
}

/// The matrices of a batched operand: dims `[batch.., r, c]` (a 1-D vector is one row
/// or one column, `as_row`).
fn split_batch(shape: &[usize], as_row: bool) -> (Vec<usize>, usize, usize) {
    match shape.len() {
        0 => (vec![], 1, 1),
        1 if as_row => (vec![], 1, shape[0]),
        1 => (vec![], shape[0], 1),
        r => (shape[..r - 2].to_vec(), shape[r - 2], shape[r - 1]),
    }
}

/// numpy broadcast of two batch shapes.
fn broadcast(node: &Node, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let r = a.len().max(b.len());
    let get = |s: &[usize], i: usize| {
        if i + s.len() >= r {
            s[i + s.len() - r]
        } else {
            1
        }
    };
    (0..r)
        .map(|i| match (get(a, i), get(b, i)) {
            (x, y) if x == y => Ok(x),
            (1, y) => Ok(y),
            (x, 1) => Ok(x),
            _ => Err(crate::err!(
                Runtime,
                "{}: matmul batch dims {a:?} and {b:?} do not broadcast",
                node.describe()
            )),
        })
        .collect()
}

fn scaled(v: Vec<i64>, by: usize) -> Vec<i64> {
    v.into_iter().map(|s| s * by as i64).collect()
}

/// `A @ op(B)`: batch dims, (m, k, n), and the strides of op(B)(k, n).
struct Dims {
    ab: Vec<usize>,
    bb: Vec<usize>,
    ob: Vec<usize>,
    m: usize,
    k: usize,
    n: usize,
    sb: (i64, i64),
    dt: DType,
}

fn dims(node: &Node, a: &V, b: &V, trans_b: bool) -> Result<Dims> {
    let (ab, m, k) = split_batch(a.shape(), true);
    let (bb, r, c) = split_batch(b.shape(), false);
    let (n, sb) = if trans_b {
        (r, (1, c as i64))
    } else {
        (c, (c as i64, 1))
    };
    let ob = broadcast(node, &ab, &bb)?;
    Ok(Dims {
        ab,
        bb,
        ob,
        m,
        k,
        n,
        sb,
        dt: a.dtype(),
    })
}

/// The forward product of `dims` (A row-major, batch strides broadcast).
fn forward(d: &Dims) -> Product {
    let mut p = Product::new(d.dt, d.m, d.n, d.k, (d.k as i64, 1), d.sb);
    p.batch = d.ob.clone();
    p.bst[0] = scaled(bcast_strides(&d.ab, &d.ob), d.m * d.k);
    p.bst[1] = scaled(bcast_strides(&d.bb, &d.ob), d.k * d.n);
    p
}

pub fn matmul(w: &mut Wgpu, node: &Node, a: &V, b: &V, y: &V) -> Result<()> {
    let d = dims(node, a, b, false)?;
    let p = forward(&d);
    launch(
        w,
        node,
        Activation::None,
        &p,
        Bufs {
            a: a.buf,
            b: b.buf,
            d: y.buf,
            bias: None,
            res: None,
            pre: None,
        },
    )
}

/// ONNX Gemm: `alpha·op(A)·op(B) + beta·C`, C broadcast to `[M, N]` through the
/// epilogue's residual term.
pub fn gemm(
    w: &mut Wgpu,
    node: &Node,
    [a, b]: [&V; 2],
    c: Option<V>,
    (alpha, beta): (f32, f32),
    (ta, tb): (bool, bool),
    y: &V,
) -> Result<()> {
    let (m, n) = (y.shape()[0], y.shape()[1]);
    let k = if ta { a.shape()[0] } else { a.shape()[1] };
    let sa = if ta { (1, m as i64) } else { (k as i64, 1) };
    let sb = if tb { (1, k as i64) } else { (n as i64, 1) };
    let mut p = Product::new(a.dtype(), m, n, k, sa, sb);
    p.alpha = alpha;
    let res = match c {
        Some(c) if beta != 0.0 => {
            let st = bcast_strides(c.shape(), y.shape());
            p.r = (st[0], st[1]);
            p.rscale = beta;
            Some(c.buf)
        }
        _ => None,
    };
    launch(
        w,
        node,
        Activation::None,
        &p,
        Bufs {
            a: a.buf,
            b: b.buf,
            d: y.buf,
            bias: None,
            res,
            pre: None,
        },
    )
}

/// `act(A @ op(B) + bias) + residual` in one shader; with Pre asked for (training),
/// Pre = A·op(B) + bias is stored on the way.
#[allow(clippy::too_many_arguments)]
pub fn fused(
    w: &mut Wgpu,
    node: &Node,
    [a, b]: [&V; 2],
    bias: Option<V>,
    res: Option<V>,
    act: Activation,
    trans_b: bool,
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let d = dims(node, a, b, trans_b)?;
    let mut p = forward(&d);
    let y = &outs[0];
    if let Some(r) = &res {
        // The residual broadcast to the full [batch.., m, n] view of Y (a 1-D operand
        // dropped m or n from Y's shape: that dim has stride 0).
        let st = bcast_strides(r.shape(), y.shape());
        let nb = d.ob.len();
        let (a1, b1) = (a.shape().len() == 1, b.shape().len() == 1);
        let (rm, rn) = match (a1, b1) {
            (true, true) => (0, 0),
            (true, false) => (0, st[nb]),
            (false, true) => (st[nb], 0),
            (false, false) => (st[nb], st[nb + 1]),
        };
        p.r = (rm, rn);
        p.bst[2] = st[..nb].to_vec();
    }
    let pre = wanted(outs, want, 1);
    launch(
        w,
        node,
        act,
        &p,
        Bufs {
            a: a.buf,
            b: b.buf,
            d: y.buf,
            bias: bias.map(|v| v.buf),
            res: res.map(|v| v.buf),
            pre: pre.map(|v| v.buf),
        },
    )
}

/// GatedMatMul: G = A·Bg + bias_g and U = A·Bu + bias_u, into the outputs the graph reads
/// or into scratch, then `Y = act(G)·U` in one pass.
#[allow(clippy::too_many_arguments)]
pub fn gated(
    w: &mut Wgpu,
    node: &Node,
    a: &V,
    [bg, bu]: [&V; 2],
    [bias_g, bias_u]: [Option<V>; 2],
    act: Activation,
    trans_b: bool,
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let y = &outs[0];
    // Scratch for the products the graph does not read.
    let scratch = |i: usize| {
        wanted(outs, want, i)
            .is_none()
            .then(|| w.scratch(y.ty.bytes()))
    };
    let bufs = [scratch(1), scratch(2)];
    let [g, u] = [1, 2].map(|i| match (wanted(outs, want, i), &bufs[i - 1]) {
        (Some(v), _) => *v,
        (None, b) => V {
            buf: b.as_ref().expect("scratch for an unread product"),
            ty: y.ty,
        },
    });
    for (wt, bias, out) in [(bg, bias_g, g), (bu, bias_u, u)] {
        fused(
            w,
            node,
            [a, wt],
            bias,
            None,
            Activation::None,
            trans_b,
            &[out],
            &[true],
        )?;
    }
    super::elementwise::glu(w, node, act, None, [&g, &u], &[y])
}

/// `(dY, A, B, [Pre], [PreA]) → (dA, dB, [dBias], [dBiasA])` with G = dY·act'(Pre):
/// dA = G·op(B)ᵀ (times act_a'(PreA) with `pre_a`), dB = Aᵀ·G (Gᵀ·A with trans_b), summed
/// over the batch entries that share an operand; dBias = Σ_rows G, dBiasA = Σ_rows dA.
#[allow(clippy::too_many_arguments)]
pub fn fused_grad(
    w: &mut Wgpu,
    node: &Node,
    [dy, a, b]: [&V; 3],
    pre: Option<V>,
    act: Activation,
    trans_b: bool,
    pre_a: Option<(V, Activation)>,
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let d = dims(node, a, b, trans_b)?;
    let (m, k, n) = (d.m, d.k, d.n);
    let nb = numel(&d.ob);
    let out = |i: usize| wanted(outs, want, i);
    let (g_buf, prod_buf);
    let g = match (act, pre) {
        (Activation::None, _) => dy.buf,
        (_, None) => crate::bail!(
            Runtime,
            "{}: FusedMatMulGrad with activation {} needs the forward's Pre (input 3)",
            node.describe(),
            act.name()
        ),
        (_, Some(p)) => {
            g_buf = w.scratch(dy.ty.bytes());
            grad_kernel(
                w,
                node,
                dy,
                &p,
                &V {
                    buf: &g_buf,
                    ty: dy.ty,
                },
                act_code(act),
                [0.0; 2],
            )?;
            &g_buf
        }
    };
    let a_st = bcast_strides(&d.ab, &d.ob);
    let b_st = bcast_strides(&d.bb, &d.ob);
    let (na, nbb) = (numel(&d.ab), numel(&d.bb));
    let none = |a, b, d| Bufs {
        a,
        b,
        d,
        bias: None,
        res: None,
        pre: None,
    };
    if let Some(da_out) = out(0) {
        // With PreA, the product goes to scratch and dA = product · act_a'(PreA) (a
        // buffer cannot be both read and written by one dispatch).
        let da = match &pre_a {
            None => V {
                buf: da_out.buf,
                ty: da_out.ty,
            },
            Some(_) => {
                prod_buf = w.scratch(da_out.ty.bytes());
                V {
                    buf: &prod_buf,
                    ty: da_out.ty,
                }
            }
        };
        // dA(m, k) = Σ_j G(m, j) · op(B)(k, j).
        let mut p = Product::new(d.dt, m, k, n, (n as i64, 1), (d.sb.1, d.sb.0));
        if na == nb {
            p.batch = d.ob.clone();
            p.bst[0] = scaled(strides(&d.ob), m * n);
            p.bst[1] = scaled(b_st.clone(), k * n);
            launch(w, node, Activation::None, &p, none(g, b.buf, da.buf))?;
        } else {
            // A broadcast: each output batch's product is added onto its A matrix.
            w.rec.clear(da.buf, da.ty.bytes());
            p.flags = ACCUM;
            for i in 0..nb {
                let mut q = p.clone();
                q.base = [
                    (i * m * n) as i64,
                    offset(i, &d.ob, &b_st) * (k * n) as i64,
                    0,
                ];
                q.d_off = offset(i, &d.ob, &a_st) as usize * m * k;
                launch(w, node, Activation::None, &q, none(g, b.buf, da.buf))?;
            }
        }
        if let Some((pa, act_a)) = &pre_a {
            grad_kernel(w, node, &da, pa, da_out, act_code(*act_a), [0.0; 2])?;
        }
        if let Some(dbias_a) = out(3) {
            let rows = da_out.ty.numel() / k.max(1);
            sum_rows(w, node, da_out, rows, k, dbias_a)?;
        }
    } else if out(3).is_some() {
        crate::bail!(
            Runtime,
            "{}: dBiasA (output 3) needs dA (output 0)",
            node.describe()
        );
    }
    if let Some(db) = out(1) {
        // dB(k, n) = Σ_m A(m, k) · G(m, n); with trans_b dB(n, k) = Σ_m G(m, n) · A(m, k).
        let (l, r, lm, ln, ls, rs) = if trans_b {
            (g, a.buf, n, k, (1, n as i64), (k as i64, 1))
        } else {
            (a.buf, g, k, n, (1, k as i64), (n as i64, 1))
        };
        let (lmat, rmat) = if trans_b {
            (m * n, m * k)
        } else {
            (m * k, m * n)
        };
        let (lst, rst) = if trans_b {
            (strides(&d.ob), a_st.clone())
        } else {
            (a_st.clone(), strides(&d.ob))
        };
        let p = Product::new(d.dt, lm, ln, m, ls, rs);
        if nbb == nb {
            let mut q = p;
            q.batch = d.ob.clone();
            q.bst[0] = scaled(lst, lmat);
            q.bst[1] = scaled(rst, rmat);
            launch(w, node, Activation::None, &q, none(l, r, db.buf))?;
        } else if nbb == 1 && na == nb {
            // Σ_i over a contiguous batch is one product over nb·M rows.
            let mut q = p;
            q.k = nb * m;
            launch(w, node, Activation::None, &q, none(l, r, db.buf))?;
        } else {
            w.rec.clear(db.buf, db.ty.bytes());
            let mut p = p;
            p.flags = ACCUM;
            for i in 0..nb {
                let mut q = p.clone();
                q.base = [
                    offset(i, &d.ob, &lst) * lmat as i64,
                    offset(i, &d.ob, &rst) * rmat as i64,
                    0,
                ];
                q.d_off = offset(i, &d.ob, &b_st) as usize * k * n;
                launch(w, node, Activation::None, &q, none(l, r, db.buf))?;
            }
        }
    }
    if let Some(dbias) = out(2) {
        sum_rows(w, node, &V { buf: g, ty: dy.ty }, nb * m, n, dbias)?;
    }
    Ok(())
}

/// The offset (in matrices) of batch entry `i` of `shape` under strides `st`.
fn offset(i: usize, shape: &[usize], st: &[i64]) -> i64 {
    let mut r = i;
    let mut off = 0;
    for d in (0..shape.len()).rev() {
        off += (r % shape[d].max(1)) as i64 * st[d];
        r /= shape[d].max(1);
    }
    off
}
