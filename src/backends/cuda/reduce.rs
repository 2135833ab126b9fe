//! Row-wise family on CUDA (cuda/reduce.cu): reductions, ArgMax/ArgMin, TopK,
//! Softmax/LogSoftmax and their gradient, LayerNormalization forward/backward,
//! SoftmaxCrossEntropyLoss and its gradient.

use super::device::{bcast_strides, strides, suffix, Arg, Strided};
use super::{unsupported, Cuda, V};
use crate::backends::common::{line_dims, node_axis, wanted};
use crate::error::Result;
use crate::graph::infer::ValueType;
use crate::graph::op::LossReduction;
use crate::graph::{Node, ReduceKind};
use crate::tensor::{numel, DType};

fn need_float(node: &Node, x: &V) -> Result<()> {
    if x.dtype().is_float() {
        Ok(())
    } else {
        Err(unsupported(node, x.dtype()))
    }
}

/// Threads per row: a warp for short rows, 256 otherwise.
fn row_threads(n: usize) -> u32 {
    if n <= 64 {
        32
    } else {
        256
    }
}

/// The statistics dtype of a floating dtype (f32, f64 for f64): what the kernels'
/// accumulation type stores.
fn acc_bytes(dt: DType) -> usize {
    if dt == DType::F64 {
        8
    } else {
        4
    }
}

/// Bytes of a reduction's partial result: the floats' accumulation type, 64 bits for the
/// integers.
fn part_bytes(dt: DType) -> usize {
    match dt.is_float() {
        true => acc_bytes(dt),
        false => 8,
    }
}

pub fn reduce(c: &Cuda, node: &Node, kind: ReduceKind, x: &V, axes: &[i64], y: &V) -> Result<()> {
    if x.dtype() == DType::Bool {
        return Err(unsupported(node, x.dtype()));
    }
    let r = x.shape().len();
    let mut red_axes = vec![];
    for &a in axes {
        red_axes.push(node_axis(node, a, r)?);
    }
    if axes.is_empty() {
        red_axes = (0..r).collect();
    }
    let st = strides(x.shape());
    let (mut ks, mut kst, mut rs, mut rst) = (vec![], vec![], vec![], vec![]);
    for (d, (&size, &stride)) in x.shape().iter().zip(&st).enumerate() {
        let (dims, sts) = if red_axes.contains(&d) {
            (&mut rs, &mut rst)
        } else {
            (&mut ks, &mut kst)
        };
        dims.push(size);
        sts.push(stride);
    }
    let (n_out, n_red) = (numel(&ks), numel(&rs));
    let kept = Strided::new(&ks, &[&kst], &[])?;
    let red = Strided::new(&rs, &[&rst], &[])?;
    let code = match kind {
        ReduceKind::Sum => 0,
        ReduceKind::Mean => 1,
        ReduceKind::Max => 2,
        ReduceKind::MeanSquare => 3,
        ReduceKind::Prod => 4,
    };
    // (Many short lines, such as a global pool's 7×7, take `reduce_lines_k` below.)
    let lines = n_red <= 64 && n_out >= 1 << 12;
    if let Some(dims) = outer_mid_inner(x.shape(), &red_axes).filter(|_| !lines) {
        return reduce_oi(c, x, y, dims, code);
    }
    // Columns: one block per output would read them strided, at a tenth of the memory's
    // rate (ResNet-50's channels-last bias gradients took 0.43 ms each in layer 1).
    let columns = rows_cols(x.shape(), &red_axes).filter(|_| !lines && x.dtype().is_float());
    if let Some(dims) = columns.filter(|&[_, n]| n >= 32) {
        return fold_rows(c, x.p, x.dtype(), dims, y.p, code);
    }
    // Few outputs of many elements each: one block per output would leave the GPU idle
    // (an MSE's mean over 8M elements took 16 ms), so split each into parts.
    if n_red >= 1 << 16 && n_out < 256 {
        let parts = (n_red >> 15).clamp(2, 1024);
        let part = c.scratch(n_out * parts * part_bytes(x.dtype()))?;
        let sfx = suffix(x.dtype());
        c.launch(
            &format!("reduce_part_{sfx}"),
            (n_out * parts) as u32,
            256,
            &[
                Arg::Ptr(x.p),
                Arg::Ptr(part),
                Arg::Strided(kept),
                Arg::Strided(red),
                Arg::I64(n_red as i64),
                Arg::I64(parts as i64),
                Arg::I32(code),
            ],
        )?;
        return c.launch(
            &format!("reduce_fin_{sfx}"),
            n_out as u32,
            256,
            &[
                Arg::Ptr(part),
                Arg::Ptr(y.p),
                Arg::I64(n_red as i64),
                Arg::I64(parts as i64),
                Arg::I32(code),
            ],
        );
    }
    // Many short lines: a block of 32 threads per 9-element pool window left most of
    // each warp idle (ResNet-50's max pool took 3.9 ms at batch 32); a thread per line.
    let mut args = vec![
        Arg::Ptr(x.p),
        Arg::Ptr(y.p),
        Arg::Strided(kept),
        Arg::Strided(red),
        Arg::I64(n_red as i64),
    ];
    if lines {
        args.extend([Arg::I64(n_out as i64), Arg::I32(code)]);
        return c.launch_n(&format!("reduce_lines_{}", suffix(x.dtype())), n_out, &args);
    }
    args.push(Arg::I32(code));
    c.launch(
        &format!("reduce_{}", suffix(x.dtype())),
        n_out as u32,
        row_threads(n_red),
        &args,
    )
}

