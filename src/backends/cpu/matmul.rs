//! Matrix products on the `gemm` crate (multi-threaded): MatMul (batched, broadcasting),
//! Gemm, and FusedMatMul with its epilogue. f16/bf16 are widened to f32.
//!
//! Every op is lowered to one `Batch`: a list of 2-D products whose operands are strided
//! views into the input buffers. Transposes are swapped strides and broadcast batch
//! operands are repeated offsets, so no input is ever copied (except f16/bf16 widening).

use super::nt;
use crate::error::Result;
use crate::graph::infer::broadcast;
use crate::graph::Activation;
use crate::tensor::{numel, Float, Real, Tensor};
use num_traits::Zero;
use rayon::prelude::*;
use std::borrow::Cow;

/// Element strides of one 2-D operand: a transposed operand just swaps them.
#[derive(Clone, Copy, Debug)]
struct Strides {
    rs: isize,
    cs: isize,
}

impl Strides {
    /// A row-major `[rows, cols]` matrix, read transposed when `t`.
    fn of(cols: usize, t: bool) -> Strides {
        if t {
            Strides {
                rs: 1,
                cs: cols as isize,
            }
        } else {
            Strides {
                rs: cols as isize,
                cs: 1,
            }
        }
    }
}

/// `out[i] = A(a_off[i]) · B(b_off[i])` for each i; `out` is contiguous `[batch, m, n]`.
struct Batch {
    m: usize,
    n: usize,
    k: usize,
    a: Strides,
    b: Strides,
    a_off: Vec<usize>,
    b_off: Vec<usize>,
}

impl Batch {
    /// numpy `matmul` of `a` by `b` (or by `b` with its last two dims swapped).
    fn matmul(a: &[usize], b: &[usize], trans_b: bool) -> Result<Batch> {
        // 1-D operands are promoted to [1, K] and [K, 1]; the output is laid out the same
        // whether or not those dims are squeezed from its shape.
        let a: Vec<usize> = if a.len() == 1 {
            vec![1, a[0]]
        } else {
            a.to_vec()
        };
        let b: Vec<usize> = if b.len() == 1 {
            vec![b[0], 1]
        } else {
            b.to_vec()
        };
        let (ra, rb) = (a.len(), b.len());
        if ra < 2 || rb < 2 {
            crate::bail!(Runtime, "matmul of a scalar");
        }
        let (m, k) = (a[ra - 2], a[ra - 1]);
        let (n, b_str) = if trans_b {
            (b[rb - 2], Strides::of(k, true))
        } else {
            (b[rb - 1], Strides::of(b[rb - 1], false))
        };
        let (ab, bb) = (&a[..ra - 2], &b[..rb - 2]);
        let out = broadcast(ab, bb).ok_or_else(|| {
            crate::err!(
                Runtime,
                "matmul batch dims {ab:?} and {bb:?} do not broadcast"
            )
        })?;
        let mut p = Batch {
            m,
            n,
            k,
            a: Strides::of(k, false),
            b: b_str,
            a_off: batch_offsets(&out, ab, m * k),
            b_off: batch_offsets(&out, bb, k * n),
        };
        p.merge_tall();
        Ok(p)
    }

    /// A shared B under a contiguous batch of A is one tall product: [batch·M, K]·B
    /// (the common [B, S, K] @ [K, N] case), which gemm parallelises far better.
    fn merge_tall(&mut self) {
        let batch = self.a_off.len();
        let rows = self.m * self.a.rs as usize;
        if batch > 1
            && self.b_off.iter().all(|&o| o == self.b_off[0])
            && self
                .a_off
                .iter()
                .enumerate()
                .all(|(i, &o)| o == self.a_off[0] + i * rows)
        {
            self.m *= batch;
            self.a_off.truncate(1);
            self.b_off.truncate(1);
        }
    }
}

/// Offset (in elements) of each matrix of an operand with batch dims `inp`, broadcast to
/// the output batch dims `out` (numpy rules: size-1 and missing dims repeat).
fn batch_offsets(out: &[usize], inp: &[usize], mat: usize) -> Vec<usize> {
    let st = bcast_strides(inp, out, mat);
    (0..numel(out)).map(|i| offset_of(i, out, &st)).collect()
}

