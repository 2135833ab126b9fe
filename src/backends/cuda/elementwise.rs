//! Elementwise family on CUDA (cuda/elementwise.cu): unary and binary maps with
//! broadcasting, Pow, Clip, Where, Cast, Dropout, the Random draws, Trilu, the unary gradients and the
//! activation epilogue that FusedMatMul uses.

use super::device::{suffix, word, Arg, Strided};
use super::{unsupported, Cuda, V};
use crate::backends::common::{self, act_code};
use crate::error::Result;
use crate::graph::infer::ValueType;
use crate::graph::{Activation, BinaryKind, BinaryOp, Node, UnaryOp};
use crate::tensor::DType;
use cudarc::driver::CudaSlice;

pub fn unary(c: &Cuda, node: &Node, u: UnaryOp, x: &V, y: &V) -> Result<()> {
    let n = y.numel();
    let (op, [alpha, beta]) = (u.code(), u.params());
    let dt = x.dtype();
    if dt.is_float() {
        let args = [
            Arg::Ptr(x.p),
            Arg::Ptr(y.p),
            Arg::I64(n as i64),
            Arg::I32(op),
            Arg::F32(alpha),
            Arg::F32(beta),
        ];
        return c.launch_n(&format!("unary_{}", suffix(dt)), n, &args);
    }
    match dt {
        dt if dt.is_int() && u.takes_ints() => {
            let args = [
                Arg::Ptr(x.p),
                Arg::Ptr(y.p),
                Arg::I64(n as i64),
                Arg::I32(op),
            ];
            c.launch_n(&format!("signop_{}", suffix(dt)), n, &args)
        }
        _ => Err(unsupported(node, dt)),
    }
}

pub fn unary_grad(c: &Cuda, node: &Node, u: UnaryOp, dy: &V, x: &V, out: &V) -> Result<()> {
    let dt = x.dtype();
    if !dt.is_float() {
        return Err(unsupported(node, dt));
    }
    grad_kernel(c, dt, dy, x, out, u.code(), u.params())
}

/// The number of 16-byte vectors covering `out` where every operand has `out`'s shape
/// (contiguous with it) and every pointer is 16-byte aligned; None for the strided walk.
fn vectors(out: &V, ops: &[&V]) -> Option<usize> {
    let lanes = 16 / out.dtype().size().max(1);
    let n = out.numel();
    let ok = n.is_multiple_of(lanes)
        && out.p.is_multiple_of(16)
        && ops
            .iter()
            .all(|v| v.shape() == out.shape() && v.p.is_multiple_of(16));
    ok.then_some(n / lanes)
}

/// `out = dy · f'(x)` for op code `op` (UnaryGrad, and FusedMatMulGrad's G).
pub fn grad_kernel(
    c: &Cuda,
    dt: DType,
    dy: &V,
    x: &V,
    out: &V,
    op: i32,
    [alpha, beta]: [f32; 2],
) -> Result<()> {
    let n = out.numel();
    if let Some(nv) = vectors(out, &[dy, x]) {
        let args = [
            Arg::Ptr(dy.p),
            Arg::Ptr(x.p),
            Arg::Ptr(out.p),
            Arg::I64(nv as i64),
            Arg::I32(op),
            Arg::F32(alpha),
            Arg::F32(beta),
        ];
        return c.launch_n(&format!("unary_grad_vec_{}", suffix(dt)), nv, &args);
    }
    let s = Strided::broadcast(out.shape(), &[dy.shape(), x.shape()])?;
    let args = [
        Arg::Ptr(dy.p),
        Arg::Ptr(x.p),
        Arg::Ptr(out.p),
        Arg::Strided(s),
        Arg::I64(n as i64),
        Arg::I32(op),
        Arg::F32(alpha),
        Arg::F32(beta),
    ];
    c.launch_n(&format!("unary_grad_{}", suffix(dt)), n, &args)
}