/// x as `[outer, mid, inner]` where the reduced axes are those of outer and inner and the
/// kept ones mid's, with runs of inner long enough to read coalesced (a channels-first
/// bias gradient: N and the spatial axes reduced, the channels kept).
fn outer_mid_inner(shape: &[usize], red: &[usize]) -> Option<[usize; 3]> {
    // The axes of size > 1 as runs of (reduced, size).
    let mut runs: Vec<(bool, usize)> = vec![];
    for (d, &n) in shape.iter().enumerate().filter(|&(_, &n)| n != 1) {
        let r = red.contains(&d);
        match runs.last_mut() {
            Some((lr, size)) if *lr == r => *size *= n,
            _ => runs.push((r, n)),
        }
    }
    let [outer, mid, inner] = match runs[..] {
        [(false, m), (true, i)] => [1, m, i],
        [(true, o), (false, m), (true, i)] => [o, m, i],
        _ => return None,
    };
    // (No empty axis: parts divide outer, and a kernel never divides by inner = 0.)
    (inner >= 16 && outer > 0 && (1..1 << 30).contains(&mid)).then_some([outer, mid, inner])
}

/// `outer_mid_inner`'s reduction (reduce.cu `reduce_oi_k`): a block per kept element, each
/// split into parts of the outer rows where there are too few kept elements to fill the
/// GPU.
fn reduce_oi(c: &Cuda, x: &V, y: &V, [outer, mid, inner]: [usize; 3], code: i32) -> Result<()> {
    let sfx = suffix(x.dtype());
    let parts = match mid >= 1024 {
        true => 1,
        false => 2048usize
            .div_ceil(mid)
            .min(outer * inner / 8192)
            .clamp(1, outer),
    };
    let part = match parts {
        1 => 0,
        _ => c.scratch(mid * parts * part_bytes(x.dtype()))?,
    };
    c.launch(
        &format!("reduce_oi_{sfx}"),
        (mid * parts) as u32,
        256,
        &[
            Arg::Ptr(x.p),
            Arg::Ptr(y.p),
            Arg::Ptr(part),
            Arg::I64(outer as i64),
            Arg::I64(mid as i64),
            Arg::I64(inner as i64),
            Arg::I64(parts as i64),
            Arg::I32(code),
        ],
    )?;
    if parts == 1 {
        return Ok(());
    }
    c.launch(
        &format!("reduce_fin_{sfx}"),
        mid as u32,
        256,
        &[
            Arg::Ptr(part),
            Arg::Ptr(y.p),
            Arg::I64((outer * inner) as i64),
            Arg::I64(parts as i64),
            Arg::I32(code),
        ],
    )
}

/// ArgMax (ArgMin with `min`; `last`: select_last_index) into the i64 `y`: a thread per
/// line along the axis (reduce.cu `arg_reduce_k`).
pub fn arg_reduce(
    c: &Cuda,
    node: &Node,
    x: &V,
    axis: i64,
    min: bool,
    last: bool,
    y: &V,
) -> Result<()> {
    if x.dtype() == DType::Bool {
        return Err(unsupported(node, x.dtype()));
    }
    let (outer, d, inner) = line_dims(node, x.shape(), axis)?;
    let lines = outer * inner;
    if d == 0 && lines > 0 {
        crate::bail!(Runtime, "{}: the axis is empty", node.describe());
    }
    let args = [
        Arg::Ptr(x.p),
        Arg::Ptr(y.p),
        Arg::I64(lines as i64),
        Arg::I64(d as i64),
        Arg::I64(inner.max(1) as i64),
        Arg::I32(min as i32),
        Arg::I32(last as i32),
    ];
    c.launch_n(&format!("arg_reduce_{}", suffix(x.dtype())), lines, &args)
}

