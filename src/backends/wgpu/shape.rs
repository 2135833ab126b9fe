//! Shape and copy family on wgpu (shaders/shape.wgsl): every op that moves elements,
//! for any dtype (elements are raw words of 1, 2, 4 or 8 bytes), Cast, GatherGrad, Pad
//! and its gradient, and the Scatter ops.

use super::device::{groups_for, Family, Kernel};
use super::{bcast_strides, float_defs, strides, unsupported, Params, Strided, Wgpu, V};
use crate::backends::common;
use crate::error::Result;
use crate::graph::infer::ValueType;
use crate::graph::{Node, ScatterReduction};
use crate::tensor::{numel, DType};

/// The dtype code of shaders/shape.wgsl `cast_elem`. WGSL has no f64 or bf16: they are
/// cast by their bits, to and from the other floats only (`cast`).
fn code(dt: DType) -> u32 {
    match dt {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::I32 => 2,
        DType::I64 => 3,
        DType::Bool => 4,
        DType::U8 => 5,
        DType::I8 => 6,
        DType::U16 => 7,
        DType::I16 => 8,
        DType::U32 => 9,
        DType::U64 => 10,
        DType::F64 => 11,
        DType::BF16 => 12,
        DType::F8E4M3FN => 13,
        DType::F8E4M3FNUZ => 14,
        DType::F8E5M2 => 15,
        DType::F8E5M2FNUZ => 16,
        DType::F4E2M1 => 17,
        DType::I4 => 18,
        DType::U4 => 19,
        DType::I2 => 20,
        DType::U2 => 21,
        DType::F8E8M0 => 22,
    }
}

fn kernel(entry: &str, es: usize, src: u32, dst: u32) -> Kernel<'_> {
    Wgpu::kernel(
        Family::Shape,
        entry,
        format!("const ES: u32 = {es}u;\nconst SRC: u32 = {src}u;\nconst DST: u32 = {dst}u;\n"),
    )
}

/// Output words of `n` elements of `es` bytes.
fn words(n: usize, es: usize) -> usize {
    (n * es).div_ceil(4)
}

/// One `copy` dispatch in `mode` over `y` (params past the mode given in `p`).
fn copy_kernel(
    w: &mut Wgpu,
    mode: usize,
    p: Params,
    bufs: [&wgpu::Buffer; 4],
    y: &V,
) -> Result<()> {
    let es = y.dtype().size();
    let n = y.numel();
    let nw = words(n, es);
    let mut p = p.u(0, nw).u(1, n).u(2, mode);
    // SliceGrad's per-dim table ends at word 84.
    p.0.resize(p.0.len().max(88), 0);
    let [x, y_, aux, x2] = bufs;
    w.run_kernel(
        &kernel("copy", es, 0, 0),
        &p,
        &[(1, x), (2, y_), (3, aux), (4, x2)],
        groups_for(nw, 256),
    )
}

/// `y` as a strided view of `x` (Transpose, Expand, Slice, Split).
pub(super) fn view(w: &mut Wgpu, x: &V, y: &V, st: &[i64], base: i64) -> Result<()> {
    let mut s = Strided::new(y.shape(), &[st]);
    s.base[0] = base;
    let p = Params::new().strided(16, &s)?;
    let d = w.scratch(16);
    copy_kernel(w, 0, p, [x.buf, y.buf, &d, &d], y)
}

pub fn transpose(w: &mut Wgpu, x: &V, perm: Option<&[usize]>, y: &V) -> Result<()> {
    let r = x.shape().len();
    let rev: Vec<usize> = (0..r).rev().collect();
    let perm = perm.unwrap_or(&rev);
    let xs = strides(x.shape());
    let st: Vec<i64> = perm.iter().map(|&p| xs[p]).collect();
    view(w, x, y, &st, 0)
}

pub fn expand(w: &mut Wgpu, x: &V, y: &V) -> Result<()> {
    view(w, x, y, &bcast_strides(x.shape(), y.shape()), 0)
}

pub fn concat(w: &mut Wgpu, ins: &[Option<V>], axis: i64, y: &V) -> Result<()> {
    let r = y.shape().len();
    let a = common::axis_index(axis, r)?;
    let inner = numel(&y.shape()[a + 1..]);
    let dim = y.shape()[a];
    let mut at = 0usize;
    for x in ins.iter().flatten() {
        let len = x.shape()[a];
        if len > 0 && x.numel() > 0 {
            let mut s = Strided::new(y.shape(), &[&strides(x.shape())]);
            s.base[0] = -(at as i64) * strides(x.shape())[a];
            let p = Params::new()
                .u(3, inner)
                .u(4, dim)
                .u(5, at)
                .u(6, at + len)
                .strided(16, &s)?;
            let d = w.scratch(16);
            copy_kernel(w, 1, p, [x.buf, y.buf, &d, &d], y)?;
        }
        at += len;
    }
    Ok(())
}

