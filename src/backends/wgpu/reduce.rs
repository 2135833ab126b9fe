//! Row-wise family on wgpu (shaders/reduce.wgsl): reductions, ArgMax/ArgMin, TopK,
//! Softmax/LogSoftmax and their gradient, LayerNormalization forward/backward,
//! SoftmaxCrossEntropyLoss and its gradient. One workgroup per row; statistics (Mean,
//! InvStdDev) are f32.

use super::device::{groups_for, Family, Kernel};
use super::{bcast_strides, float_defs, strides, unsupported, Params, Strided, Wgpu, V};
use crate::backends::common::{line_dims, node_axis, wanted};
use crate::error::Result;
use crate::graph::infer::ValueType;
use crate::graph::op::LossReduction;
use crate::graph::{Node, ReduceKind};
use crate::tensor::{numel, DType};

/// A reduce-family kernel for `dt`; `iw` is the words per label (SCE). Its defs carry
/// the workgroup reductions, through subgroups where the device has them, so the two
/// variants are distinct kernels in the pipeline cache.
fn kernel<'a>(w: &Wgpu, node: &Node, entry: &'a str, dt: DType, iw: usize) -> Result<Kernel<'a>> {
    Ok(kernel_with(w, entry, float_defs(w, node, dt)?, iw))
}

/// `kernel` with the type defs given: the selections (ArgMax, TopK), which compare and
/// move elements without arithmetic, also take i32.
fn kernel_with<'a>(w: &Wgpu, entry: &'a str, types: String, iw: usize) -> Kernel<'a> {
    let rows = if w.rec.gpu.use_subgroups() {
        include_str!("../../../shaders/rows_subgroup.wgsl")
    } else {
        include_str!("../../../shaders/rows_tree.wgsl")
    };
    let defs = format!("{types}const IW: u32 = {iw}u;\n{rows}");
    Wgpu::kernel(Family::Reduce, entry, defs)
}

/// A kernel that takes i32 as well as the floats of `kernel`: the selections (ArgMax,
/// TopK) and the integer reductions.
fn select_kernel<'a>(w: &Wgpu, node: &Node, entry: &'a str, dt: DType) -> Result<Kernel<'a>> {
    let types = match dt {
        DType::I32 => "alias T = i32;\nalias A = f32;\n".into(),
        _ => float_defs(w, node, dt)?,
    };
    Ok(kernel_with(w, entry, types, 1))
}

/// ArgMax (ArgMin with `min`; `last`: select_last_index) into the i64 `y`, written as
/// (low, high) words: a thread per line along the axis.
pub fn arg_reduce(
    w: &mut Wgpu,
    node: &Node,
    x: &V,
    axis: i64,
    min: bool,
    last: bool,
    y: &V,
) -> Result<()> {
    let (outer, d, inner) = line_dims(node, x.shape(), axis)?;
    let lines = outer * inner;
    if d == 0 && lines > 0 {
        crate::bail!(Runtime, "{}: the axis is empty", node.describe());
    }
    let p = Params::new()
        .u(0, lines)
        .u(1, d)
        .u(2, inner.max(1))
        .u(3, min as usize | (last as usize) << 1);
    // Long lines: a workgroup each (a thread's loop ends early on lavapipe).
    if d > LONG_LINE {
        let k = select_kernel(w, node, "arg_reduce_wg", x.dtype())?;
        return w.run_kernel(&k, &p, &[(1, x.buf), (11, y.buf)], rows_groups(lines));
    }
    let k = select_kernel(w, node, "arg_reduce", x.dtype())?;
    w.run_kernel(&k, &p, &[(1, x.buf), (11, y.buf)], groups_for(lines, 256))
}

/// TopK: `outs` holds Values and, when the graph reads it, Indices (i64 words; else
/// scratch takes them); K is Values' size along the axis. A thread per line picks its K
/// one after the other.
pub fn topk(w: &mut Wgpu, node: &Node, x: &V, axis: i64, largest: bool, outs: &[V]) -> Result<()> {
    let (outer, d, inner) = line_dims(node, x.shape(), axis)?;
    let a = node_axis(node, axis, x.shape().len())?;
    let vals = &outs[0];
    let kk = vals.shape()[a];
    let scratch = w.scratch(vals.numel().max(1) * 8);
    let idx = outs.get(1).map_or(&scratch, |v| v.buf);
    let lines = if kk == 0 { 0 } else { outer * inner };
    let p = Params::new()
        .u(0, lines)
        .u(1, d)
        .u(2, inner.max(1))
        .u(3, kk)
        .u(4, largest as usize);
    if matches!(x.dtype(), DType::I64 | DType::U64) {
        // 64-bit integers as word pairs, with the elementwise family's 64-bit helpers.
        let p = p.u(5, (x.dtype() == DType::I64) as usize);
        let k = Wgpu::kernel(
            super::device::Family::Elementwise,
            "top_k64",
            "alias T = i32;\nalias A = i32;\n".into(),
        );
        return w.run_kernel(
            &k,
            &p,
            &[(7, x.buf), (4, vals.buf), (3, idx)],
            groups_for(lines, 256),
        );
    }
    let k = select_kernel(w, node, "top_k", x.dtype())?;
    w.run_kernel(
        &k,
        &p,
        &[(1, x.buf), (4, vals.buf), (11, idx)],
        rows_groups(lines),
    )
}