/// TopK: `outs` holds Values and, when the graph reads it, Indices (else scratch takes
/// them); K is Values' size along the axis. A thread per line picks the K in order
/// (reduce.cu `top_k_k`).
pub fn topk(c: &Cuda, node: &Node, x: &V, axis: i64, largest: bool, outs: &[V]) -> Result<()> {
    if x.dtype() == DType::Bool {
        return Err(unsupported(node, x.dtype()));
    }
    let (outer, d, inner) = line_dims(node, x.shape(), axis)?;
    let a = node_axis(node, axis, x.shape().len())?;
    let vals = &outs[0];
    let k = vals.shape()[a];
    let idx = match outs.get(1) {
        Some(i) => i.p,
        None => c.scratch(vals.numel().max(1) * 8)?,
    };
    let lines = outer * inner;
    let args = [
        Arg::Ptr(x.p),
        Arg::Ptr(vals.p),
        Arg::Ptr(idx),
        Arg::I64(lines as i64),
        Arg::I64(d as i64),
        Arg::I64(inner.max(1) as i64),
        Arg::I64(k as i64),
        Arg::I32(largest as i32),
    ];
    let n = if k == 0 { 0 } else { lines };
    c.launch_n(&format!("top_k_{}", suffix(x.dtype())), n, &args)
}

/// Σ over the rows of a `[rows, n]` matrix into `[n]` (the bias gradient).
pub fn sum_rows(c: &Cuda, g: &V, rows: usize, n: usize, out: &V) -> Result<()> {
    if rows == 0 && n > 0 {
        return c.memset0(out);
    }
    fold_rows(c, g.p, g.dtype(), [rows, n], out.p, 0)
}

/// Reduction `code` (`reduce`'s) over the rows of a `[rows, n]` matrix at `x` into `[n]`
/// at `y` (rows > 0): row chunks of 256 (at most 256 of them), 32 coalesced columns a
/// block, then the chunks per column.
fn fold_rows(c: &Cuda, x: u64, dt: DType, [rows, n]: [usize; 2], y: u64, code: i32) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let sfx = suffix(dt);
    let chunks = rows.div_ceil(256).min(256);
    let chunk = rows.div_ceil(chunks);
    let part = c.scratch(chunks * n * acc_bytes(dt))?;
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(part),
        Arg::I64(rows as i64),
        Arg::I64(n as i64),
        Arg::I64(chunk as i64),
        Arg::I32(code),
    ];
    super::device::launch_grid(
        &c.dev,
        &c.stream,
        &format!("colsum_part_{sfx}"),
        (n.div_ceil(32) as u32, chunks as u32, 1),
        256,
        0,
        &args,
    )?;
    let args = [
        Arg::Ptr(part),
        Arg::Ptr(y),
        Arg::I64(n as i64),
        Arg::I64(chunks as i64),
        Arg::I64(rows as i64),
        Arg::I32(code),
    ];
    c.launch_n(&format!("colsum_fin_{sfx}"), n, &args)
}

/// x as `[rows, n]` where the reduced axes lead and the kept ones follow (a channels-last
/// bias gradient: N and the spatial axes reduced, the channels kept).
fn rows_cols(shape: &[usize], red: &[usize]) -> Option<[usize; 2]> {
    let (mut rows, mut n, mut kept_seen) = (1usize, 1usize, false);
    for (d, &size) in shape.iter().enumerate().filter(|&(_, &s)| s != 1) {
        match red.contains(&d) {
            true if kept_seen => return None,
            true => rows *= size,
            false => {
                kept_seen = true;
                n *= size;
            }
        }
    }
    (rows > 1 && kept_seen && n <= i32::MAX as usize * 32).then_some([rows, n])
}

/// (rows, n, inner) around `axis`.
fn around(shape: &[usize], a: usize) -> (usize, usize, usize) {
    let (outer, n, inner) = (numel(&shape[..a]), shape[a], numel(&shape[a + 1..]));
    (outer * inner, n, inner)
}