/// Element strides of `shape` broadcast to `out` (0 along repeated dims); `unit` is the
/// stride of its last dim.
fn bcast_strides(shape: &[usize], out: &[usize], unit: usize) -> Vec<usize> {
    let pad = out.len() - shape.len();
    let mut st = vec![0; out.len()];
    let mut s = unit;
    for i in (0..shape.len()).rev() {
        if shape[i] != 1 {
            st[pad + i] = s;
        }
        s *= shape[i];
    }
    st
}

/// Offset of the `i`-th element (row-major over `dims`) given per-dim strides.
fn offset_of(mut i: usize, dims: &[usize], st: &[usize]) -> usize {
    let mut off = 0;
    for d in (0..dims.len()).rev() {
        off += (i % dims[d]) * st[d];
        i /= dims[d];
    }
    off
}

/// A tensor broadcast to an output shape, read one output row (last dim) at a time.
struct RowView<'a, F: Clone> {
    data: Cow<'a, [F]>,
    rows: Vec<usize>,
    st: Vec<usize>,
}

impl<'a, F: Real> RowView<'a, F> {
    fn new<T: Float<Acc = F>>(t: &'a Tensor, out: &[usize]) -> RowView<'a, F> {
        let st = bcast_strides(t.shape(), out, 1);
        RowView {
            data: widen(t.as_slice::<T>()),
            rows: out[..out.len() - 1].to_vec(),
            st,
        }
    }
    /// Output row `r` of the broadcast view: its first element and the stride along it.
    fn row(&self, r: usize) -> (&[F], usize) {
        let last = self.st.len() - 1;
        (
            &self.data[offset_of(r, &self.rows, &self.st[..last])..],
            self.st[last],
        )
    }
}

/// The epilogue applied to each output row (global row index, values) before rounding.
type Epilogue<'a, F> = &'a (dyn Fn(usize, &mut [F]) + Sync);

/// `x` in its accumulation type: borrowed when it already is (f32, f64), widened otherwise.
pub(super) fn widen<T: Float>(x: &[T]) -> Cow<'_, [T::Acc]> {
    if let Some(x) = T::as_acc(x) {
        Cow::Borrowed(x)
    } else {
        Cow::Owned(
            x.par_iter()
                .with_min_len(1 << 14)
                .map(|v| v.to_acc())
                .collect(),
        )
    }
}

/// Runs `f` on `out` in the accumulation type: in place for f32/f64, else in scratch
/// rounded into `out` afterwards.
pub(super) fn fill_acc<T: Float>(out: &mut [T], f: impl FnOnce(&mut [T::Acc])) {
    match T::as_acc_mut(out) {
        Some(o) => f(o),
        None => {
            let mut acc = vec![<T::Acc as Zero>::zero(); out.len()];
            f(&mut acc);
            out.par_iter_mut()
                .zip(acc.par_iter())
                .with_min_len(1 << 14)
                .for_each(|(o, &a)| *o = T::from_acc(a));
        }
    }
}

/// Computes `scale · product`, then `epi` on each row, in the accumulation type; narrow
/// outputs (f16, bf16) are rounded once, at the end.
fn run<T: Float>(
    p: &Batch,
    a: &[T],
    b: &[T],
    scale: f64,
    out: &mut [T],
    epi: Option<Epilogue<T::Acc>>,
) {
    if out.is_empty() {
        return;
    }
    let (a, b) = (widen(a), widen(b));
    let n = p.n;
    let min_rows = (1 << 14) / n + 1;
    if let Some(o) = T::as_acc_mut(out) {
        products(p, &a, &b, scale, o);
        if let Some(f) = epi {
            o.par_chunks_mut(n)
                .enumerate()
                .with_min_len(min_rows)
                .for_each(|(r, row)| f(r, row));
        }
    } else {
        let mut acc = vec![<T::Acc as Zero>::zero(); out.len()];
        products(p, &a, &b, scale, &mut acc);
        acc.par_chunks_mut(n)
            .zip(out.par_chunks_mut(n))
            .enumerate()
            .with_min_len(min_rows)
            .for_each(|(r, (x, o))| {
                if let Some(f) = epi {
                    f(r, x);
                }
                for (o, &x) in o.iter_mut().zip(x.iter()) {
                    *o = T::from_acc(x);
                }
            });
    }
}