/// One workgroup per row.
fn rows_groups(rows: usize) -> [u32; 3] {
    groups_for(rows, 1)
}

pub fn reduce(
    w: &mut Wgpu,
    node: &Node,
    kind: ReduceKind,
    x: &V,
    axes: &[i64],
    y: &V,
) -> Result<()> {
    let r = x.shape().len();
    let mut red = vec![false; r];
    if axes.is_empty() {
        red = vec![true; r];
    }
    for &a in axes {
        red[node_axis(node, a, r)?] = true;
    }
    let xs = strides(x.shape());
    let pick = |want: bool| -> (Vec<usize>, Vec<i64>) {
        (0..r)
            .filter(|&d| red[d] == want)
            .map(|d| (x.shape()[d], xs[d]))
            .unzip()
    };
    let (kshape, kst) = pick(false);
    let (rshape, rst) = pick(true);
    let n_red = numel(&rshape);
    let outs = y.numel();
    let code = match kind {
        ReduceKind::Sum => 0,
        ReduceKind::Mean => 1,
        ReduceKind::Max => 2,
        ReduceKind::MeanSquare => 3,
        ReduceKind::Prod => 4,
    };
    // Few outputs of many elements each: split each output over `parts` workgroups
    // (shaders/reduce.wgsl `reduce_part`), at most 65535 workgroups in all.
    let parts = if outs < 512 {
        n_red.div_ceil(PART).min(1024).min(65535 / outs.max(1))
    } else {
        1
    };
    let p = Params::new()
        .u(0, n_red)
        .u(1, code)
        .u(2, parts)
        .u(3, outs)
        .strided(16, &Strided::new(&kshape, &[&kst]))?
        .strided(52, &Strided::new(&rshape, &[&rst]))?;
    // Exact in i32 (wrapping, as the CPU's): a workgroup per output, or a thread where
    // there are many outputs of a few elements each, as for floats.
    let short = n_red <= EACH && outs >= 256;
    if x.dtype() == DType::I32 && !short {
        let k = select_kernel(w, node, "reduce_int_wg", x.dtype())?;
        return w.run_kernel(&k, &p, &[(1, x.buf), (4, y.buf)], rows_groups(outs));
    }
    let each = match x.dtype() {
        DType::I32 => Some(select_kernel(w, node, "reduce_int", x.dtype())?),
        _ if short => Some(kernel(w, node, "reduce_each", x.dtype(), 1)?),
        _ => None,
    };
    if let Some(k) = each {
        return w.run_kernel(&k, &p, &[(1, x.buf), (4, y.buf)], groups_for(outs, 256));
    }
    if parts <= 1 {
        let k = kernel(w, node, "reduce", x.dtype(), 1)?;
        return w.run_kernel(&k, &p, &[(1, x.buf), (4, y.buf)], rows_groups(outs));
    }
    let partial = w.scratch(outs * parts * 4);
    let k = kernel(w, node, "reduce_part", x.dtype(), 1)?;
    w.run_kernel(
        &k,
        &p,
        &[(1, x.buf), (5, &partial)],
        rows_groups(outs * parts),
    )?;
    let k = kernel(w, node, "reduce_parts", x.dtype(), 1)?;
    w.run_kernel(&k, &p, &[(7, &partial), (4, y.buf)], rows_groups(outs))
}

/// Elements a line past which ArgMax/ArgMin (and classes past which softmax cross-entropy)
/// run a workgroup per line rather than a thread:
/// well under the 65535 iterations after which lavapipe ends a shader loop.
const LONG_LINE: usize = 4096;
/// Rows a dispatch of LayerNormalization's parameter gradient sums.
const ROW_STEP: usize = 16384;
/// Elements per output up to which a reduction of many outputs runs a thread per output.
const EACH: usize = 64;
/// Elements per workgroup above which a reduction with few outputs is split.
const PART: usize = 8192;
/// Rows per thread of `sum_rows` before it splits them into parts.
const SUM_PART: usize = 64;