pub fn split(w: &mut Wgpu, x: &V, axis: i64, outs: &[V]) -> Result<()> {
    let r = x.shape().len();
    let a = common::axis_index(axis, r)?;
    let xs = strides(x.shape());
    let mut at = 0i64;
    for y in outs {
        if y.numel() > 0 {
            view(w, x, y, &xs, at * xs[a])?;
        }
        at += y.shape()[a] as i64;
    }
    Ok(())
}

/// Slice's (start, step) per dim, its starts/ends/axes/steps inputs read back (they
/// decide offsets).
fn slice_steps(w: &mut Wgpu, shape: &[usize], args: &[Option<V>]) -> Result<Vec<(i64, i64)>> {
    common::slice_steps(shape, |i| match args.get(i).copied().flatten() {
        Some(v) => Ok(Some(w.read(&v)?.to_i64_vec())),
        None => Ok(None),
    })
}

pub fn slice(w: &mut Wgpu, x: &V, ins: &[Option<V>], y: &V) -> Result<()> {
    let sel = slice_steps(w, x.shape(), ins.get(1..).unwrap_or_default())?;
    let xs = strides(x.shape());
    let st: Vec<i64> = xs.iter().zip(&sel).map(|(s, (_, k))| s * k).collect();
    let base: i64 = (0..xs.len())
        .filter(|&a| y.shape()[a] > 0)
        .map(|a| xs[a] * sel[a].0)
        .sum();
    view(w, x, y, &st, base)
}

/// dY placed into zeros at the slice's positions (`ins[1]` is the input's shape).
pub fn slice_grad(w: &mut Wgpu, dy: &V, ins: &[Option<V>], dx: &V) -> Result<()> {
    // Inputs after dY and XShape are the forward's starts, ends, axes, steps.
    let sel = slice_steps(w, dx.shape(), ins.get(2..).unwrap_or_default())?;
    let r = dx.shape().len();
    if r > 8 {
        crate::bail!(Runtime, "the wgpu backend slices at most 8 dims, got {r}");
    }
    // No dims are dropped here: the descriptor is read per dim by the shader.
    let mut p = Params::new();
    p = p.u(16, r);
    let ds = strides(dy.shape());
    for d in 0..r {
        p = p
            .u(17 + d, dx.shape()[d])
            .i(25 + d, ds[d])
            .i(60 + d, sel[d].0)
            .i(68 + d, sel[d].1)
            .i(76 + d, dy.shape()[d] as i64);
    }
    let dm = w.scratch(16);
    copy_kernel(w, 5, p, [dy.buf, dx.buf, &dm, &dm], dx)
}

pub fn trilu(w: &mut Wgpu, x: &V, k: Option<V>, upper: bool, y: &V) -> Result<()> {
    let r = x.shape().len();
    let (rows, cols) = (x.shape()[r - 2], x.shape()[r - 1]);
    let k = match k {
        Some(k) => w.read(&k)?.to_i64_vec().first().copied().unwrap_or(0),
        None => 0,
    };
    let p = Params::new()
        .u(3, rows.max(1))
        .u(4, cols.max(1))
        .i(5, k)
        .u(6, upper as usize);
    let d = w.scratch(16);
    copy_kernel(w, 2, p, [x.buf, y.buf, &d, &d], y)
}

pub fn where_(w: &mut Wgpu, cond: &V, a: &V, b: &V, y: &V) -> Result<()> {
    let s = Strided::broadcast(y.shape(), &[cond.shape(), a.shape(), b.shape()]);
    let p = Params::new().strided(16, &s)?;
    copy_kernel(w, 3, p, [a.buf, y.buf, cond.buf, b.buf], y)
}

/// Words per index element (i64 indices are read by their low word).
fn index_words(node: &Node, idx: &V) -> Result<usize> {
    match idx.dtype() {
        DType::I64 => Ok(2),
        DType::I32 => Ok(1),
        dt => Err(unsupported(node, dt)),
    }
}

pub fn gather(w: &mut Wgpu, node: &Node, x: &V, idx: &V, axis: i64, y: &V) -> Result<()> {
    let r = x.shape().len();
    let a = common::axis_index(axis, r)?;
    let p = Params::new()
        .u(3, numel(&x.shape()[a + 1..]))
        .u(4, idx.numel().max(1))
        .u(5, x.shape()[a])
        .u(6, index_words(node, idx)?);
    let d = w.scratch(16);
    copy_kernel(w, 4, p, [x.buf, y.buf, idx.buf, &d], y)
}

