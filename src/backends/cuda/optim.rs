//! Optimizer steps on CUDA (cuda/optimizer.cu): SGD with momentum, Adam, AdamW, with the
//! CPU backend's rules and constants (src/backends/cpu/optim.rs).

use super::device::{suffix, Arg};
use super::Cuda;
use crate::error::Result;
use crate::graph::infer::ValueType;
use crate::graph::{Optimizer, StepScalars};
use crate::tensor::DType;

/// cuda/optimizer.cu `SgdTensors`: up to `SGD_MAX` parameters of one SGD launch.
const SGD_MAX: usize = 16;
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SgdTensors {
    p: [u64; SGD_MAX],
    g: [u64; SGD_MAX],
    buf: [u64; SGD_MAX],
    end: [i64; SGD_MAX],
    slot: [u32; SGD_MAX],
    count: i32,
}
// Safety: plain old data laid out as the C struct.
unsafe impl cudarc::driver::DeviceRepr for SgdTensors {}

/// SGD updates of one step, held back so that those with the same dtype and scalars go
/// out as one `sgd_multi` launch per `SGD_MAX` parameters (as PyTorch's foreach SGD):
/// (dtype, lr, momentum, weight decay) → (param, grad, momentum buffer, elements).
#[derive(Default)]
pub struct Pending(Vec<(SgdKey, [u64; 3], i64, u32)>);
type SgdKey = (DType, [u64; 3]);

pub fn flush(c: &mut Cuda) -> Result<()> {
    let mut todo = std::mem::take(&mut c.sgd.0);
    // Group by dtype and scalars, keeping the order the executor issued them in.
    while let Some(&(key, ..)) = todo.first() {
        let (same, rest): (Vec<_>, Vec<_>) = todo.into_iter().partition(|x| x.0 == key);
        todo = rest;
        let (dt, [lr, mu, wd]) = key;
        for chunk in same.chunks(SGD_MAX) {
            let mut t = SgdTensors {
                p: [0; SGD_MAX],
                g: [0; SGD_MAX],
                buf: [0; SGD_MAX],
                end: [0; SGD_MAX],
                slot: [0; SGD_MAX],
                count: chunk.len() as i32,
            };
            let mut total = 0i64;
            for (k, (_, [p, g, b], n, slot)) in chunk.iter().enumerate() {
                total += n;
                (t.p[k], t.g[k], t.buf[k], t.end[k], t.slot[k]) = (*p, *g, *b, total, *slot);
            }
            let args = [
                Arg::Sgd(Box::new(t)),
                Arg::F64(f64::from_bits(lr)),
                Arg::F64(f64::from_bits(mu)),
                Arg::F64(f64::from_bits(wd)),
                Arg::Ptr(c.nonfinite_ptr()),
            ];
            c.launch_n(&format!("sgd_multi_{}", suffix(dt)), total as usize, &args)?;
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub fn update(
    c: &mut Cuda,
    opt: &Optimizer,
    t: u64,
    param: u64,
    grad: u64,
    state: &[u64],
    ty: &ValueType,
    slot: u32,
) -> Result<()> {
    if !ty.dtype.is_float() {
        crate::bail!(Runtime, "cannot train a {} parameter", ty.dtype);
    }
    let n = ty.numel();
    let sfx = suffix(ty.dtype);
    match opt.step_scalars(t) {
        StepScalars::Sgd {
            lr,
            momentum,
            weight_decay,
        } => {
            let buf = state.first().copied().unwrap_or(0);
            if n > 0 {
                let key = (ty.dtype, [lr, momentum, weight_decay].map(f64::to_bits));
                c.sgd.0.push((key, [param, grad, buf], n as i64, slot));
            }
            Ok(())
        }
        StepScalars::Adam {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            decoupled,
            decay,
            ..
        } => {
            let [m, v] = state else {
                crate::bail!(Runtime, "Adam keeps two state buffers, got {}", state.len());
            };
            // t from the device's step word when it is this step (so that a recorded step
            // stays right as t grows); otherwise by value, and the step is not recorded.
            let tp = if t == c.step {
                c.steps.step_ptr(&c.stream)
            } else {
                c.steps.mark_unrecordable();
                0
            };
            let args = [
                Arg::Ptr(param),
                Arg::Ptr(grad),
                Arg::Ptr(*m),
                Arg::Ptr(*v),
                Arg::I64(n as i64),
                Arg::Ptr(tp),
                Arg::U64(t),
                Arg::F64(lr),
                Arg::F64(beta1),
                Arg::F64(beta2),
                Arg::F64(eps),
                Arg::F64(weight_decay),
                Arg::F64(decay),
                Arg::I32(decoupled as i32),
                Arg::Ptr(c.nonfinite_ptr()),
                Arg::I32(slot as i32),
            ];
            c.launch_n(&format!("adam_{sfx}"), n, &args)
        }
    }
}

/// `Backend::accumulate` (cuda/optimizer.cu `accumulate`): `acc = scale·grad` when
/// `first`, else `acc += scale·grad`. Held-back SGD updates go out first, so the order
/// is the executor's.
pub fn accumulate(
    c: &mut Cuda,
    acc: u64,
    grad: u64,
    ty: &ValueType,
    scale: f64,
    first: bool,
) -> Result<()> {
    if !ty.dtype.is_float() {
        crate::bail!(Runtime, "cannot accumulate a {} gradient", ty.dtype);
    }
    flush(c)?;
    let n = ty.numel();
    if n == 0 {
        return Ok(());
    }
    let args = [
        Arg::Ptr(acc),
        Arg::Ptr(grad),
        Arg::I64(n as i64),
        Arg::F64(scale),
        Arg::I32(first as i32),
    ];
    c.launch_n(&format!("accumulate_{}", suffix(ty.dtype)), n, &args)
}