/// Below this many multiply-adds gemm stays on one thread, so a batch of such products
/// is spread over threads one product each instead.
const GEMM_THREADING: usize = 48 * 48 * 256;

fn products<F: Real>(p: &Batch, a: &[F], b: &[F], scale: f64, out: &mut [F]) {
    let (m, n, k) = (p.m, p.n, p.k);
    // Both operands K-contiguous in f32: dot products of rows (`nt`), where gemm would
    // pack B on every call.
    let nt = match (nt::f32s(a), nt::f32s(b)) {
        (Some(a), Some(b)) if k > 0 && nt::takes::<F>(p.a.cs, p.b.rs) => Some((a, b)),
        _ => None,
    };
    let one = |dst: &mut [F], ao: usize, bo: usize, par: bool| {
        debug_assert_eq!(dst.len(), m * n);
        if let (Some((a, b)), Some(dst)) = (nt, nt::f32s_mut(dst)) {
            let (a, b) = ((&a[ao..], p.a.rs as usize), (&b[bo..], p.b.cs as usize));
            let scale = scale as f32;
            return nt::product((m, n, k), a.0, a.1, b.0, b.1, scale, dst, n, false, par);
        }
        let par = if par {
            gemm::Parallelism::Rayon(0)
        } else {
            gemm::Parallelism::None
        };
        // SAFETY: inference checked the shapes, so every element the strides reach lies
        // inside `a`, `b` and `dst`; read_dst = false, so dst is only written.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_ptr().add(ao),
                p.a.cs,
                p.a.rs,
                b.as_ptr().add(bo),
                p.b.cs,
                p.b.rs,
                F::zero(),
                F::c(scale),
                false,
                false,
                false,
                par,
            )
        }
    };
    let batch = p.a_off.iter().zip(&p.b_off);
    if p.a_off.len() > 1 && m * n * k < GEMM_THREADING {
        out.par_chunks_mut(m * n)
            .zip(batch.collect::<Vec<_>>())
            .for_each(|(d, (&ao, &bo))| one(d, ao, bo, false));
    } else {
        for (d, (&ao, &bo)) in out.chunks_mut(m * n).zip(batch) {
            one(d, ao, bo, true);
        }
    }
}

fn not_float(t: &Tensor) -> Result<()> {
    crate::bail!(
        Runtime,
        "matrix products take floating tensors, got {}",
        t.dtype()
    )
}

pub fn matmul(a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()> {
    let p = Batch::matmul(a.shape(), b.shape(), false)?;
    crate::with_float!(a.dtype(), T => {
        run::<T>(&p, a.as_slice(), b.as_slice(), 1.0, out.as_mut_slice(), None);
        Ok(())
    }, _ => not_float(a))
}

/// ONNX Gemm: `alpha · op(A) · op(B) + beta · C`, C broadcast to `[M, N]`.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    a: &Tensor,
    b: &Tensor,
    c: Option<&Tensor>,
    alpha: f32,
    beta: f32,
    trans_a: bool,
    trans_b: bool,
    out: &mut Tensor,
) -> Result<()> {
    let (m, n) = (out.shape()[0], out.shape()[1]);
    let k = if trans_a { a.shape()[0] } else { a.shape()[1] };
    let p = Batch {
        m,
        n,
        k,
        a: Strides::of(a.shape()[1], trans_a),
        b: Strides::of(b.shape()[1], trans_b),
        a_off: vec![0],
        b_off: vec![0],
    };
    let shape = out.shape().to_vec();
    crate::with_float!(a.dtype(), T => {
        let beta = <T as Float>::Acc::c(beta as f64);
        let c = c.map(|c| RowView::new::<T>(c, &shape));
        let epi = |r: usize, row: &mut [<T as Float>::Acc]| {
            let (c, cs) = c.as_ref().unwrap().row(r);
            for (j, x) in row.iter_mut().enumerate() {
                *x += beta * c[j * cs];
            }
        };
        let epi: Option<Epilogue<_>> = if c.is_some() { Some(&epi) } else { None };
        run::<T>(&p, a.as_slice(), b.as_slice(), alpha as f64, out.as_mut_slice(), epi);
        Ok(())
    }, _ => not_float(a))
}

