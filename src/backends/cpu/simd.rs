//! Kernels compiled for the vector instructions the CPU has, chosen at run time.
//!
//! The crate is built for its target's baseline (x86-64: SSE2 and no fused multiply-add),
//! so a plain loop vectorises 4 wide at most. [`dispatch`] runs a [`Kernel`] inside a
//! function compiled for the best level `pulp` finds on this CPU (x86-64: AVX-512 or
//! AVX2+FMA; aarch64: NEON), so its loops, written over plain slices and fixed-size arrays
//! with every callee `#[inline(always)]`, vectorise to that width.

use crate::tensor::Real;

/// A computation to run with the CPU's best vector instructions. `FMA` says whether
/// `a.mul_add(b, c)` is one instruction there (on the baseline it is a library call per
/// element, so kernels write `a * b + c` instead: see [`madd`]).
pub(crate) trait Kernel {
    type Output;
    fn run<const FMA: bool>(self) -> Self::Output;
}

struct Run<K>(K);
impl<K: Kernel> pulp::WithSimd for Run<K> {
    type Output = K::Output;
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) -> K::Output {
        if S::IS_SCALAR {
            self.0.run::<false>()
        } else {
            self.0.run::<true>()
        }
    }
}

/// Runs `k` compiled for the best instruction set this CPU has.
pub(crate) fn dispatch<K: Kernel>(k: K) -> K::Output {
    pulp::Arch::new().dispatch(Run(k))
}

/// Runs `f` compiled for the best instruction set this CPU has, for loops whose speed
/// does not hinge on fused multiply-add (elementwise maps). Only a small closure is
/// reliably inlined into the compiled function; a large body belongs in a [`Kernel`].
#[inline(always)]
pub(crate) fn vectorize<R>(f: impl FnOnce() -> R) -> R {
    pulp::Arch::new().dispatch(f)
}

/// `a·b + c`, fused where the instruction exists.
#[inline(always)]
pub(crate) fn madd<A: Real, const FMA: bool>(a: A, b: A, c: A) -> A {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}
