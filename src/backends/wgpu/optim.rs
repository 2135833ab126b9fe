//! Optimizer steps on wgpu (shaders/optimizer.wgsl): SGD (with momentum), Adam, AdamW in
//! place, the CPU's rules (src/backends/cpu/optim.rs) with f32 state.

use super::device::{groups_for, Family};
use super::{float_defs, Params, Wgpu};
use crate::error::Result;
use crate::graph::infer::ValueType;
use crate::graph::{Node, Op, Optimizer, StepScalars};

#[allow(clippy::too_many_arguments)]
pub fn update(
    w: &mut Wgpu,
    opt: &Optimizer,
    t: u64,
    param: &mut wgpu::Buffer,
    grad: &wgpu::Buffer,
    state: &mut [wgpu::Buffer],
    ty: &ValueType,
    slot: u32,
) -> Result<()> {
    let n = ty.numel();
    let mut p = Params::new().u(0, n).u(10, slot as usize);
    match opt.step_scalars(t) {
        StepScalars::Sgd {
            lr,
            momentum,
            weight_decay,
        } => {
            p = p
                .u(1, (momentum != 0.0) as usize)
                .f(2, lr as f32)
                .f(3, momentum as f32)
                .f(6, weight_decay as f32);
        }
        StepScalars::Adam {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            decoupled,
            step_size,
            sqrt_bc2,
            decay,
        } => {
            p = p
                .u(1, if decoupled { 3 } else { 2 })
                .f(2, lr as f32)
                .f(3, beta1 as f32)
                .f(4, beta2 as f32)
                .f(5, eps as f32)
                .f(6, weight_decay as f32)
                .f(7, step_size as f32)
                .f(8, sqrt_bc2 as f32)
                .f(9, decay as f32);
        }
    }
    let st = (state.first(), state.get(1));
    run_step(w, ("train", "parameter"), ty, &p, param, grad, st)
}

/// `Backend::accumulate`: the step kernel's kind 4 (acc = scale·grad, or += unless first).
pub fn accumulate(
    w: &mut Wgpu,
    acc: &mut wgpu::Buffer,
    grad: &wgpu::Buffer,
    ty: &ValueType,
    scale: f64,
    first: bool,
) -> Result<()> {
    if ty.numel() == 0 {
        return Ok(());
    }
    let p = Params::new()
        .u(0, ty.numel())
        .u(1, 4)
        .f(2, scale as f32)
        .u(11, first as usize);
    run_step(
        w,
        ("accumulate", "gradient"),
        ty,
        &p,
        acc,
        grad,
        (None, None),
    )
}

/// The step kernel over `ty`'s elements of `param` (an accumulator for kind 4) and
/// `grad`, with the state buffers it has (scratch stands in for the others). `what`
/// (verb, noun: "train", "parameter") says what the dtype is refused for.
fn run_step(
    w: &mut Wgpu,
    what: (&str, &str),
    ty: &ValueType,
    p: &Params,
    param: &wgpu::Buffer,
    grad: &wgpu::Buffer,
    state: (Option<&wgpu::Buffer>, Option<&wgpu::Buffer>),
) -> Result<()> {
    // Errors name the optimizer step as a node would be named.
    let node = Node {
        name: "optimizer".into(),
        op: Op::Identity,
        inputs: vec![],
        outputs: vec![],
        loc: None,
    };
    let defs = float_defs(w, &node, ty.dtype).map_err(|_| {
        let (verb, noun) = what;
        crate::err!(
            Runtime,
            "cannot {verb} a {} {noun} on the wgpu backend",
            ty.dtype
        )
    })?;
    let (s0, s1) = (w.scratch(16), w.scratch(16));
    let k = Wgpu::kernel(Family::Optimizer, "step", defs);
    w.run_kernel(
        &k,
        p,
        &[
            (1, param),
            (2, grad),
            (3, state.0.unwrap_or(&s0)),
            (4, state.1.unwrap_or(&s1)),
            (5, &w.nonfinite.clone()),
        ],
        groups_for(ty.numel(), 256),
    )
}
