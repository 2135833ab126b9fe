//! Conv and ConvGrad on CUDA, three ways: cuBLASLt products over Im2Col columns in scratch
//! (Col2Im for dX; over the image itself for a 1×1 stride-1 convolution), cuDNN on the
//! channels-first tensors as they are (cudnn.rs), and cuDNN's channels-last kernels on
//! transposed copies. Where more than one can run, the first eager call of each shape
//! times them and keeps the fastest. cuDNN's tensor-core kernels want NHWC: on
//! channels-first tensors it runs 16-bit 3×3 convolutions below them by more than the
//! copies both ways cost (ResNet-50 bf16 on an H200, 6.91 → 6.32 ms at batch 32:
//! docs/BENCHMARKS.md). The copy back carries FusedConv's bias, residual and activation in
//! the same pass. The products over columns win at batch 1.

use super::cudnn::{ConvShape, Cudnn, Which};
use super::device::{launch_grid, strides, suffix, word, Arg, Strided};
use super::elementwise::{act_epilogue, binary};
use super::matmul::strided_batch;
use super::shape::{col2im_geom, im2col_geom};
use super::{Cuda, V};
use crate::backends::common::{self, act_code, ConvGeom};
use crate::error::Result;
use crate::graph::infer::ValueType;
use crate::graph::{Activation, BinaryOp, Node};
use crate::tensor::DType;

/// How a convolution runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Way {
    /// cuBLASLt products over Im2Col columns.
    Columns,
    /// cuDNN on the channels-first tensors.
    Cudnn,
    /// cuDNN channels-last, on transposed copies.
    Nhwc,
}

/// cuDNN and the shape it takes, for its two ways.
type Dnn<'a> = Option<(&'a Cudnn, &'a ConvShape)>;

/// cuDNN's description of a convolution, when its padding is symmetric (cuDNN takes one
/// pad per axis).
fn cudnn_shape(cg: &ConvGeom, dt: DType, nhwc: bool) -> Option<ConvShape> {
    let g = &cg.g;
    let r = cg.rank;
    let tail = |a: [usize; 3]| a[3 - r..].to_vec();
    (g.begin == g.end).then(|| ConvShape {
        dt,
        n: g.n,
        c: g.c,
        m: cg.m,
        group: cg.group,
        image: tail(g.image),
        kernel: tail(g.kernel),
        out: tail(g.out),
        pads: tail(g.begin),
        strides: tail(g.strides),
        dilations: tail(g.dilations),
        nhwc,
    })
}

/// The grid of a tiled transpose of `[batch, rows, cols]` (cuda/shape.cu `transpose_k`);
/// None past CUDA's grid limits.
fn tiles(batch: usize, rows: usize, cols: usize) -> Option<(u32, u32, u32)> {
    let (x, y) = (cols.div_ceil(32), rows.div_ceil(32));
    (x <= i32::MAX as usize && y <= 65535 && batch <= 65535).then_some((
        x as u32,
        y as u32,
        batch as u32,
    ))
}

/// Whether every copy between the two layouts fits a grid.
fn copies_fit(cg: &ConvGeom) -> bool {
    let g = &cg.g;
    [
        (g.n, g.c, g.hw()),
        (g.n, cg.m, g.l()),
        (cg.m, cg.cg(), g.k()),
        (g.n, g.hw(), g.c),
        (g.n, g.l(), cg.m),
        (cg.m, g.k(), cg.cg()),
    ]
    .iter()
    .all(|&(b, r, c)| tiles(b, r, c).is_some())
}

/// Transposes `[batch, rows, cols]` at `src` into `[batch, cols, rows]` at `dst`.
fn transpose(
    c: &Cuda,
    dt: DType,
    src: u64,
    dst: u64,
    [batch, rows, cols]: [usize; 3],
) -> Result<()> {
    let Some(grid) = tiles(batch, rows, cols) else {
        crate::bail!(
            Runtime,
            "internal: a transpose of [{batch}, {rows}, {cols}] past the grid"
        );
    };
    let args = [
        Arg::Ptr(src),
        Arg::Ptr(dst),
        Arg::I64(rows as i64),
        Arg::I64(cols as i64),
    ];
    let name = format!("transpose_{}", word(dt));
    launch_grid(&c.dev, &c.stream, &name, grid, 256, 0, &args)
}

