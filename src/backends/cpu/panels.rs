//! `Y = W·C` in f32 for a weight matrix W `[M, K]` read where it lies and columns C
//! `[K, N]` packed into panels of NP columns (`pack`): a convolution's product, whose
//! weights are the same on every call and whose columns are laid out per call anyway.
//! `gemm` would pack W on every call (and each task of a convolution calls it once), and
//! its columns a second time.
//!
//! A register tile is MR rows of W by one panel (NP = NV vectors): each step along K
//! broadcasts MR weights and multiplies them into the panel's NV vectors, so every load
//! feeds NV or MR multiply-adds. Rows of W are walked in tiles, panels inside, so a tile's
//! MR rows are read once from memory and then from cache for every panel.

use std::any::TypeId;

/// MR rows by NV vectors per register tile for a vector unit of `bytes` bytes: 32 × 512
/// bits hold 24 accumulators and the panel's 2 vectors; AVX2's 16 × 256 bits hold 12
/// and 2; NEON's 32 × 128 bits 16 and 2.
const fn tile(bytes: usize) -> (usize, usize) {
    match bytes {
        64.. => (12, 2),
        32 => (6, 2),
        _ => (8, 2),
    }
}

/// The register tile on this CPU as (MR, NP): rows of W and columns of a panel. `None`
/// where the kernel does not serve: no vector unit of 128 bits or more, a dtype other
/// than f32, or switched off (`--tune cpu_conv_panels=0`).
pub(super) fn shape<F: 'static>() -> Option<(usize, usize)> {
    struct Shape;
    impl pulp::WithSimd for Shape {
        type Output = (usize, usize);
        #[inline(always)]
        fn with_simd<S: pulp::Simd>(self, _: S) -> (usize, usize) {
            let bytes = std::mem::size_of::<S::f32s>();
            let (mr, nv) = tile(bytes);
            (mr, nv * S::F32_LANES)
        }
    }
    static SHAPE: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();
    (TypeId::of::<F>() == TypeId::of::<f32>()
        && super::nt::available()
        && crate::backends::tuning::tuning().cpu_conv_panels)
        .then(|| *SHAPE.get_or_init(|| pulp::Arch::new().dispatch(Shape)))
}

/// Packs the `[k, n]` matrix whose row r is `src[r·ld..][..n]`: its whole panels of `np`
/// columns into `packed` (panel p's row r is `packed[(p·k + r)·np..][..np]`) and the
/// columns past the last whole panel into `tail`, K-contiguous (column j's row r is
/// `tail[j·k + r]`).
pub(super) fn pack(
    src: &[f32],
    ld: usize,
    (k, n): (usize, usize),
    np: usize,
    packed: &mut Vec<f32>,
    tail: &mut Vec<f32>,
) {
    let full = n / np * np;
    packed.resize(full * k, 0.0);
    tail.resize((n - full) * k, 0.0);
    for p in 0..full / np {
        for (r, dst) in packed[p * k * np..][..k * np].chunks_exact_mut(np).enumerate() {
            dst.copy_from_slice(&src[r * ld + p * np..][..np]);
        }
    }
    for r in 0..k {
        for (j, &v) in src[r * ld + full..][..n - full].iter().enumerate() {
            tail[j * k + r] = v;
        }
    }
}

/// `out[i·ldo + j] = Σ_r w[i·ldw + r] · C[r, j]` for i < m, j < n, with C laid out by
/// [`pack`] in panels of the width [`shape`] gives and a K-contiguous tail. On the
/// calling thread.
///
/// # Panics
/// If a slice is shorter than the sizes and strides reach (checked once, up front).
#[allow(clippy::too_many_arguments)]
pub(super) fn product(
    (m, n, k): (usize, usize, usize),
    w: &[f32],
    ldw: usize,
    (packed, tail): (&[f32], &[f32]),
    out: &mut [f32],
    ldo: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    let (_, np) = shape::<f32>().expect("panels::product on a CPU the kernel does not serve");
    let full = n / np * np;
    assert!(w.len() >= (m - 1) * ldw + k && (m == 1 || ldw >= k));
    assert!(packed.len() >= full * k && tail.len() >= (n - full) * k);
    assert!(out.len() >= (m - 1) * ldo + n && (m == 1 || ldo >= n));
    pulp::Arch::new().dispatch(Product { m, n, k, w, ldw, packed, tail, out, ldo });
}

struct Product<'a> {
    m: usize,
    n: usize,
    k: usize,
    w: &'a [f32],
    ldw: usize,
    packed: &'a [f32],
    tail: &'a [f32],
    out: &'a mut [f32],
    ldo: usize,
}