/// GatherElements and GatherND: a flat gather at `common::take_offsets` (uploaded as i64
/// indices into flat views of data and output).
pub fn take(w: &mut Wgpu, node: &Node, x: &V, idx: &V, y: &V) -> Result<()> {
    let offs = common::take_offsets(node, x.shape(), idx.shape(), &w.read(idx)?.to_i64_vec())?;
    let (ids_buf, ids_ty) = upload_i64(w, &offs)?;
    let (xt, yt) = (flat(x), flat(y));
    let ids = V {
        buf: &ids_buf,
        ty: &ids_ty,
    };
    gather(
        w,
        node,
        &V {
            buf: x.buf,
            ty: &xt,
        },
        &ids,
        0,
        &V {
            buf: y.buf,
            ty: &yt,
        },
    )
}

/// Their gradients: dY added at the same offsets, as Gather's gradient.
pub fn take_grad(w: &mut Wgpu, node: &Node, dy: &V, idx: &V, out: &V) -> Result<()> {
    let offs = common::take_offsets(node, out.shape(), idx.shape(), &w.read(idx)?.to_i64_vec())?;
    flat_gather_grad(w, node, dy, &offs, out)
}

/// dY's elements added into `out` (both seen flat) at `offs`; out-of-range offsets reach
/// nothing.
fn flat_gather_grad(w: &mut Wgpu, node: &Node, dy: &V, offs: &[i64], out: &V) -> Result<()> {
    let (ids_buf, ids_ty) = upload_i64(w, offs)?;
    let (dt, ot) = (flat(dy), flat(out));
    let ids = V {
        buf: &ids_buf,
        ty: &ids_ty,
    };
    gather_grad(
        w,
        node,
        &V {
            buf: dy.buf,
            ty: &dt,
        },
        &ids,
        0,
        &V {
            buf: out.buf,
            ty: &ot,
        },
    )
}

/// Pad: a gather at `common::pad_plan`'s offsets (copy mode 6), the constant (default 0)
/// where an offset is -1.
pub fn pad(w: &mut Wgpu, node: &Node, x: &V, ins: &[Option<V>], y: &V) -> Result<()> {
    let offs = common::pad_plan(node, x.shape(), |i| read_opt(w, ins, i))?;
    let (offs, _) = upload_i64(w, &offs)?;
    let zero;
    let c = match ins.get(2).copied().flatten() {
        Some(v) => v.buf,
        None => {
            zero = w.scratch(16);
            w.rec.clear(&zero, 16);
            &zero
        }
    };
    copy_kernel(w, 6, Params::new(), [x.buf, y.buf, &offs, c], y)
}

/// PadGrad: dY added at Pad's offsets; the constant's positions (-1) become an offset
/// past the end, which the kernel skips.
pub fn pad_grad(w: &mut Wgpu, node: &Node, dy: &V, ins: &[Option<V>], out: &V) -> Result<()> {
    let mut offs = common::pad_plan(node, out.shape(), |i| read_opt(w, ins, i))?;
    let past = out.numel() as i64;
    offs.iter_mut().filter(|o| **o < 0).for_each(|o| *o = past);
    flat_gather_grad(w, node, dy, &offs, out)
}

/// ScatterElements and ScatterND (shaders/shape.wgsl `scatter`): one thread per output
/// word folds the updates that land on its elements, so the result is deterministic.
pub fn scatter(
    w: &mut Wgpu,
    node: &Node,
    [data, idx, upd]: [&V; 3],
    reduction: ScatterReduction,
    out: &V,
) -> Result<()> {
    let dt = data.dtype();
    let code = match dt {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::I32 => 2,
        DType::Bool if reduction == ScatterReduction::None => 3,
        _ => return Err(unsupported(node, dt)),
    };
    let plan = common::scatter_plan(node, data.shape(), idx.shape(), &w.read(idx)?.to_i64_vec())?;
    let aux = w.scratch((plan.aux.len() * 4).max(16));
    w.rec.write(&aux, bytemuck::cast_slice(&plan.aux))?;
    let (es, n) = (dt.size(), out.numel());
    let nw = words(n, es);
    let p = Params::new()
        .u(0, nw)
        .u(1, n)
        .u(2, reduction.code() as usize)
        .u(3, code)
        .u(4, plan.starts_at)
        .u(5, plan.order_at);
    w.run_kernel(
        &kernel("scatter", es, 0, 0),
        &p,
        &[(1, data.buf), (2, out.buf), (3, &aux), (4, upd.buf)],
        groups_for(nw, 256),
    )
}