pub fn softmax(c: &Cuda, node: &Node, x: &V, axis: i64, log: bool, y: &V) -> Result<()> {
    need_float(node, x)?;
    let a = node_axis(node, axis, x.shape().len())?;
    let (rows, n, inner) = around(x.shape(), a);
    let args = [
        Arg::Ptr(x.p),
        Arg::Ptr(y.p),
        Arg::I64(n as i64),
        Arg::I64(inner as i64),
        Arg::I32(log as i32),
    ];
    c.launch(
        &format!("softmax_{}", suffix(x.dtype())),
        rows as u32,
        row_threads(n),
        &args,
    )
}

pub fn softmax_grad(
    c: &Cuda,
    node: &Node,
    dy: &V,
    y: &V,
    axis: i64,
    log: bool,
    dx: &V,
) -> Result<()> {
    need_float(node, y)?;
    let a = node_axis(node, axis, y.shape().len())?;
    let (rows, n, inner) = around(y.shape(), a);
    let args = [
        Arg::Ptr(dy.p),
        Arg::Ptr(y.p),
        Arg::Ptr(dx.p),
        Arg::I64(n as i64),
        Arg::I64(inner as i64),
        Arg::I32(log as i32),
    ];
    c.launch(
        &format!("softmax_grad_{}", suffix(y.dtype())),
        rows as u32,
        row_threads(n),
        &args,
    )
}

/// `t` broadcast to the normalised shape `norm`: itself when it already has that many
/// elements, else a device copy expanded to it.
fn expanded(c: &Cuda, t: &V, norm: &[usize]) -> Result<Option<u64>> {
    if t.numel() == numel(norm) {
        return Ok(None);
    }
    let ty = ValueType::new(t.dtype(), norm);
    let buf = c.scratch(ty.bytes())?;
    let dst = V {
        p: buf,
        ty: &ty,
        buf: None,
    };
    let s = Strided::new(
        norm,
        &[&bcast_strides(t.shape(), norm), &strides(norm)],
        &[],
    )?;
    let n = numel(norm);
    let args = [
        Arg::Ptr(t.p),
        Arg::Ptr(dst.p),
        Arg::Strided(s),
        Arg::I64(n as i64),
    ];
    c.launch_n(
        &format!("copy_{}", super::device::word(t.dtype())),
        n,
        &args,
    )?;
    Ok(Some(buf))
}

/// Blocks of the one-pass LayerNormalizationGrad: enough rows in flight to keep the
/// memory busy, few enough that the [blocks, 2, n] partials stay small.
const LN_GRAD_BLOCKS: usize = 1024;

/// The register-resident vector kernels' shape for rows of `n` elements of `dt` at the
/// given pointers: (threads, vectors per thread M) where a row is whole 16-byte vectors,
/// every pointer is 16-byte aligned and the row fits in M ≤ 4 vectors a thread; None for
/// the scalar kernels.
fn ln_vec(dt: DType, n: usize, ptrs: &[u64]) -> Option<(u32, u32)> {
    let lanes = 16 / dt.size();
    if !n.is_multiple_of(lanes) || ptrs.iter().any(|p| !p.is_multiple_of(16)) {
        return None;
    }
    let nv = n / lanes;
    let threads = nv.next_multiple_of(32).min(256);
    let m = nv.div_ceil(threads);
    let m = [1, 2, 4].into_iter().find(|&k| m <= k)?;
    Some((threads as u32, m as u32))
}

