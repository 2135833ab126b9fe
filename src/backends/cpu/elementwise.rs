//! Elementwise family: unary and binary maps with numpy broadcasting, Clip, Where,
//! Dropout, the Random draws, Trilu.

use super::simd;
use crate::backends::common;
use crate::error::Result;
use crate::graph::{BinaryOp, Node, UnaryOp};
use crate::rng::Rng;
use crate::tensor::{Bool, DType, Elem, Float, Real, Tensor};
use crate::{with_any, with_float, with_num};
use num_traits::Float as _;
use rayon::prelude::*;
use std::iter::repeat_n;

/// Outputs smaller than this run on the calling thread: rayon's hand-off costs more.
const PAR_MIN: usize = 1 << 15;
/// Elements per parallel task.
const CHUNK: usize = 1 << 14;

/// Arithmetic shared by every numeric dtype, so that Add, Clip, ReduceSum... are written
/// once: floats compute in their accumulation type, integers in i64 (u64 when
/// unsigned) and wrap on overflow as numpy does (never a debug-build panic).
pub(super) trait Num: Elem {
    type A: Copy + Send + Sync + PartialOrd + std::fmt::Debug;
    const INT: bool;
    fn load(self) -> Self::A;
    fn store(a: Self::A) -> Self;
    fn zero() -> Self::A;
    /// The identity of `max` (-inf, or the smallest integer).
    fn lowest() -> Self::A;
    fn count(n: usize) -> Self::A;
    fn add(a: Self::A, b: Self::A) -> Self::A;
    fn sub(a: Self::A, b: Self::A) -> Self::A;
    fn mul(a: Self::A, b: Self::A) -> Self::A;
    /// Integer division truncates toward zero; callers rule out a zero divisor first.
    fn div(a: Self::A, b: Self::A) -> Self::A;
    fn neg(a: Self::A) -> Self::A;
    /// `a ** e`; for an integer base with an integral exponent, exact integer power
    /// (callers rule out negative exponents first).
    fn pow(a: Self::A, e: f64) -> Self::A;
    /// The remainder of truncated division, with the dividend's sign (C's `fmod`; callers
    /// rule out an integer zero divisor first).
    fn rem(a: Self::A, b: Self::A) -> Self::A;
    /// The remainder with the divisor's sign (Python's `%`, numpy's `mod`).
    #[inline(always)]
    fn modulo(a: Self::A, b: Self::A) -> Self::A {
        let r = Self::rem(a, b);
        let z = Self::zero();
        if r != z && ((r < z) != (b < z)) {
            Self::add(r, b)
        } else {
            r
        }
    }
    /// NaN-propagating minimum, as numpy's `minimum`.
    #[inline(always)]
    fn min(a: Self::A, b: Self::A) -> Self::A {
        #[allow(clippy::eq_op)]
        if b < a || b != b {
            b
        } else {
            a
        }
    }
    /// NaN-propagating maximum, as numpy's `maximum`.
    #[inline(always)]
    fn max(a: Self::A, b: Self::A) -> Self::A {
        #[allow(clippy::eq_op)]
        if b > a || b != b {
            b
        } else {
            a
        }
    }
}

impl<T: Float> Num for T {
    type A = T::Acc;
    const INT: bool = false;
    #[inline(always)]
    fn load(self) -> T::Acc {
        self.to_acc()
    }
    #[inline(always)]
    fn store(a: T::Acc) -> T {
        T::from_acc(a)
    }
    fn zero() -> T::Acc {
        T::Acc::c(0.0)
    }
    fn lowest() -> T::Acc {
        T::Acc::neg_infinity()
    }
    fn count(n: usize) -> T::Acc {
        T::Acc::c(n as f64)
    }
    #[inline(always)]
    fn add(a: T::Acc, b: T::Acc) -> T::Acc {
        a + b
    }
    #[inline(always)]
    fn sub(a: T::Acc, b: T::Acc) -> T::Acc {
        a - b
    }
    #[inline(always)]
    fn mul(a: T::Acc, b: T::Acc) -> T::Acc {
        a * b
    }
    #[inline(always)]
    fn div(a: T::Acc, b: T::Acc) -> T::Acc {
        a / b
    }
    #[inline(always)]
    fn neg(a: T::Acc) -> T::Acc {
        -a
    }
    #[inline(always)]
    fn rem(a: T::Acc, b: T::Acc) -> T::Acc {
        a % b
    }
    fn pow(a: T::Acc, e: f64) -> T::Acc {
        a.powf(T::Acc::c(e))
    }
}

