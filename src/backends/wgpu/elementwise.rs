//! Elementwise family on wgpu (shaders/elementwise.wgsl): unary maps and their
//! gradients, binary arithmetic and comparisons with broadcasting, Pow, Clip, Dropout,
//! the Random draws.

use super::device::{groups_for, Family};
use super::{float_defs, shape, unsupported, Params, Strided, Wgpu, V};
use crate::backends::common;
use crate::error::Result;
use crate::graph::infer::ValueType;
use crate::graph::{Activation, BinaryKind, BinaryOp, Node, UnaryOp};
use crate::tensor::DType;

/// The defs of an arithmetic kernel: floats compute in f32, i32 and u32 in themselves.
fn num_defs(w: &Wgpu, node: &Node, dt: DType) -> Result<String> {
    match dt {
        DType::I32 => Ok("alias T = i32;\nalias A = i32;\n".into()),
        DType::U32 => Ok("alias T = u32;\nalias A = u32;\n".into()),
        _ => float_defs(w, node, dt),
    }
}

pub fn unary(w: &mut Wgpu, node: &Node, u: UnaryOp, x: &V, y: &V) -> Result<()> {
    let [alpha, beta] = u.params();
    let n = y.numel();
    if x.dtype() == DType::I32 && u.takes_ints() {
        let p = Params::new().u(0, n).u(1, u.code() as usize);
        let k = Wgpu::kernel(
            Family::Elementwise,
            "signop",
            num_defs(w, node, DType::I32)?,
        );
        return w.run_kernel(&k, &p, &[(1, x.buf), (3, y.buf)], groups_for(n, 256));
    }
    map_code(w, node, u.code(), [alpha, beta], x, y)
}

/// `y = f(x)` for the map of op code `code` (a unary op's, or an activation's such as
/// SiLU and ReLU6 that no unary op has) on floating values.
pub fn map_code(
    w: &mut Wgpu,
    node: &Node,
    code: i32,
    [alpha, beta]: [f32; 2],
    x: &V,
    y: &V,
) -> Result<()> {
    let n = y.numel();
    let defs = float_defs(w, node, x.dtype())?;
    let p = Params::new()
        .u(0, n)
        .u(1, code as usize)
        .f(2, alpha)
        .f(3, beta);
    let k = Wgpu::kernel(Family::Elementwise, "unary", defs);
    w.run_kernel(&k, &p, &[(1, x.buf), (3, y.buf)], groups_for(n, 256))
}

pub fn unary_grad(w: &mut Wgpu, node: &Node, u: UnaryOp, dy: &V, x: &V, out: &V) -> Result<()> {
    grad_kernel(w, node, dy, x, out, u.code(), u.params())
}

/// `out = dy · f'(x)` for op code `op` (UnaryGrad, and FusedMatMulGrad's G).
pub fn grad_kernel(
    w: &mut Wgpu,
    node: &Node,
    dy: &V,
    x: &V,
    out: &V,
    op: i32,
    [alpha, beta]: [f32; 2],
) -> Result<()> {
    let defs = float_defs(w, node, x.dtype())?;
    let n = out.numel();
    let s = Strided::broadcast(out.shape(), &[dy.shape(), x.shape()]);
    let p = Params::new()
        .u(0, n)
        .u(1, op as usize)
        .f(2, alpha)
        .f(3, beta)
        .strided(16, &s)?;
    let k = Wgpu::kernel(Family::Elementwise, "unary_grad", defs);
    w.run_kernel(
        &k,
        &p,
        &[(1, dy.buf), (2, x.buf), (3, out.buf)],
        groups_for(n, 256),
    )
}