/// `[batch, ch, sp]` at `src` channels-last, in scratch (or `src` itself where the
/// transpose changes nothing: one channel or one position).
fn to_last(c: &Cuda, dt: DType, src: u64, [batch, ch, sp]: [usize; 3]) -> Result<u64> {
    if ch == 1 || sp == 1 {
        return Ok(src);
    }
    let dst = c.scratch(batch * ch * sp * dt.size())?;
    transpose(c, dt, src, dst, [batch, ch, sp])?;
    Ok(dst)
}

/// Where a channels-last result `[batch, sp, ch]` goes before `back` copies it to `dst`:
/// scratch, or `dst` itself where the order is the same.
fn staged(c: &Cuda, dt: DType, dst: u64, [batch, sp, ch]: [usize; 3]) -> Result<u64> {
    match ch == 1 || sp == 1 {
        true => Ok(dst),
        false => c.scratch(batch * ch * sp * dt.size()),
    }
}

/// `staged`'s counterpart: the channels-last `[batch, sp, ch]` at `src` into `dst`
/// channels-first.
fn back(c: &Cuda, dt: DType, src: u64, dst: u64, dims: [usize; 3]) -> Result<()> {
    match src == dst {
        true => Ok(()),
        false => transpose(c, dt, src, dst, dims),
    }
}

impl Cuda {
    /// Runs convolution `which` by `run` in the way chosen for its shape: forced by the
    /// `cuda_conv` tuning, else the fastest at the shape's first eager call. `run` is given
    /// the way and, for cuDNN's ways, the library and the shape it takes; it returns false
    /// where cuDNN found no algorithm that runs (then the columns take it).
    fn conv_by_choice(
        &self,
        which: Which,
        cg: &ConvGeom,
        dt: DType,
        run: &dyn Fn(Way, Dnn) -> Result<bool>,
    ) -> Result<()> {
        let forced = match crate::backends::tuning::tuning().cuda_conv.as_str() {
            "columns" => Some(Way::Columns),
            "cudnn" => Some(Way::Cudnn),
            "nhwc" => Some(Way::Nhwc),
            _ => None,
        };
        let dnn = match forced {
            Some(Way::Columns) => None,
            _ => self.cudnn()?,
        };
        let shape = |nhwc: bool| {
            let d = dnn?;
            let s = cudnn_shape(cg, dt, nhwc)?;
            // A way that does not take the tensors' own layout runs on transposed copies.
            let typed = !nhwc || matches!(dt, DType::F16 | DType::BF16 | DType::F32);
            (typed && (nhwc == cg.channels_last || copies_fit(cg))).then_some(())?;
            d.supports(&s).then_some((d, s))
        };
        let (plain, nhwc) = (shape(false), shape(true));
        let go = |way: Way| -> Result<bool> {
            let ctx = match way {
                Way::Columns => None,
                Way::Cudnn => plain.as_ref().map(|(d, s)| (*d, s)),
                Way::Nhwc => nhwc.as_ref().map(|(d, s)| (*d, s)),
            };
            match (way, ctx) {
                (Way::Columns, _) => run(way, None),
                (_, Some(ctx)) => run(way, Some(ctx)),
                (_, None) => Ok(false),
            }
        };
        let columns = || run(Way::Columns, None).map(|_| ());
        let either = |way: Way| if go(way)? { Ok(()) } else { columns() };
        if let Some(way) = forced {
            // A forced cuDNN way that cannot run a 16/32-bit convolution cuDNN can
            // describe (its pads symmetric) is an error, so that a test forcing it knows
            // it ran (f64 has no channels-last kernels).
            let strict = way != Way::Columns && dt != DType::F64 && cg.g.begin == cg.g.end;
            if strict && !go(way)? {
                crate::bail!(
                    Runtime,
                    "tuning cuda_conv: the {way:?} way cannot run the {which:?} convolution \
                     of {dt} X {:?} into Y {:?} here",
                    cg.g.image,
                    cg.g.out
                );
            }
            return match strict {
                true => Ok(()),
                false => either(way),
            };
        }
        let ways: Vec<Way> = [
            Some(Way::Columns),
            plain.as_ref().map(|_| Way::Cudnn),
            nhwc.as_ref().map(|_| Way::Nhwc),
        ]
        .into_iter()
        .flatten()
        .collect();
        let Some((_, key)) = plain.as_ref().or(nhwc.as_ref()).filter(|_| ways.len() > 1) else {
            return columns();
        };
        let key = (which, key.clone(), cg.channels_last);
        let chosen = self.conv_choice.borrow().get(&key).copied();
        // Safety: the stream is ours; only its capture status is read.
        let capturing =
            unsafe { cudarc::driver::result::stream::is_capturing(self.stream.cu_stream()) }
                .map(|st| {
                    st != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
                })
                .unwrap_or(true);
        match chosen {
            Some(way) => return either(way),
            // Timing reruns the call: not while a step is being recorded.
            None if capturing => return either(ways[ways.len().min(2) - 1]),
            None => {}
        }
        // Each way once to warm up (cuDNN times its own algorithms then), then three
        // times; scratch is taken afresh from the node's first slot each run.
        let mut best = (Way::Columns, f32::INFINITY);
        for &way in &ways {
            let t = self.time_runs(&|| {
                self.steps.node_begins();
                go(way)
            })?;
            if let Some(t) = t.filter(|&t| t < best.1) {
                best = (way, t);
            }
        }
        self.conv_choice.borrow_mut().insert(key, best.0);
        // The last run left another way's result: the same values, but run the chosen
        // one so that the step's work is what later steps repeat.
        self.steps.node_begins();
        either(best.0)
    }

