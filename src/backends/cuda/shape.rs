//! Shape family on CUDA (cuda/shape.cu): Transpose, Slice, Concat, Split, Expand and
//! SliceGrad are all one strided copy with different strides; Gather and GatherGrad.

use super::device::{strides, suffix, word, Arg, Strided};
use super::{unsupported, Cuda, V};
use crate::backends::common;
use crate::error::Result;
use crate::graph::{Node, Op, ScatterReduction};
use crate::tensor::{numel, DType};

/// Copies the elements of a walk over `shape`: element i goes from `src + offset(0, i)`
/// to `dst + offset(1, i)`.
#[allow(clippy::too_many_arguments)]
fn strided_copy(
    c: &Cuda,
    src: &V,
    dst: &V,
    shape: &[usize],
    src_st: &[i64],
    src_base: i64,
    dst_st: &[i64],
    dst_base: i64,
) -> Result<()> {
    let n = numel(shape);
    // With the innermost dim contiguous on both sides (a Transpose that keeps the last
    // axis, Split, Concat), copy 16-byte words: one index computation per 16 bytes.
    let esz = src.dtype().size();
    let w = (16 / esz) as i64;
    let r = shape.len();
    if r > 0
        && esz < 16
        && shape[r - 1] as i64 % w == 0
        && src_st[r - 1] == 1
        && dst_st[r - 1] == 1
        && src_st[..r - 1]
            .iter()
            .chain(&dst_st[..r - 1])
            .all(|&x| x % w == 0)
        && src_base % w == 0
        && dst_base % w == 0
        && src.p.is_multiple_of(16)
        && dst.p.is_multiple_of(16)
    {
        let mut wshape = shape.to_vec();
        wshape[r - 1] /= w as usize;
        let div = |st: &[i64]| -> Vec<i64> {
            st.iter()
                .enumerate()
                .map(|(d, &x)| if d == r - 1 { 1 } else { x / w })
                .collect()
        };
        let (ss, ds) = (div(src_st), div(dst_st));
        let s = Strided::new(&wshape, &[&ss, &ds], &[src_base / w, dst_base / w])?;
        let nw = numel(&wshape);
        let args = [
            Arg::Ptr(src.p),
            Arg::Ptr(dst.p),
            Arg::Strided(s),
            Arg::I64(nw as i64),
        ];
        return c.launch_n("copy_w16", nw, &args);
    }
    let s = Strided::new(shape, &[src_st, dst_st], &[src_base, dst_base])?;
    let args = [
        Arg::Ptr(src.p),
        Arg::Ptr(dst.p),
        Arg::Strided(s),
        Arg::I64(n as i64),
    ];
    c.launch_n(&format!("copy_{}", word(src.dtype())), n, &args)
}

/// Reads `x` with strides `st` from `base` into contiguous `y`.
fn gather_copy(c: &Cuda, x: &V, y: &V, st: &[i64], base: i64) -> Result<()> {
    strided_copy(c, x, y, y.shape(), st, base, &strides(y.shape()), 0)
}

pub fn transpose(c: &Cuda, x: &V, perm: Option<&[usize]>, y: &V) -> Result<()> {
    let st = strides(x.shape());
    let r = st.len();
    let st: Vec<i64> = match perm {
        Some(p) => p.iter().map(|&d| st[d]).collect(),
        None => (0..r).rev().map(|d| st[d]).collect(),
    };
    gather_copy(c, x, y, &st, 0)
}

pub fn expand(c: &Cuda, x: &V, y: &V) -> Result<()> {
    gather_copy(
        c,
        x,
        y,
        &super::device::bcast_strides(x.shape(), y.shape()),
        0,
    )
}