/// Σ over `rows` rows of `n` columns of `g` into `out` (the bias gradient).
pub fn sum_rows(w: &mut Wgpu, node: &Node, g: &V, rows: usize, n: usize, out: &V) -> Result<()> {
    let parts = rows.div_ceil(SUM_PART).max(1);
    let p = Params::new().u(0, n).u(1, rows).u(2, SUM_PART).u(3, parts);
    let k = kernel(w, node, "sum_rows", g.dtype(), 1)?;
    // The kernel binds both destinations; one part writes only Y, several only S0.
    let partial = w.scratch(if parts == 1 { 16 } else { n * parts * 4 });
    w.run_kernel(
        &k,
        &p,
        &[(1, g.buf), (4, out.buf), (5, &partial)],
        groups_for(n * parts, 256),
    )?;
    if parts == 1 {
        return Ok(());
    }
    let k = kernel(w, node, "sum_parts", g.dtype(), 1)?;
    w.run_kernel(&k, &p, &[(7, &partial), (4, out.buf)], groups_for(n, 256))
}

/// (outer, n, inner) around axis `a`.
fn around(shape: &[usize], a: usize) -> (usize, usize, usize) {
    (numel(&shape[..a]), shape[a], numel(&shape[a + 1..]))
}

pub fn softmax(w: &mut Wgpu, node: &Node, x: &V, axis: i64, log: bool, y: &V) -> Result<()> {
    let a = node_axis(node, axis, x.shape().len())?;
    let (outer, n, inner) = around(x.shape(), a);
    let p = Params::new().u(0, n).u(1, inner.max(1)).u(2, log as usize);
    let k = kernel(w, node, "softmax", x.dtype(), 1)?;
    w.run_kernel(
        &k,
        &p,
        &[(1, x.buf), (4, y.buf)],
        rows_groups(outer * inner),
    )
}

pub fn softmax_grad(
    w: &mut Wgpu,
    node: &Node,
    dy: &V,
    y: &V,
    axis: i64,
    log: bool,
    dx: &V,
) -> Result<()> {
    let a = node_axis(node, axis, y.shape().len())?;
    let (outer, n, inner) = around(y.shape(), a);
    let p = Params::new().u(0, n).u(1, inner.max(1)).u(2, log as usize);
    let k = kernel(w, node, "softmax_grad", y.dtype(), 1)?;
    w.run_kernel(
        &k,
        &p,
        &[(1, dy.buf), (2, y.buf), (4, dx.buf)],
        rows_groups(outer * inner),
    )
}

/// `t` broadcast to the normalised shape `norm`: itself when it already has that many
/// elements, else a device copy expanded to it.
fn expanded(w: &mut Wgpu, t: &V, norm: &[usize]) -> Result<Option<wgpu::Buffer>> {
    if t.numel() == numel(norm) {
        return Ok(None);
    }
    let ty = ValueType::new(t.dtype(), norm);
    let buf = w.scratch(ty.bytes());
    let st = bcast_strides(t.shape(), norm);
    super::shape::view(w, t, &V { buf: &buf, ty: &ty }, &st, 0)?;
    Ok(Some(buf))
}