/// Applies `act` to a row in place. The match is outside the loop, so each arm is one
/// simple loop the compiler vectorises (a per-element match with a data-dependent branch
/// made the ReLU epilogue slower than a separate Relu node).
pub(super) fn activate_row<F: Real>(act: Activation, row: &mut [F]) {
    use super::elementwise::act as a;
    fn each<F: Copy>(row: &mut [F], f: impl Fn(F) -> F) {
        super::simd::vectorize(|| {
            for x in row {
                *x = f(*x);
            }
        })
    }
    match act {
        Activation::None => {}
        Activation::Relu => each(row, a::relu),
        Activation::Gelu => each(row, a::gelu),
        Activation::GeluTanh => each(row, a::gelu_tanh),
        Activation::Silu => each(row, a::silu),
        Activation::Sigmoid => each(row, a::sigmoid),
        Activation::Tanh => each(row, |v: F| v.tanh_v()),
        Activation::Relu6 => each(row, a::relu6),
    }
}

/// `g = g · act'(pre)` elementwise, the backward of `activate_row` (same loop structure).
fn activate_grad<F: Real>(act: Activation, g: &mut [F], pre: &[F]) {
    use super::elementwise::act as a;
    fn each<F: Copy>(g: &mut [F], pre: &[F], f: impl Fn(F, F) -> F) {
        super::simd::vectorize(|| {
            for (g, &v) in g.iter_mut().zip(pre) {
                *g = f(*g, v);
            }
        })
    }
    match act {
        Activation::None => {}
        Activation::Relu => each(g, pre, a::relu_grad),
        Activation::Gelu => each(g, pre, a::gelu_grad),
        Activation::GeluTanh => each(g, pre, a::gelu_tanh_grad),
        Activation::Silu => each(g, pre, a::silu_grad),
        Activation::Sigmoid => each(g, pre, a::sigmoid_grad),
        Activation::Tanh => each(g, pre, a::tanh_grad),
        Activation::Relu6 => each(g, pre, a::relu6_grad),
    }
}

/// `act(A @ op(B) + bias) + residual`, the epilogue applied in one pass over the product.
/// `outs` = [Y, (Pre)]: when the node asks for Pre = A @ op(B) + bias (what its backward
/// needs), the product goes to Pre and Y is computed from it in a second pass.
pub fn fused_matmul(
    a: &Tensor,
    b: &Tensor,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
    act: Activation,
    trans_b: bool,
    outs: &mut [Tensor],
) -> Result<()> {
    let p = Batch::matmul(a.shape(), b.shape(), trans_b)?;
    let (y, pre) = outs.split_at_mut(1);
    let y = &mut y[0];
    let shape = y.shape().to_vec();
    crate::with_float!(a.dtype(), T => {
        type F = <T as Float>::Acc;
        let bias = bias.map(|t| widen(t.as_slice::<T>()));
        let res = residual.map(|t| RowView::new::<T>(t, &shape));
        let add_bias = |row: &mut [F]| {
            if let Some(bias) = &bias {
                for (x, &b) in row.iter_mut().zip(bias.iter()) {
                    *x += b;
                }
            }
        };
        let finish = |r: usize, row: &mut [F]| {
            activate_row(act, row);
            if let Some((res, rs)) = res.as_ref().map(|v| v.row(r)) {
                for (j, x) in row.iter_mut().enumerate() {
                    *x += res[j * rs];
                }
            }
        };
        let (a, b) = (a.as_slice::<T>(), b.as_slice::<T>());
        match pre.first_mut() {
            None => {
                let epi = |r: usize, row: &mut [F]| {
                    add_bias(row);
                    finish(r, row);
                };
                let plain = bias.is_none() && res.is_none() && act == Activation::None;
                run::<T>(&p, a, b, 1.0, y.as_mut_slice(), if plain { None } else { Some(&epi) });
            }
            Some(pre) => {
                let epi = |_: usize, row: &mut [F]| add_bias(row);
                let pre = pre.as_mut_slice::<T>();
                run::<T>(&p, a, b, 1.0, pre, bias.is_some().then_some(&epi as Epilogue<F>));
                let n = p.n;
                if n > 0 {
                    y.as_mut_slice::<T>()
                        .par_chunks_mut(n)
                        .zip(pre.par_chunks(n))
                        .enumerate()
                        .with_min_len((1 << 14) / n + 1)
                        .for_each_init(Vec::new, |row: &mut Vec<F>, (r, (y, pre))| {
                            row.clear();
                            row.extend(pre.iter().map(|v| v.to_acc()));
                            finish(r, row);
                            for (y, &v) in y.iter_mut().zip(row.iter()) {
                                *y = T::from_acc(v);
                            }
                        });
                }
            }
        }
        Ok(())
    }, _ => not_float(a))
}