/// Input `i` read back as integers, `None` when omitted.
fn read_opt(w: &mut Wgpu, ins: &[Option<V>], i: usize) -> Result<Option<Vec<i64>>> {
    match ins.get(i).copied().flatten() {
        Some(v) => Ok(Some(w.read(&v)?.to_i64_vec())),
        None => Ok(None),
    }
}

/// `v`'s type as one flat axis.
fn flat(v: &V) -> ValueType {
    ValueType::new(v.dtype(), &[v.numel()])
}

/// A scratch buffer holding `v`.
fn upload_i64(w: &mut Wgpu, v: &[i64]) -> Result<(wgpu::Buffer, ValueType)> {
    let ty = ValueType::new(DType::I64, &[v.len()]);
    let buf = w.scratch(ty.bytes().max(8));
    w.rec.write(&buf, bytemuck::cast_slice(v))?;
    Ok((buf, ty))
}

/// `(dY, Indices, DataShape) → dData`: dY rows added at their index, in an f32
/// accumulator (the output itself for f32, else cast afterwards).
pub fn gather_grad(w: &mut Wgpu, node: &Node, dy: &V, idx: &V, axis: i64, out: &V) -> Result<()> {
    let dt = out.dtype();
    float_defs(w, node, dt)?;
    let r = out.shape().len();
    let a = common::axis_index(axis, r)?;
    let acc_ty = ValueType::new(DType::F32, out.shape());
    let scratch;
    let acc = if dt == DType::F32 {
        out.buf
    } else {
        scratch = w.scratch(acc_ty.bytes());
        &scratch
    };
    w.rec.clear(acc, acc_ty.bytes());
    let n = dy.numel();
    let p = Params::new()
        .u(1, n)
        .u(3, numel(&out.shape()[a + 1..]))
        .u(4, idx.numel().max(1))
        .u(5, out.shape()[a])
        .u(6, index_words(node, idx)?);
    // The shader reads dY as f32 or f16 (code 0 or 1).
    let src = match dy.dtype() {
        DType::F32 => 0,
        DType::F16 => 1,
        dt => return Err(unsupported(node, dt)),
    };
    w.run_kernel(
        &kernel("gather_grad", 4, src, 0),
        &p,
        &[(1, dy.buf), (3, idx.buf), (5, acc)],
        groups_for(n, 256),
    )?;
    if dt != DType::F32 {
        cast(
            w,
            node,
            &V {
                buf: acc,
                ty: &acc_ty,
            },
            out,
        )?;
    }
    Ok(())
}

pub fn cast(w: &mut Wgpu, node: &Node, x: &V, y: &V) -> Result<()> {
    if x.dtype() == y.dtype() {
        w.rec.copy(x.buf, y.buf, y.ty.bytes());
        return Ok(());
    }
    // f64 and bf16 convert through f32 in the shader: between floats only, where that
    // rounds once (f64 to f16 twice, within f16's tolerance; f64 to a narrow type would
    // round twice, so it is refused).
    let bits_only = |d: DType| matches!(d, DType::F64 | DType::BF16);
    for (d, other) in [(x.dtype(), y.dtype()), (y.dtype(), x.dtype())] {
        if bits_only(d) && !other.is_float() {
            return Err(unsupported(node, d));
        }
    }
    if x.dtype() == DType::F64 && y.dtype().narrow_bits().is_some() {
        return Err(unsupported(node, x.dtype()));
    }
    let (src, dst) = (code(x.dtype()), code(y.dtype()));
    let es = y.dtype().size();
    let n = y.numel();
    let nw = words(n, es);
    let p = Params::new().u(0, nw).u(1, n);
    w.run_kernel(
        &kernel("convert", es, src, dst),
        &p,
        &[(1, x.buf), (2, y.buf)],
        groups_for(nw, 256),
    )
}

/// The window's 27 integers at `Params` 3.. (shaders/shape.wgsl Im2Col and `col2im`).
fn window_params(node: &Node, g: &common::WindowGeom) -> Result<Params> {
    let mut p = Params::new();
    for (k, v) in g.words().into_iter().enumerate() {
        if v > i32::MAX as i64 {
            return Err(crate::err!(
                Runtime,
                "{}: a window dim of {v} is past WebGPU's 32-bit indexing",
                node.describe()
            ));
        }
        p = p.i(3 + k, v);
    }
    Ok(p)
}