/// With a `residual` R the rows are S = X + R, written to the last of `outs`.
pub fn layer_norm(
    w: &mut Wgpu,
    node: &Node,
    [x, scale]: [&V; 2],
    bias: Option<V>,
    residual: Option<V>,
    (axis, eps, rms): (i64, f32, bool),
    outs: &[V],
) -> Result<()> {
    let a = node_axis(node, axis, x.shape().len())?;
    let norm = &x.shape()[a..];
    let (rows, n) = (numel(&x.shape()[..a]), numel(norm));
    if n == 0 {
        crate::bail!(
            Runtime,
            "{}: the normalized shape is empty",
            node.describe()
        );
    }
    let g = expanded(w, scale, norm)?;
    let b = match &bias {
        Some(b) => expanded(w, b, norm)?,
        None => None,
    };
    let gb = g.as_ref().unwrap_or(scale.buf);
    let dummy = w.scratch(16);
    let bb = b.as_ref().or(bias.map(|v| v.buf)).unwrap_or(&dummy);
    // Mean and InvStdDev always go somewhere: scratch when the graph does not read them.
    let (s0, s1) = (w.scratch(rows * 4), w.scratch(rows * 4));
    let (m, i) = crate::graph::op::norm_stat_outputs(rms);
    let mean = m.and_then(|m| outs.get(m)).map_or(&s0, |v| v.buf);
    let inv = outs.get(i).map_or(&s1, |v| v.buf);
    // The residual and the sum: unbound slots get buffers of their own (a buffer may not
    // be bound both read-only and writable).
    let k = crate::graph::op::norm_sum_output(rms);
    let unbound = match (&residual, outs.get(k)) {
        (Some(_), None) => x.ty.bytes(),
        _ => 16,
    };
    let (r0, s2) = (w.scratch(16), w.scratch(unbound.max(16)));
    let (r, sum) = match &residual {
        Some(r) => (r.buf, outs.get(k).map_or(&s2, |v| v.buf)),
        None => (&r0, &s2),
    };
    let p = Params::new().u(0, n).f(1, eps).u(
        2,
        bias.is_some() as usize | (rms as usize) << 1 | (residual.is_some() as usize) << 2,
    );
    let k = kernel(w, node, "layer_norm", x.dtype(), 1)?;
    w.run_kernel(
        &k,
        &p,
        &[
            (1, x.buf),
            (2, gb),
            (3, bb),
            (4, outs[0].buf),
            (5, mean),
            (6, inv),
            (10, sum),
            (12, r),
        ],
        rows_groups(rows),
    )
}

/// `[dY, X, Scale, Mean, InvStdDev]` → `[dX, dScale, dB]` (each only when wanted); no
/// Mean for RMSNormalization's gradient.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_grad(
    w: &mut Wgpu,
    node: &Node,
    [dy, x, scale]: [&V; 3],
    mean: Option<V>,
    inv: &V,
    res: Option<V>,
    axis: i64,
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    if inv.dtype() != DType::F32 || mean.as_ref().is_some_and(|m| m.dtype() != DType::F32) {
        return Err(unsupported(node, inv.dtype()));
    }
    let rms = mean.is_none();
    // The kernels bind a Mean; RMSNormalization's (not read) is InvStdDev's buffer.
    let mean_buf = mean.as_ref().map_or(inv.buf, |m| m.buf);
    let a = node_axis(node, axis, x.shape().len())?;
    let norm = &x.shape()[a..];
    let (rows, n) = (numel(&x.shape()[..a]), numel(norm));
    let out = |i: usize| wanted(outs, want, i);
    if n == 0 || rows == 0 {
        for o in outs.iter().skip(1) {
            w.rec.clear(o.buf, o.ty.bytes());
        }
        return Ok(());
    }
    if let Some(dx) = out(0) {
        let g = expanded(w, scale, norm)?;
        let gb = g.as_ref().unwrap_or(scale.buf);
        // P[1] = 1: the residual gradient (bound as Y2, only read) is added onto dX.
        let p = Params::new()
            .u(0, n)
            .u(1, res.is_some() as usize | (rms as usize) << 1);
        let k = kernel(w, node, "layer_norm_dx", x.dtype(), 1)?;
        let mut binds = vec![
            (1, dy.buf),
            (2, x.buf),
            (3, gb),
            (7, mean_buf),
            (8, inv.buf),
            (4, dx.buf),
        ];
        // The pipeline's layout has Y2 (the shader reads it): a placeholder without one.
        let none = w.scratch(16);
        binds.push((10, res.as_ref().map_or(&none, |r| r.buf)));
        w.run_kernel(&k, &p, &binds, rows_groups(rows))?;
    }
    if out(1).is_some() || out(2).is_some() {
        let bytes = n * x.dtype().size();
        let (s0, s1) = (w.scratch(bytes), w.scratch(bytes));
        let ds = out(1).map_or(&s0, |v| v.buf);
        let db = out(2).map_or(&s1, |v| v.buf);
        let k = kernel(w, node, "layer_norm_dparams", x.dtype(), 1)?;
        // Rows in chunks, each dispatch adding onto the last (lavapipe ends a shader loop
        // after 65535 iterations).
        for r0 in (0..rows.max(1)).step_by(ROW_STEP) {
            let p = Params::new()
                .u(0, n)
                .u(1, (r0 + ROW_STEP).min(rows))
                .u(2, rms as usize)
                .u(3, r0);
            w.run_kernel(
                &k,
                &p,
                &[
                    (1, dy.buf),
                    (2, x.buf),
                    (7, mean_buf),
                    (8, inv.buf),
                    (4, ds),
                    (10, db),
                ],
                groups_for(n, 256),
            )?;
        }
    }
    Ok(())
}