/// Each input is written into its window of the output along `axis`.
pub fn concat(c: &Cuda, ins: &[Option<V>], axis: i64, y: &V) -> Result<()> {
    let r = y.shape().len();
    let a = common::axis_index(axis, r)?;
    let yst = strides(y.shape());
    let mut at = 0i64;
    for x in ins.iter().flatten() {
        strided_copy(
            c,
            x,
            y,
            x.shape(),
            &strides(x.shape()),
            0,
            &yst,
            at * yst[a],
        )?;
        at += x.shape()[a] as i64;
    }
    Ok(())
}

/// Each output reads its window of the input along `axis`.
pub fn split(c: &Cuda, x: &V, axis: i64, outs: &[V]) -> Result<()> {
    let r = x.shape().len();
    let a = common::axis_index(axis, r)?;
    let xst = strides(x.shape());
    let mut at = 0i64;
    for y in outs {
        gather_copy(c, x, y, &xst, at * xst[a])?;
        at += y.shape()[a] as i64;
    }
    Ok(())
}

/// The strides and base offset that read the slice `sel` of a tensor of `shape`.
fn slice_view(shape: &[usize], sliced: &[usize], sel: &[(i64, i64)]) -> (Vec<i64>, i64) {
    let mut st = strides(shape);
    let mut base = 0;
    for (a, &(s, step)) in sel.iter().enumerate() {
        if sliced[a] > 0 {
            base += s * st[a];
        }
        st[a] = st[a].saturating_mul(step);
    }
    (st, base)
}

/// Slice's (start, step) per dim, its starts/ends/axes/steps inputs read back from the
/// device (they decide offsets).
fn slice_steps(c: &Cuda, shape: &[usize], args: &[Option<V>]) -> Result<Vec<(i64, i64)>> {
    common::slice_steps(shape, |i| read_opt(c, args, i))
}

pub fn slice(c: &Cuda, x: &V, ins: &[Option<V>], y: &V) -> Result<()> {
    let sel = slice_steps(c, x.shape(), ins.get(1..).unwrap_or_default())?;
    let (st, base) = slice_view(x.shape(), y.shape(), &sel);
    gather_copy(c, x, y, &st, base)
}

/// dX: zeros with dY written into the sliced positions.
pub fn slice_grad(c: &Cuda, dy: &V, ins: &[Option<V>], dx: &V) -> Result<()> {
    c.memset0(dx)?;
    let sel = slice_steps(c, dx.shape(), ins.get(2..).unwrap_or_default())?;
    let (st, base) = slice_view(dx.shape(), dy.shape(), &sel);
    strided_copy(c, dy, dx, dy.shape(), &strides(dy.shape()), 0, &st, base)
}

/// The indices, range-checked as the CPU does and made non-negative, and the axis.
fn indices(
    c: &Cuda,
    node: &Node,
    shape: &[usize],
    idx: &V,
    axis: i64,
) -> Result<(usize, Vec<i64>)> {
    let r = shape.len();
    let a = common::axis_index(axis, r)?;
    let ids = c
        .read(idx)?
        .to_i64_vec()
        .into_iter()
        .map(|i| common::index_in(node, i, shape[a], a))
        .collect::<Result<Vec<i64>>>()?;
    Ok((a, ids))
}

pub fn gather(c: &Cuda, node: &Node, x: &V, idx: &V, axis: i64, y: &V) -> Result<()> {
    let (a, ids) = indices(c, node, x.shape(), idx, axis)?;
    let dev_ids = c.upload_vec(&ids)?;
    let inner = numel(&x.shape()[a + 1..]);
    let n = y.numel();
    let args = [
        Arg::Ptr(x.p),
        Arg::Ptr(c.addr(&dev_ids)),
        Arg::Ptr(y.p),
        Arg::I64(ids.len() as i64),
        Arg::I64(x.shape()[a] as i64),
        Arg::I64(inner.max(1) as i64),
        Arg::I64(n as i64),
    ];
    c.launch_n(&format!("gather_{}", word(x.dtype())), n, &args)
}