/// GatedMatMul's gate `y = act(g)·u` (`dy` None; `outs` = [Y]), or its gradient (`dy`
/// given; `outs` = [dG, dU], one dispatch each). Every operand has Y's shape, contiguous.
pub fn glu(
    w: &mut Wgpu,
    node: &Node,
    act: Activation,
    dy: Option<&V>,
    [g, u]: [&V; 2],
    outs: &[&V],
) -> Result<()> {
    let defs = float_defs(w, node, g.dtype())?;
    let n = outs[0].numel();
    let k = Wgpu::kernel(Family::Elementwise, "glu", defs);
    let code = common::act_code(act) as usize;
    let params = |mode: usize| Params::new().u(0, n).u(1, code).u(2, mode);
    let Some(dy) = dy else {
        // X2 is bound too: the entry point reads it (in the gradient's mode), so its
        // layout has it.
        let binds = [(1, g.buf), (2, u.buf), (5, u.buf), (3, outs[0].buf)];
        return w.run_kernel(&k, &params(0), &binds, groups_for(n, 256));
    };
    for (mode, out) in [(1, outs[0]), (2, outs[1])] {
        let binds = [(1, dy.buf), (2, g.buf), (5, u.buf), (3, out.buf)];
        w.run_kernel(&k, &params(mode), &binds, groups_for(n, 256))?;
    }
    Ok(())
}

pub fn binary(w: &mut Wgpu, node: &Node, op: BinaryOp, a: &V, b: &V, y: &V) -> Result<()> {
    let s = Strided::broadcast(y.shape(), &[a.shape(), b.shape()]);
    match op.kind() {
        BinaryKind::Pow => return pow(w, node, a, b, y, s),
        BinaryKind::Bitwise if !a.dtype().is_int() => return Err(unsupported(node, a.dtype())),
        _ => {}
    }
    check_divisor(w, node, op, a, b)?;
    run_map(w, node, op.code(), op.is_comparison(), a, b, y, s)
}

/// One binary map by op code (`compare`: it writes bools), by the kernel for the
/// operands' dtype: floats, i32 and u32 natively, bool and 8- and 16-bit integers packed in
/// words, 64-bit integers as word pairs (`packed_bits`).
#[allow(clippy::too_many_arguments)]
fn run_map(
    w: &mut Wgpu,
    node: &Node,
    code: i32,
    compare: bool,
    a: &V,
    b: &V,
    y: &V,
    s: Strided,
) -> Result<()> {
    let (dt, n) = (a.dtype(), y.numel());
    let mut p = Params::new().u(0, n).u(1, code as usize);
    // (entry, defs, bindings of a, b and y, outputs a thread writes)
    let (entry, defs, binds, per) = match packed_bits(dt) {
        None => {
            let defs = num_defs(w, node, dt)?;
            match compare {
                true => ("compare", defs, [1, 2, 4], 4),
                false => ("binary", defs, [1, 2, 3], 1),
            }
        }
        Some((bits, signed)) => {
            p = p.u(2, bits).u(3, signed as usize);
            let defs = "alias T = i32;\nalias A = i32;\n".to_string();
            match (compare, bits) {
                (true, 64) => ("compare64_", defs, [7, 8, 4], 4),
                (false, 64) => ("binary64", defs, [7, 8, 4], 1),
                (true, _) => ("compare_packed", defs, [7, 8, 4], 4),
                (false, _) if dt != DType::Bool => ("binary_packed", defs, [7, 8, 4], 32 / bits),
                (false, _) => return Err(unsupported(node, dt)),
            }
        }
    };
    let p = p.strided(16, &s)?;
    let k = Wgpu::kernel(Family::Elementwise, entry, defs);
    w.run_kernel(
        &k,
        &p,
        &[(binds[0], a.buf), (binds[1], b.buf), (binds[2], y.buf)],
        groups_for(n.div_ceil(per), 256),
    )
}