    /// X's columns `[N, C·K, L]` in scratch (X itself when pointwise).
    fn columns(&self, cg: &ConvGeom, dt: DType, x: u64) -> Result<u64> {
        if cg.pointwise() {
            return Ok(x);
        }
        let g = &cg.g;
        let n = g.n * g.c * g.k() * g.l();
        let cols = self.scratch(n * dt.size())?;
        im2col_geom(self, g, dt, x, cols, n)?;
        Ok(cols)
    }
}

/// Y = conv(X, W) + B.
pub fn conv(c: &Cuda, node: &Node, x: &V, w: &V, b: Option<V>, y: &V) -> Result<()> {
    fused_conv(c, node, [x, w], b, None, Activation::None, &[*y], &[true])
}

/// A scratch buffer of type `ty` (the plan's buffers are only the node's own).
fn scratch_v<'a>(c: &Cuda, ty: &'a ValueType) -> Result<V<'a>> {
    Ok(V {
        p: c.scratch(ty.bytes())?,
        ty,
        buf: None,
    })
}

/// FusedConv: `Y = act(conv(X, W) + B + Z)`, and Pre = conv + B + Z when asked for.
/// cuDNN's channels-last kernels on channels-first tensors: the copy back does all of
/// it. On channels-last tensors: the epilogue is one pass after the convolution
/// (`conv_last_out`). The channels-first ways on channels-first tensors: the convolution
/// (with its bias) writes Pre, or Y itself, and Z and the activation follow as a pass
/// each; on channels-last tensors they run on transposed copies.
#[allow(clippy::too_many_arguments)]
pub fn fused_conv(
    c: &Cuda,
    node: &Node,
    [x, w]: [&V; 2],
    b: Option<V>,
    z: Option<V>,
    act: Activation,
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let dt = x.dtype();
    let cg = common::conv_geom(node, x.shape(), w.shape())?;
    let y = &outs[0];
    if y.numel() == 0 {
        return Ok(());
    }
    let pre = common::wanted(outs, want, 1);
    let sum = pre.unwrap_or(y);
    let (g, l) = (&cg.g, cg.g.l());
    // Y channels first, for the channels-first ways on channels-last tensors.
    let first_ty = ValueType::new(dt, &[g.n, cg.m, l]);
    let run = |way: Way, dnn: Dnn| -> Result<bool> {
        let scratch = |bytes| c.scratch(bytes);
        match (way, dnn, cg.channels_last) {
            (Way::Nhwc, Some((d, s)), false) => {
                let xt = to_last(c, dt, x.p, [g.n, g.c, g.hw()])?;
                let wt = to_last(c, dt, w.p, [cg.m, cg.cg(), g.k()])?;
                let yt = c.scratch(y.numel() * dt.size())?;
                if !d.conv(Which::Forward, s, xt, wt, yt, None, &scratch)? {
                    return Ok(false);
                }
                // Y = act(Yt transposed + B + Z), Pre the sum.
                let args = [
                    Arg::Ptr(yt),
                    Arg::Ptr(b.map_or(0, |b| b.p)),
                    Arg::Ptr(z.map_or(0, |z| z.p)),
                    Arg::Ptr(pre.map_or(0, |p| p.p)),
                    Arg::Ptr(y.p),
                    Arg::I64(l as i64),
                    Arg::I64(cg.m as i64),
                    Arg::I32(act_code(act)),
                ];
                let Some(grid) = tiles(g.n, l, cg.m) else {
                    return Ok(false);
                };
                let name = format!("conv_out_{}", suffix(dt));
                launch_grid(&c.dev, &c.stream, &name, grid, 256, 0, &args)?;
                Ok(true)
            }
            (Way::Nhwc, Some((d, s)), true) => {
                if !d.conv(Which::Forward, s, x.p, w.p, sum.p, None, &scratch)? {
                    return Ok(false);
                }
                last_epilogue(c, sum.p, b, z, pre, y, cg.m, act)?;
                Ok(true)
            }
            (_, dnn, false) => first_forward(c, node, &cg, way, dnn, [x.p, w.p], b, z, sum, y, act),
            (_, dnn, true) => {
                let xf = to_last(c, dt, x.p, [g.n, g.hw(), g.c])?;
                let wf = to_last(c, dt, w.p, [cg.m, g.k(), cg.cg()])?;
                let zf = match z {
                    Some(z) => Some(V {
                        p: to_last(c, dt, z.p, [g.n, l, cg.m])?,
                        ty: &first_ty,
                        buf: None,
                    }),
                    None => None,
                };
                let yf = scratch_v(c, &first_ty)?;
                let pf = pre.map(|_| scratch_v(c, &first_ty)).transpose()?;
                let sf = pf.as_ref().unwrap_or(&yf);
                if !first_forward(c, node, &cg, way, dnn, [xf, wf], b, zf, sf, &yf, act)? {
                    return Ok(false);
                }
                for (from, to) in [(Some(&yf), Some(y)), (pf.as_ref(), pre)] {
                    if let (Some(f), Some(t)) = (from, to) {
                        back(c, dt, f.p, t.p, [g.n, cg.m, l])?;
                    }
                }
                Ok(true)
            }
        }
    };
    c.conv_by_choice(Which::Forward, &cg, dt, &run)
}

