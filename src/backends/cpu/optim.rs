//! Optimizer steps (SGD with momentum, Adam, AdamW) on host parameters, in place, with
//! PyTorch's update rules. State is kept in f32 (f64 for f64 parameters), so half
//! precision parameters still accumulate their moments accurately.

use crate::error::Result;
use crate::graph::{Optimizer, StepScalars};
use crate::tensor::{Float, Real, Tensor};

use num_traits::Float as _;
use rayon::prelude::*;

/// Updates `param` in place; false when a new value is NaN or infinite.
pub fn update(
    opt: &Optimizer,
    t: u64,
    param: &mut Tensor,
    grad: &Tensor,
    state: &mut [Tensor],
) -> Result<bool> {
    matches(grad, param, "the parameter")?;
    crate::with_float!(param.dtype(), T => Ok(step::<T>(opt, t, param, grad, state)),
        _ => Err(crate::err!(Runtime, "cannot train a {} parameter", param.dtype())))
}

/// A gradient must have the dtype and shape of what it updates (`what`).
fn matches(grad: &Tensor, other: &Tensor, what: &str) -> Result<()> {
    if grad.dtype() != other.dtype() || grad.shape() != other.shape() {
        crate::bail!(
            Runtime,
            "gradient {}{} does not match {what} {}{}",
            grad.dtype(),
            crate::tensor::fmt_shape(grad.shape()),
            other.dtype(),
            crate::tensor::fmt_shape(other.shape())
        );
    }
    Ok(())
}

/// Elements per parallel task.
const CHUNK: usize = 1 << 14;

/// The update; false when a new value (as stored, in T) is not finite.
fn step<T: Float>(
    opt: &Optimizer,
    t: u64,
    param: &mut Tensor,
    grad: &Tensor,
    state: &mut [Tensor],
) -> bool
where
    T::Acc: crate::tensor::Elem,
{
    let c = |v: f64| T::Acc::c(v);
    let g = grad.as_slice::<T>();
    let p = param.as_mut_slice::<T>();
    match opt.step_scalars(t) {
        StepScalars::Sgd {
            lr,
            momentum,
            weight_decay,
        } => {
            let (lr, mu, wd) = (c(lr), c(momentum), c(weight_decay));
            let mut buf = state.first_mut().map(|b| b.as_mut_slice::<T::Acc>());
            // Each returns whether the new value is finite (folded per chunk with &, not
            // a short-circuiting `all`, so every element is updated).
            let one = |p: &mut T, g: T, b: Option<&mut T::Acc>| {
                let pv = p.to_acc();
                let mut d = g.to_acc() + wd * pv;
                if let Some(b) = b {
                    *b = mu * *b + d;
                    d = *b;
                }
                *p = T::from_acc(pv - lr * d);
                p.to_acc().is_finite()
            };
            match buf.as_mut() {
                Some(b) => p
                    .par_chunks_mut(CHUNK)
                    .zip(g.par_chunks(CHUNK))
                    .zip(b.par_chunks_mut(CHUNK))
                    .map(|((p, g), b)| {
                        let mut ok = true;
                        for ((p, g), b) in p.iter_mut().zip(g).zip(b) {
                            ok &= one(p, *g, Some(b));
                        }
                        ok
                    })
                    .reduce(|| true, |a, b| a & b),
                None => p
                    .par_chunks_mut(CHUNK)
                    .zip(g.par_chunks(CHUNK))
                    .map(|(p, g)| {
                        let mut ok = true;
                        for (p, g) in p.iter_mut().zip(g) {
                            ok &= one(p, *g, None);
                        }
                        ok
                    })
                    .reduce(|| true, |a, b| a & b),
            }
        }
        StepScalars::Adam {
            beta1,
            beta2,
            eps,
            weight_decay,
            decoupled,
            step_size,
            sqrt_bc2,
            decay,
            ..
        } => {
            // PyTorch: p -= lr/bc1 · m / (sqrt(v)/sqrt(bc2) + eps).
            let (step_size, sq_bc2) = (c(step_size), c(sqrt_bc2));
            let (b1, b2, eps, wd) = (c(beta1), c(beta2), c(eps), c(weight_decay));
            let decay = c(decay);
            let (m, v) = state.split_at_mut(1);
            let (m, v) = (m[0].as_mut_slice::<T::Acc>(), v[0].as_mut_slice::<T::Acc>());
            let one = c(1.0);
            p.par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
                .map(|((p, g), (m, v))| {
                    let mut ok = true;
                    for (((p, g), m), v) in p.iter_mut().zip(g).zip(m).zip(v) {
                        let mut pv = p.to_acc();
                        let mut gv = g.to_acc();
                        if decoupled {
                            pv = pv * decay;
                        } else {
                            gv = gv + wd * pv;
                        }
                        *m = b1 * *m + (one - b1) * gv;
                        *v = b2 * *v + (one - b2) * gv * gv;
                        pv = pv - step_size * *m / ((*v).sqrt() / sq_bc2 + eps);
                        *p = T::from_acc(pv);
                        ok &= p.to_acc().is_finite();
                    }
                    ok
                })
                .reduce(|| true, |a, b| a & b)
        }
    }
}

/// Gradient accumulation: `acc = scale·grad` when `first`, else `acc += scale·grad`, in
/// the gradient's dtype (as PyTorch's `.grad` accumulates), each sum rounded once from the
/// accumulating type.
pub fn accumulate(acc: &mut Tensor, grad: &Tensor, scale: f64, first: bool) -> Result<()> {
    matches(grad, acc, "its accumulator")?;
    crate::with_float!(grad.dtype(), T => {
        accumulate_as::<T>(acc, grad, scale, first);
        Ok(())
    }, _ => Err(crate::err!(Runtime, "cannot accumulate a {} gradient", grad.dtype())))
}

fn accumulate_as<T: Float>(acc: &mut Tensor, grad: &Tensor, scale: f64, first: bool)
where
    T::Acc: crate::tensor::Elem,
{
    let s = T::Acc::c(scale);
    let g = grad.as_slice::<T>();
    acc.as_mut_slice::<T>()
        .par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .for_each(|(a, g)| {
            for (a, g) in a.iter_mut().zip(g) {
                let v = s * g.to_acc();
                *a = T::from_acc(if first { v } else { a.to_acc() + v });
            }
        });
}