/// Rotary (`transposed`: RotaryGrad) of x with cos and sin broadcast to it.
pub fn rotary(
    w: &mut Wgpu,
    node: &Node,
    [x, cos, sin]: [&V; 3],
    (interleaved, transposed): (bool, bool),
    y: &V,
) -> Result<()> {
    let n = y.numel();
    let d = y.shape().last().copied().unwrap_or(1);
    let s = Strided::broadcast(y.shape(), &[x.shape(), cos.shape(), sin.shape()]);
    let p = Params::new()
        .u(0, n)
        .u(1, d)
        .u(2, interleaved as usize | (transposed as usize) << 1)
        .strided(16, &s)?;
    let k = Wgpu::kernel(Family::Elementwise, "rotary", num_defs(w, node, x.dtype())?);
    let binds = [(1, x.buf), (2, cos.buf), (5, sin.buf), (3, y.buf)];
    w.run_kernel(&k, &p, &binds, groups_for(n, 256))
}

/// Integer division by zero is an error, as on the CPU (WGSL would give the dividend).
fn check_divisor(w: &mut Wgpu, node: &Node, op: BinaryOp, a: &V, b: &V) -> Result<()> {
    let divides = matches!(op, BinaryOp::Div | BinaryOp::Mod | BinaryOp::Fmod);
    if divides && a.dtype().is_int() && b.numel() > 0 && w.read(b)?.to_i64_vec().contains(&0) {
        crate::bail!(
            Runtime,
            "{}: integer division by zero (divisor of shape {})",
            node.describe(),
            crate::tensor::fmt_shape(b.shape())
        );
    }
    Ok(())
}

/// Lane width and signedness of the integer dtypes WGSL has no type for: bool and 8- and
/// 16-bit integers packed in u32 words (the `*_packed` kernels compute in i32), and 64-bit
/// integers as word pairs (`binary64`, `compare64_`).
fn packed_bits(dt: DType) -> Option<(usize, bool)> {
    match dt {
        DType::I64 => Some((64, true)),
        DType::U64 => Some((64, false)),
        DType::Bool | DType::U8 => Some((8, false)),
        DType::I8 => Some((8, true)),
        DType::U16 => Some((16, false)),
        DType::I16 => Some((16, true)),
        _ => None,
    }
}

/// Pow. Float bases: the exponent cast to f32 first (`power`); integer bases below.
fn pow(w: &mut Wgpu, node: &Node, a: &V, b: &V, y: &V, s: Strided) -> Result<()> {
    let dt = a.dtype();
    if dt.is_int() && b.dtype().is_int() {
        // The exact wrapping power, as on the CPU (`BIN_POW` of the arithmetic kernels).
        if b.numel() > 0 && w.read(b)?.to_i64_vec().iter().any(|&e| e < 0) {
            crate::bail!(
                Runtime,
                "{}: integers to negative integer powers are not allowed",
                node.describe()
            );
        }
        let ety = ValueType::new(dt, b.shape());
        let e = w.scratch(ety.bytes());
        let ev = V { buf: &e, ty: &ety };
        shape::cast(w, node, b, &ev)?;
        return run_map(w, node, BinaryOp::Pow.code(), false, a, &ev, y, s);
    }
    if dt.is_int() {
        // A float exponent: through f32 and back (exact while the powers fit f32).
        let (aty, yty) = (
            ValueType::new(DType::F32, a.shape()),
            ValueType::new(DType::F32, y.shape()),
        );
        let (af, yf) = (w.scratch(aty.bytes()), w.scratch(yty.bytes()));
        let (av, yv) = (V { buf: &af, ty: &aty }, V { buf: &yf, ty: &yty });
        shape::cast(w, node, a, &av)?;
        pow(w, node, &av, b, &yv, s)?;
        return shape::cast(w, node, &yv, y);
    }
    let defs = float_defs(w, node, a.dtype())?;
    let ety = ValueType::new(DType::F32, b.shape());
    let e = w.scratch(ety.bytes());
    shape::cast(w, node, b, &V { buf: &e, ty: &ety })?;
    let n = y.numel();
    let p = Params::new().u(0, n).strided(16, &s)?;
    let k = Wgpu::kernel(Family::Elementwise, "power", defs);
    w.run_kernel(
        &k,
        &p,
        &[(1, a.buf), (6, &e), (3, y.buf)],
        groups_for(n, 256),
    )
}

