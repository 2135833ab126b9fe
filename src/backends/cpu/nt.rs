//! `C = A·Bᵀ` in f32 for a row-major A `[M, K]` and a B stored `[N, K]`: both operands
//! K-contiguous, as PyTorch's `nn.Linear` stores its weight and as the forward-only weight
//! layout (`passes::weight_layout`) writes it. Every output is a dot product of two
//! contiguous rows, so nothing is packed: a register tile of MR rows of A by NR rows of B
//! accumulates vector-wide partial sums along K, reduced across lanes once at the end.
//! `gemm` packs such a B (its rows are not contiguous along its own vector dimension)
//! on every call, which at a few hundred rows of A costs about as much as the product.
//!
//! Tasks are blocks of rows of A by blocks of rows of B, sized so that each thread gets
//! several and a block of B stays in cache while the rows of A stream past it.

use super::Shared;
use rayon::prelude::*;

/// Rows of A a task takes: its block of A (`MB × K`) stays in the L2 cache.
const MB: usize = 64;
/// Rows of B a task takes at most.
const NB: usize = 64;

/// Whether the dot-product kernel serves on this CPU (a vector unit of 128 bits or more;
/// without one `gemm` is as good).
pub(super) fn available() -> bool {
    struct Width;
    impl pulp::WithSimd for Width {
        type Output = usize;
        #[inline(always)]
        fn with_simd<S: pulp::Simd>(self, _: S) -> usize {
            if S::IS_SCALAR {
                0
            } else {
                std::mem::size_of::<S::f32s>()
            }
        }
    }
    static WIDTH: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *WIDTH.get_or_init(|| pulp::Arch::new().dispatch(Width)) >= 16
}

/// Whether the kernel takes a product of `F`s whose A has column stride `a_cs` and B row
/// stride `b_rs`: f32, both operands K-contiguous, a vector unit, and not switched off
/// (`--tune cpu_dot_products=0`).
pub(super) fn takes<F: 'static>(a_cs: isize, b_rs: isize) -> bool {
    std::any::TypeId::of::<F>() == std::any::TypeId::of::<f32>()
        && a_cs == 1
        && b_rs == 1
        && crate::backends::tuning::tuning().cpu_dot_products
        && available()
}

/// `x` as f32 when F is f32.
pub(super) fn f32s<F: 'static>(x: &[F]) -> Option<&[f32]> {
    // SAFETY: F is f32, so the slice is one of f32.
    (std::any::TypeId::of::<F>() == std::any::TypeId::of::<f32>())
        .then(|| unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), x.len()) })
}

/// `x` as f32 when F is f32.
pub(super) fn f32s_mut<F: 'static>(x: &mut [F]) -> Option<&mut [f32]> {
    // SAFETY: F is f32, so the slice is one of f32.
    (std::any::TypeId::of::<F>() == std::any::TypeId::of::<f32>())
        .then(|| unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast(), x.len()) })
}

/// `out[i·ldc + j] = scale · Σ_k a[i·lda + k] · b[j·ldb + k]` for i < m, j < n (added to
/// what `out` holds when `accumulate`), across threads when `par`.
///
/// # Panics
/// If a slice is shorter than the sizes and strides reach (checked once, up front).
#[allow(clippy::too_many_arguments)]
pub(super) fn product(
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    scale: f32,
    out: &mut [f32],
    ldc: usize,
    accumulate: bool,
    par: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    // A single row's stride is never used (a 1-D operand has a stride of 1).
    assert!(a.len() >= (m - 1) * lda + k && (m == 1 || lda >= k));
    assert!(b.len() >= (n - 1) * ldb + k && (n == 1 || ldb >= k));
    assert!(out.len() >= (m - 1) * ldc + n && (m == 1 || ldc >= n));
    let threads = if par { rayon::current_num_threads() } else { 1 };
    let mb = MB.min(m);
    // Narrower blocks of B where there are too few tasks to go round.
    let row_blocks = m.div_ceil(mb);
    let nb = (n.div_ceil((4 * threads).div_ceil(row_blocks)))
        .next_multiple_of(4)
        .clamp(4, NB);
    let tasks: Vec<(usize, usize)> = (0..row_blocks)
        .flat_map(|r| (0..n.div_ceil(nb)).map(move |c| (r * mb, c * nb)))
        .collect();
    let o = Shared(out.as_mut_ptr());
    let run = |&(i0, j0): &(usize, usize)| {
        let block = Block {
            a,
            lda,
            b,
            ldb,
            k,
            rows: (i0, (i0 + mb).min(m)),
            cols: (j0, (j0 + nb).min(n)),
            scale,
            out: o,
            ldc,
            accumulate,
        };
        pulp::Arch::new().dispatch(block);
    };
    if !par || tasks.len() == 1 || m * n * k < 1 << 15 {
        tasks.iter().for_each(run);
    } else {
        tasks.par_iter().for_each(run);
    }
}

/// One task: rows `rows` of A against rows `cols` of B.
struct Block<'a> {
    a: &'a [f32],
    lda: usize,
    b: &'a [f32],
    ldb: usize,
    k: usize,
    rows: (usize, usize),
    cols: (usize, usize),
    scale: f32,
    out: Shared<f32>,
    ldc: usize,
    accumulate: bool,
}

impl pulp::WithSimd for Block<'_> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, simd: S) {
        // Tiles by register file: 32 × 512 bits hold 16 accumulators and 8 operands; 16 ×
        // 256 bits hold 8 and 6; NEON's 32 × 128 bits hold 16 and 8.
        match std::mem::size_of::<S::f32s>() {
            64.. => self.tiles::<S, 4, 4>(simd),
            32 => self.tiles::<S, 2, 4>(simd),
            _ => self.tiles::<S, 4, 4>(simd),
        }
    }
}

