//! Optimizer steps on CUDA (cuda/optimizer.cu): SGD with momentum, Adam, AdamW, with the
//! CPU backend's rules and constants (src/backends/cpu/optim.rs).

use super::device::{suffix, Arg};
use super::Cuda;
use crate::error::Result;
use crate::graph::infer::ValueType;
use crate::graph::{Optimizer, StepScalars};

pub fn update(
    c: &Cuda,
    opt: &Optimizer,
    t: u64,
    param: u64,
    grad: u64,
    state: &[u64],
    ty: &ValueType,
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
            let args = [
                Arg::Ptr(param),
                Arg::Ptr(grad),
                Arg::Ptr(buf),
                Arg::I64(n as i64),
                Arg::F64(lr),
                Arg::F64(momentum),
                Arg::F64(weight_decay),
            ];
            c.launch_n(&format!("sgd_{sfx}"), n, &args)
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
            ];
            c.launch_n(&format!("adam_{sfx}"), n, &args)
        }
    }
}