/// CumSum (CumProd with `prod`): the axis (one number) read back, a thread per line along
/// it; `[exclusive, reverse]` as the op's attributes.
pub fn cumulative(
    w: &mut Wgpu,
    node: &Node,
    x: &V,
    axis: &V,
    prod: bool,
    [excl, rev]: [bool; 2],
    y: &V,
) -> Result<()> {
    let ax = w.read(axis)?.to_i64_vec().first().copied().unwrap_or(0);
    let (outer, d, inner) = common::line_dims(node, x.shape(), ax)?;
    let flags = excl as usize | (rev as usize) << 1 | (prod as usize) << 2;
    let params = |s0: usize, s1: usize| {
        Params::new()
            .u(1, outer)
            .u(2, d)
            .u(3, inner.max(1))
            .u(4, flags)
            .u(5, s0)
            .u(6, s1)
    };
    // 64-bit integers (a position count from an attention mask, as BLOOM's exports
    // compute) as word pairs; the others natively.
    let (k, binds) = if matches!(packed_bits(x.dtype()), Some((64, _))) {
        let defs = "alias T = i32;\nalias A = i32;\n".to_string();
        let k = Wgpu::kernel(Family::Elementwise, "cumulative64", defs);
        (k, [(7, x.buf), (4, y.buf)])
    } else {
        let defs = num_defs(w, node, x.dtype())?;
        let k = Wgpu::kernel(Family::Elementwise, "cumulative", defs);
        (k, [(1, x.buf), (3, y.buf)])
    };
    // Steps of each line a dispatch, each carrying on from the last (lavapipe ends a
    // shader loop after 65535 iterations).
    const STEPS: usize = 16384;
    for s0 in (0..d.max(1)).step_by(STEPS) {
        let p = params(s0, (s0 + STEPS).min(d));
        w.run_kernel(&k, &p, &binds, groups_for(outer * inner, 256))?;
    }
    Ok(())
}

/// Range from its start and delta (the length is the output's).
pub fn range(w: &mut Wgpu, node: &Node, start: &V, delta: &V, y: &V) -> Result<()> {
    let defs = num_defs(w, node, y.dtype())?;
    let n = y.numel();
    let p = Params::new().u(0, n);
    let k = Wgpu::kernel(Family::Elementwise, "range_", defs);
    w.run_kernel(
        &k,
        &p,
        &[(1, start.buf), (2, delta.buf), (3, y.buf)],
        groups_for(n, 256),
    )
}

pub fn clip(w: &mut Wgpu, node: &Node, x: &V, lo: Option<V>, hi: Option<V>, y: &V) -> Result<()> {
    if packed_bits(x.dtype()).is_some() {
        return clip_packed(w, node, x, lo, hi, y);
    }
    let defs = num_defs(w, node, x.dtype())?;
    let n = y.numel();
    let flags = lo.is_some() as usize | (hi.is_some() as usize) << 1;
    let p = Params::new().u(0, n).u(1, flags);
    let k = Wgpu::kernel(Family::Elementwise, "clip", defs);
    let dummy = w.scratch(16);
    let lo_b = lo.map_or(&dummy, |v| v.buf);
    let hi_b = hi.map_or(&dummy, |v| v.buf);
    w.run_kernel(
        &k,
        &p,
        &[(1, x.buf), (2, lo_b), (5, hi_b), (3, y.buf)],
        groups_for(n, 256),
    )
}