/// GatedMatMul's gate `y = act(g)·u` (`dy` None), or its gradient (`dy` given): `outs`
/// = [dG, dU] from dY, G and U. Every operand has y's shape, contiguous.
pub fn glu(c: &Cuda, act: Activation, dy: Option<&V>, [g, u]: [&V; 2], outs: &[&V]) -> Result<()> {
    let all: Vec<&V> = dy
        .into_iter()
        .chain([g, u])
        .chain(outs.iter().copied())
        .collect();
    let (vec, n) = match vectors(outs[0], &all) {
        Some(nv) => (1, nv),
        None => (0, outs[0].numel()),
    };
    let mut args: Vec<Arg> = all.iter().map(|v| Arg::Ptr(v.p)).collect();
    args.extend([Arg::I64(n as i64), Arg::I32(act_code(act)), Arg::I32(vec)]);
    let kernel = if dy.is_some() { "glu_grad" } else { "glu" };
    c.launch_n(&format!("{kernel}_{}", suffix(g.dtype())), n, &args)
}

/// `y = act(pre) + residual` (residual broadcast to y; `pre` may be y itself).
pub fn act_epilogue(c: &Cuda, act: Activation, pre: u64, res: Option<&V>, y: &V) -> Result<()> {
    let n = y.numel();
    let ops: Vec<&V> = res.into_iter().collect();
    if let Some(nv) = vectors(y, &ops).filter(|_| pre.is_multiple_of(16)) {
        let args = [
            Arg::Ptr(pre),
            Arg::Ptr(res.map_or(0, |r| r.p)),
            Arg::Ptr(y.p),
            Arg::I64(nv as i64),
            Arg::I32(act_code(act)),
        ];
        return c.launch_n(
            &format!("act_epilogue_vec_{}", suffix(y.dtype())),
            nv,
            &args,
        );
    }
    let s = match res {
        Some(r) => Strided::broadcast(y.shape(), &[r.shape()])?,
        None => Strided::default(),
    };
    let args = [
        Arg::Ptr(pre),
        Arg::Ptr(res.map_or(0, |r| r.p)),
        Arg::Ptr(y.p),
        Arg::Strided(s),
        Arg::I64(n as i64),
        Arg::I32(act_code(act)),
    ];
    c.launch_n(&format!("act_epilogue_{}", suffix(y.dtype())), n, &args)
}

pub fn binary(c: &Cuda, node: &Node, op: BinaryOp, a: &V, b: &V, y: &V) -> Result<()> {
    use BinaryOp as B;
    let n = y.numel();
    let dt = a.dtype();
    let s = Strided::broadcast(y.shape(), &[a.shape(), b.shape()])?;
    let (name, code) = match op.kind() {
        BinaryKind::Compare | BinaryKind::Logic => ("compare", op.code()),
        BinaryKind::Pow => return pow(c, node, a, b, y, s),
        BinaryKind::Arith | BinaryKind::Bitwise => ("binary", op.code()),
    };
    if name == "binary" && dt == DType::Bool || op.kind() == BinaryKind::Bitwise && !dt.is_int() {
        return Err(unsupported(node, dt));
    }
    // Integer division by zero is an error on the CPU: checked here the same way.
    let divides = matches!(op, B::Div | B::Mod | B::Fmod);
    if divides && dt.is_int() && n > 0 && c.read(b)?.to_i64_vec().contains(&0) {
        crate::bail!(
            Runtime,
            "{}: integer division by zero (divisor of shape {})",
            node.describe(),
            crate::tensor::fmt_shape(b.shape())
        );
    }
    // Contiguous operands (each the output's shape, or one element) take the 16-byte path.
    let lanes = 16 / dt.size().max(1);
    let full = |v: &V| v.shape() == y.shape();
    let whole = |v: &V| full(v) || v.numel() == 1;
    if name == "binary"
        && whole(a)
        && whole(b)
        && n.is_multiple_of(lanes)
        && [a.p, b.p, y.p].iter().all(|p| p.is_multiple_of(16))
    {
        let nv = n / lanes;
        let args = [
            Arg::Ptr(a.p),
            Arg::Ptr(b.p),
            Arg::Ptr(y.p),
            Arg::I64(nv as i64),
            Arg::I32(code),
            Arg::I32(full(a) as i32),
            Arg::I32(full(b) as i32),
        ];
        return c.launch_n(&format!("binary_vec_{}", suffix(dt)), nv, &args);
    }
    let args = [
        Arg::Ptr(a.p),
        Arg::Ptr(b.p),
        Arg::Ptr(y.p),
        Arg::Strided(s),
        Arg::I64(n as i64),
        Arg::I32(code),
    ];
    c.launch_n(&format!("{name}_{}", suffix(dt)), n, &args)
}