/// GatedMatMul: `Y = act(A·Bg + bias_g) · (A·Bu + bias_u)`; `outs` = [Y, (G), (U)] with
/// `want` saying which of G and U the graph reads. G is computed first; U's product then
/// takes the gate in its epilogue, row by row while the row is in cache, unless U is
/// asked for (training), when it is stored and the gate applied in a pass over both.
#[allow(clippy::too_many_arguments)]
pub fn gated_matmul(
    a: &Tensor,
    [bg, bu]: [&Tensor; 2],
    [bias_g, bias_u]: [Option<&Tensor>; 2],
    act: Activation,
    trans_b: bool,
    want: &[bool],
    outs: &mut [Tensor],
) -> Result<()> {
    let has = |i: usize| i < outs.len() && want.get(i).copied().unwrap_or(false);
    let (has_g, has_u) = (has(1), has(2));
    let (y, rest) = outs.split_at_mut(1);
    let y = &mut y[0];
    let (g_slot, u_slot) = rest.split_at_mut(rest.len().min(1));
    let mut g_own = None;
    let g = match g_slot.first_mut().filter(|_| has_g) {
        Some(g) => g,
        None => g_own.insert(Tensor::zeros(y.dtype(), y.shape())),
    };
    fused_matmul(
        a,
        bg,
        bias_g,
        None,
        Activation::None,
        trans_b,
        std::slice::from_mut(g),
    )?;
    let g = &*g;
    if has_u {
        let u = &mut u_slot[0];
        fused_matmul(
            a,
            bu,
            bias_u,
            None,
            Activation::None,
            trans_b,
            std::slice::from_mut(u),
        )?;
        return glu(act, g, u, y);
    }
    let p = Batch::matmul(a.shape(), bu.shape(), trans_b)?;
    crate::with_float!(a.dtype(), T => {
        type F = <T as Float>::Acc;
        let bias = bias_u.map(|t| widen(t.as_slice::<T>()));
        let gv = widen(g.as_slice::<T>());
        let n = p.n;
        let epi = |r: usize, row: &mut [F]| {
            if let Some(bias) = &bias {
                for (x, &b) in row.iter_mut().zip(bias.iter()) {
                    *x += b;
                }
            }
            gate_row(act, &gv[r * n..(r + 1) * n], row);
        };
        run::<T>(&p, a.as_slice::<T>(), bu.as_slice::<T>(), 1.0, y.as_mut_slice(), Some(&epi));
        Ok(())
    }, _ => not_float(a))
}