/// The channels-first ways of `fused_conv` on channels-first X and W at `x`, `w`: the
/// convolution with its bias into `sum` (Pre, or Y itself), then Z and the activation.
#[allow(clippy::too_many_arguments)]
fn first_forward(
    c: &Cuda,
    node: &Node,
    cg: &ConvGeom,
    way: Way,
    dnn: Dnn,
    [x, w]: [u64; 2],
    b: Option<V>,
    z: Option<V>,
    sum: &V,
    y: &V,
    act: Activation,
) -> Result<bool> {
    let dt = y.dtype();
    let (g, l, ckg, mg, es) = (&cg.g, cg.g.l(), cg.ckg(), cg.mg(), dt.size() as u64);
    let scratch = |bytes| c.scratch(bytes);
    match (way, dnn) {
        (Way::Cudnn, Some((d, s))) => {
            if !d.conv(Which::Forward, s, x, w, sum.p, b.map(|b| b.p), &scratch)? {
                return Ok(false);
            }
        }
        _ => {
            if let Some(b) = b {
                // Y starts as the bias broadcast over each channel; the products add
                // onto it.
                let src: Vec<i64> = (0..y.shape().len()).map(|d| (d == 1) as i64).collect();
                let st = Strided::new(y.shape(), &[&src, &strides(y.shape())], &[])?;
                let n = y.numel();
                let args = [
                    Arg::Ptr(b.p),
                    Arg::Ptr(sum.p),
                    Arg::Strided(st),
                    Arg::I64(n as i64),
                ];
                c.launch_n(&format!("copy_{}", word(dt)), n, &args)?;
            }
            let cols = c.columns(cg, dt, x)?;
            for grp in 0..cg.group {
                // Y[n, group] = W[group] · columns[n, group], a product per image.
                strided_batch(
                    c,
                    dt,
                    (mg, l, ckg),
                    (false, false),
                    g.n,
                    (w + (grp * mg * ckg) as u64 * es, 0),
                    (cols + (grp * ckg * l) as u64 * es, g.c * g.k() * l),
                    (sum.p + (grp * mg * l) as u64 * es, cg.m * l),
                    b.is_some(),
                )?;
            }
        }
    }
    if let Some(z) = z {
        binary(c, node, BinaryOp::Add, sum, &z, sum)?;
    }
    if act != Activation::None || sum.p != y.p {
        act_epilogue(c, act, sum.p, None, y)?;
    }
    Ok(true)
}