/// Scatter-add of dY rows into zeros, deterministic: the host sorts the readers of each
/// row once, and each output element sums its readers in that order.
pub fn gather_grad(c: &Cuda, node: &Node, dy: &V, idx: &V, axis: i64, out: &V) -> Result<()> {
    if !out.dtype().is_float() {
        return Err(unsupported(node, out.dtype()));
    }
    let (a, ids) = indices(c, node, out.shape(), idx, axis)?;
    scatter_add(
        c,
        dy,
        &ids,
        out.shape()[a],
        numel(&out.shape()[a + 1..]),
        out,
    )
}

/// GatherElements and GatherND: a flat gather at `common::take_offsets`.
pub fn take(c: &Cuda, node: &Node, x: &V, idx: &V, y: &V) -> Result<()> {
    let offs = common::take_offsets(node, x.shape(), idx.shape(), &c.read(idx)?.to_i64_vec())?;
    let dev = c.upload_vec(&offs)?;
    let n = y.numel();
    let args = [
        Arg::Ptr(x.p),
        Arg::Ptr(c.addr(&dev)),
        Arg::Ptr(y.p),
        Arg::I64(offs.len() as i64),
        Arg::I64(x.numel() as i64),
        Arg::I64(1),
        Arg::I64(n as i64),
    ];
    c.launch_n(&format!("gather_{}", word(x.dtype())), n, &args)
}

/// Their gradients: dY added at the same offsets, as Gather's gradient.
pub fn take_grad(c: &Cuda, node: &Node, dy: &V, idx: &V, out: &V) -> Result<()> {
    if !out.dtype().is_float() {
        return Err(unsupported(node, out.dtype()));
    }
    let ids = common::take_offsets(node, out.shape(), idx.shape(), &c.read(idx)?.to_i64_vec())?;
    scatter_add(c, dy, &ids, out.numel(), 1, out)
}

/// Pad: a gather at `common::pad_plan`'s offsets, the constant (default 0) at -1.
pub fn pad(c: &Cuda, node: &Node, x: &V, ins: &[Option<V>], y: &V) -> Result<()> {
    let offs = common::pad_plan(node, x.shape(), |i| read_opt(c, ins, i))?;
    let dev = c.upload_vec(&offs)?;
    let zero;
    let cst = match ins.get(2).copied().flatten() {
        Some(v) => v.p,
        None => {
            // Eight zero bytes: a 0 of every dtype.
            zero = c.zeros::<u64>(1)?;
            c.addr(&zero)
        }
    };
    let n = y.numel();
    let args = [
        Arg::Ptr(x.p),
        Arg::Ptr(c.addr(&dev)),
        Arg::Ptr(cst),
        Arg::Ptr(y.p),
        Arg::I64(n as i64),
    ];
    c.launch_n(&format!("pad_{}", word(x.dtype())), n, &args)
}

/// PadGrad: dY added at Pad's offsets (the constant's positions dropped), in a fixed order.
pub fn pad_grad(c: &Cuda, node: &Node, dy: &V, ins: &[Option<V>], out: &V) -> Result<()> {
    if !out.dtype().is_float() {
        return Err(unsupported(node, out.dtype()));
    }
    let offs = common::pad_plan(node, out.shape(), |i| read_opt(c, ins, i))?;
    scatter_add(c, dy, &offs, out.numel(), 1, out)
}