/// `u = act(g) · u` over one row, in chunks that stay in registers and L1.
fn gate_row<F: Real>(act: Activation, g: &[F], u: &mut [F]) {
    const C: usize = 64;
    let mut t = [F::zero(); C];
    for (uc, gc) in u.chunks_mut(C).zip(g.chunks(C)) {
        let t = &mut t[..uc.len()];
        t.copy_from_slice(gc);
        activate_row(act, t);
        for (u, &t) in uc.iter_mut().zip(t.iter()) {
            *u = *u * t;
        }
    }
}

/// `y = act(g) · u` elementwise (g, u and y of one shape).
fn glu(act: Activation, g: &Tensor, u: &Tensor, y: &mut Tensor) -> Result<()> {
    const CHUNK: usize = 1 << 14;
    crate::with_float!(g.dtype(), T => {
        let (gv, uv) = (widen(g.as_slice::<T>()), widen(u.as_slice::<T>()));
        y.as_mut_slice::<T>()
            .par_chunks_mut(CHUNK)
            .zip(gv.par_chunks(CHUNK).zip(uv.par_chunks(CHUNK)))
            .for_each(|(y, (g, u))| {
                let mut row = u.to_vec();
                gate_row(act, g, &mut row);
                for (y, &v) in y.iter_mut().zip(row.iter()) {
                    *y = T::from_acc(v);
                }
            });
        Ok(())
    }, _ => not_float(g))
}

/// GatedMatMulGrad: `(dY, G, U) → (dG, dU)` with `dG = dY·U·act'(G)` and `dU =
/// dY·act(G)`, one pass over the three.
pub fn gated_grad(
    act: Activation,
    dy: &Tensor,
    g: &Tensor,
    u: &Tensor,
    outs: &mut [Tensor],
) -> Result<()> {
    const CHUNK: usize = 1 << 14;
    let [dg, du] = outs else {
        crate::bail!(Runtime, "GatedMatMulGrad has two outputs, dG and dU");
    };
    crate::with_float!(g.dtype(), T => {
        let (dyv, gv, uv) = (
            widen(dy.as_slice::<T>()),
            widen(g.as_slice::<T>()),
            widen(u.as_slice::<T>()),
        );
        dg.as_mut_slice::<T>()
            .par_chunks_mut(CHUNK)
            .zip(du.as_mut_slice::<T>().par_chunks_mut(CHUNK))
            .zip(dyv.par_chunks(CHUNK).zip(gv.par_chunks(CHUNK).zip(uv.par_chunks(CHUNK))))
            .for_each(|((dg, du), (dy, (g, u)))| {
                // dU = dY·act(G).
                let mut t = dy.to_vec();
                gate_row(act, g, &mut t);
                for (o, &v) in du.iter_mut().zip(t.iter()) {
                    *o = T::from_acc(v);
                }
                // dG = (dY·U)·act'(G).
                for ((t, &d), &u) in t.iter_mut().zip(dy).zip(u) {
                    *t = d * u;
                }
                activate_grad(act, &mut t, g);
                for (o, &v) in dg.iter_mut().zip(t.iter()) {
                    *o = T::from_acc(v);
                }
            });
        Ok(())
    }, _ => not_float(g))
}

/// Measures this machine's f32 GEMM rate (GFLOP/s) on an n×n×n product: median of `iters`.
pub fn gemm_f32_gflops(n: usize, iters: usize) -> f64 {
    let p = Batch {
        m: n,
        n,
        k: n,
        a: Strides::of(n, false),
        b: Strides::of(n, false),
        a_off: vec![0],
        b_off: vec![0],
    };
    let a: Vec<f32> = (0..n * n).map(|i| (i % 17) as f32 * 0.125 - 1.0).collect();
    let b: Vec<f32> = (0..n * n).map(|i| (i % 13) as f32 * 0.25 - 1.5).collect();
    let mut out = vec![0f32; n * n];
    products(&p, &a, &b, 1.0, &mut out); // warm-up: thread pool, packing buffers
    let mut secs: Vec<f64> = (0..iters.max(1))
        .map(|_| {
            let t = std::time::Instant::now();
            products(&p, &a, &b, 1.0, &mut out);
            t.elapsed().as_secs_f64()
        })
        .collect();
    secs.sort_by(|x, y| x.total_cmp(y));
    2.0 * (n as f64).powi(3) / secs[secs.len() / 2].max(1e-12) / 1e9
}