/// Im2Col (copy mode 7): the pad and beyond values are SX2's two elements.
pub fn im2col(w: &mut Wgpu, node: &Node, x: &V, ins: &[Option<V>], y: &V) -> Result<()> {
    let g = common::window_geom(node, x.shape(), |i| read_opt(w, ins, i))?;
    im2col_geom(w, node, &g, x, y)
}

/// The columns `y` of `x` under the window `g`.
pub(super) fn im2col_geom(
    w: &mut Wgpu,
    node: &Node,
    g: &common::WindowGeom,
    x: &V,
    y: &V,
) -> Result<()> {
    let dt = x.dtype();
    let es = dt.size();
    let mut fill = [0u8; 16];
    for (k, v) in g.fill.into_iter().enumerate() {
        let bits = common::fill_bits(dt, v).to_le_bytes();
        fill[k * es..(k + 1) * es].copy_from_slice(&bits[..es]);
    }
    let f = w.scratch(16);
    w.rec.write(&f, &fill)?;
    let p = window_params(node, g)?;
    let d = w.scratch(16);
    copy_kernel(w, 7, p, [x.buf, y.buf, &d, &f], y)
}

/// Col2Im (`col2im`): one thread per output word sums what reads its elements.
pub fn col2im(w: &mut Wgpu, node: &Node, cols: &V, ins: &[Option<V>], y: &V) -> Result<()> {
    let g = common::window_geom(node, y.shape(), |i| read_opt(w, ins, i))?;
    col2im_geom(w, node, &g, cols, y)
}

/// The image `y` that the columns `cols` of window `g` sum into.
pub(super) fn col2im_geom(
    w: &mut Wgpu,
    node: &Node,
    g: &common::WindowGeom,
    cols: &V,
    y: &V,
) -> Result<()> {
    let dt = y.dtype();
    float_defs(w, node, dt)?;
    let n = y.numel();
    // (`window_sum` in its Col2Im mode reads no argmax: AUX is bound to a stand-in.)
    let none = w.scratch(16);
    let bufs = [(1, cols.buf), (2, y.buf), (3, &none)];
    window_kernel(
        w,
        node,
        g,
        "window_sum",
        dt,
        (words(n, dt.size()), n, 0),
        &bufs,
    )
}

/// Runs the window kernel `entry` of shaders/shape.wgsl for floating `dt` on `bufs`, a
/// thread per output word: (words, elements) of its output and the kernel's mode (P[2]),
/// the window at P[3..30].
fn window_kernel(
    w: &mut Wgpu,
    node: &Node,
    g: &common::WindowGeom,
    entry: &str,
    dt: DType,
    (nw, n, mode): (usize, usize, usize),
    bufs: &[(u32, &wgpu::Buffer)],
) -> Result<()> {
    let mut p = window_params(node, g)?.u(0, nw).u(1, n).u(2, mode);
    p.0.resize(p.0.len().max(32), 0);
    let k = kernel(entry, dt.size(), code(dt), 0);
    w.run_kernel(&k, &p, bufs, groups_for(nw, 256))
}

/// MaxPool (`max_pool`): a thread per output word.
pub fn max_pool(w: &mut Wgpu, node: &Node, x: &V, y: &V) -> Result<()> {
    let (g, dt) = (pool_geom(w, node, x)?, x.dtype());
    let n = y.numel();
    let bufs = [(1, x.buf), (2, y.buf)];
    window_kernel(
        w,
        node,
        &g,
        "max_pool",
        dt,
        (words(n, dt.size()), n, 0),
        &bufs,
    )
}

/// MaxPoolGrad: each window's argmax into scratch (`max_pool_arg`, one i32 word each), then
/// a thread per dX word sums the dY of the windows whose argmax its elements are
/// (`window_sum`, mode 1).
pub fn max_pool_grad(w: &mut Wgpu, node: &Node, dy: &V, x: &V, dx: &V) -> Result<()> {
    let (g, dt) = (pool_geom(w, node, x)?, x.dtype());
    let n = dy.numel();
    let at = w.scratch(n.max(1) * 4);
    window_kernel(
        w,
        node,
        &g,
        "max_pool_arg",
        dt,
        (n, n, 0),
        &[(1, x.buf), (2, &at)],
    )?;
    let m = dx.numel();
    let bufs = [(1, dy.buf), (2, dx.buf), (3, &at)];
    window_kernel(
        w,
        node,
        &g,
        "window_sum",
        dt,
        (words(m, dt.size()), m, 1),
        &bufs,
    )
}

/// The pool's window over X, for an f32 or f16 X.
fn pool_geom(w: &Wgpu, node: &Node, x: &V) -> Result<common::WindowGeom> {
    float_defs(w, node, x.dtype())?;
    common::window_geom(node, x.shape(), |_| Ok(None))
}