/// With a `residual` R the rows are S = X + R, written to the last of `outs` (or to
/// scratch when nothing reads it).
#[allow(clippy::too_many_arguments)]
pub fn layer_norm(
    c: &Cuda,
    node: &Node,
    x: &V,
    scale: &V,
    bias: Option<V>,
    residual: Option<V>,
    (axis, eps, rms): (i64, f32, bool),
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    need_float(node, x)?;
    let a = node_axis(node, axis, x.shape().len())?;
    let norm = &x.shape()[a..];
    let (rows, n) = (numel(&x.shape()[..a]), numel(norm));
    let g = expanded(c, scale, norm)?;
    let b = match &bias {
        Some(b) => expanded(c, b, norm)?,
        None => None,
    };
    let gp = g.unwrap_or(scale.p);
    let bp = match (&b, &bias) {
        (Some(b), _) => *b,
        (None, Some(v)) => v.p,
        (None, None) => 0,
    };
    let stat = |i: usize| wanted(outs, want, i).map_or(0, |v| v.p);
    let (m, i) = crate::graph::op::norm_stat_outputs(rms);
    let (mean, inv) = (m.map_or(0, stat), stat(i));
    if n == 0 {
        crate::bail!(
            Runtime,
            "{}: the normalized shape is empty",
            node.describe()
        );
    }
    let (rp, sp) = match &residual {
        Some(r) => {
            let k = crate::graph::op::norm_sum_output(rms);
            let s = match wanted(outs, want, k) {
                Some(s) => s.p,
                None => c.scratch(x.ty.bytes())?,
            };
            (r.p, s)
        }
        None => (0, 0),
    };
    let vec = ln_vec(x.dtype(), n, &[x.p, rp, sp, gp, bp, outs[0].p]);
    let lanes = vec.map_or(1, |_| 16 / x.dtype().size());
    let args = [
        Arg::Ptr(x.p),
        Arg::Ptr(rp),
        Arg::Ptr(sp),
        Arg::Ptr(gp),
        Arg::Ptr(bp),
        Arg::Ptr(outs[0].p),
        Arg::Ptr(mean),
        Arg::Ptr(inv),
        Arg::I64((n / lanes) as i64),
        Arg::F32(eps),
        Arg::I32(rms as i32),
    ];
    let sfx = suffix(x.dtype());
    match vec {
        Some((threads, m)) => c.launch(
            &format!("layer_norm_vec{m}_{sfx}"),
            rows as u32,
            threads,
            &args,
        ),
        None => c.launch(
            &format!("layer_norm_{sfx}"),
            rows as u32,
            row_threads(n),
            &args,
        ),
    }
}

/// `[dY, X, Scale, Mean, InvStdDev]` → `[dX, dScale, dB]` (each only when wanted); no
/// Mean for RMSNormalization's gradient.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_grad(
    c: &Cuda,
    node: &Node,
    [dy, x, scale]: [&V; 3],
    (mean, inv): (Option<V>, &V),
    res: Option<V>,
    axis: i64,
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    need_float(node, x)?;
    if inv.dtype().size() != acc_bytes(x.dtype())
        || mean.as_ref().is_some_and(|m| m.dtype() != inv.dtype())
    {
        return Err(unsupported(node, inv.dtype()));
    }
    let mean_p = mean.as_ref().map_or(0, |m| m.p);
    let a = node_axis(node, axis, x.shape().len())?;
    let norm = &x.shape()[a..];
    let (rows, n) = (numel(&x.shape()[..a]), numel(norm));
    let w = |i: usize| wanted(outs, want, i);
    let sfx = suffix(x.dtype());
    if n == 0 || rows == 0 {
        for o in outs.iter().skip(1) {
            c.memset0(o)?;
        }
        return Ok(());
    }
    let (ds, db) = (w(1).map_or(0, |v| v.p), w(2).map_or(0, |v| v.p));
    let dxp = w(0).map_or(0, |v| v.p);
    let gp = if dxp != 0 {
        expanded(c, scale, norm)?.unwrap_or(scale.p)
    } else {
        0
    };
    let resp = res.as_ref().map_or(0, |r| r.p);
    // Without dX (a first LayerNorm's input needs none) the column kernel below reads dy
    // and x once as well, with more parallelism and no partials of n per block.
    let vec = ln_vec(x.dtype(), n, &[dy.p, x.p, gp, resp, dxp]).filter(|_| dxp != 0);
    if let Some((threads, m)) = vec {
        // One pass: dX and per-block partial sums of dScale/dB (blocks take rows in a
        // fixed round-robin), then the partials added per column in a fixed order.
        let blocks = rows.min(LN_GRAD_BLOCKS);
        let params = ds != 0 || db != 0;
        let part = if params {
            c.scratch(blocks * 2 * n * acc_bytes(x.dtype()))?
        } else {
            0
        };
        let args = [
            Arg::Ptr(dy.p),
            Arg::Ptr(x.p),
            Arg::Ptr(gp),
            Arg::Ptr(mean_p),
            Arg::Ptr(inv.p),
            Arg::Ptr(resp),
            Arg::Ptr(dxp),
            Arg::Ptr(part),
            Arg::I64(rows as i64),
            Arg::I64((n / (16 / x.dtype().size())) as i64),
        ];
        c.launch(
            &format!("layer_norm_grad_vec{m}_{sfx}"),
            blocks as u32,
            threads,
            &args,
        )?;
        if params {
            let args = [
                Arg::Ptr(part),
                Arg::Ptr(ds),
                Arg::Ptr(db),
                Arg::I64(n as i64),
                Arg::I64(blocks as i64),
            ];
            c.launch(
                &format!("ln_dparams_fin2_{sfx}"),
                (2 * n).div_ceil(32) as u32,
                1024,
                &args,
            )?;
        }
        return Ok(());
    }
    if dxp != 0 {
        let args = [
            Arg::Ptr(dy.p),
            Arg::Ptr(x.p),
            Arg::Ptr(gp),
            Arg::Ptr(mean_p),
            Arg::Ptr(inv.p),
            Arg::Ptr(resp),
            Arg::Ptr(dxp),
            Arg::I64(n as i64),
        ];
        c.launch(
            &format!("layer_norm_dx_{sfx}"),
            rows as u32,
            row_threads(n),
            &args,
        )?;
    }
    if ds != 0 || db != 0 {
        // Row chunks of 256 (at most 256 of them), 32 columns a block; then the chunks
        // summed per column.
        let chunks = rows.div_ceil(256).min(256);
        let chunk = rows.div_ceil(chunks);
        let part = c.scratch(chunks * 2 * n * acc_bytes(x.dtype()))?;
        let args = [
            Arg::Ptr(dy.p),
            Arg::Ptr(x.p),
            Arg::Ptr(mean_p),
            Arg::Ptr(inv.p),
            Arg::Ptr(part),
            Arg::I64(rows as i64),
            Arg::I64(n as i64),
            Arg::I64(chunk as i64),
        ];
        super::device::launch_grid(
            &c.dev,
            &c.stream,
            &format!("ln_dparams_part_{sfx}"),
            (n.div_ceil(32) as u32, chunks as u32, 1),
            256,
            0,
            &args,
        )?;
        let args = [
            Arg::Ptr(part),
            Arg::Ptr(ds),
            Arg::Ptr(db),
            Arg::I64(n as i64),
            Arg::I64(chunks as i64),
        ];
        c.launch_n(&format!("ln_dparams_fin_{sfx}"), n, &args)?;
    }
    Ok(())
}