/// FusedMatMul backward: outs = [dA, dB, (dBias), (dBiasA)]; `want[i]` false means not
/// read. With G = dY · act'(Pre): dA = G · op(B)ᵀ, dB = Aᵀ · G (Gᵀ · A when trans_b), each
/// summed over the batch entries that share the operand; dBias = Σ_rows G. With
/// `pre_a` = (PreA, act_a), dA leaves multiplied by act_a'(PreA) (still in f32/f64);
/// dBiasA = Σ_rows dA, summed before dA is rounded.
#[allow(clippy::too_many_arguments)]
pub fn fused_matmul_grad(
    dy: &Tensor,
    a: &Tensor,
    b: &Tensor,
    pre: Option<&Tensor>,
    act: Activation,
    trans_b: bool,
    pre_a: Option<(&Tensor, Activation)>,
    want: &[bool],
    outs: &mut [Tensor],
) -> Result<()> {
    if act != Activation::None && pre.is_none() {
        crate::bail!(
            Runtime,
            "FusedMatMulGrad with activation {} needs the forward's Pre (input 3)",
            act.name()
        );
    }
    let want = |i: usize| i < outs.len() && want.get(i).copied().unwrap_or(true);
    let want = [want(0), want(1), want(2), want(3)];
    if want[3] && !want[0] {
        crate::bail!(
            Runtime,
            "FusedMatMulGrad's dBiasA (output 3) needs dA (output 0)"
        );
    }
    let (sa, sb) = (a.shape(), b.shape());
    let (ra, rb) = (sa.len(), sb.len());
    if ra < 2 || rb < 2 {
        crate::bail!(
            Runtime,
            "FusedMatMulGrad takes A [..., M, K] and B [K, N] (or batched)"
        );
    }
    let (m, k) = (sa[ra - 2], sa[ra - 1]);
    let n = if trans_b { sb[rb - 2] } else { sb[rb - 1] };
    let (ab, bb) = (&sa[..ra - 2], &sb[..rb - 2]);
    let ob = broadcast(ab, bb).ok_or_else(|| {
        crate::err!(
            Runtime,
            "matmul batch dims {ab:?} and {bb:?} do not broadcast"
        )
    })?;
    let nb = numel(&ob);
    // Offsets of each output batch entry's matrix in G (contiguous), A and B.
    let g_off: Vec<usize> = (0..nb).map(|i| i * m * n).collect();
    let a_off = batch_offsets(&ob, ab, m * k);
    let b_off = batch_offsets(&ob, bb, k * n);
    crate::with_float!(a.dtype(), T => {
        let g = grad_pre::<T>(act, dy.as_slice(), pre.map(|t| t.as_slice()));
        let (av, bv) = (widen(a.as_slice::<T>()), widen(b.as_slice::<T>()));
        let (da, rest) = outs.split_at_mut(1);
        if want[0] {
            // [M, N] · op(B)ᵀ: B is stored [K, N] (read transposed) or [N, K] with trans_b.
            let p = Batch {
                m,
                n: k,
                k: n,
                a: Strides::of(n, false),
                b: if trans_b { Strides::of(k, false) } else { Strides::of(n, true) },
                a_off: g_off.clone(),
                b_off: b_off.clone(),
            };
            let mut sums = vec![];
            fill_acc(da[0].as_mut_slice::<T>(), |o| {
                products_into(p, &g, &bv, &a_off, o);
                if let Some((pa, act_a)) = pre_a {
                    const CHUNK: usize = 1 << 14;
                    o.par_chunks_mut(CHUNK)
                        .zip(widen(pa.as_slice::<T>()).par_chunks(CHUNK))
                        .for_each(|(g, p)| activate_grad(act_a, g, p));
                }
                if want[3] && k > 0 {
                    sums = column_sums(o, k);
                }
            });
            if want[3] {
                for (o, &v) in rest[2].as_mut_slice::<T>().iter_mut().zip(&sums) {
                    *o = T::from_acc(v);
                }
            }
        }
        if want[1] {
            // Aᵀ · G, of shape [K, N]; with trans_b Gᵀ · A, of shape [N, K].
            let (lhs, rhs, (lm, ln)) = if trans_b {
                (Strides::of(n, true), Strides::of(k, false), (n, k))
            } else {
                (Strides::of(k, true), Strides::of(n, false), (k, n))
            };
            let (l_off, r_off, l, r) = if trans_b {
                (g_off.clone(), a_off.clone(), &g, &av)
            } else {
                (a_off.clone(), g_off.clone(), &av, &g)
            };
            let p = Batch { m: lm, n: ln, k: m, a: lhs, b: rhs, a_off: l_off, b_off: r_off };
            fill_acc(rest[0].as_mut_slice::<T>(), |o| products_into(p, l, r, &b_off, o));
        }
        if want[2] && n > 0 {
            for (o, v) in rest[1].as_mut_slice::<T>().iter_mut().zip(column_sums(&g, n)) {
                *o = T::from_acc(v);
            }
        }
        Ok(())
    }, _ => not_float(a))
}