macro_rules! int_num {
    ($($t:ty => $a:ty),*) => {$(
        impl Num for $t {
            type A = $a;
            const INT: bool = true;
            #[inline(always)]
            fn load(self) -> $a {
                self as $a
            }
            #[inline(always)]
            fn store(a: $a) -> $t {
                a as $t
            }
            fn zero() -> $a {
                0
            }
            fn lowest() -> $a {
                <$t>::MIN as $a
            }
            fn count(n: usize) -> $a {
                n as $a
            }
            #[inline(always)]
            fn add(a: $a, b: $a) -> $a {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn sub(a: $a, b: $a) -> $a {
                a.wrapping_sub(b)
            }
            #[inline(always)]
            fn mul(a: $a, b: $a) -> $a {
                a.wrapping_mul(b)
            }
            #[inline(always)]
            fn div(a: $a, b: $a) -> $a {
                a.wrapping_div(b)
            }
            #[inline(always)]
            fn neg(a: $a) -> $a {
                a.wrapping_neg()
            }
            #[inline(always)]
            fn rem(a: $a, b: $a) -> $a {
                a.wrapping_rem(b)
            }
            fn pow(a: $a, e: f64) -> $a {
                if e.fract() == 0.0 && e >= 0.0 {
                    a.wrapping_pow(e.min(u32::MAX as f64) as u32)
                } else {
                    (a as f64).powf(e) as $a
                }
            }
        }
    )*};
}
// Signed integers compute in i64, unsigned in u64: wrapping there and narrowing on store
// is the same two's-complement result numpy gives in the narrow type.
int_num!(i64 => i64, i32 => i64, i16 => i64, i8 => i64, u64 => u64, u32 => u64, u16 => u64, u8 => u64);

// ---- parallel and broadcast walks ------------------------------------------------------

/// Runs `body(start, chunk)` over consecutive chunks of `out`, in parallel when large.
fn par_for<O: Send>(out: &mut [O], body: impl Fn(usize, &mut [O]) + Sync) {
    if out.len() < PAR_MIN {
        body(0, out);
    } else {
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(i, c)| body(i * CHUNK, c));
    }
}

/// How N broadcast operands are read while walking an output in row-major order: each
/// operand's element stride per output dim (0 where it is broadcast). Size-1 dims are
/// dropped and adjacent dims merged wherever every operand is contiguous across them,
/// so same-shape operands become one flat run and a scalar one stride-0 run.
pub(super) struct Bcast<const N: usize> {
    dims: Vec<usize>,
    strides: Vec<[usize; N]>,
}

impl<const N: usize> Bcast<N> {
    pub(super) fn new(out: &[usize], ins: [&[usize]; N]) -> Self {
        let r = out.len();
        let mut st = vec![[0usize; N]; r];
        for (k, s) in ins.iter().enumerate() {
            let off = r - s.len();
            let mut acc = 1;
            for d in (0..s.len()).rev() {
                st[off + d][k] = if s[d] == 1 { 0 } else { acc };
                acc *= s[d];
            }
        }
        let (mut dims, mut strides): (Vec<usize>, Vec<[usize; N]>) = (vec![], vec![]);
        for d in 0..r {
            if out[d] == 1 {
                continue;
            }
            if let (Some(pd), Some(ps)) = (dims.last_mut(), strides.last_mut()) {
                if (0..N).all(|k| ps[k] == st[d][k] * out[d]) {
                    *pd *= out[d];
                    *ps = st[d];
                    continue;
                }
            }
            dims.push(out[d]);
            strides.push(st[d]);
        }
        if dims.is_empty() {
            dims.push(1);
            strides.push([0; N]);
        }
        Bcast { dims, strides }
    }

    /// Operand strides along the innermost run.
    pub(super) fn inner(&self) -> [usize; N] {
        *self.strides.last().unwrap()
    }

    /// Calls `f(pos, len, offs)` for each innermost run covering output positions
    /// `start..start + len`: `pos` counts from `start`, `offs` are the operands' offsets
    /// of the run's first element, and the run continues with strides `self.inner()`.
    #[inline(always)]
    pub(super) fn walk(
        &self,
        start: usize,
        len: usize,
        mut f: impl FnMut(usize, usize, [usize; N]),
    ) {
        // offs += k * st, with k signed through wrapping (offsets never go negative).
        fn shift<const N: usize>(offs: &mut [usize; N], st: &[usize; N], k: isize) {
            for (o, s) in offs.iter_mut().zip(st) {
                *o = o.wrapping_add_signed(k * *s as isize);
            }
        }
        // An empty output has no runs; its zero dim must not reach the index arithmetic.
        if len == 0 {
            return;
        }
        let r = self.dims.len();
        let mut idx = vec![0; r];
        let mut offs = [0usize; N];
        let mut rem = start;
        for d in (0..r).rev() {
            idx[d] = rem % self.dims[d];
            rem /= self.dims[d];
            shift(&mut offs, &self.strides[d], idx[d] as isize);
        }
        let (inner, ist) = (self.dims[r - 1], self.inner());
        let mut pos = 0;
        while pos < len {
            let run = (inner - idx[r - 1]).min(len - pos);
            f(pos, run, offs);
            pos += run;
            idx[r - 1] += run;
            shift(&mut offs, &ist, run as isize);
            if idx[r - 1] < inner {
                continue;
            }
            // Carry into the outer dims.
            idx[r - 1] = 0;
            shift(&mut offs, &ist, -(inner as isize));
            for d in (0..r - 1).rev() {
                idx[d] += 1;
                shift(&mut offs, &self.strides[d], 1);
                if idx[d] < self.dims[d] {
                    break;
                }
                idx[d] = 0;
                shift(&mut offs, &self.strides[d], -(self.dims[d] as isize));
            }
        }
    }
}