/// ScatterElements and ScatterND: one thread per output element folds the updates that
/// land on it (`common::scatter_plan`), so the result is deterministic.
pub fn scatter(
    c: &Cuda,
    node: &Node,
    [data, idx, upd]: [&V; 3],
    reduction: ScatterReduction,
    out: &V,
) -> Result<()> {
    let dt = data.dtype();
    if dt == DType::Bool && reduction != ScatterReduction::None {
        return Err(unsupported(node, dt));
    }
    let plan = common::scatter_plan(node, data.shape(), idx.shape(), &c.read(idx)?.to_i64_vec())?;
    let aux = c.upload_vec(&plan.aux)?;
    let n = out.numel();
    let args = [
        Arg::Ptr(data.p),
        Arg::Ptr(upd.p),
        Arg::Ptr(c.addr(&aux)),
        Arg::Ptr(out.p),
        Arg::I64(plan.starts_at as i64),
        Arg::I64(plan.order_at as i64),
        Arg::I32(reduction.code()),
        Arg::I64(n as i64),
    ];
    c.launch_n(&format!("scatter_{}", suffix(dt)), n, &args)
}

/// Input `i` read back as integers, `None` when omitted.
fn read_opt(c: &Cuda, ins: &[Option<V>], i: usize) -> Result<Option<Vec<i64>>> {
    match ins.get(i).copied().flatten() {
        Some(v) => Ok(Some(c.read(&v)?.to_i64_vec())),
        None => Ok(None),
    }
}

/// `out` (rows of `inner` elements, `d` of them) = the dY rows whose index `ids` names
/// each row, summed in a fixed order; rows with a negative index reach none.
fn scatter_add(c: &Cuda, dy: &V, ids: &[i64], d: usize, inner: usize, out: &V) -> Result<()> {
    let mut order: Vec<i64> = (0..ids.len() as i64)
        .filter(|&q| ids[q as usize] >= 0)
        .collect();
    order.sort_by_key(|&q| ids[q as usize]);
    let mut starts = vec![0i64; d + 1];
    for &i in ids.iter().filter(|&&i| i >= 0) {
        starts[i as usize + 1] += 1;
    }
    for j in 0..d {
        starts[j + 1] += starts[j];
    }
    let (order, starts) = (c.upload_vec(&order)?, c.upload_vec(&starts)?);
    let n = out.numel();
    let args = [
        Arg::Ptr(dy.p),
        Arg::Ptr(c.addr(&order)),
        Arg::Ptr(c.addr(&starts)),
        Arg::Ptr(out.p),
        Arg::I64(ids.len() as i64),
        Arg::I64(d as i64),
        Arg::I64(inner.max(1) as i64),
        Arg::I64(n as i64),
    ];
    c.launch_n(&format!("gather_grad_{}", suffix(out.dtype())), n, &args)
}

/// cuda/shape.cu `WinGeom` (`common::WindowGeom::words`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct WinGeom([i64; 27]);

// Safety: a plain array of i64, laid out as the C struct of 27 i64s.
unsafe impl cudarc::driver::DeviceRepr for WinGeom {}

fn win_geom(g: &common::WindowGeom) -> WinGeom {
    let mut a = [0i64; 27];
    a.copy_from_slice(&g.words());
    WinGeom(a)
}

/// Im2Col: one thread per column entry.
pub fn im2col(c: &Cuda, node: &Node, x: &V, ins: &[Option<V>], y: &V) -> Result<()> {
    let g = common::window_geom(node, x.shape(), |i| read_opt(c, ins, i))?;
    im2col_geom(c, &g, x.dtype(), x.p, y.p, y.numel())
}

/// The `n` column entries at `y` of the image at `x` under the window `g`.
pub(super) fn im2col_geom(
    c: &Cuda,
    g: &common::WindowGeom,
    dt: DType,
    x: u64,
    y: u64,
    n: usize,
) -> Result<()> {
    let [pad_value, beyond_value] = g.fill;
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(y),
        Arg::U64(common::fill_bits(dt, pad_value)),
        Arg::U64(common::fill_bits(dt, beyond_value)),
        Arg::Window(win_geom(g)),
        Arg::I64(n as i64),
    ];
    c.launch_n(&format!("im2col_{}", word(dt)), n, &args)
}