/// Pow: the exponent is cast to the base's accumulation type in the kernel (f32; f64 for
/// f64); an integer base takes a float exponent as the CPU does (through f64, truncated)
/// and an integer one exactly (non-negative only).
fn pow(c: &Cuda, node: &Node, a: &V, b: &V, y: &V, s: Strided) -> Result<()> {
    let dt = a.dtype();
    let n = y.numel();
    let args = [
        Arg::Ptr(a.p),
        Arg::Ptr(b.p),
        Arg::Ptr(y.p),
        Arg::Strided(s),
        Arg::I64(n as i64),
    ];
    let (ea, eb) = (suffix(dt), suffix(b.dtype()));
    match dt {
        DType::F64 | DType::F32 | DType::F16 | DType::BF16 if b.dtype() != DType::Bool => {
            c.launch_n(&format!("pow_x_{ea}_{eb}"), n, &args)
        }
        dt if dt.is_int() && b.dtype().is_float() => {
            c.launch_n(&format!("pow_if_{ea}_{eb}"), n, &args)
        }
        dt if dt.is_int() && b.dtype().is_int() => int_pow(c, node, a, b, y, s),
        _ => Err(unsupported(node, dt)),
    }
}

/// Integer base and exponent: exact wrapping powers; a negative exponent is an error, as
/// on the CPU (checked on the host: this reads the exponent back).
fn int_pow(c: &Cuda, node: &Node, a: &V, b: &V, y: &V, s: Strided) -> Result<()> {
    let ety = ValueType::new(DType::I64, b.shape());
    let e = c.zeros::<u8>(ety.bytes())?;
    let ev = view(c, &e, &ety);
    cast(c, b, &ev)?;
    if b.numel() > 0 && c.read(&ev)?.to_i64_vec().iter().any(|&v| v < 0) {
        crate::bail!(
            Runtime,
            "{}: integers to negative integer powers are not allowed",
            node.describe()
        );
    }
    let n = y.numel();
    let args = [
        Arg::Ptr(a.p),
        Arg::Ptr(ev.p),
        Arg::Ptr(y.p),
        Arg::Strided(s),
        Arg::I64(n as i64),
    ];
    c.launch_n(&format!("pow_{}", suffix(a.dtype())), n, &args)
}

/// A scratch buffer seen as a value of type `ty`.
fn view<'a>(c: &Cuda, buf: &'a CudaSlice<u8>, ty: &'a ValueType) -> V<'a> {
    V {
        p: c.addr(buf),
        ty,
        buf: Some(buf),
    }
}

/// CumSum (CumProd with `prod`): the axis (one number) read back, a thread per line along
/// it; `[exclusive, reverse]` as the op's attributes.
pub fn cumulative(
    c: &Cuda,
    node: &Node,
    x: &V,
    axis: &V,
    prod: bool,
    [excl, rev]: [bool; 2],
    y: &V,
) -> Result<()> {
    let dt = x.dtype();
    if dt == DType::Bool {
        return Err(unsupported(node, dt));
    }
    let ax = c.read(axis)?.to_i64_vec().first().copied().unwrap_or(0);
    let (outer, d, inner) = common::line_dims(node, x.shape(), ax)?;
    let lines = outer * inner;
    let args = [
        Arg::Ptr(x.p),
        Arg::Ptr(y.p),
        Arg::I64(outer as i64),
        Arg::I64(d as i64),
        Arg::I64(inner.max(1) as i64),
        Arg::I32(excl as i32),
        Arg::I32(rev as i32),
        Arg::I32(prod as i32),
    ];
    c.launch_n(&format!("cumulative_{}", suffix(dt)), lines, &args)
}

/// Range from its start and delta (device scalars; the length is the output's).
pub fn range(c: &Cuda, node: &Node, start: &V, delta: &V, y: &V) -> Result<()> {
    let dt = y.dtype();
    if dt == DType::Bool {
        return Err(unsupported(node, dt));
    }
    let n = y.numel();
    let args = [
        Arg::Ptr(start.p),
        Arg::Ptr(delta.p),
        Arg::Ptr(y.p),
        Arg::I64(n as i64),
    ];
    c.launch_n(&format!("range_{}", suffix(dt)), n, &args)
}