impl Block<'_> {
    #[inline(always)]
    fn tiles<S: pulp::Simd, const MR: usize, const NR: usize>(&self, simd: S) {
        let (r0, r1) = self.rows;
        let (c0, c1) = self.cols;
        for j in (c0..c1).step_by(NR) {
            for i in (r0..r1).step_by(MR) {
                // A tile at the block's edge repeats its last row or column (computed,
                // not stored), so that every tile runs the same unrolled code.
                let ri: [usize; MR] = std::array::from_fn(|t| (i + t).min(r1 - 1));
                let cj: [usize; NR] = std::array::from_fn(|t| (j + t).min(c1 - 1));
                // SAFETY: `product` checked that rows < m and columns < n of A, B and
                // the output lie inside the slices.
                let sums = unsafe { self.tile::<S, MR, NR>(simd, ri, cj) };
                for (t, row) in sums.iter().enumerate().take(r1 - i) {
                    for (u, &v) in row.iter().enumerate().take(c1 - j) {
                        // SAFETY: as above; this task owns rows r0..r1 × columns c0..c1.
                        unsafe {
                            let o = self.out.ptr().add((i + t) * self.ldc + j + u);
                            *o = if self.accumulate {
                                *o + v * self.scale
                            } else {
                                v * self.scale
                            };
                        }
                    }
                }
            }
        }
    }

    /// The MR × NR dot products of rows `ri` of A with rows `cj` of B. The accumulators
    /// are vector registers (pulp's types, not arrays of f32, which LLVM keeps in memory
    /// and stores on every step). Plain loops, no closures: a closure is compiled as its
    /// own function, outside the vector instruction set, and its intrinsics become calls.
    ///
    /// # Safety
    /// Each row must hold K elements inside its slice.
    #[inline(always)]
    unsafe fn tile<S: pulp::Simd, const MR: usize, const NR: usize>(
        &self,
        simd: S,
        ri: [usize; MR],
        cj: [usize; NR],
    ) -> [[f32; NR]; MR] {
        let (k, lanes) = (self.k, S::F32_LANES);
        let mut pa = [self.a.as_ptr(); MR];
        for (p, &r) in pa.iter_mut().zip(&ri) {
            *p = p.add(r * self.lda);
        }
        let mut pb = [self.b.as_ptr(); NR];
        for (p, &c) in pb.iter_mut().zip(&cj) {
            *p = p.add(c * self.ldb);
        }
        let zero = simd.splat_f32s(0.0);
        let mut acc = [[zero; NR]; MR];
        let (mut av, mut bv) = ([zero; MR], [zero; NR]);
        let full = k / lanes * lanes;
        let mut kk = 0;
        while kk <= full {
            if kk < full {
                for t in 0..MR {
                    av[t] = std::ptr::read_unaligned(pa[t].add(kk) as *const S::f32s);
                }
                for t in 0..NR {
                    bv[t] = std::ptr::read_unaligned(pb[t].add(kk) as *const S::f32s);
                }
            } else if full < k {
                // The last K % lanes elements, zero-padded to a vector.
                for t in 0..MR {
                    av[t] =
                        simd.partial_load_f32s(std::slice::from_raw_parts(pa[t].add(kk), k - kk));
                }
                for t in 0..NR {
                    bv[t] =
                        simd.partial_load_f32s(std::slice::from_raw_parts(pb[t].add(kk), k - kk));
                }
            } else {
                break;
            }
            for i in 0..MR {
                for j in 0..NR {
                    acc[i][j] = simd.mul_add_e_f32s(av[i], bv[j], acc[i][j]);
                }
            }
            kk += lanes;
        }
        let mut sums = [[0f32; NR]; MR];
        for i in 0..MR {
            for j in 0..NR {
                sums[i][j] = simd.reduce_sum_f32s(acc[i][j]);
            }
        }
        sums
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every size at and around the tile and vector edges, against a float64 loop.
    #[test]
    fn dot_products_match_a_direct_loop() {
        let mut seed = 7u64;
        let mut rnd = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        for (m, n, k) in [
            (1, 1, 1),
            (3, 5, 7),
            (4, 4, 16),
            (5, 9, 17),
            (64, 64, 64),
            (65, 67, 100),
            (130, 70, 33),
            (7, 300, 784),
        ] {
            let (lda, ldb, ldc) = (k + 3, k + 1, n + 2);
            let a: Vec<f32> = (0..m * lda).map(|_| rnd()).collect();
            let b: Vec<f32> = (0..n * ldb).map(|_| rnd()).collect();
            let mut out = vec![f32::NAN; m * ldc];
            product((m, n, k), &a, lda, &b, ldb, 0.5, &mut out, ldc, false, true);
            // Accumulating adds the same again (on one thread: the same tiles).
            let mut twice = out.clone();
            product(
                (m, n, k),
                &a,
                lda,
                &b,
                ldb,
                0.5,
                &mut twice,
                ldc,
                true,
                false,
            );
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|t| a[i * lda + t] as f64 * b[j * ldb + t] as f64)
                        .sum::<f64>()
                        * 0.5;
                    let got = out[i * ldc + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{m}x{n}x{k} at ({i}, {j}): {got} vs {want}"
                    );
                }
                // The padding between rows is never written.
                assert!(out[i * ldc + n..(i + 1) * ldc].iter().all(|v| v.is_nan()));
            }
        }
        // One row and one column (1-D operands): their strides are 1 and never used.
        let (a, b) = ([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]);
        let mut out = [0f32];
        product((1, 1, 3), &a, 1, &b, 1, 1.0, &mut out, 1, false, true);
        assert_eq!(out[0], 32.0);
    }
}