/// Σ over the rows of `x` seen as rows of `n` (a bias gradient).
fn column_sums<F: Real>(x: &[F], n: usize) -> Vec<F> {
    super::reduce::sum_rows(x.par_chunks(n), n, n, |acc: &mut [F], row| {
        acc.iter_mut().zip(row).for_each(|(a, &v)| *a = *a + v)
    })
}

/// G = dY · act'(Pre) in the accumulation type (dY itself, borrowed where it can be, when
/// there is no activation).
fn grad_pre<'a, T: Float>(act: Activation, dy: &'a [T], pre: Option<&[T]>) -> Cow<'a, [T::Acc]> {
    let g = widen(dy);
    let Some(pre) = pre.filter(|_| act != Activation::None) else {
        return g;
    };
    let mut g = g.into_owned();
    const CHUNK: usize = 1 << 14;
    g.par_chunks_mut(CHUNK)
        .zip(widen(pre).par_chunks(CHUNK))
        .for_each(|(g, p)| activate_grad(act, g, p));
    Cow::Owned(g)
}

/// Adds product i of `p` into the matrix at `dst_off[i]` of `dst` (which it overwrites).
/// A gradient of a broadcast operand sums several products into one matrix: done as one
/// product over a longer K where the operands continue along K (Aᵀ·G over all rows of a
/// batched A when B is 2-D), else through scratch.
fn products_into<F: Real>(mut p: Batch, lhs: &[F], rhs: &[F], dst_off: &[usize], dst: &mut [F]) {
    let (mn, batch) = (p.m * p.n, p.a_off.len());
    if mn == 0 {
        return;
    }
    if p.k == 0 || batch == 0 {
        dst.fill(F::zero());
        return;
    }
    if dst_off.iter().enumerate().all(|(i, &o)| o == i * mn) && dst.len() == batch * mn {
        // One product per destination matrix.
        p.merge_tall();
        return products(&p, lhs, rhs, 1.0, dst);
    }
    let step = |off: &[usize], st: isize| {
        off.iter()
            .enumerate()
            .all(|(i, &o)| o == off[0] + i * p.k * st as usize)
    };
    if dst.len() == mn && step(&p.a_off, p.a.cs) && step(&p.b_off, p.b.rs) {
        p.k *= batch;
        p.a_off.truncate(1);
        p.b_off.truncate(1);
        return products(&p, lhs, rhs, 1.0, dst);
    }
    let mut tmp = vec![F::zero(); batch * mn];
    products(&p, lhs, rhs, 1.0, &mut tmp);
    dst.fill(F::zero());
    for (t, &o) in tmp.chunks(mn).zip(dst_off) {
        dst[o..o + mn]
            .iter_mut()
            .zip(t)
            .for_each(|(d, &v)| *d = *d + v);
    }
}