pub fn clip(c: &Cuda, node: &Node, x: &V, lo: Option<V>, hi: Option<V>, y: &V) -> Result<()> {
    let dt = x.dtype();
    if dt == DType::Bool {
        return Err(unsupported(node, dt));
    }
    let n = y.numel();
    let args = [
        Arg::Ptr(x.p),
        Arg::Ptr(lo.map_or(0, |v| v.p)),
        Arg::Ptr(hi.map_or(0, |v| v.p)),
        Arg::Ptr(y.p),
        Arg::I64(n as i64),
    ];
    c.launch_n(&format!("clip_{}", suffix(dt)), n, &args)
}

pub fn where_(c: &Cuda, cond: &V, a: &V, b: &V, y: &V) -> Result<()> {
    let n = y.numel();
    let s = Strided::broadcast(y.shape(), &[cond.shape(), a.shape(), b.shape()])?;
    let args = [
        Arg::Ptr(cond.p),
        Arg::Ptr(a.p),
        Arg::Ptr(b.p),
        Arg::Ptr(y.p),
        Arg::Strided(s),
        Arg::I64(n as i64),
    ];
    c.launch_n(&format!("where_{}", word(a.dtype())), n, &args)
}

/// Rotary (`transposed`: RotaryGrad) of x with cos and sin broadcast to it.
pub fn rotary(
    c: &Cuda,
    [x, cos, sin]: [&V; 3],
    interleaved: bool,
    transposed: bool,
    y: &V,
) -> Result<()> {
    // One thread per pair of the (even) last axis, or per four pairs of the halves where
    // x and y can be read and written four elements at a time.
    let pairs = y.numel() / 2;
    let d = y.shape().last().copied().unwrap_or(2);
    let s = Strided::broadcast(y.shape(), &[x.shape(), cos.shape(), sin.shape()])?;
    let align = 4 * x.dtype().size() as u64;
    let aligned = x.p.is_multiple_of(align) && y.p.is_multiple_of(align);
    let vec = !interleaved && (d / 2).is_multiple_of(4) && aligned;
    let (kernel, threads) = if vec {
        ("rotary_vec", pairs / 4)
    } else {
        ("rotary", pairs)
    };
    let mut args = vec![
        Arg::Ptr(x.p),
        Arg::Ptr(cos.p),
        Arg::Ptr(sin.p),
        Arg::Ptr(y.p),
        Arg::Strided(s),
        Arg::I64(threads as i64),
        Arg::I64(d as i64),
    ];
    if !vec {
        args.push(Arg::I32(interleaved as i32));
    }
    args.push(Arg::I32(transposed as i32));
    c.launch_n(&format!("{kernel}_{}", suffix(x.dtype())), threads, &args)
}

/// The narrow format index of cuda/elementwise.cu `narrow_cast_k`, -1 for other dtypes.
fn narrow_format(dt: DType) -> i32 {
    match dt {
        DType::F8E4M3FN => 0,
        DType::F8E4M3FNUZ => 1,
        DType::F8E5M2 => 2,
        DType::F8E5M2FNUZ => 3,
        DType::F4E2M1 => 4,
        DType::I4 => 5,
        DType::U4 => 6,
        DType::I2 => 7,
        DType::U2 => 8,
        DType::F8E8M0 => 9,
        _ => -1,
    }
}

pub fn cast(c: &Cuda, x: &V, y: &V) -> Result<()> {
    if x.dtype() == y.dtype() {
        return c.copy(y, x);
    }
    let n = y.numel();
    let (sf, df) = (narrow_format(x.dtype()), narrow_format(y.dtype()));
    if sf >= 0 || df >= 0 {
        // The kernel is typed by the side that is not narrow (either, when both are).
        let other = if sf < 0 { x.dtype() } else { y.dtype() };
        let t = if narrow_format(other) < 0 {
            other
        } else {
            DType::U8
        };
        let args = [
            Arg::Ptr(x.p),
            Arg::Ptr(y.p),
            Arg::I64(n as i64),
            Arg::I32(sf),
            Arg::I32(df),
        ];
        return c.launch_n(&format!("narrow_cast_{}", suffix(t)), n, &args);
    }
    let name = format!("cast_{}_{}", suffix(x.dtype()), suffix(y.dtype()));
    c.launch_n(
        &name,
        n,
        &[Arg::Ptr(x.p), Arg::Ptr(y.p), Arg::I64(n as i64)],
    )
}