/// Clip of a packed dtype: Max with the lower bound, then Min with the upper, by the
/// packed binary kernels (the first result in scratch: a dispatch may not read and write
/// one buffer).
fn clip_packed(
    w: &mut Wgpu,
    node: &Node,
    x: &V,
    lo: Option<V>,
    hi: Option<V>,
    y: &V,
) -> Result<()> {
    let bcast = |b: &V| Strided::broadcast(y.shape(), &[x.shape(), b.shape()]);
    match (lo, hi) {
        (None, None) => {
            w.rec.copy(x.buf, y.buf, y.ty.bytes());
            Ok(())
        }
        (Some(lo), None) => run_map(w, node, BinaryOp::Max.code(), false, x, &lo, y, bcast(&lo)),
        (None, Some(hi)) => run_map(w, node, BinaryOp::Min.code(), false, x, &hi, y, bcast(&hi)),
        (Some(lo), Some(hi)) => {
            let t = w.scratch(y.ty.bytes());
            let tv = V { buf: &t, ty: y.ty };
            run_map(
                w,
                node,
                BinaryOp::Max.code(),
                false,
                x,
                &lo,
                &tv,
                bcast(&lo),
            )?;
            let s = Strided::broadcast(y.shape(), &[y.shape(), hi.shape()]);
            run_map(w, node, BinaryOp::Min.code(), false, &tv, &hi, y, s)
        }
    }
}

/// A Random node's draw in f32: the CPU's counter-based values (`common::random_value`
/// with 24 bits), to f32 rounding.
pub fn random(
    w: &mut Wgpu,
    node: &Node,
    (normal, a, b): (bool, f32, f32),
    seed: Option<f64>,
    y: &V,
) -> Result<()> {
    let defs = float_defs(w, node, y.dtype())?;
    let base = common::step_seed(common::base_seed(node, common::random_seed(seed)), w.step);
    let n = y.numel();
    let p = Params::new()
        .u(0, n)
        .u(1, base as u32 as usize)
        .u(2, (base >> 32) as usize)
        .u(3, normal as usize)
        .f(4, a)
        .f(5, b);
    let k = Wgpu::kernel(Family::Elementwise, "random", defs);
    w.run_kernel(&k, &p, &[(3, y.buf)], groups_for(n, 256))
}

/// Identity at inference; in training the CPU's counter-based mask, bit for bit.
#[allow(clippy::too_many_arguments)]
pub fn dropout(
    w: &mut Wgpu,
    node: &Node,
    x: &V,
    ratio_in: Option<V>,
    mode_in: Option<V>,
    outs: &[V],
    ratio: f32,
    seed: Option<i64>,
) -> Result<()> {
    let mut first = |v: Option<V>| -> Result<Option<f64>> {
        Ok(match v {
            Some(v) => w.read(&v)?.to_f64_vec().first().copied(),
            None => None,
        })
    };
    let ratio = first(ratio_in)?.unwrap_or(ratio as f64);
    let mode = first(mode_in)?;
    let ratio = common::dropout_ratio(node, ratio)?;
    let training = w.step > 0 || mode.is_some_and(|v| v != 0.0);
    let (y, mask) = (&outs[0], outs.get(1));
    if !training || ratio == 0.0 {
        w.rec.copy(x.buf, y.buf, y.ty.bytes());
        if let Some(m) = mask {
            let ones = vec![1u8; m.numel()];
            w.rec.write(m.buf, &ones)?;
        }
        return Ok(());
    }
    let defs = float_defs(w, node, x.dtype())?;
    let base = common::step_seed(common::base_seed(node, seed.map(|s| s as u64)), w.step);
    // uniform = k / 2^53 >= ratio  ⇔  k >= ceil(ratio · 2^53), exact in f64.
    let thr = (ratio * (1u64 << 53) as f64).ceil() as u64;
    let n = y.numel();
    let p = Params::new()
        .u(0, n)
        .u(1, base as u32 as usize)
        .u(2, (base >> 32) as usize)
        .u(3, thr as u32 as usize)
        .u(4, (thr >> 32) as usize)
        .f(5, (1.0 / (1.0 - ratio)) as f32)
        .u(6, mask.is_some() as usize);
    let scratch = w.scratch(16);
    let m = mask.map_or(&scratch, |m| m.buf);
    let k = Wgpu::kernel(Family::Elementwise, "dropout", defs);
    w.run_kernel(
        &k,
        &p,
        &[(1, x.buf), (3, y.buf), (4, m)],
        groups_for(n.div_ceil(4), 256),
    )
}