fn label_words(node: &Node, l: &V) -> Result<usize> {
    match l.dtype() {
        DType::I64 => Ok(2),
        DType::I32 => Ok(1),
        dt => Err(unsupported(node, dt)),
    }
}

fn reduction_code(r: LossReduction) -> usize {
    match r {
        LossReduction::None => 0,
        LossReduction::Sum => 1,
        LossReduction::Mean => 2,
    }
}

/// Per-element weighted losses and weights (f32 scratch), and log_prob when asked.
#[allow(clippy::too_many_arguments)]
fn sce_rows(
    w: &mut Wgpu,
    node: &Node,
    x: &V,
    labels: &V,
    weights: Option<V>,
    ignore: Option<i64>,
    logp: Option<&wgpu::Buffer>,
) -> Result<(wgpu::Buffer, wgpu::Buffer, usize)> {
    let (c, d) = (x.shape()[1], numel(&x.shape()[2..]));
    let ne = x.shape()[0] * d;
    let (loss, wt) = (w.scratch(ne * 4), w.scratch(ne * 4));
    let flags = ignore.is_some() as usize
        | (weights.is_some() as usize) << 1
        | (logp.is_some() as usize) << 2;
    let p = Params::new()
        .u(0, c)
        .u(1, d.max(1))
        .u(2, ne)
        .i(3, ignore.unwrap_or(0))
        .u(4, flags);
    let dummy = w.scratch(16);
    let (entry, groups) = sce_layout(c, ne, ["sce_rows", "sce_rows_wg"]);
    let k = kernel(w, node, entry, x.dtype(), label_words(node, labels)?)?;
    let dw = w.scratch(16);
    w.run_kernel(
        &k,
        &p,
        &[
            (1, x.buf),
            (2, weights.map_or(&dummy, |v| v.buf)),
            (9, labels.buf),
            (5, &loss),
            (6, &wt),
            (4, logp.unwrap_or(&dw)),
        ],
        groups,
    )?;
    Ok((loss, wt, ne))
}

/// A softmax cross-entropy kernel's entry and grid: a thread per element, or a workgroup
/// per element past LONG_LINE classes.
fn sce_layout(c: usize, ne: usize, [each, wg]: [&'static str; 2]) -> (&'static str, [u32; 3]) {
    match c > LONG_LINE {
        false => (each, groups_for(ne, 256)),
        true => (wg, rows_groups(ne)),
    }
}

#[allow(clippy::too_many_arguments)]
pub fn sce(
    w: &mut Wgpu,
    node: &Node,
    [x, labels]: [&V; 2],
    weights: Option<V>,
    reduction: LossReduction,
    ignore: Option<i64>,
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let logp = wanted(outs, want, 1).map(|v| v.buf);
    let (loss, wt, ne) = sce_rows(w, node, x, labels, weights, ignore, logp)?;
    let code = reduction_code(reduction);
    let p = Params::new().u(0, ne).u(1, code);
    let k = kernel(w, node, "sce_reduce", x.dtype(), 1)?;
    let groups = if code == 0 {
        groups_for(ne, 256)
    } else {
        [1, 1, 1]
    };
    w.run_kernel(&k, &p, &[(7, &loss), (8, &wt), (4, outs[0].buf)], groups)
}

#[allow(clippy::too_many_arguments)]
pub fn sce_grad(
    w: &mut Wgpu,
    node: &Node,
    [dloss, x, labels]: [&V; 3],
    weights: Option<V>,
    reduction: LossReduction,
    ignore: Option<i64>,
    dx: &V,
) -> Result<()> {
    let (_loss, wt, ne) = sce_rows(w, node, x, labels, weights, ignore, None)?;
    let denom = w.scratch(16);
    let code = reduction_code(reduction);
    if code == 2 {
        let k = kernel(w, node, "wsum", x.dtype(), 1)?;
        w.run_kernel(
            &k,
            &Params::new().u(0, ne),
            &[(8, &wt), (5, &denom)],
            [1, 1, 1],
        )?;
    }
    let (c, d) = (x.shape()[1], numel(&x.shape()[2..]));
    let p = Params::new().u(0, c).u(1, d.max(1)).u(2, ne).u(5, code);
    let (entry, groups) = sce_layout(c, ne, ["sce_grad", "sce_grad_wg"]);
    let k = kernel(w, node, entry, x.dtype(), label_words(node, labels)?)?;
    w.run_kernel(
        &k,
        &p,
        &[
            (1, x.buf),
            (3, dloss.buf),
            (9, labels.buf),
            (7, &denom),
            (8, &wt),
            (4, dx.buf),
        ],
        groups,
    )
}