pub fn trilu(c: &Cuda, x: &V, k: Option<V>, upper: bool, y: &V) -> Result<()> {
    let n = y.numel();
    let r = x.shape().len();
    let (rows, cols) = (x.shape()[r - 2], x.shape()[r - 1]);
    // k (i64 or i32) is one number: read back rather than typed on the device.
    let k = match k {
        Some(k) => c.read(&k)?.to_i64_vec().first().copied().unwrap_or(0),
        None => 0,
    };
    let args = [
        Arg::Ptr(x.p),
        Arg::Ptr(y.p),
        Arg::I64(n as i64),
        Arg::I64(rows as i64),
        Arg::I64(cols.max(1) as i64),
        Arg::I64(k),
        Arg::I32(upper as i32),
    ];
    c.launch_n(&format!("trilu_{}", word(x.dtype())), n, &args)
}

/// A Random node's draw, the CPU's counter-based values (`common::random_value`); the
/// step's seed comes from the step number on the device, as Dropout's.
pub fn random(
    c: &Cuda,
    node: &Node,
    (normal, a, b): (bool, f32, f32),
    seed: Option<f64>,
    y: &V,
) -> Result<()> {
    if !y.dtype().is_float() {
        return Err(unsupported(node, y.dtype()));
    }
    let args = [
        Arg::Ptr(y.p),
        Arg::I64(y.numel() as i64),
        Arg::U64(common::base_seed(node, common::random_seed(seed))),
        Arg::Ptr(c.steps.step_ptr(&c.stream)),
        Arg::I32(normal as i32),
        Arg::F64(a as f64),
        Arg::F64(b as f64),
        Arg::I32(common::random_bits(y.dtype()) as i32),
    ];
    c.launch_n(&format!("random_{}", suffix(y.dtype())), y.numel(), &args)
}

/// Identity at inference; in training the CPU's counter-based mask, bit for bit.
#[allow(clippy::too_many_arguments)]
pub fn dropout(
    c: &Cuda,
    node: &Node,
    x: &V,
    ratio_in: Option<V>,
    mode_in: Option<V>,
    outs: &[V],
    ratio: f32,
    seed: Option<i64>,
) -> Result<()> {
    let first = |v: Option<V>| -> Result<Option<f64>> {
        Ok(match v {
            Some(v) => c.read(&v)?.to_f64_vec().first().copied(),
            None => None,
        })
    };
    let ratio = common::dropout_ratio(node, first(ratio_in)?.unwrap_or(ratio as f64))?;
    let training = c.step > 0 || first(mode_in)?.is_some_and(|v| v != 0.0);
    let (y, mask) = (&outs[0], outs.get(1));
    if !training || ratio == 0.0 {
        c.copy(y, x)?;
        if let Some(m) = mask {
            c.memset(m, 1)?;
        }
        return Ok(());
    }
    if !x.dtype().is_float() {
        return Err(unsupported(node, x.dtype()));
    }
    let base = common::base_seed(node, seed.map(|s| s as u64));
    // The step's own mask comes from the step number on the device (cuda/elementwise.cu
    // `step_seed`), so a recorded step draws a new mask each time it is replayed.
    let n = y.numel();
    let args = [
        Arg::Ptr(x.p),
        Arg::Ptr(y.p),
        Arg::Ptr(mask.map_or(0, |m| m.p)),
        Arg::I64(n as i64),
        Arg::U64(base),
        Arg::Ptr(c.steps.step_ptr(&c.stream)),
        Arg::F64(ratio),
        Arg::F64(1.0 / (1.0 - ratio)),
    ];
    c.launch_n(&format!("dropout_{}", suffix(x.dtype())), n, &args)
}