/// `out[i] = f(x[i])`.
fn map1<I: Elem, O: Elem>(x: &Tensor, out: &mut Tensor, f: impl Fn(I) -> O + Sync) {
    let x = x.as_slice::<I>();
    par_for(out.as_mut_slice::<O>(), |start, o| {
        simd::vectorize(|| {
            for (o, &v) in o.iter_mut().zip(&x[start..]) {
                *o = f(v);
            }
        })
    });
}

/// `out = f(a, b)` with numpy broadcasting.
fn map2<A: Elem, B: Elem, O: Elem>(
    a: &Tensor,
    b: &Tensor,
    out: &mut Tensor,
    f: impl Fn(A, B) -> O + Sync,
) {
    let bc = Bcast::new(out.shape(), [a.shape(), b.shape()]);
    let [sa, sb] = bc.inner();
    let (a, b) = (a.as_slice::<A>(), b.as_slice::<B>());
    par_for(out.as_mut_slice::<O>(), |start, o| {
        simd::vectorize(|| {
            bc.walk(start, o.len(), |pos, n, [oa, ob]| {
                let o = &mut o[pos..pos + n];
                // The common stride patterns get their own loops so they vectorise.
                match (sa, sb) {
                    (1, 1) => o
                        .iter_mut()
                        .zip(&a[oa..oa + n])
                        .zip(&b[ob..ob + n])
                        .for_each(|((o, &x), &y)| *o = f(x, y)),
                    (1, 0) => o
                        .iter_mut()
                        .zip(&a[oa..oa + n])
                        .for_each(|(o, &x)| *o = f(x, b[ob])),
                    (0, 1) => o
                        .iter_mut()
                        .zip(&b[ob..ob + n])
                        .for_each(|(o, &y)| *o = f(a[oa], y)),
                    _ => o
                        .iter_mut()
                        .enumerate()
                        .for_each(|(i, o)| *o = f(a[oa + i * sa], b[ob + i * sb])),
                }
            })
        })
    });
}

// ---- kernels ------------------------------------------------------------------------

pub fn unary(op: UnaryOp, x: &Tensor, out: &mut Tensor) -> Result<()> {
    if op.takes_ints() && !x.dtype().is_float() {
        // Defined on every numeric dtype.
        return with_num!(x.dtype(), T => {
            sign_op::<T>(op, x, out);
            Ok(())
        }, _ => unsupported("unary", x.dtype()));
    }
    with_float!(x.dtype(), T => {
        unary_float::<T>(op, x, out);
        Ok(())
    }, _ => unsupported("unary", x.dtype()))
}

/// Neg, Abs, Relu and Sign on integers (wrapping negation, as numpy).
fn sign_op<T: Num>(op: UnaryOp, x: &Tensor, out: &mut Tensor) {
    let z = T::zero();
    match op {
        UnaryOp::Neg => map1(x, out, |v: T| T::store(T::neg(v.load()))),
        UnaryOp::Abs => map1(x, out, |v: T| {
            let v = v.load();
            T::store(if v < z { T::neg(v) } else { v })
        }),
        UnaryOp::Relu => map1(x, out, |v: T| {
            let v = v.load();
            T::store(if v < z { z } else { v })
        }),
        _ => {
            let (one, minus) = (T::count(1), T::neg(T::count(1)));
            map1(x, out, |v: T| {
                let v = v.load();
                T::store(if v < z {
                    minus
                } else if v > z {
                    one
                } else {
                    z
                })
            })
        }
    }
}

/// Scalar activation formulas, shared by the unary kernels and the FusedMatMul epilogue
/// so that fused and unfused graphs compute the same thing.
pub(super) mod act {
    use crate::tensor::Real;

    /// `min(max(v, 0), 6)`, NaN kept (Clip's order: the lower bound first).
    #[inline(always)]
    pub fn relu6<F: Real>(v: F) -> F {
        let v = if v < F::zero() { F::zero() } else { v };
        if v > F::c(6.0) {
            F::c(6.0)
        } else {
            v
        }
    }
    /// `x < 0` rather than `max(x, 0)` so that NaN propagates.
    #[inline(always)]
    pub fn relu<F: Real>(v: F) -> F {
        if v < F::zero() {
            F::zero()
        } else {
            v
        }
    }
    #[inline(always)]
    pub fn sigmoid<F: Real>(v: F) -> F {
        F::one() / (F::one() + (-v).exp_v())
    }
    #[inline(always)]
    pub fn silu<F: Real>(v: F) -> F {
        v / (F::one() + (-v).exp_v())
    }
    #[inline(always)]
    pub fn gelu<F: Real>(v: F) -> F {
        F::c(0.5) * v * (F::one() + (v * F::c(std::f64::consts::FRAC_1_SQRT_2)).erf_v())
    }
    #[inline(always)]
    pub fn gelu_tanh<F: Real>(v: F) -> F {
        let k = F::c((2.0 / std::f64::consts::PI).sqrt());
        F::c(0.5) * v * (F::one() + (k * (v + F::c(GELU_C) * v * v * v)).tanh_v())
    }
    const GELU_C: f64 = 0.044715;