impl pulp::WithSimd for Product<'_> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, simd: S) {
        match tile(std::mem::size_of::<S::f32s>()) {
            (12, 2) => self.tiles::<S, 12, 2>(simd),
            (6, 2) => self.tiles::<S, 6, 2>(simd),
            _ => self.tiles::<S, 8, 2>(simd),
        }
    }
}

impl Product<'_> {
    #[inline(always)]
    fn tiles<S: pulp::Simd, const MR: usize, const NV: usize>(self, simd: S) {
        let (m, n, lanes) = (self.m, self.n, S::F32_LANES);
        let np = NV * lanes;
        let full = n / np * np;
        for i0 in (0..m).step_by(MR) {
            // A tile at W's edge repeats its last row (computed, not stored), so that
            // every tile runs the same unrolled code.
            let rows: [usize; MR] = std::array::from_fn(|t| (i0 + t).min(m - 1));
            for p in 0..full / np {
                // SAFETY: `product` checked that rows < m of W and the panels lie inside
                // their slices.
                let acc = unsafe { self.tile::<S, MR, NV>(simd, rows, p) };
                for (t, acc) in acc.iter().enumerate().take(m - i0) {
                    let o = &mut self.out[(i0 + t) * self.ldo + p * np..][..np];
                    for (v, a) in acc.iter().enumerate() {
                        // SAFETY: the vector lies inside the panel's columns of the row.
                        unsafe {
                            std::ptr::write_unaligned(o[v * lanes..].as_mut_ptr() as *mut S::f32s, *a)
                        }
                    }
                }
            }
            // The tail's columns while the tile's rows are in cache.
            if full < n {
                // SAFETY: as above, and each tail column holds K entries.
                let dots = unsafe { self.dots::<S, MR>(simd, rows, n - full) };
                for (t, d) in dots.chunks_exact(n - full).enumerate().take(m - i0) {
                    self.out[(i0 + t) * self.ldo + full..][..n - full].copy_from_slice(d);
                }
            }
        }
    }

    /// Rows `rows` of W dotted with the `cols` tail columns, as `[MR, cols]`: vectors
    /// along K, in chunks of K whose rows of W stay in the L1 cache while every column
    /// passes them; partial sums kept as vectors, summed across lanes at the end.
    ///
    /// # Safety
    /// Each row must hold K elements inside W, and the tail `cols` columns of K.
    #[inline(always)]
    unsafe fn dots<S: pulp::Simd, const MR: usize>(
        &self,
        simd: S,
        rows: [usize; MR],
        cols: usize,
    ) -> Vec<f32> {
        /// Entries of K a chunk takes: MR rows of it stay in L1 with a column's.
        const KC: usize = 256;
        let (k, lanes) = (self.k, S::F32_LANES);
        let mut pw = [self.w.as_ptr(); MR];
        for (ptr, &r) in pw.iter_mut().zip(&rows) {
            *ptr = ptr.add(r * self.ldw);
        }
        let zero = simd.splat_f32s(0.0);
        // Columns in pairs (an odd last one paired with itself): each load of W then
        // feeds two multiply-adds.
        let mut sums = vec![[[zero; MR]; 2]; cols.div_ceil(2)];
        let mut k0 = 0;
        while k0 < k {
            let k1 = (k0 + KC).min(k);
            let whole = k0 + (k1 - k0) / lanes * lanes;
            for (j, sum) in sums.iter_mut().enumerate() {
                // In registers while the chunk runs (through the reference LLVM would
                // store them on every step: it cannot rule out that W's reads alias).
                let mut acc = *sum;
                let c0 = self.tail.as_ptr().add(2 * j * k);
                let c1 = self.tail.as_ptr().add((2 * j + 1).min(cols - 1) * k);
                for kk in (k0..whole).step_by(lanes) {
                    let c = [
                        std::ptr::read_unaligned(c0.add(kk) as *const S::f32s),
                        std::ptr::read_unaligned(c1.add(kk) as *const S::f32s),
                    ];
                    for t in 0..MR {
                        let a = std::ptr::read_unaligned(pw[t].add(kk) as *const S::f32s);
                        acc[0][t] = simd.mul_add_e_f32s(a, c[0], acc[0][t]);
                        acc[1][t] = simd.mul_add_e_f32s(a, c[1], acc[1][t]);
                    }
                }
                if whole < k1 {
                    let rest = k1 - whole;
                    let c = [
                        simd.partial_load_f32s(std::slice::from_raw_parts(c0.add(whole), rest)),
                        simd.partial_load_f32s(std::slice::from_raw_parts(c1.add(whole), rest)),
                    ];
                    for t in 0..MR {
                        let a = simd.partial_load_f32s(std::slice::from_raw_parts(pw[t].add(whole), rest));
                        acc[0][t] = simd.mul_add_e_f32s(a, c[0], acc[0][t]);
                        acc[1][t] = simd.mul_add_e_f32s(a, c[1], acc[1][t]);
                    }
                }
                *sum = acc;
            }
            k0 = k1;
        }
        let mut out = vec![0.0; MR * cols];
        for j in 0..cols {
            for t in 0..MR {
                out[t * cols + j] = simd.reduce_sum_f32s(sums[j / 2][j % 2][t]);
            }
        }
        out
    }

    /// Rows `rows` of W times panel `p`. The accumulators are vector registers (pulp's
    /// types, not arrays of f32, which LLVM keeps in memory). Plain loops, no closures: a
    /// closure is compiled as its own function, outside the vector instruction set.
    ///
    /// # Safety
    /// Each row must hold K elements inside W, and panel p inside the packed columns.
    #[inline(always)]
    unsafe fn tile<S: pulp::Simd, const MR: usize, const NV: usize>(
        &self,
        simd: S,
        rows: [usize; MR],
        p: usize,
    ) -> [[S::f32s; NV]; MR] {
        let (k, lanes) = (self.k, S::F32_LANES);
        let np = NV * lanes;
        let mut pw = [self.w.as_ptr(); MR];
        for (ptr, &r) in pw.iter_mut().zip(&rows) {
            *ptr = ptr.add(r * self.ldw);
        }
        let mut pc = self.packed.as_ptr().add(p * k * np);
        let zero = simd.splat_f32s(0.0);
        let mut acc = [[zero; NV]; MR];
        let mut c = [zero; NV];
        for r in 0..k {
            for (v, c) in c.iter_mut().enumerate() {
                *c = std::ptr::read_unaligned(pc.add(v * lanes) as *const S::f32s);
            }
            for t in 0..MR {
                let a = simd.splat_f32s(*pw[t].add(r));
                for v in 0..NV {
                    acc[t][v] = simd.mul_add_e_f32s(a, c[v], acc[t][v]);
                }
            }
            pc = pc.add(np);
        }
        acc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every size at and around the tile, panel and vector edges, against a float64 loop.
    #[test]
    fn panel_products_match_a_direct_loop() {
        let Some((mr, np)) = shape::<f32>() else {
            eprintln!("skipped: this CPU has no vector unit the panel kernel serves");
            return;
        };
        let mut seed = 11u64;
        let mut rnd = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        for (m, n, k) in [
            (1, 1, 1),
            (mr, np, 3),
            (mr + 1, np + 1, 17),
            (mr - 1, np - 1, 64),
            (3 * mr + 5, 2 * np + 7, 300),
            (70, 49, 576),
            (2, 200, 9),
        ] {
            let (ldw, ldc, ldo) = (k + 3, n + 5, n + 2);
            let w: Vec<f32> = (0..m * ldw).map(|_| rnd()).collect();
            let c: Vec<f32> = (0..k * ldc).map(|_| rnd()).collect();
            let (mut packed, mut tail) = (vec![f32::NAN; 3], vec![f32::NAN; 5]);
            pack(&c, ldc, (k, n), np, &mut packed, &mut tail);
            let mut out = vec![f32::NAN; m * ldo];
            product((m, n, k), &w, ldw, (&packed, &tail), &mut out, ldo);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|r| w[i * ldw + r] as f64 * c[r * ldc + j] as f64)
                        .sum();
                    let got = out[i * ldo + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{m}x{n}x{k} at ({i}, {j}): {got} vs {want}"
                    );
                }
                // The padding between rows is never written.
                assert!(out[i * ldo + n..(i + 1) * ldo].iter().all(|v| v.is_nan()));
            }
        }
    }
}