/// Col2Im: one thread per image element sums what reads it.
pub fn col2im(c: &Cuda, node: &Node, cols: &V, ins: &[Option<V>], y: &V) -> Result<()> {
    if !y.dtype().is_float() {
        return Err(unsupported(node, y.dtype()));
    }
    let g = common::window_geom(node, y.shape(), |i| read_opt(c, ins, i))?;
    col2im_geom(c, &g, y.dtype(), cols.p, y.p, y.numel())
}

/// The `n` image elements at `y` summed from the columns at `cols` of window `g`.
pub(super) fn col2im_geom(
    c: &Cuda,
    g: &common::WindowGeom,
    dt: DType,
    cols: u64,
    y: u64,
    n: usize,
) -> Result<()> {
    let args = [
        Arg::Ptr(cols),
        Arg::Ptr(y),
        Arg::Window(win_geom(g)),
        Arg::I64(n as i64),
    ];
    c.launch_n(&format!("col2im_{}", suffix(dt)), n, &args)
}

/// MaxPool: one thread per output (a floating X; every window offset fits 32 bits).
pub fn max_pool(c: &Cuda, node: &Node, x: &V, y: &V) -> Result<()> {
    let (_, win) = pool_geom(node, x)?;
    let args = [
        Arg::Ptr(x.p),
        Arg::Ptr(y.p),
        Arg::Ptr(0),
        Arg::Window(win),
        Arg::I64(y.numel() as i64),
    ];
    c.launch_n(&format!("max_pool_{}", suffix(x.dtype())), y.numel(), &args)
}

/// Image elements along the last axis a thread of `max_pool_grad` takes (cuda/shape.cu
/// `POOL_RUN`).
const POOL_RUN: usize = 4;

/// MaxPoolGrad: each window's argmax into scratch (a thread per window), then a thread per
/// run of image elements sums the dY of the windows whose argmax each is.
pub fn max_pool_grad(c: &Cuda, node: &Node, dy: &V, x: &V, dx: &V) -> Result<()> {
    let (g, win) = pool_geom(node, x)?;
    let (n, dt) = (dy.numel(), x.dtype());
    let at = c.scratch(n.max(1) * 4)?;
    let args = [
        Arg::Ptr(x.p),
        Arg::Ptr(0),
        Arg::Ptr(at),
        Arg::Window(win),
        Arg::I64(n as i64),
    ];
    c.launch_n(&format!("max_pool_{}", suffix(dt)), n, &args)?;
    // Runs along the last axis: the image's last spatial axis, or channels-last the
    // channels.
    let runs = match win.0[26] {
        0 => g.n * g.c * (g.hw() / g.image[2].max(1)) * g.image[2].div_ceil(POOL_RUN),
        _ => g.n * g.hw() * g.c.div_ceil(POOL_RUN),
    };
    let args = [
        Arg::Ptr(dy.p),
        Arg::Ptr(at),
        Arg::Ptr(dx.p),
        Arg::Window(win),
        Arg::I64(runs as i64),
    ];
    c.launch_n(&format!("max_pool_grad_{}", suffix(dt)), runs, &args)
}

/// The pool's window over X, for a floating X whose planes fit 32-bit offsets, and its
/// words for the kernels (the spare word the channel count where X is channels-last).
fn pool_geom(node: &Node, x: &V) -> Result<(common::WindowGeom, WinGeom)> {
    if !x.dtype().is_float() {
        return Err(unsupported(node, x.dtype()));
    }
    let g = common::window_geom(node, x.shape(), |_| Ok(None))?;
    if g.hw() > i32::MAX as usize {
        crate::bail!(
            Runtime,
            "{}: an image plane of {} elements is past the CUDA pool's 32-bit offsets",
            node.describe(),
            g.hw()
        );
    }
    let mut win = win_geom(&g);
    if let Op::MaxPool { window, .. } | Op::MaxPoolGrad { window, .. } = &node.op {
        if window.channels_last {
            win.0[26] = g.c as i64;
        }
    }
    Ok((g, win))
}