    /// -1, 0 or 1 (NaN stays NaN).
    #[inline(always)]
    pub fn sign<F: Real>(v: F) -> F {
        if v > F::zero() {
            F::one()
        } else if v < F::zero() {
            -F::one()
        } else {
            v
        }
    }
    /// Rounds halves to even, as ONNX's Round (numpy's `round`).
    #[inline(always)]
    pub fn round_even<F: Real>(v: F) -> F {
        let r = v.round();
        if (v - v.trunc()).abs() == F::c(0.5) {
            F::c(2.0) * (v * F::c(0.5)).round()
        } else {
            r
        }
    }
    /// ln(1 + eˣ) without overflow: max(x, 0) + ln(1 + e^-|x|).
    #[inline(always)]
    pub fn softplus<F: Real>(v: F) -> F {
        v.max(F::zero()) + (-v.abs()).exp().ln_1p()
    }
    /// `d` where `lo < u < hi`, else 0: the derivative of a clamp.
    #[inline(always)]
    pub fn inside<F: Real>(u: F, lo: F, hi: F, d: F) -> F {
        if u > lo && u < hi {
            d
        } else {
            F::zero()
        }
    }
    /// HardSwish' = 0 below -3, 1 above 3, x/3 + 1/2 between (PyTorch's choice at the kinks).
    #[inline(always)]
    pub fn hard_swish_grad<F: Real>(dy: F, v: F) -> F {
        if v < F::c(-3.0) {
            F::zero()
        } else if v > F::c(3.0) {
            dy
        } else {
            dy * (v / F::c(3.0) + F::c(0.5))
        }
    }
    /// mish' = t + x·(1 - t²)·σ(x) with t = tanh(softplus(x)).
    #[inline(always)]
    pub fn mish_grad<F: Real>(dy: F, v: F) -> F {
        let t = softplus(v).tanh();
        dy * (t + v * (F::one() - t * t) * sigmoid(v))
    }
    /// d/dx x·σ(αx) = σ(αx) + αx·σ(αx)(1 - σ(αx)).
    #[inline(always)]
    pub fn swish_grad<F: Real>(dy: F, v: F, alpha: F) -> F {
        let s = sigmoid(alpha * v);
        flush(dy * s * (F::one() + alpha * v * (F::one() - s)))
    }

    // Backward: `dy · f'(x)` for each activation above (and tanh), shared by UnaryGrad and
    // FusedMatMulGrad.

    /// 1 inside (0, 6), where ReLU6 passes its input.
    #[inline(always)]
    pub fn relu6_grad<F: Real>(dy: F, v: F) -> F {
        if v > F::zero() && v < F::c(6.0) {
            dy
        } else {
            F::zero()
        }
    }
    /// A select rather than `dy · 0`, so that an infinite dy masked out gives 0, not NaN.
    #[inline(always)]
    pub fn relu_grad<F: Real>(dy: F, v: F) -> F {
        if v > F::zero() {
            dy
        } else {
            F::zero()
        }
    }
    /// Subnormal values flushed to 0. The tails of the sigmoid and gelu derivatives are
    /// full of them, and as GEMM operands (FusedMatMulGrad) they made it ~10× slower.
    #[inline(always)]
    fn flush<F: Real>(v: F) -> F {
        if v.abs() < F::min_positive_value() {
            F::zero()
        } else {
            v
        }
    }
    #[inline(always)]
    pub fn sigmoid_grad<F: Real>(dy: F, v: F) -> F {
        let s = sigmoid(v);
        flush(dy * s * (F::one() - s))
    }
    /// silu' = s + x·s·(1 - s) with s = sigmoid(x).
    #[inline(always)]
    pub fn silu_grad<F: Real>(dy: F, v: F) -> F {
        let s = sigmoid(v);
        flush(dy * s * (F::one() + v * (F::one() - s)))
    }
    #[inline(always)]
    pub fn tanh_grad<F: Real>(dy: F, v: F) -> F {
        let t = v.tanh_v();
        dy * (F::one() - t * t)
    }
    /// gelu' = Φ(x) + x·φ(x).
    #[inline(always)]
    pub fn gelu_grad<F: Real>(dy: F, v: F) -> F {
        let cdf = F::c(0.5) * (F::one() + (v * F::c(std::f64::consts::FRAC_1_SQRT_2)).erf_v());
        let pdf = F::c(0.5 * std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2)
            * (F::c(-0.5) * v * v).exp_v();
        flush(dy * (cdf + v * pdf))
    }
    /// With u = k(x + c·x³) and t = tanh(u): 0.5(1 + t) + 0.5·x·(1 - t²)·k(1 + 3c·x²).
    #[inline(always)]
    pub fn gelu_tanh_grad<F: Real>(dy: F, v: F) -> F {
        let k = F::c((2.0 / std::f64::consts::PI).sqrt());
        let x2 = v * v;
        let t = (k * (v + F::c(GELU_C) * x2 * v)).tanh_v();
        let du = k * (F::one() + F::c(3.0 * GELU_C) * x2);
        let half = F::c(0.5);
        dy * (half * (F::one() + t) + half * v * (F::one() - t * t) * du)
    }
}