#[cfg(test)]
mod speed {
    #[test]
    #[ignore]
    fn panel_speed() {
        let Some((_, np)) = super::shape::<f32>() else { return };
        for (m, n, k) in [(320, 49, 320), (320, 64, 320), (320, 32, 320), (128, 49, 4608), (128, 64, 4608), (128, 32, 4608)] {
            let w: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32).collect();
            let c: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32).collect();
            let (mut packed, mut tail) = (vec![], vec![]);
            super::pack(&c, n, (k, n), np, &mut packed, &mut tail);
            let mut out = vec![0f32; m * n];
            let t = std::time::Instant::now();
            let reps = 200;
            for _ in 0..reps {
                super::product((m, n, k), &w, k, (&packed, &tail), &mut out, n);
            }
            let s = t.elapsed().as_secs_f64() / reps as f64;
            let t2 = std::time::Instant::now();
            for _ in 0..reps {
                super::pack(&c, n, (k, n), np, &mut packed, &mut tail);
            }
            let s2 = t2.elapsed().as_secs_f64() / reps as f64;
            eprintln!("{m}x{n}x{k}: {:.1} GFLOP/s one thread, pack {:.1} us", 2.0 * (m * n * k) as f64 / s / 1e9, s2 * 1e6);
        }
    }
}