/// FusedConv's epilogue on a channels-last result at `sum` (Pre, or Y itself): Y =
/// act(sum + B + Z), Pre the sum before the activation; nothing where there is nothing
/// to add or apply.
#[allow(clippy::too_many_arguments)]
fn last_epilogue(
    c: &Cuda,
    sum: u64,
    b: Option<V>,
    z: Option<V>,
    pre: Option<&V>,
    y: &V,
    m: usize,
    act: Activation,
) -> Result<()> {
    if b.is_none() && z.is_none() && pre.is_none() && act == Activation::None {
        return Ok(());
    }
    let (n, dt) = (y.numel(), y.dtype());
    let v = 16 / dt.size();
    let ptrs = [
        Some(sum),
        b.map(|b| b.p),
        z.map(|z| z.p),
        pre.map(|p| p.p),
        Some(y.p),
    ];
    let vec = m.is_multiple_of(v) && ptrs.iter().flatten().all(|p| p.is_multiple_of(16));
    let args = [
        Arg::Ptr(sum),
        Arg::Ptr(b.map_or(0, |b| b.p)),
        Arg::Ptr(z.map_or(0, |z| z.p)),
        Arg::Ptr(pre.map_or(0, |p| p.p)),
        Arg::Ptr(y.p),
        Arg::I64(n as i64),
        Arg::I64(m as i64),
        Arg::I32(act_code(act)),
        Arg::I32(vec as i32),
    ];
    let threads = if vec { n / v } else { n };
    c.launch_n(&format!("conv_last_out_{}", suffix(dt)), threads, &args)
}