/// The labels as i64 scratch on the device, checked there: a label that is neither a
/// class of axis 1 nor ignore_index raises the error flag (reported after the step).
fn labels(c: &Cuda, node: &Node, scores: &V, labels: &V, ignore: Option<i64>) -> Result<u64> {
    let classes = scores.shape()[1] as i64;
    if !matches!(labels.dtype(), DType::I64 | DType::I32) {
        return Err(unsupported(node, labels.dtype()));
    }
    let n = labels.numel();
    let out = c.scratch(n.max(1) * 8)?;
    let (flag, code) = c.error_code(format!(
        "{}: label {{v}} is out of range for {classes} classes{}",
        node.describe(),
        ignore
            .map(|i| format!(" (ignore_index is {i})"))
            .unwrap_or_default()
    ));
    let args = [
        Arg::Ptr(labels.p),
        Arg::Ptr(out),
        Arg::I64(n as i64),
        Arg::I64(classes),
        Arg::I64(ignore.unwrap_or(0)),
        Arg::I32(ignore.is_some() as i32),
        Arg::Ptr(flag),
        Arg::U64(code),
    ];
    c.launch_n(&format!("labels_{}", suffix(labels.dtype())), n, &args)?;
    Ok(out)
}

/// Per-element weights and losses (accumulation type), and log_prob when `logp` is
/// non-null. Returns (loss, weight) scratch and the element count.
#[allow(clippy::too_many_arguments)]
fn sce_rows(
    c: &Cuda,
    x: &V,
    labels: u64,
    weights: Option<V>,
    ignore: Option<i64>,
    logp: u64,
) -> Result<(u64, u64, usize)> {
    let (n, cl) = (x.shape()[0], x.shape()[1]);
    let d = numel(&x.shape()[2..]);
    let ne = n * d;
    let ab = acc_bytes(x.dtype());
    let (loss, wt) = (c.scratch(ne * ab)?, c.scratch(ne * ab)?);
    if d == 1 && n < 1 << 31 {
        let args = [
            Arg::Ptr(x.p),
            Arg::Ptr(labels),
            Arg::Ptr(weights.map_or(0, |w| w.p)),
            Arg::Ptr(loss),
            Arg::Ptr(wt),
            Arg::Ptr(logp),
            Arg::I64(cl as i64),
            Arg::I64(ignore.unwrap_or(0)),
            Arg::I32(ignore.is_some() as i32),
        ];
        let name = format!("sce_rows_row_{}", suffix(x.dtype()));
        c.launch(&name, n as u32, row_threads(cl), &args)?;
        return Ok((loss, wt, ne));
    }
    let args = [
        Arg::Ptr(x.p),
        Arg::Ptr(labels),
        Arg::Ptr(weights.map_or(0, |w| w.p)),
        Arg::Ptr(loss),
        Arg::Ptr(wt),
        Arg::Ptr(logp),
        Arg::I64(cl as i64),
        Arg::I64(d.max(1) as i64),
        Arg::I64(ne as i64),
        Arg::I64(ignore.unwrap_or(0)),
        Arg::I32(ignore.is_some() as i32),
    ];
    c.launch_n(&format!("sce_rows_{}", suffix(x.dtype())), ne, &args)?;
    Ok((loss, wt, ne))
}