/// One monomorphised loop per op (a shared loop over a `match` would not vectorise),
/// each op's formula from its row in `for_each_unary!`.
fn unary_float<T: Float>(op: UnaryOp, x: &Tensor, out: &mut Tensor) {
    macro_rules! fwd {
        ($( ($v:ident $({$($f:ident = $d:expr),*})?, $onnx:literal, $since:literal, $code:literal,
             $class:ident, |$x:ident| $fwd:expr, $($grad:tt)+) ),* $(,)?) => {
            match op {
                $( UnaryOp::$v $({ $($f),* })? => {
                    #[inline(always)]
                    fn f<F: Real>($x: F $($(, $f: F)*)?) -> F {
                        $fwd
                    }
                    $($(let $f = <T::Acc as Real>::c($f as f64);)*)?
                    map1(x, out, |v: T| T::from_acc(f(v.to_acc() $($(, $f)*)?)))
                } ),*
            }
        };
    }
    crate::graph::elementwise::for_each_unary!(fwd);
}

fn unsupported(what: &str, dt: DType) -> Result<()> {
    crate::bail!(Runtime, "CPU {what} kernel does not take dtype {dt}")
}

pub fn binary(op: BinaryOp, a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()> {
    use BinaryOp as B;
    match op {
        B::Equal => with_any!(a.dtype(), T => map2(a, b, out, |x: T, y: T| Bool::from(x == y))),
        B::Less => with_any!(a.dtype(), T => map2(a, b, out, |x: T, y: T| Bool::from(x < y))),
        B::Greater => with_any!(a.dtype(), T => map2(a, b, out, |x: T, y: T| Bool::from(x > y))),
        B::LessOrEqual => {
            with_any!(a.dtype(), T => map2(a, b, out, |x: T, y: T| Bool::from(x <= y)))
        }
        B::GreaterOrEqual => {
            with_any!(a.dtype(), T => map2(a, b, out, |x: T, y: T| Bool::from(x >= y)))
        }
        B::And => map2(a, b, out, |x: Bool, y: Bool| Bool::from(x.get() && y.get())),
        B::Or => map2(a, b, out, |x: Bool, y: Bool| Bool::from(x.get() || y.get())),
        B::Xor => map2(a, b, out, |x: Bool, y: Bool| Bool::from(x.get() != y.get())),
        B::Pow => {
            return with_num!(a.dtype(), T => with_num!(b.dtype(), E => pow::<T, E>(a, b, out),
                _ => unsupported("Pow", b.dtype())), _ => unsupported("Pow", a.dtype()))
        }
        B::Add | B::Sub | B::Mul | B::Div | B::Mod | B::Fmod | B::Min | B::Max | B::PRelu => {
            return with_num!(a.dtype(), T => arith::<T>(op, a, b, out), _ => unsupported("binary", a.dtype()))
        }
        B::BitwiseAnd | B::BitwiseOr | B::BitwiseXor | B::BitShiftLeft | B::BitShiftRight => {
            return crate::with_dtypes!(a.dtype(), T => bitwise::<T>(op, a, b, out),
                [I64 i64, I32 i32, I16 i16, I8 i8, U64 u64, U32 u32, U16 u16, U8 u8],
                _ => unsupported(op.onnx_name(), a.dtype()))
        }
    }
    Ok(())
}

/// The bitwise maps. A shift by the type's width or more gives 0 (all bits shifted out),
/// as numpy's shifts do.
fn bitwise<T: Elem + num_traits::PrimInt>(
    op: BinaryOp,
    a: &Tensor,
    b: &Tensor,
    out: &mut Tensor,
) -> Result<()> {
    use BinaryOp as B;
    let bits = T::zero().count_zeros() as u64;
    let amount = |s: T| s.to_u64().filter(|&s| s < bits).map(|s| s as usize);
    match op {
        B::BitwiseAnd => map2(a, b, out, |x: T, y: T| x & y),
        B::BitwiseOr => map2(a, b, out, |x: T, y: T| x | y),
        B::BitwiseXor => map2(a, b, out, |x: T, y: T| x ^ y),
        B::BitShiftLeft => map2(a, b, out, |x: T, s: T| {
            amount(s).map_or(T::zero(), |s| x << s)
        }),
        B::BitShiftRight => map2(a, b, out, |x: T, s: T| {
            amount(s).map_or(T::zero(), |s| x >> s)
        }),
        _ => unreachable!("not a bitwise op: {op:?}"),
    }
    Ok(())
}

fn arith<T: Num>(op: BinaryOp, a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()> {
    use BinaryOp as B;
    match op {
        B::Add => map2(a, b, out, |x: T, y: T| T::store(T::add(x.load(), y.load()))),
        B::Sub => map2(a, b, out, |x: T, y: T| T::store(T::sub(x.load(), y.load()))),
        B::Mul => map2(a, b, out, |x: T, y: T| T::store(T::mul(x.load(), y.load()))),
        B::Div | B::Mod | B::Fmod => {
            // Checked up front so the parallel loop cannot fail: every divisor element is
            // used unless the output is empty.
            if T::INT && out.numel() > 0 && b.as_slice::<T>().iter().any(|v| v.load() == T::zero())
            {
                crate::bail!(
                    Runtime,
                    "integer division by zero (divisor of shape {})",
                    crate::tensor::fmt_shape(b.shape())
                );
            }
            match op {
                B::Div => map2(a, b, out, |x: T, y: T| T::store(T::div(x.load(), y.load()))),
                B::Mod => map2(a, b, out, |x: T, y: T| {
                    T::store(T::modulo(x.load(), y.load()))
                }),
                _ => map2(a, b, out, |x: T, y: T| T::store(T::rem(x.load(), y.load()))),
            }
        }
        B::Min => map2(a, b, out, |x: T, y: T| T::store(T::min(x.load(), y.load()))),
        B::Max => map2(a, b, out, |x: T, y: T| T::store(T::max(x.load(), y.load()))),
        // x < 0 ? slope·x : x (NaN stays NaN).
        B::PRelu => map2(a, b, out, |x: T, s: T| {
            let x = x.load();
            T::store(if x < T::zero() {
                T::mul(s.load(), x)
            } else {
                x
            })
        }),
        _ => unreachable!("not an arithmetic op: {op:?}"),
    }
    Ok(())
}

/// Pow: the exponent may have another numeric dtype; the result has the base's.
fn pow<T: Num, E: Num>(a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()> {
    if T::INT && E::INT && out.numel() > 0 && b.as_slice::<E>().iter().any(|e| e.to_f64() < 0.0) {
        crate::bail!(
            Runtime,
            "integers to negative integer powers are not allowed"
        );
    }
    map2(a, b, out, |x: T, e: E| {
        T::store(T::pow(x.load(), e.to_f64()))
    });
    Ok(())
}

/// CumSum (CumProd with `prod`) along the axis `axis` names, in the accumulation type;
/// `[exclusive, reverse]` as the op's attributes.
pub fn cumulative(
    node: &Node,
    x: &Tensor,
    axis: &Tensor,
    prod: bool,
    [excl, rev]: [bool; 2],
    out: &mut Tensor,
) -> Result<()> {
    let ax = axis.to_i64_vec().first().copied().unwrap_or(0);
    let (outer, d, inner) = common::line_dims(node, x.shape(), ax)?;
    with_num!(x.dtype(), T => {
        let (src, dst) = (x.as_slice::<T>(), out.as_mut_slice::<T>());
        let (init, step) = if prod {
            (T::count(1), T::mul as fn(_, _) -> _)
        } else {
            (T::zero(), T::add as fn(_, _) -> _)
        };
        for o in 0..outer {
            for i in 0..inner {
                let mut acc = init;
                for s in 0..d {
                    let j = if rev { d - 1 - s } else { s };
                    let at = (o * d + j) * inner + i;
                    let v = src[at].load();
                    if !excl {
                        acc = step(acc, v);
                    }
                    dst[at] = T::store(acc);
                    if excl {
                        acc = step(acc, v);
                    }
                }
            }
        }
        Ok(())
    }, _ => unsupported(node.op.name(), x.dtype()))
}

/// Range: `start + i·delta`, computed in the dtype's accumulation type (integers wrap).
pub fn range(start: &Tensor, delta: &Tensor, out: &mut Tensor) -> Result<()> {
    with_num!(out.dtype(), T => {
        let (s, d) = (start.as_slice::<T>()[0].load(), delta.as_slice::<T>()[0].load());
        for (i, o) in out.as_mut_slice::<T>().iter_mut().enumerate() {
            *o = T::store(T::add(s, T::mul(T::count(i), d)));
        }
        Ok(())
    }, _ => unsupported("Range", out.dtype()))
}

pub fn clip(
    x: &Tensor,
    min: Option<&Tensor>,
    max: Option<&Tensor>,
    out: &mut Tensor,
) -> Result<()> {
    with_num!(x.dtype(), T => {
        let bound = |t: Option<&Tensor>| t.map(|t| t.as_slice::<T>()[0].load());
        let (lo, hi) = (bound(min), bound(max));
        // Min first, then max: with min > max every value becomes max, as ONNX says; NaN
        // stays NaN (every comparison with it is false). Each bound case is its own
        // branch-free loop, so it vectorises (ReLU6 in MobileNet runs it on every
        // activation).
        match (lo, hi) {
            (Some(lo), Some(hi)) => map1(x, out, |v: T| {
                let v = v.load();
                let v = if v < lo { lo } else { v };
                T::store(if v > hi { hi } else { v })
            }),
            (Some(lo), None) => map1(x, out, |v: T| {
                let v = v.load();
                T::store(if v < lo { lo } else { v })
            }),
            (None, Some(hi)) => map1(x, out, |v: T| {
                let v = v.load();
                T::store(if v > hi { hi } else { v })
            }),
            (None, None) => map1(x, out, |v: T| v),
        }
        Ok(())
    }, _ => unsupported("Clip", x.dtype()))
}

pub fn where_(c: &Tensor, a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()> {
    let bc = Bcast::new(out.shape(), [c.shape(), a.shape(), b.shape()]);
    let [sc, sa, sb] = bc.inner();
    let cond = c.bool_bytes();
    with_any!(a.dtype(), T => {
        let (a, b) = (a.as_slice::<T>(), b.as_slice::<T>());
        par_for(out.as_mut_slice::<T>(), |start, o| {
            bc.walk(start, o.len(), |pos, n, [oc, oa, ob]| {
                let o = &mut o[pos..pos + n];
                // Unit-stride and broadcast-scalar runs get plain zipped loops.
                let (c, x, y) = (&cond[oc..], &a[oa..], &b[ob..]);
                match (sc, sa, sb) {
                    (1, 1, 1) => select(o, c[..n].iter(), x[..n].iter(), y[..n].iter()),
                    (1, 1, 0) => select(o, c[..n].iter(), x[..n].iter(), repeat_n(&y[0], n)),
                    (1, 0, 1) => select(o, c[..n].iter(), repeat_n(&x[0], n), y[..n].iter()),
                    (0, 1, 1) => select(o, repeat_n(&c[0], n), x[..n].iter(), y[..n].iter()),
                    _ => select(o, (0..n).map(|i| &c[i * sc]), (0..n).map(|i| &x[i * sa]), (0..n).map(|i| &y[i * sb])),
                }
            })
        })
    });
    Ok(())
}

/// Branch-free: a random mask would make a branch mispredict half the time.
#[inline(always)]
fn select<'a, T: Copy + 'a>(
    o: &mut [T],
    c: impl Iterator<Item = &'a u8>,
    a: impl Iterator<Item = &'a T>,
    b: impl Iterator<Item = &'a T>,
) {
    for (((o, &c), &x), &y) in o.iter_mut().zip(c).zip(a).zip(b) {
        *o = std::hint::select_unpredictable(c != 0, x, y);
    }
}

/// Rotary, or with `transposed` its gradient RotaryGrad (see `Op::Rotary`): y[i] =
/// x[i]·c[i] + sgn(i)·x[p]·s[i], transposed y[i] = x[i]·c[i] − sgn(i)·x[p]·s[p], where p
/// is i's partner on the last axis and sgn is −1 for the pair's first element. The last
/// axis lies within one run of the walk (runs merge whole trailing dims), so the
/// partner's Sin is at the same run's stride.
pub fn rotary(
    [x, cos, sin]: [&Tensor; 3],
    interleaved: bool,
    transposed: bool,
    out: &mut Tensor,
) -> Result<()> {
    let d = x.shape().last().copied().unwrap_or(2);
    let (half, step) = if interleaved { (0, 1) } else { (d / 2, d / 2) };
    let bc = Bcast::new(out.shape(), [cos.shape(), sin.shape()]);
    let [sc, ss] = bc.inner();
    with_float!(x.dtype(), T => {
        let (xs, c, s) = (x.as_slice::<T>(), cos.as_slice::<T>(), sin.as_slice::<T>());
        par_for(out.as_mut_slice::<T>(), |start, o| {
            bc.walk(start, o.len(), |pos, n, [oc, os]| {
                for t in 0..n {
                    let i = start + pos + t;
                    let j = i % d;
                    let first = if interleaved { j % 2 == 0 } else { j < half };
                    let p = if first { i + step } else { i - step };
                    let si = match transposed {
                        false => os + t * ss,
                        true => (os + t * ss).wrapping_add_signed((p as isize - i as isize) * ss as isize),
                    };
                    let r = xs[p].to_acc() * s[si].to_acc();
                    let v = xs[i].to_acc() * c[oc + t * sc].to_acc();
                    o[pos + t] = T::from_acc(if first != transposed { v - r } else { v + r });
                }
            })
        })
    }, _ => return unsupported("Rotary", x.dtype()));
    Ok(())
}

/// Identity at inference; in training a mask seeded by `seed` (or the node name).
pub fn dropout(
    node: &Node,
    ins: &[Option<&Tensor>],
    outs: &mut [Tensor],
    ratio: f32,
    seed: Option<i64>,
    step: u64,
) -> Result<()> {
    let input = |i: usize| ins.get(i).copied().flatten();
    let Some(x) = input(0) else {
        crate::bail!(Runtime, "{}: input 0 (data) is missing", node.describe())
    };
    // Scalars read leniently: an empty tensor is a missing value, not a panic.
    let first = |i: usize| input(i).and_then(|t| t.to_f64_vec().first().copied());
    let ratio = common::dropout_ratio(node, first(1).unwrap_or(ratio as f64))?;
    let training = step > 0 || first(2).is_some_and(|v| v != 0.0);
    let (y, mask) = outs.split_at_mut(1);
    let y = &mut y[0];
    if !training || ratio == 0.0 {
        y.bytes_mut().copy_from_slice(x.bytes());
        if let Some(m) = mask.first_mut() {
            m.bytes_mut().fill(1);
        }
        return Ok(());
    }
    // Counter-based: element i's draw depends only on (seed, i), so the mask is the same
    // however the work is split, and other backends can reproduce it.
    let base = common::step_seed(common::base_seed(node, seed.map(|s| s as u64)), step);
    let keep = |i: usize| Rng::new(base.wrapping_add(i as u64)).uniform() >= ratio;
    with_float!(x.dtype(), T => dropout_mask::<T>(x, y, keep, ratio), _ => return unsupported("Dropout", x.dtype()));
    if let Some(m) = mask.first_mut() {
        par_for(m.bool_bytes_mut(), |start, o| {
            for (i, o) in o.iter_mut().enumerate() {
                *o = keep(start + i) as u8;
            }
        });
    }
    Ok(())
}

/// A Random node's draw (`common::random_value`), element by element in parallel: each
/// element's value depends only on (seed, index), so any split of the work agrees.
pub fn random(
    node: &Node,
    (normal, a, b): (bool, f32, f32),
    seed: Option<f64>,
    step: u64,
    out: &mut Tensor,
) -> Result<()> {
    let base = common::step_seed(common::base_seed(node, common::random_seed(seed)), step);
    let bits = common::random_bits(out.dtype());
    let (a, b) = (a as f64, b as f64);
    let draw = |i: usize| common::random_value(normal, a, b, base, i as u64, bits);
    with_float!(out.dtype(), T => fill::<T>(out, draw), _ => return unsupported("Random", out.dtype()));
    Ok(())
}

/// Element i of `out` = `draw(i)`, rounded to T.
fn fill<T: Float>(out: &mut Tensor, draw: impl Fn(usize) -> f64 + Sync) {
    par_for(out.as_mut_slice::<T>(), |start, o| {
        for (i, o) in o.iter_mut().enumerate() {
            *o = T::from_acc(T::Acc::c(draw(start + i)));
        }
    });
}

fn dropout_mask<T: Float>(
    x: &Tensor,
    y: &mut Tensor,
    keep: impl Fn(usize) -> bool + Sync,
    ratio: f64,
) {
    let scale = T::Acc::c(1.0 / (1.0 - ratio));
    let xs = x.as_slice::<T>();
    par_for(y.as_mut_slice::<T>(), |start, o| {
        for (i, o) in o.iter_mut().enumerate() {
            let v = if keep(start + i) {
                xs[start + i].to_acc() * scale
            } else {
                T::Acc::c(0.0)
            };
            *o = T::from_acc(v);
        }
    });
}

/// Keeps the upper (j - i >= k) or lower (j - i <= k) triangle of every trailing matrix.
pub fn trilu(x: &Tensor, k: Option<&Tensor>, upper: bool, out: &mut Tensor) -> Result<()> {
    let k = k.map(|t| t.to_i64_vec()[0]).unwrap_or(0);
    let r = x.shape().len();
    let (rows, cols) = (x.shape()[r - 2], x.shape()[r - 1]);
    if out.numel() == 0 {
        return Ok(());
    }
    with_any!(x.dtype(), T => {
        let xs = x.as_slice::<T>();
        out.as_mut_slice::<T>().par_chunks_mut(cols).zip(xs.par_chunks(cols)).enumerate().with_min_len(64).for_each(
            |(row, (o, x))| {
                let i = (row % rows) as i64;
                for (j, (o, &v)) in o.iter_mut().zip(x).enumerate() {
                    let d = j as i64 - i;
                    *o = if (upper && d >= k) || (!upper && d <= k) { v } else { bytemuck::Zeroable::zeroed() };
                }
            },
        )
    });
    Ok(())
}

#[allow(dead_code)] // kept for stub kernels still being written
pub(crate) fn todo_kernel(what: &str) -> Result<()> {
    crate::bail!(Runtime, "CPU kernel '{what}' is not written yet")
}

/// `dX = dY * f'(X)` for a unary op, computed in the accumulation type.
pub fn unary_grad(op: UnaryOp, dy: &Tensor, x: &Tensor, out: &mut Tensor) -> Result<()> {
    with_float!(x.dtype(), T => unary_grad_float::<T>(op, dy, x, out),
        _ => unsupported("unary gradient", x.dtype()))
}

/// `dy · f'(x)` from each differentiable op's row in `for_each_unary!`.
fn unary_grad_float<T: Float>(
    op: UnaryOp,
    dy: &Tensor,
    x: &Tensor,
    out: &mut Tensor,
) -> Result<()> {
    macro_rules! bwd {
        ($( ($v:ident $({$($f:ident = $d:expr),*})?, $onnx:literal, $since:literal, $code:literal,
             $class:ident, |$x:ident| $fwd:expr, $($grad:tt)+) ),* $(,)?) => {
            match op {
                $( UnaryOp::$v $({ $($f),* })? => {
                    $($(let $f = <T::Acc as Real>::c($f as f64);)*)?
                    bwd!(@grad [$($($f)*)?] $($grad)+)
                } ),*
            }
        };
        (@grad [$($f:ident)*] none) => {{
            $(let _ = $f;)*
            crate::bail!(Runtime, "{} has no gradient (its derivative is zero wherever it exists)", op.onnx_name())
        }};
        (@grad [$($f:ident)*] |$g:ident, $gv:ident| $e:expr) => {{
            #[inline(always)]
            #[allow(unused_variables)]
            fn f<F: Real>($g: F, $gv: F $(, $f: F)*) -> F {
                $e
            }
            map2(dy, x, out, |g: T, v: T| T::from_acc(f(g.to_acc(), v.to_acc() $(, $f)*)));
            Ok(())
        }};
    }
    crate::graph::elementwise::for_each_unary!(bwd)
}