/// dX and dW (each when asked for) from dY, X and W. A way that does not take the
/// tensors' own layout runs on transposed copies, as the forward's.
pub fn conv_grad(
    c: &Cuda,
    node: &Node,
    [dy, x, w]: [&V; 3],
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let dt = x.dtype();
    let cg = common::conv_geom(node, x.shape(), w.shape())?;
    let (g, l, ckg, mg, m, es) = (&cg.g, cg.g.l(), cg.ckg(), cg.mg(), cg.m, dt.size() as u64);
    let hw = g.hw();
    let home_last = cg.channels_last;
    // `[batch, ch, sp]` channels-first dims in the tensors' own order, for the copies.
    let own = |[batch, ch, sp]: [usize; 3]| match home_last {
        true => [batch, sp, ch],
        false => [batch, ch, sp],
    };
    // Whether `way` reads the tensors as they lie.
    let native = |way: Way| (way == Way::Nhwc) == home_last;
    let scratch = |bytes| c.scratch(bytes);
    // dY in the other layout, for dX and dW alike where both take a way that needs it:
    // transposed once, unless timing the ways started scratch over in between.
    let dy_kept = std::cell::Cell::new(None);
    let dy_other = || -> Result<u64> {
        let round = c.steps.scratch_round();
        if let Some((p, _)) = dy_kept.get().filter(|&(_, r)| r == round) {
            return Ok(p);
        }
        let p = to_last(c, dt, dy.p, own([g.n, m, l]))?;
        dy_kept.set(Some((p, round)));
        Ok(p)
    };
    if want.first() == Some(&true) && x.numel() > 0 {
        let dx = &outs[0];
        // The channels-first ways on channels-first dY, W into dX.
        let first = |way: Way, dnn: Dnn, dy: u64, w: u64, dx: u64| -> Result<bool> {
            if let (Way::Cudnn, Some((d, s))) = (way, dnn) {
                return d.conv(Which::Data, s, dy, w, dx, None, &scratch);
            }
            let n = g.n * g.c * g.k() * l;
            let (cols, rows) = if cg.pointwise() {
                (dx, g.c * hw)
            } else {
                (c.scratch(n * dt.size())?, g.c * g.k() * l)
            };
            for grp in 0..cg.group {
                // columns[n, group] = W[group]ᵀ · dY[n, group]
                strided_batch(
                    c,
                    dt,
                    (ckg, l, mg),
                    (true, false),
                    g.n,
                    (w + (grp * mg * ckg) as u64 * es, 0),
                    (dy + (grp * mg * l) as u64 * es, m * l),
                    (cols + (grp * ckg * l) as u64 * es, rows),
                    false,
                )?;
            }
            if !cg.pointwise() {
                col2im_geom(c, g, dt, cols, dx, g.n * g.c * hw)?;
            }
            Ok(true)
        };
        let run = |way: Way, dnn: Dnn| -> Result<bool> {
            match (way, dnn) {
                (Way::Nhwc, Some((d, s))) if native(way) => {
                    d.conv(Which::Data, s, dy.p, w.p, dx.p, None, &scratch)
                }
                _ if native(way) => first(way, dnn, dy.p, w.p, dx.p),
                _ => {
                    let dyo = dy_other()?;
                    let wo = to_last(c, dt, w.p, own([m, cg.cg(), g.k()]))?;
                    // dX's dims as the way writes it.
                    let [b, r, cc] = own([g.n, g.c, hw]);
                    let dims = [b, cc, r];
                    let dxo = staged(c, dt, dx.p, dims)?;
                    let ran = match (way, dnn) {
                        (Way::Nhwc, Some((d, s))) => {
                            d.conv(Which::Data, s, dyo, wo, dxo, None, &scratch)?
                        }
                        _ => first(way, dnn, dyo, wo, dxo)?,
                    };
                    Ok(ran && back(c, dt, dxo, dx.p, dims).map(|_| true)?)
                }
            }
        };
        c.conv_by_choice(Which::Data, &cg, dt, &run)?;
    }
    if want.get(1) == Some(&true) && w.numel() > 0 {
        let dw = &outs[1];
        if g.n == 0 || l == 0 {
            return c.memset0(dw);
        }
        // The channels-first ways on channels-first X, dY into dW.
        let first = |way: Way, dnn: Dnn, x: u64, dy: u64, dw: u64| -> Result<bool> {
            if let (Way::Cudnn, Some((d, s))) = (way, dnn) {
                return d.conv(Which::Filter, s, x, dy, dw, None, &scratch);
            }
            let cols = c.columns(&cg, dt, x)?;
            let rows = if cg.pointwise() {
                g.c * hw
            } else {
                g.c * g.k() * l
            };
            for n in 0..g.n {
                // dW[group] (+)= dY[n, group] · columns[n, group]ᵀ, every group at once.
                strided_batch(
                    c,
                    dt,
                    (mg, ckg, l),
                    (false, true),
                    cg.group,
                    (dy + (n * m * l) as u64 * es, mg * l),
                    (cols + (n * rows) as u64 * es, ckg * l),
                    (dw, mg * ckg),
                    n > 0,
                )?;
            }
            Ok(true)
        };
        let run = |way: Way, dnn: Dnn| -> Result<bool> {
            match (way, dnn) {
                (Way::Nhwc, Some((d, s))) if native(way) => {
                    d.conv(Which::Filter, s, x.p, dy.p, dw.p, None, &scratch)
                }
                _ if native(way) => first(way, dnn, x.p, dy.p, dw.p),
                _ => {
                    let xo = to_last(c, dt, x.p, own([g.n, g.c, hw]))?;
                    let dyo = dy_other()?;
                    let [b, r, cc] = own([m, cg.cg(), g.k()]);
                    let dims = [b, cc, r];
                    let dwo = staged(c, dt, dw.p, dims)?;
                    let ran = match (way, dnn) {
                        (Way::Nhwc, Some((d, s))) => {
                            d.conv(Which::Filter, s, xo, dyo, dwo, None, &scratch)?
                        }
                        _ => first(way, dnn, xo, dyo, dwo)?,
                    };
                    Ok(ran && back(c, dt, dwo, dw.p, dims).map(|_| true)?)
                }
            }
        };
        c.conv_by_choice(Which::Filter, &cg, dt, &run)?;
    }
    Ok(())
}