fn reduction_code(r: LossReduction) -> i32 {
    match r {
        LossReduction::None => 0,
        LossReduction::Sum => 1,
        LossReduction::Mean => 2,
    }
}

#[allow(clippy::too_many_arguments)]
pub fn sce(
    c: &Cuda,
    node: &Node,
    x: &V,
    lab: &V,
    weights: Option<V>,
    reduction: LossReduction,
    ignore: Option<i64>,
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    need_float(node, x)?;
    let l = labels(c, node, x, lab, ignore)?;
    let logp = wanted(outs, want, 1).map_or(0, |v| v.p);
    let (loss, wt, ne) = sce_rows(c, x, l, weights, ignore, logp)?;
    let code = reduction_code(reduction);
    let args = [
        Arg::Ptr(loss),
        Arg::Ptr(wt),
        Arg::Ptr(outs[0].p),
        Arg::I64(ne as i64),
        Arg::I32(code),
    ];
    let grid = if code == 0 {
        super::device::grid_for(ne)
    } else {
        1
    };
    c.launch(
        &format!("sce_reduce_{}", suffix(x.dtype())),
        grid,
        256,
        &args,
    )
}

#[allow(clippy::too_many_arguments)]
pub fn sce_grad(
    c: &Cuda,
    node: &Node,
    dloss: &V,
    x: &V,
    lab: &V,
    weights: Option<V>,
    reduction: LossReduction,
    ignore: Option<i64>,
    dx: &V,
) -> Result<()> {
    need_float(node, x)?;
    let l = labels(c, node, x, lab, ignore)?;
    let (_loss, wt, ne) = sce_rows(c, x, l, weights, ignore, 0)?;
    let (cl, d) = (x.shape()[1], numel(&x.shape()[2..]));
    let sfx = suffix(x.dtype());
    if d == 1 && ne < 1 << 31 {
        let denom = c.scratch(acc_bytes(x.dtype()))?;
        let code = reduction_code(reduction);
        let args = [
            Arg::Ptr(wt),
            Arg::Ptr(denom),
            Arg::I64(ne as i64),
            Arg::I32(code),
        ];
        c.launch(&format!("sce_denom_{sfx}"), 1, 1024, &args)?;
        let args = [
            Arg::Ptr(x.p),
            Arg::Ptr(l),
            Arg::Ptr(wt),
            Arg::Ptr(denom),
            Arg::Ptr(dloss.p),
            Arg::Ptr(dx.p),
            Arg::I64(cl as i64),
            Arg::I32(code),
        ];
        return c.launch(
            &format!("sce_grad_row_{sfx}"),
            ne as u32,
            row_threads(cl),
            &args,
        );
    }
    let args = [
        Arg::Ptr(x.p),
        Arg::Ptr(l),
        Arg::Ptr(wt),
        Arg::Ptr(dloss.p),
        Arg::Ptr(dx.p),
        Arg::I64(cl as i64),
        Arg::I64(d.max(1) as i64),
        Arg::I64(ne as i64),
        Arg::I32(reduction_code(reduction)),
    ];
    c.launch_n(&format!("sce_grad_{sfx}"), ne, &args)
}
